"""Review of the heartbeat check-ins: edge cases of the timer, the settings and HEARTBEAT.md."""

from __future__ import annotations

import asyncio
import datetime
import os
import time
from pathlib import Path
from typing import Any

import pytest

from agentloop import ScriptedModel
from agentloop.kernel import heartbeat as kernel_heartbeat
from agentloop.kernel.heartbeat import KV_KEY, Heartbeat, offset_of
from agentloop.process.heartbeat import HeartbeatSettings, has_instructions, parse_hours
from agentloop.process.prompt import PromptSources, assemble_prompt
from tests.process_support import kernel
from tests.test_heartbeat import ASKING, EVERY, beats, check_ins, settings


def early_in_a_period(pid: str, every: float, periods: float = 3) -> float:
    """A second into the process's period ``periods`` from now: a test's later passes of "the
    same period" must not cross into the next one."""
    t = time.time() + periods * every
    return t - (t - offset_of(pid, every)) % every + 1


def in_prompt(workspace: Path) -> bool:
    """Whether a run's prompt shows the workspace's HEARTBEAT.md (the beat says it does)."""
    assembled = assemble_prompt(PromptSources(workspace=workspace, main_process=True))
    return any(p.name == "HEARTBEAT.md" for s in assembled.sections for p in s.sources)


# ------------------------------------------------------------------ settings


def test_hours_must_be_a_pair():
    for hours in ((), (datetime.time(8),), (datetime.time(8), datetime.time(9), datetime.time(10))):
        with pytest.raises(ValueError, match="pair"):
            HeartbeatSettings(hours=hours)  # type: ignore[arg-type]


def test_an_int_too_large_for_a_float_is_a_value_error():
    with pytest.raises(ValueError, match="every"):
        HeartbeatSettings(every=10**400)


# ------------------------------------------------------------------ what HEARTBEAT.md says


def test_a_template_saved_with_a_byte_order_mark_asks_for_nothing():
    assert not has_instructions("\ufeff# Heartbeat\n\n- \n")
    assert has_instructions("\ufeff- check the build\n")


@pytest.mark.parametrize(
    "content",
    [
        b"- check the build\x00\x01\x02\n",  # binary
        "- prüfe den Posteingang\n".encode("latin-1"),  # not UTF-8
    ],
)
async def test_no_beat_for_a_file_the_prompt_does_not_show(tmp_path, content):
    (tmp_path / "HEARTBEAT.md").write_bytes(content)
    assert not in_prompt(tmp_path)
    assert await check_ins(tmp_path) == 0


async def test_a_long_heartbeat_file_the_prompt_shows_gets_its_beats(tmp_path):
    (tmp_path / "HEARTBEAT.md").write_text(ASKING + "\n".join(f"- item {i}: look at it" for i in range(5000)))
    assert (tmp_path / "HEARTBEAT.md").stat().st_size > 64 * 1024
    assert in_prompt(tmp_path)
    assert await check_ins(tmp_path) == 1


async def test_a_fifo_for_a_heartbeat_file_neither_hangs_nor_beats(tmp_path):
    os.mkfifo(tmp_path / "HEARTBEAT.md")
    async with kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK"), heartbeat=settings()) as k:
        await k.heartbeat.stop()
        proc = await k.spawn(owner="a")
        k.heartbeat.clock = lambda: time.time() + 3 * EVERY
        async with asyncio.timeout(2):
            await k.heartbeat.beat_due()
        assert await beats(proc) == 0


# ------------------------------------------------------------------ when


async def test_a_beat_that_came_late_is_not_delivered_after_the_active_hours(tmp_path):
    """The period began at 22:59, inside 08:00-23:00; the process was busy until 23:30."""
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    async with kernel(
        tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK"), heartbeat=settings(hours=parse_hours("08:00-23:00"))
    ) as k:
        await k.heartbeat.stop()
        proc = await k.spawn(owner="a")
        now = time.time() + 3 * EVERY
        began = now - (now - offset_of(proc.pid, EVERY)) % EVERY
        late = began + EVERY / 2
        k.heartbeat.clock = lambda: late
        k.heartbeat.local_time = lambda ts: datetime.time(22, 59) if ts < late else datetime.time(23, 30)
        await k.heartbeat.beat_due()
        await proc.wait_idle()
        assert await beats(proc) == 0


