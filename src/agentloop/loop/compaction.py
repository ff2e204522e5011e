"""Context compaction for any runner: measure how full the context is, fold old history into a
summary; and ``Compaction``, the piece that does so for in-memory runs.

The measuring, the cut and the summary are pure computation plus one model call, shared by both
runners: a durable process (``process/compaction.py`` adds the archive-backed clearing tier, and
``process/driver.py`` installs the result in its store) and the in-memory runner, through the
``compact_context`` hook phase this module's ``Compaction`` piece fills. So are the decisions
around them (``compaction_due``: whether to compact before a call; ``keep_recent``: how much
history stays; ``ask_pre_compaction``: the hooks' say), so that the two runners cannot drift
apart again: a fix to one is a fix to both. ``compact``
never touches the history it is given: it returns the removed prefix, the kept tail and the
summary, and the caller decides whether and how to install them.

Token counts are estimates (about four characters per token, images at a flat cost) because a
tokenizer per provider would be a download and a dependency for a number that only has to be
good enough to trigger compaction a little early rather than too late.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from agentloop.events import CompactionEnd, CompactionStart, CompactionTrigger
from agentloop.loop.hooks import Block, Hooks, TurnInfo
from agentloop.loop.state import LoopConfig
from agentloop.messages import (
    AssistantMessage,
    FileContent,
    ImageContent,
    Message,
    SystemMessage,
    TextContent,
    ThinkingContent,
    ToolCall,
    ToolResultMessage,
    Usage,
    UserMessage,
    now_ms,
    storable_value,
    user,
    with_speaker,
)
from agentloop.models.base import (
    PROVIDER_COMPACTION,
    Model,
    ModelInfo,
    ModelRequest,
    NativeCompaction,
    ToolSpec,
    mask,
)
from agentloop.models.registry import resolve_model
from agentloop.urls import redact_secrets

log = logging.getLogger("agentloop.compaction")

CompactionReason: TypeAlias = Literal["threshold", "overflow", "manual"]

CHARS_PER_TOKEN = 4
# Providers bill an image by its pixels (roughly 1–2k tokens for a screenshot); the base64 length
# would overstate it tenfold, so every image counts the same.
IMAGE_TOKENS = 1_200
PDF_BYTES_PER_TOKEN = 100  # rough: pages bill 1-3k tokens, and a page takes anything from 5 KB to 1 MB
# Role markers and separators a provider adds around each message.
MESSAGE_OVERHEAD = 4

SUMMARY_KIND = "summary"
TOOL_RESULT_CLIP = 2_000
TOOL_ARGS_CLIP = 500
THINKING_CLIP = 1_000
SUMMARY_MAX_TOKENS = 2_048


class CompactionError(Exception):
    """The summary could not be produced; the history must stay as it was."""


# ------------------------------------------------------------------ estimates


def _text_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"), default=str)


#: The bytes a document holds whose ``data`` is not the bytes but a reference to where another
#: layer keeps them (a durable process stores its files outside its history: ``process/media.py``),
#: or None for a block that is not such a reference. The loop knows no store, so the layer that
#: makes such references says how to read their size (``count_stored_files``); unset, every
#: document is taken for base64.
StoredSize: TypeAlias = Callable[[FileContent], "int | None"]
_stored_size: StoredSize | None = None


def count_stored_files(size_of: StoredSize) -> None:
    """Have the estimates read a stored document's size with ``size_of`` (see ``StoredSize``)."""
    global _stored_size
    _stored_size = size_of


