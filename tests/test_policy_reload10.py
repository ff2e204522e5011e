"""A server-wide approval policy given as a file (``serve --approval PATH``, ``Kernel.open(policy=
Path(...))``) follows its edits as an account's ``approval.json`` does: its stamp is checked per
decision and it is parsed again only when that changes. It reaches the accounts without a file
and those whose file holds remembered rules alone (they sit on it); an account's own full policy
is unaffected. An edit that does not give a policy keeps the last good one, with one warning per
change; a policy given in code stays as it was given."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from agentloop.cli.approvals import parse_approval
from agentloop.process.approval import checker as checker_module
from agentloop.process.approval.checker import policy_approval
from agentloop.process.approval.policy import Policy, default_policy
from agentloop.process.store import ProcessRecord, SQLiteStore, ToolCallRow
from tests import process_support
from tests.process_support import echo, kernel
from tests.test_account_policy10 import ECHO_ALWAYS, SERVER, STRICTER, echo_model, outcome

Verdict = Callable[..., Awaitable[str]]
OWN = {"default": "auto", "rules": [{"match": "tool.echo", "action": "ask"}]}  # carol's own policy


def write(path: Path, data: Any) -> None:
    """``data`` (JSON, or text as it is) in ``path``, its stamp surely new (same size, same tick)."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


@asynccontextmanager
async def checker(tmp_path: Path, server: Any) -> AsyncIterator[Verdict]:
    """The verdicts of one checker for any account's calls: alice has no policy file, bob one of
    remembered rules alone (echo, always), carol one of her own."""
    write(tmp_path / "home" / "bob" / "approval.json", {"remembered": [ECHO_ALWAYS]})
    write(tmp_path / "home" / "carol" / "approval.json", OWN)
    store = SQLiteStore(tmp_path / "a.db")
    await store.open()
    check = policy_approval(
        store, server=server, account_file=lambda owner: tmp_path / "home" / owner / "approval.json"
    )

    async def verdict(owner: str, tool: str, **args: object) -> str:
        row = ToolCallRow("d", "p1", "r", 0, "c", tool, f"tool.{tool}", dict(args))
        return (await check(ProcessRecord("p1", owner, owner, str(tmp_path)), row)).action

    try:
        yield verdict
    finally:
        await store.close()


async def everyone(verdict: Verdict) -> dict[str, list[str]]:
    """Each account's verdicts on an echo of "risky", one of "forbidden", and another tool."""
    out = {}
    for owner in ("alice", "bob", "carol"):
        calls = [await verdict(owner, "echo", text="risky"), await verdict(owner, "echo", text="forbidden")]
        out[owner] = [*calls, await verdict(owner, "other")]
    return out


BEFORE = {"alice": ["ask", "deny", "auto"], "bob": ["auto", "deny", "auto"], "carol": ["ask", "ask", "auto"]}
AFTER = {"alice": ["deny", "deny", "deny"], "bob": ["deny", "deny", "deny"], "carol": ["ask", "ask", "auto"]}


async def test_an_edit_of_the_server_policy_file_reaches_the_next_decision(tmp_path: Path) -> None:
    server_file = tmp_path / "policy.json"
    write(server_file, SERVER)
    async with checker(tmp_path, server_file) as verdict:
        assert await everyone(verdict) == BEFORE
        write(server_file, STRICTER)  # the operator adds denies: no restart
        # alice (no file) and bob (remembered rules alone, on the server policy) follow; carol's own
        # policy replaces the server's, as before
        assert await everyone(verdict) == AFTER
        assert await verdict("bob", "echo", text="hi") == "auto"  # bob's "always" still answers
        write(server_file, SERVER)
        assert await everyone(verdict) == BEFORE


async def test_a_malformed_edit_keeps_the_last_good_policy_with_one_warning_per_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server_file = tmp_path / "policy.json"
    write(server_file, STRICTER)
    async with checker(tmp_path, server_file) as verdict:
        assert await everyone(verdict) == AFTER
        bad = [
            "{",  # not JSON (an editor's half-written file)
            '{"default": "sometimes"}',  # not a policy
            "",  # emptied (being written)
            "[]",
        ]
        for text in bad:
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="agentloop.approval"):
                write(server_file, text)
                for _ in range(3):  # never the default policy (risky echoes would ask, others run)
                    assert await everyone(verdict) == AFTER
            [warning] = [r.getMessage() for r in caplog.records]
            assert str(server_file) in warning and "the policy in force is kept" in warning
            assert "using the default policy" not in warning
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="agentloop.approval"):
            server_file.unlink()  # gone (being replaced): kept as well
            assert await everyone(verdict) == AFTER and await everyone(verdict) == AFTER
            assert len(caplog.records) == 1
            write(server_file, SERVER)  # fixed: followed at once
            assert await everyone(verdict) == BEFORE
            assert len(caplog.records) == 1


