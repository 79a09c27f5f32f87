"""Nodes and links: an EMULATED two-tier network, its alpha-beta model, hierarchical all-reduce.

A GPU cluster has two kinds of links. Inside a node, GPUs talk over NVLink (H100: 450 GB/s each
way); between nodes, over one InfiniBand port per GPU (NDR: 50 GB/s each way), about 9x slower
(REFERENCES.md#nvidia-h100, REFERENCES.md#infiniband-ndr). Processes on one laptop talk over
loopback, all equally fast. This module makes a laptop feel the difference:

    tiers = TwoTier(ranks_per_node=2)                # intra-node links 10x faster than inter
    mesh = Mesh(dp=4, network=tiers)                 # ranks 0,1 on node 0; ranks 2,3 on node 1
    collectives.all_reduce(t, impl="hierarchical", network=mesh.network)
                                                     # reduce-scatter in the node, all-reduce
                                                     # across nodes, all-gather in the node

The network is an argument: `mesh.network` (a `Network`) is what a collective that needs the
nodes is given; nothing in the module remembers it.

**It is an emulation.** Once a Mesh is built with an emulated `TwoTier` (until
`mesh.network.close()`, the next Mesh built with one, or the job's end), every point-to-point
message this process sends
(minidist's algorithms, and a student's own dist.send / dist.isend, all of which end in torch's
ProcessGroup.send) is held back for the time its link would take: it leaves when the sending
rank's port for that tier is free, takes nbytes * beta on it, and arrives alpha later; only
then does the real send start. Messages on one port queue behind each other (a port per rank
and tier, as a GPU has its NVLinks and its own network port); a delayed isend returns at once,
so overlap still overlaps. The emulated links are scaled down (25 MB/s between nodes, not 50
GB/s) so that the real loopback transfer underneath is small beside them and a laptop measures
them in milliseconds; ratios, not absolute times, carry over to a cluster. torch's own
collectives (dist.all_reduce, gloo's and NCCL's) run in C++ and bypass the emulation: compare
minidist's algorithms with each other under it, never with torch's. On a real cluster the links
are real: build the mesh with `TwoTier(..., emulated=False)` to tell minidist where the nodes
are without delaying anything.

A degraded link (`degraded={node: fraction}`) keeps only that fraction of its inter-node
bandwidth, both ways: the seeds' incident of an InfiniBand link silently running at half speed.

The alpha-beta model of the two tiers (`TwoTier.all_reduce_time`) charges each step of an
algorithm on the slowest link it uses: the flat ring pays the inter-node link on every one of
its 2(N-1) steps. `collectives.all_reduce(t, impl="auto")` picks the algorithm this model
predicts fastest whenever a network is known.

The flat ring crosses between two nodes through ONE rank's port: the other g-1 inter-node ports
of the node sit idle. NCCL does not: it runs several rings at once (its channels), each leaving
the node through a different NIC (REFERENCES.md#nccl-channels). `channels_all_reduce(t,
channels=g)` is that ring: the tensor cut into `channels` parts, part c around ring c of
`TwoTier.rings`, which leaves each node from local rank g-1-c; `TwoTier.all_reduce_time("ring",
S, N, channels=c)` is its cost, each step as long as its busiest port.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from minidist.communication import comm, streaming
from minidist.communication.comm import Ring, chunk_bounds
from minidist.communication.counting import uncounted
from minidist.communication.timing import barrier
from minidist.core import interposer
from minidist.core._checks import positive, positive_int
from minidist.core._groups import members, on_forget_groups
from minidist.costs.cost import ALL_REDUCE_ALGORITHMS, AlphaBeta

__all__ = ["TwoTier", "ALGORITHMS", "hierarchical_bytes", "hierarchical", "channels_all_reduce",
           "Network", "connect", "pairwise_bandwidth", "slow_nodes"]

ALGORITHMS = (*ALL_REDUCE_ALGORITHMS, "hierarchical")
"""All-reduce algorithms the two-tier model predicts: the flat ones and the hierarchical one."""


@dataclass(frozen=True)
class TwoTier:
    """Links inside a node and between nodes, for a job whose nodes hold `ranks_per_node`
    consecutive ranks each (as torchrun and Slurm place them: ranks 0..g-1 on the first node).

    Latencies in seconds, bandwidths in bytes per second, each way. The defaults keep the
    real ratio (NVLink about 10x InfiniBand) at laptop scale. `degraded` maps a node to the
    fraction of its inter-node bandwidth it keeps. `emulated=False` describes real links
    (a cluster's) without delaying any message."""

    ranks_per_node: int
    intra_latency: float = 100e-6
    intra_bandwidth: float = 250e6
    inter_latency: float = 1e-3
    inter_bandwidth: float = 25e6
    degraded: Mapping[int, float] = field(default_factory=dict)
    emulated: bool = True

    def __post_init__(self) -> None:
        _check(self)
        object.__setattr__(self, "degraded", dict(self.degraded))

    def __hash__(self) -> int:
        return hash((self.ranks_per_node, self.intra, self.inter,
                     tuple(sorted(self.degraded.items())), self.emulated))

    def __str__(self) -> str:
        degraded = "".join(f"; node {node} at {kept:.0%} between nodes"
                           for node, kept in sorted(self.degraded.items()))
        return (f"{self.ranks_per_node} ranks per node; inside a node {_speed(self.intra)}; "
                f"between nodes {_speed(self.inter)}{degraded}"
                + ("; EMULATED" if self.emulated else ""))

    @property
    def intra(self) -> AlphaBeta:
        """The link between two ranks of one node."""
        return AlphaBeta(self.intra_latency, 1 / self.intra_bandwidth)

    @property
    def inter(self) -> AlphaBeta:
        """A healthy link between two nodes."""
        return AlphaBeta(self.inter_latency, 1 / self.inter_bandwidth)

    def nodes(self, world_size: int) -> int:
        """How many nodes `world_size` ranks fill; raises ValueError when they do not fit
        whole nodes, or when a degraded node is not one of them."""
        positive_int(world_size=world_size)
        g = self.ranks_per_node
        if world_size % g:
            fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(f"ranks_per_node={g} does not divide the {world_size} ranks: "
                             f"nodes must be whole; choose ranks_per_node in {fits}")
        nodes = world_size // g
        missing = sorted(node for node in self.degraded if node >= nodes)
        if missing:
            raise ValueError(f"degraded={self.degraded!r} names node {missing[0]}, but "
                             f"{world_size} ranks of {g} per node make nodes 0..{nodes - 1}: "
                             f"name one of those")
        return nodes

    def node_of(self, rank: int) -> int:
        """The node global rank `rank` runs on."""
        return rank // self.ranks_per_node

    def link(self, src: int, dst: int) -> AlphaBeta:
        """The link a message from global rank `src` to `dst` takes; across nodes, at the
        speed of the slower end when one of them is degraded."""
        a, b = self.node_of(src), self.node_of(dst)
        if a == b:
            return self.intra
        kept = min(self.degraded.get(a, 1.0), self.degraded.get(b, 1.0))
        return AlphaBeta(self.inter_latency, 1 / (self.inter_bandwidth * kept))

    def tier(self, src: int, dst: int) -> str:
        """"intra" when both ranks share a node, else "inter"."""
        return "intra" if self.node_of(src) == self.node_of(dst) else "inter"

    def bytes_per_tier(self, sends: Iterable[tuple[int, int]], rank: int) -> dict[str, int]:
        """{"intra": bytes, "inter": bytes} that global rank `rank` sent, from a
        `counting.count_traffic()` log's `sends` [(peer, bytes)]."""
        totals = {"intra": 0, "inter": 0}
        for peer, nbytes in sends:
            totals[self.tier(rank, peer)] += nbytes
        return totals

    # --- The alpha-beta model of the two tiers ------------------------------------------------

    def all_reduce_time(self, algorithm: str, nbytes: float, world_size: int,
                        channels: int = 1) -> float:
        """Seconds the two-tier model predicts for all-reduce of `nbytes` over `world_size`
        ranks (the whole job) with `algorithm` (`ALGORITHMS`): each step costs alpha + bytes *
        beta on the slowest link any rank uses in it. The busiest rank's bytes are the
        cost.all_reduce_coefficients ones; additions are left out.

        "ring" with `channels` = c runs `channels_all_reduce`: c rings (`rings`) at once, each
        on S/c; in each of its 2(N-1) steps every ring sends S/(cN) to its right, and a rank's
        port for a tier carries its channels' messages one after another, so the step lasts as
        long as the busiest port: alpha + (its messages) * S/(cN) * beta. With c = 1 that is
        the plain ring on its slowest link."""
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
        positive_int(channels=channels)
        if channels != 1 and algorithm != "ring":
            raise ValueError(f"channels={channels}: only the flat ring runs on channels; "
                             f"{algorithm!r} runs on one (leave channels=1)")
        n, g = self.nodes(world_size), self.ranks_per_node
        if algorithm == "ring" and world_size > 1:
            return 2 * (world_size - 1) * self._busiest_port(nbytes / channels / world_size,
                                                             self.rings(world_size, channels))
        if algorithm == "hierarchical":
            inside = 2 * (g - 1) * (self.intra_latency + nbytes / g / self.intra_bandwidth)
            across = self.slowest_link([(r, r + g) for r in range(world_size - g)])
            return inside + 2 * (n - 1) * (across.alpha + nbytes / g / n * across.beta)
        return sum(link.alpha + fraction * nbytes * link.beta
                   for fraction, link in _flat_steps(self, algorithm, world_size))

    def rings(self, world_size: int, channels: int = 1) -> list[tuple[int, ...]]:
        """The global ranks of each channel's ring, in ring order, as NCCL lays its rings over
        a node's NICs: ring c visits each node's ranks in turn and leaves the node from local
        rank g-1-c (modulo g) for the next node, so with `channels` = g every rank's
        inter-node port carries exactly one channel. Ring 0 is the plain ring 0, 1, ..., N-1."""
        n, g = self.nodes(world_size), self.ranks_per_node
        positive_int(channels=channels)
        starts = [(g - c) % g for c in range(channels)]  # the node's last rank is start - 1
        return [tuple(node * g + (start + i) % g for node in range(n) for i in range(g))
                for start in starts]

    def _busiest_port(self, chunk: float, rings: list[tuple[int, ...]]) -> float:
        """Seconds one step of `rings` lasts when each sends `chunk` bytes to its right: the
        busiest (rank, tier) port's alpha + chunk * the betas of what it carries."""
        ports: dict[tuple[int, str], tuple[float, float]] = {}
        for ring in rings:
            for i, src in enumerate(ring):
                dst = ring[(i + 1) % len(ring)]
                link = self.link(src, dst)
                alpha, beta = ports.get((src, self.tier(src, dst)), (0.0, 0.0))
                ports[src, self.tier(src, dst)] = (max(alpha, link.alpha), beta + link.beta)
        return max(alpha + chunk * beta for alpha, beta in ports.values())

    def best_all_reduce(self, nbytes: float, world_size: int) -> str:
        """The algorithm this model predicts fastest (first of `ALGORITHMS` on a tie)."""
        return min(ALGORITHMS, key=lambda name: self.all_reduce_time(name, nbytes, world_size))

    def slowest_link(self, pairs: list[tuple[int, int]]) -> AlphaBeta:
        """The slowest link among `pairs` (global ranks): what one step of an algorithm
        whose ranks exchange in those pairs costs per message."""
        links = [self.intra, *(self.link(a, b) for a, b in pairs)]
        return AlphaBeta(max(link.alpha for link in links), max(link.beta for link in links))


def _speed(link: AlphaBeta) -> str:
    return f"{link.bandwidth / 1e6:g} MB/s, {link.alpha * 1e6:g} us"


# --- Hierarchical all-reduce -----------------------------------------------------------------


def hierarchical_bytes(nbytes: float, nodes: int, ranks_per_node: int) -> dict[str, float]:
    """Bytes each rank sends in hierarchical all-reduce of an `nbytes` tensor, per tier:
    intra 2(g-1)/g * S (the reduce-scatter and the all-gather inside the node), inter
    2(n-1)/n * S/g (the ring all-reduce of its shard across nodes). Exact when n * g divides
    the tensor; otherwise off by at most one element per step. The flat ring sends
    2(ng-1)/(ng) * S, over the inter-node link on each node's last rank."""
    positive(nbytes=nbytes)
    positive_int(nodes=nodes, ranks_per_node=ranks_per_node)
    n, g = nodes, ranks_per_node
    return {"intra": 2 * (g - 1) / g * nbytes, "inter": 2 * (n - 1) / n * nbytes / g}


def hierarchical(flat: torch.Tensor, node: Ring, across: Ring, average: bool) -> None:
    """Sum (or average) the 1-D `flat` over every rank, in place, in three phases built from
    minidist.communication.streaming's ring: reduce-scatter over `node` (the ranks of this node;
    rank l ends holding chunk l summed over the node), ring all-reduce of that chunk over `across`
    (the
    ranks holding chunk l on every node), all-gather over `node`."""
    streaming.reduce_scatter(flat, node)
    start, end = chunk_bounds(flat.numel(), node.size)[node.rank]
    shard = flat[start:end]
    streaming.ALGORITHMS["ring"](shard, across, False)
    if average:
        shard.div_(node.size * across.size)
    streaming.all_gather(flat, node)


def channels_all_reduce(tensor: torch.Tensor, *, network: Network, channels: int | None = None,
                        average: bool = False) -> torch.Tensor:
    """Sum (or average) the contiguous `tensor` over every rank of the job with the flat ring
    on `channels` channels (default: g, one per rank of a node, as NCCL runs a channel per
    NIC), in place, and return it. `network` is the job's (`mesh.network`, of a Mesh built
    with network=TwoTier(...)); channels=1 is the plain ring.

    The tensor is cut into `channels` parts and part c goes round ring c of
    `TwoTier.rings`: reduce-scatter, then all-gather, 2(N-1) steps in which every channel
    sends one chunk (1/N of its part) to its right, whole, the channels side by side; a step
    ends when all of its messages have arrived (comm.ring_all_reduce's schedule, per channel).
    Each channel's messages carry its own tag, so two channels between the same two ranks
    never take each other's."""
    if not isinstance(network, Network):
        raise ValueError(f"network={network!r}: channels_all_reduce runs over the job's nodes; "
                         "pass network=mesh.network, the mesh built with one, e.g. "
                         "Mesh(dp=4, network=TwoTier(ranks_per_node=2))")
    if not tensor.is_contiguous():
        raise ValueError("channels_all_reduce works in place on a contiguous tensor; pass "
                         "tensor.contiguous() and copy the result back")
    world, rank = dist.get_world_size(), dist.get_rank()
    channels = network.tiers.ranks_per_node if channels is None else channels
    flat = tensor.view(-1)
    parts = chunk_bounds(flat.numel(), channels)
    lanes = []  # per channel: this rank's place in its ring and the chunks of its part
    for (start, end), ring in zip(parts, network.tiers.rings(world, channels), strict=True):
        place = ring.index(rank)
        chunks = [(start + a, start + b) for a, b in chunk_bounds(end - start, world)]
        buffer = flat.new_empty(chunks[0][1] - chunks[0][0])  # chunk 0 is the largest
        lanes.append((ring[place - 1], ring[(place + 1) % world], place, chunks, buffer))
    for step in range(2 * (world - 1)):
        reduce = step < world - 1
        receives, sends, adds = [], [], []
        for tag, (left, _, place, chunks, buffer) in enumerate(lanes):
            a, b = chunks[(place - 2 - step) % world]
            if b > a:  # an empty chunk is sent by neither side
                target = buffer[: b - a] if reduce else flat[a:b]
                receives.append(dist.irecv(target, left, tag=tag))
                adds.append((a, b, target))
        for tag, (_, right, place, chunks, _) in enumerate(lanes):
            a, b = chunks[(place - 1 - step) % world]
            if b > a:
                sends.append(dist.isend(flat[a:b], right, tag=tag))
        for receive, (a, b, target) in zip(receives, adds, strict=True):
            receive.wait()
            if reduce:
                flat[a:b].add_(target)
        for send in sends:  # a chunk must not change before it has left
            send.wait()
    if average:
        flat.div_(world)
    return tensor


# --- The job's network: which ranks share a node ----------------------------------------------


@dataclass(frozen=True)
class Network:
    """The network a job runs on, as the Mesh built with it knows it (`mesh.network`), passed
    to what needs the nodes: `collectives.all_reduce(t, impl="hierarchical", network=...)`,
    `channels_all_reduce`. With an emulated `tiers` it also owns the emulation that delays this
    rank's sends, from `connect` until `close`."""

    tiers: TwoTier
    node: Ring  # this rank in its node
    across: Ring  # this rank among the ranks of the same local rank on every node
    groups: tuple[Any, ...]  # the process groups of every rank of the job
    emulation: _Emulation | None = field(default=None, compare=False, repr=False)

    def spans(self, group: dist.ProcessGroup | None) -> bool:
        """Whether `group` (None: every rank) is the whole job, whose nodes this network knows."""
        return (group or dist.group.WORLD) in self.groups

    def rings(self, group: dist.ProcessGroup | None) -> tuple[Ring, Ring]:
        """(this rank's node, its peers across nodes): the two rings of hierarchical all-reduce
        over `group`, which must be the whole job."""
        if not self.spans(group):
            ring = comm.ring_of(group, "hierarchical all-reduce")
            raise ValueError(
                f"the network (TwoTier(ranks_per_node={self.tiers.ranks_per_node})) knows the "
                f"nodes of the whole job, and group {list(ring.members)} is a part of it: run "
                f"impl='hierarchical' over the whole job (group=None), or a flat impl such as "
                f"'ring' on this group")
        return self.node, self.across

    def close(self) -> None:
        """Stop emulating (after the sends in flight arrive); the network's groups stay."""
        if self.emulation is not None:
            self.emulation.close()


def connect(tiers: TwoTier, node_group: dist.ProcessGroup, cross_group: dist.ProcessGroup,
            whole_job: Iterable[dist.ProcessGroup]) -> Network:
    """The Network of `tiers` over the groups a Mesh made (`Mesh(..., network=tiers)` calls it
    on every rank); an emulated one starts delaying this rank's sends, until its `close`, or
    until the job's groups are destroyed."""
    node, across = comm.ring_of(node_group, "a node"), comm.ring_of(cross_group, "a node")
    emulation = _Emulation(tiers, dist.get_rank()) if tiers.emulated else None
    if emulation is not None:
        # The job's groups end with it: stop emulating. (The emulation holds no group, so this
        # keeps none alive; the Network, which holds them, goes with its Mesh.)
        on_forget_groups(emulation.close)
    return Network(tiers, node, across, tuple(whole_job), emulation)


# --- The emulation ---------------------------------------------------------------------------


class _DelayedSend(dist.Work):
    """A send in flight on an emulated link: wait() returns once the real send, started when
    the emulated message arrived, has completed."""

    def __init__(self, leaves: float, arrives: float) -> None:
        super().__init__()
        self.leaves, self.arrives = leaves, arrives  # on time.monotonic()
        self.posted = threading.Event()
        self.real: dist.Work | None = None
        self.error: BaseException | None = None
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        self.posted.wait()
        if self.error is not None:
            raise self.error
        if not self._done:  # a gloo send waited on twice waits for a send that never comes
            self.real.wait()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or (self.posted.is_set() and self.error is None
                              and self.real.is_completed())


class _Port:
    """One rank's way onto one tier: messages leave one after another, each taking
    nbytes * beta, and arrive alpha after they have left. A thread starts each real send
    when its message arrives, in order, never waiting for one to complete (a receiver may
    take them in another order across process groups)."""

    def __init__(self, name: str):
        self.free_at = 0.0
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.idle = threading.Event()
        self.idle.set()
        self.pending = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._deliver, name=f"minidist-link-{name}", daemon=True).start()

    def post(self, nbytes: int, link: AlphaBeta, start_send: Callable[[], dist.Work]) -> dist.Work:
        with self.lock:
            leaves = max(time.monotonic(), self.free_at)
            self.free_at = leaves + nbytes * link.beta
            work = _DelayedSend(leaves, self.free_at + link.alpha)
            self.pending += 1
            self.idle.clear()
            self.inbox.put((start_send, work))
        return work

    def close(self) -> None:
        """Let the delivery thread end once what is queued has been sent."""
        self.inbox.put(None)

    def _deliver(self) -> None:
        while (item := self.inbox.get()) is not None:
            start_send, work = item
            delay = work.arrives - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                work.real = start_send()
            except BaseException as error:  # the peer is gone: its wait() raises it
                work.error = error
            work.posted.set()
            with self.lock:
                self.pending -= 1
                if not self.pending:
                    self.idle.set()


