"""The Gemini adapter against a local server that speaks ``streamGenerateContent?alt=sse``."""

from __future__ import annotations

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
)
from agentloop.models.base import ModelRequest, ToolSpec
from agentloop.models.gemini import SKIP_SIGNATURE, GeminiModel
from agentloop.models.overflow import is_context_overflow
from agentloop.models.registry import resolve_model
from agentloop.models.retry import RetryPolicy
from tests.fakes.gemini_server import (
    MODEL,
    GeminiFake,
    call,
    chunk,
    error,
    error_body,
    stream,
    text,
    text_reply,
    thought,
    tool_reply,
    usage,
)
from tests.fakes.http_server import JSONReply, SSEReply

FAST = RetryPolicy(base_delay=0.01, max_delay=1.0)
KEY = "AIza-test-secret-key"
ECHO_PARAMS = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
ECHO_SPEC = ToolSpec(name="echo", description="Echo text.", parameters=ECHO_PARAMS)


@pytest.fixture(scope="module")
def server() -> Iterator[GeminiFake]:
    with GeminiFake() as fake:
        yield fake


@pytest.fixture
def fake(server: GeminiFake) -> Iterator[GeminiFake]:
    server.reset()
    yield server
    server.reset()


def model(fake: GeminiFake, model_id: str = MODEL, **kw: Any) -> GeminiModel:
    return GeminiModel(model_id, base_url=fake.base_url, api_key=KEY, **kw)


async def events_of(m: GeminiModel, request: ModelRequest) -> list[StreamEvent]:
    return [e async for e in m.stream(request)]


def req(*messages: Any, tools: list[ToolSpec] | None = None, system: str = "") -> ModelRequest:
    return ModelRequest(system_prompt=system, messages=list(messages), tools=tools or [])


def finished(events: list[StreamEvent]) -> StreamDone:
    last = events[-1]
    assert isinstance(last, StreamDone), last
    return last


def failed(events: list[StreamEvent]) -> StreamError:
    last = events[-1]
    assert isinstance(last, StreamError), last
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


async def test_text_streaming_events_usage_cost_and_wire(fake: GeminiFake) -> None:
    fake.push(text_reply("Hello there, world", pieces=3, prompt=1000, output=200, cached=600, thoughts=50))
    events = await events_of(model(fake), req(user("hi"), system="Be brief."))
    assert [e.type for e in events] == ["start", "text_start", *["text_delta"] * 3, "text_end", "done"]
    msg = finished(events).message
    assert (msg.text, msg.stop_reason, msg.provider, msg.model) == ("Hello there, world", "stop", "gemini", MODEL)
    u = msg.usage
    # the cached part is reported apart from the prompt; thinking tokens are billed as output
    assert (u.input, u.output, u.cache_read, u.cache_write, u.total_tokens) == (400, 250, 600, 0, 1250)
    # gemini-2.5-flash: $0.30 in, $2.50 out, $0.03 cache read per million
    assert u.cost.total == pytest.approx((400 * 0.3 + 250 * 2.5 + 600 * 0.03) / 1e6)
    assert fake.last == {
        "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
        "systemInstruction": {"parts": [{"text": "Be brief."}]},
        "generationConfig": {"thinkingConfig": {"includeThoughts": True}},  # 2.5 flash is a reasoning model
    }
    assert fake.paths[-1] == f"/v1beta/models/{MODEL}:streamGenerateContent"
    assert fake.queries[-1] == "alt=sse"  # the key is never in the URL
    assert fake.headers[-1]["x-goog-api-key"] == KEY


async def test_max_tokens_is_length_and_generation_config(fake: GeminiFake) -> None:
    fake.push(stream(chunk(text("cut"), finish="MAX_TOKENS", usage_=usage(5, 9))))
    request = ModelRequest(system_prompt="", messages=[user("hi")], max_tokens=9, temperature=0.2)
    m = model(fake, "gemini-2.0-flash", topK=3, thinking_budget=0)
    done = finished(await events_of(m, request))
    assert done.message.stop_reason == "length" and done.message.text == "cut"
    assert fake.last["generationConfig"] == {
        "maxOutputTokens": 9,
        "temperature": 0.2,
        "thinkingConfig": {"thinkingBudget": 0},
        "topK": 3,
    }
    assert "systemInstruction" not in fake.last and "tools" not in fake.last


