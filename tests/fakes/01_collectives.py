"""Fakes of Lab 01's exercises: the right sums and formulas without the ring, the doubling or the
model they teach."""

from fakes import Fake

# The red team's copy of comm's steps, exec'd from their source under new names into _ns: the
# start of two fakes' cells.
RENAMED_STEPS = """\
    import inspect as _inspect
    _ns = dict(vars(comm))
    _src = "\\n".join(_inspect.getsource(f) for f in (
        comm.reduce_scatter_steps, comm.all_gather_steps, comm._fold_in, comm._fold_out,
        comm.recursive_doubling_steps))
    for _old, _new in (("reduce_scatter_steps", "my_rs_steps"), ("all_gather_steps", "my_ag_steps"),
                       ("_fold_in", "_my_fold_in"), ("_fold_out", "_my_fold_out"),
                       ("recursive_doubling_steps", "my_rd_steps")):
        _src = _src.replace(_old, _new)
    exec(_src, _ns)
"""
RING = ("test-ring-all-reduce",)  # my_ring_all_reduce is made of the two phases

NUMPY_BUFFER = """\
    import numpy as np

    def outside(numel, dtype):  # a tensor on NumPy's memory, which torch's allocator never sees
        size = torch.tensor([], dtype=dtype).element_size()
        return torch.from_numpy(np.zeros(max(numel, 1) * size, dtype=np.uint8)).view(dtype)[:numel]
"""

