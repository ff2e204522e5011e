"""``/v1/ws`` over a real socket: connect, every process call, signals, isolation, cancellation,
error codes, the driver hand-over, shutdown, and a fuzz test that a connection survives junk.

The server is a kernel on a temporary SQLite file with a scripted model, served by uvicorn in a
background thread (``tests/ws_support.py``); the tests talk to it with the ``websockets`` client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.websockets import WebSocket

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Approval
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest
from agentloop.server import ws
from agentloop.server.auth import Principal
from agentloop.server.service import ProcessService
from tests.ws_support import KernelServer, closed_code, eventually


@tool
def echo(text: str) -> str:
    """Echo."""
    return text


@tool
async def slow(seconds: float) -> str:
    """Sleep."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


def script(req: ModelRequest) -> Reply | str:
    """``tool X`` echoes X through a tool, ``risky`` needs approval, ``sleep`` runs a long tool;
    anything else is answered directly."""
    last = req.messages[-1]
    if isinstance(last, ToolResultMessage):
        return "answer: " + last.text
    text = last.text if isinstance(last, UserMessage) else ""
    if text.startswith("tool "):
        return Reply(tool_calls=[call("echo", text=text[5:])])
    if text == "risky":
        return Reply(tool_calls=[call("echo", text="risky")])
    if text == "sleep":
        return Reply(tool_calls=[call("slow", seconds=30)])
    return "reply: " + text


async def asking_policy(process: Any, row: Any) -> Approval:
    if row.tool_name == "echo" and row.args.get("text") == "risky":
        return Approval("ask", ("destructive",), "echo of something risky", fingerprint=json.dumps(row.args))
    return Approval("auto")


def make_server(path: Path, devices: Any = None) -> KernelServer:
    return KernelServer(path, ScriptedModel(script), devices=devices, tools=[echo, slow], approval=asking_policy)


@pytest.fixture
def server(tmp_path: Path):
    with make_server(tmp_path) as s:
        yield s


