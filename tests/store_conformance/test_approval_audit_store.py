"""``Store.add_approval_audit`` / ``Store.approval_audit``: the approvals audit (migration 14), an
append-only log per owner that a process's end does not touch, read newest first with filters and
an id cursor, on every store."""

from __future__ import annotations

import pytest

from agentloop.process.store import Store
from agentloop.process.store.base import ApprovalAuditRow, AuditDecision
from agentloop.process.store.schema import LATEST_VERSION
from tests.store_conformance.test_conformance import spawn


def entry(
    n: int,
    decision: AuditDecision = "approve",
    *,
    owner: str = "alice",
    pid: str = "a1",
    by: str | None = "alice",
) -> ApprovalAuditRow:
    """The ``n``-th decision: its id and time grow with ``n``, as ``hil.audit_id`` makes them."""
    return ApprovalAuditRow(
        id=f"{n:016d}0000abcd",
        owner=owner,
        pid=pid,
        run_id="r1",
        request_id=None if decision == "policy-deny" else f"h{n}",
        call_id=f"c{n}",
        tool_name="Shell",
        syscall="shell.exec",
        args_digest="d" * 64,
        args_preview='{"command":"ls"}',
        tags=["destructive", "network"],
        decision=decision,
        remembered="run" if decision == "approve" else None,
        edited=decision == "approve",
        answered_by=by,
        decided_at=1000.0 + n,
    )


async def write(store: Store, *rows: ApprovalAuditRow) -> None:
    async with store.transaction():
        for row in rows:
            await store.add_approval_audit(row)


async def test_the_schema_has_the_audit_table(store: Store) -> None:
    assert LATEST_VERSION >= 14 and await store.schema_version() == LATEST_VERSION
    assert await store.approval_audit("alice", limit=10) == []


async def test_rows_come_back_whole_newest_first_per_owner_and_outlive_the_process(store: Store) -> None:
    await spawn(store, "a1", owner="alice")
    first, second = entry(1), entry(2, "policy-deny", by=None)
    await write(store, first, second, entry(3, owner="bob", pid="b1", by="bob"))
    assert await store.approval_audit("alice", limit=10) == [second, first]  # every column round-trips
    async with store.transaction():
        await store.delete_process("a1")  # a kill: the process's rows go, its audit stays
    assert [r.id for r in await store.approval_audit("alice", limit=10)] == [second.id, first.id]
    assert [r.call_id for r in await store.approval_audit("bob", limit=10)] == ["c3"]
    assert await store.approval_audit("carol", limit=10) == []


async def test_filters_limit_and_the_before_cursor(store: Store) -> None:
    await write(
        store,
        entry(1, "approve", pid="a1"),
        entry(2, "deny", pid="a2"),
        entry(3, "timeout", pid="a1", by=None),
        entry(4, "non-interactive", pid="a2", by=None),
        entry(5, "deny", pid="a1", by="admin"),
    )

    async def calls(**filters: object) -> list[str]:
        limit = filters.pop("limit", 10)
        return [r.call_id for r in await store.approval_audit("alice", limit=limit, **filters)]  # type: ignore[arg-type]

    assert await calls() == ["c5", "c4", "c3", "c2", "c1"]
    assert await calls(pid="a1") == ["c5", "c3", "c1"]
    assert await calls(decision="deny") == ["c5", "c2"]
    assert await calls(answered_by="alice") == ["c2", "c1"]
    assert await calls(since=1003.0) == ["c5", "c4", "c3"]  # (at or after)
    assert await calls(pid="a1", decision="deny", answered_by="admin", since=1005.0) == ["c5"]
    page = await store.approval_audit("alice", limit=2)
    assert [r.call_id for r in page] == ["c5", "c4"]
    assert await calls(limit=2, before=page[-1].id) == ["c3", "c2"]
    assert await calls(limit=2, before=entry(1).id) == []


async def test_a_rolled_back_decision_leaves_no_audit_row(store: Store) -> None:
    """Written in the decision's transaction: a decision that does not commit is not audited."""
    with pytest.raises(RuntimeError):
        async with store.transaction():
            await store.add_approval_audit(entry(1))
            raise RuntimeError("the decision failed")
    assert await store.approval_audit("alice", limit=10) == []
