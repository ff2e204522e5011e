"""Unusable answers (``models/unusable.py``): a call that finishes with nothing the loop can act on
(no text and no tool call, thinking only, or a tool call leaked as markup into the text) is asked
again like a transient failure, reported the same way, and ends the run as an error when it never
gets better; in memory and durably alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentloop import Agent, Reply, Run, ScriptedModel, SystemMessage, call, tool
from agentloop.events import LoopEvent, ModelRetry
from agentloop.kernel import Kernel
from agentloop.loop.model_call import MAX_UNUSABLE_RETRIES
from agentloop.messages import AssistantMessage, TextContent, ThinkingContent, UserMessage
from agentloop.models.base import ModelRequest
from agentloop.models.scripted import Scripted
from agentloop.models.unusable import EMPTY, REASONING_ONLY, TOOL_MARKUP, has_tool_markup, unusable
from agentloop.process.api import approve_everything

from .test_local_protocol import FakeLlama
from .test_local_protocol import model as local_model


@tool
def echo(text: str) -> str:
    """Say ``text`` back."""
    return text


HERMES = '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>'
BAD: dict[str, tuple[Scripted, str]] = {
    "empty": ("", EMPTY),
    "whitespace": (" \n\t ", EMPTY),
    "reasoning only": (Reply(thinking="Let me think about it..."), REASONING_ONLY),
    "tool call markup": (f"I will call it.\n{HERMES}", TOOL_MARKUP),
}


def script(*replies: Scripted) -> ScriptedModel:
    """The replies in order, each answering one call."""
    return ScriptedModel(list(replies))


async def collect(agent: Agent, text: str) -> list[LoopEvent]:
    return [e async for e in agent.stream(text)]


def retries(events: list[LoopEvent]) -> list[ModelRetry]:
    return [e for e in events if isinstance(e, ModelRetry)]


# ------------------------------------------------------------------ what is unusable


@pytest.mark.parametrize(
    "text",
    [
        HERMES,
        "<|tool_call|>echo(text='hi')",
        "<function=echo>\n<parameter=text>hi</parameter>\n</function>",
        '[TOOL_CALLS][{"name": "echo", "arguments": {}}]',
        "<|python_tag|>echo.call(text='hi')",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>echo",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.echo:0",
        '<function_calls><invoke name="echo"></invoke></function_calls>',
    ],
)
def test_raw_tool_call_markup_is_recognised(text: str) -> None:
    assert has_tool_markup(text)


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 42.",
        "Use a <div> for that, or call `echo` with a function=argument style.",
        "Hermes models write calls as:\n```xml\n<tool_call>{...}</tool_call>\n```",
        "Write `<tool_call>` around the JSON.",
    ],
)
def test_prose_and_quoted_markup_are_not_taken_for_a_leak(text: str) -> None:
    assert not has_tool_markup(text)


def test_what_makes_an_answer_unusable() -> None:
    def answer(*blocks: Any, stop_reason: Any = "stop") -> AssistantMessage:
        return AssistantMessage(content=list(blocks), stop_reason=stop_reason)

    assert unusable(answer(), tools_offered=True) == EMPTY
    assert unusable(answer(TextContent(text="  ")), tools_offered=False) == EMPTY
    assert unusable(answer(ThinkingContent(thinking="hm")), tools_offered=False) == REASONING_ONLY
    assert unusable(answer(TextContent(text=HERMES)), tools_offered=True) == TOOL_MARKUP
    assert unusable(answer(TextContent(text=HERMES)), tools_offered=False) is None
    assert unusable(answer(TextContent(text="cut sh"), stop_reason="length"), tools_offered=True) is None


# ------------------------------------------------------------------ in memory


@pytest.mark.parametrize("case", list(BAD))
async def test_an_unusable_answer_is_asked_again_in_memory(case: str) -> None:
    bad, reason = BAD[case]
    model = script(bad, "the real answer")
    events = await collect(Agent(model=model, tools=[echo]), "hi")
    end = events[-1]
    assert [(r.attempt, r.error, r.delay) for r in retries(events)] == [(1, reason, 0.0)]
    assert end.type == "agent_end" and end.stop_reason == "stop" and end.error is None
    assert model.calls == 2
    assert [m.role for m in end.messages] == ["user", "assistant"]  # no trace of the bad answer
    assert end.messages[-1].text == "the real answer"
    assert end.usage.input == 20 and end.usage.output == 10  # the discarded call was billed too


async def test_a_discarded_attempt_is_shown_as_a_failed_one() -> None:
    events = await collect(Agent(model=script("", "fine")), "hi")
    ends = [e for e in events if e.type == "message_end" and isinstance(e.message, AssistantMessage)]
    assert [(e.message.stop_reason, e.message.error_message) for e in ends] == [("error", EMPTY), ("stop", None)]
    assert events.index(retries(events)[0]) == events.index(ends[0]) + 1  # as a failed call is retried


async def test_an_answer_that_stays_unusable_ends_the_run_with_an_error() -> None:
    model = script(*[Reply(thinking="hm")] * (MAX_UNUSABLE_RETRIES + 2))
    events = await collect(Agent(model=model), "hi")
    end = events[-1]
    attempts = MAX_UNUSABLE_RETRIES + 1
    assert model.calls == attempts and len(retries(events)) == MAX_UNUSABLE_RETRIES
    assert end.stop_reason == "error"
    assert end.error == f"the model gave no usable answer (reasoning only) after {attempts} attempts"
    last = end.messages[-1]
    assert isinstance(last, SystemMessage) and last.kind == "error" and end.error in last.text
    assert end.usage.input == 10 * attempts  # every attempt was billed


async def test_the_give_up_message_names_every_way_it_failed() -> None:
    model = script("", Reply(thinking="hm"), "", "")
    result = await Agent(model=model).run("hi")
    assert result.error == "the model gave no usable answer (empty answer, reasoning only) after 4 attempts"
    assert not result.ok


async def test_a_fallback_is_tried_after_the_primary_keeps_answering_nothing() -> None:
    from agentloop.models.base import ModelInfo

    backup = ScriptedModel(["from backup"], info=ModelInfo(provider="scripted", id="backup"))
    result = await Agent(model=script(*[""] * 4), fallbacks=[backup]).run("hi")
    assert result.ok and result.text == "from backup"


async def test_an_answer_cut_by_the_output_limit_is_not_retried() -> None:
    cut = AssistantMessage(content=[TextContent(text="The first half of")], stop_reason="length")
    model = script(cut, "never asked")
    events = await collect(Agent(model=model, tools=[echo]), "hi")
    assert model.calls == 1 and not retries(events)
    assert events[-1].stop_reason == "length" and events[-1].messages[-1].text == "The first half of"


async def test_a_real_tool_call_is_not_retried() -> None:
    model = script(Reply(tool_calls=[call("echo", text="x")]), "done")
    events = await collect(Agent(model=model, tools=[echo]), "hi")
    assert model.calls == 2 and not retries(events) and events[-1].stop_reason == "stop"


async def test_markup_in_text_without_tools_offered_is_an_answer() -> None:
    model = script(HERMES, "never asked")
    result = await Agent(model=model).run("how do Hermes models call tools?")
    assert model.calls == 1 and result.ok and result.text == HERMES


async def test_markup_in_the_tools_disabled_final_round_is_an_answer() -> None:
    from agentloop import Guards

    model = script(Reply(tool_calls=[call("echo", text="x")]), HERMES)
    result = await Agent(model=model, tools=[echo], guards=Guards(max_rounds=1)).run("hi")
    assert model.calls == 2 and not model.requests[-1].tools and result.text == HERMES


async def test_an_unusable_answer_is_not_retried_while_the_run_is_aborted() -> None:
    runs: list[Run] = []

    def brain(r: ModelRequest) -> str:
        runs[0].abort()  # (from inside the run's task: the flag is set, nothing is cancelled yet)
        return ""

    model = ScriptedModel(brain)
    runs.append(Agent(model=model).start("hi"))
    result = await runs[0].result()
    assert result.stop_reason == "aborted" and model.calls == 1


async def test_the_local_model_leaves_empty_answers_to_the_same_rule() -> None:
    fake = FakeLlama("   ", "an answer")
    events = await collect(Agent(model=local_model(fake)), "hi")
    assert [r.error for r in retries(events)] == [EMPTY] and len(fake.calls) == 2
    assert events[-1].stop_reason == "stop" and events[-1].messages[-1].text == "an answer"


# ------------------------------------------------------------------ durable


def kernel(tmp_path: Path, model: ScriptedModel) -> Kernel:
    return Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[echo], approval=approve_everything
    )


@pytest.mark.parametrize("case", list(BAD))
async def test_an_unusable_answer_is_asked_again_durably(tmp_path: Path, case: str) -> None:
    bad, reason = BAD[case]
    model = script(bad, "the real answer")
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a", text="hi")
        await proc.wait_idle()
        signals = [s async for s in proc.signals(follow=False)]
        messages = await proc.messages()
    retrying = [s.payload for s in signals if s.signal == "proc.run.retrying"]
    finished = [s.payload for s in signals if s.signal == "proc.run.finished"]
    assert [(r["attempt"], r["reason"], r["fallback"]) for r in retrying] == [(1, reason, False)]
    assert [(f["status"], f["text"]) for f in finished] == [("ok", "the real answer")]
    assert finished[0]["usage"]["input"] == 20  # the discarded call was billed too
    assert [type(m) for m in messages] == [UserMessage, AssistantMessage]
    assert messages[-1].text == "the real answer"


async def test_a_durable_run_that_never_gets_an_answer_ends_with_an_error(tmp_path: Path) -> None:
    model = script(*[""] * (MAX_UNUSABLE_RETRIES + 1))
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a", text="hi")
        await proc.wait_idle()
        signals = [s async for s in proc.signals(follow=False)]
        messages = await proc.messages()
    retrying = [s.payload["attempt"] for s in signals if s.signal == "proc.run.retrying"]
    finished = [s.payload for s in signals if s.signal == "proc.run.finished"]
    assert retrying == list(range(1, MAX_UNUSABLE_RETRIES + 1))
    message = "the model gave no usable answer (empty answer) after 4 attempts"
    assert [(f["status"], f["error"]) for f in finished] == [("error", message)]
    assert finished[0]["usage"]["input"] == 40
    assert isinstance(messages[-1], SystemMessage) and message in messages[-1].text
