"""A conversation's own model (``Process.set_model``) is the one every model call made for it uses,
not only its runs: the generated title (``titles="model"``), the summary and memories of a manual,
threshold or overflow compaction, the memories a reset keeps, the context window reported before
its first model step, and its subagents (``Task``), which inherit the choice. Over the WebSocket API
``proc.model.get`` / ``proc.model.set``; in the remote chat (``agentloop chat --server``) ``/model``."""

from __future__ import annotations

import asyncio
import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from agentloop import Reply, ScriptedModel, SystemMessage, ToolResultMessage, UserMessage, call
from agentloop.cli.chat import ChatRepl, PlainReader
from agentloop.cli.client import RemoteSession
from agentloop.client import AgentloopClient
from agentloop.kernel import Kernel, Process
from agentloop.kernel.titles import TITLE_PROMPT
from agentloop.models.base import ModelInfo, ModelRequest
from agentloop.models.registry import register_provider
from agentloop.process.compaction import MEMORY_SYSTEM_PROMPT, SUMMARY_KIND, SUMMARY_SYSTEM_PROMPT, estimate_tokens
from agentloop.process.engine import MODEL_KEY
from agentloop.process.pressure import usable_window
from tests import server_support
from tests.server_support import LiveServer
from tests.ws_support import KernelServer

MODELS: dict[str, ScriptedModel] = {}  # model id of the ``pu`` provider -> its (one) model
SMALL = ModelInfo(provider="pu", id="small", context_window=9_000, max_output=1_000)
LONG = "lorem ipsum dolor sit amet " * 80  # about 540 tokens


def _script(name: str):  # type: ignore[no-untyped-def]
    """Answers each kind of request so that its answer names the model that wrote it."""

    def answer(req: ModelRequest) -> Reply | str:
        if req.system_prompt == TITLE_PROMPT:
            return f"Title by {name}"
        if req.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return f"Summary by {name}.\n\n<memories>\n- a fact kept by {name}\n</memories>"
        if req.system_prompt == MEMORY_SYSTEM_PROMPT:
            return f"<memories>\n- a memory kept by {name}\n</memories>"
        first = next((m.text for m in req.messages if isinstance(m, UserMessage)), "")
        last = req.messages[-1]
        if isinstance(last, ToolResultMessage):
            return f"{name} got: {last.text}"
        if isinstance(last, UserMessage) and first.startswith("delegate: "):
            return Reply(tool_calls=[call("Task", prompt=f"job {first.removeprefix('delegate: ')}")])
        text = f"{name}: {last.text[:40] if isinstance(last, UserMessage | SystemMessage) else ''}"
        return Reply(text, input_tokens=estimate_tokens(req.messages))  # (as a provider counts it)

    return answer


def named(model_id: str) -> ScriptedModel:
    """``pu:<id>``: a scripted model of its own per id (``pu:small`` has a small window)."""
    if model_id not in MODELS:
        info = replace(SMALL, id=model_id) if model_id.startswith("small") else ModelInfo(provider="pu", id=model_id)
        MODELS[model_id] = ScriptedModel(_script(model_id), info=info)
    return MODELS[model_id]


register_provider("pu", named)


def kernel_model() -> ScriptedModel:
    return ScriptedModel(_script("kernel"))


def open_kernel(tmp_path: Path, model: ScriptedModel, **kw: Any) -> Kernel:
    return Kernel.open(  # type: ignore[return-value]
        f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, data_dir=tmp_path, tools=[], **kw
    )


def asked(model: ScriptedModel, system_prompt: str) -> list[ModelRequest]:
    return [r for r in model.requests if r.system_prompt == system_prompt]


async def talked(proc: Process, rounds: int = 3) -> None:
    for i in range(rounds):
        await proc.send(f"part {i}: {LONG}")
        await proc.wait_idle()


# ------------------------------------------------------------------ titles


async def test_a_generated_title_asks_the_process_model(tmp_path: Path) -> None:
    default = kernel_model()
    async with open_kernel(tmp_path, default, titles="model") as k:
        proc = await k.spawn(owner="alice", model="pu:titler")
        await proc.send("plan a trip")
        await proc.wait_idle()
        async with asyncio.timeout(5):
            while (title := await proc.title()) is None:
                await asyncio.sleep(0.01)
        other = await k.spawn(owner="alice")  # no choice of its own: the kernel's model names it
        await other.send("plan a trip")
        await other.wait_idle()
        async with asyncio.timeout(5):
            while (other_title := await other.title()) is None:
                await asyncio.sleep(0.01)
    assert title == "Title by titler" and other_title == "Title by kernel"
    assert len(asked(MODELS["titler"], TITLE_PROMPT)) == 1 and len(asked(default, TITLE_PROMPT)) == 1


