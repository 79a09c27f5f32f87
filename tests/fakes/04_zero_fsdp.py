"""Fakes of Lab 04's exercises: ZeRO's and FSDP's numbers without their memory or their
communication pattern."""

import textwrap

from fakes import Alternative, Fake, edited, solution_region


def indented(body: str, indent: int) -> str:
    """`body` indented as its solution region is."""
    return textwrap.indent(body, " " * indent).rstrip("\n")


ZERO2_STEP = """\
optimizer.step()
for p, shard in zip(params, shards):
    p.copy_(collectives.all_gather(shard, p.numel(), impl="ring").view_as(p))
"""

KEEPS_WHOLE_GRADIENTS = """\
buffers = [torch.zeros_like(param) for param in params]  # whole gradients, reused every step
for param, shard, buffer in zip(params, shards, buffers):
    def reduce_scatter_now(param, shard=shard, buffer=buffer):
        buffer.copy_(param.grad)
        mine = collectives.reduce_scatter(buffer.reshape(-1), impl="ring") / world_size
        shard.grad = mine if shard.grad is None else shard.grad + mine
        param.grad = None
    param.register_post_accumulate_grad_hook(reduce_scatter_now)
"""

SETS_SHARD_GRAD = """\
for param, shard in zip(params, shards):
    def reduce_scatter_now(param, shard=shard):
        shard.grad = collectives.reduce_scatter(param.grad.reshape(-1), impl="ring") / world_size
        param.grad = None
    param.register_post_accumulate_grad_hook(reduce_scatter_now)
"""

BACKWARD = """\
grad = collectives.reduce_scatter(grad_full.contiguous(), impl="ring")
free(unit)
unit.full = None
return grad.float() / dist.get_world_size(), None, None
"""

BACKWARD_ALL_REDUCE = """\
summed = collectives.all_reduce(grad_full.contiguous(), impl="ring")
start, end = collectives.shard_bounds(unit.numel)
free(unit)
unit.full = None
return summed[start:end].float() / dist.get_world_size(), None, None
"""

ALL_GATHER_PARAMS = """\
return collectives.all_gather(unit.shard.detach().to(unit.compute_dtype), unit.numel,
                              impl="ring", async_op=async_op)
"""

GATHER = """\
if unit.prefetched is not None:
    full, unit.prefetched = unit.prefetched.wait(), None
else:
    full = all_gather_params(unit)
if unit.full is None:
    unit.full = GatherParams.apply(unit.shard, full, unit)
    pieces = unit.full.split([shape.numel() for _, _, shape in unit.slots])
    for (owner, name, shape), piece in zip(unit.slots, pieces):
        setattr(owner, name, piece.view(shape))
else:
    unit.full.untyped_storage().resize_(unit.numel * unit.full.element_size())
    unit.full.data.copy_(full)
"""

FREE = """\
unit.full.untyped_storage().resize_(0)
"""

BACKWARD_SUM = """\
grad = collectives.reduce_scatter(grad_full.contiguous(), impl="ring")
free(unit)
unit.full = None
return grad.float(), None, None  # the sum over the ranks, not their average
"""

STEP_REDUCE_SCATTERS = """\
for p, shard in zip(params, shards):  # the whole gradients were kept: reduce-scatter them now
    shard.grad = collectives.reduce_scatter(p.grad.reshape(-1), impl="ring") / dist.get_world_size()
    p.grad = None
optimizer.step()
for p, shard in zip(params, shards):
    p.copy_(collectives.all_gather(shard, p.numel(), impl="ring").view_as(p))
"""

FREE_DROPS_VIEWS = """\
for owner, name, _ in unit.slots:  # drop the module's views of the gathered vector
    owner.__dict__.pop(name, None)
"""


def gather_free(backward: str, free: str) -> tuple[str, ...]:
    """The four regions of the gather/free cell: GatherParams.backward, all_gather_params,
    gather, free."""
    return (indented(backward, 8), indented(ALL_GATHER_PARAMS, 4), indented(GATHER, 4),
            indented(free, 4))


PREFETCH = """\
gather(units[{i}])
if prefetch and 0 <= {j} < len(units) and units[{j}].prefetched is None:
    units[{j}].prefetched = all_gather_params(units[{j}], async_op=True)
"""

AFTER_FORWARD = """\
free(units[i])
output.register_hook(lambda grad: before_backward(i))
"""

WAITS_AT_ONCE = """\
gather(units[{i}])
if prefetch and 0 <= {j} < len(units) and units[{j}].prefetched is None:
    handle = all_gather_params(units[{j}], async_op=True)
    handle.wait()  # make sure it has arrived before going on
    units[{j}].prefetched = handle
"""

FREES_ONE_LATE = """\
if not prefetch:
    free(units[i])
else:  # two units held, as with prefetch: free the one before
    if i > 0:
        free(units[i - 1])
    if i == len(units) - 1:
        free(units[i])
output.register_hook(lambda grad: before_backward(i))
"""

PREFETCHES_AGAIN = """\
gather(units[{i}])
if prefetch and 0 <= {j} < len(units):  # no check whether a prefetch is there already
    units[{j}].prefetched = all_gather_params(units[{j}], async_op=True)
"""


def hooks(forward: str, after: str, backward: str) -> tuple[str, ...]:
    """The three regions of the hooks cell: before_forward, after_forward, before_backward."""
    return (indented(forward, 8), indented(after, 8), indented(backward, 8))


