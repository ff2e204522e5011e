"""Google's Gemini API (``generateContent``), spoken over plain httpx.

No SDK: the wire format is one JSON request and an SSE stream of ``GenerateContentResponse``
chunks, and the core already depends on httpx, so the google-genai SDK (and its dependency tree)
would buy nothing the loop needs. The API key travels in the ``x-goog-api-key`` header, never in
the URL, so it cannot leak through a logged URL or an httpx error message.

Three facts shape the conversion:

- Function calls come whole (no argument deltas) and, in older API versions, without ids. A call
  without an id gets a generated one here; ids the API issued are sent back on the call and its
  ``functionResponse``, generated ones never are (the API matches responses by name and order,
  so the responses of a turn are sent in the order of its calls).
- ``thoughtSignature`` may sit on any part: a thought, a text, a function call (only the first
  of parallel calls). It must come back on the same part. Thought parts keep theirs on the
  thinking block; a signature on another part becomes an empty signed thinking block placed
  before that part (after it, for text, where the signature arrives on the last chunk), and is
  moved back onto the part when the history is replayed to the same model.
- Finish reasons other than STOP and MAX_TOKENS (SAFETY, RECITATION, MALFORMED_FUNCTION_CALL...)
  and a blocked prompt (``promptFeedback.blockReason``) end the turn as errors with the reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from agentloop.events import ErrorKind, StreamEvent
from agentloop.messages import (
    AssistantMessage,
    FileContent,
    MediaBlock,
    Message,
    StopReason,
    SystemMessage,
    TextContent,
    ThinkingContent,
    ToolCall,
    ToolResultMessage,
    Usage,
    UserBlock,
    UserMessage,
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
    ToolSpec,
    check_event_stream,
    file_text,
    http_error,
    make_usage,
    quote_body,
    stream_broken,
    thinking_budget,
)
from agentloop.models.catalog import model_info
from agentloop.models.idle import IdleLimit, StreamIdle, idle_seconds
from agentloop.models.overflow import is_overflow_text
from agentloop.models.replay import clean_history
from agentloop.models.retry import parse_retry_after, retry_after_from_headers
from agentloop.urls import redact_url

DEFAULT_BASE_URL = "https://generativelanguage.googleapis.com"
MIN_PRO_THINKING = 128  # a Pro model's least thinking budget (it cannot turn thinking off)
# The most thinking each Gemini 2.5 family takes (a larger budget is refused with a 400): Pro up
# to 32k, Flash and Flash-Lite up to 24k, so ``xhigh`` is ``high`` on the latter.
MAX_PRO_THINKING = 32_768
MAX_FLASH_THINKING = 24_576


def _max_thinking(model_id: str) -> int | None:
    """The largest thinking budget ``model_id`` takes, where its family's limit is known."""
    if "-pro" in model_id:
        return MAX_PRO_THINKING
    if "-flash" in model_id:
        return MAX_FLASH_THINKING
    return None


API_VERSIONS = ("v1beta", "v1alpha", "v1")
GENERATED_ID_PREFIX = "gemini_call_"
# Documented stand-in for a function call that carries no signature because another model (or
# an edited history) produced it; Gemini 3 rejects the first call of a step without one.
SKIP_SIGNATURE = "skip_thought_signature_validator"

