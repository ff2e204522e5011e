"""The store contract, run against every store implementation (SQLite and PostgreSQL).

A new dialect passes when it is added to ``STORES`` and this file is green. The PostgreSQL
dialect runs on a server the tests start themselves (``tests/conftest.py``), one fresh database per
test; without PostgreSQL binaries its cases are skipped with the reason.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from agentloop.messages import AssistantMessage, TextContent, ToolCall, ToolResultMessage, message_to_json, system, user
from agentloop.process.store import (
    AccountRecord,
    DeviceRecord,
    HilRow,
    NoSuchProcess,
    ProcessRecord,
    ScheduleRow,
    SegmentRow,
    SQLiteStore,
    Store,
    StoreError,
    TokenRecord,
    ToolCallRow,
    WatchRow,
    open_store,
)
from agentloop.process.store.schema import LATEST_VERSION, MIGRATIONS, statements


def _sqlite(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    return lambda: SQLiteStore(tmp_path / "agentloop.db")


def _postgres(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    url = request.getfixturevalue("pg_url")  # a fresh database (or a skip without PostgreSQL)
    return lambda: open_store(url)


# dialect -> (the test's request, a temporary directory) -> a factory of stores on one database
STORES: dict[str, Callable[[pytest.FixtureRequest, Path], Callable[[], Store]]] = {
    "sqlite": _sqlite,
    "postgres": _postgres,
}


@pytest.fixture(params=sorted(STORES))
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    return STORES[request.param](request, tmp_path)


@pytest.fixture
async def store(make_store: Callable[[], Store]) -> AsyncIterator[Store]:
    s = make_store()
    await s.open()
    yield s
    await s.close()


async def spawn(store: Store, pid: str = "p1", owner: str = "alice") -> ProcessRecord:
    rec = ProcessRecord(pid=pid, owner=owner, run_as=owner, cwd="/home/" + owner)
    async with store.transaction():
        await store.create_process(rec)
    got = await store.get_process(pid)
    assert got is not None
    return got


async def test_schema_is_current_and_migration_is_idempotent(make_store):
    s = make_store()
    await s.open()
    assert await s.schema_version() == LATEST_VERSION
    await s.close()
    again = make_store()
    await again.open()  # a second open applies nothing and fails nothing
    assert await again.schema_version() == LATEST_VERSION
    await again.close()


async def test_a_database_of_an_older_schema_keeps_its_rows(tmp_path):
    """Migrating up from the version before the queue's run reason: queued input stays queued."""
    db = sqlite3.connect(tmp_path / "old.db", isolation_level=None)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for version, sql in [m for m in MIGRATIONS if m[0] <= 6]:
        for stmt in statements(sql, clustered="WITHOUT ROWID"):
            db.execute(stmt)
        db.execute("INSERT INTO schema_version VALUES (?)", (version,))
    db.execute("INSERT INTO processes VALUES ('p1', 'a', 'a', '/', NULL, 1, '', 'idle', NULL, 1, 1, 1, 2, 0, 0)")
    db.execute(
        "INSERT INTO message_queue (pid, id, kind, run_id, body, created_at) VALUES ('p1', 1, 'queue', 'r1', ?, 0)",
        (message_to_json(user("waiting")),),
    )
    db.close()
    s = SQLiteStore(tmp_path / "old.db")
    await s.open()
    try:
        assert await s.schema_version() == LATEST_VERSION
        [item] = await s.queue("p1")
        assert (item.message.text, item.run_id, item.reason) == ("waiting", "r1", None)
    finally:
        await s.close()


async def test_a_newer_schema_is_refused(tmp_path):
    db = sqlite3.connect(tmp_path / "future.db")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version VALUES (?)", (LATEST_VERSION + 1,))
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer than this agentloop"):
        await SQLiteStore(tmp_path / "future.db").open()


def test_store_urls(tmp_path):
    assert isinstance(open_store(f"sqlite:///{tmp_path}/x.db"), SQLiteStore)
    with pytest.raises(StoreError, match="unsupported store URL"):
        open_store("mysql://nope")


