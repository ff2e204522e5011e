"""Regression tests from a review of the durable runner: failure paths, reset/kill, recovery, races."""

from __future__ import annotations

import asyncio

import pytest

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Approval, NoSuchProcess
from agentloop.messages import SystemMessage, UserMessage, user
from agentloop.models.base import ModelRequest
from agentloop.process.compaction import MEMORY_SYSTEM_PROMPT
from agentloop.tools.base import ToolResult
from tests.process_support import assert_valid, echo, kernel, ran


def echo_then_answer(r: ModelRequest) -> Reply | str:
    last = r.messages[-1]
    if isinstance(last, UserMessage):
        return Reply(tool_calls=[call("echo", text=last.text)])
    return "done: " + last.text


async def test_an_internal_error_ends_the_run_and_queued_input_still_runs(tmp_path):
    ran.clear()
    failures = 0

    async def flaky(process, row) -> Approval:
        nonlocal failures
        if failures == 0:
            failures += 1
            raise RuntimeError("policy store unavailable")
        return Approval("auto")

    model = ScriptedModel(echo_then_answer, latency=0.1)
    async with kernel(tmp_path, model, approval=flaky) as k:
        proc = await k.spawn(owner="a")
        await proc.send("first")
        await proc.send("second", mode="queue")
        await asyncio.wait_for(proc.wait_idle(), 5)  # the promoted run is driven, not left hanging
        msgs = await proc.messages()
        assert any(isinstance(m, SystemMessage) and "internal error" in m.text for m in msgs)
        assert msgs[-1].text == "done: second" and ran == ["second"]
        assert_valid(msgs)


async def test_an_internal_error_with_open_calls_leaves_a_valid_history(tmp_path):
    ran.clear()

    async def policy(process, row) -> Approval:
        text = row.args.get("text")
        if text == "risky":
            return Approval("ask", ("destructive",), "risky", fingerprint="fp")
        if text == "boom":
            raise RuntimeError("policy cannot judge this call")
        return Approval("auto")

    model = ScriptedModel(
        [Reply(tool_calls=[call("echo", text="safe"), call("echo", text="risky"), call("echo", text="boom")]), "ok"]
    )
    async with kernel(tmp_path, model, approval=policy) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        for _ in range(200):
            if await proc.pending_approvals():
                break
            await asyncio.sleep(0.01)
        [ask] = await proc.pending_approvals()
        await proc.hil(ask.request_id, "approve")  # the next dispatch meets "boom": the policy raises
        await asyncio.wait_for(proc.wait_idle(), 5)
        msgs = await proc.messages()
        assert_valid(msgs)
        assert isinstance(msgs[-1], SystemMessage) and "internal error" in msgs[-1].text
        assert await k.store.calls(proc.pid) == [] and await k.store.hils(proc.pid) == []
        results = [m for m in msgs if isinstance(m, ToolResultMessage)]
        assert [r.is_error for r in results] == [False, True, True] and ran == ["safe"]


async def test_a_slow_approval_policy_does_not_break_concurrent_input(tmp_path):
    async def thoughtful(process, row) -> Approval:
        await asyncio.sleep(0.1)  # asks a remote policy service, say
        return Approval("auto")

    model = ScriptedModel(echo_then_answer)
    async with kernel(tmp_path, model, approval=thoughtful) as k:
        proc = await k.spawn(owner="a")
        await proc.send("first")
        await asyncio.sleep(0.05)  # the driver is inside its commit, waiting for the policy
        receipt = await proc.send("second", mode="queue")
        assert receipt.queued
        await asyncio.wait_for(proc.wait_idle(), 5)
        assert (await proc.messages())[-1].text == "done: second"


