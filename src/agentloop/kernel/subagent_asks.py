"""A subagent's approval requests, put before the person who watches the conversation.

A ``Task`` child of an interactive process is interactive too (kernel/tasks.py), but nobody
follows a child: people follow the conversation they started. So when a child (or a child's child)
asks, the request is also logged on its top-level process, as ``proc.run.hil.requested`` with the
child's pid as ``subagent`` (its ``requestId``, call, arguments, tags and reason as the child
logged them), and a change of a child's requests as ``proc.changed`` (``hil``, ``subagent``). The
top-level process lists its descendants' requests with its own (``Process.pending_approvals``) and
answers them (``Process.hil`` finds the one a request belongs to); the child's run then goes on as
the answer says, exactly as if its own process had been answered.

The copy is written after the child's request commits, in a transaction of its own, by the worker
that drives the child. That transaction also records the copy in the top-level process's kv
(``SHOWN_KEY``: request id -> the subagent's pid), under a store-wide lock per conversation, and
takes out the requests no longer pending (a ``proc.changed`` copy for their subagents), so the
row always says which of the pending requests the conversation's log has shown. A crash between
the child's commit and the copy is made good when a kernel opens (``SubagentAsks.recover``): a
pending request the row lacks is copied then (rebuilt from its stored row), and a request the row
has that is no longer pending gets its ``proc.changed`` copy; a request already shown is never
copied twice (the row, not the log, which is pruned, says so; a copy logged before the row was
kept, by an older runtime, is looked for on the log then), and one answered meanwhile not at all.
On a shared store a worker that dies (or closes) between the two leaves the child with its run
under way and no live lease: the worker that takes the child over (lease.py's sweep, or a claim)
makes the copies good for the child's conversation then (``_taken``, the same reconciliation for
that one conversation), so they do not wait for a kernel to open on the store. An approval
timeout still denies a request whatever became of its copy.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from agentloop.kernel.tapwork import TapWork
from agentloop.process import signals as sig
from agentloop.process.signals import Signal
from agentloop.process.store import HilRow, NoSuchProcess, ProcessRecord, Store

if TYPE_CHECKING:
    from agentloop.kernel.kernel import Kernel
    from agentloop.process.tx import _Tx

log = logging.getLogger("agentloop.kernel.asks")

MAX_DEPTH = 16  # parents followed up at most (``tasks.MAX_DEPTH`` keeps real trees far shallower)
GRACE = 5.0  # seconds a closing kernel waits for the copies under way
SHOWN_KEY = "subagent_asks:shown"  # a top-level process's kv row: {request id: subagent pid} its log shows
CLOCK_SKEW = 60.0  # seconds workers' clocks may differ by (a request's time is its worker's)
LOG_PAGE = 500  # signals read at a time when a log is searched for a copy


class SubagentAsks:
    """The kernel's hub tap that copies subagents' approval requests to their top-level process."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.closed = False
        self._work = TapWork()
        kernel.engine.hub.tap(self._heard)
        leases = kernel.engine.leases
        if leases is not None:  # (a shared store: what a worker that stopped short left undone)
            leases.taken.append(self._taken)

    def _heard(self, pid: str, signal: Signal) -> None:
        """The hub's tap: cheap, synchronous, never raising."""
        if self.closed or signal.seq is None:
            return
        if signal.signal == sig.CHANGED:
            if "hil" not in signal.payload.get("changes", ()) or "subagent" in signal.payload:
                return
        elif signal.signal != sig.HIL_REQUESTED or "subagent" in signal.payload:
            return
        live = self.kernel.engine.cached(pid)
        if live is None or live.record.parent_pid is None:  # (a top-level process: its own watchers see it)
            return
        self._work.start(self._copy(pid, signal), f"asks of {pid}")

    async def _copy(self, child: str, signal: Signal) -> None:
        try:
            top = await top_level(self.kernel, child)
            if top is None:
                return
            await self._show(top.pid, child, signal)
        except NoSuchProcess:
            return  # the conversation is gone
        except Exception as exc:  # only a copy: the request stands, listed through the top-level process
            log.warning("process %s: its approval request was not shown on its conversation: %s", child, exc)

    def _taken(self, record: ProcessRecord) -> None:
        """The leases' takeover hook: this worker claimed ``record`` with its run under way, from a
        worker that may have committed a request of it and stopped before its copy (or a change
        of its requests before that one's). Cheap and synchronous; only a subagent's takeover
        reads anything, and only its conversation is written to, when it differs."""
        if self.closed or record.parent_pid is None:
            return
        self._work.start(self._made_good(record.pid), f"asks of {record.pid}, taken over")

    async def _made_good(self, child: str) -> None:
        """``recover`` for the one conversation ``child`` works for."""
        try:
            top = await top_level(self.kernel, child)
            if top is None:
                return
            pending = {row.request_id for row in await descendants_asks(self.kernel, top)}
            before = await self.kernel.store.kv_get(top.pid, SHOWN_KEY)
            if pending != (set(before) if isinstance(before, dict) else set()):
                await self._show(top.pid)
        except NoSuchProcess:
            return
        except Exception as exc:  # (the requests are still listed; the next takeover or start tries again)
            log.warning("process %s: its approval requests were not made good on its conversation: %s", child, exc)

    async def recover(self) -> None:
        """At start-up: show on each conversation's log the pending requests of its subagents that
        it has not shown (their copy was lost to a crash), and withdraw those it shows that are
        no longer pending. One pass over the store's requests and rows; only the conversations
        that differ are written to, each as the tap writes a copy."""
        store = self.kernel.store
        records = {r.pid: r for r in await store.list_processes()}
        owners = {r.owner for r in records.values() if r.parent_pid is not None and r.state != "killed"}
        pending: dict[str, set[str]] = {}  # top-level pid -> its descendants' pending request ids
        for owner in sorted(owners):
            for row in await store.account_hils(owner):
                top = _top_of(records, row.pid)
                if top is not None:
                    pending.setdefault(top, set()).add(row.request_id)
        rows = await store.kv_values(SHOWN_KEY)
        shown = {pid: set(value) for pid, value in rows.items() if isinstance(value, dict)}
        for top in sorted(set(pending) | set(shown)):
            if self.closed:
                return
            if pending.get(top, set()) == shown.get(top, set()):
                continue
            try:
                await self._show(top)
            except NoSuchProcess:
                continue
            except Exception as exc:  # (the others still get theirs; the next start tries again)
                log.warning("process %s: its subagents' approval requests were not shown on it: %s", top, exc)

    async def _show(self, top: str, child: str | None = None, heard: Signal | None = None) -> None:
        """In one transaction of the top-level process ``top``: copy the pending requests of its
        descendants that its log has not shown, and a ``proc.changed`` for each subagent whose
        shown requests are gone (and for ``child``, when ``heard`` is a change of its requests);
        ``heard``, a request of ``child``, is copied as logged."""
        engine = self.kernel.engine
        store = self.kernel.store
        live = await engine.live(top)
        async with engine._tx(live) as tx:
            await store.exclusive(f"subagent asks of {top}")  # (the tap's and a start's, on any worker)
            record = await store.get_process(top)
            if record is None or record.state == "killed":
                raise NoSuchProcess(top)
            pending = {row.request_id: row for row in await descendants_asks(self.kernel, record)}
            before = await store.kv_get(top, SHOWN_KEY)
            shown: dict[str, str] = dict(before) if isinstance(before, dict) else {}
            changed = {pid for rid, pid in shown.items() if rid not in pending}
            if heard is not None and heard.signal == sig.CHANGED and child is not None:
                changed.discard(child)
                await tx.signal(sig.CHANGED, **_copied(heard), subagent=child)
            for pid in sorted(changed):
                await tx.signal(sig.CHANGED, changes=["hil"], subagent=pid)
            shown = {rid: pid for rid, pid in shown.items() if rid in pending}
            asked = heard.payload.get("requestId") if heard is not None and heard.signal == sig.HIL_REQUESTED else None
            new = sorted((row for rid, row in pending.items() if rid not in shown), key=lambda r: r.created_at)
            if new and heard is None:  # (at start-up: a copy logged before the row was kept counts too)
                logged = await _logged_copies(store, top, since=new[0].created_at - CLOCK_SKEW)
                shown.update((row.request_id, row.pid) for row in new if row.request_id in logged)
                new = [row for row in new if row.request_id not in logged]
            for row in new:
                if heard is not None and row.request_id == asked:  # (as the child logged it)
                    payload = _copied(heard)
                else:
                    payload = await self._payload(row)
                await tx.signal(sig.HIL_REQUESTED, **payload, subagent=row.pid)
                shown[row.request_id] = row.pid
            await _keep(tx, top, before, shown)

    async def _payload(self, row: HilRow) -> dict[str, Any]:
        """What ``process.hil.ask`` logged for the request of ``row`` (the child's own signal may
        be pruned from its log): a request no call row of its run owns is a nested one."""
        calls = await self.kernel.store.calls(row.pid, row.run_id)
        nested = not any(c.dispatch_id == row.dispatch_id for c in calls)
        timeout = self.kernel.engine.approval_timeout
        return {
            "runId": row.run_id,
            "requestId": row.request_id,
            "callId": row.tool_call_id,
            "name": row.tool_name,
            "syscall": row.syscall,
            "args": row.args,
            "tags": list(row.tags),
            "reason": row.reason,
            **({"nested": True} if nested else {}),
            **({"expiresAt": row.created_at + timeout} if timeout is not None else {}),
        }

    async def close(self) -> None:
        self.closed = True
        self.kernel.engine.hub.untap(self._heard)
        leases = self.kernel.engine.leases
        if leases is not None and self._taken in leases.taken:
            leases.taken.remove(self._taken)
        await self._work.close(GRACE)


