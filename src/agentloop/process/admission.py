"""Input admission: user input and system events reach a process here. Each delivery either starts
a run or waits in the queue (``steer`` items and system events join the active run, ``queue``
items wait for the next one; an ``interrupt`` stops the run first; a ``reject`` is refused while
a run is under way); a caller-supplied run id makes a delivery idempotent, and an expected run id
makes it conditional on that run (``check_admission``). When a run ends, queued input becomes the
next run (``promote``). A run that ended without answering its input can be run again on the
history as it stands, with no new input (``retry``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from agentloop.loop.hooks import Handled
from agentloop.loop.state import CallModel, decide
from agentloop.messages import AssistantMessage, Message, SystemMessage, ToolResultMessage, UserMessage, system
from agentloop.process import signals as sig
from agentloop.process.api import Receipt, RunActive, RunNotCurrent, SendMode, new_id
from agentloop.process.pressure import forget_context
from agentloop.process.store import MAX_SEQ, NoSuchProcess, QueueItem, SegmentRow
from agentloop.process.store.base import QueueKind
from agentloop.process.tx import _Live, _new_run, promoting

if TYPE_CHECKING:
    from agentloop.process.engine import ProcessEngine

T = TypeVar("T")


async def after_clearing(engine: ProcessEngine, pid: str) -> None:
    """Wait out a reset or kill of the process under way: input that arrived meanwhile goes to the
    conversation that follows it (or, after a kill, finds no process), never to the one being
    cleared, where it would be lost or start a run the clearing does not know of. A compaction
    asked for holds the process too: input waits for the summary, and runs on it."""
    if pid in engine.clearing:
        async with engine.clearing.hold(pid):
            pass


# kv row of a run whose answer must be a value (``send(..., output=...)``): ``output_key(run_id)``
# holds {"schema": <JSON Schema>, "retries": n}, written with the input, for the run its receipt
# names; the run's configuration reads it with its other rows (one query), so it is the same after
# a restart, and the end of the run (or the withdrawal of the input) deletes it
OUTPUT_PREFIX = "run:output:"


def output_key(run_id: str) -> str:
    return OUTPUT_PREFIX + run_id


async def keep_output(engine: ProcessEngine, pid: str, run_id: str, output: dict[str, Any] | None) -> None:
    """Inside the delivery's transaction: the output the run ``run_id`` must give, if any."""
    if output is not None:
        await engine.store.kv_set(pid, output_key(run_id), output)


# kv row of the last run that was asked for an output and ended without answering (failed, aborted,
# cut at the output limit): {"run": <its id>, "output": <its ``output_key`` row>}, written as that
# run ends (``driver.forget_output``), so that ``retry`` asks the retried run for the same output.
# Matched by run id: the row of an older run, left over, never reaches a run it does not belong to.
RETRY_OUTPUT_KEY = "retry:output"


async def keep_for_retry(engine: ProcessEngine, pid: str, run_id: str) -> None:
    """Inside the transaction that ends run ``run_id`` without an answer: its output row, if it had
    one, is kept for a retry (the row itself goes with the run, as for any run)."""
    output = await engine.store.kv_get(pid, output_key(run_id))
    if isinstance(output, dict):
        await engine.store.kv_set(pid, RETRY_OUTPUT_KEY, {"run": run_id, "output": output})


async def _carry_output(engine: ProcessEngine, pid: str, failed_run: str | None, run_id: str) -> None:
    """Inside the retry's transaction: the run ``run_id`` retries ``failed_run``, and must give the
    output that run was asked for (if any: ``keep_for_retry``)."""
    kept = await engine.store.kv_get(pid, RETRY_OUTPUT_KEY)
    if isinstance(kept, dict) and failed_run is not None and kept.get("run") == failed_run:
        await keep_output(engine, pid, run_id, kept.get("output"))
        await engine.store.kv_delete(pid, RETRY_OUTPUT_KEY)


