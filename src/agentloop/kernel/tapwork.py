"""Work a hub tap starts in the background.

A tap runs inside ``SignalHub.publish``, synchronously, for every signal: what it has to do with
the store (deliver a reply, copy a request) goes into a task of its own. ``TapWork`` keeps those
tasks (a task nobody references may be collected before it ends), lets tests wait for them, and
lets a closing kernel give them a grace period before it cancels the rest."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class TapWork:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self) -> None:
        """Until none is under way (work may start more work)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self, grace: float) -> None:
        """Let what is under way finish for ``grace`` seconds, then cancel the rest."""
        if not self._tasks:
            return
        _, late = await asyncio.wait(set(self._tasks), timeout=grace)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