_FINISH: dict[str, StopReason] = {"STOP": "stop", "MAX_TOKENS": "length"}
_FINISH_TEXT = {
    "SAFETY": "the answer was stopped by the safety filter",
    "RECITATION": "the answer was stopped because it recited training data",
    "LANGUAGE": "the answer was stopped: unsupported language",
    "BLOCKLIST": "the answer was stopped: it contains blocked terms",
    "PROHIBITED_CONTENT": "the answer was stopped: prohibited content",
    "SPII": "the answer was stopped: it contains sensitive personal information",
    "IMAGE_SAFETY": "the answer was stopped by the image safety filter",
    "MALFORMED_FUNCTION_CALL": "the model produced a function call that is not valid",
    "UNEXPECTED_TOOL_CALL": "the model called a tool that was not offered",
    "TOO_MANY_TOOL_CALLS": "the model made too many tool calls in a row",
}
# JSON-schema keys Gemini's OpenAPI-subset ``parameters`` accepts; everything else is dropped
_SCHEMA_KEYS = frozenset(
    {
        "type", "format", "description", "nullable", "enum", "items", "properties", "required",
        "anyOf", "minItems", "maxItems", "minimum", "maximum", "minLength", "maxLength", "pattern",
        "minProperties", "maxProperties", "propertyOrdering", "default", "example",
    }
)  # fmt: skip


