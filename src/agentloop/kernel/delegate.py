"""Delegation: the ``Delegate`` tool, with which a process hands a task to another EXISTING process.

GSV's ``proc.ipc.deliver``, adapted. ``Task`` (kernel/tasks.py) makes a new child for each piece of
work; ``Delegate`` asks a process that is there already (one that knows a repository, a long-lived
helper the user set up, a subagent that did related work) and gets its answer back. It is a tool of
its own rather than a ``to`` argument of ``Task`` because almost none of ``Task``'s rules hold for
it: the target is not a child (it does not stop with the caller's run or the caller, it is never
retired, no depth or running cap applies), it keeps its own conversation, a timeout does not stop
it, and a busy target answers after the run it is in. Folding that into ``Task`` would leave each
argument meaning two things.

Rules and semantics:

- A process under a tool scope delegates only to a process whose scope is within its own
  (process/tool_scope.py): it would otherwise have the work done with tools it may not use.
- Same owner only. The caller itself, an unknown or killed pid and a process of another owner are
  refused alike ("no process X of yours": the error does not tell another owner's pids exist),
  and nothing is delivered. A target that is a non-interactive subagent is allowed (a call its
  policy would ask about is refused there, as for any subagent).
- The task reaches the target as user input, "Delegated task from process <source> …; complete it
  before <deadline>; your final answer is returned to the caller automatically", with the run id
  ``delegated_run_id(source, source run, call key)`` and mode ``queue``: an idle target starts a
  run on it, a busy one answers it in a run of its own after the one it is in. The delivery is
  idempotent by that run id (the admission record), so a restart that runs the call again (the
  tool is idempotent) delivers once.
- ``wait=true`` (the default): the call returns the target's final answer of THAT run (not of
  another run of the target's), or a tool error if the run failed or was aborted, or if no answer
  came within ``timeout`` seconds (default ``TASK_TIMEOUT``, at most ``MAX_TIMEOUT``). A timeout
  does not abort the target's run (the target's conversation is its own); its answer is then not
  sent back. After a restart the call runs again, finds the delivery made, and waits on.
- ``wait=false``: the call returns at once. When the delivered run ends, the caller gets a system
  event with how it ended and the answer (``Replies``, the kernel's hub tap, delivering what the
  target's row ``DELEGATIONS_KEY`` says is owed; the event and the row's removal commit together,
  so it comes once, also when a restart delivers what a crash left owed). Nothing comes if the
  caller was killed or reset since (a reset starts a new conversation; the reply belongs to the
  old one). A reply for a caller run that was aborted is still delivered: the target's work
  went on, and what it found is information the caller may use (the tool call that asked was
  complete when the run was aborted).
- Aborting the caller's run (or a timed-out wait) does not abort the target's delivered run,
  unlike a ``Task`` child's: the target is not the caller's to stop. (A target that is itself a
  subagent of the caller's aborted run stops as a subagent does, ``tree.py``.)
- A process that was ever delegated to is marked (``DELEGATED_KEY``): someone addresses it by its
  pid, so the retirement of finished subagents (kernel/tasks.py) never kills it.

Known limits: a target killed before it answers sends no reply to a ``wait=false`` caller (a
waiting one is told); on a store several workers share, the worker that runs the target's run
delivers the reply, and one that dies before that leaves it to the next kernel start. Two
processes that wait on each other (A waits on B, which delegates back to A and waits) wait until
the timeout: the task for A is queued behind A's waiting run.

A queued task dropped before its turn (withdrawn, the target reset, or stopped with its parent)
ends no run, so the signal that may have dropped it is the cue: if the task is then neither in the
queue, nor the run under way, nor a run that has ended, the caller is told it was not run (a
tool error for one that waits, a reply for one that did not).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import weakref
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from agentloop.kernel.tapwork import TapWork
from agentloop.kernel.tasks import DELEGATED_KEY, TASK_TIMEOUT
from agentloop.kernel.watches import logged_end, run_answer
from agentloop.process import admission
from agentloop.process import signals as sig
from agentloop.process.engine import DISCARDS_QUEUE
from agentloop.process.signals import Signal
from agentloop.process.store import NoSuchProcess, ProcessRecord
from agentloop.process.tool_scope import TOOLS_KEY, widening
from agentloop.tools.base import Tool, ToolContext, ToolError, ToolResult

if TYPE_CHECKING:
    from agentloop.kernel.kernel import Kernel

log = logging.getLogger("agentloop.kernel.delegate")

RUN_PREFIX = "delegate:"  # of the run ids of delegated tasks at their targets
DELEGATIONS_KEY = "delegations"  # a target's kv row: delegated run id -> the reply owed (wait=false)
MAX_TIMEOUT = TASK_TIMEOUT  # seconds a waiting call may take at most
MAX_ANSWER = 8_000  # characters of the answer in a reply event
REPLY_GRACE = 10.0  # seconds a closing kernel waits for the replies under way
# the end of a delegated task that was dropped before its run began (its payload, as a run's end)
NOT_RUN: dict[str, Any] = {"status": "not_run", "reason": "dropped"}
NOT_RUN_WHY = "it was taken out of its queue before its turn (withdrawn, or the process was reset or stopped)"

_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "to": {"type": "string", "description": "The pid of the process (of yours) to hand the task to."},
        "prompt": {
            "type": "string",
            "description": "The task, complete in itself: the other process sees nothing of this conversation.",
        },
        "wait": {
            "type": "boolean",
            "description": "true (default): wait and get the answer. false: go on; the answer arrives later"
            " as a system message.",
        },
        "timeout": {
            "type": "number",
            "description": f"Seconds to wait for the answer (wait=true; default and at most {int(MAX_TIMEOUT)}). On"
            " timeout the other process goes on with the task; its answer is then not returned.",
        },
    },
    "required": ["to", "prompt"],
    "additionalProperties": False,
}


def delegated_run_id(source_pid: str, run_id: str | None, call_key: str) -> str:
    """The delegated run's id at the target: the same for the same call, so a re-run after a
    restart is recognised (the admission record of that id) and delivers nothing new."""
    digest = hashlib.sha256(f"{source_pid}\0{run_id or ''}\0{call_key}".encode()).hexdigest()[:24]
    return f"{RUN_PREFIX}{digest}"


def _render_task(source_pid: str, prompt: str, deadline: float, wait: bool) -> str:
    when = datetime.fromtimestamp(deadline, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    tail = (
        f"Please complete this task before {when}. Your final answer will be returned to the caller automatically."
        if wait
        else f"Please complete this task (the caller does not wait; aim for {when})."
        " Your final answer will be returned to the caller automatically."
    )
    return f"Delegated task from process {source_pid}:\n\n{prompt}\n\n{tail}"


class DelegateTool(Tool):
    """``Delegate`` for one process: hands a task to another existing process of its owner."""

    def __init__(self, kernel: Kernel, source: ProcessRecord) -> None:
        super().__init__(
            "Delegate",
            "Hand a self-contained task to another EXISTING process of yours (by its pid) and get its"
            " final answer. Unlike Task, which starts a new subagent, the other process keeps its own"
            " conversation and works on it after whatever it is doing; it is not stopped if you stop or"
            " time out. Give it everything it needs to know in `prompt`.",
            _SCHEMA,
            timeout=MAX_TIMEOUT + 60,  # (the call's own ``timeout`` ends it first, with its own error)
            idempotent=True,  # a re-run after a restart finds its delivery (see delegated_run_id)
        )
        self.syscall = "proc.ipc.deliver"
        self.kernel = kernel
        self.source = source

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(arguments) - set(_SCHEMA["properties"]))
        if unknown:
            raise ToolError(
                f"Delegate takes `to`, `prompt`, `wait` and `timeout` only, not {', '.join(f'`{k}`' for k in unknown)}"
            )
        to, prompt = arguments.get("to"), arguments.get("prompt")
        if not isinstance(to, str) or not to.strip():
            raise ToolError("Delegate needs the target's pid in `to`")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ToolError("Delegate needs a non-empty `prompt` string")
        wait = arguments.get("wait", True)
        if not isinstance(wait, bool):
            raise ToolError("`wait` must be true or false")
        timeout = arguments.get("timeout", MAX_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ToolError("`timeout` must be a positive number of seconds")
        return {"to": to.strip(), "prompt": prompt, "wait": wait, "timeout": min(float(timeout), MAX_TIMEOUT)}

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        kernel, source = self.kernel, self.source
        store, engine = kernel.store, kernel.engine
        to, wait, timeout = arguments["to"], arguments["wait"], arguments["timeout"]
        target = await store.get_process(to) if to != source.pid else None
        if target is None or target.state == "killed" or target.owner != source.owner:
            what = "yourself" if to == source.pid else f"no process {to} of yours"
            raise ToolError(f"cannot delegate to {what}; nothing was delivered")
        rid = delegated_run_id(source.pid, ctx.run_id, ctx.call_key or ctx.tool_call_id)
        seen = await admission.admitted(engine, to, rid)
        after = 0  # a re-run: the delivered run may have ended before now; read its log from the start
        if seen is None:
            await _check_scope(kernel, source.pid, to)
            after = await store.last_event_seq(to)
            async with store.transaction():
                await store.exclusive(f"{DELEGATIONS_KEY} of {to}")
                await store.kv_set(to, DELEGATED_KEY, True)  # never retired as a finished subagent
                if not wait:  # (rewritten alike by a re-run that finds no delivery yet)
                    owed = dict(await store.kv_get(to, DELEGATIONS_KEY) or {})
                    owed[rid] = {
                        "source": source.pid,
                        "generation": source.history_generation,
                        "run_id": ctx.run_id,
                        "after": after,
                    }
                    await store.kv_set(to, DELEGATIONS_KEY, owed)
            text = _render_task(source.pid, arguments["prompt"], time.time() + timeout, wait)
            try:
                await (await kernel.process(to)).send(text, mode="queue", run_id=rid)
            except NoSuchProcess:
                raise ToolError(f"cannot delegate to no process {to} of yours; nothing was delivered") from None
        if not wait:
            return ToolResult.text(
                f"Delegated to process {to} (run {rid}); its answer will arrive as a system message.",
                details={"pid": to, "run_id": rid},
            )
        try:
            async with asyncio.timeout(timeout):
                finished = await _run_end(kernel, to, rid, after)
        except TimeoutError:
            raise ToolError(
                f"process {to} did not answer within {timeout:g} s; it goes on with the task (run {rid}),"
                " but its answer will not be returned"
            ) from None
        if finished is None:
            raise ToolError(f"process {to} was killed before it answered")
        if finished is NOT_RUN:
            raise ToolError(f"process {to} did not run the task: {NOT_RUN_WHY}")
        return _answer(to, rid, finished, await run_answer(kernel.store, to, rid))


async def _check_scope(kernel: Kernel, source: str, target: str) -> None:
    """A process under a tool scope delegates only to one whose scope is within its own: else
    the task would be done with tools it may not use (process/tool_scope.py)."""
    rows = {pid: await kernel.store.kv_get(pid, TOOLS_KEY) for pid in (source, target)}
    mine = rows[source] if isinstance(rows[source], list) else None
    theirs = rows[target] if isinstance(rows[target], list) else None
    wider = widening(theirs, mine, {})
    if wider:
        raise ToolError(
            f"cannot delegate to process {target}: it may use tools you may not ({', '.join(wider)});"
            " nothing was delivered"
        )


async def _run_end(kernel: Kernel, pid: str, run_id: str, after: int) -> dict[str, Any] | None:
    """The ``proc.run.finished`` payload of the target's run ``run_id``, when it comes (from its
    log after ``after``, then live); ``NOT_RUN`` if the task is dropped before its run begins;
    None if the target is killed first."""
    try:
        async for signal in (await kernel.process(pid)).signals(after_seq=after, follow=True):
            if signal.signal == sig.RUN_FINISHED and signal.payload.get("runId") == run_id:
                return dict(signal.payload)
            if _may_drop(signal):
                dropped = await _dropped(kernel, pid, run_id, signal.seq or after)
                if dropped is not None:
                    return dropped
    except NoSuchProcess:
        return None
    return None


def _may_drop(signal: Signal) -> bool:
    """Whether ``signal`` may say that queued input was dropped: a withdrawal, a reset, or the
    abort of a run that discards the queue (a subagent stopped with its parent)."""
    if signal.signal == sig.CHANGED:
        changes = signal.payload.get("changes") or ()
        return "queue" in changes or "reset" in changes
    return signal.signal == sig.RUN_FINISHED and signal.payload.get("reason") in DISCARDS_QUEUE


async def _dropped(kernel: Kernel, pid: str, run_id: str, after: int) -> dict[str, Any] | None:
    """After a signal at seq ``after`` that may have dropped the delegated task: ``NOT_RUN`` if it
    is neither waiting in the queue nor the run under way, nor a run that has ended since (its
    end then: the log is read after the signal); None while it is still to come. Read in that
    order, a task that moves on meanwhile (taken from the queue, its run ended) is never missed."""
    if any(item.run_id == run_id for item in await kernel.store.queue(pid)):
        return None
    record = await kernel.store.get_process(pid)
    if record is None or record.state == "killed":
        raise NoSuchProcess(pid)
    if record.current_run is not None and record.current_run.get("run_id") == run_id:
        return None
    return await logged_end(kernel.store, pid, run_id, after) or NOT_RUN


async def _owed_end(kernel: Kernel, pid: str, run_id: str, after: int) -> dict[str, Any] | None:
    """How the task a reply is owed for ended: as ``_dropped`` says once its delivery is recorded
    (the admission of ``run_id``); before that only a logged end counts. The row is written
    before the task is sent, so a task on its way (a call, or its re-run after a restart, between
    the two) is not in the queue yet, and must not be taken for one that was dropped."""
    if await admission.admitted(kernel.engine, pid, run_id) is None:
        return await logged_end(kernel.store, pid, run_id, after)
    return await _dropped(kernel, pid, run_id, after)


def _answer(pid: str, run_id: str, finished: Mapping[str, Any], text: str) -> ToolResult:
    if finished.get("status") != "ok":
        reason = finished.get("reason") or finished.get("status")
        said = "\n".join(part for part in (str(finished.get("error") or ""), text) if part)
        raise ToolError(
            f"process {pid} ended the delegated task with {finished.get('status')} ({reason})"
            + (f": {said}" if said else "")
        )
    return ToolResult.text(text or f"process {pid} finished without an answer", details={"pid": pid, "run_id": run_id})


# -- replies to callers that did not wait -----------------------------------------------------------


_replies: weakref.WeakKeyDictionary[Kernel, Replies] = weakref.WeakKeyDictionary()


class Replies:
    """A kernel's delivery of delegated answers to the callers that did not wait: the hub tap
    hears a delegated run end; ``start`` delivers what ended while no kernel was running."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.closed = False
        self._work = TapWork()
        _replies[kernel] = self
        kernel.engine.hub.tap(self._heard)

    async def start(self) -> None:
        """Deliver the replies owed for delegated runs that have ended (after a restart), and for
        delivered tasks that were dropped before their turn (their "not run" reply was on its way
        when the kernel stopped). A task whose delivery is not recorded yet is left alone: the
        caller's call, run again after the restart, delivers it."""
        for target, owed in (await self.kernel.store.kv_values(DELEGATIONS_KEY)).items():
            for rid, row in dict(owed or {}).items():
                try:
                    after = int(row.get("after", 0)) if isinstance(row, dict) else 0
                    finished = await _owed_end(self.kernel, target, rid, after)
                    if finished is not None:
                        await self.deliver(target, rid, finished)
                except Exception as exc:
                    log.warning("process %s: the reply of delegated run %s was not delivered: %s", target, rid, exc)

    def _heard(self, pid: str, signal: Signal) -> None:
        """The hub's tap: cheap, synchronous, never raising."""
        if self.closed:
            return
        if _may_drop(signal):  # (rare: a withdrawal, a reset, a stop with the parent)
            self._work.start(self._deliver_dropped(pid), f"replies of {pid}")
        if signal.signal != sig.RUN_FINISHED:
            return
        rid = signal.payload.get("runId")
        if not isinstance(rid, str) or not rid.startswith(RUN_PREFIX):
            return
        self._work.start(self._deliver_logged(pid, rid, dict(signal.payload)), f"reply of {rid}")

    async def _deliver_dropped(self, target: str) -> None:
        """The replies owed by ``target`` for tasks dropped before their turn: ``NOT_RUN``. The
        log is read from each task's delegation on, not from the signal that woke this: a task
        whose run ended before it (its reply still on its way) is answered, never ``NOT_RUN``."""
        try:
            owed = dict(await self.kernel.store.kv_get(target, DELEGATIONS_KEY) or {})
            for rid, row in owed.items():
                after = int(row.get("after", 0)) if isinstance(row, dict) else 0
                finished = await _owed_end(self.kernel, target, rid, after)
                if finished is not None:
                    await self.deliver(target, rid, finished)
        except NoSuchProcess:
            return
        except Exception as exc:  # left owed
            log.warning("process %s: the replies of its dropped delegated tasks were not delivered: %s", target, exc)

    async def _deliver_logged(self, target: str, rid: str, finished: dict[str, Any]) -> None:
        try:
            await self.deliver(target, rid, finished)
        except Exception as exc:  # left owed: the next start delivers it
            log.warning("process %s: the reply of delegated run %s was not delivered: %s", target, rid, exc)

    async def deliver(self, target: str, rid: str, finished: Mapping[str, Any]) -> bool:
        """Deliver the reply owed for the target's run ``rid`` (if one is) to its caller, as a
        system event whose delivery removes the row: once, whoever tries. False if none was."""
        store = self.kernel.store
        row = dict(await store.kv_get(target, DELEGATIONS_KEY) or {}).get(rid)
        if not isinstance(row, dict):
            return False
        source = await store.get_process(str(row.get("source")))
        if source is None or source.state == "killed" or source.history_generation != row.get("generation"):
            async with store.transaction():  # nobody to tell (killed), or a conversation that is gone (reset)
                await _claim(self.kernel, target, rid)
            return False
        text = _render_reply(target, rid, finished, await run_answer(self.kernel.store, target, rid))
        try:
            receipt = await self.kernel.engine.claimed_event(
                source.pid,
                text,
                claim=lambda: _claim(self.kernel, target, rid),
                run_id=f"{rid}{admission.BOUND_SUFFIX}",  # (a reset drops it, queued whenever)
                reason="delegate.reply",
                # checked again inside the delivery: a reset of the caller since the look above
                # ends the conversation the reply belongs to
                generation=source.history_generation,
            )
        except NoSuchProcess:  # the caller was killed meanwhile
            async with store.transaction():
                await _claim(self.kernel, target, rid)
            return False
        return receipt is not None

    async def wait(self) -> None:
        """Until no delivery is under way (tests)."""
        await self._work.wait()

    async def close(self) -> None:
        self.closed = True
        self.kernel.engine.hub.untap(self._heard)
        _replies.pop(self.kernel, None)
        await self._work.close(REPLY_GRACE)


