"""Usage totals: what a process has spent over all its runs (ok, failed, aborted), kept in its
registry row by the transaction that ends each run, and what an account has spent (its live
processes plus the killed ones, whose totals a kill folds into the account). Shown by
``Process.info()``, ``GET /v1/processes[/{pid}]``, ``proc.get`` over the WebSocket, ``GET
/v1/usage``, the client and ``/usage`` in ``agentloop chat``."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from agentloop import Reply, ScriptedModel, ToolResultMessage, call
from agentloop.cli.main import app
from agentloop.client import AgentloopClient
from agentloop.kernel import Kernel, Process
from agentloop.messages import UserMessage
from agentloop.models.base import ModelInfo, ModelRequest, ProviderError
from agentloop.models.registry import register_provider
from agentloop.process import driver
from agentloop.process import signals as sig
from agentloop.process.compaction import SUMMARY_SYSTEM_PROMPT
from agentloop.process.store import ProcessRecord, SQLiteStore, Store, UsageTotals
from agentloop.process.store.common import usage_columns
from agentloop.process.store.schema import MIGRATIONS, statements
from agentloop.server import api
from tests import test_prompt_manifest
from tests.process_support import echo, kernel, slow
from tests.server_support import LiveServer, live_server, remote_chat, wait_idle
from tests.store_conformance.test_conformance import make_store, store  # noqa: F401
from tests.ws_support import KernelServer

PRICED = ModelInfo(provider="scripted", id="priced", context_window=1_000_000, input_cost=3.0, output_cost=15.0)


def cost(input: int, output: int) -> float:
    """What PRICED charges for one call (dollars per million tokens)."""
    return (3.0 * input + 15.0 * output) / 1_000_000


def brain(req: ModelRequest) -> Reply:
    """``echo X`` calls the echo tool (``echo fail``: the answer after it is refused by the
    provider), ``sleep`` a tool that waits; anything else is answered at once."""
    last = req.messages[-1]
    if isinstance(last, ToolResultMessage):
        if last.text == "fail":
            raise ProviderError("the provider refused", kind="bad_request")
        return Reply(text="done: " + last.text, input_tokens=200, output_tokens=20)
    text = last.text if isinstance(last, UserMessage) else ""
    if text.startswith("echo "):
        return Reply(tool_calls=[call("echo", text=text[5:])], input_tokens=100, output_tokens=10)
    if text == "sleep":
        return Reply(tool_calls=[call("slow", seconds=30)], input_tokens=100, output_tokens=10)
    return Reply(text="answer: " + text, input_tokens=50, output_tokens=5)


def priced() -> ScriptedModel:
    return ScriptedModel(brain, info=PRICED)


def totals(input: int, output: int, calls: list[tuple[int, int]], runs: int) -> UsageTotals:
    return UsageTotals(input, output, input + output, pytest.approx(sum(cost(i, o) for i, o in calls)), runs)


async def finished(proc: Process) -> list[dict[str, Any]]:
    return [s.payload for s in await drain(proc) if s.signal == sig.RUN_FINISHED]


async def drain(proc: Process) -> list[Any]:
    return [s async for s in proc.signals(follow=False)]


async def run(proc: Process, text: str) -> None:
    await proc.send(text)
    await proc.wait_idle()


async def sleeping(proc: Process) -> None:
    """Send ``sleep``; return once its tool is under way (the run has spent a model call)."""
    after = max((s.seq or 0 for s in await drain(proc)), default=0)
    await proc.send("sleep")
    async with asyncio.timeout(10):
        async for s in proc.signals(after_seq=after):
            if s.signal == sig.TOOL_STARTED:
                return


async def abort_when_the_tool_runs(proc: Process) -> None:
    await sleeping(proc)
    assert await proc.abort()
    await proc.wait_idle()


# ---------------------------------------------------------------------------------- the engine


async def test_totals_add_up_over_ok_failed_and_aborted_runs(tmp_path: Path) -> None:
    async with kernel(tmp_path, priced()) as k:
        proc = await k.spawn(owner="alice")
        assert (await proc.info()).usage == UsageTotals()
        await run(proc, "hi")  # 50/5
        await run(proc, "echo a")  # 100/10 + 200/20
        await run(proc, "echo fail")  # 100/10, then the provider refuses
        await abort_when_the_tool_runs(proc)  # 100/10, then aborted
        ends = await finished(proc)
        assert [e["status"] for e in ends] == ["ok", "ok", "error", "aborted"]
        calls = [(50, 5), (100, 10), (200, 20), (100, 10), (100, 10)]
        assert (await proc.info()).usage == totals(550, 55, calls, 4)
        # the totals are the sum of what each run reported when it finished
        assert (await proc.info()).usage.total_tokens == sum(e["usage"]["total_tokens"] for e in ends)


async def test_a_run_ended_by_an_internal_error_counts_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = driver._call_state

    def broken(*args: Any) -> Any:
        """The run's second model turn fails inside the runtime, before its model call."""
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a bug before the second model call")
        return real(*args)

    monkeypatch.setattr(driver, "_call_state", broken)
    async with kernel(tmp_path, priced()) as k:
        proc = await k.spawn(owner="alice")
        await run(proc, "echo a")
        ends = await finished(proc)
        assert [e["status"] for e in ends] == ["error"] and "internal error" in ends[0]["error"]
        assert (await proc.info()).usage == totals(100, 10, [(100, 10)], 1)


