"""The device hub and routing, with fake driver sockets: connect and validation, name conflicts,
calls (routing, timeout → request.cancel, disconnect → error results), isolation between accounts,
the routed toolset the model sees, the ``remote`` approval tag and the ``{{devices}}`` prompt
variable."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, ToolResultMessage, call
from agentloop.kernel import Kernel
from agentloop.kernel.devices import describe_devices, device_toolset, split_device_tool
from agentloop.models.base import ModelRequest
from agentloop.process.approval import call_target, decide, default_policy
from agentloop.process.store import ProcessRecord
from agentloop.server import devices as devices_module
from agentloop.server.auth import Principal
from agentloop.server.devices import DeviceHub
from agentloop.tools.base import ToolContext
from agentloop.tools.builtin import builtin_tools
from tests.image_support import PNG

ALICE = Principal("alice", False, "t1")
BOB = Principal("bob", False, "t2")
ROOT = Principal("root", True, "t3")
ALL = ["fs.read", "fs.write", "fs.edit", "fs.delete", "fs.search", "shell.exec"]


class Closed(Exception):
    """What a closed socket raises from ``receive_text`` (Starlette raises WebSocketDisconnect)."""


class FakeSocket:
    """A driver socket: frames the hub sends land in ``sent``; ``push`` feeds it frames."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[str | None] = asyncio.Queue()
        self.sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.closed = False

    async def send_text(self, data: str) -> None:
        if self.closed:
            raise Closed()
        self.sent.put_nowait(json.loads(data))

    async def receive_text(self) -> str:
        item = await self.inbox.get()
        if item is None:
            self.closed = True
            raise Closed()
        return item

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.inbox.put_nowait(None)

    def push(self, frame: dict[str, Any]) -> None:
        self.inbox.put_nowait(json.dumps(frame))

    async def next(self) -> dict[str, Any]:
        return await asyncio.wait_for(self.sent.get(), 2.0)


Handler = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any] | None]]


async def echo_handler(call: str, args: dict[str, Any]) -> dict[str, Any] | None:
    return {"content": [{"type": "text", "text": f"{call} {json.dumps(args, sort_keys=True)}"}], "is_error": False}


class FakeDevice:
    """A driver on a fake socket that answers requests with ``handler`` (None: no answer) and
    records every request it got (``sys.ping`` answered unless ``ping=False``)."""

    def __init__(self, hub: DeviceHub, who: Principal, name: str, *, handler: Handler = echo_handler, **args: Any):
        self.hub, self.who, self.name, self.handler = hub, who, name, handler
        self.args = {"role": "driver", "name": name, "implements": ALL, **args}
        self.socket = FakeSocket()
        self.requests: list[dict[str, Any]] = []
        self.ping = True
        self.serving: asyncio.Task[None] | None = None
        self.answering: asyncio.Task[None] | None = None

    async def connect(self) -> dict[str, Any]:
        self.serving = asyncio.create_task(self.hub.serve_driver(self.socket, self.who, self.args, "c1"))
        res = await self.socket.next()
        assert res["id"] == "c1"
        if res["ok"]:
            self.answering = asyncio.create_task(self._answer())
        return res

    async def _answer(self) -> None:
        while True:
            frame = await self.socket.sent.get()
            self.requests.append(frame)
            if frame["call"] == "sys.ping":
                if self.ping:
                    self.socket.push({"type": "res", "id": frame["id"], "ok": True, "data": {}})
                continue
            if frame["call"] == "request.cancel":
                continue
            data = await self.handler(frame["call"], frame["args"])
            if data is not None:
                self.socket.push({"type": "res", "id": frame["id"], "ok": True, "data": data})

    async def disconnect(self) -> None:
        self.socket.inbox.put_nowait(None)
        assert self.serving is not None
        await asyncio.wait_for(self.serving, 2)
        if self.answering is not None:
            self.answering.cancel()

    def calls(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["call"] == name]


async def online(hub: DeviceHub, who: Principal, name: str, **kw: Any) -> FakeDevice:
    device = FakeDevice(hub, who, name, **kw)
    res = await device.connect()
    assert res["ok"], res
    return device


