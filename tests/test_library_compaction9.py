"""The ``Compaction`` piece: an in-memory run summarises its older history past a share of the
model's window, and compacts and retries once when the provider refuses a call as too long."""

from __future__ import annotations

from typing import Any

from agentloop import Agent, Compaction, Reply, ScriptedModel, SystemMessage, call, tool
from agentloop.events import ModelRetry
from agentloop.loop.compaction import SUMMARY_KIND, SUMMARY_SYSTEM_PROMPT, estimated_context
from agentloop.messages import AssistantMessage, Message, TextContent, ToolResultMessage, user
from agentloop.models.base import ModelInfo, ModelRequest, ProviderError

SMALL = ModelInfo(provider="scripted", id="small", context_window=3_000, max_output=200)
OVERFLOW = "prompt is too long: 5210 tokens > 3000 maximum"
CHUNK = "lorem ipsum dolor sit amet " * 60  # about 400 tokens


@tool
def dump(n: int) -> str:
    """Return a long text."""
    return f"chunk {n}: {CHUNK}"


class Brain:
    """A scripted model that counts its prompt as a provider would (the estimate), answers the
    summary request with a summary, and otherwise calls ``dump`` ``fills`` times (``width`` calls
    at once) before answering; ``overflows`` conversation calls, from the first, are refused as too long."""

    def __init__(self, fills: int = 0, width: int = 1, overflows: int = 0) -> None:
        self.fills, self.width, self.overflows = fills, width, overflows
        self.steps = 0
        self.summaries = 0
        self.conversation: list[ModelRequest] = []  # the requests that were not summary requests

    def __call__(self, r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            self.summaries += 1
            return Reply(text=f"Summary {self.summaries}: chunks were dumped.", input_tokens=100, output_tokens=20)
        self.conversation.append(r)
        if self.overflows:
            self.overflows -= 1
            return ProviderError(OVERFLOW, kind="overflow", status=400)
        self.steps += 1
        used = estimated_context(r.system_prompt, r.tools, r.messages)
        if self.steps <= self.fills:
            calls = [call("dump", n=self.steps * 10 + i) for i in range(self.width)]
            return Reply(tool_calls=calls, input_tokens=used)
        return Reply(text="done", input_tokens=used)


def _agent(brain: Brain, *pieces: Any) -> Agent:
    return Agent(model=ScriptedModel(brain, info=SMALL), tools=[dump], pieces=pieces)


def _unsplit(messages: list[Message]) -> bool:
    """Every tool result follows the assistant message that made its call."""
    seen: set[str] = set()
    for m in messages:
        if isinstance(m, AssistantMessage):
            seen.update(c.id for c in m.tool_calls)
        elif isinstance(m, ToolResultMessage) and m.tool_call_id not in seen:
            return False
    return True


def _shape(messages: list[Message]) -> list[tuple[str, int, str]]:
    """What a history says, without its timestamps and call ids."""
    return [(m.role, len(m.content), getattr(m, "tool_name", "") or getattr(m, "text", "")) for m in messages]


def _is_summary(m: Message) -> bool:
    return isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND


def _old_history(turns: int) -> list[Message]:
    """A finished conversation of ``turns`` long exchanges."""
    out: list[Message] = []
    for i in range(turns):
        out.append(user(f"question {i}: {CHUNK}"))
        out.append(AssistantMessage(content=[TextContent(text=f"answer {i}")]))
    return out


async def test_threshold_compaction_between_turns_of_one_run() -> None:
    brain = Brain(fills=8)
    result = await _agent(brain, Compaction()).run("fill the context")
    assert result.stop_reason == "stop" and result.text == "done"
    assert brain.summaries >= 1  # the run went past 90% of the window and was summarised
    assert _is_summary(result.messages[0]) and "Summary" in result.messages[0].text
    assert not any(_is_summary(m) for m in result.messages[1:])  # a second summary rolls the first in
    # the run's own prompt was folded in: its new messages are the compacted history
    assert result.new_messages == result.messages
    # each call after a compaction sent the summary and stayed inside the window
    later = [r for r in brain.conversation if r.messages and _is_summary(r.messages[0])]
    assert later
    usable = SMALL.context_window - SMALL.max_output
    assert all(estimated_context(r.system_prompt, r.tools, r.messages) < usable for r in brain.conversation)
    assert result.usage.input >= 100 * brain.summaries  # the summary calls are the run's


async def test_compaction_of_older_history_keeps_new_messages_and_never_splits_tool_calls() -> None:
    brain = Brain(fills=6, width=2)  # two calls per step: results come in pairs
    history = _old_history(3)
    agent = _agent(brain, Compaction(threshold=0.5))
    result = await agent.run("dump in pairs", history=history)
    assert result.stop_reason == "stop" and brain.summaries >= 1
    assert _is_summary(result.messages[0])
    assert history[0].text.startswith("question 0")  # the caller's list is left as it was
    for r in brain.conversation:  # every request the provider saw kept each call with its results
        assert _unsplit(r.messages)
    assert _unsplit(result.messages)
    kept = result.messages[1:]
    assert not isinstance(kept[0], ToolResultMessage)

    # a summary of older history only: the run's messages stay exactly its own
    brain = Brain(fills=0)
    result = await _agent(brain, Compaction(threshold=0.5)).run("and now?", history=_old_history(6))
    assert brain.summaries == 1 and _is_summary(result.messages[0])
    assert [m.role for m in result.new_messages] == ["user", "assistant"]
    assert result.new_messages[0].text == "and now?" and result.text == "done"


async def test_overflow_compacts_and_retries_the_call_once() -> None:
    brain = Brain(overflows=1)  # the provider refuses the first call; its usage said nothing
    agent = _agent(brain, Compaction())
    events = [e async for e in agent.stream("go on", history=_old_history(4))]
    end = events[-1]
    assert end.type == "agent_end" and end.stop_reason == "stop"
    assert brain.summaries == 1 and len(brain.conversation) == 2
    assert any(isinstance(e, ModelRetry) and "too long" in e.error for e in events)
    retried = brain.conversation[1]
    assert _is_summary(retried.messages[0]) and len(retried.messages) < len(brain.conversation[0].messages)
    assert not any(isinstance(m, AssistantMessage) and m.stop_reason == "error" for m in end.messages)


async def test_a_second_overflow_ends_the_run_with_the_error() -> None:
    brain = Brain(overflows=5)
    result = await _agent(brain, Compaction()).run("go on", history=_old_history(4))
    assert result.stop_reason == "error" and result.error is not None and "too long" in result.error
    assert brain.summaries == 1 and len(brain.conversation) == 2  # one compaction, one retry


async def test_without_the_piece_nothing_changes() -> None:
    # an overflow ends the run at once: no summary, no retry, the history as it was
    brain = Brain(overflows=1)
    result = await _agent(brain).run("go on", history=_old_history(4))
    assert result.stop_reason == "error" and "too long" in (result.error or "")
    assert brain.summaries == 0 and len(brain.conversation) == 1
    assert not any(_is_summary(m) for m in result.messages)

    # below its threshold the piece changes nothing: the same requests, the same history
    runs = []
    for pieces in ((), (Compaction(),)):
        brain = Brain(fills=2)
        result = await _agent(brain, *pieces).run("two dumps")
        assert brain.summaries == 0
        runs.append(([_shape(r.messages) for r in brain.conversation], _shape(result.messages)))
    assert runs[0] == runs[1]
