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

The parts: ``tx.py`` (the in-memory cache of a process and the transaction of one step),
``driver.py`` (the step loop, the model turn, compaction, ending a run), ``calls.py`` (a batch's
tool calls: dispatch, settle, deadlines, ingest), ``hil.py`` (approvals a person answers),
``admission.py`` (input: send, system events, the queue and its promotion), ``api.py`` (the
hooks' types, receipts, ids). This module holds the engine itself: its cache of processes,
recovery, the public API (which delegates to those parts), and stopping runs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Coroutine, Mapping
from contextlib import ExitStack, asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from agentloop.loop.execute import CANCELLED, own_tasks
from agentloop.loop.hooks import maybe_await
from agentloop.loop.output import DEFAULT_RETRIES, SchemaOutput
from agentloop.loop.state import LoopConfig, Mode, check_mode
from agentloop.messages import Message, ToolCall, Usage, names_speaker, tool_error_result
from agentloop.process import admission, background, hil
from agentloop.process import signals as sig
from agentloop.process.api import (
    AbortedFn,
    ApprovalFn,
    ArchiveFn,
    Compacted,
    CompiledPrompt,
    ConfigFn,
    MemoryFn,
    PromptFn,
    Receipt,
    RunActive,
    SendMode,
    ToolsetFn,
    approve_everything,
    call_of,
    new_id,
)
from agentloop.process.approval.checker import AmendFn
from agentloop.process.archive import DISCARDED_KEY, discarded_row
from agentloop.process.calls import (
    INTERRUPTED_BY_RESTART,
    disarm,
    dispatch,
    end_batch,
    results_of,
    settle,
    signal_finished,
)
from agentloop.process.compaction import check_manual
from agentloop.process.driver import drive, fail_run, forget_output, restore_added, signal_run_finished, summarise
from agentloop.process.keylock import KeyedLocks
from agentloop.process.lease import DEFAULT_POLL, DEFAULT_TTL, Leases
from agentloop.process.lease import retried as _retried
from agentloop.process.pressure import forget_context, run_keys, take_run_rows
from agentloop.process.prompt import run_prompt
from agentloop.process.signals import SignalHub
from agentloop.process.store import (
    MAX_SEQ,
    NoSuchProcess,
    ProcessBusy,
    ProcessRecord,
    QueueItem,
    Store,
    StoreError,
    ToolCallRow,
    UsageTotals,
)
from agentloop.process.store.base import QueueKind
from agentloop.process.tool_scope import TOOLS_KEY, scoped
from agentloop.process.tx import _has_media, _Live, _Tx, _TxScope, promoting
from agentloop.tools.base import BackgroundRefused, background_group
from agentloop.tools.jobs import CallKey, JobRegistry
from agentloop.tools.process_group import GroupIdentity

log = logging.getLogger("agentloop.process")


# kv row of a process: {"run_id", "at"} of its last aborted run, written with the abort, so what the
# ``aborted`` hook had to do can still be done after a crash that came before the hook ran
LAST_ABORT_KEY = "run:last-abort"
MODE_KEY = "mode"  # "chat": the process's runs answer from the same history without tools
# the process's own model choice ({"model": "provider:model", "reasoning": level}, checked by the
# kernel: kernel/account_model.py), over its owner's; absent: its owner's (or the kernel's)
MODEL_KEY = "model"
PROMPT_KEY = "run:prompt"  # {"run": id, "text": ...}: a run's prompt, which it keeps if resumed
# How long an abort waits for the cancelled model call and tools to unwind (a shell tool kills its
# process group on the way out) before it ends the run anyway: a tool that ignores cancellation
# must not keep the run, and the person who pressed stop, waiting. Its late result is ignored.
ABORT_GRACE = 10.0

# Abort reasons after which the caller decides what runs next, so queued input is not promoted:
# an interrupt starts its own run, a reset or kill clears the queue, and a subagent stopped with
# its parent (``parent.*``) must not go on with queued work nobody will read.
NEXT_RUN_DECIDED = frozenset({"user.interrupt", "process.reset", "process.kill", "parent.abort", "parent.reset"})
# aborts whose queued input is discarded in the abort's own commit: a crash before the reset's
# or kill's commit must not leave that input for the restart to run, nor may a subagent stopped
# with its parent find a report queued for it and start over after the next restart
DISCARDS_QUEUE = frozenset({"process.reset", "process.kill", "parent.abort", "parent.reset"})
MAX_BACKGROUND = 8  # background jobs one process may have running (``start_background``)
# The processes whose cache (the record and the whole history) one worker keeps, by default
# (``ProcessEngine.cache_limit``): past it, the least recently used of those safe to drop are
# dropped (``evict``), and loaded again from the store when next used.
CACHED_PROCESSES = 1000
# How many processes in use (held by a task, a run under way) one eviction looks past at most, so
# that a cache full of busy processes costs each new one a bounded look, not a walk of the cache
EVICTION_SKIPS = 8
# checks a new process must pass inside the transaction that stores it (a quota): see ``create``
Admit = Callable[[], Awaitable[None]]


def _compiled(prompt: str | CompiledPrompt) -> CompiledPrompt:
    """What a ``PromptFn`` returned, as a ``CompiledPrompt`` (plain text: no sections to show)."""
    return prompt if isinstance(prompt, CompiledPrompt) else CompiledPrompt(prompt)


def _manifest(run_id: str, prompt: CompiledPrompt, tools: list[str]) -> dict[str, Any]:
    """The payload of ``proc.prompt.compiled`` (the log adds the pid)."""
    sections = [
        {"name": s.name, "bytes": s.bytes, "files": list(s.files), "truncated": s.truncated, "omitted": list(s.omitted)}
        for s in prompt.sections
    ]
    return {
        "runId": run_id,
        "digest": prompt.digest,
        "bytes": prompt.size,
        "sections": sections,
        "tools": tools,
        "warnings": list(prompt.warnings),
        "base": prompt.base,
    }


def _check_settled(live: _Live) -> None:
    """For ``wait_idle`` once the runtime is closing: a process with a run under way will not get
    idle here, and saying it did would be a lie (``StoreError``); one that is idle is."""
    if live.record.current_run is not None or not live.idle.is_set():
        raise StoreError(
            f"the runtime closed while process {live.record.pid} had a run under way:"
            " it resumes when the store is opened again"
        )


def _armed(timer: asyncio.TimerHandle | None, now: float) -> bool:
    """Whether ``timer`` is still to fire (one that fired or was cancelled is kept all the same)."""
    return timer is not None and not timer.cancelled() and timer.when() > now


def _aborted_alone(task: asyncio.Task[bool]) -> None:
    """An abort's task is done: its failure is the caller's to hear, unless the caller gave up."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("an abort failed: %s", task.exception())


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
        configure: ConfigFn | None = None,
        archive: ArchiveFn | None = None,
        memory: MemoryFn | None = None,
        memory_home: Callable[[ProcessRecord], Path] | None = None,
        compaction_threshold: float = 0.9,
        clear_tool_outputs: bool = True,
        native_compaction: bool = False,
        toolset: ToolsetFn | None = None,
        worker: str | None = None,
        lease_ttl: float = DEFAULT_TTL,
        poll_interval: float = DEFAULT_POLL,
    ) -> None:
        self.closing = False
        self.store = store
        self.config = config
        self.hub = hub or SignalHub()
        self.approval = approval
        self.hydrate = hydrate  # stored media references -> image blocks, before a model call
        self.prompt = prompt  # the run's system prompt, built once per run
        # pid -> (run id, prompt, tools): what a run's prompt was built from, until its first model
        # step logs it (``log_prompt``)
        self._compiled: dict[str, tuple[str, CompiledPrompt, list[str]]] = {}
        self.configure = configure  # the run's configuration for its process (the owner's model)
        # a process's own model choice (its ``MODEL_KEY`` row) applied over that (set by the kernel)
        self.choose_model: Callable[[Any, LoopConfig], LoopConfig] | None = None
        self.archive = archive  # writes compacted-away messages somewhere safe, returns where
        self.memory = memory  # keeps what a compaction found worth remembering
        # a process's owner's home, whose older memories its runs recall (None: no recall); known
        # here, not asked of the run's ``memory`` tool, which a tool scope may hide
        self.memory_home = memory_home
        self.compaction_threshold = compaction_threshold
        # compaction's first tier: old tool outputs archived and replaced by a note, before a summary
        self.clear_tool_outputs = clear_tool_outputs
        self.native_compaction = native_compaction  # summaries also ask the model's provider for its own
        self.toolset = toolset  # the tools of one process's run (e.g. the owner's devices added)
        self.aborted: AbortedFn | None = None  # told of each aborted run (set by the kernel)
        # called, without arguments, once ``close`` has stopped every process (observers of the kernel)
        self.closed_hooks: list[Callable[[], None]] = []
        # seconds an approval request may wait for its answer before it is denied (None: for ever)
        self.approval_timeout: float | None = None
        # adds a person's "always, for this account" to the account's policy (set by the kernel)
        self.amend_policy: AmendFn | None = None
        # seconds a run waits before each new try of a model that is out (``driver._defer``); empty:
        # a model call that fails after its own retries ends the run
        self.outage_retries: tuple[float, ...] = ()
        # pid -> the process's cache, least recently used first (``live`` and a run's end move
        # it last); at most ``cache_limit`` but the processes in use (``evict``)
        self._live: OrderedDict[str, _Live] = OrderedDict()
        self.cache_limit = CACHED_PROCESSES
        self._reloading: set[asyncio.Task[None]] = set()
        self._aborting: set[asyncio.Task[bool]] = set()
        self._deferred: set[asyncio.Task[None]] = set()  # see ``when_cleared``
        self._background: dict[str, set[asyncio.Task[None]]] = {}  # pid -> its background work
        self._started_by: dict[asyncio.Task[None], CallKey] = {}  # background work -> the call that started it
        self.jobs = JobRegistry()  # the background commands each process can look after (``Jobs``)
        # background work a reset or kill stopped, until it has ended: ``close`` waits for it too
        # (a command's group is killed after a grace, which shutdown must not cut short)
        self._ending: set[asyncio.Task[None]] = set()
        # held by a reset or kill from its abort to its last commit, and by a compaction asked for
        # (``compact``): input for the process waits (see ``admission.after_clearing``), so no run
        # starts in between to be cleared or lost, or to find its history replaced under it
        self.clearing = KeyedLocks()
        # pid -> the last queued item the reset or kill under way discards (see ``clear``)
        self.discarding: dict[str, int] = {}
        # processes a compaction asked for is summarising (see ``compact``): nothing queued starts
        self.compacting: set[str] = set()
        # several workers may share the store: ``worker`` names this one in its leases
        self.leases = Leases(self, owner=worker, ttl=lease_ttl, poll=poll_interval) if store.shared else None

    # -- state ------------------------------------------------------------------------------------

    async def live(self, pid: str) -> _Live:
        live = self._live.get(pid)
        if live is not None:
            self._live.move_to_end(pid)  # (the least recently used are evicted first)
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
        seq = await self.store.last_event_seq(pid)  # what the deltas of its next step follow (Signal.base)
        raced = self._live.get(pid)
        if raced is not None:  # loaded by another task meanwhile: one cache (and driver) per process
            return raced
        if self.leases is not None and pid not in self.leases.held:  # let go of meanwhile
            return await self.live(pid)
        live = self._live[pid] = _Live(record, history, queued=queued, seq=seq)
        live.media = any(_has_media(m) for m in history)
        live.origins = any(map(names_speaker, history))
        live.approvals = record.current_run is not None  # decisions made before a restart may be stored
        live.resumed = record.current_run is not None
        if record.current_run is None:
            live.idle.set()
        if len(self._live) > self.cache_limit:
            self.evict()
        return live

    async def create(
        self,
        record: ProcessRecord,
        kv: Mapping[str, Any] | None = None,
        first: Message | None = None,
        run_id: str | None = None,
        admit: Admit | None = None,
        output: dict[str, Any] | None = None,
    ) -> Receipt | None:
        """Store a new process, with ``kv`` as its first key-value rows in the same transaction
        (so what they say about it is never missing), and start its cache: a fresh process has
        nothing to load. ``first`` input (``run_id`` as in ``send``) goes in the same transaction:
        as its first run where this worker drives the process, else (a shared store) as queued
        input that whichever worker claims the process first (this one, at once) runs with the
        receipt's run id. Either way no process exists without its first message. ``admit`` runs
        in that transaction once the process's row is written: what it raises leaves nothing.
        ``output``: the row the first run's output is kept in (``admission.output_key``)."""
        if first is not None and self.leases is None:
            return await self._create_running(record, kv, first, run_id, admit, output)
        receipt = None
        async with self.store.transaction():
            await self.store.create_process(record)
            if admit is not None:
                await admit()
            for key, value in (kv or {}).items():
                await self.store.kv_set(record.pid, key, value)
            if first is not None:
                receipt = Receipt(run_id or new_id(), False, 0)
                await self.store.enqueue(record.pid, "queue", first, run_id=receipt.run_id, reason="proc.send")
                await admission.keep_output(self, record.pid, receipt.run_id, output)
                await admission.remember_admission(self, record.pid, receipt.run_id, run_id, queued=False, position=0)
        if self.leases is None:  # else cached by whichever worker claims it first
            live = self._live[record.pid] = _Live(record, [], calls=False)
            live.idle.set()
            if len(self._live) > self.cache_limit:
                self.evict()
        elif receipt is not None:
            await self.leases.hold(record.pid)  # claimed: its queued message starts the run (else the claimer's)
        return receipt

    async def _create_running(
        self,
        record: ProcessRecord,
        kv: Mapping[str, Any] | None,
        first: Message,
        run_id: str | None,
        admit: Admit | None = None,
        output: dict[str, Any] | None = None,
    ) -> Receipt:
        """``create`` with the first run, in one transaction. The cache entry is published once the
        process row is written (so nothing else loads the process meanwhile), dropped only if the
        transaction is not kept, and the driver is woken once it is durable (a caller cancelled
        while a group commit completes still leaves a running process with its driver)."""
        live = _Live(record, [], calls=False)
        kept: list[bool] = []
        try:
            async with self._tx(live) as tx:
                await self.store.create_process(record)  # StoreError if the pid is taken: nothing published
                if admit is not None:
                    await admit()
                self._live[record.pid] = live
                for key, value in (kv or {}).items():
                    await self.store.kv_set(record.pid, key, value)
                started = await tx.start_run(first, "proc.send", run_id)
                await admission.keep_output(self, record.pid, started, output)
                # (a retried send of this id then returns this run)
                await admission.remember_admission(self, record.pid, started, run_id, queued=False, position=0)
                tx.after.append(lambda: kept.append(True))
                tx.durable.append(lambda: self.wake(record.pid))
        except BaseException:
            if not kept and self._live.get(record.pid) is live:
                del self._live[record.pid]
            raise
        if len(self._live) > self.cache_limit:
            self.evict()
        return Receipt(started, False, 0)

    @asynccontextmanager
    async def clear(self, pid: str, *, if_idle: bool = False) -> AsyncIterator[None]:
        """Hold the process for a reset or kill (``clearing``). The clearing discards the input
        queued before it began. Input another worker queues meanwhile (this worker's own waits
        instead) is kept: it belongs to the fresh conversation, whose first run it starts once the
        clearing is over, instead of a run on the history being cleared. ``if_idle``: for a kill
        that is given up if the process turns out not to be idle (``Kernel._kill_if_idle``): its
        background work is left running, for that kill's check to find."""
        with ExitStack() as after:
            async with self.clearing.hold(pid):
                if not if_idle:  # (what it would tell belongs to the conversation being cleared)
                    self.stop_background(pid)
                self.discarding[pid] = max((item.id for item in await self.store.queue(pid)), default=0)
                try:
                    await self.settle_deliveries()  # (before the clearing looks for the run to stop)
                    # and what the deliveries it waited for queued (they checked before the mark: a
                    # steer, an event for the run it stops) is discarded with the rest
                    self.discarding[pid] = max((item.id for item in await self.store.queue(pid)), default=0)
                    yield
                finally:
                    del self.discarding[pid]
                live = self._live.get(pid)
                if live is not None and not live.remote:  # (``wait_idle`` waits from before the release)
                    after.enter_context(promoting(live))
            if live is not None and not live.remote:
                live.queued = len(await self.store.queue(pid))
                await admission.promote(self, live)

    async def settle_deliveries(self) -> None:
        """Once a reset, kill or compaction has marked the process (``discarding``, ``compacting``):
        wait for the transactions of this worker under way to end. A delivery checks the marks
        inside its transaction, before it starts a run (``admission._check_not_clearing``); one
        whose check came before the mark and whose commit after it would start a run the
        clearing, looking for the run to stop (or whether one is active), could not see yet. A
        transaction begun here (and rolled back: it writes nothing) begins only once those have
        ended, and a transaction's cache updates apply as it ends, so from here on the cached
        ``current_run`` shows their run; a delivery that begins later sees the mark and waits.
        On the reset path only: the delivery itself pays nothing for it."""
        scope = self.store.transaction()
        await scope.begin()
        scope.end(commit=False)

    def when_cleared(self, pid: str, then: Callable[[], None]) -> None:
        """Call ``then`` once the reset or kill of ``pid`` under way is over. A loop that delivers
        to many processes in turn comes back to this one then, instead of keeping the others
        waiting meanwhile."""

        async def wait() -> None:
            await admission.after_clearing(self, pid)
            then()

        task = asyncio.get_running_loop().create_task(wait(), name=f"after the clearing of {pid}")
        self._deferred.add(task)
        task.add_done_callback(self._deferred.discard)

    async def _discard_queue(self, tx: _Tx, live: _Live, *, archived: bool = False) -> int:
        """Inside a reset's or kill's transaction: drop the queued input it discards (see ``clear``),
        and the events bound to the conversation it ends whenever they were queued (another worker's,
        ``admission.bound_to_conversation``); returns how many items are kept (what waits once the
        transaction is kept).

        The abort of a process being cleared (``discarding``) drops that input in its own commit, so
        that a crash before the clearing's last commit leaves nothing for the restart to run on the
        history the user cleared. Its archive is written only after that commit, though, and is the
        only copy of the input: so what the abort drops is set aside in the same commit
        (``archive.DISCARDED_KEY``) for the archive to take (``Kernel._archive``), and let go by the
        reset's own transaction (``archived``: its archive is written; a kill deletes the row with
        the process). A crash or an archive that cannot be written in between loses nothing: the
        next reset or kill archives it."""
        pid = live.record.pid
        upto = self.discarding.get(pid)
        kept = 0
        dropped: list[tuple[int, Message]] = []
        for item in await self.store.queue(pid):
            if upto is None or item.id <= upto or admission.bound_to_conversation(item):
                await self.store.dequeue(pid, item.id)
                if item.kind == "queue" and item.run_id is not None:  # (the output its run was to give)
                    await self.store.kv_delete(pid, admission.output_key(item.run_id))
                dropped.append((item.id, item.message))
            else:
                kept += 1
        if archived:
            await self.store.kv_delete(pid, DISCARDED_KEY)
        elif dropped and upto is not None:  # (the abort of a clearing: its archive is still to come)
            earlier = await self.store.kv_get(pid, DISCARDED_KEY)
            await self.store.kv_set(pid, DISCARDED_KEY, discarded_row(earlier, dropped))
        tx.after.append(lambda: setattr(live, "queued", kept))
        return kept

    def _tx(self, live: _Live) -> _TxScope:
        """One step's transaction: ``async with self._tx(live) as tx``. Once it commits, the cache
        and the watchers learn what changed; a rollback leaves both untouched."""
        return _TxScope(self, live)

    def process_config(self, record: ProcessRecord, model: Any = None) -> LoopConfig:
        """The shared configuration as the process's runs start from it (its owner's model, or
        ``model``, the process's own choice as its ``MODEL_KEY`` row holds it, when given)."""
        cfg = self.config if self.configure is None else self.configure(record, self.config)
        if model is not None and self.choose_model is not None:
            cfg = self.choose_model(model, cfg)
        return cfg

    async def effective_config(self, record: ProcessRecord) -> LoopConfig:
        """``process_config`` with the process's own model choice read from its kv (one query): the
        model a run of it would start on, for the calls made for it outside a run (its title, a
        manual compaction, the memories a reset keeps, the context window before its first step)."""
        return self.process_config(record, await self.store.kv_get(record.pid, MODEL_KEY))

    async def _run_config(self, live: _Live, run_id: str) -> LoopConfig:
        """The loop configuration of this run: the shared one with the run's own system prompt and
        tools, built when the run first needs it and kept until the run ends."""
        if live.config is not None and live.config[0] == run_id:
            return live.config[1]
        # per run, in one query (a change waits for the next run): the mode, the model, the pressure
        # rows, and the output the run must give (if any: ``admission.output_key``)
        output_key = admission.output_key(run_id)
        keys = (MODE_KEY, MODEL_KEY, TOOLS_KEY, output_key, *run_keys(live))
        rows = await self.store.kv_many(live.record.pid, keys)
        cfg = self.process_config(live.record, rows.get(MODEL_KEY))
        changes: dict[str, Any] = {}  # (one ``replace`` for them all: each copy costs microseconds)
        tools = cfg.tools
        if self.toolset is not None:
            tools = changes["tools"] = dict(await maybe_await(self.toolset(live.record, self.config.tools)))
        if isinstance(rows.get(TOOLS_KEY), list):  # the process's tool scope (process/tool_scope.py)
            tools = changes["tools"] = dict(scoped(tools, rows[TOOLS_KEY]))
        fresh: CompiledPrompt | None = None
        if self.prompt is not None:
            if live.prompt is None or live.prompt[0] != run_id:
                kept = await self._kept_prompt(live, run_id)
                if kept is None:
                    # with the skills the run's input names (``$deploy``) or whose paths it mentions
                    home = self.memory_home(live.record) if self.memory_home is not None else None
                    fresh = await run_prompt(_compiled(await self.prompt(live.record, tools)), live.history, home)
                    kept = (run_id, fresh.text)
                live.prompt = kept
            changes["system_prompt"] = live.prompt[1]
        if rows.get(MODE_KEY) == "chat":
            changes["tools"] = {}
        kept_output = rows.get(output_key)
        if isinstance(kept_output, dict):  # its tool, in chat mode too (the run's answer is a call)
            spec = SchemaOutput(kept_output["schema"], retries=kept_output.get("retries", DEFAULT_RETRIES))
            changes["tools"] = {**changes.get("tools", tools), spec.name: spec.tool}
        if changes:
            cfg = replace(cfg, **changes)
        take_run_rows(self, live, rows, cfg.model.info)  # the compaction policy, the level
        if fresh is not None:
            self._compiled[live.record.pid] = (run_id, fresh, sorted(cfg.tools))
        cfg = await restore_added(self, live, run_id, cfg)  # (after a restart: the tools hooks added)
        live.config = (run_id, cfg)
        return cfg

    async def _kept_prompt(self, live: _Live, run_id: str) -> tuple[str, str] | None:
        """The prompt a resumed run was given before the restart (or the takeover), if stored."""
        if not live.resumed:
            return None
        live.resumed = False
        kept = await self.store.kv_get(live.record.pid, PROMPT_KEY)
        if not isinstance(kept, dict) or kept.get("run") != run_id or not isinstance(kept.get("text"), str):
            return None
        live.prompt_kept = run_id
        return run_id, kept["text"]

    async def keep_prompt(self, tx: _Tx, live: _Live) -> None:
        """Inside a step's transaction, for a run that goes on after it: store the run's prompt
        once, so that after a restart the run carries on with the instructions it began with
        (files it was built from may have changed meanwhile), not a prompt assembled anew."""
        prompt = live.prompt
        if prompt is None or live.prompt_kept == prompt[0] or self.prompt is None:
            return
        await self.store.kv_set(live.record.pid, PROMPT_KEY, {"run": prompt[0], "text": prompt[1]})
        tx.after.append(lambda: setattr(live, "prompt_kept", prompt[0]))

    async def log_prompt(self, tx: _Tx, live: _Live, run_id: str) -> None:
        """Inside the transaction of a model step of ``run_id``: log ``proc.prompt.compiled`` if
        the run's prompt was built fresh and is not logged yet, so the manifest is durable with
        the first answer to that prompt (and, for a run that goes on, with the prompt itself,
        which ``keep_prompt`` stores in the same commit). A run resumed with its kept prompt
        logged it before the restart; one that must build its prompt anew logs the new one."""
        pid = live.record.pid
        pending = self._compiled.get(pid)
        if pending is None or pending[0] != run_id:
            return
        _, prompt, tools = pending
        await tx.signal(sig.PROMPT_COMPILED, **_manifest(run_id, prompt, tools))

        def logged() -> None:
            if self._compiled.get(pid) is pending:
                del self._compiled[pid]

        tx.after.append(logged)

    # -- recovery ---------------------------------------------------------------------------------

    async def recover(self) -> list[str]:
        """After a (re)start: settle the calls that were in flight and resume every unfinished run
        (on a shared store: those no live worker holds, and from now on the orphans of dead ones).
        A run that cannot be resumed (its tools or prompt cannot be had) ends with an error, as
        a failed step does; the others resume all the same."""
        if self.leases is not None:
            return await self.leases.start()
        resumed: list[str] = []
        for record in await self.store.list_processes():
            try:
                if await self.resume(record):
                    resumed.append(record.pid)
            except Exception:  # one process that cannot be resumed must not keep the runtime from starting
                log.exception("process %s: could not resume it after the restart", record.pid)
                await self._fail_unresumed(record.pid)
            await self._recover_background(record)
        return resumed

    async def _recover_background(self, record: ProcessRecord) -> None:
        """Report (and stop) the background jobs the runtime before left unfinished
        (``background.recover``); on a shared store they are left alone (see there)."""
        try:
            await background.recover(self, record)
        except Exception:  # (as a process that cannot be resumed: the others go on)
            log.exception("process %s: could not report the background work the restart ended", record.pid)

    async def _fail_unresumed(self, pid: str) -> None:
        """End a run its resumption failed on, as the driver ends one whose step failed: left
        active, it would wait forever for calls nothing runs, and hold its queued input back."""
        live = self._live.get(pid)
        if live is None or live.record.current_run is None:
            return  # not loaded (the store failed it), or nothing to end
        try:
            await fail_run(self, live)
        except Exception:
            log.exception("process %s: could not end the run it could not resume", pid)

    async def resume(self, record: ProcessRecord) -> bool:
        """Bring one process back to work from what the store holds. Returns whether it resumed."""
        if record.state == "killed":
            return False
        if record.current_run is None:
            if await self.store.queue(record.pid):  # a crash between a run's end and its queue's promotion
                await admission.promote(self, await self.live(record.pid))
                return True
            return False
        live = await self.live(record.pid)
        run_id = record.current_run["run_id"]
        tools = (await self._run_config(live, run_id)).tools  # the process's own (a device's tools too)
        async with self._tx(live) as tx:
            rows = await self.store.calls(record.pid, run_id)
            await hil.withdraw_orphans(self, tx, record.pid, rows)  # nested calls' questions died with their programs
            rerun: list[ToolCallRow] = []
            for row in rows:
                if row.status != "dispatched":
                    continue
                tool = tools.get(row.tool_name)
                if tool is not None and tool.idempotent:
                    if await self.store.set_call_status(row.dispatch_id, "registered", expect=("dispatched",)):
                        row.status = "registered"
                        rerun.append(row)
                else:
                    msg = tool_error_result(call_of(row), INTERRUPTED_BY_RESTART)
                    await settle(self, tx, row, msg, "failed", ("dispatched",))
            if rerun:  # dispatched again in this commit: left registered, they would pass for calls
                # never begun, which input waiting for the run skips as stale
                await dispatch(self, tx, live, record.current_run, rerun)
        self.wake(record.pid)
        return True

    async def reset(self, pid: str, *, also: Callable[[], Awaitable[Callable[[], None]]] | None = None) -> None:
        """Start an empty history (a new generation) and drop the queue and the logged signals of
        the conversation (those no watch has still to read: ``Store.prune_events``), in one
        transaction that ``also`` writes into too (it returns what to do once that commits); the
        run was stopped before. The cached process follows on commit."""
        live = await self.live(pid)
        async with self._tx(live) as tx:
            if also is not None:
                tx.after.append(await also())
            generation = await self.store.new_generation(pid)
            tx.after.append(lambda: setattr(live.record, "history_generation", generation))
            await self._discard_queue(tx, live, archived=True)  # (the kernel archived it before: ``_clear_held``)
            await self.store.prune_events(pid)
            tx.after.append(live.history.clear)
            await forget_context(tx, live)
            await tx.signal(sig.CHANGED, changes=["messages", "reset"])
        if self.leases is not None:
            self.leases.idle(pid)

    async def compact(
        self,
        pid: str,
        *,
        instructions: str | None = None,
        keep_last: int | None = None,
        through: int | None = None,
        summary: str | None = None,
    ) -> Compacted:
        """Summarise the history now (reason ``manual``; ``instructions`` go to the summary model),
        the same way a run compacts it: archive, then the swap with its segment row and
        ``proc.compacted``. Only while idle (``RunActive``); a failure raises ``CompactionError``
        and leaves the history as it was. The process is held as a reset holds it (``clearing``):
        input sent meanwhile waits, then runs on the compacted history; input another worker
        queues is promoted once it is over. On a shared store ``ProcessBusy`` while another
        worker will not let the process go.

        The cut is the compaction rules' unless the caller chose it: keep the newest ``keep_last``
        messages, or summarise up to and including message id ``through`` (never parting a tool
        call from its results: ``explicit_cut``). ``summary``: the summary's text, written by the
        caller, installed with no model call. Bad options (``check_manual``; a ``through`` the
        history does not hold) are a ``TypeError`` or ``ValueError`` before anything is done."""
        summary = check_manual(keep_last, through, summary, instructions, MAX_SEQ)
        async with self.held_idle(pid, "compaction") as live:
            cfg = await self.effective_config(live.record)  # (the process's own model, if it chose one)
            done, _ = await summarise(
                self,
                live,
                cfg,
                "manual",
                None,
                instructions,
                keep_last=keep_last,
                through=through,
                summary=summary,
            )
        return done

    @asynccontextmanager
    async def held_idle(self, pid: str, what: str) -> AsyncIterator[_Live]:
        """Hold an idle process while ``what`` (a compaction asked for, a rewind) changes its
        history in place, as a reset holds it (``clearing``): ``RunActive`` when a run is under
        way, ``ProcessBusy`` on a shared store while another worker will not let the process go,
        both before anything is done. Meanwhile no queued input starts a run (``compacting``):
        what is sent waits, and once the work is over it runs on the history as it was left;
        input another worker queued meanwhile is promoted then. An error inside leaves that to
        the next input or sweep, as it leaves the history."""
        with ExitStack() as after:
            async with self.clearing.hold(pid):
                self.compacting.add(pid)  # (first: from here the lease of the idle process is kept)
                try:
                    await self.settle_deliveries()  # (before it looks whether a run is active)
                    if self.leases is not None and not await self.leases.hold(pid):
                        raise ProcessBusy(pid, what)
                    live = await self.live(pid)
                    if live.record.current_run is not None:
                        raise RunActive(pid, f"a {what}")
                    yield live
                finally:
                    self.compacting.discard(pid)
                if not live.remote and not live.lost:  # (``wait_idle`` waits from before the release)
                    after.enter_context(promoting(live))
            if not live.remote and not live.lost:  # what another worker queued meanwhile (see ``clear``)
                live.queued = len(await self.store.queue(pid))
                await admission.promote(self, live)
        if self.leases is not None and live.record.current_run is None:
            self.leases.idle(pid)  # (let go of once nothing waits, as after a run)

    async def add_usage(self, pid: str, usage: Usage) -> bool:
        """Count a model call made outside the runner's transactions (a title, the memories a
        reset keeps) in the process's usage totals: added to the stored ones in a transaction of
        its own (``Store.add_usage``: an increment, so a run ending meanwhile, here or on another
        worker, loses nothing and takes nothing away), then to this worker's cached record, if it
        holds the same one still (a record loaded meanwhile read the sum). No run is counted;
        nothing is written for a call that spent nothing. False when the process is gone. The
        cache follows when the increment is durable (``settled``), even if this task is cancelled
        while its group commits: the increment is kept all the same."""
        added = UsageTotals.of_call(usage)
        if added == UsageTotals():
            return True
        scope = self.store.transaction()  # (``Store.add_usage``, with the cache told at the commit)
        await scope.begin()
        live = self._live.get(pid)  # (once the store is ours: a record loaded later reads the sum)
        try:
            await self.store.update_process(pid, usage_added=added)
        except BaseException as exc:
            scope.end(commit=False)
            if isinstance(exc, NoSuchProcess):
                return False
            raise

        def settled(error: BaseException | None) -> None:
            if error is None and live is not None and self._live.get(pid) is live:
                live.record.usage = live.record.usage + added

        pending = scope.end(commit=True, settled=settled)
        if pending is None:
            settled(None)
        else:
            await pending
        return True

    # -- leases (see lease.py) --------------------------------------------------------------------

    def cached(self, pid: str) -> _Live | None:
        return self._live.get(pid)

    def uncache(self, pid: str) -> None:
        """Forget what this worker knows of a process (it lost or let go of the lease, or just
        claimed it; or ``evict`` dropped it): its tasks stop, waiters look again, the next use
        reloads it."""
        live = self._live.get(pid)
        self._compiled.pop(pid, None)  # a reloaded run keeps its stored prompt, or builds (and logs) it anew
        if live is not None:
            self._drop(live)
            live.lost = True
            live.idle.set()

    def evict(self) -> int:
        """Drop the caches of the least recently used processes while more than ``cache_limit``
        are cached, as ``uncache`` drops them: the next use loads the process again from the
        store, and its watchers' streams go on (signals reach them through the hub, by pid).
        Returns how many were dropped.

        Only a process at rest goes (``_at_rest``: no run, nothing working or waiting for it),
        and only when nothing but this cache refers to its ``_Live``: no task holds it in the
        middle of an operation (a send that looked it up and waits to begin its transaction,
        ``wait_idle``, a transaction waiting for its group commit: its reference count says so),
        so nothing can act on the dropped copy, and whoever wants the process next loads it
        afresh. (Frames a caught exception left in a reference cycle count too, until the
        collector frees them.) A process in use is passed over (moved last); at most
        ``EVICTION_SKIPS`` of them per call, so a cache of busy processes stays above the bound
        until they rest (a run's end evicts again: ``_rested``). On a shared store nothing is
        evicted: a worker lets go of (and uncaches) each process it holds once it is idle
        (``Leases.idle``)."""
        cache = self._live
        if self.leases is not None or self.closing:
            return 0
        probe = object()
        unheld = sys.getrefcount(probe)  # a local nothing else refers to (the count differs by version)
        now = asyncio.get_running_loop().time()
        dropped = skipped = 0
        while len(cache) > self.cache_limit and skipped < EVICTION_SKIPS:
            pid, live = cache.popitem(last=False)  # the least recently used
            if live.driver is not None and live.driver.done():
                live.driver = None  # (a driver ended by an error or an abort keeps frames that refer to it)
            idle = self._at_rest(live, now) and sys.getrefcount(live) <= unheld
            cache[pid] = live  # back, as the most recently used
            if idle:
                self.uncache(pid)  # (the path of a lease let go of)
                dropped += 1
            else:
                skipped += 1
        return dropped

    def _at_rest(self, live: _Live, now: float) -> bool:
        """No run, and nothing working or waiting for the process: no driver, tool, abort,
        promotion, timer still to fire (``now``: the loop's time), nested call waiting for a
        person, queued input, background work, nor a reset or compaction holding it."""
        pid = live.record.pid
        return (
            live.record.current_run is None
            and live.idle.is_set()
            and (live.driver is None or live.driver.done())
            and not live.tools
            and not live.stopping
            and not live.promoting
            and not live.asking
            and not live.queued
            and not _armed(live.deadline, now)
            and not _armed(live.ask_timer, now)
            and not _armed(live.retry_timer, now)
            and not live.spending.locked()
            and not live.remote
            and not live.lost
            and pid not in self._background
            and pid not in self._compiled
            and pid not in self.clearing
            and pid not in self.compacting
            and pid not in self.discarding
        )

    def _rested(self, live: _Live) -> None:
        """A step that leaves the process idle is durable (``_Tx.settled``): it is the most
        recently used now, and processes an earlier eviction passed over while their runs went on
        may be evicted now."""
        pid = live.record.pid
        if self._live.get(pid) is live:
            self._live.move_to_end(pid)
        if len(self._live) > self.cache_limit:
            self.evict()

    async def promote(self, live: _Live) -> None:
        await admission.promote(self, live)

    def _lost(self, live: _Live) -> None:
        """A group commit failed, so the store lacks a step this cache already holds. Treat it as
        a crash of this one process: drop the cache, stop its tasks, resume from the store."""
        pid = live.record.pid
        if self._live.get(pid) is not live:
            return  # dropped already (another step of the same group)
        self.uncache(pid)  # waiters look again, and find the reloaded process
        task = asyncio.get_running_loop().create_task(self._reload(pid))
        self._reloading.add(task)
        task.add_done_callback(self._reloading.discard)

    async def _reload(self, pid: str) -> None:
        if self.leases is not None and pid not in self.leases.held:
            return  # another worker has it now
        try:
            record = await self.store.get_process(pid)
            if record is not None:
                await self.resume(record)
        except Exception:
            log.exception("process %s: could not resume after a failed commit", pid)

    # -- input (see admission.py) -----------------------------------------------------------------

    async def send(
        self,
        pid: str,
        message: Message,
        *,
        mode: SendMode = "steer",
        run_id: str | None = None,
        output: dict[str, Any] | None = None,
        expected_run_id: str | None = None,
    ) -> Receipt:
        """Deliver user input: start a run, or queue it for the active one (see the module doc).
        ``output``: the row the answering run's output is kept in (``admission.output_key``); such
        input never joins a run under way. ``expected_run_id``: only while that run is current."""
        return await _retried(
            lambda: admission.send(
                self, pid, message, mode=mode, run_id=run_id, output=output, expected_run_id=expected_run_id
            )
        )

    async def retry(self, pid: str, *, run_id: str | None = None) -> Receipt:
        """Run the model again on the history, with no new input, where the last run ended without
        an answer (failed, aborted, cut at the output limit): see ``admission.retry``."""
        return await _retried(lambda: admission.retry(self, pid, run_id=run_id))

    async def withdraw(self, pid: str, item_id: int | None = None, kind: QueueKind | None = None) -> list[QueueItem]:
        """Take waiting input out of the queue before it runs (see ``admission.withdraw``)."""
        return await _retried(lambda: admission.withdraw(self, pid, item_id, kind))

    # -- background work (see ``ToolContext.background``) -----------------------------------------

    def has_background(self, pid: str) -> bool:
        """Whether background work of the process runs on this worker."""
        return pid in self._background

    def start_background(
        self, pid: str, work: Coroutine[Any, Any, str], label: str, *, call: CallKey | None = None
    ) -> None:
        """Own ``work`` a tool of ``pid`` started to outlive its call, and deliver what it returns
        as a system event (``background.finished``). At most ``MAX_BACKGROUND`` per process
        (``BackgroundRefused``); stopped by a reset or kill of the process and by ``close``. Not
        resumed after a restart, but recorded while it runs (``background.py``): the runtime that
        opens the store next tells the model it did not finish, and stops a command a crash left
        running. Refused while the process is being reset or killed, or the runtime closes: a tool
        of the run being cleared may get here after the clearing stopped the work, and what it
        started would then report to the fresh conversation (or run on with nobody to tell)."""
        jobs = self._background.setdefault(pid, set())
        refusal = None
        if pid in self.clearing or self.closing:
            refusal = "this process is being reset or stopped"
        elif len(jobs) >= MAX_BACKGROUND:
            refusal = f"this process already runs {len(jobs)} background jobs (at most {MAX_BACKGROUND})"
        if refusal is not None:
            if not jobs:
                del self._background[pid]
            work.close()
            raise BackgroundRefused(refusal)
        task = asyncio.get_running_loop().create_task(self._deliver_background(pid, work, label, call), name=label)
        jobs.add(task)
        if call is not None:  # (``call``: the tool call that started it, which a rewind may take out)
            self._started_by[task] = call

        def ended(task: asyncio.Task[None]) -> None:
            work.close()  # (work cancelled before it began was never awaited: no warning for it)
            jobs.discard(task)
            self._started_by.pop(task, None)
            if not jobs and self._background.get(pid) is jobs:
                del self._background[pid]  # (no empty set kept for every process that ever had one)

        task.add_done_callback(ended)

    async def _deliver_background(
        self, pid: str, work: Coroutine[Any, Any, str], label: str, call: CallKey | None
    ) -> None:
        """Record the job, run it, deliver its end. Cancelled by a reset, a kill, a stop with its
        parent's run or a rewind that took out its call, it leaves no record (nobody to tell); by
        ``close``, it leaves its record for the next runtime to report."""
        job = new_id()
        try:
            kept = await self._keep_job(pid, job, label, call)
            text = await self._run_job(pid, job if kept else None, work, label)
            await self._tell_end(pid, job if kept else None, text, label)
        except asyncio.CancelledError:
            if not self.closing:
                await self._forget_job(pid, job)
            raise

    async def _keep_job(self, pid: str, job: str, label: str, call: CallKey | None) -> bool:
        """Record the job before it begins; False if the store failed (it runs all the same, as
        it would have before records existed: only a restart would not know of it)."""
        try:
            live = self._live.get(pid)
            record = live.record if live is not None else await self.store.get_process(pid)
            if record is None:
                raise NoSuchProcess(pid)
            async with self.store.transaction():
                generation = record.history_generation
                await background.record_job(self.store, pid, job, label, generation=generation, call=call)
        except Exception as exc:
            log.warning("process %s: %s is not recorded, so a restart will not report it: %s", pid, label, exc)
            return False
        return True

    async def _run_job(self, pid: str, job: str | None, work: Coroutine[Any, Any, str], label: str) -> str:
        """The work's report, or what it failed of; the groups it starts go into record ``job``."""
        if job is not None:
            background_group.set(functools.partial(self._keep_group, pid, job))  # (this task's context only)
        try:
            return await work
        except Exception as exc:
            log.warning("process %s: %s failed: %s", pid, label, exc)
            return f"{label} failed: {type(exc).__name__}: {exc}"

    async def _keep_group(self, pid: str, job: str, pgid: int, mark: str) -> None:
        """``background_group`` of a job: the group its command runs as joins the job's record,
        for the runtime after a crash to stop. A failure to write it is logged; the command
        runs on (only a crash would then leave it behind)."""
        try:
            async with self.store.transaction():
                await background.record_group(self.store, pid, job, GroupIdentity.of(pgid, mark))
        except Exception as exc:
            log.warning("process %s: the process group %d of a background job is not recorded: %s", pid, pgid, exc)

    async def _tell_end(self, pid: str, job: str | None, text: str, label: str) -> None:
        """Deliver the job's end, removing its record in the same transaction (the removal is the
        claim: a record gone means a reset or kill ended the job's conversation meanwhile)."""
        try:
            if job is None:
                await self.signal_event(pid, text, reason=background.REASON)
                return

            async def claim() -> bool:
                return await background.drop_job(self.store, pid, job)

            await self.claimed_event(pid, text, claim=claim, run_id=new_id(), reason=background.REASON)
        except NoSuchProcess:
            pass  # killed meanwhile
        except Exception:
            log.exception("process %s: the end of %s could not be delivered", pid, label)

    async def _forget_job(self, pid: str, job: str) -> None:
        try:
            await background.forget_job(self.store, pid, job)
        except Exception as exc:  # (a restart finds it, and drops it if the conversation was reset)
            log.warning("process %s: the record of a stopped background job was not removed: %s", pid, exc)

    def stop_background(self, pid: str) -> None:
        """Stop the background work of ``pid`` (its reset or kill, a stop with its parent's run):
        cancelled, a command's process group is killed. Kept until it has ended, for ``close``."""
        self.jobs.drop(pid)
        for task in self._background.pop(pid, set()):
            self._stop_task(task)

    def stop_background_of(self, pid: str, calls: Collection[CallKey]) -> None:
        """Stop the background work of ``pid`` that the tool calls ``calls`` started, as
        ``stop_background`` stops it all: a rewind took those calls out (the rest goes on)."""
        self.jobs.forget_calls(pid, calls)
        for task in [t for t in self._background.get(pid, ()) if self._started_by.get(t) in calls]:
            self._stop_task(task)

    def _stop_task(self, task: asyncio.Task[None]) -> None:
        """Cancel background work (a command's process group is killed); kept until it has ended,
        for ``close`` to wait for."""
        task.cancel()
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def signal_event(
        self, pid: str, text: str, *, run_id: str | None = None, reason: str = "system.event"
    ) -> Receipt:
        """A system event (a watch, a schedule, finished background work): shown to the model as a
        system message, ahead of queued user input; starts a run when none is active, recorded in
        ``proc.run.started`` with ``reason``. A caller-supplied ``run_id`` makes the delivery
        idempotent, as with ``send``: a retry returns the first receipt and delivers nothing."""
        receipt = await _retried(lambda: admission.signal_event(self, pid, text, run_id=run_id, reason=reason))
        assert receipt is not None  # (only a claim can refuse a delivery)
        return receipt

    async def claimed_event(
        self,
        pid: str,
        text: str,
        *,
        claim: Callable[[], Awaitable[bool]],
        run_id: str,
        reason: str,
        generation: int | None = None,
    ) -> Receipt | None:
        """A system event delivered only if ``claim`` (a compare-and-set on the caller's own row,
        such as moving a schedule past its due time) succeeds inside the delivery's transaction;
        None when it does not. The event and the claim commit together or not at all, so
        several workers racing to deliver it deliver it once, and a crash between the two cannot
        happen: the claim is the delivery's idempotency, and no admission record is kept (one
        that exists for ``run_id`` is answered and dropped). ``run_id`` names the run it starts.
        ``generation``: the conversation of the process the event is for; one a reset has ended
        meanwhile gets nothing (the claim is kept: None), checked inside the transaction."""
        return await _retried(
            lambda: admission.signal_event(
                self, pid, text, run_id=run_id, reason=reason, claim=claim, generation=generation
            )
        )

    # -- mode --------------------------------------------------------------------------------------

    async def set_mode(self, pid: str, mode: Mode) -> None:
        """Chat or agent from the next run on: a chat run sees the same history but no tools."""
        mode = check_mode(mode)
        live = await self.live(pid)
        async with self._tx(live) as tx:
            if mode == "chat":
                await self.store.kv_set(pid, MODE_KEY, "chat")
            else:
                await self.store.kv_delete(pid, MODE_KEY)
            await tx.signal(sig.CHANGED, changes=["mode"])

    async def mode(self, pid: str) -> Mode:
        await self.live(pid)  # NoSuchProcess for an unknown or killed pid
        return "chat" if await self.store.kv_get(pid, MODE_KEY) == "chat" else "agent"

    async def set_model(self, pid: str, row: Mapping[str, Any] | None) -> None:
        """The process's own model choice from its next run on (None: its owner's again); the
        kernel checked it (``AccountModels.check``)."""
        live = await self.live(pid)
        async with self._tx(live) as tx:
            if row:
                await self.store.kv_set(pid, MODEL_KEY, dict(row))
            else:
                await self.store.kv_delete(pid, MODEL_KEY)
            await tx.signal(sig.CHANGED, changes=["model"])

    async def set_tools(self, pid: str, scope: list[str] | None) -> None:
        """The process's tool scope from its next run on (None: every tool); the kernel checked it
        (process/tool_scope.py)."""
        live = await self.live(pid)
        async with self._tx(live) as tx:
            if scope is not None:
                await self.store.kv_set(pid, TOOLS_KEY, list(scope))
            else:
                await self.store.kv_delete(pid, TOOLS_KEY)
            await tx.signal(sig.CHANGED, changes=["tools"])

    # -- approvals (see hil.py) -------------------------------------------------------------------

    async def hil(
        self,
        pid: str,
        request_id: str,
        decision: str,
        *,
        remember: bool | str = False,
        message: str | None = None,
        arguments: Mapping[str, Any] | None = None,
        by: str | None = None,
    ) -> bool:
        """Answer a pending approval. The decision applies to the exact call (and arguments) shown,
        or to the person's own ``arguments``; ``message`` (deny only) is what the model reads about why;
        ``by`` who answered."""
        return await _retried(
            lambda: hil.answer(
                self, pid, request_id, decision, remember=remember, message=message, arguments=arguments, by=by
            )
        )

    # -- driving (see driver.py, calls.py) --------------------------------------------------------

    def wake(self, pid: str) -> None:
        """Ask for another step; overlapping wake-ups coalesce into one driver."""
        live = self._live.get(pid)
        if live is None:
            return
        for waiter in live.asking:  # a program waiting for a person's answer looks whether it came
            waiter.set()
        live.dirty = True
        if live.stopping:
            return  # the abort that is stopping the run wakes the driver when it is done
        if live.driver is None or live.driver.done():
            live.driver = asyncio.create_task(drive(self, live), name=f"agentloop-process-{pid}")

    # -- ending runs ------------------------------------------------------------------------------

    async def stop(self, pid: str, run_id: str | None = None) -> bool:
        """Finish the active run gently: the answer and the tool calls under way complete, then the
        model answers once more without tools and the run ends with stop reason ``stopped``
        (``abort`` is the immediate stop). False when no such run is active (a stale ``run_id``).
        Kept with the run's record, so a restart in between still ends it so."""
        if self.leases is not None and not await self.leases.hold(pid):
            return await self.leases.forward_stop(pid, run_id)
        return await _retried(lambda: self._ask_to_stop(pid, run_id))

    async def _ask_to_stop(self, pid: str, run_id: str | None) -> bool:
        live = await self.live(pid)

        def active() -> dict[str, Any] | None:
            run = live.record.current_run
            return None if run is None or (run_id is not None and run["run_id"] != run_id) else run

        if active() is None:
            return False
        async with self._tx(live) as tx:
            # read again once the transaction has begun: a step (or an abort) that committed
            # while it began must not be overwritten by the record as it was before
            run = active()
            if run is None:
                return False
            if not run.get("stopping"):
                await tx.set_run({**run, "stopping": True})
        self.wake(pid)  # (a driver waiting on nothing takes its last round now)
        return True

    async def abort(self, pid: str, run_id: str | None = None, *, reason: str = "user") -> bool:
        """Stop the active run now. A stale ``run_id`` (not the active run) does nothing. Once
        begun, the abort completes even if its caller is cancelled meanwhile (stopped halfway, the
        run would be left with nothing driving it). The caller itself (a tool that interrupts or
        resets its own process) is spared: it finishes what it is doing, as before."""
        callers = own_tasks()  # (the tool's task, and the one waiting for it under its timeout)
        task = asyncio.get_running_loop().create_task(self._abort(pid, run_id, reason, callers), name=f"abort {pid}")
        self._aborting.add(task)
        task.add_done_callback(self._aborting.discard)
        task.add_done_callback(_aborted_alone)
        return await asyncio.shield(task)

    async def _abort(self, pid: str, run_id: str | None, reason: str, callers: frozenset[asyncio.Task[Any]]) -> bool:
        if self.leases is not None and not await self.leases.hold(pid):
            return await self.leases.forward_abort(pid, run_id, reason)
        live = await self.live(pid)
        run = live.record.current_run
        if run is None or (run_id is not None and run["run_id"] != run_id):
            return False
        with promoting(live):  # (from the run's end to its successor's start, for ``wait_idle``)
            live.stopping += 1  # nothing new may start for the run while it is being stopped (an approval)
            try:
                stopped = await self._stop(live, run["run_id"], reason, callers)
            finally:
                live.stopping -= 1
            if stopped:
                await self._tell_aborted(pid, run["run_id"], reason)
            if stopped and reason not in NEXT_RUN_DECIDED:
                await admission.promote(self, live)
        if live.dirty:
            self.wake(pid)  # a wake-up that came while the run was being stopped
        return stopped

    async def _tell_aborted(self, pid: str, run_id: str, reason: str) -> None:
        """Run the ``aborted`` hook. The run is over whatever the hook does, so its failure is
        logged, not raised: the abort itself succeeded and its caller must hear so."""
        if self.aborted is None:
            return
        try:
            await self.aborted(pid, run_id, reason)
        except Exception:
            log.exception("process %s: stopping what run %s started failed", pid, run_id)

    async def _stop(self, live: _Live, active: str, reason: str, callers: frozenset[asyncio.Task[Any]]) -> bool:
        """Cancel the run's model call and tools (but the ``callers``), then end it with a terminal
        result for every open call."""
        pid = live.record.pid
        partial = live.partial
        spared = {*callers, asyncio.current_task()}
        stopping = [
            t for t in [live.driver, *live.tools.values()] if t is not None and not t.done() and t not in spared
        ]
        for task in stopping:
            task.cancel()
        if stopping:  # let them unwind, for a while
            _, stuck = await asyncio.wait(stopping, timeout=ABORT_GRACE)
            for task in stuck:
                log.warning("process %s: %s ignored its cancellation; the run ends without it", pid, task.get_name())
        run = live.record.current_run
        if run is None or run["run_id"] != active:
            return False  # it finished on its own meanwhile
        rows = await self.store.calls(pid, active)
        async with self._tx(live) as tx:
            # read again once the transaction has begun: another abort of the run may have ended it
            # while this one read its calls (two ends would give each call two cancelled results)
            run = live.record.current_run
            if run is None or run["run_id"] != active:
                return False
            queued: int | None = None  # (the cache's count, unless the abort drops the queue)
            if reason in DISCARDS_QUEUE:
                queued = await self._discard_queue(tx, live)
            added: list[Message] = []
            if partial is not None and partial.partial is not None:
                msg = partial.partial
                msg.content = [b for b in msg.content if not isinstance(b, ToolCall)]
                msg.stop_reason, msg.error_message = "aborted", "aborted"
                added.append(msg)
            added.extend(results_of(rows, CANCELLED))
            for row in rows:  # each call that started ends, for whoever shows it running
                if row.status == "dispatched":
                    await signal_finished(tx, row, CANCELLED, error=True)
            questions = await self.store.hils(pid)
            for h in questions:
                await self.store.delete_hil(h.request_id)
            await end_batch(self, tx, live, active)
            await tx.append(active, added)
            if added or questions:
                await tx.signal(sig.CHANGED, changes=["messages", "hil"] if questions else ["messages"])
            await hil.forget_decisions(self.store, pid, active)
            if self.aborted is not None:
                await self.store.kv_set(pid, LAST_ABORT_KEY, {"run_id": active, "at": time.time()})
            await forget_output(self, live, active)
            await tx.end_run(run)
            await signal_run_finished(tx, live, run, "aborted", reason, queued=queued)
        return True

    async def forget(self, pid: str) -> None:
        """Drop the in-memory state of a process (after kill); its watchers' streams end."""
        self.uncache(pid)  # (its waiters look again, and learn it is gone)
        if self.leases is not None:
            self.leases.lost(pid)
        self.hub.close(pid)

    def _drop(self, live: _Live) -> None:
        """Forget a process's cache and stop everything working for it (but the calling task)."""
        del self._live[live.record.pid]
        disarm(live)
        if live.tools or (live.driver is not None and not live.driver.done()):  # (none at rest: ``evict``)
            mine = own_tasks()
            for task in [*live.tools.values(), live.driver]:
                if task is not None and not task.done() and task not in mine:
                    task.cancel()

    async def wait_idle(self, pid: str) -> None:
        """Return when no run is active and nothing is working for the process. ``StoreError``
        when the runtime closes first with a run under way: nothing here drives it any more (it
        resumes where the store is opened next), and the caller would otherwise wait for ever."""
        live = await self.live(pid)
        while True:
            if live.remote:
                assert self.leases is not None
                await self.leases.wait_idle(pid)
                return
            if self.closing:
                _check_settled(live)
                return
            if live.lost:  # dropped after a failed commit: follow the reloaded process
                live = await self.live(pid)
            elif not live.idle.is_set():  # a run is active, or the step that ended it is not durable yet
                await live.idle.wait()
            elif live.record.current_run is not None:
                await asyncio.sleep(0)  # a run starting in this very step: its flag is cleared as it returns
            elif live.driver is not None and not live.driver.done():
                await asyncio.wait([live.driver])
            elif any(t is not asyncio.current_task() for t in live.promoting):
                await live.promoted.wait()  # the queued input a run's end leaves may start a run now
            elif live.queued and pid in self.clearing:
                await admission.after_clearing(self, pid)  # queued input waits for a reset or compaction
            else:
                return

    async def close(self) -> None:
        self.closing = True  # the tools cancelled below are stopped by a shutdown, not an abort
        tasks: list[asyncio.Task[Any]] = [*self._reloading, *self._aborting, *self._deferred]
        tasks += [*self._ending, *(t for jobs in self._background.values() for t in jobs)]
        tasks += [t for live in self._live.values() for t in [*live.tools.values(), live.driver] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.leases is not None:
            await self.leases.stop()
        for pid, live in self._live.items():
            self.hub.close(pid)  # followers' streams end instead of waiting forever
            live.idle.set()  # and so do the callers of ``wait_idle`` (told the run was left unfinished)
        for pid in list(self.hub._watchers):  # (those of processes evicted from the cache too)
            self.hub.close(pid)
        self.hub.close_accounts()
        self._live.clear()
        for hook in list(self.closed_hooks):  # (tracing ends the spans of the runs cut short)
            try:
                hook()
            except Exception:
                log.exception("a hook of the engine's close failed")
