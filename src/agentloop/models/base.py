"""What every provider adapter is: a ``Model`` that turns a request into a stream of events.

Adapters implement ``_stream`` and describe what they receive through an ``AssistantBuilder``,
which keeps the partial message, emits the protocol's events in the right order and computes
cost. ``Model.stream`` wraps ``_stream`` so that an adapter bug, a network error or garbage from
the provider becomes a terminal ``error`` event instead of an exception in the loop.
"""

from __future__ import annotations

import html
import inspect
import json
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias, TypeVar, cast, get_args

from agentloop.events import (
    ErrorKind,
    StreamDone,
    StreamError,
    StreamEvent,
    StreamStart,
    TextDelta,
    TextEnd,
    TextStart,
    ThinkingDelta,
    ThinkingEnd,
    ThinkingStart,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
)
from agentloop.messages import (
    AssistantMessage,
    Cost,
    FileContent,
    Message,
    StopReason,
    TextContent,
    ThinkingContent,
    ToolCall,
    Usage,
    document_text,
    storable,
    storable_value,
)
from agentloop.models.overflow import is_overflow_text
from agentloop.urls import MASK, redact_secrets


def file_text(block: FileContent) -> str | None:
    """A text document as a provider without document input is given it: its text in a
    ``<file>`` element with its name and type (None for a PDF)."""
    text = document_text(block)
    if text is None:
        return None
    name = html.escape(block.name or "file")  # a quote or a bracket in the name cannot break the element
    return f'<file name="{name}" type="{block.mime_type}">\n{text}\n</file>'


@dataclass(frozen=True)
class ModelInfo:
    """Facts about one model. Costs are dollars per million tokens."""

    provider: str
    id: str
    context_window: int = 128_000
    max_output: int = 4_096
    input_cost: float = 0.0
    output_cost: float = 0.0
    cache_read_cost: float = 0.0
    cache_write_cost: float = 0.0
    vision: bool = False
    reasoning: bool = False

    @property
    def name(self) -> str:
        return f"{self.provider}:{self.id}"

    def cost(self, usage: Usage) -> Cost:
        m = 1_000_000
        i = self.input_cost * usage.input / m
        o = self.output_cost * usage.output / m
        r = self.cache_read_cost * usage.cache_read / m
        w = self.cache_write_cost * usage.cache_write / m
        return Cost(input=i, output=o, cache_read=r, cache_write=w, total=i + o + r + w)


#: How hard a reasoning model thinks before it answers, said once for every provider: each
#: adapter turns it into its own setting (OpenAI's ``reasoning_effort``, a thinking budget in
#: tokens for Anthropic and Gemini), clamped to what the model takes. A model that does not
#: reason ignores it. The levels are pi's (``minimal`` and ``xhigh`` around the usual three), so a
#: level set for one provider means the nearest thing on another instead of being refused.
Reasoning: TypeAlias = Literal["off", "minimal", "low", "medium", "high", "xhigh"]
REASONING_LEVELS: tuple[str, ...] = get_args(Reasoning)
#: the thinking budget of each level, in tokens, for the providers that take one (``minimal`` is
#: Anthropic's least budget; each adapter also keeps a level within its model's own limits)
THINKING_BUDGETS: dict[str, int] = {"minimal": 1_024, "low": 2_048, "medium": 8_192, "high": 24_576, "xhigh": 32_768}


def check_reasoning(value: Any) -> Reasoning | None:
    """``value`` as a reasoning level (None: the model's own default); ValueError otherwise."""
    if value is None or value in REASONING_LEVELS:
        return value  # type: ignore[no-any-return]
    raise ValueError(f"reasoning must be one of {', '.join(REASONING_LEVELS)}, got {value!r}")