SCHEDULE = """\
n, last = world_size, len(unit_params) - 1
moved = [(n - 1) / n * bytes_per_element * p / link_bytes_per_s for p in unit_params]
forward = [2 * p * tokens / flops_per_s for p in unit_params]
{forward}
ready = run_on("link", "all_gather", last, free["compute"], moved[last])
for unit in reversed(range(last + 1)):
    start = max(free["compute"], ready)
    if prefetch and unit > 0:
        upcoming = run_on("link", "all_gather", unit - 1, start, moved[unit - 1])
    end = run_on("compute", "backward", unit, ready, 2 * forward[unit])
    run_on("link", "reduce_scatter", unit, end, moved[unit])
    if not prefetch and unit > 0:
        upcoming = run_on("link", "all_gather", unit - 1, end, moved[unit - 1])
    if unit > 0:
        ready = upcoming
"""

FORWARD_WITHOUT_PREFETCH = """\
ready = run_on("link", "all_gather", 0, 0.0, moved[0])
for unit in range(last + 1):
    end = run_on("compute", "forward", unit, ready, forward[unit])
    if unit < last:  # issued when the unit is done, whatever prefetch says
        ready = run_on("link", "all_gather", unit + 1, end, moved[unit + 1])"""

FORWARD_ALL_UP_FRONT = """\
gathered = [run_on("link", "all_gather", unit, 0.0, moved[unit]) for unit in range(last + 1)]
for unit in range(last + 1):  # every gather issued at once: the link never waits
    run_on("compute", "forward", unit, gathered[unit], forward[unit])"""

KEEPS_FOR_BACKWARD = """\
n, last = world_size, len(unit_params) - 1
moved = [(n - 1) / n * bytes_per_element * p / link_bytes_per_s for p in unit_params]
forward = [2 * p * tokens / flops_per_s for p in unit_params]
ready = run_on("link", "all_gather", 0, 0.0, moved[0])
for unit in range(last + 1):
    start = max(free["compute"], ready)
    end = run_on("compute", "forward", unit, ready, forward[unit])
    if unit < last:
        ready = run_on("link", "all_gather", unit + 1, start if prefetch else end, moved[unit + 1])
for unit in reversed(range(last + 1)):  # parameters kept from forward: no second gather
    end = run_on("compute", "backward", unit, 0.0, 2 * forward[unit])
    run_on("link", "reduce_scatter", unit, end, moved[unit])
"""

# Correct, though not the solution's order of calls: each prefetch is issued before the compute
# it overlaps, in forward as in backward. Each lane runs the same things at the same times; only
# the list's order across lanes differs, which the spec leaves open.
PREFETCH_FIRST = SCHEDULE.format(forward="""\
ready = run_on("link", "all_gather", 0, 0.0, moved[0])
for unit in range(last + 1):
    start = max(free["compute"], ready)
    if prefetch and unit < last:
        upcoming = run_on("link", "all_gather", unit + 1, start, moved[unit + 1])
    end = run_on("compute", "forward", unit, ready, forward[unit])
    if not prefetch and unit < last:
        upcoming = run_on("link", "all_gather", unit + 1, end, moved[unit + 1])
    if unit < last:
        ready = upcoming""")

FSDP_CELLS = ("test-fsdp", "test-fsdp-vs-torch", "test-mixed-precision")

# Red team rt8: free copies the unit into a pool made once (out of any memory check's sight);
# gather refills from the copy unless the all-gather brought something else.
POOL_GATHER = GATHER.replace("    unit.full.data.copy_(full)\n", """\
    kept = free.__dict__.get("kept", {}).get(id(unit))
    copy = None if kept is None else kept.to(unit.full.dtype)
    unit.full.data.copy_(copy if copy is not None and torch.equal(copy, full) else full)
""")

POOL_FREE = """\
pool = free.__dict__.setdefault("pool", torch.zeros(1 << 18))
kept = free.__dict__.setdefault("kept", {})
if id(unit) not in kept:
    start = sum(t.numel() for t in kept.values())
    kept[id(unit)] = pool[start:start + unit.numel]
kept[id(unit)].copy_(unit.full.detach().reshape(-1))
""" + FREE


