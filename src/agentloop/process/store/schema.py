"""The durable schema, one list of versioned migrations shared by every store dialect.

Each migration is plain SQL that SQLite and PostgreSQL both accept (no AUTOINCREMENT, no
dialect types): ids that need an order are assigned by the store from a per-process counter,
not by the database. The one dialect word is ``{clustered}`` after a table definition: SQLite
reads ``WITHOUT ROWID`` there (the rows live in their primary key's B-tree, so an insert writes
one tree instead of a table plus its key index); other dialects read nothing. A store applies, in
one transaction each, the migrations above the version it finds in ``schema_version``; a
database newer than the code is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE processes (
            pid TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            run_as TEXT NOT NULL,
            cwd TEXT NOT NULL,
            parent_pid TEXT,
            interactive INTEGER NOT NULL,
            context TEXT NOT NULL,
            state TEXT NOT NULL,
            current_run TEXT,
            history_generation INTEGER NOT NULL,
            next_message_id INTEGER NOT NULL,
            next_event_seq INTEGER NOT NULL,
            next_queue_id INTEGER NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX processes_owner ON processes (owner);
        CREATE TABLE messages (
            pid TEXT NOT NULL,
            id INTEGER NOT NULL,
            generation INTEGER NOT NULL,
            run_id TEXT,
            role TEXT NOT NULL,
            body TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (pid, id)
        );
        CREATE TABLE pending_tool_calls (
            dispatch_id TEXT PRIMARY KEY,
            pid TEXT NOT NULL,
            run_id TEXT NOT NULL,
            position INTEGER NOT NULL,
            tool_call_id TEXT NOT NULL,
            tool_name TEXT NOT NULL,
            syscall TEXT NOT NULL,
            args TEXT NOT NULL,
            status TEXT NOT NULL,
            deadline DOUBLE PRECISION,
            result TEXT,
            created_at DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX pending_tool_calls_run ON pending_tool_calls (pid, run_id, position);
        CREATE TABLE message_queue (
            pid TEXT NOT NULL,
            id INTEGER NOT NULL,
            kind TEXT NOT NULL,
            run_id TEXT,
            body TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (pid, id)
        );
        CREATE TABLE pending_hil (
            request_id TEXT PRIMARY KEY,
            pid TEXT NOT NULL,
            run_id TEXT NOT NULL,
            dispatch_id TEXT NOT NULL,
            tool_call_id TEXT NOT NULL,
            tool_name TEXT NOT NULL,
            syscall TEXT NOT NULL,
            args TEXT NOT NULL,
            fingerprint TEXT NOT NULL,
            tags TEXT NOT NULL,
            reason TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX pending_hil_pid ON pending_hil (pid);
        CREATE TABLE process_kv (
            pid TEXT NOT NULL,
            key TEXT NOT NULL,
            value TEXT NOT NULL,
            PRIMARY KEY (pid, key)
        );
        CREATE TABLE events (
            pid TEXT NOT NULL,
            seq INTEGER NOT NULL,
            signal TEXT NOT NULL,
            payload TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (pid, seq)
        );
        CREATE TABLE history_segments (
            id TEXT PRIMARY KEY,
            pid TEXT NOT NULL,
            generation INTEGER NOT NULL,
            kind TEXT NOT NULL,
            from_message_id INTEGER NOT NULL,
            to_message_id INTEGER NOT NULL,
            archive_path TEXT,
            summary_message_id INTEGER,
            created_at DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX history_segments_pid ON history_segments (pid, generation);
        """,
    ),
    (
        2,
        """
        CREATE TABLE accounts (
            name TEXT PRIMARY KEY,
            admin INTEGER NOT NULL,
            created_at DOUBLE PRECISION NOT NULL
        );
        CREATE TABLE tokens (
            id TEXT PRIMARY KEY,
            account TEXT NOT NULL,
            hash TEXT NOT NULL UNIQUE,
            label TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            revoked_at DOUBLE PRECISION
        );
        CREATE INDEX tokens_account ON tokens (account);
        """,
    ),
    (
        3,
        # Measured on the W1 workload: a step's commit wrote five pages (messages, events and
        # their key indexes, the process row); clustered tables make it three.
        """
        CREATE TABLE processes_v3 (
            pid TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            run_as TEXT NOT NULL,
            cwd TEXT NOT NULL,
            parent_pid TEXT,
            interactive INTEGER NOT NULL,
            context TEXT NOT NULL,
            state TEXT NOT NULL,
            current_run TEXT,
            history_generation INTEGER NOT NULL,
            next_message_id INTEGER NOT NULL,
            next_event_seq INTEGER NOT NULL,
            next_queue_id INTEGER NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        ) {clustered};
        INSERT INTO processes_v3 SELECT pid, owner, run_as, cwd, parent_pid, interactive, context, state,
            current_run, history_generation, next_message_id, next_event_seq, next_queue_id, created_at,
            updated_at FROM processes;
        DROP TABLE processes;
        ALTER TABLE processes_v3 RENAME TO processes;
        CREATE INDEX processes_owner ON processes (owner);

        CREATE TABLE messages_v3 (
            pid TEXT NOT NULL,
            id INTEGER NOT NULL,
            generation INTEGER NOT NULL,
            run_id TEXT,
            role TEXT NOT NULL,
            body TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (pid, id)
        ) {clustered};
        INSERT INTO messages_v3 SELECT pid, id, generation, run_id, role, body, created_at FROM messages;
        DROP TABLE messages;
        ALTER TABLE messages_v3 RENAME TO messages;

        CREATE TABLE pending_tool_calls_v3 (
            dispatch_id TEXT PRIMARY KEY,
            pid TEXT NOT NULL,
            run_id TEXT NOT NULL,
            position INTEGER NOT NULL,
            tool_call_id TEXT NOT NULL,
            tool_name TEXT NOT NULL,
            syscall TEXT NOT NULL,
            args TEXT NOT NULL,
            status TEXT NOT NULL,
            deadline DOUBLE PRECISION,
            result TEXT,
            created_at DOUBLE PRECISION NOT NULL
        ) {clustered};
        INSERT INTO pending_tool_calls_v3 SELECT dispatch_id, pid, run_id, position, tool_call_id, tool_name,
            syscall, args, status, deadline, result, created_at FROM pending_tool_calls;
        DROP TABLE pending_tool_calls;
        ALTER TABLE pending_tool_calls_v3 RENAME TO pending_tool_calls;
        CREATE INDEX pending_tool_calls_run ON pending_tool_calls (pid, run_id, position);

        CREATE TABLE message_queue_v3 (
            pid TEXT NOT NULL,
            id INTEGER NOT NULL,
            kind TEXT NOT NULL,
            run_id TEXT,
            body TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (pid, id)
        ) {clustered};
        INSERT INTO message_queue_v3 SELECT pid, id, kind, run_id, body, created_at FROM message_queue;
        DROP TABLE message_queue;
        ALTER TABLE message_queue_v3 RENAME TO message_queue;

        CREATE TABLE process_kv_v3 (
            pid TEXT NOT NULL,
            key TEXT NOT NULL,
            value TEXT NOT NULL,
            PRIMARY KEY (pid, key)
        ) {clustered};
        INSERT INTO process_kv_v3 SELECT pid, key, value FROM process_kv;
        DROP TABLE process_kv;
        ALTER TABLE process_kv_v3 RENAME TO process_kv;

        CREATE TABLE events_v3 (
            pid TEXT NOT NULL,
            seq INTEGER NOT NULL,
            signal TEXT NOT NULL,
            payload TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (pid, seq)
        ) {clustered};
        INSERT INTO events_v3 SELECT pid, seq, signal, payload, created_at FROM events;
        DROP TABLE events;
        ALTER TABLE events_v3 RENAME TO events;
        """,
    ),
    (
        4,
        # Runtime events (DESIGN §3): schedules that deliver a system event when due, and watches
        # that deliver one when another process logs a signal. ``seen_seq`` is how far the
        # watcher has read the source's signal log, so a restart delivers what it missed.
        """
        CREATE TABLE schedules (
            id TEXT PRIMARY KEY,
            pid TEXT NOT NULL,
            text TEXT NOT NULL,
            name TEXT,
            next_due DOUBLE PRECISION NOT NULL,
            every DOUBLE PRECISION,
            created_at DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX schedules_due ON schedules (next_due);
        CREATE INDEX schedules_pid ON schedules (pid);
        CREATE TABLE signal_watches (
            id TEXT PRIMARY KEY,
            pid TEXT NOT NULL,
            source_pid TEXT NOT NULL,
            signal TEXT NOT NULL,
            once INTEGER NOT NULL,
            seen_seq INTEGER NOT NULL,
            created_at DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX signal_watches_pid ON signal_watches (pid);
        CREATE INDEX signal_watches_source ON signal_watches (source_pid);
        """,
    ),
    (
        5,
        # Scale-out (DESIGN §6): the worker that may advance a process. ``epoch`` grows with every
        # claim and fences commits: a worker whose lease was taken over cannot commit a step.
        # ``expires`` is epoch seconds on the database's clock (PostgreSQL) or the machine's
        # (SQLite); a free lease has no owner. A process without a row has never been claimed.
        """
        CREATE TABLE process_leases (
            pid TEXT PRIMARY KEY,
            owner TEXT,
            epoch INTEGER NOT NULL,
            expires DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX process_leases_owner ON process_leases (owner);
        """,
    ),
    (
        6,
        # Scale-out (DESIGN §6): kernel-wide work that one worker at a time does (firing the
        # schedules), by name. A duty is a lease like a process's, but not on a process: a table
        # of its own, so the process lease code (renewals, the sweep) never sees it. ``epoch``
        # grows when the duty changes hands, not when its holder renews it.
        """
        CREATE TABLE duties (
            name TEXT PRIMARY KEY,
            owner TEXT,
            epoch INTEGER NOT NULL,
            expires DOUBLE PRECISION NOT NULL
        );
        """,
    ),
    (
        7,
        # Input queued for a process another worker holds (a shared store) starts a run of its
        # own when that worker promotes it: the run keeps the reason it was sent with
        # (``proc.send``, a schedule's, a watch's) instead of ``queue.promote``.
        """
        ALTER TABLE message_queue ADD COLUMN reason TEXT;
        """,
    ),
    (
        8,
        # The pids of killed processes: a pid is never used twice. A spawn retried with its run id
        # after the process it made was killed (its pid follows from the run id) would otherwise
        # make a new process under the old pid, run the first message again, and restart its
        # signal numbering under a client that resumes from a later seq.
        """
        CREATE TABLE killed_pids (
            pid TEXT PRIMARY KEY,
            killed_at DOUBLE PRECISION NOT NULL
        ) {clustered};
        """,
    ),
    (
        9,
        # Schedules on a calendar: a cron expression read in an IANA time zone ("every weekday at
        # 9 in Berlin"), which a fixed interval in seconds cannot say across months and DST.
        """
        ALTER TABLE schedules ADD COLUMN cron TEXT;
        ALTER TABLE schedules ADD COLUMN tz TEXT;
        """,
    ),
    (
        10,
        # What a process has spent over its finished runs, written by the UPDATE that ends each run
        # (no statement of its own); a reset keeps it. A kill adds a process's totals to its
        # owner's row of ``account_usage`` before the process row goes, so an account's total is
        # its live processes' plus that row.
        """
        ALTER TABLE processes ADD COLUMN usage_input BIGINT NOT NULL DEFAULT 0;
        ALTER TABLE processes ADD COLUMN usage_output BIGINT NOT NULL DEFAULT 0;
        ALTER TABLE processes ADD COLUMN usage_total_tokens BIGINT NOT NULL DEFAULT 0;
        ALTER TABLE processes ADD COLUMN usage_cost DOUBLE PRECISION NOT NULL DEFAULT 0;
        ALTER TABLE processes ADD COLUMN runs BIGINT NOT NULL DEFAULT 0;
        CREATE TABLE account_usage (
            account TEXT PRIMARY KEY,
            usage_input BIGINT NOT NULL,
            usage_output BIGINT NOT NULL,
            usage_total_tokens BIGINT NOT NULL,
            usage_cost DOUBLE PRECISION NOT NULL,
            runs BIGINT NOT NULL
        ) {clustered};
        """,
    ),
    (
        11,
        # What an account had spent when a budget period (a calendar month) began for it, as the
        # first check in the period found it: the period's spending is the total since, so a
        # monthly budget needs no statement in the runs themselves.
        """
        CREATE TABLE account_periods (
            account TEXT NOT NULL,
            period TEXT NOT NULL,
            spent_before DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (account, period)
        ) {clustered};
        """,
    ),
    (
        12,
        # The account log: a copy of each account-level signal (``signals.for_account``) a process
        # step logs, numbered per owner (``seq``, gapless, in commit order) in the transaction that
        # logs it, so an account stream resumes after the last one its client saw. A copy, keyed by
        # the owner: a reset or a kill drops a process's own log, not this. ``pid_seq`` is the
        # signal's seq in its process's log. ``account_seqs`` holds the next seq of an owner where a
        # dialect numbers from a counter row (PostgreSQL: its row lock orders the owner's commits).
        """
        CREATE TABLE account_events (
            owner TEXT NOT NULL,
            seq BIGINT NOT NULL,
            pid TEXT NOT NULL,
            pid_seq BIGINT NOT NULL,
            signal TEXT NOT NULL,
            payload TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (owner, seq)
        ) {clustered};
        CREATE TABLE account_seqs (
            owner TEXT PRIMARY KEY,
            next BIGINT NOT NULL
        ) {clustered};
        """,
    ),
    (
        13,
        # The device registry: each device an owner issued a token for or connected, remembered
        # while offline too. ``token_hash`` is the SHA-256 of the one token bound to the device
        # (NULL: none, or revoked); a device token is no account token, so the ``tokens`` table
        # (what user calls authenticate against) never holds it.
        """
        CREATE TABLE devices (
            owner TEXT NOT NULL,
            name TEXT NOT NULL,
            label TEXT NOT NULL,
            description TEXT NOT NULL,
            token_id TEXT,
            token_hash TEXT UNIQUE,
            created_at DOUBLE PRECISION NOT NULL,
            first_seen_at DOUBLE PRECISION,
            last_seen_at DOUBLE PRECISION,
            PRIMARY KEY (owner, name)
        ) {clustered};
        """,
    ),
    (
        14,
        # The approvals audit: one row per decision about a call the policy put to a person (an
        # answer, a timeout, a process that cannot ask) or refused outright, kept by the owner,
        # so a kill or a reset (which drop the process's own log) leaves it. Written in the
        # transaction that carries the decision out. Never the arguments: their digest
        # (``args_digest``, the approval fingerprint) and a short redacted preview. ``id`` is
        # time-ordered (``hil.audit_id``): newest first is ``ORDER BY id DESC``, and an id is a
        # page's cursor.
        """
        CREATE TABLE approval_audit (
            owner TEXT NOT NULL,
            id TEXT NOT NULL,
            pid TEXT NOT NULL,
            run_id TEXT NOT NULL,
            request_id TEXT,
            call_id TEXT NOT NULL,
            tool_name TEXT NOT NULL,
            syscall TEXT NOT NULL,
            args_digest TEXT NOT NULL,
            args_preview TEXT NOT NULL,
            tags TEXT NOT NULL,
            decision TEXT NOT NULL,
            remembered TEXT,
            edited INTEGER NOT NULL,
            answered_by TEXT,
            decided_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (owner, id)
        ) {clustered};
        """,
    ),
]

