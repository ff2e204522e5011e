"""Delegation to an existing process (kernel/delegate.py, the ``Delegate`` tool): GSV's
``proc.ipc.deliver``. Same owner only; the task reaches the target durably and once, as a run of
its own (queued behind a busy target's run); a waiting caller gets the answer of THAT run or a
timeout that leaves the target working; a caller that does not wait gets the answer as a system
event; a restart delivers once; retirement never kills a process that was delegated to."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, SystemMessage, ToolResultMessage, UserMessage, call
from agentloop.kernel import delegate, tasks
from agentloop.models.base import ModelRequest
from tests.process_support import (
    closed_gates,  # noqa: F401  (the autouse fixture: no gate left closed)
    gate,
    gate_tool,
    kernel,
    last_user,
)


def brain(request: ModelRequest) -> Reply | str:
    """A source on ``delegate <pid> <wait|nowait> <timeout|->: <task>`` calls Delegate; a target
    given a delegated ``gate <name>`` task first waits at that gate, then answers ``did: <task>``;
    ``busy <name>`` waits at a gate and answers ``busy done``; ``task: X`` starts a subagent, which
    answers ``done: X``."""
    last = request.messages[-1]
    asked = last_user(request)
    if asked.startswith("Delegated task from process"):
        task = asked.split("\n\n")[1]
        if isinstance(last, UserMessage) and task.startswith("gate "):
            return Reply(tool_calls=[call("gate", name=task.removeprefix("gate "))])
        return f"did: {task}"
    if asked.startswith("busy "):
        if isinstance(last, UserMessage):
            return Reply(tool_calls=[call("gate", name=asked.removeprefix("busy "))])
        return "busy done"
    if asked.startswith("job "):
        return f"done: {asked.removeprefix('job ')}"
    if isinstance(last, UserMessage) and asked.startswith("delegate "):
        head, _, task = asked.partition(": ")
        _, to, wait, timeout = head.split()
        args: dict[str, Any] = {"to": to, "prompt": task, "wait": wait == "wait"}
        if timeout != "-":
            args["timeout"] = float(timeout)
        return Reply(tool_calls=[call("Delegate", **args)])
    if isinstance(last, UserMessage) and asked.startswith("task: "):
        return Reply(tool_calls=[call("Task", prompt=f"job {asked.removeprefix('task: ')}")])
    if isinstance(last, SystemMessage):
        return f"noted: {last.text}"
    if isinstance(last, ToolResultMessage):
        return f"source got: {last.text}"
    return "?"


def _kernel(tmp_path: Path, **kw: Any) -> Any:
    return kernel(tmp_path, ScriptedModel(brain), subagents=True, tools=[gate_tool], **kw)


async def _until(check: Callable[[], Awaitable[bool]], seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        while not await check():
            await asyncio.sleep(0.02)


async def _results(proc: Any) -> list[str]:
    return [m.text for m in await proc.messages() if isinstance(m, ToolResultMessage)]


async def _told(proc: Any) -> list[str]:
    return [m.text for m in await proc.messages() if isinstance(m, SystemMessage)]


async def _delegated(proc: Any) -> list[str]:
    return [m.text for m in await proc.messages() if m.text.startswith("Delegated task from process")]


async def _at_gate(proc: Any) -> bool:
    history = await proc.history()
    return (await proc.info()).current_run is not None and any(
        getattr(m.message, "tool_calls", None) for m in history[-2:]
    )


async def test_same_owner_delegation_waits_for_the_answer(tmp_path):
    async with _kernel(tmp_path) as k:
        source = await k.spawn(owner="alice")
        target = await k.spawn(owner="alice")
        await source.send(f"delegate {target.pid} wait -: count the files")
        await source.wait_idle()
        await target.wait_idle()
        results = await _results(source)
        answer = (await source.messages())[-1].text
        history = await target.history()
    assert results == ["did: count the files"]
    assert answer == "source got: did: count the files"
    assert [m.message.text for m in history] == [history[0].message.text, "did: count the files"]
    task = history[0].message.text
    assert task.startswith(f"Delegated task from process {source.pid}:\n\ncount the files\n\n")
    assert "before" in task and "returned to the caller automatically" in task
    assert history[0].run_id == history[1].run_id
    assert history[0].run_id is not None and history[0].run_id.startswith(delegate.RUN_PREFIX)


async def test_other_owners_itself_unknown_and_killed_targets_are_refused(tmp_path):
    async with _kernel(tmp_path) as k:
        source = await k.spawn(owner="alice")
        other = await k.spawn(owner="bob")
        gone = await k.spawn(owner="alice")
        await gone.kill(archive=False)
        for to in (other.pid, source.pid, "no-such-pid", gone.pid):
            await source.send(f"delegate {to} wait -: secrets")
            await source.wait_idle()
        results = await _results(source)
        other_history = await other.history()
    assert len(results) == 4
    assert all("cannot delegate" in r and "nothing was delivered" in r for r in results), results
    assert "yourself" in results[1]
    assert f"no process {other.pid} of yours" in results[0]  # (not told whose it is)
    assert other_history == []


async def test_a_busy_target_queues_the_task_and_the_answer_is_of_the_delegated_run(tmp_path):
    async with _kernel(tmp_path) as k:
        source = await k.spawn(owner="alice")
        target = await k.spawn(owner="alice")
        await target.send("busy b1")
        await _until(lambda: _at_gate(target))
        await source.send(f"delegate {target.pid} wait -: plain")
        await _until(lambda: _queued(target))
        assert (await source.info()).current_run is not None  # waiting for the delegated run
        gate("b1").set()
        await source.wait_idle()
        await target.wait_idle()
        results = await _results(source)
        texts = [m.text for m in await target.messages()]
    assert results == ["did: plain"]  # not "busy done", the answer of the run that was going
    assert texts[0] == "busy b1" and texts[-3] == "busy done"
    assert texts[-2].startswith("Delegated task from process") and texts[-1] == "did: plain"


async def _queued(proc: Any) -> bool:
    return bool(await proc.queued())


async def test_without_waiting_the_answer_arrives_as_a_system_event(tmp_path):
    async with _kernel(tmp_path) as k:
        source = await k.spawn(owner="alice")
        target = await k.spawn(owner="alice")
        await source.send(f"delegate {target.pid} nowait -: gate g1")
        await source.wait_idle()
        assert (await _results(source))[0].startswith(f"Delegated to process {target.pid}")
        assert await _told(source) == []
        gate("g1").set()
        await _until(lambda: _has_told(source))
        await source.wait_idle()
        told = await _told(source)
        last = (await source.messages())[-1].text
        await asyncio.sleep(0.1)
        assert await _told(source) == told  # once
    assert len(told) == 1
    assert told[0].startswith(f"[delegation reply] process {target.pid}") and "status ok" in told[0]
    assert "did: gate g1" in told[0]
    assert last.startswith("noted: [delegation reply]")


async def _has_told(proc: Any) -> bool:
    return bool(await _told(proc))


async def test_a_reply_for_an_aborted_source_run_is_still_delivered_and_the_target_goes_on(tmp_path):
    async with _kernel(tmp_path) as k:
        source = await k.spawn(owner="alice")
        target = await k.spawn(owner="alice")
        await source.send(f"delegate {target.pid} nowait -: gate g5")
        await source.wait_idle()
        await source.send(f"delegate {target.pid} wait -: gate g6")  # queued behind g5's run
        await _until(lambda: _queued(target))
        await source.abort()  # the source's run: not the target's delegated runs
        await source.wait_idle()
        assert (await target.info()).current_run is not None
        gate("g5").set()
        gate("g6").set()
        await _until(lambda: _has_told(source))
        await target.wait_idle()
        await source.wait_idle()
        told = await _told(source)
        target_answers = [m.text for m in await target.messages() if m.text.startswith("did: ")]
    assert target_answers == ["did: gate g5", "did: gate g6"]  # neither was aborted
    assert [("did: gate g5" in t) for t in told] == [True]  # the waited-for one is not announced


async def test_a_timeout_is_an_error_and_leaves_the_target_working(tmp_path):
    async with _kernel(tmp_path) as k:
        source = await k.spawn(owner="alice")
        target = await k.spawn(owner="alice")
        await source.send(f"delegate {target.pid} wait 0.3: gate g2")
        await source.wait_idle()
        results = await _results(source)
        still = (await target.info()).current_run
        gate("g2").set()
        await target.wait_idle()
        await asyncio.sleep(0.1)
        await source.wait_idle()
        told = await _told(source)
        answer = [m.text for m in await target.messages()][-1]
    assert len(results) == 1 and "did not answer within 0.3 s" in results[0] and "goes on" in results[0]
    assert still is not None  # not aborted
    assert answer == "did: gate g2"
    assert told == []  # the answer after a timeout is not sent back


async def test_a_restart_while_the_target_works_delivers_once_and_the_source_gets_its_answer(tmp_path):
    async with _kernel(tmp_path) as k:
        source = await k.spawn(owner="alice")
        target = await k.spawn(owner="alice")
        await source.send(f"delegate {target.pid} wait -: gate g3")
        await _until(lambda: _at_gate(target))
    gate("g3").set()
    async with _kernel(tmp_path) as k:
        source, target = await k.process(source.pid), await k.process(target.pid)
        await _until(lambda: _answered(source))
        await target.wait_idle()
        results = await _results(source)
        delegated = await _delegated(target)
    assert len(delegated) == 1
    assert results == ["did: gate g3"]


async def _answered(proc: Any) -> bool:
    return (await proc.info()).current_run is None and bool(await _results(proc))


async def test_a_reply_owed_when_the_kernel_stopped_is_delivered_at_the_next_start(tmp_path, monkeypatch):
    async with _kernel(tmp_path) as k:
        source = await k.spawn(owner="alice")
        target = await k.spawn(owner="alice")

        async def lost(self: Any, *args: Any) -> None:  # (a crash between the run's end and the reply)
            return None

        monkeypatch.setattr(delegate.Replies, "_deliver_logged", lost)
        await source.send(f"delegate {target.pid} nowait -: ping")
        await source.wait_idle()
        await target.wait_idle()
        assert await _told(source) == []
        owed = await k.store.kv_get(target.pid, delegate.DELEGATIONS_KEY)
    assert owed and len(owed) == 1
    monkeypatch.undo()
    async with _kernel(tmp_path) as k:
        source = await k.process(source.pid)
        await _until(lambda: _has_told(source))
        await source.wait_idle()
        told = await _told(source)
        left = await k.store.kv_get(target.pid, delegate.DELEGATIONS_KEY)
    async with _kernel(tmp_path) as k:
        await asyncio.sleep(0.1)
        again = await _told(await k.process(source.pid))
    assert len(told) == 1 and "did: ping" in told[0]
    assert left is None
    assert again == told  # a third start delivers nothing more


async def test_no_reply_to_a_killed_source(tmp_path):
    async with _kernel(tmp_path) as k:
        source = await k.spawn(owner="alice")
        target = await k.spawn(owner="alice")
        await source.send(f"delegate {target.pid} nowait -: gate g4")
        await source.wait_idle()
        await source.kill(archive=False)
        gate("g4").set()
        await target.wait_idle()
        replies = delegate.replies_of(k)
        assert replies is not None
        await replies.wait()
        owed = await k.store.kv_get(target.pid, delegate.DELEGATIONS_KEY)
        processes = [r.pid for r in await k.processes("alice")]
    assert owed is None  # dropped, not owed for ever
    assert source.pid not in processes  # not recreated


async def test_no_reply_to_a_source_reset_since(tmp_path):
    async with _kernel(tmp_path) as k:
        source = await k.spawn(owner="alice")
        target = await k.spawn(owner="alice")
        await source.send(f"delegate {target.pid} nowait -: gate g7")
        await source.wait_idle()
        await source.reset()
        gate("g7").set()
        await target.wait_idle()
        replies = delegate.replies_of(k)
        assert replies is not None
        await replies.wait()
        await source.wait_idle()
        told = await _told(source)
        owed = await k.store.kv_get(target.pid, delegate.DELEGATIONS_KEY)
    assert told == []  # the reply belonged to the conversation the reset ended
    assert owed is None


@pytest.mark.parametrize("how", ["withdraw", "reset"])
async def test_a_queued_task_dropped_before_its_turn_is_an_error_at_once_for_a_waiting_caller(tmp_path, how):
    """The target was busy, so the task waited in its queue; it was withdrawn (or the target reset)
    before its turn. The waiting caller is told at once that it was not run, not after its timeout."""
    async with _kernel(tmp_path) as k:
        source = await k.spawn(owner="alice")
        target = await k.spawn(owner="alice")
        await target.send("busy b9")
        await _until(lambda: _at_gate(target))
        await source.send(f"delegate {target.pid} wait 60: plain")
        await _until(lambda: _queued(target))
        if how == "withdraw":
            assert len(await target.withdraw()) == 1
        else:
            await target.reset()
        async with asyncio.timeout(5):
            await source.wait_idle()
        [result] = await _results(source)
        gate("b9").set()
        await target.wait_idle()
    assert "did not run the task" in result and target.pid in result
    assert "timeout" not in result and "did not answer" not in result


async def test_a_queued_task_dropped_before_its_turn_is_reported_to_a_caller_that_did_not_wait(tmp_path):
    async with _kernel(tmp_path) as k:
        source = await k.spawn(owner="alice")
        target = await k.spawn(owner="alice")
        await target.send("busy b10")
        await _until(lambda: _at_gate(target))
        await source.send(f"delegate {target.pid} nowait -: plain")
        await source.wait_idle()
        await _until(lambda: _queued(target))
        await target.withdraw()
        await _until(lambda: _has_told(source))
        await source.wait_idle()
        told = await _told(source)
        owed = await k.store.kv_get(target.pid, delegate.DELEGATIONS_KEY)
        gate("b10").set()
        await target.wait_idle()
        await asyncio.sleep(0.1)
        assert await _told(source) == told  # once
    assert len(told) == 1 and told[0].startswith(f"[delegation reply] process {target.pid}")
    assert "did not run the task" in told[0]
    assert owed is None  # nothing left owed on the target


async def test_retirement_never_kills_a_subagent_that_was_delegated_to(tmp_path, monkeypatch):
    async with _kernel(tmp_path) as k:
        parent = await k.spawn(owner="alice")
        other = await k.spawn(owner="alice")
        made: list[str] = []
        for job in ("a", "b"):
            await parent.send(f"task: {job}")
            await parent.wait_idle()
            made += [r.pid for r in await k.processes("alice") if r.parent_pid == parent.pid and r.pid not in made]
        assert len(made) == 2
        kept, plain = made
        await other.send(f"delegate {kept} wait -: hello child")  # a non-interactive subagent may be asked
        await other.wait_idle()
        retirer = tasks.retirer_of(k)
        assert retirer is not None
        await retirer.wait()
        monkeypatch.setattr(tasks, "KEEP_FINISHED", 0)
        retired = await tasks.retire_finished(k, parent.pid)
        alive = [r.pid for r in await k.processes("alice")]
        results = await _results(other)
    assert results == ["did: hello child"]
    assert retired == [plain]  # the other finished child goes: retirement did run
    assert kept in alive


async def test_a_runs_answer_is_read_a_page_at_a_time_from_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run_answer`` (Delegate's replies, the watch router's events) finds a recent run's words in
    the newest page, and an old run's by paging back: a long-lived target is not read whole."""
    from agentloop.kernel import Kernel, watches
    from agentloop.kernel.watches import run_answer

    monkeypatch.setattr(watches, "ANSWER_PAGE", 2)
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(lambda r: f"re: {r.messages[-1].text}"), workspace=tmp_path
    ) as k:
        proc = await k.spawn(owner="alice")
        runs = []
        for text in ("one", "two", "three", "four"):
            runs.append((await proc.send(text)).run_id)
            await proc.wait_idle()
        reads: list[Any] = []
        history = k.store.history

        async def counted(*args: Any, **kw: Any) -> Any:
            reads.append(kw.get("before"))
            return await history(*args, **kw)

        monkeypatch.setattr(k.store, "history", counted)
        assert await run_answer(k.store, proc.pid, runs[-1]) == "re: four" and len(reads) == 1
        reads.clear()
        assert await run_answer(k.store, proc.pid, runs[0]) == "re: one" and len(reads) == 4
        assert await run_answer(k.store, proc.pid, "no-such-run") == ""
        assert await run_answer(k.store, proc.pid, runs[0], limit=2) == ""  # (not among the newest two)
