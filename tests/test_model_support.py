"""Provider-independent model machinery: registry, catalog and cost, retry policy, overflow detection."""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any

import pytest

from agentloop.events import StreamError
from agentloop.loop.execute import malformed
from agentloop.messages import AssistantMessage, Usage
from agentloop.models.base import AssistantBuilder, ModelInfo, ProviderError, make_usage
from agentloop.models.catalog import model_info
from agentloop.models.overflow import is_context_overflow, is_overflow_text
from agentloop.models.registry import ModelNotFound, register_provider, resolve_model
from agentloop.models.retry import RetryPolicy, parse_retry_after, retry_after_from_headers
from agentloop.models.scripted import ScriptedModel


def test_registry_resolves_and_explains():
    with pytest.raises(ModelNotFound, match="unknown provider 'nope'"):
        resolve_model("nope:x")
    with pytest.raises(ModelNotFound, match="provider:model"):
        resolve_model("gpt-4o")
    model = ScriptedModel(["x"])
    assert resolve_model(model) is model
    register_provider("mine", lambda model_id: ScriptedModel([model_id]))
    assert resolve_model("mine:hello").complete  # resolved through the factory
    register_provider("broken", "agentloop.models.does_not_exist:Nope")
    with pytest.raises(ModelNotFound, match=r"pip install 'agentloop\[broken\]'"):
        resolve_model("broken:x")


def test_env_selects_the_default(monkeypatch, tmp_path):
    script = tmp_path / "s.json"
    script.write_text('["from env"]')
    monkeypatch.setenv("AGENTLOOP_MODEL", f"scripted:{script}")
    assert isinstance(resolve_model(None), ScriptedModel)


def test_scripted_file_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="cannot read scripted model file"):
        ScriptedModel.from_file(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    for text, named in [
        ('{"replies": 3}', "replies: Input should be a valid list"),
        ('[{"tool_calls": [{"nom": "x"}]}]', "replies.0.tool_calls.0.name: Field required"),
        ('[{"tool_calls": "abc"}]', "replies.0.tool_calls: Input should be a valid list"),
        ('{"latency": "x", "replies": ["a"]}', "latency: Input should be a valid number"),
        ("[5]", "replies.0: Input should be a valid dictionary"),
    ]:
        bad.write_text(text)
        with pytest.raises(ValueError, match="is not a valid script") as caught:
            ScriptedModel.from_file(str(bad))
        assert named in str(caught.value), text
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="cannot read scripted model file"):
        ScriptedModel.from_file(str(bad))
    bad.write_text('{"latency": 0.5, "chunk": 2, "replies": ["a", {"error": "boom", "kind": "rate_limit"}]}')
    model = ScriptedModel.from_file(str(bad))
    assert (model.latency, model.chunk) == (0.5, 2)


def test_catalog_facts_and_cost():
    info = model_info("openai", "gpt-4o-mini")
    assert info.context_window == 128_000 and info.vision
    usage = make_usage(info, input=1_000_000, output=2_000_000, cache_read=1_000_000)
    assert usage.total_tokens == 4_000_000
    assert usage.cost.input == pytest.approx(0.15) and usage.cost.output == pytest.approx(1.2)
    assert usage.cost.total == pytest.approx(0.15 + 1.2 + 0.075)
    unknown = model_info("openai", "brand-new")
    assert unknown.id == "brand-new" and unknown.input_cost == 0


def test_retry_policy_backoff_and_retry_after():
    p = RetryPolicy(max_retries=3, base_delay=1.0, max_delay=10.0, jitter=0.0)
    assert [p.delay(i) for i in (1, 2, 3)] == [1.0, 2.0, 4.0]
    assert p.delay(4) is None
    assert p.delay(1, retry_after=7.0) == 7.0
    assert p.delay(1, retry_after=30.0) is None  # longer than we are willing to wait: fail over instead


