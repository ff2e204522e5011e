"""OpenTelemetry tracing (``agentloop.tracing``): GenAI spans of in-memory runs and durable processes.

Every test exports to its own ``TracerProvider`` (an ``InMemorySpanExporter`` behind a
``SimpleSpanProcessor``), never the global one.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from contextlib import aclosing

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from agentloop import Agent, Reply, ScriptedModel, call, tool
from agentloop.kernel import Kernel
from agentloop.messages import Cost, Usage
from agentloop.process import signals as sig
from agentloop.process.signals import Signal
from agentloop.tracing import Tracing, trace_kernel

PROMPT = "what does the secret note say?"
ANSWER = "it says swordfish"


@tool
def echo(text: str) -> str:
    """Echo the text."""
    return text


@tool
def broken(text: str) -> str:
    """Always fails."""
    raise RuntimeError("the disk is on fire")


@pytest.fixture
def traced() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def by_name(spans: tuple[ReadableSpan, ...] | list[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    found: dict[str, list[ReadableSpan]] = {}
    for s in spans:
        found.setdefault(s.name, []).append(s)
    return found


def w1_model() -> ScriptedModel:
    return ScriptedModel(
        [
            Reply(tool_calls=[call("echo", text="swordfish")], input_tokens=100, output_tokens=7),
            Reply(text=ANSWER, input_tokens=120, output_tokens=9),
        ]
    )


def check_w1_shape(spans: tuple[ReadableSpan, ...], *, conversation: str | None = None) -> ReadableSpan:
    """One run span, two model spans and one tool span under it: the W1 run's whole trace."""
    names = sorted(s.name for s in spans)
    assert names == ["chat scripted", "chat scripted", "execute_tool echo", "invoke_agent"], names
    found = by_name(spans)
    run = found["invoke_agent"][0]
    assert run.parent is None
    assert run.attributes is not None
    assert run.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert run.attributes["agentloop.run.stop_reason"] == "stop"
    assert run.attributes["gen_ai.usage.input_tokens"] == 220
    assert run.attributes["gen_ai.usage.output_tokens"] == 16
    assert run.status.status_code != StatusCode.ERROR
    if conversation is not None:
        assert run.attributes["gen_ai.conversation.id"] == conversation
    run_ctx = run.get_span_context()
    assert run_ctx is not None
    chats = sorted(found["chat scripted"], key=lambda s: s.start_time or 0)
    tokens = []
    for chat in chats:
        assert chat.parent is not None and chat.parent.span_id == run_ctx.span_id
        assert chat.context is not None and chat.context.trace_id == run_ctx.trace_id
        assert chat.kind == SpanKind.CLIENT
        a = chat.attributes
        assert a is not None
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.provider.name"] == "scripted"
        assert a["gen_ai.system"] == "scripted"
        assert a["gen_ai.request.model"] == "scripted"
        assert a["gen_ai.response.model"] == "scripted"
        tokens.append((a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]))
        assert chat.status.status_code != StatusCode.ERROR
    assert tokens == [(100, 7), (120, 9)]
    assert chats[0].attributes is not None and chats[0].attributes["gen_ai.response.finish_reasons"] == ("toolUse",)
    (tool_span,) = found["execute_tool echo"]
    assert tool_span.parent is not None and tool_span.parent.span_id == run_ctx.span_id
    a = tool_span.attributes
    assert a is not None
    assert a["gen_ai.operation.name"] == "execute_tool"
    assert a["gen_ai.tool.name"] == "echo"
    assert a["gen_ai.tool.call.id"]
    assert tool_span.status.status_code != StatusCode.ERROR
    # in order: the first model call, the tool, the second model call, all within the run
    assert chats[0].end_time is not None and tool_span.start_time is not None
    assert chats[0].end_time <= tool_span.start_time
    assert tool_span.end_time is not None and chats[1].start_time is not None
    assert tool_span.end_time <= chats[1].start_time
    assert run.start_time is not None and run.end_time is not None
    assert run.start_time <= chats[0].start_time <= chats[1].end_time <= run.end_time  # type: ignore[operator]
    return run


