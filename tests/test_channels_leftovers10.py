"""Leftovers of the chat bridges' review (round 10), each checked to fail before its fix:

- Discord's catch-up: a message that needs nothing (a server channel's talk that does not mention
  the bot, the bot's own, a stranger's once refused) moved no mark, so every new session's catch-up
  paged through all of it again (and refused the stranger again). The catch-up now moves its
  channel's mark over each page it read, in one write; a dispatched message that needs nothing
  moves it too, written every ``PAGE`` of them or at close. A mention being handled when the
  bridge stops is still caught up, and a mention delivered after a newer message that needed
  nothing is still handled;
- Telegram: a press on an approval asked in a group that became a supergroup was decided against
  the group's old id (no process: "no longer pending") and its message edited through that id,
  which Telegram refuses; both now go to the supergroup (``_moved``);
- WhatsApp: a notice said by the inbox retrier's input as it ends during the close's grace (a kept
  "/new" answered "Started a new conversation.") was cancelled at once; it now gets what is left of
  that grace, and the close never waits past it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response

from agentloop import ScriptedModel
from agentloop.channels import bridge as chat_bridge
from agentloop.channels import discord as discord_module
from agentloop.channels import whatsapp
from agentloop.channels.discord import DiscordBridge
from tests import test_channel_telegram as tg
from tests import test_channel_whatsapp as wa
from tests.test_channel_discord import ALICE, BOT, GENERAL, GUILD, MALLORY, FakeDiscord, running, until, user_texts
from tests.test_channels_input_review7 import GROUP, SUPERGROUP, said

STATE = Path("var") / "discord" / f"{BOT}.json"


class CountingDiscord(FakeDiscord):
    """The fake Discord, also listing each catch-up read: (channel, its ``after``)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[int, int]] = []

    async def answer(self, name: str, request: Request, body: Any) -> Response:
        if name == "messages":
            with self.lock:
                self.reads.append((int(request.path_params["channel"]), int(request.query_params["after"])))
        return await super().answer(name, request, body)

    def taken(self) -> list[tuple[int, int]]:
        with self.lock:
            reads, self.reads = self.reads, []
        return reads


@pytest.fixture
def fake() -> Iterator[CountingDiscord]:
    with CountingDiscord() as discord:
        yield discord


def mention(fake: FakeDiscord, user: int, text: str, *, live: bool = True) -> dict[str, Any]:
    return fake.message(GENERAL, user, f"<@{BOT}> {text}", guild=GUILD, mentions=(BOT,), live=live)


def talk(fake: FakeDiscord, count: int, *, live: bool = False) -> dict[str, Any]:
    """``count`` messages in the server channel that need nothing (people talking, a bot): the last."""
    last: dict[str, Any] = {}
    for n in range(count):
        last = fake.message(GENERAL, ALICE if n % 3 else 555, f"chat {n}", guild=GUILD, bot=n % 3 == 0, live=live)
    return last


def saved_mark(tmp_path: Path) -> int:
    return int(json.loads((tmp_path / STATE).read_text())["last"][str(GENERAL)])


async def known(tmp_path: Path, fake: CountingDiscord) -> ScriptedModel:
    """A first session, in which the bot is mentioned in the server channel (which it then knows):
    its model, for the next ones."""
    async with running(tmp_path, fake, allow=[ALICE]) as (_, _, model):
        mention(fake, ALICE, "hello")
        await until(lambda: fake.texts(GENERAL))
    fake.taken()
    return model


async def caught_up(bridge: DiscordBridge, fake: CountingDiscord) -> None:
    """Until the session's catch-up is over (it read, and the intake has nothing left to do)."""
    await until(lambda: fake.reads and bridge._queue.empty() and not bridge._lock("intake").locked())


# ------------------------------------------------------------------------------- Discord


