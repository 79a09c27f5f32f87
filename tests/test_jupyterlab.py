"""The course as a student opens it: `make lab`'s JupyterLab in a real (headless) Chromium,
cells run through the UI, and what appears on the page.

JupyterLab starts exactly as `make lab` starts it (the students' configuration from
tools/jupyter-student-config, on loopback, with a token), in a temporary copy of the course
whose labs `make lab` copies into my-labs/, under a time limit, logging to a file, and is
stopped by its process id. Playwright drives the system's Chromium. On a failure the page's
screenshot is saved, and its path given in the message.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from test_slides import chromium_or_skip

pytestmark = pytest.mark.xdist_group("jupyterlab")

REPO = Path(__file__).resolve().parents[1]
SERVER_LIMIT_S = 900  # `timeout` ends the server even if this test never gets to
START_LIMIT_S = 120
CELL_LIMIT_MS = 60_000
PANEL = ".jp-NotebookPanel"
COURSE_FILES = ["labs", "tools/my_labs.py", "tools/jupyter-student-config", "Makefile",
                "requirements.txt", "pyproject.toml"]

ABORT_CELL = """\
def heap_corrupted(rank, world_size):
    if rank == 1:
        print(f"dying at {time.monotonic()}", flush=True)
        print("malloc(): unaligned tcache chunk detected", file=sys.stderr, flush=True)
        os.abort()
    dist.barrier()

import sys, time
try:
    run(heap_corrupted, 2)
finally:
    print(f"reported at {time.monotonic()}")"""
RING_CELL = """\
def everyone_receives_first(rank, world_size):
    token = torch.zeros(1)
    dist.recv(token, src=(rank - 1) % world_size)
    dist.send(token, dst=(rank + 1) % world_size)

