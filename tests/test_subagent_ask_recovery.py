"""A subagent's request copied onto its conversation's log survives a crash (kernel/subagent_asks.py).

The copy is written after the child's request commits, in a transaction of its own: a crash in
between left the conversation's log without it, and a client following that log (a chat bridge)
never asked. Here the tap loses the copy (as the crash would), the kernel closes and opens again
on the same file, and the copy is there, once; a request answered meanwhile gets none, and a
change of the requests whose copy was lost is logged on the conversation when it opens."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from agentloop import ScriptedModel
from agentloop.kernel.subagent_asks import SHOWN_KEY, SubagentAsks
from agentloop.process import signals as sig
from agentloop.process.signals import Signal
from tests.process_support import kernel, ran
from tests.test_subagent_approvals import POLICY, _asked, _logged, brain


def _lose(monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    """Make the tap drop every copy of a ``name`` signal, as a crash right after the child's commit
    would; returns the pids of the children whose copy was dropped."""
    lost: list[str] = []
    copy: Callable[..., Any] = SubagentAsks._copy

    async def losing(self: SubagentAsks, child: str, signal: Signal) -> None:
        if signal.signal == name:
            lost.append(child)
            return
        await copy(self, child, signal)

    monkeypatch.setattr(SubagentAsks, "_copy", losing)
    return lost


async def _until(check: Callable[[], Any]) -> None:
    async with asyncio.timeout(10):
        while not check():
            await asyncio.sleep(0.02)


async def _copies(k: Any, pid: str, name: str) -> list[dict[str, Any]]:
    return [p for p in await _logged(k, pid, name) if "subagent" in p]


def _open(tmp_path: Any, **kw: Any) -> Any:
    return kernel(tmp_path, ScriptedModel(brain), subagents=True, policy=POLICY, **kw)


async def test_a_request_whose_copy_was_lost_is_shown_once_when_the_kernel_opens(tmp_path, monkeypatch):
    ran.clear()
    lost = _lose(monkeypatch, sig.HIL_REQUESTED)
    async with _open(tmp_path, approval_timeout=3600) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("delegate: hello")
        [ask] = await _asked(parent)
        await _until(lambda: lost)
        [child] = [r for r in await k.processes("alice") if r.parent_pid == parent.pid]
        assert lost == [child.pid] and ask.pid == child.pid
        assert await _copies(k, parent.pid, sig.HIL_REQUESTED) == []  # the crash window
        [own] = await _logged(k, child.pid, sig.HIL_REQUESTED)
    monkeypatch.undo()

    async with _open(tmp_path, approval_timeout=3600) as k:
        [shown] = await _copies(k, parent.pid, sig.HIL_REQUESTED)
        # what the tap would have copied: the child's signal, on the conversation's log
        assert shown == {**own, "pid": parent.pid, "subagent": child.pid}
        assert shown["requestId"] == ask.request_id and "expiresAt" in shown and "nested" not in shown
        assert await k.store.kv_get(parent.pid, SHOWN_KEY) == {ask.request_id: child.pid}

    async with _open(tmp_path, approval_timeout=3600) as k:  # shown already: not again
        assert len(await _copies(k, parent.pid, sig.HIL_REQUESTED)) == 1
        proc = await k.process(parent.pid)
        assert [r.request_id for r in await proc.pending_approvals()] == [ask.request_id]
        assert await proc.hil(ask.request_id, "approve")
        async with asyncio.timeout(10):
            await proc.wait_idle()
        assert ran == ["hello"] and (await proc.messages())[-1].text == "got: got: hello"
        assert len(await _copies(k, parent.pid, sig.HIL_REQUESTED)) == 1
        async with asyncio.timeout(5):  # the answer's change is shown, and the row follows it
            while await k.store.kv_get(parent.pid, SHOWN_KEY) is not None:
                await asyncio.sleep(0.02)
        changed = await _copies(k, parent.pid, sig.CHANGED)
        assert [c["subagent"] for c in changed] == [child.pid]


async def test_a_request_answered_before_the_restart_is_not_shown(tmp_path, monkeypatch):
    ran.clear()
    lost = _lose(monkeypatch, sig.HIL_REQUESTED)
    async with _open(tmp_path) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("delegate: hello")
        [ask] = await _asked(parent)
        await _until(lambda: lost)
        assert await parent.hil(ask.request_id, "approve")
        async with asyncio.timeout(10):
            await parent.wait_idle()
        assert ran == ["hello"]
    monkeypatch.undo()

    async with _open(tmp_path) as k:
        assert await _copies(k, parent.pid, sig.HIL_REQUESTED) == []
        assert await k.store.kv_get(parent.pid, SHOWN_KEY) is None
    async with _open(tmp_path) as k:
        assert await _copies(k, parent.pid, sig.HIL_REQUESTED) == []


async def test_a_shown_request_is_not_shown_again_and_a_lost_change_is_made_good(tmp_path, monkeypatch):
    """A request the tap copied is not copied again when the kernel opens, even once the log that
    held the copy is pruned; the copy of its answer's change, lost, is logged when it opens."""
    ran.clear()
    async with _open(tmp_path) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("delegate: hello")
        [ask] = await _asked(parent)
        async with asyncio.timeout(5):
            while not await _copies(k, parent.pid, sig.HIL_REQUESTED):
                await asyncio.sleep(0.02)
        async with k.store.transaction():  # the copy pruned from the log (a long conversation's)
            await k.store.prune_events(parent.pid)
        assert await _copies(k, parent.pid, sig.HIL_REQUESTED) == []

    async with _open(tmp_path) as k:
        assert await _copies(k, parent.pid, sig.HIL_REQUESTED) == []  # shown once already
        assert await k.store.kv_get(parent.pid, SHOWN_KEY) == {ask.request_id: ask.pid}
        lost = _lose(monkeypatch, sig.CHANGED)
        proc = await k.process(parent.pid)
        assert await proc.hil(ask.request_id, "approve")
        async with asyncio.timeout(10):
            await proc.wait_idle()
        await _until(lambda: lost)
        assert ran == ["hello"] and await _copies(k, parent.pid, sig.CHANGED) == []
    monkeypatch.undo()

    async with _open(tmp_path) as k:
        [changed] = await _copies(k, parent.pid, sig.CHANGED)
        assert changed == {"pid": parent.pid, "changes": ["hil"], "subagent": ask.pid}
        assert await k.store.kv_get(parent.pid, SHOWN_KEY) is None
        assert await _copies(k, parent.pid, sig.HIL_REQUESTED) == []
    async with _open(tmp_path) as k:
        assert len(await _copies(k, parent.pid, sig.CHANGED)) == 1


async def test_a_copy_on_the_log_without_its_row_is_not_shown_again(tmp_path):
    """A request copied before the row was kept (by a runtime before this one) counts as shown."""
    ran.clear()
    async with _open(tmp_path) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("delegate: hello")
        [ask] = await _asked(parent)
        async with asyncio.timeout(5):
            while await k.store.kv_get(parent.pid, SHOWN_KEY) is None:
                await asyncio.sleep(0.02)
        async with k.store.transaction():
            await k.store.kv_delete(parent.pid, SHOWN_KEY)

    async with _open(tmp_path) as k:
        assert len(await _copies(k, parent.pid, sig.HIL_REQUESTED)) == 1
        assert await k.store.kv_get(parent.pid, SHOWN_KEY) == {ask.request_id: ask.pid}