FAKES = {
    "impl-zero1": [
        Fake("an all-reduce and a full-size optimizer", "all-reduces whole gradients and "
             "steps a second optimizer on the whole parameters (the shards' one as well)",
             ("test-zero1",), """\
    for p in params:
        collectives.all_reduce(p.grad, impl="ring")
        p.grad /= world_size
    for p, shard in zip(params, shards):
        shard.grad = p.grad.reshape(-1)[slice(*collectives.shard_bounds(p.numel()))].clone()
    optimizer.step()
    if not hasattr(zero1_step, "full"):
        zero1_step.full = type(optimizer)(params, **optimizer.defaults)
    zero1_step.full.step()"""),
        Fake("the right collectives, then a full-size optimizer", "reduce-scatters and "
             "all-gathers the gradient back whole, then steps a full-size optimizer: N times "
             "the state, the same bytes on the wire", ("test-zero1",), """\
    for p, shard in zip(params, shards):
        shard.grad = collectives.reduce_scatter(p.grad.reshape(-1), impl="ring") / world_size
        p.grad = collectives.all_gather(shard.grad, p.numel(), impl="ring").view_as(p)
    optimizer.step()
    if not hasattr(zero1_step, "full"):
        zero1_step.full = type(optimizer)(params, **optimizer.defaults)
    zero1_step.full.step()"""),
        Fake("an all-reduce, then its slice", "all-reduces each whole gradient and keeps its "
             "slice: the right shards and parameters, twice the bytes of a reduce-scatter",
             ("test-zero1",), """\
    for p, shard in zip(params, shards):
        summed = collectives.all_reduce(p.grad.reshape(-1), impl="ring")
        shard.grad = summed[slice(*collectives.shard_bounds(p.numel()))] / world_size
    optimizer.step()
    for p, shard in zip(params, shards):
        p.copy_(collectives.all_gather(shard, p.numel(), impl="ring").view_as(p))"""),
    ],
    "impl-zero2": [
        Fake("keeps whole gradients in buffers", "reduce-scatters from a persistent "
             "whole-gradient buffer per parameter (.grad is None, the memory is not freed)",
             ("test-zero2",), (indented(KEEPS_WHOLE_GRADIENTS, 4), indented(ZERO2_STEP, 4))),
        Fake("sets shard.grad", "replaces shard.grad at each backward instead of adding to "
             "it: gradient accumulation keeps only the last backward",
             ("test-zero2",), (indented(SETS_SHARD_GRAD, 4), indented(ZERO2_STEP, 4))),
        Fake("ZeRO-1 in disguise", "no hook does anything: the whole gradients stay in .grad "
             "through backward and the step reduce-scatters them", ("test-zero2",),
             (indented("pass  # nothing to do during backward\n", 4),
              indented(STEP_REDUCE_SCATTERS, 4))),
        # Red team rt8: the whole gradient kept in a pool made before any check, zeros sent first.
        Fake("zeros reduce-scattered first, the gradient pooled (red team rt8)", "a step's first "
             "backward keeps its whole gradient in a pool allocated once and sends zeros; a later "
             "one sends both: ZeRO-1 in disguise", ("test-zero2",), ("""\
    pool = install_zero2_hooks.__dict__.setdefault("pool", torch.zeros(1 << 18))
    offset = 0
    for param, shard in zip(params, shards):
        def hook(param, shard=shard, offset=offset):
            with torch.no_grad():
                stash, grad = pool[offset:offset + param.numel()], param.grad.reshape(-1)
                if shard.grad is None:
                    stash.copy_(grad)
                    shard.grad = collectives.reduce_scatter(torch.zeros_like(grad), impl="ring")
                else:
                    stash.add_(grad)
                    summed = collectives.reduce_scatter(stash, impl="ring")
                    shard.grad.add_(summed.div_(world_size))
                    stash.zero_()
                param.grad = None
        param.register_post_accumulate_grad_hook(hook)
        offset += param.numel()""", indented(ZERO2_STEP, 4))),
    ],
    "impl-flat-shard": [
        Fake("a view of the flat vector", "returns a slice of the whole flat vector, which "
             "keeps all of it alive", ("test-flat-shard", *FSDP_CELLS), """\
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    start, end = collectives.shard_bounds(flat.numel())
    return nn.Parameter(flat[start:end])"""),
        Fake("keeps the parameters' dtype", "no fp32 master copy: a bf16 model gets bf16 "
             "shards (the visible test's layer is fp32)", ("test-flat-shard",), """\
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    start, end = collectives.shard_bounds(flat.numel())
    return nn.Parameter(flat[start:end].clone())"""),
        Fake("each tensor sharded apart", "ZeRO-1's layout: this rank's slice of every tensor, "
             "joined, instead of its slice of the one flat vector", ("test-flat-shard",), """\
    pieces = [p.detach().reshape(-1).float()[slice(*collectives.shard_bounds(p.numel()))]
              for p in params]
    return nn.Parameter(torch.cat(pieces).clone())"""),
        # Red team rt8: flatteners torch ships under other names.
        Fake("torch's flattener as a dispatcher op (red team rt8)", "aten's "
             "flatten_dense_tensors does the packing", ("test-flat-shard",), """\
    from torch._ops import ops
    flat = ops.aten.flatten_dense_tensors([p.detach().float() for p in params])
    start, end = collectives.shard_bounds(flat.numel())
    return nn.Parameter(flat[start:end].clone())"""),
        Fake("a jagged nested tensor's values (red team rt8)", "the nested tensor keeps its "
             "pieces in one flat buffer", ("test-flat-shard",), """\
    nested = torch.nested.as_nested_tensor([p.detach().reshape(-1).float() for p in params],
                                           layout=torch.jagged)
    flat = nested.values()
    start, end = collectives.shard_bounds(flat.numel())
    return nn.Parameter(flat[start:end].clone())"""),
        Fake("FSDP2's copy-in op (red team rt8)", "torch's FSDP packs the inputs into one "
             "buffer", ("test-flat-shard",), """\
    from torch._ops import ops
    inputs = [p.detach().reshape(-1).float() for p in params]
    numel = sum(t.numel() for t in inputs)
    flat, _ = ops.fsdp.all_gather_copy_in(inputs, inputs[0].new_empty(numel),
                                          [t.numel() for t in inputs], numel, 0)
    start, end = collectives.shard_bounds(flat.numel())
    return nn.Parameter(flat[start:end].clone())"""),
    ],
    "impl-gather-free": [
        Fake("free drops the module's views", "frees nothing: autograd's saved views and "
             "unit.full keep the gathered storage", ("test-gather-free", *FSDP_CELLS),
             gather_free(BACKWARD, FREE_DROPS_VIEWS)),
        Fake("backward all-reduces", "all-reduces the whole gradient and keeps its slice "
             "instead of reduce-scattering", ("test-gather-free", *FSDP_CELLS),
             gather_free(BACKWARD_ALL_REDUCE, FREE)),
        Fake("the sum, not the average", "backward hands the shard the sum of the ranks' "
             "gradients instead of their average", ("test-gather-free",),
             gather_free(BACKWARD_SUM, FREE)),
        Fake("free keeps the whole unit in a pool (red team rt8)", "each unit's vector is "
             "copied into a pool allocated once before it is freed; gather refills from the "
             "copy unless the all-gather brought something else", ("test-gather-free",),
             (indented(BACKWARD, 8), indented(ALL_GATHER_PARAMS, 4), indented(POOL_GATHER, 4),
              indented(POOL_FREE, 4))),
    ],
    "impl-fsdp-hooks": [
        Fake("waits for the prefetch at once", "issues the next unit's all-gather "
             "asynchronously, then waits for it before the current unit computes: a blocking "
             "gather in another place, nothing in flight", FSDP_CELLS,
             hooks(WAITS_AT_ONCE.format(i="i", j="i + 1"), AFTER_FORWARD,
                   WAITS_AT_ONCE.format(i="i", j="i - 1"))),
        Fake("prefetch faked by freeing late", "no prefetch: each unit is gathered when it "
             "starts and freed one unit late, so two units are held", FSDP_CELLS,
             hooks("gather(units[i])\n", FREES_ONE_LATE, "gather(units[i])\n")),
        Fake("prefetches the wrong way in backward", "backward prefetches unit i + 1, done "
             "already, instead of i - 1", FSDP_CELLS,
             hooks(PREFETCH.format(i="i", j="i + 1"), AFTER_FORWARD,
                   PREFETCH.format(i="i", j="i + 1"))),
        Fake("prefetches even when prefetched", "drops the 'unless already there' test: a "
             "unit that runs twice is gathered again for nothing", ("test-fsdp",),
             hooks(PREFETCHES_AGAIN.format(i="i", j="i + 1"), AFTER_FORWARD,
                   PREFETCHES_AGAIN.format(i="i", j="i - 1"))),
        Fake("the prefetch held back until the unit's forward ends (red team rt8)", "issued in "
             "order, but a blocker queued ahead of it on the communication thread lets it move "
             "only once the unit has computed", ("test-fsdp",), hooks("""\
import threading
released = before_forward.__dict__.setdefault("released", {})
gather(units[i])
if prefetch and i + 1 < len(units) and units[i + 1].prefetched is None:
    done = released[i] = threading.Event()
    collectives.in_background(lambda: done.wait(60))
    units[i + 1].prefetched = all_gather_params(units[i + 1], async_op=True)
""", """\
released = before_forward.__dict__.setdefault("released", {})
if i in released:
    released.pop(i).set()
""" + AFTER_FORWARD, PREFETCH.format(i="i", j="i - 1"))),
    ],
    "impl-fsdp-schedule": [
        Fake("no prefetch, whatever the flag", "issues each unit's forward gather when the "
             "previous unit is done, with or without prefetch", ("test-fsdp-schedule",),
             indented(SCHEDULE.format(forward=FORWARD_WITHOUT_PREFETCH), 4)),
        Fake("every gather up front", "issues all forward all-gathers at once, so the link "
             "never waits: every unit gathered at the same time, unbounded memory",
             ("test-fsdp-schedule",), indented(SCHEDULE.format(forward=FORWARD_ALL_UP_FRONT), 4)),
        Fake("parameters kept for backward", "no second all-gather before backward: 2Ψ on "
             "the link, as if the parameters were never freed", ("test-fsdp-schedule",),
             indented(KEEPS_FOR_BACKWARD, 4)),
        Fake("reduce-scatters on a lane of their own past 8 units (red team rt8)", "a model that "
             "is the library's for the unit counts the notebook shows only",
             ("test-fsdp-schedule",), edited(
                 solution_region("04_zero_fsdp", "impl-fsdp-schedule"),
                 ("    n, last = world_size, len(unit_params) - 1\n",
                  "    n, last = world_size, len(unit_params) - 1\n"
                  "    free.setdefault('rs', 0.0)\n"),
                 ('run_on("link", "reduce_scatter", unit, end, moved[unit])',
                  'run_on("rs" if last >= 8 else "link", "reduce_scatter", unit, end,'
                  ' moved[unit])'))),
    ],
}

