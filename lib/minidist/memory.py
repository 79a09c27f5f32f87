"""The arithmetic of distributed training: memory, pipeline bubbles, communication, MFU.

Pure functions of sizes, no tensors. Units: bytes, seconds, FLOP. GB means 1e9 bytes (`GB`);
GiB, 2**30 bytes (`GiB`), is what `nvidia-smi` and PyTorch's memory counters print.

Notation (as in the course's REFERENCE page): Ψ parameters, N data-parallel ranks, t
tensor-parallel degree, p pipeline stages, m microbatches, v model chunks per pipeline rank,
s sequence length, b microbatch size, h hidden size, a attention heads, L layers.

Sources:
  ZeRO       Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
             Parameter Models", SC 2020 (§3 and §5 memory, §7 communication).
  Korthikanti Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
             Models", MLSys 2023 (§4, Table 2).
  GPipe      Huang et al., "GPipe", NeurIPS 2019.
  Narayanan  Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
             Using Megatron-LM", SC 2021 (§2.2 schedules, §3 communication).
  ZB         Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (§2).
  Megatron   Shoeybi et al., "Megatron-LM", 2019 (§3, tensor parallel).
  PaLM       Chowdhery et al., "PaLM", 2022 (Appendix B, MFU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minidist.cost import ring_bytes_sent

GB = 1e9
GiB = 2**30


# --- Checks --------------------------------------------------------------------------------


def _positive(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name}={value!r}: must be a positive number")


def _positive_int(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")


def _choice(name: str, value: object, valid: tuple) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(map(repr, valid))}")


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
        _choice("precision", precision, tuple(PRECISIONS))
        recipe = PRECISIONS[precision]
    _choice("optimizer", optimizer, tuple(OPTIMIZER_STATES))
    states = OPTIMIZER_STATES[optimizer]
    return ModelStateBytes(recipe.param, recipe.grad, recipe.master + states * recipe.state)


def model_state_bytes(num_params: float, zero_stage: int = 0, dp: int = 1,
                      precision: str | Precision = "bf16-mixed",
                      optimizer: str = "adam") -> ModelStateBytes:
    """Bytes per rank of parameters, gradients and optimizer state (ZeRO §5, Figure 1).

    ZeRO partitions over the N = `dp` data-parallel ranks: stage 1 the optimizer state,
    stage 2 also the gradients, stage 3 (FSDP) also the parameters. With mixed-precision
    Adam (2 + 2 + 12 bytes per parameter):

        stage 0  16Ψ           stage 2  2Ψ + 14Ψ/N
        stage 1  4Ψ + 12Ψ/N    stage 3  16Ψ/N

    Shards are Ψ/N exactly (real implementations pad to a multiple of N). E.g. Ψ = 7.5e9,
    N = 64: 120, 31.4, 16.6 and 1.9 GB (ZeRO Figure 1).
    """
    _positive(num_params=num_params)
    _positive_int(dp=dp)
    _choice("zero_stage", zero_stage, (0, 1, 2, 3))
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
    _positive(gpu_memory=gpu_memory)
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
    _positive_int(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, heads=heads, tp=tp)
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
    _choice("recompute", recompute, RECOMPUTE)
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


# --- Pipeline bubbles ------------------------------------------------------------------------

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")
ZB_COSTS = (1.0, 1.0, 1.0)  # (T_F, T_B, T_W): ZB §2's assumption of equal F, B and W times


def _check_schedule(schedule: str, stages: int, microbatches: int, chunks: int) -> None:
    _choice("schedule", schedule, SCHEDULES)
    _positive_int(stages=stages, microbatches=microbatches, chunks=chunks)
    if chunks > 1 and schedule != "interleaved":
        raise ValueError(f"chunks={chunks}: only the 'interleaved' schedule has more than one "
                         "model chunk per rank")
    if schedule == "interleaved" and microbatches % stages:
        raise ValueError(f"microbatches={microbatches} is not a multiple of stages={stages}: "
                         "the interleaved schedule runs microbatches in groups of p")
    if schedule == "zb-h1" and microbatches < stages:
        raise ValueError(f"microbatches={microbatches} < stages={stages}: ZB-H1 needs at least "
                         "p microbatches to fill its bubbles with W passes")


def bubble_time(schedule: str, stages: int, microbatches: int, chunks: int = 1,
                costs: tuple[float, float, float] = ZB_COSTS) -> tuple[float, float]:
    """(bubble, ideal) time of one pipeline stage per step, in the units of `costs`.

    `costs` = (T_F, T_B, T_W): forward, backward for the input, backward for the weights, per
    microbatch per stage. Schedules that do not split the backward run B and W as one pass of
    T_B + T_W. Ideal = m(T_F + T_B + T_W), the stage's own work. Bubble:

        gpipe, 1f1b    (p-1)(T_F + T_B + T_W)         GPipe; Narayanan §2.2.1
        interleaved    (p-1)(T_F + T_B + T_W) / v     Narayanan §2.2.2 (m a multiple of p)
        zb-h1          (p-1)(T_F + T_B - T_W)         ZB §2.1 (m >= p)
        zb-h2          0                              ZB §2.2, the ideal handcrafted schedule
    """
    _check_schedule(schedule, stages, microbatches, chunks)
    _positive(T_F=costs[0], T_B=costs[1], T_W=costs[2])
    t_f, t_b, t_w = costs
    ideal = microbatches * (t_f + t_b + t_w)
    bubble = {
        "gpipe": (stages - 1) * (t_f + t_b + t_w),
        "1f1b": (stages - 1) * (t_f + t_b + t_w),
        "interleaved": (stages - 1) * (t_f + t_b + t_w) / chunks,
        "zb-h1": (stages - 1) * max(0.0, t_f + t_b - t_w),
        "zb-h2": 0.0,
    }[schedule]
    return bubble, ideal


def bubble_fraction(schedule: str, stages: int, microbatches: int, chunks: int = 1,
                    costs: tuple[float, float, float] = ZB_COSTS) -> float:
    """The bubble as a share of total time, bubble / (ideal + bubble).

    GPipe and 1F1B: (p-1)/(m+p-1); interleaved: (p-1)/(v·m + p-1); ZB-H1 with
    T_F = T_B = T_W: (p-1)/(3m + p-1). Worked values: p=4, m=1: 75%; p=4, m=8: 3/11 ≈ 27.3%;
    p=4, m=30: 3/33 ≈ 9.1%. For bubble / ideal, see `bubble_relative_to_ideal`.
    """
    bubble, ideal = bubble_time(schedule, stages, microbatches, chunks, costs)
    return bubble / (ideal + bubble)


def bubble_relative_to_ideal(schedule: str, stages: int, microbatches: int, chunks: int = 1,
                             costs: tuple[float, float, float] = ZB_COSTS) -> float:
    """The bubble relative to the ideal (bubble-free) time, bubble / ideal: the step takes
    (1 + this) times as long as the pure compute.

    GPipe and 1F1B: (p-1)/m; interleaved: (p-1)/(v·m) (Narayanan §2.2). This is not the
    share of total time (`bubble_fraction`): p=4, m=8 gives 3/8 here and 3/11 there.
    """
    bubble, ideal = bubble_time(schedule, stages, microbatches, chunks, costs)
    return bubble / ideal


def inflight_microbatches(schedule: str, stages: int, microbatches: int, stage: int,
                          chunks: int = 1) -> int:
    """Peak number of microbatches whose activations stage `stage` (0-based) holds at once.

        gpipe        m                          (all forwards before any backward)
        1f1b         min(p - i, m)              Narayanan §2.2.1
        interleaved  min((v-1)p + 2(p-i-1) + 1, v·m) chunk-microbatches: the first rank
                     holds v·p + p - 1, each 1/v of a stage's layers   Narayanan §2.2.2
        zb-h1        min(p, m) on every stage   ZB §2.1 (W passes deferred, 1F1B's peak)
        zb-h2        min(2p - 1, m)             ZB §2.2

    So under 1F1B the first stage holds p microbatches of its L/p layers, whatever p is:
    pipelining does not cut the first stage's activation memory (Korthikanti §4.2.3).
    """
    _check_schedule(schedule, stages, microbatches, chunks)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < stages:
        raise ValueError(f"stage={stage!r}: must be an integer in [0, stages={stages})")
    p, m, v, i = stages, microbatches, chunks, stage
    return {
        "gpipe": m,
        "1f1b": min(p - i, m),
        "interleaved": min((v - 1) * p + 2 * (p - i - 1) + 1, v * m),
        "zb-h1": min(p, m),
        "zb-h2": min(2 * p - 1, m),
    }[schedule]


# --- Communication ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    """`count` runs of collective `op` on a tensor of `nbytes` bytes over `group` ranks."""

    op: str  # "all_reduce", "reduce_scatter", "all_gather" or "send"
    nbytes: float
    group: int
    count: int = 1
    when: str = ""

    @property
    def bytes_sent(self) -> float:
        """Bytes each rank sends: ring algorithms (minidist.cost), or the message for send."""
        if self.op == "send":
            return self.count * self.nbytes
        return self.count * ring_bytes_sent(self.op, self.nbytes, self.group)


@dataclass(frozen=True)
class Traffic:
    """The collectives of one training step (or one layer), and what they add up to."""

    collectives: tuple[Collective, ...]

    @property
    def volume(self) -> float:
        """The bytes a rank sends as N → ∞, the measure ZeRO §7 counts: 2S per all-reduce
        (a reduce-scatter plus an all-gather), S per reduce-scatter, all-gather or send. DDP:
        2Ψ elements; ZeRO-3: 3Ψ."""
        return sum(c.count * c.nbytes * (2 if c.op == "all_reduce" else 1)
                   for c in self.collectives)

    @property
    def bytes_sent(self) -> float:
        """Bytes each rank actually sends, with the ring's (N-1)/N factors."""
        return sum(c.bytes_sent for c in self.collectives)


def data_parallel_traffic(num_params: float, dp: int, zero_stage: int = 0,
                          bytes_per_element: int = 2, microbatches: int = 1) -> Traffic:
    """Gradient and parameter traffic of one step of data parallelism over N = `dp` ranks.

    ZeRO §7: DDP all-reduces the gradients (a reduce-scatter plus an all-gather: 2Ψ
    elements); ZeRO-1 and ZeRO-2 reduce-scatter the gradients and all-gather the updated
    parameters (2Ψ, the same); ZeRO-3 all-gathers the parameters in forward and again in
    backward and reduce-scatters the gradients (3Ψ, 1.5x).

    With `microbatches` > 1 (gradient accumulation) DDP and ZeRO-1 accumulate full local
    gradients and communicate once per step; ZeRO-2 keeps only its gradient shard, so it
    reduce-scatters after every microbatch; ZeRO-3 gathers the parameters for every
    microbatch's forward and backward, and reduce-scatters its gradients each time.
    """
    _positive(num_params=num_params)
    _positive_int(dp=dp, bytes_per_element=bytes_per_element, microbatches=microbatches)
    _choice("zero_stage", zero_stage, (0, 1, 2, 3))
    size, m = num_params * bytes_per_element, microbatches
    if zero_stage == 0:
        collectives = [Collective("all_reduce", size, dp, 1, "gradients, after backward")]
    elif zero_stage == 1:
        collectives = [Collective("reduce_scatter", size, dp, 1, "gradients, after backward"),
                       Collective("all_gather", size, dp, 1, "parameters, after the step")]
    elif zero_stage == 2:
        collectives = [Collective("reduce_scatter", size, dp, m, "gradients, every backward"),
                       Collective("all_gather", size, dp, 1, "parameters, after the step")]
    else:
        collectives = [Collective("all_gather", size, dp, m, "parameters, every forward"),
                       Collective("all_gather", size, dp, m, "parameters, every backward"),
                       Collective("reduce_scatter", size, dp, m, "gradients, every backward")]
    return Traffic(tuple(collectives))


def tensor_parallel_traffic(seq_len: int, micro_batch: int, hidden: int, tp: int,
                            sequence_parallel: bool = False,
                            bytes_per_element: int = 2) -> Traffic:
    """Traffic of one transformer layer, one microbatch, forward and backward.

    Megatron §3: attention and MLP each end in an all-reduce forward (g) and start with one
    in backward (f): 2 + 2 all-reduces of b·s·h elements per layer. With sequence parallelism
    (Korthikanti §4.2.2) each all-reduce becomes a reduce-scatter plus an all-gather: the
    same bytes. Full recompute repeats the forward's two.
    """
    _positive_int(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, tp=tp,
                  bytes_per_element=bytes_per_element)
    size = seq_len * micro_batch * hidden * bytes_per_element
    if not sequence_parallel:
        return Traffic((Collective("all_reduce", size, tp, 2, "forward, after attention, MLP"),
                        Collective("all_reduce", size, tp, 2, "backward, before attention, MLP")))
    return Traffic((Collective("all_gather", size, tp, 2, "forward, before attention, MLP"),
                    Collective("reduce_scatter", size, tp, 2, "forward, after attention, MLP"),
                    Collective("all_gather", size, tp, 2, "backward, of the reduce-scatters"),
                    Collective("reduce_scatter", size, tp, 2, "backward, of the all-gathers")))


def pipeline_traffic(seq_len: int, micro_batch: int, hidden: int, microbatches: int = 1,
                     chunks: int = 1, bytes_per_element: int = 2) -> Traffic:
    """Point-to-point traffic a pipeline rank sends per step (Narayanan §2.2, §3).

    Each microbatch crosses each stage boundary as a b·s·h activation forward and its
    gradient backward. A rank with v chunks sends across v boundaries: v times the traffic of
    the plain schedule."""
    _positive_int(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden,
                  microbatches=microbatches, chunks=chunks, bytes_per_element=bytes_per_element)
    size = seq_len * micro_batch * hidden * bytes_per_element
    n = microbatches * chunks
    return Traffic((Collective("send", size, 2, n, "activations, forward"),
                    Collective("send", size, 2, n, "gradients, backward")))


# --- Compute -----------------------------------------------------------------------------------


def model_flops_per_token(num_params: float, layers: int, hidden: int, seq_len: int) -> float:
    """FLOPs of forward plus backward per token: 6Ψ + 12·L·h·s (PaLM, Appendix B): 2Ψ per
    token forward and 4Ψ backward for the matmuls with weights, plus attention's QKᵀ and ·V."""
    _positive(num_params=num_params)
    _positive_int(layers=layers, hidden=hidden, seq_len=seq_len)
    return 6 * num_params + 12 * layers * hidden * seq_len


def hardware_flops_per_token(num_params: float, layers: int, hidden: int, seq_len: int,
                             recompute: str | None = None) -> float:
    """FLOPs the hardware actually runs per token: the model's, plus what recompute repeats.
    Full recompute reruns the forward (+2Ψ + 4·L·h·s); selective recompute only attention's
    QKᵀ and ·V (+4·L·h·s)."""
    _choice("recompute", recompute, RECOMPUTE)
    extra = {None: 0.0, "selective": 4 * layers * hidden * seq_len,
             "full": 2 * num_params + 4 * layers * hidden * seq_len}[recompute]
    return model_flops_per_token(num_params, layers, hidden, seq_len) + extra


def mfu(tokens_per_second: float, num_params: float, layers: int, hidden: int, seq_len: int,
        peak_flops: float, num_gpus: int = 1) -> float:
    """Model FLOPs utilisation: tokens/s x (6Ψ + 12·L·h·s) / (num_gpus x peak FLOP/s)
    (PaLM, Appendix B). Recompute does not count: it is work the model did not need."""
    _positive(tokens_per_second=tokens_per_second, peak_flops=peak_flops)
    _positive_int(num_gpus=num_gpus)
    flops = model_flops_per_token(num_params, layers, hidden, seq_len)
    return tokens_per_second * flops / (num_gpus * peak_flops)


def hfu(tokens_per_second: float, num_params: float, layers: int, hidden: int, seq_len: int,
        peak_flops: float, num_gpus: int = 1, recompute: str | None = None) -> float:
    """Hardware FLOPs utilisation: like `mfu`, but counting recomputed FLOPs too (PaLM,
    Appendix B). Megatron's 52% on 3072 A100s (Narayanan 2021) counts full recompute: HFU."""
    _positive(tokens_per_second=tokens_per_second, peak_flops=peak_flops)
    _positive_int(num_gpus=num_gpus)
    flops = hardware_flops_per_token(num_params, layers, hidden, seq_len, recompute)
    return tokens_per_second * flops / (num_gpus * peak_flops)


def strong_scaling_efficiency(time_1: float, time_n: float, n: int) -> float:
    """T₁ / (N·T_N): the same global batch on N GPUs instead of 1 (1.0 = perfect)."""
    _positive(time_1=time_1, time_n=time_n)
    _positive_int(n=n)
    return time_1 / (n * time_n)


def weak_scaling_efficiency(time_1: float, time_n: float) -> float:
    """T₁ / T_N: the batch grown N-fold on N GPUs, so each GPU's work stays the same."""
    _positive(time_1=time_1, time_n=time_n)
    return time_1 / time_n
