"""The one message format everything round-trips through.

Providers translate to and from it, the loop reasons over it, stores persist it as JSON. Field
names follow pi's vocabulary on the wire (camelCase: ``toolCallId``, ``stopReason``,
``cacheRead``); Python code uses snake_case attributes.

Messages are slotted dataclasses validated and serialised by pydantic (``TypeAdapter``): the loop
creates a dozen of them per turn, and a dataclass costs a fraction of a ``BaseModel`` to build,
while anything that comes from outside still goes through full validation
(``message_from_dict`` / ``message_from_json``). ``message_to_json`` followed by
``message_from_json`` gives back an equal object.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeAlias, TypeVar, dataclass_transform

from pydantic import ConfigDict, Field, SerializerFunctionWrapHandler, TypeAdapter, model_serializer
from pydantic.alias_generators import to_camel

StopReason: TypeAlias = Literal["stop", "length", "toolUse", "error", "aborted"]


def now_ms() -> int:
    """Wall-clock milliseconds, the timestamp unit of every message."""
    return time.time_ns() // 1_000_000


_WIRE = ConfigDict(
    alias_generator=to_camel,
    populate_by_name=True,
    serialize_by_alias=True,
    extra="forbid",
)


_T = TypeVar("_T")


@dataclass_transform(kw_only_default=True, field_specifiers=(field,))
def _wire(cls: type[_T]) -> type[_T]:
    """camelCase on the wire, snake_case in Python, unknown fields rejected."""
    cls.__pydantic_config__ = _WIRE  # type: ignore[attr-defined]
    return dataclass(slots=True, kw_only=True)(cls)


# ------------------------------------------------------------------ content blocks


@_wire
class TextContent:
    type: Literal["text"] = "text"
    text: str


@_wire
class ThinkingContent:
    """Model reasoning. ``signature`` lets providers verify it when it is replayed."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str | None = None
    redacted: bool = False


@_wire
class ImageContent:
    """An image as base64 data (``data``) with its MIME type."""

    type: Literal["image"] = "image"
    data: str
    mime_type: str


# the document types a ``FileContent`` may carry; the text ones reach a model without document
# input as text
FILE_TYPES = ("application/pdf", "text/plain", "text/markdown", "text/csv")
_FILE_ALIASES = {"text/x-markdown": "text/markdown"}
PDF_MAGIC = b"%PDF-"  # how a PDF file begins


@_wire
class FileContent:
    """A document as base64 data (``data``) with its MIME type (one of ``FILE_TYPES``: a PDF, or
    plain, Markdown or CSV text) and its file name."""

    type: Literal["file"] = "file"
    data: str
    mime_type: str
    name: str = ""

    def __post_init__(self) -> None:
        # checked here, not only where media is stored: a block built in memory reaches the
        # provider adapters directly, and they would pass an unknown type on as a PDF
        mime = self.mime_type.strip().lower()
        mime = _FILE_ALIASES.get(mime, mime)
        if mime not in FILE_TYPES:
            raise ValueError(f"unsupported document type {self.mime_type!r}; supported: {', '.join(FILE_TYPES)}")
        self.mime_type = mime


_SURROGATE = re.compile("[\ud800-\udfff]")


def storable(text: str) -> str:
    """``text`` with lone surrogates (valid JSON, ``"\\ud800"``, but no UTF-8 form) replaced by
    U+FFFD: text from elsewhere (a provider's stream, a device's result) must not fail the commit
    that stores it."""
    return text if text.isascii() or not _SURROGATE.search(text) else _SURROGATE.sub("\ufffd", text)


def storable_value(value: Any) -> Any:
    """``value`` (JSON-like data: a tool result's details, a call's arguments) with its strings,
    keys included, made ``storable``."""
    if isinstance(value, str):
        return storable(value)
    if isinstance(value, list):
        return [storable_value(v) for v in value]
    if isinstance(value, tuple):
        return tuple(storable_value(v) for v in value)
    if isinstance(value, dict):
        return {storable_value(k): storable_value(v) for k, v in value.items()}
    return value


