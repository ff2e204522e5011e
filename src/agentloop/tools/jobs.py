"""Background commands while they run (Shell ``background=true``), and the ``Jobs`` tool through
which the model looks after them: lists them, asks how one is doing, reads its output so far,
writes to its stdin, or stops it. Without it the model would only hear of a command at its end,
and could neither answer a prompt it waits on nor end one that hangs.

Each command started in the background gets a short id (``bg-3f2a``) that the start message
names. Jobs live in the memory of the runtime that runs them, one table per process
(``JobRegistry``): a job of another process is no job of this one, a reset or kill forgets them
with the conversation, and a restart ends them all (``process/background.py`` then tells the model
they did not finish), so their ids are unknown afterwards. An ended job is kept only as a summary
(how it ended, for how long it ran, how much it wrote), for ``status`` and ``list``: its output went
to the model with its end, which still comes exactly once, as a system event.

Approval: the tool's syscall is ``shell.jobs``. ``list``, ``status`` and ``output`` only read;
``input`` and ``stop`` act, but on a command this process itself started, whose start was judged
already, so they are only ``mutating`` (a policy may ask about them with a rule on that tag; the
default policy does not). Input to an interpreter (``bash``, ``python3``) is a program, but such a
command reading its program from stdin is ``unclassified`` when it starts, which the default
policy asks about: whoever allowed it allowed what it reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import time
from collections.abc import Collection
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import Field

from agentloop.tools.base import FunctionTool, ToolArgumentsError, ToolContext, ToolError, ToolResult, utf8
from agentloop.tools.process_group import KILL_GRACE, OutputCapture

__all__ = ["MAX_ENDED", "SYSCALL", "CallKey", "CommandJob", "JobRegistry", "JobTable", "jobs_tool"]

SYSCALL = "shell.jobs"
PREFIX = "bg-"
MAX_ENDED = 16  # ended jobs a process keeps (as summaries), the latest started
PAGE_BYTES = 30_000  # one page of output: the Shell's output cap
MAX_INPUT_CHARS = 65_536
INPUT_WAIT = 5.0  # how long a write waits for the command to read it before the call returns
STOP_WAIT = KILL_GRACE + 5.0  # how long a stop waits for the command's end (SIGTERM, grace, SIGKILL)

Action = Literal["list", "status", "output", "input", "stop"]

# the tool call that started a job: (its run's id, its tool call id), as the history names the call
# (a rewind that takes the call out stops the jobs it started: ``JobRegistry.forget_calls``)
CallKey: TypeAlias = tuple[str, str]


class CommandJob:
    """One command started in the background: while it runs, its process, stdin and output as
    far as it came; once it ended, a summary only (its output went with the end)."""

    def __init__(self, job_id: str, command: str, call: CallKey | None = None) -> None:
        self.id = job_id
        self.command = command
        self.call = call  # the tool call that started it (None: started outside a durable run)
        self.stop_requested = asyncio.Event()  # watched by ``supervise``: a stop ends the command
        self.done = asyncio.Event()
        self._began = asyncio.Event()  # the command runs, or the job ended without it
        self.started: float | None = None
        self.ended: float | None = None
        self.exit_code: int | None = None
        self.ending = ""  # how it ended, in words ("exit code 0", "stopped on request (…)")
        self.stopped = False
        self.stdin_closed = False
        self._bytes = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._capture: OutputCapture | None = None

    @property
    def shown(self) -> str:
        """The command as messages name it: its first 200 characters."""
        return self.command if len(self.command) <= 200 else self.command[:200] + "…"

    @property
    def state(self) -> str:
        if self.ended is not None:
            return "ended"
        return "starting" if self._proc is None else "running"

    def attach(self, proc: asyncio.subprocess.Process, capture: OutputCapture) -> None:
        """The command runs: ``run_shell`` hands over its process and output capture."""
        self._proc, self._capture, self.started = proc, capture, time.monotonic()
        self._began.set()

    def finish(self, code: int | None, ending: str, *, stopped: bool = False) -> None:
        """The command ended: keep the summary, let go of the process and its output."""
        if self.ended is not None:
            return
        self._bytes = self.bytes_so_far()
        self.exit_code, self.ending, self.stopped = code, ending, stopped
        self.ended = time.monotonic()
        self._proc = self._capture = None
        self._began.set()
        self.done.set()

    def runtime(self) -> float:
        """Seconds the command has run (or ran): none before it started."""
        if self.started is None:
            return 0.0
        return (self.ended if self.ended is not None else time.monotonic()) - self.started

    def bytes_so_far(self) -> int:
        return self._capture.total if self._capture is not None else self._bytes

    def kept_file(self) -> str | None:
        """While it runs, the file its whole output is being written to (once the output outgrew what
        is held in memory: ``process_group.KeptOutput``), relative to the workspace."""
        kept = self._capture.kept if self._capture is not None else None
        return kept.path if kept is not None else None

    def output_so_far(self) -> str:
        """The output while it runs, cut in the middle as its end will be ("" once ended)."""
        return self._capture.render()[0] if self._capture is not None else ""

    def page(self, offset: int | None) -> tuple[int, int, bytes]:
        """A page of the output while it runs: where it was asked from (the tail's start for
        None), where it starts (later, past output not kept) and its bytes."""
        capture = self._capture
        if capture is None:
            return 0, 0, b""
        wanted = max(0, capture.total - PAGE_BYTES) if offset is None else offset
        start, data = capture.span(wanted, PAGE_BYTES)
        return wanted, start, data

    async def write(self, data: bytes, eof: bool) -> bool:
        """Write ``data`` to the command's stdin and close it after if ``eof``; whether the command
        took it all within ``INPUT_WAIT`` (the rest waits in the pipe). Input sent just after the
        start waits for the command to run: the model may answer a prompt it expects at once."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._began.wait(), INPUT_WAIT)
        stdin = self._stdin()
        try:
            stdin.write(data)
            try:
                await asyncio.wait_for(stdin.drain(), INPUT_WAIT)
                taken = True
            except TimeoutError:
                taken = False
        except (BrokenPipeError, ConnectionResetError):
            self.stdin_closed = True
            raise ToolError(f"{self.id} no longer reads its input: it closed its stdin") from None
        if eof:
            stdin.close()
            self.stdin_closed = True
        return taken

    def _stdin(self) -> asyncio.StreamWriter:
        if self.state == "ended":
            raise ToolError(f"{self.id} has ended ({self.ending}): it reads no more input")
        if self._proc is None:
            raise ToolError(f"{self.id} is still starting: try again in a moment")
        if self.stdin_closed or self._proc.stdin is None:
            raise ToolError(f"{self.id}'s input was closed (eof): it reads no more")
        return self._proc.stdin

    async def stop(self) -> bool:
        """End the command as its timeout would; whether it ended within ``STOP_WAIT``."""
        self.stop_requested.set()
        try:
            await asyncio.wait_for(self.done.wait(), STOP_WAIT)
        except TimeoutError:
            return False
        return True


