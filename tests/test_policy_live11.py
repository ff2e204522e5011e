"""Two limits of the approval policy, lifted.

``/engine/chat`` (stateless, one agent per request) applies the server-wide policy as in force at
the request, as the ``/v1`` processes do: an edit of ``serve --approval PATH`` reaches it without a
restart (``Kernel.policies.server``, the one source the processes' checks follow too).

An account's policy given in code (``Kernel.open(account_policies=...)``) means what the same
policy in the account's ``approval.json`` means: ``remembered`` rules alone sit on the server-wide
policy, whose later denies reach the account, and a policy of its own (``default``/``rules``) still
replaces the server-wide one."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop import Reply, ScriptedModel, ToolResultMessage, call
from agentloop.cli.approvals import parse_approval
from agentloop.cli.config import Settings
from agentloop.cli.serve import ServeOptions
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest
from agentloop.models.registry import register_provider
from agentloop.process.api import approve_everything
from agentloop.process.approval.checker import policy_approval
from agentloop.process.approval.policy import Policy, Rule
from agentloop.process.store import ProcessRecord, SQLiteStore, ToolCallRow
from tests import process_support
from tests.process_support import echo, kernel
from tests.server_support import parse_sse, serving
from tests.test_account_policy10 import ECHO_ALWAYS, SERVER, STRICTER, echo_model, outcome
from tests.test_policy_reload10 import write

Verdict = Callable[..., Awaitable[str]]
SHELL_DENIED = {"default": "auto", "rules": [{"match": "shell.exec", "action": "deny"}]}


# -- /engine/chat follows the server's policy file ------------------------------------------------


def _shell_script(req: ModelRequest) -> Reply | str:
    """Runs the user's message as a Shell command, then repeats what the tool said."""
    last = req.messages[-1]
    if isinstance(last, ToolResultMessage):
        return "tool said: " + last.text
    assert isinstance(last, UserMessage)
    return Reply(tool_calls=[call("Shell", command=last.text)])


def _tool_result(sse: str) -> dict[str, Any]:
    [result] = [f["data"] for f in parse_sse(sse) if f.get("event") == "tool-result"]
    return dict(result)


def test_engine_chat_follows_an_edit_of_the_server_policy_file(tmp_path: Path) -> None:
    register_provider("livepolicy11", lambda _id: ScriptedModel(_shell_script))
    ws, data = tmp_path / "ws", tmp_path / "data"
    ws.mkdir()
    policy_file = tmp_path / "policy.json"
    write(policy_file, {"default": "auto"})
    settings = Settings(model="livepolicy11:x", model_source="test")
    approval = parse_approval(str(policy_file))
    opts = ServeOptions("127.0.0.1", 0, data.resolve(), ws.resolve(), settings, approval, out=io.StringIO())
    with serving(opts) as (url, headers), httpx.Client(base_url=url, timeout=30, headers=headers) as client:

        def shell(command: str) -> dict[str, Any]:
            body = {"messages": [{"role": "user", "content": command}], "metadata": {"correlation_id": "c1"}}
            reply = client.post("/engine/chat", json=body)
            assert reply.status_code == 200
            return _tool_result(reply.text)

        ran = shell("echo live-11")
        assert "error" not in ran and "live-11" in json.dumps(ran)
        write(policy_file, SHELL_DENIED)  # the operator forbids Shell: no restart
        refused = shell("echo live-11")
        assert refused["error"].startswith("Tool execution denied by rules[0] shell.exec -> deny")
        write(policy_file, {"default": "auto"})  # and lifts it again
        assert "error" not in shell("echo again-11")


