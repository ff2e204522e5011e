"""What every store dialect encodes the same way."""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import to_json

from agentloop.process.store.base import AccountRecord, HilRow, ProcessRecord, ToolCallRow, UsageTotals, WatchRow

# a process's usage totals (``UsageTotals``, field by field) as registry and ``account_usage`` columns
USAGE_COLUMNS = ("usage_input", "usage_output", "usage_total_tokens", "usage_cost", "runs")
# ``Store.update_process``'s increment of the usage totals: a ``UsageTotals`` added to the stored
# ones in the UPDATE itself (``col = col + ?``), so writers that do not see each other's totals (a
# run's end, a title's model call in the background) lose nothing of each other's
USAGE_ADDED = "usage_added"
# the registry columns ``Store.update_process`` may set, and the increment
UPDATABLE_FIELDS = frozenset(
    {
        "state",
        "current_run",
        "history_generation",
        "cwd",
        "context",
        "interactive",
        "run_as",
        *USAGE_COLUMNS,
        USAGE_ADDED,
    }
)


def dumps(value: Any) -> str:
    """Compact JSON for a column. pydantic-core's encoder: about five times ``json``'s on the
    small payloads the store writes many of per step (signals, run state, arguments)."""
    return to_json(value).decode()


# Column lists in the order the row decoders below read them (a row is a tuple, a sqlite3.Row or
# an asyncpg.Record: all index by position).
PROCESS_COLUMNS = (
    "pid, owner, run_as, cwd, parent_pid, interactive, context, state, current_run, history_generation,"
    " created_at, updated_at, " + ", ".join(USAGE_COLUMNS)
)
CALL_COLUMNS = (
    "dispatch_id, pid, run_id, position, tool_call_id, tool_name, syscall, args, status, deadline, result, created_at"
)
HIL_COLUMNS = (
    "request_id, pid, run_id, dispatch_id, tool_call_id, tool_name, syscall, args, fingerprint, tags, reason,"
    " created_at"
)
# The pending approvals of one owner's live processes (``Store.account_hils``), {owner} its parameter.
_HIL_COLUMNS_OF_H = ", ".join(f"h.{c.strip()}" for c in HIL_COLUMNS.split(","))
ACCOUNT_HILS = (
    f"SELECT {_HIL_COLUMNS_OF_H} FROM pending_hil h JOIN processes p ON p.pid = h.pid"
    " WHERE p.owner = {owner} AND p.state <> 'killed' ORDER BY h.created_at, h.request_id"
)
# a kv row added only where none is, for a process still in a history generation: ``kv_add``
KV_ADD = (
    "INSERT INTO process_kv (pid, key, value) SELECT CAST({pid} AS TEXT), CAST({key} AS TEXT), CAST({value} AS TEXT)"
    " WHERE EXISTS (SELECT 1 FROM processes WHERE pid = {pid} AND history_generation = {generation})"
    " ON CONFLICT (pid, key) DO NOTHING"
)
# one key's value for each process of an owner (the titles of a process list): ``kv_values``
OWNER_KV = (
    "SELECT k.pid, k.value FROM process_kv k JOIN processes p ON p.pid = k.pid"
    " WHERE p.owner = {owner} AND k.key = {key}"
)
SEGMENT_COLUMNS = (
    "id, pid, generation, kind, from_message_id, to_message_id, archive_path, summary_message_id, created_at"
)
SCHEDULE_COLUMNS = "id, pid, text, next_due, every, name, created_at, cron, tz"
WATCH_COLUMNS = "id, pid, source_pid, signal, once, seen_seq, created_at"
TOKEN_COLUMNS = "id, account, hash, label, created_at, revoked_at"
DEVICE_COLUMNS = "owner, name, label, description, token_id, created_at, first_seen_at, last_seen_at"

# the sources of watches owed a delivery: a wanted signal past ``seen_seq``, logged before $1
LAGGING_WATCHES = (
    "SELECT DISTINCT w.source_pid FROM signal_watches w WHERE EXISTS (SELECT 1 FROM events e"
    " WHERE e.pid = w.source_pid AND e.seq > w.seen_seq AND e.signal = w.signal AND e.created_at < $1)"
    " ORDER BY w.source_pid"
)

