"""The ``/v1`` HTTP process API against a real server (uvicorn in a thread, kernel on SQLite).

Every answer is checked against the pydantic answer models the OpenAPI document is generated
from, so the document and the wire cannot drift apart unnoticed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate
from pydantic import BaseModel
from starlette.routing import Route, WebSocketRoute

from agentloop.server import api, events, web
from agentloop.server.ratelimit import InputRate
from tests import server_support
from tests.server_support import LiveServer, live_server, parse_sse, wait_idle, wait_until

PNG = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
    )
).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("api")
    (data / "sub").mkdir()
    with live_server(data) as srv:
        yield srv


alice = server_support.alice


def shape(resp: httpx.Response, model: type[BaseModel], status: int = 200) -> dict[str, Any]:
    """The answer's JSON, after checking its status and that it fits the documented model exactly."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    data: dict[str, Any] = resp.json()
    model.model_validate(data)
    return data


def error(resp: httpx.Response, status: int, code: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"code", "message"} and body["code"] == code, body
    message: str = body["message"]
    return message


async def spawn(client: httpx.AsyncClient, **body: Any) -> str:
    pid: str = shape(await client.post("/v1/processes", json=body), api.ProcessOut, 201)["pid"]
    return pid


async def pending(client: httpx.AsyncClient, pid: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    async def asked() -> bool:
        nonlocal found
        found = shape(await client.get(f"/v1/processes/{pid}/hil"), api.ApprovalList)["requests"]
        return bool(found)

    await wait_until(asked)
    return found


async def history(client: httpx.AsyncClient, pid: str, **params: Any) -> dict[str, Any]:
    return shape(await client.get(f"/v1/processes/{pid}/messages", params=params), api.HistoryOut)


# ------------------------------------------------------------------ happy paths


async def test_health_needs_no_token_and_me_names_the_caller(server: LiveServer, alice: httpx.AsyncClient) -> None:
    async with server.client(None) as anonymous:
        assert shape(await anonymous.get("/v1/health"), api.HealthOut) == {"ok": True}
    assert shape(await alice.get("/v1/me"), api.MeOut) == {"account": "alice", "admin": False}
    async with server.client(server.tokens.admin) as admin:
        assert shape(await admin.get("/v1/me"), api.MeOut) == {"account": "admin", "admin": True}


async def test_spawn_list_get_and_kill(server: LiveServer, alice: httpx.AsyncClient) -> None:
    created = shape(
        await alice.post("/v1/processes", json={"context": "be brief", "interactive": False, "cwd": "sub"}),
        api.ProcessOut,
        201,
    )
    pid = created["pid"]
    assert created["owner"] == "alice" and created["context"] == "be brief" and created["interactive"] is False
    assert Path(created["cwd"]) == server.data / "sub" and created["state"] == "idle" and created["run_id"] is None
    listed = shape(await alice.get("/v1/processes"), api.ProcessList)["processes"]
    assert pid in [p["pid"] for p in listed]
    assert shape(await alice.get(f"/v1/processes/{pid}"), api.ProcessOut) == created
    killed = shape(await alice.delete(f"/v1/processes/{pid}"), api.KillOut)
    assert killed == {"pid": pid, "killed": True, "archived": False}  # nothing was said: nothing to archive
    error(await alice.get(f"/v1/processes/{pid}"), 404, "not_found")
    assert pid not in [p["pid"] for p in (await alice.get("/v1/processes")).json()["processes"]]
    error(await alice.post("/v1/processes", json={"cwd": "../.."}), 400, "invalid_request")
    loop = server.data / "loop"
    loop.symlink_to(loop)
    for cwd in ("loop", "x" * 300):  # a symlink loop, a name too long: not a 500
        error(await alice.post("/v1/processes", json={"cwd": cwd}), 400, "invalid_request")


async def test_a_kill_racing_another_kill_or_a_reset_answers_404_not_500(alice: httpx.AsyncClient) -> None:
    """A retried DELETE (two tabs, a client that timed out) loses the race cleanly."""
    for other in ("delete", "reset"):
        for _ in range(3):  # with a history: the kill archives it (a moment the other request comes in)
            pid = (await alice.post("/v1/processes", json={"text": "hello"})).json()["pid"]
            second = (
                alice.delete(f"/v1/processes/{pid}")
                if other == "delete"
                else alice.post(f"/v1/processes/{pid}/reset", json={})
            )
            answers = await asyncio.gather(alice.delete(f"/v1/processes/{pid}"), second)
            assert sorted(r.status_code for r in answers)[0] == 200, answers
            assert all(r.status_code in (200, 404) for r in answers), [r.text for r in answers]


async def test_a_run_over_http_and_history_pages(alice: httpx.AsyncClient) -> None:
    pid = await spawn(alice)
    for word in ("one", "two", "three"):
        receipt = shape(
            await alice.post(f"/v1/processes/{pid}/messages", json={"text": f"echo {word}"}), api.ReceiptOut, 202
        )
        assert receipt["queued"] is False and receipt["run_id"]
        await wait_idle(alice, pid)
    everything = await history(alice, pid, limit=500)
    assert everything["next_before"] is None
    ids = [m["id"] for m in everything["messages"]]
    assert len(ids) == 12 and ids == sorted(ids)  # user, assistant call, tool result, assistant answer × 3
    assert everything["messages"][-1]["message"]["role"] == "assistant"
    assert everything["messages"][-1]["message"]["content"][0]["text"] == "done: three"

    pages: list[list[int]] = []
    before: int | None = None
    while True:
        page = await history(alice, pid, limit=5, **({"before": before} if before is not None else {}))
        pages.append([m["id"] for m in page["messages"]])
        before = page["next_before"]
        if before is None:
            break
        assert before == page["messages"][0]["id"]
    assert [len(p) for p in pages] == [5, 5, 2]
    assert [i for p in reversed(pages) for i in p] == ids  # newest page first, each page oldest first


async def test_send_with_the_same_run_id_delivers_once(alice: httpx.AsyncClient) -> None:
    pid = await spawn(alice)
    body = {"text": "hello there", "run_id": "client-retry-1"}
    first = shape(await alice.post(f"/v1/processes/{pid}/messages", json=body), api.ReceiptOut, 202)
    await wait_idle(alice, pid)
    again = shape(await alice.post(f"/v1/processes/{pid}/messages", json=body), api.ReceiptOut, 202)
    assert again == first
    await wait_idle(alice, pid)
    users = [m for m in (await history(alice, pid))["messages"] if m["message"]["role"] == "user"]
    assert len(users) == 1


async def test_send_with_an_image_and_each_mode(alice: httpx.AsyncClient) -> None:
    pid = await spawn(alice)
    media = [{"data": PNG, "mime_type": "image/png"}]
    shape(await alice.post(f"/v1/processes/{pid}/messages", json={"text": "look", "media": media}), api.ReceiptOut, 202)
    await wait_idle(alice, pid)
    for mode in ("queue", "interrupt", "steer"):
        resp = await alice.post(f"/v1/processes/{pid}/messages", json={"text": f"in {mode}", "mode": mode})
        shape(resp, api.ReceiptOut, 202)
        await wait_idle(alice, pid)
    first = (await history(alice, pid))["messages"][0]["message"]
    assert [b["type"] for b in first["content"]] == ["text", "image"]


async def test_spawn_with_a_first_message_starts_its_run(alice: httpx.AsyncClient) -> None:
    body = {"text": "hello there", "media": [{"data": PNG, "mime_type": "image/png"}], "run_id": "first-1"}
    made = shape(await alice.post("/v1/processes", json=body), api.ProcessOut, 201)
    assert made["run_id"] == "first-1"
    await wait_idle(alice, made["pid"])
    first = (await history(alice, made["pid"]))["messages"][0]
    assert first["run_id"] == "first-1" and [b["type"] for b in first["message"]["content"]] == ["text", "image"]
    # a retry of the first message (a send with the same run id) delivers nothing new
    again = shape(
        await alice.post(f"/v1/processes/{made['pid']}/messages", json={"text": "hello there", "run_id": "first-1"}),
        api.ReceiptOut,
        202,
    )
    assert again["run_id"] == "first-1" and len((await history(alice, made["pid"]))["messages"]) == 2
    # a retried spawn (its answer lost) finds the process the first one made
    retried = shape(await alice.post("/v1/processes", json=body), api.ProcessOut, 201)
    assert retried["pid"] == made["pid"] and retried["run_id"] == "first-1"
    assert len((await history(alice, made["pid"]))["messages"]) == 2
    error(await alice.post("/v1/processes", json={"media": body["media"]}), 400, "invalid_request")  # no text
    bad = {"text": "x", "media": [{"data": PNG, "mime_type": "image/jpeg"}]}
    error(await alice.post("/v1/processes", json=bad), 400, "invalid_request")


async def test_send_with_documents_and_clear_errors_for_bad_ones(alice: httpx.AsyncClient) -> None:
    pid = await spawn(alice)
    pdf = base64.b64encode(b"%PDF-1.4\n%%EOF\n").decode()
    notes = base64.b64encode("café notes".encode()).decode()
    media = [
        {"data": pdf, "mime_type": "application/pdf", "name": "report.pdf"},
        {"data": notes, "mime_type": "text/markdown", "name": "notes.md"},
    ]
    shape(await alice.post(f"/v1/processes/{pid}/messages", json={"text": "read", "media": media}), api.ReceiptOut, 202)
    await wait_idle(alice, pid)
    first = (await history(alice, pid))["messages"][0]["message"]
    assert [(b["type"], b.get("name")) for b in first["content"]] == [
        ("text", None),
        ("file", "report.pdf"),
        ("file", "notes.md"),
    ]
    url = f"/v1/processes/{pid}/messages"
    bad = {"data": PNG, "mime_type": "application/pdf"}  # an image labelled as a PDF
    assert "is not a PDF" in error(await alice.post(url, json={"text": "x", "media": [bad]}), 400, "invalid_request")
    binary = {"data": base64.b64encode(b"a\x00b").decode(), "mime_type": "text/plain"}
    assert "NUL" in error(await alice.post(url, json={"text": "x", "media": [binary]}), 400, "invalid_request")
    zipped = {"data": PNG, "mime_type": "application/zip"}
    error(await alice.post(url, json={"text": "x", "media": [zipped]}), 400, "invalid_request")
    assert len((await history(alice, pid))["messages"]) == 2  # the refused sends left nothing behind


async def test_approval_over_http_approve_and_deny(alice: httpx.AsyncClient) -> None:
    pid = await spawn(alice)
    shape(await alice.post(f"/v1/processes/{pid}/messages", json={"text": "risky"}), api.ReceiptOut, 202)
    [ask] = await pending(alice, pid)
    assert ask["tool_name"] == "echo" and ask["args"] == {"text": "risky"} and ask["tags"] == ["destructive"]
    assert ask["reason"] == "echo of something risky"
    url = f"/v1/processes/{pid}/hil/{ask['request_id']}"
    error(await alice.post(url, json={"decision": "maybe"}), 400, "invalid_request")
    decided = shape(await alice.post(url, json={"decision": "approve"}), api.DecisionOut)
    assert decided == {"request_id": ask["request_id"], "decision": "approve", "remember": False}
    await wait_idle(alice, pid)
    messages = (await history(alice, pid))["messages"]
    assert messages[-1]["message"]["content"][0]["text"] == "done: risky"
    error(await alice.post(url, json={"decision": "approve"}), 404, "not_found")  # already decided

    pid = await spawn(alice)
    await alice.post(f"/v1/processes/{pid}/messages", json={"text": "risky"})
    [ask] = await pending(alice, pid)
    resp = await alice.post(f"/v1/processes/{pid}/hil/{ask['request_id']}", json={"decision": "deny", "remember": True})
    assert shape(resp, api.DecisionOut)["decision"] == "deny"
    await wait_idle(alice, pid)
    result = next(m["message"] for m in (await history(alice, pid))["messages"] if m["message"]["role"] == "toolResult")
    assert result["isError"] is True and "denied" in json.dumps(result["content"])
    assert shape(await alice.get(f"/v1/processes/{pid}/hil"), api.ApprovalList) == {"requests": []}


async def test_abort_and_reset(alice: httpx.AsyncClient) -> None:
    pid = await spawn(alice)
    assert shape(await alice.post(f"/v1/processes/{pid}/abort"), api.AbortOut) == {"aborted": False}
    run_id = (await alice.post(f"/v1/processes/{pid}/messages", json={"text": "sleep 30"})).json()["run_id"]
    assert shape(await alice.post(f"/v1/processes/{pid}/abort", json={"run_id": "another-run"}), api.AbortOut) == {
        "aborted": False
    }
    assert shape(await alice.post(f"/v1/processes/{pid}/abort", json={"run_id": run_id}), api.AbortOut) == {
        "aborted": True
    }
    await wait_idle(alice, pid)
    assert (await history(alice, pid))["messages"]
    assert shape(await alice.post(f"/v1/processes/{pid}/reset"), api.ResetOut) == {"pid": pid, "archived": True}
    assert (await history(alice, pid))["messages"] == []
    assert shape(await alice.post(f"/v1/processes/{pid}/reset", json={}), api.ResetOut) == {
        "pid": pid,
        "archived": False,
    }


async def test_stop_finishes_the_run_gently(alice: httpx.AsyncClient) -> None:
    pid = await spawn(alice)
    assert shape(await alice.post(f"/v1/processes/{pid}/stop"), api.StopOut) == {"stopping": False}  # no run
    run_id = (await alice.post(f"/v1/processes/{pid}/messages", json={"text": "sleep 0.3"})).json()["run_id"]
    assert (await alice.post(f"/v1/processes/{pid}/stop", json={"run_id": "another-run"})).json() == {"stopping": False}
    assert shape(await alice.post(f"/v1/processes/{pid}/stop", json={"run_id": run_id}), api.StopOut) == {
        "stopping": True
    }
    await wait_idle(alice, pid)
    messages = [m["message"] for m in (await history(alice, pid))["messages"]]
    assert [m["role"] for m in messages] == ["user", "assistant", "toolResult", "system", "assistant"]
    assert "slept 0.3" in json.dumps(messages[2]["content"])  # the call under way was not cut short


async def test_mode_is_read_set_and_checked(server: LiveServer, alice: httpx.AsyncClient) -> None:
    pid = await spawn(alice)
    assert shape(await alice.get(f"/v1/processes/{pid}/mode"), api.ModeOut) == {"pid": pid, "mode": "agent"}
    assert shape(await alice.post(f"/v1/processes/{pid}/mode", json={"mode": "chat"}), api.ModeOut) == {
        "pid": pid,
        "mode": "chat",
    }
    assert (await alice.get(f"/v1/processes/{pid}/mode")).json()["mode"] == "chat"
    chatty = await spawn(alice, mode="chat")
    assert (await alice.get(f"/v1/processes/{chatty}/mode")).json()["mode"] == "chat"
    error(await alice.post(f"/v1/processes/{pid}/mode", json={"mode": "silent"}), 400, "invalid_request")
    error(await alice.post(f"/v1/processes/{pid}/mode", json={}), 400, "invalid_request")
    error(await alice.post("/v1/processes", json={"mode": "loud"}), 400, "invalid_request")
    error(await alice.post("/v1/processes/nope/mode", json={"mode": "chat"}), 404, "not_found")
    async with server.client(server.tokens.bob) as bob:  # another owner's process does not exist for bob
        error(await bob.post(f"/v1/processes/{pid}/mode", json={"mode": "agent"}), 404, "not_found")
    assert (await alice.get(f"/v1/processes/{pid}/mode")).json()["mode"] == "chat"


class FakeHub:
    def __init__(self) -> None:
        self.asked: list[str] = []

    def list(self, who: Any) -> list[dict[str, Any]]:
        self.asked.append(who.account)
        return [
            {
                "id": "laptop",
                "owner": who.account,
                "description": "",
                "implements": ["fs.read"],
                "tools": [],
                "connected_at": 1.5,
            }
        ]


async def test_devices_without_and_with_a_hub(server: LiveServer, alice: httpx.AsyncClient) -> None:
    assert server.ctx is not None
    assert shape(await alice.get("/v1/devices"), api.DeviceList) == {"devices": []}
    hub = FakeHub()
    server.ctx.devices = hub
    try:
        devices = shape(await alice.get("/v1/devices"), api.DeviceList)["devices"]
    finally:
        server.ctx.devices = None
    assert [d["id"] for d in devices] == ["laptop"] and hub.asked == ["alice"]


async def test_a_failing_part_answers_a_bare_500_and_logs_json(
    server: LiveServer, alice: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def list(self, who: Any) -> list[Any]:
            raise RuntimeError("database at /srv/secret/db.sqlite with token=al_abcdef is gone")

    assert server.ctx is not None
    server.ctx.devices = Broken()
    try:
        with caplog.at_level(logging.ERROR, logger="agentloop.server"):
            resp = await alice.get("/v1/devices")
    finally:
        server.ctx.devices = None
    message = error(resp, 500, "internal")
    assert "secret" not in message and "al_" not in message
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == "agentloop.server"]
    [record] = [r for r in logged if r.get("path") == "/v1/devices"]
    assert record["level"] == "error" and record["error_type"] == "RuntimeError" and record["path"] == "/v1/devices"
    assert "Traceback" in record["exception"]


# ------------------------------------------------------------------ the event stream


async def read_frames(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """Frames of an open SSE response, one at a time, as they arrive."""
    buffer = ""
    async for chunk in resp.aiter_text():
        buffer += chunk.replace("\r\n", "\n")
        while "\n\n" in buffer:
            block, buffer = buffer.split("\n\n", 1)
            for frame in parse_sse(block):
                yield frame


async def test_events_resume_with_last_event_id_without_gaps_or_repeats(
    server: LiveServer, alice: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events, "BUFFER", 2)  # the read-ahead fills up: backpressure on the backlog
    pid = await spawn(alice)
    await alice.post(f"/v1/processes/{pid}/messages", json={"text": "echo first"})
    await wait_idle(alice, pid)

    seen: list[int] = []
    async with alice.stream("GET", f"/v1/processes/{pid}/events") as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        async for frame in read_frames(resp):
            assert frame["event"] == frame["data"]["signal"] and frame["data"]["pid"] == pid
            seen.append(int(frame["id"]))
            assert frame["data"]["seq"] == int(frame["id"])
            if len(seen) == 3:
                break  # drop the connection mid-backlog
    await wait_until(lambda: server.watchers(pid) == 0)

    # More happens while nobody watches; the reconnect's header wins over the query's after_seq.
    second = (await alice.post(f"/v1/processes/{pid}/messages", json={"text": "a longer answer to stream"})).json()
    headers = {"Last-Event-ID": str(seen[-1])}
    live_only: list[dict[str, Any]] = []
    async with alice.stream("GET", f"/v1/processes/{pid}/events?after_seq=0", headers=headers) as resp:
        async for frame in read_frames(resp):
            if "id" not in frame:
                live_only.append(frame)
                continue
            seen.append(int(frame["id"]))
            data = frame["data"]
            if data["signal"] == "proc.run.finished" and data["payload"]["runId"] == second["run_id"]:
                break
    assert all(f["event"] == "proc.run.stream" and f["data"]["seq"] is None for f in live_only)

    async with alice.stream("GET", f"/v1/processes/{pid}/events", params={"follow": "false"}) as resp:
        logged = [int(f["id"]) for f in parse_sse((await resp.aread()).decode()) if "id" in f]  # ends after the backlog
    assert logged == list(range(1, len(logged) + 1))
    assert seen == logged  # every logged seq exactly once, in order
    after = parse_sse((await alice.get(f"/v1/processes/{pid}/events?follow=false&after_seq={logged[-2]}")).text)
    assert [int(f["id"]) for f in after] == [logged[-1]]
    head = await alice.head(f"/v1/processes/{pid}/events")  # headers only, no stream left open
    assert head.status_code == 200 and head.content == b"" and server.watchers(pid) == 0


async def test_a_live_stream_sees_a_run_and_its_watcher_goes_with_the_client(
    server: LiveServer, alice: httpx.AsyncClient
) -> None:
    pid = await spawn(alice)
    names: list[str] = []
    async with alice.stream("GET", f"/v1/processes/{pid}/events") as resp:
        await wait_until(lambda: server.watchers(pid) > 0)
        await alice.post(f"/v1/processes/{pid}/messages", json={"text": "echo live"})
        async for frame in read_frames(resp):
            names.append(frame["event"])
            if frame["event"] == "proc.run.finished":
                assert frame["data"]["payload"]["status"] == "ok"
                break
    assert names[0] == "proc.run.started" and "proc.run.tool.finished" in names
    await wait_until(lambda: server.watchers(pid) == 0)


async def test_a_killed_process_ends_its_streams(server: LiveServer, alice: httpx.AsyncClient) -> None:
    pid = await spawn(alice)
    async with alice.stream("GET", f"/v1/processes/{pid}/events") as resp:
        await wait_until(lambda: server.watchers(pid) > 0)
        await alice.delete(f"/v1/processes/{pid}")
        await asyncio.wait_for(resp.aread(), 5)
    assert server.watchers(pid) == 0


async def test_heartbeats_after_silence_and_shutdown_ends_streams(tmp_path: Path) -> None:
    with live_server(tmp_path, heartbeat=0.05) as server:
        async with server.client(server.tokens.alice) as alice:
            pid = await spawn(alice)
            pings = 0
            async with alice.stream("GET", f"/v1/processes/{pid}/events") as resp:
                async for frame in read_frames(resp):
                    assert frame == {"comment": "ping"}
                    pings += 1
                    if pings == 3:
                        break
            await wait_until(lambda: server.watchers(pid) == 0)

            assert server.ctx is not None
            stopping = server.ctx.stopping
            async with alice.stream("GET", f"/v1/processes/{pid}/events") as resp:
                await wait_until(lambda: server.watchers(pid) > 0)

                async def stop() -> None:
                    stopping.set()

                await server.run(stop)
                body = await asyncio.wait_for(resp.aread(), 5)  # the stream ends, cleanly
            assert resp.status_code == 200 and b"event:" not in body
            await wait_until(lambda: server.watchers(pid) == 0)
            error(await alice.get(f"/v1/processes/{pid}/events"), 503, "unavailable")


async def test_revoking_the_token_ends_an_event_stream_opened_with_it(tmp_path: Path) -> None:
    with live_server(tmp_path, heartbeat=0.05) as server:
        assert server.ctx is not None
        accounts = server.ctx.accounts
        token, record = await server.run(lambda: accounts.create_token("alice", label="phone"))
        async with server.client(token) as phone:
            pid = await spawn(phone)
            async with phone.stream("GET", f"/v1/processes/{pid}/events") as resp:
                await wait_until(lambda: server.watchers(pid) > 0)
                await server.run(lambda: accounts.revoke(record.id))
                await asyncio.wait_for(resp.aread(), 5)  # the stream ends
            await wait_until(lambda: server.watchers(pid) == 0)
            error(await phone.get(f"/v1/processes/{pid}"), 401, "unauthorized")


# ------------------------------------------------------------------ bad requests


async def test_bad_requests_answer_json_errors(server: LiveServer, alice: httpx.AsyncClient) -> None:
    pid = await spawn(alice)
    url = f"/v1/processes/{pid}/messages"
    assert "text" in error(await alice.post(url, json={"mode": "steer"}), 400, "invalid_request")
    assert "mode" in error(await alice.post(url, json={"text": "x", "mode": "shout"}), 400, "invalid_request")
    assert "text" in error(await alice.post(url, json={"text": 5}), 400, "invalid_request")
    bad_media = {"text": "x", "media": [{"data": PNG, "mime_type": "image/tiff"}]}
    assert "media[0].mime_type" in error(await alice.post(url, json=bad_media), 400, "invalid_request")
    bad_base64 = {"text": "x", "media": [{"data": "%%%", "mime_type": "image/png"}]}
    assert "media[0].data" in error(await alice.post(url, json=bad_base64), 400, "invalid_request")
    not_an_image = {"text": "x", "media": [{"data": "aGVsbG8=", "mime_type": "image/png"}]}
    assert "media[0].data is not a PNG" in error(await alice.post(url, json=not_an_image), 400, "invalid_request")
    wrong_type = {"text": "x", "media": [{"data": PNG, "mime_type": "image/jpeg"}]}
    assert "media[0].data is a image/png image" in error(await alice.post(url, json=wrong_type), 400, "invalid_request")
    assert "runid" in error(await alice.post(url, json={"text": "x", "runid": "r"}), 400, "invalid_request")
    assert "body" in error(await alice.post(url, content=b"{nope", headers=_json()), 400, "invalid_request")
    assert "body" in error(await alice.post(url, content=b"[1, 2]", headers=_json()), 400, "invalid_request")
    lone = b'{"text": "\\ud800"}'
    assert "body" in error(await alice.post(url, content=lone, headers=_json()), 400, "invalid_request")
    deep = b'{"text": ' + b"[" * 100_000
    assert "body" in error(await alice.post(url, content=deep, headers=_json()), 400, "invalid_request")
    error(
        await alice.post(url, content=b'{"text": "x"}', headers={"content-type": "text/plain"}),
        415,
        "unsupported_media_type",
    )
    error(await alice.post(url, content=b'{"text": "x"}', headers={"content-type": ""}), 415, "unsupported_media_type")
    assert "limit" in error(await alice.get(url, params={"limit": 0}), 400, "invalid_request")
    assert "before" in error(await alice.get(url, params={"before": "soon"}), 400, "invalid_request")
    assert "after_seq" in error(await alice.get(f"/v1/processes/{pid}/events?after_seq=-1"), 400, "invalid_request")
    assert "after_seq" in error(
        await alice.get(f"/v1/processes/{pid}/events?after_seq={2**64}"), 400, "invalid_request"
    )
    resp = await alice.get(f"/v1/processes/{pid}/events", headers={"Last-Event-ID": "x1"})
    assert "Last-Event-ID" in error(resp, 400, "invalid_request")
    error(await alice.get("/v1/processes/nope"), 404, "not_found")
    error(await alice.get(f"/v1/processes/{pid}/events/extra"), 404, "not_found")
    error(await alice.get("/nothing/here"), 404, "not_found")
    resp = await alice.put(f"/v1/processes/{pid}")
    error(resp, 405, "method_not_allowed")
    assert set(resp.headers["allow"].split(", ")) == {"GET", "HEAD", "DELETE"}
    async with server.client("al_not-a-real-token") as stranger:
        error(await stranger.get("/v1/me"), 401, "unauthorized")


def _json() -> dict[str, str]:
    return {"content-type": "application/json"}


async def test_bodies_over_the_limit_are_refused(alice: httpx.AsyncClient, server: LiveServer) -> None:
    pid = await spawn(alice)
    url = f"/v1/processes/{pid}/messages"
    big = json.dumps({"text": "x" * (1024 * 1024 + 10)}).encode()
    error(await alice.post(url, content=big, headers=_json()), 413, "too_large")

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the server has to count
        yield b'{"text": "'
        for _ in range(20):
            yield b"y" * 65536
        yield b'"}'

    error(await alice.post(url, content=chunked(), headers=_json()), 413, "too_large")
    assert (await history(alice, pid))["messages"] == []
    too_much_context = {"context": "c" * 64_001}
    assert "context" in error(await alice.post("/v1/processes", json=too_much_context), 413, "too_large")
    assert all(len(p["context"]) < 64_000 for p in (await alice.get("/v1/processes")).json()["processes"])


# ------------------------------------------------------------------ the OpenAPI document


def served_routes(app: Any) -> set[tuple[str, str]]:
    """(method, path) of every HTTP route the app answers, HEAD aside (Starlette adds it to GET),
    the browser UI's static files aside (they are not API)."""
    out: set[tuple[str, str]] = set()
    for route in app.routes:
        if isinstance(route, WebSocketRoute) or (isinstance(route, Route) and route.path in web.PATHS):
            continue
        assert isinstance(route, Route), f"an unexpected kind of route: {route!r}"
        out |= {(m, route.path) for m in route.methods or () if m != "HEAD"}
    return out


async def test_the_openapi_document_is_valid_and_matches_the_served_routes(
    server: LiveServer, alice: httpx.AsyncClient
) -> None:
    doc = shape(await alice.get("/v1/openapi.json"), api.OpenApiOut)
    validate(doc)
    assert doc["openapi"].startswith("3.1")
    documented = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    assert documented == served_routes(server.app)
    send = doc["paths"]["/v1/processes/{pid}/messages"]["post"]
    assert set(send["responses"]) >= {"202", "400", "401", "404", "413", "415"}
    schema = doc["components"]["schemas"]["SendBody"]
    assert schema["properties"]["mode"]["enum"] == ["steer", "queue", "interrupt", "reject"]
    assert schema["required"] == ["text"]
    assert doc["paths"]["/v1/health"]["get"]["security"] == []
    stream_op = doc["paths"]["/v1/processes/{pid}/events"]["get"]
    assert {p["name"] for p in stream_op["parameters"]} == {"pid", "after_seq", "follow", "Last-Event-ID"}


# ------------------------------------------------------------------ fuzzing


def _json_values() -> st.SearchStrategy[Any]:
    # Lone surrogates too: JSON can spell them ("\\ud800"), and no store can encode them.
    text = st.text(max_size=20) | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=3)
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
        max_leaves=8,
    )


