"""DESIGN §3 (durable processes) and §6 (scale-out) guarantees that no other test pinned: each
test here fails if the guarantee its docstring states breaks."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Approval, Kernel
from agentloop.messages import AssistantMessage, UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process import engine as engine_module
from agentloop.process import signals as sig
from agentloop.process.approval import KNOWN_TAGS
from agentloop.process.prompt import PromptSources, assemble_prompt
from agentloop.process.store import SQLiteStore, StoreError, ToolCallRow
from tests.process_support import assert_valid, echo, gated, kernel, ran


async def _until(check: Any, seconds: float = 10.0) -> None:
    """Wait until the async predicate ``check`` holds (or fail after ``seconds``)."""
    for _ in range(int(seconds / 0.01)):
        if await check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


async def _finished(proc: Any) -> list[dict[str, Any]]:
    return [s.payload async for s in proc.signals(follow=False) if s.signal == sig.RUN_FINISHED]


# -- the tables --------------------------------------------------------------------------------------


async def test_the_store_has_every_table_of_a_process_and_the_lease_row(tmp_path: Path) -> None:
    """A process is a registry row plus its own tables (messages, pending tool calls, the input
    queue, pending approvals, key-value rows, the per-process numbered event log), and a lease
    is a row with an owner, an expiry and a fencing epoch; SQLite has the same tables."""
    store = SQLiteStore(tmp_path / "a.db")
    await store.open()
    await store.close()
    db = sqlite3.connect(tmp_path / "a.db")
    try:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        columns = {t: [c[1] for c in db.execute(f"PRAGMA table_info({t})")] for t in tables}
        keys = {
            t: [c[1] for c in sorted(db.execute(f"PRAGMA table_info({t})"), key=lambda c: c[5]) if c[5]] for t in tables
        }
    finally:
        db.close()
    wanted = {"processes", "messages", "pending_tool_calls", "message_queue", "pending_hil", "process_kv", "events"}
    assert wanted | {"process_leases"} <= tables
    assert keys["events"] == ["pid", "seq"]  # a sequence number per process
    assert {"owner", "epoch", "expires"} <= set(columns["process_leases"])
    assert {"status", "deadline", "result"} <= set(columns["pending_tool_calls"])  # status machine, durable deadline


# -- runs and ticks ----------------------------------------------------------------------------------


async def test_a_model_answer_that_outlives_its_aborted_run_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step is keyed by its run and generation: the answer of a model call that ignored the
    abort's cancellation and came back after the run ended is stale, so it is dropped. It neither
    enters the history nor brings the ended run back to life (nor starts the tools it asked for)."""
    monkeypatch.setattr(engine_module, "ABORT_GRACE", 0.2)
    ran.clear()
    asked, release = asyncio.Event(), asyncio.Event()
    answers = 0

    async def brain(req: ModelRequest) -> Reply | str:
        nonlocal answers
        answers += 1
        if answers == 1:
            asked.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:  # a provider client that will not be stopped
                await release.wait()
            return Reply(text="stale", tool_calls=[call("echo", text="stale")])
        return "fresh"

    async with kernel(tmp_path, ScriptedModel(brain)) as k:
        proc = await k.spawn(owner="a")
        run = await proc.send("question")
        await asyncio.wait_for(asked.wait(), 5)
        assert await asyncio.wait_for(proc.abort(), 5)
        release.set()  # the stale answer arrives now
        await asyncio.sleep(0.3)
        assert (await proc.info()).current_run is None  # the run stays over
        assert ran == [] and await k.store.calls(proc.pid) == []
        assert not [m for m in await proc.messages() if m.text == "stale"]
        await proc.send("again")
        await proc.wait_idle()
        msgs = await proc.messages()
        assert msgs[-1].text == "fresh" and ran == []
        assert_valid(msgs)
        statuses = [(f["runId"], f["status"]) for f in await _finished(proc)]
        assert len(statuses) == 2 and statuses[0] == (run.run_id, "aborted")  # one end, no revival