async def test_reset_with_queued_input_leaves_an_idle_empty_process(tmp_path):
    model = ScriptedModel(
        lambda r: Reply(tool_calls=[call("slow", seconds=30)]) if r.messages[-1].text == "long" else "answered"
    )
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        await proc.send("long")
        await proc.send("later", mode="queue")
        await asyncio.sleep(0.1)
        await proc.reset()
        info = await proc.info()
        assert info.current_run is None and info.state == "idle"
        assert await proc.messages() == [] and await k.store.queue(proc.pid) == []
        await asyncio.wait_for(proc.wait_idle(), 5)
        runs = [r for r in model.requests if r.system_prompt != MEMORY_SYSTEM_PROMPT]  # (not the reset's memories)
        assert await proc.messages() == [] and len(runs) == 1


async def test_kill_with_queued_input_starts_no_run(tmp_path):
    model = ScriptedModel(
        lambda r: Reply(tool_calls=[call("slow", seconds=30)]) if r.messages[-1].text == "long" else "answered"
    )
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        await proc.send("long")
        await proc.send("later", mode="queue")
        await asyncio.sleep(0.1)
        got: list[str] = []

        async def watch() -> None:
            async for s in proc.signals(follow=True):
                got.append(s.signal)

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.05)
        await proc.kill()
        await asyncio.wait_for(watcher, 5)
        assert got.count("proc.run.started") == 1 and got[-1] == "proc.run.finished"
        await asyncio.sleep(0.05)
        assert model.calls == 1 and proc.pid not in k.engine._live


async def test_queued_input_left_by_a_crash_between_finish_and_promote_runs_on_restart(tmp_path):
    async with kernel(tmp_path, ScriptedModel(["first answer"])) as k:
        proc = await k.spawn(owner="a")
        await proc.send("first")
        await proc.wait_idle()
        pid = proc.pid
        # the state a crash leaves after a run's last commit and before its queue was promoted
        async with k.store.transaction():
            await k.store.enqueue(pid, "queue", user("waiting"), run_id="queued-run")
    async with kernel(tmp_path, ScriptedModel(["second answer"])) as k2:
        proc = await k2.process(pid)
        await asyncio.wait_for(proc.wait_idle(), 5)
        assert [m.text for m in await proc.messages()] == ["first", "first answer", "waiting", "second answer"]
        assert await k2.store.queue(pid) == []


async def test_an_approval_arriving_during_an_abort_starts_nothing(tmp_path):
    ran.clear()

    @tool
    async def tidy() -> str:
        """Takes a moment to clean up when cancelled."""
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.5)
            raise
        return "tidied"

    async def policy(process, row) -> Approval:
        if row.args.get("text") == "risky":
            return Approval("ask", ("destructive",), "risky", fingerprint="fp")
        return Approval("auto")

    model = ScriptedModel([Reply(tool_calls=[call("tidy"), call("echo", text="risky")]), "unexpected"])
    async with kernel(tmp_path, model, tools=[echo, tidy], approval=policy) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        for _ in range(200):
            if await proc.pending_approvals():
                break
            await asyncio.sleep(0.01)
        [ask] = await proc.pending_approvals()
        aborting = asyncio.create_task(proc.abort())
        await asyncio.sleep(0.05)  # the abort waits for tidy to unwind
        await proc.hil(ask.request_id, "approve")
        assert await aborting
        await asyncio.wait_for(proc.wait_idle(), 5)
        await asyncio.sleep(0.05)
        assert ran == [] and model.calls == 1  # the approved call never ran; no model call after the abort
        msgs = await proc.messages()
        assert_valid(msgs)
        assert [m.text for m in msgs if isinstance(m, ToolResultMessage)] == [
            "Tool call cancelled: the run was aborted.",
            "Tool call cancelled: the run was aborted.",
        ]
        assert not k.engine._live[proc.pid].tools


