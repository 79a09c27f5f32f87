"""minidist.communication.network: the emulated two-tier network, its alpha-beta model,
hierarchical all-reduce and the flat ring on g channels against torch.distributed's all-reduce on 2
x 2, 2 x 3 and 3 x 2 ranks, and bad input.

No test here reads a clock to judge speed: the emulation is checked on its mechanism (which port
a message takes, when it is scheduled to leave and arrive, that a delayed isend returns at once
and that what it sends arrives), hierarchical all-reduce on its results and its bytes per tier,
the channel rings on their results, their messages' order and their bytes per peer and port.
Measured ratios are bench/hierarchical_allreduce.py's job.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from minidist.communication import collectives, comm, emulation, hierarchical, link_sweep
from minidist.communication.counting import count_traffic
from minidist.communication.emulation import Network
from minidist.communication.mesh import Mesh
from minidist.communication.network import TwoTier, hierarchical_bytes
from minidist.core import interposer
from minidist.core.launch import RankError, run
from minidist.costs import algorithms, cost

LAYOUTS = ((2, 2), (2, 3), (3, 2))  # (nodes, ranks per node)
SIZES = (1, 7, 1000, 2**16 + 3)
DTYPES = (torch.float32, torch.bfloat16)


def _integers(numel: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Integers in [-16, 16]: sums over 6 ranks are exact in bfloat16, so any order of
    additions gives the same bits."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-16, 17, (numel,), generator=generator).to(dtype)


# --- On ranks: one launch per layout -----------------------------------------------------------


def _check_equal_to_torch(rank: int, net: Network) -> list[str]:
    failures = []
    for numel in SIZES:
        for dtype in DTYPES:
            for op in ("sum", "avg"):
                ours = _integers(numel, 100 * rank + numel, dtype)
                expected = ours.clone()
                dist.all_reduce(expected)
                if op == "avg":
                    expected /= dist.get_world_size()
                returned = collectives.all_reduce(ours, op=op, impl="hierarchical", network=net)
                if returned is not ours or not torch.equal(ours, expected):
                    failures.append(f"numel={numel}, {dtype}, op={op}")
    return failures


def _check_bytes_per_tier(rank: int, net: Network) -> list[str]:
    """Each rank sends 2(g-1)/g * S inside its node and 2(n-1)/n * S/g across: exactly when
    n*g divides the tensor, within one element per step otherwise; inside the node to its
    right neighbour, across nodes only to its own local rank on the next node."""
    failures, tiers = [], net.tiers
    world, g = dist.get_world_size(), tiers.ranks_per_node
    n = world // g
    node, local = divmod(rank, g)
    across = {(node + 1) % n * g + local} - {rank}
    for numel in (world * 5000, 2**16 + 3):
        for dtype in DTYPES:
            tensor = torch.ones(numel, dtype=dtype)
            with count_traffic() as log:
                collectives.all_reduce(tensor, impl="hierarchical", network=net)
            counted = tiers.bytes_per_tier(log.sends, rank)
            formula = hierarchical_bytes(numel * tensor.element_size(), n, g)
            steps = {"intra": 2 * (g - 1), "inter": 2 * (n - 1)}
            for tier in ("intra", "inter"):
                slack = 0 if numel % world == 0 else steps[tier] * tensor.element_size()
                if abs(counted[tier] - formula[tier]) > slack:
                    failures.append(f"{tier}, numel={numel}, {dtype}: counted {counted[tier]}, "
                                    f"formula {formula[tier]:.0f}")
            peers = set(log.bytes_to())
            inside = {p for p in peers if p // g == node}
            if g > 1 and inside != {node * g + (local + 1) % g}:
                failures.append(f"sent inside its node to {sorted(inside)}, not its right "
                                f"neighbour only")
            if peers - inside != across:
                failures.append(f"sent across nodes to {sorted(peers - inside)}, expected "
                                f"local rank {local} of the next node: {sorted(across)}")
            if log.calls("all_reduce") != 1:
                failures.append(f"recorded {log.calls('all_reduce')} all_reduce calls, not 1")
    return failures


def _check_mesh(rank: int, tiers: TwoTier) -> list[str]:
    failures = []
    g = tiers.ranks_per_node
    mesh = Mesh(dp=dist.get_world_size(), network=tiers)
    node_ranks = comm.ring_of(mesh.node_group()).members
    across = comm.ring_of(mesh.cross_node_group()).members
    if list(node_ranks) != list(range(rank // g * g, rank // g * g + g)):
        failures.append(f"node group {node_ranks}")
    if list(across) != list(range(rank % g, dist.get_world_size(), g)):
        failures.append(f"cross-node group {across}")
    if mesh.node_of() != rank // g or mesh.node_of(0) != 0:
        failures.append(f"node_of says {mesh.node_of()}")
    # impl="hierarchical" over the mesh's dp group (the whole job) works too; over part of the
    # job it refuses, before sending anything
    tensor = torch.ones(10)
    collectives.all_reduce(tensor, group=mesh.group("dp"), impl="hierarchical",
                           network=mesh.network)
    if not torch.equal(tensor, torch.full((10,), float(dist.get_world_size()))):
        failures.append(f"hierarchical on the dp group gave {tensor.tolist()}")
    part = dist.new_group(list(range(g)))
    if rank < g:
        try:
            collectives.all_reduce(torch.ones(4), group=part, impl="hierarchical",
                                   network=mesh.network)
            failures.append("hierarchical on part of the job did not raise")
        except ValueError as error:
            if "part of it" not in str(error):
                failures.append(f"unclear error: {error}")
    return failures


def _check_auto(rank: int, net: Network) -> list[str]:
    """auto follows the two-tier model: large tensors go hierarchical (its bytes across
    nodes), the smallest ones the algorithm the model names."""
    failures, tiers = [], net.tiers
    world = dist.get_world_size()
    for numel in (4, 2**18):
        nbytes = numel * 4
        expected = tiers.best_all_reduce(nbytes, world)
        tensor = torch.ones(numel)
        with count_traffic() as log:
            collectives.all_reduce(tensor, impl="auto", network=net)
        reference = torch.ones(numel)
        with count_traffic() as reference_log:
            collectives.all_reduce(reference, impl=expected, network=net)
        if log.bytes_to() != reference_log.bytes_to() or not torch.equal(tensor, reference):
            failures.append(f"auto at {nbytes} B did not run {expected}")
    if tiers.best_all_reduce(2**20, world) != "hierarchical":
        failures.append(f"the model prefers {tiers.best_all_reduce(2**20, world)} at 1 MiB")
    return failures


def _check_channels(rank: int, net: Network) -> list[str]:
    """The flat ring on c channels (hierarchical.channels_all_reduce): equal to torch's sum for
    c = 1, g and g + 1 (two channels between the same two ranks); each step sends one message
    per channel, to that channel's right neighbour, in channel order; per rank, channel c's
    bytes 2(N-1)/N * S/c go to its right in ring c, so with c = g every rank's inter-node port
    carries exactly one channel's S/g share and the plain ring's (c = 1) only the node's last
    rank sends across."""
    failures, tiers = [], net.tiers
    world, g = dist.get_world_size(), tiers.ranks_per_node
    for channels in (1, g, g + 1):
        rights = [ring[(ring.index(rank) + 1) % world] for ring in tiers.rings(world, channels)]
        for numel, dtype in ((world * channels * 1000, torch.float32), (1001, torch.bfloat16)):
            for average in (False, True):
                ours = _integers(numel, 10 * rank + channels, dtype)
                expected = ours.clone()
                dist.all_reduce(expected)
                if average:
                    expected /= world
                with count_traffic() as log:
                    returned = hierarchical.channels_all_reduce(
                        ours, network=net, channels=channels, average=average)
                if returned is not ours or not torch.equal(ours, expected):
                    failures.append(f"channels={channels}, numel={numel}, {dtype}, "
                                    f"average={average}: not torch's result")
                if numel % (world * channels) or average:
                    continue
                # Mechanism: the order of the messages, then the bytes per peer and per port
                steps = 2 * (world - 1)
                if [peer for peer, _ in log.sends] != rights * steps:
                    failures.append(f"channels={channels}: sent to {[p for p, _ in log.sends]}, "
                                    f"expected each step {rights} (one message per channel)")
                share = 2 * (world - 1) / world * numel * 4 / channels  # one channel's bytes
                expected_to = {}
                for right in rights:
                    expected_to[right] = expected_to.get(right, 0) + share
                if log.bytes_to() != expected_to:
                    failures.append(f"channels={channels}: bytes to {log.bytes_to()}, "
                                    f"expected {expected_to}")
                crossing = sum(tiers.tier(rank, right) == "inter" for right in rights)
                inter = tiers.bytes_per_tier(log.sends, rank)["inter"]
                if channels == g and world > g and inter != share:
                    failures.append(f"channels={g}: {inter} B across nodes, expected one "
                                    f"channel's {share:.0f}")
                if channels == 1 and inter != (share if rank % g == g - 1 and world > g else 0):
                    failures.append(f"one channel: local rank {rank % g} sent {inter} B across")
                if inter != crossing * share:
                    failures.append(f"channels={channels}: {inter} B across, {crossing} "
                                    f"crossing channel(s) of {share:.0f}")
    return failures


def _on_layout(rank: int, world_size: int, g: int) -> dict[str, list[str]]:
    tiers = TwoTier(ranks_per_node=g, emulated=False)  # the same sends, without the delays
    net = Mesh(dp=world_size, network=tiers).network
    results = {check.__name__.removeprefix("_check_"): check(rank, net)
               for check in (_check_equal_to_torch, _check_bytes_per_tier, _check_auto,
                             _check_channels)}
    results["mesh"] = _check_mesh(rank, tiers)
    # The same all-reduce under the emulation: equal results, every message delayed
    emulated = TwoTier(ranks_per_node=g, inter_bandwidth=1e9, intra_bandwidth=1e10,
                       inter_latency=1e-4, intra_latency=1e-5)
    slow = Mesh(dp=world_size, network=emulated).network
    results["emulated"] = _check_equal_to_torch(rank, slow)[:1]
    tensor = _integers(999, rank, torch.float32)
    expected = tensor.clone()
    dist.all_reduce(expected)
    if not torch.equal(hierarchical.channels_all_reduce(tensor, network=slow), expected):
        results["emulated"].append("channels_all_reduce under the emulation: not torch's sum")
    slow.close()
    try:
        hierarchical.channels_all_reduce(torch.ones(4), network=None)
        results["channels"].append("channels_all_reduce without a network did not raise")
    except ValueError as error:
        if "network=mesh.network" not in str(error):
            results["channels"].append(f"unclear error: {error}")
    return results


@functools.cache
def _layout(nodes: int, g: int) -> list[dict[str, list[str]]]:
    return run(_on_layout, nodes * g, g, timeout=120)


# One worker runs every check of a layout: the launch behind them is cached per process.
@pytest.mark.parametrize(("nodes", "g"), [
    pytest.param(*layout, marks=pytest.mark.xdist_group(f"layout-{layout}")) for layout in LAYOUTS])
@pytest.mark.parametrize("check", ["equal_to_torch", "bytes_per_tier", "auto", "channels",
                                   "mesh", "emulated"])
def test_hierarchical_all_reduce(check: str, nodes: int, g: int) -> None:
    failures = {rank: r[check] for rank, r in enumerate(_layout(nodes, g)) if r[check]}
    assert not failures, f"{check} failed on {nodes} nodes x {g} ranks: {failures}"


# --- The emulation's mechanism ------------------------------------------------------------------


def _emulation_mechanism(rank: int, world_size: int) -> dict:
    tiers = TwoTier(ranks_per_node=2, intra_bandwidth=100e6, inter_bandwidth=10e6,
                    intra_latency=1e-3, inter_latency=5e-3)
    slow = Mesh(dp=4, network=tiers).network
    found: dict = {}
    message = torch.full((2**18,), float(rank))  # 1 MiB: 10 ms inside, 100 ms across
    if rank == 0:
        # Three sends posted at once, two across nodes, one inside: the inter-node ones queue
        # on the inter-node port; the intra-node one does not wait behind them.
        works = [dist.isend(message, 2), dist.isend(message, 3), dist.isend(message, 1)]
        found["returned at once"] = [not work.is_completed() for work in works]
        found["delayed"] = all(isinstance(work, emulation._DelayedSend) for work in works)
        found["schedule"] = [(work.leaves, work.arrives) for work in works]
        for work in works:
            work.wait()
        dist.send(torch.ones(1), 1)  # tells rank 1 all has arrived
    else:
        received = torch.zeros(2**18)
        dist.recv(received, 0)
        found["received"] = received.eq(0).all().item()
        if rank == 1:
            dist.recv(torch.zeros(1), 0)
    # A blocking dist.send inside the node, and torch's own collective, which bypasses the
    # emulation (no send of this process is routed through it)
    with count_traffic() as log:
        dist.all_reduce(torch.ones(4))
    found["torch collective sends"] = log.messages
    slow.close()
    found["send restored"] = "route" not in interposer.subscribers("ProcessGroup.send")
    work = dist.isend(torch.ones(1), (rank + 1) % 4)
    found["after detach"] = type(work).__name__
    dist.recv(torch.ones(1), (rank - 1) % 4)
    work.wait()
    return found


def test_emulated_links_queue_per_port_and_delay_without_blocking() -> None:
    results = run(_emulation_mechanism, 4, timeout=60)
    sender = results[0]
    assert sender["delayed"] and sender["returned at once"] == [True, True, True], sender
    (leaves_2, arrives_2), (leaves_3, arrives_3), (leaves_1, arrives_1) = sender["schedule"]
    nbytes = 2**18 * 4
    # Each inter-node message takes nbytes / 10 MB/s on the port and arrives 5 ms after leaving
    # it; the second leaves when the first has left.
    assert leaves_3 == pytest.approx(leaves_2 + nbytes / 10e6, abs=1e-9)
    assert arrives_2 == pytest.approx(leaves_2 + nbytes / 10e6 + 5e-3, abs=1e-9)
    assert arrives_3 == pytest.approx(leaves_3 + nbytes / 10e6 + 5e-3, abs=1e-9)
    # The intra-node message, posted last, leaves at once on its own port and arrives first.
    assert leaves_1 < leaves_3
    assert arrives_1 == pytest.approx(leaves_1 + nbytes / 100e6 + 1e-3, abs=1e-9)
    assert arrives_1 < arrives_2
    assert all(r["received"] for r in results[1:]), results
    assert all(r["torch collective sends"] == 0 for r in results)
    assert all(r["send restored"] and r["after detach"] != "_DelayedSend" for r in results)


def _plain_sends_under_emulation(rank: int, world_size: int) -> bool:
    """A student's own ring (comm's, dist.isend/irecv whole messages) and dist.batch_isend_irecv
    are routed through the emulation and still sum right."""
    Mesh(dp=4, network=TwoTier(ranks_per_node=2, inter_bandwidth=1e9, intra_bandwidth=1e10))
    tensor = _integers(1001, rank, torch.float32)
    expected = tensor.clone()
    dist.all_reduce(expected)
    comm.ring_all_reduce(tensor)
    right, left = (rank + 1) % 4, (rank - 1) % 4
    incoming = torch.zeros(3)
    for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), rank * 1.0),
                                                      right),
                                           dist.P2POp(dist.irecv, incoming, left)]):
        request.wait()
    return torch.equal(tensor, expected) and incoming.eq(left).all().item()


def test_students_sends_go_through_the_emulation() -> None:
    assert run(_plain_sends_under_emulation, 4, timeout=60) == [True] * 4


# --- Bad input: a ValueError naming the value and the fix, before any rank blocks -----------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"ranks_per_node": 0}, "ranks_per_node=0: must be a whole number >= 1"),
    ({"ranks_per_node": 2, "inter_bandwidth": 0}, "inter_bandwidth=0: must be a positive number "
                                                  "of bytes per second"),
    ({"ranks_per_node": 2, "intra_bandwidth": -1e9}, "intra_bandwidth=-1000000000.0: must be"),
    ({"ranks_per_node": 2, "inter_latency": 0}, "inter_latency=0: must be a positive number of "
                                                "seconds"),
    ({"ranks_per_node": 2, "intra_latency": -1}, "intra_latency=-1"),
    ({"ranks_per_node": 2, "degraded": {1: 0}}, "node 1 keeps 0 of its bandwidth; give a "
                                                "fraction in (0, 1]"),
    ({"ranks_per_node": 2, "degraded": {1: 1.5}}, "fraction in (0, 1]"),
    ({"ranks_per_node": 2, "degraded": {-1: 0.5}}, "node -1 must be a node number"),
])
def test_bad_links_raise_at_once(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        TwoTier(**kwargs)


def test_nodes_must_be_whole_and_a_degraded_node_must_exist() -> None:
    with pytest.raises(ValueError, match=r"ranks_per_node=3 does not divide the 4 ranks: nodes "
                                         r"must be whole; choose ranks_per_node in \[1, 2, 4\]"):
        TwoTier(ranks_per_node=3).nodes(4)
    with pytest.raises(ValueError, match=r"degraded=\{2: 0.5\} names node 2, but 4 ranks of 2 "
                                         r"per node make nodes 0..1: name one of those"):
        TwoTier(ranks_per_node=2, degraded={2: 0.5}).nodes(4)
    assert TwoTier(ranks_per_node=2, degraded={1: 0.5}).nodes(4) == 2


def _mesh_with(rank: int, world_size: int, tiers: object) -> None:
    Mesh(dp=4, network=tiers)


@pytest.mark.parametrize(("tiers", "message"), [
    (TwoTier(ranks_per_node=3), "ranks_per_node=3 does not divide the 4 ranks"),
    (TwoTier(ranks_per_node=2, degraded={5: 0.5}), "names node 5"),
    ("2x2", "network='2x2': give a minidist.communication.network.TwoTier"),
])
def test_mesh_refuses_bad_networks_before_any_rank_blocks(tiers: object, message: str) -> None:
    with pytest.raises(RankError, match=message) as raised:
        run(_mesh_with, 4, tiers, timeout=20)
    assert "ValueError" in str(raised.value)
    assert "did not finish" not in str(raised.value)  # every rank failed, none was left waiting


def test_mesh_without_a_network_has_no_node_groups() -> None:
    def no_network(rank: int, world_size: int) -> str:
        mesh = Mesh(dp=2)
        try:
            mesh.node_group()
        except ValueError as error:
            return str(error)
        return "no error"

    assert all("network=TwoTier(ranks_per_node=...)" in m for m in run(no_network, 2))


# --- The two-tier model, without ranks -------------------------------------------------------


def test_the_model_charges_each_step_on_its_slowest_link() -> None:
    tiers = TwoTier(ranks_per_node=2)
    s, inter, intra = 16 * 2**20, tiers.inter, tiers.intra
    # the flat ring pays the inter-node link on every step, whatever the ranks per node
    assert tiers.all_reduce_time("ring", s, 4) == pytest.approx(
        cost.all_reduce_time("ring", s, 4, inter.alpha, inter.beta))
    # hierarchical: reduce-scatter and all-gather inside (g - 1 steps of S/g each), ring
    # all-reduce of S/g across the n nodes
    n, g = 2, 2
    expected = (2 * (g - 1) * (intra.alpha + s / g * intra.beta)
                + 2 * (n - 1) * (inter.alpha + s / g / n * inter.beta))
    assert tiers.all_reduce_time("hierarchical", s, 4) == pytest.approx(expected)
    # recursive doubling on 2 x 2: one exchange inside (distance 1), one across (distance 2)
    assert tiers.all_reduce_time("recursive_doubling", s, 4) == pytest.approx(
        intra.alpha + s * intra.beta + inter.alpha + s * inter.beta)
    # one node: the plain model on the fast link
    one_node = TwoTier(ranks_per_node=4)
    for algorithm in ("ring", "tree", "recursive_doubling", "rabenseifner"):
        assert one_node.all_reduce_time(algorithm, s, 4) == pytest.approx(
            cost.all_reduce_time(algorithm, s, 4, intra.alpha, intra.beta))
    # a node at half bandwidth doubles every step that crosses to it
    half = TwoTier(ranks_per_node=2, degraded={1: 0.5})
    assert half.all_reduce_time("ring", s, 4) == pytest.approx(
        cost.all_reduce_time("ring", s, 4, inter.alpha, 2 * inter.beta))
    # 10x slower inter-node links: hierarchical takes about 0.4 of the flat ring at 16 MiB
    ratio = tiers.all_reduce_time("hierarchical", s, 4) / tiers.all_reduce_time("ring", s, 4)
    assert 0.35 < ratio < 0.45
    assert tiers.best_all_reduce(s, 4) == "hierarchical"
    assert tiers.best_all_reduce(64, 4) == "recursive_doubling"
    assert {tiers.best_all_reduce(size, 4) for size in (64, s)} <= set(
        algorithms.names("all_reduce"))
    with pytest.raises(ValueError, match="algorithm='nccl'"):
        tiers.all_reduce_time("nccl", s, 4)


def test_channel_rings_leave_each_node_through_a_different_port() -> None:
    tiers = TwoTier(ranks_per_node=2)
    assert tiers.rings(4) == [(0, 1, 2, 3)]  # channel 0: the plain ring
    assert tiers.rings(4, 2) == [(0, 1, 2, 3), (1, 0, 3, 2)]
    for n, g in ((2, 2), (2, 4), (3, 2), (4, 8)):
        layout = TwoTier(ranks_per_node=g)
        rings = layout.rings(n * g, g)
        # every ring visits every rank once and each node's ranks one after another
        assert all(sorted(ring) == list(range(n * g)) for ring in rings)
        assert all([rank // g for rank in ring] == sorted(rank // g for rank in ring)
                   for ring in rings)
        # with g channels each rank sends across nodes in exactly one of them: every port used
        senders = sorted(ring[i] for ring in rings for i in range(n * g)
                         if layout.tier(ring[i], ring[(i + 1) % (n * g)]) == "inter")
        assert senders == list(range(n * g))


def test_the_model_prices_a_ring_on_channels_by_its_busiest_port() -> None:
    tiers = TwoTier(ranks_per_node=2)
    s, inter = 16 * 2**20, tiers.inter
    assert tiers.all_reduce_time("ring", s, 4, channels=1) == tiers.all_reduce_time("ring", s, 4)
    # g = 2 channels on 2 x 2: each step one message of S/(gN) on every rank's inter-node port
    # (and one on its intra-node port, faster): the ring on half the tensor
    assert tiers.all_reduce_time("ring", s, 4, channels=2) == pytest.approx(
        6 * (inter.alpha + s / 8 * inter.beta))
    assert tiers.all_reduce_time("ring", s, 4, channels=2) == pytest.approx(
        cost.all_reduce_time("ring", s / 2, 4, inter.alpha, inter.beta))
    # more channels than ports: two of the three cross through one rank's port
    assert tiers.all_reduce_time("ring", s, 4, channels=3) == pytest.approx(
        6 * (inter.alpha + 2 * s / 12 * inter.beta))
    # g = 8 with fast inter-node links: a rank's intra-node port carries g - 1 = 7 channels'
    # messages each step and becomes the busiest
    wide = TwoTier(ranks_per_node=8, intra_bandwidth=100e6, inter_bandwidth=50e6)
    chunk = s / 8 / 16
    assert wide.all_reduce_time("ring", s, 16, channels=8) == pytest.approx(
        30 * (wide.intra_latency + 7 * chunk / 100e6))
    # hierarchical against the flat ring: far ahead of one channel, a little ahead of g
    hierarchical = tiers.all_reduce_time("hierarchical", s, 4)
    assert hierarchical / tiers.all_reduce_time("ring", s, 4) == pytest.approx(0.40, abs=0.01)
    assert hierarchical / tiers.all_reduce_time("ring", s, 4, 2) == pytest.approx(0.79, abs=0.01)
    with pytest.raises(ValueError, match="channels=2: only the flat ring runs on channels"):
        tiers.all_reduce_time("hierarchical", s, 4, channels=2)
    with pytest.raises(ValueError, match="channels=0"):
        tiers.all_reduce_time("ring", s, 4, channels=0)


def test_hierarchical_bytes_is_the_reference_formula() -> None:
    s = 12 * 2**20
    assert hierarchical_bytes(s, 2, 2) == {"intra": s, "inter": s / 2}
    assert hierarchical_bytes(s, 4, 8) == {"intra": 2 * 7 / 8 * s, "inter": 2 * 3 / 4 * s / 8}


def test_bytes_per_tier_and_links() -> None:
    tiers = TwoTier(ranks_per_node=2, degraded={1: 0.5})
    assert tiers.bytes_per_tier([(1, 10), (2, 5), (3, 7), (1, 1)], rank=0) == {
        "intra": 11, "inter": 12}
    assert tiers.link(0, 1) == tiers.intra
    assert tiers.link(2, 3) == tiers.intra  # inside the degraded node: its NVLink is fine
    assert tiers.link(0, 2).bandwidth == pytest.approx(tiers.inter_bandwidth / 2)


def test_pair_rounds_meet_every_pair_once() -> None:
    for n in range(2, 9):
        rounds = link_sweep._rounds(n)
        pairs = [pair for round_ in rounds for pair in round_]
        assert sorted(pairs) == [(a, b) for a in range(n) for b in range(a + 1, n)]
        for round_ in rounds:
            ranks = [rank for pair in round_ for rank in pair]
            assert len(ranks) == len(set(ranks))


def test_slow_nodes_names_the_node_in_every_slow_pair() -> None:
    tiers = TwoTier(ranks_per_node=1)
    healthy, slow = 25e6, 12.5e6
    sweep = {(a, b): slow if 2 in (a, b) else healthy for a in range(4) for b in range(a + 1, 4)}
    assert link_sweep.slow_nodes(sweep, tiers) == [2]
    assert link_sweep.slow_nodes({pair: healthy for pair in sweep}, tiers) == []
    two_nodes = TwoTier(ranks_per_node=2)
    across = {(0, 2): slow, (0, 3): slow, (1, 2): slow, (1, 3): slow, (0, 1): 1e9, (2, 3): 1e9}
    assert link_sweep.slow_nodes(across, two_nodes) == []  # no healthy pair to compare with
    assert link_sweep.slow_nodes(across, two_nodes, expected=healthy) == [0, 1]


@pytest.mark.parametrize("n, g", [(2, 1), (4, 2), (8, 2), (8, 4), (6, 3), (12, 4)])
def test_with_equal_tiers_the_two_tier_model_is_the_tables_alpha_beta(n: int, g: int) -> None:
    """Every all-reduce of the algorithm table, hierarchical included, costs on two equal tiers
    what the table's a(N) * alpha + b(N) * S * beta says on one link."""
    same = TwoTier(ranks_per_node=g, intra_latency=1e-3, intra_bandwidth=25e6)
    s = 16 * 2**20
    for algorithm in algorithms.running("all_reduce"):
        a, b, _ = algorithm.coefficients("all_reduce", n, g)
        assert same.all_reduce_time(algorithm.name, s, n) == pytest.approx(
            a * same.inter.alpha + b * s * same.inter.beta), algorithm.name
