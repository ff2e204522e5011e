"""Hook deadlines: an ``async`` hook that never ends is cancelled after ``Hooks.timeout`` seconds
(``DEFAULT_HOOK_TIMEOUT`` unless set) and treated as a hook that raised, phase by phase: a
``before_tool_call`` hook's call is refused (an approval gate fails closed), a policy phase fails
the run, a context phase (``post_turn`` in a durable process too) is logged and the run goes on.

Every run is bounded by ``BOUND`` seconds, so a runtime without deadlines fails these tests
rather than hanging them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from agentloop import Agent, Reply, RunResult, ScriptedModel, ToolResultMessage, call, tool
from agentloop.cli.approvals import PolicyHook, Question
from agentloop.kernel import Kernel
from agentloop.loop import hooks as hooks_module
from agentloop.loop.hooks import Block, Hooks, ToolCallInfo
from agentloop.process.api import approve_everything
from agentloop.process.approval import Policy
from agentloop.tools.base import ToolResult

BOUND = 4.0  # seconds: a run that takes longer hung (the deadlines here are 0.2 s)
DEADLINE = 0.2

ran: list[str] = []


@tool
def step() -> str:
    """Do one step."""
    ran.append("step")
    return "step done"


@pytest.fixture(autouse=True)
def _fresh() -> None:
    ran.clear()


async def hang(*_: Any) -> None:
    """A hook whose policy service never answers."""
    await asyncio.Event().wait()


def failing(*_: Any) -> None:
    raise RuntimeError("policy service down")


def scripted() -> ScriptedModel:
    return ScriptedModel([Reply(tool_calls=[call("step")]), "done"])


async def bounded(agent: Agent, text: str = "go") -> tuple[RunResult, float]:
    started = time.monotonic()
    result = await asyncio.wait_for(agent.run(text), BOUND)
    return result, time.monotonic() - started


def tool_results(result: RunResult) -> list[ToolResultMessage]:
    return [m for m in result.messages if isinstance(m, ToolResultMessage)]


# -- before_tool_call ---------------------------------------------------------------------------------


async def test_a_hanging_before_tool_call_hook_refuses_the_call_as_a_failing_one_does() -> None:
    outcomes = []
    for hook in (failing, hang):
        agent = Agent(model=scripted(), tools=[step])
        agent.hooks.timeout = DEADLINE
        agent.hooks.before_tool_call(hook)
        result, took = await bounded(agent)
        [refused] = tool_results(result)
        outcomes.append((result.stop_reason, result.text, refused.is_error, refused.text))
        assert took < DEADLINE + 1.5
    assert ran == []  # the call ran in neither case
    (failed, timed_out) = outcomes
    assert failed[:3] == timed_out[:3] == ("stop", "done", True)
    assert timed_out[3] == f"before-tool-call hook failed: hook {hang.__qualname__} timed out after 0.2 s"


async def test_an_approval_gate_that_times_out_fails_closed(tmp_path: Path) -> None:
    asked: list[Question] = []

    async def nobody_answers(question: Question) -> Any:
        asked.append(question)
        await asyncio.Event().wait()

    agent = Agent(model=scripted(), tools=[step])
    gate = PolicyHook(Policy(default="ask"), cwd=tmp_path, ask=nobody_answers)
    gate.hook_timeout = DEADLINE  # (one that asks a person has none of its own: see the next test)
    agent.hooks.before_tool_call(gate)
    result, _ = await bounded(agent)
    [refused] = tool_results(result)
    assert asked and ran == [] and refused.is_error
    assert refused.text == "before-tool-call hook failed: hook PolicyHook timed out after 0.2 s"


async def test_a_person_answering_an_approval_is_not_held_to_the_hooks_deadline(tmp_path: Path) -> None:
    """The CLI's approval hook waits for a person at the terminal, who answers in their own time:
    an answer after the hooks' deadline still counts (without a person to ask, it has the deadline)."""

    async def slow_person(question: Question) -> Any:
        await asyncio.sleep(DEADLINE * 2)
        return "approve"

    agent = Agent(model=scripted(), tools=[step])
    agent.hooks.timeout = DEADLINE
    agent.hooks.before_tool_call(PolicyHook(Policy(default="ask"), cwd=tmp_path, ask=slow_person))
    result, _ = await bounded(agent)
    [answered] = tool_results(result)
    assert ran and not answered.is_error
    assert PolicyHook(Policy(default="ask"), cwd=tmp_path, ask=None).hook_timeout == hooks_module.DEFAULT_HOOK_TIMEOUT


