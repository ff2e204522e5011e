"""The Shell tool (syscall ``shell.exec``): one command in a shell, inside the workspace.

The command runs in its own session and so its own process group: whatever it starts —
pipelines, ``make -j`` workers, ``sleep 1000 &`` — can be stopped together with ``killpg``, which
a timeout, the runtime's per-tool timeout and an abort (all of them cancel or end this coroutine)
rely on. Stopping is SIGTERM to the group, then SIGKILL to whatever is left after a short grace.

``asyncio``'s ``Process.wait()`` also waits for the output pipe to close, which a backgrounded
child can hold open forever; so the shell's exit is watched through ``returncode`` instead, and
children still holding the output a moment after the shell exited are killed. Children that
redirect their output (``server > log 2>&1 &``) are left running.

While a command runs its output is also reported as progress (``ToolContext.update``, which a
durable process publishes as ``proc.run.tool.update``): ``{"stream": "stdout", "delta": text}``
(stderr is merged into stdout, as in the result), at most one update per ``UPDATE_INTERVAL`` and
each at most ``MAX_DELTA_BYTES``, so a command that prints megabytes sends a few kilobytes of its
newest output (``skipped`` counts the characters left out before a delta). The result is the same
with or without anyone watching.

An output over ``max_output`` is cut in the middle for the result, but kept whole (up to
``process_group.MAX_KEPT_BYTES``) in a file under ``OUTPUT_DIR`` in the workspace, written as it
comes, which the cut names: the model reads the middle there with Read's offset/limit, where running
the command again could repeat its effects or print something else.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from agentloop.messages import TextContent
from agentloop.tools import sandbox as sandboxing
from agentloop.tools.base import (
    BackgroundRefused,
    FunctionTool,
    GroupStarted,
    ToolContext,
    ToolError,
    ToolResult,
    background_group,
    tool,
)
from agentloop.tools.jobs import CommandJob, JobRegistry
from agentloop.tools.paths import display, real_root, resolve_path
from agentloop.tools.process_group import (
    DRAIN_GRACE,
    KILL_GRACE,
    OUTPUT_DIR,
    KeptOutput,
    OutputCapture,
    close_transport,
    kill_group,
    marked,
    pump,
    spawn,
    supervise,
)
from agentloop.urls import carries_secret, secret_name

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_DELTA_BYTES",
    "MAX_OUTPUT_CHARS",
    "MAX_TIMEOUT",
    "UPDATE_INTERVAL",
    "OutputStream",
    "run_shell",
    "shell_tool",
]

log = logging.getLogger("agentloop.tools.shell")

DEFAULT_TIMEOUT = 60.0
MAX_TIMEOUT = 600.0
# a command run in the background (a build, a test suite, a long download) may take longer: the
# run goes on meanwhile, and the command's end comes to the model as a system event
DEFAULT_BACKGROUND_TIMEOUT = 1800.0
MAX_BACKGROUND_TIMEOUT = 3600.0
MAX_OUTPUT_CHARS = 30_000
# the output as it comes (``OutputStream``): at most one update per stream this often (seconds),
# each with at most this many bytes of UTF-8 text
UPDATE_INTERVAL = 0.1
MAX_DELTA_BYTES = 4096


# what a command is not given of the runtime's environment: its credentials (provider API keys,
# tokens, passwords) and its own settings. A server runs commands for every account, and
# ``printenv`` is a harmless read: the key it would show must not be there to show.
# (names as ``urls.secret_name`` reads them: SSH_AUTH_SOCK is the server's ssh-agent, which would
# sign in as the server's user anywhere; values with a URL that carries a credential)


def _withheld(name: str, value: str) -> bool:
    return name.startswith("AGENTLOOP_") or secret_name(name) or carries_secret(value)


def command_environment() -> dict[str, str]:
    """The environment a Shell command runs with: the runtime's, less its credentials."""
    env = {name: value for name, value in os.environ.items() if not _withheld(name, value)}
    env.update(PAGER="cat", GIT_PAGER="cat", GIT_TERMINAL_PROMPT="0")
    return env


