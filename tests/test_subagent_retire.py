"""Finished subagents are retired (kernel/tasks.py, ``Retirer``): once a child's answer has
reached its parent durably, only the newest ``KEEP_FINISHED`` finished children of a parent stay
readable; older ones are killed with an archive, so the store does not grow with every ``Task``
call. A child still working (or with input waiting) is never retired, nor one whose answer a
restart would still have to read. And children are not conversations: the account's process
quota (the server's 409) does not count them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, SystemMessage, ToolResultMessage, UserMessage, call, tool
from agentloop.kernel import Kernel, tasks
from agentloop.messages import user
from agentloop.models.base import ModelRequest
from tests.process_support import echo, kernel, slow


def _first_user(request: ModelRequest) -> str:
    return next(m.text for m in request.messages if isinstance(m, UserMessage))


def brain(request: ModelRequest) -> Reply | str:
    """A parent delegates what its user asks (``delegate: X`` waits, ``background: X`` does not,
    ``pair: X Y`` makes two waiting calls in one reply); a child on ``job X`` answers ``done: X``,
    one on ``job gate`` first waits at the gate."""
    task = _first_user(request)
    last = request.messages[-1]
    if task.startswith("job "):  # a child
        if task == "job gate" and isinstance(last, UserMessage):
            return Reply(tool_calls=[call("gate")])
        return f"done: {task.removeprefix('job ')}"
    if isinstance(last, UserMessage) and last.text.startswith(("delegate: ", "background: ")):
        kind, _, job = last.text.partition(": ")
        return Reply(tool_calls=[call("Task", prompt=f"job {job}", wait=kind == "delegate")])
    if isinstance(last, UserMessage) and last.text.startswith("pair: "):
        jobs = last.text.removeprefix("pair: ").split()
        return Reply(tool_calls=[call("Task", prompt=f"job {job}") for job in jobs])
    if isinstance(last, SystemMessage):
        return f"noted: {last.text}"
    if isinstance(last, ToolResultMessage):
        return f"parent got: {last.text}"
    return "?"


gate_open = asyncio.Event()


@tool(name="gate")
async def gate_tool() -> str:
    """Wait for the test."""
    await gate_open.wait()
    return "opened"


@pytest.fixture(autouse=True)
def _closed_gate() -> Iterator[None]:
    global gate_open
    gate_open = asyncio.Event()
    yield
    gate_open.set()


def _kernel(tmp_path: Path, **kw: Any) -> Any:
    return kernel(tmp_path, ScriptedModel(brain), subagents=True, tools=[echo, slow, gate_tool], **kw)


async def _children(k: Kernel, pid: str) -> list[str]:
    return [r.pid for r in await k.processes("alice") if r.parent_pid == pid]


async def _until(check: Callable[[], Awaitable[bool]], seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        while not await check():
            await asyncio.sleep(0.02)


async def _told(proc: Any) -> list[str]:
    return [m.text for m in await proc.messages() if isinstance(m, SystemMessage)]


def _archived(tmp_path: Path, pid: str) -> bool:
    return bool(list((tmp_path / "var" / "sessions" / "alice" / pid).glob("kill-*.jsonl.gz")))


async def _delegate(k: Kernel, parent: Any, text: str, made: list[str]) -> None:
    """Send ``text`` to the parent, wait until its answer (and a background child's report) is
    in, and note the child it made."""
    before = len(await _told(parent)) if text.startswith("background: ") else None
    await parent.send(text)
    await parent.wait_idle()
    new = [pid for pid in await _children(k, parent.pid) if pid not in made]
    assert len(new) == 1, new
    made.append(new[0])
    if before is not None:
        await _until(lambda: _has_more_told(parent, before))
        await parent.wait_idle()


async def _has_more_told(parent: Any, before: int) -> bool:
    return len(await _told(parent)) > before and (await parent.info()).current_run is None


async def test_only_the_newest_finished_children_stay_and_the_older_are_archived(tmp_path, monkeypatch):
    monkeypatch.setattr(tasks, "KEEP_FINISHED", 2)
    async with _kernel(tmp_path) as k:
        parent = await k.spawn(owner="alice")
        made: list[str] = []
        for i in range(6):
            await _delegate(k, parent, f"{'delegate' if i % 2 == 0 else 'background'}: j{i}", made)
        await _until(lambda: _are(k, parent.pid, made[-2:]))
        results = [m.text for m in await parent.messages() if isinstance(m, ToolResultMessage)]
        told = await _told(parent)
        gone = made[:-2]
        killed = [await k.store.was_killed(pid) for pid in gone]
        kept = [[m.text for m in await (await k.process(pid)).messages()] for pid in made[-2:]]
    assert all(killed)
    assert all(_archived(tmp_path, pid) for pid in gone)  # their history went to the archive, as kill does
    assert kept == [["job j4", "done: j4"], ["job j5", "done: j5"]]  # the newest stay readable
    # every answer reached the parent: the waiting calls' results, the background children's reports
    assert [r for r in results if not r.startswith("Started subagent")] == ["done: j0", "done: j2", "done: j4"]
    assert sum(r.startswith("Started subagent") for r in results) == 3
    assert [any(f"done: j{i}" in t for t in told) for i in (1, 3, 5)] == [True, True, True]


async def _are(k: Kernel, pid: str, expected: list[str]) -> bool:
    return sorted(await _children(k, pid)) == sorted(expected)


async def test_a_working_child_is_never_retired(tmp_path, monkeypatch):
    monkeypatch.setattr(tasks, "KEEP_FINISHED", 0)
    async with _kernel(tmp_path) as k:
        parent = await k.spawn(owner="alice")
        made: list[str] = []
        await parent.send("background: gate")  # a child that waits at the gate
        await parent.wait_idle()
        made += await _children(k, parent.pid)
        working = made[0]
        for i in range(3):
            await _delegate(k, parent, f"delegate: j{i}", made)
        await _until(lambda: _are(k, parent.pid, [working]))  # the finished ones went, with nothing kept
        still = await k.store.get_process(working)
        assert still is not None and still.current_run is not None
        gate_open.set()  # it finishes, reports, and then it may go too
        await _until(lambda: _are(k, parent.pid, []))
        assert _archived(tmp_path, working)
        assert any("done: gate" in t for t in await _told(parent))


async def test_a_finished_child_with_input_waiting_is_not_retired(tmp_path, monkeypatch):
    async with _kernel(tmp_path) as k:
        parent = await k.spawn(owner="alice")
        made: list[str] = []
        for i in range(3):
            await _delegate(k, parent, f"delegate: j{i}", made)
        async with k.store.transaction():  # input for the oldest, not taken yet (nobody woke it)
            await k.store.enqueue(made[0], "queue", user("one more thing"))
        retirer = tasks.retirer_of(k)
        assert retirer is not None
        await retirer.wait()  # (what the parent's last run end set off is over)
        monkeypatch.setattr(tasks, "KEEP_FINISHED", 1)
        retired = await tasks.retire_finished(k, parent.pid)
        left = await _children(k, parent.pid)
    assert retired == [made[1]]  # the newest stays, the one with input waiting stays
    assert sorted(left) == sorted([made[0], made[2]])


async def test_children_outlive_a_reset_of_their_parent_until_retired(tmp_path, monkeypatch):
    monkeypatch.setattr(tasks, "KEEP_FINISHED", 2)
    async with _kernel(tmp_path) as k:
        parent = await k.spawn(owner="alice")
        made: list[str] = []
        for i in range(3):
            await _delegate(k, parent, f"delegate: j{i}", made)
        await _until(lambda: _are(k, parent.pid, made[1:]))
        await parent.reset()
        assert sorted(await _children(k, parent.pid)) == sorted(made[1:])  # a reset keeps them, readable
        assert [m.text for m in await (await k.process(made[1])).messages()] == ["job j1", "done: j1"]
        for i in range(3, 5):
            await _delegate(k, parent, f"background: j{i}", made)
        await _until(lambda: _are(k, parent.pid, made[3:]))
        results = [m.text for m in await parent.messages() if isinstance(m, ToolResultMessage)]
    assert all(_archived(tmp_path, pid) for pid in made[:3])
    assert len(results) == 2 and all(r.startswith("Started subagent") for r in results)


async def test_a_child_whose_result_is_stored_but_not_yet_in_the_history_survives_a_restart_of_its_parent(
    tmp_path, monkeypatch
):
    """One call at a time (``max_concurrency=1``): the first Task's result is stored with its call
    while the second call runs. The first child may be retired then (its answer is durable in
    the call's row); a restart resumes the parent's run, which reads that answer instead of
    calling Task again, and so never finds its child gone."""
    monkeypatch.setattr(tasks, "KEEP_FINISHED", 0)
    async with _kernel(tmp_path, max_concurrency=1) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("pair: first gate")
        gate = await _until_running(k, parent.pid)
        await _until(lambda: _are(k, parent.pid, [gate]))  # the first child is retired while the run goes on
        sessions = tmp_path / "var" / "sessions" / "alice"
        assert len([d for d in sessions.iterdir() if _archived(tmp_path, d.name)]) == 1
        rows = sorted(r.status for r in await k.store.calls(parent.pid))
        assert rows == ["completed", "dispatched"]  # its answer is stored with its call, not yet in the history
    gate_open.set()
    async with _kernel(tmp_path, max_concurrency=1) as k:
        proc = await k.process(parent.pid)
        await _until(lambda: _answered(proc))
        results = [m.text for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert results == ["done: first", "done: gate"]


async def test_a_child_is_not_retired_before_its_answer_is_stored_with_the_parent(tmp_path, monkeypatch):
    """Between the child's last answer and the parent's Task call storing it, the child is idle
    with nothing waiting, yet a restart would call Task again and look for it."""
    monkeypatch.setattr(tasks, "KEEP_FINISHED", 0)
    reading, hold = asyncio.Event(), asyncio.Event()
    real = tasks._answer

    async def held_answer(kernel: Kernel, pid: str, *run: Any) -> Any:
        reading.set()
        await hold.wait()
        return await real(kernel, pid, *run)

    monkeypatch.setattr(tasks, "_answer", held_answer)
    async with _kernel(tmp_path) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("delegate: j0")
        async with asyncio.timeout(5):
            await reading.wait()
        [child] = await _children(k, parent.pid)
        record = await k.store.get_process(child)
        assert record is not None and record.current_run is None  # its work is done...
        assert await tasks.retire_finished(k, parent.pid) == []  # ...its answer is not the parent's yet
        hold.set()
        await parent.wait_idle()
        await _until(lambda: _are(k, parent.pid, []))  # and once it is, the child goes
        results = [m.text for m in await parent.messages() if isinstance(m, ToolResultMessage)]
    assert results == ["done: j0"]
    assert _archived(tmp_path, child)


async def _until_running(k: Kernel, parent_pid: str) -> str:
    """The child of ``parent_pid`` working on ``job gate``, once there is one."""
    async with asyncio.timeout(10):
        while True:
            for pid in await _children(k, parent_pid):
                record = await k.store.get_process(pid)
                history = await k.store.history(pid)
                if record and record.current_run and history and history[0].message.text == "job gate":
                    return pid
            await asyncio.sleep(0.02)


async def _answered(proc: Any) -> bool:
    return (await proc.info()).current_run is None and bool(await proc.messages())


async def test_a_failing_retirement_leaves_the_child_for_the_next_occasion(tmp_path, monkeypatch):
    monkeypatch.setattr(tasks, "KEEP_FINISHED", 1)
    real = Kernel._clear_held
    failed: list[str] = []

    async def crash_once(self: Kernel, pid: str, **kw: Any) -> Any:
        if not failed:
            failed.append(pid)
            raise RuntimeError("the machine went down half-way")
        return await real(self, pid, **kw)

    monkeypatch.setattr(Kernel, "_clear_held", crash_once)
    async with _kernel(tmp_path) as k:
        parent = await k.spawn(owner="alice")
        made: list[str] = []
        for i in range(2):
            await _delegate(k, parent, f"delegate: j{i}", made)
        await _until(lambda: _truthy(failed))
        assert made[0] in await _children(k, parent.pid)  # the failed retirement left it
        await _delegate(k, parent, "delegate: j2", made)
        await _until(lambda: _are(k, parent.pid, [made[2]]))
        results = [m.text for m in await parent.messages() if isinstance(m, ToolResultMessage)]
    assert failed == [made[0]]
    assert results == ["done: j0", "done: j1", "done: j2"]


async def _truthy(value: list[str]) -> bool:
    return bool(value)


async def test_killing_a_parent_still_kills_its_kept_children(tmp_path):
    async with _kernel(tmp_path) as k:
        parent = await k.spawn(owner="alice")
        made: list[str] = []
        for i in range(2):
            await _delegate(k, parent, f"delegate: j{i}", made)
        await parent.kill()
        left = await k.processes("alice")
    assert left == []
    assert all(_archived(tmp_path, pid) for pid in made)


# -- the account's quota counts conversations ------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")
        return str(request.getfixturevalue("pg_url"))
    return f"sqlite:///{tmp_path}/agentloop.db"


async def test_subagents_do_not_count_against_the_account_quota(store_url, tmp_path):
    pytest.importorskip("starlette")
    from agentloop.server.auth import Principal
    from agentloop.server.errors import ApiError
    from agentloop.server.service import ProcessService

    alice = Principal("alice", admin=False, token_id="t")
    model = ScriptedModel(brain)
    async with Kernel.open(store_url, model=model, workspace=tmp_path, data_dir=tmp_path, subagents=True) as k:
        service = ProcessService(k, max_processes=2)
        first = await service.spawn(alice)
        parent = await k.process(first["pid"])
        made: list[str] = []
        for i in range(3):
            await _delegate(k, parent, f"delegate: j{i}", made)
        assert await k.store.count_processes("alice") == 4
        assert await k.store.count_processes("alice", top_level_only=True) == 1
        await service.spawn(alice)  # a second conversation: there is room for it
        with pytest.raises(ApiError) as refused:
            await service.spawn(alice)
        assert refused.value.status == 409 and "as many as this server allows" in str(refused.value)
        assert len(await _children(k, parent.pid)) == 3  # (nothing was retired to make room)
