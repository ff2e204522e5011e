"""The Discord bridge's slash commands (/new, /stop, /help) against the fake Discord.

They are registered as the application's global commands with one bulk overwrite, only when what
is registered differs; their interactions do what the ``!`` commands do, for the same users,
answered in the interaction's response; a failure to register leaves the bridge running.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agentloop.channels.discord import COMMANDS, EPHEMERAL, HELP, commands_differ
from tests import test_channel_discord as dc
from tests.test_channel_discord import (
    ALICE,
    ALICE_DM,
    BOT,
    GENERAL,
    GUILD,
    MALLORY,
    FakeDiscord,
    fake,  # noqa: F401  (the fixture)
    running,
    until,
)

NAMES = {"new", "stop", "help"}


def names(commands: list[dict[str, object]]) -> set[object]:
    return {c["name"] for c in commands}


async def test_the_commands_are_registered_once_and_a_restart_rewrites_nothing(
    tmp_path: Path,
    fake: FakeDiscord,  # noqa: F811
) -> None:
    async with running(tmp_path, fake) as (_, bridge, _):
        await until(lambda: fake.of("put_commands"))
        await until(lambda: bridge._registration is not None and bridge._registration.done())
        [put] = fake.of("put_commands")
        assert put.params["app"] == str(BOT) and names(put.body) == NAMES
        assert all(c["type"] == 1 and c["description"] and c["contexts"] == [0, 1] for c in put.body)
        assert [c.route for c in fake.of("commands")] == ["commands"]  # read first
    assert names(fake.commands[BOT]) == NAMES and not commands_differ(fake.commands[BOT])

    async with running(tmp_path, fake) as (_, bridge, _):  # a restart: the same set is there already
        await until(lambda: len(fake.of("commands")) == 2)
        await until(lambda: bridge._registration is not None and bridge._registration.done())
        registration, sessions = bridge._registration, len(fake.gateway.sessions)
        fake.gateway.op(9, False)  # a new session, and its READY, registers nothing again
        await until(lambda: bridge._session_id == f"session-{sessions + 1}")
        assert bridge._registration is registration
        assert len(fake.of("put_commands")) == 1 and len(fake.of("commands")) == 2


async def test_a_different_set_is_overwritten_for_readys_application(
    tmp_path: Path,
    fake: FakeDiscord,  # noqa: F811
) -> None:
    app = 31337  # (an older bot's application id is not its user id: READY names it)
    fake.gateway.application = app
    old = [{"name": "ask", "description": "Ask"}, {**COMMANDS[0], "description": "Reset"}]
    fake.commands[app] = [fake.registered(app, n, c) for n, c in enumerate(old)]
    assert commands_differ(fake.commands[app])
    async with running(tmp_path, fake) as (_, bridge, _):
        await until(lambda: fake.of("put_commands"))
        [put] = fake.of("put_commands")
        assert put.params["app"] == str(app) and put.body == list(COMMANDS)
        assert bridge.application_id == app
    assert names(fake.commands[app]) == NAMES and BOT not in fake.commands
    # what differs: a name missing or extra, a description, the contexts, options (the order does not)
    kept = [fake.registered(app, n, c) for n, c in enumerate(reversed(COMMANDS))]
    assert not commands_differ(kept)
    assert commands_differ(kept[:2]) and commands_differ([*kept, {"name": "ask"}])
    assert commands_differ([{**kept[0], "contexts": [0, 1, 2]}, *kept[1:]])
    assert commands_differ([{**kept[0], "options": [{"name": "x"}]}, *kept[1:]])
    assert commands_differ(None) and commands_differ({"message": "?"})


async def test_each_command_works_from_a_dm_and_from_a_server_channel(
    tmp_path: Path,
    fake: FakeDiscord,  # noqa: F811
) -> None:
    dc.gate.clear()
    async with running(tmp_path, fake, allow=[ALICE]) as (kernel, _, _):
        for channel, guild in ((ALICE_DM, None), (GENERAL, GUILD)):
            token = fake.command(ALICE, "help", channel, guild=guild)
            await until(lambda t=token: fake.answer_to(t))
            assert fake.answer_to(token) == {
                "type": 4,
                "data": {"content": HELP, "flags": EPHEMERAL, "allowed_mentions": {"parse": []}},
            }
            token = fake.command(ALICE, "stop", channel, guild=guild)
            await until(lambda t=token: fake.answer_to(t))
            assert fake.answer_to(token)["data"]["content"] == "Nothing is running."  # type: ignore[index]

        # a conversation in each channel, then /new resets that channel's process only
        fake.message(ALICE_DM, ALICE, "hello")
        fake.message(GENERAL, ALICE, f"<@{BOT}> hi there", guild=GUILD, mentions=(BOT,))
        await until(lambda: fake.texts(ALICE_DM)[-1:] == ["seen: hello"])
        await until(lambda: fake.texts(GENERAL)[-1:] == ["seen: hi there"])
        pids = {int(v.split(":")[1]): pid for pid, v in (await kernel.store.kv_values(dc.CHAT_KEY, None)).items()}
        token = fake.command(ALICE, "new", GENERAL, guild=GUILD)
        await until(lambda: fake.answer_to(token))
        started = {"content": "Started a new conversation.", "allowed_mentions": {"parse": []}}
        assert fake.answer_to(token) == {"type": 4, "data": started}  # (seen by all: as !new's answer)
        assert await (await kernel.process(pids[GENERAL])).messages() == []
        assert await (await kernel.process(pids[ALICE_DM])).messages() != []
        token = fake.command(ALICE, "new", ALICE_DM)
        await until(lambda: fake.answer_to(token))
        assert await (await kernel.process(pids[ALICE_DM])).messages() == []
        fake.message(ALICE_DM, ALICE, "fresh")
        await until(lambda: fake.texts(ALICE_DM)[-1:] == ["seen: fresh"])

        # /stop aborts the run under way, in a DM and in a server channel
        for channel, guild, words in ((ALICE_DM, None, "gate"), (GENERAL, GUILD, f"<@{BOT}> gate")):
            typed = len(fake.of("typing"))
            fake.message(channel, ALICE, words, guild=guild, mentions=(BOT,) if guild else ())
            await until(lambda n=typed: len(fake.of("typing")) > n)  # its run started
            token = fake.command(ALICE, "stop", channel, guild=guild)
            await until(lambda c=channel: "Stopped." in fake.texts(c))
            answer = fake.answer_to(token)
            assert answer is not None and answer["data"]["flags"] == EPHEMERAL
        assert len(await kernel.processes()) == 2  # the commands spawned nothing
        assert "Stopped." not in fake.texts(ALICE_DM)[:-1] and "Nothing is running." not in fake.texts(GENERAL)

        # !new, !stop and !help work as before
        fake.message(ALICE_DM, ALICE, "!help")
        await until(lambda: fake.texts(ALICE_DM)[-1:] == [HELP])
        fake.message(ALICE_DM, ALICE, "!stop")
        await until(lambda: fake.texts(ALICE_DM)[-1:] == ["Nothing is running."])
        fake.message(ALICE_DM, ALICE, "!new")
        await until(lambda: fake.texts(ALICE_DM)[-1:] == ["Started a new conversation."])


async def test_a_stranger_is_refused_and_changes_nothing(
    tmp_path: Path,
    fake: FakeDiscord,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="agentloop.channels")
    async with running(tmp_path, fake, allow=[ALICE]) as (kernel, _, _):
        fake.message(GENERAL, ALICE, f"<@{BOT}> hello", guild=GUILD, mentions=(BOT,))
        await until(lambda: fake.texts(GENERAL)[-1:] == ["seen: hello"])
        [record] = await kernel.processes()
        for name, channel, guild in (("new", GENERAL, GUILD), ("stop", GENERAL, GUILD), ("help", dc.MALLORY_DM, None)):
            token = fake.command(MALLORY, name, channel, guild=guild)
            await until(lambda t=token: fake.answer_to(t))
            data = fake.answer_to(token)["data"]  # type: ignore[index]
            assert data["flags"] == EPHEMERAL and data["content"].startswith("Sorry, this bot is private.")
            assert str(MALLORY) in data["content"]
        assert [r.pid for r in await kernel.processes()] == [record.pid]
        assert await (await kernel.process(record.pid)).messages() != []  # not reset
        assert fake.texts(GENERAL) == ["seen: hello"] and fake.texts(dc.MALLORY_DM) == []
    assert "refused the command /new from Discord user 999" in caplog.text


@pytest.mark.parametrize("failure", ["403", "network"])
async def test_a_registration_failure_leaves_the_bridge_running(
    tmp_path: Path,
    fake: FakeDiscord,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
    failure: str,
) -> None:
    caplog.set_level(logging.INFO, logger="agentloop.channels")
    if failure == "403":
        fake.fail("put_commands", (403, {"message": "Missing Access", "code": 50001}))
    else:
        fake.fail("commands", *[(502, {"message": "bad gateway"})] * 3)
    async with running(tmp_path, fake, allow=[ALICE]) as (_, bridge, _):
        await until(lambda: bridge._registration is not None and bridge._registration.done())
        assert "the slash commands are not registered" in caplog.text
        assert BOT not in fake.commands
        fake.message(ALICE_DM, ALICE, "!help")
        await until(lambda: fake.texts(ALICE_DM)[-1:] == [HELP])
        fake.message(ALICE_DM, ALICE, "hello")
        await until(lambda: fake.texts(ALICE_DM)[-1:] == ["seen: hello"])
        token = fake.command(ALICE, "new", ALICE_DM)  # (registered before, say: still answered)
        await until(lambda: fake.answer_to(token))
        assert bridge._gateway is not None and not bridge._gateway.done()
    assert dc.TOKEN not in caplog.text
