"""Review of ``proc.prompt.compiled``: server paths that must not reach the manifest (symlinked
homes and skill layers), display names that must not mangle other text, what the engine keeps
for a manifest not logged yet, and ``/prompt`` against a malformed payload."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, call, tool
from agentloop.kernel import Kernel
from agentloop.kernel.runs import _relative_to
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest, ProviderError
from agentloop.process import signals as sig
from agentloop.process.compaction import SUMMARY_SYSTEM_PROMPT
from agentloop.process.signals import Signal

COMPILED = "proc.prompt.compiled"


@tool
def dump(n: int) -> str:
    """Return a short text."""
    return f"chunk {n}: " + "lorem ipsum dolor sit amet " * 60  # (enough for a compaction to take)


def kernel(tmp_path: Path, model: ScriptedModel, **kw: Any) -> Any:
    return Kernel.open(f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[dump], **kw)


async def logged(proc: Any) -> list[Signal]:
    return [s async for s in proc.signals(follow=False)]


def compiled(signals: list[Signal]) -> list[dict[str, Any]]:
    return [s.payload for s in signals if s.signal == COMPILED]


# ------------------------------------------------------------------------------ display names


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("/srv/data/home/alice/context.d/1.md: binary", "context.d/1.md: binary"),
        ("/srv/data/home/alice2/context.d/1.md", "home/alice2/context.d/1.md"),  # a prefix of another name
        ("/srv/data2/x.md", "/srv/data2/x.md"),
        ("'/srv/data' is gone", "'.' is gone"),
        ("/srv/a+b(c)[d]/AGENTS.md", "AGENTS.md"),  # regex-special characters
        # a root inside a longer path or word is not that root
        ("/backup/srv/data/home/alice/x.md", "/backup/srv/data/home/alice/x.md"),
        ("metadata/notes.md and data/x.md", "metadata/notes.md and x.md"),
    ],
)
def test_display_names_replace_whole_roots_only(text: str, shown: str) -> None:
    relative = _relative_to(["/srv/data", "/srv/data/home/alice", "/srv/a+b(c)[d]", "data"])
    assert relative(text) == shown


def test_many_roots_and_a_long_text_are_quick() -> None:
    roots = [f"/srv/r{i}/" + "a" * 50 for i in range(200)]
    relative = _relative_to(roots)
    text = ("/srv/r1/" + "a" * 49 + "b ") * 20_000
    assert relative(text) == text


async def test_no_server_path_through_a_symlinked_home_or_skill_layer(tmp_path: Path) -> None:
    """The account's home and the system's skills live elsewhere, linked into the data
    directory: the files' real paths (a skill's, a warning's) are named as the links are."""
    data = tmp_path / "data"
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "alice" / "context.d").mkdir(parents=True)
    (elsewhere / "alice" / "context.d" / "10-me.md").write_text("I like tea.")
    (elsewhere / "alice" / "context.d" / "20-bin.md").write_bytes(b"\x00\x01binary")
    own = elsewhere / "alice" / "skills.d" / "mine"
    own.mkdir(parents=True)
    (own / "SKILL.md").write_text("---\nname: mine\ndescription: Mine.\n---\nDo it.")
    shared = elsewhere / "skills" / "deploy"
    shared.mkdir(parents=True)
    (shared / "SKILL.md").write_text("---\nname: deploy\ndescription: Ship.\n---\nRun make ship.")
    (data / "home").mkdir(parents=True)
    (data / "config" / "ai").mkdir(parents=True)
    os.symlink(elsewhere / "alice", data / "home" / "alice")
    os.symlink(elsewhere / "skills", data / "config" / "ai" / "skills.d")
    (tmp_path / "ws").mkdir()
    url = f"sqlite:///{data}/a.db"
    async with Kernel.open(url, model=ScriptedModel(["done"]), workspace=tmp_path / "ws", tools=[]) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("hi")
        await proc.wait_idle()
        (manifest,) = compiled(await logged(proc))
    text = json.dumps(manifest)
    assert str(tmp_path) not in text and str(tmp_path.resolve()) not in text, text
    assert not re.search(r'"/', text), text
    files = {s["name"]: s["files"] for s in manifest["sections"]}
    assert files["agent context"] == ["context.d/10-me.md"]
    assert files["skills"] == ["skills.d/deploy", "skills.d/mine"]
    assert any(w.startswith("context.d/20-bin.md: ") for w in manifest["warnings"]), manifest["warnings"]


# ------------------------------------------------------------------------------ the engine