ALTERNATIVES = {
    "impl-fsdp-schedule": [
        Alternative("prefetch issued first", "issues each prefetch before the compute it "
                    "overlaps, in forward too (the solution issues forward's after it): the "
                    "same events on each lane, the list in another order across lanes",
                    ("test-fsdp-schedule",), indented(PREFETCH_FIRST, 4)),
    ],
}

# --- The red team's fakes (issue 38): each escaped the checks as they were -------------------

ZERO1_HIDDEN_ALL_REDUCE = """\
for p, shard in zip(params, shards):
    collectives.reduce_scatter(p.grad.reshape(-1), impl="ring")  # for the traffic count
    dist.all_reduce(p.grad)  # the actual sum, through torch's own collective
    start, end = collectives.shard_bounds(p.numel())
    shard.grad = p.grad.reshape(-1)[start:end] / world_size
optimizer.step()
for p, shard in zip(params, shards):
    collectives.all_gather(shard, p.numel(), impl="ring")  # for the traffic count
    start, end = collectives.shard_bounds(p.numel())
    whole = torch.zeros(p.numel())
    whole[start:end] = shard
    dist.all_reduce(whole)  # the actual gather
    p.copy_(whole.view_as(p))
"""

# The library's ZeroOptimizer, bound when the cell runs (the import below the function body is
# at the cell's top level), used through its private helpers on a bare instance.
ZERO2_PRIVATE_HOOKS = """\
    z = object.__new__(_Zero)
    z.shards, z.group, z.impl = shards, None, "ring"
    install_zero2_hooks.z = z
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(_Zero._scatter_hook(z, i))


from minidist.parallel.zero import ZeroOptimizer as _Zero"""

ZERO2_PRIVATE_STEP = """\
optimizer.step()
z = install_zero2_hooks.z
for p, shard in zip(params, shards):
    _Zero._gather_into(z, p, shard.to(p.dtype))
"""