# ------------------------------------------------------------------ connect


async def test_a_driver_connects_is_listed_and_goes_offline_on_close():
    hub = DeviceHub()
    events: list[tuple[str, str]] = []
    hub.subscribe(lambda what, info: events.append((what, info.id)))
    device = FakeDevice(hub, ALICE, "laptop", implements=["fs.read", "shell.exec"])
    res = await device.connect()
    assert res == {
        "type": "res",
        "id": "c1",
        "ok": True,
        "data": {"device_id": "laptop", "account": "alice", "admin": False, "role": "driver"},
    }
    listed = hub.list(ALICE)
    assert [(d["id"], d["owner"], d["implements"], d["tools"]) for d in listed] == [
        ("laptop", "alice", ["fs.read", "shell.exec"], [])
    ]
    assert isinstance(listed[0]["connected_at"], float)
    assert hub.list(BOB) == [] and [d["id"] for d in hub.list(ROOT)] == ["laptop"]  # admins see all
    assert [d.id for d in hub.online("alice")] == ["laptop"] and hub.online("bob") == []
    await device.disconnect()
    assert hub.list(ALICE) == [] and events == [("online", "laptop"), ("offline", "laptop")]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"name": "a__b"}, "name"),
        ({"name": "local"}, "name"),
        ({"name": ""}, "name"),
        ({"name": "-laptop"}, "name"),
        ({"name": "x" * 33}, "name"),
        ({"name": 7}, "name"),
        ({"implements": ["fs.read", "net.listen"]}, "implements"),
        ({"implements": "fs.read"}, "implements"),
        ({"tools": [{"name": "bad name"}]}, "tools[0].name"),
        ({"tools": [{"name": "t", "parameters": {"type": "array"}}]}, "tools[0].parameters"),
        ({"tools": [{"name": "t", "parameters": {"type": "object", "properties": 3}}]}, "tools[0].parameters"),
        ({"tools": [{"name": "t"}, {"name": "t"}]}, "tools[1].name"),
        # resolving a reference outside the schema would make the server fetch what the device names
        ({"tools": [{"name": "t", "parameters": {"properties": {"q": {"$ref": "http://10.0.0.1/x"}}}}]}, "tools[0]"),
        ({"tools": [{"name": "t", "parameters": {"patternProperties": {"^(a|a)+$": {}}}}]}, "tools[0]"),
        ({"tools": [{"name": "t" * 60}]}, "tools[0].name"),
        ({"tools": "screenshot"}, "tools"),
        ({"description": 5}, "description"),
        ({"description": "x" * 201}, "description"),
    ],
)
async def test_a_bad_declaration_is_refused_naming_the_field(args, field):
    hub = DeviceHub()
    device = FakeDevice(hub, ALICE, "laptop")
    device.args.update(args)
    res = await device.connect()
    assert res["ok"] is False and res["error"]["code"] == "invalid_request"
    assert res["error"]["message"].startswith(field), res
    assert device.serving is not None
    await asyncio.wait_for(device.serving, 1)  # returns at once, leaving the socket to the caller
    assert hub.list(ROOT) == []


async def test_a_live_name_is_a_conflict_but_other_accounts_may_use_it():
    hub = DeviceHub(probe_timeout=0.5)
    first = await online(hub, ALICE, "laptop")
    second = FakeDevice(hub, ALICE, "laptop")
    res = await second.connect()
    assert res["ok"] is False and res["error"]["code"] == "conflict"
    assert first.calls("sys.ping")  # the old connection was asked whether it is still there
    await online(hub, BOB, "laptop")
    assert sorted((d["owner"], d["id"]) for d in hub.list(ROOT)) == [("alice", "laptop"), ("bob", "laptop")]


