"""Forks: a new process from a prefix of a live history, or from an archived segment.

"Try again from my message N another way", without losing the conversation that went on from
there, and "carry on with the conversation I reset": ``Kernel.fork`` makes a new top-level process
of the source's owner (same ``run_as``, ``cwd``, ``interactive``, and the source's ``context`` unless
another is given) whose history is a copy of

- the source's current history up to and including message id ``at`` (None: all of it), or
- the messages of one of its segments (``segment``: what a compaction or a reset archived, as
  ``kernel/segments.py`` reads it back; a clearing's archive holds old tool outputs, not a
  conversation, and is refused).

A fork is a valid history or nothing: a tool call without its result is refused by every provider.
An explicit ``at`` that ends inside a tool call batch (after an assistant message whose calls do not
all have their results by ``at``) is a ``ValueError`` naming the nearest valid points before and
after it; without ``at`` the copy ends at the last valid point (a run under way may have a call
out: the fork is cut before the assistant message that made it). Only committed messages are
copied: a run's in-flight state (its open calls, approvals, the queue) is not, and the fork starts
idle.

The conversation's settings go with it (``COPIED_KEYS``: its mode, its own model choice, its
tool scope, its compaction policy) and its title (``/title`` renames the fork); run state does not, nor what a
person granted the source alone (approvals it was told to remember), nor its schedules, watches
or channel. The fork records where it came from in its kv (``FORKED_KEY``: ``{"pid", "at"}`` or
``{"pid", "segment"}``) and logs one ``proc.changed`` (``changes: ["messages"]``, ``forkedFrom``);
the source logs nothing.

Media the copied messages reference are copied into the fork's own media folder (and the
references rewritten), so a reset or kill of the source, which deletes its folder, takes nothing
from the fork. A file already gone (a reset archived the segment and deleted its media) keeps its
reference, in the fork's folder, and reaches the model as the note a missing file gets.

The fork is stored in one transaction (its row, ``admit``: the server's quota, its kv rows, its
messages, its first signal): what fails leaves no process, and its media files are removed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from agentloop.kernel.segments import read_segment
from agentloop.kernel.titles import TITLE_KEY
from agentloop.messages import (
    AssistantMessage,
    FileContent,
    ImageContent,
    Message,
    ToolResultMessage,
    UserMessage,
    check_plain_text,
)
from agentloop.process import signals as sig
from agentloop.process.api import new_id
from agentloop.process.archive import check_name
from agentloop.process.engine import MODE_KEY, MODEL_KEY, Admit
from agentloop.process.media import MediaError, MediaRef, MediaStore, is_stored
from agentloop.process.pressure import COMPACTION_KEY
from agentloop.process.store import MAX_SEQ, NoSuchProcess, ProcessRecord, Store, StoreError
from agentloop.process.tool_scope import TOOLS_KEY

if TYPE_CHECKING:
    from agentloop.kernel.kernel import Kernel

FORKED_KEY = "forked_from"  # a fork's kv row: {"pid": source, "at": message id | None} or {"pid", "segment"}
# the kv rows that are the conversation's settings and name, copied to a fork (the rest is run state
# or the source's own); a fork's first run does not make a title (its history does not start with it)
COPIED_KEYS = (MODE_KEY, MODEL_KEY, TOOLS_KEY, COMPACTION_KEY, TITLE_KEY)


def valid_ends(messages: Sequence[Message]) -> list[bool]:
    """For each position, whether the history cut right after it is valid: every tool call an
    assistant message made by then has its result by then."""
    ends: list[bool] = []
    waiting: set[str] = set()
    for message in messages:
        if isinstance(message, ToolResultMessage):
            waiting.discard(message.tool_call_id)
        elif isinstance(message, AssistantMessage) and message.tool_calls:
            waiting = {c.id for c in message.tool_calls}
        ends.append(not waiting)
    return ends


def _check_args(at: object, segment: object, context: object) -> None:
    if at is not None and segment is not None:
        raise ValueError("give at or segment, not both: a fork copies a prefix of the live history or a segment")
    if at is not None and (isinstance(at, bool) or not isinstance(at, int) or not 0 <= at <= MAX_SEQ):
        raise ValueError(f"at must be a message id (an integer from 0 to {MAX_SEQ}), got {at!r}")
    if segment is not None and not isinstance(segment, str):
        raise TypeError(f"segment must be a string, got {type(segment).__name__}")
    if context is not None:
        if not isinstance(context, str):
            raise TypeError(f"context must be a string, got {type(context).__name__}")
        check_plain_text(context, "context")


def cut_at(pid: str, ids: Sequence[int], ends: Sequence[bool], at: int, what: str = "fork at") -> int:
    """How many messages a prefix ending with message id ``at`` holds (a fork copies them, a rewind
    keeps them: ``what`` says which in the error); ``ValueError`` when ``at`` is not one of the
    history's, or ends inside a tool call batch (naming the nearest valid points)."""
    try:
        index = list(ids).index(at)
    except ValueError:
        raise ValueError(f"message {at} is not a message of process {pid}'s current history") from None
    if ends[index]:
        return index + 1
    before = next((ids[i] for i in range(index - 1, -1, -1) if ends[i]), None)
    after = next((ids[i] for i in range(index + 1, len(ids)) if ends[i]), None)
    points = [f"message {before} (before the calls)" if before is not None else "nothing before the calls"]
    if after is not None:
        points.append(f"{after} (after their results)")
    raise ValueError(
        f"message {at} ends inside a tool call batch (a call without its result would follow it): "
        f"{what} {' or '.join(points)}"
    )


