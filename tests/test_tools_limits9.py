"""Known limits of Read, Search's Python engine and Fetch, removed (the ninth review). Each test
failed before the change beside it:

- Read scanned from the first byte to ``offset`` on every call, so paging through a large log
  read it again and again (quadratic); it now starts from a remembered line checkpoint;
- Search's Python engine loaded each file whole (a log of gigabytes into the child's memory);
  it now reads line by line, with the same hits;
- Fetch returned a body declared ``text/*`` that holds NUL bytes as text, NULs and all;
- Read judged a file binary by its first 8 KB only, so NULs further on reached the model.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import shutil
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from agentloop.messages import TextContent
from agentloop.stamps import open_regular
from agentloop.tools import fs
from agentloop.tools.base import ToolError, ToolResult
from agentloop.tools.fetch import decode, fetch_url
from agentloop.tools.fs import read_file
from agentloop.tools.search import search_files
from agentloop.tools.search_python import Hit, clean_line, python_search


def text(result: ToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


# ------------------------------------------------------------------ Read: line checkpoints

LINES = 200_000


def numbered(count: int = LINES) -> bytes:
    return b"".join(b"%07d the quick brown fox.....\n" % n for n in range(1, count + 1))


class Counter:
    """Counts the bytes Read takes from the file, at the lowest level (the raw reads under the
    buffered file), whichever of read, readline or iteration asked for them."""

    def __init__(self) -> None:
        self.bytes = 0

    def opener(self) -> Callable[[str | os.PathLike[str]], BinaryIO]:
        counter = self

        class CountingFileIO(io.FileIO):
            def readinto(self, buffer: Any) -> int | None:
                n = super().readinto(buffer)
                counter.bytes += n or 0
                return n

        def open_counted(path: str | os.PathLike[str]) -> BinaryIO:
            with open_regular(path) as checked:  # (the FIFO check as Read's own open makes it)
                fd = os.dup(checked.fileno())
            return io.BufferedReader(CountingFileIO(fd, "rb"))

        return open_counted

    def take(self) -> int:
        n, self.bytes = self.bytes, 0
        return n


async def cold(tmp_path: Path, name: str, offset: int, limit: int) -> ToolResult:
    """What a Read with nothing remembered answers: the same bytes under a path never read."""
    fresh = tmp_path / f"cold-{offset}-{limit}-{name}"
    shutil.copyfile(tmp_path / name, fresh)
    try:
        return await read_file(tmp_path, fresh.name, offset, limit)
    finally:
        fresh.unlink()


def same(a: ToolResult, b: ToolResult) -> None:
    assert text(a) == text(b)
    assert {k: v for k, v in a.details.items() if k != "path"} == {k: v for k, v in b.details.items() if k != "path"}


def line_of(result: ToolResult, index: int = 0) -> str:
    return text(result).splitlines()[index]


async def test_a_later_page_starts_from_a_checkpoint_not_the_first_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading page N of a large file read every byte before it, on every call: paging through
    a log of gigabytes was quadratic. A later page now starts at most a checkpoint's spacing
    before its first line."""
    data = numbered()
    (tmp_path / "big.log").write_bytes(data)
    counter = Counter()
    monkeypatch.setattr(fs, "open_regular", counter.opener())

    first = await read_file(tmp_path, "big.log", 100_000, 50)
    assert counter.take() >= len(data)  # (cold: up to the page, then the rest counted)
    assert line_of(first) == "100000\t0100000 the quick brown fox....."

    later = await read_file(tmp_path, "big.log", 190_000, 50)
    assert counter.take() < len(data) // 3  # not from the first byte: from a checkpoint near it
    assert line_of(later) == "190000\t0190000 the quick brown fox....."
    assert line_of(later, 49) == "190049\t0190049 the quick brown fox....."

    earlier = await read_file(tmp_path, "big.log", 150_000, 50)
    assert counter.take() < len(data) * 2 // 3  # (from the checkpoint before line 150000)

    for page, (offset, limit) in ((first, (100_000, 50)), (later, (190_000, 50)), (earlier, (150_000, 50))):
        same(page, await cold(tmp_path, "big.log", offset, limit))
    last = await read_file(tmp_path, "big.log", LINES, 10)
    same(last, await cold(tmp_path, "big.log", LINES, 10))
    assert text(last) == f"{LINES}\t{LINES:07d} the quick brown fox....."
    with pytest.raises(ToolError, match=f"past the end of big.log, which has {LINES} lines"):
        await read_file(tmp_path, "big.log", LINES + 1, 10)


