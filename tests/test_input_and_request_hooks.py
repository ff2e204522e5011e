"""Input hooks (input before it is admitted: rewritten, handled, or refused) in memory and in a
durable process, and provider-request hooks (the payload an adapter sends) on the wire."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop import Agent, Reply, call
from agentloop.events import AgentEnd
from agentloop.loop.hooks import Handled, Hooks, InputInfo, InputRejected, Rewrite
from agentloop.messages import ImageContent, UserMessage, user
from agentloop.models.anthropic import AnthropicModel
from agentloop.models.base import ModelRequest, ProviderRequest
from agentloop.models.openai_chat import OpenAIChatModel
from agentloop.models.scripted import ScriptedModel
from agentloop.process.store import StoreError
from tests.fakes.anthropic_server import AnthropicFake
from tests.fakes.anthropic_server import text_reply as anthropic_text
from tests.fakes.openai_server import OpenAIFake
from tests.fakes.openai_server import text_reply as openai_text
from tests.image_support import png
from tests.process_support import kernel

pytestmark = pytest.mark.filterwarnings("ignore:The model .* is deprecated:DeprecationWarning")

IMAGE = ImageContent(data=base64.b64encode(png()).decode(), mime_type="image/png")


def users(request: ModelRequest) -> list[str]:
    return [m.text for m in request.messages if isinstance(m, UserMessage)]


def expanding(seen: list[InputInfo]) -> Hooks:
    """Hooks whose input hook expands ``/greet NAME`` and masks ``sk-`` keys, noting what it saw."""
    hooks = Hooks()

    @hooks.on_input
    def expand(info: InputInfo) -> Rewrite | None:
        seen.append(info)
        if info.text.startswith("/greet "):
            return Rewrite(f"Say hello to {info.text.removeprefix('/greet ')}.")
        if "sk-" in info.text:
            return Rewrite(" ".join("sk-***" if w.startswith("sk-") else w for w in info.text.split()))
        return None

    return hooks


# ------------------------------------------------------------------ input hooks, in memory


async def test_agent_run_sends_the_rewritten_prompt_and_keeps_it() -> None:
    seen: list[InputInfo] = []
    model = ScriptedModel(["hello Bob"])
    agent = Agent(model=model, hooks=expanding(seen))
    result = await agent.run("/greet Bob")
    assert users(model.requests[0]) == ["Say hello to Bob."]
    assert [m.text for m in result.messages if isinstance(m, UserMessage)] == ["Say hello to Bob."]
    assert (seen[0].text, seen[0].mode, seen[0].source, seen[0].media) == ("/greet Bob", "prompt", "agent.run", ())


async def test_a_rewrite_keeps_or_replaces_the_media() -> None:
    hooks = Hooks()
    texts = iter(["first", "second"])

    @hooks.on_input
    async def rewrite(info: InputInfo) -> Rewrite:
        assert info.media == (IMAGE,)
        text = next(texts)
        return Rewrite(text) if text == "first" else Rewrite(text, media=())

    model = ScriptedModel(["a", "b"])
    agent = Agent(model=model, hooks=hooks)
    await agent.run(user("look", IMAGE))
    await agent.run(user("look", IMAGE))
    first, second = (r.messages[-1] for r in model.requests)
    assert isinstance(first, UserMessage) and first.text == "first" and first.content[1:] == [IMAGE]
    assert isinstance(second, UserMessage) and second.text == "second" and len(second.content) == 1


async def test_handled_input_starts_no_run_in_memory() -> None:
    hooks = Hooks()
    hooks.on_input(lambda info: Handled("a slash command") if info.text.startswith("/") else None)
    model = ScriptedModel(["answer"])
    agent = Agent(model=model, hooks=hooks)
    history = [user("earlier")]
    result = await agent.run("/help", history=history)
    events = [e async for e in agent.stream("/help")]
    assert (result.stop_reason, result.run_id, result.new_messages, result.messages) == ("handled", "", [], history)
    assert len(events) == 1 and isinstance(events[0], AgentEnd) and events[0].stop_reason == "handled"
    assert model.requests == []
    assert (await agent.run("not a command")).text == "answer"  # other input runs as ever


async def test_a_failing_or_late_input_hook_refuses_the_input_in_memory() -> None:
    model = ScriptedModel(["never"])
    failing = Hooks()

    @failing.on_input
    def broken(info: InputInfo) -> None:
        raise RuntimeError("policy service down")

    with pytest.raises(InputRejected, match=r"input hook .*broken failed: policy service down"):
        await Agent(model=model, hooks=failing).run("hi")
    late = Hooks(timeout=0.02)

    @late.on_input
    async def hangs(info: InputInfo) -> None:
        await asyncio.sleep(5)

    with pytest.raises(InputRejected, match=r"hangs .*timed out after 0.02 s"):
        await Agent(model=model, hooks=late).run("hi")
    odd = Hooks()
    odd.on_input(lambda info: "just a string")
    with pytest.raises(InputRejected, match="returned str: return None, a Rewrite or Handled"):
        await Agent(model=model, hooks=odd).run("hi")
    assert model.requests == []
    with pytest.raises(TypeError, match=r"Rewrite\.media"):
        Rewrite("x", media=("not media",))  # type: ignore[arg-type]


async def test_conversation_sends_pass_the_hook_and_handled_ones_leave_the_history() -> None:
    seen: list[InputInfo] = []
    hooks = expanding(seen)
    hooks.on_input(lambda info: Handled() if info.text == "/clear-screen" else None)
    model = ScriptedModel(["ok", "ok again"])
    conv = Agent(model=model, hooks=hooks).conversation()
    await conv.send("my key is sk-secret")
    before = conv.messages
    handled = await conv.send("/clear-screen")
    streamed = [e async for e in conv.stream("/greet Ann")]
    assert conv.messages[0] == before[0] and isinstance(before[0], UserMessage)
    assert before[0].text == "my key is sk-***"
    assert handled.stop_reason == "handled" and handled.messages == list(before)
    assert isinstance(streamed[-1], AgentEnd) and streamed[-1].stop_reason == "stop"
    assert users(model.requests[1]) == ["my key is sk-***", "Say hello to Ann."]
    assert [(i.source, i.mode) for i in seen] == [
        ("conversation.send", "prompt"),
        ("conversation.send", "prompt"),
        ("conversation.stream", "prompt"),
    ]


# ------------------------------------------------------------------ input hooks, durable


async def test_process_send_admits_the_rewritten_input(tmp_path: Path) -> None:
    seen: list[InputInfo] = []
    model = ScriptedModel(lambda request: "noted")
    async with kernel(tmp_path, model, hooks=expanding(seen)) as k:
        proc = await k.spawn(owner="alice")
        receipt = await proc.send("use sk-live-123 please", mode="queue", run_id="r1")
        await proc.wait_idle()
        stored = [m.text for m in await proc.messages() if isinstance(m, UserMessage)]
    assert stored == ["use sk-*** please"] and users(model.requests[0]) == ["use sk-*** please"]
    assert receipt.run_id == "r1" and not receipt.handled
    info = seen[-1]
    assert (info.mode, info.source, info.run_id, info.conversation) == ("queue", "process.send", "r1", proc.pid)


async def test_process_send_handled_writes_nothing_and_says_so(tmp_path: Path) -> None:
    calls: list[str | None] = []
    hooks = Hooks()

    @hooks.on_input
    def route(info: InputInfo) -> Handled:
        calls.append(info.run_id)
        return Handled("sent to the ticket system")

    model = ScriptedModel(lambda request: "never")
    async with kernel(tmp_path, model, hooks=hooks) as k:
        proc = await k.spawn(owner="alice")
        receipt = await proc.send("open a ticket", run_id="t1")
        again = await proc.send("open a ticket", run_id="t1")  # nothing remembered: the hook is asked again
        anonymous = await proc.send("and another")
        record = await k.store.get_process(proc.pid)
        state = (await proc.messages(), await proc.queued(), await k.store.kv_get(proc.pid, "admitted:t1"))
    assert receipt.handled and receipt.run_id == "t1" and not receipt.queued
    assert again == receipt and anonymous.handled and anonymous.run_id == ""
    assert calls == ["t1", "t1", None]
    assert state == ([], [], None) and record is not None and record.current_run is None
    assert model.requests == []


async def test_process_send_hook_failure_rejects_with_nothing_written(tmp_path: Path) -> None:
    hooks = Hooks(timeout=0.02)
    fail = [True]

    @hooks.on_input
    async def gate(info: InputInfo) -> None:
        if fail[0]:
            await asyncio.sleep(5)

    model = ScriptedModel(lambda request: "answered")
    async with kernel(tmp_path, model, hooks=hooks) as k:
        proc = await k.spawn(owner="alice")
        with pytest.raises(InputRejected, match=r"input hook .*gate failed: hook .*timed out after 0.02 s"):
            await proc.send("hello", run_id="r1")
        record = await k.store.get_process(proc.pid)
        nothing = (await proc.messages(), await proc.queued(), await k.store.kv_get(proc.pid, "admitted:r1"))
        fail[0] = False
        receipt = await proc.send("hello", run_id="r1")  # the caller's retry goes through
        await proc.wait_idle()
        stored = [m.text for m in await proc.messages() if isinstance(m, UserMessage)]
    assert nothing == ([], [], None) and record is not None and record.current_run is None
    assert receipt.run_id == "r1" and not receipt.handled and stored == ["hello"]


async def test_a_retried_idempotent_send_does_not_run_the_hook_again(tmp_path: Path) -> None:
    seen: list[InputInfo] = []
    model = ScriptedModel(lambda request: "once")
    async with kernel(tmp_path, model, hooks=expanding(seen)) as k:
        proc = await k.spawn(owner="alice")
        first = await proc.send("/greet Zoe", run_id="r1")
        await proc.wait_idle()
        retried = await proc.send("/greet Zoe", run_id="r1")
        await proc.wait_idle()
        stored = [m.text for m in await proc.messages() if isinstance(m, UserMessage)]
    assert retried == first and len(seen) == 1
    assert stored == ["Say hello to Zoe."] and len(model.requests) == 1


# ------------------------------------------------------------------ provider-request hooks


@pytest.fixture(scope="module")
def openai_server() -> Iterator[OpenAIFake]:
    with OpenAIFake() as fake:
        yield fake


@pytest.fixture
def openai(openai_server: OpenAIFake) -> Iterator[OpenAIFake]:
    openai_server.reset()
    yield openai_server
    openai_server.reset()


@pytest.fixture(scope="module")
def anthropic_server() -> Iterator[AnthropicFake]:
    with AnthropicFake() as fake:
        yield fake


@pytest.fixture
def anthropic(anthropic_server: AnthropicFake) -> Iterator[AnthropicFake]:
    anthropic_server.reset()
    yield anthropic_server
    anthropic_server.reset()


async def test_the_replaced_payload_goes_over_the_wire_to_openai(openai: OpenAIFake) -> None:
    openai.push(openai_text("fine"))
    seen: list[ProviderRequest] = []
    hooks = Hooks()

    @hooks.before_provider_request
    def log_it(request: ProviderRequest) -> None:  # a logger: sees the payload, keeps it
        seen.append(request)

    @hooks.before_provider_request
    async def vendor(request: ProviderRequest) -> dict[str, Any]:
        return {**request.payload, "temperature": 0.25, "vendor_knob": {"level": 3}}

    model = OpenAIChatModel("gpt-4o-mini", base_url=openai.base_url, api_key="sk-test")
    result = await Agent(model=model, hooks=hooks, system_prompt="Be brief.").run("hi")
    assert result.text == "fine"
    body = openai.last
    assert body["temperature"] == 0.25 and body["vendor_knob"] == {"level": 3}
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (seen[0].provider, seen[0].model, seen[0].api) == ("openai", "gpt-4o-mini", "openai-chat")
    assert seen[0].payload["messages"] == body["messages"] and "vendor_knob" not in seen[0].payload


async def test_the_replaced_payload_goes_over_the_wire_to_anthropic(anthropic: AnthropicFake) -> None:
    anthropic.push(anthropic_text("fine"))
    hooks = Hooks()

    @hooks.before_provider_request
    def uncached(request: ProviderRequest) -> dict[str, Any]:
        assert request.api == "anthropic-messages"
        system = [{k: v for k, v in block.items() if k != "cache_control"} for block in request.payload["system"]]
        return {**request.payload, "system": system, "metadata": {"user_id": "u-7"}}

    model = AnthropicModel("claude-sonnet-4-5", base_url=anthropic.base_url, api_key="sk-ant-test")
    result = await Agent(model=model, hooks=hooks, system_prompt="Be brief.").run("hi")
    assert result.text == "fine"
    assert anthropic.last["system"] == [{"type": "text", "text": "Be brief."}]
    assert anthropic.last["metadata"] == {"user_id": "u-7"}


async def test_a_failing_provider_request_hook_fails_the_call_like_a_provider(openai: OpenAIFake) -> None:
    openai.push(openai_text("never sent"))
    hooks = Hooks()

    @hooks.before_provider_request
    def broken(request: ProviderRequest) -> dict[str, Any]:
        raise KeyError("no such field")

    model = OpenAIChatModel("gpt-4o-mini", base_url=openai.base_url, api_key="sk-test")
    result = await Agent(model=model, hooks=hooks).run("hi")
    assert result.stop_reason == "error" and result.error is not None
    assert "provider-request hook" in result.error and "broken failed" in result.error
    assert openai.requests == []  # nothing was sent, and no retry hammered the hook
    odd = Hooks()
    odd.before_provider_request(lambda request: [request.payload])
    result = await Agent(model=model, hooks=odd).run("hi")
    assert result.error is not None and "returned list, not a dict payload" in result.error


async def test_no_hooks_no_payload_seam_on_the_request() -> None:
    model = ScriptedModel(["a"])
    await Agent(model=model).run("hi")
    assert model.requests[0].shape_payload is None


async def test_a_run_with_an_output_type_keeps_the_provider_request_hooks() -> None:
    hooks = Hooks()
    hooks.before_provider_request(lambda request: None)
    model = ScriptedModel([Reply(tool_calls=[call("final_result", result=4)])])
    result = await Agent(model=model, hooks=hooks).run("2+2?", output_type=int)
    assert result.output == 4 and model.requests[0].shape_payload is not None


def _hooked_server_hooks() -> Hooks:
    """Input hooks for the server tests: ``/ticket`` is taken, ``boom`` fails, the rest is shouted."""
    hooks = Hooks()

    @hooks.on_input
    def route(info: InputInfo) -> Rewrite | Handled | None:
        if info.text.startswith("/ticket"):
            return Handled("filed")
        if info.text == "boom":
            raise RuntimeError("the ticket system is down")
        return Rewrite(info.text.upper())

    return hooks


async def test_the_server_says_handled_and_refuses_a_failed_hook_with_422(tmp_path: Path) -> None:
    from tests.server_support import live_server, refused, wait_idle

    with live_server(tmp_path, kernel_options={"hooks": _hooked_server_hooks()}) as server:
        async with server.client(server.tokens.alice) as alice:
            pid = (await alice.post("/v1/processes", json={})).json()["pid"]
            taken = await alice.post(f"/v1/processes/{pid}/messages", json={"text": "/ticket printer"})
            failed = await alice.post(f"/v1/processes/{pid}/messages", json={"text": "boom"})
            history = (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"]
            sent = await alice.post(f"/v1/processes/{pid}/messages", json={"text": "echo hi"})
            await wait_idle(alice, pid)
            after = (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"]
    assert taken.status_code == 202 and taken.json() == {"run_id": "", "queued": False, "position": 0, "handled": True}
    refused(failed, 422, "input_rejected")
    assert "the ticket system is down" in failed.json()["message"]
    assert history == []  # neither the handled nor the refused input was written
    assert sent.status_code == 202 and "handled" not in sent.json()
    assert after[0]["message"]["content"][0]["text"] == "ECHO HI"


def test_the_chat_shows_a_refused_message_and_goes_on_after_a_handled_one(tmp_path: Path) -> None:
    from contextlib import AsyncExitStack

    from rich.console import Console

    from agentloop.cli.chat import ChatRepl, ChatState, DurableSession, PlainReader

    io_err = io.StringIO()
    model = ScriptedModel(lambda request: f"you said {request.messages[-1].text}")
    ev = asyncio.new_event_loop()
    stack = AsyncExitStack()
    try:
        k = ev.run_until_complete(stack.enter_async_context(kernel(tmp_path, model, hooks=_hooked_server_hooks())))
        session = DurableSession(k, owner="me", cwd=tmp_path, state=ChatState(tmp_path / "chat.json"))
        ev.run_until_complete(session.open(new=True))
        reader = PlainReader(io.StringIO("/ticket printer\nboom\nhello\n/exit\n"))
        out = io.StringIO()
        repl = ChatRepl(session, reader=reader, out=out, err=Console(file=io_err, width=400))
        code = repl.loop(ev)
        messages = ev.run_until_complete(session.process.messages())
    finally:
        ev.run_until_complete(stack.aclose())
        ev.close()
    assert "the message was refused: input hook" in io_err.getvalue()
    assert "you said HELLO" in out.getvalue()
    assert [m.text for m in messages] == ["HELLO", "you said HELLO"]
    assert code == 0


async def test_a_processs_first_input_passes_the_hooks_too(tmp_path: Path) -> None:
    """``spawn(text=...)`` (what ``POST /v1/processes`` with input does) is no way around them."""
    seen: list[InputInfo] = []
    hooks = Hooks()

    @hooks.on_input
    def mask(info: InputInfo) -> Rewrite | Handled | None:
        seen.append(info)
        if info.text == "/ticket":
            return Handled("filed")
        if info.text == "boom":
            raise RuntimeError("moderation is down")
        return Rewrite(info.text.replace("sk-live-123", "sk-***"))

    model = ScriptedModel(lambda request: "noted")
    async with kernel(tmp_path, model, hooks=hooks) as k:
        proc = await k.spawn(owner="alice", text="use sk-live-123 please", run_id="s1", pid="p-one")
        await proc.wait_idle()
        again = await k.spawn(owner="alice", text="use sk-live-123 please", run_id="s1", pid="p-one")
        stored = [m.text for m in await proc.messages()]
        taken = await k.spawn(owner="alice", text="/ticket")
        taken_messages = await taken.messages()
        with pytest.raises(InputRejected, match="moderation is down"):
            await k.spawn(owner="alice", text="boom", pid="p-boom")
        refused = await k.store.get_process("p-boom")
    assert stored == ["use sk-*** please", "noted"]
    assert [(i.source, i.mode, i.run_id) for i in seen[:1]] == [("process.spawn", "prompt", "s1")]
    assert again.started == proc.started and len([i for i in seen if i.run_id == "s1"]) == 1  # (a retry: not again)
    assert taken.started is not None and taken.started.handled and taken_messages == []
    assert refused is None  # nothing created


async def test_the_spawn_route_says_a_first_input_was_handled(tmp_path: Path) -> None:
    from tests.server_support import live_server, refused

    with live_server(tmp_path, kernel_options={"hooks": _hooked_server_hooks()}) as server:
        async with server.client(server.tokens.alice) as alice:
            taken = await alice.post("/v1/processes", json={"text": "/ticket printer"})
            failed = await alice.post("/v1/processes", json={"text": "boom"})
            listed = (await alice.get("/v1/processes")).json()
    assert taken.status_code == 201 and taken.json()["handled"] is True, taken.text
    refused(failed, 422, "input_rejected")
    assert [p["pid"] for p in listed["processes"]] == [taken.json()["pid"]]


async def test_a_retried_spawn_whose_first_input_was_handled_gets_its_answer_without_the_hooks(tmp_path: Path) -> None:
    seen: list[InputInfo] = []
    hooks = Hooks()

    @hooks.on_input
    def take(info: InputInfo) -> Handled:
        seen.append(info)
        return Handled("filed a ticket")

    async with kernel(tmp_path, ScriptedModel(lambda request: "x"), hooks=hooks) as k:
        first = await k.spawn(owner="alice", text="/ticket", run_id="s1", pid="p-t")
        again = await k.spawn(owner="alice", text="/ticket", run_id="s1", pid="p-t")  # (its answer was lost)
        await k.spawn(owner="alice", pid="p-quiet", run_id="s2")  # made without input
        with pytest.raises(StoreError):  # another spawn's pid: not taken for a handled one
            await k.spawn(owner="alice", text="/ticket", run_id="s2", pid="p-quiet")
    assert first.started is not None and first.started.handled
    assert again.started == first.started and len(seen) == 2  # (the second: p-quiet's, refused after)
