"""Group commit in the SQLite store: transactions of several tasks in one turn of the event loop
share one commit, yet each ``async with`` still returns only once its own changes are durable."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.kernel import Kernel
from agentloop.messages import Message, UserMessage, message_to_dict, user
from agentloop.models.base import ModelRequest
from agentloop.process.calls import INTERRUPTED_BY_RESTART
from agentloop.process.store import ProcessRecord, SQLiteStore, StoreError
from tests.process_support import kernel, ran


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    store = SQLiteStore(tmp_path / "agentloop.db")
    await store.open()
    commits = 0
    real_commit = store._commit

    def counting() -> None:
        nonlocal commits
        commits += 1
        real_commit()

    store._commit = counting  # type: ignore[method-assign]
    store.group_commits = lambda: commits  # type: ignore[attr-defined]
    try:
        yield store
    finally:
        await store.close()


def _fail_next_commit(store: SQLiteStore) -> Callable[[], bool]:
    """Make the store's next commit fail as a failing disk would; returns "has it failed yet"."""
    real_commit = store._commit
    failed = False

    def failing_once() -> None:
        nonlocal failed
        if not failed:
            failed = True
            raise sqlite3.OperationalError("disk I/O error")
        real_commit()

    store._commit = failing_once  # type: ignore[method-assign]
    return lambda: failed


def _rows(path: str, sql: str) -> list[tuple[object, ...]]:
    """What another connection (another OS process, a crash survivor) reads: committed rows only."""
    db = sqlite3.connect(path)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


async def _spawn(store: SQLiteStore, pid: str) -> None:
    async with store.transaction():
        await store.create_process(ProcessRecord(pid=pid, owner="a", run_as="a", cwd="/"))
    seen = _rows(store.path, f"SELECT pid FROM processes WHERE pid = '{pid}'")
    assert seen == [(pid,)], "the transaction returned before its row was committed"


async def test_concurrent_transactions_share_commits_and_each_returns_durable(store: SQLiteStore) -> None:
    await asyncio.gather(*(_spawn(store, f"p{i:03d}") for i in range(50)))
    # the first task commits alone; the other 49 of the same loop turn ride in one group commit
    assert store.group_commits() == 1  # type: ignore[attr-defined]
    assert len(_rows(store.path, "SELECT pid FROM processes")) == 50


async def test_one_task_alone_commits_each_transaction_itself(store: SQLiteStore) -> None:
    await _spawn(store, "p")
    for i in range(5):  # the same task, twice in a loop turn: no group, no waiting
        async with store.transaction():
            await store.append_messages("p", None, [user(f"m{i}")])
    assert store.group_commits() == 0  # type: ignore[attr-defined]
    assert len(_rows(store.path, "SELECT id FROM messages")) == 5


async def test_a_member_that_fails_rolls_back_alone(store: SQLiteStore) -> None:
    await _spawn(store, "p")

    async def write(i: int) -> None:
        async with store.transaction():
            await store.append_messages("p", None, [user(f"m{i}")])
            if i == 2:
                raise RuntimeError("this step fails")

    results = await asyncio.gather(*(write(i) for i in range(5)), return_exceptions=True)
    assert [type(r).__name__ for r in results] == ["NoneType", "NoneType", "RuntimeError", "NoneType", "NoneType"]
    texts = sorted(m.message.text for m in await store.history("p"))
    assert texts == ["m0", "m1", "m3", "m4"]
    ids = [m.id for m in await store.history("p")]
    assert ids == sorted(set(ids)), "message ids stay unique and ordered"
    assert len(_rows(store.path, "SELECT id FROM messages")) == 4


async def test_a_failed_group_commit_fails_every_member_and_keeps_nothing(store: SQLiteStore) -> None:
    await _spawn(store, "p")
    _fail_next_commit(store)
    settled: list[BaseException | None] = []

    async def write(i: int) -> None:
        scope = store.transaction()
        await scope.begin()
        await store.append_messages("p", None, [user(f"m{i}")])
        pending = scope.end(commit=True, settled=settled.append)
        if pending is not None:
            await pending

    async def first() -> None:  # commits alone: it opens the loop turn
        async with store.transaction():
            await store.append_messages("p", None, [user("alone")])

    results = await asyncio.gather(first(), *(write(i) for i in range(3)), return_exceptions=True)
    assert results[0] is None
    assert all(isinstance(r, StoreError) and "disk I/O error" in str(r) for r in results[1:])
    assert len(settled) == 3 and all(isinstance(e, sqlite3.OperationalError) for e in settled)
    assert [m.message.text for m in await store.history("p")] == ["alone"]
    # what the store knew of the lost group is forgotten: the next message gets the next free id
    async with store.transaction():
        assert await store.append_messages("p", None, [user("after")]) == [2]
    assert _rows(store.path, "SELECT id FROM messages ORDER BY id") == [(1,), (2,)]