async def send(
    engine: ProcessEngine,
    pid: str,
    message: Message,
    *,
    mode: SendMode,
    run_id: str | None,
    output: dict[str, Any] | None = None,
    expected_run_id: str | None = None,
) -> Receipt:
    """Deliver user input. With ``output`` (the row ``output_key`` keeps), the input never joins a
    run under way (a run has one output): a ``steer`` waits as ``queue`` input for a run of its own.

    ``mode="reject"`` delivers only to an idle process (its input starts a run); ``RunActive``
    otherwise. ``expected_run_id`` delivers only while that run is the current one
    (``RunNotCurrent`` otherwise): a ``steer`` joins it, a ``queue`` waits for the run after it,
    an ``interrupt`` stops it (only it: its abort is the check) and starts the next run. Either
    refusal is decided with the admission, in its transaction, and delivers, queues and aborts
    nothing; a retry of a delivery admitted already (its ``run_id``) gets its receipt first.

    The input hooks (``Hooks.admit``) see ``message`` first, before anything is written or
    aborted: see ``_hooked``."""
    check_send(mode, expected_run_id)
    if engine.config.hooks.inputs:
        hooked = await _hooked(engine, pid, message, mode, run_id)
        if isinstance(hooked, Receipt):
            return hooked
        message = hooked
    return await _past_clearings(
        lambda: _send_once(engine, pid, message, mode=mode, run_id=run_id, output=output, expected=expected_run_id)
    )


async def _hooked(
    engine: ProcessEngine, pid: str, message: Message, mode: SendMode, run_id: str | None
) -> Message | Receipt:
    """``message`` as the input hooks admit it, or the receipt to answer at once: that of a retry
    of a delivery admitted already (its hooks ran then: their side effects are not repeated), or
    a ``handled`` one. Outside the admission's transaction, so a hook that fails (or times out:
    ``InputRejected``) rejects the send with nothing written. Not remembered: a retry of a send
    the hooks handled runs them again (``InputInfo.run_id`` lets a hook tell), and two twins of
    one id sent at once may both run them before the transaction admits one."""
    await engine.live(pid)  # (NoSuchProcess first: a hook's side effects for no process at all)
    seen = await admitted(engine, pid, run_id)
    if seen is not None:
        return seen
    if not isinstance(message, UserMessage):
        return message
    out = await engine.config.hooks.admit(message, mode=mode, source="process.send", run_id=run_id, conversation=pid)
    if isinstance(out, Handled):
        return Receipt(run_id or "", False, 0, handled=True)
    return out


def check_send(mode: object, expected_run_id: str | None) -> None:
    """``ValueError`` unless ``mode`` is a ``SendMode`` that goes with ``expected_run_id``."""
    if mode not in ("steer", "queue", "interrupt", "reject"):
        raise ValueError(f"mode must be steer, queue, interrupt or reject, got {mode!r}")
    if expected_run_id is not None and mode == "reject":
        raise ValueError("expected_run_id names a run under way and mode reject wants none: pass one or the other")


def check_admission(pid: str, mode: SendMode, expected_run_id: str | None, active: dict[str, Any] | None) -> None:
    """Refuse a delivery whose condition the process's ``active`` run fails: ``RunActive`` for a
    ``reject`` while a run is under way, ``RunNotCurrent`` when ``expected_run_id`` is not that
    run. A steer that named a run which ended meanwhile would otherwise start a run of its own,
    answering words written for another; two clients racing to start one would both succeed."""
    current = active["run_id"] if active is not None else None
    if mode == "reject" and current is not None:
        raise RunActive(pid, "a send with mode reject", current)
    if expected_run_id is not None and expected_run_id != current:
        raise RunNotCurrent(pid, expected_run_id, current)


class _ClearingBegan(Exception):
    """A reset or kill of the process began while a delivery was on its way to starting a run."""


async def _past_clearings(attempt: Callable[[], Awaitable[T]]) -> T:
    """``attempt()``, made again each time it met a reset, kill or compaction that began on its
    way (``_ClearingBegan``: its transaction wrote nothing); the next try waits that one out."""
    while True:
        try:
            return await attempt()
        except _ClearingBegan:
            continue