async def test_tool_call_comes_whole_with_text_before(fake: GeminiFake) -> None:
    fake.push(tool_reply(call("echo", {"text": "hello world"}), lead="Let me echo."))
    events = await events_of(model(fake), req(user("echo it"), tools=[ECHO_SPEC]))
    types = [e.type for e in events]
    assert types == [
        "start", "text_start", "text_delta", "text_end",
        "toolcall_start", "toolcall_delta", "toolcall_end", "done",
    ]  # fmt: skip
    msg = finished(events).message
    assert msg.stop_reason == "toolUse" and msg.text == "Let me echo."
    (c,) = msg.tool_calls
    assert (c.name, c.arguments) == ("echo", {"text": "hello world"})
    assert c.id.startswith("gemini_call_")  # no id from the API: a generated one
    assert fake.last["tools"] == [
        {"functionDeclarations": [{"name": "echo", "description": "Echo text.", "parametersJsonSchema": ECHO_PARAMS}]}
    ]
    assert fake.last["toolConfig"] == {"functionCallingConfig": {"mode": "AUTO"}}


async def test_tool_without_parameters_and_sanitised_openapi_schema(fake: GeminiFake) -> None:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Args",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "path": {"type": "string", "title": "Path"},
            "mode": {"type": ["string", "null"], "enum": ["r", "w"]},
            "kind": {"const": "file"},
            "opts": {"$ref": "#/$defs/Opts"},
        },
        "required": ["path"],
        "$defs": {"Opts": {"type": "object", "additionalProperties": {"type": "string"}, "properties": {}}},
    }
    tools = [ToolSpec("read", "Read a file.", schema), ToolSpec("now", "The time.", {"type": "object"})]
    fake.push(text_reply("ok"))
    await events_of(model(fake, json_schema=False), req(user("x"), tools=tools))
    read, now = fake.last["tools"][0]["functionDeclarations"]
    assert now == {"name": "now", "description": "The time."}
    assert read["parameters"] == {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "mode": {"type": "string", "nullable": True, "enum": ["r", "w"]},
            "kind": {"enum": ["file"]},
            "opts": {"type": "object", "properties": {}},
        },
        "required": ["path"],
    }


async def test_parallel_calls_end_to_end_results_in_call_order(fake: GeminiFake) -> None:
    fake.push(
        tool_reply(call("echo", {"text": "one"}, id="fc-1"), call("echo", {"text": "two"}, id="fc-2")),
        text_reply("both done"),
    )
    result = await Agent(model=model(fake), tools=[echo], system_prompt="Use tools.").run("two echoes")
    assert result.ok and result.text == "both done"
    second = fake.requests[1]
    assert second["systemInstruction"] == {"parts": [{"text": "Use tools."}]}
    assert second["contents"] == [
        {"role": "user", "parts": [{"text": "two echoes"}]},
        {
            "role": "model",
            "parts": [
                {"functionCall": {"name": "echo", "args": {"text": "one"}, "id": "fc-1"}},
                {"functionCall": {"name": "echo", "args": {"text": "two"}, "id": "fc-2"}},
            ],
        },
        {
            "role": "user",
            "parts": [
                {"functionResponse": {"name": "echo", "response": {"output": "echo: one"}, "id": "fc-1"}},
                {"functionResponse": {"name": "echo", "response": {"output": "echo: two"}, "id": "fc-2"}},
            ],
        },
    ]
    assert result.usage.cost.total > 0


