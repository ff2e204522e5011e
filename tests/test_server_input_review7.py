"""Review of the server against hostile input: a refused request costs nothing and an accepted
one is never lost. Each test failed before its fix."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import httpx
import pytest

from agentloop import ScriptedModel
from agentloop.server.ratelimit import InputRate
from tests.ws_support import KernelServer, eventually


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelServer]:
    model = ScriptedModel(lambda req: "ok", keep_requests=False)
    with KernelServer(tmp_path_factory.mktemp("input-review7"), model) as s:
        yield s


def _http(server: KernelServer, account: str) -> httpx.Client:
    base = server.url.replace("ws://", "http://").removesuffix("/v1/ws")
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {server.tokens[account]}"}, timeout=5)


def _user_texts(messages: list[dict[str, object]]) -> list[str]:
    texts = []
    for m in messages:
        message = m["message"]
        assert isinstance(message, dict)
        if message["role"] == "user":
            texts.append(message["content"][0]["text"])
    return texts


# ------------------------------------------------------------------ a close right after a send


def test_a_message_sent_right_before_the_socket_closes_is_delivered(server: KernelServer) -> None:
    """A call that changes state runs to its end "also if its socket closes"; but it started only
    when its task first ran, and a close read right after the frame cancelled that task before it
    ran: a client that sent a message (or spawned) and hung up at once lost it, unanswered and
    undelivered, most of the time."""
    with server.client("alice") as c:
        pid = c.ok("proc.spawn")["pid"]
        before = len(c.ok("proc.list")["processes"])
        sent = [f"parting words {i}" for i in range(5)]
        for text in sent:
            quick = server.client("alice")
            quick.request("proc.send", {"pid": pid, "text": text, "mode": "queue"})
            quick.close()
        quick = server.client("alice")
        quick.request("proc.spawn", {"text": "a last spawn"})
        quick.close()
        eventually(lambda: sorted(_user_texts(c.ok("proc.history", {"pid": pid})["messages"])) == sent)
        eventually(lambda: len(c.ok("proc.list")["processes"]) == before + 1)


# ------------------------------------------------------------------ the input rate


def test_a_refused_input_does_not_use_up_the_accounts_input_rate(server: KernelServer) -> None:
    """The rate slot of a message was taken before its media was checked (a "text" document with
    NUL bytes, a "PDF" without the PDF header, found only as it is stored) and before the process
    quota (checked in the spawn's commit): requests answered 400 and 409 each cost the account an
    input, so its next good message, and even its next bad one, answered 429."""
    assert server.ctx is not None
    ctx, nul_text = server.ctx, base64.b64encode(b"a\x00b").decode()
    saved = ctx.inputs, ctx.max_inputs_per_minute, ctx.max_processes
    ctx.inputs, ctx.max_inputs_per_minute = InputRate(), 2
    try:
        with server.client("bob") as c, _http(server, "bob") as http:
            pid = c.ok("proc.spawn")["pid"]
            not_text = [{"data": nul_text, "mime_type": "text/plain"}]
            not_pdf = [{"data": base64.b64encode(b"plain words").decode(), "mime_type": "application/pdf"}]
            for media in (not_text, not_pdf, not_text):
                res = c.call("proc.send", {"pid": pid, "text": "see attached", "media": media})
                assert not res["ok"] and res["error"]["code"] == "invalid_request", res
            resp = http.post("/v1/processes", json={"text": "see attached", "media": not_pdf})
            assert resp.status_code == 400 and "PDF" in resp.json()["message"], resp.text
            ctx.max_processes = len(c.ok("proc.list")["processes"])
            resp = http.post("/v1/processes", json={"text": "one too many"})
            assert resp.status_code == 409 and resp.json()["code"] == "conflict", resp.text
            ctx.max_processes = saved[2]
            # nothing was stored, and the two inputs of the minute are still the account's
            assert c.ok("proc.history", {"pid": pid})["messages"] == []
            assert c.ok("proc.send", {"pid": pid, "text": "first", "mode": "queue"})["run_id"]
            assert c.ok("proc.signal", {"pid": pid, "text": "second"})["run_id"]
            assert c.error("proc.send", {"pid": pid, "text": "third"}) == "rate_limited"  # the limit still holds
    finally:
        ctx.inputs, ctx.max_inputs_per_minute, ctx.max_processes = saved


def test_a_malformed_engine_chat_request_does_not_use_up_the_input_rate(server: KernelServer) -> None:
    """``POST /engine/chat`` counted against the account's input rate when its token was checked,
    before its body was: malformed requests (400, no run) used it up, and the next good one
    answered 429."""
    assert server.ctx is not None
    ctx = server.ctx
    saved = ctx.inputs, ctx.max_inputs_per_minute
    ctx.inputs, ctx.max_inputs_per_minute = InputRate(), 1
    good = {"messages": [{"role": "user", "content": "hi"}], "metadata": {"correlation_id": "c-1"}}
    try:
        with _http(server, "bob") as http:
            not_text = {**good, "messages": [{"role": "user", "content": 1}]}
            for bad in ({"messages": []}, {"messages": "hi", "metadata": {}}, not_text):
                resp = http.post("/engine/chat", json=bad)
                assert resp.status_code == 400 and resp.json()["code"] == "invalid_request", resp.text
            resp = http.post("/engine/chat", json=good)
            assert resp.status_code == 200 and "event: done" in resp.text, resp.text
            resp = http.post("/engine/chat", json=good)  # the one input of the minute is spent now
            assert resp.status_code == 429 and resp.json()["code"] == "rate_limited", resp.text
    finally:
        ctx.inputs, ctx.max_inputs_per_minute = saved


# ------------------------------------------------------------------ bad frames


def test_a_frame_whose_id_is_not_valid_unicode_is_refused_with_a_null_id(server: KernelServer) -> None:
    """A frame with a lone surrogate escape is refused as ``bad_frame``; when the escape was in
    the id, the refusal echoed it back, so the answer to a bad frame was itself text that strict
    JSON parsers refuse (a client could not read why). An id that cannot be read is null."""
    with server.client("alice") as c:
        for rid in ("\\ud800", "x\\udfff", "\\ud800\\ud800"):
            c.send('{"type": "req", "id": "' + rid + '", "call": "proc.list"}')  # the escapes as sent
            raw = c.ws.recv(5)
            assert isinstance(raw, str) and "\\ud" not in raw.lower(), raw
            frame = json.loads(raw)
            assert frame["id"] is None and frame["error"]["code"] == "bad_frame", frame
        # a readable id next to a bad value is still echoed, and the connection serves on
        c.send('{"type": "req", "id": "ok-1", "call": "proc.list", "args": {"x": "\\udc00"}}')
        assert json.loads(c.ws.recv(5))["id"] == "ok-1"
        assert "processes" in c.ok("proc.list")


# ------------------------------------------------------------------ deeply nested output schemas


def _nested(levels: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_deeply_nested_output_schema_is_a_400_and_delivers_nothing(server: KernelServer) -> None:
    """A schema nested 150 levels deep is a few KiB, well within the 64 KiB limit, but checking it
    ran out of stack (RecursionError): HTTP answered 500 and the socket ``internal``."""
    with server.client("alice") as c, _http(server, "alice") as http:
        pid = c.ok("proc.spawn")["pid"]
        processes = len(c.ok("proc.list")["processes"])
        deep = _nested(150)
        resp = http.post(f"/v1/processes/{pid}/messages", json={"text": "hi", "output_schema": deep})
        assert resp.status_code == 400 and "output_schema" in resp.json()["message"], resp.text
        resp = http.post("/v1/processes", json={"text": "hi", "output_schema": deep})
        assert resp.status_code == 400 and "output_schema" in resp.json()["message"], resp.text
        res = c.call("proc.send", {"pid": pid, "text": "hi", "output_schema": deep})
        assert not res["ok"] and res["error"]["code"] == "invalid_request", res
        assert "output_schema" in res["error"]["message"]
        assert c.ok("proc.history", {"pid": pid})["messages"] == []
        assert len(c.ok("proc.list")["processes"]) == processes  # nor spawned
        # a schema of an ordinary depth is still taken
        assert c.ok("proc.send", {"pid": pid, "text": "hi", "mode": "queue", "output_schema": _nested(8)})["run_id"]
