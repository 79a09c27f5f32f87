"""A student's own functions from labs 03–09, taken out of their notebooks and composed into
one job (Lab 14), each on the process group of its mesh dimension.

    python tools/my_labs.py export       # writes my-labs/14_capstone/exported_pieces.py

    pieces = load("my_pieces.py", minidist_for=("overlap",))   # in each rank
    pieces.whose          # {"mesh": "yours", ..., "overlap": "minidist's (your choice)"}
    groups = pieces.build_groups({"pp": 2, "dp": 2, "tp": 2})   # your Lab 07 function
    tp = pieces.on(tp_group)     # your Lab 05 f, g, parallel_mlp, parallel_attention ...
    tp.parallel_mlp(x, fc1, fc2, 0, 1)                         # ... all-reducing over tp_group

**The file.** `export` copies, from each lab notebook, the lab's import cell and the cells of
the pieces below (an exercise's cell, and the given helpers it calls), one section per lab,
each cell under a line `# %% <lab> <cell id>`. A piece is *unfinished* while one of its cells
still raises the stub's NotImplementedError.

**One group per piece.** The labs wrote each function for the default group: Lab 03's
gradient all-reduce, Lab 05's f and g, Lab 06's sends to rank `r ± 1`. In a mesh each runs on
its dimension's group instead. `pieces.on(group)` runs a lab's code with its `dist` meaning
that group, as `torch.distributed` would if the group were the whole world: `get_rank()` and
`get_world_size()` in the group, a collective without `group=` on it, and `send(dst=r)`,
`recv(src=r)`, `broadcast(src=r)` to the group's rank `r` (a call that names `group=` itself
is passed on unchanged). Nothing in the student's code changes.

**Whose.** While one of the student's functions runs, minidist's version of the same piece
is refused (`minidist.core.refusal.unavailable`): a piece that only calls the library's
fails, naming it, instead of passing as the student's. A piece named in `minidist_for` runs
minidist's version instead, with the same signature, and `whose` says so; an unfinished
piece not named there stops `load` with a message naming the piece, its lab and cell, and the
two fixes, before any rank communicates.

**Used, not only loaded.** Every call of a piece's function is counted in the process that
makes it, and every byte a piece sends through its group's `dist` (a collective's full tensor,
a send's payload; minidist's versions send by their own routes, uncounted) is added to that
group's total: `usage()` returns both, `reset_usage()`
starts them afresh. A job that loads the pieces and never runs them shows no calls and no
bytes on its mesh's groups. `usage()["routed"]` holds, per group, the bytes that went by the
emulated network's route (Lab 11's links, `impl="ring"` or a send, while the network routes
`ProcessGroup.send`): a job on an emulated network whose pieces bypass it shows none there.

**Tied to the result.** Inside `tampered(delta)` every piece's collective on a mesh group (not on
the world) and every receive through a group return what it got plus `delta` (floating-point
tensors only): a job whose pieces carry the training changes its losses; pieces run on dummies
"for show" while the training happens elsewhere change nothing. Inside
`tampered_checkpoint(scale=..., generators=...)` what the checkpoint piece loads is scaled and
the generator states the rng piece restores are moved on a draw: a resume that takes its state
from anywhere else resumes to the same losses.

Under torchrun (or any launcher) set `MINIDIST_PIECES_USAGE=prefix`: each process that loads
pieces writes its usage to `prefix.rank<RANK>.json` when it exits.

Why one module of about 1000 lines: the one path a student's piece travels: exported from a
notebook, loaded with minidist's stand-ins named, and run on its mesh dimension's group."""

from __future__ import annotations

import ast
import atexit
import contextlib
import json
import os
import re
import types
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from minidist.communication import collectives
from minidist.core import interposer
from minidist.core.refusal import unavailable

__all__ = ["PIECES", "Piece", "Pieces", "MissingPiece", "export", "load", "usage",
           "reset_usage", "read_usage", "unfinished_cells", "tampered", "tampered_checkpoint"]


@dataclass(frozen=True)
class Piece:
    """One piece of the job: `functions` defined by the exercise `cells` (grade ids) of
    `lab`, plus the given `helpers` they call (functions the lab defines outside its
    exercises); `library` names minidist's version, refused while the student's runs."""

    name: str
    lab: str
    what: str
    cells: tuple[str, ...]
    functions: tuple[str, ...]
    library: tuple[str, ...]
    helpers: tuple[str, ...] = ()


_F_G = tuple(f"minidist.parallel.tensor_parallel.{op}.{method}"
             for op in ("CopyToParallel", "ReduceFromParallel")
             for method in ("forward", "backward"))  # apply is autograd.Function's own, shared

