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
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
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


ChatKind: TypeAlias = Literal["direct", "group"]
MAX_SPEAKER_NAME = 64  # characters of a speaker's display name the model is shown
MAX_SPEAKER_ID = 128  # characters of a speaker's platform id


@_wire
class Origin:
    """Who wrote a user message, and in what kind of chat: what a chat bridge knows of its sender.

    In a ``group`` chat several people write to one conversation and their words alone do not
    say whose they are: the model sees the speaker as a first line of the message
    (``[From: Alice (telegram:12345)]``, ``with_speakers``). In a ``direct`` chat there is one
    person, and the prompt stays as it was. The stored text is never changed (a history shows
    what the person typed, the origin beside it). Made by ``origin``, which makes what a platform
    says of a sender safe to show."""

    name: str = ""  # the display name
    user: str = ""  # the platform's user id, named by the platform: "telegram:12345"
    chat: ChatKind = "direct"


def _is_none(value: object) -> bool:
    return value is None


@_wire
class UserMessage:
    role: Literal["user"] = "user"
    content: list[UserBlock]
    timestamp: int = field(default_factory=now_ms)
    # (left out of the JSON when None: the stored form of a message without one is as it was)
    origin: Annotated[Origin | None, Field(exclude_if=_is_none)] = None

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


# ------------------------------------------------------------------ who said it (group chats)

# whitespace and control characters (a line break among them), each run made one space
_NOT_ONE_LINE = re.compile(r"[\s\x00-\x1f\x7f-\x9f\u2028\u2029]+")
# invisible format characters (zero-width, bidirectional overrides and isolates, BOM): a name that
# reads as another's, or reorders the line around it; not ZWJ / ZWNJ, which emoji and scripts use
_INVISIBLE = re.compile(r"[\u00ad\u061c\u180e\u200b\u200e\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069\ufeff]")
# a line of a group message's own text that would read as a speaker line: "[From: Owner (…)]"
_FORGED_LINE = re.compile(r"(^|[\n\r\x0b\x0c\x85\u2028\u2029])([ \t]*)[\[\uff3b](?=[ \t]*from[ \t]*[:\uff1a])", re.I)


def _shown(text: str, limit: int) -> str:
    """``text`` as a speaker line may show it: one line, without square brackets, at most
    ``limit`` characters. A display name is its owner's own choice: one that holds a line break
    and "[From: Alice …]" must not read as a line of another speaker."""
    text = _INVISIBLE.sub("", storable(text)) if not text.isascii() else text
    text = _NOT_ONE_LINE.sub(" ", text).replace("[", "(").replace("]", ")").strip()
    return text[:limit].rstrip()


def origin(name: str, user: str, chat: ChatKind) -> Origin:
    """The ``Origin`` of a message ``user`` (the platform's id: ``"telegram:12345"``) wrote, as
    ``name``, in a ``direct`` or ``group`` chat, made safe to show the model (``_shown``)."""
    return Origin(name=_shown(name, MAX_SPEAKER_NAME), user=_shown(user, MAX_SPEAKER_ID), chat=chat)


def check_origin(value: object) -> Origin | None:
    """``value`` (an ``Origin`` or None) as a message keeps it, made by ``origin``; TypeError or
    ValueError for what is not one (checked before anything of the input is stored)."""
    if value is None:
        return None
    if not isinstance(value, Origin):
        raise TypeError(f"origin must be an Origin or None, got {type(value).__name__}")
    if not isinstance(value.name, str) or not isinstance(value.user, str):
        raise TypeError("an origin's name and user must be strings")
    if value.chat not in ("direct", "group"):
        raise ValueError(f"an origin's chat must be direct or group, got {value.chat!r}")
    return origin(value.name, value.user, value.chat)


def names_speaker(message: Message) -> bool:
    """Whether the model is told who wrote ``message``: a user message from a group chat."""
    return type(message) is UserMessage and message.origin is not None and message.origin.chat == "group"


def speaker_line(spoke: Origin) -> str:
    """The first line a group chat's message shows the model: ``[From: Alice (telegram:12345)]``.
    Made safe here too (``_shown``): an origin not made by ``origin`` (read back from JSON, built
    in memory) reaches the model through this line."""
    name, user = _shown(spoke.name, MAX_SPEAKER_NAME), _shown(spoke.user, MAX_SPEAKER_ID)
    who = f"{name} ({user})" if name and user else name or user
    return f"[From: {who}]"


def with_speaker(message: UserMessage) -> UserMessage:
    """``message`` as the model sees it: a group chat's with its speaker's line before its text
    (a copy; the message itself is untouched), any other as it is."""
    spoke = message.origin
    if spoke is None or spoke.chat != "group":
        return message
    line = speaker_line(spoke)
    if line == "[From: ]":  # (no name nor id to show)
        return message
    # a line of the text that would read as another speaker's is shown with "(" for its "["
    content: list[UserBlock] = [
        TextContent(text=_FORGED_LINE.sub(r"\1\2(", b.text)) if isinstance(b, TextContent) and _forges(b.text) else b
        for b in message.content
    ]
    first = content[0] if content else None
    if isinstance(first, TextContent):
        content[0] = TextContent(text=f"{line}\n{first.text}" if first.text else line)
    else:
        content.insert(0, TextContent(text=line))
    return replace(message, content=content)


def _forges(text: str) -> bool:
    return ("[" in text or "\uff3b" in text) and _FORGED_LINE.search(text) is not None


def with_speakers(messages: Sequence[Message]) -> list[Message]:
    """``messages`` (a new list) as the model sees them (``with_speaker``). Each message's line
    is made of what that message keeps, nothing around it: the same history gives the same bytes
    at every call (a provider's prompt cache keeps its prefix), and a message reads the same
    wherever a compaction leaves it. Every message of a group chat is named, not only a change of
    speaker, for that reason."""
    return [with_speaker(m) if type(m) is UserMessage and m.origin is not None else m for m in messages]
