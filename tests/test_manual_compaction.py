"""Compaction on demand and reading back what compaction (or a reset) put away: ``Process.compact``,
``Process.segments`` and ``Process.segment``, their HTTP routes, WebSocket calls, client methods
and the chat's ``/compact``.

A manual compaction takes the same path as the automatic one (archive first, then the swap, a
segment row and ``proc.compacted`` in one commit, the ``pre_compaction`` hooks), only while the
process is idle; input sent meanwhile waits for it and then runs on the compacted history.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Kernel, Process
from agentloop.loop.hooks import Block, TurnInfo
from agentloop.messages import Message, SystemMessage
from agentloop.models.base import ModelRequest, ProviderError
from agentloop.process.api import RunActive
from agentloop.process.archive import read_archive
from agentloop.process.compaction import SUMMARY_KIND, SUMMARY_SYSTEM_PROMPT, CompactionError
from agentloop.server import api
from tests import server_support, test_queue_control
from tests.server_support import LiveServer, checked, refused, slow, wait_idle
from tests.ws_support import KernelServer

LONG = "lorem ipsum dolor sit amet " * 80  # about 540 tokens


class Brain:
    """Answers ``re: <text>``; the summary call answers ``Summary: …`` (after ``gate`` opens, when
    ``hold`` is set), "hold" makes a run wait for ``gate`` too. Every request is kept."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.summarising = asyncio.Event()
        self.waiting = asyncio.Event()
        self.summaries: list[ModelRequest] = []
        self.requests: list[ModelRequest] = []  # the conversation's own
        self.fail = False
        self.model = ScriptedModel(self.answer)

    async def answer(self, req: ModelRequest) -> Reply | str:
        if req.system_prompt == SUMMARY_SYSTEM_PROMPT:
            self.summaries.append(req)
            self.summarising.set()
            await self.gate.wait()
            if self.fail:
                raise ProviderError("the summary model is down", kind="server")
            return "Summary: the user sent long texts."
        self.requests.append(req)
        last = req.messages[-1]
        if isinstance(last, ToolResultMessage):
            return f"after tool: {last.text}"
        if last.text == "hold":
            self.waiting.set()
            await self.gate.wait()
        if last.text == "tool":
            return Reply(tool_calls=[call("nothing")])
        return f"re: {last.text}"


@tool
def nothing() -> str:
    """Do nothing."""
    return "done nothing"


def kernel(tmp_path: Path, brain: Brain, url: str | None = None, **kw: Any) -> Any:
    return Kernel.open(
        url or f"sqlite:///{tmp_path}/a.db",
        model=brain.model,
        workspace=tmp_path,
        data_dir=tmp_path,
        tools=[nothing],
        **kw,
    )


async def talked(k: Kernel, rounds: int = 3) -> Process:
    """A process of alice's with ``rounds`` long exchanges, idle."""
    proc = await k.spawn(owner="alice")
    for i in range(rounds):
        await proc.send(f"part {i}: {LONG}")
        await proc.wait_idle()
    return proc


async def logged(proc: Process, name: str) -> list[dict[str, Any]]:
    return [s.payload async for s in proc.signals(follow=False) if s.signal == name]


async def held_compaction(brain: Brain, proc: Process) -> asyncio.Task[Any]:
    """A compaction of ``proc`` started and held at its summary call until ``brain.gate`` opens."""
    brain.gate.clear()
    compacting = asyncio.create_task(proc.compact())
    await asyncio.wait_for(brain.summarising.wait(), 5)
    return compacting


def is_summary(m: Message) -> bool:
    return isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND


def answered_on_the_summary(brain: Brain, text: str) -> bool:
    """Whether the model call that answered ``text`` was sent the compacted history."""
    asked = next(r for r in brain.requests if any(m.text == text for m in r.messages))
    return is_summary(asked.messages[0])


# ---------------------------------------------------------------------------------- kernel


