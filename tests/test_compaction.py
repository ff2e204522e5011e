"""Compaction: estimates, pressure, the cut that keeps tool exchanges whole, the summary call."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentloop.events import StreamEvent
from agentloop.messages import (
    AssistantMessage,
    ImageContent,
    Message,
    SystemMessage,
    TextContent,
    ThinkingContent,
    ToolCall,
    ToolResultMessage,
    Usage,
    system,
    user,
)
from agentloop.models.base import AssistantBuilder, Model, ModelInfo, ModelRequest, ProviderError, ToolSpec
from agentloop.models.scripted import ScriptedModel
from agentloop.process.compaction import (
    IMAGE_TOKENS,
    SUMMARY_KIND,
    SUMMARY_SYSTEM_PROMPT,
    CompactionError,
    compact,
    context_tokens,
    estimate_tokens,
    plan_cut,
    pressure,
    should_compact,
    split_memories,
    summarize,
)
from agentloop.tools.base import tool

# ------------------------------------------------------------------ helpers

_n = 0


def _id() -> str:
    global _n
    _n += 1
    return f"call_{_n}"


def assistant(text: str = "", calls: list[ToolCall] | None = None, usage: Usage | None = None) -> AssistantMessage:
    content: list[Any] = [TextContent(text=text)] if text else []
    content.extend(calls or [])
    return AssistantMessage(content=content, usage=usage or Usage(), stop_reason="toolUse" if calls else "stop")


def result(call: ToolCall, text: str) -> ToolResultMessage:
    return ToolResultMessage(tool_call_id=call.id, tool_name=call.name, content=[TextContent(text=text)])


def exchange(n_calls: int, size: int) -> list[Message]:
    calls = [ToolCall(id=_id(), name="read", arguments={"path": f"f{i}.py"}) for i in range(n_calls)]
    return [assistant("let me look", calls), *(result(c, "x" * size) for c in calls)]


def long_history(rounds: int = 10, size: int = 2_000) -> list[Message]:
    msgs: list[Message] = [user("please refactor the parser")]
    for _ in range(rounds):
        msgs.extend(exchange(2, size))
    msgs.append(assistant("done"))
    return msgs


def check_cut(messages: list[Message], cut: int, keep: int) -> None:
    """The invariants every cut must hold."""
    removed, kept = messages[:cut], messages[cut:]
    assert len(removed) >= 2 and kept
    assert not isinstance(kept[0], ToolResultMessage)
    removed_calls = {tc.id for m in removed if isinstance(m, AssistantMessage) for tc in m.tool_calls}
    kept_calls = {tc.id for m in kept if isinstance(m, AssistantMessage) for tc in m.tool_calls}
    for m in kept:
        if isinstance(m, ToolResultMessage):
            assert m.tool_call_id not in removed_calls
            assert m.tool_call_id in kept_calls
    for m in removed:
        if isinstance(m, ToolResultMessage):
            assert m.tool_call_id not in kept_calls
    if estimate_tokens(kept) < keep:  # moved forward: no earlier cut that splits nothing kept that much
        assert all(estimate_tokens(messages[c:]) < keep for c in range(2, cut) if _whole_tail(messages, c))


def _whole_tail(messages: list[Message], cut: int) -> bool:
    """Whether a tail from ``cut`` has each of its tool results' calls."""
    calls = {tc.id for m in messages[cut:] if isinstance(m, AssistantMessage) for tc in m.tool_calls}
    return all(m.tool_call_id in calls for m in messages[cut:] if isinstance(m, ToolResultMessage))


# ------------------------------------------------------------------ estimates


def test_estimates_are_deterministic_and_ignore_timestamps_and_usage() -> None:
    a = user("hello world")
    b = user("hello world")
    b.timestamp = a.timestamp + 99_999
    assert estimate_tokens(a) == estimate_tokens(b) == estimate_tokens(a)
    x, y = assistant("hi"), assistant("hi", usage=Usage(input=5_000, output=10))
    assert estimate_tokens(x) == estimate_tokens(y)


def test_estimates_grow_with_text_and_history() -> None:
    sizes = [estimate_tokens("a" * n) for n in range(0, 200)]
    assert sizes == sorted(sizes) and sizes[0] == 0 and sizes[-1] > sizes[1]
    history: list[Message] = []
    last = 0
    for m in long_history(rounds=3, size=50):
        history.append(m)
        now = estimate_tokens(history)
        assert now > last
        last = now
    assert estimate_tokens(history) == sum(estimate_tokens(m) for m in history)


