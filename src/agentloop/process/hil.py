"""Human in the loop: a call the approval policy asks about waits for a person (a stored request
and a ``proc.hil.requested`` signal), and their answer (approve, optionally remembered as a
process-local rule, or deny, optionally with a message the model reads in the call's result)
lets the batch go on; plus the policy for the calls a running tool makes itself (a CodeMode
program's), which are asked about the same way while the tool waits.
The policy itself lives in ``approval/``.

A nested request differs from a direct one in what waits for the answer: not a call row of the
batch (which the driver dispatches once approved) but the running program, in memory. Its
request row names a dispatch id that no call row has; the answer is read from the store (the
row gone, and the id among the run's approved ones, or not), so a person may answer from any
client or worker. The program does not survive a restart, so neither may its question: on
resume the outer call is resolved as interrupted (it is not idempotent) and every request no
waiting call row owns is withdrawn (``withdraw_orphans``); a program that ends while asking (its
timeout, an abort) withdraws its own."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from agentloop.messages import message_to_dict, tool_error_result
from agentloop.process import signals as sig
from agentloop.process.api import Approval, call_of, new_id
from agentloop.process.approval.denial import DENIED_BY_USER, denial_message, denial_text
from agentloop.process.approval.engine import remember_rule
from agentloop.process.approval.tags import call_target
from agentloop.process.store import HilRow, Store, ToolCallRow
from agentloop.process.tx import _Live, _Tx
from agentloop.tools.base import ALLOW, NestedCheck, NestedVerdict

if TYPE_CHECKING:
    from agentloop.process.engine import ProcessEngine

log = logging.getLogger("agentloop.process")

NOT_INTERACTIVE = "requires interactive approval, which is unavailable for this process"
TIMED_OUT = "Tool execution not approved: nobody answered the approval request within {wait}, so the call was not run"
TIMED_OUT_ERROR = "approval timed out"


async def ask(
    engine: ProcessEngine,
    tx: _Tx,
    pid: str,
    run_id: str,
    row: ToolCallRow,
    verdict: Approval,
    *,
    nested: bool = False,
) -> str:
    """Put the call before a person, inside ``tx``: store the request and tell the watchers;
    returns the request's id. A direct call's batch waits (nothing after this call starts) until
    the request is answered; a ``nested`` one's program waits (``ask_nested``)."""
    request_id = new_id()
    tags = list(verdict.tags)
    created = time.time()
    await engine.store.put_hil(
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
            created,
        )
    )
    timeout = engine.approval_timeout
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
        **({"nested": True} if nested else {}),
        **({"expiresAt": created + timeout} if timeout is not None else {}),
    )
    if timeout is not None:
        tx.after.append(lambda: arm_asks(engine, live_of(engine, pid), created + timeout))
    return request_id


async def answer(
    engine: ProcessEngine, pid: str, request_id: str, decision: str, *, remember: bool, message: str | None = None
) -> bool:
    """Carry out a person's decision. A ``message`` (deny only) is written into the denied call's
    result in the transaction that deletes the request, so the model reads it after a restart
    too. Input is checked before anything is touched: a bad answer leaves the request pending."""
    if decision not in ("approve", "deny"):
        raise ValueError(f"decision must be approve or deny, got {decision!r}")
    if not isinstance(remember, bool):  # ("false" from a form is truthy: it would add an allow rule)
        raise TypeError(f"remember must be true or false, got {remember!r}")
    note = denial_message(message)
    if note is not None and decision != "deny":
        raise ValueError("a message goes only with deny: it tells the model why the call was refused")
    if engine.leases is not None:
        await engine.leases.hold(pid)  # or, held elsewhere, decided here and carried out there
    live = await engine.live(pid)
    row = next((h for h in await engine.store.hils(pid) if h.request_id == request_id), None)
    if row is None:
        raise KeyError(f"no pending approval {request_id!r} for process {pid}")
    async with engine._tx(live) as tx:
        # the run's approved calls and the process's remembered rules are read, added to and
        # written back: two answers through two workers at once would each keep only their own
        await engine.store.exclusive(f"approvals of {pid}")
        if not await engine.store.delete_hil(request_id):  # decided meanwhile (by another client)
            raise KeyError(f"no pending approval {request_id!r} for process {pid}")
        if decision == "approve":
            live.approvals = True
            approved = await engine.store.kv_get(pid, f"approved:{row.run_id}") or {}
            approved[row.dispatch_id] = row.fingerprint
            await engine.store.kv_set(pid, f"approved:{row.run_id}", approved)
            if remember:  # a process-local allow rule, which the policy checker reads first
                rules = await engine.store.kv_get(pid, "approval_overrides") or []
                target = call_target(row.syscall, row.tool_name, row.args)  # a device's, or local
                rules.insert(0, remember_rule(row.syscall, target, row.tags).to_json())
                await engine.store.kv_set(pid, "approval_overrides", rules)
        else:
            await _deny(engine, tx, live, row, note)
        await tx.signal(sig.CHANGED, changes=["hil"])
    engine.wake(pid)
    return True


