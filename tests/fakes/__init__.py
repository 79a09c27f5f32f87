"""Plausible fakes of every implementation exercise: what a student who wants the points
without the work might hand in. Each lab's module, `NN_topic.py`, maps the grade id of an
exercise's solution cell to its fakes (`FAKES`); tests/test_grading.py (test i) grades them with
nbgrader and requires each to score 0 on the test cells that check that exercise: an
exercise's first fake in a submission of its own, the others tried in the solution's notebook
(or, for an exercise whose checks lie far below it, in rounds of submissions, unless the
module's `TRIED_BY_SECTION` names it: its trials then rerun only the sections of their checks,
see tests/test_grading.py's `section_steps`). A fake that
leaves a thread or a process running is its exercise's first: tried in the solution's notebook,
it would refuse every check below it.

The mirror: a module's `ALTERNATIVES` (optional) maps a grade id to correct answers that differ
from the solution in what the spec leaves open (an order it does not define, a warm-up it
allows); test j grades them and requires each to score full marks on its checks."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Fake:
    """`source` replaces the solution region of the exercise's cell, indented as that region
    is (a tuple: one source per region, for a cell with several); `skips` names the mechanism
    the fake skips while getting the final numbers right; `checked_by` lists the test cells
    (grade ids) that must then score 0."""

    name: str
    skips: str
    checked_by: tuple[str, ...]
    source: str | tuple[str, ...]


@dataclass(frozen=True)
class Alternative:
    """A correct answer the spec allows that the solution does not give: `source` replaces the
    solution region of the exercise's cell as a Fake's does; `why` says what it does otherwise
    and why the spec allows it; `checked_by` lists the test cells that must then give it full
    marks."""

    name: str
    why: str
    checked_by: tuple[str, ...]
    source: str | tuple[str, ...]


def solution_region(lab: str, grade_id: str) -> str:
    """The solution region of a cell of `lab`'s solution notebook, as its lines stand: what a
    fake made from the solution starts from."""
    import json
    from pathlib import Path

    notebook = Path(__file__).resolve().parents[2] / "solutions" / lab / f"{lab}.ipynb"
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["metadata"].get("nbgrader", {}).get("grade_id") == grade_id:
            source = "".join(cell["source"])
            return source.split("### BEGIN SOLUTION\n", 1)[1].split("### END SOLUTION", 1)[0]
    raise KeyError(f"{lab}: no cell {grade_id}")


def edited(text: str, *changes: tuple[str, str]) -> str:
    """`text` with each (old, new) replaced, each old found exactly once (so that a fake never
    silently becomes the solution it was made from)."""
    for old, new in changes:
        assert text.count(old) == 1, f"{old!r} is not in the solution once"
        text = text.replace(old, new)
    return text

def _module(lab: str):
    """`lab`'s module `NN_topic.py` beside this file, None if it has none."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).with_name(f"{lab}.py")
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"fakes_{lab}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fakes_of(lab: str) -> dict[str, list[Fake]]:
    """The fakes of `lab`, {} if it has none: {grade id of an exercise's solution cell: its
    fakes}."""
    module = _module(lab)
    return module.FAKES if module else {}


def alternatives_of(lab: str) -> dict[str, list[Alternative]]:
    """The correct alternatives of `lab`, {} if it has none: {grade id of an exercise's
    solution cell: its alternatives}."""
    module = _module(lab)
    return getattr(module, "ALTERNATIVES", {}) if module else {}


def tried_by_section(lab: str) -> set[str]:
    """The exercises of `lab` whose fakes far from their checks are tried in the solution's
    notebook, section by section, rather than in rounds of submissions of their own."""
    module = _module(lab)
    return set(getattr(module, "TRIED_BY_SECTION", ())) if module else set()


def rounds(fakes: dict[str, list[Fake]] | dict[str, list[Alternative]]) -> list[dict]:
    """The fakes (or alternatives) in rounds, one submission each: round k holds fake k of
    every exercise that has one. An exercise whose checks call another exercise's function can
    then score 0 because of that one's fake too; every fake still scores 0, and each round
    costs one run of the notebook instead of one per fake."""
    count = max((len(found) for found in fakes.values()), default=0)
    return [{cell: found[k] for cell, found in fakes.items() if k < len(found)}
            for k in range(count)]


