"""The Discord channel against a real local fake of Discord: its HTTP API and its gateway.

``FakeDiscord`` is a Starlette app under uvicorn on 127.0.0.1 (its own thread and event loop) for
the REST routes the bridge uses (who the bot is, the gateway's address, sending and reading a
channel's messages, "typing…", answering a button press or a slash command, editing a deferred
answer, reading and overwriting the application's global commands), recording every call and answering as
Discord answers; failures (an HTTP status with a JSON body) can be queued per route. Its
``gateway`` is a ``websockets`` server on 127.0.0.1 (a thread and loop of its own as well) that
speaks the gateway protocol: Hello, Identify → READY with a session, Resume → the events missed,
then RESUMED (or op 9 for a session it does not know), heartbeats answered by ACKs (unless the
test turns them off), and the test's dispatches; it can drop the connection, send op 7 or op 9,
and close with a code on the next Identify or Resume (4004 …).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from typer.testing import CliRunner
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from agentloop import Reply, ScriptedModel, call, tool
from agentloop.channels.discord import CHAT_KEY, HELP, INTENTS, MAX_MESSAGE, DiscordBridge, approval_components
from agentloop.channels.discord_api import DiscordApi, DiscordError
from agentloop.cli.main import app
from agentloop.kernel import Approval, Kernel
from agentloop.messages import ToolResultMessage, UserMessage
from agentloop.models.base import ModelRequest
from tests.fakes.http_server import ServerThread
from tests.test_channel_telegram import typed

TOKEN = "NDI0Mg.GhAbCd.secret_Token-xyz0123456789abcdef"
SECRET = TOKEN.rsplit(".", 1)[1]
BOT = 4242
ALICE, BOB, MALLORY = 100, 200, 999
ALICE_DM, BOB_DM, MALLORY_DM = 5100, 5200, 5999  # the DM channels
GUILD, GENERAL = 7000, 7001  # a server and one of its channels
FAST = (0.05, 0.2)  # the bridge's backoff in these tests
QUICK_OP9 = (0.01, 0.05)


# ------------------------------------------------------------------------------- the fake gateway


@dataclass
class Session:
    id: str
    events: list[dict[str, Any]] = field(default_factory=list)  # every dispatch, with its seq

    @property
    def seq(self) -> int:
        return len(self.events)


@dataclass
class Connection:
    ws: ServerConnection
    path: str
    received: list[dict[str, Any]] = field(default_factory=list)
    beats: list[tuple[float, Any]] = field(default_factory=list)
    session: Session | None = None


class FakeGateway:
    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.interval_ms = 300
        self.ack = True
        self.refuse: int | None = None  # a close code for the next Identify or Resume
        self.application: int | None = BOT  # READY's application id (None: READY names none)
        self.lock = threading.Lock()
        self.connections: list[Connection] = []
        self.sessions: dict[str, Session] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: Server | None = None
        self.url = ""
        self.quiet = logging.getLogger("tests.fake_discord_gateway")
        self.quiet.setLevel(logging.WARNING)  # (the fake's own frames hold the token it is sent)

    def start(self) -> None:
        self.thread.start()

        async def listen() -> Server:
            return await serve(self.handle, "127.0.0.1", 0, logger=self.quiet, compression=None)

        self.server = self.run(listen())
        port = next(iter(self.server.sockets)).getsockname()[1]
        self.url = f"ws://127.0.0.1:{port}"

    def stop(self) -> None:
        async def close() -> None:
            assert self.server is not None
            self.server.close()
            await self.server.wait_closed()

        self.run(close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)

    def run(self, work: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout=5)

    async def handle(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        conn = Connection(ws, ws.request.path)
        with self.lock:
            self.connections.append(conn)
        await self.send(conn, {"op": 10, "d": {"heartbeat_interval": self.interval_ms}, "s": None, "t": None})
        try:
            async for raw in ws:
                payload = json.loads(raw)
                with self.lock:
                    conn.received.append(payload)
                await self.on_payload(conn, payload)
        except ConnectionClosed:
            pass

    async def on_payload(self, conn: Connection, payload: dict[str, Any]) -> None:
        op, d = payload["op"], payload.get("d")
        if op == 1:
            with self.lock:
                conn.beats.append((time.monotonic(), d))
            if self.ack:
                await self.send(conn, {"op": 11, "d": None, "s": None, "t": None})
        elif op in (2, 6) and (self.refuse is not None or d.get("token") != self.token):
            await conn.ws.close(self.refuse or 4004, "Authentication failed.")
        elif op == 2:
            with self.lock:
                session = Session(f"session-{len(self.sessions) + 1}")
                self.sessions[session.id] = session
                conn.session = session
            ready = {
                "v": 10,
                "user": {"id": str(BOT), "username": "agent", "bot": True},
                "session_id": session.id,
                "resume_gateway_url": f"{self.url}/resume",
                "guilds": [],
            }
            if self.application is not None:
                ready["application"] = {"id": str(self.application), "flags": 0}
            await self.dispatch_on(conn, "READY", ready)
        elif op == 6:
            session = self.sessions.get(d["session_id"])
            if session is None:
                await self.send(conn, {"op": 9, "d": False, "s": None, "t": None})
                return
            with self.lock:
                conn.session = session
                missed = [e for e in session.events if e["s"] > (d["seq"] or 0)]
            for event in missed:
                await self.send(conn, event)
            await self.dispatch_on(conn, "RESUMED", {})

    async def send(self, conn: Connection, payload: dict[str, Any]) -> None:
        with suppress(ConnectionClosed):  # (a dispatch while it is down waits in the session)
            await conn.ws.send(json.dumps(payload))

    async def dispatch_on(self, conn: Connection, event: str, data: dict[str, Any]) -> None:
        with self.lock:
            session = conn.session or list(self.sessions.values())[-1]  # (a connection not resumed yet)
            payload = {"op": 0, "t": event, "s": session.seq + 1, "d": data}
            session.events.append(payload)
        await self.send(conn, payload)

    # -- what the test does

    @property
    def current(self) -> Connection:
        with self.lock:
            return self.connections[-1]

    def dispatch(self, event: str, data: dict[str, Any]) -> None:
        """Dispatch to the session of the newest connection (kept for a resume when it is down)."""
        self.run(self.dispatch_on(self.current, event, data))

    def op(self, op: int, d: Any = None) -> None:
        self.run(self.send(self.current, {"op": op, "d": d, "s": None, "t": None}))

    def drop(self) -> None:
        """The connection breaks (no close frame): the client should resume."""
        conn = self.current
        self.loop.call_soon_threadsafe(conn.ws.transport.abort)

    def sent(self, op: int) -> list[tuple[int, dict[str, Any]]]:
        """(connection index, payload) of what the clients sent with ``op``."""
        with self.lock:
            return [(n, p) for n, c in enumerate(self.connections) for p in c.received if p["op"] == op]


# ------------------------------------------------------------------------------- the fake REST API


@dataclass
class Call:
    route: str
    params: dict[str, str]
    body: Any
    at: float
    ok: bool


class FakeDiscord:
    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.lock = threading.Lock()
        self.calls: list[Call] = []
        self.failures: dict[str, list[tuple[int, Any]]] = {}
        self.history: dict[int, list[dict[str, Any]]] = {}  # channel -> its messages, oldest first
        self.guilds: dict[int, int] = {}  # channel -> its server (guild), for a server channel
        self.commands: dict[int, list[dict[str, Any]]] = {}  # application -> its global commands
        self._next_id = 900_000
        routes = [
            Route("/api/v10/users/@me", self.route("me"), methods=["GET"]),
            Route("/api/v10/gateway/bot", self.route("gateway"), methods=["GET"]),
            Route("/api/v10/channels/{channel}", self.route("channel"), methods=["GET"]),
            Route("/api/v10/channels/{channel}/messages", self.route("create_message"), methods=["POST"]),
            Route("/api/v10/channels/{channel}/messages", self.route("messages"), methods=["GET"]),
            Route("/api/v10/channels/{channel}/typing", self.route("typing"), methods=["POST"]),
            Route("/api/v10/interactions/{id}/{token}/callback", self.route("callback"), methods=["POST"]),
            Route("/api/v10/applications/{app}/commands", self.route("commands"), methods=["GET"]),
            Route("/api/v10/applications/{app}/commands", self.route("put_commands"), methods=["PUT"]),
            Route("/api/v10/webhooks/{app}/{token}/messages/@original", self.route("edit_original"), methods=["PATCH"]),
        ]
        self.server = ServerThread(Starlette(routes=routes))
        self.url = f"{self.server.url}/api/v10"
        self.gateway = FakeGateway(token)

    def __enter__(self) -> FakeDiscord:
        self.server.start()
        self.gateway.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.gateway.stop()
        self.server.stop()

    def next_id(self) -> int:
        with self.lock:
            self._next_id += 1
            return self._next_id

    def route(self, name: str) -> Callable[[Request], Any]:
        async def handle(request: Request) -> Response:
            token_ok = request.headers.get("authorization") == f"Bot {self.token}"
            body = await request.json() if await request.body() else None
            with self.lock:
                queued = self.failures.get(name)
                failure = queued.pop(0) if queued and token_ok else None
                self.calls.append(
                    Call(name, dict(request.path_params), body, time.monotonic(), token_ok and not failure)
                )
            if not token_ok:
                return JSONResponse({"message": "401: Unauthorized", "code": 0}, 401)
            if failure is not None:
                return JSONResponse(failure[1], failure[0])
            return await self.answer(name, request, body)

        return handle

    async def answer(self, name: str, request: Request, body: Any) -> Response:
        if name == "me":
            return JSONResponse({"id": str(BOT), "username": "agent", "bot": True})
        if name == "gateway":
            limit = {"total": 1000, "remaining": 999, "reset_after": 0, "max_concurrency": 1}
            return JSONResponse({"url": self.gateway.url, "shards": 1, "session_start_limit": limit})
        if name in ("commands", "put_commands"):  # (global application commands: a PUT replaces them all)
            app = int(request.path_params["app"])
            with self.lock:
                if name == "put_commands":
                    self.commands[app] = [self.registered(app, n, c) for n, c in enumerate(body)]
                return JSONResponse(self.commands.get(app, []))
        if name == "edit_original" and self.deferral(request.path_params["token"]) == 6:
            # (a press's deferred update, edited: the pressed message, which the history keeps as sent)
            author = {"id": str(BOT), "username": "agent", "bot": True}
            return JSONResponse({"id": str(self.next_id()), "author": author, "type": 0, **body})
        if name == "edit_original":  # (a deferred response, edited: unknown until the deferral was taken)
            token = request.path_params["token"]
            deferred = [c for c in self.of("callback") if c.ok and c.params["token"] == token and c.body["type"] == 5]
            if not deferred:
                return JSONResponse({"message": "Unknown Webhook", "code": 10015}, 404)
            author = {"id": str(BOT), "username": "agent", "bot": True}
            return JSONResponse({"id": str(self.next_id()), "author": author, "type": 20, **body})
        channel = int(request.path_params.get("channel", 0))
        if name == "create_message":
            message = {
                "id": str(self.next_id()),
                "channel_id": str(channel),
                "author": {"id": str(BOT), "username": "agent", "bot": True},
                "content": body["content"],
                "components": body.get("components", []),
                "mentions": [],
                "type": 0,
            }
            with self.lock:
                self.history.setdefault(channel, []).append(message)
            return JSONResponse(message)
        if name == "channel":  # a server channel names its guild; a DM (type 1) none
            guild = self.guilds.get(channel)
            return JSONResponse(
                {"id": str(channel), "type": 1 if guild is None else 0, "guild_id": guild and str(guild)}
            )
        if name == "messages":
            after, limit = int(request.query_params["after"]), int(request.query_params["limit"])
            with self.lock:
                newer = [m for m in self.history.get(channel, []) if int(m["id"]) > after][:limit]
            return JSONResponse(list(reversed(newer)))  # newest first, as Discord answers
        return Response(status_code=204)

    @staticmethod
    def registered(app: int, n: int, command: dict[str, Any]) -> dict[str, Any]:
        """``command`` as Discord keeps and returns it: with its ids and the defaults filled in."""
        defaults = {"type": 1, "contexts": [0, 1, 2], "integration_types": [0], "nsfw": False}
        kept = {"id": str(800_000 + n), "application_id": str(app), "version": "1", "default_member_permissions": None}
        return {**defaults, **command, **kept}

    # -- what the test does as a Discord user

    def message(
        self,
        channel: int,
        user: int,
        text: str,
        *,
        guild: int | None = None,
        mentions: tuple[int, ...] = (),
        bot: bool = False,
        live: bool = True,
    ) -> dict[str, Any]:
        """A message from ``user`` in ``channel``: kept in its history as the REST API returns it,
        and dispatched (``live``) as the gateway does, with the channel's guild (``guild``: the
        channel is a server's, from then on)."""
        message: dict[str, Any] = {
            "id": str(self.next_id()),
            "channel_id": str(channel),
            "author": {"id": str(user), "username": f"user{user}", "global_name": f"User{user}", "bot": bot},
            "content": text,
            "mentions": [{"id": str(m), "username": f"user{m}"} for m in mentions],
            "type": 0,
            "attachments": [],
        }
        if guild is not None:
            self.guilds[channel] = guild
        with self.lock:
            self.history.setdefault(channel, []).append(message)
        event = dict(message)
        if channel in self.guilds:  # (the gateway's MESSAGE_CREATE adds guild_id; REST messages have none)
            event["guild_id"] = str(self.guilds[channel])
        if live:
            self.gateway.dispatch("MESSAGE_CREATE", event)
        return event

    def press(self, user: int, sent: dict[str, Any], custom_id: str, channel: int | None = None) -> None:
        """``user`` presses the button ``custom_id`` on the bot's message ``sent``."""
        presser = {"id": str(user), "username": f"user{user}", "global_name": f"User{user}"}
        interaction = {
            "id": str(self.next_id()),
            "application_id": str(BOT),
            "type": 3,
            "token": f"interaction-token-{user}-{len(self.calls)}",
            "channel_id": str(channel or int(sent["channel_id"])),
            "user": presser,
            "message": sent,
            "data": {"custom_id": custom_id, "component_type": 2},
        }
        self.gateway.dispatch("INTERACTION_CREATE", interaction)

    def command(self, user: int, name: str, channel: int, *, guild: int | None = None) -> str:
        """``user`` uses the slash command ``/name`` in ``channel`` (a server's, with ``guild``):
        the interaction's token, which its answer's address holds."""
        who = {"id": str(user), "username": f"user{user}", "global_name": f"User{user}"}
        token = f"command-token-{user}-{self.next_id()}"
        interaction: dict[str, Any] = {
            "id": str(self.next_id()),
            "application_id": str(BOT),
            "type": 2,
            "token": token,
            "channel_id": str(channel),
            "channel": {"id": str(channel), "type": 1 if guild is None else 0},
            "data": {"id": "800000", "name": name, "type": 1},
            "context": 1 if guild is None else 0,
        }
        if guild is None:
            interaction["user"] = who
        else:
            interaction |= {"guild_id": str(guild), "member": {"user": who, "roles": []}}
        self.gateway.dispatch("INTERACTION_CREATE", interaction)
        return token

    def answer_to(self, token: str) -> dict[str, Any] | None:
        """The bridge's answer to the interaction with ``token``: its response; for a deferred one
        (type 5), once made, the edit that gives it its text, as the response it stands for (type 4,
        with the deferral's flags)."""
        response = next((c.body for c in self.of("callback") if c.ok and c.params["token"] == token), None)
        if response is not None and response.get("type") == 6:  # (a press's deferred update)
            return self.update_of(token)
        if response is None or response.get("type") != 5:
            return response
        edit = self.edit_of(token)
        if edit is None:
            return None
        flags = (response.get("data") or {}).get("flags")
        return {"type": 4, "data": edit | ({"flags": flags} if flags is not None else {})}

    def update_of(self, token: str) -> dict[str, Any] | None:
        """A press's deferred update (type 6), once its outcome is shown by editing the pressed
        message, as the response it stands for (an update, type 7)."""
        edit = self.edit_of(token)
        return None if edit is None else {"type": 7, "data": edit}

    def deferral(self, token: str) -> int | None:
        """The type of the deferred response (5 or 6) taken for the interaction with ``token``."""
        taken = [c.body["type"] for c in self.of("callback") if c.ok and c.params["token"] == token]
        return next((t for t in taken if t in (5, 6)), None)

    def edit_of(self, token: str) -> dict[str, Any] | None:
        """What the bridge's edit of the (deferred) response to the interaction with ``token`` says."""
        return next((c.body for c in self.of("edit_original") if c.ok and c.params["token"] == token), None)

    def fail(self, route: str, *failures: tuple[int, Any]) -> None:
        with self.lock:
            self.failures.setdefault(route, []).extend(failures)

    # -- what the test looks at

    def of(self, route: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.route == route]

    def posted(self, channel: int) -> list[dict[str, Any]]:
        """The bot's messages in ``channel``."""
        with self.lock:
            return [m for m in self.history.get(channel, []) if m["author"]["id"] == str(BOT)]

    def texts(self, channel: int) -> list[str]:
        return [m["content"] for m in self.posted(channel)]

    def callbacks(self) -> list[dict[str, Any]]:
        """The responses taken, in the order of their interactions (answered on arrival, side by
        side, they may reach Discord in any order); a press's deferred update once its outcome is
        shown, as the response it stands for (``answer_to``)."""
        taken = sorted((c for c in self.of("callback") if c.ok), key=lambda c: int(c.params["id"]))
        answers = [self.answer_to(c.params["token"]) if c.body["type"] == 6 else c.body for c in taken]
        return [a for a in answers if a is not None]


