"""Retry: a durable run that ended without an answer (a provider outage after its retries, an
abort, the output limit) keeps the user's message; ``Process.retry()`` runs the model again on the
history as it stands, with no new input, its failed end removed first. Refused while a run is
under way (``RunActive``, HTTP 409 ``busy``) and after an answer (``NothingToRetry``, 409
``nothing_to_retry``); a retried run survives a restart like any run. Also over HTTP, the Python
client and ``agentloop chat``'s ``/retry``."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from agentloop import Agent, Reply, ScriptedModel, UserMessage, call
from agentloop.cli.chat import ChatRepl, ChatState, DurableSession, PlainReader
from agentloop.cli.client import RemoteSession
from agentloop.client import AgentloopClient, Conflict
from agentloop.messages import (
    AssistantMessage,
    Message,
    StopReason,
    SystemMessage,
    TextContent,
    ToolResultMessage,
    system,
    user,
)
from agentloop.models.base import ModelRequest, ProviderError
from agentloop.models.retry import NO_RETRY
from agentloop.process import signals as sig
from agentloop.process.admission import NothingToRetry, retry_point
from agentloop.process.api import RunActive
from agentloop.server import api
from tests.process_support import kernel
from tests.server_support import LiveServer, checked, live_server, refused, slow, wait_idle
from tests.ws_support import KernelServer

DOWN = ProviderError("the provider is down", kind="auth")  # (not an outage the run waits out)


class Script:
    """The model's replies in order (a ``ProviderError`` fails the call; an ``asyncio.Event`` is
    waited for, then the next item answers); once spent, an answer naming what it was asked.
    Every request's messages are kept."""

    def __init__(self, *items: Any) -> None:
        self.items = list(items)
        self.seen: list[list[Message]] = []
        self.model = ScriptedModel(self.brain)

    async def brain(self, request: ModelRequest) -> Any:
        self.seen.append(list(request.messages))
        while self.items and isinstance(self.items[0], asyncio.Event):
            await self.items.pop(0).wait()
        item = self.items.pop(0) if self.items else None
        if isinstance(item, ProviderError):
            raise item
        if item is not None:
            return item
        last = request.messages[-1]
        return f"answer to {last.text}" if isinstance(last, UserMessage) else "answer"


async def ends(proc: Any) -> list[dict[str, Any]]:
    return [r.payload for r in await proc.kernel.store.events(proc.pid) if r.signal == sig.RUN_FINISHED]


async def idle(proc: Any) -> None:
    async with asyncio.timeout(5):
        await proc.wait_idle()


def _answer(text: str, stop: StopReason = "stop") -> AssistantMessage:
    return AssistantMessage(content=[TextContent(text=text)], stop_reason=stop)


# -- which histories can be retried ------------------------------------------------------------


def test_retry_point_keeps_the_input_and_drops_the_failed_end() -> None:
    failed = _answer("half an ans", "error")
    notice = system("The run failed: down", "error")
    assert retry_point([user("hi"), failed, notice]) == 1
    assert retry_point([user("hi"), _answer("cut off", "length")]) == 1
    assert retry_point([user("hi"), _answer("partial", "aborted")]) == 1
    assert retry_point([user("hi")]) == 1  # (an abort during the model call, a rewind to a question)
    results = ToolResultMessage(tool_call_id="c1", tool_name="echo", content=[], is_error=True)
    assert retry_point([user("hi"), results]) == 2  # tool results the model never answered
    assert retry_point([system("a watch fired", "event"), failed, notice]) == 1
    # nothing to retry: an answer, an empty history, a summary alone
    assert retry_point([user("hi"), _answer("hello")]) is None
    assert retry_point([]) is None
    assert retry_point([failed, notice]) is None
    assert retry_point([SystemMessage(content=[], kind="summary")]) is None


# -- the library --------------------------------------------------------------------------------


