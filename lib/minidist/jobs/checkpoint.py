"""Sharded checkpoints: each rank writes its own shards, and any number of ranks can load them.

A checkpoint is one directory:

    step_00000010/
        rank_00000.pt ... rank_<N-1>.pt   each rank's tensors: its shards, its per-rank tensors
                                          (an RNG state) and, on rank 0, the replicated ones
        metadata.json                     the world size; for every tensor its global shape,
                                          dtype and which rank holds which range of its
                                          flattened elements; the plain (JSON) values; the
                                          SHA-256 of every rank file
        COMPLETE                          written last: the SHA-256 of metadata.json

Every file is written under a temporary name, flushed to disk, then renamed: a rename is
atomic, so a reader finds the old file or the new one, never half of one. Rank 0 writes
metadata.json and then COMPLETE only after every rank has renamed its file, so a save killed
midway leaves no COMPLETE, and `latest_checkpoint` skips that directory, naming it.

`save(state, path)` and `load(state, path)` take the same (nested) dict. Its leaves are

    Shard(tensor, global_shape, offset)  this rank holds elements [offset, offset + numel) of
                                         the flattened global tensor (ZeRO, FSDP)
    torch.Tensor                         the same on every rank (rank 0's copy is written)
    PerRank(value)                       different on every rank (an RNG state): a tensor or a
                                         JSON value, restored only on the same world size
    JSON values (int, float, str, bool, None, lists)   the same on every rank
    Stateful objects (state_dict() / load_state_dict()), whose state_dict is such a dict

`load` copies into the tensors in place and replaces the other leaves. A rank loading a
Shard reads, from each saved file whose range overlaps its own, exactly the overlapping
elements, so a checkpoint saved on 4 ranks loads on 2 (or 2 on 4) bit for bit: the global
tensors never change, only who holds which range. `ModelState` and `OptimizerState` describe a
plain model, a model inside `FullyShardedDataParallel` and a `ZeroOptimizer` this way, under
the names of the unsharded model's `state_dict()`, so a checkpoint also moves between them.
`RNGState` holds every random generator a training run draws from.

Why one module of about 570 lines: save and load are inverses over one directory layout; the atomic
rename and the resharding rules must agree on both sides."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from minidist.communication import collectives
from minidist.parallel.fsdp import FullyShardedDataParallel
from minidist.parallel.zero import ZeroOptimizer

__all__ = [
    "COMPLETE", "METADATA", "FORMAT", "CheckpointError", "Shard", "PerRank", "Stateful",
    "checkpoint_path", "save", "read_metadata", "load", "latest_checkpoint", "read_full",
    "ModelState", "OptimizerState", "RNGState",
]

COMPLETE = "COMPLETE"
METADATA = "metadata.json"
FORMAT = "minidist-checkpoint/1"
_STEP_DIRECTORY = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded: torn (no COMPLETE), corrupt, or not matching."""


@dataclass
class Shard:
    """This rank's elements [offset, offset + tensor.numel()) of a flattened global tensor."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offset: int


@dataclass
class PerRank:
    """A value that differs between ranks (an RNG state): a tensor or a JSON value."""

    value: Any


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def checkpoint_path(directory: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` lives in `directory`: step_<8 digits>."""
    return Path(directory) / f"step_{step:08d}"


# --- save ------------------------------------------------------------------------------------