def _check_not_clearing(engine: ProcessEngine, pid: str) -> None:
    """Inside a delivery's transaction, before it starts a run: a reset or kill that began since
    the delivery waited out the last one (during an interrupt's abort, say) may have looked for
    the run to stop already, and a run started now would outlive it, its tool results landing
    in the fresh history with no call before them (a compaction: it would summarise the history
    under the run). The delivery starts over instead. A clearing that begins after this check
    waits for the transaction to end before it looks (``ProcessEngine.settle_deliveries``)."""
    if _clearing(engine, pid):
        raise _ClearingBegan(pid)


def _clearing(engine: ProcessEngine, pid: str) -> bool:
    """Whether a reset, kill or compaction holds the process now (``clearing`` counts the
    input waiting for one too, so it is not the test)."""
    return pid in engine.discarding or pid in engine.compacting


async def _send_once(
    engine: ProcessEngine,
    pid: str,
    message: Message,
    *,
    mode: SendMode,
    run_id: str | None,
    output: dict[str, Any] | None,
    expected: str | None = None,
) -> Receipt:
    """One try of ``send``: ``_ClearingBegan`` when a clearing came in between (see there). An
    interrupt's ``expected`` run is checked by its abort, which stops that run only if it is
    still the current one; the input then follows as a plain interrupt's does."""
    await after_clearing(engine, pid)
    if engine.leases is not None and not await engine.leases.hold(pid) and mode == "interrupt":
        seen = await admitted(engine, pid, run_id)  # a retried interrupt must abort nothing
        if seen is not None:
            return seen
        # the holder stops the run (only the expected one) …
        if not await engine.leases.forward_abort(pid, expected, "user.interrupt") and expected is not None:
            record = await engine.store.get_process(pid)  # (False: it was not current, or took too long)
            check_admission(pid, mode, expected, record.current_run if record is not None else None)
        expected = None
        mode = "steer" if await engine.leases.hold(pid) else "queue"  # … and runs this next
    live = await engine.live(pid)
    seen = await admitted(engine, pid, run_id)  # early too: a retried interrupt must abort nothing
    if seen is not None:
        return seen
    if mode == "interrupt" and expected is not None:
        if not await engine.abort(pid, expected, reason="user.interrupt"):
            check_admission(pid, mode, expected, live.record.current_run)  # (not the current run: nothing stopped)
        expected = None
    elif live.record.current_run is not None and mode == "interrupt":
        await engine.abort(pid, reason="user.interrupt")
    async with engine._tx(live) as tx:
        # checked again inside the transaction: two deliveries of one id cannot both pass
        await exclude_twin(engine, pid, run_id)
        seen = await admitted(engine, pid, run_id)
        if seen is not None:
            return seen
        # decided inside the transaction: the run seen here cannot end before this commits
        active = live.record.current_run
        if live.remote and (expected is not None or mode == "reject"):
            active = await _run_held_elsewhere(engine, pid)
        if mode == "reject" and active is None:  # (idle, unless input waits to start the next run)
            active = await _run_waiting(engine, pid, lock=engine.leases is not None and not live.remote)
        check_admission(pid, mode, expected, active)
        if active is None and not live.remote:
            _check_not_clearing(engine, pid)
            receipt = Receipt(await tx.start_run(message, "proc.send", run_id), False, 0)
        elif active is None:  # the worker holding the process starts the run, with this id
            receipt = Receipt(run_id or new_id(), False, 0)
            await tx.enqueue("queue", message, receipt.run_id, reason="proc.send")
        else:
            queued_run = run_id or new_id()
            steer = mode == "steer" and output is None
            receipt_run = active["run_id"] if steer else queued_run  # steer joins the active run
            receipt = Receipt(receipt_run, True, live.queued + 1)
            await tx.enqueue("steer" if steer else "queue", message, queued_run)
        await keep_output(engine, pid, receipt.run_id, output)
        await remember_admission(engine, pid, receipt.run_id, run_id, queued=receipt.queued, position=receipt.position)
    if not receipt.queued or _waiting_out_an_outage(active):
        engine.wake(pid)
    return receipt