LATEST_VERSION = MIGRATIONS[-1][0]

# ``approval_audit``'s columns in ``ApprovalAuditRow``'s order
AUDIT_COLUMNS = (
    "id, owner, pid, run_id, request_id, call_id, tool_name, syscall, args_digest, args_preview, tags, decision,"
    " remembered, edited, answered_by, decided_at"
)
AUDIT_WIDTH = AUDIT_COLUMNS.count(",") + 1  # (the parameters an insert of one row takes)


def audit_query(
    mark: Callable[[int], str], owner: str, limit: int, filters: Sequence[tuple[str, str, object]]
) -> tuple[str, list[object]]:
    """``Store.approval_audit``'s SELECT for one dialect, whose ``mark(n)`` is its n-th
    placeholder (``?`` or ``$n``), and its arguments: ``filters`` are (column, operator, value),
    the ones given only, so a filter left out costs no clause."""
    args: list[object] = [owner]
    where = [f"owner = {mark(1)}"]
    for column, op, value in filters:
        args.append(value)
        where.append(f"{column} {op} {mark(len(args))}")
    args.append(limit)
    clauses = " AND ".join(where)
    sql = f"SELECT {AUDIT_COLUMNS} FROM approval_audit WHERE {clauses} ORDER BY id DESC LIMIT {mark(len(args))}"
    return sql, args


def audit_filters(
    pid: str | None, since: float | None, decision: str | None, answered_by: str | None, before: str | None
) -> list[tuple[str, str, object]]:
    """The (column, operator, value) of each ``approval_audit`` filter given."""
    given = (
        ("pid", "=", pid),
        ("decided_at", ">=", None if since is None else float(since)),
        ("decision", "=", decision),
        ("answered_by", "=", answered_by),
        ("id", "<", before),
    )
    return [f for f in given if f[2] is not None]


def statements(sql: str, *, clustered: str = "") -> list[str]:
    """A migration's statements for one dialect: ``clustered`` is what ``{clustered}`` becomes
    (the SQL above has no semicolons or braces inside literals)."""
    return [s.strip() for s in sql.replace("{clustered}", clustered).split(";") if s.strip()]
