"""Managing background commands (``Shell(background=true)``) while they run: each gets a short id
(``bg-3f2a``) the start message names, and the ``Jobs`` tool lists a process's jobs and shows,
feeds, pages through or stops one. Its end still comes once, as a system event, with its output
and exit code; jobs belong to their process and end with a restart of the runtime."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.kernel import Kernel
from agentloop.messages import Message
from agentloop.models.base import ModelRequest
from agentloop.process.api import approve_everything
from agentloop.process.approval.engine import decide
from agentloop.process.approval.policy import Policy, Rule, When, default_policy
from agentloop.process.approval.tags import call_tags
from agentloop.tools.base import FunctionTool, ToolArgumentsError, ToolContext, ToolError, ToolResult
from agentloop.tools.builtin import builtin_tools, syscall_of
from agentloop.tools.jobs import JobRegistry, jobs_tool
from agentloop.tools.process_group import OutputCapture
from agentloop.tools.shell import run_shell, shell_tool
from tests.test_background_shell import until
from tests.test_tools_shell import alive, pid_from, text

JOB_ID = re.compile(r"\bbg-[0-9a-f]{4}\b")


class Runtime:
    """What the durable runtime gives a tool call, in miniature: background work runs as a task
    and what it returns is kept as the job's end; jobs are kept per process in ``registry``."""

    def __init__(self, pid: str = "p", registry: JobRegistry | None = None) -> None:
        self.pid = pid
        self.registry = registry if registry is not None else JobRegistry()
        self.ends: list[str] = []
        self.tasks: set[asyncio.Task[None]] = set()

    def ctx(self, name: str = "Shell") -> ToolContext:
        return ToolContext("call-1", name, background=self.start, jobs=self.registry.of(self.pid))

    def start(self, work: Coroutine[Any, Any, str], label: str) -> None:
        async def deliver() -> None:
            self.ends.append(await work)

        task = asyncio.create_task(deliver(), name=label)
        task.add_done_callback(lambda _: work.close())  # (as the engine: work cancelled before it began)
        self.tasks.add(task)

    async def settle(self) -> None:
        await asyncio.wait_for(asyncio.gather(*self.tasks), 10)


@pytest.fixture
async def runtime() -> Any:
    rt = Runtime()
    yield rt
    for task in rt.tasks:
        task.cancel()
    await asyncio.gather(*rt.tasks, return_exceptions=True)


async def start(rt: Runtime, root: Path, command: str, **more: Any) -> str:
    """Start ``command`` in the background; its job id."""
    shell = shell_tool(root)
    result = await shell.run(shell.validate({"command": command, "background": True, **more}), rt.ctx())
    found = JOB_ID.search(text(result))
    assert found is not None, text(result)
    return found.group()


async def jobs(rt: Runtime, **arguments: Any) -> ToolResult:
    tool = jobs_tool()
    return await tool.run(tool.validate(arguments), rt.ctx("Jobs"))


async def output_of(rt: Runtime, job: str, **more: Any) -> str:
    return text(await jobs(rt, action="output", job=job, **more))


# -- input, status, output, stop ----------------------------------------------------------------


async def test_input_reaches_a_command_that_reads_its_stdin(tmp_path: Path, runtime: Runtime) -> None:
    job = await start(runtime, tmp_path, "read x; echo got $x")
    result = await jobs(runtime, action="input", job=job, text="hello")
    assert not result.is_error and "6 bytes" in text(result)
    await runtime.settle()
    [end] = runtime.ends
    assert job in end and "got hello\n[exit code 0]" in end


async def test_eof_closes_the_commands_stdin(tmp_path: Path, runtime: Runtime) -> None:
    job = await start(runtime, tmp_path, "cat; echo done")
    await jobs(runtime, action="input", job=job, text="a", eof=True)
    await runtime.settle()
    assert "a\ndone\n[exit code 0]" in runtime.ends[0]


async def test_input_without_a_newline_and_after_eof(tmp_path: Path, runtime: Runtime) -> None:
    job = await start(runtime, tmp_path, "cat")
    await jobs(runtime, action="input", job=job, text="ab", newline=False)
    await jobs(runtime, action="input", job=job, text="c", newline=True)
    await until(lambda: "abc" in runtime.registry.of("p").find(job).output_so_far())
    await jobs(runtime, action="input", job=job, eof=True)
    with pytest.raises(ToolError, match="input was closed"):
        await jobs(runtime, action="input", job=job, text="more")
    await runtime.settle()
    assert "abc\n[exit code 0]" in runtime.ends[0]


