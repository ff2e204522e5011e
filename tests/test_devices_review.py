"""A review of devices: a caller cancelled while its request frame leaves, a declaration the hub
cannot check, the device's own refusals of what a server asks outside its allow list and root,
a token revoked under a connected device, and reconnecting during a call."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from agentloop import Agent, ScriptedModel
from agentloop.device.client import DeviceClient, DeviceError, DeviceOptions
from agentloop.kernel import Kernel
from agentloop.kernel.devices import device_toolset
from agentloop.process.store import ProcessRecord
from agentloop.server.app import create_server
from agentloop.server.auth import Accounts
from agentloop.server.context import ServerContext
from agentloop.server.devices import DeviceHub, issue_device_token, revoke_device_token
from agentloop.tools.base import ToolArgumentsError
from tests.test_device_client import Server
from tests.test_devices import ALICE, BOB, FakeDevice, online


async def never(call: str, args: dict[str, Any]) -> None:
    return None


# ------------------------------------------------------------------ the hub


async def test_a_caller_cancelled_while_its_frame_leaves_cancels_the_call_on_the_device() -> None:
    """The frame was out (in the socket's buffer) when the caller was cancelled during the send:
    the device ran the command with nobody waiting, no ``request.cancel`` was sent, and the call's
    future stayed in ``pending`` for as long as the connection lived."""
    hub = DeviceHub()
    device = await online(hub, ALICE, "laptop", handler=never)
    real = device.socket.send_text

    async def draining(data: str) -> None:
        await real(data)  # the device has it ...
        if '"shell.exec"' in data:
            await asyncio.sleep(5)  # ... but the send still waits for the buffer to drain

    device.socket.send_text = draining  # type: ignore[method-assign]
    task = asyncio.create_task(hub.call("alice", "laptop", "shell.exec", {"command": "sleep 99"}, 30))
    await asyncio.sleep(0.1)
    assert device.calls("shell.exec")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)
    sent = device.calls("shell.exec")[0]["id"]
    assert [c["args"]["id"] for c in device.calls("request.cancel")] == [sent]
    assert hub._devices[("alice", "laptop")].pending == {}
    await device.disconnect()


async def test_a_schema_too_deep_to_check_is_refused_not_a_hub_failure() -> None:
    """A tool schema nested a few hundred levels deep (well inside a frame's size) made the checks
    recurse past Python's limit: ``RecursionError`` escaped ``serve_driver``, the device never got
    an answer to its connect (the server logged a hub failure and cut the socket), and the client
    reconnected forever to the same failure."""
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}}
    tool = {"name": "deep", "description": "", "parameters": schema}
    assert len(json.dumps(tool)) < 1024 * 1024  # a frame the server accepts
    hub = DeviceHub()
    device = FakeDevice(hub, ALICE, "laptop", tools=[tool])
    res = await asyncio.wait_for(device.connect(), 5)
    assert res["ok"] is False and res["error"]["code"] == "invalid_request"
    assert "tools[0].parameters" in res["error"]["message"] and "deep" in res["error"]["message"]
    assert hub.online("alice") == []
    # a deep but sane schema (31 nested objects) is taken, and checked at a call
    schema = {"type": "object"}
    value: dict[str, Any] = {}
    for _ in range(31):
        schema, value = {"type": "object", "properties": {"a": schema}, "required": ["a"]}, {"a": value}
    ok = await online(hub, ALICE, "laptop", tools=[{"name": "deep", "parameters": schema}])
    tools = device_toolset(hub)(ProcessRecord(pid="p", owner="alice", run_as="alice", cwd="/"), {})
    assert tools["laptop__deep"].validate(value) == value
    with pytest.raises(ToolArgumentsError):
        tools["laptop__deep"].validate({"a": {"a": 1}})
    await ok.disconnect()


async def test_one_name_in_two_accounts_reaches_only_the_callers_device() -> None:
    hub = DeviceHub()

    def tagged(who: str) -> Any:
        async def handler(call: str, args: dict[str, Any]) -> dict[str, Any]:
            return {"content": [{"type": "text", "text": who}], "is_error": False}

        return handler

    a = await online(hub, ALICE, "laptop", handler=tagged("alice's"))
    b = await online(hub, BOB, "laptop", handler=tagged("bob's"))
    assert (await hub.call("alice", "laptop", "fs.read", {"path": "x"}, 5)).content[0].text == "alice's"
    assert (await hub.call("bob", "laptop", "fs.read", {"path": "x"}, 5)).content[0].text == "bob's"
    # bob's device answers the id of alice's call: alice's call does not take it
    slow = await online(hub, ALICE, "phone", handler=never)
    task = asyncio.create_task(hub.call("alice", "phone", "fs.read", {"path": "x"}, 0.5))
    await asyncio.sleep(0.05)
    stolen = slow.calls("fs.read")[0]["id"]
    b.socket.push({"type": "res", "id": stolen, "ok": True, "data": {"content": [{"type": "text", "text": "B"}]}})
    result = await task
    assert result.is_error and "timed out" in result.content[0].text
    for d in (a, b, slow):
        await d.disconnect()


# ------------------------------------------------------------------ the device client


class FakeServerSocket:
    """The device client's end of a socket to a server that is not to be trusted: ``feed``
    frames to the client, read its answers from ``out``."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[str | None] = asyncio.Queue()
        self.out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def __aiter__(self) -> FakeServerSocket:
        return self

    async def __anext__(self) -> str:
        item = await self.inbox.get()
        if item is None:
            raise StopAsyncIteration
        return item

    async def send(self, data: str) -> None:
        self.out.put_nowait(json.loads(data))

    def feed(self, frame: dict[str, Any]) -> None:
        self.inbox.put_nowait(json.dumps(frame))

    async def answers(self, ids: set[str]) -> dict[str, dict[str, Any]]:
        got: dict[str, dict[str, Any]] = {}
        while not ids <= got.keys():
            frame = await asyncio.wait_for(self.out.get(), 10)
            got[frame["id"]] = frame
        return got


async def test_the_device_refuses_what_it_does_not_lend_whatever_the_server_asks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "in.txt").write_text("inside\n")
    (tmp_path / "secret.txt").write_text("outside\n")
    (root / "link").symlink_to(tmp_path / "secret.txt")
    client = DeviceClient(DeviceOptions(url="ws://127.0.0.1:1/v1/ws", token="t", name="box", root=root))
    ws = FakeServerSocket()
    serving = asyncio.create_task(client._serve(ws))
    requests = {
        "ok": ("fs.read", {"path": "in.txt"}),
        "abs": ("fs.read", {"path": str(tmp_path / "secret.txt")}),
        "up": ("fs.read", {"path": "../secret.txt"}),
        "link": ("fs.read", {"path": "link"}),
        "search": ("fs.search", {"pattern": "outside", "path": ".."}),
        "shell": ("shell.exec", {"command": f"touch {tmp_path}/ran"}),
        "write": ("fs.write", {"path": "new.txt", "content": "x"}),
        "tool": ("tool.anything", {}),
        "codemode": ("codemode.exec", {"code": "print(1)"}),
    }
    for rid, (call, args) in requests.items():
        ws.feed({"type": "req", "id": rid, "call": call, "args": args})
    answers = await ws.answers(set(requests))
    ws.inbox.put_nowait(None)
    await asyncio.wait_for(serving, 5)
    assert "inside" in answers["ok"]["data"]["content"][0]["text"]
    for rid in ("abs", "up", "link", "search"):
        data = answers[rid]["data"]
        assert data["is_error"] is True, (rid, data)
        assert "outside" not in json.dumps(data).replace("outside the workspace", ""), (rid, data)
    for rid in ("shell", "write", "tool", "codemode"):
        assert answers[rid]["ok"] is False and answers[rid]["error"]["code"] == "unknown_call"
    assert not (tmp_path / "ran").exists() and not (root / "new.txt").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="as tests/test_device_client.py")
