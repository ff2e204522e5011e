"""Cheap change detection for files the runtime re-reads while it runs (prompt sources, policy
files, an account's MCP list): a ``stat`` per check instead of reading and parsing the file."""

from __future__ import annotations

import os
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


def stamps(paths: Iterable[str | os.PathLike[str]]) -> tuple[Stamp | None, ...]:
    return tuple(file_stamp(path) for path in paths)