async def test_an_unchanged_file_is_not_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parses: list[str] = []
    merges: list[int] = []
    real_parse = checker_module.parse_policy
    real_merge = Policy.on_top_of

    def counted_parse(data: Any) -> Any:
        parses.append("server")
        return real_parse(data)

    def counted_merge(self: Any, inherited: Any) -> Any:
        merges.append(1)
        return real_merge(self, inherited)

    monkeypatch.setattr(checker_module, "parse_policy", counted_parse)
    monkeypatch.setattr(Policy, "on_top_of", counted_merge)
    server_file = tmp_path / "policy.json"
    write(server_file, SERVER)
    async with checker(tmp_path, server_file) as verdict:
        assert len(parses) == 1  # read as the kernel opens
        for _ in range(5):
            assert await everyone(verdict) == BEFORE
        assert (len(parses), len(merges)) == (1, 1)  # bob's rules were put on it once
        write(server_file, STRICTER)
        for _ in range(5):
            assert await everyone(verdict) == AFTER
        assert (len(parses), len(merges)) == (2, 2)  # once per change, for the server and for bob


async def test_startup_is_as_it_was(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file not valid when the kernel opens is the default policy with a warning, as
    ``parse_policy`` makes it (and ``--approval`` did); its later fix is followed. A file that
    cannot be read is an error, as for ``--approval``."""
    server_file = tmp_path / "policy.json"
    write(server_file, '{"default": "sometimes"}')
    with caplog.at_level(logging.WARNING, logger="agentloop.approval"):
        async with checker(tmp_path, server_file) as verdict:
            # DESIGN §3's default: it has no rule for echo, and lets the rest run
            assert [await verdict("alice", "echo", text="forbidden"), await verdict("alice", "other")] == ["auto"] * 2
            assert any("using the default policy" in r.getMessage() for r in caplog.records)
            write(server_file, STRICTER)
            assert (await everyone(verdict))["alice"] == AFTER["alice"]
    with pytest.raises(ValueError, match="cannot be read"):
        policy_approval(SQLiteStore(tmp_path / "b.db"), server=tmp_path / "missing.json")


async def test_a_policy_given_in_code_stays_fixed(tmp_path: Path) -> None:
    server_file = tmp_path / "policy.json"
    write(server_file, SERVER)
    for given in (SERVER, json.dumps(SERVER), Policy.model_validate(SERVER)):
        async with checker(tmp_path, given) as verdict:
            assert await everyone(verdict) == BEFORE
            write(server_file, STRICTER)  # (a file nobody named)
            assert await everyone(verdict) == BEFORE
            write(server_file, SERVER)


def test_approval_flag_hands_the_kernel_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "policy.json", SERVER)
    setting = parse_approval("policy.json")
    assert setting.kernel_options() == {"policy": tmp_path / "policy.json"}  # absolute: read again
    # for a local chat's one account the file as read now wins over its own file, as before
    assert setting.kernel_options("me") == {"policy": setting.policy, "account_policies": {"me": setting.policy}}
    write(tmp_path / "bad.json", "{")
    bad = parse_approval("bad.json")
    assert bad.warnings and bad.policy == default_policy()
    assert bad.kernel_options() == {"policy": tmp_path / "bad.json"}
    for word in ("ask", "deny"):
        assert parse_approval(word).kernel_options() == {"policy": parse_approval(word).policy}


async def test_a_kernel_follows_its_policy_file(tmp_path: Path) -> None:
    process_support.ran.clear()
    server_file = tmp_path / "policy.json"
    write(server_file, SERVER)
    bobs = tmp_path / "home" / "bob" / "approval.json"
    write(bobs, {"remembered": [ECHO_ALWAYS]})
    async with kernel(tmp_path, echo_model(), tools=[echo], **parse_approval(str(server_file)).kernel_options()) as k:
        alice, bob = await k.spawn(owner="alice"), await k.spawn(owner="bob")
        assert [await outcome(alice, "risky"), await outcome(bob, "risky")] == ["ask", "risky"]
        write(server_file, STRICTER)
        assert [await outcome(alice, "risky"), await outcome(bob, "risky")] == ["deny", "deny"]
        assert await outcome(bob, "hello") == "hello"
    assert process_support.ran == ["risky", "hello"]
