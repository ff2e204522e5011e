"""SQLite-only behaviour of the store: background WAL checkpoints and the clustered-table migration."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from agentloop.messages import user
from agentloop.process.store import ProcessRecord, SQLiteStore, StoreError
from agentloop.process.store.checkpoint import SAFETY_NET_PAGES, Checkpointer


async def _commit_many(store: SQLiteStore, n: int) -> None:
    async with store.transaction():
        await store.create_process(ProcessRecord(pid="p", owner="a", run_as="a", cwd="/"))
    for i in range(n):
        async with store.transaction():
            await store.append_messages("p", None, [user(f"message {i} " + "x" * 2000)])


def _wal_pages(path: Path) -> int:
    wal = Path(f"{path}-wal")
    return wal.stat().st_size // 4096 if wal.exists() else 0


async def test_writer_leaves_checkpoints_to_the_background(tmp_path: Path) -> None:
    path = tmp_path / "agentloop.db"
    store = SQLiteStore(path)
    await store.open()
    try:
        # the writer itself checkpoints only past the safety net
        assert store.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == SAFETY_NET_PAGES
        checkpointer = store._checkpointer
        assert checkpointer is not None
        await _commit_many(store, 600)
        deadline = time.monotonic() + 10
        while checkpointer.runs < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert checkpointer.runs >= 2
        # the log was copied back into the database file: a new connection sees every row there
        # even after the log is gone
    finally:
        await store.close()
    assert _wal_pages(path) == 0  # close truncates the log
    db = sqlite3.connect(path)
    assert db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 600
    db.close()


async def test_background_checkpoints_let_the_log_start_over(tmp_path: Path) -> None:
    path = tmp_path / "agentloop.db"
    store = SQLiteStore(path)
    await store.open()
    try:
        await _commit_many(store, 300)  # ~600 log pages, under the writer's own threshold
        checkpointer = store._checkpointer
        assert checkpointer is not None
        checkpointer._wake.set()  # as if the 200th commit had just happened
        time.sleep(0.3)  # the writer pauses: the thread copies the whole log back
        async with store.transaction():  # this commit starts the log over
            await store.append_messages("p", None, [user("after the pause")])
        probe = sqlite3.connect(path)
        _, frames, _ = probe.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        probe.close()
        assert frames < 10  # only the last commit's pages: without the thread it would be ~600
    finally:
        await store.close()


def test_checkpointer_on_an_unopenable_path_gives_up_quietly(tmp_path: Path) -> None:
    checkpointer = Checkpointer(str(tmp_path / "missing" / "dir" / "x.db"), interval=0.01)
    checkpointer.start()
    checkpointer.stop()  # returns: the thread ended on its own after failing to connect
    assert checkpointer.runs == 0


async def test_memory_store_has_no_checkpointer() -> None:
    store = SQLiteStore(":memory:")
    await store.open()
    try:
        assert store._checkpointer is None
        await _commit_many(store, 3)
    finally:
        await store.close()


async def test_version_2_database_migrates_to_clustered_tables_keeping_its_rows(tmp_path: Path) -> None:
    """A database written by schema version 2 opens under the current code with every row intact."""
    from agentloop.process.store.schema import LATEST_VERSION, MIGRATIONS, statements

    path = tmp_path / "agentloop.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for version, sql in MIGRATIONS:
        if version > 2:
            break
        for stmt in statements(sql):
            db.execute(stmt)
        db.execute("INSERT INTO schema_version VALUES (?)", (version,))
    db.execute(
        "INSERT INTO processes VALUES ('p', 'alice', 'alice', '/w', NULL, 1, 'ctx', 'idle', NULL, 1, 3, 2, 1, 1.0, 2.0)"
    )
    body = '{"role":"user","content":[{"type":"text","text":"hello"}],"timestamp":0}'
    db.execute("INSERT INTO messages VALUES ('p', 1, 1, NULL, 'user', ?, 1.0)", (body,))
    db.execute("INSERT INTO events VALUES ('p', 1, 'proc.changed', '{}', 1.0)")
    db.execute("INSERT INTO process_kv VALUES ('p', 'k', '[1]')")
    db.close()

    store = SQLiteStore(path)
    await store.open()
    try:
        assert await store.schema_version() == LATEST_VERSION
        record = await store.get_process("p")
        assert record is not None and record.owner == "alice" and record.context == "ctx"
        assert [m.message.text for m in await store.history("p")] == ["hello"]
        assert [e.seq for e in await store.events("p")] == [1]
        assert await store.kv_get("p", "k") == [1]
        async with store.transaction():  # counters carried over: the next message is number 3
            assert await store.append_messages("p", None, [user("again")]) == [3]
        tables = dict(store.db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'").fetchall())
        for name in ("processes", "messages", "events", "message_queue", "process_kv", "pending_tool_calls"):
            assert tables[name].rstrip().endswith("WITHOUT ROWID"), name
    finally:
        await store.close()


async def test_a_file_that_is_not_a_database_is_one_clear_error_naming_it(tmp_path):
    path = tmp_path / "agentloop.db"
    path.write_bytes(b"this is not a database file" * 200)
    store = SQLiteStore(path)
    with pytest.raises(StoreError, match=f"cannot open the database {path}: file is not a database"):
        await store.open()
    await store.close()
    assert path.read_bytes().startswith(b"this is not a database file")  # left as it was


async def test_a_new_database_file_is_readable_by_its_owner_only(tmp_path):
    store = SQLiteStore(tmp_path / "new" / "agentloop.db")
    await store.open()
    await store.close()
    assert (tmp_path / "new" / "agentloop.db").stat().st_mode & 0o777 == 0o600


async def test_a_migration_that_sqlite_rolled_back_itself_reports_its_own_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk or an I/O error ends the transaction inside SQLite; the store must then report
    that error, not a failed ROLLBACK of a transaction that is gone (simulated: the migration's
    own ROLLBACK, then a failing statement)."""
    import agentloop.process.store.sqlite as sqlite_store

    broken = (1, "CREATE TABLE t (a); ROLLBACK; SELECT * FROM missing_table")
    monkeypatch.setattr(sqlite_store, "MIGRATIONS", [broken])
    store = SQLiteStore(str(tmp_path / "agentloop.db"))
    with pytest.raises(StoreError, match="no such table: missing_table"):
        await store.open()