async def test_the_kernel_hands_out_the_policy_its_checks_follow(tmp_path: Path) -> None:
    policy_file = tmp_path / "policy.json"
    write(policy_file, SERVER)
    async with kernel(tmp_path, echo_model(), tools=[echo], policy=policy_file) as k:
        assert k.policies is not None
        assert k.policies.server() == Policy.model_validate(SERVER)
        alice = await k.spawn(owner="alice")
        write(policy_file, STRICTER)
        assert await outcome(alice, "risky") == "deny"  # the processes' checks and ...
        assert k.policies.server() == Policy.model_validate(STRICTER)  # ... what /engine/chat is given agree
        assert k.policies.server() is k.policies.server()  # (unchanged: not read, nor parsed, again)
    async with kernel(tmp_path, echo_model(), tools=[echo], approval=approve_everything) as k:
        assert k.policies is None  # (a caller's own check: no policy to follow)


# -- account policies given in code layer as their files do ---------------------------------------


@asynccontextmanager
async def checker(tmp_path: Path, server: Any, accounts: dict[str, Any]) -> AsyncIterator[Verdict]:
    """The verdicts of a fresh checker (server-wide ``server``, ``accounts`` in code) for alice's calls."""
    store = SQLiteStore(tmp_path / f"c{len(list(tmp_path.glob('c*.db')))}.db")
    await store.open()
    check = policy_approval(store, server=server, accounts=accounts)
    alice = ProcessRecord("p1", "alice", "alice", str(tmp_path))

    async def verdict(tool: str, **args: object) -> str:
        row = ToolCallRow("d", "p1", "r", 0, "c", tool, f"tool.{tool}", dict(args))
        return (await check(alice, row)).action

    try:
        yield verdict
    finally:
        await store.close()


async def _three(verdict: Verdict) -> list[str]:
    """alice's verdicts on an echo of "risky", one of "forbidden", and another tool."""
    return [await verdict("echo", text="risky"), await verdict("echo", text="forbidden"), await verdict("other")]


REMEMBERED_ALONE = [
    {"remembered": [ECHO_ALWAYS]},
    json.dumps({"remembered": [ECHO_ALWAYS]}),
    json.dumps({"remembered": [ECHO_ALWAYS]}).encode(),
    Policy(remembered=(Rule.model_validate(ECHO_ALWAYS),)),
]


@pytest.mark.parametrize("given", REMEMBERED_ALONE, ids=["dict", "text", "bytes", "Policy"])
async def test_remembered_rules_alone_given_in_code_sit_on_the_server_policy(tmp_path: Path, given: Any) -> None:
    async with checker(tmp_path, SERVER, {"alice": given}) as verdict:
        # her "always" answers the server's ask; the server's deny and default still hold
        assert await _three(verdict) == ["auto", "deny", "auto"]
    async with checker(tmp_path, STRICTER, {"alice": given}) as verdict:
        # the operator's later denies reach her (before: every call ran, the server-wide ones unseen)
        assert await _three(verdict) == ["deny", "deny", "deny"]
        assert await verdict("echo", text="hi") == "auto"


async def test_a_policy_of_its_own_given_in_code_still_replaces_the_server_policy(tmp_path: Path) -> None:
    own = {"default": "auto", "rules": [{"match": "tool.echo", "action": "ask"}], "remembered": [ECHO_ALWAYS]}
    for given in (own, json.dumps(own), Policy.model_validate(own), {"rules": []}, Policy(default="auto")):
        async with checker(tmp_path, STRICTER, {"alice": given}) as verdict:
            assert await _three(verdict) == ["auto", "auto", "auto"], given


async def test_a_kernel_account_policy_in_code_follows_the_server_policy_file(tmp_path: Path) -> None:
    process_support.ran.clear()
    policy_file = tmp_path / "policy.json"
    write(policy_file, SERVER)
    in_code = {"bob": {"remembered": [ECHO_ALWAYS]}}
    async with kernel(tmp_path, echo_model(), tools=[echo], policy=policy_file, account_policies=in_code) as k:
        bob = await k.spawn(owner="bob")
        assert [await outcome(bob, "risky"), await outcome(bob, "forbidden")] == ["risky", "deny"]
        write(policy_file, STRICTER)  # a server-wide deny, no restart: it reaches bob
        assert [await outcome(bob, "risky"), await outcome(bob, "hello")] == ["deny", "hello"]
    assert process_support.ran == ["risky", "hello"]
