"""Review of the resumable account stream (commit f210eae): the account log's edge cases."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentloop import ScriptedModel
from agentloop.kernel import AccountSignal, Kernel
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from tests.test_account_resume import answer, finish, kernel


def pruned(after: int, oldest: int) -> AccountSignal:
    payload = {"afterSeq": after, "oldestSeq": oldest, "missed": oldest - after - 1}
    return AccountSignal(None, sig.Signal(sig.ACCOUNT_LOG_PRUNED, payload))


async def test_a_resume_from_zero_is_told_of_a_pruned_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sig, "KEPT_ACCOUNT_SIGNALS", 3)
    monkeypatch.setattr(sig, "ACCOUNT_PRUNE_EVERY", 2)
    async with kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice")
        for _ in range(6):
            await finish(proc)
        got = [i async for i in k.account_signals("alice", after_seq=0, follow=False)]
        assert got[0] == pruned(0, 4)
        assert [i.seq for i in got[1:]] == [4, 5, 6]


async def test_pruning_while_a_resume_reads_the_backlog_is_told(tmp_path: Path) -> None:
    async with kernel(tmp_path) as k:
        store = k.store
        async with store.transaction():
            await store.append_account_events("alice", "p1", [(n, sig.RUN_FINISHED, {"n": n}) for n in range(1, 1201)])
        stream = k.account_signals("alice", after_seq=0, follow=False)
        first = await anext(stream)  # the first page (1..500) is read
        async with store.transaction():
            await store.prune_account_events("alice", through=800)
        rest = [first, *[i async for i in stream]]
        assert [i.seq for i in rest[:500]] == list(range(1, 501))
        assert rest[500] == pruned(500, 801)
        assert [i.seq for i in rest[501:]] == list(range(801, 1201))


# ------------------------------------------------------------------ two workers, one PostgreSQL


async def _collect(stream: AsyncIterator[AccountSignal], n: int, into: list[AccountSignal]) -> None:
    while len(into) < n:
        item = await anext(stream)
        if item.seq is not None:
            into.append(item)


async def test_two_workers_finishing_one_owners_runs_at_once_number_them_gapless(pg_url: str, tmp_path: Path) -> None:
    """Runs of one owner end on both workers at the same moments, and both listeners drop once in
    the middle: the account log is numbered 1..n without a hole or a deadlock, and a watcher on
    either worker gets each exactly once, in account seq order (what a dropped notification lost
    is read from the log)."""
    pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")
    import asyncpg

    from tests.test_scale_out import kept_by, two

    async with two(pg_url, tmp_path, ScriptedModel(answer), []) as (a, b):
        procs = []
        for worker in (a, b, a, b, a, b):
            proc = await worker.spawn(owner="alice")
            await kept_by(worker, proc.pid)
            procs.append(proc)
        rounds = 3
        total = rounds * len(procs)
        on_a, on_b = a.account_signals("alice"), b.account_signals("alice")
        seen_a: list[AccountSignal] = []
        seen_b: list[AccountSignal] = []
        watching = [asyncio.ensure_future(_collect(s, total, into)) for s, into in ((on_a, seen_a), (on_b, seen_b))]
        await asyncio.sleep(0.1)  # (both watching)
        for n in range(rounds):
            if n == 1:  # both workers' notification connections drop (and come back)
                admin = await asyncpg.connect(pg_url)
                try:
                    dropped = await admin.fetchval(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                        " WHERE query LIKE 'LISTEN%' AND pid <> pg_backend_pid()"
                    )
                    assert dropped >= 2
                finally:
                    await admin.close()
            async with asyncio.timeout(20):
                await asyncio.gather(*(finish(p, f"round {n}") for p in procs))
        async with asyncio.timeout(20):
            await asyncio.gather(*watching)
        logged = await a.store.account_events("alice", limit=total + 10)
        assert [r.seq for r in logged] == list(range(1, total + 1))
        expected = [(r.seq, r.pid, r.signal) for r in logged]
        for seen in (seen_a, seen_b):
            assert [(i.seq, i.pid, i.signal.signal) for i in seen] == expected
        assert {r.pid for r in logged} == {p.pid for p in procs}
        await on_a.aclose()
        await on_b.aclose()


async def test_a_kernel_closed_under_a_resume_ends_the_stream(tmp_path: Path) -> None:
    """Closed while a resume reads a long backlog: the stream ends (as a live one does), it does
    not fail with the store gone; one begun after the close ends at once."""
    opened = Kernel.open(f"sqlite:///{tmp_path}/agentloop.db", model=ScriptedModel(answer), workspace=tmp_path)
    k = await opened.__aenter__()
    try:
        async with k.store.transaction():
            await k.store.append_account_events("alice", "p1", [(n, sig.RUN_FINISHED, {}) for n in range(1, 1201)])
        stream = k.account_signals("alice", after_seq=0)
        first = await anext(stream)
    finally:
        await opened.__aexit__(None, None, None)
    rest = [i.seq async for i in stream]  # what the page read before the close held, then the end
    assert [first.seq, *rest] == list(range(1, 501))
    assert [i async for i in k.account_signals("alice", after_seq=3)] == []


async def test_steps_that_log_no_account_signal_touch_no_account_table(tmp_path: Path) -> None:
    """The durable hot path's cost: only the step that ends a run writes the account log (one
    INSERT, the owner's newest seq cached), every other statement is the process's own."""
    from agentloop import Reply, call, tool

    @tool
    def ping() -> str:
        """Answer pong."""
        return "pong"

    def calls(req: ModelRequest) -> Reply | str:
        asked = sum(1 for m in req.messages if getattr(m, "role", "") == "toolResult")
        return Reply(tool_calls=[call("ping")]) if asked < 3 else "done"

    async with Kernel.open(
        f"sqlite:///{tmp_path}/agentloop.db", model=ScriptedModel(calls), tools=[ping], workspace=tmp_path
    ) as k:
        proc = await k.spawn(owner="alice")
        await finish(proc)  # (the first reads the owner's newest account seq once)
        statements: list[str] = []
        k.store.db.set_trace_callback(statements.append)  # type: ignore[attr-defined]
        try:
            for _ in range(2):
                await finish(proc)
        finally:
            k.store.db.set_trace_callback(None)  # type: ignore[attr-defined]
        touching = [s for s in statements if "account_" in s]
        assert len(touching) == 2 and all(s.startswith("INSERT INTO account_events") for s in touching)
        assert sum(1 for s in statements if s.startswith("INSERT INTO events")) >= 2 * 4  # (several steps a run)
        assert await k.account_seq("alice") == 3


async def test_a_lost_first_notification_of_a_new_account_is_found_by_the_poll(pg_url: str, tmp_path: Path) -> None:
    """A watcher on worker B of an account with nothing logged yet; the notification of the first
    run's end, committed on A, is lost: B's poll still finds it in the account log (it compares
    the newest account seq of every owner watched there, one that has seen nothing included)."""
    pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")
    from tests.test_scale_out import kept_by, two

    async with two(pg_url, tmp_path, ScriptedModel(answer), []) as (a, b):
        proc = await a.spawn(owner="alice")
        await kept_by(a, proc.pid)
        leases = b.engine.leases
        assert leases is not None
        dropped: list[int] = []
        leases.accounted = lambda owner, pid, items: dropped.append(items[0][0])  # type: ignore[method-assign]
        on_b = b.account_signals("alice")
        seen: list[AccountSignal] = []
        watching = asyncio.ensure_future(_collect(on_b, 1, seen))
        await asyncio.sleep(0.1)  # (watching, at account seq 0)
        ran = await finish(proc)
        await asyncio.wait_for(watching, 5)  # (the poll runs every 0.2 s)
        assert [(i.seq, i.signal.payload.get("runId")) for i in seen] == [(1, ran)] and dropped == [1]
        await on_b.aclose()


# ------------------------------------------------------------------ the WebSocket


def test_a_websocket_account_subscription_that_fell_behind_goes_on_from_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client reads slowly: its account stream's queue overflows and the kernel ends it. A
    WebSocket subscription is not ended with it, silently (the client would hear of nothing
    again, told nothing): it goes on after the last account seq it sent, from the log."""
    import threading

    from agentloop.server.ws import Connection
    from tests.ws_support import KernelServer, eventually

    monkeypatch.setattr(sig, "BACKLOG", 2)
    released = threading.Event()
    real_send = Connection.send

    async def slow_send(self: Connection, frame: dict[str, Any]) -> bool:
        if frame.get("type") == "sig" and "id" in frame:  # (an account stream's frame)
            while not released.is_set():
                await asyncio.sleep(0.01)
        return await real_send(self, frame)

    monkeypatch.setattr(Connection, "send", slow_send)
    with KernelServer(tmp_path, ScriptedModel(answer)) as server:
        assert server.ctx is not None
        kernel = server.ctx.kernel
        with server.client("alice") as c:
            pid = c.ok("proc.spawn")["pid"]
            assert c.ok("account.subscribe") == {"account": "alice", "after_seq": 0}
            for n in range(1, 5):  # the first is being sent; two wait; the fourth overflows
                c.ok("proc.send", {"pid": pid, "text": f"run {n}"})
                eventually(lambda n=n: server.run(lambda: kernel.account_seq("alice")) == n)  # type: ignore[misc]
            eventually(lambda: not kernel.engine.hub._accounts)  # (the kernel ended the stream)
            released.set()
            got: list[dict[str, Any]] = []
            while len(got) < 4:
                got += [s for s in c.signals_until(pid, sig.RUN_FINISHED) if s["signal"] == sig.RUN_FINISHED]
            assert [s["id"] for s in got] == [1, 2, 3, 4]
            c.ok("proc.send", {"pid": pid, "text": "run 5"})  # and live again after that
            assert [s["id"] for s in c.signals_until(pid, sig.RUN_FINISHED) if s["signal"] == sig.RUN_FINISHED] == [5]


