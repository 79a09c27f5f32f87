"""Build the slide decks: each `slides/NN_topic.md` becomes a self-contained reveal.js deck
`NN_topic.html`, and `slides/index.html` lists them as a self-study path.

    .venv/bin/python slides/build.py          # rebuild every deck, the index and, when
                                              # Chromium is installed, slides/pdf/NN_topic.pdf
    .venv/bin/python slides/build.py --check  # exit 1 if a committed deck is out of date

Markdown: slides are separated by a line holding only `---`; a line holding only `Note:`
starts the slide's speaker notes. `$...$` and `$$...$$` are formulas (KaTeX). An image whose
address is `figure:<name>` is drawn by minidist at build time (slides/figures.py). The title
slide carries `**Covers:**`, `**Lab:**` and `**Time:**` lines, which the index repeats.

reveal.js, its notes and search plugins, KaTeX (fonts included) and every figure are inlined,
so a deck is one HTML file that opens offline. They come from the npm registry, pinned in
slides/package-lock.json; the builder runs `npm ci` when slides/node_modules does not match.
PDFs are printed by the system's Chromium, driven by Playwright (the Python package pinned in
requirements.txt; it never downloads a browser of its own).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mistune

SLIDES = Path(__file__).resolve().parent
sys.path.insert(0, str(SLIDES))
import figures  # noqa: E402  (slides/figures.py, next to this file)

MODULES = SLIDES / "node_modules"
PDF_DIR = SLIDES / "pdf"
STYLE_SHEET = SLIDES / "deck.css"

# Reveal's math plugin fetches KaTeX from a URL; this one uses the copy inlined in the deck.
INIT = r"""
const printing = /print-pdf/.test(location.search);
const ScalingLabMath = {
  id: 'math',
  init: deck => renderMathInElement(deck.getSlidesElement(), {
    delimiters: [{left: '$$', right: '$$', display: true},
                 {left: '\\(', right: '\\)', display: false}],
    throwOnError: true,
  }),
};
Reveal.initialize({
  width: 1280,
  // Printed, each page is the slide with its notes below it: 720 px of slide, then notes.
  height: printing ? 1000 : 720,
  margin: 0.04,
  center: !printing,
  hash: true,
  slideNumber: 'c/t',
  showSlideNumber: 'all',
  showNotes: printing,
  pdfMaxPagesPerSlide: 1,
  transition: 'none',
  plugins: [RevealNotes, RevealSearch, ScalingLabMath],
});
"""


# --- Assets ------------------------------------------------------------------------------------


def ensure_node_modules() -> None:
    """`npm ci` unless slides/node_modules holds exactly what package-lock.json pins."""
    lock = json.loads((SLIDES / "package-lock.json").read_text())
    wanted = {path: entry["version"] for path, entry in lock["packages"].items() if path}
    installed = {}
    for path in wanted:
        manifest = SLIDES / path / "package.json"
        if manifest.exists():
            installed[path] = json.loads(manifest.read_text())["version"]
    if installed == wanted:
        return
    npm = shutil.which("npm")
    if npm is None:
        sys.exit("slides/build.py needs npm (Node.js) to fetch reveal.js and KaTeX; install "
                 "Node.js (e.g. apt-get install npm) and run it again")
    print("installing reveal.js and KaTeX into slides/node_modules (npm ci)")
    subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=SLIDES,
                   check=True, timeout=600)


def _script(path: str) -> str:
    # A "</script" inside the code (reveal's notes plugin writes a page) would end the tag.
    code = (MODULES / path).read_text()
    return "<script>" + code.replace("</script", "<\\/script") + "</script>"


def _katex_css() -> str:
    """KaTeX's style sheet with its woff2 fonts inlined (every current browser reads woff2)."""
    dist = MODULES / "katex" / "dist"
    css = (dist / "katex.min.css").read_text()

    def inline(match: re.Match) -> str:
        font = base64.b64encode((dist / match[1]).read_bytes()).decode()
        return f"src:url(data:font/woff2;base64,{font}) format(\"woff2\")"

    css, count = re.subn(r"src:url\((fonts/[\w-]+\.woff2)\)[^;}]*", inline, css)
    if count == 0 or "url(fonts/" in css:
        sys.exit("KaTeX's CSS no longer names its fonts as slides/build.py expects; update "
                 "_katex_css for the pinned KaTeX version")
    return css


