"""Known limits of the chat channels, fixed: each test failed before its fix.

- Telegram forum topics: every topic of a supergroup with topics shared the chat's one process,
  and every answer went to the General topic.
- Discord: a mention of the bot's managed role (``<@&role>``, what the mention autocomplete offers
  beside the bot) was not taken for a mention of the bot, so the bot did not answer.

They run the bridges against the local fakes of ``test_channel_telegram`` and ``test_channel_discord``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop.channels.telegram import CHAT_KEY
from tests import test_channel_discord as dc
from tests import test_channel_telegram as tg
from tests.test_channel_discord import FakeDiscord
from tests.test_channel_telegram import FakeTelegram

FORUM = -1001234567890  # a supergroup with topics
LOST, PLANS = 7, 9  # two of its topics (their message_thread_id)


@pytest.fixture
def telegram() -> Iterator[FakeTelegram]:
    fake = FakeTelegram()
    with fake.server:
        yield fake


@pytest.fixture
def discord() -> Iterator[FakeDiscord]:
    with FakeDiscord() as fake:
        yield fake


# ------------------------------------------------------------------ Telegram: forum topics


def in_forum(fake: FakeTelegram, user: int, text: str, thread: int | None = None, *, topic: bool = True) -> int:
    """``user`` writes ``text`` in the forum: in the topic ``thread`` (``topic``: marked as a topic
    message, as Telegram marks one; unmarked, a reply in General, which carries a thread id too)."""
    message: dict[str, Any] = {
        "message_id": 1,
        "from": {"id": user, "is_bot": False, "first_name": f"User{user}"},
        "chat": {"id": FORUM, "type": "supergroup", "title": "Forum", "is_forum": True},
        "date": 0,
        "text": text,
    }
    if thread is not None:
        message["message_thread_id"] = thread
        if topic:
            message["is_topic_message"] = True
    return fake.add({"message": message})


def said_in(fake: FakeTelegram, thread: int | None, method: str = "sendMessage") -> list[dict[str, Any]]:
    """What the bridge sent (``method``) to the forum's topic ``thread`` (None: General)."""
    return [p for p in fake.sent(method, FORUM) if p.get("message_thread_id") == thread]


def texts_in(fake: FakeTelegram, thread: int | None) -> list[str]:
    return [p["text"] for p in said_in(fake, thread)]


async def test_telegram_each_forum_topic_is_a_conversation_of_its_own_answered_in_it(
    tmp_path: Path, telegram: FakeTelegram
) -> None:
    fake = telegram
    async with tg.running(tmp_path, fake, allow=[tg.ALICE]) as (kernel, bridge, _):
        in_forum(fake, tg.ALICE, "hello")  # General
        await tg.until(lambda: texts_in(fake, None))
        in_forum(fake, tg.ALICE, "one", LOST)
        await tg.until(lambda: texts_in(fake, LOST))
        in_forum(fake, tg.ALICE, "two", PLANS)
        await tg.until(lambda: texts_in(fake, PLANS))
        in_forum(fake, tg.ALICE, "a reply", 4321, topic=False)  # (a reply in General: no topic)
        in_forum(fake, tg.MALLORY, "me too", PLANS)
        await tg.until(lambda: len(texts_in(fake, None)) == 2 and len(texts_in(fake, PLANS)) == 2)
        assert texts_in(fake, None) == ["seen: hello", "seen: hello, a reply"]
        assert texts_in(fake, LOST) == ["seen: one"]
        assert texts_in(fake, PLANS)[0] == "seen: two"
        assert "private" in texts_in(fake, PLANS)[1]  # (the stranger is told where they wrote)
        assert {p["message_thread_id"] for p in fake.sent("sendChatAction", FORUM) if "message_thread_id" in p} == {
            LOST,
            PLANS,
        }
        assert len(fake.sent("sendMessage")) == len(fake.sent("sendMessage", FORUM)) == 5
        values = {await kernel.store.kv_get(p.pid, CHAT_KEY) for p in await kernel.processes()}
        # (the General conversation keeps the key every chat had: existing processes are found again)
        assert values == {
            f"{bridge.bot_id}:{FORUM}",
            f"{bridge.bot_id}:{FORUM}:{LOST}",
            f"{bridge.bot_id}:{FORUM}:{PLANS}",
        }
    async with tg.running(tmp_path, fake, allow=[tg.ALICE]):  # a restart finds the topics' processes again
        in_forum(fake, tg.ALICE, "again", LOST)
        await tg.until(lambda: len(texts_in(fake, LOST)) == 2)
        assert texts_in(fake, LOST)[1] == "seen: one, again"


