"""What the durable-process tests share: recording tools and a kernel on a temporary SQLite file."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from agentloop import tool
from agentloop.kernel import Kernel
from agentloop.messages import AssistantMessage, Message, ToolResultMessage

ran: list[str] = []  # what ``echo`` ran, in order (clear it at the start of a test that checks it)


@tool
def echo(text: str) -> str:
    """Echo."""
    ran.append(text)
    return text


@tool
async def slow(seconds: float) -> str:
    """Sleep."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


def kernel(tmp_path: Path, model: Any, **kw: Any) -> Kernel:
    kw.setdefault("tools", [echo, slow])
    return Kernel.open(f"sqlite:///{tmp_path}/agentloop.db", model=model, workspace=tmp_path, **kw)


def assert_valid(msgs: list[Message]) -> None:
    """Every tool call is followed by exactly one result each, in order; no orphan results."""
    i = 0
    while i < len(msgs):
        msg = msgs[i]
        assert not isinstance(msg, ToolResultMessage), f"orphan tool result at {i}: {msg}"
        if isinstance(msg, AssistantMessage) and msg.tool_calls:
            ids = [c.id for c in msg.tool_calls]
            results = msgs[i + 1 : i + 1 + len(ids)]
            assert [getattr(r, "tool_call_id", None) for r in results] == ids, msgs
            i += 1 + len(ids)
            continue
        i += 1
