"""A durable process's ``ToolRetry`` episodes as signals: ``proc.run.tool.retry.scheduled`` per
failure counted, ``.resolved`` when a step without one gives the budgets back, ``.exhausted`` when
one is spent; logged (resumable with ``after_seq``, live to a follower), once each, in order, never
repeated by a restart, and absent from a process without the piece."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentloop import Reply, ScriptedModel, ToolRetry, call
from agentloop.events import ModelRetry
from agentloop.kernel import Kernel, Process
from agentloop.messages import ToolResultMessage
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.api import approve_everything
from agentloop.process.calls import retry_signal
from agentloop.tools.builtin import builtin_tools

RETRY = (sig.TOOL_RETRY_SCHEDULED, sig.TOOL_RETRY_RESOLVED, sig.TOOL_RETRY_EXHAUSTED)


def open_kernel(tmp_path: Path, brain: Callable[[ModelRequest], Any], *, pieces: bool = True) -> Kernel:
    return Kernel.open(
        f"sqlite:///{tmp_path}/k.db",
        model=ScriptedModel(brain),
        workspace=tmp_path,
        tools=builtin_tools(tmp_path, shell=False),
        approval=approve_everything,
        pieces=[ToolRetry()] if pieces else [],
    )


def results_seen(request: ModelRequest) -> int:
    return sum(1 for m in request.messages if isinstance(m, ToolResultMessage))


def reads(*paths: str, then: str = "done") -> Callable[[ModelRequest], Reply | str]:
    """Read each of ``paths`` in its own step, then answer ``then``."""

    def brain(request: ModelRequest) -> Reply | str:
        seen = results_seen(request)
        return Reply(tool_calls=[call("Read", path=paths[seen])]) if seen < len(paths) else then

    return brain


async def logged(proc: Process) -> list[tuple[int, str, dict[str, Any]]]:
    return [(s.seq or 0, s.signal, s.payload) async for s in proc.signals(after_seq=0, follow=False)]


def retries(log: list[tuple[int, str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, payload) for _, name, payload in log if name in RETRY]


async def test_failures_then_a_success_log_scheduled_twice_then_resolved(tmp_path: Path) -> None:
    (tmp_path / "here.txt").write_text("found\n")
    async with open_kernel(tmp_path, reads("a.txt", "b.txt", "here.txt")) as k:
        proc = await k.spawn(owner="me", text="find it")
        await asyncio.wait_for(proc.wait_idle(), 10)
        log = await logged(proc)
    run_id = next(p["runId"] for _, name, p in log if name == sig.RUN_STARTED)
    calls = [p["callId"] for _, name, p in log if name == sig.TOOL_STARTED]
    assert len(calls) == 3
    assert retries(log) == [
        (
            sig.TOOL_RETRY_SCHEDULED,
            {
                "pid": proc.pid,
                "runId": run_id,
                "callId": calls[0],
                "name": "Read",
                "errorClass": "not_found",
                "roundsLeft": 31,
                "classLeft": 1,
                "toolLeft": 15,
                "signatureLeft": 2,
            },
        ),
        (
            sig.TOOL_RETRY_SCHEDULED,
            {
                "pid": proc.pid,
                "runId": run_id,
                "callId": calls[1],
                "name": "Read",
                "errorClass": "not_found",
                "roundsLeft": 30,
                "classLeft": 0,
                "toolLeft": 14,
                "signatureLeft": 2,
            },
        ),
        (sig.TOOL_RETRY_RESOLVED, {"pid": proc.pid, "runId": run_id, "failures": 2, "rounds": 2}),
    ]
    # each after its call's result, logged (a seq of its own), before the run's end
    seqs = {name: [q for q, n, _ in log if n == name] for name in (*RETRY, sig.TOOL_FINISHED, sig.RUN_FINISHED)}
    finished, (scheduled_a, scheduled_b), (resolved,) = (
        seqs[sig.TOOL_FINISHED],
        seqs[sig.TOOL_RETRY_SCHEDULED],
        seqs[sig.TOOL_RETRY_RESOLVED],
    )
    assert all(q > 0 for q in (scheduled_a, scheduled_b, resolved))
    assert finished[0] < scheduled_a < finished[1] < scheduled_b < finished[2] < resolved < seqs[sig.RUN_FINISHED][0]


async def test_a_spent_budget_logs_exhausted_before_the_stop_and_a_follower_sees_it_live(tmp_path: Path) -> None:
    async with open_kernel(tmp_path, reads("a.txt", "b.txt", "c.txt", then="gave up")) as k:
        proc = await k.spawn(owner="me", text="find it")
        live: list[tuple[str, dict[str, Any]]] = []

        async def follow() -> None:
            async for s in proc.signals(after_seq=0):
                if s.signal in RETRY:
                    live.append((s.signal, s.payload))
                if s.signal == sig.RUN_FINISHED:
                    return

        await asyncio.wait_for(follow(), 10)
        await asyncio.wait_for(proc.wait_idle(), 10)
        log = await logged(proc)
    got = retries(log)
    assert live == got  # (what a follower was given is what the log holds)
    assert [name for name, _ in got] == [sig.TOOL_RETRY_SCHEDULED, sig.TOOL_RETRY_SCHEDULED, sig.TOOL_RETRY_EXHAUSTED]
    calls = [p["callId"] for _, name, p in log if name == sig.TOOL_STARTED]
    exhausted = got[-1][1]
    assert exhausted == {
        "pid": proc.pid,
        "runId": got[0][1]["runId"],
        "callId": calls[2],
        "name": "Read",
        "errorClass": "not_found",
        "budget": "class",
        "limit": 2,
        "reason": "a not_found failure of Read went past the not_found budget (2)",
    }
    ends = [p for _, name, p in log if name == sig.RUN_FINISHED]
    assert [(p["status"], p["reason"]) for p in ends] == [("ok", "stopped")]
    at = {name: q for q, name, _ in log if name in (sig.TOOL_RETRY_EXHAUSTED, sig.RUN_FINISHED)}
    assert at[sig.TOOL_RETRY_EXHAUSTED] < at[sig.RUN_FINISHED]


async def test_a_process_without_the_piece_logs_none(tmp_path: Path) -> None:
    async with open_kernel(tmp_path, reads("a.txt", "b.txt", "c.txt"), pieces=False) as k:
        proc = await k.spawn(owner="me", text="find it")
        await asyncio.wait_for(proc.wait_idle(), 10)
        log = await logged(proc)
    assert [n for _, n, _ in log].count(sig.TOOL_FINISHED) == 3
    assert retries(log) == []
    assert not any(name.startswith("proc.run.tool.retry") for _, name, _ in log)


async def test_a_restart_neither_repeats_nor_loses_what_was_logged(tmp_path: Path) -> None:
    """Closed during the model call after two failures: the new kernel's piece counts them again
    from the history (the third spends the budget) but does not log them again; the log read after
    the reopen still has the first two."""
    hung = asyncio.Event()

    async def before(request: ModelRequest) -> Reply | str:
        seen = results_seen(request)
        if seen < 2:
            return Reply(tool_calls=[call("Read", path=f"missing-{seen}.txt")])
        hung.set()
        await asyncio.sleep(60)  # the model call a restart cuts off
        return "never"

    async with open_kernel(tmp_path, before) as k:
        proc = await k.spawn(owner="me", text="find it")
        await asyncio.wait_for(hung.wait(), 5)
        pid = proc.pid
        first = retries(await logged(proc))
    assert [name for name, _ in first] == [sig.TOOL_RETRY_SCHEDULED] * 2

    async with open_kernel(tmp_path, reads("missing-0.txt", "missing-1.txt", "missing-2.txt", then="gone")) as k:
        proc = await k.process(pid)
        await asyncio.wait_for(proc.wait_idle(), 10)
        log = await logged(proc)
    got = retries(log)
    assert got[:2] == first
    assert [name for name, _ in got] == [sig.TOOL_RETRY_SCHEDULED] * 2 + [sig.TOOL_RETRY_EXHAUSTED]
    assert got[2][1]["limit"] == 2 and got[2][1]["errorClass"] == "not_found"
    assert len({p["callId"] for _, p in got}) == 3


def test_other_events_are_not_retry_signals() -> None:
    assert retry_signal(ModelRetry(attempt=1, delay=0.0, error="out", model="m")) is None