async def test_two_decisions_on_one_approval_only_the_first_counts(tmp_path):
    ran.clear()

    async def policy(process, row) -> Approval:
        if process.owner == "busy":
            await asyncio.sleep(0.2)  # this process's policy is slow: its commit holds the store meanwhile
            return Approval("auto")
        if row.args.get("text") == "risky":
            return Approval("ask", ("destructive",), "risky", fingerprint="fp")
        return Approval("auto")

    async with kernel(tmp_path, ScriptedModel(echo_then_answer), approval=policy) as k:
        proc = await k.spawn(owner="a")
        busy = await k.spawn(owner="busy")
        await proc.send("risky")
        for _ in range(200):
            if await proc.pending_approvals():
                break
            await asyncio.sleep(0.01)
        [ask] = await proc.pending_approvals()
        await busy.send("hello")
        await asyncio.sleep(0.05)
        approve, deny = await asyncio.gather(
            proc.hil(ask.request_id, "approve"), proc.hil(ask.request_id, "deny"), return_exceptions=True
        )
        assert approve is True and isinstance(deny, KeyError)
        await asyncio.wait_for(proc.wait_idle(), 5)
        await asyncio.wait_for(busy.wait_idle(), 5)
        result = next(m for m in await proc.messages() if isinstance(m, ToolResultMessage))
        assert not result.is_error and "risky" in ran


async def test_a_tool_result_that_cannot_be_stored_becomes_an_error_result(tmp_path):
    class Handle:  # a live object a tool hands to programs in ``details``: not JSON
        pass

    @tool
    async def opener() -> ToolResult:
        """Open something."""
        return ToolResult.text("opened", details={"handle": Handle()})

    model = ScriptedModel([Reply(tool_calls=[call("opener")]), "went on"])
    async with kernel(tmp_path, model, tools=[opener]) as k:
        proc = await k.spawn(owner="a")
        await proc.send("open it")
        await asyncio.wait_for(proc.wait_idle(), 5)
        msgs = await proc.messages()
        assert_valid(msgs)
        result = next(m for m in msgs if isinstance(m, ToolResultMessage))
        assert result.is_error and "could not be recorded" in result.text and msgs[-1].text == "went on"


async def test_a_retried_steer_with_a_run_id_gets_the_same_receipt(tmp_path):
    model = ScriptedModel([Reply(tool_calls=[call("slow", seconds=0.2)]), "done"])
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        first = await proc.send("start")
        await asyncio.sleep(0.05)
        steer = await proc.send("also this", run_id="delivery-7")
        again = await proc.send("also this", run_id="delivery-7")  # the client retries the same delivery
        assert steer == again and steer.run_id == first.run_id and steer.queued
        await asyncio.wait_for(proc.wait_idle(), 5)
        assert [m.text for m in await proc.messages() if isinstance(m, UserMessage)] == ["start", "also this"]


async def test_a_killed_process_refuses_every_call_with_no_such_process(tmp_path):
    async with kernel(tmp_path, ScriptedModel(["hi"])) as k:
        proc = await k.spawn(owner="a")
        await proc.kill()
        for attempt in (
            proc.pending_approvals,
            proc.history,
            proc.info,
            proc.abort,
            proc.wait_idle,
            lambda: proc.hil("x", "approve"),
            proc.reset,
            lambda: drain(proc),
        ):
            with pytest.raises(NoSuchProcess):
                await attempt()


async def drain(proc):
    return [s async for s in proc.signals(follow=False)]


def _slow_archive(monkeypatch: pytest.MonkeyPatch, entered: asyncio.Event, seconds: float = 0.3) -> None:
    """Make a reset's or kill's archive take a while (it runs in a thread), and say when it starts:
    the gap between its abort and its last commit, where input used to start a run."""
    import time

    from agentloop.kernel import kernel as kernel_module

    real = kernel_module.write_archive
    loop = asyncio.get_running_loop()

    def slow(*args: object, **kw: object) -> object:
        loop.call_soon_threadsafe(entered.set)
        time.sleep(seconds)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(kernel_module, "write_archive", slow)