async def test_writes_need_a_transaction_and_roll_back_whole(store):
    with pytest.raises(StoreError, match=r"inside store\.transaction"):
        await store.create_process(ProcessRecord(pid="x", owner="a", run_as="a", cwd="/"))
    await spawn(store)
    with pytest.raises(RuntimeError):
        async with store.transaction():
            await store.append_messages("p1", "r1", [user("lost")])
            await store.append_event("p1", "proc.changed", {})
            raise RuntimeError("crash in the middle")
    assert await store.history("p1") == [] and await store.events("p1") == []
    async with store.transaction():  # the counters were rolled back too: no gaps
        assert await store.append_messages("p1", "r1", [user("kept")]) == [1]


async def test_transactions_of_other_tasks_wait_and_do_not_mix(store):
    await spawn(store)
    inside = asyncio.Event()
    order: list[str] = []

    async def first() -> None:
        async with store.transaction():
            await store.append_messages("p1", "r", [user("a")])
            inside.set()
            await asyncio.sleep(0.05)  # a transaction body that awaits something (a policy, a device)
            order.append("first")

    async def second() -> None:
        await inside.wait()
        with pytest.raises(StoreError, match=r"inside store\.transaction"):  # not part of the other task's
            await store.append_messages("p1", "r", [user("stray")])
        async with store.transaction():  # waits for the first to commit, instead of failing
            order.append("second")
            await store.append_messages("p1", "r", [user("b")])

    await asyncio.gather(first(), second())
    assert order == ["first", "second"]
    assert [h.message.text for h in await store.history("p1")] == ["a", "b"]
    with pytest.raises(StoreError, match="do not nest"):
        async with store.transaction(), store.transaction():
            pass


async def test_a_key_held_exclusively_excludes_other_workers(make_store):
    """``exclusive``: another worker (a store of its own, in a thread of its own, as in another
    process) taking the same key inside its transaction waits for the first one's commit, so a
    count and the insert it allows cannot interleave with another pair's."""
    store = make_store()
    await store.open()
    order: list[str] = []
    holding = threading.Event()

    async def other_worker() -> None:
        other = make_store()
        await other.open()
        try:
            holding.wait(10)
            async with other.transaction():
                await other.exclusive("schedules of p1")
                order.append("second")
        finally:
            await other.close()

    try:
        await spawn(store)
        with pytest.raises(StoreError, match=r"inside store\.transaction"):
            await store.exclusive("k")
        worker = asyncio.create_task(asyncio.to_thread(asyncio.run, other_worker()))
        async with store.transaction():
            await store.exclusive("schedules of p1")
            holding.set()
            await asyncio.sleep(0.3)
            order.append("first")
        await asyncio.wait_for(worker, 10)
        assert order == ["first", "second"]
    finally:
        await store.close()


async def test_a_killed_process_pid_is_remembered(store):
    """A pid is never given twice: one that a deleted process had is known as killed."""
    await spawn(store, "p1")
    assert not await store.was_killed("p1") and not await store.was_killed("never")
    async with store.transaction():
        await store.delete_process("p1")
    assert await store.was_killed("p1") and await store.get_process("p1") is None


async def test_end_keeps_or_drops_a_body_and_says_when_it_is_durable(make_store):
    # The two halves of a transaction, as the durable runner uses them: a kept body is visible to
    # the store at once; ``end`` returns None when it is committed already, or an awaitable that
    # completes once it is, calling ``settled`` (with None) at that moment. A store may group the
    # steps of concurrent tasks; either way each is on disk when its caller is told so.
    store = make_store()
    await store.open()
    try:
        await spawn(store)
        settled: dict[str, list[BaseException | None]] = {}

        async def step(text: str) -> str:
            scope = store.transaction()
            await scope.begin()
            await store.append_messages("p1", "r", [user(text)])
            pending = scope.end(commit=True, settled=settled.setdefault(text, []).append)
            assert (await store.history("p1"))[-1].message.text == text  # this store sees it at once
            if pending is None:
                assert settled[text] == []  # committed already: the caller follows up itself
                return "now"
            await pending
            assert settled[text] == [None]
            return "later"

        ways = await asyncio.gather(*(step(f"m{i}") for i in range(6)))
        assert set(ways) <= {"now", "later"}
        scope = store.transaction()
        await scope.begin()
        await store.append_messages("p1", "r", [user("dropped")])
        assert scope.end(commit=False) is None
    finally:
        await store.close()
    reopened = make_store()
    await reopened.open()
    try:
        assert sorted(h.message.text for h in await reopened.history("p1")) == [f"m{i}" for i in range(6)]
    finally:
        await reopened.close()


