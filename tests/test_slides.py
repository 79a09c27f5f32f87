"""The slide decks are built from their Markdown sources and open offline."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_decks_are_built_from_their_sources():
    check = [sys.executable, str(REPO / "slides" / "build.py"), "--check"]
    done = subprocess.run(check, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_ready_lab_has_a_self_contained_deck():
    labs = sorted(path.name for path in (REPO / "solutions").glob("[0-9][0-9]_*"))
    for lab in labs:
        deck = (REPO / "slides" / f"{lab}.html").read_text()
        assert deck.count("<section>") >= 5, f"slides/{lab}.html has too few slides"
        sources = re.findall(r'<(?:img|script|link)[^>]*(?:src|href)="([^"]+)"', deck)
        assert all(source.startswith("data:") for source in sources), sources
