"""Students work in copies of the labs that course updates never overwrite.

    python tools/my_labs.py copy      copy each lab not yet in my-labs/ (what `make lab` runs)
    python tools/my_labs.py update    after `git pull`: copy new labs, and put the new version of
                                      each changed lab beside the student's copy (`make update`)
    python tools/my_labs.py export    for Lab 14: copy the functions you wrote in labs 03–09 out
                                      of my-labs/ into my-labs/14_capstone/exported_pieces.py,
                                      and say which pieces are unfinished

labs/ is the course's, updated by `git pull`; my-labs/ (gitignored) is the student's. Each copy
remembers the course version it came from (my-labs/.course/<lab>/), so an update can tell which
labs the course changed since, and never needs to touch the student's files.

Both also put the course's reference page in my-labs/REFERENCES.md, where the labs' links
(../REFERENCES.md#...) find it: JupyterLab serves my-labs/ and nothing above it. A student who
edited that copy keeps it; the new version goes beside it, as a changed lab's does.
"""

from __future__ import annotations

import filecmp
import shutil
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COURSE = ROOT / "labs"
MINE = ROOT / "my-labs"
COPIED_FROM = MINE / ".course"  # each lab as the course had it when last copied or updated
REFERENCES = ROOT / "REFERENCES.md"  # the course's reference page, which every lab links
IGNORED = {".ipynb_checkpoints", "__pycache__"}


def labs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name[:2].isdigit())


def files(lab_folder: Path) -> dict[str, Path]:
    return {
        str(path.relative_to(lab_folder)): path
        for path in sorted(lab_folder.rglob("*"))
        if path.is_file() and not IGNORED & set(path.relative_to(lab_folder).parts)
    }


def same(a: Path, b: Path) -> bool:
    mine, theirs = files(a), files(b)
    return mine.keys() == theirs.keys() and all(
        filecmp.cmp(mine[name], theirs[name], shallow=False) for name in mine
    )


def remember(lab: str) -> None:
    shutil.rmtree(COPIED_FROM / lab, ignore_errors=True)
    shutil.copytree(COURSE / lab, COPIED_FROM / lab, ignore=shutil.ignore_patterns(*IGNORED))


def copy_new_labs() -> list[str]:
    new = [lab for lab in labs(COURSE) if not (MINE / lab).exists()]
    for lab in new:
        shutil.copytree(COURSE / lab, MINE / lab, ignore=shutil.ignore_patterns(*IGNORED))
        remember(lab)
    return new


def updated_name(path: Path) -> Path:
    """Where a changed file goes beside the student's: 01_x.ipynb -> 01_x.updated-<date>.ipynb."""
    stamp = f"updated-{date.today().isoformat()}"
    candidate = path.with_name(f"{path.stem}.{stamp}{path.suffix}")
    number = 2
    while candidate.exists():
        candidate = path.with_name(f"{path.stem}.{stamp}-{number}{path.suffix}")
        number += 1
    return candidate


def place_changes(lab: str) -> list[Path]:
    """Copy the course's changed or new files of `lab` into the student's folder; a file the
    student has is never overwritten: the new version goes beside it."""
    placed = []
    before = files(COPIED_FROM / lab) if (COPIED_FROM / lab).exists() else {}
    for name, path in files(COURSE / lab).items():
        if name in before and filecmp.cmp(before[name], path, shallow=False):
            continue
        target = MINE / lab / name
        if target.exists():
            target = updated_name(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        placed.append(target)
    remember(lab)
    return placed


def copy_references() -> Path | None:
    """Put the course's REFERENCES.md in my-labs/ if it is new or changed; the path written, or
    None. The student's copy is overwritten only if it is as last copied."""
    mine, before = MINE / REFERENCES.name, COPIED_FROM / REFERENCES.name
    if not REFERENCES.exists() or (
            mine.exists() and filecmp.cmp(mine, REFERENCES, shallow=False)):
        return None
    edited = mine.exists() and not (before.exists() and filecmp.cmp(mine, before, shallow=False))
    target = updated_name(mine) if edited else mine
    shutil.copy2(REFERENCES, target)
    COPIED_FROM.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REFERENCES, before)
    return target


def copy() -> None:
    MINE.mkdir(exist_ok=True)
    copy_references()
    for lab in copy_new_labs():
        print(f"my-labs/{lab}: copied from labs/{lab}; work here, updates never overwrite it")


def update() -> None:
    MINE.mkdir(exist_ok=True)
    if (placed := copy_references()) is not None and placed.name != REFERENCES.name:
        print(f"REFERENCES.md changed in the course: the new version is in "
              f"{placed.relative_to(ROOT)}; your copy is as you left it")
    changed = [
        lab for lab in labs(COURSE)
        if (MINE / lab).exists() and not (
            (COPIED_FROM / lab).exists() and same(COURSE / lab, COPIED_FROM / lab)
        )
    ]
    for lab in changed:
        placed = [str(path.relative_to(ROOT)) for path in place_changes(lab)]
        print(f"{lab} changed in the course: the new version is in {', '.join(placed)}; "
              "your files are as you left them")
    for lab in copy_new_labs():
        print(f"{lab} is new: copied to my-labs/{lab}")
    if not changed:
        print("none of your labs changed in the course")


EXPORTED = MINE / "14_capstone" / "exported_pieces.py"


def export() -> None:
    """Lab 14's pieces: the student's own functions from labs 03–09, one file (read by
    minidist.jobs.pieces); the notebook's my_pieces.py cell takes its text."""
    sys.path.insert(0, str(ROOT / "lib"))
    from minidist.jobs import pieces

    EXPORTED.parent.mkdir(parents=True, exist_ok=True)
    text = pieces.export(MINE, EXPORTED)
    found = pieces.status(text)
    shown = EXPORTED.relative_to(ROOT) if EXPORTED.is_relative_to(ROOT) else EXPORTED
    print(f"wrote {shown}; paste it into Lab 14's my_pieces.py cell")
    for piece in pieces.PIECES:
        state = found[piece.name]
        lacking = pieces.unfinished_cells(text, piece)  # which of the piece's cells to finish
        cells = ", ".join(f"{cell} ({what})" for cell, what in lacking.items())
        hint = "" if state == "finished" else (
            f"  <- finish Lab {piece.lab[:2]} cell{'s' * (len(lacking) > 1)} {cells}, or run "
            f"the job with minidist_for=({piece.name!r},)")
        print(f"  {piece.name:10s} Lab {piece.lab}: {piece.what}: {state}{hint}")


if __name__ == "__main__":
    commands = {"copy": copy, "update": update, "export": export}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: {sys.argv[0]} copy|update|export")
    commands[sys.argv[1]]()