def _file_tokens(block: FileContent) -> int:
    """A document's cost from its size: text at the usual rate, a PDF at a rough one (providers
    bill its pages, text and pictures, which the size only hints at)."""
    size = _stored_size(block) if _stored_size is not None else None
    if size is None:  # base64: 3 bytes per 4 characters, less the padding
        data = block.data
        size = len(data) * 3 // 4 - data[-2:].count("=")
    if block.mime_type == "application/pdf":
        return max(IMAGE_TOKENS, size // PDF_BYTES_PER_TOKEN)
    return math.ceil(size / CHARS_PER_TOKEN)


def _block_tokens(block: Any) -> int:
    if isinstance(block, TextContent):
        return _text_tokens(block.text)
    if isinstance(block, ImageContent):
        return IMAGE_TOKENS
    if isinstance(block, FileContent):
        return _file_tokens(block)
    if isinstance(block, ThinkingContent):
        return _text_tokens(block.thinking) + _text_tokens(block.signature or "")
    if isinstance(block, ToolCall):
        return _text_tokens(block.id) + _text_tokens(block.name) + _text_tokens(_json(block.arguments))
    return _text_tokens(_json(block))


def _message_tokens(message: Message) -> int:
    # Only what a provider sends counts: timestamps, usage and cost never reach the model.
    n = MESSAGE_OVERHEAD + sum(_block_tokens(b) for b in message.content)
    if isinstance(message, ToolResultMessage):
        n += _text_tokens(message.tool_call_id) + _text_tokens(message.tool_name)
    return n


def estimate_tokens(obj: Any) -> int:
    """Estimated tokens of text, a message, a tool spec, or any list of those.

    Deterministic and additive over lists, so appending to a history never lowers the estimate.
    """
    if obj is None:
        return 0
    if isinstance(obj, str):
        return _text_tokens(obj)
    if isinstance(obj, UserMessage | AssistantMessage | ToolResultMessage | SystemMessage):
        return _message_tokens(obj)
    if isinstance(obj, ToolSpec):
        return MESSAGE_OVERHEAD + _text_tokens(obj.name + obj.description + _json(obj.parameters))
    if isinstance(obj, TextContent | ImageContent | FileContent | ThinkingContent | ToolCall):
        return _block_tokens(obj)
    if isinstance(obj, list | tuple):
        return sum(estimate_tokens(item) for item in obj)
    return _text_tokens(_json(obj))


def reported_tokens(message: AssistantMessage) -> int:
    """The context the provider counted for a reply (its prompt, tools, history and output); 0
    where it reported none (an error, an abort, usage all zero)."""
    u = message.usage
    if u.input + u.cache_read <= 0 or message.stop_reason in ("error", "aborted"):
        return 0
    return u.input + u.cache_read + u.cache_write + u.output


def context_tokens(system_prompt: str, tools: Sequence[ToolSpec], messages: Sequence[Message]) -> int:
    """Tokens the next model call would send: real usage where the provider reported it.

    The newest assistant message with real usage already counts the prompt, the tools and the
    history before it (plus its own output); only later messages are estimated. Usage reported
    before the latest summary was made is stale, even on a message the compaction kept (it
    measured the history that was compacted away), and all-zero usage means the provider did not
    report any, so both fall back to the estimate. Only replies are dated against the summary:
    input sent while it was being written is older than it yet joins the history after it.
    """
    summarised_at = summary_time(messages)
    for i in range(len(messages) - 1, -1, -1):  # newest first: only the tail is looked at
        m = messages[i]
        if isinstance(m, AssistantMessage):
            if m.timestamp <= summarised_at:
                break
            covered = reported_tokens(m)
            if covered:
                return covered + estimate_tokens(list(messages[i + 1 :]))
    return estimated_context(system_prompt, tools, messages)


def estimated_context(system_prompt: str, tools: Sequence[ToolSpec], messages: Sequence[Message]) -> int:
    """``context_tokens`` from the estimate alone."""
    return estimate_tokens(system_prompt) + estimate_tokens(list(tools)) + estimate_tokens(list(messages))


def summary_time(messages: Sequence[Message]) -> int:
    """When the summary heading the history was made (a compaction replaces a prefix, so it is
    first, or second after a message kept before it); -1 without one."""
    for m in messages[:2]:
        if isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND:
            return m.timestamp
    return -1


def usable_window(info: ModelInfo) -> int:
    """The tokens a request may fill: what ``pressure`` divides by (the output budget is not usable)."""
    return max(1, info.context_window - info.max_output)


def pressure(
    system_prompt: str,
    tools: list[ToolSpec],
    messages: list[Message],
    info: ModelInfo,
    reserved_output: int | None = None,
) -> float:
    """Share of the usable window the next call fills (1.0 = full); the output budget is not usable."""
    reserved = info.max_output if reserved_output is None else reserved_output
    available = max(1, info.context_window - reserved)
    return context_tokens(system_prompt, tools, messages) / available


def should_compact(pressure: float, threshold: float = 0.9) -> bool:
    if not threshold > 0:
        raise ValueError(f"compaction threshold must be positive, got {threshold}")
    return pressure >= threshold


# ------------------------------------------------------------------ the cut


def plan_cut(messages: Sequence[Message], keep_recent_tokens: int) -> int | None:
    """Index where the kept tail starts, or None when compacting would gain nothing.

    The tail holds at least ``keep_recent_tokens`` (the newest message always stays). The cut
    moves towards older messages rather than lose a tool call's results or start on a result
    whose call was summarised away (providers reject both). Only when that would leave nothing
    to summarise (an exchange or a message bigger than the tail, left behind by newer ones) does
    it move forward instead, past the oversized part, to the first place that splits nothing.
    """
    if keep_recent_tokens < 0:
        raise ValueError("keep_recent_tokens must not be negative")
    n = len(messages)
    if n < 3:
        return None
    total = 0
    cut: int | None = None
    for i in range(n - 1, -1, -1):
        total += estimate_tokens(messages[i])
        if total >= keep_recent_tokens:
            cut = i
            break
    if cut is None:
        return None
    owner = _owners(messages)
    while cut > 0:
        moved = cut
        if isinstance(messages[cut], ToolResultMessage):
            moved = cut - 1
        for j in range(cut, n):
            m = messages[j]
            if isinstance(m, ToolResultMessage):
                k = owner.get(m.tool_call_id)
                if k is not None and k < moved:
                    moved = k
        if moved == cut:
            break
        cut = moved
    if cut >= 2:
        return cut
    return next((c for c in range(max(2, cut + 1), n) if _splits_nothing(messages, c, owner)), None)


def _splits_nothing(messages: Sequence[Message], cut: int, owner: dict[str, int]) -> bool:
    """Whether a tail starting at ``cut`` keeps every tool result with its call."""
    results = (m for m in messages[cut:] if isinstance(m, ToolResultMessage))
    return all(owner.get(m.tool_call_id, cut) >= cut for m in results)


def _owners(messages: Sequence[Message]) -> dict[str, int]:
    """The index of the assistant message that made each tool call, by the call's id."""
    owner: dict[str, int] = {}
    for i, m in enumerate(messages):
        if isinstance(m, AssistantMessage):
            for tc in m.tool_calls:
                owner[tc.id] = i
    return owner


def explicit_cut(messages: Sequence[Message], *, keep_last: int | None = None, through: int | None = None) -> int:
    """Index where the kept tail starts for a cut the caller chose (a compaction asked for by
    hand), instead of ``plan_cut``'s: keep the newest ``keep_last`` messages, or summarise every
    message up to and including index ``through``; exactly one of the two. Either way a tool
    call never parts from its results, nor does the tail start on a result: ``keep_last`` moves
    the cut towards older messages (keeping more than asked), ``through`` towards newer ones
    (past the results of a call it names, so that it is summarised whole). 0 keeps everything
    (nothing to summarise); ``len(messages)`` summarises it all."""
    if (keep_last is None) == (through is None):
        raise ValueError("give keep_last or through, not both")
    n = len(messages)
    owner = _owners(messages)

    def clean(cut: int) -> bool:
        if cut >= n:
            return True
        return not isinstance(messages[cut], ToolResultMessage) and _splits_nothing(messages, cut, owner)

    if keep_last is not None:
        if keep_last < 0:
            raise ValueError(f"keep_last must not be negative, got {keep_last}")
        cut = max(0, n - keep_last)
        while cut > 0 and not clean(cut):
            cut -= 1
        return cut
    assert through is not None
    if not 0 <= through < n:
        raise ValueError(f"through must be the index of a message of the history (0 to {n - 1}), got {through}")
    cut = through + 1
    while cut < n and not clean(cut):
        cut += 1
    return cut


# ------------------------------------------------------------------ the summary


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit} more characters clipped]"