async def test_an_account_has_room_for_a_bounded_number_of_devices_and_tools(monkeypatch):
    monkeypatch.setattr(devices_module, "MAX_DEVICES_PER_ACCOUNT", 2)
    monkeypatch.setattr(devices_module, "MAX_ACCOUNT_DEVICE_TOOLS", 3)
    hub = DeviceHub(probe_timeout=0.5)
    first = await online(hub, ALICE, "one", tools=[{"name": "a"}, {"name": "b"}])
    res = await FakeDevice(hub, ALICE, "two", tools=[{"name": "a"}, {"name": "b"}]).connect()
    assert res["ok"] is False and res["error"]["code"] == "conflict"
    assert "declare 2 tools" in res["error"]["message"]
    await online(hub, ALICE, "two", tools=[{"name": "a"}])  # within the tools in all
    res = await FakeDevice(hub, ALICE, "three").connect()
    assert res["ok"] is False and res["error"]["code"] == "conflict"
    assert "2 devices" in res["error"]["message"]
    await online(hub, BOB, "three")  # another account's room is its own
    first.ping = False  # gone quiet: its replacement takes its room, not another's
    await online(hub, ALICE, "one", tools=[{"name": "c"}, {"name": "d"}])
    listed = sorted((d["owner"], d["id"]) for d in hub.list(ROOT))
    assert listed == [("alice", "one"), ("alice", "two"), ("bob", "three")]


async def test_an_unresponsive_connection_is_replaced_and_its_calls_fail():
    hub = DeviceHub(probe_timeout=0.2)

    async def never(call: str, args: dict[str, Any]) -> None:
        return None

    stale = await online(hub, ALICE, "laptop", handler=never)
    stale.ping = False
    pending = asyncio.create_task(hub.call("alice", "laptop", "fs.read", {"path": "a"}, 5))
    await asyncio.sleep(0.05)
    fresh = await online(hub, ALICE, "laptop")
    result = await asyncio.wait_for(pending, 2)
    assert result.is_error and "disconnected" in result.content[0].text
    assert stale.socket.closed or stale.socket.inbox.qsize() > 0  # the hub closed the stale socket
    ok = await hub.call("alice", "laptop", "fs.read", {"path": "a"}, 5)
    assert not ok.is_error and fresh.calls("fs.read")


# ------------------------------------------------------------------ calls


async def test_a_call_is_routed_to_the_owners_device_and_its_answer_returned():
    hub = DeviceHub()
    device = await online(hub, ALICE, "laptop", implements=["fs.read"])
    result = await hub.call("alice", "laptop", "fs.read", {"path": "notes.txt"}, 5)
    assert not result.is_error and result.content[0].text == 'fs.read {"path": "notes.txt"}'
    req = device.calls("fs.read")[0]
    assert req["type"] == "req" and req["args"] == {"path": "notes.txt"}
    # not implemented, unknown device, another account's device: error results, nothing sent
    assert "does not implement shell.exec" in (await hub.call("alice", "laptop", "shell.exec", {}, 5)).content[0].text
    assert (await hub.call("alice", "phone", "fs.read", {}, 5)).is_error
    foreign = await hub.call("bob", "laptop", "fs.read", {"path": "x"}, 5)
    assert foreign.is_error and "not connected" in foreign.content[0].text
    assert len(device.calls("fs.read")) == 1


async def test_device_errors_and_malformed_answers_are_error_results():
    hub = DeviceHub()
    answers: list[dict[str, Any]] = [
        {"content": [{"type": "text", "text": "no such file"}], "is_error": True},
        {"content": [{"type": "video"}], "is_error": False},
        {"content": "text", "is_error": False},
    ]

    async def scripted(call: str, args: dict[str, Any]) -> dict[str, Any]:
        return answers.pop(0)

    await online(hub, ALICE, "laptop", handler=scripted)
    first = await hub.call("alice", "laptop", "fs.read", {}, 5)
    assert first.is_error and first.content[0].text == "no such file"
    for _ in range(2):
        bad = await hub.call("alice", "laptop", "fs.read", {}, 5)
        assert bad.is_error and "malformed" in bad.content[0].text


