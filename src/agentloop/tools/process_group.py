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

An output too long for the result loses its middle there, but a command cannot always be run again
to see it (it had effects, or would print something else): given a ``KeptOutput``, the capture
also writes the whole output, as it comes, to a file of the workspace (``OUTPUT_DIR``), and the cut
names that file, which the Read tool pages through. The files are bounded one by one
(``MAX_KEPT_BYTES``) and together (``MAX_KEPT_TOTAL``, ``MAX_KEPT_FILES``: the oldest go first).
Any other tool's result cut for its length is kept the same way, once it is whole (``keep_text``,
from ``ToolResult.capped_keeping``), in the same files, and its cut says so in the same words
(``kept_note``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import signal
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "DRAIN_GRACE",
    "KEPT_TAIL_BYTES",
    "KILL_GRACE",
    "MAX_KEPT_BYTES",
    "MAX_KEPT_FILES",
    "MAX_KEPT_TOTAL",
    "OUTPUT_DIR",
    "GroupIdentity",
    "KeptOutput",
    "OutputCapture",
    "close_transport",
    "end_group",
    "end_left_group",
    "keep_text",
    "kept_note",
    "kill_group",
    "marked",
    "output_pipes",
    "pump",
    "spawn",
    "supervise",
    "unshown_lines",
]

KILL_GRACE = 1.0  # seconds between SIGTERM and SIGKILL
MARK = "AGENTLOOP_RUN_MARK"  # the environment variable that marks a run's processes (see ``marked``)
DRAIN_GRACE = 0.3  # how long output may stay open after the main process exited
_POLL = 0.02


#: Where a command's whole output is kept when its result is cut (``KeptOutput``), beneath the
#: workspace root: inside it, so the Read tool (confined to the root) can page through it; hidden,
#: and ignored by git (its own ``.gitignore``), so it stays out of the user's listings and commits.
OUTPUT_DIR = ".agentloop/outputs"
#: Bytes of one output kept in its file: past this only its first ``MAX_KEPT_BYTES -
#: KEPT_TAIL_BYTES`` and its last ``KEPT_TAIL_BYTES`` are, around a note (a runaway ``yes`` would
#: otherwise fill the disk); the last bytes wait in memory until the command ends.
MAX_KEPT_BYTES = 64 * 1024 * 1024
KEPT_TAIL_BYTES = 4 * 1024 * 1024
#: Bytes and files the output directory may hold together: a new file removes the oldest first.
MAX_KEPT_TOTAL = 256 * 1024 * 1024
MAX_KEPT_FILES = 200
_KEPT_NAME = re.compile(r"\d{8}-\d{6}-[0-9a-f]{8}\.txt")  # (only such files are ever removed)
_writing: set[tuple[int, int]] = set()  # (device, inode) of the files being written: never removed

log = logging.getLogger("agentloop.tools.process_group")