def _last_end(ends: Sequence[bool]) -> int:
    """How many messages the longest valid prefix holds."""
    return next((i + 1 for i in range(len(ends) - 1, -1, -1) if ends[i]), 0)


def _copy_media(media: MediaStore, owner: str, pid: str, messages: list[Message]) -> list[Message]:
    """``messages`` with every stored image and document copied into process ``pid``'s folder and
    their references rewritten to the copies. (Blocking: run in a thread.)"""

    def copied(block: Any) -> Any:
        if not is_stored(block):
            return block
        name = block.name if isinstance(block, FileContent) else ""
        try:
            ref = MediaRef.of(block)
        except MediaError:
            return block  # (a broken reference: what the model is told about it stays the same)
        try:
            new = media.save(owner, pid, media.load(ref, name))
        except MediaError:  # gone or damaged: the reference, moved to the fork's folder, says so
            folder = media.process_dir(owner, pid).relative_to(media.data_dir).as_posix()
            new = dataclasses.replace(ref, path=f"{folder}/{PurePosixPath(ref.path).name}")
        if isinstance(block, FileContent):
            return FileContent(data=new.to_data(), mime_type=block.mime_type, name=block.name)
        return ImageContent(data=new.to_data(), mime_type=block.mime_type)

    out: list[Message] = []
    for message in messages:
        if isinstance(message, UserMessage | ToolResultMessage) and any(is_stored(b) for b in message.content):
            message = dataclasses.replace(message, content=[copied(b) for b in message.content])
        out.append(message)
    return out


async def fork(
    kernel: Kernel,
    pid: str,
    *,
    at: int | None = None,
    segment: str | None = None,
    context: str | None = None,
    admit: Admit | None = None,
    new_pid: str | None = None,
) -> str:
    """Make the fork of process ``pid`` (see the module doc) and return its pid. ``NoSuchProcess``
    for an unknown or killed pid, ``NoSuchSegment`` for a segment it has none by, ``ValueError``
    for a bad ``at`` (or both ``at`` and ``segment``, or a clearing's segment). ``new_pid`` names
    the fork, so that a caller who lost the answer can ask again: where a fork of ``pid`` by that
    name exists, it is the answer and nothing is made (the first call's arguments stand);
    ``StoreError`` where the name is another process's, or a killed one's."""
    _check_args(at, segment, context)
    if new_pid is not None:
        check_name(new_pid, "new_pid")
    store = kernel.store
    source = await store.get_process(pid)
    if source is None or source.state == "killed":
        raise NoSuchProcess(pid)
    if new_pid is not None and await _made_before(store, pid, new_pid):
        return new_pid
    runs: list[str | None]
    origin: dict[str, Any]
    if segment is not None:
        page = await read_segment(store, kernel.data_dir, source, segment, limit=MAX_SEQ, before=None)
        if page.segment.kind == "clearing":
            raise ValueError(
                f"segment {segment!r} is a clearing: it holds old tool outputs, not a conversation to go on with"
            )
        messages = [m for _, m in page.messages]
        messages = messages[: _last_end(valid_ends(messages))]
        runs = [None] * len(messages)
        origin = {"pid": pid, "segment": segment}
    else:
        stored = await store.history(pid)  # committed messages only: a run's in-flight state is not in it
        ends = valid_ends([m.message for m in stored])
        count = _last_end(ends) if at is None else cut_at(pid, [m.id for m in stored], ends, at)
        messages = [m.message for m in stored[:count]]
        runs = [m.run_id for m in stored[:count]]
        origin = {"pid": pid, "at": stored[count - 1].id if count else None}
    settings = await store.kv_many(pid, COPIED_KEYS)
    record = ProcessRecord(
        pid=new_pid or new_id(),
        owner=source.owner,
        run_as=source.run_as,
        cwd=source.cwd,
        interactive=source.interactive,
        context=source.context if context is None else context,
        created_at=time.time(),
    )
    media = kernel.media
    try:
        messages = await asyncio.to_thread(_copy_media, media, record.owner, record.pid, messages)
        async with store.transaction():
            await store.create_process(record)
            if admit is not None:
                await admit()
            for key, value in {**settings, FORKED_KEY: origin}.items():
                await store.kv_set(record.pid, key, value)
            pairs = list(zip(runs, messages, strict=True))
            for run_id, group in itertools.groupby(pairs, key=lambda pair: pair[0]):
                await store.append_messages(record.pid, run_id, [message for _, message in group])
            payload = {"pid": record.pid, "changes": ["messages"], "forkedFrom": origin}
            await store.append_event(record.pid, sig.CHANGED, payload)
    except BaseException as exc:
        made = False
        try:  # (a retry that ran alongside the first call made it: that fork is the answer)
            made = isinstance(exc, StoreError) and new_pid is not None and await _made_before(store, pid, new_pid)
        finally:  # otherwise the media copied for it go, where the pid is not taken (its folder is ours alone)
            if not made and await store.get_process(record.pid) is None:
                await asyncio.to_thread(media.delete_process, record.owner, record.pid)
        if made:
            return record.pid
        raise
    return record.pid


async def _made_before(store: Store, source: str, new_pid: str) -> bool:
    """Whether process ``new_pid`` is a fork of ``source`` already made (by a call asked again);
    ``StoreError`` where the pid is taken otherwise, or was a killed process's."""
    if await store.was_killed(new_pid):
        raise StoreError(f"process {new_pid} was killed: a pid is not given to another process")
    made = await store.get_process(new_pid)
    if made is None:
        return False
    origin = await store.kv_get(new_pid, FORKED_KEY)
    if not isinstance(origin, dict) or origin.get("pid") != source:
        raise StoreError(f"process {new_pid} already exists, and is not a fork of {source}")
    return True
