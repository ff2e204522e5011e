"""``POST /engine/chat``: the stateless gateway contract over SSE.

Most tests run in process through ``httpx.ASGITransport``; the disconnect test needs a real
socket (an in-process transport cannot hang up mid-stream), so it runs uvicorn on a free port.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from agentloop import Agent, Reply, RetryPolicy, ScriptedModel, call, tool
from agentloop.models.base import ProviderError
from agentloop.server import create_app
from agentloop.server.errors import safe_message

TOKEN = "s3cret-token-value-123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
URL = "/engine/chat"


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@tool
def explode(reason: str) -> str:
    """Always fails."""
    raise RuntimeError(f"tool broke: {reason}")


def body(*messages: dict[str, Any], cid: str = "corr-1", **meta: Any) -> dict[str, Any]:
    return {"messages": list(messages), "metadata": {"correlation_id": cid, **meta}}


def u(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def make_app(script: list[Any] | Callable[[Any], Any], *, tools: list[Any] | None = None, **kw: Any) -> Any:
    def factory() -> Agent:
        model = ScriptedModel(script if callable(script) else list(script), chunk=3)
        return Agent(model, tools=tools or [add, explode], retry=RetryPolicy(max_retries=0))

    return create_app(factory, tokens={TOKEN, "other-token"}, **kw)


def parse_sse(text: str, loads: Callable[[str], Any] = json.loads) -> list[tuple[str, Any]]:
    """(event name, data decoded by ``loads``) for each frame of an SSE body."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
        if name and data is not None:
            events.append((name, loads(data)))
    return events


async def post(
    app: Any, payload: Any, headers: dict[str, str] | None = None, raw: bytes | None = None
) -> httpx.Response:
    hdrs = {"content-type": "application/json", **AUTH} if headers is None else headers
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        content = raw if raw is not None else json.dumps(payload).encode()
        return await client.post(URL, content=content, headers=hdrs)


async def chat(app: Any, payload: Any) -> list[tuple[str, dict[str, Any]]]:
    resp = await post(app, payload)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    return parse_sse(resp.text)


# ------------------------------------------------------------------ the stream


async def test_tool_round_then_answer():
    app = make_app([Reply(tool_calls=[call("add", a=2, b=3)], input_tokens=7, output_tokens=2), "The sum is 5."])
    events = await chat(app, body(u("What is 2+3?")))
    names = [n for n, _ in events]
    assert names[0] == "tool-call" and names[1] == "tool-result"
    assert set(names[2:-1]) == {"text-delta"} and names[-1] == "done"
    call_ev, result_ev = events[0][1], events[1][1]
    assert call_ev["name"] == "add" and call_ev["arguments"] == {"a": 2, "b": 3}
    assert result_ev == {"id": call_ev["id"], "output": "5"}
    assert "".join(d["content"] for n, d in events if n == "text-delta") == "The sum is 5."
    assert events[-1][1] == {"finish_reason": "stop", "usage": {"prompt_tokens": 17, "completion_tokens": 7}}


async def test_tool_failure_is_reported_and_the_stream_goes_on():
    app = make_app([Reply(tool_calls=[call("explode", reason="x")]), "It failed, sorry."])
    events = await chat(app, body(u("try")))
    result = next(d for n, d in events if n == "tool-result")
    assert "error" in result and "output" not in result and "tool broke" in result["error"]
    assert events[-1][0] == "done" and events[-1][1]["finish_reason"] == "stop"
    assert [n for n, _ in events].count("text-delta") >= 1


async def test_a_tool_the_model_cannot_get_past_ends_the_stream_with_tool_error():
    # the model repeats the same failing call; the third identical failure ends the stream, and
    # the run is stopped (the fourth scripted call is never made)
    asked: list[int] = []

    async def script(request: Any) -> Any:
        asked.append(1)
        await asyncio.sleep(0.001)  # a provider waits on its network; this gives the stream a turn
        if len(asked) > 10:  # a bound, so a broken stop fails the test instead of looping forever
            return "still going"
        return Reply(tool_calls=[call("explode", reason="disk at /srv/data full")])

    app = make_app(script)
    events = await chat(app, body(u("try hard")))
    names = [n for n, _ in events]
    assert names.count("tool-result") == 3 and names.count("error") == 1 and "done" not in names
    assert names[-1] == "error"
    code, message = events[-1][1]["code"], events[-1][1]["message"]
    assert code == "tool_error" and "explode" in message and "/srv/data" not in message
    assert len(asked) <= 4  # the run was stopped: at most the next model call had started


