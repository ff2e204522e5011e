"""An answer a chat app refuses for good is noted in the process, once, without a run of its own.

Before, a bridge whose send failed permanently (the user blocked the bot, the channel is gone)
logged it and dropped the text: neither the model (on its next turn) nor anyone reading the
history knew the user never saw the answer. Now the shared bridge layer records a system note
(``Kernel.note``: a message in the history that starts no run) naming the chat, the run's answer
and why it failed; once per run, never with a secret. A send that fails only for a while and is
retried into success notes nothing. Run against the local fakes of Telegram's Bot API and
Discord (its REST API and gateway) the channel tests use.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from agentloop import ScriptedModel
from agentloop.kernel import Kernel, Process, RunActive
from agentloop.messages import SystemMessage
from agentloop.process import signals as sig
from tests.test_channel_discord import ALICE_DM, FakeDiscord
from tests.test_channel_discord import SECRET as DISCORD_SECRET
from tests.test_channel_discord import TOKEN as DISCORD_TOKEN
from tests.test_channel_discord import running as discord_running
from tests.test_channel_telegram import (
    ALICE,
    SECRET,
    TOKEN,
    FakeTelegram,
    brain,
    gate,
    open_kernel,
    running,
    until,
    user_texts,
)

NOTE = "Automatic reply delivery failed"
BLOCKED = (403, {"ok": False, "error_code": 403, "description": "Forbidden: bot was blocked by the user"})


@pytest.fixture
def telegram() -> Iterator[FakeTelegram]:
    fake = FakeTelegram()
    with fake.server:
        yield fake


@pytest.fixture
def discord() -> Iterator[FakeDiscord]:
    with FakeDiscord() as fake:
        yield fake


async def notes(proc: Process) -> list[str]:
    """The texts of the undelivered-answer notes in the process's history."""
    return [m.text for m in await proc.messages() if isinstance(m, SystemMessage) and NOTE in m.text]


async def runs_started(proc: Process) -> int:
    return sum(1 for _ in [s async for s in proc.signals(follow=False) if s.signal == sig.RUN_STARTED])


async def noted(proc: Process, count: int = 1) -> list[str]:
    """Wait (generously) until the process holds ``count`` notes; they, then."""
    deadline = asyncio.get_running_loop().time() + 10.0
    while len(found := await notes(proc)) < count:
        assert asyncio.get_running_loop().time() < deadline, f"no note: {await proc.messages()}"
        await asyncio.sleep(0.02)
    return found


async def waited(check: Callable[[], Awaitable[object]]) -> None:
    """Wait (generously) until the async ``check`` answers something true."""
    deadline = asyncio.get_running_loop().time() + 10.0
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {check}"
        await asyncio.sleep(0.02)


def seen_notes(model: ScriptedModel) -> list[list[str]]:
    """Per model request, the notes it showed the model."""
    return [[m.text for m in r.messages if isinstance(m, SystemMessage) and NOTE in m.text] for r in model.requests]


async def test_a_telegram_answer_refused_for_good_is_noted_once_and_starts_no_run(
    tmp_path: Path, telegram: FakeTelegram
) -> None:
    telegram.fail("sendMessage", BLOCKED)
    async with running(tmp_path, telegram, allow=[ALICE]) as (kernel, _, model):
        telegram.message(chat=ALICE, user=ALICE, text="hello")
        await until(lambda: telegram.of("sendMessage"))  # the answer, refused
        [record] = await kernel.processes()
        proc = await kernel.process(record.pid)
        [note] = await noted(proc)
        assert "the Telegram chat 100" in note and '"seen: hello"' in note
        assert "bot was blocked by the user" in note and "403" in note
        assert TOKEN not in note and SECRET not in note
        await proc.wait_idle()
        # no run of its own: the model was asked once, for the message, and nothing waits
        assert len(model.requests) == 1 and await runs_started(proc) == 1
        assert (await proc.info()).current_run is None and await proc.queued() == []
        assert telegram.texts(ALICE) == []

        # the next message is answered as ever, and the model is shown what the user missed
        telegram.message(chat=ALICE, user=ALICE, text="again")
        await until(lambda: telegram.texts(ALICE))
        assert telegram.texts(ALICE) == ["seen: hello, again"]
        assert user_texts(model) == ["hello", "again"]
        assert seen_notes(model) == [[], [note]]
        assert await notes(proc) == [note]  # still the one


async def test_a_telegram_answer_whose_send_fails_for_a_while_is_sent_and_noted_nowhere(
    tmp_path: Path, telegram: FakeTelegram
) -> None:
    telegram.fail(
        "sendMessage",
        (500, {"ok": False, "error_code": 500, "description": "Internal Server Error"}),
        (429, {"ok": False, "error_code": 429, "description": "Too Many Requests", "parameters": {"retry_after": 0}}),
    )
    async with running(tmp_path, telegram, allow=[ALICE]) as (kernel, _, model):
        telegram.message(chat=ALICE, user=ALICE, text="hello")
        await until(lambda: telegram.texts(ALICE))
        telegram.message(chat=ALICE, user=ALICE, text="again")
        await until(lambda: len(telegram.texts(ALICE)) == 2)
        assert telegram.texts(ALICE) == ["seen: hello", "seen: hello, again"]
        [record] = await kernel.processes()
        proc = await kernel.process(record.pid)
        assert await notes(proc) == [] and seen_notes(model) == [[], []]
        assert not [m for m in await proc.messages() if isinstance(m, SystemMessage)]