async def test_thinking_and_signatures_round_trip(fake: GeminiFake) -> None:
    fake.push(
        stream(
            chunk(thought("Let me think ")),
            chunk(thought("about it.", signature="sig-thought")),
            chunk(text("Checking.")),
            chunk(
                call("echo", {"text": "a"}, signature="sig-call"),
                call("echo", {"text": "b"}),
                finish="STOP",
                usage_=usage(10, 5, thoughts=40),
            ),
        )
    )
    m = model(fake, "gemini-2.5-pro", thinking_budget=1024)
    events = await events_of(m, req(user("?"), tools=[ECHO_SPEC]))
    types = [e.type for e in events]
    assert types[:5] == ["start", "thinking_start", "thinking_delta", "thinking_delta", "thinking_end"]
    msg = finished(events).message
    assert msg.stop_reason == "toolUse" and msg.usage.output == 45
    thinking, said, carrier, a, b = msg.content
    assert thinking == ThinkingContent(thinking="Let me think about it.", signature="sig-thought")
    assert said == TextContent(text="Checking.")
    assert carrier == ThinkingContent(thinking="", signature="sig-call")  # the first call's signature
    assert isinstance(a, ToolCall) and isinstance(b, ToolCall)
    assert fake.last["generationConfig"]["thinkingConfig"] == {"thinkingBudget": 1024, "includeThoughts": True}

    history = [
        user("?"),
        msg,
        ToolResultMessage(tool_call_id=a.id, tool_name="echo", content=[TextContent(text="echo: a")]),
        ToolResultMessage(tool_call_id=b.id, tool_name="echo", content=[TextContent(text="bad")], is_error=True),
    ]
    fake.push(text_reply("ok"))
    await events_of(m, req(*history, tools=[ECHO_SPEC]))
    model_turn, responses = fake.last["contents"][1:]
    assert model_turn == {
        "role": "model",
        "parts": [
            {"text": "Let me think about it.", "thought": True, "thoughtSignature": "sig-thought"},
            {"text": "Checking."},
            {"functionCall": {"name": "echo", "args": {"text": "a"}}, "thoughtSignature": "sig-call"},
            {"functionCall": {"name": "echo", "args": {"text": "b"}}},  # generated ids are not sent
        ],
    }
    assert responses["parts"] == [
        {"functionResponse": {"name": "echo", "response": {"output": "echo: a"}}},
        {"functionResponse": {"name": "echo", "response": {"error": "bad"}}},
    ]

    # another model gets the thinking as text and no signatures; Gemini 3 gets the skip value
    fake.push(text_reply("ok"))
    await events_of(model(fake, "gemini-3-pro-preview"), req(*history, tools=[ECHO_SPEC]))
    assert fake.last["contents"][1]["parts"] == [
        {"text": "Let me think about it."},
        {"text": "Checking."},
        {"functionCall": {"name": "echo", "args": {"text": "a"}}, "thoughtSignature": SKIP_SIGNATURE},
        {"functionCall": {"name": "echo", "args": {"text": "b"}}},
    ]


async def test_text_signature_on_the_last_chunk_goes_back_on_the_text(fake: GeminiFake) -> None:
    fake.push(stream(chunk(text("The answer")), chunk(text(" is 42.", thoughtSignature="sig-text"), finish="STOP")))
    m = model(fake)
    msg = finished(await events_of(m, req(user("?")))).message
    assert msg.text == "The answer is 42."
    fake.push(text_reply("ok"))
    await events_of(m, req(user("?"), msg, user("and?")))
    assert fake.last["contents"][1] == {
        "role": "model",
        "parts": [{"text": "The answer is 42.", "thoughtSignature": "sig-text"}],
    }


async def test_results_reordered_to_call_order_and_results_images(fake: GeminiFake) -> None:
    calls = AssistantMessage(
        content=[ToolCall(id="call_x", name="look", arguments={}), ToolCall(id="call_y", name="echo", arguments={})],
        provider="openai",
        model="gpt-4o",
        stop_reason="toolUse",
    )
    history = [
        user("go"),
        calls,
        ToolResultMessage(tool_call_id="call_y", tool_name="echo", content=[TextContent(text="second")]),
        ToolResultMessage(
            tool_call_id="call_x",
            tool_name="look",
            content=[TextContent(text="a picture"), ImageContent(data="iVBO", mime_type="image/png")],
        ),
        SystemMessage(content=[TextContent(text="3 rounds left")]),
        AssistantMessage(content=[], stop_reason="error", error_message="overloaded"),
        user("what is it?", ImageContent(data="/9j/", mime_type="image/jpeg")),
    ]
    fake.push(text_reply("a cat"))
    await events_of(model(fake), req(*history))
    contents = fake.last["contents"]
    assert [c["role"] for c in contents] == ["user", "model", "user"]
    assert contents[1]["parts"] == [  # another provider's ids are not sent
        {"functionCall": {"name": "look", "args": {}}},
        {"functionCall": {"name": "echo", "args": {}}},
    ]
    assert contents[2]["parts"] == [
        {"functionResponse": {"name": "look", "response": {"output": "a picture"}}},
        {"functionResponse": {"name": "echo", "response": {"output": "second"}}},
        {"inlineData": {"mimeType": "image/png", "data": "iVBO"}},
        {"text": "[system notice] 3 rounds left"},
        {"text": "what is it?"},
        {"inlineData": {"mimeType": "image/jpeg", "data": "/9j/"}},
    ]


