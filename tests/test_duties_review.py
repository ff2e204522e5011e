"""Review of the kernel's background duties (schedules, watches, subagents): each test failed
before its fix."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.kernel.schedules import ScheduleError, next_due_after
from agentloop.kernel.watches import MAX_WAITING, WatchError
from agentloop.messages import SystemMessage, UserMessage
from agentloop.models.base import ModelRequest
from tests.process_support import kernel


async def system_texts(proc: Any) -> list[str]:
    return [m.text for m in await proc.messages() if isinstance(m, SystemMessage)]


def slow_then_echo(seconds: float) -> ScriptedModel:
    """ "work" makes the model call ``slow`` (the run is busy that long); else it echoes."""

    def brain(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if isinstance(last, UserMessage) and last.text == "work":
            return Reply(tool_calls=[call("slow", seconds=seconds)])
        return f"re: {last.text}"

    return ScriptedModel(brain)


async def test_a_repeating_schedule_does_not_pile_up_while_its_process_is_busy(tmp_path):
    """A run busy for a long while (a slow tool, an approval nobody answers overnight): a
    repeating schedule's fires queue behind it, and were each kept, the run's next model call
    would be handed the same reminder once per fire (hundreds of copies of a 64 kB text). One
    waiting delivery stands for the fires after it, as fires missed while the runtime was down do."""
    async with kernel(tmp_path, slow_then_echo(2.5), schedule_min_every=0.1) as k:
        proc = await k.spawn(owner="a")
        await proc.send("work")
        await asyncio.sleep(0.1)
        await k.schedule(proc.pid, "check the build", every=0.1)
        await asyncio.sleep(1.0)  # ~10 fires while the tool runs
        queued = [q for q in await k.store.queue(proc.pid) if q.kind == "system"]
        assert len(queued) == 1
        await proc.wait_idle()
        assert 1 <= sum("check the build" in t for t in await system_texts(proc)) <= 3
        [row] = await k.schedules(proc.pid)
        assert row.next_due > time.time() - 0.2  # it kept moving on meanwhile


async def test_an_interval_too_short_to_move_the_clock_is_refused(tmp_path):
    """With no minimum interval configured (``schedule_min_every=0``), ``every=1e-9`` was taken:
    added to an epoch time it changes nothing, and the timer's search for the next due time after
    a fire looped for ever with the event loop blocked (the whole kernel froze)."""
    async with kernel(tmp_path, ScriptedModel(lambda r: "ok"), schedule_min_every=0) as k:
        await k.scheduler.stop()  # (were it taken, the timer would freeze the test)
        proc = await k.spawn(owner="a")
        with pytest.raises(ScheduleError, match="every must be at least"):
            await k.schedule(proc.pid, "spin", every=1e-9)
        assert await k.schedules(proc.pid) == []
    assert next_due_after(1.7e9, 1e-9, 1.7e9) > 1.7e9  # and the search itself always ends


@pytest.mark.parametrize("minimum", [float("nan"), -1.0, float("inf")])
async def test_a_bad_minimum_interval_is_refused_at_open(tmp_path, minimum):
    """A NaN minimum let every interval through (``every < nan`` is never true)."""
    with pytest.raises(ValueError, match="schedule_min_every"):
        async with kernel(tmp_path, ScriptedModel(lambda r: "ok"), schedule_min_every=minimum):
            pass


def busy_or_burst(calls: int) -> ScriptedModel:
    """ "work" calls ``slow`` for 3 s (the watcher is busy); "burst" makes ``calls`` echo calls in
    one turn (the source logs as many ``proc.run.tool.finished``); else it echoes."""

    def brain(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if isinstance(last, UserMessage) and last.text == "work":
            return Reply(tool_calls=[call("slow", seconds=3.0)])
        if isinstance(last, UserMessage) and last.text == "burst":
            return Reply(tool_calls=[call("echo", text=str(n)) for n in range(calls)])
        return f"re: {last.text}"

    return ScriptedModel(brain)


async def test_a_storm_of_watched_signals_is_bounded_while_the_watcher_is_busy(tmp_path):
    """A repeating watch on a busy source (every tool call of a long turn) while its watcher's run
    waits (a slow tool, an approval nobody answers): one queued event per signal, without end, all
    handed to the watcher's next model call at once. At most ``MAX_WAITING`` wait per watch; the
    rest are counted, and the next delivery says how many were left out."""
    async with kernel(tmp_path, busy_or_burst(40)) as k:
        source, watcher = await k.spawn(owner="a"), await k.spawn(owner="a")
        wid = await k.watch(watcher.pid, source.pid, "proc.run.tool.finished", once=False)
        await watcher.send("work")
        await asyncio.sleep(0.1)
        await source.send("burst")
        await source.wait_idle()
        await asyncio.sleep(0.3)
        waiting = [q for q in await k.store.queue(watcher.pid) if (q.run_id or "").startswith(f"watch:{wid}:")]
        assert len(waiting) == MAX_WAITING
        await watcher.wait_idle()
        await source.send("burst")  # the watcher reads its events: deliveries go on, with the count
        await source.wait_idle()
        await asyncio.sleep(0.3)
        await watcher.wait_idle()
        texts = [t for t in await system_texts(watcher) if f"[signal watch {wid}]" in t]
        assert len(texts) > MAX_WAITING
        assert f"{40 - MAX_WAITING} earlier signals of this watch were left out" in texts[MAX_WAITING]


async def test_a_watch_with_arguments_of_the_wrong_type_is_refused_clearly(tmp_path):
    """A library caller's ``signal=["proc.run.finished"]`` raised "unhashable type: 'list'" from
    the membership test, and ``once="false"`` (a string: true) reached the insert, which failed
    on ``int("false")`` with a ValueError about an integer literal."""
    async with kernel(tmp_path, ScriptedModel(lambda r: "ok")) as k:
        a, b = await k.spawn(owner="a"), await k.spawn(owner="a")
        with pytest.raises(WatchError, match="signal must be one of"):
            await k.watch(a.pid, b.pid, ["proc.run.finished"])  # type: ignore[arg-type]
        with pytest.raises(WatchError, match="once must be true or false"):
            await k.watch(a.pid, b.pid, once="false")  # type: ignore[arg-type]
        assert await k.watches(a.pid) == []
