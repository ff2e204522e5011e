"""The ``/v1/ws`` WebSocket endpoint: the process API as JSON frames, plus live signals.

One socket carries many requests at once, so each request runs as its own task and answers with
its own ``res`` frame; a slow call never holds up the others. The same ``ProcessService`` as HTTP
does the work, so both transports share one set of access rules and JSON shapes; this module only
parses frames, schedules calls and serialises what comes back.

A connection must survive anything a client sends: a bad frame is answered and forgotten, a
failing call answers ``internal`` and is logged, and only the socket's own end (or the server
stopping) ends it. Everything a connection starts (requests, subscriptions) ends with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.routing import BaseRoute, WebSocketRoute
from starlette.types import Message
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from agentloop.kernel import NoSuchProcess
from agentloop.process.signals import AccountSignal, Signal
from agentloop.process.store import MAX_SEQ
from agentloop.server.auth import Principal, bearer
from agentloop.server.context import ServerContext
from agentloop.server.devices import DeviceHub, authenticate_device, device_token_valid
from agentloop.server.errors import ApiError
from agentloop.server.strict_json import json_text

logger = logging.getLogger("agentloop.server")
T = TypeVar("T")

MAX_IN_FLIGHT = 32  # requests one connection may have running or waiting for their answer to leave
MAX_SUBSCRIPTIONS = 64  # processes one connection may follow at once
MAX_ID = 128  # longest request id (and pid, run id, approval id) accepted
CONNECT_TIMEOUT = 10.0  # seconds a socket may stay open without a successful sys.connect
SEND_TIMEOUT = 30.0  # seconds one frame may take to leave; a client that stops reading is dropped
CLOSE_GOING_AWAY = 1001  # the server is stopping
CLOSE_POLICY = 1008  # no sys.connect in time, or a client that does not read its frames
CLOSE_UNAUTHORIZED = 4401  # sys.connect with a bad token (a driver's: not its device's)

#: a driver handed to the device hub: who, its sys.connect args and id, and how to ask whether the
#: token it connected with is still good (a device token's own check, or an account token's)
_Driver = tuple[Principal, dict[str, Any], str, Callable[[], Awaitable[bool]]]

Handler = Callable[["Connection", dict[str, Any]], Awaitable[Any]]
Outcome = tuple[dict[str, Any], Callable[[], None] | None]  # a res frame, and what to start once it is sent


def _log(level: int, message: str, *, exc_info: bool = False, **fields: Any) -> None:
    """One JSON line per record, like the rest of the server. Frames and tokens are never logged:
    they carry user text and credentials."""
    if not logger.isEnabledFor(level):
        return
    payload = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "level": logging.getLevelName(level).lower(),
        "component": "ws",
        "message": message,
        **fields,
    }
    if exc_info:
        payload["exception"] = traceback.format_exc()
    logger.log(level, json.dumps(payload, default=str))


# ------------------------------------------------------------------ frames


class FrameError(Exception):
    """A frame that is not a well-formed request; ``id`` is its id when one could be read."""

    def __init__(self, message: str, id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.id = id


@dataclass(frozen=True, slots=True)
class Request:
    id: str
    call: str
    args: dict[str, Any]


def _readable_id(frame: dict[str, Any]) -> str | None:
    """The frame's id if it is one we may echo back (a short string of valid Unicode), else None:
    an id holding a lone surrogate, echoed, would make the error frame itself one that strict
    JSON parsers refuse, so the client could not read why its frame was refused."""
    rid = frame.get("id")
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_ID or _has_lone_surrogate(rid):
        return None
    return rid


# A frame's text arrives as valid UTF-8, so a lone surrogate can only come from a JSON escape.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a decoded JSON value holds a string (or key) that is not valid Unicode: such text
    cannot be stored or sent on, so it is refused at the door instead of failing deep inside a call."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


# The calls that may carry images and documents, so may be as large as their HTTP bodies may.
MEDIA_CALLS = ("proc.spawn", "proc.send")


def parse_frame(message: Message, limit: int, media_limit: int = 0) -> Request:
    """A request from one ASGI receive message, or ``FrameError`` saying what is wrong with it.

    A frame is at most ``limit`` bytes, or ``media_limit`` for the calls that carry media (as the
    HTTP API allows them ``max_media_body``). The size is checked before parsing so that a frame
    larger than both costs no JSON work; one between the two is parsed, so that its refusal names
    its id; and no field is trusted before its type is checked.
    """
    text = message.get("text")
    if text is None:
        raise FrameError("binary frames are not supported: send JSON text frames")
    largest = max(limit, media_limit)
    size = len(text)
    if size <= largest:
        size = len(text.encode("utf-8", "surrogatepass"))
    if size > largest:
        raise FrameError(f"frame larger than {largest} bytes")
    try:
        frame = json.loads(text)
    except ValueError:
        raise FrameError("frame is not valid JSON") from None
    except RecursionError:
        raise FrameError("frame nests too deeply") from None
    if not isinstance(frame, dict):
        raise FrameError("frame must be a JSON object")
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(frame):
        raise FrameError("frame contains invalid Unicode (a lone surrogate escape)", _readable_id(frame))
    rid = _readable_id(frame)
    if rid is None:
        raise FrameError(f"id must be a non-empty string of at most {MAX_ID} characters")
    if frame.get("type") != "req":
        raise FrameError('type must be "req"', rid)
    call = frame.get("call")
    if not isinstance(call, str) or not call:
        raise FrameError("call must be a non-empty string", rid)
    if size > limit and call not in MEDIA_CALLS:
        raise FrameError(f"frame larger than {limit} bytes (only {' and '.join(MEDIA_CALLS)} carry media)", rid)
    args = frame.get("args", {})
    if not isinstance(args, dict):
        raise FrameError("args must be an object", rid)
    return Request(rid, call, args)


def res_ok(rid: str, data: Any) -> dict[str, Any]:
    return {"type": "res", "id": rid, "ok": True, "data": data}


def res_error(rid: str | None, code: str, message: str) -> dict[str, Any]:
    return {"type": "res", "id": rid, "ok": False, "error": {"code": code, "message": message}}


def sig_frame(pid: str | None, signal: Signal) -> dict[str, Any]:
    return {"type": "sig", "signal": signal.signal, "payload": signal.payload, "seq": signal.seq, "pid": pid}


def account_sig_frame(item: AccountSignal) -> dict[str, Any]:
    """A signal of the account stream: a process subscription's frame, with ``id``, its account
    seq (what ``account.subscribe {after_seq}`` resumes after; null for a new title)."""
    return {**sig_frame(item.pid, item.signal), "id": item.seq}


# ------------------------------------------------------------------ arguments


def _invalid(message: str) -> ApiError:
    return ApiError(400, "invalid_request", message)


def _want(args: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str, default: Any) -> Any:
    """``args[name]`` checked against ``kind`` (bools are not ints), or ``default`` when absent."""
    value = args.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
        raise _invalid(f"{name} must be {what}")
    return value


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _opt_id(args: dict[str, Any], name: str) -> str | None:
    """An optional identifier argument (pid, run id, approval id): a short non-empty string."""
    value: str | None = _want(args, name, str, "a string", None)
    if value is not None and (not value or len(value) > MAX_ID):
        raise _invalid(f"{name} must be a non-empty string of at most {MAX_ID} characters")
    return value


def _id(args: dict[str, Any], name: str) -> str:
    value = _opt_id(args, name)
    if value is None:
        raise _invalid(f"{name} is required")
    return value


def _str(args: dict[str, Any], name: str) -> str:
    """A required string argument (any length: the service judges its content)."""
    value: str | None = _want(args, name, str, "a string", None)
    if value is None:
        raise _invalid(f"{name} is required")
    return value


def _opt_int(args: dict[str, Any], name: str, *, minimum: int = 0) -> int | None:
    value: int | None = _want(args, name, int, "an integer", None)
    if value is not None and value < minimum:
        raise _invalid(f"{name} must be at least {minimum}")
    if value is not None and value > MAX_SEQ:  # past SQLite's INTEGER: a bad request, not a storage error
        raise _invalid(f"{name} must be at most {MAX_SEQ}")
    return value


def _int(args: dict[str, Any], name: str, default: int, *, minimum: int = 0) -> int:
    value = _opt_int(args, name, minimum=minimum)
    return default if value is None else value


# ------------------------------------------------------------------ calls


@dataclass(frozen=True, slots=True)
class Then:
    """A result plus what to start once it has been sent (a subscription's stream), so the client
    always reads the ``res`` before the first ``sig`` it caused."""

    data: Any
    start: Callable[[], None]


@dataclass(frozen=True, slots=True)
class Call:
    """A user call. ``args``: the arguments it takes; any other is refused, as HTTP refuses an
    unknown field (a misspelt ``run_id`` must not turn a retry into a second message).
    ``mutates``: it changes state, so once started it runs to its end even if the request is
    cancelled or the socket closes (half a kill or a send is worse than a late one)."""

    handler: Handler
    args: frozenset[str] = frozenset()
    mutates: bool = False


def _takes(*names: str) -> frozenset[str]:
    return frozenset(names)


def _check_args(args: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise _invalid(f"{unknown[0][:64]}: unknown argument (this call takes {', '.join(sorted(allowed)) or 'none'})")


async def _spawn(conn: Connection, args: dict[str, Any]) -> Any:
    return await conn.service.spawn(
        conn.user,
        context=_want(args, "context", str, "a string", ""),
        interactive=_want(args, "interactive", bool, "a boolean", True),
        cwd=_want(args, "cwd", str, "a string", None),
        mode=_want(args, "mode", str, "a string", "agent"),
        model=_want(args, "model", str, "a string", None),
        reasoning=_want(args, "reasoning", str, "a string", None),
        tools=_want(args, "tools", list, "a list of tool names", None),
        text=_want(args, "text", str, "a string", None),
        media=_want(args, "media", list, "a list", None),
        run_id=_opt_id(args, "run_id"),
        output_schema=_want(args, "output_schema", dict, "a JSON Schema object", None),
    )


async def _mode(conn: Connection, args: dict[str, Any]) -> Any:
    return await conn.service.mode(conn.user, _id(args, "pid"), _want(args, "mode", str, "a string", None))


async def _tools_get(conn: Connection, args: dict[str, Any]) -> Any:
    """The process's tool scope: ``{pid, tools, available}`` (as HTTP's GET)."""
    return await conn.service.tools(conn.user, _id(args, "pid"))


async def _tools_set(conn: Connection, args: dict[str, Any]) -> Any:
    """``{pid, tools}``: its tool scope from the next run on (null: every tool); the service checks it."""
    pid = _id(args, "pid")
    if "tools" not in args:
        raise _invalid("tools is required (null: every tool)")
    return await conn.service.tools(conn.user, pid, {"tools": _want(args, "tools", list, "a list or null", None)})


async def _model_get(conn: Connection, args: dict[str, Any]) -> Any:
    """The process's model: ``{pid, model, reasoning, effective, source}`` (as HTTP's GET)."""
    return await conn.service.model(conn.user, _id(args, "pid"))


async def _model_set(conn: Connection, args: dict[str, Any]) -> Any:
    """``{pid, model, reasoning?}``: its own model from the next run on (a null ``model``, and no
    level, returns it to the account's or the server's); the service checks the choice."""
    pid = _id(args, "pid")
    if "model" not in args:
        raise _invalid("model is required (null returns to the account's or the server's model)")
    change = {
        "model": _want(args, "model", str, "a string or null", None),
        "reasoning": _want(args, "reasoning", str, "a string or null", None),
    }
    return await conn.service.model(conn.user, pid, change)


async def _compaction(conn: Connection, args: dict[str, Any]) -> Any:
    """Read the policy; with any of its fields (a null one too), replace it (the service checks them)."""
    change: dict[str, Any] = {k: args[k] for k in ("threshold", "overflow", "keep_recent_tokens") if k in args}
    return await conn.service.compaction(conn.user, _id(args, "pid"), change or None)


async def _title(conn: Connection, args: dict[str, Any]) -> Any:
    """``{pid}`` reads the title; ``{pid, title}`` sets it, a null ``title`` clears it."""
    pid = _id(args, "pid")
    if "title" not in args:
        return await conn.service.title(conn.user, pid)
    return await conn.service.set_title(conn.user, pid, _want(args, "title", str, "a string or null", None))


async def _list(conn: Connection, args: dict[str, Any]) -> Any:
    return {"processes": await conn.service.list_processes(conn.user)}


async def _get(conn: Connection, args: dict[str, Any]) -> Any:
    return await conn.service.get(conn.user, _id(args, "pid"))


async def _send(conn: Connection, args: dict[str, Any]) -> Any:
    pid = _id(args, "pid")
    text = _str(args, "text")
    return await conn.service.send(
        conn.user,
        pid,
        text,
        mode=_want(args, "mode", str, "a string", "steer"),
        media=_want(args, "media", list, "a list", None),
        run_id=_opt_id(args, "run_id"),
        output_schema=_want(args, "output_schema", dict, "a JSON Schema object", None),
        expected_run_id=_opt_id(args, "expected_run_id"),
    )


async def _history(conn: Connection, args: dict[str, Any]) -> Any:
    return await conn.service.history(
        conn.user, _id(args, "pid"), limit=_int(args, "limit", 100, minimum=1), before=_opt_int(args, "before")
    )


async def _stop(conn: Connection, args: dict[str, Any]) -> Any:
    return await conn.service.stop(conn.user, _id(args, "pid"), run_id=_opt_id(args, "run_id"))


async def _abort(conn: Connection, args: dict[str, Any]) -> Any:
    return await conn.service.abort(conn.user, _id(args, "pid"), run_id=_opt_id(args, "run_id"))


async def _retry(conn: Connection, args: dict[str, Any]) -> Any:
    return await conn.service.retry(conn.user, _id(args, "pid"), run_id=_opt_id(args, "run_id"))


async def _hil(conn: Connection, args: dict[str, Any]) -> Any:
    pid, request_id = _id(args, "pid"), _id(args, "request_id")
    decision = _str(args, "decision")
    remember = _want(args, "remember", (bool, str), "a boolean or 'run', 'process' or 'account'", False)
    message = _want(args, "message", str, "a string", None)
    arguments = _want(args, "arguments", dict, "an object", None)
    return await conn.service.hil(
        conn.user, pid, request_id, decision=decision, remember=remember, message=message, arguments=arguments
    )


async def _approvals(conn: Connection, args: dict[str, Any]) -> Any:
    return {"requests": await conn.service.approvals(conn.user, _id(args, "pid"))}


async def _reset(conn: Connection, args: dict[str, Any]) -> Any:
    return await conn.service.reset(conn.user, _id(args, "pid"))


async def _compact(conn: Connection, args: dict[str, Any]) -> Any:
    instructions = _want(args, "instructions", str, "a string", None)
    keep_last, through = _opt_int(args, "keep_last"), _opt_int(args, "through")
    summary = _want(args, "summary", str, "a string", None)
    return await conn.service.compact(
        conn.user, _id(args, "pid"), instructions=instructions, keep_last=keep_last, through=through, summary=summary
    )


async def _rewind(conn: Connection, args: dict[str, Any]) -> Any:
    at = _opt_int(args, "at")
    if at is None:
        raise _invalid("at is required")
    return await conn.service.rewind(conn.user, _id(args, "pid"), at)


async def _segment_list(conn: Connection, args: dict[str, Any]) -> Any:
    return {"segments": await conn.service.segments(conn.user, _id(args, "pid"))}


async def _segment_read(conn: Connection, args: dict[str, Any]) -> Any:
    pid, segment_id = _id(args, "pid"), _id(args, "segment_id")
    limit, before = _int(args, "limit", 100, minimum=1), _opt_int(args, "before")
    return await conn.service.segment(conn.user, pid, segment_id, limit=limit, before=before)


async def _fork(conn: Connection, args: dict[str, Any]) -> Any:
    pid = _id(args, "pid")
    at, segment = _opt_int(args, "at"), _opt_id(args, "segment")
    context = _want(args, "context", str, "a string", None)
    fork_id = _opt_id(args, "fork_id")
    return await conn.service.fork(conn.user, pid, at=at, segment=segment, context=context, fork_id=fork_id)


async def _kill(conn: Connection, args: dict[str, Any]) -> Any:
    return await conn.service.kill(conn.user, _id(args, "pid"))


async def _subscribe(conn: Connection, args: dict[str, Any]) -> Any:
    pid, after_seq = _id(args, "pid"), _int(args, "after_seq", 0)
    if pid not in conn.subscriptions and len(conn.subscriptions) >= MAX_SUBSCRIPTIONS:
        raise ApiError(409, "conflict", f"a connection may follow at most {MAX_SUBSCRIPTIONS} processes")
    stream = await conn.service.signals(conn.user, pid, after_seq=after_seq)  # not_found before anything streams
    return Then({"pid": pid, "after_seq": after_seq}, lambda: conn.follow(pid, stream))


async def _account_subscribe(conn: Connection, args: dict[str, Any]) -> Any:
    """``account.subscribe {after_seq?}``: the account's signals after that account seq, or from
    now on; the answer's ``after_seq`` says where the stream starts (the newest account seq now,
    without one), which a client resumes from if it is cut off before any signal comes."""
    after_seq = _opt_int(args, "after_seq")
    start, stream = await conn.service.account_signals(conn.user, after_seq=after_seq)
    return Then(
        {"account": conn.user.account, "after_seq": start},
        lambda: conn.follow_account(conn.resuming_account(stream, start)),
    )


async def _account_approvals(conn: Connection, args: dict[str, Any]) -> Any:
    account = _opt_id(args, "account")
    return {"requests": await conn.service.account_approvals(conn.user, account)}


async def _signal(conn: Connection, args: dict[str, Any]) -> Any:
    pid = _id(args, "pid")
    text = _str(args, "text")
    return await conn.service.signal(conn.user, pid, text, run_id=_opt_id(args, "run_id"))


async def _schedule_add(conn: Connection, args: dict[str, Any]) -> Any:
    pid = _id(args, "pid")
    text = _str(args, "text")
    return await conn.service.schedule(
        conn.user,
        pid,
        text,
        at=_want(args, "at", (int, float), "a number of epoch seconds", None),
        every=_want(args, "every", (int, float), "a number of seconds", None),
        name=_want(args, "name", str, "a string", None),
        cron=_want(args, "cron", str, "a cron expression", None),
        tz=_want(args, "tz", str, "an IANA time zone", None),
    )


async def _schedule_list(conn: Connection, args: dict[str, Any]) -> Any:
    return {"schedules": await conn.service.schedules(conn.user, _id(args, "pid"))}


async def _schedule_remove(conn: Connection, args: dict[str, Any]) -> Any:
    return await conn.service.unschedule(conn.user, _id(args, "pid"), _id(args, "schedule_id"))


async def _watch_add(conn: Connection, args: dict[str, Any]) -> Any:
    return await conn.service.watch(
        conn.user,
        _id(args, "pid"),
        _id(args, "source_pid"),
        signal=_want(args, "signal", str, "a string", "proc.run.finished"),
        once=_want(args, "once", bool, "a boolean", True),
    )


async def _watch_list(conn: Connection, args: dict[str, Any]) -> Any:
    return {"watches": await conn.service.watches(conn.user, _id(args, "pid"))}


async def _watch_remove(conn: Connection, args: dict[str, Any]) -> Any:
    return await conn.service.unwatch(conn.user, _id(args, "pid"), _id(args, "watch_id"))


async def _queue_list(conn: Connection, args: dict[str, Any]) -> Any:
    return {"items": await conn.service.queue(conn.user, _id(args, "pid"))}


async def _queue_withdraw(conn: Connection, args: dict[str, Any]) -> Any:
    pid, item_id = _id(args, "pid"), _opt_int(args, "item_id", minimum=1)
    kind = _want(args, "kind", str, "a string", None)
    return {"withdrawn": await conn.service.withdraw(conn.user, pid, item_id, kind=kind)}


CALLS: dict[str, Call] = {
    "proc.spawn": Call(
        _spawn,
        _takes(
            "context",
            "interactive",
            "cwd",
            "mode",
            "model",
            "reasoning",
            "tools",
            "text",
            "media",
            "run_id",
            "output_schema",
        ),
        mutates=True,
    ),
    "proc.list": Call(_list, _takes()),
    "proc.get": Call(_get, _takes("pid")),
    "proc.send": Call(
        _send, _takes("pid", "text", "mode", "media", "run_id", "output_schema", "expected_run_id"), mutates=True
    ),
    "proc.history": Call(_history, _takes("pid", "limit", "before")),
    "proc.abort": Call(_abort, _takes("pid", "run_id"), mutates=True),
    "proc.stop": Call(_stop, _takes("pid", "run_id"), mutates=True),
    "proc.retry": Call(_retry, _takes("pid", "run_id"), mutates=True),
    "proc.mode": Call(_mode, _takes("pid", "mode"), mutates=True),
    "proc.title": Call(_title, _takes("pid", "title"), mutates=True),
    "proc.compaction": Call(_compaction, _takes("pid", "threshold", "overflow", "keep_recent_tokens"), mutates=True),
    "proc.tools.get": Call(_tools_get, _takes("pid")),
    "proc.tools.set": Call(_tools_set, _takes("pid", "tools"), mutates=True),
    "proc.model.get": Call(_model_get, _takes("pid")),
    "proc.model.set": Call(_model_set, _takes("pid", "model", "reasoning"), mutates=True),
    "proc.hil": Call(_hil, _takes("pid", "request_id", "decision", "remember", "message", "arguments"), mutates=True),
    "proc.approvals": Call(_approvals, _takes("pid")),
    "proc.reset": Call(_reset, _takes("pid"), mutates=True),
    "proc.fork": Call(_fork, _takes("pid", "at", "segment", "context", "fork_id"), mutates=True),
    "proc.kill": Call(_kill, _takes("pid"), mutates=True),
    "proc.compact": Call(_compact, _takes("pid", "instructions", "keep_last", "through", "summary"), mutates=True),
    "proc.rewind": Call(_rewind, _takes("pid", "at"), mutates=True),
    "proc.segment.list": Call(_segment_list, _takes("pid")),
    "proc.segment.read": Call(_segment_read, _takes("pid", "segment_id", "limit", "before")),
    "proc.subscribe": Call(_subscribe, _takes("pid", "after_seq")),
    "proc.signal": Call(_signal, _takes("pid", "text", "run_id"), mutates=True),
    "proc.schedule.add": Call(_schedule_add, _takes("pid", "text", "at", "every", "name", "cron", "tz"), mutates=True),
    "proc.schedule.list": Call(_schedule_list, _takes("pid")),
    "proc.schedule.remove": Call(_schedule_remove, _takes("pid", "schedule_id"), mutates=True),
    "proc.watch.add": Call(_watch_add, _takes("pid", "source_pid", "signal", "once"), mutates=True),
    "proc.watch.list": Call(_watch_list, _takes("pid")),
    "proc.watch.remove": Call(_watch_remove, _takes("pid", "watch_id"), mutates=True),
    "proc.queue.list": Call(_queue_list, _takes("pid")),
    "proc.queue.withdraw": Call(_queue_withdraw, _takes("pid", "item_id", "kind"), mutates=True),
    "account.subscribe": Call(_account_subscribe, _takes("after_seq")),
    "approvals.list": Call(_account_approvals, _takes("account")),
}

_ACCOUNT = "account"
_PROCESS = "proc:"


def _follows(req: Request) -> str | None:
    """What a subscribe request follows (``_ACCOUNT``, or ``_PROCESS`` and its pid); None for other calls."""
    if req.call == "account.subscribe":
        return _ACCOUNT
    pid = req.args.get("pid")
    return _PROCESS + pid if req.call == "proc.subscribe" and isinstance(pid, str) else None


# Calls that change state keep running after their socket closes: referenced here until done.
_detached: set[asyncio.Future[Outcome]] = set()


# ------------------------------------------------------------------ the connection


class Connection:
    """One socket: its caller, its running requests and its subscriptions."""

    def __init__(self, ctx: ServerContext, websocket: WebSocket) -> None:
        self.ctx = ctx
        self.ws = websocket
        self.service = ctx.processes
        self.who: Principal | None = None
        self.subscriptions: dict[str, asyncio.Task[None]] = {}
        self.account_stream: asyncio.Task[None] | None = None  # ``account.subscribe``'s
        self._requests: dict[str, tuple[asyncio.Task[None], Call]] = {}  # running, still cancellable
        # Requests started and not yet answered. Not ``len(_requests)``: a request leaves that once its
        # call is done, and its answer may then wait for a client that does not read; counted until
        # it is sent, the limit also bounds the answers such a client makes the server hold.
        self._unanswered = 0
        self._tasks: set[asyncio.Task[None]] = set()  # every request and stream task, until it ends
        self._cancel_asked: set[str] = set()
        self._subscribing: dict[str, set[asyncio.Task[None]]] = {}  # subscribe requests running, by ``_follows``
        self._send_lock = asyncio.Lock()
        self._closed = False
        self._reader: asyncio.Task[Any] | None = None
        self._dropped = False  # the reader was cancelled because the client stopped reading
        self._ending = False  # teardown has begun: start nothing new
        self._connect_by = 0.0  # loop time by which sys.connect must have succeeded

    @property
    def user(self) -> Principal:
        assert self.who is not None, "user calls run only after sys.connect"
        return self.who

    # -- lifecycle ---------------------------------------------------------------------------

    async def serve(self) -> None:
        """Accept, read frames until the socket ends, then stop everything the socket started."""
        await self.ws.accept()
        self._reader = asyncio.current_task()
        self._connect_by = asyncio.get_running_loop().time() + CONNECT_TIMEOUT
        watcher = asyncio.create_task(self._close_when_stopping())
        revoked = asyncio.create_task(self._close_when_revoked())
        driver: _Driver | None = None
        try:
            driver = await self._read()
        except asyncio.CancelledError:
            if not self._dropped:
                raise
            self._uncancel()
            await self._close(CLOSE_POLICY, "the client does not read its frames")
        finally:
            watcher.cancel()
            revoked.cancel()
            await self._teardown(watcher, revoked)
        if driver is not None:  # the device hub owns the socket from here until it closes
            await self._hand_over(*driver)

    async def _hand_over(
        self, who: Principal, args: dict[str, Any], connect_id: str, valid: Callable[[], Awaitable[bool]]
    ) -> None:
        """Give a driver's socket to the device hub, which answers its sys.connect itself. When the
        hub returns with the socket still open (it refused the device) the socket is closed here,
        cleanly, instead of being cut; a hub failure ends this socket only (1011)."""
        code = 1000
        revoked = asyncio.create_task(self._close_when_revoked(who, valid))  # a device lends tools: same rule
        try:
            await self.ctx.devices.serve_driver(self.ws, who, args, connect_id)
        except Exception:
            _log(logging.ERROR, "device hub failed", exc_info=True, account=who.account)
            code = 1011
        finally:
            revoked.cancel()
            await asyncio.gather(revoked, return_exceptions=True)
        if self.ws.application_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(SEND_TIMEOUT):
                    await self.ws.close(code)

    async def _close_when_revoked(
        self, driver: Principal | None = None, valid: Callable[[], Awaitable[bool]] | None = None
    ) -> None:
        """Every heartbeat, check the token the socket connected with (a user's, or a device
        driver's once the hub has the socket): a revoked one closes the socket. A check that fails
        (the store unreachable for a moment) is logged and tried again next time: were this task to
        end on it, a token revoked later would keep the socket open for as long as it lasts."""
        while True:
            await asyncio.sleep(self.ctx.heartbeat)
            who = driver or self.who
            if who is None:
                continue
            try:
                good = await (valid() if valid is not None else self.ctx.accounts.still_valid(who))
            except Exception:
                _log(logging.WARNING, "token check failed", exc_info=True, account=who.account)
                continue
            if not good:
                await self._close(CLOSE_UNAUTHORIZED, "the token was revoked")
                return

    async def _close_when_stopping(self) -> None:
        await self.ctx.stopping.wait()
        await self._close(CLOSE_GOING_AWAY, "server shutting down")

    async def _teardown(self, *extra: asyncio.Task[Any]) -> None:
        """Cancel and await every task this connection started, so none outlives it."""
        self._ending = True
        tasks = [*self._tasks, *extra]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._requests.clear()
        self.subscriptions.clear()
        self.account_stream = None

    def _uncancel(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()

    # -- reading -----------------------------------------------------------------------------

    async def _receive(self) -> Message | None:
        """The next message, or None once the socket is gone (or never connected in time)."""
        if self._closed:
            with contextlib.suppress(Exception):  # drain until the client's close arrives
                while (await self.ws.receive())["type"] != "websocket.disconnect":
                    pass
            return None
        try:
            if self.who is None:  # one deadline for the whole handshake, not one per frame
                async with asyncio.timeout_at(self._connect_by):
                    message = await self.ws.receive()
            else:
                message = await self.ws.receive()
        except TimeoutError:
            await self._close(CLOSE_POLICY, "sys.connect expected")
            return await self._receive()
        except (WebSocketDisconnect, RuntimeError, OSError):
            return None
        return None if message["type"] == "websocket.disconnect" else message

    async def _read(self) -> _Driver | None:
        """Read and dispatch frames; returns a driver's hand-over details when one connects."""
        while (message := await self._receive()) is not None:
            if self._closed:  # closed (a revoked token, shutdown) while this frame was awaited: not run
                continue
            try:
                req = parse_frame(message, self.ctx.max_body, self.ctx.max_media_body)
            except FrameError as exc:
                await self.send(res_error(exc.id, "bad_frame", exc.message))
                continue
            try:
                driver = await self._handle(req)
            except Exception:  # a bug here must not end the connection, let alone the server
                _log(logging.ERROR, "frame handling failed", exc_info=True, call=req.call)
                await self.send(res_error(req.id, "internal", "internal error"))
                continue
            if driver is not None:
                return driver
        return None

    async def _handle(self, req: Request) -> _Driver | None:
        if req.call == "sys.connect":
            return await self._connect(req)
        if self.who is None:
            await self.send(res_error(req.id, "not_connected", "the first request must be sys.connect"))
        else:
            await self._dispatch(req)
        return None

    # -- sys.connect -------------------------------------------------------------------------

    async def _connect(self, req: Request) -> _Driver | None:
        if self.who is not None:
            await self.send(res_error(req.id, "conflict", "already connected"))
            return None
        role = req.args.get("role", "user")
        if role not in ("user", "driver"):
            await self.send(res_error(req.id, "invalid_request", 'role must be "user" or "driver"'))
            return None
        token = req.args.get("token")
        if token is not None and not isinstance(token, str):
            await self.send(res_error(req.id, "invalid_request", "token must be a string"))
            return None
        token = token or bearer(self.ws.headers.get("authorization"))
        if role == "driver":
            return await self._connect_driver(req, token)
        who = await self.ctx.accounts.authenticate(token) if token else None  # (never a device token)
        if who is None:
            await self._unauthorized(req, "a valid token is required", "unauthorized")
            return None
        self.who = who
        await self.send(res_ok(req.id, {"account": who.account, "admin": who.admin, "role": "user"}))
        return None

    async def _unauthorized(self, req: Request, message: str, reason: str) -> None:
        await self.send(res_error(req.id, "unauthorized", message))
        await self._close(CLOSE_UNAUTHORIZED, reason)

    async def _connect_driver(self, req: Request, token: str) -> _Driver | None:
        """A driver's token: a device token bound to the name it claims, or (only on a hub made
        with ``account_tokens``, deprecated) an account token. Refusals are ``unauthorized`` and
        close the socket with ``CLOSE_UNAUTHORIZED`` and a reason saying what was wrong."""
        store, hub = self.ctx.accounts.store, self.ctx.devices
        bound = await authenticate_device(store, token) if token else None
        who = bound[0] if bound is not None else await self.ctx.accounts.authenticate(token) if token else None
        if who is None:
            await self._unauthorized(req, "a valid token is required", "unauthorized")
            return None
        if hub is None:
            await self.send(res_error(req.id, "unavailable", "devices are not enabled on this server"))
            return None
        if isinstance(hub, DeviceHub) and hub.store is None:
            hub.bind(store, self.ctx.kernel.engine.hub)
        if bound is None:
            if not getattr(hub, "account_tokens", True):
                await self._unauthorized(
                    req,
                    "a device connects with a device token, not an account token: issue one with "
                    "POST /v1/devices/{name}/token (or 'agentloop device token NAME')",
                    "device token required",
                )
                return None
            _log(logging.WARNING, "a driver connected with an account token (deprecated)", account=who.account)
            principal = who
            return who, req.args, req.id, lambda: self.ctx.accounts.still_valid(principal)
        device, claimed = bound[1], req.args.get("name")
        if claimed != device:
            shown = repr(claimed[:40]) if isinstance(claimed, str) else "none"
            await self._unauthorized(
                req, f"this device token is for device {device!r}, not {shown}", "token for another device"
            )
            return None
        return who, req.args, req.id, lambda: device_token_valid(store, who, device)

    # -- user calls --------------------------------------------------------------------------

    async def _dispatch(self, req: Request) -> None:
        inline = _INLINE.get(req.call)
        if inline is not None:
            await self.send((await self._settle(req, inline))[0])
            return
        call = CALLS.get(req.call)
        if call is None:
            await self.send(res_error(req.id, "unknown_call", f"no call named {req.call[:64]!r}"))
        elif req.id in self._requests:
            await self.send(res_error(req.id, "bad_frame", "a request with this id is still running"))
        elif self._unanswered >= MAX_IN_FLIGHT:
            await self.send(res_error(req.id, "too_many_requests", f"at most {MAX_IN_FLIGHT} requests may run at once"))
        else:
            # A call that changes state starts now, not when its task first runs: a client that
            # sends a message and closes the socket at once would otherwise see the close cancel
            # the task before it ran, and the message it sent was silently never delivered.
            op = self._detach(req, call) if call.mutates else None
            task = self._start(self._run(req, call, op))
            self._unanswered += 1
            task.add_done_callback(lambda _: self._done(req.id, task))
            self._requests[req.id] = (task, call)
            follows = _follows(req)
            if follows is not None:  # (an unsubscribe sent after it waits for it: see ``_subscribed``)
                self._subscribing.setdefault(follows, set()).add(task)
                task.add_done_callback(lambda _: self._subscribe_ended(follows, task))

    def _subscribe_ended(self, follows: str, task: asyncio.Task[None]) -> None:
        pending = self._subscribing.get(follows)
        if pending is not None:
            pending.discard(task)
            if not pending:
                del self._subscribing[follows]

    async def _subscribed(self, follows: str) -> None:
        """Wait for the subscribe requests to ``follows`` sent before the unsubscribe being run (they
        run as tasks of their own; an unsubscribe is run as it arrives), so that it undoes them
        too: otherwise one still being set up would start after the answer that said it was gone."""
        pending = self._subscribing.get(follows)
        if pending:
            await asyncio.wait(list(pending))

    def _done(self, rid: str, task: asyncio.Task[None]) -> None:
        """A request task ended: its answer has been sent (or dropped with the socket)."""
        self._unanswered -= 1
        self._answer_if_cancelled_early(rid, task)

    def _answer_if_cancelled_early(self, rid: str, task: asyncio.Task[None]) -> None:
        """A request cancelled before its task first ran never entered ``_run``, so nothing in it
        answered: answer ``cancelled`` here. (Once ``_run`` runs it answers and the task ends
        normally, so ``task.cancelled()`` is then false.)"""
        if not task.cancelled() or rid not in self._cancel_asked:
            return
        self._cancel_asked.discard(rid)
        if self._requests.get(rid, (None,))[0] is task:
            del self._requests[rid]
        if not self._ending:
            self._start(self._send_quietly(res_error(rid, "cancelled", "the request was cancelled")))

    async def _send_quietly(self, frame: dict[str, Any]) -> None:
        await self.send(frame)

    async def _run(self, req: Request, call: Call, op: asyncio.Future[Outcome] | None = None) -> None:
        """One request task: run the call (or, for one that changes state, wait for ``op``, already
        under way), then answer (``cancelled`` if ``request.cancel`` hit it)."""
        then: Callable[[], None] | None = None
        try:
            try:
                frame, then = await (self._settle(req, call) if op is None else asyncio.shield(op))
            except asyncio.CancelledError:
                if req.id not in self._cancel_asked:
                    raise  # the connection is ending: nobody to answer
                self._cancel_asked.discard(req.id)
                self._uncancel()
                frame = res_error(req.id, "cancelled", "the request was cancelled")
        finally:
            self._requests.pop(req.id, None)  # from here on it cannot be cancelled, only answered
        if await self.send(frame) and then is not None:
            then()

    def _detach(self, req: Request, call: Call) -> asyncio.Future[Outcome]:
        """Start a call that changes state in its own task, referenced until done, so that neither
        a cancel nor a closing socket stops it halfway, nor before it began (its answer is
        dropped if nobody is left to read it)."""
        op = asyncio.ensure_future(self._settle(req, call))
        _detached.add(op)
        op.add_done_callback(_detached.discard)
        return op

    async def _settle(self, req: Request, call: Call) -> Outcome:
        """The ``res`` frame for a call: its data, or the error it raised as a safe code and message
        (an unexpected exception is logged and answered ``internal``, with none of its text)."""
        try:
            _check_args(req.args, call.args)
            data = await call.handler(self, req.args)
        except ApiError as exc:
            return {"type": "res", "id": req.id, "ok": False, "error": exc.body()}, None
        except NoSuchProcess:
            return res_error(req.id, "not_found", "no such process"), None
        except Exception:
            account = self.who.account if self.who else None
            _log(logging.ERROR, "call failed", exc_info=True, call=req.call, account=account)
            return res_error(req.id, "internal", "internal error"), None
        if isinstance(data, Then):
            return res_ok(req.id, data.data), data.start
        return res_ok(req.id, data), None

    async def cancel(self, args: dict[str, Any]) -> Any:
        """``request.cancel {id}``: stop a running read, which then answers ``cancelled``. A call
        that changes state is not interrupted (it answers normally): this says ``cancelled: false``."""
        rid = _id(args, "id")
        running = self._requests.get(rid)
        if running is None or running[0].done() or running[1].mutates:
            return {"id": rid, "cancelled": False}
        self._cancel_asked.add(rid)
        running[0].cancel()
        return {"id": rid, "cancelled": True}

    # -- subscriptions -----------------------------------------------------------------------

    def follow(self, pid: str, stream: AsyncIterator[Signal]) -> None:
        """Start streaming ``stream`` as ``sig`` frames, replacing an earlier subscription to ``pid``."""
        old = self.subscriptions.pop(pid, None)
        if old is not None:
            old.cancel()
        if self._closed or self._ending:
            return
        self.subscriptions[pid] = self._start(self._pump(pid, stream))

    def _start(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A task that the connection's end cancels and awaits."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _pump(self, pid: str, stream: AsyncIterator[Signal]) -> None:
        try:
            await self._relay(stream, lambda signal: sig_frame(pid, signal), "signal stream failed", pid=pid)
        finally:
            if self.subscriptions.get(pid) is asyncio.current_task():
                del self.subscriptions[pid]

    async def _relay(
        self, stream: AsyncIterator[T], frame: Callable[[T], dict[str, Any]], failed: str, **fields: Any
    ) -> None:
        """Send each item of ``stream`` as ``frame`` makes it, until the client stops reading or
        the stream ends or fails (logged as ``failed``); then close the stream, so the watching
        stops now rather than when it is collected."""
        try:
            async for item in stream:
                if not await self.send(frame(item)):
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            _log(logging.ERROR, failed, exc_info=True, **fields)
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def unsubscribe(self, args: dict[str, Any]) -> Any:
        """``proc.unsubscribe {pid}``: answered after the stream has stopped, so no ``sig`` for the
        process follows the answer."""
        pid = _id(args, "pid")
        await self._subscribed(_PROCESS + pid)
        task = self.subscriptions.pop(pid, None)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        return {"pid": pid, "unsubscribed": task is not None}

    def follow_account(self, stream: AsyncIterator[AccountSignal]) -> None:
        """Stream the account's signals as ``sig`` frames (a process subscription's, with the
        account seq as ``id``: a client following both tells them apart by it), replacing an
        earlier one."""
        if self.account_stream is not None:
            self.account_stream.cancel()
        self.account_stream = None
        if not (self._closed or self._ending):
            self.account_stream = self._start(self._pump_account(stream))

    async def resuming_account(self, stream: AsyncIterator[AccountSignal], start: int) -> AsyncIterator[AccountSignal]:
        """``stream``, opened again after the last account seq it gave (``start`` before any)
        whenever the kernel ends it while this connection and the server go on: a subscriber
        whose queue overflowed (it read too slowly) is ended there, and an SSE client reconnects
        with ``Last-Event-ID``, but a subscription has no end a client is told of: it would hear
        of nothing again, unaware. The account log has what it missed."""
        last = start
        while True:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]  # an async generator at runtime
                async for item in stream:
                    if item.seq is not None:
                        last = item.seq
                    yield item
            if self._closed or self._ending or self.ctx.stopping.is_set() or self.service.kernel.engine.closing:
                return
            _, stream = await self.service.account_signals(self.user, after_seq=last)

    async def _pump_account(self, stream: AsyncIterator[AccountSignal]) -> None:
        try:
            await self._relay(stream, account_sig_frame, "account stream failed", account=self.user.account)
        finally:
            if self.account_stream is asyncio.current_task():
                self.account_stream = None

    async def unsubscribe_account(self) -> Any:
        """``account.unsubscribe``: answered once the stream has stopped, so no ``sig`` of it follows."""
        await self._subscribed(_ACCOUNT)
        task, self.account_stream = self.account_stream, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        return {"account": self.user.account, "unsubscribed": task is not None}

    # -- writing -----------------------------------------------------------------------------

    async def send(self, frame: dict[str, Any]) -> bool:
        """Send one frame (one writer at a time); False if the socket is gone. A frame that cannot
        be serialised becomes an ``internal`` error for its request instead."""
        try:
            text = json_text(frame)  # (strict JSON: a model's 1e999 in a call's arguments is null)
        except (TypeError, ValueError):
            _log(logging.ERROR, "frame not serialisable", exc_info=True, type=frame.get("type"))
            if frame.get("type") != "res":
                return True
            text = json.dumps(res_error(frame.get("id"), "internal", "internal error"))
        async with self._send_lock:
            if self._closed:
                return False
            try:
                async with asyncio.timeout(SEND_TIMEOUT):
                    await self.ws.send_text(text)
            except TimeoutError:
                self._drop()
                return False
            except (WebSocketDisconnect, RuntimeError, OSError):
                self._closed = True
                return False
        return True

    def _drop(self) -> None:
        """A client that stops reading would make every writer wait forever: end its connection."""
        _log(logging.WARNING, "dropping a client that does not read", account=self.who and self.who.account)
        if self._reader is not None and not self._reader.done():
            self._dropped = True
            self._reader.cancel()

    async def _close(self, code: int, reason: str) -> None:
        async with self._send_lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(Exception):
                async with asyncio.timeout(SEND_TIMEOUT):
                    await self.ws.close(code, reason)


async def _cancel(conn: Connection, args: dict[str, Any]) -> Any:
    return await conn.cancel(args)


async def _unsubscribe(conn: Connection, args: dict[str, Any]) -> Any:
    return await conn.unsubscribe(args)


async def _account_unsubscribe(conn: Connection, args: dict[str, Any]) -> Any:
    return await conn.unsubscribe_account()


# Instant calls, answered in the order they arrive and never counted against the request limit.
_INLINE: dict[str, Call] = {
    "request.cancel": Call(_cancel, _takes("id")),
    "proc.unsubscribe": Call(_unsubscribe, _takes("pid")),
    "account.unsubscribe": Call(_account_unsubscribe, _takes()),
}


def routes(ctx: ServerContext) -> list[BaseRoute]:
    async def endpoint(websocket: WebSocket) -> None:
        await Connection(ctx, websocket).serve()

    return [WebSocketRoute("/v1/ws", endpoint)]
