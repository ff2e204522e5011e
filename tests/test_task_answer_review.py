"""Subagents, reviewed (kernel/tasks.py): a waiting ``Task`` call returns the answer of the run it
started in the child, not of a run after it. A child is addressable by its pid: another process
may ``Delegate`` a task to it and a person may send it input, and that work is queued behind the
Task's run. The call waited for the child to be idle and took its last answer, so the parent was
given the answer to someone else's task (and waited for it); so did a re-run of the call after a
restart, which found the child's later runs over."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, ToolResultMessage, UserMessage, call
from agentloop.models.base import ModelRequest
from agentloop.tools.base import ToolContext
from tests.process_support import (
    closed_gates,  # noqa: F401  (the autouse fixture: no gate left closed)
    gate,
    gate_tool,
    kernel,
    last_user,
)


def brain(request: ModelRequest) -> Reply | str:
    """``task: X`` starts a subagent on ``job X``, which answers ``done: X`` (after waiting at the
    gate ``g`` for ``job gate g``); ``delegate <pid>: X`` delegates X without waiting; a delegated
    task is answered ``did: X``; any other input ``re: <input>``."""
    last, asked = request.messages[-1], last_user(request)
    if asked.startswith("Delegated task from process"):
        return f"did: {asked.split(chr(10) * 2)[1]}"
    if asked.startswith("job "):
        job = asked.removeprefix("job ")
        if isinstance(last, UserMessage) and job.startswith("gate "):
            return Reply(tool_calls=[call("gate", name=job.removeprefix("gate "))])
        return f"done: {job}"
    if isinstance(last, UserMessage) and asked.startswith("task: "):
        return Reply(tool_calls=[call("Task", prompt=f"job {asked.removeprefix('task: ')}")])
    if isinstance(last, UserMessage) and asked.startswith("delegate "):
        head, _, task = asked.partition(": ")
        return Reply(tool_calls=[call("Delegate", to=head.split()[1], prompt=task, wait=False)])
    if isinstance(last, ToolResultMessage):
        return f"got: {last.text}"
    return f"re: {asked}"


def _kernel(tmp_path: Path) -> Any:
    return kernel(tmp_path, ScriptedModel(brain), subagents=True, tools=[gate_tool])


async def _until(check: Callable[[], Awaitable[bool]], seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        while not await check():
            await asyncio.sleep(0.02)


async def _results(proc: Any) -> list[str]:
    return [m.text for m in await proc.messages() if isinstance(m, ToolResultMessage)]


async def _child_at_gate(k: Any, parent_pid: str) -> Any:
    """The parent's one child, once its Task run waits at its gate."""

    async def there() -> bool:
        children = [r for r in await k.processes("alice") if r.parent_pid == parent_pid]
        if not children or children[0].current_run is None:
            return False
        history = await k.store.history(children[0].pid)
        return any(getattr(m.message, "tool_calls", None) for m in history[-2:])

    await _until(there)
    [child] = [r for r in await k.processes("alice") if r.parent_pid == parent_pid]
    return await k.process(child.pid)


@pytest.mark.parametrize("other", ["delegate", "queue", "steer"])
async def test_a_waiting_task_gets_the_answer_of_its_own_run_in_the_child(tmp_path, other):
    """While the child works on the Task, another process delegates a task to it (queued behind
    the Task's run), or a person queues input for it: the parent gets the answer to ITS task. A
    steer joins the Task's run instead, so the answer of that run is the one after the steer."""
    async with _kernel(tmp_path) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("task: gate g1")
        child = await _child_at_gate(k, parent.pid)
        if other == "delegate":
            source = await k.spawn(owner="alice")
            await source.send(f"delegate {child.pid}: extra")
            await source.wait_idle()
            assert (await _results(source))[0].startswith(f"Delegated to process {child.pid}")
        else:
            await child.send("extra", mode=other)
        assert await child.queued()  # behind the Task's run (a steer: for it)
        gate("g1").set()
        async with asyncio.timeout(10):
            await parent.wait_idle()
            await child.wait_idle()
        results = await _results(parent)
        answers = [m.text for m in await child.messages() if m.text.startswith(("done: ", "did: ", "re: "))]
    if other == "steer":
        assert answers == ["re: extra"]
        assert results == ["re: extra"]
    else:
        assert answers == ["done: gate g1", "did: extra" if other == "delegate" else "re: extra"]
        assert results == ["done: gate g1"]  # not the answer of the run that came after