# ------------------------------------------------------------------ compaction and memories


async def test_a_manual_compaction_asks_the_process_model(tmp_path: Path) -> None:
    default = kernel_model()
    async with open_kernel(tmp_path, default) as k:
        proc = await k.spawn(owner="alice")
        await talked(proc)
        await proc.set_model("pu:compactor")  # chosen after the conversation: the summary follows it
        done = await proc.compact()
        history = await proc.messages()
    assert done.compacted
    assert "Summary by compactor." in history[0].text and history[0].kind == SUMMARY_KIND  # type: ignore[union-attr]
    assert len(asked(MODELS["compactor"], SUMMARY_SYSTEM_PROMPT)) == 1 and not asked(default, SUMMARY_SYSTEM_PROMPT)
    memory = next((tmp_path / "home" / "alice" / "memory").glob("*.md")).read_text()
    assert "a fact kept by compactor" in memory  # the memories came from the same call


async def test_a_threshold_compaction_asks_the_process_model(tmp_path: Path) -> None:
    """The process's model has a small window: its runs compact at its threshold, with it."""
    default = kernel_model()
    async with open_kernel(tmp_path, default) as k:
        proc = await k.spawn(owner="alice", model="pu:small-threshold")
        await talked(proc, rounds=14)
        history = await proc.messages()
    summaries = asked(MODELS["small-threshold"], SUMMARY_SYSTEM_PROMPT)
    assert summaries and not asked(default, SUMMARY_SYSTEM_PROMPT) and not default.requests
    assert isinstance(history[0], SystemMessage) and "Summary by small-threshold." in history[0].text


async def test_the_memories_a_reset_keeps_are_asked_of_the_process_model(tmp_path: Path) -> None:
    default = kernel_model()
    async with open_kernel(tmp_path, default) as k:
        proc = await k.spawn(owner="alice", model="pu:rememberer")
        await proc.send("my cat is called Miso")
        await proc.wait_idle()
        await proc.reset()  # the memories are written in the background; the close waits for them
    assert len(asked(MODELS["rememberer"], MEMORY_SYSTEM_PROMPT)) == 1 and not asked(default, MEMORY_SYSTEM_PROMPT)
    memory = next((tmp_path / "home" / "alice" / "memory").glob("*.md")).read_text()
    assert "a memory kept by rememberer" in memory


# ------------------------------------------------------------------ the context window


async def test_the_context_window_before_the_first_step_is_the_process_model(tmp_path: Path) -> None:
    default = kernel_model()
    async with open_kernel(tmp_path, default) as k:
        proc = await k.spawn(owner="alice", model="pu:small-window")
        other = await k.spawn(owner="alice")
        mine, theirs = await proc.context(), await other.context()
        assert mine.window == usable_window(SMALL) and mine.tokens == 0
        assert theirs.window == usable_window(default.info)
        await other.set_model("pu:small-later")  # changed before its first step: the figure follows
        assert (await other.context()).window == usable_window(SMALL)
        await other.set_model(None)
        assert (await other.context()).window == usable_window(default.info)


# ------------------------------------------------------------------ subagents


async def test_a_task_child_inherits_the_parents_model_choice(tmp_path: Path) -> None:
    default = kernel_model()
    async with open_kernel(tmp_path, default, subagents=True) as k:
        parent = await k.spawn(owner="alice", model="pu:parent", reasoning="high")
        await parent.send("delegate: count the files")
        await parent.wait_idle()
        answer = (await parent.messages())[-1].text
        (child,) = [r for r in await k.processes("alice") if r.parent_pid == parent.pid]
        choice = await (await k.process(child.pid)).model()
        row = await k.store.kv_get(child.pid, MODEL_KEY)
    assert answer == "parent got: parent: job count the files"  # the child's answer, by the parent's model
    assert (choice.model, choice.reasoning, choice.source) == ("pu:parent", "high", "process")
    assert row == {"model": "pu:parent", "reasoning": "high"}
    assert not default.requests  # neither the parent nor its child asked the default model
    # the parent's two calls and its child's one, all at the parent's level
    assert [r.reasoning for r in MODELS["parent"].requests] == ["high"] * 3


