"""Gradient compression for data parallelism: send less than the gradient, keep what was left out.

`DistributedDataParallel(model, compression=PowerSGD(rank=2))` hands each full bucket to the
compression instead of all-reducing it, as PyTorch's DDP communication hooks do
(`register_comm_hook`). Every byte goes through minidist's own collectives (send/recv), so
`counting.count_traffic()` counts what compression saves. For a bucket of S bytes (fp32) on N
ranks, the ring all-reduce sends 2(N-1)/N·S per rank; here:

    TopK(ratio)     each rank keeps its k = ratio·numel largest entries and all-gathers k values
                    and their k int32 indices (Stich et al. 2018; Lin et al. 2018). What it left
                    out (the residual) is added to its next gradient: error feedback, without
                    which top-k stalls.
    PowerSGD(rank)  each n×m gradient matrix M becomes P Qᵀ of rank r with one power iteration,
                    warm-started from last step's Q: P = M Q, all-reduce P, orthonormalize P,
                    Q = Mᵀ P, all-reduce Q. (n+m)·r elements all-reduced instead of n·m; 1-D
                    tensors and matrices it would not shrink enough go uncompressed. Error
                    feedback as for top-k (Vogels et al., NeurIPS 2019; PyTorch's powerSGD_hook).
    Int8()          each rank sends chunk j of its gradient, quantized to int8 with one fp32
                    scale, to rank j, which sums the chunks it gets and all-gathers the sum,
                    quantized again.

Each one returns, in place, an approximation of the sum over ranks of the bucket; DDP then
divides by N as it does for the exact sum. Error feedback keeps a rank's residual per bucket,
so the same compression object must serve one model only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from minidist.communication import collectives
from minidist.communication.comm import chunk_bounds
from minidist.core._checks import positive_int
from minidist.core.flat import copy_back, flatten, views

__all__ = ["Compression", "top_k", "TopK", "PowerSGD", "Int8"]


class Compression(ABC):
    """A compressed sum over ranks of one bucket of flat gradients."""

    @abstractmethod
    def all_reduce(self, bucket: int, buffer: torch.Tensor, shapes: list[torch.Size],
                   group: dist.ProcessGroup | None = None) -> None:
        """Replace `buffer`, this rank's flat gradients of tensors of `shapes` (in order), with
        an approximation of its sum over the ranks of `group`. `bucket` names the bucket, for
        state kept between steps (residuals, PowerSGD's Q)."""


def top_k(tensor: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int32 indices) of the k entries of flat `tensor` largest in magnitude."""
    indices = tensor.abs().topk(k, sorted=False).indices
    return tensor[indices], indices.to(torch.int32)


class TopK(Compression):
    """Send the `ratio`·numel largest entries of each bucket (at least one), with error feedback."""

    def __init__(self, ratio: float):
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio={ratio!r}: the fraction of entries sent must be in (0, 1]")
        self.ratio = ratio
        self.residuals: dict[int, torch.Tensor] = {}

    def all_reduce(self, bucket: int, buffer: torch.Tensor, shapes: list[torch.Size],
                   group: dist.ProcessGroup | None = None) -> None:
        size = dist.get_world_size(group)
        corrected = buffer + self.residuals.get(bucket, 0)
        k = max(1, int(self.ratio * buffer.numel()))
        values, indices = top_k(corrected, k)
        self.residuals[bucket] = corrected.index_fill_(0, indices.long(), 0)  # not sent
        # Rank r's k entries land at [r·k, (r+1)·k): the ring all-gather's chunk r.
        all_values = collectives.all_gather(values, size * k, group=group, impl="ring",
                                            when="compressed gradients")
        all_indices = collectives.all_gather(indices, size * k, group=group, impl="ring",
                                             when="compressed gradients")
        buffer.zero_().index_add_(0, all_indices, all_values)


class PowerSGD(Compression):
    """Rank-`rank` approximation of each gradient matrix, one warm-started power iteration.

    A tensor of shape (n, ...) is the matrix n × m, m the product of the other dims; it is
    compressed when min_compression_rate·(n+m)·r < n·m, as in PyTorch's powerSGD_hook (default
    2). Q starts as the same seeded Gaussian on every rank."""

    def __init__(self, rank: int, *, min_compression_rate: float = 2.0, seed: int = 0):
        positive_int(rank=rank)
        self.rank, self.min_compression_rate, self.seed = rank, min_compression_rate, seed
        self.residuals: dict[int, list[torch.Tensor]] = {}
        self.qs: dict[int, list[torch.Tensor]] = {}

    def compresses(self, shape: torch.Size) -> bool:
        """Whether a gradient of this shape is sent as P and Q rather than whole."""
        if len(shape) < 2:
            return False
        n, m = shape[0], shape.numel() // shape[0]
        return self.min_compression_rate * (n + m) * min(self.rank, n, m) < n * m

    def all_reduce(self, bucket: int, buffer: torch.Tensor, shapes: list[torch.Size],
                   group: dist.ProcessGroup | None = None) -> None:
        pieces = views(buffer, shapes)
        plain = [v for v, shape in zip(pieces, shapes, strict=True) if not self.compresses(shape)]
        matrices = [v.view(shape[0], -1) for v, shape in zip(pieces, shapes, strict=True)
                    if self.compresses(shape)]
        if plain:
            _all_reduce_together(plain, group)
        if matrices:
            self._compress(bucket, matrices, group)

    def _compress(self, bucket: int, matrices: list[torch.Tensor],
                  group: dist.ProcessGroup | None) -> None:
        if bucket not in self.qs:
            generator = torch.Generator().manual_seed(self.seed + bucket)
            self.qs[bucket] = [torch.randn(m.shape[1], min(self.rank, *m.shape),
                                           generator=generator, dtype=m.dtype) for m in matrices]
            self.residuals[bucket] = [torch.zeros_like(m) for m in matrices]
        corrected = [m + e for m, e in zip(matrices, self.residuals[bucket], strict=True)]
        ps = [m @ q for m, q in zip(corrected, self.qs[bucket], strict=True)]
        _all_reduce_together(ps, group)
        ps = [torch.linalg.qr(p).Q for p in ps]  # orthonormal columns, the same on every rank
        qs = [m.T @ p for m, p in zip(corrected, ps, strict=True)]
        _all_reduce_together(qs, group)
        size = dist.get_world_size(group)
        for i, (m, p, q) in enumerate(zip(matrices, ps, qs, strict=True)):
            total = p @ q.T  # the approximation of the sum over ranks
            self.residuals[bucket][i] = corrected[i] - total / size
            m.copy_(total)
        self.qs[bucket] = [q / size for q in qs]  # warm start: next step's Q


class Int8(Compression):
    """Quantize to int8 with one fp32 scale per chunk: all-to-all, sum, all-gather.

    Rank j owns chunk j (`comm.chunk_bounds`): every rank sends it its chunk j (int8, its
    4-byte scale in front); rank j dequantizes and adds them, quantizes the sum and all-gathers
    it. No error feedback: 8-bit rounding errors are about 1/254 of each chunk's largest entry."""

    def all_reduce(self, bucket: int, buffer: torch.Tensor, shapes: list[torch.Size],
                   group: dist.ProcessGroup | None = None) -> None:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        bounds = chunk_bounds(buffer.numel(), size)
        slot = 4 + bounds[0][1] - bounds[0][0]  # scale + the largest chunk
        outgoing = torch.stack([_quantize(buffer[start:end], slot) for start, end in bounds])
        ones = [1] * size
        incoming = collectives.all_to_all(outgoing, ones, ones, group=group, impl="pairwise",
                                          when="compressed gradients")
        start, end = bounds[rank]
        mine = sum(_dequantize(message, end - start) for message in incoming)
        gathered = collectives.all_gather(_quantize(mine, slot), size * slot, group=group,
                                          impl="ring", when="compressed gradients")
        for peer, (start, end) in enumerate(bounds):
            buffer[start:end] = _dequantize(gathered[peer * slot:(peer + 1) * slot], end - start)


def _quantize(chunk: torch.Tensor, slot: int) -> torch.Tensor:
    """`slot` int8 bytes: the fp32 scale's 4 bytes, then round(chunk / scale), zero-padded."""
    scale = chunk.abs().max() / 127 if chunk.numel() else torch.tensor(0.0)
    scale = torch.where(scale > 0, scale, torch.ones(())).to(torch.float32)
    message = torch.zeros(slot, dtype=torch.int8)
    message[:4] = scale.reshape(1).view(torch.int8)
    message[4:4 + chunk.numel()] = (chunk / scale).round().clamp(-127, 127).to(torch.int8)
    return message


def _dequantize(message: torch.Tensor, numel: int) -> torch.Tensor:
    scale = message[:4].clone().view(torch.float32)
    return message[4:4 + numel].to(torch.float32) * scale


def _all_reduce_together(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum the tensors over ranks in place with one ring all-reduce of their concatenation."""
    flat = flatten(tensors)
    collectives.all_reduce(flat, group=group, impl="ring", when="compressed gradients")
    copy_back(flat, tensors)
