"""The WhatsApp channel against a real local HTTP server that speaks the Graph API's wire format,
with Meta's side played by real, signed HTTP requests to the bridge's webhook.

``FakeGraph`` is a Starlette app under uvicorn on 127.0.0.1 (its own thread and event loop): it
records each ``POST /<version>/<phone number id>/messages`` and answers as Graph does, and
failures (an HTTP status with Graph's error body) can be queued.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from typer.testing import CliRunner

from agentloop import ScriptedModel
from agentloop.channels.media import UNSUPPORTED
from agentloop.channels.whatsapp import CHAT_KEY, MAX_TEXT, WhatsAppBridge, sign
from agentloop.cli.main import app
from agentloop.kernel import Kernel
from tests.fakes.http_server import ServerThread
from tests.test_channel_telegram import FAST, brain, open_kernel, removed, until, user_texts

ACCESS_TOKEN = "EAAG-access-token-SECRET-0123456789abcdef"
APP_SECRET = "app-secret-5f4dcc3b5aa765d61d8327deb882cf99"
VERIFY_TOKEN = "verify-me-0123"
PHONE_ID = "106540352242922"
ALICE, BOB, MALLORY = "15550000001", "15550000002", "15550009999"
_wamids = itertools.count(1)  # (unique across bridges: a new one must not look like a re-delivery)


# ------------------------------------------------------------------------------- the fake Graph API


class FakeGraph:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[dict[str, Any], bool, float]] = []  # (body, answered ok, when)
        self.headers: list[dict[str, str]] = []
        self.failures: list[tuple[int, Any]] = []
        self._next = 0
        self.app = Starlette(routes=[Route("/{version}/{phone}/messages", self.handle, methods=["POST"])])
        self.server = ServerThread(self.app)
        self.url = self.server.url

    async def handle(self, request: Request) -> Response:
        body = await request.json()
        authorized = request.headers.get("authorization") == f"Bearer {ACCESS_TOKEN}"
        right = request.path_params["phone"] == PHONE_ID and request.path_params["version"] == "v21.0"
        with self.lock:
            queued = self.failures and authorized and "status" not in body  # (for messages, not read receipts)
            failure = self.failures.pop(0) if queued else None
            ok = authorized and right and failure is None
            self.calls.append((body, ok, time.monotonic()))
            self.headers.append(dict(request.headers))
            self._next += 1
            n = self._next
        if not authorized:
            return JSONResponse({"error": {"message": "Invalid OAuth access token.", "code": 190}}, 401)
        if failure is not None:
            return JSONResponse(failure[1], failure[0])
        return JSONResponse(
            {"success": True}
            if "status" in body
            else {
                "messaging_product": "whatsapp",
                "contacts": [{"wa_id": body["to"]}],
                "messages": [{"id": f"wamid.o{n}"}],
            }
        )

    def fail(self, *failures: tuple[int, Any]) -> None:
        with self.lock:
            self.failures.extend(failures)

    def sent(self, to: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [b for b, ok, _ in self.calls if ok and (to is None or b.get("to") == to)]

    def reads(self) -> list[dict[str, Any]]:
        return [b for b in self.sent() if b.get("status") == "read"]

    def texts(self, to: str) -> list[str]:
        return [b["text"]["body"] for b in self.sent(to) if b.get("type") == "text"]

    def asks(self, to: str) -> list[dict[str, Any]]:
        return [b["interactive"] for b in self.sent(to) if b.get("type") == "interactive"]


@pytest.fixture
def graph() -> Iterator[FakeGraph]:
    fake = FakeGraph()
    with fake.server:
        yield fake


# ------------------------------------------------------------------------------- Meta's side


class Meta:
    """Posts webhook notifications to the bridge, signed with the app secret."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = httpx.AsyncClient(timeout=10)

    def wamid(self) -> str:
        return f"wamid.HBgLMTU1NTAwMDAwMDEVAgASGBQz{next(_wamids):06d}=="

    async def post(self, notification: Any, *, signature: str | None = "good") -> httpx.Response:
        body = json.dumps(notification).encode()
        headers = {"content-type": "application/json"}
        if signature == "good":
            headers["x-hub-signature-256"] = sign(APP_SECRET, body)
        elif signature is not None:
            headers["x-hub-signature-256"] = signature
        return await self.client.post(self.url, content=body, headers=headers)

    async def send(self, wa_id: str, message: dict[str, Any], wamid: str | None = None) -> str:
        wamid = wamid or self.wamid()
        response = await self.post(notify({"from": wa_id, "id": wamid, "timestamp": "1700000000", **message}))
        assert response.status_code == 200, response.text
        return wamid

    async def text(self, wa_id: str, text: str, wamid: str | None = None) -> str:
        return await self.send(wa_id, {"type": "text", "text": {"body": text}}, wamid)

    async def press(self, wa_id: str, button_id: str) -> str:
        reply = {"type": "button_reply", "button_reply": {"id": button_id, "title": "x"}}
        return await self.send(wa_id, {"type": "interactive", "interactive": reply})


