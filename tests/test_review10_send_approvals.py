"""Review of send arbitration (``mode="reject"``, ``expected_run_id``) and of the richer approvals
(edited arguments, remember scopes): the holes found, each pinned by a test that failed before
its fix.

- A ``reject`` was admitted to a process with no run while input waited in its queue to start
  one (input another worker queued for the holder, not promoted yet): two callers were each
  told they had started the process's one run.
- An "always, for this account" answer replaced an account's policy file that is a link (to a
  policy kept elsewhere, maybe shared) with a copy: the account stopped following that policy.
  It also dropped the file's permissions (a private policy became world-readable).
- The chat's ``e`` put the arguments in the terminal's prompt with a bidirectional override
  (or another format character) as it is, so the line to edit could show other text than it
  sends, which the question itself never allows.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from agentloop.cli.approvals import Edited, Question, ask_user, parse_arguments
from agentloop.kernel import Kernel, RunActive
from agentloop.messages import user
from tests import process_support
from tests.process_support import echo, kernel
from tests.server_support import wait_until
from tests.test_approval_edit10 import ASK_ECHO, echo_model, pending_of
from tests.test_send_precondition10 import Gated, texts

# ---------------------------------------------------------------------------------- reject


async def test_a_reject_is_refused_while_queued_input_waits_to_start_a_run(tmp_path: Path) -> None:
    """Idle, but with input queued for the next run (as another worker queues it for the holder
    to promote): a reject would start a run ahead of it, or after it, both callers told they
    started the process's one run. It is refused, and names the run that input starts."""
    gated = Gated()
    url = f"sqlite:///{tmp_path}/agentloop.db"
    async with Kernel.open(url, model=gated.model, workspace=tmp_path, data_dir=tmp_path) as k:
        proc = await k.spawn(owner="alice")
        live = await k.engine.live(proc.pid)
        async with k.engine._tx(live) as tx:  # queued, not promoted yet
            await tx.enqueue("queue", user("first"), "run-first")
        assert (await proc.info()).current_run is None
        with pytest.raises(RunActive) as refused:
            await proc.send("only if idle", mode="reject")
        assert refused.value.run_id == "run-first"
        assert [q.message.text for q in await proc.queued()] == ["first"]  # nothing added
        await k.engine.promote(live)
        await asyncio.wait_for(proc.wait_idle(), 5)
        assert await texts(proc) == ["first", "re: first"]
        assert {m.run_id for m in await proc.history()} == {"run-first"}
        # idle again with nothing waiting: a reject starts its run, as before
        receipt = await proc.send("now", mode="reject")
        assert not receipt.queued
        await asyncio.wait_for(proc.wait_idle(), 5)


async def test_two_workers_a_reject_is_refused_while_input_another_queued_waits(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B (not holding the process) queues a reject's input for A to start: until A has started
    it, a second reject through B, or through A itself, finds the process busy."""
    pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")
    from tests.test_scale_out import kept_by, worker

    gated = Gated()
    async with (
        worker(pg_url, tmp_path, "A", gated.model, []) as a,
        worker(pg_url, tmp_path, "B", gated.model, []) as b,
    ):
        proc_a = await a.spawn(owner="alice")
        await kept_by(a, proc_a.pid)
        proc_b = await b.process(proc_a.pid)
        promote = a.engine.promote

        async def later(live: Any) -> None:  # (A starts the queued run only when the test lets it)
            return None

        monkeypatch.setattr(a.engine, "promote", later)
        first = await proc_b.send("first", mode="reject")
        assert not first.queued
        with pytest.raises(RunActive) as through_b:
            await proc_b.send("second", mode="reject")
        with pytest.raises(RunActive) as through_a:
            await proc_a.send("third", mode="reject")
        assert through_b.value.run_id == through_a.value.run_id == first.run_id
        assert [q.message.text for q in await proc_b.queued()] == ["first"]
        monkeypatch.setattr(a.engine, "promote", promote)
        await promote(await a.engine.live(proc_a.pid))

        async def answered() -> bool:
            return "re: first" in await texts(proc_b) and (await proc_b.info()).current_run is None

        await wait_until(answered, 10)
        assert {m.run_id for m in await proc_b.history()} == {first.run_id}
        assert not {"second", "third"} & set(gated.seen())


# ---------------------------------------------------------------------------------- the account's file


async def test_a_linked_policy_file_is_not_replaced_by_an_account_rule(tmp_path: Path) -> None:
    process_support.ran.clear()
    shared = tmp_path / "shared-policy.json"
    shared.write_text(json.dumps(ASK_ECHO))
    (tmp_path / "home" / "alice").mkdir(parents=True)
    link = tmp_path / "home" / "alice" / "approval.json"
    link.symlink_to(shared)
    async with kernel(tmp_path, echo_model(), tools=[echo]) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        ask = await pending_of(proc)
        with pytest.raises(ValueError, match="link"):
            await proc.hil(ask.request_id, "approve", remember="account")
        assert [p.request_id for p in await proc.pending_approvals()] == [ask.request_id]  # still pending
        await proc.hil(ask.request_id, "approve", remember="process")  # (what it says to do instead)
        await proc.wait_idle()
    assert link.is_symlink() and link.resolve() == shared.resolve()
    assert json.loads(shared.read_text()) == ASK_ECHO  # the shared policy is untouched
    assert process_support.ran == ["risky"]


async def test_an_amended_policy_file_keeps_its_permissions(tmp_path: Path) -> None:
    process_support.ran.clear()
    (tmp_path / "home" / "alice").mkdir(parents=True)
    path = tmp_path / "home" / "alice" / "approval.json"
    path.write_text(json.dumps(ASK_ECHO))
    path.chmod(0o600)
    old = os.umask(0o022)
    try:
        async with kernel(tmp_path, echo_model(), tools=[echo]) as k:
            proc = await k.spawn(owner="alice")
            await proc.send("go")
            ask = await pending_of(proc)
            await proc.hil(ask.request_id, "approve", remember="account")
            await proc.wait_idle()
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(json.loads(path.read_text())["remembered"]) == 1
    assert [p.name for p in path.parent.iterdir()] == ["approval.json"]  # no temporary file left
    assert process_support.ran == ["risky"]


# ---------------------------------------------------------------------------------- the chat's prompt


async def test_the_arguments_to_edit_show_format_characters_escaped() -> None:
    """The line put in the terminal's prompt shows a bidirectional override (or a control
    character) as its JSON escape, and sent back unchanged it is the same arguments."""
    command = "echo safe \u202e#fr- mr\u2066 \x1b[2K"
    seen: list[str] = []

    async def prefilled(prompt: str, text: str) -> str:
        seen.append(text)
        return text

    async def read(prompt: str) -> str:
        return "e"

    err = Console(file=io.StringIO(), width=200)
    question = Question("Shell", {"command": command}, (), "why", "r1", editable=True)
    answer = await ask_user(question, read, err, shows_prompt=True, prefilled=prefilled)
    [line] = seen
    assert all(c.isprintable() for c in line), line
    assert "\\u202e" in line and "\\u2066" in line and "\\u001b" in line
    assert answer == Edited({"command": command}) and parse_arguments(line) == {"command": command}
