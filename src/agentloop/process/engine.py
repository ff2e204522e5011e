"""The durable runner: the loop of ``agentloop.loop``, with every step committed to a store.

Each process with an active run has one driver task that repeats a *step*: look at the stored
state, take ``decide``'s decision (the same function the in-memory runner uses), do it, and commit
its outcome in one transaction. A crash anywhere loses at most the step in progress; on restart
the driver decides again from what was committed.

- The assistant message and its tool calls are committed together; calls then move
  ``registered → dispatched → completed | failed | cancelled | denied`` through claims
  (conditional updates), so a late or duplicate result changes nothing. The run goes on only when
  every call of the batch is terminal; results enter the history in the model's order.
- Each step's commit is fenced by the run id and a generation number: an abort or an interrupt
  that happened while a model call was in flight makes that call's answer land nowhere.
- Input that arrives during a run waits in the queue: ``steer`` items (and system events, first)
  are injected before the next model call; what is left when the run ends starts the next run.
- On a store several workers share (PostgreSQL), a worker advances only the processes whose
  lease it holds, and every step's commit checks that lease (``lease.py``); it reaches the
  others' processes through rows they act on. Its cache of a process it does not hold is a
  ``remote`` one: the registry row and queue length, read afresh, never driven.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeAlias

from agentloop.events import LoopEvent, MessageUpdate, ModelRetry
from agentloop.loop.execute import SKIPPED, _ask_hooks, _check, _execute, _Prepared
from agentloop.loop.hooks import TurnInfo
from agentloop.loop.model_call import call_model
from agentloop.loop.runner import CANCELLED
from agentloop.loop.state import CallModel, Finish, LoopConfig, RunState, RunTools, decide
from agentloop.messages import (
    AssistantMessage,
    ImageContent,
    Message,
    SystemMessage,
    ToolCall,
    ToolResultMessage,
    Usage,
    UserMessage,
    message_from_dict,
    message_to_dict,
    system,
    tool_error_result,
)
from agentloop.models.overflow import is_context_overflow
from agentloop.process import signals as sig
from agentloop.process.approval.engine import remember_rule
from agentloop.process.approval.tags import call_target
from agentloop.process.compaction import CompactionError, compact, estimate_tokens, pressure, should_compact
from agentloop.process.lease import DEFAULT_POLL, DEFAULT_TTL, LeaseLost, Leases
from agentloop.process.lease import retried as _retried
from agentloop.process.media import MEDIA_PREFIX
from agentloop.process.signals import Signal, SignalHub
from agentloop.process.store import (
    CallStatus,
    HilRow,
    NoSuchProcess,
    ProcessRecord,
    SegmentRow,
    Store,
    StoreError,
    ToolCallRow,
)
from agentloop.process.store.base import ProcessState, QueueKind
from agentloop.tools.base import NestedCheck, NestedVerdict, Tool
from agentloop.tools.builtin import SYSCALLS, syscall_of

log = logging.getLogger("agentloop.process")

SendMode: TypeAlias = Literal["steer", "queue", "interrupt"]
INTERRUPTED_BY_RESTART = "Tool call interrupted by a restart of the runtime; it may or may not have taken effect."
RUN_FAILED = "Tool call not completed: the run ended with an internal error."
GUARD_NAMES = frozenset({"max_rounds", "max_tool_calls", "max_wall_clock", "max_tokens", "max_cost"})


@dataclass(frozen=True)
class Approval:
    """What the approval policy says about one call."""

    action: Literal["auto", "ask", "deny"]
    tags: tuple[str, ...] = ()
    reason: str = ""
    fingerprint: str = ""


ApprovalFn: TypeAlias = Callable[[ProcessRecord, ToolCallRow], Awaitable[Approval]]
PromptFn: TypeAlias = Callable[[ProcessRecord], Awaitable[str]]
# The tools one process's run sees, given the process and the shared tools (e.g. the shared ones
# with a ``target`` argument routing to the owner's devices, plus the devices' own tools).
# a run's tools from the shared ones; may be async (e.g. to start the owner's MCP servers)
ToolsetFn: TypeAlias = Callable[[ProcessRecord, Mapping[str, Tool]], Mapping[str, Tool] | Awaitable[Mapping[str, Tool]]]
ArchiveFn: TypeAlias = Callable[[ProcessRecord, str, list[Message], dict[str, Any]], Awaitable[str | None]]


async def approve_everything(process: ProcessRecord, row: ToolCallRow) -> Approval:
    return Approval("auto")


_last_us = 0


def new_id() -> str:
    """A fresh id: 13 hex digits of the time in microseconds (strictly increasing in this runtime),
    then 6 random ones. Ids sort by creation, so the rows keyed by them (processes, runs, calls)
    are appended at the end of their index instead of anywhere in it: fewer pages per commit."""
    global _last_us
    _last_us = max(time.time_ns() // 1000, _last_us + 1)
    return f"{_last_us:013x}{os.urandom(3).hex()}"


@dataclass(frozen=True)
class Receipt:
    """The answer to ``send``: which run the input belongs to, and whether it waits in the queue."""

    run_id: str
    queued: bool
    position: int = 0


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
    config: tuple[str, LoopConfig] | None = None  # (run id, the run's loop configuration)
    media: bool = False  # the history holds stored media references (to hydrate before model calls)
    approvals: bool = False  # a run of this process may have stored approval decisions
    stopping: int = 0  # aborts in progress: meanwhile a wake-up starts no driver, it only marks dirty
    calls: bool = True  # the active run may have tool call rows (False only when known to have none)
    lost: bool = False  # dropped after a failed commit (the store lacks a step this cache holds)
    deadline: asyncio.TimerHandle | None = None  # wakes the driver to enforce the batch's nearest deadline
    remote: bool = False  # another worker holds the process: a snapshot to forward input with, never driven


class _Tx:
    """Collects what one transaction changes in memory (applied as soon as its body is kept) and
    what it shows the world (signals, tool starts: once it is durable)."""

    def __init__(self, engine: ProcessEngine, live: _Live) -> None:
        self.engine = engine
        self.live = live
        self.signals: list[Signal] = []
        self.after: list[Callable[[], None]] = []  # cache updates
        self.durable: list[Callable[[], None]] = []  # effects, once committed
        self._pending: list[tuple[str, dict[str, Any]]] = []

    async def signal(self, signal_name: str, /, **payload: Any) -> None:
        """Log a signal; the log rows are written together when the transaction body ends."""
        self._pending.append((signal_name, {"pid": self.live.record.pid, **payload}))

    async def flush(self) -> None:
        if self._pending:
            seqs = await self.engine.store.append_events(self.live.record.pid, self._pending)
            self.signals.extend(Signal(n, p, q) for (n, p), q in zip(self._pending, seqs, strict=True))
            self._pending = []

    async def append(self, run_id: str | None, messages: list[Message]) -> None:
        await self.engine.store.append_messages(self.live.record.pid, run_id, messages)
        self.after.append(lambda: self.live.history.extend(messages))
        if not self.live.media and any(_has_media(m) for m in messages):
            self.after.append(lambda: setattr(self.live, "media", True))

    async def set_run(self, run: dict[str, Any] | None) -> None:
        state: ProcessState = "running" if run is not None else "idle"
        await self.engine.store.update_process(self.live.record.pid, current_run=run, state=state)

        def apply() -> None:
            live = self.live
            live.record.current_run = run
            live.record.state = state
            if run is None:  # the run's own configuration and prompt end with it (idle processes keep none)
                live.config = live.prompt = None

        self.after.append(apply)

    async def start_run(self, message: Message, reason: str, run_id: str | None = None) -> str:
        """Start a run with ``message`` as its first input; returns the run's id."""
        run = _new_run(run_id)
        await self.append(run["run_id"], [message])
        await self.set_run(run)
        await self.signal(sig.RUN_STARTED, runId=run["run_id"], reason=reason)
        return str(run["run_id"])

    async def enqueue(self, kind: QueueKind, message: Message, run_id: str | None = None) -> None:
        """Queue input for the active run (steer, system events) or for after it."""
        live = self.live
        await self.engine.store.enqueue(live.record.pid, kind, message, run_id=run_id)
        self.after.append(lambda: setattr(live, "queued", live.queued + 1))
        await self.signal(sig.CHANGED, changes=["queue"])

    def settled(self, error: BaseException | None) -> None:
        """The transaction is durable (``error`` is None) or, in a failed group commit, lost."""
        live = self.live
        if error is not None:
            self.engine._lost(live)
            return
        for effect in self.durable:
            effect()
        if self.signals:
            publish, pid = self.engine.hub.publish, live.record.pid
            for s in self.signals:
                publish(pid, s)
        if live.record.current_run is None:
            live.idle.set()


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
                if isinstance(error, LeaseLost) and leases is not None:
                    leases.lost(error.pid)
                    tx.engine.uncache(error.pid)
                raise
        else:
            self.scope.end(commit=False)
            return None
        pending = self.scope.end(commit=True, settled=tx.settled)
        live = tx.live
        for apply in tx.after:  # kept: the cache follows the store at once (the next step reads it)
            apply()
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


