"""The course as a class meets it, from fresh clones: the instructor guide word for word, the
student release, and course updates that never overwrite a student's work.

Each clone reuses this checkout's .venv through a symlink (installing takes minutes); the
guide's commands run literally, one ```bash block after another.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import socket
import subprocess
import tarfile
import time
from pathlib import Path

import nbformat
import pytest
import requests
from nbclient import NotebookClient
from nbgrader.api import Gradebook
from test_grading import (
    HIDDEN_TESTS,
    answered,
    failure_part,
    read_notebook,
    secret_lines,
    split_region,
)

# One worker runs them all, so the fresh clone that the guide's commands grade is made once.
pytestmark = pytest.mark.xdist_group("classroom")

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "solutions" / "README.md"
BLOCK_LIMIT_S = 300
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=\S+$")  # a block like `LAB=00_first_ranks`


def sh(command: str, cwd: Path, timeout: float = BLOCK_LIMIT_S, **env: str) -> str:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", command], cwd=cwd, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, **env},
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"`{command}` failed ({done.returncode}):\n{failure_part(output)}"
    return output


def fresh_clone(tmp_path: Path, name: str = "course") -> Path:
    clone = tmp_path / name
    sh(f"git clone --quiet {REPO} {clone}", tmp_path)
    (clone / ".venv").symlink_to(REPO / ".venv")
    return clone


def bash_blocks(markdown: str) -> list[str]:
    return [block.strip() for block in re.findall(r"^```bash\n(.*?)^```", markdown, re.M | re.S)]


def keep_the_installed_venv(folder: Path) -> None:
    """Make's install stamp in the shared .venv is newer than these files, so `make lab` does
    not reinstall the course into it from this folder."""
    for name in ("requirements.txt", "pyproject.toml"):
        os.utime(folder / name, (0, 0))


@pytest.fixture(scope="module")
def guided(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A fresh clone, the guide's blocks in order. Before the block that collects from
    incoming/, two students' notebooks are saved there, as the guide says: one with every
    answer filled in from the solution, one as released."""
    clone = fresh_clone(tmp_path_factory.mktemp("guide"))
    variables: list[str] = []
    lab = None
    outputs = {}
    for block in bash_blocks(GUIDE.read_text()):
        if "incoming/$LAB" in block:
            released = read_notebook(clone / "labs" / lab / f"{lab}.ipynb")
            solution = read_notebook(clone / "solutions" / lab / f"{lab}.ipynb")
            incoming = clone / "incoming" / lab
            incoming.mkdir(parents=True)
            nbformat.write(answered(released, solution), incoming / "full.ipynb")
            nbformat.write(released, incoming / "zero.ipynb")
        outputs[block] = sh("\n".join([*variables, block]), clone)
        if all(ASSIGNMENT.match(line) for line in block.splitlines()):
            variables += block.splitlines()
            lab = dict(line.split("=", 1) for line in variables).get("LAB", lab)
    assert lab, "the guide never sets LAB"
    return {"clone": clone, "lab": lab, "outputs": outputs}


def test_guide_runs_word_for_word_from_a_fresh_clone(guided: dict) -> None:
    clone, lab = guided["clone"], guided["lab"]
    with Gradebook(f"sqlite:///{clone / 'gradebook.db'}") as gradebook:
        max_score = gradebook.find_assignment(lab).max_score
        full = gradebook.find_submission(lab, "full").score
        zero = gradebook.find_submission(lab, "zero").score
    assert max_score > 0 and (full, zero) == (max_score, 0), (full, zero, max_score)
    for student in ("full", "zero"):
        assert (clone / "feedback" / student / lab / f"{lab}.html").exists()
    with open(clone / "grades.csv") as exported:
        rows = list(csv.DictReader(exported))
    mine = {row["student_id"]: row for row in rows if row["assignment"] == lab}
    assert mine["full"]["status"] == mine["zero"]["status"] == "submitted"
    assert float(mine["zero"]["score"]) == 0 and float(mine["full"]["score"]) == max_score
    # The other labs are in the gradebook too (the set-up step), and nobody handed them in.
    others = [row for row in rows if row["assignment"] != lab]
    assert others and all(r["status"] == "not submitted" and r["score"] == "" for r in others)


def test_guide_explains_autogrades_warnings_and_formgrader(guided: dict) -> None:
    guide = " ".join(GUIDE.read_text().split())
    autograde = next(out for block, out in guided["outputs"].items() if "autograde" in block)
    for warning in ("Attribute 'checksum' for cell", "Object of type <SubmittedAssignment> not "
                    "in session", "Object of type <SubmittedNotebook> not in session",
                    "Kernel is running over TCP without encryption"):
        if warning in autograde:
            assert warning in guide, f"autograde prints {warning!r}: the guide should explain it"
    assert "Formgrader" in guide