def all_values(spans: tuple[ReadableSpan, ...]) -> str:
    """Every attribute value and event attribute of ``spans`` as one text, to look for content in."""
    parts: list[str] = []
    for s in spans:
        parts.extend(str(v) for v in (s.attributes or {}).values())
        for e in s.events:
            parts.extend(str(v) for v in (e.attributes or {}).values())
        parts.append(s.status.description or "")
    return "\n".join(parts)


# ------------------------------------------------------------------ in memory


@pytest.mark.parametrize("streaming", [False, True], ids=["run", "stream"])
async def test_w1_run_gives_run_model_and_tool_spans(traced, streaming):
    provider, exporter = traced
    agent = Agent(model=w1_model(), tools=[echo]).use(Tracing(tracer_provider=provider))
    if streaming:
        events = [e async for e in agent.stream(PROMPT)]
        assert events[-1].type == "agent_end"
        run_id = events[-1].run_id
    else:
        result = await agent.run(PROMPT)
        assert result.text == ANSWER
        run_id = result.run_id
    run = check_w1_shape(exporter.get_finished_spans())
    assert run.attributes is not None and run.attributes["agentloop.run.id"] == run_id


async def test_each_run_has_its_own_trace_and_concurrent_runs_do_not_mix(traced):
    provider, exporter = traced

    def brain(request):
        last = request.messages[-1]
        if last.role == "user":
            return Reply(tool_calls=[call("echo", text=last.text)])
        return Reply(text="done")

    agent = Agent(model=ScriptedModel(brain, latency=0.01), tools=[echo]).use(Tracing(tracer_provider=provider))
    await asyncio.gather(agent.run("one"), agent.run("two"))
    spans = exporter.get_finished_spans()
    runs = by_name(spans)["invoke_agent"]
    assert len(runs) == 2
    for run in runs:
        ctx = run.get_span_context()
        assert ctx is not None
        children = [s for s in spans if s.parent is not None and s.parent.span_id == ctx.span_id]
        assert sorted(s.name for s in children) == ["chat scripted", "chat scripted", "execute_tool echo"]
        assert all(s.context is not None and s.context.trace_id == ctx.trace_id for s in children)


async def test_run_span_is_a_child_of_the_callers_span(traced):
    provider, exporter = traced
    agent = Agent(model=ScriptedModel(["hi"])).use(Tracing(tracer_provider=provider))
    with provider.get_tracer("test").start_as_current_span("request") as outer:
        await agent.run("hello")
    run = by_name(exporter.get_finished_spans())["invoke_agent"][0]
    assert run.parent is not None and run.parent.span_id == outer.get_span_context().span_id


async def test_tool_error_marks_the_tool_span(traced):
    provider, exporter = traced
    model = ScriptedModel([Reply(tool_calls=[call("broken", text="x")]), "sorry"])
    agent = Agent(model=model, tools=[broken]).use(Tracing(tracer_provider=provider))
    result = await agent.run("go")
    assert result.stop_reason == "stop"
    found = by_name(exporter.get_finished_spans())
    (tool_span,) = found["execute_tool broken"]
    assert tool_span.status.status_code == StatusCode.ERROR
    assert tool_span.attributes is not None and tool_span.attributes["error.type"] == "tool_error"
    assert "disk is on fire" not in (tool_span.status.description or "")  # a tool's output is content
    run = found["invoke_agent"][0]
    assert run.status.status_code != StatusCode.ERROR  # the model read the error and answered


async def test_unknown_tool_gets_an_error_span_too(traced):
    provider, exporter = traced
    model = ScriptedModel([Reply(tool_calls=[call("nope")]), "ok"])
    agent = Agent(model=model, tools=[echo]).use(Tracing(tracer_provider=provider))
    await agent.run("go")
    (tool_span,) = by_name(exporter.get_finished_spans())["execute_tool nope"]
    assert tool_span.status.status_code == StatusCode.ERROR


