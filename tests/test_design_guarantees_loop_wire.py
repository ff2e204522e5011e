"""DESIGN §2 (the loop), §4 (syscalls, devices) and §5 (wire contracts): guarantees that had no
test that would fail if they broke. Each test's docstring names the guarantee it pins.

Most of §2 is pinned for the in-memory runner in ``test_loop.py``; "one logic, two runners" means
the durable runner must keep the same promises, so several tests here run the same scenario in a
durable process.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from agentloop import (
    Agent,
    AssistantMessage,
    Block,
    Hooks,
    Reply,
    RetryPolicy,
    ScriptedModel,
    SystemMessage,
    ToolResult,
    ToolResultMessage,
    TurnInfo,
    call,
    tool,
)
from agentloop.kernel import Kernel
from agentloop.loop.hooks import ToolCallInfo
from agentloop.messages import Message
from agentloop.models.base import ModelInfo, ModelRequest, ProviderError
from agentloop.tools.builtin import builtin_tools, syscall_of
from tests.process_support import echo, kernel


async def _durable_run(k: Kernel, text: str = "go") -> tuple[list[Message], list[dict[str, Any]]]:
    """Send ``text`` to a new process, wait for its run to end; its history and its
    ``proc.run.finished`` payloads."""
    proc = await k.spawn(owner="alice")
    await proc.send(text)
    await asyncio.wait_for(proc.wait_idle(), 10)
    finished = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.run.finished"]
    return await proc.messages(), finished


# ------------------------------------------------------------------ §2 provider failures


async def test_a_durable_run_whose_models_all_fail_ends_as_error_with_a_reason_and_a_visible_message(
    tmp_path: Path,
) -> None:
    """§2 provider failures: once retries and the fallback models are used up, the run finishes
    with status ``error``, a reason, and a system message in the history that says so; in a
    durable process as in the library."""
    primary = ScriptedModel([ProviderError("primary key revoked", kind="auth")] * 3)
    backup = ScriptedModel(
        [ProviderError("backup key revoked", kind="auth")] * 3, info=ModelInfo(provider="scripted", id="backup")
    )
    retry = RetryPolicy(max_retries=1, base_delay=0.001)
    async with kernel(tmp_path, primary, fallbacks=[backup], retry=retry) as k:
        messages, finished = await _durable_run(k)
    assert primary.calls == 1 and backup.calls == 1  # not transient: no retry, then the fallback
    assert len(finished) == 1
    assert finished[0]["status"] == "error" and finished[0]["reason"] == "generation.error"
    assert "backup key revoked" in finished[0]["error"]
    notice = messages[-1]
    assert isinstance(notice, SystemMessage) and notice.kind == "error" and "backup key revoked" in notice.text


# ------------------------------------------------------------------ §2 hooks in both runners


def _flip_hooks() -> Hooks:
    """After-tool-call hooks that turn a failure into a success and a success into a failure."""
    hooks = Hooks()

    @hooks.after_tool_call
    def flip(info: ToolCallInfo, result: ToolResult) -> ToolResult:
        if result.is_error:
            return ToolResult.text("recovered by the hook")
        return ToolResult.error("rejected by the hook")

    return hooks


@tool
def explode() -> str:
    """Always fails."""
    raise RuntimeError("kaboom")


def _flip_model() -> ScriptedModel:
    return ScriptedModel([Reply(tool_calls=[call("explode"), call("echo", text="fine")]), "ok"])


def _assert_flipped(results: list[ToolResultMessage], request: ModelRequest) -> None:
    assert [(r.is_error, r.text) for r in results] == [(False, "recovered by the hook"), (True, "rejected by the hook")]
    sent = [m for m in request.messages if isinstance(m, ToolResultMessage)]
    assert [(r.is_error, r.text) for r in sent] == [(False, "recovered by the hook"), (True, "rejected by the hook")]


async def test_an_after_tool_call_hook_may_replace_is_error_in_memory() -> None:
    """§2 hooks: an after-tool-call hook may replace a result's content *and* its isError flag,
    and the model sees what the hook returned."""
    model = _flip_model()
    agent = Agent(model=model, tools=[echo, explode])
    agent.config.hooks = _flip_hooks()
    result = await agent.run("go")
    _assert_flipped([m for m in result.messages if isinstance(m, ToolResultMessage)], model.requests[1])


async def test_an_after_tool_call_hook_may_replace_is_error_in_a_durable_process(tmp_path: Path) -> None:
    """§2 hooks, durable runner: the after-tool-call hook's content and isError are what is
    stored and what the model reads next."""
    model = _flip_model()
    async with kernel(tmp_path, model, tools=[echo, explode], hooks=_flip_hooks()) as k:
        messages, _ = await _durable_run(k)
    _assert_flipped([m for m in messages if isinstance(m, ToolResultMessage)], model.requests[1])


async def test_transform_context_runs_before_each_durable_model_call_and_keeps_the_history(tmp_path: Path) -> None:
    """§2 hooks, durable runner: transform-context shapes what every model call sees, and the
    stored history stays whole."""
    hooks = Hooks()
    seen: list[int] = []

    @hooks.transform_context
    def last_two(messages: list[Message]) -> list[Message]:
        seen.append(len(messages))
        return messages[-2:]

    model = ScriptedModel([Reply(tool_calls=[call("echo", text="x")]), "done"])
    async with kernel(tmp_path, model, hooks=hooks) as k:
        messages, _ = await _durable_run(k)
    assert len(seen) == 2  # before each of the two model calls
    assert [len(r.messages) for r in model.requests] == [1, 2]
    assert [m.role for m in model.requests[1].messages] == ["assistant", "toolResult"]
    assert [m.role for m in messages] == ["user", "assistant", "toolResult", "assistant"]


async def test_a_policy_phase_block_fails_a_durable_run_visibly_and_a_context_phase_failure_does_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """§2 hooks, durable runner: a hook that blocks or fails in a policy phase fails the turn
    (the run ends as error, visibly); one that fails in a context phase is left out and the turn
    goes on."""
    closed = Hooks()

    @closed.on("pre_policy")
    def office_hours(info: TurnInfo) -> Block:
        return Block("outside office hours")

    model = ScriptedModel(["never"])
    async with kernel(tmp_path / "a", model, hooks=closed) as k:
        messages, finished = await _durable_run(k)
    assert model.calls == 0
    assert finished[0]["status"] == "error" and "outside office hours" in finished[0]["error"]
    assert isinstance(messages[-1], SystemMessage) and "outside office hours" in messages[-1].text

    flaky = Hooks()

    @flaky.on("pre_prompt_context")
    def memory(info: TurnInfo) -> str:
        raise RuntimeError("memory service down")

    with caplog.at_level(logging.WARNING, logger="agentloop.hooks"):
        async with kernel(tmp_path / "b", ScriptedModel(["fine"]), hooks=flaky) as k:
            messages, finished = await _durable_run(k)
    assert finished[0]["status"] == "ok" and messages[-1].text == "fine"
    assert "memory service down" in caplog.text


async def test_text_with_tool_calls_is_kept_and_results_reach_the_model_unmodified_in_a_durable_process(
    tmp_path: Path,
) -> None:
    """§2, durable runner: words that come with tool calls stay in the stored assistant message
    and are sent back; a tool's result reaches the model exactly as the tool returned it."""
    payload = "  <b>raw</b>\n\twith whitespace  "

    @tool
    def raw() -> str:
        """Raw."""
        return payload

    model = ScriptedModel([Reply(text="Let me check.", tool_calls=[call("raw")]), "ok"])
    async with kernel(tmp_path, model, tools=[raw]) as k:
        messages, _ = await _durable_run(k)
    stored = messages[1]
    assert isinstance(stored, AssistantMessage) and stored.text == "Let me check." and stored.tool_calls
    sent = model.requests[1].messages
    assert isinstance(sent[1], AssistantMessage) and sent[1].text == "Let me check." and sent[1].tool_calls
    assert sent[-1].text == payload


