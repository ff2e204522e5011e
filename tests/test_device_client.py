"""Devices end to end: the real server (``create_server`` under uvicorn in this event loop, a
kernel on SQLite, a scripted model) and a device, in-process or as a subprocess of ``agentloop
device connect``, serving its own root. Covers routed Read/Shell, the path rules on the device,
extra tools, request.cancel killing a shell group, a device killed mid-call, reconnecting after a
server restart, SIGTERM, a bad token, a name conflict, and ``GET /v1/devices``. Devices connect
with a device token (``agentloop device token``), as documented; an account token only on a server
that allows it (``serve --device-account-tokens``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette

from agentloop import Agent, Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.client import AgentloopClient
from agentloop.device.client import DeviceClient, DeviceOptions, parse_allow, websocket_url
from agentloop.kernel import Kernel
from agentloop.models.base import ModelRequest
from agentloop.server.app import create_server
from agentloop.server.auth import Accounts, Principal
from agentloop.server.context import ServerContext
from agentloop.server.devices import DeviceHub

PIPE = asyncio.subprocess.PIPE

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")


# ------------------------------------------------------------------ the server


class Server:
    """uvicorn on a fixed port in the running loop; ``stop`` and ``start`` again to restart it."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        config = uvicorn.Config(
            self.app, log_level="critical", lifespan="off", access_log=False, timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            assert not self.task.done(), "the server did not start"
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self.task is not None:
            self.server.should_exit = True
            await asyncio.wait_for(self.task, 10)
            self.task = None
            self.sock.close()


class World:
    """``token``: what device ``box`` connects with (its device token, unless the hub takes account
    tokens); ``account_token``: alice's, for user calls."""

    def __init__(self, kernel: Kernel, hub: DeviceHub, server: Server, token: str, tmp: Path) -> None:
        self.kernel, self.hub, self.server, self.token, self.tmp = kernel, hub, server, token, tmp
        self.account_token = token
        self.device_root = tmp / "device"
        self.device_root.mkdir()
        (self.device_root / "hello.txt").write_text("greetings from the device\n")
        (tmp / "outside.txt").write_text("secret next to the device root\n")

    async def online(self, name: str, present: bool = True, timeout: float = 20) -> None:  # noqa: ASYNC109
        await self.hub.wait_until(lambda: any(d.id == name for d in self.hub.online("alice")) == present, timeout)

    async def spawn_device(self, name: str, *extra: str, module: str = "agentloop.cli.device") -> Any:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - a file the child writes to
        args = [sys.executable, "-m", module, "device"] if module.endswith("main") else [sys.executable, "-m", module]
        args += ["connect", self.server.url, "--name", name, "--root", str(self.device_root)]
        args += ["--backoff", "0.1", "--backoff-max", "0.5", *extra]
        env = {**os.environ, "AGENTLOOP_TOKEN": self.token}
        proc = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=log, env=env
        )
        log.close()
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")


def script(req: ModelRequest) -> Reply | str:
    """Tool calls chosen by the last user message; then the tool results, joined."""
    results = [m for m in req.messages if isinstance(m, ToolResultMessage)]
    last_user = max(i for i, m in enumerate(req.messages) if m.role == "user")
    if not any(i > last_user for i, m in enumerate(req.messages) if isinstance(m, ToolResultMessage)):
        text = req.messages[last_user].text  # type: ignore[union-attr]
        if text == "read":
            return Reply(
                tool_calls=[
                    call("Read", path="hello.txt", target="box"),
                    call("Shell", command="pwd && cat hello.txt", target="box"),
                    call("Read", path="../outside.txt", target="box"),
                    call("Read", path="hello.txt"),  # local: the server's workspace has no such file
                ]
            )
        if text == "sleep":
            return Reply(tool_calls=[call("Shell", command="echo $$ > shell.pid; exec sleep 30", target="box")])
        if text.startswith("call "):
            name, args = text[5:].split(" ", 1)
            return Reply(tool_calls=[call(name, **json.loads(args))])
    return "\n---\n".join(("ERROR " if m.is_error else "OK ") + m.text for m in results[-4:])


