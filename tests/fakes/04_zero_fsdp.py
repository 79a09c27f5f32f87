"""Fakes of Lab 04's exercises: ZeRO's and FSDP's numbers without their memory or their
communication pattern."""

import textwrap

from fakes import Alternative, Fake


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
