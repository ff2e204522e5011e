"""A durable process honours the loop settings the in-memory ``Agent`` does: before-tool-call
hooks, sequential execution and concurrency caps, the guards, post-turn hooks; and what a person
decides (remember, abort) applies to exactly what was shown."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentloop import Block, Guards, Hooks, Reply, ScriptedModel, ToolResultMessage, TurnInfo, call, tool
from agentloop.kernel import Kernel
from agentloop.loop.hooks import ToolCallInfo
from agentloop.loop.runner import CANCELLED
from agentloop.models.base import ModelRequest
from tests.process_support import echo, kernel

ASK_SHELL = {"default": "auto", "rules": [{"match": "shell.exec", "action": "ask"}]}


class Overlap:
    """A tool that records how many of its calls ran at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.order: list[str] = []

    def tool(self, name: str = "work", *, sequential: bool = False) -> Any:
        @tool(name=name, sequential=sequential)
        async def work(label: str) -> str:
            """Work for a moment."""
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.order.append(f"start {label}")
            await asyncio.sleep(0.05)
            self.order.append(f"end {label}")
            self.now -= 1
            return label

        return work


def _results(messages: list[Any]) -> list[str]:
    return [m.text for m in messages if isinstance(m, ToolResultMessage)]


async def _run(k: Kernel, text: str = "go") -> list[Any]:
    proc = await k.spawn(owner="a")
    await proc.send(text)
    await proc.wait_idle()
    return await proc.messages()


def _three_calls(name: str = "work") -> ScriptedModel:
    return ScriptedModel([Reply(tool_calls=[call(name, label=x) for x in "abc"]), "done"])


async def test_a_before_tool_call_hook_blocks_a_call_in_a_durable_process(tmp_path):
    overlap = Overlap()
    hooks = Hooks()
    seen: list[str] = []

    @hooks.before_tool_call
    def guard(info: ToolCallInfo) -> Block | None:
        seen.append(info.args["label"])
        return Block("b is not allowed") if info.args["label"] == "b" else None

    async with kernel(tmp_path, _three_calls(), tools=[overlap.tool()], hooks=hooks) as k:
        results = _results(await _run(k))
    assert results == ["a", "b is not allowed", "c"]
    assert sorted(seen) == ["a", "b", "c"]
    assert "start b" not in overlap.order


@pytest.mark.parametrize("options", [{"tool_execution": "sequential"}, {"max_concurrency": 1}])
async def test_sequential_mode_and_a_concurrency_cap_hold_in_a_durable_process(tmp_path, options):
    overlap = Overlap()
    async with kernel(tmp_path, _three_calls(), tools=[overlap.tool()], **options) as k:
        results = _results(await _run(k))
    assert results == ["a", "b", "c"]
    assert overlap.peak == 1
    assert overlap.order == ["start a", "end a", "start b", "end b", "start c", "end c"]


async def test_a_sequential_tool_runs_alone_between_the_others(tmp_path):
    overlap = Overlap()
    model = ScriptedModel(
        [Reply(tool_calls=[call("work", label="a"), call("barrier", label="b"), call("work", label="c")]), "done"]
    )
    async with kernel(tmp_path, model, tools=[overlap.tool(), overlap.tool("barrier", sequential=True)]) as k:
        assert _results(await _run(k)) == ["a", "b", "c"]
    assert overlap.order == ["start a", "end a", "start b", "end b", "start c", "end c"]


async def test_the_tool_call_budget_caps_a_batch_and_ends_with_a_tools_free_round(tmp_path):
    overlap = Overlap()
    model = ScriptedModel(
        lambda r: Reply(tool_calls=[call("work", label=x) for x in "abc"]) if r.tools else "out of budget"
    )
    async with kernel(tmp_path, model, tools=[overlap.tool()], guards=Guards(max_tool_calls=2)) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        await proc.wait_idle()
        messages = await proc.messages()
        finished = [s async for s in proc.signals(follow=False) if s.signal == "proc.run.finished"]
    assert _results(messages) == ["a", "b", "Not run: the run's tool call budget is used up."]
    assert "start c" not in overlap.order
    assert messages[-1].text == "out of budget"
    assert finished[0].payload["reason"] == "max_tool_calls"


