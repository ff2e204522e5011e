"""How much of a durable W1 run is SQLite itself: the floor no Python tuning can go below.

One W1 run of the durable runner is recorded statement by statement (SQL and parameters), then
replayed many times with the bare ``sqlite3`` module on a fresh database of the same schema and
settings, each replay under a new process id, so nothing but SQLite is timed. Beside it, in the same
run and alternating with it, the harness's ``baseline-sqlite`` pattern: one INSERT + COMMIT per
message, five messages. The ratio of the two medians is what the store's schema alone costs
against that baseline; the durable runner's own figure (``bench_ours_sqlite.py``) adds Python.

A third pattern, also alternated with the two, is the floor of the redesign the W1 target needs: an
append-only journal (one row per step, the step's message and signals together) beside a process
row, four commits a run as today. It tells how much of the 1.5x budget such a schema would leave
to Python.

    .venv/bin/python bench/bench_store_floor.py [replays]
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from agentloop import Kernel, tool
from agentloop.messages import ToolResultMessage
from agentloop.models.base import ModelRequest
from agentloop.models.scripted import Reply, ScriptedModel, call

Statement = tuple[str, Any, bool]  # sql, parameters, executemany
OWNER = "floor-owner-recorded"  # the recorded runs' owner, swapped for another in each replay


class _Recorder(sqlite3.Connection):
    """A connection that keeps what it executes while ``recording`` is set."""

    recording: list[Statement] | None = None

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        if _Recorder.recording is not None:
            _Recorder.recording.append((sql, parameters, False))
        return super().execute(sql, parameters)

    def executemany(self, sql: str, parameters: Any, /) -> sqlite3.Cursor:
        rows = list(parameters)
        if _Recorder.recording is not None:
            _Recorder.recording.append((sql, rows, True))
        return super().executemany(sql, rows)


def echo(text: str) -> str:
    """Say it back."""
    return text


def _brain(request: ModelRequest) -> Reply | str:
    """W1: one tool call, then the answer."""
    if isinstance(request.messages[-1], ToolResultMessage):
        return "done"
    return Reply(tool_calls=[call("echo", text="hi")])


async def _record(folder: str) -> tuple[list[Statement], str]:
    """The statements of one W1 run (a spawn with a first message, one tool call, the answer),
    taken after a few warm-up runs, and the pid they were made for."""
    connect = sqlite3.connect
    sqlite3.connect = lambda *a, **k: connect(*a, **{**k, "factory": _Recorder})  # type: ignore[assignment,misc]
    try:
        async with AsyncExitStack() as stack:
            kernel = await stack.enter_async_context(
                Kernel.open(
                    f"sqlite:///{folder}/agentloop.db",
                    model=ScriptedModel(_brain, keep_requests=False),
                    tools=[tool(echo)],
                    workspace=folder,
                )
            )
            for _ in range(4):
                recorded: list[Statement] = []
                _Recorder.recording = recorded
                proc = await kernel.spawn(owner=OWNER, text="hi")
                await proc.wait_idle()
                _Recorder.recording = None
            return recorded, proc.pid
    finally:
        sqlite3.connect = connect  # type: ignore[assignment]


def _swap(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, (list, tuple)):
        return type(value)(_swap(v, old, new) for v in value)
    if isinstance(value, dict):
        return {k: _swap(v, old, new) for k, v in value.items()}
    return value


def _journal_step(statements: list[Statement]) -> str:
    """A journal row's body as big as an average step of the recorded run: its messages and
    signals, written as one text."""
    texts = [p for _, params, many in statements for row in (params if many else [params]) for p in row]
    payload = sum(len(p) for p in texts if isinstance(p, str) and p.startswith("{"))
    return "x" * (payload // 4)


def _journal_run(db: sqlite3.Connection, pid: str, step: str) -> None:
    """A W1 run on the journal schema: the process and its first step, then three steps, each
    commit one journal row and (after the first) the process row's new state."""
    db.execute("BEGIN IMMEDIATE")
    db.execute("INSERT INTO j_procs VALUES (?, 'running', ?, 2, ?)", (pid, step[:200], time.time()))
    db.execute("INSERT INTO j_steps VALUES (?, 1, ?, ?)", (pid, step, time.time()))
    db.execute("COMMIT")
    for seq in (2, 3, 4):
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT INTO j_steps VALUES (?, ?, ?, ?)", (pid, seq, step, time.time()))
        state = "idle" if seq == 4 else "running"
        db.execute(
            "UPDATE j_procs SET state = ?, run = ?, next_seq = ?, at = ? WHERE pid = ?",
            (state, step[:200], seq + 1, time.time(), pid),
        )
        db.execute("COMMIT")


def main() -> None:
    replays = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    folder = tempfile.mkdtemp(prefix="bench-floor-")
    try:
        statements, pid = asyncio.run(_record(folder))
        replay_path = Path(folder) / "replay.db"
        shutil.copy(Path(folder) / "agentloop.db", replay_path)
        db = sqlite3.connect(replay_path, isolation_level=None)
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON"):
            db.execute(f"PRAGMA {pragma}")
        db.execute("CREATE TABLE baseline (session INTEGER, seq INTEGER, body TEXT, PRIMARY KEY (session, seq))")
        db.execute("CREATE TABLE j_procs (pid TEXT PRIMARY KEY, state TEXT, run TEXT, next_seq INTEGER, at REAL)")
        db.execute(
            "CREATE TABLE j_steps (pid TEXT, seq INTEGER, body TEXT, at REAL, PRIMARY KEY (pid, seq)) WITHOUT ROWID"
        )
        body = json.dumps({"role": "assistant", "content": "done"})
        step = _journal_step(statements)
        # every replay's statements are prepared up front: only their execution is timed
        # (each replay as another process of another owner: pids and account seqs are unique keys)
        runs = [[_swap(_swap(s, pid, f"r{i:018d}"), OWNER, f"o{i:018d}") for s in statements] for i in range(replays)]
        ours: list[float] = []
        baseline: list[float] = []
        journal: list[float] = []
        for i, run in enumerate(runs):
            start = time.perf_counter()
            for sql, params, many in run:
                (db.executemany if many else db.execute)(sql, params).fetchall()
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            for seq in range(5):
                db.execute("BEGIN")
                db.execute("INSERT INTO baseline VALUES (?, ?, ?)", (i, seq, body))
                db.execute("COMMIT")
            baseline.append(time.perf_counter() - start)
            start = time.perf_counter()
            _journal_run(db, f"j{i:018d}", step)
            journal.append(time.perf_counter() - start)
        db.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    writes = [(params, many) for sql, params, many in statements if sql.split()[0] in {"INSERT", "UPDATE", "DELETE"}]
    commits = sum(1 for sql, _, _ in statements if sql == "COMMIT")
    ours_us = statistics.median(ours) * 1e6
    base_us = statistics.median(baseline) * 1e6
    journal_us = statistics.median(journal) * 1e6
    print(
        json.dumps(
            {
                "figure": "W1 store floor (SQLite only, no Python around it)",
                "replays": replays,
                "statements": len(statements),
                "write_statements": len(writes),
                "rows_written": sum(len(params) if many else 1 for params, many in writes),
                "commits": commits,
                "ours_sql_p50_us": round(ours_us, 1),
                "baseline_sqlite_sql_p50_us": round(base_us, 1),
                "ratio": round(ours_us / base_us, 2),
                "journal_sql_p50_us": round(journal_us, 1),
                "journal_ratio": round(journal_us / base_us, 2),
                "loadavg_1m": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