async def test_status_while_running_and_after_the_end(tmp_path: Path, runtime: Runtime) -> None:
    job = await start(runtime, tmp_path, "echo hi; read x; exit 3")
    await until(lambda: runtime.registry.of("p").find(job).output_so_far() == "hi\n")
    running = await jobs(runtime, action="status", job=job)
    assert "running" in text(running) and "3 bytes of output" in text(running)
    assert running.details is not None and running.details["state"] == "running"
    assert running.details["bytes"] == 3 and running.details["runtime"] >= 0
    await jobs(runtime, action="input", job=job, text="")
    await runtime.settle()
    ended = await jobs(runtime, action="status", job=job)
    assert "ended" in text(ended) and "exit code 3" in text(ended)
    assert ended.details is not None and ended.details["exit_code"] == 3 and ended.details["state"] == "ended"
    listed = text(await jobs(runtime, action="list"))
    assert job in listed and "exit code 3" in listed and "echo hi" in listed


async def test_output_pages_while_the_command_runs(tmp_path: Path, runtime: Runtime) -> None:
    job = await start(runtime, tmp_path, "echo one; read x; echo two; read y")
    table = runtime.registry.of("p")
    await until(lambda: table.find(job).output_so_far() == "one\n")
    first = await output_of(runtime, job, offset=0)
    assert first.startswith("one\n") and "offset=4" in first and "still runs" in first
    assert "no output past byte 4 yet" in await output_of(runtime, job, offset=4)
    await jobs(runtime, action="input", job=job, text="")
    await until(lambda: table.find(job).output_so_far() == "one\ntwo\n")
    assert (await output_of(runtime, job, offset=4)).startswith("two\n")
    assert (await output_of(runtime, job)).startswith("one\ntwo\n")  # the tail: all of it, here
    await jobs(runtime, action="input", job=job, text="")
    await runtime.settle()
    after = await output_of(runtime, job)
    assert "has ended" in after and "system message" in after


async def test_paging_past_the_middle_a_long_output_dropped_says_so(tmp_path: Path, runtime: Runtime) -> None:
    job = await start(runtime, tmp_path, "head -c 300000 /dev/zero | tr '\\0' a; read x")
    await until(lambda: runtime.registry.of("p").find(job).bytes_so_far() == 300_000)
    first = await output_of(runtime, job, offset=0)
    assert first.startswith("a" * 30_000 + "\n[bytes 0–30000 of 300000 so far") and "offset=30000" in first
    middle = await output_of(runtime, job, offset=100_000)
    assert "bytes 100000–" in middle and "were not kept" in middle
    tail = await output_of(runtime, job)
    assert "[bytes 270000–300000 of 300000 so far" in tail
    await jobs(runtime, action="stop", job=job)


async def test_stop_kills_the_group_and_the_end_says_so(tmp_path: Path, runtime: Runtime) -> None:
    pid_file = tmp_path / "child.pid"
    job = await start(runtime, tmp_path, f"sleep 1000 & echo $! > {pid_file}; wait")
    child = await pid_from(pid_file)
    stopped = await jobs(runtime, action="stop", job=job)
    assert "stopped" in text(stopped).lower() and not stopped.is_error
    await runtime.settle()
    assert not alive(child)
    [end] = runtime.ends
    assert "stopped on request" in end
    again = await jobs(runtime, action="stop", job=job)
    assert "already ended" in text(again)
    assert "stopped on request" in text(await jobs(runtime, action="status", job=job))


async def test_a_job_stopped_before_its_command_starts_never_runs_it(tmp_path: Path) -> None:
    rt = Runtime()
    later: list[Coroutine[Any, Any, str]] = []
    rt.start = lambda work, label: later.append(work)  # type: ignore[method-assign]
    marker = tmp_path / "ran"
    job = await start(rt, tmp_path, f"touch {marker}")
    assert "starting" in text(await jobs(rt, action="status", job=job))
    await jobs(rt, action="stop", job=job)
    end = await later[0]
    assert "stopped on request" in end and not marker.exists()


# -- validation and what is no job --------------------------------------------------------------


