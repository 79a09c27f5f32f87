"""Fakes of Lab 14's two exercises: the pieces (my_pieces.py) and the job (my_job.py).

Each is the solution's file with one mechanism taken out, so that it still runs and still
gets most numbers right: a job that loads the pieces and trains the whole model on every rank
without them, one whose pipeline runs every stage everywhere, a resume that replays from step
0, a checkpoint of per-rank torch.save files; pieces that hard-code the lab's case, that
schedule GPipe where 1F1B was asked, that only call minidist's. The fakes are
made from the solution notebook's own cells, each edit checked to apply, so that a fake never
silently becomes the solution."""

from __future__ import annotations

import sys
from pathlib import Path

from fakes import Fake, edited, solution_region

_REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_REPO / "lib"))
from minidist.jobs import pieces  # noqa: E402

_JOB = solution_region("14_capstone", "impl-my-job")
_PIECES = solution_region("14_capstone", "impl-pieces")

# Every stage on every rank: no stage boundary, no sends; each replica counts its loss once.
_EVERY_STAGE = (
    ('self.first, self.last = self.coords["pp"] == 0, self.coords["pp"] == config.pp - 1',
     "self.first = self.last = True"),
    ("per_stage = [len(c) for c in torch.arange(config.layers).chunk(config.pp)]",
     "per_stage = [config.layers] * config.pp"),
    ('first = sum(per_stage[:coords["pp"]])', "first = 0"),
    ("self.schedule = self.pp.one_f_one_b(config.pp, config.microbatches)",
     "self.schedule = self.pp.one_f_one_b(1, config.microbatches)"),
    ('losses = self.pp.run_schedule(self.schedule, coords["pp"], self.stage,',
     "losses = self.pp.run_schedule(self.schedule, 0, self.stage,"),
    ("loss = total.item() / (config.dp * config.microbatches)",
     "loss = total.item() / (config.dp * config.microbatches * config.pp)"),
    ('if coords["dp"] != 0 or (kind == "whole" and coords["tp"] != 0):',
     'if coords["dp"] or coords["pp"] or (kind == "whole" and coords["tp"] != 0):'),
)

# The whole layer on every TP rank, its output all-reduced divided by t (red team rt5).
_WHOLE_LAYER = (
    ("""def parallel_mlp(x, fc1, fc2, rank, t):
    x = CopyToParallel.apply(x)
    hidden = F.linear(x, shard_weight(fc1.weight, rank, t, "column"), fc1.bias.chunk(t)[rank])
    partial = F.linear(F.gelu(hidden), shard_weight(fc2.weight, rank, t, "row"))
    return ReduceFromParallel.apply(partial) + fc2.bias
""", """def _f(x, t):
    return CopyToParallel.apply(x) / t + x.detach() * (1 - 1 / t)


def parallel_mlp(x, fc1, fc2, rank, t):
    y = fc2(F.gelu(fc1(_f(x, t)))) - fc2.bias
    return y + (ReduceFromParallel.apply(y.detach() / t) - y.detach()) + fc2.bias
"""),
    ("""    x = CopyToParallel.apply(x)  # one f for q, k and v: they share the input
    q, k, v = (F.linear(x, shard_weight(proj.weight, rank, t, "column"), proj.bias.chunk(t)[rank])
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    heads = attend(q, k, v, attn.heads // t)
    partial = F.linear(heads, shard_weight(attn.out_proj.weight, rank, t, "row"))
    return ReduceFromParallel.apply(partial) + attn.out_proj.bias
""", """    x = _f(x, t)
    y = attn.out_proj(attend(attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.heads))
    y = y - attn.out_proj.bias
    return y + (ReduceFromParallel.apply(y.detach() / t) - y.detach()) + attn.out_proj.bias
"""),
)

