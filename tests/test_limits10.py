"""Two known limits removed (the tenth review):

- an OpenAI-compatible stream's ``event: error`` whose data is not JSON (a proxy's plain text, an
  HTML snippet) failed as an "unreadable response", not retried, and what the provider had said
  was lost: it is now reported in the provider's own words, of the kind they name;
- Read's line checkpoints were dropped at every change of the file, so a live log that keeps
  growing never kept any and paging through it was quadratic again: they now stay while the file
  has only been appended to, and are still dropped when it was rewritten.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from agentloop.events import RETRYABLE_KINDS
from agentloop.messages import TextContent
from agentloop.models.anthropic import AnthropicModel
from agentloop.models.openai_chat import OpenAIChatModel
from agentloop.stamps import open_regular
from agentloop.tools import fs
from agentloop.tools.base import ToolResult
from agentloop.tools.fs import read_file
from tests.fakes import anthropic_server as ant
from tests.fakes import openai_server as oai
from tests.fakes.anthropic_server import AnthropicFake
from tests.fakes.http_server import SSEReply, sse_frame
from tests.fakes.openai_server import OpenAIFake
from tests.test_providers_review7 import failure

# ------------------------------------------------------------------ 1. error events that are not JSON

KEY = "sk-test-0123456789abcdefghij"  # the model's own key: a server quoting it must not show it


@pytest.fixture(scope="module")
def ofake() -> Iterator[OpenAIFake]:
    with OpenAIFake() as fake:
        yield fake


@pytest.fixture(scope="module")
def afake() -> Iterator[AnthropicFake]:
    with AnthropicFake() as fake:
        yield fake


def error_event(data: str) -> str:
    """An ``event: error`` frame whose data is sent verbatim, one ``data:`` line per line."""
    return "event: error\n" + "".join(f"data: {line}\n" for line in data.split("\n")) + "\n"


NGINX_PAGE = (
    "<html>\n<head><title>502 Bad Gateway</title></head>\n<body>\n"
    "<center><h1>502 Bad Gateway</h1></center>\n<hr><center>nginx</center>\n</body>\n</html>"
)


@pytest.mark.parametrize(
    ("data", "kind", "words"),
    [
        ("upstream overloaded", "server", "stream error: upstream overloaded"),
        (NGINX_PAGE, "server", "stream error: 502 Bad Gateway 502 Bad Gateway nginx"),
        ("Too Many Requests: slow down", "rate_limit", "stream error: Too Many Requests: slow down"),
        (
            "This model's maximum context length is 8192 tokens",
            "overflow",
            "stream error: This model's maximum context length is 8192 tokens",
        ),
        (
            "the grammar you sent has no root rule",
            "invalid_response",
            "unreadable response: the provider sent text, not JSON: the grammar you sent has no root rule",
        ),
        ("HTTP/1.1 503", "server", "stream error: HTTP/1.1 503"),
        ("error code: 429", "rate_limit", "stream error: error code: 429"),
        (  # (a number, not a status)
            "n must be at most 500",
            "invalid_response",
            "unreadable response: the provider sent text, not JSON: n must be at most 500",
        ),
    ],
)
async def test_an_openai_error_event_that_is_not_json_says_what_the_provider_said(
    ofake: OpenAIFake, data: str, kind: str, words: str
) -> None:
    ofake.reset()
    ofake.push(SSEReply(frames=[sse_frame(oai.chunk({"role": "assistant", "content": "Hi"})), error_event(data)]))
    model = OpenAIChatModel("gpt-4o-mini", base_url=ofake.base_url, api_key=KEY)
    event = await failure(model)
    assert event.message.error_message == words
    assert event.kind == kind
    assert event.retryable is (kind in RETRYABLE_KINDS)


async def test_an_openai_error_event_text_is_trimmed_and_keeps_no_secret(ofake: OpenAIFake) -> None:
    ofake.reset()
    text = f"upstream rejected key {KEY} and token sk-proj-ABCDEFGHIJKLMNOPQRSTUVWX1234 " + "x" * 5000
    ofake.push(SSEReply(frames=[error_event(text)]))
    model = OpenAIChatModel("gpt-4o-mini", base_url=ofake.base_url, api_key=KEY)
    event = await failure(model)
    message = event.message.error_message or ""
    assert message.startswith("stream error: upstream rejected key ")
    assert KEY not in message and "ABCDEFGHIJKLMNOPQRSTUVWX1234" not in message
    assert len(message) < 400  # the start of what it said, not 5000 characters of it
    assert event.kind == "server"  # ("upstream": a proxy's backend failed)


async def test_an_openai_data_line_of_plain_text_is_taken_at_its_word_too(ofake: OpenAIFake) -> None:
    """A proxy's text in place of a chunk, with no event name, says what failed as an error event does."""
    ofake.reset()
    ofake.push(oai.stream(oai.chunk({"content": "ok"}), "upstream overloaded"))
    model = OpenAIChatModel("gpt-4o-mini", base_url=ofake.base_url, api_key=KEY)
    event = await failure(model)
    assert event.kind == "server" and event.message.error_message == "stream error: upstream overloaded"


