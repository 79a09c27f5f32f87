"""minidist.communication.comm (the algorithms as Lab 01 writes them),
minidist.communication.streaming (the same, fast) and minidist.communication.collectives (the one
layer the library calls) against torch.distributed's own collectives, on 1 to 5 gloo ranks.

Starting ranks costs about a second, so each world size runs every check in one
`minidist.core.launch.run`; each rank returns {check name: [failure descriptions]}, and the tests
below look up their check and assert that its list is empty.
"""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch
import torch.distributed as dist

from minidist.communication import collectives, comm, impls, streaming
from minidist.communication.counting import count_traffic
from minidist.core import interposer
from minidist.core.launch import RankError, run
from minidist.costs import algorithms
from minidist.costs.cost import (
    AlgorithmLinks,
    AlphaBeta,
    all_reduce_bytes_sent,
    ring_bytes_sent,
)
from minidist.costs.traffic import Collective

FLAT = algorithms.names("all_reduce", nodes=False)  # the all-reduce algorithms of one link

WORLD_SIZES = (1, 2, 3, 4, 5)
SIZES = (1, 7, 1000, 2**20 + 3)
DTYPES = (torch.float32, torch.bfloat16)


def _integers(numel: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Integers in [-16, 16]: sums over 4 ranks stay within bfloat16's exact integers (<= 256),
    so every summation order gives the same bits and results can be compared exactly."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-16, 17, (numel,), generator=generator).to(dtype)


def _check_all_reduce(rank: int, world_size: int) -> list[str]:
    failures = []
    for numel in SIZES:
        for dtype in DTYPES:
            ours = _integers(numel, 1000 * rank + numel, dtype)
            expected = ours.clone()
            dist.all_reduce(expected)
            returned = comm.ring_all_reduce(ours)
            if returned is not ours or not torch.equal(ours, expected):
                failures.append(f"sum, numel={numel}, {dtype}")
    sum_, avg = dist.ReduceOp.SUM, dist.ReduceOp.AVG
    for op, torch_op in (("sum", sum_), ("avg", avg)):
        ours = torch.randn(1003, generator=torch.Generator().manual_seed(rank))
        expected = ours.clone()
        dist.all_reduce(expected, op=torch_op)
        comm.ring_all_reduce(ours, op=op)
        if not torch.allclose(ours, expected, rtol=1e-5, atol=1e-6):
            failures.append(f"random float32, op={op}")
    matrix = _integers(12 * 5, rank, torch.float32).view(12, 5)  # any shape: works on the flat view
    expected = matrix.clone()
    dist.all_reduce(expected)
    if not torch.equal(comm.ring_all_reduce(matrix), expected):
        failures.append("2-D tensor")
    return failures


def _check_all_reduce_algorithms(rank: int, world_size: int) -> list[str]:
    """Every implementation through the layer (minidist's streamed ones and torch's), and every
    plain algorithm of comm, equals torch's all-reduce."""
    failures = []
    plain = {f"plain {row.name}": row.plain["all_reduce"] for row in impls.TABLE
             if "all_reduce" in row.plain}
    for impl in (*impls.choices("all_reduce"), *plain):
        for numel in SIZES:
            for dtype in DTYPES:
                for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, "sum", "avg"):
                    ours = _integers(numel, 1000 * rank + numel, dtype)
                    expected = ours.clone()
                    averaged = op in ("avg", dist.ReduceOp.AVG)
                    dist.all_reduce(expected, op=dist.ReduceOp.AVG if averaged
                                    else dist.ReduceOp.SUM)
                    if impl in plain:
                        if not isinstance(op, str):
                            continue
                        plain[impl](ours, comm.ring_of(), op == "avg")
                        returned = ours
                    else:
                        returned = collectives.all_reduce(ours, op=op, impl=impl)
                    # Sums of small integers are exact in any order; an average is that sum
                    # divided once, so it matches too, up to how gloo rounds the division.
                    close = torch.equal(ours, expected) if op in ("sum", dist.ReduceOp.SUM) else (
                        torch.allclose(ours.float(), expected.float(), rtol=1e-2, atol=0))
                    if returned is not ours or not close:
                        failures.append(f"{impl}, {op}, numel={numel}, {dtype}")
    matrix = _integers(12 * 5, rank, torch.float32).view(12, 5)
    expected = matrix.clone()
    dist.all_reduce(expected)
    if not torch.equal(collectives.all_reduce(matrix, impl="rabenseifner"), expected):
        failures.append("2-D tensor")
    maxima = torch.full((3,), float(rank))
    if not torch.equal(collectives.all_reduce(maxima, op="max"),
                       torch.full((3,), world_size - 1.0)):
        failures.append("max, impl='torch'")
    return failures


