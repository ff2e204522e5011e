"""Signal watches: a process is told, as a system event, when another process logs a signal.

The source's signal log is the truth. A watch row remembers how far its watcher has read that
log (``seen_seq``); when the source logs a signal some watch wants, the watch reads the log from
there and delivers each match with the idempotency key ``watch:<id>:<seq>`` (``proc.run.started``
reason ``signal.watch`` when it starts a run). A crash anywhere is repaired at the next start,
which reads every watch's source from its ``seen_seq`` again; a key delivered before the crash
is not delivered twice.

Rules: both processes have the same owner (a watch shows the watcher what the source did); a
process may not watch itself (its own run ending would start its next run, forever), and a
repeating watch may not close a cycle of repeating watches (A wakes B wakes A …). A watch on a
process that is killed is removed with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

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
PAGE = 200


class WatchError(ValueError):
    """A watch that cannot be made as asked (self-watch, a cycle, an unknown signal)."""


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class WatchRouter:
    """The signal watches of one kernel: validation, an index by source, and delivery."""

    def __init__(self, store: Store, engine: ProcessEngine) -> None:
        self.store = store
        self.engine = engine
        self._index: dict[str, dict[str, WatchRow]] = {}  # source pid -> watch id -> row
        self._dirty: set[str] = set()  # sources that logged a watched signal since they were read
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- the API ----------------------------------------------------------------------------------

    async def add(self, pid: str, source_pid: str, signal: str = sig.RUN_FINISHED, *, once: bool = True) -> WatchRow:
        if signal not in WATCHABLE:
            raise WatchError(f"signal must be one of {', '.join(sorted(WATCHABLE))}")
        if pid == source_pid:
            raise WatchError("a process may not watch itself (each event would start the next run)")
        watcher = await self._record(pid)
        source = await self._record(source_pid)
        if watcher.owner != source.owner:
            raise PermissionError("only processes of the same owner may watch each other")
        if not once and self._wakes(pid, source_pid):
            raise WatchError(
                f"process {source_pid} is woken by {pid} already (directly or through other watches):"
                " a repeating watch back would loop"
            )
        if len(await self.store.watches(pid=pid)) >= MAX_WATCHES:
            raise LimitReached(f"process {pid} has {MAX_WATCHES} watches already")
        # From the source's newest signal on: what it logs between this read and the index
        # update below is read by the catch-up that the poke at the end starts.
        seen = await self.store.last_event_seq(source_pid)
        row = WatchRow(new_id(), pid, source_pid, signal, once=once, seen_seq=seen, created_at=time.time())
        async with self.store.transaction():
            await self.store.add_watch(row)
        self._index.setdefault(source_pid, {})[row.id] = row
        self._mark(source_pid)
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
        if killed is not None:
            self._index.pop(killed, None)
            for watches in self._index.values():
                for row in [w for w in watches.values() if w.pid == killed]:
                    del watches[row.id]

    # -- delivery ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the watches, read every source from where its watches stopped, follow the hub."""
        for row in await self.store.watches():
            self._index.setdefault(row.source_pid, {})[row.id] = row
            self._dirty.add(row.source_pid)
        self.engine.hub.tap(self._on_signal)
        self._task = asyncio.create_task(self._run(), name="agentloop-watches")
        self._poke.set()

    async def stop(self) -> None:
        self.engine.hub.untap(self._on_signal)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _on_signal(self, pid: str, signal: Signal) -> None:
        """The hub's tap: runs for every published signal, so it only looks at the index."""
        if signal.seq is None:
            return
        watches = self._index.get(pid)
        if watches and any(w.signal == signal.signal for w in watches.values()):
            self._mark(pid)

    def _mark(self, source_pid: str) -> None:
        self._dirty.add(source_pid)
        self._poke.set()

    async def _run(self) -> None:
        while True:
            await self._poke.wait()
            self._poke.clear()
            dirty, self._dirty = self._dirty, set()
            for source_pid in sorted(dirty):
                for row in list(self._index.get(source_pid, {}).values()):
                    try:
                        await self._catch_up(row)
                    except NoSuchProcess:  # the watcher was killed meanwhile
                        self._unindex(row)
                    except Exception:
                        log.exception("watch %s of process %s: delivery failed", row.id, row.pid)

    async def _catch_up(self, row: WatchRow) -> None:
        """Deliver every signal the watch wants that its source logged after ``seen_seq``."""
        after = row.seen_seq
        while True:
            page = await self.store.events(row.source_pid, after_seq=after, limit=PAGE)
            for event in page:
                after = event.seq
                if event.signal != row.signal:
                    continue
                text = await self._render(row, event)
                key = f"watch:{row.id}:{event.seq}"
                await self.engine.signal_event(row.pid, text, run_id=key, reason="signal.watch")
                async with self.store.transaction():
                    await self.engine.forget_admission(row.pid, key)  # the watch moves past this signal
                    if row.once:
                        await self.store.delete_watch(row.id)
                    else:
                        await self.store.set_watch_seen(row.id, event.seq)
                row.seen_seq = event.seq
                if row.once:
                    self._unindex(row)
                    return
            if len(page) < PAGE:
                break
        if after > row.seen_seq:
            async with self.store.transaction():
                await self.store.set_watch_seen(row.id, after)
            row.seen_seq = after

    async def _render(self, row: WatchRow, event: EventRow) -> str:
        """The event as the watcher's model reads it: who, what, and the gist of the payload
        (for a finished run: its status and the source's final answer)."""
        lines = [f"[signal watch {row.id}] process {row.source_pid} logged {event.signal} (seq {event.seq})"]
        payload: dict[str, Any] = {k: v for k, v in event.payload.items() if k != "pid"}
        if event.signal == sig.RUN_FINISHED:
            lines.append(f"run {payload.get('runId')}: status {payload.get('status')} ({payload.get('reason')})")
            if payload.get("error"):
                lines.append(f"error: {_clip(str(payload['error']), MAX_PAYLOAD)}")
            final = await self._final_text(row.source_pid, payload.get("runId"))
            if final:
                lines.append("final answer:\n" + _clip(final, MAX_FINAL_TEXT))
        else:
            lines.append("payload: " + _clip(json.dumps(payload, ensure_ascii=False, default=str), MAX_PAYLOAD))
        if row.once:
            lines.append("(the watch has ended: it was for one signal)")
        return "\n".join(lines)

    async def _final_text(self, pid: str, run_id: Any) -> str:
        try:
            recent = await self.store.history(pid, limit=50)
        except NoSuchProcess:
            return ""
        for stored in reversed(recent):
            if stored.run_id == run_id and isinstance(stored.message, AssistantMessage) and stored.message.text:
                return stored.message.text
        return ""

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

    def _unindex(self, row: WatchRow) -> None:
        watches = self._index.get(row.source_pid)
        if watches is not None:
            watches.pop(row.id, None)
            if not watches:
                del self._index[row.source_pid]