# Red team rt9 (issue 38): code that runs when the answer cell runs, before any check: a thread
# that runs clones of the library's functions (or builds a graph), or a forked process where
# nothing is refused. Appended at column 0 after a solution region that ends its cell's
# function (or class).
# Such a fake is its exercise's first, graded in a submission of its own (the mistaken one):
# tried in the solution's notebook, what it left running would refuse every check below it.
PRESTARTED_THREAD = """


import inspect as _inspect, queue as _queue, threading as _threading, types as _types


def _clone_module(module):
    # copies of every function the module defines, bound to a private copy of its globals,
    # made now (before any check swaps the originals' code)
    g = dict(vars(module))
    for name, value in list(g.items()):
        if _inspect.isfunction(value) and value.__module__ == module.__name__:
            g[name] = _types.FunctionType(value.__code__, g, name, value.__defaults__,
                                          value.__closure__)
            g[name].__kwdefaults__ = value.__kwdefaults__
    return g


_jobs = _queue.Queue()


def _worker():
    while True:
        fn, args, box, done = _jobs.get()
        try:
            box.append(fn(*args))
        except BaseException as error:  # noqa: BLE001
            box.append(error)
        done.set()


_threading.Thread(target=_worker, daemon=True).start()  # started now, before any check


def _elsewhere(fn, *args):
    box, done = [], _threading.Event()
    _jobs.put((fn, args, box, done))
    done.wait()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]
"""

PRESTARTED_PROCESS = """


import importlib as _importlib
import multiprocessing as _mp


def _serve(connection):
    while True:
        module, name, args = connection.recv()
        try:
            connection.send((True, getattr(_importlib.import_module(module), name)(*args)))
        except Exception as error:  # noqa: BLE001
            connection.send((False, repr(error)))


_here, _there = _mp.get_context("fork").Pipe()
_helper = _mp.get_context("fork").Process(target=_serve, args=(_there,), daemon=True)
_helper.start()  # forked now, before any check


def _library(module, name, *args):
    _here.send((module, name, args))
    ok, value = _here.recv()
    if not ok:
        raise RuntimeError(value)
    return value
"""


_STRIPPED = '''
import dis as _dis
import importlib as _importlib
import types as _types


def _stripped(function, **names):
    # function's code with every mark of where it came from taken away: its name, place,
    # docstring, locals' names and line table; `names` replace globals it calls
    code = function.__code__
    consts = list(code.co_consts)
    loaded = {i.arg for i in _dis.get_instructions(code) if i.opname == "LOAD_CONST"}
    if consts and isinstance(consts[0], str) and 0 not in loaded:
        consts[0] = None
    arguments = code.co_argcount + code.co_kwonlyargcount
    code = code.replace(co_name="mine", co_qualname="mine", co_filename="<mine>",
                        co_firstlineno=1, co_consts=tuple(consts), co_linetable=b"",
                        co_varnames=code.co_varnames[:arguments] + tuple(
                            f"_l{i}" for i in range(arguments, len(code.co_varnames))))
    clone = _types.FunctionType(code, {**function.__globals__, **names}, "mine",
                                function.__defaults__, function.__closure__)
    clone.__kwdefaults__ = function.__kwdefaults__
    return clone


def _from_file(module, name, **names):
    # module's function `name` compiled again from its file, as a copy made before any check
    # holds the library's code (the function object itself refuses while a check runs)
    source = _importlib.import_module(module)
    with open(source.__file__) as file:
        compiled = compile(file.read(), source.__file__, "exec", dont_inherit=True)
    code = next(c for c in compiled.co_consts
                if isinstance(c, _types.CodeType) and c.co_name == name)
    original = getattr(source, name)
    function = _types.FunctionType(code, vars(source), name, original.__defaults__)
    function.__kwdefaults__ = original.__kwdefaults__
    return _stripped(function, **names)
'''


def stripped_clone_helpers(indent: str = "") -> str:
    """Fake source defining `_stripped(function, **names)` (a clone of a library function with
    every mark of its origin removed: name, place, docstring, locals' names, line table) and
    `_from_file(module, name, **names)` (the same, of the function compiled again from its
    module's file, for a fake whose code only runs once the check has begun), at `indent`."""
    return textwrap.indent(_STRIPPED, indent)
