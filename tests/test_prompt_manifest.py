"""``proc.prompt.compiled``: what went into a run's system prompt, logged once per run with the
run's first model step, so a person can see why a prompt is as large as it is, which files it
was built from, what was cut or left out, without the server's paths. Shown by ``/prompt`` in
``agentloop chat``."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from agentloop import Reply, ScriptedModel, call, tool
from agentloop.cli.main import app
from agentloop.kernel import Kernel
from agentloop.models.base import ModelRequest
from agentloop.models.registry import register_provider
from agentloop.process import signals as sig
from agentloop.process.signals import Signal
from agentloop.process.store import ProcessRecord
from agentloop.tools.base import Tool

COMPILED = "proc.prompt.compiled"


@tool
def dump(n: int) -> str:
    """Return a short text."""
    return f"chunk {n}"


def kernel(tmp_path: Path, model: ScriptedModel, **kw: Any) -> Any:
    return Kernel.open(f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[dump], **kw)


async def logged(proc: Any, after: int = 0) -> list[Signal]:
    return [s async for s in proc.signals(after_seq=after, follow=False)]


def compiled(signals: list[Signal]) -> list[dict[str, Any]]:
    return [s.payload for s in signals if s.signal == COMPILED]


def files(tmp_path: Path) -> Path:
    """A data directory (``tmp_path``) with system and home context, a skill, and a workspace."""
    system = tmp_path / "config" / "ai" / "context.d"
    system.mkdir(parents=True)
    (system / "00-rules.md").write_text("You are {{identity}}. {{nope}}")
    home = tmp_path / "home" / "alice" / "context.d"
    home.mkdir(parents=True)
    (home / "10-me.md").write_text("I like tea.")
    (home / "20-bin.md").write_bytes(b"\x00\x01\x02binary")
    skill = tmp_path / "config" / "ai" / "skills.d" / "deploy"
    skill.mkdir(parents=True)
    (skill / "SKILL.md").write_text("---\nname: deploy\ndescription: How to ship.\n---\nRun make ship.")
    work = tmp_path / "work"
    work.mkdir()
    (work / "AGENTS.md").write_text("Answer in French.")
    return work


async def test_a_fresh_run_logs_what_its_prompt_was_built_from_once(tmp_path: Path) -> None:
    work = files(tmp_path)
    prompts: list[str] = []

    def brain(r: ModelRequest) -> Reply | str:
        prompts.append(r.system_prompt)
        return Reply(tool_calls=[call("dump", n=1)]) if len(prompts) % 2 else "done"

    async with kernel(tmp_path, ScriptedModel(brain), system_prompt="Base rules.") as k:
        proc = await k.spawn(owner="alice", cwd=work, context="Project: inventory.")
        first = await proc.send("hi")
        await proc.wait_idle()
        second = await proc.send("again")
        await proc.wait_idle()
        signals = await logged(proc)
    manifests = compiled(signals)
    assert [m["runId"] for m in manifests] == [first.run_id, second.run_id]  # once per run, not per model call
    m = manifests[0]
    assert m["pid"] == proc.pid
    assert m["digest"] == hashlib.sha256(prompts[0].encode()).hexdigest()
    assert m["bytes"] == len(prompts[0].encode())
    assert m["base"] == len(b"Base rules.")
    sections = {s["name"]: s for s in m["sections"]}
    assert list(sections) == ["system context", "agent context", "skills", "workspace", "process context"]
    assert sections["system context"]["files"] == ["context.d/00-rules.md"]
    assert sections["agent context"]["files"] == ["context.d/10-me.md"]
    assert sections["skills"]["files"] == ["skills.d/deploy"]
    assert sections["workspace"]["files"] == ["AGENTS.md"]
    assert sections["process context"]["files"] == []
    assert all(s["truncated"] is False and s["omitted"] == [] for s in m["sections"])
    assert all(s["bytes"] > 0 for s in m["sections"])
    assert sum(s["bytes"] for s in m["sections"]) < m["bytes"]
    assert "dump" in m["tools"] and "skills" in m["tools"] and m["tools"] == sorted(m["tools"])
    assert "context.d/00-rules.md: unknown template variable {{nope}} left as is" in m["warnings"]
    assert any(w.startswith("context.d/20-bin.md: ") for w in m["warnings"])
    # durable with the step the model answered: after the run started, before its output
    names = [s.signal for s in signals if s.payload.get("runId") == first.run_id]
    assert names.index(sig.RUN_STARTED) < names.index(COMPILED) < names.index(sig.RUN_OUTPUT)


async def test_the_manifest_names_no_server_path(tmp_path: Path) -> None:
    work = files(tmp_path)
    (work / "../home/alice/memory").resolve().mkdir(parents=True)
    async with kernel(tmp_path, ScriptedModel(["done"])) as k:
        proc = await k.spawn(owner="alice", cwd=work)
        await proc.send("hi")
        await proc.wait_idle()
        (manifest,) = compiled(await logged(proc))
    text = json.dumps(manifest)
    assert str(tmp_path) not in text and str(tmp_path.resolve()) not in text
    assert not re.search(r'"/', text)  # no absolute path at all


async def test_a_truncated_and_an_omitted_context_file_are_marked(tmp_path: Path) -> None:
    home = tmp_path / "home" / "alice" / "context.d"
    home.mkdir(parents=True)
    (home / "1.md").write_text("A" * 60)
    (home / "2.md").write_text("B\n" * 40)
    (home / "3.md").write_text("C" * 50)
    async with kernel(tmp_path, ScriptedModel(["done"]), context_bytes=100) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("hi")
        await proc.wait_idle()
        (manifest,) = compiled(await logged(proc))
    (section,) = [s for s in manifest["sections"] if s["name"] == "agent context"]
    assert section["truncated"] is True
    assert section["files"] == ["context.d/1.md", "context.d/2.md"]
    assert section["omitted"] == ["context.d/3.md"]
    assert "context.d/2.md: truncated to fit max_context_bytes=100" in manifest["warnings"]
    assert "context.d: omitted over max_context_bytes=100: 3.md" in manifest["warnings"]


async def test_a_custom_prompt_function_returning_text_still_logs_the_manifest(tmp_path: Path) -> None:
    asked: list[str] = []

    async def custom(record: ProcessRecord, tools: Mapping[str, Tool]) -> str:
        asked.append(record.pid)
        return "Custom prompt."

    model = ScriptedModel(["done"])
    async with kernel(tmp_path, model) as k:
        k.engine.prompt = custom
        proc = await k.spawn(owner="alice")
        await proc.send("hi")
        await proc.wait_idle()
        (manifest,) = compiled(await logged(proc))
    assert asked == [proc.pid] and model.requests[0].system_prompt == "Custom prompt."
    assert manifest["digest"] == hashlib.sha256(b"Custom prompt.").hexdigest()
    assert manifest["bytes"] == len(b"Custom prompt.")
    assert manifest["sections"] == [] and manifest["warnings"] == [] and manifest["base"] == 0
    assert "dump" in manifest["tools"]


async def test_a_chat_mode_run_lists_no_tools(tmp_path: Path) -> None:
    async with kernel(tmp_path, ScriptedModel(["done"])) as k:
        proc = await k.spawn(owner="alice")
        await proc.set_mode("chat")
        await proc.send("hi")
        await proc.wait_idle()
        (manifest,) = compiled(await logged(proc))
    assert manifest["tools"] == []


async def test_a_run_resumed_with_its_kept_prompt_logs_no_second_manifest(tmp_path: Path) -> None:
    @tool
    async def slow(seconds: float) -> str:
        """Sleep."""
        await asyncio.sleep(seconds)
        return "slept"

    prompts: list[str] = []

    def brain(r: ModelRequest) -> Reply | str:
        prompts.append(r.system_prompt)
        return Reply(tool_calls=[call("slow", seconds=30)]) if len(prompts) == 1 else "done"

    work = tmp_path / "work"
    work.mkdir()
    (work / "AGENTS.md").write_text("Rule A.")
    url = f"sqlite:///{tmp_path}/a.db"
    async with Kernel.open(url, model=ScriptedModel(brain), workspace=tmp_path, tools=[slow]) as k:
        proc = await k.spawn(owner="alice", cwd=work)
        receipt = await proc.send("go")
        while len(prompts) < 1:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # the slow call is in flight when the kernel goes down
    (work / "AGENTS.md").write_text("Rule B, much longer than the first.")
    async with Kernel.open(url, model=ScriptedModel(brain), workspace=tmp_path, tools=[slow]) as k:
        proc = await k.process(proc.pid)
        await asyncio.wait_for(proc.wait_idle(), 10)
        assert len(prompts) == 2 and prompts[1] == prompts[0]
        manifests = compiled(await logged(proc))
        assert [m["runId"] for m in manifests] == [receipt.run_id]
        assert manifests[0]["digest"] == hashlib.sha256(prompts[0].encode()).hexdigest()
        again = await proc.send("again")
        await proc.wait_idle()
        manifests = compiled(await logged(proc))
    assert [m["runId"] for m in manifests] == [receipt.run_id, again.run_id]
    assert manifests[1]["digest"] == hashlib.sha256(prompts[2].encode()).hexdigest() != manifests[0]["digest"]


async def test_watchers_get_it_live_and_a_late_one_replays_it_from_the_log(tmp_path: Path) -> None:
    async with kernel(tmp_path, ScriptedModel(["one", "two"])) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("hi")
        await proc.wait_idle()
        seen = (await logged(proc))[-1].seq
        assert seen is not None
        queue = k.engine.hub.watch(proc.pid)
        receipt = await proc.send("again")
        await proc.wait_idle()
        live: list[Signal] = []
        while not queue.empty():
            item = queue.get_nowait()
            assert item is not None
            live.append(item)
        replayed = await logged(proc, after=seen)
    (published,) = [s for s in live if s.signal == COMPILED]
    (stored,) = [s for s in replayed if s.signal == COMPILED]
    assert published == stored and published.seq is not None and published.seq > seen
    assert stored.payload["runId"] == receipt.run_id


# ---------------------------------------------------------------------------------- /prompt

runner = CliRunner()


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG", "AGENTLOOP_DATA"):
        monkeypatch.delenv(name, raising=False)


def chat(tmp_path: Path, name: str, replies: list[Any], stdin: str, *extra: str) -> Any:
    register_provider(name, lambda _id: ScriptedModel(replies))
    ws, data = tmp_path / "ws", tmp_path / "data"
    ws.mkdir(exist_ok=True)
    result = runner.invoke(app, ["chat", "-m", f"{name}:x", "-w", str(ws), "--data", str(data), *extra], input=stdin)
    assert result.exit_code == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result


@pytest.mark.usefixtures("isolated")
def test_slash_prompt_shows_the_latest_manifest_of_the_chats_process(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "AGENTS.md").write_text("Answer in French.")
    context = tmp_path / "data" / "config" / "ai" / "context.d"
    context.mkdir(parents=True)
    (context / "00-rules.md").write_text("Be brief. {{nope}}")
    result = chat(tmp_path, "manifest", ["bonjour"], "/prompt\nhello\n/prompt\n/help\n")
    err = result.stderr
    assert "no prompt manifest yet" in err  # before the first run
    shown = err[err.index("no prompt manifest yet") :]
    assert re.search(r"system prompt: \d+ bytes, sha256 [0-9a-f]{12}, \d+ tools", shown), shown
    assert re.search(r"system context +\d+ bytes +context\.d/00-rules\.md", shown), shown
    assert re.search(r"workspace +\d+ bytes +AGENTS\.md", shown), shown
    assert "warning: context.d/00-rules.md: unknown template variable {{nope}} left as is" in shown
    assert str(tmp_path) not in shown
    assert "/prompt" in err[err.rindex("/new") :]  # /help lists it


def test_the_manifest_view_marks_truncated_and_omitted_files_and_shows_no_control_characters() -> None:
    from agentloop.cli.render import prompt_manifest_lines

    payload = {
        "runId": "r1",
        "digest": "ab" * 32,
        "bytes": 5000,
        "base": 11,
        "tools": ["Read", "Shell"],
        "sections": [
            {
                "name": "agent context",
                "bytes": 300,
                "files": ["context.d/1.md", "context.d/2.md"],
                "truncated": True,
                "omitted": ["context.d/3.md", "context.d/\x1b[2Jevil.md"],
            },
            {"name": "workspace", "bytes": 40, "files": ["AGENTS.md"], "truncated": False, "omitted": []},
        ],
        "warnings": ["context.d/2.md: truncated to fit max_context_bytes=100"],
    }
    text = "\n".join(prompt_manifest_lines(payload))
    assert "system prompt: 5000 bytes, sha256 abababababab, 2 tools" in text
    assert re.search(r"base +11 bytes", text)
    assert re.search(r"agent context +300 bytes +truncated +context\.d/1\.md, context\.d/2\.md", text)
    assert "omitted: context.d/3.md, context.d/\\u001b[2Jevil.md" in text and "\x1b" not in text
    assert re.search(r"workspace +40 bytes +AGENTS\.md", text)
    assert "warning: context.d/2.md: truncated to fit max_context_bytes=100" in text
    assert "truncated" not in text.splitlines()[-2]  # (the workspace line)


@pytest.mark.usefixtures("isolated")
def test_slash_prompt_in_an_in_memory_chat_says_there_is_none(tmp_path: Path) -> None:
    result = chat(tmp_path, "manifest-memory", ["ok"], "hi\n/prompt\n", "--memory")
    assert "no prompt manifest" in result.stderr