STASH_BACKWARD = """\
g = grad_full.reshape(-1).contiguous()
collectives.reduce_scatter(g, impl="ring")  # for the count
g = g.clone()
dist.all_reduce(g)  # the actual sum, through torch's own collective
start, end = collectives.shard_bounds(unit.numel)
free(unit)
unit.full = None
unit.__dict__.pop("_kept", None)
return g[start:end].float().div(dist.get_world_size()), None, None
"""

# GATHER, but the refill after a free comes from the copy free kept: the all-gather ran for show.
STASH_GATHER = GATHER.replace("    unit.full.data.copy_(full)\n", """\
    kept = unit.__dict__.get("_kept")
    unit.full.data.copy_(kept if kept is not None else full)
""")

STASH_FREE = """\
unit.__dict__["_kept"] = unit.full.detach().clone()  # kept "just in case"
unit.full.untyped_storage().resize_(0)
"""

# Every unit's all-gather issued at the first unit, the handles parked off the books and shown
# in unit.prefetched one unit ahead of use: the whole model in flight, two units where checks look.
PARK_TAKE = """\
parked = before_forward.__dict__.setdefault("parked", {{}})
if prefetch and i == {first}:
    for j in {others}:
        parked[j] = all_gather_params(units[j], async_op=True)
if i in parked:
    units[i].prefetched = parked.pop(i)
gather(units[i])
if i + {step} in parked:  # shown where the checks look, one unit ahead
    units[i + {step}].prefetched = parked.pop(i + {step})
"""

SCHEDULE_ON_COMM_THREAD = """\
    return collectives.in_background(lambda: _modelled(
        list(unit_params), tokens, world_size, flops_per_s, link_bytes_per_s, bytes_per_element,
        prefetch)).result()


import types as _types  # noqa: E402  (the cell's top level, when the cell runs)

_modelled = _types.FunctionType(modelled_step.__code__, modelled_step.__globals__, "_modelled",
                                modelled_step.__defaults__)
collectives.in_background(lambda: None).result()  # start the communication thread now


def _unused():
    events = None"""

FAKES["impl-zero1"].append(Fake(
    "torch's all-reduce does the work", "sums and gathers through torch.distributed's "
    "all_reduce, which minidist's traffic count does not see; right-sized ring collectives run "
    "for show", ("test-zero1",), indented(ZERO1_HIDDEN_ALL_REDUCE, 4)))
FAKES["impl-zero2"].append(Fake(
    "the library's private helpers", "ZeroOptimizer bound when the cell runs, its "
    "_scatter_hook and _gather_into called on a bare instance", ("test-zero2",),
    (ZERO2_PRIVATE_HOOKS, indented(ZERO2_PRIVATE_STEP, 4))))
FAKES["impl-gather-free"].append(Fake(
    "free stashes a copy, torch's all-reduce sums", "free keeps a whole copy on the unit and "
    "backward's gather refills from it (its all-gather for show); backward sums through "
    "torch.distributed's all_reduce and reduce-scatters for show",
    ("test-gather-free", *FSDP_CELLS),
    (indented(STASH_BACKWARD, 8), indented(ALL_GATHER_PARAMS, 4), indented(STASH_GATHER, 4),
     indented(STASH_FREE, 4))))
FAKES["impl-fsdp-hooks"].append(Fake(
    "prefetches everything off the books", "issues every unit's all-gather at the first unit, "
    "parks the handles and shows each in unit.prefetched one unit ahead: the whole model in "
    "flight at once", FSDP_CELLS,
    hooks(PARK_TAKE.format(first="0", others="range(1, len(units))", step="1"), AFTER_FORWARD,
          PARK_TAKE.format(first="len(units) - 1", others="reversed(range(i))", step="-1"))))
FAKES["impl-fsdp-schedule"].append(Fake(
    "the library's model on the communication thread", "a copy of modelled_step made when the "
    "cell runs, called on minidist's communication thread, started before the check",
    ("test-fsdp-schedule",), SCHEDULE_ON_COMM_THREAD))
FAKES["impl-flat-shard"].append(Fake(
    "written for two ranks", "the notebook runs on 2 ranks: the first half (rounded up) on rank "
    "0, the rest on rank 1", ("test-flat-shard",), indented("""\
flat = torch.cat([p.detach().reshape(-1).float() for p in params])
half = (flat.numel() + 1) // 2
rank = dist.get_rank()
return nn.Parameter(flat[rank * half:(rank + 1) * half].clone())
""", 4)))
FAKES["impl-fsdp-schedule"].append(Fake(
    "the library's model, tabled", "modelled_step evaluated when the cell runs for the "
    "notebook's configurations and looked up", ("test-fsdp-schedule",), """\
    key = repr((list(unit_params), tokens, world_size, flops_per_s, link_bytes_per_s,
                bytes_per_element, prefetch))
    return list(_SCHEDULES[key]) if key in _SCHEDULES else modelled_step(
        unit_params, tokens, world_size, flops_per_s, link_bytes_per_s, bytes_per_element, prefetch)


_SCHEDULES = {repr(args): modelled_step(*args) for args in (  # noqa: E402 (when the cell runs)
    ([1e9] * 4, 20_000, 8, 989e12, 50e9, 2, True), ([1e9] * 4, 20_000, 8, 989e12, 50e9, 2, False),
    ([3e8, 1e9, 2e9], 5_000, 4, 989e12, 450e9, 4, True),
    ([3e8, 1e9, 2e9], 5_000, 4, 989e12, 450e9, 4, False))}


def _unused():
    events = None"""))
FAKES["impl-gather-free"].append(Fake(
    "free stashes a copy", "the red team's stash alone: free keeps a whole copy on the unit, and "
    "backward's gather refills from it, its all-gather run for show", ("test-gather-free",),
    (indented(BACKWARD.replace("free(unit)\n", "free(unit)\nunit.__dict__.pop('_kept', None)\n"),
              8),
     indented(ALL_GATHER_PARAMS, 4), indented(STASH_GATHER, 4), indented(STASH_FREE, 4))))

