"""The web UI in a real browser, for what a user hits when things happen out of step: switching
processes while one is still loading, a process reset by another client, a model call retried
mid-answer, and the live stream dropped mid-answer.

Same harness as test_web_ui_browser.py (headless Chromium over CDP; its fixtures are reused, not
copied); the streaming tests use the in-process test server with a model that streams slowly.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import httpx
import pytest

from agentloop import ScriptedModel
from agentloop.events import StreamEvent
from agentloop.messages import UserMessage
from agentloop.models.base import AssistantBuilder, ModelRequest, ProviderError, make_usage
from tests import server_support, test_web_ui_browser
from tests.cdp import Browser
from tests.server_support import LiveServer, live_server
from tests.test_web_ui_browser import FOLLOWING, send, sign_in_and_open_a_process

# The browser test's server fixture, under its name here: pytest looks fixtures up in the module.
served = test_web_ui_browser.served

DELETE = {"tool_calls": [{"name": "Delete", "arguments": {"path": "junk.txt"}}]}

# Holds back the page's requests whose URL contains window.__hold, until window.__release():
# a slow network, made deterministic. window.__held counts requests held, __done those answered.
HOLD = """window.__held = []; window.__done = 0; window.__hold = null;
const realFetch = window.fetch;
window.fetch = (url, init) => {
  if (window.__hold === null || !String(url).includes(window.__hold)) return realFetch(url, init);
  return new Promise((go) => window.__held.push(go))
    .then(() => realFetch(url, init))
    .finally(() => { window.__done += 1; });
};
window.__release = () => { for (const go of window.__held.splice(0)) go(); };"""


def open_from_list(browser: Browser, pid: str) -> None:
    browser.click(f"#processes li[data-pid={json.dumps(pid)}]")


def hold_then_switch(browser: Browser, slow: str, held_path: str, other: str) -> None:
    """Open ``slow`` with its ``held_path`` request held back, switch to ``other`` meanwhile, then
    let the held request answer and give the page a moment to act on it."""
    browser.eval(f"window.__hold = {json.dumps(f'/v1/processes/{slow}{held_path}')}")
    open_from_list(browser, slow)
    browser.wait("window.__held.length === 1")
    open_from_list(browser, other)
    browser.wait(f"document.getElementById('status').textContent === {json.dumps(f'following {other}')}")
    browser.eval("window.__hold = null; window.__release()")
    browser.wait("window.__done === 1")
    time.sleep(0.5)  # the answer's JSON is read and rendered a few tasks later


@pytest.mark.parametrize("replies", [[DELETE, "Deleted."]])
def test_a_process_left_while_it_loads_never_shows_its_messages_or_approvals_in_the_next(
    served: tuple[str, str, Path], browser: Browser
) -> None:
    """A pending approval of process A must never appear under process B: its Approve button
    would approve A's tool call while the user reads B."""
    url, token, workspace = served
    first = sign_in_and_open_a_process(browser, url, token)
    send(browser, "clean up")
    browser.wait("document.querySelector('#approvals .approval')")
    browser.click("#new-process")
    second = browser.wait(
        f"{FOLLOWING} && document.getElementById('proc-title').textContent !== {json.dumps(first)}"
        " && document.getElementById('proc-title').textContent"
    )
    assert browser.eval("document.querySelectorAll('#approvals .approval, #transcript .msg').length") == 0
    browser.eval(HOLD)

    hold_then_switch(browser, first, "/hil", second)  # A's approvals answer after B is open
    assert browser.eval("document.getElementById('proc-title').textContent") == second
    assert browser.eval("document.querySelectorAll('#approvals .approval').length") == 0

    browser.eval("window.__done = 0")
    hold_then_switch(browser, first, "/messages", second)  # A's history answers after B is open
    assert browser.eval("[...document.querySelectorAll('#transcript .msg')].map((n) => n.textContent)") == []
    assert browser.eval("document.querySelectorAll('#approvals .approval').length") == 0
    # A's requests, cut short by leaving it, are not reported as B's errors.
    assert browser.eval("document.getElementById('status').textContent") == f"following {second}"

    # A message sent to A whose answer comes after B is open: its pending bubble is not B's.
    open_from_list(browser, first)
    browser.wait(f"document.getElementById('status').textContent === {json.dumps(f'following {first}')}")
    browser.eval(f"window.__done = 0; window.__hold = {json.dumps(f'/v1/processes/{first}/messages')}")
    send(browser, "also this", mode="queue")  # a run of its own: a block the view has not made yet
    browser.wait("window.__held.length === 1")
    open_from_list(browser, second)
    browser.wait(f"document.getElementById('status').textContent === {json.dumps(f'following {second}')}")
    browser.eval("window.__hold = null; window.__release()")
    browser.wait("window.__done === 1")
    time.sleep(0.5)
    assert browser.eval("[...document.querySelectorAll('#transcript .msg')].map((n) => n.textContent)") == []
    assert (workspace / "junk.txt").exists()