async def test_model_failure_marks_the_model_and_run_spans(traced):
    provider, exporter = traced
    from agentloop.models.base import ProviderError

    agent = Agent(model=ScriptedModel([ProviderError("bad key", kind="auth")])).use(Tracing(tracer_provider=provider))
    result = await agent.run("go")
    assert result.stop_reason == "error"
    found = by_name(exporter.get_finished_spans())
    (chat,) = found["chat scripted"]
    assert chat.status.status_code == StatusCode.ERROR
    assert chat.attributes is not None and chat.attributes["error.type"]
    run = found["invoke_agent"][0]
    assert run.status.status_code == StatusCode.ERROR
    assert run.attributes is not None and run.attributes["error.type"] == "error"
    assert run.attributes["agentloop.run.stop_reason"] == "error"


async def test_a_retried_model_call_is_a_failed_span_then_a_good_one(traced):
    provider, exporter = traced
    from agentloop.models.base import ModelInfo, ProviderError
    from agentloop.models.retry import RetryPolicy

    main = ScriptedModel([ProviderError("overloaded", kind="server"), ProviderError("down", kind="server")])
    backup = ScriptedModel(["fine"], info=ModelInfo(provider="other", id="backup", context_window=1000))
    agent = Agent(model=main, fallbacks=[backup], retry=RetryPolicy(max_retries=1, base_delay=0.0, jitter=0.0))
    agent.use(Tracing(tracer_provider=provider))
    result = await agent.run("go")
    assert result.text == "fine"
    found = by_name(exporter.get_finished_spans())
    failed = sorted(found["chat scripted"], key=lambda s: s.start_time or 0)
    assert [s.status.status_code for s in failed] == [StatusCode.ERROR, StatusCode.ERROR]
    (good,) = found["chat backup"]
    assert good.status.status_code != StatusCode.ERROR
    assert good.attributes is not None and good.attributes["gen_ai.provider.name"] == "other"
    run = found["invoke_agent"][0]
    assert run.status.status_code != StatusCode.ERROR
    assert [e.name for e in run.events] == ["agentloop.model_retry", "agentloop.model_retry"]


async def test_durable_retry_is_a_failed_model_span(traced, tmp_path):
    provider, exporter = traced
    from agentloop.models.base import ProviderError
    from agentloop.models.retry import RetryPolicy

    model = ScriptedModel([ProviderError("overloaded", kind="server"), "fine"])
    async with Kernel.open(
        f"sqlite:///{tmp_path}/k.db",
        model=model,
        tools=[echo],
        workspace=tmp_path,
        heartbeat=None,
        retry=RetryPolicy(max_retries=2, base_delay=0.0, jitter=0.0),
    ) as kernel:
        trace_kernel(kernel, tracer_provider=provider)
        proc = await kernel.spawn(owner="alice", text="go")
        await proc.wait_idle()
    found = by_name(exporter.get_finished_spans())
    chats = sorted(found["chat scripted"], key=lambda s: s.start_time or 0)
    assert [s.status.status_code == StatusCode.ERROR for s in chats] == [True, False]
    assert chats[0].attributes is not None and chats[0].attributes["error.type"] == "model_error"
    assert found["invoke_agent"][0].status.status_code != StatusCode.ERROR


async def test_aborted_run_ends_every_span_with_an_error(traced):
    provider, exporter = traced
    started = asyncio.Event()

    @tool
    async def slow(text: str) -> str:
        """Takes its time."""
        started.set()
        await asyncio.sleep(30)
        return text

    model = ScriptedModel([Reply(tool_calls=[call("slow", text="x")]), "never"])
    agent = Agent(model=model, tools=[slow]).use(Tracing(tracer_provider=provider))
    task = asyncio.create_task(agent.run("go"))
    await asyncio.wait_for(started.wait(), 5)
    agent.abort()
    result = await task
    assert result.stop_reason == "aborted"
    found = by_name(exporter.get_finished_spans())
    run = found["invoke_agent"][0]
    assert run.status.status_code == StatusCode.ERROR
    assert run.attributes is not None and run.attributes["error.type"] == "aborted"
    assert run.attributes["agentloop.run.stop_reason"] == "aborted"
    (tool_span,) = found["execute_tool slow"]
    assert tool_span.status.status_code == StatusCode.ERROR
    assert tool_span.end_time is not None


