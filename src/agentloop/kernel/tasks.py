"""Subagents: the ``Task`` tool, with which a process hands a piece of work to a child process.

The child is an ordinary durable process (same owner and working directory, ``parent_pid`` set,
the task as its first message, the parent's own model choice if it made one: ``Process.set_model``),
so it survives a crash, shows up in ``ps`` and can be watched. Two ways to use it:

- ``wait=true`` (the default): the call returns the final answer of the run it started in the
  child, when that run ends: not of a run after it, which it does not wait for (the child is
  addressable by its pid: another process may ``Delegate`` a task to it, a person may send it
  input). The child's pid is derived from the parent, the run and the tool call id, so when a
  restart runs the call again (the tool is idempotent) it finds the same child and waits for it
  (or reads how that run ended) instead of starting a second one; a later run whose model numbers
  its calls the same way (``call_0`` again) starts its own.
- ``wait=false``: the call returns at once; a one-shot signal watch tells the parent, as a system
  event, how the child's run ended and what it answered. The parent can go on meanwhile.

Either way the child stops with the parent's run that started it (aborted, interrupted), and
with the parent (reset, kill): see ``tree.py``. Which run that was is stored with the child.

A child is interactive when its parent is: nobody watches a child, so its approval requests are
put to the person who watches the conversation (kernel/subagent_asks.py); a child of a
non-interactive process refuses what its policy would ask about, and its model is told why. Nesting is capped
(``MAX_DEPTH``) so a model cannot fork itself without end, and so is the number of children one
process may have running at once. Children are not conversations: the account's process quota
(the server's) does not count them (``Store.count_processes(top_level_only=True)``).

Finished children are retired (``retire_finished``), so a parent that delegates a lot does not
keep every child it ever made: the newest ``KEEP_FINISHED`` finished children of a parent stay
readable (a user opens them to see what a subagent did), older ones are killed the way kill does
it (their history archived under ``var/sessions/<owner>/<pid>/``, their own subtree with them).
A child is finished when its answer has reached the parent durably and nothing of it still works:

- the parent's ``Task`` call that made it has its result stored: its run is over, or the call's
  row is terminal (a restart reads the result from there instead of calling ``Task`` again, which
  would find the child gone). The call is named in the child's ``ORIGIN_KEY`` row;
- nothing watches it any more: a ``wait=false`` child's one-shot watch has delivered its report to
  the parent (in the transaction that queued the event), or was dropped (a reset, an abort);
- it and every process below it are idle: no run, no input waiting, no approval pending, no
  watch or schedule of its own that would wake it, no background job.

A child not made by ``Task`` (no ``ORIGIN_KEY`` row naming this parent) is never retired, nor
one that was ever handed a task by ``Delegate`` (kernel/delegate.py, ``DELEGATED_KEY``): another
process addresses it by its pid. The
occasions are a ``Task`` call that makes a child, and the end of a run of a process with children
(``Retirer``, the kernel's hub tap): both only in the background, never in the way of the run. Each
retirement is checked again under the child's clearing hold, and is a kill: one a crash cuts
short leaves a child that the next occasion retires (a kill can be repeated), never a parent
without its answer.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agentloop.kernel import tree
from agentloop.kernel.tree import ORIGIN_KEY, origin
from agentloop.kernel.watches import logged_end, run_answer
from agentloop.messages import UserMessage
from agentloop.process import signals as sig
from agentloop.process.background import JOBS_KEY
from agentloop.process.engine import MODEL_KEY
from agentloop.process.keylock import KeyedLocks
from agentloop.process.signals import Signal
from agentloop.process.store import TERMINAL_STATUSES, NoSuchProcess, ProcessRecord
from agentloop.tools.base import Tool, ToolContext, ToolError, ToolResult

if TYPE_CHECKING:
    from agentloop.kernel.kernel import Kernel

log = logging.getLogger("agentloop.kernel.tasks")

MAX_DEPTH = 3  # a process, its child, grandchild and great-grandchild: no deeper
MAX_RUNNING = 8  # children of one process running at once
TASK_TIMEOUT = 1800.0  # seconds a waiting Task call may take (the child's own runs are not cut)
KEEP_FINISHED = 16  # finished children of one process kept readable; older ones are retired
RETIRE_GRACE = 10.0  # seconds a closing kernel waits for the retirements under way
DELEGATED_KEY = "delegated"  # kv row of a process another delegated a task to (kernel/delegate.py)

_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "prompt": {
            "type": "string",
            "description": "The task, complete in itself: the subagent sees nothing of this conversation.",
        },
        "wait": {
            "type": "boolean",
            "description": "true (default): wait and get the answer. false: go on; the answer arrives later"
            " as a system message.",
        },
    },
    "required": ["prompt"],
    "additionalProperties": False,
}


_starting = KeyedLocks()  # per parent pid (one event loop per kernel: a module-level lock set is enough)
_retiring = KeyedLocks()  # per parent pid: one retirement of its children at a time


class TaskTool(Tool):
    """``Task`` for one process: starts a child process on the given prompt."""

    def __init__(self, kernel: Kernel, parent: ProcessRecord) -> None:
        super().__init__(
            "Task",
            "Hand a self-contained piece of work to a subagent (a new process with the same tools and"
            " working directory) and get its final answer. Use it for work that needs many steps of its"
            " own; give it everything it needs to know in `prompt`.",
            _SCHEMA,
            timeout=TASK_TIMEOUT,
            idempotent=True,  # a re-run after a restart finds the child it started (see child_pid)
        )
        self.syscall = "proc.spawn"
        self.kernel = kernel
        self.parent = parent

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        # as the schema says (``additionalProperties``): an option the model guessed at (say,
        # ``background``) would otherwise be dropped in silence, and the call do something else
        unknown = sorted(set(arguments) - set(_SCHEMA["properties"]))
        if unknown:
            raise ToolError(f"Task takes `prompt` and `wait` only, not {', '.join(f'`{k}`' for k in unknown)}")
        prompt = arguments.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ToolError("Task needs a non-empty `prompt` string")
        wait = arguments.get("wait", True)
        if not isinstance(wait, bool):
            raise ToolError("`wait` must be true or false")
        return {"prompt": prompt, "wait": wait}

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        kernel, parent = self.kernel, self.parent
        pid = child_pid(parent.pid, ctx.run_id, ctx.call_key or ctx.tool_call_id)
        existing = await kernel.store.get_process(pid)
        if existing is None and ctx.call_key is not None:  # a child made before calls had keys?
            legacy = await _legacy_child(kernel, parent.pid, child_pid(parent.pid, ctx.run_id, ctx.tool_call_id))
            if legacy is not None and legacy[1] == arguments["prompt"]:
                pid, existing = legacy[0].pid, legacy[0]
        run_id = f"task:{pid}"  # the child's run on the task (as its receipt says, below)
        if existing is None and await kernel.store.was_killed(pid):  # (a re-run after a restart)
            raise ToolError(f"the subagent {pid} this call started was killed")
        if existing is None:
            # one call of the parent's at a time from the count to the child's run: sibling calls
            # of one turn would all count before any child runs, and pass the cap together
            async with _starting.hold(parent.pid):
                await self._check_limits()
                kv: dict[str, Any] = {ORIGIN_KEY: origin(parent.pid, ctx.run_id, arguments["wait"], ctx.call_key)}
                chosen = await kernel.store.kv_get(parent.pid, MODEL_KEY)  # the parent's own model, if any
                if chosen is not None:
                    kv[MODEL_KEY] = chosen
                child = await kernel.spawn(
                    parent.owner,
                    run_as=parent.run_as,  # the identity it works as (its context, skills, home) too
                    cwd=parent.cwd,
                    interactive=parent.interactive,  # (its requests are put to the parent's person)
                    parent_pid=parent.pid,
                    pid=pid,
                    kv=kv,
                    context=f"You are a subagent working on a task for process {parent.pid}. Answer with the result.",
                )
                if not arguments["wait"]:
                    await kernel.watch(parent.pid, pid, sig.RUN_FINISHED, once=True)
                run_id = (await child.send(arguments["prompt"], run_id=run_id)).run_id
            retirer = _retirers.get(kernel)
            if retirer is not None:  # a new child: the occasion to retire the oldest finished ones
                retirer.soon(parent.pid)
        else:
            child = await kernel.process(pid)
            if existing.state != "killed":
                # A restart may have come between the child's creation and its prompt (and, for a
                # background task, its watch): finish the delivery. The send is idempotent by its
                # run id, so a child that got the prompt gets nothing new; the watch goes in first,
                # as above, so the child cannot finish before it exists.
                if (
                    not arguments["wait"]
                    and not any(w.source_pid == pid for w in await kernel.watches(parent.pid))
                    and not await child.history(limit=1)
                ):
                    await kernel.watch(parent.pid, pid, sig.RUN_FINISHED, once=True)
                run_id = (await child.send(arguments["prompt"], run_id=run_id)).run_id
        if not arguments["wait"]:
            return ToolResult.text(f"Started subagent {pid}; its answer will arrive as a system message.")
        try:
            finished = await _run_end(kernel, pid, run_id)
        except asyncio.CancelledError:
            # The parent's run was aborted (or timed out): the work it waited for is not wanted any
            # more (but what others gave the child after it is theirs). A shutdown is different: the
            # call runs again after the restart and finds the child.
            if not kernel.engine.closing:
                await asyncio.shield(child.abort(run_id))
            raise
        return await _answer(kernel, pid, run_id, finished)

    async def _check_limits(self) -> None:
        depth, pid = 0, self.parent.parent_pid
        while pid is not None and depth <= MAX_DEPTH:
            depth += 1
            record = await self.kernel.store.get_process(pid)
            pid = record.parent_pid if record is not None else None
        if depth >= MAX_DEPTH:
            raise ToolError(f"subagents may nest {MAX_DEPTH} deep at most; do this task yourself")
        children = [r for r in await self.kernel.processes(self.parent.owner) if r.parent_pid == self.parent.pid]
        if sum(1 for r in children if r.current_run is not None) >= MAX_RUNNING:
            raise ToolError(f"{MAX_RUNNING} subagents are running already; wait for one to finish")


def child_pid(parent_pid: str, run_id: str | None, call_key: str) -> str:
    """The child's pid: the same for the same call, so a re-run after a restart finds it. The call
    is named by its durable key (``ToolContext.call_key``), not by the provider's call id, which
    some providers reuse in every reply (``call_0``): a second Task of the run would find the
    first one's child and be given its answer."""
    digest = hashlib.sha256(f"{parent_pid}\0{run_id or ''}\0{call_key}".encode()).hexdigest()[:20]
    return f"task-{digest}"