def check_command(command: str) -> None:
    """``ToolError`` for a command no process can be given: empty, or with a NUL byte (an argument
    ends at one) or a lone surrogate (no bytes stand for it; one that stands for a byte, as a
    non-UTF-8 file name comes back, is that byte)."""
    if not command.strip():
        raise ToolError("command is empty")
    if "\x00" in command:
        at = command.index("\x00")
        raise ToolError(f"command has a NUL byte (character {at}), which no command line can hold")
    try:
        os.fsencode(command)
    except UnicodeEncodeError as exc:
        raise ToolError(f"command is not valid text: character {exc.start} is a lone surrogate") from None


def _shell() -> str:
    return shutil.which("bash") or "/bin/sh"


def refuse_unconfined(mode: str, what: str = "command") -> None:
    """``ToolError`` when the sandbox ``mode`` cannot be had here: the ``what`` must not run unconfined."""
    why = sandboxing.unavailable(mode)
    if why is not None:
        raise ToolError(
            f"the {what} was not run: the Shell sandbox (shell_sandbox = {mode!r}) is not available on this "
            f"machine: {why}"
        )


def confined_argv(
    mode: str,
    writable: Sequence[str | os.PathLike[str]],
    argv: Sequence[str],
    what: str = "command",
    readable: Sequence[str | os.PathLike[str]] = (),
) -> list[str]:
    """``argv`` under the sandbox ``mode`` (``sandbox.wrapper_argv``; a private mode may also read
    ``readable``); ``ToolError`` when it cannot be confined safely here (the interpreter that
    confines it lies where commands may write)."""
    try:
        return sandboxing.wrapper_argv(mode, writable, argv, readable)
    except sandboxing.Unconfinable as exc:
        raise ToolError(f"the {what} was not run: {exc}") from None


_warned: set[str] = set()


def _warn_if_unavailable(mode: str) -> None:
    """One warning per mode and runtime, when the tools are made, for a sandbox that cannot be had
    (every command will then be refused)."""
    why = sandboxing.unavailable(mode)
    if why is not None and mode not in _warned:
        _warned.add(mode)
        log.warning("shell_sandbox = %r is not available (%s): every Shell command will be refused", mode, why)


def sandbox_root(root: str | Path) -> Path:
    """The real path of a sandboxed command's workspace ``root``, which must be that path itself: a
    root reached through a symlink is refused (``ToolError``), as a command confined to a directory
    above it could have swapped that symlink in to widen what the next command may write."""
    base = real_root(root)
    if base != Path(os.path.abspath(os.path.expanduser(root))):
        raise ToolError(
            f"not run: the workspace {str(root)!r} is reached through a symlink (to {str(base)!r}); "
            "the Shell sandbox needs a workspace given by its real path"
        )
    return base