async def test_an_openai_data_line_of_unknown_text_is_an_unreadable_response(ofake: OpenAIFake) -> None:
    ofake.reset()
    ofake.push(oai.stream(oai.chunk({"content": "ok"}), "%%% not a chunk"))
    model = OpenAIChatModel("gpt-4o-mini", base_url=ofake.base_url, api_key=KEY)
    event = await failure(model)
    assert event.kind == "invalid_response"
    assert event.message.error_message == "unreadable response: the provider sent text, not JSON: %%% not a chunk"


async def test_an_openai_error_event_with_a_json_object_is_read_as_before(ofake: OpenAIFake) -> None:
    ofake.reset()
    frame = sse_frame({"error": {"message": "upstream failed", "type": "server_error"}}, event="error")
    ofake.push(SSEReply(frames=[sse_frame(oai.chunk({"role": "assistant", "content": "Hi"})), frame]))
    model = OpenAIChatModel("gpt-4o-mini", base_url=ofake.base_url, api_key=KEY)
    event = await failure(model)
    assert event.kind == "server" and "upstream failed" in (event.message.error_message or "")


async def test_an_anthropic_error_event_that_is_not_json_says_what_the_provider_said(afake: AnthropicFake) -> None:
    """Anthropic's SDK already quotes such an event's text; checked so that it stays so."""
    afake.reset()
    reply = ant.stream(ant.message_start())
    reply.frames.append(error_event(f"upstream overloaded (key {KEY})"))
    afake.push(reply)
    model = AnthropicModel("claude-haiku-4-5", base_url=afake.base_url, api_key=KEY)
    event = await failure(model)
    message = event.message.error_message or ""
    assert "upstream overloaded" in message and KEY not in message
    assert event.kind == "server"


# ------------------------------------------------------------------ 2. checkpoints of a growing file


def numbered(first: int, count: int, word: bytes = b"the quick") -> bytes:
    return b"".join(b"%07d %s brown fox.....\n" % (n, word) for n in range(first, first + count))


LINES = 200_000


class Counter:
    """Counts the bytes Read takes from the file (the raw reads under the buffered file), and
    runs ``during`` once, when a Read has taken ``when`` bytes, as another process writing the
    file meanwhile would."""

    def __init__(self) -> None:
        self.bytes = 0
        self.during: Callable[[], None] | None = None
        self.when = 0

    def opener(self) -> Callable[[str | os.PathLike[str]], BinaryIO]:
        counter = self

        class CountingFileIO(io.FileIO):
            def readinto(self, buffer: Any) -> int | None:
                n = super().readinto(buffer)
                counter.bytes += n or 0
                if counter.during is not None and counter.bytes >= counter.when:
                    during, counter.during = counter.during, None
                    during()
                return n

        def open_counted(path: str | os.PathLike[str]) -> BinaryIO:
            with open_regular(path) as checked:
                fd = os.dup(checked.fileno())
            return io.BufferedReader(CountingFileIO(fd, "rb"))

        return open_counted

    def take(self) -> int:
        n, self.bytes = self.bytes, 0
        return n


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> Counter:
    counter = Counter()
    monkeypatch.setattr(fs, "open_regular", counter.opener())
    return counter


