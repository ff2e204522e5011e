"""Input admission: user input and system events reach a process here. Each delivery either starts
a run or waits in the queue (``steer`` items and system events join the active run, ``queue``
items wait for the next one; an ``interrupt`` stops the run first); a caller-supplied run id
makes a delivery idempotent. When a run ends, queued input becomes the next run (``promote``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from agentloop.messages import Message, system
from agentloop.process.api import Receipt, SendMode, new_id
from agentloop.process.tx import _Live

if TYPE_CHECKING:
    from agentloop.process.engine import ProcessEngine


async def after_clearing(engine: ProcessEngine, pid: str) -> None:
    """Wait out a reset or kill of the process under way: input that arrived meanwhile goes to the
    conversation that follows it (or, after a kill, finds no process), never to the one being
    cleared, where it would be lost or start a run the clearing does not know of."""
    if pid in engine.clearing:
        async with engine.clearing.hold(pid):
            pass


async def send(engine: ProcessEngine, pid: str, message: Message, *, mode: SendMode, run_id: str | None) -> Receipt:
    if mode not in ("steer", "queue", "interrupt"):
        raise ValueError(f"mode must be steer, queue or interrupt, got {mode!r}")
    await after_clearing(engine, pid)
    if engine.leases is not None and not await engine.leases.hold(pid) and mode == "interrupt":
        seen = await admitted(engine, pid, run_id)  # a retried interrupt must abort nothing
        if seen is not None:
            return seen
        await engine.leases.forward_abort(pid, None, "user.interrupt")  # the holder stops the run
        mode = "steer" if await engine.leases.hold(pid) else "queue"  # … and runs this next
    live = await engine.live(pid)
    seen = await admitted(engine, pid, run_id)  # early too: a retried interrupt must abort nothing
    if seen is not None:
        return seen
    if live.record.current_run is not None and mode == "interrupt":
        await engine.abort(pid, reason="user.interrupt")
    async with engine._tx(live) as tx:
        # checked again inside the transaction: two deliveries of one id cannot both pass
        await exclude_twin(engine, pid, run_id)
        seen = await admitted(engine, pid, run_id)
        if seen is not None:
            return seen
        # decided inside the transaction: the run seen here cannot end before this commits
        active = live.record.current_run
        if active is None and not live.remote:
            receipt = Receipt(await tx.start_run(message, "proc.send", run_id), False, 0)
        elif active is None:  # the worker holding the process starts the run, with this id
            receipt = Receipt(run_id or new_id(), False, 0)
            await tx.enqueue("queue", message, receipt.run_id, reason="proc.send")
        else:
            queued_run = run_id or new_id()
            receipt_run = active["run_id"] if mode == "steer" else queued_run  # steer joins the active run
            receipt = Receipt(receipt_run, True, live.queued + 1)
            await tx.enqueue("steer" if mode == "steer" else "queue", message, queued_run)
        await remember_admission(engine, pid, receipt.run_id, run_id, queued=receipt.queued, position=receipt.position)
    if not receipt.queued:
        engine.wake(pid)
    return receipt


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
) -> Receipt | None:
    """Deliver a system event. With ``claim`` (see ``ProcessEngine.claimed_event``) the claim runs
    first inside the delivery's transaction; None, and nothing delivered, when it fails."""
    await after_clearing(engine, pid)
    if engine.leases is not None:
        await engine.leases.hold(pid)  # or, held elsewhere, the event waits in the queue for its holder
    live = await engine.live(pid)
    message = system(text, "event")
    async with engine._tx(live) as tx:
        if claim is not None:
            if not await claim():
                return None  # delivered by another worker (or its source moved on): nothing to do
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
            receipt = Receipt(await tx.start_run(message, reason, run_id_kept), False)
        elif active is None:
            receipt = Receipt(run_id_kept or new_id(), False)
            await tx.enqueue("system", message, receipt.run_id, reason=reason)
        else:
            await tx.enqueue("system", message, run_id_kept)
            receipt = Receipt(active["run_id"], True, 0)
        await remember_admission(engine, pid, receipt.run_id, run_id, queued=receipt.queued, position=0)
    if not receipt.queued:
        engine.wake(pid)
    return receipt


async def promote(engine: ProcessEngine, live: _Live) -> None:
    """Queued input becomes the next run: system events first, then FIFO."""
    pid = live.record.pid
    if live.record.current_run is not None or pid in engine.discarding:
        return  # (a reset or kill under way promotes what it leaves once it is over)
    queue = await engine.store.queue(pid) if live.queued else []
    if not queue:
        return
    first = next((q for q in queue if q.kind == "system"), queue[0])
    async with engine._tx(live) as tx:
        # checked inside the transaction: two promotions that read the same queue (a worker's
        # own and one on a notification from another) start one run
        if live.record.current_run is not None or not await engine.store.dequeue(pid, first.id):
            return
        tx.after.append(lambda: setattr(live, "queued", live.queued - 1))
        await tx.start_run(first.message, first.reason or "queue.promote", first.run_id, queued=live.queued - 1)
    engine.wake(pid)
