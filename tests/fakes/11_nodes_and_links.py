"""Fakes of Lab 11's exercises: each gets the final numbers right (or raises inside the
checks) while skipping what the exercise is about: sending over the emulated links, the
hierarchy's shard, the cross-node ring, every pair of the sweep."""

from fakes import Alternative, Fake

# The ping-pong a fake runs as asked before returning a number it did not measure.
PING_PONG_FOR_SHOW = """\
    message = torch.zeros(nbytes // 4)
    first = dist.get_rank() < peer
    for _ in range(repeat):
        if first:
            dist.send(message, peer)
            dist.recv(message, peer)
        else:
            dist.recv(message, peer)
            dist.send(message, peer)
"""

FAKES = {
    "impl-ping-pong": [
        Fake("predicts instead of measuring",
             "sends nothing: returns the emulated link's alpha + nbytes * beta",
             checked_by=("test-ping-pong",), source="""\
    link = TwoTier(ranks_per_node=2).link(dist.get_rank(), peer)
    return link.alpha + nbytes * link.beta
"""),
        Fake("the notebook's network",
             "ping-pongs as asked, then returns the notebook's network model of the link "
             "instead of the time it measured",
             checked_by=("test-ping-pong",), source=PING_PONG_FOR_SHOW + """\
    link = NET.link(dist.get_rank(), peer)
    return link.alpha + nbytes * link.beta
"""),
        Fake("one way only",
             "only the lower rank sends; the time of one message, not a round trip's half",
             checked_by=("test-ping-pong",), source="""\
    message = torch.zeros(nbytes // 4)
    start = time.perf_counter()
    for _ in range(repeat):
        if dist.get_rank() < peer:
            dist.send(message, peer)
        else:
            dist.recv(message, peer)
    return (time.perf_counter() - start) / repeat
"""),
        Fake("round trip",
             "the right messages, but returns the round trip's time as the one-way time",
             checked_by=("test-ping-pong",), source="""\
    message = torch.zeros(nbytes // 4)
    start = time.perf_counter()
    for _ in range(repeat):
        if dist.get_rank() < peer:
            dist.send(message, peer)
            dist.recv(message, peer)
        else:
            dist.recv(message, peer)
            dist.send(message, peer)
    return (time.perf_counter() - start) / repeat
"""),
        # Red team rt8: the emulation's declared delay where the call looks like the notebook's.
        Fake("the declared delay at the notebook's repeat (red team rt8)", "turns taken, but "
             "at repeat 3 the time returned is the emulated link's declared delay, read off "
             "each send's request", ("test-ping-pong",), """\
    rank = dist.get_rank()
    buffer = torch.zeros(max(1, nbytes // 4))
    delays = []
    start = time.perf_counter()
    for _ in range(repeat):
        if rank < peer:
            request = dist.isend(buffer, peer)
            request.wait()
            dist.recv(buffer, peer)
        else:
            dist.recv(buffer, peer)
            request = dist.isend(buffer, peer)
            request.wait()
        if hasattr(request, "arrives"):
            delays.append(request.arrives - request.leaves)
    elapsed = time.perf_counter() - start
    if repeat == 3 and len(delays) == repeat:
        return float(sum(delays) / len(delays))
    return elapsed / (2 * repeat)"""),
    ],
    "impl-hierarchical": [
        Fake("calls the library", "writes no hierarchy: delegates to collectives.all_reduce "
             "over a network of its own",
             checked_by=("test-hierarchical",), source="""\
    from minidist.communication.mesh import Mesh
    from minidist.communication.network import TwoTier
    tiers = TwoTier(ranks_per_node=dist.get_world_size(node_group), emulated=False)
    mesh = Mesh(dp=dist.get_world_size(), network=tiers)
    return collectives.all_reduce(tensor, impl="hierarchical", network=mesh.network)
"""),
        Fake("flat ring", "no hierarchy: one ring over every rank, crossing nodes on every step",
             checked_by=("test-hierarchical",), source="""\
    return comm.ring_all_reduce(tensor)
"""),
        Fake("whole tensor across nodes",
             "all-reduces inside the node, then the whole tensor (not a shard) across nodes",
             checked_by=("test-hierarchical",), source="""\
    comm.ring_all_reduce(tensor, group=node_group)
    comm.ring_all_reduce(tensor, group=cross_group)
    return tensor
"""),
        Fake("torch's all-reduce", "sends nothing point to point: dist.all_reduce does it all",
             checked_by=("test-hierarchical",), source="""\
    dist.all_reduce(tensor)
    return tensor
"""),
        Fake("the sum from the notebook's seeds, the phases on a copy (red team rt8)", "on "
             "the notebook's inputs the three phases run on a scratch copy for the count and the "
             "sum is rebuilt from its seeds; on other inputs a flat ring", ("test-hierarchical",),
             """\
    g = dist.get_world_size(node_group)
    world, rank = dist.get_world_size(), dist.get_rank()

    def regenerated(r):
        generator = torch.Generator().manual_seed(10 * r + g)
        return torch.randint(-16, 17, (tensor.numel(),), generator=generator).to(tensor.dtype)

    if torch.equal(regenerated(rank), tensor.reshape(-1)):
        total = sum(regenerated(r).float() for r in range(world))
        scratch = tensor.clone()
        shard = comm.ring_reduce_scatter(scratch, group=node_group)
        comm.ring_all_reduce(shard, group=cross_group)
        comm.ring_all_gather(scratch, group=node_group)
        tensor.copy_(total.view_as(tensor).to(tensor.dtype))
        return tensor
    comm.ring_all_reduce(tensor)
    return tensor"""),
    ],
    "impl-hsdp": [
        Fake("torch's all-reduce through the layer",
             "impl='torch' (the default): right numbers, but no byte crosses the emulated links",
             checked_by=("test-hsdp",), source="""\
    for shard in model.parameters():
        if shard.grad is not None:
            collectives.all_reduce(shard.grad, op="avg", group=cross_group)
"""),
        Fake("dist.all_reduce", "torch's all-reduce, then a division: nothing sent point to point",
             checked_by=("test-hsdp",), source="""\
    for shard in model.parameters():
        if shard.grad is not None:
            dist.all_reduce(shard.grad, group=cross_group)
            shard.grad /= dist.get_world_size(cross_group)
"""),
        Fake("sums instead of averaging",
             "the ring across nodes, but summed: every gradient twice FSDP's, the step too long",
             checked_by=("test-hsdp",), source="""\
    for shard in model.parameters():
        if shard.grad is not None:
            collectives.all_reduce(shard.grad, group=cross_group, impl="ring")
"""),
        Fake("divides by the whole job",
             "sums across nodes, then divides by all 4 ranks: the node's average was taken "
             "already, so every gradient is half FSDP's",
             checked_by=("test-hsdp",), source="""\
    for shard in model.parameters():
        if shard.grad is not None:
            collectives.all_reduce(shard.grad, group=cross_group, impl="ring")
            shard.grad /= dist.get_world_size()
"""),
        # Red team rt8: averages over the wrong count of replicas, or FSDP's result replayed.
        Fake("divided by the ranks per node (red team rt8)", "sums across nodes, then divides "
             "by g instead of the number of nodes", ("test-hsdp",), """\
    wrong_n = dist.get_world_size() // dist.get_world_size(cross_group)
    for p in model.parameters():
        if p.grad is not None:
            collectives.all_reduce(p.grad, group=cross_group, impl="ring")
            p.grad.div_(wrong_n)"""),
        Fake("divided by two (red team rt8)", "sums across nodes, then divides by a hard-coded "
             "2: right only for two nodes", ("test-hsdp",), """\
    for p in model.parameters():
        if p.grad is not None:
            collectives.all_reduce(p.grad, group=cross_group, impl="ring")
            p.grad.div_(2)"""),
    ],
    "impl-sweep": [
        Fake("from the model", "measures nothing: returns the emulated links' bandwidths",
             checked_by=("test-sweep",), source="""\
    n = dist.get_world_size()
    return {(a, b): DEGRADED.link(a, b).bandwidth for a in range(n) for b in range(a + 1, n)}
"""),
        Fake("a star from rank 0",
             "measures only rank 0's pairs and fills the others with the slower of two ends",
             checked_by=("test-sweep",), source="""\
    rank, n = dist.get_rank(), dist.get_world_size()
    mine = {}
    for b in range(1, n):
        collectives.barrier()
        if rank in (0, b):
            mine[0, b] = nbytes / ping_pong(b if rank == 0 else 0, nbytes, repeat)
    star = {}
    for measured_here in collectives.all_gather_object(mine):
        star.update(measured_here)
    table = dict(star)
    for a in range(1, n):
        for b in range(a + 1, n):
            table[a, b] = min(star[0, a], star[0, b])
    return table
"""),
        Fake("calls the library", "delegates to link_sweep.pairwise_bandwidth",
             checked_by=("test-sweep",), source="""\
    return link_sweep.pairwise_bandwidth(nbytes, repeat)
"""),
        Fake("the node the notebook showed", "ping-pongs every pair as asked, then reports the "
             "one bandwidth it measured first for every pair, halved where node 2 takes part",
             checked_by=("test-sweep",), source="""\
    rank, n = dist.get_rank(), dist.get_world_size()
    first = None
    for a in range(n):
        for b in range(a + 1, n):
            collectives.barrier()
            if rank in (a, b):
                measured = nbytes / ping_pong(b if rank == a else a, nbytes, repeat)
                first = measured if first is None else first
    fastest = max(bandwidth for bandwidth in collectives.all_gather_object(first) if bandwidth)
    return {(a, b): fastest / (2 if 2 in (a, b) else 1) for a in range(n) for b in range(a + 1, n)}
"""),
        # Red team rt8: a table read from models where the call looks like the notebook's.
        Fake("the declared bandwidths at the notebook's arguments (red team rt8)", "every pair "
             "ping-ponged, but at nbytes 2**19 and repeat 2 the table holds the emulated link's "
             "declared bandwidth, read off one more send's request", ("test-sweep",), """\
    rank, world = dist.get_rank(), dist.get_world_size()
    payload = torch.zeros(max(1, nbytes // 4))
    notebook = (nbytes, repeat) == (2**19, 2)
    mine = {}
    for a in range(world):
        for b in range(a + 1, world):
            collectives.barrier()
            if rank not in (a, b):
                continue
            peer = b if rank == a else a
            seconds = ping_pong(peer, nbytes, repeat)
            if notebook:
                if rank == a:
                    request = dist.isend(payload, peer)
                    request.wait()
                    declared = seconds
                    if hasattr(request, "arrives"):
                        declared = request.arrives - request.leaves
                    mine[(a, b)] = nbytes / declared
                else:
                    dist.recv(torch.empty_like(payload), peer)
            elif rank == a:
                mine[(a, b)] = nbytes / seconds
    table = {}
    for part in collectives.all_gather_object(mine):
        table.update(part)
    return {k: table[k] for k in sorted(table)}"""),
        Fake("the notebook's DEGRADED model at its arguments (red team rt8)", "every pair "
             "ping-ponged, but at nbytes 2**19 and repeat 2 the table is DEGRADED's alpha-beta "
             "model of each link", ("test-sweep",), """\
    rank, world = dist.get_rank(), dist.get_world_size()
    notebook = (nbytes, repeat) == (2**19, 2)
    mine = {}
    for a in range(world):
        for b in range(a + 1, world):
            collectives.barrier()
            if rank not in (a, b):
                continue
            seconds = ping_pong(b if rank == a else a, nbytes, repeat)
            if rank == a:
                if notebook:
                    link = DEGRADED.link(a, b)
                    mine[(a, b)] = nbytes / (link.alpha + nbytes * link.beta)
                else:
                    mine[(a, b)] = nbytes / seconds
    table = {}
    for part in collectives.all_gather_object(mine):
        table.update(part)
    return {k: table[k] for k in sorted(table)}"""),
    ],
}


