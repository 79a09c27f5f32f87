"""A headless Chromium driven over the DevTools protocol, for printing decks and for testing them.

    with Browser(find_chromium()) as browser:
        page = browser.open(Path("slides/00_first_ranks.html").resolve().as_uri())
        page.evaluate("Reveal.getTotalSlides()")
        page.press("ArrowRight")
        png = page.screenshot()
        pdf = browser.print_deck(Path("slides/00_first_ranks.html"))

The protocol runs over a pipe (`--remote-debugging-pipe`: commands on the child's fd 3, replies
on its fd 4, each message JSON ended by a NUL byte), so nothing listens on a port and nothing
beyond the standard library is needed.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
# A headless Chromium that contacts nobody by itself (and runs as root in CI containers).
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run",
                  "--disable-default-apps", "--disable-extensions", "--hide-scrollbars",
                  "--mute-audio", "--disable-dev-shm-usage")
KEYS = {  # name: (key, code, Windows virtual key code), as Input.dispatchKeyEvent wants them
    "ArrowRight": ("ArrowRight", "ArrowRight", 39), "ArrowLeft": ("ArrowLeft", "ArrowLeft", 37),
    "Escape": ("Escape", "Escape", 27), "s": ("s", "KeyS", 83),
}


class BrowserError(RuntimeError):
    """Chromium failed, answered with an error, or did not answer in time."""


def find_chromium() -> str | None:
    """The path of an installed Chromium (or Chrome), or None."""
    return next((found for name in CHROMIUM_NAMES if (found := shutil.which(name))), None)


class Browser:
    """One headless Chromium process with a fresh profile; a context manager."""

    def __init__(self, chromium: str, width: int = 1280, height: int = 720,
                 timeout: float = 30) -> None:
        self.chromium, self.width, self.height, self.timeout = chromium, width, height, timeout
        self.events: list[dict] = []
        self._next_id = 0
        self._buffer = b""

    def __enter__(self) -> Browser:
        self._profile = tempfile.TemporaryDirectory(prefix="slides-chromium-")
        to_child, self._write = os.pipe()
        self._read, from_child = os.pipe()

        def on_fds_3_and_4() -> None:  # runs in the child, before exec
            # Move both ends out of the way first: either may already be fd 3 or 4.
            moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_child, from_child)]
            os.dup2(moved[0], 3)  # dup2 leaves 3 and 4 inheritable; Python's own fds are not
            os.dup2(moved[1], 4)

        self._process = subprocess.Popen(
            [self.chromium, *CHROMIUM_FLAGS, "--remote-debugging-pipe",
             f"--user-data-dir={self._profile.name}",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=False, preexec_fn=on_fds_3_and_4)
        os.close(to_child)
        os.close(from_child)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call("Browser.close")
        except (BrowserError, OSError):
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._read)
        os.close(self._write)
        self._profile.cleanup()

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise BrowserError("Chromium did not answer in time")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium exited (code {self._process.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: str | None = None, **params: Any) -> dict:
        """Send one command and return its result; events that arrive meanwhile are kept."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, session: str | None = None, timeout: float | None = None
                 ) -> dict:
        """The first (kept or new) event named `method`, removed from the kept events."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            for event in self.events:
                if event.get("method") == method and event.get("sessionId", session) == session:
                    self.events.remove(event)
                    return event
            self.events.append(self._receive(deadline))

    def print_deck(self, deck: Path) -> bytes:
        """A reveal.js deck printed to PDF (opened with ?print-pdf, once reveal has laid out
        its pages): one page per slide, with the speaker notes under the slide."""
        page = self.open(deck.resolve().as_uri() + "?print-pdf")
        page.wait_until("document.querySelectorAll('.pdf-page').length > 0 && "
                        "document.querySelectorAll('.pdf-page').length === "
                        "document.querySelectorAll('.slides section').length")
        cut = page.evaluate("[...document.querySelectorAll('.pdf-page')].map((p, i) => "
                            "[i + 1, p.querySelector('.speaker-notes-pdf')]).filter(([, n]) => "
                            "n && n.scrollHeight > n.clientHeight + 1).map(([i]) => i)")
        if cut:
            page.close()
            raise BrowserError(f"{deck.name}: the notes of slides {cut} do not fit under the "
                               "slide when printed; shorten them")
        pdf = page.pdf()
        page.close()
        return pdf

    def open(self, url: str) -> Page:
        """A new tab showing `url`, loaded, at the browser's viewport size."""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        page = Page(self, target, session)
        for domain in ("Page", "Runtime", "Network"):
            self.call(f"{domain}.enable", session)
        self.call("Emulation.setDeviceMetricsOverride", session, width=self.width,
                  height=self.height, deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", session, url=url)
        self.wait_for("Page.loadEventFired", session)
        return page


class Page:
    """One tab of a Browser."""

    def __init__(self, browser: Browser, target: str, session: str) -> None:
        self.browser, self.target, self.session = browser, target, session

    def close(self) -> None:
        self.browser.call("Target.closeTarget", targetId=self.target)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (promises are awaited)."""
        result = self.browser.call("Runtime.evaluate", self.session, expression=expression,
                                   awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise BrowserError(f"{expression!r} raised: "
                               f"{details.get('exception', {}).get('description', details)}")
        return result["result"].get("value")

    def wait_until(self, expression: str, timeout: float = 20) -> None:
        """Poll a JavaScript condition until it holds."""
        deadline = time.monotonic() + timeout
        while not self.evaluate(expression):
            if time.monotonic() > deadline:
                raise BrowserError(f"still false after {timeout} s: {expression}")
            time.sleep(0.05)

    def press(self, name: str) -> None:
        """Press and release a key (a name in KEYS), as a user would."""
        key, code, virtual = KEYS[name]
        for kind in ("rawKeyDown", "keyUp"):
            self.browser.call("Input.dispatchKeyEvent", self.session, type=kind, key=key,
                              code=code, windowsVirtualKeyCode=virtual,
                              nativeVirtualKeyCode=virtual, **({"text": key} if len(key) == 1
                                                               and kind == "rawKeyDown" else {}))

    def screenshot(self) -> bytes:
        """The viewport as PNG."""
        data = self.browser.call("Page.captureScreenshot", self.session, format="png")["data"]
        return base64.b64decode(data)

    def pdf(self) -> bytes:
        """The page printed with its own CSS page size, backgrounds included."""
        data = self.browser.call("Page.printToPDF", self.session, preferCSSPageSize=True,
                                 printBackground=True)["data"]
        return base64.b64decode(data)

    def requests(self) -> list[str]:
        """URLs this tab has requested so far (kept events of the Network domain)."""
        return [event["params"]["request"]["url"] for event in self.browser.events
                if event.get("method") == "Network.requestWillBeSent"
                and event.get("sessionId") == self.session]
