"""A tool's timeout holds even when the tool swallows the cancellation (DESIGN §2: timeouts are
enforced by the runtime). Before, the timeout cancelled the tool inside the run's own task and
then waited for it: a tool that caught the ``CancelledError`` and went on held its run for as
long as it liked, and its late result was kept as if in time. Now it gets ``TIMEOUT_GRACE``
seconds to end once cancelled, and is then left behind with its result dropped, in the library
loop and in a durable process alike."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from agentloop import Agent, Kernel, ScriptedModel, tool
from agentloop.loop import execute
from agentloop.messages import ToolResultMessage
from agentloop.models.scripted import Reply, call


@pytest.fixture(autouse=True)
def _short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(execute, "TIMEOUT_GRACE", 0.2)


def _stubborn(release: asyncio.Event, ran_on: list[str]):  # type: ignore[no-untyped-def]
    @tool(timeout=0.2)
    async def stubborn() -> str:
        """Work that will not be stopped."""
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await release.wait()  # carries on past its timeout's cancellation
            ran_on.append("after the cancellation")
        return "finished anyway"

    return stubborn


async def test_the_library_loop_leaves_a_tool_that_swallows_its_timeout(caplog: pytest.LogCaptureFixture) -> None:
    release, ran_on = asyncio.Event(), []
    model = ScriptedModel([Reply(tool_calls=[call("stubborn")]), "moved on"])
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="agentloop.tools"):
        result = await Agent(model=model, tools=[_stubborn(release, ran_on)]).run("go")
    assert time.monotonic() - started < 3  # the timeout and the grace, not the tool
    (timed_out,) = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert timed_out.is_error and timed_out.text == "Tool stubborn timed out after 0.2 s"
    assert result.text == "moved on"
    assert "ignored its timeout's cancellation" in caplog.text
    release.set()  # the tool ends at last: nothing is raised or logged as never retrieved
    await asyncio.sleep(0.05)
    assert ran_on == ["after the cancellation"] and not execute._abandoned


async def test_a_durable_run_goes_on_and_the_late_result_is_dropped(tmp_path: Path) -> None:
    release, ran_on = asyncio.Event(), []
    model = ScriptedModel([Reply(tool_calls=[call("stubborn")]), "moved on", "and again"])
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[_stubborn(release, ran_on)]
    ) as kernel:
        proc = await kernel.spawn(owner="alice", text="go")
        await asyncio.wait_for(proc.wait_idle(), 5)
        release.set()
        await asyncio.sleep(0.1)  # the late result comes now
        await proc.send("next")
        await proc.wait_idle()
        messages = await proc.messages()
    results = [m for m in messages if isinstance(m, ToolResultMessage)]
    assert [r.text for r in results] == ["Tool stubborn timed out after 0.2 s"]
    assert [m.text for m in messages[-3:]] == ["moved on", "next", "and again"]
    assert ran_on == ["after the cancellation"]


async def test_an_answer_given_within_the_grace_is_kept() -> None:
    """A tool that catches the cancellation to report what it had, and does so at once, is
    answered by that report (a partial output), as before."""

    @tool(timeout=0.1)
    async def partial() -> str:
        """Report what was done when stopped."""
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return "partial: 3 of 10 files"
        return "all done"

    model = ScriptedModel([Reply(tool_calls=[call("partial")]), "ok"])
    result = await Agent(model=model, tools=[partial]).run("go")
    (answer,) = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert answer.text == "partial: 3 of 10 files"


async def test_a_tools_own_timeout_error_is_its_failure_not_the_calls_timeout() -> None:
    @tool(timeout=5)
    async def connects() -> str:
        """Fail with a socket-style timeout of its own."""
        raise TimeoutError("connect timed out")

    model = ScriptedModel([Reply(tool_calls=[call("connects")]), "ok"])
    result = await Agent(model=model, tools=[connects]).run("go")
    (failed,) = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert failed.is_error and failed.text == "TimeoutError: connect timed out"


async def test_an_abort_still_cancels_the_tool_and_waits_for_it() -> None:
    """The tool runs in a task of its own now: an abort of the run must still reach it, and the
    run end only once the tool has ended (its cleanup ran)."""
    started, cleaned = asyncio.Event(), []

    @tool(timeout=30)
    async def long_job() -> str:
        """Work for a long time, cleaning up when stopped."""
        started.set()
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.05)  # its cleanup takes a moment
            cleaned.append("cleaned")
        return "never"

    model = ScriptedModel([Reply(tool_calls=[call("long_job")]), "unused"])
    run = Agent(model=model, tools=[long_job]).start("go")
    running = asyncio.create_task(run.result())
    await asyncio.wait_for(started.wait(), 5)
    run.abort()
    result = await asyncio.wait_for(running, 5)
    assert cleaned == ["cleaned"]
    (cancelled,) = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert cancelled.text == execute.CANCELLED


async def test_a_tool_under_a_timeout_may_abort_its_own_run_and_finish() -> None:
    """A tool runs in a task of its own under its timeout: a tool that aborts its own run must
    still be spared (it finishes what it is doing), as when it ran in the run's task; the task
    waiting for it is spared with it (in a durable process too: test_process_review's
    ``test_a_tool_may_interrupt_or_reset_its_own_process``)."""
    holder: dict[str, Any] = {}
    finished: list[str] = []

    @tool(timeout=30)
    async def stop_now() -> str:
        """Stop the run, then tidy up."""
        holder["run"].abort()
        await asyncio.sleep(0.01)  # (an await after the abort: a cancel would land here)
        finished.append("tidied")
        return "stopping"

    model = ScriptedModel([Reply(tool_calls=[call("stop_now")]), "must not be called"])
    run = Agent(model=model, tools=[stop_now]).start("go")
    holder["run"] = run
    result = await run.result()
    assert result.stop_reason == "aborted" and model.calls == 1
    assert finished == ["tidied"]
