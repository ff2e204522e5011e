"""What the durable runner keeps in memory for a process (``_Live``: a cache of the committed state
and the tasks working for it), and the transaction of one step (``_Tx``, ``_TxScope``) that keeps
that cache and the watchers in step with the store: changes apply once the body is kept, effects
and signals once it is durable, nothing on a rollback. Every part of the runner writes through it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentloop.loop.state import LoopConfig, RunState
from agentloop.messages import Message, ToolResultMessage, Usage, UserMessage, names_speaker
from agentloop.process import signals as sig
from agentloop.process.api import new_id
from agentloop.process.lease import LeaseLost
from agentloop.process.media import is_stored
from agentloop.process.pressure import DEFAULT_POLICY, Band, CompactionPolicy, ContextReading
from agentloop.process.signals import AccountSignal, Signal
from agentloop.process.store import ProcessRecord, StoreError, UsageTotals
from agentloop.process.store.base import ProcessState, QueueKind

if TYPE_CHECKING:
    from agentloop.process.engine import ProcessEngine


@dataclass
class _Live:
    """What the engine keeps in memory for one process: a cache of its committed history, and the
    tasks working for it. The store is the truth; this is rebuilt from it after a restart."""

    record: ProcessRecord
    history: list[Message]
    driver: asyncio.Task[None] | None = None
    dirty: bool = False
    tools: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # dispatch id -> task
    partial: RunState | None = None  # the model call in flight, if any
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    queued: int = 0  # items in the input queue (this engine is the only writer, so it can count)
    prompt: tuple[str, str] | None = None  # (run id, system prompt): built once per run
    prompt_kept: str | None = None  # the run whose prompt is stored (see ``ProcessEngine.keep_prompt``)
    resumed: bool = False  # loaded with a run under way: its prompt may be stored already
    # (run id, the tools its last model call was shown, None unless hooks narrowed them): what its
    # calls' own nested calls may use. The run's record keeps them too, for after a restart.
    offered: tuple[str, frozenset[str] | None] | None = None
    config: tuple[str, LoopConfig] | None = None  # (run id, the run's loop configuration)
    media: bool = False  # the history holds stored media references (to hydrate before model calls)
    origins: bool = False  # the history holds a group chat's messages (their speakers named to the model)
    approvals: bool = False  # a run of this process may have stored approval decisions
    stopping: int = 0  # aborts in progress: meanwhile a wake-up starts no driver, it only marks dirty
    # tasks that may start the next run from queued input now (an abort's end, a promotion, the end
    # of a reset or compaction): ``wait_idle`` waits for them (see ``promoting``)
    promoting: list[asyncio.Task[Any]] = field(default_factory=list)
    # set (and replaced) each time one of them ends: the tasks themselves may live on (the leases'
    # loop promotes what another worker queued), so ``wait_idle`` waits for this, not for them
    promoted: asyncio.Event = field(default_factory=asyncio.Event)
    calls: bool = True  # the active run may have tool call rows (False only when known to have none)
    lost: bool = False  # dropped after a failed commit (the store lacks a step this cache holds)
    deadline: asyncio.TimerHandle | None = None  # wakes the driver to enforce the batch's nearest deadline
    ask_timer: asyncio.TimerHandle | None = None  # wakes it to deny an approval request left unanswered
    retry_timer: asyncio.TimerHandle | None = None  # wakes it to call a model that was out again
    remote: bool = False  # another worker holds the process: a snapshot to forward input with, never driven
    spending: asyncio.Lock = field(default_factory=asyncio.Lock)  # one nested call counted at a time
    asking: set[asyncio.Event] = field(default_factory=set)  # nested calls awaiting a person: set on wake
    seq: int = 0  # the last logged signal of the process this worker knows of (what relayed deltas follow)
    # the seq from which a finishing run prunes the log (``signals.KEPT_SIGNALS``)
    prune_at: int = field(default_factory=lambda: sig.KEPT_SIGNALS + sig.PRUNE_EVERY)
    pruned: int | None = None  # the log is pruned through this seq (None: not looked at since the load)
    policy: CompactionPolicy = DEFAULT_POLICY  # the active run's (read with its configuration)
    context: ContextReading | None = None  # the last reading of a change of level (None: none, so ok)
    context_known: bool = False  # ``context`` holds the stored level at least (see pressure.run_keys)
    context_tokens: int | None = None  # the newest model step's
    context_band: Band | None = None  # the ratios the known level spans (see pressure.level_band)


@contextmanager
def promoting(live: _Live) -> Iterator[None]:
    """Around work that may start a run from the queued input of an idle process: ``wait_idle``
    does not call the process idle meanwhile (the run's end is committed, its successor not yet)."""
    task = asyncio.current_task()
    if task is None:
        yield
        return
    live.promoting.append(task)
    try:
        yield
    finally:
        live.promoting.remove(task)
        ended, live.promoted = live.promoted, asyncio.Event()
        ended.set()


class _Tx:
    """Collects what one transaction changes in memory (applied as soon as its body is kept) and
    what it shows the world (signals, tool starts: once it is durable)."""

    def __init__(self, engine: ProcessEngine, live: _Live) -> None:
        self.engine = engine
        self.live = live
        self.signals: list[Signal] = []
        self.accounted: list[AccountSignal] = []  # the account-level ones, with their account seqs
        self.after: list[Callable[[], None]] = []  # cache updates
        self.durable: list[Callable[[], None]] = []  # effects, once committed
        self._pending: list[tuple[str, dict[str, Any]]] = []

    async def signal(self, signal_name: str, /, **payload: Any) -> None:
        """Log a signal; the log rows are written together when the transaction body ends."""
        self._pending.append((signal_name, {"pid": self.live.record.pid, **payload}))

    async def flush(self) -> None:
        if self._pending:
            seqs = await self.engine.store.append_events(self.live.record.pid, self._pending)
            logged = [Signal(n, p, q) for (n, p), q in zip(self._pending, seqs, strict=True)]
            self.signals += logged
            self._pending = []
            picked = [s for s in logged if sig.for_account(s)]
            if picked:  # (most steps log none: a run's end, an approval asked or answered)
                await self._account(picked)

    async def _account(self, picked: list[Signal]) -> None:
        """The account-level signals just logged (``for_account``), copied to the owner's account
        log in this transaction, numbered there (published with those numbers once durable:
        ``settled``); on a shared store also told to the other workers, who publish them to their
        own account watchers. The owner's log is pruned as it passes each ACCOUNT_PRUNE_EVERY."""
        store, pid, owner = self.engine.store, self.live.record.pid, self.live.record.owner
        rows = [(s.seq or 0, s.signal, s.payload) for s in picked]
        numbers = await store.append_account_events(owner, pid, rows)
        self.accounted += [AccountSignal(pid, s, n) for s, n in zip(picked, numbers, strict=True)]
        newest, every = numbers[-1], sig.ACCOUNT_PRUNE_EVERY
        if newest // every > (numbers[0] - 1) // every and newest > sig.KEPT_ACCOUNT_SIGNALS:
            await store.prune_account_events(owner, through=newest - sig.KEPT_ACCOUNT_SIGNALS)
        if self.engine.leases is not None:  # (a shared store: the other workers' account streams)
            told = [(n, seq, name, payload) for n, (seq, name, payload) in zip(numbers, rows, strict=True)]
            await store.notify_account(owner, pid, told)

    async def append(self, run_id: str | None, messages: list[Message]) -> None:
        await self.engine.store.append_messages(self.live.record.pid, run_id, messages)
        self.after.append(lambda: self.live.history.extend(messages))
        if not self.live.media and any(_has_media(m) for m in messages):
            self.after.append(lambda: setattr(self.live, "media", True))
        if not self.live.origins and any(map(names_speaker, messages)):  # (map: no generator per append)
            self.after.append(lambda: setattr(self.live, "origins", True))

    async def set_run(self, run: dict[str, Any] | None, added: UsageTotals | None = None) -> None:
        """Write the active run's record (None: no run); ``added``, what the process's usage
        totals grow by, in the same UPDATE of its registry row (an increment: see
        ``Store.update_process``)."""
        current = self.live.record.current_run
        if run is not None and current is not None and current.get("stopping") and current["run_id"] == run["run_id"]:
            run = {**run, "stopping": True}  # asked while a step was under way: its record keeps the request
        state: ProcessState = "running" if run is not None else "idle"
        if added is None:
            await self.engine.store.update_process(self.live.record.pid, current_run=run, state=state)
        else:
            await self.engine.store.update_process(
                self.live.record.pid, current_run=run, state=state, usage_added=added
            )

        def apply() -> None:
            live = self.live
            live.record.current_run = run
            live.record.state = state
            if added is not None:
                live.record.usage = live.record.usage + added
            if run is None:  # the run's own configuration and prompt end with it (idle processes keep none)
                live.config = live.prompt = None
                self.engine._compiled.pop(live.record.pid, None)  # (a run that ended before it answered)
                if live.retry_timer is not None:  # (an aborted run that waited out an outage)
                    live.retry_timer.cancel()
                    live.retry_timer = None

        self.after.append(apply)

    async def end_run(self, run: dict[str, Any]) -> None:
        """End ``run`` (its record as it stands at its end): no active run, and the process's
        usage totals grown by the run's, whatever its status (an aborted or failed run's model
        calls were billed too), in the one registry UPDATE the end writes anyway. The UPDATE adds
        to the stored totals rather than writing this engine's: a model call counted outside the
        engine's transactions meanwhile (a title, a reset's memories: ``ProcessEngine.add_usage``)
        is not overwritten. The cached totals follow by the same amount."""
        await self.set_run(None, UsageTotals.of_run(run["usage"]))

    async def count_usage(self, usage: Usage) -> None:
        """Add a model call made outside any run (a compaction asked for while the process is
        idle) to the process's totals: it was billed, but it is no run."""
        added = UsageTotals.of_call(usage)
        await self.engine.store.update_process(self.live.record.pid, usage_added=added)
        self.after.append(lambda: setattr(self.live.record, "usage", self.live.record.usage + added))

    async def start_run(
        self, message: Message, reason: str, run_id: str | None = None, *, queued: int | None = None
    ) -> str:
        """Start a run with ``message`` as its first input; returns the run's id. ``queued``: the
        input left waiting once this transaction is kept (the cache's count, unless it takes an
        item out of the queue)."""
        run = _new_run(run_id)
        await self.append(run["run_id"], [message])
        await self.set_run(run)
        await self.signal(
            sig.RUN_STARTED,
            runId=run["run_id"],
            reason=reason,
            queuedCount=self.live.queued if queued is None else queued,
            timestamp=int(run["started"] * 1000),
        )
        return str(run["run_id"])

    async def enqueue(
        self, kind: QueueKind, message: Message, run_id: str | None = None, reason: str | None = None
    ) -> None:
        """Queue input for the active run (steer, system events) or for after it; ``reason`` as
        in ``Store.enqueue``."""
        live = self.live
        await self.engine.store.enqueue(live.record.pid, kind, message, run_id=run_id, reason=reason)
        self.after.append(lambda: setattr(live, "queued", live.queued + 1))
        await self.signal(sig.CHANGED, changes=["queue"])

    def settled(self, error: BaseException | None) -> None:
        """The transaction is durable (``error`` is None) or, in a failed group commit, lost."""
        live = self.live
        if error is not None:
            self.drop()
            self.engine._lost(live)
            return
        for effect in self.durable:
            effect()
        if self.signals:
            publish, pid = self.engine.hub.publish, live.record.pid
            for s in self.signals:
                publish(pid, s)
            live.seq = max(live.seq, self.signals[-1].seq or 0)
            if self.accounted:
                to_account, owner = self.engine.hub.to_account, live.record.owner
                for item in self.accounted:
                    to_account(owner, item)
        # done with: the closures these lists hold refer back to this object, a cycle only the
        # garbage collector would free (a dozen objects per step, and more frequent collections)
        self.durable, self.signals, self.accounted = [], [], []
        if live.record.current_run is None:
            live.idle.set()
            self.engine._rested(live)  # (recently used; and the cache may evict what rests now)

    def drop(self) -> None:
        """The body was not kept (or its commit was lost): forget what it collected (see ``settled``)."""
        self.after, self.durable, self.signals, self._pending, self.accounted = [], [], [], [], []


class _TxScope:
    """The context manager of ``ProcessEngine._tx`` (a class: cheaper than a generator)."""

    __slots__ = ("scope", "tx")

    def __init__(self, engine: ProcessEngine, live: _Live) -> None:
        self.scope = engine.store.transaction()
        self.tx = _Tx(engine, live)

    async def __aenter__(self) -> _Tx:
        await self.scope.begin()
        if self.tx.live.lost:  # dropped after a failed commit: only the reloaded process may write
            self.scope.end(commit=False)
            pid = self.tx.live.record.pid
            if self.tx.engine.leases is not None:  # let go of, or taken over: the caller may start over
                raise LeaseLost(pid)
            raise StoreError(f"process {pid} was reloaded after a failed commit")
        return self.tx

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool | None:
        tx = self.tx
        if kind is None:
            leases = tx.engine.leases
            try:
                if leases is not None:  # a shared store: commit only under this worker's lease
                    pid = tx.live.record.pid
                    await (leases.told(pid) if tx.live.remote else leases.fence(pid))
                await tx.flush()
            except BaseException as error:
                self.scope.end(commit=False)
                tx.drop()
                if isinstance(error, LeaseLost) and leases is not None:
                    leases.lost(error.pid)
                    tx.engine.uncache(error.pid)
                raise
        else:
            self.scope.end(commit=False)
            tx.drop()
            return None
        pending = self.scope.end(commit=True, settled=tx.settled)
        live = tx.live
        for apply in tx.after:  # kept: the cache follows the store at once (the next step reads it)
            apply()
        tx.after = []  # (done with: see ``_Tx.settled``)
        if live.record.current_run is not None:
            live.idle.clear()  # busy at once; idle again only once the step that ends the run is durable
        if pending is None:
            tx.settled(None)
        else:  # in a group commit: ``settled`` runs when the group is durable
            await pending
        return None


def _new_run(run_id: str | None = None) -> dict[str, Any]:
    return {
        "run_id": run_id or new_id(),
        "generation": 0,
        "turn": 0,
        "rounds": 0,
        "tool_calls": 0,
        "started": time.time(),
        "usage": {"input": 0, "output": 0, "total_tokens": 0, "cost": 0.0},
        "guard": None,
    }


def _has_media(message: Message) -> bool:
    """Whether a message carries stored-media references (images and documents kept as files)."""
    if not isinstance(message, UserMessage | ToolResultMessage) or len(message.content) < 2:
        return False
    return any(is_stored(b) for b in message.content)
