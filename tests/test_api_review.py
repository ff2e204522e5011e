"""Review findings for the ``/v1`` HTTP API and its event stream, each pinned by a test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop import Reply, call
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest
from tests import server_support
from tests.pg_support import PgServer
from tests.server_support import LiveServer, live_server, parse_sse, wait_until
from tests.test_server_api import error, spawn
from tests.ws_support import strict_json

# ------------------------------------------------------------------ NUL characters on PostgreSQL


@pytest.fixture(scope="module")
def pg_live(pg_server: PgServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The test server over a PostgreSQL store (skipped where PostgreSQL cannot run)."""
    url = pg_server.create_database()
    try:
        with live_server(tmp_path_factory.mktemp("pg-api"), store_url=url) as srv:
            yield srv
    finally:
        pg_server.drop_database(url)


@pytest.fixture
async def pg_alice(pg_live: LiveServer) -> AsyncIterator[httpx.AsyncClient]:
    async with pg_live.client(pg_live.tokens.alice) as client:
        yield client


async def test_nul_characters_answer_4xx_not_500_on_postgres(pg_alice: httpx.AsyncClient) -> None:
    """PostgreSQL's text refuses U+0000, so a NUL that reached the store failed the query: a 500
    for a pid, run id or context a client merely mistyped (SQLite stored it). The schedule and
    id cases already held; they pin the contract."""
    alice = pg_alice
    pid = await spawn(alice)
    p = f"/v1/processes/{pid}"
    for url in ("/v1/processes/%00", "/v1/processes/a%00b/events", "/v1/processes/%00/messages"):
        error(await alice.get(url), 404, "not_found")
    error(await alice.post("/v1/processes/%00/messages", json={"text": "hi"}), 404, "not_found")
    error(await alice.delete(f"{p}/schedules/%00"), 404, "not_found")
    error(await alice.delete(f"{p}/watches/%00"), 404, "not_found")
    error(await alice.post(f"{p}/hil/%00", json={"decision": "approve"}), 404, "not_found")
    error(await alice.post(f"{p}/watches", json={"source_pid": "\u0000"}), 404, "not_found")
    refused: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/processes", {"context": "be\u0000brief"}, "context"),
        ("/v1/processes", {"text": "hi", "run_id": "r\u0000"}, "run_id"),
        (f"{p}/messages", {"text": "hi", "run_id": "r\u0000"}, "run_id"),
        (f"{p}/events", {"text": "hi", "run_id": "r\u0000"}, "run_id"),
        (f"{p}/schedules", {"text": "x\u0000", "at": 4102444800}, "text"),
        (f"{p}/schedules", {"text": "x", "at": 4102444800, "name": "n\u0000"}, "name"),
    ]
    for url, body, field in refused:
        assert field in error(await alice.post(url, json=body), 400, "invalid_request"), (url, body)
    # a NUL in a message's own text is stored (inside the message's JSON) as before
    resp = await alice.post(f"{p}/messages", json={"text": "a\u0000b"})
    assert resp.status_code == 202, resp.text


# ------------------------------------------------------------------ non-finite numbers in answers


def overflowing_script(req: ModelRequest) -> Reply | str:
    """A model whose tool call has numbers JSON cannot spell, as ``json.loads`` makes of a
    provider's ``{"n": 1e999}`` or ``{"n": NaN}``."""
    last = req.messages[-1]
    if isinstance(last, UserMessage) and last.text == "overflow":
        return Reply(tool_calls=[call("echo", text="big", n=float("inf"), m=float("nan"))])
    if isinstance(last, UserMessage) and last.text == "overflow risky":  # asked about (asking_policy)
        return Reply(tool_calls=[call("echo", text="risky", n=float("-inf"))])
    return _script(req)


_script = server_support.script


async def test_non_finite_numbers_in_tool_arguments_answer_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model's ``1e999`` reached a tool call's arguments as ``inf``: ``GET …/hil`` then answered
    500 for as long as the approval was pending (Starlette's encoder refuses it), and the events
    carried ``Infinity``, live and logged, which ``JSON.parse`` refuses. History was always fine
    (messages are stored with null)."""
    monkeypatch.setattr(server_support, "script", overflowing_script)
    with live_server(tmp_path) as server:
        async with server.client(server.tokens.alice) as alice:
            pid = await spawn(alice)
            frames: list[str] = []
            async with alice.stream("GET", f"/v1/processes/{pid}/events") as resp:
                await wait_until(lambda: server.watchers(pid) > 0)
                await alice.post(f"/v1/processes/{pid}/messages", json={"text": "overflow"})
                async for line in resp.aiter_lines():
                    if line.startswith("data:"):
                        frames.append(line[5:].strip())
                        if '"proc.run.finished"' in line:
                            break
            resp = await alice.get(f"/v1/processes/{pid}/messages")
            assert resp.status_code == 200, resp.text
            calls = [
                block
                for m in strict_json(resp.text)["messages"]
                for block in m["message"]["content"]
                if block.get("type") == "toolCall"
            ]
            assert calls and calls[0]["arguments"] == {"text": "big", "n": None, "m": None}
            assert any('"proc.run.tool.started"' in data for data in frames)
            for data in frames:  # every live frame is JSON
                strict_json(data)
            logged = await alice.get(f"/v1/processes/{pid}/events", params={"follow": "false"})
            assert len(parse_sse(logged.text)) == len([f for f in frames if '"seq": null' not in f])
            for line in logged.text.splitlines():  # and so is every logged one
                if line.startswith("data:"):
                    strict_json(line[5:].strip())

            await alice.post(f"/v1/processes/{pid}/messages", json={"text": "overflow risky"})
            asked: list[Any] = []

            async def pending() -> bool:
                resp = await alice.get(f"/v1/processes/{pid}/hil")
                assert resp.status_code == 200, resp.text
                asked[:] = strict_json(resp.text)["requests"]
                return bool(asked)

            await wait_until(pending)
            assert asked[0]["args"] == {"text": "risky", "n": None}