def _size(count: int) -> str:
    """A byte count as people read it (1.2 MiB)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"


class KeptOutput:
    """The whole output of one command, written to a file of its own in ``OUTPUT_DIR`` beneath the
    workspace ``root`` (a real path) as it comes, so that a result cut in the middle can name where
    the middle is. Files are private to the user (0600) and reached only through directories opened
    without following symlinks: a command may write the workspace, and must not turn the runtime's
    writes (or its removal of old files) to somewhere else. Nothing here raises: a file that cannot
    be written is given up (``error`` says why), never the command or its result."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path: str | None = None  # relative to the root, once started
        self.error: str | None = None
        self.dropped = 0  # bytes left out of the file's middle (over ``MAX_KEPT_BYTES``)
        self.size = 0  # bytes of the whole output given to the file (``dropped`` ones included)
        self._file: BinaryIO | None = None
        self._dir: int | None = None
        self._id: tuple[int, int] | None = None
        self.limit = MAX_KEPT_BYTES  # (read when made: a test may lower them)
        self.tail_bytes = KEPT_TAIL_BYTES
        self._head_room = self.limit - self.tail_bytes
        self._tail = bytearray()  # past the head: the last bytes, written at the end
        self._done = False

    @property
    def started(self) -> bool:
        return self.path is not None or self.error is not None

    def start(self, data: bytes) -> None:
        """Open a new file and write ``data``, the output so far (and then what ``write`` gets)."""
        if self.started:
            return
        name = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}.txt"
        try:
            self._dir = _open_output_dir(self.root)
            _prune(self._dir, room_for=1)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(name, flags, 0o600, dir_fd=self._dir)
            info = os.fstat(fd)
            self._id = (info.st_dev, info.st_ino)
            _writing.add(self._id)
            self._file = open(fd, "wb", buffering=1 << 16)  # noqa: SIM115 - kept open while the command runs
        except OSError as exc:
            self._fail(f"{OUTPUT_DIR} could not be written: {exc.strerror or exc}")
            return
        self.path = f"{OUTPUT_DIR}/{name}"
        self.write(data)

    def write(self, chunk: bytes) -> None:
        """Add ``chunk`` to the file (past the head: to the last bytes, kept in memory)."""
        if self._file is None or not chunk:
            return
        self.size += len(chunk)
        if self._head_room > 0:
            part, chunk = chunk[: self._head_room], chunk[self._head_room :]
            self._head_room -= len(part)
            try:
                self._file.write(part)
            except OSError as exc:
                self._fail(f"writing {self.path} failed: {exc.strerror or exc}", remove=True)
                return
        if chunk:
            self._tail += chunk
            if len(self._tail) > 2 * self.tail_bytes:
                over = len(self._tail) - self.tail_bytes
                self.dropped += over
                del self._tail[:over]

    def finish(self) -> None:
        """The command ended: write the last bytes (after a note of the cut, if there was one),
        close the file and make room in the directory."""
        if self._file is None or self._done:
            return
        self._done = True
        over = len(self._tail) - self.tail_bytes
        if over > 0:
            self.dropped += over
            del self._tail[:over]
        try:
            if self.dropped:
                self._file.write(
                    f"\n[agentloop: {self.dropped} bytes cut here: of an output over {self.limit} bytes only"
                    f" the first {self.limit - self.tail_bytes} and the last {self.tail_bytes} are kept]\n".encode()
                )
            self._file.write(self._tail)
            self._file.close()
        except OSError as exc:
            self._fail(f"writing {self.path} failed: {exc.strerror or exc}", remove=True)
            return
        self._tail = bytearray()
        self._release()
        self._file = None
        self._close_dir(prune=True)

    def discard(self) -> None:
        """The output was not cut after all: no file."""
        if self._file is not None:
            self._fail(None, remove=True)
        self.path = None

    def _fail(self, why: str | None, *, remove: bool = False) -> None:
        if why is not None:
            log.warning("a full output is not kept: %s", why)
        self.error = why
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        if remove and self.path is not None and self._dir is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path.rsplit("/", 1)[1], dir_fd=self._dir)
        if why is not None:
            self.path = None
        self._release()
        self._close_dir(prune=False)

    def _release(self) -> None:
        if self._id is not None:
            _writing.discard(self._id)
            self._id = None

    def _close_dir(self, *, prune: bool) -> None:
        if self._dir is None:
            return
        try:
            if prune:
                _prune(self._dir, room_for=0)
        except OSError as exc:
            log.warning("old command outputs in %s not removed: %s", OUTPUT_DIR, exc)
        finally:
            os.close(self._dir)
            self._dir = None


def keep_text(root: Path, data: bytes) -> KeptOutput:
    """``data``, a whole output already at hand (a tool result that is being cut), written to a
    new file beneath ``root`` as a command's output is, under the same limits. Blocking: call it
    off the event loop. Its ``path`` is None when the file could not be written (``error``)."""
    kept = KeptOutput(root)
    kept.start(data)
    kept.finish()
    return kept


def kept_note(kept: KeptOutput, size: int, first: int) -> str:
    """Where the whole output (``size`` bytes) of a cut is kept, for its note: the words are the
    same for a command's output and any other tool's result, so a model learns them once. ``first``
    is the first line not shown, as Read numbers the file's lines."""
    note = (
        f"; the full output ({_size(size)}) is kept in {kept.path}: Read it with offset/limit"
        f" (offset={first} for the first line not shown)"
    )
    if kept.dropped:
        note += (
            f", though only its first {_size(kept.limit - kept.tail_bytes)} and last"
            f" {_size(kept.tail_bytes)}: it was over {_size(kept.limit)}, the most kept of one output"
        )
    return note


def unshown_lines(lines: int, ends_line: bool, head: str, tail: str) -> tuple[int, int]:
    """The first and last of ``lines`` lines (as Read numbers them) not wholly shown when only
    ``head`` and ``tail`` of the text are (``first > last``: none are); ``ends_line`` when the
    text ends with a line break."""
    first = head.count("\n") + 1
    last = lines - (tail.count("\n") - (1 if ends_line else 0))
    return first, last


