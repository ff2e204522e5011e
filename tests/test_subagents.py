"""Subagents (kernel/tasks.py): the ``Task`` tool hands work to a child process, waits for its
answer or has it delivered later as a system event, survives a restart without starting a second
child, and cannot nest without end."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, SystemMessage, ToolCall, ToolResultMessage, UserMessage, call
from agentloop.kernel.tasks import MAX_DEPTH, child_pid
from agentloop.models.base import ModelRequest
from tests.process_support import kernel, slow


def _first_user(request: ModelRequest) -> str:
    return next(m.text for m in request.messages if isinstance(m, UserMessage))


def brain(request: ModelRequest) -> Reply | str:
    """The parent delegates ('delegate: X' or 'background: X'); a child answers 'done: X'."""
    task = _first_user(request)
    last = request.messages[-1]
    if isinstance(last, UserMessage) and task.startswith(("delegate: ", "background: ")):
        kind, _, job = task.partition(": ")
        return Reply(tool_calls=[call("Task", prompt=f"job {job}", wait=kind == "delegate")])
    if task.startswith("job "):
        return f"done: {task.removeprefix('job ')}"
    if isinstance(last, SystemMessage):
        return f"noted: {last.text}"
    if isinstance(last, ToolResultMessage):
        return f"parent got: {last.text}"
    return "?"


def _results(messages: list[Any]) -> list[ToolResultMessage]:
    return [m for m in messages if isinstance(m, ToolResultMessage)]


async def test_task_waits_for_a_child_process_and_returns_its_answer(tmp_path):
    async with kernel(tmp_path, ScriptedModel(brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("delegate: count the files")
        await parent.wait_idle()
        messages = await parent.messages()
        children = [r for r in await k.processes("alice") if r.parent_pid == parent.pid]
        parent_cwd = (await parent.info()).cwd
    assert _results(messages)[0].text == "done: count the files"
    assert messages[-1].text == "parent got: done: count the files"
    assert len(children) == 1 and children[0].interactive  # as its parent: its requests are put to the parent's person
    assert children[0].cwd == parent_cwd and children[0].owner == "alice"


async def test_a_background_task_reports_back_as_a_system_event(tmp_path):
    async with kernel(tmp_path, ScriptedModel(brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("background: index the repo")
        async with asyncio.timeout(5):
            while not any(isinstance(m, SystemMessage) for m in await parent.messages()):
                await asyncio.sleep(0.02)
        await parent.wait_idle()
        messages = await parent.messages()
    assert "Started subagent" in _results(messages)[0].text
    event = next(m for m in messages if isinstance(m, SystemMessage))
    assert "done: index the repo" in event.text
    assert messages[-1].text.startswith("noted: ")


async def test_a_rerun_after_a_restart_finds_the_child_instead_of_starting_another(tmp_path):
    """The tool is idempotent: the child's pid comes from the parent, the run and the call's
    durable key, which a re-run of the call after a restart has again."""
    from agentloop.tools.base import ToolContext

    async with kernel(tmp_path, ScriptedModel(brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        tool = (await k.engine._run_config(await k.engine.live(parent.pid), "run-1")).tools["Task"]
        ctx = ToolContext("call_0", "Task", run_id="run-1", call_key="d-1")
        first = await tool.run({"prompt": "job once", "wait": True}, ctx)
        again = await tool.run({"prompt": "job once", "wait": True}, ctx)
        children = [r for r in await k.processes("alice") if r.parent_pid == parent.pid]
    assert [c.pid for c in children] == [child_pid(parent.pid, "run-1", "d-1")]
    assert first.content[0].text == again.content[0].text == "done: once"  # one child, one run


async def test_two_task_calls_of_a_run_with_the_same_call_id_get_two_children(tmp_path):
    """Some providers number calls per reply (call_0 in each): the second Task of the run was
    given the first one's child, and so its answer."""

    def numbered(request: ModelRequest) -> Reply | str:
        first = _first_user(request)
        if first.startswith("job "):
            return f"answer to {first}"
        done = [m for m in request.messages if isinstance(m, ToolResultMessage)]
        if len(done) < 2:
            job = "job A" if not done else "job B"
            return Reply(tool_calls=[ToolCall(id="call_0", name="Task", arguments={"prompt": job})])
        return "finished"

    async with kernel(tmp_path, ScriptedModel(numbered), subagents=True) as k:
        parent = await k.spawn(owner="alice", run_as="reviewer")
        await parent.send("go")
        await parent.wait_idle()
        answers = [m.text for m in _results(await parent.messages())]
        children = [r for r in await k.processes("alice") if r.parent_pid == parent.pid]
    assert answers == ["answer to job A", "answer to job B"] and len(children) == 2
    assert {c.run_as for c in children} == {"reviewer"}  # a child works as the identity its parent does


