"""The moving parts of a PostgreSQL store transaction: its handle, its open body, its settling.

Kept apart from the store's statements so the protocol (who may read when, when the next
transaction may begin) can be read on its own; ``postgres.py`` explains why it is shaped so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

from agentloop.process.store.base import Settled, Transaction

Connection: TypeAlias = Any  # an asyncpg.Connection (asyncpg ships no type information)


class PgTransaction(Transaction):
    """``store.transaction()``: forwards to the store, which owns the state."""

    __slots__ = ("_begin", "_end")

    def __init__(
        self,
        begin: Callable[[], Awaitable[None]],
        end: Callable[[bool, Settled | None], Awaitable[None] | None],
    ) -> None:
        self._begin = begin
        self._end = end

    async def begin(self) -> None:
        await self._begin()

    def end(self, commit: bool, settled: Settled | None = None) -> Awaitable[None] | None:
        return self._end(commit, settled)


class TxState:
    """An open transaction body: its connection (taken from the pool for it alone), asyncpg's
    transaction object on it, and the task that may write through it."""

    __slots__ = ("conn", "task", "tr")

    def __init__(self, conn: Connection, tr: Any, task: asyncio.Task[Any] | None) -> None:
        self.conn = conn
        self.tr = tr
        self.task = task


class Settling:
    """A commit or rollback in flight. Reads that arrive before it is over wait for ``durable``
    and count themselves in ``readers``; the store's lock (and so the next transaction) waits
    until they are done, so they see exactly this commit's state. Reads that arrive after
    ``durable`` do not count: a steady stream of reads cannot hold the next writer back."""

    __slots__ = ("_gone", "done", "durable", "readers", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.durable = asyncio.Event()
        self.readers = 0
        self._gone = asyncio.Event()
        self.done: asyncio.Future[None] = loop.create_future()  # the whole settling is over
        self.task: asyncio.Task[None] | None = None

    def reader_done(self) -> None:
        self.readers -= 1
        if self.readers == 0:
            self._gone.set()

    async def readers_gone(self) -> None:
        while self.readers:
            self._gone.clear()
            await self._gone.wait()
