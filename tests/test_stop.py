"""A gentle stop (``Run.stop``, ``Process.stop``, ``POST …/stop``, WebSocket ``proc.stop``): what is
under way completes (the model's answer, its tool calls), then the model answers once more
without tools and the run ends with reason ``stopped``. ``abort`` stays the immediate stop."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agentloop import Agent, Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Kernel
from agentloop.models.base import ModelRequest
from agentloop.process.api import approve_everything

WORK_SECONDS = 0.3


def busy_model(r: ModelRequest) -> object:
    """Works through a long task one step at a time, for as long as it has tools."""
    if not r.tools:
        return "Stopped after step 1; steps 2 and later are left."
    return Reply(tool_calls=[call("step")])


def make_step(running: asyncio.Event) -> object:
    @tool
    async def step() -> str:
        """Do one step of the work."""
        running.set()
        await asyncio.sleep(WORK_SECONDS)
        return "step done"

    return step


async def test_a_stopped_run_finishes_its_step_then_answers_without_tools() -> None:
    running = asyncio.Event()
    model = ScriptedModel(busy_model)
    agent = Agent(model=model, tools=[make_step(running)])
    run = agent.start("work through the list")
    driving = asyncio.create_task(run.result())
    await asyncio.wait_for(running.wait(), 5)
    run.stop()
    result = await asyncio.wait_for(driving, 5)
    results = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert result.stop_reason == "stopped" and result.text.startswith("Stopped after step 1")
    assert [r.text for r in results] == ["step done"]  # the step under way was not cut short
    assert not model.requests[-1].tools and "asked to stop" in model.requests[-1].messages[-1].text
    run.stop()  # over: nothing to do


async def test_a_durable_run_is_stopped_the_same_way_and_a_stale_stop_does_nothing(tmp_path: Path) -> None:
    running = asyncio.Event()
    model = ScriptedModel(busy_model)
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=model,
        workspace=tmp_path,
        tools=[make_step(running)],
        approval=approve_everything,
    ) as k:
        proc = await k.spawn(owner="a", text="work through the list")
        assert proc.started is not None
        await running.wait()
        assert not await proc.stop(run_id="another-run")
        assert await proc.stop(run_id=proc.started.run_id)
        await proc.wait_idle()
        assert not await proc.stop()  # no run active
        finished = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.run.finished"]
        results = [m.text for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert [(f["status"], f["reason"]) for f in finished] == [("ok", "stopped")]
    assert finished[0]["text"].startswith("Stopped after step 1") and results == ["step done"]
    assert not model.requests[-1].tools


async def test_a_stop_reaches_the_subagents_the_run_started(tmp_path: Path) -> None:
    """A parent waiting on a child's Task call: the child sums up what it has, the parent takes
    that as the call's answer, then gives its own last answer without tools."""
    running = asyncio.Event()

    def brain(r: ModelRequest) -> object:
        first = next(m.text for m in r.messages if m.role == "user")
        if first == "job":  # the child: works step after step while it has tools
            return Reply(tool_calls=[call("step")]) if r.tools else "child: stopped after a step"
        if r.messages[-1].role == "user":
            return Reply(tool_calls=[call("Task", prompt="job", wait=True)])
        return "parent: " + r.messages[-1].text if not r.tools else "parent: done"

    model = ScriptedModel(brain)
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=model,
        workspace=tmp_path,
        tools=[make_step(running)],
        approval=approve_everything,
        subagents=True,
    ) as k:
        parent = await k.spawn(owner="a", text="delegate the job")
        await asyncio.wait_for(running.wait(), 5)
        assert await parent.stop()
        await asyncio.wait_for(parent.wait_idle(), 10)
        messages = await parent.messages()
        child = next(r for r in await k.processes("a") if r.parent_pid == parent.pid)
        child_end = [
            s.payload
            async for s in (await k.process(child.pid)).signals(follow=False)
            if s.signal == "proc.run.finished"
        ]
    assert [m.text for m in messages if isinstance(m, ToolResultMessage)] == ["child: stopped after a step"]
    assert messages[-1].text.startswith("parent: ") and child_end[-1]["reason"] == "stopped"