def _all_reduce_messages(algorithm: str, rank: int, world_size: int) -> int:
    """Sends per rank: one per step it takes part in (cost.all_reduce_coefficients' steps)."""
    p = 1 << (world_size.bit_length() - 1)
    log2_p, extra = p.bit_length() - 1, world_size - p
    if algorithm == "ring":
        return 2 * (world_size - 1)
    if algorithm == "tree":
        return round(all_reduce_bytes_sent("tree", 1, world_size, rank))
    if rank < 2 * extra and rank % 2 == 0:
        return 1  # hands its tensor in, then only receives
    steps = log2_p if algorithm == "recursive_doubling" else 2 * log2_p
    return steps + (1 if rank < 2 * extra else 0)


def _check_all_reduce_bytes(rank: int, world_size: int) -> list[str]:
    failures = []
    everyone = tuple(range(world_size))
    for algorithm in FLAT:
        for numel in (240, *SIZES):  # 240: every N in 1..5 and every p in 1, 2, 4 divide it
            expected = all_reduce_bytes_sent(algorithm, numel * 4, world_size, rank)
            messages = _all_reduce_messages(algorithm, rank, world_size)
            slack = 0 if numel % 240 == 0 else messages * 4  # one element per uneven chunk
            # Streamed: a large tensor goes in several segments per step (the ring's exact
            # count is checked in _check_ring_bytes); a small one in one message per step.
            # Plain (comm): one message per step whatever the size, and no record.
            fits = streaming.segment_count(numel * 4) == 1
            with count_traffic() as counter:
                collectives.all_reduce(torch.zeros(numel), impl=algorithm)
            with count_traffic() as plain:
                impls.implementation(algorithm).plain["all_reduce"](
                    torch.zeros(numel), comm.ring_of(), False)
            record = counter.collectives[0] if len(counter.collectives) == 1 else None
            if (abs(counter.bytes_sent - expected) > slack
                    or (counter.messages != messages if fits else counter.messages < messages)
                    or counter.collectives != [Collective("all_reduce", numel * 4, world_size)]
                    or record.ranks != everyone):
                failures.append(
                    f"{algorithm} numel={numel}: sent {counter.bytes_sent} B in "
                    f"{counter.messages} messages, expected {expected:g} B (+-{slack}) in "
                    f"{messages}; records {counter.collectives}"
                )
            if (abs(plain.bytes_sent - expected) > slack or plain.messages != messages
                    or plain.collectives):
                failures.append(f"plain {algorithm} numel={numel}: sent {plain.bytes_sent} B in "
                                f"{plain.messages} messages, expected {expected:g} in {messages}")
    return failures