@pytest.fixture
def fake() -> Iterator[FakeDiscord]:
    with FakeDiscord() as discord:
        yield discord


async def until(check: Callable[[], Any], seconds: float = 5.0) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {getattr(check, '__name__', check)}")


# ------------------------------------------------------------------------------- the agent

removed: list[str] = []
gate = threading.Event()


@tool
def rm(path: str) -> str:
    """Pretend to delete."""
    removed.append(path)
    return f"removed {path}"


@tool
async def wait_gate() -> str:
    """Wait for the test."""
    while not gate.is_set():
        await asyncio.sleep(0.01)
    return "opened"


def brain(req: ModelRequest) -> Reply | str:
    last = req.messages[-1]
    if isinstance(last, ToolResultMessage):
        return f"tool said: {last.text}"
    if isinstance(last, UserMessage) and typed(last) == "delete":
        return Reply(tool_calls=[call("rm", path="x")])
    if isinstance(last, UserMessage) and typed(last) == "gate":
        return Reply(tool_calls=[call("wait_gate")])
    if isinstance(last, UserMessage) and typed(last).startswith("long "):
        return "\n".join(f"line {n:04d} " + "x" * 40 for n in range(int(typed(last).split()[1])))
    if isinstance(last, UserMessage) and typed(last) == "ping everyone":
        return "@everyone look <@100>"
    return "seen: " + ", ".join(typed(m) for m in req.messages if isinstance(m, UserMessage))


