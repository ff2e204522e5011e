"""The WhatsApp bridge's inbox: a message whose admission is not done when the webhook answers is
kept in the state file first, so that a 200 is only given for a message that is admitted or kept,
and a kept message is admitted later (by the retrier, or by the next bridge), once.

Runs against the fakes of ``test_channel_whatsapp`` (the Graph API, Meta's signed requests)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop.channels import bridge as chat_bridge
from agentloop.channels import whatsapp
from agentloop.channels.state import ChannelState
from agentloop.kernel import Process
from agentloop.process.store.base import StoreError
from tests.test_channel_whatsapp import ALICE, BOB, PHONE_ID, FakeGraph, notify, running, until, user_texts


@pytest.fixture
def graph() -> Iterator[FakeGraph]:
    fake = FakeGraph()
    with fake.server:
        yield fake


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(whatsapp, "INTAKE_WAIT", 0.3)  # (a held admission is "slow" after this)
    monkeypatch.setattr(whatsapp, "CLOSE_GRACE", 0.3)
    monkeypatch.setattr(chat_bridge, "CLOSE_GRACE", 0.3)


def hold_first_send(monkeypatch: pytest.MonkeyPatch, *, fail: bool) -> tuple[asyncio.Event, list[str]]:
    """The next ``Process.send`` waits until the event is set, then fails as an unreachable store
    fails (``fail``) or goes through; the sends after it go through at once. Every text sent is
    listed."""
    send = Process.send
    release = asyncio.Event()
    calls: list[str] = []

    async def held(self: Process, text: str, *args: Any, **kw: Any) -> Any:
        calls.append(text)
        if len(calls) == 1:
            await release.wait()
            if fail:
                raise StoreError("the database is unreachable")
        return await send(self, text, *args, **kw)

    monkeypatch.setattr(Process, "send", held)
    return release, calls


def kept(tmp_path: Path) -> list[str]:
    """The wamids in the state file's inbox."""
    path = tmp_path / "var" / "whatsapp" / f"{PHONE_ID}.json"
    if not path.exists():
        return []
    return [m["id"] for m in json.loads(path.read_text()).get("inbox", [])]


def text(wamid: str, body: str, wa_id: str = ALICE) -> dict[str, Any]:
    return notify({"from": wa_id, "id": wamid, "timestamp": "1700000000", "type": "text", "text": {"body": body}})


