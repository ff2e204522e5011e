"""A hostile-input review of the built-in tools (the eighth): each test reproduces a fault found by
probing Write, Edit, Search, Shell, Jobs and Fetch with arguments a careless or hostile model can
send - lone surrogates (valid JSON, ``"\\ud800"``, but no UTF-8 form), NUL bytes, charsets that
name no text encoding, a file too large to edit in memory. Each failed before the fix beside it:
the call raised a raw exception (a ``UnicodeEncodeError``, a ``LookupError``) instead of a
``ToolError`` the model can act on, or did what it should have refused."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from agentloop.messages import TextContent
from agentloop.tools import fetch, fs, search_python
from agentloop.tools.base import ToolError, ToolResult
from agentloop.tools.fetch import decode, fetch_url
from agentloop.tools.fs import edit_file, read_file, write_file
from agentloop.tools.jobs import CommandJob, _input
from agentloop.tools.search import search_files
from agentloop.tools.shell import run_shell
from agentloop.tools.skills import skills_tool

LONE = "\ud800"  # a lone surrogate: json.loads gives it for "\ud800", and it has no UTF-8 form


def text(result: ToolResult) -> str:
    assert isinstance(result.content[0], TextContent)
    return result.content[0].text


# ------------------------------------------------------------------ Write and Edit


async def test_write_with_a_lone_surrogate_is_a_tool_error_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(ToolError, match="UTF-8"):
        await write_file(tmp_path, "w.txt", f"a{LONE}b")
    assert not (tmp_path / "w.txt").exists()


async def test_edit_with_a_lone_surrogate_is_a_tool_error_and_leaves_the_file(tmp_path: Path) -> None:
    (tmp_path / "e.txt").write_text("one\ntwo\n")
    with pytest.raises(ToolError, match="UTF-8"):
        await edit_file(tmp_path, "e.txt", "one", f"1{LONE}")
    assert (tmp_path / "e.txt").read_text() == "one\ntwo\n"


async def test_write_to_a_path_ending_in_a_slash_does_not_create_a_file(tmp_path: Path) -> None:
    """``newdir/`` names a directory: Write created a *file* ``newdir`` with the content."""
    with pytest.raises(ToolError, match="directory"):
        await write_file(tmp_path, "newdir/", "x")
    assert not (tmp_path / "newdir").exists()


async def test_edit_refuses_a_file_too_large_to_hold_in_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Edit read the whole file into memory, several copies of it: a 2 GB (sparse) text file took
    3.8 GB of the server's memory; a larger one would take the server down."""
    monkeypatch.setattr(fs, "MAX_EDIT_BYTES", 1000)
    big = tmp_path / "big.txt"
    big.write_text("line\n" * 400)  # 2000 bytes
    with pytest.raises(ToolError, match="1000"):
        await edit_file(tmp_path, "big.txt", "line\n", "LINE\n", replace_all=True)
    assert big.read_text() == "line\n" * 400
    (tmp_path / "small.txt").write_text("line\n")
    await edit_file(tmp_path, "small.txt", "line", "LINE")  # (under the limit: edited)
    assert (tmp_path / "small.txt").read_text() == "LINE\n"


# ------------------------------------------------------------------ Shell and Jobs


@pytest.mark.parametrize("command", ["echo a\x00b", f"echo {LONE}"])
async def test_shell_command_no_process_can_be_given_is_a_tool_error(tmp_path: Path, command: str) -> None:
    """A NUL byte raised ValueError (embedded null byte), a lone surrogate UnicodeEncodeError."""
    with pytest.raises(ToolError, match="command"):
        await run_shell(tmp_path, command, timeout=5)


async def test_shell_command_with_an_undecodable_byte_still_runs(tmp_path: Path) -> None:
    """A surrogate that stands for a byte (``surrogateescape``, as a non-UTF-8 file name comes
    back) is passed on as that byte, as before."""
    result = await run_shell(tmp_path, "printf %s \udcff | od -An -tx1", timeout=5)
    assert "ff" in text(result)


async def test_job_input_with_a_lone_surrogate_is_a_tool_error() -> None:
    with pytest.raises(ToolError, match="UTF-8"):
        await _input(CommandJob("bg-1", "cat"), f"a{LONE}", True, False)


# ------------------------------------------------------------------ Search


@pytest.mark.parametrize("use_rg", [None, False])
@pytest.mark.parametrize(("pattern", "glob"), [("a\x00", None), (f"a{LONE}", None), ("a", "*\x00"), ("a", f"*{LONE}")])
async def test_search_pattern_or_glob_no_search_can_take_is_a_tool_error(
    tmp_path: Path, pattern: str, glob: str | None, use_rg: bool | None
) -> None:
    """Given to ripgrep they raised ValueError (embedded null byte) or UnicodeEncodeError."""
    (tmp_path / "a.txt").write_text("a\n")
    with pytest.raises(ToolError, match=r"pattern|glob"):
        await search_files(tmp_path, pattern, glob=glob, use_rg=use_rg)


