"""The Shell tool (syscall ``shell.exec``): one command in a shell, inside the workspace.

The command runs in its own session and so its own process group: whatever it starts —
pipelines, ``make -j`` workers, ``sleep 1000 &`` — can be stopped together with ``killpg``, which
a timeout, the runtime's per-tool timeout and an abort (all of them cancel or end this coroutine)
rely on. Stopping is SIGTERM to the group, then SIGKILL to whatever is left after a short grace.

``asyncio``'s ``Process.wait()`` also waits for the output pipe to close, which a backgrounded
child can hold open forever; so the shell's exit is watched through ``returncode`` instead, and
children still holding the output a moment after the shell exited are killed. Children that
redirect their output (``server > log 2>&1 &``) are left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Annotated

from pydantic import Field

from agentloop.tools.base import FunctionTool, ToolError, ToolResult, tool
from agentloop.tools.paths import display, real_root, resolve_path

__all__ = ["DEFAULT_TIMEOUT", "MAX_OUTPUT_CHARS", "MAX_TIMEOUT", "run_shell", "shell_tool"]

DEFAULT_TIMEOUT = 60.0
MAX_TIMEOUT = 600.0
MAX_OUTPUT_CHARS = 30_000
KILL_GRACE = 1.0  # seconds between SIGTERM and SIGKILL
DRAIN_GRACE = 0.3  # how long output may stay open after the shell exited
_POLL = 0.02


def _shell() -> str:
    return shutil.which("bash") or "/bin/sh"


class _Capture:
    """Combined stdout+stderr, bounded: the head and the tail are kept, the middle only counted."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.keep = 2 * max_chars  # bytes per end: enough for max_chars/2 chars of multi-byte text
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            if len(self.tail) > 2 * self.keep:
                del self.tail[: len(self.tail) - self.keep]

    def render(self) -> tuple[str, bool]:
        """The text (cut in the middle if too long) and whether it was cut."""
        half = self.max_chars // 2
        if self.total == len(self.head) + len(self.tail):
            text = (self.head + self.tail).decode("utf-8", errors="replace")
            if len(text) <= self.max_chars:
                return text, False
            omitted = len(text) - 2 * half
            return f"{text[:half]}\n… {omitted} chars omitted …\n{text[-half:]}", True
        head = self.head.decode("utf-8", errors="replace")[:half]
        tail = self.tail.decode("utf-8", errors="replace")[-half:]
        omitted = self.total - len(head.encode()) - len(tail.encode())
        return f"{head}\n… {omitted} bytes omitted …\n{tail}", True


async def _pump(stream: asyncio.StreamReader, capture: _Capture) -> None:
    while chunk := await stream.read(1 << 16):
        capture.feed(chunk)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process is left in the group.

    ``killpg(pgid, 0)`` also succeeds for zombies, which an init that does not reap leaves
    behind; on Linux /proc tells them apart.
    """
    if not sys.platform.startswith("linux"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


async def _kill_group(proc: asyncio.subprocess.Process, grace: float) -> None:
    """SIGTERM the group, SIGKILL what is left after ``grace``; SIGKILL is sent even if this
    coroutine is cancelled while it waits."""
    pgid = proc.pid
    loop = asyncio.get_running_loop()
    _signal_group(pgid, signal.SIGTERM)
    try:
        deadline = loop.time() + grace
        # Neither a group's emptiness nor an exit whose pipe is held open can be awaited: poll.
        while loop.time() < deadline and (proc.returncode is None or _group_alive(pgid)):  # noqa: ASYNC110
            await asyncio.sleep(_POLL)
    finally:
        _signal_group(pgid, signal.SIGKILL)
    deadline = loop.time() + 2.0
    while proc.returncode is None and loop.time() < deadline:  # noqa: ASYNC110 - the child watcher reaps it
        await asyncio.sleep(_POLL)


async def _supervise(proc: asyncio.subprocess.Process, reader: asyncio.Task[None], limit: float) -> str:
    """Wait for the command: ``"exited"``, ``"held"`` (exited, but children keep the output
    open) or ``"timeout"``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    exited_at: float | None = None
    while not reader.done():
        now = loop.time()
        if now >= deadline:
            return "timeout"
        if proc.returncode is not None:
            exited_at = now if exited_at is None else exited_at
            if now - exited_at >= DRAIN_GRACE:
                return "held"
        await asyncio.wait({reader}, timeout=min(0.05, deadline - now))
    while proc.returncode is None:  # output closed; the shell is exiting or detached its output
        if loop.time() >= deadline:
            return "timeout"
        await asyncio.sleep(_POLL)
    return "exited"


