"""A subagent's approval requests go before the person watching the conversation (peers: OpenAI's
approvals bubble up from nested agents). A ``Task`` child of an interactive process is interactive
too; what it asks is logged on the top-level process as ``proc.run.hil.requested`` with
``subagent`` (the child's pid), listed by its ``pending_approvals``, and answered through it, with
the child's run going on as the answer says. A child of a non-interactive process still refuses."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from agentloop import Reply, ScriptedModel, SystemMessage, ToolResultMessage, UserMessage, call
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from tests.process_support import kernel, ran

POLICY = {"default": "auto", "rules": [{"match": "tool.echo", "action": "ask"}]}


def _first_user(request: ModelRequest) -> str:
    return next(m.text for m in request.messages if isinstance(m, UserMessage))


def brain(request: ModelRequest) -> Reply | str:
    """The parent hands 'delegate: X' to a child (or, nested, 'deeper: X' to a child that hands it
    on); a child echoes X, then answers with what the echo said."""
    task = _first_user(request)
    last = request.messages[-1]
    if isinstance(last, UserMessage) and task.startswith(("delegate: ", "deeper: ")):
        kind, _, job = task.partition(": ")
        prompt = f"job {job}" if kind == "delegate" else f"delegate: {job}"
        return Reply(tool_calls=[call("Task", prompt=prompt)])
    if task.startswith("job ") and isinstance(last, UserMessage):
        return Reply(tool_calls=[call("echo", text=task.removeprefix("job "))])
    if isinstance(last, ToolResultMessage):
        return f"got: {last.text}"
    if isinstance(last, SystemMessage):
        return f"noted: {last.text}"
    return "?"


async def _asked(proc: Any) -> list[Any]:
    async with asyncio.timeout(10):
        while not (pending := await proc.pending_approvals()):
            await asyncio.sleep(0.02)
    return list(pending)


async def _logged(k: Any, pid: str, name: str) -> list[dict[str, Any]]:
    return [r.payload for r in await k.store.events(pid) if r.signal == name]


async def test_a_childs_request_is_put_to_the_parent_and_answered_through_it(tmp_path):
    ran.clear()
    async with kernel(tmp_path, ScriptedModel(brain), subagents=True, policy=POLICY) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("delegate: hello")
        [ask] = await _asked(parent)
        [child] = [r for r in await k.processes("alice") if r.parent_pid == parent.pid]
        assert child.interactive and ask.pid == child.pid and ran == []
        async with asyncio.timeout(5):
            while not await _logged(k, parent.pid, sig.HIL_REQUESTED):
                await asyncio.sleep(0.02)
        [shown] = await _logged(k, parent.pid, sig.HIL_REQUESTED)
        assert shown["requestId"] == ask.request_id and shown["subagent"] == child.pid
        assert shown["pid"] == parent.pid and shown["name"] == "echo" and shown["args"] == {"text": "hello"}
        assert await parent.hil(ask.request_id, "approve")
        async with asyncio.timeout(10):
            await parent.wait_idle()
        messages = await parent.messages()
        assert ran == ["hello"] and messages[-1].text == "got: got: hello"
        assert await parent.pending_approvals() == []
        changed = await _logged(k, parent.pid, sig.CHANGED)
        assert any(c.get("subagent") == child.pid and "hil" in c["changes"] for c in changed)


async def test_the_account_stream_carries_a_childs_request_once(tmp_path):
    """The account stream has every process's signals, the child's own request among them: the
    copy on the conversation's log (``subagent``) is left out of it, or an inbox showed it twice."""
    ran.clear()
    async with kernel(tmp_path, ScriptedModel(brain), subagents=True, policy=POLICY) as k:
        stream = k.account_signals("alice")
        heard: list[tuple[str, Any]] = []

        async def listen() -> None:
            async for item in stream:
                heard.append((item.pid, item.signal))

        listener = asyncio.create_task(listen())
        await asyncio.sleep(0)  # (watching from here on)
        parent = await k.spawn(owner="alice")
        await parent.send("delegate: hello")
        [ask] = await _asked(parent)
        async with asyncio.timeout(5):  # the copy is on the conversation's log
            while not await _logged(k, parent.pid, sig.HIL_REQUESTED):
                await asyncio.sleep(0.02)
        await parent.hil(ask.request_id, "approve")
        async with asyncio.timeout(10):
            await parent.wait_idle()
        listener.cancel()
    asks = [(pid, s.payload["requestId"]) for pid, s in heard if s.signal == sig.HIL_REQUESTED]
    assert asks == [(ask.pid, ask.request_id)]
    assert not [s for _, s in heard if "subagent" in s.payload]
    assert [pid for pid, s in heard if s.signal == sig.RUN_FINISHED][-1] == parent.pid


