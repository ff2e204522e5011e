"""A Telegram album (one message per file, sharing a ``media_group_id``) reaches the agent as one
input: its files together with the caption, in one run; also when the album's files come in two
polls, and in inputs of at most ``MAX_FILES`` files when it has more."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop.channels import telegram
from agentloop.channels.media import MAX_FILES
from agentloop.messages import ImageContent, TextContent, UserMessage
from tests import test_channel_telegram as tg
from tests.image_support import png
from tests.test_channel_media import FilesTelegram, b64, last_input
from tests.test_channel_telegram import ALICE, until

PICTURES = [png(40 + i, 30) for i in range(MAX_FILES + 1)]


@pytest.fixture
def fake() -> Iterator[FilesTelegram]:
    server = FilesTelegram()
    for i, data in enumerate(PICTURES):
        server.file(f"p{i}", f"photos/file_{i}.png", data, len(data))
    with server.server:
        yield server


def photo(i: int) -> list[dict[str, Any]]:
    return [
        {"file_id": f"p{i}", "file_unique_id": f"u{i}", "width": 40 + i, "height": 30, "file_size": len(PICTURES[i])}
    ]


def album_item(fake: FilesTelegram, i: int, group: str = "g1", **fields: Any) -> int:
    return fake.media(ALICE, ALICE, photo=photo(i), media_group_id=group, **fields)


def inputs(model: Any) -> list[UserMessage]:
    return [r.messages[-1] for r in model.requests if isinstance(r.messages[-1], UserMessage)]


async def test_an_album_is_one_input_with_all_its_photos_and_its_caption(tmp_path: Path, fake: FilesTelegram) -> None:
    async with tg.running(tmp_path, fake, allow=[ALICE]) as (kernel, _, model):
        for i in range(3):
            album_item(fake, i, **({"caption": "compare these"} if i == 1 else {}))
        await until(lambda: fake.texts(ALICE), 10)
        await asyncio.sleep(0.3)  # (no second answer comes)
        assert fake.texts(ALICE) == ["seen: compare these"]
        [given] = inputs(model)
        assert given.content == [
            TextContent(text="compare these"),
            *[ImageContent(data=b64(PICTURES[i]), mime_type="image/png") for i in range(3)],
        ]
        fake.message(chat=ALICE, user=ALICE, text="and now?")  # the offset moved past the whole album
        await until(lambda: len(fake.texts(ALICE)) == 2)
        assert len(inputs(model)) == 2 and len(await kernel.processes()) == 1


async def test_an_album_split_over_two_polls_is_still_one_input(
    tmp_path: Path, fake: FilesTelegram, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(telegram, "ALBUM_WAIT", 1.5)
    async with tg.running(tmp_path, fake, allow=[ALICE]) as (_, _, model):
        fake.message(chat=ALICE, user=ALICE, text="hello")
        answered = threading.Event()  # a poll's answer has the album's first file
        result = fake.result

        async def watched(method: str, params: dict[str, Any], entry: Any) -> Any:
            out = await result(method, params, entry)
            if method == "getUpdates" and any(u.get("message", {}).get("media_group_id") for u in out):
                answered.set()
            return out

        fake.result = watched  # type: ignore[method-assign]
        album_item(fake, 0, caption="two")  # a poll that ends inside an album …
        await until(answered.is_set)
        album_item(fake, 1)  # … and the album's second file, in the next poll
        await until(lambda: fake.texts(ALICE), 10)  # (the message before it was taken at once)
        assert fake.texts(ALICE)[0] == "seen: hello"
        await until(lambda: len(fake.texts(ALICE)) == 2, 10)
        await asyncio.sleep(0.3)
        assert len(fake.texts(ALICE)) == 2
        assert last_input(model).content == [
            TextContent(text="two"),
            ImageContent(data=b64(PICTURES[0]), mime_type="image/png"),
            ImageContent(data=b64(PICTURES[1]), mime_type="image/png"),
        ]


async def test_an_album_with_more_files_than_an_input_takes_is_split(tmp_path: Path, fake: FilesTelegram) -> None:
    async with tg.running(tmp_path, fake, allow=[ALICE]) as (_, _, model):
        for i in range(MAX_FILES + 1):
            album_item(fake, i, **({"caption": "all of them"} if i == 0 else {}))
        await until(lambda: len(fake.texts(ALICE)) == 2, 10)
        first, second = inputs(model)
        assert len(first.content) == 1 + MAX_FILES and first.content[0] == TextContent(text="all of them")
        assert second.content[1:] == [ImageContent(data=b64(PICTURES[MAX_FILES]), mime_type="image/png")]


def test_takes_groups_consecutive_files_of_one_album_of_one_chat() -> None:
    def upd(uid: int, chat: int = 1, group: str | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"chat": {"id": chat}}
        if group is not None:
            message["media_group_id"] = group
        return {"update_id": uid, "message": message}

    updates = [upd(1), upd(2, group="a"), upd(3, group="a"), upd(4, chat=2, group="a"), upd(5, group="b"), upd(6)]
    assert [[u["update_id"] for u in take] for take in telegram.takes(updates)] == [[1], [2, 3], [4], [5], [6]]
    assert telegram.takes([{"update_id": 1, "message": "garbage"}, {"nonsense": True}]) == [
        [{"update_id": 1, "message": "garbage"}],
        [{"nonsense": True}],
    ]


async def test_a_video_in_an_album_goes_with_the_photos_as_a_note(tmp_path: Path, fake: FilesTelegram) -> None:
    """A video is no longer left out of an album: it goes with the photos as the kernel's note of
    it (size unknown: this one's message says none), and is not downloaded."""
    async with tg.running(tmp_path, fake, allow=[ALICE]) as (_, _, model):
        album_item(fake, 0, caption="our trip")
        fake.media(ALICE, ALICE, video={"file_id": "v", "duration": 3}, media_group_id="g1")
        album_item(fake, 1)
        await until(lambda: fake.texts(ALICE), 10)
        await asyncio.sleep(0.2)
        noted = "[Attached video (video/mp4, size unknown): it cannot be viewed here; this note stands in for it]"
        assert fake.texts(ALICE) == [f"seen: our trip\n\n{noted}"]
        [given] = inputs(model)
        assert given.content[0] == TextContent(text=f"our trip\n\n{noted}")
        assert given.content[1:] == [ImageContent(data=b64(PICTURES[i]), mime_type="image/png") for i in (0, 1)]
        assert "v" not in [c.params["file_id"] for c in fake.of("getFile")]