async def test_abort_while_the_model_streams_ends_the_model_span(traced):
    provider, exporter = traced
    agent = Agent(model=ScriptedModel(["slow answer"], latency=30)).use(Tracing(tracer_provider=provider))
    run = agent.start("go", stream=True)
    seen: list[str] = []
    async for event in run.events():
        seen.append(event.type)
        if event.type == "turn_start":
            await asyncio.sleep(0.05)  # the model call is under way
            run.abort()
    assert seen[-1] == "agent_end"
    found = by_name(exporter.get_finished_spans())
    (chat,) = found["chat scripted"]
    assert chat.status.status_code == StatusCode.ERROR
    assert found["invoke_agent"][0].status.status_code == StatusCode.ERROR


async def test_leaving_the_stream_early_ends_the_run_span(traced):
    provider, exporter = traced

    @tool(name="echo")
    async def slow_echo(text: str) -> str:
        """Echo, slowly."""
        await asyncio.sleep(30)
        return text

    agent = Agent(model=w1_model(), tools=[slow_echo]).use(Tracing(tracer_provider=provider))
    async with aclosing(agent.stream("go")) as events:
        async for event in events:
            if event.type == "tool_execution_start":
                break
    runs = by_name(exporter.get_finished_spans())["invoke_agent"]
    assert len(runs) == 1 and runs[0].attributes is not None
    assert runs[0].attributes["agentloop.run.stop_reason"] == "aborted"


async def test_a_hook_that_raises_ends_the_run_span_with_its_exception(traced):
    provider, exporter = traced
    agent = Agent(model=ScriptedModel(["hi"])).use(Tracing(tracer_provider=provider))

    @agent.hooks.transform_context
    def explode(messages):
        raise ValueError("hook bug")

    with pytest.raises(ValueError):
        await agent.run("go")
    run = by_name(exporter.get_finished_spans())["invoke_agent"][0]
    assert run.status.status_code == StatusCode.ERROR
    assert run.attributes is not None and run.attributes["error.type"] == "ValueError"


async def test_cost_and_cache_tokens_are_recorded_when_the_usage_has_them(traced):
    provider, exporter = traced
    from agentloop.messages import AssistantMessage, TextContent

    message = AssistantMessage(
        content=[TextContent(text="hi")],
        provider="scripted",
        model="scripted",
        usage=Usage(input=10, output=4, cache_read=30, cache_write=5, total_tokens=49, cost=Cost(total=0.25)),
    )
    agent = Agent(model=ScriptedModel([message])).use(Tracing(tracer_provider=provider))
    await agent.run("go")
    found = by_name(exporter.get_finished_spans())
    (chat,) = found["chat scripted"]
    a = chat.attributes
    assert a is not None
    assert a["gen_ai.usage.input_tokens"] == 45  # all of the prompt, the cached part included
    assert a["gen_ai.usage.cache_read.input_tokens"] == 30
    assert a["gen_ai.usage.cache_creation.input_tokens"] == 5
    assert a["gen_ai.usage.output_tokens"] == 4
    assert a["agentloop.usage.cost"] == pytest.approx(0.25)
    run = found["invoke_agent"][0]
    assert run.attributes is not None and run.attributes["agentloop.usage.cost"] == pytest.approx(0.25)


async def test_no_message_content_unless_asked(traced):
    provider, exporter = traced
    agent = Agent(model=w1_model(), tools=[echo]).use(Tracing(tracer_provider=provider))
    await agent.run(PROMPT)
    text = all_values(exporter.get_finished_spans())
    assert "secret" not in text and "swordfish" not in text