async def _run_held_elsewhere(engine: ProcessEngine, pid: str) -> dict[str, Any] | None:
    """The run of a process another worker holds, as the store has it now. Inside a delivery's
    transaction the process's row is locked first (as ``_same_conversation`` locks it), so a run
    the holder starts or ends meanwhile commits after this delivery instead of under its check."""
    await engine.store.update_process(pid)  # (the row lock; NoSuchProcess once it was killed)
    record = await engine.store.get_process(pid)
    if record is None or record.state == "killed":
        raise NoSuchProcess(pid)
    return record.current_run


async def _run_waiting(engine: ProcessEngine, pid: str, *, lock: bool) -> dict[str, Any] | None:
    """For a ``reject`` to a process with no run: the run its queued input starts next, if any
    waits (input another worker queued for the holder to start, or a queue not promoted yet),
    as ``{"run_id": ...}``: that process is not idle, and a reject admitted now would run
    ahead of that input or after it, two callers each told they started the one run. With
    ``lock`` (the holder, on a shared store) the process's row is locked first, as
    ``_run_held_elsewhere`` locks it, so a delivery another worker queues meanwhile commits
    before this look or waits for this delivery's commit (and then finds its run)."""
    if lock:
        await engine.store.update_process(pid)
    queue = await engine.store.queue(pid)
    if not queue:
        return None
    first = next((q for q in queue if q.kind == "system"), queue[0])  # (what ``promote`` starts)
    return {"run_id": first.run_id}


def _waiting_out_an_outage(run: dict[str, Any] | None) -> bool:
    """Whether ``run`` waits for its next try at a provider that was down: input that joins it
    (a steer, a system event) wakes it to try again at once, not at the planned time."""
    return run is not None and run.get("retry_at") is not None


async def forget_admission(engine: ProcessEngine, pid: str, run_id: str) -> None:
    """Drop the record that makes a delivery with this caller-supplied ``run_id`` idempotent,
    inside the caller's transaction, once no one can retry it: a claimed delivery (a schedule's,
    a watch's) answers an old record for its id once and then retires it."""
    await engine.store.kv_delete(pid, f"admitted:{run_id}")


async def exclude_twin(engine: ProcessEngine, pid: str, run_id: str | None) -> None:
    """Inside a delivery's transaction, before its duplicate check: hold its ``run_id`` until the
    commit. A transaction excludes the others of its own worker, but two workers delivering one id
    at once (a retry through another worker: one as the holder, one forwarding) would each find no
    record and each deliver; the second now waits for the first's commit and finds its record."""
    if run_id is not None:
        await engine.store.exclusive(f"admission of {run_id} to {pid}")


async def admitted(engine: ProcessEngine, pid: str, run_id: str | None) -> Receipt | None:
    """The receipt of an earlier delivery with this caller-supplied ``run_id``, if there was one."""
    seen = await engine.store.kv_get(pid, f"admitted:{run_id}") if run_id is not None else None
    if seen is None:
        return None
    return Receipt(seen.get("run", run_id), bool(seen.get("queued")), int(seen.get("position", 0)))


async def remember_admission(
    engine: ProcessEngine, pid: str, run_id: str, supplied: str | None, *, queued: bool, position: int
) -> None:
    """Inside the caller's transaction: the delivery with the caller's ``supplied`` id (if any)
    got this receipt, which a retry of it returns."""
    if supplied is not None:
        await engine.store.kv_set(pid, f"admitted:{supplied}", {"run": run_id, "queued": queued, "position": position})


async def signal_event(
    engine: ProcessEngine,
    pid: str,
    text: str,
    *,
    run_id: str | None,
    reason: str,
    claim: Callable[[], Awaitable[bool]] | None = None,
    generation: int | None = None,
) -> Receipt | None:
    """Deliver a system event. With ``claim`` (see ``ProcessEngine.claimed_event``) the claim runs
    first inside the delivery's transaction; None, and nothing delivered, when it fails. A
    reset, kill or compaction that begins on the way is waited out as ``send`` waits it out: the
    delivery (and its claim, rolled back with it) is tried again once it is over. ``generation``
    (with ``claim``): the event belongs to that conversation of the process; if a reset ended it
    meanwhile, the claim is kept and nothing is delivered (None), decided inside the transaction.
    ``generation`` without ``claim`` is a ValueError, not ignored (the event would reach the fresh
    conversation a reset made): a claim-less delivery always answers a receipt
    (``ProcessEngine.signal_event``: only a claim can refuse one), and a refused event's source
    must be told it is settled, which is what its claim, committed with the check, does."""
    if generation is not None and claim is None:  # (ignored, it would deliver to a conversation a reset ended)
        raise ValueError("generation is checked only with a claim: pass claim= (ProcessEngine.claimed_event)")
    return await _past_clearings(
        lambda: _signal_once(engine, pid, text, run_id=run_id, reason=reason, claim=claim, generation=generation)
    )


