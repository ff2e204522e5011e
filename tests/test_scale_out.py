"""Several workers on one PostgreSQL database (DESIGN §6), as two kernels in one test process:
input sent through either reaches the process whichever worker holds it, exactly one worker
advances a process at a time, a worker whose lease was taken over cannot commit, and many sends
from both workers to many processes each run exactly once."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Kernel, NoSuchProcess, ProcessBusy
from agentloop.messages import ImageContent, UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.archive import read_archive
from agentloop.process.store import HilRow, open_store
from agentloop.server.auth import Principal
from agentloop.server.errors import ApiError
from agentloop.server.service import ProcessService
from tests.process_support import gated

FAST = {"lease_ttl": 2.0, "poll_interval": 0.2}  # short, so a test sees expiry and polling quickly


def worker(url: str, tmp_path: Path, name: str, model: Any, tools: list[Any], **kw: Any) -> Any:
    options = {**FAST, **kw}
    return Kernel.open(url, model=model, tools=tools, workspace=tmp_path, data_dir=tmp_path, worker=name, **options)


@asynccontextmanager
async def two(
    url: str, tmp_path: Path, model: Any, tools: list[Any], **kw: Any
) -> AsyncIterator[tuple[Kernel, Kernel]]:
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(worker(url, tmp_path, "A", model, tools, **kw))
        b = await stack.enter_async_context(worker(url, tmp_path, "B", model, tools, **kw))
        yield a, b


def last_user(req: ModelRequest) -> str:
    return [m.text for m in req.messages if isinstance(m, UserMessage)][-1]


async def kept_by(worker: Kernel, pid: str) -> None:
    """``worker`` claims the process and keeps it while idle (it would let it go), so what the
    other worker is sent for it is forwarded to ``worker``."""
    leases = worker.engine.leases
    assert leases is not None
    leases.idle = lambda pid: None  # type: ignore[method-assign]
    # a release the end of its last run started may still be on its way: let it finish first
    await asyncio.gather(*leases._background, return_exceptions=True)
    assert await leases.hold(pid)


def count_process_reads(worker: Kernel) -> list[str]:
    """The pids ``worker`` reads process records of from its store, from now on."""
    reads: list[str] = []
    real = worker.store.get_process

    async def counting(pid: str) -> Any:
        reads.append(pid)
        return await real(pid)

    worker.store.get_process = counting  # type: ignore[method-assign]
    return reads


async def holder(url: str, pid: str) -> str | None:
    store = open_store(url)
    await store.open()
    try:
        lease = await store.lease(pid)
        return None if lease is None else lease.owner
    finally:
        await store.close()


async def test_a_send_through_either_worker_runs_once(pg_url: str, tmp_path: Path) -> None:
    ran: list[str] = []

    @tool
    def note(text: str) -> str:
        """Record."""
        ran.append(text)
        return text

    def brain(req: ModelRequest) -> Reply | str:
        if isinstance(req.messages[-1], UserMessage):
            return Reply(tool_calls=[call("note", text=last_user(req))])
        return "done: " + last_user(req)

    async with two(pg_url, tmp_path, ScriptedModel(brain), [note]) as (a, b):
        proc_a = await a.spawn(owner="alice")
        proc_b = await b.process(proc_a.pid)
        first = await proc_b.send("one")  # B claims the idle process and runs it
        assert not first.queued
        await proc_a.wait_idle()  # A waits on the store for B's run
        assert ran == ["one"]
        second = await proc_a.send("two")  # idle again (B let go): now A runs it
        await proc_b.wait_idle()
        assert ran == ["one", "two"]
        texts = [m.text for m in await proc_a.messages() if isinstance(m, UserMessage)]
        assert texts == ["one", "two"]
        finished = [
            s.payload["runId"] for s in [s async for s in proc_b.signals(follow=False)] if s.signal == sig.RUN_FINISHED
        ]
        assert finished == [first.run_id, second.run_id]
        assert await holder(pg_url, proc_a.pid) is None  # idle: nobody holds it


async def test_input_sent_through_the_other_worker_starts_its_run_with_its_own_reason(
    pg_url: str, tmp_path: Path
) -> None:
    """A message or a system event for an idle process that another worker holds waits in the
    queue for that worker; the run it starts still says it came from a send or an event."""
    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "ok"), []) as (a, b):
        proc_a = await a.spawn(owner="alice")
        await kept_by(a, proc_a.pid)
        proc_b = await b.process(proc_a.pid)

        async def finished(runs: int) -> None:
            async for s in proc_a.signals(follow=True):
                runs -= s.signal == sig.RUN_FINISHED
                if not runs:
                    return

        sent = await proc_b.send("hello")  # queued for A, which holds the process
        await asyncio.wait_for(finished(1), 10)
        event = await b.signal(proc_a.pid, "build finished")
        await asyncio.wait_for(finished(2), 10)
        started = [s async for s in proc_a.signals(follow=False) if s.signal == sig.RUN_STARTED]
        assert [(s.payload["runId"], s.payload["reason"]) for s in started] == [
            (sent.run_id, "proc.send"),
            (event.run_id, "system.event"),
        ]
        assert await holder(pg_url, proc_a.pid) == "A"


async def test_steer_abort_and_approval_from_the_worker_without_the_lease(pg_url: str, tmp_path: Path) -> None:
    gate = asyncio.Event()
    wait_gate, rm, brain, policy = gated(gate)

    async with two(pg_url, tmp_path, ScriptedModel(brain), [wait_gate, rm], approval=policy) as (a, b):
        pa = await a.spawn(owner="alice")
        pb = await b.process(pa.pid)
        run = await pa.send("gate")
        assert await holder(pg_url, pa.pid) == "A"
        steered = await pb.send("and this too")  # forwarded: joins A's active run
        assert steered.queued and steered.run_id == run.run_id
        gate.set()
        await pb.wait_idle()
        msgs = await pa.messages()
        assert msgs[-1].text == "seen: gate, and this too"
        assert [m.text for m in msgs if isinstance(m, UserMessage)] == ["gate", "and this too"]

        gate.clear()
        stuck = await pa.send("gate")
        assert await pb.abort() is True  # forwarded to A, which stops the run
        events = [s async for s in pa.signals(follow=False)]
        end = [s.payload for s in events if s.signal == sig.RUN_FINISHED][-1]
        assert end["runId"] == stuck.run_id and end["status"] == "aborted"

        asked = await pa.send("delete")
        for _ in range(200):
            pending = await pb.pending_approvals()
            if pending:
                break
            await asyncio.sleep(0.02)
        assert pending and pending[0].tool_name == "rm"
        assert await pb.hil(pending[0].request_id, "approve")  # decided on B, carried out by A
        await pa.wait_idle()
        results = [m for m in await pa.messages() if isinstance(m, ToolResultMessage)]
        assert results[-1].text == "removed x" and not results[-1].is_error
        events = [s async for s in pb.signals(follow=False)]
        assert [s.payload for s in events if s.signal == sig.RUN_FINISHED][-1]["runId"] == asked.run_id


async def test_a_gentle_stop_from_the_worker_without_the_lease(pg_url: str, tmp_path: Path) -> None:
    """Forwarded to the holder: the call under way completes, then one answer without tools."""
    gate = asyncio.Event()
    wait_gate, rm, brain, policy = gated(gate)
    async with two(pg_url, tmp_path, ScriptedModel(brain), [wait_gate, rm], approval=policy) as (a, b):
        pa = await a.spawn(owner="alice")
        pb = await b.process(pa.pid)
        run = await pa.send("gate")
        assert await holder(pg_url, pa.pid) == "A"
        assert not await pb.stop(run_id="another-run")
        assert await pb.stop() is True  # forwarded to A
        for _ in range(200):  # A took the request (the run's record says so) before the gate opens
            record = await b.store.get_process(pa.pid)
            if record is not None and (record.current_run or {}).get("stopping"):
                break
            await asyncio.sleep(0.02)
        gate.set()
        await pb.wait_idle()
        events = [s async for s in pb.signals(follow=False)]
        end = [s.payload for s in events if s.signal == sig.RUN_FINISHED][-1]
        assert (end["runId"], end["status"], end["reason"]) == (run.run_id, "ok", "stopped")
        results = [m for m in await pa.messages() if isinstance(m, ToolResultMessage)]
        assert [r.text for r in results] == ["opened"]  # not cut short


async def test_a_follower_on_the_other_worker_sees_the_run(pg_url: str, tmp_path: Path) -> None:
    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "hi " + last_user(req)), []) as (a, b):
        pa = await a.spawn(owner="alice")
        pb = await b.process(pa.pid)
        seen: list[str] = []

        async def follow() -> None:
            async for s in pb.signals(follow=True):
                seen.append(s.signal)
                if s.signal == sig.RUN_FINISHED:
                    return

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.1)
        await pa.send("there")  # runs on A; B's watcher is fed from the log
        await asyncio.wait_for(follower, 10)
        assert seen[0] == sig.RUN_STARTED and seen[-1] == sig.RUN_FINISHED and sig.RUN_OUTPUT in seen


def spy(store: Any, method: str) -> list[Any]:
    """The calls of ``store.method`` from now on (it still does its work)."""
    calls: list[Any] = []
    real = getattr(store, method)

    async def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return await real(*args, **kwargs)

    setattr(store, method, recording)
    return calls


class SlowText(ScriptedModel):
    """Streams its text a chunk every 30 ms, and notes when it made the last one."""

    last_chunk: float | None = None

    async def _stream(self, request: ModelRequest, out: Any) -> Any:
        async for event in super()._stream(request, out):
            if event.type == "text_delta":
                await asyncio.sleep(0.03)
                self.last_chunk = time.monotonic()
            yield event


async def test_a_follower_on_the_other_worker_sees_the_answer_as_it_streams(pg_url: str, tmp_path: Path) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    model = SlowText(lambda req: text, chunk=4)
    async with two(pg_url, tmp_path, model, []) as (a, b):
        pa = await a.spawn(owner="alice")
        pb = await b.process(pa.pid)
        seen: list[sig.Signal] = []
        first_delta: list[float] = []

        async def follow() -> None:
            async for s in pb.signals(after_seq=await b.store.last_event_seq(pb.pid), follow=True):
                seen.append(s)
                if s.signal == sig.RUN_STREAM and not first_delta:
                    first_delta.append(time.monotonic())
                if s.signal == sig.RUN_FINISHED:
                    return

        relayed = spy(a.store, "relay")
        await pa.send("alone")  # nobody follows it on B: nothing relayed
        await pa.wait_idle()
        assert relayed == []
        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.1)
        await pa.send("go")  # runs on A, which relays its deltas to B
        await asyncio.wait_for(follower, 10)
        assert relayed
        names = [s.signal for s in seen]
        streamed = [s for s in seen if s.signal == sig.RUN_STREAM]
        # the whole answer, live, in its place: after the run started, before its logged output
        assert "".join(s.payload["delta"] for s in streamed if s.payload["event"] == "text_delta") == text
        assert names.index(sig.RUN_STARTED) < names.index(sig.RUN_STREAM)
        assert len(names) - names[::-1].index(sig.RUN_STREAM) - 1 < names.index(sig.RUN_OUTPUT)
        assert all(s.seq is None and s.payload["runId"] == streamed[0].payload["runId"] for s in streamed)
        assert model.last_chunk is not None and first_delta[0] < model.last_chunk  # while A's model streamed


async def test_a_watcher_keeps_the_live_text_when_its_worker_lets_the_process_go(pg_url: str, tmp_path: Path) -> None:
    model = SlowText(lambda req: f"about {last_user(req)}", chunk=2)
    # polls far apart: A's watcher is announced when A lets go, not at a poll that happens to come
    async with two(pg_url, tmp_path, model, [], poll_interval=30.0) as (a, b):
        pa = await a.spawn(owner="alice")
        seen: list[sig.Signal] = []
        finished = asyncio.Event()

        async def follow() -> None:  # on A, which runs the first message and then lets go
            async for s in pa.signals(follow=True):
                seen.append(s)
                if s.signal == sig.RUN_FINISHED:
                    finished.set()

        await pa.send("first")  # A claims the process to run it
        assert await holder(pg_url, pa.pid) == "A"
        follower = asyncio.create_task(follow())  # a watcher on the holder: nothing to announce yet
        await asyncio.wait_for(finished.wait(), 10)
        async with asyncio.timeout(5):  # A lets go of the idle process
            while await holder(pg_url, pa.pid) == "A":
                await asyncio.sleep(0.05)
        finished.clear()
        await (await b.process(pa.pid)).send("second")  # B claims it and runs this one
        await asyncio.wait_for(finished.wait(), 10)
        follower.cancel()
        second = seen[max(i for i, s in enumerate(seen) if s.signal == sig.RUN_STARTED) :]
        text = "".join(s.payload["delta"] or "" for s in second if s.signal == sig.RUN_STREAM)
        assert text == "about second"  # relayed by B to A's watcher


async def test_a_follower_shows_deltas_in_order_without_reading_the_log_for_each(pg_url: str, tmp_path: Path) -> None:
    model = SlowText(lambda req: "lorem ipsum " * 12, chunk=4)  # 36 chunks, about a second
    async with two(pg_url, tmp_path, model, []) as (a, b):
        pa = await a.spawn(owner="alice")
        pb = await b.process(pa.pid)
        assert b.engine.leases is not None
        reads, batches = spy(b.store, "events"), []
        received = b.engine.leases.relayed

        def relayed(sender: str, got: list[Any]) -> None:
            batches.extend(got)
            received(sender, got)

        b.engine.leases.relayed = relayed  # type: ignore[method-assign]
        seen: list[sig.Signal] = []

        async def follow() -> None:
            async for s in pb.signals(follow=True):
                seen.append(s)
                if s.signal == sig.RUN_FINISHED:
                    return

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.1)
        await pa.send("go")
        await asyncio.wait_for(follower, 10)
        text = "".join(s.payload["delta"] or "" for s in seen if s.signal == sig.RUN_STREAM)
        assert text == "lorem ipsum " * 12
        # most batches went straight to the watcher: the log is read on commits and polls only
        # (reading it for each batch, it would be read more often than batches came)
        assert len(batches) >= 10 and len(reads) < len(batches) * 2 / 3


async def test_a_worker_that_takes_a_process_over_relays_after_its_last_logged_signal(
    pg_url: str, tmp_path: Path
) -> None:
    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "hi " + last_user(req)), []) as (a, b):
        pa = await a.spawn(owner="alice", text="first")
        await pa.wait_idle()
        async with asyncio.timeout(5):  # A lets go of the idle process
            while await holder(pg_url, pa.pid) == "A":
                await asyncio.sleep(0.05)
        assert b.engine.leases is not None and await b.engine.leases.hold(pa.pid)
        live = await b.engine.live(pa.pid)  # B's deltas name the last signal A logged, not 0
        assert live.seq == await b.store.last_event_seq(pa.pid) > 0


async def test_deltas_keep_coming_after_input_forwarded_from_the_other_worker(pg_url: str, tmp_path: Path) -> None:
    # B logs the steer's proc.changed into A's process: A's later deltas follow that signal
    model = SlowText(lambda req: f"about {last_user(req)}: " + "lorem ipsum " * 12, chunk=4)
    async with two(pg_url, tmp_path, model, []) as (a, b):
        pa = await a.spawn(owner="alice")
        pb = await b.process(pa.pid)
        seen: list[sig.Signal] = []
        streaming = asyncio.Event()

        async def follow() -> None:
            async for s in pb.signals(follow=True):
                seen.append(s)
                if sum(x.signal == sig.RUN_STREAM for x in seen) == 3:
                    streaming.set()
                if s.signal == sig.RUN_FINISHED:
                    return

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.1)
        await pa.send("first")
        await asyncio.wait_for(streaming.wait(), 10)
        await pb.send("also this", mode="steer")  # through B, while A's model streams
        await asyncio.wait_for(follower, 10)
        steered = next(i for i, s in enumerate(seen) if s.signal == sig.CHANGED and "queue" in s.payload["changes"])
        answered = next(i for i, s in enumerate(seen) if s.signal == sig.RUN_OUTPUT)
        assert steered < answered
        # the first answer's deltas after the steer still reach B, to the end of the answer (some
        # made just as the steer was logged may be dropped: only progress)
        text = "".join(s.payload["delta"] or "" for s in seen[steered:answered] if s.signal == sig.RUN_STREAM)
        assert len(text) >= 8 and seen[answered].payload["text"].endswith(text[-8:])


async def test_a_worker_whose_lease_was_taken_over_cannot_commit(pg_url: str, tmp_path: Path) -> None:
    """A stalls in a model call past its lease (simulated by expiring the lease row); B claims the
    run and finishes it; A's late answer is refused at commit, and A drops the process."""
    calls: list[str] = []
    stall = asyncio.Event()

    async def brain(req: ModelRequest) -> str:
        calls.append("call")
        if len(calls) == 1:
            await stall.wait()  # A's call: answers only after B took over
            return "stale answer from A"
        return "answer from B"

    model = ScriptedModel(brain)
    async with AsyncExitStack() as stack:
        # A renews rarely, so only its commit can find out that it lost the lease
        a = await stack.enter_async_context(worker(pg_url, tmp_path, "A", model, [], lease_ttl=60.0))
        b = await stack.enter_async_context(worker(pg_url, tmp_path, "B", model, []))
        pa = await a.spawn(owner="alice")
        await pa.send("hello")
        while not calls:
            await asyncio.sleep(0.01)
        await a.store.pool.execute("UPDATE process_leases SET expires = 0 WHERE pid = $1", pa.pid)  # type: ignore[attr-defined]
        assert b.engine.leases is not None and await b.engine.leases.hold(pa.pid)  # B takes the run over
        pb = await b.process(pa.pid)
        await pb.wait_idle()
        assert [m.text for m in await pb.messages()] == ["hello", "answer from B"]
        stall.set()  # A's late answer: its commit is fenced off
        for _ in range(100):
            if a.engine.cached(pa.pid) is None:
                break
            await asyncio.sleep(0.02)
        assert a.engine.cached(pa.pid) is None  # A let the process go
        assert a.engine.leases is not None and pa.pid not in a.engine.leases.held
        assert [m.text for m in await pb.messages()] == ["hello", "answer from B"]
        finished = [s for s in [s async for s in pb.signals(follow=False)] if s.signal == sig.RUN_FINISHED]
        assert len(finished) == 1


