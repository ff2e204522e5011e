"""Tools revealed by ``request_tools`` stay revealed after a summary compaction removed the
results that revealed them: in later runs, after a restart, and over repeated summaries."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from agentloop import Reply, ScriptedModel, SystemMessage, ToolResultMessage, call, tool
from agentloop.kernel import Kernel
from agentloop.loop.reveal import REQUEST_TOOLS, ToolReveal
from agentloop.messages import Message, TextContent, user
from agentloop.models.base import ModelInfo, ModelRequest
from agentloop.process.compaction import SUMMARY_KIND, SUMMARY_SYSTEM_PROMPT, compact, estimate_tokens
from tests.test_reveal import stock, weather

SMALL = ModelInfo(provider="scripted", id="small", context_window=3_000, max_output=200)
FILLS = 5  # dump calls per "fill" run: enough for a summary in a 3k window


@tool
def dump(n: int) -> str:
    """Return a long text."""
    return f"chunk {n}: " + "lorem ipsum dolor sit amet " * 60


class Brain:
    """A scripted model whose behaviour the test sets per run (``mode``), so that a run still
    knows what to do once its own user message has been summarised away."""

    def __init__(self) -> None:
        self.mode = ""
        self.steps = 0
        self.shown: list[list[str]] = []  # the tool names of each conversation call

    def __call__(self, r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return "Summary: the user had tools revealed and chunks produced."
        self.steps += 1
        self.shown.append(sorted(t.name for t in r.tools))
        used = estimate_tokens(r.system_prompt) + estimate_tokens(r.tools) + estimate_tokens(r.messages)
        return Reply(**self._answer(), input_tokens=used)

    def _answer(self) -> dict[str, Any]:
        if self.mode == "reveal":
            return {"tool_calls": [call(REQUEST_TOOLS, names=["weather"])]} if self.steps == 1 else {"text": "ok"}
        if self.mode == "fill":
            return {"tool_calls": [call("dump", n=self.steps)]} if self.steps <= FILLS else {"text": "filled"}
        if self.mode == "use":
            return {"tool_calls": [call("weather", city="Oslo")]} if self.steps == 1 else {"text": "done"}
        return {"text": "?"}


@asynccontextmanager
async def _open(path: Path, brain: Brain) -> AsyncIterator[Kernel]:
    """A kernel with ``weather`` and ``stock`` hidden behind ``request_tools``."""
    async with Kernel.open(
        f"sqlite:///{path}/a.db",
        model=ScriptedModel(brain, info=SMALL),
        workspace=path,
        tools=[dump],
        clear_tool_outputs=False,  # (the summary is the tier under test)
        pieces=[ToolReveal(hidden=[weather, stock])],
    ) as kernel:
        yield kernel


async def _say(proc: Any, brain: Brain, mode: str) -> None:
    brain.mode, brain.steps = mode, 0
    await proc.send(f"please {mode}")
    await asyncio.wait_for(proc.wait_idle(), 20)


async def _summaries(proc: Any) -> int:
    signals = [s async for s in proc.signals(follow=False) if s.signal == "proc.compacted"]
    return sum(1 for s in signals if s.payload.get("kind") != "clearing")


def _reveal_results(messages: list[Message]) -> list[ToolResultMessage]:
    return [m for m in messages if isinstance(m, ToolResultMessage) and m.tool_name == REQUEST_TOOLS]


def _used_weather(messages: list[Message]) -> None:
    """The last tool result is the revealed ``weather`` tool's answer."""
    result = [m for m in messages if isinstance(m, ToolResultMessage)][-1]
    assert (result.tool_name, result.is_error, result.text) == ("weather", False, "sunny in Oslo")


async def _reveal_then_compact(proc: Any, brain: Brain) -> None:
    """Reveal ``weather``, then fill the context until the reveal is summarised away."""
    await _say(proc, brain, "reveal")
    assert "weather" in brain.shown[-1]
    await _say(proc, brain, "fill")
    messages = await proc.messages()
    assert await _summaries(proc) >= 1
    assert isinstance(messages[0], SystemMessage) and messages[0].kind == SUMMARY_KIND
    assert not _reveal_results(messages)  # the result that revealed it is gone


async def test_a_revealed_tool_is_still_shown_and_callable_after_a_summary(tmp_path: Path) -> None:
    brain = Brain()
    async with _open(tmp_path, brain) as k:
        proc = await k.spawn(owner="alice")
        await _reveal_then_compact(proc, brain)
        await _say(proc, brain, "use")
        messages = await proc.messages()
    assert "weather" in brain.shown[-2]  # the call that used it was shown it
    _used_weather(messages)


