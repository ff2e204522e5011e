"""What the Telegram bridge writes: answers cut to Telegram's message limit, approval requests
with their buttons, and the buttons' callback data read back."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

MAX_MESSAGE = 4096  # what one Telegram message may hold (UTF-16 code units)
MAX_ARGUMENT = 300  # characters of one argument an approval message shows
MAX_ARGUMENTS = 2500  # characters of all of them
# "hil:<a|d|r>:<request id>": approve, deny, approve and remember (callback data: at most 64 bytes)
_CALLBACK = re.compile(r"hil:([adr]):([0-9A-Za-z_-]{1,48})")
_BUTTONS = (("Approve", "a"), ("Deny", "d"), ("Always", "r"))


def _utf16(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def split_message(text: str, limit: int = MAX_MESSAGE) -> list[str]:
    """``text`` in parts Telegram takes (at most ``limit`` UTF-16 code units each), cut at the
    last line break, else the last space, in the second half of a part; else where it is full."""
    parts: list[str] = []
    while _utf16(text) > limit:
        # the longest prefix that fits (characters outside the BMP count twice)
        low, high = 1, min(len(text), limit)
        while low < high:
            mid = (low + high + 1) // 2
            if _utf16(text[:mid]) <= limit:
                low = mid
            else:
                high = mid - 1
        cut = low
        for sep in ("\n", " "):
            at = text.rfind(sep, 0, cut)
            if at > cut // 2:
                cut = at
                break
        parts.append(text[:cut])
        text = text[cut:]
        if text[:1] in ("\n", " "):
            text = text[1:]  # (the separator the cut was made at)
    if text:
        parts.append(text)
    return [part for part in parts if part.strip()]


def describe_request(
    payload: Mapping[str, Any], *, max_argument: int = MAX_ARGUMENT, max_arguments: int = MAX_ARGUMENTS
) -> str:
    """The text of an approval request: the tool, its arguments (each shortened to
    ``max_argument`` characters, ``max_arguments`` in all), the policy's tags and reason."""
    name = str(payload.get("name") or payload.get("syscall") or "a tool")
    lines = [f"🔐 Approve {name}?"]
    args = payload.get("args")
    shown = 0
    items = list(args.items()) if isinstance(args, dict) else []
    for n, (key, value) in enumerate(items):
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        if len(text) > max_argument:
            text = f"{text[:max_argument]}… ({len(text) - max_argument} more characters)"
        if shown + len(text) > max_arguments:
            lines.append(f"… and {len(items) - n} more arguments")
            break
        shown += len(text)
        lines.append(f"{key}: {text}")
    tags = payload.get("tags")
    if isinstance(tags, list) and tags:
        lines.append("Flagged: " + ", ".join(str(t) for t in tags))
    reason = payload.get("reason")
    if isinstance(reason, str) and reason.strip():
        lines.append("Why: " + reason.strip()[:max_argument])
    return "\n".join(lines)


def approval_keyboard(request_id: str) -> dict[str, Any] | None:
    """Approve / Deny / Always under an approval request; None for an id no button can carry."""
    if not _CALLBACK.fullmatch(f"hil:a:{request_id}"):
        return None
    row = [{"text": text, "callback_data": f"hil:{key}:{request_id}"} for text, key in _BUTTONS]
    return {"inline_keyboard": [row]}


def parse_callback(data: object) -> tuple[str, str] | None:
    """(``a`` | ``d`` | ``r``, request id) of a button's callback data; None for anything else."""
    found = _CALLBACK.fullmatch(data) if isinstance(data, str) else None
    return None if found is None else (found.group(1), found.group(2))
