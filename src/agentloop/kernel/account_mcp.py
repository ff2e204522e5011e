"""MCP servers per account (DESIGN §4): ``<data>/home/<account>/mcp.json`` lists the servers whose
tools that account's processes get, next to the account's ``approval.json``.

The file is a JSON list of server objects, or ``{"mcp_servers": [...]}``, each as
``MCPServerConfig`` takes it. The servers of an account start when its first run needs them and
stay up for the kernel's life; a change to the file restarts them with the new list at the next
run. A file that does not validate (or is over ``MAX_FILE_BYTES``), or a server that does not
start, is logged and that account's runs go on with the other tools; a failed start is tried again
a minute later, not at every run.

The servers run as the kernel's own user, so the file is as powerful as the kernel's config:
only someone who can write the data directory can write it (the API has no way to).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agentloop.process.store import ProcessRecord
from agentloop.stamps import Stamp, file_stamp, read_regular
from agentloop.tools.base import Tool
from agentloop.tools.mcp import MCPError, MCPServerConfig, mcp_tools, parse_servers

log = logging.getLogger("agentloop.kernel.mcp")

RETRY_AFTER = 60.0  # seconds before a server that failed to start is tried again
MAX_FILE_BYTES = 1 << 20  # a server list is a few lines: a larger file is refused, not read into memory


@dataclass
class _Account:
    stamp: Stamp
    tools: list[Tool] = field(default_factory=list)
    stack: contextlib.AsyncExitStack | None = None
    failed_at: float | None = None


class AccountMCP:
    """The per-account MCP servers of one kernel; ``toolset`` adds an owner's tools to a run."""

    def __init__(self, file_of: Callable[[str], Path], clock: Callable[[], float] = time.monotonic) -> None:
        self.file_of = file_of
        self.clock = clock
        self._accounts: dict[str, _Account] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._warned: set[tuple[str, tuple[str, ...]]] = set()  # (owner, tools left out) already logged

    async def toolset(self, record: ProcessRecord, shared: Mapping[str, Tool]) -> Mapping[str, Tool]:
        tools = await self.tools_of(record.owner)
        if not tools:
            return shared
        # the shared tools first (a stable prefix for prompt caches), and a built-in keeps its name
        hidden = tuple(t.name for t in tools if t.name in shared)
        if hidden and (record.owner, hidden) not in self._warned:  # once, not at every run
            self._warned.add((record.owner, hidden))
            log.warning("account %r: MCP tools named like the server's own are left out: %s", record.owner, hidden)
        return {**shared, **{t.name: t for t in tools if t.name not in shared}}

    async def tools_of(self, owner: str) -> list[Tool]:
        """The owner's MCP tools, starting (or restarting) its servers if the file changed."""
        stamp = file_stamp(self.file_of(owner))
        current = self._accounts.get(owner)
        if stamp is None and current is None:
            return []
        if current is not None and current.stamp == stamp and not self._retry_due(current):
            return current.tools
        async with self._locks.setdefault(owner, asyncio.Lock()):
            current = self._accounts.get(owner)
            if current is not None and current.stamp == stamp and not self._retry_due(current):
                return current.tools  # another run of the same owner did it meanwhile
            if current is not None:
                await self._stop(owner)
            if stamp is None:
                return []
            account = self._accounts[owner] = await self._start(owner, stamp)
            return account.tools

    def _retry_due(self, account: _Account) -> bool:
        return account.failed_at is not None and self.clock() - account.failed_at >= RETRY_AFTER

    async def _start(self, owner: str, stamp: Stamp) -> _Account:
        path = self.file_of(owner)
        try:
            servers = _read(path)
        except ValueError as exc:
            log.warning("MCP servers of account %r (%s): %s; none started", owner, path, exc)
            return _Account(stamp)  # not retried until the file changes
        stack = contextlib.AsyncExitStack()
        try:
            tools = await stack.enter_async_context(mcp_tools(servers))
        except (MCPError, ValueError) as exc:
            await stack.aclose()
            log.warning("MCP servers of account %r: %s; retrying in %g s", owner, exc, RETRY_AFTER)
            return _Account(stamp, failed_at=self.clock())
        for tool in tools:  # what an account's own servers answer is that account's: a cut result is
            tool.keeps_cut_results = False  # not copied into the workspace every account shares
        return _Account(stamp, tools, stack)

    async def _stop(self, owner: str) -> None:
        account = self._accounts.pop(owner, None)
        if account is not None and account.stack is not None:
            await account.stack.aclose()

    async def close(self) -> None:
        """Stop every account's servers at once (one by one, servers slow to stop would add up
        past what a service manager waits for)."""

        async def stop(owner: str) -> None:
            try:
                await self._stop(owner)
            except Exception:  # one account's servers must not keep the others running
                log.exception("stopping the MCP servers of account %r", owner)

        await asyncio.gather(*(stop(owner) for owner in list(self._accounts)))


def _read(path: Path) -> list[MCPServerConfig]:
    try:
        data = json.loads(read_regular(path, MAX_FILE_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # unreadable, not UTF-8, not JSON, nested too deep
        raise ValueError(f"cannot read it: {exc}") from None
    if isinstance(data, dict) and set(data) == {"mcp_servers"}:
        data = data["mcp_servers"]
    if not isinstance(data, list):
        raise ValueError('expected a list of servers, or {"mcp_servers": [...]}')
    return parse_servers(data)
