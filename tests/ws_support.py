"""A real ``agentloop serve``-like server for WebSocket tests, and a small synchronous client.

The kernel, the accounts and uvicorn share one event loop in a background thread (the kernel's
tasks are bound to the loop that opened it), so a test drives the server over a real socket from
plain synchronous code and can still run coroutines inside the server's loop with ``run``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from agentloop import Agent, ScriptedModel
from agentloop.kernel import Kernel
from agentloop.server.app import create_server
from agentloop.server.auth import Accounts
from agentloop.server.context import ServerContext


class KernelServer:
    """A kernel on a SQLite file under ``tmp_path`` served by ``create_server``; accounts ``alice``,
    ``bob`` and the admin ``root``, whose tokens are in ``tokens``. A context manager."""

    def __init__(self, tmp_path: Path, model: ScriptedModel, *, devices: Any = None, **kernel_kw: Any) -> None:
        self.tmp_path = tmp_path
        self.model = model
        self.devices = devices
        self.kernel_kw = kernel_kw
        self.tokens: dict[str, str] = {}
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"ws://127.0.0.1:{self._sock.getsockname()[1]}/v1/ws"
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._thread_main, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ctx: ServerContext | None = None
        self.server: uvicorn.Server | None = None

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        url = f"sqlite:///{self.tmp_path}/agentloop.db"
        async with Kernel.open(url, model=self.model, workspace=self.tmp_path, **self.kernel_kw) as kernel:
            accounts = Accounts(kernel.store)
            await accounts.create_account("root", admin=True)
            for name in ("alice", "bob"):
                await accounts.create_account(name)
            for name in ("alice", "bob", "root"):
                self.tokens[name] = (await accounts.create_token(name))[0]
            self.ctx = ServerContext(kernel, accounts, devices=self.devices)
            app = create_server(self.ctx, lambda: Agent(ScriptedModel(["hi"])))
            config = uvicorn.Config(
                app, log_level="critical", lifespan="off", access_log=False, timeout_graceful_shutdown=1
            )
            self.server = uvicorn.Server(config)
            self.loop = asyncio.get_running_loop()
            serving = asyncio.create_task(self.server.serve(sockets=[self._sock]))
            while not self.server.started and not serving.done():
                await asyncio.sleep(0.005)
            self._ready.set()
            await serving

    def start(self) -> KernelServer:
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError("the test server did not start") from self._error
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> KernelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def run(self, work: Callable[[], Coroutine[Any, Any, Any]] | Awaitable[Any], timeout: float = 10) -> Any:
        """Run a coroutine inside the server's loop and return its result."""
        assert self.loop is not None
        coro = work() if callable(work) else work
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def call_soon(self, fn: Callable[[], Any]) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn)

    def ws_tasks(self, name: str = "") -> int:
        """Tasks alive in the server's loop that run a ``ws.Connection`` method (``name``: only that
        one). Counting by coroutine, not all tasks, keeps the number exact while unrelated tasks
        (uvicorn's, a just-answered request's) come and go."""
        prefix = f"Connection.{name}"

        async def count() -> int:
            names = [getattr(t.get_coro(), "__qualname__", "") for t in asyncio.all_tasks()]
            return sum(n.startswith(prefix) for n in names)

        return int(self.run(count))

    def client(self, account: str | None = None, **kw: Any) -> Client:
        """A client, already connected as ``account`` when one is given."""
        # entered by hand: the client outlives this call, and Client.close closes it
        client = Client(connect(self.url, open_timeout=5, close_timeout=2, max_size=None, **kw).__enter__())
        if account is not None:
            client.ok("sys.connect", {"role": "user", "token": self.tokens[account]})
        return client


def strict_json(text: str) -> Any:
    """``text`` parsed as JSON proper: ``NaN`` and ``Infinity`` are JavaScript's, not JSON's, and
    a browser's ``JSON.parse`` refuses them."""

    def refuse(name: str) -> Any:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


class Client:
    """A synchronous WebSocket client that keeps the ``sig`` frames it reads past in ``sigs``."""

    _ids = itertools.count(1)

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.sigs: list[dict[str, Any]] = []
        self.answers: dict[str, dict[str, Any]] = {}

    def close(self) -> None:
        self.ws.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, frame: Any) -> None:
        self.ws.send(frame if isinstance(frame, str | bytes) else json.dumps(frame))

    def request(self, call: str, args: dict[str, Any] | None = None, *, rid: str | None = None) -> str:
        rid = rid or f"r{next(self._ids)}"
        self.send({"type": "req", "id": rid, "call": call, "args": args or {}})
        return rid

    def frame(self, timeout: float = 5) -> dict[str, Any]:
        frame: dict[str, Any] = strict_json(self.ws.recv(timeout))  # (every frame, in every test)
        return frame

    def answer(self, rid: str | None, timeout: float = 5) -> dict[str, Any]:
        """The ``res`` for ``rid``, keeping signals and other answers read on the way."""
        deadline = time.monotonic() + timeout
        while rid not in self.answers:
            frame = self.frame(max(0.01, deadline - time.monotonic()))
            if frame["type"] == "sig":
                self.sigs.append(frame)
            else:
                assert frame["type"] == "res", frame
                self.answers[frame["id"]] = frame
        return self.answers.pop(rid)

    def call(self, call: str, args: dict[str, Any] | None = None, timeout: float = 5) -> dict[str, Any]:
        return self.answer(self.request(call, args), timeout)

    def ok(self, call: str, args: dict[str, Any] | None = None) -> Any:
        res = self.call(call, args)
        assert res["ok"], res
        return res["data"]

    def error(self, call: str, args: dict[str, Any] | None = None) -> str:
        res = self.call(call, args)
        assert not res["ok"], res
        assert set(res["error"]) == {"code", "message"} and isinstance(res["error"]["message"], str)
        code: str = res["error"]["code"]
        return code

    def signals_until(self, pid: str, name: str, timeout: float = 5) -> list[dict[str, Any]]:
        """Read until a ``sig`` named ``name`` for ``pid`` arrives; returns (and forgets) every signal
        of ``pid`` read so far."""
        deadline = time.monotonic() + timeout
        while not any(s["pid"] == pid and s["signal"] == name for s in self.sigs):
            frame = self.frame(max(0.01, deadline - time.monotonic()))
            if frame["type"] == "sig":
                self.sigs.append(frame)
            else:
                self.answers[frame["id"]] = frame
        mine = [s for s in self.sigs if s["pid"] == pid]
        self.sigs = [s for s in self.sigs if s["pid"] != pid]
        return mine


def closed_code(client: Client, timeout: float = 5) -> int | None:
    """Read until the server closes the socket; the close code it sent."""
    deadline = time.monotonic() + timeout
    with pytest.raises(ConnectionClosed) as info:
        while time.monotonic() < deadline:
            client.frame(timeout=max(0.01, deadline - time.monotonic()))
    rcvd = info.value.rcvd
    return rcvd.code if rcvd is not None else None


def eventually(check: Any, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)