async def test_registry(store):
    await spawn(store, "p1", "alice")
    await spawn(store, "p2", "bob")
    await spawn(store, "p3", "alice")
    assert [p.pid for p in await store.list_processes("alice")] == ["p1", "p3"]
    assert len(await store.list_processes()) == 3
    with pytest.raises(StoreError, match="exists already"):
        await spawn(store, "p1")
    async with store.transaction():
        await store.update_process("p1", state="running", current_run={"run_id": "r1", "generation": 2})
    p1 = await store.get_process("p1")
    assert p1 is not None and p1.state == "running" and p1.current_run == {"run_id": "r1", "generation": 2}
    with pytest.raises(NoSuchProcess):
        async with store.transaction():
            await store.update_process("nope", state="idle")
    with pytest.raises(StoreError, match="cannot update"):
        async with store.transaction():
            await store.update_process("p1", owner="mallory")
    assert await store.get_process("nope") is None


async def test_history_ids_paging_and_replacement(store):
    await spawn(store)
    msgs = [user(f"m{i}") for i in range(10)]
    async with store.transaction():
        assert await store.append_messages("p1", "r1", msgs[:4]) == [1, 2, 3, 4]
        assert await store.append_messages("p1", "r2", msgs[4:]) == [5, 6, 7, 8, 9, 10]
    hist = await store.history("p1")
    assert [h.id for h in hist] == list(range(1, 11))
    assert [h.message for h in hist] == msgs and hist[0].run_id == "r1" and hist[-1].run_id == "r2"
    page = await store.history("p1", limit=3)
    assert [h.id for h in page] == [8, 9, 10]
    older = await store.history("p1", limit=3, before=8)
    assert [h.id for h in older] == [5, 6, 7]
    summary = system("summary of m0-m5", "summary")
    async with store.transaction():
        new_id = await store.replace_messages("p1", 1, 6, summary)
    hist = await store.history("p1")
    assert new_id == 6 and [h.id for h in hist] == [6, 7, 8, 9, 10] and hist[0].message == summary
    async with store.transaction():
        gen = await store.new_generation("p1")
        await store.append_messages("p1", None, [user("fresh")])
    assert gen == 2 and [h.message.text for h in await store.history("p1")] == ["fresh"]
    assert await store.history("p1", generation=1) == []


async def test_deleting_a_runs_messages_keeps_the_others_and_the_numbering(store):
    await spawn(store)
    async with store.transaction():
        await store.append_messages("p1", "r1", [user("a"), user("b")])
        await store.append_messages("p1", "heartbeat:7", [system("check in", "event"), user("ok")])
        await store.append_messages("p1", "r2", [user("c")])
    async with store.transaction():
        assert await store.delete_run_messages("p1", "heartbeat:7") == 2
        assert await store.delete_run_messages("p1", "nope") == 0
        assert await store.append_messages("p1", "r3", [user("d")]) == [6]  # numbering goes on
    assert [(h.id, h.message.text) for h in await store.history("p1")] == [(1, "a"), (2, "b"), (5, "c"), (6, "d")]


async def test_messages_rewritten_in_place_keep_their_ids_and_order(store):
    await spawn(store)
    async with store.transaction():
        await store.append_messages("p1", "r1", [user("a"), user("b"), user("c")])
        await store.append_messages("p1", "r1", [user("d")])
    cleared = ToolResultMessage(tool_call_id="c1", tool_name="Read", content=[TextContent(text="[cleared]")])
    async with store.transaction():
        await store.update_messages("p1", [(2, cleared), (4, user("D"))])
        await store.update_messages("p1", [])
    hist = await store.history("p1")
    assert [h.id for h in hist] == [1, 2, 3, 4] and hist[1].message == cleared
    assert [h.message.text for h in hist] == ["a", "[cleared]", "c", "D"] and hist[1].run_id == "r1"


async def test_every_message_kind_round_trips(store):
    await spawn(store)
    msgs = [
        user("hi"),
        AssistantMessage(content=[TextContent(text="t"), ToolCall(id="c", name="Read", arguments={"path": "x"})]),
        ToolResultMessage(tool_call_id="c", tool_name="Read", content=[TextContent(text="r")], is_error=True),
        system("note", "event"),
    ]
    async with store.transaction():
        await store.append_messages("p1", "r", msgs)
    assert [h.message for h in await store.history("p1")] == msgs


