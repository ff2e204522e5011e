"""A child process in its own process group: bounded output capture, supervision, and
stopping the whole group (SIGTERM, then SIGKILL after a grace) — shared by the Shell tool and
CodeMode, which both run programs that may start children of their own.

``asyncio``'s ``Process.wait()`` also waits for the output pipe to close, which a backgrounded
child can hold open forever; so an exit is watched through ``returncode`` instead, and children
still holding the output a moment after the main process exited count as "held".

A child can leave the group (``setsid``, a shell's job control): so each run's environment
carries a mark of its own (``marked``), which descendants inherit wherever they go, and stopping
the run stops every process that bears it too (on Linux, where ``/proc`` shows environments).
One that also drops its environment (``setsid env -i …``) bears no mark, but if it still holds
the run's output pipe it is found by that (``/proc/<pid>/fd``) and stopped as well. (One that did
all three, detaching its output too, cannot be told from any other process of this user.)

A group a runtime that died left running (``GroupIdentity``, ``end_left_group``) is stopped by the
next one only if it is provably the run's: its leader the very process recorded (the same start
time, since a pid is reused), or a process bearing the run's mark.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DRAIN_GRACE",
    "KILL_GRACE",
    "GroupIdentity",
    "OutputCapture",
    "close_transport",
    "end_group",
    "end_left_group",
    "kill_group",
    "marked",
    "output_pipes",
    "pump",
    "spawn",
    "supervise",
]

KILL_GRACE = 1.0  # seconds between SIGTERM and SIGKILL
MARK = "AGENTLOOP_RUN_MARK"  # the environment variable that marks a run's processes (see ``marked``)
DRAIN_GRACE = 0.3  # how long output may stay open after the main process exited
_POLL = 0.02


class OutputCapture:
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

    def span(self, offset: int, limit: int) -> tuple[int, bytes]:
        """Up to ``limit`` bytes of the output from byte ``offset`` on, and where they start: later
        than ``offset`` when the middle there was not kept (a page never spans the gap)."""
        tail_start = self.total - len(self.tail)
        if offset < len(self.head):
            data = self.head[offset : offset + limit]
            if len(data) < limit and tail_start == len(self.head):  # (nothing dropped between them)
                data += self.tail[: limit - len(data)]
            return offset, bytes(data)
        start = max(offset, tail_start)
        return start, bytes(self.tail[start - tail_start : start - tail_start + limit])


async def pump(stream: asyncio.StreamReader, capture: OutputCapture) -> None:
    while chunk := await stream.read(1 << 16):
        capture.feed(chunk)


def marked(env: dict[str, str]) -> tuple[dict[str, str], str]:
    """``env`` with a mark of its own for one run's processes, and the mark."""
    mark = secrets.token_hex(8)
    return {**env, MARK: mark}, mark


def output_pipes(proc: asyncio.subprocess.Process) -> frozenset[str]:
    """The pipes ``proc``'s output is read from, as a holder's ``/proc/<pid>/fd`` links name
    them (``pipe:[inode]``: both ends of a pipe share its inode)."""
    transport = getattr(proc, "_transport", None)
    found = set()
    for fd in (1, 2):
        try:
            pipe = transport.get_pipe_transport(fd).get_extra_info("pipe")  # type: ignore[union-attr]
            found.add(f"pipe:[{os.fstat(pipe.fileno()).st_ino}]")
        except (AttributeError, OSError, ValueError):  # not a pipe, or closed already
            continue
    return frozenset(found)


def _holds(pid: str, pipes: frozenset[str]) -> bool:
    """Whether process ``pid`` has one of ``pipes`` open for writing: a writer is the run's (a
    process forked from the runtime may have inherited the reading end, and is not)."""
    with os.scandir(f"/proc/{pid}/fd") as fds:
        for fd in fds:
            try:
                if os.readlink(fd.path) not in pipes:
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd.name}", "rb") as f:
                    flags = next(line for line in f if line.startswith(b"flags:")).split()[1]
            except (OSError, StopIteration, IndexError):  # closed meanwhile
                continue
            if int(flags, 8) & os.O_ACCMODE != os.O_RDONLY:
                return True
    return False