async def test_documents_as_inline_data_or_text(fake: GeminiFake) -> None:
    fake.push(text_reply("read"))
    pdf = FileContent(data="JVBERi0xLjQK", mime_type="application/pdf", name="report.pdf")
    notes = FileContent(data="aGVsbG8gd29ybGQ=", mime_type="text/csv", name="t.csv")
    await events_of(model(fake), req(user("summarise", pdf, notes)))
    assert fake.last["contents"][0]["parts"] == [
        {"text": "summarise"},
        {"inlineData": {"mimeType": "application/pdf", "data": "JVBERi0xLjQK"}},
        {"text": '<file name="t.csv" type="text/csv">\nhello world\n</file>'},
    ]


# ------------------------------------------------------------------ failures


async def test_bad_key_forbidden_and_unauthenticated_are_auth_errors_without_retry(fake: GeminiFake) -> None:
    details = [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID"}]
    fake.push(error(400, "INVALID_ARGUMENT", "API key not valid. Please pass a valid API key.", details))
    err = failed(await events_of(model(fake), req(user("x"))))
    assert (err.kind, err.status, err.retryable) == ("auth", 400, False)  # Google answers a bad key with 400
    assert "check GEMINI_API_KEY" in (err.message.error_message or "")

    fake.reset()
    fake.push(error(403, "PERMISSION_DENIED", "Method doesn't allow unregistered callers."), text_reply("never"))
    events = [e async for e in Agent(model=model(fake), retry=FAST).stream("hi")]
    assert not [e for e in events if isinstance(e, ModelRetry)]
    assert run_end(events).stop_reason == "error" and len(fake.requests) == 1

    fake.reset()
    fake.push(error(401, "UNAUTHENTICATED", "Request had invalid authentication credentials."))
    err = failed(await events_of(model(fake), req(user("x"))))
    assert (err.kind, err.status, err.retryable) == ("auth", 401, False)
    assert KEY not in (err.message.error_message or "")


async def test_overflow_400_is_overflow(fake: GeminiFake) -> None:
    text_ = "The input token count (3475108) exceeds the maximum number of tokens allowed (1048576)."
    fake.push(error(400, "INVALID_ARGUMENT", text_))
    err = failed(await events_of(model(fake), req(user("big"))))
    assert (err.kind, err.status, err.retryable) == ("overflow", 400, False)
    assert is_context_overflow(err.message)
    fake.push(error(400, "INVALID_ARGUMENT", "* GenerateContentRequest.contents: contents is not specified"))
    err = failed(await events_of(model(fake), req(user("x"))))
    assert err.kind == "bad_request" and not is_context_overflow(err.message)


async def test_rate_limit_honours_retry_after_then_succeeds(fake: GeminiFake) -> None:
    fake.push(error(429, "RESOURCE_EXHAUSTED", "Resource has been exhausted (e.g. check quota).", retry_after="0.2"))
    fake.push(text_reply("finally"))
    started = time.monotonic()
    events = [e async for e in Agent(model=model(fake), retry=FAST).stream("hi")]
    retries = [e for e in events if isinstance(e, ModelRetry)]
    assert len(retries) == 1 and retries[0].delay == pytest.approx(0.2)
    assert time.monotonic() - started >= 0.2
    assert run_end(events).stop_reason == "stop" and len(fake.requests) == 2


async def test_rate_limit_retry_delay_from_error_details(fake: GeminiFake) -> None:
    details = [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "37s"}]
    fake.push(error(429, "RESOURCE_EXHAUSTED", "You exceeded your current quota.", details))
    err = failed(await events_of(model(fake), req(user("x"))))
    assert (err.kind, err.status, err.retry_after, err.retryable) == ("rate_limit", 429, 37.0, True)


@pytest.mark.parametrize("status", [500, 503])
async def test_server_errors_are_retried(fake: GeminiFake, status: int) -> None:
    fake.push(error(status, "UNAVAILABLE", "The model is overloaded. Please try again later."), text_reply("recovered"))
    result = await Agent(model=model(fake), retry=FAST).run("hi")
    assert result.stop_reason == "stop" and result.text == "recovered"
    assert len(fake.requests) == 2


