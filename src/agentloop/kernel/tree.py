"""The process tree: what becomes of a process's children (``parent_pid``) when the process is
killed or reset, or one of its runs is aborted. Without this, a child works on for a parent that
is gone or no longer wants the answer, and spends model calls nobody reads.

- **kill** kills the children too, each the way kill does it (aborted, archived, deleted), and
  theirs in turn. The parent's run is aborted first (so a ``Task`` call waiting on a child ends
  as cancelled instead of reading the child's abort as an answer), and its watches are dropped
  before anything is stopped, so no child's last signal reaches it. The parent is deleted last: a
  kill that fails half-way can be repeated and still finds every child through it.
- **reset** aborts the runs of all descendants still running, and keeps them: their history
  stays readable (what they found or changed), ``ps`` shows them, and a kill clears them (or their
  retirement, below). Killing them would buy nothing for the reset conversation: the watches that
  would have brought their answers to the parent are dropped with it.
- **a finished subagent** is retired (``tasks.retire_finished``): once its answer has reached the
  parent durably, only the newest ``tasks.KEEP_FINISHED`` finished children of a parent stay
  readable, and the older ones are killed as a kill does it (archived, with their subtree).
- **a gently stopped run** (``Process.stop``) stops the subagents it started that still work, as
  gently: each sums up what it has, which a parent waiting on it takes as its answer.
- **an aborted run** stops the subagents it started (``wait`` or not), with their descendants (a
  child that answered may have left a background task running, whose report nobody would read),
  and no others: a child of an earlier, finished run still owes that run's conversation its answer.
  Which run started a child is stored with the child when it is made (``ORIGIN_KEY``), so a
  restart in between keeps it. The abort itself records the run it ended (the engine's
  ``LAST_ABORT_KEY``), so a crash after the abort committed and before its children were stopped
  is made good when they resume: a process whose run began before the aborted run ended, and
  that the run started (itself, or an ancestor of it), is stopped; a background job such a
  process began before it is ended without the report a restart gives other jobs.

A stopped child's one-shot watch to its parent is dropped first, so the news "aborted" does not
start a parent run that nobody asked for. Each child is stopped through ``engine.abort``, which
on a shared store forwards to the worker that holds it; that worker's abort stops its subagents
in turn. A child gone meanwhile (killed by someone else) is skipped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from agentloop.process import background
from agentloop.process.engine import LAST_ABORT_KEY
from agentloop.process.store import NoSuchProcess, ProcessRecord
from agentloop.tools.process_group import end_left_group

if TYPE_CHECKING:
    from agentloop.kernel.kernel import Kernel

ORIGIN_KEY = "task:origin"  # a child's kv row: {"parent", "run_id", "wait", "call"} of the Task call that made it
PARENT_ABORT = "parent.abort"  # the abort reason of a subagent stopped with its parent's run
PARENT_RESET = "parent.reset"  # ... and of a descendant stopped by a reset

# kill(child pid, the pids above it): the kernel's kill of one process and its own subtree
KillFn = Callable[[str, frozenset[str]], Awaitable[Any]]


def origin(parent_pid: str, run_id: str | None, wait: bool, call: str | None = None) -> dict[str, Any]:
    """The ``ORIGIN_KEY`` row of a subagent: who started it, in which run, waiting or not, and
    the durable key of the call (``ToolContext.call_key``: the dispatch id of the parent's tool
    call, or of the code-mode call it was made in, followed by ``.<n>``), by which its retirement
    (``tasks.retire_finished``) knows whether the call's result is stored yet. A row without
    ``call`` (a child made before it was kept) counts as pending until the run is over."""
    return {"parent": parent_pid, "run_id": run_id, "wait": wait, "call": call}


async def children(kernel: Kernel, record: ProcessRecord) -> list[ProcessRecord]:
    """The processes whose parent is ``record`` (a child has its parent's owner)."""
    return [
        r for r in await kernel.store.list_processes(record.owner) if r.parent_pid == record.pid and r.state != "killed"
    ]


async def call_off(kernel: Kernel, parent_pid: str, child_pid: str, reason: str) -> None:
    """Stop the child's active run without telling the parent: its watch on the child goes first.
    Its background commands stop too (after the abort, so one a tool of the run handed over
    meanwhile is among them): their reports would start runs of the child that nobody reads."""
    await kernel.watchers.give_up(parent_pid, child_pid)
    with contextlib.suppress(NoSuchProcess):
        await kernel.engine.abort(child_pid, reason=reason)
    kernel.engine.stop_background(child_pid)


async def run_aborted(kernel: Kernel, pid: str, run_id: str, reason: str) -> None:
    """The engine's ``aborted`` hook: stop the subagents the aborted run started, and everything
    below them. A child that already answered has no run for its abort to stop, yet what it left
    running (a background task) works for it only, and its report would start a run of the
    child that nobody reads: the child's whole subtree stops with it."""
    record = await kernel.store.get_process(pid)
    if record is None:
        return
    for child in await children(kernel, record):
        started = await kernel.store.kv_get(child.pid, ORIGIN_KEY)
        if isinstance(started, dict) and started.get("run_id") == run_id:
            await call_off(kernel, pid, child.pid, PARENT_ABORT)
            await stop_descendants(kernel, child, PARENT_ABORT)


async def run_stopping(
    kernel: Kernel, pid: str, run_id: str | None = None, above: frozenset[str] = frozenset()
) -> None:
    """The run ``run_id`` of ``pid`` (None: the active one) was asked to finish gently
    (``Process.stop``): so are the subagents it started that are still working, and theirs, each
    wrapping up what it has. A parent waiting on a child's ``Task`` call then gets the child's
    summing-up as its answer, instead of waiting for the whole job the stop was meant to cut
    short. Named, the run is found even if it ended meanwhile. ``above``: the pids the stop came
    down from (a pid reused further up is not walked again)."""
    record = await kernel.store.get_process(pid)
    if record is None:
        return
    if run_id is None:
        if record.current_run is None:
            return
        run_id = record.current_run["run_id"]
    lineage = above | {pid}
    for child in await children(kernel, record):
        run = child.current_run
        if child.pid in lineage or run is None:
            continue
        started = await kernel.store.kv_get(child.pid, ORIGIN_KEY)
        if not isinstance(started, dict) or started.get("run_id") != run_id:
            continue
        with contextlib.suppress(NoSuchProcess):
            # (only the run seen working: one begun since is new work, someone else's)
            if await kernel.engine.stop(child.pid, run["run_id"]):
                await run_stopping(kernel, child.pid, run["run_id"], lineage)


async def stop_orphans(kernel: Kernel, pids: list[str]) -> None:
    """After a restart, among the resumed processes ``pids``: stop the subagents below a run that
    was aborted before the crash, when the abort could not stop them any more. As the abort
    itself would have, that is the children the run started and everything below them, also
    under a child that had answered already. A run that began after that abort is new work
    (someone talked to the process since) and goes on."""
    for pid in pids:
        record = await kernel.store.get_process(pid)
        if record is None or record.parent_pid is None or record.current_run is None:
            continue
        if await _below_an_abort(kernel, record, record.current_run.get("started", 0.0)):
            await call_off(kernel, record.parent_pid, pid, PARENT_ABORT)


async def stop_orphan_jobs(kernel: Kernel) -> None:
    """After a restart, before the background jobs the runtime before left are reported
    (``background.recover``): end, without a report, those of subagents below a run that was
    aborted after they began, when the abort could not stop them any more (``call_off`` stops
    them silently). The report would start a run of the subagent that nobody reads, one that
    may run the command again. On a shared store the records are their own workers' (see there)."""
    if kernel.engine.leases is not None:
        return
    store = kernel.store
    jobs_of = await store.kv_values(background.JOBS_KEY)  # (one query: most processes have none)
    if not jobs_of:
        return
    for record in await store.list_processes():
        jobs = jobs_of.get(record.pid)
        if record.parent_pid is None or record.state == "killed" or not isinstance(jobs, dict):
            continue
        for job, entry in jobs.items():
            try:
                found = background.Job.parse(entry)
            except ValueError:
                continue  # (``background.recover`` drops it, with a warning)
            if await _below_an_abort(kernel, record, found.started):
                if found.group is not None:
                    await end_left_group(found.group)
                await background.forget_job(store, record.pid, job)


async def _below_an_abort(kernel: Kernel, record: ProcessRecord, began: float) -> bool:
    """Whether a run that started ``record`` or one of its ancestors was aborted after ``began``
    (the ancestor's ``ORIGIN_KEY`` names the run its parent's ``LAST_ABORT_KEY`` names)."""
    node, seen = record, {record.pid}
    while node.parent_pid is not None and node.parent_pid not in seen:
        started = await kernel.store.kv_get(node.pid, ORIGIN_KEY)
        abort = await kernel.store.kv_get(node.parent_pid, LAST_ABORT_KEY)
        if (
            isinstance(started, dict)
            and started.get("run_id") is not None
            and isinstance(abort, dict)
            and abort.get("run_id") == started["run_id"]
            and began <= abort.get("at", 0.0)
        ):
            return True
        seen.add(node.parent_pid)
        parent = await kernel.store.get_process(node.parent_pid)
        if parent is None:
            return False
        node = parent
    return False


async def stop_descendants(kernel: Kernel, record: ProcessRecord, reason: str = PARENT_RESET) -> None:
    """Abort the active runs of every descendant, from the top down (a parent stops before its
    children, so it never reads a child's abort as the answer it waited for)."""
    seen, level = {record.pid}, [record]
    while level:
        below: list[ProcessRecord] = []
        for parent in level:
            for child in await children(kernel, parent):
                if child.pid in seen:  # (a pid reused further up: never loop)
                    continue
                seen.add(child.pid)
                await call_off(kernel, parent.pid, child.pid, reason)
                below.append(child)
        level = below


async def kill_children(kernel: Kernel, record: ProcessRecord, kill: KillFn, above: frozenset[str]) -> None:
    """Kill each child of ``record`` with its subtree (``kill``); one killed meanwhile is skipped."""
    lineage = above | {record.pid}
    for child in await children(kernel, record):
        if child.pid in lineage:  # (a pid reused further up: never loop)
            continue
        with contextlib.suppress(NoSuchProcess):
            await kill(child.pid, lineage)