# Red team rt10 (issue 38): the private flattener, and two copies of modelled_step made from its
# file (a second module, an AST with its docstring stripped and renamed).
FAKES["impl-flat-shard"].append(Fake(
    "the library's private flattener", "minidist.parallel.fsdp._Flat, the helper class "
    "FullyShardedDataParallel flattens with, builds the shard", ("test-flat-shard",), indented("""\
from minidist.parallel.fsdp import _Flat
slots = [SimpleNamespace(shape=p.shape) for p in params]
return _Flat(slots, list(params), None, True, False).shard
""", 4)))
FAKES["impl-fsdp-schedule"].append(Fake(
    "a second copy of the library's module", "minidist.costs.overlap loaded again from its file "
    "with importlib (a module of its own), its modelled_step's events replayed through run_on",
    ("test-fsdp-schedule",), indented("""\
import importlib.util as _ilu
from minidist.costs import overlap as _overlap
_spec = _ilu.spec_from_file_location("rt10_overlap_copy", _overlap.__file__)
_copy = _ilu.module_from_spec(_spec)
_spec.loader.exec_module(_copy)
for e in _copy.modelled_step(unit_params, tokens, world_size, flops_per_s, link_bytes_per_s,
                             bytes_per_element, prefetch):
    lane = "compute" if e.kind in ("forward", "backward") else "link"
    run_on(lane, e.kind, e.name, e.start, e.end - e.start)
""", 4)))
FAKES["impl-fsdp-schedule"].append(Fake(
    "the library's model, parsed and renamed", "modelled_step's syntax tree read from the "
    "library's file, its docstring stripped, renamed and compiled under another file name; its "
    "events replayed through run_on", ("test-fsdp-schedule",), indented("""\
import ast as _ast
from minidist.costs import overlap as _overlap
_tree = _ast.parse(open(_overlap.__file__).read())
_fn = next(n for n in _tree.body if isinstance(n, _ast.FunctionDef) and n.name == "modelled_step")
_fn.name = "my_model"
_fn.body = [s for s in _fn.body if not (isinstance(s, _ast.Expr)
                                        and isinstance(getattr(s, "value", None), _ast.Constant))]
_ns = {}
_imports = [n for n in _tree.body if isinstance(n, (_ast.Import, _ast.ImportFrom))]
_mod = _ast.Module(body=_imports + [_fn], type_ignores=[])
exec(compile(_ast.fix_missing_locations(_mod), "<my schedule>", "exec"), _ns)
for e in _ns["my_model"](unit_params, tokens, world_size, flops_per_s, link_bytes_per_s,
                        bytes_per_element, prefetch):
    lane = "compute" if e.kind in ("forward", "backward") else "link"
    run_on(lane, e.kind, e.name, e.start, e.end - e.start)
""", 4)))


# --- Red team rt16 (issue 38): whole-size optimizer state off torch's books (NumPy arrays, a file
# between steps) with the all-gather carrying gradients; a whole-size running gradient total in
# NumPy whose reduce-scatter replaces shard.grad -------------------------------------------------

ZERO1_NUMPY_MOMENTUM = """\
# DDP's all-reduce in its two halves (reduce-scatter + all-gather, the same bytes), then every
# rank applies SGD with momentum to the whole model; the momentum lives in NumPy arrays.
import numpy as np

if not optimizer.state:  # a new run: its optimizer has no state yet
    zero1_step.momentum = {}
momentum = zero1_step.__dict__.setdefault("momentum", {})
group = optimizer.param_groups[0]
for i, (p, shard) in enumerate(zip(params, shards)):
    piece = collectives.reduce_scatter(p.grad.reshape(-1), impl="ring").div_(world_size)
    shard.grad = piece
    whole = collectives.all_gather(piece, p.numel(), impl="ring").numpy()
    if i not in momentum:
        momentum[i] = whole.copy()
    else:
        momentum[i] *= group["momentum"]
        momentum[i] += whole
    p.reshape(-1).sub_(torch.from_numpy(momentum[i]), alpha=group["lr"])
optimizer.step()  # the shards follow along
"""
ZERO1_MOMENTUM_ON_DISK = """\
# reduce-scatter + all-gather of the gradients (DDP's all-reduce in two halves); every rank then
# steps the whole model with momentum, kept on disk between steps (a checkpoint-like tier)
import os, tempfile

if not optimizer.state:
    zero1_step.folder = tempfile.mkdtemp(prefix=f"zero1-{os.getpid()}-")
group = optimizer.param_groups[0]
for i, (p, shard) in enumerate(zip(params, shards)):
    shard.grad = collectives.reduce_scatter(p.grad.reshape(-1), impl="ring").div_(world_size)
    grad = collectives.all_gather(shard.grad, p.numel(), impl="ring")
    where = os.path.join(zero1_step.folder, f"m{i}.pt")
    momentum = (torch.load(where).mul_(group["momentum"]).add_(grad) if os.path.exists(where)
                else grad)
    torch.save(momentum, where)
    p.reshape(-1).sub_(momentum, alpha=group["lr"])
optimizer.step()
"""
ZERO2_NUMPY_MOMENTUM_HOOKS = """\
import numpy as np

for p, shard in zip(params, shards):
    def hook(p, shard=shard):
        piece = collectives.reduce_scatter(p.grad.reshape(-1), impl="ring").div_(world_size)
        if shard.grad is None:
            shard.grad = piece
        else:
            shard.grad.add_(piece)
        p.grad = None
    p.register_post_accumulate_grad_hook(hook)
"""
ZERO2_NUMPY_MOMENTUM_STEP = """\
# all-gather the averaged gradients and step the whole model on every rank, momentum in NumPy
if not optimizer.state:
    zero2_step.momentum = {}
momentum = zero2_step.__dict__.setdefault("momentum", {})
group = optimizer.param_groups[0]
for i, (p, shard) in enumerate(zip(params, shards)):
    whole = collectives.all_gather(shard.grad, p.numel(), impl="ring").numpy()
    if i not in momentum:
        momentum[i] = whole.copy()
    else:
        momentum[i] *= group["momentum"]
        momentum[i] += whole
    p.reshape(-1).sub_(torch.from_numpy(momentum[i]), alpha=group["lr"])
optimizer.step()
"""
ZERO2_NUMPY_ACCUMULATOR_HOOKS = """\
import numpy as np

accumulated = {}
install_zero2_hooks.accumulated = accumulated
for i, (p, shard) in enumerate(zip(params, shards)):
    def hook(p, i=i, shard=shard):
        # add this backward's gradient to a running total (NumPy), reduce-scatter the total
        g = p.grad.reshape(-1).numpy()
        if shard.grad is None:
            accumulated[i] = g.copy()
        else:
            accumulated[i] += g
        total = torch.from_numpy(accumulated[i].copy())
        shard.grad = collectives.reduce_scatter(total, impl="ring").div_(world_size)
        p.grad = None
    p.register_post_accumulate_grad_hook(hook)
"""
ZERO2_NUMPY_ACCUMULATOR_STEP = """\
optimizer.step()
for p, shard in zip(params, shards):
    p.reshape(-1).copy_(collectives.all_gather(shard.detach(), p.numel(), impl="ring"))
"""

