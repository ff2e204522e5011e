"""Review of the gentle stop, the repeated-failure control, the reasoning level and the run
signals' payloads: each test here failed before the fix it comes with."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import pytest

from agentloop import ScriptedModel, ToolResultMessage
from agentloop.kernel import Kernel
from agentloop.loop.retries import MAX_KEPT, MAX_SAME_FAILURES, count_failures
from agentloop.messages import ToolCall, tool_error_result, user
from agentloop.models.base import ModelRequest
from agentloop.models.catalog import model_info
from agentloop.models.gemini import GeminiModel
from agentloop.process import signals as sig
from tests.process_support import gated


async def _finished(proc: Any) -> list[dict[str, Any]]:
    return [s.payload async for s in proc.signals(follow=False) if s.signal == sig.RUN_FINISHED]


# ----------------------------------------------------------------------------------- gentle stop


async def test_a_stop_that_waits_for_a_commit_ending_the_run_does_not_bring_the_run_back(tmp_path: Path) -> None:
    """``_ask_to_stop`` read the run before its transaction began: a commit that came first (the
    run's end, an abort's, or any newer step) was overwritten with the old record plus
    ``stopping`` - a finished run was active again, and the driver called the model for it."""
    gate = asyncio.Event()
    wait_gate, rm, brain, policy = gated(gate)
    model = ScriptedModel(brain)
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[wait_gate, rm], approval=policy
    ) as k:
        proc = await k.spawn(owner="a", text="gate")
        for _ in range(200):
            if k.engine.cached(proc.pid) is not None and (await proc.info()).current_run is not None:
                break
            await asyncio.sleep(0.01)
        live = await k.engine.live(proc.pid)
        holding = asyncio.Event()

        async def another_commit() -> None:
            """A transaction body in progress when the stop comes (on PostgreSQL every store call
            yields): it ends the run, as an abort or the run's last step does."""
            async with k.engine._tx(live) as tx:
                holding.set()
                await asyncio.sleep(0.1)
                await tx.set_run(None)

        committing = asyncio.create_task(another_commit())
        await holding.wait()
        await proc.stop()
        await committing
        record = await k.store.get_process(proc.pid)
        assert record is not None and record.current_run is None
        assert live.record.current_run is None
        gate.set()


async def test_a_stop_during_an_approval_wait_ends_the_run(tmp_path: Path) -> None:
    """A call waiting for a person's approval is not under way: a gentle stop does not wait for
    an answer that may never come (the run hung until someone answered), the call is not run,
    its question is withdrawn, and the model answers once more without tools."""
    gate = asyncio.Event()
    wait_gate, rm, brain, policy = gated(gate)
    model = ScriptedModel(brain)
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[wait_gate, rm], approval=policy
    ) as k:
        proc = await k.spawn(owner="a", text="delete")
        for _ in range(500):
            if await proc.pending_approvals():
                break
            await asyncio.sleep(0.01)
        assert await proc.pending_approvals()
        assert await proc.stop()
        await asyncio.wait_for(proc.wait_idle(), 5)
        assert await proc.pending_approvals() == []
        finished = await _finished(proc)
        results = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert [(f["status"], f["reason"]) for f in finished] == [("ok", "stopped")]
    assert len(results) == 1 and results[0].is_error and "removed" not in results[0].text
    last: ModelRequest = model.requests[-1]
    assert not last.tools


async def test_a_stop_during_the_model_call_that_then_asks_for_approval_ends_the_run(tmp_path: Path) -> None:
    """The stop comes while the model answers; its answer is a call the policy asks about: the
    question is withdrawn at once, and the run ends without waiting for a person."""
    gate = asyncio.Event()
    wait_gate, rm, brain, policy = gated(gate)
    model = ScriptedModel(brain, latency=0.3)
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[wait_gate, rm], approval=policy
    ) as k:
        proc = await k.spawn(owner="a", text="delete")
        await asyncio.sleep(0.1)  # the model is answering
        assert await proc.stop()
        await asyncio.wait_for(proc.wait_idle(), 5)
        assert await proc.pending_approvals() == []
        finished = await _finished(proc)
    assert [(f["status"], f["reason"]) for f in finished] == [("ok", "stopped")]


# ------------------------------------------------------------------------------------ payloads


