"""A headless Chromium driven over the Chrome DevTools Protocol, for the web UI's browser test.

CDP over one WebSocket (the ``websockets`` package the server already needs) instead of Selenium:
no extra Python dependency and no chromedriver whose version must match the browser; and CDP
reports JavaScript dialogs (``alert``) as events, which is exactly what the XSS check needs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    for name in NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


class _Connection:
    """A DevTools WebSocket: commands by id, with the events that arrive meanwhile to ``_event``."""

    ws: ClientConnection
    _next: int

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next += 1
        ident = self._next
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=20))
            if msg.get("id") == ident:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result
            self._event(msg)

    def _event(self, msg: dict[str, Any]) -> None:
        """An event (the browser's own connection ignores them)."""


class Chromium(_Connection):
    """One headless Chromium process, shared by the tests of a session (starting one takes about
    a second). Each ``Browser`` is a browser context of its own in it (``Target.createBrowserContext``:
    its own cookies, storage and cache, as an incognito window has), with one page, disposed of
    with everything in it at the test's end; so what one test leaves in its browser cannot reach
    another, as with a Chromium of its own per test."""

    def __init__(self, binary: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="agentloop-chromium-")
        args = [
            binary,
            "--headless=new",
            "--no-sandbox",  # we run as root in CI's container
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--remote-debugging-port=0",
            f"--user-data-dir={self.profile}",
            "about:blank",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            self.port = self._devtools_port()
            version = httpx.get(f"http://127.0.0.1:{self.port}/json/version", timeout=5).json()
            self.ws: ClientConnection = connect(version["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
            self.ws.__enter__()
        except BaseException:
            self._end()
            raise
        self._next = 0

    def _devtools_port(self) -> int:
        marker = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"chromium exited with {self.proc.returncode}: {err[-2000:]}")
            if marker.exists() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            time.sleep(0.05)
        raise RuntimeError("chromium did not open its DevTools port in 20 s")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self._end()

    def _end(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        shutil.rmtree(self.profile, ignore_errors=True)


class Browser(_Connection):
    """One page in a fresh browser context of a ``Chromium``; ``dialogs`` collects every
    alert/confirm it opened."""

    def __init__(self, chromium: Chromium) -> None:
        self.chromium = chromium
        self.context: str = chromium.call("Target.createBrowserContext", disposeOnDetach=True)["browserContextId"]
        try:
            target = chromium.call("Target.createTarget", url="about:blank", browserContextId=self.context)
            url = f"ws://127.0.0.1:{chromium.port}/devtools/page/{target['targetId']}"
            self.ws: ClientConnection = connect(url, max_size=None, open_timeout=10)
            self.ws.__enter__()  # websockets 17 asks for a context manager; close() below ends it
        except BaseException:
            chromium.call("Target.disposeBrowserContext", browserContextId=self.context)
            raise
        self._next = 0
        self.dialogs: list[str] = []
        self.accept_dialogs = False  # confirm() answers: no unless a test says yes
        self.console: list[str] = []
        self.holding: str | None = None  # the method of the requests whose responses ``hold`` keeps
        self.held: list[str] = []  # their request ids, until ``release``
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Log.enable")  # CSP violations and failed loads are reported here

    def close(self) -> None:
        """Close the page and dispose of its context: its storage, cookies and cache with it."""
        try:
            self.ws.close()
        finally:
            if self.chromium.alive():
                self.chromium.call("Target.disposeBrowserContext", browserContextId=self.context)

    def _event(self, msg: dict[str, Any]) -> None:
        method = msg.get("method")
        params = msg.get("params", {})
        if method == "Page.javascriptDialogOpening":
            self.dialogs.append(f"{params.get('type')}: {params.get('message')}")
            # Answer it, or the page would stay blocked; the reply comes back as an unmatched id.
            self._next += 1
            answer = {"accept": self.accept_dialogs}
            self.ws.send(json.dumps({"id": self._next, "method": "Page.handleJavaScriptDialog", "params": answer}))
        elif method == "Runtime.consoleAPICalled":
            self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
        elif method == "Log.entryAdded":
            entry = params["entry"]
            self.console.append(f"{entry.get('source')}/{entry.get('level')}: {entry.get('text')}")
        elif method == "Runtime.exceptionThrown":
            self.console.append(f"exception: {params['exceptionDetails']}")
        elif method == "Fetch.requestPaused":  # (see ``hold``)
            if params["request"]["method"] == self.holding:
                self.held.append(params["requestId"])
            else:  # not one to hold: on its way at once, the reply coming back as an unmatched id
                self._next += 1
                resume = {"requestId": params["requestId"]}
                self.ws.send(json.dumps({"id": self._next, "method": "Fetch.continueRequest", "params": resume}))

    def eval(self, expression: str) -> Any:
        """The value of ``expression`` in the page (promises awaited)."""
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression!r} threw: {out['exceptionDetails']}")
        return out["result"].get("value")

    def wait(self, expression: str, timeout: float = 20.0) -> Any:
        """Poll ``expression`` until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        value: Any = None
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value not in (None, False, "", 0):  # an element comes back as {}: present, so true
                return value
            time.sleep(0.05)
        raise AssertionError(f"not true within {timeout}s: {expression} (last: {value!r}; console: {self.console})")

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait("document.readyState === 'complete' && location.href !== 'about:blank'")

    def reload(self) -> None:
        self.eval("window.__before_reload = true")
        self.call("Page.reload", ignoreCache=True)
        self.wait("document.readyState === 'complete' && window.__before_reload === undefined")

    def hold(self, method: str, url_pattern: str) -> None:
        """Keep the responses to ``method`` requests whose URL matches ``url_pattern`` (a glob) from
        the page until ``release``: the server has answered, the page has not seen it yet, as when a
        loaded machine delivers a response late. Requests of other methods pass at once."""
        self.holding = method
        self.call("Fetch.enable", patterns=[{"urlPattern": url_pattern, "requestStage": "Response"}])

    def release(self) -> int:
        """Let the held responses reach the page, and stop holding; how many there were."""
        released = 0
        for request_id in self.held:
            self.call("Fetch.continueRequest", requestId=request_id)
            released += 1
        self.held, self.holding = [], None
        self.call("Fetch.disable")
        return released

    def type_into(self, element_id: str, text: str) -> None:
        """Focus the element and type ``text`` as keyboard input (Input.insertText)."""
        self.eval(f"document.getElementById({json.dumps(element_id)}).focus()")
        self.call("Input.insertText", text=text)

    def click(self, selector: str) -> None:
        self.eval(f"document.querySelector({json.dumps(selector)}).click()")


def required() -> bool:
    """CI sets this, so a missing browser fails the run instead of skipping the test."""
    return os.environ.get("AGENTLOOP_REQUIRE_BROWSER") == "1"