async def test_a_manual_compaction_summarises_archives_and_logs(tmp_path: Path) -> None:
    brain = Brain()
    async with kernel(tmp_path, brain) as k:
        proc = await talked(k)
        before = await proc.messages()
        done = await proc.compact("keep every part number")
        after = await proc.messages()
        assert done.compacted and done.removed == 4 and done.tokens_after < done.tokens_before
        assert is_summary(after[0]) and after[1:] == before[4:]
        assert after == [m.message for m in await k.store.history(proc.pid)]
        assert "keep every part number" in brain.summaries[0].messages[-1].text  # the instructions reach it
        [signal] = await logged(proc, "proc.compacted")
        assert signal["reason"] == "manual" and signal["kind"] == "summary" and signal["runId"] is None
        assert signal["removed"] == 4 and signal["tokensBefore"] == done.tokens_before
        [row] = await k.store.segments(proc.pid)
        assert row.kind == "compaction" and row.id == done.segment_id
        path = tmp_path / "var" / "sessions" / "alice" / proc.pid / f"{done.archive}.jsonl.gz"
        header, archived = read_archive(path)
        assert archived == before[:4] and header["meta"]["reason"] == "manual"
        assert (await proc.info()).current_run is None
        await proc.send("and now?")  # the conversation goes on from the summary
        await proc.wait_idle()
        assert (await proc.messages())[-1].text == "re: and now?"


async def test_the_pre_compaction_hooks_run_and_may_decline(tmp_path: Path) -> None:
    brain = Brain()
    seen: list[tuple[str, int]] = []
    declining = [False]
    async with kernel(tmp_path, brain) as k:

        @k.engine.config.hooks.on("pre_compaction")
        def hook(info: TurnInfo) -> Any:
            seen.append((info.run_id, len(info.messages)))  # (the history as the hook saw it)
            return Block("not during the demo") if declining[0] else {"ticket": "T-1"}

        proc = await talked(k)
        declining[0] = True
        refused = await proc.compact()
        assert not refused.compacted and "not during the demo" in refused.note
        assert not any(is_summary(m) for m in await proc.messages()) and not brain.summaries
        declining[0] = False
        done = await proc.compact()
        assert done.compacted and seen == [("", 6), ("", 6)]
        summary = (await proc.messages())[0]
        assert isinstance(summary, SystemMessage) and summary.details == {"ticket": "T-1"}


async def test_nothing_worth_compacting_says_so(tmp_path: Path) -> None:
    brain = Brain()
    async with kernel(tmp_path, brain) as k:
        fresh = await k.spawn(owner="alice")
        empty = await fresh.compact()
        assert not empty.compacted and "nothing" in empty.note and empty.tokens_before == 0
        short = await talked(k, rounds=1)
        before = await short.messages()
        done = await short.compact()
        assert not done.compacted and done.tokens_before == done.tokens_after > 0
        assert await short.messages() == before and not brain.summaries
        assert not await logged(short, "proc.compacted") and not await k.store.segments(short.pid)


async def test_a_compaction_while_a_run_is_active_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    brain = Brain()
    async with kernel(tmp_path, brain) as k:
        proc = await talked(k)
        brain.gate.clear()
        await proc.send("hold")
        await asyncio.wait_for(brain.waiting.wait(), 5)
        before = await proc.messages()
        with pytest.raises(RunActive):
            await proc.compact()
        assert await proc.messages() == before and not brain.summaries
        brain.gate.set()
        await proc.wait_idle()
        assert not await logged(proc, "proc.compacted") and not await k.store.segments(proc.pid)


async def test_a_summary_that_fails_is_an_error_and_leaves_the_history(tmp_path: Path) -> None:
    brain = Brain()
    async with kernel(tmp_path, brain) as k:
        proc = await talked(k)
        before = await proc.messages()
        brain.fail = True
        with pytest.raises(CompactionError, match="summary model is down"):
            await proc.compact()
        assert await proc.messages() == before and not await k.store.segments(proc.pid)
        assert not await logged(proc, "proc.compacted")


