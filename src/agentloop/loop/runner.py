"""The in-memory runner: execute ``decide``'s decisions until the run finishes.

Abort is task cancellation: the caller sets ``state.aborted`` and cancels the task running
``run_loop``. The runner then closes the books so the history stays valid for every provider:
the message being streamed is kept (stop reason ``aborted``) and every tool call without a
result gets a terminal "cancelled" result.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from agentloop.events import (
    AgentEnd,
    AgentStart,
    LoopEvent,
    MessageEnd,
    MessageStart,
    ModelRetry,
    TurnEnd,
    TurnStart,
    WindowContinued,
)
from agentloop.loop.execute import CANCELLED, NOT_COUNTED, run_tool_calls
from agentloop.loop.guards import STOPPED
from agentloop.loop.hooks import TurnInfo
from agentloop.loop.model_call import call_model, with_bundles
from agentloop.loop.retries import count_repeats, repeated
from agentloop.loop.state import (
    CallModel,
    Finish,
    LoopConfig,
    QueueMode,
    RunState,
    RunTools,
    decide,
    unresolved_calls,
)
from agentloop.loop.windows import next_window
from agentloop.messages import (
    AssistantMessage,
    Message,
    ToolCall,
    ToolResultMessage,
    system,
    tool_error_result,
)
from agentloop.models.overflow import is_context_overflow
from agentloop.tools.base import Tool

Emit = Callable[[LoopEvent], None] | None


def _inject(state: RunState, message: Message, emit: Emit) -> None:
    state.append(message)
    if emit is not None:
        emit(MessageStart(message=message))
        emit(MessageEnd(message=message))


def _take(state: RunState, queue: deque[Message], mode: QueueMode, emit: Emit) -> None:
    """Inject queued input before a model call: one message, or (``all``) everything queued, in order."""
    _inject(state, queue.popleft(), emit)
    if mode == "all":
        while queue:
            _inject(state, queue.popleft(), emit)


def _strip_tool_calls(message: AssistantMessage) -> None:
    """A model that calls tools in its tools-disabled final round: keep its words, drop the calls."""
    message.content = [b for b in message.content if not isinstance(b, ToolCall)]
    message.stop_reason = "stop"


async def run_loop(cfg: LoopConfig, state: RunState, emit: Emit, prompts: list[Message]) -> str:
    """Run until finished; return the stop reason. ``prompts`` are appended first."""
    if emit is not None:
        emit(AgentStart(run_id=state.run_id))
        emit(TurnStart(turn=state.turn))
    for p in prompts:
        _inject(state, p, emit)
    new_turn = False  # a turn ended; the next model call opens another
    guards_active = cfg.guards.active
    compacts = "compact_context" in cfg.hooks.phases  # (a ``Compaction`` piece; none: no cost)
    added: dict[str, Tool] = {}  # tools a pre_tool_materialization hook added (a bundle): callable from then on
    try:
        while True:
            if state.aborted:  # aborted from inside the run's own task (a hook, an inline tool)
                _close_after_abort(state, emit)
                return "aborted"
            steering, follow_up = state.steering, state.follow_up
            decision = decide(state.messages, has_input=bool(steering or follow_up), guard=state.guard)

            if isinstance(decision, Finish):
                if state.aborted:
                    return "aborted"
                if decision.reason == "error":
                    last = state.messages[-1]
                    state.error = (last.error_message if isinstance(last, AssistantMessage) else None) or (
                        "unknown error"
                    )
                    _inject(state, system(f"The run failed: {state.error}", "error"), emit)
                return decision.reason

            if isinstance(decision, RunTools):
                calls = decision.calls
                limit = cfg.guards.max_tool_calls
                budget = None if limit is None else max(0, limit - state.tool_calls)
                # the model's calls count before they run: what the tools call themselves counts on top
                state.tool_calls += len(calls) if budget is None else min(len(calls), budget)
                state.phase = "tools"
                results = await run_tool_calls(cfg, state, decision.message, calls, emit, budget)
                state.phase = "idle"
                results, failing, repeating = count_repeats(
                    state.failures, state.repeats, calls, results, not_counted=NOT_COUNTED, tools=cfg.tools
                )
                state.failing = state.failing or failing
                state.repeating = state.repeating or repeating
                for r in results:
                    _inject(state, r, emit)
                state.results = {}
                await _end_turn(cfg, state, decision.message, results, emit)
                new_turn = True
                continue

            assert isinstance(decision, CallModel)
            if new_turn:
                state.turn += 1
                if emit is not None:
                    emit(TurnStart(turn=state.turn))
                new_turn = False
            if steering:  # queued input goes first: steering at any boundary, follow-up at the end
                _take(state, steering, cfg.steering_mode, emit)
            elif follow_up and isinstance(state.messages[-1], AssistantMessage):
                _take(state, follow_up, cfg.follow_up_mode, emit)
            tools_enabled = decision.tools_enabled and state.mode == "agent" and bool(cfg.tools)
            if tools_enabled:
                tripped = repeated(state.failing, state.repeating) or (STOPPED if state.stopping else None)
                if tripped is None and guards_active:
                    elapsed = time.monotonic() - state.started
                    tripped = cfg.guards.tripped(state.rounds, state.tool_calls, elapsed, state.usage)
                    tripped = tripped or _next_window(cfg, state, emit)
                if tripped:
                    state.guard, tools_enabled = tripped, False
                    _inject(state, system(cfg.guards.final_instruction(tripped), "guard"), emit)
                else:
                    state.rounds += 1
            state.phase = "model"
            if compacts:
                await _compact(cfg, state, tools_enabled, emit, overflow=False)
            reply = await call_model(cfg, state, tools_enabled, emit, None, added)
            if compacts and is_context_overflow(reply, cfg.model.info.context_window):
                reply = await _compact_and_retry(cfg, state, tools_enabled, emit, reply, added)
            if added:  # (this run's configuration only)
                cfg = with_bundles(cfg, added)
                added.clear()
            state.phase = "idle"
            state.usage.add(reply.usage)
            has_calls = reply.stop_reason == "toolUse" or bool(reply.tool_calls)
            if has_calls and not tools_enabled:
                _strip_tool_calls(reply)
                has_calls = False
            state.append(reply)
            if not has_calls:
                await _end_turn(cfg, state, reply, [], emit)
                new_turn = True
    except asyncio.CancelledError:
        if not state.aborted:
            raise
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()
        _close_after_abort(state, emit)
        return "aborted"


def _next_window(cfg: LoopConfig, state: RunState, emit: Emit) -> str | None:
    """Count the run into its execution window (``loop/windows.py``, which the durable runner
    shares); a window used up opens the next (``window_continued``). The guard that ends the run
    when no next window may open, or None."""
    state.window, tripped, boundary = next_window(
        cfg.guards, state.window, state.rounds, state.tool_calls, state.messages
    )
    if boundary is not None and emit is not None:
        emit(WindowContinued(window=boundary.window, rounds=boundary.rounds, tool_calls=boundary.tool_calls))
    return tripped


async def _compact(cfg: LoopConfig, state: RunState, tools_enabled: bool, emit: Emit, *, overflow: bool) -> bool:
    """Let the ``compact_context`` hooks replace the history before a model call; whether they did.
    They report a compaction on the run's events (``emit``) themselves: only they know whether
    one is due, and it starts before their summary call.

    The history is replaced in place (the list is the run's ``messages``). The run's new messages
    stay its new ones where the replacement kept them as they were, at its end; where it folded
    some of them into the summary, the run's new messages are the whole compacted history, which
    then starts with the summary that stands for them.
    """
    history = state.messages
    tools = cfg.tool_specs if tools_enabled else []
    if tools and state.offered is not None:  # a hook (``ToolReveal``) narrowed the last call's list:
        # measure the tools a call is shown, not a catalogue kept hidden to save that very room
        tools = [spec for spec in tools if spec.name in state.offered]
    info = TurnInfo(
        state.run_id,
        state.turn,
        history,
        cfg.system_prompt,
        tools,
        overflow=overflow,
        usage=state.usage,
        conversation=state.conversation,
        emit=emit,
    )
    await cfg.hooks.run_phase("compact_context", info)
    new = info.messages
    if new is history:
        return False
    added = len(history) - state.first_new  # this run's messages so far
    first = len(new) - added
    if first < 0 or (added and new[first] is not history[state.first_new]):
        first = 0
    history[:] = new
    state.first_new = first
    return True


async def _compact_and_retry(
    cfg: LoopConfig,
    state: RunState,
    tools_enabled: bool,
    emit: Emit,
    reply: AssistantMessage,
    added: dict[str, Tool] | None = None,
) -> AssistantMessage:
    """After a call the provider refused as too long (or cut short without saying so): compact and
    make the call once more, as a durable process does. The refused reply is not kept (what it
    used is counted); it stays the answer where nothing was compacted. The second call's answer
    is final: refused again, it ends the run with that error."""
    if state.aborted:
        return reply
    try:
        compacted = await _compact(cfg, state, tools_enabled, emit, overflow=True)
    except asyncio.CancelledError:  # aborted while the summary was written: the run ends here
        state.usage.add(reply.usage)  # (and the refused reply, billed, is not returned to be counted)
        raise
    if not compacted:
        return reply
    state.usage.add(reply.usage)
    if emit is not None:  # as a failed attempt: shown (its message_end went out), then the retry
        error = reply.error_message or "the context overflowed"
        model = f"{reply.provider}:{reply.model}" if reply.provider else cfg.model.name  # (a fallback's)
        emit(ModelRetry(attempt=1, delay=0.0, error=error, model=model))
    return await call_model(cfg, state, tools_enabled, emit, None, added)


async def _end_turn(
    cfg: LoopConfig, state: RunState, message: AssistantMessage, results: list[ToolResultMessage], emit: Emit
) -> None:
    if emit is not None:
        emit(TurnEnd(turn=state.turn, message=message, tool_results=results))
    if "post_turn" in cfg.hooks.phases:
        info = TurnInfo(
            state.run_id,
            state.turn,
            state.messages,
            cfg.system_prompt,
            cfg.tool_specs,
            conversation=state.conversation,
            emit=emit,
        )
        if await cfg.hooks.run_phase("post_turn", info) is not None:  # a ``Stop``: as ``Run.stop``
            state.stopping = True


def _close_after_abort(state: RunState, emit: Emit) -> None:
    """Close the books after an abort; a turn the abort cut short (in the model or the tools
    phase) ends with its ``turn_end``, so a consumer sees every start matched."""
    phase, state.phase = state.phase, "idle"
    partial = state.partial
    if phase == "model":  # aborted while the model was streaming (or before it started)
        announced = partial is not None  # its message_start went out when the stream started
        if partial is None:
            partial = AssistantMessage()
        partial.content = [b for b in partial.content if not isinstance(b, ToolCall)]
        partial.stop_reason = "aborted"
        partial.error_message = "aborted"
        state.partial = None
        state.append(partial)
        state.usage.add(partial.usage)  # what the provider reported before the abort was billed
        if emit is not None:
            if not announced:
                emit(MessageStart(message=partial))
            emit(MessageEnd(message=partial))
            emit(TurnEnd(turn=state.turn, message=partial, tool_results=[]))
        return
    assistant, pending = unresolved_calls(state.messages)
    if assistant is None or not pending:
        return
    results: list[ToolResultMessage] = []
    for call in pending:  # keep what finished, cancel the rest, in the model's order
        done: ToolResultMessage | None = state.results.get(call.id)
        results.append(done or tool_error_result(call, CANCELLED))
        _inject(state, results[-1], emit)
    state.results = {}
    if emit is not None and phase == "tools":
        emit(TurnEnd(turn=state.turn, message=assistant, tool_results=results))


def finish_event(state: RunState, reason: str, error: str | None) -> AgentEnd:
    return AgentEnd(
        run_id=state.run_id,
        messages=state.new_messages,
        stop_reason=reason,
        error=error,
        usage=state.usage,
    )