@pytest.mark.parametrize("wait", [True, False])
async def test_a_rerun_after_a_crash_between_creating_the_child_and_prompting_it_delivers_the_prompt(tmp_path, wait):
    """The child was stored, then the kernel died before its prompt (and, in the background, its
    watch) were: the re-run of the call finishes the delivery instead of waiting on an empty child."""
    from agentloop.tools.base import ToolContext

    async with kernel(tmp_path, ScriptedModel(brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        tool = (await k.engine._run_config(await k.engine.live(parent.pid), "run-1")).tools["Task"]
        pid = child_pid(parent.pid, "run-1", "call-1")
        await k.spawn(owner="alice", pid=pid, parent_pid=parent.pid, interactive=False)  # what the crash left
        result = await tool.run({"prompt": "job late", "wait": wait}, ToolContext("call-1", "Task", run_id="run-1"))
        child = await k.process(pid)
        await child.wait_idle()
        assert [m.text for m in await child.messages()] == ["job late", "done: late"]
        if wait:
            assert result.content[0].text == "done: late"
        else:
            assert [w.source_pid for w in await k.watches(parent.pid)] in ([pid], [])  # (delivered: used up)
            async with asyncio.timeout(5):
                while not any(isinstance(m, SystemMessage) for m in await parent.messages()):
                    await asyncio.sleep(0.02)
        # and a second re-run delivers nothing more, nor tells the parent again
        await tool.run({"prompt": "job late", "wait": wait}, ToolContext("call-1", "Task", run_id="run-1"))
        await child.wait_idle()
        await parent.wait_idle()
        await asyncio.sleep(0.1)
        assert [m.text for m in await child.messages()] == ["job late", "done: late"]
        told = [m for m in await parent.messages() if isinstance(m, SystemMessage) and "[signal watch" in m.text]
        assert len(told) == (0 if wait else 1) and await k.watches(parent.pid) == []


async def test_a_later_run_reusing_a_call_id_gets_a_child_of_its_own(tmp_path):
    """Some providers number tool calls per reply (``call_0`` every time): a Task call of a later
    run must not find the earlier run's child (kept, idle, with its old answer)."""

    def numbering(request: ModelRequest) -> Reply | str:
        last = request.messages[-1]
        if isinstance(last, UserMessage) and last.text.startswith("delegate: "):
            job = last.text.removeprefix("delegate: ")
            return Reply(tool_calls=[ToolCall(id="call_0", name="Task", arguments={"prompt": f"job {job}"})])
        return brain(request)

    async with kernel(tmp_path, ScriptedModel(numbering), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("delegate: first")
        await parent.wait_idle()
        await parent.send("delegate: second")
        await parent.wait_idle()
        answers = [r.text for r in _results(await parent.messages())]
        children = [r for r in await k.processes("alice") if r.parent_pid == parent.pid]
    assert answers == ["done: first", "done: second"]
    assert len(children) == 2


async def test_subagents_cannot_nest_without_end(tmp_path):
    def forking(request: ModelRequest) -> Reply | str:
        last = request.messages[-1]
        if isinstance(last, ToolResultMessage):
            return f"result: {last.text}"
        return Reply(tool_calls=[call("Task", prompt="go deeper")])

    async with kernel(tmp_path, ScriptedModel(forking), subagents=True) as k:
        top = await k.spawn(owner="alice")
        await top.send("go deeper")
        async with asyncio.timeout(20):
            await top.wait_idle()
        everyone = await k.processes("alice")
        deepest = [r for r in everyone if not any(o.parent_pid == r.pid for o in everyone)]
        refused = _results(await (await k.process(deepest[0].pid)).messages())
    assert len(everyone) == MAX_DEPTH + 1  # top, then MAX_DEPTH generations of children
    assert len(deepest) == 1
    assert refused[0].is_error and f"nest {MAX_DEPTH} deep at most" in refused[0].text


async def test_without_subagents_there_is_no_task_tool(tmp_path):
    seen: list[list[str]] = []

    def look(request: ModelRequest) -> str:
        seen.append([t.name for t in request.tools])
        return "ok"

    async with kernel(tmp_path, ScriptedModel(look)) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("hi")
        await proc.wait_idle()
    assert "Task" not in seen[0]


def test_subagents_true_in_the_config_file_gives_chat_the_task_tool(tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from agentloop.cli.main import app

    (tmp_path / "config.toml").write_text("subagents = true\n")
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "config.toml"))
    ws = tmp_path / "ws"
    ws.mkdir()
    script = tmp_path / "s.json"
    script.write_text(
        json.dumps(
            {
                "replies": [
                    {"tool_calls": [{"name": "Task", "arguments": {"prompt": "say hi"}}]},
                    "hi from the child",
                    "the child said hi",
                ]
            }
        )
    )
    args = ["chat", "-m", f"scripted:{script}", "-w", str(ws), "--data", str(tmp_path / "data")]
    result = CliRunner().invoke(app, args, input="delegate it\n")
    assert result.exit_code == 0, result.stderr
    assert "✓ Task" in result.stderr and "the child said hi" in result.stdout

    (tmp_path / "config.toml").write_text("subagents = 1\n")
    bad = CliRunner().invoke(app, args, input="x\n")
    assert bad.exit_code == 2 and "subagents must be true or false" in bad.stderr


async def test_aborting_the_parent_aborts_the_child_it_waits_for(tmp_path):
    def slow_child(request: ModelRequest) -> Reply | str:
        task, last = _first_user(request), request.messages[-1]
        if task == "parent" and isinstance(last, UserMessage):
            return Reply(tool_calls=[call("Task", prompt="child")])
        if task == "child" and isinstance(last, UserMessage):
            return Reply(tool_calls=[call("slow", seconds=30)])
        return "over"

    async with kernel(tmp_path, ScriptedModel(slow_child), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("parent")
        async with asyncio.timeout(5):
            while not [r for r in await k.processes("alice") if r.parent_pid == parent.pid and r.current_run]:
                await asyncio.sleep(0.02)
        [child] = [r for r in await k.processes("alice") if r.parent_pid == parent.pid]
        assert await parent.abort()
        async with asyncio.timeout(5):
            await (await k.process(child.pid)).wait_idle()  # not the 30 s its tool would take
        finished = [s.payload async for s in (await k.process(child.pid)).signals(follow=False)]
    assert any(p.get("status") == "aborted" for p in finished)


# -- the process tree: kill, reset and abort reach the children ---------------------------------


def tree_brain(request: ModelRequest) -> Reply | str:
    """Commands in the last user message: ``spawn X`` starts a background child on X, ``spawn+stay X``
    does that and sleeps in the same batch (the run stays active), ``wait-for X`` waits for a child
    on X, ``stay`` sleeps, ``gate`` waits for the test. A sleep cut by a restart is started again."""
    last = request.messages[-1]
    if isinstance(last, UserMessage):
        command, _, arg = last.text.partition(" ")
        sleep = call("slow", seconds=30)
        calls = {
            "spawn": [call("Task", prompt=arg, wait=False)],
            "spawn+stay": [call("Task", prompt=arg, wait=False), sleep],
            "wait-for": [call("Task", prompt=arg, wait=True)],
            "stay": [sleep],
            "gate": [call("gate")],
        }.get(command)
        return Reply(tool_calls=calls) if calls else "ok"
    if isinstance(last, ToolResultMessage):
        return Reply(tool_calls=[call("slow", seconds=30)]) if "restart" in last.text else f"over: {last.text}"
    return f"noted: {last.text}" if isinstance(last, SystemMessage) else "?"


async def _children(k: Any, pid: str) -> list[Any]:
    return [r for r in await k.processes("alice") if r.parent_pid == pid]


async def _running_child(k: Any, pid: str) -> str:
    """The pid of ``pid``'s child once its run has started."""
    async with asyncio.timeout(5):
        while not [r for r in await _children(k, pid) if r.current_run]:
            await asyncio.sleep(0.02)
    [child] = await _children(k, pid)
    return str(child.pid)


async def _finished(k: Any, pid: str) -> list[dict[str, Any]]:
    return [s.payload async for s in (await k.process(pid)).signals(follow=False) if s.signal == "proc.run.finished"]


async def test_killing_a_parent_kills_its_children_and_grandchildren(tmp_path, caplog):
    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("spawn wait-for stay")  # a background child that waits for a grandchild
        child = await _running_child(k, parent.pid)
        grandchild = await _running_child(k, child)
        await parent.wait_idle()
        await parent.kill()
        left = [r.pid for r in await k.processes("alice")]
        await asyncio.sleep(0.1)  # a stray delivery to the dead parent would be logged by now
    assert left == []
    for pid in (parent.pid, child, grandchild):  # each archived, as kill does
        assert list((tmp_path / "var" / "sessions" / "alice" / pid).glob("kill-*.jsonl.gz")), pid
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


async def test_killing_a_parent_does_not_fail_when_a_child_is_killed_meanwhile(tmp_path):
    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("spawn wait-for stay")
        grandchild = await k.process(await _running_child(k, await _running_child(k, parent.pid)))
        outcome = await asyncio.gather(parent.kill(), grandchild.kill(), return_exceptions=True)
        left = await k.processes("alice")
    assert not isinstance(outcome[0], BaseException), outcome[0]
    assert left == []


async def test_resetting_a_parent_aborts_its_running_children_but_keeps_them(tmp_path):
    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("spawn wait-for stay")
        child = await _running_child(k, parent.pid)
        grandchild = await _running_child(k, child)
        await parent.wait_idle()  # its run is over; the child works on
        await parent.reset()
        async with asyncio.timeout(5):  # not the 30 s of the grandchild's sleep
            await (await k.process(child)).wait_idle()
            await (await k.process(grandchild)).wait_idle()
        await asyncio.sleep(0.1)  # an event about the aborted child would have reached the parent
        child_ended = await _finished(k, child)
        grandchild_ended = await _finished(k, grandchild)
        kept = await (await k.process(child)).messages()
        parent_after = await parent.messages()
        parent_running = (await parent.info()).current_run
    assert child_ended[-1]["status"] == "aborted" and grandchild_ended[-1]["status"] == "aborted"
    assert kept  # the child is not killed: what it did can still be read
    assert parent_after == [] and parent_running is None  # nothing woke the reset parent


async def test_aborting_the_parent_aborts_the_background_children_its_run_started(tmp_path):
    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("spawn+stay stay")  # a background child, and the parent's run goes on
        child = await _running_child(k, parent.pid)
        assert await parent.abort()
        async with asyncio.timeout(5):
            await (await k.process(child)).wait_idle()
        await asyncio.sleep(0.1)
        ended = await _finished(k, child)
        parent_messages = await parent.messages()
        parent_running = (await parent.info()).current_run
        watches = await k.watches(parent.pid)
    assert ended[-1]["status"] == "aborted"
    assert watches == [] and parent_running is None  # the aborted child's news does not restart the parent
    assert not any(isinstance(m, SystemMessage) for m in parent_messages)


async def test_an_interrupt_aborts_the_background_children_of_the_interrupted_run(tmp_path):
    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("spawn+stay stay")
        child = await _running_child(k, parent.pid)
        await parent.send("never mind", mode="interrupt")
        async with asyncio.timeout(5):
            await (await k.process(child)).wait_idle()
            await parent.wait_idle()
        ended = await _finished(k, child)
        last = (await parent.messages())[-1]
    assert ended[-1]["status"] == "aborted"
    assert last.text == "ok"  # the interrupting message was answered


async def test_a_child_of_an_earlier_finished_run_keeps_running_when_a_later_run_is_aborted(tmp_path):
    from agentloop import tool

    gate = asyncio.Event()

    @tool(name="gate")
    async def gate_tool() -> str:
        """Wait for the test."""
        await gate.wait()
        return "opened"

    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True, tools=[gate_tool, slow]) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("spawn gate")
        child = await _running_child(k, parent.pid)
        await parent.wait_idle()  # the first run is over; its child waits at the gate
        await parent.send("stay")
        async with asyncio.timeout(5):
            while not (await parent.info()).current_run:
                await asyncio.sleep(0.02)
        assert await parent.abort()
        still_running = (await k.store.get_process(child)).current_run
        gate.set()
        async with asyncio.timeout(5):
            while not any(isinstance(m, SystemMessage) for m in await parent.messages()):
                await asyncio.sleep(0.02)
        ended = await _finished(k, child)
    assert still_running is not None
    assert ended[-1]["status"] == "ok"  # its answer was still expected, and it came


async def test_which_run_started_a_child_survives_a_restart(tmp_path):
    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("spawn+stay stay")
        child = await _running_child(k, parent.pid)
    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True) as k:
        proc = await k.process(parent.pid)
        async with asyncio.timeout(5):  # both resumed: their sleeps, cut by the restart, start again
            while not ((await proc.info()).current_run and (await k.store.get_process(child)).current_run):
                await asyncio.sleep(0.02)
        assert await proc.abort()
        async with asyncio.timeout(5):
            await (await k.process(child)).wait_idle()
        ended = await _finished(k, child)
    assert ended[-1]["status"] == "aborted"


async def _dead_hook(pid: str, run_id: str, reason: str) -> None:
    """The ``aborted`` hook of a runtime that crashes right after the abort committed."""


async def test_children_an_abort_could_not_stop_before_a_crash_are_stopped_when_they_resume(tmp_path):
    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("spawn+stay stay")
        child = await _running_child(k, parent.pid)
        k.engine.aborted = _dead_hook
        assert await parent.abort()
        still_running = (await k.store.get_process(child)).current_run
    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True) as k:
        async with asyncio.timeout(5):  # not the 30 s of the resumed sleep
            await (await k.process(child)).wait_idle()
        ended = await _finished(k, child)
        parent_running = (await k.store.get_process(parent.pid)).current_run
    assert still_running is not None  # the crash left it running
    assert ended[-1]["status"] == "aborted" and ended[-1]["reason"] == "parent.abort"
    assert parent_running is None  # and its news did not start the parent again


