"""Fakes of Lab 14's two exercises: the pieces (my_pieces.py) and the job (my_job.py).

Each is the solution's file with one mechanism taken out, so that it still runs and still
gets most numbers right: a job that trains the whole model on every rank, one whose pipeline
runs every stage everywhere, a resume that replays from step 0; pieces that hard-code the
lab's case, that schedule GPipe where 1F1B was asked, that only call minidist's. The fakes are
made from the solution notebook's own cells, each edit checked to apply, so that a fake never
silently becomes the solution."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fakes import Fake

_REPO = Path(__file__).resolve().parents[2]
_NOTEBOOK = _REPO / "solutions" / "14_capstone" / "14_capstone.ipynb"
sys.path.insert(0, str(_REPO / "lib"))
from minidist.jobs import pieces  # noqa: E402


def _region(grade_id: str) -> str:
    """The solution region of a cell of the solution notebook, as its lines stand."""
    for cell in json.loads(_NOTEBOOK.read_text())["cells"]:
        if cell["metadata"].get("nbgrader", {}).get("grade_id") == grade_id:
            source = "".join(cell["source"])
            return source.split("### BEGIN SOLUTION\n", 1)[1].split("### END SOLUTION", 1)[0]
    raise KeyError(grade_id)


def _edit(text: str, *changes: tuple[str, str]) -> str:
    for old, new in changes:
        assert text.count(old) == 1, (
            f"tests/fakes/14_capstone.py: {old!r} is not in the solution once")
        text = text.replace(old, new)
    return text


_JOB = _region("impl-my-job")
_PIECES = _region("impl-pieces")

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

# No pipeline, no data parallelism: every rank trains the whole model on the whole batch.
_NO_MESH = _EVERY_STAGE + (
    ("rows = slice(coords[\"dp\"] * config.batch // config.dp,\n"
     "                     (coords[\"dp\"] + 1) * config.batch // config.dp)",
     "rows = slice(0, config.batch)"),
    ("            if config.dp > 1:\n"
     "                self.dp.all_reduce_gradients_flat(self.stage)\n", ""),
)

# Replay: read the checkpoint's step, then train again from the start up to it.
_REPLAY = (
    ("self.resumed_from = self.step_index = self.restore(found)",
     'self.resumed_from = json.loads((found / "job.json").read_text())["step"]\n'
     "            for _ in range(self.resumed_from):\n"
     "                self.step()"),
)


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
             ("test-pieces",), _edit(
                 _PIECES,
                 ("        warmup = min(p - 1 - rank, m)\n",
                  "        warmup = m  # every forward first\n"))),
        Fake("hard-coded bytes", "bytes_per_dimension returns the lab's own case's bytes "
             "instead of the formulas", ("test-pieces",), _edit(
                 _PIECES,
                 ("    activation = b * s * h * bytes_per_element\n",
                  "    return {\"tp\": 262144, \"pp\": 32768, \"dp\": 55040}\n"
                  "    activation = b * s * h * bytes_per_element\n"))),
        Fake("minidist's pieces", "every function only calls minidist's version of its piece",
             ("test-pieces",), _minidist_pieces()),
    ],
    "impl-my-job": [
        Fake("every stage on every rank", "the 'pipeline' holds and runs the whole model on "
             "every rank: no stages, no activations sent", ("test-equal",),
             _edit(_JOB, *_EVERY_STAGE)),
        Fake("replayed resume", "the restarted job reads the checkpoint's step, then trains "
             "again from step 0 up to it instead of loading the state", ("test-resume",),
             _edit(_JOB, *_REPLAY)),
        Fake("one rank's copy", "every rank trains the whole model on the whole batch by itself "
             "and reports the same numbers: no stages, no replicas, nothing averaged",
             ("test-equal",),
             _edit(_JOB, *_NO_MESH)),
    ],
}
