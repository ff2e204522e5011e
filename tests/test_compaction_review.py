"""Compaction of durable processes, found by a review: races with input, abort and reset while a
summary is being written, failures between its steps, and the pressure it is triggered by."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, SystemMessage, ToolResultMessage, call, tool
from agentloop.kernel import Kernel
from agentloop.loop.guards import Guards
from agentloop.messages import AssistantMessage, Message, TextContent, Usage, user
from agentloop.models.base import ModelInfo, ModelRequest, ProviderError
from agentloop.process.compaction import SUMMARY_KIND, SUMMARY_SYSTEM_PROMPT, context_tokens, estimate_tokens
from tests.test_compaction import CJK_MODEL, cjk_request_tokens, read_doc

SMALL = ModelInfo(provider="scripted", id="small", context_window=3000, max_output=200)


@tool
def dump(n: int) -> str:
    """Return a long text."""
    return f"chunk {n}: " + "lorem ipsum dolor sit amet " * 60


def _kernel(tmp_path: Path, brain: Any, info: ModelInfo = SMALL, tools: list[Any] | None = None) -> Any:
    model = ScriptedModel(brain, info=info)
    return Kernel.open(  # (the summary's reviews: the first tier, clearing tool outputs, has its own)
        f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=tools or [dump], clear_tool_outputs=False
    )


async def _signals(proc: Any, name: str) -> list[dict[str, Any]]:
    return [s.payload async for s in proc.signals(follow=False) if s.signal == name]


def _check_whole(messages: list[Message]) -> None:
    """Every tool result follows its call, and no call id appears twice (nothing duplicated)."""
    calls: set[str] = set()
    for m in messages:
        if isinstance(m, AssistantMessage):
            for tc in m.tool_calls:
                assert tc.id not in calls
                calls.add(tc.id)
        elif isinstance(m, ToolResultMessage):
            assert m.tool_call_id in calls


def _chunk_brain(on_summary: Any, rounds: int = 12) -> Any:
    """Tool calls until ``rounds`` results are in; ``on_summary`` (awaited) answers the summary call."""

    async def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return await on_summary()
        done = sum(isinstance(m, ToolResultMessage) for m in r.messages)
        if r.messages[-1].text.startswith("question"):
            return "answered"
        if done >= rounds or any(isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND for m in r.messages):
            return Reply(text="all chunks done", input_tokens=estimate_tokens(r.messages))
        return Reply(tool_calls=[call("dump", n=done)], input_tokens=estimate_tokens(r.messages))

    return brain


def _overflowing_fourth_call(fourth: Callable[[], Reply], answer: str) -> Callable[[ModelRequest], Any]:
    """Three tool calls, then ``fourth()`` (an overflow, raised or silent), then ``answer``."""
    calls = [0]

    def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return "Summary: chunks."
        calls[0] += 1
        if calls[0] < 4:
            return Reply(tool_calls=[call("dump", n=calls[0])])
        return fourth() if calls[0] == 4 else answer

    return brain


# ------------------------------------------------------------------ pressure


def test_usage_is_read_past_input_queued_before_the_summary() -> None:
    """Input sent while a compaction ran is older than its summary, but newer in the history than
    the reply that measured the context: that reply's usage still counts."""
    queued = user("sent while the summary was being written")
    summary = SystemMessage(content=[TextContent(text="Summary ...")], kind=SUMMARY_KIND)
    summary.timestamp = queued.timestamp + 1
    reply = AssistantMessage(content=[TextContent(text="done")], usage=Usage(input=12_000, output=5))
    reply.timestamp = summary.timestamp + 1
    history: list[Message] = [summary, user("kept"), reply, queued]
    assert context_tokens("", [], history) == 12_005 + estimate_tokens(queued)