_TMP_PREFIX = "agentloop-sandbox-pid"
_swept_tmp = False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (someone else's process: alive)
        return True
    return True


def sweep_stale_tmp(folder: str | None = None) -> None:
    """Remove the private temporary directories a crashed runtime left behind.

    A directory is named after the runtime's pid, so one whose runtime is gone (and that this user
    owns) is nobody's: its command ended with that runtime. A pid since reused keeps its directory,
    which is only a leftover, never a removal of something in use."""
    try:
        entries = list(os.scandir(folder or tempfile.gettempdir()))
    except OSError:
        return
    for entry in entries:
        pid, _, _ = entry.name.removeprefix(_TMP_PREFIX).partition("-")
        if not entry.name.startswith(_TMP_PREFIX) or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            mine = entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.getuid()
        except OSError:
            continue
        if mine and not _alive(int(pid)):
            shutil.rmtree(entry.path, ignore_errors=True)


@contextlib.contextmanager
def private_tmp(mode: str) -> Iterator[str | None]:
    """A sandboxed command's own temporary directory (its ``$TMPDIR``, writable in the sandbox),
    removed when the command ends; None without a sandbox. The first one a runtime makes also
    sweeps away those a crashed runtime left (``sweep_stale_tmp``)."""
    global _swept_tmp
    if mode == "off":
        yield None
        return
    if not _swept_tmp:
        _swept_tmp = True
        sweep_stale_tmp()
    try:
        # (named after this runtime, so a later one can tell when it is gone; the wrapper wants real paths)
        path = os.path.realpath(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-"))
    except OSError as exc:
        raise ToolError(f"not run: no temporary directory for the sandbox: {exc}") from None
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


_DENIED = re.compile(r"Permission denied|Operation not permitted")


def _sandbox_note(mode: str) -> str:
    net = "; no TCP connections or listening" if sandboxing.is_offline(mode) else ""
    read = (
        "; they may read only the workspace, $TMPDIR, the system's directories and those shell_sandbox_read names"
        if sandboxing.is_private(mode)
        else ""
    )
    return (
        f"[sandbox {mode}: commands may write only inside the workspace and $TMPDIR{read}{net}; "
        "a 'Permission denied' elsewhere comes from it]"
    )


def _status(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class OutputStream:
    """A command's output as progress updates, while it runs: ``feed`` it the bytes as they are
    read, ``close`` it when the command has ended. ``update`` gets ``{"stream", "delta"}`` at once
    for the first output, then at most once per ``interval`` with what came meanwhile (a timer sends
    what waits when nothing more comes); a delta is at most ``max_bytes`` of UTF-8, the newest part
    of what waited, with ``skipped``: how many characters before it were left out. Text is decoded
    incrementally, so a character split between two reads is never mangled. Nothing here raises:
    an ``update`` that fails loses that update, never the command's output."""

    def __init__(
        self,
        update: Callable[[dict[str, Any]], None],
        stream: str = "stdout",
        *,
        interval: float = UPDATE_INTERVAL,
        max_bytes: int = MAX_DELTA_BYTES,
    ) -> None:
        self.update = update
        self.stream = stream
        self.interval = interval
        self.max_bytes = max(4, max_bytes)  # (room for one character of any width)
        self._loop = asyncio.get_running_loop()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self._skipped = 0
        self._last: float | None = None  # when the last update was sent
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    def feed(self, chunk: bytes) -> None:
        if self._closed:
            return
        try:
            self._add(self._decoder.decode(chunk))
            if not self._pending or self._timer is not None:
                return  # (a character still incomplete; or an update already due)
            now = self._loop.time()
            if self._last is None or now - self._last >= self.interval:
                self._send()
            else:
                self._timer = self._loop.call_later(self._last + self.interval - now, self._due)
        except Exception:  # only progress: the command's output is captured regardless
            log.debug("shell output not streamed", exc_info=True)

    def close(self) -> None:
        """The command ended: send what waits now (ahead of the call's result)."""
        self.cancel()
        try:
            self._add(self._decoder.decode(b"", final=True))
            self._send()
        except Exception:
            log.debug("shell output not streamed", exc_info=True)

    def cancel(self) -> None:
        """No more updates (the call ended, or is being stopped)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> None:
        self._timer = None
        self._send()

    def _add(self, text: str) -> None:
        if not text:
            return
        self._pending += text
        over = len(self._pending) - self.max_bytes  # (a character is one byte at least)
        if over > 0:
            self._pending = self._pending[over:]
            self._skipped += over

    def _send(self) -> None:
        text = self._pending
        if not text and not self._skipped:
            return
        data = text.encode("utf-8", errors="surrogatepass")
        if len(data) > self.max_bytes:  # wide characters: keep the newest whole ones that fit
            kept = data[-self.max_bytes :].decode("utf-8", errors="ignore")
            self._skipped += len(text) - len(kept)
            text = kept
        update: dict[str, Any] = {"stream": self.stream, "delta": text}
        if self._skipped:
            update["skipped"] = self._skipped
        self._pending, self._skipped = "", 0
        self._last = self._loop.time()
        try:
            self.update(update)
        except Exception:
            log.debug("a shell output update failed", exc_info=True)


class _StreamingCapture(OutputCapture):
    """The bounded capture of the result, that also feeds the live ``OutputStream``."""

    def __init__(self, max_chars: int, kept: KeptOutput, stream: OutputStream) -> None:
        super().__init__(max_chars, kept)
        self.stream = stream

    def feed(self, chunk: bytes) -> None:
        super().feed(chunk)
        self.stream.feed(chunk)


async def run_shell(
    root: str | Path,
    command: str,
    cwd: str = ".",
    timeout: float | None = None,  # noqa: ASYNC109 - the command's own limit, part of the syscall
    *,
    max_output: int = MAX_OUTPUT_CHARS,
    kill_grace: float = KILL_GRACE,
    max_timeout: float = MAX_TIMEOUT,
    started: GroupStarted | None = None,
    job: CommandJob | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    sandbox: str = "off",
    sandbox_read: Sequence[str | os.PathLike[str]] = (),
) -> ToolResult:
    """``shell.exec``: run ``command`` with its output captured; the group dies with it.
    ``started`` is awaited with the group and its mark once the command runs (before it is
    waited for), by whoever must be able to find the group again should this runtime die.
    A background ``job`` gets a stdin pipe (no stdin otherwise), the process and the output as
    they come, and may be stopped early (``job.stop_requested``), as a timeout stops it.
    ``progress`` (a ``ToolContext.update``) gets the output as it comes (``OutputStream``).
    With a ``sandbox`` mode other than ``off`` the command runs under Landlock (``tools/sandbox.py``),
    writable only beneath the root and a private ``$TMPDIR`` (in a private mode also readable only
    there, in the system and beneath ``sandbox_read``); where that cannot be had it is not run
    (``ToolError``)."""
    sandboxing.check_mode(sandbox)
    check_command(command)
    limit = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    if limit <= 0:
        raise ToolError("timeout must be positive")
    limit = min(limit, max_timeout)
    base = real_root(root)
    workdir = resolve_path(root, cwd or ".")
    if not workdir.is_dir():
        raise ToolError(f"cwd {cwd!r} is not a directory in the workspace")
    refuse_unconfined(sandbox)
    with private_tmp(sandbox) as tmp:
        environment = command_environment()
        argv = [_shell(), "-c", command]
        if tmp is not None:
            environment.update(TMPDIR=tmp, TMP=tmp, TEMP=tmp)
            argv = confined_argv(sandbox, [sandbox_root(root), tmp], argv, readable=sandbox_read)
        env, mark = marked(environment)
        proc = await spawn(
            mark,
            *argv,
            cwd=workdir,
            env=env,
            stdin=asyncio.subprocess.DEVNULL if job is None else asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        assert proc.stdout is not None
        streaming = OutputStream(progress) if progress is not None else None
        kept = KeptOutput(base)
        capture = (
            OutputCapture(max_output, kept) if streaming is None else _StreamingCapture(max_output, kept, streaming)
        )
        reader = asyncio.create_task(pump(proc.stdout, capture))
        if job is not None:
            job.attach(proc, capture)
        try:
            if started is not None:
                await started(proc.pid, mark)  # (start_new_session: the shell leads the group)
            outcome = await supervise(proc, reader, limit, None if job is None else job.stop_requested)
            if outcome != "exited":
                await kill_group(proc, kill_grace, mark)
                await asyncio.wait({reader}, timeout=DRAIN_GRACE)
        except BaseException:
            if streaming is not None:
                streaming.cancel()
            await kill_group(proc, kill_grace, mark)
            raise
        finally:
            reader.cancel()
            close_transport(proc)
            capture.close()  # (the full output's file, if it was cut, finished; or none)
    if streaming is not None:
        streaming.close()  # the last of the output goes out before the result
    output, truncated = capture.render()
    code = proc.returncode
    rel = display(base, workdir)
    details: dict[str, Any] = {"exit_code": code, "timed_out": outcome == "timeout", "truncated": truncated, "cwd": rel}
    if kept.path is not None:
        details["output_file"] = kept.path
    body = output.rstrip("\n") if output.strip() else "(no output)"
    if sandbox != "off":
        details["sandbox"] = sandbox
        if code != 0 and _DENIED.search(output):
            body = f"{body}\n{_sandbox_note(sandbox)}"
    if outcome == "timeout":
        note = f"[timed out after {limit:g} s; the command and its child processes were killed]"
        return ToolResult.text(f"{body}\n{note}", is_error=True, details=details)
    if outcome == "stopped":
        note = f"[stopped on request ({_status(code)}); the command and its child processes were killed]"
        return ToolResult.text(f"{body}\n{note}", is_error=True, details={**details, "stopped": True})
    note = f"[{_status(code)}]"
    if outcome == "held":
        note = f"[{_status(code)}; background processes still holding the output open were killed]"
    return ToolResult.text(f"{body}\n{note}", is_error=code != 0, details=details)


def shell_tool(
    root: str | Path, *, sandbox: str = "off", sandbox_read: Sequence[str | os.PathLike[str]] = ()
) -> FunctionTool:
    """The Shell tool, rooted at ``root``; ``sandbox`` (``tools/sandbox.py``: ``off``, ``workspace``,
    ``workspace-offline``, ``private``, ``private-offline``; ``ValueError`` for another) confines its
    commands, foreground and background; a private mode lets them read also beneath the directories
    ``sandbox_read`` names (given by their real paths). A sandbox this machine cannot give is logged
    once here, and each command refused."""
    sandboxing.check_mode(sandbox)
    _warn_if_unavailable(sandbox)
    readable = tuple(sandbox_read)
    confined = _sandbox_description(sandbox, readable)

    @tool(
        name="Shell",
        # a command watches a world that changes with time (a deploy's status, a pod list, a log after
        # `sleep 30`): the same command with the same answer is a poll, not a loop (``loop/retries.py``)
        repeatable=True,
        description=(
            "Run a shell command (bash) in the workspace and return its combined stdout and stderr and exit code. "
            "No stdin: interactive commands fail. Long output is cut in the middle; the full output is then "
            f"kept in a file under {OUTPUT_DIR}/ (the cut names it) that Read can page through with offset/limit. "
            "The command and every process it started are killed at the timeout; "
            "background processes must redirect their output (cmd > log 2>&1 &) to outlive it. "
            "With background=true the call returns at once and the command's output and exit code come to "
            "you later as a system message (for long builds or test runs; conversations kept by a server only); "
            "it gets a job id, and the Jobs tool shows its status and output meanwhile, writes to its stdin or "
            "stops it." + confined
        ),
    )
    async def shell(
        ctx: ToolContext,
        command: str,
        cwd: str = ".",
        timeout: Annotated[float | None, Field(gt=0, le=MAX_BACKGROUND_TIMEOUT)] = None,  # noqa: ASYNC109
        background: bool = False,
    ) -> ToolResult:
        """
        Args:
            command: The command line, run with bash -c.
            cwd: Working directory relative to the workspace root.
            timeout: Seconds before the command is killed (default 60, max 600; in the background
                default 1800, max 3600).
            background: Return at once; the output comes later as a system message.
        """
        if not background:
            if timeout is not None and timeout > MAX_TIMEOUT:
                raise ToolError(f"timeout is at most {MAX_TIMEOUT:g} s; a longer command can run with background=true")
            return await run_shell(
                root, command, cwd, timeout, progress=ctx.update, sandbox=sandbox, sandbox_read=readable
            )
        return start_in_background(ctx, root, command, cwd, timeout, sandbox=sandbox, sandbox_read=readable)

    return shell


def _sandbox_description(mode: str, readable: Sequence[str | os.PathLike[str]]) -> str:
    """What the model is told of the sandbox ``mode``, so it does not take a denial for a fault."""
    if mode == "off":
        return ""
    reads = "can read everything but"
    if sandboxing.is_private(mode):
        extra = "".join(f", {os.fspath(path)}" for path in readable)
        reads = f"can read only the workspace, $TMPDIR and the system's directories (/usr, /etc, ...{extra}) and"
    return (
        f" Commands run in a sandbox: they {reads} write only inside the workspace and $TMPDIR "
        "(a private temporary directory, removed when the command ends)"
        + ("; they cannot open TCP connections or listen." if sandboxing.is_offline(mode) else ".")
    )


def start_in_background(
    ctx: ToolContext,
    root: str | Path,
    command: str,
    cwd: str,
    timeout: float | None,
    *,
    sandbox: str = "off",
    sandbox_read: Sequence[str | os.PathLike[str]] = (),
) -> ToolResult:
    """Hand ``command`` to the runtime (``ToolContext.background``), checked first as a foreground
    one is, so a bad ``cwd`` (or a ``sandbox`` that cannot be had) is this call's error rather than a
    later message."""
    if ctx.background is None:  # (in memory, or on a device)
        raise ToolError(
            "background=true needs a conversation the runtime keeps (agentloop chat or serve), not run on a "
            "device: run it without"
        )
    check_command(command)
    if not resolve_path(root, cwd or ".").is_dir():
        raise ToolError(f"cwd {cwd!r} is not a directory in the workspace")
    refuse_unconfined(sandbox)
    limit = DEFAULT_BACKGROUND_TIMEOUT if timeout is None else timeout
    table = ctx.jobs if ctx.jobs is not None else JobRegistry().of("")  # (a runtime without Jobs)
    job = table.open(command)
    shown = job.shown

    async def work() -> str:
        output = await run_job(root, command, cwd, limit, job, sandbox=sandbox, sandbox_read=sandbox_read)
        return f"The background command `{shown}` (job {job.id}, call {ctx.tool_call_id}) has ended:\n{output}"

    try:
        ctx.background(work(), f"background command `{shown}`")
    except BackgroundRefused as exc:
        table.discard(job)
        raise ToolError(f"{exc}: wait for one to end, or run this one without background") from None
    return ToolResult.text(
        f"Started in the background as job {job.id}: `{shown}` (stopped after {limit:g} s). Its output and exit "
        "code will come to you as a system message when it ends; go on meanwhile. Its stdin stays open: the "
        "Jobs tool can show its status and output so far, write to its stdin (or close it), or stop it."
    )


async def run_job(
    root: str | Path,
    command: str,
    cwd: str,
    limit: float,
    job: CommandJob,
    *,
    sandbox: str = "off",
    sandbox_read: Sequence[str | os.PathLike[str]] = (),
) -> str:
    """Run a background job's command to its end (under ``sandbox``, as ``run_shell``), keeping the
    job's summary; the output and how it ended, as the model is told. A job stopped before its
    command started never starts it."""
    if job.stop_requested.is_set():
        job.finish(None, "stopped on request before it started", stopped=True)
        return "(no output)\n[stopped on request before it started]"
    started = background_group.get()  # (run by the runtime, which set it)
    try:
        result = await run_shell(
            root,
            command,
            cwd,
            limit,
            max_timeout=MAX_BACKGROUND_TIMEOUT,
            started=started,
            job=job,
            sandbox=sandbox,
            sandbox_read=sandbox_read,
        )
    except BaseException as exc:
        job.finish(None, f"failed to run ({type(exc).__name__})")
        raise
    details = result.details if isinstance(result.details, dict) else {}
    code = details.get("exit_code")
    job.finish(code, _ending(details), stopped=bool(details.get("stopped")))
    return "".join(b.text for b in result.content if isinstance(b, TextContent))


def _ending(details: dict[str, Any]) -> str:
    """How a command ended, in words, from its result's ``details``."""
    status = _status(details.get("exit_code"))
    if details.get("stopped"):
        return f"stopped on request ({status})"
    if details.get("timed_out"):
        return f"timed out ({status})"
    return status
