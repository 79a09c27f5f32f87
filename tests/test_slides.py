"""The slide decks: built from their sources, complete for self-study, and working in a real
(headless) Chromium: offline, keyboard, layout, speaker notes and print."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLIDES = REPO / "slides"
sys.path.insert(0, str(SLIDES))
from build import chromium, find_chromium, print_deck  # noqa: E402

LABS = sorted(path.name for path in (REPO / "solutions").glob("[0-9][0-9]_*"))
DECKS = sorted(SLIDES.glob("[0-9][0-9]_*.html"))
MIN_SLIDES, MIN_FIGURES = 15, 4
WIDTH, HEIGHT = 1280, 720
APT_TIMEOUT_S = 900


def sections(deck: Path) -> list[str]:
    return re.findall(r"<section>(.*?)</section>", deck.read_text(), re.DOTALL)


def test_decks_are_built_from_their_sources():
    if shutil.which("npm") is None and not (SLIDES / "node_modules").is_dir():
        pytest.skip("rebuilding the decks needs npm (Node.js) to fetch reveal.js and KaTeX; "
                    "install Node.js to run this check")
    check = [sys.executable, str(SLIDES / "build.py"), "--check"]
    done = subprocess.run(check, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_ready_lab_has_a_deck_for_self_study():
    index = (SLIDES / "index.html").read_text()
    for lab in LABS:
        deck = SLIDES / f"{lab}.html"
        assert deck.exists(), f"solutions/{lab} has no slides/{lab}.html"
        slides = sections(deck)
        assert len(slides) >= MIN_SLIDES, (
            f"slides/{lab}.html has {len(slides)} slides, expected at least {MIN_SLIDES}")
        unnoted = [n for n, slide in enumerate(slides, 1)
                   if not re.search(r'<aside class="notes">\s*\S', slide)]
        assert not unnoted, f"slides/{lab}.html: slides {unnoted} have no speaker notes"
        figures = set(re.findall(r'<img [^>]*src="(data:image/png;base64,[^"]+)"',
                                 deck.read_text()))
        assert len(figures) >= MIN_FIGURES, (
            f"slides/{lab}.html embeds {len(figures)} distinct figures, expected at least "
            f"{MIN_FIGURES}")
        markup = re.sub(r"<script>.*?</script>", "", deck.read_text(), flags=re.DOTALL)
        sources = re.findall(r'<(?:img|script|link|iframe|source|video|audio)[^>]*'
                             r'(?:src|href)="([^"]+)"', markup)
        external = [source for source in sources if not source.startswith("data:")]
        assert not external, f"slides/{lab}.html loads {external}; everything must be inlined"
        assert f'href="{lab}.html"' in index, f"slides/index.html does not list {lab}.html"
    readme = (REPO / "README.md").read_text()
    assert "slides/index.html" in readme, "README.md does not point self-learners to the index"


# --- In a browser ------------------------------------------------------------------------------


def chromium_or_skip() -> str:
    """Chromium's path, installing Debian's `chromium` package when needed (as the cluster tests
    install Slurm); skips, saying why, where it cannot be installed."""
    found = find_chromium()
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("the browser tests need Chromium: install the `chromium` package (they "
                    "install it themselves when run as root on a Debian-like system)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends",
               "-o", "DPkg::Lock::Timeout=300", "chromium"]
    done = subprocess.run(install, env=env, capture_output=True, text=True,
                          timeout=APT_TIMEOUT_S)
    if done.returncode != 0:  # a fresh machine (a CI container) may have no package lists yet
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True,
                       timeout=APT_TIMEOUT_S)
        done = subprocess.run(install, env=env, capture_output=True, text=True,
                              timeout=APT_TIMEOUT_S)
    found = find_chromium()
    if not found:
        pytest.skip(f"Chromium could not be installed: {(done.stderr or done.stdout)[-500:]}")
    return found


@pytest.fixture(scope="module")
def browser():
    with chromium(chromium_or_skip()) as running:
        yield running


def _open(browser, uri: str):
    """A new page at the deck's slide size, showing `uri` once reveal.js is ready, and the list
    of every URL it requests."""
    page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.goto(uri)
    page.wait_for_function("typeof Reveal !== 'undefined' && Reveal.isReady()")
    return page, requests


def _not_blank(png: bytes) -> tuple[float, int]:
    """(share of pixels that differ from the most common colour, number of colours)."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    counts = image.getcolors(maxcolors=WIDTH * HEIGHT)
    background = max(counts)[0]
    return 1 - background / (image.width * image.height), len(counts)