class JobRegistry:
    """The background commands of every process this runtime runs, by process. In memory only
    (a restart ends them), and only for processes that started one."""

    def __init__(self) -> None:
        self._jobs: dict[str, dict[str, CommandJob]] = {}

    def of(self, pid: str, call: CallKey | None = None) -> JobTable:
        """``pid``'s jobs, as tool call ``call`` sees them: the jobs it opens are filed as its."""
        return JobTable(self._jobs, pid, call)

    def drop(self, pid: str) -> None:
        """Forget the jobs of ``pid`` (its reset or kill: they belong to the conversation cleared)."""
        self._jobs.pop(pid, None)

    def forget_calls(self, pid: str, calls: Collection[CallKey]) -> None:
        """Forget the jobs of ``pid`` that the tool calls ``calls`` started (a rewind took those
        calls out of the conversation, which no longer knows of their jobs)."""
        own = self._jobs.get(pid, {})
        for job_id in [job_id for job_id, job in own.items() if job.call in calls]:
            del own[job_id]
        if not own:
            self._jobs.pop(pid, None)


class JobTable:
    """One process's jobs: all that its tool calls can see or reach (``ToolContext.jobs``)."""

    def __init__(self, jobs: dict[str, dict[str, CommandJob]], pid: str, call: CallKey | None = None) -> None:
        self._jobs = jobs
        self._pid = pid
        self._call = call

    def open(self, command: str) -> CommandJob:
        """A new job for ``command``, under an id none of the process's jobs has, filed as the
        table's tool call's."""
        own = self._jobs.setdefault(self._pid, {})
        _prune(own)
        job_id = PREFIX + secrets.token_hex(2)
        while job_id in own:
            job_id = PREFIX + secrets.token_hex(2)
        own[job_id] = job = CommandJob(job_id, command, self._call)
        return job

    def discard(self, job: CommandJob) -> None:
        """Forget a job whose command never got to run (the runtime refused it)."""
        own = self._jobs.get(self._pid, {})
        if own.get(job.id) is job:
            del own[job.id]
        if not own:
            self._jobs.pop(self._pid, None)

    def find(self, job_id: str) -> CommandJob:
        """The job by its id (``bg-3f2a``, or ``3f2a``, in either case: the id is hex); ToolError
        that says why there is none."""
        wanted = job_id.strip().lower()
        wanted = wanted if wanted.startswith(PREFIX) else PREFIX + wanted
        found = self._jobs.get(self._pid, {}).get(wanted)
        if found is None and not re.fullmatch(f"{PREFIX}[0-9a-f]+", wanted):  # (not made into bg-job 3f2a)
            shown = job_id if len(job_id) <= 40 else job_id[:40] + "…"
            raise ToolError(
                f"no such job {shown!r} in this conversation: a job's id is like bg-3f2a (bg- and hex digits), "
                "as the message that started it said; action='list' shows this conversation's jobs"
            )
        if found is None:
            raise ToolError(
                f"no such job {wanted}: a job belongs to the conversation that started it, and a restart of "
                "the agent runtime ends the jobs running then (a message said so for each); action='list' "
                "shows this conversation's jobs"
            )
        return found

    def all(self) -> list[CommandJob]:
        """The jobs, oldest first."""
        return list(self._jobs.get(self._pid, {}).values())


