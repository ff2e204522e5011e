"""A video sent to a chat bridge reaches the agent as the note the kernel gives a ``VideoContent``
(``process.audio_video.video_note``), with the words sent with it, and is never downloaded: the
note needs only what the message says (name, type, size), and no model could use the bytes. Against
the fakes of ``test_channel_media`` (which record every ``getFile``, Graph lookup, download and CDN
request), so "not downloaded" is what each fake saw, not what the bridge says of itself."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop.channels.media import MAX_FILES, UNSUPPORTED, Attachment
from agentloop.messages import ImageContent, TextContent, UserMessage
from agentloop.process.audio_video import video_note
from tests import test_channel_discord as dc
from tests import test_channel_telegram as tg
from tests import test_channel_whatsapp as wa
from tests.test_channel_media import PNG, FakeCdn, FilesGraph, FilesTelegram, attachment, b64, last_input, post

until = tg.until
CLIP = 3 * 1024  # bytes a video says it has (the note's "3.0 KiB")
HUGE_CLIP = 300 * 1024 * 1024  # past every download limit: a note costs nothing, so it is no reason to refuse


def note(name: str, mime: str = "video/mp4", size: int | None = CLIP) -> str:
    if size is not None:
        return video_note(name, mime, size)
    label = f'video "{name}"' if name else "video"
    return f"[Attached {label} ({mime}, size unknown): it cannot be viewed here; this note stands in for it]"


def texts_given(model: Any) -> list[str]:
    return [r.messages[-1].text for r in model.requests if isinstance(r.messages[-1], UserMessage)]


@pytest.fixture
def telegram() -> Iterator[FilesTelegram]:
    fake = FilesTelegram()
    with fake.server:
        yield fake


@pytest.fixture
def graph() -> Iterator[FilesGraph]:
    fake = FilesGraph()
    with fake.server:
        yield fake


@pytest.fixture
def discord() -> Iterator[dc.FakeDiscord]:
    with dc.FakeDiscord() as fake:
        yield fake


@pytest.fixture
def cdn() -> Iterator[FakeCdn]:
    fake = FakeCdn()
    with fake.server:
        yield fake


# ------------------------------------------------------------------------------- the shared part


def test_a_video_note_is_the_kernels_and_a_video_is_held_to_no_download_limit() -> None:
    from agentloop.channels.media import refusal, video_kind, video_text  # (new: imported here, not at the top)

    clip = Attachment("video", "video/mp4", "clip.mp4", "the video", CLIP, "ref")
    assert video_text(clip) == (
        '[Attached video "clip.mp4" (video/mp4, 3.0 KiB): it cannot be viewed here; this note stands in for it]'
    )
    unsized = Attachment("video", "video/quicktime", "", "the video", None, "ref")
    assert video_text(unsized) == note("", "video/quicktime", None)
    assert video_kind("video/mp4; codecs=avc1") == "video/mp4"
    assert video_kind("application/octet-stream", "Clip.MOV") == "video/quicktime"  # a generic type: by the suffix
    assert video_kind("image/png", "a.mp4") is None and video_kind("audio/ogg") is None
    huge = Attachment("video", "video/mp4", "long.mp4", "long.mp4", HUGE_CLIP, "ref")
    photos = [Attachment("image", "image/jpeg", "", "the photo", 10, f"p{i}") for i in range(MAX_FILES)]
    assert refusal([huge, *photos, clip], 1024) is None  # neither over the size nor past MAX_FILES: not fetched
    assert refusal([*photos, photos[0]], 1024) == f"Send at most {MAX_FILES} files in one message."
    assert "video" not in UNSUPPORTED.split(";")[1] and "voice messages" in UNSUPPORTED


# ------------------------------------------------------------------------------- Telegram


async def test_telegram_a_video_a_video_message_and_a_gif_reach_the_agent_as_notes_never_downloaded(
    tmp_path: Path, telegram: FilesTelegram
) -> None:
    video = {"file_id": "v1", "file_unique_id": "u1", "duration": 3, "width": 640, "height": 360}
    video |= {"file_name": "clip.mp4", "mime_type": "video/mp4", "file_size": CLIP}
    round_one = {"file_id": "v2", "file_unique_id": "u2", "length": 240, "duration": 2, "file_size": CLIP}
    gif = {"file_id": "v3", "file_unique_id": "u3", "duration": 1, "width": 200, "height": 200}
    gif |= {"file_name": "dance.gif.mp4", "mime_type": "video/mp4", "file_size": CLIP}
    as_file = {"file_id": "v4", "file_unique_id": "u4", "file_name": "long.mov", "mime_type": "video/quicktime"}
    as_file["file_size"] = HUGE_CLIP
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE]) as (kernel, _, model):
        telegram.media(tg.ALICE, tg.ALICE, video=video, caption="what happens here?")
        await until(lambda: telegram.texts(tg.ALICE))
        assert last_input(model).content == [TextContent(text="what happens here?\n\n" + note("clip.mp4"))]
        telegram.media(tg.ALICE, tg.ALICE, video_note=round_one)  # no caption: the note alone makes a run
        await until(lambda: len(telegram.texts(tg.ALICE)) == 2)
        assert last_input(model).content == [TextContent(text=note(""))]
        # a GIF: an MP4 animation, with the same file beside it as a document (for older clients)
        telegram.media(tg.ALICE, tg.ALICE, animation=gif, document=gif, caption="lol")
        await until(lambda: len(telegram.texts(tg.ALICE)) == 3)
        assert last_input(model).content == [TextContent(text="lol\n\n" + note("dance.gif.mp4"))]
        telegram.media(tg.ALICE, tg.ALICE, document=as_file, caption="sent as a file")  # 300 MiB: not refused
        await until(lambda: len(telegram.texts(tg.ALICE)) == 4)
        assert texts_given(model)[-1] == "sent as a file\n\n" + note("long.mov", "video/quicktime", HUGE_CLIP)
        assert telegram.texts(tg.ALICE)[0] == f"seen: what happens here?\n\n{note('clip.mp4')}"
        assert telegram.of("getFile") == [] and telegram.downloads == []  # nothing fetched, nothing asked for
        assert len(await kernel.processes()) == 1


async def test_telegram_a_video_in_an_album_goes_with_the_photos_as_its_note(
    tmp_path: Path, telegram: FilesTelegram
) -> None:
    telegram.file("p0", "photos/file_0.png", PNG, len(PNG))
    photo = [{"file_id": "p0", "file_unique_id": "u0", "width": 320, "height": 240, "file_size": len(PNG)}]
    video = {"file_id": "v", "file_unique_id": "uv", "duration": 3, "mime_type": "video/mp4", "file_size": CLIP}
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE]) as (_, _, model):
        telegram.media(tg.ALICE, tg.ALICE, photo=photo, caption="our trip", media_group_id="g1")
        telegram.media(tg.ALICE, tg.ALICE, video=video, media_group_id="g1")
        await until(lambda: telegram.texts(tg.ALICE), 10)
        await asyncio.sleep(0.2)  # (no refusal, no second answer)
        assert telegram.texts(tg.ALICE) == [f"seen: our trip\n\n{note('')}"]
        assert last_input(model).content == [
            TextContent(text="our trip\n\n" + note("")),
            ImageContent(data=b64(PNG), mime_type="image/png"),
        ]
        assert [c.params["file_id"] for c in telegram.of("getFile")] == ["p0"]  # the photo only


# ------------------------------------------------------------------------------- WhatsApp


async def test_whatsapp_a_video_reaches_the_agent_as_a_note_with_its_caption_and_no_lookup(
    tmp_path: Path, graph: FilesGraph
) -> None:
    graph.add_media("4001", b"\x00\x00\x00\x18ftypmp42", "video/mp4", CLIP)
    async with wa.running(tmp_path, graph, allow=[wa.ALICE]) as (kernel, _, model, meta):
        video = {"id": "4001", "mime_type": "video/mp4", "sha256": "x", "caption": "is this my cat?"}
        await meta.send(wa.ALICE, {"type": "video", "video": video})
        await until(lambda: graph.texts(wa.ALICE))
        unsized = note("", "video/mp4", None)  # (a notification does not say the size: not found out either)
        assert graph.texts(wa.ALICE) == [f"seen: is this my cat?\n\n{unsized}"]
        assert last_input(model).content == [TextContent(text="is this my cat?\n\n" + unsized)]
        await meta.send(wa.ALICE, {"type": "video", "video": {"id": "4001", "mime_type": "video/3gpp"}})
        await until(lambda: len(graph.texts(wa.ALICE)) == 2)  # no caption: a run all the same
        assert texts_given(model)[-1] == note("", "video/3gpp", None)
        assert graph.lookups == [] and graph.downloads == []
        assert len(await kernel.processes()) == 1


# ------------------------------------------------------------------------------- Discord


async def test_discord_a_video_attachment_is_a_note_beside_the_other_files_and_not_fetched(
    tmp_path: Path, discord: dc.FakeDiscord, cdn: FakeCdn
) -> None:
    bases = (f"{cdn.url}/attachments/",)
    clip = attachment(cdn.add("clip.mp4", b"\x00\x00\x00\x18ftypmp42"), "clip.mp4", "video/mp4", CLIP)
    image = attachment(cdn.add("cat.png", PNG), "cat.png", "image/png", len(PNG))
    webm = attachment(cdn.add("screen.webm", HUGE_CLIP), "screen.webm", "video/webm", HUGE_CLIP)
    async with dc.running(tmp_path, discord, allow=[dc.ALICE], attachment_urls=bases) as (kernel, _, model):
        post(discord, dc.ALICE_DM, dc.ALICE, "which is better?", [clip, image])
        await until(lambda: discord.texts(dc.ALICE_DM))
        assert discord.texts(dc.ALICE_DM) == [f"seen: which is better?\n\n{note('clip.mp4')}"]
        assert last_input(model).content == [
            TextContent(text="which is better?\n\n" + note("clip.mp4")),
            ImageContent(data=b64(PNG), mime_type="image/png"),
        ]
        post(discord, dc.ALICE_DM, dc.ALICE, "", [webm])  # no text: the note alone makes a run
        await until(lambda: len(discord.texts(dc.ALICE_DM)) == 2)
        assert last_input(model).content == [TextContent(text=note("screen.webm", "video/webm", HUGE_CLIP))]
        assert cdn.paths() == ["attachments/1/2/cat.png"]  # the image only: no video was fetched
        assert len(await kernel.processes()) == 1
