"""Background jobs across a restart (the records behind ``ProcessEngine.start_background``).

A job the runtime runs for a process outlives the tool call that started it, and the model was
told its end would come as a system message. If the runtime closes or dies first, that message
would never come, and a command's process group (a session of its own) may run on without it. So
while a job runs, a key-value row of its process (``JOBS_KEY``: job id -> record) names it: its
label, when it started, the history generation it belongs to and, once its command runs, the
command's group (``GroupIdentity``). The delivery of the job's end removes the record in its own
transaction (the removal is the delivery's claim, so it is made once); a reset, a kill, or a stop
with its parent's run removes it with the job. A runtime that closes keeps the records of the jobs
it stopped, and one that dies keeps them all: the runtime that next opens the store (``recover``)
stops what such a job left running and tells the model it did not finish.

Only a runtime that alone drives the store recovers them. On a shared store a lease taken over
does not prove the worker that ran the job dead (it may only have stalled, its job running on,
on another machine), so the records are left for the job's own worker to remove as it ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentloop.process.api import new_id
from agentloop.process.store import ProcessRecord, Store
from agentloop.tools.jobs import CallKey
from agentloop.tools.process_group import GroupIdentity, end_left_group

if TYPE_CHECKING:
    from agentloop.process.engine import ProcessEngine

log = logging.getLogger("agentloop.process")

JOBS_KEY = "background:jobs"  # kv row of a process: {job id: record} of its background jobs under way
REASON = "background.finished"  # the run reason of a job's end, however it ended


@dataclass(frozen=True)
class Job:
    """A job's record as ``recover`` reads it back."""

    label: str
    generation: int
    started: float
    group: GroupIdentity | None

    @classmethod
    def parse(cls, value: Any) -> Job:
        """ValueError for a record that is not one this module wrote (damaged, or by hand)."""
        if not isinstance(value, dict):
            raise ValueError(f"not a record: {value!r}")
        label, generation, started = value.get("label"), value.get("generation"), value.get("started")
        if not isinstance(label, str) or not label:
            raise ValueError(f"no label: {label!r}")
        if type(generation) is not int or not isinstance(started, (int, float)):
            raise ValueError(f"no generation and start: {generation!r}, {started!r}")
        group = value.get("group")
        return cls(label, generation, float(started), None if group is None else GroupIdentity.parse(group))


def interrupted(label: str) -> str:
    """What the model is told of a job a restart ended, in place of the end it was promised."""
    return (
        f"The {label} did not finish: the agent runtime restarted while it ran. It no longer runs "
        "and its output is lost; run it again if you still need it."
    )


async def _jobs(store: Store, pid: str) -> dict[str, Any]:
    jobs = await store.kv_get(pid, JOBS_KEY)
    return dict(jobs) if isinstance(jobs, dict) else {}


async def record_job(
    store: Store, pid: str, job: str, label: str, *, generation: int, call: CallKey | None = None
) -> None:
    """Inside the caller's transaction: job ``job`` of ``pid`` begins, started by tool call ``call``
    (kept, so that a rewind that takes the call out finds the job: ``drop_jobs_of``)."""
    jobs = await _jobs(store, pid)
    jobs[job] = {"label": label, "generation": generation, "started": time.time()}
    if call is not None:
        jobs[job]["call"] = list(call)
    await store.kv_set(pid, JOBS_KEY, jobs)


async def record_group(store: Store, pid: str, job: str, group: GroupIdentity) -> bool:
    """Inside the caller's transaction: the job's command runs as ``group``. False when the job
    has no record (removed meanwhile, or never written)."""
    jobs = await _jobs(store, pid)
    entry = jobs.get(job)
    if not isinstance(entry, dict):
        return False
    jobs[job] = {**entry, "group": group.as_dict()}
    await store.kv_set(pid, JOBS_KEY, jobs)
    return True


async def drop_job(store: Store, pid: str, job: str) -> bool:
    """Inside the caller's transaction: remove the job's record; whether there was one (the
    claim of the delivery of its end)."""
    jobs = await _jobs(store, pid)
    if job not in jobs:
        return False
    del jobs[job]
    if jobs:
        await store.kv_set(pid, JOBS_KEY, jobs)
    else:
        await store.kv_delete(pid, JOBS_KEY)
    return True


async def drop_jobs_of(store: Store, pid: str, calls: Collection[CallKey]) -> int:
    """Inside the caller's transaction (a rewind's): remove the records of the jobs the tool calls
    ``calls`` started; how many. The delivery of such a job's end then finds no record to claim
    and delivers nothing (its call is gone from the history the end would reach), and a restart
    reports none of them."""
    jobs = await _jobs(store, pid)
    gone = [job for job, entry in jobs.items() if isinstance(entry, dict) and _call_of(entry) in calls]
    for job in gone:
        del jobs[job]
    if gone and jobs:
        await store.kv_set(pid, JOBS_KEY, jobs)
    elif gone:
        await store.kv_delete(pid, JOBS_KEY)
    return len(gone)


def _call_of(entry: dict[str, Any]) -> CallKey | None:
    """The tool call a job's record names (None for work no tool call started)."""
    call = entry.get("call")
    if isinstance(call, list) and len(call) == 2 and all(isinstance(part, str) for part in call):
        return call[0], call[1]
    return None


async def forget_job(store: Store, pid: str, job: str) -> None:
    """Remove the job's record in a transaction of its own."""
    async with store.transaction():
        await drop_job(store, pid, job)


async def recover(engine: ProcessEngine, record: ProcessRecord) -> int:
    """After a restart, for each job the process's records name: stop what is left of its command
    and tell the model it did not finish, removing the record with that delivery. A job of a
    conversation reset since (a crash before the job removed its record) is stopped but not
    reported: the fresh conversation never heard of it. A record that cannot be read is dropped
    with a warning. Returns how many jobs were reported."""
    if record.state == "killed":
        return 0
    pid = record.pid
    jobs = await engine.store.kv_get(pid, JOBS_KEY)
    if jobs is None:
        return 0
    if not isinstance(jobs, dict):
        log.warning("process %s: its background jobs' record is not readable (%r): dropped", pid, jobs)
        async with engine.store.transaction():
            await engine.store.kv_delete(pid, JOBS_KEY)
        return 0
    told = 0
    for job, entry in jobs.items():
        told += await _recover_job(engine, record, job, entry)
    return told


async def _recover_job(engine: ProcessEngine, record: ProcessRecord, job: str, entry: Any) -> bool:
    pid, store = record.pid, engine.store
    try:
        found = Job.parse(entry)
    except ValueError as exc:
        log.warning("process %s: background job %s left a record that is not readable (%s): dropped", pid, job, exc)
        await forget_job(store, pid, job)
        return False
    if found.group is not None and await end_left_group(found.group):
        log.info("process %s: stopped the %s, left running by the runtime before", pid, found.label)
    if found.generation != record.history_generation:
        await forget_job(store, pid, job)
        return False

    async def claim() -> bool:
        return await drop_job(store, pid, job)

    receipt = await engine.claimed_event(pid, interrupted(found.label), claim=claim, run_id=new_id(), reason=REASON)
    return receipt is not None
