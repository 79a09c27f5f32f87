"""Lab 14's pieces of library: the reversal task and its optimum, and the export and loading
of a student's own functions (minidist.jobs.tasks, minidist.jobs.pieces, tools/my_labs.py
export). The lab itself is graded by tests/test_grading.py."""

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from minidist.core.launch import run
from minidist.jobs import pieces
from minidist.jobs.tasks import ProblemStream, Reversal

REPO = Path(__file__).resolve().parents[1]


def test_reversal_problems_their_optimum_and_how_they_read():
    task = Reversal(8)
    ids, targets = task.problems(5, torch.Generator().manual_seed(0))
    assert ids.shape == targets.shape == (5, 16)
    assert torch.equal(ids[:, 1:], targets[:, :-1])  # targets are the next tokens
    assert torch.equal(targets[:, task.answer], ids[:, :8].flip(1))
    assert (ids[:, 8] == 10).all()  # "=" after the prompt
    assert task.optimum() == pytest.approx(7 * math.log(10) / 16)
    perfect = torch.nn.functional.one_hot(targets, 11).float() * 50
    assert task.exact_match(perfect, targets) == 1.0
    line = task.show(ids[:1], perfect[:1])
    assert line.endswith("✓") and line[:8][::-1] == line[9:17]
    with pytest.raises(ValueError, match="digits"):
        Reversal(1)


def test_a_stream_resumes_from_its_state():
    stream = ProblemStream(Reversal(4), seed=3)
    stream.next_batch(2)
    saved = stream.state_dict()
    after = stream.next_batch(2)
    again = ProblemStream(Reversal(4), seed=99)
    again.load_state_dict(saved)
    assert torch.equal(again.next_batch(2)[0], after[0])


def test_export_of_the_solutions_has_every_piece_finished(tmp_path: Path):
    text = pieces.export(REPO / "solutions", tmp_path / "pieces.py")
    assert set(pieces.status(text).values()) == {"finished"}
    assert "BEGIN SOLUTION" not in text and "print(" not in text.split('"""', 2)[2]
    assert pieces.load(tmp_path / "pieces.py").whose == dict.fromkeys(
        (p.name for p in pieces.PIECES), "yours")


def test_an_unfinished_piece_is_named_with_both_fixes(tmp_path: Path):
    labs = tmp_path / "my-labs"
    for lab in {p.lab for p in pieces.PIECES}:
        shutil.copytree(REPO / "labs" / lab, labs / lab)  # the released labs: every stub unwritten
    text = pieces.export(labs, tmp_path / "pieces.py")
    assert set(pieces.status(text).values()) == {"unfinished"}
    with pytest.raises(pieces.MissingPiece, match=r"(?s)tp: Lab 05_tensor_parallel.*minidist_for="):
        pieces.load(tmp_path / "pieces.py")
    every = tuple(p.name for p in pieces.PIECES)
    chosen = pieces.load(tmp_path / "pieces.py", minidist_for=every)
    assert all(whose.startswith("minidist's") for whose in chosen.whose.values())
    with pytest.raises(ValueError, match="no pieces"):
        pieces.load(tmp_path / "pieces.py", minidist_for=("ddp",))
    missing = pieces.export(tmp_path / "nowhere")
    assert set(pieces.status(missing).values()) == {"missing"}


def _on_a_group(rank, world_size, path, minidist_for):
    loaded = pieces.load(path, minidist_for)
    groups = loaded.build_groups({"dp": 2, "tp": 2})
    group, ranks = groups["dp"]
    on = loaded.on(group)
    # Lab 06's executor sends to stage index r: on the dp group, the group's rank r.
    schedule = on.one_f_one_b(2, 2)
    stage = torch.nn.Linear(3, 3)
    torch.manual_seed(0)
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    losses = on.run_schedule(schedule, on.dist.get_rank(), stage, x, y,
                             torch.nn.functional.mse_loss, (2, 3))
    grad = torch.full((2,), float(rank))
    on.dist.all_reduce(grad)
    return (ranks, on.dist.get_rank(), on.dist.get_world_size(), losses, grad.tolist(),
            dist.get_rank())


@pytest.mark.parametrize("minidist_for", [(), ("mesh", "pp")])
def test_a_piece_runs_on_its_group_yours_or_minidists(tmp_path: Path, minidist_for):
    pieces.export(REPO / "solutions", tmp_path / "pieces.py")
    results = run(_on_a_group, 4, str(tmp_path / "pieces.py"), minidist_for)
    for ranks, group_rank, size, losses, grad, rank in results:
        assert ranks == [rank % 2, rank % 2 + 2] and group_rank == ranks.index(rank) and size == 2
        assert grad == [float(sum(ranks))] * 2  # summed over the dp group only
        assert (len(losses) == 2) == (group_rank == 1)  # the last stage reports the losses


def test_my_labs_export_writes_beside_lab_14(tmp_path: Path, monkeypatch):
    import sys
    sys.path.insert(0, str(REPO / "tools"))
    import my_labs
    monkeypatch.setattr(my_labs, "MINE", REPO / "solutions")
    monkeypatch.setattr(my_labs, "EXPORTED", tmp_path / "14_capstone" / "exported_pieces.py")
    my_labs.export()
    assert "def run_schedule" in (tmp_path / "14_capstone" / "exported_pieces.py").read_text()
