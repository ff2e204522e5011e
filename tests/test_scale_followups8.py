"""Follow-ups of the several-workers reviews, on PostgreSQL with two workers: a gentle stop that the
holder took is not lost when the holder dies before it marked the run (taking the request and the
mark are one transaction); a delegate's reply delivered through the other worker while the
caller's holder resets it never reaches the fresh conversation, neither during the reset (its
archive) nor at its commit (the delivery locks the caller's row)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agentloop import ScriptedModel
from agentloop.kernel import Kernel, delegate
from agentloop.process import signals as sig
from agentloop.process.lease import ABORT_KEY
from tests.process_support import (
    closed_gates,  # noqa: F401  (the autouse fixture: no gate left closed)
    gate,
    gate_tool,
)
from tests.test_process_followups8 import _at_gate, gated
from tests.test_scale_out import archiving as archiving_fixture
from tests.test_scale_out import kept_by, two, worker

archiving = archiving_fixture  # (the fixture: a reset's archive takes a second)

RID = "delegate:0123456789abcdef01234567"  # a delegated run of the target's (as ``delegated_run_id`` makes)


@pytest.mark.timeout(60)
async def test_a_stop_taken_by_a_holder_that_dies_before_marking_the_run_ends_it_as_stopped(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B forwards a gentle stop; A takes the request from the store and dies before it could mark
    the run in a transaction of its own. B, taking the run over, still ends it as stopped."""
    model = ScriptedModel(gated)
    async with worker(pg_url, tmp_path, "B", model, [gate_tool]) as b:
        async with worker(pg_url, tmp_path, "A", model, [gate_tool]) as a:
            pa = await a.spawn(owner="alice")
            pb = await b.process(pa.pid)
            run = await pa.send("g")
            await _at_gate(a, pa.pid)

            async def dead(*args: Any, **kwargs: Any) -> bool:  # A does nothing more once it took the request
                raise RuntimeError("worker A died")

            monkeypatch.setattr(a.engine, "stop", dead)
            monkeypatch.setattr(a.engine, "_ask_to_stop", dead)
            assert await pb.stop() is True  # forwarded to A
            async with asyncio.timeout(10):
                while await b.store.kv_get(pa.pid, ABORT_KEY) is not None:  # A took it
                    await asyncio.sleep(0.02)
        # A closed with the call under way: B takes the run over
        gate("g").set()
        async with asyncio.timeout(20):
            await pb.wait_idle()
        events = [s async for s in pb.signals(follow=False)]
        end = [s.payload for s in events if s.signal == sig.RUN_FINISHED][-1]
        assert (end["runId"], end["status"], end["reason"]) == (run.run_id, "ok", "stopped")
        assert not model.requests[-1].tools  # the last answer was given without tools


async def _owed_reply(a: Kernel, b: Kernel) -> tuple[str, str]:
    """A caller with a conversation, held by A, and a target that owes it a reply (as a
    ``Delegate`` call with ``wait=false`` leaves it); returns their pids."""
    source = await a.spawn(owner="alice")
    target = await a.spawn(owner="alice")
    await source.send("before")
    await source.wait_idle()
    await kept_by(a, source.pid)
    record = await a.store.get_process(source.pid)
    assert record is not None
    owed = {RID: {"source": source.pid, "generation": record.history_generation, "run_id": None, "after": 0}}
    async with a.store.transaction():
        await a.store.kv_set(target.pid, delegate.DELEGATIONS_KEY, owed)
    return source.pid, target.pid


async def _fresh(k: Kernel, pid: str) -> None:
    """The caller's conversation after its reset: empty, nothing queued, no reply owed any more."""
    await asyncio.sleep(0.5)  # (a promotion of what the reset kept would have begun)
    async with asyncio.timeout(10):
        await (await k.process(pid)).wait_idle()
    assert [m.text for m in await (await k.process(pid)).messages()] == []
    assert await k.store.queue(pid) == []


FINISHED = {"status": "ok", "reason": "end_turn"}


@pytest.mark.timeout(60)
async def test_a_reply_delivered_through_the_other_worker_during_the_callers_reset_is_dropped(
    pg_url: str, tmp_path: Path, archiving: asyncio.Event
) -> None:
    """While A archives the caller's conversation, B delivers the reply (it checked the caller's
    committed conversation, still the old one): the item it queues for A belongs to the
    conversation being reset, and the reset drops it instead of starting the fresh one with it."""
    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "ok"), [], subagents=True) as (a, b):
        source, target = await _owed_reply(a, b)
        replies = delegate.replies_of(b)
        assert replies is not None
        resetting = asyncio.create_task((await a.process(source)).reset())
        await asyncio.wait_for(archiving.wait(), 10)
        await replies.deliver(target, RID, FINISHED)  # queued for A (checked against the old conversation)
        await asyncio.wait_for(resetting, 20)
        await _fresh(a, source)
        assert await a.store.kv_get(target, delegate.DELEGATIONS_KEY) is None  # owed no more


@pytest.mark.timeout(60)
async def test_a_reply_delivered_through_the_other_worker_as_the_callers_reset_commits_is_dropped(
    pg_url: str, tmp_path: Path
) -> None:
    """B's delivery checks the caller's conversation after A's reset transaction has read the queue
    it discards, and before it commits: the delivery waits for the reset (the caller's row is
    locked) and then finds the fresh conversation, so nothing is delivered to it."""
    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "ok"), [], subagents=True) as (a, b):
        source, target = await _owed_reply(a, b)
        replies = delegate.replies_of(b)
        assert replies is not None
        in_reset = asyncio.Event()
        delivering: list[asyncio.Task[bool]] = []
        real_prune = a.store.prune_events

        async def pruning(pid: str, *args: Any, **kwargs: Any) -> Any:
            if pid == source and not in_reset.is_set():  # inside the reset's transaction, its queue read
                in_reset.set()
                while not delivering:
                    await asyncio.sleep(0.01)
                await asyncio.wait(delivering, timeout=1.0)  # B's delivery commits now, or waits for this one
            return await real_prune(pid, *args, **kwargs)

        a.store.prune_events = pruning  # type: ignore[method-assign]
        resetting = asyncio.create_task((await a.process(source)).reset())
        await asyncio.wait_for(in_reset.wait(), 10)
        delivering.append(asyncio.create_task(replies.deliver(target, RID, FINISHED)))
        await asyncio.wait_for(resetting, 20)
        assert await asyncio.wait_for(delivering[0], 10) is False  # the reply's conversation was gone
        await _fresh(a, source)
        assert await a.store.kv_get(target, delegate.DELEGATIONS_KEY) is None
