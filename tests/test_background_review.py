"""Review of background commands (``Shell(background=true)``, ``ProcessEngine.start_background``)
and of the gentle stop reaching subagents (``tree.run_stopping``): the edges the first tests left
open. A background job belongs to the conversation that started it: a reset, a kill, a stop of
its process with its parent's run, or shutdown ends it, and nothing it says reaches anyone else."""

from __future__ import annotations

import asyncio
import gc
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, call, tool
from agentloop.kernel import Kernel, tree
from agentloop.models.base import ModelRequest
from agentloop.process.api import approve_everything
from agentloop.tools.base import FunctionTool, ToolContext
from agentloop.tools.shell import shell_tool
from tests.test_background_shell import until
from tests.test_tools_shell import alive, pid_from


async def report(text: str, after: float) -> str:
    await asyncio.sleep(after)
    return text


def late_starter(running: asyncio.Event, go: asyncio.Event) -> FunctionTool:
    @tool(name="later")
    async def later(ctx: ToolContext) -> str:
        """Start background work once told to."""
        running.set()
        await go.wait()
        assert ctx.background is not None
        ctx.background(report("news for the old conversation", 0.2), "late job")
        return "started"

    return later


async def test_work_started_while_the_process_is_reset_does_not_reach_the_fresh_conversation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tool of the run being reset that hands work over after the reset stopped the background
    work (before its abort reached the tool) must be refused: otherwise its report starts the
    fresh conversation."""
    running, go = asyncio.Event(), asyncio.Event()

    def brain(r: ModelRequest) -> object:
        return Reply(tool_calls=[call("later")]) if r.messages[-1].role == "user" else "ok"

    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=ScriptedModel(brain),
        workspace=tmp_path,
        tools=[late_starter(running, go)],
        approval=approve_everything,
    ) as k:
        stop_background = k.engine.stop_background

        def then_go(pid: str) -> None:
            stop_background(pid)
            go.set()  # the tool hands its work over while the reset is under way

        monkeypatch.setattr(k.engine, "stop_background", then_go)
        proc = await k.spawn(owner="a", text="start it")
        await asyncio.wait_for(running.wait(), 5)
        await proc.reset()
        await asyncio.sleep(0.5)
        await proc.wait_idle()
        assert await proc.messages() == []


async def test_a_subagent_stopped_with_its_parents_run_stops_its_background_command(tmp_path: Path) -> None:
    """The child's report would start a run of the child that nobody reads (see tree.py)."""
    pid_file = tmp_path / "job.pid"
    blocked = asyncio.Event()

    @tool
    async def block() -> str:
        """Wait."""
        blocked.set()
        await asyncio.sleep(30)
        return "never"

    def brain(r: ModelRequest) -> object:
        first = next(m.text for m in r.messages if m.role == "user")
        if first == "job":  # the child: a background command, then a long wait
            if r.messages[-1].role == "user":
                return Reply(tool_calls=[call("Shell", command=f"echo $$ > {pid_file}; sleep 0.5", background=True)])
            return Reply(tool_calls=[call("block")]) if r.tools else "child: done"
        if r.messages[-1].role == "user":
            return Reply(tool_calls=[call("Task", prompt="job", wait=True)])
        return "parent: done"

    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=ScriptedModel(brain),
        workspace=tmp_path,
        tools=[block, shell_tool(tmp_path)],
        approval=approve_everything,
        subagents=True,
    ) as k:
        parent = await k.spawn(owner="a", text="delegate the job")
        await asyncio.wait_for(blocked.wait(), 5)
        job = await pid_from(pid_file)
        assert await parent.abort()
        await until(lambda: not alive(job), 0.4)  # stopped, not ended on its own
        await asyncio.sleep(0.5)
        child = next(r for r in await k.processes("a") if r.parent_pid == parent.pid)
        reasons = [
            s.payload["reason"]
            async for s in (await k.process(child.pid)).signals(follow=False)
            if s.signal == "proc.run.started"
        ]
    assert reasons == ["proc.send"]


async def test_shutdown_right_after_a_reset_ends_the_command_the_reset_stopped(tmp_path: Path) -> None:
    """A command that ignores SIGTERM is killed after the grace: ``close`` waits for it, even
    though the reset (not ``close``) cancelled it."""
    pid_file = tmp_path / "job.pid"

    def brain(r: ModelRequest) -> object:
        if r.messages[-1].role == "user":
            command = f"trap '' TERM; echo $$ > {pid_file}; sleep 30; true"
            return Reply(tool_calls=[call("Shell", command=command, background=True)])
        return "started"

    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(brain), workspace=tmp_path, approval=approve_everything
    ) as k:
        proc = await k.spawn(owner="a", text="build it")
        await proc.wait_idle()
        job = await pid_from(pid_file)
        await proc.reset()
    assert not alive(job)


