"""How much input an account may give the server per minute.

Every message or event a client sends can start a run on the server's model keys, so a script
gone wrong (a retry loop, a client that resends on every reconnect) spends the server's money as
fast as it can talk. The process quota bounds how many conversations an account has; this
bounds how often it may feed them. The window slides: the limit holds over any 60 seconds, not
per calendar minute, and a refusal says how long until the oldest input leaves the window.

Counted per worker, in memory: several workers behind one balancer each allow the limit. That
keeps the check off the store (it runs on every send) and is what such a limit is for, a brake on
runaway clients, not billing.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from agentloop.server.errors import ApiError

WINDOW = 60.0  # seconds
# generous for people (a message every second, all minute long), a brake on scripts
DEFAULT_MAX_INPUTS_PER_MINUTE = 60


class InputRate:
    """Accepted inputs per account over the last minute (admins are not counted)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._accepted: dict[str, deque[float]] = {}
        self._swept = clock()  # when accounts gone quiet were last dropped

    def take(self, account: str, limit: int | None) -> None:
        """Count one input of ``account``, or refuse it with 429 when the account gave ``limit``
        in the last minute (None: no limit). A refused input is not counted."""
        if limit is None:
            return
        now = self._clock()
        accepted = self._accepted.get(account)
        if accepted is None:
            accepted = self._accepted[account] = deque()
        while accepted and accepted[0] <= now - WINDOW:
            accepted.popleft()
        if len(accepted) >= limit:
            # (a limit of 0 has nothing in the window to wait for: a whole window, then ask again)
            wait = max(1, math.ceil(accepted[0] + WINDOW - now)) if accepted else math.ceil(WINDOW)
            raise ApiError(
                429,
                "rate_limited",
                f"account {account} sent {limit} messages in the last minute, as many as this server allows;"
                f" retry in {wait} s",
                retry_after=wait,
            )
        accepted.append(now)
        self._forget_idle(now)

    def give_back(self, account: str) -> None:
        """Uncount ``account``'s latest input: the request it was taken for was refused after all
        (its media turned out damaged, the process quota was full), and a refused input must not
        leave the account fewer to send (``take``: a refused input is not counted)."""
        accepted = self._accepted.get(account)
        if accepted:
            accepted.pop()

    def _forget_idle(self, now: float) -> None:
        """Once a minute, drop the accounts with nothing left in the window: the table holds the
        accounts active lately, not every account ever seen."""
        if now - self._swept < WINDOW:
            return
        self._swept = now
        for account in [a for a, times in self._accepted.items() if not times or times[-1] <= now - WINDOW]:
            del self._accepted[account]