class ProcessEngine:
    """Runs the durable processes of one store with one loop configuration."""

    def __init__(
        self,
        store: Store,
        config: LoopConfig,
        *,
        hub: SignalHub | None = None,
        approval: ApprovalFn = approve_everything,
        hydrate: Callable[[list[Message]], list[Message]] | None = None,
        prompt: PromptFn | None = None,
        archive: ArchiveFn | None = None,
        compaction_threshold: float = 0.9,
        toolset: ToolsetFn | None = None,
        worker: str | None = None,
        lease_ttl: float = DEFAULT_TTL,
        poll_interval: float = DEFAULT_POLL,
    ) -> None:
        self.store = store
        self.config = config
        self.hub = hub or SignalHub()
        self.approval = approval
        self.hydrate = hydrate  # stored media references -> image blocks, before a model call
        self.prompt = prompt  # the run's system prompt, built once per run
        self.archive = archive  # writes compacted-away messages somewhere safe, returns where
        self.compaction_threshold = compaction_threshold
        self.toolset = toolset  # the tools of one process's run (e.g. the owner's devices added)
        self._live: dict[str, _Live] = {}
        self._reloading: set[asyncio.Task[None]] = set()
        # several workers may share the store: ``worker`` names this one in its leases
        self.leases = Leases(self, owner=worker, ttl=lease_ttl, poll=poll_interval) if store.shared else None

    # -- state ------------------------------------------------------------------------------------

    async def live(self, pid: str) -> _Live:
        live = self._live.get(pid)
        if live is not None:
            return live
        record = await self.store.get_process(pid)
        if record is None or record.state == "killed":
            raise NoSuchProcess(pid)
        if self.leases is not None and pid not in self.leases.held:  # not this worker's to drive
            remote = _Live(record, [], remote=True, queued=len(await self.store.queue(pid)))
            if record.current_run is None:
                remote.idle.set()
            return remote
        history = [m.message for m in await self.store.history(pid)]
        queued = len(await self.store.queue(pid))
        raced = self._live.get(pid)
        if raced is not None:  # loaded by another task meanwhile: one cache (and driver) per process
            return raced
        if self.leases is not None and pid not in self.leases.held:  # let go of meanwhile
            return await self.live(pid)
        live = self._live[pid] = _Live(record, history, queued=queued)
        live.media = any(_has_media(m) for m in history)
        live.approvals = record.current_run is not None  # decisions made before a restart may be stored
        if record.current_run is None:
            live.idle.set()
        return live

    async def create(self, record: ProcessRecord) -> None:
        """Store a new process and start its cache: a fresh process has nothing to load."""
        async with self.store.transaction():
            await self.store.create_process(record)
        if self.leases is not None:
            return  # cached by whichever worker claims it first
        live = self._live[record.pid] = _Live(record, [], calls=False)
        live.idle.set()

    def _tx(self, live: _Live) -> _TxScope:
        """One step's transaction: ``async with self._tx(live) as tx``. Once it commits, the cache
        and the watchers learn what changed; a rollback leaves both untouched."""
        return _TxScope(self, live)

    # -- recovery ---------------------------------------------------------------------------------

    async def recover(self) -> list[str]:
        """After a (re)start: settle the calls that were in flight and resume every unfinished run
        (on a shared store: those no live worker holds, and from now on the orphans of dead ones)."""
        if self.leases is not None:
            return await self.leases.start()
        return [record.pid for record in await self.store.list_processes() if await self._resume(record)]

    async def _resume(self, record: ProcessRecord) -> bool:
        """Bring one process back to work from what the store holds. Returns whether it resumed."""
        if record.state == "killed":
            return False
        if record.current_run is None:
            if await self.store.queue(record.pid):  # a crash between a run's end and its queue's promotion
                await self._promote(await self.live(record.pid))
                return True
            return False
        live = await self.live(record.pid)
        run_id = record.current_run["run_id"]
        tools = (await self._run_config(live, run_id)).tools  # the process's own (a device's tools too)
        async with self._tx(live) as tx:
            for row in await self.store.calls(record.pid, run_id):
                if row.status != "dispatched":
                    continue
                tool = tools.get(row.tool_name)
                if tool is not None and tool.idempotent:
                    await self.store.set_call_status(row.dispatch_id, "registered", expect=("dispatched",))
                else:
                    msg = tool_error_result(_call_of(row), INTERRUPTED_BY_RESTART)
                    await self.store.set_call_status(
                        row.dispatch_id, "failed", expect=("dispatched",), result=message_to_dict(msg)
                    )
                    await tx.signal(
                        sig.TOOL_FINISHED,
                        runId=run_id,
                        callId=row.tool_call_id,
                        ok=False,
                        name=row.tool_name,
                        error=INTERRUPTED_BY_RESTART,
                    )
        self.wake(record.pid)
        return True

    # -- leases (see lease.py) --------------------------------------------------------------------

    def cached(self, pid: str) -> _Live | None:
        return self._live.get(pid)

    def uncache(self, pid: str) -> None:
        """Forget what this worker knows of a process (it lost or let go of the lease, or just
        claimed it): its tasks stop, waiters look again, the next use reloads it."""
        live = self._live.get(pid)
        if live is not None:
            self._drop(live)
            live.lost = True
            live.idle.set()

    async def resume(self, record: ProcessRecord) -> bool:
        return await self._resume(record)

    async def promote(self, live: _Live) -> None:
        await self._promote(live)

    def _lost(self, live: _Live) -> None:
        """A group commit failed, so the store lacks a step this cache already holds. Treat it as
        a crash of this one process: drop the cache, stop its tasks, resume from the store."""
        pid = live.record.pid
        if self._live.get(pid) is not live:
            return  # dropped already (another step of the same group)
        self._drop(live)
        live.lost = True
        live.idle.set()  # waiters look again, and find the reloaded process
        task = asyncio.get_running_loop().create_task(self._reload(pid))
        self._reloading.add(task)
        task.add_done_callback(self._reloading.discard)

    async def _reload(self, pid: str) -> None:
        if self.leases is not None and pid not in self.leases.held:
            return  # another worker has it now
        try:
            record = await self.store.get_process(pid)
            if record is not None:
                await self._resume(record)
        except Exception:
            log.exception("process %s: could not resume after a failed commit", pid)

    # -- input ------------------------------------------------------------------------------------

    async def send(self, pid: str, message: Message, *, mode: SendMode = "steer", run_id: str | None = None) -> Receipt:
        """Deliver user input: start a run, or queue it for the active one (see the module doc)."""
        return await _retried(lambda: self._send(pid, message, mode=mode, run_id=run_id))

    async def _send(self, pid: str, message: Message, *, mode: SendMode, run_id: str | None) -> Receipt:
        if mode not in ("steer", "queue", "interrupt"):
            raise ValueError(f"mode must be steer, queue or interrupt, got {mode!r}")
        if self.leases is not None and not await self.leases.hold(pid) and mode == "interrupt":
            await self.leases.forward_abort(pid, None, "user.interrupt")  # the holder stops the run
            mode = "steer" if await self.leases.hold(pid) else "queue"  # … and runs this next
        live = await self.live(pid)
        if run_id is not None:  # a caller-supplied run id makes the delivery idempotent
            seen = await self.store.kv_get(pid, f"admitted:{run_id}")
            if seen is not None:
                return Receipt(seen.get("run", run_id), bool(seen.get("queued")), int(seen.get("position", 0)))
        if live.record.current_run is not None and mode == "interrupt":
            await self.abort(pid, reason="user.interrupt")
        async with self._tx(live) as tx:
            # decided inside the transaction: the run seen here cannot end before this commits
            active = live.record.current_run
            if active is None and not live.remote:
                receipt = Receipt(await tx.start_run(message, "proc.send", run_id), False, 0)
            elif active is None:  # the worker holding the process starts the run, with this id
                receipt = Receipt(run_id or new_id(), False, 0)
                await tx.enqueue("queue", message, receipt.run_id)
            else:
                queued_run = run_id or new_id()
                receipt_run = active["run_id"] if mode == "steer" else queued_run  # steer joins the active run
                receipt = Receipt(receipt_run, True, live.queued + 1)
                await tx.enqueue("steer" if mode == "steer" else "queue", message, queued_run)
            await self._remember_admission(
                pid, receipt.run_id, run_id, queued=receipt.queued, position=receipt.position
            )
        if not receipt.queued:
            self.wake(pid)
        return receipt

    async def forget_admission(self, pid: str, run_id: str) -> None:
        """Drop the record that makes a delivery with this caller-supplied ``run_id`` idempotent,
        inside the caller's transaction, once the caller can no longer retry it (a schedule moved
        past that due time, a watch past that signal): a repeating source would otherwise leave
        one record per delivery behind for ever."""
        await self.store.kv_delete(pid, f"admitted:{run_id}")

    async def _remember_admission(
        self, pid: str, run_id: str, supplied: str | None, *, queued: bool, position: int
    ) -> None:
        if supplied is not None:
            await self.store.kv_set(
                pid, f"admitted:{supplied}", {"run": run_id, "queued": queued, "position": position}
            )

    async def signal_event(
        self, pid: str, text: str, *, run_id: str | None = None, reason: str = "system.event"
    ) -> Receipt:
        """A system event (a watch, a schedule, finished background work): shown to the model as a
        system message, ahead of queued user input; starts a run when none is active, recorded in
        ``proc.run.started`` with ``reason``. A caller-supplied ``run_id`` makes the delivery
        idempotent, as with ``send``: a retry returns the first receipt and delivers nothing."""
        return await _retried(lambda: self._signal_event(pid, text, run_id=run_id, reason=reason))

    async def _signal_event(self, pid: str, text: str, *, run_id: str | None, reason: str) -> Receipt:
        if self.leases is not None:
            await self.leases.hold(pid)  # or, held elsewhere, the event waits in the queue for its holder
        live = await self.live(pid)
        message = system(text, "event")
        async with self._tx(live) as tx:
            # checked inside the transaction: two deliveries of one id cannot both pass
            seen = await self.store.kv_get(pid, f"admitted:{run_id}") if run_id is not None else None
            if seen is not None:
                return Receipt(seen.get("run", run_id), bool(seen.get("queued")), int(seen.get("position", 0)))
            active = live.record.current_run
            if active is None and not live.remote:
                receipt = Receipt(await tx.start_run(message, reason, run_id), False)
            elif active is None:
                receipt = Receipt(run_id or new_id(), False)
                await tx.enqueue("system", message, receipt.run_id)
            else:
                await tx.enqueue("system", message, run_id)
                receipt = Receipt(active["run_id"], True, 0)
            await self._remember_admission(pid, receipt.run_id, run_id, queued=receipt.queued, position=0)
        if not receipt.queued:
            self.wake(pid)
        return receipt

    # -- driving ----------------------------------------------------------------------------------

    def wake(self, pid: str) -> None:
        """Ask for another step; overlapping wake-ups coalesce into one driver."""
        live = self._live.get(pid)
        if live is None:
            return
        live.dirty = True
        if live.stopping:
            return  # the abort that is stopping the run wakes the driver when it is done
        if live.driver is None or live.driver.done():
            live.driver = asyncio.create_task(self._drive(live), name=f"agentloop-process-{pid}")

    async def _drive(self, live: _Live) -> None:
        while live.dirty:
            live.dirty = False
            try:
                while live.record.current_run is not None and await self._step(live):
                    pass
            except asyncio.CancelledError:
                raise
            except LeaseLost:  # another worker carries on from what was committed
                log.warning("process %s: lease taken over; this worker's step was not committed", live.record.pid)
                return
            except Exception:  # a bug must not leave the run hanging: end it visibly
                log.exception("process %s: step failed", live.record.pid)
                if live.lost:
                    return  # the cache was dropped (a failed commit): the reloaded process carries on
                # inside the loop: the promotion's wake-up only marks this driver dirty
                await self._fail(live)
        if live.driver is asyncio.current_task():  # an idle process keeps no finished task around
            live.driver = None
        if self.leases is not None and live.record.current_run is None:
            self.leases.idle(live.record.pid)

    async def _fail(self, live: _Live) -> None:
        """End the active run after an internal error: stop its tools, give every open call an
        error result (so the history stays valid), then let queued input run."""
        run = live.record.current_run
        if run is None:
            return
        pid, run_id = live.record.pid, run["run_id"]
        me = asyncio.current_task()
        tools = [t for t in live.tools.values() if not t.done() and t is not me]
        for task in tools:
            task.cancel()
        if tools:
            await asyncio.wait(tools)
        run = live.record.current_run
        if run is None or run["run_id"] != run_id:
            return  # ended meanwhile (an abort)
        rows = await self.store.calls(pid, run_id)
        async with self._tx(live) as tx:
            await tx.append(run_id, _results_of(rows, RUN_FAILED))
            for h in await self.store.hils(pid):
                await self.store.delete_hil(h.request_id)
            await self._end_batch(tx, live, run_id)
            await self._finish(tx, live, run, "error", error="internal error in the runtime (see the server log)")
        await self._promote(live)

    async def _step(self, live: _Live) -> bool:
        """One decision and its committed outcome. False: nothing to do until something arrives."""
        run = live.record.current_run
        assert run is not None
        pid, run_id = live.record.pid, run["run_id"]
        rows = await self.store.calls(pid, run_id) if live.calls else []
        if rows:
            waiting = any(r.status == "registered" for r in rows)
            if waiting and await self._joining(live) and await self._skip_waiting(live, rows):
                rows = await self.store.calls(pid, run_id)
            if any(r.status == "registered" for r in rows) and not await self.store.hils(pid):
                async with self._tx(live) as tx:
                    await self._dispatch(tx, live, run, rows)
                rows = await self.store.calls(pid, run_id)
            if rows and await self._expire(live, rows):
                rows = await self.store.calls(pid, run_id)
            if not rows or any(not r.terminal for r in rows):
                return False
            async with self._tx(live) as tx:
                await self._ingest(tx, live, run, rows)
            await self._post_turn(live, run_id, run["turn"])
            return True

        decision = decide(live.history, has_input=await self._joining(live), guard=run.get("guard"))
        if isinstance(decision, Finish):
            async with self._tx(live) as tx:
                await self._finish(tx, live, run, decision.reason)
            await self._promote(live)
            return False
        if isinstance(decision, RunTools):  # calls without rows: history from elsewhere; register them
            tools = (await self._run_config(live, run_id)).tools
            async with self._tx(live):
                live.calls = True
                await self.store.register_calls(self._rows(pid, run_id, decision.calls, tools))
            return True
        assert isinstance(decision, CallModel)
        return await self._model_turn(live, run, decision.tools_enabled)

    async def _joining(self, live: _Live) -> bool:
        """Whether input waits that joins the active run (steer items, system events): a run that
        would end takes it in another model call instead, so the receipt's run is the one that
        answers. (A run that ends anyway - aborted, failed, stopped by a guard - leaves it to start
        the next run.)"""
        return bool(live.queued) and any(q.kind != "queue" for q in await self.store.queue(live.record.pid))

    async def _skip_waiting(self, live: _Live, rows: list[ToolCallRow]) -> bool:
        """The user (or a system event) spoke while calls of the batch still wait their turn: like
        the in-memory runner, do not start what is now stale. A call whose approval is pending
        stays: the person answers the question they were shown."""
        asked = {h.dispatch_id for h in await self.store.hils(live.record.pid)}
        waiting = [r for r in rows if r.status == "registered" and r.dispatch_id not in asked]
        if not waiting:
            return False
        async with self._tx(live) as tx:
            for row in waiting:
                await self._settle(tx, row, tool_error_result(_call_of(row), SKIPPED), "cancelled", ("registered",))
        return True

    async def _ingest(self, tx: _Tx, live: _Live, run: dict[str, Any], rows: list[ToolCallRow]) -> None:
        """Every call of the batch is terminal: its results enter the history, in the model's order."""
        results = [message_from_dict(r.result) for r in rows if r.result is not None]
        await tx.append(run["run_id"], results)
        await self._end_batch(tx, live, run["run_id"])
        await tx.set_run({**run, "generation": run["generation"] + 1, "turn": run["turn"] + 1})
        await tx.signal(sig.CHANGED, changes=["messages"])

    async def _model_turn(self, live: _Live, run: dict[str, Any], tools_enabled: bool) -> bool:
        pid, run_id = live.record.pid, run["run_id"]
        cfg = await self._run_config(live, run_id)  # the run's own prompt and tools
        queue = await self.store.queue(pid) if live.queued else []
        inject = [q for q in queue if q.kind == "system"] + [q for q in queue if q.kind == "steer"]
        guard = run.get("guard")
        tools_enabled = tools_enabled and bool(cfg.tools)
        tripped = None
        if tools_enabled and cfg.guards.active:
            usage = Usage(total_tokens=run["usage"]["total_tokens"])
            usage.cost.total = run["usage"]["cost"]
            tripped = cfg.guards.tripped(run["rounds"], run["tool_calls"], time.time() - run["started"], usage)
        if inject or tripped:
            added = [q.message for q in inject]
            if tripped:
                guard, tools_enabled = tripped, False
                added.append(system(cfg.guards.final_instruction(tripped), "guard"))
            run = {**run, "guard": guard, "generation": run["generation"] + 1}
            async with self._tx(live) as tx:
                for q in inject:
                    await self.store.dequeue(pid, q.id)
                tx.after.append(lambda: setattr(live, "queued", live.queued - len(inject)))
                await tx.append(run_id, added)
                await tx.set_run(run)
                await tx.signal(sig.CHANGED, changes=["messages", "queue"] if inject else ["messages"])
        generation = run["generation"]

        await self._compact_if_needed(live, run, cfg, tools_enabled)
        messages = self.hydrate(live.history) if self.hydrate is not None and live.media else live.history
        state = RunState(run_id=run_id, messages=messages, first_new=len(messages), turn=run["turn"])
        live.partial = state

        def stream(event: LoopEvent) -> None:
            if isinstance(event, MessageUpdate) and self.hub.watching(pid):
                self.hub.publish(
                    pid,
                    Signal(
                        sig.RUN_STREAM,
                        {
                            "pid": pid,
                            "runId": run_id,
                            "event": event.event.type,
                            "delta": getattr(event.event, "delta", None),
                        },
                    ),
                )
            elif isinstance(event, ModelRetry) and self.hub.watching(pid):  # live progress, like deltas
                retry = {"model": event.model, "error": event.error, "attempt": event.attempt, "delay": event.delay}
                self.hub.publish(
                    pid, Signal(sig.RUN_STREAM, {"pid": pid, "runId": run_id, "event": event.type, **retry})
                )

        try:
            reply = await call_model(cfg, state, tools_enabled, stream if self.hub.watching(pid) else None)
            overflow = is_context_overflow(reply, cfg.model.info.context_window)  # an error, or silent truncation
            if overflow and await self._compact(live, run, cfg, "overflow"):  # one compact-and-retry
                messages = self.hydrate(live.history) if self.hydrate is not None and live.media else live.history
                state = RunState(run_id=run_id, messages=messages, first_new=len(messages), turn=run["turn"])
                live.partial = state
                reply = await call_model(cfg, state, tools_enabled, None)
        finally:
            live.partial = None
        if not tools_enabled and reply.tool_calls:
            reply.content = [b for b in reply.content if not isinstance(b, ToolCall)]
            reply.stop_reason = "stop"
        usage = run["usage"]
        limit = cfg.guards.max_tool_calls
        budget = None if limit is None else max(0, limit - run["tool_calls"])  # calls past it are not run
        ran = len(reply.tool_calls) if budget is None else min(len(reply.tool_calls), budget)
        new_run = {
            **run,
            "generation": generation + 1,
            "rounds": run["rounds"] + (1 if tools_enabled else 0),
            "tool_calls": run["tool_calls"] + ran,
            "usage": {
                "input": usage["input"] + reply.usage.input,
                "output": usage["output"] + reply.usage.output,
                "total_tokens": usage["total_tokens"] + reply.usage.total_tokens,
                "cost": usage["cost"] + reply.usage.cost.total,
            },
        }
        finished = False
        batch: list[ToolCallRow] = []
        async with self._tx(live) as tx:
            # This engine is the process's only writer, so its record is the committed state; the
            # check runs inside the transaction, after any abort or interrupt that committed first.
            current = live.record.current_run
            if current is None or current.get("run_id") != run_id or current.get("generation") != generation:
                return False  # aborted or superseded while the model was answering: drop the answer
            await tx.append(run_id, [reply])
            await tx.set_run(new_run)
            if reply.text or any(b.type == "thinking" for b in reply.content):
                thinking = "".join(getattr(b, "thinking", "") for b in reply.content)
                await tx.signal(sig.RUN_OUTPUT, runId=run_id, text=reply.text, thinking=thinking)
            await tx.signal(sig.CHANGED, changes=["messages"])
            # the same transaction takes the next decision's first step: start the tools, or finish
            if reply.tool_calls:
                live.calls = True
                batch = self._rows(pid, run_id, reply.tool_calls, cfg.tools)
                await self._dispatch(tx, live, new_run, batch, reply, fresh=True, budget=budget)
            else:  # after an assistant message, the decision depends on that message (and input) alone
                after = decide([reply], has_input=await self._joining(live), guard=new_run.get("guard"))
                if isinstance(after, Finish):
                    await self._finish(tx, live, new_run, after.reason, last=reply)
                    finished = True
                else:  # input joined the run: the next model call opens another turn
                    await tx.set_run({**new_run, "turn": new_run["turn"] + 1})
        if not batch:
            await self._post_turn(live, run_id, run["turn"])
        if finished:
            await self._promote(live)
            return False
        if batch and not all(r.terminal for r in batch):
            # calls are out (or waiting for approval): their results wake the driver; the rows
            # just written are known, so they need no reading back to arm the deadline timer
            self._arm_deadline(live, batch, time.time())
            return False
        return True

    async def _run_config(self, live: _Live, run_id: str) -> LoopConfig:
        """The loop configuration of this run: the shared one with the run's own system prompt and
        tools, built when the run first needs it and kept until the run ends."""
        if live.config is not None and live.config[0] == run_id:
            return live.config[1]
        cfg = self.config
        if self.prompt is not None:
            if live.prompt is None or live.prompt[0] != run_id:
                live.prompt = (run_id, await self.prompt(live.record))
            cfg = replace(cfg, system_prompt=live.prompt[1])
        if self.toolset is not None:
            tools = self.toolset(live.record, self.config.tools)
            cfg = replace(cfg, tools=dict(await tools if inspect.isawaitable(tools) else tools))
        live.config = (run_id, cfg)
        return cfg

    async def _compact_if_needed(self, live: _Live, run: dict[str, Any], cfg: LoopConfig, tools: bool) -> None:
        """Threshold compaction, between the turns of a run as well as between runs."""
        if self.archive is None or len(live.history) < 4:
            return
        specs = cfg.tool_specs if tools else []
        level = pressure(cfg.system_prompt, specs, live.history, cfg.model.info)
        if should_compact(level, self.compaction_threshold):
            await self._compact(live, run, cfg, "threshold")

    async def _compact(self, live: _Live, run: dict[str, Any], cfg: LoopConfig, reason: Any) -> bool:
        """Summarise the older part of the history, archive it, then replace it by the summary.
        Returns whether anything was compacted. A failure leaves the history as it was."""
        if self.archive is None:
            return False
        pid = live.record.pid
        if "pre_compaction" in cfg.hooks.phases:
            info = TurnInfo(run["run_id"], run["turn"], live.history, cfg.system_prompt, cfg.tool_specs)
            blocked = await cfg.hooks.run_phase("pre_compaction", info)
            if blocked is not None:
                log.info("process %s: compaction skipped by a pre_compaction hook: %s", pid, blocked.reason)
                return False
        keep = cfg.model.info.context_window // 4
        if reason == "overflow":  # the window was too small for what we sent: keep at most half of it
            keep = min(keep, estimate_tokens(live.history) // 2)
        keep = max(256, keep)
        try:
            result = await compact(list(live.history), cfg.model, keep_recent_tokens=keep, reason=reason)
        except CompactionError as exc:
            log.warning("process %s: compaction failed, history unchanged: %s", pid, exc)
            return False
        if result is None or not result.still_applies(live.history):
            return False
        stored = await self.store.history(pid)
        removed_ids = [m.id for m in stored[: len(result.removed)]]
        where = await self.archive(live.record, f"compaction-{new_id()}", result.removed, result.meta())
        async with self._tx(live) as tx:
            summary_id = await self.store.replace_messages(pid, removed_ids[0], removed_ids[-1], result.summary)
            await self.store.add_segment(
                SegmentRow(
                    new_id(),
                    pid,
                    live.record.history_generation,
                    "compaction",
                    removed_ids[0],
                    removed_ids[-1],
                    where,
                    summary_id,
                )
            )
            await tx.signal(
                sig.COMPACTED,
                runId=run["run_id"],
                reason=reason,
                removed=len(result.removed),
                tokensBefore=result.tokens_before,
                tokensAfter=result.tokens_after,
                archive=where,
            )
            history = result.history
            tx.after.append(lambda: live.history.__setitem__(slice(None), history))
        return True

    def _rows(self, pid: str, run_id: str, calls: list[ToolCall], tools: Mapping[str, Tool]) -> list[ToolCallRow]:
        return [
            ToolCallRow(new_id(), pid, run_id, i, c.id, c.name, _syscall(c, tools), dict(c.arguments))
            for i, c in enumerate(calls)
        ]

    # -- tools ------------------------------------------------------------------------------------

    async def _dispatch(
        self,
        tx: _Tx,
        live: _Live,
        run: dict[str, Any],
        rows: list[ToolCallRow],
        assistant: AssistantMessage | None = None,
        *,
        fresh: bool = False,
        budget: int | None = None,
    ) -> None:
        """Start the registered calls the policy allows, in the model's order, inside ``tx``; stop
        at the first that needs a person's approval, or that must wait for calls in flight (the
        loop's ``sequential`` mode, a ``sequential`` tool, ``max_concurrency``): each result wakes
        the driver, which starts the next. Tools start once the transaction commits.

        ``fresh`` rows are not stored yet: they are inserted at the end with the status decided
        here (one statement per batch instead of an insert and an update per call). Calls past
        ``budget`` (what is left of the ``max_tool_calls`` guard) are not run."""
        pid, run_id = live.record.pid, run["run_id"]
        assistant = assistant or _last_assistant(live.history) or AssistantMessage()
        approved = (await self.store.kv_get(pid, f"approved:{run_id}") or {}) if live.approvals else {}
        cfg = await self._run_config(live, run_id)
        in_flight = sum(1 for r in rows if r.status == "dispatched")
        alone = in_flight > 0 and any(_runs_alone(cfg, r) for r in rows if r.status == "dispatched")
        for row in rows:
            if row.status != "registered":
                continue
            call = _call_of(row)
            if budget is not None and row.position >= budget:
                text = "Not run: the run's tool call budget is used up."
                await self._settle(tx, row, tool_error_result(call, text), "failed", ("registered",), fresh=fresh)
                continue
            if alone or in_flight >= max(1, cfg.max_concurrency) or (in_flight and _runs_alone(cfg, row)):
                break  # its turn comes when a call in flight finishes
            verdict = await self.approval(live.record, row)
            if verdict.action != "auto" and approved.get(row.dispatch_id) == (verdict.fingerprint or "-"):
                verdict = Approval("auto")
            if verdict.action == "ask" and not live.record.interactive:
                reason = "requires interactive approval, which is unavailable for this process"
                verdict = Approval("deny", verdict.tags, reason)
            if verdict.action == "deny":
                text = "Tool execution denied by policy" + (f": {verdict.reason}" if verdict.reason else "")
                await self._settle(tx, row, tool_error_result(call, text), "denied", ("registered",), fresh=fresh)
                continue
            if verdict.action == "ask":
                request_id = new_id()
                tags = list(verdict.tags)
                await self.store.put_hil(
                    HilRow(
                        request_id,
                        pid,
                        run_id,
                        row.dispatch_id,
                        row.tool_call_id,
                        row.tool_name,
                        row.syscall,
                        row.args,
                        verdict.fingerprint or "-",
                        tags,
                        verdict.reason,
                    )
                )
                await tx.signal(
                    sig.HIL_REQUESTED,
                    runId=run_id,
                    requestId=request_id,
                    callId=row.tool_call_id,
                    name=row.tool_name,
                    syscall=row.syscall,
                    args=row.args,
                    tags=tags,
                    reason=verdict.reason,
                )
                break
            prepared = _check(cfg, _state_for(live, run_id), assistant, call)
            if isinstance(prepared, ToolResultMessage):
                await self._settle(tx, row, prepared, "failed", ("registered",), fresh=fresh)
                continue
            timeout = prepared.tool.timeout if prepared.tool.timeout is not None else cfg.tool_timeout
            deadline = time.time() + timeout if timeout else None
            if fresh:
                row.status, row.deadline = "dispatched", deadline
            elif not await self.store.set_call_status(
                row.dispatch_id, "dispatched", expect=("registered",), deadline=deadline
            ):
                continue  # claimed already (a concurrent step): it is not ours to start
            await tx.signal(
                sig.TOOL_STARTED,
                runId=run_id,
                callId=row.tool_call_id,
                name=row.tool_name,
                syscall=row.syscall,
                args=row.args,
            )
            tx.durable.append(self._launcher(live, run_id, row, prepared))
            in_flight += 1
            alone = _runs_alone(cfg, row)
        if fresh:
            await self.store.register_calls(rows)

    async def _expire(self, live: _Live, rows: list[ToolCallRow]) -> bool:
        """Enforce each dispatch's durable deadline for calls nobody here is working on (a remote
        call, or one whose worker is gone); wake again at the next deadline still ahead."""
        now = time.time()
        expired = [
            r
            for r in rows
            if r.status == "dispatched"
            and r.deadline is not None
            and r.deadline <= now
            and r.dispatch_id not in live.tools
        ]
        if expired:
            async with self._tx(live) as tx:
                for row in expired:
                    text = f"Tool {row.tool_name} timed out: no result before its deadline"
                    await self._settle(tx, row, tool_error_result(_call_of(row), text), "failed", ("dispatched",))
        self._arm_deadline(live, rows, now)
        return bool(expired)

    def _arm_deadline(self, live: _Live, rows: list[ToolCallRow], now: float) -> None:
        """Wake the driver just after the nearest deadline still ahead, to enforce it."""
        ahead = [r.deadline for r in rows if r.status == "dispatched" and r.deadline is not None and r.deadline > now]
        if live.deadline is not None:
            live.deadline.cancel()
            live.deadline = None
        if ahead:
            live.deadline = asyncio.get_running_loop().call_later(min(ahead) - now + 0.01, self.wake, live.record.pid)

    async def _end_batch(self, tx: _Tx, live: _Live, run_id: str) -> None:
        """The run's tool calls are over (ingested, aborted or failed): delete their rows in ``tx``."""
        await self.store.delete_calls(live.record.pid, run_id)
        tx.after.append(lambda: self._disarm(live))

    def _disarm(self, live: _Live) -> None:
        """No batch is open: its deadline timer has nothing left to enforce (and would hold the
        process's wake-up in the loop for the whole tool timeout)."""
        live.calls = False
        if live.deadline is not None:
            live.deadline.cancel()
            live.deadline = None

    def _launcher(self, live: _Live, run_id: str, row: ToolCallRow, prepared: _Prepared) -> Callable[[], None]:
        def launch() -> None:
            # The dispatch is durable now; in a group commit that can be a loop turn after the step.
            # If meanwhile the run was aborted or the process dropped, the call stays unstarted.
            run = live.record.current_run
            if live.stopping or run is None or run["run_id"] != run_id or self._live.get(live.record.pid) is not live:
                return
            task = live.tools[row.dispatch_id] = asyncio.create_task(self._run_tool(live, run_id, row, prepared))
            task.add_done_callback(lambda done: _drop_task(live.tools, row.dispatch_id, done))

        return launch

    async def _run_tool(self, live: _Live, run_id: str, row: ToolCallRow, prepared: _Prepared) -> None:
        try:
            cfg = await self._run_config(live, run_id)
            checked = await _ask_hooks(cfg, prepared) if cfg.hooks.before else prepared  # a hook may block it
            if isinstance(checked, ToolResultMessage):
                result = checked
            else:
                nested = self._nested_policy(live, run_id, row)
                result = await _execute(cfg, _state_for(live, run_id), checked, None, nested)
            try:
                await self._record(live, run_id, row, result)
            except Exception as exc:  # e.g. ``details`` that do not serialise: the call must still end
                log.exception("process %s: the result of %s could not be recorded", live.record.pid, row.tool_name)
                text = f"The tool's result could not be recorded: {type(exc).__name__}: {exc}"
                await self._record(live, run_id, row, tool_error_result(prepared.call, text))
        finally:
            live.tools.pop(row.dispatch_id, None)
        self.wake(live.record.pid)

    def _nested_policy(self, live: _Live, run_id: str, row: ToolCallRow) -> NestedCheck:
        """The policy for calls a running tool makes itself (a CodeMode program's): the verdict a
        direct call with the same syscall and arguments would get. A verdict of ``ask`` cannot
        pause the run from inside a running tool, so it comes back as ``ask`` and the tool
        refuses the call, telling the model to make it directly (where it can be asked)."""

        async def check(syscall: str, tool_name: str, args: dict[str, Any]) -> NestedVerdict:
            nested = ToolCallRow(
                new_id(), live.record.pid, run_id, row.position, row.tool_call_id, tool_name, syscall, dict(args)
            )
            verdict = await self.approval(live.record, nested)
            if verdict.action == "deny":
                return NestedVerdict("deny", "denied by policy" + (f": {verdict.reason}" if verdict.reason else ""))
            if verdict.action == "ask":
                return NestedVerdict("ask", verdict.reason)
            return NestedVerdict("allow")

        return check

    async def _record(self, live: _Live, run_id: str, row: ToolCallRow, result: ToolResultMessage) -> None:
        """Settle a finished call; the call that completes its batch also ingests the batch."""
        status: CallStatus = "failed" if result.is_error else "completed"
        async with self._tx(live) as tx:
            run = live.record.current_run
            if run is None or run["run_id"] != run_id:  # a late result of an ended run
                await self._settle(tx, row, result, status, ("dispatched",))
                return
            rows = await self.store.calls(live.record.pid, run_id)
            mine = next((r for r in rows if r.dispatch_id == row.dispatch_id), None)
            if mine is None or mine.status != "dispatched":
                return  # settled already (a deadline, an abort): this result is late
            if not all(r.terminal for r in rows if r is not mine):
                await self._settle(tx, row, result, status, ("dispatched",))
                return
            # the last result of the batch: the batch is ingested now and its rows deleted, so the
            # status is settled in memory only
            await self._settle(tx, mine, result, status, ("dispatched",), fresh=True)
            await self._ingest(tx, live, run, rows)
        await self._post_turn(live, run_id, run["turn"])

    async def _post_turn(self, live: _Live, run_id: str, turn: int) -> None:
        """The ``post_turn`` hooks, as the in-memory runner calls them after each turn (a failing
        one is logged). The hooks are the shared configuration's; the prompt and tools the run's."""
        hooks = self.config.hooks
        if "post_turn" not in hooks.phases:
            return
        cfg = live.config[1] if live.config is not None and live.config[0] == run_id else self.config
        await hooks.run_phase("post_turn", TurnInfo(run_id, turn, live.history, cfg.system_prompt, cfg.tool_specs))

    async def _settle(
        self,
        tx: _Tx,
        row: ToolCallRow,
        result: ToolResultMessage,
        status: CallStatus,
        expect: tuple[CallStatus, ...],
        *,
        fresh: bool = False,
    ) -> bool:
        """Record a call's terminal result, unless it was settled already (a late result). A
        ``fresh`` row is one this transaction is about to insert, or to delete: only its copy in
        memory changes."""
        stored = message_to_dict(result)
        if fresh:
            row.status, row.result, ok = status, stored, True
        else:
            ok = await self.store.set_call_status(row.dispatch_id, status, expect=expect, result=stored)
        if ok:
            payload: dict[str, Any] = {
                "runId": row.run_id,
                "callId": row.tool_call_id,
                "name": row.tool_name,
                "syscall": row.syscall,
                "ok": not result.is_error,
            }
            payload["error" if result.is_error else "output"] = result.text
            await tx.signal(sig.TOOL_FINISHED, **payload)
        return ok

    # -- approvals --------------------------------------------------------------------------------

    async def hil(self, pid: str, request_id: str, decision: str, *, remember: bool = False) -> bool:
        """Answer a pending approval. The decision applies to the exact call (and arguments) shown."""
        return await _retried(lambda: self._hil(pid, request_id, decision, remember=remember))

    async def _hil(self, pid: str, request_id: str, decision: str, *, remember: bool) -> bool:
        if decision not in ("approve", "deny"):
            raise ValueError(f"decision must be approve or deny, got {decision!r}")
        if self.leases is not None:
            await self.leases.hold(pid)  # or, held elsewhere, decided here and carried out there
        live = await self.live(pid)
        row = next((h for h in await self.store.hils(pid) if h.request_id == request_id), None)
        if row is None:
            raise KeyError(f"no pending approval {request_id!r} for process {pid}")
        async with self._tx(live) as tx:
            if not await self.store.delete_hil(request_id):  # decided meanwhile (by another client)
                raise KeyError(f"no pending approval {request_id!r} for process {pid}")
            if decision == "approve":
                live.approvals = True
                approved = await self.store.kv_get(pid, f"approved:{row.run_id}") or {}
                approved[row.dispatch_id] = row.fingerprint
                await self.store.kv_set(pid, f"approved:{row.run_id}", approved)
                if remember:  # a process-local allow rule, which the policy checker reads first
                    rules = await self.store.kv_get(pid, "approval_overrides") or []
                    target = call_target(row.syscall, row.tool_name, row.args)  # a device's, or local
                    rules.insert(0, remember_rule(row.syscall, target).to_json())
                    await self.store.kv_set(pid, "approval_overrides", rules)
            else:
                msg = tool_error_result(_call_of_hil(row), "Tool execution denied by user")
                await self.store.set_call_status(
                    row.dispatch_id, "denied", expect=("registered",), result=message_to_dict(msg)
                )
                await tx.signal(
                    sig.TOOL_FINISHED,
                    runId=row.run_id,
                    callId=row.tool_call_id,
                    name=row.tool_name,
                    syscall=row.syscall,
                    ok=False,
                    error="Tool execution denied by user",
                )
            await tx.signal(sig.CHANGED, changes=["hil"])
        self.wake(pid)
        return True

    # -- ending runs ------------------------------------------------------------------------------

    async def _finish(
        self,
        tx: _Tx,
        live: _Live,
        run: dict[str, Any],
        reason: str,
        *,
        error: str | None = None,
        last: Message | None = None,
    ) -> None:
        """End the run inside ``tx``; the caller promotes queued input once it has committed."""
        pid, run_id = live.record.pid, run["run_id"]
        status = "aborted" if reason == "aborted" else "error" if reason == "error" else "ok"
        if status == "error" and error is None:
            last = last or (live.history[-1] if live.history else None)
            error = (last.error_message if isinstance(last, AssistantMessage) else None) or "unknown error"
        if status == "error":
            await tx.append(run_id, [system(f"The run failed: {error}", "error")])
        if live.approvals:
            await self.store.kv_delete(pid, f"approved:{run_id}")
        await tx.set_run(None)
        payload: dict[str, Any] = {"runId": run_id, "status": status, "reason": _reason_code(reason)}
        if error:
            payload["error"] = error
        await tx.signal(sig.RUN_FINISHED, **payload)

    async def _promote(self, live: _Live) -> None:
        """Queued input becomes the next run: system events first, then FIFO."""
        pid = live.record.pid
        if live.record.current_run is not None:
            return
        queue = await self.store.queue(pid) if live.queued else []
        if not queue:
            return
        first = next((q for q in queue if q.kind == "system"), queue[0])
        async with self._tx(live) as tx:
            # checked inside the transaction: two promotions that read the same queue (a worker's
            # own and one on a notification from another) start one run
            if live.record.current_run is not None or not await self.store.dequeue(pid, first.id):
                return
            tx.after.append(lambda: setattr(live, "queued", live.queued - 1))
            await tx.start_run(first.message, "queue.promote", first.run_id)
        self.wake(pid)

    async def abort(self, pid: str, run_id: str | None = None, *, reason: str = "user") -> bool:
        """Stop the active run now. A stale ``run_id`` (not the active run) does nothing."""
        if self.leases is not None and not await self.leases.hold(pid):
            return await self.leases.forward_abort(pid, run_id, reason)
        live = await self.live(pid)
        run = live.record.current_run
        if run is None or (run_id is not None and run["run_id"] != run_id):
            return False
        live.stopping += 1  # nothing new may start for the run while it is being stopped (an approval)
        try:
            stopped = await self._stop(live, run["run_id"], reason)
        finally:
            live.stopping -= 1
        if stopped and reason not in ("user.interrupt", "process.reset", "process.kill"):  # those decide what runs next
            await self._promote(live)
        if live.dirty:
            self.wake(pid)  # a wake-up that came while the run was being stopped
        return stopped

    async def _stop(self, live: _Live, active: str, reason: str) -> bool:
        """Cancel the run's model call and tools, then end it with a terminal result for every open call."""
        pid = live.record.pid
        partial = live.partial
        me = asyncio.current_task()
        stopping = [t for t in [live.driver, *live.tools.values()] if t is not None and not t.done() and t is not me]
        for task in stopping:
            task.cancel()
        if stopping:  # let them unwind (a shell tool kills its process group on the way out)
            await asyncio.wait(stopping)
        run = live.record.current_run
        if run is None or run["run_id"] != active:
            return False  # it finished on its own meanwhile
        rows = await self.store.calls(pid, active)
        async with self._tx(live) as tx:
            added: list[Message] = []
            if partial is not None and partial.partial is not None:
                msg = partial.partial
                msg.content = [b for b in msg.content if not isinstance(b, ToolCall)]
                msg.stop_reason, msg.error_message = "aborted", "aborted"
                added.append(msg)
            added.extend(_results_of(rows, CANCELLED))
            for h in await self.store.hils(pid):
                await self.store.delete_hil(h.request_id)
            await self._end_batch(tx, live, active)
            await tx.append(active, added)
            await self.store.kv_delete(pid, f"approved:{active}")
            await tx.set_run(None)
            await tx.signal(sig.RUN_FINISHED, runId=active, status="aborted", reason=reason)
        return True

    async def forget(self, pid: str) -> None:
        """Drop the in-memory state of a process (after kill); its watchers' streams end."""
        live = self._live.get(pid)
        if live is not None:
            self._drop(live)
        if self.leases is not None:
            self.leases.lost(pid)
        self.hub.close(pid)

    def _drop(self, live: _Live) -> None:
        """Forget a process's cache and stop everything working for it (but the calling task)."""
        del self._live[live.record.pid]
        self._disarm(live)
        me = asyncio.current_task()
        for task in [*live.tools.values(), live.driver]:
            if task is not None and not task.done() and task is not me:
                task.cancel()

    async def wait_idle(self, pid: str) -> None:
        """Return when no run is active and nothing is working for the process."""
        live = await self.live(pid)
        while True:
            if live.remote:
                assert self.leases is not None
                await self.leases.wait_idle(pid)
                return
            if live.lost:  # dropped after a failed commit: follow the reloaded process
                live = await self.live(pid)
            elif not live.idle.is_set():  # a run is active, or the step that ended it is not durable yet
                await live.idle.wait()
            elif live.record.current_run is not None:
                await asyncio.sleep(0)  # a run starting in this very step: its flag is cleared as it returns
            elif live.driver is not None and not live.driver.done():
                await asyncio.wait([live.driver])
            else:
                return

    async def close(self) -> None:
        tasks = [t for live in self._live.values() for t in [*live.tools.values(), live.driver] if t is not None]
        tasks.extend(self._reloading)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.leases is not None:
            await self.leases.stop()
        for pid in list(self._live):
            self.hub.close(pid)  # followers' streams end instead of waiting forever
        self._live.clear()


def _syscall(call: ToolCall, tools: Mapping[str, Tool]) -> str:
    """What the approval policy matches a call against (``syscall_of``; an unknown tool's name)."""
    tool = tools.get(call.name)
    return syscall_of(tool, call.arguments) if tool is not None else SYSCALLS.get(call.name, f"tool.{call.name}")


def _runs_alone(cfg: LoopConfig, row: ToolCallRow) -> bool:
    """Whether a call runs with no other call of its batch in flight."""
    if cfg.tool_execution == "sequential":
        return True
    tool = cfg.tools.get(row.tool_name)
    return tool is not None and tool.sequential


def _drop_task(tasks: dict[str, asyncio.Task[None]], key: str, task: asyncio.Task[None]) -> None:
    """Forget a finished tool task (one cancelled before it started never reaches its own cleanup)."""
    if tasks.get(key) is task:
        del tasks[key]


def _has_media(message: Message) -> bool:
    """Whether a message carries stored-media references (images kept as files, not inline)."""
    if not isinstance(message, UserMessage | ToolResultMessage) or len(message.content) < 2:
        return False
    return any(isinstance(b, ImageContent) and b.data.startswith(MEDIA_PREFIX) for b in message.content)


def _reason_code(reason: str) -> str:
    if reason in ("stop", "length") or reason in GUARD_NAMES:
        return "turn.complete" if reason == "stop" else reason
    return {"error": "generation.error", "aborted": "user"}.get(reason, reason)


def _results_of(rows: list[ToolCallRow], open_text: str) -> list[Message]:
    """One result per call of a batch, in the model's order: the stored one, or an error for an open call."""
    return [
        message_from_dict(r.result)
        if r.terminal and r.result is not None
        else tool_error_result(_call_of(r), open_text)
        for r in rows
    ]


def _call_of(row: ToolCallRow) -> ToolCall:
    return ToolCall(id=row.tool_call_id, name=row.tool_name, arguments=row.args)


def _call_of_hil(row: HilRow) -> ToolCall:
    return ToolCall(id=row.tool_call_id, name=row.tool_name, arguments=row.args)


def _last_assistant(history: list[Message]) -> AssistantMessage | None:
    for msg in reversed(history):
        if isinstance(msg, AssistantMessage):
            return msg
        if not isinstance(msg, ToolResultMessage | SystemMessage):
            return None
    return None


def _state_for(live: _Live, run_id: str) -> RunState:
    return RunState(run_id=run_id, messages=live.history, first_new=len(live.history))
