"""A subagent's approval request reaches the chat app too: the bridge follows the chat's own
process, on whose log a ``Task`` child's request is copied (kernel/subagent_asks.py); the buttons
answer it through that process, and the child's run goes on as the answer says."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agentloop import Reply, ScriptedModel, SystemMessage, ToolResultMessage, UserMessage, call
from agentloop.channels.telegram import TelegramBridge
from agentloop.kernel import Kernel
from agentloop.models.base import ModelRequest
from tests import test_channel_telegram as tg
from tests.test_channel_telegram import ALICE, FAST, TOKEN, FakeTelegram, until


@pytest.fixture
def fake() -> Iterator[FakeTelegram]:
    telegram = FakeTelegram()
    with telegram.server:
        yield telegram


def brain(request: ModelRequest) -> Reply | str:
    """The chat's process hands "delete" to a child (``Task``); the child calls ``rm`` (which asks)."""
    first = next(m.text for m in request.messages if isinstance(m, UserMessage))
    last = request.messages[-1]
    if isinstance(last, UserMessage) and first == "delete":
        return Reply(tool_calls=[call("Task", prompt="job: remove x")])
    if isinstance(last, UserMessage) and first == "job: remove x":
        return Reply(tool_calls=[call("rm", path="x")])
    if isinstance(last, ToolResultMessage):
        return f"tool said: {last.text}"
    if isinstance(last, SystemMessage):
        return "noted"
    return "?"


async def test_a_subagents_request_is_asked_in_the_chat_and_answered_by_its_buttons(
    tmp_path: Path, fake: FakeTelegram
) -> None:
    tg.removed.clear()
    async with Kernel.open(
        f"sqlite:///{tmp_path}/agentloop.db",
        model=ScriptedModel(brain),
        workspace=tmp_path,
        tools=[tg.rm],
        approval=tg.policy,
        titles=None,
        heartbeat=None,
        subagents=True,
    ) as kernel:
        bridge = TelegramBridge(kernel, TOKEN, allow=[ALICE], api_url=fake.url, poll_timeout=1, backoff=FAST)
        async with bridge:
            fake.message(chat=ALICE, user=ALICE, text="delete")
            [ask] = await until(lambda: [p for p in fake.sent(chat=ALICE) if "reply_markup" in p], 10)
            assert "rm" in ask["text"] and "path: x" in ask["text"] and tg.removed == []
            [chat_process] = [p for p in await kernel.processes() if p.parent_pid is None]
            [child] = [p for p in await kernel.processes() if p.parent_pid == chat_process.pid]
            [row] = await (await kernel.process(chat_process.pid)).pending_approvals()
            assert row.pid == child.pid  # the request is the child's, put to the chat

            [[approve, _, _]] = ask["reply_markup"]["inline_keyboard"]
            fake.press(ALICE, ask, approve["callback_data"])
            await until(lambda: any("removed x" in t for t in fake.texts(ALICE)), 10)
            assert tg.removed == ["x"]  # ran once, in the child, after the answer
            assert fake.sent("answerCallbackQuery")[0]["text"] == "✅ Approved"
            assert len([p for p in fake.sent(chat=ALICE) if "reply_markup" in p]) == 1  # asked once
