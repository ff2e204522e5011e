"""``ToolRetry`` across a restart: a durable call cut off by a restart is an interruption (not a
permission failure, and not counted), the budgets of a durable run resumed by a new
``Kernel.open`` are counted again from the run's history instead of starting from full, and the
final round of a run whose budget is spent is told why."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentloop import Agent, Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Kernel, Process
from agentloop.loop.hooks import TurnInfo
from agentloop.loop.tool_retry import ToolFailure, ToolRetry, classify_failure
from agentloop.messages import AssistantMessage, Message, TextContent, ToolCall, tool_error_result, user
from agentloop.models.base import ModelRequest
from agentloop.process.api import approve_everything
from agentloop.process.calls import INTERRUPTED_BY_RESTART
from agentloop.tools.builtin import builtin_tools

started = asyncio.Event()  # set by ``hang`` once it runs (replaced per test: an event is bound to its loop)


@tool
async def hang() -> str:
    """Run until the runtime stops (a call a restart cuts off)."""
    started.set()
    await asyncio.sleep(60)
    return "never"


def failures_seen(request: ModelRequest) -> int:
    return sum(1 for m in request.messages if isinstance(m, ToolResultMessage))


def open_kernel(tmp_path: Path, brain: Callable[[ModelRequest], Any]) -> Kernel:
    return Kernel.open(
        f"sqlite:///{tmp_path}/k.db",
        model=ScriptedModel(brain),
        workspace=tmp_path,
        tools=[*builtin_tools(tmp_path, shell=False), hang],
        approval=approve_everything,
        pieces=[ToolRetry()],  # a new piece each time: nothing carried over in memory
    )


async def finished(proc: Process) -> list[tuple[str, str]]:
    signals = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.run.finished"]
    return [(f["status"], f["reason"]) for f in signals]


def test_the_text_of_a_call_a_restart_cut_off_is_an_interruption_and_not_counted() -> None:
    for executed in (True, False):
        verdict = classify_failure(ToolFailure("X", {}, INTERRUPTED_BY_RESTART, None, executed))
        assert verdict.error_class == "cancelled" and not verdict.retryable
        assert verdict.hint is not None and "check" in verdict.hint
    # "may or may not" is no refusal; a "may not" that forbids still is
    unsure = classify_failure(ToolFailure("X", {}, "the cache may or may not be warm yet", None, True))
    assert unsure.error_class == "execution_failed" and unsure.retryable
    assert classify_failure(ToolFailure("X", {}, "You may not write to /etc", None, True)).error_class == (
        "permission_denied"
    )


async def test_a_restart_mid_batch_neither_spends_a_budget_nor_counts_afresh(tmp_path: Path) -> None:
    """Closed while ``hang`` runs: after the reopen its result is the interruption (told as such,
    not counted), the Read that failed beside it keeps its line and is counted once, silently, and
    the failure of the batch before counts too: the third not-found spends the budget of two."""
    global started
    started = asyncio.Event()

    def before(request: ModelRequest) -> Reply | str:
        if failures_seen(request) == 0:
            return Reply(tool_calls=[call("Read", path="a.txt")])
        return Reply(tool_calls=[call("Read", path="b.txt"), call("hang")])

    async with open_kernel(tmp_path, before) as k:
        proc = await k.spawn(owner="me", text="find it")
        await asyncio.wait_for(started.wait(), 5)
        await asyncio.sleep(0.3)  # (the Read beside it has long finished)
        pid = proc.pid

    requests: list[ModelRequest] = []

    def after(request: ModelRequest) -> Reply | str:
        requests.append(request)
        return Reply(tool_calls=[call("Read", path="c.txt")]) if len(requests) == 1 else "It is not there."

    async with open_kernel(tmp_path, after) as k:
        proc = await k.process(pid)
        await asyncio.wait_for(proc.wait_idle(), 10)
        texts = [m.text for m in await proc.messages() if isinstance(m, ToolResultMessage)]
        reasons = await finished(proc)
    assert len(texts) == 4 and texts[2] == INTERRUPTED_BY_RESTART  # (the result itself is the runtime's)
    told = requests[0].system_prompt
    assert "hang (" in told and "[tool retry: class=cancelled, not retryable;" in told
    assert "permission_denied" not in told and "Read (" not in told  # b.txt's line was read already
    assert "budget exhausted: not_found 2/2 used" in texts[3]
    assert reasons == [("ok", "stopped")] and not requests[-1].tools


async def test_a_run_resumed_by_a_new_kernel_keeps_its_spent_budget(tmp_path: Path) -> None:
    """Closed during the model call after two not-found failures (the budget is two): the resumed
    run's third one must spend the budget, not find it full again."""
    hung = asyncio.Event()

    async def before(request: ModelRequest) -> Reply | str:
        seen = failures_seen(request)
        if seen < 2:
            return Reply(tool_calls=[call("Read", path=f"missing-{seen}.txt")])
        hung.set()
        await asyncio.sleep(60)  # the model call a restart cuts off
        return "never"

    async with open_kernel(tmp_path, before) as k:
        proc = await k.spawn(owner="me", text="find it")
        await asyncio.wait_for(hung.wait(), 5)
        pid = proc.pid

    requests: list[ModelRequest] = []

    def after(request: ModelRequest) -> Reply | str:
        requests.append(request)
        return Reply(tool_calls=[call("Read", path="missing-2.txt")]) if len(requests) == 1 else "Not found."

    async with open_kernel(tmp_path, after) as k:
        proc = await k.process(pid)
        await asyncio.wait_for(proc.wait_idle(), 10)
        texts = [m.text for m in await proc.messages() if isinstance(m, ToolResultMessage)]
        reasons = await finished(proc)
    assert len(texts) == 3 and "not_found 0/2" in texts[1]
    assert "budget exhausted: not_found 2/2 used" in texts[2]
    assert reasons == [("ok", "stopped")] and len(requests) == 2 and not requests[-1].tools
    assert "a tool retry budget is spent" in requests[-1].system_prompt


