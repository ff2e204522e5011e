"""Signal watches: a process is told, as a system event, when another process logs a signal.

The source's signal log is the truth. A watch row remembers how far its watcher has read that
log (``seen_seq``); when the source logs a signal some watch wants, the watch reads the log from
there and delivers each match (``proc.run.started`` reason ``signal.watch``, run ``watch:<id>:<seq>``,
when it starts a run). Each delivery is claimed in its own transaction by moving the row's
``seen_seq`` from the value it was read at to the signal's (or, for a one-shot watch, by deleting
the row): the event and the move commit together or not at all. A crash anywhere is repaired at
the next start, which reads every watch's source from its ``seen_seq`` again, and a signal is
never delivered twice, even by two workers catching up at once.

A repeating watch on a busy source can log faster than its watcher reads (the watcher waits on a
slow tool, or on an approval nobody answers). At most ``MAX_WAITING`` of its events wait in the
watcher's queue; the signals after that are read past without a delivery, and the next delivery
says how many were left out, so a storm costs the watcher's model a bounded number of messages.

Several workers on one store (DESIGN §6): the worker publishing the source's signals (its lease
holder) delivers them, so a watch made on another worker must still be seen there. On a shared
store the index is therefore re-read from the store for every source that logged a watchable
signal (and before a new watch is checked for cycles), instead of trusting what this worker
loaded or added itself; a worker whose claim loses to another's reads the row again and goes on
from where that one left it. A worker that dies between logging a signal and delivering it leaves
the delivery owed with no one to notice; the worker holding the ``watches`` duty (kernel/duty.py)
looks for such watches at every renewal and delivers what their sources logged more than a lease
lifetime ago (sooner would race the publisher's own delivery for nothing).

Rules: both processes have the same owner (a watch shows the watcher what the source did); a
process may not watch itself (its own run ending would start its next run, forever), and a
repeating watch may not close a cycle of repeating watches (A wakes B wakes A …). A watch on a
process that is killed is removed with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from agentloop.kernel.duty import Duty
from agentloop.kernel.schedules import LimitReached
from agentloop.messages import AssistantMessage
from agentloop.process import signals as sig
from agentloop.process.api import new_id
from agentloop.process.engine import ProcessEngine
from agentloop.process.signals import Signal
from agentloop.process.store import EventRow, NoSuchProcess, ProcessRecord, Store, WatchRow

log = logging.getLogger("agentloop.kernel.watches")

# Signals that are logged (live-only stream deltas are not, so they cannot be watched).
WATCHABLE: frozenset[str] = frozenset(
    {
        sig.RUN_STARTED,
        sig.RUN_OUTPUT,
        sig.TOOL_STARTED,
        sig.TOOL_FINISHED,
        sig.HIL_REQUESTED,
        sig.RUN_FINISHED,
        sig.CHANGED,
        sig.COMPACTED,
    }
)
MAX_WATCHES = 100  # per watching process
MAX_FINAL_TEXT = 4_000  # of the source's answer, in the event text
MAX_PAYLOAD = 1_000  # of any other signal's payload
MAX_WAITING = 20  # a repeating watch's events waiting unread in its watcher's queue; past it, left out
PAGE = 200
WATCH_RUN_PREFIX = "watch:"  # of the run ids of watches' deliveries


class WatchError(ValueError):
    """A watch that cannot be made as asked (self-watch, a cycle, an unknown signal)."""


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


ANSWER_PAGE = 100  # messages ``run_answer`` reads at a time, newest first
LOG_PAGE = 500  # signals of a log read at a time (``logged_end``)


class WatchRouter:
    """The signal watches of one kernel: validation, an index by source, and delivery."""

    def __init__(self, store: Store, engine: ProcessEngine, *, duty: Duty | None = None) -> None:
        self.store = store
        self.engine = engine
        self.duty = duty  # on a shared store: while this worker holds it, it delivers what others left
        self.shared = store.shared  # other workers add, deliver and delete watches too
        self._index: dict[str, dict[str, WatchRow]] = {}  # source pid -> watch id -> row
        self._dirty: set[str] = set()  # sources that logged a watched signal since they were read
        self.retry = 5.0  # seconds before a source whose delivery failed is read again
        self._retrying: dict[str, asyncio.TimerHandle] = {}  # source pid -> its read again
        self._left_out: dict[str, int] = {}  # watch id -> signals not delivered since its last delivery
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- the API ----------------------------------------------------------------------------------

    async def add(self, pid: str, source_pid: str, signal: str = sig.RUN_FINISHED, *, once: bool = True) -> WatchRow:
        if not isinstance(signal, str) or signal not in WATCHABLE:  # (a list is not even hashable)
            raise WatchError(f"signal must be one of {', '.join(sorted(WATCHABLE))}")
        if not isinstance(once, bool):  # ("false" is true, and the store keeps it as an integer)
            raise WatchError(f"once must be true or false, got {once!r}")
        if pid == source_pid:
            raise WatchError("a process may not watch itself (each event would start the next run)")
        watcher = await self._record(pid)
        source = await self._record(source_pid)
        if watcher.owner != source.owner:
            raise PermissionError("only processes of the same owner may watch each other")
        async with self.store.transaction():
            # checked and inserted under one key (a cycle joins processes of one owner): two
            # concurrent adds of A->B and B->A, through any workers, cannot both find no cycle
            await self.store.exclusive(f"watches of {watcher.owner}")
            row = await self._add(pid, source_pid, signal, once)
        self._index.setdefault(source_pid, {})[row.id] = row
        self._mark(source_pid)
        return row

    async def _add(self, pid: str, source_pid: str, signal: str, once: bool) -> WatchRow:
        """Inside ``add``'s transaction: the checks, then the insert."""
        if not once and self.shared:  # the cycle check needs the other workers' watches too
            self._load(await self.store.watches())
        if not once and self._wakes(pid, source_pid):
            raise WatchError(
                f"process {source_pid} is woken by {pid} already (directly or through other watches):"
                " a repeating watch back would loop"
            )
        if len(await self.store.watches(pid=pid)) >= MAX_WATCHES:
            raise LimitReached(f"process {pid} has {MAX_WATCHES} watches already")
        # From the source's newest signal on: what it logs between this read and the index
        # update in ``add`` is read by the catch-up that its poke starts.
        seen = await self.store.last_event_seq(source_pid)
        row = WatchRow(new_id(), pid, source_pid, signal, once=once, seen_seq=seen, created_at=time.time())
        await self.store.add_watch(row)
        return row

    async def of(self, pid: str) -> list[WatchRow]:
        await self._record(pid)
        return await self.store.watches(pid=pid)

    async def remove(self, pid: str, watch_id: str) -> bool:
        """Delete one of the process's watches; False if it holds none by that id."""
        await self._record(pid)
        rows = [w for w in await self.store.watches(pid=pid) if w.id == watch_id]
        if not rows:
            return False
        async with self.store.transaction():
            gone = await self.store.delete_watch(watch_id)
        self._unindex(rows[0])
        self._left_out.pop(watch_id, None)
        return gone

    async def drop(self, pid: str) -> list[WatchRow]:
        """Delete the watches the process holds (inside the caller's transaction); pass what this
        returns to ``forget`` once it has committed."""
        rows = await self.store.watches(pid=pid)
        for row in rows:
            await self.store.delete_watch(row.id)
        return rows

    async def give_up(self, pid: str, source_pid: str, signal: str = sig.RUN_FINISHED) -> None:
        """Delete the one-shot watches ``pid`` holds for ``source_pid``'s ``signal``: the news they
        wait for is not wanted any more (the subagent is being stopped with its parent), and
        delivering it would start a run of the watcher that nobody asked for."""
        rows = [w for w in await self.store.watches(pid=pid, source_pid=source_pid) if w.once and w.signal == signal]
        if not rows:
            return
        async with self.store.transaction():
            for row in rows:
                await self.store.delete_watch(row.id)
        self.forget(rows)

    def forget(self, rows: list[WatchRow] | None = None, *, killed: str | None = None) -> None:
        """Update the index after ``drop`` (``rows``) or after process ``killed`` was deleted
        (which removed the watches it held and those on it)."""
        for row in rows or ():
            self._unindex(row)
            self._left_out.pop(row.id, None)
        if killed is not None:
            for row in self._index.pop(killed, {}).values():
                self._left_out.pop(row.id, None)
            for watches in self._index.values():
                for row in [w for w in watches.values() if w.pid == killed]:
                    del watches[row.id]
                    self._left_out.pop(row.id, None)

    # -- delivery ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the watches, read every source from where its watches stopped, follow the hub."""
        self._load(await self.store.watches())
        self._dirty.update(self._index)
        self.engine.hub.tap(self._on_signal)
        self._task = asyncio.create_task(self._run(), name="agentloop-watches")
        self._poke.set()

    async def stop(self) -> None:
        self.engine.hub.untap(self._on_signal)
        for handle in self._retrying.values():
            handle.cancel()
        self._retrying.clear()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self.duty is not None:
            await self.duty.release()

    def _on_signal(self, pid: str, signal: Signal) -> None:
        """The hub's tap: runs for every published signal, so it only looks at the index (on a
        shared store, only at the signal: the index there may miss the other workers' watches)."""
        if signal.seq is None:
            return
        if self.shared:  # a watch on ``pid`` may have been made on another worker: the store says
            if signal.signal in WATCHABLE:
                self._mark(pid)
            return
        watches = self._index.get(pid)
        if watches and any(w.signal == signal.signal for w in watches.values()):
            self._mark(pid)

    def _mark(self, source_pid: str) -> None:
        self._dirty.add(source_pid)
        self._poke.set()

    def _retry_later(self, source_pid: str) -> None:
        if source_pid not in self._retrying:
            self._retrying[source_pid] = asyncio.get_running_loop().call_later(self.retry, self._retried, source_pid)

    def _retried(self, source_pid: str) -> None:
        del self._retrying[source_pid]
        self._mark(source_pid)

    async def _run(self) -> None:
        while True:
            if self.duty is None:
                await self._poke.wait()
            else:
                with contextlib.suppress(TimeoutError):  # (not ``wait_for``: on 3.11 it can swallow a cancel)
                    async with asyncio.timeout(self.duty.every):
                        await self._poke.wait()
                await self._sweep(self.duty)
            self._poke.clear()
            dirty, self._dirty = self._dirty, set()
            for source_pid in sorted(dirty):
                if self.shared:
                    try:
                        self._load(await self.store.watches(source_pid=source_pid), source_pid)
                    except Exception:  # (the database is away) tried again at the next poke
                        log.exception("watches on process %s: could not read them", source_pid)
                        self._dirty.add(source_pid)
                        continue
                for row in list(self._index.get(source_pid, {}).values()):
                    if row.pid in self.engine.clearing:  # back to it once that is over (a reset drops it)
                        self.engine.when_cleared(row.pid, partial(self._mark, source_pid))
                        continue
                    try:
                        await self._catch_up(row)
                    except NoSuchProcess:  # the watcher was killed meanwhile
                        self._unindex(row)
                    except Exception:
                        # tried again in a while: nothing else would read this source again before
                        # it logs another signal the watch wants (on one worker: before a restart)
                        log.exception("watch %s of process %s: delivery failed; retrying", row.id, row.pid)
                        self._retry_later(source_pid)

    async def _sweep(self, duty: Duty) -> None:
        """On duty: mark the sources owing deliveries their publishers should have made by now."""
        try:
            if await duty.hold():
                self._dirty.update(await self.store.lagging_watches(time.time() - duty.ttl))
        except Exception:  # (the database is away) tried again at the next renewal
            log.exception("watches: could not look for undelivered signals")

    async def _catch_up(self, row: WatchRow) -> None:
        """Deliver every signal the watch wants that its source logged after ``seen_seq``."""
        after = row.seen_seq
        while True:
            page = await self.store.events(row.source_pid, after_seq=after, limit=PAGE)
            for event in page:
                if event.signal != row.signal:
                    after = event.seq
                    continue
                if not row.once and await self._unread(row) >= MAX_WAITING:
                    # a storm while the watcher cannot read (a slow tool, an approval nobody
                    # answers): its next model call would get every one of them at once
                    async with self.store.transaction():
                        moved = await self.store.set_watch_seen(row.id, event.seq, expect=row.seen_seq)
                    if not moved:
                        fresh = await self._reread(row)
                        if fresh is None:
                            return
                        row, after = fresh, fresh.seen_seq
                        break
                    self._left_out[row.id] = self._left_out.get(row.id, 0) + 1
                    row.seen_seq = after = event.seq
                    continue
                text = await self._render(row, event)
                claim = self._claim(row, event.seq)
                key = f"{WATCH_RUN_PREFIX}{row.id}:{event.seq}"
                delivered = await self.engine.claimed_event(
                    row.pid, text, claim=claim, run_id=key, reason="signal.watch"
                )
                if delivered is None:
                    fresh = await self._reread(row)  # another worker delivered it, or more
                    if fresh is None:
                        return
                    row, after = fresh, fresh.seen_seq
                    break  # read the log again from where that worker left the watch
                row.seen_seq = after = event.seq
                self._left_out.pop(row.id, None)  # (the delivery said how many)
                if row.once:
                    self._unindex(row)
                    return
            else:
                if len(page) < PAGE:
                    break
        if after > row.seen_seq:  # signals it does not want: read past them once, not at every pass
            async with self.store.transaction():
                if await self.store.set_watch_seen(row.id, after, expect=row.seen_seq):
                    row.seen_seq = after

    async def _unread(self, row: WatchRow) -> int:
        """How many of the watch's deliveries wait in its watcher's queue, not read yet."""
        mine = f"{WATCH_RUN_PREFIX}{row.id}:"
        return sum(
            1 for q in await self.store.queue(row.pid) if q.kind == "system" and (q.run_id or "").startswith(mine)
        )

    def _claim(self, row: WatchRow, seq: int) -> Callable[[], Awaitable[bool]]:
        """The delivery of signal ``seq``'s claim: the row moves from the ``seen_seq`` this worker
        read to ``seq`` (a one-shot watch is deleted), which only one delivery can do."""
        if row.once:
            return partial(self.store.delete_watch, row.id)
        return partial(self.store.set_watch_seen, row.id, seq, expect=row.seen_seq)

    async def _reread(self, row: WatchRow) -> WatchRow | None:
        """The watch's row as the store has it now (None, and out of the index, once it is gone)."""
        fresh = next((w for w in await self.store.watches(source_pid=row.source_pid) if w.id == row.id), None)
        self._unindex(row)
        if fresh is not None:
            self._index.setdefault(fresh.source_pid, {})[fresh.id] = fresh
        return fresh

    async def _render(self, row: WatchRow, event: EventRow) -> str:
        """The event as the watcher's model reads it: who, what, and the gist of the payload
        (for a finished run: its status and the source's final answer)."""
        lines = [f"[signal watch {row.id}] process {row.source_pid} logged {event.signal} (seq {event.seq})"]
        payload: dict[str, Any] = {k: v for k, v in event.payload.items() if k != "pid"}
        if event.signal == sig.RUN_FINISHED:
            lines.append(f"run {payload.get('runId')}: status {payload.get('status')} ({payload.get('reason')})")
            if payload.get("error"):
                lines.append(f"error: {_clip(str(payload['error']), MAX_PAYLOAD)}")
            final = await run_answer(self.store, row.source_pid, payload.get("runId"), limit=50)
            if final:
                lines.append("final answer:\n" + _clip(final, MAX_FINAL_TEXT))
        else:
            lines.append("payload: " + _clip(json.dumps(payload, ensure_ascii=False, default=str), MAX_PAYLOAD))
        left_out = self._left_out.get(row.id, 0)
        if left_out:
            lines.append(
                f"({left_out} earlier signal{'s' if left_out > 1 else ''} of this watch"
                f" {'were' if left_out > 1 else 'was'} left out:"
                f" {MAX_WAITING} of its events were waiting unread)"
            )
        if row.once:
            lines.append("(the watch has ended: it was for one signal)")
        return "\n".join(lines)

    # -- helpers ----------------------------------------------------------------------------------

    async def _record(self, pid: str) -> ProcessRecord:
        return (await self.engine.live(pid)).record  # NoSuchProcess for an unknown or killed pid

    def _wakes(self, start: str, target: str) -> bool:
        """Whether ``start`` wakes ``target``, directly or through others, by repeating watches."""
        seen, todo = {start}, [start]
        while todo:
            node = todo.pop()
            for row in self._index.get(node, {}).values():
                if row.once or row.pid in seen:
                    continue
                if row.pid == target:
                    return True
                seen.add(row.pid)
                todo.append(row.pid)
        return False

    def _load(self, rows: list[WatchRow], source_pid: str | None = None) -> None:
        """Make the index what the store says: for ``source_pid`` (``rows`` are its watches), or
        for every source (``rows`` are all the watches)."""
        if source_pid is None:
            self._index = {}
        else:
            self._index.pop(source_pid, None)
        for row in rows:
            self._index.setdefault(row.source_pid, {})[row.id] = row

    def _unindex(self, row: WatchRow) -> None:
        watches = self._index.get(row.source_pid)
        if watches is not None:
            watches.pop(row.id, None)
            if not watches:
                del self._index[row.source_pid]