async def test_a_task_child_of_a_parent_without_a_choice_keeps_the_default(tmp_path: Path) -> None:
    default = kernel_model()
    async with open_kernel(tmp_path, default, subagents=True) as k:
        parent = await k.spawn(owner="alice")
        await parent.send("delegate: count the files")
        await parent.wait_idle()
        answer = (await parent.messages())[-1].text
        (child,) = [r for r in await k.processes("alice") if r.parent_pid == parent.pid]
        choice = await (await k.process(child.pid)).model()
        row = await k.store.kv_get(child.pid, MODEL_KEY)
    assert answer == "kernel got: kernel: job count the files"
    assert (choice.model, choice.source, row) == (None, "default", None)


# ------------------------------------------------------------------ WebSocket


def test_websocket_reads_and_sets_the_model(tmp_path: Path) -> None:
    with KernelServer(tmp_path, kernel_model()) as server, server.client("alice") as c, server.client("bob") as bob:
        pid = c.ok("proc.spawn", {"model": "pu:ws-spawned"})["pid"]
        assert c.ok("proc.model.get", {"pid": pid}) == {
            "pid": pid,
            "model": "pu:ws-spawned",
            "reasoning": None,
            "effective": "pu:ws-spawned",
            "source": "process",
        }
        answer = c.ok("proc.model.set", {"pid": pid, "model": "pu:ws", "reasoning": "low"})
        assert answer == {**answer, "pid": pid, "model": "pu:ws", "reasoning": "low", "source": "process"}
        assert c.ok("proc.model.get", {"pid": pid})["model"] == "pu:ws"
        for bad, field in (
            ({"pid": pid, "model": "nosuchprovider:m"}, "nosuchprovider"),
            ({"pid": pid, "model": "pu:x", "reasoning": "extreme"}, "reasoning"),
            ({"pid": pid, "model": 5}, "model"),
            ({"pid": pid}, "model"),  # model is required (null clears it)
            ({"pid": pid, "model": "scripted:/etc/hostname"}, "file"),  # only the operator names files
        ):
            res = c.call("proc.model.set", bad)
            assert not res["ok"] and res["error"]["code"] == "invalid_request", (bad, res)
            assert field in res["error"]["message"], (bad, res)
        res = c.call("proc.spawn", {"model": "nosuchprovider:m"})
        assert not res["ok"] and res["error"]["code"] == "invalid_request"
        assert c.ok("proc.model.get", {"pid": pid})["model"] == "pu:ws"  # nothing changed
        assert bob.error("proc.model.get", {"pid": pid}) == "not_found"
        assert bob.error("proc.model.set", {"pid": pid, "model": "pu:bob"}) == "not_found"
        assert c.ok("proc.model.get", {"pid": pid})["model"] == "pu:ws"
        cleared = c.ok("proc.model.set", {"pid": pid, "model": None})
        assert (cleared["model"], cleared["reasoning"], cleared["source"]) == (None, None, "default")
        assert c.error("proc.model.get", {"pid": "nope"}) == "not_found"


# ------------------------------------------------------------------ the remote chat


server = server_support.module_server("process-model-uses")


def test_remote_chat_slash_model_shows_sets_and_clears_it(server: LiveServer) -> None:
    err = io.StringIO()
    ev = asyncio.new_event_loop()
    client = AgentloopClient(server.url, server.tokens.bob)
    try:
        session = RemoteSession(client)
        ev.run_until_complete(session.open(new=True))
        ev.run_until_complete(client.set_model(session.pid, None, reasoning="high"))
        stdin = "/model\n/model pu:remote\n/model\n/model nosuchprovider:m\n/model default\n/model\n"
        repl = ChatRepl(session, reader=PlainReader(io.StringIO(stdin)), out=io.StringIO(), err=Console(file=err))
        assert repl.loop(ev) == 1  # (the refused /model fails a piped chat)
        choice = ev.run_until_complete(client.model(session.pid))
    finally:
        ev.run_until_complete(client.aclose())
        ev.close()
    shown = " ".join(err.getvalue().split())
    assert "no model of its own" not in shown
    assert "the default, reasoning high)" in shown  # its own level over the server's model
    assert "(model set: pu:remote, reasoning high, from the next answer on)" in shown  # the level kept
    assert "(model: pu:remote, this conversation's, reasoning high)" in shown
    assert "error: " in shown and "nosuchprovider" in shown
    assert "(model: back to the default, " in shown
    assert (choice["model"], choice["reasoning"], choice["source"]) == (None, None, "default")


@pytest.fixture(autouse=True)
def _fresh_models() -> None:
    """Each test's ``pu`` models start without requests (their ids differ from test to test anyway)."""
    for model in MODELS.values():
        model.requests.clear()
