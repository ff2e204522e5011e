"""OpenAI Chat Completions, and every server that speaks it (vLLM, llama.cpp, Ollama, LM Studio).

The official SDK does the HTTP and SSE work; this module translates our history into the wire
format and the streamed chunks back into protocol events. The SDK's own retries are disabled:
the loop retries with backoff and ``retry-after``, and falls back to other models, which the SDK
cannot know about.

Compatibility choices are aimed at the strictest local servers: an assistant message always has
string ``content`` (llama.cpp's server rejects ``null``), user text without images is sent as a
plain string, and reasoning arrives under either ``reasoning_content`` or ``reasoning``.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import AsyncGenerator
from typing import Any, cast

import openai
import pydantic
from openai import AsyncOpenAI

from agentloop.events import ErrorKind, StreamEvent
from agentloop.messages import (
    AssistantMessage,
    ImageContent,
    MediaBlock,
    StopReason,
    SystemMessage,
    TextContent,
    ToolCall,
    ToolResultMessage,
    Usage,
    UserBlock,
    UserMessage,
)
from agentloop.models.base import (
    STREAM_CUT,
    ApiKey,
    AssistantBuilder,
    KeySource,
    Model,
    ModelInfo,
    ModelRequest,
    ProviderError,
    Reasoning,
    check_event_stream,
    error_parts,
    file_text,
    http_error,
    make_usage,
    quote_body,
    send_keyed,
    stream_broken,
)
from agentloop.models.catalog import model_info
from agentloop.models.idle import IdleLimit, StreamIdle, idle_seconds
from agentloop.models.overflow import is_overflow_text
from agentloop.models.replay import clean_history, safe_tool_id
from agentloop.models.retry import retry_after_from_headers
from agentloop.urls import redact_url

# A local server needs some key for the SDK to build its client; it never checks it.
PLACEHOLDER_KEY = "sk-local-no-key"
TOOL_ID_MAX = 40

_FINISH: dict[str, StopReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "toolUse",
    "function_call": "toolUse",
    # other servers' words for the same: end of sequence (Together, older TGI), stop sequence
    # (TGI), the model's own window reached (Mistral)
    "eos": "stop",
    "eos_token": "stop",
    "stop_sequence": "stop",
    "model_length": "length",
}
# finish reasons that say the server failed mid-answer (DeepSeek, Mistral): transient, retried
_FINISH_FAILED = frozenset({"insufficient_system_resource", "error"})
_CLIENT_OPTIONS = ("timeout", "default_headers", "organization", "project")
_QUOTA = "insufficient_quota"  # the ``code`` (and ``type``) of a 429 that says the account has no credit left


class OpenAIChatModel(Model):
    """A chat model behind ``/v1/chat/completions``.

    ``options`` are ``timeout``, ``default_headers``, ``organization`` and ``project`` for the
    client; anything else (``top_p``, ``reasoning_effort``, ``seed``, ...) goes into every
    request body as is.

    ``api_key`` is a key, or a function (plain or async) asked for the key before every call:
    see ``KeySource``. The client is rebuilt (sharing its connection pool) only when the key
    it returns changes, and a call refused with 401 asks it once more and is retried once
    with a different key.
    """

    def __init__(
        self,
        model_id: str,
        *,
        api_key: ApiKey = None,
        base_url: str | None = None,
        client: AsyncOpenAI | None = None,
        info: ModelInfo | None = None,
        **options: Any,
    ) -> None:
        self.model_id = model_id
        self.info = info or model_info("openai", model_id)
        self._keys, self.base_url = KeySource.of(
            api_key,
            base_url,
            key_env="OPENAI_API_KEY",
            url_env="OPENAI_BASE_URL",
            placeholder=PLACEHOLDER_KEY,
            what="OpenAI",
        )
        self._client_options = {k: options.pop(k) for k in _CLIENT_OPTIONS if k in options}
        self.options = options
        self._client = client

    @property
    def client(self) -> AsyncOpenAI:
        """Built on first use, so that an agent can be configured before a key exists. With a
        key provider it is the base the calls' clients copy (its own key is a placeholder)."""
        if self._client is None:
            key = PLACEHOLDER_KEY if self._keys.dynamic else self._keys.fixed
            if key is None:
                raise ProviderError(
                    "no OpenAI API key (set OPENAI_API_KEY, or OPENAI_BASE_URL for a local server)", kind="auth"
                )
            self._client = AsyncOpenAI(api_key=key, base_url=self.base_url, max_retries=0, **self._client_options)
        return self._client

    async def _open(self, params: dict[str, Any]) -> tuple[AsyncOpenAI, openai.AsyncStream[Any]]:
        """Send the request with the key valid now (see ``send_keyed``), and the client that sent it."""
        return await send_keyed(
            self._keys, self.client, lambda client: _send(client, params), openai.AuthenticationError
        )

    # ------------------------------------------------------------------ request

    def build_params(self, request: ModelRequest) -> dict[str, Any]:
        """The request body (minus transport details), public so it can be inspected in tests."""
        params: dict[str, Any] = {
            "model": self.model_id,
            "messages": to_openai_messages(request, documents=self.base_url is None),  # PDFs: OpenAI's own API
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.tools:
            params["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
                }
                for t in request.tools
            ]
            if not request.parallel_tool_calls and self.base_url is None and not self.info.reasoning:
                params["parallel_tool_calls"] = False  # OpenAI's reasoning models (and some servers) refuse it
        if request.cache_key and self.base_url is None:  # OpenAI's own API; other servers may refuse it
            params["prompt_cache_key"] = request.cache_key
        if request.max_tokens is not None:
            # OpenAI's reasoning models accept only the newer name, and OpenAI's own API takes it
            # from every model (so a reasoning model missing from the catalog works too); other
            # servers may know only the older one
            newer = self.info.reasoning or self.base_url is None
            params["max_completion_tokens" if newer else "max_tokens"] = request.max_tokens
        if request.temperature is not None:
            params["temperature"] = request.temperature
        params.update(self.options)
        if request.reasoning is not None and self.info.reasoning:  # (another model refuses the field)
            params["reasoning_effort"] = _effort(request.reasoning, self.model_id)
        return params

    # ------------------------------------------------------------------ response

    async def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
        params = await self.payload(request, "openai-chat", self.build_params(request))
        client, response = await self._open(params)
        finish: str | None = None
        usage: Usage | None = None
        calls = _DeltaReader(out)
        async with response:  # from here on: closed also when the caller stops reading at the start
            await check_event_stream(response.response)
            yield out.start()
            try:
                async for chunk in IdleLimit(response, idle_seconds(client.timeout)):
                    _raise_error_chunk(chunk)
                    if getattr(chunk, "usage", None) is not None:
                        usage = self._usage(chunk.usage)
                    for choice in chunk.choices or ():
                        for event in calls.delta(choice.delta):
                            yield event
                        if choice.finish_reason:
                            finish = choice.finish_reason
            except (openai.APIConnectionError, StreamIdle) as exc:  # the stream broke: say how far it got
                if finish is None:  # (after the finish the answer is whole: only its usage is lost)
                    timed_out = isinstance(exc, openai.APITimeoutError | StreamIdle)
                    kind: ErrorKind = "timeout" if timed_out else "connection"
                    raise ProviderError(stream_broken(f"the stream broke: {_cause(exc)}", out), kind=kind) from exc
        if finish is None:
            raise ProviderError(stream_broken(STREAM_CUT, out), kind="connection")
        if finish not in _FINISH:
            kind = "server" if finish in _FINISH_FAILED else "bad_request"
            raise ProviderError(f"the provider stopped the answer: finish_reason={finish!r}", kind=kind)
        for event in out.finish(_FINISH[finish], usage):
            yield event

    def _usage(self, raw: Any) -> Usage:
        details = getattr(raw, "prompt_tokens_details", None)
        cached = max(0, int(getattr(details, "cached_tokens", 0) or 0))  # (negative: the prompt grew by it)
        prompt = int(raw.prompt_tokens or 0)
        return make_usage(
            self.info, input=max(0, prompt - cached), output=int(raw.completion_tokens or 0), cache_read=cached
        )

    # ------------------------------------------------------------------ errors

    def classify(self, exc: BaseException) -> ProviderError:
        if isinstance(exc, ProviderError):
            return exc
        if isinstance(exc, openai.APITimeoutError):
            return ProviderError(f"the request to {self.name} timed out", kind="timeout")
        if isinstance(exc, openai.APIConnectionError):
            where = redact_url(self.base_url) if self.base_url else "the OpenAI API"  # (the message reaches clients)
            return ProviderError(f"cannot reach {where}: {_cause(exc)}", kind="connection")
        if isinstance(exc, openai.APIStatusError):
            message, codes = _status_detail(exc)
            return classify_status(exc.status_code, message, exc.response.headers, codes)
        if isinstance(exc, openai.APIResponseValidationError):
            return ProviderError(f"unreadable response: {exc}", kind="invalid_response")
        if isinstance(exc, openai.APIError):  # an error event inside a 200 stream
            return stream_error(exc.body if exc.body is not None else exc.message)
        if isinstance(exc, json.JSONDecodeError) and exc.doc.strip():  # an event's data that is not JSON
            return text_error(exc.doc)
        if isinstance(exc, ValueError | TypeError | AttributeError | KeyError | pydantic.ValidationError):
            return ProviderError(f"unreadable response: {type(exc).__name__}: {exc}", kind="invalid_response")
        return super().classify(exc)

    def secrets(self) -> tuple[str, ...]:
        return self._keys.secrets()


