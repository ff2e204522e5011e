"""Replay hygiene: histories that providers would reject are cleaned before sending."""

from __future__ import annotations

from agentloop.messages import AssistantMessage, TextContent, ToolCall, ToolResultMessage, user
from agentloop.models.replay import MISSING_RESULT, clean_history, safe_tool_id


def _call(id: str) -> ToolCall:
    return ToolCall(id=id, name="t", arguments={})


def _result(id: str) -> ToolResultMessage:
    return ToolResultMessage(tool_call_id=id, tool_name="t", content=[TextContent(text="r")])


def test_failed_and_empty_aborted_turns_are_dropped():
    history = [
        user("a"),
        AssistantMessage(stop_reason="error", error_message="x", content=[TextContent(text="partial")]),
        AssistantMessage(stop_reason="aborted"),
        AssistantMessage(stop_reason="aborted", content=[TextContent(text="half an answer")]),
        user("b"),
    ]
    out = clean_history(history)
    assert [m.role for m in out] == ["user", "assistant", "user"]
    assert out[1].text == "half an answer"


def test_orphaned_calls_get_synthetic_results_in_place():
    history = [
        user("a"),
        AssistantMessage(content=[_call("1"), _call("2")], stop_reason="toolUse"),
        _result("2"),
        user("b"),
        AssistantMessage(content=[_call("3")], stop_reason="toolUse"),
    ]
    out = clean_history(history)
    roles = [(m.role, getattr(m, "tool_call_id", None)) for m in out]
    assert roles == [
        ("user", None),
        ("assistant", None),
        ("toolResult", "2"),
        ("toolResult", "1"),
        ("user", None),
        ("assistant", None),
        ("toolResult", "3"),
    ]
    synthetic = out[3]
    assert synthetic.is_error and synthetic.text == MISSING_RESULT


def test_results_without_calls_are_dropped():
    history = [user("a"), _result("ghost"), AssistantMessage(content=[TextContent(text="ok")])]
    assert [m.role for m in clean_history(history)] == ["user", "assistant"]


def test_ids_are_normalised_consistently():
    weird = "call|abc/def:" + "x" * 80
    history = [user("a"), AssistantMessage(content=[_call(weird)], stop_reason="toolUse"), _result(weird)]
    out = clean_history(history, normalize_id=safe_tool_id)
    new_id = out[1].tool_calls[0].id
    assert new_id == out[2].tool_call_id
    assert len(new_id) <= 64 and all(c.isalnum() or c in "_-" for c in new_id)
    assert history[1].tool_calls[0].id == weird  # the stored history is not rewritten
