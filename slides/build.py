"""Build the slide decks: each `slides/NN_topic.md` becomes a self-contained `NN_topic.html`.

    .venv/bin/python slides/build.py          # rebuild every deck
    .venv/bin/python slides/build.py --check  # exit 1 if a committed deck is out of date

Slides are separated by a line holding only `---`. An image whose address is
`figure:<name>` is drawn by minidist (see FIGURES) and embedded, so every deck is one HTML
file that opens offline in any browser: arrow keys, space or a click move between slides, and
printing gives one slide per page.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import re
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import mistune  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from minidist.diagrams import draw_collectives  # noqa: E402

SLIDES = Path(__file__).resolve().parent
STYLE_SHEET = SLIDES / "deck.css"
FIGURES: dict[str, Callable[[], Figure]] = {
    "broadcast-reduce-all-reduce": lambda: draw_collectives(
        ["broadcast", "reduce", "all_reduce"], world_size=3
    ),
    "all-gather-reduce-scatter-send": lambda: draw_collectives(
        ["all_gather", "reduce_scatter", "send_recv"], world_size=3
    ),
    "reduce-scatter-then-all-gather": lambda: draw_collectives(
        ["reduce_scatter", "all_gather"], world_size=3
    ),
}


SCRIPT = """
const slides = [...document.querySelectorAll('section')];
let current = 0;
function show(i) {
  current = Math.max(0, Math.min(slides.length - 1, i));
  slides.forEach((s, j) => s.classList.toggle('current', j === current));
  history.replaceState(null, '', '#' + (current + 1));
}
document.addEventListener('keydown', e => {
  if (['ArrowRight', 'ArrowDown', 'PageDown', ' '].includes(e.key)) show(current + 1);
  else if (['ArrowLeft', 'ArrowUp', 'PageUp'].includes(e.key)) show(current - 1);
  else if (e.key === 'Home') show(0);
  else if (e.key === 'End') show(slides.length - 1);
});
document.addEventListener('click', e => show(current + (e.clientX > innerWidth / 3 ? 1 : -1)));
show((parseInt(location.hash.slice(1)) || 1) - 1);
"""


def figure_png(name: str) -> str:
    """The named figure as a base64 PNG, byte-for-byte the same on every build."""
    if name not in FIGURES:
        raise SystemExit(f"unknown figure:{name}; known: {', '.join(FIGURES)}")
    figure = FIGURES[name]()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def render(markdown: str) -> str:
    """The HTML deck for one Markdown file."""
    title = re.search(r"^# (.+)$", markdown, re.MULTILINE)
    sources = re.split(r"^---$", markdown, flags=re.MULTILINE)
    renderer = mistune.HTMLRenderer(allow_harmful_protocols=("figure:",))
    to_html = mistune.create_markdown(renderer=renderer, plugins=["table", "strikethrough"])
    sections = []
    for number, source in enumerate(sources, 1):
        body = re.sub(
            r'src="figure:([\w-]+)"',
            lambda match: f'src="data:image/png;base64,{figure_png(match[1])}"',
            to_html(source),
        )
        counter = f'<div class="counter">{number} / {len(sources)}</div>'
        sections.append(f"<section>\n{body}{counter}\n</section>")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title[1] if title else 'Scaling Lab')}</title>\n"
        f"<style>{STYLE_SHEET.read_text()}</style>\n</head>\n<body>\n"
        + "\n".join(sections)
        + f"\n<script>{SCRIPT}</script>\n</body>\n</html>\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the committed decks")
    args = parser.parse_args()
    stale = []
    for source in sorted(SLIDES.glob("[0-9][0-9]_*.md")):
        deck, built = source.with_suffix(".html"), render(source.read_text())
        if args.check:
            if not deck.exists() or deck.read_text() != built:
                stale.append(deck.name)
        else:
            deck.write_text(built)
            print(f"wrote {deck.relative_to(SLIDES.parent)}")
    if stale:
        sys.exit(f"out of date: {', '.join(stale)}; rebuild with: .venv/bin/python slides/build.py")


if __name__ == "__main__":
    main()
