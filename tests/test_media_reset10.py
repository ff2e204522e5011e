"""A video sent with a generic type is judged by its name, as audio is (the library, the server and
the chat bridges share one rule); and the queued input a reset or kill discards is kept in its
archive even when the clearing stops between the run's abort and the archive (a crash, a full
disk): nothing is taken out of the queue before it is written down."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.channels import media as channel_media
from agentloop.kernel import Kernel
from agentloop.kernel import kernel as kernel_module
from agentloop.messages import UserMessage, message_from_dict
from agentloop.models.base import ModelRequest
from agentloop.process.archive import read_archive
from agentloop.process.audio_video import VideoContent, video_type
from agentloop.server.api import MediaItem
from agentloop.server.errors import ApiError
from agentloop.server.service import decode_media
from tests.process_support import kernel

CLIP = base64.b64encode(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 40).decode()

# -- 1. a video of a generic type, by its name ---------------------------------------------------


@pytest.mark.parametrize(
    ("mime", "name", "expected"),
    [
        ("application/octet-stream", "clip.mp4", "video/mp4"),
        ("", "x.MOV", "video/quicktime"),
        ("binary/octet-stream", "a.webm", "video/webm"),
        ("application/octet-stream; charset=binary", "trip.mkv", "video/x-matroska"),
        (None, "old.avi", "video/x-msvideo"),
        ("video/mp4", "", "video/mp4"),  # a declared video type needs no name
    ],
)
def test_a_generic_type_with_a_video_files_name_is_video(mime: Any, name: str, expected: str) -> None:
    assert video_type(mime, name) == expected
    assert channel_media.video_kind(mime, name) == expected  # (the bridges' rule is the same one)


@pytest.mark.parametrize(
    ("mime", "name"),
    [
        ("application/octet-stream", "notes.txt"),  # a generic type without a video's name
        ("application/octet-stream", ""),
        ("image/png", "a.mp4"),  # a type that says something is believed over the name
        ("audio/ogg", "a.mp4"),
        ("application/octet-stream", "memo.ogg"),  # audio, not video
    ],
)
def test_what_is_not_a_video_stays_so(mime: str, name: str) -> None:
    assert video_type(mime, name) is None


async def test_the_library_takes_a_generic_typed_video_by_its_name_and_notes_its_real_type(tmp_path: Path) -> None:
    block = VideoContent(data=CLIP, mime_type="application/octet-stream", name="clip.mp4")
    with pytest.raises(ValueError, match="unsupported video type"):
        VideoContent(data=CLIP, mime_type="application/octet-stream", name="clip.txt")
    async with kernel(tmp_path, ScriptedModel(["I cannot watch it"])) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("look", media=[block])
        await proc.wait_idle()
        text = (await proc.messages())[0].text
    assert text.startswith('look\n\n[Attached video "clip.mp4" (video/mp4, ')  # its type, not octet-stream


def test_the_server_takes_a_generic_typed_video_by_its_name() -> None:
    blocks = decode_media(
        [
            {"data": CLIP, "mime_type": "application/octet-stream", "name": "clip.mp4"},
            {"data": CLIP, "mime_type": "", "name": "x.MOV"},
            {"data": CLIP, "mime_type": "binary/octet-stream", "name": "a.webm"},
        ]
    )
    assert [(type(b), b.mime_type) for b in blocks] == [
        (VideoContent, "video/mp4"),
        (VideoContent, "video/quicktime"),
        (VideoContent, "video/webm"),
    ]
    assert [b.name for b in blocks if isinstance(b, VideoContent)] == ["clip.mp4", "x.MOV", "a.webm"]


def test_the_servers_refusal_says_a_generic_type_is_taken_with_a_media_files_name() -> None:
    with pytest.raises(ApiError) as refused:
        decode_media([{"data": CLIP, "mime_type": "application/octet-stream", "name": "archive.zip"}])
    assert refused.value.status == 400
    message = str(refused.value.message)
    assert "audio/* or video/*" in message and "application/octet-stream" in message
    assert "audio or video file's name" in message
    described = MediaItem.model_fields["mime_type"].description or ""
    assert "video file's name" in described  # (the OpenAPI description says so too)


# -- 2. a reset's or kill's queued input, kept whatever stops the clearing ------------------------

gate = asyncio.Event()


@tool
async def wait() -> str:
    """Wait for the test."""
    await gate.wait()
    return "waited"


def brain(req: ModelRequest) -> Reply | str:
    return "done" if isinstance(req.messages[-1], ToolResultMessage) else Reply(tool_calls=[call("wait")])


def queued_texts(header: dict[str, Any]) -> list[str]:
    return [message_from_dict(m).text for m in header["meta"].get("queued", [])]


async def held_with_a_queued_message(k: Kernel) -> Any:
    """A process whose run waits at the gate, with a message queued behind it."""
    gate.clear()
    proc = await k.spawn(owner="alice")
    await proc.send("start")
    receipt = await proc.send("later, please", mode="queue")
    assert receipt.queued
    return proc


async def not_run(k: Kernel, pid: str) -> bool:
    """Whether the queued message neither waits in the queue nor reached the history: the user
    cleared the conversation it was sent to, so nothing may run it."""
    queued = [item.message.text for item in await k.store.queue(pid)]
    delivered = [m.message.text for m in await k.store.history(pid) if isinstance(m.message, UserMessage)]
    return "later, please" not in queued + delivered


async def clear(proc: Any, clearing: str) -> Path | None:
    return await (proc.reset() if clearing == "reset" else proc.kill())  # type: ignore[no-any-return]


@pytest.mark.parametrize("clearing", ["reset", "kill"])
async def test_queued_input_is_in_the_archive_marked_as_never_delivered(tmp_path: Path, clearing: str) -> None:
    async with kernel(tmp_path, ScriptedModel(brain), tools=[wait]) as k:
        proc = await held_with_a_queued_message(k)
        path = await (proc.reset() if clearing == "reset" else proc.kill())
        assert path is not None
        header, history = read_archive(path)
        assert [m.text for m in history if isinstance(m, UserMessage)] == ["start"]
        assert queued_texts(header) == ["later, please"]
        assert "never delivered" in header["meta"]["queued_note"] and clearing in header["meta"]["queued_note"]
        if clearing == "reset":
            assert await proc.queued() == [] and await proc.messages() == []
    gate.set()


@pytest.mark.parametrize("clearing", ["reset", "kill"])
async def test_a_clearing_stopped_before_its_archive_loses_no_queued_input(
    tmp_path: Path, clearing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's abort takes the queued input out of the queue (so that nothing runs it on the
    cleared history) and commits before the archive is written; an archive that cannot be written
    then must not lose it: the next reset or kill keeps it."""
    async with kernel(tmp_path, ScriptedModel(brain), tools=[wait]) as k:
        proc = await held_with_a_queued_message(k)

        def no_room(*args: Any, **kwargs: Any) -> Any:
            raise OSError("No space left on device")

        monkeypatch.setattr(kernel_module, "write_archive", no_room)
        with pytest.raises(OSError, match="No space"):
            await clear(proc, clearing)
        assert await not_run(k, proc.pid)
        monkeypatch.undo()
        path = await clear(proc, clearing)  # the user tries again, and this time the disk has room
        assert path is not None
        assert queued_texts(read_archive(path)[0]) == ["later, please"]
        if clearing == "reset":  # (let go once archived: the next reset's archive does not repeat it)
            gate.set()
            await proc.send("next")
            await asyncio.wait_for(proc.wait_idle(), 5)
            again = await proc.reset()
            assert again is not None and "queued" not in read_archive(again)[0]["meta"]
    gate.set()