FAKES = {
    "impl-chunk-bounds": [
        Fake("the library's chunk_bounds",
             "splits nothing itself: minidist.communication.comm.chunk_bounds",
             ("test-chunk-bounds",), """\
    return comm.chunk_bounds(numel, world_size)"""),
        Fake("torch.tensor_split's pieces", "splits nothing itself: torch's own split",
             ("test-chunk-bounds",), """\
    sizes = [len(piece) for piece in torch.tensor_split(torch.arange(numel), world_size)]
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return [(end - size, end) for size, end in zip(sizes, ends)]"""),
        Fake("torch's split, as a Tensor method", "splits nothing itself: "
             "arange(numel).tensor_split, the method beside the refused function",
             ("test-chunk-bounds",), """\
    pieces = torch.arange(numel).tensor_split(world_size)
    bounds, start = [], 0
    for piece in pieces:
        bounds.append((start, start + len(piece)))
        start += len(piece)
    return bounds"""),
        Fake("the library's, in another process", "asks a fresh Python process, where nothing "
             "is refused, for minidist's chunk_bounds",
             ("test-chunk-bounds",), """\
    import subprocess, sys, json as _json
    out = subprocess.run([sys.executable, "-c",
                          "import json; from minidist.communication.comm import chunk_bounds; "
                          f"print(json.dumps(chunk_bounds({numel}, {world_size})))"],
                         capture_output=True, text=True, check=True).stdout
    return [tuple(pair) for pair in _json.loads(out)]"""),
        # Red team rt8: bounds that only say they are right, and torch's splitter compiled.
        Fake("integers that agree with anything (red team rt8)", "every bound (0, 0), of an int "
             "subclass whose comparisons all say yes", ("test-chunk-bounds",), """\
    class Agreeing(int):
        def __eq__(self, other):
            return True

        def __ne__(self, other):
            return False

        def __le__(self, other):
            return True

        def __ge__(self, other):
            return True

        def __lt__(self, other):
            return False

        def __gt__(self, other):
            return False

        def __sub__(self, other):
            return Agreeing(0)

        def __rsub__(self, other):
            return Agreeing(0)

        __hash__ = int.__hash__
    return [(Agreeing(0), Agreeing(0)) for _ in range(world_size)]"""),
        Fake("torch's tensor_split in TorchScript (red team rt8)", "the split compiled by "
             "TorchScript, whose calls run in C++", ("test-chunk-bounds",), """\
    unit = torch.jit.CompilationUnit(
        "def pieces(numel: int, world_size: int) -> List[int]:\\n"
        "    return [p.numel() for p in torch.tensor_split(torch.arange(numel), world_size)]\\n")
    bounds, start = [], 0
    for size in unit.pieces(numel, world_size):
        bounds.append((start, start + size))
        start += size
    return bounds"""),
    ],
    "impl-reduce-scatter": [
        Fake("the whole tensor every step", "sends all N chunks each step instead of one",
             ("test-reduce-scatter", *RING), """\
    incoming = torch.empty_like(flat)
    for step in range(world_size - 1):
        recv_start, recv_end = bounds[(rank - step - 2) % world_size]
        requests = [dist.isend(flat, right), dist.irecv(incoming, left)]
        for request in requests:
            request.wait()
        flat[recv_start:recv_end] += incoming[recv_start:recv_end]"""),
        Fake("each chunk straight to its owner", "no ring: sends chunk c to rank c directly "
             "(the same bytes, to every rank)", ("test-reduce-scatter", *RING), """\
    mine_start, mine_end = bounds[rank]
    incoming = torch.empty(mine_end - mine_start, dtype=flat.dtype)
    for step in range(1, world_size):
        to, source = (rank + step) % world_size, (rank - step) % world_size
        requests = [dist.isend(flat[slice(*bounds[to])], to), dist.irecv(incoming, source)]
        for request in requests:
            request.wait()
        flat[mine_start:mine_end] += incoming"""),
        Fake("the library's reduce-scatter steps", "delegates to minidist.communication.comm",
             ("test-reduce-scatter", *RING), """\
    comm.reduce_scatter_steps(flat, comm.ring_of())"""),
        Fake("the ring's payloads replayed from the rendezvous store", "every input read from "
             "the TCPStore; each step sends the partial sum computed from them and throws away "
             "what arrives",
             ("test-reduce-scatter", *RING), """\
    import io, os
    n = world_size
    if n == 1:
        return
    from torch.distributed.distributed_c10d import _get_default_store
    store = _get_default_store()
    calls = globals().setdefault("_rs_calls", [0])
    calls[0] += 1
    buf = io.BytesIO(); torch.save(flat.clone(), buf)
    store.set(f"rs{os.environ.get('MASTER_PORT')}-{calls[0]}-{rank}", buf.getvalue())
    key = f"rs{os.environ.get('MASTER_PORT')}-{calls[0]}"
    everyone = [torch.load(io.BytesIO(store.get(f"{key}-{r}"))) for r in range(n)]
    inbox = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype)
    for step in range(n - 1):
        c = (rank - step - 1) % n
        s, e = bounds[c]
        payload = sum(everyone[(c + 1 + k) % n][s:e] for k in range(step + 1))
        rs, re_ = bounds[(rank - step - 2) % n]
        works = [dist.isend(payload.contiguous(), right), dist.irecv(inbox[:re_ - rs], left)]
        for w in works:
            w.wait()
    s, e = bounds[rank]
    flat[s:e] = sum(everyone[r][s:e] for r in range(n))"""),
        Fake("the library's steps, renamed", "red team rt1: comm.reduce_scatter_steps (and its "
             "neighbours) exec'd from their source under new names, run on comm.ring_of()",
             ("test-reduce-scatter", *RING), RENAMED_STEPS + """\
    _ns["my_rs_steps"](flat, comm.ring_of())"""),
        Fake("each chunk to its owner through the dispatcher's c10d ops (red team rt8)", "the "
             "chunks travel below the process group; the ring runs on zeros for show",
             ("test-reduce-scatter",), """\
    c10d, group = getattr(getattr(torch, "o" + "ps"), "c10d"), dist.group.WORLD.boxed()
    start, end = bounds[rank]
    works = [c10d.send([flat[s:e].contiguous()], group, p, 77)
             for p, (s, e) in enumerate(bounds) if p != rank]
    total = torch.zeros(end - start)
    piece = torch.empty(end - start)
    for p in range(world_size):
        if p != rank:
            c10d.recv_([piece], group, p, 77).wait()
            total += piece
    for work in works:
        work.wait()
    zeros, buffer = torch.zeros_like(flat), torch.empty(bounds[0][1] - bounds[0][0])
    for step in range(world_size - 1):
        send_start, send_end = bounds[(rank - step - 1) % world_size]
        recv_start, recv_end = bounds[(rank - step - 2) % world_size]
        incoming = buffer[:recv_end - recv_start]
        requests = [dist.isend(zeros[send_start:send_end], right), dist.irecv(incoming, left)]
        for request in requests:
            request.wait()
        zeros[recv_start:recv_end] += incoming
    flat[start:end] += total + zeros[start:end]"""),
    ],
    "impl-all-gather": [
        Fake("the whole tensor every step", "forwards all N chunks each step instead of one",
             ("test-all-gather", *RING), """\
    incoming = torch.empty_like(flat)
    for step in range(world_size - 1):
        recv_start, recv_end = bounds[(rank - step - 1) % world_size]
        requests = [dist.isend(flat, right), dist.irecv(incoming, left)]
        for request in requests:
            request.wait()
        flat[recv_start:recv_end] = incoming[recv_start:recv_end]"""),
        Fake("its chunk straight to every rank", "no ring: sends its own chunk to each rank "
             "directly (the same bytes, to every rank)", ("test-all-gather", *RING), """\
    for step in range(1, world_size):
        to, source = (rank + step) % world_size, (rank - step) % world_size
        requests = [dist.isend(flat[slice(*bounds[rank])], to),
                    dist.irecv(flat[slice(*bounds[source])], source)]
        for request in requests:
            request.wait()"""),
        Fake("the library's all-gather steps", "delegates to minidist.communication.comm",
             ("test-all-gather", *RING), """\
    comm.all_gather_steps(flat, comm.ring_of())"""),
        Fake("the library's steps, exec'd from their source", "a copy of minidist's "
             "all_gather_steps made by exec of inspect.getsource",
             ("test-all-gather", *RING), """\
    import inspect
    from minidist.communication import comm as _comm
    namespace = dict(vars(_comm))
    exec(inspect.getsource(_comm.all_gather_steps), namespace)
    namespace["all_gather_steps"](flat, _comm.ring_of())"""),
        Fake("the ring on a NumPy scratch copy (red team rt8)", "a whole copy of the tensor and "
             "a fresh buffer each step, on memory torch's allocator does not count",
             ("test-all-gather",), NUMPY_BUFFER + """\
    work = outside(flat.numel(), flat.dtype)
    work.copy_(flat)
    for step in range(world_size - 1):
        send_start, send_end = bounds[(rank - step) % world_size]
        recv_start, recv_end = bounds[(rank - step - 1) % world_size]
        incoming = outside(recv_end - recv_start, flat.dtype)
        requests = [dist.isend(work[send_start:send_end], right), dist.irecv(incoming, left)]
        for request in requests:
            request.wait()
        work[recv_start:recv_end] = incoming
    flat.copy_(work)"""),
    ],
    "impl-all-reduce": [
        Fake("dist.all_reduce behind ring-sized junk", "the sum comes from dist.all_reduce; the "
             "ring only carries zeros", RING, """\
    junk = torch.zeros(tensor.numel(), dtype=tensor.dtype)
    ring_reduce_scatter(junk, rank, world_size)
    ring_all_gather(junk, rank, world_size)
    dist.all_reduce(tensor)
    return tensor"""),
        Fake("the library's ring all-reduce",
             "delegates to minidist.communication.comm.ring_all_reduce", RING,
             """\
    return comm.ring_all_reduce(tensor)"""),
        Fake("the naive ring", "forwards whole tensors N-1 times: no reduce-scatter, no "
             "all-gather", RING, """\
    flat = tensor.view(-1)
    passing, incoming = flat.clone(), torch.empty_like(flat)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for step in range(world_size - 1):
        requests = [dist.isend(passing, right), dist.irecv(incoming, left)]
        for request in requests:
            request.wait()
        flat += incoming
        passing, incoming = incoming, passing
    return tensor"""),
        Fake("torch's backend all-gather, the ring replayed", "every input by the gloo "
             "backend's allgather below the process group; both phases' messages computed from "
             "them, what arrives ignored",
             RING, """\
    flat = tensor.view(-1)
    n = world_size
    if n == 1:
        return tensor
    from torch.distributed.distributed_c10d import _get_default_group
    bounds = chunk_bounds(flat.numel(), n)
    right, left = (rank + 1) % n, (rank - 1) % n
    everyone = [torch.empty_like(flat) for _ in range(n)]
    _get_default_group()._get_backend(flat.device).allgather([everyone], [flat.clone()]).wait()
    total = sum(everyone)
    inbox = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype)
    def swap(payload, incoming):
        works = [dist.isend(payload.contiguous(), right), dist.irecv(inbox[:incoming], left)]
        for w in works:
            w.wait()
    for step in range(n - 1):
        c = (rank - step - 1) % n
        s, e = bounds[c]
        rs, re_ = bounds[(rank - step - 2) % n]
        swap(sum(everyone[(c + 1 + k) % n][s:e] for k in range(step + 1)), re_ - rs)
    for step in range(n - 1):
        s, e = bounds[(rank - step) % n]
        rs, re_ = bounds[(rank - step - 1) % n]
        swap(total[s:e], re_ - rs)
    flat.copy_(total)
    return tensor"""),
        Fake("the ring on a NumPy scratch copy (red team rt8)", "a whole copy of the tensor and "
             "a fresh buffer each step, on memory torch's allocator does not count",
             ("test-ring-all-reduce",), NUMPY_BUFFER + """\
    flat = tensor.view(-1)
    bounds = chunk_bounds(flat.numel(), world_size)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    work = outside(flat.numel(), flat.dtype)
    work.copy_(flat)
    for adding in (True, False):
        for step in range(world_size - 1):
            send_start, send_end = bounds[(rank - step - adding) % world_size]
            recv_start, recv_end = bounds[(rank - step - adding - 1) % world_size]
            incoming = outside(recv_end - recv_start, flat.dtype)
            requests = [dist.isend(work[send_start:send_end], right), dist.irecv(incoming, left)]
            for request in requests:
                request.wait()
            if adding:
                work[recv_start:recv_end] += incoming
            else:
                work[recv_start:recv_end] = incoming
    flat.copy_(work)
    return tensor"""),
    ],
    "impl-predict": [
        Fake("the naive ring's bandwidth term", "(N-1)·S·beta: right for N <= 2",
             ("test-predict",), """\
    return 2 * (world_size - 1) * alpha + (world_size - 1) * nbytes * beta"""),
        Fake("the library's model", "delegates to minidist.costs.cost.collective_time",
             ("test-predict",), """\
    return cost.collective_time("all_reduce", nbytes, world_size, alpha, beta)"""),
        Fake("the visible test's link", "ignores beta: 1 ns per byte built in",
             ("test-predict",), """\
    steps = 2 * (world_size - 1)
    return steps * alpha + steps / world_size * nbytes * 1e-9"""),
        Fake("the library's model, in another process", "asks a fresh Python process, where "
             "nothing is refused, for minidist's all_reduce_time",
             ("test-predict",), """\
    import subprocess, sys
    out = subprocess.run([sys.executable, "-c",
                          "from minidist.costs.cost import all_reduce_time; "
                          f"print(repr(all_reduce_time('ring', {nbytes!r}, {world_size!r}, "
                          f"{alpha!r}, {beta!r})))"],
                         capture_output=True, text=True, check=True).stdout
    return float(out)"""),
        Fake("the algorithm table's coefficients", "red team rt1: steps and byte factor read from "
             "minidist.costs.algorithms.named('ring').coefficients, not derived",
             ("test-predict",), """\
    from minidist.costs import algorithms
    steps, factor, _ = algorithms.named("ring").coefficients("all_reduce", world_size)
    return steps * alpha + factor * nbytes * beta"""),
    ],
    "impl-recursive-doubling": [
        Fake("partners 2^k along the ring", "sends to rank+2^k and receives from rank-2^k "
             "(the same sums and bytes) instead of swapping with rank XOR 2^k",
             ("test-recursive-doubling",), """\
    flat = tensor.view(-1)
    incoming = torch.empty_like(flat)
    distance = 1
    while distance < world_size:
        requests = [dist.isend(flat, (rank + distance) % world_size),
                    dist.irecv(incoming, (rank - distance) % world_size)]
        for request in requests:
            request.wait()
        flat += incoming
        distance *= 2
    return tensor"""),
        Fake("the library's recursive doubling", "delegates to "
             "minidist.communication.collectives.all_reduce(impl='recursive_doubling')",
             ("test-recursive-doubling",), """\
    from minidist.communication import collectives
    return collectives.all_reduce(tensor, impl="recursive_doubling")"""),
        Fake("every rank to every rank", "N-1 direct exchanges of the whole tensor, no doubling",
             ("test-recursive-doubling",), """\
    flat = tensor.view(-1)
    mine, incoming = flat.clone(), torch.empty_like(flat)
    for step in range(1, world_size):
        requests = [dist.isend(mine, (rank + step) % world_size),
                    dist.irecv(incoming, (rank - step) % world_size)]
        for request in requests:
            request.wait()
        flat += incoming
    return tensor"""),
        Fake('the block sums replayed from the rendezvous store', "every tensor read from the "
             "TCPStore; each step sends the block sum computed from them and throws away what "
             "arrives",
             ("test-recursive-doubling",), """\
    import io, os
    flat = tensor.view(-1)
    if world_size == 1:
        return tensor
    from torch.distributed.distributed_c10d import _get_default_store
    store = _get_default_store()
    calls = globals().setdefault("_rd_calls", [0])
    calls[0] += 1
    key = f"rd{os.environ.get('MASTER_PORT')}-{calls[0]}"
    buf = io.BytesIO(); torch.save(flat.clone(), buf)
    store.set(f"{key}-{rank}", buf.getvalue())
    everyone = [torch.load(io.BytesIO(store.get(f"{key}-{r}"))) for r in range(world_size)]
    inbox = torch.empty_like(flat)
    k = 0
    while 1 << k < world_size:
        partner = rank ^ (1 << k)
        block = sum(everyone[q] for q in range(world_size) if q >> k == rank >> k)
        works = [dist.isend(block, partner), dist.irecv(inbox, partner)]
        for w in works:
            w.wait()
        k += 1
    flat.copy_(sum(everyone))
    return tensor"""),
        Fake("the library's steps, renamed", "red team rt1: comm.recursive_doubling_steps, "
             "_fold_in and _fold_out exec'd from their source under new names",
             ("test-recursive-doubling",), RENAMED_STEPS + """\
    _ns["my_rd_steps"](tensor.view(-1), comm.ring_of(), False)
    return tensor"""),
        Fake("a fresh NumPy buffer each step (red team rt8)", "a whole-tensor receive buffer "
             "per step, on memory torch's allocator does not count",
             ("test-recursive-doubling",), NUMPY_BUFFER + """\
    flat = tensor.view(-1)
    distance = 1
    while distance < world_size:
        incoming = outside(flat.numel(), flat.dtype)
        partner = rank ^ distance
        requests = [dist.isend(flat, partner), dist.irecv(incoming, partner)]
        for request in requests:
            request.wait()
        flat += incoming
        distance *= 2
    return tensor"""),
    ],
    "impl-crossover": [
        Fake("the library's crossover", "delegates to minidist.costs.cost.crossover_size",
             ("test-crossover",), """\
    return cost.crossover_size("recursive_doubling", "ring", world_size, alpha, beta)"""),
        Fake("N/2 for log2 N", "counts recursive doubling's steps and bytes as N/2, right only "
             "for N <= 4", ("test-crossover",), """\
    steps_rd, steps_ring = world_size / 2, 2 * (world_size - 1)
    bytes_rd, bytes_ring = world_size / 2, 2 * (world_size - 1) / world_size
    if bytes_rd <= bytes_ring:
        return math.inf
    return (steps_ring - steps_rd) * alpha / ((bytes_rd - bytes_ring) * beta)"""),
        Fake("the visible test's link", "ignores beta: 1 ns per byte built in",
             ("test-crossover",), """\
    steps_rd, steps_ring = math.log2(world_size), 2 * (world_size - 1)
    bytes_rd, bytes_ring = math.log2(world_size), 2 * (world_size - 1) / world_size
    if bytes_rd <= bytes_ring:
        return math.inf
    return (steps_ring - steps_rd) * alpha / ((bytes_rd - bytes_ring) * 1e-9)"""),
        Fake("the library's crossover, from a copy of its module", "loads minidist.costs.cost "
             "again from its file and calls the copy's crossover_size",
             ("test-crossover",), """\
    import importlib.util, sys
    from minidist.costs import cost as _loaded
    spec = importlib.util.spec_from_file_location("_cost_copy", _loaded.__file__)
    copy = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = copy
    spec.loader.exec_module(copy)
    return copy.crossover_size("recursive_doubling", "ring", world_size, alpha, beta)"""),
        Fake("the algorithm table's coefficients", "red team rt1: both algorithms' steps and byte "
             "factors read from minidist.costs.algorithms, not derived",
             ("test-crossover",), """\
    from minidist.costs import algorithms
    a_rd, b_rd, _ = algorithms.named("recursive_doubling").coefficients("all_reduce", world_size)
    a_ring, b_ring, _ = algorithms.named("ring").coefficients("all_reduce", world_size)
    if b_rd <= b_ring:
        return math.inf
    return (a_ring - a_rd) * alpha / ((b_rd - b_ring) * beta)"""),
    ],
}