def _render_blocks(blocks: Iterable[Any], clip: int | None) -> str:
    parts: list[str] = []
    for b in blocks:
        if isinstance(b, TextContent):
            parts.append(b.text if clip is None else _clip(b.text, clip))
        elif isinstance(b, ImageContent):
            parts.append(f"[image {b.mime_type}]")
        elif isinstance(b, FileContent):
            parts.append(f"[file {b.name or 'unnamed'} ({b.mime_type})]")
        elif isinstance(b, ThinkingContent):
            if b.thinking and not b.redacted:
                parts.append(f"(thinking: {_clip(b.thinking, THINKING_CLIP)})")
        elif isinstance(b, ToolCall):
            parts.append(f"[tool call {b.name} id={b.id} args={_clip(_json(b.arguments), TOOL_ARGS_CLIP)}]")
    return "\n".join(parts)


def render_transcript(messages: Sequence[Message]) -> str:
    """The removed messages as plain text: readable to any model, tool output clipped."""
    out: list[str] = []
    for m in messages:
        if isinstance(m, UserMessage):  # (a group chat's with its speaker: the summary keeps who said what)
            out.append(f"## user\n{_render_blocks(with_speaker(m).content, None)}")
        elif isinstance(m, AssistantMessage):
            ended = m.stop_reason in ("error", "aborted", "length")
            note = f" (stopped: {m.stop_reason} {m.error_message or ''})" if ended else ""
            out.append(f"## assistant{note}\n{_render_blocks(m.content, None)}")
        elif isinstance(m, ToolResultMessage):
            flag = " ERROR" if m.is_error else ""
            body = _render_blocks(m.content, TOOL_RESULT_CLIP)
            out.append(f"## tool result{flag} {m.tool_name} id={m.tool_call_id}\n{body}")
        else:
            out.append(f"## system ({m.kind})\n{m.text}")
    return "\n\n".join(out)


