"""Review of the server as an integrator meets it: the WebSocket's argument checking and the order
of a subscription and its undoing, sent back to back."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentloop import ScriptedModel
from agentloop.client import AgentloopClient
from agentloop.server import ws
from tests.ws_support import Client, KernelServer, eventually


@pytest.fixture
def server(tmp_path: Path) -> Iterator[KernelServer]:
    with KernelServer(tmp_path, ScriptedModel(lambda req: "ok", keep_requests=False)) as s:
        yield s


def _run_once(c: Client, pid: str) -> None:
    """Start a run on ``pid`` and wait (over the same socket) until it has ended."""
    c.ok("proc.send", {"pid": pid, "text": "hello"})
    eventually(lambda: c.ok("proc.get", {"pid": pid})["run_id"] is None)
    c.ok("proc.list")  # one more round trip: every frame sent before its answer has been read


# ------------------------------------------------------------------ unknown arguments


def test_an_unknown_argument_is_refused_as_http_refuses_an_unknown_field(server: KernelServer) -> None:
    """HTTP refuses ``{"runid": ...}`` so that a misspelt ``run_id`` cannot turn a retry into a
    second message; the socket, documented as taking the same arguments, ignored it and delivered
    the message again under a fresh run id."""
    with server.client("alice") as c:
        pid = c.ok("proc.spawn")["pid"]
        for call, args, field in [
            ("proc.send", {"pid": pid, "text": "hi", "runid": "r-1"}, "runid"),
            ("proc.signal", {"pid": pid, "text": "hi", "run_ID": "r-2"}, "run_ID"),
            ("proc.spawn", {"txt": "hi"}, "txt"),
            ("proc.fork", {"pid": pid, "forkid": "f"}, "forkid"),
            ("proc.history", {"pid": pid, "limt": 5}, "limt"),
            ("proc.unsubscribe", {"pid": pid, "all": True}, "all"),
            ("request.cancel", {"id": "x", "force": True}, "force"),
            (
                "proc.send",
                {"pid": pid, "text": "hi", "media": [{"data": "aGk=", "mime_type": "text/plain", "nme": "a"}]},
                "nme",
            ),
        ]:
            res = c.call(call, args)
            assert not res["ok"] and res["error"]["code"] == "invalid_request", (call, res)
            assert field in res["error"]["message"], (call, res)
        assert c.ok("proc.history", {"pid": pid})["messages"] == []  # nothing was delivered
        assert [p["pid"] for p in c.ok("proc.list")["processes"]] == [pid]  # nor spawned
        # every call still takes every argument it documents
        assert c.ok("proc.send", {"pid": pid, "text": "hi", "mode": "steer", "run_id": "r-3"})["run_id"] == "r-3"


def test_every_call_declares_the_arguments_it_takes() -> None:
    assert set(ws.CALLS) | set(ws._INLINE) >= {"proc.spawn", "request.cancel", "proc.unsubscribe"}
    for name, call in {**ws.CALLS, **ws._INLINE}.items():
        assert isinstance(call.args, frozenset), name


# ------------------------------------------------------------------ subscribe, then unsubscribe at once


def test_an_unsubscribe_sent_right_after_a_subscribe_undoes_it(server: KernelServer) -> None:
    """A client that follows a process and stops at once (a view opened and closed, pipelined
    without waiting) got ``unsubscribed: false`` while the subscription was still being set up,
    which then started: the process's signals kept coming after the answer that said none would."""
    with server.client("alice") as c:
        pid = c.ok("proc.spawn")["pid"]
        for _ in range(3):
            sub = c.request("proc.subscribe", {"pid": pid})
            unsub = c.request("proc.unsubscribe", {"pid": pid})
            assert c.answer(sub)["ok"]
            assert c.answer(unsub)["data"] == {"pid": pid, "unsubscribed": True}
        c.sigs.clear()
        _run_once(c, pid)
        assert [s["signal"] for s in c.sigs if s["pid"] == pid] == []