async def test_arguments_are_checked(tmp_path: Path, runtime: Runtime) -> None:
    job = await start(runtime, tmp_path, "read x")
    await until(lambda: runtime.registry.of("p").find(job).state == "running")
    with pytest.raises(ToolError, match="needs the job's id"):
        await jobs(runtime, action="status")
    with pytest.raises(ToolError, match="text, newline and eof are for action='input'"):
        await jobs(runtime, action="status", job=job, text="x")
    with pytest.raises(ToolError, match="offset is for action='output'"):
        await jobs(runtime, action="input", job=job, text="x", offset=3)
    with pytest.raises(ToolError, match="nothing to write"):
        await jobs(runtime, action="input", job=job, text="", newline=False)
    with pytest.raises(ToolArgumentsError):
        await jobs(runtime, action="explode", job=job)
    with pytest.raises(ToolArgumentsError):
        await jobs(runtime, action="output", job=job, offset=-1)
    with pytest.raises(ToolError, match="no such job bg-0000"):
        await jobs(runtime, action="status", job="bg-0000")
    assert "running" in text(await jobs(runtime, action="status", job=job.removeprefix("bg-")))
    await jobs(runtime, action="stop", job=job)


async def test_input_to_an_ended_job_is_refused(tmp_path: Path, runtime: Runtime) -> None:
    job = await start(runtime, tmp_path, "true")
    await runtime.settle()
    with pytest.raises(ToolError, match="has ended"):
        await jobs(runtime, action="input", job=job, text="late")


async def test_jobs_belong_to_their_process(tmp_path: Path) -> None:
    registry = JobRegistry()
    a, b = Runtime("a", registry), Runtime("b", registry)
    job = await start(a, tmp_path, "read x")
    with pytest.raises(ToolError, match=f"no such job {job}"):
        await jobs(b, action="status", job=job)
    assert job not in text(await jobs(b, action="list"))
    registry.drop("a")  # (a reset or kill of the process)
    with pytest.raises(ToolError, match="no such job"):
        await jobs(a, action="status", job=job)
    for task in a.tasks:
        task.cancel()
    await asyncio.gather(*a.tasks, return_exceptions=True)


async def test_without_the_runtime_there_are_no_jobs() -> None:
    with pytest.raises(ToolError, match="conversation the runtime keeps"):
        await jobs_tool().run({"action": "list"}, ToolContext("1", "Jobs"))


async def test_ended_jobs_are_kept_as_summaries_up_to_a_bound(tmp_path: Path, runtime: Runtime) -> None:
    from agentloop.tools import jobs as jobs_module

    ids = [await start(runtime, tmp_path, "true") for _ in range(3)]
    await runtime.settle()
    table = runtime.registry.of("p")
    assert all(table.find(i).ended for i in ids)
    kept = jobs_module.MAX_ENDED
    jobs_module.MAX_ENDED = 1
    try:
        await start(runtime, tmp_path, "true")
    finally:
        jobs_module.MAX_ENDED = kept
    assert len(table.all()) == 2 and table.all()[0].id == ids[-1]


# -- the pieces: foreground stdin, paging the capture ----------------------------------------------


async def test_a_foreground_command_still_has_no_stdin(tmp_path: Path) -> None:
    result = await run_shell(tmp_path, "read x; echo read=$?", timeout=5)
    assert "read=1" in text(result)


def test_a_span_of_the_capture_skips_the_middle_it_dropped() -> None:
    capture = OutputCapture(4)  # keeps the first 8 bytes, and the last 8 to 16
    capture.feed(b"".join(b"%02d" % i for i in range(20)))  # 40 bytes: 0001…19
    assert capture.span(0, 6) == (0, b"000102")
    assert capture.span(6, 6) == (6, b"03")  # the head ends there
    start, data = capture.span(8, 6)
    assert start == capture.total - len(capture.tail) and data == b"".join(b"%02d" % i for i in range(20))[start:][:6]
    assert capture.span(40, 6) == (40, b"")
    small = OutputCapture(100)
    small.feed(b"hello")
    assert small.span(2, 100) == (2, b"llo")


# -- approval ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "tags"),
    [("list", set()), ("status", set()), ("output", set()), ("input", {"mutating"}), ("stop", {"mutating"})],
)
def test_approval_tags_and_the_default_policy(tmp_path: Path, action: str, tags: set[str]) -> None:
    args = {"action": action, "job": "bg-1234"}
    assert call_tags("shell.jobs", args, cwd=tmp_path, home=tmp_path) == tags
    assert decide(default_policy(), "shell.jobs", args, cwd=tmp_path, home=tmp_path).action == "auto"
    careful = Policy(rules=(Rule(match="*", when=When(any_tags=("mutating",)), action="ask"),))
    wanted = "ask" if tags else "auto"
    assert decide(careful, "shell.jobs", args, cwd=tmp_path, home=tmp_path).action == wanted