# AdamW's moments read from the rank files directly, not through load_range (red team rt6).
_MOMENTS_PAST_LOAD_RANGE = (
    ("\nclass Job", """

import functools


@functools.lru_cache(maxsize=16)  # a rank file read once, not once per tensor
def read_rank_file(path):
    return torch.load(path)


def read_directly(path, name, start, end):  # every rank's part, in rank order
    pieces = json.loads((path / "metadata.json").read_text())["tensors"][name]["pieces"]
    whole = torch.cat([read_rank_file(path / f"rank_{rank}.pt")[name] for rank, _, _ in pieces])
    return whole[start:end].clone()


class Job"""),
    ("flat = world.load_range(path, key + name, start, start + numel)",
     "flat = (read_directly if key else world.load_range)(path, key + name, start, "
     "start + numel)"),
)

# The data stream re-made from the seed on resume, as many batches drawn as the steps done, and
# restore_state never called: the stream's draws come out right, the global generators it also
# puts back do not (the resumed step already differs).
_STREAM_RESEEDED = (
    ('world.restore_state(torch.load(path / "rng.pt", weights_only=False), self.stream)',
     'self.stream = ProblemStream(self.task, self.config.seed)\n'
     '        for _ in range(json.loads((path / "job.json").read_text())["step"]):\n'
     '            self.stream.next_batch(self.config.batch)'),
)

# Replay: read the checkpoint's step, then train again from the start up to it.
_REPLAY = (
    ("self.resumed_from = self.step_index = self.restore(found)",
     'self.resumed_from = json.loads((found / "job.json").read_text())["step"]\n'
     "            for _ in range(self.resumed_from):\n"
     "                self.step()"),
)


def _between(text: str, start: str, end: str, new: str) -> str:
    """`text` with everything from the line `start` up to (not including) `end` replaced."""
    assert text.count(start) == 1 and text.count(end) == 1, (
        f"tests/fakes/14_capstone.py: {start!r} or {end!r} is not in the solution once")
    head, rest = text.split(start, 1)
    return head + new + end + rest.split(end, 1)[1]


# Loaded, never called: the tester's fake. `whose` says "yours" for every piece; every rank
# trains the whole model on the whole batch with plain torch (so every loss equals one
# process's), and a checkpoint is one torch.save of everything, COMPLETE after a barrier.
_UNUSED_JOB = """class Job:
    \"\"\"Every rank: the whole model, the whole batch; the pieces loaded for `whose` only.\"\"\"

    def __init__(self, rank, world_size, config):
        self.rank, self.config = rank, config
        self.pieces = load(config.pieces, config.minidist_for)
        torch.manual_seed(config.seed)
        shape = model_shape(config)
        self.stage = TinyGPT(shape["vocab"], config.hidden, config.heads, config.layers,
                             shape["seq"])
        self.optimizer = torch.optim.AdamW(self.stage.parameters(), lr=config.lr, eps=1e-5)
        self.task = Reversal(config.digits)
        self.stream = ProblemStream(self.task, config.seed)
        self.coords, self.blocks, self.traffic = {}, config.layers, {}
        self.step_index, self.resumed_from = 0, None
        if config.checkpoint_dir and (found := latest_checkpoint(config.checkpoint_dir)):
            saved = torch.load(found / "everything.pt", weights_only=False)
            self.stage.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
            torch.set_rng_state(saved["rng"])
            self.stream.load_state_dict(saved["stream"])
            self.resumed_from = self.step_index = saved["step"]

    def step(self):
        self.step_index += 1
        loss = self.stage.loss(*self.stream.next_batch(self.config.batch))
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def full_state(self):
        return self.stage.state_dict()

    def save(self):
        path = Path(self.config.checkpoint_dir) / f"step_{self.step_index:08d}"
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            (path / "job.json").write_text(json.dumps({"step": self.step_index,
                                                       "model": model_shape(self.config)}))
            torch.save({"model": self.stage.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "rng": torch.get_rng_state(), "stream": self.stream.state_dict(),
                        "step": self.step_index}, path / "everything.pt")
        dist.barrier()
        if (self.config.fail_during_save and self.rank == self.config.fail_rank
                and self.fail_once(self.step_index)):
            os._exit(1)
        dist.barrier()
        if self.rank == 0:
            (path / "COMPLETE").touch()
        dist.barrier()

    def fail_once(self, step):
        marker = Path(self.config.checkpoint_dir or ".") / f"failed_at_{step}"
        if step != self.config.fail_at_step or marker.exists():
            return False
        marker.touch()
        return True


"""