async def test_tool_call_claims_ignore_late_results(store):
    await spawn(store)
    rows = [
        ToolCallRow(f"d{i}", "p1", "r1", i, f"c{i}", "Shell", "shell.exec", {"command": f"echo {i}"}) for i in (1, 0, 2)
    ]
    async with store.transaction():
        await store.register_calls(rows)
    assert [r.position for r in await store.calls("p1", "r1")] == [0, 1, 2]
    async with store.transaction():
        assert await store.set_call_status("d0", "dispatched", expect=("registered",), deadline=123.0)
        assert not await store.set_call_status("d0", "dispatched", expect=("registered",))  # claimed once only
        assert await store.set_call_status("d0", "completed", expect=("dispatched",), result={"ok": 1})
        assert not await store.set_call_status("d0", "failed", expect=("registered", "dispatched"))  # late
    d0 = next(r for r in await store.calls("p1") if r.dispatch_id == "d0")
    assert d0.status == "completed" and d0.result == {"ok": 1} and d0.deadline == 123.0 and d0.terminal
    async with store.transaction():
        await store.delete_calls("p1", "r1")
    assert await store.calls("p1") == []


async def test_queue_is_fifo(store):
    await spawn(store)
    async with store.transaction():
        a = await store.enqueue("p1", "queue", user("a"))
        b = await store.enqueue("p1", "steer", user("b"), run_id="r9")
        c = await store.enqueue("p1", "system", system("c", "event"), reason="schedule")
    assert (a, b, c) == (1, 2, 3)
    items = await store.queue("p1")
    assert [(i.kind, i.message.text, i.run_id, i.reason) for i in items] == [
        ("queue", "a", None, None),
        ("steer", "b", "r9", None),
        ("system", "c", None, "schedule"),
    ]
    async with store.transaction():
        assert await store.dequeue("p1", b)
        assert not await store.dequeue("p1", b)
    assert [i.id for i in await store.queue("p1")] == [1, 3]


async def test_pending_approvals(store):
    await spawn(store)
    row = HilRow(
        "h1", "p1", "r1", "d1", "c1", "Shell", "shell.exec", {"command": "rm -rf x"}, "fp", ["destructive"], "why"
    )
    async with store.transaction():
        await store.put_hil(row)
    assert (await store.hils("p1"))[0].args == {"command": "rm -rf x"}
    async with store.transaction():
        assert await store.delete_hil("h1")
        assert not await store.delete_hil("h1")
    assert await store.hils("p1") == []


async def test_kv_and_segments(store):
    await spawn(store)
    async with store.transaction():
        await store.kv_set("p1", "overrides", [{"match": "shell.exec"}])
        await store.kv_set("p1", "overrides", [{"match": "fs.*"}])
        await store.add_segment(SegmentRow("s1", "p1", 1, "compaction", 1, 9, "var/x.jsonl.gz", 9))
    assert await store.kv_get("p1", "overrides") == [{"match": "fs.*"}]
    assert await store.kv_get("p1", "missing") is None
    assert (await store.segments("p1"))[0].archive_path == "var/x.jsonl.gz"
    async with store.transaction():
        await store.kv_delete("p1", "overrides")
    assert await store.kv_get("p1", "overrides") is None


async def test_kv_many_reads_the_keys_that_exist_of_a_short_or_a_long_list(store):
    """A few keys (one lookup each) and more than 64 (one ``IN`` list, past SQLite's limit of
    compound terms): the same answer, missing and repeated keys included, another process's not."""
    await spawn(store)
    await spawn(store, "p2")
    async with store.transaction():
        for i in range(0, 80, 2):
            await store.kv_set("p1", f"k{i}", i)
        await store.kv_set("p2", "k1", "other")
    assert await store.kv_many("p1", ["k0", "k1", "k2", "k0"]) == {"k0": 0, "k2": 2}
    many = [f"k{i}" for i in range(80)]
    assert await store.kv_many("p1", many) == {f"k{i}": i for i in range(0, 80, 2)}
    assert await store.kv_many("p1", []) == {}


