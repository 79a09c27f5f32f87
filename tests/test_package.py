"""minidist as a whole: a clean import stack, unique names, one simulator and one counter, and a
plain `pip install .` that imports every public module."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lib" / "minidist"

# Bottom to top: a module may import only modules before it in this list.
STACK = [
    "_checks", "_groups", "_fork_server_exit", "predictions", "cost", "memory", "tiers", "fsdp1",
    "traffic", "flops", "timeline", "pipeline",
    "gantt", "planner", "widgets", "_calls", "_diagnose", "_supervisor", "launch", "flat",
    "checking", "comm", "timing", "streaming", "network", "collectives", "mesh", "bandwidth",
    "diagrams", "models", "footprint", "offload", "param_server", "compression", "ddp", "zero",
    "fsdp", "tensor_parallel", "clipping", "pipeline_exec", "pipeline_harness", "moe",
    "context_parallel", "parallelize", "checkpoint", "train", "profiling",
]


def modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(), str(path))
            for path in sorted(PACKAGE.glob("*.py")) if path.stem != "__init__"}


def minidist_imports(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minidist"):
            if node.module == "minidist":
                names |= {alias.name for alias in node.names}
            else:
                names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("minidist.")}
    return names


def test_every_module_is_placed_in_the_import_stack_and_imports_only_below_itself():
    found = modules()
    assert sorted(found) == sorted(STACK), "add the new module to STACK, at its level"
    for name, tree in found.items():
        above = set(STACK[STACK.index(name):])
        wrong = minidist_imports(tree) & above
        assert not wrong, f"minidist.{name} imports {sorted(wrong)}, which are not below it"


def test_no_two_classes_share_a_name():
    seen: dict[str, str] = {}
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assert node.name not in seen, (
                    f"class {node.name} is defined in both minidist.{seen[node.name]} and "
                    f"minidist.{name}")
                seen[node.name] = name


def test_one_schedule_generator_one_simulator_one_traffic_counter():
    defined: dict[str, list[str]] = {}
    for name, tree in modules().items():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                defined.setdefault(node.name, []).append(name)
    assert defined["schedule"] == ["pipeline"] and defined["simulate"] == ["pipeline"]
    counters = {f"{module}.{function}" for function, where in defined.items()
                if function.startswith("count") for module in where}
    assert counters == {"traffic.count_traffic"}


@pytest.mark.timeout(900)
def test_plain_pip_install_imports_every_public_module(tmp_path):
    """A fresh venv with only `pip install .` (the package's declared dependencies, no
    requirements.txt). Slow, about a minute: pip installs torch from its local cache."""
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(REPO / "pyproject.toml", source)
    shutil.copytree(PACKAGE, source / "lib" / "minidist",
                    ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.base_prefix + "/bin/python3", "-m", "venv", str(venv)], check=True,
                   timeout=300)
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                              "--no-compile",  # no .pyc for all of torch: imported once
                              str(source)], capture_output=True, text=True, timeout=840)
    assert install.returncode == 0, install.stderr[-3000:]
    public = [name for name in STACK if not name.startswith("_")]
    code = "".join(f"import minidist.{name}\n" for name in public)
    imported = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0, imported.stderr[-3000:]
