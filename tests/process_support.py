"""What the durable-process tests share: recording tools and a kernel on a temporary SQLite file."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from agentloop import tool
from agentloop.kernel import Kernel

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