async def test_the_final_round_is_told_which_budget_ended_the_run(tmp_path: Path) -> None:
    model = ScriptedModel([Reply(tool_calls=[call("Read", path=f"{p}.txt")]) for p in "abc"] + ["gave up"])
    agent = Agent(model=model, tools=builtin_tools(tmp_path, shell=False), pieces=[ToolRetry()])
    result = await asyncio.wait_for(agent.run("find it"), 10)
    assert result.stop_reason == "stopped" and len(model.requests) == 4
    final = model.requests[-1].system_prompt
    assert "a tool retry budget is spent (a not_found failure of Read went past the not_found budget (2))" in final
    assert "what would unblock it" in final
    assert all("tool retry budget" not in r.system_prompt for r in model.requests[:-1])


async def test_a_new_run_in_memory_starts_from_full_budgets(tmp_path: Path) -> None:
    """Counting a run again from the history is for a run seen mid-way: a new run of the same
    agent, after one that spent most of its budget, starts from full (its first model call)."""
    runs = 2
    replies: list[Reply | str] = []
    for _ in range(runs):
        replies += [Reply(tool_calls=[call("Read", path="a.txt")]), Reply(tool_calls=[call("Read", path="b.txt")])]
        replies.append("not there")
    model = ScriptedModel(replies)
    agent = Agent(model=model, tools=builtin_tools(tmp_path, shell=False), pieces=[ToolRetry()])
    for _ in range(runs):
        result = await agent.run("find it")
        texts = [m.text for m in result.messages if isinstance(m, ToolResultMessage)][-2:]
        assert "not_found 1/2" in texts[0] and "not_found 0/2" in texts[1]
        assert result.stop_reason == "stop"


def test_a_run_seen_mid_way_is_counted_from_its_own_part_of_the_history() -> None:
    """The recount goes back to the previous run's answer (its failure is not this run's), passes
    over input that joined the run, takes a result's line as it was counted, and tells the facts
    of a refused call that no model call has followed."""

    def batch(call_id: str, text: str) -> list[Message]:
        calls = [ToolCall(id=call_id, name="Read", arguments={"path": call_id})]
        return [AssistantMessage(content=list(calls)), tool_error_result(calls[0], text)]

    line = "\n[tool retry: class=not_found; retries left: rounds 31/32, not_found 1/2; hint: look]"
    history: list[Message] = [
        user("earlier"),
        *batch("x", "File not found: x" + line),
        AssistantMessage(content=[TextContent(text="the earlier run's answer")]),
        user("find it"),
        *batch("a", "File not found: a" + line),
        user("joined the run"),
        *batch("b", 'Validation failed for tool "Read": path is wrong'),
    ]
    piece = ToolRetry()
    told = piece.pre_prompt_context(TurnInfo("r", 2, history, "", [], conversation="p"))
    assert told is not None and told.startswith("Tool failures of your last step:\nRead (b): [tool retry: ")
    assert "class=invalid_arguments; retries left: rounds 30/32, invalid_arguments 2/3, Read 14/16" in told
    # the same run seen again is not counted twice; a new run at its first call starts from full
    assert piece.pre_prompt_context(TurnInfo("r", 3, history, "", [], conversation="p")) is None
    assert piece.pre_prompt_context(TurnInfo("r2", 0, history, "", [], conversation="p")) is None
