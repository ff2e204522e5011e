"""Review of the OpenAI and Anthropic adapters and their shared support: each test names a way a
user of the runtime was hurt (a failing request, a lost call, a leaked connection, a wrong price)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest

from agentloop import Agent, tool, user
from agentloop.events import StreamDone, StreamError, StreamEvent, StreamStart, TurnEnd
from agentloop.messages import (
    AssistantMessage,
    TextContent,
    ThinkingContent,
    ToolCall,
    ToolResultMessage,
    UserMessage,
)
from agentloop.models.anthropic import AnthropicModel
from agentloop.models.base import Model, ModelRequest, ToolSpec
from agentloop.models.catalog import model_info
from agentloop.models.openai_chat import OpenAIChatModel
from agentloop.models.retry import RetryPolicy
from tests.fakes import anthropic_server as ant
from tests.fakes import openai_server as oai
from tests.fakes.anthropic_server import AnthropicFake
from tests.fakes.http_server import SSEReply
from tests.fakes.openai_server import OpenAIFake

FAST = RetryPolicy(max_retries=2, base_delay=0.01, max_delay=1.0)
SPEC = ToolSpec(name="echo", description="Echo.", parameters={"type": "object", "properties": {}})


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


def openai_model(fake: OpenAIFake, model_id: str = "gpt-4o-mini") -> OpenAIChatModel:
    return OpenAIChatModel(model_id, base_url=fake.base_url, api_key="sk-test")


def anthropic_model(fake: AnthropicFake, model_id: str = "claude-haiku-4-5") -> AnthropicModel:
    return AnthropicModel(model_id, base_url=fake.base_url, api_key="sk-ant-test")


def req(*messages: Any, tools: list[ToolSpec] | None = None) -> ModelRequest:
    return ModelRequest(system_prompt="", messages=list(messages), tools=tools or [])


async def events_of(m: Model, request: ModelRequest) -> list[StreamEvent]:
    return [e async for e in m.stream(request)]


def done_of(events: list[StreamEvent]) -> StreamDone:
    assert isinstance(events[-1], StreamDone), events[-1]
    return events[-1]


# ------------------------------------------------------------------ errors and retries


async def test_an_exhausted_openai_quota_is_not_retried(ofake: OpenAIFake) -> None:
    """OpenAI says "no credit left" with a 429: it was retried (with backoff) as a rate limit,
    every retry refused alike, before the run could fail over or end."""
    ofake.forever = oai.error(
        429,
        "You exceeded your current quota, please check your plan and billing details.",
        type="insufficient_quota",
        code="insufficient_quota",
    )
    result = await Agent(model=openai_model(ofake), retry=FAST).run("hi")
    assert result.stop_reason == "error" and "exceeded your current quota" in (result.error or "")
    assert len(ofake.requests) == 1
    ofake.reset()
    ofake.push(oai.error(429, "Rate limit reached", type="requests", code="rate_limit_exceeded"), oai.text_reply("ok"))
    assert (await Agent(model=openai_model(ofake), retry=FAST).run("hi")).text == "ok"  # a rate limit still is


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_a_key_read_from_a_file_with_its_newline_works(
    provider: str, ofake: OpenAIFake, afake: AnthropicFake
) -> None:
    """A key from a mounted secret ends in a newline: no HTTP header may hold one, and every call
    failed as "cannot reach" the server, a connection error retried in vain."""
    key = "team-key-abcdef1234567890\n"
    if provider == "openai":
        ofake.push(oai.text_reply("ok"))
        m: Model = OpenAIChatModel("gpt-4o-mini", base_url=ofake.base_url, api_key=key)
    else:
        afake.push(ant.text_reply("ok"))
        m = AnthropicModel("claude-haiku-4-5", base_url=afake.base_url, api_key=key)
    assert done_of(await events_of(m, req(user("hi")))).message.text == "ok"
    headers = (ofake if provider == "openai" else afake).headers[-1]
    assert headers.get("authorization", headers.get("x-api-key", "")).endswith("team-key-abcdef1234567890")


# ------------------------------------------------------------------ streams


async def test_an_openai_answer_whose_usage_was_cut_off_is_kept(ofake: OpenAIFake) -> None:
    """The connection broke after the chunk with ``finish_reason``: the answer was whole, but it
    was failed as a broken stream, retried, and paid for (and shown) twice."""
    reply = oai.text_reply("complete answer")
    ofake.push(SSEReply(frames=reply.frames, cut_after=3))  # role, content, finish; usage and [DONE] lost
    done = done_of(await events_of(openai_model(ofake), req(user("hi"))))
    assert (done.message.text, done.message.stop_reason) == ("complete answer", "stop")
    ofake.push(SSEReply(frames=reply.frames, cut_after=2))  # before the finish it still is a broken stream
    err = (await events_of(openai_model(ofake), req(user("hi"))))[-1]
    assert isinstance(err, StreamError) and err.kind == "connection"


async def test_an_anthropic_answer_whose_message_stop_was_cut_off_is_kept(afake: AnthropicFake) -> None:
    """After ``message_delta`` named the stop reason only ``message_stop`` was to come: a stream
    that broke (or just ended) there threw a whole answer away as a broken one."""
    reply = ant.stream(
        ant.message_start(), *ant.tool_block(0, "toolu_1", "echo", '{"text": "x"}'), *ant.message_end("tool_use")
    )
    afake.push(SSEReply(frames=reply.frames, cut_after=len(reply.frames) - 1))
    afake.push(SSEReply(frames=reply.frames[:-1]))  # a clean end without message_stop
    for _ in range(2):
        done = done_of(await events_of(anthropic_model(afake), req(user("hi"), tools=[SPEC])))
        assert done.message.stop_reason == "toolUse" and done.message.usage.output == 15
        assert [(c.id, c.arguments) for c in done.message.tool_calls] == [("toolu_1", {"text": "x"})]
    afake.push(SSEReply(frames=reply.frames, cut_after=len(reply.frames) - 2))  # before message_delta
    err = (await events_of(anthropic_model(afake), req(user("hi"), tools=[SPEC])))[-1]
    assert isinstance(err, StreamError) and err.kind == "connection"


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_a_stream_left_at_its_start_closes_the_response(
    provider: str, ofake: OpenAIFake, afake: AnthropicFake
) -> None:
    """A caller that stops reading at ``start`` (an abort as the answer begins) left the HTTP
    response open: the connection stayed checked out of the pool until garbage collection."""
    if provider == "openai":
        m: Any = openai_model(ofake)
        ofake.push(oai.text_reply("hello"))
        resource = m.client.chat.completions
    else:
        m = anthropic_model(afake)
        afake.push(ant.text_reply("hello"))
        resource = m.client.messages
    made: list[Any] = []
    create = resource.create

    @functools.wraps(create)  # (the adapter reads the signature)
    async def recording(*args: Any, **kwargs: Any) -> Any:
        made.append(await create(*args, **kwargs))
        return made[-1]

    resource.create = recording
    stream = m.stream(req(user("hi")))
    assert isinstance(await stream.__anext__(), StreamStart)
    await stream.aclose()
    assert len(made) == 1 and made[0].response.is_closed


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_utf8_and_lines_split_anywhere_across_reads(
    provider: str, ofake: OpenAIFake, afake: AnthropicFake
) -> None:
    """Pins that an SSE stream cut into 3-byte reads (inside characters, lines and frames) reads
    back whole, with a keep-alive comment in front."""
    text = "héllo wörld ✓ 日本語 🎉"
    frames = [": keep-alive\n\n"]
    frames += oai.text_reply(text, pieces=4).frames if provider == "openai" else ant.text_reply(text, pieces=4).frames
    raw = "".join(frames).encode()
    pieces: Any = [raw[i : i + 3] for i in range(0, len(raw), 3)]
    reply = SSEReply(frames=pieces, delay=0.001)
    if provider == "openai":
        ofake.push(reply)
        m: Model = openai_model(ofake)
    else:
        afake.push(reply)
        m = anthropic_model(afake)
    assert done_of(await events_of(m, req(user("hi")))).message.text == text


# ------------------------------------------------------------------ tool calls and content


async def test_a_tool_name_that_comes_after_the_calls_first_fragment_is_kept(ofake: OpenAIFake) -> None:
    """A server that sends a call's id first and its name in a later fragment: the call kept an
    empty name and was answered "unknown tool"."""
    first = {"index": 0, "id": "call_1", "type": "function", "function": {"arguments": ""}}
    ofake.push(
        oai.stream(
            oai.chunk({"role": "assistant", "content": None}),
            oai.chunk({"tool_calls": [first]}),
            oai.chunk({"tool_calls": [{"index": 0, "function": {"name": "echo"}}]}),
            oai.chunk(oai.tool_delta(0, args='{"text": "x"}')),
            oai.chunk(finish_reason="tool_calls"),
        )
    )
    msg = done_of(await events_of(openai_model(ofake), req(user("hi"), tools=[SPEC]))).message
    assert [(c.id, c.name, c.arguments) for c in msg.tool_calls] == [("call_1", "echo", {"text": "x"})]


async def test_parallel_calls_at_index_zero_stay_apart_when_the_first_has_no_arguments(ofake: OpenAIFake) -> None:
    """Servers that give every parallel call index 0 were told apart only by whole arguments: a
    call without any (a tool without parameters) swallowed the next one, whose call was lost."""

    def call(id: str, name: str, args: str) -> dict[str, Any]:
        return {
            "tool_calls": [{"index": 0, "id": id, "type": "function", "function": {"name": name, "arguments": args}}]
        }

    ofake.push(
        oai.stream(
            oai.chunk(call("call_a", "now", "")),
            oai.chunk(call("call_b", "echo", '{"text": "x"}')),
            oai.chunk(finish_reason="tool_calls"),
        )
    )
    msg = done_of(await events_of(openai_model(ofake), req(user("hi"), tools=[SPEC]))).message
    assert [(c.id, c.name, c.arguments) for c in msg.tool_calls] == [
        ("call_a", "now", {}),
        ("call_b", "echo", {"text": "x"}),
    ]


async def test_mistral_content_parts_are_read(ofake: OpenAIFake) -> None:
    """Mistral's reasoning models stream ``content`` as a list of parts (``thinking`` parts, then
    ``text``): taken for a string, every answer failed as unreadable."""

    def think(t: str) -> dict[str, Any]:
        return oai.chunk({"content": [{"type": "thinking", "thinking": [{"type": "text", "text": t}]}]})

    ofake.push(
        oai.stream(
            oai.chunk({"role": "assistant", "content": ""}),
            think("It's a greeting"),
            think(", answer it."),
            oai.chunk({"content": [{"type": "text", "text": "Hello"}]}),
            oai.chunk({"content": "!"}),
            oai.chunk(finish_reason="stop"),
        )
    )
    msg = done_of(await events_of(openai_model(ofake, "magistral-medium-2509"), req(user("hi")))).message
    thinking, text = msg.content
    assert isinstance(thinking, ThinkingContent) and thinking.thinking == "It's a greeting, answer it."
    assert isinstance(text, TextContent) and msg.text == "Hello!"


async def test_a_tool_use_stop_without_calls_ends_the_turn(ofake: OpenAIFake) -> None:
    """``finish_reason: tool_calls`` with no call in the answer: the loop took it for a turn with
    calls to run, and the turn never ended (no ``turn_end``, no ``post_turn`` hook)."""

    @tool
    def echo(text: str) -> str:
        """Echo."""
        return text

    ofake.push(oai.text_reply("Nothing to call.", finish="tool_calls"))
    events = [e async for e in Agent(model=openai_model(ofake), tools=[echo]).stream("hi")]
    [end] = [e for e in events if isinstance(e, TurnEnd)]
    assert end.message.stop_reason == "stop" and end.message.text == "Nothing to call."


# ------------------------------------------------------------------ requests


def test_an_empty_error_result_reaches_anthropic_with_words() -> None:
    """The API refuses a ``tool_result`` with ``is_error`` and no content (an error result with
    empty or blank text): stored in the history, it failed every later call of the conversation."""
    call = ToolCall(id="toolu_1", name="echo", arguments={})
    history = [
        user("hi"),
        AssistantMessage(content=[call], stop_reason="toolUse"),
        ToolResultMessage(tool_call_id="toolu_1", tool_name="echo", content=[TextContent(text=" ")], is_error=True),
    ]
    params = AnthropicModel("claude-haiku-4-5", api_key="k", prompt_cache=False).build_params(req(*history))
    [block] = params["messages"][-1]["content"]
    assert block["is_error"] is True
    assert block["content"] == [{"type": "text", "text": "(the tool failed without a message)"}]
    fine = ToolResultMessage(tool_call_id="toolu_1", tool_name="echo", content=[])  # a success may be empty
    params = AnthropicModel("claude-haiku-4-5", api_key="k", prompt_cache=False).build_params(req(*history[:2], fine))
    assert params["messages"][-1]["content"] == [{"type": "tool_result", "tool_use_id": "toolu_1"}]


def test_several_text_blocks_reach_openai_a_line_apart() -> None:
    """An MCP tool's several text results (or a text and a note) were glued together for OpenAI:
    "Found 2 files:a.py"."""
    call = ToolCall(id="call_1", name="mcp", arguments={})
    result = ToolResultMessage(
        tool_call_id="call_1",
        tool_name="mcp",
        content=[TextContent(text="Found 2 files:"), TextContent(text="a.py\nb.py")],
    )
    two = UserMessage(content=[TextContent(text="Look:"), TextContent(text="[image unavailable]")])
    history = [two, AssistantMessage(content=[call], stop_reason="toolUse"), result]
    sent = OpenAIChatModel("gpt-4o-mini", api_key="k").build_params(req(*history))["messages"]
    assert sent[0]["content"] == "Look:\n[image unavailable]"
    assert sent[-1]["content"] == "Found 2 files:\na.py\nb.py"


@pytest.mark.parametrize(
    ("provider", "dated", "listed"),
    [
        ("openai", "o4-mini-2025-04-16", "o4-mini"),
        ("openai", "gpt-4o-2024-08-06", "gpt-4o"),
        ("anthropic", "claude-sonnet-4-5-20250929", "claude-sonnet-4-5"),
    ],
)
def test_a_dated_snapshot_has_its_models_facts(provider: str, dated: str, listed: str) -> None:
    """A pinned snapshot was an unknown model: free (a cost guard never fired), with the default
    window, and not known to reason."""
    info, base = model_info(provider, dated), model_info(provider, listed)
    assert info.id == dated and info.name == f"{provider}:{dated}"
    assert (info.input_cost, info.output_cost, info.context_window, info.max_output, info.reasoning) == (
        base.input_cost,
        base.output_cost,
        base.context_window,
        base.max_output,
        base.reasoning,
    )
    assert model_info("openai", "gpt-4o-mini-2024-07-18").input_cost == model_info("openai", "gpt-4o-mini").input_cost


def test_openai_gets_the_output_limit_under_the_name_every_model_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenAI refuses ``max_tokens`` from its reasoning models, and one missing from the catalog
    (``o3``, ``gpt-5``, a dated ``o4-mini``) got it: compaction's summary call, which always sets a
    limit, failed with 400."""
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    limited = ModelRequest(system_prompt="", messages=[user("hi")], max_tokens=100)
    for model_id in ("o3", "gpt-5", "o4-mini-2025-04-16", "gpt-4o-mini"):
        params = OpenAIChatModel(model_id, api_key="k").build_params(limited)
        assert params["max_completion_tokens"] == 100 and "max_tokens" not in params, model_id
    other = OpenAIChatModel("llama3", api_key="k", base_url="http://127.0.0.1:8000/v1").build_params(limited)
    assert other["max_tokens"] == 100 and "max_completion_tokens" not in other  # what every server knows
