"""A device's brief absence does not fail its calls: a call to a registered device that is offline
waits (``DeviceHub.reconnect_wait``) for it to connect again and then runs there; a call of an
idempotent tool the device dropped runs again once it is back, any other is an error that says it
may or may not have completed (and is never run twice); the wait ends at once when the run is
aborted, the device's token is revoked or the device forgotten, or it connects through another
worker. Real server, real WebSocket connections; the device side counts what it was asked to run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import websockets

from agentloop.kernel.devices import cut_by_shutdown, device_toolset
from agentloop.process import signals as sig
from agentloop.process.signals import Signal
from agentloop.process.store import ProcessRecord
from agentloop.process.store.base import DeviceNews
from agentloop.server import devices as hub_module
from agentloop.tools.base import ToolContext, ToolResult
from agentloop.tools.builtin import builtin_tools
from tests.test_device_client import world
from tests.test_device_registry10 import Box, box, connect

SHORT_WAIT = 0.3  # seconds: a device that stays away fails its call this soon
LONG_WAIT = 30.0  # the default: what abort, revoke and forget must not make a call sit through


class Device:
    """A device on a real WebSocket that records every call it is asked to run and answers it, or,
    with ``drop``, closes its socket instead (a laptop lid shut mid-call)."""

    def __init__(self, b: Box, token: str, name: str = "laptop", **declared: Any) -> None:
        self.b, self.token, self.name, self.declared = b, token, name, declared
        self.calls: list[str] = []
        self.asked = asyncio.Event()  # set at each call it gets
        self.ws: Any = None
        self.task: asyncio.Task[None] | None = None

    async def up(self, *, drop: bool = False) -> None:
        self.ws, res = await connect(self.b, self.token, self.name, **self.declared)
        assert res["ok"] is True, res
        self.task = asyncio.create_task(self._serve(self.ws, drop))

    async def _serve(self, ws: Any, drop: bool) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for text in ws:
                frame = json.loads(text)
                if frame.get("type") != "req" or frame["call"] == "request.cancel":
                    continue
                if frame["call"] == "sys.ping":
                    await ws.send(json.dumps({"type": "res", "id": frame["id"], "ok": True, "data": {}}))
                    continue
                self.calls.append(frame["call"])
                self.asked.set()
                if drop:
                    await ws.close()
                    return
                data = {"content": [{"type": "text", "text": f"ran {frame['call']}"}], "is_error": False}
                await ws.send(json.dumps({"type": "res", "id": frame["id"], "ok": True, "data": data}))

    async def down(self) -> None:
        """Close the socket, and wait until the hub has seen it go."""
        await self.ws.close()
        await self.gone()

    async def gone(self) -> None:
        if self.task is not None:
            await asyncio.wait_for(self.task, 5)
        await self.b.hub.wait_until(lambda: all(d.id != self.name for d in self.b.hub.online("alice")), 5)


def text(result: ToolResult) -> str:
    return "".join(getattr(block, "text", "") for block in result.content)


def toolset(b: Box, tmp_path: Path) -> dict[str, Any]:
    """What a run of alice's gets: the routed built-ins and her online devices' tools."""
    record = ProcessRecord(pid="p1", owner="alice", run_as="alice", cwd=str(tmp_path))
    return dict(device_toolset(b.hub)(record, {t.name: t for t in builtin_tools(tmp_path)}))


async def until_waiting(updates: list[Any]) -> None:
    """Until the call has told its run it waits for the device."""
    async with asyncio.timeout(5):
        while not any("waiting for device laptop" in str(u) for u in updates):
            await asyncio.sleep(0.01)


async def test_a_call_to_an_offline_device_waits_for_it_and_runs_once_it_is_back(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        b.hub.reconnect_wait = LONG_WAIT
        device = Device(b, await b.device_token("laptop"))
        await device.up()
        read = toolset(b, tmp_path)["Read"]  # the run started while the laptop was online
        await device.down()  # the lid shuts
        updates: list[Any] = []
        ctx = ToolContext("c1", "Read", tmp_path, update=updates.append)
        call = asyncio.create_task(read.run(read.validate({"path": "a.txt", "target": "laptop"}), ctx))
        await until_waiting(updates)
        assert not call.done() and device.calls == []
        await device.up()  # the lid opens
        result = await asyncio.wait_for(call, 5)
        assert not result.is_error and text(result) == "ran fs.read", text(result)
        assert device.calls == ["fs.read"]  # once
        assert "to reconnect (up to 30 s)" in updates[0]["text"]
        await device.down()


async def test_a_device_that_stays_away_past_the_wait_fails_the_call_naming_the_wait(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        b.hub.reconnect_wait = SHORT_WAIT
        device = Device(b, await b.device_token("laptop"))
        await device.up()
        await device.down()
        started = time.monotonic()
        result = await b.hub.call("alice", "laptop", "fs.read", {"path": "a.txt"}, 5)
        waited = time.monotonic() - started
        assert result.is_error and "did not connect again within 0.3 s" in text(result), text(result)
        assert SHORT_WAIT <= waited < SHORT_WAIT + 2
        # a name that is no device of alice's is not waited for
        assert "not one of your registered devices" in text(await b.hub.call("alice", "phone", "fs.read", {}, 5))


async def test_a_non_idempotent_call_the_device_drops_is_an_error_and_never_runs_twice(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        b.hub.reconnect_wait = LONG_WAIT
        device = Device(b, await b.device_token("laptop"), implements=["shell.exec"])
        await device.up(drop=True)
        shell = toolset(b, tmp_path)["Shell"]
        assert not shell.idempotent
        ctx = ToolContext("c1", "Shell", tmp_path)
        started = time.monotonic()
        call = asyncio.create_task(shell.run(shell.validate({"command": "make deploy", "target": "laptop"}), ctx))
        result = await asyncio.wait_for(call, 5)
        assert time.monotonic() - started < 5  # no wait for the device: the call would not be run again anyway
        assert result.is_error and "may or may not have completed" in text(result), text(result)
        await device.gone()
        await device.up()  # back: nothing is sent to it again
        assert (await b.hub.call("alice", "laptop", "shell.exec", {"command": "true"}, 5)).is_error is False
        assert device.calls == ["shell.exec", "shell.exec"]  # the dropped one, then the new call: never a re-run
        await device.down()


async def test_an_idempotent_device_tool_the_device_drops_runs_again_once_it_is_back(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        b.hub.reconnect_wait = LONG_WAIT
        tools = [{"name": "lookup", "parameters": {"type": "object"}, "idempotent": True}]
        device = Device(b, await b.device_token("laptop"), implements=[], tools=tools)
        await device.up(drop=True)
        lookup = toolset(b, tmp_path)["laptop__lookup"]
        assert lookup.idempotent  # as the device declared it
        updates: list[Any] = []
        call = asyncio.create_task(lookup.run({}, ToolContext("c1", "laptop__lookup", tmp_path, update=updates.append)))
        await device.gone()  # it dropped the call
        await until_waiting(updates)
        assert "run tool.lookup again" in updates[0]["text"]
        await device.up()
        result = await asyncio.wait_for(call, 5)
        assert not result.is_error and text(result) == "ran tool.lookup"
        assert device.calls == ["tool.lookup", "tool.lookup"]  # the cut one, and its re-run
        await device.down()


async def test_revoking_or_forgetting_the_device_during_the_wait_ends_it_at_once(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        b.hub.reconnect_wait = LONG_WAIT
        for name, end, why in [
            ("laptop", "/v1/devices/laptop/token", "its token was revoked"),
            ("phone", "/v1/devices/phone", "it was forgotten"),
        ]:
            device = Device(b, await b.device_token(name), name=name)
            await device.up()
            await device.down()
            updates: list[Any] = []
            call = asyncio.create_task(b.hub.call("alice", name, "fs.read", {}, 5, progress=updates.append))
            async with asyncio.timeout(5):
                while not updates:
                    await asyncio.sleep(0.01)
            started = time.monotonic()
            assert (await b.http.delete(end)).status_code == 200
            result = await asyncio.wait_for(call, 2)
            assert time.monotonic() - started < 2
            assert result.is_error and why in text(result), text(result)
        # and a call made after the revoke does not wait at all
        assert "its token was revoked" in text(
            await asyncio.wait_for(b.hub.call("alice", "laptop", "fs.read", {}, 5), 2)
        )


async def test_a_device_back_through_another_worker_ends_the_wait_with_a_clear_error(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        b.hub.reconnect_wait = LONG_WAIT
        device = Device(b, await b.device_token("laptop"))
        await device.up()
        await device.down()
        updates: list[Any] = []
        call = asyncio.create_task(b.hub.call("alice", "laptop", "fs.read", {}, 5, progress=updates.append))
        await until_waiting(updates)
        # what the lease manager hands the hub when another worker sharing the store says so
        status = {"device": "laptop", "status": "online", "timestamp": time.time()}
        b.hub.heard(DeviceNews("alice", "laptop", "status", status))
        result = await asyncio.wait_for(call, 2)
        assert result.is_error and "through another worker" in text(result), text(result)


async def test_aborting_the_run_ends_its_wait_for_a_device_at_once(tmp_path: Path) -> None:
    async with world(tmp_path) as w:  # device "box" has a token, and is not connected
        w.hub.reconnect_wait = LONG_WAIT
        proc = await w.kernel.spawn("alice", interactive=False)
        seen: list[Signal] = []

        async def follow() -> None:
            async for s in proc.signals(follow=True):
                seen.append(s)

        following = asyncio.create_task(follow())
        try:
            await asyncio.sleep(0.05)  # (the watch is made on the generator's first step)
            await proc.send('call Read {"path": "hello.txt", "target": "box"}')
            async with asyncio.timeout(10):  # the run's signals say what it waits for
                while not any(
                    s.signal == sig.TOOL_UPDATE and "waiting for device box" in s.payload["update"]["text"]
                    for s in seen
                ):
                    await asyncio.sleep(0.01)
            started = time.monotonic()
            assert await proc.abort()
            await asyncio.wait_for(proc.wait_idle(), 5)
            assert time.monotonic() - started < 5
        finally:
            following.cancel()
        assert not w.hub._waits  # nothing is left waiting for the device


# -- the server's shutdown, the call's own deadline, a device held by another worker, the limits ----


async def _never_answer(ws: Any, asked: asyncio.Event) -> None:
    """A device that takes every call and never answers it (a long one)."""
    with contextlib.suppress(websockets.ConnectionClosed):
        async for raw in ws:
            frame = json.loads(raw)
            if frame.get("type") == "req" and frame["call"] == "sys.ping":
                await ws.send(json.dumps({"type": "res", "id": frame["id"], "ok": True, "data": {}}))
            elif frame.get("type") == "req" and frame["call"] != "request.cancel":
                asked.set()


async def test_shutdown_ends_an_inflight_idempotent_call_at_once(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        b.hub.reconnect_wait = LONG_WAIT
        tools = [{"name": "lookup", "parameters": {"type": "object"}, "idempotent": True}]
        ws, res = await connect(b, await b.device_token("laptop"), "laptop", implements=[], tools=tools)
        assert res["ok"] is True, res
        asked = asyncio.Event()
        serving = asyncio.create_task(_never_answer(ws, asked))
        call = asyncio.create_task(b.hub.call("alice", "laptop", "tool.lookup", {}, 60, idempotent=True))
        await asyncio.wait_for(asked.wait(), 5)
        started = time.monotonic()
        await b.hub.close()  # its drop of the call must not start a wait for the device to come back
        try:
            result = await asyncio.wait_for(call, 3)
        finally:
            serving.cancel()
        assert time.monotonic() - started < 3
        assert result.is_error and "the server is shutting down" in text(result), text(result)
        assert cut_by_shutdown(result)


async def test_a_call_made_after_shutdown_began_does_not_wait(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        b.hub.reconnect_wait = LONG_WAIT
        device = Device(b, await b.device_token("laptop"))
        await device.up()
        await device.down()
        await b.hub.close()
        result = await asyncio.wait_for(b.hub.call("alice", "laptop", "fs.read", {"path": "a"}, 5), 3)
        assert result.is_error and "the server is shutting down" in text(result), text(result)


async def test_a_device_tool_cut_by_shutdown_records_nothing_and_waits_for_the_runtime_to_cancel_it(
    tmp_path: Path,
) -> None:
    """No "shutting down" error is handed to the run for a call that never ran: the tool stays
    until the runtime's close cancels it, as it does every call a shutdown interrupts (a durable
    process then resumes it after the restart)."""
    async with box(tmp_path) as b:
        b.hub.reconnect_wait = LONG_WAIT
        device = Device(b, await b.device_token("laptop"))
        await device.up()
        read = toolset(b, tmp_path)["Read"]
        await device.down()
        updates: list[Any] = []
        ctx = ToolContext("c1", "Read", tmp_path, update=updates.append)
        call = asyncio.create_task(read.run(read.validate({"path": "a.txt", "target": "laptop"}), ctx))
        await until_waiting(updates)
        await b.hub.close()
        done, _ = await asyncio.wait([call], timeout=0.2)
        assert not done  # no result: neither an error to record nor a wait of 30 s
        call.cancel()  # what the runtime's close does next
        await asyncio.wait([call], timeout=1)
        assert call.cancelled()


async def test_the_wait_leaves_the_call_its_own_deadline_and_says_the_device_did_not_reconnect_in_time(
    tmp_path: Path,
) -> None:
    async with box(tmp_path) as b:
        b.hub.reconnect_wait = LONG_WAIT
        device = Device(b, await b.device_token("laptop"))
        await device.up()
        read = toolset(b, tmp_path)["Read"]
        await device.down()
        loop = asyncio.get_running_loop()
        updates: list[Any] = []
        # the runtime cuts the call 1 s from now: the hub gives up its wait before that, in its own words
        ctx = ToolContext("c1", "Read", tmp_path, update=updates.append, deadline=loop.time() + 1.0)
        started = time.monotonic()
        result = await asyncio.wait_for(read.run(read.validate({"path": "a.txt", "target": "laptop"}), ctx), 5)
        assert time.monotonic() - started < 1.0
        assert result.is_error and "did not connect again in time" in text(result), text(result)
        assert "(up to 0.5 s)" in updates[0]["text"], updates


async def test_a_device_back_late_in_the_wait_is_cut_by_the_calls_deadline_not_a_fresh_timeout(
    tmp_path: Path,
) -> None:
    async with box(tmp_path) as b:
        b.hub.reconnect_wait = LONG_WAIT
        device = Device(b, await b.device_token("laptop"))
        await device.up()
        await device.down()
        loop = asyncio.get_running_loop()
        updates: list[Any] = []
        deadline = loop.time() + 1.5
        call = asyncio.create_task(
            b.hub.call("alice", "laptop", "fs.read", {}, 60, progress=updates.append, deadline=deadline)
        )
        await until_waiting(updates)
        ws, res = await connect(b, device.token, "laptop")  # back, but it never answers
        assert res["ok"] is True, res
        asked = asyncio.Event()
        serving = asyncio.create_task(_never_answer(ws, asked))
        try:
            result = await asyncio.wait_for(call, 5)
            assert loop.time() < deadline  # before the runtime would cut it, not 60 s after the sending
            assert asked.is_set()
            assert result.is_error and "the call's time ran out" in text(result), text(result)
        finally:
            await ws.close()
            serving.cancel()


async def test_a_device_connected_through_another_worker_fails_a_call_at_once(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        b.hub.reconnect_wait = LONG_WAIT
        device = Device(b, await b.device_token("laptop"))
        await device.up()
        await device.down()
        online = {"device": "laptop", "status": "online", "timestamp": time.time()}
        b.hub.heard(DeviceNews("alice", "laptop", "status", online))  # another worker holds it now
        started = time.monotonic()
        result = await asyncio.wait_for(b.hub.call("alice", "laptop", "fs.read", {}, 5), 2)
        assert time.monotonic() - started < 1
        assert result.is_error and "through another worker" in text(result), text(result)
        # it left that worker: a call waits for it again
        b.hub.reconnect_wait = SHORT_WAIT
        offline = {"device": "laptop", "status": "offline", "timestamp": time.time()}
        b.hub.heard(DeviceNews("alice", "laptop", "status", offline))
        result = await asyncio.wait_for(b.hub.call("alice", "laptop", "fs.read", {}, 5), 2)
        assert "did not connect again within 0.3 s" in text(result), text(result)
        # and one that connects here again is no longer taken to be elsewhere
        b.hub.heard(DeviceNews("alice", "laptop", "status", online))
        await device.up()
        assert not (await b.hub.call("alice", "laptop", "fs.read", {}, 5)).is_error
        await device.down()
        assert "did not connect again" in text(await b.hub.call("alice", "laptop", "fs.read", {}, 5))


async def test_an_offline_target_costs_one_registry_read(tmp_path: Path) -> None:
    async with box(tmp_path) as b:
        b.hub.reconnect_wait = SHORT_WAIT
        device = Device(b, await b.device_token("laptop"))
        await device.up()
        read = toolset(b, tmp_path)["Read"]
        await device.down()
        async with asyncio.timeout(5):  # (its leave, written down in the background)
            while b.hub._background:
                await asyncio.sleep(0.01)
        store = b.hub.store
        assert store is not None
        reads: list[str] = []
        real = store.list_devices

        async def counted(owner: str | None) -> Any:
            reads.append(str(owner))
            return await real(owner)

        store.list_devices = counted  # type: ignore[method-assign]
        try:
            result = await read.run(
                read.validate({"path": "a", "target": "laptop"}), ToolContext("c", "Read", tmp_path)
            )
            assert "did not connect again" in text(result), text(result)
            assert reads == ["alice"]
            reads.clear()
            result = await read.run(read.validate({"path": "a", "target": "phone"}), ToolContext("c", "Read", tmp_path))
            assert "not one of your online devices" in text(result), text(result)  # no device of hers
            assert reads == ["alice"]
        finally:
            del store.list_devices


async def test_an_account_has_a_bounded_number_of_calls_waiting(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(hub_module, "MAX_WAITING_CALLS", 2)
    async with box(tmp_path) as b:
        b.hub.reconnect_wait = LONG_WAIT
        device = Device(b, await b.device_token("laptop"))
        await device.up()
        await device.down()
        seen: list[Any] = []
        waiting = [
            asyncio.create_task(b.hub.call("alice", "laptop", "fs.read", {}, 5, progress=seen.append)) for _ in range(2)
        ]
        try:
            async with asyncio.timeout(5):
                while len(seen) < 2:
                    await asyncio.sleep(0.01)
            result = await asyncio.wait_for(b.hub.call("alice", "laptop", "fs.read", {}, 5), 2)
            assert result.is_error and "2 calls of this account already wait" in text(result), text(result)
            await device.up()  # the two waiting go
            assert not any(r.is_error for r in await asyncio.wait_for(asyncio.gather(*waiting), 5))
        finally:
            for task in waiting:
                task.cancel()
        assert not b.hub._waits and not b.hub._waiting
        await device.down()