async def policy(process: Any, row: Any) -> Approval:
    return (
        Approval("ask", ("destructive",), "rm deletes files", fingerprint="rm")
        if row.tool_name == "rm"
        else Approval("auto")
    )


def open_kernel(tmp_path: Path, model: ScriptedModel) -> Any:
    return Kernel.open(
        f"sqlite:///{tmp_path}/agentloop.db",
        model=model,
        workspace=tmp_path,
        tools=[rm, wait_gate],
        approval=policy,
        titles=None,
        heartbeat=None,
    )


@asynccontextmanager
async def running(
    tmp_path: Path, fake: FakeDiscord, **kw: Any
) -> AsyncIterator[tuple[Kernel, DiscordBridge, ScriptedModel]]:
    model = kw.pop("model", None) or ScriptedModel(brain)
    async with open_kernel(tmp_path, model) as kernel:
        bridge = DiscordBridge(
            kernel,
            TOKEN,
            allow=kw.pop("allow", [ALICE, BOB]),
            api_url=fake.url,
            backoff=FAST,
            ready_timeout=5.0,
            invalid_session_wait=QUICK_OP9,
            **kw,
        )
        async with bridge:
            yield kernel, bridge, model


def user_texts(model: ScriptedModel) -> list[str]:
    return [typed(r.messages[-1]) for r in model.requests if isinstance(r.messages[-1], UserMessage)]


