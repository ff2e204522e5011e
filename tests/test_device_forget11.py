"""Forgetting a device (``DELETE /v1/devices/{name}``, ``agentloop device forget NAME``): its
registry row goes, its token with it, so it is no longer listed and its place under the account's
limit is free; its connection closes at once here whatever token it used, a token bound to it no
longer connects (nor passes the heartbeat's re-check on another worker), and its leaving does not
write it back. Another account's device, or an unknown one, is a 404."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from click.testing import Result
from typer.testing import CliRunner

from agentloop.cli.main import app
from agentloop.client import AgentloopClient, NotFound
from agentloop.process.store import Store
from agentloop.server.auth import Accounts
from agentloop.server.devices import authenticate_device, device_token_valid, issue_device_token
from tests.store_conformance.test_conformance import make_store  # noqa: F401 (a fixture: one store per dialect)
from tests.test_device_registry10 import Box, box, closed_with, connect


async def _listed(b: Box) -> list[str]:
    return [d["id"] for d in await b.devices()]


async def _left_without_coming_back(b: Box) -> None:
    """Wait for the device's leave, then for its write in the background (the time it takes)."""
    await b.hub.wait_until(lambda: not b.hub.online("alice"), 5)
    await asyncio.sleep(0.3)


async def test_a_forgotten_device_is_no_longer_listed_and_frees_its_place(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        b.hub.max_registered = 2
        await b.device_token("laptop")
        await b.device_token("phone")
        assert (await b.http.post("/v1/devices/tablet/token")).status_code == 409  # full
        res = await b.http.delete("/v1/devices/phone")
        assert res.status_code == 200 and res.json() == {"device": "phone", "forgotten": True}
        assert await _listed(b) == ["laptop"]
        await b.device_token("tablet")  # the freed place is taken
        assert await _listed(b) == ["laptop", "tablet"]


async def test_a_connected_device_closes_at_once_and_its_token_connects_no_more(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        token = await b.device_token("laptop")
        ws, res = await connect(b, token, "laptop")
        assert res["ok"] is True
        assert (await b.http.delete("/v1/devices/laptop")).status_code == 200
        # the hub closes it (the heartbeat's re-check would say "the token was revoked")
        assert await closed_with(ws) == (4401, "the device was forgotten")
        await _left_without_coming_back(b)
        assert await _listed(b) == []
        ws, res = await connect(b, token, "laptop")
        assert res["ok"] is False and res["error"]["code"] == "unauthorized"
        assert await closed_with(ws) == (4401, "unauthorized")


async def test_a_device_connected_with_an_account_token_closes_too(tmp_path: Path) -> None:
    async with box(tmp_path, account_tokens=True) as b:
        ws, res = await connect(b, b.token, "laptop")
        assert res["ok"] is True and await _listed(b) == ["laptop"]
        assert (await b.http.delete("/v1/devices/laptop")).status_code == 200
        assert await closed_with(ws) == (4401, "the device was forgotten")
        await _left_without_coming_back(b)
        assert await _listed(b) == [] and await b.kernel.store.list_devices("alice") == []


async def test_unknown_or_another_accounts_device_is_not_found(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        await b.device_token("laptop")
        accounts = Accounts(b.kernel.store)
        await accounts.create_account("bob")
        bob_token, _ = await accounts.create_token("bob")
        headers = {"authorization": f"Bearer {bob_token}"}
        async with httpx.AsyncClient(base_url=b.server.url, headers=headers) as bob:
            res = await bob.delete("/v1/devices/laptop")
        assert res.status_code == 404 and res.json()["code"] == "not_found"
        assert await _listed(b) == ["laptop"]
        unknown = await b.http.delete("/v1/devices/ghost")
        assert unknown.status_code == 404 and unknown.json()["code"] == "not_found"
        assert "ghost" in unknown.json()["message"]
        assert (await b.http.delete("/v1/devices/a__b")).status_code == 400


async def test_the_heartbeat_check_of_another_worker_takes_a_forgotten_device_as_revoked(
    make_store: Callable[[], Store],  # noqa: F811
) -> None:
    """The re-check a worker the device is not connected through makes at each heartbeat: the token
    no longer resolves, so that worker closes the connection."""
    here, there = make_store(), make_store()
    await here.open()
    await there.open()
    try:
        await Accounts(here).create_account("alice")
        token, _ = await issue_device_token(here, "alice", "laptop", limit=1)
        bound = await authenticate_device(there, token)
        assert bound is not None and await device_token_valid(there, bound[0], "laptop")
        async with here.transaction():
            assert await here.forget_device("alice", "laptop")
        assert not await device_token_valid(there, bound[0], "laptop")
        assert await authenticate_device(there, token) is None
        await issue_device_token(here, "alice", "phone", limit=1)  # its place is free on every worker
    finally:
        await here.close()
        await there.close()


async def test_the_client_forgets_and_the_openapi_document_has_the_route(tmp_path: Path) -> None:
    async with box(tmp_path) as b, AgentloopClient(b.server.url, b.token) as client:
        await b.device_token("laptop")
        assert await client.forget_device("laptop") is True
        with pytest.raises(NotFound):
            await client.forget_device("laptop")
        doc = (await b.http.get("/v1/openapi.json")).json()
        forget = doc["paths"]["/v1/devices/{name}"]["delete"]
        assert {"200", "404"} <= set(forget["responses"])


async def _cli(b: Box, tmp_path: Path, *args: str) -> Result:
    """``agentloop device ARGS`` against the box's server, in a thread: the command runs its own
    event loop (``asyncio.run``) while this one serves it."""
    env = {
        "AGENTLOOP_SERVER": b.server.url,
        "AGENTLOOP_TOKEN": b.token,
        "AGENTLOOP_CONFIG": str(tmp_path / "no-config.toml"),
        "AGENTLOOP_DEBUG": None,
    }
    return await asyncio.to_thread(CliRunner().invoke, app, ["device", *args], env=env)


async def test_the_cli_forgets_in_one_line_and_refuses_an_unknown_device_in_one(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        await b.device_token("laptop")
        done = await _cli(b, tmp_path, "forget", "laptop")
        assert (done.exit_code, done.stdout, done.stderr) == (0, "forgot device laptop\n", ""), done.output
        assert await _listed(b) == []
        refused = await _cli(b, tmp_path, "forget", "laptop")
        assert refused.exit_code == 1 and refused.stdout == ""
        assert isinstance(refused.exception, SystemExit)  # the command's own exit, no uncaught error
        assert len(refused.stderr.strip().splitlines()) == 1 and "laptop" in refused.stderr, refused.stderr
