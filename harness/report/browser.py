"""Open a report in headless Chromium and say what happened: console errors, network requests, load time,
and a screenshot.

It speaks the Chrome DevTools protocol over ``--remote-debugging-pipe`` (JSON messages separated by NUL
bytes on file descriptors 3 and 4 of the browser): the standard library is enough, with no websocket client
and no debugging port open on the machine.

    check = open_page("reports/run/index.html", screenshot="shot.png")
    assert not check.console_errors and not check.network_requests

What counts as a network request: any request whose URL is not ``file:``, ``data:``, ``blob:`` or ``about:``
(a self-contained report makes none). What counts as a console error: ``console.error``/``console.assert``,
an uncaught exception, or a browser log entry of level error (a failed load, a refused resource).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import pathlib
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

# Debian's package installs /usr/bin/chromium; other names are tried for other systems.
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:", "chrome-error:")

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
         "--remote-debugging-pipe")


class BrowserError(RuntimeError):
    """Chromium could not be started, or did not answer in time; the message says which."""


def find_chromium() -> Optional[str]:
    """The Chromium executable ($SSDIFF_CHROMIUM, else the first of CANDIDATES on PATH), or None."""
    explicit = os.environ.get("SSDIFF_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageCheck:
    """What loading one page did. load_ms: navigation start to the end of the load event (the page's own
    Navigation Timing); wall_ms: from the navigate command to the load event, as seen from here."""

    url: str
    loaded: bool = False
    load_ms: Optional[float] = None
    wall_ms: Optional[float] = None
    console_errors: list = field(default_factory=list)
    console_messages: list = field(default_factory=list)
    requests: list = field(default_factory=list)
    title: str = ""
    text_length: int = 0
    page_height: int = 0
    screenshot: Optional[str] = None
    version: str = ""

    @property
    def network_requests(self) -> list:
        return [u for u in self.requests if not u.startswith(LOCAL_SCHEMES)]


class _Pipe:
    """The DevTools protocol over a pair of pipes: send commands, collect events, wait for replies."""

    def __init__(self, write_fd: int, read_fd: int, process: subprocess.Popen):
        self.write_fd, self.read_fd, self.process = write_fd, read_fd, process
        self.buffer = b""
        self.next_id = 0
        self.events: list = []
        self.replies: dict = {}

    def send(self, method: str, params: Optional[dict] = None, session: Optional[str] = None) -> int:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self.write_fd, data):]
        return self.next_id

    def _pump(self, deadline: float) -> None:
        wait = max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([self.read_fd], [], [], wait)
        if not ready:
            return
        chunk = os.read(self.read_fd, 1 << 20)
        if not chunk:
            raise BrowserError(f"chromium closed the DevTools pipe (exit status {self.process.poll()})")
        self.buffer += chunk
        *messages, self.buffer = self.buffer.split(b"\0")
        for raw in messages:
            message = json.loads(raw)
            if "id" in message:
                self.replies[message["id"]] = message
            else:
                self.events.append(message)

    def call(self, method: str, params: Optional[dict] = None, session: Optional[str] = None,
             timeout: float = 30.0) -> dict:
        ident = self.send(method, params, session)
        deadline = time.monotonic() + timeout
        while ident not in self.replies:
            if time.monotonic() >= deadline:
                raise BrowserError(f"chromium did not answer {method} within {timeout:g} s")
            self._pump(deadline)
        reply = self.replies.pop(ident)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message', reply['error'])}")
        return reply.get("result", {})

    def wait_event(self, method: str, timeout: float) -> Optional[dict]:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if event.get("method") == method:
                    return event
            if time.monotonic() >= deadline:
                return None
            self._pump(deadline)

    def drain(self, seconds: float) -> None:
        """Collect events for ``seconds`` more (late console messages, late requests)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._pump(deadline)


