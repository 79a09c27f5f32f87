"""Memory per rank: the bytes of model state (parameters, gradients, optimizer state, with
ZeRO's sharding) and of the activations a transformer layer keeps for backward.

Pure functions of sizes, no tensors. Units: bytes. GB means 1e9 bytes (`GB`); GiB, 2**30
bytes (`GiB`), is what `nvidia-smi` and PyTorch's memory counters print. What a pipeline
stage holds in flight is `minidist.costs.bubbles.inflight_microbatches`; what each strategy sends,
`minidist.costs.traffic`; FLOPs and MFU, `minidist.costs.flops`.

Notation (as in REFERENCES.md#notation): Ψ parameters, N data-parallel ranks, t
tensor-parallel degree, s sequence length, b microbatch size, h hidden size, a attention
heads, L layers.

Sources:
  ZeRO       Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
             Parameter Models", SC 2020 (§3 and §5 memory).
  Korthikanti Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
             Models", MLSys 2023 (§4, Table 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minidist.core._checks import one_of, positive, positive_int

__all__ = [
    "GB", "GiB", "Precision", "PRECISIONS", "OPTIMIZER_STATES", "ModelStateBytes",
    "bytes_per_param", "model_state_bytes", "min_gpus_for_model_state", "ActivationTerm",
    "activation_terms", "RECOMPUTE", "activation_bytes",
]

GB = 1e9
GiB = 2**30


# --- Model state: parameters, gradients, optimizer -----------------------------------------


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each copy a training recipe keeps.

    `master` is the fp32 copy of the weights that mixed precision updates (0 when the
    parameters are fp32 themselves); `state` the bytes of each optimizer state element."""

    name: str
    param: int
    grad: int
    master: int
    state: int


PRECISIONS = {
    # Mixed precision (Micikevicius et al. 2018; ZeRO §3): 16-bit params and grads, fp32
    # master weights and optimizer state.
    "bf16-mixed": Precision("bf16-mixed", param=2, grad=2, master=4, state=4),
    "fp16-mixed": Precision("fp16-mixed", param=2, grad=2, master=4, state=4),
    "fp32": Precision("fp32", param=4, grad=4, master=0, state=4),
}

