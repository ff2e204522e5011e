"""The shared schema (``schema.py``) applied to PostgreSQL.

The migrations are the SQLite store's, statement for statement; ``{clustered}`` reads as nothing
(PostgreSQL tables are heaps whatever one writes). Several stores may open a fresh database at
the same moment (two workers starting), so each migration runs in a transaction that first takes
an advisory lock and then re-reads the version: the second opener waits, then finds the work done.
"""

from __future__ import annotations

from typing import Any

from agentloop.process.store.base import StoreError
from agentloop.process.store.schema import LATEST_VERSION, MIGRATIONS, statements

# pg_advisory_xact_lock's key for "migrating the agentloop schema" (any fixed 64-bit number)
MIGRATION_LOCK = 0x6167_656E_746C_6F6F  # "agentloo"


async def migrate(conn: Any) -> int:
    """Bring the database on ``conn`` (an asyncpg connection) to ``LATEST_VERSION``; returns the
    version found before. ``StoreError`` for a database newer than this code."""
    found: int | None = None
    while True:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
            await conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            current = int(await conn.fetchval("SELECT MAX(version) FROM schema_version") or 0)
            if found is None:
                found = current
            if current > LATEST_VERSION:
                raise StoreError(
                    f"the database schema is version {current}, newer than this agentloop ({LATEST_VERSION}): upgrade"
                )
            pending = [(v, sql) for v, sql in MIGRATIONS if v > current]
            if not pending:
                return found
            version, sql = pending[0]
            for stmt in statements(sql, clustered=""):
                await conn.execute(stmt)
            await conn.execute("INSERT INTO schema_version (version) VALUES ($1)", version)
