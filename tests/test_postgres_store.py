"""What only the PostgreSQL store has to show (the shared contract is ``store_conformance``): its
URLs and errors never show a password, its schema is SQLite's, concurrent openers migrate once,
two stores on one database keep per-process ids unique and claims single, a lost connection fails
the commit it carried without wedging the store."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
from pathlib import Path

import pytest

pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")

import asyncpg

from agentloop.messages import user
from agentloop.process.store import ProcessRecord, SQLiteStore, StoreError, ToolCallRow, open_store
from agentloop.process.store.postgres import PostgresStore
from agentloop.process.store.schema import LATEST_VERSION
from tests.pg_support import PgServer


async def _spawn(store: PostgresStore, pid: str = "p1") -> None:
    async with store.transaction():
        await store.create_process(ProcessRecord(pid=pid, owner="alice", run_as="alice", cwd="/"))


def test_urls_choose_the_store_and_never_show_the_password() -> None:
    for url in ("postgresql://bob:hunter2@db.example:5432/agents", "postgres://bob:hunter2@db.example/agents"):
        store = open_store(url)
        assert isinstance(store, PostgresStore)
        assert "hunter2" not in repr(store) and "hunter2" not in store.url and "bob:***@" in store.url
    q = open_store("postgresql://db.example/agents?user=bob&password=hunter2&sslmode=require")
    assert isinstance(q, PostgresStore) and "hunter2" not in q.url and "sslmode=require" in q.url
    with pytest.raises(StoreError, match="unsupported store URL") as info:
        open_store("mysql://bob:hunter2@db.example/agents")
    assert "hunter2" not in str(info.value)
    with pytest.raises(StoreError, match="unsupported store URL") as info:
        open_store("mysql://db.example/agents?api_key=SECRET")  # no userinfo: still masked
    assert "SECRET" not in str(info.value)


def test_without_asyncpg_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "asyncpg", None)  # import asyncpg now raises ImportError
    monkeypatch.delitem(sys.modules, "agentloop.process.store.postgres")
    with pytest.raises(StoreError, match=r"install agentloop\[postgres\]"):
        open_store("postgresql://localhost/agents")


async def test_connection_errors_are_store_errors_without_the_password(pg_server: PgServer) -> None:
    missing = pg_server.dsn("no_such_database", password="hunter2")
    with pytest.raises(StoreError, match="cannot open the database") as info:
        await open_store(missing).open()
    text = str(info.value)
    assert "no_such_database" in text and "hunter2" not in text and info.value.__cause__ is None
    nobody = f"postgresql://bob:hunter2@127.0.0.1:{pg_server.port + 1 if pg_server.port < 65535 else 1}/x"
    with pytest.raises(StoreError, match="cannot open the database") as info:
        await open_store(nobody).open()
    assert "hunter2" not in str(info.value)


async def test_a_newer_schema_is_refused(pg_url: str) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        await conn.execute("INSERT INTO schema_version VALUES ($1)", LATEST_VERSION + 1)
    finally:
        await conn.close()
    with pytest.raises(StoreError, match="newer than this agentloop"):
        await open_store(pg_url).open()


async def _pg_schema(url: str) -> dict[str, object]:
    conn = await asyncpg.connect(url)
    try:
        columns = await conn.fetch(
            "SELECT table_name, column_name, data_type, is_nullable FROM information_schema.columns"
            " WHERE table_schema = 'public' ORDER BY table_name, ordinal_position"
        )
        keys = await conn.fetch(
            "SELECT tc.table_name, kcu.column_name FROM information_schema.table_constraints tc"
            " JOIN information_schema.key_column_usage kcu ON kcu.constraint_name = tc.constraint_name"
            " AND kcu.table_name = tc.table_name AND kcu.table_schema = tc.table_schema"
            " WHERE tc.constraint_type = 'PRIMARY KEY' AND tc.table_schema = 'public'"
            " ORDER BY tc.table_name, kcu.ordinal_position"
        )
        indexes = await conn.fetch(
            "SELECT indexname FROM pg_indexes WHERE schemaname = 'public'"
            " AND indexname NOT LIKE '%_pkey' AND indexname NOT LIKE '%_key'"
        )
    finally:
        await conn.close()
    tables: dict[str, list[tuple[str, str, bool]]] = {}
    for r in columns:
        tables.setdefault(r[0], []).append((r[1], r[2], r[3] == "YES"))
    pks: dict[str, list[str]] = {}
    for r in keys:
        pks.setdefault(r[0], []).append(r[1])
    return {"tables": tables, "keys": pks, "indexes": sorted(r[0] for r in indexes)}


def _sqlite_schema(path: Path) -> dict[str, object]:
    db = sqlite3.connect(path)
    names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
    tables: dict[str, list[tuple[str, str, bool]]] = {}
    pks: dict[str, list[str]] = {}
    for name in names:
        info = db.execute(f"PRAGMA table_info({name})").fetchall()
        tables[name] = [(c[1], c[2].lower(), not c[3] and not c[5]) for c in info]
        pks[name] = [c[1] for c in sorted((c for c in info if c[5]), key=lambda c: c[5])]
    indexes = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")]
    db.close()
    return {"tables": tables, "keys": {k: v for k, v in pks.items() if v}, "indexes": sorted(indexes)}


async def test_the_schema_is_the_sqlite_schema(pg_url: str, tmp_path: Path) -> None:
    pg = open_store(pg_url)
    await pg.open()
    await pg.close()
    lite = SQLiteStore(tmp_path / "a.db")
    await lite.open()
    await lite.close()
    got, want = await _pg_schema(pg_url), _sqlite_schema(tmp_path / "a.db")
    assert got["tables"] == want["tables"]  # same tables, columns in order, types, nullability
    assert got["keys"] == want["keys"] and got["indexes"] == want["indexes"]
    assert set(want["tables"]) >= {"processes", "messages", "events", "pending_tool_calls", "tokens"}  # type: ignore[operator]


async def test_concurrent_opens_of_a_fresh_database_migrate_once(pg_url: str) -> None:
    stores = [open_store(pg_url) for _ in range(4)]
    await asyncio.gather(*(s.open() for s in stores))
    try:
        assert {await s.schema_version() for s in stores} == {LATEST_VERSION}
        conn = await asyncpg.connect(pg_url)
        try:
            versions = [r[0] for r in await conn.fetch("SELECT version FROM schema_version ORDER BY version")]
        finally:
            await conn.close()
        assert versions == list(range(1, LATEST_VERSION + 1))
    finally:
        for s in stores:
            await s.close()


async def test_two_stores_on_one_database_serialise_writers_of_a_process(pg_url: str) -> None:
    a, b = PostgresStore(pg_url), PostgresStore(pg_url)
    await a.open()
    await b.open()
    try:
        await _spawn(a)
        order: list[str] = []

        async def slow_writer() -> list[int]:
            async with a.transaction():
                ids = await a.append_messages("p1", "r", [user("a1"), user("a2")])
                await asyncio.sleep(0.2)  # holds the process row; b must wait, not take ids 1 and 2
                order.append("a commits")
            return ids

        async def other_writer() -> list[int]:
            await asyncio.sleep(0.05)
            async with b.transaction():
                ids = await b.append_messages("p1", "r", [user("b1")])
                order.append("b appended")
                seqs = await b.append_events("p1", [("proc.changed", {})])
            assert seqs == [1]
            return ids

        got_a, got_b = await asyncio.gather(slow_writer(), other_writer())
        assert (got_a, got_b) == ([1, 2], [3]) and order == ["a commits", "b appended"]
        assert [h.message.text for h in await b.history("p1")] == ["a1", "a2", "b1"]

        async with a.transaction():
            await a.register_calls([ToolCallRow("d1", "p1", "r", 0, "c1", "echo", "echo", {})])

        async def claim(store: PostgresStore) -> bool:
            async with store.transaction():
                won = await store.set_call_status("d1", "dispatched", expect=("registered",))
                await asyncio.sleep(0.1)  # both claims overlap
                return won

        assert sorted(await asyncio.gather(claim(a), claim(b))) == [False, True]  # one claim wins
    finally:
        await a.close()
        await b.close()


async def test_a_lost_connection_fails_its_commit_and_the_store_goes_on(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    await store.open()
    try:
        await _spawn(store)
        scope = store.transaction()
        await scope.begin()
        await store.append_messages("p1", "r", [user("lost")])
        conn = await asyncpg.connect(pg_url)
        try:  # the server drops the transaction's connection (a restart, a network cut)
            own_pid = await store._write().fetchval("SELECT pg_backend_pid()")
            await conn.execute("SELECT pg_terminate_backend($1)", own_pid)
        finally:
            await conn.close()
        outcome: list[BaseException | None] = []
        pending = scope.end(commit=True, settled=outcome.append)
        assert pending is not None
        with pytest.raises(StoreError, match="the commit failed"):
            await pending
        assert len(outcome) == 1 and outcome[0] is not None  # told, whether or not anyone awaited
        assert await store.history("p1") == []
        async with store.transaction():  # the store is usable, and the lost ids were not taken
            assert await store.append_messages("p1", "r", [user("kept")]) == [1]
    finally:
        await store.close()


async def test_closing_with_a_body_open_keeps_nothing_of_it(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    await store.open()
    await _spawn(store)
    scope = store.transaction()
    await scope.begin()
    await store.append_messages("p1", "r", [user("never")])
    await store.close()
    with pytest.raises(StoreError, match="was the store closed"):
        scope.end(commit=True)
    again = PostgresStore(pg_url)
    await again.open()
    try:
        assert await again.history("p1") == []
    finally:
        await again.close()
