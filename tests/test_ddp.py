"""minidist.parallel.ddp against single-process training and torch's DistributedDataParallel, on 1,
2 and 4 gloo ranks, checking the mechanism as well as the numbers: bytes sent, buckets, the
order of events in backward, and nothing sent under no_sync().

Starting ranks costs about a second, so each world size runs every check in one
`minidist.core.launch.run`; each rank returns {check name: [failure descriptions]}, and the tests
below look up their check and assert that its list is empty.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minidist.communication.counting import count_traffic
from minidist.core.launch import run
from minidist.parallel.ddp import (
    DistributedDataParallel,
    all_reduce_gradients,
    all_reduce_gradients_flat,
    assign_buckets,
)
from minidist.parallel.models import MLP, TinyGPT

STEPS = 3
TOLERANCE = 1e-6  # fp32, max |difference| of any parameter after STEPS steps
SMALL_BUCKET_MB = 0.01  # 10 KiB: several buckets even for the tiny test models


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MLP(12, 32, 5, depth=3)


def _tied_gpt(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = TinyGPT(vocab=40, hidden=16, heads=2, layers=2, max_seq=8)
    model.head.weight = model.tok_emb.weight  # shared: one parameter, two uses
    return model


class _BatchNormNet(nn.Module):
    """Has buffers that change in forward (BatchNorm's running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.norm(self.fc1(x))))


def _batchnorm_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _BatchNormNet()


class _Branchy(nn.Module):
    """Uses `extra` only when asked: an unused parameter on some ranks or all."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.extra = nn.Linear(12, 5), nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        y = self.body(x)
        return self.extra(y) if use_extra else y


def _batches(kind: str, global_batch: int, steps: int = STEPS) -> list[tuple]:
    generator = torch.Generator().manual_seed(1234)
    if kind == "gpt":
        return [(torch.randint(0, 40, (global_batch, 8), generator=generator),
                 torch.randint(0, 40, (global_batch, 8), generator=generator))
                for _ in range(steps)]
    return [(torch.randn(global_batch, 12, generator=generator),
             torch.randn(global_batch, 5, generator=generator)) for _ in range(steps)]


def _loss(model: nn.Module, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if kind == "gpt":
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.mse_loss(out, y)


def _mine(batch: tuple, rank: int, world_size: int) -> tuple:
    size = batch[0].shape[0] // world_size
    return tuple(t[rank * size:(rank + 1) * size] for t in batch)


def _train(model: nn.Module, kind: str, batches: list[tuple], rank: int, world_size: int,
           split: bool = True) -> nn.Module:
    """SGD with momentum on each batch (this rank's slice of it when `split`)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for batch in batches:
        x, y = _mine(batch, rank, world_size) if split else batch
        optimizer.zero_grad()
        _loss(model, kind, x, y).backward()
        optimizer.step()
    return model


def _max_difference(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return max((x.float() - y.float()).abs().max().item() for x, y in pairs)


def _inner(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


BUILDERS = {"mlp": _mlp, "gpt": _tied_gpt, "batchnorm": _batchnorm_net}


# --- Checks run on every rank --------------------------------------------------------------------


def _check_equals_single_process_and_torch(rank: int, world_size: int) -> list[str]:
    """Weights after STEPS steps equal single-process training on the whole batch and torch's
    DDP on the same data, for both collectives, one bucket or many, tied weights, buffers."""
    failures = []
    global_batch = 4 * world_size
    for kind, build in BUILDERS.items():
        batches = _batches(kind, global_batch)
        reference = _train(build(0), kind, batches, 0, 1, split=False)
        theirs = nn.parallel.DistributedDataParallel(build(rank))
        _train(theirs, kind, batches, rank, world_size)
        if kind != "batchnorm":  # BatchNorm normalises per rank: only DDP vs DDP compares
            if (d := _max_difference(theirs.module, reference)) > TOLERANCE:
                failures.append(f"{kind}: torch DDP differs from single process by {d:.2e}")
        for all_reduce in ("torch", "ring"):
            for cap in (25, SMALL_BUCKET_MB):
                ours = DistributedDataParallel(build(rank), cap, impl=all_reduce)
                _train(ours, kind, batches, rank, world_size)
                label = f"{kind}, impl={all_reduce}, bucket_cap_mb={cap}"
                if kind != "batchnorm":
                    if (d := _max_difference(ours.module, reference)) > TOLERANCE:
                        failures.append(f"{label}: differs from single process by {d:.2e}")
                if (d := _max_difference(ours.module, theirs.module)) > TOLERANCE:
                    failures.append(f"{label}: differs from torch DDP by {d:.2e}")
    return failures


def _check_simple_variants(rank: int, world_size: int) -> list[str]:
    """One all-reduce per parameter, and one flat buffer: same weights as single process; the
    ring sends one all-reduce's messages per tensor, or one in all."""
    failures = []
    batches = _batches("mlp", 4 * world_size)
    reference = _train(_mlp(0), "mlp", batches, 0, 1, split=False)
    tensors = len(list(reference.parameters()))
    for sync, messages in ((all_reduce_gradients, tensors), (all_reduce_gradients_flat, 1)):
        model = _mlp(0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for batch in batches:
            optimizer.zero_grad()
            _loss(model, "mlp", *_mine(batch, rank, world_size)).backward()
            with count_traffic() as counter:
                sync(model, impl="ring")
            optimizer.step()
        if (d := _max_difference(model, reference)) > TOLERANCE:
            failures.append(f"{sync.__name__}: differs from single process by {d:.2e}")
        if counter.messages != 2 * (world_size - 1) * messages:
            failures.append(f"{sync.__name__}: {counter.messages} messages, expected "
                            f"{2 * (world_size - 1) * messages}")
    return failures


def _check_bytes_and_buckets(rank: int, world_size: int) -> list[str]:
    """Each rank sends 2(N-1)/N * Psi * 4 bytes per step (within 1%), in the buckets
    configured: reverse parameter order, at most the cap unless one parameter is bigger."""
    failures = []
    model = _mlp(rank)
    psi = sum(p.numel() for p in model.parameters())
    sizes = [(name, p.numel() * 4) for name, p in reversed(list(model.named_parameters()))]
    cap_mb = 2048 / 2**20
    expected, filled = [], None
    for name, size in sizes:  # the bucketing rule, written out independently
        if filled is None or filled + size > 2048:
            expected.append([])
            filled = 0
        expected[-1].append(name)
        filled += size
    for cap, layout in ((cap_mb, expected), (25, [[name for name, _ in sizes]])):
        ddp = DistributedDataParallel(_mlp(rank), cap, impl="ring")
        if [bucket.names for bucket in ddp.buckets] != layout:
            failures.append(f"cap {cap} MiB: buckets {[b.names for b in ddp.buckets]}")
        for bucket in ddp.buckets:
            if bucket.nbytes > cap * 2**20 and len(bucket.names) > 1:
                failures.append(f"cap {cap} MiB: bucket {bucket.index} holds {bucket.nbytes} B")
        x, y = _mine(_batches("mlp", 4 * world_size)[0], rank, world_size)
        with count_traffic() as counter:
            _loss(ddp, "mlp", x, y).backward()
        theory = 2 * (world_size - 1) / world_size * psi * 4
        if abs(counter.bytes_sent - theory) > 0.01 * theory:
            failures.append(f"cap {cap} MiB: sent {counter.bytes_sent} B, theory {theory:.0f} B")
        launches = sum(event.kind == "all_reduce" for event in ddp.events)
        if launches != len(layout):
            failures.append(f"cap {cap} MiB: {launches} all-reduces for {len(layout)} buckets")
    return failures


def _check_overlap(rank: int, world_size: int) -> list[str]:
    """With the backend's asynchronous all-reduce, the first bucket's all-reduce starts before
    backward has produced its last gradient, and buckets launch in order."""
    failures = []
    ddp = DistributedDataParallel(_tied_gpt(rank), SMALL_BUCKET_MB)
    ids, targets = _mine(_batches("gpt", 2 * world_size)[0], rank, world_size)
    _loss(ddp, "gpt", ids, targets).backward()
    gradients = [event.start for event in ddp.events if event.kind == "gradient"]
    all_reduces = [event for event in ddp.events if event.kind == "all_reduce"]
    if len(all_reduces) < 3:
        failures.append(f"only {len(all_reduces)} buckets: the check needs several")
    elif not all_reduces[0].start < gradients[-1]:
        failures.append("the first all-reduce started after the last gradient: no overlap")
    if [event.name for event in all_reduces] != [f"bucket {i}" for i in range(len(ddp.buckets))]:
        failures.append(f"launch order {[event.name for event in all_reduces]}")
    if any(event.end is None for event in all_reduces):
        failures.append("backward returned before an all-reduce completed")
    return failures


def _check_no_sync(rank: int, world_size: int) -> list[str]:
    """Inside no_sync() nothing is sent; accumulating microbatches then one synchronized
    backward equals single-process training on the whole batch."""
    failures = []
    batches = _batches("mlp", 4 * world_size)
    reference = _train(_mlp(0), "mlp", batches, 0, 1, split=False)
    for all_reduce in ("torch", "ring"):
        ddp = DistributedDataParallel(_mlp(rank), SMALL_BUCKET_MB, impl=all_reduce)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for batch in batches:
            x, y = _mine(batch, rank, world_size)
            optimizer.zero_grad()
            ddp.events = []  # what the last synchronized backward recorded
            with count_traffic() as counter, ddp.no_sync():
                for micro_x, micro_y in zip(x[:-1].split(1), y[:-1].split(1), strict=True):
                    (_loss(ddp, "mlp", micro_x, micro_y) * (1 / len(x))).backward()
            if counter.bytes_sent or any(e.kind == "all_reduce" for e in ddp.events):
                failures.append(f"{all_reduce}: no_sync sent {counter.bytes_sent} B")
            (_loss(ddp, "mlp", x[-1:], y[-1:]) * (1 / len(x))).backward()
            optimizer.step()
        if (d := _max_difference(ddp.module, reference)) > TOLERANCE:
            failures.append(f"{all_reduce}: accumulation differs from single process by {d:.2e}")
    return failures


def _check_frozen_parameters(rank: int, world_size: int) -> list[str]:
    """Frozen parameters are broadcast at wrap time, get no bucket and no hook."""
    failures = []
    model = _mlp(rank)
    frozen = model.layers[0][0]
    frozen.requires_grad_(False)
    ddp = DistributedDataParallel(model, SMALL_BUCKET_MB)
    if any(name.startswith("layers.0.") for bucket in ddp.buckets for name in bucket.names):
        failures.append("a frozen parameter is in a bucket")
    if not torch.equal(frozen.weight, _mlp(0).layers[0][0].weight):
        failures.append("frozen weight is not rank 0's")
    reference = _mlp(0)
    reference.layers[0][0].requires_grad_(False)
    batches = _batches("mlp", 4 * world_size)
    _train(reference, "mlp", batches, 0, 1, split=False)
    _train(ddp, "mlp", batches, rank, world_size)
    if (d := _max_difference(ddp.module, reference)) > TOLERANCE:
        failures.append(f"differs from single process by {d:.2e}")
    return failures


def _check_unused_parameters(rank: int, world_size: int) -> list[str]:
    """Unused by every rank: a clear error naming it, or zero gradient with
    find_unused_parameters; used on some ranks only: the same weights as torch's DDP."""
    failures = []
    x, _ = _mine(_batches("mlp", 4 * world_size)[0], rank, world_size)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_Branchy())
    try:
        ddp(x, use_extra=False).sum().backward()
        failures.append("no error for a parameter unused in backward")
    except RuntimeError as error:
        if "extra.weight" not in str(error) or "find_unused_parameters" not in str(error):
            failures.append(f"unclear error: {error}")
    for use_extra in (False, rank % 2 == 1):
        torch.manual_seed(0)
        ours = DistributedDataParallel(_Branchy(), SMALL_BUCKET_MB, find_unused_parameters=True)
        torch.manual_seed(0)
        theirs = nn.parallel.DistributedDataParallel(_Branchy(), find_unused_parameters=True)
        for model in (ours, theirs):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for batch in _batches("mlp", 4 * world_size):
                optimizer.zero_grad()
                model(_mine(batch, rank, world_size)[0], use_extra=use_extra).sum().backward()
                optimizer.step()
        if (d := _max_difference(ours.module, theirs.module)) > TOLERANCE:
            failures.append(f"use_extra={use_extra}: differs from torch DDP by {d:.2e}")
    return failures


def _check_bad_input(rank: int, world_size: int) -> list[str]:
    """Mismatched models, bad arguments and no_sync misuse raise clear errors."""
    failures = []

    def expect(error_type: type, words: list[str], fn) -> None:
        try:
            fn()
            failures.append(f"no {error_type.__name__} (expected one saying {words})")
        except error_type as error:
            if not all(word in str(error) for word in words):
                failures.append(f"unclear {error_type.__name__}: {error}")

    if world_size > 1:
        hidden = 32 if rank == 0 else 33
        expect(ValueError, ["rank 0", "[32, 12]", "[33, 12]", "same model"],
               lambda: DistributedDataParallel(MLP(12, hidden, 5)))
        expect(ValueError, ["frozen", "layers.0.0.weight"],
               lambda: DistributedDataParallel(_mlp(0).requires_grad_(rank == 0)))
    expect(ValueError, ["bucket_cap_mb=0"], lambda: DistributedDataParallel(_mlp(0), 0))
    expect(ValueError, ["impl='nccl'"],
           lambda: DistributedDataParallel(_mlp(0), impl="nccl"))

    ddp = DistributedDataParallel(_mlp(0))
    x = torch.randn(2, 12)

    def forward_inside_backward_outside() -> None:
        with ddp.no_sync():
            loss = ddp(x).sum()
        loss.backward()

    def finish_inside_no_sync() -> None:
        with ddp.no_sync():
            ddp.finish_gradient_synchronization()

    expect(RuntimeError, ["forward ran inside", "no_sync()"], forward_inside_backward_outside)
    expect(RuntimeError, ["inside no_sync()"], finish_inside_no_sync)
    return failures


CHECKS = {
    "equals single process and torch DDP": _check_equals_single_process_and_torch,
    "simple variants": _check_simple_variants,
    "bytes and buckets": _check_bytes_and_buckets,
    "overlap": _check_overlap,
    "no_sync": _check_no_sync,
    "frozen parameters": _check_frozen_parameters,
    "unused parameters": _check_unused_parameters,
    "bad input": _check_bad_input,
}


def _all_checks(rank: int, world_size: int) -> dict[str, list[str]]:
    results = {}
    for name, check in CHECKS.items():
        try:
            results[name] = check(rank, world_size)
        except Exception as error:  # report it under its check; the others still run
            results[name] = [f"raised {type(error).__name__}: {error}"]
    return results


@functools.cache
def _results(world_size: int) -> list[dict[str, list[str]]]:
    return run(_all_checks, world_size, timeout=240)


# --- Tests ---------------------------------------------------------------------------------------


# One xdist worker per world size, so each world size's ranks start once.
@pytest.mark.parametrize(
    "world_size", [pytest.param(n, marks=pytest.mark.xdist_group(f"ddp-{n}")) for n in (1, 2, 4)]
)
@pytest.mark.parametrize("check", list(CHECKS))
def test_ddp(world_size: int, check: str) -> None:
    for rank, results in enumerate(_results(world_size)):
        assert results[check] == [], f"rank {rank}: {results[check]}"


def test_assign_buckets() -> None:
    assert assign_buckets([40, 40, 30, 100, 10], 80) == [[0, 1], [2], [3], [4]]
    assert assign_buckets([10, 10, 10], 100) == [[0, 1, 2]]
    assert assign_buckets([], 10) == []
    with pytest.raises(ValueError, match="cap_bytes=0"):
        assign_buckets([1], 0)


def test_needs_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="needs a process group.*launch.run"):
        DistributedDataParallel(_mlp(0))
    with pytest.raises(RuntimeError, match="needs a process group"):
        all_reduce_gradients(_mlp(0))