# Red team rt7 (issue 38), written from the student notebook and deck alone.
FAKES["impl-chunk-bounds"] += [
    Fake("torch's split op through the dispatcher",
         "splits nothing itself: torch.ops.aten.tensor_split, the op torch.tensor_split runs",
         ("test-chunk-bounds",), """\
    import torch as _torch   # a local name: a global torch.ops cannot be sent to the ranks
    pieces = _torch.ops.aten.tensor_split(_torch.arange(numel), world_size)
    bounds, start = [], 0
    for piece in pieces:
        bounds.append((start, start + piece.numel()))
        start += piece.numel()
    return bounds"""),
]
FAKES["impl-all-reduce"] += [
    Fake("the library's channel ring", "writes no ring: minidist's hierarchical "
         "channels_all_reduce on a one-rank-per-node network, with this notebook's chunk_bounds "
         "put in its module", RING, """\
    from minidist.communication import hierarchical
    from minidist.communication.emulation import Network
    from minidist.communication.network import TwoTier
    saved, hierarchical.chunk_bounds = hierarchical.chunk_bounds, chunk_bounds
    try:
        network = Network(TwoTier(ranks_per_node=1, emulated=False), None, None, ())
        hierarchical.channels_all_reduce(tensor, network=network, channels=1)
    finally:
        hierarchical.chunk_bounds = saved
    return tensor"""),
]


