"""The store queries retention (kernel/retention.py) asks, on every store: which processes have
been idle since a time, and dropping the segment row of an archive that was removed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from agentloop.messages import user
from agentloop.process.store import HilRow, ScheduleRow, SegmentRow, Store, ToolCallRow, WatchRow
from tests.store_conformance.test_conformance import spawn


async def test_idle_processes_leaves_out_whatever_has_something_under_way_or_waiting(store: Store) -> None:
    pids = ["idle", "other", "queued", "asking", "calling", "scheduled", "watcher", "source", "running", "killed"]
    for pid in pids:
        await spawn(store, pid)
    async with store.transaction():
        await store.enqueue("queued", "queue", user("later"))
        await store.put_hil(HilRow("h1", "asking", "r", "d1", "c", "Shell", "shell.exec", {}, "-"))
        await store.register_calls([ToolCallRow("d2", "calling", "r", 0, "c", "Shell", "shell.exec", {})])
        await store.add_schedule(ScheduleRow("s1", "scheduled", "wake up", time.time() + 3600))
        await store.add_watch(WatchRow("w1", "watcher", "source", "run.finished"))
        await store.update_process("running", state="running", current_run={"id": "r"})
        await store.update_process("killed", state="killed")
    await asyncio.sleep(0.02)  # (what follows is after the cut-off: clocks are coarse on some systems)
    cut = time.time()
    await asyncio.sleep(0.02)
    await spawn(store, "young")  # created after the cut-off
    async with store.transaction():
        await store.append_messages("idle", None, [user("old enough")])  # after the cut too: see below

    later = time.time() + 60
    assert {r.pid for r in await store.idle_processes(later)} == {"idle", "other", "young"}
    # at the cut-off, "idle" has a message after it: active since; "young" did not exist yet
    assert {r.pid for r in await store.idle_processes(cut)} == {"other"}
    assert await store.idle_processes(0.0) == []


async def test_a_signal_logged_after_the_cut_off_is_activity(store: Store) -> None:
    await spawn(store, "p1")
    await spawn(store, "p2")
    await asyncio.sleep(0.02)
    cut = time.time()
    await asyncio.sleep(0.02)
    async with store.transaction():
        await store.append_event("p1", "proc.changed", {"changes": ["title"]})
    assert [r.pid for r in await store.idle_processes(cut)] == ["p2"]
    assert {r.pid for r in await store.idle_processes(time.time() + 1)} == {"p1", "p2"}


async def test_delete_segment_drops_one_row(store: Store) -> None:
    await spawn(store, "p1")
    async with store.transaction():
        await store.add_segment(SegmentRow("s1", "p1", 1, "reset", 1, 2, "var/sessions/alice/p1/a.jsonl.gz"))
        await store.add_segment(SegmentRow("s2", "p1", 2, "reset", 3, 4, "var/sessions/alice/p1/b.jsonl.gz"))
    async with store.transaction():
        assert await store.delete_segment("s1") is True
        assert await store.delete_segment("s1") is False
        assert await store.delete_segment("nope") is False
    assert [r.id for r in await store.segments("p1")] == ["s2"]


async def test_idle_processes_among_pids_looks_at_those_alone_inside_a_transaction(store: Store) -> None:
    for pid in ("a", "b", "busy", "other"):
        await spawn(store, pid)
    async with store.transaction():
        await store.enqueue("busy", "queue", user("later"))
    later = time.time() + 60
    async with store.transaction():  # (the kill's look: the rows it names are held until the end)
        assert [r.pid for r in await store.idle_processes(later, ["a", "b", "busy", "gone"])] == ["a", "b"]
        assert await store.idle_processes(later, []) == []
    assert {r.pid for r in await store.idle_processes(later)} == {"a", "b", "other"}


async def test_a_look_at_a_row_another_transaction_holds_finds_nothing_idle_at_once(
    make_store: Callable[[], Store], store: Store
) -> None:
    """Retention's look gives way to a live step instead of waiting (or deadlocking) with it. On
    SQLite one writer holds the whole database, so only a second worker (PostgreSQL) can hold a
    row while the look runs."""
    if not store.shared:
        return  # (SQLite: a second writer cannot begin at all; nothing to hold a row against)
    await spawn(store, "p1")
    other = make_store()
    await other.open()
    try:
        holding, release = asyncio.Event(), asyncio.Event()

        async def step() -> None:
            async with other.transaction():
                await other.update_process("p1")  # (its row locked until this transaction ends)
                holding.set()
                await release.wait()

        worker = asyncio.create_task(step())
        await asyncio.wait_for(holding.wait(), 5)
        with pytest.raises(_Ended):
            async with store.transaction():
                started = time.monotonic()  # (without NOWAIT the look would wait for the step: for ever here)
                assert await store.idle_processes(time.time() + 60, ["p1"]) == []
                assert time.monotonic() - started < 2
                raise _Ended  # (the refused lock spoilt the transaction: the caller ends it)
        release.set()
        await worker
    finally:
        await other.close()


class _Ended(Exception):
    """The test's way out of the transaction a refused lock spoilt."""