def open_page(path, screenshot=None, width: int = 1400, height: int = 3000, timeout: float = 60.0,
              chromium: Optional[str] = None, javascript: bool = True) -> PageCheck:
    """Load ``path`` (an HTML file) in headless Chromium; return what happened. With ``screenshot`` (a file
    path) write a PNG of the first ``width`` x ``height`` CSS pixels of the page there. ``javascript=False``:
    the page's scripts do not run (what a reader with JavaScript off sees)."""
    exe = chromium or find_chromium()
    if exe is None:
        raise BrowserError("chromium is not installed (Debian: apt-get install chromium)")
    url = pathlib.Path(path).resolve().as_uri()
    check = PageCheck(url=url)
    commands_r, commands_w = os.pipe()
    replies_r, replies_w = os.pipe()

    def plumb():
        # In the child: the browser reads commands from fd 3 and writes replies to fd 4. Move both ends above
        # 4 first, as either may itself be 3 or 4.
        read_end = fcntl.fcntl(commands_r, fcntl.F_DUPFD, 10)
        write_end = fcntl.fcntl(replies_w, fcntl.F_DUPFD, 10)
        os.dup2(read_end, 3)
        os.dup2(write_end, 4)

    with tempfile.TemporaryDirectory(prefix="ssdiff-chromium-") as profile, \
            tempfile.TemporaryFile(prefix="ssdiff-chromium-log-") as log:
        # close_fds=False keeps fds 3 and 4 (set up by plumb) open across exec; Python's own descriptors are
        # not inheritable (PEP 446), so nothing else leaks.
        process = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                                    "about:blank"],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                   preexec_fn=plumb, close_fds=False)
        os.close(commands_r)
        os.close(replies_w)
        pipe = _Pipe(commands_w, replies_r, process)
        try:
            _drive(pipe, check, screenshot, width, height, timeout, javascript)
        except BrowserError as err:
            log.seek(0)
            tail = log.read()[-2000:].decode(errors="replace").strip()
            raise BrowserError(f"{err}" + (f"\nchromium's log ends:\n{tail}" if tail else "")) from None
        finally:
            try:
                pipe.send("Browser.close")
            except OSError:
                pass
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            os.close(commands_w)
            os.close(replies_r)
    return check


def _drive(pipe: _Pipe, check: PageCheck, screenshot, width: int, height: int, timeout: float,
           javascript: bool) -> None:
    check.version = pipe.call("Browser.getVersion", timeout=timeout).get("product", "")
    target = pipe.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Page", "Runtime", "Log", "Network"):
        pipe.call(f"{domain}.enable", session=session)
    pipe.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                     "mobile": False}, session=session)
    if not javascript:
        pipe.call("Emulation.setScriptExecutionDisabled", {"value": True}, session=session)
    pipe.events.clear()
    start = time.monotonic()
    pipe.call("Page.navigate", {"url": check.url}, session=session)
    loaded = pipe.wait_event("Page.loadEventFired", timeout)
    check.wall_ms = (time.monotonic() - start) * 1000.0
    check.loaded = loaded is not None
    pipe.drain(0.3)

    timing = pipe.call("Runtime.evaluate", {
        "expression": "JSON.stringify({load: performance.getEntriesByType('navigation')[0]?.loadEventEnd ?? null,"
                      " title: document.title, text: document.body ? document.body.innerText.length : 0,"
                      " height: document.documentElement.scrollHeight})",
        "returnByValue": True}, session=session)
    facts = json.loads(timing.get("result", {}).get("value") or "{}")
    check.load_ms = facts.get("load")
    check.title = facts.get("title", "")
    check.text_length = facts.get("text", 0)
    check.page_height = facts.get("height", 0)
    if screenshot is not None:
        shot = pipe.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": False},
                         session=session)
        pathlib.Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
        check.screenshot = str(screenshot)
    pipe.drain(0.2)

    for event in pipe.events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Network.requestWillBeSent":
            check.requests.append(params.get("request", {}).get("url", ""))
        elif method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            check.console_messages.append(f"{params.get('type')}: {text}")
            if params.get("type") in ("error", "assert"):
                check.console_errors.append(text)
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            check.console_errors.append(details.get("exception", {}).get("description") or details.get("text", ""))
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            check.console_messages.append(f"{entry.get('level')}: {entry.get('text')}")
            if entry.get("level") == "error":
                check.console_errors.append(f"{entry.get('text')} ({entry.get('url', '')})")


__all__ = ["open_page", "find_chromium", "PageCheck", "BrowserError"]
