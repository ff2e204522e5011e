"""Review of ``Process.rewind`` (kernel/rewind.py) and ``/rewind``: what a rewind must also undo
besides the history itself."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agentloop import ScriptedModel
from agentloop.kernel import Process
from tests.test_rewind11 import answer, conversation, open_kernel, say


async def titled(proc: Process, text: str | None) -> str | None:
    """The process's title once it is ``text`` (or after a while: whatever it is then)."""
    title = None
    for _ in range(100):
        title = await proc.title()
        if title == text:
            break
        await asyncio.sleep(0.02)
    return title


async def test_a_rewind_past_the_first_message_lets_the_next_one_name_the_conversation(tmp_path: Path) -> None:
    """An automatic title is cut from the conversation's first user message; a rewind that drops
    that message (back to the start: "edit my first message") leaves a conversation about
    something else, which earns its own title, as after a reset. A person's title stays."""
    async with open_kernel(tmp_path, ScriptedModel(answer)) as k:
        proc = await k.spawn(owner="alice")
        ids = await conversation(proc, "typo in my first question", "second")
        assert await titled(proc, "typo in my first question") == "typo in my first question"
        await proc.rewind(ids[1])  # the first message is kept: so is its title
        await say(proc, "another")
        assert await titled(proc, "x") == "typo in my first question"
        await proc.rewind(0)
        assert await proc.title() is None  # (the automatic title went with its message)
        await say(proc, "the real question")
        assert await titled(proc, "the real question") == "the real question"
        named = await k.spawn(owner="alice")
        await conversation(named, "first")
        await named.set_title("Mine")
        await named.rewind(0)
        await say(named, "other")
        assert await titled(named, "other") == "Mine"