# ------------------------------------------------------------------ SQLite: the cached newest seq


async def test_sqlite_group_commit_members_rolled_back_or_lost_leave_no_gap_or_duplicate(tmp_path: Path) -> None:
    """The SQLite store numbers an owner's account signals from a cached newest seq. Bodies that
    commit in one turn of the loop share one transaction (a group, each a savepoint): a member
    rolled back gives its number to the next, and so does a whole group whose commit failed."""
    import sqlite3

    from agentloop.process.store.sqlite import SQLiteStore

    store = SQLiteStore(str(tmp_path / "a.db"))
    await store.open()
    try:

        async def log(n: int, *, fail: bool = False) -> list[int]:
            async with store.transaction():
                numbers = await store.append_account_events("alice", f"p{n}", [(n, sig.RUN_FINISHED, {})])
                if fail:
                    raise RuntimeError("the body fails after numbering")
                return numbers

        assert await log(1) == [1]
        # one turn: the first commits alone, the others as one group; the second's body fails
        got = await asyncio.gather(log(2), log(3, fail=True), log(4), return_exceptions=True)
        assert got[0] == [2] and isinstance(got[1], RuntimeError) and got[2] == [3]

        def lost() -> None:
            raise sqlite3.OperationalError("disk I/O error")

        store._commit = lost  # type: ignore[method-assign]  # the group's commit fails
        got = await asyncio.gather(log(5), log(6), log(7), return_exceptions=True)
        del store._commit
        assert got[0] == [4] and all(isinstance(g, Exception) for g in got[1:])
        assert await log(8) == [5]  # the lost group's numbers are given again
        assert [(r.seq, r.pid) for r in await store.account_events("alice")] == [
            (1, "p1"),
            (2, "p2"),
            (3, "p4"),
            (4, "p5"),
            (5, "p8"),
        ]
    finally:
        await store.close()