# ------------------------------------------------------------------------------- tests


async def test_a_dm_is_answered_in_its_channel_by_that_channels_process(tmp_path: Path, fake: FakeDiscord) -> None:
    async with running(tmp_path, fake) as (kernel, _, _):
        [(_, identify)] = fake.gateway.sent(2)
        assert identify["d"]["token"] == TOKEN and identify["d"]["intents"] == INTENTS == 37376
        assert set(identify["d"]["properties"]) == {"os", "browser", "device"}
        assert fake.gateway.connections[0].path == "/?v=10&encoding=json"
        fake.message(ALICE_DM, ALICE, "hello")
        fake.message(BOB_DM, BOB, "hi there")
        await until(lambda: fake.texts(ALICE_DM) and fake.texts(BOB_DM))
        assert fake.texts(ALICE_DM) == ["seen: hello"] and fake.texts(BOB_DM) == ["seen: hi there"]
        assert {int(c.params["channel"]) for c in fake.of("typing")} == {ALICE_DM, BOB_DM}
        bodies = [c.body for c in fake.of("create_message")]
        assert all(b["allowed_mentions"] == {"parse": []} and b["enforce_nonce"] for b in bodies)
        procs = await kernel.processes()
        assert sorted(p.owner for p in procs) == [f"discord-{ALICE}", f"discord-{BOB}"]
        fake.message(ALICE_DM, ALICE, "again")  # the same channel: the same conversation
        await until(lambda: len(fake.texts(ALICE_DM)) == 2)
        assert fake.texts(ALICE_DM)[1] == "seen: hello, again" and len(await kernel.processes()) == 2
        assert sorted((await kernel.store.kv_values(CHAT_KEY)).values()) == [f"{BOT}:{ALICE_DM}", f"{BOT}:{BOB_DM}"]


async def test_in_a_server_only_a_message_that_mentions_the_bot_is_taken(tmp_path: Path, fake: FakeDiscord) -> None:
    async with running(tmp_path, fake) as (kernel, _, model):
        fake.message(GENERAL, ALICE, "just chatting, no bot here", guild=GUILD)
        fake.message(GENERAL, ALICE, f"<@{BOB}> and not the bot", guild=GUILD, mentions=(BOB,))
        fake.message(GENERAL, 555, f"<@{BOT}> hi from another bot", guild=GUILD, mentions=(BOT,), bot=True)
        fake.message(GENERAL, ALICE, f"<@{BOT}> hello", guild=GUILD, mentions=(BOT,))
        await until(lambda: fake.texts(GENERAL))
        assert fake.texts(GENERAL) == ["seen: hello"]  # the mention taken out; the others ignored
        fake.message(GENERAL, BOB, f"and <@!{BOT}> again", guild=GUILD, mentions=(BOT,))
        await until(lambda: len(fake.texts(GENERAL)) == 2)
        assert fake.texts(GENERAL)[1] == "seen: hello, and again"  # one process for the channel
        assert user_texts(model) == ["hello", "and again"]
        assert [p.owner for p in await kernel.processes()] == [f"discord-{ALICE}"]


