"""Races between what starts a run (user input, system events, a claimed schedule, the queue's
promotion) or takes input (withdraw) and a reset or compaction of the process. Each interleaving
is forced at patched points with events, not sleeps. A run must never outlive a reset that
began before it started (its tool results would open the fresh history), nor run under a
compaction; queued input is archived by the reset or withdrawn, never both."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, call, tool
from agentloop.kernel import Kernel, Process, RunActive
from agentloop.messages import Message, SystemMessage, UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process import admission
from agentloop.process import engine as engine_module
from agentloop.process.api import Compacted
from tests.process_support import (
    assert_valid,
    closed_gates,  # noqa: F401  (the autouse fixture: no gate left closed)
    gate,
    kernel,
)

WAIT = 5.0  # seconds any one step may take before the test fails instead of hanging

entered: dict[str, asyncio.Event] = {}


def at_door(name: str) -> asyncio.Event:
    return entered.setdefault(name, asyncio.Event())


@pytest.fixture(autouse=True)
def _doors() -> None:
    entered.clear()


@tool(name="door")
async def door(name: str) -> str:
    """Wait at the door the test opens."""
    at_door(name).set()
    await gate(name).wait()
    return f"through {name}"


def brain(request: ModelRequest) -> Reply | str:
    """Each input (a user message or an event) goes through the door its text names; then an answer."""
    last = request.messages[-1]
    if isinstance(last, UserMessage | SystemMessage):
        return Reply(tool_calls=[call("door", name=last.text)])
    return "done"


def texts(messages: list[Message]) -> list[str]:
    return [m.text for m in messages if isinstance(m, UserMessage | SystemMessage)]


async def soon(what: Awaitable[Any]) -> Any:
    return await asyncio.wait_for(what, WAIT)


async def first_of(*waits: Awaitable[Any]) -> None:
    """Until the first of ``waits`` is over (the others are left running, or cancelled if they are
    only waits on an event)."""
    tasks = [w if isinstance(w, asyncio.Task) else asyncio.ensure_future(w) for w in waits]
    done, pending = await asyncio.wait(tasks, timeout=WAIT, return_when=asyncio.FIRST_COMPLETED)
    assert done, "nothing moved"
    for task in pending:
        if task not in waits:
            task.cancel()


class Clearing:
    """Hooks into a reset: ``before_abort`` once it has read the queue it archives and is about
    to stop the run (which waits for ``abort_go``), ``past_abort`` once it has looked for the run
    to stop; ``settling``
    once it waits for the transactions under way; its archive waits for ``go``. ``waiting``:
    a delivery found a clearing under way and waits for it to end."""

    def __init__(self, k: Kernel, monkeypatch: pytest.MonkeyPatch) -> None:
        self.before_abort = asyncio.Event()
        self.abort_go = asyncio.Event()  # (set: the reset's abort goes on at once unless a test clears it)
        self.abort_go.set()
        self.past_abort = asyncio.Event()
        self.settling = asyncio.Event()
        self.go = asyncio.Event()
        self.waiting = asyncio.Event()
        self.archived: list[Message] = []  # the queued input the reset archived
        abort, archive, settle, after = k.engine.abort, k._archive, k.engine.settle_deliveries, admission.after_clearing

        async def aborting(pid: str, run_id: str | None = None, *, reason: str = "user") -> bool:
            if reason == "process.reset":
                self.before_abort.set()
                await self.abort_go.wait()
            stopped = await abort(pid, run_id, reason=reason)
            if reason == "process.reset":
                self.past_abort.set()
            return stopped

        async def archiving(record: Any, reason: str, history: list[Message], queued: list[Message]) -> Any:
            self.archived += queued
            await self.go.wait()
            return await archive(record, reason, history, queued)

        async def settling() -> None:
            self.settling.set()
            await settle()

        async def after_clearing(engine: Any, pid: str) -> None:
            if pid in engine.clearing:
                self.waiting.set()
            await after(engine, pid)

        monkeypatch.setattr(k.engine, "abort", aborting)
        monkeypatch.setattr(k, "_archive", archiving)
        monkeypatch.setattr(k.engine, "settle_deliveries", settling)
        monkeypatch.setattr(admission, "after_clearing", after_clearing)


def pause_live(k: Kernel, monkeypatch: pytest.MonkeyPatch, task_name: str) -> tuple[asyncio.Event, asyncio.Event]:
    """The task named ``task_name`` stops at its first ``engine.live`` (after it waited out any
    clearing, before its transaction) until ``resume`` is set; ``paused`` says it got there."""
    paused, resume = asyncio.Event(), asyncio.Event()
    live = k.engine.live

    async def pausing(pid: str) -> Any:
        task = asyncio.current_task()
        if task is not None and task.get_name() == task_name and not paused.is_set():
            paused.set()
            await resume.wait()
        return await live(pid)

    monkeypatch.setattr(k.engine, "live", pausing)
    return paused, resume


async def run_at_door(proc: Process, text: str) -> None:
    await proc.send(text)
    await soon(at_door(text).wait())


async def settled_history(proc: Process) -> list[Message]:
    await soon(proc.wait_idle())
    messages = await proc.messages()
    assert_valid(messages)
    return messages


async def test_an_interrupt_whose_abort_lets_a_reset_in_runs_after_the_reset(tmp_path, monkeypatch):
    gate("second").set()
    async with kernel(tmp_path, ScriptedModel(brain), tools=[door]) as k:
        proc = await k.spawn(owner="a")
        await run_at_door(proc, "first")
        clearing = Clearing(k, monkeypatch)
        resets: list[asyncio.Task[Any]] = []
        abort = k.engine.abort

        async def aborting(pid: str, run_id: str | None = None, *, reason: str = "user") -> bool:
            stopped = await abort(pid, run_id, reason=reason)
            if reason == "user.interrupt":  # the run is stopped: a reset begins, and gets past its abort
                resets.append(asyncio.create_task(proc.reset()))
                await soon(clearing.past_abort.wait())
            return stopped

        monkeypatch.setattr(k.engine, "abort", aborting)
        sending = asyncio.create_task(proc.send("second", mode="interrupt"))
        await first_of(sending, clearing.waiting.wait())  # the run started, or the input waits
        clearing.go.set()
        await soon(resets[0])
        receipt = await soon(sending)
        messages = await settled_history(proc)
        assert texts(messages) == ["second"] and isinstance(messages[0], UserMessage), messages
        assert [m.run_id for m in await proc.history()] == [receipt.run_id] * len(messages)


async def test_a_reset_that_begins_while_a_delivery_commits_stops_the_run_it_started(tmp_path, monkeypatch):
    async with kernel(tmp_path, ScriptedModel(brain), tools=[door]) as k:
        proc = await k.spawn(owner="a")
        clearing = Clearing(k, monkeypatch)
        inside, go = asyncio.Event(), asyncio.Event()
        remember = admission.remember_admission

        async def remembering(*args: Any, **kw: Any) -> None:
            inside.set()  # inside the delivery's transaction, past its check, the run started in it
            await go.wait()
            await remember(*args, **kw)

        monkeypatch.setattr(admission, "remember_admission", remembering)
        sending = asyncio.create_task(proc.send("x"))
        await soon(inside.wait())
        resetting = asyncio.create_task(proc.reset())
        # the reset waits for the delivery's transaction, or (before) looks for the run at once
        await first_of(clearing.settling.wait(), clearing.past_abort.wait())
        go.set()
        clearing.go.set()
        await soon(sending)
        await soon(resetting)
        gate("x").set()
        assert await settled_history(proc) == []  # the run was the cleared conversation's: stopped
        record = await k.store.get_process(proc.pid)
        assert record is not None and record.current_run is None


async def test_a_compaction_that_begins_while_a_delivery_commits_finds_the_run(tmp_path, monkeypatch):
    async with kernel(tmp_path, ScriptedModel(brain), tools=[door]) as k:
        proc = await k.spawn(owner="a")
        summarised = asyncio.Event()

        async def summarise(*args: Any) -> tuple[Compacted, None]:
            summarised.set()
            return Compacted(False, "summarised while a run was active"), None

        monkeypatch.setattr(engine_module, "summarise", summarise)
        inside, go, settling = asyncio.Event(), asyncio.Event(), asyncio.Event()
        remember, settle = admission.remember_admission, k.engine.settle_deliveries

        async def remembering(*args: Any, **kw: Any) -> None:
            inside.set()
            await go.wait()
            await remember(*args, **kw)

        async def settled() -> None:
            settling.set()
            await settle()

        monkeypatch.setattr(admission, "remember_admission", remembering)
        monkeypatch.setattr(k.engine, "settle_deliveries", settled)
        sending = asyncio.create_task(proc.send("x"))
        await soon(inside.wait())
        compacting = asyncio.create_task(proc.compact())
        await first_of(settling.wait(), summarised.wait())
        go.set()
        await soon(sending)
        with pytest.raises(RunActive):
            await soon(compacting)
        assert not summarised.is_set()
        gate("x").set()
        assert texts(await settled_history(proc)) == ["x"]


async def test_a_system_event_on_its_way_when_a_reset_begins_runs_after_it(tmp_path, monkeypatch):
    gate("event").set()
    async with kernel(tmp_path, ScriptedModel(brain), tools=[door]) as k:
        proc = await k.spawn(owner="a")
        clearing = Clearing(k, monkeypatch)
        paused, resume = pause_live(k, monkeypatch, "deliver")
        signalling = asyncio.create_task(k.signal(proc.pid, "event"), name="deliver")
        await soon(paused.wait())
        resetting = asyncio.create_task(proc.reset())
        await soon(clearing.past_abort.wait())  # the reset found no run to stop
        resume.set()
        await first_of(signalling, clearing.waiting.wait())
        clearing.go.set()
        await soon(resetting)
        receipt = await soon(signalling)
        messages = await settled_history(proc)
        assert texts(messages) == ["event"] and isinstance(messages[0], SystemMessage), messages
        assert {m.run_id for m in await proc.history()} == {receipt.run_id}


async def test_a_schedule_firing_when_a_reset_begins_is_dropped_with_it(tmp_path, monkeypatch):
    gate("tick").set()
    async with kernel(tmp_path, ScriptedModel(brain), tools=[door]) as k:
        proc = await k.spawn(owner="a")
        await k.schedule(proc.pid, "tick", at=time.time() + 3600)  # (fired by the test, not the clock)
        (row,) = await k.schedules(proc.pid)
        clearing = Clearing(k, monkeypatch)
        paused, resume = pause_live(k, monkeypatch, "deliver")
        firing = asyncio.create_task(k.scheduler._fire(row, time.time()), name="deliver")
        await soon(paused.wait())
        resetting = asyncio.create_task(proc.reset())
        await soon(clearing.past_abort.wait())
        resume.set()
        await first_of(firing, clearing.waiting.wait())
        clearing.go.set()
        await soon(resetting)
        await soon(firing)
        # the reset dropped the schedule: its claim, rolled back and tried again after it, fails
        assert await settled_history(proc) == []
        assert await k.schedules(proc.pid) == []


async def test_a_promotion_under_way_when_a_reset_begins_starts_nothing(tmp_path, monkeypatch):
    async with kernel(tmp_path, ScriptedModel(brain), tools=[door]) as k:
        proc = await k.spawn(owner="a")
        await run_at_door(proc, "first")
        await proc.send("queued", mode="queue")
        clearing = Clearing(k, monkeypatch)
        paused, resume = asyncio.Event(), asyncio.Event()
        promoter: list[asyncio.Task[Any]] = []
        queue = k.store.queue

        async def reading(pid: str) -> Any:
            if sys._getframe(1).f_code.co_name == "promote" and not paused.is_set():
                task = asyncio.current_task()
                assert task is not None
                promoter.append(task)
                paused.set()  # past the promotion's first look for a clearing
                await resume.wait()
            return await queue(pid)

        monkeypatch.setattr(k.store, "queue", reading)
        gate("first").set()  # the run ends, and its driver promotes the queued input
        await soon(paused.wait())
        resetting = asyncio.create_task(proc.reset())
        await soon(clearing.past_abort.wait())  # nothing to stop: the first run is over
        resume.set()
        await soon(promoter[0])  # (the driver: done once its run, if it started one, waits at the door)
        clearing.go.set()
        await soon(resetting)
        gate("queued").set()
        assert await settled_history(proc) == []
        assert texts(clearing.archived) == ["queued"]  # discarded, and kept in the reset's archive
        assert await proc.queued() == []


async def test_a_withdrawal_on_its_way_when_a_reset_begins_takes_nothing_the_reset_archived(tmp_path, monkeypatch):
    async with kernel(tmp_path, ScriptedModel(brain), tools=[door]) as k:
        proc = await k.spawn(owner="a")
        await run_at_door(proc, "first")
        await proc.send("queued", mode="queue")
        clearing = Clearing(k, monkeypatch)
        paused, resume = pause_live(k, monkeypatch, "deliver")
        withdrawing = asyncio.create_task(proc.withdraw(), name="deliver")
        await soon(paused.wait())
        clearing.abort_go.clear()
        resetting = asyncio.create_task(proc.reset())
        await soon(clearing.before_abort.wait())  # it read the queue it archives (its abort drops it)
        resume.set()
        await first_of(withdrawing, clearing.waiting.wait())
        clearing.abort_go.set()
        clearing.go.set()
        await soon(resetting)
        withdrawn = await soon(withdrawing)
        assert texts(clearing.archived) == ["queued"]
        assert withdrawn == []  # archived and discarded by the reset: not in this answer too
        assert await settled_history(proc) == []


async def test_a_caller_run_id_is_at_most_128_characters_as_in_the_server_api(tmp_path):
    async with kernel(tmp_path, ScriptedModel(lambda request: "hi")) as k:
        proc = await k.spawn(owner="a")
        long = "r" * 100_000
        with pytest.raises(ValueError, match="run_id must be at most 128 characters, got 100000"):
            await proc.send("hello", run_id=long)
        with pytest.raises(ValueError, match="at most 128 characters, got 129"):
            await proc.send("hello", run_id="r" * 129)
        with pytest.raises(ValueError, match="at most 128 characters"):
            await k.signal(proc.pid, "event", run_id=long)
        with pytest.raises(ValueError, match="at most 128 characters"):
            await k.spawn(owner="a", text="hello", run_id=long)
        with pytest.raises(ValueError, match="at most 128 characters"):
            await proc.abort(long)
        with pytest.raises(ValueError, match="at most 128 characters"):
            await proc.stop(long)
        assert await proc.history() == [] and len(await k.processes()) == 1
        receipt = await proc.send("hello", run_id="r" * 128)
        assert receipt.run_id == "r" * 128
        await proc.wait_idle()
        assert [m.run_id for m in await proc.history()] == ["r" * 128] * 2