async def test_error_inside_the_stream(fake: GeminiFake) -> None:
    fake.push(stream(chunk(text("so far")), error_body(503, "UNAVAILABLE", "The model is overloaded.")))
    err = failed(await events_of(model(fake), req(user("x"))))
    assert err.kind == "server" and err.retryable and err.message.text == "so far"


async def test_an_error_string_inside_the_stream_is_the_error(fake: GeminiFake) -> None:
    """A proxy's ``{"error": "..."}`` was skipped as a chunk without candidates: the stream then
    read as cut (a retried connection error) and what it said was lost."""
    fake.push(stream(chunk(text("so far")), {"error": "upstream request timeout"}))
    err = failed(await events_of(model(fake), req(user("x"))))
    assert (err.kind, err.message.error_message) == ("server", "stream error: upstream request timeout")
    assert err.message.text == "so far"


async def test_safety_finish_is_an_error_with_the_reason(fake: GeminiFake) -> None:
    ratings = [
        {"category": "HARM_CATEGORY_DANGEROUS_CONTENT", "probability": "HIGH"},
        {"category": "HARM_CATEGORY_HARASSMENT", "probability": "NEGLIGIBLE"},
    ]
    final = chunk(finish="SAFETY", usage_=usage(5, 2))
    final["candidates"][0]["safetyRatings"] = ratings
    fake.push(stream(chunk(text("Here is how")), final))
    err = failed(await events_of(model(fake), req(user("x"))))
    assert err.kind == "bad_request" and not err.retryable
    assert err.message.stop_reason == "error" and err.message.text == "Here is how"
    assert err.message.error_message == (
        "the answer was stopped by the safety filter (finishReason SAFETY; flagged: DANGEROUS_CONTENT)"
    )


async def test_blocked_prompt_is_an_error(fake: GeminiFake) -> None:
    fake.push(stream({"promptFeedback": {"blockReason": "PROHIBITED_CONTENT"}, "usageMetadata": usage(5, 0)}))
    err = failed(await events_of(model(fake), req(user("x"))))
    assert err.kind == "bad_request"
    assert "prompt was blocked (blockReason PROHIBITED_CONTENT)" in (err.message.error_message or "")


async def test_malformed_function_call_is_invalid_response(fake: GeminiFake) -> None:
    fake.push(stream(chunk(finish="MALFORMED_FUNCTION_CALL")))
    err = failed(await events_of(model(fake), req(user("x"), tools=[ECHO_SPEC])))
    assert err.kind == "invalid_response" and "MALFORMED_FUNCTION_CALL" in (err.message.error_message or "")


async def test_garbage_in_stream_is_an_error_event(fake: GeminiFake) -> None:
    fake.push(SSEReply(frames=[*stream(chunk(text("ok"))).frames, "data: {nope\n\n"]))
    err = failed(await events_of(model(fake), req(user("hi"))))
    assert err.kind == "invalid_response" and err.message.text == "ok"


async def test_non_json_error_body(fake: GeminiFake) -> None:
    fake.push(JSONReply(status=502, body="<html>Bad Gateway</html>"))  # a proxy's page, not Google's JSON
    err = failed(await events_of(model(fake), req(user("hi"))))
    assert err.kind == "server" and err.retryable and "Bad Gateway" in (err.message.error_message or "")


async def test_stream_cut_midway_keeps_partial_text(fake: GeminiFake) -> None:
    reply = text_reply("Hello there, this answer gets cut", pieces=6)
    fake.push(SSEReply(frames=reply.frames, cut_after=2))
    err = failed(await events_of(model(fake), req(user("hi"))))
    assert err.kind == "connection" and err.retryable
    assert err.message.text == "Hello there,"
    assert "12 characters" in (err.message.error_message or "")


async def test_stream_ending_without_finish_reason_is_connection_error(fake: GeminiFake) -> None:
    fake.push(stream(chunk(text("partial"))))
    err = failed(await events_of(model(fake), req(user("hi"))))
    assert err.kind == "connection" and err.message.text == "partial"
    assert "ended before the answer was finished" in (err.message.error_message or "")


