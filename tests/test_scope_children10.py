"""Narrowing a process's tool scope (``Process.set_tools``) narrows its subagents and theirs: each
one's scope becomes its own within the parent's new one, from its next run on; widening the
parent widens none of them (process/tool_scope.py ``intersection``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentloop import ScriptedModel
from agentloop.models.base import ModelRequest
from agentloop.process.tool_scope import intersection
from tests.process_support import closed_gates  # noqa: F401  (closed_gates: autouse)
from tests.test_tool_scope10 import blue, brain, offered, open_kernel, red


def test_intersection_keeps_what_both_offer() -> None:
    tools: dict[str, Any] = {"red": red, "blue": blue}
    assert intersection(["red", "blue"], ["red"], tools) == ["red"]
    assert intersection(None, ["red"], tools) == ["red"]
    assert intersection(["red"], None, tools) == ["red"]
    assert intersection(None, None, tools) is None
    assert intersection(["r*"], ["red", "blue"], tools) == ["red"]  # a parent's name the child's glob covers
    assert intersection(["r*"], ["*e*"], tools) == ["red"]  # pattern against pattern: the tools there now
    assert intersection(["blue"], ["red"], tools) == []
    assert intersection(["Shell"], ["Jobs"], {}) == ["Jobs"]


def last_request(model: ScriptedModel, text: str) -> ModelRequest:
    return [r for r in model.requests if r.messages[-1].text == text][-1]


async def test_narrowing_a_parent_narrows_its_subagents_from_their_next_run(tmp_path: Path) -> None:
    model = ScriptedModel(brain)
    async with open_kernel(tmp_path, model, subagents=True) as k:
        parent = await k.spawn(owner="alice", tools=["Task", "red", "blue"])
        await parent.send("task: x")
        await parent.wait_idle()
        (rec,) = [r for r in await k.processes("alice") if r.parent_pid == parent.pid]
        child = await k.process(rec.pid)
        assert offered(last_request(model, "job x")) == {"Task", "red", "blue"}
        grandchild = await k.spawn(owner="alice", parent_pid=child.pid)  # inherits: every tool of its parent
        explicit = await k.spawn(owner="alice", parent_pid=parent.pid, tools=["red", "blue"])
        assert await grandchild.tools() == ["Task", "red", "blue"]

        assert await parent.set_tools(["Task", "red"]) == ["Task", "red"]
        assert await child.tools() == ["Task", "red"]
        assert await grandchild.tools() == ["Task", "red"]
        assert await explicit.tools() == ["red"]
        await child.send("child again")
        await child.wait_idle()
        assert offered(last_request(model, "child again")) == {"Task", "red"}
        await grandchild.send("grandchild run")
        await grandchild.wait_idle()
        assert offered(last_request(model, "grandchild run")) == {"Task", "red"}

        # a child narrowed on its own stays narrow when the parent widens (and so do the others)
        assert await child.set_tools(["red"]) == ["red"]
        assert await grandchild.tools() == ["red"]  # (its parent narrowed: it follows)
        assert await parent.set_tools(None) is None
        assert await child.tools() == ["red"]
        assert await grandchild.tools() == ["red"]
        assert await explicit.tools() == ["red"]
        await child.send("after widening")
        await child.wait_idle()
        assert offered(last_request(model, "after widening")) == {"red"}


async def test_a_parent_without_scope_narrowed_narrows_children_that_had_every_tool(tmp_path: Path) -> None:
    model = ScriptedModel(brain)
    async with open_kernel(tmp_path, model, subagents=True) as k:
        parent = await k.spawn(owner="alice")
        child = await k.spawn(owner="alice", parent_pid=parent.pid)
        assert await child.tools() is None
        await parent.set_tools(["blue"])
        assert await child.tools() == ["blue"]
        await child.send("hello")
        await child.wait_idle()
        assert offered(last_request(model, "hello")) == {"blue"}