def thinking_budget(level: Reasoning, info: ModelInfo, minimum: int = 0, maximum: int | None = None) -> int:
    """The thinking budget in tokens of ``level`` on ``info``'s model: 0 for off, else the level's,
    within the model's output limit and ``maximum`` (the most the provider takes for it) and at
    least ``minimum`` (the least it takes: a model's limits win over a level's number)."""
    if level == "off":
        return 0
    budget = min(THINKING_BUDGETS[level], info.max_output // 2)
    if maximum is not None:
        budget = min(budget, maximum)
    return max(minimum, budget)


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the model sees it: a name, a description and a JSON schema for its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass
class ModelRequest:
    """One model call. ``tools`` empty means the model must answer in text."""

    system_prompt: str
    messages: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float | None = None
    parallel_tool_calls: bool = True  # False: the loop runs calls one by one, so ask for one per turn
    cache_key: str | None = None  # the conversation (a process id): a prompt cache routes its calls together
    reasoning: Reasoning | None = None  # None: the model's own setting
    # the agent's provider-request hooks (``Hooks.before_provider_request``), set only when it has
    # some: each adapter hands them its payload through ``Model.payload`` just before sending it
    shape_payload: PayloadShaper | None = None


@dataclass(frozen=True)
class ProviderRequest:
    """What a provider-request hook sees: the payload an adapter is about to send, exactly as it
    will go (an OpenAI-compatible chat body, Anthropic's messages body, Gemini's body, llama.cpp's
    completion arguments; ``api`` says which), and the model it goes to. Not to be changed in
    place: a hook returns the replacement."""

    provider: str
    model: str
    api: str
    payload: dict[str, Any]


#: What gives an adapter's payload back, maybe replaced, before it is sent; raises a
#: ``ProviderError`` (the call fails as a provider's refusal would) when a hook fails.
PayloadShaper: TypeAlias = Callable[[ProviderRequest], Awaitable[dict[str, Any]]]


def make_usage(info: ModelInfo, input: int = 0, output: int = 0, cache_read: int = 0, cache_write: int = 0) -> Usage:
    """The usage of one call from the provider's counts. A count below zero (a server's bug) is
    taken as none: added to a run's or an account's spend, it took back what other calls had cost,
    and a budget let through more than it allows."""
    input, output, cache_read, cache_write = (max(0, n) for n in (input, output, cache_read, cache_write))
    usage = Usage(
        input=input,
        output=output,
        cache_read=cache_read,
        cache_write=cache_write,
        total_tokens=input + output + cache_read + cache_write,
    )
    if info.input_cost or info.output_cost or info.cache_read_cost or info.cache_write_cost:
        usage.cost = info.cost(usage)
    return usage


def endpoint(
    api_key: str | None, base_url: str | None, *, key_env: str, url_env: str, placeholder: str
) -> tuple[str | None, str | None]:
    """The API key and base URL of a provider, from the arguments or the environment. A server at
    a custom base URL (vLLM, llama.cpp, a proxy) often needs no key: it gets a placeholder.

    Both are stripped: a key read from a file (a mounted secret) ends in a newline, which no HTTP
    header may hold, and every call failed as a connection error, retried in vain."""
    url = (base_url or os.environ.get(url_env) or "").strip() or None
    key = (api_key or os.environ.get(key_env) or "").strip() or None
    if key is None and url is not None:
        key = placeholder
    return key, url


#: What an adapter asks for its API key before each call: a function, plain or async, that returns
#: the key valid now (an OAuth token that expires hourly, a key a vault rotates, an Azure AD token).
KeyProvider: TypeAlias = Callable[[], str | Awaitable[str]]
#: An adapter's ``api_key``: a fixed key, a ``KeyProvider``, or None (the environment's key).
ApiKey: TypeAlias = str | KeyProvider | None

_KEYS_MASKED = 4  # of a provider's keys, how many of the latest each error message masks


class _Rekeyable(Protocol):
    """An official SDK's client: ``with_options`` copies it with another key, sharing its pool."""

    def with_options(self, *, api_key: str) -> Any: ...


Client = TypeVar("Client", bound=_Rekeyable)


class KeySource:
    """An adapter's API key: a fixed one, or the answer of a ``KeyProvider`` asked before every
    call, so a long-running server follows a credential that changes under it (a fixed key held
    for the adapter's lifetime failed every call once the token expired, until a restart).

    A provider that raises (or answers no key) is an ``auth`` error of that call, never a
    traceback; one that raises a ``ProviderError`` chooses its own kind (``connection``, say, for
    a vault that is down for a moment: the loop retries it). A synchronous provider runs in the
    event loop: one that does I/O should be async."""

    def __init__(self, fixed: str | None, provider: KeyProvider | None, what: str) -> None:
        self.fixed = fixed
        self.provider = provider
        self.what = what
        self._seen: list[str] = []  # the provider's latest keys, for masking
        self._keyed: tuple[str, object, object] | None = None  # the latest key, its base client and copy

    @classmethod
    def of(
        cls, api_key: ApiKey, base_url: str | None, *, key_env: str, url_env: str, placeholder: str, what: str
    ) -> tuple[KeySource, str | None]:
        """The key source and base URL of an adapter from its ``api_key`` and ``base_url``
        arguments (see ``endpoint``); a provider replaces the environment's key."""
        if callable(api_key):
            _, url = endpoint(None, base_url, key_env=key_env, url_env=url_env, placeholder=placeholder)
            return cls(None, api_key, what), url
        key, url = endpoint(api_key, base_url, key_env=key_env, url_env=url_env, placeholder=placeholder)
        return cls(key, None, what), url

    @property
    def dynamic(self) -> bool:
        return self.provider is not None

    async def get(self) -> str | None:
        """The key for the call about to be made: the fixed one, or the provider's answer now."""
        if self.provider is None:
            return self.fixed
        try:
            value = self.provider()
            if inspect.isawaitable(value):
                value = await value
        except ProviderError:
            raise
        except Exception as exc:  # the run gets an error result, not the provider's traceback
            raise ProviderError(
                mask(f"the {self.what} API key provider failed: {type(exc).__name__}: {exc}", self.secrets()),
                kind="auth",
            ) from exc
        if not isinstance(value, str) or not value.strip():
            got = "an empty string" if isinstance(value, str) else type(value).__name__
            raise ProviderError(f"the {self.what} API key provider returned no key (got {got})", kind="auth")
        key = value.strip()  # (a header cannot hold the newline a key read from a file ends in)
        if key not in self._seen:
            self._seen = [*self._seen[-(_KEYS_MASKED - 1) :], key]
        return key

    async def refreshed(self, refused: str | None) -> str | None:
        """After the provider refused ``refused`` (HTTP 401, a token that expired between asking
        and sending): the key provider's key when it gives another one, for one more try; None
        when there is no provider or it gives the same key (a retry would only be refused too)."""
        if self.provider is None:
            return None
        key = await self.get()
        return key if key != refused else None

    def client_for(self, base: Client, key: str | None) -> Client:
        """The SDK client of a call made with ``key``: ``base`` for a fixed key, else a copy with
        the key (kept while the key and ``base`` are unchanged; a copy shares the connection pool)."""
        if key is None or self.provider is None:
            return base
        if self._keyed is None or self._keyed[0] != key or self._keyed[1] is not base:
            self._keyed = (key, base, base.with_options(api_key=key))
        return cast("Client", self._keyed[2])

    def secrets(self) -> tuple[str, ...]:
        """The keys an error message must not show: the fixed one, or the provider's latest."""
        return (self.fixed,) if self.fixed else tuple(self._seen)


Sent = TypeVar("Sent")


async def send_keyed(
    keys: KeySource,
    base: Client,
    send: Callable[[Client], Awaitable[Sent]],
    refused: type[Exception],
) -> tuple[Client, Sent]:
    """``send`` through the SDK client of the key valid now, and that client: ``base`` itself for
    a fixed key, else its copy with the key (``KeySource.client_for``). A refusal of the key (the
    SDK's ``refused``, its 401) with a key provider asks it once more (the token may have expired
    on the way) and sends once more if it gives another key."""
    key = await keys.get()
    client = keys.client_for(base, key)
    try:
        return client, await send(client)
    except refused:
        fresh = await keys.refreshed(key)
        if fresh is None:
            raise
    client = keys.client_for(base, fresh)
    return client, await send(client)


class ProviderError(Exception):
    """Raised inside adapters; ``Model.stream`` turns it into a terminal ``error`` event."""

    def __init__(
        self,
        message: str,
        kind: ErrorKind = "unknown",
        status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.status = status
        self.retry_after = retry_after


# how a system message is shown to a provider whose history has no place for one after the start
NOTICE_PREFIX = "[system notice] "


def http_error(
    status: int,
    text: str,
    *,
    retry_after: float | None = None,
    rate_limited: bool = False,
    auth: bool = False,
    overflow: bool = False,
) -> ProviderError:
    """What an HTTP error answer means to the loop, the ladder every adapter shares: 429 (or a
    provider's own ``rate_limited`` signal) and 5xx are transient (retried, after ``retry_after``
    when the server said), 401/403 (or ``auth``) bad credentials, 400/413 with ``overflow`` text
    a context overflow, 408 a timeout, anything else a bad request."""
    if status == 429 or rate_limited:
        return ProviderError(text, kind="rate_limit", status=status, retry_after=retry_after)
    if status >= 500:
        return ProviderError(text, kind="server", status=status, retry_after=retry_after)
    if status in (401, 403) or auth:
        return ProviderError(text, kind="auth", status=status)
    if status in (400, 413) and overflow:
        return ProviderError(text, kind="overflow", status=status)
    if status == 408:
        return ProviderError(text, kind="timeout", status=status)
    return ProviderError(text, kind="bad_request", status=status)


STREAM_CUT = "the stream ended before the answer was finished"
_NOT_A_STREAM = ("application/json", "text/html")  # (text/plain: some servers label their streams so)
_ERROR_BODY_LIMIT = 65_536
_INVALID_ARGUMENTS_KEPT = 2000  # of a call's arguments that are not a JSON object: what the model is shown
_QUOTE_LIMIT = 300  # how much of a body that is not an error object an error message quotes


def quote_body(body: object) -> str:
    """An error body that is not the provider's error object (a proxy's HTML page, plain text,
    another server's JSON), as an error message quotes it: its start."""
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    elif not isinstance(body, str):
        body = json.dumps(body, ensure_ascii=False, default=str)
    return body.strip()[:_QUOTE_LIMIT] or "(no body)"


def error_parts(error: object) -> tuple[str, int]:
    """What an ``error`` object in a body or a stream says: its message (an object's ``message``,
    ``detail`` or ``type``, else its start, or the start of a string), and the HTTP status its
    ``code`` (or ``status``) names, 0 for none."""
    if not isinstance(error, dict):
        return quote_body(error), 0
    message = str(error.get("message") or error.get("detail") or error.get("type") or quote_body(error))
    code = error.get("code", error.get("status"))
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else 0
    return message, status


async def check_event_stream(response: Any) -> None:
    """A successful answer that is not the event stream asked for (a JSON error body with status
    200, a proxy's HTML page): a ``ProviderError`` with what it says, instead of an empty stream
    taken for a cut one and retried. ``response`` is an ``httpx.Response`` whose body is unread."""
    content_type = str(response.headers.get("content-type", "")).split(";")[0].strip().lower()
    if content_type not in _NOT_A_STREAM:
        return
    raw = b""
    async for chunk in response.aiter_bytes():  # an error, not a download: the start says enough
        raw += chunk
        if len(raw) >= _ERROR_BODY_LIMIT:
            break
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        message, status = error_parts(error)
    else:
        message = raw.decode("utf-8", "replace").strip()[:_QUOTE_LIMIT] or "(empty)"
        status = 0
    text = f"the provider answered {content_type}, not a stream: {message}"
    if status:
        raise http_error(status, text, overflow=is_overflow_text(message))
    raise ProviderError(text, kind="overflow" if is_overflow_text(message) else "invalid_response")


_SECRET_MIN = 8  # a shorter "key" is a placeholder or a word: masking it would garble messages


def mask(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with each of ``secrets`` (at least 8 characters long) replaced by ``***``."""
    for secret in secrets:
        if len(secret) >= _SECRET_MIN:
            text = text.replace(secret, MASK)
    return text


def _string(value: object, what: str) -> str:
    """``value``, which the provider should have sent as a string, or the error that says it did
    not (instead of an ``AttributeError`` from deep inside, which told the user nothing)."""
    if isinstance(value, str):
        return value
    raise ProviderError(
        f"unreadable response: the provider sent {what} as {type(value).__name__}, not a string: "
        f"{quote_body(value)[:100]}",
        kind="invalid_response",
    )


def grow(holder: object, name: str, delta: str) -> None:
    """Append ``delta`` to the string attribute ``name`` of ``holder`` in amortised constant time.

    ``holder.text += delta`` copies the whole text on every delta (the attribute keeps the old
    string alive), so a long answer cost time quadratic in its deltas: 100k of them took seconds
    of CPU. With the attribute's reference dropped first, the local is the string's only owner
    and CPython grows it in place. The attribute is whole again before anything else can run, so
    whoever reads the message mid-stream (an abort storing the partial answer) sees all of it;
    a reader that kept a reference to the old string only costs a copy, never a wrong text."""
    text: str = getattr(holder, name)
    setattr(holder, name, "")
    text += delta
    setattr(holder, name, text)


def stream_broken(what: str, out: AssistantBuilder) -> str:
    """Why a stream failed, with how much of the answer had arrived (a retry starts it again)."""
    got = len(out.message.text)
    return f"{what} ({got} characters of text received)" if got else what


class AssistantBuilder:
    """Accumulates one assistant message from provider deltas and yields protocol events.

    Blocks are opened implicitly: a text delta after a tool call opens a new text block, and so
    on. Tool calls are keyed by the provider's own index so interleaved deltas land correctly.
    """

    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self.message = AssistantMessage(provider=info.provider, model=info.id)
        self._open: int | None = None  # index of the open text/thinking block
        self._tool_args: dict[int, list[str]] = {}  # content index -> raw JSON fragments
        self._tool_index: dict[Any, int] = {}  # provider key -> content index
        self.started = False

    # -- opening ---------------------------------------------------------------------------

    def start(self) -> StreamStart:
        self.started = True
        return StreamStart(partial=self.message)

    def end_block(self) -> list[StreamEvent]:
        """Close the open text or thinking block, so that the next delta starts a new one
        (providers that delimit blocks, like Anthropic, call it at each block end)."""
        if self._open is None:
            return []
        i, self._open = self._open, None
        block = self.message.content[i]
        if isinstance(block, TextContent):
            return [TextEnd(index=i, content=block.text)]
        if isinstance(block, ThinkingContent):
            return [ThinkingEnd(index=i, content=block.thinking)]
        return []

    def text(self, delta: str) -> list[StreamEvent]:
        if not delta:
            return []
        delta = storable(_string(delta, "text"))
        events: list[StreamEvent] = []
        content = self.message.content
        if self._open is None or not isinstance(content[self._open], TextContent):
            events.extend(self.end_block())
            content.append(TextContent(text=""))
            self._open = len(content) - 1
            events.append(TextStart(index=self._open))
        block = content[self._open]
        assert isinstance(block, TextContent)
        grow(block, "text", delta)
        events.append(TextDelta(index=self._open, delta=delta))
        return events

    def thinking(self, delta: str, signature: str | None = None) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        content = self.message.content
        if self._open is None or not isinstance(content[self._open], ThinkingContent):
            events.extend(self.end_block())
            content.append(ThinkingContent(thinking=""))
            self._open = len(content) - 1
            events.append(ThinkingStart(index=self._open))
        block = content[self._open]
        assert isinstance(block, ThinkingContent)
        if delta:
            delta = storable(_string(delta, "thinking"))
            grow(block, "thinking", delta)
            events.append(ThinkingDelta(index=self._open, delta=delta))
        if signature:
            block.signature = (block.signature or "") + _string(signature, "a thinking signature")
        return events

    def tool_call(self, key: Any, id: object, name: object) -> list[StreamEvent]:
        """Open a tool call. ``id`` and ``name`` are as the provider sent them: a call without an
        id (or with one that is not a string, or with the id of an earlier call of the answer)
        gets one of its own, since its result is paired to it by id (a missing one was stored as
        null, and every later call of the conversation failed on it; a repeated one lost the
        second result, and the history replayed two calls with one result, which providers
        refuse); a name that is not a string is no name (``unusable`` judges the answer)."""
        if not isinstance(id, str) or not id or any(c.id == id for c in self.message.tool_calls):
            id = f"call_{uuid.uuid4().hex[:16]}"
        if not isinstance(name, str):
            name = ""
        events = self.end_block()
        content = self.message.content
        content.append(ToolCall(id=id, name=name))
        i = len(content) - 1
        self._tool_index[key] = i
        self._tool_args[i] = []
        events.append(ToolCallStart(index=i, id=id, name=name))
        return events

    def has_tool_call(self, key: Any) -> bool:
        return key in self._tool_index

    def tool_name(self, key: Any) -> str:
        """The function name of the call under ``key`` ("" while the provider has not said it)."""
        call = self.message.content[self._tool_index[key]]
        assert isinstance(call, ToolCall)
        return call.name

    def name_tool(self, key: Any, name: str) -> None:
        """Give the call under ``key`` the name that came after its start (its ``toolcall_end``
        carries it; the ``toolcall_start`` already sent showed none)."""
        call = self.message.content[self._tool_index[key]]
        assert isinstance(call, ToolCall)
        call.name = name

    def tool_args_complete(self, key: Any) -> bool:
        """Whether a call's arguments so far are a whole JSON value (more would not be its own)."""
        raw = "".join(self._tool_args.get(self._tool_index[key], ())).strip()
        if not raw:
            return False
        try:
            json.loads(raw)
        except (ValueError, RecursionError):
            return False
        return True

    def tool_args(self, key: Any, fragment: str) -> list[StreamEvent]:
        if not fragment:
            return []
        i = self._tool_index[key]
        fragment = storable(_string(fragment, "tool call arguments"))
        self._tool_args[i].append(fragment)
        return [ToolCallDelta(index=i, delta=fragment)]

    # -- closing ---------------------------------------------------------------------------

    def _close_tools(self) -> list[StreamEvent]:
        """Parse each call's arguments. Ones that are not a JSON object stay with the call as
        ``invalid_arguments`` (the loop answers it with an error the model can correct)."""
        events: list[StreamEvent] = []
        for i, parts in self._tool_args.items():
            call = self.message.content[i]
            assert isinstance(call, ToolCall)
            raw = "".join(parts).strip()
            if raw:
                try:
                    parsed = json.loads(raw)
                except (ValueError, RecursionError):
                    parsed = None
                if isinstance(parsed, dict):
                    if "\\u" in raw:  # an escaped lone surrogate parses to one
                        parsed = storable_value(parsed)
                    call.arguments = parsed
                else:
                    call.arguments, call.invalid_arguments = {}, raw[:_INVALID_ARGUMENTS_KEPT]
            events.append(ToolCallEnd(index=i, tool_call=call))
        self._tool_args.clear()
        return events

    def finish(self, stop_reason: StopReason | None = None, usage: Usage | None = None) -> list[StreamEvent]:
        """Close every open block and end with ``done``. ``stop_reason`` defaults from content,
        and follows it where the provider's word and the content disagree: "stop" with calls (as
        Ollama says), or "toolUse" without any (a server whose calls could not be read), which
        the loop took for a turn with calls to run and never ended."""
        events = self.end_block()
        events.extend(self._close_tools())
        msg = self.message
        if usage is not None:
            msg.usage = usage
        if stop_reason is None or stop_reason in ("stop", "toolUse"):
            stop_reason = "toolUse" if msg.tool_calls else "stop"
        msg.stop_reason = stop_reason
        events.append(StreamDone(message=msg))
        return events

    def fail(
        self,
        text: str,
        kind: ErrorKind = "unknown",
        status: int | None = None,
        retry_after: float | None = None,
    ) -> StreamError:
        """End with ``error``. Tool calls whose arguments never completed are dropped."""
        msg = self.message
        self._open = None
        if self._tool_args:
            incomplete = set(self._tool_args)
            msg.content = [b for i, b in enumerate(msg.content) if i not in incomplete]
            self._tool_args.clear()
        msg.stop_reason = "aborted" if kind == "aborted" else "error"
        msg.error_message = redact_secrets(text)  # stored, and shown to whoever owns the conversation
        return StreamError(message=msg, kind=kind, status=status, retry_after=retry_after)


#: The key of a summary message's ``details`` holding a ``NativeCompaction`` (``as_details``): the
#: provider's own compaction of what the summary replaced, which only that provider and model read.
PROVIDER_COMPACTION = "provider_compaction"


@dataclass(frozen=True)
class NativeCompaction:
    """What a provider's own compaction made of a history (``Model.compact_natively``): items in
    the provider's wire format (OpenAI's encrypted ``compaction`` item among them) that stand for
    it in a later request to the same ``provider`` and ``model``, and what making them cost.

    Opaque, so never the only record: agentloop keeps it on a summary message beside the
    readable summary, which every other reader (a person, another model, the next summary) uses."""

    provider: str
    model: str
    items: list[dict[str, Any]]
    usage: Usage = field(default_factory=Usage)

    def as_details(self) -> dict[str, Any]:
        """What a summary's ``details`` keep under ``PROVIDER_COMPACTION`` (JSON data)."""
        return {"provider": self.provider, "model": self.model, "items": self.items}


class Model(ABC):
    """A provider model. ``stream`` never raises; cancellation propagates to the caller."""

    info: ModelInfo

    @property
    def name(self) -> str:
        return self.info.name

    @abstractmethod
    def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
        """Yield the events of one call, using ``out`` to build them. May raise."""

    def classify(self, exc: BaseException) -> ProviderError:
        """Map an adapter's exception to an error kind. Adapters refine this for their SDK."""
        if isinstance(exc, ProviderError):
            return exc
        return ProviderError(f"{type(exc).__name__}: {exc}", kind="unknown")

    def secrets(self) -> tuple[str, ...]:
        """What an error message must never show: the adapter's API key. A server may quote a key
        it refuses, in a shape ``redact_secrets`` does not recognise; each failure masks these."""
        return ()

    async def compact_natively(self, request: ModelRequest) -> NativeCompaction | None:
        """The provider's own compaction of ``request.messages`` (a history about to be summarised),
        for a compaction that asked for it; None where the provider has none (the default). An
        adapter that has one raises when its call fails: the caller falls back to the summary."""
        return None

    async def payload(self, request: ModelRequest, api: str, payload: dict[str, Any]) -> dict[str, Any]:
        """The seam every adapter sends through: ``payload`` (what it built for ``request``, in
        the wire format ``api`` names) as the request's provider-request hooks leave it. Without
        hooks it is ``payload`` itself, at the cost of one test. Called inside ``_stream``, so a
        hook's failure is that call's ``error`` event, never an exception in the loop."""
        shape = request.shape_payload
        if shape is None:
            return payload
        return await shape(ProviderRequest(self.info.provider, self.info.id, api, payload))

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamEvent]:
        out = AssistantBuilder(self.info)
        events = self._stream(request, out)
        try:
            async for event in events:
                yield event
                if isinstance(event, StreamDone | StreamError):
                    break
            else:
                raise ProviderError("the provider stream ended without a result", kind="connection")
        except Exception as exc:  # a provider never raises into the loop
            err = self.classify(exc)
            if not out.started:
                yield out.start()
            yield out.fail(mask(str(err), self.secrets()), err.kind, err.status, err.retry_after)
        finally:
            await events.aclose()  # close the adapter now, not in a GC finalizer

    async def respond(self, request: ModelRequest) -> StreamDone | StreamError:
        """One call, no deltas: the terminal event only. Used when nobody watches the stream.

        Adapters that can answer more cheaply without streaming override this; the default
        drains ``stream``. Like ``stream``, it never raises.
        """
        async for event in self.stream(request):
            if isinstance(event, StreamDone | StreamError):
                return event
        return AssistantBuilder(self.info).fail("the provider stream ended without a result", "connection")

    async def complete(self, request: ModelRequest) -> AssistantMessage:
        """Run one call to the end and return the final message (done or error)."""
        return (await self.respond(request)).message
