"""Tools a ``pre_tool_materialization`` hook added to a durable run survive a restart: a call to
one that was still pending (waiting for a person's approval) when the kernel closed runs after it
reopens, the hooks asked again for the run's state; a hook that no longer offers the tool leaves
the call a clear tool error; the process's tool scope is not widened by it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Approval, Kernel, Process
from agentloop.loop.hooks import TurnInfo
from agentloop.loop.state import LoopConfig
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process.calls import NOT_ADDED_AGAIN

kept: list[str] = []  # what ``remember`` and ``lookup`` did (cleared by each test)


@tool
def remember(fact: str) -> str:
    """Remember a fact."""
    kept.append(fact)
    return f"remembered {fact}"


@tool(idempotent=True)
async def lookup(key: str) -> str:
    """Look a key up (slowly the first time: a restart catches it in flight)."""
    kept.append(f"lookup {key}")
    await asyncio.sleep(5 if len(kept) == 1 else 0)
    return f"value of {key}"


@tool
def echo(text: str) -> str:
    """Echo the text."""
    return text


@tool
def wipe(path: str) -> str:
    """Pretend to wipe a path."""
    kept.append(f"wipe {path}")
    return f"wiped {path}"


class Piece:
    """A ``pre_tool_materialization`` hook (and the ``memory`` bundle) installed in a kernel."""

    def __init__(self, offer: Callable[[TurnInfo], Any]) -> None:
        self.offer = offer

    def install(self, config: LoopConfig) -> None:
        config.hooks.add_bundle("memory", [remember])
        config.hooks.on("pre_tool_materialization")(self.offer)


async def ask_remember(process: Any, row: Any) -> Approval:
    if row.tool_name == "remember":
        return Approval("ask", ("mutating",), "remember a fact", fingerprint=row.args["fact"])
    return Approval("auto")


def brain(*calls: Any) -> Callable[[ModelRequest], Reply | str]:
    """Calls ``calls`` for the user's message, then answers with the results it got."""

    def answer(request: ModelRequest) -> Reply | str:
        if isinstance(request.messages[-1], UserMessage):
            return Reply(tool_calls=list(calls))
        return "done: " + " | ".join(m.text for m in request.messages if isinstance(m, ToolResultMessage))

    return answer


def open_kernel(tmp_path: Path, model: Any, offer: Callable[[TurnInfo], Any], **kw: Any) -> Kernel:
    kw.setdefault("tools", [echo])
    kw.setdefault("approval", ask_remember)
    return Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=ScriptedModel(model),
        workspace=tmp_path,
        pieces=[Piece(offer)],
        **kw,
    )


async def asked(proc: Process) -> str:
    """The request id of the one approval the process waits for."""
    for _ in range(500):
        pending = await proc.pending_approvals()
        if pending:
            [one] = pending
            return one.request_id
        await asyncio.sleep(0.01)
    raise AssertionError("no approval was asked for")


async def restarted_and_approved(
    tmp_path: Path, model: Any, before: Callable[[TurnInfo], Any], after: Callable[[TurnInfo], Any], **kw: Any
) -> list[ToolResultMessage]:
    """Start a run whose call waits for approval, close the kernel, reopen it with the hook
    ``after``, approve: the run's tool results once it is idle."""
    async with open_kernel(tmp_path, model, before, **kw) as k:
        proc = await k.spawn(owner="alice", text="go")
        await asked(proc)
        pid = proc.pid
    async with open_kernel(tmp_path, model, after, **kw) as k2:
        proc = await k2.process(pid)
        await proc.hil(await asked(proc), "approve")
        await asyncio.wait_for(proc.wait_idle(), 10)
        messages = await proc.messages()
    assert messages[-1].text.startswith("done: ")  # the run went on to the model's answer
    return [m for m in messages if isinstance(m, ToolResultMessage)]


async def test_an_approved_call_to_a_bundle_tool_runs_after_a_restart(tmp_path: Path) -> None:
    kept.clear()
    seen: list[tuple[str, int, list[str]]] = []

    def offer(label: str) -> Callable[[TurnInfo], Any]:
        def memory(info: TurnInfo) -> str:
            seen.append((label, info.turn, [m.role for m in info.messages]))
            return "memory"

        return memory

    model = brain(call("remember", fact="tea"))
    [result] = await restarted_and_approved(tmp_path, model, offer("before"), offer("after"))
    assert (result.tool_name, result.is_error, result.text) == ("remember", False, "remembered tea")
    assert kept == ["tea"]  # it ran, once
    # the hooks were asked again for the state the call was made in: what the first call saw
    assert seen[0] == ("before", 0, ["user"]) and seen[1] == ("after", 0, ["user"])
    assert [s[0] for s in seen] == ["before", "after", "after"]  # and once more for the answer's call


async def test_a_tool_a_hook_added_directly_runs_after_a_restart(tmp_path: Path) -> None:
    kept.clear()
    model = brain(call("remember", fact="milk"), call("echo", text="x"))
    results = await restarted_and_approved(tmp_path, model, lambda info: remember, lambda info: remember)
    assert [(r.tool_name, r.is_error, r.text) for r in results] == [
        ("remember", False, "remembered milk"),
        ("echo", False, "x"),
    ]
    assert kept == ["milk"]


