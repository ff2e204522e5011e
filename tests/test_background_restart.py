"""Background commands across a restart: a job is recorded for its process while it runs, so
that the runtime that opens the store next tells the model the command did not finish (it would
otherwise wait for ever for the promised message), and stops a process group a crash left
running — only one provably the command's own, never a process that took its pid since."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.kernel import Kernel
from agentloop.models.base import ModelRequest
from agentloop.process import background
from agentloop.process.api import approve_everything
from agentloop.tools.process_group import MARK, GroupIdentity
from tests.test_background_shell import until
from tests.test_tools_shell import alive, pid_from

ROOT = Path(__file__).resolve().parent.parent


def brain(command: str) -> ScriptedModel:
    """Starts ``command`` in the background when asked to build; repeats what a system event says."""

    def answer(r: ModelRequest) -> object:
        last = r.messages[-1]
        if last.role == "user" and last.text == "build it":
            return Reply(tool_calls=[call("Shell", command=command, background=True)])
        if last.role == "system":
            return "heard: " + last.text
        return "started"

    return ScriptedModel(answer)


def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/a.db"


async def reasons(k: Kernel, pid: str) -> list[str]:
    proc = await k.process(pid)
    return [s.payload["reason"] async for s in proc.signals(follow=False) if s.signal == "proc.run.started"]


async def jobs(k: Kernel, pid: str) -> Any:
    return await k.store.kv_get(pid, background.JOBS_KEY)


async def recorded_group(k: Kernel, pid: str) -> dict[str, Any]:
    """The record of the one job of ``pid``, once its command's group is in it."""
    for _ in range(250):
        [entry] = (await jobs(k, pid)).values()
        if "group" in entry:
            return dict(entry)
        await asyncio.sleep(0.02)
    raise AssertionError("the group was never recorded")


async def reopen_and_settle(tmp_path: Path, pid: str) -> tuple[list[str], list[Any]]:
    """Open the store again; the run reasons and messages of ``pid`` once it is idle."""
    async with Kernel.open(url(tmp_path), model=brain("true"), workspace=tmp_path, approval=approve_everything) as k:
        proc = await k.process(pid)
        await proc.wait_idle()
        assert await jobs(k, pid) is None
        return await reasons(k, pid), await proc.messages()


