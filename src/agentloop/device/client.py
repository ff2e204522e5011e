"""The device side of a driver connection: connect, declare, serve requests, reconnect.

A ``DeviceClient`` connects to the server's ``/v1/ws`` as a driver (``sys.connect`` with
``role: "driver"``), declares the syscalls it implements and its extra tools, and answers each
request with ``{"content": [blocks], "is_error": bool}``. The syscalls are served by the very
built-in tools the server uses locally, rooted at the device's ``root``: the same path rules
(no ``..``, absolute path or symlink out of the root) and the same shell handling (its own process
group, killed on timeout or cancellation) apply on both sides, because it is the same code.

``request.cancel {id}`` cancels that request's task, which for a shell command kills its whole
process group; the late answer is suppressed. When the connection drops, every request still
running is cancelled the same way (nobody is left to receive its answer), and the client
reconnects with exponential backoff (capped, with jitter). A refused token or a rejected
declaration is fatal: retrying cannot fix it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from agentloop.device.wire import result_to_wire
from agentloop.tools.base import Tool, ToolContext, ToolError, ToolResult
from agentloop.tools.builtin import SYSCALLS, builtin_tools
from agentloop.urls import MASK, check_server_address, redact_secrets, redact_url

__all__ = [
    "DEFAULT_ALLOW",
    "DeviceClient",
    "DeviceError",
    "DeviceOptions",
    "default_name",
    "parse_allow",
    "websocket_url",
]

log = logging.getLogger("agentloop.device")

#: ``--allow`` groups → the syscalls they enable
ALLOW_GROUPS: dict[str, tuple[str, ...]] = {
    "read": ("fs.read", "fs.search"),
    "fs": tuple(s for s in SYSCALLS.values() if s.startswith("fs.")),
    "shell": ("shell.exec",),
}
#: What a device lends when nobody says otherwise: reading and searching files under its root.
#: Changing files and running commands on someone's machine are opt-ins (``--allow fs,shell``):
#: a device lends only what its owner asked for.
DEFAULT_ALLOW: tuple[str, ...] = ALLOW_GROUPS["read"]
_FATAL_CODES = frozenset({"unauthorized", "forbidden", "invalid_request"})
_STABLE_AFTER = 30.0  # a connection that lived this long resets the backoff
#: The largest answer a device sends. The server reads at most 16 MiB in one frame (uvicorn's
#: WebSocket limit) and closes the socket on a larger one, failing every call running on the
#: device; a result over this is answered as an error instead. (A 10 MiB image, the largest
#: fs.read sends, is 13.3 MiB as base64.)
MAX_ANSWER_BYTES = 15 * 1024 * 1024
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")


class DeviceError(Exception):
    """A failure retrying cannot fix: a refused token, a rejected name or declaration."""


def parse_allow(text: str | Iterable[str]) -> tuple[str, ...]:
    """The syscalls ``--allow`` enables: groups (``read``, ``fs``, ``shell``) or syscall names,
    comma-separated."""
    items = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    known = set(SYSCALLS.values())
    out: list[str] = []
    for item in items:
        if item in ALLOW_GROUPS:
            out.extend(ALLOW_GROUPS[item])
        elif item in known:
            out.append(item)
        else:
            choices = ", ".join([*ALLOW_GROUPS, *sorted(known)])
            raise ValueError(f"--allow: unknown {item!r}; use any of {choices}")
    if not out:
        raise ValueError("--allow: nothing allowed; use read, fs, shell or syscall names")
    return tuple(dict.fromkeys(out))


def default_name() -> str:
    """The host name made into a valid device id (letters, digits, '-', '_'; no '__')."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", socket.gethostname().split(".")[0])
    name = re.sub(r"_{2,}", "_", name)[:32].strip("-_")
    return name or "device"


def websocket_url(url: str) -> str:
    """``ws(s)://host:port/v1/ws`` from what a person types: an http(s) or ws(s) address, with or
    without the path."""
    parts = urlsplit(url if "://" in url else f"ws://{url}")
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"not a server address: {redact_url(url)!r} (use http://host:port or ws://host:port)")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1/ws"):
        path += "/v1/ws"
    address = urlunsplit((scheme, parts.netloc, path, parts.query, ""))
    check_server_address(address, ("ws", "wss"))  # a bad port is a typo to report, not to retry
    return address


