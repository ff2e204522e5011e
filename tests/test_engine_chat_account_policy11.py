"""``/engine/chat`` applies the calling account's approval policy, as that account's processes do.

The stateless endpoint used to apply the server-wide policy alone: an account whose own
``approval.json`` denied ``shell.exec`` could still run Shell there. Now the server, which knows the
principal behind the token, puts the account's policy in force on the request's agent: the same
``Kernel.policies`` book the processes' checks ask, so a file's edits reach both without a restart,
and a file of ``remembered`` rules alone sits on the server-wide policy in both."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from agentloop import Agent, ScriptedModel
from agentloop.cli.approvals import parse_approval
from agentloop.cli.config import Settings
from agentloop.cli.serve import BackgroundServer, ServeOptions
from agentloop.models.registry import register_provider
from agentloop.process.approval.checker import PolicyBook, policy_approval
from agentloop.process.approval.policy import Policy
from agentloop.process.store import SQLiteStore
from agentloop.server.engine_chat import EngineChat
from tests.process_support import echo, kernel
from tests.test_account_policy10 import ECHO_ALWAYS, SERVER, echo_model, outcome
from tests.test_policy_live11 import SHELL_DENIED, _shell_script, _tool_result
from tests.test_policy_reload10 import write

ALLOW_ALL = {"default": "auto"}
DENIED = "Tool execution denied by rules[0] shell.exec -> deny"


class Served:
    """A running ``serve`` and a client per account: ``shell(account, command)`` asks
    ``/engine/chat`` to run ``command`` through Shell and gives the ``tool-result`` event."""

    def __init__(self, url: str, tokens: dict[str, str], data: Path) -> None:
        self.url, self.tokens, self.data = url, tokens, data

    def policy_file(self, account: str) -> Path:
        return self.data / "home" / account / "approval.json"

    def shell(self, account: str, command: str) -> dict[str, Any]:
        body = {"messages": [{"role": "user", "content": command}], "metadata": {"correlation_id": "c11"}}
        headers = {"Authorization": f"Bearer {self.tokens[account]}"}
        with httpx.Client(base_url=self.url, timeout=30, headers=headers) as client:
            reply = client.post("/engine/chat", json=body)
        assert reply.status_code == 200, reply.text
        return _tool_result(reply.text)


@contextmanager
def served(tmp_path: Path, server_policy: Any, accounts: tuple[str, ...] = ("alice", "bob")) -> Iterator[Served]:
    """``agentloop serve`` with ``server_policy`` in a file (``--approval PATH``) and a token for
    each of ``accounts`` (made first) and for ``admin``, whose token the first start prints."""
    register_provider("acctpolicy11", lambda _id: ScriptedModel(_shell_script))
    ws, data = tmp_path / "ws", (tmp_path / "data").resolve()
    ws.mkdir()
    policy_file = tmp_path / "policy.json"
    write(policy_file, server_policy)
    settings = Settings(model="acctpolicy11:x", model_source="test")
    out = io.StringIO()
    opts = ServeOptions("127.0.0.1", 0, data, ws.resolve(), settings, parse_approval(str(policy_file)), out=out)
    server = BackgroundServer(opts, start_timeout=60)
    running = server.start()
    try:
        tokens = {}
        for account in accounts:
            server.call(running.ctx.accounts.create_account(account))
            tokens[account], _ = server.call(running.ctx.accounts.create_token(account))
        tokens["admin"], _ = server.call(running.ctx.accounts.create_token("admin"))
        yield Served(running.url, tokens, data)
    finally:
        server.stop()


def ran(result: dict[str, Any], text: str) -> bool:
    return "error" not in result and text in json.dumps(result)


def test_an_accounts_own_deny_reaches_its_engine_chat_and_an_edit_lifts_it(tmp_path: Path) -> None:
    with served(tmp_path, ALLOW_ALL) as srv:
        write(srv.policy_file("alice"), SHELL_DENIED)
        assert srv.shell("alice", "echo hi-11")["error"].startswith(DENIED)  # (before: it ran)
        assert ran(srv.shell("bob", "echo hi-11"), "hi-11")  # no file of his: the server-wide policy
        write(srv.policy_file("alice"), ALLOW_ALL)  # alice's file edited: no restart
        assert ran(srv.shell("alice", "echo again-11"), "again-11")


def test_remembered_rules_alone_inherit_the_server_deny_on_engine_chat(tmp_path: Path) -> None:
    with served(tmp_path, SHELL_DENIED) as srv:
        write(srv.policy_file("alice"), {"remembered": [ECHO_ALWAYS]})
        assert srv.shell("alice", "echo hi-11")["error"].startswith(DENIED)  # on the server's, as processes
        write(srv.policy_file("bob"), ALLOW_ALL)  # a policy of his own replaces the server's
        assert ran(srv.shell("bob", "echo hi-11"), "hi-11")


def test_an_admin_is_under_its_own_accounts_policy_as_its_processes_are(tmp_path: Path) -> None:
    with served(tmp_path, ALLOW_ALL, accounts=("alice",)) as srv:
        write(srv.policy_file("alice"), SHELL_DENIED)
        assert ran(srv.shell("admin", "echo admin-11"), "admin-11")  # not alice's, nor anyone's but its own
        write(srv.policy_file("admin"), SHELL_DENIED)
        assert srv.shell("admin", "echo admin-11")["error"].startswith(DENIED)


async def test_processes_and_engine_chat_ask_the_same_book(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    policy_file = tmp_path / "policy.json"
    write(policy_file, SERVER)
    write(tmp_path / "home" / "alice" / "approval.json", {"remembered": [ECHO_ALWAYS]})
    async with kernel(tmp_path, echo_model(), tools=[echo], policy=policy_file) as k:
        assert k.policies is not None
        asked: list[tuple[str, Policy]] = []
        of = k.policies.of

        def spy(owner: str) -> Policy:
            policy = of(owner)
            asked.append((owner, policy))
            return policy

        monkeypatch.setattr(k.policies, "of", spy)
        alice = await k.spawn(owner="alice")
        assert await outcome(alice, "risky") == "risky"  # her "always" answers the server's ask
        # the processes' check asked the kernel's book, and got the very policy /engine/chat gets
        assert asked and {owner for owner, _ in asked} == {"alice"}
        assert all(policy is of("alice") for _, policy in asked)
        mine = Policy.model_validate({"remembered": [ECHO_ALWAYS]})
        assert of("alice") == mine.on_top_of(k.policies.server())  # (remembered rules alone: on the server's)
        assert of("bob") is k.policies.server()  # no file: the server-wide policy itself


def test_an_agent_its_caller_could_not_be_fitted_to_never_runs() -> None:
    """A ``prepare`` that fails (the policy cannot be had) refuses the request: no run without it."""
    model = ScriptedModel(["never"])

    def prepare(token: str, agent: Agent) -> None:
        raise RuntimeError("no policy")

    chat = EngineChat(lambda: Agent(model), lambda token: token == "t", prepare=prepare)
    app = Starlette(routes=[Route("/engine/chat", chat.handle, methods=["POST"])])
    body = {"messages": [{"role": "user", "content": "hi"}], "metadata": {"correlation_id": "c11"}}
    with TestClient(app) as client:
        reply = client.post("/engine/chat", json=body, headers={"Authorization": "Bearer t"})
    assert reply.status_code == 503 and reply.json()["code"] == "engine_unavailable"
    assert model.requests == []


def test_policy_approval_takes_a_book_or_what_it_is_made_of_not_both(tmp_path: Path) -> None:
    book = PolicyBook(ALLOW_ALL)
    with pytest.raises(TypeError, match="not both"):
        policy_approval(SQLiteStore(tmp_path / "a.db"), policies=book, server=SHELL_DENIED)