def assets() -> tuple[str, str]:
    """(everything for <head>, every <script> for the end of <body>), inlined."""
    ensure_node_modules()
    styles = [(MODULES / "reveal.js" / "dist" / "reveal.css").read_text(), _katex_css(),
              STYLE_SHEET.read_text()]
    head = "".join(f"<style>{style}</style>\n" for style in styles)
    scripts = [_script(path) for path in (
        "reveal.js/dist/reveal.js", "reveal.js/dist/plugin/notes.js",
        "reveal.js/dist/plugin/search.js", "katex/dist/katex.min.js",
        "katex/dist/contrib/auto-render.min.js")]
    return head, "\n".join(scripts) + f"\n<script>{INIT}</script>\n"


# --- Decks -------------------------------------------------------------------------------------


def _markdown() -> mistune.Markdown:
    renderer = mistune.HTMLRenderer(allow_harmful_protocols=("figure:",))
    return mistune.create_markdown(renderer=renderer,
                                   plugins=["table", "strikethrough", "math"])


@functools.cache
def _figure_uri(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode(figures.draw(name)).decode()


def _title(markdown: str) -> str:
    title = re.search(r"^# (.+)$", markdown, re.MULTILINE)
    return title[1] if title else "Scaling Lab"


def render(markdown: str, head: str, scripts: str) -> str:
    """The HTML deck for one Markdown file."""
    to_html = _markdown()
    sections = []
    for number, source in enumerate(re.split(r"^---$", markdown, flags=re.MULTILINE), 1):
        parts = re.split(r"^Note:$", source, maxsplit=1, flags=re.MULTILINE)
        if len(parts) != 2 or not parts[1].strip():
            sys.exit(f"slide {number} ({source.strip().splitlines()[0][:60]!r}) has no "
                     "speaker notes: add a `Note:` line and the narration under it")
        slide, notes = parts
        body = re.sub(r'src="figure:([\w.-]+)"',
                      lambda match: f'src="{_figure_uri(match[1])}"', to_html(slide))
        sections.append(f"<section>\n{body}<aside class=\"notes\">\n{to_html(notes)}</aside>\n"
                        "</section>")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(_title(markdown))}</title>\n{head}</head>\n<body>\n"
        '<div class="reveal"><div class="slides">\n' + "\n".join(sections)
        + f"\n</div></div>\n{scripts}</body>\n</html>\n"
    )


# --- The self-study index ----------------------------------------------------------------------


def _field(markdown: str, name: str, deck: str) -> str:
    found = re.search(rf"^\*\*{name}:\*\* (.+)$", markdown, re.MULTILINE)
    if found is None:
        sys.exit(f"slides/{deck} has no `**{name}:** ...` line on its title slide; the index "
                 "needs it")
    return found[1]


def index(decks: dict[str, str]) -> str:
    """slides/index.html: every deck in order, what it covers, its lab, how long."""
    inline = mistune.create_markdown(renderer=mistune.HTMLRenderer())
    rows = []
    for name, markdown in decks.items():
        deck = f"{name}.html"
        lab = _field(markdown, "Lab", name)
        rows.append(
            f'<li><h2><a href="{deck}">{html.escape(_title(markdown))}</a></h2>\n'
            f"<p>{inline(_field(markdown, 'Covers', name)).strip()[3:-4]}</p>\n"
            f"<p class=\"meta\">Lab: <a href=\"../{html.escape(lab)}\"><code>{html.escape(lab)}"
            f"</code></a> · {html.escape(_field(markdown, 'Time', name))} · "
            f'PDF: <code>slides/pdf/{name}.pdf</code></p></li>')
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Scaling Lab: self-study path</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 52rem; margin: 2rem auto; padding: 0 1rem;
  color: #1b1b1b; line-height: 1.5; }}
