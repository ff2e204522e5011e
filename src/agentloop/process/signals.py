"""Process signals: what a durable process tells its watchers, and how watchers follow it.

Durable signals are written to the process's ``events`` log inside the transaction that caused
them, each with the next per-process sequence number, so a watcher that drops its connection
resumes with ``after_seq`` and misses nothing. Progress is the exception: stream deltas
(``proc.run.stream``) and a running tool's updates (``proc.run.tool.update``, what it reports with
``ToolContext.update``: Shell's output as it comes) are live-only, without a seq (a resumed
watcher gets the whole text in ``proc.run.output``, the whole result in ``proc.run.tool.finished``),
because logging every token or every line would make the log the bottleneck.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

RUN_STARTED = "proc.run.started"
RUN_STREAM = "proc.run.stream"
RUN_RETRYING = "proc.run.retrying"  # a failed model call being retried, or a switch to a fallback
RUN_OUTPUT = "proc.run.output"
TOOL_STARTED = "proc.run.tool.started"
# live-only, as RUN_STREAM: {pid, runId, callId, name, update} while a call runs (``process/calls.py``)
TOOL_UPDATE = "proc.run.tool.update"
TOOL_FINISHED = "proc.run.tool.finished"
HIL_REQUESTED = "proc.run.hil.requested"
RUN_FINISHED = "proc.run.finished"
CHANGED = "proc.changed"
COMPACTED = "proc.compacted"
# not logged: sent to a watcher that resumes after a seq the log no longer holds the signals after
# (pruned, or dropped by a reset), before the oldest kept one, so it knows to read the history
LOG_PRUNED = "proc.log.pruned"
# what went into a run's system prompt (sections, sizes, files cut or left out, tools, warnings):
# once per run whose prompt was built fresh, with the run's first model step
PROMPT_COMPILED = "proc.prompt.compiled"


@dataclass(frozen=True)
class Signal:
    """One signal. ``seq`` is None for live-only progress signals; their ``base`` is the seq of
    the last logged signal when they were made, so a watcher that has read the log past it knows
    they are stale (deltas of a step it has seen end)."""

    signal: str
    payload: dict[str, Any]
    seq: int | None = None
    base: int | None = None


# A watcher that falls this far behind (a client that reads slowly, while a run streams) loses
# what it has not taken yet: ``GAP`` takes its place, and the watcher reads the log again (only
# live deltas are lost). Unbounded, one slow client would hold every signal in memory.
BACKLOG = 10_000
GAP = Signal("gap", {})

# What a process's log keeps: its newest signals, this many (and those a watch has still to read).
# Older ones are dropped as runs end, a thousand at a time, so a conversation that lasts for months
# (a heartbeat every half hour, a tool output per call) does not grow the database for ever; its
# messages, not its log, are the conversation, and a reset drops the whole log anyway.
KEPT_SIGNALS = 10_000
PRUNE_EVERY = 1_000


def for_account(signal: Signal) -> bool:
    """Whether an account's stream carries ``signal``: approvals asked and answered (or dropped:
    ``proc.changed`` naming "hil") and runs that ended, so that one inbox can show what every
    process of the account waits for, runs nobody follows included (a schedule's, a subagent's);
    and new titles (``proc.changed`` naming "title"), for a list of every process. Not the copies
    of a subagent's approval signals on its conversation (``subagent`` in the payload): the
    account stream has the subagent's own."""
    if "subagent" in signal.payload:
        return False
    if signal.signal == CHANGED:
        changes = signal.payload.get("changes", ())
        return "hil" in changes or "title" in changes
    return signal.signal in (HIL_REQUESTED, RUN_FINISHED)


AccountQueue = asyncio.Queue[tuple[str, Signal] | None]