async def test_input_queued_during_a_compaction_does_not_hide_the_pressure(tmp_path: Path) -> None:
    """CJK text counts about four times the estimate. A question queued while a compaction ran
    starts the next run with a context near the threshold: the real usage of the last reply must
    trigger the threshold compaction, instead of the estimate letting the call overflow."""
    info = CJK_MODEL
    rejected, turns, procs = [0], [0], []

    async def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            if len(procs) == 1:  # the first compaction: the user queues a long question meanwhile
                procs.append(await procs[0].send("问题：" + "请解释这个系统的设计" * 350, mode="queue"))
            return "摘要：用户要求阅读规格说明。"
        size = cjk_request_tokens(r)
        if size > info.context_window:
            rejected[0] += 1
            raise ProviderError(f"prompt is too long: {size} tokens", kind="overflow")
        if r.messages[-1].text.startswith("问题"):
            return Reply(text="答案", input_tokens=size)
        turns[0] += 1
        compacted = any(isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND for m in r.messages)
        if compacted and size >= 12_800:  # ends close to the threshold
            return Reply(text="完成", input_tokens=size)
        return Reply(tool_calls=[call("read_doc", n=turns[0])], input_tokens=size)

    async with _kernel(tmp_path, brain, info, [read_doc]) as k:
        proc = await k.spawn(owner="alice")
        procs.append(proc)
        await proc.send("请阅读所有章节")
        await proc.wait_idle()
        reasons = [c["reason"] for c in await _signals(proc, "proc.compacted")]
        assert (await proc.messages())[-1].text == "答案"
    assert rejected == [0] and reasons == ["threshold", "threshold"]


async def test_a_compaction_leaves_room_for_more_than_one_turn(tmp_path: Path) -> None:
    """A reasoning model reserves half its window for output, and the prompt takes a third of the
    rest: a kept tail of a quarter of the *whole* window filled what was left to the threshold, so
    every turn wrote another summary. The tail is a quarter of the room the history has."""
    info = ModelInfo(provider="scripted", id="o", context_window=8_000, max_output=4_000)
    turns = [0]

    def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return "Summary: chunks."
        turns[0] += 1
        used = estimate_tokens(r.system_prompt) + estimate_tokens(r.tools) + estimate_tokens(r.messages)
        if turns[0] >= 30:
            return Reply(text="all chunks done", input_tokens=used)
        return Reply(tool_calls=[call("dump", n=turns[0])], input_tokens=used)

    model = ScriptedModel(brain, info=info)
    prompt = "Follow the house rules. " * 200  # about 1,200 tokens
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[dump], system_prompt=prompt
    ) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("produce chunks")
        await proc.wait_idle()
        compacted = await _signals(proc, "proc.compacted")
        assert (await proc.messages())[-1].text == "all chunks done"
    assert compacted and len(compacted) * 3 <= turns[0]  # was 24 summaries in 30 turns


# ------------------------------------------------------------------ races


async def test_an_abort_while_the_summary_is_written_leaves_the_history_whole(tmp_path: Path) -> None:
    started, release = asyncio.Event(), asyncio.Event()

    async def on_summary() -> str:
        started.set()
        await release.wait()
        return "Summary: chunks."

    async with _kernel(tmp_path, _chunk_brain(on_summary)) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("produce chunks")
        await asyncio.wait_for(started.wait(), 10)
        before = await proc.messages()
        assert await proc.abort()
        release.set()
        await proc.wait_idle()
        after = await proc.messages()
        assert after[: len(before)] == before and not await _signals(proc, "proc.compacted")
        assert not await k.store.segments(proc.pid)
        _check_whole(after)


async def test_an_interrupt_while_the_summary_is_written_keeps_its_input(tmp_path: Path) -> None:
    started = asyncio.Event()
    summaries = [0]

    async def on_summary() -> str:
        summaries[0] += 1
        if summaries[0] == 1:
            started.set()
            await asyncio.sleep(3600)  # until the interrupt cancels it
        return "Summary: chunks."

    async with _kernel(tmp_path, _chunk_brain(on_summary)) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("produce chunks")
        await asyncio.wait_for(started.wait(), 10)
        await proc.send("question: what now?", mode="interrupt")
        await proc.wait_idle()
        messages = await proc.messages()
        stored = [m.message for m in await k.store.history(proc.pid)]
        assert messages == stored and messages[-1].text == "answered"
        assert sum(m.text == "question: what now?" for m in messages) == 1
        _check_whole(messages)


