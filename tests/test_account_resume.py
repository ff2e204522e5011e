"""The account stream resumes like a process stream: every account-level signal a step logs gets
an account seq (per owner, gapless, in commit order) in the account log, and a watcher resumes
after the last one it saw (``Kernel.account_signals(owner, after_seq)``, ``Last-Event-ID`` on
``GET /v1/events``, ``account.subscribe {after_seq}``, the client's ``account_events``), with
nothing missed or repeated at the seam; on two workers, a lost notification is read from the log.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop import ScriptedModel
from agentloop.client import AccountEvent, AgentloopClient, ClientError
from agentloop.kernel import AccountSignal, Kernel, Process
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from tests import server_support
from tests.server_support import LiveServer, live_server, wait_until
from tests.test_server_api import read_frames
from tests.ws_support import KernelServer, eventually


def answer(req: ModelRequest) -> str:
    return "ok"


@asynccontextmanager
async def kernel(tmp_path: Path) -> AsyncIterator[Kernel]:
    async with Kernel.open(f"sqlite:///{tmp_path}/agentloop.db", model=ScriptedModel(answer), workspace=tmp_path) as k:
        yield k


async def finish(proc: Process, text: str = "hi") -> str:
    """One run of ``proc`` to its end (one account signal: its ``proc.run.finished``); its id."""
    receipt = await proc.send(text)
    await proc.wait_idle()
    return receipt.run_id


def runs(items: list[AccountSignal]) -> list[tuple[int | None, str | None]]:
    return [(i.seq, i.signal.payload.get("runId")) for i in items]


async def take(stream: AsyncIterator[AccountSignal], n: int) -> list[AccountSignal]:
    """The next ``n`` logged items (new titles, live only, are left out)."""
    got: list[AccountSignal] = []
    async with asyncio.timeout(5):
        while len(got) < n:
            item = await anext(stream)
            if item.seq is not None:
                got.append(item)
    return got


# ------------------------------------------------------------------ the kernel


async def test_a_resume_gets_exactly_the_signals_after_its_seq_then_live_ones(tmp_path: Path) -> None:
    async with kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice")
        ran = [await finish(proc) for _ in range(4)]
        assert await k.account_seq("alice") == 4 and await k.account_seq("bob") == 0

        stream = k.account_signals("alice", after_seq=2)
        backlog = await take(stream, 2)
        assert runs(backlog) == [(3, ran[2]), (4, ran[3])]
        assert {(i.pid, i.signal.signal) for i in backlog} == {(proc.pid, sig.RUN_FINISHED)}
        assert backlog[0].signal.seq is not None  # (its seq in the process's own log)
        live = asyncio.ensure_future(take(stream, 1))
        ran.append(await finish(proc))
        assert runs(await live) == [(5, ran[4])]
        await stream.aclose()
        assert k.engine.hub._accounts == {}

        # without follow: the backlog only; past the end: counted from the end
        backlog_only = [i async for i in k.account_signals("alice", after_seq=3, follow=False)]
        assert runs(backlog_only) == [*runs(backlog)[1:], (5, ran[4])]
        assert [i async for i in k.account_signals("alice", after_seq=99, follow=False)] == []
        with pytest.raises(ValueError):
            await anext(k.account_signals("alice", after_seq=-1))


@pytest.mark.parametrize("commit", ["before the page is read", "after the page is read"])
async def test_no_gap_and_no_repeat_at_the_seam(tmp_path: Path, commit: str) -> None:
    """A run ends while the resume reads the log: its signal is in the page or comes live (or
    both), and the stream has it once, in order."""
    async with kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice")
        ran = [await finish(proc) for _ in range(3)]
        real = k.store.account_events
        raced: list[str] = []

        async def racing(owner: str, after_seq: int = 0, limit: int = 1000) -> Any:
            if not raced and commit.startswith("before"):
                raced.append(await finish(proc))
            rows = await real(owner, after_seq, limit)
            if not raced:
                raced.append(await finish(proc))
            return rows

        k.store.account_events = racing  # type: ignore[method-assign]
        stream = k.account_signals("alice", after_seq=1)
        got = await take(stream, 3)
        later = asyncio.ensure_future(take(stream, 1))
        last = await finish(proc)
        got += await later
        await stream.aclose()
        assert runs(got) == [(2, ran[1]), (3, ran[2]), (4, raced[0]), (5, last)]


async def test_a_resume_before_the_kept_log_is_told_what_it_missed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sig, "KEPT_ACCOUNT_SIGNALS", 3)
    monkeypatch.setattr(sig, "ACCOUNT_PRUNE_EVERY", 2)
    async with kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice")
        for _ in range(6):
            await finish(proc)
        assert [r.seq for r in await k.store.account_events("alice")] == [4, 5, 6]  # pruned at 6: through 3
        await proc.kill()  # a kill drops the process's log, not the account's
        got = [i async for i in k.account_signals("alice", after_seq=1, follow=False)]
        assert got[0] == AccountSignal(
            None, sig.Signal(sig.ACCOUNT_LOG_PRUNED, {"afterSeq": 1, "oldestSeq": 4, "missed": 2})
        )
        assert [i.seq for i in got[1:]] == [4, 5, 6]
        assert [i.seq async for i in k.account_signals("alice", after_seq=3, follow=False)] == [4, 5, 6]


async def test_a_reader_ended_for_falling_behind_resumes_from_its_last_seq(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sig, "BACKLOG", 2)
    async with kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice")
        await finish(proc)
        stream = k.account_signals("alice", after_seq=0)
        [first] = await take(stream, 1)
        ran = [await finish(proc) for _ in range(3)]  # nobody reads: the watcher's queue overflows
        assert [i async for i in stream] == []  # ended
        resumed = [i async for i in k.account_signals("alice", after_seq=first.seq, follow=False)]
        assert runs(resumed) == [(2, ran[0]), (3, ran[1]), (4, ran[2])]


# ------------------------------------------------------------------ two workers, one PostgreSQL


async def test_a_lost_notification_is_read_from_the_account_log(pg_url: str, tmp_path: Path) -> None:
    pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")
    from tests.test_scale_out import kept_by, two

    async with two(pg_url, tmp_path, ScriptedModel(answer), []) as (a, b):
        proc = await a.spawn(owner="alice")
        await kept_by(a, proc.pid)  # every run on A: B hears of them by notification only
        leases = b.engine.leases
        assert leases is not None
        heard = leases.accounted
        dropped: list[int] = []

        def lossy(owner: str, pid: str, items: list[Any]) -> None:
            if owner == "alice" and items[0][0] in (2, 4):  # lost: the listener reconnecting, say
                dropped.append(items[0][0])
                return
            heard(owner, pid, items)

        leases.accounted = lossy  # type: ignore[method-assign]
        on_a, on_b = a.account_signals("alice"), b.account_signals("alice")
        seen_a = asyncio.ensure_future(take(on_a, 4))
        seen_b = asyncio.ensure_future(take(on_b, 4))
        await asyncio.sleep(0.1)  # (both watching)
        ran = [await finish(proc) for _ in range(4)]
        # 2 is found missing when 3 comes; 4, the last, by B's poll of the account log
        assert runs(await asyncio.wait_for(seen_b, 10)) == [(n, r) for n, r in enumerate(ran, 1)]
        assert runs(await seen_a) == runs(await seen_b) and dropped == [2, 4]
        await on_a.aclose()
        await on_b.aclose()


# ------------------------------------------------------------------ the server and the client


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("resume")) as srv:
        yield srv


alice = server_support.alice


async def spawn_and_finish(client: httpx.AsyncClient, *texts: str) -> str:
    pid: str = (await client.post("/v1/processes", json={})).json()["pid"]
    for text in texts:
        assert (await client.post(f"/v1/processes/{pid}/messages", json={"text": text})).status_code == 202
        await wait_until(lambda: idle(client, pid))
    return pid


async def idle(client: httpx.AsyncClient, pid: str) -> bool:
    return (await client.get(f"/v1/processes/{pid}")).json()["state"] == "idle"


async def account_frames(frames: AsyncIterator[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The next ``n`` frames that carry data (the opening id-only frame and pings are skipped)."""
    got: list[dict[str, Any]] = []
    async with asyncio.timeout(10):
        async for frame in frames:
            if "data" in frame:
                got.append(frame)
                if len(got) == n:
                    break
    return got


