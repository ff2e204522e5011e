"""A real ``agentloop serve``-like server for tests: kernel, accounts and uvicorn in one thread.

The kernel's engine, signal hub and store belong to one event loop, so the whole server (kernel
included) runs in its own thread with its own loop, exactly as in production; tests talk to it
over a real socket with ``httpx.AsyncClient`` and reach into its loop only through ``run``.

Accounts: ``alice``, ``bob`` and ``admin`` (an admin), each with a token, plus a revoked token
of alice's. The model is scripted and stateless, so one server can serve many tests:
- ``echo <text>`` calls the ``echo`` tool, then answers ``done: <text>``;
- ``risky`` calls ``echo`` with an argument the approval policy asks about;
- ``sleep <seconds>`` calls the ``slow`` tool (for abort);
- anything else answers ``answer: <text>`` (streamed in small chunks).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn

from agentloop import Agent, Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Approval, Kernel
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest
from agentloop.server import ServerContext, create_server
from agentloop.server.auth import Accounts

T = TypeVar("T")


@tool
def echo(text: str) -> str:
    """Echo the text back."""
    return text


@tool
async def slow(seconds: float) -> str:
    """Sleep a while."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


def script(req: ModelRequest) -> Reply | str:
    last = req.messages[-1]
    if isinstance(last, ToolResultMessage):
        return f"done: {last.text}"
    text = last.text if isinstance(last, UserMessage) else ""
    if text == "risky":
        return Reply(tool_calls=[call("echo", text="risky")])
    if text.startswith("echo "):
        return Reply(tool_calls=[call("echo", text=text[5:])])
    if text.startswith("sleep "):
        return Reply(tool_calls=[call("slow", seconds=float(text[6:]))])
    return f"answer: {text}"


async def asking_policy(process: Any, row: Any) -> Approval:
    if row.tool_name == "echo" and row.args.get("text") == "risky":
        return Approval("ask", ("destructive",), "echo of something risky", fingerprint=json.dumps(row.args))
    return Approval("auto")


def engine_agent() -> Agent:
    """The agent ``POST /engine/chat`` runs."""
    return Agent(model=ScriptedModel(["hello from the engine"]))


@dataclass
class Tokens:
    alice: str = ""
    bob: str = ""
    admin: str = ""
    revoked: str = ""  # alice's, revoked


@dataclass
class LiveServer:
    """The server thread. ``url``, ``tokens`` and ``ctx`` are set once ``start`` returns."""

    data: Path
    heartbeat: float = 15.0
    max_body: int = 1024 * 1024
    devices: Any = None
    store_url: str = ""  # the kernel's store; a SQLite file in ``data`` when empty
    model: Any = None  # the kernel's model; ``script`` when None
    kernel_options: dict[str, Any] = field(default_factory=dict)  # more ``Kernel.open`` arguments
    url: str = ""
    tokens: Tokens = field(default_factory=Tokens)
    ctx: ServerContext | None = None
    app: Any = None
    loop: asyncio.AbstractEventLoop | None = None
    _server: uvicorn.Server | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _error: BaseException | None = None

    def start(self) -> LiveServer:
        # proto=IPPROTO_TCP, not 0: asyncio only sets TCP_NODELAY on sockets that say they are TCP,
        # and without it every response written in two parts waits ~40 ms for a delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._run, args=(sock,), daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"the test server did not start: {self._error!r}")
        return self

    def _run(self, sock: socket.socket) -> None:
        try:
            asyncio.run(self._main(sock))
        except BaseException as exc:
            self._error = exc
            self._ready.set()
        finally:
            sock.close()

    async def _main(self, sock: socket.socket) -> None:
        model = self.model or ScriptedModel(script, chunk=4, keep_requests=False)
        url = self.store_url or f"sqlite:///{self.data}/agentloop.db"
        options: dict[str, Any] = {"tools": [echo, slow], "approval": asking_policy, **self.kernel_options}
        async with Kernel.open(url, model=model, workspace=self.data, **options) as kernel:
            accounts = Accounts(kernel.store)
            await self.make_accounts(accounts)
            self.ctx = ServerContext(
                kernel, accounts, devices=self.devices, max_body=self.max_body, heartbeat=self.heartbeat
            )
            self.app = create_server(self.ctx, engine_agent)
            config = uvicorn.Config(
                self.app, log_level="critical", lifespan="off", access_log=False, timeout_graceful_shutdown=1
            )
            self._server = uvicorn.Server(config)
            self.loop = asyncio.get_running_loop()
            serving = asyncio.create_task(self._server.serve(sockets=[sock]))
            while not self._server.started and not serving.done():
                await asyncio.sleep(0.005)
            self._ready.set()
            await serving

    async def make_accounts(self, accounts: Accounts) -> None:
        """The accounts the tests use, and their tokens in ``tokens``."""
        await accounts.create_account("alice")
        await accounts.create_account("bob")
        await accounts.create_account("admin", admin=True)
        self.tokens.alice, _ = await accounts.create_token("alice")
        self.tokens.bob, _ = await accounts.create_token("bob")
        self.tokens.admin, _ = await accounts.create_token("admin")
        self.tokens.revoked, record = await accounts.create_token("alice", label="old")
        await accounts.revoke(record.id)

    async def run(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()`` on the server's loop (e.g. to set ``ctx.stopping`` or count watchers)."""
        assert self.loop is not None

        async def wrapped() -> T:
            return await fn()

        future: Future[T] = asyncio.run_coroutine_threadsafe(wrapped(), self.loop)
        return await asyncio.wrap_future(future)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=10)

    def client(self, token: str | None, **kw: Any) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=10, **kw)

    def watchers(self, pid: str) -> int:
        """How many signal watchers the kernel's hub holds for ``pid`` (read across threads: a
        snapshot, good enough to see a leak settle to zero)."""
        assert self.ctx is not None
        return len(self.ctx.kernel.engine.hub._watchers.get(pid, ()))