def _fit(text: str, budget: int) -> str:
    """Head and tail of an oversized transcript: the goal is stated early, the state late."""
    if len(text) <= budget:
        return text
    head = int(budget * 0.35)
    tail = budget - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n\n[… {omitted} characters omitted …]\n\n{text[-tail:]}"


SUMMARY_SYSTEM_PROMPT = """\
You write the memory of an agent whose older conversation is being removed to free context.
The agent will continue with only your summary and the most recent messages, so keep every
fact it needs to carry on without asking again. Answer in concise markdown with these sections:

## Goal
## Decisions and constraints
## Files and resources touched
## Open tasks and next steps
## Key facts (ids, paths, commands, values, errors)

After the summary, write a <memories></memories> block with what is worth remembering after
this conversation is over: the user's preferences, decisions about the work, lasting facts about
people, projects and systems. One fact per line, each starting with "- "; write none inside the
block if there is nothing of the kind.

Do not invent anything. Do not call tools."""

_HEADING = re.compile(r"^#{1,6} ", re.MULTILINE)
_NOTHING = re.compile(r"^[-*\s]*(none|nothing|n/a)?[.\s]*$", re.IGNORECASE)


def split_memories(text: str) -> tuple[str, str | None]:
    """The summary and the memories block that ends a summary model's answer. Only a block at the
    end counts (a summary may well mention the tag itself); one cut off before its closing tag
    counts if it opens a line and no heading follows it. A model that leaves the block out, or
    says there is nothing to remember, gives no memories."""
    lowered = text.lower()
    start = lowered.rfind("<memories>")
    if start < 0:
        return text.strip(), None
    body_start = start + len("<memories>")
    end = lowered.find("</memories>", body_start)
    if end >= 0:
        if text[end + len("</memories>") :].strip():
            return text.strip(), None  # not the end of the answer: part of the summary
        memories = text[body_start:end].strip()
    else:
        at_line_start = start == 0 or text[:start].endswith("\n")
        if not at_line_start or _HEADING.search(text, body_start):
            return text.strip(), None
        memories = text[body_start:].strip()
    summary = text[:start].strip()
    return summary, None if _NOTHING.match(memories) else memories


def _summary_prompt(transcript: str, previous_summary: str | None, instructions: str | None) -> str:
    parts: list[str] = []
    if previous_summary:
        parts.append(
            "An earlier summary covers what came before this part; merge it into yours:\n"
            f"<previous-summary>\n{previous_summary}\n</previous-summary>"
        )
    parts.append(f"<conversation>\n{transcript}\n</conversation>")
    if instructions:
        parts.append(f"Additional instructions for this summary:\n{instructions}")
    parts.append("Summarise the conversation above.")
    return "\n\n".join(parts)


async def summarize(
    model: Model,
    messages: list[Message],
    *,
    previous_summary: str | None = None,
    instructions: str | None = None,
) -> tuple[str, str | None, Usage]:
    """A structured summary of ``messages`` written by ``model``, the memories block it ended
    with (see ``split_memories``) and what the call used, or ``CompactionError``.

    An empty summary would silently erase history, so anything short of non-empty text fails.
    """
    transcript = _fit(render_transcript(messages), _transcript_budget(model))
    reply = await _ask(model, SUMMARY_SYSTEM_PROMPT, _summary_prompt(transcript, previous_summary, instructions))
    summary, memories = split_memories(reply.text.strip())
    if not summary:
        raise CompactionError(f"summary model {model.name} returned an empty summary")
    return summary, memories, reply.usage


def _transcript_budget(model: Model) -> int:
    """Characters of transcript the model is shown: most of its window, never less than 8,000."""
    info = model.info
    return max(8_000, int((info.context_window - info.max_output) * CHARS_PER_TOKEN * 0.6))


async def _ask(model: Model, system_prompt: str, prompt: str, what: str = "summary") -> AssistantMessage:
    """One tool-less call with a bounded answer, or ``CompactionError``."""
    request = ModelRequest(
        system_prompt=system_prompt,
        messages=[user(prompt)],
        tools=[],
        max_tokens=min(model.info.max_output, SUMMARY_MAX_TOKENS),
    )
    try:
        reply = await model.complete(request)
    except Exception as exc:  # Model.complete should not raise; a broken adapter still must not
        raise CompactionError(f"{what} model {model.name} failed: {type(exc).__name__}: {exc}") from exc
    if reply.stop_reason in ("error", "aborted"):
        raise CompactionError(f"{what} model {model.name} failed ({reply.stop_reason}): {reply.error_message or ''}")
    return reply


