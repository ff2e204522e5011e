"""Per-account MCP servers (kernel/account_mcp.py), with the servers stood in for: started at an
account's first run, restarted when its file changes, a failed start retried a minute later (not at
every run), a file that does not validate logged and not retried until it changes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentloop import tool
from agentloop.kernel import account_mcp
from agentloop.kernel.account_mcp import RETRY_AFTER, AccountMCP
from agentloop.process.store import ProcessRecord
from agentloop.tools.mcp import MCPError, MCPServerConfig


class FakeServers:
    """Stands in for ``mcp_tools``: records each start and stop; fails while ``failing``."""

    def __init__(self) -> None:
        self.starts: list[list[str]] = []
        self.stops = 0
        self.failing = False

    @contextlib.asynccontextmanager
    async def __call__(self, servers: list[MCPServerConfig]) -> AsyncIterator[list[Any]]:
        self.starts.append([s.name for s in servers])
        if self.failing:
            raise MCPError("server 'x' did not start")

        @tool(name=f"{servers[0].name}__ping")
        def ping() -> str:
            """Ping."""
            return "pong"

        try:
            yield [ping]
        finally:
            self.stops += 1


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeServers:
    servers = FakeServers()
    monkeypatch.setattr(account_mcp, "mcp_tools", servers)
    return servers


def _write(path: Path, names: list[str], stamp: int) -> None:
    path.write_text(json.dumps([{"name": n, "command": "srv"} for n in names]))
    os.utime(path, ns=(stamp, stamp))  # a change the stamp sees, however fast the test runs


def _record(owner: str) -> ProcessRecord:
    return ProcessRecord(pid="p", owner=owner, run_as=owner, cwd="/")


async def test_started_once_restarted_on_change_stopped_on_close(tmp_path: Path, fake: FakeServers) -> None:
    path = tmp_path / "mcp.json"
    _write(path, ["a"], 1_000_000_000)
    mcp = AccountMCP(lambda owner: path if owner == "alice" else tmp_path / "none.json")
    assert set(await mcp.toolset(_record("alice"), {})) == {"a__ping"}
    assert set(await mcp.toolset(_record("alice"), {})) == {"a__ping"}
    assert fake.starts == [["a"]]  # shared by the account's runs
    assert await mcp.toolset(_record("bob"), {}) == {}  # bob has no file
    _write(path, ["b"], 2_000_000_000)
    assert set(await mcp.toolset(_record("alice"), {})) == {"b__ping"}
    assert fake.starts == [["a"], ["b"]] and fake.stops == 1
    path.unlink()
    assert await mcp.toolset(_record("alice"), {}) == {} and fake.stops == 2
    await mcp.close()


async def test_a_failed_start_is_retried_a_minute_later_not_at_every_run(
    tmp_path: Path, fake: FakeServers, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "mcp.json"
    _write(path, ["a"], 1_000_000_000)
    now = [100.0]
    mcp = AccountMCP(lambda owner: path, clock=lambda: now[0])
    fake.failing = True
    with caplog.at_level(logging.WARNING):
        assert await mcp.toolset(_record("alice"), {}) == {}
    assert "retrying in 60 s" in caplog.text
    now[0] += RETRY_AFTER - 1
    assert await mcp.toolset(_record("alice"), {}) == {} and len(fake.starts) == 1
    fake.failing = False
    now[0] += 1
    assert set(await mcp.toolset(_record("alice"), {})) == {"a__ping"} and len(fake.starts) == 2
    await mcp.close()


async def test_a_file_that_does_not_validate_is_logged_and_waits_for_a_change(
    tmp_path: Path, fake: FakeServers, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "mcp.json"
    path.write_text('[{"name": "a b"}]')
    now = [0.0]
    mcp = AccountMCP(lambda owner: path, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        assert await mcp.toolset(_record("alice"), {"Read": "read-tool"}) == {"Read": "read-tool"}  # type: ignore[dict-item]
    assert "server 0" in caplog.text and fake.starts == []
    now[0] += 10 * RETRY_AFTER
    await mcp.toolset(_record("alice"), {})
    assert fake.starts == []  # the same bad file is not read again
    _write(path, ["a"], 3_000_000_000)
    assert set(await mcp.toolset(_record("alice"), {})) == {"a__ping"}
    await mcp.close()


async def test_a_fifo_in_place_of_the_file_is_logged_not_waited_on(
    tmp_path: Path, fake: FakeServers, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "mcp.json"
    os.mkfifo(path)  # reading it would block the event loop until some writer came
    mcp = AccountMCP(lambda owner: path)
    with caplog.at_level(logging.WARNING):
        tools = await asyncio.wait_for(mcp.toolset(_record("alice"), {}), 5)
    assert tools == {} and "not a regular file" in caplog.text and fake.starts == []
    await mcp.close()


async def test_a_file_nested_too_deep_to_parse_is_logged_not_fatal(
    tmp_path: Path, fake: FakeServers, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "mcp.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    mcp = AccountMCP(lambda owner: path)
    with caplog.at_level(logging.WARNING):
        assert await mcp.toolset(_record("alice"), {"Read": "read-tool"}) == {"Read": "read-tool"}  # type: ignore[dict-item]
    assert "cannot read it" in caplog.text and fake.starts == []
    await mcp.close()


async def test_closing_stops_every_accounts_servers_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One account after another, servers slow to stop added up past what a service manager
    waits for (about 2 s each in the review: 100 s for 50 accounts)."""

    class SlowToStop(FakeServers):
        @contextlib.asynccontextmanager
        async def __call__(self, servers: list[MCPServerConfig]) -> AsyncIterator[list[Any]]:
            async with super().__call__(servers) as tools:
                try:
                    yield tools
                finally:
                    await asyncio.sleep(0.5)

    monkeypatch.setattr(account_mcp, "mcp_tools", SlowToStop())
    accounts = AccountMCP(lambda owner: tmp_path / f"{owner}.json")
    for i, owner in enumerate(["a", "b", "c", "d"]):
        _write(tmp_path / f"{owner}.json", [f"s{owner}"], 10**9 + i)
        assert await accounts.tools_of(owner)
    began = asyncio.get_running_loop().time()
    await accounts.close()
    assert asyncio.get_running_loop().time() - began < 1.5  # not 4 x 0.5 s
