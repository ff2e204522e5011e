"""Device tokens and the device registry: a driver connects with a token bound to its device name
(not an account token, unless the hub allows it), revocation closes it, a device token is no key to
user calls, devices are remembered while offline, presence reaches the account stream (by the route
of every account signal), and ``agentloop serve`` refuses account tokens for drivers unless started
with ``--device-account-tokens``."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from agentloop import Agent, ScriptedModel
from agentloop.cli.approvals import parse_approval
from agentloop.cli.config import Settings
from agentloop.cli.serve import ServeOptions
from agentloop.client import AgentloopClient, NotFound
from agentloop.device.client import websocket_url
from agentloop.kernel import Kernel
from agentloop.process.signals import AccountSignal, Signal, SignalHub, for_account
from agentloop.server.app import create_server
from agentloop.server.auth import Accounts
from agentloop.server.context import ServerContext
from agentloop.server.devices import DeviceHub
from tests.server_support import serving
from tests.test_device_client import Server


class Box:
    def __init__(self, kernel: Kernel, hub: DeviceHub, server: Server, token: str) -> None:
        self.kernel, self.hub, self.server, self.token = kernel, hub, server, token
        self.http = httpx.AsyncClient(base_url=server.url, headers={"authorization": f"Bearer {token}"})

    async def device_token(self, name: str) -> str:
        res = await self.http.post(f"/v1/devices/{name}/token")
        assert res.status_code == 200, res.text
        return str(res.json()["token"])

    async def devices(self) -> list[dict[str, Any]]:
        res = await self.http.get("/v1/devices")
        assert res.status_code == 200, res.text
        return list(res.json()["devices"])


@contextlib.asynccontextmanager
async def box(tmp_path: Path, *, account_tokens: bool = False) -> AsyncIterator[Box]:
    hub = DeviceHub(probe_timeout=0.5, account_tokens=account_tokens)
    url = f"sqlite:///{tmp_path}/agentloop.db"
    async with Kernel.open(url, model=ScriptedModel(["ok"]), workspace=tmp_path, devices=hub) as kernel:
        accounts = Accounts(kernel.store)
        await accounts.create_account("alice")
        token, _ = await accounts.create_token("alice")
        ctx = ServerContext(kernel, accounts, devices=hub)
        ctx.heartbeat = 0.05
        server = Server(create_server(ctx, lambda: Agent(ScriptedModel(["unused"]))))
        await server.start()
        b = Box(kernel, hub, server, token)
        try:
            yield b
        finally:
            await b.http.aclose()
            await hub.close()
            await server.stop()


async def connect(b: Box, token: str, name: str, **extra: Any) -> tuple[Any, dict[str, Any]]:
    ws = await websockets.connect(websocket_url(b.server.url))
    args = {"role": "driver", "token": token, "name": name, "implements": ["fs.read"], **extra}
    await ws.send(json.dumps({"type": "req", "id": "c1", "call": "sys.connect", "args": args}))
    return ws, json.loads(await asyncio.wait_for(ws.recv(), 5))


async def closed_with(ws: Any) -> tuple[int | None, str | None]:
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            await asyncio.wait_for(ws.recv(), 5)
    return ws.close_code, ws.close_reason


async def test_a_device_token_connects_its_device_which_runs_a_call(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        token = await b.device_token("laptop")
        assert token.startswith("al_dev_")
        ws, res = await connect(b, token, "laptop", label="My laptop", description="has the GPU")
        assert res["ok"] is True and res["data"]["device_id"] == "laptop" and res["data"]["account"] == "alice"

        async def answer() -> None:
            frame = json.loads(await ws.recv())
            data = {"content": [{"type": "text", "text": "file body"}], "is_error": False}
            await ws.send(json.dumps({"type": "res", "id": frame["id"], "ok": True, "data": data}))

        answering = asyncio.create_task(answer())
        result = await b.hub.call("alice", "laptop", "fs.read", {"path": "a.txt"}, 5)
        await answering
        assert not result.is_error and result.content[0].text == "file body"  # type: ignore[union-attr]
        [listed] = await b.devices()
        assert (listed["id"], listed["label"], listed["description"], listed["online"]) == (
            "laptop",
            "My laptop",
            "has the GPU",
            True,
        )
        assert listed["has_token"] is True and listed["implements"] == ["fs.read"]
        await ws.close()


async def test_a_driver_is_refused_with_another_devices_token_or_an_account_token(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        other = await b.device_token("desktop")
        ws, res = await connect(b, other, "laptop")
        assert res["ok"] is False and res["error"]["code"] == "unauthorized"
        assert "for device 'desktop', not 'laptop'" in res["error"]["message"]
        assert await closed_with(ws) == (4401, "token for another device")
        ws, res = await connect(b, b.token, "laptop")  # an account token
        assert res["ok"] is False and res["error"]["code"] == "unauthorized"
        assert "device token" in res["error"]["message"]
        assert await closed_with(ws) == (4401, "device token required")
        assert b.hub.online("alice") == []


async def test_account_tokens_connect_drivers_only_on_a_hub_that_allows_them(tmp_path: Path) -> None:
    async with box(tmp_path, account_tokens=True) as b:
        ws, res = await connect(b, b.token, "laptop")
        assert res["ok"] is True
        assert [d["id"] for d in await b.devices()] == ["laptop"]
        await ws.close()


async def test_a_revoked_or_replaced_device_token_is_refused_and_closes_its_connection(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        first = await b.device_token("laptop")
        ws, res = await connect(b, first, "laptop")
        assert res["ok"] is True
        second = await b.device_token("laptop")  # replaces the first: its connection goes
        assert await closed_with(ws) == (4401, "the token was revoked")
        ws, res = await connect(b, first, "laptop")
        assert res["ok"] is False and res["error"]["code"] == "unauthorized"
        ws, res = await connect(b, second, "laptop")
        assert res["ok"] is True
        revoked = await b.http.delete("/v1/devices/laptop/token")
        assert revoked.status_code == 200 and revoked.json() == {"device": "laptop", "revoked": True}
        assert await closed_with(ws) == (4401, "the token was revoked")
        assert (await b.http.delete("/v1/devices/laptop/token")).status_code == 404
        ws, res = await connect(b, second, "laptop")
        assert res["ok"] is False and res["error"]["code"] == "unauthorized"
        bad = await b.http.post("/v1/devices/a__b/token")
        assert bad.status_code == 400 and "name" in bad.text


async def test_a_device_token_is_no_key_to_user_calls(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        token = await b.device_token("laptop")
        headers = {"authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=b.server.url, headers=headers) as http:
            assert (await http.get("/v1/processes")).status_code == 401
            assert (await http.post("/v1/devices/other/token")).status_code == 401
        ws = await websockets.connect(websocket_url(b.server.url))
        await ws.send(json.dumps({"type": "req", "id": "c1", "call": "sys.connect", "args": {"token": token}}))
        res = json.loads(await asyncio.wait_for(ws.recv(), 5))
        assert res["ok"] is False and res["error"]["code"] == "unauthorized"


async def test_the_registry_lists_a_device_after_it_leaves_and_the_account_stream_hears_it(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        token = await b.device_token("laptop")
        user = await websockets.connect(websocket_url(b.server.url))
        await user.send(json.dumps({"type": "req", "id": "u1", "call": "sys.connect", "args": {"token": b.token}}))
        assert json.loads(await user.recv())["ok"] is True
        await user.send(json.dumps({"type": "req", "id": "u2", "call": "account.subscribe", "args": {}}))
        assert json.loads(await user.recv())["ok"] is True
        ws, res = await connect(b, token, "laptop", description="the old one")
        assert res["ok"] is True
        await ws.close()
        await b.hub.wait_until(lambda: b.hub.online("alice") == [], 5)
        seen = []
        while len(seen) < 2:
            frame = json.loads(await asyncio.wait_for(user.recv(), 5))
            if frame.get("type") == "sig" and frame.get("signal") == "device.status":
                seen.append((frame["payload"]["device"], frame["payload"]["status"]))
        assert seen == [("laptop", "online"), ("laptop", "offline")]
        async with asyncio.timeout(5):
            while True:
                [listed] = await b.devices()
                if listed["last_seen_at"] != listed["first_seen_at"]:
                    break
                await asyncio.sleep(0.02)
        assert (listed["id"], listed["online"], listed["description"], listed["connected_at"]) == (
            "laptop",
            False,
            "the old one",
            None,
        )
        assert listed["first_seen_at"] <= listed["last_seen_at"]
        await user.close()


async def test_device_status_takes_the_account_signal_route_and_reaches_the_event_stream(tmp_path: Path) -> None:
    assert for_account(Signal("device.status", {"device": "laptop", "status": "online", "timestamp": 1.0}))
    signals = SignalHub()
    queue = signals.watch_account("alice")
    signals.to_account("alice", AccountSignal(None, Signal("device.status", {"device": "x", "status": "online"})))
    item = queue.get_nowait()
    assert item is not None and (item.pid, item.seq, item.signal.signal) == (None, None, "device.status")
    async with box(tmp_path) as b, AgentloopClient(b.server.url, b.token) as client:
        token = (await client.device_token("laptop"))["token"]
        connected = asyncio.Event()
        heard: list[tuple[str, str, Any]] = []

        async def listen() -> None:
            async for event in client.account_events(connected=connected):
                if event.signal == "device.status":
                    heard.append((event.payload["device"], event.payload["status"], event.id))
                    if len(heard) == 2:
                        return

        listening = asyncio.create_task(listen())
        await asyncio.wait_for(connected.wait(), 5)
        async with asyncio.timeout(5):  # (the stream watches the account once its opening frame is sent)
            while not b.kernel.engine.hub.watches_account("alice"):
                await asyncio.sleep(0.01)
        ws, res = await connect(b, token, "laptop")
        assert res["ok"] is True
        await ws.close()
        await asyncio.wait_for(listening, 5)
        assert heard == [("laptop", "online", None), ("laptop", "offline", None)]  # live only: no account seq
        assert await client.revoke_device_token("laptop") is True
        with pytest.raises(NotFound):
            await client.revoke_device_token("laptop")
        [listed] = await client.devices()
        assert (listed["id"], listed["online"], listed["has_token"]) == ("laptop", False, False)


def _serve_options(tmp_path: Path, **extra: Any) -> ServeOptions:
    script = tmp_path / "script.json"
    script.write_text(json.dumps(["never asked"]))
    settings = Settings(model=f"scripted:{script}", model_source="test")
    root = tmp_path.resolve()
    return ServeOptions("127.0.0.1", 0, root, root, settings, parse_approval("ask"), out=io.StringIO(), **extra)


@pytest.mark.parametrize("flag", [False, True])
def test_serve_takes_account_tokens_for_devices_only_with_its_flag(tmp_path: Path, flag: bool) -> None:
    """Secure by default: ``agentloop serve`` connects a device with its device token only;
    ``--device-account-tokens`` (deprecated) lets an account token connect one as before."""

    async def driver(url: str, token: str) -> dict[str, Any]:
        async with websockets.connect(websocket_url(url)) as ws:
            args = {"role": "driver", "token": token, "name": "laptop", "implements": ["fs.read"]}
            await ws.send(json.dumps({"type": "req", "id": "c1", "call": "sys.connect", "args": args}))
            return dict(json.loads(await asyncio.wait_for(ws.recv(), 5)))

    with serving(_serve_options(tmp_path, device_account_tokens=flag)) as (url, headers):
        account = headers["Authorization"].removeprefix("Bearer ")
        res = asyncio.run(driver(url, account))
        assert res["ok"] is flag, res
        if not flag:
            assert res["error"]["code"] == "unauthorized" and "device token" in res["error"]["message"]
        issued = httpx.post(f"{url}/v1/devices/laptop/token", headers=headers, timeout=10)
        assert issued.status_code == 200, issued.text
        assert asyncio.run(driver(url, issued.json()["token"]))["ok"] is True
