"""Run an ASGI app under uvicorn on 127.0.0.1 in a background thread, and script its replies.

The provider fakes are real HTTP servers so that the official SDKs are exercised end to end:
connection handling, SSE decoding, status errors and headers all go through the same code a
production call does. The server has its own thread and event loop, so an async test can call it
without sharing (or blocking) the test's loop.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp


class ServerThread:
    """uvicorn serving ``app`` on a free port; ``url`` is its base address. A context manager."""

    def __init__(self, app: ASGIApp) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, log_level="critical", lifespan="off", access_log=False, timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        for _ in range(500):
            if self._server.started:
                return self
            if not self._thread.is_alive():
                break
            threading.Event().wait(0.01)
        raise RuntimeError("the test HTTP server did not start")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def serve(app: ASGIApp) -> Iterator[ServerThread]:
    """``with serve(app) as server: ... server.url ...``"""
    with ServerThread(app) as server:
        yield server


# ------------------------------------------------------------------ scripted replies


class CutConnection(Exception):
    """Raised inside a streaming body: uvicorn drops the connection mid-response."""


@dataclass
class SSEReply:
    """A streaming 200 answer. ``frames`` are raw SSE frames (already formatted).

    ``cut_after`` drops the connection after that many frames (no clean end of the body);
    ``delay`` seconds pass between frames so the client really reads them one by one.
    """

    frames: list[str]
    cut_after: int | None = None
    delay: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class JSONReply:
    """A plain JSON answer, typically an error with the provider's body shape and headers."""

    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)


Reply = SSEReply | JSONReply


def sse_frame(data: Any, event: str | None = None) -> str:
    """One SSE frame; ``data`` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


class ScriptedEndpoint:
    """A queue of replies consumed one per request, with every request body recorded.

    ``forever`` answers every request once the queue is empty (e.g. a server that keeps
    failing); with neither, the fake answers 500 so that a test never hangs on a missing reply.
    """

    def __init__(self) -> None:
        self.queue: list[Reply] = []
        self.forever: Reply | None = None
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self.queue.clear()
            self.forever = None
            self.requests.clear()
            self.headers.clear()

    def push(self, *replies: Reply) -> None:
        with self._lock:
            self.queue.extend(replies)

    @property
    def last(self) -> dict[str, Any]:
        return self.requests[-1]

    def _next(self) -> Reply | None:
        with self._lock:
            if self.queue:
                return self.queue.pop(0)
            return self.forever

    async def handle(self, request: Request) -> Response:
        body = await request.json()
        with self._lock:
            self.requests.append(body)
            self.headers.append(dict(request.headers))
        reply = self._next()
        if reply is None:
            return JSONResponse({"error": {"message": "the fake has no reply left"}}, status_code=500)
        if isinstance(reply, JSONReply):
            return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)
        return StreamingResponse(_frames(reply), media_type="text/event-stream", headers=reply.headers)


async def _frames(reply: SSEReply) -> AsyncIterator[str]:
    for i, frame in enumerate(reply.frames):
        if reply.cut_after is not None and i >= reply.cut_after:
            raise CutConnection("the fake drops the connection here")
        yield frame
        await asyncio.sleep(reply.delay)
    if reply.cut_after is not None:
        raise CutConnection("the fake drops the connection here")
