"""The SQLite store: the embedded default, one file, WAL, one writer.

Statements run on the event loop thread with the standard ``sqlite3`` module. A commit in WAL
mode with ``synchronous=NORMAL`` costs tens of microseconds, less than handing each statement to
a worker thread would (which is all ``aiosqlite`` adds), and a transaction never awaits anything
but the store's own lock, so ticks of different processes cannot interleave inside one. Tasks
that commit in the same turn of the event loop share one commit (see ``SQLiteStore._begin``).
Waiting for another program's write lock is the exception: it awaits between attempts, so the
loop runs on meanwhile (``SQLiteStore._wait_for_write_lock``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import logging
import os
import sqlite3
import time
from collections.abc import Awaitable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from agentloop.messages import Message, message_from_json, message_to_json
from agentloop.process.store.base import (
    MAX_SEQ,
    AccountEventRow,
    AccountRecord,
    ApprovalAuditRow,
    CallStatus,
    DeviceRecord,
    DutyLease,
    EventRow,
    HilRow,
    Lease,
    NoSuchProcess,
    ProcessRecord,
    QueueItem,
    QueueKind,
    ScheduleRow,
    SegmentRow,
    Settled,
    Store,
    StoredMessage,
    StoreError,
    TokenRecord,
    ToolCallRow,
    Transaction,
    UsageTotals,
    WatchRow,
    audit_row,
    audit_values,
)
from agentloop.process.store.checkpoint import SAFETY_NET_PAGES, Checkpointer
from agentloop.process.store.common import (
    ACCOUNT_HILS,
    ACCOUNT_USAGE,
    CALL_COLUMNS,
    DEVICE_COLUMNS,
    FOLD_USAGE,
    HIL_COLUMNS,
    KV_ADD,
    LAGGING_WATCHES,
    OWNER_KV,
    PROCESS_COLUMNS,
    PROCESS_TABLES,
    SCHEDULE_COLUMNS,
    SEGMENT_COLUMNS,
    TOKEN_COLUMNS,
    UPDATABLE_FIELDS,
    USAGE_ADDED,
    USAGE_COLUMNS,
    WATCH_COLUMNS,
    account_row,
    call_row,
    dumps,
    hil_row,
    process_record,
    usage_increments,
    usage_totals,
    watch_row,
)
from agentloop.process.store.schema import (
    AUDIT_COLUMNS,
    AUDIT_WIDTH,
    LATEST_VERSION,
    MIGRATIONS,
    audit_filters,
    audit_query,
    statements,
)

log = logging.getLogger("agentloop.store")

_COUNTER_COLUMNS = ("next_message_id", "next_event_seq", "next_queue_id")
_INSERT_MESSAGE = (
    "INSERT INTO messages (pid, id, generation, run_id, role, body, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)"
)
# How long a transaction waits for another process's write lock before it fails (``StoreError``),
# and how much of that SQLite may spend blocking the event loop's thread in one attempt.
BUSY_WAIT = 5.0
_BUSY_TIMEOUT_MS = 5
_INSERT_EVENT = "INSERT INTO events (pid, seq, signal, payload, created_at) VALUES (?, ?, ?, ?, ?)"
_INSERT_ACCOUNT_EVENT = (
    "INSERT INTO account_events (owner, seq, pid, pid_seq, signal, payload, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_FOLD_USAGE = FOLD_USAGE.replace("$1", "?1")
_ACCOUNT_USAGE = ACCOUNT_USAGE.replace("$1", "?1")
_OWNER_KV = OWNER_KV.format(owner="?", key="?")
_KV_ADD = KV_ADD.format(pid="?1", key="?2", value="?3", generation="?4")


def _unwritable(path: str) -> str | None:
    """Why SQLite could not write the database at ``path``, if it could not. SQLite opens a
    read-only file without complaint and fails only at the first write, which may be a run's
    commit long after start-up (its answer lost); every use of the store writes, so say it at
    open. ``os.access`` also sees a read-only file system, where even root cannot write."""
    if not os.access(path, os.W_OK):
        return "it is read-only (its permissions or its file system); make it writable or use another database"
    # WAL mode writes beside the file: its -wal and -shm files, created in the folder when missing
    companions = [path + "-wal", path + "-shm"]
    for companion in companions:
        if os.path.exists(companion) and not os.access(companion, os.W_OK):
            return f"{companion} is read-only; make it writable"
    folder = os.path.dirname(os.path.abspath(path))
    if not all(os.path.exists(c) for c in companions) and not os.access(folder, os.W_OK | os.X_OK):
        return f"its folder {folder} is read-only, and SQLite writes its journal there"
    return None


@functools.cache
def _update(columns: tuple[str, ...]) -> str:
    """A registry UPDATE of one process: ``column = ?``, or ``column = column + ?`` for an
    increment (a pending field named ``+column``: ``update_process``'s ``usage_added``). Made
    once per column list (a few kinds of step write the same few lists)."""
    sets = ", ".join(f"{c[1:]} = {c[1:]} + ?" if c[0] == "+" else f"{c} = ?" for c in columns)
    return f"UPDATE processes SET {sets} WHERE pid = ?"


@functools.cache
def _kv_many(count: int) -> str:
    """The query of ``kv_many`` for ``count`` keys (made once: it is asked for at every run): a
    lookup of the primary key per key, which SQLite runs faster than ``key IN (...)`` (no
    ephemeral table of the list). A long list (past SQLite's limit of compound terms) is one ``IN``."""
    if count > 64:
        return f"SELECT key, value FROM process_kv WHERE pid = ? AND key IN ({', '.join('?' * count)})"
    return " UNION ALL ".join(
        f"SELECT key, value FROM process_kv WHERE pid = ?1 AND key = ?{i + 2}" for i in range(count)
    )


class _Transaction(Transaction):
    """``store.transaction()``: a plain class, cheaper than a generator-based context manager."""

    __slots__ = ("store",)

    def __init__(self, store: SQLiteStore) -> None:
        self.store = store

    def begin(self) -> Coroutine[Any, Any, None]:
        return self.store._begin()  # (its coroutine itself: no frame of its own around it, per step)

    def end(self, commit: bool, settled: Settled | None = None) -> Awaitable[None] | None:
        return self.store._end(commit, settled)


class _Group:
    """Transactions of several tasks sharing one SQLite transaction, committed together. Each
    member waits on a future of its own: a member cancelled while waiting cancels only that."""

    __slots__ = ("due", "members")

    def __init__(self) -> None:
        self.members: list[tuple[asyncio.Future[None], Settled | None]] = []
        self.due = False  # the commit came while a member's body held the store: it commits on release


# ``idle_processes``: each condition is one of the store's own signs of something under way or
# waiting; the newest message and signal are read by their keys (``ORDER BY id/seq DESC LIMIT 1``),
# not by scanning a long history
_IDLE_SINCE = (
    f"SELECT {PROCESS_COLUMNS} FROM processes p"
    " WHERE p.state = 'idle' AND p.current_run IS NULL"
    " AND p.created_at < :before AND p.updated_at < :before"
    " AND NOT EXISTS (SELECT 1 FROM message_queue q WHERE q.pid = p.pid)"
    " AND NOT EXISTS (SELECT 1 FROM pending_hil h WHERE h.pid = p.pid)"
    " AND NOT EXISTS (SELECT 1 FROM pending_tool_calls c WHERE c.pid = p.pid)"
    " AND NOT EXISTS (SELECT 1 FROM schedules s WHERE s.pid = p.pid)"
    " AND NOT EXISTS (SELECT 1 FROM signal_watches w WHERE w.pid = p.pid OR w.source_pid = p.pid)"
    " AND COALESCE((SELECT m.created_at FROM messages m WHERE m.pid = p.pid ORDER BY m.id DESC LIMIT 1), 0)"
    " < :before"
    " AND COALESCE((SELECT e.created_at FROM events e WHERE e.pid = p.pid ORDER BY e.seq DESC LIMIT 1), 0)"
    " < :before"
)
_IDLE_AMONG = " AND p.pid IN (SELECT value FROM json_each(:pids))"
_IDLE_ORDER = " ORDER BY p.updated_at, p.pid"


class SQLiteStore(Store):
    """``SQLiteStore(path)``; ``":memory:"`` for a throwaway database."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._db: sqlite3.Connection | None = None
        self._lock = asyncio.Lock()
        self._tx_task: asyncio.Task[Any] | None = None  # the task whose transaction is open
        # ... and its loop: ``asyncio.current_task(loop)`` skips the running loop's lookup, which
        # costs a ``getpid`` system call on Python 3.11 (every write statement checks its task)
        self._tx_loop: asyncio.AbstractEventLoop | None = None
        # Per-process counters as last committed by this connection: pid -> [next message id,
        # next event seq, next queue id, history generation]. Valid while no other connection has
        # committed (``PRAGMA data_version``, checked when each transaction begins).
        self._known: dict[str, list[int]] = {}
        # owner -> the newest account seq as last committed by this connection (valid as ``_known``
        # is), so that numbering an account signal is a plain INSERT: reading the owner's newest
        # in the statement (``INSERT … SELECT MAX(seq) + 1 … RETURNING``) cost four times as much
        self._known_accounts: dict[str, int] = {}
        self._data_version = -1
        # The open transaction's view: counters taken so far, and registry columns to write. Both
        # go to the process row in one UPDATE at commit (or before a read of the registry).
        self._tx_counters: dict[str, list[int]] = {}
        self._tx_base: dict[str, list[int]] = {}  # the counters as the process row holds them now
        self._tx_fields: dict[str, dict[str, Any]] = {}
        self._tx_deleted: set[str] = set()
        self._tx_accounts: dict[str, int] = {}  # owner -> the newest account seq the body numbered
        self._checkpointer: Checkpointer | None = None
        self._runtime_lock: int | None = None  # the lock file's descriptor (see ``hold_runtime``)
        # Group commit (see ``_begin``): the task whose commit opened this turn of the event loop,
        # and the group the other tasks' transactions of the same turn join.
        self._committer: asyncio.Task[Any] | None = None
        self._group: _Group | None = None
        self._member = False  # the open transaction is a savepoint inside ``_group``

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError("the store is not open")
        return self._db

    async def open(self) -> None:
        if self._db is not None:
            return
        try:
            self._open()
        except (sqlite3.Error, OSError, StoreError) as exc:
            if self._db is not None:  # (a refused schema too: a second open() must not find it open)
                self._db.close()
                self._db = None
            if isinstance(exc, StoreError):
                raise
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise StoreError(f"cannot open the database {self.path}: {reason}") from exc

    def _open(self) -> None:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            # every conversation is in here: readable by its owner only (SQLite gives its WAL and
            # shared-memory files the same permissions)
            with contextlib.suppress(FileExistsError):
                os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            refusal = _unwritable(self.path)
            if refusal is not None:
                raise StoreError(f"cannot open the database {self.path}: {refusal}")
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db = db
        # ``PRAGMA data_version`` numbers are per connection: the new one's may equal the last one
        # this store saw, though other connections committed while it was closed
        self._known.clear()
        self._known_accounts.clear()
        self._data_version = -1
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("PRAGMA busy_timeout=5000")  # (the migration's wait; see below)
        db.execute("PRAGMA temp_store=MEMORY")  # a group member's savepoint journal stays in memory
        self._migrate()
        db.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")  # from now on, longer waits await (``_begin``)
        if self.path != ":memory:":
            db.execute(f"PRAGMA wal_autocheckpoint={SAFETY_NET_PAGES}")
            self._checkpointer = Checkpointer(self.path)
            self._checkpointer.start()

    def _migrate(self) -> None:
        db = self.db
        db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        current = self._found_version()
        for version, sql in MIGRATIONS:
            if version <= current:
                continue
            db.execute("BEGIN IMMEDIATE")
            try:
                # read again under the write lock: another process opening the same file may have
                # migrated it since (two stores opening an old database at once)
                current = self._found_version()
                if version > current:
                    for stmt in statements(sql, clustered="WITHOUT ROWID"):
                        db.execute(stmt)
                    db.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:  # a full disk or an I/O error rolls back by itself: keep its error
                    db.execute("ROLLBACK")
                raise

    def _found_version(self) -> int:
        """The database's schema version; ``StoreError`` if it is newer than this code."""
        current = int(self.db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0)
        if current > LATEST_VERSION:
            raise StoreError(
                f"the database schema is version {current}, newer than this agentloop ({LATEST_VERSION}): upgrade"
            )
        return current

    def hold_runtime(self) -> None:
        # an advisory lock on a file beside the database, released when the store closes or its
        # process dies (a crash leaves no stale claim behind)
        if self.path == ":memory:" or self._runtime_lock is not None:
            return
        fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if not isinstance(exc, BlockingIOError):
                raise StoreError(f"cannot lock {self.path}.lock: {exc.strerror or exc}") from exc
            raise StoreError(
                f"another agentloop (a chat or a server) is using {self.path}: stop it first, or talk to"
                " it through its server (agentloop chat --server URL)"
            ) from None
        self._runtime_lock = fd

    async def close(self) -> None:
        if self._group is not None and self._lock.locked():  # a member's body is still open: it cannot be kept
            self._abandon_group(StoreError("the store was closed before the group could commit"))
        elif self._group is not None:
            self._commit_group()
        if self._checkpointer is not None:
            self._checkpointer.stop()
            self._checkpointer = None
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):  # leave a short log behind; busy is fine too
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()
            self._db = None
        if self._runtime_lock is not None:
            os.close(self._runtime_lock)
            self._runtime_lock = None

    async def schema_version(self) -> int:
        row = self.db.execute("SELECT MAX(version) FROM schema_version").fetchone()
        return int(row[0] or 0)

    def transaction(self) -> _Transaction:
        return _Transaction(self)

    async def _begin(self) -> None:
        """Open a transaction, alone or as a member of this loop turn's group.

        A commit costs more than most transaction bodies (a WAL frame per page, the write lock
        taken and given back). When several tasks commit in the same turn of the event loop (many
        processes whose model answers arrive together), the first commits on its own and the
        others become savepoints of one transaction that commits when the loop comes round again:
        one commit and fewer pages for the lot. A task alone on the loop (or committing twice in a
        row) never waits for a group. The group holds SQLite's write lock until that next turn, so
        one event loop should not open two stores on the same file (the second would wait on the
        lock the first can only release once the loop runs)."""
        loop = asyncio.get_running_loop()
        me = asyncio.current_task(loop)
        if self._tx_task is not None and self._tx_task is me:
            raise StoreError("transactions do not nest")
        await self._lock.acquire()  # another task's transaction: wait for it to end
        try:
            db = self.db
            if self._group is not None and not db.in_transaction:  # SQLite rolled the group back by itself
                self._abandon_group(StoreError("the transaction was rolled back by SQLite"))
            if self._group is None:
                try:
                    db.execute("BEGIN IMMEDIATE")
                except sqlite3.OperationalError as exc:
                    await self._wait_for_write_lock(db, exc)
                version = db.execute("PRAGMA data_version").fetchone()[0]
                if version != self._data_version:  # another connection committed: what we knew may be stale
                    self._known.clear()
                    self._known_accounts.clear()
                    self._data_version = version
                if self._committer is not None and self._committer is not me:
                    self._group = _Group()
                    loop.call_soon(self._commit_group)
            if self._group is not None:
                db.execute("SAVEPOINT member")
                self._member = True
        except BaseException:
            self._lock.release()
            raise
        self._tx_task = me
        self._tx_loop = loop

    async def _wait_for_write_lock(self, db: sqlite3.Connection, busy: sqlite3.OperationalError) -> None:
        """``BEGIN IMMEDIATE`` again until another program lets go of the write lock, without
        blocking the loop; ``busy`` is the first attempt's error.

        SQLite's own busy handler sleeps in the calling thread, which here is the event loop's:
        while another program (an admin command, a backup) held the lock, every stream, timer and
        model call of the runtime would stand still. So the connection waits only briefly by
        itself (``_BUSY_TIMEOUT_MS``) and longer waits happen here, between attempts, for up to
        ``BUSY_WAIT`` seconds in all."""
        deadline = time.monotonic() + BUSY_WAIT
        pause = 0.001
        while True:
            if busy.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() >= deadline:
                raise StoreError(f"the database {self.path} is busy: {busy}; try again") from busy
            await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.05)
            try:
                db.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                busy = exc

    def _end(self, commit: bool, settled: Settled | None) -> Awaitable[None] | None:
        member, self._member = self._member, False
        task, self._tx_task = self._tx_task, None
        loop = self._tx_loop or asyncio.get_running_loop()
        try:
            db = self.db
            if not commit:
                self._rollback(member)
                return None
            try:
                self._flush()
                db.execute("RELEASE member" if member else "COMMIT")
            except BaseException:  # a failed commit must not leave the transaction open
                self._rollback(member)
                raise
            known = self._known
            known.update(self._tx_counters)
            for pid in self._tx_deleted:
                known.pop(pid, None)
            if self._tx_accounts:
                self._known_accounts.update(self._tx_accounts)
            if not member:
                self._committed(task, loop)
                return None
            group = self._group
            assert group is not None
            done = loop.create_future()
            group.members.append((done, settled))
            return done
        finally:
            self._tx_counters.clear()
            self._tx_base.clear()
            self._tx_fields.clear()
            self._tx_deleted.clear()
            self._tx_accounts.clear()
            self._lock.release()
            if member and self._group is not None and self._group.due:
                # not from here: the member's caller applies its cache updates when end() returns,
                # and the group's follow-ups (signals, tool starts) must see them
                self._group.due = False
                loop.call_soon(self._commit_group)

    def _rollback(self, member: bool) -> None:
        """Undo the open body: the whole transaction, or a member's savepoint only. Some errors
        (disk full, I/O) make SQLite roll back the whole transaction by itself: then the group
        the member belonged to is lost as well, and fails at once."""
        db = self.db
        if not member:
            if db.in_transaction:
                db.execute("ROLLBACK")
            return
        if db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK TO member")
                db.execute("RELEASE member")
                return
        self._abandon_group(StoreError("the transaction was rolled back by SQLite"))

    def _committed(self, task: asyncio.Task[Any] | None, loop: asyncio.AbstractEventLoop) -> None:
        """After each real commit (by ``task``, on ``loop``): mark this loop turn as having one, tell
        the checkpointer."""
        if self._committer is None:
            loop.call_soon(self._next_turn)
        self._committer = task
        if self._checkpointer is not None:
            self._checkpointer.committed()

    def _next_turn(self) -> None:
        self._committer = None

    def _commit_group(self) -> None:
        group = self._group
        if group is None:
            return  # committed already (by ``close``)
        if self._lock.locked():  # a member's body is open (awaiting something): commit when it ends
            group.due = True
            return
        try:
            self._commit()
        except BaseException as exc:
            self._abandon_group(exc)
            return
        self._group = None
        if self._checkpointer is not None:
            self._checkpointer.committed()
        self._settle_group(group, None)

    def _abandon_group(self, error: BaseException) -> None:
        """The group's transaction is gone or cannot be kept: roll back what is left of it and
        fail every member."""
        group, self._group = self._group, None
        with contextlib.suppress(sqlite3.Error):
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
        if group is not None:
            self._settle_group(group, error)

    def _settle_group(self, group: _Group, error: BaseException | None) -> None:
        """Tell every member how its group ended: first each one's follow-up, then its waiter."""
        if error is not None:
            self._known.clear()  # nothing of the group is stored: forget what we knew
            self._known_accounts.clear()
        for _, settled in group.members:
            if settled is not None:
                try:
                    settled(error)
                except Exception:  # one member's follow-up must not keep the others from theirs
                    log.exception("after a group commit")
        failure = None if error is None else StoreError(f"the commit failed: {error}")
        for done, _ in group.members:
            if done.done():
                continue  # its task was cancelled while waiting
            if failure is None:
                done.set_result(None)
            else:
                done.set_exception(failure)

    def _commit(self) -> None:
        self.db.execute("COMMIT")

    def _write(self) -> sqlite3.Connection:
        task = self._tx_task
        if task is None or task is not asyncio.current_task(self._tx_loop):
            raise StoreError("writes must happen inside store.transaction()")
        return self.db

    def _counters(self, pid: str) -> list[int]:
        """The open transaction's counters of a process (loaded once, then kept in memory): this
        connection is the only writer while its transaction is open."""
        counters = self._tx_counters.get(pid)
        if counters is None:
            if pid in self._tx_deleted:
                raise NoSuchProcess(pid)
            known = self._known.get(pid)
            if known is None:
                row = self.db.execute(
                    "SELECT next_message_id, next_event_seq, next_queue_id, history_generation FROM processes"
                    " WHERE pid = ?",
                    (pid,),
                ).fetchone()
                if row is None:
                    raise NoSuchProcess(pid)
                known = list(row)
            counters = self._tx_counters[pid] = list(known)
            self._tx_base[pid] = list(known)
        return counters

    def _flush(self) -> None:
        """Write the open transaction's registry changes: one UPDATE per process touched."""
        db = self.db
        fields = self._tx_fields
        base = self._tx_base
        for pid, counters in self._tx_counters.items():
            written = base[pid]
            sets = fields.pop(pid, None)
            if sets is None and written == counters:
                continue
            cols = [*(sets or ()), *_COUNTER_COLUMNS]
            values = [*(sets.values() if sets else ()), *counters[:3]]
            if sets is not None:
                cols.append("updated_at")
                values.append(time.time())
            db.execute(_update(tuple(cols)), (*values, pid))
            written[:] = counters
        for pid, sets in fields.items():  # fields of a process whose counters were not loaded
            cols, values = [*sets, "updated_at"], [*sets.values(), time.time()]
            db.execute(_update(tuple(cols)), (*values, pid))
        fields.clear()

    def _read_registry(self) -> sqlite3.Connection:
        """The connection, with the open transaction's registry changes written (read your writes)."""
        if self._tx_fields or self._tx_counters:
            self._flush()  # (cheap when nothing changed since the last flush)
        return self.db

    # -- registry -------------------------------------------------------------------------------

    async def create_process(self, record: ProcessRecord) -> None:
        now = time.time()
        try:
            self._write().execute(
                "INSERT INTO processes (pid, owner, run_as, cwd, parent_pid, interactive, context, state, current_run,"
                " history_generation, next_message_id, next_event_seq, next_queue_id, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1, 1, 1, ?, ?)",
                (
                    record.pid,
                    record.owner,
                    record.run_as,
                    record.cwd,
                    record.parent_pid,
                    int(record.interactive),
                    record.context,
                    record.state,
                    dumps(record.current_run) if record.current_run is not None else None,
                    record.history_generation,
                    record.created_at or now,
                    now,
                ),
            )
        except sqlite3.IntegrityError as exc:
            raise StoreError(f"process {record.pid} exists already") from exc
        self._tx_deleted.discard(record.pid)
        self._tx_counters[record.pid] = [1, 1, 1, record.history_generation]
        self._tx_base[record.pid] = [1, 1, 1, record.history_generation]

    async def get_process(self, pid: str) -> ProcessRecord | None:
        row = self._read_registry().execute(f"SELECT {PROCESS_COLUMNS} FROM processes WHERE pid = ?", (pid,)).fetchone()
        return process_record(row) if row else None

    async def list_processes(self, owner: str | None = None) -> list[ProcessRecord]:
        db = self._read_registry()
        if owner is None:
            rows = db.execute(f"SELECT {PROCESS_COLUMNS} FROM processes ORDER BY created_at, pid")
        else:
            rows = db.execute(
                f"SELECT {PROCESS_COLUMNS} FROM processes WHERE owner = ? ORDER BY created_at, pid", (owner,)
            )
        return [process_record(r) for r in rows.fetchall()]

    async def count_processes(self, owner: str, *, top_level_only: bool = False) -> int:
        sql = "SELECT count(*) FROM processes WHERE owner = ? AND state <> 'killed'"
        if top_level_only:
            sql += " AND parent_pid IS NULL"
        row = self._read_registry().execute(sql, (owner,)).fetchone()
        return int(row[0])

    async def update_process(self, pid: str, **fields: Any) -> None:
        if not UPDATABLE_FIELDS.issuperset(fields):
            raise StoreError(f"cannot update process fields {sorted(set(fields) - UPDATABLE_FIELDS)}")
        self._write()
        counters = self._counters(pid)  # NoSuchProcess now, not at commit
        pending = self._tx_fields.setdefault(pid, {})
        added = usage_increments(fields[USAGE_ADDED]) if USAGE_ADDED in fields else None
        for key, value in fields.items():
            if key == USAGE_ADDED:
                continue  # (after the totals set in the same call: the sum is set, as on PostgreSQL)
            if key in USAGE_COLUMNS:  # a total set replaces what this transaction added before
                pending.pop("+" + key, None)
            if key == "current_run":
                value = dumps(value) if value is not None else None
            elif key == "interactive":
                value = int(value)
            elif key == "history_generation":
                counters[3] = value
            pending[key] = value
        if added is not None:  # increments ("+column"), or added to a total this transaction set
            for column, amount in added.items():
                if column in pending:
                    pending[column] += amount
                else:
                    pending["+" + column] = pending.get("+" + column, 0) + amount

    async def delete_process(self, pid: str) -> None:
        self._write()
        db = self._read_registry()  # (totals this transaction wrote are folded too)
        db.execute(_FOLD_USAGE, (pid,))
        for table in PROCESS_TABLES:
            db.execute(f"DELETE FROM {table} WHERE pid = ?", (pid,))
        db.execute("DELETE FROM signal_watches WHERE pid = ? OR source_pid = ?", (pid, pid))
        db.execute("DELETE FROM processes WHERE pid = ?", (pid,))
        db.execute("INSERT OR IGNORE INTO killed_pids (pid, killed_at) VALUES (?, ?)", (pid, time.time()))
        self._tx_counters.pop(pid, None)
        self._tx_base.pop(pid, None)
        self._tx_fields.pop(pid, None)
        self._tx_deleted.add(pid)

    async def account_usage(self, owner: str) -> UsageTotals:
        return usage_totals(self._read_registry().execute(_ACCOUNT_USAGE, (owner,)).fetchone())

    async def spent_before(self, account: str, period: str, spent: float) -> float:
        db = self._write()
        db.execute(
            "INSERT INTO account_periods (account, period, spent_before) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
            (account, period, float(spent)),
        )
        row = db.execute(
            "SELECT spent_before FROM account_periods WHERE account = ? AND period = ?", (account, period)
        ).fetchone()
        return float(row[0])

    async def was_killed(self, pid: str) -> bool:
        return self.db.execute("SELECT 1 FROM killed_pids WHERE pid = ?", (pid,)).fetchone() is not None

    # -- history --------------------------------------------------------------------------------

    def _generation(self, pid: str) -> int:
        if self._tx_task is not None and self._tx_task is asyncio.current_task(self._tx_loop):
            return self._counters(pid)[3]
        row = self._read_registry().execute("SELECT history_generation FROM processes WHERE pid = ?", (pid,)).fetchone()
        if row is None:
            raise NoSuchProcess(pid)
        return int(row[0])

    async def append_messages(self, pid: str, run_id: str | None, messages: list[Message]) -> list[int]:
        if not messages:
            return []
        db = self._write()
        counters = self._counters(pid)
        first, generation = counters[0], counters[3]
        counters[0] = first + len(messages)
        now = time.time()
        if len(messages) == 1:
            m = messages[0]
            db.execute(
                _INSERT_MESSAGE,
                (pid, first, generation, run_id, m.role, message_to_json(m), now),
            )
            return [first]
        db.executemany(
            _INSERT_MESSAGE,
            [(pid, first + i, generation, run_id, m.role, message_to_json(m), now) for i, m in enumerate(messages)],
        )
        return list(range(first, counters[0]))

    async def history(
        self, pid: str, *, generation: int | None = None, limit: int | None = None, before: int | None = None
    ) -> list[StoredMessage]:
        if generation is None:  # the current one, looked up by the same statement
            sql = (
                "SELECT id, generation, run_id, body FROM messages WHERE pid = ?"
                " AND generation = (SELECT history_generation FROM processes WHERE pid = ?)"
            )
            args: list[Any] = [pid, pid]
            db = self._read_registry()
        else:
            sql = "SELECT id, generation, run_id, body FROM messages WHERE pid = ? AND generation = ?"
            args = [pid, generation]
            db = self.db
        if before is not None:
            sql += " AND id < ?"
            args.append(before)
        if limit is not None:
            sql += " ORDER BY id DESC LIMIT ?"
            args.append(limit)
            rows = db.execute(sql, args).fetchall()
            rows.reverse()
        else:
            rows = db.execute(sql + " ORDER BY id", args).fetchall()
        if not rows and generation is None:
            self._generation(pid)  # NoSuchProcess for an unknown process
        return [StoredMessage(r[0], r[1], r[2], message_from_json(r[3])) for r in rows]

    async def replace_messages(self, pid: str, from_id: int, to_id: int, replacement: Message) -> int:
        db = self._write()
        gen = self._generation(pid)
        db.execute("DELETE FROM messages WHERE pid = ? AND id BETWEEN ? AND ?", (pid, from_id, to_id))
        db.execute(
            _INSERT_MESSAGE,
            (pid, to_id, gen, None, replacement.role, message_to_json(replacement), time.time()),
        )
        return to_id

    async def update_messages(self, pid: str, updates: list[tuple[int, Message]]) -> None:
        self._write().executemany(
            "UPDATE messages SET role = ?, body = ? WHERE pid = ? AND id = ?",
            [(m.role, message_to_json(m), pid, i) for i, m in updates],
        )

    async def delete_run_messages(self, pid: str, run_id: str) -> int:
        cursor = self._write().execute("DELETE FROM messages WHERE pid = ? AND run_id = ?", (pid, run_id))
        return cursor.rowcount

    async def truncate_messages(self, pid: str, after_id: int) -> int:
        cursor = self._write().execute("DELETE FROM messages WHERE pid = ? AND id > ?", (pid, after_id))
        return cursor.rowcount

    async def new_generation(self, pid: str) -> int:
        db = self._write()
        counters = self._counters(pid)
        gen = counters[3] + 1
        db.execute("DELETE FROM messages WHERE pid = ?", (pid,))
        db.execute("UPDATE processes SET history_generation = ? WHERE pid = ?", (gen, pid))
        counters[3] = self._tx_base[pid][3] = gen
        return gen

    # -- tool calls -----------------------------------------------------------------------------

    async def register_calls(self, rows: list[ToolCallRow]) -> None:
        now = time.time()
        self._write().executemany(
            "INSERT INTO pending_tool_calls (dispatch_id, pid, run_id, position, tool_call_id, tool_name, syscall,"
            " args, status, deadline, result, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    r.dispatch_id,
                    r.pid,
                    r.run_id,
                    r.position,
                    r.tool_call_id,
                    r.tool_name,
                    r.syscall,
                    dumps(r.args),
                    r.status,
                    r.deadline,
                    dumps(r.result) if r.result is not None else None,
                    r.created_at or now,
                )
                for r in rows
            ],
        )

    async def calls(self, pid: str, run_id: str | None = None) -> list[ToolCallRow]:
        sql = f"SELECT {CALL_COLUMNS} FROM pending_tool_calls WHERE pid = ?"
        args: list[Any] = [pid]
        if run_id is not None:
            sql += " AND run_id = ?"
            args.append(run_id)
        rows = self.db.execute(sql + " ORDER BY run_id, position", args).fetchall()
        return [call_row(r) for r in rows]

    async def set_call_status(
        self,
        dispatch_id: str,
        status: CallStatus,
        *,
        expect: tuple[CallStatus, ...],
        result: dict[str, Any] | None = None,
        deadline: float | None = None,
    ) -> bool:
        marks = ", ".join("?" for _ in expect)
        cur = self._write().execute(
            f"UPDATE pending_tool_calls SET status = ?, result = COALESCE(?, result), deadline = COALESCE(?, deadline)"
            f" WHERE dispatch_id = ? AND status IN ({marks})",
            (status, dumps(result) if result is not None else None, deadline, dispatch_id, *expect),
        )
        return cur.rowcount == 1

    async def delete_calls(self, pid: str, run_id: str | None = None) -> None:
        if run_id is None:
            self._write().execute("DELETE FROM pending_tool_calls WHERE pid = ?", (pid,))
        else:
            self._write().execute("DELETE FROM pending_tool_calls WHERE pid = ? AND run_id = ?", (pid, run_id))

    # -- input queue ----------------------------------------------------------------------------

    async def enqueue(
        self, pid: str, kind: QueueKind, message: Message, run_id: str | None = None, reason: str | None = None
    ) -> int:
        db = self._write()
        counters = self._counters(pid)
        item_id = counters[2]
        counters[2] = item_id + 1
        db.execute(
            "INSERT INTO message_queue (pid, id, kind, run_id, body, created_at, reason) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (pid, item_id, kind, run_id, message_to_json(message), time.time(), reason),
        )
        return item_id

    async def queue(self, pid: str) -> list[QueueItem]:
        rows = self.db.execute(
            "SELECT id, kind, run_id, body, created_at, reason FROM message_queue WHERE pid = ? ORDER BY id", (pid,)
        ).fetchall()
        return [QueueItem(r[0], r[1], r[2], message_from_json(r[3]), r[4], r[5]) for r in rows]

    async def dequeue(self, pid: str, item_id: int) -> bool:
        cur = self._write().execute("DELETE FROM message_queue WHERE pid = ? AND id = ?", (pid, item_id))
        return cur.rowcount == 1

    # -- approvals ------------------------------------------------------------------------------

    async def put_hil(self, row: HilRow) -> None:
        self._write().execute(
            "INSERT INTO pending_hil (request_id, pid, run_id, dispatch_id, tool_call_id, tool_name, syscall, args,"
            " fingerprint, tags, reason, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.request_id,
                row.pid,
                row.run_id,
                row.dispatch_id,
                row.tool_call_id,
                row.tool_name,
                row.syscall,
                dumps(row.args),
                row.fingerprint,
                dumps(row.tags),
                row.reason,
                row.created_at or time.time(),
            ),
        )

    async def hils(self, pid: str) -> list[HilRow]:
        rows = self.db.execute(
            f"SELECT {HIL_COLUMNS} FROM pending_hil WHERE pid = ? ORDER BY created_at, request_id", (pid,)
        ).fetchall()
        return [hil_row(r) for r in rows]

    async def account_hils(self, owner: str) -> list[HilRow]:
        rows = self._read_registry().execute(ACCOUNT_HILS.format(owner="?"), (owner,)).fetchall()
        return [hil_row(r) for r in rows]

    async def delete_hil(self, request_id: str) -> bool:
        cur = self._write().execute("DELETE FROM pending_hil WHERE request_id = ?", (request_id,))
        return cur.rowcount == 1

    # -- the approvals audit --------------------------------------------------------------------

    async def add_approval_audit(self, row: ApprovalAuditRow) -> None:
        self._write().execute(
            f"INSERT INTO approval_audit ({AUDIT_COLUMNS}) VALUES ({', '.join('?' * AUDIT_WIDTH)})",
            audit_values(row),
        )

    async def approval_audit(
        self,
        owner: str,
        *,
        limit: int,
        pid: str | None = None,
        since: float | None = None,
        decision: str | None = None,
        answered_by: str | None = None,
        before: str | None = None,
    ) -> list[ApprovalAuditRow]:
        filters = audit_filters(pid, since, decision, answered_by, before)
        sql, args = audit_query(lambda n: "?", owner, limit, filters)
        return [audit_row(r) for r in self.db.execute(sql, args).fetchall()]

    # -- key-value ------------------------------------------------------------------------------

    async def kv_get(self, pid: str, key: str) -> Any | None:
        row = self.db.execute("SELECT value FROM process_kv WHERE pid = ? AND key = ?", (pid, key)).fetchone()
        return json.loads(row[0]) if row else None

    async def kv_many(self, pid: str, keys: Sequence[str]) -> dict[str, Any]:
        if not keys:
            return {}
        rows = self.db.execute(_kv_many(len(keys)), (pid, *keys)).fetchall()
        return {key: json.loads(value) for key, value in rows}

    async def kv_set(self, pid: str, key: str, value: Any) -> None:
        self._write().execute(
            "INSERT INTO process_kv (pid, key, value) VALUES (?, ?, ?)"
            " ON CONFLICT (pid, key) DO UPDATE SET value = excluded.value",
            (pid, key, dumps(value)),
        )

    async def kv_delete(self, pid: str, key: str) -> None:
        self._write().execute("DELETE FROM process_kv WHERE pid = ? AND key = ?", (pid, key))

    async def kv_add(self, pid: str, key: str, value: Any, *, generation: int) -> bool:
        return self._write().execute(_KV_ADD, (pid, key, dumps(value), generation)).rowcount == 1

    async def kv_values(self, key: str, owner: str | None = None) -> dict[str, Any]:
        if owner is None:
            rows = self.db.execute("SELECT pid, value FROM process_kv WHERE key = ?", (key,))
        else:
            rows = self.db.execute(_OWNER_KV, (owner, key))
        return {pid: json.loads(value) for pid, value in rows.fetchall()}

    # -- signal log -----------------------------------------------------------------------------

    async def append_event(self, pid: str, signal: str, payload: dict[str, Any]) -> int:
        return (await self.append_events(pid, [(signal, payload)]))[0]

    async def append_events(self, pid: str, events: list[tuple[str, dict[str, Any]]]) -> list[int]:
        if not events:
            return []
        db = self._write()
        counters = self._counters(pid)
        first = counters[1]
        counters[1] = first + len(events)
        now = time.time()
        if len(events) == 1:
            name, payload = events[0]
            db.execute(
                _INSERT_EVENT,
                (pid, first, name, dumps(payload), now),
            )
            return [first]
        db.executemany(
            _INSERT_EVENT,
            [(pid, first + i, name, dumps(payload), now) for i, (name, payload) in enumerate(events)],
        )
        return list(range(first, counters[1]))

    async def events(self, pid: str, after_seq: int = 0, limit: int = 1000) -> list[EventRow]:
        rows = self.db.execute(
            "SELECT seq, signal, payload, created_at FROM events WHERE pid = ? AND seq > ? ORDER BY seq LIMIT ?",
            (pid, after_seq, limit),
        ).fetchall()
        return [EventRow(r[0], r[1], json.loads(r[2]), r[3]) for r in rows]

    async def last_event_seq(self, pid: str) -> int:
        row = self.db.execute("SELECT MAX(seq) FROM events WHERE pid = ?", (pid,)).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    async def prune_events(self, pid: str, *, through: int | None = None) -> int:
        # One upper bound made of the arguments and an uncorrelated subquery: a range of the
        # primary key. (A bound naming ``seq`` itself, as ``COALESCE(?, seq)``, is none: every
        # prune read the process's whole log, and all of one a watch holds back.)
        bound = (1 << 63) - 1 if through is None else max(0, min(through, (1 << 63) - 1))
        cursor = self._write().execute(
            "DELETE FROM events WHERE pid = ? AND seq <= MIN(?, COALESCE("
            "(SELECT MIN(seen_seq) FROM signal_watches WHERE source_pid = ?), ?))",
            (pid, bound, pid, bound),
        )
        return cursor.rowcount

    # -- account log ----------------------------------------------------------------------------

    async def append_account_events(
        self, owner: str, pid: str, events: list[tuple[int, str, dict[str, Any]]]
    ) -> list[int]:
        if not events:
            return []
        db = self._write()
        # the owner's newest account seq: as this body left it, as last committed, or read (one
        # writer: nothing else can number between the read and the insert; a rolled back body
        # leaves no gap, as its numbers are forgotten with it)
        newest = self._tx_accounts.get(owner)
        if newest is None:
            newest = self._known_accounts.get(owner)
        if newest is None:
            newest = _newest_account_seq(db, owner)
        now = time.time()
        if len(events) == 1:
            seq, name, payload = events[0]
            db.execute(_INSERT_ACCOUNT_EVENT, (owner, newest + 1, pid, seq, name, dumps(payload), now))
        else:
            db.executemany(
                _INSERT_ACCOUNT_EVENT,
                [
                    (owner, newest + i, pid, seq, name, dumps(payload), now)
                    for i, (seq, name, payload) in enumerate(events, 1)
                ],
            )
        self._tx_accounts[owner] = newest + len(events)
        return list(range(newest + 1, newest + len(events) + 1))

    async def account_events(self, owner: str, after_seq: int = 0, limit: int = 1000) -> list[AccountEventRow]:
        rows = self.db.execute(
            "SELECT seq, pid, pid_seq, signal, payload, created_at FROM account_events"
            " WHERE owner = ? AND seq > ? ORDER BY seq LIMIT ?",
            (owner, after_seq, limit),
        ).fetchall()
        return [AccountEventRow(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5]) for r in rows]

    async def last_account_seq(self, owner: str) -> int:
        return _newest_account_seq(self.db, owner)

    async def prune_account_events(self, owner: str, *, through: int) -> int:
        bound = max(0, min(through, MAX_SEQ))
        cursor = self._write().execute(
            "DELETE FROM account_events WHERE owner = ?1 AND seq <= MIN(?2,"
            " (SELECT MAX(seq) FROM account_events WHERE owner = ?1) - 1)",
            (owner, bound),
        )
        return cursor.rowcount

    # -- history segments -----------------------------------------------------------------------

    async def add_segment(self, row: SegmentRow) -> None:
        self._write().execute(
            f"INSERT INTO history_segments ({SEGMENT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.id,
                row.pid,
                row.generation,
                row.kind,
                row.from_message_id,
                row.to_message_id,
                row.archive_path,
                row.summary_message_id,
                row.created_at or time.time(),
            ),
        )

    async def segments(self, pid: str) -> list[SegmentRow]:
        rows = self.db.execute(
            f"SELECT {SEGMENT_COLUMNS} FROM history_segments WHERE pid = ? ORDER BY created_at, id",
            (pid,),
        ).fetchall()
        return [SegmentRow(*r) for r in rows]

    async def delete_segment(self, segment_id: str) -> bool:
        return self._write().execute("DELETE FROM history_segments WHERE id = ?", (segment_id,)).rowcount == 1

    async def idle_processes(self, before: float, pids: Sequence[str] | None = None) -> list[ProcessRecord]:
        if pids is None:
            rows = self._read_registry().execute(_IDLE_SINCE + _IDLE_ORDER, {"before": float(before)}).fetchall()
            return [process_record(r) for r in rows]
        self._write()  # (the transaction holds the database's one write lock: no writer comes between)
        among = {"before": float(before), "pids": json.dumps(list(pids))}
        rows = self._read_registry().execute(_IDLE_SINCE + _IDLE_AMONG + _IDLE_ORDER, among).fetchall()
        return [process_record(r) for r in rows]

    async def exclusive(self, key: str) -> None:
        self._write()  # a transaction holds the database's one write lock: it excludes every other
        # (other connections' too) already

    # -- schedules ------------------------------------------------------------------------------

    async def add_schedule(self, row: ScheduleRow) -> None:
        try:
            self._write().execute(
                f"INSERT INTO schedules ({SCHEDULE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    row.id,
                    row.pid,
                    row.text,
                    row.next_due,
                    row.every,
                    row.name,
                    row.created_at or time.time(),
                    row.cron,
                    row.tz,
                ),
            )
        except sqlite3.IntegrityError:
            raise StoreError(f"schedule {row.id} exists already") from None

    async def schedules(self, pid: str) -> list[ScheduleRow]:
        rows = self.db.execute(
            f"SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE pid = ? ORDER BY next_due, id", (pid,)
        ).fetchall()
        return [ScheduleRow(*r) for r in rows]

    async def due_schedules(self, before: float | None, limit: int = 100) -> list[ScheduleRow]:
        args: tuple[float, ...] = ()
        if before is None:
            sql = f"SELECT {SCHEDULE_COLUMNS} FROM schedules"
        else:
            sql, args = f"SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE next_due <= ?", (before,)
        rows = self.db.execute(sql + " ORDER BY next_due, id LIMIT ?", (*args, limit)).fetchall()
        return [ScheduleRow(*r) for r in rows]

    async def set_schedule_due(self, schedule_id: str, next_due: float, *, expect: float) -> bool:
        cur = self._write().execute(
            "UPDATE schedules SET next_due = ? WHERE id = ? AND next_due = ?", (next_due, schedule_id, expect)
        )
        return cur.rowcount == 1

    async def delete_schedule(self, schedule_id: str) -> bool:
        cur = self._write().execute("DELETE FROM schedules WHERE id = ?", (schedule_id,))
        return cur.rowcount == 1

    # -- signal watches -------------------------------------------------------------------------

    async def add_watch(self, row: WatchRow) -> None:
        try:
            self._write().execute(
                f"INSERT INTO signal_watches ({WATCH_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    row.id,
                    row.pid,
                    row.source_pid,
                    row.signal,
                    int(row.once),
                    row.seen_seq,
                    row.created_at or time.time(),
                ),
            )
        except sqlite3.IntegrityError:
            raise StoreError(f"watch {row.id} exists already") from None

    async def watches(self, *, pid: str | None = None, source_pid: str | None = None) -> list[WatchRow]:
        where: list[str] = []
        args: list[str] = []
        if pid is not None:
            where.append("pid = ?")
            args.append(pid)
        if source_pid is not None:
            where.append("source_pid = ?")
            args.append(source_pid)
        sql = f"SELECT {WATCH_COLUMNS} FROM signal_watches"
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self.db.execute(sql + " ORDER BY created_at, id", args).fetchall()
        return [watch_row(r) for r in rows]

    async def set_watch_seen(self, watch_id: str, seq: int, *, expect: int | None = None) -> bool:
        if expect is None:
            cur = self._write().execute("UPDATE signal_watches SET seen_seq = ? WHERE id = ?", (seq, watch_id))
        else:
            cur = self._write().execute(
                "UPDATE signal_watches SET seen_seq = ? WHERE id = ? AND seen_seq = ?", (seq, watch_id, expect)
            )
        return cur.rowcount == 1

    async def delete_watch(self, watch_id: str) -> bool:
        cur = self._write().execute("DELETE FROM signal_watches WHERE id = ?", (watch_id,))
        return cur.rowcount == 1

    async def lagging_watches(self, before: float) -> list[str]:
        rows = self.db.execute(LAGGING_WATCHES.replace("$1", "?"), (before,)).fetchall()
        return [r[0] for r in rows]

    # -- leases ---------------------------------------------------------------------------------
    # The engine takes no leases on SQLite (one process owns the file: ``shared`` is False), but
    # the methods keep the contract, so the conformance suite holds both dialects to it.

    async def claim_lease(self, pid: str, owner: str, ttl: float) -> int | None:
        async with self.transaction():
            now = time.time()
            row = (
                self._write()
                .execute(
                    "INSERT INTO process_leases (pid, owner, epoch, expires) VALUES (?, ?, 1, ?)"
                    " ON CONFLICT (pid) DO UPDATE SET owner = excluded.owner, epoch = process_leases.epoch + 1,"
                    " expires = excluded.expires"
                    " WHERE process_leases.owner IS NULL OR process_leases.expires < ? OR process_leases.owner = ?"
                    " RETURNING epoch",
                    (pid, owner, now + ttl, now, owner),
                )
                .fetchone()
            )
        return int(row[0]) if row else None

    async def claim_orphans(
        self, owner: str, ttl: float, limit: int = 100, *, reclaim: bool = False
    ) -> list[tuple[str, int]]:
        async with self.transaction():
            now = time.time()
            db = self._read_registry()
            pids = [
                r[0]
                for r in db.execute(
                    "SELECT p.pid FROM processes p LEFT JOIN process_leases l ON l.pid = p.pid"
                    " WHERE p.state <> 'killed'"
                    " AND (p.current_run IS NOT NULL OR EXISTS (SELECT 1 FROM message_queue q WHERE q.pid = p.pid))"
                    " AND (l.pid IS NULL OR l.owner IS NULL OR l.expires < ? OR l.owner = ?) LIMIT ?",
                    (now, owner if reclaim else None, limit),
                ).fetchall()
            ]
            claimed = []
            for pid in pids:
                row = db.execute(
                    "INSERT INTO process_leases (pid, owner, epoch, expires) VALUES (?, ?, 1, ?)"
                    " ON CONFLICT (pid) DO UPDATE SET owner = excluded.owner, epoch = process_leases.epoch + 1,"
                    " expires = excluded.expires RETURNING epoch",
                    (pid, owner, now + ttl),
                ).fetchone()
                claimed.append((pid, int(row[0])))
        return claimed

    async def renew_leases(self, owner: str, ttl: float) -> dict[str, int]:
        async with self.transaction():
            rows = (
                self._write()
                .execute(
                    "UPDATE process_leases SET expires = ? WHERE owner = ? RETURNING pid, epoch",
                    (time.time() + ttl, owner),
                )
                .fetchall()
            )
        return {r[0]: int(r[1]) for r in rows}

    async def release_lease(self, pid: str, owner: str, epoch: int) -> bool:
        async with self.transaction():
            cur = self._write().execute(
                "UPDATE process_leases SET owner = NULL, expires = 0 WHERE pid = ? AND owner = ? AND epoch = ?",
                (pid, owner, epoch),
            )
        return cur.rowcount == 1

    async def lease(self, pid: str) -> Lease | None:
        row = self.db.execute("SELECT pid, owner, epoch, expires FROM process_leases WHERE pid = ?", (pid,)).fetchone()
        return Lease(row[0], row[1], int(row[2]), float(row[3])) if row else None

    async def fence(self, pid: str, owner: str, epoch: int, ttl: float) -> bool:
        cur = self._write().execute(
            "UPDATE process_leases SET expires = ? WHERE pid = ? AND owner = ? AND epoch = ?",
            (time.time() + ttl, pid, owner, epoch),
        )
        return cur.rowcount == 1

    async def claim_duty(self, name: str, owner: str, ttl: float) -> int | None:
        async with self.transaction():
            now = time.time()
            row = (
                self._write()
                .execute(
                    "INSERT INTO duties (name, owner, epoch, expires) VALUES (?, ?, 1, ?)"
                    " ON CONFLICT (name) DO UPDATE SET owner = excluded.owner,"
                    " epoch = CASE WHEN duties.owner = excluded.owner THEN duties.epoch ELSE duties.epoch + 1 END,"
                    " expires = excluded.expires"
                    " WHERE duties.owner IS NULL OR duties.expires < ? OR duties.owner = excluded.owner"
                    " RETURNING epoch",
                    (name, owner, now + ttl, now),
                )
                .fetchone()
            )
        return int(row[0]) if row else None

    async def release_duty(self, name: str, owner: str) -> bool:
        async with self.transaction():
            cur = self._write().execute(
                "UPDATE duties SET owner = NULL, expires = 0 WHERE name = ? AND owner = ?", (name, owner)
            )
        return cur.rowcount == 1

    async def duty(self, name: str) -> DutyLease | None:
        row = self.db.execute("SELECT name, owner, epoch, expires FROM duties WHERE name = ?", (name,)).fetchone()
        return DutyLease(row[0], row[1], int(row[2]), float(row[3])) if row else None

    # -- accounts and tokens --------------------------------------------------------------------

    async def create_account(self, record: AccountRecord) -> None:
        try:
            self._write().execute(
                "INSERT INTO accounts (name, admin, created_at) VALUES (?, ?, ?)",
                (record.name, int(record.admin), record.created_at or time.time()),
            )
        except sqlite3.IntegrityError:
            raise StoreError(f"account {record.name!r} already exists") from None

    async def get_account(self, name: str) -> AccountRecord | None:
        row = self.db.execute("SELECT name, admin, created_at FROM accounts WHERE name = ?", (name,)).fetchone()
        return account_row(row) if row else None

    async def list_accounts(self) -> list[AccountRecord]:
        rows = self.db.execute("SELECT name, admin, created_at FROM accounts ORDER BY name").fetchall()
        return [account_row(r) for r in rows]

    async def add_token(self, record: TokenRecord) -> None:
        try:
            self._write().execute(
                f"INSERT INTO tokens ({TOKEN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.account,
                    record.hash,
                    record.label,
                    record.created_at or time.time(),
                    record.revoked_at,
                ),
            )
        except sqlite3.IntegrityError:
            raise StoreError(f"token {record.id!r} (or one with the same hash) exists already") from None

    async def token_by_hash(self, token_hash: str) -> TokenRecord | None:
        row = self.db.execute(f"SELECT {TOKEN_COLUMNS} FROM tokens WHERE hash = ?", (token_hash,)).fetchone()
        return TokenRecord(*row) if row else None

    async def list_tokens(self, account: str | None = None) -> list[TokenRecord]:
        sql = f"SELECT {TOKEN_COLUMNS} FROM tokens"
        args: tuple[Any, ...] = ()
        if account is not None:
            sql, args = sql + " WHERE account = ?", (account,)
        return [TokenRecord(*r) for r in self.db.execute(sql + " ORDER BY created_at, id", args).fetchall()]

    async def revoke_token(self, token_id: str, at: float) -> bool:
        cur = self._write().execute(
            "UPDATE tokens SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (at, token_id)
        )
        return cur.rowcount == 1

    async def set_device_token(
        self, owner: str, name: str, token_id: str | None, token_hash: str | None, at: float
    ) -> bool:
        db = self._write()
        if token_id is None:
            cur = db.execute(
                "UPDATE devices SET token_id = NULL, token_hash = NULL"
                " WHERE owner = ? AND name = ? AND token_id IS NOT NULL",
                (owner, name),
            )
            return cur.rowcount == 1
        db.execute(
            "INSERT INTO devices (owner, name, label, description, token_id, token_hash, created_at)"
            " VALUES (?, ?, '', '', ?, ?, ?) ON CONFLICT (owner, name) DO UPDATE"
            " SET token_id = excluded.token_id, token_hash = excluded.token_hash",
            (owner, name, token_id, token_hash, at),
        )
        return True

    async def device_by_token(self, token_hash: str) -> DeviceRecord | None:
        row = self.db.execute(f"SELECT {DEVICE_COLUMNS} FROM devices WHERE token_hash = ?", (token_hash,)).fetchone()
        return DeviceRecord(*row) if row else None

    async def device_seen(
        self, owner: str, name: str, at: float, label: str | None = None, description: str | None = None
    ) -> None:
        self._write().execute(
            "INSERT INTO devices (owner, name, label, description, created_at, first_seen_at, last_seen_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (owner, name) DO UPDATE"
            " SET last_seen_at = excluded.last_seen_at,"
            " first_seen_at = COALESCE(devices.first_seen_at, excluded.first_seen_at),"
            " label = COALESCE(?, devices.label), description = COALESCE(?, devices.description)",
            (owner, name, label or "", description or "", at, at, at, label, description),
        )

    async def list_devices(self, owner: str | None = None) -> list[DeviceRecord]:
        sql = f"SELECT {DEVICE_COLUMNS} FROM devices"
        args: tuple[Any, ...] = ()
        if owner is not None:
            sql, args = sql + " WHERE owner = ?", (owner,)
        return [DeviceRecord(*r) for r in self.db.execute(sql + " ORDER BY owner, name", args).fetchall()]

    async def forget_device(self, owner: str, name: str) -> bool:
        cur = self._write().execute("DELETE FROM devices WHERE owner = ? AND name = ?", (owner, name))
        return cur.rowcount == 1


def _newest_account_seq(db: sqlite3.Connection, owner: str) -> int:
    """The newest account seq of ``owner``'s account log (0: none yet)."""
    row = db.execute("SELECT MAX(seq) FROM account_events WHERE owner = ?", (owner,)).fetchone()
    return int(row[0]) if row and row[0] is not None else 0
