"""Plausible fakes of Lab 12's exercises: each gets the final numbers (or most of them) without
the mechanism the exercise is about. Sources replace the solution region, inside the function
body (4-space indent). The H100 prediction (a quiz) is computed with the student's time model,
so the fakes of that model that change its host-tier answer fail it too."""

import textwrap

from fakes import Alternative, Fake, edited, solution_region

# Red team rt11: every function of a library module saved (code, defaults) when the answer cell
# runs, before any check swaps the library's code, revived later in a copy of the module's
# namespace and run with the profile hook (which spots copies) switched off. Module-level text:
# it follows a fake's solution region, which ends its cell.
SNAPSHOT_PROFILE_OFF = """\


import inspect as _inspect
import sys as _sys
import types as _types


def _snapshot(module):
    saved = {}
    for name, value in vars(module).items():
        while hasattr(value, "__wrapped__"):
            value = value.__wrapped__
        if _inspect.isfunction(value) and value.__module__ == module.__name__:
            saved[name] = (value.__code__, value.__defaults__, value.__kwdefaults__)
    return saved


def _revive(module, saved):
    env = dict(vars(module))
    for name, (code, defaults, kwdefaults) in saved.items():
        function = _types.FunctionType(code, env, name, defaults)
        function.__kwdefaults__ = kwdefaults
        env[name] = function
    return env


def _unwatched(function, *args, **kwargs):
    before = _sys.getprofile()
    _sys.setprofile(None)
    try:
        return function(*args, **kwargs)
    finally:
        _sys.setprofile(before)
"""


# rt17's clip_parallel fakes: the honest sum, all-reduce and scaling after their own lines.
_CLIP_PARALLEL_REST = """\
    squared = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None or (id(p) in rep and not count_replicated):
            continue
        squared += p.grad.double().pow(2).sum()
    total = squared.reshape(1)
    collectives.all_reduce(total, op="sum", group=tp_group)
    collectives.all_reduce(total, op="sum", group=pp_group)
    norm = total.sqrt()[0].item()
    scale = min(1.0, max_norm / (norm + 1e-6))
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)
    return norm"""

# The NVMe state read straight from the store's files (red team rt8): not counted, not tracked.
_READ_AROUND = """\
    def read_around(name):  # the file read directly: not counted, not tracked as held
        shape, dtype = store.layout[name]
        with open(store.path(name), "rb") as file:
            return torch.frombuffer(bytearray(file.read()), dtype=dtype).view(shape)
"""


def _filled_but(torch_nn: str, fill: str) -> str:
    """materialize that resets every module but those of class torch.nn.`torch_nn`, which `fill`
    (code run with `module` bound, no grad) fills instead (red team rt8)."""
    return f"""\
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.{torch_nn}):
{textwrap.indent(fill, " " * 16)}
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return model"""


