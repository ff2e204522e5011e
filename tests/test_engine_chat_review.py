"""``POST /engine/chat`` review: what a gateway client relies on beyond the happy path.

Each test here reproduced a suspicion first; the ones that found a bug fail without the fix they
name.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx

from agentloop import Agent, Reply, RetryPolicy, ScriptedModel, call, tool
from agentloop.events import StreamEvent
from agentloop.models.base import AssistantBuilder, Model, ModelInfo, ModelRequest, ProviderError
from agentloop.server import create_app
from agentloop.tools.base import ToolContext
from tests.test_engine_chat import parse_sse, served
from tests.ws_support import strict_json

TOKEN = "review-token-123456"
AUTH = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
URL = "/engine/chat"


def body(*messages: dict[str, Any], cid: str = "corr-1") -> dict[str, Any]:
    return {"messages": list(messages), "metadata": {"correlation_id": cid}}


def u(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


async def post(
    app: Any, payload: Any = None, *, raw: bytes | None = None, headers: dict[str, str] | None = None
) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        content = raw if raw is not None else json.dumps(payload).encode()
        return await client.post(URL, content=content, headers=AUTH if headers is None else headers)


async def events_of(app: Any, payload: Any) -> list[tuple[str, dict[str, Any]]]:
    resp = await post(app, payload)
    assert resp.status_code == 200, resp.text
    return parse_sse(resp.text, loads=strict_json)


# ------------------------------------------------------------------ event data is strict JSON


@tool
def echo(value: Any) -> str:
    """Echo the value."""
    return repr(value)


async def test_non_finite_numbers_in_tool_arguments_are_sent_as_null() -> None:
    # A model's ``{"n": 1e999}`` parses to inf; ``json.dumps`` would write ``Infinity``, which
    # JSON.parse (and every strict client) refuses, breaking the whole stream on the client.
    script = [Reply(tool_calls=[call("nope", n=float("inf"), m=[float("nan")])]), "ok"]
    app = create_app(lambda: Agent(ScriptedModel(script), tools=[echo]), tokens={TOKEN})
    events = await events_of(app, body(u("go")))
    tool_call = next(d for n, d in events if n == "tool-call")
    assert tool_call["arguments"] == {"n": None, "m": [None]}
    assert events[-1][0] == "done"


# ------------------------------------------------------------------ a retried model call


class BreaksMidAnswer(Model):
    """Streams ``first`` and then fails as a broken connection would (retryable); the next call
    answers ``second`` in full. A real provider's stream can break like this at any point."""

    def __init__(self, first: str, second: str, *, chunks: tuple[int, int] = (100, 100)) -> None:
        self.info = ModelInfo(provider="test", id="breaks", context_window=100_000)
        self.first, self.second = first, second
        self.chunks = chunks  # delta sizes of the two attempts: a retry's deltas need not line up
        self.calls = 0

    async def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
        self.calls += 1
        yield out.start()
        text, step = (self.first, self.chunks[0]) if self.calls == 1 else (self.second, self.chunks[1])
        for i in range(0, len(text), step):
            for event in out.text(text[i : i + step]):
                yield event
            await asyncio.sleep(0)
        if self.calls == 1:
            raise ProviderError("connection reset by peer", kind="connection")
        for event in out.finish():
            yield event


def retrying_app(model: Model) -> Any:
    retry = RetryPolicy(max_retries=2, base_delay=0.001, max_delay=0.01)
    return create_app(lambda: Agent(model, retry=retry), tokens={TOKEN})


async def test_a_retry_after_streamed_text_does_not_garble_the_answer() -> None:
    # The client concatenates text-delta events; a retried call must not leave the failed
    # attempt's text in front of the new answer ("Hello, wHello, world.").
    model = BreaksMidAnswer("Hello, w", "Hello, world.")
    events = await events_of(retrying_app(model), body(u("hi")))
    assert model.calls == 2
    text = "".join(d["content"] for n, d in events if n == "text-delta")
    names = [n for n, _ in events]
    if names[-1] == "done":
        assert text == "Hello, world."
    else:  # the text cannot be taken back: then the stream must end in one error, not in done
        assert names[-1] == "error" and names.count("error") == 1 and "done" not in names


async def test_a_retry_whose_deltas_split_differently_still_reads_once() -> None:
    model = BreaksMidAnswer("Hello, w", "Hello, world. Bye.", chunks=(3, 5))
    events = await events_of(retrying_app(model), body(u("hi")))
    assert "".join(d["content"] for n, d in events if n == "text-delta") == "Hello, world. Bye."
    assert events[-1][0] == "done"


async def test_a_retry_that_answers_differently_ends_in_one_error() -> None:
    model = BreaksMidAnswer("Hello, w", "Hi there, world.", chunks=(3, 4))
    events = await events_of(retrying_app(model), body(u("hi")))
    names = [n for n, _ in events]
    assert names[-1] == "error" and names.count("error") == 1 and "done" not in names
    assert events[-1][1]["code"] == "provider_error"
    assert "".join(d["content"] for n, d in events if n == "text-delta") == "Hello, w"


