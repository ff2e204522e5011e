"""System events from outside a conversation: idempotent injection, schedules, signal watches."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from typing import Any

import pytest

from agentloop import ScriptedModel
from agentloop.kernel import NoSuchProcess
from agentloop.kernel.schedules import LimitReached, ScheduleError, event_key, next_due_after, render
from agentloop.kernel.watches import WatchError
from agentloop.messages import SystemMessage
from agentloop.process.store import ScheduleRow
from tests.process_support import kernel


def echo_model() -> ScriptedModel:
    return ScriptedModel(lambda r: f"re: {r.messages[-1].text}")


async def system_texts(proc: Any) -> list[str]:
    return [m.text for m in await proc.messages() if isinstance(m, SystemMessage)]


async def until(predicate: Any) -> None:
    """Poll an async predicate until it holds (the timer and watch tasks work in the background)."""
    async with asyncio.timeout(5):
        while not await predicate():
            await asyncio.sleep(0.02)


async def started_reasons(proc: Any) -> list[str]:
    return [s.payload["reason"] async for s in proc.signals(follow=False) if s.signal == "proc.run.started"]


# ------------------------------------------------------------------ idempotent system events


async def test_a_system_event_with_a_run_id_is_delivered_once(tmp_path):
    async with kernel(tmp_path, echo_model()) as k:
        proc = await k.spawn(owner="a")
        first = await k.signal(proc.pid, "the build finished", run_id="build-42")
        again = await k.signal(proc.pid, "the build finished", run_id="build-42")
        assert first == again and first.run_id == "build-42" and not first.queued
        await proc.wait_idle()
        assert await system_texts(proc) == ["the build finished"]
        assert await started_reasons(proc) == ["system.event"]
        other = await k.signal(proc.pid, "the build finished", run_id="build-43")  # a new id is a new event
        assert other.run_id == "build-43"
        await proc.wait_idle()
        assert len(await system_texts(proc)) == 2


async def test_a_retried_event_during_a_run_is_queued_once(tmp_path):
    async with kernel(tmp_path, ScriptedModel(lambda r: "ok", latency=0.2)) as k:
        proc = await k.spawn(owner="a")
        await proc.send("work")
        await asyncio.sleep(0.05)
        a = await k.signal(proc.pid, "ping", run_id="p-1")
        b = await k.signal(proc.pid, "ping", run_id="p-1")
        assert a == b and a.queued
        await proc.wait_idle()
        assert await system_texts(proc) == ["ping"]


async def test_signal_refuses_empty_text_and_unknown_processes(tmp_path):
    async with kernel(tmp_path, echo_model()) as k:
        proc = await k.spawn(owner="a")
        with pytest.raises(ValueError, match="non-empty"):
            await k.signal(proc.pid, "  ")
        with pytest.raises(NoSuchProcess):
            await k.signal("nope", "hello")


# ------------------------------------------------------------------ schedules


async def test_a_one_shot_schedule_fires_once_and_is_deleted(tmp_path):
    async with kernel(tmp_path, echo_model()) as k:
        proc = await k.spawn(owner="a")
        sid = await k.schedule(proc.pid, "stand-up in five minutes", at=time.time() + 0.2, name="standup")
        [row] = await k.schedules(proc.pid)
        assert (row.id, row.name, row.every) == (sid, "standup", None)
        assert await system_texts(proc) == []  # not before it is due
        await until(lambda: system_texts(proc))
        await proc.wait_idle()
        [text] = await system_texts(proc)
        assert text.startswith("[schedule standup, due ") and text.endswith("\nstand-up in five minutes")
        assert await started_reasons(proc) == ["schedule.event"]
        assert await k.schedules(proc.pid) == []
        assert (await proc.messages())[-1].text.startswith("re: [schedule standup")  # the model was asked


async def test_a_repeating_schedule_fires_again_and_advances(tmp_path):
    async with kernel(tmp_path, echo_model(), schedule_min_every=0.1) as k:
        proc = await k.spawn(owner="a")
        start = time.time()
        sid = await k.schedule(proc.pid, "tick", every=0.15)
        await until(lambda: _count(proc, 2))
        [row] = await k.schedules(proc.pid)
        assert row.id == sid and row.next_due > time.time() - 0.05  # moved on, not left behind
        assert row.next_due == pytest.approx(start + 0.15 * round((row.next_due - start) / 0.15), abs=0.05)
        assert await k.unschedule(proc.pid, sid) and await k.schedules(proc.pid) == []
        await proc.wait_idle()
        assert _admission_records(tmp_path) == []  # one per fire would pile up for ever
        assert not await k.unschedule(proc.pid, sid)


def _admission_records(tmp_path: Any) -> list[str]:
    """The idempotency records left in the database (a delivery's key, kept while it can be retried)."""
    with contextlib.closing(sqlite3.connect(tmp_path / "agentloop.db")) as db:
        return [r[0] for r in db.execute("SELECT key FROM process_kv WHERE key LIKE 'admitted:%'")]


async def _count(proc: Any, n: int) -> bool:
    return len(await system_texts(proc)) >= n


async def test_fires_missed_while_the_kernel_was_down_coalesce_into_one(tmp_path):
    async with kernel(tmp_path, echo_model(), schedule_min_every=0.1) as k:
        proc = await k.spawn(owner="a")
        pid = proc.pid
        await k.schedule(pid, "tick", at=time.time() + 0.1, every=0.4)
    await asyncio.sleep(1.4)  # down past the due times at +0.1, +0.5, +0.9 and +1.3
    async with kernel(tmp_path, echo_model(), schedule_min_every=0.1) as k:
        proc = await k.process(pid)
        reopened = time.time()
        await until(lambda: _count(proc, 1))
        [text] = await system_texts(proc)  # one delivery for the four missed fires
        assert "3 earlier fires missed while the runtime was down" in text
        [row] = await k.schedules(pid)
        assert reopened < row.next_due <= reopened + 0.4


async def test_a_repeating_schedule_that_starts_in_the_past_reports_no_missed_fires(tmp_path):
    """``at`` in the past with ``every`` fires at once (as documented), but the due times before
    the schedule was made were not missed "while the runtime was down": the model must not be told
    so. Fires missed after it was made still count."""
    async with kernel(tmp_path, echo_model(), schedule_min_every=0.1) as k:
        proc = await k.spawn(owner="a")
        await k.schedule(proc.pid, "hourly", at=time.time() - 5 * 3600 - 60, every=3600)
        await until(lambda: _count(proc, 1))
        await proc.wait_idle()
        [text] = await system_texts(proc)
        assert "missed" not in text
    now = time.time()
    late = ScheduleRow("s", "p", "tick", now - 3600 - 1, every=600, created_at=now - 3 * 600 - 1)
    assert "; 3 earlier fires missed while the runtime was down" in render(late, now)


async def test_a_failed_advance_does_not_deliver_twice(tmp_path, monkeypatch):
    """The crash window: the schedule cannot be moved on. Its advance is the delivery's claim, in
    the delivery's transaction, so the event is rolled back with it and the next pass delivers once."""
    async with kernel(tmp_path, echo_model()) as k:
        proc = await k.spawn(owner="a")
        k.scheduler.retry = 0.05
        real_delete = k.store.delete_schedule
        failures = []

        async def crash_once(schedule_id: str) -> bool:
            if not failures:
                failures.append(schedule_id)
                raise RuntimeError("the process died here")
            return await real_delete(schedule_id)

        monkeypatch.setattr(k.store, "delete_schedule", crash_once)
        await k.schedule(proc.pid, "once only", at=time.time() + 0.05)
        await until(lambda: _gone(k, proc.pid))
        await proc.wait_idle()
        assert failures and len(await system_texts(proc)) == 1


async def _gone(k: Any, pid: str) -> bool:
    return await k.schedules(pid) == []


async def test_an_event_delivered_before_a_crash_is_not_delivered_again(tmp_path):
    async with kernel(tmp_path, echo_model()) as k:
        await k.scheduler.stop()  # this kernel's timer plays dead; the test does its first half
        proc = await k.spawn(owner="a")
        pid = proc.pid
        await k.schedule(pid, "once only", at=time.time() - 1)
        [row] = await k.schedules(pid)
        await k.engine.signal_event(pid, "once only", run_id=event_key(row), reason="schedule.event")
        await proc.wait_idle()
        # ... and the machine died before the row was deleted
    async with kernel(tmp_path, echo_model()) as k:
        proc = await k.process(pid)
        await until(lambda: _gone(k, pid))
        await proc.wait_idle()
        assert await system_texts(proc) == ["once only"]  # the restart's fire was answered from the record


async def test_schedule_validation(tmp_path):
    async with kernel(tmp_path, echo_model()) as k:
        proc = await k.spawn(owner="a")
        now = time.time()
        cases: list[tuple[dict[str, Any], str]] = [
            ({}, "give at"),
            ({"every": 0}, "positive"),
            ({"every": -5}, "positive"),
            ({"every": 0.5}, "at least 10 seconds"),
            ({"every": float("nan")}, "finite"),
            ({"every": True}, "number"),
            ({"at": "soon"}, "number"),
            ({"at": -1}, "epoch seconds"),
            ({"at": now + 1e10}, "hundred years"),
            ({"at": now, "name": ""}, "name"),
        ]
        for kwargs, message in cases:
            with pytest.raises(ScheduleError, match=message):
                await k.schedule(proc.pid, "x", **kwargs)
        with pytest.raises(ScheduleError, match="text"):
            await k.schedule(proc.pid, " ", at=now)
        with pytest.raises(ScheduleError, match="text is not valid text"):  # (it is stored, then delivered)
            await k.schedule(proc.pid, b"caf\xe9".decode("utf-8", "surrogateescape"), at=now + 60)
        with pytest.raises(NoSuchProcess):
            await k.schedule("nope", "x", at=now + 60)
        assert await k.schedules(proc.pid) == []


async def test_schedules_per_process_are_capped(tmp_path, monkeypatch):
    monkeypatch.setattr("agentloop.kernel.schedules.MAX_SCHEDULES", 2)
    async with kernel(tmp_path, echo_model()) as k:
        proc = await k.spawn(owner="a")
        for _ in range(2):
            await k.schedule(proc.pid, "x", at=time.time() + 60)
        with pytest.raises(LimitReached):
            await k.schedule(proc.pid, "x", at=time.time() + 60)


async def test_kill_and_reset_drop_the_schedules(tmp_path):
    async with kernel(tmp_path, echo_model()) as k:
        kept, reset, killed = [await k.spawn(owner="a") for _ in range(3)]
        for proc in (kept, reset, killed):
            await k.schedule(proc.pid, "later", at=time.time() + 60)
        await reset.reset()
        await killed.kill()
        assert await k.schedules(reset.pid) == []
        assert [r.pid for r in await k.store.due_schedules(None)] == [kept.pid]


async def test_the_timer_stops_even_when_woken_in_the_same_instant(tmp_path):
    """A wake-up and the stop's cancel landing together: Python 3.11's ``asyncio.wait_for`` would
    return the wake-up and drop the cancel, and ``stop`` would wait forever."""
    async with kernel(tmp_path, echo_model()) as k:
        await asyncio.sleep(0.05)  # the timer waits for its next due time (none: a long wait)
        k.scheduler._poke.set()
        async with asyncio.timeout(3):
            await k.scheduler.stop()


def test_next_due_after_skips_to_the_first_time_after_now():
    assert next_due_after(100.0, 10.0, 100.0) == 110.0
    assert next_due_after(100.0, 10.0, 135.0) == 140.0
    assert next_due_after(100.0, 10.0, 140.0) == 150.0  # never "now"
    assert next_due_after(100.0, 10.0, 50.0) == 110.0


# ------------------------------------------------------------------ signal watches


async def test_a_watch_tells_the_watcher_how_the_source_run_ended(tmp_path):
    async with kernel(tmp_path, echo_model()) as k:
        source, watcher = await k.spawn(owner="a"), await k.spawn(owner="a")
        wid = await k.watch(watcher.pid, source.pid)
        assert [w.id for w in await k.watches(watcher.pid)] == [wid]
        await source.send("compute the answer")
        await source.wait_idle()
        await until(lambda: system_texts(watcher))
        await watcher.wait_idle()
        [text] = await system_texts(watcher)
        assert f"process {source.pid} logged proc.run.finished" in text
        assert "status ok (turn.complete)" in text and "re: compute the answer" in text
        assert await started_reasons(watcher) == ["signal.watch"]
        assert await k.watches(watcher.pid) == []  # once: it ended with its delivery
        await source.send("again")
        await source.wait_idle()
        await asyncio.sleep(0.1)
        assert len(await system_texts(watcher)) == 1


async def test_a_repeating_watch_delivers_every_match_and_survives_a_restart(tmp_path):
    async with kernel(tmp_path, echo_model()) as k:
        source, watcher = await k.spawn(owner="a"), await k.spawn(owner="a")
        await k.watch(watcher.pid, source.pid, once=False)
        await source.send("one")
        await source.wait_idle()
        await until(lambda: _count(watcher, 1))
        await watcher.wait_idle()
        k.watchers._index.clear()  # as if the kernel died before it saw the next run end
        await source.send("two")
        await source.wait_idle()
        await asyncio.sleep(0.1)
        assert len(await system_texts(watcher)) == 1
        pids = (source.pid, watcher.pid)
    async with kernel(tmp_path, echo_model()) as k:
        watcher = await k.process(pids[1])
        await until(lambda: _count(watcher, 2))  # read from the source's log at start-up
        await watcher.wait_idle()
        texts = await system_texts(watcher)
        assert "re: one" in texts[0] and "re: two" in texts[1] and len(texts) == 2
        assert len(await k.watches(watcher.pid)) == 1
    assert _admission_records(tmp_path) == []


async def test_a_watch_delivery_that_fails_is_tried_again(tmp_path, monkeypatch):
    """A delivery that fails (the database busy for a moment) is tried again, not left until the
    source happens to log another signal the watch wants, or until the next restart: a one-shot
    watch on a subagent's end would otherwise never tell its parent."""
    async with kernel(tmp_path, echo_model()) as k:
        k.watchers.retry = 0.05
        source, watcher = await k.spawn(owner="a"), await k.spawn(owner="a")
        await k.watch(watcher.pid, source.pid)
        real = k.engine.claimed_event
        failures: list[str] = []

        async def fail_once(pid: str, text: str, **kw: Any) -> Any:
            if not failures:
                failures.append(pid)
                raise sqlite3.OperationalError("database is locked")
            return await real(pid, text, **kw)

        monkeypatch.setattr(k.engine, "claimed_event", fail_once)
        await source.send("compute the answer")
        await source.wait_idle()
        await until(lambda: system_texts(watcher))
        await watcher.wait_idle()
        assert failures == [watcher.pid] and len(await system_texts(watcher)) == 1
        assert await k.watches(watcher.pid) == []


async def test_watch_rules(tmp_path):
    async with kernel(tmp_path, echo_model()) as k:
        a, b, c = [await k.spawn(owner="alice") for _ in range(3)]
        bob = await k.spawn(owner="bob")
        with pytest.raises(WatchError, match="itself"):
            await k.watch(a.pid, a.pid)
        with pytest.raises(PermissionError, match="same owner"):
            await k.watch(bob.pid, a.pid)
        with pytest.raises(WatchError, match="signal must be one of"):
            await k.watch(a.pid, b.pid, "proc.run.stream")  # live-only: never logged
        with pytest.raises(NoSuchProcess):
            await k.watch(a.pid, "nope")
        await k.watch(b.pid, a.pid, once=False)  # a wakes b
        await k.watch(c.pid, b.pid, once=False)  # b wakes c
        with pytest.raises(WatchError, match="loop"):
            await k.watch(a.pid, c.pid, once=False)  # c waking a would close a → b → c → a
        await k.watch(a.pid, c.pid, once=True)  # a one-shot ends the loop by itself
        assert await k.watches(bob.pid) == []


async def test_a_killed_source_takes_its_watches_along_and_reset_drops_held_ones(tmp_path):
    async with kernel(tmp_path, echo_model()) as k:
        source, watcher, other = [await k.spawn(owner="a") for _ in range(3)]
        await k.watch(watcher.pid, source.pid, once=False)
        await source.kill()
        assert await k.watches(watcher.pid) == [] and k.watchers._index == {}
        await k.watch(watcher.pid, other.pid)  # held by watcher: reset drops it
        await k.watch(other.pid, watcher.pid)  # on watcher: its follower still follows it
        await watcher.reset()
        assert await k.watches(watcher.pid) == []
        assert [w.source_pid for w in await k.watches(other.pid)] == [watcher.pid]
        await watcher.send("after the reset")
        await watcher.wait_idle()
        await until(lambda: _count(other, 1))


@contextlib.contextmanager
def slow_archives(seconds: float):
    """Resets take ``seconds`` to write their archive: the window in which the process is held."""
    import agentloop.kernel.kernel as kernel_module

    real = kernel_module.write_archive

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return real(*args, **kwargs)

    kernel_module.write_archive = slow
    try:
        yield
    finally:
        kernel_module.write_archive = real


async def test_a_reset_under_way_does_not_hold_up_other_processes_schedules(tmp_path):
    """Schedules fire one at a time; one due for a process being reset is taken up again after
    the reset (which drops it) instead of keeping the others waiting until the reset is over."""
    async with kernel(tmp_path, echo_model()) as k:
        busy, other = await k.spawn(owner="a"), await k.spawn(owner="a")
        await busy.send("something to archive")
        await busy.wait_idle()
        due = time.time() + 0.3
        await k.schedule(busy.pid, "for the process being reset", at=due)
        await k.schedule(other.pid, "for the other process", at=due + 0.01)
        with slow_archives(1.5):
            resetting = asyncio.create_task(busy.reset())
            await until(lambda: system_texts(other))
            assert not resetting.done()
            await resetting
        await asyncio.sleep(0.2)
        assert await system_texts(busy) == [] and await k.schedules(busy.pid) == []


async def test_schedules_held_back_do_not_make_the_timer_spin_or_starve_the_others(tmp_path, monkeypatch):
    """A whole batch of due schedules held back (their process being reset, or their fires
    failing): the timer neither re-reads them in a busy loop nor leaves the schedules due after
    them unfired until they are let go."""
    monkeypatch.setattr("agentloop.kernel.schedules.BATCH", 2)
    async with kernel(tmp_path, echo_model()) as k:
        await k.scheduler.stop()  # the test runs the passes itself
        busy, other = await k.spawn(owner="a"), await k.spawn(owner="a")
        now = time.time()
        for n in range(2):
            await k.schedule(busy.pid, f"held {n}", at=now - 10 + n)
        await k.schedule(other.pid, "for the other process", at=now - 1)
        async with k.engine.clearing.hold(busy.pid):  # (a reset of ``busy`` under way)
            delays = [await k.scheduler.fire_due() for _ in range(3)]
            await other.wait_idle()
            assert await system_texts(other) != []
            assert delays[-1] > 0  # (0: the timer's next pass at once, again and again)
        assert await system_texts(busy) == []


async def test_a_reset_under_way_does_not_hold_up_other_watchers(tmp_path):
    async with kernel(tmp_path, echo_model()) as k:
        source, busy, other = [await k.spawn(owner="a") for _ in range(3)]
        await busy.send("something to archive")
        await busy.wait_idle()
        await k.watch(busy.pid, source.pid)  # first in line
        await k.watch(other.pid, source.pid)
        with slow_archives(1.5):
            resetting = asyncio.create_task(busy.reset())
            await asyncio.sleep(0.1)
            await source.send("finish a run")
            await until(lambda: system_texts(other))
            assert not resetting.done()
            await resetting
        await asyncio.sleep(0.2)
        assert await system_texts(busy) == [] and await k.watches(busy.pid) == []