def _prune(own: dict[str, CommandJob]) -> None:
    """Keep the summaries of the ``MAX_ENDED`` latest started of the ended jobs."""
    ended = [job_id for job_id, job in own.items() if job.ended is not None]
    for job_id in ended[: max(0, len(ended) - MAX_ENDED)]:
        del own[job_id]


# -- the tool ----------------------------------------------------------------------------------


def _shown(job: CommandJob) -> str:
    return f"`{job.shown}`"


def _summary(job: CommandJob) -> str:
    size = f"{job.bytes_so_far()} bytes of output"
    if job.state == "starting":
        return f"{job.id} is starting" + (" (stopping)" if job.stop_requested.is_set() else "")
    if job.state == "running":
        stdin = "closed" if job.stdin_closed else "open"
        return f"{job.id} is running: for {job.runtime():.1f} s, {size} so far, stdin {stdin}"
    return f"{job.id} has ended after {job.runtime():.1f} s: {job.ending}, {size}"


def _status(job: CommandJob) -> ToolResult:
    details: dict[str, Any] = {
        "job": job.id,
        "state": job.state,
        "runtime": round(job.runtime(), 3),
        "bytes": job.bytes_so_far(),
        "exit_code": job.exit_code,
        "stopped": job.stopped,
    }
    return ToolResult.text(f"{_summary(job)}. {_shown(job)}", details=details)


def _list(table: JobTable) -> ToolResult:
    found = table.all()
    if not found:
        return ToolResult.text("No background jobs in this conversation.")
    return ToolResult.text("\n".join(f"{_summary(job)}. {_shown(job)}" for job in found))


def _output(job: CommandJob, offset: int | None) -> ToolResult:
    if job.state == "ended":
        return ToolResult.text(
            f"{job.id} has ended ({job.ending}): its output came to you with the system message about its end."
        )
    wanted, start, data = job.page(offset)
    total = job.bytes_so_far()
    if not data:
        return ToolResult.text(f"[no output past byte {start} yet: {total} bytes so far; {job.id} still runs]")
    end = start + len(data)
    gap = ""
    if start > wanted:
        kept = job.kept_file()
        where = f"; the whole output so far is in {kept}, which Read pages through" if kept else ""
        gap = f"bytes {wanted}–{start} were not kept in memory (a long output keeps its start and its end{where}); "
    note = f"[{gap}bytes {start}–{end} of {total} so far; {job.id} still runs; what follows: offset={end}]"
    return ToolResult.text(f"{data.decode('utf-8', errors='replace')}\n{note}")


