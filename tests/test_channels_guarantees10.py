"""Guarantees of the chat bridges that no test held before (round 10), each checked to fail when
the guarantee is taken out of the source:

- Discord's close gives an answer still on its way to Discord (an interaction answered on arrival)
  the close grace to get there, instead of cancelling it;
- a Discord press given up after ``TRIES`` failed takes says so, in a followup note only the
  presser sees (the command's branch is held by ``test_channels_review9``);
- Discord's ``_say``: a notice goes into the slash command's answer only when it is said by the
  task handling that command, for that command's channel, while it is handled; any other goes to
  its channel;
- Telegram: an animation kept as a GIF (``image/gif``, not converted to MP4) is taken as the image
  its document is, downloaded and shown to the model, not noted as a video;
- the bridges' shared ``media.video_attachment``: a video the message gives no type is MP4;
- WhatsApp (a fix): a notice said by input still being taken when the bridge closes ("Started a new
  conversation.", said as that input's handling ends, during the close's grace) is sent, not
  cancelled as soon as it is made: before, only the notices on their way when the close began
  were waited for.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentloop.channels import discord as discord_module
from agentloop.channels import whatsapp
from agentloop.channels.discord import EPHEMERAL, GIVEN_UP, HELP, DiscordBridge
from agentloop.channels.media import Attachment, video_attachment
from agentloop.messages import ImageContent, TextContent
from tests import test_channel_telegram as tg
from tests import test_channel_whatsapp as wa
from tests.image_support import gif
from tests.test_channel_discord import ALICE, ALICE_DM, BOB_DM, FakeDiscord, running, until
from tests.test_channel_media import FilesTelegram, b64, last_input
from tests.test_discord_presses8 import ask_alice, button, last_token

NO_MENTIONS = {"parse": []}
GIF = gif(48, 32)


class SlowCallbacks:
    """Discord's interaction callbacks, each held ``hold`` seconds before it is answered: an
    answer the bridge sends is still on its way when the test closes the bridge."""

    def __init__(self, fake: FakeDiscord, hold: float) -> None:
        self.hold = hold
        self.arrived = threading.Event()
        app = fake.server._server.config.app
        route = Route("/api/v10/interactions/{id}/{token}/callback", self.handle, methods=["POST"])
        app.router.routes.insert(0, route)  # (before the fake's own, which answers at once)

    async def handle(self, request: Request) -> Response:
        self.arrived.set()
        await asyncio.sleep(self.hold)
        return Response(status_code=204)


@pytest.fixture
def fake() -> Iterator[FakeDiscord]:
    with FakeDiscord() as discord:
        # Discord's followup messages (POST /webhooks/<application>/<token>), recorded as "follow_up"
        app = discord.server._server.config.app
        app.router.routes.append(Route("/api/v10/webhooks/{app}/{token}", discord.route("follow_up"), methods=["POST"]))
        yield discord


@pytest.fixture
def telegram() -> Iterator[FilesTelegram]:
    fake = FilesTelegram()
    with fake.server:
        yield fake


# ------------------------------------------------------------------------------- Discord


async def test_an_answer_on_its_way_when_the_bridge_closes_gets_there(tmp_path: Path, fake: FakeDiscord) -> None:
    slow = SlowCallbacks(fake, hold=0.5)  # (well inside bridge.CLOSE_GRACE)
    taken: list[tuple[str, str]] = []
    async with running(tmp_path, fake) as (_, bridge, _):
        request = bridge.api.request

        async def watched(method: str, path: str, **kw: Any) -> Any:
            answer = await request(method, path, **kw)
            taken.append((method, path))  # (only once Discord answered: not when cancelled on the way)
            return answer

        bridge.api.request = watched  # type: ignore[method-assign]
        fake.command(ALICE, "help", ALICE_DM)  # answered on arrival, outside the intake
        await until(slow.arrived.is_set)
        assert taken == []  # (still on its way: the bridge closes now)
    assert [method for method, path in taken if path.endswith("/callback")] == ["POST"]


async def test_a_press_given_up_says_so_in_a_note_only_the_presser_sees(
    tmp_path: Path, fake: FakeDiscord, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(self: DiscordBridge, chat: int | None, key: str, request_id: str) -> str:
        raise RuntimeError("the store is down")

    monkeypatch.setattr(discord_module, "TRIES", 2)
    async with running(tmp_path, fake, allow=[ALICE]) as (_, _, _):
        ask = await ask_alice(fake)
        monkeypatch.setattr(DiscordBridge, "_decide", broken)
        token = last_token(fake, ALICE)
        fake.press(ALICE, ask, button(ask, 0))  # Approve
        notes = await until(lambda: [c for c in fake.of("follow_up") if c.ok and c.params["token"] == token])
        assert [c.body for c in notes] == [{"content": GIVEN_UP, "flags": EPHEMERAL, "allowed_mentions": NO_MENTIONS}]
        assert fake.deferral(token) == discord_module.DEFERRED_UPDATE  # (the press was taken: it waited)
        assert fake.edit_of(token) is None and GIVEN_UP not in fake.texts(ALICE_DM)


async def test_a_notice_joins_a_commands_answer_only_from_its_task_and_for_its_channel(
    tmp_path: Path, fake: FakeDiscord
) -> None:
    async with running(tmp_path, fake) as (_, bridge, _):
        said: list[str] = []
        other = asyncio.create_task(asyncio.sleep(0))
        await other
        bridge._saying = (other, ALICE_DM, said)  # a command of ALICE_DM handled by another task
        await bridge._say(ALICE_DM, "from elsewhere")
        bridge._saying = (asyncio.current_task(), BOB_DM, said)  # this task's command is another channel's
        await bridge._say(ALICE_DM, "for another channel")
        bridge._saying = (asyncio.current_task(), ALICE_DM, said)
        await bridge._say(ALICE_DM, "for the command")
        bridge._saying = None
        await bridge._say(ALICE_DM, "no command")
        assert said == ["for the command"]
        assert fake.texts(ALICE_DM) == ["from elsewhere", "for another channel", "no command"]


async def test_once_a_slash_command_is_handled_the_channels_notices_go_to_the_channel_again(
    tmp_path: Path, fake: FakeDiscord
) -> None:
    """``/new``'s notice goes into its deferred response; ``!stop``'s, said next by the same task
    (the intake) in the same channel, goes to the channel, not into the answered command's."""
    async with running(tmp_path, fake, allow=[ALICE]) as (_, _, _):
        token = fake.command(ALICE, "new", ALICE_DM)
        fake.message(ALICE_DM, ALICE, "!help")
        fake.message(ALICE_DM, ALICE, "!stop")
        await until(lambda: fake.edit_of(token) and len(fake.texts(ALICE_DM)) == 2)
        assert fake.edit_of(token) == {"content": "Started a new conversation.", "allowed_mentions": NO_MENTIONS}
        assert fake.texts(ALICE_DM) == [HELP, "Nothing is running."]


