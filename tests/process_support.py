"""What the durable-process tests share: recording tools and a kernel on a temporary SQLite file."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, call, tool
from agentloop.kernel import Approval, Kernel
from agentloop.messages import AssistantMessage, Message, ToolResultMessage, UserMessage
from agentloop.models.base import ModelRequest

gates: dict[str, asyncio.Event] = {}  # named gates ``gate_tool`` waits at (``closed_gates`` opens them)
ran: list[str] = []  # what ``echo`` ran, in order (clear it at the start of a test that checks it)


@tool
def echo(text: str) -> str:
    """Echo."""
    ran.append(text)
    return text


@tool
async def slow(seconds: float) -> str:
    """Sleep."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


def kernel(tmp_path: Path, model: Any, **kw: Any) -> Kernel:
    kw.setdefault("tools", [echo, slow])
    return Kernel.open(f"sqlite:///{tmp_path}/agentloop.db", model=model, workspace=tmp_path, **kw)


def assert_valid(msgs: list[Message]) -> None:
    """Every tool call is followed by exactly one result each, in order; no orphan results."""
    i = 0
    while i < len(msgs):
        msg = msgs[i]
        assert not isinstance(msg, ToolResultMessage), f"orphan tool result at {i}: {msg}"
        if isinstance(msg, AssistantMessage) and msg.tool_calls:
            ids = [c.id for c in msg.tool_calls]
            results = msgs[i + 1 : i + 1 + len(ids)]
            assert [getattr(r, "tool_call_id", None) for r in results] == ids, msgs
            i += 1 + len(ids)
            continue
        i += 1


def gated(gate: asyncio.Event) -> tuple[Any, Any, Callable[[ModelRequest], Reply | str], Any]:
    """A model and tools for input forwarded between workers: "gate" calls a tool that waits for
    ``gate`` (a run to steer or abort), "delete" calls ``rm``, which the policy asks about;
    otherwise the model answers with every user message it has seen."""

    @tool
    async def wait_gate() -> str:
        """Wait until the test opens the gate."""
        await gate.wait()
        return "opened"

    @tool
    def rm(path: str) -> str:
        """Pretend to delete."""
        return f"removed {path}"

    def brain(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if isinstance(last, UserMessage) and last.text == "gate":
            return Reply(tool_calls=[call("wait_gate")])
        if isinstance(last, UserMessage) and last.text == "delete":
            return Reply(tool_calls=[call("rm", path="x")])
        return "seen: " + ", ".join(m.text for m in req.messages if isinstance(m, UserMessage))

    async def policy(process: Any, row: Any) -> Approval:
        return Approval("ask", ("destructive",), "rm", fingerprint="rm") if row.tool_name == "rm" else Approval("auto")

    return wait_gate, rm, brain, policy


def gate(name: str) -> asyncio.Event:
    return gates.setdefault(name, asyncio.Event())


@tool(name="gate")
async def gate_tool(name: str) -> str:
    """Wait for the test."""
    await gate(name).wait()
    return f"opened {name}"


@pytest.fixture(autouse=True)
def closed_gates() -> Iterator[None]:
    """Import it into a test module that uses ``gate_tool``: each test starts with no gates and
    leaves none closed."""
    gates.clear()
    yield
    for event in gates.values():
        event.set()


def last_user(request: ModelRequest) -> str:
    return next(m.text for m in reversed(request.messages) if isinstance(m, UserMessage))