async def test_a_message_admitted_in_time_is_not_written_to_the_inbox(
    tmp_path: Path, graph: FakeGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(whatsapp, "INTAKE_WAIT", 5.0)  # (as it is: a slow machine is not "slow" here)
    writes: list[dict[str, Any]] = []
    async with running(tmp_path, graph, allow=[ALICE]) as (_, bridge, _, meta):
        write = bridge.state._write

        def spy(data: dict[str, Any]) -> None:
            writes.append(data)
            write(data)

        monkeypatch.setattr(bridge.state, "_write", spy)
        await meta.text(ALICE, "hello")
        await until(lambda: graph.texts(ALICE))
    assert writes and all(not data.get("inbox") for data in writes)
    assert kept(tmp_path) == []


async def test_an_admission_slower_than_the_wait_that_then_fails_is_admitted_by_the_retrier(
    tmp_path: Path, graph: FakeGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, calls = hold_first_send(monkeypatch, fail=True)
    async with running(tmp_path, graph, allow=[ALICE]) as (_, _, model, meta):
        wamid = await meta.text(ALICE, "hello")  # 200 after INTAKE_WAIT: kept, its admission going on
        assert kept(tmp_path) == [wamid]
        release.set()  # and then the admission fails: Meta will not deliver it again
        await until(lambda: graph.texts(ALICE))
        await until(lambda: kept(tmp_path) == [])  # taken out once admitted
        await asyncio.sleep(0.3)
        assert graph.texts(ALICE) == ["seen: hello"] and user_texts(model) == ["hello"]
        assert calls == ["hello", "hello"]  # the failed admission, and the retrier's


async def test_a_kept_message_is_admitted_by_the_next_bridge(
    tmp_path: Path, graph: FakeGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold_first_send(monkeypatch, fail=False)  # held until the bridge closes (a crash, for the user)
    async with running(tmp_path, graph, allow=[ALICE]) as (_, _, model, meta):
        wamid = await meta.text(ALICE, "hello")
        assert kept(tmp_path) == [wamid]
    assert kept(tmp_path) == [wamid] and user_texts(model) == [] and graph.texts(ALICE) == []
    async with running(tmp_path, graph, allow=[ALICE], model=model) as (kernel, _, _, meta):
        await until(lambda: graph.texts(ALICE))
        await until(lambda: kept(tmp_path) == [])
        await meta.text(ALICE, "hello", wamid)  # Meta delivers it again after all: still once
        await asyncio.sleep(0.3)
        assert graph.texts(ALICE) == ["seen: hello"] and user_texts(model) == ["hello"]
        assert len(await kernel.processes()) == 1  # the process of the first bridge, found again


async def test_a_redelivery_of_a_kept_message_runs_once(
    tmp_path: Path, graph: FakeGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, _ = hold_first_send(monkeypatch, fail=True)
    async with running(tmp_path, graph, allow=[ALICE]) as (_, _, model, meta):
        wamid = await meta.text(ALICE, "hello")
        assert kept(tmp_path) == [wamid]
        await meta.text(ALICE, "hello", wamid)  # Meta did not see the 200: it delivers it again
        release.set()  # the first admission fails
        await until(lambda: graph.texts(ALICE))
        await until(lambda: kept(tmp_path) == [])
        await meta.text(ALICE, "hello", wamid)  # and again, once admitted
        await meta.text(ALICE, "more")
        await until(lambda: len(graph.texts(ALICE)) == 2)
        await asyncio.sleep(0.3)
        assert graph.texts(ALICE) == ["seen: hello", "seen: hello, more"]
        assert user_texts(model) == ["hello", "more"]


async def test_a_message_that_cannot_be_kept_is_answered_503(
    tmp_path: Path, graph: FakeGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, _ = hold_first_send(monkeypatch, fail=True)
    async with running(tmp_path, graph, allow=[ALICE]) as (_, bridge, model, meta):
        write = bridge.state._write
        full = [True]

        def disk(data: dict[str, Any]) -> None:
            if full:
                raise OSError(28, "No space left on device")
            write(data)

        monkeypatch.setattr(bridge.state, "_write", disk)
        hello = text(meta.wamid(), "hello")
        assert (await meta.post(hello)).status_code == 503  # not admitted, not kept: Meta delivers again
        full.clear()
        release.set()
        assert (await meta.post(hello)).status_code == 200  # Meta's re-delivery
        await until(lambda: graph.texts(ALICE))
        await asyncio.sleep(0.3)
        assert graph.texts(ALICE) == ["seen: hello"] and user_texts(model) == ["hello"]


async def test_a_full_inbox_answers_503_and_drops_nothing(
    tmp_path: Path, graph: FakeGraph, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(whatsapp, "INBOX_MAX", 1)
    release, _ = hold_first_send(monkeypatch, fail=False)
    async with running(tmp_path, graph) as (_, _, model, meta):
        first = await meta.text(ALICE, "hello")
        second = text(meta.wamid(), "hi", BOB)  # waits behind the first: kept, were there room
        assert (await meta.post(second)).status_code == 503
        assert "inbox is full" in caplog.text and kept(tmp_path) == [first]
        release.set()  # (the second's admission goes on, after its 503)
        await until(lambda: graph.texts(ALICE) and graph.texts(BOB))
        await until(lambda: kept(tmp_path) == [])
        assert (await meta.post(second)).status_code == 200  # Meta's re-delivery: admitted already
        await asyncio.sleep(0.3)
        assert graph.texts(ALICE) == ["seen: hello"] and graph.texts(BOB) == ["seen: hi"]
        assert sorted(user_texts(model)) == ["hello", "hi"]


async def test_an_old_state_file_without_an_inbox_loads(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"offset": 7, "seqs": {"p1": 3}}))
    state = ChannelState(path)
    state.load()
    assert state.offset == 7 and state.seqs == {"p1": 3} and state.inbox == []
    message = {"from": ALICE, "id": "wamid.1", "type": "text", "text": {"body": "hi"}}
    state.inbox.append(message)
    assert await state.save()
    again = ChannelState(path)
    again.load()
    assert again.offset == 7 and again.seqs == {"p1": 3} and again.inbox == [message]
    again.inbox.clear()
    assert await again.save()
    assert json.loads(path.read_text()) == {"offset": 7, "seqs": {"p1": 3}}  # (as before the inbox)
    # what is not a message with an id is left out
    path.write_text(json.dumps({"offset": 1, "inbox": [1, "x", {"no": "id"}, {"id": ""}, message, message]}))
    broken = ChannelState(path)
    broken.load()
    assert broken.offset == 1 and broken.inbox == [message]
    path.write_text(json.dumps({"offset": 2, "inbox": "garbage"}))
    garbage = ChannelState(path)
    garbage.load()
    assert garbage.offset == 2 and garbage.inbox == []
