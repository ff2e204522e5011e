"""Regression tests from a review of crash-resume and recovery: restarts (a kernel closed mid-run,
as a crash leaves the store) with approvals pending or just given, deadlines past, input waiting,
idempotent calls in flight, and processes that cannot be resumed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Approval
from agentloop.messages import Message, UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process.calls import INTERRUPTED_BY_RESTART
from agentloop.process.store import ProcessRecord
from agentloop.tools.base import Tool
from tests.process_support import assert_valid, echo, kernel, ran


async def ask_risky(process: object, row: Any) -> Approval:
    """Ask about ``echo`` of "risky"; everything else runs."""
    if row.tool_name == "echo" and row.args.get("text") == "risky":
        return Approval("ask", ("mutating",), "risky", fingerprint="fp")
    return Approval("auto")


async def until(check: Any, seconds: float = 5.0) -> None:
    async with asyncio.timeout(seconds):
        while not await check():
            await asyncio.sleep(0.01)


async def resumed(tmp_path: Path, pid: str, model: Any, **kw: Any) -> list[Message]:
    """Open the kernel again after the crash and let the resumed run end: the process's messages."""
    async with kernel(tmp_path, model, **kw) as k:
        proc = await k.process(pid)
        await asyncio.wait_for(proc.wait_idle(), 5)
        return await proc.messages()


def results(msgs: list[Message]) -> list[str]:
    return [m.text for m in msgs if isinstance(m, ToolResultMessage)]


def stalled_lookup(seen: list[str]) -> Tool:
    """An idempotent read that records each call in ``seen`` and stalls on the first (the call a
    restart cuts short), answering at once after that."""

    @tool(idempotent=True)
    async def lookup(key: str) -> str:
        """Read-only lookup."""
        seen.append(key)
        await asyncio.sleep(30 if len(seen) == 1 else 0)
        return f"value of {key}"

    return lookup


async def test_a_restart_while_one_call_of_a_parallel_batch_awaits_approval_reruns_no_sibling(tmp_path: Path) -> None:
    ran.clear()
    batch = Reply(tool_calls=[call("echo", text="a"), call("echo", text="risky"), call("echo", text="b")])

    def brain(r: ModelRequest) -> Reply | str:
        return batch if isinstance(r.messages[-1], UserMessage) else "done: " + " | ".join(results(r.messages))

    async with kernel(tmp_path, ScriptedModel(brain), approval=ask_risky) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        await until(proc.pending_approvals)
        pid = proc.pid
    async with kernel(tmp_path, ScriptedModel(brain), approval=ask_risky) as k:
        proc = await k.process(pid)
        [ask] = await proc.pending_approvals()
        await proc.hil(ask.request_id, "approve")
        await asyncio.wait_for(proc.wait_idle(), 5)
        msgs = await proc.messages()
    assert ran == ["a", "risky", "b"]
    assert_valid(msgs)
    assert msgs[-1].text == "done: a | risky | b"


async def test_an_approval_given_just_before_a_crash_is_carried_out_after_the_restart(tmp_path: Path) -> None:
    ran.clear()
    batch = Reply(tool_calls=[call("echo", text="a"), call("echo", text="risky")])

    def brain(r: ModelRequest) -> Reply | str:
        return batch if isinstance(r.messages[-1], UserMessage) else "done: " + " | ".join(results(r.messages))

    async with kernel(tmp_path, ScriptedModel(brain), approval=ask_risky) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        await until(proc.pending_approvals)
        [ask] = await proc.pending_approvals()
        k.engine.wake = lambda pid: None  # type: ignore[method-assign]  # the crash comes before the dispatch
        await proc.hil(ask.request_id, "approve")
        pid = proc.pid
    assert ran == ["a"]
    msgs = await resumed(tmp_path, pid, ScriptedModel(brain), approval=ask_risky)
    assert ran == ["a", "risky"]
    assert_valid(msgs)
    assert msgs[-1].text == "done: a | risky"


