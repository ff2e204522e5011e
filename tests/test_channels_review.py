"""Review of the chat-app bridges (``agentloop.channels``): who may reach a process or answer an
approval, and what becomes of a message whose handling fails. Runs against the fakes of
``test_channel_telegram`` and ``test_channel_whatsapp``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop.channels.bridge import REFUSE_EVERY, RefusalThrottle
from agentloop.kernel import Kernel, Process, ProcessBusy
from agentloop.process.store.base import StoreError
from tests import test_channel_telegram as tg
from tests import test_channel_whatsapp as wa
from tests.test_channel_telegram import FakeTelegram
from tests.test_channel_whatsapp import FakeGraph, notify


@pytest.fixture
def fake() -> Iterator[FakeTelegram]:
    telegram = FakeTelegram()
    with telegram.server:
        yield telegram


@pytest.fixture
def graph() -> Iterator[FakeGraph]:
    fake = FakeGraph()
    with fake.server:
        yield fake


def fail_spawn_once(kernel: Kernel, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The kernel's next spawn fails as a store that is down for a moment fails (then it works)."""
    spawn = kernel.spawn
    failed: list[int] = []

    async def flaky(*args: Any, **kw: Any) -> Any:
        if not failed:
            failed.append(1)
            raise StoreError("the database is unreachable")
        return await spawn(*args, **kw)

    monkeypatch.setattr(kernel, "spawn", flaky)
    return failed


# ------------------------------------------------------------------------------- who reaches what


async def test_telegram_a_button_naming_another_chats_request_answers_nothing(
    tmp_path: Path, fake: FakeTelegram
) -> None:
    tg.removed.clear()
    async with tg.running(tmp_path, fake) as (kernel, _, _):
        fake.message(chat=tg.BOB, user=tg.BOB, text="hello")  # Bob's chat has a process of its own
        await tg.until(lambda: fake.texts(tg.BOB))
        fake.message(chat=tg.ALICE, user=tg.ALICE, text="delete")
        [ask] = await tg.until(lambda: [p for p in fake.sent(chat=tg.ALICE) if "reply_markup" in p])
        approve = ask["reply_markup"]["inline_keyboard"][0][0]["callback_data"]
        # Bob (allowed) presses, in his own chat, a button that names Alice's request
        [bobs] = fake.sent(chat=tg.BOB)
        fake.press(tg.BOB, bobs, approve)
        [answer] = await tg.until(lambda: fake.sent("answerCallbackQuery"))
        assert answer["text"] == "This request is no longer pending."
        alices = [p for p in await kernel.processes() if p.owner == f"telegram-{tg.ALICE}"]
        assert len(await (await kernel.process(alices[0].pid)).pending_approvals()) == 1 and tg.removed == []


async def test_whatsapp_a_button_naming_another_numbers_request_answers_nothing(
    tmp_path: Path, graph: FakeGraph
) -> None:
    wa.removed.clear()
    async with wa.running(tmp_path, graph) as (kernel, _, _, meta):
        await meta.text(wa.BOB, "hello")
        await wa.until(lambda: graph.texts(wa.BOB))
        await meta.text(wa.ALICE, "delete")
        [ask] = await wa.until(lambda: graph.asks(wa.ALICE))
        await meta.press(wa.BOB, ask["action"]["buttons"][0]["reply"]["id"])
        await wa.until(lambda: "This request is no longer pending." in graph.texts(wa.BOB))
        alices = [p for p in await kernel.processes() if p.owner == f"whatsapp-{wa.ALICE}"]
        assert len(await (await kernel.process(alices[0].pid)).pending_approvals()) == 1 and wa.removed == []


async def test_telegram_a_chat_whose_process_was_killed_from_outside_gets_a_new_one(
    tmp_path: Path, fake: FakeTelegram
) -> None:
    async with tg.running(tmp_path, fake, allow=[tg.ALICE]) as (kernel, bridge, _):
        fake.message(chat=tg.ALICE, user=tg.ALICE, text="hello")
        await tg.until(lambda: fake.texts(tg.ALICE))
        [old] = await kernel.processes()
        await (await kernel.process(old.pid)).kill()
        fake.message(chat=tg.ALICE, user=tg.ALICE, text="/stop")
        fake.message(chat=tg.ALICE, user=tg.ALICE, text="again")
        await tg.until(lambda: len(fake.texts(tg.ALICE)) == 3)
        assert fake.texts(tg.ALICE)[1:] == ["Nothing is running.", "seen: again"]
        [new] = await kernel.processes()
        assert new.pid != old.pid and old.pid not in bridge.state.seqs


