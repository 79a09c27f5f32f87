"""Offload (minidist.parallel.offload, nvme, host_optimizer, device_memory, zero_offload;
minidist.costs.tiers): ZeRO and FSDP with their optimizer state on the host or on NVMe train
exactly as on the device, move the bytes the formulas give, and the emulated device budget
raises CUDA's out-of-memory error where offload would have been needed. Mechanisms and bytes
only: no timing is asserted."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from minidist.core.launch import RankError, RankTimeout, run
from minidist.costs import planner, tiers
from minidist.costs.memory import GB
from minidist.parallel import host_optimizer, offload
from minidist.parallel.device_memory import DeviceMemory
from minidist.parallel.fsdp import FullyShardedDataParallel
from minidist.parallel.models import MLP, TinyGPT
from minidist.parallel.nvme import NvmeStore
from minidist.parallel.offload import Offload
from minidist.parallel.zero import ZeroOptimizer
from minidist.parallel.zero_offload import ZeroOffloadOptimizer

STEPS = 3


def mlp() -> MLP:
    torch.manual_seed(0)
    return MLP(8, 32, 4)  # every parameter's size divides by 2 and 4: formulas hold exactly


def mlp_batch(rank: int, world_size: int):
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(12, 4, generator=torch.Generator().manual_seed(2))
    mine = slice(rank * 12 // world_size, (rank + 1) * 12 // world_size)
    return x[mine], y[mine]


def train_zero(rank, world_size, stage, target, budget=None):
    """3 AdamW steps; per step: (bytes moved in backward, in the step), and the NVMe store.
    Neither offload nor budget: Lab 04's core, ZeroOptimizer, the reference."""
    model = mlp()
    x, y = mlp_batch(rank, world_size)
    if target is None and budget is None:
        optimizer = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2)
    else:
        optimizer = ZeroOffloadOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                         offload=target, device_memory=budget, lr=1e-2)
    moved = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        with offload.transfers() as backward:
            F.mse_loss(model(x), y).backward()
        with offload.transfers() as step:
            optimizer.step()
        moved.append((backward, step))
    return [p.detach().clone() for p in model.parameters()], moved, optimizer


@pytest.mark.parametrize("world_size", [2, 4])
def test_offloaded_zero_trains_like_on_the_device_and_moves_the_formula(world_size, tmp_path):
    def check(rank, world_size):
        results = {}
        for stage in (1, 2):
            reference = train_zero(rank, world_size, stage, None)[0]
            for tier in ("host", "nvme"):
                target = (Offload(tier, str(tmp_path / f"stage{stage}")) if tier == "nvme"
                          else "host")
                params, moved, optimizer = train_zero(rank, world_size, stage, target)
                error = max((a - b).abs().max().item()
                            for a, b in zip(params, reference, strict=True))
                store = optimizer.store
                largest = max(shard.numel() for shard in optimizer.shards)
                results[(stage, tier)] = dict(
                    error=error, psi=sum(p.numel() for p in optimizer.params),
                    moved=[(b.totals, s.totals, b.calls("to_host") + s.calls("to_host"))
                           for b, s in moved],
                    params=len(optimizer.params),
                    peak_resident=store.peak_resident if store else 0,
                    largest_state=12 * largest)
        return results

    for results in run(check, world_size):
        for (stage, tier), r in results.items():
            assert r["error"] <= 1e-6, (stage, tier, r["error"])
            formula = tiers.offload_transfer_bytes(r["psi"], world_size, tier, "fp32", "adamw")
            for step, (backward, in_step, to_host_calls) in enumerate(r["moved"]):
                # Each reduced gradient slice goes to the host once: during backward at
                # stage 2 (as soon as it is produced), at the step at stage 1.
                to_host = backward.to_host + in_step.to_host
                assert to_host == formula.to_host, (stage, tier, step, to_host, formula)
                assert (backward.to_host == formula.to_host) == (stage == 2)
                assert to_host_calls == r["params"]
                assert backward.to_device == 0 and in_step.to_device == formula.to_device
                disk = tiers.nvme_bytes(r["psi"], world_size, "fp32", "adamw",
                                        first_step=step == 0) if tier == "nvme" else 0
                assert in_step.disk_read == disk, (stage, tier, step, in_step.disk_read, disk)
                assert in_step.disk_written == (formula.disk_written if tier == "nvme" else 0)
            if tier == "nvme":  # one parameter's slice of state in host memory at a time
                assert 0 < r["peak_resident"] <= r["largest_state"], r


