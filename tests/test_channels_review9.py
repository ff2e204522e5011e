"""Review of the chat bridges' slash commands, button presses and forum topics (round 9).

Each test fails before its fix:

- a Discord press whose request was answered while the press waited its turn (deferred, then
  decided "no longer pending") gets a followup note only the presser sees, and no log line at
  DEBUG, of any logger, holds the interaction's token (the gateway's frame log included, with
  frames shown whole as ``WEBSOCKETS_MAX_LOG_SIZE`` allows);
- a press whose token is void (replayed after a resume: its deferral and its update both refused)
  still has its outcome told, in the channel;
- a slash command given up after ``TRIES`` failed takes says so in its deferred response instead
  of leaving "thinking…" for 15 minutes;
- Telegram: a press on an approval asked in a forum topic whose message Telegram sends without its
  topic (too old for the bot: an ``InaccessibleMessage``) reaches the topic's process, not the
  General one's (which said "no longer pending" while the topic's run waited for ever);
- Telegram: a message marked as written in the General topic (thread 1) is the chat's
  conversation, answered without a thread id (a send naming thread 1 is refused);
- a network error that quotes the address (with the interaction token the transport put in its
  path) is raised with the token masked.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.routing import Route
from websockets.frames import Frame

from agentloop.channels import discord as discord_module
from agentloop.channels.bridge import NOT_PENDING
from agentloop.channels.discord import EPHEMERAL, GIVEN_UP, DiscordBridge
from agentloop.channels.discord_api import DiscordApi, DiscordError
from tests import test_channel_discord as dc
from tests import test_channel_telegram as tg
from tests.test_channel_discord import ALICE, ALICE_DM, BOB, BOB_DM, FakeDiscord, running, until
from tests.test_channel_telegram import FakeTelegram
from tests.test_channels_limits8 import FORUM, LOST, in_forum, said_in, texts_in
from tests.test_discord_cli_polish8 import SlowCdn, post_image
from tests.test_discord_presses8 import ask_alice, button, last_token

NO_MENTIONS = {"parse": []}


@pytest.fixture
def fake() -> Iterator[FakeDiscord]:
    with FakeDiscord() as discord:
        # Discord's followup messages (POST /webhooks/<application>/<token>), which the shared fake
        # does not serve: recorded as "follow_up", answered as its other routes are
        app = discord.server._server.config.app
        app.router.routes.append(Route("/api/v10/webhooks/{app}/{token}", discord.route("follow_up"), methods=["POST"]))
        yield discord


@pytest.fixture
def cdn() -> Iterator[SlowCdn]:
    slow = SlowCdn()
    with slow.server:
        yield slow
        slow.release.set()


def follow_ups(fake: FakeDiscord, token: str) -> list[dict[str, Any]]:
    return [c.body for c in fake.of("follow_up") if c.ok and c.params["token"] == token]


async def test_a_press_answered_while_it_waited_gets_a_followup_note_and_its_token_is_never_logged(
    tmp_path: Path, fake: FakeDiscord, cdn: SlowCdn, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Frame, "MAX_LOG_SIZE", 100_000)  # (WEBSOCKETS_MAX_LOG_SIZE: frames shown whole)
    caplog.set_level(logging.DEBUG)
    for name in ("agentloop", "agentloop.channels", "httpx", "httpcore", "websockets"):
        caplog.set_level(logging.DEBUG, logger=name)
    dc.removed.clear()
    async with running(tmp_path, fake, attachment_urls=(cdn.base,)) as (_, _, _):
        ask = await ask_alice(fake)
        post_image(fake, cdn, BOB_DM, BOB, "look")  # (the intake is held by its download)
        await until(cdn.asked.is_set)
        first = last_token(fake, ALICE)
        fake.press(ALICE, ask, button(ask, 0))  # Approve
        await until(lambda: fake.deferral(first))
        second = last_token(fake, ALICE)
        fake.press(ALICE, ask, button(ask, 1))  # Deny: still pending when it comes, so deferred too
        await until(lambda: fake.deferral(second))
        cdn.release.set()

        await until(lambda: fake.edit_of(first))  # the first press decides it
        note = await until(lambda: follow_ups(fake, second))
        assert note == [{"content": NOT_PENDING, "flags": EPHEMERAL, "allowed_mentions": NO_MENTIONS}]
        [call] = fake.of("follow_up")
        assert call.params["app"] == str(dc.BOT)
        assert fake.edit_of(second) is None  # (the message shows the first press's outcome)
        await until(lambda: "tool said: removed x" in fake.texts(ALICE_DM))
        assert dc.removed == ["x"]

    records = [r.getMessage() for r in caplog.records]
    assert any("INTERACTION_CREATE" in line for line in records)  # (the frames were logged, whole)
    assert any("/webhooks/" in line and "HTTP Request: POST" in line for line in records)
    for token in (first, second):
        assert not [line for line in records if token in line]
        assert token not in caplog.text


async def test_a_press_with_a_void_token_has_its_outcome_told_in_the_channel(tmp_path: Path, fake: FakeDiscord) -> None:
    dc.removed.clear()
    async with running(tmp_path, fake, allow=[ALICE]) as (_, _, _):
        ask = await ask_alice(fake)
        gone = (404, {"message": "Unknown interaction", "code": 10062})
        fake.fail("callback", gone, gone)  # the deferral, then the update in the response
        fake.press(ALICE, ask, button(ask, 1))  # Deny
        await until(lambda: "❌ Denied by User100" in fake.texts(ALICE_DM))
        assert not [c for c in fake.of("callback") if c.ok]
        assert dc.removed == []


async def test_a_command_given_up_says_so_in_its_deferred_response(
    tmp_path: Path, fake: FakeDiscord, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(self: DiscordBridge, chat: int) -> None:
        raise RuntimeError("the store is down")

    monkeypatch.setattr(DiscordBridge, "_reset", broken)
    async with running(tmp_path, fake) as (_, _, _):
        token = fake.command(ALICE, "new", ALICE_DM)
        edit = await until(lambda: fake.edit_of(token), seconds=8.0)
        assert edit == {"content": GIVEN_UP, "allowed_mentions": NO_MENTIONS}
        assert fake.deferral(token) == discord_module.DEFERRED


def test_the_gateway_log_masks_an_interaction_token_cut_by_the_frames_elision(caplog: pytest.LogCaptureFixture) -> None:
    """At websockets' default size a frame's middle is elided: a token whose key fell in the middle
    may still end the frame's shown tail."""
    from websockets.frames import Opcode

    token = "aW50ZXJhY3Rpb246OjEyMzQ1Njc4OTAxMjM0NTY3ODpzZWNyZXRzZWNyZXQ"
    payload = '{"t":"INTERACTION_CREATE","s":3,"op":0,"d":{"id":"1","type":3,"locale":"en-US","token":"TOKEN"}}'
    payload = payload.replace("TOKEN", token)
    gateway = discord_module._GatewayLog(logging.getLogger("agentloop.channels.discord.gateway"), dc.TOKEN)
    caplog.set_level(logging.DEBUG, logger="agentloop.channels.discord.gateway")
    gateway.debug("< %s", Frame(Opcode.TEXT, payload.encode()))
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("< TEXT") and "..." in line  # (elided, as websockets shows it)
    assert not any(token[i : i + 8] in line for i in range(len(token) - 7)), line


