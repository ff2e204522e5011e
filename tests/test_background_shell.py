"""Shell's ``background=true`` (GSV's async exec): the call returns at once, the command runs on
under the runtime, and its output and exit code reach the model later as a system event, which
starts a run when none is active. A reset or kill stops the command (its process group); in
memory, where nothing could tell the model later, it is refused."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.kernel import Kernel
from agentloop.models.base import ModelRequest
from agentloop.process import engine as engine_module
from agentloop.process.api import approve_everything
from agentloop.tools.base import ToolContext, ToolError
from agentloop.tools.shell import shell_tool
from tests.test_tools_shell import alive, pid_from


async def until(check: Callable[[], bool], seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("not reached in time")


def model_running(command: str) -> ScriptedModel:
    def brain(r: ModelRequest) -> object:
        last = r.messages[-1]
        if last.role == "user" and last.text == "build it":
            return Reply(tool_calls=[call("Shell", command=command, background=True)])
        if last.role == "system":  # the command's end, as a system event
            return "The build is done: " + last.text.splitlines()[-2]
        return "Started the build; I will tell you when it ends."

    return ScriptedModel(brain)


async def test_a_background_command_reports_its_end_as_a_system_event(tmp_path: Path) -> None:
    model = model_running("sleep 0.3; echo built")
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, approval=approve_everything
    ) as k:
        proc = await k.spawn(owner="a", text="build it")
        await proc.wait_idle()
        first = [m.text for m in await proc.messages()]
        assert "Started in the background" in first[2] and first[-1].startswith("Started the build")
        started = []
        async for s in proc.signals(follow=True):
            if s.signal == "proc.run.started":
                started.append(s.payload["reason"])
            if s.signal == "proc.run.finished" and len(started) == 2:
                break
        await proc.wait_idle()
        messages = await proc.messages()
    assert started == ["proc.send", "background.finished"]
    event = messages[-2]
    assert event.role == "system" and "`sleep 0.3; echo built`" in event.text and "built\n[exit code 0]" in event.text
    assert messages[-1].text == "The build is done: built"


async def test_a_reset_stops_a_background_command(tmp_path: Path) -> None:
    pid_file = tmp_path / "job.pid"
    model = model_running(f"echo $$ > {pid_file}; exec sleep 30")
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, approval=approve_everything
    ) as k:
        proc = await k.spawn(owner="a", text="build it")
        await proc.wait_idle()
        job = await pid_from(pid_file)
        assert alive(job)
        await proc.reset()
        await until(lambda: not alive(job))
        await asyncio.sleep(0.2)
        assert await proc.messages() == []  # nothing was delivered to the fresh conversation


async def test_background_work_is_bounded_per_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "MAX_BACKGROUND", 1)

    def brain(r: ModelRequest) -> object:
        if r.messages[-1].role == "user":
            return Reply(tool_calls=[call("Shell", command="sleep 5", background=True) for _ in range(2)])
        return "ok"

    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(brain), workspace=tmp_path, approval=approve_everything
    ) as k:
        proc = await k.spawn(owner="a", text="two at once")
        await proc.wait_idle()
        results = sorted(m.text for m in await proc.messages() if m.role == "toolResult")
    assert results[0].startswith("Started in the background")
    assert "already runs 1 background jobs (at most 1)" in results[1]


async def test_in_memory_a_background_command_is_refused(tmp_path: Path) -> None:
    shell = shell_tool(tmp_path)
    with pytest.raises(ToolError, match="background=true needs a conversation the runtime keeps"):
        await shell.run(shell.validate({"command": "true", "background": True}), ToolContext("1", "Shell"))
