"""Review of archives and media: privacy of the folders, no overwrite under a race, durable
renames, and a history whose stored media went bad still reaching the model."""

from __future__ import annotations

import asyncio
import base64
import os
import stat
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from agentloop.kernel.runs import hydrate_media
from agentloop.messages import ImageContent, Message, TextContent, UserMessage
from agentloop.process import archive as archive_mod
from agentloop.process import media as media_mod
from agentloop.process.archive import read_archive, write_archive
from agentloop.process.media import MediaRef, MediaStore

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + bytes(range(64))


def png_block() -> ImageContent:
    return ImageContent(data=base64.b64encode(PNG).decode(), mime_type="image/png")


def stored(ref: MediaRef) -> UserMessage:
    return UserMessage(content=[TextContent(text="look"), ImageContent(data=ref.to_data(), mime_type=ref.mime_type)])


def test_archive_and_media_folders_are_owner_only(tmp_path: Path) -> None:
    """The folder names are the accounts, their processes and the hashes of their images: only
    the runtime's own user may list them, as only it may read the files."""
    write_archive(tmp_path, "ann", "p1", "reset-1", [UserMessage(content=[TextContent(text="secret")])])
    ref = MediaStore(tmp_path).save("ann", "p1", png_block())
    media_file = tmp_path / ref.path
    for path in [
        tmp_path / "var" / "sessions",
        tmp_path / "var" / "sessions" / "ann",
        tmp_path / "var" / "sessions" / "ann" / "p1",
        tmp_path / "var" / "media",
        media_file.parent.parent,
        media_file.parent,
        media_file,
    ]:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, f"{path} is {oct(path.stat().st_mode)}"


def test_an_archive_written_meanwhile_under_the_same_name_is_not_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two writers of one name (two workers): the one that finishes second must fail, not replace
    the first one's archive, which may be the only copy of its history."""
    first = [UserMessage(content=[TextContent(text="first")])]
    second = [UserMessage(content=[TextContent(text="second")])]
    real_fsync = os.fsync
    raced = False

    def fsync_then_race(fd: int) -> None:
        nonlocal raced
        real_fsync(fd)
        if not raced and stat.S_ISREG(os.fstat(fd).st_mode):
            raced = True  # the other writer finishes while this one is between its write and rename
            write_archive(tmp_path, "ann", "p1", "same", first)

    monkeypatch.setattr(archive_mod.os, "fsync", fsync_then_race)
    with pytest.raises(FileExistsError):
        write_archive(tmp_path, "ann", "p1", "same", second)
    monkeypatch.undo()
    _, messages = read_archive(tmp_path / "var/sessions/ann/p1/same.jsonl.gz")
    assert messages == first
    assert [p.name for p in (tmp_path / "var/sessions/ann/p1").iterdir()] == ["same.jsonl.gz"]


def test_without_hard_links_an_archive_is_still_written_and_never_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some filesystems refuse hard links: publishing falls back to a checked rename."""

    def no_links(*args: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    first = [UserMessage(content=[TextContent(text="first")])]
    path = write_archive(tmp_path, "ann", "p1", "one", first)
    assert read_archive(path)[1] == first
    with pytest.raises(FileExistsError):
        write_archive(tmp_path, "ann", "p1", "one", [])
    assert read_archive(path)[1] == first
    assert [p.name for p in path.parent.iterdir()] == ["one.jsonl.gz"]


def test_a_long_history_is_archived_and_read_without_copies_of_it(tmp_path: Path) -> None:
    """Archiving a long history (a kill, a reset) must not hold it again several times as JSON
    text and bytes; reading one back holds the messages, not the whole text as well."""
    history: list[Message] = [UserMessage(content=[TextContent(text=f"{i} " + "x" * 10_000)]) for i in range(400)]
    size = 400 * 10_000
    tracemalloc.start()
    try:
        path = write_archive(tmp_path, "ann", "p1", "big", history)
        _, written_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        _, messages = read_archive(path)
        after, read_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert messages == history
    assert written_peak < size // 4, f"writing took {written_peak} bytes for a {size}-byte history"
    assert read_peak - after < size // 4, f"reading took {read_peak - after} bytes beyond the {after - before} kept"


def test_a_media_file_is_durable_once_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The message row that references a file is committed right after ``save``: the file's
    rename must be on disk by then (the folder synced), or a power cut leaves a dangling ref."""
    synced: list[str] = []
    real_fsync = os.fsync

    def record(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    MediaStore(tmp_path).save("ann", "p1", png_block())
    assert "dir" in synced[synced.index("file") + 1 :]


def test_an_unreadable_media_file_becomes_a_note_for_the_model(tmp_path: Path) -> None:
    """Any failure to read a stored file (not only a missing one) is a placeholder, never an
    exception out of the model call's preparation: that would fail every later run too."""
    store = MediaStore(tmp_path)
    ref = store.save("ann", "p1", png_block())
    path = tmp_path / ref.path
    path.unlink()
    path.mkdir()  # read_bytes: IsADirectoryError (as PermissionError would be, for another owner)
    (out,) = hydrate_media(store)([stored(ref)])
    assert isinstance(out, UserMessage)
    note = out.content[1]
    assert isinstance(note, TextContent) and "unavailable" in note.text


def test_a_media_file_of_another_size_is_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that is not the size its ref says is not read whole (it could be anything now)."""
    store = MediaStore(tmp_path)
    ref = store.save("ann", "p1", png_block())
    (tmp_path / ref.path).write_bytes(bytes(50 * 1024 * 1024))
    read: list[Path] = []
    real = Path.read_bytes

    def spy(self: Path) -> bytes:
        read.append(self)
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", spy)
    with pytest.raises(media_mod.MediaError, match="corrupt"):
        store.load(ref)
    assert read == []


def test_sending_the_image_again_repairs_a_corrupt_copy(tmp_path: Path) -> None:
    """A stored file damaged in place (same size) is the one thing a user can mend by sending the
    image again: the store must not keep the damaged copy because its size matches."""
    store = MediaStore(tmp_path)
    ref = store.save("ann", "p1", png_block())
    path = tmp_path / ref.path
    path.write_bytes(bytes(len(PNG)))
    assert store.save("ann", "p1", png_block()) == ref
    assert store.load(ref) == png_block()


async def test_an_image_sent_during_a_reset_survives_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Input sent while a reset runs waits for it and starts the fresh conversation: the image
    it stored before waiting must not be deleted with the old conversation's media."""
    from agentloop import Kernel, ScriptedModel

    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(["one", "two"]), workspace=tmp_path, daily_memory=False
    ) as k:
        proc = await k.spawn(owner="ann", text="hello")
        await proc.wait_idle()
        archiving = asyncio.Event()
        go_on = asyncio.Event()
        real_archive = k._archive

        async def slow_archive(*args: Any) -> Path | None:
            archiving.set()
            await go_on.wait()
            return await real_archive(*args)

        monkeypatch.setattr(k, "_archive", slow_archive)
        reset = asyncio.create_task(proc.reset())
        await archiving.wait()
        send = asyncio.create_task(proc.send("look at this", media=[png_block()]))
        await asyncio.sleep(0.05)  # the send has stored its image and waits for the reset
        go_on.set()
        await reset
        await send
        await proc.wait_idle()
        messages: list[Message] = await proc.messages()
        first = messages[0]
        assert isinstance(first, UserMessage)
        image = first.content[1]
        assert isinstance(image, ImageContent)
        assert k.media.load(MediaRef.of(image)) == png_block()
