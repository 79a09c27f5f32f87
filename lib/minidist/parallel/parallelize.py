"""3D and 4D parallelism: the course's TinyGPT trained with TP, PP, DP/ZeRO and context
parallelism at once, on a Mesh.

    mesh = Mesh(pp=2, dp=2, tp=2)                       # 8 ranks; or Mesh(pp=1, dp=2, cp=2, tp=2)
    torch.manual_seed(0)                                # the same model on every rank
    model = TinyGPT(vocab=32, hidden=16, heads=4, layers=4, max_seq=8)
    parallel = parallelize(model, mesh, lambda params: torch.optim.AdamW(params, lr=1e-2),
                           microbatches=2)
    loss = parallel.step(ids, targets)                  # the whole batch on every rank
    parallel.full_state_dict()                          # model.state_dict()'s keys, unsharded

Each dimension is one of the course's pieces, on the mesh's group for it:

    pp  the blocks are cut into pp stages of consecutive blocks (the first stage also holds the
        embeddings, the last the final norm and LM head); `minidist.parallel.pipeline_exec` runs the
        schedule ("gpipe" or "1f1b") over the "pp" group, with the step's DP slice of the
        batch cut into `microbatches`
    tp  inside a stage, every block is `tensor_parallel.ParallelTransformerBlock` on the "tp"
        group (with `sequence_parallel`, the activations between blocks, and those sent from
        stage to stage, are split along the sequence); embeddings, final norm and head stay
        whole on every TP rank
    dp  zero_stage=0: the stage is wrapped in the course's `ddp.DistributedDataParallel` on the
        "dp" group; its bucketed all-reduces overlap each stage's last backward (the executor
        turns gradient sync off for the others). zero_stage=1: `zero.ZeroOptimizer` on the
        "dp" group reduce-scatters after the pipeline and all-gathers after the step
    cp  (if the mesh has it) each rank of the "cp" group holds 2 of the 2·cp zigzag chunks of
        every sequence (`minidist.parallel.context_parallel`): embeddings, norms, MLPs and the head
        work on its own tokens, and every block's attention core is ring attention (or, with
        cp_attention="ulysses", DeepSpeed-Ulysses) over the group. The parameters are the same
        on every cp rank and their tokens are not, so the gradients are averaged over cp (one
        all-reduce after the pipeline, before the DP step); every cp rank has as many tokens,
        so that average is the gradient of the whole batch's mean loss

A dimension of size 1 (or missing from the mesh) sends nothing: plain blocks when tp = 1, a
plain optimizer when dp = 1. `step` also counts what each dimension sent (`traffic`, told apart
by the group each collective ran on), and `expected_traffic()` gives the formulas of
`minidist.costs.traffic.mesh_traffic` for the same rank, so the two can be compared.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from minidist.communication import collectives, counting
from minidist.communication.comm import chunk_bounds
from minidist.communication.mesh import Mesh
from minidist.core._checks import one_of, positive_int
from minidist.core.flat import copy_back, flatten
from minidist.costs import traffic
from minidist.parallel import pipeline, pipeline_exec
from minidist.parallel.context_parallel import ContextParallelCore, positions
from minidist.parallel.ddp import DistributedDataParallel, broadcast_parameters
from minidist.parallel.models import TinyGPT, lm_loss
from minidist.parallel.tensor_parallel import (
    SEQUENCE_DIM,
    GatherAlong,
    ParallelTransformerBlock,
    SplitAlong,
)
from minidist.parallel.zero import ZeroOptimizer

__all__ = ["SCHEDULES", "TinyGPTStage", "Parallel3D", "parallelize"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SCHEDULES = ("gpipe", "1f1b")
"""Schedules whose backward is one pass (the split backward of zero-bubble schedules would run
the tensor-parallel collectives twice)."""
LAYOUT = "zigzag"
"""How a cp rank holds its tokens: balanced causal work (`minidist.parallel.context_parallel`)."""
_PIPELINE_WAIT_S = 120.0
"""How long a pipeline rank waits for a message before it reports a deadlock: generous, since
8 ranks on a 2-core laptop take turns."""


class TinyGPTStage(nn.Module):
    """The part of TinyGPT one pipeline rank holds: maybe the embeddings, some blocks, maybe
    the final norm and LM head. Input: token ids (first stage) or the previous stage's
    activation; output: logits (last stage) or the activation for the next stage. With a
    `cp_group` all of them are this cp rank's tokens (its zigzag chunks), and every block
    attends over the group by `cp_attention`."""

    def __init__(self, model: TinyGPT, first: int, end: int, is_first: bool, is_last: bool,
                 tp_group: dist.ProcessGroup | None, sequence_parallel: bool,
                 cp_group: dist.ProcessGroup | None = None, cp_attention: str = "ring"):
        super().__init__()
        self.first_block, self.is_first, self.is_last = first, is_first, is_last
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.cp_group = cp_group
        self.embeddings = copy.deepcopy(model.layers()[0]) if is_first else None
        self.blocks = nn.ModuleList(
            copy.deepcopy(block) if tp_group is None else ParallelTransformerBlock(
                block.attn.q_proj.in_features, block.attn.heads, block.mlp.fc1.out_features,
                group=tp_group, sequence_parallel=sequence_parallel).load_from(block)
            for block in model.blocks[first:end])
        self.norm = copy.deepcopy(model.norm) if is_last else None
        self.head = copy.deepcopy(model.head) if is_last else None
        if cp_group is not None:
            for block in self.blocks:
                block.attn.core = ContextParallelCore(cp_group, layout=LAYOUT,
                                                      method=cp_attention)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            if self.cp_group is None:
                x = self.embeddings(x)
            else:  # this cp rank's tokens, with their positions in the whole sequence
                cp, cp_rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
                where = positions(x.shape[1] * cp, cp_rank, cp, layout=LAYOUT).to(x.device)
                x = self.embeddings.tok_emb(x) + self.embeddings.pos_emb(where)
            if self.sequence_parallel:
                x = SplitAlong.apply(x, SEQUENCE_DIM, self.tp_group)
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            if self.sequence_parallel:
                x = GatherAlong.apply(x, SEQUENCE_DIM, self.tp_group)
            x = self.head(self.norm(x))
        return x

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters, unsharded, under TinyGPT's state_dict keys."""
        state: dict[str, torch.Tensor] = {}
        if self.is_first:
            state |= {key: value.clone() for key, value in self.embeddings.state_dict().items()}
        for index, block in enumerate(self.blocks, start=self.first_block):
            block_state = (block.state_dict() if self.tp_group is None
                           else block.full_state_dict())
            state |= {f"blocks.{index}.{key}": value.clone() for key, value in
                      block_state.items()}
        if self.is_last:
            state |= {f"norm.{key}": value.clone() for key, value in self.norm.state_dict().items()}
            state |= {f"head.{key}": value.clone() for key, value in self.head.state_dict().items()}
        return state


