"""GSV's process-loop scenarios, on agentloop's durable runner: coalesced wake-ups, late results,
batch completion, a user taking over during a shell command, and a late tool result after reset."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Kernel
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process.api import approve_everything
from agentloop.process.calls import settle
from agentloop.tools.builtin import builtin_tools


def kernel(tmp_path: Path, model, tools, **kw):
    return Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=tools, approval=approve_everything, **kw
    )


async def test_run_started_and_finished_say_what_a_watcher_needs_without_reading_the_history(tmp_path):
    """GSV's payloads: the run's answer, its usage and the input waiting to start the next run on
    proc.run.finished (``aborted: true`` on an abort); the waiting input on proc.run.started."""
    gate = asyncio.Event()

    @tool
    async def wait() -> str:
        """Wait until let go."""
        await gate.wait()
        return "let go"

    model = ScriptedModel(lambda r: Reply(tool_calls=[call("wait")]) if r.messages[-1].text == "work" else "answered")
    async with kernel(tmp_path, model, [wait]) as k:
        proc = await k.spawn(owner="a")
        first = await proc.send("work")
        await proc.send("then this", mode="queue")
        await proc.send("and this", mode="queue")
        await asyncio.sleep(0.1)
        assert await proc.abort(run_id=first.run_id)
        await proc.wait_idle()
        signals = [s.payload async for s in proc.signals(follow=False) if s.signal.startswith("proc.run.")]
    started = [p for p in signals if "queuedCount" in p and "status" not in p]
    finished = [p for p in signals if "status" in p]
    assert [p["queuedCount"] for p in started] == [0, 1, 0]  # each queued input starts a run of its own
    aborted, *answered = finished
    assert aborted["status"] == "aborted" and aborted["aborted"] is True and aborted["text"] is None
    assert aborted["queuedCount"] == 2 and aborted["usage"]["total_tokens"] > 0
    assert [(p["text"], p["queuedCount"]) for p in answered] == [("answered", 1), ("answered", 0)]
    assert not any("aborted" in p for p in answered)
    assert all(isinstance(p["timestamp"], int) for p in started + finished)


async def test_overlapping_wake_ups_coalesce_into_one_driver(tmp_path):
    model = ScriptedModel(["only one answer"], latency=0.05)

    @tool
    def noop() -> str:
        """Nothing."""
        return ""

    async with kernel(tmp_path, model, [noop]) as k:
        proc = await k.spawn(owner="a")
        await proc.send("hi")
        for _ in range(50):  # a storm of wake-ups (timers, results, decisions) while a step runs
            k.engine.wake(proc.pid)
            await asyncio.sleep(0)
        await proc.wait_idle()
        assert model.calls == 1
        assert [m.role for m in await proc.messages()] == ["user", "assistant"]


async def test_the_run_waits_for_the_whole_batch_and_late_results_change_nothing(tmp_path):
    gate = asyncio.Event()

    @tool
    async def fast() -> str:
        """Fast."""
        return "fast done"

    @tool
    async def gated() -> str:
        """Waits for the gate."""
        await gate.wait()
        return "gated done"

    model = ScriptedModel([Reply(tool_calls=[call("fast"), call("gated")]), "both seen"])
    async with kernel(tmp_path, model, [fast, gated]) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        await asyncio.sleep(0.1)
        assert model.calls == 1  # the fast result alone does not continue the run
        rows = await k.store.calls(proc.pid)
        assert sorted(r.status for r in rows) == ["completed", "dispatched"]
        gate.set()
        await proc.wait_idle()
        assert model.calls == 2
        results = [m.text for m in await proc.messages() if isinstance(m, ToolResultMessage)]
        assert results == ["fast done", "gated done"]
        # a duplicate result for a settled call (a device answering twice) is ignored
        row = rows[0]
        async with k.engine._tx(await k.engine.live(proc.pid)) as tx:
            again = await settle(
                k.engine,
                tx,
                row,
                ToolResultMessage(tool_call_id=row.tool_call_id, tool_name=row.tool_name, content=[]),
                "completed",
                ("dispatched",),
            )
        assert not again and len(await proc.messages()) == 5


async def test_user_takeover_during_a_shell_command_kills_it(tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    model = ScriptedModel(
        lambda r: (
            Reply(tool_calls=[call("Shell", command=f"echo $$ > {pid_file}; exec sleep 1000")])
            if isinstance(r.messages[-1], UserMessage) and r.messages[-1].text == "long"
            else "took over"
        )
    )
    async with kernel(tmp_path, model, builtin_tools(tmp_path)) as k:
        proc = await k.spawn(owner="a", cwd=tmp_path)
        await proc.send("long")
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text().strip():
                break
            await asyncio.sleep(0.02)
        sleeper = int(pid_file.read_text())
        await proc.send("stop, do this instead", mode="interrupt")
        await proc.wait_idle()
        assert not _alive(sleeper)
        msgs = await proc.messages()
        assert msgs[-1].text == "took over"
        cancelled = [m for m in msgs if isinstance(m, ToolResultMessage)]
        assert len(cancelled) == 1 and "cancelled" in cancelled[0].text


async def test_reset_during_a_tool_call_drops_its_late_result(tmp_path):
    release = asyncio.Event()

    @tool
    async def stuck() -> str:
        """Slow to come back."""
        await release.wait()
        return "late"

    def brain(r: ModelRequest):
        return Reply(tool_calls=[call("stuck")]) if isinstance(r.messages[-1], UserMessage) else "after"

    async with kernel(tmp_path, ScriptedModel(brain), [stuck]) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        await asyncio.sleep(0.05)
        await proc.reset()
        release.set()
        await asyncio.sleep(0.05)
        assert await proc.messages() == [] and await k.store.calls(proc.pid) == []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return os.path.exists(f"/proc/{pid}")


async def test_a_dispatch_past_its_durable_deadline_fails_when_nobody_works_on_it(tmp_path):
    @tool(timeout=0.3)
    async def remote() -> str:
        """Stands for a call answered elsewhere (a device)."""
        await asyncio.sleep(30)
        return "never"

    model = ScriptedModel([Reply(tool_calls=[call("remote")]), "gave up on it"])
    async with kernel(tmp_path, model, [remote]) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        await asyncio.sleep(0.05)
        live = await k.engine.live(proc.pid)
        for task in list(live.tools.values()):  # the worker disappears (the device went away)
            live.tools.clear()
            task.cancel()
        await asyncio.wait_for(proc.wait_idle(), 5)
        result = next(m for m in await proc.messages() if isinstance(m, ToolResultMessage))
        assert result.is_error and "no result before its deadline" in result.text
        assert (await proc.messages())[-1].text == "gave up on it"
