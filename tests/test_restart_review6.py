"""Restart review: what happens to the kernel's features (Delegate's replies, schedules, watches,
background jobs, subagents, titles) when the kernel stops, or crashes, at a bad moment, and is
opened again on the same database. Nothing lost, nothing done twice, nothing stuck."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, call, tool
from agentloop.kernel import Kernel, delegate, titles
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.api import approve_everything
from agentloop.process.background import JOBS_KEY
from agentloop.process.store import ProcessRecord
from agentloop.tools.shell import shell_tool
from tests.process_support import closed_gates, gate, kernel  # noqa: F401  (closed_gates: the autouse fixture)
from tests.test_delegate import _at_gate, _has_told, _kernel, _queued, _told, _until


async def test_a_dropped_delegated_tasks_reply_lost_to_a_crash_is_delivered_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target was busy, the task (``wait=false``) waited in its queue and was withdrawn; the
    kernel went down before the "not run" reply went out. The next start tells the caller, once,
    instead of leaving the reply owed for ever."""
    async with _kernel(tmp_path) as k:
        source = await k.spawn(owner="alice")
        target = await k.spawn(owner="alice")

        async def lost(self: Any, *args: Any) -> None:  # (a crash between the withdrawal and the reply)
            return None

        monkeypatch.setattr(delegate.Replies, "_deliver_dropped", lost)
        await target.send("busy r1")
        await _until(lambda: _at_gate(target))
        await source.send(f"delegate {target.pid} nowait -: plain")
        await source.wait_idle()
        await _until(lambda: _queued(target))
        assert len(await target.withdraw()) == 1
        gate("r1").set()
        await target.wait_idle()
        assert await _told(source) == []
        assert await k.store.kv_get(target.pid, delegate.DELEGATIONS_KEY)
    monkeypatch.undo()
    async with _kernel(tmp_path) as k:
        source = await k.process(source.pid)
        await _until(lambda: _has_told(source), 3)
        await source.wait_idle()
        told = await _told(source)
        owed = await k.store.kv_get(target.pid, delegate.DELEGATIONS_KEY)
    async with _kernel(tmp_path) as k:
        again = await _told(await k.process(source.pid))
    assert len(told) == 1 and "did not run the task" in told[0]
    assert owed is None
    assert again == told


async def test_a_title_a_crash_kept_from_being_written_is_made_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first run ended and its title was being made (a model asked, or the writer's batch
    waiting) when the kernel died: nothing was written. The next start names the process (from its
    first message: no model call at start-up), instead of leaving it a bare pid for ever; a
    process a person named, or that has no user message yet, is left as it is."""
    asked = asyncio.Event()

    async def slow_namer(record: ProcessRecord, text: str) -> str:
        asked.set()
        await asyncio.Event().wait()  # (the model is still thinking when the kernel dies)
        return "never"

    async def crash(self: titles.Titles) -> None:  # what a crash keeps of the titles in memory: nothing
        self.closing = True
        self.engine.hub.untap(self._heard)
        for task, _ in self.tasks.values():
            task.cancel()

    model = ScriptedModel(lambda r: "ok")
    async with kernel(tmp_path, model, titles=slow_namer) as k:
        monkeypatch.setattr(titles.Titles, "close", crash)
        proc = await k.spawn(owner="alice", text="Plan the billing migration\nmore")
        named = await k.spawn(owner="alice", text="something else")
        quiet = await k.spawn(owner="alice")
        await proc.wait_idle()
        await named.wait_idle()
        await asyncio.wait_for(asked.wait(), 3)
        await named.set_title("mine")
        await k.signal(quiet.pid, "a system event, no user message")
        await quiet.wait_idle()
    monkeypatch.undo()
    async with kernel(tmp_path, model, titles=slow_namer) as k:
        await _until(lambda: k.titles.of(proc.pid), 3)  # (the writer's batch, a moment later)
        got = [await (await k.process(p.pid)).title() for p in (proc, named, quiet)]
    assert got == ["Plan the billing migration", "mine", None]


async def test_a_background_job_of_a_subagent_an_abort_could_not_stop_before_a_crash_is_not_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parent's run was aborted, and the runtime died before the abort stopped what the run's
    subagent left running (a background command of a child that had answered). The next start
    ends that job without telling the child: its "did not finish" report would start a run of the
    child nobody reads, one that may even run the command again."""
    blocked = asyncio.Event()

    @tool
    async def block() -> str:
        """Wait."""
        blocked.set()
        await asyncio.sleep(30)
        return "never"

    def brain(r: ModelRequest) -> object:
        first = next(m.text for m in r.messages if m.role == "user")
        if first == "job":  # the child: a background command, then its answer
            if r.messages[-1].role == "user":
                return Reply(tool_calls=[call("Shell", command="sleep 20", background=True)])
            return "child: done"
        if r.messages[-1].role == "user":
            return Reply(tool_calls=[call("Task", prompt="job", wait=False)])
        return Reply(tool_calls=[call("block")]) if r.tools else "parent: done"

    def opened() -> Any:
        return Kernel.open(
            f"sqlite:///{tmp_path}/a.db",
            model=ScriptedModel(brain),
            workspace=tmp_path,
            tools=[block, shell_tool(tmp_path)],
            approval=approve_everything,
            subagents=True,
        )

    async with opened() as k:
        parent = await k.spawn(owner="a", text="hand it over")
        await asyncio.wait_for(blocked.wait(), 5)
        [child] = [r for r in await k.processes("a") if r.parent_pid == parent.pid]
        await (await k.process(child.pid)).wait_idle()
        assert await k.store.kv_get(child.pid, JOBS_KEY)

        async def cut_short(*args: Any) -> None:  # (the crash: the abort committed, its hook never ran)
            return None

        monkeypatch.setattr(k.engine, "aborted", cut_short)
        assert await parent.abort()
    async with opened() as k:
        await asyncio.sleep(0.1)
        proc = await k.process(child.pid)
        reasons = [s.payload["reason"] async for s in proc.signals(follow=False) if s.signal == sig.RUN_STARTED]
        jobs = await k.store.kv_get(child.pid, JOBS_KEY)
    assert reasons == ["proc.send"]
    assert jobs is None