async def test_totals_survive_reopening_the_kernel_and_a_reset(tmp_path: Path) -> None:
    async with kernel(tmp_path, priced()) as k:
        proc = await k.spawn(owner="alice")
        await run(proc, "hi")
        pid = proc.pid
    async with kernel(tmp_path, priced()) as k:
        proc = await k.process(pid)
        assert (await proc.info()).usage == totals(50, 5, [(50, 5)], 1)
        await proc.reset()  # a fresh conversation; what the process cost stays
        await asyncio.gather(*k._remembering)  # (plus the call that picks the memories it keeps)
        assert (await proc.info()).usage == totals(100, 10, [(50, 5), (50, 5)], 1)
        await run(proc, "again")
        assert (await proc.info()).usage == totals(150, 15, [(50, 5)] * 3, 2)
        assert [r.usage.runs for r in await k.processes("alice")] == [2]


def summarising_brain(req: ModelRequest) -> Reply:
    """``brain``, and the summary a compaction asks for, which costs 400 + 40 tokens."""
    if req.system_prompt == SUMMARY_SYSTEM_PROMPT:
        return Reply(text="Summary: the user said hi.", input_tokens=400, output_tokens=40)
    return brain(req)


async def test_a_manual_compaction_counts_its_summary_call_but_no_run(tmp_path: Path) -> None:
    model = ScriptedModel(summarising_brain, info=PRICED)
    async with kernel(tmp_path, model, data_dir=tmp_path) as k:
        proc = await k.spawn(owner="alice")
        for i in range(3):
            await run(proc, f"hi {i} " + "lorem ipsum " * 200)
        spent = [(50, 5)] * 3
        assert (await proc.info()).usage == totals(150, 15, spent, 3)
        assert (await proc.compact()).compacted
        with_summary = totals(550, 55, [*spent, (400, 40)], 3)  # billed, but not a run
        assert (await proc.info()).usage == with_summary
        assert await k.usage("alice") == with_summary
        await run(proc, "after")  # the next run adds to it
        assert (await proc.info()).usage == totals(600, 60, [*spent, (400, 40), (50, 5)], 4)
        pid = proc.pid
    async with kernel(tmp_path, model, data_dir=tmp_path) as k:  # stored, not only cached
        assert (await (await k.process(pid)).info()).usage == totals(600, 60, [*spent, (400, 40), (50, 5)], 4)


