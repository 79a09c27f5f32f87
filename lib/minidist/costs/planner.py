"""A 3D-parallel planner: which (TP, PP, DP, ZeRO, microbatches, recompute) layout to train with,
and optionally context parallelism (CP) for long sequences.

    plan = planner.plan(planner.MODELS["70B"], planner.Cluster.dgx_a100(64), global_batch=512)
    print(plan.table())        # the fastest layouts that fit, with their predicted step time
    print(plan.explain())      # the winner, and how many layouts each rule rejected
    print(plan.why(tp=16))     # why no layout with TP=16 survived

It enumerates layouts, rejects those that break a rule (TP must divide the heads and stay in
one node, PP must divide the layers, DP x micro-batch must divide the global batch, the
interleaved schedule needs m a multiple of p) or do not fit in memory, and ranks the rest by
a predicted step time:

    step = compute + pipeline bubble + exposed communication (TP + PP + DP + CP)
           (+ with the optimizer state offloaded: what PCIe, the CPU step and the disk add)

Context parallelism (`plan(..., context_parallel=(1, 2, 4, ...))`, off by default) splits every
sequence over cp GPUs: it divides the activations (each GPU holds s/cp tokens of every layer)
and the TP and PP messages by cp; it sends the keys and values around a ring of cp GPUs
(`minidist.costs.traffic.ring_attention_traffic`), hidden behind the attention computed meanwhile;
and the gradients are reduced over the dp·cp GPUs that hold the same parameters (as in
Megatron-LM, whose ZeRO then shards over dp·cp too). CP sits between DP and TP in the rank
order, so a CP group spans tp·cp consecutive GPUs.

Memory comes from `minidist.costs.memory` (model state with ZeRO, Korthikanti's activations) and
`minidist.parallel.pipeline` (in-flight microbatches of the schedule); bytes sent from
`minidist.costs.traffic`, their time from the alpha-beta model of `minidist.costs.cost`. Ranks are
numbered as Megatron-LM does: TP innermost, then DP, then PP, so a TP group is consecutive
GPUs of one node and pipeline neighbours are tp x dp GPUs apart.

What it leaves out, on purpose: embeddings and the LM head are spread evenly over the stages
(really they sit on the first and last), grouped-query attention and SwiGLU MLPs are treated
as plain multi-head attention and a 4h GeLU MLP, kernels all run at one efficiency, and
communication overlaps with compute only as `estimate_time` states. It ranks layouts; its
absolute times are estimates.

Why one module of about 710 lines: the layout search and the memory and time estimates it ranks by
are one choice; the rules of thumb are checked against those same estimates."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field, replace

from minidist.core._checks import positive_int
from minidist.costs.bubbles import bubble_relative_to_ideal, inflight_microbatches
from minidist.costs.cost import collective_time
from minidist.costs.flops import hardware_flops_per_token, model_flops_per_token
from minidist.costs.memory import (
    GB,
    RECOMPUTE,
    activation_bytes,
    bytes_per_param,
    model_state_bytes,
)
from minidist.costs.tiers import OFFLOAD, PCIE_BANDWIDTH, model_state_by_tier, offload_step_time
from minidist.costs.traffic import (
    data_parallel_traffic,
    pipeline_traffic,
    ring_attention_traffic,
    tensor_parallel_traffic,
)

__all__ = [
    "Model", "MODELS", "Cluster", "Layout", "MemoryEstimate", "StepTime", "Reason", "Evaluation",
    "LOGIT_BYTES", "pipeline_rank_memory", "estimate_memory", "estimate_time", "check_rules",
    "evaluate", "candidate_layouts", "Plan", "plan", "RuleCheck", "rules_of_thumb",
]


@dataclass(frozen=True)
class Model:
    """A GPT-style transformer: parameter count and shape."""

    num_params: float
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int

    def __post_init__(self) -> None:
        for name in ("num_params", "layers", "hidden", "heads", "seq_len", "vocab"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be positive")
        if self.hidden % self.heads:
            raise ValueError(f"heads={self.heads} does not divide hidden={self.hidden}")


# Published shapes (GPT-3: Brown et al. 2020, Table 2.1; Llama 2: Touvron et al. 2023). GPT-3 XL's
# row lists 24 heads of 128, which do not make its d_model of 2048: 16 heads of 128 do.
MODELS = {
    "1.3B": Model(1.3e9, layers=24, hidden=2048, heads=16, seq_len=2048, vocab=50257),
    "7B": Model(6.7e9, layers=32, hidden=4096, heads=32, seq_len=4096, vocab=32000),
    "13B": Model(13e9, layers=40, hidden=5120, heads=40, seq_len=4096, vocab=32000),
    "70B": Model(70e9, layers=80, hidden=8192, heads=64, seq_len=4096, vocab=32000),
    "175B": Model(175e9, layers=96, hidden=12288, heads=96, seq_len=2048, vocab=50257),
}


@dataclass(frozen=True)
class Cluster:
    """GPUs and links. Bandwidths are bytes/s each GPU can send (one direction); latencies
    are the alpha of the alpha-beta model; peak_flops is one GPU's dense 16-bit peak."""

    gpus: int
    gpu_memory: float
    gpus_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    peak_flops: float
    intra_node_latency: float = 5e-6
    inter_node_latency: float = 1e-5
    # Offload (minidist.costs.tiers): each GPU's PCIe link to the host (bytes/s per direction), and
    # what only a measurement gives: the host's optimizer rate (parameters/s per GPU,
    # minidist.parallel.host_optimizer.measure_optimizer_throughput), disk bandwidths
    # (minidist.parallel.nvme.measure_disk) and the host memory per GPU. None: unknown, so
    # layouts that offload there are rejected.
    pcie_bandwidth: float = PCIE_BANDWIDTH["gen4"]
    host_optimizer_throughput: float | None = None
    nvme_read_bandwidth: float | None = None
    nvme_write_bandwidth: float | None = None
    host_memory: float | None = None

    def __post_init__(self) -> None:
        for name in ("gpus", "gpu_memory", "gpus_per_node", "intra_node_bandwidth",
                     "inter_node_bandwidth", "peak_flops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be positive")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"gpus={self.gpus} is not a whole number of nodes of "
                             f"{self.gpus_per_node}")

    @classmethod
    def dgx_a100(cls, gpus: int) -> Cluster:
        """A100 80 GB nodes of 8: NVLink 3 (600 GB/s both ways), 8 x 200 Gb/s InfiniBand
        (25 GB/s per GPU), 312 TFLOP/s bf16 dense (NVIDIA A100 datasheet)."""
        return cls(gpus, 80 * GB, 8, 300e9, 25e9, 312e12, pcie_bandwidth=PCIE_BANDWIDTH["gen4"])

    @classmethod
    def dgx_h100(cls, gpus: int) -> Cluster:
        """H100 SXM 80 GB nodes of 8: NVLink 4 (900 GB/s both ways), 8 x 400 Gb/s
        InfiniBand (50 GB/s per GPU), 989 TFLOP/s bf16 dense (NVIDIA H100 datasheet)."""
        return cls(gpus, 80 * GB, 8, 450e9, 50e9, 989e12, pcie_bandwidth=PCIE_BANDWIDTH["gen5"])

    def link(self, span: int) -> tuple[float, float]:
        """(alpha, beta) of a group whose ranks span `span` consecutive GPUs."""
        if span <= self.gpus_per_node:
            return self.intra_node_latency, 1 / self.intra_node_bandwidth
        return self.inter_node_latency, 1 / self.inter_node_bandwidth


