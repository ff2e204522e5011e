"""Hooks: user code that can veto a tool call, rewrite a result, or reshape the context.

Each hook may be a plain or an ``async`` function. Several hooks of one kind run in the order they
were added; the first ``before_tool_call`` that blocks wins, and each ``after_tool_call`` sees the
result the previous one returned.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

from agentloop.messages import AssistantMessage, Message, ToolCall
from agentloop.tools.base import ToolResult


@dataclass
class ToolCallInfo:
    """What a tool hook knows about the call: the call, its validated arguments, the history."""

    call: ToolCall
    args: dict[str, Any]
    assistant_message: AssistantMessage
    messages: list[Message]
    run_id: str


@dataclass(frozen=True)
class Block:
    """Returned by a before-tool-call hook to stop the call; ``reason`` is what the model reads."""

    reason: str = "Tool execution was blocked"


BeforeToolCall: TypeAlias = Callable[[ToolCallInfo], "Block | Awaitable[Block | None] | None"]
AfterToolCall: TypeAlias = Callable[[ToolCallInfo, ToolResult], "ToolResult | Awaitable[ToolResult | None] | None"]
TransformContext: TypeAlias = Callable[[list[Message]], "list[Message] | Awaitable[list[Message]]"]

T = TypeVar("T")


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


@dataclass
class Hooks:
    """The hooks of one agent. Add with ``hooks.before_tool_call(fn)`` (usable as a decorator)."""

    before: list[BeforeToolCall] = field(default_factory=list)
    after: list[AfterToolCall] = field(default_factory=list)
    transform: list[TransformContext] = field(default_factory=list)

    def before_tool_call(self, fn: T) -> T:
        self.before.append(fn)  # type: ignore[arg-type]
        return fn

    def after_tool_call(self, fn: T) -> T:
        self.after.append(fn)  # type: ignore[arg-type]
        return fn

    def transform_context(self, fn: T) -> T:
        self.transform.append(fn)  # type: ignore[arg-type]
        return fn

    async def run_before(self, info: ToolCallInfo) -> Block | None:
        for fn in self.before:
            verdict = await _call(fn, info)
            if isinstance(verdict, Block):
                return verdict
        return None

    async def run_after(self, info: ToolCallInfo, result: ToolResult) -> ToolResult:
        for fn in self.after:
            replaced = await _call(fn, info, result)
            if isinstance(replaced, ToolResult):
                result = replaced
        return result

    async def run_transform(self, messages: list[Message]) -> list[Message]:
        for fn in self.transform:
            messages = list(await _call(fn, messages))
        return messages
