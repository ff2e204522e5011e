"""Three limits of the provider adapters, each with what it did to a user: a stream that sent only
keep-alives held a run for ever, a long answer cost CPU time quadratic in its deltas, and an
OpenAI-compatible error event without an ``error`` key was retried as a cut stream, its message
lost."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from agentloop.events import RETRYABLE_KINDS, StreamError
from agentloop.models.anthropic import AnthropicModel
from agentloop.models.base import AssistantBuilder
from agentloop.models.catalog import model_info
from agentloop.models.gemini import GeminiModel
from agentloop.models.idle import DEFAULT_IDLE_SECONDS, idle_seconds
from agentloop.models.openai_chat import OpenAIChatModel
from tests.fakes import anthropic_server as ant
from tests.fakes import gemini_server as gem
from tests.fakes import openai_server as oai
from tests.fakes.anthropic_server import AnthropicFake
from tests.fakes.gemini_server import GeminiFake
from tests.fakes.http_server import SSEReply, sse_frame
from tests.fakes.openai_server import OpenAIFake
from tests.test_providers_review7 import answer, failure

# the read timeout the models get here, the longest a stream may go without progress (also the
# connect timeout: leave a loaded machine's connect some room)
IDLE = 0.8
PINGS = 120  # keep-alives a stalled server sends, one every PING_EVERY seconds (6 s, far past IDLE)
PING_EVERY = 0.05


@pytest.fixture(scope="module")
def ofake() -> Iterator[OpenAIFake]:
    with OpenAIFake() as fake:
        yield fake
        fake.reset()


@pytest.fixture(scope="module")
def afake() -> Iterator[AnthropicFake]:
    with AnthropicFake() as fake:
        yield fake


@pytest.fixture(scope="module")
def gfake() -> Iterator[GeminiFake]:
    with GeminiFake() as fake:
        yield fake


def stalled(*content: str, keep_alive: str = ": ping\n\n") -> SSEReply:
    """``content`` frames, then keep-alives long past the read timeout (but every one within it)."""
    return SSEReply(frames=[*content, *[keep_alive] * PINGS], delay=PING_EVERY)


async def timed_failure(model: Any) -> tuple[StreamError, float]:
    start = time.monotonic()
    event = await failure(model)
    return event, time.monotonic() - start


def assert_idle_timeout(event: StreamError, elapsed: float, received: int) -> None:
    """Failed as a read timeout does (retried), soon after the last content, saying how far it got."""
    assert event.kind == "timeout", event.message.error_message
    assert event.kind in RETRYABLE_KINDS
    assert elapsed < IDLE + 3, elapsed  # (the server would have pinged for PINGS * PING_EVERY seconds)
    error = event.message.error_message or ""
    assert "keep-alives" in error
    assert f"{received} characters" in error


# ------------------------------------------------------------------ 1. keep-alives are not progress


async def test_an_openai_stream_of_comments_times_out(ofake: OpenAIFake) -> None:
    ofake.reset()
    ofake.push(stalled(sse_frame(oai.chunk({"role": "assistant", "content": "Hel"}))))
    model = OpenAIChatModel("gpt-4o-mini", base_url=ofake.base_url, api_key="sk-test", timeout=IDLE)
    assert_idle_timeout(*await timed_failure(model), received=3)


async def test_an_openai_stream_with_content_between_its_comments_goes_on(ofake: OpenAIFake) -> None:
    """The limit counts from the last content, not from the start: a slow answer is not cut."""
    ofake.reset()
    ping = ": ping\n\n"
    a, b, c = (sse_frame(oai.chunk({"content": c})) for c in "abc")
    end = oai.stream(oai.chunk(finish_reason="stop"), oai.usage_chunk(3, 3)).frames
    ofake.push(
        SSEReply(
            frames=[a, ping, ping, b, ping, ping, c, *end],
            delay=0.15,  # 0.45 s between contents, 0.9 s in all: more than IDLE
        )
    )
    model = OpenAIChatModel("gpt-4o-mini", base_url=ofake.base_url, api_key="sk-test", timeout=IDLE)
    assert (await answer(model)).text == "abc"


@pytest.mark.parametrize("keep_alive", ['event: ping\ndata: {"type": "ping"}\n\n', ": ping\n\n\n\n"])
async def test_an_anthropic_stream_of_pings_times_out(afake: AnthropicFake, keep_alive: str) -> None:
    afake.reset()
    start = ant.stream(ant.message_start(), *ant.text_block(0, "Hi")[:2]).frames
    afake.push(stalled(*start, keep_alive=keep_alive))
    model = AnthropicModel("claude-haiku-4-5", base_url=afake.base_url, api_key="sk-ant-test", timeout=IDLE)
    assert_idle_timeout(*await timed_failure(model), received=2)


async def test_a_gemini_stream_of_comments_times_out(gfake: GeminiFake) -> None:
    gfake.reset()
    gfake.push(stalled(sse_frame(gem.chunk(gem.text("Hola")))))
    model = GeminiModel("gemini-2.5-flash", base_url=gfake.base_url, api_key="gem-test", timeout=IDLE)
    assert_idle_timeout(*await timed_failure(model), received=4)


def test_the_idle_limit_is_the_clients_read_timeout() -> None:
    assert idle_seconds(2) == 2.0
    assert idle_seconds(OpenAIChatModel("m", api_key="sk-x", timeout=7.5).client.timeout) == 7.5
    assert idle_seconds(AnthropicModel("claude-haiku-4-5", api_key="sk-ant-x").client.timeout) == 600.0
    assert idle_seconds(None) == DEFAULT_IDLE_SECONDS


# ------------------------------------------------------------------ 2. long answers in linear time


def _stream_text(n: int) -> tuple[float, AssistantBuilder]:
    """The CPU time of ``n`` one-character text deltas, and the builder they went into."""
    out = AssistantBuilder(model_info("openai", "gpt-4o-mini"))
    out.start()
    start = time.process_time()
    for _ in range(n):
        out.text("x")
    return time.process_time() - start, out


def test_a_long_answer_costs_time_linear_in_its_deltas() -> None:
    """``block.text += delta`` copied the whole text on each delta: 4x the deltas took ~30x the
    time (400k deltas: seconds). Linear, 4x the deltas takes about 4x."""
    small, _ = _stream_text(100_000)
    large, out = _stream_text(400_000)
    assert large / max(small, 1e-3) < 8, (small, large)
    assert out.message.text == "x" * 400_000
    assert out.end_block()[0].content == "x" * 400_000  # type: ignore[attr-defined]


def test_text_and_thinking_read_mid_stream_are_whole() -> None:
    """Whoever reads the partial message between deltas (an abort storing it) sees all of it."""
    out = AssistantBuilder(model_info("anthropic", "claude-haiku-4-5"))
    out.start()
    for i, piece in enumerate(["é", "a", "😀", "b"]):
        out.thinking(piece)
        assert out.message.content[0].thinking == "éa😀b"[: i + 1]  # type: ignore[union-attr]
    for i, piece in enumerate(["x", "ü", "y"]):
        out.text(piece)
        assert out.message.text == "xüy"[: i + 1]
    done = out.finish()[-1]
    assert done.message.content[0].thinking == "éa😀b"  # type: ignore[attr-defined,union-attr]
    assert done.message.text == "xüy"  # type: ignore[attr-defined]


# ------------------------------------------------------------------ 3. error events without "error"


@pytest.mark.parametrize(
    ("frame", "kind", "words"),
    [
        (  # vLLM's error shape
            sse_frame({"object": "error", "message": "engine crashed", "type": "InternalServerError", "code": 500}),
            "server",
            "engine crashed",
        ),
        (sse_frame({"message": "slow down", "code": 429}, event="error"), "rate_limit", "slow down"),
        (sse_frame({"detail": "upstream went away"}, event="error"), "server", "upstream went away"),
        (
            sse_frame({"object": "error", "message": "maximum context length is 8192 tokens", "code": 400}),
            "overflow",
            "maximum context length",
        ),
    ],
)
async def test_an_openai_error_event_without_an_error_key_says_what_it_is(
    ofake: OpenAIFake, frame: str, kind: str, words: str
) -> None:
    ofake.reset()
    ofake.push(SSEReply(frames=[sse_frame(oai.chunk({"role": "assistant", "content": "Hi"})), frame]))
    model = OpenAIChatModel("gpt-4o-mini", base_url=ofake.base_url, api_key="sk-test")
    event = await failure(model)
    assert event.kind == kind, event.message.error_message
    assert words in (event.message.error_message or "")
    assert "ended before" not in (event.message.error_message or "")
