"""The message format: lossless JSON round-trip, wire names, validation of outside data."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from agentloop.messages import (
    AssistantMessage,
    Cost,
    ImageContent,
    SystemMessage,
    TextContent,
    ThinkingContent,
    ToolCall,
    ToolResultMessage,
    Usage,
    UserMessage,
    message_from_dict,
    message_from_json,
    message_to_dict,
    message_to_json,
    messages_from_dicts,
    messages_to_dicts,
)

SAMPLES = [
    UserMessage(content=[TextContent(text="hi"), ImageContent(data="aGk=", mime_type="image/png")]),
    SystemMessage(content=[TextContent(text="budget used")], kind="guard"),
    AssistantMessage(
        content=[
            ThinkingContent(thinking="hmm", signature="sig", redacted=False),
            TextContent(text="let me look"),
            ToolCall(id="call_1", name="read", arguments={"path": "a.txt", "n": [1, 2, {"x": None}]}),
        ],
        provider="openai",
        model="gpt-4o-mini",
        usage=Usage(input=10, output=5, cache_read=2, cache_write=1, total_tokens=18, cost=Cost(total=0.5)),
        stop_reason="toolUse",
    ),
    AssistantMessage(stop_reason="error", error_message="boom"),
    ToolResultMessage(
        tool_call_id="call_1", tool_name="read", content=[TextContent(text="x")], details={"k": 1}, is_error=True
    ),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.role)
def test_json_round_trip_is_lossless(msg):
    assert message_from_json(message_to_json(msg)) == msg
    assert message_from_dict(json.loads(json.dumps(message_to_dict(msg)))) == msg


def test_wire_names_are_pi_vocabulary():
    data = message_to_dict(SAMPLES[2])
    assert data["stopReason"] == "toolUse"
    assert set(data["usage"]) == {"input", "output", "cacheRead", "cacheWrite", "totalTokens", "cost"}
    assert [b["type"] for b in data["content"]] == ["thinking", "text", "toolCall"]
    result = message_to_dict(SAMPLES[4])
    assert result["role"] == "toolResult" and result["toolCallId"] == "call_1" and result["isError"] is True
    assert message_to_dict(SAMPLES[0])["content"][1]["mimeType"] == "image/png"


def test_list_round_trip():
    assert messages_from_dicts(messages_to_dicts(SAMPLES)) == SAMPLES


def test_outside_data_is_validated():
    with pytest.raises(ValidationError):
        message_from_dict({"role": "user", "content": [{"type": "text"}]})
    with pytest.raises(ValidationError):
        message_from_dict({"role": "robot", "content": []})
    with pytest.raises(ValidationError):
        message_from_dict({"role": "assistant", "stopReason": "finished"})
    with pytest.raises(ValidationError):  # unknown fields are not silently dropped
        message_from_dict({"role": "user", "content": [], "surprise": 1})


def test_usage_adds_up():
    a = Usage(input=1, output=2, cache_read=3, cache_write=4, total_tokens=10, cost=Cost(input=1, total=1))
    b = Usage(input=10, output=20, total_tokens=30, cost=Cost(output=2, total=2))
    s = a + b
    assert (s.input, s.output, s.cache_read, s.cache_write, s.total_tokens) == (11, 22, 3, 4, 40)
    assert s.cost.total == 3 and s.cost.input == 1 and s.cost.output == 2
    a.add(b)
    assert a == s


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@given(
    text=st.text(),
    args=st.dictionaries(st.text(max_size=8), json_values, max_size=4),
    tokens=st.integers(min_value=0, max_value=10**9),
)
def test_round_trip_property(text, args, tokens):
    msg = AssistantMessage(
        content=[TextContent(text=text), ToolCall(id="c", name="t", arguments=args)],
        usage=Usage(input=tokens, total_tokens=tokens),
    )
    assert message_from_json(message_to_json(msg)) == msg