async def _signal_once(
    engine: ProcessEngine,
    pid: str,
    text: str,
    *,
    run_id: str | None,
    reason: str,
    claim: Callable[[], Awaitable[bool]] | None,
    generation: int | None = None,
) -> Receipt | None:
    """One try of ``signal_event``: ``_ClearingBegan`` when a clearing came in between."""
    await after_clearing(engine, pid)
    if engine.leases is not None:
        await engine.leases.hold(pid)  # or, held elsewhere, the event waits in the queue for its holder
    live = await engine.live(pid)
    message = system(text, "event")
    async with engine._tx(live) as tx:
        if claim is not None:
            if not await claim():
                return None  # delivered by another worker (or its source moved on): nothing to do
            if generation is not None and not await _same_conversation(engine, live, generation):
                return None  # claimed (committed): owed to a conversation a reset has ended since
            # a record left by a delivery that was not claimed (made before claims existed, or
            # by hand with the same id): that delivery stands, and the claim retires its record
            seen = await admitted(engine, pid, run_id)
            if seen is not None and run_id is not None:
                await forget_admission(engine, pid, run_id)
                return seen
            run_id_kept, run_id = run_id, None  # the claim is the idempotency: no record to keep
        else:
            # checked inside the transaction: two deliveries of one id cannot both pass
            await exclude_twin(engine, pid, run_id)
            seen = await admitted(engine, pid, run_id)
            if seen is not None:
                return seen
            run_id_kept = run_id
        active = live.record.current_run
        if active is None and not live.remote:
            _check_not_clearing(engine, pid)
            receipt = Receipt(await tx.start_run(message, reason, run_id_kept), False)
        elif active is None:
            receipt = Receipt(run_id_kept or new_id(), False)
            await tx.enqueue("system", message, receipt.run_id, reason=reason)
        else:
            await tx.enqueue("system", message, run_id_kept)
            receipt = Receipt(active["run_id"], True, 0)
        await remember_admission(engine, pid, receipt.run_id, run_id, queued=receipt.queued, position=0)
    if not receipt.queued or _waiting_out_an_outage(active):
        engine.wake(pid)
    return receipt


# the run ids of system events that belong to the conversation they were delivered to (delivered
# with ``generation``: a delegate's reply) end so; a reset drops them from the queue even when
# another worker queued them while it was under way (``bound_to_conversation``)
BOUND_SUFFIX = ":reply"


def bound_to_conversation(item: QueueItem) -> bool:
    """Whether the queued ``item`` is a system event bound to the conversation it was delivered
    to (see ``BOUND_SUFFIX``): a reset of the process discards it whenever it was queued."""
    return item.kind == "system" and (item.run_id or "").endswith(BOUND_SUFFIX)


async def _same_conversation(engine: ProcessEngine, live: _Live, generation: int) -> bool:
    """Inside a delivery's transaction: whether the process still holds conversation
    ``generation``. A reset or kill under way (the deliveries it waits for are discarded with
    its queue, or would reach the fresh conversation) is waited out first (``_ClearingBegan``).

    Held by another worker, the process's reset is not seen here until it commits, so the check
    and the delivery are made atomic with it through the store: the process's row is locked
    first (``update_process`` with no fields: ``FOR UPDATE``), and a reset bumps the generation
    in that row (``new_generation``) before it reads the queue to discard. A reset that bumped
    it first is waited for, and its generation is read here once it committed; one that comes
    after waits for this delivery's commit, and then finds its item in the queue. An item queued
    while the reset was under way but before its transaction (its archive being written) is
    kept by the reset as input for the fresh conversation unless it is bound to the old one
    (``bound_to_conversation``): such events carry run ids ending with ``BOUND_SUFFIX``. The
    lock is on this path only (system events bound to a conversation, delivered to a process
    held elsewhere), never on a send's or a step's."""
    pid = live.record.pid
    if pid in engine.discarding:
        raise _ClearingBegan(pid)
    if not live.remote:  # (this worker's cache: a reset here updates it as its commit ends)
        return live.record.history_generation == generation
    try:
        await engine.store.update_process(pid)  # (the row lock: see above)
    except NoSuchProcess:
        return False
    record = await engine.store.get_process(pid)  # (read after the lock: a reset's commit is seen)
    return record is not None and record.state != "killed" and record.history_generation == generation


