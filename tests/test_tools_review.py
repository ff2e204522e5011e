"""A review of the built-in tools: each test reproduces a fault found in Read, Write, Edit, Delete,
Search or Shell (it failed before the fix beside it)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from agentloop.messages import TextContent
from agentloop.tools import fs
from agentloop.tools.base import ToolError, ToolResult
from agentloop.tools.fs import delete_file, edit_file, read_file, write_file
from agentloop.tools.search import search_files
from agentloop.tools.shell import run_shell

LINUX = sys.platform.startswith("linux")


def text(result: ToolResult) -> str:
    assert isinstance(result.content[0], TextContent)
    return result.content[0].text


# ------------------------------------------------------------------ paths


async def test_a_path_longer_than_the_system_allows_is_a_clear_error_without_the_servers_directory(
    tmp_path: Path,
) -> None:
    """Each name was short enough, but the whole path was over PATH_MAX: every tool raised a raw
    OSError (ENAMETOOLONG) that named the server's absolute directory."""
    (tmp_path / "f.txt").write_text("x\n")
    long = "a/" * 2100 + "x.txt"  # 4200 bytes: no system opens it
    calls: list[Callable[[], Awaitable[ToolResult]]] = [
        lambda: read_file(tmp_path, long),
        lambda: write_file(tmp_path, long, "hi"),
        lambda: edit_file(tmp_path, long, "x", "y"),
        lambda: delete_file(tmp_path, long),
        lambda: search_files(tmp_path, "x", long),
        lambda: run_shell(tmp_path, "true", cwd=long),
    ]
    for call_tool in calls:
        with pytest.raises(ToolError) as info:
            await call_tool()
        assert str(tmp_path) not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]


# ------------------------------------------------------------------ a FIFO put in a file's place


@pytest.fixture
def fifo_after_check(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path], None]:
    """Arm a swap: once the tool has checked that ``target`` is a regular file, another process
    replaces it with a FIFO (``rm f; mkfifo f`` in a Shell command running meanwhile)."""
    armed: list[Path] = []
    is_file = Path.is_file

    def checking(self: Path) -> bool:
        result = is_file(self)
        if armed and self == armed[0] and result:
            armed.clear()
            self.unlink()
            os.mkfifo(self)
        return result

    monkeypatch.setattr(Path, "is_file", checking)
    return lambda target: armed.__setitem__(slice(None), [target])


def _release(fifo: Path) -> None:
    """A reader still blocked opening ``fifo`` gets a writer, and then EOF: a failing test must
    not leave a thread the event loop's shutdown would wait for for ever."""
    with contextlib.suppress(OSError):  # (no reader waiting: nothing is blocked)
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("tool", ["read", "edit", "search"])
async def test_a_fifo_swapped_in_after_the_check_is_refused_not_blocked_on(
    tmp_path: Path, fifo_after_check: Callable[[Path], None], tool: str
) -> None:
    """Read, Edit and Search checked that the path was a regular file, then opened it by name: a
    FIFO put in its place meanwhile blocked the worker thread in open() for ever (a cancelled
    call cannot free it; a few such calls use up the thread pool every tool runs in)."""
    (tmp_path / "p.txt").write_text("hello\n")
    fifo_after_check(tmp_path / "p.txt")
    call_tool: Awaitable[ToolResult] = {
        "read": lambda: read_file(tmp_path, "p.txt"),
        "edit": lambda: edit_file(tmp_path, "p.txt", "hello", "bye"),
        "search": lambda: search_files(tmp_path, "hello", "p.txt"),
    }[tool]()
    try:
        result = await asyncio.wait_for(call_tool, 5)
    except ToolError as exc:
        assert "not a regular file" in str(exc)
    except TimeoutError:
        pytest.fail(f"{tool} blocked opening a FIFO")
    else:
        assert tool == "search" and "No matches" in text(result)  # skipped, as in a tree
    finally:
        _release(tmp_path / "p.txt")


# ------------------------------------------------------------------ Write


async def test_write_makes_no_directory_outside_through_a_directory_swapped_for_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Write made the missing parent directories by path (``mkdir -p``) after the check: a
    directory on the way turned into a symlink meanwhile had them made outside the workspace
    (the write itself was then refused, but the directories stayed)."""
    root, outside = tmp_path / "ws", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    resolve = fs.resolve_path

    def racing(base: str | Path, path: str, **kw: bool) -> Path:
        real = resolve(base, path, **kw)
        (root / "sub").symlink_to(outside)  # checked while sub did not exist ... then it is a link
        return real

    monkeypatch.setattr(fs, "resolve_path", racing)
    with pytest.raises(ToolError, match="outside the workspace"):
        await write_file(root, "sub/deep/f.txt", "pwned")
    assert list(outside.iterdir()) == []


async def test_write_to_the_root_itself_says_it_is_a_directory(tmp_path: Path) -> None:
    """``Write(".")`` blamed a directory that had changed on the way ("led outside the workspace"),
    which sends the model looking for a race that never was."""
    with pytest.raises(ToolError, match="is a directory"):
        await write_file(tmp_path, ".", "x")


# ------------------------------------------------------------------ Shell


def _running(pattern: str) -> list[str]:
    return subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()


@pytest.mark.skipif(not LINUX, reason="a run's processes are found through /proc")
async def test_a_child_that_left_the_session_and_dropped_its_environment_is_killed_too(tmp_path: Path) -> None:
    """A child that left the session (setsid) with an empty environment (env -i) carried neither
    the group nor the run's mark: it outlived the timeout, and an exit whose output it held, while
    the result said it had been killed. It still holds the command's output pipe: that finds it."""
    tag = f"{os.getpid() % 1000:03d}"
    try:
        result = await run_shell(tmp_path, f"setsid env -i sleep 8{tag}1 & sleep 30", timeout=1.0, kill_grace=0.5)
        assert result.details["timed_out"]
        held = await run_shell(tmp_path, f"setsid env -i sleep 8{tag}2 &", timeout=5, kill_grace=0.5)
        assert "were killed" in text(held)
        await asyncio.sleep(0.2)
        assert _running(f"^sleep 8{tag}[12]$") == []
    finally:
        for pid in _running(f"^sleep 8{tag}[12]$"):
            os.kill(int(pid), 9)


@pytest.mark.skipif(not LINUX, reason="a run's processes are found through /proc")
async def test_the_runtime_is_not_taken_for_a_holder_of_the_output(tmp_path: Path) -> None:
    """The runtime itself holds the read end of the same pipe: it must not count as a holder
    (SIGTERM to it would end this test run)."""
    result = await run_shell(tmp_path, "sleep 30", timeout=0.5, kill_grace=0.2)
    assert result.details["timed_out"]


@pytest.mark.skipif(not LINUX, reason="a run's processes are found through /proc")
def test_only_a_writer_of_the_output_counts_as_a_holder() -> None:
    """A process forked from the runtime may have inherited the reading end of a run's pipe; it
    is not one of the run's processes, and must not be killed with them."""
    from agentloop.tools.process_group import _holds

    read, write = os.pipe()
    pipe = frozenset({f"pipe:[{os.fstat(read).st_ino}]"})
    children = [subprocess.Popen(["sleep", "30"], pass_fds=(fd,)) for fd in (read, write)]
    os.close(read)
    os.close(write)
    try:
        assert [_holds(str(child.pid), pipe) for child in children] == [False, True]
    finally:
        for child in children:
            child.kill()
            child.wait()