class GeminiModel(Model):
    """A Gemini model behind ``/v1beta/models/{model}:streamGenerateContent``.

    ``thinking_budget`` (tokens; 0 turns thinking off on models that allow it) and
    ``include_thoughts`` (thought summaries in the stream, default on for reasoning models) fill
    ``generationConfig.thinkingConfig``. ``json_schema`` sends tool schemas as
    ``parametersJsonSchema`` (full JSON Schema); turn it off for servers that only know the older
    OpenAPI-subset ``parameters``, which gets a sanitised copy. Other ``options`` are merged into
    ``generationConfig`` (``topP``, ``topK``, ``stopSequences``, ...); ``timeout`` configures the
    HTTP client.

    ``api_key`` is a key, or a function (plain or async) asked for the key before every call
    (see ``KeySource``); a call refused with 401 asks it once more and is retried once with a
    different key.
    """

    def __init__(
        self,
        model_id: str,
        *,
        api_key: ApiKey = None,
        base_url: str | None = None,
        client: httpx.AsyncClient | None = None,
        info: ModelInfo | None = None,
        thinking_budget: int | None = None,
        include_thoughts: bool | None = None,
        json_schema: bool = True,
        timeout: float | httpx.Timeout | None = None,
        **options: Any,
    ) -> None:
        self.model_id = model_id.removeprefix("models/")
        self.info = info or model_info("gemini", self.model_id)
        if not callable(api_key):
            api_key = api_key or os.environ.get("GEMINI_API_KEY") or os.environ.get("GOOGLE_API_KEY") or None
        # a proxy at a custom base URL may hold the key itself: no header then, not a fake key
        self._keys, url = KeySource.of(
            api_key, base_url, key_env="GEMINI_API_KEY", url_env="GEMINI_BASE_URL", placeholder="", what="Gemini"
        )
        self.base_url = (url or DEFAULT_BASE_URL).rstrip("/")
        self.thinking_budget = thinking_budget
        self.include_thoughts = self.info.reasoning if include_thoughts is None else include_thoughts
        self.json_schema = json_schema
        self.timeout = timeout if timeout is not None else httpx.Timeout(600.0, connect=10.0)
        self.options = options
        self._client = client
        self._own_client: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] | None = None

    def __repr__(self) -> str:  # never the key
        return f"GeminiModel({self.model_id!r}, base_url={redact_url(self.base_url)!r})"

    @property
    def url(self) -> str:
        """The streaming endpoint; a base URL that already names an API version keeps it."""
        base = self.base_url
        if base.rsplit("/", 1)[-1] not in API_VERSIONS:
            base += "/v1beta"
        return f"{base}/models/{self.model_id}:streamGenerateContent?alt=sse"

    def _http(self) -> httpx.AsyncClient:
        """The given client, or one of our own per event loop (a pool cannot cross loops)."""
        if self._client is not None:
            return self._client
        loop = asyncio.get_running_loop()
        if self._own_client is None or self._own_client[0] is not loop:
            self._own_client = (loop, httpx.AsyncClient(timeout=self.timeout))
        return self._own_client[1]

    def _headers(self, key: str | None) -> dict[str, str]:
        if key is None:
            raise ProviderError(
                "no Gemini API key (set GEMINI_API_KEY or GOOGLE_API_KEY, or GEMINI_BASE_URL for a proxy)", kind="auth"
            )
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        if key:
            headers["x-goog-api-key"] = key
        return headers

    @asynccontextmanager
    async def _response(self, client: httpx.AsyncClient, body: dict[str, Any]) -> AsyncIterator[httpx.Response]:
        """The streaming response to ``body``, sent with the key valid now. A 401 with a key
        provider asks it once more (the token may have expired on the way) and sends once more."""
        key = await self._keys.get()
        fresh: str | None = None
        async with client.stream("POST", self.url, json=body, headers=self._headers(key)) as response:
            if response.status_code == 401:
                fresh = await self._keys.refreshed(key)
            if fresh is None:
                yield response
                return
        async with client.stream("POST", self.url, json=body, headers=self._headers(fresh)) as response:
            yield response

    # ------------------------------------------------------------------ request

    def build_body(self, request: ModelRequest) -> dict[str, Any]:
        """The request body, public so it can be inspected in tests."""
        body: dict[str, Any] = {"contents": to_gemini_contents(request.messages, self.info)}
        if request.system_prompt:
            body["systemInstruction"] = {"parts": [{"text": request.system_prompt}]}
        if request.tools:
            body["tools"] = [{"functionDeclarations": [self._declaration(t) for t in request.tools]}]
            body["toolConfig"] = {"functionCallingConfig": {"mode": "AUTO"}}
        config: dict[str, Any] = {}
        if request.max_tokens is not None:
            config["maxOutputTokens"] = request.max_tokens
        if request.temperature is not None:
            config["temperature"] = request.temperature
        budget = self.thinking_budget
        if request.reasoning is not None and self.info.reasoning:  # the run's level wins over the model's
            budget = thinking_budget(request.reasoning, self.info, maximum=_max_thinking(self.model_id))
            if budget == 0 and "-pro" in self.model_id:  # a Pro model cannot stop thinking: its least
                budget = MIN_PRO_THINKING
        if budget is not None or self.include_thoughts:
            thinking: dict[str, Any] = {}
            if budget is not None:
                thinking["thinkingBudget"] = budget
            if self.include_thoughts:
                thinking["includeThoughts"] = True
            config["thinkingConfig"] = thinking
        config.update(self.options)
        if config:
            body["generationConfig"] = config
        return body

    def _declaration(self, tool: ToolSpec) -> dict[str, Any]:
        decl: dict[str, Any] = {"name": tool.name, "description": tool.description}
        params = tool.parameters
        if not params.get("properties") and not params.get("anyOf"):
            return decl  # a function without parameters leaves the field unset
        if self.json_schema:
            decl["parametersJsonSchema"] = params
        else:
            decl["parameters"] = openapi_schema(params)
        return decl

    # ------------------------------------------------------------------ response

    async def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
        body = await self.payload(request, "gemini", self.build_body(request))
        client = self._http()
        async with self._response(client, body) as response:
            if response.status_code >= 400:
                raw = await response.aread()
                raise classify_status(response.status_code, raw, response.headers)
            await check_event_stream(response)
            yield out.start()
            reader = _ChunkReader(self.info, out)
            try:
                async for data, ended in IdleLimit(_sse_data(response), idle_seconds(client.timeout)):
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError as exc:
                        if not ended:  # the body ended inside this event: a cut stream (retried), not garbage
                            continue  # (the last one: the stream ends here)
                        raise ProviderError(
                            f"unreadable stream chunk: {data[:200]!r}", kind="invalid_response"
                        ) from exc
                    for event in reader.read(chunk):
                        yield event
            except (httpx.TransportError, httpx.StreamError, StreamIdle) as exc:
                if reader.finish is None:  # (after the finish the answer is whole: at most its usage is lost)
                    timed_out = isinstance(exc, httpx.TimeoutException | StreamIdle)
                    kind: ErrorKind = "timeout" if timed_out else "connection"
                    raise ProviderError(stream_broken(f"the stream broke: {_cause(exc)}", out), kind=kind) from exc
        if reader.finish is None:
            raise ProviderError(stream_broken(STREAM_CUT, out), kind="connection")
        stop = _FINISH.get(reader.finish)
        if stop is None:
            text = _FINISH_TEXT.get(reader.finish, "the answer was stopped")
            kind = "invalid_response" if reader.finish == "MALFORMED_FUNCTION_CALL" else "bad_request"
            raise ProviderError(f"{text} (finishReason {reader.finish}{reader.ratings()})", kind=kind)
        for event in out.finish(stop, reader.usage()):
            yield event

    # ------------------------------------------------------------------ errors

    def classify(self, exc: BaseException) -> ProviderError:
        if isinstance(exc, ProviderError):
            return exc
        if isinstance(exc, httpx.TimeoutException):
            return ProviderError(f"the request to {self.name} timed out", kind="timeout")
        if isinstance(exc, httpx.TransportError):
            return ProviderError(f"cannot reach {redact_url(self.base_url)}: {_cause(exc)}", kind="connection")
        if isinstance(exc, ValueError | TypeError | AttributeError | KeyError):
            return ProviderError(f"unreadable response: {type(exc).__name__}: {exc}", kind="invalid_response")
        return super().classify(exc)

    def secrets(self) -> tuple[str, ...]:
        return self._keys.secrets()