async def test_a_failed_run_is_retried_on_the_same_history(tmp_path: Path) -> None:
    script = Script(DOWN)
    async with kernel(tmp_path, script.model, retry=NO_RETRY) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("hello")
        await idle(proc)
        assert [e["status"] for e in await ends(proc)] == ["error"]
        assert [m.role for m in await proc.messages()] == ["user", "assistant", "system"]  # kept, failed
        receipt = await proc.retry()
        await idle(proc)
        msgs = await proc.messages()
        finished = await ends(proc)
        changes = [r.payload for r in await k.store.events(proc.pid) if r.signal == sig.CHANGED]
        started = [r.payload for r in await k.store.events(proc.pid) if r.signal == sig.RUN_STARTED]
        [segment] = await proc.segments()  # the failed end, archived before it went
        archived = await proc.segment(segment.id)
    assert segment.kind == "rewind" and [m.role for _, m in archived.messages] == ["assistant", "system"]
    assert len(script.seen) == 2
    asked = script.seen[1]  # the user's message last, neither the failed turn nor the notice
    assert [m.role for m in asked] == ["user"] and asked[-1].text == "hello"
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[-1].text == "answer to hello"
    assert [(e["runId"], e["status"]) for e in finished[1:]] == [(receipt.run_id, "ok")]
    assert not receipt.queued
    assert started[-1]["runId"] == receipt.run_id and started[-1]["reason"] == "proc.retry"
    assert any(c.get("retried", {}).get("removed") == 2 for c in changes)


async def test_retry_after_an_answer_is_refused(tmp_path: Path) -> None:
    async with kernel(tmp_path, Script().model, retry=NO_RETRY) as k:
        proc = await k.spawn(owner="alice")
        with pytest.raises(NothingToRetry, match="nothing to retry"):  # no conversation yet
            await proc.retry()
        await proc.send("hello")
        await idle(proc)
        before = await proc.messages()
        with pytest.raises(ValueError, match="nothing to retry"):
            await proc.retry()
        assert [m.text for m in await proc.messages()] == [m.text for m in before]
        assert (await proc.info()).current_run is None


async def test_retry_while_a_run_is_under_way_is_refused(tmp_path: Path) -> None:
    gate = asyncio.Event()
    async with kernel(tmp_path, Script(gate, "late").model, retry=NO_RETRY) as k:
        proc = await k.spawn(owner="alice")
        receipt = await proc.send("hello")
        with pytest.raises(RunActive):
            await proc.retry()
        gate.set()
        await idle(proc)
        assert [e["runId"] for e in await ends(proc)] == [receipt.run_id]


async def test_an_aborted_run_is_retried(tmp_path: Path) -> None:
    gate = asyncio.Event()
    script = Script(gate, "the retried answer")  # (the aborted call never got past the gate)
    async with kernel(tmp_path, script.model, retry=NO_RETRY) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("hello")
        async with asyncio.timeout(5):
            while not script.seen:
                await asyncio.sleep(0.01)
        assert await proc.abort()
        await idle(proc)
        gate.set()
        await proc.retry()
        await idle(proc)
        msgs = await proc.messages()
    assert [m.role for m in script.seen[-1]] == ["user"]
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[-1].text == "the retried answer"


async def test_retry_is_idempotent_with_a_run_id(tmp_path: Path) -> None:
    script = Script(DOWN)
    async with kernel(tmp_path, script.model, retry=NO_RETRY) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("hello")
        await idle(proc)
        first = await proc.retry(run_id="retry-1")
        again = await proc.retry(run_id="retry-1")  # (while it runs, or after: the same receipt)
        await idle(proc)
        later = await proc.retry(run_id="retry-1")
        with pytest.raises(ValueError):
            await proc.retry(run_id="")
    assert first.run_id == again.run_id == later.run_id == "retry-1"
    assert len(script.seen) == 2  # one retry, not three