async def _claim(kernel: Kernel, target: str, rid: str) -> bool:
    """Inside a transaction: remove the reply owed for ``rid`` from the target's row; whether it
    was there (only one delivery can remove it)."""
    store = kernel.store
    await store.exclusive(f"{DELEGATIONS_KEY} of {target}")
    owed = dict(await store.kv_get(target, DELEGATIONS_KEY) or {})
    if rid not in owed:
        return False
    del owed[rid]
    if owed:
        await store.kv_set(target, DELEGATIONS_KEY, owed)
    else:
        await store.kv_delete(target, DELEGATIONS_KEY)
    return True


def _render_reply(target: str, rid: str, finished: Mapping[str, Any], text: str) -> str:
    if finished is NOT_RUN:
        return f"[delegation reply] process {target} did not run the task (run {rid}): {NOT_RUN_WHY}"
    lines = [
        f"[delegation reply] process {target} ended the task you delegated to it (run {rid}):"
        f" status {finished.get('status')} ({finished.get('reason')})"
    ]
    if finished.get("error"):
        lines.append(f"error: {finished['error']}")
    if text:
        clipped = text if len(text) <= MAX_ANSWER else text[: MAX_ANSWER - 1] + "…"
        lines.append("answer:\n" + clipped)
    return "\n".join(lines)


def replies_of(kernel: Kernel) -> Replies | None:
    """The kernel's ``Replies`` (one opened with ``subagents``), if it has one."""
    return _replies.get(kernel)


def delegate_toolset(kernel_ref: list[Kernel]) -> Any:
    """A ``ToolsetFn`` adding ``Delegate`` to each run, bound to the run's process."""

    def toolset(record: ProcessRecord, shared: Mapping[str, Tool]) -> Mapping[str, Tool]:
        if not kernel_ref or "Delegate" in shared:
            return shared
        return {**shared, "Delegate": DelegateTool(kernel_ref[0], record)}

    return toolset
