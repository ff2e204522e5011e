"""Review of cbb8529..0d98d25: one regression test per problem found (each failed before its fix)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests import test_channel_telegram as tg
from tests.image_support import png
from tests.test_channel_media import FilesTelegram
from tests.test_session_review4 import fail_hil_once

PICTURE = png(40, 30)


# ------------------------------------------ chat bridge: a photo typed during an approval, taken again


async def test_a_photo_sent_during_an_approval_still_declines_it_when_its_update_is_taken_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """24f8ccf keeps the declined request ids in ``bridge.declines:<run id>`` so that an update
    taken again after the send still declines them (``ChatBridge._deliver``). But a message with
    files reaches ``_deliver`` through ``_deliver_files``, which returns early once the run id is
    admitted ("not downloaded again"): the retake never reaches the code that reads the row. The
    request stays pending, the photo's steer waits behind it, and the row is left in the kv."""
    from agentloop.channels.bridge import DECLINES

    tg.removed.clear()
    failures = fail_hil_once(monkeypatch)
    fake = FilesTelegram()
    fake.file("p0", "photos/file_0.png", PICTURE, len(PICTURE))
    photo = [{"file_id": "p0", "file_unique_id": "u0", "width": 40, "height": 30, "file_size": len(PICTURE)}]
    with fake.server:
        async with tg.running(tmp_path, fake, allow=[tg.ALICE]) as (kernel, bridge, _):
            fake.message(chat=tg.ALICE, user=tg.ALICE, text="delete")
            await tg.until(lambda: [p for p in fake.sent(chat=tg.ALICE) if "reply_markup" in p])
            sent = fake.media(tg.ALICE, tg.ALICE, photo=photo, caption="no, keep this one")
            await tg.until(lambda: bridge.state.offset == sent + 1)  # taken (again) and confirmed
            [proc] = await kernel.processes()
            process = await kernel.process(proc.pid)
            await asyncio.sleep(0.5)
            pending = await process.pending_approvals()
            left = await kernel.store.kv_get(proc.pid, f"{DECLINES}telegram-{bridge.bot_id}-{tg.ALICE}-{sent}")
    assert not failures  # the denial did fail once
    assert tg.removed == []
    assert pending == [], "the photo was admitted as the answer, but the request it declines still waits"
    assert left is None


# ------------------------------------ Telegram: an album taken again after its send, with a file more


async def test_an_album_file_that_arrives_before_a_retake_is_not_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TelegramBridge._take``: an album's input is "admitted once, by its run id: the first
    update's". But a retake is grouped afresh from what ``getUpdates`` answers then (``takes``):
    when another file of the album has come meanwhile, the retake holds more files under the
    same run id. ``_deliver_files`` finds the run id admitted and returns, and ``_take`` then moves
    the offset past the whole take: the late file is confirmed to Telegram and never delivered.
    (Here the send commits and then fails once, as a lost connection or a crash before the offset
    is saved would: the failure the run id exists for.)"""
    from agentloop.kernel.kernel import Process
    from tests import test_channel_album as album

    fake = FilesTelegram()
    for i, data in enumerate(album.PICTURES[:3]):
        fake.file(f"p{i}", f"photos/file_{i}.png", data, len(data))
    real_send = Process.send
    failed: list[bool] = []

    async def send_then_fail(self: Any, *a: Any, **kw: Any) -> Any:
        receipt = await real_send(self, *a, **kw)
        if not failed:  # admitted; the caller loses the answer once, and the album grows meanwhile
            failed.append(True)
            album.album_item(fake, 2)
            raise RuntimeError("connection lost")
        return receipt

    monkeypatch.setattr(Process, "send", send_then_fail)
    with fake.server:
        async with tg.running(tmp_path, fake, allow=[tg.ALICE]) as (_, bridge, model):
            album.album_item(fake, 0, caption="three photos")
            last = album.album_item(fake, 1)
            await tg.until(lambda: failed)
            await tg.until(lambda: bridge.state.offset > last + 1, 10)  # the third file confirmed too
            await asyncio.sleep(1.0)
            images = [
                block.data
                for request in model.requests
                for message in request.messages
                for block in getattr(message, "content", [])
                if getattr(block, "data", None) is not None
            ]
    assert album.b64(album.PICTURES[2]) in images, "the album's third file was confirmed but never delivered"


# ------------------------------------------ chat bridge: the declines row of a message that was refused


async def test_a_refused_message_typed_during_an_approval_leaves_no_declines_row(tmp_path: Path) -> None:
    """``ChatBridge._deliver`` writes ``bridge.declines:<run id>`` (committed) before the send and
    deletes it only after the denials. A message the process cannot keep (``send`` raises
    ValueError: a lone surrogate; "That message was refused") returns from the ``except`` with the
    row still there: nothing ever reads or deletes it, one stale row in the process's kv per
    such message (copied into no fork, dropped only with the process)."""
    from agentloop.channels.bridge import DECLINES

    tg.removed.clear()
    fake = tg.FakeTelegram()
    with fake.server:
        async with tg.running(tmp_path, fake, allow=[tg.ALICE]) as (kernel, bridge, _):
            fake.message(chat=tg.ALICE, user=tg.ALICE, text="delete")
            await tg.until(lambda: [p for p in fake.sent(chat=tg.ALICE) if "reply_markup" in p])
            bad = b"no, keep it \xe9".decode("utf-8", "surrogateescape")
            await bridge._deliver(tg.ALICE, tg.ALICE, bad, "telegram-4242-100-77")
            await tg.until(lambda: any("refused" in t for t in fake.texts(tg.ALICE)))
            [proc] = await kernel.processes()
            left = await kernel.store.kv_get(proc.pid, f"{DECLINES}telegram-4242-100-77")
            pending = await (await kernel.process(proc.pid)).pending_approvals()
    assert len(pending) == 1  # (refused: the request still waits, as it should)
    assert left is None, f"a stale declines row is left in the process's kv: {left}"