def _members(pgid: int | None, mark: str | None, pipes: frozenset[str] = frozenset()) -> list[int] | None:
    """The live processes of group ``pgid`` (None: of no group), those (anywhere) bearing ``mark``
    and those holding one of ``pipes`` (the run's output), by one look through /proc (a zombie is
    not live: an init that does not reap leaves them behind); None where there is no /proc to
    look through. This process, which reads the pipes, is none of them."""
    if not os.path.isdir("/proc/self"):
        return None
    wanted = f"{MARK}={mark}".encode() if mark else None
    found = []
    own = str(os.getpid())
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or entry.name == own:
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
            # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses
            fields = stat[stat.rfind(b")") + 2 :].split()
            if len(fields) < 3 or fields[0] in (b"Z", b"X"):
                continue
            if pgid is not None and int(fields[2]) == pgid:
                found.append(int(entry.name))
                continue
            if wanted is not None:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if wanted in f.read().split(b"\0"):
                        found.append(int(entry.name))
                        continue
            if pipes and _holds(entry.name, pipes):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def _signal_group(pgid: int | None, sig: int, pids: Sequence[int] = ()) -> None:
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _any_alive(pids: Sequence[int]) -> bool:
    """Whether one of ``pids`` is still running (a zombie is not)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X"):
            return True
    return False


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


async def end_group(pgid: int, grace: float) -> None:
    """SIGTERM process group ``pgid``, SIGKILL what is left of it after ``grace`` (also when
    cancelled meanwhile): for a group whose leader is not ours to wait on (already gone, or
    started by a library). Returns at once for a group that is empty."""
    _signal_group(pgid, signal.SIGTERM)
    try:
        deadline = asyncio.get_running_loop().time() + grace
        while _group_exists(pgid) and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_POLL)
    finally:
        _signal_group(pgid, signal.SIGKILL)


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot: ``/proc/<pid>/stat`` field 22):
    with the pid, what tells a process from a later one given the same pid. None when it is gone
    or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rfind(b")") + 2 :].split()[19])  # (fields from the 3rd on)
    except (OSError, ValueError, IndexError):
        return None


def boot_id() -> str | None:
    """This boot of the machine: start times count from it, so they compare within one boot only."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


@dataclass(frozen=True)
class GroupIdentity:
    """What a run's process group is known by after the runtime that started it died: the group
    (its leader's pid), the run's mark, when the leader started and the machine's boot (None
    where /proc does not tell)."""

    pgid: int
    mark: str | None
    start: int | None
    boot: str | None

    @classmethod
    def of(cls, pgid: int, mark: str | None) -> GroupIdentity:
        """Group ``pgid`` as it is now (read while its leader runs: just after it started)."""
        return cls(pgid, mark, process_start(pgid), boot_id())

    def as_dict(self) -> dict[str, Any]:
        return {"pgid": self.pgid, "mark": self.mark, "start": self.start, "boot": self.boot}

    @classmethod
    def parse(cls, value: Any) -> GroupIdentity:
        """From ``as_dict``'s form. ValueError for anything else: what a damaged record names must
        not be signalled (a pgid of 0 or 1 would be this runtime's own group, or every process)."""
        if not isinstance(value, Mapping):
            raise ValueError(f"not a process group: {value!r}")
        pgid, mark, start, boot = (value.get(k) for k in ("pgid", "mark", "start", "boot"))
        if type(pgid) is not int or pgid <= 1:
            raise ValueError(f"not a process group id: {pgid!r}")
        if not (mark is None or (isinstance(mark, str) and mark)):
            raise ValueError(f"not a run's mark: {mark!r}")
        if not (start is None or type(start) is int) or not (boot is None or isinstance(boot, str)):
            raise ValueError(f"not a start time and boot: {start!r}, {boot!r}")
        return cls(pgid, mark, start, boot)


async def end_left_group(group: GroupIdentity, grace: float = KILL_GRACE) -> bool:
    """Stop what is left of ``group`` after the runtime that ran it died, as a timeout does
    (SIGTERM, then SIGKILL after ``grace``), but only what is provably the run's: the group while
    its leader is still the process recorded (its pid may lead another group by now), and the
    processes bearing the run's mark. Nothing after a reboot or without /proc, where pids and
    start times prove nothing. Returns whether it found anything to stop."""
    if group.boot is None or group.boot != boot_id():
        return False
    same = group.start is not None and process_start(group.pgid) == group.start and group.pgid != os.getpgrp()
    pgid = group.pgid if same else None
    pids = await asyncio.to_thread(_members, pgid, group.mark)
    if not pids:
        return False
    loop = asyncio.get_running_loop()
    _signal_group(pgid, signal.SIGTERM, pids)
    try:
        deadline = loop.time() + grace
        while loop.time() < deadline and _any_alive(pids):  # noqa: ASYNC110 - not our children: poll
            await asyncio.sleep(_POLL)
    finally:
        _signal_group(pgid, signal.SIGKILL, pids)
    return True