def _check_auto(rank: int, world_size: int) -> list[str]:
    failures = []
    with count_traffic() as fitting:
        links = impls.fit_links()
    if impls.fit_links() is not links:
        failures.append("fit_links measured again instead of keeping the group's links")
    if fitting.bytes_sent or fitting.collectives:
        failures.append(f"fit_links' own timings were counted: {fitting}")
    own = impls.fit_links(rounds=1, sizes=(2**12, 2**14))
    if own.sizes != (2**12, 2**14) or impls.fit_links() is not links:
        failures.append(f"links fitted at other sizes replaced auto's: {own.sizes}")
    everyone = [None] * world_size
    dist.all_gather_object(everyone, links)
    if any(other != links for other in everyone):
        failures.append(f"ranks fitted different links: {everyone}")
    if world_size > 1 and any(link.alpha <= 0 and link.beta <= 0
                              for _, ranges in links.links for link in ranges):
        failures.append(f"an algorithm fitted no cost at all on some range: {links.links}")
    # Links given explicitly decide: one AlphaBeta for all (latency-bound picks fewest steps,
    # bandwidth-bound fewest bytes), or each algorithm's own, where a cheap one must win. The
    # bytes sent show which algorithm ran (sizes that every chunking divides).
    cheap_tree = AlgorithmLinks(world_size, (2**12, 2**22), tuple(
        (name, (AlphaBeta(1e-9, 1e-12) if name == "tree" else AlphaBeta(1e-3, 1e-6),))
        for name in FLAT))
    for given, numel in ((AlphaBeta(alpha=1e-3, beta=1e-12), 3840),
                         (AlphaBeta(alpha=1e-9, beta=1e-6), 3840), (cheap_tree, 3840),
                         (links, 240), (links, 240 * 4096)):
        chosen = given.best_all_reduce(numel * 4, world_size)
        if given is cheap_tree and world_size > 1 and chosen != "tree":
            failures.append(f"links where the tree costs least chose {chosen}")
        with count_traffic() as counter:
            collectives.all_reduce(torch.zeros(numel), impl="auto",
                                   link=None if given is links else given)
        expected = all_reduce_bytes_sent(chosen, numel * 4, world_size, rank)
        if counter.bytes_sent != expected:
            failures.append(f"auto with {given}, numel={numel}: sent {counter.bytes_sent} B, "
                            f"but {chosen} sends {expected:g} B")
    return failures


