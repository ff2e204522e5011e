"""A parent's narrowed tool scope reaches its descendants as a change of their own: each one whose
scope changed logs the ``proc.changed`` (``changes: ["tools"]``) a ``set_tools`` of its own logs, in
the transaction that writes its scope (``ProcessEngine.set_tools``), so watchers of its stream
hear of it at once; one whose scope did not change logs nothing. As with a change of its own, a run
under way keeps its tools and the next run has the new scope. Written deepest first, so a failure
leaves each descendant within its parent's scope, narrower, never wider, and never a scope written
without its signal (or a signal without it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agentloop import ScriptedModel
from agentloop.kernel import Kernel, Process
from agentloop.process.signals import Signal
from agentloop.process.store import StoreError
from tests.process_support import closed_gates, gate  # noqa: F401  (closed_gates: autouse)
from tests.test_tool_scope10 import brain, offered, open_kernel


async def tool_changes(proc: Process) -> list[Signal]:
    """The ``proc.changed`` signals of ``proc``'s log that name its tools."""
    return [
        s async for s in proc.signals(follow=False) if s.signal == "proc.changed" and "tools" in s.payload["changes"]
    ]


async def last_seq(proc: Process) -> int:
    return max([s.seq or 0 async for s in proc.signals(follow=False)], default=0)


async def first_tool_change(proc: Process, after_seq: int) -> Signal:
    """The first ``proc.changed`` naming tools after ``after_seq`` that a follower of ``proc``'s
    stream hears."""
    async for s in proc.signals(after_seq, follow=True):
        if s.signal == "proc.changed" and "tools" in s.payload["changes"]:
            return s
    raise AssertionError("the stream ended")


async def family(k: Kernel) -> tuple[Process, Process, Process, Process]:
    """A parent scoped to red and blue; a child and its child that inherit it; a child of red alone."""
    parent = await k.spawn(owner="alice", tools=["gate", "red", "blue"])
    child = await k.spawn(owner="alice", parent_pid=parent.pid)
    grandchild = await k.spawn(owner="alice", parent_pid=child.pid)
    red_only = await k.spawn(owner="alice", parent_pid=parent.pid, tools=["red"])
    return parent, child, grandchild, red_only


async def test_each_narrowed_descendant_logs_the_change_a_change_of_its_own_logs(tmp_path: Path) -> None:
    async with open_kernel(tmp_path, ScriptedModel(brain)) as k:
        parent, child, grandchild, red_only = await family(k)
        await child.set_tools(["gate", "red", "blue"])  # a direct change: what the narrowed ones must log alike
        (own,) = await tool_changes(child)
        followers = [asyncio.create_task(first_tool_change(p, await last_seq(p))) for p in (child, grandchild)]

        await parent.set_tools(["gate", "red"])

        async with asyncio.timeout(20):
            heard = await asyncio.gather(*followers)
        assert [s.payload for s in heard] == [
            {"pid": child.pid, "changes": own.payload["changes"]},
            {"pid": grandchild.pid, "changes": own.payload["changes"]},
        ]
        assert [s.seq for s in heard] == [(await tool_changes(child))[-1].seq, (await tool_changes(grandchild))[-1].seq]
        assert len(await tool_changes(child)) == 2 and len(await tool_changes(grandchild)) == 1
        assert await red_only.tools() == ["red"]
        assert await tool_changes(red_only) == []  # already within: unchanged, nothing logged
        assert len(await tool_changes(parent)) == 1

        # widening the parent changes none of them, so none of them logs anything
        await parent.set_tools(None)
        assert (len(await tool_changes(child)), len(await tool_changes(grandchild))) == (2, 1)
        assert await tool_changes(red_only) == []


async def test_a_running_descendant_is_told_at_once_and_treated_as_a_change_of_its_own(tmp_path: Path) -> None:
    model = ScriptedModel(brain)
    async with open_kernel(tmp_path, model) as k:
        parent, child, _, _ = await family(k)
        follower = asyncio.create_task(first_tool_change(child, await last_seq(child)))
        await child.send("gate g1")
        async with asyncio.timeout(20):
            while not model.requests:
                await asyncio.sleep(0.01)

        await parent.set_tools(["gate"])

        async with asyncio.timeout(20):
            heard = await follower  # while its run is under way
        assert heard.payload == {"pid": child.pid, "changes": ["tools"]}
        assert (await child.info()).state == "running"
        gate("g1").set()
        await child.wait_idle()
        assert offered(model.requests[-1]) == {"gate", "red", "blue"}  # the run under way kept its tools, as ...
        await child.send("again")
        await child.wait_idle()
        assert offered(model.requests[-1]) == {"gate"}  # ... after a change of its own: the next run has the new one


async def test_a_failed_narrowing_writes_neither_a_scope_nor_its_signal(tmp_path: Path) -> None:
    async with open_kernel(tmp_path, ScriptedModel(brain)) as k:
        parent, child, grandchild, _ = await family(k)
        store: Any = k.store
        append_events = store.append_events

        async def failing(pid: str, rows: list[tuple[str, dict[str, Any]]]) -> list[int]:
            if pid == grandchild.pid:
                raise StoreError("disk full")
            result: list[int] = await append_events(pid, rows)
            return result

        store.append_events = failing
        with pytest.raises(StoreError, match="disk full"):
            await parent.set_tools(["red"])
        store.append_events = append_events

        # deepest first: the grandchild's scope went back with its failed signal, and nothing above it was written
        assert await child.tools() == await grandchild.tools() == ["gate", "red", "blue"]
        assert await tool_changes(child) == [] and await tool_changes(grandchild) == []
        assert await parent.tools() == ["gate", "red", "blue"]
        await parent.set_tools(["red"])  # and the processes work on
        assert (await child.tools(), await grandchild.tools()) == (["red"], ["red"])
        assert (len(await tool_changes(child)), len(await tool_changes(grandchild))) == (1, 1)


async def test_a_failure_after_the_descendants_leaves_them_narrower_and_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_kernel(tmp_path, ScriptedModel(brain)) as k:
        parent, child, grandchild, _ = await family(k)

        set_tools = k.engine.set_tools

        async def failing(pid: str, scope: list[str] | None) -> None:
            if pid == parent.pid:
                raise StoreError("disk full")
            await set_tools(pid, scope)

        monkeypatch.setattr(k.engine, "set_tools", failing)
        with pytest.raises(StoreError, match="disk full"):
            await parent.set_tools(["red"])

        assert await parent.tools() == ["gate", "red", "blue"]
        assert (await child.tools(), await grandchild.tools()) == (["red"], ["red"])
        assert (len(await tool_changes(child)), len(await tool_changes(grandchild))) == (1, 1)


async def test_a_failure_between_descendants_leaves_each_within_its_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_kernel(tmp_path, ScriptedModel(brain)) as k:
        parent, child, grandchild, _ = await family(k)
        set_tools = k.engine.set_tools

        async def failing(pid: str, scope: list[str] | None) -> None:
            if pid == child.pid:
                raise StoreError("disk full")
            await set_tools(pid, scope)

        monkeypatch.setattr(k.engine, "set_tools", failing)
        with pytest.raises(StoreError, match="disk full"):
            await parent.set_tools(["red"])

        # the grandchild, written first, is narrower than the child above it, which kept its scope
        assert (await parent.tools(), await child.tools()) == (["gate", "red", "blue"], ["gate", "red", "blue"])
        assert await grandchild.tools() == ["red"]
        assert (len(await tool_changes(child)), len(await tool_changes(grandchild))) == (0, 1)