async def test_a_failed_res_becomes_an_error_result():
    hub = DeviceHub()
    device = FakeDevice(hub, ALICE, "laptop")
    assert (await device.connect())["ok"]
    task = asyncio.create_task(hub.call("alice", "laptop", "fs.read", {}, 5))
    req = await device.socket.next()
    device.socket.push({"type": "res", "id": req["id"], "ok": False, "error": {"code": "boom", "message": "disk"}})
    result = await asyncio.wait_for(task, 2)
    assert result.is_error and result.content[0].text == "Device laptop: disk (boom)"


async def test_a_timeout_cancels_the_call_on_the_device():
    hub = DeviceHub()

    async def never(call: str, args: dict[str, Any]) -> None:
        return None

    device = await online(hub, ALICE, "laptop", handler=never)
    result = await hub.call("alice", "laptop", "shell.exec", {"command": "sleep 9"}, 0.2)
    assert result.is_error and "timed out after 0.2 s" in result.content[0].text
    await asyncio.sleep(0.05)
    call_id = device.calls("shell.exec")[0]["id"]
    assert [c["args"] for c in device.calls("request.cancel")] == [{"id": call_id}]


async def test_a_cancelled_caller_cancels_the_call_on_the_device():
    hub = DeviceHub()

    async def never(call: str, args: dict[str, Any]) -> None:
        return None

    device = await online(hub, ALICE, "laptop", handler=never)
    task = asyncio.create_task(hub.call("alice", "laptop", "shell.exec", {"command": "sleep 9"}, 30))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)
    assert [c["args"]["id"] for c in device.calls("request.cancel")] == [device.calls("shell.exec")[0]["id"]]


async def test_a_disconnect_fails_every_call_in_flight():
    hub = DeviceHub()

    async def never(call: str, args: dict[str, Any]) -> None:
        return None

    device = await online(hub, ALICE, "laptop", handler=never)
    calls = [asyncio.create_task(hub.call("alice", "laptop", "fs.read", {"path": str(i)}, 30)) for i in range(3)]
    await asyncio.sleep(0.05)
    await device.disconnect()
    results = await asyncio.wait_for(asyncio.gather(*calls), 2)
    assert all(r.is_error and "Device laptop disconnected" in r.content[0].text for r in results)
    late = await hub.call("alice", "laptop", "fs.read", {}, 1)
    assert late.is_error and "not connected" in late.content[0].text


async def test_driver_requests_and_bad_frames_are_answered():
    hub = DeviceHub()
    device = FakeDevice(hub, ALICE, "laptop")
    assert (await device.connect())["ok"]
    device.socket.push({"type": "req", "id": "p", "call": "sys.ping", "args": {}})
    assert await device.socket.next() == {"type": "res", "id": "p", "ok": True, "data": {}}
    device.socket.push({"type": "req", "id": "q", "call": "proc.spawn", "args": {}})
    assert (await device.socket.next())["error"]["code"] == "unknown_call"
    device.socket.inbox.put_nowait("not json")
    assert (await device.socket.next())["error"]["code"] == "bad_frame"
    device.socket.inbox.put_nowait("[" * 100_000 + "]" * 100_000)  # too deep to parse: bad, not fatal
    assert (await device.socket.next())["error"]["code"] == "bad_frame"
    device.socket.push({"type": "req", "id": "p2", "call": "sys.ping", "args": {}})
    assert await device.socket.next() == {"type": "res", "id": "p2", "ok": True, "data": {}}
    device.socket.push({"type": "res", "id": "nobody", "ok": True, "data": {}})  # ignored
    await hub.wait_until(lambda: bool(hub.online("alice")), 1)


# ------------------------------------------------------------------ routing


def record(owner: str, cwd: Path) -> ProcessRecord:
    return ProcessRecord(pid="p1", owner=owner, run_as=owner, cwd=str(cwd))