async def test_input_sent_during_a_compaction_waits_and_runs_on_the_summary(tmp_path: Path) -> None:
    brain = Brain()
    async with kernel(tmp_path, brain) as k:
        proc = await talked(k)
        compacting = await held_compaction(brain, proc)
        sent = asyncio.create_task(proc.send("question while compacting"))
        event = asyncio.create_task(k.signal(proc.pid, "an event while compacting"))
        await asyncio.sleep(0.1)
        assert not sent.done() and not event.done()  # they wait for the compaction
        assert (await proc.info()).current_run is None
        brain.gate.set()
        assert (await compacting).compacted
        await sent
        await event
        await proc.wait_idle()
        messages = await proc.messages()
        assert is_summary(messages[0])
        texts = [m.text for m in messages]
        assert texts.count("question while compacting") == 1
        assert texts.count("an event while compacting") == 1
        assert answered_on_the_summary(brain, "question while compacting")
        assert messages == [m.message for m in await k.store.history(proc.pid)]


async def test_a_reset_waits_for_a_compaction_under_way(tmp_path: Path) -> None:
    brain = Brain()
    async with kernel(tmp_path, brain) as k:
        proc = await talked(k)
        compacting = await held_compaction(brain, proc)
        resetting = asyncio.create_task(proc.reset())
        await asyncio.sleep(0.1)
        assert not resetting.done()
        brain.gate.set()
        assert (await compacting).compacted
        await resetting
        assert await proc.messages() == []
        assert [s.kind for s in await proc.segments()] == ["compaction", "reset"]


async def test_segments_list_and_read_back_in_pages(tmp_path: Path) -> None:
    brain = Brain()
    async with kernel(tmp_path, brain) as k:
        proc = await talked(k)
        original = await proc.messages()
        done = await proc.compact()
        compacted = await proc.messages()
        await proc.reset()
        listed = await proc.segments()
        assert [(s.kind, s.reason, s.messages) for s in listed] == [
            ("compaction", "manual", 4),
            ("reset", "reset", 3),
        ]
        first, reset = listed
        assert first.id == done.segment_id and first.archive == done.archive
        assert first.created_at <= reset.created_at and reset.generation == first.generation

        page = await proc.segment(first.id, limit=3)
        assert [i for i, _ in page.messages] == [1, 2, 3] and page.next_before == 1
        assert [m for _, m in page.messages] == original[1:4] and page.segment == first
        older = await proc.segment(first.id, limit=3, before=page.next_before)
        assert older.messages == [(0, original[0])] and older.next_before is None
        whole = await proc.segment(reset.id)
        assert [m for _, m in whole.messages] == compacted and whole.next_before is None


async def test_bad_segment_reads_are_clean_errors(tmp_path: Path) -> None:
    from agentloop.kernel.segments import NoSuchSegment

    brain = Brain()
    async with kernel(tmp_path, brain) as k:
        proc = await talked(k)
        done = await proc.compact()
        other = await talked(k)
        with pytest.raises(NoSuchSegment):
            await proc.segment("no-such-segment")
        assert done.segment_id is not None
        with pytest.raises(NoSuchSegment):  # a segment of another process
            await other.segment(done.segment_id)
        for bad in ({"limit": 0}, {"limit": True}, {"before": -1}):
            with pytest.raises(ValueError):
                await proc.segment(done.segment_id, **bad)
        assert done.archive is not None
        (tmp_path / "var" / "sessions" / "alice" / proc.pid / f"{done.archive}.jsonl.gz").unlink()
        [gone] = await proc.segments()
        assert gone.messages is None  # listed, its archive unreadable
        with pytest.raises(NoSuchSegment, match="archive"):
            await proc.segment(done.segment_id)


