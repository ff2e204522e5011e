"""The tool calls of a durable run, from the model's calls to their results in the history: rows
registered with the assistant message, dispatch under the approval policy and the concurrency
rules, the tasks that run them, settling each call exactly once (a late or duplicate result changes
nothing), the durable deadlines, and ingesting the batch once every call is terminal. Separate
from the driver: this is the per-call state machine (``registered -> dispatched -> terminal``);
the driver only decides when a batch is started and when it is over."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from agentloop.events import LoopEvent, ToolExecutionUpdate, ToolRetryExhausted, ToolRetryResolved, ToolRetryScheduled
from agentloop.loop.execute import NOT_COUNTED as NOT_THE_MODELS_FAILURES
from agentloop.loop.execute import _ask_hooks, _check, _execute, _Prepared, malformed
from agentloop.loop.guards import CALLS_USED_UP
from agentloop.loop.hooks import TurnInfo
from agentloop.loop.retries import count_repeats
from agentloop.loop.state import LoopConfig, RunState
from agentloop.messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolResultMessage,
    message_from_dict,
    message_to_dict,
    tool_error_result,
)
from agentloop.process import signals as sig
from agentloop.process.api import Approval, call_of, new_id
from agentloop.process.hil import NOT_INTERACTIVE, ask, audit_refusal, edited_result, edits_key, nested_policy
from agentloop.process.lease import LeaseLost
from agentloop.process.signals import Signal
from agentloop.process.store import CallStatus, ToolCallRow
from agentloop.process.tx import _Live, _Tx
from agentloop.tools.base import CallBudget, Tool, not_offered
from agentloop.tools.builtin import SYSCALLS, syscall_of

if TYPE_CHECKING:
    from agentloop.process.engine import ProcessEngine

log = logging.getLogger("agentloop.process")


INTERRUPTED_BY_RESTART = "Tool call interrupted by a restart of the runtime; it may or may not have taken effect."
# a call whose approval was still pending when the user asked the run to stop (``ProcessEngine.stop``)
NOT_RUN_STOPPED = "Not run: the user asked to stop before it was approved."
# a call to a tool a hook had added to the turn (``driver.restore_added``) that the hooks, asked
# again after a restart, no longer add
NOT_ADDED_AGAIN = (
    "Tool no longer available: a hook had added it to this turn, and after a restart of the runtime"
    " it no longer offers it."
)
# results that are no failure of the model's: not counted as repeats (``loop/retries.py``)
NOT_COUNTED = NOT_THE_MODELS_FAILURES | {INTERRUPTED_BY_RESTART, NOT_RUN_STOPPED, NOT_ADDED_AGAIN}


def call_rows(pid: str, run_id: str, calls: list[ToolCall], tools: Mapping[str, Tool]) -> list[ToolCallRow]:
    return [
        ToolCallRow(new_id(), pid, run_id, i, c.id, c.name, _syscall(c, tools), dict(c.arguments))
        for i, c in enumerate(calls)
    ]


async def dispatch(
    engine: ProcessEngine,
    tx: _Tx,
    live: _Live,
    run: dict[str, Any],
    rows: list[ToolCallRow],
    assistant: AssistantMessage | None = None,
    *,
    fresh: bool = False,
    budget: int | None = None,
    offered: frozenset[str] | None = None,
) -> None:
    """Start the registered calls the policy allows, in the model's order, inside ``tx``; stop
    at the first that needs a person's approval, or that must wait for calls in flight (the
    loop's ``sequential`` mode, a ``sequential`` tool, ``max_concurrency``): each result wakes
    the driver, which starts the next. Tools start once the transaction commits.

    ``fresh`` rows are not stored yet: they are inserted at the end with the status decided
    here (one statement per batch instead of an insert and an update per call). Calls past
    ``budget`` (what is left of the ``max_tool_calls`` guard) are not run, nor calls to tools
    outside ``offered`` (the names the model was shown, when hooks narrowed them)."""
    pid, run_id = live.record.pid, run["run_id"]
    assistant = assistant or _last_assistant(live.history) or AssistantMessage()
    approved = (await engine.store.kv_get(pid, f"approved:{run_id}") or {}) if live.approvals else {}
    edits = (await engine.store.kv_get(pid, edits_key(run_id)) or {}) if approved else {}
    cfg = await engine._run_config(live, run_id)
    waiting = {row.tool_call_id: row for row in rows if row.status == "registered"}
    for call in assistant.tool_calls:  # (arguments that were not a JSON object: nothing to approve or run)
        refused = malformed(call, assistant)
        if refused is not None and call.id in waiting:
            await settle(engine, tx, waiting[call.id], refused, "failed", ("registered",), fresh=fresh)
    if offered is not None:  # all at once: the loop below may stop at a call that has to wait
        for row in rows:
            if row.status == "registered" and row.tool_name not in offered and row.tool_name in cfg.tools:
                refused = tool_error_result(call_of(row), not_offered(row.tool_name))
                await settle(engine, tx, row, refused, "failed", ("registered",), fresh=fresh)
    gone = [name for name in run.get("added", ()) if name not in cfg.tools]
    for row in rows:  # (before anyone is asked to approve a call that cannot run)
        if row.status == "registered" and row.tool_name in gone:
            refused = tool_error_result(call_of(row), NOT_ADDED_AGAIN)
            await settle(engine, tx, row, refused, "failed", ("registered",), fresh=fresh)
    in_flight = sum(1 for r in rows if r.status == "dispatched")
    alone = in_flight > 0 and any(_runs_alone(cfg, r) for r in rows if r.status == "dispatched")
    for row in rows:
        if row.status != "registered":
            continue
        if row.dispatch_id in edits:  # approved with a person's arguments (``hil.answer``): run those
            row.args = edits[row.dispatch_id]
        call = call_of(row)
        if budget is not None and row.position >= budget:
            refused = tool_error_result(call, CALLS_USED_UP)
            await settle(engine, tx, row, refused, "failed", ("registered",), fresh=fresh)
            continue
        if alone or in_flight >= max(1, cfg.max_concurrency) or (in_flight and _runs_alone(cfg, row)):
            break  # its turn comes when a call in flight finishes
        verdict = await engine.approval(live.record, row)
        # a person's approval answers a question: a refusal (a rule added meanwhile, the guard on
        # the kernel's own data) stands
        if verdict.action == "ask" and approved.get(row.dispatch_id) == (verdict.fingerprint or "-"):
            verdict = Approval("auto")
        if verdict.action == "ask" and not live.record.interactive:
            verdict = Approval("deny", verdict.tags, NOT_INTERACTIVE)
        if verdict.action == "deny":
            text = "Tool execution denied by policy" + (f": {verdict.reason}" if verdict.reason else "")
            if await settle(engine, tx, row, tool_error_result(call, text), "denied", ("registered",), fresh=fresh):
                await audit_refusal(engine, live.record.owner, row, verdict)  # (the approvals audit)
            continue
        if verdict.action == "ask":
            await ask(engine, tx, pid, run_id, row, verdict)
            break
        prepared = _check(cfg, _state_for(live, run_id), assistant, call)
        if isinstance(prepared, ToolResultMessage):
            await settle(engine, tx, row, prepared, "failed", ("registered",), fresh=fresh)
            continue
        timeout = prepared.tool.timeout if prepared.tool.timeout is not None else cfg.tool_timeout
        deadline = time.time() + timeout if timeout else None
        if fresh:
            row.status, row.deadline = "dispatched", deadline
        elif not await engine.store.set_call_status(
            row.dispatch_id, "dispatched", expect=("registered",), deadline=deadline
        ):
            continue  # claimed already (a concurrent step): it is not ours to start
        await tx.signal(
            sig.TOOL_STARTED,
            runId=run_id,
            callId=row.tool_call_id,
            name=row.tool_name,
            syscall=row.syscall,
            args=row.args,
        )
        tx.durable.append(launcher(engine, live, run_id, row, prepared))
        in_flight += 1
        alone = _runs_alone(cfg, row)
    if fresh:
        await engine.store.register_calls(rows)


async def expire(engine: ProcessEngine, live: _Live, rows: list[ToolCallRow]) -> bool:
    """Enforce each dispatch's durable deadline for calls nobody here is working on (a remote
    call, or one whose worker is gone); wake again at the next deadline still ahead."""
    now = time.time()
    expired = [
        r
        for r in rows
        if r.status == "dispatched" and r.deadline is not None and r.deadline <= now and r.dispatch_id not in live.tools
    ]
    if expired:
        async with engine._tx(live) as tx:
            for row in expired:
                text = f"Tool {row.tool_name} timed out: no result before its deadline"
                await settle(engine, tx, row, tool_error_result(call_of(row), text), "failed", ("dispatched",))
    arm_deadline(engine, live, rows, now)
    return bool(expired)


def arm_deadline(engine: ProcessEngine, live: _Live, rows: list[ToolCallRow], now: float) -> None:
    """Wake the driver just after the nearest deadline still ahead, to enforce it."""
    ahead = [r.deadline for r in rows if r.status == "dispatched" and r.deadline is not None and r.deadline > now]
    if live.deadline is not None:
        live.deadline.cancel()
        live.deadline = None
    if ahead:
        live.deadline = asyncio.get_running_loop().call_later(min(ahead) - now + 0.01, engine.wake, live.record.pid)


async def end_batch(engine: ProcessEngine, tx: _Tx, live: _Live, run_id: str) -> None:
    """The run's tool calls are over (ingested, aborted or failed): delete their rows in ``tx``."""
    await engine.store.delete_calls(live.record.pid, run_id)
    tx.after.append(lambda: disarm(live))


