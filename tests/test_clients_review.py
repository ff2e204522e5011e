"""Review of the clients: the Python client (``agentloop.client``) against servers that answer
something unexpected (HTML, a redirect, JSON of the wrong shape, a refusal with ``Retry-After``),
and the device client (``agentloop.device``): secrets in what it says, an answer too large for the
server's frame limit, and the terminal closing under it (SIGHUP)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from agentloop import tool
from agentloop.client import (
    AgentloopClient,
    ClientError,
    Conflict,
    Forbidden,
    NotFound,
    RateLimited,
    Unauthorized,
)
from agentloop.device.client import DeviceClient, DeviceOptions
from tests.test_device_client import gone, kill_group, read_pid, world

Handler = Callable[[httpx.Request], httpx.Response]


def mocked(handler: Handler) -> AgentloopClient:
    return AgentloopClient("http://agentloop.test", "tok3n", transport=httpx.MockTransport(handler))


HTML = "<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1><hr>nginx</body></html>"


# ------------------------------------------------------------------ the Python client


async def test_a_stream_answered_with_a_web_page_is_an_error_not_an_endless_retry() -> None:
    """A URL that reaches some other web server (one answering every path with its index page)
    gave a 200 with no events: the stream 'ended', was reopened, forever, and the caller hung."""
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(200, headers={"Content-Type": "text/html"}, text="<html><body>hi</body></html>")

    async with mocked(handler) as client:
        for follow in (True, False):
            with pytest.raises(ClientError) as caught:
                async with asyncio.timeout(5):
                    async for _ in client.events("p1", follow=follow):
                        pass
            assert caught.value.code == "bad_response" and "event stream" in caught.value.message
    assert len(requests) == 2  # one each: not retried


async def test_a_redirect_is_said_not_followed_into_garbage() -> None:
    """An http→https redirect (a proxy's) answered ``bad_response: not JSON``, and the event
    stream, reading the redirect's empty body as a stream that ended, retried it forever."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(308, headers={"Location": "https://bob:hunter2@agentloop.test/v1/processes"})

    async with mocked(handler) as client:
        with pytest.raises(ClientError) as caught:
            await client.processes()
        assert caught.value.status == 308 and "redirect" in caught.value.message
        assert "https://bob:***@agentloop.test" in caught.value.message and "hunter2" not in caught.value.message
        with pytest.raises(ClientError) as caught:
            async with asyncio.timeout(5):
                async for _ in client.events("p1"):
                    pass
        assert caught.value.status == 308


async def test_an_html_error_page_is_said_in_one_clear_line() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, headers={"Content-Type": "text/html"}, text=HTML)

    async with mocked(handler) as client:
        with pytest.raises(ClientError) as caught:
            await client.processes()
    assert caught.value.status == 502 and caught.value.code == "http_error"
    assert "<" not in caught.value.message and "HTTP 502 Bad Gateway" in caught.value.message


async def test_json_of_the_wrong_shape_is_a_client_error() -> None:
    """A server answering ``[]`` or ``"ok"`` raised AttributeError from the client's own code."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=["not", "an", "object"])

    async with mocked(handler) as client:
        for call in (client.processes, client.devices, client.me, lambda: client.abort("p1")):
            with pytest.raises(ClientError) as caught:
                await call()
            assert caught.value.code == "bad_response"


@pytest.mark.parametrize(
    ("status", "code", "kind", "retry_after"),
    [
        (401, "unauthorized", Unauthorized, None),
        (403, "forbidden", Forbidden, None),
        (404, "not_found", NotFound, None),
        (409, "conflict", Conflict, 1.0),
        (429, "rate_limited", RateLimited, 7.0),
    ],
)
async def test_refusals_are_typed_and_keep_retry_after(
    status: int, code: str, kind: type[ClientError], retry_after: float | None
) -> None:
    """A 429 said when to retry (``Retry-After``) and the client dropped it: a caller could only
    guess, or hammer the server."""

    def handler(request: httpx.Request) -> httpx.Response:
        headers = {} if retry_after is None else {"Retry-After": f"{retry_after:g}"}
        return httpx.Response(status, headers=headers, json={"code": code, "message": "no"})

    async with mocked(handler) as client:
        with pytest.raises(kind) as caught:
            await client.send("p1", "hi")
    assert (caught.value.status, caught.value.code, caught.value.retry_after) == (status, code, retry_after)


async def test_the_event_stream_waits_as_long_as_retry_after_says() -> None:
    """A server (or its proxy) answering 503 with ``Retry-After: 1`` was asked again after 0.1 s."""
    times: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        times.append(time.monotonic())
        if len(times) == 1:
            return httpx.Response(503, headers={"Retry-After": "1"}, json={"code": "unavailable", "message": "x"})
        body = 'id: 1\nevent: proc.changed\ndata: {"seq": 1, "signal": "proc.changed", "payload": {}}\n\n'
        return httpx.Response(200, headers={"Content-Type": "text/event-stream"}, text=body)

    async with mocked(handler) as client:
        seen = [e async for e in client.events("p1", follow=False)]
    assert [e.seq for e in seen] == [1]
    assert times[1] - times[0] >= 0.95


# ------------------------------------------------------------------ the device client


class FakeSocket:
    """Answers the device's ``sys.connect`` with ``ok``."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send(self, text: str) -> None:
        self.sent.append(json.loads(text))

    async def recv(self) -> str:
        return json.dumps({"type": "res", "id": "connect", "ok": True, "data": {"account": "alice"}})


