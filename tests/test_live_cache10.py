"""The engine's cache of processes is bounded (``ProcessEngine.cache_limit``): past it, the least
recently used processes at rest are dropped (``ProcessEngine.evict``) and loaded again from the
store when next used, transparently: history, signal numbers, open followers' streams, resets and
kills carry on. A process with work under way or waiting for it (a run waiting for a person's
answer, a background job), or one a task holds in the middle of an operation, is never dropped."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, call, tool
from agentloop.kernel import Kernel, Process
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.store import NoSuchProcess
from agentloop.tools.base import ToolContext
from tests.process_support import gated


def _seen(request: ModelRequest) -> str:
    return "seen: " + ", ".join(m.text for m in request.messages if isinstance(m, UserMessage))


def _open(tmp_path: Path, brain: Any = _seen, **kw: Any) -> Kernel:
    kw.setdefault("tools", [])
    return Kernel.open(f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(brain), workspace=tmp_path, **kw)


async def _spawned(k: Kernel, n: int, text: str = "hello") -> list[Process]:
    procs = []
    for i in range(n):
        proc = await k.spawn(owner="alice", text=f"{text} {i}")
        await proc.wait_idle()
        procs.append(proc)
        # (a caught exception's frames in a reference cycle, not yet collected, still refer to the
        # cache of the run that raised it: such a process is passed over until the collector runs)
        gc.collect()
    return procs


def _cached(k: Kernel) -> set[str]:
    return set(k.engine._live)


async def test_the_cache_keeps_its_bound_and_an_evicted_process_reloads_transparently(tmp_path: Path) -> None:
    async with _open(tmp_path) as k:
        k.engine.cache_limit = 3
        first, *rest = await _spawned(k, 8)
        assert len(_cached(k)) == 3 and _cached(k) == {p.pid for p in rest[-3:]}
        assert k.engine.cached(first.pid) is None
        seq = await k.store.last_event_seq(first.pid)
        await first.send("again")
        await first.wait_idle()
        assert [m.text for m in await first.messages()] == ["hello 0", "seen: hello 0", "again", "seen: hello 0, again"]
        logged = [s async for s in first.signals(seq, follow=False)]
        assert logged and logged[0].seq == seq + 1  # the numbers go on where they were
        assert [s.seq for s in logged] == list(range(seq + 1, seq + 1 + len(logged)))
        assert first.pid in _cached(k) and len(_cached(k)) == 3


async def test_a_dropped_cache_is_freed(tmp_path: Path) -> None:
    """Nothing else keeps the evicted ``_Live`` (its history) alive."""
    async with _open(tmp_path) as k:
        k.engine.cache_limit = 2
        [first] = await _spawned(k, 1)
        ref = weakref.ref(k.engine._live[first.pid])
        await _spawned(k, 3, "more")
        gc.collect()
        assert ref() is None


async def test_the_least_recently_used_goes_first(tmp_path: Path) -> None:
    async with _open(tmp_path) as k:
        k.engine.cache_limit = 3
        a, b, c = await _spawned(k, 3)
        await a.send("still here")  # used again: b is now the least recently used
        await a.wait_idle()
        [d] = await _spawned(k, 1, "new")
        assert _cached(k) == {a.pid, c.pid, d.pid} and k.engine.cached(b.pid) is None


async def test_an_open_followers_stream_goes_on_after_the_reload(tmp_path: Path) -> None:
    """Eviction drops the cache only: the hub (and so each follower's stream) is the process's own."""
    async with _open(tmp_path) as k:
        k.engine.cache_limit = 2
        [first] = await _spawned(k, 1)
        seq = await k.store.last_event_seq(first.pid)
        got: list[Any] = []
        finished = asyncio.Event()

        async def follow() -> None:
            async for s in first.signals(seq):
                got.append(s)
                if s.signal == sig.RUN_FINISHED:
                    finished.set()

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.05)
        await _spawned(k, 3, "more")
        assert k.engine.cached(first.pid) is None and not follower.done()
        await first.send("again")
        await asyncio.wait_for(finished.wait(), 5)
        logged = [s.seq for s in got if s.seq is not None]
        assert logged == list(range(seq + 1, seq + 1 + len(logged)))
        assert sig.RUN_STARTED in [s.signal for s in got]
        await _spawned(k, 2, "later")
        assert k.engine.cached(first.pid) is None and not follower.done()
    await asyncio.wait_for(follower, 5)  # the runtime closed: the stream ends, evicted or not


async def test_a_run_waiting_for_an_approval_is_never_evicted(tmp_path: Path) -> None:
    wait_gate, rm, brain, policy = gated(asyncio.Event())
    async with _open(tmp_path, brain, tools=[wait_gate, rm], approval=policy) as k:
        k.engine.cache_limit = 2
        asking = await k.spawn(owner="alice", text="delete")
        for _ in range(100):
            if await asking.pending_approvals():
                break
            await asyncio.sleep(0.01)
        [ask] = await asking.pending_approvals()
        await _spawned(k, 4)
        assert k.engine.cached(asking.pid) is not None and len(_cached(k)) == 2
        await asking.hil(ask.request_id, "approve")
        await asking.wait_idle()
        assert "removed x" in [m.text for m in await asking.messages()]
        await _spawned(k, 2, "more")
        assert k.engine.cached(asking.pid) is None and len(_cached(k)) == 2  # at rest now


async def test_a_process_with_background_work_is_never_evicted(tmp_path: Path) -> None:
    go = asyncio.Event()

    async def job() -> str:
        await go.wait()
        return "the job is done"

    @tool
    def start(ctx: ToolContext) -> str:
        """Start a background job."""
        assert ctx.background is not None
        ctx.background(job(), "a job")
        return "started"

    def brain(r: ModelRequest) -> object:
        last = r.messages[-1]
        if isinstance(last, UserMessage) and last.text == "start":
            return Reply(tool_calls=[call("start")])
        return _seen(r)

    async with _open(tmp_path, brain, tools=[start]) as k:
        k.engine.cache_limit = 2
        owner = await k.spawn(owner="alice", text="start")
        await owner.wait_idle()
        await _spawned(k, 4)
        assert k.engine.cached(owner.pid) is not None  # its job may report at any time
        go.set()
        for _ in range(200):
            if any("the job is done" in m.text for m in await owner.messages()):
                break
            await asyncio.sleep(0.01)
        await owner.wait_idle()
        assert sum("the job is done" in m.text for m in await owner.messages()) == 1
        await _spawned(k, 2, "more")
        assert k.engine.cached(owner.pid) is None


async def test_a_process_held_by_a_task_is_not_evicted(tmp_path: Path) -> None:
    """A task that looked the process up and waits (here: for the store) still has the one cache."""
    async with _open(tmp_path) as k:
        k.engine.cache_limit = 1
        a, b = await _spawned(k, 2)
        assert _cached(k) == {b.pid}
        held = await k.engine.live(a.pid)  # loaded again (b went), by a caller in the middle of an operation
        assert _cached(k) == {a.pid}
        k.engine.cache_limit = 0
        assert k.engine.evict() == 0 and k.engine.cached(a.pid) is held
        del held
        assert k.engine.evict() == 1 and not _cached(k)


async def test_sends_racing_eviction_are_delivered_exactly_once(tmp_path: Path) -> None:
    async with _open(tmp_path) as k:
        k.engine.cache_limit = 0  # evict whatever can be evicted, at every chance
        procs = await _spawned(k, 4)
        k.engine.evict()  # (the last one's run ended after the last eviction)
        assert not _cached(k)
        stop = asyncio.Event()

        async def evicting() -> None:
            while not stop.is_set():
                k.engine.evict()
                await asyncio.sleep(0)

        evictor = asyncio.create_task(evicting())
        try:
            sends = [p.send(f"m{i}-{j}", mode="queue") for j in range(3) for i, p in enumerate(procs)]
            await asyncio.gather(*sends, *(k.spawn(owner="alice", text=f"new {n}") for n in range(4)))
            for p in procs:
                await p.wait_idle()
        finally:
            stop.set()
            await evictor
        for i, p in enumerate(procs):
            texts = [m.text for m in await p.messages() if isinstance(m, UserMessage)]
            assert sorted(texts) == sorted([f"hello {i}", *(f"m{i}-{j}" for j in range(3))]), texts
        k.engine.evict()
        assert not _cached(k)


async def test_reset_and_kill_of_an_evicted_process(tmp_path: Path) -> None:
    async with _open(tmp_path) as k:
        k.engine.cache_limit = 1
        a, b = await _spawned(k, 2)
        assert k.engine.cached(a.pid) is None
        await a.reset()
        assert await a.messages() == []
        await a.send("fresh")
        await a.wait_idle()
        assert [m.text for m in await a.messages()] == ["fresh", "seen: fresh"]
        await _spawned(k, 1, "new")
        assert k.engine.cached(a.pid) is None and k.engine.cached(b.pid) is None
        await a.kill()
        with pytest.raises(NoSuchProcess):
            await a.send("anyone?")
        assert k.engine.cached(a.pid) is None
