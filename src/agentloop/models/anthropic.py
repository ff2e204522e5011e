"""Anthropic's Messages API through the official ``anthropic`` SDK (an optional extra).

The SDK does HTTP and SSE; this module maps our history onto Anthropic's stricter shape (one
system prompt, alternating roles, tool results as blocks of a user message, signed thinking) and
the streamed events back onto the protocol. SDK retries are off: the loop owns retrying.

Two facts shape the conversion. Thinking blocks carry a signature that only the model that wrote
them can verify, so they are replayed as thinking only to that model and as plain text to any
other. And runtime notices (``SystemMessage``) in mid-history cannot be system prompts here, so
they travel as marked user text, in their place.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncGenerator
from typing import Any, cast

import anthropic
import pydantic
from anthropic import AsyncAnthropic

try:  # the transport under the SDK: httpx2 in anthropic 2.x, httpx before
    from httpx2 import TimeoutException, TransportError
except ImportError:  # pragma: no cover
    from httpx import TimeoutException, TransportError  # type: ignore[assignment]

from agentloop.events import ErrorKind, StreamEvent
from agentloop.images import encoded_image_size
from agentloop.messages import (
    AssistantMessage,
    ImageContent,
    MediaBlock,
    StopReason,
    SystemMessage,
    TextContent,
    ThinkingContent,
    ToolCall,
    ToolResultMessage,
    Usage,
    UserBlock,
    UserMessage,
    document_text,
)
from agentloop.models.base import (
    NOTICE_PREFIX,
    STREAM_CUT,
    ApiKey,
    AssistantBuilder,
    KeySource,
    Model,
    ModelInfo,
    ModelRequest,
    ProviderError,
    check_event_stream,
    http_error,
    make_usage,
    quote_body,
    send_keyed,
    stream_broken,
    thinking_budget,
)
from agentloop.models.catalog import model_info
from agentloop.models.idle import IdleLimit, StreamIdle, idle_seconds
from agentloop.models.overflow import is_overflow_text
from agentloop.models.replay import clean_history, safe_tool_id
from agentloop.models.retry import retry_after_from_headers
from agentloop.urls import redact_url

PLACEHOLDER_KEY = "sk-ant-local-no-key"
TOOL_ID_MAX = 64
EPHEMERAL = {"type": "ephemeral"}
EMPTY_ERROR = "(the tool failed without a message)"
MIN_THINKING = 1024  # the smallest thinking budget the API takes
# Anthropic's limits on images: at most 5 MiB of base64 and 8000 pixels a side each, 2000 a side
# in a request of more than 20, at most 100 in a request
MAX_IMAGE_CHARS = 5 * 1024 * 1024
MAX_IMAGE_SIDE = 8000
MANY_IMAGES = 20
MAX_SIDE_OF_MANY = 2000
MAX_IMAGES = 100

_STOP: dict[str, StopReason] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "refusal": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "toolUse",
}
# ``error.type`` of an error event inside a 200 stream -> our kind
_STREAM_ERRORS: dict[str, ErrorKind] = {
    "overloaded_error": "rate_limit",
    "rate_limit_error": "rate_limit",
    "api_error": "server",
    "timeout_error": "timeout",
    "authentication_error": "auth",
    "permission_error": "auth",
    "invalid_request_error": "bad_request",
    "request_too_large": "bad_request",
}
_CLIENT_OPTIONS = ("timeout", "default_headers")


class AnthropicModel(Model):
    """A Claude model. ``thinking_budget`` (tokens) turns on extended thinking.

    ``prompt_cache`` marks the system prompt and the newest message as cache breakpoints, so a
    long conversation pays full price for its prefix once. Other ``options`` (``top_k``,
    ``metadata``, ...) go into every request body; ``timeout`` and ``default_headers`` configure
    the client.

    ``api_key`` is a key, or a function (plain or async) asked for the key before every call:
    see ``KeySource``. The client is copied with the new key (sharing its connection pool) only
    when the key changes, and a call refused with 401 asks once more and is retried once with a
    different key.
    """

    def __init__(
        self,
        model_id: str,
        *,
        api_key: ApiKey = None,
        base_url: str | None = None,
        client: AsyncAnthropic | None = None,
        info: ModelInfo | None = None,
        thinking_budget: int | None = None,
        prompt_cache: bool = True,
        **options: Any,
    ) -> None:
        self.model_id = model_id
        self.info = info or model_info("anthropic", model_id)
        self._keys, self.base_url = KeySource.of(
            api_key,
            base_url,
            key_env="ANTHROPIC_API_KEY",
            url_env="ANTHROPIC_BASE_URL",
            placeholder=PLACEHOLDER_KEY,
            what="Anthropic",
        )
        self.thinking_budget = thinking_budget
        self.prompt_cache = prompt_cache
        self._client_options = {k: options.pop(k) for k in _CLIENT_OPTIONS if k in options}
        self.options = options
        self._client = client

    @property
    def client(self) -> AsyncAnthropic:
        """Built on first use, so that an agent can be configured before a key exists. With a
        key provider it is the base the calls' clients copy (its own key is a placeholder)."""
        if self._client is None:
            key = PLACEHOLDER_KEY if self._keys.dynamic else self._keys.fixed
            if key is None:
                raise ProviderError(
                    "no Anthropic API key (set ANTHROPIC_API_KEY, or ANTHROPIC_BASE_URL for a proxy)", kind="auth"
                )
            self._client = AsyncAnthropic(api_key=key, base_url=self.base_url, max_retries=0, **self._client_options)
        return self._client

    async def _open(self, params: dict[str, Any]) -> tuple[AsyncAnthropic, anthropic.AsyncStream[Any]]:
        """Send the request with the key valid now (see ``send_keyed``), and the client that sent it."""
        return await send_keyed(
            self._keys, self.client, lambda client: _send(client, params), anthropic.AuthenticationError
        )

    # ------------------------------------------------------------------ request

    def build_params(self, request: ModelRequest) -> dict[str, Any]:
        """The request body (minus transport details)."""
        messages = to_anthropic_messages(request.messages, self.info)
        max_tokens = request.max_tokens or self.info.max_output
        params: dict[str, Any] = {"model": self.model_id, "messages": messages, "stream": True}
        if request.system_prompt:
            block: dict[str, Any] = {"type": "text", "text": request.system_prompt}
            if self.prompt_cache:
                block["cache_control"] = EPHEMERAL
            params["system"] = [block]
        if self.prompt_cache and messages:
            last = messages[-1]["content"][-1]
            if last.get("type") not in ("thinking", "redacted_thinking"):
                last["cache_control"] = EPHEMERAL
        if request.tools:
            params["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": t.parameters} for t in request.tools
            ]
            if not request.parallel_tool_calls:
                params["tool_choice"] = {"type": "auto", "disable_parallel_tool_use": True}
        budget = self.thinking_budget
        if request.reasoning is not None and self.info.reasoning:  # the run's level wins over the model's
            budget = thinking_budget(request.reasoning, self.info, minimum=MIN_THINKING)
        if budget:
            params["thinking"] = {"type": "enabled", "budget_tokens": budget}
            max_tokens = max(max_tokens, budget + 1024)  # the budget must fit in max_tokens
        elif request.temperature is not None:  # thinking requires the default temperature
            params["temperature"] = request.temperature
        params["max_tokens"] = max_tokens
        params.update(self.options)
        return params

    # ------------------------------------------------------------------ response

    async def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
        params = await self.payload(request, "anthropic-messages", self.build_params(request))
        client, response = await self._open(params)
        reader = _EventReader(self.info, out)
        async with response:  # from here on: closed also when the caller stops reading at the start
            await check_event_stream(response.response)
            yield out.start()
            try:
                async for event in IdleLimit(response, idle_seconds(client.timeout), _progress):
                    for ev in reader.read(event):
                        yield ev
                    if reader.stop is not None:
                        break
            except (anthropic.APIConnectionError, TransportError, StreamIdle) as exc:  # (SDK lets transport errors out)
                if not reader.whole():
                    timed_out = isinstance(exc, anthropic.APITimeoutError | TimeoutException | StreamIdle)
                    kind: ErrorKind = "timeout" if timed_out else "connection"
                    raise ProviderError(stream_broken(f"the stream broke: {_cause(exc)}", out), kind=kind) from exc
        if reader.stop is None and not reader.whole():
            raise ProviderError(stream_broken(STREAM_CUT, out), kind="connection")
        for ev in reader.flush():
            yield ev
        for ev in out.finish(reader.stop or "stop", reader.usage()):
            yield ev

    # ------------------------------------------------------------------ errors

    def classify(self, exc: BaseException) -> ProviderError:
        if isinstance(exc, ProviderError):
            return exc
        if isinstance(exc, anthropic.APITimeoutError | TimeoutException):
            return ProviderError(f"the request to {self.name} timed out", kind="timeout")
        if isinstance(exc, anthropic.APIConnectionError | TransportError):
            where = redact_url(self.base_url) if self.base_url else "the Anthropic API"  # (the message reaches clients)
            return ProviderError(f"cannot reach {where}: {_cause(exc)}", kind="connection")
        if isinstance(exc, anthropic.APIStatusError):
            return _classify_status(exc)
        if isinstance(exc, anthropic.APIResponseValidationError):
            return ProviderError(f"unreadable response: {exc}", kind="invalid_response")
        if isinstance(exc, ValueError | TypeError | AttributeError | KeyError | pydantic.ValidationError):
            return ProviderError(f"unreadable response: {type(exc).__name__}: {exc}", kind="invalid_response")
        return super().classify(exc)

    def secrets(self) -> tuple[str, ...]:
        return self._keys.secrets()


