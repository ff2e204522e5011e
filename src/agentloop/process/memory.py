"""Daily memory files: what a compaction's summary model picked out as worth remembering is
appended to ``memory/<YYYY-MM-DD>.md`` in the process's working directory, under a heading with
the time. The prompt reads today's and yesterday's file back (``prompt.py``), so facts from a
conversation that was folded away stay in view for the next day, in any process working there.

The working directory belongs to the agent, which can plant a symlink where ``memory`` should be:
the file is resolved like a tool's path (no way out of the directory) and opened without following
a final link, and anything but a regular file is refused rather than written to or waited on.
"""

from __future__ import annotations

import datetime
import errno
import os
import stat
from pathlib import Path

from agentloop.tools.base import ToolError
from agentloop.tools.paths import resolve_path

MEMORY_DIR = "memory"


def daily_memory_name(day: datetime.date) -> str:
    return f"{MEMORY_DIR}/{day.isoformat()}.md"


def append_daily_memory(cwd: str | Path, memories: str, now: datetime.datetime | None = None) -> str:
    """Append ``memories`` to the day's memory file under ``cwd``; returns its name relative to
    ``cwd``. Raises ``OSError`` when it cannot be written there (a link leading out, not a
    regular file, a read-only directory)."""
    now = now or datetime.datetime.now()
    name = daily_memory_name(now.date())
    try:
        folder = resolve_path(cwd, MEMORY_DIR)
        folder.mkdir(exist_ok=True)
        path = resolve_path(cwd, name, follow_final=False)
    except ToolError as exc:
        raise OSError(errno.EPERM, str(exc)) from None
    entry = f"### From context compaction ({now:%H:%M})\n\n{memories.strip()}\n\n"
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
    fd = os.open(path, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.write(fd, entry.encode("utf-8"))
    finally:
        os.close(fd)
    return name
