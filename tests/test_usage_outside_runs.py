"""Usage spent outside any run: the title a model writes (``titles="model"``) and the memories a
reset keeps are model calls made in background tasks, outside the durable runner's transactions.
They count in the process's totals (tokens and cost, no run), added as increments
(``Store.add_usage``), so a run of the same process ending meanwhile loses nothing of them, nor
they of it, on SQLite and on PostgreSQL, where the two transactions really interleave."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel
from agentloop.kernel import Kernel, Process
from agentloop.kernel.titles import TITLE_PROMPT
from agentloop.messages import Usage, UserMessage
from agentloop.models.base import ModelInfo, ModelRequest
from agentloop.process.compaction import MEMORY_SYSTEM_PROMPT
from agentloop.process.store import ProcessRecord, Store, UsageTotals
from agentloop.process.store.common import usage_columns
from tests.store_conformance.test_conformance import make_store, store  # noqa: F401

PRICED = ModelInfo(provider="scripted", id="priced", context_window=1_000_000, input_cost=3.0, output_cost=15.0)
RUN = (50, 5)  # what each run's one model call spends
TITLE = (30, 3)  # the title's call
MEMORY = (70, 7)  # the reset's memory extraction


def cost(*calls: tuple[int, int]) -> Any:
    return pytest.approx(sum((3.0 * i + 15.0 * o) / 1_000_000 for i, o in calls))


def totals(*calls: tuple[int, int], runs: int) -> UsageTotals:
    i, o = sum(c[0] for c in calls), sum(c[1] for c in calls)
    return UsageTotals(i, o, i + o, cost(*calls), runs)


class Gates:
    """A model whose title call and whose "wait" run can be held until released."""

    def __init__(self) -> None:
        self.title = asyncio.Event()
        self.title.set()
        self.title_asked = asyncio.Event()
        self.run = asyncio.Event()
        self.run.set()
        self.run_asked = asyncio.Event()

    async def brain(self, req: ModelRequest) -> Reply:
        if req.system_prompt == TITLE_PROMPT:
            self.title_asked.set()
            await self.title.wait()
            return Reply(text="Cats and dogs", input_tokens=TITLE[0], output_tokens=TITLE[1])
        if req.system_prompt == MEMORY_SYSTEM_PROMPT:
            return Reply(
                text="<memories>\n- The cat is Miso.\n</memories>", input_tokens=MEMORY[0], output_tokens=MEMORY[1]
            )
        last = req.messages[-1]
        if isinstance(last, UserMessage) and last.text == "wait":
            self.run_asked.set()
            await self.run.wait()
        return Reply(text="ok", input_tokens=RUN[0], output_tokens=RUN[1])

    def model(self) -> ScriptedModel:
        return ScriptedModel(self.brain, info=PRICED)


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/agentloop.db"
    return str(request.getfixturevalue("pg_url"))


def kernel(url: str, tmp_path: Path, model: ScriptedModel, **kw: Any) -> Any:
    return Kernel.open(url, model=model, workspace=tmp_path, tools=[], **kw)


async def titled(k: Kernel) -> None:
    async with asyncio.timeout(10):
        while k.titles.busy:
            await asyncio.sleep(0.01)


async def remembered(k: Kernel) -> None:
    async with asyncio.timeout(10):
        await asyncio.gather(*k._remembering)


async def run(proc: Process, text: str) -> None:
    await proc.send(text)
    await proc.wait_idle()


# ---------------------------------------------------------------------------------- the stores


async def test_add_usage_adds_without_a_run_and_ignores_a_missing_process(store: Store) -> None:  # noqa: F811
    async with store.transaction():
        await store.create_process(ProcessRecord(pid="p1", owner="alice", run_as="alice", cwd="/"))
    assert await store.add_usage("p1", UsageTotals(10, 2, 12, 0.5, 0))
    assert await store.add_usage("p1", UsageTotals(1, 1, 2, 0.25, 0))
    got = await store.get_process("p1")
    assert got is not None and got.usage == UsageTotals(11, 3, 14, 0.75, 0)
    assert not await store.add_usage("nobody", UsageTotals(1, 1, 2, 0.25, 0))
    assert await store.get_process("nobody") is None
    # a process that spent only outside runs still leaves its cost to its account when deleted
    async with store.transaction():
        await store.delete_process("p1")
    assert await store.account_usage("alice") == UsageTotals(11, 3, 14, 0.75, 0)
    assert not await store.add_usage("p1", UsageTotals(1, 1, 2, 0.25, 0))  # killed: not counted
    assert await store.account_usage("alice") == UsageTotals(11, 3, 14, 0.75, 0)


async def test_usage_added_is_an_increment_beside_other_fields(store: Store) -> None:  # noqa: F811
    async with store.transaction():
        await store.create_process(ProcessRecord(pid="p1", owner="alice", run_as="alice", cwd="/"))
    async with store.transaction():
        await store.update_process("p1", **usage_columns(UsageTotals(100, 10, 110, 1.0, 2)))
    async with store.transaction():  # twice in one transaction, with the run's other fields
        await store.update_process("p1", state="running", current_run={"run_id": "r"})
        await store.update_process("p1", state="idle", current_run=None, usage_added=UsageTotals(5, 1, 6, 0.5, 1))
        await store.update_process("p1", usage_added=UsageTotals(1, 1, 2, 0.25, 0))
    got = await store.get_process("p1")
    assert got is not None and got.state == "idle" and got.current_run is None
    assert got.usage == UsageTotals(106, 12, 118, 1.75, 3)
    async with store.transaction():  # a total set in the same transaction: the addition joins it
        await store.update_process("p1", usage_added=UsageTotals(1, 1, 2, 0.25, 0))
        await store.update_process("p1", **usage_columns(UsageTotals(7, 7, 14, 2.0, 4)))
        await store.update_process("p1", usage_added=UsageTotals(1, 0, 1, 0.5, 1))
    got = await store.get_process("p1")
    assert got is not None and got.usage == UsageTotals(8, 7, 15, 2.5, 5)


async def test_a_run_end_held_open_and_a_concurrent_addition_both_count(
    make_store: Callable[[], Store],  # noqa: F811
) -> None:
    """Two stores on one database (two workers): one holds a run's end open, with its increment
    written, while the other adds a title's usage; whichever way the commits fall, both count."""
    engine_side, background = make_store(), make_store()
    await engine_side.open()
    await background.open()
    try:
        async with engine_side.transaction():
            await engine_side.create_process(ProcessRecord(pid="p1", owner="alice", run_as="alice", cwd="/"))
            await engine_side.update_process("p1", **usage_columns(UsageTotals(100, 10, 110, 1.0, 1)))
        tx = engine_side.transaction()
        await tx.begin()
        await engine_side.update_process(
            "p1", state="idle", current_run=None, usage_added=UsageTotals(50, 5, 55, 0.5, 1)
        )
        await engine_side.get_process("p1")  # (SQLite: the pending UPDATE is written, the lock taken)
        adding = asyncio.create_task(background.add_usage("p1", UsageTotals(30, 3, 33, 0.25, 0)))
        await asyncio.sleep(0.2)
        assert not adding.done()  # it waits for the run's end (the row's lock, or the write lock)
        pending = tx.end(commit=True)
        if pending is not None:
            await pending
        assert await asyncio.wait_for(adding, 10)
        for s in (engine_side, background):
            got = await s.get_process("p1")
            assert got is not None and got.usage == UsageTotals(180, 18, 198, 1.75, 2)
    finally:
        await engine_side.close()
        await background.close()