async def test_a_long_answer_cut_short_is_one_note_saying_how_much_went_out(
    tmp_path: Path, telegram: FakeTelegram
) -> None:
    # the first part goes out (answered as Telegram answers a send), the second is refused: the
    # rest is dropped, and the answer gets one note, not one per part
    sent = {"ok": True, "result": {"message_id": 7, "chat": {"id": ALICE, "type": "private"}, "date": 0}}
    telegram.fail("sendMessage", (200, sent), BLOCKED)
    async with running(tmp_path, telegram, allow=[ALICE]) as (kernel, _, model):
        telegram.message(chat=ALICE, user=ALICE, text="long 200")  # 200 lines of 50 characters: 3 parts
        await until(lambda: len(telegram.of("sendMessage")) == 2)
        [record] = await kernel.processes()
        proc = await kernel.process(record.pid)
        [note] = await noted(proc)
        assert "only 1 of its 3 messages went out" in note and '"line 0000 xxx' in note
        await proc.wait_idle()
        assert len(model.requests) == 1 and await runs_started(proc) == 1
        assert len(telegram.of("sendMessage")) == 2  # the third part was not tried
        assert await notes(proc) == [note]


async def test_a_note_waits_out_a_run_under_way_and_calls_no_model(tmp_path: Path, telegram: FakeTelegram) -> None:
    gate.clear()
    telegram.fail("sendMessage", BLOCKED)  # (the answer of the gated run)
    try:
        async with running(tmp_path, telegram, allow=[ALICE]) as (kernel, _, model):
            telegram.message(chat=ALICE, user=ALICE, text="gate")
            await until(lambda: len(model.requests) == 1)  # the run waits in its tool
            telegram.message(chat=ALICE, user=ALICE, text="hello")  # queued behind it
            [record] = await kernel.processes()
            proc = await kernel.process(record.pid)
            await waited(proc.queued)
            gate.set()
            await until(lambda: telegram.texts(ALICE))  # the queued message's answer
            [note] = await noted(proc)
            assert '"tool said: opened"' in note
            await proc.wait_idle()
            # the gated run's two model calls and the queued message's one: none for the note
            assert len(model.requests) == 3 and await runs_started(proc) == 2
            assert telegram.texts(ALICE) == ["seen: gate, hello"]
    finally:
        gate.set()


async def test_kernel_note_is_idempotent_by_its_id_and_refused_during_a_run(tmp_path: Path) -> None:
    gate.clear()
    model = ScriptedModel(brain)
    try:
        async with open_kernel(tmp_path, model) as kernel:
            assert isinstance(kernel, Kernel)
            proc = await kernel.spawn("someone")
            assert await kernel.note(proc.pid, "the first", note_id="n1") is True
            assert await kernel.note(proc.pid, "the first, again", note_id="n1") is False
            assert await kernel.note(proc.pid, "another") is True
            assert [m.text for m in await proc.messages()] == ["the first", "another"]
            assert model.requests == [] and await runs_started(proc) == 0
            with pytest.raises(ValueError):
                await kernel.note(proc.pid, "   ")
            await proc.send("gate")
            await until(lambda: len(model.requests) == 1)
            with pytest.raises(RunActive):
                await kernel.note(proc.pid, "during the run")
    finally:
        gate.set()


async def test_a_discord_answer_refused_for_good_is_noted_once_and_starts_no_run(
    tmp_path: Path, discord: FakeDiscord
) -> None:
    discord.fail("create_message", (403, {"message": "Missing Access", "code": 50001}))
    async with discord_running(tmp_path, discord, allow=[ALICE]) as (kernel, _, model):
        discord.message(ALICE_DM, ALICE, "hello")
        await until(lambda: discord.of("create_message"))
        [record] = await kernel.processes()
        proc = await kernel.process(record.pid)
        [note] = await noted(proc)
        assert f"the Discord channel {ALICE_DM}" in note and '"seen: hello"' in note
        assert "Missing Access" in note
        assert DISCORD_TOKEN not in note and DISCORD_SECRET not in note
        await proc.wait_idle()
        assert len(model.requests) == 1 and await runs_started(proc) == 1
        assert discord.texts(ALICE_DM) == []

        discord.message(ALICE_DM, ALICE, "again")
        await until(lambda: discord.texts(ALICE_DM))
        assert discord.texts(ALICE_DM) == ["seen: hello, again"]
        assert seen_notes(model) == [[], [note]]
        assert await notes(proc) == [note]


async def test_a_discord_answer_whose_send_fails_for_a_while_is_noted_nowhere(
    tmp_path: Path, discord: FakeDiscord
) -> None:
    discord.fail("create_message", (500, {"message": "Internal Server Error", "code": 0}))
    async with discord_running(tmp_path, discord, allow=[ALICE]) as (kernel, _, model):
        discord.message(ALICE_DM, ALICE, "hello")
        await until(lambda: discord.texts(ALICE_DM))
        discord.message(ALICE_DM, ALICE, "again")
        await until(lambda: len(discord.texts(ALICE_DM)) == 2)
        assert discord.texts(ALICE_DM) == ["seen: hello", "seen: hello, again"]
        [record] = await kernel.processes()
        proc = await kernel.process(record.pid)
        assert await notes(proc) == [] and seen_notes(model) == [[], []]