async def _legacy_child(kernel: Kernel, parent_pid: str, pid: str) -> tuple[ProcessRecord, str] | None:
    """The child an earlier version named by the provider's call id, with its prompt, if there is
    one: a call re-run after an upgrade finds it by that (and by its prompt, since the call id may
    have been reused) instead of starting the work again."""
    record = await kernel.store.get_process(pid)
    if record is None or record.parent_pid != parent_pid:
        return None
    first = next((m.message for m in await kernel.store.history(pid) if isinstance(m.message, UserMessage)), None)
    return (record, first.text) if first is not None else None


async def _run_end(kernel: Kernel, pid: str, run_id: str) -> dict[str, Any] | None:
    """The ``proc.run.finished`` payload of the child's run ``run_id``, the Task's own, when it
    comes (from the log, then live): not the end of a run after it (a task another process
    delegated to the child, input a person sent it; a run whose end is in the log already, for a
    call run again after a restart). None if the run is over without one in the log (pruned
    since, dropped by a reset) or the child was killed."""
    try:
        process = await kernel.process(pid)
        after = await kernel.store.last_event_seq(pid)  # (before the check: a change after it is seen)
        pending = await _pending(kernel, pid, run_id)
        async for signal in process.signals(follow=pending):
            if signal.signal == sig.RUN_FINISHED and signal.payload.get("runId") == run_id:
                return dict(signal.payload)
            if (signal.seq or 0) > after and _may_end(signal) and not await _pending(kernel, pid, run_id):
                # over: its end is logged by now, if it has one (a signal is heard after the
                # commit that logged it, and those the same commit logged after it)
                return await logged_end(kernel.store, pid, run_id, signal.seq or after)
    except NoSuchProcess:
        pass
    return None