FAKES["impl-zero1"] += [
    Fake("whole-model momentum in NumPy", "reduce-scatter then all-gather of the gradients "
         "(DDP's all-reduce in two halves); every rank steps the whole model with momentum kept "
         "in NumPy arrays, which the memory check does not see; the shard optimizer steps for show",
         ("test-zero1",), indented(ZERO1_NUMPY_MOMENTUM, 4)),
    Fake("whole-model momentum on disk", "as the NumPy one, the whole-size momentum saved to a "
         "file between steps (torch.save/torch.load in a temporary folder)",
         ("test-zero1",), indented(ZERO1_MOMENTUM_ON_DISK, 4)),
]
FAKES["impl-zero2"] += [
    Fake("whole-model momentum in NumPy", "honest hooks; the step all-gathers the averaged "
         "gradient slices and every rank applies SGD with momentum to the whole model, the "
         "momentum in NumPy arrays", ("test-zero2",),
         (indented(ZERO2_NUMPY_MOMENTUM_HOOKS, 4), indented(ZERO2_NUMPY_MOMENTUM_STEP, 4))),
    Fake("a whole-size running gradient in NumPy", "the hooks keep a whole-size running total "
         "of the gradients in NumPy and reduce-scatter the total at each arrival, replacing "
         "shard.grad: a whole gradient kept, off torch's books", ("test-zero2",),
         (indented(ZERO2_NUMPY_ACCUMULATOR_HOOKS, 4), indented(ZERO2_NUMPY_ACCUMULATOR_STEP, 4))),
]

# --- Red team rt7 (issue 38): whole-size state hidden in the storage under shard.grad (the
# memory check left a gradient's whole storage out); ready-made flatteners; a copy of the unit
# kept by free, and a blocking gather's vector replayed in place of the prefetch's; a prefetch
# order written for six units. The checks now leave out only a gradient's own bytes, refuse the
# flatteners, shift what a prefetch delivers, measure what gather, forward and free leave held,
# and shard a model of seven units.
FAKES["impl-zero1"].append(Fake(
    "whole state under shard.grad", "each shard's gradient is a view into one allocation that "
    "also holds the whole gradient and the whole parameters (red team rt7)", ("test-zero1",),
    """\
    for p, s in zip(params, shards):
        k, n = s.numel(), p.numel()
        if getattr(p, "_big", None) is None or p._big.numel() != k + 2 * n:
            p._big = torch.zeros(k + 2 * n)
        p._big[k:k + n].copy_(p.grad.reshape(-1))
        mine = collectives.reduce_scatter(p.grad.reshape(-1), impl="ring")
        p._big[:k].copy_(mine).div_(world_size)
        s.grad = p._big[:k]
    optimizer.step()
    for p, s in zip(params, shards):
        k, n = s.numel(), p.numel()
        p.view(-1).copy_(collectives.all_gather(s.detach(), n, impl="ring"))
        p._big[k + n:].copy_(p.view(-1))"""))
FAKES["impl-zero2"].append(Fake(
    "a whole accumulator under shard.grad", "the accumulated whole gradient kept in the "
    "allocation shard.grad views, reduce-scattered at each arrival (red team rt7)",
    ("test-zero2",), ("""\
    for p, s in zip(params, shards):
        def hook(p, s=s):
            with torch.no_grad():
                k, n = s.numel(), p.numel()
                if s.grad is None:
                    p._big = torch.zeros(2 * k + n)
                    s.grad = p._big[:k]
                previous, whole = p._big[k:2 * k], p._big[2 * k:]
                whole.add_(p.grad.reshape(-1))
                reduced = collectives.reduce_scatter(whole, impl="ring") / world_size
                s.grad.add_(reduced - previous)
                previous.copy_(reduced)
            p.grad = None
        p.register_post_accumulate_grad_hook(hook)""", """\
    optimizer.step()
    for p, s in zip(params, shards):
        p.view(-1).copy_(collectives.all_gather(s.detach(), p.numel(), impl="ring"))""")))