async def test_compaction_and_segments_on_a_shared_postgresql_store(pg_url: str, tmp_path: Path) -> None:
    """Input another worker queues for the process while its holder compacts waits for the
    compaction; the summary and the segment rows are the same on PostgreSQL."""
    pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")
    brain = Brain()

    def worker(name: str) -> Any:
        return kernel(tmp_path, brain, pg_url, worker=name, poll_interval=0.2)

    async with worker("A") as a, worker("B") as b:
        proc = await talked(a)
        compacting = await held_compaction(brain, proc)
        elsewhere = await b.process(proc.pid)
        receipt = await elsewhere.send("question from B")
        assert receipt.queued is False
        await asyncio.sleep(0.3)
        assert (await proc.info()).current_run is None  # not started under the compaction
        brain.gate.set()
        assert (await compacting).compacted
        await asyncio.sleep(0.1)
        await proc.wait_idle()
        messages = await proc.messages()
        assert is_summary(messages[0]) and [m.text for m in messages].count("question from B") == 1
        assert messages[-1].text == "re: question from B" and answered_on_the_summary(brain, "question from B")
        [segment] = await elsewhere.segments()
        page = await elsewhere.segment(segment.id)
        assert len(page.messages) == segment.messages == 4


# ---------------------------------------------------------------------------------- HTTP


server = server_support.module_server("compact")
alice, bob = server_support.alice, server_support.bob


async def talked_over_http(client: httpx.AsyncClient, rounds: int = 3) -> str:
    pid: str = (await client.post("/v1/processes", json={})).json()["pid"]
    for i in range(rounds):
        assert (await client.post(f"/v1/processes/{pid}/messages", json={"text": f"{i} {LONG}"})).status_code == 202
        await wait_idle(client, pid)
    return pid


async def test_http_compacts_and_reads_segments_back(alice: httpx.AsyncClient) -> None:
    pid = await talked_over_http(alice)
    base = f"/v1/processes/{pid}"
    before = (await alice.get(f"{base}/messages")).json()["messages"]
    done = checked(await alice.post(f"{base}/compact", json={"instructions": "mention part 1"}), api.CompactOut)
    assert done["compacted"] is True and done["removed"] == 4 and done["tokens_before"] > 0  # (an echoing model)
    after = (await alice.get(f"{base}/messages")).json()["messages"]
    assert after[0]["message"]["kind"] == "summary" and "mention part 1" in after[0]["message"]["content"][0]["text"]

    [segment] = checked(await alice.get(f"{base}/segments"), api.SegmentList)["segments"]
    assert segment["id"] == done["segment_id"] and segment["kind"] == "compaction"
    assert segment["reason"] == "manual" and segment["messages"] == 4 and segment["archive"] == done["archive"]
    page = checked(await alice.get(f"{base}/segments/{segment['id']}", params={"limit": 3}), api.SegmentPageOut)
    assert [m["index"] for m in page["messages"]] == [1, 2, 3] and page["next_before"] == 1
    assert [m["message"] for m in page["messages"]] == [m["message"] for m in before[1:4]]
    older = checked(await alice.get(f"{base}/segments/{segment['id']}?limit=3&before=1"), api.SegmentPageOut)
    assert [m["message"] for m in older["messages"]] == [before[0]["message"]] and older["next_before"] is None

    assert checked(await alice.post(f"{base}/reset"), api.ResetOut)["archived"] is True
    kinds = [s["kind"] for s in checked(await alice.get(f"{base}/segments"), api.SegmentList)["segments"]]
    assert kinds == ["compaction", "reset"]
    nothing = checked(await alice.post(f"{base}/compact"), api.CompactOut)  # (empty body: no instructions)
    assert nothing["compacted"] is False and nothing["note"]