async def test_a_reset_reports_the_queue_it_discarded_as_empty(tmp_path: Path) -> None:
    """The abort of a reset (or kill, or a parent's abort) drops the queued input in its own
    commit; ``proc.run.finished`` still counted it (the cache's count before the commit), so a
    client showed input waiting that would never run."""
    gate = asyncio.Event()
    wait_gate, rm, brain, _policy = gated(gate)
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(brain), workspace=tmp_path, tools=[wait_gate, rm]
    ) as k:
        proc = await k.spawn(owner="a", text="gate")
        await proc.send("later 1", mode="queue")
        await proc.send("later 2", mode="queue")
        seen: list[dict[str, Any]] = []

        async def follow() -> None:
            async for s in proc.signals():
                if s.signal == sig.RUN_FINISHED:
                    seen.append(s.payload)
                    return

        following = asyncio.create_task(follow())
        await asyncio.sleep(0.05)
        await proc.reset()
        await asyncio.wait_for(following, 5)
    assert seen[0]["status"] == "aborted" and seen[0]["queuedCount"] == 0


# ----------------------------------------------------------------------------------- reasoning


async def test_serves_reasoning_level_reaches_the_stateless_chat_agent_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve --reasoning`` (or the config's ``reasoning``) reached the processes but not the
    agent of ``/engine/chat``, which took only the timeout, guards and fallbacks."""
    import agentloop.server.app as app_module
    from agentloop.cli.approvals import parse_approval
    from agentloop.cli.config import Settings
    from agentloop.cli.serve import Running, ServeOptions, serve_async

    factories: list[Any] = []
    real = app_module.create_server

    def capture(ctx: Any, agent_factory: Any, **options: Any) -> Any:
        factories.append(agent_factory)
        return real(ctx, agent_factory, **options)

    monkeypatch.setattr(app_module, "create_server", capture)
    script = tmp_path / "script.json"
    script.write_text(json.dumps(["unused"]))
    (tmp_path / "data").mkdir()
    settings = Settings(model=f"scripted:{script}", model_source="test", reasoning="high")
    opts = ServeOptions(
        "127.0.0.1", 0, tmp_path / "data", tmp_path, settings, parse_approval("auto"), out=io.StringIO()
    )

    def ready(running: Running) -> None:
        running.stop()

    await asyncio.wait_for(serve_async(opts, signals=False, on_ready=ready), 30)
    assert factories and factories[0]().config.reasoning == "high"


# ------------------------------------------------------------------------------------- retries


def test_the_failure_counts_a_run_keeps_are_bounded_and_keep_the_latest() -> None:
    """Every distinct failure stayed in the counts for the rest of the run, and the durable run
    rewrites them with its record at every step: a long run failing in ever new ways (a shell
    command's changing output) made each step cost more. The latest failures are kept, so a
    repeat among them is still caught."""
    counts: dict[str, int] = {}

    def fail(*calls: ToolCall) -> bool:
        return count_failures(counts, list(calls), [tool_error_result(c, f"failed {c.name}") for c in calls])[1]

    for i in range(1000):
        assert not fail(ToolCall(id=f"c{i}", name=f"make-{i}", arguments={}))
    assert len(counts) <= MAX_KEPT
    repeat = ToolCall(id="r", name="fetch", arguments={"url": "x"})
    for i in range(MAX_SAME_FAILURES):  # between the repeats, other new failures
        assert not fail(repeat, *(ToolCall(id=f"n{i}{j}", name=f"new-{i}-{j}", arguments={}) for j in range(20)))
    assert fail(repeat) and len(counts) <= MAX_KEPT


@pytest.mark.parametrize(
    ("provider", "model_id", "reasons"),
    [
        ("gemini", "gemini-2.5-flash-preview-09-2025", True),
        ("gemini", "gemini-2.5-flash-lite-preview-06-17", True),
        ("gemini", "gemini-3-pro-preview", True),
        ("gemini", "gemini-2.0-flash-001", False),
        ("anthropic", "claude-opus-4-5", True),
        ("anthropic", "claude-3-7-sonnet-latest", True),
        ("anthropic", "claude-3-5-haiku-latest", False),
    ],
)
def test_thinking_models_not_listed_are_known_by_their_family(provider: str, model_id: str, reasons: bool) -> None:
    """Only OpenAI's unlisted reasoning families were known: on a Gemini preview or a newer
    Claude the run's level was dropped without a word (the model thought as it liked)."""
    assert model_info(provider, model_id).reasoning is reasons


def test_an_unlisted_gemini_pro_gets_its_least_budget_for_off() -> None:
    body = GeminiModel("gemini-3-pro-preview", api_key="k").build_body(
        ModelRequest(system_prompt="", messages=[user("think")], reasoning="off")
    )
    assert body["generationConfig"]["thinkingConfig"]["thinkingBudget"] == 128
