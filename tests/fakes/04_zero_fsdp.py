"""Fakes of Lab 04's exercises: ZeRO's and FSDP's numbers without their memory or their
communication pattern."""

import textwrap

from fakes import Fake


def by_function(indent: int, **bodies: str) -> str:
    """One source for a cell with several solution regions (each region gets the same
    source): each function runs the body named after it."""
    pad = " " * indent
    lines = [f"{pad}match __import__('sys')._getframe().f_code.co_name:"]
    for name, body in bodies.items():
        lines.append(f"{pad}    case {name!r}:")
        lines += [f"{pad}        {line}" if line else "" for line in
                  textwrap.dedent(body).strip("\n").splitlines()]
    return "\n".join(lines)


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
return collectives.all_gather(unit.shard.detach().to(unit.compute_dtype), unit.numel, impl="ring")
"""

GATHER = """\
if unit.prefetched is not None:
    full, unit.prefetched = unit.prefetched, None
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

FREE_DROPS_VIEWS = """\
for owner, name, _ in unit.slots:  # drop the module's views of the gathered vector
    owner.__dict__.pop(name, None)
"""

BEFORE_FORWARD = """\
gather(units[i])
if prefetch and i + 1 < len(units) and units[i + 1].prefetched is None:
    units[i + 1].prefetched = all_gather_params(units[i + 1])
"""

AFTER_FORWARD = """\
free(units[i])
output.register_hook(lambda grad: before_backward(i))
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

PREFETCHES_BACKWARD_WRONG_WAY = """\
gather(units[i])
if prefetch and i + 1 < len(units) and units[i + 1].prefetched is None:
    units[i + 1].prefetched = all_gather_params(units[i + 1])
"""

PREFETCHES_AGAIN = """\
gather(units[{i}])
if prefetch and 0 <= {j} < len(units):  # no check whether it is prefetched already
    units[{j}].prefetched = all_gather_params(units[{j}])
"""

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
    ],
    "impl-traffic": [
        Fake("the library's traffic", "calls minidist.traffic.data_parallel_traffic",
             ("test-traffic",), """\
    step = traffic.data_parallel_traffic(num_params, world_size, stage, bytes_per_element)
    return step.bytes_sent"""),
        Fake("2Ψ at every stage", "ignores the stage: forgets FSDP's second all-gather "
             "(the visible test's stage 3 runs on one rank)", ("test-traffic",), """\
    return 2 * num_params * bytes_per_element * (world_size - 1) / world_size"""),
    ],
    "impl-zero2": [
        Fake("keeps whole gradients in buffers", "reduce-scatters from a persistent "
             "whole-gradient buffer per parameter (.grad is None, the memory is not freed)",
             ("test-zero2",), by_function(4, install_zero2_hooks=KEEPS_WHOLE_GRADIENTS,
                                          zero2_step=ZERO2_STEP)),
        Fake("sets shard.grad", "replaces shard.grad at each backward instead of adding to "
             "it: gradient accumulation keeps only the last backward",
             ("test-zero2",), by_function(4, install_zero2_hooks=SETS_SHARD_GRAD,
                                          zero2_step=ZERO2_STEP)),
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
    ],
    "impl-gather-free": [
        Fake("free drops the module's views", "frees nothing: autograd's saved views and "
             "unit.full keep the gathered storage", ("test-gather-free", *FSDP_CELLS),
             by_function(8, backward=BACKWARD, all_gather_params=ALL_GATHER_PARAMS,
                         gather=GATHER, free=FREE_DROPS_VIEWS)),
        Fake("backward all-reduces", "all-reduces the whole gradient and keeps its slice "
             "instead of reduce-scattering", ("test-gather-free", *FSDP_CELLS),
             by_function(8, backward=BACKWARD_ALL_REDUCE, all_gather_params=ALL_GATHER_PARAMS,
                         gather=GATHER, free=FREE)),
    ],
    "impl-fsdp-hooks": [
        Fake("prefetch faked by freeing late", "no prefetch: each unit is gathered when it "
             "starts and freed one unit late, so two units are held", FSDP_CELLS,
             by_function(8, before_forward="gather(units[i])\n", after_forward=FREES_ONE_LATE,
                         before_backward="gather(units[i])\n")),
        Fake("prefetches the wrong way in backward", "backward prefetches unit i + 1, done "
             "already, instead of i - 1", FSDP_CELLS,
             by_function(8, before_forward=BEFORE_FORWARD, after_forward=AFTER_FORWARD,
                         before_backward=PREFETCHES_BACKWARD_WRONG_WAY)),
        Fake("prefetches even when prefetched", "drops the 'unless already there' test: a "
             "unit that runs twice is gathered again for nothing", ("test-fsdp",),
             by_function(8, before_forward=PREFETCHES_AGAIN.format(i="i", j="i + 1"),
                         after_forward=AFTER_FORWARD,
                         before_backward=PREFETCHES_AGAIN.format(i="i", j="i - 1"))),
    ],
}