_FIELDS = [
    "text",
    "mode",
    "media",
    "run_id",
    "decision",
    "remember",
    "context",
    "interactive",
    "cwd",
    "data",
    "mime_type",
]
_bodies = st.one_of(
    st.binary(max_size=64),
    _json_values().map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(_FIELDS), _json_values(), max_size=4).map(lambda v: json.dumps(v).encode()),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    route=st.sampled_from(["/v1/processes", "{p}/messages", "{p}/abort", "{p}/hil/{r}", "{p}/reset", "{p}"]),
    pid=st.sampled_from(["own", "unknown", "../x", "%00"]),
    request_id=st.text(min_size=1, max_size=10),
    body=_bodies,
    content_type=st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain", ""]),
)
def test_random_bodies_never_answer_5xx(
    fuzz_client: tuple[httpx.Client, str], route: str, pid: str, request_id: str, body: bytes, content_type: str
) -> None:
    client, own = fuzz_client
    p = f"/v1/processes/{own if pid == 'own' else pid}"
    url = route.format(p=p, r=quote(request_id, safe=""))
    resp = client.post(url, content=body, headers={"content-type": content_type})
    assert resp.status_code < 500, (url, body, resp.text)
    assert set(resp.json()) >= {"code", "message"} if resp.status_code >= 400 else True


