"""Four limits of the WhatsApp bridge, lifted: the access token is checked at start; the ids of
the commands handled survive a restart (so Meta's re-delivery of a ``/new`` does not reset again);
a kept message that keeps failing is given up after ``INBOX_ATTEMPTS``; a signed notification
nested too deep is a 400, not a 500.

Runs against the fakes of ``test_channel_whatsapp`` (the Graph API, Meta's signed requests)."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from typer.testing import CliRunner

from agentloop import ScriptedModel
from agentloop.channels import whatsapp
from agentloop.channels.graph import CredentialsRefused
from agentloop.channels.whatsapp import GIVEN_UP, WhatsAppBridge, sign
from agentloop.cli.main import app
from agentloop.kernel import Kernel, Process
from agentloop.process.store.base import StoreError
from tests.test_channel_telegram import FAST, brain, open_kernel
from tests.test_channel_whatsapp import (
    ACCESS_TOKEN,
    ALICE,
    APP_SECRET,
    ENV,
    PHONE_ID,
    VERIFY_TOKEN,
    FakeGraph,
    cli_env,  # noqa: F401 (a fixture)
    notify,
    running,
    until,
    user_texts,
)
from tests.test_cli_chat_durable import model as scripted_model

OTHER_PHONE = "999000111222333"  # a phone number id Graph does not know


class CheckedGraph(FakeGraph):
    """The fake Graph API, also answering the start-up check as Graph does: 401 (code 190) for a
    token it does not take, 400 (code 100, subcode 33) for an id that names nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.checks: list[str | None] = []  # the Authorization of each check
        route = Route("/{version}/{phone}/whatsapp_business_profile", self.profile, methods=["GET"])
        self.app.router.routes.append(route)

    async def profile(self, request: Request) -> Response:
        authorization = request.headers.get("authorization")
        with self.lock:
            self.checks.append(authorization)
        if authorization != f"Bearer {ACCESS_TOKEN}":
            error = {"message": "Invalid OAuth access token.", "type": "OAuthException", "code": 190}
            return JSONResponse({"error": error}, 401)
        if request.path_params["phone"] != PHONE_ID:
            message = f"Unsupported get request. Object with ID '{request.path_params['phone']}' does not exist"
            return JSONResponse({"error": {"message": message, "code": 100, "error_subcode": 33}}, 400)
        return JSONResponse({"data": [{"about": "hi", "messaging_product": "whatsapp"}]})


@pytest.fixture
def graph() -> Iterator[CheckedGraph]:
    fake = CheckedGraph()
    with fake.server:
        yield fake


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(whatsapp, "CLOSE_GRACE", 0.3)


def bridge(kernel: Kernel, graph_url: str, **kw: Any) -> WhatsAppBridge:
    settings: dict[str, Any] = {"access_token": ACCESS_TOKEN, "phone_number_id": PHONE_ID, **kw}
    return WhatsAppBridge(
        kernel,
        app_secret=APP_SECRET,
        verify_token=VERIFY_TOKEN,
        allow=[ALICE],
        graph_url=graph_url,
        backoff=FAST,
        **settings,
    )


def text(wamid: str, body: str) -> dict[str, Any]:
    return {"from": ALICE, "id": wamid, "timestamp": "1700000000", "type": "text", "text": {"body": body}}


def state_file(tmp_path: Path) -> Path:
    return tmp_path / "var" / "whatsapp" / f"{PHONE_ID}.json"


# ------------------------------------------------------------------------------- 1. the token at start