async def test_input_sent_during_a_reset_goes_to_the_fresh_conversation(tmp_path, monkeypatch):
    """A review: a send (or an event) arriving while a reset archived the history started a run
    the reset then cleared from under it; the message was in neither history nor archive."""
    model = ScriptedModel(
        lambda r: Reply(tool_calls=[call("slow", seconds=30)]) if r.messages[-1].text == "long" else "fresh answer"
    )
    entered = asyncio.Event()
    _slow_archive(monkeypatch, entered)
    async with kernel(tmp_path, model, daily_memory=False) as k:
        proc = await k.spawn(owner="a")
        await proc.send("long")
        await asyncio.sleep(0.1)
        reset = asyncio.create_task(proc.reset())
        await asyncio.wait_for(entered.wait(), 5)
        event = asyncio.create_task(k.signal(proc.pid, "the build finished"))  # waits as well
        second = await proc.send("second")  # waits for the reset to finish
        assert reset.done() and not second.queued
        await asyncio.wait_for(event, 5)
        await asyncio.wait_for(proc.wait_idle(), 5)
        texts = [m.text for m in await proc.messages()]
        assert "second" in texts and "the build finished" in texts and "long" not in texts
        runs = [s async for s in proc.signals(follow=False) if s.signal == "proc.run.started"]
        assert [s.payload["runId"] for s in runs][-1] == second.run_id


async def test_input_sent_during_a_kill_finds_no_process_and_waiters_return(tmp_path, monkeypatch):
    """A review: a send during a kill started a run; the kill then left wait_idle() hanging."""
    model = ScriptedModel(lambda r: Reply(tool_calls=[call("slow", seconds=30)]))
    entered = asyncio.Event()
    _slow_archive(monkeypatch, entered)
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        await proc.send("long")
        await asyncio.sleep(0.1)
        waiter = asyncio.create_task(proc.wait_idle())
        kill = asyncio.create_task(proc.kill())
        await asyncio.wait_for(entered.wait(), 5)
        with pytest.raises(NoSuchProcess):
            await proc.send("second")
        await asyncio.wait_for(kill, 5)
        await asyncio.wait_for(asyncio.gather(waiter, return_exceptions=True), 5)  # not left waiting
        assert model.calls == 1


@pytest.mark.parametrize("kill", [False, True])
async def test_a_crash_after_a_reset_or_kills_abort_runs_none_of_the_discarded_input(tmp_path, monkeypatch, kill):
    """A review: the abort committed first, the queue was dropped in a later commit; a crash in
    between left the queued input for the restart to run on the history the user cleared."""
    ran.clear()
    model = ScriptedModel(
        lambda r: (
            Reply(tool_calls=[call("slow", seconds=30)])
            if r.messages[-1].text == "long"
            else Reply(tool_calls=[call("echo", text="queued ran")])
        )
    )

    def crash(*args: object, **kw: object) -> object:
        raise SystemExit("the machine died while the history was archived")

    from agentloop.kernel import kernel as kernel_module

    monkeypatch.setattr(kernel_module, "write_archive", crash)
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        await proc.send("long")
        await proc.send("later", mode="queue")
        await asyncio.sleep(0.1)
        with pytest.raises(SystemExit):
            await (proc.kill() if kill else proc.reset())
        pid = proc.pid
    monkeypatch.undo()
    async with kernel(tmp_path, ScriptedModel(["nothing should ask"])) as k2:
        proc = await k2.process(pid)  # still there: the kill did not get to its commit
        await asyncio.wait_for(proc.wait_idle(), 5)
        assert await k2.store.queue(pid) == [] and ran == []
        assert "later" not in [m.text for m in await proc.messages()]