async def test_telegram_an_approval_asked_in_a_topic_is_asked_and_answered_there(
    tmp_path: Path, telegram: FakeTelegram
) -> None:
    fake = telegram
    tg.removed.clear()
    async with tg.running(tmp_path, fake, allow=[tg.ALICE]):
        in_forum(fake, tg.ALICE, "delete", LOST)
        [ask] = await tg.until(lambda: [p for p in said_in(fake, LOST) if "reply_markup" in p])
        typed = len(said_in(fake, LOST, "sendChatAction"))
        data = ask["reply_markup"]["inline_keyboard"][0][0]["callback_data"]
        message = {
            "message_id": ask["_message_id"],
            "chat": {"id": FORUM, "type": "supergroup", "is_forum": True},
            "message_thread_id": LOST,
            "is_topic_message": True,
            "date": 0,
            "text": ask["text"],
        }
        sender = {"id": tg.ALICE, "is_bot": False, "first_name": "Alice"}
        fake.add(
            {"callback_query": {"id": "q1", "from": sender, "message": message, "chat_instance": "1", "data": data}}
        )
        await tg.until(lambda: "tool said: removed x" in texts_in(fake, LOST))
        assert tg.removed == ["x"]
        await tg.until(lambda: len(said_in(fake, LOST, "sendChatAction")) > typed)  # "typing…" in the topic
        assert "Approved by Alice" in fake.sent("editMessageText")[0]["text"]
        assert texts_in(fake, None) == []  # nothing went to General


# ------------------------------------------------------------------ Discord: the bot's managed role

BOT_ROLE, MODS = 8001, 8002  # the role Discord made for the bot, and a role the bot shares with people


def mention_roles(fake: FakeDiscord, user: int, text: str, roles: tuple[int, ...]) -> None:
    """``user`` writes ``text`` in the server's channel, mentioning ``roles`` (and no user)."""
    event = fake.message(dc.GENERAL, user, text, guild=dc.GUILD, live=False)
    event["mention_roles"] = [str(r) for r in roles]
    with fake.lock:
        fake.history[dc.GENERAL][-1]["mention_roles"] = event["mention_roles"]
    fake.gateway.dispatch("MESSAGE_CREATE", event)


def roles_of_the_server() -> list[dict[str, Any]]:
    return [
        {"id": str(dc.GUILD), "name": "@everyone"},
        {"id": str(BOT_ROLE), "name": "agent", "managed": True, "tags": {"bot_id": str(dc.BOT)}},
        {"id": str(MODS), "name": "mods"},
    ]


class RolesTransport(httpx.AsyncBaseTransport):
    """The network, and ``GET /guilds/<server>/roles`` (a route the fake has not) answered here."""

    def __init__(self) -> None:
        self.network = httpx.AsyncHTTPTransport()
        self.asked: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == f"/api/v10/guilds/{dc.GUILD}/roles":
            self.asked.append(request.url.path)
            return httpx.Response(200, content=json.dumps(roles_of_the_server()).encode())
        return await self.network.handle_async_request(request)

    async def aclose(self) -> None:
        await self.network.aclose()


async def test_discord_a_mention_of_the_bots_role_is_a_mention_of_the_bot(tmp_path: Path, discord: FakeDiscord) -> None:
    fake = discord
    network = RolesTransport()
    async with dc.running(tmp_path, fake, transport=network):
        mention_roles(fake, dc.ALICE, f"<@&{MODS}> not for the bot", (MODS,))
        mention_roles(fake, dc.ALICE, f"<@&{BOT_ROLE}> hello", (BOT_ROLE,))
        await dc.until(lambda: fake.texts(dc.GENERAL))
        mention_roles(fake, dc.ALICE, f"and <@&{MODS}> <@&{BOT_ROLE}> again", (MODS, BOT_ROLE))
        await dc.until(lambda: len(fake.texts(dc.GENERAL)) == 2)
        # the bot's role taken out as its mention is; a role the bot merely has is not for it
        assert fake.texts(dc.GENERAL) == ["seen: hello", f"seen: hello, and <@&{MODS}> again"]
        assert len(network.asked) == 1  # (the server's roles read once)
