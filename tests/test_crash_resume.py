"""Kill -9 a kernel at many points of a run; a new process must finish it, losing and repeating nothing.

Points covered by the spread of delays: before the first model call, during model streams, between
commits, while tools run, while an approval is pending (the worker approves after restarting).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agentloop.messages import AssistantMessage, ToolResultMessage, UserMessage
from agentloop.process.store import SQLiteStore, open_store
from tests import crash_worker


class _Worker:
    """``crash_worker.py`` run as a new process, killed as one (SIGKILL to its pid): forked from a
    fork server that imported it and the package once for the whole module (``_forkserver``),
    not started afresh. A fresh start is half a second of imports before ``READY``, three per
    test; the worker's life from the kernel's opening on (where the kills land) is the same."""

    def __init__(self, db: Path | str, effects: Path) -> None:
        read_out, write_out = _CTX.Pipe(duplex=False)
        read_err, write_err = _CTX.Pipe(duplex=False)
        self.proc = _CTX.Process(target=crash_worker.forked, args=(str(db), str(effects), write_out, write_err))
        self.proc.start()
        write_out.close()  # the child has its own copies: the reads below end when it does
        write_err.close()
        self.stdout = os.fdopen(os.dup(read_out.fileno()), "r")
        self._err = os.fdopen(os.dup(read_err.fileno()), "r")
        read_out.close()
        read_err.close()
        self.stderr = self._err

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def send_signal(self, sig: int) -> None:
        """As ``Popen.send_signal``: nothing if the worker has ended already."""
        assert self.proc.pid is not None
        if self.proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):  # (ended since)
                os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int | None:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired("crash_worker", timeout)
        self.stdout.close()
        self._err.close()
        return self.proc.exitcode

    def communicate(self, timeout: float) -> tuple[str, str]:
        with ThreadPoolExecutor(2) as pool:  # both pipes at once, or a full one would stall the child
            out, err = pool.submit(self.stdout.read), pool.submit(self._err.read)
            self.proc.join(timeout)
            if self.proc.exitcode is None:
                self.proc.kill()
                self.proc.join(10)
                raise subprocess.TimeoutExpired("crash_worker", timeout)
            result = out.result(10), err.result(10)
        self.stdout.close()
        self._err.close()
        return result


_CTX = multiprocessing.get_context("forkserver")


@pytest.fixture(scope="module", autouse=True)
def _forkserver() -> None:
    """The fork server, with ``crash_worker`` (the package with it) imported before it forks."""
    _CTX.set_forkserver_preload(["tests.crash_worker"])


def _start(db: Path | str, effects: Path) -> _Worker:
    return _Worker(db, effects)


def _kill_after_ready(proc: _Worker, delay: float) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "READY", line + (proc.stderr.read() if proc.stderr else "")
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


async def _check(db: Path | str, effects: Path) -> None:
    store = open_store(db) if isinstance(db, str) else SQLiteStore(db)
    await store.open()
    try:
        [record] = await store.list_processes()
        assert record.current_run is None and await store.calls(record.pid) == [] and await store.hils(record.pid) == []
        msgs = [m.message for m in await store.history(record.pid)]
    finally:
        await store.close()
    assert isinstance(msgs[0], UserMessage) and msgs[0].text == "start"
    assert sum(isinstance(m, UserMessage) for m in msgs) == 1  # admitted once
    rounds = [m for m in msgs if isinstance(m, AssistantMessage) and m.tool_calls]
    assert [m.text for m in rounds] == ["round 0", "round 1", "round 2"]  # no round lost or repeated
    for i, msg in enumerate(msgs):
        if isinstance(msg, AssistantMessage) and msg.tool_calls:
            results = msgs[i + 1 : i + 1 + len(msg.tool_calls)]
            assert [r.tool_call_id for r in results if isinstance(r, ToolResultMessage)] == [
                c.id for c in msg.tool_calls
            ]
    assert isinstance(msgs[-1], AssistantMessage) and msgs[-1].text == "finished after all rounds"
    lines = effects.read_text().split() if effects.exists() else []
    assert len(lines) == len(set(lines)), f"a non-idempotent tool ran twice: {lines}"
    interrupted = [m for m in msgs if isinstance(m, ToolResultMessage) and m.tool_name == "append_line" and m.is_error]
    for r in interrupted:  # a call cut short by the crash is reported, not silently redone
        assert "interrupted by a restart" in r.text


async def _finished(db: str) -> bool:
    """Whether the conversation on ``db`` has come to its end."""
    store = open_store(db)
    await store.open()
    try:
        procs = await store.list_processes()
        history = await store.history(procs[0].pid) if procs else []
    finally:
        await store.close()
    return bool(history) and history[-1].message.text == "finished after all rounds"


DELAYS = [round(0.025 * i, 3) for i in range(16)]  # 0 to 0.375 s: the whole run, phase by phase


@pytest.mark.timeout(240)
@pytest.mark.parametrize("delay", DELAYS)
async def test_kill_at_any_point_then_resume(tmp_path: Path, delay: float) -> None:
    db, effects = tmp_path / "crash.db", tmp_path / "effects.txt"
    _kill_after_ready(_start(db, effects), delay)
    _kill_after_ready(_start(db, effects), delay / 2)  # and once more, during the recovery itself
    final = _start(db, effects)
    out, err = final.communicate(timeout=60)
    assert final.returncode == 0 and "DONE" in out, err[-2000:]
    await _check(db, effects)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0.05, 0.15, 0.3])  # (all of DELAYS pass too; three keep it quick)
async def test_kill_at_any_point_then_resume_on_postgres(pg_url: str, tmp_path: Path, delay: float) -> None:
    # The same worker and checks on a PostgreSQL database: a client killed mid-transaction leaves
    # its connection to the server, which rolls the open transaction back when the socket closes.
    effects = tmp_path / "effects.txt"
    _kill_after_ready(_start(pg_url, effects), delay)
    assert not await _finished(pg_url), "the first worker was meant to die mid-run"
    _kill_after_ready(_start(pg_url, effects), delay / 2)
    final = _start(pg_url, effects)
    out, err = final.communicate(timeout=60)
    assert final.returncode == 0 and "DONE" in out, err[-2000:]
    await _check(pg_url, effects)