def spawn_group(env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A command in a session of its own, as Shell starts one: a shell and two children (three processes)."""
    return subprocess.Popen(
        ["bash", "-c", "sleep 60 & sleep 60; wait"],
        start_new_session=True,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
    )


def group_of(pgid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid and alive(int(entry)):
                    found.append(int(entry))
            except ProcessLookupError:
                continue
    return found


@pytest.fixture
def reaped() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


async def left_behind(tmp_path: Path, identity: GroupIdentity | None, *, label: str = "background command `x`") -> str:
    """A process with a job record as a runtime that died would have left it; returns its pid."""
    async with Kernel.open(url(tmp_path), model=brain("true"), workspace=tmp_path) as k:
        proc = await k.spawn(owner="a")
        async with k.store.transaction():
            await background.record_job(k.store, proc.pid, "job1", label, generation=1)
            if identity is not None:
                await background.record_group(k.store, proc.pid, "job1", identity)
        return proc.pid


async def test_a_command_running_at_close_is_reported_once_after_reopening(tmp_path: Path) -> None:
    pid_file = tmp_path / "job.pid"
    command = f"echo $$ > {pid_file}; exec sleep 30"
    async with Kernel.open(url(tmp_path), model=brain(command), workspace=tmp_path, approval=approve_everything) as k:
        proc = await k.spawn(owner="a", text="build it")
        await proc.wait_idle()
        job = await pid_from(pid_file)
        entry = await recorded_group(k, proc.pid)
        assert entry["label"] == f"background command `{command}`"
        assert entry["group"]["pgid"] == job  # (its shell leads the group)
    assert not alive(job)  # stopped by the close

    started, messages = await reopen_and_settle(tmp_path, proc.pid)
    assert started == ["proc.send", "background.finished"]
    events = [m for m in messages if m.role == "system"]
    assert len(events) == 1
    assert f"`{command}`" in events[0].text and "did not finish" in events[0].text and "restart" in events[0].text
    assert messages[-1].text == "heard: " + events[0].text  # the model saw it

    again, _ = await reopen_and_settle(tmp_path, proc.pid)
    assert again == started  # told once


async def test_a_finished_job_leaves_no_record(tmp_path: Path) -> None:
    async with Kernel.open(
        url(tmp_path), model=brain("echo built"), workspace=tmp_path, approval=approve_everything
    ) as k:
        proc = await k.spawn(owner="a", text="build it")
        for _ in range(250):
            if (await reasons(k, proc.pid)).count("background.finished") == 1:
                break
            await asyncio.sleep(0.02)
        await proc.wait_idle()
        assert await jobs(k, proc.pid) is None
        assert "built" in next(m for m in await proc.messages() if m.role == "system").text
    started, _ = await reopen_and_settle(tmp_path, proc.pid)
    assert started == ["proc.send", "background.finished"]


async def test_a_reset_drops_the_record_of_the_job_it_stopped(tmp_path: Path) -> None:
    pid_file = tmp_path / "job.pid"
    command = f"echo $$ > {pid_file}; exec sleep 30"
    async with Kernel.open(url(tmp_path), model=brain(command), workspace=tmp_path, approval=approve_everything) as k:
        proc = await k.spawn(owner="a", text="build it")
        await proc.wait_idle()
        job = await pid_from(pid_file)
        await proc.reset()
        await until(lambda: not alive(job))
        for _ in range(250):
            if await jobs(k, proc.pid) is None:
                break
            await asyncio.sleep(0.02)
        assert await jobs(k, proc.pid) is None
    started, messages = await reopen_and_settle(tmp_path, proc.pid)
    assert "background.finished" not in started and messages == []


async def test_a_group_a_crash_left_running_is_stopped_and_reported(
    tmp_path: Path, reaped: list[subprocess.Popen[bytes]]
) -> None:
    mark = "f00dfeedf00dfeed"
    group = spawn_group({MARK: mark})
    reaped.append(group)
    await until(lambda: len(group_of(group.pid)) == 3)
    members = group_of(group.pid)
    pid = await left_behind(tmp_path, GroupIdentity.of(group.pid, mark), label="background command `make all`")
    assert all(alive(p) for p in members)

    started, messages = await reopen_and_settle(tmp_path, pid)
    assert not any(alive(p) for p in members)
    assert started == ["background.finished"]
    [event] = [m for m in messages if m.role == "system"]
    assert "`make all`" in event.text and "did not finish" in event.text


async def test_a_pid_taken_by_another_process_is_not_killed(
    tmp_path: Path, reaped: list[subprocess.Popen[bytes]]
) -> None:
    other = spawn_group()
    reaped.append(other)
    await until(lambda: len(group_of(other.pid)) == 3)
    real = GroupIdentity.of(other.pid, "0123456789abcdef")
    assert real.start is not None
    stale = GroupIdentity(other.pid, "0123456789abcdef", real.start - 1, real.boot)  # the command's, long gone
    pid = await left_behind(tmp_path, stale)

    started, messages = await reopen_and_settle(tmp_path, pid)
    assert all(alive(p) for p in group_of(other.pid)) and len(group_of(other.pid)) == 3
    assert started == ["background.finished"]  # the command is lost all the same: the model is told
    assert "did not finish" in messages[0].text


async def test_a_record_from_before_a_reset_is_not_reported(
    tmp_path: Path, reaped: list[subprocess.Popen[bytes]]
) -> None:
    """A crash between a reset's commit and the stopped job's removal of its record: the group is
    still stopped, and the fresh conversation hears nothing of the old one's job."""
    mark = "00ff00ff00ff00ff"
    group = spawn_group({MARK: mark})
    reaped.append(group)
    await until(lambda: len(group_of(group.pid)) == 3)
    async with Kernel.open(url(tmp_path), model=brain("true"), workspace=tmp_path) as k:
        proc = await k.spawn(owner="a")
        async with k.store.transaction():
            await background.record_job(k.store, proc.pid, "old", "background command `x`", generation=0)
            await background.record_group(k.store, proc.pid, "old", GroupIdentity.of(group.pid, mark))
    started, messages = await reopen_and_settle(tmp_path, proc.pid)
    assert group_of(group.pid) == []
    assert started == [] and messages == []


async def test_a_malformed_record_is_dropped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with Kernel.open(url(tmp_path), model=brain("true"), workspace=tmp_path) as k:
        first, second = await k.spawn(owner="a"), await k.spawn(owner="a")
        async with k.store.transaction():
            await k.store.kv_set(first.pid, background.JOBS_KEY, "not a table of jobs")
            await k.store.kv_set(
                second.pid,
                background.JOBS_KEY,
                {"bad": {"label": 5}, "worse": [], "group": {"label": "x", "generation": 1, "group": {"pgid": "1"}}},
            )
    with caplog.at_level(logging.WARNING, logger="agentloop"):
        for pid in (first.pid, second.pid):
            started, messages = await reopen_and_settle(tmp_path, pid)
            assert started == [] and messages == []
    warned = [r.getMessage() for r in caplog.records if "background" in r.getMessage()]
    assert len(warned) >= 4, warned


WORKER = textwrap.dedent(
    """
    import asyncio, sys
    from agentloop import Reply, ScriptedModel, call
    from agentloop.kernel import Kernel
    from agentloop.process import background
    from agentloop.process.api import approve_everything

    db, workspace, command = sys.argv[1:4]

    def answer(r):
        if r.messages[-1].role == "user":
            return Reply(tool_calls=[call("Shell", command=command, background=True)])
        return "started"

    async def main():
        async with Kernel.open(
            db, model=ScriptedModel(answer), workspace=workspace, approval=approve_everything
        ) as k:
            proc = await k.spawn(owner="a", text="build it")
            await proc.wait_idle()
            while True:
                jobs = await k.store.kv_get(proc.pid, background.JOBS_KEY) or {}
                if any("group" in job for job in jobs.values()):
                    break
                await asyncio.sleep(0.02)
            print("READY", proc.pid, flush=True)
            await asyncio.sleep(600)

    asyncio.run(main())
    """
)


def start_worker(tmp_path: Path, command: str) -> subprocess.Popen[str]:
    """A runtime in a process of its own, to be SIGKILLed while its background command runs."""
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, url(tmp_path), str(tmp_path), command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )


async def test_a_command_a_killed_runtime_left_running_is_stopped_on_the_next_open(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "job.pid"
    command = f"echo $$ > {pid_file}; exec sleep 60"
    worker = start_worker(tmp_path, command)
    try:
        assert worker.stdout is not None
        line = await asyncio.to_thread(worker.stdout.readline)
        assert line.startswith("READY"), line + (worker.stderr.read() if worker.stderr else "")
        pid = line.split()[1]
        job = await pid_from(pid_file)
    finally:
        worker.kill()
        worker.wait(10)
    assert alive(job)  # the crash left the command running
    try:
        started, messages = await reopen_and_settle(tmp_path, pid)
        assert not alive(job)
    finally:
        if alive(job):
            os.kill(job, signal.SIGKILL)
    assert started == ["proc.send", "background.finished"]
    [event] = [m for m in messages if m.role == "system"]
    assert f"`{command}`" in event.text and "did not finish" in event.text
