"""An account's ``approval.json`` of remembered rules alone ("always, for this account" where the
account had no file) adds them to the server-wide policy instead of freezing a copy of it: a deny
the operator adds server-wide later reaches the account, the remembered rules still answer what
they cover, and a file with its own ``default``/``rules`` still replaces the server-wide policy."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, ToolResultMessage, call
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process.approval.checker import policy_amender, policy_approval
from agentloop.process.approval.policy import Policy, Rule
from agentloop.process.store import ProcessRecord, SQLiteStore, ToolCallRow
from tests import process_support
from tests.process_support import echo, kernel

# every echo asks, an echo of "forbidden" is refused
SERVER = {
    "default": "auto",
    "rules": [
        {"match": "tool.echo", "when": {"argEquals": {"text": "forbidden"}}, "action": "deny"},
        {"match": "tool.echo", "action": "ask"},
    ],
}
# the operator's later change: an echo of "risky" is refused too, and so is every other tool
STRICTER = {
    "default": "deny",
    "rules": [
        {"match": "tool.echo", "when": {"argEquals": {"text": "risky"}}, "action": "deny"},
        *SERVER["rules"],
    ],
}
ECHO_ALWAYS = {"match": "tool.echo", "target": "local", "action": "auto"}

Verdict = Callable[..., Awaitable[str]]


@asynccontextmanager
async def checker(tmp_path: Path, server: Any, policy_file: Path) -> AsyncIterator[Verdict]:
    """The verdicts of a fresh checker (a server started with ``server``) for alice's calls."""
    store = SQLiteStore(tmp_path / f"a{len(list(tmp_path.glob('a*.db')))}.db")
    await store.open()
    check = policy_approval(store, server=server, account_file=lambda owner: policy_file)
    alice = ProcessRecord("p1", "alice", "alice", str(tmp_path))

    async def verdict(tool: str, **args: object) -> str:
        row = ToolCallRow("d", "p1", "r", 0, "c", tool, f"tool.{tool}", dict(args))
        return (await check(alice, row)).action

    try:
        yield verdict
    finally:
        await store.close()


def test_a_file_without_default_or_rules_inherits() -> None:
    from agentloop.process.approval.policy import parse_account_policy

    policy, inherits, problems = parse_account_policy(json.dumps({"remembered": [ECHO_ALWAYS]}))
    assert problems == [] and inherits and policy.remembered == (Rule.model_validate(ECHO_ALWAYS),)
    assert parse_account_policy("{}")[1:] == (True, [])
    for own in ({"default": "auto", "remembered": [ECHO_ALWAYS]}, {"rules": []}, SERVER):
        assert parse_account_policy(json.dumps(own))[1:] == (False, [])
    for bad in ('{"remembered": [{"match": "tool.echo", "action": "deny"}]}', "[1]", "{", ""):
        assert parse_account_policy(bad)[1] is False
    server = Policy.model_validate(STRICTER)
    merged = policy.on_top_of(server)
    assert merged.default == "deny" and merged.rules == server.rules and merged.remembered == policy.remembered
    assert Policy().on_top_of(server) is server  # (nothing to add: the server-wide policy itself)


async def test_remembered_rules_alone_sit_on_the_server_policy_and_follow_its_changes(tmp_path: Path) -> None:
    policy_file = tmp_path / "approval.json"
    policy_file.write_text(json.dumps({"remembered": [ECHO_ALWAYS]}))
    async with checker(tmp_path, SERVER, policy_file) as verdict:
        assert [await verdict("echo", text=t) for t in ("risky", "forbidden")] == ["auto", "deny"]
        assert await verdict("other") == "auto"  # the server-wide default
    # the operator restarts the server with a stricter policy: it reaches alice
    async with checker(tmp_path, STRICTER, policy_file) as verdict:
        assert [await verdict("echo", text=t) for t in ("risky", "forbidden", "hi")] == ["deny", "deny", "auto"]
        assert await verdict("other") == "deny"
        # the account's file changes: followed at the next call, still on the server-wide policy
        policy_file.write_text(json.dumps({"remembered": []}) + "  ")
        assert await verdict("echo", text="hi") == "ask"
        policy_file.write_text(json.dumps({"remembered": [ECHO_ALWAYS]}))
        assert await verdict("echo", text="hi") == "auto"


async def test_a_file_with_its_own_rules_is_unaffected_by_the_server_policy(tmp_path: Path) -> None:
    policy_file = tmp_path / "approval.json"
    own = {"default": "auto", "rules": [{"match": "tool.echo", "action": "ask"}], "remembered": [ECHO_ALWAYS]}
    policy_file.write_text(json.dumps(own))
    for server in (SERVER, STRICTER):
        async with checker(tmp_path, server, policy_file) as verdict:
            calls = [await verdict("echo", text=t) for t in ("risky", "forbidden")]
            assert [*calls, await verdict("other")] == ["auto", "auto", "auto"]