class NothingToRetry(ValueError):
    """A retry of a process whose conversation ended with an answer (or has none yet): no input
    waits for the model, so there is nothing to run again. Nothing was done; send input instead."""

    def __init__(self, pid: str) -> None:
        super().__init__(f"nothing to retry: the last run of process {pid} finished (send a message to go on)")
        self.pid = pid


FAILURE_KIND = "error"  # the kind of the notice a failed run ends with (``driver._finish``)
UNFINISHED = ("error", "aborted", "length")  # stop reasons of a model turn that did not answer


def _failed_turn(message: Message) -> bool:
    """Whether ``message`` is part of how a run failed to answer: the runtime's failure notice, or
    a model turn that failed (its partial output is never sent to a model: ``clean_history``), was
    cut off by an abort or ended at the output limit (a truncated answer, not the answer)."""
    if isinstance(message, SystemMessage):
        return message.kind == FAILURE_KIND
    return isinstance(message, AssistantMessage) and message.stop_reason in UNFINISHED


NOTE_KIND = "event"  # the kind of a note (``Kernel.note``): a fact recorded after a run, asking no answer


def notes_end(history: list[Message]) -> int:
    """Where the notes that close ``history`` begin (``len(history)`` when it ends with none): the
    system events a retry looks past to the failed run's end. ``Kernel.note`` records them while
    idle, after a run ended (an undelivered answer's note among them); a system event that was a
    failed run's last input, with no failed turn after it, is looked past the same way (it stays,
    and the retried run reads it, as it was to)."""
    end = len(history)
    while end and _note(history[end - 1]):
        end -= 1
    return end


def _note(message: Message) -> bool:
    return isinstance(message, SystemMessage) and message.kind == NOTE_KIND


def retry_point(history: list[Message]) -> int | None:
    """How many messages of ``history`` a retry keeps before its closing notes (``notes_end``),
    or None when there is nothing to retry. The notes themselves stay (see ``_retry_held``).

    The failed end (``_failed_turn``: failure notices and unfinished model turns) goes, so the
    model answers the input as if for the first time rather than reading its own failure as a turn
    (archived first, as a rewind's segment: a cut-off answer was seen, and stays readable).
    What is left must owe the model a turn, as the shared ``decide`` judges it (the durable runner
    and ``Agent`` take the same decision at a run's first step): a user message, a system event or
    tool results nobody answered. Without a failed end only user input or tool results count (an
    abort during a model call, a rewind to a question): a history that ends with a compaction's
    summary ended with an answer before it was summarised. An answer, a run its tools ended, an
    empty history: None."""
    end = notes_end(history)
    keep = end
    while keep and _failed_turn(history[keep - 1]):
        keep -= 1
    if not keep or (keep == end and not isinstance(history[end - 1], UserMessage | ToolResultMessage)):
        return None
    return keep if isinstance(decide(history[:keep], has_input=False, guard=None), CallModel) else None