# ------------------------------------------------------------------ Fetch


@pytest.mark.parametrize("charset", ["rot13", "base64", "hex", "zlib", "uu_codec", "undefined", "idna"])
@pytest.mark.parametrize("html", [False, True])
def test_a_charset_that_is_no_text_encoding_is_read_as_utf8(charset: str, html: bool) -> None:
    """A server (or a page's ``<meta charset>``) naming one of Python's non-text codecs made the
    whole fetch fail with a LookupError or UnicodeError."""
    body = "héllo wörld".encode()
    if html:
        page = f"<html><head><meta charset='{charset}'></head><body>héllo wörld</body></html>".encode()
        assert "héllo wörld" in decode(page, "text/html", True)
    else:
        assert decode(body, f"text/plain; charset={charset}", False) == "héllo wörld"


def test_a_declared_text_charset_is_still_honoured() -> None:
    assert decode("héllo".encode("latin-1"), "text/plain; charset=latin-1", False) == "héllo"
    assert decode("hi".encode("utf-16"), "text/plain; charset=utf-16", False) == "hi"


async def test_a_url_with_a_lone_surrogate_is_a_tool_error() -> None:
    """httpx takes it, then fails to encode the request line: a UnicodeEncodeError."""
    with pytest.raises(ToolError, match="not a URL"):
        await fetch_url(f"http://example.com/{LONE}", resolve=_no_lookup)


@pytest.mark.parametrize("host", ["a" * 300 + ".com", "b" * 70 + ".example", "a..b.com"])
async def test_a_host_name_dns_cannot_take_is_a_tool_error(host: str) -> None:
    """A label over 63 characters, or an empty one, raised UnicodeError from the lookup (its IDNA
    encoding, made before any query is sent), for the first URL and every redirect alike."""
    with pytest.raises(ToolError, match="cannot resolve"):
        await fetch_url(f"http://{host}/")
    with pytest.raises(ToolError, match="cannot resolve"):
        await fetch.checked_addresses(fetch.checked_url(f"http://{host}/"), fetch.AllowList(), fetch.system_resolve)


async def test_a_post_body_with_a_lone_surrogate_is_a_tool_error() -> None:
    with pytest.raises(ToolError, match="UTF-8"):
        await fetch_url("http://example.com/", "POST", body=f"a{LONE}", resolve=_no_lookup)


async def _no_lookup(host: str, port: int) -> list[str]:
    """No test here may reach the network: a lookup means a check was missed."""
    await asyncio.sleep(0)
    raise AssertionError(f"looked up {host}")


# ------------------------------------------------------------------ Search's Python engine


def test_the_python_engine_does_not_read_through_a_symlink_swapped_in(tmp_path: Path) -> None:
    """The walk skips symlinks, but then read the file by name: a symlink put in its place after
    the walk looked (by a command racing it) was followed, out of the workspace."""
    outside = tmp_path / "outside.txt"
    outside.write_text("SECRET\n")
    root = tmp_path / "ws"
    root.mkdir()
    (root / "f.txt").symlink_to(outside)  # (the state after the swap)
    hits: list[search_python.Hit] = []
    search_python._search_file(root / "f.txt", "f.txt", re.compile("SECRET"), hits, 10)
    assert hits == []
    os.mkfifo(root / "fifo")  # (a FIFO swapped in: refused at once, not waited on)
    search_python._search_file(root / "fifo", "fifo", re.compile("x"), hits, 10)
    assert hits == []
    (root / "g.txt").write_text("SECRET\n")
    search_python._search_file(root / "g.txt", "g.txt", re.compile("SECRET"), hits, 10)
    assert [h.path for h in hits] == ["g.txt"]


# ------------------------------------------------------------------ Read


async def test_read_of_a_huge_file_counts_what_follows_the_page_within_a_bound(tmp_path: Path) -> None:
    """Read went through the whole file to count its lines for the "more lines" note: a Read of
    the first line of a 2 GB file took 7 s, of a 50 GB log minutes, in a worker thread no
    timeout can stop. It now counts within ``COUNT_BYTES`` after the page, and says so."""
    with (tmp_path / "huge.log").open("wb") as f:
        f.write(b"hello\n" * 3000)
        f.truncate(16 * 1024 * 1024 * 1024)  # sparse: no disk, but 16 GB to read through
    result = await asyncio.wait_for(read_file(tmp_path, "huge.log", limit=2), 20)
    assert text(result).startswith("     1\thello\n     2\thello\n… at least 2998 more lines")
    assert "use offset=3 to read on" in text(result)
    assert result.details["total_lines"] is None


