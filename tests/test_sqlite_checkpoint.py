"""The SQLite store checkpoints its write-ahead log in a background thread, not on a commit."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from agentloop.messages import user
from agentloop.process.store import ProcessRecord, SQLiteStore
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
