"""Follow-ups of the process races review: ``wait_idle`` on the worker holding the process waits for
queued input an abort is about to promote; a gentle stop forwarded to a holder that dies first is
honoured by the worker taking over; a tool whose result cannot be recorded (the database went away)
says so in one line; a delegate's reply checks the caller's conversation inside its delivery; a
send racing a kill leaves nothing running. Interleavings are forced with events, not sleeps."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, UserMessage, call
from agentloop.kernel import NoSuchProcess, delegate
from agentloop.models.base import ModelRequest
from agentloop.process import admission
from agentloop.process import signals as sig
from agentloop.process.tx import promoting
from tests.process_support import (
    closed_gates,  # noqa: F401  (the autouse fixture: no gate left closed)
    gate,
    gate_tool,
    kernel,
)
from tests.test_delegate import _kernel, _told
from tests.test_scale_out import worker

WAIT = 5.0


async def soon(what: Awaitable[Any]) -> Any:
    return await asyncio.wait_for(what, WAIT)


def gated(request: ModelRequest) -> Reply | str:
    """Input goes through the gate its text names, then an answer."""
    last = request.messages[-1]
    if isinstance(last, UserMessage):
        return Reply(tool_calls=[call("gate", name=last.text)])
    return "done"


async def _at_gate(k: Any, pid: str) -> None:
    async with asyncio.timeout(WAIT):
        while not (live := k.engine.cached(pid)) or not live.tools:
            await asyncio.sleep(0.01)


# -- 1. wait_idle on the holder waits for the promotion of queued input -----------------------------


async def test_wait_idle_does_not_return_while_an_abort_is_about_to_promote_queued_input(tmp_path: Path) -> None:
    gate("second").set()
    async with kernel(tmp_path, ScriptedModel(gated), tools=[gate_tool]) as k:
        proc = await k.spawn(owner="a")
        await proc.send("first")
        await _at_gate(k, proc.pid)
        queued = await proc.send("second", mode="queue")
        assert queued.queued
        entered, go = asyncio.Event(), asyncio.Event()
        hook = k.engine.aborted
        assert hook is not None

        async def slow_hook(pid: str, run_id: str, reason: str) -> None:
            entered.set()  # the run has ended (committed); its queued input is not promoted yet
            await go.wait()
            await hook(pid, run_id, reason)

        k.engine.aborted = slow_hook
        aborting = asyncio.create_task(proc.abort())
        await soon(entered.wait())
        waiter = asyncio.create_task(proc.wait_idle())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiter.done(), "wait_idle returned while queued input was about to start"
        go.set()
        assert await soon(aborting)
        await soon(waiter)
        record = await k.store.get_process(proc.pid)
        assert record is not None and record.current_run is None
        assert [m.text for m in await proc.messages()][-2:] == ["opened second", "done"]


# -- 4. a delegate's reply checks the caller's conversation inside its delivery ----------------------


async def test_wait_idle_returns_when_a_promotion_in_a_long_lived_task_ends(tmp_path: Path) -> None:
    """The leases' loop promotes what another worker queued, in its own task, which lives on:
    ``wait_idle`` waited for that task to end, for ever (1 in 3 runs of the two-worker delivery
    test hung), instead of for the promotion to end."""
    async with kernel(tmp_path, ScriptedModel(gated), tools=[gate_tool]) as k:
        proc = await k.spawn(owner="a")
        live = await k.engine.live(proc.pid)
        entered, done = asyncio.Event(), asyncio.Event()

        async def long_lived() -> None:
            with promoting(live):
                entered.set()
                await done.wait()
            await asyncio.Event().wait()  # (goes on, as the leases' loop does)

        looping = asyncio.create_task(long_lived())
        try:
            await soon(entered.wait())
            waiter = asyncio.create_task(proc.wait_idle())
            await asyncio.sleep(0.05)
            assert not waiter.done()  # (a promotion under way: not idle yet)
            done.set()
            await soon(waiter)
        finally:
            looping.cancel()


async def test_a_delegate_reply_racing_a_reset_of_its_caller_is_not_delivered_to_the_fresh_conversation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _kernel(tmp_path) as k:
        source = await k.spawn(owner="alice")
        target = await k.spawn(owner="alice")
        await source.send(f"delegate {target.pid} nowait -: gate g1")
        await source.wait_idle()
        answer = delegate.run_answer
        reset: list[bool] = []

        async def answering(store: Any, pid: str, rid: str) -> str:
            # the reply has checked the caller's conversation: a reset of the caller runs in full now
            if not reset:
                reset.append(True)
                await source.reset()
            return await answer(store, pid, rid)

        monkeypatch.setattr(delegate, "run_answer", answering)
        gate("g1").set()
        await soon(target.wait_idle())
        replies = delegate.replies_of(k)
        assert replies is not None
        await soon(replies.wait())
        await soon(source.wait_idle())
        assert reset
        told = await _told(source)
        owed = await k.store.kv_get(target.pid, delegate.DELEGATIONS_KEY)
    assert told == []  # the reply belonged to the conversation the reset ended
    assert owed is None  # and is not owed for ever


# -- 5. a send whose delivery commits as a kill begins ------------------------------------------------


async def test_a_send_committing_as_a_kill_begins_leaves_nothing_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with kernel(tmp_path, ScriptedModel(gated), tools=[gate_tool]) as k:
        proc = await k.spawn(owner="a")
        inside, go, settling = asyncio.Event(), asyncio.Event(), asyncio.Event()
        remember, settle = admission.remember_admission, k.engine.settle_deliveries

        async def remembering(*args: Any, **kw: Any) -> None:
            inside.set()  # inside the delivery's transaction, past its check, its run started in it
            await go.wait()
            await remember(*args, **kw)

        async def settling_deliveries() -> None:
            settling.set()  # the kill has marked the process, and waits for the delivery
            await settle()

        monkeypatch.setattr(admission, "remember_admission", remembering)
        monkeypatch.setattr(k.engine, "settle_deliveries", settling_deliveries)
        sending = asyncio.create_task(proc.send("x"))
        await soon(inside.wait())
        killing = asyncio.create_task(proc.kill(archive=False))
        await soon(settling.wait())
        go.set()
        try:
            receipt = await soon(sending)
        except NoSuchProcess:
            receipt = None
        await soon(killing)
        assert receipt is None or receipt.run_id  # delivered, then stopped with the process
        assert k.engine.cached(proc.pid) is None
        assert await k.store.get_process(proc.pid) is None
        with pytest.raises(NoSuchProcess):
            await soon(proc.wait_idle())
        with pytest.raises(NoSuchProcess):
            await soon(proc.send("again"))
        gate("x").set()
        await asyncio.sleep(0)
        assert not any(t.get_name().startswith("tool gate") and not t.done() for t in asyncio.all_tasks())


# -- several workers on PostgreSQL ---------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_a_stop_forwarded_to_a_holder_that_dies_ends_the_run_as_stopped(pg_url: str, tmp_path: Path) -> None:
    """B forwards a gentle stop to A, which dies before it acts on it: B, taking the run over,
    finishes it as stopped (one answer without tools), not as a plain end of turn."""
    model = ScriptedModel(gated)
    async with worker(pg_url, tmp_path, "B", model, [gate_tool]) as b:
        async with worker(pg_url, tmp_path, "A", model, [gate_tool]) as a:
            pa = await a.spawn(owner="alice")
            pb = await b.process(pa.pid)
            run = await pa.send("g")
            await _at_gate(a, pa.pid)
            leases = a.engine.leases
            assert leases is not None

            async def deaf(pid: str) -> None:  # A hears nothing more: it dies right after the request
                return None

            leases._look = deaf  # type: ignore[method-assign]
            assert await pb.stop() is True  # forwarded to A
        # A closed with the call under way: B takes the run over (the call re-runs or fails)
        gate("g").set()
        async with asyncio.timeout(20):
            await pb.wait_idle()
        events = [s async for s in pb.signals(follow=False)]
        end = [s.payload for s in events if s.signal == sig.RUN_FINISHED][-1]
        assert (end["runId"], end["status"], end["reason"]) == (run.run_id, "ok", "stopped")
        assert not model.requests[-1].tools  # the last answer was given without tools


@pytest.mark.timeout(60)
async def test_a_tool_whose_result_cannot_be_recorded_says_so_in_one_line(
    pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with worker(pg_url, tmp_path, "A", ScriptedModel(gated), [gate_tool]) as a:
        proc = await a.spawn(owner="alice")
        await proc.send("cut")
        await _at_gate(a, proc.pid)
        live = a.engine.cached(proc.pid)
        assert live is not None
        [task] = live.tools.values()
        a.store._pool.terminate()  # type: ignore[attr-defined]  (the connection is cut)
        gate("cut").set()
        await asyncio.wait([task], timeout=WAIT)
        assert task.done()
        del task, live
        gc.collect()
        await asyncio.sleep(0)
        lines = [r for r in caplog.records if "could not be recorded" in r.getMessage() or "result" in r.getMessage()]
        assert "never retrieved" not in caplog.text
        assert any("gate" in r.getMessage() and r.exc_info is None for r in lines), caplog.text