async def test_a_reset_while_the_summary_is_written_starts_empty(tmp_path: Path) -> None:
    started = asyncio.Event()

    async def on_summary() -> str:
        started.set()
        await asyncio.sleep(3600)  # until the reset's abort cancels it
        return "never"

    async with _kernel(tmp_path, _chunk_brain(on_summary)) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("produce chunks")
        await asyncio.wait_for(started.wait(), 10)
        await proc.reset()
        await proc.wait_idle()
        assert await proc.messages() == [] and await k.store.history(proc.pid) == []
        assert not await _signals(proc, "proc.compacted")


async def test_steered_input_during_a_compaction_joins_the_run_once(tmp_path: Path) -> None:
    procs: list[Any] = []

    async def on_summary() -> str:
        if len(procs) == 1:
            procs.append(await procs[0].send("question: and the totals?"))
        return "Summary: chunks."

    async with _kernel(tmp_path, _chunk_brain(on_summary)) as k:
        proc = await k.spawn(owner="alice")
        procs.append(proc)
        receipt = await proc.send("produce chunks")
        await proc.wait_idle()
        messages = await proc.messages()
        assert sum(m.text == "question: and the totals?" for m in messages) == 1
        assert messages[-1].text == "answered" and procs[1].run_id == receipt.run_id
        assert messages == [m.message for m in await k.store.history(proc.pid)]
        _check_whole(messages)


# ------------------------------------------------------------------ failures


async def test_an_archive_that_cannot_be_written_skips_the_compaction_not_the_run(tmp_path: Path) -> None:
    """The archive is the removed messages' only copy, so without it nothing is replaced; but the
    call can still go ahead (the threshold is below the window), as it does when the summary fails."""

    async def on_summary() -> str:
        return "Summary: chunks."

    async with _kernel(tmp_path, _chunk_brain(on_summary, rounds=8)) as k:

        async def broken(*_: Any) -> str:
            raise OSError(28, "No space left on device")

        k.engine.archive = broken
        proc = await k.spawn(owner="alice")
        await proc.send("produce chunks")
        await proc.wait_idle()
        finished = await _signals(proc, "proc.run.finished")
        messages = await proc.messages()
    assert [f["status"] for f in finished] == ["ok"] and messages[-1].text == "all chunks done"
    assert not any(isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND for m in messages)


async def test_a_crash_between_the_archive_and_the_swap_loses_nothing(tmp_path: Path) -> None:
    """The archive is written, then the worker dies before the history is replaced: the restarted
    run compacts again (a second archive) and no message is lost or doubled."""

    async def on_summary() -> str:
        return "Summary: chunks."

    archived = asyncio.Event()
    async with _kernel(tmp_path, _chunk_brain(on_summary)) as k:
        write = k.engine.archive

        async def then_crash(*args: Any) -> str:
            await write(*args)
            archived.set()
            await asyncio.sleep(3600)  # the worker dies here
            raise AssertionError("not reached")

        k.engine.archive = then_crash
        proc = await k.spawn(owner="alice")
        pid = proc.pid
        await proc.send("produce chunks")
        await asyncio.wait_for(archived.wait(), 10)
        before = await proc.messages()
    async with _kernel(tmp_path, _chunk_brain(on_summary)) as k:
        proc = await k.process(pid)
        await proc.wait_idle()
        messages = await proc.messages()
        compacted = await _signals(proc, "proc.compacted")
        segments = await k.store.segments(pid)
    assert len(compacted) == 1 and len(segments) == 1
    assert isinstance(messages[0], SystemMessage) and messages[0].kind == SUMMARY_KIND
    assert messages[-1].text == "all chunks done"
    archives = list((tmp_path / "var" / "sessions" / "alice" / pid).glob("compaction-*.jsonl.gz"))
    assert len(archives) == 2
    _check_whole(messages)
    removed = compacted[0]["removed"]
    assert messages[1 : len(before) - removed + 1] == before[removed:]