def disarm(live: _Live) -> None:
    """No batch is open: its deadline timer has nothing left to enforce (and would hold the
    process's wake-up in the loop for the whole tool timeout)."""
    live.calls = False
    if live.deadline is not None:
        live.deadline.cancel()
        live.deadline = None


def launcher(
    engine: ProcessEngine, live: _Live, run_id: str, row: ToolCallRow, prepared: _Prepared
) -> Callable[[], None]:
    def launch() -> None:
        # The dispatch is durable now; in a group commit that can be a loop turn after the step.
        # If meanwhile the run was aborted or the process dropped, the call stays unstarted.
        run = live.record.current_run
        if live.stopping or run is None or run["run_id"] != run_id or engine.cached(live.record.pid) is not live:
            return
        name = f"tool {row.tool_name} ({row.tool_call_id})"  # named in the log if it ignores an abort
        work = run_tool(engine, live, run_id, row, prepared)
        task = live.tools[row.dispatch_id] = asyncio.create_task(work, name=name)
        task.add_done_callback(lambda done: _drop_task(live.tools, row.dispatch_id, done))
        task.add_done_callback(functools.partial(_ended, live.record.pid))

    return launch


async def run_tool(engine: ProcessEngine, live: _Live, run_id: str, row: ToolCallRow, prepared: _Prepared) -> None:
    try:
        cfg = await engine._run_config(live, run_id)
        checked = await _ask_hooks(cfg, prepared) if cfg.hooks.before else prepared  # a hook may block it
        if isinstance(checked, ToolResultMessage):
            result = checked
        else:
            nested = nested_policy(engine, live, run_id, row)
            budget = nested_budget(engine, live, run_id, cfg)
            state = _state_for(live, run_id)
            started_by = (run_id, row.tool_call_id)  # (the jobs it starts are its: a rewind of it stops them)
            background = functools.partial(engine.start_background, live.record.pid, call=started_by)
            jobs = engine.jobs.of(live.record.pid, started_by)
            progress = Progress(engine, live, run_id, row)
            result = await _execute(
                cfg,
                state,
                checked,
                progress,
                nested,
                budget,
                call_key=row.dispatch_id,
                background=background,
                jobs=jobs,
                # (a process's built-in tools are rooted in its own directory: its Read finds the file there;
                # the str, made a Path only for a result that is cut)
                keep_in=live.record.cwd if cfg.workspace is not None else None,
            )
            await progress.flush()
        result = edited_result(prepared, result)
        try:
            await record(engine, live, run_id, row, result)
        except Exception as exc:  # e.g. ``details`` that do not serialise: the call must still end
            text = f"The tool's result could not be recorded: {type(exc).__name__}: {exc}"
            await record(engine, live, run_id, row, tool_error_result(prepared.call, text))  # (the store's own
            # failure raises again here: told by ``_ended``, in one line)
            log.error(
                "process %s: the result of %s could not be recorded", live.record.pid, row.tool_name, exc_info=exc
            )
    finally:
        live.tools.pop(row.dispatch_id, None)
    engine.wake(live.record.pid)


