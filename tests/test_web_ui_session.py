"""The web UI's conversation tools, in headless Chromium (tests/cdp.py): fork from a message, the
model picker, and the countdown of an approval the server denies when nobody answers in time.

The server is the tests' in-process one (tests/server_support.py, its scripted model: ``risky``
calls a tool the approval policy asks about; anything else answers ``answer: <text>``), with an
approval timeout of 3 s. A ``webpu`` provider is registered here so that ``webpu:<id>`` is a model spec
the server accepts: it answers ``<id>: <text>``.

Without Chromium the tests skip, unless ``AGENTLOOP_REQUIRE_BROWSER=1`` (CI) makes them fail.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentloop import Reply, ScriptedModel, ToolResultMessage
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest
from agentloop.models.registry import register_provider
from tests.cdp import Browser
from tests.server_support import LiveServer
from tests.test_web_ui_browser import FOLLOWING, send, sign_in_and_open_a_process


def _pu(model_id: str) -> ScriptedModel:
    def answer(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if isinstance(last, ToolResultMessage):
            return f"{model_id}: after the tool"
        return f"{model_id}: {last.text if isinstance(last, UserMessage) else ''}"

    return ScriptedModel(answer, keep_requests=False)


register_provider("webpu", _pu)

TITLE = "document.getElementById('proc-title').textContent"
STATUS = "document.getElementById('status').textContent"
SHOWN = """[...document.querySelectorAll('#transcript .msg')]
  .map((n) => [n.classList.contains('user') ? 'user' : 'assistant', n.textContent])"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = LiveServer(tmp_path_factory.mktemp("web-session"), kernel_options={"heartbeat": None, "approval_timeout": 3})
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


def history(api: httpx.Client, pid: str) -> list[tuple[str, str]]:
    messages: list[dict[str, Any]] = api.get(f"/v1/processes/{pid}/messages?limit=200").json()["messages"]
    shown = []
    for m in messages:
        blocks = m["message"].get("content") or []
        text = blocks if isinstance(blocks, str) else "".join(b.get("text", "") for b in blocks)
        shown.append((m["message"]["role"], text))
    return shown


def finished(browser: Browser, count: int) -> None:
    browser.wait(f"document.querySelectorAll('#transcript .footer[data-status]').length === {count}")


def persisted(browser: Browser, users: int) -> None:
    """Wait until the history shows ``users`` messages of the user's, none pending or streaming
    (a run's end may come before the read of its messages does)."""
    browser.wait(
        f"document.querySelectorAll('#transcript .msg.user:not(.pending)').length === {users} && "
        "!document.querySelector('#transcript .msg.pending, #transcript .msg.live')"
    )


def opened_other_than(browser: Browser, pid: str) -> str:
    """The pid of the process the page opened instead of ``pid``, once it follows it live."""
    other: str = browser.wait(f"{FOLLOWING} && {TITLE} !== {json.dumps(pid)} && {TITLE}")
    return other


