"""System events, schedules and signal watches over HTTP (``/v1/processes/{pid}/…``) and WebSocket."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop import ScriptedModel
from agentloop.server import api
from tests import server_support
from tests.server_support import LiveServer, wait_idle, wait_until
from tests.test_server_api import error, shape, spawn
from tests.ws_support import KernelServer

server = server_support.module_server("events")
alice, bob = server_support.alice, server_support.bob


async def system_texts(client: httpx.AsyncClient, pid: str) -> list[str]:
    page = shape(await client.get(f"/v1/processes/{pid}/messages"), api.HistoryOut)
    return [
        "".join(b["text"] for b in m["message"]["content"])
        for m in page["messages"]
        if m["message"]["role"] == "system"
    ]


async def test_an_event_is_injected_once_per_run_id(alice: httpx.AsyncClient) -> None:
    pid = await spawn(alice)
    body = {"text": "the deploy finished", "run_id": "deploy-7"}
    first = shape(await alice.post(f"/v1/processes/{pid}/events", json=body), api.ReceiptOut, 202)
    again = shape(await alice.post(f"/v1/processes/{pid}/events", json=body), api.ReceiptOut, 202)
    assert first == again and first["run_id"] == "deploy-7" and not first["queued"]
    await wait_idle(alice, pid)
    assert await system_texts(alice, pid) == ["the deploy finished"]


async def test_event_input_is_checked(alice: httpx.AsyncClient, bob: httpx.AsyncClient) -> None:
    pid = await spawn(alice)
    url = f"/v1/processes/{pid}/events"
    assert "text" in error(await alice.post(url, json={}), 400, "invalid_request")
    assert "empty" in error(await alice.post(url, json={"text": "  "}), 400, "invalid_request")
    error(await alice.post(url, json={"text": "x", "run_id": ""}), 400, "invalid_request")
    error(await alice.post(url, json={"text": "x", "mode": "queue"}), 400, "invalid_request")  # unknown field
    error(await alice.post(url, json={"text": "x" * 200_001}), 413, "too_large")
    error(await bob.post(url, json={"text": "hi"}), 404, "not_found")
    error(await alice.post("/v1/processes/nope/events", json={"text": "hi"}), 404, "not_found")


async def test_a_schedule_is_made_listed_fired_and_deleted(alice: httpx.AsyncClient, bob: httpx.AsyncClient) -> None:
    pid = await spawn(alice)
    url = f"/v1/processes/{pid}/schedules"
    later = shape(
        await alice.post(url, json={"text": "weekly report", "at": time.time() + 3600, "every": 604800, "name": "wk"}),
        api.ScheduleOut,
        201,
    )
    assert later["every"] == 604800 and later["name"] == "wk" and later["pid"] == pid
    soon = shape(await alice.post(url, json={"text": "stand-up", "at": time.time() + 0.1}), api.ScheduleOut, 201)
    listed = shape(await alice.get(url), api.ScheduleList)["schedules"]
    assert [s["id"] for s in listed] == [soon["id"], later["id"]]
    error(await bob.get(url), 404, "not_found")
    error(await bob.delete(f"{url}/{later['id']}"), 404, "not_found")

    async def fired() -> bool:
        return any("stand-up" in t for t in await system_texts(alice, pid))

    await wait_until(fired)
    assert [s["id"] for s in shape(await alice.get(url), api.ScheduleList)["schedules"]] == [later["id"]]
    removed = shape(await alice.delete(f"{url}/{later['id']}"), api.RemovedOut)
    assert removed == {"id": later["id"], "removed": True}
    error(await alice.delete(f"{url}/{later['id']}"), 404, "not_found")
    assert shape(await alice.get(url), api.ScheduleList)["schedules"] == []


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"text": "x"}, 400, "give at"),
        ({"text": "x", "every": 0}, 400, "positive"),
        ({"text": "x", "every": 1}, 400, "at least"),
        ({"text": "x", "every": True}, 400, "every"),
        ({"text": "x", "at": "tomorrow"}, 400, "at"),
        ({"text": "x", "at": 1e300}, 400, "hundred years"),
        ({"text": "", "at": 1}, 400, "text"),
        ({"text": "x", "at": 1, "name": ""}, 400, "name"),
        ({"text": "x" * 64_001, "at": 1}, 413, "longer"),
    ],
)
async def test_bad_schedules_are_refused_with_a_reason(
    alice: httpx.AsyncClient, body: dict[str, Any], status: int, words: str
) -> None:
    pid = await spawn(alice)
    resp = await alice.post(f"/v1/processes/{pid}/schedules", json=body)
    code = "too_large" if status == 413 else "invalid_request"
    assert words in error(resp, status, code)
    assert shape(await alice.get(f"/v1/processes/{pid}/schedules"), api.ScheduleList)["schedules"] == []


async def test_a_watch_over_http(server: LiveServer, alice: httpx.AsyncClient, bob: httpx.AsyncClient) -> None:
    source, watcher = await spawn(alice), await spawn(alice)
    bobs = await spawn(bob)
    url = f"/v1/processes/{watcher}/watches"
    assert "itself" in error(await alice.post(url, json={"source_pid": watcher}), 400, "invalid_request")
    error(await alice.post(url, json={"source_pid": bobs}), 404, "not_found")  # bob's does not exist for alice
    error(await bob.post(f"/v1/processes/{bobs}/watches", json={"source_pid": source}), 404, "not_found")
    error(await alice.post(url, json={"source_pid": source, "signal": "proc.nope"}), 400, "invalid_request")
    watch = shape(await alice.post(url, json={"source_pid": source}), api.WatchOut, 201)
    assert watch["once"] and watch["signal"] == "proc.run.finished"
    assert [w["id"] for w in shape(await alice.get(url), api.WatchList)["watches"]] == [watch["id"]]
    assert watch["created_at"] == shape(await alice.get(url), api.WatchList)["watches"][0]["created_at"] > 0
    await alice.post(f"/v1/processes/{source}/messages", json={"text": "the numbers"})

    async def told() -> bool:
        return any("answer: the numbers" in t for t in await system_texts(alice, watcher))

    await wait_until(told)
    assert shape(await alice.get(url), api.WatchList)["watches"] == []  # a one-shot ends
    again = shape(await alice.post(url, json={"source_pid": source, "once": False}), api.WatchOut, 201)
    assert shape(await alice.delete(f"{url}/{again['id']}"), api.RemovedOut)["removed"]
    error(await alice.delete(f"{url}/{again['id']}"), 404, "not_found")


async def test_an_admin_may_not_pair_two_owners_processes(server: LiveServer, alice: httpx.AsyncClient) -> None:
    bobs_client = server.client(server.tokens.bob)
    async with bobs_client as bob, server.client(server.tokens.admin) as admin:
        mine, bobs = await spawn(alice), await spawn(bob)
        resp = await admin.post(f"/v1/processes/{mine}/watches", json={"source_pid": bobs})
        assert "same owner" in error(resp, 403, "forbidden")


# ------------------------------------------------------------------ WebSocket


@pytest.fixture
def ws_server(tmp_path: Path) -> Iterator[KernelServer]:
    model = ScriptedModel(lambda r: f"re: {r.messages[-1].text}")
    with KernelServer(tmp_path, model) as srv:
        yield srv


def test_ws_runtime_event_calls(ws_server: KernelServer) -> None:
    with ws_server.client("alice") as alice, ws_server.client("bob") as bob:
        pid = alice.ok("proc.spawn")["pid"]
        other = alice.ok("proc.spawn")["pid"]
        receipt = alice.ok("proc.signal", {"pid": pid, "text": "wake up", "run_id": "w-1"})
        assert alice.ok("proc.signal", {"pid": pid, "text": "wake up", "run_id": "w-1"}) == receipt
        assert bob.error("proc.signal", {"pid": pid, "text": "hi"}) == "not_found"
        assert alice.error("proc.signal", {"pid": pid}) == "invalid_request"
        assert alice.error("proc.signal", {"pid": pid, "text": 5}) == "invalid_request"

        sched = alice.ok("proc.schedule.add", {"pid": pid, "text": "later", "at": time.time() + 3600})
        assert [s["id"] for s in alice.ok("proc.schedule.list", {"pid": pid})["schedules"]] == [sched["id"]]
        assert alice.error("proc.schedule.add", {"pid": pid, "text": "x", "every": "often"}) == "invalid_request"
        assert alice.error("proc.schedule.add", {"pid": pid, "text": "x", "every": -1}) == "invalid_request"
        assert bob.error("proc.schedule.list", {"pid": pid}) == "not_found"
        assert bob.error("proc.schedule.remove", {"pid": pid, "schedule_id": sched["id"]}) == "not_found"
        assert alice.ok("proc.schedule.remove", {"pid": pid, "schedule_id": sched["id"]})["removed"]
        assert alice.error("proc.schedule.remove", {"pid": pid, "schedule_id": sched["id"]}) == "not_found"

        watch = alice.ok("proc.watch.add", {"pid": pid, "source_pid": other, "once": False})
        assert [w["id"] for w in alice.ok("proc.watch.list", {"pid": pid})["watches"]] == [watch["id"]]
        assert alice.error("proc.watch.add", {"pid": pid, "source_pid": pid}) == "invalid_request"
        assert alice.error("proc.watch.add", {"pid": pid, "source_pid": other, "once": "yes"}) == "invalid_request"
        assert bob.error("proc.watch.list", {"pid": pid}) == "not_found"
        assert alice.ok("proc.watch.remove", {"pid": pid, "watch_id": watch["id"]})["removed"]
        assert alice.ok("proc.watch.list", {"pid": pid})["watches"] == []

        async def history() -> list[str]:
            assert ws_server.ctx is not None
            proc = await ws_server.ctx.kernel.process(pid)
            return [m.text for m in await proc.messages()]

        texts = ws_server.run(history)
        assert texts.count("wake up") == 1
