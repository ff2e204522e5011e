"""A crash after a parent's abort committed and before its subagents were stopped: at the next
start, the whole subtree that aborted run started is stopped, grandchildren included, even below
a child that had already answered (the live abort stops that subtree too)."""

from __future__ import annotations

import asyncio

from agentloop import ScriptedModel
from tests.process_support import kernel
from tests.test_subagents import _dead_hook, _finished, tree_brain


async def _tree(k, parent_pid: str) -> tuple[str, str]:
    """The child and the grandchild once the grandchild's run has started (the child, which only
    starts it in the background, may have answered by then)."""
    async with asyncio.timeout(5):
        while True:
            records = await k.processes("alice")
            children = [r.pid for r in records if r.parent_pid == parent_pid]
            below = [r for r in records if children and r.parent_pid == children[0] and r.current_run]
            if below:
                return children[0], below[0].pid
            await asyncio.sleep(0.02)


async def test_grandchildren_an_abort_could_not_stop_before_a_crash_are_stopped_when_they_resume(tmp_path):
    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("spawn+stay spawn stay")  # a child that starts a grandchild, and answers
        child, grandchild = await _tree(k, parent.pid)
        await (await k.process(child)).wait_idle()
        k.engine.aborted = _dead_hook  # the runtime crashes right after the abort commits
        assert await parent.abort()
        left_running = (await k.store.get_process(grandchild)).current_run
    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True) as k:
        async with asyncio.timeout(5):  # not the 30 s of the resumed sleep
            await (await k.process(grandchild)).wait_idle()
        ended = await _finished(k, grandchild)
        child_runs = await _finished(k, child)
    assert left_running is not None
    assert ended[-1]["status"] == "aborted" and ended[-1]["reason"] == "parent.abort"
    assert [r["status"] for r in child_runs] == ["ok"]  # the child had answered: nothing of its to stop


async def test_a_grandchild_talked_to_after_the_abort_keeps_its_new_run_over_a_restart(tmp_path):
    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("spawn+stay spawn stay")
        child, below = await _tree(k, parent.pid)
        grandchild = await k.process(below)
        await (await k.process(child)).wait_idle()
        k.engine.aborted = _dead_hook
        assert await parent.abort()
        await grandchild.abort()  # the user stops the grandchild and gives it work of their own
        await grandchild.send("stay")
        async with asyncio.timeout(5):
            while not (await grandchild.info()).current_run:
                await asyncio.sleep(0.02)
    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True) as k:
        resumed = await k.process(grandchild.pid)
        await asyncio.sleep(0.3)
        running = (await resumed.info()).current_run
    assert running is not None
