"""Retention (kernel/retention.py): archives older than a rule are removed with their segment
rows, processes idle for longer than a rule are killed with an archive, nothing happens unless a
rule is set, the kernel sweeps by itself (a duty), and ``agentloop prune`` does it by hand or, with
``--dry-run``, lists what it would do. Time is moved with the sweep's ``now``, never waited for."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from agentloop import Reply, ScriptedModel, call
from agentloop.cli import admin
from agentloop.cli.config import read_config_file
from agentloop.cli.main import app
from agentloop.kernel import Kernel, NoSuchProcess, retention
from agentloop.kernel.retention import Retention, plan, sweep
from agentloop.kernel.segments import NoSuchSegment
from agentloop.kernel.tasks import DELEGATED_KEY
from agentloop.process import background
from agentloop.process.archive import all_archives, read_header
from agentloop.process.store import open_store
from agentloop.tools.builtin import builtin_tools
from tests.process_support import kernel

DAY = 86400.0
RULES = Retention(archives=timedelta(days=30), idle_processes=timedelta(days=90))
runner = CliRunner()


def chatty() -> ScriptedModel:
    return ScriptedModel(lambda request: "ok")


async def talked(k: Kernel, owner: str = "alice", text: str = "hello", **kw: Any) -> str:
    """A process that had one exchange and is idle again; its pid."""
    proc = await k.spawn(owner, cwd=k.data_dir, **kw)
    await proc.send(text)
    await proc.wait_idle()
    return proc.pid


async def test_old_archives_go_with_their_segments_and_young_ones_stay(tmp_path: Path, caplog: Any) -> None:
    async with kernel(tmp_path, chatty()) as k:
        pid = await talked(k, text="a secret the log must not show")
        proc = await k.process(pid)
        await proc.reset()
        await proc.send("second conversation")
        await proc.wait_idle()
        await proc.reset()
        old_segment, young_segment = await proc.segments()
        old, young = sorted(all_archives(tmp_path), key=lambda a: a.created)
        assert (old.name, young.name) == (old_segment.archive, young_segment.archive)
        now = (old.created + young.created) / 2 + 30 * DAY  # the cut-off falls between the two

        with caplog.at_level(logging.INFO, logger="agentloop.kernel.retention"):
            swept = await sweep(k, Retention(archives=timedelta(days=30)), now=now)

        assert (swept.archives, swept.processes, swept.failed) == (1, 0, 0)
        assert not old.path.exists() and young.path.exists()
        assert [s.id for s in await proc.segments()] == [young_segment.id]
        with pytest.raises(NoSuchSegment, match="no segment"):
            await proc.fork(segment=old_segment.id)
        fork = await proc.fork(segment=young_segment.id)  # the young one still forks
        assert (await fork.messages())[0].text == "second conversation"
        assert f"removed archive {old.name} of process {pid} of alice" in caplog.text
        assert "secret" not in caplog.text


async def test_a_removed_archive_takes_its_empty_folders_and_nothing_else(tmp_path: Path) -> None:
    async with kernel(tmp_path, chatty()) as k:
        gone = await talked(k, owner="bob")
        await (await k.process(gone)).kill()
        kept = await talked(k)
        await (await k.process(kept)).kill()
        stray = tmp_path / "var" / "sessions" / "alice" / "notes.txt"  # not an archive: never retention's
        stray.write_text("mine")
        hidden = tmp_path / "var" / "sessions" / "alice" / kept / ".half-written.tmp"
        hidden.write_text("")

        swept = await sweep(k, RULES, now=time.time() + 31 * DAY)

        assert swept.archives == 2
        assert not (tmp_path / "var" / "sessions" / "bob").exists()  # its pid's folder, then its own
        assert stray.read_text() == "mine" and hidden.exists()  # (so alice's folders stay)
        assert all_archives(tmp_path) == []


async def test_idle_processes_are_killed_with_an_archive_and_busy_ones_kept(tmp_path: Path, caplog: Any) -> None:
    (tmp_path / "build").mkdir()

    def script(request: Any) -> Reply | str:
        if request.messages[-1].text == "clean up":
            return Reply(tool_calls=[call("Shell", command="rm -rf build")])
        return "ok"

    async with kernel(tmp_path, ScriptedModel(script), tools=builtin_tools(tmp_path)) as k:
        idle = await talked(k)
        parent = await talked(k)
        child = await talked(k, parent_pid=parent)
        busy_parent = await talked(k)
        busy_child = await talked(k, parent_pid=busy_parent)
        asking = (await k.spawn("alice", cwd=tmp_path)).pid
        await (await k.process(asking)).send("clean up")
        for _ in range(500):  # (the ask comes within a few steps)
            if await (await k.process(asking)).pending_approvals():
                break
            await asyncio.sleep(0.01)
        assert await (await k.process(asking)).pending_approvals()
        scheduled = await talked(k)
        await k.schedule(scheduled, "wake up", at=time.time() + 365 * DAY)
        jobbing = await talked(k)
        async with k.store.transaction():  # a background job under way (process/background.py)
            await k.store.kv_set(jobbing, background.JOBS_KEY, {"j1": {"label": "make", "generation": 1}})
            await k.store.enqueue(busy_child, "queue", (await k.store.history(idle))[0].message)
        later = time.time() + 91 * DAY

        todo = await plan(k.store, tmp_path, RULES, now=later)
        assert sorted(r.pid for r in todo.processes) == sorted([idle, parent])  # roots; the child goes with its parent
        with caplog.at_level(logging.INFO, logger="agentloop.kernel.retention"):
            swept = await sweep(k, RULES, now=later)

        assert (swept.processes, swept.failed) == (2, 0)
        for pid in (idle, parent, child):
            with pytest.raises(NoSuchProcess):
                await k.process(pid)
        for pid in (busy_parent, busy_child, asking, scheduled, jobbing):
            await k.process(pid)  # kept
        archives = {a.pid: a for a in all_archives(tmp_path)}
        assert {idle, parent, child} <= set(archives)
        assert read_header(archives[idle].path)["meta"]["reason"] == "kill"
        assert (tmp_path / "build").exists()  # the asking process's command never ran
        assert f"killed process {idle} of alice, idle for 91.0 days" in caplog.text
        await (await k.process(asking)).kill()


def gated() -> tuple[ScriptedModel, asyncio.Event]:
    """A model whose answer to "are you there?" waits for the event: that run is under way meanwhile."""
    gate = asyncio.Event()

    async def script(request: Any) -> str:
        if request.messages[-1].text == "are you there?":
            await gate.wait()
        return "ok"

    return ScriptedModel(script), gate


async def alive(k: Kernel, pid: str) -> bool:
    try:
        await k.process(pid)
    except NoSuchProcess:
        return False
    return True


async def test_a_child_that_got_input_during_the_sweep_keeps_its_whole_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    model, gate = gated()
    async with kernel(tmp_path, model) as k:
        parent = await talked(k)
        child = await talked(k, parent_pid=parent)
        planned = retention.plan

        async def plan_then_the_user_writes(*args: Any, **kw: Any) -> retention.Plan:
            todo = await planned(*args, **kw)
            assert [r.pid for r in todo.processes] == [parent]  # (the child goes with its parent)
            receipt = await (await k.process(child)).send("are you there?")  # the user talks to the child meanwhile
            assert receipt.run_id
            return todo

        monkeypatch.setattr(retention, "plan", plan_then_the_user_writes)
        with caplog.at_level(logging.INFO, logger="agentloop.kernel.retention"):
            swept = await sweep(k, RULES, now=time.time() + 91 * DAY)
        gate.set()
        assert (swept.processes, swept.failed) == (0, 0)
        assert await alive(k, parent) and await alive(k, child)
        await (await k.process(child)).wait_idle()
        assert [m.text for m in await (await k.process(child)).messages()][-2:] == ["are you there?", "ok"]
        assert f"kept process {parent} of alice" in caplog.text and f"process {child} below it" in caplog.text


async def test_the_root_that_got_input_just_after_the_look_is_not_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, gate = gated()
    async with kernel(tmp_path, model) as k:
        pid = await talked(k)
        looked = retention._still_idle

        async def looked_then_the_user_writes(store: Any, record: Any) -> bool:
            idle = await looked(store, record)
            await (await k.process(pid)).send("are you there?")  # between the sweep's look and the kill
            return idle

        monkeypatch.setattr(retention, "_still_idle", looked_then_the_user_writes)
        swept = await sweep(k, RULES, now=time.time() + 91 * DAY)
        gate.set()
        assert (swept.processes, swept.failed) == (0, 0)
        await (await k.process(pid)).wait_idle()  # its run went on, and answered
        assert [m.text for m in await (await k.process(pid)).messages()][-1] == "ok"


async def test_a_kill_if_idle_decides_for_the_whole_tree_and_input_after_it_finds_no_process(tmp_path: Path) -> None:
    async with kernel(tmp_path, chatty()) as k:
        parent = await talked(k)
        await asyncio.sleep(0.02)  # (clocks are coarse on some systems)
        cut = time.time()
        await asyncio.sleep(0.02)
        child = await talked(k, parent_pid=parent)
        proc = await k.process(parent)
        with pytest.raises(retention.StillActive, match=f"process {child} below it has been active"):
            await proc.kill(if_idle_since=cut)  # (the child talked since)
        assert await alive(k, parent) and await alive(k, child)
        late = await k.process(child)
        killing = asyncio.create_task(proc.kill(if_idle_since=time.time() + 1))
        while child not in k.engine.clearing and not killing.done():
            await asyncio.sleep(0)
        with pytest.raises(NoSuchProcess):  # (waited for the kill, and found no process: no receipt)
            await late.send("late")
        path = await killing
        assert path is not None and read_header(path)["meta"]["reason"] == "kill"
        assert not await alive(k, parent) and not await alive(k, child)
        assert {a.pid for a in all_archives(tmp_path)} == {parent, child}


async def test_a_process_delegated_to_is_never_killed_nor_the_tree_above_it(tmp_path: Path) -> None:
    async with kernel(tmp_path, chatty()) as k:
        helper = await talked(k)  # others delegate to it by its pid
        parent = await talked(k)
        child = await talked(k, parent_pid=parent)  # (delegated to as well: its parent stays with it)
        idle = await talked(k)
        async with k.store.transaction():
            await k.store.kv_set(helper, DELEGATED_KEY, True)
            await k.store.kv_set(child, DELEGATED_KEY, True)
        swept = await sweep(k, RULES, now=time.time() + 91 * DAY)
        assert (swept.processes, swept.failed) == (1, 0)
        assert not await alive(k, idle)
        for pid in (helper, parent, child):
            assert await alive(k, pid)


async def test_on_postgres_input_from_another_worker_during_the_sweep_keeps_the_process(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def worker(name: str) -> Any:
        return Kernel.open(pg_url, model=chatty(), workspace=tmp_path, data_dir=tmp_path, worker=name)

    async with worker("w1") as first, worker("w2") as second:
        pid = await talked(first)
        planned = retention.plan

        async def plan_then_another_worker_queues(*args: Any, **kw: Any) -> retention.Plan:
            todo = await planned(*args, **kw)
            async with second.store.transaction():  # (as a send through w2 queues it for w1's run)
                await second.store.enqueue(pid, "queue", (await second.store.history(pid))[0].message)
            return todo

        monkeypatch.setattr(retention, "plan", plan_then_another_worker_queues)
        monkeypatch.setattr(retention, "_still_idle", lambda store, record: asyncio.sleep(0, True))
        swept = await sweep(first, RULES, now=time.time() + 91 * DAY)
        assert (swept.processes, swept.failed) == (0, 0)
        assert await alive(first, pid)


async def test_off_by_default_nothing_is_removed(tmp_path: Path) -> None:
    async with kernel(tmp_path, chatty()) as k:
        assert k.retention is None
        pid = await talked(k)
        await (await k.process(pid)).reset()
        kept = await talked(k)
        swept = await sweep(k, Retention(), now=time.time() + 10_000 * DAY)
        assert (swept.archives, swept.processes) == (0, 0)
        assert len(all_archives(tmp_path)) == 1
        await k.process(kept)
        todo = await plan(k.store, tmp_path, Retention(), now=time.time() + 10_000 * DAY)
        assert (todo.archives, todo.processes) == ([], [])


async def test_the_kernel_sweeps_by_itself_as_a_duty(tmp_path: Path) -> None:
    quick = Retention(
        archives=timedelta(microseconds=1), every=timedelta(milliseconds=50), first_after=timedelta(milliseconds=10)
    )
    async with kernel(tmp_path, chatty()) as k:  # (the archive made first: with a rule of 1 µs a sweep
        pid = await talked(k)  # racing the reset could remove its file before its segment row is in)
        await (await k.process(pid)).reset()
    async with kernel(tmp_path, chatty(), retention=quick) as k:
        assert k.retention is not None and k.retention.name == "retention"
        for _ in range(200):
            if not all_archives(tmp_path):
                break
            await asyncio.sleep(0.01)
        assert all_archives(tmp_path) == []
        assert await (await k.process(pid)).segments() == []
        await k.process(pid)  # (no idle rule: the process stays)


async def test_on_postgres_one_worker_at_a_time_holds_the_retention_duty(pg_url: str, tmp_path: Path) -> None:
    quick = Retention(archives=timedelta(days=1), first_after=timedelta(milliseconds=10))

    def worker(name: str) -> Any:
        return Kernel.open(pg_url, model=chatty(), workspace=tmp_path, data_dir=tmp_path, worker=name, retention=quick)

    async with worker("w1"), worker("w2") as second:
        for _ in range(300):
            duty = await second.store.duty("retention")
            if duty is not None and duty.owner is not None:
                break
            await asyncio.sleep(0.01)
        assert duty is not None and duty.owner in {"w1", "w2"}
        await asyncio.sleep(0.1)  # (several passes of both timers: the other keeps trying, and failing)
        again = await second.store.duty("retention")
        assert again is not None and (again.owner, again.epoch) == (duty.owner, duty.epoch)


async def test_bad_rules_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="archives must be positive"):
        Retention(archives=timedelta(0))
    with pytest.raises(TypeError, match="idle_processes must be a timedelta"):
        Retention(idle_processes=90)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="archives_days must be a number of days"):
        Retention.from_days(archives_days=-1)
    with pytest.raises(TypeError, match="retention must be a Retention"):
        async with kernel(tmp_path, chatty(), retention={"archives_days": 30}):
            pass
    cases = {
        "retention = 30": "must be a table",
        "[retention]\narchive_days = 30": "unknown keys: archive_days",
        '[retention]\narchives_days = "30"': "archives_days must be a number of days",
        "[retention]\nidle_process_days = 0": "idle_process_days must be a number of days",
        "[retention]\nidle_process_days = true": "idle_process_days must be a number of days",
    }
    for text, problem in cases.items():
        path = tmp_path / "config.toml"
        path.write_text(text)
        file, _ = read_config_file(path)
        assert file.retention is None
        assert problem in file.errors["retention"], (text, file.errors)
    path.write_text("[retention]\narchives_days = 30\nidle_process_days = 90.5")
    file, _ = read_config_file(path)
    assert file.retention == Retention(archives=timedelta(days=30), idle_processes=timedelta(days=90.5))
    assert not file.errors


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.delenv("AGENTLOOP_DATA", raising=False)
    monkeypatch.delenv("AGENTLOOP_STORE", raising=False)
    monkeypatch.delenv("AGENTLOOP_DEBUG", raising=False)
    directory = tmp_path / "data"
    directory.mkdir()
    return directory


def prune(data: Path, monkeypatch: pytest.MonkeyPatch, *args: str, days_later: float = 100) -> tuple[int, str, str]:
    """``agentloop prune`` as if run ``days_later`` days from now."""
    moved = time.time() + days_later * DAY
    monkeypatch.setattr(admin, "time", SimpleNamespace(time=lambda: moved))
    result = runner.invoke(app, ["prune", *args, "--data", str(data)])
    return result.exit_code, result.stdout, result.stderr


async def _seed(data: Path) -> tuple[str, str]:
    """An archived reset of one process (kept, idle), and another idle process; their pids."""
    async with kernel(data, chatty(), data_dir=data) as k:
        reset = await talked(k)
        await (await k.process(reset)).reset()
        return reset, await talked(k, owner="bob")


def test_prune_dry_run_lists_and_removes_nothing_then_prune_removes(
    data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reset, other = asyncio.run(_seed(data))
    [archive] = all_archives(data)
    (data.parent / "config.toml").write_text("[retention]\narchives_days = 30\nidle_process_days = 90\n")

    code, out, err = prune(data, monkeypatch, "--dry-run")
    assert code == 0, err
    assert f"archive\talice/{reset}/{archive.path.name}\t100.0d old" in out
    assert f"process\t{reset}\talice\tidle 100.0d" in out and f"process\t{other}\tbob\tidle 100.0d" in out
    assert "would remove 1 archives and kill 2 idle processes" in err
    assert all_archives(data) == [archive]  # nothing removed

    code, out, err = prune(data, monkeypatch, "--dry-run", "--archives-days", "200")  # flags replace the file's
    assert code == 0 and out == "" and "would remove 0 archives and kill 0" in err

    code, out, err = prune(data, monkeypatch)
    assert code == 0, err
    assert "removed 1 archives, killed 2 idle processes" in err
    assert not archive.path.exists()
    # the kill's own archive, young (the reset one's history was empty: nothing to archive)
    assert {a.pid for a in all_archives(data)} == {other}
    code, out, err = prune(data, monkeypatch, "--dry-run", days_later=0)
    assert code == 0 and out == ""


def test_prune_starts_nothing_a_due_schedule_stays_unfired(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def seed() -> str:
        async with kernel(data, chatty(), data_dir=data) as k:
            await talked(k)  # idle: prune opens the kernel to kill it
            scheduled = await talked(k, owner="bob")
            await k.schedule(scheduled, "wake up and check the build", at=time.time() + 0.05)
            return scheduled

    async def history(pid: str) -> list[str]:
        store = open_store(f"sqlite:///{data}/agentloop.db")  # (the store alone: a kernel would fire it)
        await store.open()
        try:
            return [m.message.text for m in await store.history(pid)]
        finally:
            await store.close()

    scheduled = asyncio.run(seed())
    time.sleep(0.1)  # due now, while no server runs
    code, _, err = prune(data, monkeypatch, "--idle-days", "90")
    assert code == 0, err
    assert "killed 1 idle processes" in err  # (the scheduled one is not idle)
    assert asyncio.run(history(scheduled)) == ["hello", "ok"]  # no run of prune's made


def test_prune_refuses_bad_or_missing_rules(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asyncio.run(_seed(data))
    code, _, err = prune(data, monkeypatch, "--dry-run")
    assert code == 2 and "no retention rules" in err
    code, _, err = prune(data, monkeypatch, "--idle-days", "0")
    assert code == 2 and "--idle-days must be a number of days" in err
    (data.parent / "config.toml").write_text("[retention]\narchives_days = -3\n")
    code, _, err = prune(data, monkeypatch)
    assert code == 2 and "retention archives_days must be a number of days" in err
    assert len(all_archives(data)) == 1  # nothing removed


async def test_a_tree_with_a_member_held_at_work_is_kept_without_holding_the_others(tmp_path: Path) -> None:
    """A member already held (a compaction, another clearing) is at work: the kill gives up at
    once, before it holds the others, so their input does not wait for a kill that cannot be."""
    async with kernel(tmp_path, chatty()) as k:
        parent = await talked(k)
        child = await talked(k, parent_pid=parent)
        proc = await k.process(parent)
        async with k.engine.clearing.hold(child):
            with pytest.raises(retention.StillActive):
                await asyncio.wait_for(proc.kill(if_idle_since=time.time() + 60), 2)
            assert parent not in k.engine.clearing
        assert await alive(k, parent) and await alive(k, child)