PIECES = (
    Piece("mesh", "07_3d_parallel", "a mesh's groups", ("impl-mesh-groups", "impl-build-groups"),
          ("mesh_groups", "build_groups"),
          ("minidist.communication.mesh.group_ranks", "minidist.communication.mesh.Mesh.__init__")),
    Piece("tp", "05_tensor_parallel", "f, g, the parallel MLP and attention",
          ("impl-f-g", "impl-mlp", "impl-attention"),
          ("CopyToParallel", "ReduceFromParallel", "parallel_mlp", "parallel_attention"),
          (*_F_G, *(f"minidist.parallel.tensor_parallel.{layer}" for layer in (
              "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelAttention"))),
          helpers=("shard_weight",)),
    Piece("pp", "06_pipeline", "1F1B and the executor", ("impl-1f1b", "impl-executor"),
          ("one_f_one_b", "run_schedule"),
          ("minidist.parallel.pipeline.schedule", "minidist.parallel.pipeline._one_f_one_b",
           "minidist.parallel.pipeline_exec.execute",
           "minidist.parallel.pipeline_exec._Executor.run")),
    Piece("dp", "03_data_parallel", "the gradient all-reduce", ("impl-flat",),
          ("all_reduce_gradients_flat",), ("minidist.parallel.ddp.all_reduce_gradients_flat",)),
    Piece("checkpoint", "09_fault_tolerance", "sharded save and load", ("impl-save_load",),
          ("write_atomically", "save_shards", "load_range"),
          ("minidist.jobs.checkpoint.save", "minidist.jobs.checkpoint.load",
           "minidist.jobs.checkpoint.read_full", "minidist.jobs.checkpoint.read_metadata")),
    Piece("rng", "09_fault_tolerance", "capturing every generator", ("impl-rng_state",),
          ("capture_state", "restore_state"),
          ("minidist.jobs.checkpoint.RNGState.state_dict",
           "minidist.jobs.checkpoint.RNGState.load_state_dict")),
    Piece("nan_guard", "09_fault_tolerance", "the NaN guard", ("impl-nan_guard",),
          ("all_finite",), ()),
    Piece("overlap", "08_profiling", "overlap from a timeline", ("impl-overlap",),
          ("union", "overlap_from_events"),
          ("minidist.jobs.profiling.overlap_fraction", "minidist.jobs.profiling.merge",
           "minidist.jobs.profiling.intersect")),
    Piece("bytes", "07_3d_parallel", "bytes per mesh dimension", ("impl-bytes-per-dimension",),
          ("bytes_per_dimension",), tuple(f"minidist.costs.traffic.{name}" for name in (
              "mesh_traffic", "tensor_parallel_traffic", "pipeline_traffic",
              "data_parallel_traffic"))),
    Piece("cost", "07_3d_parallel", "the layout's cost", ("impl-layout-cost",),
          ("layout_cost",), tuple(f"minidist.costs.planner.{name}" for name in (
              "estimate_time", "estimate_memory", "evaluate", "plan"))),
)
BY_NAME = {piece.name: piece for piece in PIECES}

# minidist's version of each piece, with the student's signature; `dist` is the piece's
# group-bound torch.distributed, `dist.group` its group.
_MINIDIST = {
    "mesh": '''
from minidist.communication.mesh import Mesh, group_ranks

def mesh_groups(shape, dim):
    return group_ranks(dict(shape), dim)

def build_groups(shape):
    mesh = Mesh(**shape)
    return {dim: (mesh.group(dim), mesh.ranks(dim)) for dim in shape}
''',
    "tp": '''
import torch.nn.functional as F
from minidist.parallel import tensor_parallel
from minidist.parallel.models import attend

def shard_weight(weight, rank, t, kind):
    return weight.chunk(t, dim={"column": 0, "row": 1}[kind])[rank]

class CopyToParallel:
    @staticmethod
    def apply(x):
        return tensor_parallel.CopyToParallel.apply(x, dist.group)

class ReduceFromParallel:
    @staticmethod
    def apply(x):
        return tensor_parallel.ReduceFromParallel.apply(x, dist.group)

def _column(x, linear, rank, t):
    return F.linear(x, shard_weight(linear.weight, rank, t, "column"), linear.bias.chunk(t)[rank])

def parallel_mlp(x, fc1, fc2, rank, t):
    partial = F.linear(F.gelu(_column(CopyToParallel.apply(x), fc1, rank, t)),
                       shard_weight(fc2.weight, rank, t, "row"))
    return ReduceFromParallel.apply(partial) + fc2.bias

def parallel_attention(x, attn, rank, t):
    x = CopyToParallel.apply(x)
    heads = attend(*(_column(x, p, rank, t) for p in (attn.q_proj, attn.k_proj, attn.v_proj)),
                   attn.heads // t)
    partial = F.linear(heads, shard_weight(attn.out_proj.weight, rank, t, "row"))
    return ReduceFromParallel.apply(partial) + attn.out_proj.bias
''',
    "pp": '''
from minidist.parallel import pipeline, pipeline_exec

def one_f_one_b(p, m):
    return pipeline.schedule("1f1b", p, m)

def run_schedule(schedule, rank, stage, inputs, targets, loss_fn, activation_shape):
    return list(pipeline_exec.execute(schedule, {rank: stage}, inputs, targets, loss_fn,
                                      group=dist.group).losses)
''',
    "dp": '''
from minidist.parallel import ddp

def all_reduce_gradients_flat(model, all_reduce=None):
    ddp.all_reduce_gradients_flat(model, group=dist.group)
''',
    "checkpoint": '''
import os
from pathlib import Path
from minidist.jobs import checkpoint

def write_atomically(path, save_fn):
    temporary = Path(f"{path}.tmp")
    save_fn(temporary)
    with open(temporary, "rb+") as file:
        os.fsync(file.fileno())
    os.replace(temporary, path)

def _key(name):  # minidist's keys nest at "/": any other name is one key
    return name.replace("%", "%25").replace("/", "%2F")

def save_shards(shards, path):
    checkpoint.save({_key(name): checkpoint.Shard(tensor.reshape(-1), (numel,), offset)
                     for name, (offset, tensor, numel) in shards.items()}, path)

_READ = {}  # folder -> (its COMPLETE's time, every tensor whole): a resume reads each file once

def load_range(path, name, start, end):
    done = Path(path) / checkpoint.COMPLETE
    stamp = done.stat().st_mtime_ns if done.exists() else None
    if stamp is None or _READ.get(str(path), (None,))[0] != stamp:
        _READ[str(path)] = (stamp, checkpoint.read_full(path))  # a torn one raises, naming it
    return _READ[str(path)][1][_key(name)].reshape(-1)[start:end].clone()
''',
    "rng": '''
from minidist.jobs import checkpoint

def capture_state(sampler):
    return {"generators": checkpoint.RNGState().state_dict(), "sampler": dict(sampler.state_dict())}

def restore_state(state, sampler):
    checkpoint.RNGState().load_state_dict(state["generators"])
    sampler.load_state_dict(state["sampler"])
''',
    "nan_guard": '''
def all_finite(loss, grads):
    bad = not torch.isfinite(loss).all() or any(
        not torch.isfinite(g).all() for g in grads if g is not None)
    flag = torch.tensor([float(bad)])
    dist.all_reduce(flag)
    return flag.item() == 0
''',
    "overlap": '''
from minidist.jobs import profiling

def union(intervals):
    return profiling.merge(intervals)

def overlap_from_events(timeline, rank):
    def of(kind):
        return profiling.merge((e.start, e.end) for e in timeline.events
                               if e.rank == rank and e.kind == kind)
    communication = of("communication")
    total = profiling.total(communication)
    hidden = profiling.total(profiling.intersect(communication, of("compute")))
    return hidden / total if total > 0 else 0.0
''',
    "bytes": '''
from minidist.costs import traffic

def bytes_per_dimension(stage, pp, b, s, h, blocks_on_stage, microbatches, rank_params,
                        bytes_per_element=4):
    activation = b * s * h * bytes_per_element
    tp_layer = traffic.tensor_parallel_traffic(s, b, h, 2, bytes_per_element=bytes_per_element)
    per_layer = sum(c.count * c.nbytes for c in tp_layer.collectives)
    return {"tp": blocks_on_stage * microbatches * per_layer,
            "pp": ((stage < pp - 1) + (stage > 0)) * activation * microbatches,
            "dp": rank_params * bytes_per_element}
''',
    "cost": '''
from minidist.costs import planner

def layout_cost(layout, model, cluster, global_batch, efficiency=0.6):
    time = planner.estimate_time(layout, model, cluster, global_batch, efficiency)
    return {"memory": planner.estimate_memory(layout, model).total, "compute": time.compute,
            "bubble": time.bubble, "tp": time.tp_comm, "pp": time.pp_comm, "dp": time.dp_comm}
''',
}

