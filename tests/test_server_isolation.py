"""Who may call what: every ``/v1`` route × {owner, another account, admin, no token, revoked token}.

The routes are read from the app itself, and each needs a recipe below (how to make a valid
request of it), so a route added later fails here until someone decides who may call it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import httpx
import pytest
from starlette.routing import Route

from agentloop.server import ServerContext, create_server
from tests.server_support import LiveServer, engine_agent, live_server, parse_sse


def v1_routes() -> list[tuple[str, str]]:
    """(method, path) of every ``/v1`` HTTP route, from an app built the way the server builds it."""
    app = create_server(ServerContext(kernel=cast(Any, None), accounts=cast(Any, None)), engine_agent)
    found = set()
    for route in app.routes:
        if isinstance(route, Route) and route.path.startswith("/v1/"):
            found |= {(m, route.path) for m in route.methods or () if m != "HEAD"}
    return sorted(found)


ROUTES = v1_routes()
ROLES = ["owner", "other", "admin", "no_token", "revoked"]
PUBLIC = {("GET", "/v1/health")}

# How to call each route validly for the process's owner: request keyword arguments for httpx.
RECIPES: dict[tuple[str, str], dict[str, Any]] = {
    ("GET", "/v1/health"): {},
    ("GET", "/v1/me"): {},
    ("GET", "/v1/usage"): {},
    ("GET", "/v1/models"): {},
    ("GET", "/v1/devices"): {},
    ("POST", "/v1/devices/{name}/token"): {},  # (a device of the caller's own: any account may)
    ("DELETE", "/v1/devices/{name}/token"): {},
    ("DELETE", "/v1/devices/{name}"): {},  # (a device of the caller's own, made for it to forget)
    ("GET", "/v1/openapi.json"): {},
    ("GET", "/v1/processes"): {},
    ("GET", "/v1/approvals"): {},
    ("GET", "/v1/approvals/audit"): {},  # (each account its own audit; ``?account=`` is an admin's)
    ("GET", "/v1/events"): {"params": {"follow": "false"}},
    ("POST", "/v1/processes"): {"json": {"context": "matrix"}},
    ("GET", "/v1/processes/{pid}"): {},
    ("DELETE", "/v1/processes/{pid}"): {},
    ("POST", "/v1/processes/{pid}/messages"): {"json": {"text": "hello"}},
    ("GET", "/v1/processes/{pid}/messages"): {"params": {"limit": 10}},
    ("GET", "/v1/processes/{pid}/events"): {"params": {"follow": "false"}},
    ("POST", "/v1/processes/{pid}/abort"): {"json": {}},
    ("POST", "/v1/processes/{pid}/stop"): {"json": {}},
    ("POST", "/v1/processes/{pid}/retry"): {"json": {}},  # (on a question left unanswered: path_ids)
    ("GET", "/v1/processes/{pid}/mode"): {},
    ("POST", "/v1/processes/{pid}/mode"): {"json": {"mode": "chat"}},
    ("GET", "/v1/processes/{pid}/model"): {},
    ("POST", "/v1/processes/{pid}/model"): {"json": {"model": None, "reasoning": "low"}},
    ("GET", "/v1/processes/{pid}/tools"): {},
    ("POST", "/v1/processes/{pid}/tools"): {"json": {"tools": None}},
    ("GET", "/v1/processes/{pid}/title"): {},
    ("POST", "/v1/processes/{pid}/title"): {"json": {"title": "matrix"}},
    ("GET", "/v1/processes/{pid}/compaction"): {},
    ("POST", "/v1/processes/{pid}/compaction"): {"json": {"threshold": 0.8, "overflow": "fail"}},
    ("GET", "/v1/processes/{pid}/hil"): {},
    ("POST", "/v1/processes/{pid}/hil/{request_id}"): {"json": {"decision": "deny"}},
    ("POST", "/v1/processes/{pid}/reset"): {},
    ("POST", "/v1/processes/{pid}/events"): {"json": {"text": "an event"}},
    ("GET", "/v1/processes/{pid}/schedules"): {},
    ("POST", "/v1/processes/{pid}/schedules"): {"json": {"text": "later", "at": 4102444800}},
    ("DELETE", "/v1/processes/{pid}/schedules/{schedule_id}"): {},
    ("GET", "/v1/processes/{pid}/watches"): {},
    ("POST", "/v1/processes/{pid}/watches"): {"json": {"source_pid": "{source_pid}"}},
    ("DELETE", "/v1/processes/{pid}/watches/{watch_id}"): {},
    ("GET", "/v1/processes/{pid}/queue"): {},
    ("DELETE", "/v1/processes/{pid}/queue"): {},
    ("DELETE", "/v1/processes/{pid}/queue/{item_id}"): {},
    ("POST", "/v1/processes/{pid}/compact"): {"json": {}},
    ("POST", "/v1/processes/{pid}/fork"): {"json": {}},
    ("POST", "/v1/processes/{pid}/rewind"): {"json": {"at": 0}},  # (an empty history: back to the start)
    ("GET", "/v1/processes/{pid}/segments"): {},
    ("GET", "/v1/processes/{pid}/segments/{segment_id}"): {"params": {"limit": 10}},
}


def path_ids(alice: httpx.Client, path: str, pid: str) -> dict[str, str]:
    """Ids a route's path or body names besides the pid: a schedule, a watch, a queued message and
    a history segment of alice's process, and another of her processes to watch."""
    source: str = alice.post("/v1/processes", json={}).json()["pid"]
    out = {"source_pid": source, "schedule_id": "no-such-schedule", "watch_id": "no-such-watch"}
    if "{schedule_id}" in path:
        out["schedule_id"] = alice.post(
            f"/v1/processes/{pid}/schedules", json={"text": "later", "at": 4102444800}
        ).json()["id"]
    if "{watch_id}" in path:
        out["watch_id"] = alice.post(f"/v1/processes/{pid}/watches", json={"source_pid": source}).json()["id"]
    if "{item_id}" in path:  # input waiting behind a long run
        alice.post(f"/v1/processes/{pid}/messages", json={"text": "sleep 30"})
        alice.post(f"/v1/processes/{pid}/messages", json={"text": "later", "mode": "queue"})
        out["item_id"] = str(alice.get(f"/v1/processes/{pid}/queue").json()["items"][0]["id"])
    if path.endswith("/retry"):  # a question with its answer rewound away: one to retry
        alice.post(f"/v1/processes/{pid}/messages", json={"text": "hello"})
        for _ in range(500):
            if alice.get(f"/v1/processes/{pid}").json()["state"] == "idle":
                break
            time.sleep(0.01)
        question = alice.get(f"/v1/processes/{pid}/messages").json()["messages"][0]["id"]
        alice.post(f"/v1/processes/{pid}/rewind", json={"at": question})
    if "{segment_id}" in path:  # a conversation a reset put away
        alice.post(f"/v1/processes/{pid}/messages", json={"text": "hello"})
        for _ in range(500):
            if alice.get(f"/v1/processes/{pid}").json()["state"] == "idle":
                break
            time.sleep(0.01)
        alice.post(f"/v1/processes/{pid}/reset")
        out["segment_id"] = alice.get(f"/v1/processes/{pid}/segments").json()["segments"][0]["id"]
    return out