def test_images_cost_a_flat_amount_whatever_their_size() -> None:
    small = user("look", ImageContent(data="A" * 10, mime_type="image/png"))
    big = user("look", ImageContent(data="A" * 1_000_000, mime_type="image/png"))
    assert estimate_tokens(small) == estimate_tokens(big)
    assert estimate_tokens(small) >= IMAGE_TOKENS


def test_tool_specs_thinking_and_calls_count() -> None:
    spec = ToolSpec(name="read", description="Read a file", parameters={"type": "object", "properties": {}})
    assert estimate_tokens(spec) > 0
    assert estimate_tokens([spec, spec]) == 2 * estimate_tokens(spec)
    plain = assistant("ok")
    rich = AssistantMessage(
        content=[
            ThinkingContent(thinking="t" * 400),
            TextContent(text="ok"),
            ToolCall(id="c", name="n", arguments={"a": 1}),
        ]
    )
    assert estimate_tokens(rich) > estimate_tokens(plain)
    assert estimate_tokens(None) == 0


# ------------------------------------------------------------------ pressure

INFO = ModelInfo(provider="t", id="m", context_window=10_000, max_output=2_000)


def test_pressure_from_estimate_when_no_usage() -> None:
    msgs: list[Message] = [user("a" * 4_000), assistant("b" * 400)]  # zero usage: estimate everything
    tools = [ToolSpec(name="read", description="d", parameters={})]
    expected = (estimate_tokens("sys") + estimate_tokens(tools) + estimate_tokens(msgs)) / 8_000
    assert pressure("sys", tools, msgs, INFO) == pytest.approx(expected)
    assert pressure("sys", tools, msgs, INFO, reserved_output=0) == pytest.approx(expected * 8_000 / 10_000)


def test_pressure_prefers_real_usage_plus_estimate_of_what_follows() -> None:
    call = ToolCall(id="c1", name="read", arguments={})
    tail = result(call, "z" * 800)
    msgs: list[Message] = [
        user("short"),
        assistant("", [call], usage=Usage(input=3_000, cache_read=1_000, output=100)),
        tail,
    ]
    assert context_tokens("", [], msgs) == 4_100 + estimate_tokens(tail)
    assert pressure("", [], msgs, INFO) == pytest.approx((4_100 + estimate_tokens(tail)) / 8_000)


def test_all_zero_errored_and_pre_summary_usage_are_ignored() -> None:
    stale = assistant("old", usage=Usage(input=9_000))
    errored = AssistantMessage(content=[], usage=Usage(input=7_000), stop_reason="error", error_message="x")
    msgs: list[Message] = [stale, system("summary", kind="summary"), user("q"), assistant("a"), errored]
    assert context_tokens("p", [], msgs) == estimate_tokens("p") + estimate_tokens(msgs)


def test_should_compact_threshold() -> None:
    assert should_compact(0.95) and should_compact(0.9) and not should_compact(0.89)
    assert should_compact(0.5, threshold=0.5)
    with pytest.raises(ValueError):
        should_compact(0.5, threshold=0)


# ------------------------------------------------------------------ plan_cut


def test_plan_cut_none_for_tiny_or_small_histories() -> None:
    assert plan_cut([], 10) is None
    assert plan_cut([user("hi")], 0) is None
    assert plan_cut([user("hi"), assistant("ho")], 0) is None
    assert plan_cut(long_history(rounds=2, size=10), 1_000_000) is None  # everything fits


def test_plan_cut_moves_back_to_keep_the_tool_exchange_whole() -> None:
    msgs = long_history(rounds=6, size=400)
    # The two newest results alone reach the budget: the cut lands on a result and must move back.
    keep = estimate_tokens(msgs[-3:])
    cut = plan_cut(msgs, keep)
    assert cut is not None
    first = msgs[cut]
    assert isinstance(first, AssistantMessage) and first.tool_calls
    check_cut(msgs, cut, keep)


def test_plan_cut_keeps_at_least_the_newest_message() -> None:
    msgs = long_history(rounds=3, size=100)
    cut = plan_cut(msgs, 0)
    assert cut == len(msgs) - 1


def test_plan_cut_none_when_the_whole_history_is_one_exchange() -> None:
    msgs: list[Message] = [user("go"), *exchange(8, 500)]
    assert plan_cut(msgs, estimate_tokens(msgs[-1])) is None  # moving back reaches index 1