@dataclass
class DeviceOptions:
    """How a device connects and what it lends."""

    url: str
    token: str
    name: str
    root: Path
    implements: tuple[str, ...] = DEFAULT_ALLOW  # shell and file changes only when asked for
    tools: Sequence[Tool] = ()  # extra tools, shown to the model as ``<name>__<tool>``
    description: str = ""  # the owner's words for the device, listed in the agents' prompts
    backoff_initial: float = 1.0
    backoff_max: float = 60.0
    connect_timeout: float = 15.0
    ping_interval: float | None = 20.0
    extra_args: dict[str, Any] = field(default_factory=dict)  # more ``sys.connect`` args


def _say(text: str) -> None:
    log.info("%s", text)


class _MaskedLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """The log websockets writes to for a device: with debug logging on it logs the handshake's
    headers (``Authorization: Bearer <token>``) and the frames sent (``sys.connect`` carries the
    token), so every line has the token masked before it is written."""

    def __init__(self, logger: logging.Logger, secret: str) -> None:
        super().__init__(logger, {})
        self.secret = secret

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        text = str(msg) % args if args else str(msg)
        if self.secret:
            text = text.replace(self.secret, MASK)
        kwargs.setdefault("stacklevel", 2)
        self.logger.log(level, "%s", text, **kwargs)


