"""Repeated failures (``loop/retries.py``): the same call failing the same way is told to change
course at the third time and stops the run's tool use at the fourth, in memory and durably alike;
a failure that changes (a test suite being fixed) or is not the model's doing does not count."""

from __future__ import annotations

import itertools
from pathlib import Path

from agentloop import Agent, Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Kernel
from agentloop.loop.execute import CANCELLED
from agentloop.loop.retries import MAX_SAME_FAILURES, count_failures
from agentloop.messages import ToolCall, tool_error_result
from agentloop.models.base import ModelRequest
from agentloop.process.api import approve_everything
from agentloop.tools.base import ToolError


@tool
def fetch(url: str) -> str:
    """Fetch a page (always refused here)."""
    raise ToolError(f"403 Forbidden: {url}")


def stubborn(r: ModelRequest) -> object:
    """Calls the same failing tool for as long as it may, then says what happened."""
    if r.tools:
        return Reply(tool_calls=[call("fetch", url="https://example.com/x")])
    return "I could not fetch the page: it answers 403 every time."


async def test_the_same_failure_is_told_then_stops_the_tools_in_memory() -> None:
    model = ScriptedModel(stubborn)
    result = await Agent(model=model, tools=[fetch]).run("get the page")
    results = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert result.stop_reason == "repeated_failure" and result.text.startswith("I could not fetch")
    assert len(results) == MAX_SAME_FAILURES + 1 and len(model.requests) == MAX_SAME_FAILURES + 2
    assert ["Do not repeat it" in r.text for r in results] == [False, False, True, False]
    assert not model.requests[-1].tools  # the last round has no tools
    assert "kept failing the same way" in model.requests[-1].messages[-1].text


async def test_a_failure_that_changes_each_time_is_no_repeat() -> None:
    runs = itertools.count(1)

    @tool
    def tests() -> str:
        """Run the test suite (failing differently as the code is fixed)."""
        n = next(runs)
        if n < 7:
            raise ToolError(f"{7 - n} tests failed")
        return "all passed"

    model = ScriptedModel(
        lambda r: "fixed" if r.messages[-1].text == "all passed" else Reply(tool_calls=[call("tests")])
    )
    result = await Agent(model=model, tools=[tests]).run("make the tests pass")
    assert result.stop_reason == "stop" and result.text == "fixed"


def test_what_is_not_the_models_doing_is_not_counted() -> None:
    the_call = ToolCall(id="c1", name="fetch", arguments={"url": "u"})
    counts: dict[str, int] = {}
    for _ in range(MAX_SAME_FAILURES + 2):
        _, tripped = count_failures(
            counts, [the_call], [tool_error_result(the_call, CANCELLED)], not_counted=frozenset({CANCELLED})
        )
        assert not tripped
    assert counts == {}


async def test_a_durable_run_counts_failures_the_same_way(tmp_path: Path) -> None:
    model = ScriptedModel(stubborn)
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[fetch], approval=approve_everything
    ) as k:
        proc = await k.spawn(owner="a", text="get the page")
        await proc.wait_idle()
        finished = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.run.finished"]
        results = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert [(f["status"], f["reason"]) for f in finished] == [("ok", "repeated_failure")]
    assert finished[0]["text"].startswith("I could not fetch")
    assert ["Do not repeat it" in r.text for r in results] == [False, False, True, False]
    assert len(model.requests) == MAX_SAME_FAILURES + 2 and not model.requests[-1].tools
