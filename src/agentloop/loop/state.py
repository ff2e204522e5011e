"""Loop configuration, the state of one run, and the decision over that state.

``decide`` is the whole control flow of an agent loop: given the history, what happens next is
exactly one of *call the model*, *run tools*, or *finish*. The in-memory runner executes its
decisions directly; a durable runner executes the same decisions, committing each outcome.
It only looks at the tail of the history, so a decision costs the same at message 4 and 400.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeAlias

from agentloop.events import LoopEvent
from agentloop.loop.guards import Guards
from agentloop.loop.hooks import Hooks
from agentloop.loop.windows import FIRST, Window
from agentloop.messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolResultMessage,
    Usage,
)
from agentloop.models.base import Model, Reasoning, ToolSpec
from agentloop.models.retry import RetryPolicy
from agentloop.tools.base import Tool

ToolExecution: TypeAlias = Literal["parallel", "sequential"]
Mode: TypeAlias = Literal["agent", "chat"]  # chat: the same history, no tools
#: How queued steering or follow-up input joins the run: ``one-at-a-time`` injects one message per
#: model call (the model answers each in turn), ``all`` injects everything queued before the next
#: call (one answer to the lot: cheaper when messages pile up). pi's ``steeringMode``/``followUpMode``.
QueueMode: TypeAlias = Literal["one-at-a-time", "all"]


def check_queue_mode(name: str, value: object) -> QueueMode:
    """``value`` as a ``QueueMode``, or ``ValueError`` naming the option ``name``."""
    if value == "one-at-a-time":
        return "one-at-a-time"
    if value == "all":
        return "all"
    raise ValueError(f"{name} must be 'one-at-a-time' or 'all', got {value!r}")


def check_mode(mode: object) -> Mode:
    """``mode`` as a ``Mode``, or ``ValueError`` (a run's, a process's: the same two words)."""
    if mode == "agent":
        return "agent"
    if mode == "chat":
        return "chat"
    raise ValueError(f"mode must be agent or chat, got {mode!r}")


#: What watches an in-memory run's events (``LoopConfig.observers``; tracing, say): called with the
#: run's config and state as the run starts, it returns the function the run gives each of its
#: events to, streaming or not (None: it leaves this run alone). That function is called on the
#: run's hot path: it must be cheap and should not raise (what it raises is logged, then ignored).
#: A run with a watcher calls the model's streaming API even when it is not streamed (the events
#: come from the stream); without one, nothing changes.
Observer: TypeAlias = Callable[["LoopConfig", "RunState"], Callable[[LoopEvent], None] | None]


@dataclass
class LoopConfig:
    """Everything a run needs that does not change while it runs."""

    model: Model
    tools: dict[str, Tool] = field(default_factory=dict)
    system_prompt: str = ""
    fallbacks: list[Model] = field(default_factory=list)
    tool_timeout: float | None = 60.0
    tool_execution: ToolExecution = "parallel"
    max_concurrency: int = 16
    guards: Guards = field(default_factory=Guards)
    hooks: Hooks = field(default_factory=Hooks)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    workspace: Path | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    reasoning: Reasoning | None = None  # how hard a reasoning model thinks (``models.base.Reasoning``)
    off_limits: tuple[Path, ...] = ()  # paths no tool may read (see ``ToolContext``)
    observers: list[Observer] = field(default_factory=list)  # see ``Observer``: none, no cost
    steering_mode: QueueMode = "one-at-a-time"  # see ``QueueMode`` (the in-memory runner's)
    follow_up_mode: QueueMode = "one-at-a-time"

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [t.spec for t in self.tools.values()]


@dataclass(slots=True)
class RunState:
    """One run in progress: the history it extends, its counters and its input queues."""

    run_id: str
    messages: list[Message]
    first_new: int  # index of this run's first message in ``messages``
    steering: deque[Message] = field(default_factory=deque)
    follow_up: deque[Message] = field(default_factory=deque)
    turn: int = 0
    rounds: int = 0  # model calls with tools enabled
    tool_calls: int = 0
    usage: Usage = field(default_factory=Usage)
    started: float = field(default_factory=time.monotonic)
    guard: str | None = None  # the guard that tripped; set when the final round is armed
    failures: dict[str, int] = field(default_factory=dict)  # failed calls by what they were (loop/retries.py)
    failing: bool = False  # a call failed the same way once too often: the next round is the last
    repeats: dict[str, int] = field(default_factory=dict)  # the streak of one same successful result (loop/retries.py)
    repeating: bool = False  # a call got the same result once too often: the next round is the last
    stopping: bool = False  # asked to finish (``Run.stop``): the next round is the last
    window: Window = FIRST  # the execution window the run is in (loop/windows.py; immutable, so shared)
    partial: AssistantMessage | None = None  # the assistant message being streamed
    offered: frozenset[str] | None = None  # tools the last model call was shown, when hooks narrowed them
    conversation: str | None = None  # a durable process's id, sent as the provider's prompt-cache key
    results: dict[str, ToolResultMessage] = field(default_factory=dict)  # finished calls of a batch
    aborted: bool = False
    mode: Mode = "agent"
    phase: Literal["idle", "model", "tools"] = "idle"
    error: str | None = None  # why the run failed, when it did
    transient: bool = False  # the last model call failed in a way that may pass (rate limit, 5xx, connection)
    metadata: Mapping[str, Any] | None = None  # the caller's, for the run's tools (``ToolContext.metadata``)
    # whether ``messages`` hold a group chat's, whose speakers the model is told (``with_speakers``):
    # None to look (``speakers_named``); a durable process knows, and spares its calls the look
    origins: bool | None = None
    origins_seen: int = 0  # (while None: how much of ``messages`` was looked at, and had none)

    @property
    def new_messages(self) -> list[Message]:
        return self.messages[self.first_new :]

    def append(self, message: Message) -> None:
        self.messages.append(message)


# ------------------------------------------------------------------ decisions


@dataclass(frozen=True, slots=True)
class CallModel:
    tools_enabled: bool


@dataclass(frozen=True, slots=True)
class RunTools:
    message: AssistantMessage
    calls: list[ToolCall]  # the calls of ``message`` that have no result yet


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # stop | length | error | aborted | <guard name>


Decision: TypeAlias = CallModel | RunTools | Finish

# decisions are immutable: the common ones are made once
_CALL_WITH_TOOLS = CallModel(tools_enabled=True)
_CALL_WITHOUT_TOOLS = CallModel(tools_enabled=False)
_FINISH_STOP = Finish("stop")
_FINISH_LENGTH = Finish("length")


def unresolved_calls(messages: list[Message]) -> tuple[AssistantMessage | None, list[ToolCall]]:
    """The newest assistant message and those of its tool calls that have no result after it."""
    done: set[str] = set()
    for msg in reversed(messages):
        if isinstance(msg, ToolResultMessage):
            done.add(msg.tool_call_id)
        elif isinstance(msg, AssistantMessage):
            return msg, [c for c in msg.tool_calls if c.id not in done]
        elif isinstance(msg, SystemMessage):
            continue
        else:
            return None, []
    return None, []


def decide(messages: list[Message], *, has_input: bool, guard: str | None) -> Decision:
    """The next action for a history. ``has_input``: queued input is waiting to be injected;
    ``guard``: the guard that tripped, if any (its final tools-disabled round is armed or done).
    """
    if not messages:
        return _FINISH_STOP
    last = messages[-1]
    if isinstance(last, AssistantMessage):
        if last.stop_reason in ("error", "aborted"):
            return Finish(last.stop_reason)
        calls = last.tool_calls
        if calls:
            return RunTools(last, calls)
        if guard is not None:
            return Finish(guard)
        if has_input:
            return _CALL_WITH_TOOLS
        return _FINISH_LENGTH if last.stop_reason == "length" else _FINISH_STOP
    if isinstance(last, ToolResultMessage):
        assistant, pending = unresolved_calls(messages)
        if assistant is not None and pending:
            return RunTools(assistant, pending)
        # every result of the turn asks to end the run: no model call to read them back, unless
        # input waits (the person who spoke meanwhile is answered, as at any other end)
        if last.terminate and not has_input and assistant is not None and _terminating(messages, assistant):
            return _FINISH_STOP
    return _CALL_WITH_TOOLS if guard is None else _CALL_WITHOUT_TOOLS


def _terminating(messages: list[Message], assistant: AssistantMessage) -> bool:
    """Whether each of ``assistant``'s calls has a result that says ``terminate``."""
    asked = {c.id for c in assistant.tool_calls}
    for msg in reversed(messages):
        if msg is assistant:
            return True
        if isinstance(msg, ToolResultMessage) and msg.tool_call_id in asked and not msg.terminate:
            return False
    return True
