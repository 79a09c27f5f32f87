"""The network a job runs on, as a Mesh knows it (`Network`), and its EMULATION on a laptop.

Processes on one laptop talk over loopback, all equally fast. With an emulated `TwoTier` the
Mesh's `Network` owns an emulation that makes the laptop feel the two tiers.

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
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from minidist.communication import comm
from minidist.communication.comm import Ring
from minidist.communication.network import TwoTier
from minidist.core import interposer
from minidist.core._groups import members, on_forget_groups
from minidist.costs.cost import AlphaBeta

__all__ = ["Network", "connect"]


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
