"""The local adapter's JSON tool protocol, driven by a fake ``Llama`` (no weights, no llama.cpp)."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop.agent import Agent
from agentloop.events import StreamDone, StreamError, StreamEvent, TextDelta
from agentloop.messages import (
    AssistantMessage,
    ImageContent,
    Message,
    TextContent,
    ToolCall,
    ToolResultMessage,
    system,
    user,
)
from agentloop.models.base import ModelRequest, ToolSpec
from agentloop.models.local import (
    LocalModel,
    answer_only_schema,
    chat_messages,
    degenerate,
    parse_json_reply,
    partial_answer,
    tool_schema,
)
from agentloop.models.overflow import is_context_overflow
from agentloop.tools.base import tool

READ = ToolSpec(
    "read_file",
    "Read a file.",
    {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
)
TIME = ToolSpec("get_time", "The time.", {"type": "object", "properties": {"timezone": {"type": "string"}}})


class FakeLlama:
    """Stands in for ``llama_cpp.Llama``: replays replies as streamed chunks and records calls."""

    def __init__(self, *replies: str | BaseException, delay: float = 0.0) -> None:
        self.replies = list(replies)
        self.calls: list[dict[str, Any]] = []
        self.delay = delay
        self.n_tokens = 0
        self.produced = 0
        self.closed = threading.Event()

    def create_chat_completion(self, **kwargs: Any) -> Iterator[dict[str, Any]]:
        self.calls.append(kwargs)
        assert kwargs["stream"] is True
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return self._chunks(reply)

    def _chunks(self, reply: str) -> Iterator[dict[str, Any]]:
        try:
            yield {"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]}
            pieces = [reply[i : i + 3] for i in range(0, len(reply), 3)]
            for piece in pieces:
                if self.delay:
                    time.sleep(self.delay)
                self.produced += 1
                yield {"choices": [{"delta": {"content": piece}, "finish_reason": None}]}
            self.n_tokens = 50 + len(pieces)
            yield {"choices": [{"delta": {}, "finish_reason": "stop"}]}
        finally:
            self.closed.set()


class EndlessLlama(FakeLlama):
    def _chunks(self, reply: str) -> Iterator[dict[str, Any]]:
        try:
            while True:
                time.sleep(0.01)
                self.produced += 1
                yield {"choices": [{"delta": {"content": "word "}, "finish_reason": None}]}
        finally:
            self.closed.set()


def model(fake: FakeLlama) -> LocalModel:
    return LocalModel("qwen2.5-coder-0.5b", llama=fake)


def request(*messages: Message, tools: list[ToolSpec] | None = None, prompt: str = "Be brief.") -> ModelRequest:
    return ModelRequest(system_prompt=prompt, messages=list(messages), tools=tools or [])


async def run(m: LocalModel, req: ModelRequest) -> tuple[list[StreamEvent], StreamDone | StreamError]:
    events = [e async for e in m.stream(req)]
    last = events[-1]
    assert isinstance(last, StreamDone | StreamError)
    return events, last


def call_msg(name: str, args: dict[str, Any], id: str = "c1") -> AssistantMessage:
    return AssistantMessage(content=[ToolCall(id=id, name=name, arguments=args)], stop_reason="toolUse")


def result_msg(name: str, text: str, id: str = "c1", is_error: bool = False) -> ToolResultMessage:
    return ToolResultMessage(tool_call_id=id, tool_name=name, content=[TextContent(text=text)], is_error=is_error)


# ------------------------------------------------------------------ schema and parsing


def test_tool_schema_is_any_of_calls_and_final_answer() -> None:
    schema = tool_schema([READ, TIME])
    options = schema["anyOf"]
    assert [o["properties"].get("tool") for o in options] == [{"const": "read_file"}, {"const": "get_time"}, None]
    assert options[0]["properties"]["arguments"] == READ.parameters
    assert options[0]["required"] == ["tool", "arguments"]
    assert options[-1] == answer_only_schema()


def test_tool_schema_hoists_defs_to_the_root() -> None:
    params = {
        "type": "object",
        "properties": {"item": {"$ref": "#/$defs/Item"}},
        "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer"}}}},
    }
    other = {
        "type": "object",
        "properties": {"item": {"$ref": "#/$defs/Item"}},
        "$defs": {"Item": {"type": "string"}},
    }
    schema = tool_schema([ToolSpec("a", "", params), ToolSpec("b", "", other)])
    assert schema["$defs"]["Item"]["type"] == "object"
    assert schema["$defs"]["b__Item"] == {"type": "string"}
    assert schema["anyOf"][0]["properties"]["arguments"]["properties"]["item"] == {"$ref": "#/$defs/Item"}
    assert schema["anyOf"][1]["properties"]["arguments"]["properties"]["item"] == {"$ref": "#/$defs/b__Item"}
    assert "$defs" not in schema["anyOf"][0]["properties"]["arguments"]


def test_llama_cpp_accepts_the_schema() -> None:
    grammar = pytest.importorskip("llama_cpp.llama_grammar")
    converter = grammar.SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    schema = tool_schema([READ, TIME])
    converter.visit(converter.resolve_refs(schema, ""), "")
    text = converter.format_grammar()
    assert '\\"read_file\\"' in text and "final_answer" in text


@pytest.mark.parametrize(
    "text",
    [
        '{"tool": "read_file", "arguments": {"path": "a.txt"}}',
        '```json\n{"tool": "read_file", "arguments": {"path": "a.txt"}}\n```',
        '<tool_call>\n{"tool": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>',
        'Sure! {"tool": "read_file", "arguments": {"path": "a.txt"}} done',
    ],
)
def test_lenient_parsing(text: str) -> None:
    assert parse_json_reply(text) == {"tool": "read_file", "arguments": {"path": "a.txt"}}


def test_parsing_garbage() -> None:
    assert parse_json_reply("no json here") is None
    assert parse_json_reply('{"tool": ') is None
    assert parse_json_reply("[1, 2]") is None


def test_an_object_inside_a_cut_off_call_is_not_taken_for_a_call() -> None:
    """A review: a call cut off at max_tokens was read as a call of whatever ``name`` an object in
    its arguments held (``name`` is accepted for ``tool``), a real tool included."""
    cut = '{"tool": "gh__create_issue", "arguments": {"labels": [{"name": "get_time"}], "body": "Steps: {'
    assert parse_json_reply(cut) is None
    assert parse_json_reply("Sure: " + cut) is None
    # a broken object before a whole one still leaves the whole one to be found
    whole = {"tool": "a", "arguments": {"s": "}{"}}
    assert parse_json_reply('{not json} {"tool": "a", "arguments": {"s": "}{"}}') == whole
    # prose braces, and a closed object broken inside, are still looked through
    assert parse_json_reply('Checking {quickly. {"tool": "a", "arguments": {"s": "}{"}}') == whole
    assert parse_json_reply('{"tool_calls": [{"tool": "a", "arguments": {"s": "}{"}},]}') == whole


def test_partial_answer_decodes_as_it_grows() -> None:
    full = json.dumps({"final_answer": 'line1\n"q" \u00e9 \U0001f600 end'})
    seen = [partial_answer(full[:i]) for i in range(len(full) + 1)]
    assert seen[0] is None and seen[5] is None
    values = [s for s in seen if s is not None]
    assert values[-1] == 'line1\n"q" \u00e9 \U0001f600 end'
    assert all(b.startswith(a) for a, b in itertools.pairwise(values))  # never takes a character back
    assert partial_answer('{"tool": "x"') is None


# ------------------------------------------------------------------ conversation mapping


def test_conversation_mapping() -> None:
    image = ImageContent(data="aGk=", mime_type="image/png")
    history: list[Message] = [
        user("What is in a.txt?", image),
        call_msg("read_file", {"path": "a.txt"}),
        result_msg("read_file", "hello"),
        AssistantMessage(content=[TextContent(text="It says hello.")]),
        system("Budget nearly spent.", kind="guard"),
        user("and b.txt?"),
        call_msg("read_file", {"path": "b.txt"}, id="c2"),
        result_msg("read_file", "no such file", id="c2", is_error=True),
    ]
    chat = chat_messages("SYS", history, json_protocol=True)
    assert [m["role"] for m in chat] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert chat[0]["content"] == "SYS"
    assert "cannot see images" in chat[1]["content"]
    assert json.loads(chat[2]["content"]) == {"tool": "read_file", "arguments": {"path": "a.txt"}}
    assert chat[3]["content"] == "Tool result for read_file:\nhello"
    assert json.loads(chat[4]["content"]) == {"final_answer": "It says hello."}
    assert "[notice from the runtime] Budget nearly spent." in chat[5]["content"]
    assert chat[5]["content"].endswith("and b.txt?")  # notice and user text merged: one user turn
    assert "ERROR" in chat[7]["content"] and "no such file" in chat[7]["content"]
    assert chat[7]["content"].endswith("Use this result to answer my question: and b.txt?")


def test_conversation_mapping_free_text_keeps_plain_answers() -> None:
    history: list[Message] = [user("hi"), AssistantMessage(content=[TextContent(text="hello")]), user("bye")]
    chat = chat_messages("", history, json_protocol=False)
    assert chat == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ]


def test_failed_assistant_turns_are_not_replayed() -> None:
    failed = AssistantMessage(content=[TextContent(text="half")], stop_reason="error", error_message="boom")
    chat = chat_messages("", [user("hi"), failed, user("again")], json_protocol=False)
    assert chat == [{"role": "user", "content": "hi\n\nagain"}]


# ------------------------------------------------------------------ the stream


async def test_tool_call_becomes_a_tool_call_block() -> None:
    fake = FakeLlama('{"tool": "read_file", "arguments": {"path": "notes.txt"}}')
    _, last = await run(model(fake), request(user("read notes.txt"), tools=[READ, TIME]))
    assert isinstance(last, StreamDone)
    msg = last.message
    assert msg.stop_reason == "toolUse"
    [call] = msg.tool_calls
    assert call.name == "read_file" and call.arguments == {"path": "notes.txt"}
    assert call.id.startswith("call_")
    assert msg.text == ""
    sent = fake.calls[0]
    assert sent["response_format"] == {"type": "json_object", "schema": tool_schema([READ, TIME])}
    assert sent["temperature"] == 0.0
    assert sent["messages"][0]["role"] == "system"
    assert sent["messages"][0]["content"].startswith("Be brief.")
    assert '{"name": "read_file", "description": "Read a file.", "parameters": ' in sent["messages"][0]["content"]
    assert msg.usage.output > 0 and msg.usage.cost.total == 0.0


async def test_final_answer_streams_incrementally() -> None:
    fake = FakeLlama(json.dumps({"final_answer": "The port is 8081."}))
    events, last = await run(model(fake), request(user("port?"), tools=[READ]))
    assert isinstance(last, StreamDone)
    assert last.message.text == "The port is 8081."
    assert last.message.stop_reason == "stop"
    deltas = [e.delta for e in events if isinstance(e, TextDelta)]
    assert len(deltas) > 2 and "".join(deltas) == "The port is 8081."


async def test_free_text_without_tools() -> None:
    fake = FakeLlama("Four.")
    events, last = await run(model(fake), request(user("2+2?")))
    assert isinstance(last, StreamDone) and last.message.text == "Four."
    assert "response_format" not in fake.calls[0]
    assert [e.delta for e in events if isinstance(e, TextDelta)] == ["Fou", "r."]


async def test_tools_disabled_after_calls_asks_for_a_final_answer_only() -> None:
    fake = FakeLlama('{"final_answer": "done"}')
    req = request(user("go"), call_msg("read_file", {"path": "a"}), result_msg("read_file", "x"))
    _, last = await run(model(fake), req)
    assert isinstance(last, StreamDone) and last.message.text == "done"
    assert fake.calls[0]["response_format"]["schema"] == answer_only_schema()


async def test_repeated_call_guard_forces_a_final_answer() -> None:
    fake = FakeLlama('{"tool": "read_file", "arguments": {"path": "a.txt"}}', '{"final_answer": "It says x."}')
    req = request(
        user("what is in a.txt?"),
        call_msg("read_file", {"path": "a.txt"}),
        result_msg("read_file", "x"),
        tools=[READ],
    )
    _, last = await run(model(fake), req)
    assert isinstance(last, StreamDone)
    assert last.message.tool_calls == [] and last.message.text == "It says x."
    assert len(fake.calls) == 2
    second = fake.calls[1]
    assert second["response_format"]["schema"] == answer_only_schema()
    assert "already called read_file" in second["messages"][-1]["content"]
    pieces = sum(
        -(-len(r) // 3)
        for r in ['{"tool": "read_file", "arguments": {"path": "a.txt"}}', '{"final_answer": "It says x."}']
    )
    assert last.message.usage.output == pieces  # both calls are counted


async def test_a_different_call_is_not_a_repeat() -> None:
    fake = FakeLlama('{"tool": "read_file", "arguments": {"path": "b.txt"}}')
    req = request(user("q"), call_msg("read_file", {"path": "a.txt"}), result_msg("read_file", "x"), tools=[READ])
    _, last = await run(model(fake), req)
    assert isinstance(last, StreamDone) and last.message.tool_calls[0].arguments == {"path": "b.txt"}


async def test_garbage_is_retried_then_reported() -> None:
    fake = FakeLlama("{{{", "{]")
    _, last = await run(model(fake), request(user("q"), tools=[READ]))
    assert isinstance(last, StreamError)
    assert last.kind == "invalid_response"
    assert len(fake.calls) == 2
    assert fake.calls[1]["response_format"]["schema"] == answer_only_schema()


async def test_plain_text_after_retry_becomes_the_answer() -> None:
    fake = FakeLlama("not json", "still not json")
    _, last = await run(model(fake), request(user("q"), tools=[READ]))
    assert isinstance(last, StreamDone) and last.message.text == "still not json"


async def test_context_overflow_is_recognised() -> None:
    fake = FakeLlama(ValueError("Requested tokens (9000) exceed context window of 8192"))
    _, last = await run(model(fake), request(user("q" * 10)))
    assert isinstance(last, StreamError)
    assert last.kind == "overflow"
    assert is_context_overflow(last.message)


async def test_an_unexpected_failure_is_an_error_event() -> None:
    fake = FakeLlama(RuntimeError("llama_decode returned -3"))
    _, last = await run(model(fake), request(user("q")))
    assert isinstance(last, StreamError) and "llama_decode" in (last.message.error_message or "")


async def test_missing_weights_are_an_error_event(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTLOOP_CACHE", str(tmp_path))
    m = LocalModel("/nonexistent/model.gguf")
    _, last = await run(m, request(user("q")))
    assert isinstance(last, StreamError) and last.kind == "bad_request"
    assert "not found" in (last.message.error_message or "")


async def test_cancellation_stops_generation() -> None:
    fake = EndlessLlama("")
    m = model(fake)

    async def consume() -> None:
        async for _ in m.stream(request(user("talk forever"))):
            pass

    task = asyncio.create_task(consume())
    for _ in range(500):  # polled: the counter is bumped by the worker thread
        if fake.produced >= 5:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(fake.closed.wait, 2.0), "the worker did not leave llama.cpp's generator"
    stopped_at = fake.produced
    await asyncio.sleep(0.1)
    assert fake.produced <= stopped_at + 1
    # the engine lock was released: the next call runs
    fake2 = m._engine
    assert fake2 is not None and not fake2.lock.locked()


async def test_agent_loop_with_the_fake_model(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("port: 8081\n")
    seen: list[str] = []

    @tool
    def read_file(path: str) -> str:
        """Read a file.

        Args:
            path: file name
        """
        seen.append(path)
        return (tmp_path / path).read_text()

    fake = FakeLlama(
        '{"tool": "read_file", "arguments": {"path": "config.yaml"}}',
        '{"final_answer": "8081"}',
    )
    result = await Agent(model=model(fake), tools=[read_file]).run("Which port?")
    assert seen == ["config.yaml"]
    assert result.stop_reason == "stop" and result.text == "8081"
    last_prompt = fake.calls[1]["messages"]
    assert last_prompt[-2]["content"] == '{"tool": "read_file", "arguments": {"path": "config.yaml"}}'
    assert last_prompt[-1]["content"].startswith("Tool result for read_file:\nport: 8081")


def test_missing_llama_cpp_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from agentloop.models import local
    from agentloop.models.base import ProviderError

    real_import = builtins.__import__

    def fake_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "llama_cpp":
            raise ImportError("No module named 'llama_cpp'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ProviderError) as err:
        local._import_llama()
    assert "pip install 'agentloop[local]'" in str(err.value) and "9 minutes" in str(err.value)


def test_context_window_is_the_allocated_one() -> None:
    m = LocalModel("local:qwen2.5-coder-1.5b", n_ctx=4096, llama=FakeLlama())
    assert m.name == "local:qwen2.5-coder-1.5b"
    assert m.info.context_window == 4096


def test_degenerate_loops_are_detected() -> None:
    assert degenerate("answer: " + "```\n" * 80)
    assert degenerate("x" * 300)
    assert not degenerate("short")
    assert not degenerate(" ".join(f"word{i}" for i in range(100)))


async def test_a_looping_answer_is_cut_short() -> None:
    fake = EndlessLlama("")
    _, last = await run(model(fake), request(user("talk")))
    assert isinstance(last, StreamDone)
    assert last.message.stop_reason == "length"
    assert fake.closed.wait(2.0)
    assert fake.produced < 200