async def test_a_grandchilds_request_reaches_the_top_and_a_denial_reaches_the_model(tmp_path):
    ran.clear()
    async with kernel(tmp_path, ScriptedModel(brain), subagents=True, policy=POLICY) as k:
        top = await k.spawn(owner="alice")
        await top.send("deeper: x")
        [ask] = await _asked(top)
        [child] = [r for r in await k.processes("alice") if r.parent_pid == top.pid]
        assert ask.pid not in (top.pid, child.pid)  # the grandchild's
        assert (await (await k.process(child.pid)).pending_approvals())[0].request_id == ask.request_id
        assert await top.hil(ask.request_id, "deny", message="not now")
        async with asyncio.timeout(10):
            await top.wait_idle()
        answer = (await top.messages())[-1].text
    assert ran == []
    assert "not now" in answer


async def test_an_unknown_request_is_still_a_key_error(tmp_path):
    async with kernel(tmp_path, ScriptedModel(brain), subagents=True, policy=POLICY) as k:
        parent = await k.spawn(owner="alice")
        try:
            await parent.hil("no-such-request", "approve")
        except KeyError as exc:
            assert "no-such-request" in str(exc)
        else:
            raise AssertionError("an unknown request was answered")


async def test_a_child_of_a_non_interactive_process_still_refuses(tmp_path):
    ran.clear()
    async with kernel(tmp_path, ScriptedModel(brain), subagents=True, policy=POLICY) as k:
        parent = await k.spawn(owner="alice", interactive=False)
        await parent.send("delegate: hello")
        async with asyncio.timeout(10):
            await parent.wait_idle()
        [child] = [r for r in await k.processes("alice") if r.parent_pid == parent.pid]
        answer = (await parent.messages())[-1].text
    assert not child.interactive and ran == []
    assert "interactive" in answer


def test_over_http_the_conversation_lists_and_answers_its_subagents_requests(tmp_path):
    """``GET …/hil`` of the conversation lists the child's request with ``subagent``; ``POST
    …/hil/{id}`` on the conversation answers it; another account sees none of it."""
    import httpx

    from tests.process_support import echo, slow
    from tests.server_support import LiveServer

    options = {"subagents": True, "policy": POLICY, "approval": None, "tools": [echo, slow]}
    server = LiveServer(tmp_path, model=ScriptedModel(brain), kernel_options=options).start()
    ran.clear()
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.tokens.alice}"}) as alice:
        pid = alice.post("/v1/processes", json={"text": "delegate: over http"}).json()["pid"]
        for _ in range(500):
            requests = alice.get(f"/v1/processes/{pid}/hil").json()["requests"]
            if requests:
                break
            time.sleep(0.02)
        [request] = requests
        assert request["tool_name"] == "echo" and request["subagent"] not in (None, pid)
        bob = {"Authorization": f"Bearer {server.tokens.bob}"}
        assert (
            httpx.post(
                f"{server.url}/v1/processes/{pid}/hil/{request['request_id']}",
                headers=bob,
                json={"decision": "approve"},
            ).status_code
            == 404
        )
        answered = alice.post(f"/v1/processes/{pid}/hil/{request['request_id']}", json={"decision": "approve"})
        assert answered.status_code == 200, answered.text
        for _ in range(500):
            last = alice.get(f"/v1/processes/{pid}/messages").json()["messages"][-1]["message"]
            if last["role"] == "assistant" and any(b["type"] == "text" for b in last["content"]):
                break  # (the answer, not the Task call)
            time.sleep(0.02)
    server.stop()
    assert ran == ["over http"]
    assert last["content"][0]["text"] == "got: got: over http"
