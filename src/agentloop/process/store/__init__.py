"""Durable storage for processes: one schema, a SQLite store and a PostgreSQL store."""

from agentloop.process.store.base import (
    MAX_SEQ,
    TERMINAL_STATUSES,
    AccountEventRow,
    AccountRecord,
    CallStatus,
    DeviceRecord,
    DutyLease,
    EventRow,
    HilRow,
    Lease,
    LiveListener,
    NoSuchProcess,
    ProcessBusy,
    ProcessRecord,
    QueueItem,
    RelayBatch,
    ScheduleRow,
    SegmentRow,
    Store,
    StoredMessage,
    StoreError,
    TokenRecord,
    ToolCallRow,
    UsageTotals,
    WatchRow,
)
from agentloop.process.store.pgurl import redact
from agentloop.process.store.sqlite import SQLiteStore


def open_store(url: str) -> Store:
    """A store from a URL, read as SQLAlchemy does: ``sqlite:///relative/path.db``,
    ``sqlite:////absolute/path.db``, ``sqlite:///:memory:``; ``postgresql://user:password@host:port/db``
    (or ``postgres://``) for PostgreSQL, which needs the ``postgres`` extra (asyncpg)."""
    if not isinstance(url, str):  # (a path object, a None from an unset setting)
        raise TypeError(f"store URL must be a string such as sqlite:///agentloop.db, got {type(url).__name__}")
    if url.startswith("sqlite:///"):
        path = url.removeprefix("sqlite:///")
        if not path:
            raise StoreError(f"store URL {url!r} names no file")
        return SQLiteStore(path)
    if url.startswith(("postgresql://", "postgres://")):
        try:  # asyncpg is optional: imported only when asked for
            from agentloop.process.store.postgres import PostgresStore
        except ImportError as exc:
            if exc.name != "asyncpg":
                raise
            raise StoreError(
                "a PostgreSQL store needs asyncpg: install agentloop[postgres] (pip install 'agentloop[postgres]')"
            ) from None
        return PostgresStore(url)
    raise StoreError(f"unsupported store URL {redact(url)!r} (supported: sqlite:///path, postgresql://user@host/db)")


__all__ = [
    "MAX_SEQ",
    "TERMINAL_STATUSES",
    "AccountEventRow",
    "AccountRecord",
    "CallStatus",
    "DeviceRecord",
    "DutyLease",
    "EventRow",
    "HilRow",
    "Lease",
    "LiveListener",
    "NoSuchProcess",
    "ProcessBusy",
    "ProcessRecord",
    "QueueItem",
    "RelayBatch",
    "SQLiteStore",
    "ScheduleRow",
    "SegmentRow",
    "Store",
    "StoreError",
    "StoredMessage",
    "TokenRecord",
    "ToolCallRow",
    "UsageTotals",
    "WatchRow",
    "open_store",
]
