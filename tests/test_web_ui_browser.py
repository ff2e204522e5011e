"""The web UI in a real browser: headless Chromium (over CDP, tests/cdp.py) against a real
``agentloop serve`` subprocess whose model is a script.

One conversation covers the page end to end: sign in with the admin token printed on first
start, start a process, watch an answer stream in (it carries an ``<img onerror>`` payload, which
must stay text), watch a tool call wait for approval, reload mid-run, find the conversation and
the pending approval exactly once, approve, and see the run finish; then another message, and a
last reload, with every message on the page exactly once.

Without Chromium the test skips, unless ``AGENTLOOP_REQUIRE_BROWSER=1`` (CI) makes it fail.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cdp import Browser

AGENTLOOP = Path(sys.executable).parent / "agentloop"
XSS = "<img src=x onerror=alert(1)>"
HELLO = f"Hello! Markup stays text: {XSS} and <b>bold</b>, streamed in small pieces."
REPLIES = [
    HELLO,
    {"tool_calls": [{"name": "Delete", "arguments": {"path": "junk.txt"}}]},
    "Deleted junk.txt.",
    "Still here.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def replies() -> list[object]:
    """The model's script (a test may parametrize its own)."""
    return REPLIES


@pytest.fixture
def served(tmp_path: Path, replies: list[object]) -> Iterator[tuple[str, str, Path]]:
    """``agentloop serve`` on a free port: (url, admin token, workspace)."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "junk.txt").write_text("junk\n")
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"chunk": 3, "replies": replies}))
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTLOOP_MODEL", "AGENTLOOP_DATA", "AGENTLOOP_TOKEN")}
    env.update(
        AGENTLOOP_CONFIG=str(tmp_path / "no-config.toml"), XDG_DATA_HOME=str(tmp_path / "xdg"), PYTHONUNBUFFERED="1"
    )
    port = free_port()
    args = [str(AGENTLOOP), "serve", "--port", str(port), "--data", str(tmp_path / "data")]
    args += ["--model", f"scripted:{script}", "--workspace", str(workspace)]  # default approval: Delete asks
    lines: list[str] = []
    with (tmp_path / "serve.err").open("w") as err:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, env=env)

        def read() -> None:
            assert proc.stdout is not None
            lines.extend(line.rstrip("\n") for line in proc.stdout)

        threading.Thread(target=read, daemon=True).start()
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while not any(line.startswith("web UI:") for line in lines):
                assert proc.poll() is None, (tmp_path / "serve.err").read_text()
                assert time.monotonic() < deadline, f"serve did not start: {lines}"
                time.sleep(0.05)
            assert f"web UI: {url}/ (sign in with a token)" in lines
            tokens = [m for line in lines for m in re.findall(r"al_[A-Za-z0-9_\-]{20,}", line)]
            assert len(tokens) == 1, lines
            yield url, tokens[0], workspace
        finally:
            proc.kill()
            proc.wait(30)


# What the transcript shows, in order: (kind, text) of every bubble, tool card and run footer.
TRANSCRIPT = """[...document.querySelectorAll('#transcript .msg, #transcript .tool, #transcript .footer')]
  .filter((n) => n.textContent !== '')
  .map((n) => [n.classList.contains('tool') ? 'tool' : n.classList.contains('footer') ? 'footer'
              : n.classList.contains('user') ? 'user' : 'assistant', n.textContent])"""
OK = ["footer", "run finished: ok (turn.complete)"]


def test_chat_in_the_browser_streams_asks_resumes_and_never_renders_model_markup(
    served: tuple[str, str, Path], browser: Browser
) -> None:
    url, token, workspace = served
    started = time.monotonic()
    browser.navigate(url + "/")
    browser.wait("!document.getElementById('signin').hidden")

    # Sign in; the token goes to sessionStorage, never into the URL.
    browser.type_into("token", token)
    browser.eval("document.getElementById('signin-form').requestSubmit()")
    assert browser.wait("document.getElementById('who').textContent") == "admin (admin)"
    assert browser.eval("sessionStorage.getItem('agentloop.token')") == token
    assert token not in browser.eval("location.href")

    # A new process, opened.
    browser.click("#new-process")
    following = "document.getElementById('transcript').dataset.stream === 'live'"
    pid = browser.wait(f"{following} && document.getElementById('proc-title').textContent")
    listed = browser.eval("[...document.querySelectorAll('#processes li')].map((li) => li.dataset.pid)")
    assert pid in listed

    # Record every text the streaming bubble showed, to see the answer arrive in pieces.
    browser.eval(
        """window.__streamed = [];
        new MutationObserver((records) => { for (const r of records) for (const n of r.addedNodes)
            if (n.nodeType === 3 && r.target.classList && r.target.classList.contains('live')) __streamed.push(n.data);
        }).observe(document.getElementById('transcript'), {childList: true, subtree: true});"""
    )
    browser.type_into("text", "hello")
    browser.click("#send")
    browser.wait("document.querySelector('#transcript .footer[data-status=ok]')")
    streamed = browser.eval("window.__streamed")
    assert any(0 < len(s) < len(HELLO) and HELLO.startswith(s) for s in streamed), streamed  # partial text, live
    assert browser.eval(TRANSCRIPT) == [["user", "hello"], ["assistant", HELLO], OK]
    # The payload is text: no element was made from it, no dialog opened, the markup is visible as written.
    assert browser.eval("document.querySelectorAll('img, b, #transcript *[onerror]').length") == 0
    assert browser.eval("[...document.querySelectorAll('#transcript .msg.assistant')].map((n) => n.textContent)") == [
        HELLO
    ]

    # A tool call the policy asks about: the card shows its arguments, the approval waits.
    browser.type_into("text", "clean up")
    browser.click("#send")
    browser.wait("document.querySelector('#approvals .approval')")
    assert "junk.txt" in browser.eval("document.querySelector('#approvals .approval pre').textContent")

    # Reload mid-run: the conversation and the pending approval come back, each once.
    browser.reload()
    browser.wait(f"{following} && document.querySelectorAll('#approvals .approval').length === 1")
    assert browser.eval("document.getElementById('proc-title').textContent") == pid
    shown = browser.eval(TRANSCRIPT)
    assert shown[:3] == [["user", "hello"], ["assistant", HELLO], OK]
    assert shown[3] == ["user", "clean up"]
    assert shown[4][0] == "tool" and shown[4][1].startswith("Delete waiting for approval") and "junk.txt" in shown[4][1]
    assert len(shown) == 5, shown
    assert browser.eval("document.querySelectorAll('#approvals .approval').length") == 1
    assert (workspace / "junk.txt").exists()

    # Approve: the tool runs, the run finishes, the stream resumed after the reload shows it all once.
    browser.click("#approvals .hil-approve")
    browser.wait("document.querySelectorAll('#transcript .footer[data-status=ok]').length === 2")
    assert not (workspace / "junk.txt").exists()
    assert browser.eval("document.querySelectorAll('#approvals .approval').length") == 0
    shown = browser.eval(TRANSCRIPT)
    assert shown[4][0] == "tool" and shown[4][1].startswith("Delete finished") and "junk.txt" in shown[4][1]
    assert shown[5:] == [["assistant", "Deleted junk.txt."], OK]

    browser.type_into("text", "again")
    browser.click("#send")
    browser.wait("document.querySelectorAll('#transcript .footer[data-status=ok]').length === 3")
    final = browser.eval(TRANSCRIPT)
    assert final[7:] == [["user", "again"], ["assistant", "Still here."], OK]
    assert len(final) == 10, final

    # A last reload rebuilds exactly the same page from the history and the signal log.
    browser.reload()
    browser.wait("document.querySelectorAll('#transcript .footer[data-status=ok]').length === 3")
    assert browser.eval(TRANSCRIPT) == final
    assert browser.dialogs == []
    assert not [line for line in browser.console if "exception" in line or "/error:" in line], browser.console
    assert not [line for line in browser.console if "Content Security Policy" in line], browser.console

    # Everything the page showed came through the API with the token: without it, nothing.
    assert httpx.get(f"{url}/v1/processes/{pid}/messages", timeout=5).status_code == 401
    assert time.monotonic() - started < 30


# rm makes the default policy ask; the sleep keeps the call running until it is stopped.
SLEEP = {"tool_calls": [{"name": "Shell", "arguments": {"command": "sleep 30 || rm -f never.txt"}}]}
FOLLOWING = "document.getElementById('transcript').dataset.stream === 'live'"


def sign_in_and_open_a_process(browser: Browser, url: str, token: str) -> str:
    browser.navigate(url + "/")
    browser.wait("!document.getElementById('signin').hidden")
    browser.type_into("token", token)
    browser.eval("document.getElementById('signin-form').requestSubmit()")
    browser.wait("document.getElementById('who').textContent")
    browser.click("#new-process")
    pid: str = browser.wait(f"{FOLLOWING} && document.getElementById('proc-title').textContent")
    return pid


def send(browser: Browser, text: str, mode: str = "steer") -> None:
    browser.eval(f"document.getElementById('mode').value = {json.dumps(mode)}")
    browser.type_into("text", text)
    browser.click("#send")


def footers(browser: Browser) -> list[str]:
    result: list[str] = browser.eval(
        "[...document.querySelectorAll('#transcript .footer')].map((n) => n.dataset.status || '')"
    )
    return result


@pytest.mark.parametrize("replies", [[SLEEP, "Stopped.", SLEEP]])
def test_always_interrupt_abort_reset_and_kill_from_the_browser(
    served: tuple[str, str, Path], browser: Browser
) -> None:
    url, token, _ = served
    pid = sign_in_and_open_a_process(browser, url, token)

    # "Always" approves this call and remembers it for the process.
    send(browser, "nap")
    browser.wait("document.querySelector('#approvals .hil-always')")
    assert "sleep 30" in browser.eval("document.querySelector('#approvals .approval pre').textContent")
    browser.click("#approvals .hil-always")
    browser.wait("document.querySelector('#transcript .tool.running') && !document.querySelector('#approvals *')")
    browser.wait("document.getElementById('abort').disabled === false")

    # interrupt: the running call is cancelled, its run ends aborted, the message starts the next run.
    send(browser, "stop that", mode="interrupt")
    browser.wait("document.querySelectorAll('#transcript .footer[data-status=ok]').length === 1")
    assert footers(browser) == ["aborted", "ok"]
    assert browser.eval("[...document.querySelectorAll('#transcript .msg.assistant')].map((n) => n.textContent)") == [
        "Stopped."
    ]

    # The same call again runs without asking (remembered); Abort ends it.
    send(browser, "nap again")
    browser.wait("document.querySelectorAll('#transcript .tool.running').length === 1")
    assert browser.eval("document.querySelectorAll('#approvals .approval').length") == 0
    browser.wait("document.getElementById('abort').disabled === false")
    browser.click("#abort")
    browser.wait("document.querySelectorAll('#transcript .footer[data-status=aborted]').length === 2")
    assert footers(browser) == ["aborted", "ok", "aborted"]

    # Reset clears the conversation (after a confirm); kill removes the process (after another).
    browser.accept_dialogs = True
    browser.click("#reset")
    browser.wait(f"{FOLLOWING} && document.querySelectorAll('#transcript .msg, #transcript .tool').length === 0")
    assert browser.eval("document.getElementById('proc-title').textContent") == pid
    browser.click("#kill")
    browser.wait("document.getElementById('proc-title').textContent === 'No process selected'")
    browser.wait("document.querySelectorAll('#processes li').length === 0")  # the list refreshes after the title
    assert len(browser.dialogs) == 2 and all(d.startswith("confirm:") for d in browser.dialogs), browser.dialogs
    assert httpx.get(f"{url}/v1/processes/{pid}", headers={"Authorization": f"Bearer {token}"}).status_code == 404


NAP = {"tool_calls": [{"name": "Shell", "arguments": {"command": "sleep 1 || rm -f never.txt"}}]}


@pytest.mark.parametrize("replies", [[NAP, "First done.", "Second."]])
def test_a_queued_message_waits_for_the_run_and_then_runs_on_its_own(
    served: tuple[str, str, Path], browser: Browser
) -> None:
    """``queue`` mode from the page: the message is acknowledged with its place in the queue,
    stays out of the active run (which finishes on its own answer), then becomes the next run."""
    url, token, _ = served
    sign_in_and_open_a_process(browser, url, token)
    send(browser, "nap")
    browser.wait("document.querySelector('#approvals .hil-approve')")
    send(browser, "later", mode="queue")
    assert browser.wait("document.getElementById('status').textContent.startsWith('queued')") is True
    assert browser.eval("document.getElementById('status').textContent") == "queued (position 1)"
    # The card says what the call waits for; the queued message shows as pending, after the run.
    shown = browser.eval(TRANSCRIPT)
    assert shown[0] == ["user", "nap"] and shown[1][1].startswith("Shell waiting for approval"), shown
    assert shown[2:] == [["user", "later"]], shown
    assert browser.eval("document.querySelector('#transcript .msg.user.pending').textContent") == "later"

    browser.click("#approvals .hil-approve")
    browser.wait("document.querySelectorAll('#transcript .footer[data-status=ok]').length === 2")
    shown = browser.eval(TRANSCRIPT)
    assert shown[0] == ["user", "nap"] and shown[1][0] == "tool" and shown[1][1].startswith("Shell finished")
    assert shown[2:] == [["assistant", "First done."], OK, ["user", "later"], ["assistant", "Second."], OK]

    browser.reload()  # the page rebuilt from the history and the log shows the same, once
    browser.wait("document.querySelectorAll('#transcript .footer[data-status=ok]').length === 2")
    assert browser.eval(TRANSCRIPT) == shown


@pytest.mark.parametrize("replies", [["HEARTBEAT_OK", "The build broke."]])
def test_a_quiet_heartbeat_stays_out_of_sight_and_one_with_news_shows(
    served: tuple[str, str, Path], browser: Browser
) -> None:
    """Check-ins are runs named ``heartbeat:<period>``; one answered only ``HEARTBEAT_OK`` is
    hidden, live and after a reload, while one with something to say is shown."""
    url, token, _ = served
    pid = sign_in_and_open_a_process(browser, url, token)
    auth = {"Authorization": f"Bearer {token}"}
    for period in (1, 2):
        posted = httpx.post(
            f"{url}/v1/processes/{pid}/events", headers=auth, json={"text": "check in", "run_id": f"heartbeat:{period}"}
        )
        assert posted.status_code == 202, posted.text
        browser.wait(f"document.querySelectorAll('#transcript .footer[data-status=ok]').length === {period}")
    visible = """[...document.querySelectorAll('#transcript section.run')]
      .map((n) => [n.dataset.run, n.hidden, n.offsetParent !== null])"""
    assert browser.eval(visible) == [["heartbeat:1", True, False], ["heartbeat:2", False, True]]
    shown = browser.eval("document.getElementById('transcript').innerText")
    assert "HEARTBEAT_OK" not in shown and "The build broke." in shown
    # rebuilt from the history, which the quiet check-in left, and the log: still out of sight
    browser.reload()
    browser.wait(f"{FOLLOWING} && document.querySelectorAll('#transcript .footer[data-status=ok]').length >= 1")
    assert [row for row in browser.eval(visible) if row[2]] == [["heartbeat:2", False, True]]
    shown = browser.eval("document.getElementById('transcript').innerText")
    assert "HEARTBEAT_OK" not in shown and "The build broke." in shown


ANSWER = "An answer, streamed in small pieces."
# Each text shown in a streaming answer bubble before its run's block shows a user message.
EARLY = """window.__early = [];
new MutationObserver((records) => { for (const r of records) for (const n of r.addedNodes)
    if (n.nodeType === 3 && r.target.classList && r.target.classList.contains('live')
        && !r.target.closest('section.run').querySelector('.msg.user')) __early.push(n.data);
}).observe(document.getElementById('transcript'), {childList: true, subtree: true});"""


@pytest.mark.parametrize("replies", [[ANSWER]])
def test_a_message_shows_before_its_answer_when_its_receipt_comes_late(
    served: tuple[str, str, Path], browser: Browser
) -> None:
    """The stream and the POST that sent a message are two connections, in no order: on a loaded
    machine the answer can stream in, and its run end, before the page has the POST's receipt.
    The message is shown from the history as its run starts, ahead of any of the run's output,
    and the late receipt adds no second copy of it."""
    url, token, _ = served
    sign_in_and_open_a_process(browser, url, token)
    browser.eval(EARLY)
    browser.hold("POST", "*/v1/processes/*/messages")
    send(browser, "are you there?")
    browser.wait("document.querySelector('#transcript .footer[data-status=ok]')")
    assert len(browser.held) == 1  # the run is over, and the page has not had the receipt yet
    assert browser.eval("window.__early") == []
    expected = [["user", "are you there?"], ["assistant", ANSWER], OK]
    assert browser.eval(TRANSCRIPT) == expected

    assert browser.release() == 1
    browser.wait("document.getElementById('status').textContent === 'sent (steer)'")
    assert browser.eval(TRANSCRIPT) == expected
    assert browser.eval("document.querySelectorAll('#transcript .msg.user.pending').length") == 0
