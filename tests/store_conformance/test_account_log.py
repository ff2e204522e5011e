"""The account log (``Store.append_account_events``): each owner's account-level signals numbered
gapless and in commit order, read after an account seq, kept through a process's reset and kill,
and pruned to a bound, on every store."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from agentloop.process.store import Store
from tests.store_conformance.test_conformance import spawn


async def log(store: Store, owner: str, pid: str, *names: str, seq: int = 1) -> list[int]:
    """Copy signals named ``names`` of ``pid`` (process seqs from ``seq`` on) in a transaction of
    their own; their account seqs."""
    async with store.transaction():
        return await store.append_account_events(
            owner, pid, [(seq + i, name, {"pid": pid, "n": i}) for i, name in enumerate(names)]
        )


async def test_account_seqs_are_per_owner_gapless_and_read_after_a_seq(store: Store) -> None:
    await spawn(store, "a1", owner="alice")
    await spawn(store, "a2", owner="alice")
    await spawn(store, "b1", owner="bob")
    assert await store.last_account_seq("alice") == 0 and await store.account_events("alice") == []
    assert await log(store, "alice", "a1", "proc.run.hil.requested") == [1]
    assert await log(store, "bob", "b1", "proc.run.finished") == [1]  # numbered per owner
    assert await log(store, "alice", "a2", "proc.changed", "proc.run.finished", seq=7) == [2, 3]
    assert await log(store, "alice", "a1", "proc.run.finished", seq=4) == [4]

    rows = await store.account_events("alice")
    assert [(r.seq, r.pid, r.pid_seq, r.signal) for r in rows] == [
        (1, "a1", 1, "proc.run.hil.requested"),
        (2, "a2", 7, "proc.changed"),
        (3, "a2", 8, "proc.run.finished"),
        (4, "a1", 4, "proc.run.finished"),
    ]
    assert rows[2].payload == {"pid": "a2", "n": 1} and rows[0].created_at > 0
    assert [r.seq for r in await store.account_events("alice", after_seq=2)] == [3, 4]
    assert [r.seq for r in await store.account_events("alice", after_seq=1, limit=2)] == [2, 3]
    assert await store.account_events("alice", after_seq=4) == []
    assert await store.last_account_seq("alice") == 4 and await store.last_account_seq("bob") == 1
    assert await store.last_account_seqs(["alice", "bob", "carol"]) == {"alice": 4, "bob": 1}


async def test_a_rolled_back_body_leaves_no_gap(store: Store) -> None:
    await spawn(store, "a1")
    assert await log(store, "alice", "a1", "proc.run.finished") == [1]
    tx = store.transaction()
    await tx.begin()
    assert await store.append_account_events("alice", "a1", [(2, "proc.run.finished", {})]) == [2]
    tx.end(commit=False)
    assert await log(store, "alice", "a1", "proc.run.finished", seq=3) == [2]
    assert [r.pid_seq for r in await store.account_events("alice")] == [1, 3]


async def test_the_account_log_outlives_a_reset_and_a_kill(store: Store) -> None:
    await spawn(store, "a1")
    async with store.transaction():
        seqs = await store.append_events("a1", [("proc.run.finished", {"x": 1})])
        await store.append_account_events("alice", "a1", [(seqs[0], "proc.run.finished", {"x": 1})])
    async with store.transaction():
        await store.new_generation("a1")
        await store.prune_events("a1")  # (a reset drops the process's own log)
    assert await store.events("a1") == []
    async with store.transaction():
        await store.delete_process("a1")
    [row] = await store.account_events("alice")
    assert (row.seq, row.pid, row.payload) == (1, "a1", {"x": 1})
    await spawn(store, "a2")
    assert await log(store, "alice", "a2", "proc.run.finished") == [2]  # the numbering goes on


async def test_pruning_keeps_the_newest_so_the_numbering_goes_on(store: Store) -> None:
    await spawn(store, "a1")
    await spawn(store, "b1", owner="bob")
    for _ in range(5):
        await log(store, "alice", "a1", "proc.run.finished")
    await log(store, "bob", "b1", "proc.run.finished")
    async with store.transaction():
        assert await store.prune_account_events("alice", through=3) == 3
    assert [r.seq for r in await store.account_events("alice")] == [4, 5]
    async with store.transaction():
        assert await store.prune_account_events("alice", through=100) == 1  # not the newest
    assert [r.seq for r in await store.account_events("alice")] == [5]
    assert [r.seq for r in await store.account_events("bob")] == [1]  # another owner's untouched
    assert await log(store, "alice", "a1", "proc.run.finished") == [6]


async def test_two_stores_number_one_owners_signals_in_commit_order(make_store: Callable[[], Store]) -> None:
    """The second writer of an owner's account log waits for the first to commit, then numbers
    after it: nothing numbered below a committed account seq is still to commit."""
    first, second = make_store(), make_store()
    await first.open()
    await second.open()
    try:
        await spawn(first, "a1")
        await spawn(first, "a2")
        tx = first.transaction()
        await tx.begin()
        assert await first.append_account_events("alice", "a1", [(1, "proc.run.finished", {})]) == [1]
        other = asyncio.create_task(log(second, "alice", "a2", "proc.run.finished"))
        await asyncio.sleep(0.3)
        assert not other.done()  # waits for the first transaction
        pending = tx.end(commit=True)
        if pending is not None:
            await pending
        assert await asyncio.wait_for(other, 10) == [2]
        assert [(r.seq, r.pid) for r in await first.account_events("alice")] == [(1, "a1"), (2, "a2")]
        assert await log(first, "alice", "a1", "proc.run.finished", seq=2) == [3]  # (what it knew is stale)
    finally:
        await first.close()
        await second.close()