# ------------------------------------------------------------------ errors


def _error_body(raw: bytes) -> tuple[str, str, Any]:
    """``(message, status, details)`` of Google's ``{"error": {code, message, status, details}}``;
    a body that is not that shape (a proxy's HTML page) is quoted, shortened."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace").strip()[:300] or "(no body)", "", None
    if isinstance(body, list) and body:  # some gateways wrap the error in a list
        body = body[0]
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return json.dumps(body)[:300], "", None
    return str(err.get("message") or ""), str(err.get("status") or ""), err.get("details")


def _retry_delay(details: Any) -> float | None:
    """``google.rpc.RetryInfo.retryDelay`` ("37s") from an error's details, if present."""
    for detail in details if isinstance(details, list) else ():
        if isinstance(detail, dict) and str(detail.get("@type", "")).endswith("RetryInfo"):
            delay = detail.get("retryDelay")
            if isinstance(delay, str):
                return parse_retry_after(delay.removesuffix("s"))
    return None


def _reason(details: Any) -> str | None:
    """``google.rpc.ErrorInfo.reason`` (``API_KEY_INVALID``...) from an error's details."""
    for detail in details if isinstance(details, list) else ():
        if isinstance(detail, dict) and str(detail.get("@type", "")).endswith("ErrorInfo"):
            return str(detail.get("reason") or "") or None
    return None


def classify_status(status: int, raw: bytes, headers: httpx.Headers) -> ProviderError:
    """The error kind of an HTTP error answer: 429/5xx transient, 401/403 auth, overflow by text."""
    message, code, details = _error_body(raw)
    text = f"HTTP {status} {code}: {message}" if code else f"HTTP {status}: {message}"
    error = http_error(
        status,
        text,
        retry_after=retry_after_from_headers(headers) or _retry_delay(details),
        rate_limited=code == "RESOURCE_EXHAUSTED",
        auth=_reason(details) == "API_KEY_INVALID",  # a bad key is a 400 at Google
        overflow=is_overflow_text(message),
    )
    if error.kind == "auth" and "key" in message.lower():  # Google names the key; say where it came from
        return ProviderError(f"{text} (check GEMINI_API_KEY)", kind="auth", status=status)
    return error


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _error_status(code: object) -> int:
    """The HTTP status an error inside the stream names by its ``code``; 500 (a server error,
    retried) when that is not one: read as a number whatever it was, a word failed the answer
    as unreadable and lost what the error said."""
    if isinstance(code, str) and code.strip().isdigit():
        code = int(code)
    if isinstance(code, float) and code.is_integer():
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600:
        return code
    return 500


