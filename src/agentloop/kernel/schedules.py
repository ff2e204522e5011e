"""Schedules: system events a process receives at a time, once, every so many seconds, or on a
calendar (a cron expression read in an IANA time zone, so "weekdays at 9" stays at 9 across DST).

A schedule is a row (``schedules`` table), so it survives restarts. One timer task per kernel
fires what is due: it delivers the schedule's text as a system event (``proc.run.started`` reason
``schedule.event`` when it starts a run) and then deletes a one-shot schedule or moves a repeating
one to its next due time after now. Fires that were missed while the kernel was down coalesce
into one delivery that says how many were missed: a backlog of identical reminders helps no one.
For the same reason a repeating schedule whose last delivery still waits in its process's queue
(the run is busy) only moves on: that delivery stands for the fires after it.

Delivery and advancing are one transaction: the advance (deleting a one-shot schedule, moving a
repeating one on from the due time it was read at) is the delivery's claim
(``ProcessEngine.claimed_event``), a compare-and-set that only one delivery of that due time can
win. A crash before the commit leaves both undone, so the next pass fires again; after it, both
are done. Two timers that read the same due row (on a shared store: a worker that stalled past
its duty's expiry, and the one that took the duty over) deliver it once, and no idempotency
record is left behind per fire. The run a fire starts is named ``schedule:<id>:<due time>``.

On a shared store (several workers, DESIGN §6) only the worker holding the ``schedules`` duty
(kernel/duty.py) fires; the others keep trying to take the duty, which they get when its holder
closes or dies.
"""

from __future__ import annotations

import datetime
import logging
import math
import time
import zoneinfo
from collections.abc import Awaitable, Callable, Iterator
from functools import partial

from cronsim import CronSim, CronSimError

from agentloop.kernel.duty import Duty, DutyTimer
from agentloop.messages import check_plain_text
from agentloop.process.api import new_id
from agentloop.process.engine import ProcessEngine
from agentloop.process.store import NoSuchProcess, ScheduleRow, Store

log = logging.getLogger("agentloop.kernel.schedules")

DEFAULT_MIN_EVERY = 10.0  # each fire can start a model run: a tighter loop only burns tokens
SHORTEST_EVERY = 0.001  # whatever the minimum says: a shorter step may not move an epoch time at all
MAX_AHEAD = 100 * 365.25 * 86400.0  # further than this is a typo, not a plan
MAX_SCHEDULES = 100  # per process
MAX_NAME = 128
MAX_TEXT = 64_000  # a schedule's text is delivered again at every fire
POLL = 60.0  # re-read the table at least this often (another writer may have added a schedule)
BATCH = 100  # schedules fired per pass
OVER_BUDGET_WAIT = 300.0  # seconds a schedule of an account past its budget waits before it is looked at again
SCHEDULE_RUN_PREFIX = "schedule:"  # of the run ids of schedules' deliveries
MAX_CRON = 200  # characters of a cron expression
MISSED_COUNTED = 1000  # a calendar's missed fires are counted up to this many


class ScheduleError(ValueError):
    """A schedule that cannot be made as asked (bad time, bad interval, bad text)."""


class LimitReached(ValueError):
    """A process already has as many schedules (or watches) as it may."""


def event_key(row: ScheduleRow) -> str:
    """The name of the run a schedule's delivery for its current due time starts."""
    return f"{SCHEDULE_RUN_PREFIX}{row.id}:{row.next_due!r}"


def next_due_after(due: float, every: float, now: float) -> float:
    """The first time ``due + k * every`` (k ≥ 1) that is later than ``now``."""
    steps = max(1, math.floor((now - due) / every) + 1)
    nxt = due + steps * every
    while nxt <= now:  # float rounding
        nxt += every
        if nxt <= now and now + every == now:  # a step below the clock's resolution never gets there
            return math.nextafter(now, math.inf)
    return nxt


def zone(tz: str) -> zoneinfo.ZoneInfo:
    """The IANA time zone ``tz`` (``ScheduleError`` if there is none by that name)."""
    if not isinstance(tz, str) or not tz or len(tz) > 64 or tz.startswith(("/", ".")) or ".." in tz:
        raise ScheduleError(f"tz must be an IANA time zone such as Europe/Berlin or UTC, not {tz!r}")
    try:
        return zoneinfo.ZoneInfo(tz)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ScheduleError(f"unknown time zone {tz!r}: use an IANA name such as Europe/Berlin or UTC") from None


