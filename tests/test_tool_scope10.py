"""A process's tool scope (process/tool_scope.py): ``Kernel.spawn(tools=[...])`` offers its runs only
the tools named (by name, ``mcp:<server>`` or a glob), kept in the process's kv across restarts;
the model sees only those and a call to another is refused as a tool that does not exist; a
subagent inherits the scope and may narrow it, never widen it; a Delegate may not reach a wider
process; ``Process.set_tools`` changes it from the next run on. Over HTTP: ``tools`` in the spawn
body and ``/v1/processes/{pid}/tools``; over the WebSocket: ``proc.spawn``'s ``tools`` and
``proc.tools.get``/``proc.tools.set``; in the client: ``spawn(tools=)``, ``tools``, ``set_tools``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop import Reply, ScriptedModel, ToolResultMessage, UserMessage, call, tool
from agentloop.client import AgentloopClient, ClientError
from agentloop.kernel import Kernel, NoSuchProcess
from agentloop.models.base import ModelRequest
from agentloop.process.tool_scope import TOOLS_KEY, ToolScopeError, allows, check_scope, scoped, widening
from agentloop.server import api
from agentloop.tools.base import Tool
from tests import server_support
from tests.process_support import closed_gates, gate, gate_tool  # noqa: F401  (closed_gates: autouse)
from tests.server_support import LiveServer
from tests.ws_support import KernelServer

ran: list[str] = []


@tool
def red(text: str) -> str:
    """Say it in red."""
    ran.append(f"red {text}")
    return f"red: {text}"


@tool
def blue(text: str) -> str:
    """Say it in blue."""
    ran.append(f"blue {text}")
    return f"blue: {text}"


def brain(request: ModelRequest) -> Reply | str:
    """``call <tool> <text>`` calls that tool; ``gate <name>`` waits at a gate; ``task: X`` starts a
    subagent on ``job X``; ``delegate <pid>: X`` delegates; anything else is answered in text."""
    last = request.messages[-1]
    if isinstance(last, ToolResultMessage):
        return f"result: {last.text}"
    text = last.text if isinstance(last, UserMessage) else ""
    if text.startswith("call "):
        _, name, arg = text.split(" ", 2)
        return Reply(tool_calls=[call(name, text=arg)])
    if text.startswith("gate "):
        return Reply(tool_calls=[call("gate", name=text.removeprefix("gate "))])
    if text.startswith("task: "):
        return Reply(tool_calls=[call("Task", prompt=f"job {text.removeprefix('task: ')}")])
    if text.startswith("delegate "):
        head, _, task = text.partition(": ")
        return Reply(tool_calls=[call("Delegate", to=head.split()[1], prompt=task)])
    return f"answer: {text}"


def open_kernel(tmp_path: Path, model: ScriptedModel, **kw: Any) -> Any:
    return Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[red, blue, gate_tool], **kw
    )


def offered(request: ModelRequest) -> set[str]:
    return {spec.name for spec in request.tools}


async def last_text(proc: Any) -> str:
    return str((await proc.messages())[-1].text)


# ------------------------------------------------------------------ the scope itself


class _Mcp(Tool):
    def __init__(self, server: str, name: str) -> None:
        super().__init__(f"{server}__{name}", "an MCP tool", {"type": "object"})
        self.syscall = f"mcp.{server}.{name}"


def test_entries_match_names_mcp_servers_and_globs() -> None:
    tools: dict[str, Tool] = {t.name: t for t in (_Mcp("gh", "search"), _Mcp("gh", "issue"), _Mcp("db", "query"))}
    assert list(scoped(tools, ["mcp:gh"])) == ["gh__search", "gh__issue"]
    assert list(scoped(tools, ["db__*", "gh__issue"])) == ["gh__issue", "db__query"]
    assert list(scoped(tools, [])) == []
    assert scoped(tools, None) is tools
    assert allows(["Shell"], "Jobs") and not allows(["Read"], "Jobs")  # Jobs goes with Shell
    assert check_scope([" Read", "Read", "Grep "]) == ["Read", "Grep"]
    for bad in ("Read", [1], ["a\x00"], [""], ["mcp:"], ["x" * 300]):
        with pytest.raises((TypeError, ValueError)):
            check_scope(bad)
    # a child narrows: a name its parent offers, or the very pattern its parent has; nothing else
    assert widening(["gh__search", "mcp:gh"], ["mcp:gh"], tools) == []
    assert widening(["gh__*"], ["mcp:gh"], tools) == ["gh__*"]
    assert widening(["db__query"], ["mcp:gh"], tools) == ["db__query"]
    assert widening(None, ["Read"], {}) == ["*"] and widening(["x"], None, {}) == []


# ------------------------------------------------------------------ the kernel


async def test_the_model_sees_and_may_call_only_the_allowed_tools(tmp_path: Path) -> None:
    ran.clear()
    model = ScriptedModel(brain)
    async with open_kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice", tools=["red", "gate"])
        unscoped = await k.spawn(owner="alice")
        assert await proc.tools() == ["red", "gate"]
        assert await unscoped.tools() is None
        await proc.send("call red hi")
        await proc.wait_idle()
        assert await last_text(proc) == "result: red: hi"
        assert offered(model.requests[-1]) == {"red", "gate"}
        await proc.send("call blue sneaky")
        await proc.wait_idle()
        assert "blue" not in offered(model.requests[-1])
        result = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)][-1]
        assert result.is_error and "blue" in result.text and "not found" in result.text
        assert ran == ["red hi"]  # the hidden tool never ran
        await unscoped.send("call blue open")
        await unscoped.wait_idle()
        assert {"red", "blue", "gate"} <= offered(model.requests[-1]) and ran[-1] == "blue open"


async def test_unknown_names_are_refused_listing_the_available_ones(tmp_path: Path) -> None:
    async with open_kernel(tmp_path, ScriptedModel(brain)) as k:
        with pytest.raises(ToolScopeError) as bad:
            await k.spawn(owner="alice", pid="p1", tools=["red", "grene"])
        assert "'grene'" in str(bad.value) and "blue" in str(bad.value) and "red" in bad.value.available
        assert await k.store.get_process("p1") is None  # no process made
        with pytest.raises(ValueError, match="tools="):
            await k.spawn(owner="alice", kv={TOOLS_KEY: ["red"]})
        proc = await k.spawn(owner="alice", tools=["red", "mcp:later", "later__*"])  # patterns: not checked
        with pytest.raises(ToolScopeError):
            await proc.set_tools(["nope"])
        assert await proc.tools() == ["red", "mcp:later", "later__*"]  # unchanged
        assert "blue" in await proc.available_tools()
        await proc.kill()
        with pytest.raises(NoSuchProcess):
            await proc.set_tools(["red"])


async def test_a_restart_keeps_the_scope_and_a_fork_copies_it(tmp_path: Path) -> None:
    model = ScriptedModel(brain)
    async with open_kernel(tmp_path, model) as k:
        pid = (await k.spawn(owner="alice", tools=["blue"])).pid
    async with open_kernel(tmp_path, model) as k:
        proc = await k.process(pid)
        assert await proc.tools() == ["blue"]
        await proc.send("hello")
        await proc.wait_idle()
        assert offered(model.requests[-1]) == {"blue"}
        fork = await k.fork(pid)
        assert await fork.tools() == ["blue"]


async def test_a_change_applies_from_the_next_run(tmp_path: Path) -> None:
    model = ScriptedModel(brain)
    async with open_kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice", tools=["gate", "red"])
        await proc.send("gate g1")
        async with asyncio.timeout(5):
            while not model.requests:
                await asyncio.sleep(0.01)
        assert await proc.set_tools(["gate"]) == ["gate"]
        gate("g1").set()
        await proc.wait_idle()
        assert offered(model.requests[-1]) == {"gate", "red"}  # the run under way kept its tools
        await proc.send("again")
        await proc.wait_idle()
        assert offered(model.requests[-1]) == {"gate"}
        assert await proc.set_tools(None) is None
        await proc.send("all")
        await proc.wait_idle()
        assert {"gate", "red", "blue"} <= offered(model.requests[-1])
        events = [s async for s in proc.signals(follow=False)]
        assert any(s.signal == "proc.changed" and s.payload.get("changes") == ["tools"] for s in events)


async def test_a_subagent_inherits_the_scope_and_cannot_widen_it(tmp_path: Path) -> None:
    model = ScriptedModel(brain)
    async with open_kernel(tmp_path, model, subagents=True) as k:
        parent = await k.spawn(owner="alice", tools=["Task", "red"])
        await parent.send("task: x")
        await parent.wait_idle()
        assert await last_text(parent) == "result: answer: job x"
        (child,) = [r for r in await k.processes("alice") if r.parent_pid == parent.pid]
        sub = await k.process(child.pid)
        assert await sub.tools() == ["Task", "red"]
        child_request = next(r for r in model.requests if r.messages[-1].text == "job x")
        assert offered(child_request) == {"Task", "red"}
        with pytest.raises(ToolScopeError, match="widen"):
            await sub.set_tools(["red", "blue"])
        assert await sub.set_tools(["red"]) == ["red"]  # narrowing is fine
        assert await sub.set_tools(None) == ["Task", "red"]  # "all" for a child: its parent's
        with pytest.raises(ToolScopeError, match="widen"):
            await k.spawn(owner="alice", parent_pid=parent.pid, tools=["blue"])
        narrow = await k.spawn(owner="alice", parent_pid=parent.pid, tools=["red"])
        assert await narrow.tools() == ["red"]


async def test_a_scoped_process_may_not_delegate_to_a_wider_one(tmp_path: Path) -> None:
    ran.clear()
    async with open_kernel(tmp_path, ScriptedModel(brain), subagents=True) as k:
        wide = await k.spawn(owner="alice")
        narrow_target = await k.spawn(owner="alice", tools=["red"])
        source = await k.spawn(owner="alice", tools=["Delegate", "red"])
        await source.send(f"delegate {wide.pid}: call blue x")
        await source.wait_idle()
        assert "may use tools you may not" in await last_text(source)
        assert await wide.history() == []  # nothing was delivered
        await source.send(f"delegate {narrow_target.pid}: hello")
        await source.wait_idle()
        assert "answer: Delegated task" in await last_text(source)  # a target no wider: delivered


# ------------------------------------------------------------------ HTTP, WebSocket, client

server = server_support.module_server("tool-scope")
alice = server_support.alice


async def test_http_spawn_with_tools_and_change_them(server: LiveServer, alice: httpx.AsyncClient) -> None:
    resp = await alice.post("/v1/processes", json={"tools": ["slow"], "text": "echo hi"})
    assert resp.status_code == 201, resp.text
    pid = resp.json()["pid"]
    await server_support.wait_idle(alice, pid)
    history = (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"]
    results = [m["message"] for m in history if m["message"]["role"] == "toolResult"]
    assert results and results[-1]["isError"] and results[-1]["content"][0]["text"] == "Tool echo not found"

    got = server_support.checked(await alice.get(f"/v1/processes/{pid}/tools"), api.ToolsOut)
    assert got["tools"] == ["slow"] and {"echo", "slow"} <= set(got["available"])
    resp = await alice.post(f"/v1/processes/{pid}/tools", json={"tools": ["echo"]})
    changed = server_support.checked(resp, api.ToolsOut)
    assert changed["tools"] == ["echo"]
    for bad in ({"tools": ["ech0"]}, {"tools": "echo"}, {"tools": [5]}, {}, {"tools": ["a\u0000"]}):
        resp = await alice.post(f"/v1/processes/{pid}/tools", json=bad)
        server_support.refused(resp, 400, "invalid_request")
    resp = await alice.post(f"/v1/processes/{pid}/tools", json={"tools": ["ech0"]})
    assert "ech0" in resp.json()["message"] and "slow" in resp.json()["message"]  # the available ones
    assert (await alice.get(f"/v1/processes/{pid}/tools")).json()["tools"] == ["echo"]
    server_support.refused(await alice.post("/v1/processes", json={"tools": ["nope"]}), 400, "invalid_request")
    async with server.client(server.tokens.bob) as bob:
        server_support.refused(await bob.get(f"/v1/processes/{pid}/tools"), 404, "not_found")
        server_support.refused(await bob.post(f"/v1/processes/{pid}/tools", json={"tools": None}), 404, "not_found")
    cleared = (await alice.post(f"/v1/processes/{pid}/tools", json={"tools": None})).json()
    assert cleared["tools"] is None
    paths = api.openapi_document()["paths"]
    assert {"get", "post"} <= set(paths["/v1/processes/{pid}/tools"]) and "tools" in api.SpawnBody.model_fields


async def test_client_methods(server: LiveServer) -> None:
    async with AgentloopClient(server.url, server.tokens.alice) as client:
        pid = (await client.spawn(tools=["echo"]))["pid"]
        assert (await client.tools(pid))["tools"] == ["echo"]
        assert (await client.set_tools(pid, ["slow", "echo"]))["tools"] == ["slow", "echo"]
        with pytest.raises(ClientError) as bad:
            await client.set_tools(pid, ["nope"])
        assert bad.value.status == 400 and "echo" in bad.value.message
        assert (await client.set_tools(pid, None))["tools"] is None


def test_websocket_spawn_and_tools_calls(tmp_path: Path) -> None:
    with KernelServer(tmp_path, ScriptedModel(brain)) as srv, srv.client("alice") as c, srv.client("bob") as bob:
        pid = c.ok("proc.spawn", {"tools": ["Read"]})["pid"]
        got = c.ok("proc.tools.get", {"pid": pid})
        assert got["tools"] == ["Read"] and "Read" in got["available"]
        assert c.ok("proc.tools.set", {"pid": pid, "tools": []})["tools"] == []
        for bad in ({"pid": pid, "tools": ["nope"]}, {"pid": pid}, {"pid": pid, "tools": "Read"}):
            res = c.call("proc.tools.set", bad)
            assert not res["ok"] and res["error"]["code"] == "invalid_request", (bad, res)
        assert not c.call("proc.spawn", {"tools": ["nope"]})["ok"]
        assert bob.error("proc.tools.get", {"pid": pid}) == "not_found"
        assert c.ok("proc.tools.set", {"pid": pid, "tools": None})["tools"] is None