async def _sse_data(response: httpx.Response) -> AsyncGenerator[tuple[str, bool], None]:
    """The ``data`` payload of each SSE event (multi-line data joined, comments skipped), and
    whether a blank line ended it. The last event of a body may lack that line (some servers
    omit it), or be cut off in the middle: only the reader can tell the two apart."""
    lines: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if lines:
                yield "\n".join(lines), True
                lines = []
        elif line.startswith("data:"):
            lines.append(line[5:].removeprefix(" "))
    if lines:
        yield "\n".join(lines), False


# ------------------------------------------------------------------ stream reading


class _ChunkReader:
    """Turns ``GenerateContentResponse`` chunks into builder calls; keeps usage and finish."""

    def __init__(self, info: ModelInfo, out: AssistantBuilder) -> None:
        self.info = info
        self.out = out
        self.finish: str | None = None
        self._usage: dict[str, Any] = {}
        self._ratings: list[Any] = []
        self._calls = 0

    def usage(self) -> Usage:
        """``usageMetadata`` is cumulative, the latest wins. Thinking is billed as output; the
        cached part of the prompt is reported apart from (and included in) the prompt count."""
        u = self._usage
        cached = max(0, int(u.get("cachedContentTokenCount") or 0))  # (negative: the prompt grew by it)
        prompt = int(u.get("promptTokenCount") or 0) + int(u.get("toolUsePromptTokenCount") or 0)
        output = int(u.get("candidatesTokenCount") or 0) + int(u.get("thoughtsTokenCount") or 0)
        return make_usage(self.info, input=max(0, prompt - cached), output=output, cache_read=cached)

    def ratings(self) -> str:
        """The safety categories that were not rated negligible, for the error message."""
        flagged = [
            str(r.get("category", "")).removeprefix("HARM_CATEGORY_")
            for r in self._ratings
            if isinstance(r, dict) and (r.get("blocked") or r.get("probability") in ("MEDIUM", "HIGH"))
        ]
        return f"; flagged: {', '.join(flagged)}" if flagged else ""

    def read(self, chunk: Any) -> list[StreamEvent]:
        if not isinstance(chunk, dict):
            raise ProviderError(f"unreadable stream chunk: {json.dumps(chunk)[:200]}", kind="invalid_response")
        error = chunk.get("error")
        if isinstance(error, dict):  # an error inside a 200 stream
            raise classify_status(_error_status(error.get("code")), json.dumps(chunk).encode(), httpx.Headers())
        if error:  # a proxy's error, as a string: not a chunk to skip and then call the stream cut
            raise ProviderError(f"stream error: {quote_body(error)}", kind="server")
        if isinstance(chunk.get("usageMetadata"), dict):
            self._usage = chunk["usageMetadata"]
        feedback = chunk.get("promptFeedback") or {}
        if feedback.get("blockReason"):
            self._ratings = feedback.get("safetyRatings") or []
            reason = feedback["blockReason"]
            raise ProviderError(f"the prompt was blocked (blockReason {reason}{self.ratings()})", kind="bad_request")
        events: list[StreamEvent] = []
        candidates = chunk.get("candidates") or []
        if candidates:  # one candidate is asked for; others are ignored
            cand = candidates[0]
            for part in (cand.get("content") or {}).get("parts") or ():
                events.extend(self._part(part))
            if cand.get("safetyRatings"):
                self._ratings = cand["safetyRatings"]
            if cand.get("finishReason"):
                self.finish = str(cand["finishReason"])
        return events

    def _signature(self, signature: str) -> list[StreamEvent]:
        """An empty thinking block that carries a non-thought part's signature."""
        out = self.out
        return out.end_block() + out.thinking("", signature) + out.end_block()

    def _part(self, part: dict[str, Any]) -> list[StreamEvent]:
        out = self.out
        signature = part.get("thoughtSignature") or None
        if part.get("thought"):
            text = str(part.get("text") or "")
            return out.thinking(text, signature) if text or signature else []
        call = part.get("functionCall")
        if isinstance(call, dict):
            events = self._signature(signature) if signature else []
            self._calls += 1
            call_id = call.get("id") or f"{GENERATED_ID_PREFIX}{uuid.uuid4().hex[:12]}"
            # arguments that are not an object go through as written: the call keeps them as
            # ``invalid_arguments`` and the loop tells the model what to fix, rather than the reply failing
            args = call.get("args")
            key = ("call", self._calls)
            events += out.tool_call(key, str(call_id), str(call.get("name") or ""))
            return events + out.tool_args(key, json.dumps({} if args is None else args, ensure_ascii=False))
        if "text" in part:
            events = out.text(str(part["text"] or ""))
            return events + self._signature(signature) if signature else events
        if signature:
            return self._signature(signature)
        return []  # executableCode, inlineData answers...: not part of our vocabulary yet


