"""FLOPs of a training step, model and hardware FLOPs utilisation, scaling efficiency.

Sources:
  PaLM       Chowdhery et al., "PaLM", 2022 (Appendix B, MFU and HFU).
  Narayanan  Narayanan et al., SC 2021 (§5.1, Eq. 3: the FLOPs behind 52% on 3072 A100s).
"""

from __future__ import annotations

from minidist.core._checks import one_of, positive, positive_int
from minidist.costs.memory import RECOMPUTE

__all__ = [
    "model_flops_per_token", "hardware_flops_per_token", "mfu", "hfu",
    "strong_scaling_efficiency", "weak_scaling_efficiency",
]


def model_flops_per_token(num_params: float, layers: int, hidden: int, seq_len: int) -> float:
    """FLOPs of forward plus backward per token: 6Ψ + 12·L·h·s (PaLM, Appendix B): 2Ψ per
    token forward and 4Ψ backward for the matmuls with weights, plus attention's QKᵀ and ·V."""
    positive(num_params=num_params)
    positive_int(layers=layers, hidden=hidden, seq_len=seq_len)
    return 6 * num_params + 12 * layers * hidden * seq_len


def hardware_flops_per_token(num_params: float, layers: int, hidden: int, seq_len: int,
                             recompute: str | None = None) -> float:
    """FLOPs the hardware actually runs per token: the model's, plus what recompute repeats.
    Full recompute reruns the forward (+2Ψ + 4·L·h·s); selective recompute only attention's
    QKᵀ and ·V (+4·L·h·s)."""
    one_of("recompute", recompute, RECOMPUTE)
    extra = {None: 0.0, "selective": 4 * layers * hidden * seq_len,
             "full": 2 * num_params + 4 * layers * hidden * seq_len}[recompute]
    return model_flops_per_token(num_params, layers, hidden, seq_len) + extra


def mfu(tokens_per_second: float, num_params: float, layers: int, hidden: int, seq_len: int,
        peak_flops: float, num_gpus: int = 1) -> float:
    """Model FLOPs utilisation: tokens/s x (6Ψ + 12·L·h·s) / (num_gpus x peak FLOP/s)
    (PaLM, Appendix B). Recompute does not count: it is work the model did not need."""
    positive(tokens_per_second=tokens_per_second, peak_flops=peak_flops)
    positive_int(num_gpus=num_gpus)
    flops = model_flops_per_token(num_params, layers, hidden, seq_len)
    return tokens_per_second * flops / (num_gpus * peak_flops)


def hfu(tokens_per_second: float, num_params: float, layers: int, hidden: int, seq_len: int,
        peak_flops: float, num_gpus: int = 1, recompute: str | None = None) -> float:
    """Hardware FLOPs utilisation: like `mfu`, but counting recomputed FLOPs too (PaLM,
    Appendix B). Which of the two a published figure is depends on the FLOPs it counts
    (Lab 02's S3 asks it of Megatron's 52% on 3072 A100s, Narayanan 2021 §5.1)."""
    positive(tokens_per_second=tokens_per_second, peak_flops=peak_flops)
    positive_int(num_gpus=num_gpus)
    flops = hardware_flops_per_token(num_params, layers, hidden, seq_len, recompute)
    return tokens_per_second * flops / (num_gpus * peak_flops)


def strong_scaling_efficiency(time_1: float, time_n: float, n: int) -> float:
    """T₁ / (N·T_N): the same global batch on N GPUs instead of 1 (1.0 = perfect)."""
    positive(time_1=time_1, time_n=time_n)
    positive_int(n=n)
    return time_1 / (n * time_n)


def weak_scaling_efficiency(time_1: float, time_n: float) -> float:
    """T₁ / T_N: the batch grown N-fold on N GPUs, so each GPU's work stays the same."""
    positive(time_1=time_1, time_n=time_n)
    return time_1 / time_n
