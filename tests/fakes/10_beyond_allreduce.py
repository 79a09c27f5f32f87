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
    ],
}