async def test_different_failures_are_left_to_the_model():
    # failures that differ in arguments are the model trying things: they never end the stream
    script = [Reply(tool_calls=[call("explode", reason=str(i))]) for i in range(4)] + ["giving up"]
    events = await chat(make_app(script), body(u("try")))
    assert [n for n, _ in events].count("tool-result") == 4
    assert events[-1][0] == "done"


async def test_unknown_tool_still_gets_a_tool_call_before_its_result():
    app = make_app([Reply(tool_calls=[call("nope", q=1)]), "ok"])
    events = await chat(app, body(u("go")))
    names = [n for n, _ in events]
    assert names.index("tool-call") < names.index("tool-result")
    assert next(d for n, d in events if n == "tool-result").get("error")


async def test_guard_stop_is_the_finish_reason():
    def factory() -> Agent:
        script = [Reply(tool_calls=[call("add", a=1, b=1)]) for _ in range(5)] + ["done"]
        return Agent(ScriptedModel(script), tools=[add], max_rounds=1)

    app = create_app(factory, tokens={TOKEN})
    events = await chat(app, body(u("loop")))
    assert events[-1][0] == "done" and events[-1][1]["finish_reason"] == "max_rounds"


async def test_provider_error_is_an_error_event_safe_for_display():
    err = ProviderError(
        "upstream 500 at https://api.x/v1?key=abc from /srv/app/secret.py sk-abcdef1234567890", "server"
    )
    app = make_app([err])
    events = await chat(app, body(u("hi")))
    assert [n for n, _ in events] == ["error"]
    data = events[0][1]
    assert data["code"] == "provider_error"
    for leak in ("https://", "/srv/app", "sk-abcdef", "key=abc", "Traceback"):
        assert leak not in data["message"]


async def test_overflow_is_context_overflow():
    app = make_app([ProviderError("prompt is too long: 300000 tokens > 200000 maximum", "overflow")])
    events = await chat(app, body(u("a" * 1000)))
    assert events == [("error", {"code": "context_overflow", "message": events[0][1]["message"]})]
    assert events[0][1]["message"]


async def test_multi_turn_history_with_tool_calls():
    seen: list[Any] = []

    def script(request: Any) -> str:
        seen.append(request)
        return "Noted."

    app = make_app(script)
    history = body(
        {"role": "system", "content": "Read /AGENT.md for your instructions."},
        u("Add 1 and 2"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "assistant", "content": "It is 3."},
        u("Thanks"),
        conversation_id="conv-9",
        trigger="message",
        client_context={"path": "/finances"},
    )
    events = await chat(app, history)
    assert events[-1][0] == "done"
    req = seen[0]
    assert req.system_prompt.startswith("Read /AGENT.md")
    roles = [m.role for m in req.messages]
    assert roles == ["user", "assistant", "toolResult", "assistant", "user"]
    assert req.messages[1].tool_calls[0].arguments == {"a": 1, "b": 2}
    assert req.messages[2].tool_name == "add" and req.messages[2].text == "3"


async def test_history_ending_in_a_tool_result_continues():
    app = make_app(["The answer is 3."])
    payload = body(
        u("Add 1 and 2"),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "function": {"name": "add", "arguments": {}}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    )
    events = await chat(app, payload)
    assert events[-1] == ("done", events[-1][1]) and events[-1][1]["finish_reason"] == "stop"


# ------------------------------------------------------------------ before the stream


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"messages": [u("hi")], "metadata": {}}, "metadata.correlation_id"),
        ({"messages": [u("hi")], "metadata": {"correlation_id": ""}}, "metadata.correlation_id"),
        ({"messages": [u("hi")]}, "metadata"),
        ({"metadata": {"correlation_id": "c"}}, "messages"),
        (body(), "messages"),
        (body({"role": "robot", "content": "x"}), "messages[0].role"),
        (body({"role": "user", "content": 5}), "messages[0].content"),
        (body({"role": "user"}), "messages[0].content"),
        (body(u("hi"), trigger="cron"), "metadata.trigger"),
        (body(u("hi"), {"role": "assistant", "content": "x"}), "messages"),
        (body({"role": "tool", "tool_call_id": "zz", "content": "x"}), "messages[0].tool_call_id"),
        (
            body(
                u("x"),
                {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "function": {"name": "add"}}]},
                u("y"),
            ),
            "messages[1].tool_calls[0]",
        ),
        (
            body(
                u("x"),
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "a", "function": {"name": "add", "arguments": "{not json"}}],
                },
                {"role": "tool", "tool_call_id": "a", "content": "1"},
            ),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            body(
                u("x"),
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "a", "function": {"name": "add", "arguments": "[" * 100_000 + "]" * 100_000}}
                    ],
                },
                {"role": "tool", "tool_call_id": "a", "content": "1"},
            ),
            "messages[1].tool_calls[0].function.arguments",  # nested deeper than the parser goes
        ),
        ([1, 2], "body"),
    ],
)
async def test_invalid_request_names_the_field(payload: Any, field: str):
    resp = await post(make_app(["unused"]), payload)
    assert resp.status_code == 400
    data = resp.json()
    assert data["code"] == "invalid_request"
    assert data["message"].startswith(f"{field}:"), data["message"]


