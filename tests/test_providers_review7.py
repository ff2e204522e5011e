"""Review of the provider adapters against hostile answers: each test names a response a server
sent (a call without an id, arguments for a block that never started, a stream cut inside an
event, negative usage ...) and what it did to a user (a conversation that failed on every later
call, a tool run with no arguments, an answer thrown away or a wrong bill)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentloop import Agent, tool, user
from agentloop.events import StreamDone, StreamError
from agentloop.messages import AssistantMessage, ToolCall, ToolResultMessage
from agentloop.models.base import Model, ModelRequest, make_usage
from agentloop.models.catalog import model_info
from agentloop.models.gemini import GeminiModel
from agentloop.models.transcribe import OpenAITranscriber, TranscriptionError
from agentloop.models.unusable import NAMELESS_CALL, unusable
from agentloop.process import signals as sig
from tests.fakes import anthropic_server as ant
from tests.fakes import gemini_server as gem
from tests.fakes import openai_server as oai
from tests.fakes.anthropic_server import AnthropicFake, ev
from tests.fakes.gemini_server import GeminiFake
from tests.fakes.http_server import ServerThread, SSEReply, sse_frame
from tests.fakes.openai_server import OpenAIFake
from tests.process_support import assert_valid, kernel, ran
from tests.test_providers_review import FAST, SPEC, anthropic_model, openai_model


@tool
def echo_tool(text: str = "") -> str:
    """Echo."""
    return text


@pytest.fixture(scope="module")
def openai_server() -> Iterator[OpenAIFake]:
    with OpenAIFake() as fake:
        yield fake


@pytest.fixture
def ofake(openai_server: OpenAIFake) -> Iterator[OpenAIFake]:
    openai_server.reset()
    yield openai_server
    openai_server.reset()


@pytest.fixture(scope="module")
def anthropic_server() -> Iterator[AnthropicFake]:
    with AnthropicFake() as fake:
        yield fake


@pytest.fixture
def afake(anthropic_server: AnthropicFake) -> Iterator[AnthropicFake]:
    anthropic_server.reset()
    yield anthropic_server
    anthropic_server.reset()


@pytest.fixture(scope="module")
def gemini_server() -> Iterator[GeminiFake]:
    with GeminiFake() as fake:
        yield fake


@pytest.fixture
def gfake(gemini_server: GeminiFake) -> Iterator[GeminiFake]:
    gemini_server.reset()
    yield gemini_server
    gemini_server.reset()


def gemini_model(fake: GeminiFake) -> GeminiModel:
    return GeminiModel("gemini-2.5-flash", base_url=fake.base_url, api_key="gem-test")


async def last_event(model: Model) -> StreamDone | StreamError:
    request = ModelRequest(system_prompt="", messages=[user("hi")], tools=[SPEC])
    events = [e async for e in model.stream(request)]
    assert isinstance(events[-1], StreamDone | StreamError), events[-1]
    return events[-1]


async def failure(model: Model) -> StreamError:
    event = await last_event(model)
    assert isinstance(event, StreamError), event.message
    return event


async def answer(model: Model) -> AssistantMessage:
    event = await last_event(model)
    assert isinstance(event, StreamDone), event.message.error_message
    return event.message


def anthropic_call(block: dict[str, Any], *after: ant.Event, stop: bool = True) -> SSEReply:
    """One ``tool_use`` content block as ``block`` says, ``after`` events, the message's end."""
    start = ev("content_block_start", index=0, content_block=block)
    end = [ev("content_block_stop", index=0)] if stop else []
    return ant.stream(ant.message_start(), start, *after, *end, *ant.message_end("tool_use"))


# ------------------------------------------------------------------ tool calls