h1 {{ color: #16324f; }} h2 {{ font-size: 1.2rem; margin: 0; }}
ol {{ padding-left: 1.4rem; }} li {{ margin-bottom: 1.2rem; }}
.meta {{ color: #555; font-size: 0.92rem; margin: 0.2rem 0; }} p {{ margin: 0.3rem 0; }}
kbd {{ border: 1px solid #aaa; border-radius: 3px; padding: 0 0.3em; font-size: 0.85em; }}
</style>
</head>
<body>
<h1>Scaling Lab: the self-study path</h1>
<p>Take the decks in order. For each: read the slides (every slide has the lecturer's
narration: press <kbd>S</kbd> for the speaker view, or read it under each slide in the PDF),
answer its "check yourself" slide before turning the page, then do its lab in JupyterLab
(<code>make lab</code>). The labs check your code; the decks give you the picture first.</p>
<p>Keys: <kbd>→</kbd>/<kbd>←</kbd> move, <kbd>Esc</kbd> overview, <kbd>S</kbd> speaker notes,
<kbd>Ctrl</kbd>+<kbd>Shift</kbd>+<kbd>F</kbd> search. Every deck is one file that works
offline. PDFs (one slide per page, notes under it) are built into <code>slides/pdf/</code> by
<code>.venv/bin/python slides/build.py</code> when Chromium is installed; or open a deck with
<code>?print-pdf</code> and print it.</p>
<p>Sources: <a href="../REFERENCES.md"><code>REFERENCES.md</code></a> lists every paper, standard
and documentation page the decks and labs rely on, with the section or table each fact comes
from; the citations on the slides link to it.</p>
<ol>
{chr(10).join(rows)}
</ol>
</body>
</html>
"""


# --- Printing, in the system's Chromium ------------------------------------------------------

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
# A headless Chromium that contacts nobody by itself (and runs as root in CI containers).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-default-apps", "--disable-extensions", "--hide-scrollbars",
                 "--mute-audio", "--disable-dev-shm-usage"]
WIDTH, HEIGHT = 1280, 720


def find_chromium() -> str | None:
    """The path of an installed Chromium (or Chrome), or None."""
    return next((found for name in CHROMIUM_NAMES if (found := shutil.which(name))), None)


@contextlib.contextmanager
def chromium(path: str):
    """A headless Chromium (a Playwright Browser) started from `path`, closed afterwards."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def print_deck(browser, deck: Path) -> bytes:
    """A reveal.js deck printed to PDF (opened with ?print-pdf, once reveal has laid out its
    pages): one page per slide, with the speaker notes under the slide."""
    page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
    try:
        page.goto(deck.resolve().as_uri() + "?print-pdf")
        page.wait_for_function("document.querySelectorAll('.pdf-page').length > 0 && "
                               "document.querySelectorAll('.pdf-page').length === "
                               "document.querySelectorAll('.slides section').length")
        cut = page.evaluate("[...document.querySelectorAll('.pdf-page')].map((p, i) => "
                            "[i + 1, p.querySelector('.speaker-notes-pdf')]).filter(([, n]) => "
                            "n && n.scrollHeight > n.clientHeight + 1).map(([i]) => i)")
        if cut:
            raise ValueError(f"{deck.name}: the notes of slides {cut} do not fit under the slide "
                             "when printed; shorten them")
        return page.pdf(prefer_css_page_size=True, print_background=True)
    finally:
        page.close()


# --- Main ----------------------------------------------------------------------------------------


def build() -> dict[Path, str]:
    """Every output file and its text: the decks and the index."""
    head, scripts = assets()
    sources = {path.stem: path.read_text() for path in sorted(SLIDES.glob("[0-9][0-9]_*.md"))}
    built = {SLIDES / f"{name}.html": render(markdown, head, scripts)
             for name, markdown in sources.items()}
    built[SLIDES / "index.html"] = index(sources)
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the committed decks")
    args = parser.parse_args()
    built = build()
    if args.check:
        stale = [path.name for path, text in built.items()
                 if not path.exists() or path.read_text() != text]
        if stale:
            sys.exit(f"out of date: {', '.join(stale)}; rebuild with: "
                     ".venv/bin/python slides/build.py")
        return
    for path, text in built.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(SLIDES.parent)}")
    path = find_chromium()
    if path is None:
        print("no Chromium found: PDFs not built (install the `chromium` package for them)")
        return
    PDF_DIR.mkdir(exist_ok=True)
    with chromium(path) as browser:
        for deck in built:
            if deck.name != "index.html":
                pdf = PDF_DIR / deck.with_suffix(".pdf").name
                pdf.write_bytes(print_deck(browser, deck))
                print(f"wrote {pdf.relative_to(SLIDES.parent)}")


if __name__ == "__main__":
    main()
