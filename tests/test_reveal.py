"""Hidden tools revealed by ``request_tools`` or by a preflight call."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentloop import Agent, Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.loop.reveal import ToolReveal
from agentloop.models.base import ProviderError


@tool
def echo(text: str) -> str:
    """Echo the text."""
    return text


@tool
def weather(city: str) -> str:
    """Tell the weather in a city."""
    return f"sunny in {city}"


@tool
def stock(symbol: str) -> str:
    """Quote a stock price."""
    return f"{symbol}: 42"


def names(request) -> list[str]:
    return sorted(t.name for t in request.tools)


async def test_request_tools_reveals_for_the_next_round():
    model = ScriptedModel(
        [
            Reply(tool_calls=[call("request_tools", names=["weather", "teleport"], reason="user asks")]),
            Reply(tool_calls=[call("weather", city="Oslo")]),
            "It is sunny.",
        ]
    )
    agent = Agent(model=model, tools=[echo]).use(ToolReveal(hidden=[weather, stock]))
    result = await agent.run("weather in Oslo?")
    assert names(model.requests[0]) == ["echo", "request_tools"]
    assert "weather: Tell the weather in a city." in model.requests[0].tools[1].description
    assert names(model.requests[1]) == ["echo", "request_tools", "weather"]
    first = next(m for m in result.messages if isinstance(m, ToolResultMessage))
    assert "weather" in first.text and "Not available: teleport" in first.text
    assert result.text == "It is sunny."
    # a later run on the same history keeps the revealed tool: the set is read from the history
    again = ScriptedModel(["ok"])
    follow = Agent(model=again, tools=[echo]).use(ToolReveal(hidden=[weather, stock]))
    await follow.run("and tomorrow?", history=result.messages)
    assert "weather" in names(again.requests[0])


async def test_hidden_tools_cannot_be_called_before_reveal_is_shown_but_run_goes_on():
    model = ScriptedModel([Reply(tool_calls=[call("request_tools", names=["weather", "stock"])]), "done"])
    agent = Agent(model=model).use(ToolReveal(hidden=[weather, stock]))
    await agent.run("go")
    assert names(model.requests[1]) == ["stock", "weather"]  # all revealed: request_tools is no longer shown


async def test_a_hidden_tool_called_without_reveal_is_refused_and_not_run():
    ran: list[str] = []

    @tool(name="weather")
    def spy(city: str) -> str:
        """Tell the weather in a city."""
        ran.append(city)
        return f"sunny in {city}"

    model = ScriptedModel(
        [Reply(tool_calls=[call("weather", city="Oslo")]), Reply(tool_calls=[call("echo", text="hi")]), "done"]
    )
    agent = Agent(model=model, tools=[echo]).use(ToolReveal(hidden=[spy]))
    result = await agent.run("weather in Oslo?")
    refused, echoed = (m for m in result.messages if isinstance(m, ToolResultMessage))
    assert refused.is_error and "weather is not available in this turn" in refused.text
    assert ran == []  # the model guessed the name: it was not offered, so it did not run
    assert echoed.text == "hi" and result.text == "done"  # offered tools run as before


async def test_preflight_reveals_up_front_and_failures_are_harmless():
    chooser = ScriptedModel(['Sure: {"visibleTools": ["stock", "nonsense"]}'])
    model = ScriptedModel(["fine", "fine again"])
    agent = Agent(model=model).use(ToolReveal(hidden=[weather, stock], preflight=chooser))
    await agent.run("price of ACME?")
    assert names(model.requests[0]) == ["request_tools", "stock"]
    assert "price of ACME?" in chooser.requests[0].messages[0].text

    # a preflight model that fails: the conversation's own model is asked once instead
    broken = ScriptedModel([ProviderError("down", kind="auth")])
    model2 = ScriptedModel(['{"visibleTools": ["weather"]}', "fine"])
    agent2 = Agent(model=model2).use(ToolReveal(hidden=[weather, stock], preflight=broken))
    result = await agent2.run("weather?")
    assert result.text == "fine" and names(model2.requests[1]) == ["request_tools", "weather"]
    assert model2.requests[0].system_prompt != model2.requests[1].system_prompt  # the first was the preflight

    # both fail: the turn goes on with nothing revealed
    model3 = ScriptedModel([ProviderError("also down", kind="auth"), "fine"])
    broken_too = ScriptedModel([ProviderError("down", kind="auth")])
    agent3 = Agent(model=model3).use(ToolReveal(hidden=[weather], preflight=broken_too))
    result = await agent3.run("hi")
    assert result.text == "fine" and names(model3.requests[1]) == ["request_tools"]


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="at least one hidden tool"):
        ToolReveal(hidden=[])
    with pytest.raises(ValueError, match="registered twice"):
        Agent(model=ScriptedModel([]), tools=[weather]).use(ToolReveal(hidden=[weather]))


async def test_a_tool_revealed_in_a_durable_process_can_be_called_the_next_turn(tmp_path) -> None:
    """The calls of a turn are checked against what that turn's model call was shown, not the
    turn before's (a review: the durable runner compared them with the previous list)."""
    from agentloop.kernel import Kernel

    @tool
    async def weather(city: str) -> str:
        """Weather for a city."""
        return f"sunny in {city}"

    def brain(r: Any) -> Any:
        done = [m for m in r.messages if isinstance(m, ToolResultMessage)]
        if not done:
            return Reply(tool_calls=[call("request_tools", names=["weather"])])
        return Reply(tool_calls=[call("weather", city="Oslo")]) if len(done) == 1 else "finished"

    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=ScriptedModel(brain),
        workspace=tmp_path,
        tools=[],
        pieces=[ToolReveal(hidden=[weather])],
    ) as k:
        proc = await k.spawn(owner="me")
        await proc.send("weather in Oslo?")
        await asyncio.wait_for(proc.wait_idle(), 10)
        results = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert [(r.tool_name, r.is_error, r.text) for r in results][-1] == ("weather", False, "sunny in Oslo")