async def test_signal_log_is_gap_free_and_resumable(store):
    await spawn(store)
    await spawn(store, "p2")
    async with store.transaction():
        for i in range(5):
            assert await store.append_event("p1", "proc.run.stream", {"i": i}) == i + 1
        assert await store.append_event("p2", "proc.changed", {}) == 1  # per-process sequence
    assert [e.seq for e in await store.events("p1", after_seq=2)] == [3, 4, 5]
    assert [e.payload["i"] for e in await store.events("p1", after_seq=0, limit=2)] == [0, 1]


async def test_delete_removes_everything_and_state_survives_reopen(make_store):
    s = make_store()
    await s.open()
    await spawn(s, "keep")
    await spawn(s, "gone")
    async with s.transaction():
        for pid in ("keep", "gone"):
            await s.append_messages(pid, "r", [user("x")])
            await s.append_event(pid, "proc.changed", {})
            await s.enqueue(pid, "queue", user("q"))
            await s.kv_set(pid, "k", 1)
            await s.register_calls([ToolCallRow(f"d-{pid}", pid, "r", 0, "c", "Shell", "shell.exec", {})])
            await s.put_hil(HilRow(f"h-{pid}", pid, "r", f"d-{pid}", "c", "Shell", "shell.exec", {}, "-"))
            await s.add_segment(SegmentRow(f"s-{pid}", pid, 1, "compaction", 1, 1, "var/x.jsonl.gz", 1))
        await s.delete_process("gone")
    await s.close()
    s2 = make_store()
    await s2.open()
    assert await s2.get_process("gone") is None
    assert await s2.history("keep") != [] and await s2.events("gone") == [] and await s2.queue("gone") == []
    # every table of the process is emptied (common.PROCESS_TABLES); the other process keeps its rows
    assert await s2.kv_get("gone", "k") is None and await s2.kv_get("keep", "k") == 1
    assert await s2.calls("gone") == [] and await s2.hils("gone") == [] and await s2.segments("gone") == []
    assert len(await s2.calls("keep")) == len(await s2.hils("keep")) == len(await s2.segments("keep")) == 1
    async with s2.transaction():  # counters continue where they were
        assert await s2.append_messages("keep", "r", [user("y")]) == [2]
    await s2.close()


async def test_accounts_are_unique_and_listed(store: Store) -> None:
    async with store.transaction():
        await store.create_account(AccountRecord("admin", admin=True))
        await store.create_account(AccountRecord("alice"))
    with pytest.raises(StoreError, match="already exists"):
        async with store.transaction():
            await store.create_account(AccountRecord("alice"))
    assert [(a.name, a.admin) for a in await store.list_accounts()] == [("admin", True), ("alice", False)]
    assert await store.get_account("nobody") is None
    assert (await store.get_account("alice")) is not None


async def test_what_an_account_had_spent_when_a_period_began_is_kept_from_the_first_look(store: Store) -> None:
    async with store.transaction():
        assert await store.spent_before("alice", "2026-11", 1.25) == 1.25
    async with store.transaction():
        assert await store.spent_before("alice", "2026-11", 9.0) == 1.25  # the first look's stands
        assert await store.spent_before("alice", "2026-12", 9.0) == 9.0  # a new period
        assert await store.spent_before("bob", "2026-11", 0.0) == 0.0
    with pytest.raises(StoreError, match="transaction"):
        await store.spent_before("carol", "2026-11", 1.0)


async def test_tokens_are_found_by_hash_and_revoked_once(store: Store) -> None:
    async with store.transaction():
        await store.create_account(AccountRecord("alice"))
        await store.add_token(TokenRecord("t1", "alice", "h1", "laptop"))
        await store.add_token(TokenRecord("t2", "alice", "h2"))
    found = await store.token_by_hash("h1")
    assert found is not None and (found.id, found.account, found.label, found.revoked_at) == (
        "t1",
        "alice",
        "laptop",
        None,
    )
    assert await store.token_by_hash("nope") is None
    with pytest.raises(StoreError, match="exists already"):  # the same hash twice: one error on every store
        async with store.transaction():
            await store.add_token(TokenRecord("t3", "alice", "h1"))
    async with store.transaction():
        assert await store.revoke_token("t1", 123.0)
        assert not await store.revoke_token("t1", 124.0)
        assert not await store.revoke_token("missing", 124.0)
    revoked = await store.token_by_hash("h1")
    assert revoked is not None and revoked.revoked_at == 123.0
    assert [t.id for t in await store.list_tokens("alice")] == ["t1", "t2"]
    assert await store.list_tokens("bob") == []


