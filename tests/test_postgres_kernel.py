"""Durable processes end to end on PostgreSQL: ``Kernel.open("postgresql://…")`` runs tool turns,
takes steer and queued input, keeps an approval across a restart of the kernel, and resumes a run
that a "crash" (closing the kernel mid-run) interrupted. The SIGKILL version of the crash is in
``test_crash_resume.py``; the store contract itself in ``store_conformance``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Approval, Kernel
from agentloop.kernel.schedules import ScheduleError
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.store import StoreError, open_store
from agentloop.process.store.postgres import PostgresStore
from tests.process_support import echo, ran, slow


def pg_kernel(url: str, tmp_path: Path, model: Any, **kw: Any) -> Any:
    kw.setdefault("tools", [echo, slow])
    return Kernel.open(url, model=model, workspace=tmp_path, data_dir=tmp_path, **kw)


def by_tool_results(req: ModelRequest) -> Reply | str:
    last = req.messages[-1]
    if isinstance(last, UserMessage):
        return Reply(tool_calls=[call("echo", text=last.text)])
    return "answer: " + [m.text for m in req.messages if isinstance(m, ToolResultMessage)][-1]


async def test_a_tool_turn_runs_on_postgres_and_is_stored_there(pg_url: str, tmp_path: Path) -> None:
    ran.clear()
    async with pg_kernel(pg_url, tmp_path, ScriptedModel(by_tool_results)) as k:
        assert isinstance(k.store, PostgresStore)
        proc = await k.spawn(owner="alice")
        receipt = await proc.send("hello")
        await proc.wait_idle()
        assert ran == ["hello"]
        pid = proc.pid
    # what a fresh store (no kernel, no cache) reads back from the database
    store = open_store(pg_url)
    await store.open()
    try:
        msgs = [m.message for m in await store.history(pid)]
        assert [m.role for m in msgs] == ["user", "assistant", "toolResult", "assistant"]
        assert msgs[-1].text == "answer: hello"
        events = await store.events(pid)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))  # gap-free log
        names = [e.signal for e in events]
        assert names[0] == "proc.run.started" and names[-1] == "proc.run.finished"
        assert events[-1].payload["runId"] == receipt.run_id and events[-1].payload["status"] == "ok"
        record = await store.get_process(pid)
        assert record is not None and record.state == "idle" and record.current_run is None
        assert await store.calls(pid) == [] and await store.queue(pid) == []
    finally:
        await store.close()


async def test_spawn_with_a_first_message_on_postgres(pg_url: str, tmp_path: Path) -> None:
    """On a shared store the first message is delivered like a send (a worker claims the process)."""
    ran.clear()
    async with pg_kernel(pg_url, tmp_path, ScriptedModel(by_tool_results)) as k:
        proc = await k.spawn(owner="alice", text="first", run_id="pg-first")
        assert proc.started is not None and proc.started.run_id == "pg-first"
        await proc.wait_idle()
        assert ran == ["first"] and (await proc.messages())[-1].text == "answer: first"
        # promoted from the queue by the claiming worker, the run still says why it started
        started = [s async for s in proc.signals(follow=False) if s.signal == sig.RUN_STARTED]
        assert [s.payload["reason"] for s in started] == ["proc.send"]
        again = await proc.send("first", run_id="pg-first")
        await proc.wait_idle()
        assert again.run_id == "pg-first" and ran == ["first"]
        assert [m.text for m in await proc.messages() if isinstance(m, UserMessage)] == ["first"]


async def test_a_spawn_stores_its_process_and_first_message_together(pg_url: str, tmp_path: Path) -> None:
    """On a shared store the first message is stored with the process, as input for whichever
    worker claims it: when the spawning worker's own claim fails after the commit, the process
    waits with its message, the sweep runs it, and a retry gets the receipt without a second
    delivery."""
    ran.clear()
    async with pg_kernel(pg_url, tmp_path, ScriptedModel(by_tool_results), poll_interval=0.2) as k:
        assert k.engine.leases is not None
        claim = k.engine.leases.hold

        async def failing(pid: str) -> bool:
            raise StoreError("the database went away")

        k.engine.leases.hold = failing  # type: ignore[method-assign]
        made = await k.spawn(owner="alice", pid="stored", text="first", run_id="r-1")  # stored: the receipt
        k.engine.leases.hold = claim  # type: ignore[method-assign]
        retried = await k.spawn(owner="alice", pid="stored", text="first", run_id="r-1")
        assert made.started == retried.started and retried.started is not None and retried.started.run_id == "r-1"
        async with asyncio.timeout(10):  # the sweep claims the process with waiting input
            while ran != ["first"] or (await retried.info()).state != "idle":
                await asyncio.sleep(0.05)
        assert [m.text for m in await retried.messages() if isinstance(m, UserMessage)] == ["first"]
        started = [s async for s in retried.signals(follow=False) if s.signal == "proc.run.started"]
        assert [s.payload["runId"] for s in started] == ["r-1"]
        with pytest.raises(StoreError):  # another message for that pid: a clash
            await k.spawn(owner="alice", pid="stored", text="again", run_id="r-2")
        assert ran == ["first"]


async def test_steer_and_queue_on_postgres(pg_url: str, tmp_path: Path) -> None:
    def brain(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if isinstance(last, UserMessage) and last.text == "start":
            return Reply(tool_calls=[call("slow", seconds=0.3)])
        return f"re: {last.text}"

    model = ScriptedModel(brain)
    async with pg_kernel(pg_url, tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        first = await proc.send("start")
        await asyncio.sleep(0.1)  # the slow tool is running
        steer = await proc.send("also this", mode="steer")
        queued = await proc.send("afterwards", mode="queue")
        assert steer.queued and steer.run_id == first.run_id
        assert queued.queued and queued.run_id != first.run_id
        await proc.wait_idle()
        # the steer went in at the tool-result boundary, before the run's next model call
        assert model.requests[1].messages[-1].text == "also this"
        texts = [m.text for m in await proc.messages()]
        assert texts == ["start", "", "slept 0.3", "also this", "re: also this", "afterwards", "re: afterwards"]
        finished = [e.payload["runId"] for e in await k.store.events(proc.pid) if e.signal == "proc.run.finished"]
        assert finished == [first.run_id, queued.run_id]


async def asking_policy(process: object, row: Any) -> Approval:
    if row.tool_name == "echo" and row.args.get("text") == "risky":
        return Approval("ask", ("destructive",), "echo of something risky", fingerprint=json.dumps(row.args))
    return Approval("auto")


async def test_an_approval_survives_closing_and_reopening_the_kernel(pg_url: str, tmp_path: Path) -> None:
    ran.clear()

    def brain(req: ModelRequest) -> Reply | str:
        if isinstance(req.messages[-1], UserMessage):
            return Reply(tool_calls=[call("echo", text="safe"), call("echo", text="risky")])
        return "done: " + " | ".join(m.text for m in req.messages if isinstance(m, ToolResultMessage))

    async with pg_kernel(pg_url, tmp_path, ScriptedModel(brain), approval=asking_policy) as k:
        proc = await k.spawn(owner="a")
        await proc.send("do it")
        for _ in range(500):
            if await proc.pending_approvals():
                break
            await asyncio.sleep(0.01)
        [asked] = await proc.pending_approvals()
        pid, asked_id = proc.pid, asked.request_id
        for _ in range(500):  # the safe sibling's result is being stored meanwhile: let it land first
            if [c.status for c in await k.store.calls(pid)] == ["completed", "registered"]:
                break
            await asyncio.sleep(0.01)
        assert [(c.args, c.status) for c in await k.store.calls(pid)] == [
            ({"text": "safe"}, "completed"),
            ({"text": "risky"}, "registered"),
        ]
        assert ran == ["safe"]
    assert ran == ["safe"]  # nothing ran while the kernel was down
    async with pg_kernel(pg_url, tmp_path, ScriptedModel(brain), approval=asking_policy) as k2:
        proc = await k2.process(pid)
        [still] = await proc.pending_approvals()
        assert still.request_id == asked_id and still.args == {"text": "risky"}
        assert (await proc.info()).current_run is not None
        await proc.hil(asked_id, "approve")
        await proc.wait_idle()
        assert ran == ["safe", "risky"]  # the approved call ran once; its approved sibling did not re-run
        assert (await proc.messages())[-1].text == "done: safe | risky"
        assert await proc.pending_approvals() == []


async def test_a_run_interrupted_by_closing_the_kernel_resumes_on_reopen(pg_url: str, tmp_path: Path) -> None:
    calls: list[str] = []

    @tool(idempotent=True)
    async def lookup(key: str) -> str:
        """Read-only lookup."""
        calls.append(f"lookup {key}")
        await asyncio.sleep(0.5 if len(calls) == 1 else 0)
        return f"value of {key}"

    @tool
    async def charge(amount: int) -> str:
        """Charge a card (not idempotent)."""
        calls.append(f"charge {amount}")
        await asyncio.sleep(5)
        return "charged"

    def brain(r: ModelRequest) -> Reply | str:
        if isinstance(r.messages[-1], UserMessage):
            return Reply(tool_calls=[call("lookup", key="k"), call("charge", amount=5)])
        return "done: " + " | ".join(m.text for m in r.messages if isinstance(m, ToolResultMessage))

    async with pg_kernel(pg_url, tmp_path, ScriptedModel(brain), tools=[lookup, charge]) as k:
        proc = await k.spawn(owner="a")
        await proc.send("pay")
        await asyncio.sleep(0.2)  # both calls are dispatched; the "crash" comes now
        pid = proc.pid
        assert {c.status for c in await k.store.calls(pid)} == {"dispatched"}
    async with pg_kernel(pg_url, tmp_path, ScriptedModel(brain), tools=[lookup, charge]) as k2:
        proc = await k2.process(pid)
        await proc.wait_idle()
        final = (await proc.messages())[-1].text
        assert final.startswith("done: value of k | Tool call interrupted by a restart")
        assert calls.count("charge 5") == 1 and calls.count("lookup k") == 2


async def test_two_concurrent_sends_with_one_run_id_deliver_once(pg_url: str, tmp_path: Path) -> None:
    """The duplicate check runs inside the delivery's transaction: on PostgreSQL the early read
    can yield, and two retries of one delivery both passed it (two user messages, two runs)."""
    async with pg_kernel(pg_url, tmp_path, ScriptedModel(lambda r: "hi")) as k:
        proc = await k.spawn(owner="alice")
        first, second = await asyncio.gather(proc.send("hello", run_id="d1"), proc.send("hello", run_id="d1"))
        await proc.wait_idle()
        users = [m for m in await proc.messages() if isinstance(m, UserMessage)]
    assert first == second and first.run_id == "d1"
    assert len(users) == 1


async def test_concurrent_adds_respect_the_limits_and_the_cycle_check(pg_url: str, tmp_path: Path) -> None:
    """A review: on PostgreSQL concurrent requests each counted before any inserted (300
    schedules against a limit of 100), and A->B with B->A made together formed a loop that ran
    forever."""
    from agentloop.kernel.schedules import MAX_SCHEDULES
    from agentloop.kernel.watches import WatchError

    async with pg_kernel(pg_url, tmp_path, ScriptedModel(lambda r: "ok"), tools=[]) as k:
        p = await k.spawn(owner="alice")
        made = await asyncio.gather(
            *(k.schedule(p.pid, "tick", at=4e9) for _ in range(MAX_SCHEDULES + 20)), return_exceptions=True
        )
        assert sum(isinstance(r, str) for r in made) == MAX_SCHEDULES == len(await k.schedules(p.pid))
        a, b = await k.spawn(owner="alice"), await k.spawn(owner="alice")
        both = await asyncio.gather(
            k.watch(a.pid, b.pid, once=False), k.watch(b.pid, a.pid, once=False), return_exceptions=True
        )
        assert sum(isinstance(r, str) for r in both) == 1 and sum(isinstance(r, WatchError) for r in both) == 1


async def test_text_with_a_nul_character_is_refused_before_it_reaches_a_text_column(
    pg_url: str, tmp_path: Path
) -> None:
    """PostgreSQL's text type cannot hold U+0000: a spawn context or a schedule's text or name with
    one is a clear ValueError (a 400 over HTTP), as on SQLite, not a database error mid-commit.
    (Message text goes into JSON, where it is escaped, so it is kept.)"""
    async with pg_kernel(pg_url, tmp_path, ScriptedModel(lambda req: "ok")) as k:
        with pytest.raises(ValueError, match="NUL"):
            await k.spawn(owner="alice", context="rules\x00more")
        proc = await k.spawn(owner="alice")
        for text, name in (("check\x00it", None), ("check it", "daily\x00")):
            with pytest.raises(ScheduleError, match="NUL"):
                await k.schedule(proc.pid, text, every=60, name=name)
        await proc.send("a\x00b")
        await proc.wait_idle()
        assert [m.text for m in await proc.messages()] == ["a\x00b", "ok"]
        assert [r.pid for r in await k.processes("alice")] == [proc.pid]