# ------------------------------------------------------------------ §2 timeouts


def test_the_default_tool_timeout_is_60_seconds() -> None:
    """§2 timeouts: every tool without its own timeout is held to 60 s by default, in the library
    and in durable processes (which share ``LoopConfig``)."""
    from agentloop.loop.state import LoopConfig

    assert Agent(model=ScriptedModel([])).config.tool_timeout == 60.0
    assert LoopConfig(model=ScriptedModel([])).tool_timeout == 60.0


# ------------------------------------------------------------------ §4 syscalls


def test_the_built_in_tools_map_to_their_syscalls(tmp_path: Path) -> None:
    """§4: the model-visible built-ins map to syscalls Read→fs.read, Write→fs.write,
    Edit→fs.edit, Delete→fs.delete, Search→fs.search, Shell→shell.exec, Fetch→net.fetch,
    CodeMode→codemode.exec (what approval policies and devices are matched against)."""
    tools = {t.name: t for t in builtin_tools(tmp_path, codemode=True)}
    assert {name: syscall_of(t) for name, t in tools.items()} == {
        "Read": "fs.read",
        "Write": "fs.write",
        "Edit": "fs.edit",
        "Delete": "fs.delete",
        "Search": "fs.search",
        "Shell": "shell.exec",
        "Fetch": "net.fetch",
        "CodeMode": "codemode.exec",
    }