class Parallel3D:
    """One rank's part of a TinyGPT trained on a dp·pp·tp (or dp·pp·cp·tp) mesh (see the
    module doc); made by `parallelize`.

    `stage` is this rank's TinyGPTStage, `module` what the pipeline runs (the stage, in DDP
    under zero_stage=0 with dp > 1), `optimizer` its optimizer (a ZeroOptimizer under ZeRO-1),
    `schedule` the pipeline schedule. After each `step`, `traffic` maps "tp", "pp", "dp" and
    "cp" to what this rank sent along that dimension (a `minidist.costs.traffic.Traffic`: the
    collectives on the dimension's group; for "pp", the point-to-point sends to its ranks);
    `expected_traffic()` holds the formulas for it.

    Why one unit of about 130 lines: a step, and the formulas its traffic is checked against,
    read side by side."""

    def __init__(self, model: TinyGPT, mesh: Mesh, optimizer_factory: OptimizerFactory,
                 microbatches: int, *, schedule: str, zero_stage: int, sequence_parallel: bool,
                 cp_attention: str = "ring"):
        self.mesh, self.microbatches, self.zero_stage = mesh, microbatches, zero_stage
        self.cp_attention = cp_attention
        dp, pp, tp, cp = (mesh.size(dim) for dim in ("dp", "pp", "tp", "cp"))
        self.sequence_parallel = sequence_parallel and tp > 1
        self.hidden, self.max_seq = model.tok_emb.embedding_dim, model.max_seq
        self.stage_index = mesh.coord("pp")
        self.schedule = pipeline.schedule(schedule, ranks=pp, microbatches=microbatches)
        first, end = chunk_bounds(len(model.blocks), pp)[self.stage_index]
        self.stage = TinyGPTStage(
            model, first, end, is_first=self.stage_index == 0,
            is_last=self.stage_index == pp - 1,
            tp_group=mesh.group("tp") if tp > 1 else None,
            sequence_parallel=self.sequence_parallel,
            cp_group=mesh.group("cp") if cp > 1 else None, cp_attention=cp_attention)
        self.module: nn.Module = self.stage
        params = list(self.stage.parameters())
        if dp > 1 and zero_stage == 0:  # DDP copies the first replica's weights to all
            self.module = DistributedDataParallel(self.stage, group=mesh.group("dp"),
                                                  broadcast_buffers=False)
            self.optimizer = optimizer_factory(params)
        elif dp > 1:
            broadcast_parameters(self.stage, mesh.group("dp"))
            self.optimizer = ZeroOptimizer(params, optimizer_factory, stage=1,
                                           group=mesh.group("dp"))
        else:
            self.optimizer = optimizer_factory(params)
        self.traffic: dict[str, traffic.Traffic] = {}
        self._shape: tuple[int, int] | None = None  # (micro_batch, seq_len) of the last step

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on the global batch `ids`, `targets` [batch, seq] (the same on
        every rank): this rank trains on its DP slice, cut into microbatches. Returns the mean
        loss over the whole batch, the same number on every rank."""
        dp, cp = self.mesh.size("dp"), self.mesh.size("cp")
        batch, seq = _check_batch(ids, targets, dp, self.microbatches,
                                  self.mesh.size("tp") if self.sequence_parallel else 1,
                                  self.max_seq, cp)
        self._shape = (batch // (dp * self.microbatches), seq)
        mine = slice(self.mesh.coord("dp") * batch // dp, (self.mesh.coord("dp") + 1) * batch // dp)
        ours = positions(seq, self.mesh.coord("cp"), cp, layout=LAYOUT)  # this cp rank's tokens
        self.optimizer.zero_grad()
        with counting.count_traffic() as log:
            trace = pipeline_exec.execute(
                self.schedule, {self.stage_index: self.module},
                ids[mine][:, ours] if self.stage.is_first else None,
                targets[mine][:, ours] if self.stage.is_last else None,
                lm_loss, timeout=_PIPELINE_WAIT_S,
                group=self.mesh.group("pp"))
            if cp > 1:
                self._average_gradients_over_cp()
            self.optimizer.step()
        self.traffic = self._per_dimension(log)
        return self._global_mean(trace.losses)

    def _average_gradients_over_cp(self) -> None:
        grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
        flat = flatten(grads)
        collectives.all_reduce(flat, op="avg", group=self.mesh.group("cp"),
                               when="gradients, over cp")
        copy_back(flat, grads)

    def _per_dimension(self, log: counting.TrafficLog) -> dict[str, traffic.Traffic]:
        """The step's records by the mesh dimension whose group they ran on; the pipeline's
        point-to-point sends (all one size: an activation or its gradient) as "pp"."""
        per_dim = {}
        for dim in ("tp", "dp", "cp"):
            ranks = tuple(self.mesh.ranks(dim))
            per_dim[dim] = traffic.Traffic(tuple(
                c for c in log.collectives if self.mesh.size(dim) > 1 and c.ranks == ranks))
        stage_ranks = set(self.mesh.ranks("pp"))
        sends = [nbytes for peer, nbytes in log.sends if peer in stage_ranks]
        per_dim["pp"] = traffic.Traffic((traffic.Collective(
            "send", sum(sends) // len(sends), 2, len(sends), "activations and gradients"),)
            if sends else ())
        return per_dim

    def _global_mean(self, losses: list[float]) -> float:
        """The mean loss over the batch: the last stage's microbatch losses, summed over the
        DP replicas and cp ranks (one TP rank each; every cp rank has as many tokens), over
        every rank."""
        counts = self.stage.is_last and self.mesh.coord("tp") == 0
        total = torch.tensor([sum(losses) if counts else 0.0], dtype=torch.float64)
        collectives.all_reduce(total, when="loss, for reporting")
        return total.item() / (self.mesh.size("dp") * self.mesh.size("cp") * self.microbatches)

    def expected_traffic(self) -> dict[str, traffic.Traffic]:
        """`minidist.costs.traffic.mesh_traffic` for this rank and the last step's batch: what
        `traffic` should hold, per dimension."""
        if self._shape is None:
            raise RuntimeError("expected_traffic() needs the batch shape: run step() first")
        params = list(self.stage.parameters())
        micro_batch, seq = self._shape
        element = params[0].element_size()
        pp, dp, tp, cp = (self.mesh.size(dim) for dim in ("pp", "dp", "tp", "cp"))
        return traffic.mesh_traffic(
            stage=self.stage_index, pp=pp, dp=dp, tp=tp,
            blocks=len(self.stage.blocks), num_params=sum(p.numel() for p in params),
            param_tensors=len(params), seq_len=seq, micro_batch=micro_batch, hidden=self.hidden,
            microbatches=self.microbatches, zero_stage=self.zero_stage,
            sequence_parallel=self.sequence_parallel, bytes_per_element=element, cp=cp,
            cp_attention=self.cp_attention)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, unsharded, under the single model's state_dict keys,
        on every rank (gathered over the tp, then the pp group; cp ranks hold the same)."""
        mine = self.stage.full_state_dict()
        if self.mesh.size("pp") == 1:
            return mine
        stages = collectives.all_gather_object(mine, group=self.mesh.group("pp"),
                                               when="full state dict")
        return {key: value for stage in stages for key, value in stage.items()}