def recipe(route: tuple[str, str], ids: dict[str, str]) -> dict[str, Any]:
    kw = dict(RECIPES.get(route, {}))
    if "json" in kw:
        kw["json"] = {k: v.format(**ids) if isinstance(v, str) else v for k, v in kw["json"].items()}
    return kw


class Devices:
    """A device hub with one device per account; it answers what the principal may see."""

    def list(self, who: Any) -> list[dict[str, Any]]:
        mine = [
            {"id": f"{name}-laptop", "owner": name, "implements": [], "tools": [], "connected_at": 0.0}
            for name in ("alice", "bob")
        ]
        return [d for d in mine if who.admin or d["owner"] == who.account]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("isolation"), devices=Devices()) as srv:
        yield srv


@pytest.fixture(scope="module")
def clients(server: LiveServer) -> Iterator[dict[str, httpx.Client]]:
    """One client per role, shared by the whole matrix (sync: nothing here needs concurrency)."""
    tokens = {
        "owner": server.tokens.alice,
        "other": server.tokens.bob,
        "admin": server.tokens.admin,
        "no_token": None,
        "revoked": server.tokens.revoked,
    }
    out = {
        role: httpx.Client(base_url=server.url, timeout=10, headers={"Authorization": f"Bearer {t}"} if t else {})
        for role, t in tokens.items()
    }
    yield out
    for client in out.values():
        client.close()


def owned_process(alice: httpx.Client, *, asking: bool) -> tuple[str, str]:
    """A process of alice's, and a pending approval request on it when ``asking``."""
    pid: str = alice.post("/v1/processes", json={}).json()["pid"]
    if not asking:
        return pid, "no-such-request"
    alice.post(f"/v1/processes/{pid}/messages", json={"text": "risky"})
    for _ in range(500):
        requests = alice.get(f"/v1/processes/{pid}/hil").json()["requests"]
        if requests:
            return pid, requests[0]["request_id"]
        time.sleep(0.01)
    raise AssertionError("no approval was requested")


def test_every_route_has_a_recipe() -> None:
    assert set(ROUTES) == set(RECIPES), "add a recipe (and decide who may call it) for each new /v1 route"