class Gate:
    """Makes a ProcessService method wait until released, so a test can hold a call in flight."""

    def __init__(self, server: KernelServer) -> None:
        self.server = server
        self.event: asyncio.Event | None = None
        self.entered = 0

    def patch(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        original = getattr(ProcessService, name)
        self.event = self.server.run(self._make_event)

        async def gated(service: ProcessService, *args: Any, **kw: Any) -> Any:
            self.entered += 1
            assert self.event is not None
            await self.event.wait()
            return await original(service, *args, **kw)

        monkeypatch.setattr(ProcessService, name, gated)

    async def _make_event(self) -> asyncio.Event:
        return asyncio.Event()

    def release(self) -> None:
        assert self.event is not None
        self.server.call_soon(self.event.set)


# ------------------------------------------------------------------ connect


def test_connect_answers_who_and_calls_before_it_are_refused(server: KernelServer) -> None:
    with server.client() as c:
        assert c.error("proc.list") == "not_connected"
        assert c.error("proc.spawn") == "not_connected"
        data = c.ok("sys.connect", {"role": "user", "token": server.tokens["alice"]})
        assert data == {"account": "alice", "admin": False, "role": "user"}
        assert c.error("sys.connect", {"role": "user", "token": server.tokens["alice"]}) == "conflict"
        assert c.ok("proc.list") == {"processes": []}
    with server.client() as c:
        assert c.error("sys.connect", {"role": "boss", "token": server.tokens["alice"]}) == "invalid_request"
        assert c.ok("sys.connect", {"token": server.tokens["root"]}) == {
            "account": "root",
            "admin": True,
            "role": "user",
        }


def test_a_bearer_header_on_the_handshake_is_accepted(server: KernelServer) -> None:
    headers = {"Authorization": f"Bearer {server.tokens['bob']}"}
    with server.client(additional_headers=headers) as c:
        assert c.ok("sys.connect", {"role": "user"})["account"] == "bob"


@pytest.mark.parametrize("args", [{"role": "user", "token": "al_wrong"}, {"role": "user"}, {"token": 42}])
def test_a_bad_token_answers_unauthorized_and_closes(server: KernelServer, args: dict[str, Any]) -> None:
    with server.client() as c:
        res = c.call("sys.connect", args)
        assert not res["ok"] and res["error"]["code"] in ("unauthorized", "invalid_request")
        if res["error"]["code"] == "unauthorized":
            assert closed_code(c) == ws.CLOSE_UNAUTHORIZED


def test_a_socket_that_never_connects_is_closed(server: KernelServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ws, "CONNECT_TIMEOUT", 0.2)
    with server.client() as c:
        assert c.error("proc.list") == "not_connected"
        assert closed_code(c) == ws.CLOSE_POLICY


# ------------------------------------------------------------------ the calls


def test_every_process_call(server: KernelServer, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    with server.client("alice") as c:
        proc = c.ok("proc.spawn", {"context": "be brief", "interactive": True, "cwd": "sub"})
        pid = proc["pid"]
        assert proc["owner"] == "alice" and proc["context"] == "be brief" and proc["cwd"].endswith("sub")
        assert c.ok("proc.get", {"pid": pid}) == proc
        assert [p["pid"] for p in c.ok("proc.list")["processes"]] == [pid]

        c.ok("proc.subscribe", {"pid": pid})
        receipt = c.ok("proc.send", {"pid": pid, "text": "hello", "mode": "steer"})
        assert receipt["run_id"] and receipt["queued"] is False
        c.signals_until(pid, "proc.run.finished")
        page = c.ok("proc.history", {"pid": pid, "limit": 1})
        assert [m["message"]["role"] for m in page["messages"]] == ["assistant"] and page["next_before"]
        older = c.ok("proc.history", {"pid": pid, "before": page["next_before"]})
        assert [m["message"]["role"] for m in older["messages"]] == ["user"] and older["next_before"] is None
        assert c.ok("proc.approvals", {"pid": pid}) == {"requests": []}
        assert c.ok("proc.abort", {"pid": pid}) == {"aborted": False}
        assert c.ok("proc.stop", {"pid": pid}) == {"stopping": False}

        assert c.ok("proc.reset", {"pid": pid}) == {"pid": pid, "archived": True}
        assert c.ok("proc.history", {"pid": pid})["messages"] == []
        assert c.ok("proc.unsubscribe", {"pid": pid}) == {"pid": pid, "unsubscribed": True}
        assert c.ok("proc.unsubscribe", {"pid": pid}) == {"pid": pid, "unsubscribed": False}
        assert c.ok("proc.kill", {"pid": pid}) == {"pid": pid, "killed": True, "archived": False}
        assert c.error("proc.get", {"pid": pid}) == "not_found"
        assert c.ok("proc.list") == {"processes": []}


def test_spawn_with_a_first_message_over_the_socket(server: KernelServer) -> None:
    with server.client("alice") as c:
        made = c.ok("proc.spawn", {"text": "hello", "run_id": "ws-first"})
        assert made["run_id"] == "ws-first"
        again = c.ok("proc.send", {"pid": made["pid"], "text": "hello", "run_id": "ws-first"})
        assert again == {"run_id": "ws-first", "queued": False, "position": 0}
        assert c.ok("proc.spawn", {"text": "hello", "run_id": "ws-first"})["pid"] == made["pid"]  # a retried spawn
        assert len(c.ok("proc.list")["processes"]) == 1
        users = [m for m in c.ok("proc.history", {"pid": made["pid"]})["messages"] if m["message"]["role"] == "user"]
        assert len(users) == 1  # the retry delivered nothing


def test_arguments_are_checked_and_name_the_field(server: KernelServer) -> None:
    with server.client("alice") as c:
        pid = c.ok("proc.spawn")["pid"]
        bad: list[tuple[str, dict[str, Any], str]] = [
            ("proc.get", {}, "pid"),
            ("proc.get", {"pid": 7}, "pid"),
            ("proc.get", {"pid": "x" * 500}, "pid"),
            ("proc.spawn", {"interactive": "yes"}, "interactive"),
            ("proc.spawn", {"cwd": "../.."}, "cwd"),
            ("proc.spawn", {"text": 5}, "text"),
            ("proc.spawn", {"text": "hi", "run_id": ""}, "run_id"),
            ("proc.send", {"pid": pid}, "text"),
            ("proc.send", {"pid": pid, "text": "hi", "mode": "shout"}, "mode"),
            ("proc.send", {"pid": pid, "text": "hi", "media": [{"data": "!!", "mime_type": "image/png"}]}, "media"),
            ("proc.history", {"pid": pid, "limit": 0}, "limit"),
            ("proc.history", {"pid": pid, "limit": True}, "limit"),
            ("proc.subscribe", {"pid": pid, "after_seq": -1}, "after_seq"),
            ("proc.subscribe", {"pid": pid, "after_seq": 2**63}, "after_seq"),  # past what the store holds
            ("proc.history", {"pid": pid, "before": 2**63}, "before"),
            ("proc.schedule.add", {"pid": pid, "text": "x", "every": 10**400}, "every"),
            ("proc.mode", {"pid": pid, "mode": "silent"}, "mode"),
            ("proc.mode", {"pid": pid, "mode": 1}, "mode"),
            ("proc.hil", {"pid": pid, "request_id": "r"}, "decision"),
            ("proc.hil", {"pid": pid, "request_id": "r", "decision": "maybe"}, "decision"),
            ("request.cancel", {}, "id"),
        ]
        for name, args, field in bad:
            res = c.call(name, args)
            assert not res["ok"] and res["error"]["code"] == "invalid_request", (name, args, res)
            assert field in res["error"]["message"], (name, res)
        assert c.ok("proc.mode", {"pid": pid}) == {"pid": pid, "mode": "agent"}
        assert c.ok("proc.mode", {"pid": pid, "mode": "chat"}) == {"pid": pid, "mode": "chat"}
        assert c.ok("proc.mode", {"pid": c.ok("proc.spawn", {"mode": "chat"})["pid"]})["mode"] == "chat"
        res = c.call("proc.send", {"pid": pid, "text": "x" * 200_001})
        assert res["error"]["code"] == "too_large"
        assert c.error("proc.hil", {"pid": pid, "request_id": "nope", "decision": "approve"}) == "not_found"


def test_a_full_run_is_observed_through_sig_frames(server: KernelServer) -> None:
    with server.client("alice") as c:
        pid = c.ok("proc.spawn")["pid"]
        assert c.ok("proc.subscribe", {"pid": pid}) == {"pid": pid, "after_seq": 0}
        run_id = c.ok("proc.send", {"pid": pid, "text": "tool hello"})["run_id"]
        sigs = c.signals_until(pid, "proc.run.finished")
        names = [s["signal"] for s in sigs]
        assert names.index("proc.run.started") < names.index("proc.run.tool.started")
        assert names.index("proc.run.tool.started") < names.index("proc.run.tool.finished")
        assert names.index("proc.run.tool.finished") < names.index("proc.run.finished")
        assert "proc.run.output" in names
        finished = sigs[names.index("proc.run.finished")]
        assert finished["payload"]["status"] == "ok" and finished["payload"]["runId"] == run_id
        assert all(set(s) == {"type", "signal", "payload", "seq", "pid"} for s in sigs)
        logged = [s["seq"] for s in sigs if s["seq"] is not None]
        assert logged == sorted(logged) and len(set(logged)) == len(logged)
        messages = c.ok("proc.history", {"pid": pid})["messages"]
        assert messages[-1]["message"]["content"][0]["text"] == "answer: hello"


def test_subscribe_after_seq_sends_the_backlog_then_live_signals(server: KernelServer) -> None:
    with server.client("alice") as c:
        pid = c.ok("proc.spawn")["pid"]
        c.ok("proc.subscribe", {"pid": pid})
        c.ok("proc.send", {"pid": pid, "text": "first"})
        first = [s["seq"] for s in c.signals_until(pid, "proc.run.finished") if s["seq"] is not None]
    last = first[-1]
    with server.client("alice") as late:
        assert late.ok("proc.subscribe", {"pid": pid, "after_seq": 3}) == {"pid": pid, "after_seq": 3}
        backlog = late.signals_until(pid, "proc.run.finished")
        assert [s["seq"] for s in backlog] == [q for q in first if q > 3]
        late.ok("proc.send", {"pid": pid, "text": "second"})
        live = [s["seq"] for s in late.signals_until(pid, "proc.run.finished") if s["seq"] is not None]
        assert live[0] == last + 1 and live == sorted(live)


def test_several_subscriptions_on_one_connection_and_unsubscribe(server: KernelServer) -> None:
    with server.client("alice") as c, server.client("alice") as watcher:
        a, b = c.ok("proc.spawn")["pid"], c.ok("proc.spawn")["pid"]
        for pid in (a, b):
            c.ok("proc.subscribe", {"pid": pid})
            watcher.ok("proc.subscribe", {"pid": pid})
        c.ok("proc.send", {"pid": a, "text": "to a"})
        c.ok("proc.send", {"pid": b, "text": "to b"})
        assert c.signals_until(a, "proc.run.finished") and c.signals_until(b, "proc.run.finished")
        watcher.signals_until(a, "proc.run.finished")
        watcher.signals_until(b, "proc.run.finished")

        assert c.ok("proc.unsubscribe", {"pid": a})["unsubscribed"] is True
        c.sigs = [s for s in c.sigs if s["pid"] != a]  # (what came before the answer: a's title, say)
        c.ok("proc.send", {"pid": a, "text": "again a"})
        c.ok("proc.send", {"pid": b, "text": "again b"})
        watcher.signals_until(a, "proc.run.finished")
        c.signals_until(b, "proc.run.finished")
        c.ok("proc.list")
        assert [s for s in c.sigs if s["pid"] == a] == []


def test_approvals_over_the_socket(server: KernelServer) -> None:
    with server.client("alice") as c:
        pid = c.ok("proc.spawn")["pid"]
        c.ok("proc.subscribe", {"pid": pid})
        c.ok("proc.send", {"pid": pid, "text": "risky"})
        asked = c.signals_until(pid, "proc.run.hil.requested")[-1]["payload"]
        [pending] = c.ok("proc.approvals", {"pid": pid})["requests"]
        assert pending["request_id"] == asked["requestId"] and pending["tags"] == ["destructive"]
        answer = c.ok("proc.hil", {"pid": pid, "request_id": pending["request_id"], "decision": "approve"})
        assert answer == {"request_id": pending["request_id"], "decision": "approve", "remember": False}
        finished = c.signals_until(pid, "proc.run.finished")[-1]
        assert finished["payload"]["status"] == "ok"


def test_abort_stops_a_running_call(server: KernelServer) -> None:
    with server.client("alice") as c:
        pid = c.ok("proc.spawn")["pid"]
        c.ok("proc.subscribe", {"pid": pid})
        c.ok("proc.send", {"pid": pid, "text": "sleep"})
        c.signals_until(pid, "proc.run.tool.started")
        assert c.ok("proc.abort", {"pid": pid}) == {"aborted": True}
        assert c.signals_until(pid, "proc.run.finished")[-1]["payload"]["status"] == "aborted"


def test_another_account_cannot_see_or_touch_a_process(server: KernelServer) -> None:
    with server.client("alice") as alice, server.client("bob") as bob, server.client("root") as root:
        pid = alice.ok("proc.spawn")["pid"]
        for name, args in [
            ("proc.get", {"pid": pid}),
            ("proc.send", {"pid": pid, "text": "hi"}),
            ("proc.history", {"pid": pid}),
            ("proc.subscribe", {"pid": pid}),
            ("proc.abort", {"pid": pid}),
            ("proc.stop", {"pid": pid}),
            ("proc.approvals", {"pid": pid}),
            ("proc.hil", {"pid": pid, "request_id": "x", "decision": "deny"}),
            ("proc.reset", {"pid": pid}),
            ("proc.kill", {"pid": pid}),
        ]:
            assert bob.error(name, args) == "not_found", name
        assert bob.ok("proc.list") == {"processes": []}
        assert bob.sigs == []
        assert root.ok("proc.get", {"pid": pid})["owner"] == "alice"  # admins see everything
        assert alice.ok("proc.get", {"pid": pid})["pid"] == pid  # and nothing bob tried happened


# ------------------------------------------------------------------ concurrency and cancellation


def test_a_slow_call_does_not_block_others_and_can_be_cancelled(
    server: KernelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(server)
    gate.patch(monkeypatch, "get")
    with server.client("alice") as c:
        pid = c.ok("proc.spawn")["pid"]
        slow_id = c.request("proc.get", {"pid": pid})
        eventually(lambda: gate.entered == 1)
        assert [p["pid"] for p in c.ok("proc.list")["processes"]] == [pid]  # not stuck behind the slow call
        assert c.ok("request.cancel", {"id": slow_id}) == {"id": slow_id, "cancelled": True}
        res = c.answer(slow_id)
        assert res["ok"] is False and res["error"]["code"] == "cancelled"
        assert c.ok("request.cancel", {"id": slow_id}) == {"id": slow_id, "cancelled": False}
        assert c.ok("request.cancel", {"id": "never-sent"}) == {"id": "never-sent", "cancelled": False}
        gate.release()
        assert c.ok("proc.get", {"pid": pid})["pid"] == pid


def test_a_call_that_changes_state_runs_to_its_end_even_when_cancelled(
    server: KernelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(server)
    gate.patch(monkeypatch, "spawn")
    with server.client("alice") as c:
        rid = c.request("proc.spawn")
        eventually(lambda: gate.entered == 1)
        assert c.ok("request.cancel", {"id": rid}) == {"id": rid, "cancelled": False}
        gate.release()
        pid = c.answer(rid)["data"]["pid"]
        assert [p["pid"] for p in c.ok("proc.list")["processes"]] == [pid]


def test_in_flight_requests_are_limited_per_connection(server: KernelServer, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(server)
    gate.patch(monkeypatch, "list_processes")
    with server.client("alice") as c, server.client("alice") as other:
        held = [c.request("proc.list") for _ in range(ws.MAX_IN_FLIGHT)]
        eventually(lambda: gate.entered == ws.MAX_IN_FLIGHT)
        assert c.error("proc.list") == "too_many_requests"
        dup = c.answer(c.request("proc.list", rid=held[0]))
        assert dup["error"]["code"] == "bad_frame"  # its id is still running
        assert other.error("proc.get", {"pid": "nope"}) == "not_found"  # other connections unaffected
        assert c.ok("request.cancel", {"id": held[0]})["cancelled"] is True
        assert c.answer(held[0])["error"]["code"] == "cancelled"
        gate.release()
        assert all(c.answer(rid)["ok"] for rid in held[1:])


def test_closing_the_socket_stops_everything_it_started(server: KernelServer, monkeypatch: pytest.MonkeyPatch) -> None:
    with server.client("alice") as c:
        pids = [c.ok("proc.spawn")["pid"] for _ in range(3)]
    gate = Gate(server)
    gate.patch(monkeypatch, "history")
    with server.client("alice") as c:
        for pid in pids:
            c.ok("proc.subscribe", {"pid": pid})
            c.request("proc.history", {"pid": pid})
        eventually(lambda: gate.entered == 3)
        assert server.ws_tasks("_pump") == 3 and server.ws_tasks("_run") == 3
    eventually(lambda: server.ws_tasks() == 0)  # no stream, request or watcher outlives its socket
    assert server.run(_watchers(server, pids)) == 0


async def _watchers(server: KernelServer, pids: list[str]) -> int:
    assert server.ctx is not None
    return sum(server.ctx.kernel.engine.hub.watching(pid) for pid in pids)


# ------------------------------------------------------------------ errors


def test_bad_frames_are_answered_and_the_connection_stays_usable(server: KernelServer) -> None:
    with server.client("alice") as c:
        cases: list[tuple[Any, str | None]] = [
            ("not json", None),
            ("[1, 2]", None),
            ('"a string"', None),
            ({"type": "req", "call": "proc.list"}, None),
            ({"type": "req", "id": 5, "call": "proc.list"}, None),
            ({"type": "req", "id": "x" * 1000, "call": "proc.list"}, None),
            ({"id": "a1", "call": "proc.list"}, "a1"),
            ({"type": "res", "id": "a2", "ok": True}, "a2"),
            ({"type": "req", "id": "a3"}, "a3"),
            ({"type": "req", "id": "a4", "call": 12}, "a4"),
            ({"type": "req", "id": "a5", "call": "proc.list", "args": [1]}, "a5"),
            ({"type": "req", "id": "a6", "call": "proc.list", "args": "x"}, "a6"),
            (b"\x00\x01binary", None),
            ("[" * 100_000 + "]" * 100_000, None),
            (json.dumps({"type": "req", "id": "big", "call": "proc.list", "args": {"pad": "x" * (1 << 20)}}), "big"),
        ]
        for frame, rid in cases:
            c.send(frame)
            res = c.frame()
            assert res["type"] == "res" and res["id"] == rid and res["ok"] is False, (frame, res)
            assert res["error"]["code"] == "bad_frame"
        for rid, args in [("u1", '{"context": "\\udc00"}'), ("u2", '{"x": ["ok", {"\\ud800": 1}]}')]:
            c.send(f'{{"type": "req", "id": "{rid}", "call": "proc.spawn", "args": {args}}}')
            assert c.answer(rid)["error"]["code"] == "bad_frame"  # a lone surrogate: not storable text
        c.send('{"type": "req", "id": "u3", "call": "proc.spawn", "args": {"context": "\\ud83d\\ude00"}}')
        assert c.answer("u3")["data"]["context"] == "\U0001f600"  # a proper pair is fine
        c.ok("proc.kill", {"pid": c.ok("proc.list")["processes"][0]["pid"]})
        assert c.error("proc.explode") == "unknown_call"
        assert c.error("sys.disconnect") == "unknown_call"
        assert c.ok("proc.list") == {"processes": []}


def test_an_exception_inside_a_call_answers_internal_without_its_text(
    server: KernelServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(service: ProcessService, who: Principal) -> Any:
        raise RuntimeError("secret detail /etc/agentloop/key")

    monkeypatch.setattr(ProcessService, "list_processes", broken)
    with caplog.at_level(logging.ERROR, logger="agentloop.server"), server.client("alice") as c:
        res = c.call("proc.list")
        assert res["error"] == {"code": "internal", "message": "internal error"}
        assert c.ok("proc.spawn")["owner"] == "alice"  # the connection goes on
        eventually(lambda: any("call failed" in r.getMessage() for r in caplog.records))
    logged = next(r.getMessage() for r in caplog.records if "call failed" in r.getMessage())
    assert json.loads(logged)["call"] == "proc.list" and "secret detail" in json.loads(logged)["exception"]


# ------------------------------------------------------------------ drivers


class FakeHub:
    """Stands in for the device hub: answers sys.connect, sends one request, awaits its answer."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any], str]] = []
        self.answer: dict[str, Any] | None = None

    async def serve_driver(self, websocket: WebSocket, who: Principal, args: dict[str, Any], connect_id: str) -> None:
        self.seen.append((who.account, args, connect_id))
        await websocket.send_json({"type": "res", "id": connect_id, "ok": True, "data": {"device_id": args["name"]}})
        await websocket.send_json({"type": "req", "id": "d1", "call": "fs.read", "args": {"path": "a.txt"}})
        self.answer = await websocket.receive_json()
        await websocket.close(1000)


def test_a_driver_connection_is_handed_to_the_device_hub(tmp_path: Path) -> None:
    hub = FakeHub()
    with make_server(tmp_path, devices=hub) as server, server.client() as c:
        args = {"role": "driver", "token": server.tokens["bob"], "name": "laptop", "implements": ["fs.read"]}
        rid = c.request("sys.connect", args)
        assert c.frame() == {"type": "res", "id": rid, "ok": True, "data": {"device_id": "laptop"}}
        assert c.frame() == {"type": "req", "id": "d1", "call": "fs.read", "args": {"path": "a.txt"}}
        reply = {"type": "res", "id": "d1", "ok": True, "data": {"content": [], "is_error": False}}
        c.send(reply)
        assert closed_code(c) == 1000
        assert hub.seen == [("bob", args, rid)] and hub.answer == reply


class ParkedHub:
    """A device hub that accepts the driver and waits until its socket ends."""

    async def serve_driver(self, websocket: WebSocket, who: Principal, args: dict[str, Any], connect_id: str) -> None:
        await websocket.send_json({"type": "res", "id": connect_id, "ok": True, "data": {"device_id": args["name"]}})
        with contextlib.suppress(Exception):
            while True:
                await websocket.receive_json()


def test_revoking_a_drivers_token_closes_the_device_socket(tmp_path: Path) -> None:
    """A device lends its files and shell through the socket: it must go when its token does."""
    with make_server(tmp_path, devices=ParkedHub()) as server, server.client() as c:
        assert server.ctx is not None
        ctx = server.ctx
        ctx.heartbeat = 0.05
        token, record = server.run(lambda: ctx.accounts.create_token("bob", label="laptop"))
        assert c.ok("sys.connect", {"role": "driver", "token": token, "name": "laptop"}) == {"device_id": "laptop"}
        server.run(lambda: ctx.accounts.revoke(record.id))
        assert closed_code(c) == ws.CLOSE_UNAUTHORIZED


def test_drivers_without_a_device_hub_are_unavailable(server: KernelServer) -> None:
    with server.client() as c:
        assert c.error("sys.connect", {"role": "driver", "token": server.tokens["bob"], "name": "x"}) == "unavailable"
        assert c.ok("sys.connect", {"role": "user", "token": server.tokens["bob"]})["account"] == "bob"


def test_a_bad_driver_token_is_refused_before_the_hub_sees_it(tmp_path: Path) -> None:
    hub = FakeHub()
    with make_server(tmp_path, devices=hub) as server, server.client() as c:
        assert c.error("sys.connect", {"role": "driver", "token": "al_nope", "name": "x"}) == "unauthorized"
        assert closed_code(c) == ws.CLOSE_UNAUTHORIZED and hub.seen == []


# ------------------------------------------------------------------ shutdown


def test_stopping_the_server_closes_sockets_with_going_away(server: KernelServer) -> None:
    with server.client("alice") as c, server.client() as unconnected:
        pid = c.ok("proc.spawn")["pid"]
        c.ok("proc.subscribe", {"pid": pid})
        assert server.ctx is not None
        server.call_soon(server.ctx.stopping.set)
        assert closed_code(c) == ws.CLOSE_GOING_AWAY
        assert closed_code(unconnected) == ws.CLOSE_GOING_AWAY


def test_uvicorn_shutdown_closes_the_socket(tmp_path: Path) -> None:
    server = make_server(tmp_path).start()
    try:
        with server.client("alice") as c:
            c.ok("proc.spawn")
            server.stop()
            assert closed_code(c) is not None
    finally:
        server.stop()


# ------------------------------------------------------------------ fuzz

JSON_LEAF = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats()
    | st.text(max_size=30)  # lone surrogates included: json.dumps escapes them
)
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=15,
)
ARG_NAMES = ["pid", "text", "mode", "media", "run_id", "limit", "before", "after_seq", "id", "decision"]
ARG_NAMES += ["request_id", "context", "cwd", "interactive", "remember"]
# not sys.connect: a bad token closes the socket, by design
CALL_NAMES = [*sorted(ws.CALLS), "request.cancel", "proc.unsubscribe", "proc.nope", ""]
NEAR_VALID = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["req", "res", "sig"]) | JSON,
        "id": st.text(max_size=12) | st.text(min_size=129, max_size=3000) | JSON,
        "call": st.sampled_from(CALL_NAMES) | st.text(max_size=20) | JSON,
        "args": st.dictionaries(st.sampled_from(ARG_NAMES), JSON, max_size=5) | JSON,
    },
).map(json.dumps)
FRAMES = st.one_of(
    NEAR_VALID,
    JSON.map(json.dumps),
    st.text(st.characters(exclude_categories=("Cs",)), max_size=200),
    st.binary(max_size=200),
    st.integers(min_value=1, max_value=20_000).map(lambda n: "[" * n + "]" * n),
    st.integers(min_value=1, max_value=20_000).map(lambda n: '{"a":' * n + "1" + "}" * n),
)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory):
    with make_server(tmp_path_factory.mktemp("fuzz")) as s:
        yield s


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(FRAMES, min_size=1, max_size=8), connect_first=st.booleans())
def test_random_frames_never_break_a_connection(
    fuzz_server: KernelServer, frames: list[Any], connect_first: bool
) -> None:
    server = fuzz_server
    with server.client("alice" if connect_first else None) as c, server.client("bob") as other:
        for frame in frames:
            c.send(frame)
        if not connect_first:
            c.ok("sys.connect", {"role": "user", "token": server.tokens["alice"]})
        res = c.call("proc.list", timeout=10)
        assert res["ok"] and isinstance(res["data"]["processes"], list)
        for frame in c.answers.values():
            assert frame["type"] == "res" and isinstance(frame["ok"], bool)
            if not frame["ok"]:
                assert isinstance(frame["error"]["code"], str) and frame["error"]["code"] != "internal"
        assert other.ok("proc.list") == {"processes": []}


def test_a_request_cancelled_right_after_it_was_sent_still_answers(
    server: KernelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(server)
    gate.patch(monkeypatch, "get")
    with server.client("alice") as c:
        for i in range(20):  # back to back: the cancel may be read before the request's task first runs
            rid = c.request("proc.get", {"pid": "p"}, rid=f"slow{i}")
            cancel = c.request("request.cancel", {"id": rid})
            assert c.answer(cancel)["data"]["cancelled"] is True
            assert c.answer(rid)["error"]["code"] == "cancelled"


class BrokenHub:
    async def serve_driver(self, websocket: WebSocket, who: Principal, args: dict[str, Any], connect_id: str) -> None:
        raise RuntimeError("hub bug")


def test_a_failing_device_hub_ends_only_that_socket(tmp_path: Path) -> None:
    with make_server(tmp_path, devices=BrokenHub()) as server, server.client("alice") as user:
        with server.client() as driver:
            driver.request("sys.connect", {"role": "driver", "token": server.tokens["bob"], "name": "x"})
            assert closed_code(driver) == 1011
        assert user.ok("proc.list") == {"processes": []}


class RefusingHub:
    """Answers the connect with an error and returns, leaving the socket open (as the hub does)."""

    async def serve_driver(self, websocket: WebSocket, who: Principal, args: dict[str, Any], connect_id: str) -> None:
        error = {"code": "conflict", "message": "a device named 'x' is already connected"}
        await websocket.send_json({"type": "res", "id": connect_id, "ok": False, "error": error})


def test_a_refused_driver_gets_its_answer_and_a_clean_close(tmp_path: Path) -> None:
    with make_server(tmp_path, devices=RefusingHub()) as server, server.client() as driver:
        assert driver.error("sys.connect", {"role": "driver", "token": server.tokens["bob"], "name": "x"}) == "conflict"
        assert closed_code(driver) == 1000


def test_a_client_that_stops_reading_is_dropped(server: KernelServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A send that cannot finish (the client's buffers are full) ends the connection, so writers
    waiting on the send lock are not stuck behind it forever."""
    monkeypatch.setattr(ws, "SEND_TIMEOUT", 0.2)
    original = WebSocket.send_text

    async def stuck(self: WebSocket, data: str) -> None:
        if "stuck-here" in data:
            await asyncio.sleep(30)
        await original(self, data)

    monkeypatch.setattr(WebSocket, "send_text", stuck)
    with server.client("alice") as c:
        c.request("proc.get", {"pid": "stuck-here"})  # its not_found answer quotes the pid
        assert closed_code(c) == ws.CLOSE_POLICY
    eventually(lambda: server.ws_tasks() == 0)
    with server.client("alice") as again:
        assert again.ok("proc.list") == {"processes": []}


def test_killing_a_followed_process_ends_its_subscription(server: KernelServer) -> None:
    with server.client("alice") as c, server.client("alice") as killer:
        pid = c.ok("proc.spawn")["pid"]
        c.ok("proc.subscribe", {"pid": pid})
        eventually(lambda: server.ws_tasks("_pump") == 1)  # the subscription's stream
        killer.ok("proc.kill", {"pid": pid})
        eventually(lambda: server.ws_tasks("_pump") == 0)
        assert c.ok("proc.unsubscribe", {"pid": pid})["unsubscribed"] is False
        assert c.error("proc.subscribe", {"pid": pid}) == "not_found"


def test_revoking_the_token_closes_a_socket_opened_with_it(server: KernelServer) -> None:
    assert server.ctx is not None
    ctx = server.ctx
    ctx.heartbeat = 0.05
    token, record = server.run(lambda: ctx.accounts.create_token("alice", label="laptop"))
    with server.client() as c:
        assert c.ok("sys.connect", {"role": "user", "token": token})["account"] == "alice"
        assert c.ok("proc.list") == {"processes": []}
        server.run(lambda: ctx.accounts.revoke(record.id))
        assert closed_code(c) == ws.CLOSE_UNAUTHORIZED


def test_numbers_json_cannot_spell_reach_the_socket_as_null(tmp_path: Path) -> None:
    """A model's ``1e999`` parses to ``inf`` in a tool call's arguments: the ``sig`` frames that
    show the call are strict JSON (``Client.frame`` refuses ``Infinity``), with null in its place."""

    def brain(req: ModelRequest) -> Reply | str:
        if isinstance(req.messages[-1], UserMessage):
            return Reply(tool_calls=[call("echo", text="big", n=float("inf"))])
        return "done"

    with KernelServer(tmp_path, ScriptedModel(brain), tools=[echo]) as server, server.client("alice") as c:
        pid = c.ok("proc.spawn")["pid"]
        c.ok("proc.subscribe", {"pid": pid})
        c.ok("proc.send", {"pid": pid, "text": "go"})
        sigs = c.signals_until(pid, "proc.run.finished")
        [started] = [s for s in sigs if s["signal"] == "proc.run.tool.started"]
        assert started["payload"]["args"] == {"text": "big", "n": None}