@pytest.mark.timeout(180)
async def test_many_sends_from_both_workers_each_run_exactly_once(pg_url: str, tmp_path: Path) -> None:
    """Ten processes, twelve messages each, sent through both workers at once (queue and steer):
    every message is in its history once, its tool ran once, and no process ran on two workers
    at the same time."""
    ran: list[tuple[str, str]] = []
    busy: dict[str, dict[str, int]] = {}  # pid -> worker -> tools of it running there
    overlaps: list[str] = []

    def make_tool(worker_name: str) -> Any:
        @tool(name="mark")
        async def mark(pid: str, text: str) -> str:
            """Record a message, noticing a process at work on two workers at once."""
            here = busy.setdefault(pid, {})
            if any(n for w, n in here.items() if w != worker_name):
                overlaps.append(pid)
            here[worker_name] = here.get(worker_name, 0) + 1
            await asyncio.sleep(0.005)
            ran.append((pid, text))
            here[worker_name] -= 1
            return f"{worker_name} marked {text}"

        return mark

    def brain(req: ModelRequest) -> Reply | str:
        new: list[str] = []  # the user messages since the model last spoke (steers arrive together)
        for m in reversed(req.messages):
            if not isinstance(m, UserMessage):
                break
            new.insert(0, m.text)
        if new:
            return Reply(tool_calls=[call("mark", pid=t.split(":")[0], text=t) for t in new])
        return "ok"

    model = ScriptedModel(brain)
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(worker(pg_url, tmp_path, "A", model, [make_tool("A")]))
        b = await stack.enter_async_context(worker(pg_url, tmp_path, "B", model, [make_tool("B")]))
        pids = [(await a.spawn(owner="alice")).pid for _ in range(10)]
        sent: list[str] = []

        async def sender(k: Kernel, parity: int) -> None:
            for i in range(parity, 12, 2):
                for pid in pids:
                    text = f"{pid}:{i}"
                    sent.append(text)
                    await (await k.process(pid)).send(text, mode="queue" if i % 3 else "steer")

        await asyncio.gather(sender(a, 0), sender(b, 1))
        for pid in pids:
            for _ in range(3):  # idle on the store, then settled on both workers
                await (await a.process(pid)).wait_idle()
                await (await b.process(pid)).wait_idle()
        store = a.store
        for pid in pids:
            texts = [m.message.text for m in await store.history(pid) if isinstance(m.message, UserMessage)]
            expected = sorted(t for t in sent if t.startswith(pid + ":"))
            assert sorted(texts) == expected, pid  # none lost, none twice
            assert not await store.queue(pid)
    assert sorted(t for _, t in ran) == sorted(sent)  # each message's tool ran exactly once
    assert not overlaps