async def test_message_content_when_opted_in(traced):
    provider, exporter = traced
    agent = Agent(model=w1_model(), tools=[echo]).use(Tracing(tracer_provider=provider, record_content=True))
    await agent.run(PROMPT)
    found = by_name(exporter.get_finished_spans())
    run = found["invoke_agent"][0]
    assert run.attributes is not None
    inputs = json.loads(str(run.attributes["gen_ai.input.messages"]))
    assert inputs == [{"role": "user", "parts": [{"type": "text", "content": PROMPT}]}]
    outputs = json.loads(str(run.attributes["gen_ai.output.messages"]))
    assert outputs[0]["parts"] == [{"type": "text", "content": ANSWER}]
    first = min(found["chat scripted"], key=lambda s: s.start_time or 0)
    assert first.attributes is not None
    said = json.loads(str(first.attributes["gen_ai.output.messages"]))
    assert said[0]["parts"][0]["type"] == "tool_call" and said[0]["parts"][0]["name"] == "echo"
    (tool_span,) = found["execute_tool echo"]
    assert tool_span.attributes is not None
    assert json.loads(str(tool_span.attributes["gen_ai.tool.call.arguments"])) == {"text": "swordfish"}
    assert tool_span.attributes["gen_ai.tool.call.result"] == "swordfish"


async def test_agent_name_names_the_run_span(traced):
    provider, exporter = traced
    agent = Agent(model=ScriptedModel(["hi"])).use(Tracing(tracer_provider=provider, agent_name="helper"))
    await agent.run("go")
    (run,) = exporter.get_finished_spans()[-1:]
    assert run.name == "invoke_agent helper"
    assert run.attributes is not None and run.attributes["gen_ai.agent.name"] == "helper"


async def test_an_agent_without_tracing_has_no_observers():
    agent = Agent(model=ScriptedModel(["hi"]))
    assert agent.config.observers == []
    await agent.run("go")


async def test_observer_that_raises_does_not_break_the_run():
    calls: list[str] = []

    def observer(cfg, state):
        def watch(event):
            calls.append(event.type)
            raise RuntimeError("observer bug")

        return watch

    agent = Agent(model=w1_model(), tools=[echo])
    agent.config.observers.append(observer)
    result = await agent.run("go")
    assert result.text == ANSWER
    assert calls[0] == "agent_start" and calls[-1] == "agent_end"


# ------------------------------------------------------------------ durable


async def test_durable_run_gives_the_same_span_shape(traced, tmp_path):
    provider, exporter = traced
    async with Kernel.open(
        f"sqlite:///{tmp_path}/k.db", model=w1_model(), tools=[echo], workspace=tmp_path, heartbeat=None
    ) as kernel:
        tracing = trace_kernel(kernel, tracer_provider=provider)
        proc = await kernel.spawn(owner="alice", text=PROMPT)
        await proc.wait_idle()
        run = check_w1_shape(exporter.get_finished_spans(), conversation=proc.pid)
        assert run.attributes is not None
        assert run.attributes["agentloop.run.resumed"] is False
        assert tracing.open_runs == 0
        text = all_values(exporter.get_finished_spans())
        assert "secret" not in text and "swordfish" not in text


async def test_durable_content_when_opted_in(traced, tmp_path):
    provider, exporter = traced
    async with Kernel.open(
        f"sqlite:///{tmp_path}/k.db", model=w1_model(), tools=[echo], workspace=tmp_path, heartbeat=None
    ) as kernel:
        Tracing(tracer_provider=provider, record_content=True).install_kernel(kernel)
        proc = await kernel.spawn(owner="alice", text=PROMPT)
        await proc.wait_idle()
    found = by_name(exporter.get_finished_spans())
    (tool_span,) = found["execute_tool echo"]
    assert tool_span.attributes is not None
    assert json.loads(str(tool_span.attributes["gen_ai.tool.call.arguments"])) == {"text": "swordfish"}
    assert tool_span.attributes["gen_ai.tool.call.result"] == "swordfish"
    run = found["invoke_agent"][0]
    assert run.attributes is not None and ANSWER in str(run.attributes["gen_ai.output.messages"])


