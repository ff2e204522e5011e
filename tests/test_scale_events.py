"""Schedules and signal watches with several workers on one PostgreSQL database (DESIGN §6): one
worker at a time fires the schedules (the ``schedules`` duty), the duty moves on when that worker
closes or dies, and a schedule fire or a watched signal reaches its process once, even when two
workers deliver it at the same moment."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")

from agentloop import ScriptedModel
from agentloop.kernel import Kernel
from agentloop.messages import SystemMessage
from agentloop.process.store import ScheduleRow, WatchRow

FAST = {"lease_ttl": 2.0, "poll_interval": 0.2, "schedule_min_every": 0.1}


def echo() -> ScriptedModel:
    return ScriptedModel(lambda r: f"re: {r.messages[-1].text}")


def worker(url: str, tmp_path: Path, name: str) -> Any:
    return Kernel.open(url, model=echo(), tools=[], workspace=tmp_path, data_dir=tmp_path, worker=name, **FAST)


@asynccontextmanager
async def two(url: str, tmp_path: Path) -> AsyncIterator[tuple[Kernel, Kernel]]:
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(worker(url, tmp_path, "A"))
        b = await stack.enter_async_context(worker(url, tmp_path, "B"))
        yield a, b


async def events_of(k: Kernel, pid: str) -> list[str]:
    return [m.text for m in await (await k.process(pid)).messages() if isinstance(m, SystemMessage)]


async def until(predicate: Callable[[], Awaitable[bool]], within: float = 8.0) -> None:
    async with asyncio.timeout(within):
        while not await predicate():
            await asyncio.sleep(0.05)


async def duty_owner(k: Kernel) -> str | None:
    duty = await k.store.duty("schedules")  # (kernel/duty.py SCHEDULES)
    return None if duty is None else duty.owner


def record_fires(k: Kernel) -> list[str]:
    """The run ids (``schedule:<id>:<due time>``) of the fires this worker delivered."""
    fired: list[str] = []
    deliver = k.engine.claimed_event

    async def recording(pid: str, text: str, **kw: Any) -> Any:
        receipt = await deliver(pid, text, **kw)
        if receipt is not None:
            fired.append(kw["run_id"])
        return receipt

    k.engine.claimed_event = recording  # type: ignore[method-assign]
    return fired


async def settle(*kernels: Kernel) -> None:
    """Every process idle, on every worker, and a moment for stray deliveries to show."""
    await asyncio.sleep(0.3)
    for k in kernels:
        for record in await k.processes():
            await (await k.process(record.pid)).wait_idle()


# ---------------------------------------------------------------------------------------- schedules


async def test_one_worker_fires_the_schedules_and_each_fire_arrives_once(pg_url: str, tmp_path: Path) -> None:
    async with two(pg_url, tmp_path) as (a, b):
        fired = {"A": record_fires(a), "B": record_fires(b)}
        proc = await b.spawn(owner="alice")
        await until(lambda: _is(duty_owner(a), "A"))  # A opened first: it holds the duty, B waits
        await b.schedule(proc.pid, "once", at=time.time() + 0.2)  # made on B, fired by A
        await b.schedule(proc.pid, "tick", every=0.3)
        await until(lambda: _at_least(events_of(a, proc.pid), 4))
        await b.unschedule(proc.pid, (await b.schedules(proc.pid))[0].id)
        await settle(a, b)
        texts = await events_of(a, proc.pid)
        assert sum("once" in t for t in texts) == 1
        assert fired["B"] == []  # not on duty
        assert len(fired["A"]) == len(set(fired["A"])) == len(texts) >= 4  # each due time once
        assert await duty_owner(b) == "A"
        assert await _admission_records(b, proc.pid) == []  # no idempotency record left per fire


async def test_a_fire_raced_by_a_stalled_worker_is_delivered_once(pg_url: str, tmp_path: Path) -> None:
    """Both workers read the same due rows (one stalled past its duty's expiry, the other took the
    duty over). Each delivers them after the other: the second finds them fired already."""
    async with two(pg_url, tmp_path) as (a, b):
        await a.scheduler.stop()  # the tests drive the fires themselves
        await b.scheduler.stop()
        proc = await a.spawn(owner="alice")
        now = time.time()
        repeating = ScheduleRow("s-rep", proc.pid, "tick", now - 1, every=60.0, created_at=now)
        once = ScheduleRow("s-once", proc.pid, "once", now - 1, created_at=now)
        async with a.store.transaction():
            await a.store.add_schedule(repeating)
            await a.store.add_schedule(once)
        read_by_a = await a.store.due_schedules(now)
        read_by_b = await b.store.due_schedules(now)
        assert {r.id for r in read_by_a} == {r.id for r in read_by_b} == {"s-rep", "s-once"}
        for row in read_by_a:
            await a.scheduler._fire(row, now)
        await settle(a, b)
        for row in read_by_b:
            await b.scheduler._fire(row, now)
        await settle(a, b)
        texts = await events_of(a, proc.pid)
        assert sorted(t.rsplit("\n", 1)[-1] for t in texts) == ["once", "tick"]
        [left] = await a.store.schedules(proc.pid)
        assert left.id == "s-rep" and left.next_due > now
        # and at the same moment: one of the two deliveries wins
        [row] = await a.store.due_schedules(None)
        await asyncio.gather(a.scheduler._fire(row, row.next_due), b.scheduler._fire(row, row.next_due))
        await settle(a, b)
        assert len(await events_of(a, proc.pid)) == 3


async def test_the_duty_moves_to_another_worker_when_its_worker_closes(pg_url: str, tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        b = await stack.enter_async_context(worker(pg_url, tmp_path, "B"))
        async with worker(pg_url, tmp_path, "A") as a:
            await a.scheduler.stop()  # so that A can take the duty: B holds it now
            await b.scheduler.stop()
            a.scheduler.start()
            await until(lambda: _is(duty_owner(a), "A"))
            b.scheduler.start()
            proc = await b.spawn(owner="alice")
            await asyncio.sleep(0.5)
            assert await duty_owner(b) == "A"  # B keeps trying, and failing
        await until(lambda: _is(duty_owner(b), "B"), within=1.5)  # at once, not after the expiry
        await b.schedule(proc.pid, "after the handover", at=time.time())
        await until(lambda: _at_least(events_of(b, proc.pid), 1))
        await settle(b)
        assert len(await events_of(b, proc.pid)) == 1


async def test_the_duty_moves_to_another_worker_when_its_worker_dies(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(worker(pg_url, tmp_path, "A"))
        b = await stack.enter_async_context(worker(pg_url, tmp_path, "B"))
        proc = await b.spawn(owner="alice")
        await until(lambda: _is(duty_owner(b), "A"))

        async def dead(name: str, owner: str) -> bool:
            return False  # A dies with the duty: nobody releases it

        monkeypatch.setattr(a.store, "release_duty", dead)
        await a.scheduler.stop()  # A's timer is gone; its duty row lives on until it expires
        died = time.monotonic()
        await b.schedule(proc.pid, "due while A is dead", at=time.time())
        await asyncio.sleep(0.6)
        assert await events_of(b, proc.pid) == []  # B is not on duty yet: it does not fire
        await until(lambda: _at_least(events_of(b, proc.pid), 1), within=6.0)
        assert time.monotonic() - died >= 1.5  # after the lease_ttl (2 s) ran out, give or take a poll
        assert await duty_owner(b) == "B"
        await settle(a, b)
        assert len(await events_of(b, proc.pid)) == 1


# ------------------------------------------------------------------------------------------ watches


async def test_a_watch_made_on_one_worker_is_delivered_when_the_source_runs_on_another(
    pg_url: str, tmp_path: Path
) -> None:
    async with two(pg_url, tmp_path) as (a, b):
        source, watcher = await a.spawn(owner="alice"), await a.spawn(owner="alice")
        await a.watch(watcher.pid, source.pid, once=False)  # A's index knows it, B's does not
        src_b = await b.process(source.pid)
        await src_b.send("one")  # B claims the source and runs it: B publishes its signals
        await src_b.wait_idle()
        await until(lambda: _at_least(events_of(a, watcher.pid), 1))
        await src_b.send("two")
        await until(lambda: _at_least(events_of(a, watcher.pid), 2))
        await settle(a, b)
        texts = await events_of(a, watcher.pid)
        assert len(texts) == 2 and "re: one" in texts[0] and "re: two" in texts[1]


async def test_two_workers_catching_up_one_watch_deliver_each_signal_once(pg_url: str, tmp_path: Path) -> None:
    """One worker delivers a watch (its source's holder), another catches it up from the row it
    read before (at its start): the second finds the signal delivered and does not deliver it again."""
    async with two(pg_url, tmp_path) as (a, b):
        source, watcher = await a.spawn(owner="alice"), await a.spawn(owner="alice")
        repeating = await a.watchers.add(watcher.pid, source.pid, once=False)
        await a.watchers.stop()  # the tests drive the deliveries themselves
        await b.watchers.stop()
        await source.send("one")
        await source.wait_idle()
        [stored] = await a.store.watches(pid=watcher.pid)
        assert stored.id == repeating.id

        def copy(row: WatchRow) -> WatchRow:
            return WatchRow(row.id, row.pid, row.source_pid, row.signal, row.once, row.seen_seq, row.created_at)

        read_by_a, read_by_b = copy(stored), copy(stored)
        await a.watchers._catch_up(read_by_a)
        await settle(a, b)
        await b.watchers._catch_up(read_by_b)
        await settle(a, b)
        assert len(await events_of(a, watcher.pid)) == 1
        # at the same moment, after the next signal: once as well
        await source.send("two")
        await source.wait_idle()
        [stored] = await a.store.watches(pid=watcher.pid)
        await asyncio.gather(a.watchers._catch_up(copy(stored)), b.watchers._catch_up(copy(stored)))
        await settle(a, b)
        texts = await events_of(a, watcher.pid)
        assert len(texts) == 2 and "re: two" in texts[1]
        [stored] = await a.store.watches(pid=watcher.pid)
        assert stored.seen_seq >= read_by_a.seen_seq  # never moved back by the late worker
        assert await _admission_records(a, watcher.pid) == []


async def test_a_signal_left_undelivered_by_a_dead_worker_is_delivered_by_the_watches_duty(
    pg_url: str, tmp_path: Path
) -> None:
    """The source's worker logs the signal and dies before delivering it; the worker now on the
    ``watches`` duty delivers it once the source's lease would have run out, and only once."""
    async with two(pg_url, tmp_path) as (a, b):
        source, watcher = await a.spawn(owner="alice"), await a.spawn(owner="alice")
        await a.watch(watcher.pid, source.pid)
        await a.watchers.stop()  # A's deliveries die with it (and its duty, if it held it, is let go)
        await source.send("lost news")  # run on A, which logs the signals and delivers nothing
        await source.wait_idle()
        logged = time.monotonic()
        await asyncio.sleep(1.0)
        assert await events_of(b, watcher.pid) == []  # not while the publisher may still deliver it
        await until(lambda: _at_least(events_of(b, watcher.pid), 1), within=8.0)
        assert time.monotonic() - logged >= 1.5  # a lease lifetime (2 s) after it was logged, give or take
        duty = await b.store.duty("watches")
        assert duty is not None and duty.owner == "B"
        await settle(a, b)
        [text] = await events_of(b, watcher.pid)
        assert "re: lost news" in text
        assert await b.store.watches(pid=watcher.pid) == []  # a one-shot watch, used up


# ------------------------------------------------------------------------------------------ helpers


async def _is(value: Awaitable[Any], expected: Any) -> bool:
    return await value == expected


async def _at_least(value: Awaitable[list[str]], n: int) -> bool:
    return len(await value) >= n


async def _admission_records(k: Kernel, pid: str) -> list[str]:
    """The idempotency records left in the database (a repeating source must not pile them up)."""
    pool = k.store.pool  # type: ignore[attr-defined]
    rows = await pool.fetch("SELECT key FROM process_kv WHERE pid = $1 AND key LIKE 'admitted:%'", pid)
    return [r[0] for r in rows]
