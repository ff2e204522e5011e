"""Review of the server's streams and access control: the WebSocket's bounds on what a client
that does not read can make the server hold, the SSE stream's hold on a client that does not
read, revocation checks that survive a store hiccup, and input rate limits on every route that
runs the model."""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.websockets import WebSocket

from agentloop import ScriptedModel
from agentloop.server import events, ws
from agentloop.server.auth import Accounts, Principal
from agentloop.server.errors import ApiError
from agentloop.server.ratelimit import InputRate
from tests.server_support import live_server, wait_until
from tests.ws_support import KernelServer, closed_code, eventually


@pytest.fixture
def server(tmp_path: Path) -> Iterator[KernelServer]:
    with KernelServer(tmp_path, ScriptedModel(["reply"])) as s:
        yield s


# ------------------------------------------------------------------ WebSocket: a client that does not read


def test_answers_waiting_to_be_sent_count_against_the_in_flight_limit(
    server: KernelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that sends requests but does not read their answers: each finished request waits,
    with its answer in memory, for the socket. Those answers must count against MAX_IN_FLIGHT, or
    a client can make the server hold any number of them (MAX_IN_FLIGHT bounds nothing)."""
    monkeypatch.setattr(ws, "MAX_IN_FLIGHT", 4)
    monkeypatch.setattr(ws, "SEND_TIMEOUT", 3.0)
    original = WebSocket.send_text

    async def stuck(self: WebSocket, data: str) -> None:
        if "stuck-here" in data:  # the client's buffers are full: this frame cannot leave
            await asyncio.sleep(30)
        await original(self, data)

    monkeypatch.setattr(WebSocket, "send_text", stuck)
    with server.client("alice") as c:
        c.request("proc.get", {"pid": "stuck-here"})
        time.sleep(0.2)  # answered: its frame now holds the send lock
        for _ in range(20):
            c.request("proc.list")
            time.sleep(0.02)  # each one done before the next: never more than one running
        assert server.ws_tasks("_run") <= ws.MAX_IN_FLIGHT
        assert closed_code(c) == ws.CLOSE_POLICY
    eventually(lambda: server.ws_tasks() == 0)


# ------------------------------------------------------------------ SSE: a client that does not read


async def test_an_event_stream_whose_client_stops_reading_is_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SSE client whose buffers are full (it stopped reading, or its network did) must not hold
    its stream, its tasks and its watcher on the process for ever: like the WebSocket, a frame
    that cannot leave in time ends the stream, quietly (a warning, not a failed request)."""
    monkeypatch.setattr(events, "SEND_TIMEOUT", 0.2, raising=False)
    with live_server(tmp_path, heartbeat=0.02) as server:
        async with server.client(server.tokens.alice) as alice:
            pid = (await alice.post("/v1/processes", json={})).json()["pid"]
        assert server.ctx is not None
        ctx = server.ctx

        async def serve_one_that_never_reads() -> list[str]:
            who = await ctx.accounts.authenticate(server.tokens.alice)
            assert who is not None
            response = await events.open_stream(ctx, who, pid, after_seq=0, follow=True)
            sent: list[str] = []
            forever = asyncio.Event()

            async def send(message: Any) -> None:
                if message["type"] == "http.response.body" and message.get("body") and "body" in sent:
                    await forever.wait()  # the first ping left; now the client's buffers are full
                sent.append(message["type"].rsplit(".", 1)[-1])

            async def receive() -> Any:
                await forever.wait()  # the client never hangs up either

            scope = {"type": "http", "method": "GET", "headers": []}
            async with asyncio.timeout(5):
                await response(scope, receive, send)
            return sent

        assert await server.run(serve_one_that_never_reads) == ["start", "body"]
        await wait_until(lambda: server.watchers(pid) == 0)


# ------------------------------------------------------------------ revocation


def test_a_failed_revocation_check_does_not_stop_the_checks(
    server: KernelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store failing once (a lost database connection, a locked SQLite file) while a socket's
    token is checked must not end the checks: a token revoked afterwards still closes the socket."""
    assert server.ctx is not None
    ctx = server.ctx
    ctx.heartbeat = 0.05
    token, record = server.run(lambda: ctx.accounts.create_token("alice", label="laptop"))
    original = Accounts.still_valid
    failures = [RuntimeError("database is locked")]

    async def flaky(self: Accounts, who: Principal) -> bool:
        if failures:
            raise failures.pop()
        valid: bool = await original(self, who)
        return valid

    monkeypatch.setattr(Accounts, "still_valid", flaky)
    with server.client() as c:
        assert c.ok("sys.connect", {"role": "user", "token": token})["account"] == "alice"
        eventually(lambda: not failures)
        assert c.ok("proc.list") == {"processes": []}
        server.run(lambda: ctx.accounts.revoke(record.id))
        assert closed_code(c) == ws.CLOSE_UNAUTHORIZED


def test_no_request_runs_once_a_revoked_socket_is_closed(server: KernelServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the server has closed a socket for a revoked token, a frame the client sent before it
    saw the close (the reader was already waiting for it) must not run: that would be one more
    spawn, send or kill on a token that no longer opens anything."""
    assert server.ctx is not None
    ctx = server.ctx
    ctx.heartbeat = 0.05
    token, record = server.run(lambda: ctx.accounts.create_token("alice", label="laptop"))
    closes: list[int] = []
    original = WebSocket.close

    async def slow_close(self: WebSocket, code: int = 1000, reason: str | None = None) -> None:
        if code == ws.CLOSE_UNAUTHORIZED:  # the close frame is still on its way to the client
            closes.append(code)
            return
        await original(self, code, reason)

    monkeypatch.setattr(WebSocket, "close", slow_close)
    with server.client() as c, server.client("alice") as other:
        assert c.ok("sys.connect", {"role": "user", "token": token})["account"] == "alice"
        server.run(lambda: ctx.accounts.revoke(record.id))
        eventually(lambda: closes == [ws.CLOSE_UNAUTHORIZED])
        c.request("proc.spawn", {"context": "after revocation"})
        time.sleep(0.3)
        assert other.ok("proc.list") == {"processes": []}


# ------------------------------------------------------------------ input rate


async def test_engine_chat_counts_against_the_accounts_input_rate(tmp_path: Path) -> None:
    """``/engine/chat`` on ``agentloop serve`` runs a model on the server's keys for any account
    token, so it counts against the account's input rate like a message to a process does:
    otherwise the limit brakes nothing (a runaway script just calls the stateless route)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "metadata": {"correlation_id": "c1"}}
    with live_server(tmp_path) as server:
        assert server.ctx is not None
        server.ctx.max_inputs_per_minute = 2
        async with server.client(server.tokens.alice) as alice, server.client(server.tokens.admin) as admin:
            assert (await alice.post("/engine/chat", json=body)).status_code == 200
            pid = (await alice.post("/v1/processes", json={"text": "one"})).json()["pid"]
            refused = await alice.post("/engine/chat", json=body)
            assert refused.status_code == 429 and refused.json()["code"] == "rate_limited"
            assert 1 <= int(refused.headers["retry-after"]) <= 60
            sent = await alice.post(f"/v1/processes/{pid}/messages", json={"text": "two"})
            assert sent.status_code == 429  # one budget for both routes
            for _ in range(3):  # admins are not counted
                assert (await admin.post("/engine/chat", json=body)).status_code == 200


def test_a_limit_of_zero_refuses_every_input() -> None:
    """``max_inputs_per_minute=0`` (a ``ServerContext`` made in code: the CLI asks for at least 1)
    means no input at all: a 429 like any other, not an IndexError answered as a 500."""
    rate = InputRate()
    for _ in range(2):
        with pytest.raises(ApiError) as refused:
            rate.take("alice", 0)
        assert refused.value.status == 429 and refused.value.code == "rate_limited"
        assert refused.value.retry_after == 60
    rate.take("alice", 1)  # the refusals were not counted


# ------------------------------------------------------------------ WebSocket: frame sizes


def big_png(size: int) -> str:
    """A PNG header (its size readable) padded to ``size`` bytes, base64: an image as big as a photo."""
    header = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">IIBBBBB", 1, 1, 8, 6, 0, 0, 0)
    return base64.b64encode(header + b"\0" * (size - len(header))).decode()


def test_media_the_http_api_takes_is_taken_over_the_socket_too(server: KernelServer) -> None:
    """A 2 MB photo is a good ``POST /v1/processes`` body (up to ``max_media_body``); the same call
    over the socket must not be refused as a frame too large (``max_body``), while a frame that
    cannot carry media still may not be that large."""
    media = [{"data": big_png(2 * 1024 * 1024), "mime_type": "image/png"}]
    http_url = server.url.replace("ws://", "http://").removesuffix("/v1/ws")
    headers = {"Authorization": f"Bearer {server.tokens['alice']}"}
    over_http = httpx.post(f"{http_url}/v1/processes", json={"text": "look", "media": media}, headers=headers)
    assert over_http.status_code == 201, over_http.text
    with server.client("alice") as c:
        pid = c.ok("proc.spawn", {"text": "look", "media": media})["pid"]
        assert c.ok("proc.send", {"pid": pid, "text": "again", "media": media})["run_id"]
        res = c.call("proc.get", {"pid": pid, "pad": media[0]["data"]})
        assert res["error"]["code"] == "bad_frame" and "larger than" in res["error"]["message"]
        assert c.ok("proc.get", {"pid": pid})["pid"] == pid
        assert server.ctx is not None
        server.ctx.max_media_body = 2 * 1024 * 1024  # larger than both limits: refused unread
        c.request("proc.send", {"pid": pid, "text": "too big", "media": media})
        res = c.answer(None)
        assert res["error"] == {"code": "bad_frame", "message": f"frame larger than {2 * 1024 * 1024} bytes"}