async def test_durable_tool_error_and_abort(traced, tmp_path):
    provider, exporter = traced
    started = asyncio.Event()

    @tool
    async def slow(text: str) -> str:
        """Takes its time."""
        started.set()
        await asyncio.sleep(30)
        return text

    model = ScriptedModel(
        [Reply(tool_calls=[call("broken", text="x")]), "it failed", Reply(tool_calls=[call("slow", text="y")])]
    )
    async with Kernel.open(
        f"sqlite:///{tmp_path}/k.db", model=model, tools=[broken, slow], workspace=tmp_path, heartbeat=None
    ) as kernel:
        tracing = trace_kernel(kernel, tracer_provider=provider)
        proc = await kernel.spawn(owner="alice", text="first")
        await proc.wait_idle()
        await proc.send("second")
        await asyncio.wait_for(started.wait(), 5)
        assert tracing.open_runs == 1
        await proc.abort()
        await proc.wait_idle()
        assert tracing.open_runs == 0
    found = by_name(exporter.get_finished_spans())
    (failed,) = found["execute_tool broken"]
    assert failed.status.status_code == StatusCode.ERROR
    (cut,) = found["execute_tool slow"]
    assert cut.status.status_code == StatusCode.ERROR
    runs = sorted(found["invoke_agent"], key=lambda s: s.start_time or 0)
    assert [r.status.status_code == StatusCode.ERROR for r in runs] == [False, True]
    assert runs[1].attributes is not None and runs[1].attributes["agentloop.run.stop_reason"] == "aborted"
    pids = {r.attributes["gen_ai.conversation.id"] for r in runs if r.attributes is not None}
    assert pids == {proc.pid}


async def test_a_tap_that_fails_does_not_break_the_kernel(traced, tmp_path, caplog):
    provider, _ = traced
    async with Kernel.open(
        f"sqlite:///{tmp_path}/k.db", model=w1_model(), tools=[echo], workspace=tmp_path, heartbeat=None
    ) as kernel:
        tracing = trace_kernel(kernel, tracer_provider=provider)
        tracing._tracer = None  # type: ignore[assignment]  # every span it would start now fails
        proc = await kernel.spawn(owner="alice", text=PROMPT)
        await proc.wait_idle()
        last = (await proc.history(limit=1))[-1].message
        assert last.text == ANSWER
    assert "tracing could not record" in caplog.text


def test_durable_runs_resumed_capped_and_closed(traced):
    provider, exporter = traced

    class FakeEngine:
        def __init__(self) -> None:
            from agentloop.process.signals import SignalHub

            self.hub = SignalHub()
            self.closed_hooks: list = []

        def cached(self, pid):
            return None

        async def close(self) -> None:  # (as ProcessEngine.close ends: its hooks are called)
            for hook in list(self.closed_hooks):
                hook()

    class FakeKernel:
        engine = FakeEngine()

    kernel = FakeKernel()
    tracing = trace_kernel(kernel, tracer_provider=provider, max_open_runs=2)  # type: ignore[arg-type]
    hub = kernel.engine.hub

    def publish(pid: str, signal: str, **payload) -> None:
        hub.publish(pid, Signal(signal, {"pid": pid, **payload}))

    # a run this worker did not see start (resumed after a restart): a new span, marked so
    publish("p0", sig.TOOL_STARTED, runId="r0", callId="c0", name="echo", args={})
    publish("p0", sig.TOOL_FINISHED, runId="r0", callId="c0", name="echo", ok=True, output="x")
    publish("p0", sig.RUN_FINISHED, runId="r0", status="ok", reason="turn.complete", usage={"input": 3, "output": 2})
    found = by_name(exporter.get_finished_spans())
    (r0,) = found["invoke_agent"]
    assert r0.attributes is not None and r0.attributes["agentloop.run.resumed"] is True
    assert r0.attributes["gen_ai.usage.input_tokens"] == 3
    # runs that never finish: at most two are held, the oldest is ended to make room
    for i in range(1, 4):
        publish(f"p{i}", sig.RUN_STARTED, runId=f"r{i}", reason="proc.send")
    assert tracing.open_runs == 2
    evicted = [s for s in exporter.get_finished_spans() if (s.attributes or {}).get("agentloop.run.id") == "r1"]
    assert len(evicted) == 1 and evicted[0].attributes is not None
    assert evicted[0].attributes["agentloop.run.incomplete"] == "evicted"
    # live-only progress is ignored, whatever it holds
    hub.publish("p2", Signal(sig.RUN_STREAM, {"runId": "r2", "delta": "x"}))
    # closing the kernel ends what is still open
    asyncio.run(kernel.engine.close())
    assert tracing.open_runs == 0
    closed = [
        s for s in exporter.get_finished_spans() if (s.attributes or {}).get("agentloop.run.incomplete") == "closed"
    ]
    assert sorted(s.attributes["agentloop.run.id"] for s in closed if s.attributes) == ["r2", "r3"]
    assert hub._taps == []