def _check_reduce_scatter_and_all_gather(rank: int, world_size: int) -> list[str]:
    failures = []
    for numel in (*SIZES, 12 * world_size):
        bounds = comm.chunk_bounds(numel, world_size)
        start, end = bounds[rank]
        data = _integers(numel, 7 * rank + numel, torch.float32)
        total = data.clone()
        dist.all_reduce(total)

        # Reduce-scatter: rank r gets chunk r, as a view into the tensor.
        ours = data.clone()
        chunk = comm.ring_reduce_scatter(ours)
        if chunk.data_ptr() != ours[start:].data_ptr() or chunk.numel() != end - start:
            failures.append(f"reduce_scatter numel={numel}: returned chunk is not chunk {rank}")
        elif not torch.equal(chunk, total[start:end]):
            failures.append(f"reduce_scatter numel={numel}: wrong values")
        if numel % world_size == 0:
            theirs = torch.empty(numel // world_size)
            dist.reduce_scatter_single(theirs, data.clone())
            if not torch.equal(chunk, theirs):
                failures.append(f"reduce_scatter numel={numel}: differs from torch's")

        # All-gather: only chunk r is valid on rank r at the start.
        full = _integers(numel, numel, torch.float32)  # the same on every rank
        ours = torch.full((numel,), -100.0)
        ours[start:end] = full[start:end]
        if comm.ring_all_gather(ours) is not ours or not torch.equal(ours, full):
            failures.append(f"all_gather numel={numel}")
        if numel % world_size == 0:
            theirs = torch.empty(numel)
            dist.all_gather_single(theirs, full[start:end].clone())
            if not torch.equal(ours, theirs):
                failures.append(f"all_gather numel={numel}: differs from torch's")

        # The layer: a new tensor, this rank's shard, from either implementation.
        for impl in impls.choices("reduce_scatter"):
            shard = collectives.reduce_scatter(data, impl=impl)
            if not torch.equal(shard, total[start:end]) or shard.data_ptr() == data.data_ptr():
                failures.append(f"collectives.reduce_scatter impl={impl} numel={numel}")
            for async_op in (False, True):
                gathered = collectives.all_gather(full[start:end].clone(), numel, impl=impl,
                                                  async_op=async_op)
                gathered = gathered.wait() if async_op else gathered
                if not torch.equal(gathered, full):
                    failures.append(f"collectives.all_gather impl={impl} async={async_op} "
                                    f"numel={numel}")

    start, end = comm.chunk_bounds(10, world_size)[rank]
    mean = torch.full((end - start,), (world_size - 1) / 2)  # the mean of the ranks 0..N-1
    if not torch.allclose(comm.ring_reduce_scatter(torch.full((10,), float(rank)), "avg"), mean):
        failures.append("reduce_scatter avg")
    for impl in impls.choices("reduce_scatter"):
        shard = collectives.reduce_scatter(torch.full((10,), float(rank)), impl=impl, op="avg")
        if not torch.allclose(shard, mean):
            failures.append(f"collectives.reduce_scatter avg, impl={impl}")
    pieces = torch.full((2, 3 * world_size, 5), float(rank))
    along = collectives.reduce_scatter_along(pieces, 1)
    if along.shape != (2, 3, 5) or not torch.equal(along, torch.full((2, 3, 5), float(
            sum(range(world_size))))):
        failures.append(f"reduce_scatter_along: shape {tuple(along.shape)}")
    gathered = collectives.all_gather_along(torch.full((2, 3, 5), float(rank)), 1)
    expected = torch.cat([torch.full((2, 3, 5), float(r)) for r in range(world_size)], dim=1)
    if not torch.equal(gathered, expected):
        failures.append("all_gather_along")
    return failures


def _check_broadcast(rank: int, world_size: int) -> list[str]:
    failures = []
    for src in range(world_size):
        for numel in (1, 7, 1000):
            ours = torch.full((numel,), float(rank))
            theirs = ours.clone()
            dist.broadcast(theirs, src)
            if comm.tree_broadcast(ours, src) is not ours or not torch.equal(ours, theirs):
                failures.append(f"src={src}, numel={numel}")
            for impl in impls.choices("broadcast"):
                ours = torch.full((numel,), float(rank))
                if not torch.equal(collectives.broadcast(ours, src=src, impl=impl), theirs):
                    failures.append(f"collectives.broadcast impl={impl} src={src}")
    for broadcast in (lambda t: comm.tree_broadcast(t, src=world_size - 1),
                      lambda t: collectives.broadcast(t, src=world_size - 1, impl="tree")):
        with count_traffic() as counter:
            broadcast(torch.zeros(100))
        # Every rank but src receives the tensor exactly once, so the sends add up to (N-1) * S.
        total = torch.tensor([counter.bytes_sent])
        dist.all_reduce(total)
        if total.item() != (world_size - 1) * 400:
            failures.append(f"broadcast sent {total.item()} bytes in all, not (N-1) * S")
    tensors = [torch.full((3,), float(rank)), torch.full((2, 2), rank, dtype=torch.int64)]
    with count_traffic() as log:
        collectives.broadcast_tensors(tensors)
    if not (torch.equal(tensors[0], torch.zeros(3)) and torch.equal(tensors[1], torch.zeros(
            2, 2, dtype=torch.int64))) or [(c.op, c.nbytes) for c in log.collectives] != [
            ("broadcast", 12), ("broadcast", 32)]:
        failures.append(f"broadcast_tensors: one broadcast per dtype, got {log.collectives}")
    return failures


def _check_ring_bytes(rank: int, world_size: int) -> list[str]:
    failures = []
    for numel in (24 * world_size, *SIZES):
        nbytes = numel * 4
        # streaming.segment_count messages per chunk sent. Rank r sends every chunk but r in
        # the reduce-scatter, every chunk but r+1 in the all-gather; comm sends each whole.
        segments = [streaming.segment_count((end - start) * 4)
                    for start, end in comm.chunk_bounds(numel, world_size)]
        scattered = sum(segments) - segments[rank]
        gathered = sum(segments) - segments[(rank + 1) % world_size]
        shard = torch.zeros(comm.chunk_bounds(numel, world_size)[rank][1]
                            - comm.chunk_bounds(numel, world_size)[rank][0])
        for name, collective, steps, messages in (
            ("all_reduce", lambda t: collectives.all_reduce(t, impl="ring"),
             2 * (world_size - 1), scattered + gathered),
            ("reduce_scatter", lambda t: collectives.reduce_scatter(t, impl="ring"),
             world_size - 1, scattered),
            ("all_gather", lambda t, s=shard: collectives.all_gather(s, t.numel(), impl="ring"),
             world_size - 1, gathered),
            ("all_reduce", comm.ring_all_reduce, 2 * (world_size - 1), 2 * (world_size - 1)),
            ("reduce_scatter", comm.ring_reduce_scatter, world_size - 1, world_size - 1),
            ("all_gather", comm.ring_all_gather, world_size - 1, world_size - 1),
        ):
            with count_traffic() as counter:
                collective(torch.zeros(numel))
            expected = ring_bytes_sent(name, nbytes, world_size)
            # Chunks differ by at most one element, so each step may be off by one element.
            slack = 0 if numel % world_size == 0 else steps * 4
            right = {comm.ring_of().right} if world_size > 1 else set()
            if (abs(counter.bytes_sent - expected) > slack or counter.messages != messages
                    or set(counter.bytes_to()) != right):
                failures.append(
                    f"{name} numel={numel}: sent {counter.bytes_to()} (B per rank) in "
                    f"{counter.messages} messages, expected {expected:g} B (+-{slack}) to the "
                    f"right neighbour in {messages}"
                )
    return failures


def _check_counting_plain_sends(rank: int, world_size: int) -> list[str]:
    if world_size == 1:
        return []  # dist.send to oneself is an error
    failures = []
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    before = interposer.subscribers("ProcessGroup.send")  # the launcher's recorder, for life
    payload, inbox = torch.zeros(10), torch.empty(10)  # 40 bytes
    made_before = [dist.P2POp(dist.isend, payload, right), dist.P2POp(dist.irecv, inbox, left)]

    with count_traffic() as outer:
        # dist.send / dist.recv, ordered so the ring cannot deadlock: even ranks send first.
        for sending in (rank % 2 == 0, rank % 2 == 1):
            if sending:
                dist.send(payload, right)
            else:
                dist.recv(inbox, left)
        requests = [dist.isend(payload, right), dist.irecv(inbox, left)]  # gloo's isend waits
        for request in requests:  # for the matching recv, so post both before waiting
            request.wait()
        with count_traffic() as inner:
            for request in dist.batch_isend_irecv(made_before):  # P2POps made outside the block
                request.wait()
            made_inside = [
                dist.P2POp(dist.isend, payload, right),
                dist.P2POp(dist.irecv, inbox, left),
            ]
            for request in dist.batch_isend_irecv(made_inside):
                request.wait()
    if (outer.bytes_sent, outer.messages) != (160, 4) or outer.bytes_to() != {right: 160}:
        failures.append(f"outer block counted {outer.bytes_to()} B in {outer.messages} messages")
    if (inner.bytes_sent, inner.messages) != (80, 2):
        failures.append(f"inner block counted {inner.bytes_sent} B in {inner.messages} messages")

    # After the block: nothing more is counted, and P2POps made inside still work.
    for request in dist.batch_isend_irecv(made_inside):
        request.wait()
    comm.ring_all_reduce(torch.zeros(100))
    if (outer.bytes_sent, inner.bytes_sent) != (160, 80):
        failures.append("sends after the block were counted")
    if interposer.subscribers("ProcessGroup.send") != before:
        failures.append("the counter still watches ProcessGroup.send")

    # An exception inside the block restores it too.
    with pytest.raises(RuntimeError), count_traffic():
        raise RuntimeError("boom")
    if interposer.subscribers("ProcessGroup.send") != before:
        failures.append("the counter still watches ProcessGroup.send after an exception")
    return failures


def _check_errors(rank: int, world_size: int) -> list[str]:
    failures = []
    cases = [
        ("non-contiguous", lambda: comm.ring_all_reduce(torch.zeros(4, 6).t()), "contiguous"),
        ("op max", lambda: comm.ring_all_reduce(torch.zeros(4), op="max"), "'sum' or 'avg'"),
        ("ReduceOp.MAX, ring", lambda: collectives.all_reduce(
            torch.zeros(4), op=dist.ReduceOp.MAX, impl="ring"), "op"),
        ("op min", lambda: collectives.all_reduce(torch.zeros(4), op="min"), "'max'"),
        ("avg on ints", lambda: comm.ring_all_reduce(torch.zeros(4, dtype=torch.int64), "avg"),
         "floating-point"),
        ("bad src", lambda: comm.tree_broadcast(torch.zeros(4), src=world_size), "src"),
        # Raised before any send: only this rank calls, so a blocked call would hang the run.
        ("unknown algorithm", lambda: collectives.all_reduce(torch.zeros(4), impl="butterfly"),
         "'recursive_doubling'"),
        ("unknown impl", lambda: collectives.all_gather(torch.zeros(4), 4, impl="tree"),
         "'ring'"),
        ("avg on ints, tree", lambda: collectives.all_reduce(
            torch.zeros(4, dtype=torch.int64), op="avg", impl="tree"), "floating-point"),
        ("wrong shard", lambda: collectives.all_gather(torch.zeros(5), 4 * world_size),
         "shard_bounds"),
    ]
    for name, call, phrase in cases:
        try:
            call()
            failures.append(f"{name}: no error")
        except ValueError as error:
            if phrase not in str(error):
                failures.append(f"{name}: unclear message {error}")
    return failures


def _check_subgroup(rank: int, world_size: int) -> list[str]:
    if world_size < 3:
        return []
    members = [1, world_size - 1]  # not starting at 0 and not adjacent: group ranks != global
    group = dist.new_group(members)  # every rank must call new_group, members or not
    if rank not in members:
        try:
            collectives.all_reduce(torch.zeros(4), group=group, impl="recursive_doubling")
        except ValueError as error:
            return [] if "not a member" in str(error) else [f"unclear message: {error}"]
        return ["all_reduce on a group this rank is not in: no error"]
    failures = []
    for algorithm in (*FLAT, "auto"):
        ours = _integers(1001, rank, torch.float32)
        theirs = ours.clone()
        dist.all_reduce(theirs, group=group)
        if not torch.equal(collectives.all_reduce(ours, group=group, impl=algorithm), theirs):
            failures.append(f"{algorithm} all_reduce on a subgroup")
    ours = _integers(1001, rank, torch.float32)
    theirs = ours.clone()
    dist.all_reduce(theirs, group=group)
    with count_traffic() as counter:
        comm.ring_all_reduce(ours, group=group)
    if not torch.equal(ours, theirs):
        failures.append("all_reduce on a subgroup")
    if abs(counter.bytes_sent - ring_bytes_sent("all_reduce", 1001 * 4, 2)) > 2 * 4:
        failures.append(f"subgroup all_reduce sent {counter.bytes_sent} B")
    # One record per collective, per group: minidist's and the backend's collectives alike.
    with count_traffic() as log:
        collectives.all_reduce(torch.ones(10), group=group, impl="ring")
        collectives.all_gather(torch.ones(3), 6, group=group, impl="ring")
        collectives.reduce_scatter(torch.ones(8), group=group)
        collectives.all_gather(torch.ones(3), 6, group=group)
    expected = {("all_reduce", 2): (1, 40), ("all_gather", 2): (2, 48),
                ("reduce_scatter", 2): (1, 32)}
    if log.per_collective() != expected:
        failures.append(f"per collective and group: {log.per_collective()}, not {expected}")
    if {c.ranks for c in log.collectives} != {tuple(members)}:
        failures.append(f"records name the group's ranks {members}: {log.collectives}")
    gathers = (log.calls("all_gather"), log.nbytes("all_gather"))
    if gathers != (2, 48):
        failures.append(f"all_gather: (calls, bytes) = {gathers}, not (2, 48)")
    ours = torch.full((5,), float(rank))
    comm.tree_broadcast(ours, src=world_size - 1, group=group)
    if not torch.equal(ours, torch.full((5,), float(world_size - 1))):
        failures.append("broadcast on a subgroup from a global src")
    start, end = comm.chunk_bounds(1001, 2)[members.index(rank)]
    chunk = comm.ring_reduce_scatter(torch.ones(1001), group=group)
    if chunk.numel() != end - start or not torch.equal(chunk, torch.full((end - start,), 2.0)):
        failures.append("reduce_scatter on a subgroup: chunk numbering must follow group ranks")
    return failures


CHECKS = {
    check.__name__.removeprefix("_check_"): check
    for check in (
        _check_all_reduce,
        _check_all_reduce_algorithms,
        _check_all_reduce_bytes,
        _check_auto,
        _check_reduce_scatter_and_all_gather,
        _check_broadcast,
        _check_ring_bytes,
        _check_counting_plain_sends,
        _check_errors,
        _check_subgroup,
    )
}


def _run_checks(rank: int, world_size: int) -> dict[str, list[str]]:
    return {name: check(rank, world_size) for name, check in CHECKS.items()}


@functools.cache
def _results(world_size: int) -> list[dict[str, list[str]]]:
    return run(_run_checks, world_size, timeout=60)


# One worker runs every check of a world size: the launch behind them is cached per process.
@pytest.mark.parametrize("world_size", [
    pytest.param(n, marks=pytest.mark.xdist_group(f"comm-{n}")) for n in WORLD_SIZES])
@pytest.mark.parametrize("check", CHECKS)
def test_against_torch(check: str, world_size: int) -> None:
    failures = {rank: r[check] for rank, r in enumerate(_results(world_size)) if r[check]}
    assert not failures, f"{check} failed on N={world_size}: {failures}"


def _all_reduce_sizes_differ(rank: int, world_size: int, algorithm: str) -> list[float]:
    tensor = torch.ones(1000 + rank)
    collectives.all_reduce(tensor, impl=algorithm)
    return tensor[:2].tolist()


@pytest.mark.parametrize("algorithm", FLAT)
def test_sizes_that_differ_across_ranks_fail_loudly(algorithm: str) -> None:
    # gloo aborts a rank that receives a larger message than it posted a buffer for ("Received
    # data size doesn't match expected size"); every algorithm sends whole tensors or chunks
    # both ways along each edge, so some rank always sees one.
    with pytest.raises(RankError):
        run(_all_reduce_sizes_differ, 3, algorithm, timeout=20)


def test_one_table_of_algorithms_joined_to_its_code() -> None:
    """impls.TABLE is costs.algorithms.TABLE, row for row, each with code for every collective
    the row runs; a collective's choices are "torch", "auto" for all_reduce, then the table's
    names; a wrong impl names them."""
    assert [row.algorithm for row in impls.TABLE] == list(algorithms.TABLE)
    for row in impls.TABLE:
        assert set(row.streamed) == set(row.algorithm.collectives), row.name
        assert set(row.plain) <= set(row.algorithm.collectives), row.name
    assert impls.choices("all_reduce") == (
        "torch", "auto", "ring", "recursive_doubling", "tree", "rabenseifner", "hierarchical")
    assert impls.choices("reduce_scatter") == impls.choices("all_gather") == ("torch", "ring")
    assert impls.choices("broadcast") == ("torch", "tree")
    assert impls.choices("all_to_all") == ("torch", "pairwise")
    with pytest.raises(ValueError, match="impl='butterfly': all_reduce runs with one of 'torch', "
                                         "'auto', 'ring'"):
        impls.check_impl("all_reduce", "butterfly")


def test_chunk_bounds() -> None:
    assert comm.chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert comm.chunk_bounds(9, 3) == [(0, 3), (3, 6), (6, 9)]
    assert comm.chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert comm.chunk_bounds(0, 2) == [(0, 0), (0, 0)]
    with pytest.raises(ValueError, match="world_size"):
        comm.chunk_bounds(10, 0)


def test_needs_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="minidist.core.launch.run"):
        comm.ring_all_reduce(torch.zeros(4))