async def test_max_rounds_ends_a_durable_run_with_a_tools_free_round(tmp_path):
    requests: list[ModelRequest] = []

    def brain(request: ModelRequest) -> Reply | str:
        requests.append(request)
        return Reply(tool_calls=[call("echo", text="again")]) if request.tools else "stopping here"

    async with kernel(tmp_path, ScriptedModel(brain), guards=Guards(max_rounds=2)) as k:
        proc = await k.spawn(owner="a")
        await proc.send("loop forever")
        await proc.wait_idle()
        finished = [s async for s in proc.signals(follow=False) if s.signal == "proc.run.finished"]
        last = (await proc.messages())[-1]
    assert [bool(r.tools) for r in requests] == [True, True, False]
    assert last.text == "stopping here"
    assert isinstance(finished[0].payload.pop("timestamp"), int)
    assert finished[0].payload == {
        "pid": proc.pid,
        "runId": finished[0].payload["runId"],
        "status": "ok",
        "reason": "max_rounds",
        "text": "stopping here",  # the run's answer, for a watcher that does not read the history
        "usage": {"input": 30, "output": 15, "total_tokens": 45, "cost": 0.0},
        "queuedCount": 0,
    }


async def test_a_final_round_of_nothing_but_calls_finishes_with_no_text(tmp_path):
    """A model that calls tools in its tools-free final round: the calls are dropped, and the run
    ends with no answer, which ``proc.run.finished`` says as null, not as an empty text."""
    model = ScriptedModel(lambda r: Reply(tool_calls=[call("echo", text="again")]))
    async with kernel(tmp_path, model, guards=Guards(max_rounds=1)) as k:
        proc = await k.spawn(owner="a", text="loop")
        await proc.wait_idle()
        finished = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.run.finished"]
    assert [(f["reason"], f["text"]) for f in finished] == [("max_rounds", None)]


async def test_post_turn_hooks_run_after_each_turn_of_a_durable_run(tmp_path):
    hooks = Hooks()
    turns: list[tuple[int, str]] = []

    @hooks.on("post_turn")
    def after(info: TurnInfo) -> None:
        turns.append((info.turn, info.messages[-1].role))

    model = ScriptedModel([Reply(tool_calls=[call("echo", text="x")]), "done"])
    async with kernel(tmp_path, model, hooks=hooks) as k:
        await _run(k)
    assert turns == [(0, "toolResult"), (1, "assistant")]


@pytest.mark.parametrize("options", [{}, {"tool_execution": "sequential"}, {"max_concurrency": 1}])
async def test_a_durable_run_refuses_calls_to_tools_a_hook_kept_back(tmp_path, options):
    hooks = Hooks()
    calls: list[str] = []

    @tool
    def danger() -> str:
        """Danger."""
        calls.append("danger")
        return "boom"

    @hooks.on("pre_tool_materialization")
    def hide_danger(info: TurnInfo) -> list[Any]:
        return [t for t in info.tools if t.name != "danger"]

    # the hidden call comes after calls that must wait their turn (sequential, concurrency 1)
    model = ScriptedModel([Reply(tool_calls=[call("echo", text="a"), call("echo", text="x"), call("danger")]), "done"])
    async with kernel(tmp_path, model, tools=[danger, echo], hooks=hooks, **options) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        await proc.wait_idle()
        results = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)]
        finished = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.run.tool.finished"]
    assert calls == []
    assert [r.is_error for r in results] == [False, False, True]
    assert [r.text for r in results[:2]] == ["a", "x"] and "danger is not available in this turn" in results[2].text
    assert sorted(f["ok"] for f in finished) == [False, True, True]


async def test_each_model_call_of_a_process_carries_its_pid_as_the_cache_key(tmp_path):
    model = ScriptedModel([Reply(tool_calls=[call("echo", text="x")]), "done", "again"])
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        for text in ("go", "more"):
            await proc.send(text)
            await proc.wait_idle()
    assert [r.cache_key for r in model.requests] == [proc.pid] * 3


def _device_shell() -> Any:
    @tool(name="Shell")
    def shell(command: str, target: str = "local") -> str:
        """Run a command on a target."""
        return f"{target}: {command}"

    return shell


