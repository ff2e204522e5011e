"""What the clients show of today's durable news: the ``ToolRetry`` signals
(``proc.run.tool.retry.scheduled`` / ``.resolved`` / ``.exhausted``) and a group chat's speakers.

- the durable CLI renderer (``SignalRenderer``) prints a short line for a failure counted (the
  tightest budget's retries left) and for a budget spent (the run stops), nothing for ``resolved``;
- the tracer of a kernel's durable runs records all three as events on the run's span;
- the web UI shows the same lines in the run, under the failed call's card, live and when the log
  is replayed, and the speaker's name (as text, never markup) above a group chat's user message.

Without Chromium the browser test skips, unless ``AGENTLOOP_REQUIRE_BROWSER=1`` (CI) makes it fail.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentloop import Reply, ScriptedModel, ToolResultMessage, ToolRetry, call
from agentloop.cli.render import SignalRenderer, TextRenderer, stderr_console, tool_retry_line
from agentloop.messages import UserMessage, origin
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.api import approve_everything
from agentloop.process.signals import Signal, SignalHub
from agentloop.tools.builtin import builtin_tools
from agentloop.tracing import trace_kernel
from tests.cdp import Browser
from tests.server_support import LiveServer
from tests.test_web_ui_browser import FOLLOWING, send, sign_in_and_open_a_process

SCHEDULED = {
    "runId": "r1",
    "callId": "c1",
    "name": "Read",
    "errorClass": "not_found",
    "roundsLeft": 31,
    "classLeft": 1,
    "toolLeft": 15,
    "signatureLeft": 2,
}
EXHAUSTED = {
    "runId": "r1",
    "callId": "c3",
    "name": "Read",
    "errorClass": "not_found",
    "budget": "class",
    "limit": 2,
    "reason": "a not_found failure of Read went past the not_found budget (2)",
}
RESOLVED = {"runId": "r1", "failures": 2, "rounds": 2}


# ------------------------------------------------------------------------------- the terminal


def rendered(*signals: tuple[str, dict[str, Any]]) -> tuple[str, list[bool]]:
    err = io.StringIO()
    waits: list[bool] = []
    view = SignalRenderer(TextRenderer(io.StringIO(), stderr_console(err), on_wait=waits.append))
    for seq, (name, payload) in enumerate(signals, 1):
        view.handle(Signal(name, payload, seq))
    return err.getvalue(), waits


def test_the_cli_shows_a_failure_counted_and_a_budget_spent_but_not_the_budgets_given_back() -> None:
    second = {**SCHEDULED, "callId": "c2", "roundsLeft": 30, "classLeft": 0, "toolLeft": 14}
    shown, waits = rendered(
        (sig.TOOL_RETRY_SCHEDULED, SCHEDULED),
        (sig.TOOL_RETRY_SCHEDULED, second),
        (sig.TOOL_RETRY_EXHAUSTED, EXHAUSTED),
        (sig.TOOL_RETRY_RESOLVED, RESOLVED),
    )
    assert shown.splitlines() == [
        "Read failed (not_found): 1 retry left for this class",
        "Read failed (not_found): no retries left for this class",
        "tool retry budget spent: a not_found failure of Read went past the not_found budget (2); the run stops",
    ]
    assert waits[-1] is True  # the model reads the failure next: the spinner is back


def test_the_cli_names_the_tightest_budget_and_never_obeys_what_a_tool_name_holds() -> None:
    line = tool_retry_line
    tight = {**SCHEDULED, "classLeft": 5, "signatureLeft": 3, "toolLeft": 3, "roundsLeft": 9}
    assert line(sig.TOOL_RETRY_SCHEDULED, tight) == "Read failed (not_found): 3 retries left for this call"
    rounds = {**SCHEDULED, "classLeft": 5, "signatureLeft": 3, "toolLeft": 4, "roundsLeft": 1}
    assert line(sig.TOOL_RETRY_SCHEDULED, rounds).endswith(": 1 retry left in this run")
    assert line(sig.TOOL_RETRY_SCHEDULED, {"name": "Read"}) == "Read failed (error): retrying"
    no_reason = {**EXHAUSTED, "reason": None}
    assert line(sig.TOOL_RETRY_EXHAUSTED, no_reason) == "tool retry budget spent: class budget (2); the run stops"
    assert line(sig.TOOL_RETRY_RESOLVED, RESOLVED) == ""
    shown, _ = rendered((sig.TOOL_RETRY_SCHEDULED, {**SCHEDULED, "name": "Evil\x1b]0;pwned\x07\nname"}))
    assert "\x1b" not in shown and "\x07" not in shown and shown.count("\n") == 1
    assert "\\u001b" in shown


# -------------------------------------------------------------------------------- the tracer


def test_the_tracer_records_the_retry_signals_as_events_on_the_run_span() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    class FakeEngine:
        def __init__(self) -> None:
            self.hub = SignalHub()
            self.closed_hooks: list[Any] = []

        def cached(self, pid: str) -> None:
            return None

    class FakeKernel:
        engine = FakeEngine()

    kernel = FakeKernel()
    trace_kernel(kernel, tracer_provider=provider)  # type: ignore[arg-type]

    def publish(signal: str, payload: dict[str, Any]) -> None:
        kernel.engine.hub.publish("p1", Signal(signal, {"pid": "p1", **payload}))

    publish(sig.RUN_STARTED, {"runId": "r1", "reason": "proc.send"})
    publish(sig.TOOL_RETRY_SCHEDULED, SCHEDULED)
    publish(sig.TOOL_RETRY_RESOLVED, RESOLVED)
    publish(sig.TOOL_RETRY_EXHAUSTED, EXHAUSTED)
    publish(sig.RUN_FINISHED, {"runId": "r1", "status": "ok", "reason": "stopped", "usage": {}})
    # a run this tracer did not see start (a restart): its retry news opens its span too
    publish(sig.TOOL_RETRY_SCHEDULED, {**SCHEDULED, "runId": "r2"})
    publish(sig.RUN_FINISHED, {"runId": "r2", "status": "ok", "reason": "turn.complete", "usage": {}})
    spans = {(s.attributes or {})["agentloop.run.id"]: s for s in exporter.get_finished_spans()}
    events = [(e.name, dict(e.attributes or {})) for e in spans["r1"].events]
    assert events == [
        (
            "agentloop.tool_retry.scheduled",
            {
                "gen_ai.tool.call.id": "c1",
                "gen_ai.tool.name": "Read",
                "agentloop.tool_retry.error_class": "not_found",
                "agentloop.tool_retry.rounds_left": 31,
                "agentloop.tool_retry.class_left": 1,
                "agentloop.tool_retry.tool_left": 15,
                "agentloop.tool_retry.signature_left": 2,
            },
        ),
        ("agentloop.tool_retry.resolved", {"agentloop.tool_retry.failures": 2, "agentloop.tool_retry.rounds": 2}),
        (
            "agentloop.tool_retry.exhausted",
            {
                "gen_ai.tool.call.id": "c3",
                "gen_ai.tool.name": "Read",
                "agentloop.tool_retry.error_class": "not_found",
                "agentloop.tool_retry.budget": "class",
                "agentloop.tool_retry.limit": 2,
                "agentloop.tool_retry.reason": EXHAUSTED["reason"],
            },
        ),
    ]
    resumed = spans["r2"]
    assert (resumed.attributes or {})["agentloop.run.resumed"] is True
    assert [e.name for e in resumed.events] == ["agentloop.tool_retry.scheduled"]


# ------------------------------------------------------------------------------- the web UI

MARKUP = "<img src=x onerror=alert(1)>Alice"


def brain(request: ModelRequest) -> Reply | str:
    """``find it``: read three files that are not there (the third spends the not_found budget,
    2), then give up; anything else: an answer."""
    last = next(m for m in reversed(request.messages) if isinstance(m, UserMessage))
    if "find it" not in last.text:
        return f"re: {last.text.splitlines()[-1]}"
    seen = sum(1 for m in request.messages if isinstance(m, ToolResultMessage))
    if seen < 3:
        return Reply(tool_calls=[call("Read", path=f"missing-{seen}.txt")])
    return "gave up"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    options = {
        "heartbeat": None,
        "pieces": [ToolRetry()],
        "tools": builtin_tools(tmp_path, shell=False),
        "approval": approve_everything,
    }
    srv = LiveServer(tmp_path, model=ScriptedModel(brain), kernel_options=options).start()
    try:
        yield srv
    finally:
        srv.stop()


RETRY_LINES = "[...document.querySelectorAll('#transcript .notice.tool-retry')].map((n) => n.textContent)"
# each retry line with the text of the node before it (the failed call's card: its tool's name)
UNDER = (
    "[...document.querySelectorAll('#transcript .notice.tool-retry')]"
    ".map((n) => [n.previousElementSibling.className, n.previousElementSibling.querySelector('.name')?.textContent])"
)
SPEAKERS = (
    "[...document.querySelectorAll('#transcript .speaker')]"
    ".map((n) => [n.textContent, n.title, n.nextElementSibling.className, n.nextElementSibling.textContent])"
)


def test_the_page_shows_tool_retries_and_group_speakers_live_and_after_a_reload(
    server: LiveServer, browser: Browser
) -> None:
    assert server.ctx is not None
    kernel = server.ctx.kernel
    proc = asyncio.run(server.run(lambda: kernel.spawn(owner="alice")))

    async def say(text: str, name: str, user: str, chat: Any) -> None:
        await proc.send(text, origin=origin(name, user, chat))
        await proc.wait_idle()

    browser.navigate(server.url + "/")
    browser.wait("!document.getElementById('signin').hidden")
    browser.type_into("token", server.tokens.alice)
    browser.eval("document.getElementById('signin-form').requestSubmit()")
    item = f"#processes li[data-pid={json.dumps(proc.pid)}]"
    browser.wait(f"document.querySelector({json.dumps(item)})")
    browser.click(item)
    browser.wait(f"{FOLLOWING} && document.getElementById('proc-title').textContent === {json.dumps(proc.pid)}")

    # live: a group message whose sender's name holds markup, a run whose reads fail until it stops
    asyncio.run(server.run(lambda: say("please find it", MARKUP, "telegram:42", "group")))
    asyncio.run(server.run(lambda: say("thanks", "Bob", "telegram:7", "group")))
    asyncio.run(server.run(lambda: say("just me", "Carol", "telegram:9", "direct")))  # one person: no name
    expected_lines = [
        "Read failed (not_found): 1 retry left for this class",
        "Read failed (not_found): no retries left for this class",
        "tool retry budget spent: a not_found failure of Read went past the not_found budget (2); the run stops",
    ]
    expected_speakers = [
        [MARKUP, "telegram:42", "msg user", "please find it"],
        ["Bob", "telegram:7", "msg user", "thanks"],
    ]
    browser.wait("document.querySelectorAll('#transcript .footer[data-status]').length === 3")
    browser.wait(f"{RETRY_LINES}.length === 3")
    assert browser.eval(RETRY_LINES) == expected_lines
    assert browser.eval(UNDER) == [["tool failed", "Read"]] * 3  # each under the card of the call it counts
    browser.wait("document.querySelectorAll('#transcript .msg.user').length === 3")
    assert browser.eval(SPEAKERS) == expected_speakers
    assert browser.eval("document.querySelectorAll('#transcript img').length") == 0
    assert browser.dialogs == []

    # replayed: the history and the log read again give the same page
    browser.reload()
    browser.wait(f"document.querySelector({json.dumps(item)})")
    browser.click(item)
    browser.wait(f"{FOLLOWING} && document.querySelectorAll('#transcript .footer[data-status]').length === 3")
    assert browser.eval(RETRY_LINES) == expected_lines
    assert browser.eval(UNDER) == [["tool failed", "Read"]] * 3
    assert browser.eval(SPEAKERS) == expected_speakers
    assert browser.eval("document.querySelectorAll('#transcript img').length") == 0
    assert browser.dialogs == []


# --------------------------------------------------------------------- approval with an edit

ARGS = "document.querySelector('#approvals .hil-args')"
ERROR = "document.querySelector('#approvals .hil-error').textContent"


@pytest.fixture
def asking_server(tmp_path: Path) -> Iterator[LiveServer]:
    """The tests' usual server: ``risky`` calls ``echo`` with text "risky", which the policy asks about."""
    srv = LiveServer(tmp_path, kernel_options={"heartbeat": None}).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_an_approval_can_be_edited_refused_inline_and_approved_with_the_edit(
    asking_server: LiveServer, browser: Browser
) -> None:
    sign_in_and_open_a_process(browser, asking_server.url, asking_server.tokens.alice)
    send(browser, "risky")
    browser.wait("document.querySelector('#approvals .hil-edit')")
    assert browser.eval(f"{ARGS}.closest('.hil-editor').hidden") is True
    browser.click("#approvals .hil-edit")
    assert browser.eval(f"{ARGS}.closest('.hil-editor').hidden") is False
    assert json.loads(browser.eval(f"{ARGS}.value")) == {"text": "risky"}  # the call's arguments, as JSON

    # not JSON, or not an object: said under it, nothing sent
    browser.eval(f"{ARGS}.value = '{{\"text\": '")
    browser.click("#approvals .hil-approve-edited")
    assert browser.eval(ERROR).startswith("not JSON")
    browser.eval(f"{ARGS}.value = '[1]'")
    browser.click("#approvals .hil-approve-edited")
    assert browser.eval(ERROR) == "the arguments must be a JSON object"

    # what the tool's schema refuses: the server's 400, said under it; the request still pending
    browser.eval(f"{ARGS}.value = '{{\"text\": 5}}'")
    browser.click("#approvals .hil-approve-edited")
    refused = browser.wait(f"{ERROR}")
    assert refused.startswith("the edited arguments are not valid for echo")
    assert browser.eval(f"{ARGS}.disabled") is False  # answer again
    assert browser.eval("document.querySelectorAll('#approvals .approval').length") == 1

    # the edit approved: the call runs with it and the card goes
    browser.eval(f"{ARGS}.value = {json.dumps(json.dumps({'text': '<b>edited</b>'}))}")
    browser.click("#approvals .hil-approve-edited")
    browser.wait("document.querySelectorAll('#approvals .approval').length === 0")
    browser.wait("document.querySelector('#transcript .footer[data-status]')")
    output = browser.wait("document.querySelector('#transcript .tool.ok .output')?.textContent")
    assert "edited this call's arguments" in output and output.endswith("\n<b>edited</b>")  # (as text)
    assert browser.eval("document.querySelectorAll('#transcript b').length") == 0
    assert browser.dialogs == []