async def test_a_fenced_commit_and_a_forwarded_write_notify_the_other_workers(pg_url: str) -> None:
    from agentloop.process.store import ProcessRecord

    a, b = open_store(pg_url), open_store(pg_url)
    await a.open()
    await b.open()
    heard: list[tuple[str, str]] = []
    got = asyncio.Event()

    def notified(pid: str, sender: str) -> None:
        heard.append((pid, sender))
        got.set()

    stop = await b.listen(notified)
    assert stop is not None
    try:
        async with a.transaction():
            await a.create_process(ProcessRecord(pid="p1", owner="o", run_as="o", cwd="/"))
        epoch = await a.claim_lease("p1", "A", 30)
        assert epoch is not None
        async with a.transaction():
            assert await a.fence("p1", "A", epoch, 30)
            await asyncio.sleep(0.05)
            assert heard == []  # not before the commit
        await asyncio.wait_for(got.wait(), 5)
        assert heard == [("p1", "A")]
        got.clear()
        async with a.transaction():
            assert not await a.fence("p1", "A", epoch + 1, 30)  # a stale claim: no notification either
            await a.notify("p1", "B")  # a forwarded write
        await asyncio.wait_for(got.wait(), 5)
        assert heard == [("p1", "A"), ("p1", "B")]
    finally:
        await stop()
        await a.close()
        await b.close()


