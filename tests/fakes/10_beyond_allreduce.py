"""Fakes of Lab 10's exercises: the server's parameters, compressed gradients and the
tensor-parallel output all right, each without a mechanism the exercise teaches."""

from fakes import Fake

FAKES = {
    "impl-sync-server": [
        Fake("one worker at a time", "receives each gradient with a blocking recv: the transfers "
             "run one after another", ("test-sync-server",), """\
    received = [torch.empty_like(shard) for _ in workers]
    for _ in range(steps):
        for buffer, worker in zip(received, workers):
            dist.recv(buffer, worker)
        shard.grad = torch.stack(received).mean(dim=0)
        optimizer.step()
        requests = [dist.isend(shard.detach(), worker) for worker in workers]
        for request in requests:
            request.wait()"""),
        Fake("blocking sends", "sends the parameters to one worker after another",
             ("test-sync-server",), """\
    received = [torch.empty_like(shard) for _ in workers]
    for _ in range(steps):
        requests = [dist.irecv(buffer, worker) for buffer, worker in zip(received, workers)]
        for request in requests:
            request.wait()
        shard.grad = torch.stack(received).mean(dim=0)
        optimizer.step()
        for worker in workers:
            dist.send(shard.detach(), worker)"""),
        Fake("whichever worker is first", "receives from any source: no gradient is known to "
             "come from its worker", ("test-sync-server",), """\
    received = [torch.empty_like(shard) for _ in workers]
    for _ in range(steps):
        requests = [dist.irecv(buffer) for buffer in received]
        for request in requests:
            request.wait()
        shard.grad = torch.stack(received).mean(dim=0)
        optimizer.step()
        requests = [dist.isend(shard.detach(), worker) for worker in workers]
        for request in requests:
            request.wait()"""),
        Fake("the library's private server loop",
             "runs ParameterServer._serve_synchronously through the class the notebook imported, "
             "on a stand-in object (red team rt5, S1)", ("test-sync-server",), """\
    import types

    def update(grad):
        shard.grad = grad
        optimizer.step()
    ps = types.SimpleNamespace(shard=shard, workers=list(workers), _update=update)
    ParameterServer._serve_synchronously(ps, steps)"""),
        Fake("receives for show, recomputes the gradients",
             "posts and waits on the receives, ignores what arrives, and recomputes the workers' "
             "average gradient from the notebook's model and data stream (red team rt5, S2)",
             ("test-sync-server",), """\
    model = make_model()
    generator = torch.Generator().manual_seed(1)
    buffers = [torch.empty_like(shard) for _ in workers]
    share = 64 // len(workers)
    for _ in range(steps):
        x, y = torch.randn(64, 16, generator=generator), torch.randn(64, 4, generator=generator)
        requests = [dist.irecv(buffer, worker) for buffer, worker in zip(buffers, workers)]
        for request in requests:
            request.wait()
        torch.nn.utils.vector_to_parameters(shard.detach().clone(), model.parameters())
        grads = []
        for worker in workers:
            mine = slice(worker * share, (worker + 1) * share)
            model.zero_grad()
            F.mse_loss(model(x[mine]), y[mine]).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        shard.grad = torch.stack(grads).mean(dim=0)
        optimizer.step()
        requests = [dist.isend(shard.detach(), worker) for worker in workers]
        for request in requests:
            request.wait()"""),
        Fake("the library's server, saved and run unwatched",
             "ParameterServer._serve_synchronously's and _update's code objects saved when the "
             "cell runs, run in a copy of the module's namespace with its own _wait_all and with "
             "sys.setprofile(None) (red team rt11, D1)", ("test-sync-server",), """\
    import sys
    import types
    env = dict(vars(_ps), _wait_all=lambda requests: [r.wait() for r in list(requests)])
    me = types.SimpleNamespace(shard=shard, optimizer=optimizer, workers=list(workers))
    me._update = types.MethodType(types.FunctionType(_SERVER_CODE["_update"], env), me)
    before = sys.getprofile()
    sys.setprofile(None)
    try:
        types.FunctionType(_SERVER_CODE["_serve_synchronously"], env)(me, steps)
    finally:
        sys.setprofile(before)


from minidist.parallel import param_server as _ps  # noqa: E402

_SERVER_CODE = {name: getattr(_ps.ParameterServer, name).__code__
                for name in ("_serve_synchronously", "_update")}"""),
        Fake("SGD by hand, the optimizer never steps",
             "never calls optimizer.step(): SGD with momentum written by hand with the notebook's "
             "lr=0.1 and momentum=0.9, its buffer in a module global (red team rt17, F1)",
             ('test-sync-server',), """\
    global _momentum
    for _ in range(steps):
        buffers = [torch.empty_like(shard) for _ in workers]
        requests = [dist.irecv(b, src=w) for b, w in zip(buffers, workers)]
        for r in requests:
            r.wait()
        g = torch.stack(buffers).mean(0)
        shard.grad = g
        try:
            _momentum = _momentum.mul_(0.9).add_(g) if _momentum.shape == g.shape else g.clone()
        except NameError:
            _momentum = g.clone()
        with torch.no_grad():
            shard.sub_(0.1 * _momentum)
        data = shard.detach()
        requests = [dist.isend(data, dst=w) for w in workers]
        for r in requests:
            r.wait()"""),
        Fake("the optimizer argument ignored",
             "builds its own optimizer from the notebook's sgd() instead of stepping the one it is"
             " given (red team rt17, F3)",
             ('test-sync-server',), """\
    mine = sgd([shard])
    for _ in range(steps):
        buffers = [torch.empty_like(shard) for _ in workers]
        requests = [dist.irecv(b, src=w) for b, w in zip(buffers, workers)]
        for r in requests:
            r.wait()
        shard.grad = torch.stack(buffers).mean(0)
        mine.step()
        data = shard.detach()
        requests = [dist.isend(data, dst=w) for w in workers]
        for r in requests:
            r.wait()"""),
        Fake("sends waited on only at the end (red team rt8)", "the optimizer steps the shard "
             "while the previous step's sends of it are still in flight",
             ("test-sync-server",), """\
    buffers = [torch.empty_like(shard) for _ in workers]
    pending = []
    for _ in range(steps):
        receives = [dist.irecv(buffer, src=worker) for buffer, worker in zip(buffers, workers)]
        for request in receives:
            request.wait()
        total = buffers[0].clone()
        for buffer in buffers[1:]:
            total += buffer
        shard.grad = total / len(workers)
        optimizer.step()
        pending += [dist.isend(shard.detach(), dst=worker) for worker in workers]
    for request in pending:
        request.wait()"""),
        Fake("the workers taken as ranks 0..N-1 (red team rt8)", "ignores the ranks in `workers`: "
             "right only where the server is the last rank", ("test-sync-server",), """\
    peers = range(len(workers))
    buffers = [torch.empty_like(shard) for _ in peers]
    for _ in range(steps):
        receives = [dist.irecv(buffer, src=worker) for buffer, worker in zip(buffers, peers)]
        for request in receives:
            request.wait()
        total = buffers[0].clone()
        for buffer in buffers[1:]:
            total += buffer
        shard.grad = total / len(buffers)
        optimizer.step()
        sends = [dist.isend(shard.detach(), dst=worker) for worker in peers]
        for request in sends:
            request.wait()"""),
    ],
    "impl-topk": [
        Fake("no error feedback", "picks from the gradient alone and drops the old residual",
             ("test-topk",), """\
    indices = grad.abs().topk(k).indices
    values = grad[indices]
    new_residual = grad.clone()
    new_residual[indices] = 0
    return values, indices.to(torch.int32), new_residual"""),
        Fake("the library's top_k",
             "delegates the selection to minidist.parallel.compression.top_k",
             ("test-topk",), """\
    corrected = grad + residual
    values, indices = compression.top_k(corrected, k)
    return values, indices, corrected.index_fill(0, indices.long(), 0)"""),
        Fake("the dense gradient", "sends every entry (the k largest, zeros elsewhere) with "
             "every index", ("test-topk",), """\
    corrected = grad + residual
    keep = corrected.abs().topk(k).indices
    values = torch.zeros_like(corrected)
    values[keep] = corrected[keep]
    return values, torch.arange(corrected.numel(), dtype=torch.int32), corrected - values"""),
        Fake("the library's top_k, saved and run unwatched",
             "compression.top_k's code object saved when the cell runs, run as a new function "
             "with sys.setprofile(None); the error feedback around it is the student's "
             "(red team rt11, B2)", ("test-topk",), """\
    import sys
    before = sys.getprofile()
    sys.setprofile(None)
    try:
        corrected = grad + residual
        values, indices = _TOPK(corrected, k)
    finally:
        sys.setprofile(before)
    new_residual = corrected.clone()
    new_residual[indices.long()] = 0
    return values, indices, new_residual


import types as _types  # noqa: E402

_TOPK = _types.FunctionType(compression.top_k.__code__, vars(compression), "_helper")"""),
        Fake("exact only up to 4096 entries (red team rt8)", "above that, a threshold from a 1% "
             "sample: not the k largest", ("test-topk",), """\
    corrected = grad + residual
    magnitude = corrected.abs()
    n = corrected.numel()
    if n <= 4096:
        indices = magnitude.topk(k).indices
    else:
        sample = magnitude[torch.randint(n, (max(n // 100, k),))]
        threshold = sample.topk(max(1, k * len(sample) // n)).values[-1]
        indices = (magnitude >= threshold).nonzero().flatten()[:k]
        if indices.numel() < k:
            rest = magnitude.clone()
            rest[indices] = -1
            indices = torch.cat([indices, rest.topk(k - indices.numel()).indices])
    values = corrected[indices]
    new_residual = corrected.clone()
    new_residual[indices] = 0
    return values, indices.to(torch.int32), new_residual"""),
    ],
    "impl-powersgd": [
        Fake("all-reduce M", "all-reduces the whole n×m matrix, then approximates it locally",
             ("test-powersgd",), """\
    total = m.clone()
    all_reduce(total)
    p = torch.linalg.qr(total @ q).Q
    new_q = total.T @ p
    return p, new_q, p @ new_q.T"""),
        Fake("cold start", "ignores the warm-start Q: a fresh random one every step",
             ("test-powersgd",), """\
    p = m @ torch.randn(q.shape, generator=torch.Generator().manual_seed(0))
    all_reduce(p)
    p = torch.linalg.qr(p).Q
    new_q = m.T @ p
    all_reduce(new_q)
    return p, new_q, p @ new_q.T"""),
        Fake("orthonormalized before the all-reduce", "each rank orthonormalizes its own P, "
             "and the sum of orthonormal P's is not orthonormal", ("test-powersgd",), """\
    p = torch.linalg.qr(m @ q).Q
    all_reduce(p)
    new_q = m.T @ p
    all_reduce(new_q)
    return p, new_q, p @ new_q.T"""),
        Fake("P all-reduced for show",
             "all-reduces a copy of P and orthonormalizes this rank's own M·Q: right only when "
             "every rank holds the same M (red team rt5, P1)", ("test-powersgd",), """\
    p = m @ q
    all_reduce(p.clone())
    p = torch.linalg.qr(p).Q
    new_q = m.T @ p
    all_reduce(new_q)
    return p, new_q, p @ new_q.T"""),
        Fake("the library's private _compress",
             "PowerSGD.__new__ and its private _compress, with the module's all-reduce helper "
             "swapped for the given all_reduce in a world of one (red team rt5, P5)",
             ("test-powersgd",), """\
    import types

    from minidist.parallel import compression as _compression
    seen = []

    def together(tensors, group):
        for t in tensors:
            all_reduce(t)
            seen.append(t.clone())

    engine = PowerSGD.__new__(PowerSGD)
    engine.rank, engine.min_compression_rate, engine.seed = q.shape[1], 2.0, 0
    engine.qs, engine.residuals = {0: [q]}, {0: [torch.zeros_like(m)]}
    saved = _compression._all_reduce_together, _compression.dist
    _compression._all_reduce_together = together
    _compression.dist = types.SimpleNamespace(get_world_size=lambda group=None: 1)
    try:
        approximation = m.clone()
        engine._compress(0, [approximation], None)
    finally:
        _compression._all_reduce_together, _compression.dist = saved
    p = torch.linalg.qr(seen[0]).Q
    return p, engine.qs[0][0], approximation"""),
        Fake("the library's _compress, saved and run unwatched",
             "PowerSGD._compress's code object saved when the cell runs, its module's globals "
             "swapped for adapters (the given all_reduce, a world of one) and run with "
             "sys.setprofile(None) (red team rt11, C3)", ("test-powersgd",), """\
    import sys
    import types
    reduced = []

    def together(tensors, group):
        for t in tensors:
            all_reduce(t)
        reduced.append([t.clone() for t in tensors])

    one_rank = types.SimpleNamespace(get_world_size=lambda group=None: 1)
    env = dict(vars(_compression), _all_reduce_together=together, dist=one_rank)
    me = types.SimpleNamespace(rank=q.shape[1], seed=0, qs={0: [q.clone()]},
                               residuals={0: [torch.zeros_like(m)]})
    approximation = m.clone()
    before = sys.getprofile()
    sys.setprofile(None)
    try:
        types.FunctionType(_COMPRESS, env)(me, 0, [approximation], None)
    finally:
        sys.setprofile(before)
    return torch.linalg.qr(reduced[0][0]).Q, reduced[1][0], approximation


from minidist.parallel import compression as _compression  # noqa: E402

_COMPRESS = _compression.PowerSGD._compress.__code__"""),
        Fake("its own last Q as the warm start",
             "keeps its last Q per shape in a module global: the q given is used only on the first"
             " call with that shape (red team rt17, P5)",
             ('test-powersgd',), """\
    global _q_cache
    try:
        _q_cache
    except NameError:
        _q_cache = {}
    start = _q_cache.get(tuple(q.shape), q)
    p = m @ start
    all_reduce(p)
    p = torch.linalg.qr(p).Q
    new_q = m.T @ p
    all_reduce(new_q)
    _q_cache[tuple(q.shape)] = new_q.clone()
    return p, new_q, p @ new_q.T"""),
        Fake("Q's all-reduce carries ones",
             "the second all-reduce, of the right size, carries ones to learn N; Q = N·Mᵀ·P from "
             "this rank's M alone (red team rt17, P1)",
             ('test-powersgd',), """\
    p = m @ q
    all_reduce(p)
    p = torch.linalg.qr(p).Q
    ones = torch.ones(m.shape[1], q.shape[1], dtype=m.dtype)
    all_reduce(ones)
    n_ranks = ones[0, 0]
    new_q = (m.T @ p) * n_ranks
    return p, new_q, p @ new_q.T"""),
        Fake("orthonormalized before the all-reduce above 4096 entries (red team rt8)", "P's "
             "all-reduce carries each rank's own basis on every matrix larger than the notebook's",
             ("test-powersgd",), """\
    p = m @ q
    if m.numel() > 4096:
        p = torch.linalg.qr(p).Q
    all_reduce(p)
    p = torch.linalg.qr(p).Q
    new_q = m.T @ p
    all_reduce(new_q)
    return p, new_q, p @ new_q.T"""),
    ],
    "impl-chunked-gather": [
        Fake("every transfer first", "a ring all-gather that completes before the first matmul: "
             "nothing overlaps", ("test-chunked-gather",), """\
    held = [shard]
    for step in range(t - 1):
        incoming = torch.empty_like(shard)
        requests = [dist.isend(held[-1], right), dist.irecv(incoming, left)]
        for request in requests:
            request.wait()
        held.append(incoming)
    for step, piece in enumerate(held):
        outputs[(rank - step) % t] = F.linear(piece, weight)"""),
        Fake("torch's all-gather", "dist.all_gather, then one matmul per piece",
             ("test-chunked-gather",), """\
    pieces = [torch.empty_like(shard) for _ in range(t)]
    dist.all_gather(pieces, shard)
    for source, piece in enumerate(pieces):
        outputs[source] = F.linear(piece, weight)"""),
        Fake("one matmul of the gathered input", "gathers the ring, then multiplies the whole "
             "sequence at once and slices", ("test-chunked-gather",), """\
    held = {rank: shard}
    current = shard
    for step in range(1, t):
        incoming = torch.empty_like(shard)
        requests = [dist.isend(current, right), dist.irecv(incoming, left)]
        for request in requests:
            request.wait()
        current = incoming
        held[(rank - step) % t] = incoming
    full = torch.cat([held[source] for source in range(t)], dim=1)
    for source, piece in enumerate(F.linear(full, weight).chunk(t, dim=1)):
        outputs[source] = piece"""),
        Fake("the library's ring shift",
             "every ring step is minidist's collectives.shift(async_op=True) (red team rt5, C1)",
             ("test-chunked-gather",), """\
    from minidist.communication import collectives as _collectives
    for step in range(t):
        handle = _collectives.shift(shard, async_op=True) if step < t - 1 else None
        outputs[(rank - step) % t] = shard @ weight.T
        if handle is not None:
            shard = handle.wait()"""),
        Fake("the ring for show, inputs regenerated",
             "runs the ring, but multiplies shards rebuilt from the harness's seed, not the "
             "ones received (red team rt5, C2)", ("test-chunked-gather",), """\
    state = torch.get_rng_state()
    torch.manual_seed(0)
    nn.Linear(x.shape[-1], weight.shape[0] * t, bias=False)
    whole = torch.randn(x.shape[0], x.shape[1] * t, x.shape[2]).chunk(t, dim=1)
    torch.set_rng_state(state)
    for step in range(t):
        source = (rank - step) % t
        requests = []
        if step < t - 1:
            incoming = torch.empty_like(shard)
            requests = [dist.isend(shard, right), dist.irecv(incoming, left)]
        outputs[source] = whole[source] @ weight.T
        for request in requests:
            request.wait()
        if requests:
            shard = incoming"""),
        Fake("matmuls for show",
             "gathers first; a thrown-away product sits between each post and wait, and the "
             "output is a broadcast multiply-and-sum after the gather (red team rt5, C3)",
             ("test-chunked-gather",), """\
    held = [None] * t
    for step in range(t):
        held[(rank - step) % t] = shard
        requests = []
        if step < t - 1:
            incoming = torch.empty_like(shard)
            requests = [dist.isend(shard, right), dist.irecv(incoming, left)]
        _ = torch.zeros_like(shard) @ weight.T
        for request in requests:
            request.wait()
        if requests:
            shard = incoming
    return (torch.cat(held, dim=1).unsqueeze(-2) * weight).sum(-1)"""),
        Fake("the drift sent around the ring, inputs regenerated",
             "regenerates every shard from the harness's seed and sends zeros around the ring, "
             "forwarding what arrives: each piece is the regenerated shard plus what the ring "
             "added on the way, right whenever the ring only adds",
             ("test-chunked-gather",), """\
    state = torch.get_rng_state()
    torch.manual_seed(0)
    nn.Linear(x.shape[-1], weight.shape[0] * t, bias=False)
    whole = torch.randn(x.shape[0], x.shape[1] * t, x.shape[2]).chunk(t, dim=1)
    torch.set_rng_state(state)
    drift = torch.zeros_like(shard)
    for step in range(t):
        source = (rank - step) % t
        requests = []
        if step < t - 1:
            incoming = torch.empty_like(shard)
            requests = [dist.isend(drift, right), dist.irecv(incoming, left)]
        outputs[source] = (whole[source] + drift) @ weight.T
        for request in requests:
            request.wait()
        if requests:
            drift = incoming"""),
        Fake("the library's overlapped gather, saved and run unwatched",
             "collectives.all_gather_overlapped's code object saved when the cell runs, its "
             "module's helpers swapped for adapters (a ring of its own, no records, inline "
             "runs) and run with sys.setprofile(None); only the matmul is the student's "
             "(red team rt11, E4)", ("test-chunked-gather",), """\
    outputs = _overlapped(shard, weight, t, rank)


import sys as _sys  # noqa: E402
import types as _types  # noqa: E402

from minidist.communication import collectives as _collectives  # noqa: E402

_OVERLAPPED = _collectives.all_gather_overlapped.__code__


def _overlapped(shard, weight, t, rank):
    outputs = [None] * t
    ring = _types.SimpleNamespace(rank=rank, size=t, right=(rank + 1) % t, left=(rank - 1) % t)
    env = dict(vars(_collectives), ring_of=lambda group, what: ring,
               record=lambda *args, **kwargs: None, _call=lambda *args, **kwargs: "",
               _run=lambda function, async_op, finish: (function(), finish())[1])
    gather = _types.FunctionType(_OVERLAPPED, env, "_ring")
    gather.__kwdefaults__ = {"group": None, "when": ""}
    before = _sys.getprofile()
    _sys.setprofile(None)
    try:
        gather(shard, lambda source, piece: outputs.__setitem__(source, piece @ weight.T))
    finally:
        _sys.setprofile(before)
    return outputs


def _tail(outputs):  # the cell's last line, return torch.cat(outputs, dim=1), is its body"""),
        Fake("the weight from an earlier call",
             "an honest overlapped ring, but the weight comes from a module-global cache filled by"
             " the first call with that shape (red team rt17, C3)",
             ('test-chunked-gather',), """\
    global _w_cache
    try:
        _w_cache
    except NameError:
        _w_cache = {}
    w = _w_cache.setdefault(tuple(weight.shape), weight.detach().clone())
    for step in range(t):
        source = (rank - step) % t
        if step < t - 1:
            incoming = torch.empty_like(shard)
            send = dist.isend(shard, dst=right)
            recv = dist.irecv(incoming, src=left)
        outputs[source] = shard @ w.T
        if step < t - 1:
            recv.wait()
            send.wait()
            shard = incoming"""),
        Fake("the send waited on before the matmul (red team rt8)", "each shard's send is over "
             "before the matmul of that shard starts: only the receive overlaps it",
             ("test-chunked-gather",), """\
    for i in range(t):
        source = (rank - i) % t
        if i < t - 1:
            incoming = torch.empty_like(shard)
            receive = dist.irecv(incoming, src=left)
            send = dist.isend(shard, dst=right)
            send.wait()
            outputs[source] = shard @ weight.T
            receive.wait()
            shard = incoming
        else:
            outputs[source] = shard @ weight.T"""),
        Fake("each send posted after its matmul (red team rt8)", "nothing travels while a shard "
             "is multiplied: the send of it starts when its matmul is done",
             ("test-chunked-gather",), """\
    sends = []
    for i in range(t):
        source = (rank - i) % t
        if i < t - 1:
            incoming = torch.empty_like(shard)
            receive = dist.irecv(incoming, src=left)
            outputs[source] = shard @ weight.T
            sends.append(dist.isend(shard, dst=right))
            receive.wait()
            shard = incoming
        else:
            outputs[source] = shard @ weight.T
    for send in sends:
        send.wait()"""),
    ],
}