async def test_sse_frames_carry_the_account_seq_and_last_event_id_resumes(
    server: LiveServer, alice: httpx.AsyncClient
) -> None:
    assert server.ctx is not None
    kernel = server.ctx.kernel
    async with alice.stream("GET", "/v1/events") as resp:
        reading = read_frames(resp)
        opening = await anext(reading)
        start = int(opening["id"])
        assert set(opening) == {"id"} and start == await server.run(lambda: kernel.account_seq("alice"))
        pid = await spawn_and_finish(alice, "one", "two")
        frames = await account_frames(reading, 2)
    assert [int(f["id"]) for f in frames] == [start + 1, start + 2]
    assert [(f["event"], f["data"]["pid"]) for f in frames] == [(sig.RUN_FINISHED, pid)] * 2

    await spawn_and_finish(alice, "three")  # while nobody watches
    headers = {"Last-Event-ID": str(start + 1)}
    async with alice.stream("GET", "/v1/events", headers=headers, params={"after_seq": 0}) as resp:
        resumed = await account_frames(read_frames(resp), 2)  # the header wins over after_seq
        assert [int(f["id"]) for f in resumed] == [start + 2, start + 3]
        assert resumed[0]["data"] == frames[1]["data"]

    backlog = (await alice.get("/v1/events", params={"after_seq": start, "follow": "false"})).text
    assert [line for line in backlog.splitlines() if line.startswith("id:")] == [f"id: {start + n}" for n in (1, 2, 3)]
    bad = await alice.get("/v1/events", headers={"Last-Event-ID": "x"})
    assert bad.status_code == 400