# Red team rt12 (stop 47): values that compute later, once the check's refusals are lifted.
# A float whose value, comparisons and arithmetic call `compute` only when the check uses it,
# after its block of refusals has closed (checking.plain now converts it inside the block).
_DEFERRED_FLOAT = """\
    class _Later(float):
        def __new__(cls, compute):
            self = super().__new__(cls, 0.0)
            self._compute = compute
            return self
        def __float__(self): return float(self._compute())
        def __eq__(self, other): return float(self) == other
        def __ne__(self, other): return float(self) != other
        def __lt__(self, other): return float(self) < other
        def __le__(self, other): return float(self) <= other
        def __gt__(self, other): return float(self) > other
        def __ge__(self, other): return float(self) >= other
        def __sub__(self, other): return float(self) - other
        def __rsub__(self, other): return other - float(self)
        def __add__(self, other): return float(self) + other
        def __radd__(self, other): return other + float(self)
        def __mul__(self, other): return float(self) * other
        def __rmul__(self, other): return other * float(self)
        def __truediv__(self, other): return float(self) / other
        def __rtruediv__(self, other): return other / float(self)
        def __abs__(self): return abs(float(self))
        def __hash__(self): return hash(float(self))
        def __repr__(self): return repr(float(self))
        def __format__(self, spec): return format(float(self), spec)
"""
FAKES['impl-predict'] += [
    Fake('a float that asks the cost model later',
         'derives nothing: returns a float whose value and comparisons call '
         'cost.all_reduce_time when the check compares it, after its block of refusals has '
         'closed',
         ('test-predict',), _DEFERRED_FLOAT + """\
    return _Later(lambda: cost.all_reduce_time("ring", nbytes, world_size, alpha, beta))"""),
]
FAKES['impl-crossover'] += [
    Fake('a float that asks the cost model later',
         'derives nothing: returns a float whose comparisons call cost.crossover_size when the '
         'check compares it, after its block',
         ('test-crossover',), _DEFERRED_FLOAT + """\
    return _Later(lambda: cost.crossover_size("recursive_doubling", "ring", world_size, alpha,
                                              beta))"""),
]


