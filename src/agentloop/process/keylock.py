"""One ``asyncio.Lock`` per key, kept only while someone holds or waits for it.

The leases serialize the claims of one process (a send's and the sweep's) with a lock per pid.
A dict of locks that are never dropped grows with every process a long-lived worker ever claims;
dropping a lock the moment it is released is wrong too, since a waiter may still be queued on it
while a newcomer makes a second lock for the same key. So each key counts its users, and the last
one out removes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class KeyedLocks:
    """``async with locks.hold(key):`` excludes the other holders of ``key`` (and only them)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # key -> (lock, holders + waiters)

    def __len__(self) -> int:
        return len(self._locks)

    def __contains__(self, key: object) -> bool:
        return key in self._locks

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)
