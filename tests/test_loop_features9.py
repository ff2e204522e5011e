"""Loop features from the pi/Pioneer audit: a preflight that cannot hold the turn for ever,
composable pieces through ``Kernel.open``, ``post_turn`` hooks that stop the run gently, and
queued input taken all at once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from agentloop import Agent, Guards, Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Kernel
from agentloop.loop.hooks import Hooks, Stop, TurnInfo
from agentloop.loop.reveal import REQUEST_TOOLS, ToolReveal
from agentloop.loop.stop_after import StopAfterTools
from agentloop.messages import AssistantMessage, UserMessage
from agentloop.models.base import ModelRequest, ProviderError
from agentloop.process.api import approve_everything


@tool
def weather(city: str) -> str:
    """Weather for a city."""
    return f"sunny in {city}"


@tool
def step() -> str:
    """Do one step of the work."""
    return "step done"


def names(request: ModelRequest) -> list[str]:
    return sorted(t.name for t in request.tools)


class HangsOnComplete(ScriptedModel):
    """Answers the loop's calls from its script, but never answers ``complete`` (the preflight's)."""

    async def complete(self, request: ModelRequest) -> AssistantMessage:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def busy(r: ModelRequest) -> object:
    """Calls ``step`` for as long as it has tools; without them, says where it stopped."""
    return Reply(tool_calls=[call("step")]) if r.tools else "Stopped after a step."


# -- 1. the preflight's timeout ---------------------------------------------------------------------


async def test_a_preflight_model_that_never_answers_is_given_up_on_and_the_turn_goes_on() -> None:
    hung = HangsOnComplete([])
    model = ScriptedModel(["fine"])
    agent = Agent(model=model).use(ToolReveal(hidden=[weather], preflight=hung, preflight_timeout=0.1))
    began = time.monotonic()
    result = await asyncio.wait_for(agent.run("weather?"), 5)
    assert time.monotonic() - began < 2
    # as after a failed preflight: no extra tools, request_tools still there; the time was used
    # up by the first try, so the conversation's model was not asked a second time
    assert result.text == "fine" and names(model.requests[0]) == [REQUEST_TOOLS]
    assert len(model.requests) == 1


async def test_the_timeout_bounds_the_second_try_too() -> None:
    broken = ScriptedModel([ProviderError("down", kind="auth")])
    model = HangsOnComplete(["fine", "fine again"])  # the second try (its ``complete``) hangs
    agent = Agent(model=model).use(ToolReveal(hidden=[weather], preflight=broken, preflight_timeout=0.1))
    result = await asyncio.wait_for(agent.run("weather?"), 5)
    assert result.text == "fine" and names(model.requests[0]) == [REQUEST_TOOLS]
    result = await asyncio.wait_for(agent.run("again?"), 5)  # a new run asks again, and goes on again
    assert result.text == "fine again"


def test_the_preflight_timeout_is_checked() -> None:
    assert ToolReveal(hidden=[weather]).preflight_timeout == 15.0
    assert ToolReveal(hidden=[weather], preflight_timeout=60).preflight_timeout == 60.0
    for bad in (0, -1, 60.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="preflight_timeout"):
            ToolReveal(hidden=[weather], preflight_timeout=bad)
    for wrong in (True, "15", None):
        with pytest.raises(TypeError, match="preflight_timeout"):
            ToolReveal(hidden=[weather], preflight_timeout=wrong)  # type: ignore[arg-type]


# -- 2. pieces through the constructor and Kernel.open ----------------------------------------------


async def test_an_agent_takes_its_pieces_in_the_constructor() -> None:
    model = ScriptedModel([Reply(tool_calls=[call("submit", answer="42")]), "never asked"])

    @tool
    def submit(answer: str) -> str:
        """Hand in the answer."""
        return answer

    agent = Agent(model=model, tools=[submit], pieces=[ToolReveal(hidden=[weather]), StopAfterTools("submit")])
    result = await agent.run("go")
    assert names(model.requests[0]) == [REQUEST_TOOLS, "submit"]  # weather hidden
    assert result.stop_reason == "stop" and len(model.requests) == 1  # ended after submit
    with pytest.raises(ValueError, match="registered twice"):
        Agent(model=ScriptedModel([]), tools=[weather], pieces=[ToolReveal(hidden=[weather])])


async def test_kernel_open_takes_pieces(tmp_path: Path) -> None:
    """Composed in like any other ``Agent`` option: nobody reaches into ``kernel.engine.config``."""

    @tool
    def submit(answer: str) -> str:
        """Hand in the answer."""
        return answer

    model = ScriptedModel([Reply(tool_calls=[call("submit", answer="42")]), "never asked"])
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=model,
        workspace=tmp_path,
        tools=[submit],
        approval=approve_everything,
        pieces=[ToolReveal(hidden=[weather]), StopAfterTools("submit")],
    ) as k:
        assert {"weather", REQUEST_TOOLS} <= set(k.engine.config.tools)
        proc = await k.spawn(owner="me", text="hi")
        await asyncio.wait_for(proc.wait_idle(), 10)
        results = [m.text for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert REQUEST_TOOLS in names(model.requests[0]) and "weather" not in names(model.requests[0])
    assert results == ["42"] and len(model.requests) == 1  # the run ended after submit


# -- 3. post_turn hooks that stop the run -----------------------------------------------------------


def stop_after_first_turn(seen: list[int]) -> Any:
    def hook(info: TurnInfo) -> Stop | None:
        seen.append(info.turn)
        return Stop("enough for now") if info.turn == 0 else None

    return hook


async def test_a_post_turn_hook_stops_the_run_gently() -> None:
    model = ScriptedModel(busy)
    seen: list[int] = []
    agent = Agent(model=model, tools=[step], guards=Guards(max_rounds=4))  # (a backstop, not the stop)
    agent.hooks.on("post_turn")(stop_after_first_turn(seen))
    result = await asyncio.wait_for(agent.run("work"), 5)
    results = [m.text for m in result.messages if isinstance(m, ToolResultMessage)]
    # the turn's tool ran, then one last answer without tools, as ``Run.stop`` gives
    assert result.stop_reason == "stopped" and results == ["step done"]
    assert result.text == "Stopped after a step." and not model.requests[-1].tools
    assert len(model.requests) == 2 and seen == [0, 1]


async def test_a_stop_after_an_answer_just_ends_the_run() -> None:
    model = ScriptedModel(["done"])
    agent = Agent(model=model, tools=[step])
    agent.hooks.on("post_turn")(lambda info: Stop())
    result = await agent.run("hi")
    assert result.stop_reason == "stop" and result.text == "done" and len(model.requests) == 1


async def test_post_turn_hooks_returning_other_things_do_not_stop() -> None:
    model = ScriptedModel([Reply(tool_calls=[call("step")]), "done"])
    agent = Agent(model=model, tools=[step])
    agent.hooks.on("post_turn")(lambda info: True)  # (only ``Stop`` asks)
    result = await agent.run("hi")
    assert result.stop_reason == "stop" and result.text == "done"


async def test_a_post_turn_hook_stops_a_durable_run_the_same_way(tmp_path: Path) -> None:
    model = ScriptedModel(busy)
    seen: list[int] = []
    hooks = Hooks()
    hooks.on("post_turn")(stop_after_first_turn(seen))
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=model,
        workspace=tmp_path,
        tools=[step],
        approval=approve_everything,
        hooks=hooks,
        guards=Guards(max_rounds=4),
    ) as k:
        proc = await k.spawn(owner="a", text="work")
        await asyncio.wait_for(proc.wait_idle(), 10)
        finished = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.run.finished"]
        results = [m.text for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert [(f["status"], f["reason"]) for f in finished] == [("ok", "stopped")]
    assert results == ["step done"] and not model.requests[-1].tools and len(model.requests) == 2


# -- 4. queued input, one at a time or all at once ----------------------------------------------------


def users(request: ModelRequest) -> list[str]:
    return [m.text for m in request.messages if isinstance(m, UserMessage)]


async def test_steering_is_taken_one_at_a_time_by_default_or_all_at_once() -> None:
    one = ScriptedModel(["a", "b", "c"])
    run = Agent(model=one).start("hi")
    run.steer("first")
    run.steer("second")
    await run.result()
    assert [users(r) for r in one.requests] == [["hi", "first"], ["hi", "first", "second"]]

    every = ScriptedModel(["a", "b"])
    run = Agent(model=every, steering_mode="all").start("hi")
    run.steer("first")
    run.steer("second")
    result = await run.result()
    assert [users(r) for r in every.requests] == [["hi", "first", "second"]] and result.text == "a"


async def test_follow_ups_are_taken_one_at_a_time_by_default_or_all_at_once() -> None:
    one = ScriptedModel(["a", "b", "c"])
    run = Agent(model=one).start("hi")
    run.follow_up("x")
    run.follow_up("y")
    await run.result()
    assert [users(r)[-1] for r in one.requests] == ["hi", "x", "y"]

    every = ScriptedModel(["a", "b", "c"])
    run = Agent(model=every, follow_up_mode="all").start("hi")
    run.follow_up("x")
    run.follow_up("y")
    result = await run.result()
    assert [users(r) for r in every.requests] == [["hi"], ["hi", "x", "y"]] and result.text == "b"


def test_queue_modes_are_checked() -> None:
    with pytest.raises(ValueError, match="steering_mode"):
        Agent(model=ScriptedModel([]), steering_mode="some")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="follow_up_mode"):
        Agent(model=ScriptedModel([]), follow_up_mode="one")  # type: ignore[arg-type]