async def test_the_account_total_includes_killed_processes(tmp_path: Path) -> None:
    async with kernel(tmp_path, priced()) as k:
        assert await k.usage("alice") == UsageTotals()
        first, second = await k.spawn(owner="alice"), await k.spawn(owner="alice")
        other = await k.spawn(owner="bob")
        await run(first, "hi")
        await run(second, "echo a")
        await run(other, "hi")
        everything = totals(350, 35, [(50, 5), (100, 10), (200, 20)], 2)
        assert await k.usage("alice") == everything
        await first.kill()
        assert await k.usage("alice") == everything  # the killed process's cost stays with the account
        await second.reset()
        await asyncio.gather(*k._remembering)  # (the memories call, which counts too)
        assert await k.usage("alice") == totals(400, 40, [(50, 5), (100, 10), (200, 20), (50, 5)], 2)
        await sleeping(second)  # killed mid-run: the model call its run made counts
        await second.kill()
        assert await k.usage("alice") == totals(500, 50, [(50, 5), (100, 10), (200, 20), (50, 5), (100, 10)], 3)
        assert await k.usage("bob") == totals(50, 5, [(50, 5)], 1)
    async with kernel(tmp_path, priced()) as k:  # and it survives a restart
        assert (await k.usage("alice")).runs == 3


async def test_the_postgres_engine_keeps_the_totals(pg_url: str, tmp_path: Path) -> None:
    async with Kernel.open(pg_url, model=priced(), workspace=tmp_path, data_dir=tmp_path, tools=[echo, slow]) as k:
        proc = await k.spawn(owner="alice")
        await run(proc, "echo a")
        await abort_when_the_tool_runs(proc)
        calls = [(100, 10), (200, 20), (100, 10)]
        assert (await proc.info()).usage == totals(400, 40, calls, 2)
        await proc.kill()
        assert await k.usage("alice") == totals(400, 40, calls, 2)


# ---------------------------------------------------------------------------------- the stores


async def test_a_store_keeps_the_totals_and_a_delete_folds_them_into_the_account(store: Store) -> None:  # noqa: F811
    for pid, owner in (("p1", "alice"), ("p2", "alice"), ("p3", "bob")):
        async with store.transaction():
            await store.create_process(ProcessRecord(pid=pid, owner=owner, run_as=owner, cwd="/"))
    got = await store.get_process("p1")
    assert got is not None and got.usage == UsageTotals()
    async with store.transaction():
        await store.update_process(
            "p1", state="idle", current_run=None, **usage_columns(UsageTotals(100, 10, 110, 0.5, 2))
        )
        await store.update_process("p2", **usage_columns(UsageTotals(1, 2, 3, 0.25, 1)))
    got = await store.get_process("p1")
    assert got is not None and got.usage == UsageTotals(100, 10, 110, 0.5, 2) and got.state == "idle"
    assert [r.usage for r in await store.list_processes("alice")] == [
        UsageTotals(100, 10, 110, 0.5, 2),
        UsageTotals(1, 2, 3, 0.25, 1),
    ]
    alice = UsageTotals(101, 12, 113, 0.75, 3)
    assert await store.account_usage("alice") == alice
    async with store.transaction():
        await store.delete_process("p1")
    assert await store.account_usage("alice") == alice
    async with store.transaction():
        await store.delete_process("p2")
    assert await store.account_usage("alice") == alice  # all of it from the killed processes now
    async with store.transaction():  # totals written in the transaction that deletes the process
        await store.update_process("p3", **usage_columns(UsageTotals(8, 1, 9, 0.125, 2)))
        await store.delete_process("p3")
    assert await store.account_usage("bob") == UsageTotals(8, 1, 9, 0.125, 2)
    assert await store.account_usage("carol") == UsageTotals()


