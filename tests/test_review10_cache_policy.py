"""Review of the durable ToolRetry signals (``process/calls.py`` ``post_turn``): the episode is a
report, logged in a transaction of its own after the step; a failure to log it must neither fail
the step nor skip the ``Stop`` the spent budget asks for."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, ToolRetry, call
from agentloop.kernel import Kernel
from agentloop.messages import ToolResultMessage
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.api import approve_everything
from agentloop.process.tx import _Tx
from agentloop.tools.builtin import builtin_tools

RETRY = (sig.TOOL_RETRY_SCHEDULED, sig.TOOL_RETRY_RESOLVED, sig.TOOL_RETRY_EXHAUSTED)


async def test_a_retry_episode_that_cannot_be_logged_still_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = _Tx.signal

    async def failing(self: _Tx, signal_name: str, /, **payload: Any) -> None:
        if signal_name in RETRY:
            raise RuntimeError("the log is out of space")
        await real(self, signal_name, **payload)

    monkeypatch.setattr(_Tx, "signal", failing)
    paths = [f"missing{i}.txt" for i in range(8)]

    def brain(request: ModelRequest) -> Reply | str:
        seen = sum(1 for m in request.messages if isinstance(m, ToolResultMessage))
        if not request.tools:  # (the stop's last answer, without tools)
            return "stopped here"
        return Reply(tool_calls=[call("Read", path=paths[seen])]) if seen < len(paths) else "done"

    async with Kernel.open(
        f"sqlite:///{tmp_path}/k.db",
        model=ScriptedModel(brain),
        workspace=tmp_path,
        tools=builtin_tools(tmp_path, shell=False),
        approval=approve_everything,
        pieces=[ToolRetry()],
    ) as k:
        proc = await k.spawn(owner="me", text="find it")
        await asyncio.wait_for(proc.wait_idle(), 10)
        log = [(s.signal, s.payload) async for s in proc.signals(after_seq=0, follow=False)]
    started = [p for name, p in log if name == sig.TOOL_STARTED]
    [finished] = [p for name, p in log if name == sig.RUN_FINISHED]
    # the not_found budget (2) is spent at the third failure: the run stops there, as when logged
    assert len(started) == 3
    assert finished.get("stopReason", finished.get("reason")) == "stopped", finished