# the largest tool update sent, as JSON: a larger one is dropped (Shell's are a few KiB at most)
MAX_UPDATE_CHARS = 16_384
_DROP = object()


class Progress:
    """What a durable call's ``ToolContext.update`` does: publish ``proc.run.tool.update`` (pid,
    runId, callId, name, and the tool's ``update``) to this worker's watchers of the process and,
    on a shared store, relay it to watchers on other workers, as the driver does stream deltas:
    live only, never in the log, no seq (its ``base`` the last logged signal, so a watcher that has
    read the log past it drops it as stale). Best-effort and never the tool's problem: nothing is
    done while nobody watches, a value that is not JSON is sent as its string (or dropped, as is one
    over ``MAX_UPDATE_CHARS``), an update from a tool's worker thread is handed to the event loop,
    and nothing raises into the tool. A slow watcher costs nothing either: the hub's queues are
    bounded (``signals.BACKLOG``) and never waited on."""

    def __init__(self, engine: ProcessEngine, live: _Live, run_id: str, row: ToolCallRow) -> None:
        self.engine, self.live, self.run_id, self.row = engine, live, run_id, row
        self.loop = asyncio.get_running_loop()
        self.thread = threading.get_ident()
        self.relayed = False  # something waits in the relay: sent before the result is committed

    def __call__(self, event: LoopEvent) -> None:
        if not isinstance(event, ToolExecutionUpdate):
            return
        try:
            if threading.get_ident() == self.thread:
                self.publish(event.partial_result)
            else:  # a sync tool run in a thread: the hub and the relay belong to the loop
                self.loop.call_soon_threadsafe(self.publish, event.partial_result)
        except Exception:  # (the loop closed under a thread that outlived it)
            log.debug("a tool update of %s was not published", self.row.tool_name, exc_info=True)

    def publish(self, value: Any) -> None:
        try:
            pid = self.live.record.pid
            relay = self.engine.leases.relay if self.engine.leases is not None else None
            watched = self.engine.hub.watching(pid)
            if not watched and (relay is None or not relay.wanted(pid)):
                return  # nobody to tell
            update = _as_json(value)
            if update is _DROP:
                return
            payload = {
                "pid": pid,
                "runId": self.run_id,
                "callId": self.row.tool_call_id,
                "name": self.row.tool_name,
                "update": update,
            }
            if watched:
                self.engine.hub.publish(pid, Signal(sig.TOOL_UPDATE, payload, base=self.live.seq))
            if relay is not None and relay.send(pid, self.live.seq, payload, signal=sig.TOOL_UPDATE):
                self.relayed = True
        except Exception:
            log.debug("a tool update of %s was not published", self.row.tool_name, exc_info=True)

    async def flush(self) -> None:
        """The call ended: what the relay holds of its updates goes out ahead of its result."""
        relay = self.engine.leases.relay if self.engine.leases is not None else None
        if self.relayed and relay is not None:
            await relay.flush(self.live.record.pid)