@dataclass
class SignalHub:
    """Fan-out of signals to live watchers, per process. Committed signals are announced after
    their transaction commits, so a watcher never sees a signal the log does not have."""

    _watchers: dict[str, set[asyncio.Queue[Signal | None]]] = field(default_factory=lambda: defaultdict(set))
    # owner -> its account's watchers (``watch_account``): they get (pid, signal) of every process
    # of the owner's that ``publish`` is told the owner of
    _accounts: dict[str, set[AccountQueue]] = field(default_factory=dict)
    # Called with every published signal of every process, once it is durable (the kernel's
    # signal watches): they must be cheap, synchronous and never raise, since they run in the
    # callback that settles a step's commit, for stream deltas too.
    _taps: list[Callable[[str, Signal], None]] = field(default_factory=list)

    def tap(self, listener: Callable[[str, Signal], None]) -> None:
        self._taps.append(listener)

    def untap(self, listener: Callable[[str, Signal], None]) -> None:
        if listener in self._taps:
            self._taps.remove(listener)

    def watch(self, pid: str) -> asyncio.Queue[Signal | None]:
        """A queue of the process's signals from now on (``GAP`` where some were dropped, see
        ``BACKLOG``; None once the process is gone)."""
        queue: asyncio.Queue[Signal | None] = asyncio.Queue(maxsize=BACKLOG)
        self._watchers[pid].add(queue)
        return queue

    def unwatch(self, pid: str, queue: asyncio.Queue[Signal | None]) -> None:
        watchers = self._watchers.get(pid)
        if watchers is not None:
            watchers.discard(queue)
            if not watchers:
                del self._watchers[pid]

    def watching(self, pid: str) -> bool:
        return bool(self._watchers.get(pid))

    def watch_account(self, owner: str) -> AccountQueue:
        """A queue of (pid, signal) for the ``for_account`` signals of ``owner``'s processes from
        now on: live only, nothing is replayed (the store has what is pending). None ends it: the
        hub closed, or the watcher fell ``BACKLOG`` behind and should read the store again."""
        queue: AccountQueue = asyncio.Queue(maxsize=BACKLOG)
        self._accounts.setdefault(owner, set()).add(queue)
        return queue

    def unwatch_account(self, owner: str, queue: AccountQueue) -> None:
        watchers = self._accounts.get(owner)
        if watchers is not None:
            watchers.discard(queue)
            if not watchers:
                del self._accounts[owner]

    def publish(self, pid: str, signal: Signal, owner: str | None = None) -> None:
        """Announce ``signal``; with its process's ``owner``, to the owner's account watchers too.
        The steps this worker commits give it; what is read from the log or relayed for a process
        another worker holds (a shared store) comes without, and reaches process watchers only."""
        for queue in self._watchers.get(pid, ()):
            _put(queue, signal)
        if owner is not None and self._accounts:  # the hot path's only cost while nobody watches an account
            self._to_account(owner, pid, signal)
        for listener in self._taps:
            listener(pid, signal)

    def watches_account(self, owner: str) -> bool:
        """Whether anyone here watches ``owner``'s account stream."""
        return bool(self._accounts.get(owner))

    def to_account(self, owner: str, pid: str, signal: Signal) -> None:
        """``signal`` of ``owner``'s process ``pid`` to the account's watchers only (another
        worker committed it: its process watchers read it from the log)."""
        self._to_account(owner, pid, signal)

    def _to_account(self, owner: str, pid: str, signal: Signal) -> None:
        watchers = self._accounts.get(owner)
        if not watchers or not for_account(signal):
            return
        for queue in list(watchers):
            if queue.full():  # fallen too far behind: ended, so that it reads the inbox again
                self.unwatch_account(owner, queue)
                _end(queue)
            else:
                queue.put_nowait((pid, signal))

    def close_accounts(self) -> None:
        """Shutting down: end every account watcher's stream."""
        accounts, self._accounts = self._accounts, {}
        for watchers in accounts.values():
            for queue in watchers:
                _end(queue)

    def close(self, pid: str) -> None:
        """The process is gone: end every watcher's stream."""
        for queue in self._watchers.pop(pid, set()):
            _put(queue, None)


def _end(queue: AccountQueue) -> None:
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(None)


def _put(queue: asyncio.Queue[Signal | None], item: Signal | None) -> None:
    if queue.full():  # the watcher fell too far behind: it reads the log again instead
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(GAP)
    queue.put_nowait(item)