async def test_a_longer_period_in_the_settings_does_not_stop_the_beats(tmp_path):
    """The config file's ``every`` went from 60 s to 120 s between two runs of the runtime."""
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    now = time.time() + 3 * EVERY
    async with kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK"), heartbeat=settings()) as k:
        await k.heartbeat.stop()
        proc = await k.spawn(owner="a")
        k.heartbeat.clock = lambda: now
        await k.heartbeat.beat_due()
        await proc.wait_idle()
        assert await beats(proc) == 1
    async with kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK"), heartbeat=settings(every=2 * EVERY)) as k:
        await k.heartbeat.stop()
        later = early_in_a_period(proc.pid, 2 * EVERY, periods=5)
        k.heartbeat.clock = lambda: later
        await k.heartbeat.beat_due()
        proc = await k.process(proc.pid)
        await proc.wait_idle()
        assert await beats(proc) == 2
        k.heartbeat.clock = lambda: later + 1  # the same (longer) period: once
        await k.heartbeat.beat_due()
        fresh = Heartbeat(k.store, k.engine, settings(every=2 * EVERY), clock=lambda: later + 2)
        await fresh.beat_due()
        await proc.wait_idle()
        assert await beats(proc) == 2
        assert await k.store.kv_get(proc.pid, KV_KEY) is not None


# ------------------------------------------------------------------ reset and kill


async def test_a_reset_in_the_period_of_a_beat_does_not_bring_another(tmp_path):
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    async with kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK"), heartbeat=settings()) as k:
        await k.heartbeat.stop()
        proc = await k.spawn(owner="a")
        now = early_in_a_period(proc.pid, EVERY)
        k.heartbeat.clock = lambda: now
        await k.heartbeat.beat_due()
        await proc.wait_idle()
        await proc.reset()
        assert await beats(proc) == 0
        fresh = Heartbeat(k.store, k.engine, settings(), clock=lambda: now + 1)  # (no cache: the store says)
        await fresh.beat_due()
        await proc.wait_idle()
        assert await beats(proc) == 0
        fresh.clock = lambda: now + EVERY
        await fresh.beat_due()
        await proc.wait_idle()
        assert await beats(proc) == 1


async def test_when_the_main_conversation_is_killed_the_one_used_before_gets_the_beats(tmp_path):
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    async with kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK"), heartbeat=settings()) as k:
        await k.heartbeat.stop()
        old = await k.spawn(owner="a")
        main = await k.spawn(owner="a")
        await main.kill()
        k.heartbeat.clock = lambda: time.time() + 3 * EVERY
        await k.heartbeat.beat_due()
        await old.wait_idle()
        assert await beats(old) == 1


async def test_a_reset_under_way_keeps_no_other_process_waiting_for_its_beat(tmp_path):
    """The schedules' timer comes back to a process being cleared (``when_cleared``); the beats'
    waited for the clearing, with every process after it in the pass."""
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    async with kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK"), heartbeat=settings()) as k:
        await k.heartbeat.stop()
        clearing = await k.spawn(owner="a")
        other = await k.spawn(owner="b")
        now = time.time() + 3 * EVERY
        k.heartbeat.clock = lambda: now
        async with k.engine.clear(clearing.pid):
            async with asyncio.timeout(1):
                await k.heartbeat.beat_due()
            await other.wait_idle()
            assert await beats(other) == 1
            assert await beats(clearing) == 0
        await k.heartbeat.beat_due()  # a later pass of the same period, once the clearing is over
        await clearing.wait_idle()
        assert await beats(clearing) == 1


# ------------------------------------------------------------------ cost


async def test_passes_within_a_poll_read_each_heartbeat_file_once(tmp_path, monkeypatch):
    reads: list[str] = []
    original = kernel_heartbeat.read_text_file

    def counted(path: Any) -> str:
        reads.append(str(path))
        return original(path)

    monkeypatch.setattr(kernel_heartbeat, "read_text_file", counted)
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    async with kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK"), heartbeat=settings(every=1800)) as k:
        await k.heartbeat.stop()
        for owner in "abc":
            await k.spawn(owner=owner)
        reads.clear()
        now = time.time() + 3 * 1800
        for step in range(10):  # ten passes within one minute
            k.heartbeat.clock = lambda step=step: now + step
            await k.heartbeat.beat_due()
        assert len(reads) == 1
        k.heartbeat.clock = lambda: now + kernel_heartbeat.POLL + 1  # a new HEARTBEAT.md is seen within POLL
        await k.heartbeat.beat_due()
        assert len(reads) == 2


async def test_many_targets_do_not_make_a_pass_each(tmp_path, monkeypatch):
    """Each pass lists every process: with a target per offset, waking for each one's beat makes
    the passes of a period grow with the processes (and the cost of a period with their square)."""
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    async with kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK"), heartbeat=settings()) as k:
        await k.heartbeat.stop()
        for i in range(300):
            await k.spawn(owner=f"u{i}")

        async def no_beat(pid: str, period: int, began: float = 0.0) -> None:
            return None

        monkeypatch.setattr(k.heartbeat, "_beat", no_beat)
        now = start = time.time() + 3 * EVERY
        passes = 0
        while now < start + EVERY:
            k.heartbeat.clock = lambda now=now: now
            now += max(await k.heartbeat.beat_due(), 1e-3)
            passes += 1
        assert passes <= EVERY / kernel_heartbeat.MIN_GAP + 1, passes