# ------------------------------------------------------------------ §2 revealed tools


async def test_a_revealed_tool_stays_visible_when_transform_context_trims_the_history() -> None:
    """§2 modes: ``request_tools`` reveals tools for the next round and a visible tool is never
    taken away mid-run; a transform-context hook that sends the model only the newest messages
    (and so not the ``request_tools`` result) does not hide a tool revealed earlier."""
    from agentloop.loop.reveal import ToolReveal

    @tool
    def weather(city: str) -> str:
        """Tell the weather in a city."""
        return f"sunny in {city}"

    model = ScriptedModel(
        [
            Reply(tool_calls=[call("request_tools", names=["weather"])]),
            Reply(tool_calls=[call("echo", text="thinking")]),
            Reply(tool_calls=[call("weather", city="Oslo")]),
            "It is sunny.",
        ]
    )
    agent = Agent(model=model, tools=[echo]).use(ToolReveal(hidden=[weather]))

    @agent.hooks.transform_context
    def newest(messages: list[Message]) -> list[Message]:
        return messages[-2:]

    result = await agent.run("weather in Oslo?")
    assert ["weather" in {t.name for t in r.tools} for r in model.requests] == [False, True, True, True]
    answer = [m for m in result.messages if isinstance(m, ToolResultMessage)][-1]
    assert not answer.is_error and answer.text == "sunny in Oslo"


# ------------------------------------------------------------------ §5 /engine/chat errors before the stream