def _copied(signal: Signal) -> dict[str, Any]:
    """A child's signal as its copy on the conversation's log carries it (the log adds its pid)."""
    return {k: v for k, v in signal.payload.items() if k != "pid"}


async def _logged_copies(store: Store, top: str, *, since: float) -> set[Any]:
    """The request ids of the subagents' requests copied onto ``top``'s log since ``since``
    (epoch seconds), read from the newest signal back, a page at a time."""
    found: set[Any] = set()
    end = await store.last_event_seq(top)
    while end > 0:
        start = max(0, end - LOG_PAGE)
        rows = await store.events(top, after_seq=start, limit=end - start)
        copies = [r.payload for r in rows if r.signal == sig.HIL_REQUESTED and "subagent" in r.payload]
        found.update(p.get("requestId") for p in copies)
        if not rows or rows[0].seq > start + 1 or rows[0].created_at < since:
            break  # (the log is pruned below, or older than the requests)
        end = start
    return found


async def _keep(tx: _Tx, top: str, before: Any, shown: dict[str, str]) -> None:
    if shown == before or (not shown and before is None):
        return
    store = tx.engine.store
    if shown:
        await store.kv_set(top, SHOWN_KEY, shown)
    else:
        await store.kv_delete(top, SHOWN_KEY)