# Optimizer state elements per parameter: Adam keeps m and v, SGD with momentum one buffer.
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes one rank holds for parameters, gradients and optimizer state (master weights
    included in `optimizer`, as ZeRO's K counts them)."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def __str__(self) -> str:
        return (f"params {self.params / GB:.2f} GB + grads {self.grads / GB:.2f} GB + "
                f"optimizer {self.optimizer / GB:.2f} GB = {self.total / GB:.2f} GB")


def bytes_per_param(precision: str | Precision = "bf16-mixed",
                    optimizer: str = "adam") -> ModelStateBytes:
    """Bytes per parameter, unsharded: mixed-precision Adam is 2 + 2 + 12 = 16 (ZeRO §3:
    K = 12 for the fp32 master weights, m and v); fp32 Adam 4 + 4 + 8 = 16 as well."""
    recipe = precision if isinstance(precision, Precision) else None
    if recipe is None:
        one_of("precision", precision, tuple(PRECISIONS))
        recipe = PRECISIONS[precision]
    one_of("optimizer", optimizer, tuple(OPTIMIZER_STATES))
    states = OPTIMIZER_STATES[optimizer]
    return ModelStateBytes(recipe.param, recipe.grad, recipe.master + states * recipe.state)


def model_state_bytes(num_params: float, zero_stage: int = 0, dp: int = 1,
                      precision: str | Precision = "bf16-mixed",
                      optimizer: str = "adam") -> ModelStateBytes:
    """Bytes per rank of parameters, gradients and optimizer state (ZeRO §5, Figure 1).

    ZeRO partitions over the N = `dp` data-parallel ranks: stage 1 the optimizer state,
    stage 2 also the gradients, stage 3 (FSDP) also the parameters (what each stage then holds
    per parameter is Lab 04's prediction). Shards are Ψ/N exactly (real implementations pad to a
    multiple of N). E.g. Ψ = 7.5e9, N = 64: 120, 31.4, 16.6 and 1.9 GB (ZeRO Figure 1).
    """
    positive(num_params=num_params)
    positive_int(dp=dp)
    one_of("zero_stage", zero_stage, (0, 1, 2, 3))
    per_param = bytes_per_param(precision, optimizer)
    params, grads, states = (per_param.params * num_params, per_param.grads * num_params,
                             per_param.optimizer * num_params)
    return ModelStateBytes(
        params=params / dp if zero_stage >= 3 else params,
        grads=grads / dp if zero_stage >= 2 else grads,
        optimizer=states / dp if zero_stage >= 1 else states,
    )


def min_gpus_for_model_state(num_params: float, gpu_memory: float, zero_stage: int = 3,
                             precision: str | Precision = "bf16-mixed",
                             optimizer: str = "adam") -> int | None:
    """The fewest data-parallel ranks N whose model state fits in `gpu_memory` bytes each,
    before activations; None when no N does (the unsharded part alone is too big).

    70B parameters, mixed-precision Adam, 80 GB GPUs, ZeRO-3: 16 * 70e9 / N <= 80e9, N = 14.
    ZeRO-1 and ZeRO-2 never fit: their unsharded 4Ψ = 280 GB and 2Ψ = 140 GB exceed 80 GB.
    """
    positive(gpu_memory=gpu_memory)
    one = model_state_bytes(num_params, zero_stage, 1, precision, optimizer)
    sharded = {0: 0.0, 1: one.optimizer, 2: one.optimizer + one.grads, 3: one.total}[zero_stage]
    kept = one.total - sharded
    if kept > gpu_memory or (sharded > 0 and kept == gpu_memory):
        return None
    if sharded == 0:
        return 1
    n = max(1, math.ceil(sharded / (gpu_memory - kept)))
    while n > 1 and kept + sharded / (n - 1) <= gpu_memory:  # float rounding may add one
        n -= 1
    return n


# --- Activations -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationTerm:
    """One tensor a transformer layer keeps for backward (Korthikanti §4.1).

    `tensor_parallel`: split across the t ranks by plain tensor parallelism (the rest is
    replicated, until sequence parallelism splits it along the sequence). `attention_core`:
    what selective recompute drops and recomputes (the s x s softmax and its dropout)."""

    name: str
    bytes: float
    tensor_parallel: bool
    attention_core: bool = False


def activation_terms(seq_len: int, micro_batch: int, hidden: int,
                     heads: int) -> list[ActivationTerm]:
    """Korthikanti §4.1's itemised activations of one GPT layer (16-bit activations, 1-byte
    dropout masks, MLP width 4h), without parallelism or recompute: they sum to
    s·b·h·(34 + 5·a·s/h) bytes."""
    _check_shape(seq_len, micro_batch, hidden, heads)
    sbh = seq_len * micro_batch * hidden
    as2b = heads * seq_len * seq_len * micro_batch
    return [
        ActivationTerm("LayerNorm 1 input", 2 * sbh, False),
        ActivationTerm("QKV projection input", 2 * sbh, False),
        ActivationTerm("Q and K, for QKᵀ", 4 * sbh, True),
        ActivationTerm("softmax output", 2 * as2b, True, attention_core=True),
        ActivationTerm("attention dropout mask", as2b, True, attention_core=True),
        ActivationTerm("attention dropout output, for ·V", 2 * as2b, True, attention_core=True),
        ActivationTerm("V", 2 * sbh, True),
        ActivationTerm("output projection input", 2 * sbh, True),
        ActivationTerm("attention block dropout mask", sbh, False),
        ActivationTerm("LayerNorm 2 input", 2 * sbh, False),
        ActivationTerm("fc1 input", 2 * sbh, False),
        ActivationTerm("GeLU input", 8 * sbh, True),
        ActivationTerm("fc2 input", 8 * sbh, True),
        ActivationTerm("MLP block dropout mask", sbh, False),
    ]


RECOMPUTE = (None, "selective", "full")


def _check_shape(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1) -> None:
    positive_int(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, heads=heads, tp=tp)
    if hidden % heads:
        raise ValueError(f"heads={heads} does not divide hidden={hidden}: "
                         "each head gets hidden/heads dimensions")
    if heads % tp:
        raise ValueError(f"tp={tp} does not divide heads={heads}: "
                         "tensor parallelism gives each rank whole heads")


def activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                     sequence_parallel: bool = False, recompute: str | None = None) -> float:
    """Bytes one transformer layer keeps for backward, per tensor-parallel rank, for one
    microbatch (Korthikanti Table 2; 16-bit activations):

        no parallelism                                 sbh(34 + 5as/h)
        tensor parallel                                sbh(10 + 24/t + 5as/(ht))
        tensor + sequence parallel                     sbh(34 + 5as/h) / t
        tensor parallel + selective recompute          sbh(10 + 24/t)
        tensor + sequence parallel + selective         34 sbh / t
        full recompute                                 2 sbh (the layer's input only)

    With full recompute and sequence parallelism the stored input is itself split along the
    sequence, 2sbh/t. Whoever recomputes also needs one layer's activations at a time while
    it does; that working memory is not included here.
    """
    _check_shape(seq_len, micro_batch, hidden, heads, tp)
    one_of("recompute", recompute, RECOMPUTE)
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel={sequence_parallel!r}: must be True or False")
    if sequence_parallel and seq_len % tp:
        raise ValueError(f"tp={tp} does not divide seq_len={seq_len}: "
                         "sequence parallelism splits the sequence across the tp ranks")
    if recompute == "full":
        layer_input = 2 * seq_len * micro_batch * hidden
        return layer_input / tp if sequence_parallel else layer_input
    total = 0.0
    for term in activation_terms(seq_len, micro_batch, hidden, heads):
        if term.attention_core and recompute == "selective":
            continue
        total += term.bytes / tp if term.tensor_parallel or sequence_parallel else term.bytes
    return total