_CELL = re.compile(r"^# %% (\d\d_\w+) ([\w-]+)$", re.M)
_IMPORTS = "imports"
_LEFT_OUT = ("matplotlib", "minidist.pictures", "IPython", "ipywidgets")
"""Import lines the job does not need: pictures and widgets (each rank would load them)."""


class MissingPiece(RuntimeError):
    """A piece the job needs is not in the file, or still unfinished."""


# --- export ----------------------------------------------------------------------------------


def _cells(notebook: Path) -> list[dict]:
    return json.loads(notebook.read_text())["cells"]


def _source(cell: dict) -> str:
    source = cell["source"]
    return "".join(source) if isinstance(source, list) else source


def _defines(source: str) -> set[str]:
    try:
        tree = ast.parse(_without_magics(source))
    except SyntaxError:
        return set()
    return {node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def _without_magics(source: str) -> str:
    return "\n".join(line for line in source.splitlines()
                     if not line.lstrip().startswith(("%", "!")))


_DELIMITERS = tuple(f"### {word} SOLUTION" for word in ("BEGIN", "END"))
"""nbgrader's solution delimiters, in the instructors' notebooks (spelt so that the student
release, which checks it holds none, does not hold them either)."""


def _definitions(source: str) -> str:
    """A cell's functions, classes and imports, without what it runs at the top level (a demo
    that prints) and without nbgrader's solution delimiters; a cell that does not parse is
    kept whole, so that loading it reports the student's syntax error."""
    text = "\n".join(line for line in _without_magics(source).splitlines()
                     if line.strip() not in _DELIMITERS)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines()
    kept = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import,
                             ast.ImportFrom)):
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            kept.append("\n".join(lines[first - 1:node.end_lineno]))
    return "\n\n\n".join(kept)


def _import_lines(source: str) -> str:
    """The import statements of a lab's first code cell, without pictures and magics."""
    tree = ast.parse(_without_magics(source))
    lines = _without_magics(source).splitlines()
    kept = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            text = "\n".join(lines[node.lineno - 1:node.end_lineno])
            if not any(word in text for word in _LEFT_OUT):
                kept.append(text)
    return "\n".join(kept)


def export(labs: str | Path, target: str | Path | None = None) -> str:
    """The pieces file made from the lab notebooks under `labs` (a folder holding
    NN_topic/NN_topic.ipynb, e.g. my-labs/), written to `target` if given. Labs or cells that
    are missing are listed at the top of the file as missing."""
    labs = Path(labs)
    sections, notes = [], []
    for lab in dict.fromkeys(piece.lab for piece in PIECES):
        notebook = labs / lab / f"{lab}.ipynb"
        if not notebook.exists():
            notes.append(f"# missing: {lab} (no {notebook.name} in {labs})")
            continue
        cells = [cell for cell in _cells(notebook) if cell["cell_type"] == "code"]
        by_id = {cell.get("metadata", {}).get("nbgrader", {}).get("grade_id"): cell
                 for cell in cells}
        wanted = [piece for piece in PIECES if piece.lab == lab]
        chosen: list[tuple[str, dict]] = []
        for piece in wanted:
            for grade_id in piece.cells:
                if grade_id not in by_id:
                    notes.append(f"# missing: {lab} cell {grade_id} (piece {piece.name})")
                elif all(grade_id != known for known, _ in chosen):
                    chosen.append((grade_id, by_id[grade_id]))
            for helper in piece.helpers:
                for cell in cells:
                    name = f"given-{helper}"
                    if helper in _defines(_source(cell)) and all(name != k for k, _ in chosen):
                        chosen.append((name, cell))
        order = {id(cell): index for index, cell in enumerate(cells)}
        chosen.sort(key=lambda item: order[id(item[1])])
        parts = [f"# %% {lab} {_IMPORTS}\n{_import_lines(_source(cells[0]))}"]
        parts += [f"# %% {lab} {grade_id}\n{_definitions(_source(cell))}"
                  for grade_id, cell in chosen]
        sections.append("\n\n\n".join(parts))
    header = (f'"""Your pieces from labs 03–09, exported from {labs.name}/ (minidist.jobs.pieces '
              f'reads this\nfile: one section per lab, each cell under its "# %% <lab> <cell>" '
              f'line)."""\n')
    text = header + ("\n".join(notes) + "\n" if notes else "") + "\n\n" + \
        "\n\n\n".join(sections) + "\n"
    if target is not None:
        Path(target).write_text(text)
    return text


