"""Review of durable compaction's shared rule (``compaction_due``) and of ToolRetry's recount of a
resumed run: the cases the two changes left out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentloop import Agent, Compaction, Reply, ScriptedModel, ToolReveal, call, tool
from agentloop.kernel import Kernel
from agentloop.loop.compaction import SUMMARY_SYSTEM_PROMPT, estimate_tokens, estimated_context
from agentloop.loop.hooks import ToolCallInfo, TurnInfo
from agentloop.loop.tool_retry import ToolRetry
from agentloop.messages import AssistantMessage, Message, TextContent, ToolCall, tool_error_result, user
from agentloop.models.base import ModelInfo, ModelRequest, ProviderError
from agentloop.tools.base import Tool, ToolResult

# ------------------------------------------------------------------ durable compaction, hidden tools

WIDE = ModelInfo(provider="scripted", id="wide", context_window=10_000, max_output=200)


@tool
def page(n: int) -> str:
    """Return a page."""
    return f"page {n}: " + "lorem ipsum dolor sit amet " * 60  # about 400 tokens


async def _noop() -> ToolResult:
    return ToolResult.text("ok")


def _hidden(count: int = 20) -> list[Tool]:
    """A catalogue of hidden tools larger than the window by itself (a tool list ``ToolReveal``
    exists to keep out of the prompt)."""
    return [
        Tool.from_schema(f"hidden_{i}", f"Hidden tool {i}.\n" + "details " * 300, {"type": "object"}, _noop)
        for i in range(count)
    ]


class Brain:
    """Reads pages, then answers; counts its prompt as the estimate does, reports it as usage, and,
    like a provider, refuses a request past the window."""

    def __init__(self, fills: int) -> None:
        self.fills = fills
        self.steps = self.refused = self.summaries = 0
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
            return Reply(tool_calls=[call("page", n=self.steps)], input_tokens=used)
        return Reply(text="done", input_tokens=used)


async def test_durable_compaction_measures_the_tools_a_call_is_shown_not_a_hidden_catalogue(tmp_path: Path) -> None:
    """With ``ToolReveal`` hiding a catalogue that alone is past the threshold, the calls are shown
    a short list. The in-memory runner measures that list (``state.offered``); the durable one
    measured the whole catalogue since it took ``compaction_due``: the prompt and tools "alone"
    looked past the window, so it never compacted at the threshold and left every compaction to
    a request the provider refused as too long (a run whose policy fails on overflow fails)."""
    catalogue = _hidden()
    assert estimate_tokens([t.spec for t in catalogue]) > WIDE.context_window  # (the premise)
    brain = Brain(fills=30)
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=ScriptedModel(brain, info=WIDE),
        workspace=tmp_path,
        tools=[page],
        pieces=[ToolReveal(hidden=catalogue)],
        heartbeat=None,
        daily_memory=False,
    ) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("read many pages")
        await proc.wait_idle()
        messages = await proc.messages()
        compactions = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.compacted"]
    assert messages[-1].text == "done"
    assert all(len(r.tools) <= 2 for r in brain.conversation)  # (the catalogue stayed hidden)
    assert compactions and {c["reason"] for c in compactions} == {"threshold"}  # before: only "overflow"
    assert brain.refused == 0  # before: refused as too long before each compaction
    # and it keeps the tail the in-memory rule keeps (a quarter of the room the shown tools leave),
    # not the least one (before: the catalogue "filled" the room, every old page was cleared)
    assert compactions[0]["tokensAfter"] > 2_000  # before: about 1,100


async def test_in_memory_compaction_with_the_same_hidden_catalogue_compacts_at_the_threshold() -> None:
    """The in-memory runner, the reference the durable one was meant to follow."""
    brain = Brain(fills=30)
    agent = Agent(
        model=ScriptedModel(brain, info=WIDE),
        tools=[page],
        pieces=[ToolReveal(hidden=_hidden()), Compaction()],
    )
    result = await agent.run("read many pages")
    assert result.text == "done" and brain.summaries >= 1 and brain.refused == 0


# ------------------------------------------------------------------ ToolRetry: the recount's reach

LINE = "\n[tool retry: class=not_found; retries left: rounds 31/32, not_found 1/2; hint: look]"


def _batch(call_id: str, text: str) -> list[Message]:
    calls = [ToolCall(id=call_id, name="Read", arguments={"path": call_id})]
    return [AssistantMessage(content=list(calls)), tool_error_result(calls[0], text)]


def _next_failure(piece: ToolRetry, history: list[Message], run_id: str, call_id: str) -> str:
    """The budget line the after hook gives the run's next not-found failure."""
    assistant, _ = _batch(call_id, "")
    info = ToolCallInfo(assistant.tool_calls[0], {}, assistant, history, run_id, conversation="p")
    out = piece.after_tool_call(info, ToolResult(f"File not found: {call_id}", is_error=True))
    assert out is not None
    text = out.content[-1]
    assert isinstance(text, TextContent)
    return text.text


def test_a_resumed_run_is_not_charged_with_an_aborted_runs_failures() -> None:
    """A durable run aborted while its model call was under way (or waiting out an outage) leaves
    nothing at its end: its history ends with its last batch's results. The next run, resumed by a
    new ``Kernel.open`` after one failed batch (turn 1), was counted back through its own input
    into the aborted run: three not-found failures where it had one, its budget (two) "spent", the
    model told the run was ending and the run stopped at its next failure. A run's own batches are
    at most its turn (each batch opens the next turn), so no more are counted."""
    history: list[Message] = [
        user("the aborted run"),
        *_batch("a1", "File not found: a1" + LINE),
        *_batch("a2", "File not found: a2" + LINE.replace("not_found 1/2", "not_found 0/2")),
        user("a new run"),  # (after an abort with nothing to append: no answer, no cancelled call)
        *_batch("b1", "File not found: b1" + LINE),
    ]
    piece = ToolRetry()
    told = piece.pre_prompt_context(TurnInfo("b", 1, history, "", [], conversation="p"))
    assert told is None  # before: "The run is ending because a tool retry budget is spent ..."
    line = _next_failure(piece, history, "b", "b2")
    assert "retries left" in line and "not_found 0/2" in line  # before: "the run is stopping"


def test_a_resumed_runs_batch_seen_first_by_post_turn_counts_only_the_runs_own_batches() -> None:
    """The same reach when the first hook to see the resumed run is ``post_turn`` (a restart
    while the batch ran): the batches before it are at most its turn."""
    history: list[Message] = [
        user("the aborted run"),
        *_batch("a1", "File not found: a1" + LINE),
        *_batch("a2", "File not found: a2" + LINE.replace("not_found 1/2", "not_found 0/2")),
        user("a new run"),
        *_batch("b1", "File not found: b1" + LINE),
        *_batch("b2", "File not found: b2"),  # (this batch: no line, its call cut off by the restart)
    ]
    piece = ToolRetry()
    assert piece.post_turn(TurnInfo("b", 1, history, "", [], conversation="p")) is None  # before: Stop(...)
    told = piece.pre_prompt_context(TurnInfo("b", 2, history, "", [], conversation="p"))
    assert told is not None and "retries left" in told and "budget is spent" not in told