@dataclass(frozen=True)
class Layout:
    """One way to lay the model out: tp x pp x dp (x cp) GPUs, b sequences per microbatch, m
    microbatches per step per DP rank, v model chunks per pipeline rank (v > 1: the
    interleaved schedule), activation recompute None, "selective" or "full", cp GPUs sharing
    each sequence (context parallelism)."""

    tp: int
    pp: int
    dp: int
    zero_stage: int
    micro_batch: int
    microbatches: int
    recompute: str | None
    chunks: int = 1
    cp: int = 1
    offload: str | None = None  # where the optimizer state goes: None, "host" or "nvme"

    @property
    def schedule(self) -> str:
        return "interleaved" if self.chunks > 1 else "1f1b"

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    def __str__(self) -> str:
        v = f" v={self.chunks}" if self.chunks > 1 else ""
        cp = f" CP{self.cp}" if self.cp > 1 else ""
        offload = f" offload={self.offload}" if self.offload else ""
        return (f"TP{self.tp} PP{self.pp} DP{self.dp}{cp} ZeRO-{self.zero_stage} "
                f"b={self.micro_batch} m={self.microbatches}{v} recompute={self.recompute}"
                f"{offload}")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the fullest GPU: its model state, and the activations it holds at peak; with
    offload, also what its share of the host memory and of the disk holds (not in `total`)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    host: float = 0.0
    nvme: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one training step, exposed communication only."""

    compute: float
    bubble: float
    tp_comm: float
    pp_comm: float
    dp_comm: float
    cp_comm: float = 0.0
    offload: float = 0.0  # PCIe transfers, the CPU's optimizer step and disk I/O not hidden

    @property
    def total(self) -> float:
        return (self.compute + self.bubble + self.tp_comm + self.pp_comm + self.dp_comm
                + self.cp_comm + self.offload)


@dataclass(frozen=True)
class Reason:
    """Why a layout was rejected: the rule it broke, and the details."""

    rule: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Evaluation:
    layout: Layout
    memory: MemoryEstimate | None
    time: StepTime | None
    reasons: tuple[Reason, ...]
    model_flops: float  # per step, all GPUs: global batch x seq_len x (6Ψ + 12·L·h·s)
    peak_flops: float  # all GPUs

    @property
    def fits(self) -> bool:
        return not self.reasons

    @property
    def mfu(self) -> float:
        """Predicted model FLOPs utilisation (PaLM's definition)."""
        return self.model_flops / (self.time.total * self.peak_flops)


# --- Memory and time of one layout ----------------------------------------------------------

LOGIT_BYTES = 4  # the loss is computed on fp32 logits


def pipeline_rank_memory(layout: Layout, model: Model, rank: int,
                         precision: str = "bf16-mixed", optimizer: str = "adam") -> MemoryEstimate:
    """Bytes on a GPU of pipeline rank `rank` (0 to pp-1): model state for Ψ/(tp·pp)
    parameters under ZeRO (sharded over dp·cp), plus activations: `inflight_microbatches` of
    the schedule times the layers of a chunk times Korthikanti's bytes per layer divided by cp,
    plus one layer's recomputed activations while it is recomputed, plus fp32 logits
    (s/cp)·b·V/t on the last rank. ZeRO-3 also holds two gathered layers of parameters and
    one layer's whole gradient."""
    lay = layout
    state = model_state_bytes(model.num_params / (lay.tp * lay.pp), lay.zero_stage,
                              lay.dp * lay.cp, precision, optimizer)
    params, grads = state.params, state.grads
    if lay.zero_stage == 3 and lay.dp * lay.cp > 1:
        # ZeRO-3 gathers a layer's parameters whole (and prefetches the next) and produces a
        # layer's whole gradient before reduce-scattering it.
        per_param = bytes_per_param(precision, optimizer)
        layer_params = model.num_params / (model.layers * lay.tp)
        params += 2 * layer_params * per_param.params
        grads += layer_params * per_param.grads
    shape = (model.seq_len, lay.micro_batch, model.hidden, model.heads, lay.tp,
             lay.sequence_parallel)
    # With cp, a GPU keeps the activations of its s/cp queries: 1/cp of each term, the
    # attention scores included (s/cp queries against all s keys).
    per_layer = activation_bytes(*shape, recompute=lay.recompute) / lay.cp
    inflight = inflight_microbatches(lay.schedule, lay.pp, lay.microbatches, rank, lay.chunks)
    activations = inflight * model.layers / (lay.pp * lay.chunks) * per_layer
    activations += activation_bytes(*shape, recompute=None) / lay.cp - per_layer  # recompute
    if rank == lay.pp - 1:
        activations += LOGIT_BYTES * model.seq_len * lay.micro_batch * model.vocab / (
            lay.tp * lay.cp)
    if lay.offload is not None:  # the optimizer state (and the gradient shards) leave the GPU
        tiers = model_state_by_tier(model.num_params / (lay.tp * lay.pp), lay.zero_stage,
                                    lay.dp, lay.offload, precision, optimizer)
        kept_grads = grads if lay.zero_stage < 2 else 0.0
        return MemoryEstimate(params, kept_grads, 0.0, activations, tiers.host, tiers.nvme)
    return MemoryEstimate(params, grads, state.optimizer, activations)


def estimate_memory(layout: Layout, model: Model, precision: str = "bf16-mixed",
                    optimizer: str = "adam") -> MemoryEstimate:
    """The fuller of the first pipeline rank (most in-flight activations) and the last
    (logits)."""
    ranks = {0, layout.pp - 1}
    return max((pipeline_rank_memory(layout, model, r, precision, optimizer) for r in ranks),
               key=lambda estimate: estimate.total)


def estimate_time(layout: Layout, model: Model, cluster: Cluster, global_batch: int,
                  compute_efficiency: float = 0.6) -> StepTime:
    """Predicted step time.

    compute  hardware FLOPs (model FLOPs + recompute) / (GPUs x peak x compute_efficiency)
    bubble   compute x bubble_relative_to_ideal(schedule, p, m, v)
    tp_comm  the layer's TP collectives on s/cp tokens (1.5x with full recompute) x layers/p
             x m: exposed
    pp_comm  m·v activations and m·v gradients of (s/cp)·b·h/t elements (sequence-parallel
             scatter/gather) sent to a neighbour: exposed
    cp_comm  per layer and microbatch, ring attention's cp - 1 steps forward and backward
             (a key/value pair of (s/cp)·b·h/t elements each way forward; again, plus the
             gradients, backward), each hidden behind one step's attention (4·b·(s/cp)²·h/t
             FLOPs forward, halved by the causal mask, twice that backward): what is left over
    dp_comm  the gradient reduction (over dp·cp GPUs) hides behind the last microbatch's
             backward (2/3 of its compute), per-microbatch ZeRO-2/3 traffic behind each
             microbatch's forward and backward; the ZeRO-1/2 parameter all-gather after the
             step is exposed.
    Links: a group uses NVLink if its GPUs are in one node, else the network (`Cluster.link`).
    """
    lay, m = layout, layout.microbatches
    local = model.seq_len // lay.cp  # tokens of a sequence on one GPU
    tokens = global_batch * model.seq_len
    flops = tokens * hardware_flops_per_token(model.num_params, model.layers, model.hidden,
                                              model.seq_len, lay.recompute)
    compute = flops / (cluster.gpus * cluster.peak_flops * compute_efficiency)
    bubble = compute * bubble_relative_to_ideal(lay.schedule, lay.pp, m, lay.chunks)
    forward_mb, backward_mb = compute / m / 3, 2 * compute / m / 3

    tp_comm = 0.0
    if lay.tp > 1:
        alpha, beta = cluster.link(lay.tp)
        layer = tensor_parallel_traffic(local, lay.micro_batch, model.hidden, lay.tp,
                                        lay.sequence_parallel)
        per_layer = sum(c.count * collective_time(c.op, c.nbytes, c.group, alpha, beta)
                        for c in layer.collectives)
        repeats = 1.5 if lay.recompute == "full" else 1.0
        tp_comm = per_layer * repeats * model.layers / lay.pp * m

    pp_comm = 0.0
    if lay.pp > 1:
        alpha, beta = cluster.link(lay.tp * lay.cp * lay.dp * lay.pp)
        sends = pipeline_traffic(local, lay.micro_batch, model.hidden, m, lay.chunks)
        pp_comm = sum(c.count * collective_time("send", c.nbytes / lay.tp, 2, alpha, beta)
                      for c in sends.collectives)

    cp_comm = 0.0
    if lay.cp > 1:
        alpha, beta = cluster.link(lay.tp * lay.cp)
        ring = ring_attention_traffic(model.seq_len, lay.micro_batch, model.hidden // lay.tp,
                                      lay.cp)
        step_bytes = ring.collectives[0].nbytes  # one key/value pair
        transfer = collective_time("send", step_bytes, 2, alpha, beta)
        step_flops = 2 * lay.micro_batch * local * local * model.hidden / lay.tp  # causal
        attention = step_flops / (cluster.peak_flops * compute_efficiency)
        # forward: one transfer per step; backward: two (blocks and gradients), twice the work
        cp_comm = 3 * (lay.cp - 1) * max(0.0, transfer - attention) * model.layers / lay.pp * m

    dp_comm = 0.0
    if lay.dp * lay.cp > 1:
        alpha, beta = cluster.link(lay.tp * lay.cp * lay.dp)
        traffic = data_parallel_traffic(model.num_params / (lay.tp * lay.pp), lay.dp * lay.cp,
                                        lay.zero_stage, microbatches=m)
        t = [collective_time(c.op, c.nbytes, c.group, alpha, beta) for c in traffic.collectives]
        if lay.zero_stage == 0:
            dp_comm = max(0.0, t[0] - backward_mb)
        elif lay.zero_stage == 1:
            dp_comm = max(0.0, t[0] - backward_mb) + t[1]
        elif lay.zero_stage == 2:
            dp_comm = m * max(0.0, t[0] - backward_mb) + t[1]
        else:
            dp_comm = m * (max(0.0, t[0] - forward_mb) + max(0.0, t[1] + t[2] - backward_mb))
    offload = 0.0
    if lay.offload is not None:  # the last microbatch's backward hides the gradients' way out
        parts = offload_step_time(
            model.num_params / (lay.tp * lay.pp), lay.dp, compute / m, lay.offload,
            cluster.pcie_bandwidth, cluster.host_optimizer_throughput,
            cluster.nvme_read_bandwidth, cluster.nvme_write_bandwidth)
        offload = parts.total - parts.compute
    return StepTime(compute, bubble, tp_comm, pp_comm, dp_comm, cp_comm, offload)


def check_rules(layout: Layout, model: Model, cluster: Cluster,
                global_batch: int) -> list[Reason]:
    """The rules a layout breaks, before looking at memory."""
    lay, reasons = layout, []
    if model.heads % lay.tp:
        reasons.append(Reason("tp-heads", f"TP={lay.tp} does not divide heads={model.heads}: "
                                          "each TP rank needs whole heads"))
    if lay.tp > cluster.gpus_per_node:
        ratio = cluster.intra_node_bandwidth / cluster.inter_node_bandwidth
        reasons.append(Reason(
            "tp-crosses-nodes",
            f"TP={lay.tp} crosses nodes: a TP group is larger than a node "
            f"({cluster.gpus_per_node} GPUs), so its 4 collectives per layer per microbatch, "
            f"on the critical path, would run over the network, {ratio:.0f}x slower than "
            "NVLink"))
    if lay.tp > 1 and model.seq_len % (lay.tp * lay.cp):
        reasons.append(Reason("tp-seq", f"TP={lay.tp} does not divide seq_len={model.seq_len}"
                                        + (f"/CP={lay.cp}" if lay.cp > 1 else "")
                                        + ": sequence parallelism splits the sequence"))
    if lay.cp > 1 and model.seq_len % (2 * lay.cp):
        reasons.append(Reason("cp-seq", f"2·CP={2 * lay.cp} does not divide seq_len="
                                        f"{model.seq_len}: the zigzag layout cuts each sequence "
                                        "into 2·cp chunks"))
    if model.layers % (lay.pp * lay.chunks):
        what = f"PP={lay.pp} x v={lay.chunks}" if lay.chunks > 1 else f"PP={lay.pp}"
        reasons.append(Reason("pp-layers", f"{what} does not divide layers={model.layers}: "
                                           "stages need equal numbers of layers"))
    if global_batch % (lay.dp * lay.micro_batch):
        reasons.append(Reason(
            "batch", f"global batch {global_batch} is not a multiple of DP x b = "
                     f"{lay.dp} x {lay.micro_batch}"))
    elif lay.schedule == "interleaved" and lay.microbatches % lay.pp:
        reasons.append(Reason(
            "m-multiple-of-p", f"m={lay.microbatches} is not a multiple of p={lay.pp}: the "
                               "interleaved schedule runs microbatches in groups of p"))
    if lay.offload is not None and cluster.host_optimizer_throughput is None:
        reasons.append(Reason(
            "offload-unmeasured", f"offload={lay.offload} needs the host's optimizer rate: set "
                                  "Cluster(host_optimizer_throughput=...), measured by "
                                  "minidist.parallel.host_optimizer.measure_optimizer_throughput"))
    if lay.offload == "nvme" and None in (cluster.nvme_read_bandwidth,
                                          cluster.nvme_write_bandwidth):
        reasons.append(Reason(
            "offload-unmeasured", "offload=nvme needs Cluster(nvme_read_bandwidth=..., "
                                  "nvme_write_bandwidth=...), measured by "
                                  "minidist.parallel.nvme.measure_disk"))
    return reasons


def evaluate(layout: Layout, model: Model, cluster: Cluster, global_batch: int, *,
             usable_memory: float = 0.9, compute_efficiency: float = 0.6,
             enforce_rules: bool = True) -> Evaluation:
    """Memory, step time and the reasons to reject one layout. `enforce_rules=False` skips
    the TP-in-a-node rule, to see what breaking it would cost."""
    reasons = check_rules(layout, model, cluster, global_batch)
    if not enforce_rules:
        reasons = [r for r in reasons if r.rule != "tp-crosses-nodes"]
    memory = time = None
    structural = {"tp-heads", "tp-seq", "cp-seq", "pp-layers", "batch", "m-multiple-of-p",
                  "offload-unmeasured"}
    if not structural & {r.rule for r in reasons}:
        memory = estimate_memory(layout, model)
        time = estimate_time(layout, model, cluster, global_batch, compute_efficiency)
        usable = usable_memory * cluster.gpu_memory
        if memory.total > usable:
            reasons.append(Reason(
                "memory", f"over memory by {(memory.total - usable) / GB:.1f} GB: needs "
                          f"{memory.total / GB:.1f} GB of the {usable / GB:.1f} GB usable per GPU"))
        if memory.host and cluster.host_memory is not None and memory.host > cluster.host_memory:
            reasons.append(Reason(
                "host-memory", f"the offloaded state needs {memory.host / GB:.1f} GB of host "
                               f"memory per GPU, more than its {cluster.host_memory / GB:.1f} GB"))
    tokens = global_batch * model.seq_len
    model_flops = tokens * model_flops_per_token(model.num_params, model.layers, model.hidden,
                                                 model.seq_len)
    return Evaluation(layout, memory, time, tuple(reasons), model_flops,
                      cluster.gpus * cluster.peak_flops)


# --- The search ------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(cluster: Cluster, global_batch: int,
                      micro_batches: tuple[int, ...] = (1, 2, 4, 8),
                      chunks: tuple[int, ...] = (1, 2),
                      context_parallel: tuple[int, ...] = (1,),
                      offload: tuple[str | None, ...] = (None,)) -> list[Layout]:
    """Every tp x pp x dp x cp = gpus (cp from `context_parallel`), ZeRO stage, micro-batch
    size, chunks, recompute and offload tier. ZeRO stages > 0 are only tried with DP·CP > 1
    (with one replica they shard nothing), chunks > 1 only with PP > 1."""
    for tier in offload:
        if tier not in OFFLOAD:
            raise ValueError(f"offload={offload!r}: each must be one of {OFFLOAD}")
    layouts = []
    for tp, pp, cp in itertools.product(_divisors(cluster.gpus), _divisors(cluster.gpus),
                                        context_parallel):
        if cluster.gpus % (tp * pp * cp):
            continue
        dp = cluster.gpus // (tp * pp * cp)
        for zero, b, v, recompute in itertools.product(range(4), micro_batches, chunks,
                                                       RECOMPUTE):
            if (zero and dp * cp == 1) or (v > 1 and pp == 1):
                continue
            m = max(1, global_batch // (dp * b))
            layouts += [Layout(tp, pp, dp, zero, b, m, recompute, v, cp, tier)
                        for tier in offload]
    return layouts


@dataclass
class Plan:
    """Every layout evaluated; `feasible` fastest first."""

    model: Model
    cluster: Cluster
    global_batch: int
    evaluations: list[Evaluation]
    settings: dict = field(default_factory=dict)

    @property
    def feasible(self) -> list[Evaluation]:
        fits = [e for e in self.evaluations if e.fits]
        return sorted(fits, key=lambda e: (e.time.total, e.memory.total))

    @property
    def rejected(self) -> list[Evaluation]:
        return [e for e in self.evaluations if not e.fits]

    @property
    def best(self) -> Evaluation:
        if not self.feasible:
            raise ValueError("no layout fits: see plan.explain() for why")
        return self.feasible[0]

    def evaluate(self, enforce_rules: bool = True, **fields) -> Evaluation:
        """The best layout's evaluation with some fields changed, e.g. `tp=16, dp=4`.
        The number of microbatches follows from dp and micro_batch unless given."""
        layout = replace(self.best.layout, **fields)
        if "microbatches" not in fields:
            m = max(1, self.global_batch // (layout.dp * layout.micro_batch))
            layout = replace(layout, microbatches=m)
        return evaluate(layout, self.model, self.cluster, self.global_batch,
                        enforce_rules=enforce_rules, **self.settings)

    def table(self, rows: int = 10) -> str:
        """The `rows` fastest layouts that fit."""
        header = (f"{'':>3} {'TP':>3} {'PP':>3} {'DP':>3} {'CP':>3} {'ZeRO':>4} {'b':>2} "
                  f"{'m':>4} {'v':>2} {'recompute':>9} {'mem GB':>7} {'step s':>7} "
                  f"{'compute':>7} {'bubble':>6} {'TP com':>6} {'PP com':>6} {'DP com':>6} "
                  f"{'CP com':>6} {'MFU':>5}")
        lines = [header]
        for rank, e in enumerate(self.feasible[:rows], 1):
            lay, t = e.layout, e.time
            lines.append(
                f"{rank:>3} {lay.tp:>3} {lay.pp:>3} {lay.dp:>3} {lay.cp:>3} "
                f"{lay.zero_stage:>4} {lay.micro_batch:>2} {lay.microbatches:>4} "
                f"{lay.chunks:>2} {str(lay.recompute):>9} {e.memory.total / GB:>7.1f} "
                f"{t.total:>7.2f} {t.compute:>7.2f} {t.bubble:>6.2f} {t.tp_comm:>6.2f} "
                f"{t.pp_comm:>6.2f} {t.dp_comm:>6.2f} {t.cp_comm:>6.2f} {e.mfu:>5.1%}")
        return "\n".join(lines)

    def explain(self) -> str:
        """The winner in words, and what each rule rejected."""
        model, cluster = self.model, self.cluster
        lines = [f"{model.num_params / 1e9:.0f}B parameters on {cluster.gpus} GPUs of "
                 f"{cluster.gpu_memory / GB:.0f} GB, {cluster.gpus_per_node} per node, global "
                 f"batch {self.global_batch} x {model.seq_len} tokens: "
                 f"{len(self.feasible)} of {len(self.evaluations)} layouts fit."]
        if self.feasible:
            best = self.best
            m, t = best.memory, best.time
            lines += [
                f"Best: {best.layout}",
                f"  memory per GPU {m.total / GB:.1f} GB = params {m.params / GB:.1f} + grads "
                f"{m.grads / GB:.1f} + optimizer {m.optimizer / GB:.1f} + activations "
                f"{m.activations / GB:.1f}",
                f"  step {t.total:.2f} s = compute {t.compute:.2f} + bubble {t.bubble:.2f} + "
                f"exposed TP {t.tp_comm:.2f} + PP {t.pp_comm:.2f} + DP {t.dp_comm:.2f}"
                + (f" + CP {t.cp_comm:.2f}" if best.layout.cp > 1 else "")
                + f"; predicted MFU {best.mfu:.1%}",
            ]
        counts = Counter(r.rule for e in self.rejected for r in e.reasons)
        examples = {}  # per rule, the layout closest to fitting
        by_memory = sorted(self.rejected, key=lambda e: e.memory.total if e.memory else 0)
        for e in by_memory:
            for r in e.reasons:
                examples.setdefault(r.rule, f"{e.layout}: {r.message}")
        lines.append(f"Rejected {len(self.rejected)} layouts (a layout may break several rules):")
        for rule, count in counts.most_common():
            lines.append(f"  {count:>5} x {rule}: e.g. {examples[rule]}")
        return "\n".join(lines)

    def why(self, **fields) -> str:
        """Why layouts with these field values (e.g. `tp=16`) were or were not chosen."""
        chosen = [e for e in self.evaluations
                  if all(getattr(e.layout, k) == v for k, v in fields.items())]
        what = ", ".join(f"{k}={v}" for k, v in fields.items())
        if not chosen:
            return f"no layout with {what} was enumerated"
        fits = [e for e in chosen if e.fits]
        if fits:
            best = min(fits, key=lambda e: e.time.total)
            rank = self.feasible.index(best) + 1
            return (f"{len(fits)} of {len(chosen)} layouts with {what} fit; the best, "
                    f"{best.layout}, ranks {rank} at {best.time.total:.2f} s per step")
        lines = [f"all {len(chosen)} layouts with {what} are rejected:"]
        by_rule: dict[str, list[Evaluation]] = {}
        for e in chosen:
            for r in e.reasons:
                by_rule.setdefault(r.rule, []).append(e)
        for rule, rejected in sorted(by_rule.items(), key=lambda item: -len(item[1])):
            closest = min(rejected, key=lambda e: e.memory.total if e.memory else 0)
            message = next(str(r) for r in closest.reasons if r.rule == rule)
            lines.append(f"  {len(rejected):>4} x {message}"
                         + (f" (the closest, {closest.layout})" if rule == "memory" else ""))
        return "\n".join(lines)


def plan(model: Model, cluster: Cluster, global_batch: int, *, usable_memory: float = 0.9,
         compute_efficiency: float = 0.6, micro_batches: tuple[int, ...] = (1, 2, 4, 8),
         chunks: tuple[int, ...] = (1, 2), context_parallel: tuple[int, ...] = (1,),
         offload: tuple[str | None, ...] = (None,)) -> Plan:
    """Evaluate every candidate layout of `model` on `cluster` for `global_batch` sequences,
    with context parallelism of each degree in `context_parallel` (1: none) and the optimizer
    state in each tier of `offload` (None: on the GPU).

    `usable_memory`: the share of GPU memory the estimate may fill (the rest is for the
    CUDA context, communication buffers and fragmentation). `compute_efficiency`: the share
    of peak FLOP/s the kernels reach."""
    positive_int(global_batch=global_batch)
    if not 0 < usable_memory <= 1 or not 0 < compute_efficiency <= 1:
        raise ValueError(f"usable_memory={usable_memory}, compute_efficiency="
                         f"{compute_efficiency}: both must be in (0, 1]")
    settings = {"usable_memory": usable_memory, "compute_efficiency": compute_efficiency}
    evaluations = [evaluate(layout, model, cluster, global_batch, **settings)
                   for layout in candidate_layouts(cluster, global_batch, micro_batches, chunks,
                                                   context_parallel, offload)]
    return Plan(model, cluster, global_batch, evaluations, settings)


# --- Rules of thumb, checked against a plan --------------------------------------------------


@dataclass(frozen=True)
class RuleCheck:
    rule: str
    holds: bool
    evidence: str

    def __str__(self) -> str:
        return f"[{'holds' if self.holds else 'FAILS'}] {self.rule}\n    {self.evidence}"


def rules_of_thumb(plan: Plan) -> list[RuleCheck]:
    """Common advice, tested on the plan's best layout and its neighbours."""
    best, model, cluster = plan.best, plan.model, plan.cluster
    lay, checks = best.layout, []

    node = cluster.gpus_per_node
    wide_tp = 2 * node
    if cluster.gpus % (wide_tp * lay.pp) == 0 and model.heads % wide_tp == 0:
        inside = plan.evaluate(tp=node, dp=cluster.gpus // (node * lay.pp))
        across = plan.evaluate(tp=wide_tp, dp=cluster.gpus // (wide_tp * lay.pp),
                               enforce_rules=False)
        checks.append(RuleCheck(
            "Keep tensor parallelism inside a node.", across.time.tp_comm > inside.time.tp_comm,
            f"TP={wide_tp} across nodes: {across.time.tp_comm:.1f} s of exposed TP "
            f"communication per step, against {inside.time.tp_comm:.1f} s for TP={node}."))

    by_tp = {}
    for e in plan.feasible:
        by_tp.setdefault(e.layout.tp, e)
    listing = ", ".join(f"TP={tp}: {e.time.total:.1f} s" for tp, e in sorted(by_tp.items()))
    checks.append(RuleCheck(
        f"Use TP = GPUs per node ({node}) for large models.", lay.tp == node,
        f"Best step time for each TP that fits: {listing}."))

    m = lay.microbatches
    ddp = data_parallel_traffic(model.num_params, cluster.gpus, 0, microbatches=m).volume
    zero3 = data_parallel_traffic(model.num_params, cluster.gpus, 3, microbatches=m).volume
    checks.append(RuleCheck(
        "ZeRO-3 / FSDP costs 1.5x the communication of DDP.", zero3 / ddp == 1.5,
        f"Per step with m={m} microbatches of gradient accumulation, ZeRO-3 moves "
        f"{zero3 / ddp:.1f}x DDP's bytes: it gathers the parameters for every microbatch."))

    layer_mb = activation_bytes(model.seq_len, lay.micro_batch, model.hidden, model.heads,
                                lay.tp, lay.sequence_parallel, lay.recompute)
    stage0 = {p: inflight_microbatches("1f1b", p, max(m, p), 0) * model.layers / p * layer_mb
              for p in (1, 8) if model.layers % p == 0}
    if len(stage0) == 2:
        checks.append(RuleCheck(
            "Pipeline parallelism over p stages cuts activation memory by p.",
            stage0[8] < stage0[1] / 2,
            f"Under 1F1B the first pipeline rank holds p microbatches of L/p layers: "
            f"{stage0[1] / GB:.1f} GB of activations with p=1 and {stage0[8] / GB:.1f} GB with "
            "p=8 (Korthikanti §4.2.3)."))

    flops = {r: hardware_flops_per_token(model.num_params, model.layers, model.hidden,
                                         model.seq_len, r) for r in RECOMPUTE}
    full, selective = flops["full"] / flops[None] - 1, flops["selective"] / flops[None] - 1
    checks.append(RuleCheck(
        "Full recompute costs about a third more compute; selective recompute almost none.",
        abs(full - 1 / 3) < 0.05 and selective < 0.05,
        f"Full: +{full:.1%} FLOPs; selective: +{selective:.1%} (Korthikanti §5). The best "
        f"layout uses recompute={lay.recompute}."))

    pipelined = [e for e in plan.feasible if e.layout.pp > 1
                 and e.layout.microbatches >= 4 * e.layout.pp]
    if pipelined:
        worst = max(pipelined, key=lambda e: e.time.bubble / e.time.total)
        share = worst.time.bubble / worst.time.total
        checks.append(RuleCheck(
            "With m >= 4p microbatches the pipeline bubble is small (< 20% of the step).",
            share < 0.2,
            f"The largest bubble among {len(pipelined)} such layouts that fit: {share:.1%} of "
            f"the step ({worst.layout})."))
    return checks