async def test_a_child_talked_to_after_its_parent_aborted_keeps_its_new_run_over_a_restart(tmp_path):
    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("spawn+stay stay")
        child = await k.process(await _running_child(k, parent.pid))
        k.engine.aborted = _dead_hook
        assert await parent.abort()
        await child.abort()  # the user stops the child, and gives it work of their own
        await child.send("stay")
        async with asyncio.timeout(5):
            while not (await child.info()).current_run:
                await asyncio.sleep(0.02)
    async with kernel(tmp_path, ScriptedModel(tree_brain), subagents=True) as k:
        resumed = await k.process(child.pid)
        await asyncio.sleep(0.3)
        running = (await resumed.info()).current_run
        ended = await _finished(k, child.pid)
    assert running is not None  # the user's run goes on
    assert [e["reason"] for e in ended if e["status"] == "aborted"] == ["user"]


async def test_parallel_task_calls_of_one_turn_respect_the_running_cap(tmp_path):
    """A review: 30 Task calls in one turn each counted the running children before any had
    started, and 18 ran against a cap of 8 (at every nesting level)."""
    from agentloop.kernel.tasks import MAX_RUNNING

    def brain(request: ModelRequest) -> Reply | str:
        first = next(m.text for m in request.messages if isinstance(m, UserMessage))
        last = request.messages[-1]
        if first == "fan out" and isinstance(last, UserMessage):
            return Reply(tool_calls=[call("Task", prompt=f"job {i}", wait=False) for i in range(20)])
        if first.startswith("job ") and isinstance(last, UserMessage):
            return Reply(tool_calls=[call("slow", seconds=30)])  # the children keep running
        return "ok"

    async with kernel(tmp_path, ScriptedModel(brain), tools=[slow], subagents=True) as k:
        top = await k.spawn(owner="alice")
        await top.send("fan out")
        for _ in range(100):
            results = [m for m in await top.messages() if isinstance(m, ToolResultMessage)]
            if len(results) == 20:
                break
            await asyncio.sleep(0.05)
        children = [r for r in await k.processes("alice") if r.parent_pid == top.pid]
        assert len(children) == MAX_RUNNING
        assert sum(r.is_error for r in results) == 20 - MAX_RUNNING
        await top.kill()