def text(result: ToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


async def cold(tmp_path: Path, name: str, offset: int, limit: int) -> ToolResult:
    """What a Read with nothing remembered answers: the same bytes under a path never read."""
    fresh = tmp_path / f"cold-{offset}-{limit}-{name}"
    shutil.copyfile(tmp_path / name, fresh)
    try:
        return await read_file(tmp_path, fresh.name, offset, limit)
    finally:
        fresh.unlink()


async def same_as_cold(tmp_path: Path, page: ToolResult, name: str, offset: int, limit: int) -> None:
    other = await cold(tmp_path, name, offset, limit)
    assert text(page) == text(other)
    assert {k: v for k, v in page.details.items() if k != "path"} == {
        k: v for k, v in other.details.items() if k != "path"
    }


def append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


def marks(path: Path) -> list[tuple[int, int]]:
    return fs._LINE_MARKS.marks_of(os.path.realpath(path))


async def test_checkpoints_stay_when_the_file_was_only_appended_to(tmp_path: Path, counter: Counter) -> None:
    """A live log's stamp changes with each line written: its checkpoints were dropped every
    time, and each page was read from the first byte again."""
    path = tmp_path / "live.log"
    path.write_bytes(numbered(1, LINES))
    size = path.stat().st_size
    await read_file(tmp_path, "live.log", 100_000, 50)
    assert counter.take() >= size  # (cold: the whole file, to count its lines)
    assert marks(path)

    append(path, numbered(LINES + 1, 100))
    page = await read_file(tmp_path, "live.log", 190_000, 50)
    assert counter.take() < size // 3  # from a checkpoint near the page, not from the first byte
    assert text(page).splitlines()[0] == "190000\t0190000 the quick brown fox....."
    assert page.details["total_lines"] == LINES + 100
    await same_as_cold(tmp_path, page, "live.log", 190_000, 50)

    append(path, b"a last line without its break")
    counter.take()  # (the cold read's)
    page = await read_file(tmp_path, "live.log", LINES + 100, 5)
    assert counter.take() < size // 3
    last = f"{LINES + 100}\t{LINES + 100:07d} the quick brown fox....."
    assert text(page) == f"{last}\n{LINES + 101}\ta last line without its break"
    await same_as_cold(tmp_path, page, "live.log", LINES + 100, 5)


async def test_checkpoints_found_while_the_file_grows_are_kept(tmp_path: Path, counter: Counter) -> None:
    """A log written to while a Read scans it: the checkpoints that Read found were thrown away
    (its stamp had changed by the end), so no Read of a busy log ever left any."""
    path = tmp_path / "busy.log"
    path.write_bytes(numbered(1, LINES))
    counter.during = lambda: append(path, numbered(LINES + 1, 10))
    counter.when = 2 * 1024 * 1024  # (past the page, while the rest is counted)
    first = await read_file(tmp_path, "busy.log", 100_000, 50)
    assert first.details["total_lines"] == LINES + 10  # (the lines appended meanwhile counted too)
    assert marks(path)
    counter.take()

    page = await read_file(tmp_path, "busy.log", 199_000, 20)
    assert counter.take() < path.stat().st_size // 3
    await same_as_cold(tmp_path, page, "busy.log", 199_000, 20)


async def test_checkpoints_go_when_earlier_bytes_were_rewritten(tmp_path: Path) -> None:
    """Appending to a file whose first line was split in two (every later line one number on):
    the file grew, but not by appending only."""
    path = tmp_path / "edited.log"
    path.write_bytes(numbered(1, 100_000))
    await read_file(tmp_path, "edited.log", 50_000, 10)
    assert marks(path)
    with path.open("r+b") as f:
        f.seek(7)
        f.write(b"\n")
    append(path, numbered(100_001, 10))
    page = await read_file(tmp_path, "edited.log", 90_000, 10)
    assert text(page).splitlines()[0] == " 90000\t0089999 the quick brown fox....."
    await same_as_cold(tmp_path, page, "edited.log", 90_000, 10)

    # a line inserted in the middle, the file no shorter: the head unchanged, every later line moved
    data = path.read_bytes()
    cut = data.index(b"0050000 the quick")
    with path.open("r+b") as f:
        f.write(data[:cut] + b"inserted\n" + data[cut:])
    page = await read_file(tmp_path, "edited.log", 90_000, 10)
    assert text(page).splitlines()[0] == " 90000\t0089998 the quick brown fox....."
    await same_as_cold(tmp_path, page, "edited.log", 90_000, 10)


async def test_checkpoints_go_when_the_file_was_truncated_and_grew_again(tmp_path: Path) -> None:
    """copytruncate: the log cut to nothing in place (same inode), then written past its old size
    before the next Read. Its first lines may well be the same as before (a banner, the same
    start): the bytes before its old end are not."""
    path = tmp_path / "rotated.log"
    path.write_bytes(numbered(1, 100_000))
    await read_file(tmp_path, "rotated.log", 60_000, 10)
    assert marks(path)
    with path.open("r+b") as f:
        f.truncate(0)
    append(path, numbered(1, 1000) + numbered(1, 120_000, word=b"a slower"))
    page = await read_file(tmp_path, "rotated.log", 90_000, 10)
    assert text(page).splitlines()[0] == " 90000\t0089000 a slower brown fox....."
    await same_as_cold(tmp_path, page, "rotated.log", 90_000, 10)
    assert page.details["total_lines"] == 121_000


def test_a_version_is_grown_into_only_by_appending(tmp_path: Path) -> None:
    path = tmp_path / "f.log"
    path.write_bytes(numbered(1, 100))
    with path.open("r+b") as f:
        fd = f.fileno()
        version = fs._Version.of(fd)
        assert version.grown_into(fd)  # (unchanged)
        append(path, b"more\n")
        assert version.grown_into(fd)
        assert not version.grown_into(None)  # (no file to look at: only the same stamp would do)
        os.pwrite(fd, b"X", 3200)  # a byte near the old end changed
        assert not version.grown_into(fd)
        os.pwrite(fd, numbered(1, 100)[3200:3201], 3200)
        assert version.grown_into(fd)
        os.pwrite(fd, b"X", 10)  # one near the start
        assert not version.grown_into(fd)
        os.pwrite(fd, b"e", 10)
        assert version.grown_into(fd)
        os.ftruncate(fd, version.stamp[2] - 1)  # shorter than it was
        assert not version.grown_into(fd)