async def _send(client: AsyncOpenAI, params: dict[str, Any]) -> openai.AsyncStream[Any]:
    """One streaming Chat Completions request through ``client``."""
    create = cast(Any, client.chat.completions.create)  # overloads cannot see `stream` in a dict
    response: openai.AsyncStream[Any] = await create(**sdk_kwargs(create, params))
    return response


def stream_error(body: object) -> ProviderError:
    """What an error inside a 200 stream means: its message, and the kind the status its code
    names says (vLLM, OpenRouter), else a server error (retried) or an overflow by its text."""
    message, status = error_parts(body)
    text = f"stream error: {message}"
    if status:
        return http_error(status, text, overflow=is_overflow_text(text))
    return ProviderError(text, kind="overflow" if is_overflow_text(text) else "server")


# what an event's plain text (a proxy's error line, a gateway's HTML page) says of the failure: a
# server overloaded or failing upstream, or a rate limit; both pass once waited for. A status is
# taken only where it is named one ("HTTP/1.1 503", "error 502"): "at most 500 items" is none.
_STATUS = r"(?:status|code|error|http\S*)[\s:=#]*"
_RATE_LIMIT_TEXT = re.compile(rf"\b(?:rate[ _-]?limit\w*|too many requests|{_STATUS}429)\b", re.IGNORECASE)
_SERVER_TEXT = re.compile(
    r"\b(?:overload\w*|over capacity|upstream|unavailable|bad gateway|gateway time-?out|internal server error"
    rf"|server error|temporarily|try again later|timed out|{_STATUS}50[0-4])\b",
    re.IGNORECASE,
)
_MARKUP = re.compile(r"<(script|style)\b.*?</\1\s*>|<[^>]*>", re.IGNORECASE | re.DOTALL)