async def test_a_pruned_resume_point_is_said_over_sse(server: LiveServer, alice: httpx.AsyncClient) -> None:
    assert server.ctx is not None
    store = server.ctx.kernel.store
    await spawn_and_finish(alice, "a", "b", "c")
    newest = await server.run(lambda: store.last_account_seq("alice"))

    async def prune() -> None:
        async with store.transaction():
            await store.prune_account_events("alice", through=newest - 1)

    await server.run(prune)
    text = (await alice.get("/v1/events", params={"after_seq": 1, "follow": "false"})).text
    assert "event: account.log.pruned" in text and f'"oldestSeq": {newest}' in text
    assert text.index("account.log.pruned") < text.index(f"id: {newest}")


async def test_the_client_resumes_the_account_stream_from_its_last_id(
    server: LiveServer, alice: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dropped connection is reopened with the last account seq: what ended meanwhile comes."""
    opened: list[str | None] = []
    real = AgentloopClient._frames

    def cut_once(self: Any, path: str, params: Any, headers: dict[str, str], connected: Any) -> Any:
        opened.append(headers.get("Last-Event-ID"))
        frames = real(self, path, params, headers, connected)

        async def cut() -> AsyncIterator[Any]:  # the first connection drops after its first event
            async with aclosing(frames):
                async for frame in frames:
                    yield frame
                    if frame[1]:
                        raise ClientError(0, "unreachable", "the connection dropped")

        return cut() if len(opened) == 1 else frames

    monkeypatch.setattr(AgentloopClient, "_frames", cut_once)
    async with AgentloopClient(server.url, server.tokens.alice) as client:
        connected = asyncio.Event()
        stream = client.account_events(connected=connected)
        first = asyncio.ensure_future(anext(stream))
        await connected.wait()
        pid = await spawn_and_finish(alice, "one")
        event: AccountEvent = await asyncio.wait_for(first, 10)
        assert (event.pid, event.signal) == (pid, sig.RUN_FINISHED) and event.id is not None
        other = await spawn_and_finish(alice, "two")  # sent on the connection that drops
        async with asyncio.timeout(10):
            after = await anext(stream)
        await stream.aclose()
    assert opened[0] is None and opened[1] == str(event.id)
    assert after.id == event.id + 1 and (after.pid, after.signal) == (other, sig.RUN_FINISHED)


def test_the_websocket_account_subscription_resumes_after_a_seq(tmp_path: Path) -> None:
    with KernelServer(tmp_path, ScriptedModel(answer)) as server:
        assert server.ctx is not None
        kernel = server.ctx.kernel
        with server.client("alice") as c:
            pid = c.ok("proc.spawn")["pid"]
            for text in ("one", "two", "three"):
                c.ok("proc.send", {"pid": pid, "text": text})
                eventually(lambda: c.ok("proc.get", {"pid": pid})["state"] == "idle")
            assert server.run(lambda: kernel.account_seq("alice")) == 3
            assert c.ok("account.subscribe", {"after_seq": 1}) == {"account": "alice", "after_seq": 1}
            got: list[dict[str, Any]] = []
            while len(got) < 2:
                got += c.signals_until(pid, sig.RUN_FINISHED)
            assert [s["id"] for s in got] == [2, 3]
            assert all(s["signal"] == sig.RUN_FINISHED and isinstance(s["seq"], int) for s in got)
            assert c.ok("account.unsubscribe")["unsubscribed"] is True
            assert c.ok("account.subscribe") == {"account": "alice", "after_seq": 3}  # from now on
            assert c.error("account.subscribe", {"after_seq": -1}) == "invalid_request"