class Heard:
    """A LiveListener that keeps what it hears."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, str, int, list[dict[str, Any]]]] = []
        self.follows: list[tuple[str, list[str]]] = []
        self.got = asyncio.Event()

    def relayed(self, sender: str, batches: list[tuple[str, int, list[dict[str, Any]]]]) -> None:
        self.batches += [(sender, pid, base, payloads) for pid, base, payloads in batches]
        self.got.set()

    def followed(self, sender: str, pids: list[str]) -> None:
        self.follows.append((sender, pids))
        self.got.set()

    async def until(self, done: Any) -> None:
        async with asyncio.timeout(5):
            while not done():
                await self.got.wait()
                self.got.clear()


async def test_relayed_deltas_reach_the_other_workers_in_notifications_that_fit(pg_url: str) -> None:
    a, b = open_store(pg_url), open_store(pg_url)
    await a.open()
    await b.open()
    heard = Heard()
    stop = await b.listen(lambda pid, sender: None, heard)
    assert stop is not None
    try:
        # 20 deltas of 2 kB each (two bytes a character): only the byte count keeps them under the limit
        deltas = [{"event": "text_delta", "delta": f"{i:04d}" + "é" * 998} for i in range(20)]
        # more than one notification holds: a delta is sent in pieces, anything else left out
        too_big = {"event": "text_delta", "delta": "y" * 9000 + "\x1b" * 3000}
        shell = {"runId": "r", "update": {"stream": "stdout", "delta": "z\u00e9\n" * 4000, "skipped": 5}}
        no_delta = {"runId": "r", "update": {"lines": ["x" * 100] * 100}}
        sent = [too_big, shell, no_delta, *deltas[5:]]
        await a.relay("A", [("p1", 7, deltas[:5]), ("p2", 3, sent)])
        await heard.until(lambda: [d for *_, p in heard.batches for d in p][-1:] == deltas[-1:])
        assert len(heard.batches) > 2  # split between notifications
        assert {(sender, pid, base) for sender, pid, base, _ in heard.batches} == {("A", "p1", 7), ("A", "p2", 3)}
        got = [d for *_, payloads in heard.batches for d in payloads]
        assert got[:5] == deltas[:5] and got[-15:] == deltas[5:]  # in order
        pieces = got[5:-15]
        streamed = [p for p in pieces if "delta" in p]
        assert len(streamed) > 1 and "".join(p["delta"] for p in streamed) == too_big["delta"]
        assert all(p["event"] == "text_delta" for p in streamed)
        updates = [p["update"] for p in pieces if "update" in p]
        assert len(updates) > 1 and "".join(u["delta"] for u in updates) == shell["update"]["delta"]
        assert [u.get("skipped") for u in updates] == [5] + [None] * (len(updates) - 1)
        assert len(streamed) + len(updates) == len(pieces)  # the one without a delta left out
        await b.pool.execute("SELECT pg_notify('agentloop_live', 'not json')")  # ignored, not a crash
        await a.follow_live("A", [f"pid-{i}" for i in range(1000)])  # 22 kB of pids: several notifications
        await heard.until(lambda: sum(len(pids) for _, pids in heard.follows) >= 1000)
        assert [pid for _, pids in heard.follows for pid in pids] == [f"pid-{i}" for i in range(1000)]
        assert len(heard.follows) > 1 and {sender for sender, _ in heard.follows} == {"A"}
    finally:
        await stop()
        await a.close()
        await b.close()


async def test_a_parent_aborted_or_killed_through_the_other_worker_takes_its_subagents_along(
    pg_url: str, tmp_path: Path
) -> None:
    """The abort is forwarded to the parent's holder, whose abort stops the subagent its run
    started; a kill from the worker without the lease reaches the children too."""

    @tool
    async def nap(seconds: float) -> str:
        """Sleep."""
        await asyncio.sleep(seconds)
        return "rested"

    def brain(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if isinstance(last, UserMessage) and last.text == "parent":  # a background child, and stay busy
            return Reply(tool_calls=[call("Task", prompt="child", wait=False), call("nap", seconds=30)])
        if isinstance(last, UserMessage) and last.text == "child":
            return Reply(tool_calls=[call("nap", seconds=30)])
        return "over"

    async def running_children(k: Kernel, pid: str) -> list[str]:
        return [r.pid for r in await k.processes("alice") if r.parent_pid == pid and r.current_run]

    async with two(pg_url, tmp_path, ScriptedModel(brain), [nap], subagents=True) as (a, b):
        pa = await a.spawn(owner="alice")
        pb = await b.process(pa.pid)
        await pa.send("parent")
        async with asyncio.timeout(10):
            while not await running_children(a, pa.pid):
                await asyncio.sleep(0.02)
        [child] = await running_children(a, pa.pid)
        assert await pb.abort()  # forwarded to A
        async with asyncio.timeout(10):
            await (await b.process(child)).wait_idle()
        ended = [
            s.payload async for s in (await b.process(child)).signals(follow=False) if s.signal == sig.RUN_FINISHED
        ]
        assert ended[-1]["status"] == "aborted" and ended[-1]["reason"] == "parent.abort"

        await pa.send("parent")  # a second run, with a second child
        async with asyncio.timeout(10):
            while not await running_children(a, pa.pid):
                await asyncio.sleep(0.02)
        await pb.kill()
        assert await b.processes("alice") == []


async def test_a_worker_keeps_no_claim_lock_for_processes_it_is_not_claiming(pg_url: str, tmp_path: Path) -> None:
    """One lock per process ever claimed, kept for ever, would grow without bound on a long-lived
    worker: a lock lives only while a claim holds or waits for it."""
    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "ok " + last_user(req)), []) as (a, b):
        procs = [await a.spawn(owner="alice") for _ in range(5)]
        for i, proc in enumerate(procs):
            await (await b.process(proc.pid)).send(f"via b {i}")
            await proc.send(f"via a {i}")
        for proc in procs:
            await proc.wait_idle()
            await (await b.process(proc.pid)).wait_idle()
        for k in (a, b):
            assert k.engine.leases is not None
            assert len(k.engine.leases._claiming) == 0


@pytest.fixture
async def archiving(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set when a reset or kill begins writing its archive, which then takes a second: the window
    in which the tests below send through the other worker."""
    import agentloop.kernel.kernel as kernel_module

    began = asyncio.Event()
    loop = asyncio.get_running_loop()
    real_write = kernel_module.write_archive

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        loop.call_soon_threadsafe(began.set)
        time.sleep(1.0)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(kernel_module, "write_archive", slow_write)
    return began


