"""Guarantees the read-through found without a test of their own: an aborted run forgets the
decisions a person gave its nested calls, as a finished one does; a lock error that is not
SQLite's "busy" fails the transaction at once instead of being waited out; a process group
recorded before a reboot, or the runtime's own, is never signalled; Fetch ignores the
environment's proxies."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.process.approval import Policy, Rule, default_policy
from agentloop.process.store import SQLiteStore, StoreError
from agentloop.tools.builtin import builtin_tools
from agentloop.tools.fetch import fetch_url
from agentloop.tools.process_group import GroupIdentity, end_left_group
from tests import test_tools_fetch
from tests.process_support import kernel
from tests.test_hil_message import pending_of
from tests.test_tools_fetch import LOCAL, Site, text

site = test_tools_fetch.site  # the local web site fixture, under its name here


async def test_an_aborted_run_forgets_its_nested_denials(tmp_path: Path) -> None:
    (tmp_path / "g.txt").write_text("x")
    (tmp_path / "h.txt").write_text("x")
    code = textwrap.dedent(
        """
        try:
            await delete("g.txt")
        except ToolDenied as exc:
            print(exc)
        await delete("h.txt")
        """
    ).strip()
    trust = Policy(default="auto", rules=(Rule(match="codemode.exec", action="auto"), *default_policy().rules))
    model = ScriptedModel([Reply(tool_calls=[call("CodeMode", code=code)]), "done"])
    async with kernel(tmp_path, model, tools=builtin_tools(tmp_path, codemode=True), policy=trust.to_json()) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        first = await pending_of(proc)
        await proc.hil(first.request_id, "deny", message="keep g.txt")
        for _ in range(500):  # the program goes on to its second call, which asks again
            pending = await proc.pending_approvals()
            if pending and pending[0].request_id != first.request_id:
                break
            await asyncio.sleep(0.01)
        assert await k.store.kv_get(proc.pid, f"denied:{first.run_id}") == {first.dispatch_id: "keep g.txt"}
        await proc.abort()
        await proc.wait_idle()
        assert await k.store.kv_get(proc.pid, f"denied:{first.run_id}") is None
        assert await k.store.kv_get(proc.pid, f"approved:{first.run_id}") is None
    assert (tmp_path / "g.txt").exists() and (tmp_path / "h.txt").exists()


async def test_a_lock_error_other_than_busy_fails_at_once(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "agentloop.db")
    await store.open()
    try:
        locked = sqlite3.OperationalError("database table is locked")
        locked.sqlite_errorcode = sqlite3.SQLITE_LOCKED  # type: ignore[attr-defined]
        started = time.monotonic()
        with pytest.raises(StoreError, match="is busy"):
            await store._wait_for_write_lock(store.db, locked)
        assert time.monotonic() - started < 0.05  # not waited out
    finally:
        await store.close()


async def test_a_group_recorded_before_a_reboot_or_as_the_runtimes_own_is_never_signalled() -> None:
    sleeper = await asyncio.create_subprocess_exec("sleep", "30", start_new_session=True)
    try:
        now = GroupIdentity.of(sleeper.pid, None)
        assert now.start is not None and now.boot is not None
        assert not await end_left_group(replace(now, boot="another-boot"), grace=0.1)
        own = GroupIdentity.of(os.getpgrp(), None)
        assert not await end_left_group(own, grace=0.1)
        assert sleeper.returncode is None  # alive: nothing was sent to it
        assert await end_left_group(now, grace=0.1)  # the same record, this boot: stopped
        await asyncio.wait_for(sleeper.wait(), 5)
    finally:
        if sleeper.returncode is None:
            sleeper.kill()
            await sleeper.wait()


async def test_fetch_goes_direct_to_this_machine_whatever_proxy_the_environment_names(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there: using it would fail
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    result = await fetch_url(site.url("/text"), allow=LOCAL)
    assert "héllo wörld" in text(result)
