"""Key providers: each adapter asks a function (plain or async) for its API key before every call,
so a long-running server follows short-lived credentials (hourly OAuth tokens, a rotating vault,
Azure AD tokens) instead of failing every call once the key it started with expires.

Every test runs against the local wire-format fakes the provider tests use, and reads the key off
the headers the server received.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from agentloop import Agent, user
from agentloop.events import AgentEnd, ModelRetry, StreamDone, StreamError, StreamEvent
from agentloop.models.anthropic import AnthropicModel
from agentloop.models.base import ApiKey, Model, ModelRequest, ProviderError
from agentloop.models.gemini import GeminiModel
from agentloop.models.openai_chat import OpenAIChatModel
from agentloop.models.retry import RetryPolicy
from tests.fakes import anthropic_server as ant
from tests.fakes import gemini_server as gem
from tests.fakes import openai_server as oai
from tests.fakes.http_server import Reply, ScriptedEndpoint

# anthropic 2.x warns about model ids it considers deprecated; the ids here are only fixture names
pytestmark = pytest.mark.filterwarnings("ignore:The model .* is deprecated:DeprecationWarning")

FAST = RetryPolicy(base_delay=0.01, max_delay=0.05)
PROVIDERS = ["openai", "anthropic", "gemini"]


@dataclass
class Wire:
    """One provider's fake server and how to talk to it: its model, the header that carries the
    key, a good answer and a 401."""

    fake: ScriptedEndpoint
    make: Callable[[ApiKey], Model]
    header: str
    ok: Callable[[str], Reply]
    unauthorized: Callable[[str], Reply]

    def sent_keys(self) -> list[str]:
        """The key each request the server received carried, in order. (Anthropic's SDK sends
        ``x-api-key`` in some versions and ``Authorization: Bearer`` in others.)"""
        keys = []
        for h in self.fake.headers:
            value = h.get(self.header) or h["authorization"]
            keys.append(value.removeprefix("Bearer "))
        return keys


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ScriptedEndpoint]]:
    with oai.OpenAIFake() as o, ant.AnthropicFake() as a, gem.GeminiFake() as g:
        yield {"openai": o, "anthropic": a, "gemini": g}


@pytest.fixture(params=PROVIDERS)
def wire(request: pytest.FixtureRequest, servers: dict[str, Any]) -> Iterator[Wire]:
    name: str = request.param
    fake = servers[name]
    fake.reset()
    url = fake.base_url
    if name == "openai":
        w = Wire(
            fake,
            lambda key: OpenAIChatModel("gpt-4o-mini", base_url=url, api_key=key),
            "authorization",
            oai.text_reply,
            lambda text: oai.error(401, text, code="invalid_api_key"),
        )
    elif name == "anthropic":
        w = Wire(
            fake,
            lambda key: AnthropicModel("claude-sonnet-4-5", base_url=url, api_key=key),
            "x-api-key",
            ant.text_reply,
            lambda text: ant.error(401, "authentication_error", text),
        )
    else:
        w = Wire(
            fake,
            lambda key: GeminiModel("gemini-2.5-flash", base_url=url, api_key=key),
            "x-goog-api-key",
            gem.text_reply,
            lambda text: gem.error(401, "UNAUTHENTICATED", text),
        )
    yield w
    fake.reset()


class Rotating:
    """A key provider that hands out ``token-0001...``, ``token-0002...``: a new key each time it
    is asked, as a token that expired between calls would be."""

    def __init__(self) -> None:
        self.asked = 0

    def key(self) -> str:
        self.asked += 1
        return f"token-{self.asked:04d}-rotating-secret"

    def sync(self) -> str:
        return self.key()

    async def async_(self) -> str:
        return self.key()


def request() -> ModelRequest:
    return ModelRequest(system_prompt="", messages=[user("hi")])


async def call(model: Model) -> StreamDone | StreamError:
    events: list[StreamEvent] = [e async for e in model.stream(request())]
    last = events[-1]
    assert isinstance(last, StreamDone | StreamError), last
    return last


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_each_call_carries_the_key_the_provider_gave_at_that_time(wire: Wire, kind: str) -> None:
    keys = Rotating()
    provider: ApiKey = keys.sync if kind == "sync" else keys.async_
    model = wire.make(provider)
    for n in range(3):
        wire.fake.push(wire.ok(f"answer {n}"))
        done = await call(model)
        assert isinstance(done, StreamDone), done.message.error_message
        assert done.message.text == f"answer {n}"
    assert keys.asked == 3
    assert wire.sent_keys() == [f"token-{n:04d}-rotating-secret" for n in (1, 2, 3)]


async def test_a_cached_key_is_sent_until_the_provider_renews_it(wire: Wire) -> None:
    """A provider that caches its token returns the same key until it renews it: every call
    carries the cached one, and the first call after the renewal the new one."""
    current = ["cached-token-aaaaaaaa"]
    model = wire.make(lambda: current[0])
    for text in ("one", "two"):
        wire.fake.push(wire.ok(text))
        assert isinstance(await call(model), StreamDone)
    current[0] = "renewed-token-bbbbbbbb"
    wire.fake.push(wire.ok("three"))
    assert isinstance(await call(model), StreamDone)
    assert wire.sent_keys() == ["cached-token-aaaaaaaa"] * 2 + ["renewed-token-bbbbbbbb"]


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_provider_that_raises_is_an_auth_error_of_the_call(wire: Wire, kind: str) -> None:
    def broken() -> str:
        raise RuntimeError("vault sealed")

    async def broken_async() -> str:
        raise RuntimeError("vault sealed")

    model = wire.make(broken if kind == "sync" else broken_async)
    wire.fake.push(wire.ok("never"))
    result = await call(model)
    assert isinstance(result, StreamError)
    assert result.kind == "auth"
    assert result.message.stop_reason == "error"
    message = result.message.error_message or ""
    assert "key provider failed" in message and "RuntimeError: vault sealed" in message
    assert "Traceback" not in message
    assert wire.fake.requests == []  # nothing was sent without a key


@pytest.mark.parametrize("answer", [None, "", "  \n"])
async def test_a_provider_that_answers_no_key_is_an_auth_error(wire: Wire, answer: Any) -> None:
    model = wire.make(lambda: answer)
    result = await call(model)
    assert isinstance(result, StreamError) and result.kind == "auth"
    assert "returned no key" in (result.message.error_message or "")
    assert wire.fake.requests == []


async def test_a_provider_error_it_raises_keeps_its_kind_so_the_loop_retries_it(wire: Wire) -> None:
    """A vault that is down for a moment: the provider says so with a retryable kind, the loop
    retries, and the next ask succeeds."""
    asked: list[int] = []

    async def flaky() -> str:
        asked.append(1)
        if len(asked) == 1:
            raise ProviderError("vault unreachable", kind="connection")
        return "token-after-the-outage"

    wire.fake.push(wire.ok("fine"))
    events = [e async for e in Agent(model=wire.make(flaky), retry=FAST).stream("hi")]
    end = events[-1]
    assert isinstance(end, AgentEnd) and end.stop_reason != "error", end
    assert len([e for e in events if isinstance(e, ModelRetry)]) == 1
    assert wire.sent_keys() == ["token-after-the-outage"]


async def test_a_raising_provider_ends_an_agent_run_with_an_error_not_a_traceback(wire: Wire) -> None:
    def broken() -> str:
        raise OSError("token file missing")

    events = [e async for e in Agent(model=wire.make(broken), retry=FAST).stream("hi")]
    end = events[-1]
    assert isinstance(end, AgentEnd) and end.stop_reason == "error"
    assert not [e for e in events if isinstance(e, ModelRetry)]  # an auth error is not retried
    assert wire.fake.requests == []


async def test_a_401_asks_the_provider_again_and_retries_once_with_the_new_key(wire: Wire) -> None:
    keys = Rotating()
    wire.fake.push(wire.unauthorized("token expired"), wire.ok("after refresh"))
    done = await call(wire.make(keys.async_))
    assert isinstance(done, StreamDone), done.message.error_message
    assert done.message.text == "after refresh"
    assert keys.asked == 2
    assert wire.sent_keys() == ["token-0001-rotating-secret", "token-0002-rotating-secret"]


async def test_a_second_401_is_the_auth_error_and_the_refused_keys_are_masked(wire: Wire) -> None:
    keys = Rotating()
    wire.fake.push(
        wire.unauthorized("bad key token-0001-rotating-secret"),
        wire.unauthorized("bad key token-0002-rotating-secret"),
        wire.ok("never"),
    )
    result = await call(wire.make(keys.sync))
    assert isinstance(result, StreamError) and result.kind == "auth" and result.status == 401
    assert len(wire.fake.requests) == 2  # one refresh, not a loop
    message = result.message.error_message or ""
    assert "rotating-secret" not in message


async def test_a_401_with_the_same_key_again_is_not_sent_twice(wire: Wire) -> None:
    wire.fake.push(wire.unauthorized("revoked"), wire.ok("never"))
    result = await call(wire.make(lambda: "revoked-token-cccccccc"))
    assert isinstance(result, StreamError) and result.kind == "auth"
    assert wire.sent_keys() == ["revoked-token-cccccccc"]