async def test_an_approved_call_runs_though_the_user_spoke_while_it_was_pending(tmp_path: Path) -> None:
    """A call whose approval is pending stays when input arrives (the person answers what they were
    shown): approved, it runs; it is not skipped as stale once the question is gone."""
    ran.clear()

    def brain(r: ModelRequest) -> Reply | str:
        last = r.messages[-1]
        if isinstance(last, UserMessage) and last.text == "go":
            return Reply(tool_calls=[call("echo", text="risky")])
        return "done: " + " | ".join(results(r.messages))

    async with kernel(tmp_path, ScriptedModel(brain), approval=ask_risky) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        await until(proc.pending_approvals)
        [ask] = await proc.pending_approvals()
        await proc.send("and be quick", mode="steer")
        await proc.hil(ask.request_id, "approve")
        await asyncio.wait_for(proc.wait_idle(), 5)
        msgs = await proc.messages()
    assert ran == ["risky"]
    assert_valid(msgs)
    assert msgs[-1].text == "done: risky"


async def test_an_idempotent_call_cut_by_a_restart_is_rerun_though_input_waits(tmp_path: Path) -> None:
    """The user spoke while an idempotent call was in flight; a restart cut it. It was started, so
    it is re-run (as the design says), not skipped like a call that never began."""
    seen: list[str] = []

    lookup = stalled_lookup(seen)

    def brain(r: ModelRequest) -> Reply | str:
        last = r.messages[-1]
        if isinstance(last, UserMessage) and last.text == "look":
            return Reply(tool_calls=[call("lookup", key="k")])
        return "done: " + " | ".join(results(r.messages))

    async with kernel(tmp_path, ScriptedModel(brain), tools=[lookup]) as k:
        proc = await k.spawn(owner="a")
        await proc.send("look")
        await until(lambda: asyncio.sleep(0, len(seen) == 1))
        await proc.send("and hurry", mode="steer")
        pid = proc.pid
    msgs = await resumed(tmp_path, pid, ScriptedModel(brain), tools=[lookup])
    assert seen == ["k", "k"]
    assert_valid(msgs)
    assert msgs[-1].text == "done: value of k"


async def test_one_process_that_cannot_be_resumed_does_not_keep_the_others_from_resuming(tmp_path: Path) -> None:
    """A run whose tools cannot be had after a restart (its toolset fails) must not stop the
    runtime from starting, nor the other processes' runs from resuming; it ends visibly."""
    broken = {"on": False}

    def toolset(record: ProcessRecord, shared: dict[str, Tool]) -> dict[str, Tool]:
        if broken["on"] and record.owner == "bad":
            raise RuntimeError("the account's tools are gone")
        return shared

    def brain(r: ModelRequest) -> Reply | str:
        last = r.messages[-1]
        if isinstance(last, UserMessage):
            return Reply(tool_calls=[call("slow", seconds=0.3)])
        return "done: " + last.text

    async with kernel(tmp_path, ScriptedModel(brain), toolset=toolset) as k:
        bad, good = await k.spawn(owner="bad"), await k.spawn(owner="good")
        await bad.send("go")
        await good.send("go")
        await asyncio.sleep(0.1)  # both slow calls are in flight
    broken["on"] = True
    async with kernel(tmp_path, ScriptedModel(brain), toolset=toolset) as k:
        good = await k.process(good.pid)
        await asyncio.wait_for(good.wait_idle(), 5)
        assert (await good.messages())[-1].text == "done: " + INTERRUPTED_BY_RESTART
        bad = await k.process(bad.pid)
        await asyncio.wait_for(bad.wait_idle(), 5)
        msgs = await bad.messages()
        assert_valid(msgs)
        finished = [s.payload async for s in bad.signals(follow=False) if s.signal == "proc.run.finished"]
        assert finished[-1]["status"] == "error"


async def test_a_deadline_that_passed_during_the_outage_ends_the_call_once(tmp_path: Path) -> None:
    @tool(timeout=0.3)
    async def brief() -> str:
        """Not idempotent, with a short timeout."""
        await asyncio.sleep(30)
        return "never"

    def brain(r: ModelRequest) -> Reply | str:
        last = r.messages[-1]
        if isinstance(last, UserMessage):
            return Reply(tool_calls=[call("brief"), call("echo", text="x")])
        return "done: " + " | ".join(results(r.messages))

    async with kernel(tmp_path, ScriptedModel(brain), tools=[brief, echo]) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        await asyncio.sleep(0.1)
        pid = proc.pid
    await asyncio.sleep(0.4)  # the call's deadline passes while the runtime is down
    async with kernel(tmp_path, ScriptedModel(brain), tools=[brief, echo]) as k:
        proc = await k.process(pid)
        await asyncio.wait_for(proc.wait_idle(), 5)
        msgs = await proc.messages()
        finished = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.run.tool.finished"]
    assert_valid(msgs)
    assert len([f for f in finished if f["name"] == "brief"]) == 1
    assert "interrupted by a restart" in results(msgs)[0]


