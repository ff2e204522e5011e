"""The web UI's input queue, context meter and Compact button, in headless Chromium (tests/cdp.py).

The server is the tests' in-process one (tests/server_support.py) with its own scripted model: a
window of 10,000 usable tokens, and answers that report how full it is, so the context's level can
be driven from the page:
- ``sleep <seconds>`` calls the ``slow`` tool, which keeps a run active;
- ``fill <n> …`` answers with usage of ``n`` input tokens (the provider's count of the context);
- the summary call answers a summary; anything else answers ``re: <text>``.

Without Chromium the tests skip, unless ``AGENTLOOP_REQUIRE_BROWSER=1`` (CI) makes them fail.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop import Reply, ScriptedModel, ToolResultMessage, call
from agentloop.messages import UserMessage
from agentloop.models.base import ModelInfo, ModelRequest
from agentloop.process.compaction import SUMMARY_SYSTEM_PROMPT
from tests.cdp import Browser
from tests.server_support import LiveServer
from tests.test_web_ui_browser import send, sign_in_and_open_a_process

WINDOW = ModelInfo(provider="scripted", id="window", context_window=10_200, max_output=200)  # 10,000 usable
LONG = "lorem ipsum dolor sit amet " * 80  # about 540 tokens: enough history for a summary
QUEUE = "[...document.querySelectorAll('#queue-list li')].map((li) => li.textContent)"
LABEL = "document.getElementById('context-label').textContent"


def brain(req: ModelRequest) -> Reply | str:
    if req.system_prompt == SUMMARY_SYSTEM_PROMPT:
        return "Summary: the user filled the context."
    last = req.messages[-1]
    if isinstance(last, ToolResultMessage):
        return f"done: {last.text}"
    text = last.text if isinstance(last, UserMessage) else ""
    if text.startswith("sleep "):
        return Reply(tool_calls=[call("slow", seconds=float(text.split()[1]))])
    if text.startswith("fill "):
        return Reply(text="filled", input_tokens=int(text.split()[1]), output_tokens=0)
    return f"re: {text}"


def window_server(data: Path) -> LiveServer:
    """The tests' server with ``brain`` for its model, and no heartbeat."""
    model = ScriptedModel(brain, info=WINDOW, chunk=4, keep_requests=False)
    return LiveServer(data, model=model, kernel_options={"heartbeat": None})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = window_server(tmp_path_factory.mktemp("web-queue"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def api(server: LiveServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {server.tokens.alice}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=10) as client:
        yield client


def open_new_process(browser: Browser, server: LiveServer) -> str:
    return sign_in_and_open_a_process(browser, server.url, server.tokens.alice)


def enqueue(browser: Browser, text: str, position: int) -> None:
    """Send ``text`` in queue mode and wait for its receipt (the composer is free again)."""
    send(browser, text, mode="queue")
    browser.wait(f"document.getElementById('status').textContent === 'queued (position {position})'")
    browser.eval("document.getElementById('status').textContent = ''")


def finished(browser: Browser, count: int) -> None:
    browser.wait(f"document.querySelectorAll('#transcript .footer[data-status]').length === {count}")


def queue_texts(api: httpx.Client, pid: str) -> list[str]:
    resp = api.get(f"/v1/processes/{pid}/queue")
    assert resp.status_code == 200, resp.text
    return [item["text"] for item in resp.json()["items"]]


def history(api: httpx.Client, pid: str) -> list[tuple[str, str]]:
    """(role, text) of every message of the process's history."""
    messages: list[dict[str, Any]] = api.get(f"/v1/processes/{pid}/messages?limit=200").json()["messages"]
    shown = []
    for m in messages:
        blocks = m["message"].get("content") or []
        text = blocks if isinstance(blocks, str) else "".join(b.get("text", "") for b in blocks)
        shown.append((m["message"]["role"], text))
    return shown


def test_queued_input_is_listed_and_withdrawn_from_the_page_and_never_runs(
    server: LiveServer, api: httpx.Client, browser: Browser
) -> None:
    pid = open_new_process(browser, server)
    assert browser.eval("document.getElementById('queue').hidden") is True  # nothing waits

    # A run kept active by a slow tool; Compact is refused meanwhile, with the server's own words.
    send(browser, "sleep 30")
    browser.wait("document.querySelector('#transcript .tool.running')")
    browser.wait("document.getElementById('abort').disabled === false")
    browser.click("#compact")
    shown = browser.wait(
        "document.getElementById('status').textContent.startsWith('compact failed') && "
        "document.getElementById('status').textContent"
    )
    refused = api.post(f"/v1/processes/{pid}/compact", json={})
    assert refused.status_code == 409, refused.text
    assert shown == f"compact failed: {refused.json()['message']}"

    # Two queued messages wait, listed in the order they will run, each with its place.
    enqueue(browser, "later one", 1)
    enqueue(browser, "later two", 2)
    browser.wait(f"{QUEUE}.length === 2")
    assert browser.eval(QUEUE) == ["1.later oneWithdraw", "2.later twoWithdraw"]
    assert browser.eval("document.getElementById('queue').hidden") is False
    assert browser.eval("document.getElementById('queue-count').textContent") == "2"
    assert queue_texts(api, pid) == ["later one", "later two"]

    # Withdraw the first from the page: the API no longer has it, its pending bubble is gone.
    browser.click("#queue-list li:first-child .withdraw")
    browser.wait(f"{QUEUE}.length === 1")
    assert browser.eval(QUEUE) == ["1.later twoWithdraw"]
    assert queue_texts(api, pid) == ["later two"]
    pending = "[...document.querySelectorAll('#transcript .msg.user.pending')].map((n) => n.textContent)"
    browser.wait(f"{pending}.join() === 'later two'")

    # Abort the slow run: what still waits runs next; the withdrawn message never does.
    browser.click("#abort")
    browser.wait("document.querySelector('#transcript .footer[data-status=ok]')")
    browser.wait("document.getElementById('queue').hidden")
    assert queue_texts(api, pid) == []
    said = history(api, pid)
    assert ("user", "later two") in said and ("assistant", "re: later two") in said
    assert not [m for m in said if "later one" in m[1]], said

    # "Withdraw all" empties the queue of another active run; none of it runs.
    send(browser, "sleep 30")
    browser.wait("document.querySelectorAll('#transcript .tool.running').length === 1")
    enqueue(browser, "third", 1)
    enqueue(browser, "fourth", 2)
    browser.wait(f"{QUEUE}.length === 2")
    browser.click("#queue-clear")
    browser.wait("document.getElementById('status').textContent === 'withdrawn: 2 messages'")
    browser.wait("document.getElementById('queue').hidden")
    assert queue_texts(api, pid) == []
    assert browser.eval(pending) == []
    browser.click("#abort")
    browser.wait("document.querySelectorAll('#transcript .footer[data-status=aborted]').length === 2")
    assert api.get(f"/v1/processes/{pid}").json()["run_id"] is None
    assert not [m for m in history(api, pid) if m[1] in ("third", "fourth", "later one")]
    errors = [line for line in browser.console if "exception" in line or "/error:" in line]
    assert errors == ["network/error: Failed to load resource: the server responded with a status of 409 (Conflict)"]


def test_the_context_meter_follows_the_level_and_compact_empties_it(
    server: LiveServer, api: httpx.Client, browser: Browser
) -> None:
    pid = open_new_process(browser, server)
    browser.wait("!document.getElementById('context').hidden")
    assert browser.eval(LABEL) == "context 0% · ok"
    assert browser.eval("document.getElementById('context').dataset.level") == "ok"

    # Each answer reports how full the window is; the label follows, its level styled.
    for n, (tokens, label, level) in enumerate(
        [
            (3_000, "context 30% · ok", "ok"),
            (7_500, "context 75% · warn", "warn"),
            (8_700, "context 87% · critical", "critical"),
        ],
        start=1,
    ):
        send(browser, f"fill {tokens} {LONG}")
        finished(browser, n)
        browser.wait(f"{LABEL} === {json.dumps(label)}")
        assert browser.eval("document.getElementById('context').dataset.level") == level
        assert api.get(f"/v1/processes/{pid}").json()["context_pressure"]["level"] == level
    assert browser.eval("document.getElementById('context-meter').value") == pytest.approx(0.87)
    colour = "getComputedStyle(document.getElementById('context')).color"
    critical = browser.eval(colour)
    assert api.get(f"/v1/processes/{pid}/segments").json()["segments"] == []

    # Compact on the idle process: the transcript says so, a segment is archived, the level falls.
    browser.click("#compact")
    browser.wait("document.getElementById('status').textContent.startsWith('compacted:')")
    notices = "[...document.querySelectorAll('#transcript .notice')].map((n) => n.textContent)"
    browser.wait(f"{notices}.some((text) => text.startsWith('context compacted'))")
    browser.wait("document.getElementById('context').dataset.level === 'ok'")
    assert browser.eval(LABEL).startswith("context ") and browser.eval(LABEL).endswith("% · ok")
    assert browser.eval(colour) != critical
    [segment] = api.get(f"/v1/processes/{pid}/segments").json()["segments"]
    assert segment["kind"] == "compaction" and segment["reason"] == "manual"
    assert api.get(f"/v1/processes/{pid}").json()["context_pressure"]["level"] == "ok"
    assert not [line for line in browser.console if "exception" in line or "/error:" in line], browser.console
