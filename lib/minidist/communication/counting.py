"""Counting what a rank really sends: every point-to-point message (bytes, and to which rank)
and one record per collective that `minidist.communication.collectives` runs, the one layer every
collective in minidist goes through. The records are `minidist.costs.traffic.Collective`s, so a
count compares with a prediction from sizes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from minidist.core import interposer
from minidist.core._groups import members
from minidist.costs.traffic import Collective, Traffic

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["TrafficLog", "count_traffic", "record", "uncounted"]

@dataclass
class TrafficLog:
    """What this rank sent inside one `count_traffic` block.

    `sends`: every point-to-point message that left this process, as (global rank it went to,
    payload bytes), in order. `collectives`: one `Collective` record per collective run through
    `minidist.communication.collectives`, with the bytes of the full tensor it reduced or produced,
    its group's size and ranks and, for tensor parallelism, whether it ran "forward" or "backward"
    (`when`)."""

    sends: list[tuple[int, int]] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)

    @property
    def bytes_sent(self) -> int:
        """Point-to-point payload bytes this rank sent."""
        return sum(nbytes for _, nbytes in self.sends)

    @property
    def messages(self) -> int:
        """Point-to-point messages this rank sent (a message sent in segments counts once per
        segment)."""
        return len(self.sends)

    def bytes_to(self) -> dict[int, int]:
        """{global rank: bytes this rank sent it}, in the order first sent to."""
        totals: dict[int, int] = {}
        for peer, nbytes in self.sends:
            totals[peer] = totals.get(peer, 0) + nbytes
        return totals

    def calls(self, op: str, when: str | None = None) -> int:
        """How many `op` collectives ran (only those of phase `when`, if given)."""
        return sum(c.count for c in self._matching(op, when))

    def nbytes(self, op: str, when: str | None = None) -> int:
        """Bytes of the full tensors those collectives carried, added up."""
        return sum(c.count * c.nbytes for c in self._matching(op, when))

    def per_collective(self) -> dict[tuple[str, int], tuple[int, int]]:
        """{(op, group size): (calls, bytes of the full tensors)}, in the order first seen."""
        totals: dict[tuple[str, int], tuple[int, int]] = {}
        for c in self.collectives:
            calls, nbytes = totals.get((c.op, c.group), (0, 0))
            totals[(c.op, c.group)] = (calls + c.count, nbytes + c.count * c.nbytes)
        return totals

    @property
    def traffic(self) -> Traffic:
        """The records as a `Traffic`, to compare with this module's predictions."""
        return Traffic(tuple(self.collectives))

    def _matching(self, op: str, when: str | None) -> list[Collective]:
        return [c for c in self.collectives if c.op == op and when in (None, c.when)]


def record(op: str, nbytes: int, group: dist.ProcessGroup | None, when: str = "", *,
           call: str = "") -> None:
    """Add one `op` collective of `nbytes` (the full tensor) over `group` to every open log.
    `minidist.communication.collectives` calls it once per collective, its own or one that
    code outside minidist ran (`record_torch_collective`), before any byte moves; `call`
    describes what every rank of the group must agree on ("8 float32, op='sum', impl='ring'"),
    for `minidist.core.agreement`'s comparison."""
    interposer.announce("minidist.collective", op, nbytes, group, when, call)


@contextlib.contextmanager
def count_traffic() -> Iterator[TrafficLog]:
    """Count what this rank sends inside the block: point-to-point messages, and every
    collective that `minidist.communication.collectives` runs.

        with count_traffic() as log:
            collectives.all_reduce(t, impl="ring")
        log.bytes_sent              # 2(N-1)/N * t.nbytes when N divides t.numel()
        log.bytes_to()              # {right neighbour: the same}: a ring sends to one rank
        log.calls("all_reduce")     # 1

    Point-to-point: every send this process makes through torch.distributed's point-to-point
    API while the block runs: dist.send, dist.isend, dist.batch_isend_irecv, send_object_list,
    and minidist's own algorithms. Payload bytes only, no headers; receives are not counted,
    nor the bytes of collectives that torch runs as one call (dist.all_reduce, ...): those run
    in C++, where no Python-level send sees them; their calls are in `collectives` when minidist
    ran them.

    How: all of those point-to-point functions end in one method, ProcessGroup.send, and the
    block subscribes to it at the interposer's "counting" layer (minidist.core.interposer).
    Counting there counts each message once however it was sent (dist.send itself calls
    dist.isend), when it is posted, before an emulated network delays it. Blocks nest: an
    outer log includes what inner ones count.
    """
    log = TrafficLog()

    def count_send(send: Callable[..., Any], group: dist.ProcessGroup, tensors: list, dst: int,
                   *args: Any, **kwargs: Any) -> Any:
        log.sends.append((members(group)[dst],
                          sum(tensor.nbytes for tensor in tensors)))
        return send(group, tensors, dst, *args, **kwargs)

    def count_collective(_: Callable[..., None], op: str, nbytes: int,
                         group: dist.ProcessGroup | None, when: str, call: str) -> None:
        ranks = members(group)
        log.collectives.append(Collective(op, nbytes, len(ranks), 1, when, ranks))

    with interposer.subscribed("counting", {"ProcessGroup.send": count_send,
                                            "minidist.collective": count_collective}):
        yield log


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Inside the block the open `count_traffic` logs count nothing: for set-up work that is
    not part of what they measure (a pipeline's shape exchange, fitting links)."""
    with interposer.muted("counting"):
        yield
