"""Counting an owner's processes, on every store: every live one, or only the top-level ones (the
conversations an account's quota counts; subagents, which have a ``parent_pid``, are not)."""

from __future__ import annotations

from agentloop.process.store import ProcessRecord, Store
from tests.store_conformance.test_conformance import spawn


async def _child(store: Store, pid: str, parent: str, owner: str = "alice") -> None:
    record = ProcessRecord(pid=pid, owner=owner, run_as=owner, cwd="/home/" + owner, parent_pid=parent)
    async with store.transaction():
        await store.create_process(record)


async def test_processes_are_counted_all_or_top_level_only(store: Store) -> None:
    await spawn(store, "p1", "alice")
    await spawn(store, "p2", "alice")
    await spawn(store, "b1", "bob")
    await _child(store, "c1", "p1")
    await _child(store, "c2", "p1")
    await _child(store, "g1", "c1")  # a grandchild
    await _child(store, "bc", "b1", owner="bob")
    assert await store.count_processes("alice") == 5
    assert await store.count_processes("alice", top_level_only=True) == 2
    assert await store.count_processes("bob", top_level_only=True) == 1
    assert await store.count_processes("carol", top_level_only=True) == 0
    async with store.transaction():
        await store.update_process("p2", state="killed")  # (not live: counted by neither)
        await store.update_process("c2", state="killed")
    assert await store.count_processes("alice") == 3
    assert await store.count_processes("alice", top_level_only=True) == 1
    async with store.transaction():
        await store.delete_process("c1")
    assert await store.count_processes("alice") == 2  # (g1's row stays until it is killed itself)
    assert await store.count_processes("alice", top_level_only=True) == 1
