"""Durable compaction decides as the in-memory piece does (one rule in loop/compaction.py for
both: when to compact, how much history to keep, the ``pre_compaction`` hooks), and the in-memory
``Compaction`` piece honours its hooks and its options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentloop import Agent, Block, Compaction, Reply, ScriptedModel, SystemMessage, call, tool
from agentloop.kernel import Kernel
from agentloop.loop.compaction import SUMMARY_KIND, SUMMARY_SYSTEM_PROMPT, estimate_tokens, estimated_context
from agentloop.loop.hooks import TurnInfo
from agentloop.messages import AssistantMessage, Message, user
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
    like a provider, refuses a request past the window; answers summary requests (and keeps them)."""

    def __init__(self, tool: str, fills: int) -> None:
        self.tool, self.fills = tool, fills
        self.steps = self.refused = 0
        self.summary_requests: list[ModelRequest] = []
        self.conversation: list[ModelRequest] = []

    @property
    def summaries(self) -> int:
        return len(self.summary_requests)

    def __call__(self, r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            self.summary_requests.append(r)
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


def _kernel(tmp_path: Path, brain: Brain, info: ModelInfo, tools: list[Any], system_prompt: str) -> Any:
    return Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=ScriptedModel(brain, info=info),
        workspace=tmp_path,
        tools=tools,
        system_prompt=system_prompt,
        heartbeat=None,
        daily_memory=False,
    )