async def _send(client: AsyncAnthropic, params: dict[str, Any]) -> anthropic.AsyncStream[Any]:
    """One streaming Messages request through ``client``."""
    create = cast(Any, client.messages.create)  # overloads cannot see `stream` in a dict
    response: anthropic.AsyncStream[Any] = await create(**sdk_kwargs(create, params))
    return response


def _classify_status(exc: anthropic.APIStatusError) -> ProviderError:
    status = exc.status_code
    etype = _error_field(exc.body, "type")
    detail = _error_field(exc.body, "message") or quote_body(exc.body if exc.body is not None else exc.message)
    text = f"HTTP {status} {etype}: {detail}" if etype else f"HTTP {status}: {detail}"
    if status < 400:  # an ``error`` event inside a 200 stream: only the body says what it was
        kind = _STREAM_ERRORS.get(etype or "", "server")
        if kind == "bad_request" and is_overflow_text(detail):
            kind = "overflow"
        return ProviderError(f"stream error: {text}", kind=kind)
    return http_error(
        status,
        text,
        retry_after=retry_after_from_headers(exc.response.headers),
        rate_limited=status == 529 or etype == "overloaded_error",  # Anthropic's "overloaded"
        overflow=is_overflow_text(f"{detail} {exc.message}"),
    )