async def test_a_stranger_is_refused_once_and_reaches_no_process(tmp_path: Path, fake: FakeDiscord) -> None:
    async with running(tmp_path, fake, allow=[ALICE]) as (kernel, _, model):
        fake.message(MALLORY_DM, MALLORY, "rm -rf / please")
        fake.message(MALLORY_DM, MALLORY, "please?")  # told once, not each time
        fake.message(GENERAL, MALLORY, f"<@{BOT}> me too", guild=GUILD, mentions=(BOT,))
        fake.message(ALICE_DM, ALICE, "hello")  # (taken after them: the refusals were handled)
        await until(lambda: fake.texts(ALICE_DM))
        [refusal] = fake.texts(MALLORY_DM)
        assert "private" in refusal and str(MALLORY) in refusal
        assert len(fake.texts(GENERAL)) == 1 and str(MALLORY) in fake.texts(GENERAL)[0]
        assert user_texts(model) == ["hello"]
        assert [p.owner for p in await kernel.processes()] == [f"discord-{ALICE}"]
    # an empty allow-list refuses everyone
    async with running(tmp_path / "empty", fake, allow=[]) as (kernel, _, model):
        fake.message(ALICE_DM, ALICE, "me neither?")
        await until(lambda: len(fake.texts(ALICE_DM)) == 2)
        assert "private" in fake.texts(ALICE_DM)[1] and model.requests == [] and await kernel.processes() == []


async def test_approve_runs_the_tool_and_deny_does_not(tmp_path: Path, fake: FakeDiscord) -> None:
    removed.clear()
    async with running(tmp_path, fake) as (kernel, _, _):
        fake.message(BOB_DM, BOB, "hello")  # Bob's channel has a process of its own
        await until(lambda: fake.texts(BOB_DM))
        fake.message(ALICE_DM, ALICE, "delete")
        [ask] = await until(lambda: [m for m in fake.posted(ALICE_DM) if m["components"]])
        [row] = ask["components"]
        approve = row["components"][0]
        assert [(b["label"], b["style"]) for b in row["components"]] == [("Approve", 3), ("Deny", 4), ("Always", 2)]
        assert "rm" in ask["content"] and "path: x" in ask["content"] and "destructive" in ask["content"]
        assert removed == []  # nothing ran before the answer

        fake.press(MALLORY, ask, approve["custom_id"])  # not on the allow-list
        fake.press(ALICE, ask, "hil:x:nonsense")  # garbage: no traceback, an answer
        [bobs] = fake.posted(BOB_DM)
        fake.press(BOB, bobs, approve["custom_id"])  # Bob, in his channel, names Alice's request
        await until(lambda: len(fake.callbacks()) == 3)
        assert [(c["type"], c["data"]["content"], c["data"]["flags"]) for c in fake.callbacks()] == [
            (4, "You are not allowed to answer this.", 64),
            (4, "Unknown button.", 64),
            (4, "This request is no longer pending.", 64),
        ]
        alices = [p for p in await kernel.processes() if p.owner == f"discord-{ALICE}"]
        assert len(await (await kernel.process(alices[0].pid)).pending_approvals()) == 1 and removed == []

        fake.press(ALICE, ask, approve["custom_id"])
        await until(lambda: "tool said: removed x" in fake.texts(ALICE_DM))
        assert removed == ["x"]
        update = fake.callbacks()[3]
        assert update["type"] == 7 and update["data"]["components"] == []  # the buttons are gone
        assert update["data"]["content"] == ask["content"] + "\n\n✅ Approved by User100"
        token = fake.of("callback")[3].params["token"]
        assert token.startswith("interaction-token-100")  # (the token written into the path)

        fake.press(ALICE, ask, approve["custom_id"])  # pressed again: stale
        await until(lambda: len(fake.callbacks()) == 5)
        assert fake.callbacks()[4]["data"]["content"] == "This request is no longer pending."

        fake.message(ALICE_DM, ALICE, "delete")
        asks = await until(lambda: [m for m in fake.posted(ALICE_DM) if m["components"]][1:])
        fake.press(ALICE, asks[0], asks[0]["components"][0]["components"][1]["custom_id"])  # Deny
        await until(lambda: len(fake.texts(ALICE_DM)) == 4)
        assert removed == ["x"]  # denied: it did not run
        assert fake.texts(ALICE_DM)[3].startswith("tool said:") and "denied" in fake.texts(ALICE_DM)[3]
        assert fake.callbacks()[5]["data"]["content"].endswith("❌ Denied by User100")
    assert approval_components("x" * 200) is None  # an id no custom_id can carry: no buttons


async def test_a_dropped_connection_resumes_its_session(tmp_path: Path, fake: FakeDiscord) -> None:
    async with running(tmp_path, fake) as (_, bridge, _):
        fake.message(ALICE_DM, ALICE, "hello")
        await until(lambda: fake.texts(ALICE_DM))
        await until(lambda: bridge.state.last.get(ALICE_DM))
        seq = fake.gateway.connections[0].session.seq  # type: ignore[union-attr]
        caught_up = len(fake.of("messages"))
        fake.gateway.drop()
        [(n, resume)] = await until(lambda: fake.gateway.sent(6))
        assert n == 1 and fake.gateway.connections[1].path == "/resume?v=10&encoding=json"
        assert resume["d"] == {"token": TOKEN, "session_id": "session-1", "seq": seq}
        fake.message(ALICE_DM, ALICE, "after the drop")
        await until(lambda: len(fake.texts(ALICE_DM)) == 2)
        assert fake.texts(ALICE_DM)[1] == "seen: hello, after the drop"
        assert len(fake.gateway.sent(2)) == 1 and len(fake.of("messages")) == caught_up  # resumed: no catch-up

        # what is dispatched while the connection is down is replayed by the resume
        fake.gateway.drop()
        fake.message(ALICE_DM, ALICE, "while down")
        await until(lambda: len(fake.gateway.sent(6)) == 2)
        await until(lambda: len(fake.texts(ALICE_DM)) == 3)
        assert fake.texts(ALICE_DM)[2].endswith("while down")

        # op 7: Discord asks for a reconnect, which resumes too
        fake.gateway.op(7)
        await until(lambda: len(fake.gateway.sent(6)) == 3)
        assert fake.gateway.sent(6)[2][1]["d"]["session_id"] == "session-1"
        assert fake.gateway.connections[2].ws.close_code == 4000  # not 1000, which would end the session