run(everyone_receives_first, 4, timeout=15)"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(the JupyterLab URL with its token, the course folder) of a running `make lab`."""
    course = tmp_path_factory.mktemp("course")
    for name in COURSE_FILES:
        source, target = REPO / name, course / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        else:
            shutil.copy2(source, target)
    (course / ".venv").symlink_to(REPO / ".venv")
    for name in ("requirements.txt", "pyproject.toml"):  # make: the venv is up to date
        os.utime(course / name, (0, 0))
    port, token = free_port(), "browser-test-token"
    log_path = course / "lab.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            ["timeout", str(SERVER_LIMIT_S), "make", "lab"], cwd=course, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "JUPYTER_PORT": str(port), "JUPYTER_TOKEN": token,
                 "BROWSER": "true"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_LIMIT_S
        while True:
            try:
                if requests.get(f"{url}/api/status", params={"token": token},
                                timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert server.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, (f"JupyterLab did not answer within "
                                                 f"{START_LIMIT_S} s:\n{log_path.read_text()}")
            time.sleep(0.5)
        yield f"{url}?token={token}", course
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.fixture(scope="module")
def browser():
    from build import chromium

    with chromium(chromium_or_skip()) as running:
        yield running


class Lab:
    """One notebook open in JupyterLab, driven as a student would: click, type, Shift+Enter."""

    def __init__(self, browser, server: str, notebook: str, shots: Path):
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.shots, self.name = shots, Path(notebook).stem
        base, token = server.split("?")
        # ?reset: a fresh workspace, not the tabs the previous page left open.
        self.page.goto(f"{base}/lab/tree/{notebook}?reset&{token}")
        self.page.wait_for_selector(f"{PANEL} .jp-Cell.jp-mod-active", timeout=CELL_LIMIT_MS)
        self.page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                                    timeout=CELL_LIMIT_MS)

    def position(self) -> tuple[int, int]:
        """(index of the selected cell, number of cells), from the status bar's "Cell 3/30":
        the notebook renders only the cells near the view, so the page cannot be counted."""
        text = self.page.locator("#jp-main-statusbar").inner_text()
        at, total = map(int, re.search(r"Cell (\d+)/(\d+)", text).groups())
        return at - 1, total

    def select(self, index: int):
        """Move the selection to cell `index` with the keyboard, as a student pages through a
        notebook (J and K in command mode; the notebook scrolls along); the cell's locator."""
        self.page.keyboard.press("Escape")
        at = self.position()[0]
        while at != index:
            self.page.keyboard.press("j" if at < index else "k")
            at = self.moved_from(at)
        return self.page.locator(f"{PANEL} .jp-Cell.jp-mod-active")

    def moved_from(self, at: int, limit_s: float = 5) -> int:
        """The selected cell's index once the status bar shows it has left cell `at`: it
        lags behind the keys, and reading it too soon would press one key too many."""
        deadline = time.monotonic() + limit_s
        while (now := self.position()[0]) == at and time.monotonic() < deadline:
            time.sleep(0.05)
        return now

    def start(self, index: int) -> None:
        """Select cell `index` and press the toolbar's Run button (run it, select the next)."""
        self.select(index)
        self.page.locator(f"{PANEL} .jp-NotebookPanel-toolbar "
                          "[data-command='notebook:run-cell-and-select-next']").click()
        self.moved_from(index)

    def run(self, index: int, limit_ms: int = CELL_LIMIT_MS):
        """Run cell `index`, go back to it and wait until it has run. A freshly opened notebook
        can drop the first run while its kernel connection settles (its prompt stays "[ ]:"),
        so a run that has not started within a few seconds is started again, as a student
        would press Run again."""
        for _ in range(3):
            self.start(index)
            cell = self.select(index)
            prompt = cell.locator(".jp-InputPrompt")
            deadline = time.monotonic() + 5
            while prompt.inner_text().strip() == "[ ]:" and time.monotonic() < deadline:
                time.sleep(0.2)
            if prompt.inner_text().strip() != "[ ]:":
                break
        self.wait_done(cell, limit_ms)
        return cell

    def wait_done(self, cell, limit_ms: int = CELL_LIMIT_MS) -> None:
        prompt = cell.locator(".jp-InputPrompt")
        deadline = time.monotonic() + limit_ms / 1000
        while not re.fullmatch(r"\[\d+\]:", prompt.inner_text().strip()):
            assert time.monotonic() < deadline, f"cell still running: {cell.inner_text()[:500]}"
            time.sleep(0.2)

    def add_cell(self, code: str) -> int:
        """A new code cell at the end, with `code` typed in (inserted, not key by key: the
        editor would indent each typed line once more); returns its index."""
        last = self.position()[1] - 1
        self.select(last)
        self.page.keyboard.press("b")  # command mode: a new cell below
        self.page.keyboard.press("Enter")  # edit it
        self.page.keyboard.insert_text(code)
        self.page.keyboard.press("Escape")
        return last + 1

    def shot(self, label: str) -> Path:
        path = self.shots / f"{self.name}-{label}.png"
        self.page.screenshot(path=str(path), full_page=False)
        return path


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    folder = tmp_path / "screenshots"
    folder.mkdir()
    return folder


def checked(lab: Lab, check) -> None:
    """Run `check()`; on a failure save the page's screenshot and name it in the error."""
    try:
        check()
    except Exception as error:
        path = lab.shot("failure")
        raise AssertionError(f"{error}\n(screenshot: {path})") from error
    lab.shot("end")


