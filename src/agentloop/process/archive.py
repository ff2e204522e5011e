"""History archives: the messages a compaction, reset or kill takes out of a live process.

An archive is the only copy of what it holds once the history is replaced, so it is written to
a temporary file, synced, and renamed into place: a reader sees a whole archive or none. The
header records how many messages follow, so a truncated file is detected instead of read as a
shorter history. Names come from users and process ids, so each path component is checked
before it can reach the filesystem.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from agentloop.messages import Message, message_from_dict, message_to_dict

FORMAT = "agentloop.history"
VERSION = 1
SUFFIX = ".jsonl.gz"

_NAME = re.compile(r"[A-Za-z0-9_@+-][A-Za-z0-9._@+-]{0,127}")

_clock_lock = threading.Lock()
_last_ns = 0


def check_name(value: str, what: str = "name") -> str:
    """``value`` if it is one safe path component (no separators, no ``..``, no hidden files)."""
    if not isinstance(value, str) or not _NAME.fullmatch(value) or ".." in value:
        raise ValueError(f"invalid {what} {value!r}: use 1-128 letters, digits, '.', '_', '-', '@', '+'")
    return value


def _created_ns() -> int:
    """A strictly increasing timestamp, so archives written in one tick still sort in order."""
    global _last_ns
    with _clock_lock:
        _last_ns = max(time.time_ns(), _last_ns + 1)
        return _last_ns


def archive_dir(data_dir: Path, user: str, pid: str) -> Path:
    return Path(data_dir) / "var" / "sessions" / check_name(user, "user") / check_name(pid, "pid")


def archive_path(data_dir: Path, user: str, pid: str, name: str) -> Path:
    return archive_dir(data_dir, user, pid) / f"{check_name(name, 'archive name')}{SUFFIX}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_archive(
    data_dir: Path,
    user: str,
    pid: str,
    name: str,
    messages: list[Message],
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write ``messages`` to ``var/sessions/<user>/<pid>/<name>.jsonl.gz`` and return the path.

    An existing archive is never overwritten (``FileExistsError``): it may be the only copy.
    """
    path = archive_path(data_dir, user, pid, name)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "user": user,
        "pid": pid,
        "name": name,
        "count": len(messages),
        "created_ns": _created_ns(),
        "meta": dict(meta or {}),
    }
    try:
        lines = [json.dumps(header, ensure_ascii=False)]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"archive meta is not JSON-serialisable: {exc}") from exc
    lines.extend(json.dumps(message_to_dict(m), ensure_ascii=False) for m in messages)
    payload = ("\n".join(lines) + "\n").encode("utf-8")

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        raise FileExistsError(f"archive {path} already exists")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as raw:
            # mtime=0: the same history gives the same bytes (the header holds the real time).
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
                gz.write(payload)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def read_archive(path: Path) -> tuple[dict[str, Any], list[Message]]:
    """The header (with the caller's ``meta`` under ``"meta"``) and the messages, as written."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = [line for line in f.read().split("\n") if line]
    except (OSError, EOFError) as exc:
        raise ValueError(f"archive {path} is unreadable: {exc}") from exc
    if not lines:
        raise ValueError(f"archive {path} is empty")
    try:
        header = json.loads(lines[0])
        records = [json.loads(line) for line in lines[1:]]
    except json.JSONDecodeError as exc:
        raise ValueError(f"archive {path} is not JSON lines: {exc}") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"archive {path} has no {FORMAT} header")
    if header.get("version") != VERSION:
        raise ValueError(f"archive {path} has unsupported version {header.get('version')!r}")
    if header.get("count") != len(records):
        raise ValueError(f"archive {path} holds {len(records)} messages, its header says {header.get('count')}")
    return header, [message_from_dict(r) for r in records]


def _sort_key(path: Path) -> tuple[int, str]:
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            created = json.loads(f.readline()).get("created_ns")
        if isinstance(created, int):
            return created, path.name
    except (OSError, EOFError, ValueError, AttributeError):
        pass
    return path.stat().st_mtime_ns, path.name


def list_archives(data_dir: Path, user: str, pid: str) -> list[Path]:
    """Archives of one process, oldest first (by the creation time in their headers)."""
    directory = archive_dir(data_dir, user, pid)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith(".") and p.is_file()]
    return sorted(found, key=_sort_key)
