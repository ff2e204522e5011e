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


def read_regular(path: str | os.PathLike[str], limit: int | None = None) -> bytes:
    """The content of ``path`` if it is a regular file. A FIFO or a device put where a config
    file belongs would block the event loop on read (or never end): it is refused instead. With
    ``limit``, a file longer than that many bytes is refused (``EFBIG``) without being loaded: a
    huge (or sparse) file where text belongs would otherwise fill the server's memory."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO this way does not wait for a writer
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        if limit is not None and info.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read() if limit is None else f.read(limit + 1)  # (it may have grown since)
    finally:
        os.close(fd)
    if limit is not None and len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
    return data


def stamps(paths: Iterable[str | os.PathLike[str]]) -> tuple[Stamp | None, ...]:
    return tuple(file_stamp(path) for path in paths)