class DeviceClient:
    """One device: ``await client.run()`` serves until cancelled; raises ``DeviceError`` if fatal."""

    def __init__(self, options: DeviceOptions, *, say: Callable[[str], None] = _say) -> None:
        self.options = options
        self.say = say
        self.url = websocket_url(options.url)
        shell = "shell.exec" in options.implements
        builtins = {SYSCALLS[t.name]: t for t in builtin_tools(options.root, shell=shell)}
        self.handlers: dict[str, Tool] = {s: builtins[s] for s in options.implements if s in builtins}
        self.handlers.update({f"tool.{t.name}": t for t in options.tools})
        self.connected = asyncio.Event()  # set while a connection is accepted (tests, status)
        self.connections = 0  # accepted connections so far

    # -- the reconnect loop -----------------------------------------------------------------------

    async def run(self) -> None:
        attempt = 0
        while True:
            started = time.monotonic()
            try:
                await self.session()
                why = "the server closed the connection"
            except DeviceError:
                raise
            except Exception as exc:  # the network, websockets' handshake and protocol errors
                why = self._reason(exc)
            if time.monotonic() - started >= _STABLE_AFTER:
                attempt = 0
            delay = min(self.options.backoff_max, self.options.backoff_initial * 2**attempt)
            delay = random.uniform(delay / 2, delay)  # jitter: devices dropped together spread out
            attempt = min(attempt + 1, 30)
            self.say(f"disconnected ({why}); reconnecting in {delay:.1f} s")
            await asyncio.sleep(delay)

    def _reason(self, exc: BaseException) -> str:
        """Why a connection failed, fit for a terminal and a log: an error may quote an address
        with a password in it (a proxy's, from ``ws_proxy``/``https_proxy``), never the token."""
        text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), str(exc))
        text = redact_secrets(text)
        if self.options.token:
            text = text.replace(self.options.token, MASK)
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

    # -- one connection ---------------------------------------------------------------------------

    def _connect_args(self) -> dict[str, Any]:
        # ``idempotent``: a call of it that a disconnect cut may be run again once we are back
        tools = [
            {"name": t.name, "description": t.description, "parameters": t.parameters, "idempotent": t.idempotent}
            for t in self.options.tools
        ]
        return {
            **self.options.extra_args,
            "role": "driver",
            "token": self.options.token,
            "name": self.options.name,
            "implements": [s for s in self.options.implements if s in self.handlers],
            "tools": tools,
            **({"description": self.options.description} if self.options.description else {}),
        }

    async def session(self) -> None:
        """Connect once, serve until the connection ends; ``DeviceError`` if the server refuses us."""
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed, InvalidStatus

        headers = {"Authorization": f"Bearer {self.options.token}"}
        try:
            ws = await connect(
                self.url,
                additional_headers=headers,
                open_timeout=self.options.connect_timeout,
                ping_interval=self.options.ping_interval,
                max_size=32 * 1024 * 1024,
                logger=_MaskedLog(logging.getLogger("websockets.client"), self.options.token),
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status in (401, 403):
                raise DeviceError(f"the server refused the token (HTTP {status})") from None
            raise
        try:
            await self._handshake(ws)
            self.connected.set()
            self.connections += 1
            await self._serve(ws)
        except ConnectionClosed:
            pass
        finally:
            self.connected.clear()
            await ws.close()

    async def _handshake(self, ws: Any) -> None:
        await ws.send(json.dumps({"type": "req", "id": "connect", "call": "sys.connect", "args": self._connect_args()}))
        frame: dict[str, Any] | None = None
        async with asyncio.timeout(self.options.connect_timeout):
            while frame is None or frame.get("type") != "res" or frame.get("id") != "connect":
                frame = _parse(await ws.recv())
        if frame.get("ok") is True:
            data = frame.get("data") or {}
            account = data.get("account", "?") if isinstance(data, dict) else "?"
            what = ", ".join(self._connect_args()["implements"]) or "no syscalls"
            self.say(f"connected to {redact_url(self.url)} as {self.options.name} (account {account}; {what})")
            return
        raw_error = frame.get("error")
        error: dict[str, Any] = raw_error if isinstance(raw_error, dict) else {}
        code, message = str(error.get("code", "error")), str(error.get("message", "connect refused"))
        if code in _FATAL_CODES:
            raise DeviceError(f"the server refused the connection: {message} ({code})")
        raise ConnectionError(f"the server refused the connection: {message} ({code})")

    async def _serve(self, ws: Any) -> None:
        tasks: dict[str, asyncio.Task[None]] = {}
        try:
            async for raw in ws:
                frame = _parse(raw)
                if frame is None:
                    continue
                kind = frame.get("type")
                if kind == "req":
                    await self._on_request(ws, frame, tasks)
                elif kind == "sig" and frame.get("signal") == "request.cancel":
                    payload = frame.get("payload")
                    _cancel(tasks, payload.get("id") if isinstance(payload, dict) else None)
        finally:
            # Nobody can receive these answers any more: stop the work (shell groups are killed).
            for task in tasks.values():
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def _on_request(self, ws: Any, frame: dict[str, Any], tasks: dict[str, asyncio.Task[None]]) -> None:
        req_id, call, args = frame.get("id"), frame.get("call"), frame.get("args")
        args = args if isinstance(args, dict) else {}
        if not isinstance(req_id, str) or not isinstance(call, str):
            return
        if call == "request.cancel":
            cancelled = _cancel(tasks, args.get("id"))
            await _send(ws, {"type": "res", "id": req_id, "ok": True, "data": {"cancelled": cancelled}})
        elif call == "sys.ping":
            await _send(ws, {"type": "res", "id": req_id, "ok": True, "data": {}})
        elif call in self.handlers:
            if req_id in tasks:
                return  # a duplicate id: the first request is still running
            task = asyncio.create_task(self._handle(ws, req_id, self.handlers[call], args))
            tasks[req_id] = task
            task.add_done_callback(lambda _t: tasks.pop(req_id, None))
        else:
            error = {"code": "unknown_call", "message": f"device {self.options.name} does not implement {call}"}
            await _send(ws, {"type": "res", "id": req_id, "ok": False, "error": error})

    async def _handle(self, ws: Any, req_id: str, tool: Tool, args: dict[str, Any]) -> None:
        result = await run_tool(tool, args, ToolContext(req_id, tool.name, self.options.root))
        text = _encode({"type": "res", "id": req_id, "ok": True, "data": result_to_wire(result)})
        if len(text) > MAX_ANSWER_BYTES:  # (ASCII: as many bytes as characters)
            too_large = ToolResult.error(
                f"The result of {tool.name} is too large to send ({len(text)} bytes, over the device's "
                f"{MAX_ANSWER_BYTES}-byte limit); ask for less of it at a time."
            )
            text = _encode({"type": "res", "id": req_id, "ok": True, "data": result_to_wire(too_large)})
        await _send_text(ws, text)


async def run_tool(tool: Tool, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
    """Validate and run one tool; every failure but cancellation is an error result."""
    try:
        return await tool.run(tool.validate(args), ctx)
    except ToolError as exc:
        return ToolResult.error(str(exc))
    except Exception as exc:
        log.debug("tool %s raised", tool.name, exc_info=True)
        return ToolResult.error(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def _parse(raw: str | bytes) -> dict[str, Any] | None:
    try:
        frame = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return frame if isinstance(frame, dict) else None


def _cancel(tasks: dict[str, asyncio.Task[None]], req_id: Any) -> bool:
    task = tasks.get(req_id) if isinstance(req_id, str) else None
    if task is None or task.done():
        return False
    task.cancel()
    return True


def _encode(frame: dict[str, Any]) -> str:
    return json.dumps(frame, separators=(",", ":"))


async def _send(ws: Any, frame: dict[str, Any]) -> None:
    await _send_text(ws, _encode(frame))


async def _send_text(ws: Any, text: str) -> None:
    """Send a frame; a connection that closed meanwhile loses it (the server fails the call)."""
    from websockets.exceptions import ConnectionClosed

    with contextlib.suppress(ConnectionClosed):
        await ws.send(text)