def _close(proc: asyncio.subprocess.Process) -> None:
    """Release the pipe transport even if a detached process still holds the other end."""
    transport = getattr(proc, "_transport", None)
    if transport is not None:
        transport.close()


def _status(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


async def run_shell(
    root: str | Path,
    command: str,
    cwd: str = ".",
    timeout: float | None = None,  # noqa: ASYNC109 - the command's own limit, part of the syscall
    *,
    max_output: int = MAX_OUTPUT_CHARS,
    kill_grace: float = KILL_GRACE,
) -> ToolResult:
    """``shell.exec``: run ``command`` with its output captured; the group dies with it."""
    if not command.strip():
        raise ToolError("command is empty")
    limit = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    if limit <= 0:
        raise ToolError("timeout must be positive")
    limit = min(limit, MAX_TIMEOUT)
    base = real_root(root)
    workdir = resolve_path(root, cwd or ".")
    if not workdir.is_dir():
        raise ToolError(f"cwd {cwd!r} is not a directory in the workspace")
    env = {**os.environ, "PAGER": "cat", "GIT_PAGER": "cat", "GIT_TERMINAL_PROMPT": "0"}
    proc = await asyncio.create_subprocess_exec(
        _shell(),
        "-c",
        command,
        cwd=workdir,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    assert proc.stdout is not None
    capture = _Capture(max_output)
    reader = asyncio.create_task(_pump(proc.stdout, capture))
    try:
        outcome = await _supervise(proc, reader, limit)
        if outcome != "exited":
            await _kill_group(proc, kill_grace)
            await asyncio.wait({reader}, timeout=DRAIN_GRACE)
    except BaseException:
        await _kill_group(proc, kill_grace)
        raise
    finally:
        reader.cancel()
        _close(proc)
    output, truncated = capture.render()
    code = proc.returncode
    rel = display(base, workdir)
    details = {"exit_code": code, "timed_out": outcome == "timeout", "truncated": truncated, "cwd": rel}
    body = output.rstrip("\n") if output.strip() else "(no output)"
    if outcome == "timeout":
        note = f"[timed out after {limit:g} s; the command and its child processes were killed]"
        return ToolResult.text(f"{body}\n{note}", is_error=True, details=details)
    note = f"[{_status(code)}]"
    if outcome == "held":
        note = f"[{_status(code)}; background processes still holding the output open were killed]"
    return ToolResult.text(f"{body}\n{note}", is_error=code != 0, details=details)


def shell_tool(root: str | Path) -> FunctionTool:
    @tool(
        name="Shell",
        description=(
            "Run a shell command (bash) in the workspace and return its combined stdout and stderr and exit code. "
            "No stdin: interactive commands fail. Long output is cut in the middle. "
            "The command and every process it started are killed at the timeout; "
            "background processes must redirect their output (cmd > log 2>&1 &) to outlive it."
        ),
    )
    async def shell(
        command: str,
        cwd: str = ".",
        timeout: Annotated[float | None, Field(gt=0, le=MAX_TIMEOUT)] = None,  # noqa: ASYNC109
    ) -> ToolResult:
        """
        Args:
            command: The command line, run with bash -c.
            cwd: Working directory relative to the workspace root.
            timeout: Seconds before the command is killed (default 60, max 600).
        """
        return await run_shell(root, command, cwd, timeout)

    return shell