async def test_an_anthropic_call_without_an_id_gets_one_and_the_durable_conversation_goes_on(
    afake: AnthropicFake, tmp_path: Path
) -> None:
    """A ``tool_use`` block without an id made a call with a null id. In a durable process the
    step failed on it (a NOT NULL constraint of the pending calls): the run ended "internal error
    in the runtime", the answer and its usage lost, the tool never run. In an ``Agent`` the tool
    ran, then the next call failed ("TypeError: expected string or bytes-like object"), as did
    every later call of the conversation, whose history held it."""
    no_id = {"type": "tool_use", "name": "echo", "input": {}}
    afake.push(anthropic_call(no_id, ant.json_delta(0, '{"text": "x"}')))
    afake.forever = ant.text_reply("done")
    ran.clear()
    async with kernel(tmp_path, anthropic_model(afake), retry=FAST) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("run echo")
        async with asyncio.timeout(5):
            await proc.wait_idle()
        msgs = await proc.messages()
        finished = [r.payload for r in await k.store.events(proc.pid) if r.signal == sig.RUN_FINISHED]
    assert ran == ["x"] and finished[-1]["status"] == "ok"
    assert [m.role for m in msgs] == ["user", "assistant", "toolResult", "assistant"]
    assert msgs[0].text == "run echo" and msgs[-1].text == "done"
    assert_valid(msgs)
    call = msgs[1].tool_calls[0] if isinstance(msgs[1], AssistantMessage) else None
    assert call is not None and isinstance(call.id, str) and call.id
    assert isinstance(msgs[2], ToolResultMessage) and msgs[2].tool_call_id == call.id
    replayed = afake.last["messages"][1]["content"][0]
    assert replayed["type"] == "tool_use" and replayed["id"] == call.id


async def test_a_call_without_a_name_is_asked_again_not_answered_as_an_unknown_tool(ofake: OpenAIFake) -> None:
    """A call whose name never came (``function: null``) was kept with an empty name (Anthropic's
    a null one): answered "Tool  not found" and replayed so, a name the providers refuse."""
    nameless = oai.chunk({"tool_calls": [{"index": 0, "id": "c1", "function": None}]})
    ofake.push(oai.stream(nameless, oai.chunk(finish_reason="tool_calls")))
    ofake.forever = oai.text_reply("done")
    result = await Agent(model=openai_model(ofake), tools=[echo_tool], retry=FAST).run("hi")
    assert result.stop_reason == "stop" and result.text == "done"
    assert len(ofake.requests) == 2
    assert [m["role"] for m in ofake.last["messages"]] == ["user"]  # the nameless call went nowhere
    assert unusable(AssistantMessage(content=[ToolCall(id="c1", name="")]), tools_offered=True) == NAMELESS_CALL


async def test_two_calls_with_one_id_are_told_apart_and_both_results_replayed(afake: AnthropicFake) -> None:
    """Both calls ran, but the history paired only the first result with the id: the second
    result was dropped from every later request, which held two ``tool_use`` blocks of one id
    and one result (a request Anthropic refuses, so the conversation failed from then on)."""
    blocks = [
        *ant.tool_block(0, "t1", "echo_tool", '{"text": "a"}'),
        *ant.tool_block(1, "t1", "echo_tool", '{"text": "b"}'),
    ]
    afake.push(ant.stream(ant.message_start(), *blocks, *ant.message_end("tool_use")))
    afake.forever = ant.text_reply("done")
    result = await Agent(model=anthropic_model(afake), tools=[echo_tool], retry=FAST).run("hi")
    assert result.text == "done"
    calls, results = afake.last["messages"][1]["content"], afake.last["messages"][2]["content"]
    assert calls[0]["id"] == "t1" and calls[1]["id"] not in ("t1", "")
    assert [r["tool_use_id"] for r in results] == [calls[0]["id"], calls[1]["id"]]
    assert [r["content"][0]["text"] for r in results] == ["a", "b"]


async def test_anthropic_arguments_for_a_block_that_never_started_are_an_error(afake: AnthropicFake) -> None:
    """The fragments were dropped and the call ran with no arguments at all (``{}``)."""
    start = ant.tool_start(0, "t1", "echo")
    afake.push(ant.stream(ant.message_start(), start, ant.json_delta(1, '{"text": "x"}'), *ant.message_end("tool_use")))
    err = await failure(anthropic_model(afake))
    assert err.kind == "invalid_response" and not err.message.tool_calls
    assert "arguments for content block 1, which it never started" in (err.message.error_message or "")


