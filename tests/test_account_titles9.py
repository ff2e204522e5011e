"""Title changes go through the log like the other account signals: each is written with its
``proc.changed`` in one transaction (``ProcessEngine.log_changes``), so it has a
seq in the process's log and an account seq in the owner's account log. A resumed account stream
is given it, a watcher on another worker sharing the store hears of it, and the process's own
stream still has it once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from agentloop import ScriptedModel
from agentloop.kernel import AccountSignal, Kernel, Process
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.signals import Signal


def answer(req: ModelRequest) -> str:
    return "ok"


@asynccontextmanager
async def kernel(tmp_path: Path) -> AsyncIterator[Kernel]:
    url = f"sqlite:///{tmp_path}/agentloop.db"
    async with Kernel.open(url, model=ScriptedModel(answer), workspace=tmp_path) as k:
        yield k


def title_change(s: Signal) -> bool:
    return s.signal == sig.CHANGED and "title" in s.payload.get("changes", ())


async def titled(proc: Process, title: str | None = None) -> str:
    """The process's title once it has one (``title``, if given)."""
    async with asyncio.timeout(5):
        while (now := await proc.title()) is None or (title is not None and now != title):
            await asyncio.sleep(0.01)
    return now


async def until_logged(k: Kernel, owner: str, count: int) -> list[tuple[int, str, str, str | None]]:
    """The owner's account log once it holds ``count`` signals: (account seq, pid, name, title)."""
    async with asyncio.timeout(5):
        while len(rows := await k.store.account_events(owner)) < count:
            await asyncio.sleep(0.01)
    return [(r.seq, r.pid, r.signal, r.payload.get("title")) for r in rows]


async def anext_all(proc: Process) -> list[Signal]:
    """The process's logged signals, all of them (no following)."""
    return [s async for s in proc.signals(follow=False)]


async def take(stream: AsyncIterator[AccountSignal], n: int) -> list[AccountSignal]:
    async with asyncio.timeout(5):
        return [await anext(stream) for _ in range(n)]


async def test_a_title_change_is_in_the_account_log_with_an_account_seq(tmp_path: Path) -> None:
    async with kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice", text="plan the trip to Lisbon")
        await proc.wait_idle()
        assert await titled(proc) == "plan the trip to Lisbon"
        logged = await until_logged(k, "alice", 2)
        assert logged == [
            (1, proc.pid, sig.RUN_FINISHED, None),
            (2, proc.pid, sig.CHANGED, "plan the trip to Lisbon"),  # the automatic title
        ]
        await proc.set_title("Lisbon")  # a person's
        await proc.set_title(None)  # cleared: the automatic one is made again
        await titled(proc, "plan the trip to Lisbon")
        logged = await until_logged(k, "alice", 5)
        assert logged[2:] == [
            (3, proc.pid, sig.CHANGED, "Lisbon"),
            (4, proc.pid, sig.CHANGED, None),
            (5, proc.pid, sig.CHANGED, "plan the trip to Lisbon"),
        ]
        # each also in the process's own log, once, under the seq the account log names
        rows = await k.store.account_events("alice")
        in_process = [s for s in await anext_all(proc) if title_change(s)]
        assert [s.payload["title"] for s in in_process] == [r.payload["title"] for r in rows[1:]]
        assert [s.seq for s in in_process] == [r.pid_seq for r in rows[1:]]

        await proc.reset()  # drops the automatic title: logged too, after the reset
        assert await proc.title() is None
        logged = await until_logged(k, "alice", 6)
        assert logged[5] == (6, proc.pid, sig.CHANGED, None)
        assert await k.account_seq("alice") == 6


async def test_a_resume_after_a_seq_gets_the_title_then_the_live_ones_once(tmp_path: Path) -> None:
    async with kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice", text="name me")
        await proc.wait_idle()
        await until_logged(k, "alice", 2)  # its run's end, then its title

        backlog = [i async for i in k.account_signals("alice", after_seq=1, follow=False)]
        assert [(i.seq, i.pid, i.signal.signal, i.signal.payload["title"]) for i in backlog] == [
            (2, proc.pid, sig.CHANGED, "name me")
        ]
        assert backlog[0].signal.seq is not None  # (its seq in the process's log)

        stream = k.account_signals("alice", after_seq=1)
        [replayed] = await take(stream, 1)
        assert replayed == backlog[0]
        await proc.set_title("By hand")
        [live] = await take(stream, 1)
        assert (live.seq, live.signal.payload["title"]) == (3, "By hand")
        await proc.set_title("Again")
        [again] = await take(stream, 1)
        assert again.seq == 4  # (nothing repeated between)
        await stream.aclose()


async def test_the_process_stream_shows_a_title_change_once(tmp_path: Path) -> None:
    async with kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice")
        seen: list[Signal] = []

        async def follow() -> None:
            async for s in proc.signals(follow=True):
                seen.append(s)

        following = asyncio.ensure_future(follow())
        await asyncio.sleep(0.05)
        await proc.send("once only")
        await proc.wait_idle()
        await titled(proc)
        await proc.set_title("By hand")
        await asyncio.sleep(0.2)  # (time for a duplicate to arrive)
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        changes = [s for s in seen if title_change(s)]
        assert [s.payload["title"] for s in changes] == ["once only", "By hand"]
        assert all(s.seq is not None for s in changes)
        assert len({s.seq for s in seen if s.seq is not None}) == len([s for s in seen if s.seq is not None])


async def test_a_watcher_on_the_other_worker_sees_the_title(pg_url: str, tmp_path: Path) -> None:
    """A process held by worker A: its automatic title (made on A) and a person's title set
    through B (forwarded to the store as B's own transaction) reach the account watchers of both,
    each once with the same account seq; and B resumes from the log with them."""
    pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")
    from tests.test_scale_out import kept_by, two

    async with two(pg_url, tmp_path, ScriptedModel(answer), []) as (a, b):
        pa = await a.spawn(owner="alice")
        await kept_by(a, pa.pid)
        pb = await b.process(pa.pid)
        on_a, on_b = a.account_signals("alice"), b.account_signals("alice")
        first_a, first_b = asyncio.ensure_future(take(on_a, 2)), asyncio.ensure_future(take(on_b, 2))
        await asyncio.sleep(0.1)  # (both watching)
        await pa.send("a title from worker A")  # runs on A, titled on A
        got_a, got_b = await first_a, await first_b
        assert got_a == got_b
        assert [(i.seq, i.signal.signal) for i in got_b] == [(1, sig.RUN_FINISHED), (2, sig.CHANGED)]
        assert got_b[1].signal.payload == {"pid": pa.pid, "changes": ["title"], "title": "a title from worker A"}

        await pb.set_title("Set through B")  # B does not hold it: the holder is told in the commit
        [told_a], [told_b] = await take(on_a, 1), await take(on_b, 1)
        assert told_a == told_b and told_a.seq == 3
        assert told_a.signal.payload["title"] == "Set through B"
        assert await pa.title() == "Set through B"

        resumed = [i async for i in b.account_signals("alice", after_seq=1, follow=False)]
        assert [(i.seq, i.signal.payload["title"]) for i in resumed] == [
            (2, "a title from worker A"),
            (3, "Set through B"),
        ]
        # the holder's process stream has each once
        titles = [s.payload["title"] for s in await anext_all(pa) if title_change(s)]
        assert titles == ["a title from worker A", "Set through B"]
        await on_a.aclose()
        await on_b.aclose()