async def test_an_invalid_session_identifies_anew(tmp_path: Path, fake: FakeDiscord) -> None:
    async with running(tmp_path, fake) as (_, _, _):
        fake.message(ALICE_DM, ALICE, "hello")
        await until(lambda: fake.texts(ALICE_DM))
        catch_ups = len(fake.of("messages"))
        fake.gateway.op(9, False)
        await until(lambda: len(fake.gateway.sent(2)) == 2)
        assert fake.gateway.sent(6) == [] and fake.gateway.sent(2)[1][0] == 1
        await until(lambda: len(fake.of("messages")) > catch_ups)  # a new session catches up
        fake.message(ALICE_DM, ALICE, "in the new session")
        await until(lambda: len(fake.texts(ALICE_DM)) == 2)
        # op 9 true: the session may be resumed
        fake.gateway.op(9, True)
        [(_, resume)] = await until(lambda: fake.gateway.sent(6))
        assert resume["d"]["session_id"] == "session-2"


async def test_heartbeats_are_sent_and_a_missing_ack_reconnects(tmp_path: Path, fake: FakeDiscord) -> None:
    fake.gateway.interval_ms = 100
    async with running(tmp_path, fake) as (_, _, _):
        first = fake.gateway.connections[0]
        await until(lambda: len(first.beats) >= 3)
        gaps = [b[0] - a[0] for a, b in zip(first.beats[1:], first.beats[2:], strict=False)]
        assert all(0.07 < gap < 0.3 for gap in gaps)
        assert first.beats[-1][1] == 1  # the last seq: READY's
        fake.gateway.op(1)  # the gateway asks for a beat at once
        before = len(first.beats)
        await until(lambda: len(first.beats) > before, 0.08)
        fake.gateway.ack = False
        await until(lambda: len(fake.gateway.connections) == 2, 2.0)  # a zombie: closed and resumed
        fake.gateway.ack = True
        [(_, resume)] = await until(lambda: fake.gateway.sent(6))
        assert resume["d"]["session_id"] == "session-1"
        fake.message(ALICE_DM, ALICE, "still there?")
        await until(lambda: fake.texts(ALICE_DM))


async def test_a_refused_token_or_disallowed_intents_stop_with_a_clear_error(tmp_path: Path, fake: FakeDiscord) -> None:
    fake.gateway.refuse = 4004
    async with open_kernel(tmp_path, ScriptedModel(brain)) as kernel:
        bridge = DiscordBridge(kernel, TOKEN, allow=[ALICE], api_url=fake.url, backoff=FAST)
        with pytest.raises(DiscordError) as refused:
            await bridge.start()
        assert "authentication failed" in str(refused.value) and "4004" in str(refused.value)
        assert refused.value.code == 4004 and len(fake.gateway.connections) == 1  # no endless loop
    # while running: a reconnect that meets 4014 ends ``wait`` with the reason
    fake.gateway.refuse = None
    async with running(tmp_path / "later", fake) as (_, bridge, _):
        fake.gateway.refuse = 4014
        fake.gateway.drop()
        with pytest.raises(DiscordError) as disallowed:
            await asyncio.wait_for(bridge.wait(), 5)
        assert "Message Content intent" in str(disallowed.value) and TOKEN not in str(disallowed.value)
    # a token Discord's HTTP API refuses: 401 at start, at once
    async with open_kernel(tmp_path / "wrong", ScriptedModel(brain)) as kernel:
        wrong = DiscordBridge(kernel, "NDI0Mg.GhAbCd.wrong_token-9876543210", allow=[ALICE], api_url=fake.url)
        with pytest.raises(DiscordError) as unauthorized:
            await wrong.start()
        assert unauthorized.value.status == 401 and "token was refused" in str(unauthorized.value)
        assert "wrong_token" not in str(unauthorized.value)


async def test_a_restart_catches_up_what_was_said_meanwhile_exactly_once(tmp_path: Path, fake: FakeDiscord) -> None:
    async with running(tmp_path, fake, allow=[ALICE]) as (kernel, bridge, model):
        first = fake.message(ALICE_DM, ALICE, "hello")
        await until(lambda: fake.texts(ALICE_DM))
        await until(lambda: bridge.state.last.get(ALICE_DM) == int(first["id"]))
        [proc] = await kernel.processes()
    state = tmp_path / "var" / "discord" / f"{BOT}.json"
    assert json.loads(state.read_text())["last"] == {str(ALICE_DM): first["id"]}
    # said while the bridge was down: the gateway will not replay it
    fake.message(ALICE_DM, ALICE, "while away", live=False)
    helped = fake.message(ALICE_DM, ALICE, "!help", live=False)
    last = fake.message(ALICE_DM, ALICE, "and more", live=False)
    async with running(tmp_path, fake, allow=[ALICE], model=model) as (kernel, bridge, _):
        await until(lambda: bridge.state.last.get(ALICE_DM) == int(last["id"]))
        await until(lambda: fake.texts(ALICE_DM)[-1].endswith("and more"))
        assert user_texts(model) == ["hello", "while away", "and more"]
        history = [m.text for m in await (await kernel.process(proc.pid)).messages() if isinstance(m, UserMessage)]
        assert history == ["hello", "while away", "and more"]  # oldest first, in the same process
        assert fake.texts(ALICE_DM).count(HELP) == 1
        fake.gateway.dispatch("MESSAGE_CREATE", helped)  # dispatched as well: taken once
        fake.gateway.dispatch("MESSAGE_CREATE", last)
        fake.message(ALICE_DM, ALICE, "live")
        await until(lambda: fake.texts(ALICE_DM)[-1].endswith("live"))
        assert fake.texts(ALICE_DM).count(HELP) == 1
        seen = user_texts(model)

    # a crash after the input was admitted but before its id was stored: caught up again, run once
    saved = json.loads(state.read_text())
    state.write_text(json.dumps({**saved, "last": {str(ALICE_DM): helped["id"]}}))
    answers = len(fake.texts(ALICE_DM))
    async with running(tmp_path, fake, allow=[ALICE], model=model) as (kernel, bridge, _):
        await until(lambda: bridge.state.last.get(ALICE_DM, 0) > int(last["id"]))
        fake.message(ALICE_DM, ALICE, "last")
        await until(lambda: fake.texts(ALICE_DM)[-1].endswith("last"))
        history = [m.text for m in await (await kernel.process(proc.pid)).messages() if isinstance(m, UserMessage)]
        assert history == ["hello", "while away", "and more", "live", "last"]  # none of them twice
        assert user_texts(model) == [*seen, "last"]
        assert len(fake.texts(ALICE_DM)) == answers + 1
        assert [p.pid for p in await kernel.processes()] == [proc.pid]


