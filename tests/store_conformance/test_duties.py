"""The duty contract (kernel-wide work one worker does at a time, kernel/duty.py), and the claims
that make a schedule's or a watch's delivery happen once, on every store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from agentloop.process.store import Store, WatchRow
from tests.store_conformance.test_conformance import spawn


async def test_a_duty_excludes_other_owners_until_released_and_keeps_its_epoch_while_renewed(store: Store) -> None:
    assert await store.duty("schedules") is None
    assert await store.claim_duty("schedules", "w1", 30) == 1
    assert await store.claim_duty("schedules", "w1", 30) == 1  # a renewal: the same hands, the same epoch
    assert await store.claim_duty("schedules", "w2", 30) is None
    assert await store.claim_duty("other", "w2", 30) == 1  # duties are independent of each other
    duty = await store.duty("schedules")
    assert duty is not None and (duty.name, duty.owner, duty.epoch) == ("schedules", "w1", 1)
    assert not await store.release_duty("schedules", "w2")  # not w2's
    assert await store.release_duty("schedules", "w1")
    assert not await store.release_duty("schedules", "w1")  # once
    freed = await store.duty("schedules")
    assert freed is not None and freed.owner is None
    assert await store.claim_duty("schedules", "w2", 30) == 2  # changed hands: the epoch moves on
    assert await store.claim_duty("schedules", "w1", 30) is None


async def test_an_expired_duty_is_taken_over(store: Store) -> None:
    assert await store.claim_duty("schedules", "w1", 0.05) == 1
    assert await store.claim_duty("schedules", "w2", 30) is None
    await asyncio.sleep(0.12)  # w1 died: nobody renewed it
    assert await store.claim_duty("schedules", "w2", 30) == 2
    assert await store.claim_duty("schedules", "w1", 30) is None  # back from the dead: it is w2's now


async def test_duties_are_not_process_leases(store: Store) -> None:
    """A duty never shows up in the process leases' renewals or sweep, nor a lease in a duty."""
    await spawn(store)
    await store.claim_duty("p1", "w1", 30)  # even one named like a process
    assert await store.lease("p1") is None
    assert await store.renew_leases("w1", 30) == {}
    assert await store.claim_lease("p1", "w2", 30) == 1
    duty = await store.duty("p1")
    assert duty is not None and duty.owner == "w1"


async def test_two_workers_claiming_a_duty_at_once_get_it_once(make_store: Callable[[], Store]) -> None:
    stores = [make_store() for _ in range(4)]
    for s in stores:
        await s.open()
    try:
        got = await asyncio.gather(*(s.claim_duty("schedules", f"w{i}", 30) for i, s in enumerate(stores)))
        assert sorted(got, key=lambda e: e is None) == [1, None, None, None]
    finally:
        for s in stores:
            await s.close()


async def test_a_watch_moves_on_only_from_where_it_was_read(store: Store) -> None:
    async with store.transaction():
        await store.add_watch(WatchRow("w1", "w", "src", "proc.run.finished", once=False, seen_seq=3))
    async with store.transaction():
        assert await store.set_watch_seen("w1", 5, expect=3)
    async with store.transaction():
        assert not await store.set_watch_seen("w1", 6, expect=3)  # moved on by someone else meanwhile
    [row] = await store.watches(pid="w")
    assert row.seen_seq == 5
    async with store.transaction():
        assert await store.delete_watch("w1")
        assert not await store.set_watch_seen("w1", 7, expect=5)


async def test_lagging_watches_are_the_sources_owing_a_wanted_signal_logged_before_a_time(store: Store) -> None:
    for pid in ("src", "other", "w"):
        await spawn(store, pid)
    async with store.transaction():
        await store.append_events("src", [("proc.changed", {}), ("proc.run.finished", {}), ("proc.changed", {})])
        await store.append_events("other", [("proc.changed", {})])
        await store.add_watch(WatchRow("owed", "w", "src", "proc.run.finished", once=True, seen_seq=0))
        await store.add_watch(WatchRow("read", "w", "other", "proc.run.finished", once=False, seen_seq=0))
    later = time.time() + 60
    assert await store.lagging_watches(later) == ["src"]  # "other" logged nothing its watch wants
    assert await store.lagging_watches(time.time() - 60) == []  # too recent: its publisher delivers it
    async with store.transaction():
        assert await store.set_watch_seen("owed", 2)  # delivered
    assert await store.lagging_watches(later) == []
    async with store.transaction():
        await store.append_events("other", [("proc.run.finished", {})])
        await store.add_watch(WatchRow("also", "other", "src", "proc.run.finished", once=False, seen_seq=1))
    assert await store.lagging_watches(later) == ["other", "src"]  # each source once, sorted
