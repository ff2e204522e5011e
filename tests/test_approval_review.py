"""Review of the approval policy engine: path arguments read as the tools read them, the policy
file's size, and what a remembered answer may allow."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from agentloop.process.approval import Policy, decide, default_policy, parse_policy, remember_rule
from agentloop.tools.paths import resolve_path
from tests.test_process_approval import calls_with_data_inside

CWD = "/home/ann/proj"
HOME = "/home/ann"


def policy(rules: list[dict[str, Any]], default: str = "auto") -> Policy:
    parsed, warnings = parse_policy({"default": default, "rules": rules})
    assert warnings == []
    return parsed


# -- an fs path is what the tools make of it -------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["$x/../data/home/alice/approval.json", "~nobody/../data/x", "`a`/../data/x", "~/../data/x"]
)
def test_fs_paths_the_tools_read_literally_still_reach_protected_data(tmp_path: Path, path: str) -> None:
    """The fs tools never expand ``$``, backticks or ``~``: ``$x/../data`` is ``<root>/data``. The
    guard on the kernel's own data must see that too, or any fs call can rewrite the policies."""
    (tmp_path / "data").mkdir()
    assert resolve_path(tmp_path, path).is_relative_to(tmp_path / "data")  # where the tool writes
    root, home = str(tmp_path), "/nonexistent/home/ann"  # (``~/..`` must not land in its parent)
    d = decide(default_policy(), "fs.write", {"path": path}, cwd=root, home=home, protected=[str(tmp_path / "data")])
    assert d.action == "deny" and d.rule == "protected"


@pytest.mark.parametrize("path", ["$x/../.env", "~other/../.env"])
def test_fs_hidden_path_is_tagged_for_literal_paths(path: str) -> None:
    rules = policy([{"match": "fs.*", "when": {"anyTag": ["hidden-path"]}, "action": "deny"}])
    assert decide(rules, "fs.read", {"path": path}, cwd=CWD, home=HOME).action == "deny"


@pytest.mark.parametrize(("command", "cwd"), [("cat data/x", "$x/.."), ("cat ../data/x", "~"), ("cat data/x", "~o/..")])
def test_shell_operands_are_judged_from_the_cwd_the_shell_tool_uses(tmp_path: Path, command: str, cwd: str) -> None:
    """The shell tool resolves ``cwd`` like the file tools (``$x/..`` is the workspace, ``~`` a
    directory named so in it): the operands must be judged from there."""
    (tmp_path / "data").mkdir()
    (tmp_path / "~").mkdir()
    root, home = str(tmp_path), "/nonexistent/home/ann"
    args = {"command": command, "cwd": cwd}
    d = decide(default_policy(), "shell.exec", args, cwd=root, home=home, protected=[str(tmp_path / "data")])
    assert d.action == "deny" and d.rule == "protected"


def test_fs_home_paths_keep_their_tags() -> None:
    d = decide(default_policy(), "fs.read", {"path": "~/.ssh/id_rsa"}, cwd=CWD, home=HOME)
    assert {"outside-cwd", "hidden-path"} <= set(d.tags)


# -- argPrefix on a path compares paths, not strings ----------------------------------------------


@pytest.mark.parametrize(
    "path", ["./.github/workflows/x.yml", "src/../.github/x.yml", f"{CWD}/.github/x", ".//.github/x", ".github"]
)
def test_arg_prefix_deny_on_a_path_is_not_bypassed_by_spelling(path: str) -> None:
    rules = policy([{"match": "fs.write", "when": {"argPrefix": {"path": ".github/"}}, "action": "deny"}])
    assert decide(rules, "fs.write", {"path": path}, cwd=CWD, home=HOME).action == "deny"


@pytest.mark.parametrize("path", ["build/../src/main.py", "build-keep/x", "/home/ann/proj/buildx", "../proj2/build/x"])
def test_arg_prefix_allow_on_a_path_does_not_over_match(path: str) -> None:
    rules = policy([{"match": "fs.delete", "when": {"argPrefix": {"path": "build"}}, "action": "auto"}], default="ask")
    assert decide(rules, "fs.delete", {"path": path}, cwd=CWD, home=HOME).action == "ask"


@pytest.mark.parametrize("path", ["build/x.o", "./build/sub/y", "build", f"{CWD}/build/z"])
def test_arg_prefix_allow_on_a_path_still_matches_inside(path: str) -> None:
    rules = policy([{"match": "fs.delete", "when": {"argPrefix": {"path": "build/"}}, "action": "auto"}], default="ask")
    assert decide(rules, "fs.delete", {"path": path}, cwd=CWD, home=HOME).action == "auto"


def test_arg_prefix_on_home_and_on_shell_cwd() -> None:
    rules = policy(
        [
            {"match": "fs.read", "when": {"argPrefix": {"path": "~/.ssh"}}, "action": "deny"},
            {"match": "shell.exec", "when": {"argPrefix": {"cwd": "/etc"}}, "action": "deny"},
        ]
    )
    assert decide(rules, "fs.read", {"path": "/home/ann/./.ssh/id_rsa"}, cwd=CWD, home=HOME).action == "deny"
    assert decide(rules, "shell.exec", {"command": "ls", "cwd": "/./etc"}, cwd=CWD, home=HOME).action == "deny"
    assert decide(rules, "shell.exec", {"command": "ls", "cwd": "/etcetera"}, cwd=CWD, home=HOME).action == "auto"


