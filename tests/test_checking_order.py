"""minidist.core.checking's order-keeping helpers, on the patterns the labs' checks tell apart:
`watching` interleaves any function's calls with `recording`'s, `in_flight` sees a matmul run
between a request's post and its wait (or not), however both were spelled."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.core.checking import RECORDED, in_flight, ran_while_in_flight, recording, watching
from minidist.core.launch import run
from minidist.core.refusal import unavailable


def test_watching_keeps_the_order_and_restores(tmp_path) -> None:
    original = os.replace
    (tmp_path / "a.tmp").write_text("a")
    with recording(RECORDED) as calls, watching("os.replace", "torch.load", into=calls) as seen:
        os.replace(tmp_path / "a.tmp", tmp_path / "a")
        torch.save(torch.ones(2), tmp_path / "t.pt")
        torch.load(tmp_path / "t.pt")
    assert seen is calls
    assert [c.name for c in calls] == ["os.replace", "torch.load"]
    assert calls[0].args[1] == tmp_path / "a"
    assert os.replace is original


def _ring_step(rank: int, world_size: int) -> dict[str, object]:
    """One ring step spelled three ways: overlapped, waited before the matmul, blocking; plus
    batch_isend_irecv, each checked with in_flight."""
    original_wait = dist.Work.wait
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    found = {}
    with in_flight() as overlapped:
        incoming = torch.empty_like(x)
        requests = [dist.isend(x, right), dist.irecv(incoming, src=left)]
        F.linear(x, w)
        for request in requests:
            request.wait()
    found["overlapped"] = overlapped
    with in_flight() as waited_first:
        requests = [dist.isend(x, dst=right), dist.irecv(incoming, left)]
        for request in requests:
            request.wait()
        x @ w.T
    found["waited first"] = waited_first
    with in_flight() as blocking:
        if rank == 0:
            dist.send(x, right)
            dist.recv(incoming, left)
        else:
            dist.recv(incoming, left)
            dist.send(x, right)
        torch.einsum("bsh,oh->bso", x, w)
    found["blocking"] = blocking
    with in_flight() as batched:
        ops = [dist.P2POp(dist.isend, x, right), dist.P2POp(dist.irecv, incoming, left)]
        works = dist.batch_isend_irecv(ops)
        torch.matmul(x, w.T)
        for work in works:
            work.wait()
    found["batched"] = batched
    found["wait restored"] = dist.Work.wait is original_wait
    return found


def test_in_flight_sees_what_overlapped() -> None:
    found = run(_ring_step, 2)[0]
    overlapped = found["overlapped"]
    assert [(r.kind, r.name, r.peer) for r in overlapped] == [
        ("post", "isend", 1), ("post", "irecv", 1), ("op", "mm", None), ("wait", "wait", None),
        ("wait", "wait", None)]
    assert overlapped[0].nbytes == 2 * 3 * 4 * 4 and overlapped[2].shape == (6, 5)
    assert ran_while_in_flight(overlapped) == {0: 1, 1: 1}
    assert ran_while_in_flight(found["waited first"]) == {0: 0, 1: 0}
    assert [r.kind for r in found["blocking"]] == ["post", "wait", "post", "wait", "op"]
    assert ran_while_in_flight(found["blocking"]) == {0: 0, 1: 0}
    assert ran_while_in_flight(found["batched"]) == {0: 1, 1: 1}
    assert found["wait restored"]


def test_unavailable_and_in_flight_nest() -> None:
    with unavailable("torch.distributed.all_gather"), in_flight(ops=()) as done:
        pass
    assert done == [] and dist.all_gather.__name__ == "all_gather"
