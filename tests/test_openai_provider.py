"""The OpenAI Chat Completions adapter against a local server that speaks the wire format."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from agentloop import Agent, tool, user
from agentloop.events import AgentEnd, LoopEvent, ModelRetry, StreamDone, StreamError, StreamEvent
from agentloop.messages import (
    AssistantMessage,
    FileContent,
    ImageContent,
    SystemMessage,
    TextContent,
    ThinkingContent,
    ToolCall,
    ToolResultMessage,
    message_to_json,
    tool_error_result,
)
from agentloop.models.base import ModelRequest, ToolSpec
from agentloop.models.openai_chat import OpenAIChatModel
from agentloop.models.registry import resolve_model
from agentloop.models.retry import RetryPolicy
from tests.fakes.http_server import JSONReply, SSEReply
from tests.fakes.openai_server import (
    OpenAIFake,
    chunk,
    error,
    stream,
    text_reply,
    tool_delta,
    tool_reply,
    usage_chunk,
)

FAST = RetryPolicy(base_delay=0.01, max_delay=1.0)
ECHO_SPEC = ToolSpec(name="echo", description="Echo text.", parameters={"type": "object", "properties": {}})


@pytest.fixture(scope="module")
def server() -> Iterator[OpenAIFake]:
    with OpenAIFake() as fake:
        yield fake


@pytest.fixture
def fake(server: OpenAIFake) -> Iterator[OpenAIFake]:
    server.reset()
    yield server
    server.reset()


def model(fake: OpenAIFake, model_id: str = "gpt-4o-mini") -> OpenAIChatModel:
    return OpenAIChatModel(model_id, base_url=fake.base_url, api_key="sk-test")


async def events_of(m: OpenAIChatModel, request: ModelRequest) -> list[StreamEvent]:
    return [e async for e in m.stream(request)]


def req(*messages: Any, tools: list[ToolSpec] | None = None, system: str = "") -> ModelRequest:
    return ModelRequest(system_prompt=system, messages=list(messages), tools=tools or [])


def finished(events: list[StreamEvent]) -> StreamDone:
    last = events[-1]
    assert isinstance(last, StreamDone), last
    return last


def run_end(events: list[LoopEvent]) -> AgentEnd:
    last = events[-1]
    assert isinstance(last, AgentEnd), last
    return last


@tool
def echo(text: str) -> str:
    """Echo the text."""
    return f"echo: {text}"


# ------------------------------------------------------------------ streaming


async def test_text_streaming_events_usage_and_cost(fake: OpenAIFake) -> None:
    fake.push(text_reply("Hello there, world", pieces=3, prompt=1000, completion=200, cached=400))
    events = await events_of(model(fake), req(user("hi"), system="Be brief."))
    assert [e.type for e in events] == ["start", "text_start", *["text_delta"] * 3, "text_end", "done"]
    done = events[-1]
    assert isinstance(done, StreamDone)
    msg = done.message
    assert msg.text == "Hello there, world"
    assert msg.stop_reason == "stop"
    assert (msg.usage.input, msg.usage.output, msg.usage.cache_read) == (600, 200, 400)
    assert msg.usage.total_tokens == 1200
    # gpt-4o-mini: $0.15 in, $0.60 out, $0.075 cache read per million
    assert msg.usage.cost.total == pytest.approx((600 * 0.15 + 200 * 0.6 + 400 * 0.075) / 1e6)
    body = fake.last
    assert body["model"] == "gpt-4o-mini"
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert "tools" not in body and "max_tokens" not in body and "temperature" not in body
    assert fake.headers[-1]["authorization"] == "Bearer sk-test"


async def test_length_and_options(fake: OpenAIFake) -> None:
    fake.push(text_reply("cut", finish="length"))
    request = ModelRequest(system_prompt="", messages=[user("hi")], max_tokens=7, temperature=0.0)
    m = OpenAIChatModel("gpt-4o-mini", base_url=fake.base_url, seed=3)
    done = finished(await events_of(m, request))
    assert done.message.stop_reason == "length"
    assert (fake.last["max_tokens"], fake.last["temperature"], fake.last["seed"]) == (7, 0.0, 3)


async def test_tool_call_arguments_split_across_chunks(fake: OpenAIFake) -> None:
    fake.push(tool_reply("echo", '{"text": "hello world"}', id="call_abc", text="Let me echo.", split=4))
    events = await events_of(model(fake), req(user("echo it"), tools=[ECHO_SPEC]))
    types = [e.type for e in events]
    assert types[:5] == ["start", "text_start", "text_delta", "text_end", "toolcall_start"]
    assert types.count("toolcall_delta") == 4
    assert types[-2:] == ["toolcall_end", "done"]
    msg = finished(events).message
    assert msg.stop_reason == "toolUse"
    assert msg.text == "Let me echo."
    assert msg.tool_calls == [ToolCall(id="call_abc", name="echo", arguments={"text": "hello world"})]
    assert fake.last["tools"] == [
        {
            "type": "function",
            "function": {"name": "echo", "description": "Echo text.", "parameters": ECHO_SPEC.parameters},
        }
    ]
    assert "parallel_tool_calls" not in fake.last  # the provider's default: parallel


def test_a_conversation_key_goes_to_openais_prompt_cache_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    keyed = ModelRequest(system_prompt="", messages=[user("hi")], cache_key="proc-1")
    official = OpenAIChatModel("gpt-4o-mini", api_key="sk-test")
    assert official.build_params(keyed)["prompt_cache_key"] == "proc-1"
    assert "prompt_cache_key" not in official.build_params(req(user("hi")))  # no conversation, no key
    other = OpenAIChatModel("local-model", api_key="x", base_url="http://127.0.0.1:8000/v1")
    assert "prompt_cache_key" not in other.build_params(keyed)  # a compatible server may refuse it


def test_sequential_tool_execution_asks_openai_for_one_call_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    one_by_one = ModelRequest(system_prompt="", messages=[user("hi")], tools=[ECHO_SPEC], parallel_tool_calls=False)
    assert OpenAIChatModel("gpt-4o-mini", api_key="k").build_params(one_by_one)["parallel_tool_calls"] is False
    # OpenAI's reasoning models refuse the parameter, and an OpenAI-compatible server may
    assert "parallel_tool_calls" not in OpenAIChatModel("o4-mini", api_key="k").build_params(one_by_one)
    compatible = OpenAIChatModel("m", api_key="k", base_url="http://127.0.0.1:8000/v1")
    assert "parallel_tool_calls" not in compatible.build_params(one_by_one)


async def test_sequential_mode_reaches_the_request(fake: OpenAIFake) -> None:
    fake.push(tool_reply("echo", '{"text": "hi"}', id="call_1"), text_reply("done"))
    seen: list[ModelRequest] = []

    class Recording(OpenAIChatModel):
        def build_params(self, request: ModelRequest) -> dict[str, Any]:
            seen.append(request)
            return super().build_params(request)

    m = Recording("gpt-4o-mini", base_url=fake.base_url, api_key="sk-test")
    agent = Agent(model=m, tools=[echo], tool_execution="sequential")
    assert (await agent.run("say hi")).text == "done"
    assert [r.parallel_tool_calls for r in seen] == [False, False]


async def test_two_parallel_tool_calls_interleaved(fake: OpenAIFake) -> None:
    fake.push(
        stream(
            chunk({"role": "assistant", "content": None}),
            chunk(tool_delta(0, id="call_a", name="echo", args='{"te')),
            chunk(tool_delta(1, id="call_b", name="echo", args='{"text"')),
            chunk(tool_delta(0, args='xt": "one"}')),
            chunk(tool_delta(1, args=': "two"}')),
            chunk(finish_reason="tool_calls"),
            usage_chunk(10, 10),
        )
    )
    done = (await events_of(model(fake), req(user("two"), tools=[ECHO_SPEC])))[-1]
    assert isinstance(done, StreamDone)
    assert done.message.tool_calls == [
        ToolCall(id="call_a", name="echo", arguments={"text": "one"}),
        ToolCall(id="call_b", name="echo", arguments={"text": "two"}),
    ]


async def test_parallel_calls_that_share_index_zero_stay_apart(fake: OpenAIFake) -> None:
    """Ollama, LiteLLM and lmdeploy give every parallel call index 0: keyed by index alone, the
    calls merged into one whose arguments (``{...}{...}``) were not JSON, and the turn failed."""
    fake.push(
        stream(  # each call whole (Ollama)
            chunk(tool_delta(0, id="call_a", name="echo", args='{"text": "one"}')),
            chunk(tool_delta(0, id="call_b", name="echo", args='{"text": "two"}')),
            chunk(finish_reason="tool_calls"),
        ),
        stream(  # a start with the id, then fragments without one (lmdeploy)
            chunk(tool_delta(0, id="call_c", name="echo")),
            chunk(tool_delta(0, args='{"text": ')),
            chunk(tool_delta(0, args='"three"}')),
            chunk(tool_delta(0, id="call_d", name="echo")),
            chunk(tool_delta(0, args='{"text": "four"}')),
            chunk(finish_reason="tool_calls"),
        ),
        stream(  # one call whose later fragments carry another id: still one call
            chunk(tool_delta(0, id="call_e", name="echo")),
            chunk(tool_delta(0, id="call_f", args='{"text": ')),
            chunk(tool_delta(0, id="call_f", args='"five"}')),
            chunk(finish_reason="tool_calls"),
        ),
    )
    seen = []
    for _ in range(3):
        done = finished(await events_of(model(fake), req(user("two"), tools=[ECHO_SPEC])))
        seen.append([(c.id, c.arguments) for c in done.message.tool_calls])
    assert seen == [
        [("call_a", {"text": "one"}), ("call_b", {"text": "two"})],
        [("call_c", {"text": "three"}), ("call_d", {"text": "four"})],
        [("call_e", {"text": "five"})],
    ]


async def test_tool_calls_without_index_are_keyed_by_id(fake: OpenAIFake) -> None:
    whole = [
        {"id": "call_x", "type": "function", "function": {"name": "echo", "arguments": '{"text": "x"}'}},
        {"id": "call_y", "type": "function", "function": {"name": "echo", "arguments": '{"text": "y"}'}},
    ]
    fake.push(stream(chunk({"role": "assistant", "content": "", "tool_calls": whole}), chunk(finish_reason="stop")))
    done = finished(await events_of(model(fake), req(user("two"), tools=[ECHO_SPEC])))
    assert done.message.stop_reason == "toolUse"  # Ollama says "stop" even when it calls tools
    assert [(c.id, c.arguments) for c in done.message.tool_calls] == [
        ("call_x", {"text": "x"}),
        ("call_y", {"text": "y"}),
    ]


async def test_reasoning_model_gets_max_completion_tokens(fake: OpenAIFake) -> None:
    fake.push(text_reply("ok"))
    request = ModelRequest(system_prompt="", messages=[user("hi")], max_tokens=50)
    await events_of(OpenAIChatModel("o4-mini", base_url=fake.base_url), request)
    assert fake.last["max_completion_tokens"] == 50 and "max_tokens" not in fake.last


async def test_reasoning_content_becomes_thinking(fake: OpenAIFake) -> None:
    fake.push(
        stream(
            chunk({"role": "assistant", "content": ""}),
            chunk({"reasoning_content": "Let me think. "}),
            chunk({"reasoning": "Done thinking."}),  # vLLM's newer field name
            chunk({"content": "42"}),
            chunk(finish_reason="stop"),
            usage_chunk(5, 5),
        )
    )
    events = await events_of(model(fake), req(user("?")))
    types = [e.type for e in events]
    assert types == [
        "start",
        "thinking_start",
        "thinking_delta",
        "thinking_delta",
        "thinking_end",
        "text_start",
        "text_delta",
        "text_end",
        "done",
    ]
    msg = finished(events).message
    assert msg.content == [ThinkingContent(thinking="Let me think. Done thinking."), TextContent(text="42")]


# ------------------------------------------------------------------ request conversion


async def test_history_round_trip_tool_calls_results_and_content_never_null(fake: OpenAIFake) -> None:
    long_id = "toolu_" + "x" * 60 + ".weird|id"
    history = [
        user("first"),
        AssistantMessage(
            content=[
                ThinkingContent(thinking="private", signature="sig"),
                ToolCall(id=long_id, name="echo", arguments={"text": "é"}),
            ],
            provider="anthropic",
            model="claude-sonnet-4-5",
            stop_reason="toolUse",
        ),
        ToolResultMessage(
            tool_call_id=long_id,
            tool_name="echo",
            content=[TextContent(text="echo: é"), ImageContent(data="AAAA", mime_type="image/png")],
        ),
        SystemMessage(content=[TextContent(text="guard notice")]),
        AssistantMessage(content=[TextContent(text="failed")], stop_reason="error", error_message="boom"),
        user("again"),
    ]
    fake.push(text_reply("ok"))
    await events_of(model(fake), req(*history))
    sent = fake.last["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "user", "system", "user"]
    assistant = sent[1]
    assert assistant["content"] == ""  # never null: llama.cpp's server rejects it
    (tc,) = assistant["tool_calls"]
    assert len(tc["id"]) <= 40 and tc["id"].replace("_", "").replace("-", "").isalnum()
    assert tc["function"] == {"name": "echo", "arguments": '{"text": "é"}'}
    assert sent[2] == {"role": "tool", "tool_call_id": tc["id"], "content": "echo: é"}
    assert sent[3]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert sent[4] == {"role": "system", "content": "guard notice"}
    assert "private" not in json.dumps(sent)  # thinking is not sent back


async def test_image_input_as_data_url(fake: OpenAIFake) -> None:
    fake.push(text_reply("a cat"))
    await events_of(model(fake), req(user("what is this?", ImageContent(data="iVBOR", mime_type="image/png"))))
    assert fake.last["messages"][0]["content"] == [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
    ]


def test_a_pdf_returned_by_a_tool_follows_the_tool_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    calls = AssistantMessage(content=[ToolCall(id="call_r", name="Read", arguments={})], stop_reason="toolUse")
    pdf = FileContent(data="JVBERi0xLjQK", mime_type="application/pdf", name="r.pdf")
    result = ToolResultMessage(tool_call_id="call_r", tool_name="Read", content=[TextContent(text="PDF r.pdf"), pdf])
    messages = OpenAIChatModel("gpt-4o-mini", api_key="k").build_params(req(user("read r.pdf"), calls, result))
    messages = messages["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user"]
    assert messages[2]["content"] == "PDF r.pdf"
    assert messages[3]["content"][1] == {
        "type": "file",
        "file": {"filename": "r.pdf", "file_data": "data:application/pdf;base64,JVBERi0xLjQK"},
    }


def test_documents_go_to_openai_as_file_parts_and_as_text(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    pdf = FileContent(data="JVBERi0xLjQK", mime_type="application/pdf", name="report.pdf")
    notes = FileContent(data="aGVsbG8gd29ybGQ=", mime_type="text/plain", name='a"b.txt')
    params = OpenAIChatModel("gpt-4o-mini", api_key="k").build_params(req(user("summarise", pdf, notes)))
    assert params["messages"][0]["content"] == [
        {"type": "text", "text": "summarise"},
        {"type": "file", "file": {"filename": "report.pdf", "file_data": "data:application/pdf;base64,JVBERi0xLjQK"}},
        {"type": "text", "text": '<file name="a&quot;b.txt" type="text/plain">\nhello world\n</file>'},
    ]


async def test_a_compatible_server_gets_a_note_instead_of_a_pdf(fake: OpenAIFake) -> None:
    """Many OpenAI-compatible servers refuse ``file`` parts; one would stay in the history and
    fail every later call."""
    fake.push(text_reply("read"))
    pdf = FileContent(data="JVBERi0xLjQK", mime_type="application/pdf", name="report.pdf")
    await events_of(model(fake), req(user("summarise", pdf)))
    assert fake.last["messages"][0]["content"] == [
        {"type": "text", "text": "summarise"},
        {"type": "text", "text": "[PDF report.pdf omitted: this server does not take PDFs]"},
    ]


# ------------------------------------------------------------------ failures


async def test_unauthorized_is_auth_error_without_retry(fake: OpenAIFake) -> None:
    fake.push(error(401, "Incorrect API key provided", type="invalid_request_error", code="invalid_api_key"))
    fake.push(text_reply("never"))
    events = [e async for e in Agent(model=model(fake), retry=FAST).stream("hi")]
    assert not [e for e in events if isinstance(e, ModelRetry)]
    result = events[-1]
    assert result.type == "agent_end" and result.stop_reason == "error"
    assert len(fake.requests) == 1


async def test_overflow_400_is_overflow(fake: OpenAIFake) -> None:
    fake.push(
        error(
            400,
            "This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 tokens.",
            code="context_length_exceeded",
        )
    )
    err = (await events_of(model(fake), req(user("big"))))[-1]
    assert isinstance(err, StreamError)
    assert (err.kind, err.status, err.retryable) == ("overflow", 400, False)
    assert err.message.stop_reason == "error"
    assert "maximum context length" in (err.message.error_message or "")


async def test_an_error_body_in_another_shape_is_quoted(fake: OpenAIFake) -> None:
    """The SDK's message quotes only OpenAI's ``error.message``: a server's ``{"error": "..."}``
    became "Error code: 400", its overflow went unrecognised (no compaction), its words lost."""
    fake.push(JSONReply(400, {"error": "the request exceeds the available context size, try increasing it"}))
    fake.push(JSONReply(503, {"detail": "upstream unavailable"}))
    err = (await events_of(model(fake), req(user("big"))))[-1]
    assert isinstance(err, StreamError) and (err.kind, err.status) == ("overflow", 400)
    assert err.message.error_message == "HTTP 400: the request exceeds the available context size, try increasing it"
    err = (await events_of(model(fake), req(user("x"))))[-1]
    assert isinstance(err, StreamError) and err.kind == "server" and err.retryable
    assert err.message.error_message == 'HTTP 503: {"detail": "upstream unavailable"}'


async def test_an_overflow_named_only_by_the_error_code_is_overflow(fake: OpenAIFake) -> None:
    fake.push(error(400, "Input tokens exceed the configured limit.", code="context_length_exceeded"))
    err = (await events_of(model(fake), req(user("big"))))[-1]
    assert isinstance(err, StreamError) and err.kind == "overflow"


async def test_other_400_is_bad_request(fake: OpenAIFake) -> None:
    fake.push(error(400, "Invalid value for 'tools'"))
    err = (await events_of(model(fake), req(user("x"))))[-1]
    assert isinstance(err, StreamError) and err.kind == "bad_request"


async def test_rate_limit_honours_retry_after_then_succeeds(fake: OpenAIFake) -> None:
    fake.push(error(429, "Rate limit reached", type="requests", code="rate_limit_exceeded", retry_after="0.2"))
    fake.push(text_reply("finally"))
    started = time.monotonic()
    events = [e async for e in Agent(model=model(fake), retry=FAST).stream("hi")]
    elapsed = time.monotonic() - started
    retries = [e for e in events if isinstance(e, ModelRetry)]
    assert len(retries) == 1 and retries[0].delay == pytest.approx(0.2)
    assert elapsed >= 0.2
    assert run_end(events).stop_reason == "stop"
    assert len(fake.requests) == 2


async def test_server_error_is_retried(fake: OpenAIFake) -> None:
    fake.push(error(500, "The server had an error", type="server_error"), text_reply("recovered"))
    result = await Agent(model=model(fake), retry=FAST).run("hi")
    assert result.stop_reason == "stop" and result.text == "recovered"
    assert len(fake.requests) == 2


async def test_stream_cut_midway_keeps_partial_text(fake: OpenAIFake) -> None:
    reply = text_reply("Hello there, this answer gets cut", pieces=6)
    fake.push(SSEReply(frames=reply.frames, cut_after=3))  # role chunk + two content chunks
    events = await events_of(model(fake), req(user("hi")))
    err = events[-1]
    assert isinstance(err, StreamError)
    assert err.kind == "connection" and err.retryable
    assert err.message.text == "Hello there,"  # the two content chunks before the cut
    assert "12 characters" in (err.message.error_message or "")


async def test_stream_ending_without_finish_is_connection_error(fake: OpenAIFake) -> None:
    fake.push(stream(chunk({"role": "assistant", "content": ""}), chunk({"content": "partial"}), done=False))
    err = (await events_of(model(fake), req(user("hi"))))[-1]
    assert isinstance(err, StreamError)
    assert err.kind == "connection" and err.message.text == "partial"


async def test_garbage_in_stream_is_an_error_event(fake: OpenAIFake) -> None:
    fake.push(stream(chunk({"content": "ok"}), "{this is not json", done=True))
    events = await events_of(model(fake), req(user("hi")))
    err = events[-1]
    assert isinstance(err, StreamError)
    assert err.kind == "invalid_response" and not err.retryable


async def test_broken_tool_arguments_stay_with_the_call_and_go_back_as_written(fake: OpenAIFake) -> None:
    """The reply is not lost: the call keeps what the model wrote (the loop answers it with an
    error), and the next request shows the model its call as it wrote it."""
    fake.push(tool_reply("echo", '{"text": "unterminated'))
    done = (await events_of(model(fake), req(user("hi"), tools=[ECHO_SPEC])))[-1]
    assert isinstance(done, StreamDone)
    [broken] = done.message.tool_calls
    assert broken.arguments == {} and broken.invalid_arguments == '{"text": "unterminated'
    answer = tool_error_result(broken, "bad arguments")
    fake.push(stream(chunk({"content": "sorry"}), done=True))
    await events_of(model(fake), req(user("hi"), done.message, answer, tools=[ECHO_SPEC]))
    sent = fake.requests[-1]["messages"][1]["tool_calls"][0]["function"]
    assert sent == {"name": "echo", "arguments": '{"text": "unterminated'}


async def test_error_event_inside_stream_is_server_error(fake: OpenAIFake) -> None:
    fake.push(stream(chunk({"content": "so"}), {"error": {"message": "upstream failed", "type": "server_error"}}))
    err = (await events_of(model(fake), req(user("hi"))))[-1]
    assert isinstance(err, StreamError) and err.kind == "server"


async def test_error_event_inside_stream_says_what_it_says(fake: OpenAIFake) -> None:
    """An ``error`` that is a string (a proxy's) was reported as "An error occurred during
    streaming"; one with a status code (vLLM, OpenRouter) was retried whatever the code."""
    fake.push(stream(chunk({"content": "so"}), {"error": "upstream idle timeout"}))
    fake.push(
        stream(chunk({"content": "so"}), {"error": {"message": "bad grammar", "type": "BadRequestError", "code": 400}})
    )
    err = (await events_of(model(fake), req(user("hi"))))[-1]
    assert isinstance(err, StreamError) and err.kind == "server" and err.retryable
    assert err.message.error_message == "stream error: upstream idle timeout" and err.message.text == "so"
    err = (await events_of(model(fake), req(user("hi"))))[-1]
    assert isinstance(err, StreamError) and (err.kind, err.status, err.retryable) == ("bad_request", 400, False)
    assert err.message.error_message == "stream error: bad grammar"


@pytest.mark.parametrize(
    ("finish", "stop"), [("eos", "stop"), ("eos_token", "stop"), ("stop_sequence", "stop"), ("model_length", "length")]
)
async def test_other_servers_words_for_stop_and_length(fake: OpenAIFake, finish: str, stop: str) -> None:
    """Together says ``eos``, older TGI ``eos_token``/``stop_sequence``, Mistral ``model_length``:
    a finished answer was thrown away as a non-retryable error."""
    fake.push(text_reply("all done", finish=finish))
    done = finished(await events_of(model(fake), req(user("hi"))))
    assert (done.message.text, done.message.stop_reason) == ("all done", stop)


@pytest.mark.parametrize("finish", ["insufficient_system_resource", "error"])
async def test_a_finish_reason_that_says_the_server_failed_is_retried(fake: OpenAIFake, finish: str) -> None:
    """DeepSeek's ``insufficient_system_resource`` (and Mistral's ``error``) end an answer the
    server could not finish: transient, not a bad request."""
    fake.push(text_reply("half", finish=finish), text_reply("whole"))
    result = await Agent(model=model(fake), retry=FAST).run("hi")
    assert (result.stop_reason, result.text) == ("stop", "whole")
    assert len(fake.requests) == 2


async def test_a_content_filter_stop_is_an_error(fake: OpenAIFake) -> None:
    fake.push(text_reply("I can", finish="content_filter"))
    err = (await events_of(model(fake), req(user("hi"))))[-1]
    assert isinstance(err, StreamError) and err.kind == "bad_request" and err.message.text == "I can"
    assert "content_filter" in (err.message.error_message or "")


async def test_connection_refused_is_connection_error() -> None:
    m = OpenAIChatModel("gpt-4o-mini", base_url="http://127.0.0.1:9/v1")
    err = (await events_of(m, req(user("hi"))))[-1]
    assert isinstance(err, StreamError) and err.kind == "connection"


async def test_missing_key_is_auth_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    err = (await events_of(OpenAIChatModel("gpt-4o-mini"), req(user("hi"))))[-1]
    assert isinstance(err, StreamError) and err.kind == "auth"


# ------------------------------------------------------------------ end to end


async def test_base_url_env_and_registry_string(fake: OpenAIFake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    m = resolve_model("openai:gpt-4o-mini")
    assert isinstance(m, OpenAIChatModel)
    fake.push(tool_reply("echo", '{"text": "ping"}'), text_reply("The tool said: echo: ping"))
    result = await Agent(model="openai:gpt-4o-mini", tools=[echo]).run("echo ping")
    assert result.stop_reason == "stop"
    assert result.text == "The tool said: echo: ping"
    assert fake.headers[0]["authorization"].startswith("Bearer ")  # a placeholder key for local servers


async def test_agent_run_with_real_tool_call(fake: OpenAIFake) -> None:
    fake.push(tool_reply("echo", '{"text": "hi"}', id="call_7", text="Calling echo."), text_reply("Done: echo: hi"))
    result = await Agent(model=model(fake), tools=[echo], system_prompt="Use tools.").run("say hi")
    assert result.ok and result.text == "Done: echo: hi"
    second = fake.requests[1]["messages"]
    assert second[0] == {"role": "system", "content": "Use tools."}
    assert second[2]["role"] == "assistant" and second[2]["content"] == "Calling echo."
    assert second[2]["tool_calls"][0]["id"] == "call_7"
    assert second[3] == {"role": "tool", "tool_call_id": "call_7", "content": "echo: hi"}
    assert result.usage.input > 0 and result.usage.cost.total > 0


async def test_fallback_after_primary_keeps_failing(fake: OpenAIFake) -> None:
    fake.forever = error(500, "down", type="server_error")
    with OpenAIFake() as good:
        good.push(text_reply("from the fallback"))
        agent = Agent(
            model=model(fake, "gpt-4o"),
            fallbacks=[OpenAIChatModel("gpt-4o-mini", base_url=good.base_url)],
            retry=RetryPolicy(max_retries=2, base_delay=0.01),
        )
        result = await agent.run("hi")
    assert result.stop_reason == "stop" and result.text == "from the fallback"
    assert len(fake.requests) == 3  # one call and two retries


async def test_abort_closes_the_stream(fake: OpenAIFake) -> None:
    reply = text_reply("slow answer " * 20, pieces=40)
    fake.push(SSEReply(frames=reply.frames, delay=0.05))
    m = model(fake)
    seen: list[str] = []
    gen: AsyncIterator[StreamEvent] = m.stream(req(user("hi")))
    async for event in gen:
        seen.append(event.type)
        if event.type == "text_delta":
            break
    await gen.aclose()  # type: ignore[attr-defined]
    assert seen[-1] == "text_delta"


async def test_lone_surrogates_in_a_stream_become_replacement_characters(fake: OpenAIFake) -> None:
    """Valid JSON, no UTF-8 form: the answer could not be stored, and the run failed as an
    internal error instead of keeping what the provider said."""
    fake.push(tool_reply("echo", '{"text": "a\\ud800b", "raw": "c\ud800d"}', id="call_s", text="x\ud800y", split=3))
    msg = finished(await events_of(model(fake), req(user("hi"), tools=[ECHO_SPEC]))).message
    assert msg.text == "x\ufffdy"
    assert msg.tool_calls[0].arguments == {"text": "a\ufffdb", "raw": "c\ufffdd"}
    assert "\ufffd" in message_to_json(msg)