async def test_an_anthropic_block_started_twice_is_an_error(afake: AnthropicFake) -> None:
    """The first call lost its key to the second and ran with no arguments."""
    afake.push(
        anthropic_call(
            {"type": "tool_use", "id": "t1", "name": "echo", "input": {}},
            ant.tool_start(0, "t2", "echo"),
            ant.json_delta(0, '{"text": "x"}'),
        )
    )
    err = await failure(anthropic_model(afake))
    assert err.kind == "invalid_response" and "started content block 0 twice" in (err.message.error_message or "")


@pytest.mark.parametrize(
    ("start_input", "arguments", "invalid"),
    [([1, 2], {}, "[1, 2]"), ('{"text": "x"}', {"text": "x"}, None), (7, {}, "7")],
)
async def test_anthropic_start_input_that_is_not_an_object_stays_with_the_call(
    afake: AnthropicFake, start_input: Any, arguments: dict[str, Any], invalid: str | None
) -> None:
    """It was ignored, and the call ran with ``{}`` as if the model had sent nothing."""
    afake.push(anthropic_call({"type": "tool_use", "id": "t1", "name": "echo", "input": start_input}))
    [call] = (await answer(anthropic_model(afake))).tool_calls
    assert (call.arguments, call.invalid_arguments) == (arguments, invalid)


async def test_anthropic_start_input_of_a_block_that_never_stopped_is_kept(afake: AnthropicFake) -> None:
    """The start's input was taken only at the block's stop: without one the call ran with ``{}``."""
    afake.push(anthropic_call({"type": "tool_use", "id": "t1", "name": "echo", "input": {"text": "x"}}, stop=False))
    [call] = (await answer(anthropic_model(afake))).tool_calls
    assert call.arguments == {"text": "x"}


async def test_openai_arguments_sent_as_an_object_are_read(ofake: OpenAIFake) -> None:
    """Some servers send ``arguments`` as the object itself: the whole answer failed with
    "AttributeError: 'dict' object has no attribute 'isascii'". A number is kept as invalid."""
    for arguments in ({"text": "x"}, 5):
        call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "echo", "arguments": arguments}}
        ofake.push(oai.stream(oai.chunk({"tool_calls": [call]}), oai.chunk(finish_reason="tool_calls")))
    first, second = (await answer(openai_model(ofake))).tool_calls[0], (await answer(openai_model(ofake))).tool_calls[0]
    assert (first.arguments, first.invalid_arguments) == ({"text": "x"}, None)
    assert (second.arguments, second.invalid_arguments) == ({}, "5")


# ------------------------------------------------------------------ text and usage of the wrong type


async def test_openai_content_that_is_a_number_is_text_and_other_shapes_say_so(ofake: OpenAIFake) -> None:
    """A number was dropped unseen (the answer then taken for an empty one and asked again)."""
    ofake.push(
        oai.stream(oai.chunk({"content": 42}), oai.chunk(finish_reason="stop")),
        oai.stream(oai.chunk({"content": {"a": 1}}), oai.chunk(finish_reason="stop")),
    )
    assert (await answer(openai_model(ofake))).text == "42"
    err = await failure(openai_model(ofake))
    assert err.kind == "invalid_response"
    assert err.message.error_message == 'unreadable response: the provider sent content that is not text: {"a": 1}'


async def test_anthropic_text_of_the_wrong_type_is_named(afake: AnthropicFake) -> None:
    """The error read "AttributeError: 'int' object has no attribute 'isascii'"."""
    delta = ev("content_block_delta", index=0, delta={"type": "text_delta", "text": 42})
    start = ev("content_block_start", index=0, content_block={"type": "text", "text": ""})
    afake.push(ant.stream(ant.message_start(), start, delta, *ant.message_end()))
    err = await failure(anthropic_model(afake))
    assert err.kind == "invalid_response"
    assert err.message.error_message == "unreadable response: the provider sent text as int, not a string: 42"


def test_negative_usage_counts_as_none() -> None:
    """A negative count made a negative cost, which took back spend from a run's and an
    account's totals: a budget let more through."""
    usage = make_usage(model_info("openai", "gpt-4o-mini"), input=-100, output=-50, cache_read=-5, cache_write=-1)
    assert (usage.input, usage.output, usage.cache_read, usage.cache_write, usage.total_tokens) == (0, 0, 0, 0, 0)
    assert usage.cost.total == 0