def test_arg_prefix_on_other_arguments_stays_a_string_prefix() -> None:
    rules = policy([{"match": "shell.exec", "when": {"argPrefix": {"command": "git "}}, "action": "deny"}])
    assert decide(rules, "shell.exec", {"command": "git status"}, cwd=CWD, home=HOME).action == "deny"
    assert decide(rules, "shell.exec", {"command": "gitk"}, cwd=CWD, home=HOME).action == "auto"
    mcp = policy([{"match": "mcp.*", "when": {"argPrefix": {"path": "a/"}}, "action": "deny"}])
    assert decide(mcp, "mcp.fs__read", {"path": "a/../b"}, cwd=CWD, home=HOME).action == "deny"


# -- the policy file --------------------------------------------------------------------------------


async def test_a_huge_policy_file_is_refused_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A policy file is a few rules; a huge one would be read whole into the server's memory at
    every change. It is refused (default policy, a warning that says why), not loaded."""
    from agentloop.process.approval.checker import policy_approval
    from agentloop.process.store import ProcessRecord, SQLiteStore, ToolCallRow

    policy_file = tmp_path / "approval.json"
    policy_file.write_text('{"default": "deny"}' + " " * (3 << 20))
    store = SQLiteStore(tmp_path / "a.db")
    await store.open()
    try:
        check = policy_approval(store, account_file=lambda owner: policy_file)
        alice = ProcessRecord("p1", "alice", "alice", str(tmp_path))
        row = ToolCallRow("d", "p1", "r", 0, "c", "echo", "tool.echo", {"text": "hi"})
        with caplog.at_level(logging.WARNING, logger="agentloop.approval"):
            verdict = await check(alice, row)
        assert verdict.action == "auto"  # the default policy, not the file's "deny"
        assert any("larger than" in r.getMessage() for r in caplog.records)
    finally:
        await store.close()


# -- remember ---------------------------------------------------------------------------------------


async def test_remember_turns_asks_into_autos_but_never_lifts_a_deny(tmp_path: Path) -> None:
    """ "Yes, and remember" answers a question: later calls the policy would ask about run unasked.
    A call the account's policy denies was never asked about, and stays denied."""
    from agentloop.process.approval.checker import OVERRIDES_KEY, policy_approval
    from agentloop.process.store import ProcessRecord, SQLiteStore, ToolCallRow

    account = {
        "default": "deny",
        "rules": [
            {"match": "shell.exec", "when": {"anyTag": ["network"]}, "action": "ask"},
            {"match": "shell.exec", "when": {"anyTag": ["privileged"]}, "action": "deny"},
        ],
    }
    store = SQLiteStore(tmp_path / "a.db")
    await store.open()
    try:
        check = policy_approval(store, accounts={"alice": account})
        alice = ProcessRecord("p1", "alice", "alice", str(tmp_path))

        async def verdict(command: str) -> str:
            row = ToolCallRow("d", "p1", "r", 0, "c", "shell", "shell.exec", {"command": command})
            return (await check(alice, row)).action

        assert [await verdict(c) for c in ("curl example.com", "sudo rm -rf /", "ls")] == ["ask", "deny", "deny"]
        async with store.transaction():
            await store.kv_set("p1", OVERRIDES_KEY, [remember_rule("shell.exec", "local").to_json()])
        assert [await verdict(c) for c in ("curl example.org", "sudo rm -rf /", "ls")] == ["auto", "deny", "deny"]
    finally:
        await store.close()


async def test_a_kernel_tool_cannot_rewrite_an_accounts_policy_through_a_literal_path(tmp_path: Path) -> None:
    """End to end: with the data directory inside the workspace, ``Write $x/../data/...`` (which
    the tool resolves to ``<root>/data/...``) and ``Shell cat data/...`` run from ``cwd="$x/.."``
    must be refused like ``data/...`` itself."""
    from agentloop import call

    data = tmp_path / "data"
    (data / "home" / "alice").mkdir(parents=True)
    attempts = [
        call("Write", path="$x/../data/home/alice/approval.json", content='{"default": "auto"}'),
        call("Shell", command="cat data/agentloop.db", cwd="$x/.."),
    ]
    results = await calls_with_data_inside(tmp_path, data, attempts)
    assert [r.is_error for r in results] == [True, True]
    assert all("agentloop's own data" in r.text for r in results)
    assert not (data / "home" / "alice" / "approval.json").exists()


async def test_always_at_the_chat_prompt_never_lifts_a_deny(tmp_path: Path) -> None:
    """The chat's in-memory runner remembers alike: "always" answers the questions the policy asks,
    and what it denies stays denied."""
    from agentloop.cli.approvals import PolicyHook
    from agentloop.loop.hooks import ToolCallInfo
    from agentloop.messages import AssistantMessage, ToolCall
    from agentloop.process.approval import parse_policy

    policy, _ = parse_policy(
        {
            "default": "deny",
            "rules": [{"match": "shell.exec", "when": {"anyTag": ["network"]}, "action": "ask"}],
        }
    )
    asked: list[str] = []

    async def ask(question: Any) -> Any:
        asked.append(question.args["command"])
        return "always"

    hook = PolicyHook(policy, cwd=tmp_path, ask=ask)

    async def run(command: str) -> bool:
        call = ToolCall(id="c", name="Shell", arguments={"command": command})
        info = ToolCallInfo(call, {"command": command}, AssistantMessage(), [], "r", syscall="shell.exec")
        return await hook(info) is None

    assert await run("curl example.com")  # asked, and remembered
    assert await run("curl example.org")  # not asked again
    assert not await run("ls")  # denied by the policy: "always" never reaches it
    assert asked == ["curl example.com"]