async def _input(job: CommandJob, text: str, newline: bool, eof: bool) -> ToolResult:
    if len(text) > MAX_INPUT_CHARS:
        raise ToolError(f"text is at most {MAX_INPUT_CHARS} characters")
    data = utf8(text + ("\n" if newline else ""), "text")
    if not data and not eof:
        raise ToolError("nothing to write: give text (newline adds a line end), or eof=true to close stdin")
    taken = await job.write(data, eof)
    said = f"Wrote {len(data)} bytes to {job.id}'s stdin"
    said += "" if taken else " (the command has not read them all yet: the rest waits in the pipe)"
    said += ", then closed it" if eof else ""
    return ToolResult.text(said + ". What it answers shows with action='output'.")


async def _stop(job: CommandJob) -> ToolResult:
    if job.state == "ended":
        return ToolResult.text(f"{job.id} had already ended ({job.ending}); nothing to stop.")
    if job.state == "starting":
        job.stop_requested.set()  # (its command will not start: no need to wait)
        return ToolResult.text(f"Stopped {job.id} before its command started; its end comes as a system message.")
    if not await job.stop():
        return ToolResult.text(f"Stopping {job.id}: asked to end; its end comes to you as a system message.")
    return ToolResult.text(
        f"Stopped {job.id} after {job.runtime():.1f} s ({job.ending}): it and the processes it started were "
        "killed. Its output comes to you as a system message, as for any end."
    )


def _check(action: str, job: str | None, text: str | None, newline: bool | None, eof: bool, offset: int | None) -> None:
    """Arguments that do not fit the action are an error, rather than silently ignored."""
    if action != "list" and not (job and job.strip()):
        raise ToolError(f"action={action!r} needs the job's id (as bg-3f2a: the start message named it)")
    if action == "list" and job is not None:
        raise ToolError("job is not for action='list', which lists every job: use action='status' for one")
    if action != "input" and (text is not None or newline is not None or eof):
        raise ToolError("text, newline and eof are for action='input'")
    if action != "output" and offset is not None:
        raise ToolError("offset is for action='output'")


class _JobsTool(FunctionTool):
    """``Jobs``, which refuses an argument it does not take instead of dropping it: ``input`` meant
    as ``text`` would otherwise write an empty line to the command's stdin."""

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(arguments) - set(self.parameters["properties"]))
        if unknown:
            raise ToolArgumentsError(
                f"Jobs does not take {', '.join(unknown)}: its arguments are action, job, text (what action='input' "
                "writes), newline, eof and offset"
            )
        return super().validate(arguments)


def jobs_tool() -> FunctionTool:
    """The ``Jobs`` tool (syscall ``shell.jobs``) over the jobs of the process that calls it."""

    async def jobs(
        ctx: ToolContext,
        action: Action,
        job: str | None = None,
        text: str | None = None,
        newline: bool | None = None,
        eof: bool = False,
        offset: Annotated[int | None, Field(ge=0)] = None,
    ) -> ToolResult:
        """
        Args:
            action: list, status, output, input or stop.
            job: The job's id (bg-3f2a), for every action but list.
            text: What to write to the job's stdin, for input.
            newline: Add a line end after text, for input (default true).
            eof: Close the job's stdin after writing, for input.
            offset: The byte to show output from, for output (default: the last part).
        """
        if ctx.jobs is None:
            raise ToolError("background jobs need a conversation the runtime keeps (agentloop chat or serve)")
        _check(action, job, text, newline, eof, offset)
        if action == "list":
            return _list(ctx.jobs)
        assert job is not None
        found = ctx.jobs.find(job)
        if action == "status":
            return _status(found)
        if action == "output":
            return _output(found, offset)
        if action == "input":
            return await _input(found, text or "", newline is not False, eof)
        return await _stop(found)

    tool = _JobsTool(
        jobs,
        name="Jobs",
        description=(
            "Look after the commands you started with Shell background=true (each has an id like bg-3f2a, "
            "named when it started). action='list' shows them; 'status' tells whether one still runs (or how "
            "it ended), for how long, and how much output it wrote; 'output' shows its output so far (the "
            "last part; offset=N shows from byte N on); 'input' writes text to its stdin (a newline is added "
            "unless newline=false; eof=true then closes stdin); 'stop' kills it and every process it "
            "started. Its end still comes to you as a system message, once."
        ),
        # a poll: asking again how a command does while it runs (the same output so far, the same
        # list) is what the tool is for, not a model going round in circles (``loop/retries.py``)
        repeatable=True,
    )
    tool.syscall = SYSCALL
    return tool
