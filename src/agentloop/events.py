"""Events: what a provider stream says while it answers, and what the loop says while it runs.

Provider events follow one protocol: ``start``, then any of the ``*_start / *_delta / *_end``
triples, then exactly one terminal ``done`` or ``error``. A provider never raises; a failure is an
``error`` event whose message has stop reason ``error`` or ``aborted``.

Loop events use pi's names (``agent_start``, ``turn_start``, ``message_start/_update/_end``,
``tool_execution_start/_update/_end``, ``turn_end``, ``agent_end``), plus ``model_retry`` and
what pieces report through ``TurnInfo.emit``: ``compaction_start/_end`` (``Compaction``) and
``tool_retry_scheduled/_resolved/_exhausted`` (``ToolRetry``), and ``window_continued`` (an
execution window used up, the run going on in the next). Every event is a pydantic slotted
dataclass; ``event_to_dict(event)`` is its wire form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeAlias, TypeVar, dataclass_transform

from pydantic import Field, TypeAdapter

from agentloop.messages import (
    AssistantMessage,
    Message,
    StopReason,
    ToolCall,
    ToolResultMessage,
    Usage,
)

_T = TypeVar("_T")


@dataclass_transform(kw_only_default=True, field_specifiers=(field,))
def _event(cls: type[_T]) -> type[_T]:
    """Events are slotted dataclasses: created on the hot path, validated only when parsed."""
    return dataclass(slots=True, kw_only=True)(cls)


# ------------------------------------------------------------------ provider stream events


@_event
class StreamStart:
    """The first event; ``partial`` is the message being built (live, left out of the wire form)."""

    type: Literal["start"] = "start"
    partial: Annotated[AssistantMessage | None, Field(exclude=True)] = None


@_event
class TextStart:
    type: Literal["text_start"] = "text_start"
    index: int


@_event
class TextDelta:
    type: Literal["text_delta"] = "text_delta"
    index: int
    delta: str


@_event
class TextEnd:
    type: Literal["text_end"] = "text_end"
    index: int
    content: str


@_event
class ThinkingStart:
    type: Literal["thinking_start"] = "thinking_start"
    index: int


@_event
class ThinkingDelta:
    type: Literal["thinking_delta"] = "thinking_delta"
    index: int
    delta: str


@_event
class ThinkingEnd:
    type: Literal["thinking_end"] = "thinking_end"
    index: int
    content: str


@_event
class ToolCallStart:
    type: Literal["toolcall_start"] = "toolcall_start"
    index: int
    id: str
    name: str


@_event
class ToolCallDelta:
    """A raw fragment of the tool call's JSON arguments, as the provider sent it."""

    type: Literal["toolcall_delta"] = "toolcall_delta"
    index: int
    delta: str


@_event
class ToolCallEnd:
    type: Literal["toolcall_end"] = "toolcall_end"
    index: int
    tool_call: ToolCall


@_event
class StreamDone:
    type: Literal["done"] = "done"
    message: AssistantMessage


ErrorKind: TypeAlias = Literal[
    "rate_limit",  # 429 / overloaded: retry after a while
    "server",  # 5xx
    "connection",  # could not connect, or the stream broke
    "timeout",
    "overflow",  # the context does not fit the model's window
    "auth",  # bad or missing credentials
    "bad_request",  # the provider rejected what we sent
    "invalid_response",  # the provider answered something we cannot read
    "aborted",
    "unknown",
]

RETRYABLE_KINDS: frozenset[str] = frozenset({"rate_limit", "server", "connection", "timeout"})


@_event
class StreamError:
    """The terminal event of a failed call. ``message`` holds whatever arrived before the failure."""

    type: Literal["error"] = "error"
    message: AssistantMessage
    kind: ErrorKind = "unknown"
    status: int | None = None
    retry_after: float | None = None

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE_KINDS


StreamEvent: TypeAlias = Annotated[
    StreamStart
    | TextStart
    | TextDelta
    | TextEnd
    | ThinkingStart
    | ThinkingDelta
    | ThinkingEnd
    | ToolCallStart
    | ToolCallDelta
    | ToolCallEnd
    | StreamDone
    | StreamError,
    Field(discriminator="type"),
]


# ------------------------------------------------------------------ loop events


@_event
class AgentStart:
    type: Literal["agent_start"] = "agent_start"
    run_id: str


@_event
class TurnStart:
    type: Literal["turn_start"] = "turn_start"
    turn: int


@_event
class MessageStart:
    type: Literal["message_start"] = "message_start"
    message: Message


@_event
class MessageUpdate:
    """A provider delta applied to the assistant message being streamed (``message`` is live)."""

    type: Literal["message_update"] = "message_update"
    message: AssistantMessage
    event: StreamEvent


@_event
class MessageEnd:
    type: Literal["message_end"] = "message_end"
    message: Message


@_event
class ToolExecutionStart:
    type: Literal["tool_execution_start"] = "tool_execution_start"
    tool_call_id: str
    tool_name: str
    args: dict[str, Any]


@_event
class ToolExecutionUpdate:
    type: Literal["tool_execution_update"] = "tool_execution_update"
    tool_call_id: str
    tool_name: str
    partial_result: Any


@_event
class ToolExecutionEnd:
    type: Literal["tool_execution_end"] = "tool_execution_end"
    tool_call_id: str
    tool_name: str
    result: ToolResultMessage
    is_error: bool


@_event
class TurnEnd:
    type: Literal["turn_end"] = "turn_end"
    turn: int
    message: AssistantMessage
    tool_results: list[ToolResultMessage]


