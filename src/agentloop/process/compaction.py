"""Context compaction of a durable process: the shared measuring, cut and summary, plus clearing.

What a summary compaction computes (the token estimates, where to cut, the summary prompt and
message) is the loop's (``loop/compaction.py``), shared with the in-memory ``Compaction`` piece,
and re-exported here for the process layer. What stays is the process's own: the first, cheap tier
that clears old tool outputs whose originals the process archives, and how the estimates read
the size of a document stored as a file (``process/media.py``). The durable runner decides *when*
and *where* to install a result: ``compact`` and ``clear_tool_outputs`` never touch storage, the
caller archives what they remove first and only then swaps the history, so a crash between the
two leaves an extra archive, never lost messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agentloop.loop.compaction import (
    CHARS_PER_TOKEN,
    IMAGE_TOKENS,
    MEMORY_SYSTEM_PROMPT,
    MESSAGE_OVERHEAD,
    PDF_BYTES_PER_TOKEN,
    SUMMARY_KIND,
    SUMMARY_MAX_TOKENS,
    SUMMARY_SYSTEM_PROMPT,
    THINKING_CLIP,
    TOOL_ARGS_CLIP,
    TOOL_RESULT_CLIP,
    CompactionError,
    CompactionReason,
    CompactionResult,
    carried,
    compact,
    context_tokens,
    count_stored_files,
    estimate_tokens,
    estimated_context,
    explicit_cut,
    extract_memories,
    plan_cut,
    pressure,
    render_transcript,
    reported_tokens,
    should_compact,
    split_memories,
    summarize,
    summary_message,
    summary_time,
)
from agentloop.messages import (
    AssistantMessage,
    FileContent,
    ImageContent,
    Message,
    TextContent,
    ToolResultMessage,
    check_plain_text,
    now_ms,
)
from agentloop.process.media import MediaError, MediaRef, is_stored

__all__ = [
    "CHARS_PER_TOKEN",
    "CLEARABLE_TOKENS",
    "CLEARED_DETAIL",
    "CLEARED_NOTE",
    "CLEARING_MARGIN",
    "IMAGE_TOKENS",
    "MAX_SUMMARY",
    "MEMORY_SYSTEM_PROMPT",
    "MESSAGE_OVERHEAD",
    "PDF_BYTES_PER_TOKEN",
    "SUMMARY_KIND",
    "SUMMARY_MAX_TOKENS",
    "SUMMARY_SYSTEM_PROMPT",
    "THINKING_CLIP",
    "TOOL_ARGS_CLIP",
    "TOOL_RESULT_CLIP",
    "Clearing",
    "CompactionError",
    "CompactionReason",
    "CompactionResult",
    "carried",
    "check_manual",
    "check_summary",
    "clear_tool_outputs",
    "compact",
    "context_tokens",
    "estimate_tokens",
    "estimated_context",
    "explicit_cut",
    "extract_memories",
    "plan_cut",
    "pressure",
    "render_transcript",
    "reported_tokens",
    "should_compact",
    "split_memories",
    "summarize",
    "summary_message",
]


def _stored_file_size(block: FileContent) -> int | None:
    """A document kept as a file counts by the size its reference records (a broken one: 0)."""
    if not is_stored(block):
        return None
    try:
        return MediaRef.of(block).size
    except MediaError:
        return 0


# (wherever a process's history is measured this module is loaded, so its stored files count)
count_stored_files(_stored_file_size)


# ------------------------------------------------------------------ a compaction asked for by hand


MAX_SUMMARY = 20_000  # characters of a summary a caller supplies (``Process.compact(summary=…)``)
# (C0 but tab and line breaks, DEL, and C1: U+009B is a terminal's CSI as ESC [ is)
_CONTROL = {chr(c) for c in range(32) if chr(c) not in "\t\n\r"} | {chr(c) for c in range(0x7F, 0xA0)}


def check_summary(summary: object) -> str:
    """A summary a caller wrote, stripped, or ``TypeError``/``ValueError``: it must be plain text
    (no control characters but tab and line breaks, nothing a text column refuses), not empty,
    at most ``MAX_SUMMARY`` characters. It stands in the history for what it replaces, as the
    model's summaries do, so it is held to what a message's text may be, and kept short."""
    if not isinstance(summary, str):
        raise TypeError(f"summary must be a string, got {type(summary).__name__}")
    text = summary.strip()
    if not text:
        raise ValueError("summary must not be empty")
    if len(text) > MAX_SUMMARY:
        raise ValueError(f"summary is longer than {MAX_SUMMARY} characters")
    check_plain_text(text, "summary")
    bad = next((i for i, ch in enumerate(text) if ch in _CONTROL), None)
    if bad is not None:
        raise ValueError(f"summary must be plain text (character {bad} is a control character)")
    return text


def check_manual(
    keep_last: object, through: object, summary: object, instructions: str | None, max_position: int
) -> str | None:
    """The options of a compaction asked for by hand, checked before anything is done (the
    summary as ``check_summary`` returns it): ``keep_last`` (a count) and ``through`` (a message
    id), integers from 0 to ``max_position``, not both; ``summary`` not with ``instructions``,
    which are for the summary model that a supplied summary stands in for."""
    for name, value in (("keep_last", keep_last), ("through", through)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
        if isinstance(value, int) and not 0 <= value <= max_position:
            raise ValueError(f"{name} must be an integer from 0 to {max_position}, got {value}")
    if keep_last is not None and through is not None:
        raise ValueError("give keep_last or through, not both: one says where the summary ends")
    if summary is None:
        return None
    if instructions is not None and instructions.strip():
        raise ValueError("give summary or instructions, not both: instructions are for the summary model")
    return check_summary(summary)


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
        summarised_at = summary_time(messages)
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