def test_the_jobs_tool_is_its_own_syscall_and_not_a_builtin(tmp_path: Path) -> None:
    tool = jobs_tool()
    assert isinstance(tool, FunctionTool) and syscall_of(tool, {"action": "stop"}) == "shell.jobs"
    assert "Jobs" not in {t.name for t in builtin_tools(tmp_path)}


# -- in a durable process ---------------------------------------------------------------------------


def script(steps: list[Callable[[str], Reply | str]]) -> ScriptedModel:
    """A model that starts a background command on the first user message, then plays ``steps``
    one per turn with the job id it was told; it echoes system events."""
    state: dict[str, Any] = {"job": None, "step": 0}

    def brain(r: ModelRequest) -> object:
        last: Message = r.messages[-1]
        if last.role == "system":
            return "heard: " + last.text
        if state["job"] is None and last.role == "toolResult" and (found := JOB_ID.search(last.text)):
            state["job"] = found.group()
        if last.role == "user":
            return Reply(tool_calls=[call("Shell", command=last.text, background=True)])
        if state["step"] < len(steps):
            state["step"] += 1
            return steps[state["step"] - 1](state["job"])
        return "done"

    return ScriptedModel(brain)


def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/a.db"


async def test_a_stopped_job_is_reported_once_as_stopped(tmp_path: Path) -> None:
    model = script([lambda job: Reply(tool_calls=[call("Jobs", action="stop", job=job)])])
    async with Kernel.open(url(tmp_path), model=model, workspace=tmp_path, approval=approve_everything) as k:
        proc = await k.spawn(owner="a", text="sleep 30")
        for _ in range(3):  # the stop's call, the end's event, and time for a second one to come
            await proc.wait_idle()
            await asyncio.sleep(0.3)
        messages = await proc.messages()
    events = [m.text for m in messages if m.role == "system"]
    assert len(events) == 1 and "stopped on request" in events[0] and "sleep 30" in events[0]
    results = [m.text for m in messages if m.role == "toolResult"]
    assert "Stopped" in results[1]


async def test_the_jobs_tool_is_offered_in_durable_processes_and_ids_stay_in_theirs(tmp_path: Path) -> None:
    offered: list[set[str]] = []
    asked: list[str] = []

    def brain(r: ModelRequest) -> object:
        offered.append({t.name for t in r.tools})
        last = r.messages[-1]
        if last.role == "user" and last.text.startswith("peek "):
            return Reply(tool_calls=[call("Jobs", action="status", job=last.text.removeprefix("peek "))])
        if last.role == "user":
            return Reply(tool_calls=[call("Shell", command="read x", background=True)])
        if last.role == "toolResult":
            asked.append(last.text)
        return "ok"

    async with Kernel.open(
        url(tmp_path), model=ScriptedModel(brain), workspace=tmp_path, approval=approve_everything
    ) as k:
        a = await k.spawn(owner="a", text="start")
        await a.wait_idle()
        found = JOB_ID.search(asked[0])
        assert found is not None
        b = await k.spawn(owner="a", text=f"peek {found.group()}")
        await b.wait_idle()
        await a.send(f"peek {found.group()}")
        await a.wait_idle()
    assert offered and all("Jobs" in names and "Shell" in names for names in offered)
    assert "no such job" in asked[1] and "is running" in asked[2]


async def test_after_a_restart_the_old_jobs_are_no_such_jobs(tmp_path: Path) -> None:
    seen: list[str] = []

    def brain(r: ModelRequest) -> object:
        last = r.messages[-1]
        if last.role == "user" and last.text.startswith("peek "):
            return Reply(tool_calls=[call("Jobs", action="status", job=last.text.removeprefix("peek "))])
        if last.role == "user":
            return Reply(tool_calls=[call("Shell", command="sleep 30", background=True)])
        seen.append(last.text)
        return "ok"

    model = ScriptedModel(brain)
    async with Kernel.open(url(tmp_path), model=model, workspace=tmp_path, approval=approve_everything) as k:
        proc = await k.spawn(owner="a", text="start")
        await proc.wait_idle()
    found = JOB_ID.search(seen[0])
    assert found is not None
    async with Kernel.open(url(tmp_path), model=model, workspace=tmp_path, approval=approve_everything) as k:
        again = await k.process(proc.pid)
        await again.wait_idle()
        await again.send(f"peek {found.group()}")
        await again.wait_idle()
        messages = await again.messages()
    told = [m.text for m in messages if m.role == "toolResult"][-1]
    assert f"no such job {found.group()}" in told and "restart" in told
    assert any(m.role == "system" and "did not finish" in m.text for m in messages)