@pytest.mark.parametrize("replies", [["First answer."]])
def test_a_reset_by_another_client_clears_the_open_conversation(
    served: tuple[str, str, Path], browser: Browser
) -> None:
    """After a reset made elsewhere (the CLI, another tab), the open page shows what a reload
    would: an empty conversation, not the archived one."""
    url, token, _ = served
    pid = sign_in_and_open_a_process(browser, url, token)
    send(browser, "hello")
    browser.wait("document.querySelector('#transcript .footer[data-status=ok]')")
    assert browser.eval("document.querySelectorAll('#transcript .msg').length") == 2

    auth = {"Authorization": f"Bearer {token}"}
    assert httpx.post(f"{url}/v1/processes/{pid}/reset", json={}, headers=auth, timeout=10).status_code == 200
    browser.wait("document.querySelectorAll('#transcript .msg, #transcript .footer:not(:empty)').length === 0", 5)
    assert browser.eval("document.getElementById('proc-title').textContent") == pid


# -- the live stream, against the in-process test server with a model that streams slowly


class FlakyModel(ScriptedModel):
    """The test server's scripted model, except for two messages it answers slowly enough for the
    page to be watched while the answer streams: ``flaky`` (the first answer breaks off after a
    few pieces, an overloaded provider, and is retried) and ``slowly`` (a long answer)."""

    failed = False
    # Set by the test once the page follows the stream again after a cut: from then on ``slowly``
    # streams its rest quickly (the gap and the splice it could cause are behind; what is left is
    # only the text after them, which needs no more than a few pieces, not seconds of them).
    reconnected = threading.Event()

    async def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
        last = request.messages[-1]
        said = last.text if isinstance(last, UserMessage) else ""
        if said not in ANSWERS:
            async for event in super()._stream(request, out):
                yield event
            return
        text = ANSWERS[said]
        cut = 12 if said == "flaky" and not FlakyModel.failed else len(text)
        yield out.start()
        for i in range(0, cut, 4):
            for event in out.text(text[i : min(i + 4, cut)]):
                yield event
            await asyncio.sleep(0.02 if FlakyModel.reconnected.is_set() else 0.1)
        if cut < len(text):
            FlakyModel.failed = True
            raise ProviderError("overloaded", kind="server", retry_after=0.2)
        yield done_event(out)


ANSWERS = {
    "flaky": "answer: flaky, streamed in pieces",
    "slowly": "answer: " + " ".join(f"word{i}" for i in range(60)),  # ~10 s of streaming, unless reconnected
}


def done_event(out: AssistantBuilder) -> StreamEvent:
    """The builder's final event (its ``finish`` list ends with the done)."""
    return out.finish(usage=make_usage(out.info, input=1, output=1))[-1]


@pytest.fixture
def flaky_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    monkeypatch.setattr(server_support, "ScriptedModel", FlakyModel)
    FlakyModel.failed = False
    FlakyModel.reconnected.clear()
    with live_server(tmp_path) as srv:
        yield srv


# Every text the streaming bubble showed, to catch a wrong one that only lasts while it streams.
WATCH_LIVE = """window.__streamed = [];
new MutationObserver(() => { for (const n of document.querySelectorAll('#transcript .live'))
    if (window.__streamed.at(-1) !== n.textContent) window.__streamed.push(n.textContent); })
  .observe(document.getElementById('transcript'), {childList: true, subtree: true, characterData: true});"""


def test_a_retried_model_call_does_not_stream_its_text_twice(flaky_server: LiveServer, browser: Browser) -> None:
    """A model call that breaks off mid-answer is retried from the start; what it streamed before
    is void, so the page must not show the retry's text glued after it."""
    sign_in_and_open_a_process(browser, flaky_server.url, flaky_server.tokens.alice)
    browser.eval(WATCH_LIVE)
    send(browser, "flaky")
    browser.wait("document.querySelector('#transcript .footer[data-status=ok]')")
    final = ANSWERS["flaky"]
    assert browser.eval("[...document.querySelectorAll('#transcript .msg.assistant')].map((n) => n.textContent)") == [
        final
    ]
    streamed: list[str] = browser.eval("window.__streamed")
    assert "answer: flak" in streamed, streamed  # the first attempt was seen, live
    assert [s for s in streamed if not final.startswith(s)] == [], streamed