async def test_a_checkpoint_of_a_file_that_changed_is_not_used(tmp_path: Path) -> None:
    """A checkpoint is a byte position for a line number of one version of the file: used after
    a change, it would number every line wrong."""
    path = tmp_path / "big.log"
    path.write_bytes(numbered(100_000))
    await read_file(tmp_path, "big.log", 50_000, 10)  # (checkpoints up to the end)
    with path.open("r+b") as f:  # line 1 split in two: same size, every later line one number on
        f.seek(7)
        f.write(b"\n")
    moved = await read_file(tmp_path, "big.log", 90_000, 10)
    assert line_of(moved) == " 90000\t0089999 the quick brown fox....."
    same(moved, await cold(tmp_path, "big.log", 90_000, 10))

    with path.open("ab") as f:  # grown: the lines counted after the page too
        f.write(b"one more\n")
    grown = await read_file(tmp_path, "big.log", 90_000, 10)
    assert grown.details["total_lines"] == 100_002
    same(grown, await cold(tmp_path, "big.log", 90_000, 10))

    replaced = tmp_path / "other"
    replaced.write_bytes(numbered(100_000).replace(b"the quick", b"THE QUICK"))
    replaced.replace(path)  # (another file at the same path)
    again = await read_file(tmp_path, "big.log", 90_000, 10)
    assert line_of(again) == " 90000\t0090000 THE QUICK brown fox....."


async def test_pages_read_at_once_in_worker_threads_agree_with_cold_reads(tmp_path: Path) -> None:
    (tmp_path / "big.log").write_bytes(numbered(50_000))
    offsets = [49_990, 5, 40_000, 20_000, 45_000, 30_001, 35_000, 10_000]
    pages = await asyncio.gather(*(read_file(tmp_path, "big.log", n, 20) for n in offsets))
    again = await asyncio.gather(*(read_file(tmp_path, "big.log", n, 20) for n in reversed(offsets)))
    for offset, page, repeat in zip(offsets, pages, reversed(again), strict=True):
        assert line_of(page) == f"{offset:>6}\t{offset:07d} the quick brown fox....."
        same(page, repeat)
        same(page, await cold(tmp_path, "big.log", offset, 20))


def test_checkpoints_are_bounded_per_file_and_in_files() -> None:
    marks = fs._LineMarks(files=2, per_file=8)
    stamp = fs._Version((1, 2, 3, 4, 5))
    marks.add("a", stamp, [(n * 100 + 1, n * fs._MARK_BYTES) for n in range(1, 1000)])
    kept = marks.marks_of("a")
    assert 1 < len(kept) <= 8
    assert kept[-1][0] > 50_000  # thinned evenly, not cut off: the far end is still marked
    assert marks.nearest("a", stamp, 99_950) == max(m for m in kept if m[0] <= 99_950)
    assert marks.nearest("a", fs._Version((9, 9, 9, 9, 9)), 99_950) == (1, 0)  # another version of the file
    assert marks.marks_of("a") == []  # (and what was kept of the old one dropped)
    for key in ("a", "b", "c"):
        marks.add(key, stamp, [(101, fs._MARK_BYTES)])
    assert marks.marks_of("a") == [] and marks.marks_of("b") and marks.marks_of("c")  # the least recent went


# ------------------------------------------------------------------ Read: NULs past the first 8 KB


async def test_read_stops_a_page_at_a_line_holding_nul_bytes(tmp_path: Path) -> None:
    """The binary check looked at the first 8 KB only: a NUL further on went to the model."""
    head = [f"text line {n:05d}" for n in range(1, 1001)]  # ~16 KB, no NUL
    lines = [*head, "crashed\x00\x00\x00here", "after the crash", "and more"]
    (tmp_path / "app.log").write_bytes(("\n".join(lines) + "\n").encode())
    whole = await read_file(tmp_path, "app.log")
    shown = text(whole)
    assert not whole.is_error and "\x00" not in shown
    assert shown.splitlines()[999] == "  1000\ttext line 01000"
    assert "line 1001 holds NUL bytes" in shown and "offset=1002" in shown
    assert whole.details["lines"] == 1000 and whole.details["total_lines"] == 1003
    assert whole.details["binary_line"] == 1001

    with pytest.raises(ToolError, match=r"line 1001 of app.log holds NUL bytes.*offset=1002"):
        await read_file(tmp_path, "app.log", 1001)
    rest = await read_file(tmp_path, "app.log", 1002)
    assert text(rest) == "  1002\tafter the crash\n  1003\tand more"
    page = await read_file(tmp_path, "app.log", 990, 5)  # a page that ends before the NUL line
    assert "NUL" not in text(page) and "binary_line" not in page.details


# ------------------------------------------------------------------ Search: the Python engine streams


