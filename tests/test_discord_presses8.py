"""Discord approval button presses acknowledged on arrival.

A press waits its turn behind the messages before it (an attachment being downloaded …), but
Discord drops an interaction not answered within 3 seconds: an approval answer gets a deferred
update (type 6) as it arrives, is decided in its turn, and the pressed message is then edited
(``PATCH …/messages/@original``) to show the outcome without its buttons. A stranger's press and a
press on a request no longer pending are answered at once; a failed deferral falls back to the
update in the response (type 7), a failed edit to the outcome told in the channel.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop.channels.discord import EPHEMERAL
from tests import test_channel_discord as dc
from tests.test_channel_discord import ALICE, ALICE_DM, BOB, BOB_DM, MALLORY, FakeDiscord, running, until
from tests.test_discord_cli_polish8 import SlowCdn, post_image, response

NO_MENTIONS = {"parse": []}


@pytest.fixture
def fake() -> Iterator[FakeDiscord]:
    with FakeDiscord() as discord:
        yield discord


@pytest.fixture
def cdn() -> Iterator[SlowCdn]:
    slow = SlowCdn()
    with slow.server:
        yield slow
        slow.release.set()


def last_token(fake: FakeDiscord, user: int) -> str:
    """The token of ``user``'s latest press (``FakeDiscord.press`` names it by the calls so far)."""
    return f"interaction-token-{user}-{len(fake.calls)}"


async def ask_alice(fake: FakeDiscord) -> dict[str, Any]:
    fake.message(ALICE_DM, ALICE, "delete")
    [ask] = await until(lambda: [m for m in fake.posted(ALICE_DM) if m["components"]])
    return ask


def button(ask: dict[str, Any], n: int) -> str:
    return str(ask["components"][0]["components"][n]["custom_id"])


async def test_a_press_behind_a_slow_download_is_acknowledged_at_once_then_its_message_edited(
    tmp_path: Path, fake: FakeDiscord, cdn: SlowCdn
) -> None:
    dc.removed.clear()
    async with running(tmp_path, fake, attachment_urls=(cdn.base,)) as (_, _, _):
        ask = await ask_alice(fake)
        post_image(fake, cdn, BOB_DM, BOB, "look")  # (another channel's, but the same intake)
        await until(cdn.asked.is_set)  # the intake is held by the download
        pressed = time.monotonic()
        token = last_token(fake, ALICE)
        fake.press(ALICE, ask, button(ask, 0))  # Approve
        stranger = last_token(fake, MALLORY)
        fake.press(MALLORY, ask, button(ask, 0))
        await until(lambda: response(fake, token) and response(fake, stranger))
        deferred = response(fake, token)
        assert deferred is not None and deferred.body == {"type": 6} and deferred.at - pressed < 3.0
        refused = response(fake, stranger)
        assert refused is not None and refused.at - pressed < 3.0
        assert refused.body["data"] == {
            "content": "You are not allowed to answer this.",
            "flags": EPHEMERAL,
            "allowed_mentions": NO_MENTIONS,
        }
        assert fake.edit_of(token) is None and dc.removed == []  # (still behind the download)

        cdn.release.set()
        await until(lambda: "tool said: removed x" in fake.texts(ALICE_DM))
        assert dc.removed == ["x"]  # the approval took effect
        edit = await until(lambda: fake.edit_of(token))
        assert edit == {
            "content": ask["content"] + "\n\n✅ Approved by User100",
            "components": [],  # the buttons are gone
            "allowed_mentions": NO_MENTIONS,
        }
        [call] = [c for c in fake.of("edit_original") if c.params["token"] == token]
        assert call.params["app"] == str(dc.BOT)
        assert len([c for c in fake.of("callback") if c.params["token"] == token]) == 1  # (no type 7 besides)

        again = last_token(fake, ALICE)
        fake.press(ALICE, ask, button(ask, 0))  # no longer pending: told at once, nothing deferred
        await until(lambda: response(fake, again))
        assert response(fake, again).body["data"]["content"] == "This request is no longer pending."  # type: ignore[union-attr]


async def test_a_failed_deferral_updates_in_the_response_and_a_failed_edit_tells_the_channel(
    tmp_path: Path, fake: FakeDiscord
) -> None:
    dc.removed.clear()
    async with running(tmp_path, fake, allow=[ALICE]) as (_, _, _):
        ask = await ask_alice(fake)
        fake.fail("callback", (404, {"message": "Unknown interaction", "code": 10062}))  # the deferral
        token = last_token(fake, ALICE)
        fake.press(ALICE, ask, button(ask, 1))  # Deny
        await until(lambda: response(fake, token))
        assert response(fake, token).body == {  # type: ignore[union-attr]
            "type": 7,
            "data": {
                "content": ask["content"] + "\n\n❌ Denied by User100",
                "components": [],
                "allowed_mentions": NO_MENTIONS,
            },
        }
        assert fake.of("edit_original") == []
        await until(lambda: any("denied" in t for t in fake.texts(ALICE_DM)))

        fake.message(ALICE_DM, ALICE, "delete")
        [ask] = await until(lambda: [m for m in fake.posted(ALICE_DM) if m["components"]][1:])
        fake.fail("edit_original", (404, {"message": "Unknown Webhook", "code": 10015}))
        token = last_token(fake, ALICE)
        fake.press(ALICE, ask, button(ask, 0))  # Approve
        await until(lambda: "✅ Approved by User100" in fake.texts(ALICE_DM))
        assert response(fake, token).body == {"type": 6}  # type: ignore[union-attr]
        assert fake.edit_of(token) is None
        await until(lambda: "tool said: removed x" in fake.texts(ALICE_DM))
        assert dc.removed == ["x"]
