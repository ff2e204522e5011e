"""Review of the in-memory ``Compaction`` piece (loop/compaction.py, loop/runner.py): cases the
first tests left out."""

from __future__ import annotations

import asyncio
from typing import Any

from agentloop import Agent, Compaction, Reply, ScriptedModel, SystemMessage, call, tool
from agentloop.loop.compaction import SUMMARY_KIND, SUMMARY_SYSTEM_PROMPT, estimated_context
from agentloop.loop.reveal import ToolReveal
from agentloop.messages import AssistantMessage, user
from agentloop.models.base import ModelInfo, ModelRequest, ProviderError

WIDE = ModelInfo(provider="scripted", id="wide", context_window=10_000, max_output=200)
USABLE = WIDE.context_window - WIDE.max_output
# a system prompt that alone fills 95% of the usable window: past a 0.9 threshold by itself
BIG_PROMPT = "x" * int(USABLE * 0.95 * 4)
SMALL = ModelInfo(provider="scripted", id="small", context_window=3_000, max_output=200)


@tool
def note(n: int) -> str:
    """Return a short note."""
    return f"note {n}: " + "abc " * 60  # about 60 tokens


@tool
def page(n: int) -> str:
    """Return a page."""
    return f"page {n}: " + "lorem ipsum dolor sit amet " * 60  # about 400 tokens


class Brain:
    """Calls ``tool`` ``fills`` times, then answers; counts its prompt as the estimate does and,
    like a provider, refuses a request past the window; answers summary requests."""

    def __init__(self, tool: str, fills: int) -> None:
        self.tool, self.fills = tool, fills
        self.steps = self.summaries = self.refused = 0
        self.conversation: list[ModelRequest] = []

    def __call__(self, r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            self.summaries += 1
            return Reply(text=f"Summary {self.summaries}.", input_tokens=50, output_tokens=10)
        used = estimated_context(r.system_prompt, r.tools, r.messages)
        if used > WIDE.context_window:
            self.refused += 1
            return ProviderError(f"prompt is too long: {used} tokens > {WIDE.context_window} maximum", kind="overflow")
        self.conversation.append(r)
        self.steps += 1
        if self.steps <= self.fills:
            return Reply(tool_calls=[call(self.tool, n=self.steps)], input_tokens=used)
        return Reply(text="done", input_tokens=used)


def _old_history(turns: int) -> list[Any]:
    """A finished conversation of ``turns`` long exchanges, without usage."""
    out: list[Any] = []
    for i in range(turns):
        out += [user(f"question {i}: " + "lorem ipsum dolor sit amet " * 60), AssistantMessage(content=[])]
    return out


def _summaries(messages: list[Any]) -> int:
    return sum(1 for m in messages if isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND)


async def test_a_system_prompt_past_the_threshold_by_itself_is_not_summarised_at_every_call() -> None:
    """Before: every model call from the fourth message on paid for a summary (the system prompt
    alone kept the context past the threshold, whatever the summary removed) and the model was
    left with the last exchange only. Now the run goes on whole while the usable window holds
    it, and compacts only where the next call would not fit it."""
    brain = Brain("note", fills=5)
    agent = Agent(model=ScriptedModel(brain, info=WIDE), tools=[note], system_prompt=BIG_PROMPT, pieces=[Compaction()])
    result = await agent.run("take notes")
    assert result.stop_reason == "stop" and result.text == "done"
    assert brain.summaries == 0 and brain.refused == 0
    assert _summaries(result.messages) == 0 and len(result.messages) == 2 + 2 * 5
    assert len(brain.conversation[-1].messages) == 1 + 2 * 5  # the last call saw the whole run

    # a longer run: summarised only where a call would not fit the window, never refused
    brain = Brain("note", fills=30)
    agent = Agent(model=ScriptedModel(brain, info=WIDE), tools=[note], system_prompt=BIG_PROMPT, pieces=[Compaction()])
    result = await agent.run("take many notes")
    assert result.stop_reason == "stop" and result.text == "done" and brain.refused == 0
    sizes = [estimated_context(r.system_prompt, r.tools, r.messages) for r in brain.conversation]
    assert max(sizes) < USABLE
    assert 1 <= brain.summaries <= len(brain.conversation) // 2  # (before: 27 summaries in 31 calls)

    # pages: each call past the usable window is compacted before it is made, never refused
    brain = Brain("page", fills=6)
    agent = Agent(model=ScriptedModel(brain, info=WIDE), tools=[page], system_prompt=BIG_PROMPT, pieces=[Compaction()])
    result = await agent.run("read pages")
    assert result.stop_reason == "stop" and result.text == "done"
    assert brain.refused == 0 and brain.summaries >= 1 and _summaries(result.messages) == 1


async def test_an_abort_during_the_overflow_summary_keeps_the_refused_calls_usage() -> None:
    """A provider that cut the prompt without saying so answered, and billed, a reply whose input
    is past the window; the piece compacts before asking again. Before: an abort while the summary
    was being written dropped that billed reply's usage from the run's (it was added only once the
    compaction succeeded)."""
    writing = asyncio.Event()

    async def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            writing.set()
            await asyncio.sleep(30)  # aborted before it ends
        return Reply(text="cut short", input_tokens=5_000, output_tokens=7)

    agent = Agent(model=ScriptedModel(brain, info=SMALL), pieces=[Compaction()])
    run = agent.start("go on", history=_old_history(4))
    task = asyncio.ensure_future(run.result())
    await asyncio.wait_for(writing.wait(), 5)
    run.abort()
    result = await asyncio.wait_for(task, 5)
    assert result.stop_reason == "aborted"
    assert result.usage.input == 5_000 and result.usage.output == 7
    assert not any(isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND for m in result.messages)


def _hidden(i: int) -> Any:
    def fn(q: str) -> str:
        return q

    return tool(name=f"hidden_{i}", description=f"Hidden tool {i}.\n" + "It does many things. " * 60)(fn)


async def test_tools_kept_hidden_do_not_count_as_the_context_a_summary_cannot_shrink() -> None:
    """``ToolReveal`` keeps a catalogue out of the calls to save room. Measured as sent, the run is
    compacted at its threshold; with the hidden catalogue counted as part of every call's prompt
    (an estimate past the threshold by itself) the check of the first test would take the
    threshold for out of reach and wait until the usable window was full. (A guard of that check:
    9ba0f85 passes it, by summarising at every call past the threshold.)"""
    hidden = [_hidden(i) for i in range(20)]
    brain = Brain("page", fills=14)
    agent = Agent(
        model=ScriptedModel(brain, info=WIDE), tools=[page], pieces=[ToolReveal(hidden), Compaction(threshold=0.5)]
    )
    result = await agent.run("read pages")
    assert result.stop_reason == "stop" and result.text == "done" and brain.summaries >= 1
    assert all(len(r.tools) == 2 for r in brain.conversation)  # page and request_tools: the rest stayed hidden
    sizes = [estimated_context(r.system_prompt, r.tools, r.messages) for r in brain.conversation]
    assert max(sizes) < 0.6 * USABLE