def old_engine(root: Path, regex: re.Pattern[str], cap: int) -> list[Hit]:
    """The engine as it was (each file loaded whole), for its results."""
    hits: list[Hit] = []
    for path in sorted(root.iterdir(), key=lambda p: p.name):
        data = path.read_bytes()
        if b"\x00" in data:
            continue
        parts = data.split(b"\n")
        if parts and parts[-1] == b"":
            parts.pop()
        for number, raw in enumerate(parts, start=1):
            line = raw.decode("utf-8", errors="replace")
            if regex.search(line):
                hits.append(Hit(path.name, number, clean_line(line)))
                if len(hits) >= cap:
                    return hits
    return hits


def test_the_python_engine_searches_a_large_file_without_loading_it_whole(tmp_path: Path) -> None:
    lines = [f"{n:07d} {'needle' if n % 997 == 0 else 'hay'} {'x' * 90}" for n in range(1, 80_001)]
    data = ("\n".join(lines) + "\n").encode()  # ~8 MB
    (tmp_path / "big.txt").write_bytes(data)
    regex = re.compile("needle")
    tracemalloc.start()
    try:
        hits = python_search(tmp_path, tmp_path, regex, None, 10_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert hits == old_engine(tmp_path, regex, 10_000)
    assert [h.line for h in hits] == list(range(997, 80_001, 997))
    assert peak < len(data) // 8  # a line at a time, never the file


def test_the_python_engine_keeps_its_results_at_the_edges(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"x1\r\n\r\nbad \xff\xfe x2\nlast x3 without a newline")
    (tmp_path / "b.txt").write_bytes(b"x4\n" * 5 + b"y" * 100_000 + b"\x00 late NUL: binary, no hits\n")
    (tmp_path / "c.txt").write_bytes(b"\n\nx5\n\n")
    (tmp_path / "d.txt").write_bytes(b"")
    (tmp_path / "e.txt").write_bytes(b"x" * 300_000 + b"\nx6\n")
    for pattern in ("x", r"^$", r"x\d$", r"\r$", "\ufffd"):
        regex = re.compile(pattern)
        for cap in (1, 3, 100):
            assert python_search(tmp_path, tmp_path, regex, None, cap) == old_engine(tmp_path, regex, cap), (
                pattern,
                cap,
            )


async def test_search_through_the_child_still_finds_by_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTLOOP_SEARCH", "python")
    (tmp_path / "f.txt").write_text("alpha\nbeta\ngamma beta\n")
    result = await search_files(tmp_path, "beta")
    assert "f.txt:2: beta" in text(result) and "f.txt:3: gamma beta" in text(result)


# ------------------------------------------------------------------ Fetch: NULs in a text body

ROUTES: dict[str, tuple[str, bytes]] = {
    "/nul.txt": ("text/plain", b"a header line\n\x00\x00\x00\x01 then binary \x00\xff"),
    "/nul.html": ("text/html; charset=utf-8", b"<html><body><p>hi\x00there</p></body></html>"),
    "/nul.json": ("application/json", b'{"a": "\x00"}'),
    "/utf16": ("text/plain; charset=utf-16", "h\u00e9llo".encode("utf-16")),
    "/utf16-bom": ("text/plain", "h\u00e9llo".encode("utf-16-be").join([b"\xfe\xff", b""])),
    "/plain": ("text/plain", b"just text"),
}


@pytest.fixture
async def site() -> AsyncIterator[str]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            ctype, body = ROUTES[head.split(b" ", 2)[1].decode()]
            top = ["HTTP/1.1 200 OK", f"Content-Type: {ctype}", f"Content-Length: {len(body)}", "Connection: close"]
            writer.write(("\r\n".join(top) + "\r\n\r\n").encode() + body)
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("path", ["/nul.txt", "/nul.html", "/nul.json"])
async def test_a_body_declared_text_that_holds_nul_bytes_is_binary(site: str, path: str) -> None:
    result = await fetch_url(site + path, allow=("127.0.0.1",))
    shown = text(result)
    size = len(ROUTES[path][1])
    assert not result.is_error and "\x00" not in shown
    assert f"[binary body: {ROUTES[path][0].split(';')[0]}, {size} bytes; not shown" in shown
    assert "NUL" in shown and result.details["bytes"] == size


async def test_text_in_utf16_is_still_text(site: str) -> None:
    """UTF-16 text holds NUL bytes (the high half of every ASCII character) but no NUL character:
    the check is made on the decoded text. A byte-order mark names the encoding when the header
    does not."""
    for path in ("/utf16", "/utf16-bom", "/plain"):
        shown = text(await fetch_url(site + path, allow=("127.0.0.1",)))
        assert "binary" not in shown and "\x00" not in shown
    assert text(await fetch_url(site + "/utf16-bom", allow=("127.0.0.1",))).endswith("h\u00e9llo")
    assert decode(b"\xff\xfeh\x00i\x00", "text/plain", False) == "hi"