def check_approval_timeout(timeout: object) -> None:
    """``TypeError``/``ValueError`` unless ``timeout`` is None or a positive, finite number of seconds."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"approval_timeout must be a number of seconds or None, got {type(timeout).__name__}")
    if not 0 < timeout < float("inf"):  # (NaN fails this too)
        raise ValueError(f"approval_timeout must be a positive, finite number of seconds, got {timeout!r}")


async def expire_asks(engine: ProcessEngine, live: _Live) -> bool:
    """Deny the process's requests left unanswered for ``engine.approval_timeout`` seconds (the
    model reads that nobody answered, not that a person refused), and wake again when the next
    one falls due. The deadline follows from the stored request, so it holds across a restart."""
    timeout = engine.approval_timeout
    if timeout is None:
        return False
    now = time.time()
    rows = await engine.store.hils(live.record.pid)
    due = [h for h in rows if h.created_at + timeout <= now]
    denied = False
    if due:
        text = TIMED_OUT.format(wait=_duration(timeout))
        async with engine._tx(live) as tx:
            for row in due:
                if await engine.store.delete_hil(row.request_id):  # (not answered meanwhile)
                    await _deny(engine, tx, live, row, None, text=text, error=TIMED_OUT_ERROR)
                    denied = True
            if denied:
                await tx.signal(sig.CHANGED, changes=["hil"])
        if denied:
            engine.wake(live.record.pid)  # (a program waiting on its own request looks again)
        log.info("process %s: %d approval request(s) unanswered after %s, denied", live.record.pid, len(due), timeout)
    ahead = [h.created_at + timeout for h in rows if h.created_at + timeout > now]
    if ahead:
        arm_asks(engine, live, min(ahead))
    return denied


def arm_asks(engine: ProcessEngine, live: _Live | None, due: float) -> None:
    """Wake the process's driver just after ``due`` (epoch seconds), to deny what is unanswered by
    then. One timer per process: a nearer deadline replaces a later one."""
    if live is None:
        return
    loop = asyncio.get_running_loop()
    at = loop.time() + max(0.0, due - time.time()) + 0.01
    timer = live.ask_timer
    if timer is not None and not timer.cancelled() and loop.time() < timer.when() <= at:
        return  # (a nearer wake-up is armed, and it arms the next)
    if timer is not None:
        timer.cancel()
    live.ask_timer = loop.call_at(at, engine.wake, live.record.pid)


def live_of(engine: ProcessEngine, pid: str) -> _Live | None:
    return engine._live.get(pid)


def _duration(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


async def _deny(
    engine: ProcessEngine,
    tx: _Tx,
    live: _Live,
    row: HilRow,
    note: str | None,
    *,
    text: str | None = None,
    error: str = DENIED_BY_USER,
) -> None:
    """Inside ``tx``: the denied call's result, with the person's words (or ``text``, when no
    person answered). A nested call's request has no call row: its program reads the denial
    (``_decision``), and the words from the run's ``denied:`` record, since the answer may come
    through another worker."""
    msg = tool_error_result(call_of(row), text or denial_text(note))
    if await engine.store.set_call_status(
        row.dispatch_id, "denied", expect=("registered",), result=message_to_dict(msg)
    ):
        await tx.signal(
            sig.TOOL_FINISHED,
            runId=row.run_id,
            callId=row.tool_call_id,
            name=row.tool_name,
            syscall=row.syscall,
            ok=False,
            error=error,
            **({"withMessage": True} if note is not None else {}),
        )
    elif note is not None or text is not None:
        live.approvals = True  # the run's end clears its decisions, this one with them
        denied = await engine.store.kv_get(row.pid, f"denied:{row.run_id}") or {}
        denied[row.dispatch_id] = note if text is None else {"text": text}  # (the person's words, or ours)
        await engine.store.kv_set(row.pid, f"denied:{row.run_id}", denied)


async def forget_decisions(store: Store, pid: str, run_id: str) -> None:
    """Inside the transaction that ends run ``run_id``: drop what its approvals decided (the calls
    approved, and the words of the nested calls denied), which only that run reads."""
    await store.kv_delete(pid, f"approved:{run_id}")
    await store.kv_delete(pid, f"denied:{run_id}")


def nested_policy(engine: ProcessEngine, live: _Live, run_id: str, row: ToolCallRow) -> NestedCheck:
    """The policy for calls a running tool makes itself (a CodeMode program's): the verdict a
    direct call with the same syscall and arguments would get. ``ask`` puts the call before a
    person as a direct call would, and the program waits for the answer (``ask_nested``); a
    process that cannot ask refuses it, as it refuses a direct call."""

    async def check(syscall: str, tool_name: str, args: dict[str, Any]) -> NestedVerdict:
        nested = ToolCallRow(
            new_id(), live.record.pid, run_id, row.position, row.tool_call_id, tool_name, syscall, dict(args)
        )
        verdict = await engine.approval(live.record, nested)
        if verdict.action == "deny":
            return NestedVerdict("deny", "denied by policy" + (f": {verdict.reason}" if verdict.reason else ""))
        if verdict.action == "ask" and not live.record.interactive:
            return NestedVerdict("deny", f"Tool execution denied: {NOT_INTERACTIVE}")
        if verdict.action == "ask":
            return await ask_nested(engine, live, run_id, nested, verdict)
        return ALLOW

    return check


async def ask_nested(
    engine: ProcessEngine, live: _Live, run_id: str, row: ToolCallRow, verdict: Approval
) -> NestedVerdict:
    """Ask a person about a nested call and wait for the answer, while the program waits in its
    call. The wait has no limit of its own: the program's timeout (or an abort) ends it, and
    then the request is withdrawn, so no question is left that nothing waits on."""
    waiter = asyncio.Event()
    live.asking.add(waiter)  # ``engine.wake`` sets it: an answer here, or one noticed from elsewhere
    request_id: str | None = None
    try:
        async with engine._tx(live) as tx:
            request_id = await ask(engine, tx, live.record.pid, run_id, row, verdict, nested=True)
        decided = await _decision(engine, live, run_id, request_id, row.dispatch_id, verdict, waiter)
        request_id = None  # answered: nothing to withdraw
        return decided
    finally:
        live.asking.discard(waiter)
        if request_id is not None:
            await _withdraw(engine, live, request_id)


async def _decision(
    engine: ProcessEngine,
    live: _Live,
    run_id: str,
    request_id: str,
    dispatch_id: str,
    verdict: Approval,
    waiter: asyncio.Event,
) -> NestedVerdict:
    """Wait until the request is answered; then approved means stored among the run's approvals
    (``answer`` does that in the transaction that deletes the request) for these arguments."""
    pid = live.record.pid
    while True:
        waiter.clear()  # before looking: a wake-up that comes after the look is not missed
        if not any(h.request_id == request_id for h in await engine.store.hils(pid)):
            break
        await waiter.wait()
    approved = await engine.store.kv_get(pid, f"approved:{run_id}") or {}
    if approved.get(dispatch_id) == (verdict.fingerprint or "-"):
        return ALLOW
    denied = (await engine.store.kv_get(pid, f"denied:{run_id}") or {}).get(dispatch_id)
    if isinstance(denied, dict) and isinstance(denied.get("text"), str):  # (nobody answered: ``expire_asks``)
        return NestedVerdict("deny", denied["text"])
    return NestedVerdict("deny", denial_text(denied))


async def _withdraw(engine: ProcessEngine, live: _Live, request_id: str) -> None:
    """Delete a nested request nothing waits on any more (the program ended while asking). Runs
    as the program's call is cancelled: a failure is logged, and a restart withdraws it then."""
    try:
        async with engine._tx(live) as tx:
            if await engine.store.delete_hil(request_id):
                await tx.signal(sig.CHANGED, changes=["hil"])
    except Exception:
        log.warning("process %s: could not withdraw approval request %s", live.record.pid, request_id, exc_info=True)


async def withdraw_orphans(engine: ProcessEngine, tx: _Tx, pid: str, rows: list[ToolCallRow]) -> None:
    """Inside ``tx``, on resume: delete the requests no waiting call row owns. Those are nested
    calls' (a CodeMode program's), whose program died with the runtime; their outer call is
    resolved as interrupted, so an answer would reach nothing, and a pending request would keep
    the batch from dispatching its other calls."""
    waiting = {r.dispatch_id for r in rows if r.status == "registered"}
    dropped = False
    for h in await engine.store.hils(pid):
        if h.dispatch_id not in waiting and await engine.store.delete_hil(h.request_id):
            dropped = True
    if dropped:
        await tx.signal(sig.CHANGED, changes=["hil"])