def save(state: dict[str, Any], path: str | Path,
         group: dist.ProcessGroup | None = None) -> Path:
    """Write this rank's part of `state` into the checkpoint directory `path`; every rank of
    `group` must call it. Returns `path` once the checkpoint is complete on disk."""
    path = Path(path)
    rank, world_size = _rank_and_world(group)
    leaves = _flatten(_expand(state))
    tensors: dict[str, torch.Tensor] = {}
    mine: dict[str, Any] = {"shards": {}, "per_rank": {}}
    described: dict[str, dict] = {}
    values: dict[str, Any] = {}
    for key, leaf in leaves.items():
        if isinstance(leaf, Shard):
            _check_shard(key, leaf)
            tensors[key] = leaf.tensor.detach().reshape(-1).clone()
            mine["shards"][key] = [leaf.offset, leaf.tensor.numel()]
            described[key] = _describe("sharded", leaf.global_shape, leaf.tensor.dtype)
        elif isinstance(leaf, PerRank):
            if isinstance(leaf.value, torch.Tensor):
                tensors[key] = leaf.value.detach().clone()
                described[key] = _describe("per_rank", leaf.value.shape, leaf.value.dtype)
            else:
                mine["per_rank"][key] = _json_value(key, leaf.value)
        elif isinstance(leaf, torch.Tensor):
            if rank == 0:
                tensors[key] = leaf.detach().clone()
            described[key] = _describe("replicated", leaf.shape, leaf.dtype)
        else:
            values[key] = _json_value(key, leaf)

    path.mkdir(parents=True, exist_ok=True)
    if rank == 0:  # overwriting a checkpoint: it stops counting as complete first
        (path / COMPLETE).unlink(missing_ok=True)
    _barrier(group, world_size)
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    mine["file"] = f"rank_{rank:05d}.pt"
    mine["sha256"] = _write_atomically(path / mine["file"], buffer.getvalue())
    everyone: list[Any] = [mine]
    if world_size > 1:
        everyone = collectives.all_gather_object(mine, group=group, when="checkpoint metadata")
    for key, entry in described.items():
        if entry["kind"] == "sharded":
            lacking = [r for r in range(world_size) if key not in everyone[r]["shards"]]
            if lacking:
                raise ValueError(f"{key}: rank(s) {lacking} saved no Shard of it; every rank "
                                 f"must save the same keys")
            entry["pieces"] = [[r, *everyone[r]["shards"][key]] for r in range(world_size)]
            _check_pieces_cover(key, entry)
    if rank == 0:
        metadata = {"format": FORMAT, "world_size": world_size, "tensors": described,
                    "values": values, "per_rank_values": [e["per_rank"] for e in everyone],
                    "files": {e["file"]: e["sha256"] for e in everyone}}
        text = json.dumps(metadata, indent=1, sort_keys=True).encode()
        digest = _write_atomically(path / METADATA, text)
        _write_atomically(path / COMPLETE, digest.encode())
    _barrier(group, world_size)
    return path


def _describe(kind: str, shape, dtype: torch.dtype) -> dict[str, Any]:
    return {"kind": kind, "shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}


def _check_shard(key: str, shard: Shard) -> None:
    numel = int(np.prod(shard.global_shape, dtype=np.int64))
    end = shard.offset + shard.tensor.numel()
    if shard.offset < 0 or end > numel:
        raise ValueError(f"{key}: Shard holds elements [{shard.offset}, {end}) but the global "
                         f"tensor {tuple(shard.global_shape)} has {numel}; fix its offset")


def _check_pieces_cover(key: str, entry: dict) -> None:
    """The ranks' ranges of a sharded tensor must tile it exactly, else it cannot be rebuilt."""
    numel = int(np.prod(entry["shape"], dtype=np.int64))
    position = 0
    for rank, offset, count in sorted(entry["pieces"], key=lambda p: (p[1], p[2])):
        if count == 0:
            continue
        if offset != position:
            raise ValueError(f"{key}: the ranks' shards do not tile the tensor: element "
                             f"{position} is expected next but rank {rank} starts at {offset}")
        position += count
    if position != numel:
        raise ValueError(f"{key}: the ranks' shards cover {position} of {numel} elements")


def _json_value(key: str, value: Any) -> Any:
    try:
        json.dumps(value)
    except TypeError as error:
        raise TypeError(f"{key}: {type(value).__name__} is not a tensor, Shard, PerRank or "
                        f"JSON value ({error}); convert it, or give it state_dict() and "
                        f"load_state_dict()") from None
    return value


def _write_atomically(path: Path, data: bytes) -> str:
    """Write under a temporary name, flush to disk, rename; return the data's SHA-256."""
    temporary = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:  # the rename itself reaches the disk
        os.fsync(directory)
    finally:
        os.close(directory)
    return hashlib.sha256(data).hexdigest()


# --- load ------------------------------------------------------------------------------------


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a complete checkpoint; CheckpointError if it is torn or corrupt."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise CheckpointError(f"{path} is incomplete (no {COMPLETE} marker): its save was "
                              f"interrupted; load an earlier checkpoint")
    text = (path / METADATA).read_bytes()
    if hashlib.sha256(text).hexdigest() != (path / COMPLETE).read_text().strip():
        raise CheckpointError(f"{path}/{METADATA} does not match the checksum in {COMPLETE}")
    metadata = json.loads(text)
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {metadata.get('format')!r}, expected {FORMAT!r}")
    return metadata


