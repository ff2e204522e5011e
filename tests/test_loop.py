"""The loop's guarantees (DESIGN §2) and pi's loop scenarios (A1-A9, B5-B11), on a scripted model."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from agentloop import (
    Agent,
    AgentBusy,
    AssistantMessage,
    Block,
    Reply,
    ScriptedModel,
    SystemMessage,
    ToolResult,
    ToolResultMessage,
    call,
    tool,
    user,
)
from agentloop.events import event_to_dict
from agentloop.messages import TextContent
from agentloop.models.base import ModelRequest, ProviderError


@tool
def echo(text: str) -> str:
    """Echo the text."""
    return text


def types(events) -> list[str]:
    return [e.type for e in events]


async def collect(agent: Agent, prompt, **kw):
    return [e async for e in agent.stream(prompt, **kw)]


# ------------------------------------------------------------------ pi A-scenarios


async def test_a1_text_reply_events_and_messages():
    agent = Agent(model=ScriptedModel(["hello"]))
    events = await collect(agent, "hi")
    assert types(events)[:4] == ["agent_start", "turn_start", "message_start", "message_end"]
    assert types(events)[-2:] == ["turn_end", "agent_end"]
    end = events[-1]
    assert [m.role for m in end.messages] == ["user", "assistant"]
    assert end.stop_reason == "stop"
    assert all(isinstance(event_to_dict(e), dict) for e in events)  # every event has a wire form


async def test_a3_transform_context_runs_before_each_call_and_keeps_history():
    model = ScriptedModel(["ok"])
    agent = Agent(model=model)

    @agent.hooks.transform_context
    def last_two(messages):
        return messages[-2:]

    history = [user("1"), AssistantMessage(content=[TextContent(text="2")]), user("3")]
    result = await agent.run("4", history=history)
    assert [m.text for m in model.requests[0].messages] == ["3", "4"]
    assert len(result.messages) == 5  # stored history is untouched


async def test_a4_tool_call_and_result():
    seen: list[str] = []

    @tool
    def record(value: str) -> str:
        """Record."""
        seen.append(value)
        return value

    agent = Agent(model=ScriptedModel([Reply(tool_calls=[call("record", value="hello")]), "done"]), tools=[record])
    events = await collect(agent, "go")
    assert seen == ["hello"]
    ends = [e for e in events if e.type == "tool_execution_end"]
    assert [e.type for e in events if e.type.startswith("tool_execution")] == [
        "tool_execution_start",
        "tool_execution_end",
    ]
    assert ends[0].is_error is False and ends[0].result.text == "hello"
    assert [m.role for m in events[-1].messages] == ["user", "assistant", "toolResult", "assistant"]


async def test_a5_parallel_execution_results_in_source_order():
    log: list[str] = []

    @tool
    async def step(name: str, delay: float) -> str:
        """Step."""
        log.append(f"start {name}")
        await asyncio.sleep(delay)
        log.append(f"end {name}")
        return name

    model = ScriptedModel(
        [Reply(tool_calls=[call("step", name="1", delay=0.05), call("step", name="2", delay=0)]), "ok"]
    )
    agent = Agent(model=model, tools=[step])
    events = await collect(agent, "go")
    assert log.index("start 2") < log.index("end 1")  # the second started before the first finished
    results = [e.message.text for e in events if e.type == "message_end" and e.message.role == "toolResult"]
    assert results == ["1", "2"]
    assert [m.text for m in model.requests[1].messages if isinstance(m, ToolResultMessage)] == ["1", "2"]


async def test_a6_steering_skips_remaining_tools_in_sequential_mode():
    model = ScriptedModel([Reply(tool_calls=[call("first"), call("second")]), "ok"])
    ran: list[str] = []
    agent = Agent(model=model, tool_execution="sequential")
    run_holder = {}

    @tool
    def first() -> str:
        """First."""
        ran.append("first")
        run_holder["run"].steer("interrupt")
        return "1"

    @tool
    def second() -> str:
        """Second."""
        ran.append("second")
        return "2"

    agent.config.tools.update({"first": first, "second": second})
    run = agent.start("go", stream=True)
    run_holder["run"] = run
    events = [e async for e in run.events()]
    assert ran == ["first"]
    ends = [e for e in events if e.type == "tool_execution_end"]
    assert [e.is_error for e in ends] == [False, True]
    assert "Skipped due to queued user message" in ends[1].result.text
    assert any(e.type == "message_start" and getattr(e.message, "text", "") == "interrupt" for e in events)
    assert model.requests[1].messages[-1].text == "interrupt"


async def test_steering_skips_prepared_calls_in_parallel_mode():
    model = ScriptedModel([Reply(tool_calls=[call("echo", text="a"), call("echo", text="b")]), "ok"])
    agent = Agent(model=model, tools=[echo])

    @agent.hooks.before_tool_call
    def steer_during_preparation(info):
        if info.call.arguments["text"] == "a":
            agent.steer("stop that")

    result = await agent.run("go")
    results = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert all(r.is_error and "Skipped" in r.text for r in results)
    assert model.requests[1].messages[-1].text == "stop that"


async def test_a7_continue_needs_messages():
    agent = Agent(model=ScriptedModel([]))
    with pytest.raises(ValueError, match="Cannot continue: no messages in context"):
        await agent.run([])
    with pytest.raises(ValueError, match="Cannot continue from message role: assistant"):
        await agent.run([user("a"), AssistantMessage()])


async def test_a8_continue_from_existing_context_emits_no_user_events():
    agent = Agent(model=ScriptedModel(["answer"]))
    events = await collect(agent, [user("question")])
    ends = [e for e in events if e.type == "message_end"]
    assert len(ends) == 1 and ends[0].message.role == "assistant"
    assert [m.role for m in events[-1].messages] == ["assistant"]


async def test_a9_system_message_as_last_message_is_allowed():
    agent = Agent(model=ScriptedModel(["ok"]))
    result = await agent.run([user("a"), SystemMessage(content=[TextContent(text="event: file changed")])])
    assert result.text == "ok" and [m.role for m in result.new_messages] == ["assistant"]


# ------------------------------------------------------------------ pi B-scenarios (Agent/Run)


async def test_b5_b6_queued_input_is_not_in_history_until_delivered():
    gate = asyncio.Event()

    @tool
    async def wait() -> str:
        """Wait."""
        await gate.wait()
        return "waited"

    model = ScriptedModel([Reply(tool_calls=[call("wait")]), "first answer", "second answer"])
    agent = Agent(model=model, tools=[wait])
    run = agent.start("go")
    task = asyncio.create_task(run.result())
    await asyncio.sleep(0.01)
    run.follow_up("and then?")
    assert all(getattr(m, "text", None) != "and then?" for m in run.state.messages)
    gate.set()
    result = await task
    assert [m.role for m in result.messages] == ["user", "assistant", "toolResult", "assistant", "user", "assistant"]
    assert result.text == "second answer"  # b10: the follow-up ran after the agent would have stopped


async def test_b7_abort_while_idle_is_harmless():
    agent = Agent(model=ScriptedModel(lambda r: "x"))
    agent.abort()
    result = await agent.run("hi")
    assert result.stop_reason == "stop"
    run = agent.start("again")
    await run.result()
    run.abort()  # stale: the run is over
    assert (await run.result()).stop_reason == "stop"


async def test_b11_steering_is_delivered_one_at_a_time():
    gate = asyncio.Event()

    @tool
    async def wait() -> str:
        """Wait."""
        await gate.wait()
        return "w"

    model = ScriptedModel([Reply(tool_calls=[call("wait")]), "a1", "a2", "a3"])
    agent = Agent(model=model, tools=[wait])
    run = agent.start("go")
    task = asyncio.create_task(run.result())
    await asyncio.sleep(0.01)
    run.steer("s1")
    run.steer("s2")
    gate.set()
    result = await task
    assert [m.role for m in result.messages][-4:] == ["user", "assistant", "user", "assistant"]
    assert model.calls == 3 and result.text == "a2"


async def test_agent_level_controls_are_unambiguous():
    agent = Agent(model=ScriptedModel(lambda r: "x", latency=0.05))
    with pytest.raises(AgentBusy):
        agent.steer("nobody is running")
    t1 = asyncio.create_task(agent.run("a"))
    t2 = asyncio.create_task(agent.run("b"))
    await asyncio.sleep(0.01)
    with pytest.raises(AgentBusy):
        agent.steer("which one?")
    await asyncio.gather(t1, t2)


# ------------------------------------------------------------------ DESIGN §2 guarantees


async def test_no_default_iteration_cap():
    def brain(req: ModelRequest):
        n = sum(1 for m in req.messages if isinstance(m, ToolResultMessage))
        return Reply(tool_calls=[call("echo", text=str(n))]) if n < 300 else "finished"

    result = await Agent(model=ScriptedModel(brain), tools=[echo]).run("go")
    assert result.stop_reason == "stop" and result.text == "finished"
    assert sum(isinstance(m, ToolResultMessage) for m in result.messages) == 300


def _looping_model(**kw) -> ScriptedModel:
    def brain(req: ModelRequest):
        if not req.tools:
            return "final answer from what I know"
        return Reply(tool_calls=[call("echo", text="again")], **kw)

    return ScriptedModel(brain)


@pytest.mark.parametrize(
    ("guard", "value"),
    [("max_rounds", 3), ("max_tool_calls", 2), ("max_tokens", 40), ("max_cost", 0.0005)],
)
async def test_guards_end_with_a_final_tools_disabled_round(guard, value):
    from agentloop import Guards
    from agentloop.models.base import ModelInfo

    model = _looping_model()
    model.info = ModelInfo(provider="scripted", id="priced", input_cost=10.0, output_cost=10.0)
    agent = Agent(model=model, tools=[echo], guards=Guards(**{guard: value}))
    result = await agent.run("go")
    assert result.stop_reason == guard
    assert result.text == "final answer from what I know"
    assert model.requests[-1].tools == []  # the last round had tools disabled
    assert all(r.tools for r in model.requests[:-1])
    notices = [m for m in result.messages if isinstance(m, SystemMessage)]
    assert len(notices) == 1 and guard in notices[0].text and notices[0].kind == "guard"
    assert result.messages[0].text == "go"  # history is kept whole


async def test_max_tool_calls_refuses_the_excess_calls_of_a_turn():
    model = ScriptedModel(
        lambda r: Reply(tool_calls=[call("echo", text=str(i)) for i in range(3)]) if r.tools else "enough"
    )
    result = await Agent(model=model, tools=[echo], guards=__import__("agentloop").Guards(max_tool_calls=2)).run("go")
    results = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert [r.is_error for r in results] == [False, False, True]
    assert "budget" in results[2].text and result.stop_reason == "max_tool_calls"


async def test_wall_clock_guard():
    from agentloop import Guards

    @tool
    async def slow() -> str:
        """Slow."""
        await asyncio.sleep(0.06)
        return "z"

    model = ScriptedModel(lambda r: Reply(tool_calls=[call("slow")]) if r.tools else "time is up")
    result = await Agent(model=model, tools=[slow], guards=Guards(max_wall_clock=0.1)).run("go")
    assert result.stop_reason == "max_wall_clock" and result.text == "time is up"


async def test_final_round_tool_calls_are_dropped_but_words_kept():
    model = ScriptedModel(lambda r: Reply(text="still want tools", tool_calls=[call("echo", text="x")]))
    result = await Agent(model=model, tools=[echo], max_rounds=1).run("go")
    last = result.messages[-1]
    assert isinstance(last, AssistantMessage) and last.tool_calls == [] and last.text == "still want tools"
    assert result.stop_reason == "max_rounds"


async def test_text_with_tool_calls_is_kept_and_sent_back():
    model = ScriptedModel([Reply(text="Let me check.", tool_calls=[call("echo", text="x")]), "done"])
    await Agent(model=model, tools=[echo]).run("go")
    sent = model.requests[1].messages[1]
    assert isinstance(sent, AssistantMessage) and sent.text == "Let me check." and sent.tool_calls


async def test_concurrency_cap_and_sequential_barrier():
    active, peak, order = 0, 0, []

    @tool
    async def work(n: int) -> str:
        """Work."""
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        order.append(f"start {n}")
        await asyncio.sleep(0.02)
        active -= 1
        order.append(f"end {n}")
        return str(n)

    @tool(sequential=True)
    async def barrier() -> str:
        """Barrier."""
        order.append("barrier")
        return "b"

    calls = [call("work", n=i) for i in range(4)] + [call("barrier")] + [call("work", n=9)]
    model = ScriptedModel([Reply(tool_calls=calls), "ok"])
    await Agent(model=model, tools=[work, barrier], max_concurrency=2).run("go")
    assert peak == 2
    b = order.index("barrier")
    assert all(order.index(f"end {i}") < b for i in range(4)) and order.index("start 9") > b


async def test_tool_timeout_is_enforced_and_run_goes_on():
    @tool
    async def hang() -> str:
        """Hang."""
        await asyncio.sleep(60)
        return "never"

    @tool(timeout=0.05)
    async def hang_short() -> str:
        """Hang with its own timeout."""
        await asyncio.sleep(60)
        return "never"

    model = ScriptedModel([Reply(tool_calls=[call("hang"), call("hang_short")]), "moved on"])
    t0 = time.monotonic()
    result = await Agent(model=model, tools=[hang, hang_short], tool_timeout=0.1).run("go")
    assert time.monotonic() - t0 < 2
    r = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert r[0].is_error and "timed out after 0.1 s" in r[0].text
    assert r[1].is_error and "timed out after 0.05 s" in r[1].text
    assert result.text == "moved on"


async def test_a_blocking_tool_with_its_own_timeout_runs_in_a_thread_and_is_held_to_it():
    release = threading.Event()

    @tool(timeout=0.2)
    def blocking() -> str:
        """Block (a plain def: inline work could not be interrupted, so it gets a thread)."""
        release.wait(10)
        return "late"

    @tool
    def quick() -> str:
        """Answer at once."""
        return "quick"

    model = ScriptedModel([Reply(tool_calls=[call("blocking"), call("quick")]), "moved on"])
    t0 = time.monotonic()
    try:
        result = await Agent(model=model, tools=[blocking, quick]).run("go")
    finally:
        release.set()
    assert time.monotonic() - t0 < 5
    first, second = (m for m in result.messages if isinstance(m, ToolResultMessage))
    assert first.is_error and "timed out after 0.2 s" in first.text
    assert second.text == "quick" and result.text == "moved on"
    assert blocking.interruptible and not quick.interruptible  # no timeout of its own: still inline


async def test_a_plain_def_that_holds_the_loop_long_is_reported_once(caplog):
    @tool
    def slow() -> str:
        """Work inline for longer than a tool should hold the loop."""
        time.sleep(0.6)
        return "done"

    model = ScriptedModel([Reply(tool_calls=[call("slow")]), Reply(tool_calls=[call("slow")]), "ok"])
    with caplog.at_level(logging.WARNING, logger="agentloop.tools"):
        result = await Agent(model=model, tools=[slow]).run("go")
    assert result.text == "ok"
    [record] = [r for r in caplog.records if r.name == "agentloop.tools"]
    assert "tool slow ran 0.6 s inline" in record.getMessage() and "thread=True" in record.getMessage()


async def test_tool_failures_go_to_the_model():
    @tool
    def explode() -> str:
        """Explode."""
        raise RuntimeError("kaboom")

    model = ScriptedModel(
        [
            Reply(
                tool_calls=[
                    call("nope"),
                    call("echo", wrong="arg"),
                    call("explode"),
                    call("echo", text="fine"),
                ]
            ),
            "recovered",
        ]
    )
    result = await Agent(model=model, tools=[echo, explode]).run("go")
    r = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert r[0].is_error and r[0].text == "Tool nope not found"
    assert r[1].is_error and 'Validation failed for tool "echo"' in r[1].text and "text: Field required" in r[1].text
    assert r[2].is_error and "kaboom" in r[2].text
    assert not r[3].is_error and r[3].text == "fine"
    assert result.stop_reason == "stop" and result.text == "recovered"


async def test_before_hook_blocks_and_after_hook_replaces():
    model = ScriptedModel([Reply(tool_calls=[call("echo", text="secret"), call("echo", text="public")]), "ok"])
    agent = Agent(model=model, tools=[echo])

    @agent.hooks.before_tool_call
    async def no_secrets(info):
        return Block("secrets are not echoed") if info.args["text"] == "secret" else None

    @agent.hooks.after_tool_call
    def shout(info, result):
        return ToolResult.text(result.content[0].text.upper())

    result = await agent.run("go")
    r = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert r[0].is_error and r[0].text == "secrets are not echoed"
    assert not r[1].is_error and r[1].text == "PUBLIC"


async def test_results_reach_the_model_unmodified():
    payload = "  <b>raw</b>\n\twith whitespace  "

    @tool
    def raw() -> str:
        """Raw."""
        return payload

    model = ScriptedModel([Reply(tool_calls=[call("raw")]), "ok"])
    await Agent(model=model, tools=[raw]).run("go")
    assert model.requests[1].messages[-1].text == payload


async def test_transient_provider_errors_are_retried():
    from agentloop import RetryPolicy

    model = ScriptedModel([ProviderError("overloaded", kind="rate_limit", retry_after=0.01), "ok"])
    agent = Agent(model=model, retry=RetryPolicy(base_delay=0.01))
    events = await collect(agent, "hi")
    retries = [e for e in events if e.type == "model_retry"]
    assert len(retries) == 1 and retries[0].delay == 0.01  # the provider's retry-after is honoured
    assert events[-1].stop_reason == "stop"
    assert [m.role for m in events[-1].messages] == ["user", "assistant"]  # the failed attempt is not kept


async def test_fallback_then_error_with_visible_system_message():
    from agentloop import RetryPolicy

    primary = ScriptedModel([ProviderError("down", kind="server")] * 3)
    backup = ScriptedModel(["from backup"])
    ok = await Agent(model=primary, fallbacks=[backup], retry=RetryPolicy(max_retries=2, base_delay=0.001)).run("hi")
    assert ok.text == "from backup" and primary.calls == 3

    dead = ScriptedModel([ProviderError("bad key", kind="auth")] * 5)
    failed = await Agent(model=dead, retry=RetryPolicy(base_delay=0.001)).run("hi")
    assert dead.calls == 1  # not transient: no retry
    assert failed.stop_reason == "error" and "bad key" in (failed.error or "")
    assert isinstance(failed.messages[-1], SystemMessage) and failed.messages[-1].kind == "error"
    assert not failed.ok


async def test_a_provider_that_raises_never_breaks_the_loop():
    class Broken(ScriptedModel):
        async def _stream(self, request, out):
            raise RuntimeError("adapter bug")
            yield  # pragma: no cover

        async def respond(self, request):  # use the generic path
            return await super(ScriptedModel, self).respond(request)

    result = await Agent(model=Broken([])).run("hi")
    assert result.stop_reason == "error" and "adapter bug" in (result.error or "")
    events = await collect(Agent(model=Broken([])), "hi")
    assert events[-1].type == "agent_end" and events[-1].stop_reason == "error"


async def test_length_stop_reason_finishes():
    msg = AssistantMessage(content=[TextContent(text="truncat")], stop_reason="length")
    result = await Agent(model=ScriptedModel([msg])).run("hi")
    assert result.stop_reason == "length"


# ------------------------------------------------------------------ abort


async def test_abort_during_model_stream():
    agent = Agent(model=ScriptedModel(["never"], latency=5))
    task = asyncio.create_task(agent.run("hi"))
    await asyncio.sleep(0.02)
    agent.abort()
    result = await asyncio.wait_for(task, 1)
    assert result.stop_reason == "aborted"
    last = result.messages[-1]
    assert isinstance(last, AssistantMessage) and last.stop_reason == "aborted"


async def test_abort_mid_stream_keeps_partial_text_and_drops_calls():
    model = ScriptedModel([Reply(text="abcdefghij" * 20, tool_calls=[call("echo", text="x")])], chunk=1)
    agent = Agent(model=model, tools=[echo])
    run = agent.start("hi", stream=True)
    async for event in run.events():
        if event.type == "message_update" and len(event.message.text) > 30:
            run.abort()
    result = await run.result()
    last = result.messages[-1]
    assert result.stop_reason == "aborted" and last.stop_reason == "aborted"
    assert 30 < len(last.text) < 200 and last.tool_calls == []


async def test_abort_during_tools_cancels_them_with_terminal_results():
    cancelled: list[str] = []

    @tool
    async def slow(n: int) -> str:
        """Slow."""
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(str(n))
            raise
        return "late"

    model = ScriptedModel([Reply(tool_calls=[call("echo", text="quick"), call("slow", n=1), call("slow", n=2)])])
    agent = Agent(model=model, tools=[echo, slow])
    task = asyncio.create_task(agent.run("go"))
    await asyncio.sleep(0.05)
    agent.abort()
    result = await asyncio.wait_for(task, 2)
    assert result.stop_reason == "aborted" and sorted(cancelled) == ["1", "2"]
    r = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert [x.text for x in r] == ["quick", *["Tool call cancelled: the run was aborted."] * 2]
    assert r[1].is_error and not r[0].is_error
    # the history is valid: a new run continues from it
    follow = await Agent(model=ScriptedModel(["resumed"])).run("again", history=result.messages)
    assert follow.text == "resumed"


async def test_abort_from_inside_a_tool():
    holder = {}

    @tool
    def stop_now() -> str:
        """Stop."""
        holder["run"].abort()
        return "stopping"

    model = ScriptedModel([Reply(tool_calls=[call("stop_now")]), "must not be called"])
    run = Agent(model=model, tools=[stop_now]).start("go")
    holder["run"] = run
    result = await run.result()
    assert result.stop_reason == "aborted" and model.calls == 1


async def test_leaving_the_stream_early_aborts_the_run():
    model = ScriptedModel(["x"] * 3, latency=0.01)
    agent = Agent(model=model)
    async for event in agent.stream("hi"):
        if event.type == "message_start":
            break
    await asyncio.sleep(0.05)
    assert not agent._active


def test_run_sync():
    result = Agent(model=ScriptedModel(["sync ok"])).run_sync("hi")
    assert result.text == "sync ok" and result.ok


async def test_concurrent_runs_share_one_agent():
    agent = Agent(model=ScriptedModel(lambda r: r.messages[0].text.upper(), latency=0.01), tools=[echo])
    results = await asyncio.gather(*(agent.run(f"r{i}") for i in range(50)))
    assert [r.text for r in results] == [f"R{i}" for i in range(50)]


async def test_switching_to_a_fallback_is_announced():
    from agentloop import RetryPolicy
    from agentloop.models.base import ModelInfo

    primary = ScriptedModel([ProviderError("down", kind="server")] * 2)
    backup = ScriptedModel(["ok"], info=ModelInfo(provider="scripted", id="backup"))
    agent = Agent(model=primary, fallbacks=[backup], retry=RetryPolicy(max_retries=1, base_delay=0.001))
    events = await collect(agent, "hi")
    retries = [(e.attempt, e.model) for e in events if e.type == "model_retry"]
    assert retries == [(1, "scripted:scripted"), (0, "scripted:backup")]
    assert events[-1].stop_reason == "stop"


async def test_input_that_is_not_text_or_messages_is_refused_up_front():
    agent = Agent(model=ScriptedModel(["never"]))
    for bad in (None, 123, [None], ["hi"]):
        with pytest.raises(TypeError):
            await agent.run(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await agent.run("hi", history=[{"role": "user", "content": "x"}])  # type: ignore[list-item]


async def test_steering_a_finished_run_is_an_error_not_a_lost_message():
    agent = Agent(model=ScriptedModel(["done"]))
    run = agent.start("hi")
    await run.result()
    with pytest.raises(AgentBusy, match="the run has ended"):
        run.steer("late")
    with pytest.raises(AgentBusy, match="the run has ended"):
        run.follow_up("later")