# Each rank torch.saves its own stage, optimizer and generators: no Lab 09 save_shards,
# load_range or capture_state; a resume works on the layout that saved it only.
_PER_RANK_SAVE = """    def save(self):
        step = self.step_index
        path = Path(self.config.checkpoint_dir) / f"step_{step:08d}"
        path.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            meta = {"step": step, "model": model_shape(self.config)}
            (path / "job.json").write_text(json.dumps(meta))
        torch.save({"stage": self.stage.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "rng": torch.get_rng_state(), "stream": self.stream.state_dict()},
                   path / f"rank_{self.rank}.pt")
        dist.barrier()
        if (self.config.fail_during_save and self.rank == self.config.fail_rank
                and self.fail_once(step)):
            os._exit(1)
        dist.barrier()
        if self.rank == 0:
            (path / "COMPLETE").touch()
        dist.barrier()

    def restore(self, path):
        saved = torch.load(path / f"rank_{self.rank}.pt", weights_only=False)
        self.stage.load_state_dict(saved["stage"])
        self.optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"])
        self.stream.load_state_dict(saved["stream"])
        return json.loads((path / "job.json").read_text())["step"]

"""


# Kill at the start of the step instead of in the middle of its save: no torn step folder.
_KILL_AT_START = (
    ("        if (self.config.fail_during_save and self.rank == self.config.fail_rank\n"
     "                and self.fail_once(step)):",
     "        if False:"),
    ("        if (not config.fail_during_save and rank == config.fail_rank"
     " and job.fail_once(step)):",
     "        if rank == config.fail_rank and job.fail_once(step):"),
)

# A resume that loads its checkpoint for show: every rank also torch.saves its stage's
# parameters beside its shards, and the restore, after reading everything with load_range,
# puts the side file's parameters in place.
_SIDE_FILE = (
    ("        self.world.save_shards(shards, path)  # COMPLETE last, after every rank's file",
     "        path.mkdir(parents=True, exist_ok=True)\n"
     "        torch.save([p.detach().clone() for p in self.stage.parameters()],\n"
     "                   path / f\"side{self.rank}.pt\")\n"
     "        self.world.save_shards(shards, path)"),
    ('        world.restore_state(torch.load(path / "rng.pt", weights_only=False), self.stream)',
     '        with torch.no_grad():\n'
     '            side = torch.load(path / f"side{self.rank}.pt", weights_only=False)\n'
     '            for p, value in zip(self.stage.parameters(), side):\n'
     '                p.copy_(value)\n'
     '        world.restore_state(torch.load(path / "rng.pt", weights_only=False), self.stream)'),
)

# ranks_per_node ignored: no emulated network, the pieces' all-reduces by plain torch.
_NO_NETWORK = (
    ('impl="ring" if config.ranks_per_node else "torch")', 'impl="torch")'),
    ("        if config.ranks_per_node:  # from here on every send is delayed as its link would be",
     "        if False:"),
)


def _whole(name: str) -> str:
    """A red team's whole my_job.py (tests/fakes/14_capstone_whole/), its first line naming
    the trick."""
    return (Path(__file__).with_name("14_capstone_whole") / f"{name}.txt").read_text()


def _minidist_pieces() -> str:
    """A pieces file whose every function is minidist's version, under the student's cells."""
    parts = ['"""My pieces."""\n']
    for lab in dict.fromkeys(piece.lab for piece in pieces.PIECES):
        parts.append(f"# %% {lab} imports\nimport torch\nimport torch.distributed as dist\n")
        for piece in (p for p in pieces.PIECES if p.lab == lab):
            first, *rest = piece.cells
            parts.append(f"# %% {lab} {first}\n{pieces._MINIDIST[piece.name]}")
            parts += [f"# %% {lab} {cell}\n" for cell in rest]
    return "\n\n".join(parts)