def test_count_traffic_outside_ranks_counts_nothing() -> None:
    with count_traffic() as counter:
        pass
    assert (counter.bytes_sent, counter.messages) == (0, 0)


def _all_to_all_with(rank: int, world_size: int, impl: str, receive_more: bool) -> torch.Tensor:
    """Rank r sends r + 1 rows to every rank; rank 1 expects one row more (or fewer) from
    rank 0 than rank 0 sends it."""
    sends = [rank + 1] * world_size
    receives = [peer + 1 for peer in range(world_size)]
    if rank == 1:
        receives[0] += 1 if receive_more else -1
    x = torch.full((sum(sends), 2), float(rank))
    return collectives.all_to_all(x, sends, receives, impl=impl)


@pytest.mark.parametrize("impl", ["pairwise", "torch"])
@pytest.mark.parametrize("receive_more", [True, False])
def test_all_to_all_with_mismatched_splits_names_both_ranks(impl, receive_more):
    """A receive size larger than what the peer sends would come back as uninitialised
    memory, a smaller one as a shape error inside torch: every rank raises first, naming
    both ranks' calls."""
    with pytest.raises(RankError) as raised:
        run(_all_to_all_with, 3, impl, receive_more, timeout=20)
    message = str(raised.value)
    expected = 2 if receive_more else 0
    assert "mismatched splits" in message and (
        f"rank 1 expects {expected} rows from rank 0, which sends it 1" in message), message
    assert "send_sizes=[1, 1, 1]" in message, message
    assert all(f"rank {rank}" in message for rank in range(3)), message