async def test_a_message_sent_through_the_other_worker_during_a_reset_reaches_the_fresh_conversation(
    pg_url: str, tmp_path: Path, archiving: asyncio.Event
) -> None:
    """A reset on the holder archives, then clears: a message that another worker queues for the
    process meanwhile is neither started on the history being cleared nor dropped with the
    queue the reset discards; it starts the first run of the fresh conversation."""
    brain = lambda req: "seen: " + ", ".join(m.text for m in req.messages if isinstance(m, UserMessage))  # noqa: E731
    async with two(pg_url, tmp_path, ScriptedModel(brain), []) as (a, b):
        proc_a = await a.spawn(owner="alice")
        await proc_a.send("before")
        await proc_a.wait_idle()
        await kept_by(a, proc_a.pid)
        proc_b = await b.process(proc_a.pid)

        resetting = asyncio.create_task(proc_a.reset())
        await asyncio.wait_for(archiving.wait(), 10)
        sent = await proc_b.send("after")  # queued for A, which is resetting the process
        await resetting
        for _ in range(200):
            texts = [m.text for m in await proc_a.messages()]
            if len(texts) == 2:
                break
            await asyncio.sleep(0.05)
        assert texts == ["after", "seen: after"]
        started = [s async for s in proc_a.signals(follow=False) if s.signal == sig.RUN_STARTED]
        assert started[-1].payload["runId"] == sent.run_id