def expected(route: tuple[str, str], role: str) -> Callable[[int], bool]:
    if route in PUBLIC:
        return lambda status: status == 200
    if role in ("no_token", "revoked"):
        return lambda status: status == 401
    if role == "other" and "{pid}" in route[1]:
        return lambda status: status == 404  # someone else's process does not exist
    return lambda status: 200 <= status < 300


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("route", ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_isolation(clients: dict[str, httpx.Client], route: tuple[str, str], role: str) -> None:
    method, path = route
    alice, caller = clients["owner"], clients[role]
    auditing = route == ("GET", "/v1/approvals/audit")
    pid, request_id = owned_process(alice, asking="{request_id}" in path or path == "/v1/approvals" or auditing)
    if auditing:  # a decision of alice's for her audit to hold
        alice.post(f"/v1/processes/{pid}/hil/{request_id}", json={"decision": "deny"})
    ids = path_ids(alice, path, pid) if "{pid}" in path else {}
    before = alice.get(f"/v1/processes/{pid}").json()
    forgetting = route == ("DELETE", "/v1/devices/{name}")
    url = path.format(pid=pid, request_id=request_id, name="isolation-gone" if forgetting else "isolation-box", **ids)
    if route == ("DELETE", "/v1/devices/{name}/token") and role in ("owner", "other", "admin"):
        caller.post(url)  # (each account revokes a token of its own device)
    if forgetting and role in ("owner", "other", "admin"):
        caller.post(f"{url}/token")  # (each account forgets a device of its own)
    resp = caller.request(method, url, **recipe(route, ids))
    assert expected(route, role)(resp.status_code), (role, method, url, resp.status_code, resp.text)
    if resp.status_code >= 400:
        assert resp.json()["code"] in ("unauthorized", "not_found")
        after = alice.get(f"/v1/processes/{pid}")
        assert after.status_code == 200 and after.json()["updated_at"] == before["updated_at"]  # untouched
    check_lists(route, role, resp, pid)


def check_lists(route: tuple[str, str], role: str, resp: httpx.Response, pid: str) -> None:
    """A list shows the caller's own items only (admins see every device)."""
    if resp.status_code != 200 or role not in ("owner", "other", "admin"):
        return
    account = {"owner": "alice", "other": "bob", "admin": "admin"}[role]
    if route == ("GET", "/v1/processes"):
        owners = {p["owner"] for p in resp.json()["processes"]}
        assert owners <= {account}
        assert (pid in [p["pid"] for p in resp.json()["processes"]]) == (role == "owner")
    elif route == ("GET", "/v1/approvals"):  # alice's process asks: in her inbox only
        assert (pid in [r["pid"] for r in resp.json()["requests"]]) == (role == "owner")
    elif route == ("GET", "/v1/approvals/audit"):  # alice's decision in her audit only
        assert {e["account"] for e in resp.json()["entries"]} <= {account}
        assert (pid in [e["pid"] for e in resp.json()["entries"]]) == (role == "owner")
    elif route == ("POST", "/v1/processes"):
        assert resp.json()["owner"] == account
    elif route == ("GET", "/v1/devices"):
        owners = {d["owner"] for d in resp.json()["devices"]}
        # (an admin's own device, issued a token by the routes above, may be listed too)
        assert owners - {"admin"} == ({"alice", "bob"} if role == "admin" else {account})
    elif route in (("GET", "/v1/me"), ("GET", "/v1/usage")):  # the caller's own account only
        assert resp.json()["account"] == account


def test_an_admin_sees_and_acts_on_another_accounts_process(clients: dict[str, httpx.Client]) -> None:
    alice, admin, bob = clients["owner"], clients["admin"], clients["other"]
    pid, request_id = owned_process(alice, asking=True)
    assert admin.get(f"/v1/processes/{pid}").json()["owner"] == "alice"
    assert [r["request_id"] for r in admin.get(f"/v1/processes/{pid}/hil").json()["requests"]] == [request_id]
    assert admin.post(f"/v1/processes/{pid}/hil/{request_id}", json={"decision": "approve"}).status_code == 200
    assert bob.get(f"/v1/processes/{pid}/events?follow=false").status_code == 404
    # the owner's log says who answered for her, and what about which call
    log = alice.get(f"/v1/processes/{pid}/events?follow=false").text
    payloads = [f["data"]["payload"] for f in parse_sse(log) if f.get("event") == "proc.changed"]
    [answered] = [p["answered"] for p in payloads if "answered" in p]
    assert answered["requestId"] == request_id and answered["decision"] == "approve"
    assert answered["by"] == "admin" and answered["name"] and answered["callId"]