@_event
class ModelRetry:
    """A provider failure (or an unusable answer) being retried: after ``delay`` s on ``model``;
    ``attempt`` 0 means a switch to a fallback."""

    type: Literal["model_retry"] = "model_retry"
    attempt: int
    delay: float
    error: str
    model: str

    @property
    def fallback(self) -> bool:
        """Whether this is the switch to a fallback ``model`` (its first call), not a retry."""
        return self.attempt == 0


CompactionTrigger: TypeAlias = Literal["threshold", "overflow"]


@_event
class CompactionStart:
    """The ``Compaction`` piece is folding older history into a summary (a model call): the context
    passed its ``threshold``, or the provider refused the last call as too long (``overflow``).
    ``messages_before``: how many messages the history holds."""

    type: Literal["compaction_start"] = "compaction_start"
    reason: CompactionTrigger
    messages_before: int


@_event
class CompactionEnd:
    """The end of a ``compaction_start``. ``compacted``: the history was replaced by the summary
    and the ``removed`` messages' tail (token counts are estimates of the history before and
    after, as a durable process's ``proc.compacted`` gives them); not compacted, ``error`` says
    why the summary failed (None: nothing was worth compacting). ``will_retry``: the call refused
    as too long is made once more."""

    type: Literal["compaction_end"] = "compaction_end"
    reason: CompactionTrigger
    compacted: bool
    will_retry: bool = False
    error: str | None = None
    removed: int = 0
    tokens_before: int | None = None
    tokens_after: int | None = None


@_event
class ToolRetryScheduled:
    """A retryable tool failure counted by the ``ToolRetry`` piece: its class, and what is left of
    each budget it counts against after it (the model is told the same and tries again)."""

    type: Literal["tool_retry_scheduled"] = "tool_retry_scheduled"
    tool_call_id: str
    tool_name: str
    error_class: str
    rounds_left: int
    class_left: int
    tool_left: int
    signature_left: int


@_event
class ToolRetryResolved:
    """A step without a retryable failure after some: the episode is over and the budgets are
    full again. ``failures`` and ``rounds``: what the episode had counted."""

    type: Literal["tool_retry_resolved"] = "tool_retry_resolved"
    failures: int
    rounds: int


@_event
class ToolRetryExhausted:
    """A tool failure went past a retry budget (``budget``: ``rounds``, ``class``, ``tool`` or
    ``signature``, of ``limit``): the run stops after this step, tools off for its last answer."""

    type: Literal["tool_retry_exhausted"] = "tool_retry_exhausted"
    tool_call_id: str
    tool_name: str
    error_class: str
    budget: str
    limit: int
    reason: str


@_event
class WindowContinued:
    """An execution window was used up and the run goes on in the next (``Guards.window_rounds``,
    ``window_tool_calls``): ``window`` is the number of the one that opens now, ``rounds`` and
    ``tool_calls`` what the one that ended used."""

    type: Literal["window_continued"] = "window_continued"
    window: int
    rounds: int
    tool_calls: int


@_event
class AgentEnd:
    type: Literal["agent_end"] = "agent_end"
    run_id: str
    messages: list[Message]
    stop_reason: str
    error: str | None = None
    usage: Usage


LoopEvent: TypeAlias = Annotated[
    AgentStart
    | TurnStart
    | MessageStart
    | MessageUpdate
    | MessageEnd
    | ToolExecutionStart
    | ToolExecutionUpdate
    | ToolExecutionEnd
    | TurnEnd
    | ModelRetry
    | CompactionStart
    | CompactionEnd
    | ToolRetryScheduled
    | ToolRetryResolved
    | ToolRetryExhausted
    | WindowContinued
    | AgentEnd,
    Field(discriminator="type"),
]

_STREAM_EVENT: TypeAdapter[StreamEvent] = TypeAdapter(StreamEvent)
_LOOP_EVENT: TypeAdapter[LoopEvent] = TypeAdapter(LoopEvent)


def event_to_dict(event: LoopEvent | StreamEvent) -> dict[str, Any]:
    """The JSON-ready form of an event (what ``--json`` prints and the server sends)."""
    adapter = _STREAM_EVENT if event.type in _STREAM_TYPES else _LOOP_EVENT
    data: dict[str, Any] = adapter.dump_python(event, mode="json", by_alias=True)  # type: ignore[arg-type]
    return data


def event_from_dict(data: dict[str, Any]) -> LoopEvent:
    return _LOOP_EVENT.validate_python(data)


_STREAM_TYPES = frozenset(
    {
        "start",
        "text_start",
        "text_delta",
        "text_end",
        "thinking_start",
        "thinking_delta",
        "thinking_end",
        "toolcall_start",
        "toolcall_delta",
        "toolcall_end",
        "done",
        "error",
    }
)

__all__ = [
    "RETRYABLE_KINDS",
    "AgentEnd",
    "AgentStart",
    "CompactionEnd",
    "CompactionStart",
    "CompactionTrigger",
    "ErrorKind",
    "LoopEvent",
    "MessageEnd",
    "MessageStart",
    "MessageUpdate",
    "ModelRetry",
    "StopReason",
    "StreamDone",
    "StreamError",
    "StreamEvent",
    "StreamStart",
    "TextDelta",
    "TextEnd",
    "TextStart",
    "ThinkingDelta",
    "ThinkingEnd",
    "ThinkingStart",
    "ToolCallDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "ToolExecutionEnd",
    "ToolExecutionStart",
    "ToolExecutionUpdate",
    "ToolRetryExhausted",
    "ToolRetryResolved",
    "ToolRetryScheduled",
    "TurnEnd",
    "TurnStart",
    "WindowContinued",
    "event_from_dict",
    "event_to_dict",
]