async def test_a_token_revoked_under_a_connected_device_stops_it_with_a_clear_error(tmp_path: Path) -> None:
    hub = DeviceHub(probe_timeout=0.5)
    (tmp_path / "server").mkdir()
    (tmp_path / "device").mkdir()
    url = f"sqlite:///{tmp_path}/agentloop.db"
    async with Kernel.open(url, model=ScriptedModel(["unused"]), workspace=tmp_path / "server", devices=hub) as k:
        accounts = Accounts(k.store)
        await accounts.create_account("alice")
        token, _ = await issue_device_token(k.store, "alice", "box")  # (what POST /v1/devices/box/token does)
        ctx = ServerContext(k, accounts, devices=hub, heartbeat=0.1)
        server = Server(create_server(ctx, lambda: Agent(ScriptedModel(["unused"]))))
        await server.start()
        said: list[str] = []
        options = DeviceOptions(
            url=server.url, token=token, name="box", root=tmp_path / "device", backoff_initial=0.05, backoff_max=0.1
        )
        running = asyncio.create_task(DeviceClient(options, say=said.append).run())
        try:
            await hub.wait_until(lambda: bool(hub.online("alice")), 20)
            assert await revoke_device_token(k.store, "alice", "box")
            with pytest.raises(DeviceError, match="unauthorized"):
                await asyncio.wait_for(running, 20)
            assert sum("reconnecting" in s for s in said) <= 1, said
            assert hub.online("alice") == []
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await hub.close()
            await server.stop()


async def test_a_device_that_reconnects_during_a_call_gets_a_clear_error_and_no_rerun(tmp_path: Path) -> None:
    """The old connection is half-dead (the server has not noticed): the device's new connection
    replaces it, the call in flight ends with an error at once, and the device does not run it
    again on the new connection."""
    hub = DeviceHub(probe_timeout=0.2)
    old = await online(hub, ALICE, "laptop", handler=never)
    old.ping = False
    task = asyncio.create_task(hub.call("alice", "laptop", "fs.read", {"path": "a"}, 30))
    await asyncio.sleep(0.05)
    new = await online(hub, ALICE, "laptop")
    result = await asyncio.wait_for(task, 2)
    assert result.is_error and "outcome is unknown" in result.content[0].text
    # the old call's answer arriving late, on either socket, is dropped
    rid = old.calls("fs.read")[0]["id"]
    new.socket.push({"type": "res", "id": rid, "ok": True, "data": {"content": []}})
    assert not new.calls("fs.read")
    ok = await hub.call("alice", "laptop", "fs.read", {"path": "b"}, 5)
    assert not ok.is_error and len(new.calls("fs.read")) == 1
    await new.disconnect()
