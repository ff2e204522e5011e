"""Retention: what keeps the data directory and the store from growing without bound.

Off by default: nothing is removed unless a rule is set (``Retention``, given to ``Kernel.open``
as ``retention=`` or in the config file's ``[retention]`` table). Two rules:

- ``archives``: an archive (``var/sessions/<user>/<pid>/<name>.jsonl.gz``: what a reset, kill,
  compaction, clearing or rewind took out of a history) older than this is removed, with the
  ``history_segments`` rows that lead to it (a fork of such a segment then says there is no such
  segment) and the folders its removal leaves empty. An archive's age is the time in its header.
- ``idle_processes``: a process with no activity for longer than this is killed
  (``Process.kill(if_idle_since=...)``): its history is archived, its media deleted, and that new
  archive then ages under the first rule. Idle means the store knows of nothing under way or
  waiting for it (``Store.idle_processes``: no run, nothing queued, no pending approval or tool
  call, no schedule, no watch held or on it, no message or signal since the cut-off) and it has no
  background job. A child goes only with its parent (the kill takes the whole tree), so a process
  is killed only when every process below it is idle too, and a child whose parent lives is never
  killed on its own. The sweep's plan is only a list of candidates: whether a tree is still all
  idle is decided again by the kill itself, in the transaction that deletes it, with this worker's
  input for any of its processes held back until then and another worker's locked out
  (``Kernel._kill_if_idle``). Input that arrived during the sweep therefore keeps its process (the
  tree is skipped, logged at info), and input that comes after the kill finds no process, as after
  any kill: a receipt is never followed by the kill of its process. Processes that another process
  delegated a task to (``Delegate``, kernel/delegate.py: marked ``DELEGATED_KEY``) are never
  killed, nor the trees above them: others reach them by pid, and would find nothing there.
  Interactive conversations are no exception: the one ``agentloop chat`` continues is killed like
  any other once idle that long (the next ``chat`` starts a new one).

A sweep runs an hour apart (the first shortly after the kernel opens), as the ``retention`` duty
(``kernel/duty.py``): with several workers on one PostgreSQL database, one sweeps at a time. An
item that fails is logged and the sweep goes on. Each removal is logged at info level, naming the
owner, process and archive, never what they hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from agentloop.kernel.duty import Duty, DutyTimer
from agentloop.kernel.tasks import DELEGATED_KEY
from agentloop.process.archive import SUFFIX, StoredArchive, all_archives, remove_archive
from agentloop.process.background import JOBS_KEY
from agentloop.process.store import NoSuchProcess, ProcessRecord, Store

if TYPE_CHECKING:
    from agentloop.kernel.kernel import Kernel

__all__ = ["Plan", "Retention", "RetentionTimer", "StillActive", "Swept", "plan", "sweep"]

log = logging.getLogger("agentloop.kernel.retention")

DAY = 86400.0
MAX_DAYS = 36500  # a hundred years: past that a rule is a typo (and timedelta overflows soon after)


def _check_span(name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, timedelta):
        raise TypeError(f"retention {name} must be a timedelta{' or None' if optional else ''}, got {value!r}")
    if value <= timedelta(0):
        raise ValueError(f"retention {name} must be positive, got {value}")


class StillActive(Exception):
    """A kill only if idle (``Process.kill(if_idle_since=...)``) found the process, or one below
    it, active since the cut-off: nothing was killed."""

    def __init__(self, pid: str, active: str) -> None:
        which = "it" if active == pid else f"process {active} below it"
        super().__init__(f"process {pid} was not killed: {which} has been active since the cut-off")
        self.pid = pid
        self.active = active


@dataclass(frozen=True)
class Retention:
    """The retention rules (None: that rule is off). ``every``: between sweeps; ``first_after``:
    from the kernel's opening to its first sweep (not at once: opening has recovery to do)."""

    archives: timedelta | None = None  # remove archives older than this
    idle_processes: timedelta | None = None  # kill (with archive) processes idle for longer
    every: timedelta = timedelta(hours=1)
    first_after: timedelta = timedelta(minutes=1)

    def __post_init__(self) -> None:
        _check_span("archives", self.archives, optional=True)
        _check_span("idle_processes", self.idle_processes, optional=True)
        _check_span("every", self.every, optional=False)
        _check_span("first_after", self.first_after, optional=False)

    @classmethod
    def from_days(cls, archives_days: float | None = None, idle_process_days: float | None = None) -> Retention:
        """The rules in days, as the config file and ``agentloop prune`` give them."""
        for name, days in (("archives_days", archives_days), ("idle_process_days", idle_process_days)):
            if days is None:
                continue
            if isinstance(days, bool) or not isinstance(days, int | float) or not 0 < days <= MAX_DAYS:
                raise ValueError(
                    f"retention {name} must be a number of days above 0 and at most {MAX_DAYS}, got {days!r}"
                )
        return cls(
            archives=None if archives_days is None else timedelta(days=archives_days),
            idle_processes=None if idle_process_days is None else timedelta(days=idle_process_days),
        )

    @property
    def enabled(self) -> bool:
        return self.archives is not None or self.idle_processes is not None