async def _engine_chat_post(app: Any, headers: dict[str, str]) -> Any:
    import httpx

    payload = {"messages": [{"role": "user", "content": "hi"}], "metadata": {"correlation_id": "c-1"}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.post("/engine/chat", json=payload, headers=headers)


async def test_engine_chat_answers_401_and_503_with_code_and_message() -> None:
    """§5: errors before the /engine/chat stream are 400 / 401 / 503 with a JSON ``{code,
    message}``: a missing token is 401, and a token check that cannot be made (the credential
    store is down) is 503, not a 401 that would make a gateway drop a good token, nor a 500."""
    from agentloop.server import create_app

    def store_down(token: str) -> bool:
        raise ConnectionError("credential store at 10.0.0.5 unreachable")

    ok_app = create_app(lambda: Agent(ScriptedModel(["ok"])), tokens={"good-token"})
    missing = await _engine_chat_post(ok_app, {})
    assert missing.status_code == 401
    assert set(missing.json()) == {"code", "message"} and missing.json()["code"] == "unauthorized"
    assert missing.json()["message"]

    down_app = create_app(lambda: Agent(ScriptedModel(["ok"])), tokens=store_down)
    down = await _engine_chat_post(down_app, {"Authorization": "Bearer good-token"})
    assert down.status_code == 503
    assert set(down.json()) == {"code", "message"} and down.json()["code"] == "engine_unavailable"
    assert "10.0.0.5" not in down.json()["message"]


# ------------------------------------------------------------------ §2 provider stream events


class _Adapter:
    """Builds models whose adapter misbehaves in a given way (``how``)."""

    @staticmethod
    def make(how: str) -> Any:
        from collections.abc import AsyncGenerator

        from agentloop.events import StreamEvent
        from agentloop.models.base import AssistantBuilder, Model

        class Misbehaving(Model):
            def __init__(self) -> None:
                self.info = ModelInfo(provider="fake", id=how)

            async def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
                yield out.start()
                for event in out.text("half an answer"):
                    yield event
                if how == "trails":  # a done, then more events and another done
                    for event in out.finish():
                        yield event
                    for event in out.text(" and more"):
                        yield event
                    for event in out.finish():
                        yield event
                elif how == "raises":
                    raise RuntimeError("socket reset")
                # "stops": the stream just ends, with neither done nor error

        return Misbehaving()


@pytest.mark.parametrize("how", ["stops", "trails", "raises"])
async def test_a_provider_stream_always_ends_with_exactly_one_done_or_error(how: str) -> None:
    """§2 vocabulary: a provider stream is ``start``, block events, then exactly one ``done`` or
    ``error``, whatever the adapter does (ends early, keeps going after done, raises): providers
    never raise into the loop."""
    from agentloop.events import StreamDone, StreamError, StreamStart

    model = _Adapter.make(how)
    events = [e async for e in model.stream(ModelRequest(system_prompt="", messages=[]))]
    terminal = [e for e in events if isinstance(e, StreamDone | StreamError)]
    assert isinstance(events[0], StreamStart) and len(terminal) == 1 and events[-1] is terminal[0]
    if how == "trails":
        assert isinstance(terminal[0], StreamDone) and terminal[0].message.text == "half an answer"
    else:
        assert isinstance(terminal[0], StreamError) and terminal[0].message.stop_reason == "error"


async def test_a_durable_run_finishes_on_stop_reason_length(tmp_path: Path) -> None:
    """§2 decisions: an answer cut by the output limit (stop reason ``length``) finishes the run
    (status ok, reason ``length``) without another model call, in a durable process as in the
    library."""
    from agentloop.messages import TextContent

    cut = AssistantMessage(content=[TextContent(text="truncat")], stop_reason="length")
    model = ScriptedModel([cut, "never asked"])
    async with kernel(tmp_path, model) as k:
        messages, finished = await _durable_run(k)
        assert [(f["status"], f["reason"]) for f in finished] == [("ok", "length")]
        assert messages[-1].text == "truncat" and model.calls == 1


# ------------------------------------------------------------------ §2 replay hygiene


def test_normalised_tool_call_ids_stay_distinct() -> None:
    """§2 replay hygiene: tool call ids are normalised per provider without changing what they
    pair up: two calls whose ids differ only in characters the provider refuses (or past its
    length limit) keep distinct ids, each result still answering its own call."""
    from agentloop.messages import TextContent, ToolCall, user
    from agentloop.models.replay import clean_history, safe_tool_id

    ids = ["call|1", "call/1", "x" * 70 + "a", "x" * 70 + "b"]
    history: list[Message] = [
        user("go"),
        AssistantMessage(content=[ToolCall(id=i, name="t", arguments={}) for i in ids], stop_reason="toolUse"),
        *(ToolResultMessage(tool_call_id=i, tool_name="t", content=[TextContent(text=f"result of {i}")]) for i in ids),
    ]
    out = clean_history(history, lambda i: safe_tool_id(i, 64))
    sent = out[1]
    assert isinstance(sent, AssistantMessage)
    new_ids = [c.id for c in sent.tool_calls]
    assert len(set(new_ids)) == len(ids)
    assert all(len(i) <= 64 and all(c.isalnum() or c in "_-" for c in i) for i in new_ids)
    results = [m for m in out if isinstance(m, ToolResultMessage)]
    assert [(r.tool_call_id, r.text) for r in results] == [
        (n, f"result of {o}") for n, o in zip(new_ids, ids, strict=True)
    ]