async def test_a_reset_refused_because_another_worker_holds_the_process_changes_nothing(
    pg_url: str, tmp_path: Path
) -> None:
    """A reset through a worker that cannot take the process from its holder is refused before
    it touches anything: the images of the history it keeps are still there (they were deleted,
    then the reset gave up), and the refusal says the process is busy."""
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + bytes(range(64))).decode()
    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "seen"), []) as (a, b):
        proc_a = await a.spawn(owner="alice")
        await proc_a.send("look", media=[ImageContent(data=png, mime_type="image/png")])
        await proc_a.wait_idle()
        await kept_by(a, proc_a.pid)
        media = a.media.process_dir("alice", proc_a.pid)
        assert len(list(media.iterdir())) == 1
        with pytest.raises(ProcessBusy, match="busy on another worker"):
            await (await b.process(proc_a.pid)).reset()
        assert len(list(media.iterdir())) == 1
        assert [m.text for m in await proc_a.messages()] == ["look", "seen"]
        assert not list((tmp_path / "var" / "sessions").rglob("*.jsonl.gz"))  # nothing archived either
        service = ProcessService(b)  # over HTTP and WebSocket: 409, to be tried again
        with pytest.raises(ApiError) as refused:
            await service.reset(Principal("alice", admin=False, token_id="t"), proc_a.pid)
        assert (refused.value.status, refused.value.code, refused.value.retry_after) == (409, "conflict", 1)


async def test_a_message_sent_through_the_other_worker_during_a_kill_is_refused_or_archived(
    pg_url: str, tmp_path: Path, archiving: asyncio.Event
) -> None:
    """A kill on the holder archives, then deletes the process: a message that another worker
    sends meanwhile either gets "no such process" or, if it was queued in time, is in the
    archive. It is never deleted with the process after its sender got a receipt."""
    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "seen"), []) as (a, b):
        proc_a = await a.spawn(owner="alice")
        await proc_a.send("before")
        await proc_a.wait_idle()
        await kept_by(a, proc_a.pid)
        proc_b = await b.process(proc_a.pid)

        killing = asyncio.create_task(proc_a.kill())
        await asyncio.wait_for(archiving.wait(), 10)
        with pytest.raises(NoSuchProcess):
            await proc_b.send("after")  # waits for the kill's commit, then finds no process
        archive = await killing
        assert archive is not None
        header, history = read_archive(archive)
        assert [m.text for m in history] == ["before", "seen"] and "queued" not in header["meta"]
        with pytest.raises(NoSuchProcess):
            await b.process(proc_a.pid)


