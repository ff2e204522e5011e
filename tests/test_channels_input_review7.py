"""Review of the chat bridges' handling of odd input and misbehaving apps: one regression test per
problem found (each failed before its fix). Runs against the fakes of ``test_channel_telegram``
and ``test_channel_discord``."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop.channels.media import UNSUPPORTED
from agentloop.channels.telegram import CHAT_KEY
from tests import test_channel_discord as dc
from tests import test_channel_telegram as tg
from tests import test_channel_whatsapp as wa
from tests.test_channel_discord import FakeDiscord
from tests.test_channel_telegram import FakeTelegram
from tests.test_channel_whatsapp import FakeGraph

GROUP, SUPERGROUP = -4100, -1004100  # a group's chat id, and the one it has once it is a supergroup


@pytest.fixture
def fake() -> Iterator[FakeTelegram]:
    telegram = FakeTelegram()
    with telegram.server:
        yield telegram


def said(fake: FakeTelegram, chat: int, user: int, **content: Any) -> int:
    """A message of ``user`` in ``chat`` holding ``content`` (no text unless it says so)."""
    sender = {"id": user, "is_bot": False, "first_name": f"User{user}"}
    kind = "private" if chat > 0 else "group"
    return fake.add({"message": {"message_id": 7, "from": sender, "chat": {"id": chat, "type": kind}, **content}})


# ------------------------------------------------ Telegram: a service message is not a user's message


async def test_telegram_service_messages_are_not_answered_as_unsupported_files(
    tmp_path: Path, fake: FakeTelegram
) -> None:
    """A message with no text and no file was answered ``UNSUPPORTED`` ("voice messages, audio,
    video … are not supported"), service messages too: a user who pinned a message or set the
    chat's auto-delete timer was told their "file" is not supported, and a stranger joining a
    group the bot is in was told the bot is private."""
    chat = {"id": tg.ALICE, "type": "private"}
    async with tg.running(tmp_path, fake, allow=[tg.ALICE]) as (kernel, bridge, model):
        said(fake, tg.ALICE, tg.ALICE, pinned_message={"message_id": 3, "chat": chat, "date": 0, "text": "x"})
        said(fake, tg.ALICE, tg.ALICE, message_auto_delete_timer_changed={"message_auto_delete_time": 86400})
        said(fake, GROUP, tg.MALLORY, new_chat_members=[{"id": tg.MALLORY, "is_bot": False, "first_name": "M"}])
        said(fake, tg.ALICE, tg.ALICE, location={"latitude": 1.5, "longitude": 2.5})  # (a user's: answered)
        last = fake.message(chat=tg.ALICE, user=tg.ALICE, text="hello")
        await tg.until(lambda: bridge.state.offset == last + 1 and len(fake.texts(tg.ALICE)) == 2)
        await asyncio.sleep(0.1)
        assert fake.texts(tg.ALICE) == [UNSUPPORTED, "seen: hello"]
        assert fake.texts(GROUP) == []
        assert tg.user_texts(model) == ["hello"] and len(await kernel.processes()) == 1


# ------------------------------------------- Telegram: update ids numbered afresh after a quiet week


class RenumberedTelegram(FakeTelegram):
    """Telegram after a week without updates: it numbers them afresh from a random id (here lower
    than the bridge's offset), and an offset past every id it gave out confirms nothing: it
    answers what is pending (as go-telegram-bot-api#156 logs it)."""

    async def result(self, method: str, params: dict[str, Any], entry: Any) -> Any:
        if method == "getUpdates":
            with self.lock:
                issued = max((u["update_id"] for u in self.updates), default=0)
            if int(params.get("offset") or 0) > issued + 1:
                params = {**params, "offset": 0}
        return await super().result(method, params, entry)


async def test_telegram_update_ids_numbered_afresh_below_the_offset_are_taken(tmp_path: Path) -> None:
    """An update whose id is below the offset was taken for one handled already: skipped without
    the offset moving, so Telegram gave it again, for ever, and every message after it too (the
    bot was deaf until its state file was deleted)."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "4242.json").write_text(json.dumps({"offset": 727334708, "seqs": {}}))
    fake = RenumberedTelegram()
    with fake.server:
        async with tg.running(tmp_path, fake, state_dir=state) as (_, bridge, _):
            fake.message(chat=tg.ALICE, user=tg.ALICE, text="hello", update_id=117314199)
            await tg.until(lambda: fake.texts(tg.ALICE), seconds=3.0)
            fake.message(chat=tg.ALICE, user=tg.ALICE, text="again", update_id=117314200)
            await tg.until(lambda: len(fake.texts(tg.ALICE)) == 2, seconds=3.0)
            assert fake.texts(tg.ALICE) == ["seen: hello", "seen: hello, again"]
            assert bridge.state.offset == 117314201


# ------------------------------------------- Telegram: a group that became a supergroup keeps its answers


async def test_telegram_an_answer_to_a_group_that_became_a_supergroup_is_sent_there(
    tmp_path: Path, fake: FakeTelegram
) -> None:
    """A send to a group that was upgraded is refused with 400 and ``migrate_to_chat_id``: it was a
    permanent error, so the answer was dropped, and the group's process stayed bound to the old
    id (the next message, from the supergroup, began a new conversation)."""
    async with tg.running(tmp_path, fake, allow=[tg.ALICE]) as (kernel, bridge, _):
        moved = {"error_code": 400, "description": "Bad Request: group chat was upgraded to a supergroup chat"}
        fake.fail("sendMessage", (400, {"ok": False, **moved, "parameters": {"migrate_to_chat_id": SUPERGROUP}}))
        fake.message(chat=GROUP, user=tg.ALICE, text="hi")
        await tg.until(lambda: fake.texts(SUPERGROUP))
        assert fake.texts(SUPERGROUP) == ["seen: hi"] and fake.texts(GROUP) == []
        [proc] = await kernel.processes()
        assert await kernel.store.kv_get(proc.pid, CHAT_KEY) == f"{bridge.bot_id}:{SUPERGROUP}"
        fake.message(chat=SUPERGROUP, user=tg.ALICE, text="again")  # the same conversation, there
        await tg.until(lambda: len(fake.texts(SUPERGROUP)) == 2)
        assert fake.texts(SUPERGROUP)[1] == "seen: hi, again" and len(await kernel.processes()) == 1


async def test_telegram_the_upgrade_service_message_moves_the_groups_conversation(
    tmp_path: Path, fake: FakeTelegram
) -> None:
    """Telegram tells of the upgrade in the group (``migrate_to_chat_id``): the next message, from
    the supergroup, goes on with the group's process (before: a new process, the conversation lost,
    and the service message answered ``UNSUPPORTED`` in a chat that no longer takes messages)."""
    async with tg.running(tmp_path, fake, allow=[tg.ALICE]) as (kernel, _, _):
        fake.message(chat=GROUP, user=tg.ALICE, text="before")
        await tg.until(lambda: fake.texts(GROUP))
        said(fake, GROUP, tg.ALICE, migrate_to_chat_id=SUPERGROUP)
        fake.message(chat=SUPERGROUP, user=tg.ALICE, text="after")
        await tg.until(lambda: fake.texts(SUPERGROUP))
        assert fake.texts(SUPERGROUP) == ["seen: before, after"] and fake.texts(GROUP) == ["seen: before"]
        assert len(await kernel.processes()) == 1


# --------------------------------------------- Discord: a resume address that cannot be reached


async def test_discord_a_resume_address_that_cannot_be_reached_falls_back_to_the_main_gateway(
    tmp_path: Path,
) -> None:
    """After a drop the bridge resumed at the session's ``resume_gateway_url`` and, when that
    failed, tried it again for ever: a resume host that is down (or an address that is no
    gateway) kept the bot offline until it was restarted, though the main gateway was up."""
    with FakeDiscord() as fake:
        async with dc.running(tmp_path, fake) as (_, bridge, _):
            fake.message(dc.ALICE_DM, dc.ALICE, "hello")
            await dc.until(lambda: fake.texts(dc.ALICE_DM))
            bridge._resume_url = "ws://127.0.0.1:1/resume"  # (nothing listens there)
            fake.gateway.drop()
            [(n, resume)] = await dc.until(lambda: fake.gateway.sent(6), seconds=4.0)
            assert n == 1 and fake.gateway.connections[1].path == "/?v=10&encoding=json"
            assert resume["d"]["session_id"] == "session-1" and len(fake.gateway.sent(2)) == 1
            fake.message(dc.ALICE_DM, dc.ALICE, "still here")
            await dc.until(lambda: len(fake.texts(dc.ALICE_DM)) == 2)
            assert fake.texts(dc.ALICE_DM)[1] == "seen: hello, still here"


# ------------------------------------------------------------ Discord: a forwarded message


async def test_discord_a_forwarded_message_reaches_the_agent_instead_of_the_help(tmp_path: Path) -> None:
    """A forward comes with no content of its own: Discord puts the forwarded message in
    ``message_snapshots``. The bridge read only ``content``, found it empty and answered the help
    text: what the user forwarded never reached the agent (and a forwarded "!new" is not a command
    of theirs)."""
    with FakeDiscord() as fake:
        async with dc.running(tmp_path, fake) as (_, _, model):
            for words in ("the forwarded words", "!new"):
                event = fake.message(dc.ALICE_DM, dc.ALICE, "", live=False)
                event["message_reference"] = {"type": 1, "channel_id": "77", "message_id": "78"}
                event["message_snapshots"] = [{"message": {"content": words, "attachments": [], "type": 0}}]
                fake.gateway.dispatch("MESSAGE_CREATE", event)
            await dc.until(lambda: len(fake.texts(dc.ALICE_DM)) == 2)
            assert fake.texts(dc.ALICE_DM) == ["seen: the forwarded words", "seen: the forwarded words, !new"]
            assert dc.user_texts(model) == ["the forwarded words", "!new"]


# ------------------------------------------------ WhatsApp: an answer Graph took but could not deliver


async def test_whatsapp_an_answer_graph_could_not_deliver_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Graph answers a send 200 before it delivers it; a failure (the 24-hour window closed, the
    number cannot receive it) comes later as a ``failed`` status, which the bridge dropped without a
    word: the answer was lost and no log line said so."""
    graph = FakeGraph()
    error = {
        "code": 131047,
        "title": "Re-engagement message",
        "error_data": {"details": "more than 24 hours have passed since the customer last replied"},
    }
    failed = {"id": "wamid.o7", "status": "failed", "timestamp": "1", "recipient_id": wa.ALICE, "errors": [error]}
    delivered = {**failed, "id": "wamid.o8", "status": "delivered", "errors": []}
    with graph.server:
        async with wa.running(tmp_path, graph) as (_, _, _, meta):
            notification = wa.notify(statuses=[failed, delivered])
            with caplog.at_level(logging.INFO, logger="agentloop.channels.whatsapp"):
                response = await meta.post(notification)
    assert response.status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "agentloop.channels.whatsapp"]
    [line] = [x for x in lines if "could not deliver" in x]
    assert "wamid.o7" in line and wa.ALICE in line and "Re-engagement message" in line and "131047" in line
    assert not any("wamid.o8" in x for x in lines)
