"""What compactions, clearings and resets took out of a process's history, listed and read back.

Each of them leaves a ``history_segments`` row (its kind, when, the message ids it covered, where
its archive is) and an archive with the messages themselves, whose header says how many and why
(a compaction's reason). The archive is opened by its name under the owner's and the process's
folder (``archive.archive_path``), never by the path the row stores, so a row cannot lead a
reader outside the process's own archives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentloop.messages import Message
from agentloop.process.api import new_id
from agentloop.process.archive import SUFFIX, archive_path, read_archive, read_header
from agentloop.process.store import ProcessRecord, SegmentRow, Store, StoredMessage


class NoSuchSegment(LookupError):
    """The process has no segment by that id, or its archive cannot be read any more."""


@dataclass(frozen=True)
class Segment:
    """One part of a history put away: by a compaction (the summary took its place), a clearing
    (old tool outputs, replaced by a note) or a reset (the whole conversation)."""

    id: str
    kind: str  # compaction, clearing or reset
    reason: str | None  # a compaction's (threshold, overflow, manual), "reset"; None when not said
    created_at: float
    generation: int  # the history generation it was taken from (each reset starts the next)
    messages: int | None  # how many its archive holds; None when the archive cannot be read
    archive: str | None  # the archive's name


@dataclass(frozen=True)
class SegmentPage:
    """Archived messages of a segment, oldest first, each with its position in the archive;
    ``next_before`` is the ``before`` of the page before this one (None: this is the first)."""

    segment: Segment
    messages: list[tuple[int, Message]]
    next_before: int | None


def _archive_name(row: SegmentRow) -> str | None:
    """The name of a row's archive: the engine stores a path relative to the data directory."""
    if not row.archive_path:
        return None
    name = Path(row.archive_path).name
    return name[: -len(SUFFIX)] if name.endswith(SUFFIX) else None


def _archive_file(data_dir: Path, record: ProcessRecord, row: SegmentRow) -> Path | None:
    name = _archive_name(row)
    if name is None:
        return None
    try:
        return archive_path(data_dir, record.owner, record.pid, name)
    except ValueError:  # (not a name this runtime writes)
        return None


def _header(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        return read_header(path)
    except (ValueError, OSError):
        return None


def _segment(row: SegmentRow, header: dict[str, Any] | None) -> Segment:
    meta = header.get("meta") if header is not None else None
    reason = meta.get("reason") if isinstance(meta, dict) else None
    count = header.get("count") if header is not None else None
    return Segment(
        id=row.id,
        kind=row.kind,
        reason=reason if isinstance(reason, str) else None,
        created_at=row.created_at,
        generation=row.generation,
        messages=count if isinstance(count, int) and not isinstance(count, bool) else None,
        archive=_archive_name(row),
    )


async def list_segments(store: Store, data_dir: Path, record: ProcessRecord) -> list[Segment]:
    """The process's segments, oldest first, each with what its archive's header says."""
    rows = await store.segments(record.pid)

    def headers() -> list[dict[str, Any] | None]:
        return [_header(_archive_file(data_dir, record, row)) for row in rows]

    return [_segment(row, header) for row, header in zip(rows, await asyncio.to_thread(headers), strict=True)]


async def read_segment(
    store: Store, data_dir: Path, record: ProcessRecord, segment_id: str, *, limit: int, before: int | None
) -> SegmentPage:
    """The last ``limit`` archived messages of segment ``segment_id`` before position ``before``
    (the newest page by default), as ``Process.history`` pages the live history."""
    row = next((r for r in await store.segments(record.pid) if r.id == segment_id), None)
    if row is None:
        raise NoSuchSegment(f"process {record.pid} has no segment {segment_id!r}")
    path = _archive_file(data_dir, record, row)
    if path is None:
        raise NoSuchSegment(f"segment {segment_id!r} has no archive")
    try:
        header, messages = await asyncio.to_thread(read_archive, path)
    except (ValueError, OSError):
        raise NoSuchSegment(f"the archive of segment {segment_id!r} is missing or unreadable") from None
    end = len(messages) if before is None else min(before, len(messages))
    start = max(0, end - limit)
    page = [(i, messages[i]) for i in range(start, end)]
    return SegmentPage(_segment(row, header), page, start if start > 0 else None)


async def record_reset(
    store: Store, data_dir: Path, record: ProcessRecord, stored: Sequence[StoredMessage], path: Path | None
) -> None:
    """Inside a reset's transaction: the segment row of the history it archived to ``path`` (none
    when there was nothing to archive). Message ids 0 when only queued input was archived."""
    if path is None:
        return
    first, last = (stored[0].id, stored[-1].id) if stored else (0, 0)
    where = str(path.relative_to(data_dir))
    await store.add_segment(SegmentRow(new_id(), record.pid, record.history_generation, "reset", first, last, where))