async def test_read_counts_every_line_of_a_file_within_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fs, "_CHUNK", 7)
    monkeypatch.setattr(fs, "COUNT_BYTES", 50)
    (tmp_path / "a.txt").write_text("l1\nl2\nl3\nl4\nl5")  # no final line break: still a line
    result = await read_file(tmp_path, "a.txt", limit=1)
    assert text(result) == "     1\tl1\n… 4 more lines; use offset=2 to read on"
    assert result.details["total_lines"] == 5
    (tmp_path / "b.txt").write_text("x\n" * 100)  # 200 bytes: over the bound
    result = await read_file(tmp_path, "b.txt", offset=2, limit=1)
    assert re.search(r"… at least \d+ more lines \(counted in the next 50 bytes of 200\)", text(result))
    assert result.details["total_lines"] is None
    assert text(await read_file(tmp_path, "b.txt", offset=100)) == "   100\tx"


# ------------------------------------------------------------------ skills


def test_skill_files_offered_are_those_read_can_open(tmp_path: Path) -> None:
    """A FIFO in a skill's directory was listed among its files, then refused by ``read`` with a
    message that listed it again ("has no file 'pipe'. Its files: pipe, ...")."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "SKILL.md").write_text("---\ndescription: one\n---\nbody\n")
    (tmp_path / "s" / "ref.txt").write_text("ref\n")
    os.mkfifo(tmp_path / "s" / "pipe")
    tool = skills_tool([tmp_path])
    shown = tool.fn(**tool.validate({"action": "show", "name": "s"}))
    assert shown.details["files"] == ["ref.txt"]
    with pytest.raises(ToolError) as refused:
        tool.fn(**tool.validate({"action": "read", "name": "s", "path": "pipe"}))
    assert "Its files: ref.txt." in str(refused.value)


# ------------------------------------------------------------------ concurrent Write and Edit


async def test_concurrent_edits_of_one_file_all_take_effect(tmp_path: Path) -> None:
    """The calls of one model turn run concurrently: each Edit read the file, made its change and
    wrote it back, so the last one undid the others - all of them reporting success."""
    (tmp_path / "f.txt").write_text("".join(f"line{n}\n" for n in range(20000)))
    picked = range(0, 20000, 2500)
    results = await asyncio.gather(*(edit_file(tmp_path, "f.txt", f"line{n}\n", f"EDITED{n}\n") for n in picked))
    assert all(not r.is_error for r in results)
    content = (tmp_path / "f.txt").read_text()
    assert [n for n in picked if f"EDITED{n}\n" not in content] == []


async def test_a_write_during_an_edit_is_not_undone_by_it(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_text("old\n" + "pad\n" * 50000)
    edit = edit_file(tmp_path, "f.txt", "old\n", "edited\n")
    write = write_file(tmp_path, "f.txt", "written\n")
    outcomes = await asyncio.gather(edit, write, return_exceptions=True)
    content = (tmp_path / "f.txt").read_text()
    # either order is right: the Edit first, then the Write; or the Write first, the Edit then failing
    assert content == "written\n"
    assert isinstance(outcomes[0], ToolResult | ToolError)
    assert fs._writers == {}  # (the locks are let go)


# ------------------------------------------------------------------ a cancel while the command starts


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


async def _dead(pid: int, within: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + within
    while _alive(pid):
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
async def test_a_cancel_while_the_command_is_being_started_stops_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncio's process creation goes on after the fork; on a loaded machine the command has
    started children by the time it returns. A cancel (the runtime's timeout, an abort) that came
    then killed the shell alone and never reached the group kill: the children ran on (seen as
    ``sleep 1000`` left behind by the test suite on a busy 2-core machine)."""
    real = asyncio.create_subprocess_exec

    async def slow_to_return(*args: object, **kw: object) -> asyncio.subprocess.Process:
        proc = await real(*args, **kw)  # type: ignore[arg-type]
        await asyncio.sleep(1)  # (the parent resumes late; the command runs meanwhile)
        return proc

    monkeypatch.setattr(asyncio, "create_subprocess_exec", slow_to_return)
    task = asyncio.create_task(run_shell(tmp_path, "sleep 1000 & echo $! > pid; wait", timeout=30))
    pid_file = tmp_path / "pid"
    for _ in range(250):
        if pid_file.exists() and pid_file.read_text().strip():
            break
        await asyncio.sleep(0.02)
    pid = int(pid_file.read_text())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    try:
        assert await _dead(pid)
    finally:
        if _alive(pid):
            os.kill(pid, 9)