def notify(*messages: dict[str, Any], statuses: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    value: dict[str, Any] = {
        "messaging_product": "whatsapp",
        "metadata": {"display_phone_number": "15550001234", "phone_number_id": PHONE_ID},
        "contacts": [{"profile": {"name": "Someone"}, "wa_id": m["from"]} for m in messages],
        "messages": list(messages),
    }
    if statuses is not None:
        value["statuses"] = statuses
    return {
        "object": "whatsapp_business_account",
        "entry": [{"id": "1", "changes": [{"value": value, "field": "messages"}]}],
    }


# ------------------------------------------------------------------------------- the agent


@asynccontextmanager
async def running(
    tmp_path: Path, graph: FakeGraph, **kw: Any
) -> AsyncIterator[tuple[Kernel, WhatsAppBridge, ScriptedModel, Meta]]:
    model = kw.pop("model", None) or ScriptedModel(brain)
    async with open_kernel(tmp_path, model) as kernel:
        bridge = WhatsAppBridge(
            kernel,
            access_token=ACCESS_TOKEN,
            app_secret=APP_SECRET,
            verify_token=VERIFY_TOKEN,
            phone_number_id=PHONE_ID,
            allow=kw.pop("allow", [ALICE, BOB]),
            graph_url=graph.url,
            backoff=FAST,
            **kw,
        )
        try:
            port = await bridge.listen("127.0.0.1", 0)
            meta = Meta(f"http://127.0.0.1:{port}/whatsapp")
            try:
                yield kernel, bridge, model, meta
            finally:
                await meta.client.aclose()
        finally:
            await bridge.close()


# ------------------------------------------------------------------------------- tests


async def test_the_verification_handshake(tmp_path: Path, graph: FakeGraph) -> None:
    async with running(tmp_path, graph) as (_, _, _, meta):
        good = {"hub.mode": "subscribe", "hub.verify_token": VERIFY_TOKEN, "hub.challenge": "1158201444"}
        answer = await meta.client.get(meta.url, params=good)
        assert answer.status_code == 200 and answer.text == "1158201444"
        assert answer.headers["content-type"].startswith("text/plain")
        for bad in ({**good, "hub.verify_token": "guess"}, {**good, "hub.mode": "unsubscribe"}, {}):
            refused = await meta.client.get(meta.url, params=bad)
            assert refused.status_code == 403 and "1158201444" not in refused.text


async def test_unsigned_or_badly_signed_notifications_are_refused(tmp_path: Path, graph: FakeGraph) -> None:
    async with running(tmp_path, graph) as (kernel, _, model, meta):
        hello = notify({"from": ALICE, "id": meta.wamid(), "type": "text", "text": {"body": "hello"}})
        assert (await meta.post(hello, signature=None)).status_code == 401
        assert (await meta.post(hello, signature="sha256=" + "0" * 64)).status_code == 403
        assert (await meta.post(hello, signature=sign("another secret", json.dumps(hello).encode()))).status_code == 403
        assert (await meta.post(hello, signature="md5=abc")).status_code == 403
        await asyncio.sleep(0.2)
        assert model.requests == [] and await kernel.processes() == [] and graph.calls == []
        assert (await meta.post(hello)).status_code == 200  # the same, signed: taken
        await until(lambda: graph.texts(ALICE))


async def test_a_text_is_answered_to_its_sender_by_that_numbers_process(tmp_path: Path, graph: FakeGraph) -> None:
    async with running(tmp_path, graph) as (kernel, _, _, meta):
        hello = await meta.text(ALICE, "hello")
        hi = await meta.text(BOB, "hi there")
        await until(lambda: graph.texts(ALICE) and graph.texts(BOB))
        assert graph.texts(ALICE) == ["seen: hello"] and graph.texts(BOB) == ["seen: hi there"]
        [first] = graph.sent(ALICE)
        assert first["messaging_product"] == "whatsapp" and first["type"] == "text"
        assert {h["authorization"] for h in graph.headers} == {f"Bearer {ACCESS_TOKEN}"}
        # "typing…" on the message being answered (which also marks it read)
        assert {(r["message_id"], r["typing_indicator"]["type"]) for r in graph.reads()} == {
            (hello, "text"),
            (hi, "text"),
        }
        assert sorted(p.owner for p in await kernel.processes()) == [f"whatsapp-{ALICE}", f"whatsapp-{BOB}"]
        await meta.text(ALICE, "again")
        await until(lambda: len(graph.texts(ALICE)) == 2)
        assert graph.texts(ALICE)[1] == "seen: hello, again" and len(await kernel.processes()) == 2
        # statuses, reactions and another number's notifications are ignored; a voice message gets a notice
        status = {"id": "wamid.o1", "status": "delivered", "timestamp": "1", "recipient_id": ALICE}
        assert (await meta.post(notify(statuses=[status]))).status_code == 200
        await meta.send(ALICE, {"type": "reaction", "reaction": {"message_id": "wamid.o1", "emoji": "👍"}})
        other = notify({"from": ALICE, "id": meta.wamid(), "type": "text", "text": {"body": "elsewhere"}})
        other["entry"][0]["changes"][0]["value"]["metadata"]["phone_number_id"] = "999"
        assert (await meta.post(other)).status_code == 200
        await meta.send(ALICE, {"type": "audio", "audio": {"id": "1", "mime_type": "audio/ogg", "voice": True}})
        await until(lambda: len(graph.texts(ALICE)) == 3)
        await asyncio.sleep(0.2)
        assert graph.texts(ALICE)[2:] == [UNSUPPORTED]
        assert (await meta.post({"object": "garbage"})).status_code == 200
        assert (
            await meta.client.post(meta.url, content=b"{", headers={"x-hub-signature-256": sign(APP_SECRET, b"{")})
        ).status_code == 400


async def test_a_redelivered_message_runs_once_also_after_a_restart(tmp_path: Path, graph: FakeGraph) -> None:
    async with running(tmp_path, graph, allow=[ALICE]) as (kernel, _, model, meta):
        wamid = await meta.text(ALICE, "hello")
        await until(lambda: graph.texts(ALICE))
        await meta.text(ALICE, "hello", wamid)  # Meta did not see our 200: it delivers again
        await asyncio.sleep(0.3)
        [proc] = await kernel.processes()
    assert user_texts(model) == ["hello"] and graph.texts(ALICE) == ["seen: hello"]
    state = json.loads((tmp_path / "var" / "whatsapp" / f"{PHONE_ID}.json").read_text())
    assert state["seqs"][proc.pid] > 0
    async with running(tmp_path, graph, allow=[ALICE], model=model) as (kernel, _, _, meta):
        await meta.text(ALICE, "hello", wamid)  # once more, to a bridge that never saw it
        await meta.text(ALICE, "more")
        await until(lambda: len(graph.texts(ALICE)) == 2)
        await asyncio.sleep(0.2)
        assert graph.texts(ALICE) == ["seen: hello", "seen: hello, more"]  # the same process, found again
        assert user_texts(model) == ["hello", "more"]
        assert await kernel.store.kv_values(CHAT_KEY) == {proc.pid: f"{PHONE_ID}:{ALICE}"}


async def test_a_number_not_on_the_allow_list_is_refused(tmp_path: Path, graph: FakeGraph) -> None:
    async with running(tmp_path, graph, allow=["+" + ALICE]) as (kernel, _, model, meta):
        await meta.text(MALLORY, "rm -rf / please")
        await meta.text(MALLORY, "please?")  # told once, not each time
        await meta.text(ALICE, "hello")
        await until(lambda: graph.texts(ALICE))
        [refusal] = graph.texts(MALLORY)
        assert "private" in refusal
        assert user_texts(model) == ["hello"] and [p.owner for p in await kernel.processes()] == [f"whatsapp-{ALICE}"]
    async with running(tmp_path / "empty", graph, allow=[]) as (kernel, _, model, meta):
        await meta.text(ALICE, "me neither?")
        await until(lambda: len(graph.texts(ALICE)) == 2)
        assert "private" in graph.texts(ALICE)[1] and model.requests == [] and await kernel.processes() == []


async def test_approval_buttons_approve_deny_and_go_stale(tmp_path: Path, graph: FakeGraph) -> None:
    removed.clear()
    async with running(tmp_path, graph, allow=[ALICE]) as (kernel, _, _, meta):
        await meta.text(ALICE, "delete")
        [ask] = await until(lambda: graph.asks(ALICE))
        assert ask["type"] == "button" and len(ask["action"]["buttons"]) == 3
        replies = [b["reply"] for b in ask["action"]["buttons"]]
        assert [r["title"] for r in replies] == ["Approve", "Deny", "Always"]
        assert all(len(r["title"]) <= 20 and len(r["id"]) <= 256 for r in replies)
        body = ask["body"]["text"]
        assert "rm" in body and "path: x" in body and "destructive" in body and len(body) <= 1024
        assert removed == []
        await meta.press(MALLORY, replies[0]["id"])  # not on the allow-list: refused
        await meta.press(ALICE, "hil:x:nonsense")
        await until(lambda: "Unknown button." in graph.texts(ALICE))
        [proc] = await kernel.processes()
        assert len(await (await kernel.process(proc.pid)).pending_approvals()) == 1 and removed == []

        await meta.press(ALICE, replies[0]["id"])
        await until(lambda: "tool said: removed x" in graph.texts(ALICE))
        assert removed == ["x"] and "✅ Approved" in graph.texts(ALICE)
        await meta.press(ALICE, replies[0]["id"])  # pressed again: stale
        await until(lambda: "This request is no longer pending." in graph.texts(ALICE))

        await meta.text(ALICE, "delete")
        second = await until(lambda: graph.asks(ALICE)[1:])
        await meta.press(ALICE, second[0]["action"]["buttons"][1]["reply"]["id"])  # Deny
        await until(lambda: graph.texts(ALICE)[-1].startswith("tool said:"))
        assert removed == ["x"] and "denied" in graph.texts(ALICE)[-1] and "❌ Denied" in graph.texts(ALICE)


async def test_a_long_answer_is_split(tmp_path: Path, graph: FakeGraph) -> None:
    async with running(tmp_path, graph, allow=[ALICE]) as (_, _, _, meta):
        await meta.text(ALICE, "long 250")  # 250 lines of 50 characters: 12 749
        await until(lambda: len(graph.texts(ALICE)) >= 4)
        await asyncio.sleep(0.1)
        parts = graph.texts(ALICE)
        assert len(parts) == 4 and all(len(p) <= MAX_TEXT for p in parts)
        assert "\n".join(parts).splitlines() == [f"line {n:04d} " + "x" * 40 for n in range(250)]


async def test_429_500_and_rate_limit_codes_are_retried_other_errors_are_not(
    tmp_path: Path, graph: FakeGraph, caplog: pytest.LogCaptureFixture
) -> None:
    graph.fail(
        (429, {"error": {"message": "Too many calls", "code": 80007}}),
        (500, {"error": {"message": "An unknown error occurred", "code": 1}}),
        (400, {"error": {"message": "Spam rate limit hit", "code": 131056}}),
    )
    async with running(tmp_path, graph, allow=[ALICE]) as (_, _, _, meta):
        await meta.text(ALICE, "hello")
        await until(lambda: graph.texts(ALICE))
        texts = [b for b, _, _ in graph.calls if b.get("type") == "text"]
        assert len(texts) == 4 and graph.texts(ALICE) == ["seen: hello"]  # once, on the fourth try
        graph.fail((400, {"error": {"message": "Recipient phone number not in allowed list", "code": 131030}}))
        await meta.text(ALICE, "dropped")
        await until(lambda: "Recipient phone number not in allowed list" in caplog.text)
        await meta.text(ALICE, "next")
        await until(lambda: len(graph.texts(ALICE)) == 2)
        texts = [b for b, _, _ in graph.calls if b.get("type") == "text"]
        assert graph.texts(ALICE)[1] == "seen: hello, dropped, next" and len(texts) == 6  # no retry


async def test_secrets_never_appear_in_the_logs(
    tmp_path: Path, graph: FakeGraph, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    graph.fail((500, {"error": {"message": f"boom with {ACCESS_TOKEN} and {APP_SECRET}", "code": 2}}))
    async with running(tmp_path, graph, allow=[ALICE]) as (_, _, _, meta):
        await meta.text(ALICE, "hello")
        await meta.text(MALLORY, "hello")
        await meta.post(
            notify({"from": ALICE, "id": meta.wamid(), "type": "text", "text": {"body": "x"}}), signature="sha256=00"
        )
        await meta.client.get(
            meta.url, params={"hub.mode": "subscribe", "hub.verify_token": "nope", "hub.challenge": "1"}
        )
        await until(lambda: graph.texts(ALICE) and graph.texts(MALLORY))
    from agentloop.channels.graph import GraphApi, GraphError

    down = GraphApi(ACCESS_TOKEN, PHONE_ID, graph_url="http://127.0.0.1:9", backoff=(0.01, 0.01), secrets=(APP_SECRET,))
    with pytest.raises(GraphError) as failed:
        await down.send({"to": ALICE, "type": "text", "text": {"body": "x"}}, attempts=2)
    await down.close()
    assert failed.value.transient and ACCESS_TOKEN not in str(failed.value)
    text = "\n".join(r.getMessage() for r in caplog.records) + caplog.text
    assert "HTTP Request: POST" in text and "boom with ***" in text and "wrong signature" in text
    assert "network error" in text and MALLORY in text
    for secret in (ACCESS_TOKEN, APP_SECRET, VERIFY_TOKEN):
        assert secret not in text


# ------------------------------------------------------------------------------- the command

runner = CliRunner()
ENV = {
    "WHATSAPP_ACCESS_TOKEN": ACCESS_TOKEN,
    "WHATSAPP_APP_SECRET": APP_SECRET,
    "WHATSAPP_VERIFY_TOKEN": VERIFY_TOKEN,
    "WHATSAPP_PHONE_NUMBER_ID": PHONE_ID,
}


@pytest.fixture
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG", "AGENTLOOP_DATA", "AGENTLOOP_STORE", *ENV):
        monkeypatch.delenv(name, raising=False)


def test_the_command_refuses_to_start_without_its_secrets_or_an_allow_list(
    tmp_path: Path, cli_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = []
    for name in ENV:
        for other, value in ENV.items():
            if other == name:
                monkeypatch.delenv(other, raising=False)
            else:
                monkeypatch.setenv(other, value)
        result = runner.invoke(app, ["whatsapp", "--allow", ALICE])
        assert result.exit_code == 2 and f"set {name} " in result.stderr, result.stderr
        results.append(result)
    monkeypatch.setenv("WHATSAPP_PHONE_NUMBER_ID", PHONE_ID)
    no_allow = runner.invoke(app, ["whatsapp"])
    assert no_allow.exit_code == 2 and "no WhatsApp number is allowed" in no_allow.stderr
    bad = runner.invoke(app, ["whatsapp", "--allow", "alice"])
    assert bad.exit_code == 2 and "digits only" in bad.stderr
    for result in (*results, no_allow, bad):
        assert "Traceback" not in result.stderr
        assert all(secret not in result.stderr + result.stdout for secret in ENV.values() if secret != PHONE_ID)
    assert not (tmp_path / "xdg" / "agentloop").exists()  # refused before anything was opened


def test_the_command_serves_the_webhook_and_stops_cleanly_on_sigterm(
    tmp_path: Path, graph: FakeGraph, cli_env: None
) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps(["hello from the agent"]))
    (tmp_path / "ws").mkdir()
    command = [sys.executable, "-m", "agentloop.cli.main", "whatsapp", "--allow", ALICE, "--port", "0"]
    command += ["--graph-url", graph.url, "--data", str(tmp_path / "data"), "-w", str(tmp_path / "ws")]
    command += ["--model", f"scripted:{script}"]
    proc = subprocess.Popen(
        command, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "agentloop whatsapp: webhook on http://127.0.0.1:" in line, line
        url = line.split("webhook on ", 1)[1].split(" ", 1)[0]
        body = json.dumps(notify({"from": ALICE, "id": "wamid.cli1", "type": "text", "text": {"body": "hi"}})).encode()
        answer = httpx.post(url, content=body, headers={"x-hub-signature-256": sign(APP_SECRET, body)})
        assert answer.status_code == 200
        deadline = time.monotonic() + 15
        while not graph.texts(ALICE) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert graph.texts(ALICE) == ["hello from the agent"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "allowed numbers: " + ALICE in line and ACCESS_TOKEN not in out + err + line and APP_SECRET not in err