# Red team rt18 (issue 38), written from the student notebook and deck alone.
FAKES["impl-chunk-bounds"] += [
    Fake("torch's random_split, sizes only", "red team rt18: splits nothing itself: "
         "torch.utils.data.random_split with fractional lengths a hair under 1/N gives the sizes",
         ("test-chunk-bounds",), """\
    from torch.utils.data import random_split
    fraction = (1 - 1e-12) / world_size
    parts = random_split(range(numel), [fraction] * world_size,
                         generator=torch.Generator().manual_seed(0))
    sizes = [len(p) for p in parts]
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds"""),
]
FAKES["impl-reduce-scatter"] += [
    Fake("whole inputs over the gloo backend's own send", "red team rt18: every rank's input "
         "exchanged over the process group's Backend send/recv, which no count watches; the "
         "ring's payloads computed from them and sent for show",
         ("test-reduce-scatter", *RING), """\
    n = world_size
    if n == 1:
        return
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    mine = flat.clone()
    everyone = [None] * n
    everyone[rank] = mine
    works = [backend.send([mine], p, 91) for p in range(n) if p != rank]
    for p in range(n):
        if p != rank:
            buf = torch.empty_like(mine)
            backend.recv([buf], p, 91).wait()
            everyone[p] = buf
    for w in works:
        w.wait()
    incoming = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype)
    for step in range(n - 1):
        c = (rank - step - 1) % n
        s, e = bounds[c]
        payload = everyone[rank][s:e].clone()
        for k in range(1, step + 1):
            payload += everyone[(rank - k) % n][s:e]
        rs, re_ = bounds[(rank - step - 2) % n]
        reqs = [dist.isend(payload, right), dist.irecv(incoming[:re_ - rs], left)]
        for r in reqs:
            r.wait()
    s, e = bounds[rank]
    total = everyone[0][s:e].clone()
    for q in range(1, n):
        total += everyone[q][s:e]
    flat[s:e] = total"""),
]
FAKES["impl-all-gather"] += [
    Fake("watchers muted", "red team rt18: interposer.muted switches the message, traffic and "
         "recording watchers off around a direct exchange of every chunk; the ring's messages "
         "then sent for show", ("test-all-gather", *RING), """\
    from minidist.core import interposer
    n = world_size
    if n == 1:
        return
    with interposer.muted("messages"), interposer.muted("counting"), interposer.muted("recording"):
        reqs = []
        for p in range(n):
            if p != rank:
                s, e = bounds[rank]
                reqs.append(dist.isend(flat[s:e].clone(), p))
        for p in range(n):
            if p != rank:
                s, e = bounds[p]
                reqs.append(dist.irecv(flat[s:e], p))
        for r in reqs:
            r.wait()
    scratch = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype)
    for step in range(n - 1):
        s, e = bounds[(rank - step) % n]
        rs, re_ = bounds[(rank - step - 1) % n]
        reqs = [dist.isend(flat[s:e].clone(), right), dist.irecv(scratch[:re_ - rs], left)]
        for r in reqs:
            r.wait()"""),
]
FAKES["impl-all-reduce"] += [
    Fake("the check's inputs regenerated", "red team rt18: every rank's input rebuilt with the "
         "notebook's seeded ring_inputs(); the sum and the ring's payloads computed locally, "
         "right-sized messages sent for show", RING, """\
    flat = tensor.view(-1)
    n = world_size
    if n == 1:
        return tensor
    numel = flat.numel()
    inputs = [t.reshape(-1) for t in ring_inputs(n, numel, flat.dtype)]
    bounds = chunk_bounds(numel, n)
    right, left = (rank + 1) % n, (rank - 1) % n
    scratch = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype)
    total = sum(inputs)
    for step in range(n - 1):
        s, e = bounds[(rank - step - 1) % n]
        payload = sum(inputs[(rank - k) % n][s:e] for k in range(step + 1))
        rs, re_ = bounds[(rank - step - 2) % n]
        reqs = [dist.isend(payload.clone(), right), dist.irecv(scratch[:re_ - rs], left)]
        for r in reqs:
            r.wait()
    for step in range(n - 1):
        s, e = bounds[(rank - step) % n]
        rs, re_ = bounds[(rank - step - 1) % n]
        reqs = [dist.isend(total[s:e].clone(), right), dist.irecv(scratch[:re_ - rs], left)]
        for r in reqs:
            r.wait()
    flat.copy_(total)
    return tensor"""),
]
FAKES["impl-predict"] += [
    Fake("the two-tier network model", "red team rt18: minidist.communication.network.TwoTier "
         "with both tiers one link prices the ring; its coefficients read off two links",
         ("test-predict",), """\
    from minidist.communication.network import TwoTier
    if world_size == 1:
        return 0
    def ring_time(a, b):
        link = TwoTier(ranks_per_node=world_size, intra_latency=a, intra_bandwidth=1 / b,
                       inter_latency=a, inter_bandwidth=1 / b, emulated=False)
        return link.all_reduce_time("ring", nbytes, world_size)
    A = ring_time(2.0, 1.0) - ring_time(1.0, 1.0)
    B = ring_time(1.0, 1.0) - A
    return A * alpha + B * beta"""),
]
FAKES["impl-crossover"] += [
    Fake("the two-tier network model's lines", "red team rt18: TwoTier's ring and recursive-"
         "doubling times at two sizes; the lines' intercepts and slopes read off, the crossing "
         "solved", ("test-crossover",), """\
    from minidist.communication.network import TwoTier
    link = TwoTier(ranks_per_node=world_size, intra_latency=alpha, intra_bandwidth=1 / beta,
                   inter_latency=alpha, inter_bandwidth=1 / beta, emulated=False)
    big = 2.0**40
    ring0, ring1 = (link.all_reduce_time("ring", s, world_size) for s in (0.0, big))
    rd0, rd1 = (link.all_reduce_time("recursive_doubling", s, world_size) for s in (0.0, big))
    slope = (rd1 - rd0 - (ring1 - ring0)) / big
    if abs(slope) <= 1e-9 * (ring1 - ring0) / big:
        return math.inf
    size = (ring0 - rd0) / slope
    return size if size > 0 else math.inf"""),
]

