"""Devices with two servers (workers) on one PostgreSQL store, as a load balancer spreads clients
over them: a device is connected to one worker, while its owner follows the account stream, and
revokes or forgets it, through the other. Its ``device.status`` reaches the account stream on both
(each once), and a revoke, a replaced token or a forget through the other worker closes its
connection at once: the heartbeat here is a minute long, so only the notification of the
transaction that did it can explain a close within seconds."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")

import websockets

from agentloop.client import AgentloopClient
from agentloop.device.client import websocket_url
from agentloop.process.store import RelayBatch, open_store
from agentloop.server.devices import DeviceHub
from tests.server_support import Tokens
from tests.test_server_workers8 import Worker

if TYPE_CHECKING:  # (imported where used below, so that each test here fails on its own without it)
    from agentloop.process.store.base import DeviceNews

# (pg_url comes from tests/conftest.py, which starts a throwaway PostgreSQL server)

HEARTBEAT = 60.0  # far longer than any wait below: the heartbeat's token check never closes anything here
WAIT = 10.0  # generous: a loaded machine must not flake


def _worker(data: Path, store_url: str, name: str, tokens: Tokens) -> Worker:
    data.mkdir()
    options = {"worker": name, "lease_ttl": 2.0, "poll_interval": 0.2, "data_dir": data}
    hub = DeviceHub(probe_timeout=0.5, account_tokens=True)  # (the forget test connects with an account token)
    return Worker(
        data, heartbeat=HEARTBEAT, store_url=store_url, kernel_options=options, name=name, shared=tokens, devices=hub
    )


@pytest.fixture
def workers(pg_url: str, tmp_path: Path) -> Iterator[tuple[Worker, Worker]]:
    tokens = Tokens()
    a = _worker(tmp_path / "a", pg_url, "A", tokens)
    a.start()
    try:
        b = _worker(tmp_path / "b", pg_url, "B", tokens)
        b.start()
        try:
            yield a, b
        finally:
            b.stop()
    finally:
        a.stop()


async def _until(check: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(WAIT):
        while not check():
            await asyncio.sleep(0.02)
    assert check(), what


async def _connect_device(worker: Worker, token: str, name: str) -> Any:
    """A driver connected through ``worker`` (its sys.connect accepted)."""
    ws = await websockets.connect(websocket_url(worker.url))
    args = {"role": "driver", "token": token, "name": name, "implements": ["fs.read"]}
    await ws.send(json.dumps({"type": "req", "id": "c1", "call": "sys.connect", "args": args}))
    res = json.loads(await asyncio.wait_for(ws.recv(), WAIT))
    assert res["ok"] is True, res
    return ws


async def _closed_with(ws: Any) -> tuple[int | None, str | None]:
    """How the server closed ``ws``; ``TimeoutError`` if it did not within ``WAIT``."""
    async with asyncio.timeout(WAIT):
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                await ws.recv()
    return ws.close_code, ws.close_reason


def _online(worker: Worker, name: str) -> bool:
    hub = worker.devices
    assert isinstance(hub, DeviceHub)
    return any(d.id == name for d in hub.online("alice"))


class _WsFollower:
    """The account stream over the WebSocket (``account.subscribe``): its ``device.status``."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.heard: list[tuple[str, str]] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        ws = await websockets.connect(websocket_url(self.worker.url))
        connect = {"type": "req", "id": "u1", "call": "sys.connect", "args": {"token": self.worker.tokens.alice}}
        await ws.send(json.dumps(connect))
        assert json.loads(await asyncio.wait_for(ws.recv(), WAIT))["ok"] is True
        await ws.send(json.dumps({"type": "req", "id": "u2", "call": "account.subscribe", "args": {}}))
        assert json.loads(await asyncio.wait_for(ws.recv(), WAIT))["ok"] is True
        self._task = asyncio.create_task(self._read(ws))

    async def _read(self, ws: Any) -> None:
        try:
            async for text in ws:
                frame = json.loads(text)
                if frame.get("type") == "sig" and frame.get("signal") == "device.status":
                    self.heard.append((frame["payload"]["device"], frame["payload"]["status"]))
        finally:
            await ws.close()

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def _watched(worker: Worker) -> None:
    """Wait until ``worker``'s kernel watches alice's account stream (its follower is in place)."""
    assert worker.ctx is not None
    hub = worker.ctx.kernel.engine.hub
    await _until(lambda: hub.watches_account("alice"), f"an account watcher on {worker.name}")


