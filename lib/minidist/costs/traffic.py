"""What each parallelism sends per step, predicted from sizes (no torch needed).

A `Collective` is one record, whether predicted here from sizes or counted on real ranks by
`minidist.communication.counting.count_traffic()`: `count` runs of collective `op` on a tensor
of `nbytes` bytes over a group of `group` ranks. `Traffic` adds records up two ways: `volume`,
the bytes per rank as N → ∞ that ZeRO §7 counts (2S per all-reduce), and `bytes_sent`, with the
ring's (N-1)/N factors (`minidist.costs.cost`).

Sources:
  ZeRO       Rajbhandari et al., SC 2020 (§7 communication).
  Megatron   Shoeybi et al., "Megatron-LM", 2019 (§3, tensor parallel).
  Korthikanti Korthikanti et al., MLSys 2023 (§4.2.2, sequence parallel).
  Narayanan  Narayanan et al., SC 2021 (§2.2 and §3, pipeline parallel).
  Li         Li et al., "Scaling Distributed Machine Learning with the Parameter Server",
             OSDI 2014.
  Liu        Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers", 2023.
  Jacobs     Jacobs et al., "DeepSpeed Ulysses", 2023.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minidist.core._checks import one_of, positive, positive_int
from minidist.costs.cost import ring_bytes_sent

__all__ = [
    "Collective", "Traffic", "data_parallel_traffic",
    "tensor_parallel_traffic", "pipeline_traffic", "ring_attention_traffic", "ulysses_traffic",
    "mesh_traffic", "parameter_server_traffic",
]


@dataclass(frozen=True)
class Collective:
    """`count` runs of collective `op` on a tensor of `nbytes` bytes over `group` ranks;
    `when` says where in the step (e.g. "forward", "gradients, after backward")."""

    op: str  # "all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "all_to_all",
    # "shift" (every rank sends to its right neighbour at once)
    nbytes: float  # the full tensor reduced or produced (the message, for send and shift;
    # for all_to_all, what this rank sends to the other ranks)
    group: int  # ranks in the group (2 for a point-to-point send)
    count: int = 1
    when: str = ""
    # Counted records only: the group's global ranks, who took part. Not compared: a
    # prediction equals a count whatever ranks it ran on.
    ranks: tuple[int, ...] = field(default=(), compare=False)

    @property
    def bytes_sent(self) -> float:
        """Bytes each rank sends: ring algorithms (minidist.costs.cost), or the message for send,
        shift and all_to_all. A broadcast has none: its root sends more than the other ranks."""
        if self.op in ("send", "shift", "all_to_all"):
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
    positive(num_params=num_params)
    positive_int(dp=dp, bytes_per_element=bytes_per_element, microbatches=microbatches)
    one_of("zero_stage", zero_stage, (0, 1, 2, 3))
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
    positive_int(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, tp=tp,
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
    positive_int(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden,
                  microbatches=microbatches, chunks=chunks, bytes_per_element=bytes_per_element)
    size = seq_len * micro_batch * hidden * bytes_per_element
    n = microbatches * chunks
    return Traffic((Collective("send", size, 2, n, "activations, forward"),
                    Collective("send", size, 2, n, "gradients, backward")))


def _check_context(seq_len: int, micro_batch: int, hidden: int, cp: int,
                   bytes_per_element: int) -> None:
    positive_int(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, cp=cp,
                 bytes_per_element=bytes_per_element)
    if seq_len % cp:
        raise ValueError(f"seq_len={seq_len} is not divisible by cp={cp}: each rank holds s/cp "
                         f"tokens")


def ring_attention_traffic(seq_len: int, micro_batch: int, hidden: int, cp: int,
                           bytes_per_element: int = 2) -> Traffic:
    """What one rank sends for one ring attention (Liu §3), forward and backward, over cp ranks.

    Each rank holds s/cp tokens; its key block and its value block are b·(s/cp)·hidden
    elements each (`hidden`: heads x head_dim of the keys this rank attends with, h/t under
    tensor parallelism). Forward, the key/value pair goes cp - 1 steps around the ring (the
    last block is used where it arrives). Backward, the pair goes around again, cp - 1 steps,
    and the key/value gradients travel with their blocks, cp steps: the last brings each
    block's finished gradient home. 2(cp-1) + 2(cp-1) + 2cp blocks in all, about 4·b·s·hidden
    elements per rank whatever cp is: ring bytes per rank do not shrink as cp grows."""
    _check_context(seq_len, micro_batch, hidden, cp, bytes_per_element)
    if cp == 1:
        return Traffic(())
    pair = 2 * micro_batch * (seq_len // cp) * hidden * bytes_per_element
    return Traffic((Collective("shift", pair, cp, cp - 1, "forward, key/value blocks"),
                    Collective("shift", pair, cp, cp - 1, "backward, key/value blocks"),
                    Collective("shift", pair, cp, cp, "backward, key/value gradients")))


def ulysses_traffic(seq_len: int, micro_batch: int, hidden: int, cp: int,
                    bytes_per_element: int = 2) -> Traffic:
    """What one rank sends for one DeepSpeed-Ulysses attention (Jacobs §3), forward and
    backward, over cp ranks.

    q, k and v (b·(s/cp)·hidden elements each on a rank) go from sequence-sharded to
    head-sharded by one all-to-all each, and the output back by a fourth; backward runs the
    four the other way. An all-to-all keeps 1/cp of the tensor and sends the rest: (cp-1)/cp
    of it per rank, so Ulysses' bytes per rank shrink as 1/cp (Jacobs: a constant volume per
    link when s and cp grow together)."""
    _check_context(seq_len, micro_batch, hidden, cp, bytes_per_element)
    if hidden % cp:
        raise ValueError(f"hidden={hidden} is not divisible by cp={cp}: Ulysses gives each rank "
                         f"1/cp of the heads")
    if cp == 1:
        return Traffic(())
    sent = micro_batch * (seq_len // cp) * (hidden // cp) * (cp - 1) * bytes_per_element
    return Traffic((Collective("all_to_all", sent, cp, 4, "forward, q, k, v to heads, output back"),
                    Collective("all_to_all", sent, cp, 4, "backward, the same four reversed")))


def mesh_traffic(*, stage: int, pp: int, dp: int, tp: int, blocks: int, num_params: float,
                 param_tensors: int, seq_len: int, micro_batch: int, hidden: int,
                 microbatches: int, zero_stage: int = 1, sequence_parallel: bool = False,
                 bytes_per_element: int = 4, cp: int = 1,
                 cp_attention: str = "ring") -> dict[str, Traffic]:
    """What one rank of a dp·pp·cp·tp mesh sends in one step, per mesh dimension: the formulas
    above, applied to the rank's share of a transformer, plus the few messages minidist's
    implementation (`minidist.parallel.parallelize`) adds to them. With cp > 1 each rank holds s/cp
    of every sequence (`seq_len` is the whole sequence), which is what tp and pp then send.

    The rank sits on pipeline stage `stage` of `pp` and holds `blocks` transformer blocks,
    `num_params` parameters in `param_tensors` tensors. A dimension of size 1 sends nothing.

    tp  per block and microbatch, `tensor_parallel_traffic` (2 all-reduces of b·s·h forward,
        2 backward). With sequence parallel: its all-gathers and reduce-scatters, plus 2
        all-gathers in backward (the attention and MLP inputs are gathered again rather than
        stored), 6 all-reduces of h (gradients of the two LayerNorms and two row-parallel
        biases, which see only a slice of the sequence), one all-gather backward where the
        embeddings enter the split sequence (first stage) and one forward where it is
        gathered for the LM head (last stage).
    pp  per microbatch, a b·s·h activation to the next stage (all but the last stage) and a
        gradient to the previous one (all but the first); b·(s/t)·h with sequence parallel,
        where each TP rank sends its slice.
    dp  `data_parallel_traffic` of this rank's parameters: ≈ 2Ψ/(tp·pp) per rank. ZeRO-1 first
        sums which parameters have a gradient (one int32 per tensor, minidist.parallel.zero).
    cp  per block and microbatch, `ring_attention_traffic` (or `ulysses_traffic`, with
        cp_attention="ulysses") of the rank's h/t attention width; then one all-reduce of the
        rank's gradients over cp (its parameters are the same on every cp rank, its tokens
        are not).
    """
    positive_int(pp=pp, dp=dp, tp=tp, param_tensors=param_tensors, seq_len=seq_len,
                 micro_batch=micro_batch, hidden=hidden, microbatches=microbatches,
                 bytes_per_element=bytes_per_element, cp=cp)
    if seq_len % cp or hidden % tp:
        raise ValueError(f"seq_len={seq_len} and hidden={hidden} must be divisible by cp={cp} "
                         f"and tp={tp}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage}: must be in 0..{pp - 1}")
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
        raise ValueError(f"blocks={blocks!r}: must be a whole number >= 0")
    m, size = microbatches, micro_batch * (seq_len // cp) * hidden * bytes_per_element
    sequence_parallel = sequence_parallel and tp > 1
    tensor: list[Collective] = []
    if tp > 1:
        layer = tensor_parallel_traffic(seq_len // cp, micro_batch, hidden, tp,
                                        sequence_parallel, bytes_per_element)
        tensor = [Collective(c.op, c.nbytes, tp, c.count * blocks * m, c.when)
                  for c in layer.collectives]
        if sequence_parallel:
            tensor += [
                Collective("all_gather", size, tp, 2 * blocks * m,
                           "backward, attention and MLP inputs gathered again"),
                Collective("all_reduce", hidden * bytes_per_element, tp, 6 * blocks * m,
                           "backward, gradients of norms and row-parallel biases"),
            ]
            if stage == 0:
                tensor.append(Collective("all_gather", size, tp, m,
                                         "backward, into the split sequence"))
            if stage == pp - 1:
                tensor.append(Collective("all_gather", size, tp, m,
                                         "forward, out of the split sequence"))
    boundary = size // tp if sequence_parallel else size
    pipeline = []
    if stage < pp - 1:
        pipeline.append(Collective("send", boundary, 2, m, "activations, forward"))
    if stage > 0:
        pipeline.append(Collective("send", boundary, 2, m, "gradients, backward"))
    data: tuple[Collective, ...] = ()
    if dp > 1:
        data = data_parallel_traffic(num_params, dp, zero_stage, bytes_per_element).collectives
        if zero_stage == 1:
            data += (Collective("all_reduce", 4 * param_tensors, dp, 1,
                                "which parameters have gradients"),)
    context: list[Collective] = []
    if cp > 1:
        one_of("cp_attention", cp_attention, ("ring", "ulysses"))
        formula = ring_attention_traffic if cp_attention == "ring" else ulysses_traffic
        layer = formula(seq_len, micro_batch, hidden // tp, cp, bytes_per_element)
        context = [Collective(c.op, c.nbytes, cp, c.count * blocks * m, c.when)
                   for c in layer.collectives]
        context.append(Collective("all_reduce", num_params * bytes_per_element, cp, 1,
                                  "gradients, over cp"))
    return {"tp": Traffic(tuple(tensor)), "pp": Traffic(tuple(pipeline)), "dp": Traffic(data),
            "cp": Traffic(tuple(context))}


def parameter_server_traffic(nbytes: float, workers: int, servers: int = 1) -> dict[str, Traffic]:
    """What one synchronous parameter-server step sends, per role: {"worker": ..., "server": ...}.

    Li et al. 2014: every worker pushes its `nbytes` gradient, cut into one shard per server,
    and each server sends its parameter shard back to each worker (what that adds up to per
    role is Lab 10's first prediction).
    """
    positive(nbytes=nbytes)
    positive_int(workers=workers, servers=servers)
    shard = nbytes / servers
    pushes = Collective("send", shard, 2, servers, "gradient shard, to each server")
    pulls = Collective("send", shard, 2, workers, "parameter shard, to each worker")
    return {"worker": Traffic((pushes,)), "server": Traffic((pulls,))}
