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

# Bottom to top: a folder may import only from folders before it, and a module only from
# modules before it in its folder's list (lib/minidist/README.md draws this; each folder's
# README lists its modules in this order).
FOLDERS = {
    "core": ["_checks", "_groups", "_fork_server_exit", "interposer", "_calls", "_diagnose",
             "_supervisor", "launch", "flat", "timeline", "checking", "predictions"],
    "costs": ["algorithms", "cost", "memory", "footprint", "flops", "overlap", "tiers", "bubbles",
              "traffic", "planner"],
    "communication": ["comm", "counting", "timing", "streaming", "network", "emulation",
                      "hierarchical", "link_sweep", "impls", "collectives", "mesh", "bandwidth"],
    "parallel": ["models", "compression", "ddp", "offload", "device_memory", "nvme",
                 "host_optimizer", "zero", "zero_offload", "fsdp", "fsdp1", "tensor_parallel",
                 "clipping", "pipeline", "pipeline_simulator", "pipeline_validator",
                 "pipeline_exec", "pipeline_harness", "moe", "context_parallel", "param_server",
                 "parallelize"],
    "jobs": ["checkpoint", "train", "profiling", "tasks", "pieces"],
    "pictures": ["gantt", "diagrams", "widgets"],
}
STACK = [f"{folder}.{module}" for folder, names in FOLDERS.items() for module in names]


def modules() -> dict[str, ast.Module]:
    """{"folder.module": its syntax tree} for every module of minidist but the __init__s."""
    return {".".join(path.relative_to(PACKAGE).with_suffix("").parts):
            ast.parse(path.read_text(), str(path))
            for path in sorted(PACKAGE.rglob("*.py")) if path.stem != "__init__"}


def minidist_imports(tree: ast.Module) -> set[str]:
    """The "folder.module"s a module imports, however it names them."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minidist"):
            parts = node.module.split(".")[1:]
            if len(parts) == 1:  # from minidist.folder import module, ...
                names |= {f"{parts[0]}.{alias.name}" for alias in node.names}
            elif parts:
                names.add(".".join(parts[:2]))
            else:
                names |= {alias.name for alias in node.names}  # from minidist import folder
        elif isinstance(node, ast.Import):
            names |= {".".join(a.name.split(".")[1:3]) for a in node.names
                      if a.name.startswith("minidist.")}
    return names


def test_every_module_is_placed_in_the_import_stack_and_imports_only_below_itself():
    found = modules()
    assert sorted(found) == sorted(STACK), "add the new module to FOLDERS, at its level"
    for name, tree in found.items():
        above = set(STACK[STACK.index(name):])
        wrong = minidist_imports(tree) & above
        assert not wrong, f"minidist.{name} imports {sorted(wrong)}, which are not below it"
        unknown = minidist_imports(tree) - set(STACK)
        assert not unknown, (f"minidist.{name} imports {sorted(unknown)}: import modules, not "
                             "folders")


def test_each_folder_has_a_readme_naming_its_modules_in_import_order():
    top = (PACKAGE / "README.md").read_text()
    for folder, names in FOLDERS.items():
        assert f"{folder}/" in top, f"lib/minidist/README.md does not draw {folder}/"
        readme = (PACKAGE / folder / "README.md").read_text()
        listed = [line.split("`")[1] for line in readme.splitlines() if line.startswith("| `")]
        assert listed == names, (f"{folder}/README.md lists {listed}; the import order is "
                                 f"{names}")


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
    assert defined["schedule"] == ["parallel.pipeline"]
    assert defined["simulate"] == ["parallel.pipeline_simulator"]
    counters = {f"{module}.{function}" for function, where in defined.items()
                if function.startswith("count") for module in where}
    assert counters == {"communication.counting.count_traffic"}


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
    public = [name for name in STACK if not name.split(".")[1].startswith("_")]
    code = "".join(f"import minidist.{name}\n" for name in public)
    imported = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0, imported.stderr[-3000:]