async def test_a_hanging_after_tool_call_hook_is_an_error_result_as_a_failing_one_is() -> None:
    agent = Agent(model=scripted(), tools=[step])
    agent.hooks.timeout = DEADLINE
    agent.hooks.after_tool_call(hang)
    result, _ = await bounded(agent)
    [res] = tool_results(result)
    assert ran == ["step"] and res.is_error and "timed out after 0.2 s" in res.text and result.text == "done"


# -- turn phases --------------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["pre_policy", "pre_tool_materialization"])
async def test_a_hanging_policy_phase_hook_fails_the_run_as_a_failing_one_does(phase: Any) -> None:
    outcomes = []
    for hook in (failing, hang):
        agent = Agent(model=scripted(), tools=[step])
        agent.hooks.timeout = DEADLINE
        agent.hooks.on(phase)(hook)
        result, took = await bounded(agent)
        outcomes.append((result.stop_reason, result.error))
        assert took < DEADLINE + 1.5
    assert ran == []
    assert outcomes[0] == ("error", f"{phase} hook failed: policy service down")
    assert outcomes[1] == ("error", f"{phase} hook failed: hook {hang.__qualname__} timed out after 0.2 s")


async def test_a_hanging_context_phase_hook_is_logged_and_left_out(caplog: pytest.LogCaptureFixture) -> None:
    agent = Agent(model=scripted(), tools=[step])
    agent.hooks.timeout = DEADLINE
    agent.hooks.on("pre_prompt_context")(hang)
    agent.hooks.on("post_turn")(hang)
    with caplog.at_level(logging.WARNING, logger="agentloop.hooks"):
        result, _ = await bounded(agent)
    assert result.stop_reason == "stop" and result.text == "done" and ran == ["step"]
    assert "timed out after 0.2 s" in caplog.text


async def test_a_hanging_transform_context_hook_is_treated_as_a_failing_one() -> None:
    """A failing ``transform_context`` hook's error ends ``Agent.run`` (it is raised there): so
    does a timed-out one's, rather than the run waiting for it."""
    raised: list[BaseException] = []
    for hook in (failing, hang):
        agent = Agent(model=scripted(), tools=[step])
        agent.hooks.timeout = DEADLINE
        agent.hooks.transform_context(hook)
        with pytest.raises(Exception) as caught:
            await asyncio.wait_for(agent.run("go"), BOUND)
        raised.append(caught.value)
    assert ran == [] and str(raised[0]) == "policy service down"
    assert isinstance(raised[1], TimeoutError) and type(raised[1]).__name__ == "HookTimedOut"
    assert str(raised[1]) == f"hook {hang.__qualname__} timed out after 0.2 s"


# -- a durable process --------------------------------------------------------------------------------


async def test_a_hanging_post_turn_hook_in_a_durable_process_is_logged_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = scripted()
    hooks = Hooks()
    hooks.timeout = DEADLINE
    hooks.on("post_turn")(hang)
    with caplog.at_level(logging.WARNING, logger="agentloop.hooks"):
        async with Kernel.open(
            f"sqlite:///{tmp_path}/a.db",
            model=model,
            workspace=tmp_path,
            tools=[step],
            approval=approve_everything,
            hooks=hooks,
        ) as k:
            proc = await k.spawn(owner="a", text="go")
            await asyncio.wait_for(proc.wait_idle(), BOUND * 2)
            finished = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.run.finished"]
            results = [m.text for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert [f["status"] for f in finished] == ["ok"]
    assert results == ["step done"] and len(model.requests) == 2
    assert f"hook {hang.__qualname__} timed out after 0.2 s" in caplog.text


# -- which deadline -----------------------------------------------------------------------------------


async def test_the_default_deadline_applies_when_none_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hooks_module, "DEFAULT_HOOK_TIMEOUT", DEADLINE)
    agent = Agent(model=scripted(), tools=[step])
    agent.hooks.before_tool_call(hang)
    result, _ = await bounded(agent)
    [refused] = tool_results(result)
    assert ran == [] and refused.text.endswith("timed out after 0.2 s")


