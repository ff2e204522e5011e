"""Discord's catch-up given up (round 11), checked to fail before its fix.

A catch-up that fails ``TRIES`` times (Discord's API or the store failing) was given up for good:
the next live message handled in its channel moved the channel's mark past the messages the
catch-up never read, which were then never answered. Now the mark stays where the catch-up
stopped, the catch-up is tried again later (with back-off; and at the next session or start), and
a message handled live meanwhile is not handled again when the catch-up reads it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop.channels import bridge as chat_bridge
from agentloop.channels.discord import HELP, TRIES, DiscordBridge
from agentloop.kernel import Kernel
from agentloop.messages import UserMessage
from tests.test_channel_discord import ALICE, ALICE_DM, BOT, FakeDiscord, running, until

STATE = Path("var") / "discord" / f"{BOT}.json"
FAILING = (503, {"message": "Service Unavailable", "code": 0})
WAIT = 15.0  # seconds: generous, a given-up catch-up takes ``TRIES`` tries with back-off


@pytest.fixture
def fake() -> Iterator[FakeDiscord]:
    with FakeDiscord() as discord:
        yield discord


def saved(tmp_path: Path) -> dict[str, Any]:
    return dict(json.loads((tmp_path / STATE).read_text()))


def saved_mark(tmp_path: Path) -> int:
    return int(saved(tmp_path)["last"][str(ALICE_DM)])


def break_catch_ups(fake: FakeDiscord) -> None:
    """Every read of a channel's messages fails (a transient 503) until ``mend``."""
    fake.fail("messages", *[FAILING] * 10_000)


def mend(fake: FakeDiscord) -> None:
    with fake.lock:
        fake.failures.pop("messages", None)


async def said_to(kernel: Kernel) -> list[str]:
    """What the channel's process was told, in order."""
    [proc] = await kernel.processes()
    return [m.text for m in await (await kernel.process(proc.pid)).messages() if isinstance(m, UserMessage)]


async def known(tmp_path: Path, fake: FakeDiscord) -> int:
    """A first session, in which Alice says hello (the channel is then known): its message id."""
    async with running(tmp_path, fake, allow=[ALICE]) as (_, bridge, _):
        hello = fake.message(ALICE_DM, ALICE, "hello")
        await until(lambda: bridge.state.last.get(ALICE_DM) == int(hello["id"]))
        await until(lambda: fake.texts(ALICE_DM))
    return int(hello["id"])


def logged(caplog: pytest.LogCaptureFixture, words: str) -> bool:
    return any(words in r.getMessage() for r in caplog.records)


async def given_up_then_live(
    tmp_path: Path, fake: FakeDiscord, bridge: DiscordBridge, mark: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Once the session's catch-up was given up, Alice says "live" and "!help": both are answered
    at once, and the mark stays where the catch-up stopped. The two messages."""
    await until(lambda: len(fake.of("messages")) >= 3 * TRIES, WAIT)  # (three reads a try)
    live = fake.message(ALICE_DM, ALICE, "live")
    helped = fake.message(ALICE_DM, ALICE, "!help")
    await until(lambda: HELP in fake.texts(ALICE_DM), WAIT)
    await until(lambda: any(t.endswith("live") for t in fake.texts(ALICE_DM)), WAIT)
    assert bridge.state.last[ALICE_DM] == mark and saved_mark(tmp_path) == mark  # not over the unread ones
    return live, helped


async def test_a_given_up_catch_up_is_tried_again_and_hands_over_what_it_missed_once(
    tmp_path: Path, fake: FakeDiscord, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agentloop.channels.discord")
    mark = await known(tmp_path, fake)
    fake.message(ALICE_DM, ALICE, "missed one", live=False)
    fake.message(ALICE_DM, ALICE, "missed two", live=False)
    break_catch_ups(fake)
    async with running(tmp_path, fake, allow=[ALICE]) as (kernel, bridge, _):
        _, helped = await given_up_then_live(tmp_path, fake, bridge, mark)
        mend(fake)  # the next try of the catch-up (with back-off) reads what it missed
        await until(lambda: bridge.state.last[ALICE_DM] >= int(helped["id"]), WAIT)
        await until(lambda: saved_mark(tmp_path) >= int(helped["id"]), WAIT)
        await until(lambda: sum(t.endswith("missed two") for t in fake.texts(ALICE_DM)), WAIT)
        told = await said_to(kernel)
        assert sorted(told) == ["hello", "live", "missed one", "missed two"]  # each once
        assert told.index("missed one") < told.index("missed two")
        assert fake.texts(ALICE_DM).count(HELP) == 1  # the live "!help", read again, not answered again
        assert logged(caplog, "catching up given up") and logged(caplog, "catching up again")
        # caught up: a live message moves the mark at once again
        after = fake.message(ALICE_DM, ALICE, "after")
        await until(lambda: saved_mark(tmp_path) == int(after["id"]), WAIT)
        assert "taken" not in saved(tmp_path)


async def test_a_restart_catches_up_what_a_given_up_catch_up_missed_and_not_what_was_handled_live(
    tmp_path: Path, fake: FakeDiscord, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chat_bridge, "CLOSE_GRACE", 0.2)  # (the close cuts off a catch-up failing again)
    mark = await known(tmp_path, fake)
    fake.message(ALICE_DM, ALICE, "missed one", live=False)
    break_catch_ups(fake)
    async with running(tmp_path, fake, allow=[ALICE]) as (_, bridge, _):
        _, helped = await given_up_then_live(tmp_path, fake, bridge, mark)
    assert saved_mark(tmp_path) == mark
    mend(fake)
    async with running(tmp_path, fake, allow=[ALICE]) as (kernel, bridge, _):
        await until(lambda: saved_mark(tmp_path) >= int(helped["id"]), WAIT)
        await until(lambda: any(t.endswith("missed one") for t in fake.texts(ALICE_DM)), WAIT)
        assert sorted(await said_to(kernel)) == ["hello", "live", "missed one"]  # each once
        assert fake.texts(ALICE_DM).count(HELP) == 1  # (the file kept it: not answered again)
        assert "taken" not in saved(tmp_path)


async def test_a_catch_up_that_recovers_within_its_tries_moves_the_marks_as_before(
    tmp_path: Path, fake: FakeDiscord, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agentloop.channels.discord")
    await known(tmp_path, fake)
    missed = fake.message(ALICE_DM, ALICE, "missed", live=False)
    fake.fail("messages", *[FAILING] * 4)  # (two of the catch-up's tries)
    async with running(tmp_path, fake, allow=[ALICE]) as (kernel, bridge, _):
        await until(lambda: bridge.state.last.get(ALICE_DM, 0) >= int(missed["id"]), WAIT)
        live = fake.message(ALICE_DM, ALICE, "live")
        await until(lambda: saved_mark(tmp_path) == int(live["id"]), WAIT)  # a live message moves it at once
        await until(lambda: any(t.endswith("live") for t in fake.texts(ALICE_DM)), WAIT)
        assert await said_to(kernel) == ["hello", "missed", "live"]
        reads = len(fake.of("messages"))
        await asyncio.sleep(0.5)
        assert len(fake.of("messages")) == reads  # no catch-up tried again
    assert not logged(caplog, "given up") and not logged(caplog, "catching up again")
    assert "taken" not in saved(tmp_path)
