"""Review of the in-memory engine: event pairing on abort, failures that must not hang a stream,
and timeouts a tool raises itself."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest
from pydantic import BaseModel, field_validator

from agentloop import Agent, Reply, RetryPolicy, ScriptedModel, ToolResultMessage, call, tool
from agentloop.events import LoopEvent, StreamEvent
from agentloop.models.base import AssistantBuilder, ModelRequest, ProviderError, make_usage
from agentloop.tools.base import ToolResult


def assert_paired(events: list[LoopEvent]) -> None:
    """Every start has its end, in order: turns enclose messages and tool executions, a message
    ends before the next one starts, every tool execution that started ends, the run ends last."""
    assert events[0].type == "agent_start" and events[-1].type == "agent_end"
    open_turn = False
    open_message = False
    open_tools: set[str] = set()
    for e in events[1:-1]:
        if e.type == "turn_start":
            assert not open_turn, "turn_start inside a turn"
            open_turn = True
        elif e.type == "turn_end":
            assert open_turn and not open_message and not open_tools, f"turn_end with {open_tools or 'a message'} open"
            open_turn = False
        elif e.type == "message_start":
            assert open_turn and not open_message, "message_start outside a turn or inside a message"
            open_message = True
        elif e.type == "message_update":
            assert open_message, "message_update outside a message"
        elif e.type == "message_end":
            assert open_message, "message_end without message_start"
            open_message = False
        elif e.type == "tool_execution_start":
            assert open_turn and e.tool_call_id not in open_tools
            open_tools.add(e.tool_call_id)
        elif e.type == "tool_execution_end":
            assert e.tool_call_id in open_tools, "tool_execution_end without tool_execution_start"
            open_tools.discard(e.tool_call_id)
    assert not open_turn and not open_message and not open_tools, "the run ended with something open"


@tool
def echo(text: str) -> str:
    """Echo the text."""
    return text


@tool
async def slow(n: int) -> str:
    """Sleep for long."""
    await asyncio.sleep(10)
    return "late"


async def _stream_and_abort_when(agent: Agent, when: str) -> list[LoopEvent]:
    run = agent.start("go", stream=True)
    events: list[LoopEvent] = []
    async for e in run.events():
        events.append(e)
        if e.type == when:
            asyncio.get_running_loop().call_later(0.05, run.abort)
    return events


async def test_abort_during_parallel_tools_ends_every_tool_execution_and_the_turn() -> None:
    model = ScriptedModel([Reply(tool_calls=[call("echo", text="q"), call("slow", n=1), call("slow", n=2)])])
    events = await asyncio.wait_for(_stream_and_abort_when(Agent(model=model, tools=[echo, slow]), "message_end"), 2)
    assert events[-1].stop_reason == "aborted"
    assert_paired(events)
    ends = [e for e in events if e.type == "tool_execution_end"]
    assert [e.is_error for e in ends] == [False, True, True]
    turn_end = [e for e in events if e.type == "turn_end"][-1]
    assert [r.text for r in turn_end.tool_results] == ["q", *["Tool call cancelled: the run was aborted."] * 2]


async def test_abort_in_a_before_hook_announces_every_call_of_the_batch() -> None:
    model = ScriptedModel([Reply(tool_calls=[call("echo", text="a"), call("echo", text="b")])])
    agent = Agent(model=model, tools=[echo])

    @agent.hooks.before_tool_call
    async def wait(info: object) -> None:
        await asyncio.sleep(10)

    events = await asyncio.wait_for(_stream_and_abort_when(agent, "tool_execution_start"), 2)
    assert_paired(events)
    starts = [e.tool_call_id for e in events if e.type == "tool_execution_start"]
    ends = [e.tool_call_id for e in events if e.type == "tool_execution_end"]
    assert len(starts) == 2 and sorted(ends) == sorted(starts)
    results = [m for m in events[-1].messages if isinstance(m, ToolResultMessage)]
    assert [r.tool_call_id for r in results] == starts  # the history stays valid: one result per call


async def test_abort_mid_stream_ends_the_turn() -> None:
    model = ScriptedModel([Reply(text="x" * 400)], chunk=1)
    run = Agent(model=model).start("go", stream=True)
    events: list[LoopEvent] = []
    async for e in run.events():
        events.append(e)
        if e.type == "message_update" and len(e.message.text) > 20:
            run.abort()
    assert events[-1].stop_reason == "aborted"
    assert_paired(events)
    assert events[-2].type == "turn_end" and events[-2].message.stop_reason == "aborted"


async def test_abort_while_waiting_to_retry_does_not_end_a_message_that_never_started() -> None:
    model = ScriptedModel([ProviderError("overloaded", kind="server"), "never"])
    agent = Agent(model=model, retry=RetryPolicy(base_delay=5))
    events = await asyncio.wait_for(_stream_and_abort_when(agent, "model_retry"), 2)
    assert events[-1].stop_reason == "aborted"
    assert_paired(events)


async def test_usage_of_a_message_aborted_mid_stream_is_counted() -> None:
    """Providers report input tokens when the stream starts; an abort must not lose what was billed."""

    class Counting(ScriptedModel):
        async def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
            yield out.start()
            out.message.usage = make_usage(self.info, input=1000)
            for event in out.text("partial"):
                yield event
            await asyncio.sleep(10)

    events = await asyncio.wait_for(_stream_and_abort_when(Agent(model=Counting([])), "message_update"), 2)
    end = events[-1]
    assert end.stop_reason == "aborted" and end.messages[-1].usage.input == 1000
    assert end.usage.input == 1000


async def test_a_run_that_raises_ends_the_stream_instead_of_hanging() -> None:
    agent = Agent(model=ScriptedModel(["never"]))

    @agent.hooks.transform_context
    def broken(messages: list[object]) -> list[object]:
        raise ValueError("transform bug")

    async def consume() -> None:
        async for _ in agent.stream("hi"):
            pass

    with pytest.raises(ValueError, match="transform bug"):
        await asyncio.wait_for(consume(), 2)


async def test_a_waiter_on_a_streamed_run_that_raises_gets_the_error() -> None:
    agent = Agent(model=ScriptedModel(["never"]))

    @agent.hooks.transform_context
    def broken(messages: list[object]) -> list[object]:
        raise ValueError("transform bug")

    run = agent.start("hi", stream=True)
    waiter = asyncio.create_task(run.result())

    async def consume() -> None:
        async for _ in run.events():
            pass

    with pytest.raises(ValueError):
        await asyncio.wait_for(consume(), 2)
    with pytest.raises(ValueError, match="transform bug"):
        await asyncio.wait_for(waiter, 2)


async def test_a_timeout_the_tool_raises_itself_is_not_reported_as_the_runtime_timeout() -> None:
    @tool
    def connect() -> str:
        """Connect (a socket timeout is a TimeoutError)."""
        raise TimeoutError("connect to db:5432 timed out")

    @tool
    async def fetch() -> str:
        """Fetch with its own short deadline."""
        await asyncio.wait_for(asyncio.sleep(1), 0.001)
        return "never"

    model = ScriptedModel([Reply(tool_calls=[call("connect"), call("fetch")]), "ok"])
    result = await Agent(model=model, tools=[connect, fetch]).run("go")
    texts = [m.text for m in result.messages if isinstance(m, ToolResultMessage)]
    assert texts[0] == "TimeoutError: connect to db:5432 timed out"
    assert texts[1] == "TimeoutError"
    assert not any("60 s" in t for t in texts)


async def test_a_tool_raising_timeout_error_without_a_runtime_timeout_does_not_crash_the_run() -> None:
    @tool
    async def fetch() -> str:
        """Fetch with its own short deadline."""
        await asyncio.wait_for(asyncio.sleep(1), 0.001)
        return "never"

    model = ScriptedModel([Reply(tool_calls=[call("fetch")]), "ok"])
    result = await Agent(model=model, tools=[fetch], tool_timeout=None).run("go")
    assert result.text == "ok"
    r = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert r[0].is_error and r[0].text == "TimeoutError"


async def test_the_runtime_timeout_is_still_reported_as_such() -> None:
    model = ScriptedModel([Reply(tool_calls=[call("slow", n=1)]), "ok"])
    result = await Agent(model=model, tools=[slow], tool_timeout=0.01).run("go")
    r = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert r[0].is_error and r[0].text == "Tool slow timed out after 0.01 s"


async def test_a_tool_that_raises_cancelled_error_itself_fails_alone() -> None:
    """A CancelledError the tool did not get from an abort (it awaited work someone else
    cancelled) is that tool's failure: the run and the other calls go on."""
    finished: list[str] = []

    @tool
    async def flaky() -> str:
        """Await work that was cancelled elsewhere."""
        work = asyncio.get_running_loop().create_future()
        work.cancel()
        await work
        return "never"

    @tool
    async def steady() -> str:
        """Take a moment."""
        await asyncio.sleep(0.02)
        finished.append("steady")
        return "fine"

    for calls in ([call("flaky")], [call("flaky"), call("steady")]):
        model = ScriptedModel([Reply(tool_calls=calls), "ok"])
        result = await asyncio.wait_for(Agent(model=model, tools=[flaky, steady]).run("go"), 2)
        assert result.text == "ok"
        r = [m for m in result.messages if isinstance(m, ToolResultMessage)]
        assert r[0].is_error and r[0].text.startswith("CancelledError")
        assert [m.text for m in r[1:]] == ["fine"] * (len(calls) - 1)
    assert finished == ["steady"]


