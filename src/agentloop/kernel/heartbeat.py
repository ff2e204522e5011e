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

A beat is for the active hours: one whose period began outside them, or that would come (late,
after a busy run) once they are over, is passed over.

Delivery is claimed like a schedule's (kernel/schedules.py): the process's ``heartbeat`` value,
when the period it last got a beat for began (a time, not a period's number, which depends on
``every``: a changed setting neither stops the beats nor repeats one), moves forward in the
delivery's transaction, so two timers (on a shared store, a stalled duty holder and the worker
that took over) deliver a period's beat once. On a shared store only the worker holding the
``heartbeat`` duty runs the timer.

Which workspaces ask is judged as the prompt reads ``HEARTBEAT.md`` (UTF-8 text of at most
4 MiB, inside the directory): a beat says the instructions are in the context, so a file the
prompt leaves out gets none. A directory's answer is kept for ``POLL`` seconds, and passes are
at least ``MIN_GAP`` apart: with thousands of processes a pass per process's beat, each reading
every file and listing every process, would cost the square of their number.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable

from agentloop.kernel.duty import Duty, DutyTimer
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
from agentloop.tools.base import ToolError
from agentloop.tools.paths import resolve_path
from agentloop.tools.skills import UnreadableFile, read_text_file

__all__ = ["Heartbeat", "offset_of"]

log = logging.getLogger("agentloop.kernel.heartbeat")

POLL = 60.0  # how soon a new HEARTBEAT.md, or a busy process gone idle, is noticed
MIN_GAP = 5.0  # between passes: beats due meanwhile come together, at most this much late
KV_KEY = "heartbeat"  # when the period a process last got its beat for began (seconds since the epoch)


def offset_of(pid: str, every: float) -> float:
    """Where in each period the process beats: spread by its id, the same on every worker."""
    fraction = int.from_bytes(hashlib.sha256(pid.encode()).digest()[:8], "big") / 2**64
    return fraction * every


class Heartbeat(DutyTimer):
    """The check-ins of one kernel's processes: who gets one, when, and the timer."""

    name = "heartbeat"

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
        super().__init__(duty)
        self.store = store
        self.engine = engine
        self.settings = settings
        self.clock = clock
        self.local_time = local_time
        self._beaten: dict[str, int] = {}  # pid -> the last period it got (or missed) its beat for
        self._asks: dict[str, tuple[float, bool]] = {}  # cwd -> (when looked at, whether it asks)
        # why an account may start nothing new now (``budget.gate_timers``): the period's beat of
        # its processes is skipped
        self.spending: Callable[[str], Awaitable[str | None]] | None = None

    async def work(self) -> float:
        return await self.beat_due()

    async def beat_due(self) -> float:
        """Deliver the beats that are due now; the seconds until the next pass."""
        every, hours = self.settings.every, self.settings.hours
        now = self.clock()
        soonest = POLL
        in_hours_now = within(hours, self.local_time(now))
        for record in await self.targets(now):
            offset = offset_of(record.pid, every)
            period = math.floor((now - offset) / every)
            began = period * every + offset
            soonest = min(soonest, began + every - now)
            if record.created_at > began - every or self._beaten.get(record.pid, -1) >= period:
                continue  # (a conversation gets its first beat once it is a whole period old)
            if not (in_hours_now and within(hours, self.local_time(began))):
                self._beaten[record.pid] = period
                continue
            if record.current_run is not None or record.pid in self.engine.clearing:
                # busy, or being reset (waiting for that would hold up the beats of the processes
                # after it): tried again at the next pass, while the period lasts
                continue
            if self.spending is not None and await self.spending(record.owner) is not None:
                self._beaten[record.pid] = period  # (a check-in nobody asked for: this period's is skipped)
                continue
            await self._beat(record.pid, period, began)
        return max(soonest, MIN_GAP)

    async def targets(self, now: float | None = None) -> list[ProcessRecord]:
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
        alive = {record.pid for record in main.values()}
        self._beaten = {pid: period for pid, period in self._beaten.items() if pid in alive}
        asking = await self._asking({cwd for _, cwd in main}, self.clock() if now is None else now)
        return [record for (_, cwd), record in main.items() if cwd in asking]

    async def _asking(self, cwds: set[str], now: float) -> set[str]:
        """Those of ``cwds`` whose ``HEARTBEAT.md`` has instructions, each file read at most once
        per ``POLL`` seconds."""
        known = self._asks
        stale = {cwd for cwd in cwds if cwd not in known or not 0 <= now - known[cwd][0] < POLL}
        if stale:
            asking = await asyncio.to_thread(_asking, stale)
            known.update((cwd, (now, cwd in asking)) for cwd in stale)
        self._asks = {cwd: known[cwd] for cwd in cwds}
        return {cwd for cwd in cwds if known[cwd][1]}

    async def _beat(self, pid: str, period: int, began: float) -> None:
        async def claim() -> bool:
            # inside the delivery's transaction: the period moves on once, and a run that began
            # since the process was listed keeps its conversation to itself
            await self.store.exclusive(f"heartbeat of {pid}")
            last = await self.store.kv_get(pid, KV_KEY)
            record = await self.store.get_process(pid)
            given = isinstance(last, int | float) and not isinstance(last, bool) and last >= began
            if given or record is None or record.current_run is not None:
                return False
            await self.store.kv_set(pid, KV_KEY, began)
            return True

        try:
            receipt = await self.engine.claimed_event(
                pid, self.settings.text, claim=claim, run_id=f"{RUN_PREFIX}{int(began)}", reason=REASON
            )
        except NoSuchProcess:
            self._beaten.pop(pid, None)
            return
        except Exception:
            log.exception("heartbeat of process %s failed; retrying at the next pass", pid)
            return
        if receipt is not None or await self.store.kv_get(pid, KV_KEY) == began:
            self._beaten[pid] = period


def _asking(cwds: set[str]) -> set[str]:
    """The directories whose ``HEARTBEAT.md`` has instructions, read as the prompt reads it
    (process/prompt.py): inside the directory (a link out of it does not count), UTF-8 text of
    at most 4 MiB; a file the prompt leaves out asks for nothing."""
    out = set()
    for cwd in cwds:
        try:
            text = read_text_file(resolve_path(cwd, HEARTBEAT_FILE))
        except (OSError, ToolError, UnreadableFile):
            continue
        if has_instructions(text):
            out.add(cwd)
    return out