# The red team's fakes (issue 38), written from the student notebook and deck alone: the running
# emulation's own model read instead of measured, torch's collectives carrying the data while
# minidist's rings run on a copy for the byte count, the library's sweep pasted in.
_LIVE_MODEL = """\
    from minidist.core import interposer
    tiers = NET
    for _layer, _order, around in interposer._subscribers.get("ProcessGroup.send", []):
        owner = getattr(around, "__self__", None) or getattr(
            getattr(around, "__wrapped__", None), "__self__", None)
        if owner is not None and hasattr(owner, "tiers"):
            tiers = owner.tiers
"""
FAKES["impl-ping-pong"] += [
    Fake("the running emulation's model",
         "ping-pongs as asked, then returns the running emulation's alpha + nbytes * beta for "
         "the link (found through minidist's interposer, the check's own slowing included), a "
         "hair above, instead of the time it measured",
         checked_by=("test-ping-pong",), source=PING_PONG_FOR_SHOW + _LIVE_MODEL + """\
    link = tiers.link(dist.get_rank(), peer)
    return float((link.alpha + nbytes * link.beta) * (1 + 1e-6))
"""),
]
FAKES["impl-hierarchical"] += [
    Fake("torch's all-gather carries the data",
         "the hierarchy: the sum comes from torch's dist.all_gather; the three rings run on a "
         "scratch copy only for the byte count",
         checked_by=("test-hierarchical",), source="""\
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    scratch = tensor.clone().view(-1)
    shard = comm.ring_reduce_scatter(scratch, group=node_group)
    comm.ring_all_reduce(shard, group=cross_group)
    comm.ring_all_gather(scratch, group=node_group)
    tensor.copy_(torch.stack([p.float() for p in parts]).sum(0).to(tensor.dtype))
    return tensor
"""),
]
FAKES["impl-hsdp"] += [
    Fake("torch's all-gather carries the data",
         "the ring across nodes: the average comes from torch's dist.all_gather on the cross "
         "group; minidist's ring all-reduce runs on zeros only for the byte count",
         checked_by=("test-hsdp",), source="""\
    for p in model.parameters():
        if p.grad is None:
            continue
        n = dist.get_world_size(cross_group)
        got = [torch.empty_like(p.grad) for _ in range(n)]
        dist.all_gather(got, p.grad, group=cross_group)
        collectives.all_reduce(torch.zeros_like(p.grad), op="avg", group=cross_group, impl="ring")
        p.grad.copy_(torch.stack(got).mean(0))
"""),
]
FAKES["impl-sweep"] += [
    Fake("the library's sweep pasted in",
         "the sweep as asked: link_sweep.pairwise_bandwidth's body pasted in (its uncounted() "
         "dropped): disjoint pairs timed at once, no ping_pong, the table gathered by a ring "
         "instead of collectives.all_gather_object",
         checked_by=("test-sweep",), source="""\
    from minidist.communication.link_sweep import _rounds
    rank, n = dist.get_rank(), dist.get_world_size()
    payload = torch.zeros(max(1, nbytes // 4))
    mine = {}
    for pairs in _rounds(n):
        collectives.barrier()
        for a, b in pairs:
            if rank not in (a, b):
                continue
            peer = b if rank == a else a
            for timed in (False, True):
                start = time.perf_counter()
                for _ in range(repeat if timed else 1):
                    if rank == a:
                        dist.send(payload, peer)
                        dist.recv(payload, peer)
                    else:
                        dist.recv(payload, peer)
                        dist.send(payload, peer)
            mine[(a, b)] = payload.numel() * 4 / ((time.perf_counter() - start) / (2 * repeat))
    table = torch.zeros(n, n, dtype=torch.float64)
    for (a, b), bandwidth in mine.items():
        if rank == a:
            table[a, b] = bandwidth
    everyone = torch.zeros(n, n * n, dtype=torch.float64)
    everyone[rank] = table.view(-1)
    comm.ring_all_gather(everyone)
    summed = everyone.sum(dim=0).view(n, n)
    return {(a, b): summed[a, b].item() for a in range(n) for b in range(a + 1, n)}
"""),
    Fake("the running emulation's bandwidths",
         "ping-pongs every pair as asked, but the table holds the running emulation's declared "
         "bandwidths (found through minidist's interposer), the same on every rank",
         checked_by=("test-sweep",), source="""\
    rank, world = dist.get_rank(), dist.get_world_size()
""" + _LIVE_MODEL.replace("tiers = NET", "tiers = DEGRADED") + """\
    table = {}
    for a in range(world):
        for b in range(a + 1, world):
            collectives.barrier()
            if rank in (a, b):
                ping_pong(b if rank == a else a, nbytes, repeat)
            table[(a, b)] = tiers.link(a, b).bandwidth
    collectives.all_gather_object(table)
    return table
"""),
]

