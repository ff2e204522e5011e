"""Running the tool calls of one model turn.

Per call, in the model's order: look the tool up, validate its arguments, ask the
before-tool-call hooks. Calls that pass run concurrently (up to ``max_concurrency``), each under
its own timeout; a ``sequential`` tool is a barrier that runs alone. After-tool-call hooks see
each result as it finishes. Results are returned in the model's order, whatever order the tools
finished in. Every failure (unknown tool, bad arguments, exception, timeout, block) becomes an
error result for the model; nothing here raises except cancellation.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, cast

from agentloop.events import (
    LoopEvent,
    ToolExecutionEnd,
    ToolExecutionStart,
    ToolExecutionUpdate,
)
from agentloop.loop.guards import CALLS_USED_UP
from agentloop.loop.hooks import ToolCallInfo
from agentloop.loop.state import LoopConfig, RunState
from agentloop.messages import AssistantMessage, ToolCall, ToolResultMessage, tool_error_result
from agentloop.tools.base import (
    ALLOW,
    CallBudget,
    NestedCheck,
    NestedVerdict,
    Tool,
    ToolContext,
    ToolError,
    ToolResult,
    not_offered,
)
from agentloop.tools.builtin import syscall_of
from agentloop.tools.jobs import JobTable

log = logging.getLogger("agentloop.tools")

Emit = Callable[[LoopEvent], None] | None

SKIPPED = "Skipped due to queued user message."
CANCELLED = "Tool call cancelled: the run was aborted."
#: results that are no failure of the model's (``loop/retries.py`` does not count them)
NOT_COUNTED = frozenset({SKIPPED, CANCELLED, CALLS_USED_UP})


@dataclass(slots=True)
class _Prepared:
    call: ToolCall
    tool: Tool
    info: ToolCallInfo


def _check(
    cfg: LoopConfig, state: RunState, message: AssistantMessage, call: ToolCall
) -> _Prepared | ToolResultMessage:
    """Look the tool up and validate the arguments: a prepared call, or its error result."""
    botched = malformed(call, message)
    if botched is not None:
        return botched
    tool = cfg.tools.get(call.name)
    if tool is None:
        return tool_error_result(call, f"Tool {call.name} not found")
    if state.offered is not None and call.name not in state.offered:
        return tool_error_result(call, not_offered(call.name))
    try:
        args = tool.validate(call.arguments)
    except ToolError as exc:
        return tool_error_result(call, str(exc))
    except Exception as exc:  # a validator's own bug (pydantic passes a TypeError through): the call's failure
        log.debug("validating the arguments of %s raised", call.name, exc_info=True)
        return tool_error_result(call, f"Invalid arguments for {call.name}: {type(exc).__name__}: {exc}")
    info = ToolCallInfo(
        call, args, message, state.messages, state.run_id, syscall_of(tool, args), conversation=state.conversation
    )
    return _Prepared(call, tool, info)


def malformed(call: ToolCall, message: AssistantMessage) -> ToolResultMessage | None:
    """The error result of a call whose arguments were not a JSON object (``invalid_arguments``),
    saying what to do about it; None for a call whose arguments parsed."""
    raw = call.invalid_arguments
    if raw is None:
        return None
    if message.stop_reason == "length":
        why = (
            "were cut off by the output token limit before they were complete;"
            " make the call smaller (a long text can be written in parts)"
        )
    else:
        try:
            json.loads(raw)
            why = "are not a JSON object; call it again with an object of named arguments"
        except (ValueError, RecursionError) as exc:
            why = f"are not valid JSON ({exc}); call it again with a JSON object"
    shown = raw if len(raw) <= 200 else raw[:200] + "…"
    return tool_error_result(call, f"The arguments of this {call.name} call {why}. They were: {shown}")


async def _ask_hooks(cfg: LoopConfig, p: _Prepared) -> _Prepared | ToolResultMessage:
    try:
        block = await cfg.hooks.run_before(p.info)
    except Exception as exc:
        return tool_error_result(p.call, f"before-tool-call hook failed: {exc}")
    return p if block is None else tool_error_result(p.call, block.reason)


def nested_check(cfg: LoopConfig, p: _Prepared, first: NestedCheck | None = None) -> NestedCheck:
    """How calls that the tool of ``p`` makes itself (CodeMode's) are approved: ``first`` (the
    durable runner's policy), then the before-tool-call hooks, given the nested call as if the
    model had made it (with ``parent`` set), so an approval hook judges it like a direct call."""
    count = 0

    async def check(syscall: str, tool_name: str, args: dict[str, Any]) -> NestedVerdict:
        nonlocal count
        if first is not None:
            verdict = await first(syscall, tool_name, args)
            if verdict.action != "allow":
                return verdict
        if not cfg.hooks.before:
            return ALLOW
        count += 1
        call = ToolCall(id=f"{p.call.id}.{count}", name=tool_name, arguments=args)
        info = ToolCallInfo(
            call,
            args,
            p.info.assistant_message,
            p.info.messages,
            p.info.run_id,
            syscall=syscall,
            parent=p.call,
            conversation=p.info.conversation,
        )
        try:
            block = await cfg.hooks.run_before(info)
        except Exception as exc:
            return NestedVerdict("deny", f"before-tool-call hook failed: {exc}")
        return ALLOW if block is None else NestedVerdict("deny", block.reason)

    return check


def memory_budget(cfg: LoopConfig, state: RunState) -> CallBudget | None:
    """The in-memory runner's budget for calls a tool makes itself (CodeMode's): each one adds to
    ``state.tool_calls``, the count the ``max_tool_calls`` guard reads before the next model call,
    and none runs once it is used up. Without that guard nothing is counted (None)."""
    limit = cfg.guards.max_tool_calls
    if limit is None:
        return None

    async def spend() -> str | None:
        if state.tool_calls >= limit:
            return cfg.guards.calls_used_up()
        state.tool_calls += 1
        return None

    return spend


async def _execute(
    cfg: LoopConfig,
    state: RunState,
    p: _Prepared,
    emit: Emit,
    nested: NestedCheck | None = None,
    budget: CallBudget | None = None,
    call_key: str | None = None,
    background: Callable[[Coroutine[Any, Any, str], str], None] | None = None,
    jobs: JobTable | None = None,
    keep_in: str | None = None,
) -> ToolResultMessage:
    """Run one checked call under its timeout. ``nested`` is the durable runner's policy check for
    calls the tool makes itself (the in-memory runner's policy is a hook); ``budget`` counts those
    calls against the run's ``max_tool_calls`` (each runner keeps its own count); ``call_key``,
    ``background`` and ``jobs`` as in ``ToolContext``. A result cut for its length is kept whole
    beneath ``keep_in`` (default: the run's workspace; none without one), where the Read tool finds
    it (``ToolResult.capped_keeping``), unless the tool says its result must not be
    (``Tool.keeps_result_of``: an account's own tool, a device's, a view of a file already there)."""
    call, tool = p.call, p.tool
    timeout = tool.timeout if tool.timeout is not None else cfg.tool_timeout
    check = nested_check(cfg, p, nested)
    ctx = ToolContext(
        call.id,
        call.name,
        cfg.workspace,
        tools=cfg.tools,
        check=check,
        run_id=p.info.run_id,
        budget=budget,
        off_limits=cfg.off_limits,
        offered=state.offered,
        call_key=call_key,
        metadata=state.metadata,
        background=background,
        jobs=jobs,
        # (when ``_within`` below cuts it: it starts its clock just after this one)
        deadline=None if timeout is None else asyncio.get_running_loop().time() + timeout,
    )
    if emit is not None:

        def update(partial: Any) -> None:
            emit(ToolExecutionUpdate(tool_call_id=call.id, tool_name=call.name, partial_result=partial))

        ctx.update = update
    try:
        if timeout is None or not tool.interruptible:  # an inline sync tool cannot be interrupted anyway
            result = await tool.run(p.info.args, ctx)
        else:
            result = await _within(timeout, tool.run(p.info.args, ctx), call)
    except ToolError as exc:
        result = ToolResult.error(str(exc))
    except _TimedOut:  # (a tool's own TimeoutError, a socket's, is its failure: reported below)
        result = ToolResult.error(f"Tool {call.name} timed out after {timeout:g} s")
    except Exception as exc:
        result = _raised(call, exc)
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is None or task.cancelling():  # an abort (or the caller's cancel): stop now
            raise
        # the tool awaited work that was cancelled elsewhere: its failure, not the run's
        result = _raised(call, exc)
    if cfg.hooks.after:
        try:
            result = await cfg.hooks.run_after(p.info, result)
        except Exception as exc:
            result = ToolResult.error(f"after-tool-call hook failed: {exc}")
    limit = tool.max_result_chars
    if limit is not None and result.too_long(limit):  # (checked first: nearly every result fits, and costs no await)
        where = (keep_in or cfg.workspace) if tool.keeps_result_of(p.info.args) else None
        result = await result.capped_keeping(limit, where)
    return result.to_message(call.id, call.name)


# how long a tool whose timeout fired is given to end once cancelled; one that is still running
# then (it caught the cancellation and went on) is left behind, so that it cannot hold its run
TIMEOUT_GRACE = 2.0
_abandoned: set[asyncio.Task[Any]] = set()  # (the loop keeps only weak references to tasks)


@dataclass(slots=True)
class _Waiter:
    """A task waiting in ``_within`` for ``tool``, the task it runs the tool in (set once made)."""

    task: asyncio.Task[Any]
    tool: asyncio.Task[Any] | None = None


# what a tool that stops its own run (an interrupt, a reset) spares along with itself
# (``own_tasks``): for each tool running under a timeout around the current task (``_within``,
# outermost first, nested calls included), the task waiting for it and the tool's own task. The
# variable is copied into every task the tool starts, and into every callback it schedules, which
# may outlive the call: a waiter counts only while the tool it waits for is still running, else
# a watchdog the tool left behind could never abort the run it had once been called from.
_WAITING: ContextVar[tuple[_Waiter, ...]] = ContextVar("agentloop_tool_waiters", default=())


def own_tasks() -> frozenset[asyncio.Task[Any]]:
    """The current task and, while it runs (or is called from) a tool under a timeout that has not
    ended yet, the tasks waiting for that tool (each call's, a nested call's): cancelling one of
    those would cancel the tool itself."""
    me = asyncio.current_task()
    waiting = (w.task for w in _WAITING.get() if w.tool is not None and not w.tool.done())
    return frozenset(waiting if me is None else (me, *waiting))


class _TimedOut(Exception):
    """A call's timeout fired (not a ``TimeoutError`` of the tool's own)."""


async def _within(seconds: float, work: Coroutine[Any, Any, ToolResult], call: ToolCall) -> ToolResult:
    """``work``'s result if it ends within ``seconds``. Past that it is cancelled, and
    given ``TIMEOUT_GRACE`` seconds to end: a result it gives then (a tool that caught the
    cancellation to report what it had) is kept, and an end by cancellation or error is
    ``_TimedOut``. One still running is left behind (``_TimedOut`` too, its late result dropped):
    a tool that swallows the cancellation and carries on has no say in when its run goes on.

    The tool runs in a task of its own for that, so that it can be left behind. Cancelling the
    caller (an abort) cancels it and waits for its end, as when it ran inline: the abort's own
    grace (the engine's) decides how long. Whatever the tool's task ends with is retrieved in
    every case (``_ended``): an error it raised while being cancelled by an abort is nobody's
    to report, and must not be logged as an exception never retrieved."""
    waiter = _Waiter(cast("asyncio.Task[Any]", asyncio.current_task()))  # (awaited: always in a task)
    waiting = _WAITING.set((*_WAITING.get(), waiter))
    try:
        task = asyncio.ensure_future(work)  # (it copies the context: the tool sees who waits for it)
    finally:
        _WAITING.reset(waiting)
    waiter.tool = task
    task.add_done_callback(_ended)
    try:
        await asyncio.wait((task,), timeout=seconds)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.wait((task,), timeout=TIMEOUT_GRACE)
    except asyncio.CancelledError:
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
        raise
    if not task.done():
        log.warning(
            "tool %s (%s) ignored its timeout's cancellation: left running, its result dropped", call.name, call.id
        )
        _abandoned.add(task)
        task.add_done_callback(_abandoned.discard)
    elif not task.cancelled() and task.exception() is None:
        return task.result()
    raise _TimedOut


def _ended(task: asyncio.Task[Any]) -> None:
    """A tool's task ended: its error is marked retrieved (``_within`` reports what it must from
    the task itself). A tool left behind, or cancelled by an abort, may end with one nobody
    waits for any more: it is logged quietly."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("tool task %s ended with an error", task.get_name(), exc_info=task.exception())


def _raised(call: ToolCall, exc: BaseException) -> ToolResult:
    """The error result of a tool that raised ``exc``: its type and message, for the model."""
    log.debug("tool %s raised", call.name, exc_info=exc)
    return ToolResult.error(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def _finish(state: RunState, msg: ToolResultMessage, emit: Emit) -> ToolResultMessage:
    state.results[msg.tool_call_id] = msg
    if emit is not None:
        emit(
            ToolExecutionEnd(tool_call_id=msg.tool_call_id, tool_name=msg.tool_name, result=msg, is_error=msg.is_error)
        )
    return msg


async def run_tool_calls(
    cfg: LoopConfig,
    state: RunState,
    message: AssistantMessage,
    calls: list[ToolCall],
    emit: Emit,
    budget: int | None = None,
) -> list[ToolResultMessage]:
    """Run ``calls`` and return one result per call, in the model's order.

    ``budget`` caps how many calls may run (the rest get an error result); the caller has counted
    those in ``state.tool_calls`` already, and the calls the tools make themselves (CodeMode's) add
    to it as they go. Finished results are also recorded in ``state.results`` as they come, so an
    abort can keep them; on abort every other call gets its "cancelled" result here, with its
    ``tool_execution_end`` (and the start of a call not announced yet), so the events of the batch
    stay paired.
    """
    state.results = {}
    spend = memory_budget(cfg, state)
    prepared: list[_Prepared] = []
    sequential_mode = cfg.tool_execution == "sequential"
    steered = False
    announced = 0  # calls whose tool_execution_start went out
    try:
        for i, call in enumerate(calls):
            if emit is not None:
                emit(ToolExecutionStart(tool_call_id=call.id, tool_name=call.name, args=call.arguments))
            announced = i + 1
            if steered:
                _finish(state, tool_error_result(call, SKIPPED), emit)
                continue
            if budget is not None and i >= budget:
                _finish(state, tool_error_result(call, CALLS_USED_UP), emit)
                continue
            p = _check(cfg, state, message, call)
            if cfg.hooks.before and isinstance(p, _Prepared):
                p = await _ask_hooks(cfg, p)
            if isinstance(p, ToolResultMessage):
                _finish(state, p, emit)
            elif sequential_mode:
                _finish(state, await _execute(cfg, state, p, emit, budget=spend), emit)
                steered = bool(state.steering)
            else:
                prepared.append(p)
        if prepared and state.steering:
            for p in prepared:  # the user spoke while we prepared: do not run what is now stale
                _finish(state, tool_error_result(p.call, SKIPPED), emit)
            prepared = []
        if len(prepared) == 1:
            _finish(state, await _execute(cfg, state, prepared[0], emit, budget=spend), emit)
        elif prepared:
            await _run_concurrently(cfg, state, prepared, emit, spend)
    except asyncio.CancelledError:
        if state.aborted:
            _cancel_rest(state, calls, announced, emit)
        raise
    return [state.results[c.id] for c in calls]


def _cancel_rest(state: RunState, calls: list[ToolCall], announced: int, emit: Emit) -> None:
    """Give every call of an aborted batch without a result its terminal "cancelled" result, in
    the model's order; the first ``announced`` calls had their start event already."""
    for i, call in enumerate(calls):
        if call.id in state.results:
            continue
        if emit is not None and i >= announced:
            emit(ToolExecutionStart(tool_call_id=call.id, tool_name=call.name, args=call.arguments))
        _finish(state, tool_error_result(call, CANCELLED), emit)


async def _run_concurrently(
    cfg: LoopConfig, state: RunState, prepared: list[_Prepared], emit: Emit, spend: CallBudget | None
) -> None:
    limit = asyncio.Semaphore(max(1, cfg.max_concurrency))

    async def one(p: _Prepared) -> None:
        async with limit:
            _finish(state, await _execute(cfg, state, p, emit, budget=spend), emit)

    group: list[_Prepared] = []
    for p in prepared:
        if p.tool.sequential:
            if group:
                await asyncio.gather(*(one(q) for q in group))
                group = []
            await one(p)
        else:
            group.append(p)
    if group:
        await asyncio.gather(*(one(q) for q in group))