async def test_the_device_registry_binds_one_token_and_remembers_when_a_device_was_seen(store: Store) -> None:
    async with store.transaction():
        assert await store.set_device_token("alice", "laptop", "d1", "dh1", 10.0)
        await store.device_seen("bob", "box", 11.0, "Box", "the big one")  # connected without a token
    found = await store.device_by_token("dh1")
    assert found == DeviceRecord("alice", "laptop", "", "", "d1", 10.0, None, None)
    async with store.transaction():
        assert await store.set_device_token("alice", "laptop", "d2", "dh2", 12.0)  # a new token replaces it
        await store.device_seen("alice", "laptop", 13.0, "Laptop", "mine")
        await store.device_seen("alice", "laptop", 14.0)  # leaving: label and description kept
    assert await store.device_by_token("dh1") is None
    laptop = DeviceRecord("alice", "laptop", "Laptop", "mine", "d2", 10.0, 13.0, 14.0)
    assert await store.list_devices("alice") == [laptop]
    async with store.transaction():
        assert await store.set_device_token("alice", "laptop", None, None, 15.0)  # revoked
        assert not await store.set_device_token("alice", "laptop", None, None, 16.0)
        assert not await store.set_device_token("alice", "ghost", None, None, 16.0)
    assert await store.device_by_token("dh2") is None
    assert [(d.owner, d.name, d.token_id) for d in await store.list_devices()] == [
        ("alice", "laptop", None),
        ("bob", "box", None),
    ]
    assert (await store.list_devices("bob"))[0].first_seen_at == 11.0
    async with store.transaction():  # forgotten: the row goes, and the token with it
        assert await store.set_device_token("alice", "laptop", "d3", "dh3", 17.0)
        assert await store.forget_device("alice", "laptop")
        assert not await store.forget_device("alice", "laptop")
        assert not await store.forget_device("alice", "box")  # another owner's name is not hers
    assert await store.device_by_token("dh3") is None
    assert [(d.owner, d.name) for d in await store.list_devices()] == [("bob", "box")]


async def test_schedules_are_listed_soonest_first_and_claimed_once(store: Store) -> None:
    await spawn(store, "p1")
    await spawn(store, "p2")
    async with store.transaction():
        await store.add_schedule(ScheduleRow("s-late", "p1", "later", 300.0, every=60.0, name="hourly"))
        await store.add_schedule(ScheduleRow("s-soon", "p1", "soon", 100.0))
        await store.add_schedule(ScheduleRow("s-other", "p2", "other", 200.0))
    assert [s.id for s in await store.schedules("p1")] == ["s-soon", "s-late"]
    late = (await store.schedules("p1"))[1]
    assert (late.text, late.every, late.name, late.next_due) == ("later", 60.0, "hourly", 300.0)
    assert [s.id for s in await store.due_schedules(200.0)] == ["s-soon", "s-other"]  # every process, inclusive
    assert [s.id for s in await store.due_schedules(None, limit=1)] == ["s-soon"]
    async with store.transaction():
        assert await store.set_schedule_due("s-late", 360.0, expect=300.0)
        assert not await store.set_schedule_due("s-late", 420.0, expect=300.0)  # moved already: a stale claim
        assert await store.delete_schedule("s-soon")
        assert not await store.delete_schedule("s-soon")
    assert [(s.id, s.next_due) for s in await store.schedules("p1")] == [("s-late", 360.0)]


async def test_watches_are_found_by_either_end_and_remember_how_far_they_read(store: Store) -> None:
    for pid in ("w", "src", "x"):
        await spawn(store, pid)
    async with store.transaction():
        await store.add_watch(WatchRow("w1", "w", "src", "proc.run.finished", once=True, seen_seq=3))
        await store.add_watch(WatchRow("w2", "x", "src", "proc.run.started", once=False))
        await store.add_watch(WatchRow("w3", "w", "x", "proc.run.finished"))
    assert [w.id for w in await store.watches(pid="w")] == ["w1", "w3"]
    assert [w.id for w in await store.watches(source_pid="src")] == ["w1", "w2"]
    assert [w.id for w in await store.watches(pid="w", source_pid="src")] == ["w1"]
    assert len(await store.watches()) == 3
    w2 = (await store.watches(pid="x"))[0]
    assert (w2.source_pid, w2.signal, w2.once, w2.seen_seq) == ("src", "proc.run.started", False, 0)
    async with store.transaction():
        assert await store.set_watch_seen("w1", 9)
        assert await store.delete_watch("w3") and not await store.delete_watch("w3")
        assert not await store.set_watch_seen("w3", 1)
    assert [(w.id, w.seen_seq) for w in await store.watches(pid="w")] == [("w1", 9)]