def test_lab00_in_jupyterlab_shows_outputs_and_the_rank_reports(browser, lab_server, shots):
    server, course = lab_server
    assert (course / "my-labs" / "00_first_ranks" / "00_first_ranks.ipynb").exists()
    lab = Lab(browser, server, "00_first_ranks/00_first_ranks.ipynb", shots)

    def check():
        menus = lab.page.locator("#jp-MainMenu .lm-MenuBar-itemLabel").all_inner_texts()
        assert "File" in menus and "Nbgrader" not in menus, f"menu bar: {menus}"
        base, token = server.split("?")
        assert requests.get(f"{base}/formgrader?{token}", timeout=10).status_code == 404

        lab.run(2)  # imports
        hello = lab.run(4).locator(".jp-OutputArea").inner_text()
        for rank in range(4):
            assert f"[rank{rank}] hello from rank {rank} of 4" in hello, hello
        assert "returned: [0, 10, 20, 30]" in hello

        crash = lab.run(14).locator(".jp-OutputArea").inner_text()
        assert "RankError, error.rank = 2" in crash, crash
        assert "rank 2 of 4 failed: ValueError: bad batch on rank 2" in crash
        assert "Traceback from rank 2:\n  Cell In[3], line 3, in rank_two_crashes" in crash

        index = lab.add_cell(ABORT_CELL)
        report = lab.run(index).locator(".jp-OutputArea").inner_text()
        seconds = (float(re.search(r"reported at ([\d.]+)", report)[1])
                   - float(re.search(r"dying at ([\d.]+)", report)[1]))
        assert seconds < 5, f"the native crash was reported {seconds:.1f} s after the rank died"
        assert "RankError: rank 1 of 2 failed: the process was killed by SIGABRT" in report
        assert "glibc found the heap corrupted" in report, report
        assert "  malloc(): unaligned tcache chunk detected" in report
        assert ("Python stack of rank 1 when it died (most recent call last):\n"
                "  Cell In[4], line 5, in heap_corrupted\n    os.abort()") in report, report

        index = lab.add_cell(RING_CELL)
        lab.start(index)
        cell = lab.select(index)
        live = cell.locator(".jp-OutputArea", has_text="still waiting after 5 s: ranks 0–3 in recv")
        live.wait_for(timeout=20_000)
        lab.shot("live-line")
        lab.wait_done(cell)
        report = cell.locator(".jp-OutputArea").inner_text()
        assert "still waiting" not in report, "the live line should give way to the report"
        assert "RankTimeout: rank(s) 0, 1, 2, 3 of 4 did not finish within 15 s" in report
        assert ("Deadlock: rank 0 waits for 3, 3 for 2, 2 for 1, 1 for 0: nobody sends first."
                in report), report
        assert "ranks 0–3 are all at Cell In[5], line 3: dist.recv(" in report, report

        lab.page.keyboard.press("Control+Shift+c")  # the command palette lists every command
        palette = lab.page.locator(".lm-CommandPalette-content").inner_text().lower()
        lab.page.keyboard.press("Escape")
        assert "formgrader" not in palette and "create assignment" not in palette
        assert "run all cells" in palette, "the palette did not open"

    checked(lab, check)
    lab.page.close()


def test_lab02_widgets_render_and_the_dropdown_shows_each_choice(browser, lab_server, shots):
    server, _ = lab_server
    name = "02_memory_math/02_memory_math.ipynb"
    cells = json.loads((REPO / "labs" / name).read_text())["cells"]
    calculator_cell = next(index for index, cell in enumerate(cells)  # the one-GPU calculator
                           if cell["cell_type"] == "code"
                           and "DeviceMemoryCalculator(" in "".join(cell["source"]))
    lab = Lab(browser, server, name, shots)

    def check():
        lab.run(1)  # imports
        calculator = lab.run(calculator_cell)
        calculator.get_by_label("recompute").wait_for(timeout=CELL_LIMIT_MS)
        assert "Error displaying widget" not in calculator.inner_text()
        assert calculator.locator(".widget-hslider, .widget-slider").count() >= 4
        dropdown = calculator.get_by_label("recompute")
        assert dropdown.evaluate("select => select.value") == "selective"
        for choice in ("none", "full", "selective", "none"):
            dropdown.select_option(label=choice)
            lab.page.wait_for_timeout(300)
            shown = dropdown.evaluate("s => s.selectedIndex >= 0 ? s.options[s.selectedIndex]"
                                      ".text : ''")
            assert shown == choice, f"after choosing {choice!r} the dropdown shows {shown!r}"
        calculator.locator(".jp-OutputArea-output img").last.wait_for(timeout=CELL_LIMIT_MS)
        lab.shot("calculator")
        assert "Error displaying widget" not in lab.page.locator(PANEL).inner_text()

    checked(lab, check)
    lab.page.close()


def test_lab06_bubble_explorer_renders(browser, lab_server, shots):
    server, _ = lab_server
    name = "06_pipeline/06_pipeline.ipynb"
    cells = json.loads((REPO / "labs" / name).read_text())["cells"]
    explorer_cell = next(index for index, cell in enumerate(cells)
                         if "BubbleExplorer(" in "".join(cell["source"]))
    lab = Lab(browser, server, name, shots)

    def check():
        lab.run(1)  # imports
        explorer = lab.run(explorer_cell)
        explorer.locator(".widget-hslider, .widget-slider").first.wait_for(
            timeout=CELL_LIMIT_MS)
        lab.shot("explorer")
        assert "Error displaying widget" not in explorer.inner_text()

    checked(lab, check)
    lab.page.close()
