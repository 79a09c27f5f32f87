"""Gradient clipping when no rank holds the whole gradient: sharded and model-parallel models.

`torch.nn.utils.clip_grad_norm_(params, max_norm)` scales every gradient by
min(1, max_norm / (‖g‖ + 1e-6)), with ‖g‖ the norm of all the model's gradients together.
When the gradient is spread over ranks, each rank knows only its piece, and the norm needs a
collective (Megatron-LM's `clip_grads.py`):

    ‖g‖² = Σ over ranks of Σ over this rank's pieces of ‖g_piece‖²

one all-reduce (SUM) of the squared local norms, then every rank scales its own pieces by the
same factor:

    FSDP / ZeRO         each rank holds 1/N of every gradient: sum over the data-parallel group
    tensor parallel     split weights are pieces, summed over the TP group; but LayerNorms,
                        row-parallel biases and the layers kept whole are **replicated**, the
                        same on every TP rank: count them once (on TP rank 0), not t times
    pipeline parallel   each stage holds different layers: sum over the pipeline group too
    DDP                 every rank holds the whole averaged gradient: no collective needed

A clip on the local norm alone gives each rank a different factor: the shards of one model
are scaled differently, silently. Counting replicated parameters t times overstates the norm
and clips too hard, silently too.

    clip_grad_norm_(fsdp_model.parameters(), 1.0, group=dp_group)
    clip_grad_norm_(stage.parameters(), 1.0, group=(mesh.group("tp"), mesh.group("pp")),
                    replicated=replicated_parameters(stage), replicated_group=mesh.group("tp"))

`torch.nn.utils.clip_grad_norm_` does the same on FSDP2's DTensor parameters: the norm of a
sharded DTensor is a partial sum that DTensor all-reduces.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from minidist.communication import collectives
from minidist.core.flat import accumulation_dtype
from minidist.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

__all__ = ["clip_grad_norm_", "replicated_parameters"]

Groups = dist.ProcessGroup | Sequence[dist.ProcessGroup] | None


def replicated_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of `module` that every tensor-parallel rank holds whole: all but the
    split weights of column- and row-parallel linears (and a column-parallel bias) and of
    vocab-parallel embeddings."""
    split: set[nn.Parameter] = set()
    for layer in module.modules():
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            split.add(layer.weight)
        if isinstance(layer, ColumnParallelLinear) and layer.bias is not None:
            split.add(layer.bias)
    return [p for p in dict.fromkeys(module.parameters()) if p not in split]


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, *, group: Groups = None,
                    replicated: Iterable[torch.Tensor] = (),
                    replicated_group: dist.ProcessGroup | None = None,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Scale this rank's gradients so that the norm of the whole model's gradient is at most
    `max_norm`; return that norm (before scaling), the same on every rank.

    `parameters` are this rank's (shards, or a stage's split and whole layers); `group` the
    ranks whose gradients together make the model's (None: every rank; a sequence of groups,
    e.g. the TP then the PP group, sums over each in turn); `replicated` those of
    `parameters` that every rank of `replicated_group` holds whole, counted once.
    `norm_type` 2 (the default) or inf."""
    params = [p for p in dict.fromkeys(parameters) if p.grad is not None]
    replicated = set(replicated)
    _check(max_norm, norm_type, replicated, replicated_group)
    counts = not replicated or _group_rank(replicated_group) == 0
    pieces = [p.grad for p in params if counts or p not in replicated]
    groups = list(group) if isinstance(group, Sequence) else [group]
    device = params[0].grad.device if params else torch.device("cpu")
    # fp32 at least, fp64 for fp64 gradients: every rank adds its part in the same dtype
    acc = accumulation_dtype(*(p.grad.dtype for p in params))
    if norm_type == math.inf:
        local = torch.stack([g.abs().max().to(acc) for g in pieces]).max() if pieces else None
        total = (local if local is not None else torch.zeros((), dtype=acc, device=device))
        total = total.reshape(1)
        for each in groups if dist.is_initialized() else ():
            collectives.all_reduce(total, op="max", group=each, when="gradient norm")
    else:
        squares = [torch.linalg.vector_norm(g, 2.0, dtype=acc) ** 2 for g in pieces]
        total = (torch.stack(squares).sum() if squares
                 else torch.zeros((), dtype=acc, device=device))
        total = total.reshape(1)
        for each in groups if dist.is_initialized() else ():  # alone: nothing to add
            collectives.all_reduce(total, op="sum", group=each, when="gradient norm")
        total = total.sqrt()
    norm = total[0]
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's own factor
    for p in params:
        p.grad.mul_(scale.to(p.grad.dtype))
    return norm


def _check(max_norm: float, norm_type: float, replicated: set,
           replicated_group: dist.ProcessGroup | None) -> None:
    """Before any collective, so that no rank waits for one that raised."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r}: must be a positive number, the largest "
                         f"gradient norm allowed (e.g. 1.0); a norm of 0 or less would zero "
                         f"or flip every gradient: to skip clipping, do not call it")
    if norm_type not in (2, 2.0, math.inf):
        raise ValueError(f"norm_type={norm_type!r}: use 2.0 (the default) or math.inf")
    if replicated and replicated_group is None:
        raise ValueError("replicated parameters need replicated_group, the group whose ranks "
                         "all hold them (the tensor-parallel group), so that one rank counts "
                         "them")