def text_error(text: str) -> ProviderError:
    """The provider error an event whose data is plain text, not JSON, is (an ``event: error`` of
    a proxy, an HTML page in the stream; the SDK fails on it as JSON): its own words, markup
    dropped and trimmed, of the kind they name where one can tell (an overflow, a rate limit, an
    overloaded or failing server: retried), else an unreadable response, not retried blindly."""
    words = quote_body(" ".join(_MARKUP.sub(" ", text).split()))
    message = f"stream error: {words}"
    if is_overflow_text(words):
        return ProviderError(message, kind="overflow")
    if _RATE_LIMIT_TEXT.search(words):
        return ProviderError(message, kind="rate_limit")
    if _SERVER_TEXT.search(words):
        return ProviderError(message, kind="server")
    return ProviderError(f"unreadable response: the provider sent text, not JSON: {words}", kind="invalid_response")


# what marks a chunk without ``choices`` as an error body (vLLM's ``"object": "error"``, a proxy's
# ``{"message": ...}`` or ``{"detail": ...}``); the SDK recognises only an ``error`` key
_ERROR_MARKS = ("message", "detail", "error_message")


def _raise_error_chunk(chunk: Any) -> None:
    """Raise the provider error a chunk is, when it is one the SDK let through: an ``event:
    error`` or a data line whose body has no ``error`` key. Taken for an empty chunk, it ended
    the stream as a cut one, and the retry lost what the server had said."""
    if "choices" in getattr(chunk, "model_fields_set", ("choices",)):
        return
    body = chunk.to_dict()
    if body.get("object") == "error" or body.get("type") == "error" or any(k in body for k in _ERROR_MARKS):
        raise stream_error(body)