async def test_discord_a_catch_up_does_not_read_again_what_needed_nothing(
    tmp_path: Path, fake: CountingDiscord
) -> None:
    model = await known(tmp_path, fake)
    talk(fake, 120)
    mention(fake, ALICE, "while away", live=False)
    mention(fake, MALLORY, "me too", live=False)  # a stranger: refused once
    last = talk(fake, 100)
    async with running(tmp_path, fake, allow=[ALICE], model=model) as (_, bridge, _):
        await until(lambda: len(fake.texts(GENERAL)) == 3)
        await caught_up(bridge, fake)
        assert len(fake.taken()) == 3  # (pages of 100, after the hello)
        assert user_texts(model) == ["hello", "while away"]
    mark = saved_mark(tmp_path)  # (the whole of the last page, which holds the answers, in one write)

    # the next session asks only for what came after; what was missed since is handled once
    mention(fake, ALICE, "and again", live=False)
    async with running(tmp_path, fake, allow=[ALICE], model=model) as (_, bridge, _):
        await until(lambda: fake.texts(GENERAL)[-1].endswith("and again"))
        await caught_up(bridge, fake)
        assert fake.taken() == [(GENERAL, mark)] and mark >= int(last["id"])
        assert user_texts(model) == ["hello", "while away", "and again"]
    refusals = [t for t in fake.texts(GENERAL) if str(MALLORY) in t]
    assert len(refusals) == 1  # (read again, the stranger was refused again)


async def test_discord_dispatched_talk_moves_the_mark_in_batches_and_at_close(
    tmp_path: Path, fake: CountingDiscord, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = await known(tmp_path, fake)
    mark = saved_mark(tmp_path)
    monkeypatch.setattr(discord_module, "PAGE", 5)
    async with running(tmp_path, fake, allow=[ALICE], model=model) as (_, bridge, _):
        await caught_up(bridge, fake)  # (the answer to the hello)
        fake.taken()
        fifth = talk(fake, 5, live=True)
        await until(lambda: saved_mark(tmp_path) == int(fifth["id"]))  # a write for five, not five writes
        last = talk(fake, 2, live=True)
        await until(lambda: bridge.state.last[GENERAL] == int(last["id"]))
        assert saved_mark(tmp_path) == int(fifth["id"])
    assert saved_mark(tmp_path) == int(last["id"]) > mark  # written at close
    async with running(tmp_path, fake, allow=[ALICE], model=model) as (_, _, _):
        await until(lambda: fake.reads)
        assert fake.taken() == [(GENERAL, int(last["id"]))]


async def test_discord_a_mention_cut_off_by_the_close_is_caught_up_once(
    tmp_path: Path, fake: CountingDiscord, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = await known(tmp_path, fake)
    mark = saved_mark(tmp_path)
    talk(fake, 3)
    missed = mention(fake, ALICE, "cut off", live=False)
    talk(fake, 3)
    monkeypatch.setattr(chat_bridge, "CLOSE_GRACE", 0.2)
    deliver = DiscordBridge._deliver
    delivering = asyncio.Event()

    async def stuck(self: DiscordBridge, *args: Any, **kw: Any) -> None:
        delivering.set()
        await asyncio.sleep(30)  # (longer than the grace: cancelled by the close)

    monkeypatch.setattr(DiscordBridge, "_deliver", stuck)
    async with running(tmp_path, fake, allow=[ALICE], model=model) as (_, _, _):
        await asyncio.wait_for(delivering.wait(), 5)
    assert saved_mark(tmp_path) == mark  # (its page not dealt with: not passed over)
    monkeypatch.setattr(DiscordBridge, "_deliver", deliver)
    async with running(tmp_path, fake, allow=[ALICE], model=model) as (_, bridge, _):
        await until(lambda: fake.texts(GENERAL)[-1].endswith("cut off"))
        await caught_up(bridge, fake)
        assert bridge.state.last[GENERAL] > int(missed["id"])
        assert user_texts(model) == ["hello", "cut off"]


async def test_discord_a_mention_delivered_after_newer_talk_is_still_handled(
    tmp_path: Path, fake: CountingDiscord
) -> None:
    model = await known(tmp_path, fake)
    async with running(tmp_path, fake, allow=[ALICE], model=model) as (_, bridge, _):
        await caught_up(bridge, fake)
        late = mention(fake, ALICE, "late", live=False)
        newer = talk(fake, 1, live=True)  # (Discord delivers it first)
        await until(lambda: bridge.state.last[GENERAL] == int(newer["id"]))
        fake.gateway.dispatch("MESSAGE_CREATE", late)
        await until(lambda: fake.texts(GENERAL)[-1].endswith("late"))
        assert user_texts(model) == ["hello", "late"]


# ------------------------------------------------------------------------------- Telegram


@pytest.fixture
def telegram() -> Iterator[tg.FakeTelegram]:
    fake = tg.FakeTelegram()
    with fake.server:
        yield fake


async def test_telegram_a_press_on_an_approval_asked_before_the_group_moved_goes_to_the_supergroup(
    tmp_path: Path, telegram: tg.FakeTelegram
) -> None:
    tg.removed.clear()
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE]) as (_, _, _):
        telegram.message(chat=GROUP, user=tg.ALICE, text="delete")
        [ask] = await tg.until(lambda: [p for p in telegram.sent(chat=GROUP) if "reply_markup" in p])
        said(telegram, GROUP, tg.ALICE, migrate_to_chat_id=SUPERGROUP)  # the group is a supergroup now
        approve = ask["reply_markup"]["inline_keyboard"][0][0]["callback_data"]
        telegram.press(tg.ALICE, ask, approve)  # (on the message in the group: its old id)
        [edit] = await tg.until(lambda: telegram.sent("editMessageText"))
        assert [p["text"] for p in telegram.sent("answerCallbackQuery")] == ["✅ Approved"]
        assert edit["chat_id"] == GROUP and edit["message_id"] == ask["_message_id"]  # (where it is)
        assert edit["text"].endswith("✅ Approved by User100")
        await tg.until(lambda: "tool said: removed x" in telegram.texts(SUPERGROUP))
        assert tg.removed == ["x"]