def cron_times(cron: str, tz: str, after: float) -> Iterator[float]:
    """The times (epoch seconds) ``cron`` names in time zone ``tz``, each later than ``after``."""
    start = datetime.datetime.fromtimestamp(after, zone(tz))
    for when in CronSim(cron, start):
        if when.timestamp() > after:
            yield when.timestamp()


def next_cron_after(cron: str, tz: str, after: float) -> float:
    """The first time ``cron`` names after ``after`` (a checked expression always has one)."""
    return next(cron_times(cron, tz, after))


def describe_cron(cron: str, tz: str) -> str:
    """The expression in words ("At 09:00 on Monday through Friday"), with its zone."""
    try:
        words = CronSim(cron, datetime.datetime.now(zone(tz))).explain()
    except Exception:  # (explain covers the common forms; the expression itself is enough)
        words = f"cron {cron}"
    return f"{words} ({tz})"


def repeats(row: ScheduleRow) -> str | None:
    """How the schedule repeats, in words ("repeats every 60 s"); None for one that fires once."""
    if row.cron is not None and row.tz is not None:
        return f"repeats: {describe_cron(row.cron, row.tz)}"
    if row.every is not None:
        return f"repeats every {row.every:g} s"
    return None


def render(row: ScheduleRow, now: float) -> str:
    """The system message the process sees: what the schedule says, which one it is, and how many
    fires it stands for when the kernel was down past several due times."""
    label = row.name or row.id
    when = datetime.datetime.fromtimestamp(row.next_due, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    head = f"[schedule {label}, due {when}"
    repeat = repeats(row)
    if repeat is not None:
        head += f", {repeat}"
    if row.cron is not None and row.tz is not None:
        missed = _missed_cron(row, now)
        if missed > 0:
            more = "+" if missed >= MISSED_COUNTED else ""
            head += f"; {missed}{more} earlier fire{'s' if missed > 1 else ''} missed while the runtime was down"
    elif row.every is not None:
        missed = math.floor((now - row.next_due) / row.every)
        # due times before the schedule was made (an ``at`` in the past) were not missed: it fires
        # for them at once, as asked, and the runtime was not down for them
        missed -= max(0, math.floor((row.created_at - row.next_due) / row.every))
        if missed > 0:
            head += f"; {missed} earlier fire{'s' if missed > 1 else ''} missed while the runtime was down"
    return f"{head}]\n{row.text}"


def _missed_cron(row: ScheduleRow, now: float) -> int:
    """The calendar's fire times between the due one and ``now`` (after the schedule was made)."""
    assert row.cron is not None and row.tz is not None
    missed = 0
    for when in cron_times(row.cron, row.tz, max(row.next_due, row.created_at)):
        if when > now or missed >= MISSED_COUNTED:
            break
        missed += 1
    return missed


def _check_cron(cron: object, tz: object, now: float, min_every: float) -> tuple[str, str, float]:
    """A usable calendar: the expression, its zone, its first time after ``now``."""
    if not isinstance(cron, str) or not cron.strip() or len(cron) > MAX_CRON:
        raise ScheduleError(f"cron must be a cron expression of at most {MAX_CRON} characters")
    cron = " ".join(cron.split())
    tz = "UTC" if tz is None else tz
    if not isinstance(tz, str):
        raise ScheduleError("tz must be an IANA time zone such as Europe/Berlin or UTC")
    zone(tz)
    try:
        times = cron_times(cron, tz, now)
        first = next(times)
        second = next(times)
    except CronSimError as exc:
        raise ScheduleError(f"cron {cron!r} is not a cron expression (minute hour day month weekday): {exc}") from None
    except StopIteration:  # (a date that never comes, like 30 February)
        raise ScheduleError(f"cron {cron!r} never fires") from None
    if first > now + MAX_AHEAD:
        raise ScheduleError(f"cron {cron!r} first fires more than a hundred years from now")
    if second - first < min_every:
        raise ScheduleError(f"cron {cron!r} fires more often than every {min_every:g} seconds")
    return cron, tz, first


def _number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScheduleError(f"{name} must be a number of seconds")
    try:
        number = float(value)
    except OverflowError:  # an integer past any float
        number = math.inf
    if not math.isfinite(number):
        raise ScheduleError(f"{name} must be a finite number")
    return number


class Scheduler(DutyTimer):
    """The schedules of one kernel: validation, the table, and the timer that fires them."""

    name = "schedules"

    def __init__(
        self,
        store: Store,
        engine: ProcessEngine,
        *,
        min_every: float = DEFAULT_MIN_EVERY,
        clock: Callable[[], float] = time.time,
        duty: Duty | None = None,
    ) -> None:
        if isinstance(min_every, bool) or not isinstance(min_every, int | float) or not 0 <= min_every < math.inf:
            # (NaN would let every interval through: ``every < nan`` is never true)
            raise ValueError(f"schedule_min_every must be a finite number of seconds, at least 0, got {min_every!r}")
        super().__init__(duty)  # (its ``retry``: also the wait before a schedule whose fire failed)
        self.store = store
        self.engine = engine
        self.min_every = max(float(min_every), SHORTEST_EVERY)
        self.clock = clock
        self._held: dict[str, float] = {}  # schedule id -> not before (after a failed fire)
        # why an account may start nothing new now (``budget.gate_timers``): its schedules wait,
        # and fire once it may again
        self.spending: Callable[[str], Awaitable[str | None]] | None = None

    # -- the API ----------------------------------------------------------------------------------

    async def add(
        self,
        pid: str,
        text: str,
        *,
        at: float | None = None,
        every: float | None = None,
        name: str | None = None,
        cron: str | None = None,
        tz: str | None = None,
    ) -> ScheduleRow:
        """A new schedule: first due at ``at`` (epoch seconds; one in the past fires at once) or,
        without it, ``every`` seconds from now; repeats every ``every`` seconds when given. Or on a
        calendar: ``cron`` (minute hour day-of-month month day-of-week) read in ``tz`` (an IANA
        zone, UTC by default), first due at its next time after now."""
        if not isinstance(text, str) or not text.strip():
            raise ScheduleError("text must be a non-empty string")
        if len(text) > MAX_TEXT:
            raise ScheduleError(f"text is longer than {MAX_TEXT} characters")
        if name is not None and (not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME):
            raise ScheduleError(f"name must be a non-empty string of at most {MAX_NAME} characters")
        try:
            check_plain_text(text, "text")  # (both are columns of their own)
            if name is not None:
                check_plain_text(name, "name")
        except ValueError as exc:
            raise ScheduleError(str(exc)) from None
        if cron is not None and (at is not None or every is not None):
            raise ScheduleError("give cron alone, or at and every: not both")
        if tz is not None and cron is None:
            raise ScheduleError("tz goes with cron (at is epoch seconds, which need no zone)")
        if at is None and every is None and cron is None:
            raise ScheduleError("give at (a time), every (an interval), both, or cron (a calendar)")
        now = self.clock()
        if cron is not None:
            cron, tz, first_cron = _check_cron(cron, tz, now, self.min_every)
        if every is not None:
            every = _number(every, "every")
            if every <= 0:
                raise ScheduleError("every must be a positive number of seconds")
            if every < self.min_every:
                raise ScheduleError(f"every must be at least {self.min_every:g} seconds")
            if every > MAX_AHEAD:
                raise ScheduleError("every is longer than a hundred years")
        if at is not None:
            at = _number(at, "at")
            if at <= 0:
                raise ScheduleError("at must be a time in epoch seconds")
            if at > now + MAX_AHEAD:
                raise ScheduleError("at is more than a hundred years away")
        first = first_cron if cron is not None else at if at is not None else now + (every or 0.0)
        live = await self.engine.live(pid)  # NoSuchProcess for an unknown or killed pid
        row = ScheduleRow(new_id(), live.record.pid, text, first, every, name, created_at=now, cron=cron, tz=tz)
        async with self.store.transaction():
            # counted and inserted under one key: concurrent adds (through any worker) cannot all
            # count before any inserts, and pass the limit together
            await self.store.exclusive(f"schedules of {pid}")
            if len(await self.store.schedules(pid)) >= MAX_SCHEDULES:
                raise LimitReached(f"process {pid} has {MAX_SCHEDULES} schedules already")
            await self.store.add_schedule(row)
        self.poke()
        return row

    async def of(self, pid: str) -> list[ScheduleRow]:
        await self.engine.live(pid)
        return await self.store.schedules(pid)

    async def remove(self, pid: str, schedule_id: str) -> bool:
        """Delete one of the process's schedules; False if it has none by that id."""
        await self.engine.live(pid)
        if not any(s.id == schedule_id for s in await self.store.schedules(pid)):
            return False
        async with self.store.transaction():
            return await self.store.delete_schedule(schedule_id)

    async def drop(self, pid: str) -> None:
        """Delete every schedule of the process (inside the caller's transaction)."""
        for row in await self.store.schedules(pid):
            await self.store.delete_schedule(row.id)

    # -- the timer --------------------------------------------------------------------------------

    async def work(self) -> float:
        return await self.fire_due()

    async def fire_due(self) -> float:
        """Fire every schedule that is due now; returns the seconds until the next one is."""
        now = self.clock()
        # past the held ones too: a full batch of them read alone would leave the schedules due
        # after them unfired, and look like more work at once (a pass again without a pause)
        limit = BATCH + sum(1 for until in self._held.values() if until > now)
        due = await self.store.due_schedules(now, limit=limit)
        for row in due:
            if self._held.get(row.id, 0.0) > now:
                continue
            if row.pid in self.engine.clearing:  # taken up again once that is over (a reset drops it)
                self._held[row.id] = math.inf
                self.engine.when_cleared(row.pid, partial(self._unhold, row.id))
                continue
            await self._fire(row, now)
        if len(due) == limit:
            return 0.0
        delay = POLL
        if self._held:
            now = self.clock()
            self._held = {k: v for k, v in self._held.items() if v > now}
            delay = min([delay, *(v - now for v in self._held.values())])
        soonest = await self.store.due_schedules(None, limit=len(self._held) + 1)
        nxt = next((row for row in soonest if row.id not in self._held), None)  # (held ones: see above)
        if nxt is not None:
            delay = min(delay, nxt.next_due - self.clock())
        return max(delay, 0.0)

    def _unhold(self, schedule_id: str) -> None:
        self._held.pop(schedule_id, None)
        self.poke()

    async def _advance(self, row: ScheduleRow, nxt: float) -> bool:
        """A repeating schedule's claim: move it from the due time ``row`` was read at to ``nxt``.
        False (and nothing delivered) when another timer moved it first, and also when an
        earlier fire of it still waits in the process's queue (its run is busy: a slow tool, an
        approval nobody answers overnight): the move commits, and that delivery stands for this
        fire too, as one delivery stands for the fires missed while the runtime was down.
        Otherwise the run's next model call would be handed the same text once per fire."""
        if not await self.store.set_schedule_due(row.id, nxt, expect=row.next_due):
            return False
        mine = f"{SCHEDULE_RUN_PREFIX}{row.id}:"
        waiting = any(q.kind == "system" and (q.run_id or "").startswith(mine) for q in await self.store.queue(row.pid))
        return not waiting

    async def _over_budget(self, row: ScheduleRow, spending: Callable[[str], Awaitable[str | None]]) -> bool:
        record = await self.store.get_process(row.pid)
        if record is None:
            return False  # (its process is gone: the delivery finds that out)
        why = await spending(record.owner)
        if why is not None:
            log.info("schedule %s of process %s waits: %s", row.id, row.pid, why)
        return why is not None

    async def _fire(self, row: ScheduleRow, now: float) -> None:
        """Deliver one due schedule, claimed by its advance from the due time ``row`` was read at:
        if another timer fired it meanwhile, the claim fails and nothing is delivered."""
        claim: Callable[[], Awaitable[bool]]
        try:
            if self.spending is not None and await self._over_budget(row, self.spending):
                self._held[row.id] = self.clock() + OVER_BUDGET_WAIT  # (it fires once the account may spend again)
                return
            if row.cron is not None and row.tz is not None:
                claim = partial(self._advance, row, next_cron_after(row.cron, row.tz, max(now, row.next_due)))
            elif row.every is None:
                claim = partial(self.store.delete_schedule, row.id)
            else:
                claim = partial(self._advance, row, next_due_after(row.next_due, row.every, now))
            await self.engine.claimed_event(
                row.pid, render(row, now), claim=claim, run_id=event_key(row), reason="schedule.event"
            )
        except NoSuchProcess:  # killed meanwhile: its schedule goes with it
            async with self.store.transaction():
                await self.store.delete_schedule(row.id)
        except Exception:
            log.exception("schedule %s of process %s: fire failed; retrying in %g s", row.id, row.pid, self.retry)
            self._held[row.id] = self.clock() + self.retry
        else:
            self._held.pop(row.id, None)
