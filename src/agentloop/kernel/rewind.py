"""Rewinds: a process's history cut back, in place, to one of its own messages.

"Drop what came after message N and go on from there" (edit a message and try again, Claude
Code's /rewind) without a new process: ``Process.rewind(at)`` keeps the history up to and including
message id ``at`` (0: none of it, back to the start) and takes everything after it out. The pid, the
settings, the title, the schedules and watches, the queue and the media stay, so the web UI, a chat
bridge or a parent go on following the same process (a fork would leave them on the old one). Only
an automatic title goes when the user message it was cut from does (a rewind to the start, or to
before the first user message): the conversation that follows earns its own, as after a reset (in the
rewind's transaction; the title being made of the dropped message is cancelled). A person's stays.

What is taken out is archived first, as a segment of kind ``rewind`` (reason ``rewind``, the header's
``meta`` saying at which message and how many were kept): ``segments()`` lists it, ``segment()``
reads it, and ``fork(segment=…)`` makes a process of the messages it holds.

The cut follows a fork's rules (``fork.cut_at``): the history kept is a valid one or nothing is done,
never ending inside a tool call batch (an assistant message whose calls do not all have their results
by ``at``): that is a ``ValueError`` naming the nearest valid points, as is an ``at`` that is not a
message of the current history. Rewinding to the last message does nothing: no archive, no signal.

Durable the way a compaction is: the process is held idle (``ProcessEngine.held_idle``: ``RunActive``
while a run is under way, since the run would go on from the history taken from under it; abort it
first), the messages are archived before the history changes, and one transaction deletes them
(``Store.truncate_messages``), adds the segment row, forgets the context reading (it measured the
longer history; the next model step measures anew) and logs ``proc.changed`` with ``changes:
["messages"]`` and ``rewound: {at, removed, segment}``: a client showing the history drops what it
holds after message ``at`` and reads on from there. A crash between the archive and the commit leaves
an extra archive, never a lost message.

Background jobs (Shell ``background=true``) that tool calls taken out started are stopped as a reset
stops a process's jobs (cancelled: the command's process group is killed) and forgotten by the
``Jobs`` tool: their records go in the rewind's transaction, so their ends, which the rewound
conversation never asked for, are not delivered (nor reported after a restart). The jobs of the calls
kept go on. Schedules and watches stay whoever made them: nothing records which call created one.

Queued input stays queued: the process is idle, so only input sent during the rewind can be waiting,
and it runs on the rewound history once the rewind is over, as after a compaction.

Media follow a compaction's rule: the files the removed messages reference stay in the process's
media folder (the archive refers to them, and a fork of the segment copies them; a file is stored
once per content, so a kept message may refer to the same one), and go with the folder at a reset
or kill.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentloop.kernel.fork import cut_at, valid_ends
from agentloop.messages import AssistantMessage, UserMessage
from agentloop.process import signals as sig
from agentloop.process.api import new_id
from agentloop.process.archive import write_archive
from agentloop.process.background import drop_jobs_of
from agentloop.process.pressure import forget_context
from agentloop.process.store import MAX_SEQ, SegmentRow, StoredMessage, StoreError
from agentloop.tools.jobs import CallKey

if TYPE_CHECKING:
    from agentloop.kernel.kernel import Kernel
    from agentloop.process.tx import _Live

KIND = "rewind"  # the segment's kind, and its archive's reason


@dataclass(frozen=True)
class Rewound:
    """What a rewind did: how many messages the history keeps and how many it took out (0: the
    point was the last message, nothing was done), and where those went (None when nowhere)."""

    kept: int
    removed: int
    segment: str | None  # the segment's id (``Process.segment``, ``fork(segment=…)``)
    archive: str | None  # its archive's name


def check_at(at: object) -> int:
    """``at`` if it can name a message (an integer from 0, the start, to ``MAX_SEQ``)."""
    if isinstance(at, bool) or not isinstance(at, int):
        raise TypeError(f"at must be a message id (an integer), got {type(at).__name__}")
    if not 0 <= at <= MAX_SEQ:
        raise ValueError(f"at must be a message id (an integer from 0 to {MAX_SEQ}), got {at}")
    return at


def kept_count(pid: str, stored: list[StoredMessage], at: int) -> int:
    """How many messages a rewind to ``at`` keeps (0, the start, keeps none, always valid)."""
    if at == 0:
        return 0
    ends = valid_ends([m.message for m in stored])
    return cut_at(pid, [m.id for m in stored], ends, at, "rewind to")


async def rewind(kernel: Kernel, pid: str, at: int) -> Rewound:
    """Rewind process ``pid`` to message id ``at`` (see the module doc). ``NoSuchProcess`` for an
    unknown or killed pid, ``RunActive`` while it runs, ``ProcessBusy`` while another worker holds
    it, ``TypeError``/``ValueError`` for a point that is not a valid one: all before anything is done."""
    check_at(at)
    engine, store = kernel.engine, kernel.store
    async with engine.held_idle(pid, KIND) as live:
        stored = await store.history(pid)
        count = kept_count(pid, stored, at)
        removed = stored[count:]
        if not removed:
            return Rewound(count, 0, None, None)
        name, segment_id = f"{KIND}-{new_id()}", new_id()
        meta = {"reason": KIND, "at": at, "kept": count}
        messages = [m.message for m in removed]
        path = await asyncio.to_thread(write_archive, kernel.data_dir, live.record.owner, pid, name, messages, meta)
        where = str(path.relative_to(kernel.data_dir))
        async with engine._tx(live) as tx:
            if await store.truncate_messages(pid, at) != len(removed):  # (held idle: nothing else writes it)
                raise StoreError(f"process {pid}: the history changed during the rewind; nothing was rewound")
            generation, ids = live.record.history_generation, (removed[0].id, removed[-1].id)
            await store.add_segment(SegmentRow(segment_id, pid, generation, KIND, *ids, where))
            await forget_context(tx, live)
            if not any(isinstance(m.message, UserMessage) and m.message.text.strip() for m in stored[:count]):
                tx.after.append(await retitle(kernel, live))
            rewound = {"at": at, "removed": len(removed), "segment": segment_id}
            await tx.signal(sig.CHANGED, changes=["messages"], rewound=rewound)
            tx.after.append(lambda: live.history.__delitem__(slice(count, None)))
            calls = calls_in(removed)
            if calls:  # (their ends then claim no record: see ``background.drop_jobs_of``)
                await drop_jobs_of(store, pid, calls)
                tx.after.append(lambda: engine.stop_background_of(pid, calls))
    return Rewound(count, len(removed), segment_id, name)


def calls_in(messages: list[StoredMessage]) -> set[CallKey]:
    """The tool calls ``messages`` make, as the jobs they started name them (run id, call id)."""
    return {
        (m.run_id, c.id)
        for m in messages
        if m.run_id is not None and isinstance(m.message, AssistantMessage)
        for c in m.message.tool_calls
    }


async def retitle(kernel: Kernel, live: _Live) -> Callable[[], None]:
    """Inside the transaction of a rewind that drops the user message an automatic title is cut
    from: delete that title (a person's stays) as a reset does, and return what, once the rewind
    has committed, stops the title being made of the dropped message and lets the next user
    message's run name the conversation (``Titles.pending``: no text yet, waiting)."""
    titles, pid = kernel.titles, live.record.pid
    announce = await titles.forget_automatic(live.record)

    def done() -> None:
        titles.cancel(pid)
        if titles.automatic:
            titles.pending[pid] = None
        announce()

    return done
