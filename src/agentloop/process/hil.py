"""Human in the loop: a call the approval policy asks about waits for a person (a stored request
and a ``proc.hil.requested`` signal), and their answer (approve, optionally remembered as a
process-local rule, or deny) lets the batch go on; plus the policy for the calls a running tool
makes itself, which cannot wait for a person. The policy itself lives in ``approval/``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentloop.messages import message_to_dict, tool_error_result
from agentloop.process import signals as sig
from agentloop.process.api import Approval, call_of, new_id
from agentloop.process.approval.engine import remember_rule
from agentloop.process.approval.tags import call_target
from agentloop.process.store import HilRow, ToolCallRow
from agentloop.process.tx import _Live, _Tx
from agentloop.tools.base import NestedCheck, NestedVerdict

if TYPE_CHECKING:
    from agentloop.process.engine import ProcessEngine


async def ask(engine: ProcessEngine, tx: _Tx, pid: str, run_id: str, row: ToolCallRow, verdict: Approval) -> None:
    """Put the call before a person, inside ``tx``: store the request and tell the watchers.
    The batch waits (nothing after this call starts) until the request is answered."""
    request_id = new_id()
    tags = list(verdict.tags)
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


async def answer(engine: ProcessEngine, pid: str, request_id: str, decision: str, *, remember: bool) -> bool:
    if decision not in ("approve", "deny"):
        raise ValueError(f"decision must be approve or deny, got {decision!r}")
    if engine.leases is not None:
        await engine.leases.hold(pid)  # or, held elsewhere, decided here and carried out there
    live = await engine.live(pid)
    row = next((h for h in await engine.store.hils(pid) if h.request_id == request_id), None)
    if row is None:
        raise KeyError(f"no pending approval {request_id!r} for process {pid}")
    async with engine._tx(live) as tx:
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
                rules.insert(0, remember_rule(row.syscall, target).to_json())
                await engine.store.kv_set(pid, "approval_overrides", rules)
        else:
            msg = tool_error_result(call_of(row), "Tool execution denied by user")
            await engine.store.set_call_status(
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
    engine.wake(pid)
    return True


def nested_policy(engine: ProcessEngine, live: _Live, run_id: str, row: ToolCallRow) -> NestedCheck:
    """The policy for calls a running tool makes itself (a CodeMode program's): the verdict a
    direct call with the same syscall and arguments would get. A verdict of ``ask`` cannot
    pause the run from inside a running tool, so it comes back as ``ask`` and the tool
    refuses the call, telling the model to make it directly (where it can be asked)."""

    async def check(syscall: str, tool_name: str, args: dict[str, Any]) -> NestedVerdict:
        nested = ToolCallRow(
            new_id(), live.record.pid, run_id, row.position, row.tool_call_id, tool_name, syscall, dict(args)
        )
        verdict = await engine.approval(live.record, nested)
        if verdict.action == "deny":
            return NestedVerdict("deny", "denied by policy" + (f": {verdict.reason}" if verdict.reason else ""))
        if verdict.action == "ask":
            return NestedVerdict("ask", verdict.reason)
        return NestedVerdict("allow")

    return check
