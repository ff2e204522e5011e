"""Compaction's first tier (clearing old tool outputs), found by a review: the usage a provider
reported before a clearing, the store's rows against the cached history, what a note says."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

from agentloop import Reply, call, tool
from agentloop.kernel import Kernel
from agentloop.loop.reveal import REQUEST_TOOLS, ToolReveal
from agentloop.messages import (
    AssistantMessage,
    ImageContent,
    SystemMessage,
    TextContent,
    ToolCall,
    ToolResultMessage,
    user,
)
from agentloop.models.base import ModelInfo, ModelRequest, ProviderError
from agentloop.models.scripted import ScriptedModel
from agentloop.process.compaction import SUMMARY_KIND, SUMMARY_SYSTEM_PROMPT, clear_tool_outputs, estimate_tokens

WINDOW = ModelInfo(provider="scripted", id="small", context_window=12_000, max_output=200)
BULK = "lorem ipsum dolor sit amet " * 60  # about 400 tokens


@tool
def dump(n: int) -> str:
    """Return a long text."""
    return f"chunk {n}: {BULK}"


def _kernel(tmp_path: Path, brain: Any, **kw: Any) -> Any:
    return Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(brain, info=WINDOW), workspace=tmp_path, tools=[dump], **kw
    )


async def _signals(proc: Any, name: str) -> list[dict[str, Any]]:
    return [s.payload async for s in proc.signals(follow=False) if s.signal == name]


def _used(r: ModelRequest) -> int:
    return estimate_tokens(r.system_prompt) + estimate_tokens(r.tools) + estimate_tokens(r.messages)


def _cleared(r: ModelRequest) -> bool:
    return any(isinstance(m, ToolResultMessage) and m.text.startswith("[output cleared") for m in r.messages)


async def test_usage_reported_before_a_clearing_does_not_bring_a_summary_after_it(tmp_path: Path) -> None:
    """The model call right after a clearing fails (no usage): the next run must not measure its
    context by the usage of the reply before the clearing, which still counts the outputs cleared,
    and summarise a history the clearing had brought well under the threshold."""
    summaries: list[int] = []
    failed: list[int] = []

    def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            summaries.append(1)
            return "Summary: chunks were produced."
        if r.messages[-1].text == "question":
            return Reply(text="answered", input_tokens=_used(r), output_tokens=1)
        if _cleared(r) and not failed:
            failed.append(1)
            return ProviderError("refused", kind="auth")
        done = sum(isinstance(m, ToolResultMessage) for m in r.messages)
        return Reply(tool_calls=[call("dump", n=done)], input_tokens=_used(r), output_tokens=1)

    async with _kernel(tmp_path, brain) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("produce chunks")
        await proc.wait_idle()
        assert failed and [c["kind"] for c in await _signals(proc, "proc.compacted")] == ["clearing"]
        await proc.send("question")
        await proc.wait_idle()
        history = await proc.messages()
        compacted = await _signals(proc, "proc.compacted")
    assert history[-1].text == "answered"
    assert summaries == [] and [c["kind"] for c in compacted] == ["clearing"]


def _calling(call_id: str, name: str = "dump") -> AssistantMessage:
    return AssistantMessage(content=[ToolCall(id=call_id, name=name, arguments={})])


def test_a_cleared_request_tools_result_keeps_the_tools_it_revealed() -> None:
    """``ToolReveal`` reads what was revealed from the results' details (not sent to the model):
    a clearing saves context, and must not take back tools a later run was given."""

    @tool
    def weather(city: str) -> str:
        """Tell the weather in a city."""
        return "sunny"

    text = "Available from your next step: weather. Not available: " + ", ".join(f"t{i}" for i in range(400))
    revealing = ToolResultMessage(
        tool_call_id="r", tool_name=REQUEST_TOOLS, content=[TextContent(text=text)], details={"added": ["weather"]}
    )
    history = [user("go"), _calling("r", REQUEST_TOOLS), revealing, _calling("d"), _result("d", BULK)]
    clearing = clear_tool_outputs(history, keep_recent_tokens=estimate_tokens(history[-1]))
    assert clearing is not None and clearing.positions == [2]
    reveal = ToolReveal(hidden=[weather])
    assert reveal.revealed(history) == {"weather"}
    assert reveal.revealed(clearing.history(history)) == {"weather"}


def test_the_note_of_a_cleared_image_says_it_was_one() -> None:
    pixel = base64.b64encode(b"\x89PNG fake").decode()
    shot = ToolResultMessage(
        tool_call_id="s",
        tool_name="screenshot",
        content=[TextContent(text="the screen"), ImageContent(data=pixel, mime_type="image/png")],
    )
    history = [user("go"), _calling("s", "screenshot"), shot, _calling("d"), _result("d", BULK)]
    clearing = clear_tool_outputs(history, keep_recent_tokens=estimate_tokens(history[-1]))
    assert clearing is not None and clearing.positions == [2]
    note = clearing.cleared[0]
    assert note.text.startswith("[output cleared") and "image" in note.text
    assert not any(isinstance(b, ImageContent) for b in note.content)


def _result(call_id: str, text: str) -> ToolResultMessage:
    return ToolResultMessage(tool_call_id=call_id, tool_name="dump", content=[TextContent(text=text)])


async def test_a_clearing_after_a_summary_rewrites_the_rows_it_cleared(tmp_path: Path) -> None:
    """The positions of the cached history (a summary at its head) name the same rows in the
    store: after a restart the history is the one the process ran with."""
    summaries: list[int] = []

    def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            summaries.append(1)
            return "Summary: the user talked at length."
        if r.messages[-1].text.startswith("talk"):
            return Reply(text="noted", input_tokens=_used(r), output_tokens=1)
        done = sum(isinstance(m, ToolResultMessage) for m in r.messages)
        if done >= 30:
            return Reply(text="all chunks done", input_tokens=_used(r), output_tokens=1)
        return Reply(tool_calls=[call("dump", n=done)], input_tokens=_used(r), output_tokens=1)

    async with _kernel(tmp_path, brain) as k:
        proc = await k.spawn(owner="alice")
        for n in range(30):
            await proc.send(f"talk {n}: {BULK}")
            await proc.wait_idle()
        assert summaries
        await proc.send("produce chunks")
        await proc.wait_idle()
        history = await proc.messages()
        kinds = [c.get("kind") for c in await _signals(proc, "proc.compacted")]
    assert kinds[-1] == "clearing" and "summary" in kinds  # a clearing after summaries
    assert history[-1].text == "all chunks done"
    assert isinstance(history[0], SystemMessage) and history[0].kind == SUMMARY_KIND
    for m in history:  # a note only ever replaced a tool result
        if m.text.startswith("[output cleared"):
            assert isinstance(m, ToolResultMessage)
    async with _kernel(tmp_path, brain) as k:
        assert await (await k.process(proc.pid)).messages() == history


async def test_an_abort_while_the_outputs_are_archived_leaves_the_history_whole(tmp_path: Path) -> None:
    archiving = asyncio.Event()

    def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return "Summary."
        done = sum(isinstance(m, ToolResultMessage) for m in r.messages)
        return Reply(tool_calls=[call("dump", n=done)], input_tokens=_used(r), output_tokens=1)

    async with _kernel(tmp_path, brain) as k:
        real = k.engine.archive

        async def slow(record: Any, name: str, messages: Any, meta: Any) -> str:
            where = await real(record, name, messages, meta)
            if name.startswith("clearing-"):
                archiving.set()
                await asyncio.sleep(5)
            return str(where)

        k.engine.archive = slow
        proc = await k.spawn(owner="alice")
        await proc.send("produce chunks")
        await asyncio.wait_for(archiving.wait(), 5)
        assert await proc.abort()
        await proc.wait_idle()
        history = await proc.messages()
        segments = await k.store.segments(proc.pid)
    assert not any(m.text.startswith("[output cleared") for m in history) and segments == []