async def test_a_subagent_stopped_with_its_parent_does_not_start_over_after_a_restart(tmp_path):
    """Its grandchild's report was queued for it when the parent's run was aborted: the report is
    dropped with the stop, instead of starting a run nobody reads at the next start."""

    def tree(request: ModelRequest) -> Reply | str:
        last = request.messages[-1]
        if isinstance(last, UserMessage):
            command, _, rest = last.text.partition(" ")
            if command == "spawn+stay":
                return Reply(tool_calls=[call("Task", prompt=rest, wait=False), call("slow", seconds=30)])
            return "ok"
        return Reply(tool_calls=[call("slow", seconds=30)]) if isinstance(last, SystemMessage) else "over"

    async def kids(k: Any, pid: str) -> list[Any]:
        return [r for r in await k.processes("alice") if r.parent_pid == pid]

    async with kernel(tmp_path, ScriptedModel(tree), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("spawn+stay spawn+stay quick")  # parent: child C + sleep; C: grandchild G + sleep
        async with asyncio.timeout(10):
            while not (c := await kids(k, parent.pid)) or not (g := await kids(k, c[0].pid)):
                await asyncio.sleep(0.02)
            child = c[0].pid
            await (await k.process(g[0].pid)).wait_idle()
            while not await k.store.queue(child):  # G's report waits in C's queue (C is busy)
                await asyncio.sleep(0.02)
        assert await parent.abort()
        assert (await k.store.get_process(child)).current_run is None and await k.store.queue(child) == []
    async with kernel(tmp_path, ScriptedModel(tree), subagents=True) as k:
        await asyncio.sleep(0.3)
        assert (await k.store.get_process(child)).current_run is None


async def test_a_child_started_before_calls_had_keys_is_found_after_an_upgrade(tmp_path):
    """A child named by the provider's call id (as before durable call keys) is found by the call
    re-run after an upgrade, by that id and its prompt, instead of being started a second time."""
    from agentloop.tools.base import ToolContext

    async with kernel(tmp_path, ScriptedModel(brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        old = child_pid(parent.pid, "run-1", "call_0")
        child = await k.spawn(owner="alice", pid=old, parent_pid=parent.pid, interactive=False)
        await child.send("job once")
        await child.wait_idle()
        tool = (await k.engine._run_config(await k.engine.live(parent.pid), "run-1")).tools["Task"]
        ctx = ToolContext("call_0", "Task", run_id="run-1", call_key="d-9")
        again = await tool.run({"prompt": "job once", "wait": True}, ctx)
        other = await tool.run(
            {"prompt": "job twice", "wait": True}, ToolContext("call_0", "Task", run_id="run-1", call_key="d-10")
        )
        children = sorted(r.pid for r in await k.processes("alice") if r.parent_pid == parent.pid)
    assert again.content[0].text == "done: once" and other.content[0].text == "done: twice"
    assert len(children) == 2 and old in children  # the reused call id with another prompt: a child of its own
