"""``GET /v1/processes/{pid}/events``: a process's signals as Server-Sent Events; and
``GET /v1/events``, the account stream (the approvals and run ends of all the caller's processes).

The stream is a view on ``Process.signals``: logged signals carry ``id: <seq>`` so a client that
reconnects with ``Last-Event-ID`` continues exactly where it stopped; live-only progress has no
id. Three things end it besides the process itself: the client hanging up, ``follow=false`` after
the backlog, and ``ctx.stopping`` (server shutdown) — each without leaving a watcher behind.

The signals are read by a small pump task rather than by the response generator itself: the
generator has to wait "for the next signal, or a heartbeat's worth of silence, or shutdown", and
cancelling a wait on a generator's ``__anext__`` would end that generator. Cancelling a
``Queue.get`` loses nothing, and cancelling the pump closes ``Process.signals`` (whose
``finally`` unwatches) in the pump's own task.

The account stream is resumable the same way, by account seq (per owner: the account log's, see
``Kernel.account_signals``): its frames carry ``id: <account seq>`` (a new title, live only, has
none), and ``Last-Event-ID`` (or ``after_seq``) resumes after one. A stream opened without either
starts with a frame that is only ``id: <the newest account seq>``: it dispatches no event, but a
client cut off before the first signal resumes from it. A resume point older than the kept log is
told with an ``account.log.pruned`` event (no id) first, as ``proc.log.pruned`` on a process stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, suppress
from typing import Any, TypeVar

from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import AppStatus, SendTimeoutError
from starlette.types import Receive, Scope, Send

from agentloop.kernel import NoSuchProcess
from agentloop.process.signals import AccountSignal, Signal
from agentloop.server.auth import Principal
from agentloop.server.context import ServerContext
from agentloop.server.errors import ApiError
from agentloop.server.http_errors import log_json
from agentloop.server.service import signal_json
from agentloop.server.strict_json import json_text

_END = object()  # the pump's last item: the backlog ran out (follow=false), the process is gone, or shutdown
T = TypeVar("T")


def event_data(pid: str | None, signal: Signal) -> dict[str, Any]:
    return {**signal_json(signal), "pid": pid}


def _frame(pid: str | None, signal: Signal, seq: int | None) -> ServerSentEvent:
    return ServerSentEvent(
        data=json_text(event_data(pid, signal)), event=signal.signal, id=str(seq) if seq is not None else None
    )


def frame(pid: str, signal: Signal) -> ServerSentEvent:
    return _frame(pid, signal, signal.seq)


def account_frame(item: AccountSignal) -> ServerSentEvent:
    """A frame of the account stream: the process stream's, with the account seq as its id (the
    ``seq`` in its data stays the signal's seq in its process's log)."""
    return _frame(item.pid, item.signal, item.seq)


BUFFER = 256  # signals read ahead of a slow client; beyond it, reading the backlog waits for the client
SEND_TIMEOUT = 30.0  # seconds one event (or ping) may take to leave; a client that stops reading is dropped


async def _pump(pid: str, signals: AsyncIterator[T], out: asyncio.Queue[Any]) -> None:
    try:
        async with aclosing(signals):  # type: ignore[type-var]  # an async generator at runtime
            async for signal in signals:
                await out.put(signal)
    except NoSuchProcess:
        pass  # killed meanwhile: the stream just ends
    except Exception as exc:
        log_json(logging.ERROR, "event stream failed", exc=exc, pid=pid, error_type=type(exc).__name__)
    await out.put(_END)


async def _on_stop(stopping: asyncio.Event, out: asyncio.Queue[Any]) -> None:
    await stopping.wait()
    # Wakes a reader waiting on an empty queue; a full queue means the reader is busy and sees
    # ``stopping`` before its next item.
    with suppress(asyncio.QueueFull):
        out.put_nowait(_END)


async def _revoked(ctx: ServerContext, who: Principal, name: str) -> bool | None:
    """Whether ``who``'s token is revoked (or its account gone): True ends the stream. None when
    the check itself failed (the store unreachable for a moment): logged, without the token, and
    the stream goes on to the next check, as a WebSocket's does. Ending the stream on it would cut
    every client off at each database blip, and all of them would reconnect at once."""
    try:
        return not await ctx.accounts.still_valid(who)
    except Exception as exc:
        log_json(
            logging.WARNING,
            "token check failed",
            exc=exc,
            stream=name,
            account=who.account,
            error_type=type(exc).__name__,
        )
        return None


def frames(
    ctx: ServerContext, pid: str, signals: AsyncIterator[Signal], who: Principal | None = None
) -> AsyncIterator[ServerSentEvent]:
    """SSE frames for a process's ``signals`` (see ``_frames``)."""
    return _frames(ctx, pid, signals, who, lambda signal: frame(pid, signal))


