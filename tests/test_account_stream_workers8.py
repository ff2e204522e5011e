"""The account stream (``Kernel.account_signals``) with two workers on one PostgreSQL store: a
stream on either worker sees the runs ended and the approvals asked and answered of every process
of the account, whichever worker runs it, each once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")

from agentloop import Reply, ScriptedModel, call, tool
from agentloop.kernel import Kernel
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.signals import Signal
from tests.process_support import Approval
from tests.test_scale_out import kept_by, two

BIG = "y" * 9000  # an approval whose payload is too large for a notification


@tool
def rm(path: str) -> str:
    """Pretend to delete."""
    return f"removed {len(path)}"


def brain(req: ModelRequest) -> Reply | str:
    last = req.messages[-1]
    if isinstance(last, UserMessage) and last.text == "delete":
        return Reply(tool_calls=[call("rm", path="x")])
    if isinstance(last, UserMessage) and last.text == "big":
        return Reply(tool_calls=[call("rm", path=BIG)])
    return "seen: " + last.text if isinstance(last, UserMessage) else "ok"


async def policy(process: Any, row: Any) -> Approval:
    return Approval("ask", ("destructive",), "rm", fingerprint="rm") if row.tool_name == "rm" else Approval("auto")


class Stream:
    """What one worker's account stream of ``owner`` delivers, collected in the background."""

    def __init__(self, kernel: Kernel, owner: str) -> None:
        self.seen: list[tuple[str, Signal]] = []
        self._stream = kernel.account_signals(owner)
        self.task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        async for item in self._stream:
            self.seen.append((item.pid or "", item.signal))

    def logged(self) -> list[tuple[str, int | None, str]]:
        """What it saw, but the new titles: announced only where they are made (not logged)."""
        return [(pid, s.seq, s.signal) for pid, s in self.seen if s.payload.get("changes") != ["title"]]

    async def until(self, check: Callable[[list[tuple[str, Signal]]], bool]) -> None:
        for _ in range(500):
            if check(self.seen):
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"not seen; got {self.logged()}")

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def finished(run_id: str) -> Callable[[list[tuple[str, Signal]]], bool]:
    return lambda seen: any(s.signal == sig.RUN_FINISHED and s.payload.get("runId") == run_id for _, s in seen)


def asked(seen: list[tuple[str, Signal]]) -> bool:
    return any(s.signal == sig.HIL_REQUESTED for _, s in seen)


async def test_an_account_stream_on_either_worker_sees_the_signals_of_runs_on_the_other(
    pg_url: str, tmp_path: Path
) -> None:
    async with two(pg_url, tmp_path, ScriptedModel(brain), [rm], approval=policy) as (a, b):
        pa = await a.spawn(owner="alice")
        await kept_by(a, pa.pid)
        pb = await b.process(pa.pid)
        on_a, on_b, other = Stream(a, "alice"), Stream(b, "alice"), Stream(b, "bob")
        await asyncio.sleep(0.1)  # (live from the first read on)
        try:
            run = await pa.send("hi")  # runs on A
            await on_b.until(finished(run.run_id))
            await on_a.until(finished(run.run_id))

            asking = await pa.send("delete")
            await on_b.until(asked)
            await on_a.until(asked)
            pending = await pb.pending_approvals()
            assert pending and pending[0].tool_name == "rm"
            assert await pb.hil(pending[0].request_id, "approve")  # decided on B (forwarded), run on A
            await on_a.until(finished(asking.run_id))
            await on_b.until(finished(asking.run_id))

            large = await pa.send("big")  # its approval is read from the log on B
            await on_b.until(lambda seen: sum(s.signal == sig.HIL_REQUESTED for _, s in seen) == 2)
            await on_a.until(lambda seen: sum(s.signal == sig.HIL_REQUESTED for _, s in seen) == 2)
            pending = await pa.pending_approvals()
            assert pending and await pa.hil(pending[0].request_id, "deny")
            await on_a.until(finished(large.run_id))
            await on_b.until(finished(large.run_id))
            await asyncio.sleep(0.2)  # (time for a duplicate to arrive)

            # the same signals on both workers, each once, in the log's order
            assert on_a.logged() == on_b.logged()
            assert len(set(on_a.logged())) == len(on_a.logged())
            seqs = [seq for _, seq, _ in on_a.logged()]
            assert seqs == sorted(seqs)
            names = [name for _, _, name in on_a.logged()]
            assert names.count(sig.RUN_FINISHED) == 3 and names.count(sig.HIL_REQUESTED) == 2
            assert sig.CHANGED in names  # the approvals answered
            big = [s for _, s in on_b.seen if s.signal == sig.HIL_REQUESTED][-1]
            assert big == [s for _, s in on_a.seen if s.signal == sig.HIL_REQUESTED][-1]
            assert BIG in str(big.payload)
            assert {pid for pid, _, _ in on_a.logged()} == {pa.pid}
            assert other.seen == []  # another account's stream has none of them
        finally:
            for stream in (on_a, on_b, other):
                await stream.close()
