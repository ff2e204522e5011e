"""Subagents, reviewed (kernel/tasks.py, kernel/tree.py): a Task call's arguments are checked as
its schema says, a child that fails tells its parent why, and aborting a parent's run stops the
whole subtree its children started, not only the children."""

from __future__ import annotations

import asyncio
from typing import Any

from agentloop import Reply, ScriptedModel, ToolResultMessage, UserMessage, call
from agentloop.models.base import ModelRequest, ProviderError
from tests.process_support import kernel


def _first_user(request: ModelRequest) -> str:
    return next(m.text for m in request.messages if isinstance(m, UserMessage))


def _results(messages: list[Any]) -> list[ToolResultMessage]:
    return [m for m in messages if isinstance(m, ToolResultMessage)]


async def _children(k: Any, pid: str) -> list[Any]:
    return [r for r in await k.processes("alice") if r.parent_pid == pid]


async def _parent_run(k: Any) -> tuple[Any, ToolResultMessage]:
    """A parent process sent "parent", once its run is over, and the one tool result it got."""
    parent = await k.spawn(owner="alice")
    await parent.send("parent")
    async with asyncio.timeout(10):
        await parent.wait_idle()
    [result] = _results(await parent.messages())
    return parent, result


async def test_a_task_call_with_an_unknown_option_is_refused_and_starts_no_child(tmp_path):
    """The schema forbids other properties, yet ``background: true`` (a model's guess at how to
    go on without waiting) was dropped in silence: the call waited, and a child was started."""

    def brain(request: ModelRequest) -> Reply | str:
        if _first_user(request) == "parent" and isinstance(request.messages[-1], UserMessage):
            return Reply(tool_calls=[call("Task", prompt="job", background=True)])
        return "ok"

    async with kernel(tmp_path, ScriptedModel(brain), subagents=True) as k:
        parent, result = await _parent_run(k)
        children = await _children(k, parent.pid)
    assert result.is_error and "background" in result.text
    assert children == []


async def test_a_child_whose_model_fails_tells_the_waiting_parent_why(tmp_path):
    """The parent was told only ``error (generation.error)``: the provider's message (a bad key,
    a quota) that the background report carries was left out of the waited-for answer."""

    def brain(request: ModelRequest) -> Any:
        task, last = _first_user(request), request.messages[-1]
        if task == "parent" and isinstance(last, UserMessage):
            return Reply(tool_calls=[call("Task", prompt="child")])
        if task == "child":
            return ProviderError("invalid API key for the subagent's model", kind="auth")
        return "ok"

    async with kernel(tmp_path, ScriptedModel(brain), subagents=True) as k:
        _, result = await _parent_run(k)
    assert result.is_error and "ended with error" in result.text
    assert "invalid API key for the subagent's model" in result.text


async def test_aborting_the_parent_stops_what_its_finished_child_left_running(tmp_path):
    """The parent's run waited for a child, which started a background grandchild and answered.
    Aborting the parent's run found the child idle and stopped nothing: the grandchild worked on,
    and its report would start a run of the child that nobody reads."""

    def brain(request: ModelRequest) -> Any:
        task, last = _first_user(request), request.messages[-1]
        if task == "parent":
            if isinstance(last, UserMessage):
                return Reply(tool_calls=[call("Task", prompt="child", wait=True)])
            return Reply(tool_calls=[call("slow", seconds=30)])  # the parent's run goes on
        if task == "child":
            return (
                Reply(tool_calls=[call("Task", prompt="grandchild", wait=False)])
                if len(request.messages) == 1
                else "ok"
            )
        return Reply(tool_calls=[call("slow", seconds=30)]) if isinstance(last, UserMessage) else "done"

    async with kernel(tmp_path, ScriptedModel(brain), subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("parent")
        async with asyncio.timeout(5):
            while not _results(await parent.messages()):  # the child answered; the grandchild works on
                await asyncio.sleep(0.02)
        [child] = await _children(k, parent.pid)
        [grandchild] = await _children(k, child.pid)
        assert (await k.store.get_process(grandchild.pid)).current_run is not None
        assert await parent.abort()
        async with asyncio.timeout(5):  # not the 30 s of its sleep
            await (await k.process(grandchild.pid)).wait_idle()
        await asyncio.sleep(0.1)
        ended = [s.payload async for s in (await k.process(grandchild.pid)).signals(follow=False)]
        child_after = await k.store.get_process(child.pid)
        child_watches = await k.watches(child.pid)
    assert [e["reason"] for e in ended if e.get("status") == "aborted"] == ["parent.abort"]
    assert child_after is not None and child_after.current_run is None and child_watches == []