FAKES = {
    "impl-offload-hooks": [
        Fake("keeps the slices on the device",
             "no offload: the reduced slice becomes the host shard's gradient without crossing "
             "to the host (on a CPU laptop it still runs and trains the same)",
             checked_by=("test-offload-step",), source="""\
    for param, shard in zip(params, host_shards):
        def reduce_now(param, shard=shard):
            mine = collectives.reduce_scatter(param.grad.reshape(-1), impl="ring")
            mine = mine.float() / world_size
            shard.grad = mine if shard.grad is None else shard.grad + mine
            param.grad = None
        param.register_post_accumulate_grad_hook(reduce_now)"""),
        Fake("moves the whole gradient",
             "moves each whole gradient to the host and reduce-scatters it there: Ψ bytes "
             "instead of the Ψ/N slice",
             checked_by=("test-offload-step",), source="""\
    for param, shard in zip(params, host_shards):
        def offload_now(param, shard=shard):
            whole = offload.to_host(param.grad.reshape(-1))
            mine = collectives.reduce_scatter(whole, impl="ring").float() / world_size
            shard.grad = mine if shard.grad is None else shard.grad + mine
            param.grad = None
        param.register_post_accumulate_grad_hook(offload_now)"""),
        Fake("offloads at the step",
             "reduce-scatters during backward but keeps the slices on the device; they cross "
             "only when the step runs, after backward",
             checked_by=("test-offload-step",), source="""\
    for param, shard in zip(params, host_shards):
        def reduce_now(param, shard=shard):
            mine = collectives.reduce_scatter(param.grad.reshape(-1), impl="ring")
            pending = getattr(shard, "pending", None)
            shard.pending = mine if pending is None else pending + mine
            param.grad = None
        param.register_post_accumulate_grad_hook(reduce_now)"""),
        Fake("all-reduces, with a decoy reduce-scatter",
             "ZeRO-2's reduction: all-reduces each whole gradient and slices it locally, and "
             "reduce-scatters zeros so that the count of reduce-scatters looks right (twice "
             "the traffic)",
             checked_by=("test-offload-step",), source="""\
    def offload_now(param, shard):
        whole = param.grad.reshape(-1).clone()
        collectives.all_reduce(whole, op="sum", impl="ring")
        collectives.reduce_scatter(torch.zeros_like(whole), impl="ring")  # for the count
        param.grad = None
        mine = offload.to_host(whole[slice(*collectives.shard_bounds(whole.numel()))])
        mine = mine.float() / world_size
        shard.grad = mine if shard.grad is None else shard.grad + mine
    for param, shard in zip(params, host_shards):
        param.register_post_accumulate_grad_hook(lambda p, shard=shard: offload_now(p, shard))"""),
        Fake("the copy to the host for show",
             "reduce-scatters and calls offload.to_host so the bytes are counted, then throws the "
             "copy away: the host shard's gradient is the device-side slice (red team rt5, E1)",
             checked_by=("test-offload-step",), source="""\
    def make(shard):
        def hook(p):
            mine = collectives.reduce_scatter(p.grad.reshape(-1))
            p.grad = None
            offload.to_host(mine)  # counted, not used
            mine = mine.float().div_(world_size)
            if shard.grad is None:
                shard.grad = mine
            else:
                shard.grad.add_(mine)
        return hook
    for p, shard in zip(params, host_shards):
        p.register_post_accumulate_grad_hook(make(shard))"""),
        Fake("overwrites the host shard's gradient",
             "each arriving slice replaces its host shard's .grad instead of joining it: with "
             "several backwards per step (gradient accumulation) all but the last are lost (red "
             "team rt17, O1)",
             ('test-offload-step',), """\
    for index, p in enumerate(params):
        def hook(param, index=index):
            mine = collectives.reduce_scatter(param.grad.reshape(-1), impl="ring")
            host_shards[index].grad = offload.to_host(mine).float().div_(world_size)
            param.grad = None
        p.register_post_accumulate_grad_hook(hook)"""),
        Fake("whole gradients kept in a global list",
             "every whole gradient appended to a module-global list before its slice leaves "
             "(p.grad is None, so the parameters hold no gradient) (red team rt17, O2)",
             ('test-offload-step',), """\
    global _kept_whole_gradients
    _kept_whole_gradients = []
    for index, p in enumerate(params):
        def hook(param, index=index):
            _kept_whole_gradients.append(param.grad)
            mine = collectives.reduce_scatter(param.grad.reshape(-1), impl="ring")
            host = offload.to_host(mine).float().div_(world_size)
            shard = host_shards[index]
            shard.grad = host if shard.grad is None else shard.grad + host
            param.grad = None
        p.register_post_accumulate_grad_hook(hook)"""),
    ],
    "impl-offloaded-step": [
        Fake("steps on the device",
             "never moves the updated slices: all-gathers the host shards as they are",
             checked_by=("test-offload-step",), source="""\
    optimizer.step()
    for p, shard in zip(params, host_shards):
        p.copy_(collectives.all_gather(shard.to(p.dtype), p.numel(), impl="ring").view_as(p))"""),
        Fake("sends the fp32 master back",
             "moves the fp32 master slice to the device and casts there: 4 bytes per element "
             "cross instead of the parameters' 2 (bf16)",
             checked_by=("test-offload-step",), source="""\
    optimizer.step()
    for p, shard in zip(params, host_shards):
        mine = offload.to_device(shard, p.device).to(p.dtype)
        p.copy_(collectives.all_gather(mine, p.numel(), impl="ring").view_as(p))"""),
        Fake("updates a replica on the side",
             "steps the host shards for show, sends them to the device as junk of the right "
             "size, and copies into the parameters a whole replica updated by an AdamW of its "
             "own from the host shards' gradients, gathered",
             checked_by=("test-offload-step",), source="""\
    optimizer.step()
    if _TWINS.get("optimizer") is not optimizer:  # a new run: a new replica
        twins = [p.detach().clone().float().requires_grad_() for p in params]
        _TWINS.update(optimizer=optimizer, twins=twins,
                      replica=torch.optim.AdamW(twins, lr=optimizer.param_groups[0]["lr"]))
    for i, (p, twin) in enumerate(zip(params, _TWINS["twins"])):
        twin.grad = collectives.all_gather(host_shards[i].grad.float(), p.numel()).view_as(p)
    with torch.enable_grad():
        _TWINS["replica"].step()
    for p, shard, twin in zip(params, host_shards, _TWINS["twins"]):
        offload.to_device(shard.to(p.dtype), p.device)
        p.copy_(twin.detach().to(p.dtype))


_TWINS = {}"""),
        Fake("the copy back for show",
             "calls offload.to_device so the bytes are counted, throws the copy away and "
             "all-gathers the parameter straight from the host shard (red team rt5, E1)",
             checked_by=("test-offload-step",), source="""\
    optimizer.step()
    for p, shard in zip(params, host_shards):
        offload.to_device(shard.to(p.dtype), p.device)  # counted, not used
        p.copy_(collectives.all_gather(shard.detach().to(p.dtype), p.numel()).view_as(p))"""),
        Fake("AdamW by hand, the optimizer never steps",
             "the given optimizer never steps: adamw_step_ with the check's lr on the host shards,"
             " moments in a module-global dict (red team rt17, O11)",
             ('test-offload-step',), """\
    global _adam_state
    try:
        _adam_state
    except NameError:
        _adam_state = {}
    for p, s in zip(params, host_shards):
        m, v, n = _adam_state.get(id(s), (torch.zeros_like(s), torch.zeros_like(s), 0))
        n += 1
        adamw_step_(s.data, s.grad, m, v, n, lr=1e-2)
        _adam_state[id(s)] = (m, v, n)
        back = offload.to_device(s.to(p.dtype), p.device)
        full = collectives.all_gather(back, p.numel(), impl="ring")
        p.copy_(full.view_as(p))"""),
        Fake("a shadow AdamW steps, its state copied in (red team rt8)", "the optimizer handed "
             "in never steps; one of its own over the same shards does",
             ("test-offload-step",), edited(
                 solution_region("12_memory_beyond_the_gpu", "impl-offloaded-step"),
                 ("    optimizer.step()\n", """\
    shadows = offloaded_step.__dict__.setdefault("shadows", {})
    if id(optimizer) not in shadows:
        group = optimizer.param_groups[0]
        shadows[id(optimizer)] = torch.optim.AdamW(
            host_shards, lr=group["lr"], betas=group["betas"], eps=group["eps"],
            weight_decay=group["weight_decay"])
    shadows[id(optimizer)].step()
    for shard in host_shards:
        optimizer.state[shard] = shadows[id(optimizer)].state[shard]
"""))),
    ],
    "impl-step-time": [
        Fake("no overlap",
             "adds the whole gradient transfer, as if nothing overlapped backward",
             checked_by=("test-step-time", "test-h100_step_seconds"), source="""\
    per_rank = num_params / dp
    seconds = compute + 2 * per_rank / pcie_bandwidth + per_rank / optimizer_throughput
    if disk_read_bandwidth is not None:
        seconds += 12 * per_rank / disk_read_bandwidth + 12 * per_rank / disk_write_bandwidth
    return seconds + 2 * per_rank / pcie_bandwidth"""),
        Fake("forgets the way back",
             "counts the gradients' way to the host but not the parameters' way back",
             checked_by=("test-step-time", "test-h100_step_seconds"), source="""\
    per_rank = num_params / dp
    seconds = compute + max(0.0, 2 * per_rank / pcie_bandwidth - backward_share * compute)
    seconds += per_rank / optimizer_throughput
    if disk_read_bandwidth is not None:
        seconds += 12 * per_rank / disk_read_bandwidth + 12 * per_rank / disk_write_bandwidth
    return seconds"""),
        Fake("reads the state only",
             "the NVMe tier reads the optimizer state but the model forgets it is written back",
             checked_by=("test-step-time",), source="""\
    per_rank = num_params / dp
    seconds = compute + max(0.0, 2 * per_rank / pcie_bandwidth - backward_share * compute)
    seconds += per_rank / optimizer_throughput + 2 * per_rank / pcie_bandwidth
    if disk_read_bandwidth is not None:
        seconds += 12 * per_rank / disk_read_bandwidth
    return seconds"""),
        Fake("the library's model",
             "writes no model: returns minidist.costs.tiers.offload_step_time's total",
             checked_by=("test-step-time",), source="""\
    tier = "host" if disk_read_bandwidth is None else "nvme"
    times = tiers.offload_step_time(num_params, dp, compute, tier, pcie_bandwidth,
                                    optimizer_throughput, disk_read_bandwidth,
                                    disk_write_bandwidth, backward_share=backward_share)
    return float(times.total)"""),
        Fake("a private copy of the library's model",
             "writes no model: loads minidist/costs/tiers.py again with runpy and returns its "
             "offload_step_time's total (not the refused function object)",
             checked_by=("test-step-time",), source="""\
    import runpy
    copy = runpy.run_path(tiers.__file__, run_name="tiers_copy")
    tier = "host" if disk_read_bandwidth is None else "nvme"
    times = copy["offload_step_time"](num_params, dp, compute, tier, pcie_bandwidth,
                                      optimizer_throughput, disk_read_bandwidth,
                                      disk_write_bandwidth, backward_share=backward_share)
    return float(times.total)"""),
        Fake("the library's model, saved and run unwatched",
             "every function of minidist.costs.tiers saved when the cell runs, revived in a copy "
             "of the module's namespace and run with sys.setprofile(None) (red team rt11, B-st)",
             checked_by=("test-step-time",), source="""\
    env = _revive(tiers, _TIERS)
    tier = "host" if disk_read_bandwidth is None else "nvme"
    parts = _unwatched(env["offload_step_time"], num_params, dp, compute, tier, pcie_bandwidth,
                       optimizer_throughput, disk_read_bandwidth, disk_write_bandwidth,
                       backward_share=backward_share)
    return float(parts.compute + parts.to_host + parts.optimizer + parts.disk + parts.to_device)"""
             + SNAPSHOT_PROFILE_OFF + """
_TIERS = _snapshot(tiers)"""),
        Fake("backward_share hard-coded",
             "the backward_share argument ignored: the default 2/3 hard-coded (red team rt17, S2)",
             ('test-step-time',), """\
    shard = num_params / dp
    to_host = max(0.0, 2 * shard / pcie_bandwidth - 2 / 3 * compute)
    optimizer = shard / optimizer_throughput
    disk = 0.0
    if disk_read_bandwidth is not None and disk_write_bandwidth is not None:
        disk = 12 * shard / disk_read_bandwidth + 12 * shard / disk_write_bandwidth
    to_device = 2 * shard / pcie_bandwidth
    return float(compute + to_host + optimizer + disk + to_device)"""),
    ],
    "impl-nvme-step": [
        Fake("reads everything first",
             "reads every shard's state, then updates and writes them: the whole state in host "
             "memory at once, not shard by shard",
             checked_by=("test-nvme-step",), source="""\
    state = []
    for i, grad in enumerate(grads):
        master = store.read(f"{i}.master")
        moments = ([torch.zeros_like(master), torch.zeros_like(master)] if step == 1
                   else [store.read(f"{i}.exp_avg"), store.read(f"{i}.exp_avg_sq")])
        state.append((master, *moments))
    for i, ((master, exp_avg, exp_avg_sq), grad) in enumerate(zip(state, grads)):
        adamw_step_(master, grad, exp_avg, exp_avg_sq, step, lr=lr)
        store.write(f"{i}.master", master)
        store.write(f"{i}.exp_avg", exp_avg)
        store.write(f"{i}.exp_avg_sq", exp_avg_sq)"""),
        Fake("moments stay in memory",
             "writes only the master weights to disk; Adam's m and v stay in a dict in host "
             "memory between steps",
             checked_by=("test-nvme-step",), source="""\
    import builtins
    moments = builtins.__dict__.setdefault("_lab12_moments", {})
    for i, grad in enumerate(grads):
        master = store.read(f"{i}.master")
        if step == 1:
            moments[(id(store), i)] = (torch.zeros_like(master), torch.zeros_like(master))
        adamw_step_(master, grad, *moments[(id(store), i)], step, lr=lr)
        store.write(f"{i}.master", master)"""),
        Fake("forgets the moments",
             "reads and writes everything, but restarts Adam's moments from zero every step",
             checked_by=("test-nvme-step",), source="""\
    for i, grad in enumerate(grads):
        master = store.read(f"{i}.master")
        if step > 1:
            store.read(f"{i}.exp_avg"), store.read(f"{i}.exp_avg_sq")
        exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
        adamw_step_(master, grad, exp_avg, exp_avg_sq, step, lr=lr)
        store.write(f"{i}.master", master)
        store.write(f"{i}.exp_avg", exp_avg)
        store.write(f"{i}.exp_avg_sq", exp_avg_sq)"""),
        Fake("writes zeros for the moments",
             "keeps Adam's m and v in a dict and writes zeros of the right size in their "
             "place (reading them back only for the count); the master goes through the disk",
             checked_by=("test-nvme-step",), source="""\
    moments = _MOMENTS.setdefault(id(store), {})
    for i, grad in enumerate(grads):
        master = store.read(f"{i}.master")
        if step > 1:
            store.read(f"{i}.exp_avg"), store.read(f"{i}.exp_avg_sq")
        if step == 1 or i not in moments:
            moments[i] = (torch.zeros_like(master), torch.zeros_like(master))
        adamw_step_(master, grad, *moments[i], step, lr=lr)
        store.write(f"{i}.master", master)
        store.write(f"{i}.exp_avg", torch.zeros_like(master))
        store.write(f"{i}.exp_avg_sq", torch.zeros_like(master))
        del master


_MOMENTS = {}"""),
        Fake("keeps the state in memory",
             "keeps master, m and v in a dict keyed by the store: the files are read (and "
             "dropped) and written only so that the byte counts look like the disk tier's",
             checked_by=("test-nvme-step",), source="""\
    state = _CACHE.setdefault(id(store), {})
    for i, grad in enumerate(grads):
        names = [f"{i}.master"] + ([f"{i}.exp_avg", f"{i}.exp_avg_sq"] if step > 1 else [])
        for name in names:
            loaded = store.read(name)  # for the count only
            state.setdefault(name, loaded.clone())
            del loaded
        master = state[f"{i}.master"]
        exp_avg = state.setdefault(f"{i}.exp_avg", torch.zeros_like(master))
        exp_avg_sq = state.setdefault(f"{i}.exp_avg_sq", torch.zeros_like(master))
        adamw_step_(master, grad, exp_avg, exp_avg_sq, step, lr=lr)
        for name, t in ((f"{i}.master", master), (f"{i}.exp_avg", exp_avg),
                        (f"{i}.exp_avg_sq", exp_avg_sq)):
            store.write(name, t)


_CACHE = {}"""),
        Fake("the library's private NVMe tier",
             "builds zero_offload._NvmeSlices with __new__ around the given store and runs its "
             "step (red team rt5, N1)", checked_by=("test-nvme-step",), source="""\
    import types
    tier = zero_offload._NvmeSlices.__new__(zero_offload._NvmeSlices)
    tier.store, tier.steps = store, [step - 1] * len(grads)
    shards = [types.SimpleNamespace(grad=grad) for grad in grads]
    params = [torch.empty(0) for _ in grads]
    hyper = dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    tier.step(params, shards, hyper, lambda param, master: None)"""),
        Fake("the library's NVMe step, saved and run unwatched",
             "zero_offload._NvmeSlices.step's code object saved when the cell runs, run on a "
             "stand-in object with sys.setprofile(None) (red team rt11, C-nv)",
             checked_by=("test-nvme-step",), source="""\
    import sys
    import types
    me = types.SimpleNamespace(store=store, steps=[step - 1] * len(grads))
    shards = [types.SimpleNamespace(grad=grad) for grad in grads]
    params = [torch.empty(0)] * len(grads)
    hyper = dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    library_step = types.FunctionType(_STEP, vars(zero_offload))
    before = sys.getprofile()
    sys.setprofile(None)
    try:
        library_step(me, params, shards, hyper, lambda param, shard: None)
    finally:
        sys.setprofile(before)


_STEP = zero_offload._NvmeSlices.step.__code__"""),
        Fake("its own step counter",
             "the step argument ignored: steps counted per store in a module-global dict, from 1 "
             "(red team rt17, N6)",
             ('test-nvme-step',), """\
    global _step_counts
    try:
        _step_counts
    except NameError:
        _step_counts = {}
    mine = _step_counts[id(store)] = _step_counts.get(id(store), 0) + 1
    for i, grad in enumerate(grads):
        master = store.read(f"{i}.master")
        if mine == 1:
            exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
        else:
            exp_avg, exp_avg_sq = store.read(f"{i}.exp_avg"), store.read(f"{i}.exp_avg_sq")
        adamw_step_(master, grad, exp_avg, exp_avg_sq, mine, lr=lr)
        store.write(f"{i}.master", master)
        store.write(f"{i}.exp_avg", exp_avg)
        store.write(f"{i}.exp_avg_sq", exp_avg_sq)
        del master, exp_avg, exp_avg_sq"""),
        Fake("lr hard-coded",
             "the lr argument ignored: the default 1e-2 hard-coded (red team rt17, N8)",
             ('test-nvme-step',), """\
    for i, grad in enumerate(grads):
        master = store.read(f"{i}.master")
        if step == 1:
            exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
        else:
            exp_avg, exp_avg_sq = store.read(f"{i}.exp_avg"), store.read(f"{i}.exp_avg_sq")
        adamw_step_(master, grad, exp_avg, exp_avg_sq, step, lr=1e-2)
        store.write(f"{i}.master", master)
        store.write(f"{i}.exp_avg", exp_avg)
        store.write(f"{i}.exp_avg_sq", exp_avg_sq)
        del master, exp_avg, exp_avg_sq"""),
        # Red team rt8: the state read around the store.
        Fake("every shard's state read at once around the store (red team rt8)", "plain file "
             "reads hold the whole state; the store's reads only for the counts",
             ("test-nvme-step",), _READ_AROUND + """\
    names = ["master"] + (["exp_avg", "exp_avg_sq"] if step > 1 else [])
    state = [{n: read_around(f"{i}.{n}") for n in names} for i in range(len(grads))]
    for i, grad in enumerate(grads):
        for n in names:
            store.read(f"{i}.{n}")
        master = state[i]["master"]
        exp_avg = state[i].get("exp_avg", torch.zeros_like(master))
        exp_avg_sq = state[i].get("exp_avg_sq", torch.zeros_like(master))
        adamw_step_(master, grad, exp_avg, exp_avg_sq, step, lr=lr)
        store.write(f"{i}.master", master)
        store.write(f"{i}.exp_avg", exp_avg)
        store.write(f"{i}.exp_avg_sq", exp_avg_sq)"""),
        Fake("the master read thrice, the moments around the store (red team rt8)", "the right "
             "bytes counted, the wrong files: the moments never pass through the tier",
             ("test-nvme-step",), _READ_AROUND + """\
    for i, grad in enumerate(grads):
        master = store.read(f"{i}.master")
        if step > 1:
            store.read(f"{i}.master")
            store.read(f"{i}.master")
            exp_avg, exp_avg_sq = read_around(f"{i}.exp_avg"), read_around(f"{i}.exp_avg_sq")
        else:
            exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
        adamw_step_(master, grad, exp_avg, exp_avg_sq, step, lr=lr)
        store.write(f"{i}.master", master)
        store.write(f"{i}.exp_avg", exp_avg)
        store.write(f"{i}.exp_avg_sq", exp_avg_sq)"""),
    ],
    "impl-materialize": [
        Fake("the seed's recipe",
             "to_empty and nothing else: the parameters hold whatever the memory held",
             checked_by=("test-materialize",), source="""\
    return model.to_empty(device=device)"""),
        Fake("only the linear layers",
             "re-initialises nn.Linear but not the embeddings and LayerNorms",
             checked_by=("test-materialize",), source="""\
    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()
    return model"""),
        Fake("GPT-2 style normal init",
             "fills every parameter with N(0, 0.02), LayerNorms included",
             checked_by=("test-materialize",), source="""\
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
    return model"""),
        Fake("initialises each module whole, then distributes it",
             "each rank's shards only: every module with parameters gets whole, plain tensors, "
             "initialises them itself, and distribute_tensor cuts this rank's shard out (right "
             "values; each rank holds every whole parameter for a moment)",
             checked_by=("test-materialize",), source="""\
    from torch.distributed.tensor import distribute_tensor
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            own = dict(module.named_parameters(recurse=False))
            if not own or not hasattr(module, "reset_parameters"):
                continue
            for name, p in own.items():  # whole, plain tensors: the module initialises them
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, device=device))
            module.reset_parameters()
            for name, p in own.items():
                whole = module._parameters[name].detach()
                p.to_local().copy_(distribute_tensor(whole, p.device_mesh, p.placements).to_local())
                module._parameters[name] = p
    return model"""),
        Fake("initialises by the parameters' names",
             "never asks a module to initialise itself: fills each local shard by its name "
             "('norm': 1 and 0, 'emb': N(0, 1), else uniform in ±1/sqrt(fan_in)), the rules the "
             "visible check states",
             checked_by=("test-materialize",), source="""\
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            local = p.to_local()
            if "norm" in name:
                local.fill_(1.0 if name.endswith("weight") else 0.0)
            elif "emb" in name:
                local.normal_()
            else:
                weight = p if p.dim() == 2 else params[name.replace("bias", "weight")]
                bound = weight.shape[-1] ** -0.5
                local.uniform_(-bound, bound)
    return model"""),
        # Red team rt8: values inside the constructors' bounds, not their draws.
        Fake("linear layers at plus or minus their bound (red team rt8)", "random signs times "
             "1/sqrt(fan_in): the bounds and spread of a uniform draw, not its values",
             ("test-materialize",),
             _filled_but(torch_nn="Linear", fill="""\
bound = module.in_features ** -0.5
for p in module.parameters(recurse=False):
    local = p.to_local() if hasattr(p, "to_local") else p
    local.copy_((torch.randint(0, 2, local.shape) * 2 - 1).to(local.dtype) * bound)""")),
        Fake("linear layers from a truncated normal (red team rt8)", "std bound/2 cut at the "
             "bound, not the constructor's uniform draw", ("test-materialize",),
             _filled_but(torch_nn="Linear", fill="""\
bound = module.in_features ** -0.5
for p in module.parameters(recurse=False):
    local = p.to_local() if hasattr(p, "to_local") else p
    torch.nn.init.trunc_normal_(local, std=bound / 2, a=-bound, b=bound)""")),
        Fake("embeddings uniform with a std of 1 (red team rt8)", "uniform(-sqrt 3, sqrt 3) in "
             "place of N(0, 1)", ("test-materialize",),
             _filled_but(torch_nn="Embedding", fill="""\
weight = module.weight
local = weight.to_local() if hasattr(weight, "to_local") else weight
local.uniform_(-3 ** 0.5, 3 ** 0.5)""")),
    ],
    "impl-clip-sharded": [
        Fake("local norm only",
             "clips each rank's shards by their own norm: no collective",
             checked_by=("test-clip-sharded",), source="""\
    norm = torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale)
    return norm"""),
        Fake("adds the norms",
             "all-reduces the local norms instead of their squares",
             checked_by=("test-clip-sharded",), source="""\
    total = torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt().reshape(1)
    collectives.all_reduce(total, group=group)
    norm = total[0]
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale)
    return norm"""),
        Fake("gathers the gradient",
             "all-gathers every whole gradient to take the norm: right numbers, Ψ of traffic",
             checked_by=("test-clip-sharded",), source="""\
    pieces = [torch.cat(collectives.all_gather_object(g.reshape(-1), group=group)) for g in grads]
    norm = torch.cat(pieces).norm()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale)
    return norm"""),
        Fake("the norm through the store",
             "each rank's squared norm goes through the process group's key-value store, a side "
             "channel no traffic count sees; the one all-reduce carries a zero, for show "
             "(red team rt5, K2)", checked_by=("test-clip-sharded",), source="""\
    import torch.distributed.distributed_c10d as _c10d
    store = _c10d._get_default_store()
    rank, size = dist.get_rank(), dist.get_world_size()
    round_ = store.add(f"clip-round/{rank}", 1)
    mine = sum(float(g.double().pow(2).sum()) for g in grads if g is not None)
    store.set(f"clip{round_}/{rank}", repr(mine))
    total = sum(float(store.get(f"clip{round_}/{r}").decode()) for r in range(size))
    collectives.all_reduce(torch.zeros(1, dtype=torch.float64), group=group)  # for show
    norm = torch.tensor(total, dtype=torch.float64).sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        if g is not None:
            g.mul_(scale.to(g.dtype))
    return norm"""),
        Fake("the norm through files",
             "each rank's squared norm goes through files in /tmp; the one all-reduce carries "
             "the honest local square and serves as a barrier, and its result is ignored "
             "(red team rt11, A-cs)", checked_by=("test-clip-sharded",), source="""\
    import os
    import tempfile
    _CALLS[0] += 1
    port = os.environ.get("MASTER_PORT", "x")
    folder = os.path.join(tempfile.gettempdir(), f"fake-clip-{port}-{_CALLS[0]}")
    os.makedirs(folder, exist_ok=True)
    local = sum(g.double().pow(2).sum() for g in grads)
    with open(os.path.join(folder, f"{dist.get_rank(group)}.txt"), "w") as f:
        f.write(repr(float(local)))
    collectives.all_reduce(torch.tensor([float(local)], dtype=torch.float64), group=group)
    total = 0.0
    for r in range(dist.get_world_size(group)):
        with open(os.path.join(folder, f"{r}.txt")) as f:
            total += float(f.read())
    norm = torch.tensor(total, dtype=torch.float64).sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return norm


_CALLS = [0]"""),
        Fake("ignores the group",
             "the one all-reduce runs over the world whatever group it is given: right whenever "
             "the group is the world", checked_by=("test-clip-sharded",), source="""\
    total = torch.stack([g.float().pow(2).sum() for g in grads]).sum().reshape(1)
    collectives.all_reduce(total)
    norm = total.sqrt()[0]
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale)
    return norm"""),
    ],
    "impl-clip-parallel": [
        Fake("replicated counted t times",
             "every TP rank adds the replicated parameters' squares: they count t times",
             checked_by=("test-clip-parallel",), source="""\
    total = torch.zeros(1)
    for p in params:
        if p.grad is not None:
            total += p.grad.float().pow(2).sum()
    collectives.all_reduce(total, group=tp_group)
    collectives.all_reduce(total, group=pp_group)
    norm = total.sqrt()[0]
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)
    return norm"""),
        Fake("forgets the other stages",
             "sums over the tensor-parallel group only: each stage clips by its own norm",
             checked_by=("test-clip-parallel",), source="""\
    once = {id(p) for p in replicated}
    counts_replicated = dist.get_rank(tp_group) == 0
    total = torch.zeros(1)
    for p in params:
        if p.grad is not None and (counts_replicated or id(p) not in once):
            total += p.grad.float().pow(2).sum()
    collectives.all_reduce(total, group=tp_group)
    norm = total.sqrt()[0]
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)
    return norm"""),
        Fake("local norm only",
             "no collective: each rank clips its pieces by their own norm",
             checked_by=("test-clip-parallel",), source="""\
    total = sum(p.grad.float().pow(2).sum() for p in params if p.grad is not None)
    norm = total.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)
    return norm"""),
        Fake("one all-reduce over the world",
             "ignores tp_group and pp_group: one all-reduce over the world, which is tp x pp on "
             "the test's mesh (red team rt5, K1)", checked_by=("test-clip-parallel",), source="""\
    shared = {id(p) for p in replicated}
    first = dist.get_rank(tp_group) == 0
    squares = [p.grad.double().pow(2).sum() for p in params
               if p.grad is not None and (first or id(p) not in shared)]
    zero = torch.zeros((), dtype=torch.float64)
    total = (torch.stack(squares).sum() if squares else zero).reshape(1)
    collectives.all_reduce(total)
    norm = total.sqrt()[0]
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.dtype))
    return norm"""),
        Fake("the library's clipping, saved and run unwatched",
             "every function of minidist.parallel.clipping saved when the cell runs; its "
             "clip_grad_norm_ revived and run over (tp_group, pp_group) with sys.setprofile(None) "
             "(red team rt11, B-cp)", checked_by=("test-clip-parallel",), source="""\
    env = _revive(clipping, _CLIPPING)
    return _unwatched(env["clip_grad_norm_"], params, max_norm, group=(tp_group, pp_group),
                      replicated=replicated, replicated_group=tp_group)"""
             + SNAPSHOT_PROFILE_OFF + """
_CLIPPING = _snapshot(clipping)"""),
        Fake("TP rank 0 as world rank mod t",
             "counts the replicated parameters where the world rank is a multiple of t, right only"
             " for a mesh whose TP groups are consecutive ranks, not on the TP group's rank 0 (red"
             " team rt17, CP3)",
             ('test-clip-parallel',), """\
    rep = {id(p) for p in replicated}
    count_replicated = dist.get_rank() % dist.get_world_size(tp_group) == 0
""" + _CLIP_PARALLEL_REST),
        Fake("the notebook's MAX_NORM",
             "the max_norm argument ignored: the notebook's MAX_NORM global (red team rt17, CP10)",
             ('test-clip-parallel',), """\
    rep = {id(p) for p in replicated}
    count_replicated = dist.get_rank(tp_group) == 0
""" + _CLIP_PARALLEL_REST.replace("max_norm /", "MAX_NORM /")),
    ],
}