def _open_output_dir(root: Path) -> int:
    """``OUTPUT_DIR`` beneath ``root``, opened (made, private, if missing): each step without
    following a symlink, so a command that swapped one in cannot send the files elsewhere. A
    ``.agentloop`` made here gets a ``.gitignore`` that ignores it all, as tools' caches do. The
    root itself is not followed either (it is given resolved): a process's directory that a command
    replaced by a symlink would otherwise have the server write wherever it points."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in OUTPUT_DIR.split("/"):
            made = False
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
                made = True
            except FileExistsError:
                pass
            sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = sub
            if made and part == ".agentloop":
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                with contextlib.suppress(OSError), open(os.open(".gitignore", flags, 0o644, dir_fd=fd), "wb") as f:
                    f.write(b"# agentloop's own files (kept command outputs)\n*\n")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _prune(directory: int, *, room_for: int) -> None:
    """Remove the oldest kept outputs of ``directory`` (an open fd) until it holds at most
    ``MAX_KEPT_FILES - room_for`` files and ``MAX_KEPT_TOTAL`` bytes. Only this user's regular
    files named as ``KeptOutput`` names them go, and none being written."""
    found: list[tuple[float, str, int]] = []
    for name in os.listdir(directory):
        if not _KEPT_NAME.fullmatch(name):
            continue
        try:
            info = os.stat(name, dir_fd=directory, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            continue
        if (info.st_dev, info.st_ino) in _writing:
            continue
        found.append((info.st_mtime, name, info.st_size))
    found.sort()
    count, total = len(found), sum(size for _, _, size in found)
    for _, name, size in found:
        if count <= MAX_KEPT_FILES - room_for and total <= MAX_KEPT_TOTAL:
            break
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=directory)
        count, total = count - 1, total - size


class OutputCapture:
    """Combined stdout+stderr, bounded: the head and the tail are kept, the middle only counted
    (and written whole to ``kept``'s file, when one is given)."""

    def __init__(self, max_chars: int, kept: KeptOutput | None = None) -> None:
        self.max_chars = max_chars
        self.keep = 2 * max_chars  # bytes per end: enough for max_chars/2 chars of multi-byte text
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.newlines = 0
        self.kept = kept
        self._ends_line = True

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        self.total += len(chunk)
        self.newlines += chunk.count(b"\n")
        self._ends_line = chunk.endswith(b"\n")
        room = self.keep - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            if self.kept is not None:
                if not self.kept.started:  # (the first byte past the head: nothing was dropped yet)
                    self.kept.start(bytes(self.head))
                self.kept.write(chunk)
            self.tail += chunk
            if len(self.tail) > 2 * self.keep:
                del self.tail[: len(self.tail) - self.keep]

    def close(self) -> None:
        """The output has ended: finish its file if the output is cut, remove it if not."""
        if self.kept is None:
            return
        if not self.render()[1]:
            self.kept.discard()
            return
        if not self.kept.started:  # (cut, but all of it still held)
            self.kept.start(bytes(self.head + self.tail))
        self.kept.finish()

    def render(self) -> tuple[str, bool]:
        """The text (cut in the middle if too long, with a note of what was cut and where the
        whole output is kept) and whether it was cut. The note's length comes off what is shown,
        so a cut text stays about ``max_chars`` long."""
        room = self.max_chars
        for _ in range(2):  # (once to measure the note, once to fit it)
            text, cut, note = self._render(max(0, room) // 2)
            if not cut:
                return text, False
            room = self.max_chars - len(note) - 2
        return text, True

    def _render(self, half: int) -> tuple[str, bool, str]:
        if self.total == len(self.head) + len(self.tail):
            text = (self.head + self.tail).decode("utf-8", errors="replace")
            if len(text) <= self.max_chars:
                return text, False, ""
            head, tail = text[:half], text[-half:] if half else ""
            omitted = f"{len(text) - len(head) - len(tail)} chars omitted"
        else:
            head = self.head.decode("utf-8", errors="replace")[:half]
            tail = self.tail.decode("utf-8", errors="replace")[-half:] if half else ""
            omitted = f"{self.total - len(head.encode()) - len(tail.encode())} bytes omitted"
        note = self._cut_note(omitted, head, tail)
        return f"{head}\n{note}\n{tail}", True, note

    def _cut_note(self, omitted: str, head: str, tail: str) -> str:
        """What the cut left out (the lines not wholly shown, as Read numbers them) and where the
        whole output is, for the model to read it there rather than run the command again."""
        lines = self.newlines + (0 if self._ends_line else 1)
        first, last = unshown_lines(lines, self._ends_line, head, tail)
        span = f": lines {first}–{last} of {lines} not shown" if first <= last else ""
        note = f"… {omitted}{span}"
        kept = self.kept
        if kept is not None and kept.path is not None:
            note += kept_note(kept, self.total, first)
        elif kept is not None and kept.error is not None:
            note += f" (the full output could not be kept: {kept.error})"
        return note + " …"

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
