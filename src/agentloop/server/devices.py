"""The device hub: the server's end of driver (device) connections (docs/server-api.md, "Drivers").

The WebSocket endpoint authenticates a ``sys.connect`` with ``role: "driver"`` and hands the socket
to ``DeviceHub.serve_driver``, which validates the device's declaration, answers the connect and
then owns the socket: it sends ``req`` frames for tool calls, matches the ``res`` frames by id and
returns when the socket closes. The kernel reaches devices through ``online`` and ``call`` (the
``DeviceDirectory`` protocol in ``agentloop.kernel.devices``).

Failures never raise into a run: an offline device, a timeout and a disconnect are error results.
A timed-out or cancelled call is also cancelled on the device (``request.cancel {id}``), so a shell
command there does not outlive the call that wanted it.

Devices blip (a laptop's lid, a phone changing networks, the server restarting), so a call to a
device that is offline when it is made waits up to ``reconnect_wait`` seconds for it to connect
again, telling the run so (its ``progress``), then runs there: nothing ran yet, so that is always
safe. A call the device drops while it runs is run again the same way only if the tool is
idempotent; any other may have done its work, so it is an error result that says so. The wait
and the answer share the call's own time (its ``deadline``, the runtime's timeout): a wait that
used it up says the device did not reconnect in time. A wait ends at once, with an error, when the
device's token is revoked or it is forgotten (nothing would let it back in), or when it is
connected through another worker sharing the store (calls reach a device only through the worker
holding its connection: this one could not reach it there; known from the ``device.status`` the
other workers send, ``heard``), and when the caller is cancelled (the run aborted). Only a device
the registry says may come back is waited for: a hub without a store knows no registry, and does
not wait; and at most ``MAX_WAITING_CALLS`` calls of an account wait at once. From the server's
shutdown on (``close``) no call waits or is run again: a call it cut is a ``shut_down`` result,
which the kernel's device tools leave to the runtime's close to cancel (``kernel.devices``).

Names: a device id is unique per account. When a second connection claims a name that is already
connected, the hub probes the existing connection (a ``sys.ping`` request); if it answers within
``probe_timeout`` the newcomer is refused with ``conflict``, otherwise the old connection is taken
to be a dead one the server has not noticed yet (a laptop that slept, a NAT that forgot) and the
newcomer replaces it. A device that reconnects after a drop thus gets its name back at once,
while two live machines cannot steal each other's name.

Tokens and the registry: a driver connects with a *device token*, which its owner issues for one
device name (``POST /v1/devices/{name}/token``) and which is good for nothing else: it is not an
account token (the ``tokens`` table never holds it), so user calls refuse it, and a driver that
claims another name with it is refused. Issuing a new one replaces the old; revoking it (``DELETE``),
or replacing it, closes a connection that uses it at once (``DeviceHub.unbind``): on this server, and
on any other sharing the store when it hears of it (``Store.notify_device``, sent in the revoking
transaction; its next heartbeat's token check, should that notification be lost). An account token
is refused for a driver unless the hub was made with ``account_tokens=True`` (``agentloop serve
--device-account-tokens``: the way devices connected before device tokens, kept for a migration).
Every device an owner issued a token for or connected is remembered in the store's ``devices``
table (label, description, first and last seen), listed while offline too; each presence change
reaches the owner's account stream
as ``device.status {device, status: "online" | "offline", timestamp}`` (live only: no account seq),
on every worker sharing the store: the one the device is connected to tells its own account watchers,
and the others through a notification of the transaction that writes the change down (``_seen``).

The registry holds at most ``max_registered`` devices per account (``MAX_REGISTERED_DEVICES``): a
token for a new name past it is refused (``TooManyDevices``), one for a registered name never is. A
revoked device stays registered (listed, with no token), so revoking does not free its slot: its
name is reused by issuing it a token again. Forgetting a device (``DELETE /v1/devices/{name}``,
``forget_device``) deletes its row, token and all, and frees its slot; its connection closes at once
(``DeviceHub.disconnect``, whatever token it used), here or, told by the forgetting transaction's
notification, on another worker (whose heartbeat check also closes one that used a device token,
which no longer resolves, should that notification be lost). A device that leaves is written
down only while it is still registered, so a forgotten one is not brought back by its own leaving.
Counted and written under a key of the owner's (``Store.exclusive``), two registrations through any
workers cannot both pass the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentloop.device.wire import result_from_wire
from agentloop.kernel.devices import DEVICE_SYSCALLS, LOCAL, DeviceInfo, DeviceTool, shut_down, unsafe_schema
from agentloop.messages import TextContent, storable
from agentloop.process.media import MediaError, check_media
from agentloop.process.signals import AccountSignal, Signal, SignalHub
from agentloop.process.store import DeviceRecord, Store
from agentloop.process.store.base import DeviceNews
from agentloop.server.auth import Principal, hash_token
from agentloop.server.strict_json import too_deep
from agentloop.tools.base import ResultBlock, ToolResult

__all__ = [
    "DEFAULT_RECONNECT_WAIT",
    "DEVICE_STATUS",
    "DEVICE_TOKEN_PREFIX",
    "MAX_REGISTERED_DEVICES",
    "DeviceHub",
    "DriverSocket",
    "HubError",
    "TooManyDevices",
    "authenticate_device",
    "check_device_name",
    "device_token_valid",
    "forget_device",
    "issue_device_token",
    "registry",
    "revoke_device_token",
]

log = logging.getLogger("agentloop.devices")

#: a device id: letters, digits, ``-`` and ``_``, starting and ending with a letter or digit, no ``__``
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,30}[A-Za-z0-9])?")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 64
MAX_DESCRIPTION = 4096
MAX_DEVICE_DESCRIPTION = 200  # a device's own description: one line of the system prompt
MAX_LABEL = 64  # a device's display name in listings (one line)
DEVICE_TOKEN_PREFIX = "al_dev_"
DEVICE_STATUS = "device.status"  # the account signal of a device going online or offline
#: how deeply a tool's schema may nest objects and arrays: real ones stay far below it, and the
#: checks that walk a schema (here, at every call, in the providers' encoders) recurse
MAX_SCHEMA_DEPTH = 64
# An account's devices together: every run of the account offers all their tools to the model, and
# providers refuse a request with too many (OpenAI's limit is 128); this also bounds what one
# account's token can hold open on the server.
MAX_DEVICES_PER_ACCOUNT = 16
MAX_ACCOUNT_DEVICE_TOOLS = 128
# An account's devices in the registry (every name it issued a token for or that connected, online
# or not, revoked or not): its rows are kept until the owner forgets them, so without a bound one
# account token (a leaked one too) could add rows without end. Four times the devices it may have
# connected at once.
MAX_REGISTERED_DEVICES = 64
SEND_TIMEOUT = 10.0  # seconds one frame may take to leave; a device that does not read is dropped
#: seconds a call waits for its device to connect again (a blip: a laptop's lid, a network switch)
DEFAULT_RECONNECT_WAIT = 30.0
#: times a call of an idempotent tool is run again after its device dropped it: a device that
#: drops every time (the call itself brings it down) does not keep the run waiting for ever
MAX_RERUNS = 3
#: calls of one account that may wait for their devices at once: each holds a task of its run, and
#: an account's token must not be able to pile them up without end
MAX_WAITING_CALLS = 64
#: seconds before its caller's deadline a device call gives up its wait or its answer, so that its
#: own error (what ran the clock out) reaches the run rather than the runtime's bare "timed out"
DEADLINE_MARGIN = 0.5


class DriverSocket(Protocol):
    """What the hub needs of a WebSocket (Starlette's ``WebSocket`` fits); a disconnect raises."""

    async def send_text(self, data: str) -> None: ...

    async def receive_text(self) -> str: ...

    async def close(self, code: int = 1000, reason: str | None = None) -> None: ...


class HubError(Exception):
    """A rejected ``sys.connect``: ``code`` is the wire error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class TooManyDevices(HubError):
    """A new device name refused: the owner's registry already holds ``limit`` devices."""

    def __init__(self, owner: str, limit: int) -> None:
        super().__init__(
            "too_many_devices",
            f"account {owner} has {limit} devices registered, the most it may have (at most {limit}); "
            "issue a token for one of them again to reuse its name, or forget one (DELETE /v1/devices/{name})",
        )
        self.limit = limit


class _Busy(Exception):
    """A frame waited for the socket past its caller's deadline."""


@dataclass(eq=False)  # (kept in a set: each wait is itself)
class _Wait:
    """A call waiting for its device to connect (again): woken when the device is ready here, or
    ended for good with why (revoked, forgotten, connected elsewhere, shutdown)."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    ended: str | None = None


@dataclass
class _Connection:
    """One live driver socket and the calls waiting on it."""

    info: DeviceInfo
    socket: DriverSocket
    pending: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    closed: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    token_id: str = ""  # the principal's: ``device:<id>`` for a device token (``DeviceHub.unbind``)
    #: its ``sys.connect`` was answered: a call that waited for it is sent only then, for a device
    #: reads the answer to its connect before any request
    ready: bool = False

    async def send(self, frame: dict[str, Any], deadline: float | None = None) -> None:
        """One frame at a time on the socket. ``_Busy`` when the frames before it hold the socket
        past ``deadline`` (the caller's: nothing is wrong with the device); ``TimeoutError`` when
        the frame itself cannot leave in ``SEND_TIMEOUT``: a device that stops reading fills the
        socket's buffer, and would hold every caller waiting on the lock."""
        try:
            async with asyncio.timeout_at(deadline):
                await self.lock.acquire()
        except TimeoutError:
            raise _Busy from None
        try:
            async with asyncio.timeout(SEND_TIMEOUT):
                await self.socket.send_text(json.dumps(frame, separators=(",", ":")))
        finally:
            self.lock.release()

    def fail_all(self, reason: dict[str, Any]) -> None:
        for fut in self.pending.values():
            if not fut.done():
                fut.set_result(reason)
        self.pending.clear()


def _error_res(req_id: Any, code: str, message: str) -> dict[str, Any]:
    return {"type": "res", "id": req_id, "ok": False, "error": {"code": code, "message": message}}


def check_device_name(name: Any) -> str:
    """``name`` if it may name a device, else ``HubError`` (``invalid_request``)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or "__" in name or name == LOCAL:
        raise HubError(
            "invalid_request",
            "name: a device needs a name of 1-32 letters, digits, '-' or '_', starting and ending with a "
            f"letter or digit, without '__', and not '{LOCAL}'",
        )
    return name


def _label(args: dict[str, Any]) -> str:
    label = args.get("label", "")
    if not isinstance(label, str) or len(label) > MAX_LABEL:
        raise HubError("invalid_request", f"label: a string of at most {MAX_LABEL} chars")
    return " ".join(label.split())


# -- device tokens and the registry -----------------------------------------------------------------


async def _devices(store: Store, owner: str) -> list[DeviceRecord]:
    """Inside a transaction: ``owner``'s registry, read under the owner's key, held until the
    transaction ends, so a check of it and the write it allows (a registration under the limit, a
    leave written down only for a device not forgotten, a revoke of the token it read) cannot
    interleave with another such pair, or a forgetting, through any worker sharing the store."""
    await store.exclusive(f"devices of {owner}")
    return await store.list_devices(owner)


async def _registered(store: Store, owner: str) -> set[str]:
    """Inside a transaction: the names in ``owner``'s registry (``_devices``)."""
    return {d.name for d in await _devices(store, owner)}


async def _has_room(store: Store, owner: str, name: str, limit: int) -> bool:
    """Inside a transaction: whether ``owner``'s device ``name`` is registered, or may be (counted
    under the owner's key: registrations cannot all count before any writes and pass the limit)."""
    names = await _registered(store, owner)
    return name in names or len(names) < limit


async def issue_device_token(
    store: Store, owner: str, name: str, *, limit: int = MAX_REGISTERED_DEVICES
) -> tuple[str, str]:
    """A new token bound to ``owner``'s device ``name`` (registering the device if new), replacing
    any token issued for it before: the token (shown once: only its hash is kept) and its id.
    ``TooManyDevices`` for a new name when the owner has ``limit`` devices registered already."""
    check_device_name(name)
    token = DEVICE_TOKEN_PREFIX + secrets.token_urlsafe(32)
    token_id = secrets.token_hex(6)
    async with store.transaction():
        if not await _has_room(store, owner, name, limit):
            raise TooManyDevices(owner, limit)
        await store.set_device_token(owner, name, token_id, hash_token(token), time.time())
        # a connection with the token this one replaces, on another worker, closes now
        await store.notify_device(DeviceNews(owner, name, "revoked", {"token_id": token_id}))
    return token, token_id


async def revoke_device_token(store: Store, owner: str, name: str) -> bool:
    """Unbind the token of ``owner``'s device ``name``; False if it had none. The other workers
    are told which token went (``revoked``), so that one the device connected with meanwhile, with
    a token issued since, is not closed by a notification that arrives after it."""
    async with store.transaction():
        bound = next((d.token_id for d in await _devices(store, owner) if d.name == name), None)
        if bound is None or not await store.set_device_token(owner, name, None, None, time.time()):
            return False
        await store.notify_device(DeviceNews(owner, name, "revoked", {"revoked": bound}))
        return True


async def forget_device(store: Store, owner: str, name: str) -> bool:
    """Remove ``owner``'s device ``name`` from the registry, its token with it, freeing its place
    under the limit; False if it was not registered. Under the owner's key, so a leave being
    written down at the same time (``DeviceHub._seen``) sees it gone instead of writing it back."""
    async with store.transaction():
        await store.exclusive(f"devices of {owner}")
        if not await store.forget_device(owner, name):
            return False
        await store.notify_device(DeviceNews(owner, name, "forgotten"))  # (its connection on another worker)
        return True


async def authenticate_device(store: Store, token: str) -> tuple[Principal, str] | None:
    """The owner (as a principal whose ``token_id`` is ``device:<id>``) and the device name a
    device token is bound to; None for anything else (an account token included), a revoked
    token, or a device whose account is gone."""
    if not token.startswith(DEVICE_TOKEN_PREFIX) or len(token) > 512:
        return None
    record = await store.device_by_token(hash_token(token))
    if record is None or record.token_id is None or await store.get_account(record.owner) is None:
        return None
    return Principal(record.owner, False, f"device:{record.token_id}"), record.name


async def device_token_valid(store: Store, who: Principal, name: str) -> bool:
    """Whether the device token ``who`` connected with is still the one bound to ``name``."""
    if await store.get_account(who.account) is None:
        return False
    token_id = who.token_id.removeprefix("device:")
    return any(d.name == name and d.token_id == token_id for d in await store.list_devices(who.account))


def _device_json(record: DeviceRecord | None, live: DeviceInfo | None) -> dict[str, Any]:
    base = record or DeviceRecord(live.owner if live else "", live.id if live else "")
    out: dict[str, Any] = {
        "id": base.name,
        "owner": base.owner,
        "label": base.label,
        "description": base.description,
        "online": live is not None,
        "has_token": base.token_id is not None,
        "first_seen_at": base.first_seen_at,
        "last_seen_at": base.last_seen_at,
        "implements": [],
        "tools": [],
        "connected_at": None,
    }
    if live is not None:
        out.update(live.to_json())
    return out


async def registry(store: Store, hub: DeviceHub | None, who: Principal) -> list[dict[str, Any]]:
    """``GET /v1/devices``: the caller's devices (every account's for an admin), remembered and
    connected, offline ones included, by owner and name."""
    records = await store.list_devices(None if who.admin else who.account)
    live = {(d.owner, d.id): d for d in (hub.connected(who) if hub is not None else [])}
    rows = {(r.owner, r.name): _device_json(r, live.get((r.owner, r.name))) for r in records}
    for key, info in live.items():  # connected but not (yet) written down
        rows.setdefault(key, _device_json(None, info))
    return [rows[k] for k in sorted(rows)]


def parse_declaration(args: Any) -> tuple[str, tuple[str, ...], tuple[DeviceTool, ...], str]:
    """The device id, syscalls, extra tools and description a ``sys.connect`` declares; ``HubError``
    if invalid. The description goes into prompts, so it is one line of bounded length."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if not isinstance(args, dict):
        raise HubError("invalid_request", "args must be an object")
    name = check_device_name(args.get("name"))
    implements = args.get("implements", [])
    if not isinstance(implements, list) or not all(isinstance(s, str) for s in implements):
        raise HubError("invalid_request", "implements: must be a list of syscall names")
    unknown = sorted(set(implements) - DEVICE_SYSCALLS)
    if unknown:
        raise HubError("invalid_request", f"implements: unknown syscall(s) {unknown}; known: {sorted(DEVICE_SYSCALLS)}")
    raw_tools = args.get("tools", [])
    if not isinstance(raw_tools, list) or len(raw_tools) > MAX_TOOLS:
        raise HubError("invalid_request", f"tools: must be a list of at most {MAX_TOOLS} tools")
    tools: list[DeviceTool] = []
    for i, t in enumerate(raw_tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise HubError("invalid_request", f"{where}: must be an object with name, description, parameters")
        tname, desc, params = t.get("name"), t.get("description", ""), t.get("parameters", {"type": "object"})
        idempotent = t.get("idempotent", False)
        full = f"{name}__{tname}"
        if not isinstance(tname, str) or not _TOOL_NAME.fullmatch(tname) or not _TOOL_NAME.fullmatch(full):
            raise HubError(
                "invalid_request", f"{where}.name: letters, digits, '-' and '_', and '{name}__<name>' at most 64"
            )
        if any(x.name == tname for x in tools):
            raise HubError("invalid_request", f"{where}.name: {tname!r} is declared twice")
        if not isinstance(desc, str) or len(desc) > MAX_DESCRIPTION:
            raise HubError("invalid_request", f"{where}.description: a string of at most {MAX_DESCRIPTION} chars")
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise HubError("invalid_request", f"{where}.parameters: must be a JSON schema of type object")
        if too_deep(params, MAX_SCHEMA_DEPTH):
            raise HubError("invalid_request", f"{where}.parameters: nested deeper than {MAX_SCHEMA_DEPTH} levels")
        try:
            Draft202012Validator.check_schema(params)
        except SchemaError as exc:
            raise HubError("invalid_request", f"{where}.parameters: not a valid JSON schema: {exc.message}") from None
        problem = unsafe_schema(params)
        if problem:
            raise HubError("invalid_request", f"{where}.parameters: {problem}")
        if not isinstance(idempotent, bool):
            raise HubError("invalid_request", f"{where}.idempotent: true or false")
        tools.append(DeviceTool(tname, desc, {"type": "object", **params}, idempotent))
    description = args.get("description", "")
    if not isinstance(description, str) or len(description) > MAX_DEVICE_DESCRIPTION:
        raise HubError("invalid_request", f"description: a string of at most {MAX_DEVICE_DESCRIPTION} chars")
    description = " ".join(description.split())  # one line: it is listed in the system prompt
    return name, tuple(dict.fromkeys(implements)), tuple(tools), description


def _check_room(info: DeviceInfo, others: list[DeviceInfo]) -> None:
    """Refuse a device the account has no room for (``conflict``: the device client tries again
    later, and gets in once another device of the account has gone)."""
    if len(others) >= MAX_DEVICES_PER_ACCOUNT:
        raise HubError(
            "conflict", f"this account already has {len(others)} devices connected (at most {MAX_DEVICES_PER_ACCOUNT})"
        )
    declared = sum(len(d.tools) for d in others)
    if declared + len(info.tools) > MAX_ACCOUNT_DEVICE_TOOLS:
        raise HubError(
            "conflict",
            f"this account's devices already declare {declared} tools; with this device's {len(info.tools)} "
            f"they would pass the limit of {MAX_ACCOUNT_DEVICE_TOOLS} tools in all",
        )


def _report(progress: Callable[[Any], None] | None, update: dict[str, Any]) -> None:
    """Tell the waiting call's run ``update`` (its tool progress); never the call's problem."""
    if progress is None:
        return
    try:
        progress(update)
    except Exception:
        log.debug("a device wait's progress was not told", exc_info=True)


def _result_of(device: str, res: dict[str, Any]) -> ToolResult:
    """A device's ``res`` frame (or a hub-made failure) as a tool result."""
    if res.get("ok") is not True:
        error = res.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        text = str(message or "the device reported an error")
        return ToolResult.error(f"Device {device}: {text}" + (f" ({code})" if code else ""))
    result = result_from_wire(res.get("data"))
    if result is None:
        return ToolResult.error(f"Device {device} answered with a malformed result")
    result.content = [_checked_block(device, b) for b in result.content]
    return result


def _checked_block(device: str, block: ResultBlock) -> ResultBlock:
    """A block of a device's result as it can be stored and shown to a model: text with lone
    surrogates replaced (they have no UTF-8 form: the whole result would be lost at its commit),
    an image or document only if it is what it says, else a note in its place (it would be sent
    with every later model request)."""
    if isinstance(block, TextContent):
        return TextContent(text=storable(block.text))
    try:
        check_media(block)
    except MediaError as exc:
        return TextContent(text=f"[device {device} sent media that was left out: {exc}]")
    return block


class DeviceHub:
    """The online devices of every account, and calls to them. One per server; one event loop."""

    def __init__(
        self,
        *,
        probe_timeout: float = 3.0,
        account_tokens: bool = False,
        max_registered: int = MAX_REGISTERED_DEVICES,
        reconnect_wait: float = DEFAULT_RECONNECT_WAIT,
    ) -> None:
        if not reconnect_wait >= 0:  # (NaN too)
            raise ValueError(f"reconnect_wait must be a number of seconds >= 0, not {reconnect_wait!r}")
        self.probe_timeout = probe_timeout
        #: seconds a call waits for its offline (or dropped) device to connect again; 0: no wait
        self.reconnect_wait = reconnect_wait
        #: how many devices one account may have in the registry (``issue_device_token``'s limit)
        self.max_registered = max_registered
        #: whether a driver may connect with an account token (the old way, before device tokens;
        #: deprecated): off unless asked for, as ``agentloop serve --device-account-tokens`` does
        self.account_tokens = account_tokens
        #: the registry's store and the kernel's signal hub (``bind``): presence is written down
        #: and told to the owner's account stream once the server has bound them
        self.store: Store | None = None
        self.signals: SignalHub | None = None
        self._devices: dict[tuple[str, str], _Connection] = {}
        self._ids = itertools.count(1)
        self._listeners: list[Callable[[str, DeviceInfo], None]] = []
        self._changed = asyncio.Event()
        self._background: set[asyncio.Task[Any]] = set()
        # the calls waiting for a device to connect again, by device (each woken only by its own
        # device), and how many wait per account (``MAX_WAITING_CALLS``)
        self._waits: dict[tuple[str, str], set[_Wait]] = {}
        self._waiting: dict[str, int] = {}
        # devices another worker sharing the store says are connected there (``heard``): a call
        # here could not reach them, so it fails at once rather than wait
        self._remote: set[tuple[str, str]] = set()
        self._closing = False  # ``close`` began: no call waits or runs again any more

    # -- presence ---------------------------------------------------------------------------------

    def online(self, owner: str) -> list[DeviceInfo]:
        """``owner``'s connected devices (``DeviceDirectory``)."""
        return [c.info for (o, _), c in sorted(self._devices.items()) if o == owner]

    def connected(self, who: Principal) -> list[DeviceInfo]:
        """The connected devices ``who`` may see: their own; an admin every account's."""
        return [c.info for (o, _), c in sorted(self._devices.items()) if who.admin or o == who.account]

    def list(self, who: Principal) -> list[dict[str, Any]]:
        """The connected devices ``who`` may see, as JSON (``registry`` adds the offline ones)."""
        return [info.to_json() for info in self.connected(who)]

    def bind(self, store: Store, signals: SignalHub | None) -> None:
        """Where presence is written down (the registry) and told (the owner's account stream)."""
        self.store, self.signals = store, signals

    def subscribe(self, listener: Callable[[str, DeviceInfo], None]) -> Callable[[], None]:
        """Call ``listener("online" | "offline", device)`` on every presence change; returns an
        unsubscribe function."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Wait until ``predicate()`` holds, re-checked at each presence change (tests, tooling)."""
        async with asyncio.timeout(timeout):
            while not predicate():
                event = self._changed
                await event.wait()

    def _notify(self, what: str, info: DeviceInfo) -> dict[str, Any]:
        """A presence change, told here; returns its ``device.status`` payload, for ``_seen`` to
        tell the other workers the very same signal."""
        self._wake()
        status = {"device": info.id, "status": what, "timestamp": time.time()}
        self._tell_account(info.owner, status)
        for listener in list(self._listeners):
            try:
                listener(what, info)
            except Exception:
                log.exception("device presence listener failed")
        return status

    def _wake(self) -> None:
        """Wake whoever waits for a presence change here (``wait_until``; a call waiting for its
        device is woken by that device only, ``_wake_waits``)."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def _tell_account(self, owner: str, status: dict[str, Any]) -> None:
        """``device.status`` to the owner's account watchers here, by the route of every account
        signal (``SignalHub.to_account``, whose filter ``signals.for_account`` passes it): live
        only (no account seq, no pid), as new titles are; a watcher fallen too far behind is ended
        there as for any other account signal."""
        if self.signals is None:
            return
        self.signals.to_account(owner, AccountSignal(None, Signal(DEVICE_STATUS, status)))

    async def _seen(self, info: DeviceInfo, label: str | None, status: dict[str, Any]) -> None:
        """Write down that ``info`` connected (``label`` given) or left (None), and tell the other
        workers sharing the store its ``device.status`` (``status``) in the same transaction; a
        failure is logged, never the device's: presence is kept in memory all the same. A device
        new to a full registry (one connected with an account token under a new name) is not
        written down: the registry's limit holds for every way into it. Nor is the leave of a
        device no longer registered: it was forgotten (its closing is what made it leave), and
        must stay so. Either is told all the same: the device did connect, or leave."""
        if self.store is None:
            return
        description = None if label is None else info.description
        try:
            async with self.store.transaction():
                await self.store.notify_device(DeviceNews(info.owner, info.id, "status", status))
                names = await _registered(self.store, info.owner)
                if info.id not in names and label is None:
                    return
                if info.id not in names and len(names) >= self.max_registered:
                    log.warning(
                        "device %s of %s: not registered (at most %d devices per account)",
                        info.id,
                        info.owner,
                        self.max_registered,
                    )
                    return
                await self.store.device_seen(info.owner, info.id, time.time(), label, description)
        except Exception:
            log.warning("device %s of %s: could not update the registry", info.id, info.owner, exc_info=True)

    # -- connections ------------------------------------------------------------------------------

    async def serve_driver(
        self, websocket: DriverSocket, who: Principal, args: dict[str, Any], connect_id: str
    ) -> None:
        """Serve one driver connection until it closes.

        Validates the ``sys.connect`` args, answers the connect request ``connect_id`` (ok with
        ``{device_id, account, admin, role}``, or an error with code ``invalid_request`` /
        ``conflict``) and, if accepted, reads the socket until it closes. A rejected connect
        returns right after the error response and leaves the socket open for the caller.
        """
        try:
            name, implements, tools, description = parse_declaration(args)
            label = _label(args)
            info = DeviceInfo(name, who.account, implements, tools, time.time(), description)
            conn = _Connection(info, websocket, token_id=who.token_id)
            online = await self._claim(conn)
        except HubError as exc:
            with contextlib.suppress(Exception):
                await websocket.send_text(json.dumps(_error_res(connect_id, exc.code, exc.message)))
            return
        try:
            await self._seen(info, label, online)
            data = {"device_id": name, "account": who.account, "admin": who.admin, "role": "driver"}
            try:
                await conn.send({"type": "res", "id": connect_id, "ok": True, "data": data})
            except Exception:  # gone before it heard back
                return
            conn.ready = True
            self._wake_waits(info.owner, name)  # the calls that waited for it go now
            log.info("device %s of %s connected (%s)", name, who.account, ", ".join(implements) or "no syscalls")
            await self._read(conn)
        finally:
            self._drop(conn, f"Device {name} disconnected before answering")

    async def _claim(self, conn: _Connection) -> dict[str, Any]:
        """Take the device's name for ``conn`` (``HubError`` if it may not have it); returns its
        ``device.status``, told here."""
        key = (conn.info.owner, conn.info.id)
        old = self._devices.get(key)
        if old is not None:
            if await self._answers(old):
                raise HubError("conflict", f"a device named {conn.info.id!r} is already connected to this account")
            log.info("device %s of %s: replacing an unresponsive connection", conn.info.id, conn.info.owner)
            self._drop(old, f"Device {conn.info.id} disconnected (replaced by a new connection)")
            with contextlib.suppress(Exception):
                async with asyncio.timeout(SEND_TIMEOUT):  # (a socket that is not read may not close)
                    await old.socket.close(1001, "replaced by a new connection")
            if key in self._devices:  # another newcomer won the race while we probed
                raise HubError("conflict", f"a device named {conn.info.id!r} is already connected to this account")
        _check_room(conn.info, [c.info for (o, _), c in self._devices.items() if o == conn.info.owner])
        self._devices[key] = conn
        self._remote.discard(key)  # (it left the other worker, whose offline may come later)
        return self._notify("online", conn.info)

    async def _answers(self, conn: _Connection) -> bool:
        """Whether a connection still answers a request (any answer counts)."""
        if conn.closed:
            return False
        req_id = f"ping-{next(self._ids)}"
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        conn.pending[req_id] = fut
        try:
            await asyncio.wait_for(conn.send({"type": "req", "id": req_id, "call": "sys.ping", "args": {}}), 1.0)
            res = await asyncio.wait_for(fut, self.probe_timeout)
        except Exception:
            return False
        finally:
            conn.pending.pop(req_id, None)
        return res.get("hub") != "dropped"

    async def _read(self, conn: _Connection) -> None:
        while True:
            try:
                text = await conn.socket.receive_text()
            except Exception:  # a disconnect (Starlette raises WebSocketDisconnect) or a binary frame
                return
            try:
                frame = json.loads(text)
            except (ValueError, RecursionError):
                frame = None
            if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
                await self._reply(conn, _error_res(None, "bad_frame", "a frame must be a JSON object with a type"))
                continue
            kind, req_id = frame["type"], frame.get("id")
            if kind == "res":
                fut = conn.pending.pop(req_id, None) if isinstance(req_id, str) else None
                if fut is not None and not fut.done():
                    fut.set_result(frame)
            elif kind == "req":
                call = frame.get("call")
                if not isinstance(req_id, str) or not isinstance(call, str):
                    await self._reply(conn, _error_res(req_id, "bad_frame", "a req needs a string id and call"))
                elif call == "sys.ping":
                    await self._reply(conn, {"type": "res", "id": req_id, "ok": True, "data": {}})
                else:
                    await self._reply(conn, _error_res(req_id, "unknown_call", f"drivers cannot call {call!r}"))
            # signals from a device are ignored: none are defined yet

    async def _reply(self, conn: _Connection, frame: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):
            await conn.send(frame)

    def _drop(self, conn: _Connection, reason: str) -> None:
        """Forget a connection (idempotent): its in-flight calls get an error result."""
        if conn.closed:
            return
        conn.closed = True
        conn.fail_all(_error_res(None, "unavailable", reason) | {"hub": "dropped"})
        key = (conn.info.owner, conn.info.id)
        if self._devices.get(key) is conn:
            del self._devices[key]
            log.info("device %s of %s disconnected", conn.info.id, conn.info.owner)
            offline = self._notify("offline", conn.info)
            if self.store is not None:
                self._spawn(self._seen(conn.info, None, offline))

    async def unbind(self, owner: str, name: str, token_id: str | None = None, *, revoked: str | None = None) -> bool:
        """Close ``owner``'s device ``name`` now if it connected with a device token other than
        ``token_id`` (None: its token was revoked; else the id of the one just issued in its place),
        or, given ``revoked`` (another worker's revoke), with exactly that token, so no further call
        reaches a device whose token is gone (the heartbeat's token check alone left it one for up
        to a heartbeat); its in-flight calls fail. A device connected with an account token is left
        alone. True if one closed."""
        if token_id is None and not self.account_tokens:  # (replaced: it may come back with the new one)
            self._end_waits(owner, name, f"Device {name} is not connected: its token was revoked")
        conn = self._devices.get((owner, name))
        if conn is None or conn.closed or not conn.token_id.startswith("device:"):
            return False
        if token_id is not None and conn.token_id == f"device:{token_id}":
            return False
        if revoked is not None and conn.token_id != f"device:{revoked}":
            return False  # (it connected again since, with a token issued after the revoke)
        self._drop(conn, f"Device {name} disconnected (its token was revoked)")
        with contextlib.suppress(Exception):
            async with asyncio.timeout(SEND_TIMEOUT):  # (a socket that is not read may not close)
                await conn.socket.close(4401, "the token was revoked")
        return True

    async def disconnect(self, owner: str, name: str) -> bool:
        """Close ``owner``'s device ``name`` now, whatever token it connected with: it was forgotten
        (``forget_device``), so no further call may reach it. Unlike ``unbind`` this closes one
        connected with an account token too, which the heartbeat would never close (the account
        token stays good); it may connect again, and is then registered anew. True if one closed."""
        self._end_waits(owner, name, f"Device {name} is not connected: it was forgotten")
        conn = self._devices.get((owner, name))
        if conn is None or conn.closed:
            return False
        self._drop(conn, f"Device {name} disconnected (it was forgotten)")
        with contextlib.suppress(Exception):
            async with asyncio.timeout(SEND_TIMEOUT):  # (a socket that is not read may not close)
                await conn.socket.close(4401, "the device was forgotten")
        return True

    def heard(self, news: DeviceNews) -> None:
        """A device event another worker sharing the store committed (``Leases.deviced``, which
        the server registers this with): a presence change goes to the owner's account watchers
        here (the worker it happened on told its own), a revoked or replaced token closes the
        device's connection here if it used another device token (``unbind``), a forgotten device
        closes it here whatever token it used (``disconnect``): at once, not at the next heartbeat.
        An ``offline`` of a device connected here is stale (it left that worker's older connection
        after it reconnected here): it is not told here, and the other workers are told it is
        online again (``_still_online``), so that it is not their account watchers' last word.
        A device told online there, and not connected here, is remembered as connected elsewhere
        until told offline or it connects here (``_heard_status``): a call to it fails at once. (A
        lost ``offline`` leaves it remembered until it connects here again.)"""
        if news.event == "status":
            here = self._devices.get((news.owner, news.name))
            if news.detail.get("status") == "offline" and here is not None and not here.closed:
                # stale: it left the other worker after it connected here (a load balancer moved
                # it, and that worker noticed late): not told here, and told online again there
                self._spawn(self._still_online(here.info))
                return
            self._heard_status(news, here is None or here.closed)
            self._tell_account(news.owner, news.detail)
        elif news.event == "revoked":
            replacement, revoked = news.detail.get("token_id"), news.detail.get("revoked")
            self._spawn(
                self.unbind(
                    news.owner,
                    news.name,
                    replacement if isinstance(replacement, str) else None,
                    revoked=revoked if isinstance(revoked, str) else None,
                )
            )
        elif news.event == "forgotten":
            self._spawn(self.disconnect(news.owner, news.name))

    def _heard_status(self, news: DeviceNews, not_here: bool) -> None:
        """Keep track of the devices connected through another worker (``_remote``): a call to
        one fails at once (``_hopeless``), and one waiting for it ends now."""
        key = (news.owner, news.name)
        if news.detail.get("status") == "offline":
            self._remote.discard(key)
        elif news.detail.get("status") == "online" and not_here:
            self._remote.add(key)
            self._end_waits(news.owner, news.name, self._elsewhere(news.name))

    async def _still_online(self, info: DeviceInfo) -> None:
        """Tell the other workers again that ``info`` is online here (its ``device.status``), after
        one of them told an offline of an older connection of it; a failure is logged."""
        if self.store is None:
            return
        status = {"device": info.id, "status": "online", "timestamp": time.time()}
        try:
            async with self.store.transaction():
                await self.store.notify_device(DeviceNews(info.owner, info.id, "status", status))
        except Exception:
            log.warning("device %s of %s: could not tell it online again", info.id, info.owner, exc_info=True)

    async def close(self) -> None:
        """Server shutdown: close every driver socket (their in-flight calls fail), then wait (up
        to ``SEND_TIMEOUT``) for the work they leave in the background: their leaves written down
        and told to the other workers, before the server closes the store. From now on no call
        waits for a device or runs again: calls waiting end at once, and so do those the closing
        sockets drop (ended again once they are closed: a wait may have begun meanwhile), each a
        ``shut_down`` result (see the module docstring)."""
        self._closing = True
        self._end_all_waits()
        for conn in list(self._devices.values()):
            self._drop(conn, f"Device {conn.info.id} disconnected (server shutting down)")
            with contextlib.suppress(Exception):
                await conn.socket.close(1001, "server shutting down")
        self._end_all_waits()
        pending = list(self._background)
        if pending:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SEND_TIMEOUT):
                    await asyncio.gather(*pending, return_exceptions=True)

    def _end_all_waits(self) -> None:
        for owner, name in list(self._waits):
            self._end_waits(owner, name, self._shutting_down(name))

    @staticmethod
    def _shutting_down(name: str) -> str:
        return f"Device {name} is not connected: the server is shutting down"

    # -- calls ------------------------------------------------------------------------------------

    async def call(
        self,
        owner: str,
        device_id: str,
        call: str,
        args: dict[str, Any],
        timeout: float | None,  # noqa: ASYNC109 - the per-call deadline is part of the contract
        *,
        idempotent: bool = False,
        progress: Callable[[Any], None] | None = None,
        deadline: float | None = None,
        not_a_device: str | None = None,
    ) -> ToolResult:
        """Run ``call`` on ``owner``'s device ``device_id`` (``DeviceDirectory``).

        Offline, not implemented, timed out and disconnected all become error results; on a
        timeout, or if the caller is cancelled, the device is sent ``request.cancel``. A device
        that is offline, or (``idempotent`` only) drops the call, is waited for (``_reconnected``)
        and the call sent to it once it is back. ``timeout`` bounds the device's answer to one
        sending; ``deadline`` (the caller's, event-loop time) the whole call, waits included: the
        hub gives up ``DEADLINE_MARGIN`` before it, so that its error says what ran the clock out.
        """
        key = (owner, device_id)
        end = None if deadline is None else deadline - DEADLINE_MARGIN
        conn = self._live(key)
        reruns = 0
        while True:
            if conn is None:
                back = await self._reconnected(key, progress, "to reconnect", end, not_a_device)
                if isinstance(back, str):
                    return self._failed(back)
                conn = back
            res = await self._call_on(conn, call, args, timeout, end)
            if res is not None:
                return res
            # dropped while it ran: it may have done its work, or some of it
            if self._closing:
                return shut_down(f"Device {device_id} disconnected during {call}: the server is shutting down")
            if not idempotent:
                return ToolResult.error(
                    f"Device {device_id} disconnected during {call}: it dropped while the call ran, so the call may "
                    "or may not have completed (its outcome is unknown); it was not run again"
                )
            reruns += 1
            if reruns > MAX_RERUNS:
                return ToolResult.error(
                    f"Device {device_id} disconnected during {call} {reruns} times; it was not run again"
                )
            what = f"to reconnect, to run {call} again (it dropped while the call ran)"
            back = await self._reconnected(key, progress, what, end, None)
            if isinstance(back, str):
                return self._failed(f"{back}; it dropped during {call}, whose outcome is unknown")
            conn = back

    def _failed(self, why: str) -> ToolResult:
        """The result of a call that got no device: the server's shutdown's (``shut_down``: no
        result of it is to be recorded) once ``close`` began, whatever ended the wait."""
        return shut_down(why) if self._closing else ToolResult.error(why)

    def _live(self, key: tuple[str, str]) -> _Connection | None:
        """The connection of a device that may be sent calls now."""
        conn = self._devices.get(key)
        return conn if conn is not None and conn.ready and not conn.closed else None

    async def _hopeless(self, owner: str, device_id: str, not_a_device: str | None = None) -> str | None:
        """Why a call should not wait for ``owner``'s device ``device_id`` to connect (again), if
        it should not: the server is shutting down, the device is connected through another worker,
        no wait is set, there is no registry to say it is a device at all, the registry does not
        hold it, or its token was revoked (nothing would let it back in). One registry read; a name
        not known to be a device of the owner's gets ``not_a_device`` when given (the caller's words)."""
        base = f"Device {device_id} is not connected"
        if self._closing:
            return self._shutting_down(device_id)
        if (owner, device_id) in self._remote:
            return self._elsewhere(device_id)
        if self.store is None or self.reconnect_wait <= 0:
            return not_a_device or base
        try:
            record = next((d for d in await self.store.list_devices(owner) if d.name == device_id), None)
        except Exception:
            log.warning("device %s of %s: could not read the registry", device_id, owner, exc_info=True)
            return not_a_device or base
        if record is None:
            return not_a_device or f"{base} (it is not one of your registered devices)"
        if record.token_id is None and not self.account_tokens:
            return f"{base}: its token was revoked"
        return None

    async def _reconnected(
        self,
        key: tuple[str, str],
        progress: Callable[[Any], None] | None,
        what: str,
        end: float | None,
        not_a_device: str | None,
    ) -> _Connection | str:
        """``key``'s device once it is connected again, within ``reconnect_wait`` seconds and
        before ``end`` (event-loop time); else why not (an error message). Told to the run through
        ``progress``. At most ``MAX_WAITING_CALLS`` of an account's calls wait at once."""
        owner, device_id = key
        wait = _Wait()
        self._waits.setdefault(key, set()).add(wait)  # first: a revoke while the registry is read ends it too
        self._waiting[owner] = self._waiting.get(owner, 0) + 1
        try:
            why = await self._hopeless(owner, device_id, not_a_device)
            if why is not None:
                return why
            if self._waiting[owner] > MAX_WAITING_CALLS:
                return (
                    f"Device {device_id} is not connected, and {MAX_WAITING_CALLS} calls of this account already "
                    "wait for their devices (the most that may): it was not waited for"
                )
            limit = self.reconnect_wait
            if end is not None:
                limit = max(0.0, min(limit, end - asyncio.get_running_loop().time()))
            if limit > 0:
                _report(
                    progress,
                    {
                        "device": device_id,
                        "wait": limit,
                        "text": f"waiting for device {device_id} {what} (up to {round(limit, 1):g} s)",
                    },
                )
            return await self._until_back(key, wait, limit)
        finally:
            self._unwait(key, wait)

    def _unwait(self, key: tuple[str, str], wait: _Wait) -> None:
        waits = self._waits.get(key)
        if waits is not None:
            waits.discard(wait)
            if not waits:
                del self._waits[key]
        left = self._waiting.get(key[0], 1) - 1
        if left > 0:
            self._waiting[key[0]] = left
        else:
            self._waiting.pop(key[0], None)

    async def _until_back(self, key: tuple[str, str], wait: _Wait, limit: float) -> _Connection | str:
        """Wait up to ``limit`` seconds for ``key``'s device to be connected and ready, or ``wait``
        to be ended; woken by that device only (``_wake_waits``)."""
        try:
            async with asyncio.timeout(limit):
                while True:
                    conn = self._live(key)
                    if conn is not None:
                        return conn
                    if wait.ended is not None:
                        return wait.ended
                    await wait.wake.wait()
                    wait.wake.clear()  # (looked at again above: a wake after it is not lost)
        except TimeoutError:
            if limit < self.reconnect_wait:
                return (
                    f"Device {key[1]} is not connected: it did not connect again in time (the call's time ran "
                    f"out after {limit:.1f} s of waiting for it)"
                )
            return f"Device {key[1]} is not connected: it did not connect again within {self.reconnect_wait:g} s"

    def _wake_waits(self, owner: str, name: str) -> None:
        """Wake the calls waiting for ``owner``'s device ``name``: it is ready here."""
        for wait in self._waits.get((owner, name), ()):
            wait.wake.set()

    def _end_waits(self, owner: str, name: str, why: str) -> None:
        """End the waits of calls for ``owner``'s device ``name`` now, each with ``why``."""
        for wait in self._waits.get((owner, name), ()):
            if wait.ended is None:
                wait.ended = why
                wait.wake.set()

    @staticmethod
    def _elsewhere(name: str) -> str:
        return (
            f"Device {name} is not connected here: it is connected through another worker, and a call "
            "reaches a device only through the worker holding its connection; try the call again"
        )

    async def _call_on(
        self,
        conn: _Connection,
        call: str,
        args: dict[str, Any],
        timeout: float | None,  # noqa: ASYNC109 - the per-call deadline is part of the contract
        end: float | None = None,
    ) -> ToolResult | None:
        """One sending of ``call`` on ``conn``, answered within ``timeout`` and before ``end``
        (event-loop time: the caller's): its result, or None if the device dropped it."""
        device_id = conn.info.id
        if call.startswith("tool."):
            if not any(t.name == call[5:] for t in conn.info.tools):
                return ToolResult.error(f"Device {device_id} has no tool {call[5:]!r}")
        elif call not in conn.info.implements:
            return ToolResult.error(f"Device {device_id} does not implement {call}")
        req_id = f"call-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        conn.pending[req_id] = fut
        sent = loop.time()
        own = None if timeout is None else sent + timeout
        deadline = own if end is None or (own is not None and own <= end) else end  # sending counts towards it
        try:
            await conn.send({"type": "req", "id": req_id, "call": call, "args": args}, deadline)
        except _Busy:
            conn.pending.pop(req_id, None)
            return ToolResult.error(
                f"Device {device_id}: {call} timed out before it could be sent (the device is busy)"
            )
        except Exception as exc:
            conn.pending.pop(req_id, None)
            why = "does not read what it is sent" if isinstance(exc, TimeoutError) else "disconnected"
            self._drop(conn, f"Device {device_id} {why}")
            return ToolResult.error(f"Device {device_id} {why}; the call was not sent")
        except asyncio.CancelledError:
            # The frame may have left already (a cancel while the socket drains it): the device
            # would run it with nobody waiting. A cancel for an id it never got is harmless.
            self._cancel_on_device(conn, req_id)
            raise
        try:
            res = await asyncio.wait_for(asyncio.shield(fut), None if deadline is None else deadline - loop.time())
        except TimeoutError:
            self._cancel_on_device(conn, req_id)
            if deadline != own:  # the caller's time ran out first (some of it went on waiting for the device)
                return ToolResult.error(
                    f"Device {device_id}: {call} timed out: the call's time ran out {loop.time() - sent:.1f} s after "
                    "it was sent; it was cancelled there"
                )
            return ToolResult.error(f"Device {device_id}: {call} timed out after {timeout:g} s; it was cancelled there")
        except asyncio.CancelledError:
            self._cancel_on_device(conn, req_id)
            raise
        if res.get("hub") == "dropped":
            return None
        return _result_of(device_id, res)

    def _cancel_on_device(self, conn: _Connection, req_id: str) -> None:
        """Tell the device to stop ``req_id``, without waiting (the caller may be cancelled)."""
        fut = conn.pending.pop(req_id, None)
        if fut is not None and not fut.done():
            fut.cancel()
        if conn.closed:
            return
        frame = {"type": "req", "id": f"cancel-{next(self._ids)}", "call": "request.cancel", "args": {"id": req_id}}
        self._spawn(self._reply(conn, frame))

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` in the background, kept referenced until it is done."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
