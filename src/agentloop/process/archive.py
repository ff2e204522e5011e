"""History archives: the messages a compaction, reset or kill takes out of a live process.

An archive is the only copy of what it holds once the history is replaced, so it is written to
a temporary file, synced, and linked into place: a reader sees a whole archive or none. The
header records how many messages follow, so a truncated file is detected instead of read as a
shorter history. Names come from users and process ids, so each path component is checked
before it can reach the filesystem.

A reset's or kill's archive also keeps the input that was queued (sent while a run was active)
and that the clearing discarded: it never reached the model, so it is not history, and is kept
apart from the messages, in the header's ``meta.queued`` (the messages, as ``message_to_dict``
writes them, oldest first), with ``meta.queued_note`` saying so to a person who opens the file
(``queued_meta``). Readers of the messages (``read_archive``, a segment's pages, a fork from it)
are unchanged by it. The run's abort takes that input out of the queue before the archive is
written, so it is set aside meanwhile in the process's ``DISCARDED_KEY`` row, in the abort's commit.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentloop.messages import Message, message_from_dict, message_to_dict

FORMAT = "agentloop.history"
VERSION = 1
SUFFIX = ".jsonl.gz"

_NAME = re.compile(r"[A-Za-z0-9_@+-][A-Za-z0-9._@+-]{0,127}")

_clock_lock = threading.Lock()
_last_ns = 0


# kv row of a process being reset or killed: the queued input its run's abort discarded, kept in
# the store from that commit until the clearing's archive holds it (``ProcessEngine._discard_queue``):
# [{"id": queue item id, "message": message dict}, …], oldest first
DISCARDED_KEY = "clearing:discarded"


def discarded_row(earlier: object, items: Sequence[tuple[int, Message]]) -> list[dict[str, Any]]:
    """The ``DISCARDED_KEY`` row with the queue ``items`` (id, message) added to what it held
    (``earlier``: a clearing that failed before its archive left some there)."""
    kept = [entry for entry in earlier if isinstance(entry, dict)] if isinstance(earlier, list) else []
    return kept + [{"id": item_id, "message": message_to_dict(message)} for item_id, message in items]


def discarded_messages(row: object) -> dict[int, Message]:
    """Queue item id -> message, of a ``DISCARDED_KEY`` row (an entry that cannot be read is passed
    over: the rest is still worth keeping)."""
    found: dict[int, Message] = {}
    for entry in row if isinstance(row, list) else []:
        try:
            found[int(entry["id"])] = message_from_dict(entry["message"])
        except (KeyError, TypeError, ValueError):
            continue
    return found


def queued_meta(reason: str, queued: list[Message]) -> dict[str, Any]:
    """The header ``meta`` entries that keep the ``queued`` input a ``reason`` ("reset", "kill")
    discarded (none when there was none): the messages, and a note, since a header holding user
    messages next to a history that lacks them would otherwise read as a mistake."""
    if not queued:
        return {}
    return {
        "queued": [message_to_dict(m) for m in queued],
        "queued_note": (
            f"input queued while a run was active, discarded by the {reason}: never delivered to the model"
        ),
    }


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


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable: a rename or a new file in it is only
    on disk once its directory is synced (best effort where a platform cannot sync one)."""
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


def private_dir(root: Path, *parts: str) -> Path:
    """``root/parts…``, made where missing one owner-only folder at a time: the folder names are
    the accounts, their process ids and the hashes of their images, which only the runtime's own
    user may list (``Path.mkdir(parents=True)`` would make the parents world-readable). Each new
    folder is synced into its parent, so a file renamed into it cannot outlive it in a crash.
    Existing folders keep their mode (``root`` and its ``var`` may be the operator's choice)."""
    path = Path(root)
    for part in parts:
        parent, path = path, path / part
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        fsync_dir(parent)
    return path


