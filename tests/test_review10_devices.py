"""Review of device tokens (RV6): revoking or replacing a device's token ends its live connection
at once, not at the next heartbeat (until then the server kept sending the device tool calls, and
a call in flight waited on it); a device token stays bound to one owner's one device name; a
connection made with an account token is not ended by a device token's revocation; the token
never reaches a log line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop import Agent, ScriptedModel
from agentloop.kernel import Kernel
from agentloop.server.app import create_server
from agentloop.server.auth import Accounts
from agentloop.server.context import ServerContext
from agentloop.server.devices import DeviceHub
from tests.test_device_client import Server
from tests.test_device_registry10 import Box, closed_with, connect

SLOW_HEARTBEAT = 60.0  # the token check would come only after the test's deadlines


@contextlib.asynccontextmanager
async def box(tmp_path: Path, *, account_tokens: bool = False) -> AsyncIterator[Box]:
    hub = DeviceHub(probe_timeout=0.5, account_tokens=account_tokens)
    url = f"sqlite:///{tmp_path}/agentloop.db"
    async with Kernel.open(url, model=ScriptedModel(["ok"]), workspace=tmp_path, devices=hub) as kernel:
        accounts = Accounts(kernel.store)
        await accounts.create_account("alice")
        await accounts.create_account("bob")
        token, _ = await accounts.create_token("alice")
        ctx = ServerContext(kernel, accounts, devices=hub)
        ctx.heartbeat = SLOW_HEARTBEAT
        server = Server(create_server(ctx, lambda: Agent(ScriptedModel(["unused"]))))
        await server.start()
        b = Box(kernel, hub, server, token)
        b.bob = (await accounts.create_token("bob"))[0]  # type: ignore[attr-defined]
        try:
            yield b
        finally:
            await b.http.aclose()
            await hub.close()
            await server.stop()


async def test_revoking_a_device_token_ends_its_connection_and_call_at_once(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        token = await b.device_token("laptop")
        ws, res = await connect(b, token, "laptop")
        assert res["ok"] is True
        call = asyncio.create_task(b.hub.call("alice", "laptop", "fs.read", {"path": "a"}, 30))
        frame = json.loads(await asyncio.wait_for(ws.recv(), 5))  # the call reached the device
        assert frame["call"] == "fs.read"
        revoked = await b.http.delete("/v1/devices/laptop/token")
        assert revoked.status_code == 200
        assert b.hub.online("alice") == []  # no further call goes to it
        result = await asyncio.wait_for(call, 5)  # the call in flight does not wait for the device
        assert result.is_error
        assert "not connected" in (await b.hub.call("alice", "laptop", "fs.read", {}, 5)).content[0].text  # type: ignore[union-attr]
        assert await asyncio.wait_for(closed_with(ws), 5) == (4401, "the token was revoked")


async def test_a_new_token_ends_the_connection_of_the_one_it_replaces_at_once(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        first = await b.device_token("laptop")
        ws, res = await connect(b, first, "laptop")
        assert res["ok"] is True
        second = await b.device_token("laptop")
        assert b.hub.online("alice") == []
        assert await asyncio.wait_for(closed_with(ws), 5) == (4401, "the token was revoked")
        ws, res = await connect(b, second, "laptop")  # the new token gets its name at once
        assert res["ok"] is True
        await ws.close()


async def test_an_account_token_connection_is_not_ended_by_a_device_token(tmp_path: Path) -> None:
    async with box(tmp_path, account_tokens=True) as b:
        ws, res = await connect(b, b.token, "laptop")
        assert res["ok"] is True
        await b.device_token("laptop")
        assert (await b.http.delete("/v1/devices/laptop/token")).status_code == 200
        assert [d.id for d in b.hub.online("alice")] == ["laptop"]
        await ws.close()


async def test_a_device_token_is_bound_to_its_owner_and_listings_stay_per_owner(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        mine = await b.device_token("laptop")
        bob = httpx.AsyncClient(base_url=b.server.url, headers={"authorization": f"Bearer {b.bob}"})  # type: ignore[attr-defined]
        try:
            theirs = (await bob.post("/v1/devices/laptop/token")).json()["token"]
            assert theirs != mine
            ws, res = await connect(b, theirs, "laptop")
            assert res["ok"] is True and res["data"]["account"] == "bob" and res["data"]["admin"] is False
            assert b.hub.online("alice") == [] and [d.id for d in b.hub.online("bob")] == ["laptop"]
            assert [(d["owner"], d["id"]) for d in await b.devices()] == [("alice", "laptop")]
            # bob revoking his token leaves alice's alone, and the other way round
            assert (await bob.delete("/v1/devices/laptop/token")).status_code == 200
            assert await asyncio.wait_for(closed_with(ws), 5) == (4401, "the token was revoked")
            ws, res = await connect(b, mine, "laptop")
            assert res["ok"] is True and res["data"]["account"] == "alice"
            await ws.close()
            for odd in ("..", "a%2Fb", "x" * 33, "caf%C3%A9", "local", "-a", "a__b"):
                assert (await bob.post(f"/v1/devices/{odd}/token")).status_code in (400, 404), odd
        finally:
            await bob.aclose()


async def test_no_device_token_reaches_a_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with box(tmp_path) as b:
        token = await b.device_token("laptop")
        ws, res = await connect(b, token, "desktop")  # refused: another device's token
        assert res["ok"] is False and token not in json.dumps(res)
        await closed_with(ws)
        ws, res = await connect(b, token, "laptop")
        assert res["ok"] is True
        await b.http.delete("/v1/devices/laptop/token")
        await closed_with(ws)
        ws, res = await connect(b, token, "laptop")  # revoked
        assert res["ok"] is False and token not in json.dumps(res)
        await closed_with(ws)
    server = [r for r in caplog.records if not r.name.startswith(("websockets.client", "httpx", "httpcore"))]
    texts: list[Any] = [r.getMessage() for r in server] + [str(r.__dict__) for r in server]  # (not the test's clients)
    leaked = [t[:300] for t in texts if token in t]
    assert not leaked, leaked


async def test_migration_13_on_a_database_with_accounts_keeps_them_and_binds_devices(tmp_path: Path) -> None:
    """A version-12 database with accounts and tokens gains the (empty) registry: its account
    tokens still authenticate, and a device token issued after is no account token."""
    import sqlite3

    from agentloop.process.store.schema import LATEST_VERSION
    from agentloop.process.store.sqlite import SQLiteStore
    from agentloop.server.devices import authenticate_device, issue_device_token

    path = tmp_path / "agentloop.db"
    store = SQLiteStore(path)
    await store.open()
    accounts = Accounts(store)
    await accounts.create_account("alice")
    token, _ = await accounts.create_token("alice")
    await store.close()
    db = sqlite3.connect(path, isolation_level=None)  # back to version 12
    db.execute("DROP TABLE devices")
    db.execute("DROP TABLE approval_audit")  # (migration 14's: a version-12 database has neither)
    db.execute("DELETE FROM schema_version WHERE version >= 13")
    db.close()
    store = SQLiteStore(path)
    await store.open()
    try:
        assert await store.schema_version() == LATEST_VERSION and await store.list_devices() == []
        accounts = Accounts(store)
        who = await accounts.authenticate(token)
        assert who is not None and who.account == "alice"
        device, _ = await issue_device_token(store, "alice", "laptop")
        assert await accounts.authenticate(device) is None
        bound = await authenticate_device(store, device)
        assert bound is not None and (bound[0].account, bound[0].admin, bound[1]) == ("alice", False, "laptop")
        assert await authenticate_device(store, token) is None
    finally:
        await store.close()
