"""The HTTP, SSE and WebSocket API of two servers on one PostgreSQL database (DESIGN §5, §6), as a
load balancer spreads clients over them: a stream followed through the worker that runs the
process gets every logged signal, the ones the other worker logged for it included."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")

import websockets

from agentloop.server.auth import Accounts
from tests.server_support import LiveServer, Tokens
from tests.test_scale_out import kept_by

# (pg_url comes from tests/conftest.py, as for tests/test_scale_out.py)


@dataclass
class Worker(LiveServer):
    """A live server on a shared PostgreSQL store; the first of them creates the accounts."""

    name: str = "A"
    shared: Tokens | None = None

    async def make_accounts(self, accounts: Accounts) -> None:
        assert self.shared is not None
        if not self.shared.alice:
            await accounts.create_account("alice")
            self.shared.alice, _ = await accounts.create_token("alice")
        self.tokens = self.shared


def worker(data: Path, store_url: str, name: str, tokens: Tokens) -> Worker:
    options = {"worker": name, "lease_ttl": 2.0, "poll_interval": 0.2, "data_dir": data}
    return Worker(data, heartbeat=1.0, store_url=store_url, kernel_options=options, name=name, shared=tokens)


@pytest.fixture
def workers(pg_url: str, tmp_path: Path) -> Iterator[tuple[Worker, Worker]]:
    tokens = Tokens()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = worker(tmp_path / "a", pg_url, "A", tokens).start()
    try:
        b = worker(tmp_path / "b", pg_url, "B", tokens).start()
        try:
            yield a, b
        finally:
            b.stop()
    finally:
        a.stop()


async def sse_until(client: httpx.AsyncClient, path: str, last: str, started: asyncio.Event) -> list[dict[str, str]]:
    """The frames of an event stream, up to the first of event ``last``."""
    frames: list[dict[str, str]] = []
    async with client.stream("GET", path, timeout=15) as resp:
        assert resp.status_code == 200
        started.set()
        frame: dict[str, str] = {}
        async for line in resp.aiter_lines():
            if line.startswith(":"):
                continue
            if line:
                key, _, value = line.partition(": ")
                frame[key] = value
                continue
            if frame:
                frames.append(frame)
                if frame.get("event") == last:
                    return frames
            frame = {}
    return frames


async def test_a_stream_on_the_holder_has_the_signals_the_other_worker_logged(workers: tuple[Worker, Worker]) -> None:
    """A message sent through B for a process A runs is logged by B (its queue change); an approval
    decided through B too. A's SSE and WebSocket followers got neither: a seq missing from a
    stream that promises every logged one, in order, once."""
    a, b = workers
    token = a.tokens.alice
    async with a.client(token) as ca, b.client(token) as cb:
        pid = (await ca.post("/v1/processes", json={})).json()["pid"]
        await a.run(lambda: kept_by(a.ctx.kernel, pid))  # type: ignore[union-attr]
        async with websockets.connect(a.url.replace("http", "ws") + "/v1/ws") as ws:
            await ws.send(json.dumps({"type": "req", "id": "1", "call": "sys.connect", "args": {"token": token}}))
            assert json.loads(await ws.recv())["ok"]
            await ws.send(json.dumps({"type": "req", "id": "2", "call": "proc.subscribe", "args": {"pid": pid}}))
            assert json.loads(await ws.recv())["ok"]
            started = asyncio.Event()
            path = f"/v1/processes/{pid}/events"
            stream = asyncio.create_task(sse_until(ca, path, "proc.run.finished", started))
            await asyncio.wait_for(started.wait(), 5)
            assert (await cb.post(f"/v1/processes/{pid}/messages", json={"text": "risky"})).status_code == 202
            while not (asked := (await cb.get(f"/v1/processes/{pid}/hil")).json()["requests"]):
                await asyncio.sleep(0.05)
            decided = await cb.post(f"/v1/processes/{pid}/hil/{asked[0]['request_id']}", json={"decision": "approve"})
            assert decided.status_code == 200
            frames = await asyncio.wait_for(stream, 15)
            seqs = [int(f["id"]) for f in frames if "id" in f]
            assert seqs == list(range(1, seqs[-1] + 1))
            ws_seqs: list[int] = []
            while not ws_seqs or ws_seqs[-1] < seqs[-1]:
                sent = json.loads(await asyncio.wait_for(ws.recv(), 10))
                if sent["type"] == "sig" and sent.get("seq") is not None:
                    ws_seqs.append(sent["seq"])
            assert ws_seqs == seqs
        payloads = [json.loads(f["data"])["payload"] for f in frames if f["event"] == "proc.run.stream"]
        text = "".join(p["delta"] for p in payloads if p["event"] == "text_delta")
        assert text == "done: risky"  # the answer's deltas, relayed