@st.composite
def histories(draw: st.DrawFn) -> list[Message]:
    msgs: list[Message] = []
    if draw(st.booleans()):
        msgs.append(system("earlier summary " * draw(st.integers(1, 30)), kind="summary"))
    text = st.integers(0, 300).map(lambda n: "w" * n)
    for _ in range(draw(st.integers(1, 5))):
        msgs.append(user(draw(text) or "q"))
        for _ in range(draw(st.integers(0, 4))):
            n_calls = draw(st.integers(0, 4))
            calls = [ToolCall(id=_id(), name="t", arguments={"n": draw(text)}) for _ in range(n_calls)]
            msgs.append(assistant(draw(text), calls))
            results = [result(c, draw(text)) for c in calls]
            # results normally come in the model's order; be robust to any order anyway
            msgs.extend(draw(st.permutations(results)) if results else [])
            if calls and draw(st.integers(0, 4)) == 0:
                msgs.append(system("event", kind="event"))  # steered input after the results
        msgs.append(assistant(draw(text) or "answer"))
    return msgs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=histories(), frac=st.floats(0, 1.2))
def test_cut_never_splits_tool_calls_from_results(msgs: list[Message], frac: float) -> None:
    keep = int(estimate_tokens(msgs) * frac)
    cut = plan_cut(msgs, keep)
    if cut is not None:
        check_cut(msgs, cut, keep)


# ------------------------------------------------------------------ summarize / compact

SUMMARY = "## Goal\nRefactor the parser.\n## Open tasks and next steps\nRun the tests."


async def test_compact_builds_summary_and_exact_partition() -> None:
    msgs = long_history(rounds=10, size=3_000)
    model = ScriptedModel([SUMMARY])
    res = await compact(msgs, model, keep_recent_tokens=3_000, reason="threshold")
    assert res is not None
    assert res.removed + res.kept == msgs
    assert len(res.removed) >= 2 and res.kept
    check_cut(msgs, len(res.removed), 3_000)
    assert res.summary.kind == "summary" and isinstance(res.summary, SystemMessage)
    assert SUMMARY in res.summary.text
    assert f"replaces {len(res.removed)} earlier messages" in res.summary.text
    assert res.history == [res.summary, *res.kept]
    assert res.reason == "threshold"
    assert res.tokens_before == estimate_tokens(msgs)
    assert res.tokens_after == estimate_tokens(res.history) < res.tokens_before
    meta = res.meta()
    assert meta["reason"] == "threshold" and meta["removed"] == len(res.removed)
    # the summary call: no tools, the clipped transcript, a bounded answer
    (req,) = model.requests
    assert req.tools == [] and req.max_tokens is not None
    prompt = req.messages[0]
    assert prompt.role == "user"
    assert "refactor the parser" in prompt.text
    assert "x" * 2_001 not in prompt.text
    assert "1000 more characters clipped" in prompt.text


async def test_compact_returns_none_without_calling_the_model() -> None:
    model = ScriptedModel([])
    assert await compact([user("hi"), assistant("ho")], model, reason="manual") is None
    assert model.calls == 0


async def test_previous_summary_is_rolled_forward() -> None:
    msgs: list[Message] = [system("Summary ... user wants X", kind="summary"), *long_history(rounds=6, size=1_000)]
    model = ScriptedModel([SUMMARY])
    res = await compact(msgs, model, keep_recent_tokens=1_000, reason="overflow", instructions="focus on files")
    assert res is not None and res.removed[0] is msgs[0]
    text = model.requests[0].messages[0].text
    assert "<previous-summary>" in text and "user wants X" in text and "focus on files" in text


async def test_still_applies_detects_a_changed_history() -> None:
    msgs = long_history(rounds=6, size=1_000)
    res = await compact(msgs, ScriptedModel([SUMMARY]), keep_recent_tokens=1_000, reason="threshold")
    assert res is not None
    assert res.still_applies(msgs)
    assert res.still_applies([*msgs, user("more input arrived meanwhile")])
    assert not res.still_applies(msgs[1:])
    assert not res.still_applies([user("after a reset")])