def check_unicode(text: str, what: str) -> str:
    """``text``, or ValueError if it cannot be stored: a lone surrogate, as Python makes of bytes
    that were not UTF-8 (``surrogateescape``), has no UTF-8 form and would fail the commit."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid text (character {exc.start} is a lone surrogate: not UTF-8?)") from None
    return text


def check_plain_text(text: str, what: str) -> str:
    """``text``, or ValueError if a database text column cannot keep it: a lone surrogate (see
    ``check_unicode``) or a NUL character, which PostgreSQL's text type refuses (message text is
    stored as JSON, where a NUL is escaped: only what goes into a column of its own needs this)."""
    check_unicode(text, what)
    if "\x00" in text:
        raise ValueError(f"{what} is not valid text (character {text.index(chr(0))} is NUL)")
    return text


def document_text(block: FileContent) -> str | None:
    """The text of a text document; None for a PDF, or data that is not base64 UTF-8."""
    if not block.mime_type.startswith("text/"):
        return None
    try:
        return base64.b64decode(block.data, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None


@_wire
class ToolCall:
    """A request by the model to run a tool; ``arguments`` are already parsed JSON.

    ``invalid_arguments``: what the model sent instead when it was not a JSON object (broken
    JSON, an answer cut off by the output limit, a list); ``arguments`` is then empty. The call
    is answered with an error result the model can correct, as any bad call is, rather than
    failing the whole reply. Left out of the wire form when there is none."""

    type: Literal["toolCall"] = "toolCall"
    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    invalid_arguments: str | None = None

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if self.invalid_arguments is None and isinstance(data, dict):
            data.pop("invalidArguments", None)
        return data


UserBlock: TypeAlias = Annotated[TextContent | ImageContent | FileContent, Field(discriminator="type")]
MediaBlock: TypeAlias = ImageContent | FileContent  # what a user (or a tool) attaches besides text
AssistantBlock: TypeAlias = Annotated[TextContent | ThinkingContent | ToolCall, Field(discriminator="type")]


# ------------------------------------------------------------------ usage


@_wire
class Cost:
    """Dollars spent, per component; ``total`` is their sum."""

    input: float = 0.0
    output: float = 0.0
    cache_read: float = 0.0
    cache_write: float = 0.0
    total: float = 0.0


@_wire
class Usage:
    """Tokens of one model call (or a sum of calls). ``total_tokens`` is the sum of the four."""

    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0
    total_tokens: int = 0
    cost: Cost = field(default_factory=Cost)

    def add(self, other: Usage) -> None:
        """Accumulate ``other`` into this usage, in place."""
        self.input += other.input
        self.output += other.output
        self.cache_read += other.cache_read
        self.cache_write += other.cache_write
        self.total_tokens += other.total_tokens
        c, o = self.cost, other.cost
        c.input += o.input
        c.output += o.output
        c.cache_read += o.cache_read
        c.cache_write += o.cache_write
        c.total += o.total

    def __add__(self, other: Usage) -> Usage:
        c, o = self.cost, other.cost
        return Usage(
            input=self.input + other.input,
            output=self.output + other.output,
            cache_read=self.cache_read + other.cache_read,
            cache_write=self.cache_write + other.cache_write,
            total_tokens=self.total_tokens + other.total_tokens,
            cost=Cost(
                input=c.input + o.input,
                output=c.output + o.output,
                cache_read=c.cache_read + o.cache_read,
                cache_write=c.cache_write + o.cache_write,
                total=c.total + o.total,
            ),
        )


# ------------------------------------------------------------------ messages


@_wire
class UserMessage:
    role: Literal["user"] = "user"
    content: list[UserBlock]
    timestamp: int = field(default_factory=now_ms)

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.content if isinstance(b, TextContent))


@_wire
class SystemMessage:
    """A message from the runtime rather than a person: guard notices, events, provider errors.

    Providers render it as a system (or developer) message; ``kind`` says why it exists.
    ``details`` is data for the runtime's code, never sent to a model: a summary carries there
    what pieces read back from the history it replaced (``ToolReveal``'s revealed tools).
    """

    role: Literal["system"] = "system"
    content: list[TextContent]
    kind: str = "notice"
    details: Any = None
    timestamp: int = field(default_factory=now_ms)

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.content)

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> Any:
        # most system messages carry nothing: their stored form stays as it was
        data = handler(self)
        if self.details is None and isinstance(data, dict):
            data.pop("details", None)
        return data


@_wire
class AssistantMessage:
    role: Literal["assistant"] = "assistant"
    content: list[AssistantBlock] = field(default_factory=list)
    provider: str = ""
    model: str = ""
    usage: Usage = field(default_factory=Usage)
    stop_reason: StopReason = "stop"
    error_message: str | None = None
    timestamp: int = field(default_factory=now_ms)

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.content if isinstance(b, TextContent))

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [b for b in self.content if isinstance(b, ToolCall)]


@_wire
class ToolResultMessage:
    role: Literal["toolResult"] = "toolResult"
    tool_call_id: str
    tool_name: str
    content: list[UserBlock]
    details: Any = None
    is_error: bool = False
    terminate: bool = False  # the tool asked to end the run after this turn (``ToolResult.terminate``)
    timestamp: int = field(default_factory=now_ms)

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.content if isinstance(b, TextContent))


Message: TypeAlias = Annotated[
    UserMessage | AssistantMessage | ToolResultMessage | SystemMessage,
    Field(discriminator="role"),
]

_MESSAGE: TypeAdapter[Message] = TypeAdapter(Message)
_MESSAGES: TypeAdapter[list[Message]] = TypeAdapter(list[Message])
_SERIALIZERS = {
    cls: TypeAdapter(cls).serializer for cls in (UserMessage, AssistantMessage, ToolResultMessage, SystemMessage)
}


def message_from_dict(data: Any) -> Message:
    """Parse and validate one message from plain data (as ``message_to_dict`` produces)."""
    return _MESSAGE.validate_python(data)


def message_from_json(data: str | bytes) -> Message:
    return _MESSAGE.validate_json(data)


def messages_from_dicts(data: Any) -> list[Message]:
    return _MESSAGES.validate_python(data)


def message_to_dict(message: Message) -> dict[str, Any]:
    data: dict[str, Any] = _MESSAGE.dump_python(message, mode="json")
    return data


def message_to_json(message: Message) -> str:
    """By the message class's own serializer: the union's picks the same one by the role, after a
    lookup that costs more than the message (the store writes several per step)."""
    serializer = _SERIALIZERS.get(type(message))
    data = serializer.to_json(message) if serializer is not None else _MESSAGE.dump_json(message)
    return data.decode()


def messages_to_dicts(messages: list[Message]) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = _MESSAGES.dump_python(messages, mode="json")
    return data


# ------------------------------------------------------------------ constructors


def user(text: str, *media: ImageContent | FileContent) -> UserMessage:
    """A user message with text and optional images and documents."""
    blocks: list[TextContent | ImageContent | FileContent] = [TextContent(text=text)]
    blocks.extend(media)
    return UserMessage(content=blocks)


def system(text: str, kind: str = "notice") -> SystemMessage:
    return SystemMessage(content=[TextContent(text=text)], kind=kind)


def tool_error_result(call: ToolCall, text: str) -> ToolResultMessage:
    """An error result for ``call``: the shape every failure takes on its way to the model."""
    return ToolResultMessage(
        tool_call_id=call.id,
        tool_name=call.name,
        content=[TextContent(text=text)],
        is_error=True,
    )