async def test_a_retried_run_survives_a_restart(tmp_path: Path) -> None:
    gate = asyncio.Event()  # never set: the kernel closes while the retried run waits for the model
    script = Script(DOWN, gate)
    async with kernel(tmp_path, script.model, retry=NO_RETRY) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("hello")
        await idle(proc)
        receipt = await proc.retry()
        async with asyncio.timeout(5):
            while len(script.seen) < 2:
                await asyncio.sleep(0.01)
    after = Script()
    async with kernel(tmp_path, after.model, retry=NO_RETRY) as k:
        proc = await k.process(proc.pid)
        await idle(proc)  # (resumed on opening, like any run left under way)
        msgs = await proc.messages()
        finished = await ends(proc)
    assert [m.role for m in after.seen[0]] == ["user"]
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[-1].text == "answer to hello"
    assert (finished[-1]["runId"], finished[-1]["status"]) == (receipt.run_id, "ok")


# -- HTTP, the client, the WebSocket ------------------------------------------------------------

_FAILED_ONCE: set[str] = set()


def flaky(request: ModelRequest) -> Any:
    """The server's model: a message starting with "flaky" fails the first time it is asked
    (a refusal, not an outage to wait out); "sleep N" runs the slow tool; else it answers."""
    last = request.messages[-1]
    if isinstance(last, ToolResultMessage):
        return f"done: {last.text}"
    text = last.text if isinstance(last, UserMessage) else ""
    if text.startswith("flaky") and text not in _FAILED_ONCE:
        _FAILED_ONCE.add(text)
        raise DOWN
    if text.startswith("sleep "):
        return Reply(tool_calls=[call("slow", seconds=float(text[6:]))])
    return f"answer to {text}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = ScriptedModel(flaky, keep_requests=False)
    with live_server(tmp_path_factory.mktemp("retry"), model=model, kernel_options={"retry": NO_RETRY}) as srv:
        yield srv