MEMORY_SYSTEM_PROMPT = """\
You keep the long-term memory of an agent whose conversation is being cleared. From the
conversation, pick out what is worth remembering after it: the user's preferences, decisions
about the work, lasting facts about people, projects and systems. Answer with a
<memories></memories> block only: one fact per line, each starting with "- ", or none inside it
if there is nothing of the kind. Do not invent anything. Do not call tools."""


async def extract_memories(model: Model, messages: list[Message]) -> tuple[str | None, Usage]:
    """What ``model`` finds worth remembering in ``messages`` (before a reset clears them), or
    None: nothing, or an answer without the memories block; and what the call spent. Failures
    raise ``CompactionError``."""
    transcript = _fit(render_transcript(messages), _transcript_budget(model))
    prompt = f"<conversation>\n{transcript}\n</conversation>\n\nWrite the memories block."
    reply = await _ask(model, MEMORY_SYSTEM_PROMPT, prompt, "memory")
    return split_memories(reply.text.strip())[1], reply.usage


# ------------------------------------------------------------------ compaction


@dataclass
class CompactionResult:
    """A computed compaction, not yet installed: ``history`` replaces the original (a durable
    process archives ``removed`` first; an in-memory run has nowhere to keep them)."""

    removed: list[Message]
    kept: list[Message]
    summary: SystemMessage
    reason: CompactionReason
    tokens_before: int
    tokens_after: int
    created_ms: int = field(default_factory=now_ms)
    memories: str | None = None  # lasting facts the summary model picked out, for the daily memory file
    usage: Usage = field(default_factory=Usage)  # the summary call's: the run it is made for pays for it

    @property
    def history(self) -> list[Message]:
        """The history that replaces the original: the summary, then the kept tail."""
        return [self.summary, *self.kept]

    def still_applies(self, current: Sequence[Message]) -> bool:
        """Whether ``current`` still starts with the removed prefix unchanged.

        The summary is computed outside any lock; if the history changed meanwhile (a reset, an
        edit, a concurrent compaction), installing it would drop or duplicate messages.
        """
        n = len(self.removed)
        return len(current) >= n and list(current[:n]) == self.removed

    def meta(self) -> dict[str, Any]:
        """JSON-ready facts for the archive header and the compaction event."""
        return {
            "kind": "compaction",
            "reason": self.reason,
            "removed": len(self.removed),
            "kept": len(self.kept),
            "tokens_before": self.tokens_before,
            "tokens_after": self.tokens_after,
            "summary": self.summary.text,
            "memories": self.memories,
            "created_ms": self.created_ms,
        }


def summary_message(text: str, replaced: int, details: dict[str, Any] | None = None) -> SystemMessage:
    plural = "message" if replaced == 1 else "messages"
    body = f"Summary of the earlier conversation; it replaces {replaced} earlier {plural}.\n\n{text}"
    return SystemMessage(content=[TextContent(text=body)], kind=SUMMARY_KIND, details=details or None)


def carried(removed: Sequence[Message], carry: dict[str, Any] | None) -> dict[str, Any]:
    """The details a new summary keeps: what the summaries it replaces carried, under ``carry``
    (what the ``pre_compaction`` hooks gave). Rolled forward like the summary text, so data kept
    once is not lost to a second summary when its piece has nothing new to say."""
    details: dict[str, Any] = {}
    for m in removed:
        if isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND and isinstance(m.details, dict):
            details.update(m.details)
    for key, value in (carry or {}).items():
        try:  # stored with the summary: a hook's data that cannot be must not fail the compaction
            json.dumps({key: value})
        except (TypeError, ValueError):
            log.warning("compaction: %r from a pre_compaction hook is not JSON data; not kept", key)
            continue
        details[key] = storable_value(value)
    return details


