"""Failover (DESIGN §6): a worker SIGKILLed mid-run on a shared PostgreSQL database loses its
lease when it expires, and another worker's sweep claims the process and finishes the run; the
tool that was in flight (not idempotent) is reported as interrupted, never run again."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")

from agentloop import ScriptedModel, ToolResultMessage, tool
from agentloop.kernel import Kernel
from agentloop.process import signals as sig
from tests.failover_worker import LEASE_TTL, brain

ROOT = Path(__file__).resolve().parent.parent


def _kill_once_the_tool_runs(url: str, effects: Path) -> None:
    """Start the doomed worker and SIGKILL it as soon as its tool is in flight."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    doomed = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "failover_worker.py"), url, str(effects)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert doomed.stdout is not None
        line = doomed.stdout.readline()
        assert line.strip() == "TOOL", line + (doomed.stderr.read() if doomed.stderr else "")
    finally:
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)


@pytest.mark.timeout(120)
async def test_a_dead_workers_run_is_finished_by_another(pg_url: str, tmp_path: Path) -> None:
    effects = tmp_path / "effects.txt"
    await asyncio.to_thread(_kill_once_the_tool_runs, pg_url, effects)
    killed = time.monotonic()

    ran: list[int] = []

    @tool
    async def append_slow(n: int) -> str:
        """The survivor's copy of the tool: it must not be called again."""
        ran.append(n)
        return "appended"

    async with Kernel.open(
        pg_url,
        model=ScriptedModel(brain),
        tools=[append_slow],
        workspace=tmp_path,
        data_dir=tmp_path,
        worker="survivor",
        lease_ttl=5.0,
        poll_interval=0.2,
    ) as k:
        proc = await k.process("p1")
        await asyncio.wait_for(proc.wait_idle(), 30)  # waits for the sweep, then for the run
        recovered = time.monotonic() - killed
        msgs = await proc.messages()
        events = [s async for s in proc.signals(follow=False)]
    assert [m.role for m in msgs] == ["user", "assistant", "toolResult", "assistant"]
    result = msgs[2]
    assert isinstance(result, ToolResultMessage) and result.is_error
    assert "interrupted by a restart" in result.text
    assert msgs[-1].text == "finished"
    assert ran == [] and not effects.exists()  # neither worker completed the tool
    finished = [s.payload for s in events if s.signal == sig.RUN_FINISHED]
    assert len(finished) == 1 and finished[0]["status"] == "ok"
    assert recovered < LEASE_TTL + 10  # the lease's expiry plus a sweep, not a manual restart