async def run_answer(store: Store, pid: str, run_id: Any, *, limit: int | None = None) -> str:
    """The last words of run ``run_id`` of process ``pid`` (its newest assistant text), among its
    newest ``limit`` messages (None: all of them, read a page at a time from the newest, so that a
    long-lived process's recent run costs one page); "" when there are none, or no such process."""
    before: int | None = None
    seen = 0
    while limit is None or seen < limit:
        size = ANSWER_PAGE if limit is None else min(ANSWER_PAGE, limit - seen)
        try:
            page = await store.history(pid, limit=size, before=before)
        except NoSuchProcess:
            return ""
        for stored in reversed(page):
            if stored.run_id == run_id and isinstance(stored.message, AssistantMessage) and stored.message.text:
                return stored.message.text
        if len(page) < size:
            return ""
        seen += len(page)
        before = page[0].id
    return ""


async def logged_end(store: Store, pid: str, run_id: str, after: int) -> dict[str, Any] | None:
    """The ``proc.run.finished`` payload of run ``run_id`` of process ``pid`` if its log has it
    after ``after`` (read a page at a time)."""
    while True:
        page = await store.events(pid, after_seq=after, limit=LOG_PAGE)
        for row in page:
            if row.signal == sig.RUN_FINISHED and row.payload.get("runId") == run_id:
                return dict(row.payload)
            after = row.seq
        if len(page) < LOG_PAGE:
            return None
