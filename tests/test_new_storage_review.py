"""Review of the memory tool, the image header checks and the pruning of a reset: the cases the
first tests left out (real-world image variants a decoder takes, a memory folder with one bad or
huge day, a ``forget`` whose text is in every entry's heading)."""

from __future__ import annotations

import base64
import datetime
import os
import struct
from pathlib import Path

import pytest

from agentloop.images import image_size
from agentloop.messages import ImageContent
from agentloop.process.media import check_media
from agentloop.process.memory import MAX_DAY_BYTES, append_daily_memory, daily_memory_name
from agentloop.process.prompt import PromptSources, assemble_prompt
from agentloop.tools.base import ToolError
from tests.image_support import jpeg
from tests.test_memory_tool import DAY, at, use

# ---------------------------------------------------------------------------------------- images


def _gif(screen: tuple[int, int], frame: tuple[int, int], *, extension: bool) -> bytes:
    """A GIF whose logical screen and first frame have the given sizes: a global colour table of
    four entries, optionally a graphic control extension (animated GIFs have one per frame), then
    the frame's descriptor and its pixels (a 7x5 frame's, as Pillow writes them)."""
    head = b"GIF89a" + struct.pack("<HHBBB", *screen, 0x81, 0, 0) + b"\x00\x00\x00\xff\xff\xff" + bytes(6)
    control = b"\x21\xf9\x04\x04\x0a\x00\x00\x00" if extension else b""
    descriptor = b"\x2c" + struct.pack("<HHHHB", 0, 0, *frame, 0)
    return head + control + descriptor + b"\x08\x0c\x00\x01\x08\x1cH\xb0\xa0\xc1\x83\x07\x03\x02\x00;"


@pytest.mark.parametrize("extension", [False, True])
def test_a_gif_with_a_zero_logical_screen_has_its_frames_size(extension: bool) -> None:
    # some encoders write 0x0 as the logical screen; decoders (browsers, Pillow) take the frame's
    data = _gif((0, 0), (7, 5), extension=extension)
    assert image_size(data) == (7, 5)
    check_media(ImageContent(data=base64.b64encode(data).decode(), mime_type="image/gif"))  # not refused
    assert image_size(_gif((0, 0), (0, 5), extension=extension)) is None  # a frame of no pixels still is
    assert image_size(_gif((0, 0), (7, 5), extension=extension)[:20]) is None  # cut before the frame


def test_a_jpeg_with_stray_bytes_before_a_marker_has_its_size() -> None:
    # libjpeg skips bytes before a marker with a warning ("extraneous bytes before marker") and
    # decodes the image; some cameras and editors write them
    photo = jpeg(640, 480)
    frame = photo.index(b"\xff\xc0")
    assert image_size(photo[:frame] + b"\x00\x00\x0d\x0a" + photo[frame:]) == (640, 480)
    assert image_size(b"\xff\xd8\xff\xe0\x00\x10" + bytes(14) + b"garbage without a marker") is None


# ---------------------------------------------------------------------------------------- memory


async def test_one_unreadable_day_does_not_stop_the_search_of_the_others(tmp_path: Path) -> None:
    append_daily_memory(tmp_path, "- The API listens on port 8443.", at(DAY))
    bad = tmp_path / daily_memory_name(DAY + datetime.timedelta(days=1))
    bad.write_bytes(b"### From the agent (09:00)\n\nport \xff\xfe not UTF-8\n")
    found = await use(tmp_path, action="search", query="port")
    assert "[2026-03-04]" in found and "8443" in found
    assert "2026-03-05" in found  # named as skipped, so the model knows a day went unread


async def test_forget_matches_what_an_entry_says_not_its_heading(tmp_path: Path) -> None:
    append_daily_memory(tmp_path, "- Alice prefers tabs.", at(DAY, 9), source="the agent")
    append_daily_memory(tmp_path, "- The agent config lives in /etc/agent.", at(DAY, 10), source="the agent")
    append_daily_memory(tmp_path, "- Deploys happen at 09:30.", at(DAY, 11))
    assert await use(tmp_path, action="forget", day=DAY.isoformat(), text="agent") == "Forgot 1 entry of 2026-03-04."
    kept = (tmp_path / daily_memory_name(DAY)).read_text()
    assert "Alice prefers tabs." in kept and "/etc/agent" not in kept
    with pytest.raises(ToolError, match="no entry"):
        await use(tmp_path, action="forget", day=DAY.isoformat(), text="### From")  # (every heading has it)
    with pytest.raises(ToolError, match="no entry"):
        await use(tmp_path, action="forget", day=DAY.isoformat(), text="09:00")  # (a heading's time)
    assert "Alice prefers tabs." in (tmp_path / daily_memory_name(DAY)).read_text()


async def test_remember_stops_before_the_day_is_too_large_to_read_back(tmp_path: Path) -> None:
    today = datetime.date.today()
    day_file = tmp_path / daily_memory_name(today)
    append_daily_memory(tmp_path, "- an early fact", at(today))
    with day_file.open("a") as f:
        f.write("x" * (MAX_DAY_BYTES - day_file.stat().st_size - 100))
    with pytest.raises(ToolError, match="full"):
        await use(tmp_path, action="remember", text="one fact too many " * 20)
    assert day_file.stat().st_size <= MAX_DAY_BYTES
    assert "an early fact" in await use(tmp_path, action="read", day=today.isoformat())  # still readable
    await use(tmp_path, action="forget", day=today.isoformat(), text="xxxx")  # and room is made this way
    assert "Remembered" in await use(tmp_path, action="remember", text="one fact too many")


def test_a_huge_day_file_is_not_put_whole_into_every_prompt(tmp_path: Path) -> None:
    for n in range(400):  # ~ 400 KB: a day of many compactions, or of an agent remembering in a loop
        append_daily_memory(tmp_path, f"- fact {n}: " + "y" * 1000, at(DAY))
    assembled = assemble_prompt(PromptSources(owner_home=tmp_path), today=DAY)
    assert len(assembled.text.encode()) < 64 * 1024
    assert "fact 399:" in assembled.text and "fact 0:" not in assembled.text  # the newest are shown
    assert "memory" in assembled.text.rsplit("fact 399", 1)[0]  # and it says where the rest is


async def test_a_temporary_left_by_a_crashed_forget_does_not_block_later_ones(tmp_path: Path) -> None:
    # a server killed mid-forget leaves its temporary; a restarted one often has the same pid (1, in
    # a container), and creating the file exclusively failed that day's every forget from then on
    append_daily_memory(tmp_path, "- Alice prefers tabs.", at(DAY))
    append_daily_memory(tmp_path, "- Bob prefers spaces.", at(DAY))
    (tmp_path / "memory" / f".{DAY.isoformat()}.md.{os.getpid()}.tmp").write_text("half a rewrite")
    assert await use(tmp_path, action="forget", day=DAY.isoformat(), text="Bob") == "Forgot 1 entry of 2026-03-04."
    assert "Bob" not in (tmp_path / daily_memory_name(DAY)).read_text()
    assert sorted(p.name for p in (tmp_path / "memory").iterdir()) == ["2026-03-04.md"]
