"""The stores: opening, reopening and migrating a database that other connections share, and
the same answers from PostgreSQL whatever its collation."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import pytest

from agentloop.messages import user
from agentloop.process.store import AccountRecord, ProcessRecord, SQLiteStore, StoreError
from agentloop.process.store import sqlite as sqlite_store
from agentloop.process.store.postgres import PostgresStore
from agentloop.process.store.schema import LATEST_VERSION, MIGRATIONS, statements
from tests.pg_support import PgServer


async def test_a_reopened_store_does_not_reuse_ids_another_connection_took_while_it_was_closed(
    tmp_path: Path,
) -> None:
    """The counters a store caches are checked against ``PRAGMA data_version``, whose value is
    per connection: a store closed and opened again has a new connection whose numbering may
    match the old one's, so what it cached before closing must not survive the reopen."""
    path = tmp_path / "agentloop.db"
    store = SQLiteStore(path)
    await store.open()
    async with store.transaction():
        await store.create_process(ProcessRecord(pid="p1", owner="a", run_as="a", cwd="/"))
        await store.append_messages("p1", None, [user("one")])
    await store.close()
    other = SQLiteStore(path)  # a chat or a CLI command in another process, say
    await other.open()
    async with other.transaction():
        assert await other.append_messages("p1", None, [user("two")]) == [2]
    await other.close()
    await store.open()
    try:
        async with store.transaction():
            assert await store.append_messages("p1", None, [user("three")]) == [3]
        assert [m.message.text for m in await store.history("p1")] == ["one", "two", "three"]
    finally:
        await store.close()


class _Racing(SQLiteStore):
    """A store that, the moment it asks for the write lock to apply its first migration, lets
    another connection (another process opening the same file) migrate the database first."""

    def _migrate(self) -> None:
        raced = False

        def trace(sql: str) -> None:
            nonlocal raced
            if raced or not sql.startswith("BEGIN IMMEDIATE"):
                return
            raced = True
            other = sqlite3.connect(self.path, isolation_level=None)
            other.execute("BEGIN IMMEDIATE")
            for version, migration in MIGRATIONS:
                for stmt in statements(migration, clustered="WITHOUT ROWID"):
                    other.execute(stmt)
                other.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
            other.execute("COMMIT")
            other.close()

        self.db.set_trace_callback(trace)
        try:
            super()._migrate()
        finally:
            self.db.set_trace_callback(None)


async def test_two_processes_opening_a_fresh_database_at_once_both_succeed(tmp_path: Path) -> None:
    """Both read version 0, one takes the write lock and migrates; the other, once it has the
    lock, must see that work done instead of creating the tables again."""
    store = _Racing(tmp_path / "agentloop.db")
    await store.open()
    try:
        assert await store.schema_version() == LATEST_VERSION
        rows = store.db.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
        assert [r[0] for r in rows] == [v for v, _ in MIGRATIONS]
    finally:
        await store.close()


async def test_a_refused_newer_database_stays_refused(tmp_path: Path) -> None:
    """An open refused for a newer schema must leave the store closed: a second ``open()``
    (a retry, or a caller that ignored the first error) must not find a connection left behind
    and go on writing to a schema this code does not know."""
    path = tmp_path / "future.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version VALUES (?)", (LATEST_VERSION + 1,))
    db.commit()
    db.close()
    store = SQLiteStore(path)
    for _ in range(2):
        with pytest.raises(StoreError, match="newer than this agentloop"):
            await store.open()
    with pytest.raises(StoreError, match="not open"):
        await store.schema_version()


async def test_accounts_are_listed_in_the_same_order_on_a_postgresql_database_with_a_language_collation(
    pg_server: PgServer, tmp_path: Path
) -> None:
    """Most PostgreSQL clusters are created with a language's collation (en_US.UTF-8), which
    sorts case-insensitively and skips punctuation; SQLite sorts text by its bytes. A listing by
    name must come out in one order whatever the database's collation."""
    name = "t_" + uuid.uuid4().hex[:16]
    pg_server.admin(f"CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C'")
    url = pg_server.dsn(name)
    names = ["alice", "Bob", "_ops", "a-z", "ab"]
    try:
        orders = []
        for store in (SQLiteStore(tmp_path / "agentloop.db"), PostgresStore(url)):
            await store.open()
            try:
                async with store.transaction():
                    for n in names:
                        await store.create_account(AccountRecord(n))
                orders.append([a.name for a in await store.list_accounts()])
            finally:
                await store.close()
        assert orders[0] == sorted(names)  # by code point
        assert orders[1] == orders[0]
    finally:
        pg_server.drop_database(url)


async def test_a_database_another_process_keeps_locked_is_a_store_error_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the busy timeout, a transaction that cannot take the write lock fails as a StoreError
    (what the store's callers catch) rather than a raw sqlite3 error; once the lock is free the
    store works on, with nothing half-done."""
    # the store waits for the lock ``BUSY_WAIT`` seconds (5) before it gives up; a shorter wait
    # ends the same way (as test_sqlite_busy.py has it), without 5 s of waiting
    monkeypatch.setattr(sqlite_store, "BUSY_WAIT", 0.3)
    store = SQLiteStore(tmp_path / "a.db")
    await store.open()
    try:
        store.db.execute("PRAGMA busy_timeout=50")
        other = sqlite3.connect(tmp_path / "a.db", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process writing, for longer than the timeout
        with pytest.raises(StoreError, match="busy"):
            async with store.transaction():
                await store.kv_set("p1", "k", 1)
        other.execute("COMMIT")
        other.close()
        async with store.transaction():
            await store.kv_set("p1", "k", 2)
        assert await store.kv_get("p1", "k") == 2
    finally:
        await store.close()