async def retry(engine: ProcessEngine, pid: str, *, run_id: str | None) -> Receipt:
    """Start a run on the history as it stands, with no new input: the model is asked again where
    the last run failed to answer (``retry_point``), its failed end removed in the transaction that
    starts the run, so a restart resumes it like any run. Only while idle: ``RunActive`` while a
    run is under way, ``NothingToRetry`` after an answer, ``ProcessBusy`` while another worker will
    not let the process go; nothing is done then. Held as a rewind holds it (``held_idle``): input
    sent meanwhile waits and then joins the retried run. A caller-supplied ``run_id`` makes it
    idempotent as with ``send``: a retry of a retry that got through gets its receipt."""
    seen = await admitted(engine, pid, run_id)
    if seen is not None:
        return seen
    try:
        receipt = await _retry_held(engine, pid, run_id)
    except RunActive:  # a twin with the same id got through while this one waited for the process
        seen = await admitted(engine, pid, run_id)
        if seen is not None:
            return seen
        raise
    engine.wake(pid)
    return receipt


async def _retry_held(engine: ProcessEngine, pid: str, run_id: str | None) -> Receipt:
    """``retry`` with the process held idle; the history read here is the one the run starts on."""
    async with engine.held_idle(pid, "retry") as live:
        seen = await admitted(engine, pid, run_id)  # (a twin that got through and already finished)
        if seen is not None:
            return seen
        stored = await engine.store.history(pid)
        history = [m.message for m in stored]
        keep = retry_point(history)
        if keep is None:
            raise NothingToRetry(pid)
        end = notes_end(history)
        removed = end - keep
        failed_run = next((m.run_id for m in reversed(stored[:end]) if m.run_id is not None), None)
        where = None
        if removed and engine.archive is not None:  # (archived before it goes: a cut-off answer was seen)
            meta = {"reason": "retry", "at": stored[keep - 1].id, "kept": keep}
            where = await engine.archive(live.record, f"retry-{new_id()}", history[keep:end], meta)
        async with engine._tx(live) as tx:
            if removed:
                await engine.store.truncate_messages(pid, stored[keep - 1].id)
                if where is not None:  # (a rewind's kind: what follows a message, taken out)
                    ids = (stored[keep].id, stored[end - 1].id)
                    generation = live.record.history_generation
                    await engine.store.add_segment(SegmentRow(new_id(), pid, generation, "rewind", *ids, where))
                await forget_context(tx, live)  # (it measured the failed end too)
                tx.after.append(lambda: live.history.__delitem__(slice(keep, None)))
                # The notes recorded after the failed end are facts and stay, written again right
                # after the kept history (new ids, same order), so the retried run reads them after
                # its input. Put back where they were, they would sit between the input and the
                # model's turn that no longer exists; kept after the failed end, that end would
                # stay. After the kept end (a user message, a system event or a complete batch of
                # tool results: never an assistant turn whose calls wait for their results) a system
                # message is valid for every provider: Anthropic and Gemini merge it into the user
                # turn as marked text, OpenAI-style APIs take it as a system message there.
                if end < len(stored):
                    await tx.append(None, history[end:])
                retried = {"at": stored[keep - 1].id, "removed": removed}
                await tx.signal(sig.CHANGED, changes=["messages"], retried=retried)
            run = _new_run(run_id)
            await tx.set_run(run)
            await _carry_output(engine, pid, failed_run, run["run_id"])
            started = int(run["started"] * 1000)
            await tx.signal(sig.RUN_STARTED, runId=run["run_id"], reason="proc.retry", queuedCount=0, timestamp=started)
            await remember_admission(engine, pid, run["run_id"], run_id, queued=False, position=0)
    return Receipt(run["run_id"], False, 0)


async def promote(engine: ProcessEngine, live: _Live) -> None:
    """Queued input becomes the next run: system events first, then FIFO. An item withdrawn
    between the look at the queue and its claim is passed over for the next one: left waiting,
    the rest would have nothing to start it."""
    if not live.queued:
        return  # (the common end of a run: nothing waits)
    with promoting(live):  # (``wait_idle`` waits for it)
        pid = live.record.pid
        # (a reset, kill or compaction under way promotes what it leaves once it is over)
        while live.record.current_run is None and not _clearing(engine, pid):
            queue = await engine.store.queue(pid) if live.queued else []
            if not queue:
                return
            first = next((q for q in queue if q.kind == "system"), queue[0])
            async with engine._tx(live) as tx:
                # checked inside the transaction: two promotions that read the same queue (a worker's
                # own and one on a notification from another) start one run; and one of a clearing
                # that began since the look above starts none (see ``_check_not_clearing``)
                if live.record.current_run is not None or _clearing(engine, pid):
                    return
                if not await engine.store.dequeue(pid, first.id):
                    continue  # withdrawn meanwhile: look again
                tx.after.append(lambda: setattr(live, "queued", live.queued - 1))
                await tx.start_run(first.message, first.reason or "queue.promote", first.run_id, queued=live.queued - 1)
            engine.wake(pid)
            return