@contextlib.asynccontextmanager
async def world(
    tmp_path: Path, *, account_tokens: bool = False, heartbeat: float | None = None
) -> AsyncIterator[World]:
    hub = DeviceHub(probe_timeout=0.5, account_tokens=account_tokens)
    workspace = tmp_path / "server"
    workspace.mkdir()
    url = f"sqlite:///{tmp_path}/agentloop.db"
    async with Kernel.open(url, model=ScriptedModel(script), workspace=workspace, devices=hub) as kernel:
        accounts = Accounts(kernel.store)
        await accounts.create_account("alice")
        token, _ = await accounts.create_token("alice")
        ctx = ServerContext(kernel, accounts, devices=hub)
        if heartbeat is not None:  # (how soon a revoked token closes its socket)
            ctx.heartbeat = heartbeat
        server = Server(create_server(ctx, lambda: Agent(ScriptedModel(["unused"]))))
        await server.start()
        w = World(kernel, hub, server, token, tmp_path)
        if not account_tokens:  # the documented way: a token bound to the device (named box in every test)
            async with AgentloopClient(server.url, token) as client:
                w.token = (await client.device_token("box"))["token"]
        try:
            yield w
        finally:
            await hub.close()
            await server.stop()


async def ask(w: World, text: str, timeout: float = 20) -> str:  # noqa: ASYNC109
    proc = await w.kernel.spawn("alice", interactive=False)
    await proc.send(text)
    await asyncio.wait_for(proc.wait_idle(), timeout)
    return (await proc.messages())[-1].text


def alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process is left in the process group ``pgid``."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


async def read_pid(path: Path, timeout: float = 10) -> int:  # noqa: ASYNC109
    async with asyncio.timeout(timeout):
        while not (path.exists() and path.read_text().strip()):
            await asyncio.sleep(0.02)
    return int(path.read_text())


