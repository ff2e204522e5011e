"""Human in the loop: a call the approval policy asks about waits for a person (a stored request
and a ``proc.hil.requested`` signal), and their answer (approve, optionally with arguments of
their own and optionally remembered for the run, the process or the account, or deny, optionally
with a message the model reads in the call's result) lets the batch go on; plus the policy for
the calls a running tool makes itself (a CodeMode program's), which are asked about the same way
while the tool waits. The policy itself lives in ``approval/``.

Edited arguments are stored by the answer (``edits_key``), in the transaction that deletes the
request, and put in place of the model's at every dispatch of the call (``calls.dispatch``), so a
restart between the answer and the run runs the edit, never the original. The history keeps the
model's call as it made it: its assistant message is the provider's own transcript (call ids,
signed reasoning beside it), already streamed and maybe archived, and a call rewritten there
would also tell the model it chose what the person chose. Its result says instead that the
arguments were edited, and to what (``edited_result``).

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
import dataclasses
import json
import logging
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from agentloop.messages import TextContent, ToolResultMessage, message_to_dict, tool_error_result
from agentloop.process import signals as sig
from agentloop.process.api import Approval, call_of, new_id
from agentloop.process.approval.checker import OVERRIDES_KEY, run_overrides_key
from agentloop.process.approval.denial import DENIED_BY_USER, denial_message, denial_text
from agentloop.process.approval.engine import account_rule, args_fingerprint, remember_rule
from agentloop.process.approval.policy import Rule
from agentloop.process.approval.tags import call_target
from agentloop.process.store import HilRow, Store, ToolCallRow
from agentloop.process.store.base import ApprovalAuditRow, AuditDecision
from agentloop.process.tx import _Live, _Tx
from agentloop.tools.base import ALLOW, NestedCheck, NestedVerdict
from agentloop.tools.builtin import syscall_of
from agentloop.urls import MASK, redact_secrets, secret_name

if TYPE_CHECKING:
    from agentloop.loop.execute import _Prepared
    from agentloop.process.engine import ProcessEngine

#: how long a "yes, and remember" lasts: the rest of the run, the process, or the account (its
#: policy file, for its later processes too)
RememberScope = Literal["run", "process", "account"]
REMEMBER_SCOPES: tuple[RememberScope, ...] = ("run", "process", "account")
#: edited arguments as JSON: a person types them, a few KiB at most
MAX_EDITED_ARGUMENTS = 1 << 20

log = logging.getLogger("agentloop.process")

NOT_INTERACTIVE = "requires interactive approval, which is unavailable for this process"
TIMED_OUT = "Tool execution not approved: nobody answered the approval request within {wait}, so the call was not run"
TIMED_OUT_ERROR = "approval timed out"
#: characters of an audit row's argument preview: enough to tell one command from another, too
#: few to be a copy of what the call carried
AUDIT_PREVIEW = 160
#: an audit row's id (``audit_id``), the cursor a page of the audit is asked ``before``
AUDIT_ID = re.compile(r"[0-9]{16}[0-9a-f]{8}")
#: audit rows one read returns at most: a page, not an export
MAX_AUDIT_PAGE = 500


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
    engine: ProcessEngine,
    pid: str,
    request_id: str,
    decision: str,
    *,
    remember: bool | str = False,
    message: str | None = None,
    arguments: Mapping[str, Any] | None = None,
    by: str | None = None,
) -> bool:
    """Carry out a person's decision. A ``message`` (deny only) is written into the denied call's
    result in the transaction that deletes the request, so the model reads it after a restart
    too. ``arguments`` (approve only) replace the model's: checked against the tool's schema and
    the policy first, the approval is then bound to them. ``remember`` (approve only; ``True`` is
    ``"process"``, as before it had scopes) adds an allow rule for the run, the process or the
    account. Input is checked before anything is touched: a bad answer leaves the request pending.
    The answer's ``proc.changed`` says what was decided about which call, and ``by`` whom when
    known (``answered``): a record of the decision in the process's log, for its owner and for an
    audit (who allowed this command?)."""
    if decision not in ("approve", "deny"):
        raise ValueError(f"decision must be approve or deny, got {decision!r}")
    scope = remember_scope(remember)
    note = denial_message(message)
    if note is not None and decision != "deny":
        raise ValueError("a message goes only with deny: it tells the model why the call was refused")
    if decision != "approve" and arguments is not None:
        raise ValueError("arguments go only with approve: they are what the approved call runs with")
    if decision != "approve" and isinstance(remember, str):  # (``True`` with deny was always ignored)
        raise ValueError("remember goes only with approve: a denial is never remembered")
    edit = None if arguments is None else plain_arguments(arguments)
    if scope == "account" and engine.amend_policy is None:
        raise ValueError("this server's approval policy is not kept in account files: 'account' cannot be remembered")
    if engine.leases is not None:
        await engine.leases.hold(pid)  # or, held elsewhere, decided here and carried out there
    live = await engine.live(pid)
    row = next((h for h in await engine.store.hils(pid) if h.request_id == request_id), None)
    if row is None:
        raise KeyError(f"no pending approval {request_id!r} for process {pid}")
    args, tags, fingerprint = row.args, row.tags, row.fingerprint
    if edit is not None and edit != row.args:
        verdict = await _check_edit(engine, live, row, edit)
        args, tags, fingerprint = edit, list(verdict.tags), verdict.fingerprint or "-"
    else:
        edit = None
    target = call_target(row.syscall, row.tool_name, args)  # a device's, or local
    rule = remember_rule(row.syscall, target, tags)
    if scope == "account":  # (narrower, or refused: before anything is touched)
        rule = account_rule(row.syscall, args, target, tags)
    async with engine._tx(live) as tx:
        # the run's approved calls and the process's remembered rules are read, added to and
        # written back: two answers through two workers at once would each keep only their own
        await engine.store.exclusive(f"approvals of {pid}")
        if not await engine.store.delete_hil(request_id):  # decided meanwhile (by another client)
            raise KeyError(f"no pending approval {request_id!r} for process {pid}")
        if decision == "approve":
            live.approvals = True
            approved = await engine.store.kv_get(pid, f"approved:{row.run_id}") or {}
            approved[row.dispatch_id] = fingerprint
            await engine.store.kv_set(pid, f"approved:{row.run_id}", approved)
            if edit is not None:  # run with these, at every dispatch of the call (a restart's too)
                edits = await engine.store.kv_get(pid, edits_key(row.run_id)) or {}
                edits[row.dispatch_id] = edit
                await engine.store.kv_set(pid, edits_key(row.run_id), edits)
            if scope is not None:
                await _remember(engine, live, row.run_id, scope, rule)
        else:
            await _deny(engine, tx, live, row, note)
        kept = scope if decision == "approve" else None  # (``True`` with deny was always ignored)
        await audit(
            engine,
            live.record.owner,
            row,
            "approve" if decision == "approve" else "deny",
            tags=tags,
            args=args,
            by=by,
            remembered=kept,
            edited=edit is not None,
        )
        answered = {"requestId": request_id, "decision": decision, "callId": row.tool_call_id, "name": row.tool_name}
        await tx.signal(
            sig.CHANGED,
            changes=["hil"],
            answered={**answered, **({"by": by} if by is not None else {})},
            **({"edited": True} if edit is not None else {}),
            **({"remembered": kept} if kept is not None else {}),
        )
    engine.wake(pid)
    return True


def audit_id(at: float) -> str:
    """A new audit row's id: ``at`` in microseconds (16 digits, so ids sort as times do), then
    8 random hex digits, since two workers may decide in the same microsecond. Made by the
    writer, not the database: the schema has no dialect's sequence, and a counter row would make
    every approval of an account wait on every other."""
    return f"{round(at * 1_000_000):016d}{secrets.token_hex(4)}"


def args_preview(args: Mapping[str, Any]) -> str:
    """A short look at a call's arguments for the audit, never the arguments: the values of
    arguments named like credentials masked, what looks like a credential in the others masked
    (``redact_secrets``: bearer tokens, keys, ``PASSWORD=…``, a DSN's password), then cut to
    ``AUDIT_PREVIEW`` characters. Each string is masked before it is JSON-encoded: the escapes
    (``\"``, ``\n``) would hide a credential's shape from the patterns. Masked before the cut, so
    a secret cut in half is never half shown."""
    shown = json.dumps(_masked(dict(args)), ensure_ascii=False, sort_keys=True, default=_masked_repr)
    return shown if len(shown) <= AUDIT_PREVIEW else shown[: AUDIT_PREVIEW - 1] + "…"


def _masked(value: object) -> object:
    """``value`` with every string redacted, and the value of a credential-named key masked: in a
    mapping, or as the item after a credential-named string in a list (``["API_KEY", "…"]``, an
    argv's ``["--password", "…"]``)."""
    if isinstance(value, str):
        return redact_secrets(value)
    if isinstance(value, Mapping):
        return {k: MASK if secret_name(str(k)) else _masked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        out: list[object] = []
        previous: object = None
        for item in value:
            named = isinstance(previous, str) and secret_name(previous)
            out.append(MASK if named and isinstance(item, str) else _masked(item))
            previous = None if named else item  # (a masked value names nothing: "S3cretPass")
        return out
    return value


def _masked_repr(value: object) -> str:
    """What JSON cannot encode, as its ``repr``, redacted like a string argument."""
    return redact_secrets(repr(value))


async def audit(
    engine: ProcessEngine,
    owner: str,
    row: HilRow | ToolCallRow,
    decision: AuditDecision,
    *,
    tags: Sequence[str],
    args: Mapping[str, Any] | None = None,
    by: str | None = None,
    remembered: str | None = None,
    edited: bool = False,
) -> None:
    """Inside the transaction that carries a decision out: append it to ``owner``'s approvals
    audit (``Store.add_approval_audit``), about ``row``'s call with ``args`` (the call's own
    unless given: an edit's). The digest is the approval fingerprint of the arguments decided
    on, which tells whether two decisions were about the same call without keeping it."""
    at = time.time()
    args = row.args if args is None else args
    await engine.store.add_approval_audit(
        ApprovalAuditRow(
            audit_id(at),
            owner,
            row.pid,
            row.run_id,
            row.request_id if isinstance(row, HilRow) else None,
            row.tool_call_id,
            row.tool_name,
            row.syscall,
            args_fingerprint(row.syscall, args),
            args_preview(args),
            sorted(tags),
            decision,
            remembered,
            edited,
            by,
            at,
        )
    )


async def audit_refusal(engine: ProcessEngine, owner: str, row: ToolCallRow, verdict: Approval) -> None:
    """Inside the transaction that denies ``row``'s call without asking anyone: the policy's
    ``deny``, or an ``ask`` in a process that cannot ask (``verdict.reason`` is then
    ``NOT_INTERACTIVE``: worth telling apart, since a person would have been asked elsewhere)."""
    decision: AuditDecision = "non-interactive" if verdict.reason == NOT_INTERACTIVE else "policy-deny"
    await audit(engine, owner, row, decision, tags=verdict.tags)


def remember_scope(remember: object) -> RememberScope | None:
    """The scope of a "yes, and remember": ``True`` is ``"process"`` (what it meant before scopes
    existed), ``False`` none. ``TypeError`` otherwise: ``"false"`` from a form is truthy, and a
    misspelt scope must not widen (or narrow) what the person meant."""
    if remember is False or remember is None:
        return None
    if remember is True:
        return "process"
    if isinstance(remember, str) and remember in REMEMBER_SCOPES:
        return remember
    raise TypeError(f"remember must be true or false, or a scope: 'run', 'process' or 'account'; got {remember!r}")


def plain_arguments(arguments: object) -> dict[str, Any]:
    """A person's arguments as the JSON object the call stores and runs with; ``TypeError`` or
    ``ValueError`` for anything else (what does not survive JSON would not survive a restart)."""
    if not isinstance(arguments, Mapping):
        raise TypeError(f"arguments must be an object of named arguments, got {type(arguments).__name__}")
    try:
        text = json.dumps(dict(arguments), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"arguments must be plain JSON ({exc})") from None
    if len(text) > MAX_EDITED_ARGUMENTS:
        raise ValueError(f"arguments are longer than {MAX_EDITED_ARGUMENTS} characters as JSON")
    plain: dict[str, Any] = json.loads(text)
    return plain


def edits_key(run_id: str) -> str:
    """The kv row of run ``run_id``'s calls approved with a person's arguments: dispatch id -> them."""
    return f"edited:{run_id}"


async def _check_edit(engine: ProcessEngine, live: _Live, row: HilRow, edit: dict[str, Any]) -> Approval:
    """The policy's verdict on the call with the person's arguments, once they are known to be
    valid for the tool; ``ValueError`` (the request stays pending) when they are not, when the
    policy denies them (an edit is no way around a ``deny``), or when the request is a nested
    call's (a running program waits for it with its own arguments, in memory)."""
    calls = await engine.store.calls(row.pid, row.run_id)
    call = next((c for c in calls if c.dispatch_id == row.dispatch_id), None)
    if call is None:
        raise ValueError(
            "only a call the model made itself can be approved with other arguments, not one a running"
            " program (CodeMode) makes: approve or deny it as it is"
        )
    tool = (await engine._run_config(live, row.run_id)).tools.get(row.tool_name)
    if tool is None:
        raise ValueError(f"tool {row.tool_name} is not available to this run: its arguments cannot be checked")
    try:
        tool.validate(dict(edit))
    except Exception as exc:  # (``ToolArgumentsError``: says which argument and why; or a validator's own bug)
        raise ValueError(f"the edited arguments are not valid for {row.tool_name}: {exc}") from None
    if syscall_of(tool, edit) != row.syscall:
        raise ValueError(
            f"the edited arguments change what the call reaches ({row.syscall} -> {syscall_of(tool, edit)}):"
            " deny it and tell the model what to call instead"
        )
    verdict = await engine.approval(live.record, dataclasses.replace(call, args=edit))
    if verdict.action == "deny":
        why = f": {verdict.reason}" if verdict.reason else ""
        raise ValueError(f"the approval policy denies the call with the edited arguments{why}")
    return verdict


async def _remember(engine: ProcessEngine, live: _Live, run_id: str, scope: RememberScope, rule: Rule) -> None:
    """Inside the answer's transaction: keep ``rule`` where ``scope`` says. The account's file is
    written last, once the request is known to be this answer's (deleted above); should the
    transaction then fail, the request stays pending and the rule is the one asked for anyway."""
    if scope == "account":
        amend = engine.amend_policy
        assert amend is not None  # (checked before anything was touched)
        await engine.store.exclusive(f"approval policy of {live.record.owner}")  # (read, added to, written)
        await asyncio.to_thread(amend, live.record, rule)
        return
    key = OVERRIDES_KEY if scope == "process" else run_overrides_key(run_id)
    rules = await engine.store.kv_get(live.record.pid, key) or []
    rules.insert(0, rule.to_json())  # (read first by the policy checker)
    await engine.store.kv_set(live.record.pid, key, rules)


def edited_result(prepared: _Prepared, result: ToolResultMessage) -> ToolResultMessage:
    """``result`` of a call a person approved with other arguments than the model's, led by what
    they were: the model's call stays as it made it in the history (see the module's docstring),
    and the model must not take the outcome for that of its own arguments."""
    model_call = next((c for c in prepared.info.assistant_message.tool_calls if c.id == prepared.call.id), None)
    if model_call is None or dict(model_call.arguments) == prepared.call.arguments:
        return result
    shown = json.dumps(prepared.call.arguments, ensure_ascii=False, sort_keys=True)
    note = f"[The user edited this call's arguments before approving it. It ran with: {shown}]\n"
    return dataclasses.replace(result, content=[TextContent(text=note), *result.content])


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
                    await audit(engine, live.record.owner, row, "timeout", tags=row.tags)
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
    approved, the arguments they were approved with, the rules remembered for the run, and the
    words of the nested calls denied), which only that run reads."""
    await store.kv_delete(pid, f"approved:{run_id}")
    await store.kv_delete(pid, f"denied:{run_id}")
    await store.kv_delete(pid, edits_key(run_id))
    await store.kv_delete(pid, run_overrides_key(run_id))  # ("remember for this run")


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
            await _audit_nested_refusal(engine, live, nested, verdict)
            return NestedVerdict("deny", "denied by policy" + (f": {verdict.reason}" if verdict.reason else ""))
        if verdict.action == "ask" and not live.record.interactive:
            await _audit_nested_refusal(engine, live, nested, Approval("deny", verdict.tags, NOT_INTERACTIVE))
            return NestedVerdict("deny", f"Tool execution denied: {NOT_INTERACTIVE}")
        if verdict.action == "ask":
            return await ask_nested(engine, live, run_id, nested, verdict)
        return ALLOW

    return check


async def _audit_nested_refusal(engine: ProcessEngine, live: _Live, row: ToolCallRow, verdict: Approval) -> None:
    """A nested call refused without asking: its refusal lives in the running program only, so
    the audit row is written in a transaction of its own."""
    async with engine._tx(live):
        await audit_refusal(engine, live.record.owner, row, verdict)


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