class _Emulation:
    """This rank's ports, one per tier, and the route every send takes through them."""

    def __init__(self, tiers: TwoTier, rank: int):
        self.tiers, self.rank = tiers, rank
        self.ports = {tier: _Port(f"{tier}-{rank}") for tier in ("intra", "inter")}
        self.closed = False
        # The interposer's last layer: every send of this process now takes its port, in place
        # of an earlier emulation's (whose messages in flight still arrive).
        self.stop_routing = interposer.subscribe("route", "ProcessGroup.send", self.route,
                                                 replace=True)

    def route(self, send: Callable[..., dist.Work], group: dist.ProcessGroup, tensors: list,
              dst: int, *args: Any, **kwargs: Any) -> dist.Work:
        peer = members(group)[dst]
        nbytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
        port = self.ports[self.tiers.tier(self.rank, peer)]
        grad_mode = torch.is_grad_enabled()  # thread-local: the sending thread runs in it too

        def start_send() -> dist.Work:
            with torch.set_grad_enabled(grad_mode):
                return send(group, tensors, dst, *args, **kwargs)

        return port.post(nbytes, self.tiers.link(self.rank, peer), start_send)

    def close(self) -> None:
        """Stop routing sends, wait until every message posted has been sent, then end the
        delivery threads (again: nothing)."""
        if self.closed:
            return
        self.closed = True
        self.stop_routing()
        for port in self.ports.values():
            port.idle.wait()
            port.close()


