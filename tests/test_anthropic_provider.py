"""The Anthropic Messages adapter against a local server that speaks the wire format."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agentloop import Agent, tool, user
from agentloop.events import AgentEnd, LoopEvent, ModelRetry, StreamDone, StreamError, StreamEvent
from agentloop.images import sniff_image
from agentloop.loop.execute import malformed
from agentloop.messages import (
    AssistantMessage,
    FileContent,
    ImageContent,
    SystemMessage,
    TextContent,
    ThinkingContent,
    ToolCall,
    ToolResultMessage,
)
from agentloop.models.anthropic import AnthropicModel
from agentloop.models.base import ModelRequest, ToolSpec
from agentloop.models.overflow import is_context_overflow
from agentloop.models.registry import resolve_model
from agentloop.models.retry import RetryPolicy
from tests.fakes.anthropic_server import (
    AnthropicFake,
    error,
    error_body,
    ev,
    json_delta,
    message_end,
    message_start,
    stream,
    text_block,
    text_reply,
    thinking_block,
    tool_reply,
    tool_start,
)
from tests.fakes.http_server import SSEReply
from tests.image_support import jpeg, png

# anthropic 2.x warns about model ids it considers deprecated; the ids here are only fixture names
pytestmark = pytest.mark.filterwarnings("ignore:The model .* is deprecated:DeprecationWarning")

FAST = RetryPolicy(base_delay=0.01, max_delay=1.0)
ECHO_SPEC = ToolSpec(name="echo", description="Echo text.", parameters={"type": "object", "properties": {}})
SONNET = "claude-sonnet-4-5"


@pytest.fixture(scope="module")
def server() -> Iterator[AnthropicFake]:
    with AnthropicFake() as fake:
        yield fake


@pytest.fixture
def fake(server: AnthropicFake) -> Iterator[AnthropicFake]:
    server.reset()
    yield server
    server.reset()


def model(fake: AnthropicFake, model_id: str = SONNET, **kw: Any) -> AnthropicModel:
    return AnthropicModel(model_id, base_url=fake.base_url, api_key="sk-ant-test", **kw)


async def events_of(m: AnthropicModel, request: ModelRequest) -> list[StreamEvent]:
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


async def test_text_streaming_events_usage_and_cost(fake: AnthropicFake) -> None:
    fake.push(text_reply("Hello there, world", pieces=3, input=1000, output=200, cache_read=3000, cache_write=500))
    events = await events_of(model(fake), req(user("hi"), system="Be brief."))
    assert [e.type for e in events] == ["start", "text_start", *["text_delta"] * 3, "text_end", "done"]
    done = events[-1]
    assert isinstance(done, StreamDone)
    msg = done.message
    assert (msg.text, msg.stop_reason, msg.provider, msg.model) == ("Hello there, world", "stop", "anthropic", SONNET)
    u = msg.usage
    assert (u.input, u.output, u.cache_read, u.cache_write, u.total_tokens) == (1000, 200, 3000, 500, 4700)
    # sonnet 4.5: $3 in, $15 out, $0.30 cache read, $3.75 cache write per million
    assert u.cost.total == pytest.approx((1000 * 3 + 200 * 15 + 3000 * 0.3 + 500 * 3.75) / 1e6)
    body = fake.last
    assert body["model"] == SONNET and body["stream"] is True
    assert body["max_tokens"] == 64_000  # the catalog's max output when the request sets none
    assert body["system"] == [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}
    ]
    assert "tools" not in body and "temperature" not in body and "thinking" not in body
    headers = fake.headers[-1]  # SDK 2.x sends the key as a bearer token, older ones as x-api-key
    assert "sk-ant-test" in (headers.get("x-api-key"), headers.get("authorization", "").removeprefix("Bearer "))


async def test_max_tokens_stop_and_temperature(fake: AnthropicFake) -> None:
    fake.push(stream(message_start(), *text_block(0, "cut"), *message_end("max_tokens")))
    request = ModelRequest(system_prompt="", messages=[user("hi")], max_tokens=9, temperature=0.2)
    done = finished(await events_of(model(fake, prompt_cache=False), request))
    assert done.message.stop_reason == "length"
    assert (fake.last["max_tokens"], fake.last["temperature"]) == (9, 0.2)
    assert fake.last["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


async def test_tool_call_arguments_split_across_chunks(fake: AnthropicFake) -> None:
    fake.push(tool_reply("echo", '{"text": "hello world"}', id="toolu_abc", text="Let me echo.", split=4))
    events = await events_of(model(fake), req(user("echo it"), tools=[ECHO_SPEC]))
    types = [e.type for e in events]
    assert types[:5] == ["start", "text_start", "text_delta", "text_end", "toolcall_start"]
    assert types.count("toolcall_delta") == 4
    assert types[-2:] == ["toolcall_end", "done"]
    msg = finished(events).message
    assert msg.stop_reason == "toolUse" and msg.text == "Let me echo."
    assert msg.tool_calls == [ToolCall(id="toolu_abc", name="echo", arguments={"text": "hello world"})]
    assert fake.last["tools"] == [{"name": "echo", "description": "Echo text.", "input_schema": ECHO_SPEC.parameters}]
    assert "tool_choice" not in fake.last  # the provider's default: parallel calls allowed


async def test_sequential_tool_execution_disables_parallel_tool_use(fake: AnthropicFake) -> None:
    fake.push(tool_reply("echo", '{"text": "hi"}', id="toolu_1"), text_reply("done"))
    agent = Agent(model=model(fake), tools=[echo], tool_execution="sequential")
    assert (await agent.run("say hi")).text == "done"
    assert [r["tool_choice"] for r in fake.requests] == [{"type": "auto", "disable_parallel_tool_use": True}] * 2


async def test_two_parallel_tool_calls_interleaved(fake: AnthropicFake) -> None:
    fake.push(
        stream(
            message_start(),
            tool_start(0, "toolu_a", "echo"),
            tool_start(1, "toolu_b", "echo"),
            json_delta(0, '{"te'),
            json_delta(1, '{"text"'),
            json_delta(0, 'xt": "one"}'),
            json_delta(1, ': "two"}'),
            ev("content_block_stop", index=0),
            ev("content_block_stop", index=1),
            *message_end("tool_use"),
        )
    )
    done = (await events_of(model(fake), req(user("two"), tools=[ECHO_SPEC])))[-1]
    assert isinstance(done, StreamDone)
    assert done.message.tool_calls == [
        ToolCall(id="toolu_a", name="echo", arguments={"text": "one"}),
        ToolCall(id="toolu_b", name="echo", arguments={"text": "two"}),
    ]


async def test_thinking_with_signature_and_budget(fake: AnthropicFake) -> None:
    fake.push(
        stream(
            message_start(),
            *thinking_block(0, "Let me think about it.", "sig-123"),
            ev("content_block_start", index=1, content_block={"type": "redacted_thinking", "data": "opaque=="}),
            ev("content_block_stop", index=1),
            *text_block(2, "42"),
            *message_end(),
        )
    )
    m = model(fake, thinking_budget=2048)
    request = ModelRequest(system_prompt="", messages=[user("?")], max_tokens=1000, temperature=0.5)
    events = await events_of(m, request)
    types = [e.type for e in events]
    assert types[:5] == ["start", "thinking_start", "thinking_delta", "thinking_delta", "thinking_end"]
    assert types[5:] == ["thinking_start", "thinking_end", "text_start", "text_delta", "text_end", "done"]
    msg = finished(events).message
    assert msg.content == [
        ThinkingContent(thinking="Let me think about it.", signature="sig-123"),
        ThinkingContent(thinking="", signature="opaque==", redacted=True),
        TextContent(text="42"),
    ]
    body = fake.last
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert body["max_tokens"] > 2048 and "temperature" not in body

    # replayed to the same model: signed thinking and redacted thinking come back as they were
    fake.push(text_reply("ok"))
    await events_of(m, req(user("?"), msg, user("and?")))
    assert fake.last["messages"][1]["content"] == [
        {"type": "thinking", "thinking": "Let me think about it.", "signature": "sig-123"},
        {"type": "redacted_thinking", "data": "opaque=="},
        {"type": "text", "text": "42"},
    ]
    # replayed to another model: thinking becomes plain text, redacted thinking is dropped
    fake.push(text_reply("ok"))
    await events_of(model(fake, "claude-haiku-4-5"), req(user("?"), msg, user("and?")))
    assert fake.last["messages"][1]["content"] == [
        {"type": "text", "text": "Let me think about it."},
        {"type": "text", "text": "42"},
    ]


async def test_tool_input_sent_whole_in_the_block_start(fake: AnthropicFake) -> None:
    """A server that puts a tool's input in ``content_block_start`` and sends no deltas (which
    the SDK's accumulator takes) had the call run with no arguments."""
    whole = ev(
        "content_block_start",
        index=0,
        content_block={"type": "tool_use", "id": "toolu_w", "name": "echo", "input": {"text": "whole"}},
    )
    fake.push(
        stream(message_start(), whole, ev("content_block_stop", index=0), *message_end("tool_use")),
        stream(  # deltas, when they come, are the input (as in the SDK)
            message_start(),
            ev(
                "content_block_start",
                index=0,
                content_block={"type": "tool_use", "id": "toolu_d", "name": "echo", "input": {"text": "stale"}},
            ),
            json_delta(0, ""),
            json_delta(0, '{"text": "fresh"}'),
            ev("content_block_stop", index=0),
            *message_end("tool_use"),
        ),
    )
    done = finished(await events_of(model(fake), req(user("x"), tools=[ECHO_SPEC])))
    assert done.message.tool_calls == [ToolCall(id="toolu_w", name="echo", arguments={"text": "whole"})]
    done = finished(await events_of(model(fake), req(user("x"), tools=[ECHO_SPEC])))
    assert done.message.tool_calls == [ToolCall(id="toolu_d", name="echo", arguments={"text": "fresh"})]


