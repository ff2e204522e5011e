"""Hostile review of several workers on one PostgreSQL database (DESIGN §6), part 8: what a worker
that stops short leaves to the one that takes its processes over."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")

from agentloop import Reply, ScriptedModel, ToolResultMessage, UserMessage, call, tool
from agentloop.kernel.subagent_asks import SHOWN_KEY, SubagentAsks
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.signals import Signal
from tests.process_support import echo, ran
from tests.test_scale_out import two, worker
from tests.test_subagent_approvals import POLICY, _asked, brain


async def _copies(k: Any, pid: str) -> list[dict[str, Any]]:
    return [r.payload for r in await k.store.events(pid) if r.signal == sig.HIL_REQUESTED and "subagent" in r.payload]


async def _until(check: Callable[[], Any], seconds: float = 10) -> None:
    async with asyncio.timeout(seconds):
        while not await check():
            await asyncio.sleep(0.05)


@pytest.mark.timeout(60)
async def test_a_subagents_request_whose_worker_closed_before_its_copy_is_shown_by_the_worker_taking_over(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commits a child's approval request and closes before it copies it onto the conversation
    (as a crash in that window would). B, open all along, takes the child's run over: it makes the
    copy good then, once, instead of leaving it until a kernel next opens on the store."""
    ran.clear()
    lost: list[str] = []
    copy = SubagentAsks._copy

    async def losing_on_a(self: SubagentAsks, child: str, signal: Signal) -> None:
        if self.kernel.engine.leases is not None and self.kernel.engine.leases.owner == "A":
            lost.append(child)
            return
        await copy(self, child, signal)

    monkeypatch.setattr(SubagentAsks, "_copy", losing_on_a)
    model = ScriptedModel(brain)
    options: dict[str, Any] = {"subagents": True, "policy": POLICY, "approval_timeout": 3600}
    async with AsyncExitStack() as stack:
        b = await stack.enter_async_context(worker(pg_url, tmp_path, "B", model, [echo], **options))
        async with worker(pg_url, tmp_path, "A", model, [echo], **options) as a:
            parent = await a.spawn(owner="alice")
            await parent.send("delegate: hello")
            [ask] = await _asked(parent)
            await _until(lambda: asyncio.sleep(0, bool(lost)))
            assert await _copies(a, parent.pid) == []  # the window a crash leaves
        # A closed: its leases are free, B's sweep takes the child (and its parent) over
        await _until(lambda: _copies(b, parent.pid))
        await asyncio.sleep(0.5)  # (a second copy would come now)
        [shown] = await _copies(b, parent.pid)
        assert shown["requestId"] == ask.request_id and shown["subagent"] == ask.pid
        assert await b.store.kv_get(parent.pid, SHOWN_KEY) == {ask.request_id: ask.pid}
        proc = await b.process(parent.pid)
        assert await proc.hil(ask.request_id, "approve")
        async with asyncio.timeout(15):
            await proc.wait_idle()
        assert ran == ["hello"]
        assert (await proc.messages())[-1].text == "got: got: hello"


@pytest.mark.timeout(60)
async def test_an_abort_forwarded_while_the_holder_is_stopping_the_run_ends_it_once(
    pg_url: str, tmp_path: Path
) -> None:
    """The holder is already stopping the run (its tool unwinds slowly) when an abort of the same
    run comes from the other worker: the run ends once, its call with one cancelled result."""
    unwinding = asyncio.Event()

    @tool
    async def stubborn() -> str:
        """Wait, and take a while to stop."""
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            unwinding.set()
            await asyncio.sleep(0.6)
            raise
        return "never"

    def model(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        return Reply(tool_calls=[call("stubborn")]) if isinstance(last, UserMessage) else "done"

    async with two(pg_url, tmp_path, ScriptedModel(model), [stubborn]) as (a, b):
        pa = await a.spawn(owner="alice")
        pb = await b.process(pa.pid)
        run = await pa.send("go")
        await _until(lambda: _running(a, pa.pid))
        here = asyncio.create_task(pa.abort(run.run_id))  # the holder's own abort
        await asyncio.wait_for(unwinding.wait(), 5)
        assert await pb.abort(run.run_id)  # forwarded to the holder, which is stopping the run already
        assert await here
        await asyncio.sleep(0.3)
        msgs = await pa.messages()
        results = [m for m in msgs if isinstance(m, ToolResultMessage)]
        assert len(results) == 1 and "cancelled" in results[0].text, [m.text for m in msgs]
        finished = [s for s in [s async for s in pa.signals(follow=False)] if s.signal == sig.RUN_FINISHED]
        assert [s.payload["runId"] for s in finished] == [run.run_id]


@pytest.mark.timeout(60)
async def test_two_aborts_of_one_run_on_its_holder_end_it_once(pg_url: str, tmp_path: Path) -> None:
    """Both read the run's calls before either's transaction (a PostgreSQL query yields): the
    second must look again inside its transaction, and find the run over."""

    def model(req: ModelRequest) -> Reply | str:
        return Reply(tool_calls=[call("hang")]) if isinstance(req.messages[-1], UserMessage) else "done"

    @tool
    async def hang() -> str:
        """Wait for ever."""
        await asyncio.Event().wait()
        return "never"

    async with two(pg_url, tmp_path, ScriptedModel(model), [hang]) as (a, _b):
        proc = await a.spawn(owner="alice")
        run = await proc.send("go")
        await _until(lambda: _running(a, proc.pid))
        outcomes = await asyncio.gather(proc.abort(run.run_id), proc.abort(run.run_id), proc.abort())
        assert sorted(outcomes) == [False, False, True]
        results = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)]
        assert len(results) == 1 and "cancelled" in results[0].text
        finished = [s for s in [s async for s in proc.signals(follow=False)] if s.signal == sig.RUN_FINISHED]
        assert [s.payload["runId"] for s in finished] == [run.run_id]


async def _running(k: Any, pid: str) -> bool:
    live = k.engine.cached(pid)
    return live is not None and bool(live.tools)