def train_fsdp(rank, world_size, target, dtype):
    torch.manual_seed(0)
    model = FullyShardedDataParallel(TinyGPT(vocab=64, hidden=32, heads=2, layers=2, max_seq=16),
                                     compute_dtype=dtype, offload=target)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(rank))
    moved = []
    for _ in range(STEPS):
        with offload.transfers() as log:
            optimizer.zero_grad()
            model.loss(ids[:, :-1], ids[:, 1:]).backward()
            optimizer.step()
        moved.append(log.totals)
    psi = sum(flat.numel for unit in model.units for flat in unit.flats)
    return model.full_state_dict(), moved, psi


@pytest.mark.parametrize("world_size", [2, 4])
def test_offloaded_fsdp_trains_like_on_the_device_and_moves_the_formula(world_size):
    def check(rank, world_size):
        found = {}
        for dtype in (torch.float32, torch.bfloat16):
            reference = train_fsdp(rank, world_size, None, dtype)[0]
            state, moved, psi = train_fsdp(rank, world_size, "host", dtype)
            found[dtype] = (max((state[k] - reference[k]).abs().max().item() for k in state),
                            moved, psi)
        return found

    for found in run(check, world_size):
        for dtype, (error, moved, psi) in found.items():
            assert error <= 1e-6, (dtype, error)
            precision = "fp32" if dtype == torch.float32 else "bf16-mixed"
            formula = tiers.offload_transfer_bytes(psi, world_size, "host", precision)
            assert moved == [formula] * STEPS, (dtype, moved, formula)


def test_device_budget_overflows_without_offload_and_fits_with_it():
    psi_bytes = 4 * sum(p.numel() for p in mlp().parameters())
    largest = 4 * max(p.numel() for p in mlp().parameters())
    capacity = psi_bytes + 2 * largest  # the parameters, a gradient and a gathered parameter

    def check(rank, world_size):
        found = {}
        for target in (None, "host"):
            budget = DeviceMemory(capacity)
            try:
                train_zero(rank, world_size, 2, target, budget)
                found[target] = ("trained", budget.peak)
            except torch.OutOfMemoryError as error:
                found[target] = ("out of memory", str(error))
        return found

    for found in run(check, 2):
        outcome, message = found[None]
        assert outcome == "out of memory", found
        assert message.startswith("CUDA out of memory (emulated") and "Tried to allocate" in message
        assert "offload='host'" in message  # the fix is named
        outcome, peak = found["host"]
        assert outcome == "trained" and psi_bytes < peak <= capacity, found


def test_a_budget_below_the_parameters_raises_before_anything_runs():
    def build(rank, world_size):
        ZeroOffloadOptimizer(mlp().parameters(), torch.optim.AdamW, stage=2, offload="host",
                             device_memory=DeviceMemory(1000))

    with pytest.raises(RankError, match="Tried to allocate 0.01 MiB for parameters") as error:
        run(build, 2, timeout=20)
    assert not isinstance(error.value, RankTimeout)
    with pytest.raises(ValueError, match="capacity=0"):
        DeviceMemory(0)


@pytest.mark.parametrize("build, message", [
    (lambda: ZeroOffloadOptimizer(mlp().parameters(), torch.optim.AdamW, stage=2,
                                  offload=Offload("host", capacity=1000)),
     r"offload to the host tier: .* needs 0.01 MiB per rank but the tier holds 0.00 MiB "
     r"\(capacity=1000\); use more ranks"),
    (lambda: ZeroOffloadOptimizer(mlp().parameters(), torch.optim.SGD, stage=2,
                                  offload=Offload("nvme", "never-written"), lr=0.1),
     "got optimizer_cls=SGD: use torch.optim.AdamW"),
    (lambda: ZeroOffloadOptimizer(mlp().parameters(), torch.optim.AdamW, offload="gpu"),
     "offload='gpu': choose None"),
    (lambda: FullyShardedDataParallel(mlp(), offload="nvme"),
     "offloads to the host .* got tier 'nvme'"),
    (lambda: FullyShardedDataParallel(mlp(), offload=Offload("host", capacity=10)),
     r"needs 0.01 MiB per rank but the tier holds 0.00 MiB"),
    (lambda: FullyShardedDataParallel(mlp(), reshard_after_forward="yes"),
     "reshard_after_forward='yes'"),
])
def test_bad_offload_raises_on_every_rank_before_any_collective(build, message):
    def make(rank, world_size):
        build()

    with pytest.raises(RankError, match=message) as error:
        run(make, 2, timeout=20)
    assert not isinstance(error.value, RankTimeout)