_SUMS = ", ".join(f"COALESCE(SUM({c}), 0)" for c in USAGE_COLUMNS)
_USAGE = ", ".join(USAGE_COLUMNS)
# an account's totals ($1): its live processes' and those deleted processes left it
ACCOUNT_USAGE = (
    f"SELECT {_SUMS} FROM (SELECT {_USAGE} FROM processes WHERE owner = $1"
    f" UNION ALL SELECT {_USAGE} FROM account_usage WHERE account = $1) AS u"
)
# before the row of process $1 is deleted: its totals join its owner's (a process that spent
# nothing, in runs or outside them, leaves nothing to add). The WHERE also keeps SQLite's parser
# from reading ON CONFLICT as part of a join.
FOLD_USAGE = (
    f"INSERT INTO account_usage (account, {_USAGE}) SELECT owner, {_USAGE} FROM processes"
    " WHERE pid = $1 AND (runs > 0 OR usage_total_tokens > 0 OR usage_input > 0 OR usage_output > 0"
    " OR usage_cost > 0) ON CONFLICT (account) DO UPDATE SET "
    + ", ".join(f"{c} = account_usage.{c} + excluded.{c}" for c in USAGE_COLUMNS)
)

# every table with rows of one process (``pid``): deleting a process empties them all. Watches
# are also removed where the process is the source, and the registry row goes last.
PROCESS_TABLES = (
    "messages",
    "pending_tool_calls",
    "message_queue",
    "pending_hil",
    "process_kv",
    "events",
    "history_segments",
    "schedules",
    "process_leases",
)


def process_record(row: Any) -> ProcessRecord:
    """A registry row (``PROCESS_COLUMNS``) as a ``ProcessRecord``."""
    (pid, owner, run_as, cwd, parent, interactive, context, state, current, generation, created, updated, *_) = row
    return ProcessRecord(
        pid=pid,
        owner=owner,
        run_as=run_as,
        cwd=cwd,
        parent_pid=parent,
        interactive=bool(interactive),
        context=context,
        state=state,
        current_run=json.loads(current) if current else None,
        history_generation=generation,
        created_at=created,
        updated_at=updated,
        usage=usage_totals(row, 12),
    )


def usage_totals(row: Any, at: int = 0) -> UsageTotals:
    """``USAGE_COLUMNS`` as read from ``row[at:]`` as ``UsageTotals`` (PostgreSQL sums BIGINTs as
    numerics: converted)."""
    return UsageTotals(int(row[at]), int(row[at + 1]), int(row[at + 2]), float(row[at + 3]), int(row[at + 4]))


def usage_columns(totals: UsageTotals) -> dict[str, Any]:
    """``totals`` as the registry columns ``Store.update_process`` sets."""
    values = (totals.input, totals.output, totals.total_tokens, totals.cost, totals.runs)
    return dict(zip(USAGE_COLUMNS, values, strict=True))


def usage_increments(added: Any) -> dict[str, Any]:
    """``update_process``'s ``usage_added`` (a ``UsageTotals``) as column -> amount to add."""
    if not isinstance(added, UsageTotals):
        raise TypeError(f"{USAGE_ADDED} must be UsageTotals, got {type(added).__name__}")
    return usage_columns(added)


def call_row(r: Any) -> ToolCallRow:
    """A ``pending_tool_calls`` row (``CALL_COLUMNS``) as a ``ToolCallRow``."""
    return ToolCallRow(
        dispatch_id=r[0],
        pid=r[1],
        run_id=r[2],
        position=r[3],
        tool_call_id=r[4],
        tool_name=r[5],
        syscall=r[6],
        args=json.loads(r[7]),
        status=r[8],
        deadline=r[9],
        result=json.loads(r[10]) if r[10] else None,
        created_at=r[11],
    )


def hil_row(r: Any) -> HilRow:
    """A ``pending_hil`` row (``HIL_COLUMNS``) as a ``HilRow``."""
    return HilRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], json.loads(r[7]), r[8], json.loads(r[9]), r[10], r[11])


def watch_row(r: Any) -> WatchRow:
    """A ``signal_watches`` row (``WATCH_COLUMNS``) as a ``WatchRow``."""
    return WatchRow(r[0], r[1], r[2], r[3], bool(r[4]), r[5], r[6])


def account_row(r: Any) -> AccountRecord:
    """An ``accounts`` row (name, admin, created_at) as an ``AccountRecord``."""
    return AccountRecord(r[0], bool(r[1]), r[2])