def test_the_default_deadline_is_thirty_seconds() -> None:
    assert hooks_module.DEFAULT_HOOK_TIMEOUT == 30.0 and Hooks().timeout == 30.0


def slow(seconds: float, verdict: Block | None) -> Callable[[ToolCallInfo], Awaitable[Block | None]]:
    async def hook(info: ToolCallInfo) -> Block | None:
        await asyncio.sleep(seconds)
        return verdict

    return hook


async def test_a_hook_that_ends_within_its_deadline_works_as_before() -> None:
    agent = Agent(model=scripted(), tools=[step])
    agent.hooks.timeout = 1.0
    agent.hooks.before_tool_call(slow(0.01, Block("not today")))
    result, _ = await bounded(agent)
    assert [r.text for r in tool_results(result)] == ["not today"] and ran == []

    agent = Agent(model=scripted(), tools=[step])
    agent.hooks.timeout = 1.0
    agent.hooks.before_tool_call(slow(0.01, None))
    agent.hooks.on("pre_prompt_context")(lambda info: "some context")  # (a plain hook: as before)
    result, _ = await bounded(agent)
    assert [r.text for r in tool_results(result)] == ["step done"] and ran == ["step"]


async def test_none_disables_the_deadline() -> None:
    agent = Agent(model=scripted(), tools=[step])
    agent.hooks.timeout = None
    agent.hooks.before_tool_call(slow(0.5, None))  # longer than any deadline used here
    result, _ = await bounded(agent)
    assert [r.text for r in tool_results(result)] == ["step done"] and ran == ["step"]


async def test_a_hook_may_declare_its_own_deadline() -> None:
    class WaitsForAPerson:
        hook_timeout = None  # an approval that a person answers, in their own time

        async def __call__(self, info: ToolCallInfo) -> Block | None:
            await asyncio.sleep(0.5)
            return None

    class Impatient:
        hook_timeout = DEADLINE

        async def __call__(self, info: ToolCallInfo) -> Block | None:
            await asyncio.Event().wait()
            return None

    agent = Agent(model=scripted(), tools=[step])
    agent.hooks.timeout = 0.1
    agent.hooks.before_tool_call(WaitsForAPerson())
    result, _ = await bounded(agent)
    assert [r.text for r in tool_results(result)] == ["step done"]

    agent = Agent(model=scripted(), tools=[step])
    agent.hooks.timeout = None
    agent.hooks.before_tool_call(Impatient())
    result, _ = await bounded(agent)
    [refused] = tool_results(result)
    assert refused.text.endswith(f"hook {Impatient.__qualname__} timed out after 0.2 s")


async def test_a_hooks_own_timeout_error_is_its_failure_not_a_deadline() -> None:
    async def socket_timeout(info: ToolCallInfo) -> None:
        raise TimeoutError("read timed out")

    agent = Agent(model=scripted(), tools=[step])
    agent.hooks.timeout = 5.0
    agent.hooks.before_tool_call(socket_timeout)
    result, _ = await bounded(agent)
    [refused] = tool_results(result)
    assert refused.text == "before-tool-call hook failed: read timed out" and ran == []


async def test_an_after_hook_within_its_deadline_still_replaces_the_result() -> None:
    async def rewrite(info: ToolCallInfo, result: ToolResult) -> ToolResult:
        await asyncio.sleep(0.01)
        return ToolResult.text("rewritten")

    agent = Agent(model=scripted(), tools=[step])
    agent.hooks.timeout = 1.0
    agent.hooks.after_tool_call(rewrite)
    result, _ = await bounded(agent)
    assert [r.text for r in tool_results(result)] == ["rewritten"]