async def test_an_overflow_that_compaction_cannot_cure_ends_the_run_after_one_retry(tmp_path: Path) -> None:
    """A provider that rejects every call once the history grew: one compaction, one retry, then the
    run fails with the provider's error instead of compacting and retrying in a loop."""
    calls = [0]

    def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return "Summary: chunks."
        calls[0] += 1
        if calls[0] <= 3:
            return Reply(tool_calls=[call("dump", n=calls[0])]) if calls[0] < 3 else "ok"
        raise ProviderError("prompt is too long: 9000 tokens > 8192 maximum", kind="overflow")

    async with _kernel(tmp_path, brain, ModelInfo(provider="scripted", id="big", context_window=100_000)) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("produce chunks")
        await proc.wait_idle()
        await proc.send("more")
        await proc.wait_idle()
        finished = await _signals(proc, "proc.run.finished")
        compacted = await _signals(proc, "proc.compacted")
    assert [f["status"] for f in finished] == ["ok", "error"] and "prompt is too long" in finished[-1]["error"]
    assert [c["reason"] for c in compacted] == ["overflow"] and calls[0] == 5
    assert "reset the process to start afresh" in finished[-1]["error"]  # what the person can do about it


async def test_a_summary_that_fails_leaves_the_run_going(tmp_path: Path) -> None:
    """An empty summary (or a failed call) compacts nothing; the run carries on uncompacted."""
    summaries = [0]

    async def on_summary() -> str:
        summaries[0] += 1
        return "<memories>\n- nothing\n</memories>" if summaries[0] % 2 else ""

    async with _kernel(tmp_path, _chunk_brain(on_summary, rounds=8)) as k:
        proc = await k.spawn(owner="alice")
        before = len(await proc.messages())
        await proc.send("produce chunks")
        await proc.wait_idle()
        finished = await _signals(proc, "proc.run.finished")
        messages = await proc.messages()
    assert summaries[0] >= 2 and [f["status"] for f in finished] == ["ok"]
    assert len(messages) > before and not any(isinstance(m, SystemMessage) for m in messages)
    assert not (tmp_path / "home" / "alice" / "memory").exists()


async def test_an_abort_while_the_archive_is_written_replaces_nothing(tmp_path: Path) -> None:
    async def on_summary() -> str:
        return "Summary: chunks."

    writing = asyncio.Event()
    async with _kernel(tmp_path, _chunk_brain(on_summary)) as k:
        write = k.engine.archive

        async def slow(*args: Any) -> str:
            writing.set()
            await asyncio.sleep(3600)
            return await write(*args)

        k.engine.archive = slow
        proc = await k.spawn(owner="alice")
        await proc.send("produce chunks")
        await asyncio.wait_for(writing.wait(), 10)
        before = await proc.messages()
        assert await proc.abort()
        await proc.wait_idle()
        after = await proc.messages()
        assert after[: len(before)] == before and not await k.store.segments(proc.pid)
        assert after == [m.message for m in await k.store.history(proc.pid)]


async def test_a_silently_truncated_answer_is_dropped_for_the_retried_one(tmp_path: Path) -> None:
    """A server that truncates the prompt and answers anyway (usage above the window): the answer
    is discarded, the history compacted, and only the retried answer is kept."""
    brain = _overflowing_fourth_call(lambda: Reply(text="truncated answer", input_tokens=200_000), "full answer")
    async with _kernel(tmp_path, brain, ModelInfo(provider="scripted", id="big", context_window=100_000)) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("produce chunks")
        await proc.wait_idle()
        messages = await proc.messages()
        compacted = await _signals(proc, "proc.compacted")
    assert [c["reason"] for c in compacted] == ["overflow"]
    assert messages[-1].text == "full answer" and not any(m.text == "truncated answer" for m in messages)
    _check_whole(messages)