async def test_adds_through_both_workers_respect_the_limits_and_the_cycle_check(pg_url: str, tmp_path: Path) -> None:
    """The per-process limits and the watch cycle check hold for requests that reach different
    workers at once, not only for those of one worker."""
    from agentloop.kernel.schedules import MAX_SCHEDULES
    from agentloop.kernel.watches import WatchError

    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "ok"), []) as (a, b):
        p = await a.spawn(owner="alice")
        made = await asyncio.gather(
            *(k.schedule(p.pid, "tick", at=4e9) for k in (a, b) for _ in range(MAX_SCHEDULES // 2 + 10)),
            return_exceptions=True,
        )
        assert sum(isinstance(r, str) for r in made) == MAX_SCHEDULES == len(await a.schedules(p.pid))
        loops = 0
        for _ in range(5):  # each try a fresh pair: A->B through one worker, B->A through the other
            x, y = await a.spawn(owner="alice"), await a.spawn(owner="alice")
            both = await asyncio.gather(
                a.watch(x.pid, y.pid, once=False), b.watch(y.pid, x.pid, once=False), return_exceptions=True
            )
            assert all(isinstance(r, str | WatchError) for r in both), both
            loops += all(isinstance(r, str) for r in both)
        assert loops == 0


async def test_the_process_quota_holds_for_spawns_through_both_workers_at_once(pg_url: str, tmp_path: Path) -> None:
    """The live processes an account may have are counted in the transaction that stores each new
    one, under a key of the account's: spawns through two workers at once cannot pass it together."""
    pytest.importorskip("starlette")
    from agentloop.server.auth import Principal
    from agentloop.server.errors import ApiError
    from agentloop.server.service import ProcessService

    bob = Principal("bob", admin=False, token_id="t")
    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "ok"), []) as (a, b):
        services = [ProcessService(a, max_processes=3), ProcessService(b, max_processes=3)]
        made = await asyncio.gather(*(s.spawn(bob) for s in services for _ in range(8)), return_exceptions=True)
        assert sum(isinstance(r, dict) for r in made) == 3, made
        assert all(isinstance(r, dict) or (isinstance(r, ApiError) and r.status == 409) for r in made)
        assert len(await a.processes("bob")) == 3


async def test_orphans_swept_together_are_all_resumed_when_one_fails_to_resume(pg_url: str, tmp_path: Path) -> None:
    """The sweep claims several orphans at once. One whose resume fails (a database error, a
    prompt or toolset hook raising) must not strand the others, nor itself: a claimed lease this
    worker renews but never acts on would keep every other worker away from the process for good."""
    from agentloop.messages import user
    from agentloop.process.store import ProcessRecord

    model = ScriptedModel(lambda r: f"re: {last_user(r)}")
    async with worker(pg_url, tmp_path, "A", model, []) as a:
        engine = a.engine
        real_resume = engine.resume
        failed: list[str] = []

        async def resume_failing_once(record: ProcessRecord) -> bool:
            if not failed:
                failed.append(record.pid)
                raise RuntimeError("the database went away for a moment")
            return await real_resume(record)

        engine.resume = resume_failing_once  # type: ignore[method-assign]
        now = time.time()
        async with a.store.transaction():  # two processes with queued input and no lease: orphans
            for pid in ("orphan-1", "orphan-2"):
                await a.store.create_process(ProcessRecord(pid, "alice", "alice", str(tmp_path), created_at=now))
                await a.store.enqueue(pid, "queue", user(f"hello {pid}"), run_id=f"r-{pid}")
        for pid in ("orphan-1", "orphan-2"):
            proc = await a.process(pid)
            async with asyncio.timeout(10):
                while not [m for m in await a.store.history(pid) if m.message.role == "assistant"]:
                    await asyncio.sleep(0.05)
            await proc.wait_idle()
            assert [m.text for m in await proc.messages()] == [f"hello {pid}", f"re: hello {pid}"]
        assert failed == ["orphan-1"]


async def test_an_idle_process_leased_before_a_restart_under_the_same_name_is_not_stranded(
    pg_url: str, tmp_path: Path
) -> None:
    """A worker died holding the lease of an idle process (between a run's end and letting it go)
    and came back under the same name. Its renewals, which extend every lease of its name, must not
    keep that lease alive for good: input sent through another worker would wait for ever."""
    from agentloop.process.store import ProcessRecord

    store = open_store(pg_url)
    await store.open()
    try:
        async with store.transaction():
            await store.create_process(ProcessRecord("p-idle", "alice", "alice", str(tmp_path), created_at=time.time()))
        assert await store.claim_lease("p-idle", "A", 2.0) is not None  # A's previous life held it
    finally:
        await store.close()
    model = ScriptedModel(lambda r: f"re: {last_user(r)}")
    async with two(pg_url, tmp_path, model, []) as (_a, b):
        proc = await b.process("p-idle")
        await proc.send("hello", mode="queue")  # through B: A's lease is alive, so B forwards it
        async with asyncio.timeout(10):
            while not [m for m in await b.store.history("p-idle") if m.message.role == "assistant"]:
                await asyncio.sleep(0.05)
        assert [m.text for m in await proc.messages()] == ["hello", "re: hello"]


async def test_events_delivered_through_the_other_worker_during_a_reset_do_not_reach_the_fresh_conversation(
    pg_url: str, tmp_path: Path, archiving: asyncio.Event
) -> None:
    """A reset drops the schedules and watches the process set up: their events belong to the
    conversation being archived. One that another worker delivers while the reset is under way
    (its schedules duty firing, its copy of a watched run ending) is queued for the holder; the
    reset must drop it with them, not start the fresh conversation with it."""
    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "ok"), []) as (a, b):
        for k in (a, b):  # the test delivers the events itself, through B
            await k.scheduler.stop()
            await k.watchers.stop()
        proc_a = await a.spawn(owner="alice")
        source = await a.spawn(owner="alice")
        await proc_a.send("before")
        await proc_a.wait_idle()
        await kept_by(a, proc_a.pid)
        await a.schedule(proc_a.pid, "stand-up", at=time.time() + 3600)
        [row] = await a.schedules(proc_a.pid)
        await a.watch(proc_a.pid, source.pid)
        [watch] = await a.watches(proc_a.pid)
        await source.send("work")
        await source.wait_idle()
        [finished] = [e for e in await a.store.events(source.pid) if e.signal == sig.RUN_FINISHED]

        resetting = asyncio.create_task(proc_a.reset())
        await asyncio.wait_for(archiving.wait(), 10)
        assert await b.scheduler._fire(row, time.time()) is None  # due now, fired by B
        assert await b.engine.claimed_event(  # as B's watch router delivers it
            proc_a.pid,
            "[signal watch] the source finished",
            claim=b.watchers._claim(watch, finished.seq),
            run_id=f"watch:{watch.id}:{finished.seq}",
            reason="signal.watch",
        )
        await resetting
        await asyncio.sleep(0.5)
        await proc_a.wait_idle()
        assert [m.text for m in await proc_a.messages()] == []
        assert await a.store.queue(proc_a.pid) == []
        assert await a.schedules(proc_a.pid) == [] and await a.watches(proc_a.pid) == []


