"""Review of today's device commits: a worker shutting down tells the other workers that its
devices went offline before its store closes (``DeviceHub.close`` waits for the leaves it
writes down), and a stale ``offline`` from another worker (the device left it after it
reconnected here, as a load balancer moves a device after a network blip) neither reaches this
worker's account watchers nor stays the last word elsewhere: this worker tells its presence again."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from agentloop.process.signals import AccountSignal
from agentloop.process.store import DeviceRecord
from agentloop.process.store.base import DeviceNews
from agentloop.server.auth import Principal
from agentloop.server.devices import DeviceHub, revoke_device_token
from tests.test_devices import ALICE, FakeDevice


class NotingStore:
    """What ``DeviceHub`` needs of a store: a transaction's device news are committed (``news``)
    when it ends, as PostgreSQL delivers a NOTIFY at commit; its key takes ``delay`` seconds."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.news: list[DeviceNews] = []
        self._open: list[DeviceNews] = []

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        self._open = []
        yield
        self.news.extend(self._open)

    async def exclusive(self, key: str) -> None:
        await asyncio.sleep(self.delay)

    async def list_devices(self, owner: str | None = None) -> list[Any]:
        return []

    async def device_seen(self, *args: Any) -> None:
        return None

    async def notify_device(self, news: DeviceNews) -> None:
        self._open.append(news)


class Watchers:
    """The account watchers here: the ``device.status`` each owner was told."""

    def __init__(self) -> None:
        self.told: list[tuple[str, str]] = []

    def to_account(self, owner: str, signal: AccountSignal) -> None:
        self.told.append((signal.signal.payload["device"], signal.signal.payload["status"]))


def _statuses(store: NotingStore) -> list[tuple[str, str]]:
    return [(n.name, n.detail["status"]) for n in store.news if n.event == "status"]


async def test_closing_the_hub_tells_the_other_workers_its_devices_left_before_it_returns() -> None:
    store = NotingStore(delay=0.05)  # (a round trip to the database)
    hub = DeviceHub(probe_timeout=0.5)
    hub.bind(store, Watchers())  # type: ignore[arg-type]
    device = FakeDevice(hub, ALICE, "laptop")
    assert (await device.connect())["ok"] is True
    assert _statuses(store) == [("laptop", "online")]
    await hub.close()  # (the server then closes the kernel, and with it the store)
    assert _statuses(store) == [("laptop", "online"), ("laptop", "offline")]


async def test_a_stale_offline_from_another_worker_is_not_told_here_and_the_device_is_told_online_again() -> None:
    store = NotingStore()
    watchers = Watchers()
    hub = DeviceHub(probe_timeout=0.5)
    hub.bind(store, watchers)  # type: ignore[arg-type]
    device = FakeDevice(hub, ALICE, "laptop")
    assert (await device.connect())["ok"] is True  # reconnected here, after a blip on the other worker
    assert watchers.told == [("laptop", "online")]
    # the other worker notices only now that its old connection is gone
    left = {"device": "laptop", "status": "offline", "timestamp": time.time() - 1}
    hub.heard(DeviceNews("alice", "laptop", "status", left))
    for _ in range(50):
        await asyncio.sleep(0.01)
    assert watchers.told == [("laptop", "online")]  # the device is here, online
    assert _statuses(store)[-1] == ("laptop", "online")  # and the other workers are told so again
    # an offline of a device not connected here is told as before
    hub.heard(DeviceNews("alice", "phone", "status", {"device": "phone", "status": "offline", "timestamp": 1.0}))
    assert watchers.told[-1] == ("phone", "offline")
    await hub.close()


async def test_a_revoke_names_the_token_it_took_and_another_worker_closes_only_that_tokens_connection() -> None:
    """The owner revokes a token through another worker, issues a new one, and the device reconnects
    here with it before the revoke's notification arrives: the late notification closes nothing."""

    class Bound(NotingStore):
        async def list_devices(self, owner: str | None = None) -> list[Any]:
            return [DeviceRecord("alice", "laptop", token_id="old")]

        async def set_device_token(self, *args: Any) -> bool:
            return True

    store = Bound()
    assert await revoke_device_token(store, "alice", "laptop")  # type: ignore[arg-type]
    [news] = [n for n in store.news if n.event == "revoked"]
    assert news.detail == {"revoked": "old"}

    hub = DeviceHub(probe_timeout=0.5)
    hub.bind(NotingStore(), Watchers())  # type: ignore[arg-type]
    device = FakeDevice(hub, Principal("alice", False, "device:new"), "laptop")
    assert (await device.connect())["ok"] is True
    hub.heard(news)  # (late: the device is here with the token issued since)
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert [d.id for d in hub.online("alice")] == ["laptop"]
    hub.heard(DeviceNews("alice", "laptop", "revoked", {"revoked": "new"}))  # its own token revoked: it goes
    await hub.wait_until(lambda: not hub.online("alice"))
    await hub.close()