async def test_a_second_runtime_on_the_same_file_is_refused_until_the_first_closes(tmp_path):
    """Without leases two kernels on one SQLite file would both drive its processes (a review ran
    a payment tool twice from two chats on one --data). The second is refused with a clear error;
    other connections (the CLI's account and token commands) are not runtimes and still open."""
    from agentloop import ScriptedModel
    from agentloop.kernel import Kernel

    url = f"sqlite:///{tmp_path}/agentloop.db"
    async with Kernel.open(url, model=ScriptedModel(lambda r: "ok"), workspace=tmp_path):
        with pytest.raises(StoreError, match=r"another agentloop .* is using"):
            async with Kernel.open(url, model=ScriptedModel(lambda r: "ok"), workspace=tmp_path):
                pass
        other = SQLiteStore(tmp_path / "agentloop.db")
        await other.open()
        assert await other.list_processes() == []
        await other.close()
    async with Kernel.open(url, model=ScriptedModel(lambda r: "ok"), workspace=tmp_path) as k:
        assert await k.processes() == []


async def test_a_kernel_that_fails_to_open_lets_go_of_the_database(tmp_path, monkeypatch):
    """Whatever fails once the runtime's lock is held closes the store, lock included: the next
    open in the same process is not refused as 'another agentloop'."""
    from agentloop import ScriptedModel
    from agentloop.kernel import Kernel

    real_init = Kernel.__init__

    def failing(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("setup failed")

    monkeypatch.setattr(Kernel, "__init__", failing)
    url = f"sqlite:///{tmp_path}/agentloop.db"
    with pytest.raises(RuntimeError, match="setup failed"):
        async with Kernel.open(url, model=ScriptedModel(lambda r: "ok"), workspace=tmp_path):
            pass
    monkeypatch.setattr(Kernel, "__init__", real_init)
    async with Kernel.open(url, model=ScriptedModel(lambda r: "ok"), workspace=tmp_path) as k:
        assert await k.processes() == []
