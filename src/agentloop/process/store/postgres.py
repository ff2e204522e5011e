"""The PostgreSQL store: the same tables and semantics as the SQLite store, on an asyncpg pool.

Transactions. ``store.transaction()`` takes a connection of its own from the pool and runs a
READ COMMITTED transaction on it. Transactions of one store run one at a time (a store-wide lock,
as in the SQLite store): the durable runner expects one writer per process, and the conformance
suite expects a second task's transaction to wait for the first instead of interleaving with it.
Across stores (two kernels on one database, a CLI next to a server) the process row is the lock:
every write that takes a per-process id (message id, signal seq, queue id) or changes the registry
row does so with an ``UPDATE … RETURNING`` on that row, which holds its row lock until commit, so
ids stay gap-free and unique per process and a second writer of the same process waits for the
first. Tool-call claims (``set_call_status``) and deletes are single conditional statements:
under READ COMMITTED PostgreSQL re-checks their ``WHERE`` against the committed row after a
concurrent writer commits, so a claim succeeds once only. Nothing needs SERIALIZABLE.

Commits. ``end(commit=True)`` cannot commit before it returns (asyncpg only talks asynchronously),
so it starts the commit and returns an awaitable that completes once the commit is durable;
``settled`` is called at that moment whether or not anyone awaits. Until then the store's lock is
held, and every read of this store (from any task) waits for the commit first, so a kept body is
visible to the store "at once", as the ``Transaction`` contract says; reads that waited on a commit
also run before the next transaction may begin, so they see exactly that commit's state. A
rollback (``end(commit=False)``) returns None the same way and finishes in the background; the
next transaction and every read wait for it.

Reads outside a transaction go to any pooled connection and see committed state only (the SQLite
store's reads share its single connection, so they could see another task's open body); reads by
the task whose transaction is open use that transaction's connection and see its own writes.

Scale-out (DESIGN §6) fits on top: replacing the store-wide lock by a per-process lease row
(claimed with ``FOR UPDATE SKIP LOCKED``, checked by epoch at commit) lets several transactions
of different processes run at once on their own pooled connections, and the per-process row locks
above already keep two writers of one process apart.

Column types are the shared schema's: ids and counters are ``INTEGER`` (32-bit here), which is why
comparisons with caller-given ids are cast to ``bigint`` (an id past 2**31 finds nothing instead of
failing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import asyncpg

from agentloop.messages import Message, message_from_json, message_to_json
from agentloop.process.store.base import (
    MAX_SEQ,
    AccountEventRow,
    AccountRecord,
    ApprovalAuditRow,
    CallStatus,
    DeviceNews,
    DeviceRecord,
    DutyLease,
    EventRow,
    HilRow,
    Lease,
    LiveListener,
    NoSuchProcess,
    Notified,
    ProcessRecord,
    QueueItem,
    QueueKind,
    RelayBatch,
    ScheduleRow,
    SegmentRow,
    Settled,
    Store,
    StoredMessage,
    StoreError,
    TokenRecord,
    ToolCallRow,
    UsageTotals,
    WatchRow,
    audit_row,
    audit_values,
)
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
from agentloop.process.store.pgschema import migrate
from agentloop.process.store.pgtx import Connection, PgTransaction, Settling, TxState
from agentloop.process.store.pgurl import redact, scrub
from agentloop.process.store.schema import AUDIT_COLUMNS, AUDIT_WIDTH, audit_filters, audit_query

log = logging.getLogger("agentloop.store")


# Append rows that take ids from a per-process counter in one round trip: the UPDATE bumps the
# counter (and holds the process row's lock until commit), the INSERT numbers the rows from it. No
# row comes back when the process does not exist.
_APPEND_MESSAGES = """
WITH c AS (
    UPDATE processes SET next_message_id = next_message_id + cardinality($3::text[])
    WHERE pid = $1 RETURNING next_message_id - cardinality($3::text[]) AS first, history_generation AS gen
)
INSERT INTO messages (pid, id, generation, run_id, role, body, created_at)
SELECT $1, c.first + t.n - 1, c.gen, $2, t.role, t.body, $5
FROM c, unnest($3::text[], $4::text[]) WITH ORDINALITY AS t(role, body, n)
RETURNING id
"""
_APPEND_EVENTS = """
WITH c AS (
    UPDATE processes SET next_event_seq = next_event_seq + cardinality($2::text[])
    WHERE pid = $1 RETURNING next_event_seq - cardinality($2::text[]) AS first
)
INSERT INTO events (pid, seq, signal, payload, created_at)
SELECT $1, c.first + t.n - 1, t.signal, t.payload, $4
FROM c, unnest($2::text[], $3::text[]) WITH ORDINALITY AS t(signal, payload, n)
RETURNING seq
"""
# Account signals copied to the owner's account log (``append_account_events``) in one round trip:
# the upsert bumps the owner's counter row, whose lock it holds until commit, so the owner's next
# transaction numbers after this one's commit (gapless, in commit order; a rollback undoes the bump).
_APPEND_ACCOUNT_EVENTS = """
WITH c AS (
    INSERT INTO account_seqs (owner, next) VALUES ($1, 1 + cardinality($3::bigint[]))
    ON CONFLICT (owner) DO UPDATE SET next = account_seqs.next + cardinality($3::bigint[])
    RETURNING next - cardinality($3::bigint[]) AS first
)
INSERT INTO account_events (owner, seq, pid, pid_seq, signal, payload, created_at)
SELECT $1, c.first + t.n - 1, $2, t.pid_seq, t.signal, t.payload, $6
FROM c, unnest($3::bigint[], $4::text[], $5::text[]) WITH ORDINALITY AS t(pid_seq, signal, payload, n)
RETURNING seq
"""
_ENQUEUE = """
WITH c AS (
    UPDATE processes SET next_queue_id = next_queue_id + 1 WHERE pid = $1 RETURNING next_queue_id - 1 AS id
)
INSERT INTO message_queue (pid, id, kind, run_id, body, created_at, reason)
SELECT $1, c.id, $2, $3, $4, $5, $6 FROM c
RETURNING id
"""
# one statement: the process's usage totals added to its owner's (every CTE reads the rows as they
# were before the statement), a CTE per table of the process (common.PROCESS_TABLES), then the registry row
_DELETE_PROCESS = (
    f"WITH u AS ({FOLD_USAGE}),\n     "
    + ",\n     ".join(f"d{i} AS (DELETE FROM {t} WHERE pid = $1)" for i, t in enumerate(PROCESS_TABLES))
    + ",\n     w AS (DELETE FROM signal_watches WHERE pid = $1 OR source_pid = $1)"
    + ",\n     p AS (DELETE FROM processes WHERE pid = $1)"
    + "\nINSERT INTO killed_pids (pid, killed_at) VALUES ($1, $2) ON CONFLICT DO NOTHING"
)


# Leases (DESIGN §6) live on the database's clock, so workers on machines whose clocks disagree
# still agree on when a lease has expired.
_NOW = "extract(epoch from clock_timestamp())::double precision"
CHANNEL = "agentloop"  # the LISTEN/NOTIFY channel; a payload is "<pid> <sender>"
# relayed progress (process/relay.py): {"sender", "batches": [[pid, base, [payload, ...]], ...]}
# or {"sender", "follow": [pid, ...]}, or the account-level signals of a commit (``notify_account``),
# sent in the committing transaction (delivered at commit, never for a rolled back one):
# {"sender", "owner", "pid", "account": [[account seq, seq, signal, payload or null], ...]} (null:
# too large for a notification, read from the account log); its sender is the store (each worker
# has its own); or a device event (``notify_device``), sent in its transaction the same way:
# {"sender", "device": [owner, name, event, detail]}
LIVE_CHANNEL = "agentloop_live"
_NOTIFY_MAX = 7900  # bytes of one NOTIFY payload (PostgreSQL refuses 8000 and more)
_CLAIM = f"""
INSERT INTO process_leases (pid, owner, epoch, expires) VALUES ($1, $2, 1, {_NOW} + $3)
ON CONFLICT (pid) DO UPDATE SET owner = excluded.owner, epoch = process_leases.epoch + 1, expires = excluded.expires
WHERE process_leases.owner IS NULL OR process_leases.expires < {_NOW} OR process_leases.owner = excluded.owner
RETURNING epoch
"""
# The sweep: processes with work and no live lease. A process row a tick has locked is skipped
# (its worker is alive); the claim itself re-checks the lease under the lease row's lock.
_CLAIM_ORPHANS = f"""
WITH c AS (
    SELECT p.pid FROM processes p LEFT JOIN process_leases l ON l.pid = p.pid
    WHERE p.state <> 'killed'
      AND (p.current_run IS NOT NULL OR EXISTS (SELECT 1 FROM message_queue q WHERE q.pid = p.pid))
      AND (l.pid IS NULL OR l.owner IS NULL OR l.expires < {_NOW} OR l.owner = $4)
    ORDER BY p.pid LIMIT $3
    FOR UPDATE OF p SKIP LOCKED
)
INSERT INTO process_leases (pid, owner, epoch, expires) SELECT c.pid, $1, 1, {_NOW} + $2 FROM c
ON CONFLICT (pid) DO UPDATE SET owner = excluded.owner, epoch = process_leases.epoch + 1, expires = excluded.expires
WHERE process_leases.owner IS NULL OR process_leases.expires < {_NOW} OR process_leases.owner = $4
RETURNING pid, epoch
"""

# A kernel-wide duty (the schedules' timer): the same rules as a process's lease, except that
# its holder renews it by claiming again, which keeps the epoch (it moves only with the owner).
_CLAIM_DUTY = f"""
INSERT INTO duties (name, owner, epoch, expires) VALUES ($1, $2, 1, {_NOW} + $3)
ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, expires = excluded.expires,
    epoch = CASE WHEN duties.owner = excluded.owner THEN duties.epoch ELSE duties.epoch + 1 END