# ---------------------------------------------------------------------------------- the kernel


async def test_a_model_title_is_counted_without_a_run_and_survives_a_restart(url: str, tmp_path: Path) -> None:
    gates = Gates()
    async with kernel(url, tmp_path, gates.model(), titles="model") as k:
        proc = await k.spawn(owner="alice")
        await run(proc, "my cat is called Miso")
        await titled(k)
        assert await proc.title() == "Cats and dogs"
        info = await proc.info()
        assert info.usage == totals(RUN, TITLE, runs=1)
        live = k.engine.cached(proc.pid)
        # the worker's cache follows (on PostgreSQL an idle process may be let go of already)
        assert live is None or live.record.usage == info.usage
        assert live is not None or not url.startswith("sqlite")
        assert await k.usage("alice") == totals(RUN, TITLE, runs=1)
        pid = proc.pid
    async with kernel(url, tmp_path, gates.model(), titles="model") as k:
        proc = await k.process(pid)
        assert (await proc.info()).usage == totals(RUN, TITLE, runs=1)
        await run(proc, "again")  # a later run adds to it
        assert (await proc.info()).usage == totals(RUN, TITLE, RUN, runs=2)


async def test_a_title_counted_while_a_run_is_active_loses_nothing(url: str, tmp_path: Path) -> None:
    """The title's answer arrives while the process's next run is under way: its usage is added
    mid-run, and the run's end, written afterwards, adds to it rather than over it."""
    gates = Gates()
    gates.title.clear()
    async with kernel(url, tmp_path, gates.model(), titles="model") as k:
        proc = await k.spawn(owner="alice")
        await run(proc, "my cat is called Miso")
        async with asyncio.timeout(10):
            await gates.title_asked.wait()
        gates.run.clear()
        await proc.send("wait")
        async with asyncio.timeout(10):
            await gates.run_asked.wait()  # the second run is active, its model call in flight
        gates.title.set()
        await titled(k)
        assert (await proc.info()).usage == totals(RUN, TITLE, runs=1)  # counted at once, mid-run
        gates.run.set()
        await proc.wait_idle()
        info = await proc.info()
        assert info.usage == totals(RUN, TITLE, RUN, runs=2)
        live = k.engine.cached(proc.pid)
        assert live is None or live.record.usage == info.usage
        assert live is not None or not url.startswith("sqlite")
        pid = proc.pid
    async with kernel(url, tmp_path, gates.model(), titles="model") as k:
        assert (await (await k.process(pid)).info()).usage == totals(RUN, TITLE, RUN, runs=2)