async def test_missing_correlation_id_message():
    resp = await post(make_app(["x"]), {"messages": [u("hi")], "metadata": {}})
    assert resp.json()["message"] == "metadata.correlation_id: field required"


@pytest.mark.parametrize(
    ("raw", "content_type"),
    [(b"{not json", "application/json"), (b"", "application/json"), (b'{"a":1}', "text/plain"), (b"\xff\xfe", None)],
)
async def test_non_json_body_or_wrong_content_type_is_400(raw: bytes, content_type: str | None):
    headers = dict(AUTH)
    if content_type:
        headers["content-type"] = content_type
    resp = await post(make_app(["x"]), None, headers=headers, raw=raw)
    assert resp.status_code == 400 and resp.json()["code"] == "invalid_request"


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": "Bearer "},
        {"Authorization": TOKEN},
    ],
)
async def test_unauthorized(headers: dict[str, str]):
    resp = await post(make_app(["x"]), body(u("hi")), headers={"content-type": "application/json", **headers})
    assert resp.status_code == 401
    assert resp.json()["code"] == "unauthorized"


async def test_token_function_and_second_token():
    app = create_app(lambda: Agent(ScriptedModel(["ok"])), tokens=lambda t: t == "fn-token")
    resp = await post(
        app, body(u("hi")), headers={"content-type": "application/json", "Authorization": "Bearer fn-token"}
    )
    assert resp.status_code == 200
    resp = await post(make_app(["ok"]), body(u("hi")), headers={"content-type": "application/json", **AUTH})
    assert resp.status_code == 200


async def test_oversized_body_is_413():
    app = make_app(["x"], max_body=2048)
    resp = await post(app, body(u("a" * 5000)))
    assert resp.status_code == 413 and resp.json()["code"] == "payload_too_large"


async def test_agent_factory_failure_is_503():
    def broken() -> Agent:
        raise RuntimeError("no model configured at /etc/agent.toml")

    resp = await post(create_app(broken, tokens={TOKEN}), body(u("hi")))
    assert resp.status_code == 503
    assert resp.json()["code"] == "engine_unavailable" and "/etc" not in resp.json()["message"]


# ------------------------------------------------------------------ logs


async def test_logs_carry_correlation_id_and_never_the_token(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG, logger="agentloop.server")
    app = make_app([ProviderError("boom", "auth")])
    await chat(app, body(u("hi"), cid="trace-42"))
    await post(
        app, body(u("hi"), cid="trace-43"), headers={"content-type": "application/json", "Authorization": "Bearer nope"}
    )
    await post(app, {"messages": [], "metadata": {"correlation_id": "trace-44"}})
    records = [r for r in caplog.records if r.name == "agentloop.server"]
    lines = [json.loads(r.getMessage()) for r in records]
    started = [x for x in lines if x["message"] == "request started"]
    finished = [x for x in lines if x["message"] == "request finished"]
    assert started[0]["correlation_id"] == "trace-42" and finished[0]["correlation_id"] == "trace-42"
    assert finished[0]["outcome"] == "provider_error"
    assert any(getattr(r, "correlation_id", None) == "trace-42" for r in records)
    assert any(x["correlation_id"] == "trace-44" and x["message"] == "request rejected" for x in lines)
    assert all({"timestamp", "level", "component", "message", "correlation_id"} <= x.keys() for x in lines)
    assert TOKEN not in caplog.text and "nope" not in caplog.text


def test_safe_message_strips_what_must_not_be_shown():
    text = "Error: bad key sk-ant-api03-XYZXYZXYZXYZ at /home/u/app/models.py\nTraceback (most recent call last):"
    out = safe_message(text, "fallback")
    assert "sk-ant" not in out and "/home/u" not in out and "Traceback" not in out
    assert safe_message("Traceback (most recent call last):\n  File x", "fallback") == "fallback"
    assert safe_message("", "fallback") == "fallback"


# ------------------------------------------------------------------ a real server: streaming and disconnect


