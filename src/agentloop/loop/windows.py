"""Execution windows: a long run split into windows of rounds (or tool calls) that checkpoint and
go on, instead of one budget that ends the run.

A window's budget (``Guards.window_rounds``, ``Guards.window_tool_calls``) is checked where the
run budgets are, before a model call with tools: once it is used up, a new window opens (an event
in memory, ``proc.run.window`` in a durable process, whose every step is committed anyway) and the
per-window counts start again. The run ends like a tripped guard (one last round without tools)
when the ``max_windows``-th window is used up (``max_windows``), or when ``max_idle_windows``
windows in a row made no progress (``no_progress``).

Progress, kept simple so both runners count it the same from the history alone: a window made
progress when one of its model answers had text, or one of its tool calls succeeded with a result
the run had not had before for that call (the same call, the same arguments, a different
result; the latest ``MAX_SEEN`` distinct ones are remembered). A model that only goes round the
same calls getting the same answers, even alternating them so the repeated-call guard never
sees a streak, makes none.

Both runners call ``next_window`` with the run's totals and history; the window's state
(``Window``) is immutable, and the durable runner keeps it in its run record (``record``), so a
restart carries on in the same window.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from agentloop.messages import AssistantMessage, Message, TextContent, ToolCall, ToolResultMessage

if TYPE_CHECKING:
    from agentloop.loop.guards import Guards

MAX_WINDOWS = "max_windows"
NO_PROGRESS = "no_progress"
DEFAULT_MAX_WINDOWS = 16
DEFAULT_MAX_IDLE_WINDOWS = 3
#: the distinct successful results a run remembers (the durable run rewrites its record at each step)
MAX_SEEN = 64


@dataclass(frozen=True, slots=True)
class Window:
    """The current window of a run. Its counts are the run's totals when it opened (``rounds_at``,
    ``calls_at``): what it used is the run's totals less these, so nothing else counts twice."""

    number: int = 1
    rounds_at: int = 0
    calls_at: int = 0
    idle: int = 0  # windows in a row before this one that made no progress
    progress: bool = False  # whether this window made progress so far
    scanned: int = 0  # the run's rounds whose answers were looked at for progress (each once)
    seen: tuple[str, ...] = ()  # digests of the successful results the run had, the latest last

    def record(self) -> dict[str, Any]:
        """The JSON-ready form a durable run keeps in its record."""
        data = asdict(self)
        data["seen"] = list(self.seen)
        return data

    @classmethod
    def from_record(cls, data: dict[str, Any] | None) -> Window:
        if not data:
            return FIRST
        known = {f.name for f in fields(cls)}  # (a record from another version: what this one knows)
        return cls(**{k: v for k, v in data.items() if k in known and k != "seen"}, seen=tuple(data.get("seen", ())))


FIRST = Window()


@dataclass(frozen=True, slots=True)
class Boundary:
    """A window used up and the next one opened: its ``window`` number, and the ``rounds`` and
    ``tool_calls`` the window that ended used."""

    window: int
    rounds: int
    tool_calls: int


def next_window(
    guards: Guards, window: Window, rounds: int, tool_calls: int, messages: Sequence[Message]
) -> tuple[Window, str | None, Boundary | None]:
    """Before a model call with tools: ``window`` with the last round's progress counted (from the
    tail of ``messages``), and, where its budget is used up, the next window opened (its
    ``Boundary``) or the guard that ends the run (``max_windows``, ``no_progress``)."""
    if guards.window_rounds is None and guards.window_tool_calls is None:
        return window, None, None
    if rounds > window.scanned:
        window = _scan(window, rounds, messages)
    used_rounds, used_calls = rounds - window.rounds_at, tool_calls - window.calls_at
    full = (guards.window_rounds is not None and used_rounds >= guards.window_rounds) or (
        guards.window_tool_calls is not None and used_calls >= guards.window_tool_calls
    )
    if not full:
        return window, None, None
    idle = 0 if window.progress else window.idle + 1
    if idle >= guards.max_idle_windows:
        return replace(window, idle=idle), NO_PROGRESS, None
    if window.number >= guards.max_windows:
        return replace(window, idle=idle), MAX_WINDOWS, None
    opened = replace(window, number=window.number + 1, rounds_at=rounds, calls_at=tool_calls, idle=idle, progress=False)
    return opened, None, Boundary(opened.number, used_rounds, used_calls)


def _scan(window: Window, rounds: int, messages: Sequence[Message]) -> Window:
    """Count the last round (the newest model answer and the results of its calls, after which
    only injected input may come) into the window's progress."""
    results: list[ToolResultMessage] = []
    answer: AssistantMessage | None = None
    for msg in reversed(messages):
        if isinstance(msg, ToolResultMessage):
            results.append(msg)
        elif isinstance(msg, AssistantMessage):
            answer = msg
            break
    progress = window.progress
    seen = list(window.seen)
    if answer is not None:
        progress = progress or bool(answer.text.strip())
        calls = {c.id: c for c in answer.tool_calls}
        for result in reversed(results):
            call = calls.get(result.tool_call_id)
            if call is None or result.is_error:
                continue
            key = _digest(call, result)
            if key not in seen:
                seen.append(key)
                progress = True
    return replace(window, progress=progress, scanned=rounds, seen=tuple(seen[-MAX_SEEN:]))


def _digest(call: ToolCall, result: ToolResultMessage) -> str:
    """What a successful result was, for its call: tool, arguments, text and media."""
    media = [getattr(b, "data", "") for b in result.content if not isinstance(b, TextContent)]
    whole = json.dumps([call.name, call.arguments, result.text, media], sort_keys=True, default=str)
    return hashlib.sha256(whole.encode()).hexdigest()[:16]