async def gone(pgid: int, timeout: float = 5) -> bool:  # noqa: ASYNC109
    """Whether the whole group dies within ``timeout`` (the shell and what it started)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while alive(pgid) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return not alive(pgid)


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


# ------------------------------------------------------------------ tests


def test_addresses_and_allow_lists():
    assert websocket_url("http://h:8765") == "ws://h:8765/v1/ws"
    assert websocket_url("https://h/base/") == "wss://h/base/v1/ws"
    assert websocket_url("ws://h:1/v1/ws") == "ws://h:1/v1/ws"
    assert websocket_url("h:8765") == "ws://h:8765/v1/ws"
    with pytest.raises(ValueError):
        websocket_url("ftp://h")
    with pytest.raises(ValueError) as refused:  # said on the terminal and in logs: the password masked
        websocket_url("ftp://bob:hunter2@h")
    assert "hunter2" not in str(refused.value) and "bob" in str(refused.value)
    with pytest.raises(ValueError, match="Port out of range"):  # a typo: said once, not retried forever
        websocket_url("http://127.0.0.1:99999")
    assert parse_allow("fs") == ("fs.read", "fs.write", "fs.edit", "fs.delete", "fs.search")
    assert parse_allow("read") == ("fs.read", "fs.search")
    assert parse_allow("shell, fs.read") == ("shell.exec", "fs.read")
    with pytest.raises(ValueError, match="unknown 'net'"):
        parse_allow("net")


async def test_a_device_subprocess_serves_read_and_shell_then_dies_mid_call(tmp_path):
    async with world(tmp_path) as w:
        device = await w.spawn_device("box", "--allow", "fs,shell", "--description", "the build box")
        try:
            await w.online("box")
            async with httpx.AsyncClient(base_url=w.server.url) as http:
                listed = await http.get("/v1/devices", headers={"Authorization": f"Bearer {w.account_token}"})
            assert listed.status_code == 200, listed.text
            [box] = listed.json()["devices"]
            assert box["id"] == "box" and box["owner"] == "alice" and "shell.exec" in box["implements"]
            assert box["description"] == "the build box"  # --description, as the agents' prompts show it
            answer = await ask(w, "read")
            first, shell, escape, local = answer.split("\n---\n")
            assert first.startswith("OK ") and "greetings from the device" in first
            assert shell.startswith("OK ") and str(w.device_root.resolve()) in shell and "greetings" in shell
            assert escape.startswith("ERROR ") and "escapes the workspace" in escape and "secret" not in escape
            assert local.startswith("ERROR ") and "File not found" in local  # target local: the server's files
            # a long command on the device; the device dies in the middle of it
            proc = await w.kernel.spawn("alice", interactive=False)
            await proc.send("sleep")
            pid = await read_pid(w.device_root / "shell.pid")
            device.kill()
            await device.wait()
            await asyncio.wait_for(proc.wait_idle(), 20)
            result = (await proc.messages())[-1].text
            assert result.startswith("ERROR ") and "Device box disconnected" in result, result
            await w.online("box", present=False, timeout=5)
            kill_group(pid)  # SIGKILL gave the device no chance to stop its shell: clean up after it
        finally:
            if device.returncode is None:
                device.kill()
                await device.wait()


async def test_the_device_reconnects_after_a_server_restart_and_stops_cleanly_on_sigterm(tmp_path):
    async with world(tmp_path) as w:
        device = await w.spawn_device("box", "--allow", "shell")
        try:
            await w.online("box")
            assert [d["implements"] for d in w.hub.list(_alice())] == [["shell.exec"]]
            await w.server.stop()
            await w.online("box", present=False, timeout=10)
            await w.server.start()
            await w.online("box")  # back, with backoff
            assert "reconnecting in" in w.log("box")
            result = await w.hub.call("alice", "box", "shell.exec", {"command": "cat hello.txt"}, 10)
            assert not result.is_error and "greetings" in result.content[0].text
            refused = await w.hub.call("alice", "box", "fs.read", {"path": "hello.txt"}, 10)
            assert refused.is_error and "does not implement fs.read" in refused.content[0].text
            # SIGTERM while a command runs: the device kills it, closes, exits 0
            pending = asyncio.create_task(
                w.hub.call("alice", "box", "shell.exec", {"command": "echo $$ > shell.pid; exec sleep 30"}, 60)
            )
            pid = await read_pid(w.device_root / "shell.pid")
            device.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(device.wait(), 10) == 0, w.log("box")
            outcome = await asyncio.wait_for(pending, 5)
            assert outcome.is_error and "disconnected" in outcome.content[0].text
            assert await gone(pid), "the device left its shell command running"
            assert "stopped" in w.log("box")
        finally:
            if device.returncode is None:
                device.kill()
                await device.wait()


async def test_a_cancelled_call_kills_the_shell_group_and_extra_tools_are_served(tmp_path):
    @tool
    def greet(name: str) -> str:
        """Say hello."""
        return f"hello {name} from the device"

    async with world(tmp_path) as w:
        options = DeviceOptions(
            url=w.server.url,
            token=w.token,
            name="box",
            root=w.device_root,
            implements=parse_allow("fs,shell"),
            tools=[greet],
            backoff_initial=0.05,
        )
        client = DeviceClient(options, say=lambda text: None)
        running = asyncio.create_task(client.run())
        try:
            await w.online("box")
            answer = await ask(w, 'call box__greet {"name": "ann"}')
            assert answer == "OK hello ann from the device"
            bad = await ask(w, 'call box__greet {"name": 3}')
            assert bad.startswith("ERROR ") and "Validation failed" in bad
            command = "echo $$ > shell.pid; sleep 30 & sleep 30"  # a group of two
            timed_out = asyncio.create_task(w.hub.call("alice", "box", "shell.exec", {"command": command}, 1.5))
            pid = await read_pid(w.device_root / "shell.pid")
            result = await timed_out
            assert result.is_error and "timed out after 1.5 s" in result.content[0].text
            assert await gone(pid), "request.cancel left the shell running"
            # a second live device under the same name is refused, and keeps retrying quietly
            said: list[str] = []
            twin = DeviceClient(replace(options, backoff_initial=0.05, backoff_max=0.1), say=said.append)
            retrying = asyncio.create_task(twin.run())
            try:
                async with asyncio.timeout(10):
                    while sum("(conflict)" in line for line in said) < 2:
                        await asyncio.sleep(0.02)
            finally:
                retrying.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await retrying
            assert twin.connections == 0 and client.connections == 1 and client.connected.is_set()
        finally:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running


async def test_by_default_a_device_lends_reading_files_and_not_the_shell(tmp_path):
    """Security by default: without --allow the device reads and searches files under its root;
    a shell command or a file change routed to it is refused, and nothing runs on the machine."""
    assert DeviceOptions(url="ws://h/v1/ws", token="t", name="d", root=tmp_path).implements == (
        "fs.read",
        "fs.search",
    )
    async with world(tmp_path) as w:
        device = await w.spawn_device("box")
        try:
            await w.online("box")
            assert [d["implements"] for d in w.hub.list(_alice())] == [["fs.read", "fs.search"]]
            read = await w.hub.call("alice", "box", "fs.read", {"path": "hello.txt"}, 10)
            assert not read.is_error and "greetings" in read.content[0].text
            command = {"command": "touch ran.txt"}
            shell = await w.hub.call("alice", "box", "shell.exec", command, 10)
            assert shell.is_error and "does not implement shell.exec" in shell.content[0].text
            write = await w.hub.call("alice", "box", "fs.write", {"path": "new.txt", "content": "x"}, 10)
            assert write.is_error and "does not implement fs.write" in write.content[0].text
            assert not (w.device_root / "ran.txt").exists() and not (w.device_root / "new.txt").exists()
            assert "read-only; --allow fs,shell" in w.log("box")
        finally:
            if device.returncode is None:
                device.kill()
                await device.wait()


async def test_a_refused_token_is_fatal_with_a_clear_message(tmp_path):
    async with world(tmp_path) as w:
        w.token = "al_not-a-token"
        device = await w.spawn_device("box", module="agentloop.cli.main")
        try:
            assert await asyncio.wait_for(device.wait(), 20) == 1
        finally:
            if device.returncode is None:
                device.kill()
                await device.wait()
        log = w.log("box")
        assert "error: the server refused the connection" in log and "unauthorized" in log
        assert "reconnecting" not in log


async def test_a_device_token_from_the_cli_connects_and_an_account_token_does_not(tmp_path):
    """``agentloop device token box`` prints the token once, which ``device connect`` then uses;
    the account token itself is refused for a device, fatally and saying what to do instead."""
    async with world(tmp_path, heartbeat=0.1) as w:
        env = {**os.environ, "AGENTLOOP_SERVER": w.server.url, "AGENTLOOP_TOKEN": w.account_token}
        env.pop("AGENTLOOP_DEVICE_TOKEN", None)
        cli = [sys.executable, "-m", "agentloop.cli.main", "device", "token", "box"]
        issued = await asyncio.create_subprocess_exec(*cli, stdout=PIPE, stderr=PIPE, env=env)
        out, err = await asyncio.wait_for(issued.communicate(), 30)
        assert issued.returncode == 0, err
        token = out.decode().strip()
        assert token.startswith("al_dev_") and token not in err.decode() and "shown only this once" in err.decode()
        w.token = w.account_token  # refused: a device needs its own token
        refused = await w.spawn_device("box", module="agentloop.cli.main")
        assert await asyncio.wait_for(refused.wait(), 20) == 1
        assert "device token" in w.log("box") and "reconnecting" not in w.log("box")
        w.token = token
        device = await w.spawn_device("box")
        try:
            await w.online("box")
            async with AgentloopClient(w.server.url, w.account_token) as client:
                [box] = await client.devices()
                assert (box["id"], box["online"], box["has_token"]) == ("box", True, True)
            revoke = await asyncio.create_subprocess_exec(*cli, "--revoke", stdout=PIPE, stderr=PIPE, env=env)
            out, err = await asyncio.wait_for(revoke.communicate(), 30)
            assert revoke.returncode == 0 and out.decode().strip() == "revoked the token of device box", err
            assert await asyncio.wait_for(device.wait(), 20) == 1  # closed at the next heartbeat, then refused
            again = await asyncio.create_subprocess_exec(*cli, "--revoke", stdout=PIPE, stderr=PIPE, env=env)
            out, err = await asyncio.wait_for(again.communicate(), 30)
            assert again.returncode == 1 and "has no token" in err.decode()
        finally:
            if device.returncode is None:
                device.kill()
                await device.wait()


async def test_a_server_that_allows_account_tokens_still_connects_a_device_with_one(tmp_path):
    """``serve --device-account-tokens``: the way devices connected before device tokens."""
    async with world(tmp_path, account_tokens=True) as w:
        assert w.token == w.account_token
        device = await w.spawn_device("box")
        try:
            await w.online("box")
            read = await w.hub.call("alice", "box", "fs.read", {"path": "hello.txt"}, 10)
            assert not read.is_error and "greetings" in read.content[0].text
        finally:
            if device.returncode is None:
                device.kill()
                await device.wait()


def _alice() -> Principal:
    return Principal("alice", False, "t")