async def test_429_with_retry_after_and_500_are_retried(tmp_path: Path, fake: FakeDiscord) -> None:
    fake.fail(
        "create_message",
        (429, {"message": "You are being rate limited.", "retry_after": 0.5, "global": False}),
        (500, {"message": "Internal Server Error", "code": 0}),
    )
    fake.fail("gateway", (502, {"message": "Bad Gateway"}))
    async with running(tmp_path, fake, allow=[ALICE]) as (_, _, _):
        fake.message(ALICE_DM, ALICE, "hello")
        await until(lambda: fake.texts(ALICE_DM))
        sends = fake.of("create_message")
        assert len(sends) == 3 and fake.texts(ALICE_DM) == ["seen: hello"]  # the answer once, on the third try
        assert sends[1].at - sends[0].at >= 0.45  # retry_after: 0.5 seconds
        assert sends[2].at - sends[1].at < 0.4  # the 500: the backoff
        assert sends[0].body["nonce"] == sends[2].body["nonce"]  # the same message, tried again
        assert len(fake.of("gateway")) == 2  # the 502 was retried too
        # a permanent failure (the channel is gone) drops that message; the next goes out
        fake.fail("create_message", (404, {"message": "Unknown Channel", "code": 10003}))
        fake.message(ALICE_DM, ALICE, "lost")
        fake.message(ALICE_DM, ALICE, "found")
        await until(lambda: len(fake.texts(ALICE_DM)) == 2)
        assert fake.texts(ALICE_DM)[1] == "seen: hello, lost, found"


async def test_a_long_answer_is_split_at_2000_and_pings_no_one(tmp_path: Path, fake: FakeDiscord) -> None:
    async with running(tmp_path, fake, allow=[ALICE]) as (_, _, _):
        fake.message(ALICE_DM, ALICE, "long 100")  # 100 lines of 50 characters: 5099
        await until(lambda: len(fake.texts(ALICE_DM)) >= 3)
        await asyncio.sleep(0.1)
        parts = fake.texts(ALICE_DM)
        assert len(parts) == 3 and all(len(p) <= MAX_MESSAGE == 2000 for p in parts)
        assert "\n".join(parts).splitlines() == [f"line {n:04d} " + "x" * 40 for n in range(100)]
        fake.message(ALICE_DM, ALICE, "ping everyone")
        await until(lambda: len(fake.texts(ALICE_DM)) == 4)
        [ping] = [c.body for c in fake.of("create_message") if c.body["content"].startswith("@everyone")]
        assert ping["allowed_mentions"] == {"parse": []}


async def test_the_token_never_appears_in_the_logs(
    tmp_path: Path, fake: FakeDiscord, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="agentloop.channels")  # (a command run before may have set INFO)
    fake.fail("create_message", (500, {"message": f"boom with {TOKEN} in it"}))
    async with running(tmp_path, fake, allow=[ALICE]) as (_, _, _):
        fake.message(ALICE_DM, ALICE, "hello")
        fake.message(MALLORY_DM, MALLORY, "hello")
        await until(lambda: fake.texts(ALICE_DM) and fake.texts(MALLORY_DM))
        fake.gateway.drop()  # a resume sends the token again
        await until(lambda: fake.gateway.sent(6))
        fake.message(ALICE_DM, ALICE, "delete")
        [ask] = await until(lambda: [m for m in fake.posted(ALICE_DM) if m["components"]])
        fake.press(ALICE, ask, ask["components"][0]["components"][0]["custom_id"])
        await until(lambda: fake.callbacks())
    wrong = DiscordApi("NDI0Mg.GhAbCd.wrong_token-9876543210", fake.url, backoff=FAST)
    with pytest.raises(DiscordError) as refused:
        await wrong.request("GET", "/users/@me")
    await wrong.close()
    assert refused.value.status == 401 and "wrong_token" not in str(refused.value)
    unreachable = DiscordApi(TOKEN, "http://127.0.0.1:9", backoff=(0.01, 0.01))
    with pytest.raises(DiscordError) as down:
        await unreachable.request("GET", "/users/@me", attempts=2)
    await unreachable.close()
    assert down.value.transient and TOKEN not in str(down.value)

    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "HTTP Request: POST" in text and "boom with *** in it" in text and "network error" in text
    frames = [line for line in text.splitlines() if "TEXT" in line or "payload, not shown" in line]
    assert any(line.startswith("< TEXT") for line in frames), frames
    assert any(line.startswith("> (an Identify or Resume payload, not shown)") for line in frames), frames
    requests = [line for line in text.splitlines() if "HTTP Request:" in line]
    assert any("/interactions/" in line for line in requests)
    assert not any("interaction-token" in line for line in requests)  # its token masked in the path
    assert str(MALLORY) in text
    assert TOKEN not in text and SECRET not in text and TOKEN not in caplog.text and SECRET not in caplog.text


