"""Sharded checkpoints: saved on 4 ranks and loaded on 2 (and back on 4), FSDP and ZeRO, give
exactly the saved global state; a torn or corrupt checkpoint is never loaded."""

from pathlib import Path

import pytest
import torch

from minidist.core.launch import run
from minidist.jobs import checkpoint
from minidist.parallel.fsdp import FullyShardedDataParallel
from minidist.parallel.models import TinyGPT
from minidist.parallel.zero import ZeroOptimizer


def _model(seed: int) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(vocab=32, hidden=16, heads=2, layers=2, max_seq=8)


def _wrapped(kind: str, seed: int):
    """(model, optimizer, extra) on this rank; the seed makes a fresh job's weights differ."""
    model = _model(seed)
    if kind == "fsdp":
        model = FullyShardedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    else:
        optimizer = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=0.01)
    return model, optimizer


def _state(model, optimizer, sampler_position: int) -> dict:
    return {"model": checkpoint.ModelState(model),
            "optimizer": checkpoint.OptimizerState(model, optimizer),
            "rng": checkpoint.RNGState(), "sampler_position": sampler_position}


def _reshard(rank: int, world_size: int, sources: dict[str, Path | None], out: Path) -> dict:
    """For FSDP and ZeRO: train two steps (no source) or load the source; save into out."""
    result = {}
    for kind, source in sources.items():
        model, optimizer = _wrapped(kind, seed=0 if source is None else 1 + world_size)
        state = _state(model, optimizer, sampler_position=-1)
        if source is None:
            ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank))
            for _ in range(2):
                model.loss(ids, ids.roll(-1, 1)).backward()
                optimizer.step()
                optimizer.zero_grad()
            state["sampler_position"] = 2
        else:
            result[f"{kind}_skipped"] = checkpoint.load(state, source)
            result[f"{kind}_sampler"] = state["sampler_position"]
            result[f"{kind}_lr"] = optimizer.param_groups[0]["lr"]
        if kind == "fsdp":
            result["fsdp_gathered"] = model.full_state_dict()
        checkpoint.save(state, out / kind)
    return result


def _assert_same_tensors(saved: dict, loaded: dict, what: str) -> None:
    tensors = [key for key, value in saved.items() if isinstance(value, torch.Tensor)]
    assert tensors and sorted(tensors) == sorted(k for k, v in loaded.items()
                                                 if isinstance(v, torch.Tensor)), what
    for key in tensors:
        assert torch.equal(saved[key], loaded[key]), (
            f"{what}: {key} differs from the saved tensor by up to "
            f"{(saved[key].double() - loaded[key].double()).abs().max().item()}")


def test_save_on_4_load_on_2_and_back_on_4_is_exact(tmp_path):
    run(_reshard, 4, {"fsdp": None, "zero": None}, tmp_path / "on4")
    on2 = run(_reshard, 2, {k: tmp_path / "on4" / k for k in ("fsdp", "zero")}, tmp_path / "on2")
    on4 = run(_reshard, 4, {k: tmp_path / "on2" / k for k in ("fsdp", "zero")}, tmp_path / "back")
    for kind in ("fsdp", "zero"):
        saved = checkpoint.read_full(tmp_path / "on4" / kind)
        assert any(key.endswith("/exp_avg_sq") for key in saved), sorted(saved)
        if kind == "zero":
            assert any(key.endswith("/master") for key in saved), sorted(saved)
        for world_size, results, folder in ((2, on2, "on2"), (4, on4, "back")):
            what = f"{kind} saved on 4 ranks, loaded on {world_size}"
            _assert_same_tensors(saved, checkpoint.read_full(tmp_path / folder / kind), what)
            for result in results:
                # per-rank RNG states come back only on the world size that saved them
                expected_skipped = ["rng/torch_cpu", "rng/python", "rng/numpy_keys",
                                    "rng/numpy"]
                assert result[f"{kind}_skipped"] == expected_skipped, (
                    f"{what}: expected {expected_skipped} left unloaded, got "
                    f"{result[f'{kind}_skipped']}")
                assert result[f"{kind}_sampler"] == 2 and result[f"{kind}_lr"] == 0.01, result
        if kind == "fsdp":
            for name, value in on2[0]["fsdp_gathered"].items():
                assert torch.equal(value, saved[f"model/{name}"]), (
                    f"FSDP on 2 ranks after loading: {name} is not the saved parameter")

    # A checkpoint of sharded FSDP state loads into the plain, unsharded model in one process.
    plain = _model(seed=7)
    checkpoint.load({"model": checkpoint.ModelState(plain)}, tmp_path / "on4" / "fsdp")
    saved = checkpoint.read_full(tmp_path / "on4" / "fsdp")
    for name, value in plain.state_dict().items():
        assert torch.equal(value, saved[f"model/{name}"]), (
            f"plain model: {name} differs from the FSDP checkpoint by "
            f"{(value - saved[f'model/{name}']).abs().max().item()}")


def _one_process_checkpoint(path: Path, weight: float) -> dict:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(weight)
    state = {"model": checkpoint.ModelState(model), "step": int(weight)}
    checkpoint.save(state, path)
    return state


def test_a_torn_checkpoint_is_skipped_and_a_corrupt_one_refused(tmp_path, monkeypatch):
    _one_process_checkpoint(checkpoint.checkpoint_path(tmp_path, 5), 5.0)
    real_write = checkpoint._write_atomically

    def killed_before_the_marker(path, data):
        if path.name == checkpoint.COMPLETE:
            raise KeyboardInterrupt("killed")  # what a kill during the save leaves behind
        return real_write(path, data)

    monkeypatch.setattr(checkpoint, "_write_atomically", killed_before_the_marker)
    torn = checkpoint.checkpoint_path(tmp_path, 10)
    with pytest.raises(KeyboardInterrupt):
        _one_process_checkpoint(torn, 10.0)
    monkeypatch.undo()
    assert (torn / "rank_00000.pt").exists() and not (torn / checkpoint.COMPLETE).exists()

    with pytest.warns(UserWarning, match=f"skipping checkpoint {torn}: .*no COMPLETE marker"):
        newest = checkpoint.latest_checkpoint(tmp_path)
    assert newest == checkpoint.checkpoint_path(tmp_path, 5), f"expected step 5, got {newest}"
    fresh = {"model": checkpoint.ModelState(torch.nn.Linear(3, 2)), "step": 0}
    checkpoint.load(fresh, newest)
    assert fresh["step"] == 5 and fresh["model"].model.weight.eq(5.0).all(), fresh
    with pytest.raises(checkpoint.CheckpointError, match="no COMPLETE marker"):
        checkpoint.load(fresh, torn)

    rank_file = newest / "rank_00000.pt"
    data = bytearray(rank_file.read_bytes())
    data[-40] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=f"{rank_file} is corrupt"):
        checkpoint.load(fresh, newest)