@pytest.fixture(scope="module")
def fuzz_client(server: LiveServer) -> Iterator[tuple[httpx.Client, str]]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.tokens.alice}"}) as client:
        pid = client.post("/v1/processes", json={}).json()["pid"]
        yield client, pid


async def test_an_account_may_have_only_so_many_live_processes(server: LiveServer, alice: httpx.AsyncClient) -> None:
    """A review: one account could make any number of processes, each with schedules starting
    runs on the server's model keys."""
    assert server.ctx is not None
    live = len((await alice.get("/v1/processes")).json()["processes"])
    server.ctx.max_processes = live + 1
    try:
        first = await alice.post("/v1/processes", json={"text": "hi", "run_id": "r-limit"})
        assert first.status_code == 201, first.text
        refused = error(await alice.post("/v1/processes", json={}), 409, "conflict")
        assert "as many as this server allows" in refused
        again = await alice.post("/v1/processes", json={"text": "hi", "run_id": "r-limit"})  # a retry: its receipt
        assert again.status_code in (200, 201) and again.json()["pid"] == first.json()["pid"]
        async with server.client(server.tokens.admin) as admin:
            for _ in range(live + 2):  # admins are not limited
                assert (await admin.post("/v1/processes", json={})).status_code == 201
        await alice.delete(f"/v1/processes/{first.json()['pid']}")
        assert (await alice.post("/v1/processes", json={})).status_code == 201  # room again
    finally:
        server.ctx.max_processes = 1000