async def test_tool_calls_are_registered_in_the_commit_of_the_assistant_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calls an assistant message makes are registered in the same transaction that stores
    the message: when registering them fails, the message is not stored either (no history with
    calls that have no rows, which nothing would ever run or answer), and no tool starts."""
    ran.clear()
    model = ScriptedModel(
        lambda r: Reply(tool_calls=[call("echo", text="x")]) if isinstance(r.messages[-1], UserMessage) else "done"
    )
    async with kernel(tmp_path, model) as k:
        real = k.store.register_calls
        failures: list[int] = []

        async def failing(rows: list[ToolCallRow]) -> None:
            if not failures:
                failures.append(len(rows))
                raise StoreError("disk full")
            await real(rows)

        monkeypatch.setattr(k.store, "register_calls", failing)
        proc = await k.spawn(owner="a")
        await proc.send("first")
        await asyncio.wait_for(proc.wait_idle(), 10)
        msgs = await proc.messages()
        assert failures == [1] and ran == []
        assert not [m for m in msgs if isinstance(m, AssistantMessage) and m.tool_calls]  # rolled back with the rows
        assert_valid(msgs)
        assert (await _finished(proc))[-1]["status"] == "error"
        await proc.send("second")  # the process goes on
        await proc.wait_idle()
        assert ran == ["x"] and (await proc.messages())[-1].text == "done"


async def test_a_batch_moves_through_the_status_machine(tmp_path: Path) -> None:
    """Each call of a batch is a row moving registered → dispatched → completed | failed |
    cancelled | denied: a running call is dispatched, then completed; a policy refusal is denied;
    the call asked about stays registered until answered (a person's no: denied); a call still
    waiting its turn when the user speaks is cancelled. Only when every call is terminal does the
    batch enter the history, in the model's order, and its rows go."""
    gate = asyncio.Event()

    @tool
    async def work() -> str:
        """Work until the test lets it finish."""
        await gate.wait()
        return "worked"

    async def policy(process: Any, row: Any) -> Approval:
        if row.args.get("text") == "refused":
            return Approval("deny", (), "not this one")
        if row.args.get("text") == "asked":
            return Approval("ask", ("destructive",), "ask first", fingerprint="asked")
        return Approval("auto")

    def brain(r: ModelRequest) -> Reply | str:
        if isinstance(r.messages[-1], UserMessage) and r.messages[-1].text == "go":
            return Reply(
                tool_calls=[
                    call("work"),
                    call("echo", text="refused"),
                    call("echo", text="asked"),
                    call("echo", text="later"),
                ]
            )
        return "done"

    async with kernel(tmp_path, ScriptedModel(brain), tools=[work, echo], approval=policy) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")

        async def statuses() -> list[str]:
            return [r.status for r in sorted(await k.store.calls(proc.pid), key=lambda r: r.position)]

        await _until(lambda: _equals(statuses, ["dispatched", "denied", "registered", "registered"]))
        [pending] = await proc.pending_approvals()
        await proc.send("never mind the rest")  # (steer) the call still waiting its turn is now stale
        gate.set()
        await _until(lambda: _equals(statuses, ["completed", "denied", "registered", "cancelled"]))
        assert (await proc.info()).current_run is not None  # not every call is terminal: the run waits
        assert len([m for m in await proc.messages() if isinstance(m, ToolResultMessage)]) == 0
        await proc.hil(pending.request_id, "deny")
        await proc.wait_idle()
        msgs = await proc.messages()
        assert await k.store.calls(proc.pid) == []
        results = [m.text for m in msgs if isinstance(m, ToolResultMessage)]
        assert results[0] == "worked" and results[1].startswith("Tool execution denied by policy")
        assert results[2] == "Tool execution denied by user" and "skipped" in results[3].lower()
        assert_valid(msgs)


async def _equals(get: Any, want: list[str]) -> bool:
    return bool(await get() == want)


# -- input while a run is active -------------------------------------------------------------------


async def test_input_sent_without_a_mode_steers_the_active_run(tmp_path: Path) -> None:
    """``steer`` is the default mode: input sent during a run without a mode joins that run (its
    receipt names it), and reaches the model at the next tool-result boundary."""
    model = ScriptedModel([Reply(tool_calls=[call("slow", seconds=0.3)]), "after"])
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        first = await proc.send("start")
        await asyncio.sleep(0.05)
        steered = await proc.send("also this")
        assert steered.queued and steered.run_id == first.run_id
        await proc.wait_idle()
        assert [m.role for m in model.requests[1].messages] == ["user", "assistant", "toolResult", "user"]
        assert model.requests[1].messages[-1].text == "also this"
        assert len(await _finished(proc)) == 1


async def test_steer_input_left_when_the_run_is_aborted_starts_the_next_run(tmp_path: Path) -> None:
    """A steer that never reached a tool-result boundary (the run was aborted first) is not lost
    with the run: it starts the next run, answered there."""
    model = ScriptedModel(
        lambda r: Reply(tool_calls=[call("slow", seconds=30)]) if r.messages[-1].text == "start" else "answered"
    )
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        first = await proc.send("start")
        await asyncio.sleep(0.05)
        await proc.send("and this", mode="steer")
        assert await proc.abort()
        await proc.wait_idle()
        finished = await _finished(proc)
        assert [f["status"] for f in finished] == ["aborted", "ok"] and finished[0]["runId"] == first.run_id
        msgs = await proc.messages()
        assert [m.text for m in msgs if isinstance(m, UserMessage)] == ["start", "and this"]
        assert msgs[-1].text == "answered"


# -- approval ------------------------------------------------------------------------------------------


async def test_remember_is_a_rule_of_the_process_only(tmp_path: Path) -> None:
    """``remember`` adds a process-local allow rule: the process that was answered stops asking
    for that call, while another process of the same account still asks."""
    ran.clear()
    policy = {"default": "auto", "rules": [{"match": "tool.echo", "action": "ask"}]}
    model = ScriptedModel(
        lambda r: "ok" if isinstance(r.messages[-1], ToolResultMessage) else Reply(tool_calls=[call("echo", text="x")])
    )
    async with kernel(tmp_path, model, policy=policy) as k:
        first = await k.spawn(owner="alice")
        other = await k.spawn(owner="alice")
        await first.send("go")
        await _until(first.pending_approvals)
        [pending] = await first.pending_approvals()
        await first.hil(pending.request_id, "approve", remember=True)
        await first.wait_idle()
        await first.send("again")
        await first.wait_idle()
        assert ran == ["x", "x"] and await first.pending_approvals() == []  # remembered here
        # … for calls with no risk beyond what the person saw (this one had none)
        [rule] = await k.store.kv_get(first.pid, "approval_overrides")
        assert rule["when"] == {"noTag": sorted(KNOWN_TAGS)} and rule["match"] == "tool.echo"
        await other.send("go")
        await _until(other.pending_approvals)  # … but not for the account's other process
        assert ran == ["x", "x"]
        await other.abort()


# -- prompt assembly -----------------------------------------------------------------------------------


def test_the_default_context_budget_is_32_kib(tmp_path: Path) -> None:
    """The run-as account's ``~/context.d`` is read within ``max_context_bytes``, 32 KiB unless
    configured: a file of exactly 32 KiB fits whole, one byte more is truncated."""
    home = tmp_path / "agent"
    (home / "context.d").mkdir(parents=True)
    note = home / "context.d" / "notes.md"
    note.write_text("a" * (32 * 1024 - 1) + "Z")
    whole = assemble_prompt(PromptSources(agent_home=home))
    assert "Z" in whole.text and not whole.warnings
    note.write_text("a" * (32 * 1024) + "Z")
    cut = assemble_prompt(PromptSources(agent_home=home))
    assert "Z" not in cut.text and any("max_context_bytes=32768" in w for w in cut.warnings)


# -- scale-out -----------------------------------------------------------------------------------------


async def test_lost_notifications_only_delay_steer_approval_and_abort_until_the_next_poll(
    pg_url: str, tmp_path: Path
) -> None:
    """Wake-ups between workers go by LISTEN/NOTIFY with a polling fallback: when every
    notification of the worker without the lease is lost, the steer, the approval and the abort
    it forwards still reach the holder, at its next poll, instead of being stranded."""
    pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")
    gate = asyncio.Event()
    wait_gate, rm, brain, policy = gated(gate)

    def worker(name: str) -> Kernel:
        return Kernel.open(
            pg_url,
            model=ScriptedModel(brain),
            tools=[wait_gate, rm],
            approval=policy,
            workspace=tmp_path,
            data_dir=tmp_path,
            worker=name,
            lease_ttl=2.0,
            poll_interval=0.2,
        )

    async with worker("A") as a, worker("B") as b:
        pa = await a.spawn(owner="alice")
        leases = a.engine.leases
        assert leases is not None
        leases.idle = lambda pid: None  # type: ignore[method-assign]  # A keeps the process between runs
        await asyncio.gather(*leases._background, return_exceptions=True)
        assert await leases.hold(pa.pid)
        lost: list[str] = []

        async def dropped(pid: str, sender: str) -> None:
            lost.append(pid)

        b.store.notify = dropped  # type: ignore[method-assign]  # every wake-up B sends is lost
        pb = await b.process(pa.pid)

        run = await pa.send("gate")
        steered = await pb.send("and this too")
        assert steered.queued and steered.run_id == run.run_id
        gate.set()

        async def answered() -> bool:
            return bool((await pa.messages())[-1].text == "seen: gate, and this too")

        await _until(answered)

        gate.clear()
        stuck = await pa.send("gate")
        assert await asyncio.wait_for(pb.abort(), 10) is True
        end = (await _finished(pa))[-1]
        assert (end["runId"], end["status"]) == (stuck.run_id, "aborted")

        await pa.send("delete")
        await _until(pb.pending_approvals)
        [pending] = await pb.pending_approvals()
        assert await pb.hil(pending.request_id, "approve")

        async def removed() -> bool:
            return bool((await pa.messages())[-1].text.startswith("seen:") and (await pa.info()).current_run is None)

        await _until(removed)
        results = [m for m in await pa.messages() if isinstance(m, ToolResultMessage)]
        assert results[-1].text == "removed x" and not results[-1].is_error
        assert lost  # the notifications were sent, and lost