async def test_a_retry_that_stops_short_of_the_sent_text_ends_in_one_error() -> None:
    model = BreaksMidAnswer("Hello, w", "Hello")
    events = await events_of(retrying_app(model), body(u("hi")))
    assert [n for n, _ in events] == ["text-delta", "error"]
    assert events[-1][1]["code"] == "provider_error"


async def test_a_retry_before_any_text_is_invisible() -> None:
    model = BreaksMidAnswer("", "Hello, world.")
    events = await events_of(retrying_app(model), body(u("hi")))
    assert model.calls == 2
    assert "".join(d["content"] for n, d in events if n == "text-delta") == "Hello, world."
    assert events[-1][0] == "done"


# ------------------------------------------------------------------ mid-stream provider failure


async def test_a_provider_failure_after_text_is_one_error_and_nothing_after() -> None:
    class Fails(BreaksMidAnswer):
        async def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
            yield out.start()
            for event in out.text("partial answer"):
                yield event
            raise ProviderError("invalid api key", kind="auth")  # not retryable

    app = create_app(lambda: Agent(Fails("", ""), retry=RetryPolicy(max_retries=3)), tokens={TOKEN})
    events = await events_of(app, body(u("hi")))
    names = [n for n, _ in events]
    assert names[-1] == "error" and names.count("error") == 1 and "done" not in names
    assert set(names[:-1]) == {"text-delta"}
    assert events[-1][1]["code"] == "provider_error" and isinstance(events[-1][1]["message"], str)


# ------------------------------------------------------------------ field names and types


async def test_every_event_has_exactly_the_contract_fields() -> None:
    @tool
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    script = [Reply(text="Let me add. ", tool_calls=[call("add", a=1, b=2), call("nope")]), "It is 3."]
    app = create_app(lambda: Agent(ScriptedModel(script, chunk=2), tools=[add]), tokens={TOKEN})
    events = await events_of(app, body(u("1+2?")))
    shapes = {
        "text-delta": {"content": str},
        "tool-call": {"id": str, "name": str, "arguments": dict},
        "done": {"finish_reason": str, "usage": dict},
    }
    for name, data in events:
        if name == "tool-result":
            assert set(data) in ({"id", "output"}, {"id", "error"}), data
            assert all(isinstance(v, str) for v in data.values())
            continue
        assert set(data) == set(shapes[name]), (name, data)
        for key, kind in shapes[name].items():
            assert isinstance(data[key], kind), (name, key, data)
    usage = events[-1][1]["usage"]
    assert set(usage) == {"prompt_tokens", "completion_tokens"}
    assert all(type(v) is int and v >= 0 for v in usage.values())
    calls = [d["id"] for n, d in events if n == "tool-call"]
    results = [d["id"] for n, d in events if n == "tool-result"]
    assert sorted(calls) == sorted(results) and len(set(calls)) == 2


# ------------------------------------------------------------------ bodies


async def test_a_chunked_body_over_the_limit_is_413() -> None:
    # No Content-Length: the size must still be enforced while reading.
    app = create_app(lambda: Agent(ScriptedModel(["x"])), tokens={TOKEN}, max_body=4096)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"a" * 1000
        yield b'"}], "metadata": {"correlation_id": "c"}}'

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        resp = await client.post(URL, content=chunks(), headers=AUTH)
    assert resp.status_code == 413 and resp.json()["code"] == "payload_too_large"


async def test_deeply_nested_json_is_a_clear_400() -> None:
    app = create_app(lambda: Agent(ScriptedModel(["x"])), tokens={TOKEN})
    for depth in (300, 5000, 100_000):
        nested = "[" * depth + "]" * depth
        raw = (
            '{"messages": [{"role": "user", "content": "hi"}], '
            f'"metadata": {{"correlation_id": "c", "client_context": {{"x": {nested}}}}}}}'
        ).encode()
        resp = await post(app, raw=raw)
        assert resp.status_code in (200, 400), (depth, resp.status_code)
        if resp.status_code == 400:
            assert resp.json()["code"] == "invalid_request"


async def test_content_as_a_list_of_parts_is_refused_naming_the_field() -> None:
    app = create_app(lambda: Agent(ScriptedModel(["x"])), tokens={TOKEN})
    parts = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]
    resp = await post(app, body({"role": "user", "content": parts}))
    assert resp.status_code == 400
    assert resp.json()["message"].startswith("messages[0].content:"), resp.json()


# ------------------------------------------------------------------ concurrency