@pytest.mark.parametrize(
    ("answer", "summary", "memories"),
    [
        ("## Goal\nship it\n<memories>\n- prefers tabs\n</memories>", "## Goal\nship it", "- prefers tabs"),
        ("## Goal\nship it\n<MEMORIES>none</MEMORIES>", "## Goal\nship it", None),
        ("## Goal\nship it\n<memories>\n- None.\n</memories>", "## Goal\nship it", None),
        ("## Goal\nship it", "## Goal\nship it", None),  # a model that leaves the block out
        ("## Goal\nship it\n<memories>\n- cut off mid", "## Goal\nship it", "- cut off mid"),
        # a summary that only talks about the tag keeps all of itself
        ("## Goal\nAdd a <memories> parser\n## Facts\nx", "## Goal\nAdd a <memories> parser\n## Facts\nx", None),
        (
            "## Goal\nAdd a <memories> parser\n<memories>\n- real\n</memories>",
            "## Goal\nAdd a <memories> parser",
            "- real",
        ),
        ("## Goal\n<memories>- a</memories> and more", "## Goal\n<memories>- a</memories> and more", None),
    ],
)
def test_the_memories_block_is_split_from_the_summary(answer: str, summary: str, memories: str | None) -> None:
    assert split_memories(answer) == (summary, memories)


async def test_compaction_carries_the_memories_apart_from_the_summary() -> None:
    answer = f"{SUMMARY}\n<memories>\n- The user deploys on Fridays.\n</memories>"
    model = ScriptedModel([answer])
    res = await compact(long_history(rounds=10, size=3_000), model, keep_recent_tokens=3_000, reason="threshold")
    assert res is not None and res.memories == "- The user deploys on Fridays."
    assert SUMMARY in res.summary.text and "memories" not in res.summary.text.lower()
    assert res.meta()["memories"] == res.memories
    assert "<memories>" in model.requests[0].system_prompt  # the model was asked for them


@pytest.mark.parametrize(
    "reply",
    [ProviderError("upstream exploded", kind="server"), "", "   \n", "<memories>- only this</memories>"],
    ids=["provider-error", "empty", "blank", "memories-only"],
)
async def test_failing_or_empty_summary_raises(reply: Any) -> None:
    with pytest.raises(CompactionError) as info:
        await compact(long_history(), ScriptedModel([reply]), keep_recent_tokens=1_000, reason="threshold")
    if isinstance(reply, ProviderError):
        assert "upstream exploded" in str(info.value)


class RaisingModel(Model):
    info = ModelInfo(provider="broken", id="m")

    async def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
        raise AssertionError("not used")
        yield  # pragma: no cover

    async def complete(self, request: ModelRequest) -> AssistantMessage:
        raise RuntimeError("adapter bug")


async def test_a_raising_adapter_becomes_compaction_error() -> None:
    with pytest.raises(CompactionError, match="adapter bug"):
        await summarize(RaisingModel(), long_history(rounds=2, size=10))


async def test_huge_transcripts_are_bounded_to_the_summary_model() -> None:
    info = ModelInfo(provider="scripted", id="small", context_window=8_000, max_output=1_000)
    model = ScriptedModel([SUMMARY], info=info)
    msgs: list[Message] = [user("goal: " + "g" * 100)]
    for i in range(200):
        msgs += [user(f"step {i} " + "u" * 300), assistant("a" * 300)]
    text, _, _ = await summarize(model, msgs)
    assert text == SUMMARY
    prompt = model.requests[0].messages[0].text
    assert "goal:" in prompt and "step 199" in prompt and "characters omitted" in prompt
    assert len(prompt) < 40_000


# ------------------------------------------------------------------ found by a review (durable)


def _kernel(tmp_path: Any, brain: Any, info: ModelInfo, tools: list[Any]) -> Any:
    from agentloop.kernel import Kernel

    return Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=ScriptedModel(brain, info=info),
        workspace=tmp_path,
        tools=tools,
        clear_tool_outputs=False,  # (the summary's tests: the first tier has its own)
    )