async def test_a_tool_call_cut_by_max_tokens_says_so(fake: AnthropicFake) -> None:
    fake.push(
        stream(
            message_start(), tool_start(0, "toolu_c", "echo"), json_delta(0, '{"text": "lo'), *message_end("max_tokens")
        )
    )
    done = finished(await events_of(model(fake), req(user("x"), tools=[ECHO_SPEC])))
    assert done.message.stop_reason == "length"
    [cut] = done.message.tool_calls
    assert cut.arguments == {} and cut.invalid_arguments == '{"text": "lo'
    assert "cut off by the output token limit" in malformed(cut, done.message).text


# ------------------------------------------------------------------ request conversion


async def test_whitespace_only_text_is_left_out(fake: AnthropicFake) -> None:
    """The API refuses a text block of only whitespace ("text content blocks must contain
    non-whitespace text"); kept in the history, one (a tool's "\n") failed every later call."""
    calls = AssistantMessage(content=[ToolCall(id="toolu_1", name="echo", arguments={})], stop_reason="toolUse")
    blank = ToolResultMessage(tool_call_id="toolu_1", tool_name="echo", content=[TextContent(text="\n")])
    fake.push(text_reply("ok"))
    await events_of(
        model(fake, prompt_cache=False),
        req(user("go"), calls, blank, user(" \n", ImageContent(data="AAAA", mime_type="image/png"))),
    )
    sent = fake.last["messages"]
    assert sent[2]["content"] == [
        {"type": "tool_result", "tool_use_id": "toolu_1"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
    ]


async def test_history_tool_results_merged_ids_and_notices(fake: AnthropicFake) -> None:
    long_id = "call_" + "y" * 70 + ".odd|id"
    history = [
        user("first"),
        AssistantMessage(
            content=[
                TextContent(text="Running both."),
                ToolCall(id=long_id, name="echo", arguments={"text": "a"}),
                ToolCall(id="call_2", name="echo", arguments={"text": "b"}),
            ],
            provider="openai",
            model="gpt-4o",
            stop_reason="toolUse",
        ),
        ToolResultMessage(
            tool_call_id=long_id,
            tool_name="echo",
            content=[TextContent(text="echo: a"), ImageContent(data="AAAA", mime_type="image/png")],
        ),
        ToolResultMessage(tool_call_id="call_2", tool_name="echo", content=[TextContent(text="boom")], is_error=True),
        SystemMessage(content=[TextContent(text="3 rounds left")]),
        AssistantMessage(content=[], stop_reason="error", error_message="overloaded"),
        user("go on"),
    ]
    fake.push(text_reply("ok"))
    await events_of(model(fake, prompt_cache=False), req(*history, system="sys"))
    sent = fake.last["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    text_block_, use_a, use_b = sent[1]["content"]
    assert text_block_ == {"type": "text", "text": "Running both."}
    assert use_a["type"] == "tool_use" and use_a["input"] == {"text": "a"}
    assert len(use_a["id"]) <= 64 and use_a["id"].replace("_", "").replace("-", "").isalnum()
    assert use_b == {"type": "tool_use", "id": "call_2", "name": "echo", "input": {"text": "b"}}
    assert sent[2]["content"] == [
        {
            "type": "tool_result",
            "tool_use_id": use_a["id"],
            "content": [
                {"type": "text", "text": "echo: a"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            ],
        },
        {
            "type": "tool_result",
            "tool_use_id": "call_2",
            "content": [{"type": "text", "text": "boom"}],
            "is_error": True,
        },
        {"type": "text", "text": "[system notice] 3 rounds left"},
        {"type": "text", "text": "go on"},
    ]
    assert fake.last["system"] == [{"type": "text", "text": "sys"}]


async def test_image_input_as_base64_block(fake: AnthropicFake) -> None:
    fake.push(text_reply("a cat"))
    await events_of(model(fake), req(user("what is this?", ImageContent(data="/9j/", mime_type="image/jpeg"))))
    content = fake.last["messages"][0]["content"]
    assert content[0] == {"type": "text", "text": "what is this?"}
    assert content[1]["source"] == {"type": "base64", "media_type": "image/jpeg", "data": "/9j/"}


def b64_image(data: bytes) -> ImageContent:
    return ImageContent(data=base64.b64encode(data).decode(), mime_type=sniff_image(data) or "image/png")


def sent_blocks(content: list[dict[str, Any]]) -> list[str]:
    """Each sent block as "image", or the note that took an image's place."""
    return ["image" if b["type"] == "image" else b["text"] for b in content if b["type"] != "tool_result"]


async def test_an_image_past_anthropics_limits_is_a_note_not_a_refused_request(fake: AnthropicFake) -> None:
    """Anthropic refuses a request holding an image over 5 MiB of base64 or 8000 pixels a side,
    and the image stays in the history: without this, every later call of the conversation
    failed. The model is told what was left out and why."""
    huge = png(8001, 600)
    heavy = ImageContent(data=base64.b64encode(png() + bytes(4 * 2**20)).decode(), mime_type="image/png")
    fake.push(text_reply("seen"))
    await events_of(model(fake), req(user("look", b64_image(png(8000, 8000)), b64_image(huge), heavy)))
    assert sent_blocks(fake.last["messages"][0]["content"]) == [
        "look",
        "image",
        "[an image (image/png) was left out: it is 8001x600 pixels, over the 8000 a side Anthropic takes]",
        "[an image (image/png) was left out: it is 5.3 MiB in base64, over the 5 MiB Anthropic takes]",
    ]


async def test_a_request_of_many_images_keeps_the_newest_within_anthropics_limits(fake: AnthropicFake) -> None:
    """More than 20 images in a request: 2000 pixels a side at most; more than 100: the oldest go."""
    images = [b64_image(jpeg(2001 if i == 60 else 100, 100)) for i in range(102)]
    fake.push(text_reply("seen"))
    await events_of(model(fake), req(user("many", *images)))
    sent = sent_blocks(fake.last["messages"][0]["content"])
    too_many = "[an image (image/jpeg) was left out: a request holds at most 100 images, and newer ones came after it]"
    too_big = (
        "[an image (image/jpeg) was left out: it is 2001x100 pixels, over the 2000 a side Anthropic takes"
        " in a request of more than 20 images]"
    )
    assert sent == ["many", too_many, too_many, *["image"] * 58, too_big, *["image"] * 41]


async def test_a_pdf_returned_by_a_tool_is_a_document_in_the_tool_result(fake: AnthropicFake) -> None:
    calls = AssistantMessage(content=[ToolCall(id="toolu_1", name="Read", arguments={})], stop_reason="toolUse")
    pdf = FileContent(data="JVBERi0xLjQK", mime_type="application/pdf", name="r.pdf")
    result = ToolResultMessage(tool_call_id="toolu_1", tool_name="Read", content=[TextContent(text="PDF r.pdf"), pdf])
    fake.push(text_reply("read"))
    await events_of(model(fake), req(user("read r.pdf"), calls, result))
    [tool_result] = [b for b in fake.last["messages"][2]["content"] if b["type"] == "tool_result"]
    assert tool_result["content"][1]["type"] == "document"
    assert tool_result["content"][1]["source"] == {
        "type": "base64",
        "media_type": "application/pdf",
        "data": "JVBERi0xLjQK",
    }


async def test_documents_as_document_blocks(fake: AnthropicFake) -> None:
    fake.push(text_reply("read"))
    pdf = FileContent(data="JVBERi0xLjQK", mime_type="application/pdf", name="report.pdf")
    notes = FileContent(data="aGVsbG8gd29ybGQ=", mime_type="text/plain")
    await events_of(model(fake), req(user("summarise", pdf, notes)))
    content = [{k: v for k, v in b.items() if k != "cache_control"} for b in fake.last["messages"][0]["content"]]
    assert content[1:] == [
        {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQK"},
            "title": "report.pdf",
        },
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "hello world"}},
    ]


# ------------------------------------------------------------------ failures


async def test_unauthorized_is_auth_error_without_retry(fake: AnthropicFake) -> None:
    fake.push(error(401, "authentication_error", "invalid x-api-key"), text_reply("never"))
    events = [e async for e in Agent(model=model(fake), retry=FAST).stream("hi")]
    assert not [e for e in events if isinstance(e, ModelRetry)]
    end = events[-1]
    assert end.type == "agent_end" and end.stop_reason == "error"
    assert len(fake.requests) == 1


async def test_overflow_400_is_overflow(fake: AnthropicFake) -> None:
    fake.push(error(400, "invalid_request_error", "prompt is too long: 213462 tokens > 200000 maximum"))
    err = (await events_of(model(fake), req(user("big"))))[-1]
    assert isinstance(err, StreamError)
    assert (err.kind, err.status, err.retryable) == ("overflow", 400, False)
    assert "prompt is too long" in (err.message.error_message or "")


async def test_input_and_max_tokens_over_the_window_is_overflow(fake: AnthropicFake) -> None:
    """With max_tokens at the model's output cap (64k), this is the overflow a long conversation
    meets first; read as a bad request, the run failed instead of compacting."""
    message = (
        "input length and `max_tokens` exceed context limit: 178959 + 64000 > 200000, "
        "decrease input length or `max_tokens` and try again"
    )
    fake.push(error(400, "invalid_request_error", message))
    err = (await events_of(model(fake), req(user("big"))))[-1]
    assert isinstance(err, StreamError) and (err.kind, err.status) == ("overflow", 400)
    assert is_context_overflow(err.message)


async def test_other_400_is_bad_request(fake: AnthropicFake) -> None:
    fake.push(error(400, "invalid_request_error", "messages: roles must alternate"))
    err = (await events_of(model(fake), req(user("x"))))[-1]
    assert isinstance(err, StreamError) and err.kind == "bad_request"


async def test_rate_limit_honours_retry_after_then_succeeds(fake: AnthropicFake) -> None:
    fake.push(
        error(429, "rate_limit_error", "Number of request tokens has exceeded your rate limit", retry_after="0.2")
    )
    fake.push(text_reply("finally"))
    started = time.monotonic()
    events = [e async for e in Agent(model=model(fake), retry=FAST).stream("hi")]
    elapsed = time.monotonic() - started
    retries = [e for e in events if isinstance(e, ModelRetry)]
    assert len(retries) == 1 and retries[0].delay == pytest.approx(0.2)
    assert elapsed >= 0.2
    assert run_end(events).stop_reason == "stop" and len(fake.requests) == 2


async def test_overloaded_529_is_rate_limit(fake: AnthropicFake) -> None:
    fake.push(error(529, "overloaded_error", "Overloaded", retry_after="1"))
    err = (await events_of(model(fake), req(user("x"))))[-1]
    assert isinstance(err, StreamError)
    assert (err.kind, err.status, err.retry_after) == ("rate_limit", 529, 1.0)


async def test_server_error_is_retried(fake: AnthropicFake) -> None:
    fake.push(error(500, "api_error", "Internal server error"), text_reply("recovered"))
    result = await Agent(model=model(fake), retry=FAST).run("hi")
    assert result.stop_reason == "stop" and result.text == "recovered"
    assert len(fake.requests) == 2


async def test_overloaded_error_event_mid_stream(fake: AnthropicFake) -> None:
    fake.push(
        stream(
            message_start(),
            *text_block(0, "partial answer")[:2],
            ("error", error_body("overloaded_error", "Overloaded")),
        )
    )
    err = (await events_of(model(fake), req(user("x"))))[-1]
    assert isinstance(err, StreamError)
    assert err.kind == "rate_limit" and err.retryable
    assert err.message.text == "partial answer"


async def test_stream_cut_midway_keeps_partial_text(fake: AnthropicFake) -> None:
    reply = text_reply("Hello there, this answer gets cut", pieces=6)
    fake.push(SSEReply(frames=reply.frames, cut_after=5))  # start, ping, block start, two deltas
    err = (await events_of(model(fake), req(user("hi"))))[-1]
    assert isinstance(err, StreamError)
    assert err.kind == "connection" and err.retryable
    assert err.message.text == "Hello there,"
    assert "12 characters" in (err.message.error_message or "")


async def test_stream_ending_without_message_stop_is_connection_error(fake: AnthropicFake) -> None:
    fake.push(stream(message_start(), *text_block(0, "partial")))
    err = (await events_of(model(fake), req(user("hi"))))[-1]
    assert isinstance(err, StreamError) and err.kind == "connection" and err.message.text == "partial"


async def test_garbage_in_stream_is_an_error_event(fake: AnthropicFake) -> None:
    fake.push(SSEReply(frames=[*stream(message_start()).frames, "event: content_block_delta\ndata: {nope\n\n"]))
    err = (await events_of(model(fake), req(user("hi"))))[-1]
    assert isinstance(err, StreamError) and err.kind == "invalid_response"


async def test_missing_key_is_auth_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)
    err = (await events_of(AnthropicModel(SONNET), req(user("hi"))))[-1]
    assert isinstance(err, StreamError) and err.kind == "auth"


