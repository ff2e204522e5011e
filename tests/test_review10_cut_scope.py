"""Review RV4 of manual compaction's chosen cut (``keep_last``/``through``/``summary``) and of
the per-process tool scope: what a scope must also keep from a process (the tools a CodeMode
program is lent), and what a hand-made cut must not do."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Kernel
from agentloop.messages import AssistantMessage, Message, TextContent, ToolCall, user
from agentloop.process.approval import Policy, Rule, default_policy
from agentloop.process.compaction import check_summary, explicit_cut
from agentloop.process.tool_scope import scoped
from agentloop.tools.codemode import CodeMode
from agentloop.tools.mcp import MCPGateway

TRUST_CODEMODE = Policy(default="auto", rules=(Rule(match="codemode.exec", action="auto"), *default_policy().rules))
ran: list[str] = []


@tool
def red(text: str) -> str:
    """Say it in red."""
    ran.append(f"red {text}")
    return f"red: {text}"


@tool
def blue(text: str) -> str:
    """Say it in blue."""
    ran.append(f"blue {text}")
    return f"blue: {text}"


def results(messages: list[Any]) -> list[ToolResultMessage]:
    return [m for m in messages if isinstance(m, ToolResultMessage)]


# ------------------------------------------------------------------ tool scope: CodeMode


def test_scoped_codemode_lends_only_the_tools_in_scope() -> None:
    mode = CodeMode([red, blue])
    tools = {"red": red, "CodeMode": mode}
    out = scoped(tools, ["CodeMode", "red"])
    lent = out["CodeMode"]
    assert isinstance(lent, CodeMode)
    assert set(lent.own_tools) == {"red"} and "blue" not in lent.description
    assert set(mode.own_tools) == {"red", "blue"}  # (the kernel's own CodeMode is untouched)
    assert scoped(tools, None) is tools


async def test_a_codemode_program_cannot_call_a_tool_out_of_scope(tmp_path: Path) -> None:
    ran.clear()
    code = "print(await red('a'))\ntry:\n    print(await blue('b'))\nexcept Exception as exc:\n    print('no', exc)\n"
    model = ScriptedModel([Reply(tool_calls=[call("CodeMode", code=code)]), "done"])
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=model,
        workspace=tmp_path,
        tools=[red, blue, CodeMode([red, blue])],
        policy=TRUST_CODEMODE.to_json(),
    ) as k:
        proc = await k.spawn(owner="alice", tools=["CodeMode", "red"])
        await proc.send("go")
        await proc.wait_idle()
        [res] = results(await proc.messages())
    assert "red: a" in res.text
    assert "blue: b" not in res.text and ran == ["red a"], res.text


def test_mcp_server_entry_reaches_a_server_behind_the_gateway_and_no_other() -> None:
    gateway = MCPGateway([SimpleNamespace(config=SimpleNamespace(name=n)) for n in ("gh", "db")])  # type: ignore[misc]
    tools = {"red": red, "mcp": gateway}
    narrowed = scoped(tools, ["red", "mcp:gh"])["mcp"]
    assert isinstance(narrowed, MCPGateway) and list(narrowed.connections) == ["gh"]
    assert "db" not in narrowed.description and list(gateway.connections) == ["gh", "db"]
    assert list(scoped(tools, ["red"])) == ["red"]  # no server of the gateway's named: no gateway
    assert scoped(tools, ["mcp"])["mcp"] is gateway  # the gateway by name: all of it
    lent = scoped({"CodeMode": CodeMode([red, gateway])}, ["CodeMode", "mcp:db"])["CodeMode"]
    assert isinstance(lent, CodeMode) and set(lent.own_tools) == {"mcp"}
    inner = lent.own_tools["mcp"]
    assert isinstance(inner, MCPGateway) and list(inner.connections) == ["db"]


# ------------------------------------------------------------------ manual compaction


def test_a_supplied_summary_with_a_c1_control_character_is_refused() -> None:

    for bad in ("red \x9b31mtext", "a\x85b", "a\x7fb", "a\x1bb"):
        with pytest.raises(ValueError):
            check_summary(bad)
    assert check_summary(" tab\tand\nlines, é and ü \n") == "tab\tand\nlines, é and ü"


def test_the_explicit_cut_keeps_a_batch_whose_results_a_steer_message_parts() -> None:
    def result(call_id: str) -> ToolResultMessage:
        return ToolResultMessage(tool_call_id=call_id, tool_name="red", content=[TextContent(text="ok")])

    batch = AssistantMessage(content=[ToolCall(id=c, name="red", arguments={}) for c in ("x", "y")])
    messages: list[Message] = [user("a"), batch, result("x"), user("steer"), result("y"), user("b")]
    assert [explicit_cut(messages, keep_last=k) for k in range(8)] == [6, 5, 1, 1, 1, 1, 0, 0]
    assert [explicit_cut(messages, through=t) for t in range(6)] == [1, 5, 5, 5, 5, 6]