async def test_closing_the_kernel_ends_open_run_spans(traced, tmp_path):
    provider, exporter = traced
    started = asyncio.Event()

    @tool
    async def slow(text: str) -> str:
        """Takes its time."""
        started.set()
        await asyncio.sleep(30)
        return text

    model = ScriptedModel([Reply(tool_calls=[call("slow", text="y")])])
    async with Kernel.open(
        f"sqlite:///{tmp_path}/k.db", model=model, tools=[slow], workspace=tmp_path, heartbeat=None
    ) as kernel:
        tracing = trace_kernel(kernel, tracer_provider=provider)
        await kernel.spawn(owner="alice", text="go")
        await asyncio.wait_for(started.wait(), 5)
    assert tracing.open_runs == 0
    found = by_name(exporter.get_finished_spans())
    (run,) = found["invoke_agent"]
    assert run.attributes is not None and run.attributes["agentloop.run.incomplete"] == "closed"
    (tool_span,) = found["execute_tool slow"]
    assert tool_span.end_time is not None


# ------------------------------------------------------------------ the optional extra


def test_missing_extra_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    monkeypatch.setitem(sys.modules, "opentelemetry.trace", None)
    with pytest.raises(ImportError, match=r"pip install 'agentloop\[otel\]'"):
        Tracing()
    with pytest.raises(ImportError, match=r"pip install 'agentloop\[otel\]'"):
        trace_kernel(object())  # type: ignore[arg-type]


def test_importing_agentloop_does_not_import_opentelemetry():
    code = (
        "import sys, agentloop, agentloop.tracing, agentloop.kernel\n"
        "loaded = [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


async def test_closing_a_real_kernel_ends_the_spans_of_runs_it_cut_short(traced, tmp_path):
    """The kernel's close (its engine's ``closed_hooks``) ends what is still open, marked."""
    provider, exporter = traced
    gate = asyncio.Event()

    @tool
    async def wait_for_ever() -> str:
        """Wait."""
        await gate.wait()
        return "never"

    model = ScriptedModel([Reply(tool_calls=[call("wait_for_ever")])])
    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=model, tools=[wait_for_ever], workspace=tmp_path) as k:
        tracing = trace_kernel(k, tracer_provider=provider)
        proc = await k.spawn(owner="alice", text="go")
        for _ in range(200):
            if tracing.open_runs:
                break
            await asyncio.sleep(0.01)
        assert tracing.open_runs == 1
    assert tracing.open_runs == 0 and tracing.close not in k.engine.closed_hooks
    [run] = [s for s in exporter.get_finished_spans() if s.name.startswith("invoke_agent")]
    assert run.attributes is not None and run.attributes["agentloop.run.incomplete"] == "closed"
    assert run.attributes["gen_ai.conversation.id"] == proc.pid
