"""Kernel-wide work that one worker at a time does on a shared store (DESIGN §6).

Each worker of a shared PostgreSQL database runs a kernel, and each kernel has a schedule
timer. Were every timer to fire every due schedule, every worker would read the same rows at the
same moment and race to deliver them. The timer is therefore a *duty*: a named row in the
``duties`` table (owner, expiry, epoch; a table of its own, so the process leases' renewals and
sweep never see it). The worker holding it fires the schedules and renews it by claiming it again
at every pass; the others try to claim it as often, and one of them takes it over once its holder
closed (it releases the duty) or died (the duty expires after ``ttl`` seconds).

The duty only keeps the others idle; it does not make a fire safe by itself: a holder that
stalls for longer than ``ttl`` (a long pause, a slow database) can still be firing when another
worker has taken over. Each fire is claimed in its own delivery transaction (see
``Scheduler._fire``), so that race delivers once as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from agentloop.process.store import Store

log = logging.getLogger("agentloop.kernel.duty")

SCHEDULES = "schedules"  # the duty of firing the schedules
WATCHES = "watches"  # the duty of delivering watched signals a dead worker left undelivered
HEARTBEAT = "heartbeat"  # the duty of delivering the check-ins HEARTBEAT.md files ask for
RETENTION = "retention"  # the duty of sweeping old archives and idle processes (kernel/retention.py)


class Duty:
    """This worker's side of one duty: ``hold`` claims or renews it, ``release`` lets it go."""

    def __init__(self, store: Store, name: str, owner: str, *, ttl: float, every: float) -> None:
        if ttl <= 0 or every <= 0:
            raise ValueError("a duty's ttl and renewal interval must be positive")
        self.store = store
        self.name = name
        self.owner = owner
        self.ttl = ttl
        self.every = min(every, ttl / 3)  # how often to renew it (or, without it, to try to take it)
        self.epoch: int | None = None  # of this worker's hold, None when it does not hold the duty

    async def hold(self) -> bool:
        """Claim the duty, or renew it when this worker holds it already: whether it holds it now."""
        epoch = await self.store.claim_duty(self.name, self.owner, self.ttl)
        if epoch != self.epoch:
            if epoch is None:
                log.warning("duty %s: taken over by another worker (it had expired)", self.name)
            else:
                log.info("duty %s: this worker (%s) holds it now (epoch %d)", self.name, self.owner, epoch)
        self.epoch = epoch
        return epoch is not None

    async def release(self) -> None:
        """Let the duty go (on close), so another worker takes it at its next try instead of after
        the expiry."""
        if self.epoch is None:
            return
        self.epoch = None
        try:
            await self.store.release_duty(self.name, self.owner)
        except Exception:  # the database is gone: the duty expires by itself
            log.warning("could not release duty %s; it expires in %.0fs", self.name, self.ttl)


class DutyTimer:
    """A kernel's timer of one kind of work (firing schedules, delivering heartbeats): a task
    that does a pass, then waits as long as the pass said (or until ``poke``). A pass that fails is
    logged and tried again after ``retry`` seconds. On a shared store it works only while this
    worker holds ``duty``; the others keep trying to take it."""

    name = "timer"

    def __init__(self, duty: Duty | None) -> None:
        self.duty = duty
        self.retry = 5.0  # seconds before a pass that failed is tried again
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def work(self) -> float:
        """Do what is due now; the seconds until the next pass."""
        raise NotImplementedError

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"agentloop-{self.name}")

    def poke(self) -> None:
        """Pass again now (something new may be due sooner than the timer thinks)."""
        self._poke.set()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self.duty is not None:
            await self.duty.release()

    async def _run(self) -> None:
        while True:
            self._poke.clear()  # before the pass: work that comes meanwhile pokes again
            try:
                delay = await self._pass()
            except Exception:
                log.exception("%s: a pass failed", self.name)
                delay = self.retry
            if delay > 0:
                with contextlib.suppress(TimeoutError):  # (not ``wait_for``: on 3.11 it can swallow a cancel)
                    async with asyncio.timeout(delay):
                        await self._poke.wait()

    async def _pass(self) -> float:
        """Work if this worker is on duty; the seconds until the next pass. On duty, that is at
        most the duty's renewal interval, which also bounds how late work another worker added
        is seen."""
        duty = self.duty
        if duty is None:
            return await self.work()
        if not await duty.hold():
            return duty.every  # another worker does it; try again, to take over if it died
        return min(await self.work(), duty.every)