async def kill_group(proc: asyncio.subprocess.Process, grace: float, mark: str | None = None) -> None:
    """SIGTERM the group (and the processes bearing ``mark``, which may have left it), SIGKILL
    what is left after ``grace``; SIGKILL is sent even if this coroutine is cancelled meanwhile.
    Which processes those are is read from /proc once, in a thread (every process's files, on a
    busy machine), and once more at the end for children started meanwhile; the wait between
    only looks at them."""
    pgid = proc.pid
    loop = asyncio.get_running_loop()
    pipes = output_pipes(proc)
    members = await asyncio.to_thread(_members, pgid, mark, pipes)
    _signal_group(pgid, signal.SIGTERM, members or ())
    try:
        deadline = loop.time() + grace
        # Neither a group's emptiness nor an exit whose pipe is held open can be awaited: poll.
        while loop.time() < deadline and (  # noqa: ASYNC110
            proc.returncode is None or (_any_alive(members) if members is not None else _group_exists(pgid))
        ):
            await asyncio.sleep(_POLL)
    finally:
        _signal_group(pgid, signal.SIGKILL, members or ())
        if mark is not None or pipes:
            _signal_group(pgid, signal.SIGKILL, _members(pgid, mark, pipes) or ())
    deadline = loop.time() + 2.0
    while proc.returncode is None and loop.time() < deadline:  # noqa: ASYNC110 - the child watcher reaps it
        await asyncio.sleep(_POLL)


async def spawn(mark: str | None, *argv: str, **options: Any) -> asyncio.subprocess.Process:
    """``asyncio.create_subprocess_exec(*argv, **options)`` for a program whose environment bears
    ``mark`` (``marked``), made so that a cancel cannot lose its children. The creation goes on
    after the fork (it connects the pipes); cancelled then - a timeout, an abort - asyncio kills
    the program itself and raises, and whatever the program had started meanwhile (on a loaded
    machine it has run for a while) was left running, its group never known to the caller. So
    the processes bearing the mark are stopped then (on Linux, where /proc shows them)."""
    try:
        return await asyncio.create_subprocess_exec(*argv, **options)
    except asyncio.CancelledError:
        if mark is not None:
            await _stop_marked(mark)
        raise


async def _stop_marked(mark: str) -> None:
    """SIGTERM every process bearing ``mark``, SIGKILL what is left after ``KILL_GRACE`` (and
    what was started meanwhile)."""
    pids = await asyncio.to_thread(_members, None, mark)
    if not pids:
        return
    _signal_group(None, signal.SIGTERM, pids)
    try:
        deadline = asyncio.get_running_loop().time() + KILL_GRACE
        while asyncio.get_running_loop().time() < deadline and _any_alive(pids):  # noqa: ASYNC110
            await asyncio.sleep(_POLL)
    finally:
        _signal_group(None, signal.SIGKILL, [*pids, *(_members(None, mark) or ())])


async def supervise(
    proc: asyncio.subprocess.Process, reader: asyncio.Task[None], limit: float, stop: asyncio.Event | None = None
) -> str:
    """Wait for the command: ``"exited"``, ``"held"`` (exited, but children keep the output
    open), ``"timeout"``, or ``"stopped"`` once ``stop`` is set (a request to end it early)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    exited_at: float | None = None
    while not reader.done():
        now = loop.time()
        if stop is not None and stop.is_set():
            return "stopped"
        if now >= deadline:
            return "timeout"
        if proc.returncode is not None:
            exited_at = now if exited_at is None else exited_at
            if now - exited_at >= DRAIN_GRACE:
                return "held"
        await asyncio.wait({reader}, timeout=min(0.05, deadline - now))
    while proc.returncode is None:  # output closed; the shell is exiting or detached its output
        if stop is not None and stop.is_set():
            return "stopped"
        if loop.time() >= deadline:
            return "timeout"
        await asyncio.sleep(_POLL)
    return "exited"


def close_transport(proc: asyncio.subprocess.Process) -> None:
    """Release the pipe transport even if a detached process still holds the other end."""
    transport = getattr(proc, "_transport", None)
    if transport is not None:
        transport.close()