# --- Finding a slow link ---------------------------------------------------------------------


def _rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of n ranks once, in rounds where each rank is in at most one pair (the
    circle method): n-1 rounds for even n, n for odd n."""
    ranks = list(range(n)) + ([None] if n % 2 else [])
    rounds = []
    for _ in range(len(ranks) - 1):
        half = len(ranks) // 2
        pairs = [(a, b) for a, b in zip(ranks[:half], reversed(ranks[half:]), strict=True)
                 if a is not None and b is not None]
        rounds.append([tuple(sorted(pair)) for pair in pairs])
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]
    return rounds


def pairwise_bandwidth(nbytes: int = 1 << 20, repeat: int = 3) -> dict[tuple[int, int], float]:
    """Bytes per second between every pair of ranks (a < b) of the job, each way: a sends
    `nbytes` to b and b sends them back, `repeat` times, one-way time = half a round trip.
    Pairs go in rounds of disjoint pairs, all pairs of a round at once, as a cluster's
    link check does (cluster_setup/jobs/busbw_check.py --pairwise). Call it on every rank;
    every rank gets the whole table. Nothing it sends is counted."""
    positive_int(nbytes=nbytes, repeat=repeat)
    rank, n = dist.get_rank(), dist.get_world_size()
    payload = torch.zeros(max(1, nbytes // 4))
    mine: dict[tuple[int, int], float] = {}
    with uncounted():
        for pairs in _rounds(n):
            barrier()
            for a, b in pairs:
                if rank not in (a, b):
                    continue
                peer = b if rank == a else a
                for timed in (False, True):  # the first round trip opens the connection
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


def slow_nodes(bandwidths: Mapping[tuple[int, int], float], tiers: TwoTier,
               expected: float | None = None, below: float = 0.75) -> list[int]:
    """The nodes all of whose inter-node pairs run below `below` times `expected` (bytes/s;
    default: the upper quartile of the sweep's inter-node pairs, the healthy speed when most
    links are healthy): where a degraded link is. With two nodes every pair has both ends, so
    give the healthy speed as `expected`; a slow pair then names both nodes."""
    inter = {pair: bw for pair, bw in bandwidths.items() if tiers.tier(*pair) == "inter"}
    if not inter:
        return []
    if expected is None:
        expected = float(torch.tensor(list(inter.values()), dtype=torch.float64).quantile(0.75))
    nodes = sorted({tiers.node_of(rank) for pair in inter for rank in pair})
    return [node for node in nodes
            if all(bw < below * expected for pair, bw in inter.items()
                   if node in (tiers.node_of(pair[0]), tiers.node_of(pair[1])))]


def _check(network: TwoTier) -> None:
    """Raise ValueError naming the first field a person gave wrong, and how to fix it."""
    if isinstance(network.ranks_per_node, bool) or not isinstance(network.ranks_per_node, int) \
            or network.ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={network.ranks_per_node!r}: must be a whole number "
                         f">= 1, the ranks each node holds (e.g. its GPUs)")
    for name in ("intra_latency", "intra_bandwidth", "inter_latency", "inter_bandwidth"):
        value = getattr(network, name)
        unit = "seconds" if name.endswith("latency") else "bytes per second"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name}={value!r}: must be a positive number of {unit}, e.g. "
                             f"{getattr(TwoTier, name):g}; a link has some latency and "
                             f"a finite bandwidth")
    if not isinstance(network.degraded, Mapping):
        raise ValueError(f"degraded={network.degraded!r}: give {{node: fraction of its "
                         f"inter-node bandwidth kept}}, e.g. {{1: 0.5}}")
    for node, fraction in network.degraded.items():
        if isinstance(node, bool) or not isinstance(node, int) or node < 0:
            raise ValueError(f"degraded={dict(network.degraded)!r}: node {node!r} must be a "
                             f"node number 0, 1, ...")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                or not 0 < fraction <= 1:
            raise ValueError(f"degraded={dict(network.degraded)!r}: node {node} keeps "
                             f"{fraction!r} of its bandwidth; give a fraction in (0, 1], "
                             f"e.g. 0.5 for a link at half speed")


def _flat_steps(network: TwoTier, algorithm: str, n: int) -> list[tuple[float, AlphaBeta]]:
    """(bytes per byte of tensor, link) of each step of a flat algorithm other than the ring
    (`TwoTier._busiest_port` prices the ring's steps) on n ranks, in minidist.communication.comm's
    schedules."""
    if n == 1:
        return []
    if algorithm == "tree":  # edges (r, r + 2^k), r < 2^k: up the tree, then down
        rounds = [network.slowest_link([(r, r + 2**k) for r in range(min(2**k, n - 2**k))])
                  for k in range((n - 1).bit_length())]
        return [(1.0, link) for link in rounds * 2]
    p = 1 << (n.bit_length() - 1)
    extra = n - p

    def core(c: int) -> int:  # comm._core_peer
        return 2 * c + 1 if c < extra else c + extra

    folds = [(2 * i, 2 * i + 1) for i in range(extra)]
    fold = [(1.0, network.slowest_link(folds))] if extra else []
    distances = [1 << k for k in range(p.bit_length() - 1)]  # 1, 2, ..., p/2
    exchanges = {d: network.slowest_link([(core(c), core(c ^ d)) for c in range(p)])
                 for d in distances}
    if algorithm == "recursive_doubling":
        middle = [(1.0, exchanges[d]) for d in distances]
    else:  # rabenseifner: halving from distance p/2 (S/2 sent), then doubling back
        halving = [(d / p, exchanges[d]) for d in reversed(distances)]
        middle = halving + halving[::-1]
    return fold + middle + fold
