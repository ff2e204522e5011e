"""Heartbeat: the agent checks in on its own, every so often, as ``HEARTBEAT.md`` asks.

A workspace whose ``HEARTBEAT.md`` has instructions ("look at the inbox, tell me about anything
urgent") gets a check-in every ``every`` seconds (30 minutes by default) within the active hours
(08:00 to 23:00 local time by default). The check-in is a system event to the workspace's main
conversation: of the owner's interactive top-level processes in that directory, the one used
last. The file itself is in every run's prompt already (process/prompt.py); the event says it is
time to follow it, and to answer ``HEARTBEAT_OK`` when nothing needs attention, which clients then
leave unshown (process/heartbeat.py). A file of nothing but headings and blank lines asks for
nothing, and costs no model call.

Each process beats at its own offset within the period, so a server's processes do not all call
their model in the same second. A beat is never queued behind work: a process that is busy when
its beat is due gets it once it is idle, within the same period, or not at all. Beats missed
while the runtime was down are not made up; the next one comes at its time.

Delivery is claimed like a schedule's (kernel/schedules.py): the process's ``heartbeat`` value,
the last period it got a beat for, moves forward in the delivery's transaction, so two timers
(on a shared store, a stalled duty holder and the worker that took over) deliver a period's beat
once. On a shared store only the worker holding the ``heartbeat`` duty runs the timer.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
import math
import time
from collections.abc import Callable

from agentloop.kernel.duty import Duty
from agentloop.process.engine import ProcessEngine
from agentloop.process.heartbeat import (
    HEARTBEAT_FILE,
    REASON,
    RUN_PREFIX,
    HeartbeatSettings,
    has_instructions,
    within,
)
from agentloop.process.store import NoSuchProcess, ProcessRecord, Store
from agentloop.stamps import read_regular
from agentloop.tools.base import ToolError
from agentloop.tools.paths import resolve_path

__all__ = ["Heartbeat", "offset_of"]

log = logging.getLogger("agentloop.kernel.heartbeat")

POLL = 60.0  # how soon a new HEARTBEAT.md, or a busy process gone idle, is noticed
MAX_FILE_BYTES = 64 * 1024  # (the prompt reads it too; this only asks whether it says anything)
KV_KEY = "heartbeat"  # the last period a process got its beat for


def offset_of(pid: str, every: float) -> float:
    """Where in each period the process beats: spread by its id, the same on every worker."""
    fraction = int.from_bytes(hashlib.sha256(pid.encode()).digest()[:8], "big") / 2**64
    return fraction * every


class Heartbeat:
    """The check-ins of one kernel's processes: who gets one, when, and the timer."""

    def __init__(
        self,
        store: Store,
        engine: ProcessEngine,
        settings: HeartbeatSettings,
        *,
        clock: Callable[[], float] = time.time,
        local_time: Callable[[float], datetime.time] = lambda ts: datetime.datetime.fromtimestamp(ts).time(),
        duty: Duty | None = None,
    ) -> None:
        self.store = store
        self.engine = engine
        self.settings = settings
        self.clock = clock
        self.local_time = local_time
        self.duty = duty
        self.retry = 5.0  # seconds before a pass that failed is tried again
        self._beaten: dict[str, int] = {}  # pid -> the last period it got (or missed) its beat for
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="agentloop-heartbeat")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self.duty is not None:
            await self.duty.release()

    async def _run(self) -> None:
        while True:
            try:
                delay = await self._pass()
            except Exception:
                log.exception("heartbeat: a pass failed")
                delay = self.retry
            await asyncio.sleep(delay)

    async def _pass(self) -> float:
        duty = self.duty
        if duty is None:
            return await self.beat_due()
        if not await duty.hold():
            return duty.every
        return min(await self.beat_due(), duty.every)

    async def beat_due(self) -> float:
        """Deliver the beats that are due now; the seconds until the next pass."""
        every = self.settings.every
        now = self.clock()
        soonest = POLL
        for record in await self.targets():
            offset = offset_of(record.pid, every)
            period = math.floor((now - offset) / every)
            began = period * every + offset
            soonest = min(soonest, began + every - now)
            if record.created_at > began - every or self._beaten.get(record.pid, -1) >= period:
                continue  # (a conversation gets its first beat once it is a whole period old)
            if not within(self.settings.hours, self.local_time(began)):
                self._beaten[record.pid] = period
                continue
            if record.current_run is not None:
                continue  # busy: tried again at the next pass, while the period lasts
            await self._beat(record.pid, period)
        return max(soonest, 0.0)

    async def targets(self) -> list[ProcessRecord]:
        """Per owner and working directory whose ``HEARTBEAT.md`` has instructions, the
        interactive top-level process used last."""
        main: dict[tuple[str, str], ProcessRecord] = {}
        for record in await self.store.list_processes(None):
            if record.parent_pid is not None or not record.interactive:
                continue
            place = (record.owner, record.cwd)
            known = main.get(place)
            if known is None or record.updated_at > known.updated_at:
                main[place] = record
        if not main:
            return []
        asking = await asyncio.to_thread(_asking, {cwd for _, cwd in main})
        alive = {record.pid for record in main.values()}
        self._beaten = {pid: period for pid, period in self._beaten.items() if pid in alive}
        return [record for (_, cwd), record in main.items() if cwd in asking]

    async def _beat(self, pid: str, period: int) -> None:
        async def claim() -> bool:
            # inside the delivery's transaction: the period moves on once, and a run that began
            # since the process was listed keeps its conversation to itself
            await self.store.exclusive(f"heartbeat of {pid}")
            last = await self.store.kv_get(pid, KV_KEY)
            record = await self.store.get_process(pid)
            if (isinstance(last, int) and last >= period) or record is None or record.current_run is not None:
                return False
            await self.store.kv_set(pid, KV_KEY, period)
            return True

        try:
            receipt = await self.engine.claimed_event(
                pid, self.settings.text, claim=claim, run_id=f"{RUN_PREFIX}{period}", reason=REASON
            )
        except NoSuchProcess:
            self._beaten.pop(pid, None)
            return
        except Exception:
            log.exception("heartbeat of process %s failed; retrying at the next pass", pid)
            return
        if receipt is not None or await self.store.kv_get(pid, KV_KEY) == period:
            self._beaten[pid] = period


def _asking(cwds: set[str]) -> set[str]:
    """The directories whose ``HEARTBEAT.md`` has instructions (read inside the directory: a
    link out of it does not count)."""
    out = set()
    for cwd in cwds:
        try:
            path = resolve_path(cwd, HEARTBEAT_FILE)
            text = read_regular(path, MAX_FILE_BYTES).decode("utf-8", errors="replace")
        except (OSError, ToolError):
            continue
        if has_instructions(text):
            out.add(cwd)
    return out