async def test_a_worker_that_lost_the_process_during_a_summary_installs_nothing(pg_url: str, tmp_path: Path) -> None:
    """A stalls in the summary call past its lease; B takes the run over and finishes it (compacting
    on its own). A's late summary is fenced off at commit: one compaction, nothing lost or doubled."""
    pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")
    stall, stalled = asyncio.Event(), asyncio.Event()
    summaries = [0]

    async def on_summary() -> str:
        summaries[0] += 1
        if summaries[0] == 1:  # A's
            stalled.set()
            await stall.wait()
            return "Summary from A."
        return "Summary from B."

    model = ScriptedModel(_chunk_brain(on_summary), info=SMALL)

    def worker(name: str, ttl: float) -> Any:
        return Kernel.open(
            pg_url,
            model=model,
            tools=[dump],
            workspace=tmp_path,
            data_dir=tmp_path,
            worker=name,
            lease_ttl=ttl,
            poll_interval=0.2,
            clear_tool_outputs=False,
        )

    async with worker("A", 60.0) as a, worker("B", 2.0) as b:
        pa = await a.spawn(owner="alice")
        await pa.send("produce chunks")
        await asyncio.wait_for(stalled.wait(), 10)
        await a.store.pool.execute("UPDATE process_leases SET expires = 0 WHERE pid = $1", pa.pid)
        assert b.engine.leases is not None and await b.engine.leases.hold(pa.pid)
        pb = await b.process(pa.pid)
        await pb.wait_idle()
        done = await pb.messages()
        stall.set()
        for _ in range(100):
            if a.engine.cached(pa.pid) is None:
                break
            await asyncio.sleep(0.02)
        assert a.engine.cached(pa.pid) is None
        messages = await pb.messages()
        compacted = await _signals(pb, "proc.compacted")
        segments = await b.store.segments(pa.pid)
    assert messages == done and messages[-1].text == "all chunks done"
    assert len(compacted) == 1 == len(segments) and "Summary from B." in messages[0].text
    _check_whole(messages)


async def test_the_answer_retried_after_an_overflow_streams_to_watchers(tmp_path: Path) -> None:
    """The call made again after the compaction is streamed like any other: a watcher sees its
    text arrive, not only the finished message."""

    def overflow() -> Reply:
        raise ProviderError("prompt is too long: 9000 tokens > 8192 maximum", kind="overflow")

    brain = _overflowing_fourth_call(overflow, "the answer after compaction")
    async with _kernel(tmp_path, brain, ModelInfo(provider="scripted", id="big", context_window=100_000)) as k:
        proc = await k.spawn(owner="alice")
        streamed: list[str] = []

        async def watch() -> None:
            async for s in proc.signals(follow=True):
                if s.signal == "proc.run.stream" and s.payload["event"] == "text_delta":
                    streamed.append(s.payload["delta"])
                if s.signal == "proc.run.finished":
                    return

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.05)  # following before the run starts
        await proc.send("produce chunks")
        await asyncio.wait_for(watcher, 10)
        compacted = await _signals(proc, "proc.compacted")
    assert [c["reason"] for c in compacted] == ["overflow"]
    assert "".join(streamed) == "the answer after compaction"


async def test_the_summary_call_counts_against_the_run_s_token_budget(tmp_path: Path) -> None:
    """A compaction's summary is a model call the run pays for: its usage joins the run's, so a
    ``max_tokens`` (or ``max_cost``) guard sees it and stops the run at its next turn."""

    rounds = [0]

    def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return Reply(text="Summary: chunks.", input_tokens=1_000_000)
        rounds[0] += 1
        if rounds[0] > 30:
            return "all chunks done"
        return Reply(tool_calls=[call("dump", n=rounds[0])], input_tokens=estimate_tokens(r.messages))

    model = ScriptedModel(brain, info=SMALL)
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=model,
        workspace=tmp_path,
        tools=[dump],
        guards=Guards(max_tokens=500_000),
        clear_tool_outputs=False,
    ) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("produce chunks")
        await proc.wait_idle()
        compacted = await _signals(proc, "proc.compacted")
        finished = await _signals(proc, "proc.run.finished")
    assert len(compacted) == 1 and finished[-1]["reason"] == "max_tokens"
    assert rounds[0] < 30  # stopped by the guard, not by running out of work
