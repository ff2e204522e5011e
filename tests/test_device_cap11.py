"""The device registry's limit per account: a token for a new device name past it is refused (409
``too_many_devices``, the limit in the message, one line from the CLI), on SQLite and PostgreSQL
alike and through several workers at once; a token for a registered name never is; a revoked device
keeps its place; and a driver connected with an account token under a new name past it is served
but not written down."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from agentloop.process.store import Store
from agentloop.server.devices import (
    MAX_REGISTERED_DEVICES,
    TooManyDevices,
    issue_device_token,
    revoke_device_token,
)
from tests.store_conformance.test_conformance import make_store  # noqa: F401 (a fixture: one store per dialect)
from tests.test_device_registry10 import box, closed_with, connect

PIPE = asyncio.subprocess.PIPE


async def _names(store: Store, owner: str = "alice") -> list[str]:
    return [d.name for d in await store.list_devices(owner)]


async def test_the_default_limit_refuses_a_new_name_but_never_a_registered_one(
    make_store: Callable[[], Store],  # noqa: F811
) -> None:
    store = make_store()
    await store.open()
    try:
        names = [f"d{i}" for i in range(MAX_REGISTERED_DEVICES)]
        for name in names:
            await issue_device_token(store, "alice", name)
        with pytest.raises(TooManyDevices) as refused:
            await issue_device_token(store, "alice", "one-more")
        assert refused.value.code == "too_many_devices" and f"at most {MAX_REGISTERED_DEVICES}" in refused.value.message
        await issue_device_token(store, "alice", "d7")  # a new token for a registered device: no new row
        await issue_device_token(store, "bob", "d0")  # the limit is the account's own
        assert sorted(await _names(store)) == sorted(names)
        assert await _names(store, "bob") == ["d0"]
    finally:
        await store.close()


async def test_a_revoked_device_keeps_its_place_and_gets_a_token_again(
    make_store: Callable[[], Store],  # noqa: F811
) -> None:
    store = make_store()
    await store.open()
    try:
        await issue_device_token(store, "alice", "laptop", limit=2)
        await issue_device_token(store, "alice", "phone", limit=2)
        assert await revoke_device_token(store, "alice", "phone")
        with pytest.raises(TooManyDevices):  # revoking does not free a place: the row stays
            await issue_device_token(store, "alice", "tablet", limit=2)
        await issue_device_token(store, "alice", "phone", limit=2)  # the name is reused instead
        assert [(d.name, d.token_id is not None) for d in await store.list_devices("alice")] == [
            ("laptop", True),
            ("phone", True),
        ]
    finally:
        await store.close()


async def test_registrations_through_two_workers_at_once_cannot_both_pass_the_limit(
    make_store: Callable[[], Store],  # noqa: F811
) -> None:
    """Two stores on one database, as two servers sharing it: each round, the account has one
    place left and both register a new name at once; exactly one gets it."""
    first, second = make_store(), make_store()
    await first.open()
    await second.open()
    try:
        for limit in range(1, 6):
            outcomes = await asyncio.gather(
                issue_device_token(first, "alice", f"a{limit}", limit=limit),
                issue_device_token(second, "alice", f"b{limit}", limit=limit),
                return_exceptions=True,
            )
            refused = [o for o in outcomes if isinstance(o, TooManyDevices)]
            assert len(refused) == 1, outcomes
            assert len(await _names(first)) == limit
    finally:
        await first.close()
        await second.close()


async def test_the_route_answers_409_too_many_devices_with_the_limit(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        b.hub.max_registered = 2  # the hub's setting is the route's limit
        for name in ("laptop", "phone", "laptop"):
            res = await b.http.post(f"/v1/devices/{name}/token")
            assert res.status_code == 200, res.text
        res = await b.http.post("/v1/devices/tablet/token")
        assert res.status_code == 409
        assert res.json()["code"] == "too_many_devices" and "at most 2" in res.json()["message"]
        assert [d["id"] for d in await b.devices()] == ["laptop", "phone"]


async def test_the_cli_prints_the_refusal_in_one_line(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        b.hub.max_registered = 1
        await b.device_token("laptop")
        env = {**os.environ, "AGENTLOOP_SERVER": b.server.url, "AGENTLOOP_TOKEN": b.token}
        cli = [sys.executable, "-m", "agentloop.cli.main", "device", "token", "phone"]
        proc = await asyncio.create_subprocess_exec(*cli, stdout=PIPE, stderr=PIPE, env=env)
        out, err = await asyncio.wait_for(proc.communicate(), 20)
        text = err.decode()
        assert proc.returncode == 1 and out == b""
        assert "at most 1" in text and "Traceback" not in text and len(text.strip().splitlines()) == 1, text


async def test_a_driver_with_an_account_token_past_the_limit_is_served_but_not_registered(tmp_path: Path) -> None:
    async with box(tmp_path, account_tokens=True) as b:
        b.hub.max_registered = 1
        await b.device_token("laptop")
        ws, res = await connect(b, b.token, "spare")
        assert res["ok"] is True
        assert [d.id for d in b.hub.online("alice")] == ["spare"]
        assert await _names(b.kernel.store) == ["laptop"]  # (the connect is written down before its answer)
        await ws.close()
        await closed_with(ws)
        await b.hub.wait_until(lambda: not b.hub.online("alice"))
        await asyncio.sleep(0.3)  # the leave is written down in the background: the time it takes
        assert await _names(b.kernel.store) == ["laptop"]
        assert [d["id"] for d in await b.devices()] == ["laptop"]