async def test_one_delivery_id_sent_through_both_workers_at_once_is_delivered_once(pg_url: str, tmp_path: Path) -> None:
    """A send (or system event) retried through the other worker while the first try is still
    under way: the holder starts the run, the other worker queues it, and neither saw the other's
    uncommitted idempotency record, so the message ran twice under one run id."""
    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "ok"), []) as (a, b):
        assert a.engine.leases is not None
        for i in range(5):
            pa = await a.spawn(owner="alice")
            await a.engine.leases.hold(pa.pid)  # A holds it: B forwards
            pb = await b.process(pa.pid)
            first, second = await asyncio.gather(pa.send("hello", run_id=f"d{i}"), pb.send("hello", run_id=f"d{i}"))
            assert first == second
            events = await asyncio.gather(
                a.signal(pa.pid, "the build finished", run_id=f"e{i}"),
                b.signal(pa.pid, "the build finished", run_id=f"e{i}"),
            )
            assert events[0] == events[1]
            for _ in range(2):
                await pa.wait_idle()
                await pb.wait_idle()
            texts = [m.text for m in await pa.messages()]
            assert texts.count("hello") == 1, texts
            assert texts.count("the build finished") == 1, texts
            started = [s.payload["runId"] async for s in pa.signals(follow=False) if s.signal == sig.RUN_STARTED]
            assert len(started) == len(set(started)), started


async def test_waiting_for_a_process_held_elsewhere_does_not_poll_the_database_continually(
    pg_url: str, tmp_path: Path
) -> None:
    """A worker waiting for a run on the other worker to end (a subagent's parent, a client) looks
    again when that worker says the process changed, or every poll interval: not fifty times a
    second for as long as the run lasts."""

    async def slow(req: ModelRequest) -> str:
        await asyncio.sleep(1.5)
        return "done"

    async with two(pg_url, tmp_path, ScriptedModel(slow), []) as (a, b):
        pa = await a.spawn(owner="alice")
        await pa.send("work")
        pb = await b.process(pa.pid)
        reads = count_process_reads(b)
        async with asyncio.timeout(10):
            await pb.wait_idle()
        assert [m.text for m in await pa.messages()] == ["work", "done"]
        assert len(reads) <= 25, len(reads)  # (a poll every 0.2 s, a look per notification; was ~70)


async def test_an_abort_forwarded_to_the_holder_waits_for_it_without_polling_the_database(
    pg_url: str, tmp_path: Path
) -> None:
    """A forwarded abort waits for the holder to end the run the same way: it looks again when the
    holder says the process changed, or every poll interval, and returns once the run ended."""

    @tool
    async def stubborn() -> str:
        """Take a second and a half to stop when cancelled."""
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(1.5)
            raise
        return "never"

    def brain(req: ModelRequest) -> Reply | str:
        return Reply(tool_calls=[call("stubborn")]) if isinstance(req.messages[-1], UserMessage) else "over"

    async with two(pg_url, tmp_path, ScriptedModel(brain), [stubborn]) as (a, b):
        pa = await a.spawn(owner="alice")
        run = await pa.send("go")
        async with asyncio.timeout(10):
            while not [s async for s in pa.signals(follow=False) if s.signal == sig.TOOL_STARTED]:
                await asyncio.sleep(0.02)
        pb = await b.process(pa.pid)
        reads = count_process_reads(b)
        async with asyncio.timeout(10):
            assert await pb.abort() is True  # forwarded to A, whose tool takes 1.5 s to stop
        ended = [s.payload async for s in pa.signals(follow=False) if s.signal == sig.RUN_FINISHED]
        assert ended[-1]["runId"] == run.run_id and ended[-1]["status"] == "aborted"
        assert len(reads) <= 20, len(reads)  # (a poll every 0.2 s, a look per notification; was ~75)


async def test_approvals_of_one_run_answered_through_both_workers_at_once_are_all_kept(
    pg_url: str, tmp_path: Path
) -> None:
    """Approving updates the run's map of approved calls (read, add, write): two approvals of one
    run's nested calls, answered through both workers at the same moment, each wrote the map as
    it read it, so one was lost (and its call then denied)."""
    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "ok"), []) as (a, b):
        proc_a = await a.spawn(owner="alice")
        await kept_by(a, proc_a.pid)
        proc_b = await b.process(proc_a.pid)
        for attempt in range(10):
            run_id = f"run-{attempt}"
            rows = [
                HilRow(
                    f"q{attempt}-{n}", proc_a.pid, run_id, f"d{attempt}-{n}", "c", "Shell", "shell.exec", {}, f"f{n}"
                )
                for n in (1, 2)
            ]
            async with a.store.transaction():
                for row in rows:
                    await a.store.put_hil(row)
            await asyncio.gather(proc_a.hil(rows[0].request_id, "approve"), proc_b.hil(rows[1].request_id, "approve"))
            approved = await a.store.kv_get(proc_a.pid, f"approved:{run_id}")
            assert approved == {rows[0].dispatch_id: "f1", rows[1].dispatch_id: "f2"}, attempt
