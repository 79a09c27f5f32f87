"""Measure what PyTorch actually holds, to check the formulas of `minidist.costs.memory`.

    state = model_state_footprint(model, optimizer)   # after one optimizer step
    saved = saved_activations(block, x)               # what autograd keeps for backward

Bytes are those of tensor storages, each storage counted once: two views of one tensor (a
transpose, a reshape) are one allocation, and so are the three uses of one LayerNorm output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from minidist.costs.memory import ModelStateBytes

__all__ = ["storage_bytes", "model_state_footprint", "SavedTensor", "saved_activations"]


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views share their base's storage)."""
    return sum(dict(_storage(t) for t in tensors).values())


def model_state_footprint(model: torch.nn.Module,
                          optimizer: torch.optim.Optimizer) -> ModelStateBytes:
    """Bytes of `model`'s parameters, of their gradients, and of everything `optimizer`
    keeps: its state tensors (Adam's exp_avg, exp_avg_sq and step) plus any parameters it
    updates that are not the model's (the fp32 master weights of mixed precision).

    Call it after an optimizer step: PyTorch creates optimizer state lazily, at the first
    step. A storage counted in an earlier category is not counted again."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    model_storages = {_storage(t)[0] for t in params + grads}
    masters = [p for group in optimizer.param_groups for p in group["params"]
               if _storage(p)[0] not in model_storages]
    states = [value for state in optimizer.state.values() for value in state.values()
              if isinstance(value, torch.Tensor)]
    master_grads = [p.grad for p in masters if p.grad is not None]
    return ModelStateBytes(
        params=storage_bytes(params),
        grads=storage_bytes(grads + master_grads),
        optimizer=storage_bytes(masters + states),
    )


@dataclass(frozen=True)
class SavedTensor:
    """One storage autograd saved for backward, and the grad_fn of the op that produced it
    (none for inputs and for statistics such as LayerNorm's mean and 1/std)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    produced_by: str


def saved_activations(fn: Callable[..., torch.Tensor], *args: torch.Tensor,
                      exclude: Iterable[torch.Tensor] = ()) -> list[SavedTensor]:
    """Run `fn(*args)` and list the distinct storages autograd saves for its backward.

    Uses `torch.autograd.graph.saved_tensors_hooks`, whose pack hook sees every tensor an op
    saves. Parameters of `fn` (if it is a Module) and tensors in `exclude` are left out: they
    live on whether or not anything is saved."""
    skip = {_storage(t)[0] for t in exclude}
    if isinstance(fn, torch.nn.Module):
        skip |= {_storage(p)[0] for p in fn.parameters()}
    saved: dict[int, SavedTensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer, nbytes = _storage(tensor)
        if pointer not in skip and pointer not in saved:
            op = tensor.grad_fn.name() if tensor.grad_fn is not None else "none"
            saved[pointer] = SavedTensor(tuple(tensor.shape), tensor.dtype, nbytes, op)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*args)
    return list(saved.values())