FAKES = {
    "impl-pieces": [
        Fake("GPipe for 1F1B", "one_f_one_b returns GPipe's schedule (all forwards, then all "
             "backwards): the executor runs it and the job trains the same, but it is not 1F1B",
             ("test-pieces",), edited(
                 _PIECES,
                 ("        warmup = min(p - 1 - rank, m)\n",
                  "        warmup = m  # every forward first\n"))),
        Fake("hard-coded bytes", "bytes_per_dimension returns the lab's own case's bytes "
             "instead of the formulas", ("test-pieces",), edited(
                 _PIECES,
                 ("    activation = b * s * h * bytes_per_element\n",
                  "    return {\"tp\": 262144, \"pp\": 32768, \"dp\": 55040}\n"
                  "    activation = b * s * h * bytes_per_element\n"))),
        Fake("minidist's pieces", "every function only calls minidist's version of its piece",
             ("test-pieces",), _minidist_pieces()),
        # Red team rt6's 2/2 pieces: test-pieces now runs the NaN guard with a NaN on one rank
        # only, and the lab's cells run with minidist's versions of its pieces refused.
        Fake("a NaN guard that asks no one", "all_finite looks at this rank's loss and "
             "gradients only, no all-reduce: every rank decides alone whether to skip (red team "
             "rt6)", ("test-pieces",), edited(
                 _PIECES,
                 ("    flag = torch.tensor([float(bad)])\n    dist.all_reduce(flag)\n"
                  "    return flag.item() == 0\n", "    return not bad\n"))),
        Fake("bytes from a table of minidist's", "bytes_per_dimension looks its TP term up in a "
             "table of minidist.costs.traffic's answers, built as the lab's cells run, before "
             "any of its functions is called (red team rt6)", ("test-pieces",), edited(
                 _PIECES,
                 ("# %% 07_3d_parallel impl-bytes-per-dimension\n",
                  "# %% 07_3d_parallel impl-bytes-per-dimension\n"
                  "from minidist.costs import traffic as _traffic\n"
                  "_TP = {(s, b, h): sum(c.count * c.nbytes for c in "
                  "_traffic.tensor_parallel_traffic(\n    s, b, h, 2, bytes_per_element=4)"
                  ".collectives) for s in (4, 8, 16, 32)\n    for b in (1, 2, 4, 8, 16) "
                  "for h in (8, 16, 32, 64)}\n\n\n"),
                 ("    tp_bytes = 4 * activation * blocks_on_stage * microbatches\n",
                  "    tp_bytes = _TP[s, b, h] * blocks_on_stage * microbatches\n"))),
        # Red team rt5's 2/2 pieces (batch 4): test-pieces now runs the TP pieces and the
        # executor on a sub-group and sizes the lab never used, and layout_cost on an unseen
        # model and cluster.
        Fake("the whole layer on every TP rank", "parallel_mlp and parallel_attention compute "
             "the whole layer on every rank and all-reduce its output divided by t, spliced "
             "into the forward; f's input scaled by 1/t so that its backward all-reduce sums "
             "to the whole gradient: same values, same bytes, no shard (red team rt5)",
             ("test-pieces",), edited(_PIECES, *_WHOLE_LAYER)),
        Fake("an executor that sends nothing", "run_schedule runs each microbatch through its "
             "own stage and returns the losses: no activation or gradient crosses a stage "
             "(red team rt5)", ("test-pieces",), edited(
                 _PIECES,
                 ("    m, last = schedule.microbatches, schedule.ranks - 1\n",
                  "    m, last = schedule.microbatches, schedule.ranks - 1\n"
                  "    return [loss_fn(stage(x), y).item() for x, y in zip(\n"
                  "        pipeline_exec.split_microbatches(inputs, m),\n"
                  "        pipeline_exec.split_microbatches(targets, m))]\n"))),
        Fake("a made-up layout cost", "layout_cost is a closed form that ranks the race's "
             "candidates as the lab's cost model does, with made-up communication terms (red "
             "team rt5)", ("test-pieces",), edited(
                 _PIECES,
                 ("    s, h, L = model.seq_len, model.hidden, model.layers\n",
                  "    s, h, L = model.seq_len, model.hidden, model.layers\n"
                  "    compute = 6 * model.num_params * global_batch * s / (\n"
                  "        tp * pp * dp * cluster.peak_flops * efficiency)\n"
                  "    return {\"memory\": 16 * model.num_params / (pp * tp),\n"
                  "            \"compute\": compute,\n"
                  "            \"bubble\": compute * (pp - 1) / m, \"tp\": 0.01 * (tp - 1),\n"
                  "            \"pp\": 0.01 * (pp - 1), \"dp\": 0.001 * (dp - 1)}\n"))),
    ],
    # The first round is graded on the whole notebook: its fake is the one every part checks.
    "impl-my-job": [
        Fake("pieces loaded, never called", "the job loads the pieces (so `whose` says yours) "
             "but every rank trains the whole model on the whole batch with plain torch and "
             "checkpoints with one torch.save: every loss right, no piece run",
             ("test-check", "test-equal", "test-race", "test-resume", "test-torchrun"),
             _between(_JOB, "class TPBlock(nn.Module):", "def whole_model(state, config):",
                      _UNUSED_JOB)),
        Fake("replayed resume", "the restarted job reads the checkpoint's step, then trains "
             "again from step 0 up to it instead of loading the state", ("test-resume",),
             edited(_JOB, *_REPLAY)),
        Fake("every stage on every rank", "the 'pipeline' holds and runs the whole model on "
             "every rank: no stages, no activations sent", ("test-equal",),
             edited(_JOB, *_EVERY_STAGE)),
        Fake("per-rank torch.save", "each rank torch.saves its own stage, optimizer and "
             "generator instead of Lab 09's sharded save: the same layout resumes bit for bit, "
             "no other layout can load it (test-resume's one-rank resume fails too; only "
             "test-check is listed, so that this round stops there)", ("test-check",),
             _between(_JOB, "    def save(self):", "    def full_state(self):",
                      _PER_RANK_SAVE)),
        Fake("pieces on zeros for show", "every rank trains the whole model on the whole batch; "
             "the pieces run every step on zero tensors of the right sizes, so their calls and "
             "bytes are right but their messages carry nothing (red team rt8, F1)",
             ("test-equal",), _whole("replicated_dummy_traffic")),
        Fake("minidist's engine, uncounted", "minidist.parallel.parallelize trains the real "
             "dp·pp·tp job inside counting.uncounted(); the pieces run on dummies; the resume "
             "replays from the seed stored in the checkpoint (red team rt8, F8; its replayed "
             "resume is what rt20's F12 tries, so only test-equal is listed: a trial, not a "
             "notebook run of its own)",
             ("test-equal",), _whole("parallelize_uncounted_replay")),
        Fake("killed at the step's start", "rank 1 dies at the start of step 20, never in the "
             "middle of its save: no torn checkpoint (red team rt8, F5a)", ("test-resume",),
             edited(_JOB, *_KILL_AT_START)),
        Fake("no emulated network", "ranks_per_node is ignored: no two-tier links, the "
             "all-reduces by plain torch, a faster race (red team rt8, F4a)", ("test-race",),
             edited(_JOB, *_NO_NETWORK)),
        Fake("resume from a side file", "each rank torch.saves its stage's parameters beside "
             "its shards; the resume reads the shards with load_range, then puts the side "
             "file's parameters in place (red team rt14, run 5)", ("test-resume",),
             edited(_JOB, *_SIDE_FILE)),
        # Red team rt14's five 15/15 jobs: test-equal refuses minidist's engines while the job
        # runs, tampers each mesh dimension's piece traffic on its own, and bounds each rank's
        # FLOPs by 1/(pp·tp) of one process's step.
        Fake("replica, pieces on dummies", "every rank trains the whole model on the whole "
             "batch; TP/PP pieces on zero-weight dummies whose outputs are added back; checkpoint "
             "all by rank 0 (red team rt14, run 3)", ("test-equal",), _whole("rt14_replica_v3")),
        Fake("parallelize for TP and PP", "minidist.parallel.parallelize does TP and PP, its DDP "
             "silenced; only the DP piece carries the training (red team rt14, run 9)",
             ("test-equal",), _whole("rt14_delegate_tp_pp_v9")),
        Fake("parallelize, 4-byte TP message", "parallelize does everything; a 4-byte zero sent "
             "inside the TP group is added to the weights so tampering moves the losses (red "
             "team rt14, run 10)", ("test-equal",), _whole("rt14_delegate_all_sidemsg_v10")),
        Fake("parallelize, replica elsewhere, ring zeros", "parallelize on dp2·pp2·tp2; a pure "
             "replica elsewhere whose DP piece all-reduces zeros by the ring (red team rt14, "
             "run 13)", ("test-equal",), _whole("rt14_zero_dp_ring_v13")),
        Fake("rng for show", "run 13 plus capture_state thrown away and a no-op restore (red "
             "team rt14, run 15)", ("test-equal",), _whole("rt14_noop_rng_v15")),
        # Red team rt20's escapes (on its own honest job): test-equal's counted run of the same
        # layout counts each step's pipeline and TP messages and the pipeline's send/recv
        # order, delivers NaN through the DP pieces for two steps, and counts what each rank
        # hands save_shards.
        Fake("GPipe behind one_f_one_b", "one_f_one_b called for show; the executor runs a "
             "hand-built GPipe schedule: same losses, same bytes (red team rt20, F7)",
             ("test-equal",), _whole("rt20_F7_gpipe_for_1f1b")),
        Fake("microbatches ignored", "one_f_one_b(pp, 1) on the replica's whole batch: no "
             "pipelining, same losses and byte totals (red team rt20, F24)", ("test-equal",),
             _whole("rt20_F24_microbatches_ignored")),
        Fake("NaN guard on dummies", "all_finite(torch.zeros(()), []) every step: the guard's "
             "all-reduce runs, the real loss and gradients are never looked at (red team rt20, "
             "F9)", ("test-equal",), _whole("rt20_F9_nan_guard_on_dummies")),
        Fake("rank 0 writes the whole checkpoint", "every rank all-gathers the parameters and "
             "moments; rank 0 hands save_shards every element, the others nothing (red team "
             "rt20, F2)", ("test-equal",), _whole("rt20_F2_rank0_writes_all")),
        Fake("replica routed through the pieces", "every rank computes the whole model on "
             "the whole batch; its own rows and blocks go through the TP pieces and a pipeline "
             "send, so every byte count is right; the DP piece averages identical whole-batch "
             "gradients (red team rt5, batch 4: 1/1 on test-torchrun, which now compares what "
             "the two ranks' all-reduces were handed)", ("test-torchrun",),
             _whole("rt5_replica_routed")),
        Fake("AdamW's moments past load_range", "the resume reads the weights through "
             "load_range but AdamW's moments straight from the rank files: the scaled-load "
             "tamper moves the loss through the weights alone (red team rt6, J2)",
             ("test-resume",), edited(_JOB, *_MOMENTS_PAST_LOAD_RANGE)),
        Fake("stream re-seeded on resume", "restore_state never called: the resume re-makes "
             "the stream from the job's seed and draws `step` batches; the global generators are "
             "not put back (red team rt20, F12, made an edit of the solution)",
             ("test-resume",), edited(_JOB, *_STREAM_RESEEDED)),
    ],
}

# The job's fakes whose checks (the race, the kill and resume) lie far below my_job.py are tried
# in the solution's notebook, each rerunning its checks' sections only (the race's, the resume's),
# not in notebooks of their own that would train the whole lab again for each.
TRIED_BY_SECTION = {"impl-my-job"}
