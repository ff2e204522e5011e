"""Input arbitration for callers that race one another or act on a stale view: ``send`` with
``expected_run_id`` (deliver only while that run is the current one, as Codex's expected turn id)
and ``mode="reject"`` (deliver only to an idle process, LangGraph's multitask strategy).

A refusal delivers, queues and aborts nothing, and is decided in the admission's transaction:
the race tests end a run (or start one) after ``Process.send``'s early look and before that
transaction, where a check made only on the early look would let the input through.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.kernel import Kernel, Process, RunActive, RunNotCurrent
from agentloop.messages import UserMessage, user
from agentloop.models.base import ModelRequest
from agentloop.process import admission
from agentloop.server import api
from tests import server_support
from tests.server_support import LiveServer, checked, slow, wait_until
from tests.ws_support import KernelServer

# ---------------------------------------------------------------------------------- support


class Gated:
    """A model whose answer to a user message starting with "hold" waits for the gate (set
    again for each run that needs one); anything else is answered at once, ``re: <text>``."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.calling = asyncio.Event()  # set while a held answer waits for the gate
        self.model = ScriptedModel(self.brain)

    async def brain(self, req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if isinstance(last, UserMessage) and last.text.startswith("hold"):
            self.calling.set()
            await self.gate.wait()
        return f"re: {last.text}"

    def seen(self) -> list[str]:
        """The user texts the model was shown, over every request."""
        return [m.text for r in self.model.requests for m in r.messages if isinstance(m, UserMessage)]


@pytest.fixture
async def kernel(tmp_path: Path) -> AsyncIterator[tuple[Kernel, Gated]]:
    gated = Gated()
    url = f"sqlite:///{tmp_path}/agentloop.db"
    async with Kernel.open(url, model=gated.model, workspace=tmp_path, data_dir=tmp_path) as k:
        yield k, gated


async def busy(k: Kernel, gated: Gated) -> tuple[Process, str]:
    """A process with a run under way (held at the gate), and that run's id."""
    proc = await k.spawn(owner="alice")
    receipt = await proc.send("hold on")
    await asyncio.wait_for(gated.calling.wait(), 5)
    return proc, receipt.run_id


async def current_run(proc: Process) -> str | None:
    run = (await proc.info()).current_run
    return run["run_id"] if run is not None else None


async def texts(proc: Process) -> list[str]:
    return [m.message.text for m in await proc.history()]


async def finish(proc: Process, gated: Gated) -> None:
    gated.gate.set()
    await asyncio.wait_for(proc.wait_idle(), 5)


# ---------------------------------------------------------------------------------- library


async def test_a_steer_naming_the_current_run_joins_it(kernel: tuple[Kernel, Gated]) -> None:
    k, gated = kernel
    proc, run = await busy(k, gated)
    receipt = await proc.send("and also this", expected_run_id=run)
    assert (receipt.run_id, receipt.queued) == (run, True)
    assert [(q.kind, q.message.text) for q in await proc.queued()] == [("steer", "and also this")]
    await finish(proc, gated)
    # the run named took it: its messages, not a run of its own
    mine = [m.message.text for m in await proc.history() if m.run_id == run]
    assert "and also this" in mine and "re: and also this" in mine
    assert {m.run_id for m in await proc.history()} == {run}


@pytest.mark.parametrize("mode", ["steer", "queue", "interrupt"])
async def test_a_send_naming_a_stale_run_is_refused_and_delivers_nothing(
    kernel: tuple[Kernel, Gated], mode: Any
) -> None:
    k, gated = kernel
    proc, run = await busy(k, gated)
    before = await texts(proc)
    with pytest.raises(RunNotCurrent) as refused:
        await proc.send("for an older run", mode=mode, expected_run_id="an-older-run")
    assert (refused.value.expected, refused.value.current, refused.value.pid) == ("an-older-run", run, proc.pid)
    assert "an-older-run" in str(refused.value) and run in str(refused.value)
    assert await proc.queued() == []  # nothing queued …
    assert await current_run(proc) == run  # … nor the run aborted (an interrupt's abort is its check)
    await finish(proc, gated)
    assert "for an older run" not in await texts(proc) and "for an older run" not in gated.seen()
    assert len(await texts(proc)) == len(before) + 1  # the run's answer, nothing else


@pytest.mark.parametrize("mode", ["steer", "queue", "interrupt"])
async def test_a_send_naming_a_run_that_ended_starts_no_run(kernel: tuple[Kernel, Gated], mode: Any) -> None:
    """The stale steer the precondition is for: without it, input written for a run that ended
    meanwhile would silently start a run of its own."""
    k, gated = kernel
    proc, run = await busy(k, gated)
    await finish(proc, gated)
    before = await texts(proc)
    with pytest.raises(RunNotCurrent) as refused:
        await proc.send("too late", mode=mode, expected_run_id=run)
    assert refused.value.current is None
    assert await current_run(proc) is None and await proc.queued() == []
    assert await texts(proc) == before


async def test_an_interrupt_naming_the_current_run_stops_it_and_starts_the_next(
    kernel: tuple[Kernel, Gated],
) -> None:
    k, gated = kernel
    proc, run = await busy(k, gated)
    receipt = await proc.send("instead", mode="interrupt", expected_run_id=run)
    assert receipt.run_id != run and not receipt.queued
    await asyncio.wait_for(proc.wait_idle(), 5)
    assert [m.message.text for m in await proc.history() if m.run_id == receipt.run_id] == ["instead", "re: instead"]


async def test_a_queue_naming_the_current_run_waits_for_the_run_after_it(kernel: tuple[Kernel, Gated]) -> None:
    k, gated = kernel
    proc, run = await busy(k, gated)
    receipt = await proc.send("next", mode="queue", expected_run_id=run)
    assert receipt.queued and receipt.run_id != run
    assert [(q.kind, q.run_id) for q in await proc.queued()] == [("queue", receipt.run_id)]
    await finish(proc, gated)
    assert [m.message.text for m in await proc.history() if m.run_id == receipt.run_id] == ["next", "re: next"]


async def test_reject_refuses_while_a_run_is_under_way(kernel: tuple[Kernel, Gated]) -> None:
    k, gated = kernel
    proc, run = await busy(k, gated)
    with pytest.raises(RunActive) as refused:
        await proc.send("only if idle", mode="reject")
    assert refused.value.run_id == run and refused.value.pid == proc.pid
    assert await proc.queued() == [] and await current_run(proc) == run
    await finish(proc, gated)
    assert "only if idle" not in await texts(proc)


async def test_reject_on_an_idle_process_starts_a_run(kernel: tuple[Kernel, Gated]) -> None:
    k, _ = kernel
    proc = await k.spawn(owner="alice")
    receipt = await proc.send("hello", mode="reject")
    assert not receipt.queued
    await asyncio.wait_for(proc.wait_idle(), 5)
    assert [m.message.text for m in await proc.history() if m.run_id == receipt.run_id] == ["hello", "re: hello"]


async def test_two_rejects_racing_on_an_idle_process_start_one_run(kernel: tuple[Kernel, Gated]) -> None:
    k, gated = kernel
    proc = await k.spawn(owner="alice")
    results = await asyncio.gather(
        proc.send("hold first", mode="reject"), proc.send("hold second", mode="reject"), return_exceptions=True
    )
    started = [r for r in results if not isinstance(r, BaseException)]
    refusals = [r for r in results if isinstance(r, RunActive)]
    assert len(started) == 1 and len(refusals) == 1, results
    assert refusals[0].run_id == started[0].run_id
    await finish(proc, gated)
    assert len({m.run_id for m in await proc.history()}) == 1


async def test_the_run_check_is_made_in_the_admission_not_only_before_it(
    kernel: tuple[Kernel, Gated], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run named ends after ``Process.send`` looked at it and before the admission decides:
    the steer is refused there, and no run is started from it."""
    k, gated = kernel
    proc, run = await busy(k, gated)
    real = admission.after_clearing

    async def run_ends_meanwhile(engine: Any, pid: str) -> None:
        await finish(proc, gated)
        await real(engine, pid)

    monkeypatch.setattr(admission, "after_clearing", run_ends_meanwhile)
    with pytest.raises(RunNotCurrent) as refused:
        await proc.send("steer the run", expected_run_id=run)
    assert refused.value.current is None
    assert await current_run(proc) is None and await proc.queued() == []
    assert await texts(proc) == ["hold on", "re: hold on"]  # run X's, and nothing after it


async def test_a_reject_is_refused_in_the_admission_when_a_run_starts_meanwhile(
    kernel: tuple[Kernel, Gated], monkeypatch: pytest.MonkeyPatch
) -> None:
    k, gated = kernel
    proc = await k.spawn(owner="alice")
    real = admission.after_clearing
    started: list[str] = []

    async def run_starts_meanwhile(engine: Any, pid: str) -> None:
        monkeypatch.setattr(admission, "after_clearing", real)  # (once: the send below comes here too)
        started.append((await engine.send(pid, user("hold there"))).run_id)
        await real(engine, pid)

    monkeypatch.setattr(admission, "after_clearing", run_starts_meanwhile)
    with pytest.raises(RunActive) as refused:
        await proc.send("only if idle", mode="reject")
    assert refused.value.run_id == started[0]
    assert await proc.queued() == []
    await finish(proc, gated)
    assert "only if idle" not in await texts(proc)


async def test_two_interrupts_of_one_run_stop_it_once(kernel: tuple[Kernel, Gated]) -> None:
    k, gated = kernel
    proc, run = await busy(k, gated)
    results = await asyncio.gather(
        proc.send("hold one", mode="interrupt", expected_run_id=run),
        proc.send("hold two", mode="interrupt", expected_run_id=run),
        return_exceptions=True,
    )
    delivered = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, RunNotCurrent)]
    assert len(delivered) == 1 and len(refused) == 1, results
    assert refused[0].current == delivered[0].run_id  # the winner's run is the current one
    await finish(proc, gated)
    assert len([t for t in await texts(proc) if t in ("hold one", "hold two")]) == 1


async def test_a_retried_send_gets_its_receipt_whatever_the_run_is_now(kernel: tuple[Kernel, Gated]) -> None:
    """Idempotency comes first: a retry of a send that got through (its ``run_id``) is not
    refused because the condition it met no longer holds; it is delivered once."""
    k, gated = kernel
    proc, run = await busy(k, gated)
    steered = await proc.send("steer once", expected_run_id=run, run_id="retry-steer")
    await finish(proc, gated)
    assert await proc.send("steer once", expected_run_id=run, run_id="retry-steer") == steered  # run X ended

    gated.gate.clear()
    gated.calling.clear()
    rejected = await proc.send("hold, if idle", mode="reject", run_id="retry-reject")
    await asyncio.wait_for(gated.calling.wait(), 5)
    assert await current_run(proc) == rejected.run_id == "retry-reject"
    assert await proc.send("hold, if idle", mode="reject", run_id="retry-reject") == rejected  # now busy
    await finish(proc, gated)
    assert (await texts(proc)).count("steer once") == 1 and (await texts(proc)).count("hold, if idle") == 1


async def test_bad_arguments_are_refused_before_anything_is_stored(kernel: tuple[Kernel, Gated]) -> None:
    k, _ = kernel
    proc = await k.spawn(owner="alice")
    with pytest.raises(ValueError, match="reject"):
        await proc.send("x", mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected_run_id"):
        await proc.send("x", mode="reject", expected_run_id="r")
    with pytest.raises(TypeError, match="expected_run_id"):
        await proc.send("x", expected_run_id=42)  # type: ignore[arg-type]
    assert await texts(proc) == [] and await current_run(proc) is None


# ---------------------------------------------------------------------------------- HTTP


server = server_support.module_server("precondition")
alice = server_support.alice


async def run_of(client: httpx.AsyncClient, pid: str) -> str | None:
    run: str | None = (await client.get(f"/v1/processes/{pid}")).json()["run_id"]
    return run


async def test_http_sends_with_a_precondition(alice: httpx.AsyncClient) -> None:
    pid = (await alice.post("/v1/processes", json={})).json()["pid"]
    url = f"/v1/processes/{pid}/messages"
    run = checked(await alice.post(url, json={"text": "sleep 30"}), api.ReceiptOut, 202)["run_id"]
    try:
        steered = checked(await alice.post(url, json={"text": "more", "expected_run_id": run}), api.ReceiptOut, 202)
        assert steered["run_id"] == run and steered["queued"]
        await alice.delete(f"/v1/processes/{pid}/queue")  # (so the abort below leaves nothing to run)

        stale = await alice.post(url, json={"text": "stale", "mode": "queue", "expected_run_id": "old"})
        assert stale.status_code == 409
        assert stale.json() == {"code": "run_not_current", "message": stale.json()["message"], "current_run_id": run}
        busy = await alice.post(url, json={"text": "if idle", "mode": "reject"})
        assert busy.status_code == 409
        assert busy.json() == {"code": "busy", "message": busy.json()["message"], "current_run_id": run}
        assert (await alice.get(f"/v1/processes/{pid}/queue")).json() == {"items": []}
        both = await alice.post(url, json={"text": "x", "mode": "reject", "expected_run_id": run})
        assert both.status_code == 400 and both.json()["code"] == "invalid_request"
    finally:
        await alice.post(f"/v1/processes/{pid}/abort", json={})

    async def idle() -> bool:
        return await run_of(alice, pid) is None

    await wait_until(idle)
    ended = await alice.post(url, json={"text": "too late", "expected_run_id": run})
    assert ended.status_code == 409
    assert ended.json()["code"] == "run_not_current" and ended.json()["current_run_id"] is None
    assert await run_of(alice, pid) is None  # no run started from it
    started = checked(await alice.post(url, json={"text": "hello", "mode": "reject"}), api.ReceiptOut, 202)
    assert not started["queued"]


def test_the_precondition_is_documented() -> None:
    op = api.openapi_document()["paths"]["/v1/processes/{pid}/messages"]["post"]
    assert "409" in op["responses"]
    schemas = api.openapi_document()["components"]["schemas"]
    assert "expected_run_id" in schemas["SendBody"]["properties"]
    assert "reject" in str(schemas["SendBody"]["properties"]["mode"])
    assert "current_run_id" in schemas["ErrorBody"]["properties"]


# ---------------------------------------------------------------------------------- client


async def test_the_client_sends_with_a_precondition(server: LiveServer) -> None:
    from agentloop.client import AgentloopClient, Conflict

    async with AgentloopClient(server.url, server.tokens.alice) as client:
        pid = (await client.spawn())["pid"]
        run = (await client.send(pid, "sleep 30"))["run_id"]
        try:
            assert (await client.send(pid, "more", expected_run_id=run))["run_id"] == run
            with pytest.raises(Conflict) as stale:
                await client.send(pid, "stale", mode="interrupt", expected_run_id="old")
            assert stale.value.code == "run_not_current" and stale.value.details == {"current_run_id": run}
            with pytest.raises(Conflict) as busy:
                await client.send(pid, "if idle", mode="reject")
            assert busy.value.code == "busy" and busy.value.details == {"current_run_id": run}
        finally:
            await client.withdraw(pid)
            await client.abort(pid)


# ---------------------------------------------------------------------------------- WebSocket


def ws_script(req: ModelRequest) -> Reply | str:
    last = req.messages[-1]
    if isinstance(last, UserMessage) and last.text == "sleep":
        return Reply(tool_calls=[call("slow", seconds=30)])
    return "reply: " + last.text


def test_websocket_sends_with_a_precondition(tmp_path: Path) -> None:
    with KernelServer(tmp_path, ScriptedModel(ws_script), tools=[slow]) as srv:
        alice = srv.client("alice")
        try:
            pid = alice.ok("proc.spawn", {})["pid"]
            run = alice.ok("proc.send", {"pid": pid, "text": "sleep"})["run_id"]
            steered = alice.ok("proc.send", {"pid": pid, "text": "more", "expected_run_id": run})
            assert steered["run_id"] == run and steered["queued"]
            stale = alice.call("proc.send", {"pid": pid, "text": "stale", "expected_run_id": "old"})
            assert not stale["ok"]
            assert stale["error"]["code"] == "run_not_current" and stale["error"]["current_run_id"] == run
            busy = alice.call("proc.send", {"pid": pid, "text": "if idle", "mode": "reject"})
            assert not busy["ok"] and busy["error"]["code"] == "busy" and busy["error"]["current_run_id"] == run
            assert [i["text"] for i in alice.ok("proc.queue.list", {"pid": pid})["items"]] == ["more"]
            assert alice.error("proc.send", {"pid": pid, "text": "x", "expected_run_id": 5}) == "invalid_request"
            alice.ok("proc.queue.withdraw", {"pid": pid})
            alice.ok("proc.abort", {"pid": pid})
        finally:
            alice.close()


# ---------------------------------------------------------------------------------- two workers


async def test_a_worker_not_holding_the_process_checks_against_the_holders_run(pg_url: str, tmp_path: Path) -> None:
    """Sent through a worker that does not hold the process, the check reads the run under the
    process's row lock (the holder's run cannot start or end under it), and an interrupt names
    the run it forwards the abort for."""
    pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")
    from tests.test_scale_out import kept_by, worker

    gated = Gated()
    async with (
        worker(pg_url, tmp_path, "A", gated.model, []) as a,
        worker(pg_url, tmp_path, "B", gated.model, []) as b,
    ):
        proc_a = await a.spawn(owner="alice")
        await kept_by(a, proc_a.pid)
        run = (await proc_a.send("hold on")).run_id
        await asyncio.wait_for(gated.calling.wait(), 5)
        proc_b = await b.process(proc_a.pid)

        with pytest.raises(RunNotCurrent) as stale:
            await proc_b.send("stale", expected_run_id="old")
        assert stale.value.current == run
        with pytest.raises(RunActive) as busy_refusal:
            await proc_b.send("if idle", mode="reject")
        assert busy_refusal.value.run_id == run
        with pytest.raises(RunNotCurrent):
            await proc_b.send("stale interrupt", mode="interrupt", expected_run_id="old")
        assert await proc_b.queued() == [] and await current_run(proc_b) == run  # nothing queued or aborted

        steered = await proc_b.send("more", expected_run_id=run)
        assert (steered.run_id, steered.queued) == (run, True)
        await proc_b.withdraw()
        fresh = await proc_b.send("instead", mode="interrupt", expected_run_id=run)
        assert fresh.run_id != run

        async def answered() -> bool:  # (by whichever worker holds the process now)
            return "re: instead" in await texts(proc_b)

        await wait_until(answered, 10)
        assert not {"stale", "if idle", "stale interrupt", "more"} & set(gated.seen())
