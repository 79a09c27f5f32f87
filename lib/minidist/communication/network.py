"""Nodes and links: the two-tier network a job runs on, and its alpha-beta model.

A GPU cluster has two kinds of links. Inside a node, GPUs talk over NVLink (H100: 450 GB/s each
way); between nodes, over one InfiniBand port per GPU (NDR: 50 GB/s each way), about 9x slower
(REFERENCES.md#nvidia-h100, REFERENCES.md#infiniband-ndr). `TwoTier` says which ranks share a
node and what each tier's links cost:

    tiers = TwoTier(ranks_per_node=2)                # intra-node links 10x faster than inter
    mesh = Mesh(dp=4, network=tiers)                 # ranks 0,1 on node 0; ranks 2,3 on node 1
    collectives.all_reduce(t, impl="hierarchical", network=mesh.network)
                                                     # reduce-scatter in the node, all-reduce
                                                     # across nodes, all-gather in the node

The network is an argument: `mesh.network` (a `minidist.communication.emulation.Network`) is
what a collective that needs the nodes is given; nothing in minidist remembers it. On a laptop
the links are EMULATED (minidist.communication.emulation); the hierarchical algorithms are in
minidist.communication.hierarchical and the link sweep that finds a slow node in
minidist.communication.link_sweep.

A degraded link (`degraded={node: fraction}`) keeps only that fraction of its inter-node
bandwidth, both ways: the seeds' incident of an InfiniBand link silently running at half speed.

The alpha-beta model of the two tiers (`TwoTier.all_reduce_time`) charges each step of an
algorithm on the slowest link it uses: the flat ring pays the inter-node link on every one of
its 2(N-1) steps. `collectives.all_reduce(t, impl="auto", network=mesh.network)` picks the
algorithm this model predicts fastest.

The flat ring crosses between two nodes through ONE rank's port: the other g-1 inter-node ports
of the node sit idle. NCCL does not: it runs several rings at once (its channels), each leaving
the node through a different NIC (REFERENCES.md#nccl-channels). `TwoTier.rings` lays out those
rings and `TwoTier.all_reduce_time("ring", S, N, channels=c)` prices them, each step as long as
its busiest port; `hierarchical.channels_all_reduce` runs them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from minidist.core._checks import positive, positive_int
from minidist.costs import algorithms
from minidist.costs.cost import AlphaBeta

__all__ = ["TwoTier", "hierarchical_bytes"]

_ALL_REDUCE = algorithms.names("all_reduce")  # the flat ones and hierarchical


@dataclass(frozen=True)
class TwoTier:
    """Links inside a node and between nodes, for a job whose nodes hold `ranks_per_node`
    consecutive ranks each (as torchrun and Slurm place them: ranks 0..g-1 on the first node).

    Latencies in seconds, bandwidths in bytes per second, each way. The defaults keep the
    real ratio (NVLink about 10x InfiniBand) at laptop scale. `degraded` maps a node to the
    fraction of its inter-node bandwidth it keeps. `emulated=False` describes real links
    (a cluster's) without delaying any message.

    Why one unit of about 150 lines: the two-tier model: each tier's links, the rings placed on them
    and the α-β predictions made from both."""

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
        ranks (the whole job) with `algorithm`, any all-reduce of `minidist.costs.algorithms`'
        table (flat or hierarchical): each step costs alpha + bytes * beta on the slowest link
        any rank uses in it. The busiest rank's bytes are the table's b(N); additions are left
        out. With the same link inside and between nodes, this is the table's a * alpha +
        b * S * beta.

        "ring" with `channels` = c runs `channels_all_reduce`: c rings (`rings`) at once, each
        on S/c; in each of its 2(N-1) steps every ring sends S/(cN) to its right, and a rank's
        port for a tier carries its channels' messages one after another, so the step lasts as
        long as the busiest port: alpha + (its messages) * S/(cN) * beta. With c = 1 that is
        the plain ring on its slowest link."""
        if algorithm not in _ALL_REDUCE:
            raise ValueError(f"algorithm={algorithm!r}: choose one of {', '.join(_ALL_REDUCE)}")
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
        """The all-reduce algorithm this model predicts fastest, hierarchical included (the
        first in the table on a tie)."""
        return min(_ALL_REDUCE, key=lambda name: self.all_reduce_time(name, nbytes, world_size))

    def slowest_link(self, pairs: list[tuple[int, int]]) -> AlphaBeta:
        """The slowest link among `pairs` (global ranks): what one step of an algorithm
        whose ranks exchange in those pairs costs per message."""
        links = [self.intra, *(self.link(a, b) for a, b in pairs)]
        return AlphaBeta(max(link.alpha for link in links), max(link.beta for link in links))


def _speed(link: AlphaBeta) -> str:
    return f"{link.bandwidth / 1e6:g} MB/s, {link.alpha * 1e6:g} us"


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
