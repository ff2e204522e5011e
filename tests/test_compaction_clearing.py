"""Compaction's first tier: old tool outputs archived and replaced by a note, with no model call,
when that alone brings the context well under the threshold; the summary otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentloop import Reply, call, tool
from agentloop.kernel import Kernel
from agentloop.messages import AssistantMessage, TextContent, ToolCall, ToolResultMessage, user
from agentloop.models.base import ModelInfo, ModelRequest
from agentloop.models.scripted import ScriptedModel
from agentloop.process.archive import read_archive
from agentloop.process.compaction import CLEARABLE_TOKENS, SUMMARY_SYSTEM_PROMPT, clear_tool_outputs, estimate_tokens

WINDOW = ModelInfo(provider="scripted", id="small", context_window=12_000, max_output=200)
BULK = "lorem ipsum dolor sit amet " * 60  # about 400 tokens


def result(call_id: str, text: str, *, error: bool = False) -> ToolResultMessage:
    return ToolResultMessage(tool_call_id=call_id, tool_name="dump", content=[TextContent(text=text)], is_error=error)


def calling(call_id: str) -> AssistantMessage:
    return AssistantMessage(content=[ToolCall(id=call_id, name="dump", arguments={})])


def test_only_large_results_older_than_the_tail_are_cleared_and_the_shape_stays() -> None:
    history = [
        user("go"),
        calling("a"),
        result("a", BULK),
        calling("b"),
        result("b", "small"),
        calling("c"),
        result("c", BULK, error=True),
        calling("d"),
        result("d", BULK),  # the newest: in the tail
    ]
    clearing = clear_tool_outputs(history, keep_recent_tokens=estimate_tokens(history[-2:]))
    assert clearing is not None and clearing.positions == [2, 6]
    cleared = clearing.history(history)
    assert len(cleared) == len(history) and cleared[4] is history[4] and cleared[8] is history[8]
    note = cleared[2]
    assert isinstance(note, ToolResultMessage) and note.tool_call_id == "a" and note.text.startswith("[output cleared")
    assert isinstance(cleared[6], ToolResultMessage) and cleared[6].is_error  # an error stays an error
    assert clearing.tokens_after < clearing.tokens_before - CLEARABLE_TOKENS
    assert clearing.still_applies(history) and not clearing.still_applies(cleared)
    assert clear_tool_outputs(cleared, keep_recent_tokens=estimate_tokens(history[-2:])) is None  # done once
    assert clear_tool_outputs(history, keep_recent_tokens=10**9) is None  # everything is recent


def kernel(tmp_path: Path, brain: Any, **kw: Any) -> Any:
    @tool
    def dump(n: int) -> str:
        """Return a long text."""
        return f"chunk {n}: {BULK}"

    return Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(brain, info=WINDOW), workspace=tmp_path, tools=[dump], **kw
    )


def chunks(count: int, summaries: list[int]) -> Any:
    """A model that asks for ``count`` chunks, then answers; summary calls are counted."""
    asked: list[int] = []

    def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            summaries.append(1)
            return "Summary: chunks were produced."
        done = len(asked)  # (not the results in the history: a summary folds them away)
        if done >= count:
            return "all chunks done"
        asked.append(done)
        used = estimate_tokens(r.system_prompt) + estimate_tokens(r.tools) + estimate_tokens(r.messages)
        return Reply(tool_calls=[call("dump", n=done)], input_tokens=used, output_tokens=1)

    return brain


async def signals(proc: Any, name: str) -> list[dict[str, Any]]:
    return [s.payload async for s in proc.signals(follow=False) if s.signal == name]


async def test_old_outputs_are_cleared_without_a_summary_and_archived(tmp_path: Path) -> None:
    summaries: list[int] = []
    async with kernel(tmp_path, chunks(40, summaries)) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("produce chunks")
        await proc.wait_idle()
        history = await proc.messages()
        compacted = await signals(proc, "proc.compacted")
        segments = await k.store.segments(proc.pid)
    assert history[-1].text == "all chunks done" and summaries == []  # no model call spent on it
    assert compacted and all(c["kind"] == "clearing" and c["cleared"] > 0 for c in compacted)
    results = [m for m in history if isinstance(m, ToolResultMessage)]
    assert len(results) == 40  # every call keeps its result, in place
    notes = [m for m in results if m.text.startswith("[output cleared")]
    assert notes and results[-1].text.startswith("chunk 39")  # the newest are whole
    header, archived = read_archive(tmp_path / compacted[0]["archive"])
    assert header["meta"]["kind"] == "clearing"
    assert all(isinstance(m, ToolResultMessage) and m.text.startswith("chunk ") for m in archived)
    assert {s.kind for s in segments} == {"clearing"} and len(segments) == len(compacted)
    async with kernel(tmp_path, chunks(40, summaries)) as k:  # durable: after a restart too
        assert await (await k.process(proc.pid)).messages() == history


async def test_when_clearing_is_not_enough_the_summary_does_it(tmp_path: Path) -> None:
    """Long user messages and small tool outputs: nothing worth clearing, so a summary."""
    summaries: list[int] = []

    def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            summaries.append(1)
            return "Summary: the user talked at length."
        used = estimate_tokens(r.system_prompt) + estimate_tokens(r.tools) + estimate_tokens(r.messages)
        return Reply(text="noted", input_tokens=used, output_tokens=1)

    async with kernel(tmp_path, brain) as k:
        proc = await k.spawn(owner="alice")
        for n in range(30):
            await proc.send(f"{n}: {BULK}")
            await proc.wait_idle()
        compacted = await signals(proc, "proc.compacted")
    assert summaries and compacted and all(c.get("kind") != "clearing" for c in compacted)


async def test_clearing_can_be_turned_off(tmp_path: Path) -> None:
    summaries: list[int] = []
    async with kernel(tmp_path, chunks(40, summaries), clear_tool_outputs=False) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("produce chunks")
        await proc.wait_idle()
        compacted = await signals(proc, "proc.compacted")
    assert summaries and compacted and all(c.get("kind") != "clearing" for c in compacted)


def test_chat_says_what_a_clearing_did() -> None:
    import io

    from rich.console import Console

    from agentloop.cli.render import SignalRenderer, TextRenderer
    from agentloop.process.signals import Signal

    err = io.StringIO()
    render = SignalRenderer(TextRenderer(io.StringIO(), Console(file=err, width=200)))
    payload = {"kind": "clearing", "cleared": 7, "removed": 0, "reason": "threshold"}
    render.handle(Signal("proc.compacted", payload, 1))
    assert "cleared 7 old tool outputs (archived) (threshold)" in err.getvalue()