def _may_end(signal: Signal) -> bool:
    """Whether ``signal`` may say that a run is over, or its queued input dropped (a withdrawal,
    a reset): a run's end, or a change of the queue."""
    if signal.signal == sig.CHANGED:
        changes = signal.payload.get("changes") or ()
        return "queue" in changes or "reset" in changes
    return signal.signal == sig.RUN_FINISHED


async def _pending(kernel: Kernel, pid: str, run_id: str) -> bool:
    """Whether the child's run ``run_id`` is under way or its input waits in the queue."""
    record = await kernel.store.get_process(pid)
    if record is None or record.state == "killed":
        return False
    if record.current_run is not None and record.current_run.get("run_id") == run_id:
        return True
    return any(item.run_id == run_id for item in await kernel.store.queue(pid))


async def _answer(kernel: Kernel, pid: str, run_id: str, finished: Mapping[str, Any] | None) -> ToolResult:
    """The answer of the child's run ``run_id``, or an error saying how it ended without one."""
    text = await run_answer(kernel.store, pid, run_id)
    if finished is None:
        record = await kernel.store.get_process(pid)
        if record is None or record.state == "killed":
            raise ToolError(f"subagent {pid} was killed before it answered")
    elif finished.get("status") != "ok":
        reason = finished.get("reason") or finished.get("status")
        # what failed (the provider's message), as the background report gives it: the reason
        # code alone (``generation.error``) does not tell the parent whether trying again helps
        said = "\n".join(part for part in (str(finished.get("error") or ""), text) if part)
        raise ToolError(
            f"subagent {pid} ended with {finished.get('status')} ({reason})" + (f": {said}" if said else "")
        )
    return ToolResult.text(text or f"subagent {pid} finished without an answer", details={"pid": pid})