USER_INPUT: tuple[QueueKind, ...] = ("steer", "queue")  # what a withdraw that names no kind or item takes
_TAKEN_RANK: dict[str, int] = {"system": 0, "steer": 1, "queue": 2}


def take_order(items: list[QueueItem], *, running: bool) -> list[QueueItem]:
    """``items`` (the store's queue, in id order) in the order they will be taken: while a run is
    active, its next model turn takes the system events and then the steer input, and each
    queued message becomes a run of its own after it. An idle process (input forwarded to the
    worker holding it) first promotes a system event or else the oldest item, whose run then
    takes the rest in that same order."""
    ranked = sorted(items, key=lambda q: (_TAKEN_RANK[q.kind], q.id))
    if running or not items or ranked[0].kind == "system":
        return ranked
    return [items[0], *(q for q in ranked if q is not items[0])]


def check_withdrawal(item_id: object, kind: object) -> None:
    """``ValueError`` unless ``item_id`` is None or a queue item id, and ``kind`` None or a kind."""
    bad_id = isinstance(item_id, bool) or not isinstance(item_id, int) or not 1 <= item_id <= MAX_SEQ
    if item_id is not None and bad_id:
        raise ValueError(f"item_id must be an integer from 1 to {MAX_SEQ}, got {item_id!r}")
    if kind is not None and kind not in ("steer", "queue", "system"):
        raise ValueError(f"kind must be steer, queue or system, got {kind!r}")


async def withdraw(
    engine: ProcessEngine, pid: str, item_id: int | None = None, kind: QueueKind | None = None
) -> list[QueueItem]:
    """Take waiting input out of the queue before it runs: the item ``item_id``, the items of
    ``kind``, or (neither given) all the user's input; system events only when named by id or
    kind, since they are what schedules, watches and finished background work tell the process,
    which the user did not write. Returns what was withdrawn, in take order.

    One transaction: each item is claimed with the same delete a run's claim uses, so an item a
    run took first is simply not withdrawn (nor listed), and one withdrawn is never run. A reset
    under way is waited out (it archives what it discards). The media files a withdrawn message
    names stay: stored once per process by content, they may be another message's too, and a
    reset or kill deletes them with the process's folder."""
    check_withdrawal(item_id, kind)
    return await _past_clearings(lambda: _withdraw_once(engine, pid, item_id, kind))


async def _withdraw_once(
    engine: ProcessEngine, pid: str, item_id: int | None, kind: QueueKind | None
) -> list[QueueItem]:
    """One try of ``withdraw``: ``_ClearingBegan`` when a reset or kill began on the way, which
    archives the queued input it discards (read once it began): taken now, an item would be in
    that archive and in this answer both."""
    await after_clearing(engine, pid)
    live = await engine.live(pid)
    kinds = (kind,) if kind is not None else USER_INPUT if item_id is None else tuple(_TAKEN_RANK)
    async with engine._tx(live) as tx:
        if pid in engine.discarding:  # (a compaction takes nothing from the queue)
            raise _ClearingBegan(pid)
        chosen = [q for q in await engine.store.queue(pid) if q.kind in kinds and item_id in (None, q.id)]
        taken = [q for q in chosen if await engine.store.dequeue(pid, q.id)]
        for q in taken:  # (the output a queued item's run was to give: that run will not be)
            if q.kind == "queue" and q.run_id is not None:
                await engine.store.kv_delete(pid, output_key(q.run_id))
        if taken:
            tx.after.append(lambda: setattr(live, "queued", max(0, live.queued - len(taken))))
            await tx.signal(sig.CHANGED, changes=["queue"], withdrawn=[q.id for q in taken])
        running = live.record.current_run is not None
    return take_order(taken, running=running)