async def test_the_toolset_offers_the_owners_devices_as_targets(tmp_path):
    hub = DeviceHub()
    screenshot = {"name": "screenshot", "description": "Take one.", "parameters": {"type": "object"}}
    await online(hub, ALICE, "laptop", tools=[screenshot])
    await online(hub, ALICE, "nas", implements=["fs.read", "fs.search"])
    await online(hub, BOB, "desktop")
    shared = {t.name: t for t in builtin_tools(tmp_path)}
    tools = device_toolset(hub)(record("alice", tmp_path), shared)
    read = tools["Read"].parameters["properties"]["target"]
    assert read["enum"] == ["local", "laptop", "nas"] and read["default"] == "local"
    assert "laptop" in read["description"] and "desktop" not in json.dumps(tools["Read"].parameters)
    assert tools["Shell"].parameters["properties"]["target"]["enum"] == ["local", "laptop"]
    assert "target" not in tools["Read"].parameters.get("required", [])
    assert set(tools) == {*shared, "laptop__screenshot"}
    assert tools["laptop__screenshot"].description == "Take one."
    assert split_device_tool("laptop__screenshot") == ("laptop", "screenshot")
    bob = device_toolset(hub)(record("bob", tmp_path), shared)
    assert bob["Read"].parameters["properties"]["target"]["enum"] == ["local", "desktop"]
    assert "laptop__screenshot" not in bob
    nobody = device_toolset(hub)(record("carol", tmp_path), shared)
    assert "target" not in nobody["Read"].parameters["properties"]  # nothing to choose from
    assert nobody["Read"].parameters == shared["Read"].parameters


async def test_routed_tools_run_locally_remotely_or_refuse_a_foreign_target(tmp_path):
    hub = DeviceHub()
    (tmp_path / "here.txt").write_text("on the server\n")
    device = await online(hub, ALICE, "laptop", tools=[{"name": "ping", "parameters": {"type": "object"}}])
    await online(hub, BOB, "desktop")
    tools = device_toolset(hub)(record("alice", tmp_path), {t.name: t for t in builtin_tools(tmp_path)})
    read = tools["Read"]
    ctx = ToolContext("c", "Read", tmp_path)
    local = await read.run(read.validate({"path": "here.txt"}), ctx)
    assert not local.is_error and "on the server" in local.content[0].text
    remote = await read.run(read.validate({"path": "there.txt", "target": "laptop"}), ctx)
    assert remote.content[0].text.startswith("fs.read ") and '"path": "there.txt"' in remote.content[0].text
    assert "target" not in device.calls("fs.read")[0]["args"]  # the target is the hub's business
    foreign = await read.run(read.validate({"path": "x", "target": "desktop"}), ctx)
    assert foreign.is_error and "not one of your online devices" in foreign.content[0].text
    shell = tools["Shell"]
    await shell.run(shell.validate({"command": "ls", "target": "laptop", "timeout": 5}), ctx)
    assert device.calls("shell.exec")[0]["args"]["command"] == "ls"
    extra = await tools["laptop__ping"].run({}, ctx)
    assert not extra.is_error and device.calls("tool.ping")
    await device.disconnect()  # gone after the run's tools were built: a stale target
    stale = await read.run(read.validate({"path": "x", "target": "laptop"}), ctx)
    assert stale.is_error and "laptop" in stale.content[0].text
    assert (await tools["laptop__ping"].run({}, ctx)).is_error


def test_device_calls_are_tagged_remote():
    assert call_target("fs.read", "Read", {"path": "a", "target": "laptop"}) == "laptop"
    assert call_target("fs.read", "Read", {"path": "a", "target": "local"}) == "local"
    assert call_target("shell.exec", "Shell", {"command": "ls"}) == "local"
    assert call_target("tool.laptop__shot", "laptop__shot", {}) == "laptop"
    assert call_target("tool.echo", "echo", {"target": "laptop"}) == "local"  # not a routable syscall
    remote = decide(default_policy(), "fs.read", {"path": "a"}, target="laptop", cwd="/w", home="/h")
    assert "remote" in remote.tags and "on laptop" in remote.reason
    local = decide(default_policy(), "fs.read", {"path": "a"}, target="local", cwd="/w", home="/h")
    assert "remote" not in local.tags


# ------------------------------------------------------------------ through a kernel