# --- Red team rt7 (issue 38): a copy across PCIe counted, then used only as 0 * copy (a NaN put
# into it still shows, a number does not); initialisations that draw nothing, or draw under a
# seed of their own; the norm taken from the notebook's own single-process clip. The checks now
# add a finite amount to every copy, materialize under two seeds, and clip a model drawn at
# grading time.
FAKES["impl-offload-hooks"].append(Fake(
    "the device's slice, the host copy times zero", "the averaged slice kept on the device; the "
    "copy sent to the host only as 0 * copy (red team rt7, H2)", ("test-offload-step",), """\
    def make(i):
        def hook(p):
            mine = collectives.reduce_scatter(p.grad.reshape(-1), impl="ring", when="gradients")
            host = offload.to_host(mine, "gradient shard")
            p.grad = None
            g = mine.float().div(world_size) + 0 * host.float()
            s = host_shards[i]
            s.grad = g if s.grad is None else s.grad + g
        return hook
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(make(i))"""))
FAKES["impl-offloaded-step"].append(Fake(
    "the host shard gathered, the copy back times zero", "the parameters rebuilt from the host "
    "shard; the copy to the device only as 0 * copy (red team rt7, S2)", ("test-offload-step",),
    """\
    optimizer.step()
    for p, s in zip(params, host_shards):
        back = offload.to_device(s.to(p.dtype), p.device, "parameter shard")
        piece = s.to(p.dtype) + 0 * back
        full = collectives.all_gather(piece, p.numel(), impl="ring", when="parameters")
        p.copy_(full.view_as(p))"""))