async def test_a_waiting_task_does_not_wait_for_the_runs_queued_after_its_own(tmp_path):
    """The parent's call returns when the Task's run ends, not when the child is idle: a long
    delegated task after it is not the parent's to wait for."""
    async with _kernel(tmp_path) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("task: gate g1")
        child = await _child_at_gate(k, parent.pid)
        await child.send("job gate g2", mode="queue")  # a run of the child's that waits at g2
        gate("g1").set()
        async with asyncio.timeout(5):
            await parent.wait_idle()
        results = await _results(parent)
        still = (await child.info()).current_run
        gate("g2").set()
        await child.wait_idle()
    assert results == ["done: gate g1"]
    assert still is not None  # the child's next run went on (not aborted with the call)


async def test_a_rerun_of_a_task_call_after_a_restart_gets_the_answer_of_its_own_run(tmp_path):
    """The call ran again after a restart (the tool is idempotent): it finds its child, whose
    Task run is over and which has answered others since, and returns the Task run's answer."""
    ctx = ToolContext("call_0", "Task", run_id="run-1", call_key="d-1")
    async with _kernel(tmp_path) as k:
        parent = await k.spawn(owner="alice")
        task = (await k.engine._run_config(await k.engine.live(parent.pid), "run-1")).tools["Task"]
        first = await task.run({"prompt": "job once", "wait": True}, ctx)
        [child] = [r for r in await k.processes("alice") if r.parent_pid == parent.pid]
        source = await k.spawn(owner="alice")
        await source.send(f"delegate {child.pid}: extra")
        await source.wait_idle()
        proc = await k.process(child.pid)
        await proc.wait_idle()
        await proc.send("later")
        await proc.wait_idle()
        again = await task.run({"prompt": "job once", "wait": True}, ctx)  # (a re-run in the same kernel)
    async with _kernel(tmp_path) as k:
        task = (await k.engine._run_config(await k.engine.live(parent.pid), "run-1")).tools["Task"]
        after_restart = await task.run({"prompt": "job once", "wait": True}, ctx)
        texts = [m.text for m in await (await k.process(child.pid)).messages()]
    assert texts[1::2] == ["done: once", "did: extra", "re: later"]  # the child's three runs
    assert first.content[0].text == again.content[0].text == after_restart.content[0].text == "done: once"


async def test_a_task_waiting_over_a_restart_gets_the_answer_of_its_own_run(tmp_path):
    """The kernel stopped while the parent waited and a delegated task was queued behind the
    Task's run: after the restart both runs go on, and the parent gets its own answer."""
    async with _kernel(tmp_path) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("task: gate g1")
        child = await _child_at_gate(k, parent.pid)
        source = await k.spawn(owner="alice")
        await source.send(f"delegate {child.pid}: extra")
        await source.wait_idle()
        assert await child.queued()
    gate("g1").set()
    async with _kernel(tmp_path) as k:
        parent, child = await k.process(parent.pid), await k.process(child.pid)

        async def answered() -> bool:
            return (await parent.info()).current_run is None and bool(await _results(parent))

        await _until(answered)
        await child.wait_idle()
        results = await _results(parent)
        answers = [m.text for m in await child.messages() if m.text.startswith(("done: ", "did: "))]
    assert answers == ["done: gate g1", "did: extra"]
    assert results == ["done: gate g1"]