@pytest.mark.parametrize("clearing", ["reset", "kill"])
async def test_a_crash_between_a_clearings_abort_and_its_archive_loses_no_queued_input(
    tmp_path: Path, clearing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker dies once the run's abort committed, before the archive: a new one, opening the
    same database, runs nothing of it, and the reset or kill the user tries again archives it."""
    crashed = asyncio.Event()
    async with kernel(tmp_path, ScriptedModel(brain), tools=[wait]) as k:
        proc = await held_with_a_queued_message(k)
        pid = proc.pid

        def dies(*args: Any, **kwargs: Any) -> Any:
            crashed.set()
            raise SystemExit("the machine died while the history was archived")

        monkeypatch.setattr(kernel_module, "write_archive", dies)
        with pytest.raises(SystemExit):
            await clear(proc, clearing)
        assert crashed.is_set()
    monkeypatch.undo()
    gate.set()
    async with kernel(tmp_path, ScriptedModel(brain), tools=[wait]) as again:
        proc = await again.process(pid)  # (still there: the clearing never got to its last commit)
        await asyncio.wait_for(proc.wait_idle(), 5)
        assert await not_run(again, pid)
        path = await clear(proc, clearing)
        assert path is not None
        header, history = read_archive(path)
        assert queued_texts(header) == ["later, please"]
        assert [m.text for m in history if isinstance(m, UserMessage)] == ["start"]