async def test_a_member_whose_error_rolled_back_everything_fails_its_group_at_once(store: SQLiteStore) -> None:
    # Disk full or an I/O error makes SQLite roll back the whole transaction by itself: the
    # members that went before lose their changes too, so they must hear about it.
    await _spawn(store, "p")

    async def write(i: int) -> None:
        async with store.transaction():
            await store.append_messages("p", None, [user(f"m{i}")])
            if i == 2:
                store.db.execute("ROLLBACK")  # what SQLite does on SQLITE_FULL
                raise sqlite3.OperationalError("database or disk is full")

    results = await asyncio.gather(*(write(i) for i in range(4)), return_exceptions=True)
    assert results[0] is None  # committed alone, before the group
    assert isinstance(results[1], StoreError)  # its savepoint went with the whole transaction
    assert isinstance(results[2], sqlite3.OperationalError)
    assert results[3] is None  # began after the group was gone: a group of its own
    assert [m.message.text for m in await store.history("p")] == ["m0", "m3"]
    assert [m.id for m in await store.history("p")] == [1, 2]


async def test_a_member_cancelled_while_waiting_does_not_cancel_the_group(store: SQLiteStore) -> None:
    await _spawn(store, "p")

    async def write(i: int) -> None:
        async with store.transaction():
            await store.append_messages("p", None, [user(f"m{i}")])

    async def cancelled_member() -> None:
        async with store.transaction():
            await store.append_messages("p", None, [user("cancelled")])

    tasks = [asyncio.create_task(write(0)), asyncio.create_task(cancelled_member()), asyncio.create_task(write(1))]
    await asyncio.sleep(0)  # every body has run; the last two wait for their group
    tasks[1].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[1], asyncio.CancelledError) and results[0] is None and results[2] is None
    # the cancelled task's step was kept before it was cancelled: it is committed with its group
    assert sorted(r[0] for r in _rows(store.path, "SELECT id FROM messages")) == [1, 2, 3]


async def test_close_commits_an_open_group(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "agentloop.db")
    await store.open()
    await _spawn(store, "p")
    waiting = []

    async def write(i: int) -> None:
        scope = store.transaction()
        await scope.begin()
        await store.append_messages("p", None, [user(f"m{i}")])
        waiting.append(scope.end(commit=True))

    await asyncio.gather(write(0), write(1))
    assert waiting[1] is not None  # the second task of the turn is in a group, not yet committed
    await store.close()  # before the loop comes round: close must not lose it
    await asyncio.gather(*(w for w in waiting if w is not None))
    assert len(_rows(store.path, "SELECT id FROM messages")) == 2


# -- the durable runner over group commits ------------------------------------------------------


async def _cache_matches_store(k: Kernel, pid: str) -> list[Message]:
    stored = [m.message for m in await k.store.history(pid)]
    cached = k.engine._live[pid].history
    assert [message_to_dict(m) for m in cached] == [message_to_dict(m) for m in stored]
    return stored


