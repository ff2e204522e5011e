"""The durable schema, one list of versioned migrations shared by every store dialect.

Each migration is plain SQL that SQLite and PostgreSQL both accept (no AUTOINCREMENT, no
dialect types): ids that need an order are assigned by the store from a per-process counter,
not by the database. A store applies, in one transaction each, the migrations above the version
it finds in ``schema_version``; a database newer than the code is refused.
"""

from __future__ import annotations

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
]

LATEST_VERSION = MIGRATIONS[-1][0]


def statements(sql: str) -> list[str]:
    """Split a migration into statements (the SQL above has no semicolons inside literals)."""
    return [s.strip() for s in sql.split(";") if s.strip()]
