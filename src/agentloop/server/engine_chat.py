"""``POST /engine/chat``: one stateless run of the server's agent over a history the caller sends.

The caller (a gateway) owns the conversation: it sends the whole history each time and keeps
whatever comes back. The server owns the behaviour: model, tools and rules come from its agent
factory, never from the request. So the endpoint only has to (1) refuse bad requests before a
stream opens, with a status and a message naming the field, (2) turn the OpenAI-style wire
messages into agentloop messages, and (3) translate the loop's events into the contract's five
SSE events, ending with exactly one ``done`` or ``error``.

A failed tool call is reported to the model, which usually corrects itself. When it cannot (the
same call, with the same arguments, fails the same way three times in one request) the run is
stopped and the stream ends with ``error{code: "tool_error"}``, instead of burning the caller's
budget on a loop that will not get anywhere.

The gateway of the Agent Loop Spec names who a request is for in two headers it sets after its
own auth: ``X-Actor-ID`` and ``X-Actor-Permissions`` (a comma list). They are facts about the
caller's caller, handed to the run's tools read-only (``ToolContext.metadata["actor"]``) so a tool
can scope what it does; the endpoint never grants or refuses anything by them: the bearer token
stays its only auth, and anyone holding it could send any actor.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from agentloop.agent import Agent, Run
from agentloop.events import AgentEnd, LoopEvent, MessageEnd, MessageUpdate, ModelRetry, TextDelta, ToolExecutionEnd
from agentloop.events import ToolExecutionStart as _ToolStart
from agentloop.loop.hooks import maybe_await
from agentloop.messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    TextContent,
    ToolCall,
    ToolResultMessage,
    Usage,
    UserMessage,
)
from agentloop.models.overflow import is_context_overflow, is_overflow_text
from agentloop.server.errors import ApiError, safe_message
from agentloop.server.strict_json import json_text

logger = logging.getLogger("agentloop.server")

DEFAULT_MAX_BODY = 1024 * 1024
DEFAULT_MAX_SAME_TOOL_FAILURES = 3
# Why a call the approval policy would ask about is refused here: a request has nobody to ask.
STATELESS_ASK = "requires approval, which a stateless /engine/chat request cannot give (use a /v1 process)"
AgentFactory = Callable[[], Agent]
# Says whether a bearer token may call the endpoint; may be async (a store lookup).
Authorize = Callable[[str], bool | Awaitable[bool]]
# Admits a well-formed request of a token's just before its run starts (may raise ``ApiError``,
# e.g. 429 past an account's input rate): a request refused as malformed must not count.
Admit = Callable[[str], Awaitable[None] | None]
# Fits a request's fresh agent to the token's caller before its run starts (its account's approval
# policy: the factory is not told who calls); may be async, and may raise ``ApiError``.
Prepare = Callable[[str, Agent], Awaitable[None] | None]

# ------------------------------------------------------------------ request shape


class _Model(BaseModel):
    # Unknown fields are ignored: a gateway may send more than this version knows about.
    model_config = ConfigDict(extra="ignore", strict=True)


class WireFunction(_Model):
    name: str = Field(min_length=1)
    # A JSON string on the wire (OpenAI style); an object is accepted too. Checked in conversion
    # so the error names the field instead of a pydantic union branch.
    arguments: Any = "{}"


class WireToolCall(_Model):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: WireFunction


class WireMessage(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None  # required; null only for an assistant message that calls tools
    tool_calls: list[WireToolCall] | None = None
    tool_call_id: str | None = None


class Metadata(_Model):
    correlation_id: str = Field(min_length=1, max_length=256)
    conversation_id: str | None = None
    trigger: Literal["message", "webhook", "schedule"] = "message"
    client_context: dict[str, Any] | None = None


class ChatRequest(_Model):
    messages: list[WireMessage] = Field(min_length=1)
    metadata: Metadata


def _field(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def _invalid(field: str, problem: str) -> ApiError:
    return ApiError(400, "invalid_request", f"{field}: {problem}")


def parse_request(body: bytes) -> ChatRequest:
    """Validate the body; a failure names the first offending field (``metadata.correlation_id``)."""
    try:
        return ChatRequest.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_context=False, include_input=False)[0]
        if err["type"] == "json_invalid":
            raise _invalid("body", "not valid JSON") from None
        if not err["loc"] and err["type"] in ("model_type", "model_attributes_type", "dict_type"):
            raise _invalid("body", "must be a JSON object") from None
        problem = err["msg"]
        raise _invalid(_field(err["loc"]), problem[:1].lower() + problem[1:]) from None


def _arguments(raw: Any, field: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError):  # nesting deeper than the parser goes is not JSON we take
            raise _invalid(field, "not valid JSON") from None
        if isinstance(parsed, dict):
            return parsed
    raise _invalid(field, "must be a JSON object (or a string holding one)")


def to_history(req: ChatRequest) -> tuple[str, list[Message]]:
    """The request's system prefix and its messages as agentloop history.

    Leading system messages become the system prompt prefix (they are the gateway's bootstrap
    prompt); later ones stay in place as ``SystemMessage``. Every assistant tool call must be
    answered by a tool message before the conversation moves on: otherwise the loop would run a
    call the model never made in this run, on the caller's say-so.
    """
    prefix: list[str] = []
    history: list[Message] = []
    pending: dict[str, tuple[str, str]] = {}  # call id -> (tool name, field of the call)
    seen_ids: set[str] = set()

    def require_answered() -> None:
        if pending:
            field = next(iter(pending.values()))[1]
            raise _invalid(field, "no tool message answers this call")

    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.tool_calls is not None and m.role != "assistant":
            raise _invalid(f"{where}.tool_calls", "only assistant messages carry tool calls")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise _invalid(f"{where}.content", "must be a string")
        text = m.content or ""
        if m.role == "tool":
            if not m.tool_call_id:
                raise _invalid(f"{where}.tool_call_id", "field required for a tool message")
            if m.tool_call_id not in pending:
                raise _invalid(f"{where}.tool_call_id", "does not match an unanswered assistant tool call")
            name, _ = pending.pop(m.tool_call_id)
            result = ToolResultMessage(tool_call_id=m.tool_call_id, tool_name=name, content=[TextContent(text=text)])
            history.append(result)
            continue
        require_answered()
        if m.role == "system":
            if history:
                history.append(SystemMessage(content=[TextContent(text=text)], kind="gateway"))
            elif text:
                prefix.append(text)
        elif m.role == "user":
            history.append(UserMessage(content=[TextContent(text=text)]))
        else:
            blocks: list[TextContent | ToolCall] = [TextContent(text=text)] if text else []
            for j, tc in enumerate(m.tool_calls or []):
                call_field = f"{where}.tool_calls[{j}]"
                if tc.id in seen_ids:
                    raise _invalid(f"{call_field}.id", "duplicate tool call id")
                seen_ids.add(tc.id)
                args = _arguments(tc.function.arguments, f"{call_field}.function.arguments")
                blocks.append(ToolCall(id=tc.id, name=tc.function.name, arguments=args))
                pending[tc.id] = (tc.function.name, call_field)
            history.append(AssistantMessage(content=list(blocks), stop_reason="toolUse" if m.tool_calls else "stop"))
    require_answered()
    if not history or history[-1].role not in ("user", "toolResult"):
        raise _invalid("messages", "the last message must be from the user or a tool")
    return "\n\n".join(prefix), history


# ------------------------------------------------------------------ actor headers

ACTOR_ID_HEADER = "X-Actor-ID"
ACTOR_PERMISSIONS_HEADER = "X-Actor-Permissions"
MAX_ACTOR_ID = 256
MAX_PERMISSION = 256
MAX_PERMISSIONS_HEADER = 4096
# Visible ASCII without spaces: an id or a permission is a token (``owner_abc123``, ``memory:*``),
# and nothing a tool might print, log or put in a path can hide a control character or a look-alike.
_TOKEN = re.compile(r"[\x21-\x7e]+")


def _one_header(headers: Headers, name: str) -> str | None:
    values = headers.getlist(name)
    if len(values) > 1:  # two identities for one request: which one the gateway meant is unknowable
        raise _invalid(name, "sent more than once")
    return values[0] if values else None


def parse_actor(headers: Headers) -> MappingProxyType[str, Any] | None:
    """The gateway's actor headers as ``{"id", "permissions"}`` (read-only), None without them.

    Both or neither: a gateway sets the pair, and half of it is a gateway fault that a tool
    should not have to guess about. A malformed value is refused (400) before the stream opens;
    the message names the header, never its value. An empty ``X-Actor-Permissions`` is an actor
    without permissions.
    """
    actor_id = _one_header(headers, ACTOR_ID_HEADER)
    raw = _one_header(headers, ACTOR_PERMISSIONS_HEADER)
    if actor_id is None and raw is None:
        return None
    if actor_id is None:
        raise _invalid(ACTOR_ID_HEADER, f"required with {ACTOR_PERMISSIONS_HEADER}")
    if raw is None:
        raise _invalid(ACTOR_PERMISSIONS_HEADER, f"required with {ACTOR_ID_HEADER}")
    actor_id = actor_id.strip()
    if len(actor_id) > MAX_ACTOR_ID or not _TOKEN.fullmatch(actor_id):
        raise _invalid(ACTOR_ID_HEADER, f"must be 1 to {MAX_ACTOR_ID} visible ASCII characters, without spaces")
    if len(raw) > MAX_PERMISSIONS_HEADER:
        raise _invalid(ACTOR_PERMISSIONS_HEADER, f"longer than {MAX_PERMISSIONS_HEADER} characters")
    items = [p.strip() for p in raw.split(",")] if raw.strip() else []
    for item in items:
        if len(item) > MAX_PERMISSION or not _TOKEN.fullmatch(item):
            problem = f"must be a comma list of permissions, each 1 to {MAX_PERMISSION} visible ASCII characters"
            raise _invalid(ACTOR_PERMISSIONS_HEADER, problem)
    return MappingProxyType({"id": actor_id, "permissions": tuple(dict.fromkeys(items))})


# ------------------------------------------------------------------ loop events -> SSE events


def _usage(usage: Usage) -> dict[str, int]:
    # Provider-neutral usage counts cached input apart; the contract's prompt_tokens (OpenAI's
    # meaning) is everything the model read.
    return {
        "prompt_tokens": usage.input + usage.cache_read + usage.cache_write,
        "completion_tokens": usage.output,
    }


class EventTranslator:
    """Turns loop events into ``(event name, data)`` pairs of the contract.

    It remembers the tool calls each assistant message made, so a call the loop finishes without
    ever starting (unknown tool, blocked by a hook) still gets its ``tool-call`` before its result.

    A model call that fails after some of its text was streamed and is then retried (or handed to
    a fallback model) starts its answer again, yet the caller concatenates every ``text-delta`` and
    has no event that takes text back. So the text sent during the current model call is kept: the
    retry's text is checked against it and only what goes beyond it is sent. A retry that answers
    differently ends the stream with ``error{provider_error}``, which the caller can act on, rather
    than leave it a garbled answer ("Hello, wHello, world.") it would store as the reply.
    """

    def __init__(self, max_same_failures: int = DEFAULT_MAX_SAME_TOOL_FAILURES) -> None:
        self._calls: dict[str, ToolCall] = {}
        self._announced: set[str] = set()
        self._last_assistant: AssistantMessage | None = None
        self._failures: dict[tuple[str, str, str], int] = {}
        self._max_same_failures = max_same_failures
        self._sent = ""  # the text sent during the current model call, across its attempts
        self._replayed: int | None = None  # a retry's text matched so far against _sent; None: not replaying
        self.outcome = "incomplete"  # what the log line at the end says

    def feed(self, event: LoopEvent) -> list[tuple[str, dict[str, Any]]]:
        if isinstance(event, MessageUpdate):
            if isinstance(event.event, TextDelta) and event.event.delta:
                return self._text(event.event.delta)
            return []
        if isinstance(event, ModelRetry):
            if self._sent:  # the next attempt must first say again what was already sent
                self._replayed = 0
            return []
        if isinstance(event, MessageEnd):
            if isinstance(event.message, AssistantMessage):
                self._last_assistant = event.message
                for tc in event.message.tool_calls:
                    self._calls[tc.id] = tc
                if event.message.stop_reason != "error":  # the model call is over (a failed attempt may be retried)
                    short = self._replayed is not None  # the retry ended before repeating what was sent
                    self._sent, self._replayed = "", None
                    if short:
                        return [self._diverged()]
            return []
        if isinstance(event, _ToolStart):
            self._announced.add(event.tool_call_id)
            return [("tool-call", {"id": event.tool_call_id, "name": event.tool_name, "arguments": event.args})]
        if isinstance(event, ToolExecutionEnd):
            out: list[tuple[str, dict[str, Any]]] = []
            if event.tool_call_id not in self._announced:
                known = self._calls.get(event.tool_call_id)
                args = known.arguments if known is not None else {}
                self._announced.add(event.tool_call_id)
                out.append(("tool-call", {"id": event.tool_call_id, "name": event.tool_name, "arguments": args}))
            key = "error" if event.is_error else "output"
            out.append(("tool-result", {"id": event.tool_call_id, key: event.result.text}))
            if event.is_error and self._repeated_failure(event):
                out.append(self._give_up(event))
            return out
        if isinstance(event, AgentEnd):
            return [self._end(event)]
        return []

    def _text(self, delta: str) -> list[tuple[str, dict[str, Any]]]:
        """The ``text-delta`` for ``delta``: all of it, or during a retry the part beyond what was sent."""
        if self._replayed is not None:
            expected = self._sent[self._replayed :]
            overlap = min(len(delta), len(expected))
            if delta[:overlap] != expected[:overlap]:
                return [self._diverged()]
            self._replayed += overlap
            delta = delta[overlap:]
            if self._replayed < len(self._sent):
                return []
            self._replayed = None  # caught up: from here on the retry's text is new
            if not delta:
                return []
        self._sent += delta
        return [("text-delta", {"content": delta})]

    def _diverged(self) -> tuple[str, dict[str, Any]]:
        self.outcome = "provider_error"
        message = (
            "The model provider failed while answering, and its retry answered differently from the "
            "text already sent; that text cannot be taken back, so this answer is incomplete."
        )
        return ("error", {"code": "provider_error", "message": message})

    @property
    def finished(self) -> bool:
        """A ``done`` or ``error`` was produced: the stream ends here."""
        return self.outcome != "incomplete"

    def _repeated_failure(self, event: ToolExecutionEnd) -> bool:
        """Count this failure by its signature (tool, arguments, error); True once it is one too many."""
        known = self._calls.get(event.tool_call_id)
        args = json.dumps(known.arguments if known is not None else {}, sort_keys=True, default=str)
        signature = (event.tool_name, args, event.result.text)
        count = self._failures.get(signature, 0) + 1
        self._failures[signature] = count
        return count >= self._max_same_failures

    def _give_up(self, event: ToolExecutionEnd) -> tuple[str, dict[str, Any]]:
        self.outcome = "tool_error"
        message = (
            f"The tool {event.tool_name} failed {self._max_same_failures} times with the same arguments "
            f"and the same error; the model could not recover: {safe_message(event.result.text, 'tool failed')}"
        )
        return ("error", {"code": "tool_error", "message": message})

    def _end(self, event: AgentEnd) -> tuple[str, dict[str, Any]]:
        if event.stop_reason != "error":
            self.outcome = event.stop_reason
            # the contract spells an answer cut off at the output limit as the providers do
            reason = "max_tokens" if event.stop_reason == "length" else event.stop_reason
            return ("done", {"finish_reason": reason, "usage": _usage(event.usage)})
        last = self._last_assistant
        overflow = (last is not None and is_context_overflow(last)) or is_overflow_text(event.error or "")
        if overflow:
            self.outcome = "context_overflow"
            return ("error", {"code": "context_overflow", "message": "The conversation is too long for the model."})
        self.outcome = "provider_error"
        detail = safe_message(event.error, "")
        message = f"The model provider failed: {detail}" if detail else "The model provider failed."
        return ("error", {"code": "provider_error", "message": message})


# ------------------------------------------------------------------ the endpoint


def _log(level: int, message: str, correlation_id: str | None, *, exc_info: bool = False, **fields: Any) -> None:
    """One JSON line per record; ``correlation_id`` also rides on the record for log routers.

    Headers are never logged, so a bearer token cannot end up in a log line.
    """
    if not logger.isEnabledFor(level):
        return
    payload = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "level": logging.getLevelName(level).lower(),
        "component": "engine_chat",
        "message": message,
        "correlation_id": correlation_id,
        **fields,
    }
    if exc_info:  # inside the JSON, so the record stays one line for log shippers
        payload["exception"] = traceback.format_exc()
    logger.log(level, json.dumps(payload, default=str), extra={"correlation_id": correlation_id})


def _correlation_hint(body: bytes) -> str | None:
    """The correlation id of a body that failed validation, when one can still be read, for the log."""
    try:
        data = json.loads(body)
        cid = data["metadata"]["correlation_id"]
    except Exception:
        return None
    return cid[:256] if isinstance(cid, str) and cid else None


class EngineChat:
    """The endpoint (``handle`` is the route). One instance per app; it holds configuration, never conversation."""

    def __init__(
        self,
        agent_factory: AgentFactory,
        authorize: Authorize,
        *,
        max_body: int = DEFAULT_MAX_BODY,
        admit: Admit | None = None,
        prepare: Prepare | None = None,
    ) -> None:
        self.agent_factory = agent_factory
        self.authorize = authorize
        self.max_body = max_body
        self.admit = admit
        self.prepare = prepare

    async def handle(self, request: Request) -> Response:
        started = time.monotonic()
        try:
            token = await self._check_auth(request)
            body = await self._read_body(request)
        except ApiError as exc:
            _log(logging.WARNING, "request rejected", None, status=exc.status, code=exc.code)
            return exc.response()
        except ClientDisconnect:
            return Response(status_code=499)
        cid: str | None = None
        try:
            req = parse_request(body)
            cid = req.metadata.correlation_id
            actor = parse_actor(request.headers)
            system_prefix, history = to_history(req)
            if self.admit is not None:  # (only now: a malformed request is refused for free)
                await maybe_await(self.admit(token))
            metadata = req.metadata.model_dump()
            if actor is not None:  # (from the headers only: the body's metadata has no ``actor`` field)
                metadata["actor"] = actor
            run = await self._start(token, system_prefix, history, cid, metadata)
        except ApiError as exc:
            cid = cid or _correlation_hint(body)
            _log(logging.WARNING, "request rejected", cid, status=exc.status, code=exc.code, detail=exc.message)
            return exc.response()
        _log(
            logging.INFO,
            "request started",
            cid,
            conversation_id=req.metadata.conversation_id,
            trigger=req.metadata.trigger,
            messages=len(req.messages),
            actor_id=actor["id"] if actor is not None else None,  # (a name, not a credential: for tracing)
            run_id=run.id,
        )
        return EventSourceResponse(self._stream(run, cid, started), ping=15)

    async def _check_auth(self, request: Request) -> str:
        """The request's bearer token, once ``authorize`` accepted it (401 otherwise)."""
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        ok = False
        if scheme.lower() == "bearer" and token:
            try:
                ok = await maybe_await(self.authorize(token))
            except ApiError:  # a refusal the check chose (429 past an account's input rate)
                raise
            except Exception:
                _log(logging.ERROR, "token check failed", None, exc_info=True)
                raise ApiError(503, "engine_unavailable", "The engine cannot check credentials right now.") from None
        if not ok:
            raise ApiError(401, "unauthorized", "Missing or invalid bearer token.")
        return token

    async def _read_body(self, request: Request) -> bytes:
        content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type != "application/json":
            raise _invalid("content-type", "expected application/json")
        too_large = ApiError(413, "payload_too_large", f"The request body exceeds {self.max_body} bytes.")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def _start(
        self, token: str, system_prefix: str, history: list[Message], cid: str, metadata: dict[str, Any]
    ) -> Run:
        """The request's run, on an agent fitted to ``token``'s caller (``prepare``); its
        ``metadata`` (the correlation id among it) reaches its tools."""
        try:
            agent = self.agent_factory()
        except Exception:
            _log(logging.ERROR, "agent factory failed", cid, exc_info=True)
            raise ApiError(503, "engine_unavailable", "The engine is not available right now.") from None
        await self._prepare(token, agent, cid)
        cfg = agent.config
        if system_prefix:
            # A copy: the factory may hand out one shared agent, and this prefix is per request.
            cfg = replace(cfg, system_prompt="\n\n".join(p for p in (system_prefix, cfg.system_prompt) if p))
        return Run(cfg, history, [], stream=True, metadata=MappingProxyType(metadata))

    async def _prepare(self, token: str, agent: Agent, cid: str) -> None:
        """``prepare`` (if any) on the request's agent. A failure refuses the request (503, or
        the ``ApiError`` it chose): an agent it did not fit (one without its caller's policy) never runs."""
        if self.prepare is None:
            return
        try:
            await maybe_await(self.prepare(token, agent))
        except ApiError:
            raise
        except Exception:
            _log(logging.ERROR, "agent preparation failed", cid, exc_info=True)
            raise ApiError(503, "engine_unavailable", "The engine is not available right now.") from None

    async def _stream(self, run: Run, cid: str, started: float) -> AsyncIterator[ServerSentEvent]:
        translator = EventTranslator()
        try:
            async with aclosing(run.events()) as events:
                async for event in events:
                    for name, data in translator.feed(event):
                        # (strict JSON: a model's 1e999 in a call's arguments is sent as null)
                        yield ServerSentEvent(data=json_text(data), event=name)
                    if translator.finished:
                        break  # leaving run.events() early aborts the run (a tool_error, a retry that diverged)
        except asyncio.CancelledError:
            # The client went away: leaving run.events() has aborted the run and its tools.
            translator.outcome = "client_disconnected"
            raise
        except Exception as exc:
            translator.outcome = "internal_error"
            _log(logging.ERROR, "stream failed", cid, exc_info=True, error_type=type(exc).__name__)
            data = {"code": "provider_error", "message": "The engine failed while answering."}
            yield ServerSentEvent(data=json_text(data), event="error")
        finally:
            level = logging.INFO if translator.outcome not in ("internal_error", "provider_error") else logging.ERROR
            _log(
                level,
                "request finished",
                cid,
                outcome=translator.outcome,
                run_id=run.id,
                duration_ms=round((time.monotonic() - started) * 1000),
            )