@pytest.fixture
def telegram() -> Iterator[FakeTelegram]:
    fake = FakeTelegram()
    with fake.server:
        yield fake


async def test_telegram_a_press_on_a_topics_approval_too_old_to_name_its_topic_reaches_that_topic(
    tmp_path: Path, telegram: FakeTelegram
) -> None:
    fake = telegram
    tg.removed.clear()
    async with tg.running(tmp_path, fake, allow=[tg.ALICE]):
        in_forum(fake, tg.ALICE, "hello")  # (the General conversation has a process too)
        await tg.until(lambda: texts_in(fake, None))
        in_forum(fake, tg.ALICE, "delete", LOST)
        [ask] = await tg.until(lambda: [p for p in said_in(fake, LOST) if "reply_markup" in p])
        data = ask["reply_markup"]["inline_keyboard"][0][0]["callback_data"]
        # what Telegram sends for a message the bot can no longer see: its chat and id, date 0
        old = {"message_id": ask["_message_id"], "chat": {"id": FORUM, "type": "supergroup"}, "date": 0}
        sender = {"id": tg.ALICE, "is_bot": False, "first_name": "Alice"}
        fake.add({"callback_query": {"id": "q1", "from": sender, "message": old, "chat_instance": "1", "data": data}})
        await tg.until(lambda: "tool said: removed x" in texts_in(fake, LOST))
        assert tg.removed == ["x"]
        [answer] = fake.sent("answerCallbackQuery")
        assert answer["text"] == "✅ Approved"
        [edit] = await tg.until(lambda: fake.sent("editMessageReplyMarkup"))
        assert edit["message_id"] == ask["_message_id"] and edit["reply_markup"] == {"inline_keyboard": []}


async def test_telegram_a_message_marked_as_in_the_general_topic_is_the_chats_conversation(
    tmp_path: Path, telegram: FakeTelegram
) -> None:
    fake = telegram
    async with tg.running(tmp_path, fake, allow=[tg.ALICE]):
        in_forum(fake, tg.ALICE, "hello")
        await tg.until(lambda: texts_in(fake, None))
        in_forum(fake, tg.ALICE, "again", 1)  # (marked is_topic_message, thread 1: General)
        await tg.until(lambda: len(texts_in(fake, None)) == 2)
        assert texts_in(fake, None) == ["seen: hello", "seen: hello, again"]  # one conversation
        assert not [p for p in fake.sent("sendMessage") if "message_thread_id" in p]


async def test_a_network_error_quoting_the_address_does_not_carry_the_interaction_token() -> None:
    """The transport sees the address with the token in its path: an error of its that quotes it
    (a proxy's, a connection library's) must not carry the token into the raised message."""

    class Quoting(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            raise httpx.ConnectError(f"cannot reach {request.url}", request=request)

    token = "interaction-token-secret-123456"
    api = DiscordApi(dc.TOKEN, "http://discord.invalid/api/v10", backoff=(0.0, 0.0), transport=Quoting())
    try:
        for path in ("/interactions/1/***/callback", "/webhooks/2/***"):
            with pytest.raises(DiscordError) as failed:
                await api.request("POST", path, json={}, attempts=1, path_secret=token)
            assert "cannot reach http://discord.invalid/api/v10/" in str(failed.value)
            assert token not in str(failed.value)
    finally:
        await api.close()
