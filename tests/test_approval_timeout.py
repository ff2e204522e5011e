"""Approvals that nobody answers: with ``approval_timeout`` a request left pending that long is
denied (the model reads that nobody answered, not that a person said no), so an unattended run
does not hold its process for ever. The deadline follows from the stored request, so it holds
across a restart too: a request that fell due while the kernel was down is denied on resume."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.kernel import Approval
from agentloop.messages import ToolResultMessage
from tests.process_support import assert_valid, kernel


async def ask_risky(process: Any, row: Any) -> Approval:
    if row.args.get("text") == "risky":
        return Approval("ask", ("destructive",), "risky", fingerprint="fp")
    return Approval("auto")


def two_calls() -> ScriptedModel:
    return ScriptedModel([Reply(tool_calls=[call("echo", text="safe"), call("echo", text="risky")]), "ok"])


async def pending(proc: Any) -> list[Any]:
    for _ in range(300):
        rows = await proc.pending_approvals()
        if rows:
            return list(rows)
        await asyncio.sleep(0.01)
    raise AssertionError("no approval was asked")


async def test_an_unanswered_request_is_denied_when_its_time_is_up(tmp_path: Path) -> None:
    async with kernel(tmp_path, two_calls(), approval=ask_risky, approval_timeout=0.3) as k:
        proc = await k.spawn(owner="alice", text="go")
        started = time.monotonic()
        [request] = await pending(proc)
        seen = [s async for s in proc.signals(after_seq=0, follow=False) if s.signal == "proc.run.hil.requested"]
        await asyncio.wait_for(proc.wait_idle(), 5)
        waited = time.monotonic() - started
        msgs = await proc.messages()
        assert await proc.pending_approvals() == []
    assert 0.25 <= waited < 3
    assert seen[0].payload["expiresAt"] == pytest.approx(request.created_at + 0.3)
    results = [m for m in msgs if isinstance(m, ToolResultMessage)]
    assert [r.is_error for r in results] == [False, True]
    assert "nobody answered" in results[1].text and "denied by user" not in results[1].text.lower()
    assert msgs[-1].text == "ok"
    assert_valid(msgs)


async def test_an_answer_in_time_stands(tmp_path: Path) -> None:
    async with kernel(tmp_path, two_calls(), approval=ask_risky, approval_timeout=0.5) as k:
        proc = await k.spawn(owner="alice", text="go")
        [request] = await pending(proc)
        await proc.hil(request.request_id, "approve")
        await asyncio.wait_for(proc.wait_idle(), 5)
        await asyncio.sleep(0.6)  # past the deadline: nothing is denied after the fact
        results = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert [r.is_error for r in results] == [False, False]


async def test_without_a_timeout_a_request_waits(tmp_path: Path) -> None:
    async with kernel(tmp_path, two_calls(), approval=ask_risky) as k:
        proc = await k.spawn(owner="alice", text="go")
        await pending(proc)
        seen = [s async for s in proc.signals(after_seq=0, follow=False) if s.signal == "proc.run.hil.requested"]
        await asyncio.sleep(0.5)
        assert len(await proc.pending_approvals()) == 1
    assert "expiresAt" not in seen[0].payload


async def test_a_request_that_fell_due_while_the_kernel_was_down_is_denied_on_resume(tmp_path: Path) -> None:
    async with kernel(tmp_path, two_calls(), approval=ask_risky, approval_timeout=0.3) as k:
        proc = await k.spawn(owner="alice", text="go")
        await pending(proc)
    await asyncio.sleep(0.4)
    async with kernel(tmp_path, ScriptedModel(["ok"]), approval=ask_risky, approval_timeout=0.3) as k:
        proc = await k.process(proc.pid)
        await asyncio.wait_for(proc.wait_idle(), 5)
        results = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert [r.is_error for r in results] == [False, True] and "nobody answered" in results[1].text


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "60"])
async def test_a_bad_timeout_is_refused(tmp_path: Path, bad: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="approval_timeout"):
        async with kernel(tmp_path, two_calls(), approval_timeout=bad):
            pass


async def test_requests_of_later_batches_get_their_own_deadline(tmp_path: Path) -> None:
    """One timer serves the process: once it has fired, the next request arms it again."""
    model = ScriptedModel(
        [Reply(tool_calls=[call("echo", text="risky")]), Reply(tool_calls=[call("echo", text="risky")]), "ok"]
    )
    async with kernel(tmp_path, model, approval=ask_risky, approval_timeout=0.2) as k:
        proc = await k.spawn(owner="alice", text="go")
        await asyncio.wait_for(proc.wait_idle(), 5)
        results = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert [("nobody answered" in r.text) for r in results] == [True, True]


async def test_a_programs_nested_request_nobody_answers_is_denied_too(tmp_path: Path) -> None:
    """A CodeMode program waiting for a person's answer to one of its own calls is told, when the
    time is up, that nobody answered; the program goes on."""
    from tests.test_codemode import TRUST_CODEMODE, open_kernel, program, results

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "f.txt").write_text("x")
    code = program(
        """
        try:
            await delete("f.txt")
        except ToolDenied as exc:
            print(exc)
        print("went on")
        """
    )
    model = ScriptedModel([Reply(tool_calls=[call("CodeMode", code=code)]), "done"])
    async with open_kernel(tmp_path, model, policy=TRUST_CODEMODE.to_json(), approval_timeout=0.3) as k:
        proc = await k.spawn(owner="alice", text="go")
        await asyncio.wait_for(proc.wait_idle(), 5)
        [res] = results(await proc.messages())
        assert await proc.pending_approvals() == []
    assert "nobody answered" in res.text and "went on" in res.text and (ws / "f.txt").exists()