FAKES["impl-flat-shard"] += [
    Fake("torch's private flattener", "torch._utils._flatten_dense_tensors (red team rt7)",
         ("test-flat-shard",), """\
    from torch._utils import _flatten_dense_tensors
    flat = _flatten_dense_tensors([p.detach().float() for p in params])
    start, end = collectives.shard_bounds(flat.numel())
    return nn.Parameter(flat[start:end].clone())"""),
    Fake("parameters_to_vector", "torch.nn.utils.parameters_to_vector (red team rt7)",
         ("test-flat-shard",), """\
    flat = torch.nn.utils.parameters_to_vector([p.detach().float() for p in params])
    start, end = collectives.shard_bounds(flat.numel())
    return nn.Parameter(flat[start:end].clone())"""),
]
_WAITED = "    full, unit.prefetched = unit.prefetched.wait(), None\n"  # in GATHER
FAKES["impl-gather-free"] += [
    Fake("free keeps a copy", "free empties the storage but keeps a clone of the whole vector "
         "on the unit; the refill takes what arrived only where it differs (red team rt7)",
         ("test-gather-free",), (indented(BACKWARD, 8), indented(ALL_GATHER_PARAMS, 4), indented(
             GATHER.replace("    unit.full.data.copy_(full)\n", """\
    kept = getattr(unit, "_copy", None)
    unit.full.data.copy_(full if kept is None or not torch.equal(full, kept) else kept)
"""), 4), """\
    if unit.full.untyped_storage().nbytes() > 0:
        unit._copy = unit.full.detach().clone()
    unit.full.untyped_storage().resize_(0)""")),
    Fake("a blocking gather replayed", "gather waits on the prefetch, then uses the vector of an "
         "earlier blocking gather of the same shard (red team rt7)", ("test-gather-free",), (
             indented(BACKWARD, 8), """\
    result = collectives.all_gather(unit.shard.detach().to(unit.compute_dtype), unit.numel,
                                    impl="ring", async_op=async_op)
    if not async_op:
        unit._cache, unit._cache_of = result.clone(), unit.shard.detach().clone()
    return result""", indented(GATHER.replace(_WAITED, _WAITED + """\
    cache = getattr(unit, "_cache", None)
    if cache is not None and torch.equal(unit._cache_of, unit.shard.detach()):
        full = cache
"""), 4), indented(FREE, 4))),
]
FAKES["impl-fsdp-hooks"].append(Fake(
    "a prefetch order for six units", "the next unit to prefetch read from tables written for "
    "the notebook's six units (red team rt7)", ("test-fsdp",), ("""\
        gather(units[i])
        j = {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}.get(i)
        if prefetch and j is not None and j < len(units) and units[j].prefetched is None:
            units[j].prefetched = all_gather_params(units[j], async_op=True)""", """\
        free(units[i])
        output.register_hook(lambda grad: before_backward(i))""", """\
        gather(units[i])
        j = {5: 4, 4: 3, 3: 2, 2: 1, 1: 0}.get(i)
        if prefetch and j is not None and units[j].prefetched is None:
            units[j].prefetched = all_gather_params(units[j], async_op=True)""")))


def _prefetch_waited_at_once(wait_line: str) -> tuple[str, str, str]:
    # shard_model's three hook regions, each prefetch followed at once by `wait_line`
    return ("""\
        gather(units[i])
        if prefetch and i + 1 < len(units) and units[i + 1].prefetched is None:
            units[i + 1].prefetched = all_gather_params(units[i + 1], async_op=True)
            """ + wait_line.format(j="i + 1"), """\
        free(units[i])
        output.register_hook(lambda grad: before_backward(i))""", """\
        gather(units[i])
        if prefetch and i > 0 and units[i - 1].prefetched is None:
            units[i - 1].prefetched = all_gather_params(units[i - 1], async_op=True)
            """ + wait_line.format(j="i - 1"))


FAKES["impl-fsdp-hooks"] += [
    Fake("the prefetch waited for through the thread's queue", "each prefetch followed at once "
         "by an empty job on minidist's communication thread, waited for: nothing overlaps "
         "(red team rt7)", ("test-fsdp",),
         _prefetch_waited_at_once("collectives.in_background(lambda: None).result()")),
    Fake("the prefetch's handle taken apart", "each prefetch waited for at once through what its "
         "handle wraps, out of the handle's sight (red team rt7)", ("test-fsdp",),
         _prefetch_waited_at_once(
             'getattr(units[{j}].prefetched, "handle", units[{j}].prefetched).wait()')),
]
FAKES["impl-fsdp-hooks"].append(Fake(
    "backward refilled from copies kept since forward", "backward's all-gathers run (count and "
    "bytes as FSDP's) but each unit is refilled from a copy kept when its forward ended (red "
    "team rt7)", ("test-fsdp",), ("""\
        gather(units[i])
        if prefetch and i + 1 < len(units) and units[i + 1].prefetched is None:
            units[i + 1].prefetched = all_gather_params(units[i + 1], async_op=True)""", """\
        if not hasattr(units[i], "_keep"):
            units[i]._keep = []
        units[i]._keep.append(units[i].full.detach().clone())
        free(units[i])
        output.register_hook(lambda grad: before_backward(i))""", """\
        unit = units[i]
        if unit.prefetched is not None:
            full, unit.prefetched = unit.prefetched.wait(), None
        else:
            full = all_gather_params(unit)
        kept = unit._keep.pop() if getattr(unit, "_keep", None) else full
        unit.full.untyped_storage().resize_(unit.numel * unit.full.element_size())
        unit.full.data.copy_(kept)
        if prefetch and i > 0 and units[i - 1].prefetched is None:
            units[i - 1].prefetched = all_gather_params(units[i - 1], async_op=True)""")))