async def test_the_device_does_not_say_a_password_in_its_address(tmp_path) -> None:
    """``agentloop device connect ws://bob:hunter2@proxy…`` masked the address in its first line
    and then printed it whole in 'connected to …'."""
    said: list[str] = []
    options = DeviceOptions(url="ws://bob:hunter2@127.0.0.1:9/v1/ws", token="t0ken", name="box", root=tmp_path)
    client = DeviceClient(options, say=said.append)
    await client._handshake(FakeSocket())
    assert said and all("hunter2" not in line and "t0ken" not in line for line in said), said
    assert "bob:***@127.0.0.1:9" in said[0]


async def test_the_device_does_not_say_a_proxy_password(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad proxy setting made every reconnect line repeat the proxy's password."""
    for name in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY", "https_proxy", "HTTPS_PROXY", "socks_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ws_proxy", "http://bob:hunter2@proxy.invalid:3128/a-path")
    said: list[str] = []
    options = DeviceOptions(url="ws://127.0.0.1:9", token="t0ken", name="box", root=tmp_path, backoff_initial=0.01)
    running = asyncio.create_task(DeviceClient(options, say=said.append).run())
    try:
        async with asyncio.timeout(10):
            while not said:
                await asyncio.sleep(0.01)
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    assert "proxy" in said[0] and "hunter2" not in said[0], said


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")
async def test_an_answer_over_the_servers_frame_limit_fails_that_call_only(tmp_path) -> None:
    """A result larger than the server takes in one frame (uvicorn: 16 MiB) made the server close
    the socket: that call and every other one running on the device failed as 'disconnected', and
    the device reconnected. Now that call answers an error and the connection stays."""

    @tool
    def dump(megabytes: int) -> str:
        """Return a lot of text."""
        return "x" * (megabytes * 1024 * 1024)

    async with world(tmp_path) as w:
        options = DeviceOptions(
            url=w.server.url, token=w.token, name="box", root=w.device_root, tools=[dump], backoff_initial=0.05
        )
        client = DeviceClient(options, say=lambda text: None)
        running = asyncio.create_task(client.run())
        try:
            await w.online("box")
            big = await w.hub.call("alice", "box", "tool.dump", {"megabytes": 17}, 30)
            assert big.is_error and "too large" in big.content[0].text, big.content[0].text[:300]
            small = await w.hub.call("alice", "box", "tool.dump", {"megabytes": 1}, 30)
            assert not small.is_error and len(small.content[0].text) == 1024 * 1024
            assert client.connections == 1
        finally:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")
async def test_closing_the_terminal_stops_the_device_and_its_commands(tmp_path) -> None:
    """SIGHUP (the terminal running ``agentloop device connect`` closed) killed the device by the
    default action: the shell commands it was running, in their own sessions, were left orphaned."""
    async with world(tmp_path) as w:
        device = await w.spawn_device("box", "--allow", "shell")
        pid = 0
        try:
            await w.online("box")
            pending = asyncio.create_task(
                w.hub.call("alice", "box", "shell.exec", {"command": "echo $$ > shell.pid; exec sleep 30"}, 60)
            )
            pid = await read_pid(w.device_root / "shell.pid")
            device.send_signal(signal.SIGHUP)
            assert await asyncio.wait_for(device.wait(), 10) == 0, w.log("box")
            outcome = await asyncio.wait_for(pending, 5)
            assert outcome.is_error
            assert await gone(pid), "the device left its shell command running"
        finally:
            if pid:
                kill_group(pid)
            if device.returncode is None:
                device.kill()
                await device.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")
async def test_the_token_is_not_in_the_debug_log(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """With debug logging on (someone chasing a connection problem), websockets logged the
    handshake's headers, ``Authorization: Bearer <token>`` among them, and the frames sent."""
    caplog.set_level(logging.DEBUG)
    async with world(tmp_path) as w:
        options = DeviceOptions(url=w.server.url, token=w.token, name="box", root=w.device_root)
        client = DeviceClient(options, say=lambda text: None)
        running = asyncio.create_task(client.run())
        try:
            await w.online("box")
            read = await w.hub.call("alice", "box", "fs.read", {"path": "hello.txt"}, 10)
            assert not read.is_error
        finally:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "Authorization" in logged or "sys.connect" in logged  # what was logged, was
    assert w.token not in logged and w.token[:12] not in logged


class ScriptedSocket:
    """Feeds ``_serve`` frames from a queue and records its answers by id."""

    def __init__(self) -> None:
        self.incoming: asyncio.Queue[str | None] = asyncio.Queue()
        self.answers: dict[str, dict[str, Any]] = {}
        self.arrived = asyncio.Event()

    def req(self, req_id: str, call: str, **args: Any) -> None:
        self.incoming.put_nowait(json.dumps({"type": "req", "id": req_id, "call": call, "args": args}))

    async def send(self, text: str) -> None:
        frame = json.loads(text)
        self.answers[frame["id"]] = frame
        self.arrived.set()

    async def wait_for(self, *ids: str) -> None:
        async with asyncio.timeout(10):
            while not all(i in self.answers for i in ids):
                self.arrived.clear()
                await self.arrived.wait()

    def __aiter__(self) -> ScriptedSocket:
        return self

    async def __anext__(self) -> str:
        frame = await self.incoming.get()
        if frame is None:
            raise StopAsyncIteration
        return frame


async def test_requests_run_side_by_side_and_late_or_unknown_ones_are_answered(tmp_path) -> None:
    """Pins the request handling: a slow call does not hold up a quick one, a cancel for a call
    that already finished (or never existed) answers ``cancelled: false``, an unknown call
    ``unknown_call``, and a cancelled call sends no late answer."""
    gate = asyncio.Event()

    @tool
    async def wait() -> str:
        """Wait for the test."""
        await gate.wait()
        return "waited"

    options = DeviceOptions(url="ws://127.0.0.1:9", token="t", name="box", root=tmp_path, tools=[wait])
    (tmp_path / "a.txt").write_text("alpha\n")
    client = DeviceClient(options, say=lambda text: None)
    ws = ScriptedSocket()
    serving = asyncio.create_task(client._serve(ws))
    ws.req("slow", "tool.wait")
    ws.req("gone", "tool.wait")
    ws.req("quick", "fs.read", path="a.txt")
    await ws.wait_for("quick")
    assert "alpha" in ws.answers["quick"]["data"]["content"][0]["text"] and "slow" not in ws.answers
    ws.req("c1", "request.cancel", id="gone")
    ws.req("c2", "request.cancel", id="quick")  # finished already
    ws.req("c3", "request.cancel", id="never")
    ws.req("u", "shell.exec", command="true")  # not lent
    await ws.wait_for("c1", "c2", "c3", "u")
    assert [ws.answers[c]["data"]["cancelled"] for c in ("c1", "c2", "c3")] == [True, False, False]
    assert ws.answers["u"]["error"]["code"] == "unknown_call"
    gate.set()
    await ws.wait_for("slow")
    assert ws.answers["slow"]["data"]["content"][0]["text"] == "waited"
    ws.incoming.put_nowait(None)
    await asyncio.wait_for(serving, 5)
    assert "gone" not in ws.answers


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals")
async def test_a_device_started_under_nohup_outlives_its_terminal(tmp_path) -> None:
    """``nohup agentloop device connect …`` ignores SIGHUP on purpose: stopping on it is only for a
    device whose SIGHUP was not set aside."""
    async with world(tmp_path) as w:
        args = [sys.executable, "-m", "agentloop.cli.device", "connect", w.server.url, "--name", "box"]
        args += ["--root", str(w.device_root), "--backoff", "0.1"]
        device = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, "AGENTLOOP_TOKEN": w.token},
            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),  # what nohup does
        )
        try:
            await w.online("box")
            device.send_signal(signal.SIGHUP)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(device.wait(), 1.0)
            read = await w.hub.call("alice", "box", "fs.read", {"path": "hello.txt"}, 10)
            assert not read.is_error
        finally:
            if device.returncode is None:
                device.terminate()
                assert await asyncio.wait_for(device.wait(), 10) == 0


