"""Review of running several workers on one PostgreSQL store (DESIGN §6): what an operator with
two or more workers would hit when connections drop, leases lapse or workers stall."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")

from agentloop import ScriptedModel
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.lease import ABORT_KEY
from agentloop.process.store import StoreError
from tests.pg_support import PgServer
from tests.test_scale_out import SlowText, kept_by, last_user, two, worker


async def drop_listeners(url: str) -> int:
    """End every worker's LISTEN connection on the server (as a restart or a network blip
    would), leaving the pooled connections alone; returns how many were ended."""
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid() AND query LIKE 'LISTEN%'"
            )
        )
    finally:
        await conn.close()


async def test_live_deltas_reach_the_other_worker_after_its_listen_connection_dropped(
    pg_url: str, tmp_path: Path
) -> None:
    """Relayed deltas and announcements travel only by NOTIFY: a worker whose LISTEN connection
    died must listen again, or its watchers see no live text (and it no interest) for good."""
    model = SlowText(lambda req: "live text for " + last_user(req), chunk=4)
    async with two(pg_url, tmp_path, model, []) as (a, b):
        pa = await a.spawn(owner="alice")
        pb = await b.process(pa.pid)
        assert await drop_listeners(pg_url) == 2
        await asyncio.sleep(1.0)  # a few polls: time enough to listen again
        seen: list[sig.Signal] = []

        async def follow() -> None:
            async for s in pb.signals(after_seq=await b.store.last_event_seq(pb.pid), follow=True):
                seen.append(s)
                if s.signal == sig.RUN_FINISHED:
                    return

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.5)
        await pa.send("go")  # runs on A, which relays its deltas to B's watcher
        await asyncio.wait_for(follower, 10)
        text = "".join(s.payload["delta"] or "" for s in seen if s.signal == sig.RUN_STREAM)
        assert text == "live text for go"


@pytest.mark.parametrize(("watcher", "killer"), [("other", "holder"), ("holder", "other"), ("other", "other")])
async def test_a_watcher_stops_when_the_process_is_killed_whichever_worker_kills_it(
    pg_url: str, tmp_path: Path, watcher: str, killer: str
) -> None:
    """On one worker a kill ends its followers' streams; a follower on any worker must not wait
    for ever on a process that no longer exists."""
    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "hi"), []) as (a, b):
        pa = await a.spawn(owner="alice")
        await kept_by(a, pa.pid)  # A holds the process
        pb = await b.process(pa.pid)
        seen: list[str] = []

        async def follow() -> None:
            async for s in (pa if watcher == "holder" else pb).signals(follow=True):
                seen.append(s.signal)

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.3)
        await (pa if killer == "holder" else pb).kill()
        await asyncio.wait_for(follower, 5)  # the stream ends


async def test_a_watcher_on_a_worker_that_lost_the_lease_follows_the_new_holder(pg_url: str, tmp_path: Path) -> None:
    """A stalls past its lease and B takes the process over: A's watchers must go on seeing the
    process (from the log, as for any process held elsewhere), not fall silent for good."""
    model = ScriptedModel(lambda req: "hi " + last_user(req))
    async with two(pg_url, tmp_path, model, []) as (a, b):
        pa = await a.spawn(owner="alice")
        await kept_by(a, pa.pid)
        seen: list[sig.Signal] = []
        done = asyncio.Event()

        async def follow() -> None:
            async for s in pa.signals(follow=True):
                seen.append(s)
                if s.signal == sig.RUN_OUTPUT and s.payload.get("text") == "hi after":
                    done.set()

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.3)
        await b.store.pool.execute("UPDATE process_leases SET expires = 0 WHERE pid = $1", pa.pid)  # type: ignore[attr-defined]
        assert b.engine.leases is not None and await b.engine.leases.hold(pa.pid)  # B takes it over
        await asyncio.sleep(1.0)  # A finds out at its next renewal
        assert a.engine.leases is not None and pa.pid not in a.engine.leases.held
        pb = await b.process(pa.pid)
        await pb.send("after")  # runs on B
        await asyncio.wait_for(done.wait(), 5)
        follower.cancel()


async def test_a_retried_interrupt_through_the_worker_without_the_lease_aborts_nothing(
    pg_url: str, tmp_path: Path
) -> None:
    """An interrupt with a run id, retried (a client that timed out, a balancer that picked the
    other worker): the retry returns the first receipt and must not abort the run it started."""
    gate = asyncio.Event()

    async def brain(req: ModelRequest) -> str:
        await gate.wait()
        return "done " + last_user(req)

    async with two(pg_url, tmp_path, ScriptedModel(brain), []) as (a, b):
        pa = await a.spawn(owner="alice")
        await kept_by(a, pa.pid)
        await pa.send("first")  # runs on A, waiting in its model call
        pb = await b.process(pa.pid)
        receipt = await pb.send("urgent", mode="interrupt", run_id="r-urgent")
        async with asyncio.timeout(5):  # A stopped the first run and runs the interrupt
            while ((await a.store.get_process(pa.pid)).current_run or {}).get("run_id") != "r-urgent":  # type: ignore[union-attr]
                await asyncio.sleep(0.05)
        again = await pb.send("urgent", mode="interrupt", run_id="r-urgent")  # the retry
        assert again.run_id == receipt.run_id == "r-urgent"
        gate.set()
        await pb.wait_idle()
        finished = {
            s.payload["runId"]: s.payload["status"]
            for s in [s async for s in pb.signals(follow=False)]
            if s.signal == sig.RUN_FINISHED
        }
        assert finished["r-urgent"] != "aborted"


async def test_a_lease_outlives_a_few_failed_renewals_in_a_row(pg_url: str, tmp_path: Path) -> None:
    """A database blip makes renewals fail for a while (a failover, a saturated pool): the worker
    tries again soon instead of a whole renewal period later, so its leases never lapse while
    it lives (a lapse lets another worker take the run over and re-dispatch its tools)."""
    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "hi"), [], lease_ttl=3.0) as (a, _b):
        pa = await a.spawn(owner="alice")
        await kept_by(a, pa.pid)
        failures = 3
        real = a.store.renew_leases

        async def flaky(owner: str, ttl: float) -> dict[str, int]:
            nonlocal failures
            if failures > 0:
                failures -= 1
                raise StoreError("the database is away for a moment")
            return await real(owner, ttl)

        a.store.renew_leases = flaky  # type: ignore[method-assign]
        lapsed = False
        pool: Any = a.store.pool  # type: ignore[attr-defined]
        for _ in range(100):  # five seconds: the blip (three renewal periods when not retried sooner) and after
            lapsed = lapsed or bool(
                await pool.fetchval(
                    "SELECT expires < extract(epoch from clock_timestamp()) FROM process_leases WHERE pid = $1", pa.pid
                )
            )
            await asyncio.sleep(0.05)
        assert failures == 0
        assert not lapsed
        assert a.engine.leases is not None and pa.pid in a.engine.leases.held


async def test_a_worker_whose_lease_was_taken_over_leaves_an_abort_request_to_the_new_holder(
    pg_url: str, tmp_path: Path
) -> None:
    """A stalled past its lease and C took the process over; an abort request forwarded for the
    run reaches A (it has not renewed yet) before A knows it lost the lease: A cannot stop the
    run (its commit is fenced), so it must not consume the request either."""
    gate = asyncio.Event()

    async def brain(req: ModelRequest) -> str:
        await gate.wait()
        return "done"

    async with two(pg_url, tmp_path, ScriptedModel(brain), [], lease_ttl=60.0) as (a, _b):
        pa = await a.spawn(owner="alice")
        receipt = await pa.send("go")  # runs on A, waiting in its model call
        pool: Any = a.store.pool  # type: ignore[attr-defined]
        # C (a third worker) takes the process over
        await pool.execute("UPDATE process_leases SET owner = 'C', epoch = epoch + 1 WHERE pid = $1", pa.pid)
        async with a.store.transaction():
            await a.store.kv_set(pa.pid, ABORT_KEY, {"run_id": receipt.run_id, "reason": "user"})
        assert a.engine.leases is not None and pa.pid in a.engine.leases.held  # A does not know yet
        await a.engine.leases._look(pa.pid)  # as on a notification
        await asyncio.sleep(0.3)
        assert await a.store.kv_get(pa.pid, ABORT_KEY) is not None  # left for C
        assert pa.pid not in a.engine.leases.held  # and A learnt it lost the lease
        gate.set()


async def test_a_worker_that_shuts_down_hands_its_runs_over_at_once(pg_url: str, tmp_path: Path) -> None:
    """Closing a worker frees its leases: another worker resumes its runs at its next sweep, not
    a lease lifetime later."""
    calls: list[str] = []

    async def brain(req: ModelRequest) -> str:
        calls.append("call")
        if len(calls) == 1:
            await asyncio.Event().wait()  # A's call: never answers (A closes meanwhile)
        return "answer from B"

    async with AsyncExitStack() as stack, AsyncExitStack() as first:
        a = await first.enter_async_context(worker(pg_url, tmp_path, "A", ScriptedModel(brain), [], lease_ttl=60.0))
        b = await stack.enter_async_context(worker(pg_url, tmp_path, "B", ScriptedModel(brain), [], lease_ttl=60.0))
        pa = await a.spawn(owner="alice")
        await pa.send("hello")
        while not calls:
            await asyncio.sleep(0.01)
        await first.aclose()  # A shuts down
        pb = await b.process(pa.pid)
        async with asyncio.timeout(5):
            while [m.text for m in await pb.messages()] != ["hello", "answer from B"]:
                await asyncio.sleep(0.05)


async def restart(server: PgServer) -> None:
    """Restart the PostgreSQL server under the workers (every connection of theirs ends)."""
    pg_ctl = str(server.bindir / "pg_ctl")
    log = str(server.root / "server.log")  # (else the new server keeps pg_ctl's output open)
    await asyncio.to_thread(
        server._run, pg_ctl, "-D", str(server.data), "-l", log, "-m", "fast", "-w", "-t", "60", "restart"
    )


async def test_the_workers_carry_on_after_postgresql_restarts_under_them(
    pg_server: PgServer, pg_url: str, tmp_path: Path
) -> None:
    """A run whose model call is under way while the server restarts finishes; afterwards input
    sent through the other worker reaches the holder, and that worker's watcher sees the live
    text again."""
    gate = asyncio.Event()
    model = SlowText(lambda req: "answer to " + last_user(req), chunk=4)
    real = model._stream

    async def gated(request: ModelRequest, out: Any) -> Any:
        if last_user(request) == "before":
            await gate.wait()
        async for event in real(request, out):
            yield event

    model._stream = gated  # type: ignore[method-assign]
    async with two(pg_url, tmp_path, model, []) as (a, b):
        pa = await a.spawn(owner="alice")
        await kept_by(a, pa.pid)
        await pa.send("before")  # on A, its model call waiting
        await restart(pg_server)
        gate.set()
        await asyncio.wait_for(pa.wait_idle(), 10)
        pb = await b.process(pa.pid)
        seen: list[sig.Signal] = []

        async def follow() -> None:
            async for s in pb.signals(after_seq=await b.store.last_event_seq(pb.pid), follow=True):
                seen.append(s)
                if s.signal == sig.RUN_FINISHED:
                    return

        follower = asyncio.create_task(follow())
        await asyncio.sleep(1.0)  # (the listeners are back within a few polls)
        await pb.send("after")  # forwarded to A
        await asyncio.wait_for(follower, 10)
        texts = [m.text for m in await pb.messages()]
        assert texts == ["before", "answer to before", "after", "answer to after"]
        streamed = "".join(s.payload["delta"] or "" for s in seen if s.signal == sig.RUN_STREAM)
        assert streamed == "answer to after"


async def test_input_forwarded_to_a_holder_that_claimed_an_idle_process_without_loading_it_is_run(
    pg_url: str, tmp_path: Path
) -> None:
    """A holds an idle process it has not loaded: a claim that found nothing to resume (the
    sweep's, when the work it saw was gone by the time it claimed), or the reload after a failed
    commit of an idle process. Input sent through B then waits for A, which must run it (or let
    the process go) instead of keeping the lease, never looking at the process, for ever."""
    async with two(pg_url, tmp_path, ScriptedModel(lambda req: "hi " + last_user(req)), []) as (a, b):
        pa = await a.spawn(owner="alice")
        assert a.engine.leases is not None and await a.engine.leases.hold(pa.pid)
        assert a.engine.cached(pa.pid) is None  # claimed, nothing to resume: not loaded
        pb = await b.process(pa.pid)
        await pb.send("second")  # B: A holds it, so the message waits in its queue for A
        async with asyncio.timeout(5):
            while [m.text for m in await pb.messages()][-1:] != ["hi second"]:
                await asyncio.sleep(0.05)
