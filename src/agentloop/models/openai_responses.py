"""OpenAI's Responses API (``/v1/responses``), through the official SDK.

The history is agentloop's, not OpenAI's: every request is stateless (``store: false``) and sends
the whole conversation as ``input`` items. A reasoning model's thinking survives between turns
only if it is sent back, so its reasoning items are asked for with their encrypted content
(``include: ["reasoning.encrypted_content"]``) and kept on the assistant message: each becomes a
``ThinkingContent`` whose text is the item's summary and whose ``signature`` holds the item's id
and encrypted content (as JSON: opaque to everyone but this adapter). They are replayed only to
the model that wrote them; another provider's thinking is left out, as the Chat Completions
adapter leaves it out.

A compaction that asks for the provider's own (``compact_natively``: ``/v1/responses/compact``)
gets its output, the compacted part's user messages and one encrypted ``compaction`` item, kept
on the summary message; a request to the same model sends those items in the summary's place,
any other the summary's text. The endpoint returns no readable summary, so the summary itself
is written by the usual summary call.

The adapter is the Chat Completions one over another endpoint: the same keys, client, base URL
and error classification (HTTP errors, overflow texts, garbage in the stream), so it subclasses
it and replaces only the request body and the reading of the stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any, cast

import openai
from openai import AsyncOpenAI

from agentloop.events import ErrorKind, StreamEvent
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
)
from agentloop.models.base import (
    PROVIDER_COMPACTION,
    STREAM_CUT,
    ApiKey,
    AssistantBuilder,
    ModelInfo,
    ModelRequest,
    NativeCompaction,
    ProviderError,
    check_event_stream,
    error_parts,
    file_text,
    http_error,
    make_usage,
    send_keyed,
    stream_broken,
)
from agentloop.models.catalog import model_info
from agentloop.models.idle import IdleLimit, StreamIdle, idle_seconds
from agentloop.models.openai_chat import TOOL_ID_MAX, OpenAIChatModel, _arguments, _cause, _effort, sdk_kwargs
from agentloop.models.overflow import is_overflow_text
from agentloop.models.replay import clean_history, safe_tool_id

PROVIDER = "openai-responses"  # the provider of its model strings and of the messages it writes
API = "openai-responses"  # what a provider-request hook sees as ``api``
SUMMARIES = ("auto", "concise", "detailed")
ENCRYPTED_REASONING = "reasoning.encrypted_content"

# ``error.code`` of a failed response (or of an ``error`` event) -> our kind; a code not listed
# names something wrong with the request (an image, a policy), not retried
_CODES: dict[str, ErrorKind] = {
    "rate_limit_exceeded": "rate_limit",
    "server_error": "server",
    "vector_store_timeout": "server",
    "insufficient_quota": "auth",  # no credit left: waiting does not end it (as the chat adapter says)
    "context_length_exceeded": "overflow",
}
# why a response ended incomplete -> our stop reason; other reasons (``content_filter``) are errors
_INCOMPLETE: dict[str, StopReason] = {"max_output_tokens": "length"}


def responses_info(model_id: str) -> ModelInfo:
    """OpenAI's facts for ``model_id`` (window, prices, whether it reasons) under this adapter's
    provider name, so its messages and its name (``openai-responses:gpt-5``) say which API wrote them."""
    return replace(model_info("openai", model_id), provider=PROVIDER)


class OpenAIResponsesModel(OpenAIChatModel):
    """A model behind ``/v1/responses`` (``openai-responses:<model>``).

    Takes what ``OpenAIChatModel`` takes (``api_key`` may be a key provider; ``options`` go into
    every request body, ``store=True`` among them), and ``reasoning_summary``: the summary a
    reasoning model is asked for ("auto", "concise", "detailed"), streamed as thinking; None asks
    for none (an organisation OpenAI has not verified is refused summaries).
    """

    def __init__(
        self,
        model_id: str,
        *,
        api_key: ApiKey = None,
        base_url: str | None = None,
        client: AsyncOpenAI | None = None,
        info: ModelInfo | None = None,
        reasoning_summary: str | None = "auto",
        **options: Any,
    ) -> None:
        if reasoning_summary is not None and reasoning_summary not in SUMMARIES:
            raise ValueError(
                f"reasoning_summary must be one of {', '.join(SUMMARIES)} or None, got {reasoning_summary!r}"
            )
        super().__init__(
            model_id,
            api_key=api_key,
            base_url=base_url,
            client=client,
            info=info or responses_info(model_id),
            **options,
        )
        self.reasoning_summary = reasoning_summary

    async def _open(self, params: dict[str, Any]) -> tuple[AsyncOpenAI, openai.AsyncStream[Any]]:
        """As the chat adapter sends (the key valid now, one retry on a 401), to ``/v1/responses``."""
        return await send_keyed(
            self._keys, self.client, lambda client: _send(client, params), openai.AuthenticationError
        )

    # ------------------------------------------------------------------ request

    def build_params(self, request: ModelRequest) -> dict[str, Any]:
        """The request body (minus transport details), public so it can be inspected in tests."""
        params: dict[str, Any] = {
            "model": self.model_id,
            "input": to_responses_input(request, self.info, documents=self.base_url is None),
            "stream": True,
            "store": False,  # agentloop keeps the history: nothing is left on OpenAI's side
        }
        if request.system_prompt:
            params["instructions"] = request.system_prompt
        if request.tools:
            # ``strict`` is said: the Responses API makes a function strict by default, and a
            # strict schema must list every property as required, which most tools' do not
            params["tools"] = [
                {"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                 "strict": False}
                for t in request.tools
            ]  # fmt: skip
            if not request.parallel_tool_calls:  # (unlike Chat Completions, taken by reasoning models too)
                params["parallel_tool_calls"] = False
        if request.cache_key and self.base_url is None:  # OpenAI's own API; other servers may refuse it
            params["prompt_cache_key"] = request.cache_key
        if request.max_tokens is not None:
            params["max_output_tokens"] = request.max_tokens
        if request.temperature is not None and not self.info.reasoning:  # reasoning models refuse it
            params["temperature"] = request.temperature
        params.update(self.options)
        if self.info.reasoning:
            self._reasoning_params(request, params)
        return params

    def _reasoning_params(self, request: ModelRequest, params: dict[str, Any]) -> None:
        """A reasoning model's ``reasoning`` (the run's level wins over an option's) and the
        encrypted reasoning the next request sends back."""
        reasoning = dict(params.get("reasoning") or {})
        if self.reasoning_summary is not None:
            reasoning.setdefault("summary", self.reasoning_summary)
        if request.reasoning is not None:
            reasoning["effort"] = _effort(request.reasoning, self.model_id)
        if reasoning:
            params["reasoning"] = reasoning
        include = list(params.get("include") or ())
        if ENCRYPTED_REASONING not in include:
            include.append(ENCRYPTED_REASONING)
        params["include"] = include

    async def compact_natively(self, request: ModelRequest) -> NativeCompaction:
        """``/v1/responses/compact`` on ``request.messages``: the window it returns (the user
        messages, then the encrypted ``compaction`` item) to send in their place from now on.
        Raises (the SDK's errors, ``ProviderError``) when it fails or returns no compaction item."""
        params: dict[str, Any] = {
            "model": self.model_id,
            "input": to_responses_input(request, self.info, documents=self.base_url is None),
        }
        if request.system_prompt:
            params["instructions"] = request.system_prompt
        _, made = await send_keyed(
            self._keys, self.client, lambda client: client.responses.compact(**params), openai.AuthenticationError
        )
        # (as the server sent them: the SDK parses a user message as an output message, whose
        # serializer would warn about its ``input_text`` parts)
        dumped = [item.model_dump(mode="json", exclude_none=True, warnings=False) for item in made.output or ()]
        items = [_as_input_item(item) for item in dumped]
        if not any(item.get("type") == "compaction" for item in items):
            raise ProviderError("the compaction returned no compaction item", kind="invalid_response")
        usage = _usage(self.info, made.usage) if made.usage is not None else Usage()
        return NativeCompaction(self.info.provider, self.info.id, items, usage)

    # ------------------------------------------------------------------ response

    async def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
        params = await self.payload(request, API, self.build_params(request))
        client, response = await self._open(params)
        reader = _EventReader(self.info, out)
        async with response:  # from here on: closed also when the caller stops reading at the start
            await check_event_stream(response.response)
            yield out.start()
            try:
                async for event in IdleLimit(response, idle_seconds(client.timeout)):
                    for ev in reader.read(event):
                        yield ev
                    if reader.stop is not None:
                        break
            except (openai.APIConnectionError, StreamIdle) as exc:  # the stream broke: say how far it got
                if reader.stop is None:
                    timed_out = isinstance(exc, openai.APITimeoutError | StreamIdle)
                    kind: ErrorKind = "timeout" if timed_out else "connection"
                    raise ProviderError(stream_broken(f"the stream broke: {_cause(exc)}", out), kind=kind) from exc
        if reader.stop is None:
            raise ProviderError(stream_broken(STREAM_CUT, out), kind="connection")
        for ev in out.finish(reader.stop, reader.usage):
            yield ev


async def _send(client: AsyncOpenAI, params: dict[str, Any]) -> openai.AsyncStream[Any]:
    """One streaming Responses request through ``client``."""
    create = cast(Any, client.responses.create)  # overloads cannot see `stream` in a dict
    response: openai.AsyncStream[Any] = await create(**sdk_kwargs(create, params))
    return response


def response_error(code: object, message: object) -> ProviderError:
    """What a failed response (``response.failed``) or an ``error`` event says, by its code: an
    overflow, a rate limit, a failing server (both retried), a status the code names, else a
    request the provider will not take."""
    words, status = error_parts({"message": message or code or "(no message)", "code": code})
    named = f" ({code})" if isinstance(code, str) and code and not status else ""  # (a status is said by its kind)
    text = f"the response failed: {words}{named}"
    overflow = is_overflow_text(text)
    if status:
        return http_error(status, text, overflow=overflow)
    if overflow:
        return ProviderError(text, kind="overflow")
    if code is None:  # nothing says what went wrong: taken for the server's trouble
        return ProviderError(text, kind="server")
    return ProviderError(text, kind=_CODES.get(str(code), "bad_request"))


class _EventReader:
    """Turns Responses stream events into builder calls; keeps the usage and the stop reason.

    Output items are keyed by ``output_index``. Each item's start closes the open block, so two
    reasoning items (or a summary and the text after it) stay separate blocks. An item's whole
    form at its end fills in what no delta brought (a server that sends items whole), and a
    reasoning item's end gives its thinking block the id and encrypted content to replay.
    """

    def __init__(self, info: ModelInfo, out: AssistantBuilder) -> None:
        self.info = info
        self.out = out
        self.stop: StopReason | None = None
        self.usage: Usage | None = None
        self._streamed: set[int] = set()  # items some delta has filled (their end adds nothing)
        self._summary_part: dict[int, int] = {}  # reasoning item -> the summary part being streamed

    def read(self, event: Any) -> list[StreamEvent]:
        kind = getattr(event, "type", None)
        if kind == "response.output_item.added":
            return self._item_added(event.output_index, event.item)
        if kind in ("response.output_text.delta", "response.refusal.delta"):
            self._streamed.add(event.output_index)
            return self.out.text(event.delta)
        if kind in ("response.reasoning_summary_text.delta", "response.reasoning_text.delta"):
            return self._thinking(event.output_index, getattr(event, "summary_index", 0), event.delta)
        if kind == "response.function_call_arguments.delta":
            return self._arguments(event.output_index, event.delta)
        if kind == "response.output_item.done":
            return self._item_done(event.output_index, event.item)
        if kind in ("response.completed", "response.incomplete"):
            self._finished(event.response, incomplete=kind == "response.incomplete")
        elif kind == "response.failed":
            error = getattr(event.response, "error", None)
            raise response_error(getattr(error, "code", None), getattr(error, "message", None))
        elif kind == "error":
            raise response_error(getattr(event, "code", None), getattr(event, "message", None))
        return []  # lifecycle events, and the hosted tools' own (web search, ...): nothing to build

    def _item_added(self, index: int, item: Any) -> list[StreamEvent]:
        events = self.out.end_block()
        if item.type == "function_call":
            events += self.out.tool_call(index, getattr(item, "call_id", None), getattr(item, "name", None))
        return events

    def _thinking(self, index: int, part: int, delta: str) -> list[StreamEvent]:
        """A summary delta; a new summary part of the same item starts a new paragraph."""
        previous = self._summary_part.get(index)
        self._summary_part[index] = part
        self._streamed.add(index)
        if previous is not None and previous != part:
            delta = "\n\n" + delta
        return self.out.thinking(delta)

    def _arguments(self, index: int, delta: str) -> list[StreamEvent]:
        if not self.out.has_tool_call(index):  # dropped, the call would have run without them
            raise ProviderError(
                f"unreadable response: the provider sent function call arguments for output item {index}, "
                "which it never started",
                kind="invalid_response",
            )
        self._streamed.add(index)
        return self.out.tool_args(index, delta)

    def _item_done(self, index: int, item: Any) -> list[StreamEvent]:
        out = self.out
        streamed = index in self._streamed
        if item.type == "reasoning":
            return self._reasoning_done(item, streamed)
        events: list[StreamEvent] = []
        if item.type == "message" and not streamed:
            events += out.text("".join(_part_text(p) for p in getattr(item, "content", None) or ()))
        elif item.type == "function_call":
            if not out.has_tool_call(index):
                events += out.tool_call(index, getattr(item, "call_id", None), getattr(item, "name", None))
            elif not out.tool_name(index) and isinstance(getattr(item, "name", None), str):
                out.name_tool(index, item.name)
            if not streamed:
                events += out.tool_args(index, getattr(item, "arguments", None) or "")
        return events + out.end_block()

    def _reasoning_done(self, item: Any, streamed: bool) -> list[StreamEvent]:
        """The end of a reasoning item: its summary (when no delta brought it) and its signature,
        on the thinking block its deltas opened, or on a new one."""
        text = "" if streamed else "\n\n".join(_part_text(s) for s in getattr(item, "summary", None) or ())
        signature = reasoning_signature(getattr(item, "id", None), getattr(item, "encrypted_content", None))
        # (a server that sent the item only whole may have left another block open)
        events = [] if streamed else self.out.end_block()
        if text or signature is not None:
            events += self.out.thinking(text, signature)
        return events + self.out.end_block()

    def _finished(self, response: Any, incomplete: bool) -> None:
        raw = getattr(response, "usage", None)
        if raw is not None:
            self.usage = _usage(self.info, raw)
        if not incomplete:
            self.stop = "stop"  # (the builder makes it toolUse when the answer has calls)
            return
        details = getattr(response, "incomplete_details", None)
        reason = str(getattr(details, "reason", None) or "unknown")
        if reason not in _INCOMPLETE:
            raise ProviderError(f"the provider stopped the answer: incomplete ({reason})", kind="bad_request")
        self.stop = _INCOMPLETE[reason]


def _usage(info: ModelInfo, raw: Any) -> Usage:
    """A response's (or a compaction's) ``usage`` as ours, priced for ``info``."""
    details = getattr(raw, "input_tokens_details", None)
    cached = max(0, int(getattr(details, "cached_tokens", 0) or 0))
    prompt = int(getattr(raw, "input_tokens", 0) or 0)  # (cached tokens included)
    output = int(getattr(raw, "output_tokens", 0) or 0)  # (reasoning tokens included)
    return make_usage(info, input=max(0, prompt - cached), output=output, cache_read=cached)


def _part_text(part: Any) -> str:
    """The text of an item's part: ``output_text``'s text, a refusal's words, a summary's text."""
    text = getattr(part, "text", None) or getattr(part, "refusal", None)
    return text if isinstance(text, str) else ""


# ------------------------------------------------------------------ reasoning round-trip


def reasoning_signature(item_id: object, encrypted: object) -> str | None:
    """What a thinking block keeps of a reasoning item to send it back: its id and encrypted
    content as JSON, None when there is nothing to send back (no encrypted content: the request
    did not ask for it, or a server has none)."""
    if not isinstance(item_id, str) or not item_id or not isinstance(encrypted, str) or not encrypted:
        return None
    return json.dumps({"id": item_id, "encrypted_content": encrypted}, separators=(",", ":"))


def _reasoning_item(block: ThinkingContent) -> dict[str, Any] | None:
    """The reasoning item a thinking block of this adapter's came from, or None when its
    signature is not one of ours (left out rather than failing every later call)."""
    try:
        kept = json.loads(block.signature or "")
    except ValueError:
        return None
    if not isinstance(kept, dict) or not all(isinstance(kept.get(k), str) for k in ("id", "encrypted_content")):
        return None
    summary = [{"type": "summary_text", "text": block.thinking}] if block.thinking else []
    return {"type": "reasoning", "id": kept["id"], "summary": summary, "encrypted_content": kept["encrypted_content"]}


# ------------------------------------------------------------------ history conversion


def _compacted(msg: SystemMessage, info: ModelInfo) -> list[dict[str, Any]] | None:
    """The provider's compaction a summary keeps (``compact_natively``), to send in its place:
    only to the model that made it (no other can read its encrypted item), else None."""
    if not isinstance(msg.details, dict):
        return None
    kept = msg.details.get(PROVIDER_COMPACTION)
    if not isinstance(kept, dict) or kept.get("provider") != info.provider or kept.get("model") != info.id:
        return None
    items = kept.get("items")
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        return None
    return items


def _media_part(block: MediaBlock, documents: bool) -> dict[str, Any]:
    """An image, a PDF (an ``input_file``, where the server takes ``documents``), or a text
    document as text."""
    if isinstance(block, ImageContent):
        return {"type": "input_image", "image_url": f"data:{block.mime_type};base64,{block.data}", "detail": "auto"}
    text = file_text(block)
    if text is not None:
        return {"type": "input_text", "text": text}
    if not documents:  # a compatible server may refuse files, and it would stay in history
        return {
            "type": "input_text",
            "text": f"[PDF {block.name or 'document'} omitted: this server does not take PDFs]",
        }
    return {
        "type": "input_file",
        "filename": block.name or "document.pdf",
        "file_data": f"data:{block.mime_type};base64,{block.data}",
    }


def _parts(blocks: list[UserBlock], documents: bool) -> list[dict[str, Any]]:
    """Text (empty text left out), images and documents as input content parts."""
    return [
        {"type": "input_text", "text": b.text} if isinstance(b, TextContent) else _media_part(b, documents)
        for b in blocks
        if not isinstance(b, TextContent) or b.text
    ]


def _joined(blocks: list[UserBlock]) -> str:
    """Text blocks as one string, a line apart (as the Chat Completions adapter joins them)."""
    return "\n".join(b.text for b in blocks if isinstance(b, TextContent) and b.text)


def _user_content(blocks: list[UserBlock], documents: bool) -> str | list[dict[str, Any]]:
    if all(isinstance(b, TextContent) for b in blocks):
        return _joined(blocks)
    return _parts(blocks, documents)


#: the fields an input item of each type the compact endpoint returns may carry (what it sends back
#: as output has more, ``created_by``, ``status``, which an input item may not)
_INPUT_FIELDS = {"compaction": ("type", "id", "encrypted_content"), "message": ("type", "role", "content")}


def _as_input_item(item: dict[str, Any]) -> dict[str, Any]:
    """A compact endpoint's output item as it is to be sent back as input: only the fields an
    input item of its type has (an unknown type is kept as it came)."""
    fields = _INPUT_FIELDS.get(str(item.get("type")))
    return item if fields is None else {k: item[k] for k in fields if k in item}


def _assistant_items(msg: AssistantMessage, info: ModelInfo) -> list[dict[str, Any]]:
    """An assistant turn's items in their order: reasoning (to the model that wrote it), text
    as ``message`` items, calls as ``function_call`` items."""
    same_model = msg.provider == info.provider and msg.model == info.id
    items: list[dict[str, Any]] = []
    for b in msg.content:
        if isinstance(b, ThinkingContent):
            item = _reasoning_item(b) if same_model and b.signature else None
            if item is not None:
                items.append(item)
        elif isinstance(b, TextContent):
            if b.text:
                text = {"type": "output_text", "text": b.text, "annotations": []}
                items.append({"type": "message", "role": "assistant", "content": [text]})
        elif isinstance(b, ToolCall):
            items.append({"type": "function_call", "call_id": b.id, "name": b.name, "arguments": _arguments(b)})
    while items and items[-1]["type"] == "reasoning":
        # a turn cut after its reasoning (the output limit, an abort): the API refuses a reasoning
        # item with no output item after it, and would refuse every later call of the conversation
        items.pop()
    return items


def _tool_output(msg: ToolResultMessage, documents: bool) -> dict[str, Any]:
    """A ``function_call_output``: its text, or a list of parts when the tool returned images or
    documents (the Responses API takes them in the output itself)."""
    return {
        "type": "function_call_output",
        "call_id": msg.tool_call_id,
        "output": _user_content(msg.content, documents),
    }


def to_responses_input(request: ModelRequest, info: ModelInfo, documents: bool = True) -> list[dict[str, Any]]:
    """Our history as Responses ``input`` items, after replay hygiene. The system prompt is not
    among them: it travels as ``instructions``; a runtime notice in mid-history is a
    ``developer`` message in its place."""
    items: list[dict[str, Any]] = []
    for msg in clean_history(request.messages, lambda i: safe_tool_id(i, TOOL_ID_MAX)):
        if isinstance(msg, UserMessage):
            items.append({"role": "user", "content": _user_content(msg.content, documents)})
        elif isinstance(msg, SystemMessage):
            items.extend(_compacted(msg, info) or [{"role": "developer", "content": msg.text}])
        elif isinstance(msg, ToolResultMessage):
            items.append(_tool_output(msg, documents))
        elif isinstance(msg, AssistantMessage):
            items.extend(_assistant_items(msg, info))
    return items