# --- The student release --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_text(folder: Path, skip: tuple[str, ...] = ()) -> str:
    texts = []
    for path in folder.rglob("*"):
        parts = path.relative_to(folder).parts
        if path.is_file() and ".venv" not in parts and parts[0] not in skip:
            texts.append(path.read_bytes().decode("utf-8", "replace"))
    return "\n".join(texts)


def hidden_test_lines(notebook: Path) -> set[str]:
    lines = set()
    for cell in read_notebook(notebook).cells:
        lines |= {line.strip() for line in split_region(cell.source, HIDDEN_TESTS)[1]}
    return {line for line in lines if len(line) >= 6}


def test_student_release_has_no_solutions_and_make_lab_opens_the_labs(guided: dict) -> None:
    clone = guided["clone"]
    release = clone / "release" / "scaling-lab"
    assert release.is_dir(), "the guide's `make release` should write release/scaling-lab/"
    names = {path.name for path in release.iterdir()}
    assert not names & {"solutions", "tests", "nbgrader_config.py", "cluster_setup"}
    assert not (release / "tools" / "grading").exists(), "the grading tooling is instructors' only"
    assert {"labs", "lib", "slides", "bench", "README.md", "requirements.txt", "Makefile"} <= names
    # The benchmarks the labs and README send students to ship; the scripts that drive the
    # hidden tests and the fakes do not.
    for shipped in ("gpu_check.py", "allreduce_busbw.py"):
        assert (release / "bench" / shipped).exists(), f"bench/{shipped} is not in the release"
    assert not (release / "bench" / "self_grade_every_lab.py").exists()
    assert not (release / "bench" / "grading_on_any_machine.py").exists()
    assert not (release / "bench" / "lab_run_times.py").exists()  # it runs solutions/
    assert not list(release.rglob("gradebook.db"))
    text = all_text(release)
    notebooks = sorted((clone / "solutions").glob("*/*.ipynb"))
    # Lines of solutions and hidden tests that no released lab shows (one lab's solution may be
    # another's given code).
    released = "\n".join(path.read_text() for path in release.glob("labs/*/*.ipynb"))
    secrets = {
        line for path in notebooks for line in secret_lines(read_notebook(path))
        if json.dumps(line, ensure_ascii=False)[1:-1] not in released
    }
    hidden = secrets & set().union(*map(hidden_test_lines, notebooks))
    assert hidden and "BEGIN HIDDEN TESTS" not in text and "BEGIN SOLUTION" not in text
    # minidist (lib/) is the reference students compare their code with, by design, and shares
    # generic lines with solutions; nothing else in the release may show a line of a solution
    # or a hidden test.
    shown = {line.strip() for line in all_text(release, skip=("lib",)).splitlines()}
    shown |= {line.strip() for path in release.rglob("*.ipynb")
              for cell in read_notebook(path).cells for line in cell.source.splitlines()}
    assert not (found := sorted(secrets & shown)), f"solution or hidden-test lines: {found}"
    with tarfile.open(clone / "release" / "scaling-lab.tar.gz") as tarball:
        members = {name.split("/")[1] for name in tarball.getnames() if "/" in name}
    assert members == names

    (release / ".venv").symlink_to(REPO / ".venv")
    keep_the_installed_venv(release)
    port, token = free_port(), "release-test-token"
    log = open(release / "lab.log", "w")
    server = subprocess.Popen(
        ["timeout", "120", "make", "lab"], cwd=release, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "JUPYTER_PORT": str(port), "JUPYTER_TOKEN": token, "BROWSER": "true"},
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                listing = requests.get(f"{url}/api/contents", params={"token": token}, timeout=5)
                if listing.status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert server.poll() is None, (release / "lab.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "JupyterLab did not answer within 90 s"
            time.sleep(0.5)
        opened = sorted(item["name"] for item in listing.json()["content"])
        # The labs, and the reference page they link to (tools/my_labs.py puts it beside them).
        labs = sorted([*(path.name for path in (release / "labs").iterdir()), "REFERENCES.md"])
        assert opened == labs, f"JupyterLab opened {opened}, expected copies of {labs}"
        page = requests.get(f"{url}/lab", params={"token": token}, timeout=10).text
        for plugin in ("formgrader", "create-assignment", "menu"):  # menu: an empty Nbgrader menu
            assert f"@jupyter/nbgrader:{plugin}" in page.split('"disabledExtensions"')[1][:2000]
        formgrader = requests.get(f"{url}/formgrader", params={"token": token}, timeout=10)
        assert formgrader.status_code == 404, "Formgrader is served in the students' JupyterLab"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


# --- Course updates ------------------------------------------------------------------------


def test_update_keeps_the_students_edits_and_brings_the_change(tmp_path: Path) -> None:
    upstream = fresh_clone(tmp_path, "upstream")  # the course as published
    sh("git config user.email staff@example.org && git config user.name Staff", upstream)
    student = tmp_path / "student"
    sh(f"git clone --quiet {upstream} {student}", tmp_path)
    (student / ".venv").symlink_to(REPO / ".venv")
    keep_the_installed_venv(student)
    sh(".venv/bin/python tools/my_labs.py copy", student)  # what `make lab` does first
    lab = sorted(path.name for path in (student / "labs").iterdir())[1]
    mine = student / "my-labs" / lab / f"{lab}.ipynb"
    edited = nbformat.read(mine, as_version=4)
    edited.cells[0].source += "\n\nMy notes: the ring sends 2(N-1) messages."
    nbformat.write(edited, mine)

    fixed = nbformat.read(upstream / "labs" / lab / f"{lab}.ipynb", as_version=4)
    fixed.cells[0].source += "\n\nCourse fix: a clearer sentence."
    nbformat.write(fixed, upstream / "labs" / lab / f"{lab}.ipynb")
    new_lab = "99_new_lab"
    (upstream / "labs" / new_lab).mkdir()
    nbformat.write(nbformat.v4.new_notebook(), upstream / "labs" / new_lab / f"{new_lab}.ipynb")
    sh("git add labs && git commit --quiet -m 'Course fix'", upstream)

    keep_the_installed_venv(student)
    said = sh("make update", student)
    assert f"{lab} changed" in said and f"{new_lab} is new" in said, said
    assert nbformat.read(mine, as_version=4).cells[0].source == edited.cells[0].source
    beside = list(mine.parent.glob(f"{lab}.updated-*.ipynb"))
    assert len(beside) == 1, list(mine.parent.iterdir())
    assert "Course fix" in nbformat.read(beside[0], as_version=4).cells[0].source
    assert (student / "my-labs" / new_lab / f"{new_lab}.ipynb").exists()
    assert "none of your labs changed" in sh("make update", student)


def test_labs_reference_links_resolve_in_my_labs_and_updates_keep_an_edited_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """JupyterLab serves my-labs/ and nothing above it, so the labs link the reference page as
    ../REFERENCES.md: my_labs.py puts the course's page there, refreshes it when the course
    changes it, and keeps a copy the student edited (the new one goes beside it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("my_labs", REPO / "tools" / "my_labs.py")
    my_labs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(my_labs)
    course, mine = tmp_path / "labs", tmp_path / "my-labs"
    (course / "13_long_context").mkdir(parents=True)
    (course / "13_long_context" / "13_long_context.ipynb").write_text("{}")
    references = tmp_path / "REFERENCES.md"
    references.write_text('<a id="ring-attention"></a>\n')
    for name, value in {"ROOT": tmp_path, "COURSE": course, "MINE": mine,
                        "COPIED_FROM": mine / ".course", "REFERENCES": references}.items():
        monkeypatch.setattr(my_labs, name, value)

    my_labs.copy()
    copied = mine / "REFERENCES.md"
    assert copied.read_text() == references.read_text()
    for notebook in sorted(REPO.glob("labs/*/*.ipynb")):
        for target in re.findall(r"\]\(([^)#]*REFERENCES\.md)", notebook.read_text()):
            reached = (mine / notebook.parent.name / target).resolve()
            assert reached == copied.resolve(), (
                f"{notebook.relative_to(REPO)} links {target}: from my-labs/ that is {reached}, "
                f"not my-labs/REFERENCES.md (write ../REFERENCES.md)")

    references.write_text('<a id="ring-attention"></a>\n<a id="gqa"></a>\n')
    my_labs.update()
    assert copied.read_text() == references.read_text(), "update left the old page"
    copied.write_text("my notes\n")
    references.write_text('<a id="gqa"></a>\n')
    my_labs.update()
    assert copied.read_text() == "my notes\n", "update overwrote the student's edited copy"
    beside = list(mine.glob("REFERENCES.updated-*.md"))
    assert len(beside) == 1 and beside[0].read_text() == references.read_text(), beside


# --- Saved notebooks -----------------------------------------------------------------------


def test_progress_bars_leave_text_not_widget_placeholders(tmp_path: Path) -> None:
    """A widget progress bar saved without its widget state reopens as "Error displaying
    widget: model not found"; minidist's progress bars are text."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from minidist.communication.bandwidth import measure\n"
        "rows = measure(2, [1024], collective='all_reduce', iters=1, repeats=1)"
    )])
    NotebookClient(notebook, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = notebook.cells[0].outputs
    view = "application/vnd.jupyter.widget-view+json"
    widgets = [output for output in outputs if view in output.get("data", {})]
    assert not widgets, widgets
    assert "all_reduce on 2 ranks" in "".join(o.get("text", "") for o in outputs), outputs