async def _compactions(proc: Any) -> list[dict[str, Any]]:
    return [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.compacted"]


def test_usage_a_compaction_kept_from_before_it_is_not_read_as_the_current_size() -> None:
    """Messages kept in the tail carry usage measured on the history compacted away."""
    kept = assistant("ok", usage=Usage(input=11_000, output=5))
    summary = SystemMessage(content=[TextContent(text="Summary ...")], kind=SUMMARY_KIND)
    summary.timestamp = kept.timestamp + 1  # made after what it kept
    history = [summary, user("small"), kept, user("hi")]
    assert context_tokens("", [], history) == estimate_tokens(history)
    later = assistant("fresh", usage=Usage(input=900, output=5))
    later.timestamp = summary.timestamp + 1
    assert context_tokens("", [], [*history, later]) == 905


async def test_replies_without_usage_after_a_compaction_do_not_compact_again_and_again(tmp_path: Any) -> None:
    from agentloop import Reply, call, tool

    info = ModelInfo(provider="scripted", id="small", context_window=12_000, max_output=200)

    @tool
    def dump(n: int) -> str:
        """Return a long text."""
        return f"chunk {n}: " + "lorem ipsum dolor sit amet " * 60

    after = [0]

    def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return "Summary: chunks were produced."
        compacted = any(isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND for m in r.messages)
        after[0] += compacted
        if after[0] > 10:
            return "all done"
        used = estimate_tokens(r.system_prompt) + estimate_tokens(r.tools) + estimate_tokens(r.messages)
        done = sum(isinstance(m, ToolResultMessage) for m in r.messages)
        # usage reported before the first compaction, none after it (a fallback, a local server)
        return Reply(tool_calls=[call("dump", n=done)], input_tokens=0 if compacted else used, output_tokens=1)

    async with _kernel(tmp_path, brain, info, [dump]) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("produce chunks")
        await proc.wait_idle()
        assert len(await _compactions(proc)) == 1  # was 9: the kept tail's stale usage each time


async def test_an_exchange_bigger_than_the_tail_is_compacted_once_newer_input_follows(tmp_path: Any) -> None:
    """Two parallel results of ~33k characters against a 16k-token window: the run that read them
    fails, but the next message compacts them away instead of failing the same way for ever."""
    from agentloop import Reply, call, tool

    info = ModelInfo(provider="scripted", id="local-16k", context_window=16_000, max_output=1_000)

    @tool
    def read_log(part: int) -> str:
        """Read part of a log."""
        return f"log part {part}\n" + "2024-05-01 12:00:00 INFO request served in 3ms\n" * 700

    def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return "Summary: the user asked to read the logs."
        size = estimate_tokens(r.system_prompt) + estimate_tokens(r.tools) + estimate_tokens(r.messages)
        if size > info.context_window:
            raise ProviderError(f"prompt is too long: {size} tokens > 16000 maximum", kind="overflow")
        if r.messages[-1].text == "read the logs":
            return Reply(tool_calls=[call("read_log", part=1), call("read_log", part=2)])
        return "4"

    async with _kernel(tmp_path, brain, info, [read_log]) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("read the logs")
        await proc.wait_idle()
        await proc.send("never mind. what is 2+2?")
        await proc.wait_idle()
        assert (await proc.messages())[-1].text == "4" and len(await _compactions(proc)) == 1
    failed = AssistantMessage(content=[], stop_reason="error", error_message="prompt is too long")
    huge = [user("x" * 80_000), failed, user("sorry, what is 2+2?")]
    assert plan_cut(huge, 4_000) == 2  # a pasted message bigger than the window goes the same way


# A provider that counts CJK text at about a token per character, four times the estimate.
CJK_MODEL = ModelInfo(provider="scripted", id="m", context_window=16_000, max_output=1_000)


def cjk_tokens(text: str) -> int:
    cjk = sum(1 for ch in text if "\u4e00" <= ch <= "\u9fff")
    return cjk + (len(text) - cjk) // 4


def cjk_request_tokens(r: ModelRequest) -> int:
    """What that provider would count for request ``r``."""
    return cjk_tokens(r.system_prompt) + sum(cjk_tokens(m.text) + 4 for m in r.messages) + 200 * len(r.tools)


@tool
def read_doc(n: int) -> str:
    """Read a chapter."""
    return f"第{n}章 " + "系统设计文档内容说明" * 150


async def test_threshold_compaction_fires_where_the_provider_counts_more_tokens_than_the_estimate(
    tmp_path: Any,
) -> None:
    """CJK text is about a token per character, four times the estimate: the kept quarter of the
    window is scaled by what the provider reports, so compaction happens before an overflow."""
    from agentloop import Reply, call

    info = CJK_MODEL
    rejected, turns = [0], [0]

    def brain(r: ModelRequest) -> Any:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return "摘要：用户要求阅读规格说明。"
        size = cjk_request_tokens(r)
        if size > info.context_window:
            rejected[0] += 1
            raise ProviderError(f"prompt is too long: {size} tokens", kind="overflow")
        turns[0] += 1
        if turns[0] >= 40:
            return "完成"
        return Reply(tool_calls=[call("read_doc", n=turns[0])], input_tokens=size)

    async with _kernel(tmp_path, brain, info, [read_doc]) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("请阅读所有章节")
        await proc.wait_idle()
        reasons = {c["reason"] for c in await _compactions(proc)}
    assert reasons == {"threshold"} and rejected == [0]
