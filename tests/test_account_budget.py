"""A monthly budget per account (``agentloop serve --account-budget``, ``ServerContext.limit_spending``):
once an account has spent it this calendar month (UTC, catalog prices, runs that ended), new input
that would start runs (a first message, a send, an event) is refused with 402 ``budget_spent``,
naming what was spent; reads still work, admins are not limited, and another account is not
touched. The month's spending is what the account spent since the first check in the month."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentloop import ScriptedModel
from agentloop.models.base import ModelInfo
from tests.server_support import LiveServer

# one answer costs 10 input and 5 output tokens (ScriptedModel's defaults) at $1,000,000 and
# $2,000,000 per million: $10 + $10 = $20 a run
PRICEY = ModelInfo(provider="scripted", id="pricey", input_cost=1_000_000, output_cost=2_000_000)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    srv = LiveServer(tmp_path, model=ScriptedModel(lambda r: "answer", info=PRICEY)).start()
    assert srv.ctx is not None
    srv.ctx.limit_spending(30.0)
    yield srv
    srv.stop()


def _idle(client: httpx.Client, pid: str) -> None:
    for _ in range(500):
        if client.get(f"/v1/processes/{pid}").json()["run_id"] is None:
            return
        time.sleep(0.02)
    raise AssertionError("the run did not end")


def test_input_is_refused_once_the_months_budget_is_spent(server: LiveServer) -> None:
    def client(token: str) -> httpx.Client:
        return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"})

    with client(server.tokens.alice) as alice, client(server.tokens.bob) as bob, client(server.tokens.admin) as admin:
        made = alice.post("/v1/processes", json={"text": "one", "run_id": "r-one"})  # $20 of $30
        pid = made.json()["pid"]
        _idle(alice, pid)
        sent = alice.post(f"/v1/processes/{pid}/messages", json={"text": "two", "run_id": "r-two"})
        assert sent.status_code in (200, 202)
        _idle(alice, pid)  # $40 now: past the budget
        # a retry of input admitted already (its answer lost) gets its first receipt, not 402
        again = alice.post(f"/v1/processes/{pid}/messages", json={"text": "two", "run_id": "r-two"})
        assert again.status_code in (200, 202) and again.json() == sent.json(), again.text
        respawned = alice.post("/v1/processes", json={"text": "one", "run_id": "r-one"})
        assert respawned.status_code in (200, 201) and respawned.json()["pid"] == pid, respawned.text
        refused = alice.post(f"/v1/processes/{pid}/messages", json={"text": "three"})
        assert refused.status_code == 402, refused.text
        body = refused.json()
        assert body["code"] == "budget_spent" and "$40.00 of its $30.00" in body["message"]
        assert alice.post("/v1/processes", json={"text": "new"}).status_code == 402
        assert alice.post(f"/v1/processes/{pid}/events", json={"text": "event"}).status_code == 402
        assert alice.post("/v1/processes", json={}).status_code == 201  # no input: nothing to spend
        assert alice.get(f"/v1/processes/{pid}/messages").status_code == 200  # reading still works
        texts = [
            m["message"]["content"][0]["text"] for m in alice.get(f"/v1/processes/{pid}/messages").json()["messages"]
        ]
        assert texts == ["one", "answer", "two", "answer"]  # nothing of the refused input was kept
        other = bob.post("/v1/processes", json={"text": "hello"})  # another account's budget is its own
        assert other.status_code == 201
        assert admin.post("/v1/processes", json={"text": "hello"}).status_code == 201
        server.ctx.limit_spending(None)  # type: ignore[union-attr]  # no budget: no check
        assert alice.post(f"/v1/processes/{pid}/messages", json={"text": "four"}).status_code in (200, 202)


def test_a_budget_that_is_not_a_positive_amount_is_refused_at_the_command_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from agentloop.cli.main import app

    result = CliRunner().invoke(app, ["serve", "--data", str(tmp_path / "d"), "--account-budget", "0"])
    assert result.exit_code == 2 and "--account-budget" in result.output
    assert not (tmp_path / "d").exists()