async def test_http_retries_a_failed_run_and_refuses_otherwise(server: LiveServer) -> None:
    async with server.client(server.tokens.alice) as alice, server.client(server.tokens.bob) as bob:
        pid = (await alice.post("/v1/processes", json={})).json()["pid"]
        await alice.post(f"/v1/processes/{pid}/messages", json={"text": "flaky http"})
        assert (await wait_idle(alice, pid))["state"] == "idle"
        refused(await bob.post(f"/v1/processes/{pid}/retry", json={}), 404, "not_found")
        receipt = checked(await alice.post(f"/v1/processes/{pid}/retry"), api.ReceiptOut, 202)  # (no body: {})
        assert receipt["queued"] is False and receipt["run_id"]
        await wait_idle(alice, pid)
        messages = (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"]
        assert [m["message"]["role"] for m in messages] == ["user", "assistant"]
        assert messages[-1]["message"]["content"][0]["text"] == "answer to flaky http"
        refused(await alice.post(f"/v1/processes/{pid}/retry", json={}), 409, "nothing_to_retry")
        refused(await alice.post(f"/v1/processes/{pid}/retry", json={"run_id": ""}), 400, "invalid_request")
        await alice.post(f"/v1/processes/{pid}/messages", json={"text": "sleep 30"})
        try:
            busy = await alice.post(f"/v1/processes/{pid}/retry", json={})
            refused(busy, 409, "busy")
            assert busy.headers.get("retry-after") == "1"
        finally:
            await alice.post(f"/v1/processes/{pid}/abort", json={})
        # aborted during its tool call: the model answers the cancelled result
        again = checked(await alice.post(f"/v1/processes/{pid}/retry", json={"run_id": "r-1"}), api.ReceiptOut, 202)
        await wait_idle(alice, pid)
        same = checked(await alice.post(f"/v1/processes/{pid}/retry", json={"run_id": "r-1"}), api.ReceiptOut, 202)
        assert again == same and again["run_id"] == "r-1"
        last = (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"][-1]["message"]
        assert last["role"] == "assistant" and last["content"][0]["text"].startswith("done: ")
        spec = (await alice.get("/v1/openapi.json")).json()
        assert "post" in spec["paths"]["/v1/processes/{pid}/retry"]


async def test_the_client_retries(server: LiveServer) -> None:
    async with AgentloopClient(server.url, server.tokens.alice) as client:
        pid = (await client.spawn())["pid"]
        await client.send(pid, "flaky client")
        async with server.client(server.tokens.alice) as http:
            await wait_idle(http, pid)
            receipt = await client.retry(pid, run_id="client-retry")
            assert receipt["run_id"] == "client-retry"
            await wait_idle(http, pid)
        assert (await client.retry(pid, run_id="client-retry"))["run_id"] == "client-retry"
        with pytest.raises(Conflict) as refusal:
            await client.retry(pid)
        assert refusal.value.code == "nothing_to_retry"


def test_websocket_retries(tmp_path: Path) -> None:
    with KernelServer(tmp_path, ScriptedModel(flaky), tools=[slow], retry=NO_RETRY) as srv:
        alice, bob = srv.client("alice"), srv.client("bob")
        try:
            pid = alice.ok("proc.spawn", {})["pid"]
            alice.ok("proc.send", {"pid": pid, "text": "flaky ws"})
            for _ in range(500):
                if alice.ok("proc.get", {"pid": pid})["state"] == "idle":
                    break
                time.sleep(0.01)
            assert bob.error("proc.retry", {"pid": pid}) == "not_found"
            receipt = alice.ok("proc.retry", {"pid": pid, "run_id": "ws-retry"})
            api.ReceiptOut.model_validate(receipt)
            assert receipt["run_id"] == "ws-retry"
            for _ in range(500):
                if alice.ok("proc.get", {"pid": pid})["state"] == "idle":
                    break
                time.sleep(0.01)
            assert alice.error("proc.retry", {"pid": pid}) == "nothing_to_retry"
        finally:
            alice.close()
            bob.close()


# -- agentloop chat -------------------------------------------------------------------------------


def test_durable_chat_retries(tmp_path: Path) -> None:
    script = Script(DOWN)
    ev = asyncio.new_event_loop()
    stack = AsyncExitStack()
    out, err = io.StringIO(), io.StringIO()
    try:
        k = ev.run_until_complete(stack.enter_async_context(kernel(tmp_path, script.model, retry=NO_RETRY)))
        session = DurableSession(k, owner="me", cwd=tmp_path, state=ChatState(tmp_path / "chat.json"))
        ev.run_until_complete(session.open(new=True))
        reader = PlainReader(io.StringIO("hello\n/retry\n/retry\n/help\n/exit\n"))
        repl = ChatRepl(session, reader=reader, out=out, err=Console(file=err, width=200))
        repl.loop(ev)
        messages = ev.run_until_complete(session.process.messages())
    finally:
        ev.run_until_complete(stack.aclose())
        ev.close()
    shown = err.getvalue()
    assert "answer to hello" in out.getvalue()
    assert "not retried: nothing to retry" in shown and "/retry" in shown  # the second, and the help
    assert [m.role for m in messages] == ["user", "assistant"] and messages[-1].text == "answer to hello"
    assert [m.role for m in script.seen[-1]] == ["user"]


def test_remote_chat_retries(server: LiveServer) -> None:
    ev = asyncio.new_event_loop()
    client = AgentloopClient(server.url, server.tokens.bob)
    out, err = io.StringIO(), io.StringIO()
    try:
        session = RemoteSession(client)
        ev.run_until_complete(session.open(new=True))
        reader = PlainReader(io.StringIO("flaky remote chat\n/retry\n/retry\n/exit\n"))
        repl = ChatRepl(session, reader=reader, out=out, err=Console(file=err, width=200))
        repl.loop(ev)
        history = ev.run_until_complete(client.history(session.pid))["messages"]
    finally:
        ev.run_until_complete(client.aclose())
        ev.close()
    assert "answer to flaky remote chat" in out.getvalue()
    assert "not retried: nothing to retry" in err.getvalue()
    assert [m["message"]["role"] for m in history] == ["user", "assistant"]


def test_a_chat_in_memory_says_it_cannot_retry() -> None:
    err = io.StringIO()
    reader = PlainReader(io.StringIO("/retry\n/exit\n"))
    repl = ChatRepl(Agent(model=ScriptedModel(["hi"])), reader=reader, out=io.StringIO(), err=Console(file=err))
    assert repl.loop() == 0
    assert "no retry" in err.getvalue()