def test_offload_names_its_tiers():
    with pytest.raises(ValueError, match="tier='disk'"):
        Offload("disk")
    with pytest.raises(ValueError, match="folder=.* is for the NVMe tier"):
        Offload("host", folder="/tmp")
    with pytest.raises(ValueError, match="capacity=-1"):
        Offload("host", capacity=-1)


def test_nvme_store_reads_and_writes_real_files(tmp_path):
    store = NvmeStore(tmp_path / "state")
    values = torch.arange(10, dtype=torch.bfloat16)
    with offload.transfers() as log:
        store.write("m", values)
        got = store.read("m")
    assert torch.equal(got, values) and got.data_ptr() != values.data_ptr()
    assert (tmp_path / "state" / "m.bin").stat().st_size == 20
    assert (log.disk_written, log.disk_read) == (20, 20) == (store.bytes_written, store.bytes_read)
    assert [e.kind for e in log.events] == ["disk_write", "disk_read"]
    assert store.resident == 20
    del got
    assert store.resident == 0 and store.peak_resident == 20
    with pytest.raises(KeyError, match="'v' was never written"):
        store.read("v")


def test_adamw_step_is_torch_adamw():
    torch.manual_seed(0)
    param = torch.randn(100)
    twin = param.clone().requires_grad_()
    optimizer = torch.optim.AdamW([twin], lr=1e-2, weight_decay=0.1)
    exp_avg, exp_avg_sq = torch.zeros(100), torch.zeros(100)
    for step in range(1, 4):
        grad = torch.randn(100)
        twin.grad = grad.clone()
        optimizer.step()
        host_optimizer.adamw_step_(param, grad, exp_avg, exp_avg_sq, step, lr=1e-2,
                                   weight_decay=0.1)
        assert torch.equal(param, twin.detach())


def test_copies_between_tiers_are_counted_and_are_copies():
    tensor = torch.ones(4, dtype=torch.bfloat16)
    with offload.transfers() as outer:
        with offload.transfers() as inner:
            host = offload.to_host(tensor, "gradient shard")
        back = offload.to_device(host, "cpu", "parameter shard")
    assert host.data_ptr() != tensor.data_ptr() and back.data_ptr() != host.data_ptr()
    assert (inner.to_host, inner.to_device) == (8, 0)
    assert (outer.to_host, outer.to_device) == (8, 8)
    assert [(e.kind, e.name) for e in outer.events] == [("to_host", "gradient shard"),
                                                       ("to_device", "parameter shard")]



def test_tampered_copies_change_what_each_door_returns_inside_the_block_only():
    tensor = torch.zeros(3)
    with offload.tampered_copies(to_host=1.0):
        host = offload.to_host(tensor)
        moving = offload.to_host(tensor, async_op=True)
        back = offload.to_device(tensor, "cpu")
        with offload.tampered_copies(to_device=float("nan")):
            poisoned = offload.to_device(tensor, "cpu")
    assert host.tolist() == [1.0] * 3 and moving.wait().tolist() == [1.0] * 3
    assert back.tolist() == [0.0] * 3 and poisoned.isnan().all()
    assert tensor.tolist() == [0.0] * 3  # the original is untouched
    assert offload.to_host(tensor).tolist() == [0.0] * 3 and offload._tampering == {}

def test_tier_formulas_follow_zero_offload():
    psi = 1e9
    # ZeRO-Offload §4 on one GPU: 2Ψ on the device, 14Ψ on the host, 4Ψ across PCIe per step.
    state = tiers.model_state_by_tier(psi, 2, 1, "host")
    assert (state.device, state.host, state.nvme) == (2 * psi, 14 * psi, 0)
    moved = tiers.offload_transfer_bytes(psi, 1)
    assert moved.to_host + moved.to_device == 4 * psi
    nvme = tiers.model_state_by_tier(psi, 3, 8, "nvme")
    assert (nvme.device, nvme.host, nvme.nvme) == (2 * psi / 8, 2 * psi / 8, 12 * psi / 8)
    assert tiers.model_state_by_tier(psi, 1, 4, "host").device == 4 * psi  # whole gradients
    assert tiers.model_state_by_tier(psi, 2, 4).device == 2 * psi + 14 * psi / 4
    assert tiers.nvme_bytes(psi, 4) == 3 * psi and tiers.nvme_bytes(psi, 4, first_step=True) == psi
    assert tiers.PCIE_BANDWIDTH == {"gen4": 32e9, "gen5": 64e9}