FAKES["impl-materialize"] += [
    Fake("quantiles, nothing drawn", "Linear, Embedding and LayerNorm filled in place with "
         "deterministic quantiles of their distributions (red team rt7, M3b)",
         ("test-materialize",), """\
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            own = list(module.named_parameters(recurse=False))
            if not own:
                continue
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm)):
                for name, p in own:
                    local = p.to_local() if hasattr(p, "to_local") else p
                    n = local.numel()
                    if n == 0:
                        continue
                    if isinstance(module, torch.nn.LayerNorm):
                        local.fill_(1.0 if name == "weight" else 0.0)
                        continue
                    flat = local.view(-1)
                    torch.arange(n, out=flat)
                    flat.add_(0.5).div_(n)
                    if isinstance(module, torch.nn.Embedding):
                        torch.special.ndtri(flat, out=flat)
                    else:
                        flat.mul_(2).sub_(1).mul_(module.weight.shape[-1] ** -0.5)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return model"""),
    Fake("a seed of its own", "every module re-initialised, under one fixed seed whatever the "
         "caller set (red team rt7, M4)", ("test-materialize",), """\
    model.to_empty(device=device)
    torch.manual_seed(1234)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return model"""),
]
FAKES["impl-clip-parallel"].append(Fake(
    "the notebook's single-process clip", "the norm from the test cell's single_process_clip; "
    "the tp and pp all-reduces carry ones, their result used as a scale (red team rt7, P3)",
    ("test-clip-parallel",), """\
    total = torch.ones(1)
    collectives.all_reduce(total, group=tp_group, when="gradient norm")
    collectives.all_reduce(total, group=pp_group, when="gradient norm")
    size = dist.get_world_size(tp_group) * dist.get_world_size(pp_group)
    with torch.enable_grad():
        base = single_process_clip(max_norm)[0]
    norm = torch.tensor(base) * torch.sqrt(total[0] / size)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.dtype))
    return norm"""))

ALTERNATIVES = {
    "impl-clip-parallel": [
        Alternative("no epsilon in the scale",
                    "scales by max_norm / norm (capped at 1), where clip_grad_norm_ divides by "
                    "norm + 1e-6: a factor 2e-6 apart (relative) here, which 'like "
                    "clip_grad_norm_' allows; the factors are checked to a relative 1e-5, not to "
                    "6 decimals (0.080763 against 0.080762 here)",
                    ("test-clip-parallel",), """\
    once = {id(p) for p in replicated}
    counts_replicated = dist.get_rank(tp_group) == 0
    total = torch.zeros(1)
    for p in params:
        if p.grad is not None and (counts_replicated or id(p) not in once):
            total += p.grad.float().pow(2).sum()
    collectives.all_reduce(total, group=tp_group)
    collectives.all_reduce(total, group=pp_group)
    norm = total.sqrt()[0]
    scale = torch.clamp(max_norm / norm, max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)
    return norm"""),
    ],
}