async def test_a_run_aborted_before_its_first_answer_leaves_nothing_behind(tmp_path: Path) -> None:
    asked = asyncio.Event()
    gate = asyncio.Event()

    async def brain(r: ModelRequest) -> str:
        asked.set()
        await gate.wait()
        return "ok"

    async def aborted_before_the_answer(proc: Any) -> None:
        asked.clear()
        gate.clear()
        await proc.send("hi")
        await asyncio.wait_for(asked.wait(), 10)
        assert await proc.abort()
        await asyncio.wait_for(proc.wait_idle(), 10)
        gate.set()

    async with kernel(tmp_path, ScriptedModel(brain)) as k:
        proc = await k.spawn(owner="alice")
        await aborted_before_the_answer(proc)
        assert compiled(await logged(proc)) == []
        again = await proc.send("again")  # a new run: its own prompt, logged with its answer
        await asyncio.wait_for(proc.wait_idle(), 10)
        assert [m["runId"] for m in compiled(await logged(proc))] == [again.run_id]
        # the prompt of a run aborted before any answer is not kept until that process runs again
        quiet = [await k.spawn(owner="alice") for _ in range(3)]
        for each in quiet:
            await aborted_before_the_answer(each)
        await proc.send("more")
        await asyncio.wait_for(proc.wait_idle(), 10)
        assert k.engine._compiled == {}


async def test_a_prompt_function_that_raises_fails_the_run_and_the_next_logs(tmp_path: Path) -> None:
    async with kernel(tmp_path, ScriptedModel(["one", "two"])) as k:
        built = k.engine.prompt
        assert built is not None

        async def broken(record: Any, tools: Any) -> str:
            raise RuntimeError("no prompt today")

        k.engine.prompt = broken
        proc = await k.spawn(owner="alice")
        await proc.send("hi")
        await asyncio.wait_for(proc.wait_idle(), 10)
        assert compiled(await logged(proc)) == []
        k.engine.prompt = built
        again = await proc.send("again")
        await asyncio.wait_for(proc.wait_idle(), 10)
        assert [m["runId"] for m in compiled(await logged(proc))] == [again.run_id]
        assert k.engine._compiled == {}


async def test_an_overflow_retry_logs_the_manifest_once(tmp_path: Path) -> None:
    """The first model call of a run overflows: compaction, one retry, then the answer logs
    the run's manifest (once)."""
    calls = {"n": 0}

    def brain(r: ModelRequest) -> Reply | str:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return "Summary of the earlier talk."
        calls["n"] += 1
        if calls["n"] == 5:
            raise ProviderError("prompt is too long: 9000 tokens > 8192 maximum", kind="overflow")
        if isinstance(r.messages[-1], UserMessage) and calls["n"] < 5:
            return Reply(tool_calls=[call("dump", n=calls["n"])])
        return f"answer {calls['n']}"

    async with kernel(tmp_path, ScriptedModel(brain)) as k:
        proc = await k.spawn(owner="alice")
        runs = []
        for text in ("one", "two", "three: this call overflows"):
            runs.append((await proc.send(text)).run_id)
            await asyncio.wait_for(proc.wait_idle(), 10)
        signals = await logged(proc)
    assert [s.payload["reason"] for s in signals if s.signal == sig.COMPACTED] == ["overflow"]
    assert [m["runId"] for m in compiled(signals)] == runs
    assert signals[-1].payload["status"] == "ok"


# ------------------------------------------------------------------------------ /prompt


def test_the_manifest_view_survives_a_malformed_payload_and_shows_no_control_characters() -> None:
    from agentloop.cli.render import prompt_manifest_lines

    payload: dict[str, Any] = {
        "digest": "\x1b]0;pwned\x07\x1b[2J",
        "bytes": "many",
        "base": True,
        "tools": "Read",
        "sections": [None, {"name": {"x": 1}, "bytes": 1.5, "files": "a", "omitted": [None]}, "s"],
        "warnings": {"w": 1},
    }
    lines = prompt_manifest_lines(payload)
    text = "\n".join(lines)
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", text), text
    assert lines[0].startswith("system prompt: 0 bytes, sha256 ")
    assert prompt_manifest_lines({})[0] == "system prompt: 0 bytes, sha256 , 0 tools"


def test_remote_slash_prompt_with_the_server_gone_says_so_and_the_chat_goes_on() -> None:
    """``/prompt`` is a command like ``/chat``: a server out of reach is an error line, not the
    end of the chat."""
    import httpx
    from rich.console import Console

    from agentloop.cli.chat import ChatRepl, PlainReader
    from agentloop.cli.client import RemoteSession
    from agentloop.client import AgentloopClient

    def gone(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            return httpx.Response(404, json={"error": {"code": "not_found", "message": "no such process"}})
        raise httpx.ConnectError("connection refused")

    err = io.StringIO()
    ev = asyncio.new_event_loop()
    client = AgentloopClient("http://127.0.0.1:9", "t0k3n", transport=httpx.MockTransport(gone))
    try:
        session = RemoteSession(client)
        session.pid = "p1"
        repl = ChatRepl(
            session,
            reader=PlainReader(io.StringIO("/prompt\n/help\n")),
            out=io.StringIO(),
            err=Console(file=err, width=200),
        )
        repl.loop(ev)  # (ends with /help, not with a traceback)
        assert repl.failed
    finally:
        ev.run_until_complete(client.aclose())
        ev.close()
    shown = err.getvalue()
    assert "error: no prompt manifest: " in shown and "404" in shown, shown
    assert "/prompt shows" in shown  # /help ran after it
