"""Daily memory files: what a summary model picked out as worth remembering (when a compaction
folds part of a conversation away, or a reset clears it), or what the agent chose to remember
(the ``memory`` tool), is appended to ``memory/<YYYY-MM-DD>.md`` in the owner's home
(``<data>/home/<owner>``), under a heading with its source and the time. The prompt reads today's
and yesterday's file back (``prompt.py``), so those facts stay in view for the next day, in every
process of that owner, and in no one else's: a working directory may be shared by accounts. Older
days are reached through the ``memory`` tool, which searches, reads and forgets entries.

The home is off limits to tools, but the writer still trusts no link where ``memory`` or the
day's file should be. Every step is opened relative to the one before and without following a link
(``O_NOFOLLOW`` on each component, no path resolved ahead of time that a concurrent process could
swap), a file with other hard links is refused (it may be a file outside the directory), and so
is anything but a regular file (a FIFO would block the writer). A file is rewritten (to forget an
entry) through a new file renamed over it, in the same folder.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

MEMORY_DIR = "memory"
ENTRY_HEADING = "### From "
MAX_DAY_BYTES = 1024 * 1024  # a day's file read back; one larger is refused, not loaded
_DAY_FILE = re.compile(r"(\d{4}-\d{2}-\d{2})\.md")
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def daily_memory_name(day: datetime.date) -> str:
    return f"{MEMORY_DIR}/{day.isoformat()}.md"


@contextlib.contextmanager
def _folder(home: str | Path, *, create: bool, lock: bool = False) -> Iterator[int]:
    """The memory folder of ``home``, opened without following a link (``FileNotFoundError`` when
    it does not exist and ``create`` is false). With ``lock`` it is held exclusively while in use:
    writers take it, so an entry appended while another is forgotten (a file read, then replaced)
    is not lost with the replaced file."""
    root = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(MEMORY_DIR, 0o755, dir_fd=root)
        folder = os.open(MEMORY_DIR, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=root)
    finally:
        os.close(root)
    try:
        if lock:
            fcntl.flock(folder, fcntl.LOCK_EX)  # (released when the descriptor closes)
        yield folder
    finally:
        os.close(folder)


def _checked(fd: int, name: str) -> os.stat_result:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise OSError(errno.EINVAL, "not a regular file", name)
    if info.st_nlink > 1:
        raise OSError(errno.EPERM, "the file has other hard links, which may lead out of the directory", name)
    return info


def append_daily_memory(
    home: str | Path,
    memories: str,
    now: datetime.datetime | None = None,
    *,
    source: str = "context compaction",
    max_bytes: int | None = None,
) -> str:
    """Append ``memories`` (found by ``source``) to the day's memory file under ``home``; returns
    its name relative to ``home``. Raises ``OSError`` when it cannot be written there safely, and
    ``OSError(EFBIG)`` when the file would pass ``max_bytes`` (checked under the folder's lock:
    an agent remembering in a loop would make a day too large to read back, or to forget from)."""
    now = now or datetime.datetime.now()
    name = daily_memory_name(now.date())
    entry = f"{ENTRY_HEADING}{source} ({now:%H:%M})\n\n{memories.strip()}\n\n".encode()
    with _folder(home, create=True, lock=True) as folder:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | _NOFOLLOW
        fd = os.open(Path(name).name, flags, 0o644, dir_fd=folder)
        try:
            size = _checked(fd, name).st_size
            if max_bytes is not None and size + len(entry) > max_bytes:
                raise OSError(errno.EFBIG, f"{size} bytes already; the entry would pass {max_bytes}", name)
            os.write(fd, entry)
        finally:
            os.close(fd)
    return name


def memory_days(home: str | Path) -> list[tuple[datetime.date, int]]:
    """The days that have a memory file under ``home``, oldest first, with each file's size."""
    try:
        with _folder(home, create=False) as folder:
            days = []
            for entry in os.scandir(folder):
                match = _DAY_FILE.fullmatch(entry.name)
                if match is None or not entry.is_file(follow_symlinks=False):
                    continue
                with contextlib.suppress(ValueError):
                    days.append(
                        (datetime.date.fromisoformat(match.group(1)), entry.stat(follow_symlinks=False).st_size)
                    )
    except FileNotFoundError:
        return []
    return sorted(days)


def read_daily_memory(home: str | Path, day: datetime.date) -> str | None:
    """The day's memory file under ``home`` (None: there is none). ``OSError`` when it cannot be
    read safely, or is over ``MAX_DAY_BYTES``; ``UnicodeDecodeError`` when it is not UTF-8."""
    try:
        with _folder(home, create=False) as folder:
            return _read_day(folder, day)
    except FileNotFoundError:
        return None


def _read_day(folder: int, day: datetime.date) -> str | None:
    name = daily_memory_name(day)
    try:
        fd = os.open(Path(name).name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=folder)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        if _checked(fd, name).st_size > MAX_DAY_BYTES:
            raise OSError(errno.EFBIG, f"larger than {MAX_DAY_BYTES} bytes", name)
        return f.read(MAX_DAY_BYTES + 1).decode("utf-8")


def memory_entries(text: str) -> list[str]:
    """A day's file as its entries (each from its ``### From`` heading to the next), stripped."""
    parts = re.split(rf"(?m)^(?={re.escape(ENTRY_HEADING)})", text)
    return [p.strip() for p in parts if p.strip()]


def entry_body(entry: str) -> str:
    """An entry without its heading line, which names only its source and time: ``forget``'s
    text is looked for here, or "agent" (in every heading ``From the agent``) would remove them
    all."""
    return entry.partition("\n")[2] if entry.startswith(ENTRY_HEADING) else entry


def forget_daily_memory(home: str | Path, day: datetime.date, text: str) -> int:
    """Remove the entries of the day's memory file whose text (not heading) contains ``text``; how
    many were removed.
    The file is rewritten through a new one renamed over it (removed when nothing is left), under
    the folder's lock: an entry appended meanwhile is neither lost nor forgotten."""
    if not text:
        return 0
    try:
        with _folder(home, create=False, lock=True) as folder:
            current = _read_day(folder, day)
            if current is None:
                return 0
            entries = memory_entries(current)
            kept = [e for e in entries if text not in entry_body(e)]
            if len(kept) < len(entries):
                _replace(folder, Path(daily_memory_name(day)).name, kept)
            return len(entries) - len(kept)
    except FileNotFoundError:
        return 0


def _replace(folder: int, name: str, entries: list[str]) -> None:
    """The day's file ``name`` made of ``entries`` (removed when there are none)."""
    if not entries:
        os.unlink(name, dir_fd=folder)
        return
    temporary = f".{name}.{os.getpid()}.tmp"
    # Under the folder's lock no one else writes it: one that is there was left by a process that
    # died mid-rewrite (a restarted server often has its pid), and would fail every later forget.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary, dir_fd=folder)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(("\n\n".join(entries) + "\n\n").encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=folder)
        raise