async def test_a_resets_memories_are_counted_without_a_run(url: str, tmp_path: Path) -> None:
    gates = Gates()
    async with kernel(url, tmp_path, gates.model(), titles=None) as k:
        proc = await k.spawn(owner="alice")
        await run(proc, "my cat is called Miso")
        await proc.reset()
        await remembered(k)
        info = await proc.info()
        assert info.usage == totals(RUN, MEMORY, runs=1)
        live = k.engine.cached(proc.pid)
        assert live is None or live.record.usage == info.usage
        await run(proc, "again")
        assert (await proc.info()).usage == totals(RUN, MEMORY, RUN, runs=2)
        pid = proc.pid
    async with kernel(url, tmp_path, gates.model(), titles=None) as k:
        proc = await k.process(pid)
        assert (await proc.info()).usage == totals(RUN, MEMORY, RUN, runs=2)
        await proc.kill()
        assert await k.usage("alice") == totals(RUN, MEMORY, RUN, runs=2)  # the account keeps it all


async def test_a_call_answered_after_the_kill_is_not_counted(tmp_path: Path) -> None:
    gates = Gates()
    async with kernel(f"sqlite:///{tmp_path}/agentloop.db", tmp_path, gates.model(), titles=None) as k:
        proc = await k.spawn(owner="alice")
        await run(proc, "hi")
        await proc.kill()
        assert not await k.engine.add_usage(proc.pid, _usage(TITLE))
        assert await k.usage("alice") == totals(RUN, runs=1)


def _usage(call: tuple[int, int]) -> Usage:
    usage = Usage(input=call[0], output=call[1], total_tokens=sum(call))
    usage.cost.total = (3.0 * call[0] + 15.0 * call[1]) / 1_000_000
    return usage