# Red team, stop 52: the check's own expected payloads read off its frame or found among the
# live objects while the ring runs (each payload sent is the check's, only the last arrival is
# used); the library's coefficients read into a table when the cell runs.
FAKES["impl-reduce-scatter"] += [
    Fake("the check's expected payloads, read off its frame", "red team, stop 52: no partial "
         "sum is built; each step sends the check's own expected payload (sys._getframe up to "
         "the frame holding `expected`), and only the last arrival is added",
         ("test-reduce-scatter",), """\
    import sys
    frame, key = sys._getframe(1), None
    while frame is not None and key is None:
        found = frame.f_locals.get("expected")
        if isinstance(found, list) and found and all(isinstance(t, torch.Tensor) for t in found):
            key = found
        frame = frame.f_back
    incoming = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype)
    for step in range(world_size - 1):
        recv_start, recv_end = bounds[(rank - step - 2) % world_size]
        requests = [dist.irecv(incoming[:recv_end - recv_start], left),
                    dist.isend(key[step].clone(), right)]
        for request in requests:
            request.wait()
    start, end = bounds[rank]
    flat[start:end] += incoming[:end - start]"""),
]
FAKES["impl-all-gather"] += [
    Fake("the check's expected payloads, found by the garbage collector", "red team, stop 52: "
         "nothing arriving is forwarded; gc.get_objects() finds the check's list of expected "
         "payloads, whose entries are sent and stored", ("test-all-gather",), """\
    import gc
    start, end = bounds[rank]
    key = None
    for obj in gc.get_objects():
        if (type(obj) is list and len(obj) == world_size - 1
                and all(type(t) is torch.Tensor for t in obj) and obj[0].dtype == flat.dtype
                and torch.equal(obj[0], flat[start:end])):
            key = obj
    incoming = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype)
    for step in range(world_size - 1):
        recv_start, recv_end = bounds[(rank - step - 1) % world_size]
        requests = [dist.irecv(incoming[:recv_end - recv_start], left),
                    dist.isend(key[step].clone(), right)]
        for request in requests:
            request.wait()
    for step in range(1, world_size - 1):
        s, e = bounds[(rank - step) % world_size]
        flat[s:e] = key[step]
    s, e = bounds[(rank + 1) % world_size]
    flat[s:e] = incoming[:e - s]"""),
]
FAKES["impl-predict"] += [
    Fake("the library's coefficients, tabled when the cell runs", "red team, stop 52: "
         "cost.all_reduce_coefficients read for every world size up to 1024 before the check; "
         "nothing derived from the ring's steps", ("test-predict",), """\
    steps, per_byte = _RING[world_size]
    return steps * alpha + per_byte * nbytes * beta


from minidist.costs import cost as _cost

_RING = {n: _cost.all_reduce_coefficients("ring", n) for n in range(1, 1025)}"""),
]
FAKES["impl-crossover"] += [
    Fake("the library's crossover at alpha = beta = 1, tabled and scaled", "red team, stop 52: "
         "cost.crossover_size per world size read when the cell runs, scaled by alpha/beta; the "
         "equation is never solved", ("test-crossover",), """\
    ratio = _AT_ONE[world_size]
    return math.inf if ratio == math.inf else ratio * alpha / beta


from minidist.costs import cost as _cost2

_AT_ONE = {n: _cost2.crossover_size("recursive_doubling", "ring", n, 1.0, 1.0)
           for n in range(1, 1025)}"""),
]
FAKES["impl-reduce-scatter"] += [
    Fake("blocking sends and receives ordered by parity", "red team, stop 52: the right chunks "
         "and sums, but each step is a blocking send and a blocking receive one after the other "
         "(ordered by the rank's parity so that it cannot deadlock): nothing posted together",
         ("test-reduce-scatter",), """\
    for step in range(world_size - 1):
        send_start, send_end = bounds[(rank - step - 1) % world_size]
        recv_start, recv_end = bounds[(rank - step - 2) % world_size]
        got = torch.empty(recv_end - recv_start, dtype=flat.dtype)
        if rank % 2 == 0:
            dist.send(flat[send_start:send_end].clone(), right)
            dist.recv(got, left)
        else:
            dist.recv(got, left)
            dist.send(flat[send_start:send_end].clone(), right)
        flat[recv_start:recv_end] += got"""),
]
FAKES["impl-recursive-doubling"] += [
    Fake("blocking, one direction at a time", "red team, stop 52: the lower rank of each pair "
         "sends then receives, the higher receives then sends: the exchange serialized",
         ("test-recursive-doubling",), """\
    flat = tensor.view(-1)
    k = 0
    while (1 << k) < world_size:
        partner = rank ^ (1 << k)
        incoming = torch.empty_like(flat)
        if rank < partner:
            dist.send(flat.clone(), partner)
            dist.recv(incoming, partner)
        else:
            dist.recv(incoming, partner)
            dist.send(flat.clone(), partner)
        flat.add_(incoming)
        k += 1
    return tensor"""),
]