WHERE duties.owner IS NULL OR duties.expires < {_NOW} OR duties.owner = excluded.owner
RETURNING epoch
"""


def pack_relay(sender: str, batches: list[RelayBatch], limit: int = _NOTIFY_MAX) -> list[str]:
    """The NOTIFY payloads that carry ``batches`` (see ``LIVE_CHANNEL``), each at most ``limit``
    bytes: as few as fit, a batch split between two where needed. A signal too large to fit in
    one alone is sent in pieces when what makes it large is its text delta (``split_delta``: the
    pieces' deltas add up to its own); any other is left out (it is only progress: the logged
    ``proc.run.output`` has the text)."""
    head = f'{{"sender":{dumps(sender)},"batches":['
    empty = len(head.encode()) + 2  # with its closing "]}"
    payloads: list[str] = []
    entries: list[str] = []
    used = empty
    for pid, base, signals in batches:
        prefix = f"[{dumps(pid)},{int(base)},["
        room = limit - empty - len(prefix.encode()) - 2  # the bytes one signal may take alone
        items: list[str] = []
        for signal in _fitted(pid, signals, room):
            item = dumps(signal)
            # an entry's first item brings the entry's frame ('[pid,base,[' ... ']]', a comma before it)
            frame = 0 if items else len(prefix.encode()) + 2 + (1 if entries else 0)
            size = len(item.encode()) + (1 if items else 0)
            if used + frame + size > limit:  # this payload is full: the next one goes on
                if items:
                    entries.append(prefix + ",".join(items) + "]]")
                payloads.append(head + ",".join(entries) + "]}")
                entries, items, used = [], [], empty
                frame, size = len(prefix.encode()) + 2, len(item.encode())
            items.append(item)
            used += frame + size
        if items:
            entries.append(prefix + ",".join(items) + "]]")
    if entries:
        payloads.append(head + ",".join(entries) + "]}")
    return payloads


def _fitted(pid: str, signals: list[dict[str, Any]], room: int) -> Iterator[dict[str, Any]]:
    """``signals`` with each larger than ``room`` bytes split (or left out where it cannot be)."""
    for signal in signals:
        size = len(dumps(signal).encode())
        if size <= room:
            yield signal
            continue
        pieces = split_delta(signal, room)
        if not pieces:
            log.debug("process %s: a progress signal of %d bytes is too large to relay", pid, size)
        yield from pieces


def split_delta(signal: dict[str, Any], room: int) -> list[dict[str, Any]]:
    """``signal`` as several of at most ``room`` bytes of JSON each, whose text deltas, in order,
    add up to its own: a stream delta (``delta``) or a tool's progress that carries one
    (``update.delta``, the shell's output). Its other fields go with every piece, but a
    ``skipped`` count (text dropped before the delta) only with the first. Empty where the
    signal has no such delta, or its other fields alone leave no room for one."""
    update = signal.get("update")
    nested = isinstance(update, dict) and isinstance(update.get("delta"), str)
    text = update.get("delta") if isinstance(update, dict) and nested else signal.get("delta")
    if not isinstance(text, str) or not text:
        return []

    def piece(delta: str, first: bool) -> dict[str, Any]:
        if not nested:
            return {**signal, "delta": delta}
        inner = {**(update if isinstance(update, dict) else {}), "delta": delta}
        if not first:
            inner.pop("skipped", None)
        return {**signal, "update": inner}

    space = room - len(dumps(piece("", True)).encode())
    if space < 64:  # (the rest of it is nearly as large as a notification)
        return []
    pieces: list[dict[str, Any]] = []
    start, used = 0, 0
    for i, ch in enumerate(text):
        size = len(dumps(ch).encode()) - 2  # as it is escaped in JSON, without the quotes
        if used + size > space:
            pieces.append(piece(text[start:i], not pieces))
            start, used = i, 0
        used += size
    pieces.append(piece(text[start:], not pieces))
    return pieces


def _fill(used: int, items: list[str], limit: int = _NOTIFY_MAX) -> list[list[str]]:
    """``items`` in groups whose comma-joined bytes fit in ``limit`` after ``used`` bytes."""
    groups: list[list[str]] = [[]]
    size = used
    for item in items:
        n = len(item.encode()) + (1 if groups[-1] else 0)
        if size + n > limit and groups[-1]:
            groups.append([])
            size, n = used, len(item.encode())
        if size + n <= limit:
            groups[-1].append(item)
            size += n
    return [group for group in groups if group]


def _account_items(items: list[Any]) -> list[tuple[int, int, str, dict[str, Any] | None]]:
    """The [account seq, seq, signal, payload or null] of an account notification, checked."""
    return [
        (account_seq, seq, name, payload if isinstance(payload, dict) else None)
        for account_seq, seq, name, payload in items
        if isinstance(account_seq, int) and isinstance(seq, int) and isinstance(name, str)
    ]


def _device_news(item: Any) -> DeviceNews:
    """The [owner, name, event, detail] of a device notification, checked (``TypeError`` if not)."""
    owner, name, event, detail = item
    if not (isinstance(owner, str) and isinstance(name, str) and isinstance(detail, dict)):
        raise TypeError("a device notification needs [owner, name, event, detail]")
    if event not in ("status", "revoked", "forgotten"):
        raise TypeError(f"unknown device event {event!r}")
    return DeviceNews(owner, name, event, detail)


def _changed(status: str) -> int:
    """The row count of a command status such as ``UPDATE 1`` or ``INSERT 0 1``."""
    return int(status.rsplit(" ", 1)[-1])


# ``idle_processes`` (as SQLite's: the newest message and signal read by their keys)
_IDLE_SINCE = (
    f"SELECT {PROCESS_COLUMNS} FROM processes p"
    " WHERE p.state = 'idle' AND p.current_run IS NULL"
    " AND p.created_at < $1 AND p.updated_at < $1"
    " AND NOT EXISTS (SELECT 1 FROM message_queue q WHERE q.pid = p.pid)"
    " AND NOT EXISTS (SELECT 1 FROM pending_hil h WHERE h.pid = p.pid)"
    " AND NOT EXISTS (SELECT 1 FROM pending_tool_calls c WHERE c.pid = p.pid)"
    " AND NOT EXISTS (SELECT 1 FROM schedules s WHERE s.pid = p.pid)"
    " AND NOT EXISTS (SELECT 1 FROM signal_watches w WHERE w.pid = p.pid OR w.source_pid = p.pid)"
    " AND COALESCE((SELECT m.created_at FROM messages m WHERE m.pid = p.pid ORDER BY m.id DESC LIMIT 1), 0) < $1"
    " AND COALESCE((SELECT e.created_at FROM events e WHERE e.pid = p.pid ORDER BY e.seq DESC LIMIT 1), 0) < $1"
)
_IDLE_AMONG = " AND p.pid = ANY($2::text[])"
_IDLE_ORDER = " ORDER BY p.updated_at, p.pid"


class PostgresStore(Store):
    """``PostgresStore("postgresql://user:password@host:5432/db")``. The URL is asyncpg's (libpq's
    query parameters such as ``sslmode`` work); ``url`` shows it with the password masked."""

    shared = True  # other servers may work on the same database: the engine takes leases

    def __init__(self, dsn: str, *, min_connections: int = 1, max_connections: int = 10) -> None:
        self._dsn = dsn
        self.url = redact(dsn)
        self._min = min_connections
        self._max = max_connections
        self._pool: Any = None  # an asyncpg.Pool once open
        self._lock = asyncio.Lock()  # held by the open transaction until its commit or rollback is over
        self._tx: TxState | None = None  # the open transaction's body
        self._settling: Settling | None = None  # the commit or rollback in flight
        self._sender = os.urandom(8).hex()  # this store's name on the account notifications it sends

    def __repr__(self) -> str:
        return f"PostgresStore({self.url!r})"

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def pool(self) -> Any:
        if self._pool is None:
            raise StoreError("the store is not open")
        return self._pool

    async def open(self) -> None:
        if self._pool is not None:
            return
        self._lock = asyncio.Lock()
        try:
            pool = await asyncpg.create_pool(self._dsn, min_size=self._min, max_size=self._max, timeout=15)
        except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
            raise self._error("cannot open the database", exc) from None
        try:
            async with pool.acquire() as conn:
                await migrate(conn)
        except StoreError:
            await pool.close()
            raise
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            await pool.close()
            raise self._error("cannot migrate the database", exc) from None
        self._pool = pool

    def _error(self, what: str, exc: BaseException) -> StoreError:
        """A ``StoreError`` naming the database without its password (asyncpg's own messages may
        quote the DSN, so they are scrubbed too). Raised ``from None``: the original exception's
        arguments could carry the password in a traceback."""
        reason = scrub(str(exc) or type(exc).__name__, self._dsn)
        return StoreError(f"{what} {self.url}: {reason}")

    async def close(self) -> None:
        pool = self._pool
        if pool is None:
            return
        settling = self._settling
        if settling is not None:
            with contextlib.suppress(BaseException):
                await asyncio.shield(settling.done)
        tx, self._tx = self._tx, None
        if tx is not None:  # a body still open: it cannot be kept; closing its connection rolls it back
            tx.conn.terminate()
            with contextlib.suppress(Exception):
                await pool.release(tx.conn)
        self._pool = None
        try:
            await asyncio.wait_for(pool.close(), 10)
        except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            pool.terminate()

    async def schema_version(self) -> int:
        async with self._reading() as db:
            return int(await db.fetchval("SELECT MAX(version) FROM schema_version") or 0)

    def transaction(self) -> PgTransaction:
        return PgTransaction(self._begin, self._end)

    async def _begin(self) -> None:
        me = asyncio.current_task()
        if self._tx is not None and self._tx.task is me:
            raise StoreError("transactions do not nest")
        pool = self.pool
        await self._lock.acquire()  # another transaction's body, commit or rollback: wait for it
        try:
            conn = await pool.acquire()
            try:
                tr = conn.transaction()
                await tr.start()
            except BaseException:  # (cancelled, say) BEGIN may or may not have reached the server:
                with contextlib.suppress(Exception):
                    conn.terminate()  # a closed connection is replaced by the pool, never reused half-open
                    await pool.release(conn)
                raise
        except BaseException:
            self._lock.release()
            raise
        self._tx = TxState(conn, tr, me)

    def _end(self, commit: bool, settled: Settled | None) -> Awaitable[None] | None:
        tx = self._tx
        if tx is None or tx.task is not asyncio.current_task():
            if not commit:
                return None  # nothing (left) to roll back: the store was closed under the body
            raise StoreError("no transaction of this task is open (was the store closed?)")
        self._tx = None
        loop = asyncio.get_running_loop()
        settling = self._settling = Settling(loop)
        waiter: asyncio.Future[None] | None = loop.create_future() if commit else None
        # the task is kept by ``settling.done``'s callbacks and by close(), which awaits it
        settling.task = loop.create_task(self._settle(tx, commit, settled, settling, waiter))
        return waiter

    async def _settle(
        self,
        tx: TxState,
        commit: bool,
        settled: Settled | None,
        settling: Settling,
        waiter: asyncio.Future[None] | None,
    ) -> None:
        """Commit or roll back ``tx`` and tell everyone: its ``settled``, its waiter, the reads
        that waited for it. Only then may the next transaction begin."""
        error: BaseException | None = None
        try:
            try:
                await (tx.tr.commit() if commit else tx.tr.rollback())
            except (Exception, asyncio.CancelledError) as exc:
                error = exc
                # whatever state the connection is in, closing it makes the server roll back what
                # is left (asyncpg may have closed and detached it already: nothing to do then)
                with contextlib.suppress(Exception):
                    tx.conn.terminate()
            with contextlib.suppress(Exception):
                await self.pool.release(tx.conn)
        finally:
            # never skipped: a waiter or a read left waiting here would wait for ever
            settling.durable.set()  # reads that waited may run now; later reads need not wait
            self._tell(commit, settled, waiter, error)
        try:
            await settling.readers_gone()
        finally:
            if self._settling is settling:
                self._settling = None
            self._lock.release()
            settling.done.set_result(None)

    def _tell(
        self, commit: bool, settled: Settled | None, waiter: asyncio.Future[None] | None, error: BaseException | None
    ) -> None:
        """Say how a commit ended: ``settled`` first, then the waiter (unless its task was
        cancelled meanwhile); a failed rollback is only logged (nothing of it was to be kept)."""
        if not commit:
            if error is not None:
                log.warning("rolling back a transaction on %s failed: %s", self.url, scrub(str(error), self._dsn))
            return
        if settled is not None:
            try:
                settled(error)
            except Exception:  # the follow-up's failure is not the commit's
                log.exception("after a commit")
        if waiter is not None and not waiter.done():
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(self._error("the commit failed on", error))

    def _write(self) -> Connection:
        tx = self._tx
        if tx is None or tx.task is not asyncio.current_task():
            raise StoreError("writes must happen inside store.transaction()")
        return tx.conn

    @contextlib.asynccontextmanager
    async def _reading(self) -> AsyncIterator[Any]:
        """Where a read runs: the open transaction's connection for its own task (read your
        writes), the pool otherwise, after the commit or rollback in flight (if any) is over."""
        tx = self._tx
        if tx is not None and tx.task is asyncio.current_task():
            yield tx.conn
            return
        settling = self._settling
        if settling is None or settling.durable.is_set():
            yield self.pool
            return
        settling.readers += 1
        try:
            await settling.durable.wait()
            yield self.pool
        finally:
            settling.reader_done()

    # -- registry -------------------------------------------------------------------------------

    async def create_process(self, record: ProcessRecord) -> None:
        now = time.time()
        status = await self._write().execute(
            "INSERT INTO processes (pid, owner, run_as, cwd, parent_pid, interactive, context, state, current_run,"
            " history_generation, next_message_id, next_event_seq, next_queue_id, created_at, updated_at)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 1, 1, 1, $11, $12) ON CONFLICT DO NOTHING",
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
            float(record.created_at or now),
            now,
        )
        if _changed(status) != 1:  # (ON CONFLICT: a failed statement would abort the whole transaction)
            raise StoreError(f"process {record.pid} exists already")

    async def get_process(self, pid: str) -> ProcessRecord | None:
        async with self._reading() as db:
            row = await db.fetchrow(f"SELECT {PROCESS_COLUMNS} FROM processes WHERE pid = $1", pid)
        return process_record(row) if row else None

    async def list_processes(self, owner: str | None = None) -> list[ProcessRecord]:
        async with self._reading() as db:
            if owner is None:
                rows = await db.fetch(f"SELECT {PROCESS_COLUMNS} FROM processes ORDER BY created_at, pid")
            else:
                rows = await db.fetch(
                    f"SELECT {PROCESS_COLUMNS} FROM processes WHERE owner = $1 ORDER BY created_at, pid", owner
                )
        return [process_record(r) for r in rows]

    async def count_processes(self, owner: str, *, top_level_only: bool = False) -> int:
        sql = "SELECT count(*) FROM processes WHERE owner = $1 AND state <> 'killed'"
        if top_level_only:
            sql += " AND parent_pid IS NULL"
        async with self._reading() as db:
            count = await db.fetchval(sql, owner)
        return int(count)

    async def update_process(self, pid: str, **fields: Any) -> None:
        unknown = set(fields) - UPDATABLE_FIELDS
        if unknown:
            raise StoreError(f"cannot update process fields {sorted(unknown)}")
        db = self._write()
        if not fields:
            if await db.fetchval("SELECT 1 FROM processes WHERE pid = $1 FOR UPDATE", pid) is None:
                raise NoSuchProcess(pid)
            return
        fields = dict(fields)
        added = fields.pop(USAGE_ADDED, None)
        increments = {} if added is None else usage_increments(added)
        for column in [c for c in increments if c in fields]:  # (a total set in the same call: the sum is set)
            fields[column] += increments.pop(column)
        values: list[Any] = []
        assignments: list[str] = []
        for key, value in fields.items():
            if key == "current_run":
                value = dumps(value) if value is not None else None
            elif key == "interactive":
                value = int(value)
            values.append(value)
            assignments.append(f"{key} = ${len(values)}")
        for column, amount in increments.items():  # a writer that did not see these totals loses nothing
            values.append(amount)
            assignments.append(f"{column} = {column} + ${len(values)}")
        sets = ", ".join(assignments)
        n = len(values)
        status = await db.execute(
            f"UPDATE processes SET {sets}, updated_at = ${n + 1} WHERE pid = ${n + 2}", *values, time.time(), pid
        )
        if _changed(status) != 1:
            raise NoSuchProcess(pid)

    async def delete_process(self, pid: str) -> None:
        db = self._write()
        # the row locked first, in a statement of its own: the fold's snapshot is then taken after
        # any writer that held it committed (an increment of its totals is folded, not deleted)
        await db.execute("SELECT 1 FROM processes WHERE pid = $1 FOR UPDATE", pid)
        await db.execute(_DELETE_PROCESS, pid, time.time())

    async def account_usage(self, owner: str) -> UsageTotals:
        async with self._reading() as db:
            return usage_totals(await db.fetchrow(ACCOUNT_USAGE, owner))

    async def spent_before(self, account: str, period: str, spent: float) -> float:
        db = self._write()
        await db.execute(
            "INSERT INTO account_periods (account, period, spent_before) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
            account,
            period,
            float(spent),
        )
        value = await db.fetchval(
            "SELECT spent_before FROM account_periods WHERE account = $1 AND period = $2", account, period
        )
        return float(value)

    async def was_killed(self, pid: str) -> bool:
        async with self._reading() as db:
            return bool(await db.fetchval("SELECT 1 FROM killed_pids WHERE pid = $1", pid))

    # -- history --------------------------------------------------------------------------------

    async def append_messages(self, pid: str, run_id: str | None, messages: list[Message]) -> list[int]:
        if not messages:
            return []
        rows = await self._write().fetch(
            _APPEND_MESSAGES,
            pid,
            run_id,
            [m.role for m in messages],
            [message_to_json(m) for m in messages],
            time.time(),
        )
        if not rows:
            raise NoSuchProcess(pid)
        return sorted(int(r[0]) for r in rows)

    async def history(
        self, pid: str, *, generation: int | None = None, limit: int | None = None, before: int | None = None
    ) -> list[StoredMessage]:
        args: list[Any] = [pid]
        if generation is None:  # the current one, looked up by the same statement
            sql = (
                "SELECT id, generation, run_id, body FROM messages WHERE pid = $1"
                " AND generation = (SELECT history_generation FROM processes WHERE pid = $1)"
            )
        else:
            args.append(generation)
            sql = "SELECT id, generation, run_id, body FROM messages WHERE pid = $1 AND generation = $2::bigint"
        if before is not None:
            args.append(before)
            sql += f" AND id < ${len(args)}::bigint"
        async with self._reading() as db:
            if limit is not None:
                args.append(limit)
                rows = list(await db.fetch(sql + f" ORDER BY id DESC LIMIT ${len(args)}", *args))
                rows.reverse()
            else:
                rows = await db.fetch(sql + " ORDER BY id", *args)
            if (
                not rows
                and generation is None
                and await db.fetchval("SELECT 1 FROM processes WHERE pid = $1", pid) is None
            ):
                raise NoSuchProcess(pid)
        return [StoredMessage(r[0], r[1], r[2], message_from_json(r[3])) for r in rows]

    async def update_messages(self, pid: str, updates: list[tuple[int, Message]]) -> None:
        await self._write().executemany(
            "UPDATE messages SET role = $1, body = $2 WHERE pid = $3 AND id = $4::bigint",
            [(m.role, message_to_json(m), pid, i) for i, m in updates],
        )

    async def delete_run_messages(self, pid: str, run_id: str) -> int:
        status = await self._write().execute("DELETE FROM messages WHERE pid = $1 AND run_id = $2", pid, run_id)
        return int(status.split()[-1])

    async def truncate_messages(self, pid: str, after_id: int) -> int:
        status = await self._write().execute("DELETE FROM messages WHERE pid = $1 AND id > $2::bigint", pid, after_id)
        return int(status.split()[-1])

    async def replace_messages(self, pid: str, from_id: int, to_id: int, replacement: Message) -> int:
        db = self._write()
        gen = await db.fetchval("SELECT history_generation FROM processes WHERE pid = $1", pid)
        if gen is None:
            raise NoSuchProcess(pid)
        await db.execute(
            "DELETE FROM messages WHERE pid = $1 AND id BETWEEN $2::bigint AND $3::bigint", pid, from_id, to_id
        )
        await db.execute(
            "INSERT INTO messages (pid, id, generation, run_id, role, body, created_at)"
            " VALUES ($1, $2, $3, NULL, $4, $5, $6)",
            pid,
            to_id,
            gen,
            replacement.role,
            message_to_json(replacement),
            time.time(),
        )
        return to_id

    async def new_generation(self, pid: str) -> int:
        db = self._write()
        gen = await db.fetchval(
            "UPDATE processes SET history_generation = history_generation + 1 WHERE pid = $1"
            " RETURNING history_generation",
            pid,
        )
        if gen is None:
            raise NoSuchProcess(pid)
        await db.execute("DELETE FROM messages WHERE pid = $1", pid)
        return int(gen)

    # -- tool calls -----------------------------------------------------------------------------

    async def register_calls(self, rows: list[ToolCallRow]) -> None:
        db = self._write()
        if not rows:
            return
        now = time.time()
        await db.executemany(
            f"INSERT INTO pending_tool_calls ({CALL_COLUMNS})"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
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
                    None if r.deadline is None else float(r.deadline),
                    dumps(r.result) if r.result is not None else None,
                    float(r.created_at or now),
                )
                for r in rows
            ],
        )

    async def calls(self, pid: str, run_id: str | None = None) -> list[ToolCallRow]:
        sql = f"SELECT {CALL_COLUMNS} FROM pending_tool_calls WHERE pid = $1"
        args: list[Any] = [pid]
        if run_id is not None:
            sql += " AND run_id = $2"
            args.append(run_id)
        async with self._reading() as db:
            rows = await db.fetch(sql + " ORDER BY run_id, position", *args)
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
        done = await self._write().execute(
            "UPDATE pending_tool_calls SET status = $1, result = COALESCE($2, result),"
            " deadline = COALESCE($3, deadline) WHERE dispatch_id = $4 AND status = ANY($5::text[])",
            status,
            dumps(result) if result is not None else None,
            None if deadline is None else float(deadline),
            dispatch_id,
            list(expect),
        )
        return _changed(done) == 1

    async def delete_calls(self, pid: str, run_id: str | None = None) -> None:
        if run_id is None:
            await self._write().execute("DELETE FROM pending_tool_calls WHERE pid = $1", pid)
        else:
            await self._write().execute("DELETE FROM pending_tool_calls WHERE pid = $1 AND run_id = $2", pid, run_id)

    # -- input queue ----------------------------------------------------------------------------

    async def enqueue(
        self, pid: str, kind: QueueKind, message: Message, run_id: str | None = None, reason: str | None = None
    ) -> int:
        body = message_to_json(message)
        item_id = await self._write().fetchval(_ENQUEUE, pid, kind, run_id, body, time.time(), reason)
        if item_id is None:
            raise NoSuchProcess(pid)
        return int(item_id)

    async def queue(self, pid: str) -> list[QueueItem]:
        async with self._reading() as db:
            rows = await db.fetch(
                "SELECT id, kind, run_id, body, created_at, reason FROM message_queue WHERE pid = $1 ORDER BY id", pid
            )
        return [QueueItem(r[0], r[1], r[2], message_from_json(r[3]), r[4], r[5]) for r in rows]

    async def dequeue(self, pid: str, item_id: int) -> bool:
        status = await self._write().execute(
            "DELETE FROM message_queue WHERE pid = $1 AND id = $2::bigint", pid, item_id
        )
        return _changed(status) == 1

    # -- approvals ------------------------------------------------------------------------------

    async def put_hil(self, row: HilRow) -> None:
        await self._write().execute(
            f"INSERT INTO pending_hil ({HIL_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
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
            float(row.created_at or time.time()),
        )

    async def hils(self, pid: str) -> list[HilRow]:
        async with self._reading() as db:
            rows = await db.fetch(
                f"SELECT {HIL_COLUMNS} FROM pending_hil WHERE pid = $1 ORDER BY created_at, request_id", pid
            )
        return [hil_row(r) for r in rows]

    async def account_hils(self, owner: str) -> list[HilRow]:
        async with self._reading() as db:
            rows = await db.fetch(ACCOUNT_HILS.format(owner="$1"), owner)
        return [hil_row(r) for r in rows]

    async def delete_hil(self, request_id: str) -> bool:
        status = await self._write().execute("DELETE FROM pending_hil WHERE request_id = $1", request_id)
        return _changed(status) == 1

    # -- the approvals audit --------------------------------------------------------------------

    async def add_approval_audit(self, row: ApprovalAuditRow) -> None:
        marks = ", ".join(f"${n}" for n in range(1, AUDIT_WIDTH + 1))
        await self._write().execute(
            f"INSERT INTO approval_audit ({AUDIT_COLUMNS}) VALUES ({marks})", *audit_values(row)
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
        sql, args = audit_query(lambda n: f"${n}", owner, limit, filters)
        async with self._reading() as db:
            rows = await db.fetch(sql, *args)
        return [audit_row(r) for r in rows]

    # -- key-value ------------------------------------------------------------------------------

    async def kv_get(self, pid: str, key: str) -> Any | None:
        async with self._reading() as db:
            value = await db.fetchval("SELECT value FROM process_kv WHERE pid = $1 AND key = $2", pid, key)
        return json.loads(value) if value is not None else None

    async def kv_many(self, pid: str, keys: Sequence[str]) -> dict[str, Any]:
        if not keys:
            return {}
        async with self._reading() as db:
            rows = await db.fetch(
                "SELECT key, value FROM process_kv WHERE pid = $1 AND key = ANY($2::text[])", pid, list(keys)
            )
        return {row["key"]: json.loads(row["value"]) for row in rows}

    async def kv_set(self, pid: str, key: str, value: Any) -> None:
        await self._write().execute(
            "INSERT INTO process_kv (pid, key, value) VALUES ($1, $2, $3)"
            " ON CONFLICT (pid, key) DO UPDATE SET value = excluded.value",
            pid,
            key,
            dumps(value),
        )

    async def kv_delete(self, pid: str, key: str) -> None:
        await self._write().execute("DELETE FROM process_kv WHERE pid = $1 AND key = $2", pid, key)

    async def kv_add(self, pid: str, key: str, value: Any, *, generation: int) -> bool:
        sql = KV_ADD.format(pid="$1", key="$2", value="$3", generation="$4")
        return _changed(await self._write().execute(sql, pid, key, dumps(value), generation)) == 1

    async def kv_values(self, key: str, owner: str | None = None) -> dict[str, Any]:
        async with self._reading() as db:
            if owner is None:
                rows = await db.fetch("SELECT pid, value FROM process_kv WHERE key = $1", key)
            else:
                rows = await db.fetch(OWNER_KV.format(owner="$1", key="$2"), owner, key)
        return {row[0]: json.loads(row[1]) for row in rows}

    # -- signal log -----------------------------------------------------------------------------

    async def append_event(self, pid: str, signal: str, payload: dict[str, Any]) -> int:
        return (await self.append_events(pid, [(signal, payload)]))[0]

    async def append_events(self, pid: str, events: list[tuple[str, dict[str, Any]]]) -> list[int]:
        if not events:
            return []
        rows = await self._write().fetch(
            _APPEND_EVENTS,
            pid,
            [name for name, _ in events],
            [dumps(payload) for _, payload in events],
            time.time(),
        )
        if not rows:
            raise NoSuchProcess(pid)
        return sorted(int(r[0]) for r in rows)

    async def notify_account(self, owner: str, pid: str, signals: list[tuple[int, int, str, dict[str, Any]]]) -> None:
        """In this transaction, one notification (or a few) on ``LIVE_CHANNEL``: delivered to the
        other workers at commit, never for a rollback. A payload too large for a notification is
        sent as null, for its readers to take from the account log."""
        head = dumps({"sender": self._sender, "owner": owner, "pid": pid, "account": []}).removesuffix("[]}")
        room = _NOTIFY_MAX - len(head.encode()) - 1
        texts = []
        for account_seq, seq, name, payload in signals:
            text = dumps([account_seq, seq, name, payload])
            if len(text.encode()) > room - 2:  # (within its group's brackets)
                text = dumps([account_seq, seq, name, None])
            texts.append(text)
        for group in _fill(2, texts, room):
            body = f"{head}[{','.join(group)}]}}"
            await self._write().execute("SELECT pg_notify($1, $2)", LIVE_CHANNEL, body)

    async def notify_device(self, news: DeviceNews) -> None:
        """In this transaction, one notification on ``LIVE_CHANNEL`` (delivered to the other
        workers at commit). Small: account and device names are short, and so is ``detail``."""
        body = dumps({"sender": self._sender, "device": [news.owner, news.name, news.event, news.detail]})
        await self._write().execute("SELECT pg_notify($1, $2)", LIVE_CHANNEL, body)

    async def events(self, pid: str, after_seq: int = 0, limit: int = 1000) -> list[EventRow]:
        async with self._reading() as db:
            rows = await db.fetch(
                "SELECT seq, signal, payload, created_at FROM events WHERE pid = $1 AND seq > $2::bigint"
                " ORDER BY seq LIMIT $3",
                pid,
                after_seq,
                limit,
            )
        return [EventRow(r[0], r[1], json.loads(r[2]), r[3]) for r in rows]

    async def last_event_seq(self, pid: str) -> int:
        async with self._reading() as db:
            found = await db.fetchval("SELECT MAX(seq) FROM events WHERE pid = $1", pid)
        return int(found) if found is not None else 0

    async def prune_events(self, pid: str, *, through: int | None = None) -> int:
        # One upper bound made of the arguments and an uncorrelated subquery (an InitPlan): an
        # index range. (A bound naming ``seq`` itself, as ``COALESCE($2, seq)``, is only a filter:
        # every prune read the process's whole log, and all of one a watch holds back.)
        bound = (1 << 63) - 1 if through is None else max(0, min(through, (1 << 63) - 1))
        status = await self._write().execute(
            "DELETE FROM events WHERE pid = $1 AND seq <= LEAST($2::bigint, COALESCE("
            "(SELECT MIN(seen_seq) FROM signal_watches WHERE source_pid = $1), $2::bigint))",
            pid,
            bound,
        )
        return int(status.split()[-1])

    # -- account log ----------------------------------------------------------------------------

    async def append_account_events(
        self, owner: str, pid: str, events: list[tuple[int, str, dict[str, Any]]]
    ) -> list[int]:
        if not events:
            return []
        rows = await self._write().fetch(
            _APPEND_ACCOUNT_EVENTS,
            owner,
            pid,
            [seq for seq, _, _ in events],
            [name for _, name, _ in events],
            [dumps(payload) for _, _, payload in events],
            time.time(),
        )
        return sorted(int(r[0]) for r in rows)

    async def account_events(self, owner: str, after_seq: int = 0, limit: int = 1000) -> list[AccountEventRow]:
        async with self._reading() as db:
            rows = await db.fetch(
                "SELECT seq, pid, pid_seq, signal, payload, created_at FROM account_events"
                " WHERE owner = $1 AND seq > $2::bigint ORDER BY seq LIMIT $3",
                owner,
                after_seq,
                limit,
            )
        return [AccountEventRow(int(r[0]), r[1], int(r[2]), r[3], json.loads(r[4]), r[5]) for r in rows]

    async def last_account_seq(self, owner: str) -> int:
        async with self._reading() as db:
            found = await db.fetchval("SELECT MAX(seq) FROM account_events WHERE owner = $1", owner)
        return int(found) if found is not None else 0

    async def last_account_seqs(self, owners: Sequence[str]) -> dict[str, int]:
        async with self._reading() as db:
            rows = await db.fetch(
                "SELECT owner, MAX(seq) FROM account_events WHERE owner = ANY($1::text[]) GROUP BY owner",
                list(owners),
            )
        return {row[0]: int(row[1]) for row in rows}

    async def prune_account_events(self, owner: str, *, through: int) -> int:
        bound = max(0, min(through, MAX_SEQ))
        status = await self._write().execute(
            "DELETE FROM account_events WHERE owner = $1 AND seq <= LEAST($2::bigint,"
            " (SELECT MAX(seq) FROM account_events WHERE owner = $1) - 1)",
            owner,
            bound,
        )
        return _changed(status)

    # -- history segments -----------------------------------------------------------------------

    async def add_segment(self, row: SegmentRow) -> None:
        await self._write().execute(
            f"INSERT INTO history_segments ({SEGMENT_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            row.id,
            row.pid,
            row.generation,
            row.kind,
            row.from_message_id,
            row.to_message_id,
            row.archive_path,
            row.summary_message_id,
            float(row.created_at or time.time()),
        )

    async def segments(self, pid: str) -> list[SegmentRow]:
        async with self._reading() as db:
            rows = await db.fetch(
                f"SELECT {SEGMENT_COLUMNS} FROM history_segments WHERE pid = $1 ORDER BY created_at, id", pid
            )
        return [SegmentRow(*r) for r in rows]

    async def delete_segment(self, segment_id: str) -> bool:
        return _changed(await self._write().execute("DELETE FROM history_segments WHERE id = $1", segment_id)) == 1

    async def idle_processes(self, before: float, pids: Sequence[str] | None = None) -> list[ProcessRecord]:
        if pids is None:
            async with self._reading() as db:
                rows = await db.fetch(_IDLE_SINCE + _IDLE_ORDER, float(before))
            return [process_record(r) for r in rows]
        db = self._write()
        # the rows locked first, in a statement of their own; the look after it, a statement of its
        # own too, sees every commit before. NOWAIT: a row another transaction holds is a process
        # at work, so none is idle; the look gives way rather than wait (or deadlock) with a live
        # step, and the caller ends its transaction, which the refused lock has spoilt
        try:
            await db.execute(
                "SELECT 1 FROM processes WHERE pid = ANY($1::text[]) ORDER BY pid FOR UPDATE NOWAIT", list(pids)
            )
        except asyncpg.LockNotAvailableError:
            return []
        rows = await db.fetch(_IDLE_SINCE + _IDLE_AMONG + _IDLE_ORDER, float(before), list(pids))
        return [process_record(r) for r in rows]

    def hold_runtime(self) -> None:
        pass  # runtimes sharing the database each hold the processes they drive (leases)

    async def exclusive(self, key: str) -> None:
        # a transaction-scoped advisory lock: released by the commit or rollback, on any worker
        await self._write().execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", key)

    # -- schedules ------------------------------------------------------------------------------

    async def add_schedule(self, row: ScheduleRow) -> None:
        status = await self._write().execute(
            f"INSERT INTO schedules ({SCHEDULE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"
            " ON CONFLICT DO NOTHING",
            row.id,
            row.pid,
            row.text,
            float(row.next_due),
            None if row.every is None else float(row.every),
            row.name,
            float(row.created_at or time.time()),
            row.cron,
            row.tz,
        )
        if _changed(status) == 0:
            raise StoreError(f"schedule {row.id} exists already")

    async def schedules(self, pid: str) -> list[ScheduleRow]:
        async with self._reading() as db:
            rows = await db.fetch(f"SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE pid = $1 ORDER BY next_due, id", pid)
        return [ScheduleRow(*r) for r in rows]

    async def due_schedules(self, before: float | None, limit: int = 100) -> list[ScheduleRow]:
        async with self._reading() as db:
            if before is None:
                rows = await db.fetch(f"SELECT {SCHEDULE_COLUMNS} FROM schedules ORDER BY next_due, id LIMIT $1", limit)
            else:
                rows = await db.fetch(
                    f"SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE next_due <= $1 ORDER BY next_due, id LIMIT $2",
                    float(before),
                    limit,
                )
        return [ScheduleRow(*r) for r in rows]

    async def set_schedule_due(self, schedule_id: str, next_due: float, *, expect: float) -> bool:
        status = await self._write().execute(
            "UPDATE schedules SET next_due = $1 WHERE id = $2 AND next_due = $3",
            float(next_due),
            schedule_id,
            float(expect),
        )
        return _changed(status) == 1

    async def delete_schedule(self, schedule_id: str) -> bool:
        return _changed(await self._write().execute("DELETE FROM schedules WHERE id = $1", schedule_id)) == 1

    # -- signal watches -------------------------------------------------------------------------

    async def add_watch(self, row: WatchRow) -> None:
        status = await self._write().execute(
            f"INSERT INTO signal_watches ({WATCH_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING",
            row.id,
            row.pid,
            row.source_pid,
            row.signal,
            int(row.once),
            row.seen_seq,
            float(row.created_at or time.time()),
        )
        if _changed(status) == 0:
            raise StoreError(f"watch {row.id} exists already")

    async def watches(self, *, pid: str | None = None, source_pid: str | None = None) -> list[WatchRow]:
        async with self._reading() as db:
            rows = await db.fetch(
                f"SELECT {WATCH_COLUMNS} FROM signal_watches"
                " WHERE ($1::text IS NULL OR pid = $1) AND ($2::text IS NULL OR source_pid = $2)"
                " ORDER BY created_at, id",
                pid,
                source_pid,
            )
        return [watch_row(r) for r in rows]

    async def set_watch_seen(self, watch_id: str, seq: int, *, expect: int | None = None) -> bool:
        if expect is None:
            status = await self._write().execute("UPDATE signal_watches SET seen_seq = $1 WHERE id = $2", seq, watch_id)
        else:
            status = await self._write().execute(
                "UPDATE signal_watches SET seen_seq = $1 WHERE id = $2 AND seen_seq = $3", seq, watch_id, expect
            )
        return _changed(status) == 1

    async def delete_watch(self, watch_id: str) -> bool:
        return _changed(await self._write().execute("DELETE FROM signal_watches WHERE id = $1", watch_id)) == 1

    async def lagging_watches(self, before: float) -> list[str]:
        async with self._reading() as db:
            return [r[0] for r in await db.fetch(LAGGING_WATCHES, before)]

    # -- leases ---------------------------------------------------------------------------------

    async def claim_lease(self, pid: str, owner: str, ttl: float) -> int | None:
        epoch = await self.pool.fetchval(_CLAIM, pid, owner, float(ttl))
        return None if epoch is None else int(epoch)

    async def claim_orphans(
        self, owner: str, ttl: float, limit: int = 100, *, reclaim: bool = False
    ) -> list[tuple[str, int]]:
        rows = await self.pool.fetch(_CLAIM_ORPHANS, owner, float(ttl), limit, owner if reclaim else None)
        return [(r[0], int(r[1])) for r in rows]

    async def renew_leases(self, owner: str, ttl: float) -> dict[str, int]:
        rows = await self.pool.fetch(
            f"UPDATE process_leases SET expires = {_NOW} + $2 WHERE owner = $1 RETURNING pid, epoch", owner, float(ttl)
        )
        return {r[0]: int(r[1]) for r in rows}

    async def release_lease(self, pid: str, owner: str, epoch: int) -> bool:
        status = await self.pool.execute(
            "UPDATE process_leases SET owner = NULL, expires = 0 WHERE pid = $1 AND owner = $2 AND epoch = $3",
            pid,
            owner,
            epoch,
        )
        return _changed(status) == 1

    async def lease(self, pid: str) -> Lease | None:
        async with self._reading() as db:
            row = await db.fetchrow("SELECT pid, owner, epoch, expires FROM process_leases WHERE pid = $1", pid)
        return Lease(row[0], row[1], int(row[2]), float(row[3])) if row else None

    async def fence(self, pid: str, owner: str, epoch: int, ttl: float) -> bool:
        # the UPDATE's row lock holds until commit: a claimer waits, then finds the lease extended;
        # the notification (the other workers' cue, as ``notify``) rides in the same round trip
        told = await self._write().fetchval(
            f"WITH u AS (UPDATE process_leases SET expires = {_NOW} + $4 WHERE pid = $1 AND owner = $2 AND epoch = $3"
            " RETURNING pid) SELECT count(pg_notify($5, u.pid || ' ' || $2)) FROM u",
            pid,
            owner,
            epoch,
            float(ttl),
            CHANNEL,
        )
        return int(told) == 1

    async def claim_duty(self, name: str, owner: str, ttl: float) -> int | None:
        epoch = await self.pool.fetchval(_CLAIM_DUTY, name, owner, float(ttl))
        return None if epoch is None else int(epoch)

    async def release_duty(self, name: str, owner: str) -> bool:
        status = await self.pool.execute(
            "UPDATE duties SET owner = NULL, expires = 0 WHERE name = $1 AND owner = $2", name, owner
        )
        return _changed(status) == 1

    async def duty(self, name: str) -> DutyLease | None:
        async with self._reading() as db:
            row = await db.fetchrow("SELECT name, owner, epoch, expires FROM duties WHERE name = $1", name)
        return DutyLease(row[0], row[1], int(row[2]), float(row[3])) if row else None

    async def notify(self, pid: str, sender: str) -> None:
        await self._write().execute("SELECT pg_notify($1, $2)", CHANNEL, f"{pid} {sender}")

    async def listen(
        self, notified: Notified, live: LiveListener | None = None
    ) -> Callable[[], Awaitable[None]] | None:
        """LISTEN on a connection of its own (not the pool's: a pooled connection is shared). A
        notification sent while the connection is down is lost, which the caller's polling covers;
        a lost connection (the server restarted, a network blip) is replaced at once and then
        retried until it is back, since without one every later notification would be lost too:
        the relayed live text and the other workers' interest in it travel by notification only."""

        def deliver(_conn: Any, _pid: int, _channel: str, payload: str) -> None:
            pid, _, sender = payload.partition(" ")
            notified(pid, sender)

        def deliver_live(_conn: Any, _pid: int, _channel: str, payload: str) -> None:
            assert live is not None
            try:
                message = json.loads(payload)
                sender = str(message["sender"])
                if "account" in message:
                    accounted = getattr(live, "accounted", None)
                    if sender != self._sender and accounted is not None:  # (its own: published as committed)
                        accounted(str(message["owner"]), str(message["pid"]), _account_items(message["account"]))
                elif "device" in message:
                    deviced = getattr(live, "deviced", None)
                    if sender != self._sender and deviced is not None:  # (its own: acted on where it was made)
                        deviced(_device_news(message["device"]))
                elif "follow" in message:
                    live.followed(sender, [str(pid) for pid in message["follow"]])
                else:
                    live.relayed(
                        sender,
                        [(str(p), int(b), [x for x in xs if isinstance(x, dict)]) for p, b, xs in message["batches"]],
                    )
            except (ValueError, TypeError, KeyError):  # not ours: another program on the channel
                log.debug("ignored a malformed message on %s", LIVE_CHANNEL)

        listeners = [(CHANNEL, deliver)] + ([(LIVE_CHANNEL, deliver_live)] if live is not None else [])
        lost = asyncio.Event()

        def on_lost(_conn: Any) -> None:
            lost.set()

        async def connect() -> Any:
            conn = await asyncpg.connect(self._dsn, timeout=15)
            try:
                for channel, callback in listeners:
                    await conn.add_listener(channel, callback)
            except BaseException:
                conn.terminate()
                raise
            conn.add_termination_listener(on_lost)
            if conn.is_closed():  # lost before its listener was there to hear it
                lost.set()
            return conn

        try:
            current = [await connect()]
        except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise self._error("cannot listen on", exc) from None

        async def keep() -> None:
            while True:
                await lost.wait()
                lost.clear()
                log.warning("the notification connection to %s was lost; listening again", self.url)
                delay = 0.1
                while True:
                    try:
                        current[0] = await connect()
                        break
                    except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                        log.debug("cannot listen on %s yet: %s", self.url, scrub(str(exc), self._dsn))
                        await asyncio.sleep(delay)
                        delay = min(2 * delay, 5.0)

        keeper = asyncio.get_running_loop().create_task(keep(), name="agentloop-listen")

        async def stop() -> None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            conn = current[0]
            conn.remove_termination_listener(on_lost)
            for channel, callback in listeners:
                with contextlib.suppress(Exception):
                    await conn.remove_listener(channel, callback)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 5)
            if not conn.is_closed():
                conn.terminate()

        return stop

    async def relay(self, sender: str, batches: list[RelayBatch]) -> None:
        for payload in pack_relay(sender, batches):
            await self._notify_live(payload)

    async def follow_live(self, sender: str, pids: list[str]) -> None:
        head = f'{{"sender":{dumps(sender)},"follow":['
        for items in _fill(len(head.encode()) + 2, [dumps(pid) for pid in pids]):
            await self._notify_live(head + ",".join(items) + "]}")

    async def _notify_live(self, payload: str) -> None:
        try:
            await self.pool.execute("SELECT pg_notify($1, $2)", LIVE_CHANNEL, payload)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise self._error("cannot relay through", exc) from None

    # -- accounts and tokens --------------------------------------------------------------------

    async def create_account(self, record: AccountRecord) -> None:
        status = await self._write().execute(
            "INSERT INTO accounts (name, admin, created_at) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
            record.name,
            int(record.admin),
            float(record.created_at or time.time()),
        )
        if _changed(status) != 1:
            raise StoreError(f"account {record.name!r} already exists")

    async def get_account(self, name: str) -> AccountRecord | None:
        async with self._reading() as db:
            row = await db.fetchrow("SELECT name, admin, created_at FROM accounts WHERE name = $1", name)
        return account_row(row) if row else None

    async def list_accounts(self) -> list[AccountRecord]:
        async with self._reading() as db:
            # by code point, as SQLite sorts: the database's collation may be a language's
            rows = await db.fetch('SELECT name, admin, created_at FROM accounts ORDER BY name COLLATE "C"')
        return [account_row(r) for r in rows]

    async def add_token(self, record: TokenRecord) -> None:
        status = await self._write().execute(
            f"INSERT INTO tokens ({TOKEN_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
            record.id,
            record.account,
            record.hash,
            record.label,
            float(record.created_at or time.time()),
            None if record.revoked_at is None else float(record.revoked_at),
        )
        if _changed(status) != 1:
            raise StoreError(f"token {record.id!r} (or one with the same hash) exists already")

    async def token_by_hash(self, token_hash: str) -> TokenRecord | None:
        async with self._reading() as db:
            row = await db.fetchrow(f"SELECT {TOKEN_COLUMNS} FROM tokens WHERE hash = $1", token_hash)
        return TokenRecord(*row) if row else None

    async def list_tokens(self, account: str | None = None) -> list[TokenRecord]:
        async with self._reading() as db:
            if account is None:
                rows = await db.fetch(f"SELECT {TOKEN_COLUMNS} FROM tokens ORDER BY created_at, id")
            else:
                rows = await db.fetch(
                    f"SELECT {TOKEN_COLUMNS} FROM tokens WHERE account = $1 ORDER BY created_at, id", account
                )
        return [TokenRecord(*r) for r in rows]

    async def revoke_token(self, token_id: str, at: float) -> bool:
        status = await self._write().execute(
            "UPDATE tokens SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL", float(at), token_id
        )
        return _changed(status) == 1

    async def set_device_token(
        self, owner: str, name: str, token_id: str | None, token_hash: str | None, at: float
    ) -> bool:
        if token_id is None:
            status = await self._write().execute(
                "UPDATE devices SET token_id = NULL, token_hash = NULL"
                " WHERE owner = $1 AND name = $2 AND token_id IS NOT NULL",
                owner,
                name,
            )
            return _changed(status) == 1
        await self._write().execute(
            "INSERT INTO devices (owner, name, label, description, token_id, token_hash, created_at)"
            " VALUES ($1, $2, '', '', $3, $4, $5) ON CONFLICT (owner, name) DO UPDATE"
            " SET token_id = excluded.token_id, token_hash = excluded.token_hash",
            owner,
            name,
            token_id,
            token_hash,
            float(at),
        )
        return True

    async def device_by_token(self, token_hash: str) -> DeviceRecord | None:
        async with self._reading() as db:
            row = await db.fetchrow(f"SELECT {DEVICE_COLUMNS} FROM devices WHERE token_hash = $1", token_hash)
        return DeviceRecord(*row) if row else None

    async def device_seen(
        self, owner: str, name: str, at: float, label: str | None = None, description: str | None = None
    ) -> None:
        await self._write().execute(
            "INSERT INTO devices (owner, name, label, description, created_at, first_seen_at, last_seen_at)"
            " VALUES ($1, $2, COALESCE($4, ''), COALESCE($5, ''), $3, $3, $3) ON CONFLICT (owner, name) DO UPDATE"
            " SET last_seen_at = excluded.last_seen_at,"
            " first_seen_at = COALESCE(devices.first_seen_at, excluded.first_seen_at),"
            " label = COALESCE($4, devices.label), description = COALESCE($5, devices.description)",
            owner,
            name,
            float(at),
            label,
            description,
        )

    async def list_devices(self, owner: str | None = None) -> list[DeviceRecord]:
        async with self._reading() as db:
            if owner is None:
                order = 'ORDER BY owner COLLATE "C", name COLLATE "C"'
                rows = await db.fetch(f"SELECT {DEVICE_COLUMNS} FROM devices {order}")
            else:
                rows = await db.fetch(
                    f'SELECT {DEVICE_COLUMNS} FROM devices WHERE owner = $1 ORDER BY name COLLATE "C"', owner
                )
        return [DeviceRecord(*r) for r in rows]

    async def forget_device(self, owner: str, name: str) -> bool:
        status = await self._write().execute("DELETE FROM devices WHERE owner = $1 AND name = $2", owner, name)
        return _changed(status) == 1
