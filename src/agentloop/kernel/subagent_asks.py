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
that drives the child; a crash between the two leaves the request without its copy in the
top-level log (it is still listed, and answerable, through the top-level process), and an
approval timeout still denies it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from agentloop.kernel.tapwork import TapWork
from agentloop.process import signals as sig
from agentloop.process.signals import Signal
from agentloop.process.store import HilRow, NoSuchProcess, ProcessRecord

if TYPE_CHECKING:
    from agentloop.kernel.kernel import Kernel

log = logging.getLogger("agentloop.kernel.asks")

MAX_DEPTH = 16  # parents followed up at most (``tasks.MAX_DEPTH`` keeps real trees far shallower)
GRACE = 5.0  # seconds a closing kernel waits for the copies under way


class SubagentAsks:
    """The kernel's hub tap that copies subagents' approval requests to their top-level process."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.closed = False
        self._work = TapWork()
        kernel.engine.hub.tap(self._heard)

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
            engine = self.kernel.engine
            live = await engine.live(top.pid)
            payload: dict[str, Any] = {k: v for k, v in signal.payload.items() if k != "pid"}
            async with engine._tx(live) as tx:
                await tx.signal(signal.signal, **payload, subagent=child)
        except NoSuchProcess:
            return  # the conversation is gone
        except Exception as exc:  # only a copy: the request stands, listed through the top-level process
            log.warning("process %s: its approval request was not shown on its conversation: %s", child, exc)

    async def close(self) -> None:
        self.closed = True
        self.kernel.engine.hub.untap(self._heard)
        await self._work.close(GRACE)


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