def test_fork_from_a_message_opens_the_fork_with_that_message_back_in_the_composer(
    server: LiveServer, api: httpx.Client, browser: Browser
) -> None:
    pid = sign_in_and_open_a_process(browser, server.url, server.tokens.alice)
    send(browser, "first")
    finished(browser, 1)
    send(browser, "second <b>edit me</b>")
    finished(browser, 2)
    before = history(api, pid)
    assert before == [
        ("user", "first"),
        ("assistant", "answer: first"),
        ("user", "second <b>edit me</b>"),
        ("assistant", "answer: second <b>edit me</b>"),
    ]
    # Each of the user's messages has its action; the message bubbles' text is the message alone.
    persisted(browser, 2)
    assert browser.eval("document.querySelectorAll('#transcript .fork-here').length") == 2
    assert browser.eval(SHOWN)[0] == ["user", "first"]

    # Fork from the second message: a new conversation with the first exchange only, opened, listed,
    # the second message's text back in the composer to edit and send again.
    browser.eval("document.querySelectorAll('#transcript .fork-here')[1].click()")
    fork = opened_other_than(browser, pid)
    browser.wait(f"document.getElementById('text').value === {json.dumps('second <b>edit me</b>')}")
    browser.wait(f"{SHOWN}.length === 2")
    assert browser.eval(SHOWN) == [["user", "first"], ["assistant", "answer: first"]]
    listed = browser.eval("[...document.querySelectorAll('#processes li')].map((li) => li.dataset.pid)")
    assert pid in listed and fork in listed
    assert browser.eval("document.querySelector('#processes li.selected').dataset.pid") == fork
    assert history(api, fork) == before[:2]
    assert history(api, pid) == before  # the source is untouched
    assert api.get(f"/v1/processes/{pid}").json()["run_id"] is None
    assert browser.eval("document.querySelectorAll('b, img').length") == 0

    # The composer's text is sent to the fork as usual.
    browser.click("#send")
    finished(browser, 1)  # (the copied exchange has no run of the fork's own)
    persisted(browser, 2)
    assert history(api, fork) == before
    assert history(api, pid) == before

    # The first message has nothing before it: the page says so and makes nothing.
    count = len(api.get("/v1/processes").json()["processes"])
    browser.eval("document.querySelectorAll('#transcript .fork-here')[0].click()")
    browser.wait(f"{STATUS}.includes('nothing before')")
    assert len(api.get("/v1/processes").json()["processes"]) == count
    assert browser.eval(TITLE) == fork

    # The header's Fork copies the whole conversation; the composer stays empty.
    browser.eval("document.getElementById('text').value = ''")
    browser.click("#fork")
    whole = opened_other_than(browser, fork)
    browser.wait(f"{SHOWN}.length === 4")
    assert history(api, whole) == before
    assert browser.eval("document.getElementById('text').value") == ""
    assert api.get(f"/v1/processes/{whole}").json()["state"] != "killed"

    # A refusal (here the account's process quota, 409) is said on the page; nothing else changes.
    # (once the fork's view follows its stream: its "following …" would overwrite the refusal)
    browser.wait("document.getElementById('transcript').dataset.stream === 'live'")
    browser.eval(
        """window.__fetch = window.fetch;
        window.fetch = (path, init) => String(path).endsWith('/fork')
          ? Promise.resolve(new Response(JSON.stringify({code: 'conflict', message: 'process quota reached'}),
                                         {status: 409, headers: {'Content-Type': 'application/json'}}))
          : window.__fetch(path, init);"""
    )
    browser.click("#fork")
    browser.wait(f"{STATUS} === 'could not fork: process quota reached'")
    browser.eval("document.getElementById('status').textContent = ''")
    browser.eval("document.querySelectorAll('#transcript .fork-here')[1].click()")
    browser.wait(f"{STATUS} === 'could not fork: process quota reached'")
    assert browser.eval(TITLE) == whole
    assert browser.eval("document.getElementById('fork').disabled") is False
    assert len(api.get("/v1/processes").json()["processes"]) == count + 1
    assert not [line for line in browser.console if "exception" in line], browser.console


def test_the_model_picker_shows_sets_refuses_and_resets_the_model(
    server: LiveServer, api: httpx.Client, browser: Browser
) -> None:
    pid = sign_in_and_open_a_process(browser, server.url, server.tokens.alice)
    label = "document.getElementById('model').textContent"
    browser.wait(f"{label}.includes('default')")
    assert api.get(f"/v1/processes/{pid}/model").json()["source"] == "default"
    assert browser.eval("document.getElementById('model-form').hidden") is True

    # Open the editor; the hint says a change applies from the next answer.
    browser.click("#model-edit")
    assert browser.eval("document.getElementById('model-form').hidden") is False
    assert "next answer" in browser.eval("document.getElementById('model-hint').textContent")
    # it suggests the server's catalog (GET /v1/models), the models the server can call first
    catalog = api.get("/v1/models").json()["models"]
    assert browser.wait("document.getElementById('model-options').options.length") == len(catalog)
    first = browser.eval("document.getElementById('model-options').options[0].value")
    assert next(m for m in catalog if m["model"] == first)["usable"] is True
    browser.eval("document.getElementById('model-spec').value = ''")
    browser.type_into("model-spec", "webpu:x")
    browser.eval("document.getElementById('model-reasoning').value = 'low'")
    browser.click("#model-apply")
    browser.wait(f"{label}.includes('webpu:x') && {label}.includes('process')")
    got = api.get(f"/v1/processes/{pid}/model").json()
    assert (got["model"], got["reasoning"], got["effective"], got["source"]) == ("webpu:x", "low", "webpu:x", "process")
    assert browser.eval("document.getElementById('model-error').textContent") == ""

    # The next answer is the new model's.
    send(browser, "hi")
    finished(browser, 1)
    persisted(browser, 1)
    assert browser.eval(SHOWN) == [["user", "hi"], ["assistant", "x: hi"]]

    # A spec the server refuses: its message is shown, the model stays as it was.
    assert browser.eval("document.getElementById('model-form').hidden") is True  # closed once applied
    browser.click("#model-edit")
    browser.eval("document.getElementById('model-spec').value = ''")
    browser.type_into("model-spec", "nosuchprovider:zzz")
    browser.click("#model-apply")
    shown = browser.wait("document.getElementById('model-error').textContent")
    refused = api.post(f"/v1/processes/{pid}/model", json={"model": "nosuchprovider:zzz"})
    assert refused.status_code == 400
    assert shown == refused.json()["message"]
    assert api.get(f"/v1/processes/{pid}/model").json()["model"] == "webpu:x"
    assert "webpu:x" in browser.eval(label) and "process" in browser.eval(label)

    # Reset to the default: the process's own choice is gone.
    browser.click("#model-reset")
    browser.wait(f"{label}.includes('default')")
    got = api.get(f"/v1/processes/{pid}/model").json()
    assert (got["model"], got["source"]) == (None, "default")
    assert browser.eval("document.getElementById('model-error').textContent") == ""