# ------------------------------------------------------------------------------- nothing is lost


async def test_telegram_a_message_whose_admission_failed_is_taken_again_not_dropped(
    tmp_path: Path, fake: FakeTelegram, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with tg.running(tmp_path, fake, allow=[tg.ALICE]) as (kernel, bridge, model):
        failed = fail_spawn_once(kernel, monkeypatch)
        first = fake.message(chat=tg.ALICE, user=tg.ALICE, text="hello")
        fake.message(chat=tg.ALICE, user=tg.ALICE, text="second")
        await tg.until(lambda: failed)
        await tg.until(lambda: bridge.state.offset == first + 2)
        await tg.until(lambda: fake.texts(tg.ALICE) and fake.texts(tg.ALICE)[-1] == "seen: hello, second")
        assert tg.user_texts(model)[0] == "hello"  # admitted, once, and before the message after it


async def test_telegram_an_update_that_always_fails_is_skipped_in_the_end(
    tmp_path: Path, fake: FakeTelegram, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with tg.running(tmp_path, fake, allow=[tg.ALICE]) as (kernel, bridge, _):

        async def broken(*args: Any, **kw: Any) -> Any:
            raise RuntimeError("a bug")

        monkeypatch.setattr(kernel, "spawn", broken)
        first = fake.message(chat=tg.ALICE, user=tg.ALICE, text="hello")
        await tg.until(lambda: bridge.state.offset == first + 1, seconds=10)  # (the bridge goes on)


async def test_whatsapp_a_message_whose_admission_failed_is_delivered_again_by_meta(
    tmp_path: Path, graph: FakeGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with wa.running(tmp_path, graph, allow=[wa.ALICE]) as (kernel, _, model, meta):
        failed = fail_spawn_once(kernel, monkeypatch)
        wamid = meta.wamid()
        hello = notify({"from": wa.ALICE, "id": wamid, "type": "text", "text": {"body": "hello"}})
        first = await meta.post(hello)
        assert failed and first.status_code >= 500  # not admitted: Meta is asked to deliver it again
        assert (await meta.post(hello)).status_code == 200  # Meta's re-delivery
        await wa.until(lambda: graph.texts(wa.ALICE))
        await asyncio.sleep(0.2)
        assert graph.texts(wa.ALICE) == ["seen: hello"] and wa.user_texts(model) == ["hello"]


async def test_refused_chats_are_told_once_an_hour_and_forgotten_after() -> None:
    throttle: RefusalThrottle[int] = RefusalThrottle()
    assert throttle.due(1) and not throttle.due(1)  # a stranger writing again is not answered again
    for chat in range(2, 1100):  # many strangers, each told once
        assert throttle.due(chat)
    assert len(throttle._told) <= 1100
    throttle._told = {c: t - REFUSE_EVERY for c, t in throttle._told.items()}  # an hour on
    assert throttle.due(5000)
    assert len(throttle._told) == 1  # those refused an hour ago are forgotten
    assert throttle.due(1)  # and told again when they write again


async def test_new_on_a_process_busy_elsewhere_says_so_and_the_bridge_goes_on(
    tmp_path: Path, fake: FakeTelegram, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with tg.running(tmp_path, fake, allow=[tg.ALICE]) as _:
        fake.message(chat=tg.ALICE, user=tg.ALICE, text="hello")
        await tg.until(lambda: fake.texts(tg.ALICE) == ["seen: hello"])

        async def busy(self: Process) -> None:
            raise ProcessBusy(self.pid, "reset")

        monkeypatch.setattr(Process, "reset", busy)
        fake.message(chat=tg.ALICE, user=tg.ALICE, text="/new")
        await tg.until(lambda: len(fake.texts(tg.ALICE)) == 2)
        assert "busy" in fake.texts(tg.ALICE)[1] and "Started" not in fake.texts(tg.ALICE)[1]
        monkeypatch.undo()
        fake.message(chat=tg.ALICE, user=tg.ALICE, text="/new")
        await tg.until(lambda: fake.texts(tg.ALICE)[-1] == "Started a new conversation.")
