"""Context compaction: measure how full the context is, and fold old history into a summary.

Everything here is pure computation plus one model call, so the durable runner decides *when*
and *where* to install the result. ``compact`` never touches storage: it returns the removed
prefix, the kept tail and the summary, the caller archives ``removed`` first and only then swaps
the history, so a crash between the two leaves an extra archive, never lost messages.

Token counts are estimates (about four characters per token, images at a flat cost) because a
tokenizer per provider would be a download and a dependency for a number that only has to be
good enough to trigger compaction a little early rather than too late.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeAlias

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
)
from agentloop.models.base import Model, ModelInfo, ModelRequest, ToolSpec
from agentloop.process.media import MediaError, MediaRef, decoded_size, is_stored

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


def _file_tokens(block: FileContent) -> int:
    """A document's cost from its size: text at the usual rate, a PDF at a rough one (providers
    bill its pages, text and pictures, which the size only hints at)."""
    size = decoded_size(block.data)
    if is_stored(block):  # stored as a file: the reference knows its size
        try:
            size = MediaRef.of(block).size
        except MediaError:
            size = 0
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
    summarised_at = _summary_time(messages)
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


def _summary_time(messages: Sequence[Message]) -> int:
    """When the summary heading the history was made (a compaction replaces a prefix, so it is
    first, or second after a message kept before it); -1 without one."""
    for m in messages[:2]:
        if isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND:
            return m.timestamp
    return -1


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
    owner: dict[str, int] = {}
    for i, m in enumerate(messages):
        if isinstance(m, AssistantMessage):
            for tc in m.tool_calls:
                owner[tc.id] = i
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


# ------------------------------------------------------------------ clearing old tool outputs


CLEARABLE_TOKENS = 256  # a tool result smaller than this (about 1 KiB) is not worth a placeholder
CLEARED_NOTE = "[output cleared to save context: about {tokens} tokens{held}; the original is archived]"
# The key a cleared result's details gain (the tool's own details stay: code reads them from the
# history, as ``ToolReveal`` the tools a run was given): {"tokens": the output's estimate,
# "measured": the timestamp of the newest reply when it was cleared, whose usage still counts it}.
CLEARED_DETAIL = "_cleared"
# A clearing is taken instead of a summary only if it brings the pressure this far under the
# threshold: one that barely gets under would be followed by a summary a turn or two later.
CLEARING_MARGIN = 0.8


@dataclass
class Clearing:
    """Old tool outputs replaced by a one-line note: the first, cheap tier of compaction. No model
    call, and the conversation keeps its shape (every call, its result, every word of the
    dialogue); only the bulk of what tools returned long ago goes, to the archive."""

    positions: list[int]  # indexes in the history of the results cleared
    originals: list[ToolResultMessage]
    cleared: list[ToolResultMessage]
    tokens_before: int
    tokens_after: int
    created_ms: int = field(default_factory=now_ms)

    def history(self, messages: Sequence[Message]) -> list[Message]:
        out = list(messages)
        for i, message in zip(self.positions, self.cleared, strict=True):
            out[i] = message
        return out

    def still_applies(self, current: Sequence[Message]) -> bool:
        """Whether the results to clear are still where they were, unchanged."""
        return all(i < len(current) and current[i] == m for i, m in zip(self.positions, self.originals, strict=True))

    @staticmethod
    def uncounted(messages: Sequence[Message]) -> int:
        """Estimated tokens that clearings took out after the provider last reported usage: the
        reply ``context_tokens`` reads still counts them (the model call after a clearing failed,
        or was aborted, and reported none)."""
        summarised_at = _summary_time(messages)
        for i in range(len(messages) - 1, -1, -1):
            reply = messages[i]
            if not isinstance(reply, AssistantMessage):
                continue
            if reply.timestamp <= summarised_at:
                return 0  # (that usage is not read at all)
            if not reported_tokens(reply):
                continue
            saved = 0
            for m in messages[:i]:
                info = m.details.get(CLEARED_DETAIL) if isinstance(m, ToolResultMessage) and _is_cleared(m) else None
                if not isinstance(info, dict) or not isinstance(info.get("tokens"), int):
                    continue
                if isinstance(info.get("measured"), int) and info["measured"] >= reply.timestamp:
                    saved += max(0, info["tokens"] - estimate_tokens(m))
            return saved
        return 0

    def meta(self) -> dict[str, Any]:
        return {
            "kind": "clearing",
            "cleared": len(self.originals),
            "tokens_before": self.tokens_before,
            "tokens_after": self.tokens_after,
            "created_ms": self.created_ms,
        }


def clear_tool_outputs(messages: Sequence[Message], keep_recent_tokens: int) -> Clearing | None:
    """Replace the large tool results older than the newest ``keep_recent_tokens`` with a note
    saying how large they were; None when there is none to clear."""
    total = 0
    tail = len(messages)
    while tail > 0 and total < keep_recent_tokens:
        tail -= 1
        total += estimate_tokens(messages[tail])
    measured = next((m.timestamp for m in reversed(messages) if isinstance(m, AssistantMessage)), -1)
    positions: list[int] = []
    originals: list[ToolResultMessage] = []
    cleared: list[ToolResultMessage] = []
    for i in range(tail):
        m = messages[i]
        if not isinstance(m, ToolResultMessage) or _is_cleared(m):
            continue
        tokens = estimate_tokens(m)
        if tokens < CLEARABLE_TOKENS:
            continue
        images = sum(isinstance(b, ImageContent) for b in m.content)
        files = sum(isinstance(b, FileContent) for b in m.content)
        held = " and ".join(f"{n} {kind}{'s' * (n > 1)}" for n, kind in ((images, "image"), (files, "file")) if n)
        note = TextContent(text=CLEARED_NOTE.format(tokens=tokens, held=f", with {held}" if held else ""))
        details = dict(m.details) if isinstance(m.details, dict) else {}
        details[CLEARED_DETAIL] = {"tokens": tokens, "measured": measured}
        positions.append(i)
        originals.append(m)
        cleared.append(replace(m, content=[note], details=details))
    if not positions:
        return None
    before = estimate_tokens(list(messages))
    saved = sum(estimate_tokens(o) - estimate_tokens(c) for o, c in zip(originals, cleared, strict=True))
    return Clearing(positions, originals, cleared, before, before - saved)


def _is_cleared(message: ToolResultMessage) -> bool:
    return isinstance(message.details, dict) and CLEARED_DETAIL in message.details


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
        if isinstance(m, UserMessage):
            out.append(f"## user\n{_render_blocks(m.content, None)}")
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
    """A computed compaction, not yet installed: archive ``removed``, then install ``history``."""

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
) -> CompactionResult | None:
    """Summarise the prefix before ``plan_cut``; None when there is nothing worth compacting.

    Earlier summaries in the prefix are handed to the model as the previous summary so that
    repeated compactions roll them forward instead of summarising a summary as chatter.
    ``carry``: JSON data for the summary's ``details`` (see ``carried``), which code reading the
    history finds there once the messages it came from are gone.
    """
    cut = plan_cut(messages, keep_recent_tokens)
    if cut is None:
        return None
    removed, kept = list(messages[:cut]), list(messages[cut:])
    previous = [m.text for m in removed if isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND]
    rest = [m for m in removed if not (isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND)]
    text, memories, usage = await summarize(
        model, rest, previous_summary="\n\n".join(previous) or None, instructions=instructions
    )
    summary = summary_message(text, len(removed), carried(removed, carry))
    return CompactionResult(
        removed=removed,
        kept=kept,
        summary=summary,
        reason=reason,
        tokens_before=estimate_tokens(messages),
        tokens_after=estimate_tokens([summary, *kept]),
        memories=memories,
        usage=usage,
    )