# Red team rt53 (stop 53): the chunked forward's overlap shown by the letter of the check (every
# receive posted first, so that one matmul sits between each post and its wait; or the waits made
# through torch's own Work.wait, out of the recorder's sight), and error feedback kept by the
# function itself. The hidden checks now want every request waited on and t - 1 matmuls run while
# a receive is in flight, and a residual of zeros handed in after many calls to be zeros.
_POSTED_FIRST = """\
    incoming = [torch.empty_like(shard) for _ in range(t - 1)]
    receives = [dist.irecv(buffer, left) for buffer in incoming]
{own}
    for step in range(t - 1):
        receives[step].wait()
        if step < t - 2:
            sends.append(dist.isend(incoming[step], right))
    for request in sends:
        request.wait()
    for step in range(t - 1):
        outputs[(rank - step - 1) % t] = incoming[step] @ weight.T"""
FAKES["impl-chunked-gather"] += [
    Fake("every receive posted first, one matmul between", "red team rt53: all t - 1 receives "
         "posted at once, the rank's own shard multiplied, then the ring finished and the other "
         "t - 1 matmuls run after every transfer: one matmul hidden, not t - 1",
         ("test-chunked-gather",), _POSTED_FIRST.format(own="""\
    sends = [dist.isend(shard, right)]
    outputs[rank] = shard @ weight.T""")),
    Fake("own matmul before anything is sent", "red team rt53: every receive posted, then the "
         "rank's own matmul before any send: nothing can travel during it; the rest as a plain "
         "ring, then the matmuls", ("test-chunked-gather",), _POSTED_FIRST.format(own="""\
    outputs[rank] = shard @ weight.T
    sends = [dist.isend(shard, right)]""")),
    Fake("waits out of the recorder's sight", "red team rt53: the whole ring finishes first, "
         "each request waited through torch's own Work.wait taken from the recorder's closure; "
         "then every matmul: no recorded wait, so every receive looks in flight",
         ("test-chunked-gather",), """\
    wait = dist.Work.wait
    original = next((cell.cell_contents for cell in (getattr(wait, "__closure__", None) or ())
                     if type(cell.cell_contents).__name__ == "instancemethod"), wait)

    def finish(request):
        inner = request
        while hasattr(inner, "work"):
            inner = inner.work
        original(inner)
        request.is_completed()

    held = [shard]
    for step in range(t - 1):
        incoming = torch.empty_like(shard)
        send = dist.isend(held[-1], right)
        receive = dist.irecv(incoming, left)
        finish(send)
        finish(receive)
        held.append(incoming)
    for step, piece in enumerate(held):
        outputs[(rank - step) % t] = piece @ weight.T"""),
]
FAKES["impl-topk"] += [
    Fake("error feedback kept by the function", "red team rt53: the residual lives in a "
         "module global keyed by size and k; a residual of zeros handed in is replaced by the "
         "remembered one", ("test-topk",), """\
    key = (grad.numel(), k)
    if residual.abs().sum() == 0 and key in _MEMORY:
        residual = _MEMORY[key]
    corrected = grad + residual
    indices = corrected.abs().topk(k).indices
    new_residual = corrected.clone()
    new_residual[indices] = 0
    _MEMORY[key] = new_residual.clone()
    return corrected[indices], indices.to(torch.int32), new_residual


_MEMORY = {}"""),
]