# ------------------------------------------------------------------------------- Telegram


async def test_telegram_an_animation_kept_as_a_gif_is_the_image_of_its_document(
    tmp_path: Path, telegram: FilesTelegram
) -> None:
    animation = {"file_id": "g1", "file_unique_id": "ug", "duration": 1, "width": 48, "height": 32}
    animation |= {"file_name": "wave.gif", "mime_type": "image/gif", "file_size": len(GIF)}
    document = {"file_id": "g1", "file_unique_id": "ug", "file_name": "wave.gif", "mime_type": "image/gif"}
    document["file_size"] = len(GIF)
    telegram.file("g1", "animations/file_1.gif", GIF, len(GIF))
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE]) as (_, _, model):
        telegram.media(tg.ALICE, tg.ALICE, animation=animation, document=document, caption="hi!")
        await until(lambda: telegram.texts(tg.ALICE))
        assert last_input(model).content == [
            TextContent(text="hi!"),
            ImageContent(data=b64(GIF), mime_type="image/gif"),
        ]
        assert [c.params["file_id"] for c in telegram.of("getFile")] == ["g1"]
        assert telegram.downloads == ["animations/file_1.gif"]


# ------------------------------------------------------------------------------- the shared part


def test_a_video_the_message_gives_no_type_is_mp4_and_its_name_is_shown_clean() -> None:
    assert video_attachment(None, None, "the video message", 10, "v") == Attachment(
        "video", "video/mp4", "", "the video message", 10, "v"
    )
    assert video_attachment("video/quicktime; x=1", "a\nclip.mov", "the video", None, "r") == Attachment(
        "video", "video/quicktime", "aclip.mov", "the video", None, "r"
    )


# ------------------------------------------------------------------------------- WhatsApp


@pytest.fixture
def graph() -> Iterator[wa.FakeGraph]:
    fake = wa.FakeGraph()
    with fake.server:
        yield fake


async def test_whatsapp_a_notice_said_while_the_bridge_closes_is_still_sent(
    tmp_path: Path, graph: wa.FakeGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(whatsapp, "INTAKE_WAIT", 0.1)  # (the webhook answers; the /new goes on)
    reset = whatsapp.WhatsAppBridge._reset
    resetting = asyncio.Event()

    async def slow_reset(self: whatsapp.WhatsAppBridge, chat: str) -> None:
        resetting.set()
        await asyncio.sleep(0.4)  # (the close begins meanwhile)
        await reset(self, chat)

    monkeypatch.setattr(whatsapp.WhatsAppBridge, "_reset", slow_reset)
    async with wa.running(tmp_path, graph, allow=[wa.ALICE]) as (_, bridge, _, meta):
        send = bridge.api.send

        async def slow_send(message: dict[str, Any], **kw: Any) -> Any:
            await asyncio.sleep(0.2)  # (on its way while the close goes on)
            return await send(message, **kw)

        bridge.api.send = slow_send  # type: ignore[method-assign]
        await meta.text(wa.ALICE, "/new")
        await resetting.wait()
    assert graph.texts(wa.ALICE) == ["Started a new conversation."]
