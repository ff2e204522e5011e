"""End to end on PostgreSQL: ``agentloop serve --store postgresql://…`` (and ``AGENTLOOP_STORE``)
runs its processes on the shared database while the data directory keeps only files; two servers
on one database serve each other's processes (DESIGN §6)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")

from agentloop.process.store import open_store
from tests.fakes.openai_server import OpenAIFake, text_reply
from tests.test_e2e_server import Served, follow_run, free_port, http, until


@pytest.fixture(scope="module")
def fake() -> Iterator[OpenAIFake]:
    with OpenAIFake() as server:
        yield server


def start(tmp: Path, fake: OpenAIFake, store: str, monkeypatch: pytest.MonkeyPatch) -> Served:
    workspace = tmp / "ws"
    workspace.mkdir(exist_ok=True)
    monkeypatch.setenv("AGENTLOOP_STORE", store)  # Served passes the environment on
    return Served(tmp / "data", workspace, fake, free_port()).start()


def stored_history(url: str, pid: str) -> list[str]:
    async def read() -> list[str]:
        store = open_store(url)
        await store.open()
        try:
            return [m.message.role for m in await store.history(pid)]
        finally:
            await store.close()

    return asyncio.run(read())


def test_serve_runs_on_postgresql(
    pg_url: str, tmp_path: Path, fake: OpenAIFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.reset()
    fake.push(text_reply("hello from postgres"))
    served = start(tmp_path, fake, pg_url, monkeypatch)
    try:
        with http(served) as client:
            pid = client.post("/v1/processes", json={}).json()["pid"]
            sent = client.post(f"/v1/processes/{pid}/messages", json={"text": "hi"})
            assert sent.status_code == 202
            frames = follow_run(client, pid, sent.json()["run_id"])
        assert frames[-1]["data"]["payload"]["status"] == "ok"
    finally:
        served.stop()
    assert stored_history(pg_url, pid) == ["user", "assistant"]  # in the database …
    assert not (tmp_path / "data" / "agentloop.db").exists()  # … and not in a private SQLite file


def test_a_bad_store_url_is_a_usage_error(tmp_path: Path, fake: OpenAIFake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTLOOP_STORE", "mysql://nobody@nowhere/db")
    served = Served(tmp_path / "data", tmp_path, fake, free_port())
    with pytest.raises(AssertionError, match=r"exited with 2.*AGENTLOOP_STORE: store must start with"):
        served.start()


def test_two_servers_share_one_database(
    pg_url: str, tmp_path: Path, fake: OpenAIFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process created on one server is talked to through the other, and both see its runs."""
    fake.reset()
    for i in range(4):
        fake.push(text_reply(f"reply {i}"))
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = start(tmp_path / "one", fake, pg_url, monkeypatch)
    token = one.token  # printed by the first server only: the accounts are the database's
    two = start(tmp_path / "two", fake, pg_url, monkeypatch)
    try:
        with http(one) as a, http(two, token) as b:
            pid = a.post("/v1/processes", json={}).json()["pid"]
            first = b.post(f"/v1/processes/{pid}/messages", json={"text": "via two"}).json()["run_id"]
            frames = follow_run(a, pid, first)  # followed on the other server
            assert frames[-1]["data"]["payload"]["status"] == "ok"
            second = a.post(f"/v1/processes/{pid}/messages", json={"text": "via one"}).json()["run_id"]
            frames = follow_run(b, pid, second)
            assert frames[-1]["data"]["payload"]["status"] == "ok"
            until(lambda: len(b.get(f"/v1/processes/{pid}/messages").json()["messages"]) == 4, "four messages")
    finally:
        one.stop()
        two.stop()
    assert stored_history(pg_url, pid) == ["user", "assistant", "user", "assistant"]
