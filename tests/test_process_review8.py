"""Regression tests from a hostile-usage review of the durable process API: bad arguments are
refused by name before anything is stored, and a caller waiting on a process is never left
hanging when the runtime closes."""

from __future__ import annotations

import asyncio

import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.kernel import Kernel, NoSuchProcess
from agentloop.messages import FileContent, UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process.store import StoreError
from tests.process_support import (
    closed_gates,  # noqa: F401  (the autouse fixture: no gate left closed)
    gate,
    gate_tool,
    kernel,
)

TEXT = "aGVsbG8="  # "hello", a valid text document


def gated(request: ModelRequest) -> Reply | str:
    """Waits at the gate named by the user's text, then answers."""
    last = request.messages[-1]
    if isinstance(last, UserMessage):
        return Reply(tool_calls=[call("gate", name=last.text)])
    return "done"


async def test_wait_idle_ends_when_the_kernel_closes_with_a_run_under_way(tmp_path):
    gate("never")
    async with kernel(tmp_path, ScriptedModel(gated), tools=[gate_tool]) as k:
        proc = await k.spawn(owner="a")
        await proc.send("never")
        waiter = asyncio.create_task(proc.wait_idle())
        await asyncio.sleep(0.05)
        assert not waiter.done()
    with pytest.raises(StoreError, match=r"closed while process \w+ had a run under way"):
        await asyncio.wait_for(waiter, 2)


async def test_wait_idle_of_an_idle_process_still_returns_as_the_kernel_closes(tmp_path):
    async with kernel(tmp_path, ScriptedModel(["hi"])) as k:
        proc = await k.spawn(owner="a")
        await proc.send("hello")
        await proc.wait_idle()
        k.engine.closing = True  # (as ``close`` begins)
        await asyncio.wait_for(proc.wait_idle(), 1)
        k.engine.closing = False


@pytest.mark.parametrize(
    ("name", "error", "match"),
    [
        ("a\ud800", ValueError, "lone surrogate"),
        ("a\x00b", ValueError, "NUL"),
        ("x" * 256, ValueError, "at most 255"),
        ("two\nlines", ValueError, "control characters"),
    ],
)
async def test_a_bad_document_name_is_refused_before_anything_is_stored(tmp_path, name, error, match):
    async with kernel(tmp_path, ScriptedModel(["hi"])) as k:
        proc = await k.spawn(owner="a")
        doc = FileContent(data=TEXT, mime_type="text/plain", name=name)
        with pytest.raises(error, match=match):
            await proc.send("read this", media=[doc])
        assert await proc.history() == []
        assert not k.media.process_dir("a", proc.pid).exists()


async def test_spawn_refuses_bad_kv_cwd_and_run_as_by_name(tmp_path):
    async with kernel(tmp_path, ScriptedModel(["hi"])) as k:
        with pytest.raises(TypeError, match="kv must be a mapping"):
            await k.spawn(owner="a", kv=[("k", 1)])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="kv keys must be non-empty strings"):
            await k.spawn(owner="a", kv={1: "x"})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match=r"kv\['k'\] cannot be stored"):
            await k.spawn(owner="a", kv={"k": object()})
        with pytest.raises(TypeError, match="cwd must be a path"):
            await k.spawn(owner="a", cwd=5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="invalid run_as"):
            await k.spawn(owner="a", run_as="")
        assert await k.processes() == []


async def test_a_child_must_have_its_parents_owner(tmp_path):
    async with kernel(tmp_path, ScriptedModel(["hi"])) as k:
        parent = await k.spawn(owner="alice")
        with pytest.raises(ValueError, match="a child has its parent's owner"):
            await k.spawn(owner="bob", parent_pid=parent.pid)
        child = await k.spawn(owner="alice", parent_pid=parent.pid)
        await parent.kill()
        with pytest.raises(NoSuchProcess):
            await child.info()  # (killed with its parent, as every child is)


async def test_a_non_boolean_remember_answers_nothing(tmp_path):
    async with kernel(tmp_path, ScriptedModel(["hi"])) as k:
        proc = await k.spawn(owner="a")
        with pytest.raises(TypeError, match="remember must be true or false"):
            await proc.hil("req", "approve", remember="false")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="request_id must be a string"):
            await proc.hil(5, "approve")  # type: ignore[arg-type]


async def test_abort_and_stop_refuse_a_run_id_that_is_not_a_string(tmp_path):
    async with kernel(tmp_path, ScriptedModel(["hi"])) as k:
        proc = await k.spawn(owner="a")
        for ending in (proc.abort, proc.stop):
            with pytest.raises(TypeError, match="run_id must be a string or None"):
                await ending(5)  # type: ignore[arg-type]
            assert await ending("an-old-run") is False  # a stale id still does nothing


@pytest.mark.parametrize("url", [None, 5])
async def test_a_store_url_that_is_not_a_string_is_named(url):
    with pytest.raises(TypeError, match="store URL must be a string"):
        async with Kernel.open(url, model=ScriptedModel(["hi"])):  # type: ignore[arg-type]
            pass