def unfinished_cells(text: str, piece: Piece) -> dict[str, str]:
    """{cell id: "missing", "unfinished" or "empty: ..."} of `piece`'s cells in a pieces
    file's text that are not finished: which cell of the lab to finish."""
    cells = _split(text)
    undefined = _undefined(_defined_by_lab(cells), piece)
    found = {}
    for grade_id in piece.cells:
        source = cells.get((piece.lab, grade_id))
        if source is None:
            found[grade_id] = "missing"
        elif "NotImplementedError" in source:
            found[grade_id] = "unfinished"
        elif undefined and not _defines(source) & set(piece.functions):
            found[grade_id] = f"empty: it defines no {' or '.join(undefined)}"
    return found


def status(text: str) -> dict[str, str]:
    """Each piece's state in a pieces file's text: "finished", "unfinished" (a cell still
    raises NotImplementedError, or the lab's cells leave one of the piece's functions
    undefined) or "missing" (a cell is not there)."""
    cells = _split(text)
    defined = _defined_by_lab(cells)
    found = {}
    for piece in PIECES:
        sources = [cells.get((piece.lab, grade_id)) for grade_id in piece.cells]
        if any(source is None for source in sources):
            found[piece.name] = "missing"
        elif (any("NotImplementedError" in source for source in sources)
              or _undefined(defined, piece)):
            found[piece.name] = "unfinished"
        else:
            found[piece.name] = "finished"
    return found


def _defined_by_lab(cells: dict[tuple[str, str], str]) -> dict[str, set[str]]:
    """{lab: the functions and classes its cells in a pieces file define}, each cell parsed
    once."""
    defined: dict[str, set[str]] = {}
    for (lab, _), source in cells.items():
        defined.setdefault(lab, set()).update(_defines(source))
    return defined


def _undefined(defined: dict[str, set[str]], piece: Piece) -> list[str]:
    """The functions of `piece` that no cell of its lab defines (`defined`: `_defined_by_lab`)."""
    return [name for name in piece.functions if name not in defined.get(piece.lab, set())]


