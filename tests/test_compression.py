"""minidist.parallel.compression inside minidist.parallel.ddp on 2 gloo ranks, in one launch: the
bytes PowerSGD and top-k send (counted by counting.count_traffic), and the loss after 50 steps of
Lab 10's problem
against no compression and against PyTorch's powerSGD_hook on PyTorch's DDP."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from minidist.communication.counting import count_traffic
from minidist.core.launch import run
from minidist.parallel.compression import Int8, PowerSGD, TopK
from minidist.parallel.ddp import DistributedDataParallel
from minidist.parallel.models import MLP

WORLD, STEPS, BATCH = 2, 50, 32  # BATCH per rank


def _student() -> MLP:
    torch.manual_seed(0)
    return MLP(32, 64, 16, depth=2)


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Lab 10's problem: fit a fixed random MLP (the teacher); each rank its own samples."""
    torch.manual_seed(100)
    teacher = MLP(32, 64, 16, depth=2)
    generator = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        return [(x, teacher(x)) for x in (torch.randn(BATCH, 32, generator=generator)
                                          for _ in range(STEPS))]


def _final_loss(model: nn.Module, batches) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    return loss.item()


def _ranks(rank: int, world_size: int) -> dict[str, object]:
    found: dict[str, object] = {}
    batches = _batches(rank)
    x, y = batches[0]
    for name, compression in (("powersgd", PowerSGD(2)), ("topk", TopK(0.05))):
        ddp = DistributedDataParallel(_student(), compression=compression)
        with count_traffic() as log:
            F.mse_loss(ddp(x), y).backward()
        found[f"{name} log"] = (log.bytes_sent, log.per_collective())
    losses = {}
    for name, compression in (("none", None), ("powersgd", PowerSGD(2)), ("topk", TopK(0.05)),
                              ("int8", Int8())):
        losses[name] = _final_loss(DistributedDataParallel(_student(), compression=compression),
                                   batches)
    theirs = nn.parallel.DistributedDataParallel(_student())
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    theirs.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    losses["torch powersgd"] = _final_loss(theirs, batches)
    found["losses"] = losses
    return found


@pytest.fixture(scope="module")
def results() -> list[dict[str, object]]:
    return run(_ranks, WORLD, timeout=120)


def test_powersgd_all_reduces_n_plus_m_times_r_per_matrix(results):
    compression, elements = PowerSGD(2), 0
    for p in _student().parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        elements += (n + m) * 2 if compression.compresses(p.shape) else p.numel()
    for rank, found in enumerate(results):
        bytes_sent, collectives = found["powersgd log"]
        all_reduced = sum(nbytes for (op, _), (_, nbytes) in collectives.items()
                          if op == "all_reduce")
        assert all_reduced == 4 * elements, (f"rank {rank}: expected (n+m)·r elements per matrix "
                                             f"and the biases whole, {4 * elements} B, "
                                             f"all-reduced {all_reduced} B")
        expected = 2 * (WORLD - 1) / WORLD * 4 * elements
        assert abs(bytes_sent - expected) <= 0.01 * expected, (
            f"rank {rank}: expected the ring to send {expected:.0f} B, counted {bytes_sent}")


def test_top_k_sends_k_values_and_k_indices(results):
    numel = sum(p.numel() for p in _student().parameters())  # one 25 MiB bucket
    k = int(0.05 * numel)
    for rank, found in enumerate(results):
        bytes_sent, collectives = found["topk log"]
        expected = (WORLD - 1) * k * (4 + 4)  # fp32 values and int32 indices, all-gathered
        assert bytes_sent == expected, (f"rank {rank}: expected {expected} B (k={k} values "
                                        f"and indices from each other rank), sent {bytes_sent}")
        assert collectives == {("all_gather", WORLD): (2, 2 * WORLD * k * 4)}, (
            f"rank {rank}: expected 2 all-gathers of {WORLD}·k entries, got {collectives}")


def test_loss_after_50_steps_is_within_10_percent_of_uncompressed(results):
    for rank, found in enumerate(results):
        losses = found["losses"]
        for name, loss in losses.items():
            assert abs(loss - losses["none"]) <= 0.1 * losses["none"], (
                f"rank {rank}: expected {name}'s loss after {STEPS} steps within 10% of "
                f"uncompressed {losses['none']:.4f}, got {loss:.4f}")


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="ratio=0"):
        TopK(0)
    with pytest.raises(ValueError, match="rank"):
        PowerSGD(0)