# ------------------------------------------------------------------ end to end


async def test_base_url_env_and_registry_string(fake: AnthropicFake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_BASE_URL", fake.base_url)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    assert isinstance(resolve_model(f"anthropic:{SONNET}"), AnthropicModel)
    fake.push(tool_reply("echo", '{"text": "ping"}'), text_reply("The tool said: echo: ping"))
    result = await Agent(model=f"anthropic:{SONNET}", tools=[echo]).run("echo ping")
    assert result.stop_reason == "stop" and result.text == "The tool said: echo: ping"


async def test_agent_run_with_real_tool_call(fake: AnthropicFake) -> None:
    fake.push(tool_reply("echo", '{"text": "hi"}', id="toolu_7", text="Calling echo."), text_reply("Done: echo: hi"))
    result = await Agent(model=model(fake, prompt_cache=False), tools=[echo], system_prompt="Use tools.").run("say hi")
    assert result.ok and result.text == "Done: echo: hi"
    second = fake.requests[1]
    assert second["system"] == [{"type": "text", "text": "Use tools."}]
    assert second["messages"][1] == {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Calling echo."},
            {"type": "tool_use", "id": "toolu_7", "name": "echo", "input": {"text": "hi"}},
        ],
    }
    assert second["messages"][2] == {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_7", "content": [{"type": "text", "text": "echo: hi"}]}
        ],
    }
    assert result.usage.cost.total > 0


async def test_fallback_after_primary_keeps_failing(fake: AnthropicFake) -> None:
    fake.forever = error(500, "api_error", "down")
    with AnthropicFake() as good:
        good.push(text_reply("from the fallback"))
        agent = Agent(
            model=model(fake),
            fallbacks=[AnthropicModel("claude-haiku-4-5", base_url=good.base_url)],
            retry=RetryPolicy(max_retries=2, base_delay=0.01),
        )
        result = await agent.run("hi")
    assert result.stop_reason == "stop" and result.text == "from the fallback"
    assert len(fake.requests) == 3
