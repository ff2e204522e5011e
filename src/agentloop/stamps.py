"""Files the runtime re-reads while it runs (prompt sources, policy files, an account's MCP list):
cheap change detection (a ``stat`` per check instead of reading and parsing the file), and a read
that refuses what is not a regular file."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from typing import BinaryIO

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


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` open for reading if it is a regular file, judged by what was opened, not by its
    name. A FIFO or a device where a file belongs (put there since a check, perhaps) would block
    an ordinary open until a writer came, for ever: it is opened without waiting and refused
    (``EINVAL``)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], limit: int | None = None) -> bytes:
    """The content of ``path`` if it is a regular file (``open_regular``). With ``limit``, a file
    longer than that many bytes is refused (``EFBIG``) without being loaded: a huge (or sparse)
    file where text belongs would otherwise fill the server's memory."""
    with open_regular(path) as f:
        if limit is not None and os.fstat(f.fileno()).st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
        data = f.read() if limit is None else f.read(limit + 1)  # (it may have grown since)
    if limit is not None and len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
    return data


def stamps(paths: Iterable[str | os.PathLike[str]]) -> tuple[Stamp | None, ...]:
    return tuple(file_stamp(path) for path in paths)
