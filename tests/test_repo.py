"""The repository as a new user and CI meet it: pinned set-up, lint, lab layout, diagrams."""

import re
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest

from minidist.pictures.diagrams import COLLECTIVES, draw_collectives

REPO = Path(__file__).resolve().parents[1]
matplotlib.use("Agg")


def test_requirements_are_pinned_and_install_minidist():
    text = (REPO / "requirements.txt").read_text()
    packages = [line.split("#")[0].strip() for line in text.splitlines()]
    packages = [line for line in packages if line]
    assert "-e ." in packages
    assert "torch==2.13.0" in packages
    unpinned = [line for line in packages if line != "-e ." and "==" not in line]
    assert not unpinned, f"pin these with ==: {unpinned}"


def test_readme_shows_the_two_setup_commands_and_ci_runs_the_test_one():
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^make (\w+)", readme, flags=re.M)
    assert commands == ["lab", "test"], commands
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_ruff_is_clean():
    paths = ["lib", "tests", "bench", "cluster_setup", "tools"]
    done = subprocess.run([sys.executable, "-m", "ruff", "check", *paths],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_lab_folder_is_named_nn_topic_in_solutions_and_labs():
    solutions = sorted(p.name for p in (REPO / "solutions").iterdir() if p.is_dir())
    labs = sorted(p.name for p in (REPO / "labs").iterdir() if p.is_dir())
    assert solutions == labs
    for name in solutions:
        assert re.fullmatch(r"\d\d_[a-z0-9_]+", name), name
        assert (REPO / "solutions" / name / f"{name}.ipynb").exists()


def test_collective_diagrams_draw_every_collective():
    figure = draw_collectives(world_size=3)
    assert len(figure.axes) == 2 * len(COLLECTIVES)
    with pytest.raises(ValueError, match="unknown collective 'all_to_all'"):
        draw_collectives(["all_to_all"])
    with pytest.raises(ValueError, match="world_size must be at least 2"):
        draw_collectives(world_size=1)