# -- retiring finished children ------------------------------------------------------------------


async def retire_finished(kernel: Kernel, parent_pid: str) -> list[str]:
    """Retire the finished children of ``parent_pid`` past the newest ``KEEP_FINISHED`` (see the
    module doc); returns the pids retired. Nothing while the parent is being reset or killed (that
    takes care of its children itself) or the kernel closes. A child whose retirement fails is
    logged and left for the next occasion."""
    async with _retiring.hold(parent_pid):
        engine, store = kernel.engine, kernel.store
        if engine.closing or parent_pid in engine.clearing:
            return []
        parent = await store.get_process(parent_pid)
        if parent is None or parent.state == "killed":
            return []
        idle = [c for c in await tree.children(kernel, parent) if c.current_run is None]
        if len(idle) <= KEEP_FINISHED:
            return []
        idle.sort(key=lambda r: (r.updated_at, r.created_at, r.pid), reverse=True)  # newest finished first
        kept, retired = 0, []
        for child in idle:
            if child.pid in engine.clearing or not await _finished(kernel, parent_pid, child):
                continue
            if kept < KEEP_FINISHED:
                kept += 1
            elif await _retire(kernel, parent_pid, child.pid):
                retired.append(child.pid)
        return retired


async def _finished(kernel: Kernel, parent_pid: str, child: ProcessRecord) -> bool:
    """Whether ``child``'s answer has reached its parent durably and nothing of it works on."""
    store = kernel.store
    started = await store.kv_get(child.pid, ORIGIN_KEY)
    if not isinstance(started, dict) or started.get("parent") != parent_pid:
        return False  # not a subagent of this parent's Task calls: whoever made it decides
    if await store.kv_get(child.pid, DELEGATED_KEY):
        return False  # a process was delegated to (``Delegate``): someone addresses it by its pid
    if not await store.history(child.pid, limit=1):
        return False  # never given its task (a restart between its creation and its prompt)
    parent = await store.get_process(parent_pid)  # (read after the child: a run begun since is seen)
    if parent is None or await _call_pending(kernel, parent, started):
        return False
    if await store.watches(source_pid=child.pid):
        return False  # its report is still owed (or someone else follows it)
    return await _quiet(kernel, child)


async def _call_pending(kernel: Kernel, parent: ProcessRecord, started: dict[str, Any]) -> bool:
    """Whether the parent's ``Task`` call that made the child may still run (again): its run is
    the parent's active one and the call has no stored result yet. A run that is over never runs
    its calls again; a terminal call row keeps its result for the restart that would re-run it."""
    run_id, run = started.get("run_id"), parent.current_run
    if run_id is None or run is None or run.get("run_id") != run_id:
        return False
    call = started.get("call")
    if not isinstance(call, str):
        return True  # (made before the call was kept: until its run is over)
    return any(
        (row.dispatch_id == call or call.startswith(f"{row.dispatch_id}.")) and row.status not in TERMINAL_STATUSES
        for row in await kernel.store.calls(parent.pid, run_id)
    )


async def _quiet(kernel: Kernel, record: ProcessRecord) -> bool:
    """Whether ``record`` and every process below it are idle and nothing would wake them: a
    retirement kills the whole subtree. (``record`` itself may be held for its retirement: one
    below it being reset or killed is not quiet.)"""
    store, engine = kernel.store, kernel.engine
    seen, todo = {record.pid}, [record]
    while todo:
        node = todo.pop()
        if (
            node.current_run is not None
            or (node is not record and node.pid in engine.clearing)
            or await store.queue(node.pid)
            or await store.hils(node.pid)
            or await store.watches(pid=node.pid)
            or await store.schedules(node.pid)
            or await store.kv_get(node.pid, JOBS_KEY)
        ):
            return False
        for child in await tree.children(kernel, node):
            if child.pid not in seen:  # (a pid reused further up: never loop)
                seen.add(child.pid)
                todo.append(child)
    return True