def load(state: dict[str, Any], path: str | Path,
         group: dist.ProcessGroup | None = None) -> list[str]:
    """Fill `state` (the dict `save` was given, on any world size) from the checkpoint `path`:
    tensors in place, other leaves replaced, Stateful objects through load_state_dict.

    Returns the keys left as they were: per-rank values when the world size changed (a rank
    of the new world has no saved generator of its own)."""
    path = Path(path)
    metadata = read_metadata(path)
    rank, world_size = _rank_and_world(group)
    same_world = metadata["world_size"] == world_size
    files = _RankFiles(path, metadata)
    expanded = _expand(state)
    skipped = []
    for key, leaf in _flatten(expanded).items():
        entry = metadata["tensors"].get(key)
        if isinstance(leaf, PerRank):
            if not same_world:
                skipped.append(key)
            elif isinstance(leaf.value, torch.Tensor):
                leaf.value = files.tensor(rank, key).clone()
            else:
                leaf.value = _saved_value(metadata["per_rank_values"][rank], key, path)
        elif isinstance(leaf, (Shard, torch.Tensor)):
            if entry is None:
                raise CheckpointError(f"{path} has no tensor {key!r}; it holds "
                                      f"{_preview(metadata['tensors'])}")
            _load_tensor(key, leaf, entry, files, path)
        else:
            _replace_leaf(expanded, key, _saved_value(metadata["values"], key, path))
    _restore_stateful(state, expanded)
    return skipped


def _load_tensor(key: str, leaf: Shard | torch.Tensor, entry: dict, files: _RankFiles,
                 path: Path) -> None:
    target, shape, offset = ((leaf.tensor, tuple(leaf.global_shape), leaf.offset)
                             if isinstance(leaf, Shard) else (leaf, tuple(leaf.shape), 0))
    if tuple(entry["shape"]) != shape:
        raise CheckpointError(f"{key}: {path} holds shape {tuple(entry['shape'])}, the "
                              f"model expects {shape}")
    if not target.is_contiguous():
        raise ValueError(f"{key}: load copies into tensors in place and needs them contiguous")
    flat = target.view(-1)
    pieces = entry.get("pieces", [[0, 0, int(np.prod(shape, dtype=np.int64))]])
    end = offset + flat.numel()
    for rank, piece_offset, count in pieces:
        start, stop = max(offset, piece_offset), min(end, piece_offset + count)
        if start < stop:  # only the overlap of the saved piece and this rank's range is read
            saved = files.tensor(rank, key).reshape(-1)
            with torch.no_grad():
                flat[start - offset: stop - offset].copy_(
                    saved[start - piece_offset: stop - piece_offset])


def _saved_value(values: dict[str, Any], key: str, path: Path) -> Any:
    if key not in values:
        raise CheckpointError(f"{path} has no value {key!r}; it holds {_preview(values)}")
    return values[key]


def _preview(entries: dict) -> str:
    names = sorted(entries)
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


class _RankFiles:
    """The saved rank files, each read (memory-mapped) and checksummed on first use."""

    def __init__(self, path: Path, metadata: dict[str, Any]):
        self.path, self.metadata = path, metadata
        self.loaded: dict[int, dict[str, torch.Tensor]] = {}

    def tensor(self, rank: int, key: str) -> torch.Tensor:
        if rank not in self.loaded:
            name = f"rank_{rank:05d}.pt"
            file = self.path / name
            digest = hashlib.sha256(file.read_bytes()).hexdigest()
            if digest != self.metadata["files"][name]:
                raise CheckpointError(f"{file} is corrupt: its SHA-256 is not the one in "
                                      f"{METADATA}")
            self.loaded[rank] = torch.load(file, mmap=True, weights_only=True)
        return self.loaded[rank][key]


# --- finding the newest complete checkpoint ----------------------------------------------------


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint (step_<n>) in `directory`, or None. A newer one that is
    torn or corrupt is skipped with a warning naming it."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = sorted((int(match.group(1)), child) for child in directory.iterdir()
                   if (match := _STEP_DIRECTORY.fullmatch(child.name)) and child.is_dir())
    for _, candidate in reversed(found):
        try:
            read_metadata(candidate)
        except (CheckpointError, OSError, ValueError) as error:
            warnings.warn(f"skipping checkpoint {candidate}: {error}", stacklevel=2)
            continue
        return candidate
    return None