async def test_an_account_may_send_only_so_many_messages_a_minute(server: LiveServer, alice: httpx.AsyncClient) -> None:
    """Each message or event may start a run on the server's model keys: a runaway client is
    refused with 429 and Retry-After past the rate; bad requests, other accounts and admins are
    not counted against it."""
    assert server.ctx is not None
    clock = [1000.0]
    server.ctx.inputs = InputRate(lambda: clock[0])
    server.ctx.max_inputs_per_minute = 3
    try:
        pid = (await alice.post("/v1/processes", json={"text": "one"})).json()["pid"]  # 1
        error(await alice.post(f"/v1/processes/{pid}/messages", json={"text": ""}), 400, "invalid_request")
        error(await alice.post("/v1/processes/nope/messages", json={"text": "hi"}), 404, "not_found")
        assert (await alice.post(f"/v1/processes/{pid}/messages", json={"text": "two", "mode": "queue"})).is_success
        assert (await alice.post(f"/v1/processes/{pid}/events", json={"text": "three"})).is_success
        for refused in (
            await alice.post(f"/v1/processes/{pid}/messages", json={"text": "four"}),
            await alice.post(f"/v1/processes/{pid}/events", json={"text": "four"}),
            await alice.post("/v1/processes", json={"text": "four"}),
        ):
            assert "retry in 60 s" in error(refused, 429, "rate_limited")
            assert refused.headers["retry-after"] == "60"
        assert (await alice.post("/v1/processes", json={})).status_code == 201  # no message: no run
        async with server.client(server.tokens.admin) as admin:
            assert (await admin.post(f"/v1/processes/{pid}/messages", json={"text": "admin"})).is_success
        clock[0] += 60
        assert (await alice.post(f"/v1/processes/{pid}/messages", json={"text": "later"})).is_success
        await wait_idle(alice, pid)
    finally:
        server.ctx.max_inputs_per_minute = None


async def test_a_spawn_retried_after_its_process_was_killed_is_a_conflict(alice: httpx.AsyncClient) -> None:
    """The pid follows from the run id: a retry after a kill must not make a new process under the
    old pid, run the first message again and number its signals from 1 under old resume points."""
    first = await alice.post("/v1/processes", json={"text": "hello", "run_id": "spawn-once"})
    assert first.status_code == 201
    pid = first.json()["pid"]
    assert (await alice.delete(f"/v1/processes/{pid}")).status_code == 200
    error(await alice.post("/v1/processes", json={"text": "hello", "run_id": "spawn-once"}), 409, "conflict")
    error(await alice.get(f"/v1/processes/{pid}"), 404, "not_found")