def _mismatched_call(rank: int, world_size: int, mistake: str) -> list[float]:
    """Rank 1 makes one of a student's mistakes in its second collective: the first (an
    all-reduce every rank makes alike) must run as it does without the check."""
    collectives.all_reduce(torch.ones(3), impl="ring")
    x = torch.ones(8)
    if rank == 1 and mistake == "size":
        x = torch.ones(6)
    if rank == 1 and mistake == "dtype":  # as many bytes: gloo would sum them as floats
        return collectives.all_reduce(torch.ones(8, dtype=torch.int32)).tolist()
    if rank == 1 and mistake == "collective":
        return collectives.broadcast(x).tolist()
    impl = "torch" if rank == 1 and mistake == "impl" else "ring"
    return collectives.all_reduce(x, impl=impl).tolist()


@pytest.mark.parametrize("mistake, rank_1_called", [
    ("size", "all_reduce(6 float32, op='sum', impl='ring')"),
    ("dtype", "all_reduce(8 int32, op='sum', impl='torch')"),
    ("impl", "all_reduce(8 float32, op='sum', impl='torch')"),
    ("collective", "broadcast(8 float32, src=0, impl='torch')"),
])
def test_checked_calls_name_every_ranks_collective_before_any_byte_moves(mistake, rank_1_called):
    """With check_calls (on in notebooks) the collective layer compares each call across its
    group through the store first: a mismatch that would crash, hang or return garbage raises
    on every rank, naming the calls and their ranks."""
    with pytest.raises(RankError) as raised:
        run(_mismatched_call, 3, mistake, timeout=20, check_calls=True)
    message = str(raised.value)
    assert ("CallMismatch: collective mismatch, the 2nd collective on ranks [0, 1, 2]: ranks 0, "
            f"2 called all_reduce(8 float32, op='sum', impl='ring'), rank 1 called "
            f"{rank_1_called}") in message, message
    assert "SIGABRT" not in message and "did not finish" not in message, message


