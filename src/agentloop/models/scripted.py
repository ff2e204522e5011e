"""A deterministic provider for tests, demos and benchmarks.

It answers from a list of replies (one per call) or from a function of the request, and streams
them through the same builder a real adapter uses, so the loop cannot tell the difference.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentloop.events import ErrorKind, StreamDone, StreamError, StreamEvent
from agentloop.messages import (
    AssistantMessage,
    TextContent,
    ThinkingContent,
    ToolCall,
    storable_value,
)
from agentloop.models.base import (
    AssistantBuilder,
    Model,
    ModelInfo,
    ModelRequest,
    ProviderError,
    make_usage,
)


@dataclass
class Reply:
    """One scripted answer: optional thinking, text, and tool calls ``(name, args)`` or ``ToolCall``."""

    text: str = ""
    tool_calls: Sequence[ToolCall | tuple[str, dict[str, Any]]] = field(default_factory=list)
    thinking: str = ""
    input_tokens: int = 10
    output_tokens: int = 5


Scripted: TypeAlias = str | Reply | AssistantMessage | BaseException
ScriptFn: TypeAlias = Callable[[ModelRequest], Scripted | Awaitable[Scripted]]

_ids = itertools.count(1)


def call(tool_name: str, /, **arguments: Any) -> tuple[str, dict[str, Any]]:
    """Shorthand for a scripted tool call: ``Reply(tool_calls=[call("echo", text="hi")])``."""
    return (tool_name, arguments)


class _ScriptCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: dict[str, Any] | None = None


class _ScriptReply(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = ""
    thinking: str = ""
    tool_calls: list[_ScriptCall] = Field(default_factory=list)
    error: str | None = None
    kind: ErrorKind = "server"


class _ScriptFile(BaseModel):
    """The JSON a ``scripted:`` model file holds (see ``ScriptedModel.from_file``)."""

    model_config = ConfigDict(extra="forbid")
    latency: float = Field(0.0, ge=0)
    chunk: int = Field(0, ge=0)
    replies: list[str | _ScriptReply]


class ScriptedModel(Model):
    """Replays ``script`` (a list, consumed one reply per call) or calls it (a function).

    ``latency`` seconds are awaited per call; ``chunk`` splits text into deltas of that many
    characters (0 = one delta). Every request is kept in ``requests``.
    """

    def __init__(
        self,
        script: Iterable[Scripted] | ScriptFn,
        *,
        latency: float = 0.0,
        chunk: int = 0,
        info: ModelInfo | None = None,
        keep_requests: bool = True,
    ) -> None:
        self.info = info or ModelInfo(provider="scripted", id="scripted", context_window=1_000_000)
        self._fn: ScriptFn | None = script if callable(script) else None
        self._queue: list[Scripted] = [] if callable(script) else list(script)
        self.latency = latency
        self.chunk = chunk
        self.keep_requests = keep_requests
        self.requests: list[ModelRequest] = []

    @classmethod
    def from_file(cls, path: str) -> ScriptedModel:
        """A script from a JSON file: a list of replies, each a string or
        ``{"text": ..., "thinking": ..., "tool_calls": [{"name": ..., "arguments": {...}}], "error": ...}``;
        optional top-level form ``{"latency": s, "chunk": n, "replies": [...]}``. Lets the CLI and
        subprocess tests run deterministic conversations (``--model scripted:/path/to/script.json``).
        """
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read scripted model file {path!r}: {exc}") from exc
        try:
            script = _ScriptFile.model_validate({"replies": data} if isinstance(data, list) else data)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            if len(errors) > 1:  # a reply that is an object: "it is not a string either" is noise
                errors = [e for e in errors if e["loc"][-1:] != ("str",)]
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'] if not str(p).startswith('_Script')) or 'file'}: {e['msg']}"
                for e in errors[:5]
            )
            raise ValueError(f"scripted model file {path!r} is not a valid script: {problems}") from None
        replies: list[Scripted] = []
        for item in script.replies:
            if isinstance(item, str):
                replies.append(item)
            elif item.error is not None:
                replies.append(ProviderError(item.error, kind=item.kind))
            else:
                calls = [(c.name, dict(c.arguments or {})) for c in item.tool_calls]
                replies.append(Reply(text=item.text, thinking=item.thinking, tool_calls=calls))
        return cls(replies, latency=script.latency, chunk=script.chunk)

    @property
    def calls(self) -> int:
        return len(self.requests)

    async def _next(self, request: ModelRequest) -> Scripted:
        if self._fn is not None:
            result = self._fn(request)
            if hasattr(result, "__await__"):  # cheaper than inspect.isawaitable's ABC check
                result = await result
            return result
        if not self._queue:
            raise ProviderError("scripted model has no reply left", kind="bad_request")
        return self._queue.pop(0)

    async def respond(self, request: ModelRequest) -> StreamDone | StreamError:
        """Build the answer directly, without events: the cheap path when nobody streams."""
        if self.keep_requests:
            self.requests.append(request)
        if self.latency:
            await asyncio.sleep(self.latency)
        try:
            if self._fn is not None:  # inline: one coroutine less per call
                reply = self._fn(request)
                if hasattr(reply, "__await__"):
                    reply = await reply
            else:
                reply = await self._next(request)
            if isinstance(reply, BaseException):
                raise reply
        except Exception as exc:
            err = self.classify(exc)
            return AssistantBuilder(self.info).fail(str(err), err.kind, err.status, err.retry_after)
        info = self.info
        if isinstance(reply, str):  # the common final answer, without an intermediate Reply
            usage = make_usage(info, input=Reply.input_tokens, output=Reply.output_tokens)
            blocks: list[TextContent | ThinkingContent | ToolCall] = [TextContent(text=reply)] if reply else []
            return StreamDone(
                message=AssistantMessage(content=blocks, provider=info.provider, model=info.id, usage=usage)
            )
        if isinstance(reply, AssistantMessage):
            return StreamDone(message=reply)
        content: list[TextContent | ThinkingContent | ToolCall] = []
        if reply.thinking:
            content.append(ThinkingContent(thinking=reply.thinking))
        if reply.text:
            content.append(TextContent(text=reply.text))
        for tc in reply.tool_calls:
            if isinstance(tc, tuple):  # (arguments made storable, as a provider's are on the way in)
                tc = ToolCall(id=f"call_{next(_ids)}", name=tc[0], arguments=storable_value(tc[1]))
            content.append(tc)
        return StreamDone(
            message=AssistantMessage(
                content=content,
                provider=self.info.provider,
                model=self.info.id,
                usage=make_usage(self.info, input=reply.input_tokens, output=reply.output_tokens),
                stop_reason="toolUse" if reply.tool_calls else "stop",
            )
        )

    async def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
        if self.keep_requests:
            self.requests.append(request)
        if self.latency:
            await asyncio.sleep(self.latency)
        reply = await self._next(request)
        yield out.start()
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(reply, str):
            reply = Reply(text=reply)
        if isinstance(reply, AssistantMessage):
            for event in self._replay(reply, out):
                yield event
            for event in out.finish(reply.stop_reason, reply.usage):
                yield event
            return
        if reply.thinking:
            for event in out.thinking(reply.thinking):
                yield event
        step = self.chunk if self.chunk > 0 else max(1, len(reply.text))
        for i in range(0, len(reply.text), step):
            for event in out.text(reply.text[i : i + step]):
                yield event
            if self.chunk:  # like a network stream, let others run between chunks
                await asyncio.sleep(0)
        for tc in reply.tool_calls:
            if isinstance(tc, tuple):
                tc = ToolCall(id=f"call_{next(_ids)}", name=tc[0], arguments=tc[1])
            for event in out.tool_call(tc.id, tc.id, tc.name):
                yield event
            raw = tc.invalid_arguments if tc.invalid_arguments is not None else json.dumps(tc.arguments)
            for event in out.tool_args(tc.id, raw):  # (a script may send broken arguments too)
                yield event
        usage = make_usage(self.info, input=reply.input_tokens, output=reply.output_tokens)
        for event in out.finish(usage=usage):
            yield event

    def _text(self, text: str, out: AssistantBuilder) -> list[StreamEvent]:
        if not text:
            return []
        if self.chunk <= 0:
            return out.text(text)
        events: list[StreamEvent] = []
        for i in range(0, len(text), self.chunk):
            events.extend(out.text(text[i : i + self.chunk]))
        return events

    def _replay(self, message: AssistantMessage, out: AssistantBuilder) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for block in message.content:
            if isinstance(block, TextContent):
                events.extend(self._text(block.text, out))
            elif isinstance(block, ThinkingContent):
                events.extend(out.thinking(block.thinking, block.signature))
            else:
                events.extend(out.tool_call(block.id, block.id, block.name))
                events.extend(out.tool_args(block.id, json.dumps(block.arguments)))
        return events