async def test_stop_aborts_the_run_and_new_starts_a_fresh_conversation(tmp_path: Path, fake: FakeDiscord) -> None:
    gate.clear()
    async with running(tmp_path, fake, allow=[ALICE]) as (kernel, bridge, _):
        fake.message(ALICE_DM, ALICE, "!stop")
        await until(lambda: fake.texts(ALICE_DM) == ["Nothing is running."])
        fake.message(ALICE_DM, ALICE, "gate")
        queued = fake.message(ALICE_DM, ALICE, "queued meanwhile")
        await until(lambda: bridge.state.last.get(ALICE_DM) == int(queued["id"]))
        [record] = await kernel.processes()
        process = await kernel.process(record.pid)
        assert [item.kind for item in await process.queued()] == ["queue"]  # waits for its own run
        fake.message(ALICE_DM, ALICE, "!STOP")
        await until(lambda: "Stopped." in fake.texts(ALICE_DM))
        await until(lambda: fake.texts(ALICE_DM)[-1].startswith("seen:"))  # then the queued message ran
        assert fake.texts(ALICE_DM)[-1] == "seen: gate, queued meanwhile"
        fake.message(GENERAL, ALICE, f"<@{BOT}> !new", guild=GUILD, mentions=(BOT,))  # (another channel)
        fake.message(ALICE_DM, ALICE, "!new")
        await until(lambda: "Started a new conversation." in fake.texts(ALICE_DM))
        assert await process.messages() == []
        fake.message(ALICE_DM, ALICE, "fresh")
        await until(lambda: fake.texts(ALICE_DM)[-1] == "seen: fresh")  # the same channel's process, reset
        assert [r.pid for r in await kernel.processes()] == [record.pid]
        fake.message(ALICE_DM, ALICE, "!help")
        await until(lambda: fake.texts(ALICE_DM)[-1] == HELP)
        assert "!new" in HELP and "!stop" in HELP


# ------------------------------------------------------------------------------- the command

runner = CliRunner()


@pytest.fixture
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG", "AGENTLOOP_DATA", "AGENTLOOP_STORE", "DISCORD_BOT_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return {}


def test_the_command_refuses_to_start_without_a_token_or_an_allow_list(
    tmp_path: Path, cli_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    no_token = runner.invoke(app, ["discord", "--allow", "100"])
    assert no_token.exit_code == 2 and "no bot token: set DISCORD_BOT_TOKEN" in no_token.stderr
    other = runner.invoke(app, ["discord", "--allow", "100", "--token-env", "MY_BOT"])
    assert other.exit_code == 2 and "set MY_BOT" in other.stderr
    monkeypatch.setenv("DISCORD_BOT_TOKEN", TOKEN)
    no_allow = runner.invoke(app, ["discord"])
    assert no_allow.exit_code == 2 and "no Discord user is allowed" in no_allow.stderr and "--allow" in no_allow.stderr
    monkeypatch.setenv("DISCORD_BOT_TOKEN", "not a token/../")
    bad = runner.invoke(app, ["discord", "--allow", "100"])
    assert bad.exit_code == 2 and "bot token" in bad.stderr and "not a token" not in bad.stderr
    for result in (no_token, other, no_allow, bad):
        assert "Traceback" not in result.stderr and TOKEN not in result.stderr + result.stdout
    assert not (tmp_path / "xdg" / "agentloop").exists()  # refused before anything was opened


def test_the_command_fails_with_one_line_for_a_refused_token(
    tmp_path: Path, fake: FakeDiscord, cli_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps(["hello"]))
    (tmp_path / "ws").mkdir()
    command = ["discord", "--allow", str(ALICE), "--api-url", fake.url, "--data", str(tmp_path / "data")]
    command += ["-w", str(tmp_path / "ws"), "--model", f"scripted:{script}"]
    monkeypatch.setenv("DISCORD_BOT_TOKEN", "NDI0Mg.GhAbCd.wrong_token-9876543210")
    unauthorized = runner.invoke(app, command)
    assert unauthorized.exit_code == 1, unauthorized.stderr
    assert unauthorized.stderr.count("error:") == 1 and "token was refused" in unauthorized.stderr
    monkeypatch.setenv("DISCORD_BOT_TOKEN", TOKEN)
    fake.gateway.refuse = 4004
    refused = runner.invoke(app, command)
    assert refused.exit_code == 1 and "authentication failed" in refused.stderr and "4004" in refused.stderr
    for result in (unauthorized, refused):
        assert "Traceback" not in result.stderr and "wrong_token" not in result.stderr and SECRET not in result.stderr


def test_the_command_talks_through_a_bot_and_stops_cleanly_on_sigterm(
    tmp_path: Path, fake: FakeDiscord, cli_env: dict[str, str]
) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps(["hello from the agent"]))
    (tmp_path / "ws").mkdir()
    env = {**os.environ, "DISCORD_BOT_TOKEN": TOKEN}
    command = [sys.executable, "-m", "agentloop.cli.main", "discord", "--allow", str(ALICE)]
    command += ["--api-url", fake.url, "--data", str(tmp_path / "data"), "-w", str(tmp_path / "ws")]
    command += ["--model", f"scripted:{script}"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 15
        while not fake.gateway.sent(2) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.1)  # (the READY on its way)
        hi = fake.message(ALICE_DM, ALICE, "hi")
        while not fake.texts(ALICE_DM) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert fake.texts(ALICE_DM) == ["hello from the agent"], proc.poll() or (proc.terminate(), proc.communicate())
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "@agent is listening" in err and "allowed users: 100" in err and TOKEN not in out + err
    saved = json.loads((tmp_path / "data" / "var" / "discord" / f"{BOT}.json").read_text())
    assert saved["last"] == {str(ALICE_DM): hi["id"]}


async def test_a_busy_conversation_names_the_channels_own_command(tmp_path: Path) -> None:
    """``/new`` is Telegram's and WhatsApp's spelling; a Discord user is told to type ``!new``."""
    from agentloop.channels.bridge import ChatBridge
    from agentloop.channels.state import ChannelState
    from agentloop.kernel import ProcessBusy

    said: list[str] = []

    class Busy:
        async def reset(self) -> None:
            raise ProcessBusy("pid", "reset")

    class FakeKernel:
        async def process(self, pid: str) -> Busy:
            return Busy()

    for bridge_class, prefix in ((DiscordBridge, "!"), (ChatBridge, "/")):
        bridge = bridge_class.__new__(bridge_class)
        ChatBridge.__init__(
            bridge, FakeKernel(), account=None, context="", state=ChannelState(tmp_path / "s.json"), backoff=(0.01, 0.1)
        )  # type: ignore[arg-type]
        bridge._chats[1] = "pid"

        async def say(chat: object, text: str) -> None:
            said.append(text)

        bridge._say = say  # type: ignore[method-assign]
        await bridge._reset(1)
        assert said[-1] == f"The conversation is busy elsewhere; try {prefix}new again in a moment."