async def test_http_refuses_bad_compactions_and_segment_reads(alice: httpx.AsyncClient, bob: httpx.AsyncClient) -> None:
    pid = await talked_over_http(alice)
    base = f"/v1/processes/{pid}"
    done = checked(await alice.post(f"{base}/compact", json={}), api.CompactOut)
    refused(await alice.get(f"{base}/segments/no-such-segment"), 404, "not_found")
    refused(await alice.get(f"{base}/segments/{done['segment_id']}?limit=0"), 400, "invalid_request")
    refused(await alice.get(f"{base}/segments/{done['segment_id']}?before=-1"), 400, "invalid_request")
    refused(await alice.post(f"{base}/compact", json={"instructions": 3}), 400, "invalid_request")
    refused(await alice.post(f"{base}/compact", json={"instructions": "x" * 20_001}), 400, "invalid_request")
    refused(await alice.post(f"{base}/compact", json={"instructions": "a\x00b"}), 400, "invalid_request")
    refused(await alice.post(f"{base}/compact", json={"focus": "x"}), 400, "invalid_request")
    for path in (f"{base}/segments", f"{base}/segments/{done['segment_id']}"):
        refused(await bob.get(path), 404, "not_found")
    refused(await bob.post(f"{base}/compact", json={}), 404, "not_found")
    refused(await alice.post("/v1/processes/nope/compact", json={}), 404, "not_found")
    refused(await alice.get("/v1/processes/nope/segments"), 404, "not_found")

    assert (await alice.post(f"{base}/messages", json={"text": "sleep 30"})).status_code == 202
    try:
        before = (await alice.get(f"{base}/messages")).json()
        refused(await alice.post(f"{base}/compact", json={}), 409, "busy")
        assert (await alice.get(f"{base}/messages")).json() == before
    finally:
        await alice.post(f"{base}/abort", json={})


def test_the_routes_are_documented() -> None:
    paths = api.openapi_document()["paths"]
    assert "post" in paths["/v1/processes/{pid}/compact"]
    assert "409" in paths["/v1/processes/{pid}/compact"]["post"]["responses"]
    assert "get" in paths["/v1/processes/{pid}/segments"]
    assert "get" in paths["/v1/processes/{pid}/segments/{segment_id}"]


# ---------------------------------------------------------------------------------- client


async def test_the_client_compacts_and_reads_segments(server: LiveServer) -> None:
    from agentloop.client import AgentloopClient, Conflict, NotFound

    async with AgentloopClient(server.url, server.tokens.alice) as client:
        pid = (await client.spawn())["pid"]
        for i in range(3):
            await client.send(pid, f"{i} {LONG}")
            async with server.client(server.tokens.alice) as http:
                await wait_idle(http, pid)
        done = await client.compact(pid, "be brief")
        assert done["compacted"] and done["removed"] == 4
        [segment] = await client.segments(pid)
        page = await client.segment(pid, segment["id"], limit=2)
        assert [m["index"] for m in page["messages"]] == [2, 3] and page["next_before"] == 2
        assert (await client.segment(pid, segment["id"], before=2))["next_before"] is None
        with pytest.raises(NotFound):
            await client.segment(pid, "nope")
        await client.send(pid, "sleep 30")
        try:
            with pytest.raises(Conflict):
                await client.compact(pid)
        finally:
            await client.abort(pid)


# ---------------------------------------------------------------------------------- WebSocket


def ws_script(req: ModelRequest) -> Reply | str:
    """The queue tests' WebSocket script, which also answers the summary call."""
    if req.system_prompt == SUMMARY_SYSTEM_PROMPT:
        return "Summary: long texts."
    return test_queue_control.ws_script(req)


def test_websocket_compacts_and_reads_segments_with_the_same_rules(tmp_path: Path) -> None:
    import time

    with KernelServer(tmp_path, ScriptedModel(ws_script), tools=[slow]) as srv:
        alice, bob = srv.client("alice"), srv.client("bob")
        try:
            pid = alice.ok("proc.spawn", {})["pid"]
            for i in range(3):
                alice.ok("proc.send", {"pid": pid, "text": f"{i} {LONG}"})
                for _ in range(500):
                    if alice.ok("proc.get", {"pid": pid})["state"] == "idle":
                        break
                    time.sleep(0.01)
            done = alice.ok("proc.compact", {"pid": pid, "instructions": "short"})
            api.CompactOut.model_validate(done)
            assert done["compacted"] and done["removed"] == 4
            listed = alice.ok("proc.segment.list", {"pid": pid})
            api.SegmentList.model_validate(listed)
            [segment] = listed["segments"]
            page = alice.ok("proc.segment.read", {"pid": pid, "segment_id": segment["id"], "limit": 1})
            api.SegmentPageOut.model_validate(page)
            assert [m["index"] for m in page["messages"]] == [3] and page["next_before"] == 3

            assert bob.error("proc.compact", {"pid": pid}) == "not_found"
            assert bob.error("proc.segment.list", {"pid": pid}) == "not_found"
            assert bob.error("proc.segment.read", {"pid": pid, "segment_id": segment["id"]}) == "not_found"
            assert alice.error("proc.segment.read", {"pid": pid, "segment_id": "nope"}) == "not_found"
            assert alice.error("proc.segment.read", {"pid": pid}) == "invalid_request"
            for bad in (0, -1, True, "2"):
                args = {"pid": pid, "segment_id": segment["id"], "limit": bad}
                assert alice.error("proc.segment.read", args) == "invalid_request"
            assert alice.error("proc.compact", {"pid": pid, "instructions": 5}) == "invalid_request"
            alice.ok("proc.send", {"pid": pid, "text": "sleep"})
            assert alice.error("proc.compact", {"pid": pid}) == "busy"
            alice.ok("proc.abort", {"pid": pid})
        finally:
            alice.close()
            bob.close()