async def test_remember_on_a_device_call_allows_that_device_only(tmp_path):
    model = ScriptedModel(
        [
            Reply(tool_calls=[call("Shell", command="ls", target="laptop")]),
            "first",
            Reply(tool_calls=[call("Shell", command="ls", target="local")]),
            "second",
            Reply(tool_calls=[call("Shell", command="pwd", target="laptop")]),
            "third",
        ]
    )
    async with kernel(tmp_path, model, tools=[_device_shell()], policy=ASK_SHELL) as k:
        proc = await k.spawn(owner="a")
        await proc.send("on the laptop")
        [request] = await _pending(proc)
        await proc.hil(request.request_id, "approve", remember=True)
        await proc.wait_idle()
        await proc.send("here")
        [here] = await _pending(proc)  # the server itself still asks
        assert here.args["target"] == "local"
        await proc.hil(here.request_id, "approve")
        await proc.wait_idle()
        await proc.send("laptop again")
        await proc.wait_idle()  # remembered for the laptop: no question
        assert await proc.pending_approvals() == []
        assert _results(await proc.messages()) == ["laptop: ls", "local: ls", "laptop: pwd"]


async def _pending(proc: Any) -> list[Any]:
    for _ in range(200):
        pending = await proc.pending_approvals()
        if pending:
            return list(pending)
        await asyncio.sleep(0.01)
    raise AssertionError("no approval was requested")


async def test_abort_clears_the_pending_approval(tmp_path):
    model = ScriptedModel([Reply(tool_calls=[call("Shell", command="rm -rf x")]), "never"])
    async with kernel(tmp_path, model, tools=[_device_shell()], policy=ASK_SHELL) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        [request] = await _pending(proc)
        assert await proc.abort()
        await proc.wait_idle()
        assert await proc.pending_approvals() == []
        with pytest.raises(KeyError):
            await proc.hil(request.request_id, "approve")
        assert _results(await proc.messages()) == [CANCELLED]


async def test_a_system_event_runs_before_input_queued_earlier(tmp_path):
    model = ScriptedModel(lambda r: f"re: {r.messages[-1].text}", latency=0.1)
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        await proc.send("first")
        await asyncio.sleep(0.02)
        await proc.send("queued before the event", mode="queue")
        await k.signal(proc.pid, "the build finished")
        await proc.wait_idle()
        texts = [m.text for m in await proc.messages()]
    # the event joins the running run; the queued input runs after it, as its own run
    assert texts.index("the build finished") < texts.index("queued before the event")


async def test_system_events_are_injected_before_steer_input_that_came_first(tmp_path):
    model = ScriptedModel([Reply(tool_calls=[call("slow", seconds=0.2)]), "done"])
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        await proc.send("start")
        await asyncio.sleep(0.05)  # the tool is running
        await proc.send("steer first", mode="steer")
        await k.signal(proc.pid, "event second")
        await proc.wait_idle()
        sent = [m.text for m in model.requests[1].messages]
    assert sent[-2:] == ["event second", "steer first"]


async def test_steer_skips_the_calls_still_waiting_their_turn_in_a_durable_process(tmp_path):
    """As in the in-memory runner: what the user says while a sequential batch runs makes the
    calls not yet started stale; the call in flight finishes, the rest get a 'skipped' result and
    the steer message reaches the model right after them."""
    overlap = Overlap()
    requests: list[ModelRequest] = []

    def brain(request: ModelRequest) -> Reply | str:
        requests.append(request)
        if len(requests) == 1:
            return Reply(tool_calls=[call("work", label=x) for x in "abc"])
        return "changed course"

    async with kernel(tmp_path, ScriptedModel(brain), tools=[overlap.tool()], tool_execution="sequential") as k:
        proc = await k.spawn(owner="a")
        first = await proc.send("go")
        while "start a" not in overlap.order:
            await asyncio.sleep(0.005)
        steer = await proc.send("stop, do something else", mode="steer")
        await proc.wait_idle()
        messages = await proc.messages()
    assert steer.queued and steer.run_id == first.run_id
    assert overlap.order == ["start a", "end a"]
    results = [m for m in messages if isinstance(m, ToolResultMessage)]
    assert len(results) == 3 and results[0].text == "a"
    assert all(r.is_error and "Skipped" in r.text for r in results[1:])
    assert requests[-1].messages[-1].text == "stop, do something else"
    assert messages[-1].text == "changed course"