async def test_work_stopped_before_it_began_leaves_no_warning(tmp_path: Path) -> None:
    """A reset (or shutdown) in the very turn a tool handed its work over: the work, never begun,
    is closed rather than left for the garbage collector to warn about."""
    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(lambda r: "ok"), workspace=tmp_path) as k:
        proc = await k.spawn(owner="a")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            k.engine.start_background(proc.pid, report("x", 0), "job")
            k.engine.stop_background(proc.pid)
            await asyncio.sleep(0.05)
            gc.collect()
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []


# -- run_stopping on a stand-in kernel: only the records it reads ------------------------------------


@dataclass
class _Record:
    pid: str
    parent_pid: str | None
    current_run: dict[str, Any] | None
    owner: str = "a"
    state: str = "running"


@dataclass
class _Store:
    records: dict[str, _Record]
    origins: dict[str, dict[str, Any]]

    async def get_process(self, pid: str) -> _Record | None:
        return self.records.get(pid)

    async def list_processes(self, owner: str) -> list[_Record]:
        return list(self.records.values())

    async def kv_get(self, pid: str, key: str) -> Any:
        return self.origins.get(pid) if key == tree.ORIGIN_KEY else None


@dataclass
class _Engine:
    stopped: list[str] = field(default_factory=list)

    async def stop(self, pid: str, run_id: str | None = None) -> bool:
        self.stopped.append(pid)
        return True


@dataclass
class _Kernel:
    store: _Store
    engine: _Engine


async def test_run_stopping_never_loops_on_a_pid_met_further_up() -> None:
    """As ``stop_descendants`` and ``kill_children``: a pid reused further up is not walked again
    (each stop of an active run answers True, so nothing else would end the walk)."""
    records = {
        "p": _Record("p", "c", {"run_id": "r1"}),
        "c": _Record("c", "p", {"run_id": "r2"}),
    }
    origins = {"c": tree.origin("p", "r1", True), "p": tree.origin("c", "r2", True)}
    kernel = _Kernel(_Store(records, origins), _Engine())
    await asyncio.wait_for(tree.run_stopping(kernel, "p"), 5)  # type: ignore[arg-type]
    assert kernel.engine.stopped == ["c"]


async def test_a_stop_reaches_the_subagents_even_when_the_run_ends_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stopped run may end (its last answer is quick) before its subagents are looked up: a
    child it started without waiting is still stopped, not left working for nobody."""
    running = asyncio.Event()

    @tool
    async def step() -> str:
        """Do one step of the work."""
        running.set()
        await asyncio.sleep(0.2)
        return "step done"

    def brain(r: ModelRequest) -> object:
        first = next(m.text for m in r.messages if m.role == "user")
        if first == "job":  # the child: works step after step while it has tools
            return Reply(tool_calls=[call("step")]) if r.tools else "child: stopped"
        if r.messages[-1].role == "user":
            return Reply(tool_calls=[call("Task", prompt="job", wait=False)])
        return Reply(tool_calls=[call("step")]) if r.tools else "parent: stopped"

    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=ScriptedModel(brain),
        workspace=tmp_path,
        tools=[step],
        approval=approve_everything,
        subagents=True,
    ) as k:
        parent = await k.spawn(owner="a", text="delegate the job")
        await asyncio.wait_for(running.wait(), 5)
        stop = k.engine.stop

        async def stop_then_end(pid: str, run_id: str | None = None) -> bool:
            stopping = await stop(pid, run_id)
            if pid == parent.pid:
                await parent.wait_idle()  # the parent's run ends before its subagents are looked up
            return stopping

        monkeypatch.setattr(k.engine, "stop", stop_then_end)
        assert await parent.stop()
        child = await k.process(next(r for r in await k.processes("a") if r.parent_pid == parent.pid).pid)
        await asyncio.wait_for(child.wait_idle(), 5)
        ends = [s.payload["reason"] async for s in child.signals(follow=False) if s.signal == "proc.run.finished"]
    assert ends[-1] == "stopped"


async def test_the_refusal_names_every_place_without_background_work(tmp_path: Path) -> None:
    """A device runs Shell with no ``ToolContext.background`` even under ``agentloop serve``: the
    refusal must not say only that the conversation is not kept, which would be wrong there."""
    shell = shell_tool(tmp_path)
    with pytest.raises(Exception, match="not run on a device"):
        await shell.run(shell.validate({"command": "true", "background": True}), ToolContext("1", "Shell"))