async def compact(
    messages: list[Message],
    model: Model,
    *,
    keep_recent_tokens: int = 20_000,
    reason: CompactionReason,
    instructions: str | None = None,
    carry: dict[str, Any] | None = None,
    cut: int | None = None,
    summary: str | None = None,
    native: Model | None = None,
) -> CompactionResult | None:
    """Summarise the prefix before ``plan_cut``; None when there is nothing worth compacting.

    Earlier summaries in the prefix are handed to the model as the previous summary so that
    repeated compactions roll them forward instead of summarising a summary as chatter.
    ``carry``: JSON data for the summary's ``details`` (see ``carried``), which code reading the
    history finds there once the messages it came from are gone. ``cut``: where the kept tail
    starts, chosen by the caller (``explicit_cut``) instead of ``plan_cut``. ``summary``: the
    summary's text, given by the caller: ``model`` is not called (no usage, no memories), and
    the text replaces whatever earlier summaries the prefix holds along with the rest of it.
    ``native``: the model the history is sent to, asked meanwhile for its provider's own
    compaction of the prefix (``Model.compact_natively``), kept on the summary's ``details``
    under ``PROVIDER_COMPACTION`` for that model to read instead of the text. The text is still
    written: the provider's is opaque, and the text is what people, the next summary and any
    other model read. Without it (none, or it failed: a warning) the summary is as always.
    """
    if summary is not None and not summary.strip():
        raise ValueError("the summary is empty")
    if cut is None:
        cut = plan_cut(messages, keep_recent_tokens)
    elif not 0 <= cut <= len(messages):
        raise ValueError(f"cut must be from 0 to {len(messages)}, got {cut}")
    if not cut:
        return None
    removed, kept = list(messages[:cut]), list(messages[cut:])
    previous = [m.text for m in removed if isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND]
    rest = [m for m in removed if not (isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND)]
    provided: NativeCompaction | None = None  # (a caller's own text is not the provider's to replace)
    if summary is not None:
        text, memories, usage = summary.strip(), None, Usage()
    elif not rest:  # (only an earlier summary: nothing new to summarise)
        return None
    else:
        natively = None if native is None else asyncio.ensure_future(_compact_natively(native, removed))
        try:
            text, memories, usage = await summarize(
                model, rest, previous_summary="\n\n".join(previous) or None, instructions=instructions
            )
        except BaseException:
            if natively is not None:
                natively.cancel()
            raise
        if natively is not None:
            provided = await natively
    details = carried(removed, carry)
    # (an earlier summary's stands for less than this one replaces: it must not be rolled forward)
    details.pop(PROVIDER_COMPACTION, None)
    if provided is not None:
        details[PROVIDER_COMPACTION] = provided.as_details()
        usage = usage + provided.usage
    made = summary_message(text, len(removed), details)
    return CompactionResult(
        removed=removed,
        kept=kept,
        summary=made,
        reason=reason,
        tokens_before=estimate_tokens(messages),
        tokens_after=estimate_tokens([made, *kept]),
        memories=memories,
        usage=usage,
    )


async def _compact_natively(model: Model, removed: list[Message]) -> NativeCompaction | None:
    """``model``'s provider's own compaction of ``removed``, or None: it has none, or it failed
    (a warning; the summary alone stands for them then, as it does without it)."""
    try:
        return await model.compact_natively(ModelRequest(system_prompt="", messages=removed))
    except Exception as exc:  # (the SDK's errors too: classified, and the key never shown)
        err = model.classify(exc)
        log.warning(
            "compaction: %s's own compaction failed (%s), the summary alone replaces the history: %s",
            model.name,
            err.kind,
            mask(redact_secrets(str(err)), model.secrets()),
        )
        return None


# ------------------------------------------------------------------ when, how much, the hooks


#: tokens a default tail keeps at least, however small the window (a turn or two of dialogue)
MIN_KEEP = 256


def compaction_due(
    system_prompt: str,
    tools: Sequence[ToolSpec],
    messages: Sequence[Message],
    info: ModelInfo,
    threshold: float,
    keep_recent_tokens: int | None = None,
    *,
    tokens: int | None = None,
    who: str = "context",
) -> bool:
    """Whether to compact before the next call: past the threshold, where a summary can help.
    ``tokens``: the context as ``context_tokens`` measured it, where the caller already has it.

    What a compaction leaves is at least the system prompt and tools, which it cannot touch,
    plus the tail it keeps (``plan_cut`` keeps at least the tokens asked for), plus the summary.
    Where the first two alone reach the threshold, every call would be past it again right after
    its summary: each would pay for another one and the model would keep losing its recent work,
    for nothing. The threshold is then out of reach and the window itself is the limit: compact
    only where the next call would not fit the usable window (a provider that cuts the prompt
    without saying so would otherwise lose the oldest part unseen), and not at all where even
    that cannot help; the overflow retry, which compacts harder, is left for a call the provider
    refuses. (Estimates are compared, scaled as ``keep_recent`` scales them, and only past the
    threshold: below it nothing more is measured.) One rule for both runners, so a process and
    an in-memory run of the same conversation compact at the same calls.
    """
    real = context_tokens(system_prompt, tools, messages) if tokens is None else tokens
    usable = usable_window(info)
    if not should_compact(real / usable, threshold):
        return False
    fixed = estimated_context(system_prompt, tools, [])
    scale = min(1.0, (fixed + estimate_tokens(list(messages))) / max(1, real))
    least_left = fixed + (MIN_KEEP if keep_recent_tokens is None else keep_recent_tokens)
    room = usable * scale
    if least_left < room * threshold:
        return True
    if real >= usable and least_left < room:
        return True
    log.debug(
        "%s: past the compaction threshold, but the system prompt and tools (about %d tokens)"
        " with the least tail kept leave a summary no room to bring it under; not compacted",
        who,
        fixed,
    )
    return False