async def test_a_tool_added_again_at_a_later_turn_runs_after_a_restart(tmp_path: Path) -> None:
    """At the second turn the tool is already the run's (added at the first): its call is still
    known for one a hook added, and the restart asks the hooks for it."""
    kept.clear()

    def model(request: ModelRequest) -> Reply | str:
        done = [m.text for m in request.messages if isinstance(m, ToolResultMessage)]
        if len(done) < 2:
            return Reply(tool_calls=[call("remember", fact="ab"[len(done)])])
        return "done: " + " | ".join(done)

    async with open_kernel(tmp_path, model, lambda info: "memory") as k:
        proc = await k.spawn(owner="alice", text="go")
        await proc.hil(await asked(proc), "approve")  # the first turn's call, before the restart
        for _ in range(500):
            if kept == ["a"] and await proc.pending_approvals():
                break
            await asyncio.sleep(0.01)
        pid = proc.pid
    async with open_kernel(tmp_path, model, lambda info: "memory") as k2:
        proc = await k2.process(pid)
        await proc.hil(await asked(proc), "approve")
        await asyncio.wait_for(proc.wait_idle(), 10)
        assert (await proc.messages())[-1].text == "done: remembered a | remembered b"
    assert kept == ["a", "b"]


async def test_a_tool_the_hook_no_longer_offers_after_a_restart_is_a_clear_tool_error(tmp_path: Path) -> None:
    kept.clear()
    model = brain(call("remember", fact="tea"))
    [result] = await restarted_and_approved(tmp_path, model, lambda info: "memory", lambda info: None)
    assert (result.tool_name, result.is_error, result.text) == ("remember", True, NOT_ADDED_AGAIN)
    assert kept == []


async def test_a_failing_hook_after_a_restart_leaves_the_call_a_clear_tool_error(tmp_path: Path) -> None:
    kept.clear()

    def broken(info: TurnInfo) -> Any:
        if info.turn == 0:  # (asked again for the call's turn; the next call's works)
            raise RuntimeError("no memory today")
        return None

    model = brain(call("remember", fact="tea"))
    [result] = await restarted_and_approved(tmp_path, model, lambda info: "memory", broken)
    assert (result.is_error, result.text) == (True, NOT_ADDED_AGAIN)
    assert kept == []


async def test_the_restored_tools_do_not_widen_the_process_tool_scope(tmp_path: Path) -> None:
    """The scope leaves ``wipe`` out: after the restart the hook's tool is back, ``wipe`` is not."""
    kept.clear()
    model = brain(call("remember", fact="tea"), call("wipe", path="/"))
    async with open_kernel(tmp_path, model, lambda info: "memory", tools=[echo, wipe]) as k:
        proc = await k.spawn(owner="alice")
        await proc.set_tools(["echo"])
        await proc.send("go")
        await asked(proc)
        pid = proc.pid
    async with open_kernel(tmp_path, model, lambda info: "memory", tools=[echo, wipe]) as k2:
        proc = await k2.process(pid)
        await proc.hil(await asked(proc), "approve")
        await asyncio.wait_for(proc.wait_idle(), 10)
        first, second = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert (first.is_error, first.text) == (False, "remembered tea")
    assert second.is_error and "wipe not found" in second.text
    assert kept == ["tea"]


async def test_a_hook_added_idempotent_call_in_flight_is_run_again_after_a_restart(tmp_path: Path) -> None:
    """As a registered idempotent tool is: the restart must know the tool to judge the call."""
    kept.clear()
    model = brain(call("lookup", key="k"))
    async with open_kernel(tmp_path, model, lambda info: lookup) as k:
        proc = await k.spawn(owner="alice", text="go")
        for _ in range(500):
            if kept:
                break
            await asyncio.sleep(0.01)
        pid = proc.pid  # the call is in flight: the "crash" comes now
    async with open_kernel(tmp_path, model, lambda info: lookup) as k2:
        proc = await k2.process(pid)
        await asyncio.wait_for(proc.wait_idle(), 10)
        assert (await proc.messages())[-1].text == "done: value of k"
    assert kept == ["lookup k", "lookup k"]


async def test_a_restart_asks_the_hooks_again_only_for_a_run_whose_call_needs_it(tmp_path: Path) -> None:
    """Two runs wait for approval: one of a call to ``echo`` (registered), one of a call to the
    hook's ``remember``; the restart asks the hooks again for the second alone, and both run."""
    kept.clear()
    asked_for: list[tuple[str | None, int]] = []

    def memory(info: TurnInfo) -> str:
        asked_for.append((info.conversation, info.turn))
        return "memory"

    async def ask_all(process: Any, row: Any) -> Approval:
        return Approval("ask", ("mutating",), row.tool_name, fingerprint=row.tool_name)

    def model(request: ModelRequest) -> Reply | str:
        if isinstance(request.messages[-1], UserMessage):
            text = request.messages[-1].text
            return Reply(tool_calls=[call("echo", text="x") if text == "echo" else call("remember", fact="tea")])
        return "done: " + " | ".join(m.text for m in request.messages if isinstance(m, ToolResultMessage))

    async with open_kernel(tmp_path, model, memory, approval=ask_all) as k:
        plain = await k.spawn(owner="alice", text="echo")
        await asked(plain)
        hooked = await k.spawn(owner="alice", text="remember")
        await asked(hooked)
    assert sorted(asked_for) == sorted([(plain.pid, 0), (hooked.pid, 0)])  # each run's model call
    asked_for.clear()
    async with open_kernel(tmp_path, model, memory, approval=ask_all) as k2:
        for pid in (plain.pid, hooked.pid):
            proc = await k2.process(pid)
            await proc.hil(await asked(proc), "approve")
            await asyncio.wait_for(proc.wait_idle(), 10)
            assert (await proc.messages())[-1].text in ("done: x", "done: remembered tea")
        # the restart asked for the run whose call needs the hook's tool (then each answer's call)
        assert asked_for[0] == (hooked.pid, 0) and sorted(asked_for[1:]) == sorted([(plain.pid, 1), (hooked.pid, 1)])
    assert kept == ["tea"]