def sdk_kwargs(create: Any, params: dict[str, Any]) -> dict[str, Any]:
    """Body fields the SDK method does not name (server extras like vLLM's ``top_k``) travel in
    ``extra_body`` instead of failing as unexpected arguments."""
    known = inspect.signature(create).parameters
    kwargs = {k: v for k, v in params.items() if k in known}
    extra = {k: v for k, v in params.items() if k not in known}
    if extra:
        kwargs["extra_body"] = {**kwargs.get("extra_body", {}), **extra}
    return kwargs


def _status_detail(exc: openai.APIStatusError) -> tuple[str, str]:
    """What an error answer says, and its ``code`` and ``type`` (which may name an overflow). The
    SDK's message quotes only an OpenAI-shaped ``error.message``; another server's body (a
    string ``error``, plain text, a proxy's HTML page) is quoted from ``body``."""
    body = exc.body  # (the SDK has already taken ``error`` out of ``{"error": {...}}``)
    if isinstance(body, dict):
        message = body.get("message")
        if not isinstance(message, str) or not message:
            message = quote_body(body.get("error") or body)
        codes = " ".join(str(body[k]) for k in ("code", "type") if isinstance(body.get(k), str))
        return message, codes
    if body is None:
        return exc.message, ""
    return quote_body(body), ""


def classify_status(status: int, text: str, headers: object, codes: str = "") -> ProviderError:
    """The error kind of an HTTP error answer, shared by every OpenAI-compatible server;
    ``codes``, the body's ``code`` and ``type``, may name an overflow the text does not.

    OpenAI answers an exhausted quota (no credit left) with a 429 too, but waiting does not end
    it: it is told apart by its code and not retried, so the run fails over (or ends) at once
    instead of repeating a refused call."""
    if _QUOTA in codes.split():
        return ProviderError(f"HTTP {status}: {text}", kind="auth", status=status)
    return http_error(
        status,
        f"HTTP {status}: {text}",
        retry_after=retry_after_from_headers(headers),
        overflow=is_overflow_text(f"{text} {codes}"),
    )


