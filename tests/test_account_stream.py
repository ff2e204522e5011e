"""One account's view across all its processes: ``GET /v1/approvals`` (every pending request of the
caller's processes), the account stream (``GET /v1/events``, WebSocket ``account.subscribe``) and
what the client and the web UI make of them.

The point of it all: an approval asked by a run nobody follows (a schedule's, a system event's, a
subagent's) reaches its owner all the same, and leaves the inbox once it is answered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.client import AccountEvent, AgentloopClient, ClientError
from agentloop.messages import SystemMessage, UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.signals import AccountSignal, Signal, SignalHub
from agentloop.server import api
from tests import server_support
from tests.cdp import Browser
from tests.server_support import LiveServer, asking_policy, echo, live_server, pending_requests, wait_until
from tests.test_server_api import read_frames
from tests.test_web_ui_browser import FOLLOWING, replies, served  # noqa: F401
from tests.ws_support import KernelServer, eventually

ORIGINAL_SCRIPT = server_support.script


def script(req: ModelRequest) -> Reply | str:
    """The shared test script, plus: a system event ending in ``risky`` asks for approval too (the
    run of a schedule, whose header comes first, or of ``kernel.signal``: runs nobody follows)."""
    last = req.messages[-1]
    if isinstance(last, SystemMessage) and last.text.splitlines()[-1] == "risky":
        return Reply(tool_calls=[call("echo", text="risky")])
    return ORIGINAL_SCRIPT(req)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server_support, "script", script)
        with live_server(tmp_path_factory.mktemp("account")) as srv:
            yield srv


alice, bob = server_support.alice, server_support.bob


async def spawn(client: httpx.AsyncClient) -> str:
    resp = await client.post("/v1/processes", json={})
    assert resp.status_code == 201, resp.text
    pid: str = resp.json()["pid"]
    return pid


async def ask(client: httpx.AsyncClient, pid: str) -> dict[str, Any]:
    """Start a run on ``pid`` that asks for approval; its pending request."""
    assert (await client.post(f"/v1/processes/{pid}/messages", json={"text": "risky"})).status_code == 202
    return (await pending_requests(client, pid))[0]


async def inbox(client: httpx.AsyncClient, **params: str) -> list[dict[str, Any]]:
    resp = await client.get("/v1/approvals", params=params)
    assert resp.status_code == 200, resp.text
    api.AccountApprovalList.model_validate(resp.json())
    requests: list[dict[str, Any]] = resp.json()["requests"]
    return requests


def account_watchers(server: LiveServer, account: str) -> int:
    assert server.ctx is not None
    return len(server.ctx.kernel.engine.hub._accounts.get(account, ()))


# ------------------------------------------------------------------ the hub


def test_an_account_watcher_gets_its_owners_approvals_and_run_ends_only() -> None:
    hub = SignalHub()
    mine = hub.watch_account("alice")
    asked = AccountSignal("p1", Signal(sig.HIL_REQUESTED, {"requestId": "h1"}, 3), 7)
    hub.to_account("alice", asked)
    hub.to_account("alice", AccountSignal("p1", Signal(sig.RUN_STARTED, {}, 1), 8))  # (not the account's)
    hub.publish("p1", Signal(sig.RUN_STREAM, {"delta": "x"}), "alice")
    hub.publish("p1", Signal(sig.CHANGED, {"changes": ["queue"]}, 2), "alice")
    answered = AccountSignal("p1", Signal(sig.CHANGED, {"changes": ["messages", "hil"]}, 4), 8)
    hub.to_account("alice", answered)
    titled = Signal(sig.CHANGED, {"changes": ["title"], "title": "t"})
    hub.publish("p1", titled, "alice")  # unlogged, as titles are: live only, no account seq
    finished = AccountSignal("p1", Signal(sig.RUN_FINISHED, {"status": "ok"}, 5), 9)
    hub.to_account("alice", finished)
    hub.to_account("bob", AccountSignal("p2", Signal(sig.HIL_REQUESTED, {}, 1), 1))  # another account's
    hub.publish("p3", Signal(sig.HIL_REQUESTED, {}, 1))  # (a relayed signal: its owner is not known here)
    got = [mine.get_nowait() for _ in range(mine.qsize())]
    assert got == [asked, answered, AccountSignal("p1", titled), finished]
    assert hub.account_heads() == {"alice": 9}
    hub.unwatch_account("alice", mine)
    assert hub._accounts == {}


def test_nobody_watching_an_account_costs_publish_no_filtering(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(signal: Signal) -> bool:
        raise AssertionError("filtered while nobody watches an account")

    monkeypatch.setattr(sig, "for_account", never)
    hub = SignalHub()
    process = hub.watch("p1")
    hub.publish("p1", Signal(sig.HIL_REQUESTED, {}, 1), "alice")
    assert process.qsize() == 1


def test_an_account_watcher_that_falls_behind_is_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sig, "BACKLOG", 3)
    hub = SignalHub()
    slow = hub.watch_account("alice")
    for seq in range(1, 6):
        hub.publish("p1", Signal(sig.RUN_FINISHED, {}, seq), "alice")
    assert [slow.get_nowait() for _ in range(slow.qsize())] == [None]  # read the inbox again, then reopen
    assert hub._accounts == {}


async def test_closing_the_hub_ends_account_watchers() -> None:
    hub = SignalHub()
    watcher = hub.watch_account("alice")
    hub.close_accounts()
    assert await watcher.get() is None and hub._accounts == {}


# ------------------------------------------------------------------ GET /v1/approvals


async def test_the_inbox_lists_every_pending_request_of_the_callers_processes(
    server: LiveServer, alice: httpx.AsyncClient, bob: httpx.AsyncClient
) -> None:
    first, second, quiet = await spawn(alice), await spawn(alice), await spawn(alice)
    theirs = await spawn(bob)
    asked = {pid: await ask(alice, pid) for pid in (first, second)}
    bobs = await ask(bob, theirs)

    listed = await inbox(alice)
    for pid, request in asked.items():
        assert {**request, "pid": pid} in listed  # the process's own hil fields, and its pid
    assert quiet not in {r["pid"] for r in listed}
    alices = {p["pid"] for p in (await alice.get("/v1/processes")).json()["processes"]}
    assert {r["pid"] for r in listed} <= alices
    assert {r["request_id"] for r in await inbox(bob)} >= {bobs["request_id"]}
    assert theirs not in {r["pid"] for r in listed}

    # an answered request leaves the inbox
    decided = await alice.post(f"/v1/processes/{first}/hil/{asked[first]['request_id']}", json={"decision": "approve"})
    assert decided.status_code == 200
    assert asked[first]["request_id"] not in {r["request_id"] for r in await inbox(alice)}
    assert asked[second]["request_id"] in {r["request_id"] for r in await inbox(alice)}


async def test_an_admin_sees_their_own_inbox_or_names_an_account(
    server: LiveServer, alice: httpx.AsyncClient, bob: httpx.AsyncClient
) -> None:
    pid = await spawn(alice)
    request = await ask(alice, pid)
    async with server.client(server.tokens.admin) as admin:
        assert pid not in {r["pid"] for r in await inbox(admin)}
        assert {**request, "pid": pid} in await inbox(admin, account="alice")
        assert await inbox(admin, account="nobody") == []
    assert {**request, "pid": pid} in await inbox(alice, account="alice")  # naming oneself is fine
    refused = await bob.get("/v1/approvals", params={"account": "alice"})
    assert refused.status_code == 403 and refused.json()["code"] == "forbidden"


# ------------------------------------------------------------------ GET /v1/events


async def next_data(frames: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    """The next frame that carries data (pings are skipped)."""
    async with asyncio.timeout(10):
        async for frame in frames:
            if "data" in frame:
                return frame
    raise AssertionError("the stream ended")


async def test_the_account_stream_tells_of_an_approval_a_schedule_asked_with_nobody_following(
    server: LiveServer, alice: httpx.AsyncClient, bob: httpx.AsyncClient
) -> None:
    assert server.ctx is not None
    kernel = server.ctx.kernel
    pid, theirs = await spawn(alice), await spawn(bob)
    async with alice.stream("GET", "/v1/events") as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        await wait_until(lambda: account_watchers(server, "alice") == 1)
        await ask(bob, theirs)  # bob's approval is not alice's business
        await server.run(lambda: kernel.schedule(pid, "risky", at=time.time()))
        frames = read_frames(resp)
        asked = await next_data(frames)
        assert asked["event"] == sig.HIL_REQUESTED and asked["data"]["pid"] == pid
        assert asked["id"].isdigit()  # its account seq: what a reconnect resumes after
        assert server.watchers(pid) == 0  # nobody follows the process itself
        request_id = asked["data"]["payload"]["requestId"]
        assert [r["request_id"] for r in await inbox(alice) if r["pid"] == pid] == [request_id]

        decided = await alice.post(f"/v1/processes/{pid}/hil/{request_id}", json={"decision": "deny"})
        assert decided.status_code == 200
        seen = [await next_data(frames)]
        while seen[-1]["event"] != sig.RUN_FINISHED:
            seen.append(await next_data(frames))
        assert seen[0]["event"] == sig.CHANGED and "hil" in seen[0]["data"]["payload"]["changes"]
        assert all(f["data"]["pid"] == pid for f in seen)
        assert all(f["event"] != sig.CHANGED or "hil" in f["data"]["payload"]["changes"] for f in seen)
        assert seen[-1]["data"]["payload"]["status"] == "ok"
    await wait_until(lambda: account_watchers(server, "alice") == 0)


async def test_the_account_stream_follows_a_run_started_by_a_system_event(
    server: LiveServer, alice: httpx.AsyncClient
) -> None:
    assert server.ctx is not None
    kernel = server.ctx.kernel
    pid = await spawn(alice)
    async with alice.stream("GET", "/v1/events") as resp:
        await wait_until(lambda: account_watchers(server, "alice") == 1)
        await server.run(lambda: kernel.signal(pid, "risky"))
        asked = await next_data(read_frames(resp))
        assert (asked["event"], asked["data"]["pid"]) == (sig.HIL_REQUESTED, pid)
        assert asked["data"]["payload"]["name"] == "echo" and asked["data"]["payload"]["tags"] == ["destructive"]
    await alice.post(f"/v1/processes/{pid}/abort", json={})


async def test_follow_false_answers_at_once_with_where_the_stream_stands(
    server: LiveServer, alice: httpx.AsyncClient
) -> None:
    resp = await alice.get("/v1/events", params={"follow": "false"})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert server.ctx is not None
    newest = await server.run(lambda: server.ctx.kernel.account_seq("alice"))  # type: ignore[union-attr]
    assert resp.content == f"id: {newest}\r\n\r\n".encode()  # no event: only the account seq it opens at
    assert account_watchers(server, "alice") == 0


async def test_the_account_stream_pings_and_ends_on_revocation_and_shutdown(tmp_path: Path) -> None:
    with live_server(tmp_path, heartbeat=0.05) as server:
        assert server.ctx is not None
        accounts, stopping = server.ctx.accounts, server.ctx.stopping
        token, record = await server.run(lambda: accounts.create_token("alice", label="phone"))
        async with server.client(token) as phone:
            pings = 0
            async with phone.stream("GET", "/v1/events") as resp, asyncio.timeout(5):
                async for frame in read_frames(resp):  # until the server ends the stream
                    if set(frame) == {"id"}:
                        continue  # (the opening frame: where the stream starts)
                    assert frame == {"comment": "ping"}
                    pings += 1
                    if pings == 2:
                        await server.run(lambda: accounts.revoke(record.id))
            assert pings >= 2
            await wait_until(lambda: account_watchers(server, "alice") == 0)
            assert (await phone.get("/v1/events")).status_code == 401

        async with server.client(server.tokens.alice) as alice:
            async with alice.stream("GET", "/v1/events") as resp:
                await wait_until(lambda: account_watchers(server, "alice") == 1)

                async def stop() -> None:
                    stopping.set()

                await server.run(stop)
                body = await asyncio.wait_for(resp.aread(), 5)
            assert b"event:" not in body
            await wait_until(lambda: account_watchers(server, "alice") == 0)
            refused = await alice.get("/v1/events")
            assert refused.status_code == 503 and refused.json()["code"] == "unavailable"


# ------------------------------------------------------------------ the WebSocket


def ws_script(req: ModelRequest) -> Reply | str:
    last = req.messages[-1]
    if isinstance(last, UserMessage | SystemMessage) and last.text == "risky":  # a person's, or an event's
        return Reply(tool_calls=[call("echo", text="risky")])
    return "done"


def test_account_subscribe_pushes_the_signals_of_every_process_of_the_account(tmp_path: Path) -> None:
    model = ScriptedModel(ws_script)
    with KernelServer(tmp_path, model, tools=[echo], approval=asking_policy) as server:
        assert server.ctx is not None
        kernel = server.ctx.kernel
        with server.client("alice") as c, server.client("bob") as other:
            assert c.ok("account.subscribe")["account"] == "alice"
            assert other.ok("account.subscribe")["account"] == "bob"
            pid = c.ok("proc.spawn")["pid"]  # never proc.subscribe'd
            server.run(lambda: kernel.signal(pid, "risky"))
            [asked] = c.signals_until(pid, sig.HIL_REQUESTED)
            assert asked["seq"] is not None and asked["payload"]["name"] == "echo"
            [listed] = c.ok("approvals.list")["requests"]
            assert listed["pid"] == pid and listed["request_id"] == asked["payload"]["requestId"]
            assert c.ok("approvals.list", {"account": "alice"})["requests"] == [listed]
            assert c.error("approvals.list", {"account": "bob"}) == "forbidden"
            assert other.ok("approvals.list")["requests"] == []

            c.ok("proc.hil", {"pid": pid, "request_id": listed["request_id"], "decision": "approve"})
            told = c.signals_until(pid, sig.RUN_FINISHED)
            assert told[0]["signal"] == sig.CHANGED and "hil" in told[0]["payload"]["changes"]
            assert {s["signal"] for s in told} <= {sig.CHANGED, sig.RUN_FINISHED}
            assert c.ok("approvals.list")["requests"] == []

            assert c.ok("account.unsubscribe") == {"account": "alice", "unsubscribed": True}
            assert c.ok("account.unsubscribe") == {"account": "alice", "unsubscribed": False}
            c.ok("proc.send", {"pid": pid, "text": "risky"})
            eventually(lambda: bool(c.ok("approvals.list")["requests"]))
            assert [s for s in c.sigs if s["pid"] == pid] == []  # unsubscribed: nothing more
            assert other.ok("proc.list")["processes"] == [] and other.sigs == []
            eventually(lambda: len(kernel.engine.hub._accounts.get("alice", ())) == 0)
        eventually(lambda: kernel.engine.hub._accounts == {})  # the socket's end ends bob's too


# ------------------------------------------------------------------ the client


async def test_the_client_lists_the_inbox_and_follows_the_account(server: LiveServer, alice: httpx.AsyncClient) -> None:
    assert server.ctx is not None
    kernel = server.ctx.kernel
    pid = await spawn(alice)
    async with AgentloopClient(server.url, server.tokens.alice) as client:
        connected = asyncio.Event()
        seen: list[AccountEvent] = []

        async def follow() -> None:
            async for event in client.account_events(connected=connected):
                seen.append(event)
                if event.signal == sig.RUN_FINISHED and event.pid == pid:
                    return

        following = asyncio.create_task(follow())
        async with asyncio.timeout(10):
            await connected.wait()
            await wait_until(lambda: account_watchers(server, "alice") == 1)
            await server.run(lambda: kernel.signal(pid, "risky"))
            await wait_until(lambda: any(e.signal == sig.HIL_REQUESTED for e in seen))
            [asked] = [e for e in seen if e.signal == sig.HIL_REQUESTED]
            assert asked.pid == pid and asked.seq is not None
            pending = [r for r in await client.approvals() if r["pid"] == pid]
            assert [r["request_id"] for r in pending] == [asked.payload["requestId"]]
            assert await client.approvals(pid) == [{k: v for k, v in pending[0].items() if k != "pid"}]
            await client.hil(pid, asked.payload["requestId"], "approve")
            await following
        assert [e.signal for e in seen][-1] == sig.RUN_FINISHED
        assert any(e.signal == sig.CHANGED and "hil" in e.payload["changes"] for e in seen)
        assert [r for r in await client.approvals() if r["pid"] == pid] == []
        with pytest.raises(ClientError) as refused:
            await client.approvals(account="bob")
        assert refused.value.code == "forbidden"
    async with AgentloopClient(server.url, server.tokens.revoked) as revoked:
        with pytest.raises(ClientError) as info:
            async for _ in revoked.account_events():
                pass
        assert info.value.status == 401


# ------------------------------------------------------------------ the web UI


ASKING = {"tool_calls": [{"name": "Delete", "arguments": {"path": "junk.txt"}}]}
BADGE = "document.getElementById('inbox-count').textContent"


@pytest.mark.parametrize("replies", [[ASKING, "Deleted junk.txt."]])
def test_the_sidebar_shows_an_approval_asked_by_another_process_and_opens_it(
    served: tuple[str, str, Path],  # noqa: F811
    browser: Browser,
) -> None:
    url, token, workspace = served
    browser.navigate(url + "/")
    browser.wait("!document.getElementById('signin').hidden")
    browser.type_into("token", token)
    browser.eval("document.getElementById('signin-form').requestSubmit()")
    browser.click("#new-process")
    shown = browser.wait(f"{FOLLOWING} && document.getElementById('proc-title').textContent")
    assert browser.eval("document.getElementById('inbox').hidden") is True  # nothing pending: no badge

    # Another process asks, started by a system event: the page follows only the one it shows.
    auth = {"Authorization": f"Bearer {token}"}
    asking = httpx.post(f"{url}/v1/processes", headers=auth, json={}, timeout=5).json()["pid"]
    posted = httpx.post(f"{url}/v1/processes/{asking}/events", headers=auth, json={"text": "tidy up"}, timeout=5)
    assert posted.status_code == 202, posted.text
    assert browser.wait(f"!document.getElementById('inbox').hidden && {BADGE}") == "1"
    item = "document.querySelector('#inbox-list li')"
    assert browser.eval(f"{item}.dataset.pid") == asking
    assert "Delete" in browser.eval(f"{item}.textContent")
    assert browser.eval("document.getElementById('proc-title').textContent") == shown
    assert browser.eval("document.querySelectorAll('#approvals .approval').length") == 0

    # Clicking it opens that process, with its approval card; approving it empties the inbox.
    browser.click("#inbox-list li")
    browser.wait(f"{FOLLOWING} && document.getElementById('proc-title').textContent === {asking!r}")
    browser.wait("document.querySelector('#approvals .approval')")
    assert "junk.txt" in browser.eval("document.querySelector('#approvals .approval pre').textContent")
    browser.click("#approvals .hil-approve")
    browser.wait("document.querySelector('#transcript .footer[data-status=ok]')")
    browser.wait("document.getElementById('inbox').hidden")
    assert not (workspace / "junk.txt").exists()
    assert not [line for line in browser.console if "exception" in line or "Content Security Policy" in line]