def keep_recent(
    system_prompt: str,
    tools: Sequence[ToolSpec],
    messages: Sequence[Message],
    info: ModelInfo,
    threshold: float,
    keep_recent_tokens: int | None,
    reason: CompactionReason,
) -> int:
    """Estimated tokens of newest history a summary keeps (``plan_cut``'s ``keep_recent_tokens``).

    ``keep_recent_tokens`` (a process's policy, the piece's option) if given, else a quarter of the
    room the history has: the usable window less the prompt and tools, since a quarter of the
    whole window can be near the threshold by itself and every turn would compact again; and at
    most half of what the threshold leaves the history, since a low threshold would otherwise be
    under the kept quarter and the prompt together, again compacting at every turn. The window is
    scaled down where the provider counts more than the estimate (CJK text, dense code), or the
    "quarter" could be the whole room. After an overflow (the provider measured the context too
    long) at most half the history stays; a ``manual`` compaction (asked for to free the context
    now, however full it is) keeps at most a quarter. Never under ``MIN_KEEP`` by default.
    """
    if keep_recent_tokens is not None:
        keep = keep_recent_tokens
    else:
        fixed = estimated_context(system_prompt, tools, [])
        estimated = fixed + estimate_tokens(list(messages))
        scale = min(1.0, estimated / max(1, context_tokens(system_prompt, tools, messages)))
        usable = usable_window(info) * scale
        keep = int(min((usable - fixed) / 4, (usable * threshold - fixed) / 2))
    if reason == "overflow":
        keep = min(keep, estimate_tokens(list(messages)) // 2)
    elif reason == "manual":
        keep = min(keep, estimate_tokens(list(messages)) // 4)
    return max(MIN_KEEP if keep_recent_tokens is None else 1, keep)


async def ask_pre_compaction(
    hooks: Hooks,
    run_id: str,
    turn: int,
    messages: list[Message],
    system_prompt: str,
    tools: list[ToolSpec],
    conversation: str | None,
    who: str,
) -> dict[str, Any] | Block:
    """Run the ``pre_compaction`` hooks on ``messages`` (the history about to be summarised): the
    data they want kept on the summary (``TurnInfo.carry``, for ``compact``'s ``carry``), or the
    ``Block`` one gave to skip this compaction (logged, ``who`` naming the run or process). Without
    such hooks nothing is built or run: the common case costs a dictionary look-up."""
    if "pre_compaction" not in hooks.phases:
        return {}
    info = TurnInfo(run_id, turn, messages, system_prompt, tools, conversation=conversation)
    blocked = await hooks.run_phase("pre_compaction", info)
    if isinstance(blocked, Block):
        log.info("%s: compaction skipped by a pre_compaction hook: %s", who, blocked.reason)
        return blocked
    return info.carry


# ------------------------------------------------------------------ the in-memory piece


class Compaction:
    """A piece (``agent.use(Compaction())``) that keeps a long in-memory run inside the model's window.

    Before each model call it measures the context (the provider's count of the last reply plus
    an estimate of what came after, or the estimate of system prompt, tools and history where
    there is none: ``context_tokens``) against the model's usable window (``model.info``'s context
    window less its output budget). Below ``threshold`` that is all it does. At or past it, the
    older history is replaced by a summary that ``summariser`` (else the agent's model) writes,
    keeping the newest ``keep_recent_tokens`` (default: a quarter of the room the history has, at
    most half of what the threshold leaves it) and never separating a tool call from its results.
    Where the system prompt and tools with that least tail reach the threshold by themselves, no
    summary could bring the context under it: the usable window is the limit instead (or, where
    even that is out of reach, only the provider's refusal). When the provider refuses a call as
    too long anyway (or cuts the prompt without saying so), it compacts harder (keeping at most
    half the history) and the call is made once more; a second
    overflow ends the run with that error, as does one where nothing could be compacted. A summary
    that fails leaves the history as it was (logged). ``pre_compaction`` hooks run first, as in a
    durable process: one returning ``Block`` skips the compaction, a ``dict`` is kept on the
    summary's ``details``. With ``native`` the agent's model is also asked for its provider's own
    compaction (OpenAI's Responses API has one), kept on the summary for that model to be sent
    instead of the text (see ``compact``); a provider without one, or its failure, changes
    nothing. The summary call's usage is the run's. A watched run shows each summary
    as a ``compaction_start`` event and its ``compaction_end`` (compacted or not, and why).

    After a compaction ``RunResult.messages`` holds the compacted history, the summary (a
    ``system`` message of kind ``summary``) followed by the messages kept: the conversation to
    continue with, given as ``history`` to the next run, whose compactions roll the summary
    forward. ``RunResult.new_messages`` are still this run's messages where the summary replaced
    only older ones; where it folded in some of this run's too, they are the whole compacted
    history, starting with the summary that now stands for them. The caller's own list is never
    changed (a run works on a copy).

    A durable process compacts by itself (and archives what it removes): given to a kernel this
    piece does nothing there. Not installed it costs nothing; installed, a model call below the
    threshold costs a look at the last few messages.
    """

    def __init__(
        self,
        threshold: float = 0.9,
        *,
        keep_recent_tokens: int | None = None,
        summariser: str | Model | None = None,
        instructions: str | None = None,
        native: bool = False,
    ) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int | float):
            raise TypeError(f"threshold must be a number, got {type(threshold).__name__}")
        if not 0 < threshold <= 1:  # (NaN fails this too)
            raise ValueError(f"threshold must be above 0 and at most 1 (a share of the window), got {threshold}")
        if keep_recent_tokens is not None and (
            isinstance(keep_recent_tokens, bool) or not isinstance(keep_recent_tokens, int) or keep_recent_tokens < 1
        ):
            raise ValueError(f"keep_recent_tokens must be a positive integer, got {keep_recent_tokens!r}")
        self.threshold = float(threshold)
        self.keep_recent_tokens = keep_recent_tokens
        self.summariser = None if summariser is None else resolve_model(summariser)
        if not isinstance(native, bool):
            raise TypeError(f"native must be True or False, got {type(native).__name__}")
        self.instructions = instructions
        self.native = native

    def install(self, config: LoopConfig) -> None:
        async def compact_context(info: TurnInfo) -> list[Message] | None:
            return await self.compact(config, info)

        config.hooks.on("compact_context")(compact_context)

    async def compact(self, config: LoopConfig, info: TurnInfo) -> list[Message] | None:
        """The history that replaces ``info.messages`` (the summary, then the tail kept), or None
        to leave it: below the threshold, nothing worth compacting, or the summary failed."""
        history, model = info.messages, config.model.info
        who = f"run {info.run_id}"
        if not info.overflow and (
            len(history) < 4
            or not compaction_due(
                info.system_prompt, info.tools, history, model, self.threshold, self.keep_recent_tokens, who=who
            )
        ):
            return None
        carry = await ask_pre_compaction(
            config.hooks, info.run_id, info.turn, history, info.system_prompt, info.tools, info.conversation, who
        )
        if isinstance(carry, Block):
            return None
        reason: CompactionTrigger = "overflow" if info.overflow else "threshold"
        keep = keep_recent(
            info.system_prompt, info.tools, history, model, self.threshold, self.keep_recent_tokens, reason
        )
        emit = info.emit  # (watched: a start, and its end however the summary goes)
        if emit is not None:
            emit(CompactionStart(reason=reason, messages_before=len(history)))
        try:
            result = await compact(
                list(history),
                self.summariser or config.model,
                keep_recent_tokens=keep,
                reason=reason,
                instructions=self.instructions,
                carry=carry,
                native=config.model if self.native else None,
            )
        except CompactionError as exc:
            log.warning("run %s: compaction failed, history unchanged: %s", info.run_id, exc)
            if emit is not None:
                emit(CompactionEnd(reason=reason, compacted=False, error=str(exc)))
            return None
        except BaseException as exc:  # an abort (cancelled), or a bug the hook runner logs
            if emit is not None:
                error = "aborted" if isinstance(exc, asyncio.CancelledError) else f"{type(exc).__name__}: {exc}"
                emit(CompactionEnd(reason=reason, compacted=False, error=error))
            raise
        if result is None:
            if emit is not None:
                emit(CompactionEnd(reason=reason, compacted=False))
            return None
        if info.usage is not None:
            info.usage.add(result.usage)
        log.info(
            "run %s: %s compaction folded %d messages into a summary (about %d tokens to %d)",
            info.run_id,
            reason,
            len(result.removed),
            result.tokens_before,
            result.tokens_after,
        )
        if emit is not None:  # (an overflow's call is made again with the compacted history)
            emit(
                CompactionEnd(
                    reason=reason,
                    compacted=True,
                    will_retry=info.overflow,
                    removed=len(result.removed),
                    tokens_before=result.tokens_before,
                    tokens_after=result.tokens_after,
                )
            )
        return result.history
