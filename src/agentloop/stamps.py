"""Files the runtime re-reads while it runs (prompt sources, policy files, an account's MCP list):
cheap change detection (a ``stat`` per check instead of reading and parsing the file), and a read
that refuses what is not a regular file."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable

Stamp = tuple[int, int]


def file_stamp(path: str | os.PathLike[str]) -> Stamp | None:
    """What changes when the file's content (or a directory's entry list) changes; None when it
    does not exist or cannot be seen. Modification time in nanoseconds and size: a rewrite of
    the same size within one clock tick goes unnoticed, which a config edit never is."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """The content of ``path`` if it is a regular file. A FIFO or a device put where a config
    file belongs would block the event loop on read (or never end): it is refused instead."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO this way does not wait for a writer
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def stamps(paths: Iterable[str | os.PathLike[str]]) -> tuple[Stamp | None, ...]:
    return tuple(file_stamp(path) for path in paths)