def _as_json(value: Any) -> Any:
    """``value`` as plain JSON data (a copy, so the tool may change what it passed on), its string
    when it is not JSON, ``_DROP`` when not even that or when it is too large to send."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        try:
            text = json.dumps(value, allow_nan=False, default=str)
        except (TypeError, ValueError, RecursionError):
            try:
                text = json.dumps(str(value))
            except Exception:  # a __str__ that fails
                return _DROP
        except Exception:  # a __str__ of a part that fails
            return _DROP
    if len(text) > MAX_UPDATE_CHARS:
        log.debug("a tool update of %d characters was dropped", len(text))
        return _DROP
    return json.loads(text)


def nested_budget(engine: ProcessEngine, live: _Live, run_id: str, cfg: LoopConfig) -> CallBudget | None:
    """The durable runner's budget for calls a running tool makes itself (CodeMode's): each one
    is added to the run's committed ``tool_calls`` before it runs, the count the ``max_tool_calls``
    guard reads before the next model call, so a restart keeps what was spent. Without that guard
    nothing is counted (None), and no transaction is spent on it."""
    limit = cfg.guards.max_tool_calls
    if limit is None:
        return None

    def refusal() -> str | None:
        run = live.record.current_run
        if run is None or run["run_id"] != run_id:
            return "the run has ended"
        return cfg.guards.calls_used_up() if run["tool_calls"] >= limit else None

    async def spend() -> str | None:
        async with live.spending:  # read and increment as one: a program's calls run in parallel
            if (why := refusal()) is not None:
                return why
            async with engine._tx(live) as tx:
                if (why := refusal()) is not None:  # the run changed while the transaction began
                    return why
                run = live.record.current_run
                assert run is not None
                await tx.set_run({**run, "tool_calls": run["tool_calls"] + 1})
        return None

    return spend


async def record(engine: ProcessEngine, live: _Live, run_id: str, row: ToolCallRow, result: ToolResultMessage) -> None:
    """Settle a finished call; the call that completes its batch also ingests the batch."""
    status: CallStatus = "failed" if result.is_error else "completed"
    async with engine._tx(live) as tx:
        run = live.record.current_run
        if run is None or run["run_id"] != run_id:  # a late result of an ended run
            await settle(engine, tx, row, result, status, ("dispatched",))
            return
        rows = await engine.store.calls(live.record.pid, run_id)
        mine = next((r for r in rows if r.dispatch_id == row.dispatch_id), None)
        if mine is None or mine.status != "dispatched":
            return  # settled already (a deadline, an abort): this result is late
        if not all(r.terminal for r in rows if r is not mine):
            await settle(engine, tx, row, result, status, ("dispatched",))
            return
        # the last result of the batch: the batch is ingested now and its rows deleted, so the
        # status is settled in memory only
        await settle(engine, tx, mine, result, status, ("dispatched",), fresh=True)
        await ingest(engine, tx, live, run, rows)
    await post_turn(engine, live, run_id, run["turn"])


async def ingest(engine: ProcessEngine, tx: _Tx, live: _Live, run: dict[str, Any], rows: list[ToolCallRow]) -> None:
    """Every call of the batch is terminal: its results enter the history, in the model's order,
    its failures and repeated results counted with the run (``loop/retries.py``, as the in-memory
    runner counts them)."""
    stored = [message_from_dict(r.result) for r in rows if r.result is not None]
    failures = dict(run.get("failures") or {})
    repeats = dict(run.get("repeats") or {})
    results = [m for m in stored if isinstance(m, ToolResultMessage)]
    # the run's own tools (hooks' included), as its calls ran with: which of them are polls
    cfg = live.config[1] if live.config is not None and live.config[0] == run["run_id"] else engine.config
    calls = [call_of(r) for r in rows]
    noted, failing, repeating = count_repeats(
        failures, repeats, calls, results, not_counted=NOT_COUNTED, tools=cfg.tools
    )
    await tx.append(run["run_id"], [*noted])
    await end_batch(engine, tx, live, run["run_id"])
    after = {**run, "generation": run["generation"] + 1, "turn": run["turn"] + 1}
    after.pop("added", None)  # (the batch is over: no call left for the hooks' tools to run)
    if failures:
        after["failures"] = failures
    if failing:
        after["failing"] = True
    if repeats:
        after["repeats"] = repeats
    else:
        after.pop("repeats", None)  # (a poll ended the streak)
    if repeating:
        after["repeating"] = True
    await tx.set_run(after)
    await tx.signal(sig.CHANGED, changes=["messages"])


async def post_turn(engine: ProcessEngine, live: _Live, run_id: str, turn: int) -> None:
    """The ``post_turn`` hooks, as the in-memory runner calls them after each turn (a failing
    one is logged). The hooks are the shared configuration's; the prompt and tools the run's.
    A hook's ``Stop`` is a gentle stop of this run, through the same path as ``Process.stop`` (so
    it is kept with the run's record, and a run that has ended meanwhile is left alone). What the
    hooks report (``TurnInfo.emit``: ``ToolRetry``'s episode) is logged as signals (``retry_signal``)
    in a transaction of its own, before that stop; a hook that reports nothing costs none."""
    hooks = engine.config.hooks
    if "post_turn" not in hooks.phases:
        return
    cfg = live.config[1] if live.config is not None and live.config[0] == run_id else engine.config
    told: list[LoopEvent] = []
    info = TurnInfo(
        run_id, turn, live.history, cfg.system_prompt, cfg.tool_specs, conversation=live.record.pid, emit=told.append
    )
    stop = await hooks.run_phase("post_turn", info)
    logged = [s for s in map(retry_signal, told) if s is not None]
    if logged and not live.lost:
        try:
            async with engine._tx(live) as tx:
                for name, payload in logged:
                    await tx.signal(name, runId=run_id, **payload)
        except Exception as exc:  # a report: its failure must not fail the step, nor skip the stop
            if isinstance(exc, LeaseLost):  # (the driver lets go of the process)
                raise
            log.warning("process %s: the tool retry episode was not logged: %s", live.record.pid, exc)
    if stop is not None:
        await engine.stop(live.record.pid, run_id)


def retry_signal(event: LoopEvent) -> tuple[str, dict[str, Any]] | None:
    """The signal a durable process logs for a ``ToolRetry`` event, its fields in camelCase (the
    call's id and tool as ``proc.run.tool.*`` name them); None for any other event."""
    if isinstance(event, ToolRetryScheduled):
        return sig.TOOL_RETRY_SCHEDULED, {
            "callId": event.tool_call_id,
            "name": event.tool_name,
            "errorClass": event.error_class,
            "roundsLeft": event.rounds_left,
            "classLeft": event.class_left,
            "toolLeft": event.tool_left,
            "signatureLeft": event.signature_left,
        }
    if isinstance(event, ToolRetryResolved):
        return sig.TOOL_RETRY_RESOLVED, {"failures": event.failures, "rounds": event.rounds}
    if isinstance(event, ToolRetryExhausted):
        return sig.TOOL_RETRY_EXHAUSTED, {
            "callId": event.tool_call_id,
            "name": event.tool_name,
            "errorClass": event.error_class,
            "budget": event.budget,
            "limit": event.limit,
            "reason": event.reason,
        }
    return None


async def settle(
    engine: ProcessEngine,
    tx: _Tx,
    row: ToolCallRow,
    result: ToolResultMessage,
    status: CallStatus,
    expect: tuple[CallStatus, ...],
    *,
    fresh: bool = False,
) -> bool:
    """Record a call's terminal result, unless it was settled already (a late result). A
    ``fresh`` row is one this transaction is about to insert, or to delete: only its copy in
    memory changes."""
    stored = message_to_dict(result)
    if fresh:
        row.status, row.result, ok = status, stored, True
    else:
        ok = await engine.store.set_call_status(row.dispatch_id, status, expect=expect, result=stored)
    if ok:
        await signal_finished(tx, row, result.text, error=result.is_error)
    return ok


async def signal_finished(tx: _Tx, row: ToolCallRow, text: str, *, error: bool) -> None:
    """Log ``proc.run.tool.finished`` for a call: its output, or its error."""
    payload: dict[str, Any] = {
        "runId": row.run_id,
        "callId": row.tool_call_id,
        "name": row.tool_name,
        "syscall": row.syscall,
        "ok": not error,
    }
    payload["error" if error else "output"] = text
    await tx.signal(sig.TOOL_FINISHED, **payload)


def _syscall(call: ToolCall, tools: Mapping[str, Tool]) -> str:
    """What the approval policy matches a call against (``syscall_of``; an unknown tool's name)."""
    tool = tools.get(call.name)
    return syscall_of(tool, call.arguments) if tool is not None else SYSCALLS.get(call.name, f"tool.{call.name}")


def _runs_alone(cfg: LoopConfig, row: ToolCallRow) -> bool:
    """Whether a call runs with no other call of its batch in flight."""
    if cfg.tool_execution == "sequential":
        return True
    tool = cfg.tools.get(row.tool_name)
    return tool is not None and tool.sequential


def _ended(pid: str, task: asyncio.Task[None]) -> None:
    """A tool's task is over: a failure of its own (the store gone while its result was recorded:
    the database cut off, the runtime closing) is said here in one line, not left to the event
    loop's "Task exception was never retrieved". The call stays open in the store: the run
    resumes from there (a restart, or the worker that takes the process over)."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.warning(
            "process %s: %s ended without its result recorded: %s: %s", pid, task.get_name(), type(exc).__name__, exc
        )


def _drop_task(tasks: dict[str, asyncio.Task[None]], key: str, task: asyncio.Task[None]) -> None:
    """Forget a finished tool task (one cancelled before it started never reaches its own cleanup)."""
    if tasks.get(key) is task:
        del tasks[key]


def results_of(rows: list[ToolCallRow], open_text: str) -> list[Message]:
    """One result per call of a batch, in the model's order: the stored one, or an error for an open call."""
    return [
        message_from_dict(r.result) if r.terminal and r.result is not None else tool_error_result(call_of(r), open_text)
        for r in rows
    ]


def _last_assistant(history: list[Message]) -> AssistantMessage | None:
    for msg in reversed(history):
        if isinstance(msg, AssistantMessage):
            return msg
        if not isinstance(msg, ToolResultMessage | SystemMessage):
            return None
    return None


def _state_for(live: _Live, run_id: str) -> RunState:
    offered: frozenset[str] | None = None
    if live.offered is not None and live.offered[0] == run_id:
        offered = live.offered[1]
    else:  # (after a restart or a takeover: the run's record keeps what its turn was shown)
        run = live.record.current_run
        kept = run.get("offered") if run is not None and run.get("run_id") == run_id else None
        offered = frozenset(kept) if kept is not None else None
    return RunState(
        run_id=run_id, messages=live.history, first_new=len(live.history), offered=offered, conversation=live.record.pid
    )
