"""Process signals: what a durable process tells its watchers, and how watchers follow it.

Durable signals are written to the process's ``events`` log inside the transaction that caused
them, each with the next per-process sequence number, so a watcher that drops its connection
resumes with ``after_seq`` and misses nothing. Progress is the exception: stream deltas
(``proc.run.stream``) and a running tool's updates (``proc.run.tool.update``, what it reports with
``ToolContext.update``: Shell's output as it comes) are live-only, without a seq (a resumed
watcher gets the whole text in ``proc.run.output``, the whole result in ``proc.run.tool.finished``),
because logging every token or every line would make the log the bottleneck.

An account's stream (``for_account``: approvals asked and answered, runs ended, across all of an
owner's processes) is resumable the same way: each account-level signal a step logs is also copied
to the owner's account log in the same transaction, with the next per-owner account seq
(``AccountSignal.seq``), so a watcher that drops its connection resumes after the last one it saw.
New titles are the exception there: announced live only (no account seq), as they are not logged.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentloop.process.store.base import AccountEventRow

RUN_STARTED = "proc.run.started"
RUN_STREAM = "proc.run.stream"
RUN_RETRYING = "proc.run.retrying"  # a failed model call being retried, or a switch to a fallback
RUN_OUTPUT = "proc.run.output"
# an execution window used up, the run going on in the next (``loop/windows.py``): {runId, window,
# rounds, toolCalls}, ``window`` the one that opens, the counts those of the one that ended
RUN_WINDOW = "proc.run.window"
TOOL_STARTED = "proc.run.tool.started"
# live-only, as RUN_STREAM: {pid, runId, callId, name, update} while a call runs (``process/calls.py``)
TOOL_UPDATE = "proc.run.tool.update"
TOOL_FINISHED = "proc.run.tool.finished"
# the ``ToolRetry`` piece's episodes (``loop/tool_retry.py``), as its ``post_turn`` hook reports them
# (``process/calls.py``), logged after the step they end: a failure counted {runId, callId, name,
# errorClass, roundsLeft, classLeft, toolLeft, signatureLeft}, the budgets given back {runId,
# failures, rounds}, a budget spent {runId, callId, name, errorClass, budget, limit, reason}
TOOL_RETRY_SCHEDULED = "proc.run.tool.retry.scheduled"
TOOL_RETRY_RESOLVED = "proc.run.tool.retry.resolved"
TOOL_RETRY_EXHAUSTED = "proc.run.tool.retry.exhausted"
HIL_REQUESTED = "proc.run.hil.requested"
RUN_FINISHED = "proc.run.finished"
CHANGED = "proc.changed"
COMPACTED = "proc.compacted"
# not logged: sent to a watcher that resumes after a seq the log no longer holds the signals after
# (pruned, or dropped by a reset), before the oldest kept one, so it knows to read the history
LOG_PRUNED = "proc.log.pruned"
# not logged either: the account stream's own notice to a watcher that resumes after an account
# seq the account log no longer holds the signals after, before the oldest kept one (as LOG_PRUNED)
ACCOUNT_LOG_PRUNED = "account.log.pruned"
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
# What an owner's account log keeps, the same way: its newest account signals, this many, pruned
# by the step whose account seq passes a multiple of ACCOUNT_PRUNE_EVERY (a statement per thousand).
KEPT_ACCOUNT_SIGNALS = 10_000
ACCOUNT_PRUNE_EVERY = 1_000


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
    return signal.signal in (HIL_REQUESTED, RUN_FINISHED, "device.status")  # (the last: server/devices.py, live)


@dataclass(frozen=True, slots=True)
class AccountSignal:
    """One item of an account stream: ``signal`` of the owner's process ``pid``, and its ``seq`` in
    the owner's account log (what a watcher resumes after). ``seq`` is None for what the account
    log does not keep: new titles (live only) and the stream's own notices
    (``ACCOUNT_LOG_PRUNED``, whose ``pid`` is None too)."""

    pid: str | None
    signal: Signal
    seq: int | None = None

    @classmethod
    def logged(cls, row: AccountEventRow) -> AccountSignal:
        """The item a row of the account log stands for."""
        return cls(row.pid, Signal(row.signal, row.payload, row.pid_seq), row.seq)


AccountQueue = asyncio.Queue[AccountSignal | None]


@dataclass
class SignalHub:
    """Fan-out of signals to live watchers, per process. Committed signals are announced after
    their transaction commits, so a watcher never sees a signal the log does not have."""

    _watchers: dict[str, set[asyncio.Queue[Signal | None]]] = field(default_factory=lambda: defaultdict(set))
    # owner -> its account's watchers (``watch_account``): they get the account signals of every
    # process of the owner's (``to_account``, and the new titles ``publish`` is told the owner of)
    _accounts: dict[str, set[AccountQueue]] = field(default_factory=dict)
    # owner -> the newest account seq its watchers here were given (or had read): while anyone
    # watches it, what a worker on a shared store checks the account log against (``account_heads``)
    _heads: dict[str, int] = field(default_factory=dict)
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

    def recheck(self, pid: str) -> None:
        """Have the process's watchers read its log now (``GAP`` in their queues): it holds
        signals nothing here publishes (another worker logged them, on a shared store). Not the
        taps: they get what is published, in order."""
        for queue in self._watchers.get(pid, ()):
            _put(queue, GAP)

    def watch_account(self, owner: str) -> AccountQueue:
        """A queue of the ``for_account`` signals of ``owner``'s processes from now on, as they are
        published here (``Kernel.account_signals`` puts them in account seq order and fills gaps
        from the account log). None ends it: the hub closed, or the watcher fell ``BACKLOG``
        behind and should resume from the account log."""
        queue: AccountQueue = asyncio.Queue(maxsize=BACKLOG)
        self._accounts.setdefault(owner, set()).add(queue)
        return queue

    def unwatch_account(self, owner: str, queue: AccountQueue) -> None:
        watchers = self._accounts.get(owner)
        if watchers is not None:
            watchers.discard(queue)
            if not watchers:
                del self._accounts[owner]
                self._heads.pop(owner, None)

    def account_seen(self, owner: str, seq: int) -> None:
        """A watcher of ``owner``'s account has read its account log up to ``seq``. Recorded even
        at 0 (an account with nothing logged yet): ``account_heads`` names the owners the poll
        checks, and one left out would never have a lost notification found."""
        if owner in self._accounts and seq >= self._heads.get(owner, 0):
            self._heads[owner] = seq

    def account_heads(self) -> dict[str, int]:
        """owner -> the newest account seq that reached its watchers here, for every owner watched."""
        return dict(self._heads)

    def publish(self, pid: str, signal: Signal, owner: str | None = None) -> None:
        """Announce ``signal``; with its process's ``owner``, an unlogged one to the owner's
        account watchers too (a new title: live only, no account seq). Logged account-level
        signals reach them through ``to_account``, with their account seqs."""
        for queue in self._watchers.get(pid, ()):
            _put(queue, signal)
        if owner is not None and self._accounts:  # the hot path's only cost while nobody watches an account
            self._to_account(owner, AccountSignal(pid, signal))
        for listener in self._taps:
            listener(pid, signal)

    def watches_account(self, owner: str) -> bool:
        """Whether anyone here watches ``owner``'s account stream."""
        return bool(self._accounts.get(owner))

    def to_account(self, owner: str, item: AccountSignal) -> None:
        """A logged account signal of ``owner``'s to the account's watchers only: one this
        worker committed (its process watchers had it from ``publish``), or one another worker
        committed (they read it from the log)."""
        if self._accounts:
            self._to_account(owner, item)

    def _to_account(self, owner: str, item: AccountSignal) -> None:
        watchers = self._accounts.get(owner)
        if not watchers or not for_account(item.signal):
            return
        if item.seq is not None and item.seq > self._heads.get(owner, 0):
            self._heads[owner] = item.seq
        for queue in list(watchers):
            if queue.full():  # fallen too far behind: ended, so that it resumes from the account log
                self.unwatch_account(owner, queue)
                _end(queue)
            else:
                queue.put_nowait(item)

    def close_accounts(self) -> None:
        """Shutting down: end every account watcher's stream."""
        accounts, self._accounts = self._accounts, {}
        self._heads.clear()
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
