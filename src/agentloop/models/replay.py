"""Replay hygiene: make a stored history acceptable to any provider before it is sent.

Histories collect things providers reject: failed assistant turns, tool calls whose results never
came (a crash, an abort, a switch of model), ids in another provider's format. Adapters call
``clean_history`` while converting, so the stored history itself is never rewritten.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import replace

from agentloop.messages import (
    AssistantMessage,
    Message,
    TextContent,
    ToolCall,
    ToolResultMessage,
)

MISSING_RESULT = "No result provided"

_UNSAFE_ID = re.compile(r"[^A-Za-z0-9_-]")


def safe_tool_id(id: str, max_len: int = 64) -> str:
    """An id matching ``^[A-Za-z0-9_-]{1,max_len}$`` (Anthropic's rule, accepted everywhere)."""
    clean = _UNSAFE_ID.sub("_", id)[:max_len]
    return clean or "call"


def clean_history(messages: list[Message], normalize_id: Callable[[str], str] | None = None) -> list[Message]:
    """Return a copy of ``messages`` that every provider accepts.

    - assistant turns that failed (``error``) are dropped, and aborted turns with no content;
    - a tool call without a result gets a synthetic error result right after its turn's results;
    - a tool result without its call is dropped;
    - with ``normalize_id``, tool call ids are rewritten consistently in calls and results, and
      ids that normalise alike (``a|1`` and ``a/1``, or a shared prefix past the length limit)
      stay distinct, so no result answers the wrong call.
    """
    out: list[Message] = []
    open_calls: dict[str, ToolCall] = {}  # (normalised) id -> call of the latest turn, no result yet
    dropped: set[str] = set()
    ids: dict[str, str] = {}  # original id -> normalised id
    taken: set[str] = set()  # normalised ids given out

    def norm(id: str) -> str:
        if normalize_id is None:
            return id
        new = ids.get(id)
        if new is None:
            new = normalize_id(id)
            salt = 0
            while new in taken:  # another id normalised to this one: prefix a hash, which survives truncation
                digest = hashlib.sha1(f"{salt}:{id}".encode(), usedforsecurity=False).hexdigest()[:12]
                new, salt = normalize_id(f"{digest}_{id}"), salt + 1
            ids[id] = new
            taken.add(new)
        return new

    def close_open() -> None:
        for call in open_calls.values():
            out.append(
                ToolResultMessage(
                    tool_call_id=call.id,
                    tool_name=call.name,
                    content=[TextContent(text=MISSING_RESULT)],
                    is_error=True,
                )
            )
        open_calls.clear()

    for msg in messages:
        if isinstance(msg, AssistantMessage):
            close_open()
            if msg.stop_reason == "error" or (msg.stop_reason == "aborted" and not msg.content):
                dropped.update(c.id for c in msg.tool_calls)
                continue
            if normalize_id is not None and msg.tool_calls:
                msg = replace(
                    msg,
                    content=[replace(b, id=norm(b.id)) if isinstance(b, ToolCall) else b for b in msg.content],
                )
            for call in msg.tool_calls:
                open_calls[call.id] = call
            out.append(msg)
        elif isinstance(msg, ToolResultMessage):
            key = norm(msg.tool_call_id)
            if msg.tool_call_id in dropped or key not in open_calls:
                continue
            del open_calls[key]
            if key != msg.tool_call_id:
                msg = replace(msg, tool_call_id=key)
            out.append(msg)
        else:
            close_open()
            out.append(msg)
    close_open()
    return out
