"""What the ``Compaction`` and ``ToolRetry`` pieces tell a watched in-memory run: a summary as
``compaction_start`` / ``compaction_end``, a tool retry episode as ``tool_retry_scheduled``,
``_resolved`` and ``_exhausted``; their wire form, and the CLI's one-line notes."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

from agentloop import Agent, Compaction, Reply, ScriptedModel, ToolRetry, call, tool
from agentloop.cli.render import JsonRenderer, TextRenderer, stderr_console
from agentloop.events import (
    AgentEnd,
    CompactionEnd,
    CompactionStart,
    LoopEvent,
    ModelRetry,
    ToolRetryExhausted,
    ToolRetryResolved,
    ToolRetryScheduled,
    TurnEnd,
    TurnStart,
    event_from_dict,
    event_to_dict,
)
from agentloop.loop.compaction import SUMMARY_SYSTEM_PROMPT, estimated_context
from agentloop.loop.hooks import TurnInfo
from agentloop.messages import AssistantMessage, Message, TextContent, ToolCall, tool_error_result, user
from agentloop.models.base import ModelInfo, ModelRequest, ProviderError
from agentloop.tools.base import ToolError

SMALL = ModelInfo(provider="scripted", id="small", context_window=3_000, max_output=200)
CHUNK = "lorem ipsum dolor sit amet " * 60  # about 400 tokens
OVERFLOW = "prompt is too long: 5210 tokens > 3000 maximum"


@tool
def dump(n: int) -> str:
    """Return a long text."""
    return f"chunk {n}: {CHUNK}"


def _brain(fills: int = 0, overflows: int = 0) -> Any:
    """Summaries for summary requests; otherwise ``fills`` calls of ``dump``, then "done"; the
    first ``overflows`` conversation calls are refused as too long."""
    left = {"fills": fills, "overflows": overflows}

    def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return Reply(text="Summary: chunks were dumped.", input_tokens=100, output_tokens=20)
        if left["overflows"]:
            left["overflows"] -= 1
            return ProviderError(OVERFLOW, kind="overflow", status=400)
        used = estimated_context(r.system_prompt, r.tools, r.messages)
        if left["fills"]:
            left["fills"] -= 1
            return Reply(tool_calls=[call("dump", n=left["fills"])], input_tokens=used)
        return Reply(text="done", input_tokens=used)

    return brain


def _old_history(turns: int) -> list[Message]:
    out: list[Message] = []
    for i in range(turns):
        out.append(user(f"question {i}: {CHUNK}"))
        out.append(AssistantMessage(content=[TextContent(text=f"answer {i}")]))
    return out


async def _events(agent: Agent, text: str, history: list[Message] | None = None) -> list[LoopEvent]:
    return [e async for e in agent.stream(text, history=history or [])]


def _compactions(events: list[LoopEvent]) -> list[CompactionStart | CompactionEnd]:
    return [e for e in events if isinstance(e, CompactionStart | CompactionEnd)]


# ------------------------------------------------------------------ compaction


async def test_a_threshold_compaction_is_told_as_start_then_end() -> None:
    agent = Agent(model=ScriptedModel(_brain(fills=8), info=SMALL), tools=[dump], pieces=[Compaction()])
    events = await _events(agent, "fill the context")
    assert isinstance(events[-1], AgentEnd) and events[-1].stop_reason == "stop"
    told = _compactions(events)
    assert told and len(told) % 2 == 0
    for start, end in zip(told[::2], told[1::2], strict=True):  # each start has its end, next
        assert isinstance(start, CompactionStart) and start.reason == "threshold" and start.messages_before >= 4
        assert isinstance(end, CompactionEnd) and end.reason == "threshold"
        assert end.compacted and not end.will_retry and end.error is None and end.removed > 0
        assert end.tokens_before is not None and end.tokens_after is not None
        assert end.tokens_after < end.tokens_before
    # between a model call's turn: after the turn that filled the context, before the next call
    first = events.index(told[0])
    assert any(isinstance(e, TurnStart) for e in events[:first])


async def test_an_overflow_compaction_says_the_call_is_made_again() -> None:
    agent = Agent(model=ScriptedModel(_brain(overflows=1), info=SMALL), tools=[dump], pieces=[Compaction()])
    events = await _events(agent, "go on", _old_history(4))
    assert isinstance(events[-1], AgentEnd) and events[-1].stop_reason == "stop"
    start, end = _compactions(events)
    assert isinstance(start, CompactionStart) and start.reason == "overflow" and start.messages_before == 9
    assert isinstance(end, CompactionEnd) and end.reason == "overflow" and end.compacted and end.will_retry
    assert end.removed > 0
    retry = next(i for i, e in enumerate(events) if isinstance(e, ModelRetry))
    assert events.index(start) < events.index(end) < retry  # compacted, then the call made again


async def test_a_compaction_that_cannot_help_or_fails_ends_uncompacted() -> None:
    # nothing to summarise (the prompt alone overflowed): the end says so, without an error
    agent = Agent(model=ScriptedModel(_brain(overflows=1), info=SMALL), tools=[dump], pieces=[Compaction()])
    events = await _events(agent, "go on")
    start, end = _compactions(events)
    assert isinstance(start, CompactionStart) and isinstance(end, CompactionEnd)
    assert not end.compacted and not end.will_retry and end.error is None and end.removed == 0
    assert isinstance(events[-1], AgentEnd) and events[-1].stop_reason == "error"

    # the summary model failed: the end carries its error, the history stays
    broken = ScriptedModel(lambda r: ProviderError("summary service down", kind="bad_request"))
    piece = Compaction(summariser=broken)
    agent = Agent(model=ScriptedModel(_brain(overflows=1), info=SMALL), tools=[dump], pieces=[piece])
    events = await _events(agent, "go on", _old_history(4))
    start, end = _compactions(events)
    assert isinstance(end, CompactionEnd) and not end.compacted and not end.will_retry
    assert end.error is not None and "summary service down" in end.error
    assert isinstance(events[-1], AgentEnd) and events[-1].stop_reason == "error"


async def test_an_abort_during_the_summary_still_ends_the_compaction() -> None:
    async def slow(r: ModelRequest) -> str:
        await asyncio.sleep(30)
        return "never"

    piece = Compaction(summariser=ScriptedModel(slow))
    agent = Agent(model=ScriptedModel(_brain(overflows=1), info=SMALL), tools=[dump], pieces=[piece])
    run = agent.start("go on", history=_old_history(4), stream=True)
    seen: list[LoopEvent] = []
    async with asyncio.timeout(10):
        async for event in run.events():
            seen.append(event)
            if isinstance(event, CompactionStart):
                run.abort()
    end = next(e for e in seen if isinstance(e, CompactionEnd))
    assert not end.compacted and end.error == "aborted"
    assert isinstance(seen[-1], AgentEnd) and seen[-1].stop_reason == "aborted"


async def test_an_unwatched_run_reports_nothing_and_a_hook_sees_no_emit() -> None:
    def watching(emits: list[object]) -> Agent:
        agent = Agent(model=ScriptedModel(_brain(fills=8), info=SMALL), tools=[dump], pieces=[Compaction()])
        agent.hooks.on("compact_context")(lambda info: emits.append(info.emit))
        agent.hooks.on("post_turn")(lambda info: emits.append(info.emit))
        return agent

    emits: list[object] = []
    result = await watching(emits).run("fill the context")
    assert result.stop_reason == "stop" and any(m.role == "system" for m in result.messages)
    assert emits and all(e is None for e in emits)
    emits = []
    events = await _events(watching(emits), "fill the context")
    assert emits and all(callable(e) for e in emits)  # watched: the hooks may report
    assert _compactions(events)


# ------------------------------------------------------------------ tool retry


@tool
def look(path: str) -> str:
    """Look at a file."""
    if path.startswith("ok"):
        return "contents"
    raise ToolError(f"No such file: {path}")


def _script(*steps: list[str]) -> Any:
    """One step per model call, each a list of paths to ``look`` at; then an answer."""
    queue = list(steps)

    def brain(r: ModelRequest) -> Any:
        if queue and r.tools:
            return Reply(tool_calls=[call("look", path=p) for p in queue.pop(0)])
        return "that is all"

    return brain


async def test_a_retry_episode_is_scheduled_resolved_and_then_exhausted() -> None:
    brain = _script(["a"], ["b"], ["ok1"], ["c"], ["d"], ["e"], ["ok2"])
    agent = Agent(model=ScriptedModel(brain), tools=[look], pieces=[ToolRetry()])
    events = await _events(agent, "find it")
    told = [e for e in events if isinstance(e, ToolRetryScheduled | ToolRetryResolved | ToolRetryExhausted)]
    kinds = [e.type for e in told]
    assert kinds == [
        "tool_retry_scheduled",
        "tool_retry_scheduled",
        "tool_retry_resolved",
        "tool_retry_scheduled",
        "tool_retry_scheduled",
        "tool_retry_exhausted",
    ]
    first, second, resolved, _, _, spent = told
    assert isinstance(first, ToolRetryScheduled) and isinstance(second, ToolRetryScheduled)
    assert (first.tool_name, first.error_class) == ("look", "not_found")
    assert (first.class_left, second.class_left) == (1, 0)  # not_found: two retries an episode
    assert (first.rounds_left, second.rounds_left) == (31, 30)
    assert (first.tool_left, first.signature_left) == (15, 2)
    assert isinstance(resolved, ToolRetryResolved) and (resolved.failures, resolved.rounds) == (2, 2)
    assert isinstance(spent, ToolRetryExhausted)
    assert (spent.tool_name, spent.error_class, spent.budget, spent.limit) == ("look", "not_found", "class", 2)
    assert "not_found" in spent.reason
    # each is told for the step it is about: its call is that step's, and it comes after its turn_end
    ends = [e for e in events if isinstance(e, TurnEnd)]
    calls = {c.id: e for e in ends for c in e.message.tool_calls}
    assert first.tool_call_id in calls and spent.tool_call_id in calls
    assert calls[spent.tool_call_id].message.tool_calls[0].arguments == {"path": "e"}
    assert events.index(calls[first.tool_call_id]) < events.index(first)
    end = events[-1]
    assert isinstance(end, AgentEnd) and end.stop_reason == "stopped"


async def test_a_call_refused_before_it_ran_is_scheduled_with_its_id() -> None:
    def brain(r: ModelRequest) -> Any:
        if len(r.messages) == 1:
            return Reply(tool_calls=[ToolCall(id="x1", name="missing", arguments={})])
        return "done"

    agent = Agent(model=ScriptedModel(brain), tools=[look], pieces=[ToolRetry()])
    events = await _events(agent, "go")
    scheduled = [e for e in events if isinstance(e, ToolRetryScheduled)]
    assert [(e.tool_call_id, e.tool_name) for e in scheduled] == [("x1", "missing")]


def _batch(call_id: str, path: str) -> list[Message]:
    tc = ToolCall(id=call_id, name="look", arguments={"path": path})
    return [AssistantMessage(content=[tc], stop_reason="toolUse"), tool_error_result(tc, f"No such file: {path}")]


def test_failures_counted_again_from_a_history_are_not_reported_anew() -> None:
    """A run the piece has not seen (a resumed one) is counted from its history: only the step
    that just ended is reported, with what the earlier one left of the budgets."""
    piece = ToolRetry()
    history = [user("find it"), *_batch("c1", "a"), *_batch("c2", "b")]
    told: list[LoopEvent] = []
    piece.post_turn(TurnInfo("r1", 1, history, "", [], emit=told.append))
    assert [(type(e), getattr(e, "tool_call_id", None)) for e in told] == [(ToolRetryScheduled, "c2")]
    assert isinstance(told[0], ToolRetryScheduled) and told[0].class_left == 0

    # unwatched steps leave nothing behind for a later watched one
    piece = ToolRetry()
    history = [user("find it"), *_batch("c1", "a")]
    piece.post_turn(TurnInfo("r2", 0, history, "", []))
    told = []
    history += _batch("c2", "b")
    piece.post_turn(TurnInfo("r2", 1, history, "", [], emit=told.append))
    assert [getattr(e, "tool_call_id", None) for e in told] == ["c2"]


# ------------------------------------------------------------------ wire and terminal


SAMPLES: list[LoopEvent] = [
    CompactionStart(reason="threshold", messages_before=12),
    CompactionEnd(reason="overflow", compacted=True, will_retry=True, removed=7, tokens_before=900, tokens_after=120),
    CompactionEnd(reason="threshold", compacted=False, error="summary model m failed"),
    ToolRetryScheduled(
        tool_call_id="c1",
        tool_name="look",
        error_class="not_found",
        rounds_left=31,
        class_left=1,
        tool_left=15,
        signature_left=2,
    ),
    ToolRetryResolved(failures=2, rounds=2),
    ToolRetryExhausted(
        tool_call_id="c5", tool_name="look", error_class="not_found", budget="class", limit=2, reason="spent"
    ),
]


def test_the_new_events_have_a_wire_form_that_reads_back() -> None:
    for event in SAMPLES:
        data = event_to_dict(event)
        assert data["type"] == event.type
        assert json.loads(json.dumps(data)) == data
        assert event_from_dict(data) == event
        assert JsonRenderer.to_dict(event) == data
    assert event_to_dict(SAMPLES[1])["will_retry"] is True and event_to_dict(SAMPLES[1])["removed"] == 7


def test_the_terminal_shows_a_line_for_a_compaction_and_a_spent_budget() -> None:
    err = io.StringIO()
    view = TextRenderer(io.StringIO(), stderr_console(err))
    for event in SAMPLES:
        view.handle(event)
    lines = err.getvalue().splitlines()
    assert lines == [
        "compacting context…",
        "context compacted: 7 messages summarised",
        "context not compacted: summary model m failed",
        "tool retry budget spent: spent; the run stops",
    ]
