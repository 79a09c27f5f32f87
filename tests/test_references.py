"""REFERENCES.md, the course's bibliography: it exists and its anchors are unique; every
`REFERENCES.md#<anchor>` cited anywhere in the repository names one of them; README, the slides'
index and the student release carry it; and nothing cites the course page by the singular name,
a page the repository does not have."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCES = REPO / "REFERENCES.md"
CITED = re.compile(r"REFERENCES\.md#([A-Za-z0-9_-]+)")
# The singular, upper-case page name that older docstrings and cells cite. This file names it
# here and is left out of the search below.
BARE = re.compile(r"\bREFERENCE\b")
SKIPPED_DIRS = {".git", ".venv", "node_modules", "my-labs", "release", "__pycache__"}

def repository_files() -> list[Path]:
    """The files of the working tree that git would commit (tracked or not ignored); every file
    outside the usual build and environment folders where there is no git."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
            capture_output=True, check=True, timeout=60).stdout.decode()
        paths = [REPO / name for name in listed.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        paths = [path for path in REPO.rglob("*")
                 if not SKIPPED_DIRS & set(path.relative_to(REPO).parts)]
    return sorted(path for path in paths if path.is_file())


def text_lines() -> list[tuple[str, int, str]]:
    """(path relative to the repository, line number, line) for every text file."""
    lines = []
    for path in repository_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        name = path.relative_to(REPO).as_posix()
        lines += [(name, number, line) for number, line in enumerate(text.splitlines(), 1)]
    return lines


def anchors() -> list[str]:
    return re.findall(r'<a id="([^"]+)"></a>', REFERENCES.read_text())


def test_references_page_exists_with_unique_anchors_and_working_links():
    assert REFERENCES.is_file(), "REFERENCES.md, the course's bibliography, is missing"
    ids = anchors()
    duplicated = sorted({anchor for anchor in ids if ids.count(anchor) > 1})
    assert not duplicated, f"REFERENCES.md defines these anchors twice: {duplicated}"
    for anchor in ("notation", "by-lab", "collectives", "corrections", "zero", "megatron-lm",
                   "korthikanti", "gpipe", "megatron-ptdp", "zero-bubble", "thakur-2005",
                   "nccl-tests", "palm", "young-1974", "ring-attention", "ulysses"):
        assert anchor in ids, f"REFERENCES.md has no entry anchored <a id=\"{anchor}\"></a>"
    internal = set(re.findall(r"\]\(#([^)]+)\)", REFERENCES.read_text()))
    assert not (broken := sorted(internal - set(ids))), (
        f"REFERENCES.md links to anchors it does not define: {broken}")


def test_every_cited_anchor_exists():
    ids = set(anchors())
    missing = [f"{name}:{number}: #{anchor}" for name, number, line in text_lines()
               for anchor in CITED.findall(line) if anchor not in ids]
    assert not missing, (
        "these cite anchors REFERENCES.md does not define (add the entry or fix the anchor):\n"
        + "\n".join(missing))


def test_readme_slide_index_decks_and_release_carry_the_page():
    readme = (REPO / "README.md").read_text()
    assert "](REFERENCES.md)" in readme, "README.md does not link REFERENCES.md"
    index = (REPO / "slides" / "index.html").read_text()
    assert 'href="../REFERENCES.md"' in index, (
        "slides/index.html does not link ../REFERENCES.md (its text comes from slides/build.py)")
    for deck in sorted((REPO / "slides").glob("[0-9][0-9]_*.html")):
        for target in set(re.findall(r'href="([^"#]*REFERENCES\.md)[#"]', deck.read_text())):
            assert (deck.parent / target).resolve() == REFERENCES, (
                f"slides/{deck.name} links {target}, which is not the repository's REFERENCES.md")
    released = re.search(r"^RELEASED :=(.*?)(?<!\\)$", (REPO / "Makefile").read_text(),
                         re.MULTILINE | re.DOTALL)
    assert released and "REFERENCES.md" in released[1].split(), (
        "the student release (RELEASED in the Makefile) leaves out REFERENCES.md, which its "
        "README and slides link")


def test_nothing_cites_the_singular_course_page():
    own = Path(__file__).resolve().relative_to(REPO).as_posix()
    found: dict[str, list[str]] = {}
    for name, number, line in text_lines():
        if name != own and BARE.search(line):
            found.setdefault(name, []).append(f"{name}:{number}: {line.strip()[:100]}")
    hits = [hit for _, lines in sorted(found.items()) for hit in lines]
    assert not hits, (
        "these cite a page the repository does not have; cite REFERENCES.md#<anchor> instead:\n"
        + "\n".join(hits))