def test_an_account_unsubscribe_sent_right_after_its_subscribe_undoes_it(server: KernelServer) -> None:
    with server.client("alice") as c:
        pid = c.ok("proc.spawn")["pid"]
        sub = c.request("account.subscribe")
        unsub = c.request("account.unsubscribe")
        assert c.answer(sub)["ok"]
        assert c.answer(unsub)["data"] == {"account": "alice", "unsubscribed": True}
        c.sigs.clear()
        _run_once(c, pid)
        assert [s["signal"] for s in c.sigs] == []


def test_a_subscription_still_follows_when_nothing_undid_it(server: KernelServer) -> None:
    with server.client("alice") as c:
        pid = c.ok("proc.spawn")["pid"]
        other = c.ok("proc.spawn")["pid"]
        sub = c.request("proc.subscribe", {"pid": pid})
        unsub = c.request("proc.unsubscribe", {"pid": other})  # another process's: no effect on pid's
        assert c.answer(sub)["ok"]
        assert c.answer(unsub)["data"] == {"pid": other, "unsubscribed": False}
        _run_once(c, pid)
        assert "proc.run.finished" in [s["signal"] for s in c.sigs if s["pid"] == pid]


# ------------------------------------------------------------------ the Python client


async def test_the_client_spawns_and_forks_with_every_documented_field(server: KernelServer) -> None:
    """``spawn`` could not say ``mode`` or ``media`` and ``fork`` could not say ``context``,
    though the server documents and takes them: a client user had to fall back to raw HTTP."""
    base = server.url.replace("ws://", "http://").removesuffix("/v1/ws")
    async with AgentloopClient(base, server.tokens["alice"]) as client:
        doc = {"data": base64.b64encode(b"a note").decode(), "mime_type": "text/plain", "name": "note.txt"}
        proc = await client.spawn(mode="chat", text="read this", media=[doc], run_id="first")
        pid = proc["pid"]
        assert proc["run_id"] == "first"
        assert await client.mode(pid) == "chat"
        await _idle(client, pid)
        first = (await client.history(pid))["messages"][0]["message"]
        assert [block["type"] for block in first["content"]] == ["text", "file"]
        fork = await client.fork(pid, context="a branch", fork_id="b1")
        assert fork["context"] == "a branch" and fork["forked_from"]["pid"] == pid
        assert (await client.fork(pid, context="a branch", fork_id="b1"))["pid"] == fork["pid"]


async def _idle(client: AgentloopClient, pid: str) -> None:
    for _ in range(500):
        if (await client.process(pid))["run_id"] is None:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the run did not end")


# ------------------------------------------------------------------ output schemas no answer can meet


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}},  # a reference to nothing
        {"type": "object", "properties": {"a": {"$ref": "#/properties/b"}}},
        {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},  # a loop that never reaches the value
        {"type": "object", "allOf": [{"$ref": "#"}]},
        {
            "$defs": {"a": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/b"}]}, "b": {"not": {"$ref": "#/$defs/a"}}},
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/a"}},
        },
    ],
)
def test_an_output_schema_no_answer_could_be_checked_against_is_refused(
    server: KernelServer, schema: dict[str, object]
) -> None:
    """Such a schema was accepted (202) and stored with the input; checking the model's
    ``final_result`` against it then failed every time (a reference to nothing, or a recursion
    without end), so the run could only finish ``output_missing``. The docs promise a 400 for a
    schema that is not valid, and nothing delivered."""
    with server.client("alice") as c:
        pid = c.ok("proc.spawn")["pid"]
        res = c.call("proc.send", {"pid": pid, "text": "go", "output_schema": schema})
        assert not res["ok"] and res["error"]["code"] == "invalid_request", res
        assert "output_schema" in res["error"]["message"]
        assert c.ok("proc.history", {"pid": pid})["messages"] == []


def test_recursive_output_schemas_that_descend_into_the_value_are_still_taken(server: KernelServer) -> None:
    tree = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
    }
    nested = {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"$ref": "#"}]}}
    pointer = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"$ref": "#/properties/a"}}}
    listed = {
        "type": "object",
        "properties": {"p": {"prefixItems": [{"type": "string"}]}, "q": {"$ref": "#/properties/p/prefixItems/0"}},
    }
    with server.client("alice") as c:
        for schema in (tree, nested, pointer, listed):
            pid = c.ok("proc.spawn")["pid"]
            assert c.ok("proc.send", {"pid": pid, "text": "go", "output_schema": schema})["run_id"]