@contextmanager
def live_server(data: Path, **kw: Any) -> Iterator[LiveServer]:
    server = LiveServer(data, **kw).start()
    try:
        yield server
    finally:
        server.stop()


def module_server(name: str) -> Any:
    """A module-scoped ``server`` fixture: a live server on a fresh directory named after ``name``.
    Use as ``server = module_server("queue")``; ``alice`` and ``bob`` below talk to it."""

    @pytest.fixture(scope="module")
    def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
        with live_server(tmp_path_factory.mktemp(name)) as srv:
            yield srv

    return server


# Client fixtures of the module's ``server`` fixture; bring them in as ``alice = server_support.alice``
# (an assignment, so a test's ``alice`` argument does not read as shadowing an unused import).
@pytest.fixture
async def alice(server: LiveServer) -> AsyncIterator[httpx.AsyncClient]:
    async with server.client(server.tokens.alice) as client:
        yield client


@pytest.fixture
async def bob(server: LiveServer) -> AsyncIterator[httpx.AsyncClient]:
    async with server.client(server.tokens.bob) as client:
        yield client


def checked(resp: httpx.Response, model: type[Any], status: int = 200) -> dict[str, Any]:
    """The answer's JSON, after checking its status and that it fits ``model`` (a looser
    ``test_server_api.shape``: the content type is not checked)."""
    assert resp.status_code == status, resp.text
    data: dict[str, Any] = resp.json()
    model.model_validate(data)
    return data


def refused(resp: httpx.Response, status: int, code: str) -> None:
    """The answer is an error of ``status`` with ``code`` (a looser ``test_server_api.error``)."""
    assert resp.status_code == status, resp.text
    assert resp.json()["code"] == code, resp.text


async def pending_requests(client: httpx.AsyncClient, pid: str) -> list[dict[str, Any]]:
    """Poll the process's approval requests until there is one; all of them."""
    found: list[dict[str, Any]] = []

    async def asked() -> bool:
        nonlocal found
        found = (await client.get(f"/v1/processes/{pid}/hil")).json()["requests"]
        return bool(found)

    await wait_until(asked)
    return found


def remote_chat(server: LiveServer, stdin: str) -> tuple[str, str]:
    """A chat REPL over HTTP as bob, on a new process of the server, reading ``stdin``: what it
    wrote to stdout and to stderr."""
    import io

    from rich.console import Console

    from agentloop.cli.chat import ChatRepl, PlainReader
    from agentloop.cli.client import RemoteSession
    from agentloop.client import AgentloopClient

    out, err = io.StringIO(), io.StringIO()
    reader = PlainReader(io.StringIO(stdin))
    ev = asyncio.new_event_loop()
    client = AgentloopClient(server.url, server.tokens.bob)
    try:
        session = RemoteSession(client)
        ev.run_until_complete(session.open(new=True))
        repl = ChatRepl(session, reader=reader, out=out, err=Console(file=err, width=200))
        assert repl.loop(ev) == 0
    finally:
        ev.run_until_complete(client.aclose())
        ev.close()
    return out.getvalue(), err.getvalue()


def parse_sse(text: str) -> list[dict[str, Any]]:
    """Frames of an SSE body: each a dict with the fields it had (``event``, ``id``, ``data``,
    ``comment``); ``data`` is decoded JSON."""
    frames = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        frame: dict[str, Any] = {}
        for line in block.split("\n"):
            if line.startswith(":"):
                frame["comment"] = line[1:].strip()
            elif ":" in line:
                name, _, value = line.partition(":")
                frame[name] = value[1:] if value.startswith(" ") else value
        if "data" in frame:
            frame["data"] = json.loads(frame["data"])
        if frame:
            frames.append(frame)
    return frames


async def wait_until(check: Callable[[], Awaitable[bool] | bool], seconds: float = 5.0) -> None:
    """Poll ``check`` (sync or async) until it holds."""
    for _ in range(int(seconds / 0.01)):
        result = check()
        if await result if inspect.isawaitable(result) else result:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


async def wait_idle(client: httpx.AsyncClient, pid: str, seconds: float = 5.0) -> dict[str, Any]:
    """Poll the process until no run is active; its final state."""
    out: dict[str, Any] = {}

    async def idle() -> bool:
        nonlocal out
        resp = await client.get(f"/v1/processes/{pid}")
        out = resp.json()
        return resp.status_code == 200 and out["run_id"] is None and out["state"] == "idle"

    await wait_until(idle, seconds)
    return out


@contextmanager
def serving(opts: Any) -> Iterator[tuple[str, dict[str, str]]]:
    """``agentloop serve`` with ``opts`` (``ServeOptions``) in the background: its URL and the
    bearer header of a new account, alice."""
    from agentloop.cli.serve import BackgroundServer

    server = BackgroundServer(opts, start_timeout=60)
    running = server.start()
    try:
        accounts = running.ctx.accounts
        server.call(accounts.create_account("alice"))
        token, _ = server.call(accounts.create_token("alice"))
        yield running.url, {"Authorization": f"Bearer {token}"}
    finally:
        server.stop()