class _DeltaReader:
    """Applies ``choices[].delta`` to the builder.

    Tool call fragments are keyed by ``index``; servers that omit it (some Ollama versions send
    each call whole) are keyed by ``id``, and a fragment with neither continues the latest call.
    Some servers give every parallel call index 0 (Ollama, LiteLLM, lmdeploy): a fragment with a
    new ``id`` under an index whose call's arguments are already a whole JSON value, or that
    names another function than that call's, starts another call. (Not any new id: a few servers
    change the id between fragments of one call.) A call whose first fragment had no name takes
    it from the fragment that brings it.
    """

    def __init__(self, out: AssistantBuilder) -> None:
        self.out = out
        self.last_key: Any = None
        self._latest: dict[Any, Any] = {}  # index (or id) -> builder key of the latest call under it
        self._by_id: dict[str, Any] = {}  # the server's call id -> builder key

    def _key(self, call: Any) -> Any:
        if call.id and call.id in self._by_id:
            return self._by_id[call.id]
        slot = call.index if call.index is not None else (call.id or self.last_key or 0)
        key = self._latest.get(slot, slot)
        if call.id:
            if self.out.has_tool_call(key) and (self._names_another(key, call) or self.out.tool_args_complete(key)):
                key = self._latest[slot] = (slot, call.id)
            self._by_id[call.id] = key
        return key

    def _names_another(self, key: Any, call: Any) -> bool:
        """Whether ``call`` names another function than the call under ``key`` (which tells two
        calls apart even when the first has no arguments, so none that could be whole)."""
        name = call.function.name if call.function else None
        return bool(name) and self.out.tool_name(key) not in ("", name)

    def delta(self, delta: Any) -> list[StreamEvent]:
        if delta is None:
            return []
        out = self.out
        events: list[StreamEvent] = []
        reasoning = getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None)
        if isinstance(reasoning, str) and reasoning:
            events.extend(out.thinking(reasoning))
        content = delta.content
        if isinstance(content, str):
            events.extend(out.text(content))
        elif isinstance(content, list):
            events.extend(self._parts(content))
        elif isinstance(content, int | float) and not isinstance(content, bool):
            events.extend(out.text(str(content)))  # a number for text: its digits (it was dropped)
        elif content is not None:  # dropped unseen, the answer was taken for an empty one
            raise ProviderError(
                f"unreadable response: the provider sent content that is not text: {quote_body(content)[:100]}",
                kind="invalid_response",
            )
        for call in delta.tool_calls or ():
            key = self._key(call)
            fn = call.function
            if not out.has_tool_call(key):
                call_id = call.id or f"call_{key}_{len(out.message.content)}"
                events.extend(out.tool_call(key, call_id, (fn.name if fn else None) or ""))
            elif fn is not None and isinstance(fn.name, str) and fn.name and not out.tool_name(key):
                out.name_tool(key, fn.name)
            self.last_key = key
            if fn is not None and fn.arguments:
                events.extend(out.tool_args(key, _arguments_text(fn.arguments)))
        return events

    def _parts(self, parts: list[Any]) -> list[StreamEvent]:
        """Content as a list of parts, as Mistral's reasoning models stream it: ``text`` parts,
        and ``thinking`` parts whose ``thinking`` is a list of text parts. (Taken for a string,
        it failed every answer of such a model as unreadable.)"""
        events: list[StreamEvent] = []
        for part in parts:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "thinking":
                thinking = _part_text(part.get("thinking"))
                if thinking:
                    events.extend(self.out.thinking(thinking))
            elif part.get("type") == "text":
                events.extend(self.out.text(_part_text(part.get("text"))))
        return events


def _arguments_text(arguments: object) -> str:
    """A call's ``arguments`` as JSON text. Some servers send the object itself instead of its
    text; it is written out, and a value that is not an object (a number, a list) stays with the
    call as invalid arguments the model is told about, rather than failing the whole answer."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False, default=str)


def _part_text(value: object) -> str:
    """The text of a content part's payload: a string, or a list of ``{"type": "text"}`` parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(p["text"] for p in value if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


# OpenAI's ``reasoning_effort`` values from least to most, and what each family of its reasoning
# models takes (first match wins; the SDK's type lists them all, but a model refuses one it does not
# take with a 400). Before gpt-5.1 no model could stop thinking ("none"); gpt-5 added "minimal";
# gpt-5.1 dropped "minimal" for "none"; "xhigh" came with gpt-5.1-codex-max and gpt-5.2. gpt-5-pro
# thinks only at "high". The o-series, and a family not known here, take the three usual ones.
_EFFORT_ORDER = ("none", "minimal", "low", "medium", "high", "xhigh")
_USUAL_EFFORTS = ("low", "medium", "high")
_FAMILY_EFFORTS: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...] = (
    (re.compile(r"gpt-5-pro(?:-|$)"), ("high",)),
    (re.compile(r"gpt-5\.1-codex-max(?:-|$)"), ("low", "medium", "high", "xhigh")),
    (re.compile(r"gpt-5(?:\.1)?-codex(?:-|$)"), _USUAL_EFFORTS),
    (re.compile(r"gpt-5\.1(?:-|$)"), ("none", "low", "medium", "high")),
    (re.compile(r"gpt-5\.\d+(?:-|$)"), ("none", "low", "medium", "high", "xhigh")),
    (re.compile(r"gpt-5(?:-|$)"), ("minimal", "low", "medium", "high")),
)


def _efforts_of(model_id: str) -> tuple[str, ...]:
    """The ``reasoning_effort`` values ``model_id`` takes (a gateway's ``openai/`` prefix aside)."""
    name = model_id.rsplit("/", 1)[-1]
    return next((efforts for pattern, efforts in _FAMILY_EFFORTS if pattern.match(name)), _USUAL_EFFORTS)


