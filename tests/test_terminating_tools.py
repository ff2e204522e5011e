"""Terminating tool results: a run ends after a turn whose every result says ``terminate``,
without another model call (pi's ``terminate: true``, users' ``stopAtToolNames``: a "submit" or
"final answer" tool whose result is the run's outcome). The flag is part of the stored result, so
the in-memory loop and a durable process (after a restart too) decide the same way."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from agentloop import Agent, Reply, ScriptedModel, StopAfterTools, call, tool
from agentloop.loop.hooks import Hooks, ToolCallInfo
from agentloop.loop.state import CallModel, Finish, decide
from agentloop.messages import (
    AssistantMessage,
    TextContent,
    ToolCall,
    ToolResultMessage,
    message_from_json,
    message_to_json,
    user,
)
from agentloop.models.base import ModelRequest
from agentloop.tools.base import ToolError, ToolResult
from tests.process_support import kernel


@tool
def submit(answer: str) -> ToolResult:
    """Hand in the final answer."""
    return ToolResult.text(f"submitted: {answer}", terminate=True)


@tool
def note(text: str) -> str:
    """Take a note."""
    return f"noted {text}"


@tool
def refuse(answer: str) -> str:
    """A submit that fails."""
    raise ToolError("not accepted")


def scripted(*replies: Reply | str) -> ScriptedModel:
    queue = list(replies)

    def brain(request: ModelRequest) -> Reply | str:
        return queue.pop(0) if queue else "the model was called once too often"

    return ScriptedModel(brain)


async def test_a_terminating_result_ends_the_run_without_another_model_call() -> None:
    model = scripted(Reply(text="handing in", tool_calls=[call("submit", answer="42")]))
    result = await Agent(model=model, tools=[submit]).run("solve it")
    assert len(model.requests) == 1
    assert result.stop_reason == "stop"
    last = result.messages[-1]
    assert isinstance(last, ToolResultMessage) and last.terminate and last.text == "submitted: 42"
    assert result.text == "handing in"


async def test_one_terminating_result_among_others_does_not_end_the_run() -> None:
    model = scripted(Reply(tool_calls=[call("submit", answer="42"), call("note", text="x")]), "done")
    result = await Agent(model=model, tools=[submit, note]).run("go")
    assert len(model.requests) == 2 and result.text == "done"


async def test_stop_after_tools_ends_on_a_success_and_lets_a_failure_be_retried() -> None:
    model = scripted(
        Reply(tool_calls=[call("refuse", answer="1")]),
        Reply(tool_calls=[call("note", text="a")]),
        Reply(text="final", tool_calls=[call("note", text="b")]),
    )
    agent = Agent(model=model, tools=[refuse, note]).use(StopAfterTools("refuse", "note"))
    result = await agent.run("go")
    # the failed call went back to the model; the first successful one ended the run
    assert len(model.requests) == 2
    results = [m for m in result.new_messages if isinstance(m, ToolResultMessage)]
    assert [(r.is_error, r.terminate) for r in results] == [(True, False), (False, True)]


async def test_an_after_tool_call_hook_may_terminate() -> None:
    hooks = Hooks()

    @hooks.after_tool_call
    def stop_on_note(info: ToolCallInfo, result: ToolResult) -> ToolResult:
        return ToolResult(result.content, details=result.details, terminate=True)

    model = scripted(Reply(tool_calls=[call("note", text="x")]))
    result = await Agent(model=model, tools=[note], hooks=hooks).run("go")
    assert len(model.requests) == 1 and result.stop_reason == "stop"


async def test_input_waiting_at_a_terminating_turn_is_still_answered() -> None:
    gate = asyncio.Event()

    @tool
    async def slow_submit(answer: str) -> ToolResult:
        """Hand in, slowly."""
        await gate.wait()
        return ToolResult.text("in", terminate=True)

    model = scripted(Reply(tool_calls=[call("slow_submit", answer="1")]), "about your question: yes")
    agent = Agent(model=model, tools=[slow_submit])
    run = agent.start("go")
    task = asyncio.ensure_future(run.result())
    await asyncio.sleep(0.05)
    run.steer("one more question")
    gate.set()
    result = await task
    assert len(model.requests) == 2 and result.text == "about your question: yes"


def test_the_flag_round_trips_and_decides_the_same_after_a_restart() -> None:
    asked = AssistantMessage(content=[TextContent(text="x"), ToolCall(id="c1", name="submit", arguments={})])
    done = ToolResultMessage(tool_call_id="c1", tool_name="submit", content=[], terminate=True)
    history = [user("go"), asked, message_from_json(message_to_json(done))]
    assert isinstance(decide(history, has_input=False, guard=None), Finish)
    assert isinstance(decide(history, has_input=True, guard=None), CallModel)
    plain = ToolResultMessage(tool_call_id=done.tool_call_id, tool_name="submit", content=[])
    assert isinstance(decide([*history[:2], plain], has_input=False, guard=None), CallModel)
    # an old stored result, written before the flag existed, reads as not terminating
    old = '{"role":"toolResult","toolCallId":"c","toolName":"submit","content":[],"isError":false,"timestamp":1}'
    assert message_from_json(old).terminate is False  # type: ignore[union-attr]


async def test_a_durable_process_ends_its_run_on_a_terminating_result(tmp_path: Path) -> None:
    model = scripted(Reply(text="handing in", tool_calls=[call("submit", answer="42")]))
    async with kernel(tmp_path, model, tools=[submit]) as k:
        proc = await k.spawn(owner="alice", text="solve it")
        await proc.wait_idle()
        history = [h.message for h in await proc.history()]
        finished = [s async for s in proc.signals(after_seq=0, follow=False) if s.signal == "proc.run.finished"]
    assert len(model.requests) == 1
    last: Any = history[-1]
    assert isinstance(last, ToolResultMessage) and last.terminate
    assert finished[-1].payload["status"] == "ok"
    assert finished[-1].payload["text"] == "handing in"  # the answer a watcher shows: the model's words
    # the store kept the flag: a reopened kernel reads the same history as finished
    async with kernel(tmp_path, scripted(), tools=[submit]) as k:
        proc = await k.process(proc.pid)
        await proc.wait_idle()
        again = [h.message for h in await proc.history()]
    assert isinstance(again[-1], ToolResultMessage) and again[-1].terminate
    assert isinstance(decide(again, has_input=False, guard=None), Finish)


async def test_stop_after_tools_as_a_kernels_hooks(tmp_path: Path) -> None:
    model = scripted(Reply(tool_calls=[call("note", text="x")]))
    async with kernel(tmp_path, model, tools=[note], hooks=StopAfterTools("note").hooks()) as k:
        proc = await k.spawn(owner="alice", text="go")
        await proc.wait_idle()
        last: Any = (await proc.history())[-1].message
    assert len(model.requests) == 1 and isinstance(last, ToolResultMessage) and last.terminate