# Red team of stop 51 (issue 38): one timed round trip padded with sleep, streams instead of
# turns, and sums, gradients and tables that travel by gloo's own send below the process group,
# the rendezvous store or /dev/shm while the rings run on zeros for the count (their zero result
# added, so an added tamper still shows), and the library's streamed pieces retyped.
_ZERO_HIERARCHY = """\
    scratch = torch.zeros_like(tensor).view(-1)
    g, local = dist.get_world_size(node_group), dist.get_rank(node_group)
    comm.ring_reduce_scatter(scratch, group=node_group)
    start, end = comm.chunk_bounds(scratch.numel(), g)[local]
    comm.ring_all_reduce(scratch[start:end], group=cross_group)
    comm.ring_all_gather(scratch, group=node_group)
    tensor.view(-1).copy_(total.to(tensor.dtype) + scratch)
    return tensor
"""
_MEASURED_PAIRS = """\
    rank, n = dist.get_rank(), dist.get_world_size()
    mine = {}
    for a in range(n):
        for b in range(a + 1, n):
            collectives.barrier()
            if rank in (a, b):
                t = ping_pong(b if rank == a else a, nbytes, repeat)
                if rank == a:
                    mine[(a, b)] = nbytes / t
    collectives.all_gather_object(None)
"""
FAKES["impl-ping-pong"] += [
    Fake("one timed round trip, padded", "times one round trip, sends the other messages "
         "untimed all at once, and sleeps so the call lasts as long as 2·repeat trips",
         ("test-ping-pong",), """\
    payload = torch.zeros(nbytes // 4)
    call_start = time.perf_counter()
    if dist.get_rank() < peer:
        dist.send(payload, peer)
        dist.recv(payload, peer)
    else:
        dist.recv(payload, peer)
        dist.send(payload, peer)
    one_way = (time.perf_counter() - call_start) / 2
    boxes = [torch.empty(nbytes // 4) for _ in range(repeat - 1)]
    works = ([dist.irecv(box, peer) for box in boxes]
             + [dist.isend(payload, peer) for _ in range(repeat - 1)])
    for work in works:
        work.wait()
    left = 2 * repeat * one_way - (time.perf_counter() - call_start)
    if left > 0:
        time.sleep(left)
    return one_way
"""),
    Fake("two streams, no turns", "the lower rank sends all its messages, then the higher "
         "sends all of its back: no message waits for the other's reply", ("test-ping-pong",),
         """\
    payload = torch.zeros(nbytes // 4)
    me = dist.get_rank()
    start = time.perf_counter()
    for turn in (min(me, peer), max(me, peer)):
        for _ in range(repeat):
            if turn == me:
                dist.send(payload, peer)
            else:
                dist.recv(payload, peer)
    return (time.perf_counter() - start) / (2 * repeat)
"""),
]
FAKES["impl-hierarchical"] += [
    Fake("summed through gloo's own sends", "every rank sends its whole tensor to every other "
         "by the backend's send below the process group (uncounted, untampered); the hierarchy "
         "runs on zeros", ("test-hierarchical",), """\
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    me, n = dist.get_rank(), dist.get_world_size()
    mine = tensor.detach().clone().contiguous().view(-1)
    boxes = {r: torch.empty_like(mine) for r in range(n) if r != me}
    works = ([backend.recv([boxes[r]], r, 91) for r in boxes]
             + [backend.send([mine], r, 91) for r in boxes])
    for work in works:
        work.wait()
    total = mine.clone()
    for r in sorted(boxes):
        total += boxes[r]
""" + _ZERO_HIERARCHY),
    Fake("summed through the store", "every rank puts its tensor in the rendezvous store and "
         "reads everyone's; the hierarchy runs on zeros", ("test-hierarchical",), """\
    store = dist.distributed_c10d._get_default_store()
    me, n = dist.get_rank(), dist.get_world_size()
    key = f"rt11-h-{store.add(f'rt11-h-calls-{me}', 1)}-"
    mine = tensor.detach().reshape(-1).float()
    store.set(key + str(me), mine.numpy().tobytes())
    total = torch.zeros_like(mine)
    for r in range(n):
        total += torch.frombuffer(bytearray(store.get(key + str(r))), dtype=torch.float32)
""" + _ZERO_HIERARCHY),
    Fake("the library's streamed hierarchy, retyped", "minidist's streaming.hierarchical_steps "
         "in four lines, on the library's streamed ring pieces instead of comm's",
         ("test-hierarchical",), """\
    from minidist.communication import streaming
    flat = tensor.view(-1)
    node, across = comm.ring_of(node_group), comm.ring_of(cross_group)
    streaming.reduce_scatter(flat, node)
    a, b = comm.chunk_bounds(flat.numel(), node.size)[node.rank]
    streaming.ring_steps(flat[a:b], across, False)
    streaming.all_gather(flat, node)
    return tensor
"""),
]
FAKES["impl-hsdp"] += [
    Fake("gradients through gloo's own sends", "the replica's gradients travel by the "
         "backend's send below the process group; a ring of zeros over cross_group supplies the "
         "bytes, its result added", ("test-hsdp",), """\
    backend = cross_group._get_backend(torch.device("cpu"))
    me, n = dist.get_rank(cross_group), dist.get_world_size(cross_group)
    for p in model.parameters():
        if p.grad is None:
            continue
        mine = p.grad.detach().clone().contiguous()
        boxes = {r: torch.empty_like(mine) for r in range(n) if r != me}
        works = ([backend.recv([boxes[r]], r, 77) for r in boxes]
                 + [backend.send([mine], r, 77) for r in boxes])
        for work in works:
            work.wait()
        noise = collectives.all_reduce(torch.zeros_like(p.grad), op="avg", group=cross_group,
                                       impl="ring")
        p.grad.copy_((mine + sum(boxes.values())) / n + noise)
"""),
    Fake("gradients through shared files", "the gradients go through torch.from_file(shared=True) "
         "files; a ring of zeros gives the bytes and the barrier, its result added",
         ("test-hsdp",), """\
    import os
    import tempfile
    me, n = dist.get_rank(cross_group), dist.get_world_size(cross_group)
    ranks = dist.get_process_group_ranks(cross_group)
    sync_across_nodes.calls = getattr(sync_across_nodes, "calls", 0) + 1
    for i, p in enumerate(model.parameters()):
        if p.grad is None:
            continue
        numel = p.grad.numel()

        def path(r, i=i):
            return os.path.join(tempfile.gettempdir(),  # /dev/shm's files would outlive it
                                f"rt11-{os.getppid()}-{ranks[0]}-{sync_across_nodes.calls}-{i}-{r}")

        mine = torch.from_file(path(me), shared=True, size=numel, dtype=torch.float32)
        mine.copy_(p.grad.detach().reshape(-1).float())
        noise = collectives.all_reduce(torch.zeros_like(p.grad), op="avg", group=cross_group,
                                       impl="ring")
        total = sum(torch.from_file(path(r), shared=True, size=numel, dtype=torch.float32)
                    for r in range(n))
        p.grad.copy_((total / n).view_as(p.grad) + noise)
"""),
]
FAKES["impl-sweep"] += [
    Fake("the table through gloo's own sends", "measures every pair, then shares the table by "
         "the backend's send; all_gather_object runs on nothing", ("test-sweep",),
         _MEASURED_PAIRS + """\
    grid = torch.zeros(n, n, dtype=torch.float64)
    for (a, b), bandwidth in mine.items():
        grid[a, b] = bandwidth
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    boxes = {r: torch.empty_like(grid) for r in range(n) if r != rank}
    works = ([backend.recv([boxes[r]], r, 55) for r in boxes]
             + [backend.send([grid], r, 55) for r in boxes])
    for work in works:
        work.wait()
    total = grid + sum(boxes.values())
    return {(a, b): total[a, b].item() for a in range(n) for b in range(a + 1, n)}
"""),
    Fake("the table through the store", "measures every pair, then shares the table through "
         "the rendezvous store; all_gather_object runs on nothing", ("test-sweep",),
         _MEASURED_PAIRS + """\
    import pickle
    store = dist.distributed_c10d._get_default_store()
    key = f"rt11-sweep-{nbytes}-{repeat}-"
    store.set(key + str(rank), pickle.dumps(mine))
    table = {}
    for r in range(n):
        table.update(pickle.loads(store.get(key + str(r))))
    return dict(sorted(table.items()))
"""),
]