def test_retry_after_parsing():
    assert parse_retry_after("2") == 2.0
    future = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 < (parse_retry_after(future) or 0) <= 30
    assert parse_retry_after("soon") is None
    assert retry_after_from_headers({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert retry_after_from_headers({"retry-after": "3"}) == 3.0
    assert retry_after_from_headers(object()) is None


@pytest.mark.parametrize(
    "text",
    [
        "prompt is too long: 210000 tokens > 200000 maximum",
        "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens",
        "Your input exceeds the context window of this model",
        "the request exceeds the available context size, try increasing it",
        "Requested tokens (9000) exceed context window of 8192",
        "400 status code (no body)",
        "input length and `max_tokens` exceed context limit: 178959 + 64000 > 200000, decrease input length or "
        "`max_tokens` and try again",  # Anthropic, when input + max_tokens do not fit the window
    ],
)
def test_overflow_texts(text):
    assert is_overflow_text(text)


def test_not_overflow():
    assert not is_overflow_text("429 Too Many Requests: rate limit reached")
    assert not is_overflow_text("invalid api key")


def test_silent_overflow_from_usage():
    ok = AssistantMessage(usage=Usage(input=100))
    over = AssistantMessage(usage=Usage(input=900, cache_read=200))
    assert not is_context_overflow(ok, context_window=1000)
    assert is_context_overflow(over, context_window=1000)
    err = AssistantMessage(stop_reason="error", error_message="prompt is too long")
    assert is_context_overflow(err)


def test_builder_keeps_garbage_tool_arguments_for_the_loop_to_answer():
    b = AssistantBuilder(ModelInfo(provider="p", id="m"))
    b.start()
    b.tool_call(0, "c1", "read")
    b.tool_args(0, '{"path": ')
    b.tool_call(1, "c2", "read")
    b.tool_args(1, '["a.txt"]')
    done = b.finish()[-1]
    first, second = done.message.tool_calls
    assert (first.arguments, first.invalid_arguments) == ({}, '{"path":')
    assert (second.arguments, second.invalid_arguments) == ({}, '["a.txt"]')
    assert "are not valid JSON" in malformed(first, done.message).text
    assert "are not a JSON object" in malformed(second, done.message).text


def test_a_tool_call_cut_by_the_output_limit_says_so():
    """Arguments cut off by max_tokens are the usual broken JSON: the error named only the JSON."""
    b = AssistantBuilder(ModelInfo(provider="p", id="m"))
    b.start()
    b.tool_call(0, "c1", "write")
    b.tool_args(0, '{"path": "a.txt", "content": "lo')
    done = b.finish("length")[-1]
    [cut] = done.message.tool_calls
    assert done.message.stop_reason == "length" and cut.invalid_arguments == '{"path": "a.txt", "content": "lo'
    assert "were cut off by the output token limit" in malformed(cut, done.message).text


QUOTA = {
    "error": {"message": "You exceeded your current quota", "type": "insufficient_quota", "code": "insufficient_quota"}
}


@pytest.mark.parametrize("provider", ["openai", "anthropic", "gemini"])
async def test_a_json_error_with_status_200_is_the_providers_error_not_a_cut_stream(provider: str) -> None:
    """Read as an empty stream it was retried as a broken connection, and its message was lost."""
    from agentloop import Agent
    from agentloop.models.anthropic import AnthropicModel
    from agentloop.models.gemini import GeminiModel
    from agentloop.models.openai_chat import OpenAIChatModel
    from tests.fakes.anthropic_server import AnthropicFake
    from tests.fakes.gemini_server import GeminiFake
    from tests.fakes.http_server import JSONReply
    from tests.fakes.openai_server import OpenAIFake

    fakes = {"openai": OpenAIFake, "anthropic": AnthropicFake, "gemini": GeminiFake}
    with fakes[provider]() as fake:
        fake.forever = JSONReply(200, QUOTA)
        model = {
            "openai": lambda: OpenAIChatModel("gpt-4o-mini", base_url=fake.base_url, api_key="k"),
            "anthropic": lambda: AnthropicModel("claude-haiku-4-5", base_url=fake.base_url, api_key="k"),
            "gemini": lambda: GeminiModel("gemini-2.5-flash", base_url=fake.base_url, api_key="k"),
        }[provider]()
        result = await Agent(model=model, retry=RetryPolicy(max_retries=2, base_delay=0.01)).run("hi")
        assert result.stop_reason == "error"
        assert result.error == "the provider answered application/json, not a stream: You exceeded your current quota"
        assert len(fake.requests) == 1  # not a transient failure: not retried


async def test_a_page_instead_of_a_stream_is_shown_as_such() -> None:
    import httpx

    from agentloop.models.base import check_event_stream

    page = httpx.Response(
        200, headers={"content-type": "text/html; charset=utf-8"}, content=b"<h1>502 Bad Gateway</h1>"
    )
    with pytest.raises(ProviderError, match="answered text/html, not a stream: <h1>502 Bad Gateway</h1>") as caught:
        await check_event_stream(page)
    assert caught.value.kind == "invalid_response"
    overloaded = httpx.Response(200, json={"error": {"message": "overloaded", "code": 503}})
    with pytest.raises(ProviderError) as caught:
        await check_event_stream(overloaded)
    assert caught.value.kind == "server"  # transient: retried
    await check_event_stream(
        httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"data: {}\n\n")
    )


async def test_a_stream_labelled_text_plain_is_left_to_be_read() -> None:
    """Some OpenAI-compatible servers label their event streams text/plain."""
    import httpx

    from agentloop.models.base import check_event_stream

    await check_event_stream(httpx.Response(200, headers={"content-type": "text/plain"}, content=b"data: {}\n\n"))


class _Page:
    """An answer that is not the provider's JSON: a proxy's HTML page, a server's plain text."""

    def __init__(self, status: int, body: str, content_type: str = "text/html") -> None:
        self.status, self.body, self.content_type = status, body, content_type


def _serving_pages(fake_class: type) -> type:
    """``fake_class`` answering a queued ``_Page`` as it is."""
    from starlette.requests import Request
    from starlette.responses import Response

    class Pages(fake_class):  # type: ignore[misc, valid-type]
        async def handle(self, request: Request) -> Response:
            page = self.queue[0] if self.queue else None
            if not isinstance(page, _Page):
                return await super().handle(request)
            self.queue.pop(0)
            self.requests.append(await request.json())
            return Response(page.body, status_code=page.status, media_type=page.content_type)

    return Pages


def _provider(provider: str, key: str = "k") -> tuple[Any, Any]:
    """A fake server of ``provider`` that can also answer pages, and a model factory for it."""
    from agentloop.models.anthropic import AnthropicModel
    from agentloop.models.gemini import GeminiModel
    from agentloop.models.openai_chat import OpenAIChatModel
    from tests.fakes.anthropic_server import AnthropicFake
    from tests.fakes.gemini_server import GeminiFake
    from tests.fakes.openai_server import OpenAIFake

    fake = _serving_pages({"openai": OpenAIFake, "anthropic": AnthropicFake, "gemini": GeminiFake}[provider])()
    make = {
        "openai": lambda: OpenAIChatModel("gpt-4o-mini", base_url=fake.base_url, api_key=key),
        "anthropic": lambda: AnthropicModel("claude-haiku-4-5", base_url=fake.base_url, api_key=key),
        "gemini": lambda: GeminiModel("gemini-2.5-flash", base_url=fake.base_url, api_key=key),
    }[provider]
    return fake, make


async def _failure(model: Any) -> StreamError:
    from agentloop import user
    from agentloop.models.base import ModelRequest

    events = [e async for e in model.stream(ModelRequest(system_prompt="", messages=[user("hi")]))]
    assert isinstance(events[-1], StreamError), events[-1]
    return events[-1]


PAGE = "<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1>" + "<p>nginx</p>" * 500


@pytest.mark.parametrize("provider", ["openai", "anthropic", "gemini"])
async def test_an_error_page_is_quoted_shortened(provider: str) -> None:
    """OpenAI's adapter lost the body ("HTTP 502: Error code: 502") and the overflow a plain-text
    body names; Anthropic's quoted a whole proxy page (6 KB of HTML) into the stored error."""
    fake, make = _provider(provider)
    with fake:
        fake.push(_Page(502, PAGE), _Page(400, "the request exceeds the available context size", "text/plain"))
        page = await _failure(make())
        assert (page.kind, page.status, page.retryable) == ("server", 502, True)
        text = page.message.error_message or ""
        assert text.startswith("HTTP 502: <html><head><title>502 Bad Gateway</title>") and len(text) < 400
        plain = await _failure(make())
        assert (plain.kind, plain.status) == ("overflow", 400)
        assert plain.message.error_message == "HTTP 400: the request exceeds the available context size"


@pytest.mark.parametrize("provider", ["openai", "anthropic", "gemini"])
async def test_a_key_the_server_quotes_is_masked(provider: str) -> None:
    """A key in no vendor's shape (a local server's, a proxy's) reached the stored error as is
    when the server quoted it back."""
    key = "team-proxy-key-8f3a"
    fake, make = _provider(provider, key)
    with fake:
        fake.push(
            _Page(401, json.dumps({"error": {"message": f"Invalid API key {key} for this proxy"}}), "application/json")
        )
        err = await _failure(make())
    assert err.kind == "auth"
    assert key not in (err.message.error_message or "") and "Invalid API key *** for this proxy" in (
        err.message.error_message or ""
    )
