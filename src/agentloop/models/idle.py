"""A limit on how long a provider stream may go without progress.

A transport's read timeout counts bytes, and a server that has stalled can keep sending bytes:
SSE comments (``: ping``), Anthropic's ``event: ping``, blank lines. Such a stream never timed
out, and the run waited on it for ever. ``IdleLimit`` counts only the events that carry content
or progress, and fails the stream with ``StreamIdle`` when none has come for as long as the
client's read timeout; each adapter treats that as it treats a read timeout (a retryable
``timeout``, or the answer kept when it had already finished).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Generic, TypeVar

T = TypeVar("T")

#: how long a stream may go without progress when the client's settings name no read timeout
#: (what the SDKs and the Gemini adapter use by default)
DEFAULT_IDLE_SECONDS = 600.0


class StreamIdle(TimeoutError):
    """A stream sent nothing but keep-alives for longer than its read timeout."""


def idle_seconds(timeout: object) -> float:
    """The read timeout of a client's ``timeout`` setting (a number of seconds, or an httpx
    ``Timeout`` with its ``read``), as the longest a stream may go without progress; the
    default when it names none (a stalled stream must still end some day)."""
    read = getattr(timeout, "read", timeout)
    if isinstance(read, int | float) and not isinstance(read, bool) and read > 0:
        return float(read)
    return DEFAULT_IDLE_SECONDS


def _always(item: object) -> bool:
    """Every item is progress (the parser under it already dropped the keep-alives)."""
    return True


class IdleLimit(Generic[T]):
    """``source``'s items, failing with ``StreamIdle`` once ``seconds`` pass without an item for
    which ``progress`` is true (the time before the first item counts too).

    An iterator object rather than an async generator: one left unfinished (the adapter stops
    reading after the answer's end) holds no frame for the garbage collector to close later."""

    def __init__(self, source: AsyncIterable[T], seconds: float, progress: Callable[[T], bool] = _always) -> None:
        self._source: AsyncIterator[T] = aiter(source)
        self._seconds = seconds
        self._progress = progress
        self._deadline: float | None = None

    def __aiter__(self) -> IdleLimit[T]:
        return self

    async def __anext__(self) -> T:
        loop = asyncio.get_running_loop()
        if self._deadline is None:
            self._deadline = loop.time() + self._seconds
        while True:
            item = await self._next_before(self._deadline)
            if self._progress(item):
                self._deadline = loop.time() + self._seconds
                return item

    async def _next_before(self, deadline: float) -> T:
        """The source's next item, or ``StreamIdle`` at ``deadline`` (a keep-alive the source
        yields is consumed here and does not move the deadline)."""
        limit = asyncio.timeout_at(deadline)
        try:
            async with limit:
                return await anext(self._source)
        except TimeoutError:
            if not limit.expired():  # the source's own timeout, not ours
                raise
        raise StreamIdle(f"nothing but keep-alives for {self._seconds:g} s")
