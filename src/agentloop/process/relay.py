"""Live progress signals between workers on a shared store (DESIGN §6).

``proc.run.stream`` deltas and ``proc.run.tool.update`` progress are never logged (see
``signals``), so a watcher on a worker that does not hold the process would see a run's answer
(a command's output) only once it is complete. The holder therefore relays them: it collects the
progress of its processes and sends it every ``interval`` seconds (and a process's own before each
commit that ends one of its model calls or tool calls) in one cross-worker message (NOTIFY on
PostgreSQL) for all of them. A payload is relayed as it is published; one of another signal than
``proc.run.stream`` carries that signal's name under ``SIGNAL_KEY``, taken off again on arrival.

Only processes somebody follows elsewhere are relayed: a worker whose watchers follow a process
held elsewhere says so (``announce``) when the first one starts and again every poll, and a
holder relays a process while such an announcement is younger than ``interest_ttl``.

Each batch names the last logged signal its holder had committed when the deltas were made (its
*base*), so a receiving worker places the batch right after that signal in what its watchers see:
it first feeds them the log up to the base, and it drops a batch whose base is behind what they
have already seen (the deltas of an answer whose ``proc.run.output`` they hold). Progress is
best-effort, as on one worker: a lost or dropped batch costs only live text, never a logged signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from agentloop.process.signals import RUN_STREAM, TOOL_UPDATE, Signal
from agentloop.process.store import RelayBatch, Store

log = logging.getLogger("agentloop.relay")

INTERVAL = 0.05  # seconds a delta waits at most before it is relayed

Batch = tuple[int, list[dict[str, Any]]]  # (base seq, payloads of progress signals)
# in a relayed payload: the name of its signal, when it is not ``proc.run.stream`` (a batch on the
# wire is payloads only, and a worker that predates the key shows such a payload as a stream event
# that no client draws)
SIGNAL_KEY = "~signal"
RELAYED = frozenset({RUN_STREAM, TOOL_UPDATE})  # what a relayed payload may be: live-only progress


class Relay:
    """One worker's side of the relay: the deltas it sends for the processes it holds, and the
    batches it received for processes its watchers follow elsewhere."""

    def __init__(self, store: Store, owner: str, *, interest_ttl: float, interval: float = INTERVAL) -> None:
        self.store = store
        self.owner = owner
        self.interval = interval
        self.interest_ttl = interest_ttl
        self._wanted: dict[str, float] = {}  # pid -> until when (monotonic) another worker follows it
        self._outbox: dict[str, list[Batch]] = {}
        self._inbox: dict[str, list[Batch]] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._sending = asyncio.Lock()  # one send at a time: a flush waits for one under way

    # -- sending (the holder) -----------------------------------------------------------------

    def wanted(self, pid: str) -> bool:
        """Whether a watcher on another worker follows ``pid``."""
        until = self._wanted.get(pid)
        return until is not None and until > time.monotonic()

    def followed(self, sender: str, pids: list[str]) -> None:
        """Another worker announced the processes its watchers follow."""
        if sender == self.owner:
            return
        now = time.monotonic()
        self._wanted = {pid: until for pid, until in self._wanted.items() if until > now}
        for pid in pids:
            self._wanted[pid] = now + self.interest_ttl

    def send(self, pid: str, base: int, payload: dict[str, Any], *, signal: str = RUN_STREAM) -> bool:
        """Relay one progress signal of ``pid`` (a delta, unless ``signal`` says otherwise), made
        after the holder's committed signal ``base``, if anyone elsewhere follows the process;
        returns whether it will be sent."""
        if not self.wanted(pid):
            return False
        if signal != RUN_STREAM:
            payload = {**payload, SIGNAL_KEY: signal}
        box = self._outbox.setdefault(pid, [])
        if box and box[-1][0] == base:
            box[-1][1].append(payload)
        else:
            box.append((base, [payload]))
        self._arm()
        return True

    async def flush(self, pid: str) -> None:
        """Send what waits for ``pid`` now, and let a send under way finish: before a commit, so
        its deltas arrive ahead of it."""
        box = self._outbox.pop(pid, None)
        async with self._sending:
            if box:
                await self._send([(pid, base, payloads) for base, payloads in box])

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        self._outbox.clear()
        self._inbox.clear()

    def _arm(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_later(), name="agentloop-relay")

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.interval)
        boxes, self._outbox = self._outbox, {}
        async with self._sending:
            await self._send([(pid, base, payloads) for pid, box in boxes.items() for base, payloads in box])
        if self._outbox:  # deltas made while this send was under way
            self._flusher = None
            self._arm()

    async def _send(self, batches: list[RelayBatch]) -> None:
        try:
            await self.store.relay(self.owner, batches)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # only progress: the runs go on, their watchers get the text logged
            log.debug("deltas not relayed: %s", exc)

    # -- receiving (the other workers) ----------------------------------------------------------

    async def announce(self, pids: list[str]) -> None:
        """Tell the other workers this one's watchers follow ``pids`` (best-effort, repeated)."""
        try:
            await self.store.follow_live(self.owner, pids)
        except Exception as exc:
            log.debug("interest in %d processes not announced: %s", len(pids), exc)

    def received(self, pid: str, base: int, payloads: list[dict[str, Any]]) -> None:
        """Keep a batch from another worker until the log is read up to its place."""
        self._inbox.setdefault(pid, []).append((base, payloads))

    def waiting(self, pid: str) -> bool:
        return pid in self._inbox

    def forget(self, pid: str) -> None:
        self._inbox.pop(pid, None)

    def merge(self, pid: str, after: int, rows: list[Signal], publish: Callable[[Signal], None]) -> None:
        """Publish the log ``rows`` read after seq ``after`` with the batches received for ``pid``
        in their place: a batch right after its base, none behind what was already published;
        a batch based past the rows (its commit not read yet) waits for the next read."""
        batches = self._inbox.pop(pid, [])
        for row in rows:
            assert row.seq is not None
            while batches and batches[0][0] < row.seq:
                publish_batch(batches.pop(0), after, publish)
            publish(row)
            after = row.seq
        waiting = []
        for batch in batches:
            if batch[0] > after:
                waiting.append(batch)
            else:
                publish_batch(batch, after, publish)
        if waiting:
            self._inbox.setdefault(pid, [])[:0] = waiting


def publish_batch(batch: Batch, after: int, publish: Callable[[Signal], None]) -> None:
    """Publish a relayed batch to watchers who have seen the log up to ``after``: only if it was
    made right after that (else they have seen signals after it, and its deltas are stale)."""
    base, payloads = batch
    if base == after:
        for payload in payloads:
            name = payload.get(SIGNAL_KEY, RUN_STREAM)
            if name not in RELAYED:
                continue  # never a logged signal: those come from the log
            if SIGNAL_KEY in payload:
                payload = {k: v for k, v in payload.items() if k != SIGNAL_KEY}
            publish(Signal(name, payload, base=base))
