"""Daily memory files: what a summary model picked out as worth remembering (when a compaction
folds part of a conversation away, or a reset clears it) is appended to ``memory/<YYYY-MM-DD>.md``
in the owner's home (``<data>/home/<owner>``), under a heading with the time. The prompt reads
today's and yesterday's file back (``prompt.py``), so those facts stay in view for the next day, in
every process of that owner, and in no one else's: a working directory may be shared by accounts.

The home is off limits to tools, but the writer still trusts no link where ``memory`` or the
day's file should be. Every step is opened relative to the one before and without following a link
(``O_NOFOLLOW`` on each component, no path resolved ahead of time that a concurrent process could
swap), a file with other hard links is refused (it may be a file outside the directory), and so
is anything but a regular file (a FIFO would block the writer).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import stat
from pathlib import Path

MEMORY_DIR = "memory"


def daily_memory_name(day: datetime.date) -> str:
    return f"{MEMORY_DIR}/{day.isoformat()}.md"


def append_daily_memory(
    home: str | Path, memories: str, now: datetime.datetime | None = None, *, source: str = "context compaction"
) -> str:
    """Append ``memories`` (found by ``source``) to the day's memory file under ``home``; returns
    its name relative to ``home``. Raises ``OSError`` when it cannot be written there safely."""
    now = now or datetime.datetime.now()
    name = daily_memory_name(now.date())
    entry = f"### From {source} ({now:%H:%M})\n\n{memories.strip()}\n\n"
    nofollow = os.O_NOFOLLOW | os.O_CLOEXEC
    root = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(MEMORY_DIR, 0o755, dir_fd=root)
        folder = os.open(MEMORY_DIR, os.O_RDONLY | os.O_DIRECTORY | nofollow, dir_fd=root)
        try:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | nofollow
            fd = os.open(Path(name).name, flags, 0o644, dir_fd=folder)
        finally:
            os.close(folder)
    finally:
        os.close(root)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", name)
        if info.st_nlink > 1:
            raise OSError(errno.EPERM, "the file has other hard links, which may lead out of the directory", name)
        os.write(fd, entry.encode("utf-8"))
    finally:
        os.close(fd)
    return name