def read_full(path: str | Path) -> dict[str, Any]:
    """Every global tensor and value of a checkpoint, rebuilt from all its shards, in one
    process (for inspection and tests); per-rank values as a list over the saved ranks."""
    path = Path(path)
    metadata = read_metadata(path)
    files = _RankFiles(path, metadata)
    full: dict[str, Any] = dict(metadata["values"])
    for key, entry in metadata["tensors"].items():
        if entry["kind"] == "per_rank":
            full[key] = [files.tensor(r, key) for r in range(metadata["world_size"])]
            continue
        tensor = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
        _load_tensor(key, tensor, entry, files, path)
        full[key] = tensor
    for rank, values in enumerate(metadata["per_rank_values"]):
        for key, value in values.items():
            full.setdefault(key, [None] * metadata["world_size"])[rank] = value
    return full


# --- nested dicts and Stateful objects ---------------------------------------------------------


def _expand(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with every Stateful object replaced by its state_dict (recursively)."""
    expanded = {}
    for key, value in state.items():
        if not isinstance(key, str) or "/" in key:
            raise ValueError(f"state key {key!r}: keys must be strings without '/'")
        if isinstance(value, Stateful) and not isinstance(value, nn.Module):
            value = value.state_dict()
        expanded[key] = _expand(value) if isinstance(value, dict) else value
    return expanded


def _flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    leaves = {}
    for key, value in state.items():
        if isinstance(value, dict):
            leaves.update(_flatten(value, f"{prefix}{key}/"))
        else:
            leaves[prefix + key] = value
    return leaves


def _replace_leaf(state: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split("/")
    for parent in parents:
        state = state[parent]
    state[last] = value


def _restore_stateful(state: dict[str, Any], expanded: dict[str, Any]) -> None:
    """Hand each Stateful object its filled state_dict; replace the plain leaves in `state`."""
    for key, value in state.items():
        if isinstance(value, Stateful) and not isinstance(value, nn.Module):
            value.load_state_dict(expanded[key])
        elif isinstance(value, dict):
            _restore_stateful(value, expanded[key])
        elif not isinstance(value, (torch.Tensor, Shard, PerRank)):
            state[key] = expanded[key]


def _rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _barrier(group: dist.ProcessGroup | None, world_size: int) -> None:
    if world_size > 1:
        collectives.barrier(group=group, when="checkpoint")


# --- model, optimizer and RNG state ----------------------------------------------------------


def _fsdp_slices(model: FullyShardedDataParallel) -> Iterator[tuple[list[str], Any, Any]]:
    """For every parameter of an FSDP model: its names, and a function turning the flat shard
    (or a tensor shaped like it, e.g. Adam's m) into this rank's Shard of that parameter."""
    for unit in model.units:
        for flat in unit.flats:
            start, end = collectives.shard_bounds(flat.numel, model.group)
            offset = 0
            for slot in flat.slots:
                low = min(max(start, offset), end)
                high = max(min(end, offset + slot.shape.numel()), low)

                def cut(tensor, low=low, high=high, start=start, shape=slot.shape,
                        offset=offset):
                    return Shard(tensor[low - start: high - start], tuple(shape),
                                 low - offset if high > low else 0)

                yield slot.names, flat.shard, cut
                offset += slot.shape.numel()


class ModelState:
    """A model's parameters and buffers as checkpoint leaves, under the unsharded model's
    state_dict() names: Shards for a FullyShardedDataParallel model, else replicated tensors."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        if not isinstance(self.model, FullyShardedDataParallel):
            return dict(self.model.state_dict())
        state: dict[str, Any] = dict(self.model.module.state_dict())  # buffers: replicated
        for names, shard, cut in _fsdp_slices(self.model):
            state.update(dict.fromkeys(names, cut(shard.data)))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to do: `load` copied into the model's own storage."""


class OptimizerState:
    """An optimizer's state (Adam's m and v, SGD's momentum, step counts) as checkpoint leaves,
    keyed by parameter name, sharded as the parameters are: for a FullyShardedDataParallel
    model as its shards, for a ZeroOptimizer as its fp32 master slices (saved too, under
    "master"), else whole. The hyperparameters of each param group are saved as JSON values.

    A fresh optimizer has no state to load into: state_dict() then creates it, as zeros with
    step counts 0, exactly what the first step would create."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def _entries(self) -> list[tuple[str, torch.Tensor, Any]]:
        """(name, the tensor the torch optimizer updates, how to cut a tensor shaped like it)."""
        if isinstance(self.model, FullyShardedDataParallel):
            return [(name, shard, cut) for names, shard, cut in _fsdp_slices(self.model)
                    for name in names]
        names = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(param, name)
        if isinstance(self.optimizer, ZeroOptimizer):
            entries = []
            for param, master in zip(self.optimizer.params, self.optimizer.shards, strict=True):
                start, _ = collectives.shard_bounds(param.numel(), self.optimizer.group)
                entries.append((names[param], master,
                                lambda t, shape=tuple(param.shape), s=start: Shard(t, shape, s)))
            return entries
        return [(names[p], p, lambda t: t)
                for group in self.optimizer.param_groups for p in group["params"]]

    def _inner(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer if isinstance(self.optimizer, ZeroOptimizer) \
            else self.optimizer

    def state_dict(self) -> dict[str, Any]:
        inner = self._inner()
        entries = self._entries()
        if any(tensor not in inner.state for _, tensor, _ in entries):
            _create_state(inner)
        state: dict[str, Any] = {}
        for name, tensor, cut in entries:
            slots = {"master": cut(tensor.data)} if isinstance(self.optimizer, ZeroOptimizer) \
                else {}
            for kind, value in inner.state[tensor].items():
                if isinstance(value, torch.Tensor) and value.shape == tensor.shape \
                        and value.dim() > 0:
                    slots[kind] = cut(value)
                else:  # a step count: the same for every element, on every rank
                    slots[kind] = value
            state[name] = slots
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in inner.param_groups]
        return {"state": state, "param_groups": hyper}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Tensors were copied in place; the hyperparameters (a learning-rate schedule's lr)
        are set here, tuples (Adam's betas) kept as tuples."""
        for group, saved in zip(self._inner().param_groups, state["param_groups"], strict=True):
            for key, value in saved.items():
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value


@torch.no_grad()
def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """Make `optimizer` create its per-parameter state: one step with zero gradients and
    learning rate 0 (which leaves the parameters unchanged), then step counts back to 0."""
    saved_grads, saved_lrs = {}, []
    for group in optimizer.param_groups:
        saved_lrs.append(group["lr"])
        group["lr"] = 0.0
        for param in group["params"]:
            saved_grads[param] = param.grad
            param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved_lrs, strict=True):
        group["lr"] = lr
        for param in group["params"]:
            param.grad = saved_grads[param]
            for kind, value in optimizer.state[param].items():
                if kind == "step":
                    optimizer.state[param][kind] = (value.zero_() if isinstance(value, torch.Tensor)
                                                    else 0)


class RNGState:
    """Every random generator a training run draws from, on this rank: torch's CPU generator,
    each CUDA device's, Python's `random` and NumPy's global one. Per-rank values."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        name, keys, position, has_gauss, cached = np.random.get_state()
        state = {
            "torch_cpu": PerRank(torch.get_rng_state()),
            "python": PerRank([version, list(internal), gauss]),
            "numpy_keys": PerRank(torch.from_numpy(keys.astype(np.int64))),
            "numpy": PerRank([name, int(position), int(has_gauss), float(cached)]),
        }
        if torch.cuda.is_available():
            state["torch_cuda"] = {str(i): PerRank(s)
                                   for i, s in enumerate(torch.cuda.get_rng_state_all())}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch_cpu"].value)
        version, internal, gauss = state["python"].value
        random.setstate((version, tuple(internal), gauss))
        name, position, has_gauss, cached = state["numpy"].value
        keys = state["numpy_keys"].value.numpy().astype(np.uint32)
        np.random.set_state((name, keys, position, has_gauss, cached))
        if "torch_cuda" in state:
            torch.cuda.set_rng_state_all([state["torch_cuda"][str(i)].value
                                          for i in range(len(state["torch_cuda"]))])