# ---------------------------------------------------------------------------------- chat


def test_durable_chat_compacts_on_demand(tmp_path: Path) -> None:
    from contextlib import AsyncExitStack

    from agentloop.cli.chat import ChatRepl, ChatState, DurableSession, PlainReader

    brain = Brain()
    ev = asyncio.new_event_loop()
    stack = AsyncExitStack()
    err = io.StringIO()
    try:
        k = ev.run_until_complete(stack.enter_async_context(kernel(tmp_path, brain)))
        session = DurableSession(k, owner="me", cwd=tmp_path, state=ChatState(tmp_path / "chat.json"))
        ev.run_until_complete(session.open(new=True))
        lines = "".join(f"part {i}: {LONG}\n" for i in range(3))
        reader = PlainReader(io.StringIO(f"/compact\n{lines}/compact keep the part numbers\n/exit\n"))
        repl = ChatRepl(session, reader=reader, out=io.StringIO(), err=Console(file=err, width=200))
        assert repl.loop(ev) == 0
        messages = ev.run_until_complete(session.process.messages())
    finally:
        ev.run_until_complete(stack.aclose())
        ev.close()
    shown = err.getvalue()
    assert shown.count("nothing to compact") == 1
    assert "compacted: 4 messages summarised" in shown and "→" in shown
    assert is_summary(messages[0]) and "keep the part numbers" in brain.summaries[0].messages[-1].text


def test_remote_chat_compacts_on_demand(server: LiveServer) -> None:
    from agentloop.cli.chat import ChatRepl, PlainReader
    from agentloop.cli.client import RemoteSession
    from agentloop.client import AgentloopClient

    ev = asyncio.new_event_loop()
    client = AgentloopClient(server.url, server.tokens.bob)
    err = io.StringIO()
    try:
        session = RemoteSession(client)
        ev.run_until_complete(session.open(new=True))
        lines = "".join(f"part {i}: {LONG}\n" for i in range(3))
        reader = PlainReader(io.StringIO(f"{lines}/compact only the gist\n/exit\n"))
        repl = ChatRepl(session, reader=reader, out=io.StringIO(), err=Console(file=err, width=200))
        assert repl.loop(ev) == 0
        history = ev.run_until_complete(client.history(session.pid))["messages"]
    finally:
        ev.run_until_complete(client.aclose())
        ev.close()
    shown = err.getvalue()
    assert "compacted: 4 messages summarised" in shown and "→" in shown
    assert history[0]["message"]["kind"] == "summary"


def test_a_chat_in_memory_has_nothing_to_compact_durably() -> None:
    from agentloop import Agent
    from agentloop.cli.chat import ChatRepl, PlainReader

    err = io.StringIO()
    reader = PlainReader(io.StringIO("/compact\n/help\n/exit\n"))
    repl = ChatRepl(Agent(model=ScriptedModel(["hi"])), reader=reader, out=io.StringIO(), err=Console(file=err))
    assert repl.loop() == 0
    assert "no compaction" in err.getvalue() and "/compact" in err.getvalue()