@pytest.mark.parametrize(
    "text",
    [
        '{"remembered": [{"match": "tool.echo", "action": "deny"}]}',  # (remembered rules are allows)
        '{"remembered": [{"match": "tool echo", "action": "auto"}]}',
        '{"remembered": "tool.echo"}',
    ],
)
async def test_a_malformed_file_of_remembered_rules_is_the_default_policy_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str
) -> None:
    policy_file = tmp_path / "approval.json"
    policy_file.write_text(text)
    with caplog.at_level(logging.WARNING, logger="agentloop.approval"):
        async with checker(tmp_path, STRICTER, policy_file) as verdict:
            # the built-in default policy (echo runs, so does the rest), not the server-wide one
            assert [await verdict("echo", text="risky"), await verdict("other")] == ["auto", "auto"]
    assert any("using the default policy" in r.getMessage() and "alice" in r.getMessage() for r in caplog.records)


def test_the_amender_writes_the_rule_alone_where_there_was_no_file(tmp_path: Path) -> None:
    files = {name: tmp_path / name / "approval.json" for name in ("alice", "bob")}
    amend = policy_amender(account_file=lambda owner: files[owner])
    alice = ProcessRecord("p1", "alice", "alice", str(tmp_path))
    echo_rule = Rule.model_validate(ECHO_ALWAYS)
    amend(alice, echo_rule)
    assert json.loads(files["alice"].read_text()) == {"remembered": [ECHO_ALWAYS]}
    amend(alice, echo_rule)  # (the same answer again: kept once)
    other = Rule(match="tool.slow", action="auto")
    amend(alice, other)
    assert json.loads(files["alice"].read_text()) == {"remembered": [ECHO_ALWAYS, other.to_json()]}
    # a file of the account's own keeps what it says, the rule added
    files["bob"].parent.mkdir()
    files["bob"].write_text(json.dumps(SERVER))
    amend(ProcessRecord("p2", "bob", "bob", str(tmp_path)), echo_rule)
    assert json.loads(files["bob"].read_text()) == {**SERVER, "remembered": [ECHO_ALWAYS]}


def echo_model() -> ScriptedModel:
    """Each run calls echo with the run's message as its text, then answers with the result."""

    def script(req: ModelRequest) -> Reply | str:
        last_user = max(i for i, m in enumerate(req.messages) if isinstance(m, UserMessage))
        done = [m for m in req.messages[last_user:] if isinstance(m, ToolResultMessage)]
        if not done:
            message = req.messages[last_user]
            assert isinstance(message, UserMessage)
            return Reply(tool_calls=[call("echo", text=message.text)])
        return f"done: {done[-1].text}"

    return ScriptedModel(script)


async def outcome(proc: Any, text: str) -> str:
    """``ask`` (then denied, to end the run), or the result of the echo the run made."""
    await proc.send(text)
    for _ in range(500):
        if pending := await proc.pending_approvals():
            await proc.hil(pending[0].request_id, "deny")
            await proc.wait_idle()
            return "ask"
        if (await proc.info()).current_run is None:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("neither asked nor finished")
    result = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)][-1]
    return "deny" if result.text.startswith("Tool execution denied by policy") else result.text


async def test_an_accounts_always_keeps_later_server_wide_denies(tmp_path: Path) -> None:
    process_support.ran.clear()
    policy_file = tmp_path / "home" / "alice" / "approval.json"
    async with kernel(tmp_path, echo_model(), tools=[echo], policy=SERVER) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("risky")
        for _ in range(500):
            if pending := await proc.pending_approvals():
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("no approval was requested")
        await proc.hil(pending[0].request_id, "approve", remember="account")
        await proc.wait_idle()
        [rule] = json.loads(policy_file.read_text())["remembered"]
        assert json.loads(policy_file.read_text()) == {"remembered": [rule]}  # the rule alone
        later = await k.spawn(owner="alice")
        assert await outcome(later, "risky") == "risky"  # not asked: the rule answers
        assert await outcome(later, "forbidden") == "deny"  # the server's deny stands
        assert await outcome(await k.spawn(owner="bob"), "risky") == "ask"
    # the operator makes the server-wide policy stricter: alice's account follows it
    async with kernel(tmp_path, echo_model(), tools=[echo], policy=STRICTER) as k:
        alice = await k.spawn(owner="alice")
        assert await outcome(alice, "risky") == "deny"  # the new deny reaches the account
        assert await outcome(alice, "hello") == "hello"  # what the rule covers still runs unasked
        assert await outcome(await k.spawn(owner="bob"), "hello") == "ask"
    assert process_support.ran == ["risky", "risky", "hello"]