async def test_a_process_routes_calls_and_its_policy_sees_the_remote_tag(tmp_path):
    hub = DeviceHub()
    device = await online(hub, ALICE, "laptop", description="Alice's laptop,\n has the GPU")
    seen: list[ModelRequest] = []

    def model(req: ModelRequest) -> Reply | str:
        seen.append(req)
        results = [m for m in req.messages if isinstance(m, ToolResultMessage)]
        if not results:
            return Reply(
                tool_calls=[
                    call("Read", path="a.txt", target="laptop"),
                    call("Write", path="b", content="x", target="laptop"),
                ]
            )
        return " | ".join(m.text for m in results)

    (tmp_path / "config/ai/context.d").mkdir(parents=True)
    (tmp_path / "config/ai/context.d/10-devices.md").write_text("Devices:\n{{devices}}")
    policy = {"rules": [{"match": "fs.write", "when": {"anyTag": ["remote"]}, "action": "deny"}]}
    url = f"sqlite:///{tmp_path}/agentloop.db"
    async with Kernel.open(url, model=ScriptedModel(model), workspace=tmp_path, devices=hub, policy=policy) as k:
        proc = await k.spawn("alice", interactive=False)
        await proc.send("go")
        await asyncio.wait_for(proc.wait_idle(), 10)
        answer = (await proc.messages())[-1].text
        assert answer.startswith('fs.read {"limit": 2000, "offset": 1, "path": "a.txt"}')  # validated args
        assert "denied by policy" in answer and "fs.write on laptop is" in answer and "remote" in answer
        assert device.calls("fs.read") and not device.calls("fs.write")
        assert "- laptop (Alice's laptop, has the GPU): fs.read, fs.write" in seen[0].system_prompt  # one line
        assert "- local:" in seen[0].system_prompt
        assert hub.list(ALICE)[0]["description"] == "Alice's laptop, has the GPU"
        # bob's process sees neither alice's device nor its name in the prompt
        bob = await k.spawn("bob")
        await bob.send("go")
        await asyncio.wait_for(bob.wait_idle(), 10)
        assert "laptop" not in seen[-1].system_prompt
        assert "target" not in next(t for t in seen[-1].tools if t.name == "Read").parameters["properties"]
        assert "is not one of your online devices" in (await bob.messages())[-1].text


def test_describe_devices_lists_local_first():
    assert describe_devices([]) == "- local: the server's own workspace"


def test_a_device_schema_is_checked_without_fetching_or_slow_patterns() -> None:
    """A review: a broken ``$ref`` failed the whole run as an internal error; a regex pattern built
    to backtrack froze the server's event loop for every account while it was checked."""
    import time

    from agentloop.kernel.devices import DeviceExtraTool, DeviceInfo, DeviceTool
    from agentloop.tools.base import ToolArgumentsError

    def extra(parameters: dict[str, Any]) -> DeviceExtraTool:
        spec = DeviceTool("lookup", "", {"type": "object", **parameters})
        return DeviceExtraTool(DeviceInfo("laptop", "alice", (), (spec,)), spec, None)  # type: ignore[arg-type]

    broken = extra({"properties": {"q": {"$ref": "#/$defs/nope"}}})
    with pytest.raises(ToolArgumentsError, match="its schema from device laptop is broken"):
        broken.validate({"q": "x"})
    slow = extra({"properties": {"q": {"type": "string", "pattern": "^(a|a)+$"}, "pattern": {"type": "integer"}}})
    start = time.monotonic()
    assert slow.validate({"q": "a" * 40 + "!"}) == {"q": "a" * 40 + "!"}  # left to the device
    assert time.monotonic() - start < 0.5
    with pytest.raises(ToolArgumentsError):
        slow.validate({"q": 5})  # the rest is still checked
    with pytest.raises(ToolArgumentsError):
        slow.validate({"q": "a", "pattern": "not a number"})  # a property named pattern is kept
    globs = extra({"properties": {"g": {"enum": [{"pattern": "*.py"}, {"pattern": "*.md"}]}}})
    assert globs.validate({"g": {"pattern": "*.py"}}) == {"g": {"pattern": "*.py"}}  # data is data