async def test_a_follower_on_the_other_worker_hears_device_status_and_one_on_its_own_hears_it_once(
    workers: tuple[Worker, Worker],
) -> None:
    a, b = workers
    on_b: list[tuple[str, str, float]] = []
    async with AgentloopClient(b.url, a.tokens.alice) as client:  # B's event stream (SSE)
        token = (await client.device_token("laptop"))["token"]
        connected = asyncio.Event()

        async def listen() -> None:
            async for event in client.account_events(connected=connected):
                if event.signal == "device.status":
                    on_b.append((event.payload["device"], event.payload["status"], event.payload["timestamp"]))

        listening = asyncio.create_task(listen())
        on_a = _WsFollower(a)
        try:
            await asyncio.wait_for(connected.wait(), WAIT)
            await on_a.start()
            await _watched(a)
            await _watched(b)
            ws = await _connect_device(a, token, "laptop")
            await _until(lambda: [(d, s) for d, s, _ in on_b] == [("laptop", "online")], "online heard on B")
            await ws.close()
            await _until(lambda: len(on_b) == 2, "offline heard on B")
            await _until(lambda: len(on_a.heard) == 2, "offline heard on A")
            await asyncio.sleep(0.5)  # (time for a duplicate to arrive)
        finally:
            listening.cancel()
            await asyncio.gather(listening, return_exceptions=True)
            await on_a.stop()
    assert [(d, s) for d, s, _ in on_b] == [("laptop", "online"), ("laptop", "offline")]
    assert on_b[0][2] <= on_b[1][2]  # (the timestamps of the changes, as A told them)
    assert on_a.heard == [("laptop", "online"), ("laptop", "offline")]  # each once: A told its own only


async def test_revoking_the_token_through_the_other_worker_closes_the_connection_at_once(
    workers: tuple[Worker, Worker],
) -> None:
    a, b = workers
    async with b.client(b.tokens.alice) as http:
        issued = await http.post("/v1/devices/laptop/token")
        assert issued.status_code == 200, issued.text
        ws = await _connect_device(a, issued.json()["token"], "laptop")
        assert _online(a, "laptop")
        revoked = await http.delete("/v1/devices/laptop/token")
        assert revoked.status_code == 200, revoked.text
        assert await _closed_with(ws) == (4401, "the token was revoked")
        await _until(lambda: not _online(a, "laptop"), "the device gone from A's hub")


async def test_a_token_issued_in_its_place_through_the_other_worker_closes_the_old_ones_connection(
    workers: tuple[Worker, Worker],
) -> None:
    a, b = workers
    async with b.client(b.tokens.alice) as http:
        first = (await http.post("/v1/devices/laptop/token")).json()["token"]
        ws = await _connect_device(a, first, "laptop")
        replaced = await http.post("/v1/devices/laptop/token")
        assert replaced.status_code == 200, replaced.text
        assert await _closed_with(ws) == (4401, "the token was revoked")
        again = await _connect_device(a, replaced.json()["token"], "laptop")  # the new one connects
        other = await http.post("/v1/devices/phone/token")  # another device's token closes nothing
        assert other.status_code == 200
        await asyncio.sleep(0.5)
        assert _online(a, "laptop")
        await again.close()


async def test_forgetting_through_the_other_worker_closes_a_device_connected_with_an_account_token(
    workers: tuple[Worker, Worker],
) -> None:
    a, b = workers
    ws = await _connect_device(a, a.tokens.alice, "laptop")
    async with b.client(b.tokens.alice) as http:

        async def listed() -> list[str]:
            return [d["id"] for d in (await http.get("/v1/devices")).json()["devices"]]

        async with asyncio.timeout(WAIT):  # (registered as it connected, in the background of its connect)
            while await listed() != ["laptop"]:
                await asyncio.sleep(0.05)
        forgotten = await http.delete("/v1/devices/laptop")
        assert forgotten.status_code == 200, forgotten.text
        assert await _closed_with(ws) == (4401, "the device was forgotten")
        await _until(lambda: not _online(a, "laptop"), "the device gone from A's hub")
        await asyncio.sleep(0.3)  # (its leave, written down on A, must not bring it back)
        assert await listed() == []


class _Heard:
    """A worker's live listener, as far as device events go."""

    def __init__(self) -> None:
        self.news: list[DeviceNews] = []

    def relayed(self, sender: str, batches: list[RelayBatch]) -> None:
        pass

    def followed(self, sender: str, pids: list[str]) -> None:
        pass

    def deviced(self, news: DeviceNews) -> None:
        self.news.append(news)


async def test_a_device_event_reaches_the_other_workers_when_its_transaction_commits_only(pg_url: str) -> None:
    """The store's part: told in a transaction, heard by the other stores' listeners at its commit,
    never for a rollback, nor by the store that sent it (its worker acted on it already)."""
    from agentloop.process.store.base import DeviceNews

    here, there = open_store(pg_url), open_store(pg_url)
    await here.open()
    await there.open()
    heard_here, heard_there = _Heard(), _Heard()
    stops = [await here.listen(lambda pid, sender: None, heard_here)]
    stops.append(await there.listen(lambda pid, sender: None, heard_there))
    try:
        with contextlib.suppress(RuntimeError):
            async with here.transaction():
                await here.notify_device(DeviceNews("alice", "laptop", "forgotten"))
                raise RuntimeError("rolled back")
        status = {"device": "laptop", "status": "online", "timestamp": 1.5}
        async with here.transaction():
            await here.notify_device(DeviceNews("alice", "laptop", "status", status))
            await asyncio.sleep(0.2)
            assert heard_there.news == []  # (not before the commit)
        await _until(lambda: bool(heard_there.news), "the committed event heard")
        await asyncio.sleep(0.3)  # (time for the rolled back one, or a duplicate, to arrive)
        assert heard_there.news == [DeviceNews("alice", "laptop", "status", status)]
        assert heard_here.news == []
    finally:
        for stop in stops:
            if stop is not None:
                await stop()
        await here.close()
        await there.close()