async def test_an_abort_while_steps_wait_for_their_group_leaves_cache_and_store_equal(tmp_path: Path) -> None:
    gate = asyncio.Event()

    async def script(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if isinstance(last, UserMessage) and last.text == "go":
            await gate.wait()
            return Reply(tool_calls=[call("slow", seconds=30)])
        return "done"

    async with kernel(tmp_path, ScriptedModel(script)) as k:
        procs = [await k.spawn(owner="alice") for _ in range(4)]
        for proc in procs:
            await proc.send("go")
        await asyncio.sleep(0.05)  # every model call waits at the gate
        gate.set()
        await asyncio.sleep(0)  # the answers are kept: the first committed, the others wait for a group
        assert k.store._group is not None and len(k.store._group.members) == 3
        for proc in procs:  # each abort cancels a driver: three of them wait for the group commit
            assert await proc.abort()
        for proc in procs:
            await proc.wait_idle()
            roles = [m.role for m in await _cache_matches_store(k, proc.pid)]
            assert roles == ["user", "assistant", "toolResult"]
            assert await k.store.calls(proc.pid) == []
        # the runs were aborted, not merely interrupted: the next input starts a clean run
        await procs[1].send("again")
        await procs[1].wait_idle()
        stored = await _cache_matches_store(k, procs[1].pid)
        assert [m.role for m in stored] == ["user", "assistant", "toolResult", "user", "assistant"]


async def test_a_failed_group_commit_resumes_each_process_from_the_store(tmp_path: Path) -> None:
    ran.clear()
    gate = asyncio.Event()

    async def script(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if isinstance(last, UserMessage):
            await gate.wait()
            return Reply(tool_calls=[call("echo", text=last.text)])
        return "done: " + last.text

    async with kernel(tmp_path, ScriptedModel(script)) as k:
        procs = [await k.spawn(owner="alice") for _ in range(4)]
        for i, proc in enumerate(procs):
            await proc.send(f"job {i}")
        await asyncio.sleep(0.05)
        store = k.store
        assert isinstance(store, SQLiteStore)
        failed = _fail_next_commit(store)
        gate.set()  # four answers in one loop turn: three of them ride in the group that fails
        for proc in procs:
            await asyncio.wait_for(proc.wait_idle(), 10)
        assert failed(), "the group commit was attempted"
        outcomes = []
        for proc in procs:
            stored = await _cache_matches_store(k, proc.pid)
            assert [m.role for m in stored] == ["user", "assistant", "toolResult", "assistant"]
            outcomes.append(stored[-1].text)
        # The answers lost with the group were asked for again and their calls ran then. A call
        # whose result was lost (its tool had finished; the result rode in the failed group) is
        # not run again: the model is told it was interrupted, as after a crash.
        assert sorted(ran) == [f"job {i}" for i in range(4)]
        interrupted = "done: " + INTERRUPTED_BY_RESTART
        assert all(text in (f"done: job {i}", interrupted) for i, text in enumerate(outcomes))
        assert outcomes[1:] == [f"done: job {i}" for i in range(1, 4)]


async def test_waiting_for_idle_while_a_run_starts_in_a_group_does_not_spin(tmp_path: Path) -> None:
    # A run started by a group member is "running" for the cache at once; a waiter that looks in
    # that very turn must wait for the run's end, not busy-loop on a stale idle flag (which
    # would also keep the group from ever committing).
    async def script(req: ModelRequest) -> str:
        await asyncio.sleep(0.05)
        return "done"

    async with kernel(tmp_path, ScriptedModel(script)) as k:
        p, q = await k.spawn(owner="alice"), await k.spawn(owner="alice")
        await asyncio.sleep(0.01)

        async def wait_for_p() -> str:
            await p.wait_idle()
            return (await p.messages())[-1].text

        results = await asyncio.wait_for(asyncio.gather(q.send("hello q"), p.send("hello p"), wait_for_p()), 5)
        assert results[2] == "done"


async def test_an_abort_before_the_group_commits_keeps_the_tool_from_starting(tmp_path: Path) -> None:
    ran.clear()
    gate = asyncio.Event()

    async def script(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if isinstance(last, UserMessage) and last.text.startswith("go"):
            await gate.wait()
            return Reply(tool_calls=[call("echo", text=last.text)])
        return "done"

    async with kernel(tmp_path, ScriptedModel(script)) as k:
        procs = [await k.spawn(owner="alice") for _ in range(4)]
        for i, proc in enumerate(procs):
            await proc.send(f"go {i}")
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.sleep(0)  # the answers are kept; procs 1-3 wait for their group
        assert k.store._group is not None
        assert await procs[1].abort()  # its dispatch becomes durable only after the abort began
        for proc in procs:
            await proc.wait_idle()
        await asyncio.sleep(0.05)
        assert sorted(ran) == ["go 0", "go 2", "go 3"]  # the aborted run's call never started
        stored = await _cache_matches_store(k, procs[1].pid)
        assert [m.role for m in stored] == ["user", "assistant", "toolResult"]
        assert "cancelled" in stored[-1].text
        assert all(not k.engine._live[p.pid].tools for p in procs)


async def test_a_group_waiting_on_an_open_body_commits_on_the_next_turn(store: SQLiteStore) -> None:
    # A body that awaits (a custom approval hook, say) holds the store when the group's commit
    # comes due; the group then commits on the next turn, never inside that body's end(), so a
    # caller applies its cache updates before the group's follow-ups run.
    await _spawn(store, "p")
    order: list[str] = []
    release = asyncio.Event()

    async def member(text: str, slow: bool) -> None:
        scope = store.transaction()
        await scope.begin()
        await store.append_messages("p", None, [user(text)])
        if slow:
            await release.wait()
        pending = scope.end(commit=True, settled=lambda error: order.append(f"settled {text}"))
        order.append(f"ended {text}")
        if pending is not None:
            await pending

    async def opener() -> None:  # commits alone, so the others form a group
        async with store.transaction():
            await store.append_messages("p", None, [user("first")])

    task = asyncio.gather(opener(), member("fast", False), member("slow", True))
    await asyncio.sleep(0.01)  # the group's commit came while "slow" held the store
    release.set()
    await task
    assert order.index("ended slow") < order.index("settled slow")
    assert len(_rows(store.path, "SELECT id FROM messages")) == 3


async def test_closing_with_a_member_body_open_fails_the_group_and_releases_the_store(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "agentloop.db")
    await store.open()
    await _spawn(store, "p")
    release = asyncio.Event()

    async def member(text: str, slow: bool) -> None:
        async with store.transaction():
            await store.append_messages("p", None, [user(text)])
            if slow:
                await release.wait()

    async def opener() -> None:
        async with store.transaction():
            await store.append_messages("p", None, [user("first")])

    task = asyncio.gather(opener(), member("kept?", False), member("open", True), return_exceptions=True)
    await asyncio.sleep(0.01)
    await store.close()
    release.set()
    results = await asyncio.wait_for(task, 5)
    assert results[0] is None
    assert isinstance(results[1], StoreError) and "closed" in str(results[1])
    assert isinstance(results[2], StoreError)  # its body could not end on a closed store
    assert not store._lock.locked()
    assert [r[0] for r in _rows(store.path, "SELECT id FROM messages")] == [1]


async def test_a_group_whose_transaction_vanished_fails_before_anyone_joins_it(store: SQLiteStore) -> None:
    # An error outside any body (a read on the shared connection hitting an I/O error) can make
    # SQLite roll back the group's transaction by itself; the next member must not open a fresh
    # transaction under the old group's name, which would tell the earlier members "committed".
    await _spawn(store, "p")

    async def write(text: str) -> None:
        async with store.transaction():
            await store.append_messages("p", None, [user(text)])

    async def vanish_then_write() -> None:
        store.db.execute("ROLLBACK")  # what SQLite does to the open group on such an error
        await write("after")

    results = await asyncio.gather(write("first"), write("in the group"), vanish_then_write(), return_exceptions=True)
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], StoreError)
    assert [m.message.text for m in await store.history("p")] == ["first", "after"]


async def test_a_dropped_process_cache_refuses_to_write_and_the_reloaded_one_works(tmp_path: Path) -> None:
    async with kernel(tmp_path, ScriptedModel(lambda req: "done")) as k:
        proc = await k.spawn(owner="alice")
        old = k.engine._live[proc.pid]
        k.engine._lost(old)  # as after a failed group commit
        with pytest.raises(StoreError, match="reloaded"):
            async with k.engine._tx(old):
                pass
        await proc.send("hello")
        await proc.wait_idle()
        assert k.engine._live[proc.pid] is not old
        assert [m.role for m in await _cache_matches_store(k, proc.pid)] == ["user", "assistant"]


async def test_a_tool_task_cancelled_before_it_starts_is_forgotten(tmp_path: Path) -> None:
    gate = asyncio.Event()

    async def script(req: ModelRequest) -> Reply | str:
        if isinstance(req.messages[-1], UserMessage):
            await gate.wait()
            return Reply(tool_calls=[call("slow", seconds=30)])
        return "done"

    async with kernel(tmp_path, ScriptedModel(script)) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.sleep(0)  # the answer is committed and the tool task created, not yet started
        live = k.engine._live[proc.pid]
        assert len(live.tools) == 1
        (task,) = live.tools.values()
        task.cancel()  # before its first step: its own cleanup never runs
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # (done callbacks run a turn later)
        assert task.cancelled() and live.tools == {}
        assert await proc.abort()
        await proc.wait_idle()
        assert [m.role for m in await _cache_matches_store(k, proc.pid)] == ["user", "assistant", "toolResult"]