async def test_an_older_database_gains_zero_totals(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for version, sql in MIGRATIONS[:9]:
        for stmt in statements(sql, clustered="WITHOUT ROWID"):
            db.execute(stmt)
        db.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
    db.execute(
        "INSERT INTO processes VALUES ('old', 'alice', 'alice', '/', NULL, 1, '', 'idle', NULL, 1, 1, 1, 1, 0, 0)"
    )
    db.commit()
    db.close()
    s = SQLiteStore(path)
    await s.open()
    try:
        got = await s.get_process("old")
        assert got is not None and got.usage == UsageTotals()
        assert await s.account_usage("alice") == UsageTotals()
    finally:
        await s.close()


# ---------------------------------------------------------------------------------- HTTP, WebSocket, client

SERVED = {"input": 10, "output": 5, "total_tokens": 15, "cost": 0.0, "runs": 1}  # one answer of the test server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    with live_server(tmp_path) as srv:
        yield srv


async def test_http_shows_process_and_account_totals(server: LiveServer) -> None:
    async with server.client(server.tokens.alice) as alice, server.client(server.tokens.bob) as bob:
        made = await alice.post("/v1/processes", json={"text": "hi"})
        assert made.status_code == 201 and "usage" in made.json()
        pid = made.json()["pid"]
        await wait_idle(alice, pid)
        one = await alice.get(f"/v1/processes/{pid}")
        api.ProcessOut.model_validate(one.json())
        assert one.json()["usage"] == SERVED
        listed = (await alice.get("/v1/processes")).json()["processes"]
        assert [p["usage"] for p in listed] == [SERVED]
        assert shaped(await alice.get("/v1/usage")) == {"account": "alice", "usage": SERVED}
        assert (await alice.delete(f"/v1/processes/{pid}")).status_code == 200
        assert shaped(await alice.get("/v1/usage")) == {"account": "alice", "usage": SERVED}
        assert shaped(await bob.get("/v1/usage"))["usage"]["runs"] == 0  # each account its own


def shaped(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()
    api.UsageAnswer.model_validate(data)
    return data


async def test_the_client_reads_the_totals(server: LiveServer) -> None:
    async with AgentloopClient(server.url, server.tokens.alice) as client:
        proc = await client.spawn()
        await client.send(proc["pid"], "echo x")
        await wait_until_idle(client, proc["pid"])
        assert (await client.process(proc["pid"]))["usage"] == {**SERVED, "input": 20, "output": 10, "total_tokens": 30}
        assert (await client.usage())["usage"]["total_tokens"] == 30


async def wait_until_idle(client: AgentloopClient, pid: str) -> None:
    async with asyncio.timeout(10):
        while (await client.process(pid))["run_id"] is not None:
            await asyncio.sleep(0.01)


def test_the_websocket_process_carries_the_totals(tmp_path: Path) -> None:
    with KernelServer(tmp_path, ScriptedModel(lambda req: "reply"), tools=[echo]) as s, s.client("alice") as c:
        pid = c.ok("proc.spawn", {})["pid"]
        assert c.ok("proc.get", {"pid": pid})["usage"] == UsageTotals().as_dict()
        c.ok("proc.subscribe", {"pid": pid})
        c.ok("proc.send", {"pid": pid, "text": "hello"})
        c.signals_until(pid, "proc.run.finished")
        assert c.ok("proc.get", {"pid": pid})["usage"] == SERVED
        assert [p["usage"] for p in c.ok("proc.list")["processes"]] == [SERVED]


# ---------------------------------------------------------------------------------- chat /usage

runner = CliRunner()


isolated = test_prompt_manifest.isolated  # a config-free environment for the CLI


@pytest.mark.usefixtures("isolated")
def test_slash_usage_in_a_durable_chat(tmp_path: Path) -> None:
    register_provider("usage-totals", lambda _id: ScriptedModel(["one", "two"]))
    ws, data = tmp_path / "ws", tmp_path / "data"
    ws.mkdir()
    args = ["chat", "-m", "usage-totals:x", "-w", str(ws), "--data", str(data)]
    result = runner.invoke(app, args, input="/usage\nhello\nagain\n/usage\n/help\n")
    assert result.exit_code == 0, result.stderr
    err = result.stderr
    assert "this conversation: no run has finished yet" in err
    assert "this conversation: 2 runs · 30 tokens (20 in, 10 out)" in err
    assert "/usage" in err[err.rindex("/new") :]  # /help lists it


@pytest.mark.usefixtures("isolated")
def test_slash_usage_in_an_in_memory_chat_says_there_is_none(tmp_path: Path) -> None:
    register_provider("usage-memory", lambda _id: ScriptedModel(["ok"]))
    (tmp_path / "ws").mkdir()
    args = ["chat", "-m", "usage-memory:x", "-w", str(tmp_path / "ws"), "--data", str(tmp_path / "d"), "--memory"]
    result = runner.invoke(app, args, input="hi\n/usage\n")
    assert result.exit_code == 0, result.stderr
    assert "no usage totals" in result.stderr


def test_slash_usage_in_a_remote_chat(server: LiveServer) -> None:
    _, err = remote_chat(server, "hi\n/usage\n/exit\n")
    assert "this conversation: 1 run · 15 tokens (10 in, 5 out)" in err