@dataclass(frozen=True)
class Plan:
    """What a sweep at ``now`` removes: the archives, and the processes to kill (each with the
    idle tree below it)."""

    archives: list[StoredArchive] = field(default_factory=list)
    processes: list[ProcessRecord] = field(default_factory=list)


@dataclass
class Swept:
    """What a sweep did: how many archives it removed, processes it killed, and items that failed."""

    archives: int = 0
    processes: int = 0
    failed: int = 0


def last_active(record: ProcessRecord) -> float:
    """The registry's last sign of activity of a process (the store checks its messages and
    signals too: ``Store.idle_processes``)."""
    return max(record.created_at, record.updated_at)


async def idle_roots(
    store: Store, before: float, *, busy: Callable[[str], bool] = lambda pid: False
) -> list[ProcessRecord]:
    """The processes idle since ``before`` that a kill may take with everything below them: a
    top-level one (or one whose parent is gone) whose whole tree is idle. ``busy``: what the
    caller knows to be under way that the store cannot show (a reset or kill in progress). A
    process something was delegated to is never idle: others reach it by its pid."""
    idle = {r.pid: r for r in await store.idle_processes(before)}
    if not idle:
        return []
    jobs = await store.kv_values(JOBS_KEY)  # (one query: most processes have none)
    delegated = await store.kv_values(DELEGATED_KEY)
    everyone = await store.list_processes()
    present = {r.pid for r in everyone}
    children: dict[str, list[str]] = {}
    for record in everyone:
        if record.parent_pid is not None:
            children.setdefault(record.parent_pid, []).append(record.pid)

    def quiet(pid: str) -> bool:
        return pid in idle and not busy(pid) and not jobs.get(pid) and not delegated.get(pid)

    def tree_quiet(pid: str, seen: set[str]) -> bool:
        if pid in seen:  # (a cycle cannot be made, but a walk must end whatever the rows say)
            return True
        seen.add(pid)
        return quiet(pid) and all(tree_quiet(child, seen) for child in children.get(pid, ()))

    return [
        record
        for record in idle.values()
        if (record.parent_pid is None or record.parent_pid not in present) and tree_quiet(record.pid, set())
    ]


async def plan(
    store: Store, data_dir: Path, rules: Retention, *, now: float, busy: Callable[[str], bool] = lambda pid: False
) -> Plan:
    """What the ``rules`` remove at ``now`` (nothing for a rule that is off)."""
    archives: list[StoredArchive] = []
    if rules.archives is not None:
        cut = now - rules.archives.total_seconds()
        archives = [a for a in await asyncio.to_thread(all_archives, data_dir) if a.created < cut]
    processes: list[ProcessRecord] = []
    if rules.idle_processes is not None:
        processes = await idle_roots(store, now - rules.idle_processes.total_seconds(), busy=busy)
    return Plan(archives, processes)