# ------------------------------------------------------------------------------- WhatsApp


@pytest.fixture
def graph() -> Iterator[wa.FakeGraph]:
    fake = wa.FakeGraph()
    with fake.server:
        yield fake


def kept_new(tmp_path: Path) -> None:
    """A "/new" kept in the inbox by the bridge before (Meta was told it was taken)."""
    message = {"from": wa.ALICE, "id": "wamid.kept-new", "timestamp": "1700000000", "type": "text"}
    path = tmp_path / "var" / "whatsapp" / f"{wa.PHONE_ID}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"offset": 0, "seqs": {}, "inbox": [{**message, "text": {"body": "/new"}}]}))


def slow_reset(monkeypatch: pytest.MonkeyPatch, seconds: float) -> asyncio.Event:
    reset = whatsapp.WhatsAppBridge._reset
    resetting = asyncio.Event()

    async def slow(self: whatsapp.WhatsAppBridge, chat: str) -> None:
        resetting.set()
        await asyncio.sleep(seconds)  # (the close begins meanwhile)
        await reset(self, chat)

    monkeypatch.setattr(whatsapp.WhatsAppBridge, "_reset", slow)
    return resetting


def grace(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    monkeypatch.setattr(whatsapp, "CLOSE_GRACE", seconds)
    monkeypatch.setattr(chat_bridge, "CLOSE_GRACE", seconds)


async def test_whatsapp_a_notice_the_retriers_input_says_while_the_bridge_closes_is_sent(
    tmp_path: Path, graph: wa.FakeGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    grace(monkeypatch, 2.0)
    kept_new(tmp_path)
    resetting = slow_reset(monkeypatch, 0.3)
    async with wa.running(tmp_path, graph, allow=[wa.ALICE]) as (_, bridge, _, _):
        send = bridge.api.send

        async def slow_send(message: dict[str, Any], **kw: Any) -> Any:
            await asyncio.sleep(0.2)  # (on its way when the retrier is stopped)
            return await send(message, **kw)

        bridge.api.send = slow_send  # type: ignore[method-assign]
        await asyncio.wait_for(resetting.wait(), 5)
    assert graph.texts(wa.ALICE) == ["Started a new conversation."]


async def test_whatsapp_the_retriers_notices_get_no_more_than_the_grace_left(
    tmp_path: Path, graph: wa.FakeGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    grace(monkeypatch, 1.0)
    kept_new(tmp_path)
    resetting = slow_reset(monkeypatch, 0.5)
    async with wa.running(tmp_path, graph, allow=[wa.ALICE]) as (_, bridge, _, _):

        async def stuck_send(message: dict[str, Any], **kw: Any) -> Any:
            await asyncio.sleep(30)  # (a Graph that does not answer)

        bridge.api.send = stuck_send  # type: ignore[method-assign]
        await asyncio.wait_for(resetting.wait(), 5)
        began = time.monotonic()
        await bridge.close()
        took = time.monotonic() - began
    # (waited for the notice, past the input's 0.5 s, but only for what was left of the grace)
    assert 0.85 < took < 1.35
    assert graph.texts(wa.ALICE) == []