@asynccontextmanager
async def served(app: Any) -> AsyncIterator[str]:
    """``app`` on a real uvicorn server (a client that goes away is a closed socket, not a
    cancelled ASGI call); its base URL."""
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serve = asyncio.create_task(server.serve())
    try:
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.01)
        assert server.started
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(serve, 10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_real_server_streams_and_a_disconnect_aborts_the_run(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="agentloop.server")
    tool_started = asyncio.Event()
    tool_cancelled = asyncio.Event()

    @tool
    async def slow(seconds: float) -> str:
        """Sleeps."""
        tool_started.set()
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            tool_cancelled.set()
            raise
        return "slept"

    def factory() -> Agent:
        script = [Reply(text="Working on it. ", tool_calls=[call("slow", seconds=30)]), "done"]
        return Agent(ScriptedModel(script, chunk=4), tools=[slow], tool_timeout=None)

    async with served(create_app(factory, tokens={TOKEN})) as base:
        received: list[str] = []
        async with (
            httpx.AsyncClient(base_url=base, timeout=5) as client,
            client.stream("POST", URL, json=body(u("sleep")), headers=AUTH) as resp,
        ):
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("event:"):
                    received.append(line[6:].strip())
                if "tool-call" in received:
                    break
        # Streaming: the text and the tool call arrived while the tool was still running.
        assert received[0] == "text-delta" and received[-1] == "tool-call"
        await asyncio.wait_for(tool_started.wait(), 5)
        await asyncio.wait_for(tool_cancelled.wait(), 5)
        for _ in range(100):
            if "client_disconnected" in caplog.text:
                break
            await asyncio.sleep(0.02)
        assert '"outcome": "client_disconnected"' in caplog.text


# ------------------------------------------------------------------ no body makes a 500

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=12,
)
_role = st.sampled_from(["system", "user", "assistant", "tool", "robot"]) | _json
_message = st.fixed_dictionaries(
    {"role": _role},
    optional={
        "content": st.text(max_size=10) | _json,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "id": st.sampled_from(["a", "b", ""]) | _json,
                    "function": st.fixed_dictionaries(
                        {}, optional={"name": st.sampled_from(["add", "nope"]) | _json, "arguments": _json}
                    )
                    | _json,
                },
            ),
            max_size=2,
        )
        | _json,
        "tool_call_id": st.sampled_from(["a", "b"]) | _json,
    },
)
_metadata = st.fixed_dictionaries(
    {},
    optional={
        "correlation_id": st.text(max_size=5) | _json,
        "trigger": st.sampled_from(["message", "webhook", "schedule", "x"]) | _json,
        "client_context": _json,
        "conversation_id": _json,
    },
)
# Mostly valid conversations (so the stream path is exercised too), some of them broken by a mutation.
_tool_round = st.builds(
    lambda cid, args: [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": cid, "function": {"name": "add", "arguments": args}}],
        },
        {"role": "tool", "tool_call_id": cid, "content": "3"},
    ],
    st.sampled_from(["c1", "c2"]),
    st.sampled_from(['{"a":1,"b":2}', "{}", "", "[1]", "nope"]) | _json,
)
_turn = st.one_of(
    st.builds(lambda t: [{"role": "user", "content": t}], st.text(max_size=10)),
    st.builds(lambda t: [{"role": "system", "content": t}], st.text(max_size=10)),
    st.builds(lambda t: [{"role": "assistant", "content": t}], st.text(max_size=10)),
    _tool_round,
)
_conversation = st.builds(
    lambda turns, last, cid: {
        "messages": [m for turn in turns for m in turn] + last,
        "metadata": {"correlation_id": cid},
    },
    st.lists(_turn, max_size=4),
    st.sampled_from([[{"role": "user", "content": "go"}], []]),
    st.sampled_from(["c", "corr-1"]) | st.text(max_size=3),
)
_bodies = (
    _conversation.map(lambda v: json.dumps(v).encode())
    | _json.map(lambda v: json.dumps(v).encode())
    | st.fixed_dictionaries(
        {}, optional={"messages": st.lists(_message, max_size=4) | _json, "metadata": _metadata}
    ).map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=20)
)


def test_random_bodies_never_give_a_500():
    app = make_app(lambda request: Reply(text="ok"))
    statuses: Counter[int] = Counter()
    with TestClient(app) as client:

        @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(raw=_bodies)
        def check(raw: bytes) -> None:
            resp = client.post(URL, content=raw, headers={"content-type": "application/json", **AUTH})
            assert resp.status_code in (200, 400), resp.text
            statuses[resp.status_code] += 1
            if resp.status_code == 400:
                assert resp.json()["code"] == "invalid_request"
            else:
                events = parse_sse(resp.text)
                assert events[-1][0] in ("done", "error")

        check()
    assert statuses[200] > 0 and statuses[400] > 0, statuses
