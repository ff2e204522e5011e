"""Another program holding SQLite's write lock: the runtime waits for it without stopping its event
loop (streams, timers and model calls go on), then carries on; past ``BUSY_WAIT`` the step fails
with a clear ``StoreError`` and nothing is half written."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from agentloop import ScriptedModel
from agentloop.messages import AssistantMessage
from agentloop.process.store import sqlite as sqlite_store
from agentloop.process.store.base import StoreError
from tests.process_support import kernel


def _hold_write_lock(path: Path) -> sqlite3.Connection:
    """A second connection (as an admin command or a backup would be) that takes the write lock."""
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    return other


async def _ticks_while(work: asyncio.Task[object], every: float = 0.01) -> tuple[int, float]:
    """How many times a timer fired while ``work`` ran, and the longest gap between two firings."""
    ticks, longest, last = 0, 0.0, time.monotonic()
    while not work.done():
        await asyncio.sleep(every)
        now = time.monotonic()
        ticks, longest, last = ticks + 1, max(longest, now - last), now
    return ticks, longest


async def test_a_step_waits_for_another_programs_write_lock_without_blocking_the_loop(tmp_path: Path) -> None:
    async with kernel(tmp_path, ScriptedModel(lambda request: "hello")) as k:
        other = _hold_write_lock(tmp_path / "agentloop.db")
        spawning = asyncio.create_task(k.spawn(owner="alice", text="hi"))
        asyncio.get_running_loop().call_later(0.5, other.execute, "COMMIT")
        ticks, longest = await _ticks_while(spawning)
        proc = await spawning
        await asyncio.wait_for(proc.wait_idle(), 5)
        last = (await proc.history())[-1].message
        other.close()
    assert isinstance(last, AssistantMessage) and last.text == "hello"
    assert ticks >= 20, "the event loop stood still while the lock was held"
    assert longest < 0.2, f"the loop was blocked for {longest:.3f} s at a time"


async def test_a_lock_held_past_the_wait_fails_the_step_clearly_and_keeps_nothing_half_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_store, "BUSY_WAIT", 0.3)
    async with kernel(tmp_path, ScriptedModel(lambda request: "hello")) as k:
        other = _hold_write_lock(tmp_path / "agentloop.db")
        started = time.monotonic()
        with pytest.raises(StoreError, match="is busy"):
            await k.spawn(owner="alice", text="hi")
        waited = time.monotonic() - started
        other.execute("COMMIT")
        other.close()
        assert await k.processes(owner="alice") == []
        proc = await k.spawn(owner="alice", text="again")  # the store works on once the lock is free
        await asyncio.wait_for(proc.wait_idle(), 5)
    assert 0.25 <= waited < 2.0