class Window(BaseModel):
    """A range whose validator has a bug: it raises TypeError, which pydantic passes through."""

    start: int
    end: int

    @field_validator("end")
    @classmethod
    def _after_start(cls, end: int) -> int:
        raise TypeError("unsupported operand")


async def test_a_validator_that_raises_something_else_fails_the_call_not_the_run() -> None:
    """Validation is the tool's: whatever its validator raises, the model is told and the run
    goes on (the TypeError reached the caller and the run ended without an answer)."""

    @tool
    def show(window: Window) -> str:
        """Show a window."""
        return "shown"

    def brain(req: ModelRequest) -> Reply | str:
        if isinstance(req.messages[-1], ToolResultMessage):
            return "told: " + req.messages[-1].text
        return Reply(tool_calls=[call("show", window={"start": 1, "end": 2})])

    result = await Agent(model=ScriptedModel(brain), tools=[show]).run("go")
    assert result.text.startswith("told: ") and "unsupported operand" in result.text


async def test_a_tool_whose_argument_model_is_defined_in_a_function_works() -> None:
    """With ``from __future__ import annotations`` (as in this module) annotations are strings;
    a model defined where the tool is (inside a function) resolves from that scope instead of
    failing the decoration with a NameError."""

    class Point(BaseModel):
        x: int
        y: int

    @tool
    def norm(point: Point) -> int:
        """Manhattan norm."""
        return abs(point.x) + abs(point.y)

    @tool(name="double_norm")
    def double(point: Point) -> int:
        """Twice the norm."""
        return 2 * (abs(point.x) + abs(point.y))

    assert norm.parameters["$defs"]["Point"]["properties"]["x"] == {"type": "integer"}
    result = await norm.run(norm.validate({"point": {"x": 3, "y": -4}}), None)  # type: ignore[arg-type]
    assert result.content == ToolResult.text("7").content
    assert double.validate({"point": {"x": 1, "y": 1}})["point"] == Point(x=1, y=1)
