"""One model turn: build the request, stream the answer, retry what is transient, fall back.

Transient failures (rate limit, 5xx, broken connection) are retried with backoff, honouring the
provider's ``retry-after``; when a model keeps failing, the configured fallbacks are tried in
order. An answer that finished but cannot be used (empty, thinking only, tool-call markup in its
text: ``models/unusable.py``) is asked again at once, up to ``MAX_UNUSABLE_RETRIES`` times, then
counts as a failure of the model. A failed attempt is shown (``message_end`` with the error, then
``model_retry``, also given to ``on_retry`` before the wait) but does not enter the history. The
returned message is final: ``done``, or the last error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

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
from agentloop.loop.hooks import ToolMap, TurnFailed, TurnInfo, with_added
from agentloop.loop.state import LoopConfig, RunState
from agentloop.messages import AssistantMessage, Message, Usage, UserMessage, names_speaker, with_speakers
from agentloop.models.base import Model, ModelRequest
from agentloop.models.unusable import unusable
from agentloop.tools.base import Tool

log = logging.getLogger("agentloop.hooks")

Emit = Callable[[LoopEvent], None] | None
OnRetry = Callable[[ModelRetry], Awaitable[None]] | None

#: how many times an unusable answer (``models/unusable.py``) is asked again, on each model
MAX_UNUSABLE_RETRIES = 3


def build_request(
    cfg: LoopConfig, messages: list[Message], tools_enabled: bool, conversation: str | None = None
) -> ModelRequest:
    hooks = cfg.hooks
    return ModelRequest(
        system_prompt=cfg.system_prompt,
        messages=messages,
        tools=cfg.tool_specs if tools_enabled else [],
        max_tokens=cfg.max_tokens,
        temperature=cfg.temperature,
        reasoning=cfg.reasoning,
        parallel_tool_calls=cfg.tool_execution == "parallel",
        cache_key=conversation,
        # the adapter hands its payload to the provider-request hooks (none: it sends it as built)
        shape_payload=hooks.shape_payload if hooks.provider_request else None,
    )


def with_bundles(cfg: LoopConfig, added: dict[str, Tool]) -> LoopConfig:
    """``cfg`` with the tools hooks added to a call (``call_model``'s ``added``) callable: the
    configuration a runner executes the run's next tool calls, and makes its next calls, with."""
    return replace(cfg, tools=with_added(cfg.tools, added))


def _turn_info(cfg: LoopConfig, state: RunState, request: ModelRequest) -> TurnInfo:
    """What the turn-phase hooks of this call see (the tools hooks added earlier in the run left
    out of its list: they are shown again only if a hook adds them again)."""
    tools = cfg.tools
    if request.tools and isinstance(tools, ToolMap) and tools.bundled:
        request.tools = [spec for spec in request.tools if spec.name not in tools.bundled]
    return TurnInfo(
        state.run_id,
        state.turn,
        request.messages,
        request.system_prompt,
        request.tools,
        conversation=state.conversation,
        registered=tools,
    )


async def _turn_phases(cfg: LoopConfig, state: RunState, request: ModelRequest, added: dict[str, Tool] | None) -> None:
    """Let the turn-phase hooks shape this call's system prompt and tool list."""
    info = _turn_info(cfg, state, request)
    hooks = cfg.hooks
    phases = hooks.phases
    await hooks.run_phase("pre_policy", info)
    await hooks.run_phase("pre_prompt_context", info)
    if request.tools:
        await hooks.run_phase("pre_tool_materialization", info)
        if info.added:
            _take_added(info, added)
    if "post_preflight_prompt_context" in phases:
        await hooks.run_phase("post_preflight_prompt_context", info)
    if info.context:
        info.system_prompt = "\n\n".join(p for p in (info.system_prompt, *info.context) if p)
    await hooks.run_phase("pre_prompt_compile", info)
    if "post_prompt_compile" in phases:
        await hooks.run_phase("post_prompt_compile", info)
    request.system_prompt = info.system_prompt
    request.tools = info.tools if request.tools else []


def _take_added(info: TurnInfo, added: dict[str, Tool] | None) -> None:
    """Hand the tools hooks added to this call to the runner (``added``), which makes them
    callable; a caller that cannot (None) does not show them: a call to them would fail."""
    if added is not None:
        added.update(info.added)
        return
    info.tools = [spec for spec in info.tools if spec.name not in info.added]
    log.warning("tools added by a hook are left out here: %s", ", ".join(sorted(info.added)))


@dataclass(slots=True)
class _Unusable:
    """A finished answer the loop cannot use, made a failed attempt: ``message`` is it as shown
    (and, for the last, returned), ``reason`` what was wrong with it."""

    message: AssistantMessage
    reason: str


async def _attempt(
    model: Model, request: ModelRequest, state: RunState, emit: Emit, unusable_so_far: list[str]
) -> StreamDone | StreamError | _Unusable:
    if emit is None:  # nobody watches: no deltas needed
        return _judge(await model.respond(request), request, state, unusable_so_far)
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
    result = _judge(terminal, request, state, unusable_so_far)
    emit(MessageEnd(message=result.message))
    return result


def _judge(
    result: StreamDone | StreamError, request: ModelRequest, state: RunState, unusable_so_far: list[str]
) -> StreamDone | StreamError | _Unusable:
    """Make a finished answer that cannot be used a failed attempt, before anyone sees it end: it
    is shown and kept as an error (the last saying that the model gave up), without what it said,
    and its usage goes to the run's, since it was billed. Not while the run is being aborted:
    the abort ends the run anyway, and a retry would only delay it."""
    if not isinstance(result, StreamDone) or state.aborted:
        return result
    reason = unusable(result.message, tools_offered=bool(request.tools))
    if reason is None:
        return result
    unusable_so_far.append(reason)
    message = result.message
    state.usage.add(message.usage)
    message.content, message.usage, message.stop_reason = [], Usage(), "error"
    message.error_message = reason if len(unusable_so_far) <= MAX_UNUSABLE_RETRIES else _gave_up(unusable_so_far)
    return _Unusable(message, reason)


def _gave_up(reasons: list[str]) -> str:
    return f"the model gave no usable answer ({', '.join(dict.fromkeys(reasons))}) after {len(reasons)} attempts"


def speakers_named(state: RunState) -> bool:
    """Whether the history holds a group chat's messages, whose speakers the model is told. Where
    the runner does not know (``state.origins`` None: in memory), only what the history gained
    since the last call is looked at: a look at all of it at every call made a long run's calls
    cost more as its history grew. Once one is found the answer stays yes (a compaction that took
    it away leaves the naming to find nothing, which costs a pass and changes no byte)."""
    named = state.origins
    if named is not None:
        return named
    messages, seen = state.messages, state.origins_seen
    n = len(messages)
    if seen > n:  # (the history was replaced: a compaction) look at it all again
        seen = 0
    while seen < n:  # (an index loop, only user messages asked: the cheapest look per call)
        m = messages[seen]
        if type(m) is UserMessage and names_speaker(m):
            state.origins = True
            return True
        seen += 1
    state.origins_seen = n
    return False


async def _request(cfg: LoopConfig, state: RunState, tools_enabled: bool) -> ModelRequest:
    """The request of a model call over the history of ``state``, before the turn phases."""
    # a snapshot (the history grows after this call), with a group chat's speakers named
    messages = with_speakers(state.messages) if speakers_named(state) else list(state.messages)
    if cfg.hooks.transform:
        messages = await cfg.hooks.run_transform(messages)
    return build_request(cfg, messages, tools_enabled, state.conversation)


async def tools_added(cfg: LoopConfig, state: RunState) -> dict[str, Tool]:
    """The tools the ``pre_tool_materialization`` hooks add to a call over the history of
    ``state``: the request ``call_model`` would build, the phase it would run, no model called.
    A durable runner whose configuration was built anew (a restart) gets back so, from the hooks
    themselves, the tools they added to the call whose tool calls are still to run (a tool added
    directly as well as a bundle's); what they no longer add stays out. Raises what the hooks
    raise (``TurnFailed``)."""
    if "pre_tool_materialization" not in cfg.hooks.phases:
        return {}
    request = await _request(cfg, state, True)
    info = _turn_info(cfg, state, request)
    if request.tools:  # (as in ``_turn_phases``: a call without tools runs no materialisation)
        await cfg.hooks.run_phase("pre_tool_materialization", info)
    return info.added


async def call_model(
    cfg: LoopConfig,
    state: RunState,
    tools_enabled: bool,
    emit: Emit,
    on_retry: OnRetry = None,
    added: dict[str, Tool] | None = None,
) -> AssistantMessage:
    """The model's final answer to the history of ``state``. The usage of answers it threw away
    is added to ``state.usage``: the returned message's own stays that of one call, which the
    context-pressure estimate reads as the size of the prompt. ``added`` receives the tools a
    ``pre_tool_materialization`` hook added to the call (a bundle): the caller runs the call's
    tool calls, and makes the run's next calls, with ``with_bundles(cfg, added)``."""
    request = await _request(cfg, state, tools_enabled)
    state.offered = None
    state.transient = False
    if cfg.hooks.phases:
        try:
            await _turn_phases(cfg, state, request, added)
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
        result = await _call_one(cfg, model, request, state, emit, on_retry)
        if isinstance(result, AssistantMessage):
            return result
        outcome = result
    assert outcome is not None
    state.transient = outcome.retryable  # (every model failed so: a later try may well succeed)
    return outcome.message


async def _call_one(
    cfg: LoopConfig, model: Model, request: ModelRequest, state: RunState, emit: Emit, on_retry: OnRetry
) -> AssistantMessage | StreamError:
    """Call ``model`` until it answers (the message, final), or fails in a way the next model may
    not (an abort, an overflow: final too); else the failure, for the next model to take over.
    Transient failures and unusable answers are asked again, each within its own limit."""
    attempt = 0
    unusable_so_far: list[str] = []
    while True:
        result = await _attempt(model, request, state, emit, unusable_so_far)
        state.partial = None
        if isinstance(result, StreamDone):
            return result.message
        if isinstance(result, _Unusable):
            if len(unusable_so_far) > MAX_UNUSABLE_RETRIES:
                return StreamError(message=result.message, kind="invalid_response")
            retry = ModelRetry(attempt=len(unusable_so_far), delay=0.0, error=result.reason, model=model.name)
            await _retrying(retry, emit, on_retry)
            continue
        if result.kind == "aborted" or result.kind == "overflow":
            return result.message
        attempt += 1
        delay = cfg.retry.delay(attempt, result.retry_after) if result.retryable else None
        if delay is None:
            return result
        error = result.message.error_message or result.kind
        await _retrying(ModelRetry(attempt=attempt, delay=delay, error=error, model=model.name), emit, on_retry)
        await asyncio.sleep(delay)


async def _retrying(event: ModelRetry, emit: Emit, on_retry: OnRetry) -> None:
    if emit is not None:
        emit(event)
    if on_retry is not None:
        await on_retry(event)