async def test_an_abort_whose_caller_gives_up_still_ends_the_run(tmp_path):
    """A review: a caller cancelled while the tools unwound (``wait_for(abort(), t)``) left the
    run active with nothing driving it; wait_idle() hung, and a tool deadline later revived it."""
    unwinding = asyncio.Event()

    @tool
    async def cleanup_slowly(n: int) -> str:
        """Works; on cancellation takes a while to clean up."""
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            unwinding.set()
            await asyncio.sleep(0.3)
            raise
        return "done"

    model = ScriptedModel(
        lambda r: (
            "final"
            if isinstance(r.messages[-1], ToolResultMessage)
            else Reply(tool_calls=[call("cleanup_slowly", n=1)])
        )
    )
    async with kernel(tmp_path, model, tools=[cleanup_slowly]) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        await asyncio.sleep(0.1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(proc.abort(), 0.05)
        assert unwinding.is_set()
        await asyncio.wait_for(proc.wait_idle(), 5)
        info = await proc.info()
        assert info.current_run is None
        finished = [s.payload for s in [s async for s in proc.signals(follow=False)] if s.signal == "proc.run.finished"]
        assert [(f["status"], f["reason"]) for f in finished] == [("aborted", "user")]
        assert model.calls == 1


async def test_a_watcher_that_falls_behind_is_bounded_and_misses_no_logged_signal(tmp_path, monkeypatch):
    """A review: a client that read slowly made the server keep every signal for it (73 MB for
    1.6 MB of text). Now a watcher's queue is bounded; past it, it reads the log again."""
    from agentloop.process import signals as sig

    monkeypatch.setattr(sig, "BACKLOG", 3)
    async with kernel(tmp_path, ScriptedModel(echo_then_answer, chunk=1)) as k:
        proc = await k.spawn(owner="a")
        follow = proc.signals(follow=True)
        first = asyncio.create_task(anext(follow))  # the follower is watching, then reads nothing
        await asyncio.sleep(0.05)
        await proc.send("a long enough message to stream many deltas")
        await proc.wait_idle()
        queues = k.engine.hub._watchers[proc.pid]
        assert all(q.qsize() <= 3 for q in queues)
        seen = [await first]
        while seen[-1].signal != sig.RUN_FINISHED:
            seen.append(await asyncio.wait_for(anext(follow), 5))
        await follow.aclose()
        logged = [s.seq for s in seen if s.seq is not None]
        assert logged == [s.seq async for s in proc.signals(follow=False)]  # each once, in order
        assert sig.GAP not in seen


async def test_a_tool_may_interrupt_or_reset_its_own_process(tmp_path):
    """A diff review: once aborts ran in a task of their own, a tool that interrupted or reset its
    own process was cancelled by it: the interrupting message was lost, the reset never done."""
    state: dict[str, object] = {}

    @tool
    async def stop_me(how: str) -> str:
        """Stops its own process."""
        proc = await state["kernel"].process(state["pid"])  # type: ignore[attr-defined]
        if how == "reset":
            await proc.reset()
        else:
            await proc.send("after interrupt", mode="interrupt")
        state["returned"] = how
        return "ok"

    def brain(r: ModelRequest) -> Reply | str:
        last = r.messages[-1]
        if isinstance(last, ToolResultMessage) or last.text == "after interrupt":
            return "final: " + last.text
        return Reply(tool_calls=[call("stop_me", how=last.text)])

    async with kernel(tmp_path, ScriptedModel(brain), tools=[stop_me], daily_memory=False) as k:
        for how in ("interrupt", "reset"):
            proc = await k.spawn(owner="a")
            state.update(kernel=k, pid=proc.pid)
            await proc.send(how)
            for _ in range(50):
                await asyncio.wait_for(proc.wait_idle(), 10)
                if state.get("returned") == how:
                    break
                await asyncio.sleep(0.02)
            await asyncio.wait_for(proc.wait_idle(), 10)
            assert state.get("returned") == how
            texts = [m.text for m in await proc.messages()]
            if how == "interrupt":
                assert texts[-2:] == ["after interrupt", "final: after interrupt"]
            else:
                assert texts == []  # reset: the history is gone (archived)
                assert list(tmp_path.rglob("reset-*"))
