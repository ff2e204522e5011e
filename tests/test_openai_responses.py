"""The OpenAI Responses API adapter against a local server that speaks its SSE wire format."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from agentloop import Agent, user
from agentloop.events import ModelRetry, StreamError, StreamEvent
from agentloop.loop.hooks import Hooks
from agentloop.messages import (
    AssistantMessage,
    FileContent,
    ImageContent,
    SystemMessage,
    TextContent,
    ThinkingContent,
    ToolCall,
    ToolResultMessage,
    message_from_json,
    message_to_json,
)
from agentloop.models.base import ModelRequest, ProviderRequest, ToolSpec
from agentloop.models.openai_responses import OpenAIResponsesModel
from agentloop.models.registry import provider_status, resolve_model
from agentloop.models.retry import RetryPolicy
from tests.fakes.http_server import SSEReply
from tests.fakes.openai_responses_server import (
    ResponsesFake,
    call_added,
    call_delta,
    call_done,
    completed,
    created,
    error,
    failed,
    incomplete,
    message_events,
    reasoning_events,
    stream,
    text_reply,
    tool_reply,
)
from tests.test_openai_provider import echo, finished  # (the chat adapter's test helpers)

FAST = RetryPolicy(base_delay=0.01, max_delay=1.0)
ECHO_SPEC = ToolSpec(name="echo", description="Echo text.", parameters={"type": "object", "properties": {}})


@pytest.fixture(scope="module")
def server() -> Iterator[ResponsesFake]:
    with ResponsesFake() as fake:
        yield fake


@pytest.fixture
def fake(server: ResponsesFake) -> Iterator[ResponsesFake]:
    server.reset()
    yield server
    server.reset()


def model(fake: ResponsesFake, model_id: str = "gpt-4o-mini", **options: Any) -> OpenAIResponsesModel:
    return OpenAIResponsesModel(model_id, base_url=fake.base_url, api_key="sk-test", **options)


async def events_of(m: OpenAIResponsesModel, request: ModelRequest) -> list[StreamEvent]:
    return [e async for e in m.stream(request)]


def req(*messages: Any, tools: list[ToolSpec] | None = None, system: str = "", **kw: Any) -> ModelRequest:
    return ModelRequest(system_prompt=system, messages=list(messages), tools=tools or [], **kw)


def failure(events: list[StreamEvent]) -> StreamError:
    last = events[-1]
    assert isinstance(last, StreamError), last
    return last


# ------------------------------------------------------------------ answers


async def test_a_text_answer_streams_with_usage_cost_and_a_stateless_request(fake: ResponsesFake) -> None:
    fake.push(text_reply("Hello there, world", pieces=3, input=1000, output=200, cached=400))
    events = await events_of(model(fake), req(user("hi"), system="Be brief."))
    assert [e.type for e in events] == ["start", "text_start", *["text_delta"] * 3, "text_end", "done"]
    msg = finished(events).message
    assert (msg.text, msg.stop_reason, msg.provider, msg.model) == (
        "Hello there, world",
        "stop",
        "openai-responses",
        "gpt-4o-mini",
    )
    assert (msg.usage.input, msg.usage.output, msg.usage.cache_read, msg.usage.total_tokens) == (600, 200, 400, 1200)
    # OpenAI's prices for gpt-4o-mini: $0.15 in, $0.60 out, $0.075 cache read per million
    assert msg.usage.cost.total == pytest.approx((600 * 0.15 + 200 * 0.6 + 400 * 0.075) / 1e6)
    body = fake.last
    assert body["model"] == "gpt-4o-mini" and body["stream"] is True and body["store"] is False
    assert body["instructions"] == "Be brief."
    assert body["input"] == [{"role": "user", "content": "hi"}]
    for absent in ("tools", "include", "reasoning", "max_output_tokens", "temperature", "parallel_tool_calls"):
        assert absent not in body, absent
    assert fake.headers[-1]["authorization"] == "Bearer sk-test"


async def test_the_output_limit_is_a_length_stop(fake: ResponsesFake) -> None:
    fake.push(stream(created(), *message_events("cut sh"), incomplete("max_output_tokens")))
    done = finished(await events_of(model(fake), req(user("hi"), max_tokens=7, temperature=0.0)))
    assert (done.message.stop_reason, done.message.text) == ("length", "cut sh")
    assert done.message.usage.input == 12  # the incomplete response's usage counts too
    assert (fake.last["max_output_tokens"], fake.last["temperature"]) == (7, 0.0)


async def test_a_content_filter_stop_is_an_error_that_keeps_the_text(fake: ResponsesFake) -> None:
    fake.push(stream(created(), *message_events("I can"), incomplete("content_filter")))
    err = failure(await events_of(model(fake), req(user("hi"))))
    assert err.kind == "bad_request" and err.message.text == "I can"
    assert "content_filter" in (err.message.error_message or "")


# ------------------------------------------------------------------ tools


async def test_a_tool_call_round_trip_sends_the_call_and_its_output_back(fake: ResponsesFake) -> None:
    fake.push(tool_reply("echo", '{"text": "hi"}', call_id="call_7", text="Calling echo."), text_reply("Done."))
    result = await Agent(model=model(fake), tools=[echo], system_prompt="Use tools.").run("say hi")
    assert result.ok and result.text == "Done."
    first, second = fake.requests
    assert first["tools"] == [
        {
            "type": "function",
            "name": "echo",
            "description": "Echo the text.",
            "parameters": first["tools"][0]["parameters"],
            "strict": False,  # the Responses API's default is strict, which most schemas fail
        }
    ]
    assert first["tools"][0]["parameters"]["properties"]["text"]["type"] == "string"
    assert second["instructions"] == "Use tools."
    assert second["input"] == [
        {"role": "user", "content": "say hi"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Calling echo.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "call_7", "name": "echo", "arguments": '{"text": "hi"}'},
        {"type": "function_call_output", "call_id": "call_7", "output": "echo: hi"},
    ]
    assert result.usage.input > 0 and result.usage.cost.total > 0


async def test_parallel_calls_with_interleaved_arguments_stay_apart(fake: ResponsesFake) -> None:
    fake.push(
        stream(
            created(),
            call_added(0, "call_a", "echo"),
            call_added(1, "call_b", "echo"),
            call_delta(0, '{"te'),
            call_delta(1, '{"text"'),
            call_delta(0, 'xt": "one"}'),
            call_delta(1, ': "two"}'),
            call_done(0, "call_a", "echo", '{"text": "one"}'),
            call_done(1, "call_b", "echo", '{"text": "two"}'),
            completed(),
        )
    )
    msg = finished(await events_of(model(fake), req(user("two"), tools=[ECHO_SPEC]))).message
    assert msg.stop_reason == "toolUse"
    assert msg.tool_calls == [
        ToolCall(id="call_a", name="echo", arguments={"text": "one"}),
        ToolCall(id="call_b", name="echo", arguments={"text": "two"}),
    ]


async def test_a_call_sent_only_whole_at_its_end_keeps_its_arguments(fake: ResponsesFake) -> None:
    fake.push(stream(created(), call_done(0, "call_w", "echo", '{"text": "whole"}'), completed()))
    msg = finished(await events_of(model(fake), req(user("x"), tools=[ECHO_SPEC]))).message
    assert msg.tool_calls == [ToolCall(id="call_w", name="echo", arguments={"text": "whole"})]


async def test_arguments_for_a_call_never_started_are_an_unreadable_response(fake: ResponsesFake) -> None:
    fake.push(stream(created(), call_delta(3, '{"text": "x"}'), completed()))
    err = failure(await events_of(model(fake), req(user("x"), tools=[ECHO_SPEC])))
    assert err.kind == "invalid_response" and "never started" in (err.message.error_message or "")


def test_sequential_tool_execution_asks_for_one_call_at_a_time() -> None:
    one_by_one = req(user("hi"), tools=[ECHO_SPEC], parallel_tool_calls=False)
    m = OpenAIResponsesModel("gpt-5-mini", api_key="k", base_url="http://127.0.0.1:9/v1")
    assert m.build_params(one_by_one)["parallel_tool_calls"] is False  # reasoning models take it here
    assert "parallel_tool_calls" not in m.build_params(req(user("hi"), tools=[ECHO_SPEC]))


def test_the_conversation_key_goes_to_openais_prompt_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    keyed = req(user("hi"), cache_key="proc-1")
    assert OpenAIResponsesModel("gpt-4o-mini", api_key="k").build_params(keyed)["prompt_cache_key"] == "proc-1"
    other = OpenAIResponsesModel("m", api_key="k", base_url="http://127.0.0.1:8000/v1")
    assert "prompt_cache_key" not in other.build_params(keyed)  # a compatible server may refuse it


# ------------------------------------------------------------------ media and history


async def test_images_and_documents_go_in_as_input_parts(fake: ResponsesFake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    image = ImageContent(data="iVBOR", mime_type="image/png")
    pdf = FileContent(data="JVBERi0xLjQK", mime_type="application/pdf", name="r.pdf")
    notes = FileContent(data="aGVsbG8gd29ybGQ=", mime_type="text/plain", name="n.txt")
    call = AssistantMessage(content=[ToolCall(id="call_s", name="Shot", arguments={})], stop_reason="toolUse")
    shot = ToolResultMessage(tool_call_id="call_s", tool_name="Shot", content=[TextContent(text="taken"), image])
    history = req(user("what is this?", image, pdf, notes), call, shot)
    items = OpenAIResponsesModel("gpt-4o-mini", api_key="k").build_params(history)["input"]
    image_part = {"type": "input_image", "image_url": "data:image/png;base64,iVBOR", "detail": "auto"}
    assert items[0]["content"] == [
        {"type": "input_text", "text": "what is this?"},
        image_part,
        {"type": "input_file", "filename": "r.pdf", "file_data": "data:application/pdf;base64,JVBERi0xLjQK"},
        {"type": "input_text", "text": '<file name="n.txt" type="text/plain">\nhello world\n</file>'},
    ]
    # a tool's image goes back inside its output, right after its call
    assert items[2] == {
        "type": "function_call_output",
        "call_id": "call_s",
        "output": [{"type": "input_text", "text": "taken"}, image_part],
    }
    fake.push(text_reply("a cat"))  # over the wire, to a compatible server: a note for the PDF
    await events_of(model(fake), req(user("what is this?", image, pdf)))
    assert fake.last["input"][0]["content"][1:] == [
        image_part,
        {"type": "input_text", "text": "[PDF r.pdf omitted: this server does not take PDFs]"},
    ]


def test_history_hygiene_and_notices() -> None:
    long_id = "toolu_" + "x" * 60 + ".weird|id"
    history = req(
        user("first"),
        AssistantMessage(
            content=[
                ThinkingContent(thinking="private", signature="anthropic-signature"),
                ToolCall(id=long_id, name="echo", arguments={"text": "é"}),
            ],
            provider="anthropic",
            model="claude-sonnet-4-5",
            stop_reason="toolUse",
        ),
        SystemMessage(content=[TextContent(text="guard notice")]),
        AssistantMessage(content=[TextContent(text="failed")], stop_reason="error", error_message="boom"),
        user("again"),
    )
    items = OpenAIResponsesModel("gpt-4o-mini", api_key="k", base_url="http://127.0.0.1:9/v1").build_params(history)
    sent = items["input"]
    assert [i.get("type", i.get("role")) for i in sent] == [
        "user",
        "function_call",
        "function_call_output",  # the missing result, made up by replay hygiene
        "developer",
        "user",
    ]
    call_id = sent[1]["call_id"]
    assert len(call_id) <= 40 and sent[2]["call_id"] == call_id and sent[1]["arguments"] == '{"text": "é"}'
    assert sent[3] == {"role": "developer", "content": "guard notice"}
    assert "private" not in json.dumps(sent) and "reasoning" not in json.dumps(sent)  # another provider's thinking


# ------------------------------------------------------------------ reasoning


def _reasoning_answer() -> SSEReply:
    return stream(
        created(),
        *reasoning_events(0, ["Thinking about it.", "Checked twice."], encrypted="gAAAA-secret-1", item_id="rs_1"),
        *reasoning_events(1, [], encrypted="gAAAA-secret-2", item_id="rs_2"),
        *_reasoned_call(),
        completed(30, 40),
    )


def _reasoned_call() -> list[dict[str, Any]]:
    return [
        call_added(2, "call_r", "echo"),
        call_delta(2, '{"text": "x"}'),
        call_done(2, "call_r", "echo", '{"text": "x"}'),
    ]


async def test_reasoning_summaries_stream_as_thinking_and_the_encrypted_reasoning_goes_back(
    fake: ResponsesFake,
) -> None:
    m = model(fake, "gpt-5-mini")
    fake.push(_reasoning_answer())
    events = await events_of(m, req(user("think"), tools=[ECHO_SPEC], reasoning="high"))
    assert [e.type for e in events][:7] == [
        "start",
        "thinking_start",
        "thinking_delta",
        "thinking_delta",
        "thinking_end",
        "thinking_start",  # the second item, with no summary: its own block, for its signature
        "thinking_end",
    ]
    msg = finished(events).message
    first, second, call = msg.content
    assert isinstance(first, ThinkingContent) and isinstance(second, ThinkingContent)
    assert first.thinking == "Thinking about it.\n\nChecked twice." and second.thinking == ""
    assert isinstance(call, ToolCall) and call.id == "call_r"
    body = fake.last
    assert body["store"] is False and body["include"] == ["reasoning.encrypted_content"]
    assert body["reasoning"] == {"summary": "auto", "effort": "high"}
    assert "temperature" not in body

    # the message as a store keeps it, then the next turn: both reasoning items go back first
    stored = message_from_json(message_to_json(msg))
    result = ToolResultMessage(tool_call_id="call_r", tool_name="echo", content=[TextContent(text="echo: x")])
    fake.push(text_reply("done"))
    finished(await events_of(m, req(user("think"), stored, result, tools=[ECHO_SPEC])))
    sent = fake.last["input"]
    assert sent[1] == {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "Thinking about it.\n\nChecked twice."}],
        "encrypted_content": "gAAAA-secret-1",
    }
    assert sent[2] == {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "gAAAA-secret-2"}
    assert sent[3]["type"] == "function_call" and sent[4]["type"] == "function_call_output"


async def test_reasoning_goes_back_only_to_the_model_that_wrote_it(fake: ResponsesFake) -> None:
    fake.push(_reasoning_answer())
    msg = finished(await events_of(model(fake, "gpt-5-mini"), req(user("think"), tools=[ECHO_SPEC]))).message
    result = ToolResultMessage(tool_call_id="call_r", tool_name="echo", content=[TextContent(text="echo: x")])
    params = model(fake, "gpt-5").build_params(req(user("think"), msg, result, tools=[ECHO_SPEC]))
    assert [i.get("type", i.get("role")) for i in params["input"]] == [
        "user",
        "function_call",
        "function_call_output",
    ]
    assert params["reasoning"] == {"summary": "auto"}  # no level asked: the model's own effort
    off = OpenAIResponsesModel("gpt-5", api_key="k", base_url=fake.base_url, reasoning_summary=None)
    unsummarised = off.build_params(req(user("hi")))
    assert "reasoning" not in unsummarised and unsummarised["include"] == ["reasoning.encrypted_content"]


def test_a_reasoning_summary_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="reasoning_summary must be one of auto, concise, detailed"):
        OpenAIResponsesModel("gpt-5", api_key="k", reasoning_summary="verbose")


def test_a_corrupted_signature_is_left_out_rather_than_failing_the_call() -> None:
    m = OpenAIResponsesModel("gpt-5", api_key="k", base_url="http://127.0.0.1:9/v1")
    turn = AssistantMessage(
        content=[ThinkingContent(thinking="t", signature="not json"), TextContent(text="hi")],
        provider="openai-responses",
        model="gpt-5",
    )
    assert [i["type"] for i in m.build_params(req(user("a"), turn))["input"][1:]] == ["message"]


# ------------------------------------------------------------------ failures


async def test_a_rate_limit_is_retried_after_retry_after(fake: ResponsesFake) -> None:
    fake.push(error(429, "Rate limit reached", type="requests", code="rate_limit_exceeded", retry_after="0.05"))
    fake.push(text_reply("finally"))
    events = [e async for e in Agent(model=model(fake), retry=FAST).stream("hi")]
    retries = [e for e in events if isinstance(e, ModelRetry)]
    assert len(retries) == 1 and retries[0].delay == pytest.approx(0.05)
    assert events[-1].type == "agent_end" and events[-1].stop_reason == "stop"
    assert len(fake.requests) == 2


async def test_a_context_overflow_400_is_overflow(fake: ResponsesFake) -> None:
    fake.push(
        error(
            400,
            "Your input exceeds the context window of this model. Please adjust your input and try again.",
            code="context_length_exceeded",
        )
    )
    err = failure(await events_of(model(fake), req(user("big"))))
    assert (err.kind, err.status, err.retryable) == ("overflow", 400, False)


async def test_other_http_errors_keep_their_kinds(fake: ResponsesFake) -> None:
    fake.push(error(400, "Invalid value for 'tools'"), error(401, "Incorrect API key provided", code="invalid_api_key"))
    assert failure(await events_of(model(fake), req(user("x")))).kind == "bad_request"
    assert failure(await events_of(model(fake), req(user("x")))).kind == "auth"


@pytest.mark.parametrize(
    ("event", "kind"),
    [
        (failed("rate_limit_exceeded", "Slow down"), "rate_limit"),
        (failed("server_error", "Something broke"), "server"),
        (failed("invalid_prompt", "Invalid prompt"), "bad_request"),
        ({"type": "error", "code": "context_length_exceeded", "message": "too long"}, "overflow"),
        ({"type": "error", "code": None, "message": "An error occurred while processing"}, "server"),
        ({"type": "error", "code": "429", "message": "Too many requests"}, "rate_limit"),  # a status for a code
        ({"type": "error", "code": "insufficient_quota", "message": "No credit left"}, "auth"),  # waiting won't help
    ],
)
async def test_a_failed_response_or_an_error_event_is_a_provider_error(
    fake: ResponsesFake, event: dict[str, Any], kind: str
) -> None:
    fake.push(stream(created(), *message_events("par"), event))
    err = failure(await events_of(model(fake), req(user("x"))))
    assert err.kind == kind and err.message.text == "par"
    assert str(event.get("message") or event["response"]["error"]["message"]) in (err.message.error_message or "")


async def test_garbage_in_the_stream_is_a_clear_error_not_a_traceback(fake: ResponsesFake) -> None:
    fake.push(stream(created(), "{this is not json", completed()))
    err = failure(await events_of(model(fake), req(user("hi"))))
    assert err.kind == "invalid_response" and not err.retryable
    assert "this is not json" in (err.message.error_message or "")


async def test_a_stream_that_ends_before_the_response_does_is_a_connection_error(fake: ResponsesFake) -> None:
    fake.push(stream(created(), *message_events("partial")))
    err = failure(await events_of(model(fake), req(user("hi"))))
    assert err.kind == "connection" and err.retryable and err.message.text == "partial"
    fake.push(stream(created(), *message_events("Hello there, cut", pieces=3), completed(), cut_after=5))
    err = failure(await events_of(model(fake), req(user("hi"))))  # created, added, part, two deltas: cut
    assert err.kind == "connection" and err.message.text == "Hello there,"  # (16 characters in 3 pieces of 6)
    assert "the stream broke" in (err.message.error_message or "")


# ------------------------------------------------------------------ hooks, registry, end to end


async def test_the_provider_request_hook_sees_the_responses_payload(fake: ResponsesFake) -> None:
    fake.push(text_reply("fine"))
    seen: list[ProviderRequest] = []
    hooks = Hooks()

    @hooks.before_provider_request
    def shape(request: ProviderRequest) -> dict[str, Any]:
        seen.append(request)
        return {**request.payload, "metadata": {"run": "r-1"}}

    result = await Agent(model=model(fake), hooks=hooks, system_prompt="Be brief.").run("hi")
    assert result.text == "fine"
    (request,) = seen
    assert (request.provider, request.model, request.api) == ("openai-responses", "gpt-4o-mini", "openai-responses")
    assert request.payload["input"] == [{"role": "user", "content": "hi"}] and "metadata" not in request.payload
    assert fake.last["metadata"] == {"run": "r-1"} and fake.last["instructions"] == "Be brief."


async def test_the_model_string_selects_the_adapter_end_to_end(
    fake: ResponsesFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    m = resolve_model("openai-responses:gpt-4o-mini")
    assert isinstance(m, OpenAIResponsesModel) and m.name == "openai-responses:gpt-4o-mini"
    assert m.info.context_window == 128_000 and m.info.vision  # OpenAI's facts for the model
    assert provider_status("openai-responses") == (True, "OPENAI_BASE_URL is set")
    fake.push(tool_reply("echo", '{"text": "ping"}'), text_reply("The tool said: echo: ping"))
    result = await Agent(model="openai-responses:gpt-4o-mini", tools=[echo]).run("echo ping")
    assert (result.stop_reason, result.text) == ("stop", "The tool said: echo: ping")
    assert [i.get("type") for i in fake.requests[1]["input"][1:]] == ["function_call", "function_call_output"]


@pytest.mark.parametrize("stop", ["length", "aborted"])
def test_a_turn_cut_after_its_reasoning_sends_no_lone_reasoning_item(stop: str) -> None:
    """The API refuses a reasoning item with no output item after it (and would refuse every
    later call of the conversation): a turn cut right after its reasoning sends none."""
    model = OpenAIResponsesModel("gpt-5", api_key="k")
    signature = json.dumps({"id": "rs_1", "encrypted_content": "gAAAA"})
    cut = AssistantMessage(
        content=[ThinkingContent(thinking="thinking...", signature=signature)],
        provider=model.info.provider,
        model=model.info.id,
        stop_reason=stop,  # type: ignore[arg-type]
    )
    request = ModelRequest("sys", [user("hi"), cut, user("go on")])
    items = model.build_params(request)["input"]
    assert [item.get("type", item.get("role")) for item in items] == ["user", "user"]
