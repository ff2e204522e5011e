"""Turn phases and modes: hooks that shape each model call, and chat mode (same history, no tools)."""

from __future__ import annotations

import logging

import pytest

from agentloop import Agent, Block, Reply, ScriptedModel, SystemMessage, call, tool


@tool
def echo(text: str) -> str:
    """Echo."""
    return text


@tool
def danger() -> str:
    """Danger."""
    return "boom"


async def test_phases_shape_the_request_in_order():
    model = ScriptedModel([Reply(tool_calls=[call("echo", text="x")]), "done"])
    agent = Agent(model=model, tools=[echo, danger], system_prompt="base")
    order: list[str] = []

    @agent.hooks.on("pre_policy")
    def policy(info):
        order.append(f"policy:{info.turn}")

    @agent.hooks.on("pre_prompt_context")
    async def context(info):
        order.append("context")
        return "Today is Tuesday."

    @agent.hooks.on("pre_tool_materialization")
    def hide_danger(info):
        order.append("tools")
        return [t for t in info.tools if t.name != "danger"]

    @agent.hooks.on("pre_prompt_compile")
    def compile_prompt(info):
        order.append("compile")
        return info.system_prompt.upper()

    turns: list[int] = []

    @agent.hooks.on("post_turn")
    def after(info):
        turns.append(info.turn)

    result = await agent.run("go")
    assert result.text == "done"
    assert order[:4] == ["policy:0", "context", "tools", "compile"]
    first = model.requests[0]
    assert first.system_prompt == "BASE\n\nTODAY IS TUESDAY."
    assert [t.name for t in first.tools] == ["echo"]
    assert agent.config.system_prompt == "base"  # per call, not permanent
    assert turns == [0, 1]


async def test_a_tool_a_hook_kept_back_cannot_be_called():
    model = ScriptedModel([Reply(tool_calls=[call("danger"), call("echo", text="x")]), "done"])
    agent = Agent(model=model, tools=[echo, danger])

    @agent.hooks.on("pre_tool_materialization")
    def hide_danger(info):
        return [t for t in info.tools if t.name != "danger"]

    result = await agent.run("go")
    danger_result, echo_result = (m for m in result.messages if m.role == "toolResult")
    assert danger_result.is_error and "not available in this turn" in danger_result.text
    assert echo_result.text == "x" and not echo_result.is_error


async def test_policy_block_fails_the_run_visibly():
    model = ScriptedModel(["never"])
    agent = Agent(model=model)

    @agent.hooks.on("pre_policy")
    def closed(info):
        return Block("outside office hours")

    result = await agent.run("go")
    assert result.stop_reason == "error" and "outside office hours" in (result.error or "")
    assert model.calls == 0
    assert isinstance(result.messages[-1], SystemMessage) and "outside office hours" in result.messages[-1].text


async def test_failing_policy_hook_fails_failing_context_hook_does_not(caplog):
    ok_model = ScriptedModel(["fine"])
    agent = Agent(model=ok_model)

    @agent.hooks.on("pre_prompt_context")
    def broken_context(info):
        raise RuntimeError("memory service down")

    with caplog.at_level(logging.WARNING, logger="agentloop.hooks"):
        result = await agent.run("go")
    assert result.text == "fine" and "memory service down" in caplog.text

    strict = Agent(model=ScriptedModel(["never"]))

    @strict.hooks.on("pre_prompt_compile")
    def broken_compile(info):
        raise RuntimeError("template error")

    failed = await strict.run("go")
    assert failed.stop_reason == "error" and "pre_prompt_compile hook failed: template error" in (failed.error or "")


def test_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown hook phase"):
        Agent(model=ScriptedModel([])).hooks.on("whenever")  # type: ignore[arg-type]


async def test_chat_mode_sends_no_tools_on_the_same_history():
    model = ScriptedModel([Reply(tool_calls=[call("echo", text="a")]), "tool answer", "chatty answer"])
    agent = Agent(model=model, tools=[echo])
    first = await agent.run("use a tool")
    second = await agent.run("just talk", history=first.messages, mode="chat")
    assert model.requests[-1].tools == [] and second.text == "chatty answer"
    assert len(second.messages) == len(first.messages) + 2
    with pytest.raises(ValueError, match="mode must be"):
        agent.start("x", mode="shout")  # type: ignore[arg-type]
