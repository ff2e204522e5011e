"""The web UI and retries, in headless Chromium (tests/cdp.py): the last run, when it ended without
an answer (a provider error, cut off at the output limit, an abort), offers a Retry action under its
footer; clicking it runs the model again, the failed end (the failure notice, the failed or cut-off
partial answer) goes from the transcript and the answer shows, and the action is gone. A retry the
server refuses (nothing to retry any more, a run under way) says why on the status line.

The server is the tests' in-process one (tests/server_support.py) with a model of its own here: a
message starting with ``flaky`` fails the first time it is asked (a provider error, not retried by
the run: ``NO_RETRY``), one starting with ``cut`` is cut off at the output limit the first time,
``sleep N`` runs the slow tool (for abort), anything else answers ``answer: <text>``.

Without Chromium the tests skip, unless ``AGENTLOOP_REQUIRE_BROWSER=1`` (CI) makes them fail.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentloop import Reply, ScriptedModel, ToolResultMessage, call
from agentloop.messages import AssistantMessage, TextContent, UserMessage
from agentloop.models.base import ModelRequest, ProviderError
from agentloop.models.retry import NO_RETRY
from tests.cdp import Browser
from tests.server_support import LiveServer, live_server
from tests.test_web_ui_browser import FOLLOWING, send, sign_in_and_open_a_process
from tests.test_web_ui_session import STATUS, history

TIMEOUT = 30.0  # seconds any one condition may take on a loaded machine
DOWN = ProviderError("the provider is down", kind="auth")  # (not an outage the run waits out)
PARTIAL = "A partial answer, cut o"
RETRY = "#transcript .retry-bar .retry-run"
# What the transcript shows: [kind, text] per message (user, assistant, system, error).
TRANSCRIPT = """[...document.querySelectorAll('#transcript .msg')].map((n) => [
  ['error', 'system', 'user'].find((c) => n.classList.contains(c)) || 'assistant', n.textContent])"""
OUTCOMES = "[...document.querySelectorAll('#transcript .footer[data-status]')].map((n) => n.textContent)"
SETTLED = "!document.querySelector('#transcript .msg.pending, #transcript .msg.live')"

_FAILED_ONCE: set[str] = set()


def model(request: ModelRequest) -> Any:
    last = request.messages[-1]
    if isinstance(last, ToolResultMessage):
        return f"done: {last.text}"
    text = last.text if isinstance(last, UserMessage) else ""
    first = text not in _FAILED_ONCE
    if text.startswith("flaky") and first:
        _FAILED_ONCE.add(text)
        raise DOWN
    if text.startswith("cut") and first:
        _FAILED_ONCE.add(text)
        return AssistantMessage(content=[TextContent(text=PARTIAL)], stop_reason="length")
    if text.startswith("sleep "):
        return Reply(tool_calls=[call("slow", seconds=float(text[6:]))])
    return f"answer: {text}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    scripted = ScriptedModel(model, chunk=4, keep_requests=False)
    options = {"heartbeat": None, "retry": NO_RETRY}
    with live_server(tmp_path_factory.mktemp("web-retry"), model=scripted, kernel_options=options) as srv:
        yield srv


@pytest.fixture
def api(server: LiveServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {server.tokens.alice}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=10) as client:
        yield client


def shown_is(browser: Browser, expected: list[list[str]]) -> None:
    """Wait until the transcript shows exactly ``expected`` ([kind, text]), nothing pending or streaming."""
    want = json.dumps(expected, separators=(",", ":"))
    browser.wait(f"JSON.stringify({TRANSCRIPT}) === {json.dumps(want)} && {SETTLED}", timeout=TIMEOUT)


def retry_buttons(browser: Browser) -> int:
    count: int = browser.eval(f"document.querySelectorAll('{RETRY}').length")
    return count


def failed(browser: Browser, outcomes: int) -> None:
    """Wait until ``outcomes`` runs have ended, the last one offering Retry (enabled)."""
    browser.wait(f"{OUTCOMES}.length === {outcomes}", timeout=TIMEOUT)
    browser.wait(f"document.querySelector('{RETRY}') && !document.querySelector('{RETRY}').disabled", timeout=TIMEOUT)


def test_a_failed_run_offers_retry_which_replaces_the_failure_with_the_answer(
    server: LiveServer, api: httpx.Client, browser: Browser
) -> None:
    pid = sign_in_and_open_a_process(browser, server.url, server.tokens.alice)
    send(browser, "hello")
    shown_is(browser, [["user", "hello"], ["assistant", "answer: hello"]])
    browser.wait(f"{OUTCOMES}.length === 1", timeout=TIMEOUT)
    assert retry_buttons(browser) == 0  # an answer: nothing to retry

    send(browser, "flaky one")
    failed(browser, 2)
    browser.wait(f"{OUTCOMES}[1] === 'run finished: error (generation.error)'", timeout=TIMEOUT)
    shown = browser.eval(TRANSCRIPT)
    assert shown[:3] == [["user", "hello"], ["assistant", "answer: hello"], ["user", "flaky one"]]
    assert any("the provider is down" in text for _, text in shown[3:]), shown
    assert retry_buttons(browser) == 1
    # under the failed run's footer, not in it (the footer's text is the outcome)
    assert browser.eval(f"document.querySelector('{RETRY}').closest('.run').lastElementChild.className") == "retry-bar"
    assert "ended without an answer" in browser.eval(f"document.querySelector('{RETRY}').title")

    browser.click(RETRY)
    after = [
        ["user", "hello"],
        ["assistant", "answer: hello"],
        ["user", "flaky one"],
        ["assistant", "answer: flaky one"],
    ]
    shown_is(browser, after)
    browser.wait(f"{OUTCOMES}.length === 3 && {OUTCOMES}[2] === 'run finished: ok (turn.complete)'", timeout=TIMEOUT)
    browser.wait(f"{STATUS} === 'retrying…'", timeout=TIMEOUT)
    assert retry_buttons(browser) == 0
    assert [text for _, text in history(api, pid)] == [text for _, text in after]
    assert browser.eval("document.querySelectorAll('#transcript .msg-actions').length") == 2

    # A reload shows the same: the failed end does not come back, and there is nothing to retry.
    browser.reload()
    browser.wait(FOLLOWING, timeout=TIMEOUT)
    shown_is(browser, after)
    browser.wait(f"{OUTCOMES}.length === 3", timeout=TIMEOUT)
    assert retry_buttons(browser) == 0

    # A run cut off at the output limit is retried alike: its partial answer goes.
    send(browser, "cut short")
    failed(browser, 4)
    assert browser.eval(f"{OUTCOMES}[3]") == "run finished: ok (length)"
    shown_is(browser, [*after, ["user", "cut short"], ["assistant", PARTIAL]])
    browser.click(RETRY)
    shown_is(browser, [*after, ["user", "cut short"], ["assistant", "answer: cut short"]])
    browser.wait(f"{OUTCOMES}.length === 5", timeout=TIMEOUT)
    assert retry_buttons(browser) == 0
    assert not [line for line in browser.console if "exception" in line], browser.console


def test_a_retry_the_server_refuses_says_why_and_an_aborted_run_is_retried(
    server: LiveServer, api: httpx.Client, browser: Browser
) -> None:
    pid = sign_in_and_open_a_process(browser, server.url, server.tokens.alice)
    send(browser, "flaky two")
    failed(browser, 1)
    browser.eval(f"window.__stale = document.querySelector('{RETRY}')")

    # Another client retries first: the page follows it, and its Retry goes.
    done = api.post(f"/v1/processes/{pid}/retry", json={})
    assert done.status_code == 202, done.text
    answered = [["user", "flaky two"], ["assistant", "answer: flaky two"]]
    shown_is(browser, answered)
    browser.wait(f"{OUTCOMES}.length === 2", timeout=TIMEOUT)
    assert retry_buttons(browser) == 0

    # The stale action: the server refuses it (nothing to retry), and says why.
    browser.eval("window.__stale.click()")
    browser.wait(f"{STATUS}.startsWith('not retried: nothing to retry')", timeout=TIMEOUT)
    assert "send a message to go on" in browser.eval(STATUS)
    assert browser.eval("window.__stale.disabled") is False  # (it may be used again)
    shown_is(browser, answered)
    assert [text for _, text in history(api, pid)] == [text for _, text in answered]

    # A run under way refuses it too.
    send(browser, "sleep 30")
    browser.wait("document.getElementById('proc-state').textContent.startsWith('running')", timeout=TIMEOUT)
    assert retry_buttons(browser) == 0
    browser.eval("window.__stale.click()")
    browser.wait(f"{STATUS} === 'not retried: a run is active'", timeout=TIMEOUT)
    assert browser.eval("window.__stale.disabled") is False

    # Aborted during its tool call, it ended without an answer: Retry has the model answer the result.
    browser.click("#abort")
    failed(browser, 3)
    browser.wait(f"{OUTCOMES}[2].startsWith('run finished: aborted')", timeout=TIMEOUT)
    browser.click(RETRY)
    browser.wait(f"{OUTCOMES}.length === 4 && {OUTCOMES}[3] === 'run finished: ok (turn.complete)'", timeout=TIMEOUT)
    browser.wait(
        "[...document.querySelectorAll('#transcript .msg.assistant')].some((n) => n.textContent.startsWith('done: '))",
        timeout=TIMEOUT,
    )
    browser.wait(SETTLED, timeout=TIMEOUT)
    assert retry_buttons(browser) == 0
    last = history(api, pid)[-1]
    assert last[0] == "assistant" and last[1].startswith("done: "), last
    assert not [line for line in browser.console if "exception" in line], browser.console
