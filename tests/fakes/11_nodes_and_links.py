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