async def test_two_requests_at_once_share_nothing_even_with_one_shared_agent() -> None:
    seen: dict[str, Any] = {}
    both_in = asyncio.Event()
    arrived: list[str] = []

    async def script(request: ModelRequest) -> str:
        who = request.messages[-1].text
        arrived.append(who)
        if len(arrived) == 2:
            both_in.set()
        await asyncio.wait_for(both_in.wait(), 5)  # both runs are inside the model at once
        seen[who] = request
        return f"answer to {who}"

    shared = Agent(ScriptedModel(script, chunk=1), system_prompt="base")
    app = create_app(lambda: shared, tokens={TOKEN})
    first = body({"role": "system", "content": "prefix A"}, u("A"), cid="a")
    second = body({"role": "system", "content": "prefix B"}, u("B"), cid="b")
    ev_a, ev_b = await asyncio.gather(events_of(app, first), events_of(app, second))
    assert "".join(d["content"] for n, d in ev_a if n == "text-delta") == "answer to A"
    assert "".join(d["content"] for n, d in ev_b if n == "text-delta") == "answer to B"
    assert seen["A"].system_prompt.startswith("prefix A") and "prefix B" not in seen["A"].system_prompt
    assert seen["B"].system_prompt.startswith("prefix B") and "prefix A" not in seen["B"].system_prompt
    assert [m.text for m in seen["A"].messages] == ["A"] and [m.text for m in seen["B"].messages] == ["B"]
    assert shared.config.system_prompt == "base"


# ------------------------------------------------------------------ a client that hangs up


class Hangs(Model):
    """Streams a little text, then waits forever (a slow provider); records its cancellation."""

    def __init__(self) -> None:
        self.info = ModelInfo(provider="test", id="hangs", context_window=100_000)
        self.streaming = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
        yield out.start()
        for event in out.text("Thinking about it"):
            yield event
        self.streaming.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        for event in out.finish():
            yield event


async def test_a_disconnect_during_the_model_call_cancels_it_and_leaves_no_task() -> None:

    model = Hangs()
    async with served(create_app(lambda: Agent(model), tokens={TOKEN})) as base:
        before = set(asyncio.all_tasks())
        async with (
            httpx.AsyncClient(base_url=base, timeout=5) as client,
            client.stream("POST", URL, json=body(u("hi")), headers=AUTH) as resp,
        ):
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("event: text-delta"):
                    break
            await asyncio.wait_for(model.streaming.wait(), 5)
        await asyncio.wait_for(model.cancelled.wait(), 5)
        for _ in range(100):
            # (sse-starlette keeps one shutdown watcher per event loop: the library's, not a request's)
            extra = {t for t in asyncio.all_tasks() - before if not t.done() and "_shutdown_watcher" not in repr(t)}
            if not extra:
                break
            await asyncio.sleep(0.02)
        assert not extra, extra


# ------------------------------------------------------------------ finish reasons


class CutOff(Model):
    """Answers, then stops at the output limit (the provider's "length" finish reason)."""

    info = ModelInfo(provider="test", id="cut", context_window=100_000)

    async def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
        yield out.start()
        for event in out.text("a long answer that was cu"):
            yield event
        for event in out.finish("length"):
            yield event


async def test_an_answer_cut_at_the_output_limit_finishes_as_max_tokens() -> None:
    """The contract spells an answer cut off at the output limit ``max_tokens`` (as the providers'
    finish reasons it passes through do); ours said ``length``, which a gateway would not know."""
    app = create_app(lambda: Agent(CutOff()), tokens={TOKEN})
    events = await events_of(app, body(u("go")))
    assert events[-1] == ("done", {"finish_reason": "max_tokens", "usage": events[-1][1]["usage"]})


# ------------------------------------------------------------------ metadata reaches the tools


async def test_the_correlation_id_reaches_the_tools() -> None:
    """The contract's correlation_id flows to the tools (with the rest of the request's metadata),
    so what a tool logs or calls can be traced to the request that caused it."""
    seen: list[dict[str, Any]] = []

    @tool
    def trace(ctx: ToolContext) -> str:
        """Record the request's metadata."""
        seen.append(dict(ctx.metadata or {}))
        return "traced"

    script = [Reply(tool_calls=[call("trace")]), "ok"]
    app = create_app(lambda: Agent(ScriptedModel(script), tools=[trace]), tokens={TOKEN})
    payload = body(u("go"), cid="corr-42")
    payload["metadata"]["conversation_id"] = "conv-7"
    events = await events_of(app, payload)
    assert events[-1][0] == "done"
    assert seen == [
        {"correlation_id": "corr-42", "conversation_id": "conv-7", "trigger": "message", "client_context": None}
    ]


async def test_metadata_given_to_a_run_reaches_its_tools() -> None:
    seen: list[Any] = []

    @tool
    def trace(ctx: ToolContext) -> str:
        """Record the run's metadata."""
        seen.append(ctx.metadata)
        return "traced"

    agent = Agent(ScriptedModel([Reply(tool_calls=[call("trace")]), "ok"]), tools=[trace])
    await agent.run("go", metadata={"request": "r-1"})
    assert seen == [{"request": "r-1"}]
