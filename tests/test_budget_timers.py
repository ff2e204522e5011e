"""The monthly budget holds what the kernel's timers would start for an account past it
(``kernel/budget.py``): a due schedule waits and fires once the account may spend again (here, a
larger budget), a heartbeat of that period is skipped; another account, and an admin, go on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from agentloop import ScriptedModel
from agentloop.kernel import schedules
from agentloop.kernel.budget import MonthlyBudget, gate_timers
from agentloop.models.base import ModelInfo
from agentloop.process.store import AccountRecord
from tests.process_support import kernel
from tests.test_heartbeat import ASKING, EVERY, beats, later, settings

# one answer: 10 input and 5 output tokens at $1,000,000 and $2,000,000 per million, $20 a run
PRICEY = ModelInfo(provider="scripted", id="pricey", input_cost=1_000_000, output_cost=2_000_000)


def pricey() -> ScriptedModel:
    return ScriptedModel(lambda r: "answer", info=PRICEY)


async def _spend(k: Any, owner: str, budget: MonthlyBudget) -> Any:
    """A process of ``owner``'s that has spent $20 in one run this month (checked against
    ``budget`` first, as the server checks each input: the month's spending counts from there)."""
    assert await budget.refusal(owner) is None
    proc = await k.spawn(owner=owner)
    await proc.send("spend")
    await proc.wait_idle()
    return proc


async def test_a_due_schedule_waits_while_its_account_is_past_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(schedules, "OVER_BUDGET_WAIT", 0.0)
    async with kernel(tmp_path, pricey()) as k:
        await k.scheduler.stop()  # the test runs the passes
        budget = MonthlyBudget(k, 10.0)
        gate_timers(k, budget.refusal)
        alice, bob = await _spend(k, "alice", budget), await _spend(k, "bob", budget)
        budget.dollars = 30.0  # bob spent $20 of $30; alice spends $20 more: $40
        await alice.send("more")
        await alice.wait_idle()
        for proc in (alice, bob):
            await k.schedule(proc.pid, "reminder: water the plants", at=time.time() - 1)
        await k.scheduler.fire_due()
        await bob.wait_idle()
        assert [m.text for m in await bob.messages()][-2:][0].endswith("water the plants")  # bob's went
        assert len(await alice.messages()) == 4  # alice's waits, kept
        assert len(await k.schedules(alice.pid)) == 1
        await k.scheduler.fire_due()  # looked at again: still past
        assert len(await alice.messages()) == 4

        budget.dollars = 100.0  # she may spend again
        await k.scheduler.fire_due()
        await alice.wait_idle()
        texts = [m.text for m in await alice.messages()]
        assert len(texts) == 6 and texts[4].endswith("water the plants")
        assert await k.schedules(alice.pid) == []  # fired once, and gone
        gate_timers(k, None)
        assert k.scheduler.spending is None


async def test_a_heartbeat_is_skipped_for_an_account_past_its_budget_and_not_for_an_admin(tmp_path: Path) -> None:
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    async with kernel(tmp_path, pricey(), heartbeat=settings()) as k:
        assert k.heartbeat is not None
        await k.heartbeat.stop()
        async with k.store.transaction():
            await k.store.create_account(AccountRecord("root", admin=True))
        budget = MonthlyBudget(k, 10.0)
        gate_timers(k, budget.refusal)
        alice = await _spend(k, "alice", budget)  # past her $10
        root = await _spend(k, "root", budget)  # an admin: not limited
        now = later(2)
        k.heartbeat.clock = lambda: now
        await k.heartbeat.beat_due()
        await root.wait_idle()
        assert await beats(alice) == 0 and await beats(root) == 1
        budget.dollars = 100.0
        await k.heartbeat.beat_due()  # the same period: skipped for good, not owed
        assert await beats(alice) == 0
        k.heartbeat.clock = lambda: now + EVERY  # the next period: she may spend, she gets it
        await k.heartbeat.beat_due()
        await alice.wait_idle()
        assert await beats(alice) == 1


@pytest.mark.parametrize("dollars", [0, -5.0, float("nan"), float("inf"), True, "10"])
async def test_a_budget_that_is_not_a_positive_amount_is_refused(tmp_path: Path, dollars: Any) -> None:
    async with kernel(tmp_path, pricey()) as k:
        with pytest.raises(ValueError, match="positive number of dollars"):
            MonthlyBudget(k, dollars)