async def test_the_account_stream_is_reopened_after_a_drop_and_says_so() -> None:
    """The account stream was one connection: a dropped one (a proxy's idle cut, a server
    restarting) ended it, and a caller that did not reopen it by hand heard nothing more."""
    opened: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/events"
        opened.append(1)
        if len(opened) == 1:  # the server restarting: the stream ends
            return httpx.Response(200, headers={"Content-Type": "text/event-stream"}, text=": hello\n\n")
        if len(opened) == 2:
            return httpx.Response(502, text=HTML)
        body = 'event: proc.run.finished\ndata: {"pid": "p1", "signal": "proc.run.finished", "payload": {}}\n\n'
        return httpx.Response(200, headers={"Content-Type": "text/event-stream"}, text=body)

    retries: list[str] = []
    connected = asyncio.Event()
    async with mocked(handler) as client:
        async with asyncio.timeout(10):
            stream = client.account_events(connected=connected, on_retry=lambda p, n: retries.append(p.code))
            event = await anext(stream)
            await stream.aclose()
    assert (event.pid, event.signal) == ("p1", "proc.run.finished") and connected.is_set()
    assert len(opened) == 3 and retries[0] == "stream_ended" and len(retries) == 2

    async with mocked(handler) as client:  # without reconnect: the end of the first connection ends it
        opened.clear()
        assert [e async for e in client.account_events(reconnect=False)] == [] and len(opened) == 1