def _top_of(records: dict[str, ProcessRecord], pid: str) -> str | None:
    """``top_level`` over records already read: the pid of the conversation ``pid`` works for."""
    record = records.get(pid)
    for _ in range(MAX_DEPTH):
        if record is None or record.state == "killed":
            return None
        if record.parent_pid is None:
            return record.pid if record.pid != pid else None
        record = records.get(record.parent_pid)
    return None


async def top_level(kernel: Kernel, pid: str) -> ProcessRecord | None:
    """The conversation ``pid`` works for: its top-level ancestor (None if it is one itself, or a
    process in its chain is gone)."""
    record = await kernel.store.get_process(pid)
    for _ in range(MAX_DEPTH):
        if record is None or record.state == "killed":
            return None
        if record.parent_pid is None:
            return record if record.pid != pid else None
        record = await kernel.store.get_process(record.parent_pid)
    return None


async def descendants_asks(kernel: Kernel, record: ProcessRecord) -> list[HilRow]:
    """The pending approval requests of ``record``'s descendants, nearest first."""
    waiting: dict[str, list[HilRow]] = {}
    for row in await kernel.store.account_hils(record.owner):  # (one query; mostly none but its own)
        if row.pid != record.pid:
            waiting.setdefault(row.pid, []).append(row)
    if not waiting:
        return []
    rows: list[HilRow] = []
    family = [r for r in await kernel.store.list_processes(record.owner) if r.state != "killed"]
    level = [record.pid]
    for _ in range(MAX_DEPTH):
        level = [r.pid for r in family if r.parent_pid in level]
        if not level:
            break
        for pid in level:
            rows.extend(waiting.get(pid, ()))
    return rows