def _effort(level: Reasoning, model_id: str) -> str:
    """OpenAI's ``reasoning_effort`` for a level: the level itself ("off" is "none") where the
    model takes it, else the nearest value it does take, so a level is never refused by the API
    (an o-series model's "off" is its least, "low"; gpt-5's "xhigh" is its most, "high"). Between
    two equally near values the higher wins: "minimal" asks for some thinking, so on gpt-5.1 it is
    "low", not "none"."""
    wanted = _EFFORT_ORDER.index("none" if level == "off" else level)
    efforts = _efforts_of(model_id)
    return min(efforts, key=lambda e: (abs(_EFFORT_ORDER.index(e) - wanted), -_EFFORT_ORDER.index(e)))


def _cause(exc: BaseException) -> str:
    """The transport's own words (``peer closed connection ...``), not the SDK's generic ones."""
    cause = exc.__cause__ or exc
    return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__


# ------------------------------------------------------------------ history conversion


def _media_part(block: MediaBlock, documents: bool) -> dict[str, Any]:
    """An image, a PDF (a ``file`` part, where the server takes ``documents``), or a text document
    as text (the API takes PDFs only)."""
    if isinstance(block, ImageContent):
        return {"type": "image_url", "image_url": {"url": f"data:{block.mime_type};base64,{block.data}"}}
    text = file_text(block)
    if text is not None:
        return {"type": "text", "text": text}
    if not documents:  # many OpenAI-compatible servers refuse a ``file`` part, and it would stay in history
        return {"type": "text", "text": f"[PDF {block.name or 'document'} omitted: this server does not take PDFs]"}
    return {
        "type": "file",
        "file": {"filename": block.name or "document.pdf", "file_data": f"data:{block.mime_type};base64,{block.data}"},
    }


def _joined(blocks: list[UserBlock]) -> str:
    """The text blocks of a message as one string, a line apart: separate blocks (an MCP tool's
    several results, a note after a text) are separate texts, which glued together ran into one
    another ("Found 2 files:a.py")."""
    return "\n".join(b.text for b in blocks if isinstance(b, TextContent) and b.text)


def _user_content(blocks: list[UserBlock], documents: bool) -> str | list[dict[str, Any]]:
    if all(isinstance(b, TextContent) for b in blocks):
        return _joined(blocks)
    return [
        {"type": "text", "text": b.text} if isinstance(b, TextContent) else _media_part(b, documents) for b in blocks
    ]


def to_openai_messages(request: ModelRequest, documents: bool = True) -> list[dict[str, Any]]:
    """Our history as Chat Completions messages, after replay hygiene.

    Tool results can only carry text, so their images and documents follow in one user message
    after the run of tool messages (a user message inside the run would separate results from
    their calls).
    """
    out: list[dict[str, Any]] = []
    if request.system_prompt:
        out.append({"role": "system", "content": request.system_prompt})
    pending_images: list[dict[str, Any]] = []

    def flush_images() -> None:
        if pending_images:
            parts = [{"type": "text", "text": "Images and files returned by the tools above:"}, *pending_images]
            out.append({"role": "user", "content": parts})
            pending_images.clear()

    for msg in clean_history(request.messages, lambda i: safe_tool_id(i, TOOL_ID_MAX)):
        if isinstance(msg, ToolResultMessage):
            out.append({"role": "tool", "tool_call_id": msg.tool_call_id, "content": _joined(msg.content)})
            pending_images.extend(_media_part(b, documents) for b in msg.content if not isinstance(b, TextContent))
            continue
        flush_images()
        if isinstance(msg, UserMessage):
            out.append({"role": "user", "content": _user_content(msg.content, documents)})
        elif isinstance(msg, SystemMessage):
            out.append({"role": "system", "content": msg.text})
        elif isinstance(msg, AssistantMessage):
            entry: dict[str, Any] = {"role": "assistant", "content": msg.text}
            if msg.tool_calls:
                entry["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": _arguments(c)},
                    }
                    for c in msg.tool_calls
                ]
            out.append(entry)
    flush_images()
    return out


def _arguments(call: ToolCall) -> str:
    """A call's arguments as the model wrote them: its own text when it was not a JSON object,
    so the error that answered it matches what the model sees of its call."""
    if call.invalid_arguments is not None:
        return call.invalid_arguments
    return json.dumps(call.arguments, ensure_ascii=False)