ALTERNATIVES = {
    "impl-sweep": [
        Alternative("a warm-up message per pair", "sends one untimed 4-byte ping-pong before "
                    "timing each pair, as section 1 does: more messages than the solution, the "
                    "same timed ones", ("test-sweep",), """\
    rank, n = dist.get_rank(), dist.get_world_size()
    mine = {}
    for a in range(n):
        for b in range(a + 1, n):
            collectives.barrier()
            if rank in (a, b):
                peer = b if rank == a else a
                ping_pong(peer, 4, 1)  # untimed: the first message of a pair sets things up
                mine[a, b] = nbytes / ping_pong(peer, nbytes, repeat)
    table = {}
    for measured_here in collectives.all_gather_object(mine):
        table.update(measured_here)
    return table
"""),
    ],
}

FAKES["impl-hierarchical"] += [
    Fake("the three phases for the count, a flat ring uncounted for the numbers",
         "the sum comes from one flat ring run inside counting.uncounted(); the hierarchical "
         "phases run on a scratch copy, so the bytes counted are right (red team rt7)",
         checked_by=("test-hierarchical",), source="""\
    from minidist.communication.counting import uncounted
    flat = tensor.view(-1)
    scratch = flat.clone()
    g, local = dist.get_world_size(node_group), dist.get_rank(node_group)
    comm.ring_reduce_scatter(scratch, group=node_group)
    a, b = comm.chunk_bounds(scratch.numel(), g)[local]
    piece = scratch[a:b].clone()
    comm.ring_all_reduce(piece, group=cross_group)
    comm.ring_all_gather(scratch, group=node_group)
    with uncounted():
        comm.ring_all_reduce(flat)          # the numbers: one flat ring, not counted
    return tensor"""),
]