def sdk_kwargs(create: Any, params: dict[str, Any]) -> dict[str, Any]:
    """Body fields the SDK method does not name (it drops some across versions, and gateways
    accept extra ones) travel in ``extra_body`` instead of failing as unexpected arguments."""
    known = inspect.signature(create).parameters
    kwargs = {k: v for k, v in params.items() if k in known}
    extra = {k: v for k, v in params.items() if k not in known}
    if extra:
        kwargs["extra_body"] = {**kwargs.get("extra_body", {}), **extra}
    return kwargs


def _error_field(body: object, name: str) -> str | None:
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get(name), str):
            return cast(str, inner[name])
    return None


def _progress(event: Any) -> bool:
    """Whether a stream event is progress: all but ``ping`` (which the SDK drops already, but a
    version that passed it on would keep a stalled stream alive)."""
    return getattr(event, "type", None) != "ping"


def _cause(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__


class _EventReader:
    """Turns raw Messages stream events into builder calls; keeps usage and the stop reason.

    The builder merges consecutive deltas of one kind into one block, but Anthropic's block
    boundaries matter (each thinking block has its own signature), so a ``content_block_stop``
    closes the builder's open block. A ``tool_use`` block's arguments come as ``input_json_delta``
    fragments; a server that sends them whole in the block's start instead (as the SDK's own
    accumulator allows) has them taken from there, and input that is not an object stays with
    the call as invalid arguments. A block started twice, or arguments for a block that never
    started, are garbage: dropped, they left a call that ran with no arguments at all.
    """

    def __init__(self, info: ModelInfo, out: AssistantBuilder) -> None:
        self.info = info
        self.out = out
        self.kinds: dict[int, str] = {}
        self._start_input: dict[int, str] = {}  # tool blocks whose start held the input: its JSON text
        self.tokens = {"input": 0, "output": 0, "cache_read": 0, "cache_write": 0}
        self.stop: StopReason | None = None
        self._stop_reason: str | None = None

    def usage(self) -> Usage:
        return make_usage(self.info, **self.tokens)

    def whole(self) -> bool:
        """Whether the answer had arrived whole when the stream broke: once ``message_delta``
        named the stop reason only ``message_stop`` was to come, so the answer ends as it said
        (instead of being thrown away and asked for, and paid for, again)."""
        if self._stop_reason is None:
            return False
        self.stop = _STOP.get(self._stop_reason, "stop")
        return True

    def _take_usage(self, raw: Any) -> None:
        if raw is None:
            return
        for ours, theirs in (
            ("input", "input_tokens"),
            ("output", "output_tokens"),
            ("cache_read", "cache_read_input_tokens"),
            ("cache_write", "cache_creation_input_tokens"),
        ):
            value = getattr(raw, theirs, None)
            if value is not None:  # message_delta counts are cumulative: the latest wins
                self.tokens[ours] = int(value)

    def read(self, event: Any) -> list[StreamEvent]:
        out = self.out
        kind = event.type
        if kind == "message_start":
            self._take_usage(event.message.usage)
        elif kind == "content_block_start":
            return self._block_start(event.index, event.content_block)
        elif kind == "content_block_delta":
            return self._block_delta(event.index, event.delta)
        elif kind == "content_block_stop":
            if self.kinds.get(event.index) in ("text", "thinking"):
                return out.end_block()
            return self._start_args(event.index)
        elif kind == "message_delta":
            self._take_usage(event.usage)
            if event.delta.stop_reason:
                self._stop_reason = event.delta.stop_reason
        elif kind == "message_stop":
            reason = self._stop_reason or "end_turn"
            self.stop = _STOP.get(reason, "stop")
        return []

    def _start_args(self, index: int) -> list[StreamEvent]:
        """The input a tool block's start held, as its arguments (no deltas came)."""
        start_input = self._start_input.pop(index, None)
        if start_input is not None and self.out.has_tool_call(index):
            return self.out.tool_args(index, start_input)
        return []

    def flush(self) -> list[StreamEvent]:
        """At the end of the message: the start input of tool blocks that never said they
        stopped (it was lost, and the call ran with no arguments)."""
        return [ev for index in list(self._start_input) for ev in self._start_args(index)]

    def _block_start(self, index: int, block: Any) -> list[StreamEvent]:
        out = self.out
        if index in self.kinds:
            raise ProviderError(
                f"unreadable response: the provider started content block {index} twice", kind="invalid_response"
            )
        self.kinds[index] = block.type
        if block.type == "text":
            return out.text(block.text or "")
        if block.type == "thinking":
            return out.thinking(block.thinking or "", getattr(block, "signature", None) or None)
        if block.type == "redacted_thinking":  # opaque: kept only to be replayed to the same model
            events = out.end_block() + out.thinking("", block.data)
            thinking = out.message.content[-1]
            assert isinstance(thinking, ThinkingContent)
            thinking.redacted = True
            return events + out.end_block()
        if block.type in ("tool_use", "server_tool_use"):
            start_input = getattr(block, "input", None)
            if isinstance(start_input, str):  # (its JSON text, as a delta would have been)
                self._start_input[index] = start_input
            elif start_input is not None and start_input != {}:
                self._start_input[index] = json.dumps(start_input, ensure_ascii=False, default=str)
            return out.tool_call(index, getattr(block, "id", None), getattr(block, "name", None))
        return []

    def _block_delta(self, index: int, delta: Any) -> list[StreamEvent]:
        out = self.out
        if delta.type == "text_delta":
            return out.text(delta.text)
        if delta.type == "thinking_delta":
            return out.thinking(delta.thinking)
        if delta.type == "signature_delta":
            return out.thinking("", delta.signature)
        if delta.type == "input_json_delta" and index not in self.kinds:
            raise ProviderError(
                f"unreadable response: the provider sent tool call arguments for content block {index}, "
                "which it never started",
                kind="invalid_response",
            )
        if delta.type == "input_json_delta" and out.has_tool_call(index):
            if delta.partial_json:  # the deltas are the input, not the start's (as in the SDK)
                self._start_input.pop(index, None)
            return out.tool_args(index, delta.partial_json)
        return []


# ------------------------------------------------------------------ history conversion


class _Images:
    """Which images of one request go to the API. One that breaks a limit of Anthropic's would
    have the request refused, and every later one of the conversation holding it; instead a note
    takes its place, saying why, so the model can tell the person. Past the number a request may
    hold, the oldest are the ones left out."""

    def __init__(self, messages: list[Any]) -> None:
        total = sum(
            isinstance(b, ImageContent)
            for m in messages
            if isinstance(m, UserMessage | ToolResultMessage)
            for b in m.content
        )
        self.left_out = max(0, total - MAX_IMAGES)  # the oldest, left out for the newer
        self.many = total - self.left_out > MANY_IMAGES
        self.max_side = MAX_SIDE_OF_MANY if self.many else MAX_IMAGE_SIDE
        self.seen = 0

    def block(self, image: ImageContent) -> dict[str, Any]:
        """The next image of the request (they are asked for in order), or the note in its place."""
        self.seen += 1
        why = self._refusal(image)
        if why is not None:
            return {"type": "text", "text": f"[an image ({image.mime_type}) was left out: {why}]"}
        return {"type": "image", "source": {"type": "base64", "media_type": image.mime_type, "data": image.data}}

    def _refusal(self, image: ImageContent) -> str | None:
        if self.seen <= self.left_out:
            return f"a request holds at most {MAX_IMAGES} images, and newer ones came after it"
        if len(image.data) > MAX_IMAGE_CHARS:
            return f"it is {len(image.data) / 2**20:.1f} MiB in base64, over the 5 MiB Anthropic takes"
        size = encoded_image_size(image.data)  # (None: not readable here; the API judges it)
        if size is not None and max(size) > self.max_side:
            among = f" in a request of more than {MANY_IMAGES} images" if self.many else ""
            return f"it is {size[0]}x{size[1]} pixels, over the {self.max_side} a side Anthropic takes{among}"
        return None


def _media(block: MediaBlock, images: _Images) -> dict[str, Any]:
    """An image, or a document: a PDF as base64, a text document as its text."""
    if isinstance(block, ImageContent):
        return images.block(block)
    text = document_text(block)
    if text is None:
        source = {"type": "base64", "media_type": block.mime_type, "data": block.data}
    else:
        source = {"type": "text", "media_type": "text/plain", "data": text}
    document: dict[str, Any] = {"type": "document", "source": source}
    if block.name:
        document["title"] = block.name
    return document


def _user_blocks(blocks: list[UserBlock], images: _Images) -> list[dict[str, Any]]:
    """Text, images and documents; text blocks that are empty or only whitespace are rejected by
    the API (and would fail every later call from the history), so they are left out."""
    return [
        {"type": "text", "text": b.text} if isinstance(b, TextContent) else _media(b, images)
        for b in blocks
        if not isinstance(b, TextContent) or b.text.strip()
    ]


def _assistant_blocks(msg: AssistantMessage, info: ModelInfo) -> list[dict[str, Any]]:
    same_model = msg.provider == info.provider and msg.model == info.id
    blocks: list[dict[str, Any]] = []
    for b in msg.content:
        if isinstance(b, ThinkingContent):
            if same_model and b.redacted and b.signature:
                blocks.append({"type": "redacted_thinking", "data": b.signature})
            elif same_model and b.signature:
                blocks.append({"type": "thinking", "thinking": b.thinking, "signature": b.signature})
            elif b.thinking.strip() and not b.redacted:
                blocks.append({"type": "text", "text": b.thinking})
        elif isinstance(b, TextContent):
            if b.text.strip():
                blocks.append({"type": "text", "text": b.text})
        elif isinstance(b, ToolCall):
            blocks.append({"type": "tool_use", "id": b.id, "name": b.name, "input": b.arguments})
    return blocks


def _tool_result(msg: ToolResultMessage, images: _Images) -> dict[str, Any]:
    """A ``tool_result`` block. The API refuses an error result without content, and the stored
    result would fail every later call of the conversation: an empty one says so in words."""
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": msg.tool_call_id}
    content = _user_blocks(msg.content, images)
    if not content and msg.is_error:
        content = [{"type": "text", "text": EMPTY_ERROR}]
    if content:
        block["content"] = content
    if msg.is_error:
        block["is_error"] = True
    return block


def to_anthropic_messages(messages: list[Any], info: ModelInfo) -> list[dict[str, Any]]:
    """Our history as alternating user/assistant messages, after replay hygiene.

    Consecutive tool results become one user message of ``tool_result`` blocks; anything else
    that lands next to a message of the same role is merged into it.
    """
    out: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})

    history = clean_history(messages, lambda i: safe_tool_id(i, TOOL_ID_MAX))
    images = _Images(history)
    for msg in history:
        if isinstance(msg, UserMessage):
            add("user", _user_blocks(msg.content, images))
        elif isinstance(msg, SystemMessage):
            add("user", [{"type": "text", "text": NOTICE_PREFIX + msg.text}])
        elif isinstance(msg, ToolResultMessage):
            add("user", [_tool_result(msg, images)])
        elif isinstance(msg, AssistantMessage):
            add("assistant", _assistant_blocks(msg, info))
    return out