# Where the current slide's content lies outside the 1280 x 720 slide, in slide pixels.
OVERFLOW = """(() => {
  const slide = Reveal.getCurrentSlide();
  const box = Reveal.getSlidesElement().getBoundingClientRect();
  const scale = Reveal.getScale();
  const out = [];
  for (const element of slide.querySelectorAll('*')) {
    // Skip the notes (hidden) and KaTeX's MathML copy (for screen readers, clipped to 1 px).
    if (element.closest('aside.notes, .katex-mathml')) continue;
    const r = element.getBoundingClientRect();
    if (r.width === 0 && r.height === 0) continue;
    const over = Math.max(box.left - r.left, r.right - box.right,
                          box.top - r.top, r.bottom - box.bottom) / scale;
    if (over > 1) out.push(`${element.tagName.toLowerCase()} ${Math.round(over)} px: ` +
                           (element.textContent || element.getAttribute('alt') || '').slice(0, 50));
  }
  for (const element of slide.querySelectorAll('pre, .katex-display')) {
    if (element.scrollWidth > element.clientWidth + 1)
      out.push(`${element.className || element.tagName} cut inside: ` +
               element.textContent.slice(0, 50));
  }
  return out;
})()"""


@pytest.mark.xdist_group("browser")
@pytest.mark.parametrize("deck", DECKS, ids=[deck.stem for deck in DECKS])
def test_deck_works_offline_by_keyboard_within_the_slide(browser, deck):
    uri = deck.resolve().as_uri()
    page, requests = _open(browser, uri)
    try:
        total = page.evaluate("Reveal.getTotalSlides()")
        assert total == len(sections(deck)), f"reveal sees {total} slides of {len(sections(deck))}"
        raw_math = page.evaluate(
            "[...document.querySelectorAll('.slides .math')].filter(m => !m.querySelector("
            "'.katex')).map(m => m.textContent)")
        assert not raw_math, f"{deck.name}: formulas not rendered by KaTeX: {raw_math[:3]}"
        raw_tex = page.evaluate(
            "[...document.querySelectorAll('.slides section')].map((s, i) => [i + 1, "
            "s.cloneNode(true)]).filter(([, s]) => { s.querySelectorAll('.katex, pre, code')"
            ".forEach(e => e.remove()); return /\\$|\\\\[a-zA-Z(\\[]/.test(s.textContent); })"
            ".map(([i]) => i)")
        assert not raw_tex, f"{deck.name}: slides {raw_tex} show raw TeX ($ or a backslash)"
        problems = []
        for index in range(total):
            at = page.evaluate("Reveal.getIndices().h")
            assert at == index, f"{deck.name}: after {index} presses of → the deck is at {at}"
            overflow = page.evaluate(OVERFLOW)
            if overflow:
                problems.append(f"slide {index + 1}: " + "; ".join(overflow[:3]))
            inked, colours = _not_blank(page.screenshot())
            if inked < 0.01 or colours < 3:
                problems.append(f"slide {index + 1} looks blank ({inked:.2%} drawn, {colours} "
                                "colours)")
            page.keyboard.press("ArrowRight")
        assert page.evaluate("Reveal.isLastSlide()"), f"{deck.name}: → never reached the end"
        page.keyboard.press("ArrowLeft")
        assert page.evaluate("Reveal.getIndices().h") == total - 2, "← does not move back"
        page.keyboard.press("Escape")
        assert page.evaluate("Reveal.isOverview()"), f"{deck.name}: Esc shows no overview"
        page.keyboard.press("Escape")
        assert not problems, f"{deck.name}:\n" + "\n".join(problems)
        external = [url for url in requests
                    if not url.startswith("data:") and url.split("#")[0] != uri]
        assert not external, f"{deck.name} made network requests: {external}"
    finally:
        page.close()


@pytest.mark.xdist_group("browser")
@pytest.mark.parametrize("deck", DECKS, ids=[deck.stem for deck in DECKS])
def test_speaker_notes_key_opens_the_speaker_view(browser, deck):
    page, _ = _open(browser, deck.resolve().as_uri())
    try:
        with page.expect_popup() as opened:
            page.keyboard.press("s")
        speaker_view = opened.value
        notes_text = page.evaluate("Reveal.getSlideNotes()")
        first_words = re.sub(r"<[^>]+>", "", notes_text).split()[:4]
        speaker_view.wait_for_function(
            "(document.querySelector('.speaker-controls-notes') || {innerText: ''}).innerText"
            f".includes({' '.join(first_words)!r})")
        speaker_view.close()
    finally:
        page.close()


@pytest.mark.xdist_group("browser")
@pytest.mark.parametrize("deck", DECKS, ids=[deck.stem for deck in DECKS])
def test_deck_prints_one_page_per_slide(browser, deck):
    pdf = print_deck(browser, deck)
    pages = len(re.findall(rb"/Type\s*/Page(?![s\w])", pdf))
    assert pages == len(sections(deck)), (
        f"{deck.name} printed {pages} pages for {len(sections(deck))} slides")