def test_offload_step_time_adds_what_is_not_hidden():
    time = tiers.offload_step_time(8e9, 8, compute=1.0, offload="host", pcie_bandwidth=64e9,
                                   optimizer_throughput=1e9)
    assert time.to_host == 0.0  # 2 GB in 1/32 s hides behind 2/3 s of backward
    assert time.optimizer == pytest.approx(1.0) and time.to_device == pytest.approx(2e9 / 64e9)
    assert time.total == pytest.approx(2.0 + 2e9 / 64e9)
    slow = tiers.offload_step_time(8e9, 1, 0.3, "nvme", 32e9, 1e10, 2e9, 1e9)
    assert slow.to_host == pytest.approx(16e9 / 32e9 - 0.2)
    assert slow.disk == pytest.approx(96e9 / 2e9 + 96e9 / 1e9)
    assert tiers.offload_step_time(8e9, 1, 0.3, None, 32e9, 1e10).total == 0.3
    with pytest.raises(ValueError, match="needs disk_read_bandwidth"):
        tiers.offload_step_time(8e9, 1, 0.3, "nvme", 32e9, 1e10)


def test_planner_fits_a_model_only_with_offload():
    """70B on 8 H100s with FSDP: 16Ψ/8 = 140 GB per GPU does not fit 80 GB; with the
    optimizer state on the host the GPU keeps 2Ψ/8 = 17.5 GB of model state."""
    cluster = planner.Cluster.dgx_h100(8)
    model = planner.MODELS["70B"]
    layout = planner.Layout(1, 1, 8, 3, 1, 1, "full")
    on_device = planner.evaluate(layout, model, cluster, 8)
    assert [reason.rule for reason in on_device.reasons] == ["memory"]
    offloaded_layout = dataclasses.replace(layout, offload="host")
    unmeasured = planner.evaluate(offloaded_layout, model, cluster, 8)
    assert [reason.rule for reason in unmeasured.reasons] == ["offload-unmeasured"]
    measured = dataclasses.replace(cluster, host_optimizer_throughput=2e9)
    offloaded = planner.evaluate(offloaded_layout, model, measured, 8)
    assert offloaded.fits, offloaded.reasons
    assert offloaded.memory.optimizer == 0 and offloaded.memory.grads == 0
    assert offloaded.memory.host == pytest.approx(14 * 70e9 / 8)
    assert offloaded.time.offload == pytest.approx(70e9 / 8 / 2e9 + 2 * 70e9 / 8 / 64e9)
    assert on_device.memory.total > 80 * GB > offloaded.memory.total
    small_host = dataclasses.replace(measured, host_memory=100 * GB)
    assert [r.rule for r in planner.evaluate(offloaded_layout, model, small_host, 8).reasons] == [
        "host-memory"]
    best = planner.plan(model, measured, 8, offload=(None, "host")).best
    assert best.layout.offload == "host" or best.layout.tp * best.layout.pp > 1


def test_lab_02_memory_calculator_shows_the_offload_tiers():
    from minidist.pictures.widgets import MemoryCalculator, memory_by_zero_stage

    on_device = memory_by_zero_stage(planner.MODELS["7B"], dp=8)
    offloaded = memory_by_zero_stage(planner.MODELS["7B"], dp=8, offload="host")
    assert offloaded[2].optimizer == 0 and offloaded[2].grads == 0
    assert offloaded[2].host == pytest.approx(14 * 6.7e9 / 8)
    assert offloaded[2].total < on_device[2].total
    calculator = MemoryCalculator(model="7B", zero_stage=2, dp=8)
    calculator.controls["offload"].value = "nvme"
    assert "offloaded to nvme" in calculator.message
    assert "across PCIe per step" in calculator.message
    assert calculator.data[2].nvme == pytest.approx(12 * 6.7e9 / 8)
