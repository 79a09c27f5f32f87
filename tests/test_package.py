"""minidist as a whole: a clean import stack, unique names, one simulator and one counter, and a
plain `pip install .` that imports every public module."""

import ast
import os
import re
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
    "core": ["_checks", "_groups", "interposer", "agreement", "_calls", "_diagnose",
             "_supervisor", "launch", "flat", "timeline", "refusal", "_fork_server_ready",
             "checking", "predictions"],
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


LONG_MODULE, LONG_UNIT = 500, 120  # lines; longer ones say why they are one piece
SIZE_STATED = re.compile(r"Why one (?:module|unit) of about (\d+) lines: \S")


def stated_size(docstring: str | None) -> int | None:
    found = SIZE_STATED.search(" ".join((docstring or "").split()))
    return int(found[1]) if found else None


def test_every_long_module_and_unit_says_why_it_is_one_piece_and_its_size():
    """A module over 500 lines, or a class or function over 120, reads as one idea only if it
    says why it is one ("Why one module of about N lines: ..."), with N within 15 %."""
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        units = [(path.relative_to(PACKAGE).as_posix(), tree, LONG_MODULE,
                  len(path.read_text().splitlines()))]
        units += [(f"{path.relative_to(PACKAGE).as_posix()}:{node.name}", node, LONG_UNIT,
                   node.end_lineno - node.lineno + 1)
                  for node in ast.walk(tree)
                  if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        for name, node, limit, lines in units:
            if lines <= limit:
                continue
            stated = stated_size(ast.get_docstring(node))
            if stated is None or abs(stated - lines) > 0.15 * lines:
                missing.append(f"{name} ({lines} lines, states {stated})")
    assert not missing, (
        "each of these is long without saying why it is one piece, or states an old size; add "
        f"'Why one module (or unit) of about N lines: <reason>' to its docstring: {missing}")


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


def imported_at_import_time(tree: ast.Module) -> set[str]:
    """The top-level names of the modules a module imports when it is imported (not those its
    functions import when called)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue  # for the type checker alone
        for inner in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(inner, ast.Import):
                names |= {alias.name.split(".")[0] for alias in inner.names}
            elif isinstance(inner, ast.ImportFrom) and inner.level == 0 and inner.module:
                names.add(inner.module.split(".")[0])
    return names


def declared_closure() -> set[str]:
    """The import names of minidist's declared dependencies (pyproject.toml, as the course's
    environment installed it) and of everything they require in turn."""
    from importlib import metadata

    from packaging.requirements import Requirement

    declared = metadata.requires("minidist") or []
    def needed(requirements: list[str]) -> list[str]:  # on this platform, no extras
        parsed = map(Requirement, requirements)
        return [r.name for r in parsed if r.marker is None or r.marker.evaluate({"extra": ""})]

    queue, seen, names = needed(declared), set(), set()
    while queue:
        name = queue.pop()
        if name.lower() in seen:
            continue
        seen.add(name.lower())
        distribution = metadata.distribution(name)
        names |= {top for top in (distribution.read_text("top_level.txt") or "").split()}
        names |= {file.parts[0].removesuffix(".py") for file in distribution.files or []
                  if file.parts[0].isidentifier() or file.parts[0].endswith(".py")}
        queue += needed(distribution.requires or [])
    return names


def test_every_module_imported_at_import_time_is_a_declared_dependency():
    """`pip install .` brings pyproject.toml's dependencies: whatever minidist imports on
    import is one of them (or theirs), or the standard library."""
    third_party = set()
    for name, tree in modules().items():
        third_party |= {f"{module} (minidist.{name})" for module in imported_at_import_time(tree)
                        if module not in sys.stdlib_module_names and module != "minidist"}
    closure = declared_closure()
    undeclared = sorted(entry for entry in third_party if entry.split()[0] not in closure)
    assert not undeclared, (f"imported on import but not a dependency in pyproject.toml: "
                            f"{undeclared}; declare it, or import it inside the function")


@pytest.mark.timeout(900)
def test_plain_pip_install_imports_every_public_module(tmp_path):
    """A fresh venv with `pip install .` alone: every public module imports from the installed
    package (its folders all packaged). The dependencies come from the course's environment
    rather than a second install of torch (minutes); the test above checks they are declared."""
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(REPO / "pyproject.toml", source)
    shutil.copytree(PACKAGE, source / "lib" / "minidist",
                    ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.base_prefix + "/bin/python3", "-m", "venv", str(venv)], check=True,
                   timeout=300)
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                              "--no-deps", "--no-compile", str(source)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # After the venv's own site-packages, so the installed minidist comes first; a path in a
    # .pth is not itself scanned for .pth files, so the course's editable minidist stays out.
    dependencies = [path for path in sys.path if path.endswith("site-packages")]
    Path(site, "course_dependencies.pth").write_text("\n".join(dependencies) + "\n")
    public = [name for name in STACK if not name.split(".")[1].startswith("_")]
    code = ("import minidist, pathlib\n"
            f"assert pathlib.Path(minidist.__file__).is_relative_to({site!r}), minidist.__file__\n"
            + "".join(f"import minidist.{name}\n" for name in public))
    # Without PYTHONPATH: a developer's (lib/ on it) would import the source, not the install.
    environ = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    imported = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=environ)
    assert imported.returncode == 0, imported.stderr[-3000:]
