"""Structured output: ``Agent.run(..., output_type=T)`` gives the run an output tool
(``final_result``) whose schema is ``T``'s; a valid call ends the run and ``RunResult.output`` is the
validated ``T``. Invalid arguments go back to the model as a validation error; a text answer is
nudged at most ``output_retries`` times, then the run ends with stop reason ``output_missing``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pytest
from pydantic import BaseModel
from typing_extensions import TypedDict  # pydantic wants this one before Python 3.12

from agentloop import Agent, Reply, ScriptedModel, call, tool
from agentloop.events import AgentEnd, ToolExecutionEnd
from agentloop.loop.output import OUTPUT_MISSING, OUTPUT_TOOL
from agentloop.messages import (
    SystemMessage,
    ToolResultMessage,
)
from agentloop.models.base import ModelRequest
from agentloop.tools.base import ToolResult


class City(BaseModel):
    """A city and its country."""

    name: str
    country: str
    population: int


@dataclass
class Point:
    x: int
    y: int


class Person(TypedDict):
    name: str
    age: int


@tool
def note(text: str) -> str:
    """Take a note."""
    return f"noted {text}"


def scripted(*replies: Reply | str) -> ScriptedModel:
    queue = list(replies)

    def brain(request: ModelRequest) -> Reply | str:
        return queue.pop(0) if queue else "the model was called once too often"

    return ScriptedModel(brain)


def tool_names(request: ModelRequest) -> list[str]:
    return [t.name for t in request.tools]


PARIS = {"name": "Paris", "country": "France", "population": 2_100_000}


async def test_a_model_output_is_the_typed_instance_after_one_model_call() -> None:
    model = scripted(Reply(text="here it is", tool_calls=[call("final_result", **PARIS)]))
    result = await Agent(model=model).run("Which is the capital of France?", output_type=City)
    assert len(model.requests) == 1
    assert result.stop_reason == "stop" and result.ok
    assert isinstance(result.output, City)
    assert result.output == City(**PARIS)
    assert result.text == "here it is"  # unchanged: the last assistant message's words
    spec = next(t for t in model.requests[0].tools if t.name == OUTPUT_TOOL)
    assert spec.parameters["type"] == "object"
    assert set(spec.parameters["properties"]) == {"name", "country", "population"}
    assert "final" in spec.description.lower()
    last = result.messages[-1]
    assert isinstance(last, ToolResultMessage) and last.terminate and last.details == PARIS


async def test_a_non_object_type_is_wrapped_in_result() -> None:
    model = scripted(Reply(tool_calls=[call("final_result", result=["a", "b"])]))
    result = await Agent(model=model).run("list two letters", output_type=list[str])
    assert result.output == ["a", "b"]
    spec = next(t for t in model.requests[0].tools if t.name == OUTPUT_TOOL)
    assert spec.parameters["type"] == "object"
    assert spec.parameters["required"] == ["result"]
    assert spec.parameters["properties"]["result"]["type"] == "array"
    last = result.messages[-1]
    assert isinstance(last, ToolResultMessage) and last.details == ["a", "b"]  # the value, unwrapped


async def test_literal_and_int_outputs() -> None:
    model = scripted(Reply(tool_calls=[call("final_result", result="yes")]))
    result = await Agent(model=model).run("yes or no?", output_type=Literal["yes", "no"])
    assert result.output == "yes"
    model = scripted(Reply(tool_calls=[call("final_result", result="42")]))
    number = await Agent(model=model).run("a number", output_type=int)
    assert number.output == 42  # coerced as tool arguments are


async def test_a_dataclass_output() -> None:
    model = scripted(Reply(tool_calls=[call("final_result", x=1, y="2")]))
    result = await Agent(model=model).run("a point", output_type=Point)
    assert result.output == Point(1, 2)


async def test_a_typed_dict_output() -> None:
    model = scripted(Reply(tool_calls=[call("final_result", name="Ada", age=36)]))
    result = await Agent(model=model).run("a person", output_type=Person)
    assert result.output == {"name": "Ada", "age": 36}


async def test_invalid_arguments_go_back_to_the_model_and_its_correction_is_the_output() -> None:
    model = scripted(
        Reply(tool_calls=[call("final_result", name="Paris", country="France", population="many")]),
        Reply(tool_calls=[call("final_result", **PARIS)]),
    )
    result = await Agent(model=model).run("capital of France", output_type=City)
    assert len(model.requests) == 2
    error = next(m for m in model.requests[1].messages if isinstance(m, ToolResultMessage))
    assert error.is_error and not error.terminate
    assert "Validation failed" in error.text and "population" in error.text
    assert result.output == City(**PARIS)
    assert result.stop_reason == "stop"


async def test_a_text_answer_is_nudged_and_the_call_that_follows_is_the_output() -> None:
    model = scripted("Paris, France.", Reply(tool_calls=[call("final_result", **PARIS)]))
    result = await Agent(model=model).run("capital of France", output_type=City)
    assert len(model.requests) == 2
    nudges = [m for m in model.requests[1].messages if isinstance(m, SystemMessage)]
    assert len(nudges) == 1 and "final_result" in nudges[0].text
    assert OUTPUT_TOOL in tool_names(model.requests[1])
    assert result.output == City(**PARIS) and result.stop_reason == "stop"


async def test_text_every_time_ends_after_the_nudges_without_an_exception() -> None:
    model = scripted("Paris.", "Paris!", "It is Paris.", "more")
    result = await Agent(model=model).run("capital of France", output_type=City)
    assert len(model.requests) == 3  # the answer and two nudges (output_retries defaults to 2)
    assert result.stop_reason == OUTPUT_MISSING == "output_missing"
    assert result.output is None and result.text == "It is Paris."
    assert result.error is None

    model = scripted("Paris.", "Paris!")
    once = await Agent(model=model, output_type=City, output_retries=0).run("capital?")
    assert len(model.requests) == 1 and once.stop_reason == "output_missing"


async def test_the_agents_tools_are_not_changed_by_a_run_with_an_output_type() -> None:
    model = scripted(Reply(tool_calls=[call("final_result", **PARIS)]), "plain answer")
    agent = Agent(model=model, tools=[note])
    before = dict(agent.tools)
    await agent.run("capital", output_type=City)
    assert agent.tools == before and OUTPUT_TOOL not in agent.config.tools
    plain = await agent.run("hello")
    assert plain.output is None and plain.stop_reason == "stop"
    assert tool_names(model.requests[0]) == ["note", OUTPUT_TOOL]
    assert tool_names(model.requests[1]) == ["note"]


async def test_the_run_argument_wins_over_the_constructor_default() -> None:
    model = scripted(
        Reply(tool_calls=[call("final_result", **PARIS)]),
        Reply(tool_calls=[call("final_result", x=3, y=4)]),
    )
    agent = Agent(model=model, output_type=City)
    default = await agent.run("capital")
    assert isinstance(default.output, City)
    chosen = await agent.run("a point", output_type=Point)
    assert chosen.output == Point(3, 4)


async def test_a_type_pydantic_cannot_handle_is_a_type_error() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError, match="output_type"):
        Agent(model=scripted(), output_type=Opaque)
    with pytest.raises(TypeError, match="output_type"):
        await Agent(model=scripted()).run("x", output_type=Opaque)


async def test_an_output_tool_name_taken_by_a_tool_is_refused() -> None:
    @tool
    def final_result(answer: str) -> str:
        """Mine."""
        return answer

    with pytest.raises(ValueError, match="final_result"):
        await Agent(model=scripted(), tools=[final_result]).run("x", output_type=City)


async def test_an_output_type_in_chat_mode_is_refused_but_a_default_is_not_applied() -> None:
    with pytest.raises(ValueError, match="chat"):
        await Agent(model=scripted()).run("x", output_type=City, mode="chat")
    model = scripted("just talk")
    result = await Agent(model=model, output_type=City).run("x", mode="chat")
    assert result.stop_reason == "stop" and result.output is None and model.requests[0].tools == []


async def test_output_with_another_tool_in_the_turn_gets_one_more_turn_and_stays_the_output() -> None:
    model = scripted(
        Reply(tool_calls=[call("final_result", **PARIS), call("note", text="x")]),
        "Done: Paris.",
    )
    result = await Agent(model=model, tools=[note]).run("capital", output_type=City)
    assert len(model.requests) == 2  # the note's result is read back; no nudge after the answer
    assert result.output == City(**PARIS) and result.stop_reason == "stop"
    assert result.text == "Done: Paris."


async def test_the_last_valid_output_is_the_output() -> None:
    model = scripted(
        Reply(tool_calls=[call("final_result", **PARIS), call("note", text="x")]),
        Reply(tool_calls=[call("final_result", name="Lyon", country="France", population=520_000)]),
    )
    result = await Agent(model=model, tools=[note]).run("a French city", output_type=City)
    assert result.output is not None and result.output.name == "Lyon"


async def test_streaming_events_arrive_and_agent_end_says_why() -> None:
    model = scripted(Reply(tool_calls=[call("final_result", result=["a"])]))
    agent = Agent(model=model, output_type=list[str])
    events = [e async for e in agent.stream("letters")]
    assert events[0].type == "agent_start" and isinstance(events[-1], AgentEnd)
    ends = [e for e in events if isinstance(e, ToolExecutionEnd)]
    assert len(ends) == 1 and ends[0].tool_name == OUTPUT_TOOL and not ends[0].is_error
    assert events[-1].stop_reason == "stop"

    model = scripted("no", "no", "no")
    missing = [e async for e in Agent(model=model, output_type=City).stream("capital")]
    assert isinstance(missing[-1], AgentEnd) and missing[-1].stop_reason == OUTPUT_MISSING


async def test_start_and_run_sync_take_an_output_type() -> None:
    model = scripted(Reply(tool_calls=[call("final_result", x=1, y=1)]))
    run = Agent(model=model).start("a point", output_type=Point)
    assert (await run.result()).output == Point(1, 1)


def test_run_sync_takes_an_output_type() -> None:
    model = scripted(Reply(tool_calls=[call("final_result", x=5, y=6)]))
    assert Agent(model=model).run_sync("a point", output_type=Point).output == Point(5, 6)


async def test_continuing_a_history_finds_the_output_there() -> None:
    """A history that ends with a valid output result ends at once, with that output; a new prompt
    after a finished run starts a new exchange, whose output is its own."""
    first = await Agent(model=scripted(Reply(tool_calls=[call("final_result", **PARIS)]))).run(
        "capital of France", output_type=City
    )
    model = scripted()
    resumed = await Agent(model=model).run(first.messages, output_type=City)
    assert model.requests == [] and resumed.output == City(**PARIS)

    model = scripted("Rome.", "Still Rome.", "Rome!")
    later = await Agent(model=model).run("and of Italy?", history=first.messages, output_type=City)
    assert later.output is None and later.stop_reason == OUTPUT_MISSING  # Paris was the last exchange's

    model = scripted(Reply(tool_calls=[call("final_result", name="Rome", country="Italy", population=2_700_000)]))
    italy = await Agent(model=model).run("and of Italy?", history=first.messages, output_type=City)
    assert italy.output is not None and italy.output.name == "Rome"


async def test_a_hook_that_makes_the_output_an_error_is_not_the_output() -> None:
    model = scripted(
        Reply(tool_calls=[call("final_result", **PARIS)]), Reply(tool_calls=[call("final_result", **PARIS)])
    )
    agent = Agent(model=model, output_type=City)
    refused = {"n": 0}

    @agent.hooks.after_tool_call
    def refuse_once(info: Any, result: ToolResult) -> ToolResult | None:
        if refused["n"] == 0:
            refused["n"] += 1
            return ToolResult.error("not yet")
        return None

    result = await agent.run("capital")
    assert len(model.requests) == 2 and result.output == City(**PARIS)


class Node(BaseModel):
    name: str
    children: list[Node] = []


async def test_a_recursive_model_is_not_wrapped() -> None:
    tree = {"name": "root", "children": [{"name": "leaf"}]}
    model = scripted(Reply(tool_calls=[call("final_result", **tree)]))
    result = await Agent(model=model).run("a tree", output_type=Node)
    spec = next(t for t in model.requests[0].tools if t.name == OUTPUT_TOOL)
    assert set(spec.parameters["properties"]) == {"name", "children"} and "$defs" in spec.parameters
    assert result.output == Node(name="root", children=[Node(name="leaf")])


async def test_a_run_continued_after_a_tool_result_can_end_with_its_output() -> None:
    """A history that ends with tool results (a run cut short, a stored conversation) continues;
    the output call made then ends it."""
    interrupted = await Agent(model=scripted(Reply(tool_calls=[call("note", text="x")])), tools=[note]).run(
        "note x, then name a city"
    )
    history = interrupted.messages[:-1]  # up to the note's result: the model's answer never came
    assert isinstance(history[-1], ToolResultMessage)
    model = scripted(Reply(tool_calls=[call("final_result", **PARIS)]))
    result = await Agent(model=model, tools=[note], output_type=City).run(history)
    assert len(model.requests) == 1 and result.output == City(**PARIS)


async def test_a_guard_that_ends_the_run_keeps_its_own_stop_reason() -> None:
    model = scripted(Reply(tool_calls=[call("note", text="x")]), "out of rounds", "more")
    result = await Agent(model=model, tools=[note], max_rounds=1).run("capital", output_type=City)
    assert result.stop_reason == "max_rounds" and result.output is None
    assert len(model.requests) == 2 and model.requests[1].tools == []  # the guard's last round: no nudge after it