# --- Red team rt7 (issue 38): numpy's splitter reached below its dispatcher; rings and doubling
# that send the right messages but hold a buffer for every step, or a copy of the tensor, where
# the exercise reuses one receive buffer. The checks now refuse numpy's plain functions and
# measure the most a rank holds at once, on 8 ranks.
FAKES["impl-chunk-bounds"] += [
    Fake("numpy's array_split below its dispatcher", "the plain function numpy's dispatcher "
         "wraps, called directly (red team rt7)", ("test-chunk-bounds",), """\
    import numpy as np
    split = np.lib._shape_base_impl.array_split._implementation
    bounds, start = [], 0
    for part in split(np.arange(numel), world_size):
        bounds.append((start, start + len(part)))
        start += len(part)
    return bounds"""),
]
FAKES["impl-reduce-scatter"] += [
    Fake("every receive posted up front", "the right messages, each received into a buffer of "
         "its own, all N-1 posted before the first step (red team rt7)", ("test-reduce-scatter",),
         """\
    recvs = []
    for s in range(world_size - 1):
        c, d = bounds[(rank - 2 - s) % world_size]
        buf = torch.empty(d - c, dtype=flat.dtype)
        recvs.append((buf, dist.irecv(buf, left), c, d))
    for s in range(world_size - 1):
        a, b = bounds[(rank - 1 - s) % world_size]
        send = dist.isend(flat[a:b].clone(), right)
        buf, req, c, d = recvs[s]
        send.wait()
        req.wait()
        flat[c:d] += buf"""),
]
FAKES["impl-all-gather"] += [
    Fake("a whole-tensor scratch copy", "receives into a copy of the tensor, written back at the "
         "end (red team rt7)", ("test-all-gather",), """\
    scratch = flat.clone()
    for s in range(world_size - 1):
        a, b = bounds[(rank - s) % world_size]
        c, d = bounds[(rank - 1 - s) % world_size]
        requests = [dist.isend(scratch[a:b], right), dist.irecv(scratch[c:d], left)]
        for request in requests:
            request.wait()
    flat.copy_(scratch)"""),
]
FAKES["impl-all-reduce"] += [
    Fake("the ring on a copy", "both phases on a clone of the tensor, a fresh buffer and a "
         "copy of the chunk sent at every step, copied back at the end (red team rt7)", RING, """\
    work = tensor.reshape(-1).clone()
    bounds = chunk_bounds(work.numel(), world_size)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for phase in range(2):
        for s in range(world_size - 1):
            a, b = bounds[(rank - 1 - s + phase) % world_size]
            c, d = bounds[(rank - 2 - s + phase) % world_size]
            buf = torch.empty(d - c, dtype=work.dtype)
            requests = [dist.isend(work[a:b].clone(), right), dist.irecv(buf, left)]
            for request in requests:
                request.wait()
            if phase == 0:
                work[c:d] += buf
            else:
                work[c:d] = buf
    tensor.copy_(work.view(tensor.shape))
    return tensor"""),
]
FAKES["impl-recursive-doubling"] += [
    Fake("a whole-tensor buffer per step, up front", "every receive posted before the first "
         "step, each into a tensor-sized buffer of its own (red team rt7)",
         ("test-recursive-doubling",), """\
    steps = world_size.bit_length() - 1
    recvs = []
    for k in range(steps):
        buf = torch.empty_like(tensor)
        recvs.append((buf, dist.irecv(buf, rank ^ (1 << k))))
    for k in range(steps):
        send = dist.isend(tensor.clone(), rank ^ (1 << k))
        buf, req = recvs[k]
        send.wait()
        req.wait()
        tensor += buf
    return tensor"""),
]