def _runs_code(source: str) -> bool:
    """Whether a cell calls anything as it runs: a statement other than an import, a def or a
    class, or a call in a decorator, a default value or a class body (what `export` writes
    calls nothing; a table built as the cell runs does)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True

    def calls(nodes: Iterable[ast.AST]) -> bool:
        return any(isinstance(inner, ast.Call) for node in nodes for inner in ast.walk(node))

    def runs(statements: list[ast.stmt]) -> bool:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if calls([*node.decorator_list, *node.args.defaults,
                          *(d for d in node.args.kw_defaults if d is not None)]):
                    return True
            elif isinstance(node, ast.ClassDef):
                if calls([*node.decorator_list, *node.bases, *node.keywords]) or runs(node.body):
                    return True
            elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
                return True  # an assignment, a loop, a call ... (a docstring is none of them)
        return False

    return runs(tree.body)


def _split(text: str) -> dict[tuple[str, str], str]:
    """{(lab, cell id): source} of a pieces file."""
    marks = list(_CELL.finditer(text))
    return {(mark.group(1), mark.group(2)):
            text[mark.end():marks[k + 1].start() if k + 1 < len(marks) else len(text)]
            for k, mark in enumerate(marks)}


# --- what ran: calls per piece, bytes per group ---------------------------------------------

_CALLS: Counter = Counter()  # {piece name: calls of its functions}, in this process
_BYTES: Counter = Counter()  # {group's global ranks (tuple), or "world": bytes sent through it}
_ROUTED: Counter = Counter()  # the same, of the bytes the emulated network's route carried
_MESSAGES: Counter = Counter()  # {group: messages (collectives and sends) its pieces sent on it}
_P2P: dict[Any, list] = {}  # {group: [("send" or "recv", peer's group rank), ...] in order}
_WRITTEN: list[tuple[str, int, int, int]] = []  # save_shards: (name, offset, elements, numel)
_INPUTS: dict[Any, list] = {}  # {group: the sum of each all-reduce's input, the first _KEPT}
_KEPT = 64
_TAMPER = [0.0]  # added to what each collective on a mesh group returns, each receive delivers
_TAMPER_SCALE = [1.0]  # what each is multiplied by first
_TAMPER_ONLY: list[tuple | None] = [None]  # the one group tampered (global ranks); None: all
_USAGE_FILE = "MINIDIST_PIECES_USAGE"
# inside `tampered_checkpoint`: what load_range's tensors are multiplied by, whether the
# generator states restore_state is given move on a draw, and how many of each were tampered
_CHECKPOINT_TAMPER: dict[str, Any] = {"scale": 1.0, "generators": False, "done": None}


def usage() -> dict[str, Any]:
    """What this process ran since the last `reset_usage()`: {"calls": {piece: calls of its
    functions}, "bytes": {group: bytes its pieces sent on it}, "routed": {group: those of them
    the emulated network's route carried}, "messages": {group: collectives and sends its pieces
    made on it}, "p2p": {group: its pieces' point-to-point calls in order, each ("send" or
    "recv", the peer's rank in the group)}, "inputs": {group: the sum (in float64) of what each
    of its pieces' all-reduces of more than one floating-point element was handed, in order, the
    first 64}, "written": [(name, offset, elements, numel) of each tensor handed to the checkpoint
    piece's save_shards]}, a group named by its global ranks as a tuple (the whole world:
    "world"). Why messages and order besides bytes: a pipeline that ignores its microbatches, or
    runs GPipe where 1F1B was asked, sends the same bytes. Why inputs: data or tensor parallelism
    hands each rank's all-reduce that rank's own gradients or partial sums; replicas that all
    compute the same thing hand every rank the same tensor, with the same bytes."""
    return {"calls": dict(_CALLS), "bytes": dict(_BYTES), "routed": dict(_ROUTED),
            "messages": dict(_MESSAGES), "p2p": {key: list(ops) for key, ops in _P2P.items()},
            "inputs": {key: list(sums) for key, sums in _INPUTS.items()},
            "written": list(_WRITTEN)}


def reset_usage() -> None:
    """Forget the calls, bytes, messages, inputs and writes counted so far in this process."""
    for counted in (_CALLS, _BYTES, _ROUTED, _MESSAGES, _P2P, _INPUTS, _WRITTEN):
        counted.clear()


@contextlib.contextmanager
def tampered(delta: float, group: Iterable[int] | None = None,
             scale: float = 1.0) -> Iterator[None]:
    """Inside the block, add `delta` to what every piece's collective on a mesh group returns
    and every receive through a group delivers (floating-point tensors), in this process. A
    grader's check that the pieces' traffic carries the training: their messages tampered, a
    real job's losses change. `group` (global ranks): tamper on that group only, so that each
    mesh dimension's traffic is checked on its own (one group carrying a token message does not
    carry the others). `scale`: multiply by it first (a uniform `delta` on an activation a
    LayerNorm follows cancels out; a scale does not)."""
    previous = _TAMPER[0], _TAMPER_ONLY[0], _TAMPER_SCALE[0]
    _TAMPER[0], _TAMPER_ONLY[0] = float(delta), None if group is None else tuple(group)
    _TAMPER_SCALE[0] = float(scale)
    try:
        yield
    finally:
        _TAMPER[0], _TAMPER_ONLY[0], _TAMPER_SCALE[0] = previous


def _routed_now() -> bool:
    return "route" in interposer.subscribers("ProcessGroup.send")


class _TamperedRequest:
    """An async request (torch's Work or minidist's Handle) whose first `wait()` then adds the
    tamper to its tensor, once, as `checking.tampered_receives` does to a dist.Work."""

    def __init__(self, work: Any, tensor: Any, delta: float):
        self._work, self._tensor, self._delta = work, tensor, delta

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        if self._delta is not None:
            _add(self._tensor, self._delta)
        self._delta = None  # arrived: a second wait() must not add it again
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def tampered_checkpoint(*, scale: float = 1.0,
                        generators: bool = False) -> Iterator[dict[str, int]]:
    """Inside the block, in this process: every floating-point tensor the checkpoint piece's
    `load_range` returns comes back multiplied by `scale`, and with `generators` every random
    generator's state the rng piece's `restore_state` is given is moved on by one draw (a state
    equal to one a generator holds already is left alone: restoring it changes nothing). A
    grader's check that a resume takes its weights and its generators from the checkpoint
    through those pieces: a job that reads a side file, or replays its data from the seed,
    resumes to the losses it would have without the block. Yields {"scaled": tensors scaled,
    "elements": their elements, "moved": states moved}, counted as the block runs (a resume
    that reads AdamW's moments elsewhere reads a third of the elements a whole one does)."""
    previous = dict(_CHECKPOINT_TAMPER)
    done = {"scaled": 0, "elements": 0, "moved": 0}
    _CHECKPOINT_TAMPER.update(scale=float(scale), generators=generators, done=done)
    try:
        yield done
    finally:
        _CHECKPOINT_TAMPER.update(previous)


def _scaled_load(load_range: Callable, *args: Any, **kwargs: Any) -> Any:
    loaded = load_range(*args, **kwargs)
    scale, done = _CHECKPOINT_TAMPER["scale"], _CHECKPOINT_TAMPER["done"]
    if scale != 1.0 and isinstance(loaded, torch.Tensor) and loaded.is_floating_point():
        done["scaled"] += 1
        done["elements"] += loaded.numel()
        return loaded * scale
    return loaded


def _moved_restore(restore_state: Callable, state: Any, *args: Any, **kwargs: Any) -> Any:
    if _CHECKPOINT_TAMPER["generators"]:
        held = [torch.get_rng_state()] + [value.get_state() for value in _generators_in(args)]
        state = _moved_states(state, held, _CHECKPOINT_TAMPER["done"])
    return restore_state(state, *args, **kwargs)


def _generators_in(values: Iterable[Any]) -> list[torch.Generator]:
    """The generators among `values` and their attributes (a sampler's `.generator`)."""
    found = []
    for value in values:
        for candidate in (value, *vars(value).values()) if hasattr(value, "__dict__") else (value,):
            if isinstance(candidate, torch.Generator):
                found.append(candidate)
    return found


_STATE_BYTES = torch.Generator().get_state().numel()  # a CPU generator's state, in bytes


def _moved_states(state: Any, held: list[torch.Tensor], done: dict[str, int]) -> Any:
    """`state` with every CPU generator state in it (nested in dicts, lists and tuples) that no
    generator in `held` holds moved on by one draw."""
    if isinstance(state, dict):
        return {key: _moved_states(value, held, done) for key, value in state.items()}
    if type(state) in (list, tuple):
        return type(state)(_moved_states(value, held, done) for value in state)
    if (isinstance(state, torch.Tensor) and state.dtype == torch.uint8
            and state.numel() == _STATE_BYTES
            and not any(torch.equal(state, other) for other in held)):
        generator = torch.Generator()
        generator.set_state(state)
        torch.rand(1, generator=generator)
        done["moved"] += 1
        return generator.get_state()
    return state


_TAMPERED_CALLS = {("checkpoint", "load_range"): _scaled_load,
                   ("rng", "restore_state"): _moved_restore}


def _add(tensor: Any, delta: float) -> None:
    if hasattr(tensor, "is_floating_point") and tensor.is_floating_point():
        tensor.data.mul_(_TAMPER_SCALE[0]).add_(delta)


def _write_usage_at_exit() -> None:
    """Under a launcher (MINIDIST_PIECES_USAGE set), write this process's usage when it exits."""
    prefix = os.environ.get(_USAGE_FILE)
    if not prefix or getattr(_write_usage_at_exit, "registered", False):
        return
    _write_usage_at_exit.registered = True  # type: ignore[attr-defined]

    def write() -> None:
        found = usage()
        for kind in _BY_GROUP:
            found[kind] = {json.dumps(list(key) if isinstance(key, tuple) else key): value
                           for key, value in found[kind].items()}
        Path(f"{prefix}.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(found))

    atexit.register(write)


_BY_GROUP = ("bytes", "routed", "messages", "p2p", "inputs")  # usage() entries keyed by group


def read_usage(prefix: str | Path) -> dict[int, dict]:
    """{rank: usage} from the files MINIDIST_PIECES_USAGE=prefix made the ranks write (groups
    as tuples again)."""
    found = {}
    for path in sorted(Path(prefix).parent.glob(f"{Path(prefix).name}.rank*.json")):
        saved = json.loads(path.read_text())
        for kind in _BY_GROUP:
            saved[kind] = {(tuple(key) if isinstance(key := json.loads(k), list) else key): v
                           for k, v in saved.get(kind, {}).items()}
        found[int(path.name.rsplit(".rank", 1)[1].split(".")[0])] = saved
    return found


def _counted(function: Callable, piece: str) -> Callable:
    """`function`, its calls counted as calls of `piece` (and, for save_shards, what it is
    handed noted; for load_range and restore_state, what they load tampered inside
    `tampered_checkpoint`)."""
    observe = _OBSERVED_CALLS.get((piece, function.__name__))
    tampered_call = _TAMPERED_CALLS.get((piece, function.__name__))

    def counted(*args, **kwargs):
        _CALLS[piece] += 1
        if observe is not None:
            observe(*args, **kwargs)
        if tampered_call is not None and _CHECKPOINT_TAMPER["done"] is not None:
            return tampered_call(function, *args, **kwargs)
        return function(*args, **kwargs)

    counted.__name__ = counted.__qualname__ = function.__name__
    counted.__wrapped__ = function
    return counted


def _note_written(*args: Any, **kwargs: Any) -> None:
    """Note what a save_shards call was handed ({name: (offset, tensor, numel)}): which rank
    writes which elements, so that a grader sees a checkpoint written from one gathered copy."""
    shards = args[0] if args else kwargs.get("shards")
    for name, entry in (shards.items() if isinstance(shards, dict) else ()):
        if isinstance(entry, tuple) and len(entry) == 3 and hasattr(entry[1], "numel"):
            offset, tensor, numel = entry
            _WRITTEN.append((str(name), int(offset), int(tensor.numel()), int(numel)))


_OBSERVED_CALLS = {("checkpoint", "save_shards"): _note_written}


def _nbytes(value: Any) -> int:
    return value.nbytes if hasattr(value, "nbytes") and hasattr(value, "dtype") else 0


# --- run on a group --------------------------------------------------------------------------


class _OnGroup:
    """torch.distributed as code written for the whole world sees it, on `group` (see the
    module doc). Everything not listed here is torch.distributed's own.

    Why one unit of about 130 lines: every call a piece makes on its group passes here, so
    the group's rank mapping, the counting (bytes, messages, point-to-point order) and the
    tampering sit on the one path, each call wrapped once."""

    def __init__(self, group: dist.ProcessGroup | None, impl: str = "torch"):
        self.group, self.impl = group, impl
        self._key: Any = None

    def _sent(self, nbytes: int, group=None, routable: bool = False) -> None:
        """Count `nbytes` sent on the bound group (not on a group the call names itself);
        `routable`: sent by sends, which the emulated network routes when it is on."""
        if group is not None or not nbytes:
            return
        _BYTES[self._group_key()] += nbytes
        _MESSAGES[self._key] += 1
        if routable and _routed_now():
            _ROUTED[self._key] += nbytes

    def _group_key(self) -> Any:
        if self._key is None:
            self._key = ("world" if self.group is None
                         else tuple(dist.get_process_group_ranks(self.group)))
        return self._key

    def _handed(self, tensor: Any, group=None) -> None:
        """Note the sum of an all-reduce's input on the bound group (see `usage`)."""
        if (group is None and hasattr(tensor, "is_floating_point") and tensor.is_floating_point()
                and tensor.numel() > 1):
            sums = _INPUTS.setdefault(self._group_key(), [])
            if len(sums) < _KEPT:
                sums.append(tensor.detach().sum(dtype=torch.float64).item())

    def _p2p(self, kind: str, peer: Any, group=None) -> None:
        """Note a point-to-point call on the bound group, in order (see `usage`)."""
        if group is None:
            _P2P.setdefault(self._group_key(), []).append((kind, peer))

    def _tampered(self, result: Any, tensor: Any, group=None) -> Any:
        """`result` of a call on the bound mesh group, its `tensor` tampered (see `tampered`)."""
        delta = _TAMPER[0]
        if (not delta and _TAMPER_SCALE[0] == 1.0) or group is not None or self.group is None:
            return result
        if (_TAMPER_ONLY[0] is not None
                and tuple(dist.get_process_group_ranks(self.group)) != _TAMPER_ONLY[0]):
            return result  # another group's traffic: not the one tampered
        if result is not None and hasattr(result, "wait"):
            return _TamperedRequest(result, tensor, delta)
        _add(tensor, delta)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def get_rank(self, group=None) -> int:
        return dist.get_rank(group if group is not None else self.group)

    def get_world_size(self, group=None) -> int:
        return dist.get_world_size(group if group is not None else self.group)

    def _collective(name: str, rooted: str | None = None, counted: int | None = None,
                    ) -> Callable:  # noqa: N805
        """torch.distributed's `name` on the bound group; `rooted` names its root argument
        (a group rank here), `counted` the position of the tensor whose bytes
        the collective layer records (the full tensor, as for minidist's own)."""
        def call(self, *args, group=None, **kwargs):
            if group is None and rooted is not None:
                if rooted in kwargs:
                    kwargs[rooted] = self._global(kwargs[rooted])
                elif len(args) >= 2:
                    args = (args[0], self._global(args[1]), *args[2:])
            if counted is not None and len(args) > counted:
                self._sent(_nbytes(args[counted]), group)
            group = group if group is not None else self.group
            if counted is not None and len(args) > counted:
                tensor = args[counted]
                collectives.record_torch_collective(name, tensor, group)
            return getattr(dist, name)(*args, group=group, **kwargs)
        call.__name__ = name
        return call

    _torch_all_reduce = _collective("all_reduce", counted=0)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        """torch's all-reduce, or with impl="ring" (an emulated network: Lab 11) minidist's
        ring of sends, which the emulated links delay as they would a cluster's."""
        self._handed(tensor, group)
        if self.impl == "torch":
            return self._tampered(
                self._torch_all_reduce(tensor, op, group=group, async_op=async_op), tensor, group)
        self._sent(_nbytes(tensor), group, routable=True)
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"impl={self.impl!r} sums only; got op={op}")
        return self._tampered(
            collectives.all_reduce(tensor, op="sum",
                                   group=group if group is not None else self.group,
                                   impl=self.impl, async_op=async_op), tensor, group)

    all_gather = _collective("all_gather")
    all_gather_into_tensor = _collective("all_gather_into_tensor", counted=0)
    reduce_scatter = _collective("reduce_scatter")
    reduce_scatter_tensor = _collective("reduce_scatter_tensor", counted=1)
    all_to_all = _collective("all_to_all")
    all_to_all_single = _collective("all_to_all_single")
    all_gather_object = _collective("all_gather_object")
    barrier = _collective("barrier")
    broadcast = _collective("broadcast", "src", counted=0)
    broadcast_object_list = _collective("broadcast_object_list", "src")
    reduce = _collective("reduce", "dst", counted=0)
    _send = _collective("send", "dst")
    _isend = _collective("isend", "dst")

    def send(self, tensor, *args, group=None, **kwargs):
        self._p2p("send", args[0] if args else kwargs.get("dst"), group)
        self._sent(_nbytes(tensor), group, routable=True)
        return self._send(tensor, *args, group=group, **kwargs)

    def isend(self, tensor, *args, group=None, **kwargs):
        self._p2p("send", args[0] if args else kwargs.get("dst"), group)
        self._sent(_nbytes(tensor), group, routable=True)
        return self._isend(tensor, *args, group=group, **kwargs)
    _irecv = _collective("irecv", "src")

    def irecv(self, tensor, *args, group=None, **kwargs):
        self._p2p("recv", args[0] if args else kwargs.get("src"), group)
        return self._tampered(self._irecv(tensor, *args, group=group, **kwargs), tensor, group)

    def recv(self, tensor, src=None, group=None, tag=0):
        self._p2p("recv", src, group)
        if group is not None:
            return dist.recv(tensor, src, group=group, tag=tag)
        sender = dist.recv(tensor, None if src is None else self._global(src),
                           group=self.group, tag=tag)
        self._tampered(None, tensor)
        return sender if self.group is None else dist.get_group_rank(self.group, sender)

    del _collective


def _refusing(function: Callable, library: tuple[str, ...], piece: str) -> Callable:
    """`function`, with minidist's version of `piece` refused while it runs."""
    if not library:
        return function

    def refusing(*args, **kwargs):
        with unavailable(*library, reason=f"the job runs your piece {piece!r}, not minidist's"):
            return function(*args, **kwargs)

    refusing.__name__ = refusing.__qualname__ = function.__name__
    refusing.__wrapped__ = function
    return refusing


class _OnePerGroup:
    """Every piece's functions on one group, and `dist`, torch.distributed on it. A piece is
    made as one of its functions is first looked up here: its lab's cells run on this group
    only for the labs the job uses on it (two or three of six, in each of its ranks)."""

    def __init__(self, dist: _OnGroup, functions_of: Callable[[Piece], dict[str, Any]]):
        self.dist, self._functions_of = dist, functions_of

    def __getattr__(self, name: str) -> Any:
        piece = next((piece for piece in PIECES if name in piece.functions), None)
        if piece is None:
            raise AttributeError(f"no piece has a function {name!r}; the pieces' functions "
                                 f"are {', '.join(f for p in PIECES for f in p.functions)}")
        vars(self).update(self._functions_of(piece))
        return vars(self)[name]

    def __dir__(self) -> list[str]:
        return [*super().__dir__(), *(name for piece in PIECES for name in piece.functions)]


class Pieces:
    """The job's pieces, from a pieces file (see the module doc); made by `load`."""

    def __init__(self, text: str, minidist_for: Iterable[str], source: str,
                 impl: str = "torch"):
        self._cells, self.source, self.impl = _split(text), source, impl
        self.minidist_for = tuple(minidist_for)
        self.status = status(text)
        self.whose = {piece.name: "yours" if piece.name not in self.minidist_for
                      else f"minidist's (your choice; yours is {self.status[piece.name]})"
                      for piece in PIECES}
        self._bound: dict[Any, _OnePerGroup] = {}

    def on(self, group: dist.ProcessGroup | None) -> _OnePerGroup:
        """Every piece's functions, their `dist` meaning `group` (None: the whole world);
        `.dist` is that torch.distributed itself."""
        key = id(group) if group is not None else None
        if key not in self._bound:
            self._bound[key] = self._build(group)
        return self._bound[key]

    def _build(self, group) -> _OnePerGroup:
        bound = _OnGroup(group, self.impl)  # torch.distributed as the pieces see it
        namespaces: dict[str, dict] = {}

        def functions_of(piece: Piece) -> dict[str, Any]:
            if piece.name in self.minidist_for:
                namespace = {"__name__": f"minidist_{piece.name}", "dist": bound}
                exec("import torch\n" + _MINIDIST[piece.name], namespace)  # noqa: S102
                return {name: _counted(namespace[name], piece.name)
                        if isinstance(namespace[name], types.FunctionType) else namespace[name]
                        for name in piece.functions}
            if piece.lab not in namespaces:
                namespaces[piece.lab] = self._run_lab(piece.lab, bound)
            return {name: self._wrap(namespaces[piece.lab][name], piece)
                    for name in piece.functions}
        return _OnePerGroup(bound, functions_of)

    def _wrap(self, value: Any, piece: Piece) -> Any:
        if isinstance(value, types.FunctionType):
            return _counted(_refusing(value, piece.library, piece.name), piece.name)
        return value  # a class (f, g): its methods run inside the functions that apply them

    def _run_lab(self, lab: str, bound: _OnGroup) -> dict:
        """The lab's section run in a namespace of its own: its imports, then `dist` bound to
        the group, then its cells in order (so a default argument such as
        `all_reduce=dist.all_reduce` binds the group too). minidist's version of each of the
        lab's pieces the job runs as yours is refused meanwhile, as while they run: a table of
        the library's answers built as the section runs is not yours either."""
        namespace: dict[str, Any] = {"__name__": f"pieces_{lab}"}
        cells = [(grade_id, source) for (name, grade_id), source in self._cells.items()
                 if name == lab]
        library = [path for piece in PIECES if piece.lab == lab
                   and piece.name not in self.minidist_for for path in piece.library]
        runs = any(_runs_code(source) for _, source in cells)  # not only definitions
        refused = (unavailable(*library, reason=f"the job runs your Lab {lab[:2]} pieces, not "
                                                f"minidist's") if library and runs
                   else contextlib.nullcontext())
        with refused:
            for grade_id, source in cells:
                if grade_id == _IMPORTS:
                    exec(compile(source, f"{self.source} ({lab} imports)", "exec"), namespace)  # noqa: S102
            namespace["dist"] = bound
            for grade_id, source in cells:
                if grade_id != _IMPORTS:
                    exec(compile(source, f"{self.source} ({lab} {grade_id})", "exec"), namespace)  # noqa: S102
        return namespace

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.on(None), name)

    def report(self) -> str:
        """One line per piece: its name, lab, what it is, and whose version the job runs."""
        return "\n".join(f"{piece.name:10s} Lab {piece.lab[:2]} {piece.what:38s} "
                         f"{self.whose[piece.name]}" for piece in PIECES)