# Lets the test cut the page's live event stream as a dropped network connection would.
CUTTABLE = """const realFetch = window.fetch;
window.fetch = async (url, init) => {
  const resp = await realFetch(url, init);
  if (!String(url).includes('follow=true')) return resp;
  const cutter = new TransformStream({ start(c) { window.__cut = () => c.error(new TypeError('network error')); } });
  return new Response(resp.body.pipeThrough(cutter), { status: resp.status, headers: resp.headers });
};"""


def test_text_streamed_across_a_dropped_connection_is_never_shown_spliced(
    flaky_server: LiveServer, browser: Browser
) -> None:
    """Text deltas are live-only: those sent while the page reconnects are lost for good. The
    streaming bubble must not join what comes after the gap to what came before as if nothing
    were missing; the whole text arrives with the answer."""
    sign_in_and_open_a_process(browser, flaky_server.url, flaky_server.tokens.alice)
    browser.call("Page.addScriptToEvaluateOnNewDocument", source=CUTTABLE)
    browser.reload()  # the page's stream now goes through the cutter
    browser.wait(FOLLOWING)
    browser.eval(WATCH_LIVE)
    send(browser, "slowly")
    browser.wait("(document.querySelector('#transcript .live')?.textContent.length ?? 0) > 16")
    browser.eval("window.__cut()")
    browser.wait("document.getElementById('transcript').dataset.stream === 'reconnecting'")
    browser.wait(FOLLOWING)
    # Back, with text left to stream: still live (the deltas of the gap lost), the page is shown
    # the rest, after the gap.
    assert browser.eval("document.querySelector('#transcript .footer[data-status=ok]')") is None
    FlakyModel.reconnected.set()
    browser.wait("document.querySelector('#transcript .footer[data-status=ok]')")
    final = ANSWERS["slowly"]
    shown = browser.eval("[...document.querySelectorAll('#transcript .msg.assistant')].map((n) => n.textContent)")
    assert shown == [final]
    streamed: list[str] = browser.eval("window.__streamed")
    spliced = [s for s in streamed if not final.startswith(s) and "…" not in s]
    assert spliced == [], streamed


def test_a_reconnect_after_the_log_was_pruned_reads_the_history_again(
    flaky_server: LiveServer, browser: Browser
) -> None:
    """Away long enough for the log to drop what was said meanwhile (``proc.log.pruned``), the
    page reads the history again rather than show only what the log still holds."""
    pid = sign_in_and_open_a_process(browser, flaky_server.url, flaky_server.tokens.alice)
    browser.call("Page.addScriptToEvaluateOnNewDocument", source=CUTTABLE)
    browser.reload()
    browser.wait(FOLLOWING)
    browser.eval("{" + HOLD + "}")  # (in a block: its realFetch is the cutter's wrapper, not a redeclaration)
    send(browser, "hello")
    browser.wait("document.querySelector('#transcript .footer[data-status=ok]')")
    browser.eval("window.__hold = 'follow=true'; window.__cut()")  # the reconnect waits for us
    browser.wait("window.__held.length === 1")

    async def meanwhile() -> None:
        async with flaky_server.client(flaky_server.tokens.alice) as alice:
            resp = await alice.post(f"/v1/processes/{pid}/messages", json={"text": "said elsewhere"})
            assert resp.status_code == 202
            await server_support.wait_idle(alice, pid)
        assert flaky_server.ctx is not None
        store = flaky_server.ctx.kernel.store

        async def prune() -> None:  # all but the newest signal (the run's end) are gone
            async with store.transaction():
                await store.prune_events(pid, through=await store.last_event_seq(pid) - 1)

        await flaky_server.run(prune)

    asyncio.run(meanwhile())
    browser.eval("window.__hold = null; window.__release()")
    browser.wait(FOLLOWING)
    messages = "[...document.querySelectorAll('#transcript .msg')].map((n) => n.textContent)"
    browser.wait(f"{messages}.includes('answer: said elsewhere')", 5)
    shown = browser.eval(messages)
    assert shown == ["hello", "answer: hello", "said elsewhere", "answer: said elsewhere"]