async def test_a_refused_token_or_an_unknown_number_id_fails_the_start_and_says_which(
    tmp_path: Path, graph: CheckedGraph, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "EAAG-wrong-token-SECRET-9876543210"
    async with open_kernel(tmp_path, ScriptedModel(brain)) as kernel:
        refused = bridge(kernel, graph.url, access_token=wrong)
        with pytest.raises(CredentialsRefused, match="the access token was refused") as token_error:
            await refused.listen("127.0.0.1", 0)
        assert refused.port is None  # (not serving)
        unknown = bridge(kernel, graph.url, phone_number_id=OTHER_PHONE)
        with pytest.raises(CredentialsRefused, match=f"does not know the phone number id {OTHER_PHONE}"):
            await unknown.start()
        async with bridge(kernel, graph.url) as good:  # (the right ones start)
            assert good._started
    assert graph.checks == [f"Bearer {wrong}", f"Bearer {ACCESS_TOKEN}", f"Bearer {ACCESS_TOKEN}"]
    assert wrong not in str(token_error.value) + caplog.text and ACCESS_TOKEN not in caplog.text


async def test_graph_out_of_reach_at_start_is_a_warning_and_the_bridge_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as closed:  # (a port nothing listens on: connection refused)
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    async with open_kernel(tmp_path, ScriptedModel(brain)) as kernel, bridge(kernel, url) as started:
        assert started._started
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("start-up check failed: network error" in w and "not checked" in w for w in warnings), warnings
    assert ACCESS_TOKEN not in caplog.text


def test_the_command_says_the_token_was_refused_in_one_line(
    tmp_path: Path,
    graph: CheckedGraph,
    cli_env: None,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WHATSAPP_ACCESS_TOKEN", "EAAG-revoked-SECRET-000")
    scripted_model("wa-token", ["never"])
    where = ["-w", str(tmp_path), "--data", str(tmp_path / "data"), "--graph-url", graph.url]
    result = CliRunner().invoke(app, ["whatsapp", "--allow", ALICE, "--port", "0", "-m", "wa-token:x", *where])
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "the access token was refused" in result.stderr, result.stderr
    assert "EAAG-revoked-SECRET-000" not in result.stderr + result.stdout


# ------------------------------------------------------------------------------- 2. commands handled


async def test_a_new_redelivered_after_a_restart_does_not_reset_again(tmp_path: Path, graph: CheckedGraph) -> None:
    model = ScriptedModel(brain)
    async with running(tmp_path, graph, allow=[ALICE], model=model) as (_, _, _, meta):
        await meta.text(ALICE, "hello")
        await until(lambda: graph.texts(ALICE) == ["seen: hello"])
        new = await meta.text(ALICE, "/new")
        await meta.text(ALICE, "again")
        await until(lambda: len(graph.texts(ALICE)) == 3)
    assert json.loads(state_file(tmp_path).read_text())["handled"] == [new]  # (the texts: not written)
    async with running(tmp_path, graph, allow=[ALICE], model=model) as (_, _, _, meta):
        await meta.text(ALICE, "/new", new)  # Meta did not see the 200 before the restart
        await meta.text(ALICE, "more")
        await until(lambda: len(graph.texts(ALICE)) >= 4)
    assert graph.texts(ALICE) == ["seen: hello", "Started a new conversation.", "seen: again", "seen: again, more"]


async def test_the_ids_kept_are_bounded(tmp_path: Path, graph: CheckedGraph, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(whatsapp, "HANDLED", 3)
    async with running(tmp_path, graph, allow=[ALICE]) as (_, _, _, meta):
        helps = [await meta.text(ALICE, "/help") for _ in range(5)]
        await until(lambda: len(graph.texts(ALICE)) == 5)
    assert json.loads(state_file(tmp_path).read_text())["handled"] == helps[-3:]
    state = whatsapp.WhatsAppState(state_file(tmp_path))
    state.load()
    assert state.handled == helps[-3:]


# ------------------------------------------------------------------------------- 3. a message that always fails


async def test_a_kept_message_that_always_fails_is_given_up_once_and_the_rest_flows(
    tmp_path: Path, graph: CheckedGraph, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    send = Process.send
    tries: list[str] = []

    async def poisoned(self: Process, body: str, *args: Any, **kw: Any) -> Any:
        if body == "poison":
            tries.append(body)
            raise StoreError("cannot hold this one")
        return await send(self, body, *args, **kw)

    monkeypatch.setattr(Process, "send", poisoned)
    state_file(tmp_path).parent.mkdir(parents=True)
    state_file(tmp_path).write_text(json.dumps({"offset": 0, "seqs": {}, "inbox": [text("wamid.poison", "poison")]}))
    async with running(tmp_path, graph, allow=[ALICE]) as (_, _, model, meta):
        await until(lambda: GIVEN_UP in graph.texts(ALICE))
        await until(lambda: "inbox" not in json.loads(state_file(tmp_path).read_text()))
        await meta.text(ALICE, "hello")
        await until(lambda: "seen: hello" in graph.texts(ALICE))
        # (tried for at least INBOX_PATIENCE longest backoffs, FAST's 0.2 s here)
        assert len(tries) >= whatsapp.INBOX_ATTEMPTS
    assert graph.texts(ALICE) == [GIVEN_UP, "seen: hello"] and user_texts(model) == ["hello"]
    assert f"wamid.poison from 15550000001 failed {len(tries)} times: it is given up" in caplog.text


async def test_a_store_outage_that_fails_kept_messages_many_times_loses_none(
    tmp_path: Path, graph: CheckedGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More failures in a row than ``INBOX_ATTEMPTS``, all within the patience: nothing given up."""
    send = Process.send
    tries: list[str] = []

    async def down_for_a_while(self: Process, body: str, *args: Any, **kw: Any) -> Any:
        if len(tries) < whatsapp.INBOX_ATTEMPTS + 2:
            tries.append(body)
            raise StoreError("the database is restarting")
        return await send(self, body, *args, **kw)

    monkeypatch.setattr(Process, "send", down_for_a_while)
    state_file(tmp_path).parent.mkdir(parents=True)
    state_file(tmp_path).write_text(json.dumps({"offset": 0, "seqs": {}, "inbox": [text("wamid.kept", "kept")]}))
    async with running(tmp_path, graph, allow=[ALICE]) as (_, _, model, _meta):
        await until(lambda: "seen: kept" in graph.texts(ALICE))
    assert len(tries) == whatsapp.INBOX_ATTEMPTS + 2
    assert graph.texts(ALICE) == ["seen: kept"] and user_texts(model) == ["kept"]


# ------------------------------------------------------------------------------- 4. too deep


async def test_a_signed_notification_nested_too_deep_is_a_400(tmp_path: Path, graph: CheckedGraph) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000  # past Python's recursion limit
    nested: Any = "x"
    for _ in range(whatsapp.MAX_DEPTH + 1):
        nested = {"a": nested}
    deeper = json.dumps(notify({**text("wamid.deep", "hi"), "extra": nested})).encode()
    async with running(tmp_path, graph, allow=[ALICE]) as (_, _, _, meta):
        for body in (deep, deeper):
            headers = {"x-hub-signature-256": sign(APP_SECRET, body), "content-type": "application/json"}
            answer = await meta.client.post(meta.url, content=body, headers=headers)
            assert answer.status_code == 400 and answer.text == "nested too deep"
        await meta.text(ALICE, "hello")  # (and the bridge goes on)
        await until(lambda: graph.texts(ALICE) == ["seen: hello"])
