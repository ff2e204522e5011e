"""A monthly spending cap per account: what a server's ``--account-budget`` enforces.

An account (not an admin) that has spent its budget this calendar month (UTC, at catalog prices,
over its runs that ended) starts nothing new: the server refuses its input (402), and the
kernel's timers (``gate_timers``) hold what they would start for it. A schedule due
meanwhile waits and fires once the account may spend again (a new month, a larger budget), as
one that fell due while the runtime was down; a heartbeat of that period is skipped (a check-in,
not something anyone asked for).

The month's spending is the account's total less its total at the first check in the month
(``Store.spent_before``, written once per account and month, so every worker reads the same),
so a run under way at the turn of the month counts where it ends.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentloop.kernel.kernel import Kernel


class MonthlyBudget:
    """``dollars`` per account and calendar month (UTC) on ``kernel``; admins are not limited."""

    def __init__(self, kernel: Kernel, dollars: float) -> None:
        if isinstance(dollars, bool) or not isinstance(dollars, int | float) or not 0 < dollars < math.inf:
            raise ValueError(f"a budget must be a positive number of dollars, got {dollars!r}")
        self.kernel = kernel
        self.dollars = dollars
        self._before: dict[tuple[str, str], float] = {}  # (account, month): its total at the month's start

    async def refusal(self, account: str, *, admin: bool | None = None) -> str | None:
        """Why ``account`` may start nothing new now (None: it may). ``admin`` when the caller
        knows it; otherwise the account's record says."""
        if admin is None:
            record = await self.kernel.store.get_account(account)
            admin = record is not None and record.admin
        if admin:
            return None
        total = (await self.kernel.usage(account)).cost
        period = time.strftime("%Y-%m", time.gmtime())
        before = self._before.get((account, period))
        if before is None:  # (once written, a month's row never changes: read once, kept)
            async with self.kernel.store.transaction():
                before = await self.kernel.store.spent_before(account, period, total)
            self._before[(account, period)] = before
        spent = total - before
        if spent < self.dollars:
            return None
        return (
            f"account {account!r} has spent ${spent:.2f} of its ${self.dollars:.2f} budget for {period} (UTC);"
            " new input is refused until the month ends"
        )


def gate_timers(kernel: Kernel, spending: Callable[[str], Awaitable[str | None]] | None) -> None:
    """What the kernel's schedules and heartbeats ask before they start a run for an account
    (None: nothing)."""
    kernel.scheduler.spending = spending
    if kernel.heartbeat is not None:
        kernel.heartbeat.spending = spending