async def _frames(
    ctx: ServerContext,
    name: str,
    signals: AsyncIterator[T],
    who: Principal | None,
    render: Callable[[T], ServerSentEvent],
) -> AsyncIterator[ServerSentEvent]:
    """SSE frames for ``signals``, with a ``: ping`` comment after every ``ctx.heartbeat`` seconds of
    silence, until the signals end or ``ctx.stopping`` is set; and, every heartbeat, a check that
    ``who``'s token is still valid (a revoked token ends the stream; a check that fails is tried
    again at the next one: ``_revoked``). ``name`` is the stream's in logs: its pid, or ``account
    <account>``."""
    items: asyncio.Queue[Any] = asyncio.Queue(BUFFER)
    pump = asyncio.create_task(_pump(name, signals, items))
    stop = asyncio.create_task(_on_stop(ctx.stopping, items))
    loop = asyncio.get_running_loop()
    check_at = loop.time() + ctx.heartbeat
    try:
        while not ctx.stopping.is_set():
            if who is not None and loop.time() >= check_at:
                if await _revoked(ctx, who, name) is True:
                    return
                check_at = loop.time() + ctx.heartbeat
            if items.empty():
                try:  # (not ``wait_for``: on 3.11 a cancel that meets an item can be swallowed)
                    async with asyncio.timeout(ctx.heartbeat):
                        item = await items.get()
                except TimeoutError:
                    yield ServerSentEvent(comment="ping")
                    continue
            else:  # no waiting, no timer: the common case while a run streams
                item = items.get_nowait()
            if item is _END:
                return
            yield render(item)
    finally:  # also on a client disconnect (CancelledError) or the response closing us
        pump.cancel()
        stop.cancel()


class _EventStream(EventSourceResponse):
    """An event stream that ends when a frame cannot leave within ``SEND_TIMEOUT``.

    A client that stops reading (or whose network went quiet) would otherwise hold its stream, its
    tasks and its watcher on the process for ever: the server's send waits on the full socket, so
    neither the heartbeat's revocation check nor anything else runs again. Ending it is routine,
    not a failed request: a warning here, and the server closes the connection.
    """

    def __init__(self, content: AsyncIterator[ServerSentEvent], pid: str) -> None:
        # ping=0: heartbeats come from ``frames``, and only after silence, not on a fixed clock.
        super().__init__(content, ping=0, headers={"Cache-Control": "no-store"}, send_timeout=SEND_TIMEOUT)
        self.pid = pid

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            log_json(logging.WARNING, "dropping an event stream whose client does not read", pid=self.pid)


async def open_stream(
    ctx: ServerContext, who: Principal, pid: str, *, after_seq: int, follow: bool
) -> EventSourceResponse:
    """Check the caller and the process now, so a refusal is a JSON error and not an SSE one."""
    if ctx.stopping.is_set():
        raise ApiError(503, "unavailable", "the server is shutting down")
    signals = await ctx.processes.signals(who, pid, after_seq=after_seq, follow=follow)
    return _EventStream(frames(ctx, pid, signals, who), pid)


async def _opening(start: int, signals: AsyncIterator[ServerSentEvent]) -> AsyncIterator[ServerSentEvent]:
    """``signals``, led by a frame that only sets the client's last event id to ``start``."""
    yield ServerSentEvent(id=str(start))
    async with aclosing(signals):  # type: ignore[type-var]  # an async generator at runtime
        async for item in signals:
            yield item


async def open_account_stream(
    ctx: ServerContext, who: Principal, *, after_seq: int | None, follow: bool
) -> EventSourceResponse:
    """The caller's account stream after account seq ``after_seq`` (None: from now on, opened by
    an id-only frame saying where that is); ``follow=false`` ends it after the logged backlog,
    at once without ``after_seq`` (which tells a client the stream may be opened without holding
    it, and where it stands)."""
    if ctx.stopping.is_set():
        raise ApiError(503, "unavailable", "the server is shutting down")
    start, signals = await ctx.processes.account_signals(who, after_seq=after_seq, follow=follow)
    name = f"account {who.account}"
    frames = _frames(ctx, name, signals, who, account_frame)
    return _EventStream(frames if after_seq is not None else _opening(start, frames), name)


def streams_may_run_again() -> None:
    """Let event streams run again in this process after a signal stopped a server. sse-starlette
    ends every stream of the process once uvicorn's ``handle_exit`` has run (a flag it keeps for
    the whole process, never cleared): a program, or a test, that serves again after a signal
    would see each new stream closed at once, half-sent."""
    AppStatus.should_exit = False