async def test_a_subagent_call_cut_by_a_restart_gets_its_childs_answer_though_input_waits(tmp_path: Path) -> None:
    """``Task`` is idempotent: after a restart its call runs again and finds the child. Input the
    user sent meanwhile must not turn it into a skipped call, leaving the child's work unread."""

    def brain(r: ModelRequest) -> Reply | str:
        first = next(m.text for m in r.messages if isinstance(m, UserMessage))
        last = r.messages[-1]
        if first.startswith("job"):  # the child: a slow step, then its answer
            return Reply(tool_calls=[call("slow", seconds=0.5)]) if isinstance(last, UserMessage) else "child done"
        if isinstance(last, UserMessage) and last.text == "delegate":
            return Reply(tool_calls=[call("Task", prompt="job X")])
        return "parent got: " + " | ".join(results(r.messages))

    async with kernel(tmp_path, ScriptedModel(brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("delegate")

        async def child_started() -> bool:
            return any(r.parent_pid == parent.pid for r in await k.processes("alice"))

        await until(child_started)
        await parent.send("thanks, go on", mode="steer")
    async with kernel(tmp_path, ScriptedModel(brain), subagents=True) as k:
        parent = await k.process(parent.pid)
        await asyncio.wait_for(parent.wait_idle(), 10)
        msgs = await parent.messages()
    assert_valid(msgs)
    assert results(msgs) == ["child done"]


async def test_an_idempotent_sibling_in_flight_is_rerun_while_the_other_call_still_awaits_approval(
    tmp_path: Path,
) -> None:
    """A restart cuts an idempotent call while its sibling waits for a person: the cut call runs
    again at once (the question does not hold it back), the question stays, and once approved the
    sibling runs; nothing runs twice but the cut call."""
    ran.clear()
    seen: list[str] = []

    lookup = stalled_lookup(seen)

    def brain(r: ModelRequest) -> Reply | str:
        if isinstance(r.messages[-1], UserMessage):
            return Reply(tool_calls=[call("lookup", key="k"), call("echo", text="risky")])
        return "done: " + " | ".join(results(r.messages))

    async with kernel(tmp_path, ScriptedModel(brain), tools=[lookup, echo], approval=ask_risky) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        await until(proc.pending_approvals)
        pid = proc.pid
    async with kernel(tmp_path, ScriptedModel(brain), tools=[lookup, echo], approval=ask_risky) as k:
        proc = await k.process(pid)
        await until(lambda: asyncio.sleep(0, len(seen) == 2))
        [ask] = await proc.pending_approvals()
        await proc.hil(ask.request_id, "approve")
        await asyncio.wait_for(proc.wait_idle(), 5)
        msgs = await proc.messages()
    assert seen == ["k", "k"] and ran == ["risky"]
    assert_valid(msgs)
    assert msgs[-1].text == "done: value of k | risky"


async def test_a_second_restart_right_after_the_first_reruns_an_idempotent_call_only_once_more(
    tmp_path: Path,
) -> None:
    """Two restarts in a row, the second before the re-run call did anything: it is dispatched
    once more in all, not once per restart that found it in flight."""
    seen: list[str] = []

    lookup = stalled_lookup(seen)

    def brain(r: ModelRequest) -> Reply | str:
        if isinstance(r.messages[-1], UserMessage):
            return Reply(tool_calls=[call("lookup", key="k")])
        return "done: " + " | ".join(results(r.messages))

    async with kernel(tmp_path, ScriptedModel(brain), tools=[lookup]) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        await until(lambda: asyncio.sleep(0, len(seen) == 1))
        pid = proc.pid
    gone: list[str] = []

    @tool(idempotent=True, name="lookup")
    async def lookup_down(key: str) -> str:
        """The same lookup, while its backend is down: it never gets to run."""
        gone.append(key)
        await asyncio.sleep(30)
        return "never"

    async with kernel(tmp_path, ScriptedModel(brain), tools=[lookup_down]) as k:
        pass  # a second crash, at once
    msgs = await resumed(tmp_path, pid, ScriptedModel(brain), tools=[lookup])
    assert len(seen) + len(gone) <= 3 and seen[-1] == "k"
    assert_valid(msgs)
    assert msgs[-1].text == "done: value of k"