def test_an_approval_counts_down_and_shows_it_was_not_answered_in_time(
    server: LiveServer, api: httpx.Client, browser: Browser
) -> None:
    pid = sign_in_and_open_a_process(browser, server.url, server.tokens.alice)
    send(browser, "risky")
    browser.wait("document.querySelector('#approvals .approval')")
    countdown = "document.querySelector('#approvals .approval .expires').textContent"
    first = browser.wait(countdown)
    assert re.fullmatch(r"denied automatically in 0:0[0-3]", first), first
    time.sleep(1.2)
    second = browser.eval(countdown)
    assert re.fullmatch(r"denied automatically in 0:0[0-3]", second) and second != first, (first, second)

    # Unanswered, the server denies it: the card says so, its buttons are gone, the run goes on.
    browser.wait("document.querySelector('#approvals .approval.expired')", timeout=10)
    card = browser.eval("document.querySelector('#approvals .approval.expired').textContent")
    assert "not answered in time" in card
    assert browser.eval("document.querySelectorAll('#approvals .approval.expired .hil-approve').length") == 0
    assert api.get(f"/v1/processes/{pid}/hil").json()["requests"] == []
    finished(browser, 1)
    browser.wait("document.querySelector('#transcript .tool.failed')")

    # Dismissed, the card goes.
    browser.click("#approvals .approval.expired .dismiss")
    browser.wait("!document.querySelector('#approvals .approval')")

    # One answered in time is simply gone, no countdown left behind.
    send(browser, "risky")
    browser.wait("document.querySelector('#approvals .approval .expires')")
    browser.click("#approvals .hil-approve")
    finished(browser, 2)
    browser.wait("!document.querySelector('#approvals .approval')")
    time.sleep(3.5)
    assert browser.eval("document.querySelectorAll('#approvals .approval').length") == 0

    # A browser whose clock is a minute slow counts down from too far, yet when the server denies
    # the request the card still says it was not answered in time (the denial's error says so).
    browser.eval("window.__realNow = Date.now; Date.now = () => window.__realNow() - 60000;")
    send(browser, "risky")
    browser.wait("document.querySelector('#approvals .approval .expires')")
    assert re.fullmatch(r"denied automatically in 1:0[0-3]", browser.wait(countdown)), browser.eval(countdown)
    browser.wait("document.querySelector('#approvals .approval.expired')", timeout=10)
    assert "not answered in time" in browser.eval("document.querySelector('#approvals .approval').textContent")
    finished(browser, 3)

    # After a reload the pending request's countdown comes back (from the logged request).
    send(browser, "risky")
    browser.wait("document.querySelector('#approvals .approval .expires')")
    browser.reload()
    browser.wait(f"{FOLLOWING} && document.querySelector('#approvals .approval .expires')")
    assert re.fullmatch(r"denied automatically in 0:0[0-3]", browser.eval(countdown)), browser.eval(countdown)
    browser.wait("document.querySelector('#approvals .approval.expired')", timeout=10)
    finished(browser, 4)
    assert not [line for line in browser.console if "exception" in line], browser.console