async def test_connection_refused_is_connection_error() -> None:
    err = failed(await events_of(GeminiModel(MODEL, base_url="http://127.0.0.1:9", api_key=KEY), req(user("hi"))))
    assert err.kind == "connection" and KEY not in (err.message.error_message or "")


async def test_missing_key_is_auth_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GEMINI_API_KEY", "GOOGLE_API_KEY", "GEMINI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    err = failed(await events_of(GeminiModel(MODEL), req(user("hi"))))
    assert err.kind == "auth" and "GEMINI_API_KEY" in (err.message.error_message or "")


# ------------------------------------------------------------------ end to end


async def test_registry_string_env_key_and_base_url(fake: GeminiFake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMINI_BASE_URL", fake.base_url)
    monkeypatch.delenv("GEMINI_API_KEY", raising=False)
    monkeypatch.setenv("GOOGLE_API_KEY", "from-google-env")
    m = resolve_model(f"gemini:{MODEL}")
    assert isinstance(m, GeminiModel) and "from-google-env" not in repr(m)
    fake.push(tool_reply(call("echo", {"text": "ping"})), text_reply("The tool said: echo: ping"))
    result = await Agent(model=f"gemini:{MODEL}", tools=[echo]).run("echo ping")
    assert result.stop_reason == "stop" and result.text == "The tool said: echo: ping"
    assert [h["x-goog-api-key"] for h in fake.headers] == ["from-google-env"] * 2
    first_call = fake.requests[1]["contents"][1]["parts"][0]["functionCall"]
    assert first_call == {"name": "echo", "args": {"text": "ping"}}
    assert fake.requests[1]["contents"][2]["parts"] == [
        {"functionResponse": {"name": "echo", "response": {"output": "echo: ping"}}}
    ]


async def test_proxy_base_url_without_key_sends_no_key(fake: GeminiFake, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GEMINI_API_KEY", "GOOGLE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    fake.push(text_reply("hi"))
    done = finished(await events_of(GeminiModel(MODEL, base_url=fake.base_url + "/v1beta"), req(user("hi"))))
    assert done.message.text == "hi"
    assert "x-goog-api-key" not in fake.headers[-1]
    assert fake.paths[-1] == f"/v1beta/models/{MODEL}:streamGenerateContent"


async def test_fallback_after_primary_keeps_failing(fake: GeminiFake) -> None:
    fake.forever = error(500, "INTERNAL", "down")
    with GeminiFake() as good:
        good.push(text_reply("from the fallback"))
        agent = Agent(
            model=model(fake),
            fallbacks=[GeminiModel("gemini-2.0-flash", base_url=good.base_url, api_key=KEY)],
            retry=RetryPolicy(max_retries=2, base_delay=0.01),
        )
        result = await agent.run("hi")
    assert result.stop_reason == "stop" and result.text == "from the fallback"
    assert len(fake.requests) == 3


async def test_abort_closes_the_stream(fake: GeminiFake) -> None:
    reply = text_reply("slow answer " * 20, pieces=40)
    fake.push(SSEReply(frames=reply.frames, delay=0.05))
    seen: list[str] = []
    gen: AsyncIterator[StreamEvent] = model(fake).stream(req(user("hi")))
    async for event in gen:
        seen.append(event.type)
        if event.type == "text_delta":
            break
    await gen.aclose()  # type: ignore[attr-defined]
    assert seen[-1] == "text_delta"


async def test_function_call_arguments_that_are_not_an_object_stay_with_the_call(fake: GeminiFake) -> None:
    """The reply is kept: the call carries what the model sent, the loop answers it with an error
    the model can correct, and the call goes back to Gemini with an empty object (its API takes
    nothing else)."""
    fake.push(stream(chunk({"functionCall": {"name": "echo", "args": ["a"]}}, finish="STOP")))
    fake.push(stream(chunk({"text": "sorry"}, finish="STOP")))
    agent = Agent(model=model(fake), tools=[echo])
    result = await agent.run("x")
    assert result.text == "sorry"
    [answer] = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert answer.is_error and '["a"]' in answer.text
    [call] = next(m for m in result.messages if isinstance(m, AssistantMessage)).tool_calls
    assert call.arguments == {} and call.invalid_arguments == '["a"]'
    sent = fake.requests[-1]["contents"][1]["parts"][0]["functionCall"]
    assert sent["name"] == "echo" and sent["args"] == {}
