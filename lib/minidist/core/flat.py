"""Tensors as one flat buffer and back: how buckets, shards and fused collectives are made.

    flat = flatten(grads)              # one 1-D tensor: every tensor's elements, in order
    collectives.all_reduce(flat)       # one collective instead of one per tensor
    copy_back(flat, grads)             # each tensor takes its elements back
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["accumulation_dtype", "flat_view", "flatten", "views", "copy_back"]


def accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype to accumulate `dtypes` in: at least fp32, and never narrower than any of them
    (bf16 and fp16 sum in fp32; fp64 stays fp64, so a gradient check in fp64 keeps its digits)."""
    found = torch.float32
    for dtype in dtypes:
        found = torch.promote_types(found, dtype)
    return found


def flat_view(tensor: torch.Tensor, caller: str) -> torch.Tensor:
    """`tensor` as a 1-D view sharing its memory, for a collective that works in place on it;
    raises, naming `caller`, if the tensor is not contiguous (a view would be a copy)."""
    if not tensor.is_contiguous():
        raise ValueError(f"{caller} works in place on a contiguous tensor, got one with shape "
                         f"{tuple(tensor.shape)} and strides {tensor.stride()}; pass "
                         f"t.contiguous() and copy the result back")
    return tensor.view(-1)


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new 1-D tensor holding every tensor's elements, one after another (in `dtype`, if
    given); the tensors must share a device."""
    return torch.cat([t.detach().reshape(-1).to(dtype or t.dtype) for t in tensors])


def views(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Consecutive pieces of `flat`, one view of each shape: the tensors `flatten` took in."""
    pieces, offset = [], 0
    for shape in shapes:
        pieces.append(flat[offset:offset + shape.numel()].view(shape))
        offset += shape.numel()
    return pieces


def copy_back(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy `flat`'s pieces back into `tensors`, in place (the inverse of `flatten`)."""
    with torch.no_grad():
        for tensor, piece in zip(tensors, views(flat, [t.shape for t in tensors]), strict=True):
            tensor.copy_(piece)
