"""One model turn: build the request, stream the answer, retry what is transient, fall back.

Transient failures (rate limit, 5xx, broken connection) are retried with backoff, honouring the
provider's ``retry-after``; when a model keeps failing, the configured fallbacks are tried in
order. A failed attempt is shown (``message_end`` with the error, then ``model_retry``, also given
to ``on_retry`` before the wait) but does not enter the history. The returned message is final:
``done``, or the last error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from agentloop.events import (
    LoopEvent,
    MessageEnd,
    MessageStart,
    MessageUpdate,
    ModelRetry,
    StreamDone,
    StreamError,
    StreamStart,
)
from agentloop.loop.hooks import TurnFailed, TurnInfo
from agentloop.loop.state import LoopConfig, RunState
from agentloop.messages import AssistantMessage, Message
from agentloop.models.base import Model, ModelRequest

Emit = Callable[[LoopEvent], None] | None
OnRetry = Callable[[ModelRetry], Awaitable[None]] | None


def build_request(
    cfg: LoopConfig, messages: list[Message], tools_enabled: bool, conversation: str | None = None
) -> ModelRequest:
    return ModelRequest(
        system_prompt=cfg.system_prompt,
        messages=messages,
        tools=cfg.tool_specs if tools_enabled else [],
        max_tokens=cfg.max_tokens,
        temperature=cfg.temperature,
        reasoning=cfg.reasoning,
        parallel_tool_calls=cfg.tool_execution == "parallel",
        cache_key=conversation,
    )


async def _turn_phases(cfg: LoopConfig, state: RunState, request: ModelRequest) -> None:
    """Let the turn-phase hooks shape this call's system prompt and tool list."""
    info = TurnInfo(state.run_id, state.turn, request.messages, request.system_prompt, request.tools)
    hooks = cfg.hooks
    await hooks.run_phase("pre_policy", info)
    await hooks.run_phase("pre_prompt_context", info)
    if request.tools:
        await hooks.run_phase("pre_tool_materialization", info)
    if info.context:
        info.system_prompt = "\n\n".join(p for p in (info.system_prompt, *info.context) if p)
    await hooks.run_phase("pre_prompt_compile", info)
    request.system_prompt = info.system_prompt
    request.tools = info.tools if request.tools else []


async def _attempt(model: Model, request: ModelRequest, state: RunState, emit: Emit) -> StreamDone | StreamError:
    if emit is None:  # nobody watches: no deltas needed
        return await model.respond(request)
    terminal: StreamDone | StreamError | None = None
    async for event in model.stream(request):
        if isinstance(event, StreamStart):
            state.partial = event.partial
            if event.partial is not None:
                emit(MessageStart(message=event.partial))
        elif isinstance(event, StreamDone | StreamError):
            terminal = event
        elif state.partial is not None:
            emit(MessageUpdate(message=state.partial, event=event))
    assert terminal is not None  # Model.stream always ends with done or error
    emit(MessageEnd(message=terminal.message))
    return terminal


async def call_model(
    cfg: LoopConfig, state: RunState, tools_enabled: bool, emit: Emit, on_retry: OnRetry = None
) -> AssistantMessage:
    messages: list[Message] = list(state.messages)  # a snapshot: the history grows after this call
    if cfg.hooks.transform:
        messages = await cfg.hooks.run_transform(messages)
    request = build_request(cfg, messages, tools_enabled, state.conversation)
    state.offered = None
    if cfg.hooks.phases:
        try:
            await _turn_phases(cfg, state, request)
        except TurnFailed as exc:
            return AssistantMessage(
                provider=cfg.model.info.provider, model=cfg.model.info.id, stop_reason="error", error_message=str(exc)
            )
        offered = frozenset(spec.name for spec in request.tools)
        if tools_enabled and offered != cfg.tools.keys():  # a hook narrowed the list: only those may run
            state.offered = offered
    outcome: StreamError | None = None
    for model in (cfg.model, *cfg.fallbacks):
        if outcome is not None:  # say that we move on to the next model
            reason = outcome.message.error_message or outcome.kind
            await _retrying(ModelRetry(attempt=0, delay=0.0, error=reason, model=model.name), emit, on_retry)
        attempt = 0
        while True:
            result = await _attempt(model, request, state, emit)
            state.partial = None
            if isinstance(result, StreamDone):
                return result.message
            outcome = result
            if outcome.kind == "aborted" or outcome.kind == "overflow":
                return outcome.message
            attempt += 1
            delay = cfg.retry.delay(attempt, outcome.retry_after) if outcome.retryable else None
            if delay is None:
                break
            error = outcome.message.error_message or outcome.kind
            await _retrying(ModelRetry(attempt=attempt, delay=delay, error=error, model=model.name), emit, on_retry)
            await asyncio.sleep(delay)
    assert outcome is not None
    return outcome.message


async def _retrying(event: ModelRetry, emit: Emit, on_retry: OnRetry) -> None:
    if emit is not None:
        emit(event)
    if on_retry is not None:
        await on_retry(event)