async def _retire(kernel: Kernel, parent_pid: str, pid: str) -> bool:
    """Kill a finished child with an archive, as ``Process.kill`` does, once it is checked again
    under its clearing hold (input for it waits meanwhile). False if it was not retired."""
    try:
        async with kernel.engine.clear(pid):
            record = await kernel.store.get_process(pid)
            if record is None or record.current_run is not None or not await _finished(kernel, parent_pid, record):
                return False
            await kernel._clear_held(pid, kill=True, archive=True, above=frozenset({parent_pid}))
    except NoSuchProcess:
        return False  # killed meanwhile
    except Exception as exc:
        log.warning("process %s: the finished subagent %s was not retired: %s", parent_pid, pid, exc)
        return False
    log.info("process %s: retired the finished subagent %s", parent_pid, pid)
    return True


_retirers: weakref.WeakKeyDictionary[Kernel, Retirer] = weakref.WeakKeyDictionary()


class Retirer:
    """A kernel's retirements of finished subagents, in the background: after a run of a process
    with children ends (the kernel's hub tap) and after a ``Task`` call made a child (``soon``).
    One at a time per parent; an occasion that comes while one is under way runs it again after."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.parents: set[str] = set()  # the processes known to have children
        self._work: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()
        self.closed = False
        _retirers[kernel] = self
        kernel.engine.hub.tap(self._heard)

    async def start(self) -> None:
        """Note the processes that have children (once, when the kernel opens)."""
        records = await self.kernel.store.list_processes()
        self.parents.update(r.parent_pid for r in records if r.parent_pid is not None and r.state != "killed")

    def _heard(self, pid: str, signal: Signal) -> None:
        """The hub's tap: cheap, synchronous, never raising."""
        if signal.signal != sig.RUN_FINISHED or pid not in self.parents:
            return
        live = self.kernel.engine.cached(pid)
        if live is not None and live.remote:  # (its worker retires them)
            return
        self.soon(pid)

    def soon(self, parent_pid: str) -> None:
        """Retire the finished children of ``parent_pid`` in the background."""
        if self.closed:
            return
        self.parents.add(parent_pid)
        if parent_pid in self._work:
            self._again.add(parent_pid)
            return
        work = self._retire(parent_pid)
        task = asyncio.get_running_loop().create_task(work, name=f"retire the finished subagents of {parent_pid}")
        self._work[parent_pid] = task
        task.add_done_callback(functools.partial(self._done, parent_pid))

    async def _retire(self, parent_pid: str) -> None:
        try:
            await retire_finished(self.kernel, parent_pid)
            if await self.kernel.store.get_process(parent_pid) is None:
                self.parents.discard(parent_pid)  # (killed: no more occasions for it)
        except Exception as exc:
            log.warning("process %s: its finished subagents were not retired: %s", parent_pid, exc)

    def _done(self, parent_pid: str, task: asyncio.Task[None]) -> None:
        if self._work.get(parent_pid) is task:
            del self._work[parent_pid]
        if parent_pid in self._again:
            self._again.discard(parent_pid)
            self.soon(parent_pid)

    async def wait(self) -> None:
        """Until no retirement is under way (tests; ``close``)."""
        while self._work:
            await asyncio.gather(*list(self._work.values()), return_exceptions=True)

    async def close(self) -> None:
        """No more occasions; the retirements under way get ``RETIRE_GRACE`` to finish."""
        self.closed = True
        self.kernel.engine.hub.untap(self._heard)
        _retirers.pop(self.kernel, None)
        work = set(self._work.values())
        if work:
            _, late = await asyncio.wait(work, timeout=RETIRE_GRACE)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)


def retirer_of(kernel: Kernel) -> Retirer | None:
    """The kernel's ``Retirer`` (one opened with ``subagents``), if it has one."""
    return _retirers.get(kernel)


def task_toolset(kernel_ref: list[Kernel]) -> Any:
    """A ``ToolsetFn`` adding ``Task`` to each run, bound to the run's process. ``kernel_ref`` is
    filled once the kernel exists (the toolset is made before it)."""

    def toolset(record: ProcessRecord, shared: Mapping[str, Tool]) -> Mapping[str, Tool]:
        if not kernel_ref or "Task" in shared:
            return shared
        return {**shared, "Task": TaskTool(kernel_ref[0], record)}

    return toolset