async def test_a_device_that_stops_reading_is_dropped_and_its_calls_end_on_time(monkeypatch):
    """A review: with its socket's buffer full, every call to the device waited on the send lock
    past its deadline, and the device could not reconnect under its name."""
    from agentloop.server import devices as hub_module

    monkeypatch.setattr(hub_module, "SEND_TIMEOUT", 0.3)
    hub = DeviceHub()
    device = await online(hub, ALICE, "laptop", implements=ALL)
    stuck = asyncio.Event()

    async def never(data: str) -> None:
        await stuck.wait()  # the frame never leaves: nobody reads the other end

    device.socket.send_text = never  # type: ignore[method-assign]
    results = await asyncio.wait_for(
        asyncio.gather(*(hub.call("alice", "laptop", "fs.read", {"path": "a"}, 5.0) for _ in range(3))), 3
    )
    assert all(r.is_error for r in results)
    assert "does not read what it is sent" in results[0].content[0].text
    assert hub.online("alice") == []  # dropped: the device may connect again under its name
    again = await online(hub, ALICE, "laptop", implements=ALL)
    assert [d.id for d in hub.online("alice")] == ["laptop"]
    await again.disconnect()


async def test_a_devices_result_is_made_storable_and_its_media_checked():
    """A review: an image that was not one was stored and sent with every later model request;
    one lone surrogate in a device's text lost its whole result at the commit."""
    import base64

    png = base64.b64encode(PNG).decode()

    async def odd(call: str, args: dict[str, Any]) -> dict[str, Any]:
        content = [
            {"type": "text", "text": "before \ud800 after"},
            {"type": "image", "data": "!!! not base64 <script>", "mimeType": "text/html"},
            {"type": "image", "data": png, "mimeType": "image/png"},
        ]
        return {"content": content, "is_error": False}

    hub = DeviceHub()
    device = await online(hub, ALICE, "laptop", handler=odd)
    result = await hub.call("alice", "laptop", "fs.read", {"path": "a"}, 5.0)
    text, note, image = result.content
    assert text.text == "before \ufffd after"  # type: ignore[union-attr]
    assert note.text.startswith("[device laptop sent media that was left out: unsupported image type")  # type: ignore[union-attr]
    assert image.data == png  # type: ignore[union-attr]  # a real one is kept
    await device.disconnect()


async def test_a_document_of_a_type_no_model_takes_is_left_out_and_the_rest_kept():
    """A review: one such document made the whole result 'malformed'."""

    async def report(call: str, args: dict[str, Any]) -> dict[str, Any]:
        content = [
            {"type": "text", "text": "the report follows"},
            {"type": "file", "data": "e30=", "mimeType": "application/json", "name": "r.json"},
        ]
        return {"content": content, "is_error": False}

    hub = DeviceHub()
    device = await online(hub, ALICE, "laptop", handler=report)
    result = await hub.call("alice", "laptop", "fs.read", {"path": "r.json"}, 5.0)
    texts = [b.text for b in result.content]  # type: ignore[union-attr]
    assert not result.is_error and texts[0] == "the report follows"
    assert texts[1].startswith("[a block of the result was left out:") and "application/json" in texts[1]
    await device.disconnect()


async def test_a_call_waiting_behind_a_slow_frame_times_out_without_dropping_the_device():
    """A review: a short call deadline spent waiting for the socket dropped a healthy device."""
    hub = DeviceHub()
    device = await online(hub, ALICE, "laptop", implements=ALL)
    real = device.socket.send_text

    async def slow(data: str) -> None:
        if len(data) > 100_000:
            await asyncio.sleep(0.5)  # a big frame takes a while to leave
        await real(data)

    device.socket.send_text = slow  # type: ignore[method-assign]
    big = asyncio.create_task(hub.call("alice", "laptop", "fs.write", {"path": "a", "content": "x" * 200_000}, 5.0))
    await asyncio.sleep(0.05)
    short = await hub.call("alice", "laptop", "fs.read", {"path": "b"}, 0.2)
    assert short.is_error and "before it could be sent" in short.content[0].text  # type: ignore[union-attr]
    assert not (await big).is_error
    assert [d.id for d in hub.online("alice")] == ["laptop"]
    await device.disconnect()