async def test_last_event_seq(store: Store) -> None:
    await spawn(store, "p1")
    assert await store.last_event_seq("p1") == 0
    async with store.transaction():
        await store.append_events("p1", [("proc.changed", {}), ("proc.changed", {})])
    assert await store.last_event_seq("p1") == 2


async def test_pruning_a_log_keeps_what_a_watch_has_still_to_read_and_the_sequence(store: Store) -> None:
    for pid in ("p1", "w"):
        await spawn(store, pid)
    async with store.transaction():
        await store.append_events("p1", [("proc.changed", {"n": n}) for n in range(5)])
        await store.add_watch(WatchRow("w1", "w", "p1", "proc.run.finished", once=True, seen_seq=3))
    async with store.transaction():
        assert await store.prune_events("p1") == 3  # seq 4 and 5: the watch has not read them yet
    assert [e.seq for e in await store.events("p1")] == [4, 5]
    async with store.transaction():
        assert await store.delete_watch("w1")
        assert await store.prune_events("p1") == 2
        assert await store.prune_events("w") == 0
        assert await store.append_events("p1", [("proc.changed", {})]) == [6]  # numbering goes on
    assert [e.seq for e in await store.events("p1")] == [6] and await store.last_event_seq("p1") == 6


async def test_pruning_the_oldest_of_a_log_keeps_the_rest_and_what_a_watch_has_still_to_read(store: Store) -> None:
    for pid in ("p1", "w"):
        await spawn(store, pid)
    async with store.transaction():
        await store.append_events("p1", [("proc.changed", {"n": n}) for n in range(10)])
    async with store.transaction():
        assert await store.prune_events("p1", through=4) == 4
    assert [e.seq for e in await store.events("p1")] == [5, 6, 7, 8, 9, 10]
    async with store.transaction():
        await store.add_watch(WatchRow("w1", "w", "p1", "proc.run.finished", once=False, seen_seq=6))
        assert await store.prune_events("p1", through=8) == 2  # 5 and 6: the watch has read to 6
        assert await store.prune_events("p1", through=0) == 0
    assert [e.seq for e in await store.events("p1")] == [7, 8, 9, 10] and await store.last_event_seq("p1") == 10


async def test_deleting_a_process_drops_its_schedules_and_every_watch_touching_it(store: Store) -> None:
    for pid in ("a", "b", "c"):
        await spawn(store, pid)
    async with store.transaction():
        await store.add_schedule(ScheduleRow("sa", "a", "tick", 1.0))
        await store.add_schedule(ScheduleRow("sb", "b", "tick", 1.0))
        await store.add_watch(WatchRow("a-on-b", "a", "b", "proc.run.finished"))
        await store.add_watch(WatchRow("b-on-a", "b", "a", "proc.run.finished"))
        await store.add_watch(WatchRow("b-on-c", "b", "c", "proc.run.finished"))
        await store.delete_process("a")
    assert [s.id for s in await store.due_schedules(None)] == ["sb"]
    assert [w.id for w in await store.watches()] == ["b-on-c"]


async def test_ids_past_any_stored_one_find_nothing_instead_of_failing(store: Store) -> None:
    # A client's Last-Event-ID or paging cursor can be any 64-bit number (the server accepts up
    # to 2**63 - 1); a dialect whose id columns are narrower must still answer, with nothing.
    await spawn(store)
    async with store.transaction():
        await store.append_messages("p1", "r", [user("a")])
        await store.append_event("p1", "proc.changed", {})
        await store.enqueue("p1", "queue", user("q"))
    huge = 2**63 - 1
    assert await store.events("p1", after_seq=huge) == []
    assert [h.message.text for h in await store.history("p1", before=huge, limit=5)] == ["a"]
    async with store.transaction():
        assert not await store.dequeue("p1", huge)