async def _compactions(proc: Any) -> list[dict[str, Any]]:
    return [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.compacted"]


def _summaries(messages: list[Any]) -> int:
    return sum(1 for m in messages if isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND)


# ------------------------------------------------------------------ durable: when to compact


async def test_a_durable_prompt_past_the_threshold_by_itself_is_not_summarised_at_every_step(tmp_path: Path) -> None:
    """Before: with a system prompt past the threshold by itself, the durable runner paid for a
    summary before nearly every model call of a run and left the model only its last exchange.
    Now (the in-memory piece's rule, shared) it goes on whole while the usable window holds it."""
    brain = Brain("note", fills=5)
    async with _kernel(tmp_path, brain, WIDE, [note], BIG_PROMPT) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("take notes")
        await proc.wait_idle()
        messages = await proc.messages()
        compactions = await _compactions(proc)
    assert messages[-1].text == "done" and brain.refused == 0
    assert brain.summaries == 0 and compactions == [] and _summaries(messages) == 0  # before: 2
    assert len(brain.conversation[-1].messages) == 1 + 2 * 5  # the last call saw the whole run


async def test_a_durable_prompt_past_the_threshold_compacts_where_the_next_call_would_not_fit(tmp_path: Path) -> None:
    """A longer run: each call that would not fit the usable window is compacted before it is made
    (never refused by the provider), and no more often than that."""
    brain = Brain("note", fills=20)
    async with _kernel(tmp_path, brain, WIDE, [note], BIG_PROMPT) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("take many notes")
        await proc.wait_idle()
        messages = await proc.messages()
        compactions = await _compactions(proc)
    assert messages[-1].text == "done" and brain.refused == 0
    assert len(compactions) == brain.summaries and {c["reason"] for c in compactions} == {"threshold"}
    assert 1 <= brain.summaries <= len(brain.conversation) // 2  # before: 17 in 21 calls
    sizes = [estimated_context(r.system_prompt, r.tools, r.messages) for r in brain.conversation]
    assert max(sizes) < USABLE


# ------------------------------------------------------------------ in memory: hooks and options


class Chunks:
    """Calls ``page`` ``fills`` times, then answers; usage as the estimate counts the prompt."""

    def __init__(self, fills: int, info: ModelInfo = SMALL) -> None:
        self.fills, self.info = fills, info
        self.steps = 0
        self.summary_requests: list[ModelRequest] = []
        self.conversation: list[ModelRequest] = []

    def __call__(self, r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            self.summary_requests.append(r)
            return Reply(text=f"Summary {len(self.summary_requests)}.", input_tokens=50, output_tokens=10)
        used = estimated_context(r.system_prompt, r.tools, r.messages)
        if used > self.info.context_window:
            return ProviderError(f"prompt is too long: {used} tokens", kind="overflow")
        self.conversation.append(r)
        self.steps += 1
        if self.steps <= self.fills:
            return Reply(tool_calls=[call("page", n=self.steps)], input_tokens=used)
        return Reply(text="done", input_tokens=used)


def _agent(brain: Any, *pieces: Any, info: ModelInfo = SMALL) -> Agent:
    return Agent(model=ScriptedModel(brain, info=info), tools=[page], pieces=pieces)


async def test_a_pre_compaction_hook_that_blocks_skips_the_in_memory_summary() -> None:
    """A ``Block`` from ``pre_compaction`` leaves the history whole: no summary call is made."""
    seen: list[TurnInfo] = []

    def veto(info: TurnInfo) -> Block:
        seen.append(info)
        return Block("keep everything")

    brain = Chunks(fills=4)
    agent = _agent(brain, Compaction(threshold=0.5))
    agent.config.hooks.on("pre_compaction")(veto)
    result = await agent.run("read pages")
    assert result.stop_reason == "stop" and result.text == "done"
    assert seen and brain.summary_requests == [] and _summaries(result.messages) == 0
    assert len(result.messages) == 2 + 2 * 4  # nothing folded away
    assert all(s.messages and s.run_id for s in seen)  # the hook saw the history it would fold


async def test_a_pre_compaction_hook_dict_is_carried_on_the_in_memory_summary() -> None:
    """What a ``pre_compaction`` hook returns as a dict lands on the summary's ``details``."""
    calls: list[int] = []

    def carry(info: TurnInfo) -> dict[str, Any]:
        calls.append(len(info.messages))
        return {"kept_by_hook": len(calls)}

    brain = Chunks(fills=4)
    agent = _agent(brain, Compaction(threshold=0.5))
    agent.config.hooks.on("pre_compaction")(carry)
    result = await agent.run("read pages")
    assert result.stop_reason == "stop" and brain.summary_requests and calls
    summary = result.messages[0]
    assert isinstance(summary, SystemMessage) and summary.kind == SUMMARY_KIND
    assert summary.details == {"kept_by_hook": len(calls)}


async def test_the_in_memory_threshold_decides_when_to_compact() -> None:
    """The same run is summarised at a low threshold and left whole at the default one."""
    low, default = Chunks(fills=3), Chunks(fills=3)
    at_low = await _agent(low, Compaction(threshold=0.3)).run("read pages")
    at_default = await _agent(default, Compaction()).run("read pages")
    assert at_low.text == at_default.text == "done"
    assert low.summary_requests and _summaries(at_low.messages) >= 1
    assert default.summary_requests == [] and len(at_default.messages) == 2 + 2 * 3


async def test_the_in_memory_keep_recent_tokens_sets_the_tail_a_summary_keeps() -> None:
    """``keep_recent_tokens`` is the least tail kept: a large one keeps more of the history than the
    default, a small one less; each kept tail holds at least what was asked (where it fits)."""
    history = [m for i in range(6) for m in (user(f"question {i}: " + "lorem ipsum " * 120), AssistantMessage())]
    kept: dict[int | None, list[Message]] = {}
    for keep in (None, 300, 1_200):
        brain = Chunks(fills=0)
        result = await _agent(brain, Compaction(threshold=0.5, keep_recent_tokens=keep)).run(
            "and now?", history=history
        )
        assert result.text == "done" and len(brain.summary_requests) == 1
        assert isinstance(result.messages[0], SystemMessage) and result.messages[0].kind == SUMMARY_KIND
        kept[keep] = result.messages[1:-1]  # the tail kept (before this run's answer)
    assert estimate_tokens(kept[1_200]) >= 1_200
    assert estimate_tokens(kept[300]) >= 300
    assert len(kept[300]) < len(kept[None]) < len(kept[1_200])


async def test_the_in_memory_summariser_and_instructions_are_used() -> None:
    """``summariser`` writes the summary instead of the agent's model, asked with ``instructions``."""
    writer = Chunks(fills=0)
    brain = Chunks(fills=3)
    piece = Compaction(
        threshold=0.3, summariser=ScriptedModel(writer, info=SMALL), instructions="Keep the page numbers."
    )
    result = await _agent(brain, piece).run("read pages")
    assert result.text == "done" and _summaries(result.messages) >= 1
    assert brain.summary_requests == [] and writer.summary_requests
    assert all("Keep the page numbers." in r.messages[0].text for r in writer.summary_requests)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"threshold": 0}, ValueError),
        ({"threshold": 1.5}, ValueError),
        ({"threshold": float("nan")}, ValueError),
        ({"threshold": "0.5"}, TypeError),
        ({"threshold": True}, TypeError),
        ({"keep_recent_tokens": 0}, ValueError),
        ({"keep_recent_tokens": 2.5}, ValueError),
    ],
)
def test_the_in_memory_options_are_checked(options: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        Compaction(**options)