# ------------------------------------------------------------------ schema


def openapi_schema(schema: Any) -> Any:
    """A JSON schema reduced to the OpenAPI subset of Gemini's ``parameters``: unknown keys
    (``additionalProperties``, ``$schema``, ``title``...) dropped, ``["x", "null"]`` types made
    ``nullable``, ``const`` made a one-value ``enum``, local ``$ref``s inlined."""
    defs: dict[str, Any] = {}
    if isinstance(schema, dict):
        defs = schema.get("$defs") or schema.get("definitions") or {}

    def walk(node: Any, depth: int = 0) -> Any:
        if not isinstance(node, dict) or depth > 32:
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.rsplit("/", 1)[-1] in defs:
            node = {**defs[ref.rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key == "const":
                out["enum"] = [value]
            elif key == "type" and isinstance(value, list):
                types = [t for t in value if t != "null"]
                out["type"] = types[0] if types else "null"
                if "null" in value:
                    out["nullable"] = True
            elif key == "properties" and isinstance(value, dict):
                out[key] = {name: walk(sub, depth + 1) for name, sub in value.items()}
            elif key == "items":
                out[key] = walk(value, depth + 1)
            elif key in ("anyOf", "oneOf") and isinstance(value, list):
                out["anyOf"] = [walk(v, depth + 1) for v in value]
            elif key in _SCHEMA_KEYS:
                out[key] = value
        return out

    return walk(schema)


# ------------------------------------------------------------------ history conversion


def _inline(block: MediaBlock) -> dict[str, Any]:
    """An image or a PDF as inline data; a text document as its text."""
    text = file_text(block) if isinstance(block, FileContent) else None
    if text is not None:
        return {"text": text}
    return {"inlineData": {"mimeType": block.mime_type, "data": block.data}}


def _user_parts(blocks: list[UserBlock]) -> list[dict[str, Any]]:
    """Text, images and documents; empty text parts are rejected by the API, so they are left out."""
    parts: list[dict[str, Any]] = []
    for b in blocks:
        if not isinstance(b, TextContent):
            parts.append(_inline(b))
        elif b.text:
            parts.append({"text": b.text})
    return parts


def _is_ours(call_id: str, msg: AssistantMessage) -> bool:
    """True for an id the Gemini API issued (and so expects back), not one generated here or by
    another provider."""
    return msg.provider == "gemini" and not call_id.startswith(GENERATED_ID_PREFIX)


def _model_parts(msg: AssistantMessage, info: ModelInfo) -> list[dict[str, Any]]:
    """An assistant turn as ``model`` parts. Signatures go back only to the model that wrote
    them; another model's thinking travels as text, and its function calls (unsigned) get the
    documented skip value on Gemini 3, which otherwise rejects the step."""
    same_model = msg.provider == info.provider and msg.model == info.id
    parts: list[dict[str, Any]] = []
    pending: str | None = None  # a function call's signature, waiting for its call
    blocks = msg.content
    for i, block in enumerate(blocks):
        if isinstance(block, ThinkingContent):
            if not same_model:
                if block.thinking.strip():
                    parts.append({"text": block.thinking})
            elif block.thinking:
                part: dict[str, Any] = {"text": block.thinking, "thought": True}
                if block.signature:
                    part["thoughtSignature"] = block.signature
                parts.append(part)
            elif block.signature:  # a carried signature: the call after it, or the text before it
                before_text = bool(parts) and "text" in parts[-1] and "thoughtSignature" not in parts[-1]
                if i + 1 < len(blocks) and isinstance(blocks[i + 1], ToolCall):
                    pending = block.signature
                elif before_text:
                    parts[-1]["thoughtSignature"] = block.signature
                else:
                    parts.append({"text": "", "thought": True, "thoughtSignature": block.signature})
        elif isinstance(block, TextContent):
            if block.text:
                parts.append({"text": block.text})
        elif isinstance(block, ToolCall):
            call: dict[str, Any] = {"name": block.name, "args": block.arguments}
            if _is_ours(block.id, msg):
                call["id"] = block.id
            part = {"functionCall": call}
            if pending:
                part["thoughtSignature"], pending = pending, None
            parts.append(part)
    if not same_model and "gemini-3" in info.id:
        first = next((p for p in parts if "functionCall" in p), None)
        if first is not None:
            first["thoughtSignature"] = SKIP_SIGNATURE
    return parts


def _response_parts(results: list[ToolResultMessage], calls: AssistantMessage | None) -> list[dict[str, Any]]:
    """One turn's results as ``functionResponse`` parts in the order of the calls (the API pairs
    them by name and position), with the results' images after them."""
    order = {c.id: i for i, c in enumerate(calls.tool_calls)} if calls else {}
    names = {c.id: c.name for c in calls.tool_calls} if calls else {}
    parts: list[dict[str, Any]] = []
    images: list[dict[str, Any]] = []
    for res in sorted(results, key=lambda r: order.get(r.tool_call_id, len(order))):
        payload = {"error" if res.is_error else "output": res.text}
        response: dict[str, Any] = {"name": names.get(res.tool_call_id, res.tool_name), "response": payload}
        if calls is not None and _is_ours(res.tool_call_id, calls):
            response["id"] = res.tool_call_id
        parts.append({"functionResponse": response})
        images.extend(_inline(b) for b in res.content if not isinstance(b, TextContent))
    return parts + images


def to_gemini_contents(messages: list[Message], info: ModelInfo) -> list[dict[str, Any]]:
    """Our history as alternating ``user`` / ``model`` contents, after replay hygiene.

    Runtime notices (``SystemMessage``) in mid-history cannot be a system instruction here, so
    they travel as marked user text, in their place. Contents of one role next to each other are
    merged, which every API version accepts.
    """
    out: list[dict[str, Any]] = []

    def add(role: str, parts: list[dict[str, Any]]) -> None:
        if not parts:
            return
        if out and out[-1]["role"] == role:
            out[-1]["parts"].extend(parts)
        else:
            out.append({"role": role, "parts": parts})

    last_calls: AssistantMessage | None = None
    results: list[ToolResultMessage] = []

    def flush() -> None:
        if results:
            add("user", _response_parts(results, last_calls))
            results.clear()

    for msg in clean_history(messages):
        if isinstance(msg, ToolResultMessage):
            results.append(msg)
            continue
        flush()
        if isinstance(msg, UserMessage):
            add("user", _user_parts(msg.content))
        elif isinstance(msg, SystemMessage):
            add("user", [{"text": NOTICE_PREFIX + msg.text}])
        elif isinstance(msg, AssistantMessage):
            add("model", _model_parts(msg, info))
            last_calls = msg
    flush()
    return out