def write_archive(
    data_dir: Path,
    user: str,
    pid: str,
    name: str,
    messages: list[Message],
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write ``messages`` to ``var/sessions/<user>/<pid>/<name>.jsonl.gz`` and return the path.

    An existing archive is never overwritten (``FileExistsError``), also not by a writer of the
    same name finishing first meanwhile: it may be the only copy. The messages are streamed to
    the file one line at a time: a long history is not held a second time as text.
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
        first = json.dumps(header, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"archive meta is not JSON-serialisable: {exc}") from exc

    directory, fd, tmp_name = _temp_file(Path(data_dir), user, pid, name, path)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as raw:
            # mtime=0: the same history gives the same bytes (the header holds the real time).
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
                gz.write(first.encode("utf-8") + b"\n")
                for message in messages:
                    gz.write(json.dumps(message_to_dict(message), ensure_ascii=False).encode("utf-8") + b"\n")
            raw.flush()
            os.fsync(raw.fileno())
        _publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(directory)
    return path


def _temp_file(data_dir: Path, user: str, pid: str, name: str, path: Path) -> tuple[Path, int, str]:
    """The archive's folder, and a temporary file opened in it. Retention removes a folder that
    its last archive's removal left empty (``remove_archive``): one removed while it is made or
    before the file is opened in it is made again, instead of failing the reset or kill that
    archives."""
    attempts = 3
    while True:
        attempts -= 1
        try:
            directory = private_dir(data_dir, "var", "sessions", user, pid)
            if path.exists():
                raise FileExistsError(f"archive {path} already exists")
            fd, tmp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
        except FileNotFoundError:
            if attempts == 0:
                raise
            continue
        return directory, fd, tmp_name


def _publish(tmp: Path, path: Path) -> None:
    """Give the finished ``tmp`` the name ``path`` unless that name is taken. A hard link is
    atomic and refuses an existing name, where ``exists()`` then ``replace`` would let a writer
    finishing in between be overwritten; a filesystem without hard links gets the latter."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise FileExistsError(f"archive {path} already exists") from None
    except OSError:
        if path.exists():
            raise FileExistsError(f"archive {path} already exists") from None
        os.replace(tmp, path)


def read_archive(path: Path) -> tuple[dict[str, Any], list[Message]]:
    """The header (with the caller's ``meta`` under ``"meta"``) and the messages, as written.

    Read one line at a time (an archive can hold a long history); ``ValueError`` says what is
    wrong with a file that is truncated, corrupt or not an archive."""
    header: Any = None
    messages: list[Message] = []
    try:
        with gzip.open(path, "rt", encoding="utf-8", newline="\n") as f:
            for line in f:
                if not line.strip("\n"):
                    continue
                if header is None:
                    header = json.loads(line)
                    _check_header(path, header)
                else:
                    messages.append(message_from_dict(json.loads(line)))
    except (OSError, EOFError) as exc:
        raise ValueError(f"archive {path} is unreadable: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"archive {path} is not JSON lines: {exc}") from exc
    if header is None:
        raise ValueError(f"archive {path} is empty")
    if header.get("count") != len(messages):
        raise ValueError(f"archive {path} holds {len(messages)} messages, its header says {header.get('count')}")
    return header, messages


def read_header(path: Path) -> dict[str, Any]:
    """The header alone (what a listing shows: how many messages, the caller's ``meta``), without
    reading the messages; ``ValueError`` as ``read_archive`` for a file that is not an archive."""
    try:
        with gzip.open(path, "rt", encoding="utf-8", newline="\n") as f:
            header = json.loads(f.readline())
    except (OSError, EOFError) as exc:
        raise ValueError(f"archive {path} is unreadable: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"archive {path} has no header: {exc}") from exc
    _check_header(path, header)
    assert isinstance(header, dict)
    return header


def _check_header(path: Path, header: Any) -> None:
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"archive {path} has no {FORMAT} header")
    if header.get("version") != VERSION:
        raise ValueError(f"archive {path} has unsupported version {header.get('version')!r}")


def created_ns(path: Path) -> int:
    """When the archive was written (nanoseconds since the epoch): its header's time, which a copy
    or a restore from a backup keeps, else the file's modification time."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            created = json.loads(f.readline()).get("created_ns")
        if isinstance(created, int) and not isinstance(created, bool):
            return created
    except (OSError, EOFError, ValueError, AttributeError):
        pass
    return path.stat().st_mtime_ns


def _sort_key(path: Path) -> tuple[int, str]:
    return created_ns(path), path.name


def list_archives(data_dir: Path, user: str, pid: str) -> list[Path]:
    """Archives of one process, oldest first (by the creation time in their headers)."""
    directory = archive_dir(data_dir, user, pid)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith(".") and p.is_file()]
    return sorted(found, key=_sort_key)


@dataclass(frozen=True)
class StoredArchive:
    """One archive file found under ``var/sessions`` (``all_archives``)."""

    user: str
    pid: str
    name: str  # without the suffix, as ``archive_path`` takes it
    path: Path
    created: float  # seconds since the epoch (``created_ns``)


def _safe_names(directory: Path, what: str) -> list[str]:
    """The entries of ``directory`` that are names this runtime could have written (others, and
    hidden ones such as a writer's temporary file, are not the archives' to judge)."""
    found: list[str] = []
    for entry in sorted(directory.iterdir()):
        try:
            found.append(check_name(entry.name, what))
        except ValueError:
            continue
    return found


def all_archives(data_dir: Path) -> list[StoredArchive]:
    """Every archive under ``var/sessions/<user>/<pid>/`` (retention's inventory), by user, pid and
    name. Entries that are not folders or archives of the names this runtime writes are passed
    over, never reported as archives: retention must not remove what it did not write."""
    root = Path(data_dir) / "var" / "sessions"
    if not root.is_dir():
        return []
    found: list[StoredArchive] = []
    for user in _safe_names(root, "user"):
        if not (root / user).is_dir():
            continue
        for pid in _safe_names(root / user, "pid"):
            directory = root / user / pid
            if not directory.is_dir():
                continue
            for entry in _safe_names(directory, "archive name"):
                path = directory / entry
                if not entry.endswith(SUFFIX) or not path.is_file():
                    continue
                name = entry[: -len(SUFFIX)]
                try:
                    check_name(name, "archive name")
                except ValueError:
                    continue
                found.append(StoredArchive(user, pid, name, path, created_ns(path) / 1e9))
    return found


def remove_archive(data_dir: Path, user: str, pid: str, name: str) -> bool:
    """Delete one archive, then its process's and its user's folders if that left them empty;
    whether the file was there. A writer that finds a folder gone meanwhile makes it again
    (``write_archive``), so removing an empty one is safe while archives are being written."""
    path = archive_path(data_dir, user, pid, name)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    directory = path.parent
    fsync_dir(directory)
    for folder in (directory, directory.parent):
        try:
            folder.rmdir()  # only when empty: anything else in it stays
        except OSError:
            break
        fsync_dir(folder.parent)
    return True