def _check_batch(ids: torch.Tensor, targets: torch.Tensor, dp: int, microbatches: int,
                 sequence_split: int, max_seq: int, cp: int = 1) -> tuple[int, int]:
    if ids.dim() != 2 or ids.shape != targets.shape:
        raise ValueError(f"ids {tuple(ids.shape)} and targets {tuple(targets.shape)} must both "
                         f"be [batch, seq]")
    batch, seq = ids.shape
    if seq > max_seq:
        raise ValueError(f"sequence length {seq} exceeds the model's max_seq={max_seq}: use "
                         f"shorter sequences or a model with a larger max_seq")
    if batch % (dp * microbatches):
        raise ValueError(
            f"global batch {batch} is not divisible by dp·microbatches = {dp}·{microbatches} = "
            f"{dp * microbatches}: every DP rank needs the same number of equal microbatches; "
            f"use a batch that is a multiple of {dp * microbatches}")
    if cp > 1 and seq % (2 * cp):
        raise ValueError(f"sequence length {seq} is not divisible by 2·cp = {2 * cp}: context "
                         f"parallelism cuts every sequence into 2·cp zigzag chunks; use a "
                         f"multiple of {2 * cp}")
    if (seq // cp) % sequence_split:
        raise ValueError(f"sequence length {seq} is not divisible by tp={sequence_split}"
                         + (f" times cp={cp}" if cp > 1 else "") + ": sequence parallel splits "
                         f"each rank's tokens across the TP ranks; use a multiple of "
                         f"{sequence_split * cp} or sequence_parallel=False")
    return batch, seq


def parallelize(model: TinyGPT, mesh: Mesh, optimizer_factory: OptimizerFactory,
                microbatches: int, *, schedule: str = "1f1b", zero_stage: int = 1,
                sequence_parallel: bool = False, cp_attention: str = "ring") -> Parallel3D:
    """Shard `model` (the same TinyGPT on every rank: seed it) over `mesh` and return this
    rank's `Parallel3D`. `optimizer_factory(params)` builds the optimizer, e.g.
    `lambda params: torch.optim.AdamW(params, lr=1e-3)`; with zero_stage=1 each DP rank
    updates 1/dp of every parameter. A "cp" dimension in the mesh adds context parallelism,
    by "ring" attention or "ulysses". Every argument is checked before any rank
    communicates."""
    if not isinstance(model, TinyGPT):
        raise ValueError(f"parallelize takes a minidist.parallel.models.TinyGPT, got "
                         f"{type(model).__name__}")
    positive_int(microbatches=microbatches)
    one_of("schedule", schedule, SCHEDULES)
    if not {"pp", "dp", "tp"} <= set(mesh.dims) or not set(mesh.dims) <= {"pp", "dp", "cp", "tp"}:
        raise ValueError(f"parallelize needs a mesh with pp, dp and tp dimensions (size 1 is "
                         f"fine), and maybe cp, got one with {', '.join(mesh.dims)}: e.g. "
                         f"Mesh(pp=1, dp={mesh.size('dp')}, tp={mesh.size('tp')})")
    one_of("zero_stage", zero_stage, (0, 1))
    one_of("cp_attention", cp_attention, ("ring", "ulysses"))
    tp, pp, cp = mesh.size("tp"), mesh.size("pp"), mesh.size("cp")
    block = model.blocks[0]
    heads, ffn = block.attn.heads, block.mlp.fc1.out_features
    if heads % tp:
        raise ValueError(f"heads={heads} is not divisible by tp={tp}: each TP rank holds whole "
                         f"heads; use a tp that divides {heads}")
    if ffn % tp:
        raise ValueError(f"ffn_hidden={ffn} is not divisible by tp={tp}: use a tp that "
                         f"divides {ffn}")
    if cp_attention == "ulysses" and (heads // tp) % cp:
        raise ValueError(f"heads={heads} over tp={tp} leaves {heads // tp} heads per TP rank, "
                         f"not divisible by cp={cp}: Ulysses gives each cp rank whole heads; "
                         f"use cp_attention='ring' or a cp that divides {heads // tp}")
    if len(model.blocks) < pp:
        raise ValueError(f"layers={len(model.blocks)} is fewer than pp={pp} stages: every "
                         f"stage needs a block; use pp <= {len(model.blocks)} or more layers")
    return Parallel3D(model, mesh, optimizer_factory, microbatches, schedule=schedule,
                      zero_stage=zero_stage, sequence_parallel=sequence_parallel,
                      cp_attention=cp_attention)