def load(path: str | Path, minidist_for: Iterable[str] = (), impl: str = "torch") -> Pieces:
    """The pieces in the file `path` (see `export`), with minidist's version of each piece
    named in `minidist_for`; their all-reduces run by `impl` ("torch", or "ring" on an emulated
    network, so that its links delay them). Raises MissingPiece, naming the piece and the
    fixes, if a piece not named there is unfinished or missing; checked before anything
    communicates."""
    minidist_for = tuple(minidist_for)
    unknown = [name for name in minidist_for if name not in BY_NAME]
    if unknown:
        raise ValueError(f"minidist_for names {unknown}, which are no pieces; the pieces are "
                         f"{', '.join(BY_NAME)}")
    path = Path(path)
    if not path.exists():
        raise MissingPiece(f"{path} does not exist: run `python tools/my_labs.py export` and "
                           f"put what it wrote in the notebook's my_pieces.py cell")
    text = path.read_text()
    found = status(text)
    lacking = [name for name, state in found.items()
               if state != "finished" and name not in minidist_for]
    if lacking:
        lines = [f"  {name}: Lab {BY_NAME[name].lab} ({BY_NAME[name].what}): " + ", ".join(
                     f"cell {cell} is {state}"
                     for cell, state in unfinished_cells(text, BY_NAME[name]).items())
                 for name in lacking]
        raise MissingPiece(
            f"{path}: the job needs these pieces, which are not finished:\n" + "\n".join(lines)
            + f"\nEither finish them in their lab and export again (python tools/my_labs.py "
              f"export), or run minidist's version of each instead: "
              f"minidist_for={tuple(lacking)!r}")
    if impl not in ("torch", "ring"):
        raise ValueError(f"impl={impl!r}: use 'torch' or 'ring'")
    _write_usage_at_exit()
    return Pieces(text, minidist_for, str(path), impl)
