"""What every route of the server shares: the kernel, the accounts, the devices, the settings.

One object instead of module globals, so tests can run several servers in one process and the
routes stay plain functions of (context, request).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import HTTPConnection

from agentloop.kernel import Kernel
from agentloop.kernel.budget import MonthlyBudget, gate_timers
from agentloop.server.auth import Accounts, Principal, bearer
from agentloop.server.errors import ApiError
from agentloop.server.ratelimit import DEFAULT_MAX_INPUTS_PER_MINUTE, InputRate
from agentloop.server.service import ProcessService

DEFAULT_MAX_BODY = 1024 * 1024
# a body that may carry media (base64: 4 characters per 3 bytes of a file up to the media store's
# 10 MiB) gets room for one such file
DEFAULT_MAX_MEDIA_BODY = 16 * 1024 * 1024
DEFAULT_HEARTBEAT = 15.0
# live processes an account (not an admin) may have: each can hold schedules and watches that
# start runs on the server's model keys, so an unbounded number is the server's to pay for
DEFAULT_MAX_PROCESSES = 1000


@dataclass
class ServerContext:
    kernel: Kernel
    accounts: Accounts
    devices: Any = None  # the device hub (``agentloop.server.devices``), when devices are enabled
    max_body: int = DEFAULT_MAX_BODY
    max_media_body: int = DEFAULT_MAX_MEDIA_BODY  # for the requests that may carry images and documents
    heartbeat: float = DEFAULT_HEARTBEAT  # seconds between SSE heartbeat comments
    max_processes: int = DEFAULT_MAX_PROCESSES  # per account (admins are not limited)
    # messages and events an account (not an admin) may send per minute; None: no limit
    max_inputs_per_minute: int | None = DEFAULT_MAX_INPUTS_PER_MINUTE
    inputs: InputRate = field(default_factory=InputRate)
    # what an account (not an admin) may spend per calendar month (UTC): ``limit_spending``
    budget: MonthlyBudget | None = None
    # Set when the server begins shutting down: streams end cleanly instead of being cut.
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def processes(self) -> ProcessService:
        return ProcessService(
            self.kernel,
            max_processes=self.max_processes,
            inputs=self.inputs,
            max_inputs_per_minute=self.max_inputs_per_minute,
            budget=self.budget,
        )

    def limit_spending(self, dollars: float | None) -> None:
        """A budget of ``dollars`` per account and calendar month (UTC), admins aside (None: no
        budget): past it, the account's input is refused and its schedules and heartbeats wait."""
        self.budget = None if dollars is None else MonthlyBudget(self.kernel, dollars)
        gate_timers(self.kernel, None if self.budget is None else self.budget.refusal)

    async def principal(self, conn: HTTPConnection) -> Principal:
        """The caller of an HTTP request or WebSocket handshake, from its bearer token; 401 if none."""
        token = bearer(conn.headers.get("authorization"))
        who = await self.accounts.authenticate(token) if token else None
        if who is None:
            raise ApiError(401, "unauthorized", "a valid bearer token is required")
        return who