async def test_a_tool_never_revealed_stays_hidden_after_a_summary(tmp_path: Path) -> None:
    brain = Brain()
    async with _open(tmp_path, brain) as k:
        proc = await k.spawn(owner="alice")
        await _reveal_then_compact(proc, brain)
        await _say(proc, brain, "use")
    assert "stock" not in brain.shown[-1] and REQUEST_TOOLS in brain.shown[-1]


async def test_the_revealed_set_survives_a_restart_after_a_summary(tmp_path: Path) -> None:
    """The store holds it: a new kernel, with a new ``ToolReveal`` (nothing in memory), reads it."""
    brain = Brain()
    async with _open(tmp_path, brain) as k:
        proc = await k.spawn(owner="alice")
        pid = proc.pid
        await _reveal_then_compact(proc, brain)
    brain = Brain()
    async with _open(tmp_path, brain) as k:
        proc = await k.process(pid)
        await _say(proc, brain, "use")
        messages = await proc.messages()
    assert "weather" in brain.shown[0] and "stock" not in brain.shown[0]
    _used_weather(messages)


async def test_repeated_summaries_keep_the_revealed_set(tmp_path: Path) -> None:
    brain = Brain()
    async with _open(tmp_path, brain) as k:
        proc = await k.spawn(owner="alice")
        await _reveal_then_compact(proc, brain)
        first = await _summaries(proc)
        for _ in range(3):
            await _say(proc, brain, "fill")
        assert await _summaries(proc) > first  # a later summary replaced the first one
        await _say(proc, brain, "use")
        messages = await proc.messages()
    assert "weather" in brain.shown[-2] and "stock" not in brain.shown[-2]
    _used_weather(messages)


async def test_compact_rolls_carried_details_forward_and_adds_new_ones() -> None:
    """What an earlier summary carried is kept by the next one, under what the caller adds."""
    model = ScriptedModel(lambda r: "Summary.")
    old = SystemMessage(content=[TextContent(text="Old summary.")], kind=SUMMARY_KIND, details={"a": 1, "b": 1})
    history: list[Message] = [old, user("x" * 4_000), user("y" * 4_000), user("z" * 400)]
    result = await compact(history, model, keep_recent_tokens=100, reason="manual", carry={"b": 2})
    assert result is not None and result.summary.details == {"a": 1, "b": 2}
    bare = await compact(history[1:], model, keep_recent_tokens=100, reason="manual")
    assert bare is not None and bare.summary.details is None


async def test_pre_compaction_hooks_give_what_the_summary_keeps() -> None:
    """A dict a ``pre_compaction`` hook returns is merged into ``TurnInfo.carry``; in other
    phases it means nothing."""
    from agentloop.loop.hooks import Hooks, TurnInfo

    hooks = Hooks()
    hooks.on("pre_compaction")(lambda info: {"a": 1})
    hooks.on("pre_compaction")(lambda info: {"b": 2})
    hooks.on("post_turn")(lambda info: {"c": 3})
    info = TurnInfo("run", 0, [], "", [])
    assert await hooks.run_phase("pre_compaction", info) is None
    await hooks.run_phase("post_turn", info)
    assert info.carry == {"a": 1, "b": 2}


def test_a_summary_s_carried_set_is_read_like_a_request_tools_result() -> None:
    reveal = ToolReveal(hidden=[weather, stock])
    kept = SystemMessage(
        content=[TextContent(text="S")], kind=SUMMARY_KIND, details={REQUEST_TOOLS: {"added": ["weather", "gone"]}}
    )
    assert reveal.revealed([kept, user("hi")]) == {"weather"}
    odd = SystemMessage(content=[TextContent(text="S")], kind=SUMMARY_KIND, details={REQUEST_TOOLS: ["weather"]})
    assert reveal.revealed([odd]) == set()


async def test_carried_data_that_cannot_be_stored_is_left_out(caplog: Any) -> None:
    model = ScriptedModel(lambda r: "Summary.")
    history: list[Message] = [user("x" * 4_000), user("y" * 4_000), user("z" * 400)]
    carry = {"bad": object(), "good": [1]}
    result = await compact(history, model, keep_recent_tokens=100, reason="manual", carry=carry)
    assert result is not None and result.summary.details == {"good": [1]}
    assert "not JSON data" in caplog.text