async def remove_old_archive(store: Store, data_dir: Path, archive: StoredArchive) -> None:
    """Remove one archive: first the segment rows that lead to it (a reader then finds no such
    segment rather than a row whose file is gone), then the file and the folders left empty."""
    file_name = f"{archive.name}{SUFFIX}"
    rows = [r for r in await store.segments(archive.pid) if r.archive_path and Path(r.archive_path).name == file_name]
    if rows:
        async with store.transaction():
            for row in rows:
                await store.delete_segment(row.id)
    await asyncio.to_thread(remove_archive, data_dir, archive.user, archive.pid, archive.name)


async def _still_idle(store: Store, planned: ProcessRecord) -> bool:
    """Whether nothing happened to the process since it was planned (a message or a run since
    would have moved its registry row or filled its queue): a quick look that spares the kill's
    holds on a conversation that plainly came back to life during the sweep. Not the decision:
    that is the kill's own (``if_idle_since``), made atomically with it for the whole tree."""
    record = await store.get_process(planned.pid)
    return (
        record is not None
        and record.state == "idle"
        and record.current_run is None
        and record.updated_at == planned.updated_at
        and not await store.queue(planned.pid)
        and not await store.hils(planned.pid)
    )


async def sweep(kernel: Kernel, rules: Retention, *, now: float | None = None) -> Swept:
    """Apply the ``rules`` once, at ``now`` (default: the clock's). Idle processes go first, so
    that the archive their kill writes is judged, young, by the archive rule of the same sweep."""
    now = time.time() if now is None else now
    done = Swept()
    if not rules.enabled:
        return done
    store = kernel.store
    todo = await plan(store, kernel.data_dir, rules, now=now, busy=kernel.engine.clearing.__contains__)
    cut = now - rules.idle_processes.total_seconds() if rules.idle_processes is not None else now
    for record in todo.processes:
        try:
            if not await _still_idle(store, record):
                continue
            path = await (await kernel.process(record.pid)).kill(archive=True, if_idle_since=cut)
        except NoSuchProcess:
            continue  # (killed meanwhile, by its owner or another sweep)
        except StillActive as exc:
            log.info("retention: kept process %s of %s and the processes below it: %s", record.pid, record.owner, exc)
            continue
        except Exception:
            done.failed += 1
            log.exception("retention: could not kill idle process %s of %s", record.pid, record.owner)
            continue
        done.processes += 1
        log.info(
            "retention: killed process %s of %s, idle for %.1f days (archive: %s)",
            record.pid,
            record.owner,
            (now - last_active(record)) / DAY,
            path.name if path is not None else "none, it had no history",
        )
    for archive in todo.archives:
        try:
            await remove_old_archive(store, kernel.data_dir, archive)
        except Exception:
            done.failed += 1
            log.exception("retention: could not remove archive %s of process %s", archive.name, archive.pid)
            continue
        done.archives += 1
        log.info(
            "retention: removed archive %s of process %s of %s, %.1f days old",
            archive.name,
            archive.pid,
            archive.user,
            (now - archive.created) / DAY,
        )
    return done


class RetentionTimer(DutyTimer):
    """The kernel's sweeps: the first ``first_after`` the kernel opened, then ``every`` apart."""

    name = "retention"

    def __init__(
        self, kernel: Kernel, rules: Retention, *, duty: Duty | None, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(duty)
        self.kernel = kernel
        self.rules = rules
        self.clock = clock
        self.due = clock() + rules.first_after.total_seconds()
        self.retry = min(rules.every.total_seconds(), 300.0)  # (a sweep that failed as a whole)

    async def work(self) -> float:
        now = self.clock()
        if now < self.due:
            return self.due - now
        self.due = now + self.rules.every.total_seconds()
        swept = await sweep(self.kernel, self.rules, now=now)
        if swept.archives or swept.processes or swept.failed:
            log.info(
                "retention: swept %d archives and %d idle processes (%d failed)",
                swept.archives,
                swept.processes,
                swept.failed,
            )
        return self.rules.every.total_seconds()