async def test_negative_usage_from_a_stream_costs_nothing(ofake: OpenAIFake, gfake: GeminiFake) -> None:
    ofake.push(oai.stream(oai.chunk({"content": "hi"}), oai.chunk(finish_reason="stop"), oai.usage_chunk(10, -50, -5)))
    gfake.push(gem.stream(gem.chunk(gem.text("hi"), finish="STOP", usage_=gem.usage(prompt=-5, output=-9, cached=-2))))
    for model in (openai_model(ofake), gemini_model(gfake)):
        usage = (await answer(model)).usage
        assert min(usage.input, usage.output, usage.cache_read) >= 0 and usage.cost.total >= 0


# ------------------------------------------------------------------ cut streams and errors (Gemini)


async def test_a_gemini_stream_cut_inside_an_event_is_retried(gfake: GeminiFake) -> None:
    """The half event was parsed as a whole one: "unreadable stream chunk", not retried, the
    run ended with an error where OpenAI's and Anthropic's adapters retry a cut stream."""
    cut = SSEReply(frames=[sse_frame(gem.chunk(gem.text("hel"))), 'data: {"candidates": [{"content": {"par'])
    gfake.push(cut)
    gfake.forever = gem.text_reply("hello")
    model = gemini_model(gfake)
    err = await failure(model)
    assert (err.kind, err.retryable) == ("connection", True)
    said = err.message.error_message
    assert said == "the stream ended before the answer was finished (3 characters of text received)"
    result = await Agent(model=model, retry=FAST).run("hi")
    assert result.text == "hello"


async def test_a_gemini_stream_dropped_after_its_finish_keeps_the_answer(gfake: GeminiFake) -> None:
    """The whole answer had come, but was thrown away as a broken stream and asked (and paid)
    for again; the OpenAI and Anthropic adapters keep it."""
    gfake.push(gem.stream(gem.chunk(gem.text("all here"), finish="STOP", usage_=gem.usage()), cut_after=1))
    message = await answer(gemini_model(gfake))
    assert message.text == "all here" and message.stop_reason == "stop" and message.usage.input == 20
    assert len(gfake.requests) == 1


@pytest.mark.parametrize("code", ["UNAVAILABLE", [503], True, 200])
async def test_a_gemini_stream_error_with_an_odd_code_says_its_message(gfake: GeminiFake, code: Any) -> None:
    """A code that is not a number failed as "ValueError: invalid literal for int()" (not
    retried, the error's own words lost); ``true`` became "HTTP 1"."""
    gfake.push(gem.stream({"error": {"code": code, "message": "backend went away", "status": "UNAVAILABLE"}}))
    err = await failure(gemini_model(gfake))
    assert (err.kind, err.status) == ("server", 500)
    assert err.message.error_message == "HTTP 500 UNAVAILABLE: backend went away"


# ------------------------------------------------------------------ transcription


@pytest.fixture(scope="module")
def transcription_server() -> Iterator[tuple[ServerThread, list[bytes]]]:
    """``/v1/audio/transcriptions`` answering each queued body as ``application/json``, as is."""
    bodies: list[bytes] = []

    async def handle(request: Request) -> Response:
        await request.body()
        return Response(bodies.pop(0) if bodies else b'{"text": "hi"}', 200, media_type="application/json")

    with ServerThread(Starlette(routes=[Route("/v1/audio/transcriptions", handle, methods=["POST"])])) as server:
        yield server, bodies


@pytest.mark.parametrize("body", [b"", b'{"text": "cut'])
async def test_a_transcription_answer_that_is_not_json_is_a_transcription_error(
    transcription_server: tuple[ServerThread, list[bytes]], body: bytes
) -> None:
    """An empty or cut JSON body let the SDK's ``JSONDecodeError`` out of ``transcribe``, which
    promises a ``TranscriptionError`` saying why."""
    server, bodies = transcription_server
    bodies.append(body)
    transcriber = OpenAITranscriber("whisper-1", api_key="sk-test", base_url=server.url + "/v1", max_retries=0)
    try:
        with pytest.raises(TranscriptionError, match="answer is not JSON"):
            await transcriber.transcribe(b"audio", "voice.ogg", "audio/ogg")
    finally:
        await transcriber.close()
    assert bodies == []  # the server was asked, and answered the body queued