def test_checked_calls_that_agree_send_what_they_send_unchecked():
    """The comparison meets in the store: a count of the group's messages sees none of it."""
    def counted(rank: int, world_size: int) -> tuple[list[tuple[int, int]], list[float]]:
        with count_traffic() as log:
            total = collectives.all_reduce(torch.arange(6.0) * (rank + 1), impl="ring")
            collectives.all_to_all(torch.ones(3, 2), [1, 1, 1], [1, 1, 1], impl="pairwise")
        return log.sends, total.tolist()

    checked, unchecked = (run(counted, 3, check_calls=check) for check in (True, False))
    assert checked == unchecked
    assert checked[0][1] == [0.0, 6.0, 12.0, 18.0, 24.0, 30.0]


def test_checked_calls_are_on_in_a_notebook_and_off_in_a_script(monkeypatch):
    """`check_calls` defaults to whether run is called from a Jupyter kernel."""
    with pytest.raises(RankError, match="collective mismatch"):
        monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
        run(_mismatched_call, 2, "impl", timeout=20)
    monkeypatch.delitem(sys.modules, "ipykernel")
    with pytest.raises(RankError) as unchecked:  # gloo's own failure, later and vaguer
        run(_mismatched_call, 2, "impl", timeout=5)
    assert "CallMismatch" not in str(unchecked.value)


def test_all_to_all_with_matching_uneven_splits_still_runs():
    def uneven(rank: int, world_size: int) -> list[float]:
        sends = [rank + 1] * world_size
        got = collectives.all_to_all(torch.full((sum(sends),), float(rank)), sends,
                                     [peer + 1 for peer in range(world_size)], impl="pairwise")
        return got.tolist()

    assert run(uneven, 3) == [[0.0, 1.0, 1.0, 2.0, 2.0, 2.0]] * 3
