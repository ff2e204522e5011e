"""Durable storage for processes: one schema, a SQLite store now, PostgreSQL later."""

from agentloop.process.store.base import (
    TERMINAL_STATUSES,
    AccountRecord,
    CallStatus,
    EventRow,
    HilRow,
    NoSuchProcess,
    ProcessRecord,
    QueueItem,
    ScheduleRow,
    SegmentRow,
    Store,
    StoredMessage,
    StoreError,
    TokenRecord,
    ToolCallRow,
    WatchRow,
)
from agentloop.process.store.sqlite import SQLiteStore


def open_store(url: str) -> Store:
    """A store from a URL, read as SQLAlchemy does: ``sqlite:///relative/path.db``,
    ``sqlite:////absolute/path.db``, ``sqlite:///:memory:``."""
    if url.startswith("sqlite:///"):
        path = url.removeprefix("sqlite:///")
        if not path:
            raise StoreError(f"store URL {url!r} names no file")
        return SQLiteStore(path)
    raise StoreError(f"unsupported store URL {url!r} (supported: sqlite:///path)")


__all__ = [
    "TERMINAL_STATUSES",
    "AccountRecord",
    "CallStatus",
    "EventRow",
    "HilRow",
    "NoSuchProcess",
    "ProcessRecord",
    "QueueItem",
    "SQLiteStore",
    "ScheduleRow",
    "SegmentRow",
    "Store",
    "StoreError",
    "StoredMessage",
    "TokenRecord",
    "ToolCallRow",
    "WatchRow",
    "open_store",
]
