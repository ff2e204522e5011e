"""The README and docs/server-api.md sentences added or changed on the day of send arbitration,
edited approvals, manual compaction's cut, tool scope, skill activation, speaker lines,
``Conversation``, serve's bridges, the compaction and tool-retry events, generic-type video, the
process cache bound and the new approval holes, each checked by doing what the sentence says: in
the library, over HTTP (a live server), over the WebSocket and with the CLI where one is named."""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner
from websockets.sync.client import connect

from agentloop import Agent, Conversation, ConversationBusy, Reply, ScriptedModel, ToolResult, ToolRetry, call, tool
from agentloop.cli.approvals import Edited, Question, ask_user
from agentloop.cli.main import app
from agentloop.events import (
    CompactionEnd,
    CompactionStart,
    ToolRetryExhausted,
    ToolRetryResolved,
    ToolRetryScheduled,
    TurnEnd,
)
from agentloop.kernel import Kernel, RunActive, RunNotCurrent
from agentloop.loop.compaction import SUMMARY_SYSTEM_PROMPT, Compaction, estimated_context
from agentloop.messages import Origin, SystemMessage, ToolResultMessage, UserMessage
from agentloop.models.base import ModelInfo, ModelRequest
from agentloop.process.api import approve_everything
from agentloop.process.approval.engine import account_rule, decide
from agentloop.process.approval.policy import Policy, default_policy, parse_policy
from agentloop.process.tool_scope import allows
from tests import server_support
from tests.server_support import LiveServer, live_server, pending_requests, refused, wait_idle, wait_until
from tests.ws_support import Client

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
API = (ROOT / "docs" / "server-api.md").read_text(encoding="utf-8")
FLAT_README = " ".join(README.split())
FLAT_API = " ".join(API.split())
OGG = b"OggS\x00\x02" + bytes(100)
runner = CliRunner()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def user_texts(req: ModelRequest) -> list[str]:
    return [m.text for m in req.messages if isinstance(m, UserMessage)]


@tool
def echo(text: str) -> str:
    """Echo the text back."""
    return text


@tool
async def slow(seconds: float) -> str:
    """Sleep a while."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


def brain(req: ModelRequest) -> Reply | str:
    """``echo X`` and ``sleep N`` call their tools, ``call slow`` too (for a scope test); anything
    else answers ``answer: <text>``."""
    last = req.messages[-1]
    if isinstance(last, ToolResultMessage):
        return f"done: {last.text}"
    text = last.text if isinstance(last, UserMessage) else ""
    if text.startswith("echo "):
        return Reply(tool_calls=[call("echo", text=text[5:])])
    if text.startswith("sleep "):
        return Reply(tool_calls=[call("slow", seconds=float(text[6:]))])
    return f"answer: {text}"


def open_kernel(tmp_path: Path, model: Any, **kw: Any) -> Any:
    kw.setdefault("tools", [echo, slow])
    kw.setdefault("approval", approve_everything)
    return Kernel.open(f"sqlite:///{tmp_path}/k.db", model=model, workspace=tmp_path, **kw)


async def signals_of(proc: Any, prefix: str) -> list[Any]:
    return [s async for s in proc.signals(follow=False) if s.signal.startswith(prefix)]


# ------------------------------------------------------------------------------------ Conversation


async def test_the_readmes_conversation_example() -> None:
    """``agent.conversation()``: follow_up while idle is taken first by the next send; ``send``
    returns the RunResult of one run on the whole history; ``messages`` is a read-only copy;
    ``stream`` yields the agent's events; a second send is refused (``ConversationBusy``) unless
    ``if_busy="queue"``; ``reset`` is refused while a send runs; ``subscribe`` sees later sends."""
    gate = asyncio.Event()

    def script(req: ModelRequest) -> Reply | str:
        texts = user_texts(req)
        if texts[-1] == "wait" and not any(isinstance(m, ToolResultMessage) for m in req.messages[-1:]):
            return Reply(tool_calls=[call("hold")])
        return "seen: " + " | ".join(texts)

    @tool
    async def hold() -> str:
        """Wait for the test."""
        await gate.wait()
        return "held"

    model = ScriptedModel(script)
    agent = Agent(model=model, tools=[hold], system_prompt="Be brief.")
    conv = agent.conversation()
    assert isinstance(conv, Conversation) and isinstance(Conversation(agent, []), Conversation)
    await conv.send("My name is Alice.")
    conv.follow_up("I like tea.")
    result = await conv.send("What is my name?")
    assert len(model.requests) == 3  # one run: a follow-up answered, then the send's own input
    assert user_texts(model.requests[-1]) == ["My name is Alice.", "I like tea.", "What is my name?"]
    assert result.text == "seen: My name is Alice. | I like tea. | What is my name?"
    assert isinstance(conv.messages, tuple)
    seen: list[str] = []
    conv.subscribe(lambda event: seen.append(event.type))
    kinds = [event.type async for event in conv.stream("And what do I like?")]
    assert kinds[0] == "agent_start" and kinds[-1] == "agent_end" and "message_end" in kinds
    assert seen == kinds
    running = asyncio.create_task(conv.send("wait"))
    await wait_until(lambda: conv.running and conv._run is not None)
    with pytest.raises(ConversationBusy):
        await conv.send("second")
    with pytest.raises(ConversationBusy):
        conv.reset()
    queued = asyncio.create_task(conv.send("after", if_busy="queue"))
    gate.set()
    await asyncio.wait_for(asyncio.gather(running, queued), 5)
    await conv.wait_idle()
    conv.follow_up("queued input")
    assert (await conv.continue_()).text.endswith("| queued input")
    gate.clear()
    aborted = asyncio.create_task(conv.send("wait"))
    await wait_until(lambda: conv._run is not None and not conv._run.done)
    conv.abort()
    assert (await asyncio.wait_for(aborted, 5)).stop_reason == "aborted"
    conv.reset()
    assert conv.messages == ()


async def test_a_send_whose_run_raises_leaves_every_tool_call_answered() -> None:
    """ "A send whose run raises still leaves a valid history: each tool call it left open gets an
    error result" (here the send's task is cancelled while two tool calls are open)."""
    started = asyncio.Event()

    @tool
    async def forever() -> str:
        """Never finish."""
        started.set()
        await asyncio.Event().wait()
        return "never"

    model = ScriptedModel([Reply(tool_calls=[call("forever"), call("forever")]), "never"])
    conv = Agent(model=model, tools=[forever]).conversation()
    task = asyncio.create_task(conv.send("go"))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    history = conv.messages
    calls = [c.id for m in history for c in getattr(m, "tool_calls", ()) or ()]
    results = [m for m in history if isinstance(m, ToolResultMessage)]
    assert len(calls) == 2 and sorted(calls) == sorted(m.tool_call_id for m in results)
    assert all(m.is_error for m in results) and not conv.running


# ------------------------------------------------------------------------------- send arbitration


async def test_reject_and_expected_run_id_in_the_library(tmp_path: Path) -> None:
    """README: ``mode="reject"`` delivers only to an idle process (``RunActive``), and
    ``expected_run_id`` only while that run is current (``RunNotCurrent``), delivering nothing."""
    async with open_kernel(tmp_path, ScriptedModel(brain)) as k:
        proc = await k.spawn("alice")
        first = await proc.send("sleep 30")
        with pytest.raises(RunActive) as active:
            await proc.send("only if idle", mode="reject")
        assert active.value.run_id == first.run_id
        joined = await proc.send("more", expected_run_id=first.run_id, mode="queue")
        assert [i.message.text for i in await proc.queued()] == ["more"] and joined.queued
        await proc.withdraw()
        await proc.abort()
        await asyncio.wait_for(proc.wait_idle(), 5)
        with pytest.raises(RunNotCurrent) as stale:
            await proc.send("stale steer", expected_run_id=first.run_id)
        assert stale.value.current is None
        assert await proc.queued() == [] and (await proc.info()).current_run is None
        idle = await proc.send("hello", mode="reject")
        await asyncio.wait_for(proc.wait_idle(), 5)
        assert idle.run_id != first.run_id


def test_the_cli_send_takes_expected_run() -> None:
    result = runner.invoke(app, ["send", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--expected-run" in result.output
    assert "send PID TEXT [--mode steer|queue|interrupt] [--expected-run RUN_ID]" in README


# ------------------------------------------------------------------------------- approval policy


async def test_agentloop_chat_answers_e_and_account() -> None:
    """ "`agentloop chat` answers `e` (edit the arguments as JSON at the prompt) and `account`
    besides y / n / a" (a durable chat's question)."""
    question = Question(tool="echo", args={"text": "risky"}, tags=(), reason="asked", editable=True)

    async def answer(*lines: str) -> Any:
        given = iter(lines)

        async def read(prompt: str) -> str:
            return next(given)

        return await ask_user(question, read, Console(file=io.StringIO()), shows_prompt=True)

    assert await answer("e", '{"text": "calm"}') == Edited({"text": "calm"})
    assert await answer("account") == "account"
    assert await answer("a") == "always" and await answer("y") == "approve"


def test_the_shell_commands_the_readme_says_are_asked(tmp_path: Path) -> None:
    """The default policy asks for ``echo x > $HOME/.bashrc`` (a write to a path made of a
    variable), ``git -C`` / ``--git-dir`` outside the working directory, abbreviated program-running
    options (``tar --to-c=``), writes into ``.git`` (shell and file tools); not for their plain
    counterparts."""
    (tmp_path / "work" / ".git").mkdir(parents=True)
    work, home = tmp_path / "work", tmp_path / "home"

    def action(syscall: str, **args: Any) -> str:
        return decide(default_policy(), syscall, args, cwd=work, home=home).action

    asked = [
        "echo x > $HOME/.bashrc",
        "git -C /tmp status",
        "git --git-dir=/tmp/x log",
        "tar --to-c=cat -xf a.tar",
        "tar --to-command=cat -xf a.tar",
        "echo x > .git/config",
        "git -c core.pager=cat log",
    ]
    for command in asked:
        assert action("shell.exec", command=command) == "ask", command
    for command in ("echo x > notes.txt", "git -C . status", "tar -xf a.tar", "git status"):
        assert action("shell.exec", command=command) == "auto", command
    assert action("fs.write", path=".git/config", content="x") == "ask"
    assert action("fs.write", path="notes.txt", content="x") == "auto"
    assert "as\ndoes a write to a path made of a variable (`echo x > $HOME/.bashrc`)" in README


def test_the_program_clause_as_the_readme_spells_it(tmp_path: Path) -> None:
    """``"when": {"program": "git push"}`` holds for ``git push origin dev``, not for the README's
    five counter-examples; only ``shell.exec`` rules may have it."""
    policy = Policy.model_validate(
        {"default": "ask", "rules": [{"match": "shell.exec", "when": {"program": "git push"}, "action": "auto"}]}
    )

    def action(command: str) -> str:
        return decide(policy, "shell.exec", {"command": command}, cwd=tmp_path, home=tmp_path).action

    assert action("git push origin dev") == "auto"
    for command in (
        "git push x; cat ~/.ssh/id_rsa",
        "git push $(echo x)",
        "FOO=1 git push",
        "./git push",
        "git push $X",
    ):
        assert action(command) == "ask", command
    for match in ("fs.write", "shell.*"):
        _, problems = parse_policy({"rules": [{"match": match, "when": {"program": "git"}, "action": "auto"}]})
        assert problems and "only to rules matching 'shell.exec'" in problems[0]


def test_what_account_scope_refuses() -> None:
    """README: several programs, unparseable or not spelled-out commands, CodeMode, and a
    destructive or privileged call are refused at the account scope (``account_rule``)."""
    for command in ("git push && ls", "python -c 1", "git push $X"):
        with pytest.raises(ValueError, match="account"):
            account_rule("shell.exec", {"command": command}, tags=("network",))
    with pytest.raises(ValueError, match="CodeMode"):
        account_rule("codemode.exec", {"code": "print(1)"})
    for tags in (("destructive",), ("privileged",)):
        with pytest.raises(ValueError, match="whole account"):
            account_rule("shell.exec", {"command": "rm -rf build"}, tags=tags)
    assert "a destructive or privileged call, and CodeMode are refused at that scope" in FLAT_README
    assert "refused for several programs, unparseable commands, destructive or privileged calls and CodeMode" in (
        FLAT_API
    )


NOTE = "[The user edited this call's arguments before approving it. It ran with: "
ASK_ECHO = {"default": "auto", "rules": [{"match": "tool.echo", "action": "ask"}]}


async def asked(proc: Any) -> Any:
    for _ in range(500):
        if pending := await proc.pending_approvals():
            return pending[0]
        if (await proc.info()).current_run is None:
            return None
        await asyncio.sleep(0.01)
    raise AssertionError("neither asked nor finished")


async def test_edit_remember_and_the_account_file(tmp_path: Path) -> None:
    """``proc.hil(..., arguments=...)`` runs the edit (invalid: ``ValueError``, still pending; the
    model's call stays as it made it); ``remember="account"`` where the account has no file writes
    ``{"remembered": [rule]}``, which keeps the server-wide policy and adds the rule on top; an
    account whose policy is given in code is refused that scope."""
    model = ScriptedModel(brain)
    async with open_kernel(tmp_path, model, policy=ASK_ECHO, approval=None) as k:
        proc = await k.spawn("alice")
        await proc.send("echo risky")
        ask = await asked(proc)
        with pytest.raises(ValueError):
            await proc.hil(ask.request_id, "approve", arguments={"text": 5, "extra": True})
        assert [p.request_id for p in await proc.pending_approvals()] == [ask.request_id]
        await proc.hil(ask.request_id, "approve", arguments={"text": "safe"}, remember="account")
        await asyncio.wait_for(proc.wait_idle(), 5)
        history = [m.message for m in await proc.history()]
        [made] = [c for m in history for c in getattr(m, "tool_calls", ()) or ()]
        [result] = [m for m in history if isinstance(m, ToolResultMessage)]
        assert made.arguments == {"text": "risky"} and result.text.startswith(NOTE) and result.text.endswith("safe")
        written = json.loads((tmp_path / "home" / "alice" / "approval.json").read_text())
        assert list(written) == ["remembered"]
        later = await k.spawn("alice")
        await later.send("echo again")
        assert await asked(later) is None  # the remembered rule answers the server policy's question
        bob = await k.spawn("bob")
        await bob.send("echo bob")
        bobs = await asked(bob)
        assert bobs is not None
        await bob.hil(bobs.request_id, "deny")
    async with open_kernel(tmp_path, model, account_policies={"alice": ASK_ECHO}, approval=None) as k:
        proc = await k.spawn("alice")
        await proc.send("echo risky")
        ask = await asked(proc)
        with pytest.raises(ValueError):
            await proc.hil(ask.request_id, "approve", remember="account")
        await proc.hil(ask.request_id, "deny")


async def test_a_later_server_wide_deny_reaches_an_account_with_remembered_rules(tmp_path: Path) -> None:
    """ "a file with neither `default` nor `rules` keeps the server-wide policy, later changes
    included"; remembered rules "cannot outrank a `deny`"."""
    home = tmp_path / "home" / "alice"
    home.mkdir(parents=True)
    rule = {"match": "tool.echo", "action": "auto"}
    (home / "approval.json").write_text(json.dumps({"remembered": [rule]}))
    deny = {"default": "auto", "rules": [{"match": "tool.echo", "action": "deny"}]}
    async with open_kernel(tmp_path, ScriptedModel(brain), policy=deny, approval=None) as k:
        proc = await k.spawn("alice")
        await proc.send("echo hi")
        await asyncio.wait_for(proc.wait_idle(), 5)
        [result] = [m.message for m in await proc.history() if isinstance(m.message, ToolResultMessage)]
        assert result.is_error and "denied" in result.text


# ------------------------------------------------------------------------------- manual compaction


async def test_manual_compaction_keep_last_through_and_summary(tmp_path: Path) -> None:
    """``keep_last`` keeps the newest N messages, moved back rather than part a tool call from its
    results; ``through`` summarises up to and including that message; ``summary`` makes no model
    call; bad options change nothing; ``proc.compacted`` has reason ``manual``."""
    model = ScriptedModel(brain)
    async with open_kernel(tmp_path, model) as k:
        proc = await k.spawn("alice")
        for text in ("one", "two", "echo three", "four"):
            await proc.send(text, mode="queue")
        await asyncio.wait_for(proc.wait_idle(), 5)
        before = await proc.history()
        roles = [m.message.role for m in before]
        assert (
            roles
            == ["user", "assistant", "user", "assistant", "user", "assistant", "toolResult", "assistant"][: len(roles)]
            + roles[8:]
        )
        calls = len(model.requests)
        for bad in (
            {"keep_last": 2, "through": before[0].id},
            {"summary": "S", "instructions": "keep names"},
            {"summary": ""},
            {"summary": "x" * 20_001},
            {"summary": "bell\x07"},
            {"through": 10**9},
        ):
            instructions = bad.pop("instructions", None)
            with pytest.raises((ValueError, TypeError)):
                await proc.compact(instructions, **bad)
        assert [m.id for m in await proc.history()] == [m.id for m in before]
        # the newest 4 would begin with the tool result: the cut moves back to its call (5 kept)
        done = await proc.compact(keep_last=4, summary="Mine.\tTabs\nand lines are fine.")
        assert done.compacted and len(model.requests) == calls
        after = [m.message for m in await proc.history()]
        assert isinstance(after[0], SystemMessage) and "Mine." in after[0].text
        assert after[1:] == [m.message for m in before[-5:]] and after[1].tool_calls
        [signal] = await signals_of(proc, "proc.compacted")
        assert signal.payload.get("reason") == "manual"
        await proc.send("five")
        await asyncio.wait_for(proc.wait_idle(), 5)
        now = await proc.history()
        assert now[1].message.tool_calls  # through the call: its results are summarised too
        assert (await proc.compact(through=now[1].id, summary="Second.")).compacted
        kept = [m.message for m in await proc.history()]
        assert kept[1:] == [m.message for m in now[3:]] and "Second." in kept[0].text


# ---------------------------------------------------------------------------------------- tool scope


async def test_spawn_with_tools_and_set_tools(tmp_path: Path) -> None:
    """``spawn(..., tools=[...])``: its runs see only those, a call to another is ``Tool X not
    found``; ``set_tools`` from the next run on, ``tools()`` reads it; an unknown name is refused
    listing the available ones; patterns are not checked; restarts and forks keep the scope."""
    model = ScriptedModel(brain)
    async with open_kernel(tmp_path, model) as k:
        proc = await k.spawn("alice", tools=["echo"])
        assert await proc.tools() == ["echo"]
        await proc.send("sleep 0")
        await asyncio.wait_for(proc.wait_idle(), 5)
        assert [t.name for t in model.requests[0].tools] == ["echo"]
        [result] = [m.message for m in await proc.history() if isinstance(m.message, ToolResultMessage)]
        assert result.is_error and result.text == "Tool slow not found"
        with pytest.raises(ValueError, match="echo") as refused_scope:
            await proc.set_tools(["nope"])
        assert "slow" in str(refused_scope.value) and await proc.tools() == ["echo"]
        assert await proc.set_tools(["mcp:github", "github__*", "slow"]) == ["mcp:github", "github__*", "slow"]
        fork = await proc.fork()
        assert await fork.tools() == await proc.tools()
        pid = proc.pid
    async with open_kernel(tmp_path, model) as k:
        again = await k.process(pid)
        assert await again.tools() == ["mcp:github", "github__*", "slow"]
        await again.set_tools(None)
        assert await again.tools() is None
    assert allows(["Shell"], "Jobs") and not allows(["Read"], "Jobs")


async def test_the_readmes_spawn_with_builtin_tool_names(tmp_path: Path) -> None:
    """``spawn(..., tools=["Read", "Search", "mcp:github"])`` on a kernel with its own tools."""
    async with Kernel.open(f"sqlite:///{tmp_path}/k.db", model=ScriptedModel(lambda r: "ok"), workspace=tmp_path) as k:
        proc = await k.spawn("alice", tools=["Read", "Search", "mcp:github"])
        assert await proc.tools() == ["Read", "Search", "mcp:github"]
        assert {"Read", "Search", "Shell", "Jobs"} <= set(await proc.available_tools())
        assert await proc.set_tools(["Shell", "github__*"]) == ["Shell", "github__*"]


# ------------------------------------------------------------------------------- skill activation


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


async def test_skills_activate_by_name_and_by_path(tmp_path: Path) -> None:
    """A ``$name`` in the user's message (not one in code, nor an unknown name), or a path a
    skill's ``paths:`` globs match (``paths: src/**/*.py, *.sql``), puts the skill's body into a
    final ``[active skills]`` section of that run's prompt; every model call of the run sends it."""
    layer = tmp_path / "config" / "ai" / "skills.d"
    write(layer / "deploy" / "SKILL.md", "---\nname: deploy\ndescription: How to ship.\n---\nRun make ship.\n")
    write(layer / "lint.md", "---\ndescription: Lint.\npaths: src/**/*.py, *.sql\n---\nRun ruff on it.\n")
    prompts: list[str] = []

    def script(req: ModelRequest) -> Reply | str:
        prompts.append(req.system_prompt)
        if isinstance(req.messages[-1], UserMessage):
            return Reply(tool_calls=[call("echo", text="x")])
        return "ok"

    async with open_kernel(tmp_path, ScriptedModel(script), data_dir=tmp_path) as k:
        proc = await k.spawn("alice")

        async def prompts_of(text: str) -> list[str]:
            del prompts[:]
            await proc.send(text)
            await asyncio.wait_for(proc.wait_idle(), 5)
            return list(prompts)

        named = await prompts_of("Ship it with $deploy please.")
        assert len(named) == 2 and named[0] == named[1]
        assert "[active skills]" in named[0] and named[0].rstrip().endswith("Run make ship.")
        for plain in ("Use `$deploy` here", "```\n$deploy\n```", "Try $nosuchskill", "hello"):
            assert "[active skills]" not in (await prompts_of(plain))[0], plain
        for path in ("Look at src/app/main.py", "fix schema.sql"):
            assert "Run ruff on it." in (await prompts_of(path))[0].split("[active skills]")[-1], path
        assert "[active skills]" not in (await prompts_of("Look at docs/main.py"))[0]


# ---------------------------------------------------------------------------------- speaker lines


async def test_a_group_messages_speaker_line(tmp_path: Path) -> None:
    """``Process.send(..., origin=...)``: in a group the model sees ``[From: Alice
    (telegram:12345)]`` first, the history keeps what was typed, a direct chat's prompt stays."""
    model = ScriptedModel(lambda req: "ok")
    async with open_kernel(tmp_path, model) as k:
        proc = await k.spawn("alice")
        await proc.send("hi all", origin=Origin(name="Alice", user="telegram:12345", chat="group"))
        await asyncio.wait_for(proc.wait_idle(), 5)
        assert user_texts(model.requests[-1]) == ["[From: Alice (telegram:12345)]\nhi all"]
        direct = await k.spawn("bob")
        await direct.send("hi", origin=Origin(name="Bob", user="telegram:9", chat="direct"))
        await asyncio.wait_for(direct.wait_idle(), 5)
        assert user_texts(model.requests[-1]) == ["hi"]
        [stored, *_] = [m.message for m in await proc.history()]
        assert stored.text == "hi all" and stored.origin == Origin(name="Alice", user="telegram:12345", chat="group")
    assert "`[From: Alice (telegram:12345)]`" in README


# ---------------------------------------------------------------------------- serve's chat bridges


def test_serve_takes_the_bridge_flags_and_refuses_kernel_options_in_them(tmp_path: Path) -> None:
    env = {"COLUMNS": "200", "TELEGRAM_BOT_TOKEN": "123:abc", "AGENTLOOP_CONFIG": str(tmp_path / "none.toml")}
    text = runner.invoke(app, ["serve", "--help"], env=env).output
    assert all(flag in text for flag in ("--telegram", "--whatsapp", "--discord"))
    kernel_options = ("--model openai:gpt-4o", "--workspace /tmp", "--data /tmp/x", "--store sqlite:///x.db")
    for option in (*kernel_options, "--approval auto", "--transcribe-model openai:whisper-1"):
        result = runner.invoke(app, ["serve", "--data", str(tmp_path), "--telegram", f"--allow 1 {option}"], env=env)
        assert result.exit_code == 2 and "set on serve itself" in result.output, (option, result.output)
    cfg = tmp_path / "config.toml"
    cfg.write_text('[bridges]\nsignal = "--allow 1"\n')
    result = runner.invoke(app, ["serve", "--data", str(tmp_path)], env={**env, "AGENTLOOP_CONFIG": str(cfg)})
    assert result.exit_code == 2 and "bridges names no bridge: signal" in result.output, result.output


# --------------------------------------------------------------------------------------- events


SMALL = ModelInfo(provider="scripted", id="small", context_window=3_000, max_output=200)
CHUNK = "lorem ipsum dolor sit amet " * 60


@tool
def dump(n: int) -> str:
    """Return a long text."""
    return f"chunk {n}: {CHUNK}"


async def test_a_streamed_run_shows_compaction_start_and_end() -> None:
    left = {"fills": 8}

    def script(r: ModelRequest) -> Reply | str:
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return Reply(text="Summary.", input_tokens=100, output_tokens=20)
        used = estimated_context(r.system_prompt, r.tools, r.messages)
        if left["fills"]:
            left["fills"] -= 1
            return Reply(tool_calls=[call("dump", n=left["fills"])], input_tokens=used)
        return Reply(text="done", input_tokens=used)

    agent = Agent(model=ScriptedModel(script, info=SMALL), tools=[dump])
    agent.use(Compaction(threshold=0.9))
    events = [e async for e in agent.stream("fill it")]
    starts = [e for e in events if isinstance(e, CompactionStart)]
    ends = [e for e in events if isinstance(e, CompactionEnd)]
    assert starts and len(starts) == len(ends) and starts[0].reason == "threshold"
    end = ends[0]
    assert end.compacted and not end.will_retry and end.error is None and end.removed > 0
    assert end.tokens_before is not None and end.tokens_after is not None


@tool
def look(path: str) -> ToolResult:
    """Look a path up."""
    if path == "ok":
        return ToolResult.text("found")
    return ToolResult.text(f"no such file: {path}", is_error=True, details={"error_class": "not_found"})


def retry_script() -> ScriptedModel:
    """not found, found (resolved), then three not-founds (the third past the budget of 2)."""
    paths = iter(["a", "ok", "b", "c", "d"])

    def script(req: ModelRequest) -> Reply | str:
        if not req.tools:
            return "I give up."
        path = next(paths, None)
        return Reply(tool_calls=[call("look", path=path)]) if path else "done"

    return ScriptedModel(script)


async def test_tool_retry_episodes_streamed_and_logged() -> None:
    """In memory: ``tool_retry_scheduled`` / ``_resolved`` / ``_exhausted`` after the step's
    ``turn_end``; durable: the signals ``proc.run.tool.retry.*`` with the docs' fields."""
    agent = Agent(model=retry_script(), tools=[look], pieces=[ToolRetry()])
    events = [e async for e in agent.stream("find")]
    kinds = [type(e) for e in events]
    first = kinds.index(ToolRetryScheduled)
    assert kinds[first - 1] is TurnEnd
    assert ToolRetryResolved in kinds and ToolRetryExhausted in kinds
    assert kinds.index(ToolRetryResolved) < kinds.index(ToolRetryExhausted)


async def test_tool_retry_signals_of_a_durable_process(tmp_path: Path) -> None:
    async with open_kernel(tmp_path, retry_script(), tools=[look], pieces=[ToolRetry()]) as k:
        proc = await k.spawn("alice", text="find")
        await asyncio.wait_for(proc.wait_idle(), 5)
        told = await signals_of(proc, "proc.run.tool.retry.")
        names = [s.signal.rsplit(".", 1)[1] for s in told]
        assert names[0] == "scheduled" and "resolved" in names and names[-1] == "exhausted"
        keys = {s.signal.rsplit(".", 1)[1]: set(s.payload) for s in told}
        assert keys["scheduled"] >= {
            "runId", "callId", "name", "errorClass", "roundsLeft", "classLeft", "toolLeft", "signatureLeft"
        }  # fmt: skip
        assert keys["resolved"] >= {"runId", "failures", "rounds"}
        assert keys["exhausted"] >= {"runId", "callId", "name", "errorClass", "budget", "limit", "reason"}
        order = [s.signal for s in await signals_of(proc, "proc.run.")]
        exhausted = order.index("proc.run.tool.retry.exhausted")
        assert "proc.run.finished" in order[exhausted:]


# ------------------------------------------------------------------------------------ the cache


async def test_the_process_cache_is_bounded_and_reads_back(tmp_path: Path) -> None:
    """ "a server keeps at most 1000 processes … in memory (`kernel.engine.cache_limit`): past that,
    the least recently used idle ones are dropped and read back from the store when next used"."""
    model = ScriptedModel(brain)
    async with open_kernel(tmp_path, model) as k:
        assert k.engine.cache_limit == 1000
        k.engine.cache_limit = 2
        procs = []
        for n in range(5):
            proc = await k.spawn("alice", text=f"hello {n}")
            await asyncio.wait_for(proc.wait_idle(), 5)
            procs.append(proc)
            gc.collect()  # (a process some uncollected cycle still refers to is not dropped: it is held)
        await wait_until(lambda: len(k.engine._live) <= 2)
        [n, gone] = next((n, p) for n, p in enumerate(procs) if p.pid not in k.engine._live)
        history = [m.message.text for m in await gone.history()]
        assert history == [f"hello {n}", f"answer: hello {n}"]
        await gone.send("back")
        await asyncio.wait_for(gone.wait_idle(), 5)
        assert [m.message.text for m in await gone.history()][-1] == "answer: back"


# ----------------------------------------------------------------------------------- transcriber


async def test_a_plain_def_transcriber_runs_in_a_worker_thread(tmp_path: Path) -> None:
    from agentloop.process.audio_video import AudioContent

    threads: list[str] = []

    class Plain:
        def transcribe(self, audio: bytes, filename: str, mime: str) -> str:
            threads.append(threading.current_thread().name)
            return "hello"

    model = ScriptedModel(lambda req: "ok")
    async with open_kernel(tmp_path, model, transcriber=Plain()) as k:
        proc = await k.spawn("alice")
        await proc.send("", media=[AudioContent(data=b64(OGG), mime_type="audio/ogg", name="memo.ogg")])
        await asyncio.wait_for(proc.wait_idle(), 5)
    assert threads and threads[0] != threading.main_thread().name
    assert user_texts(model.requests[-1]) == ['[Transcribed audio file "memo.ogg"]: hello']


# ------------------------------------------------------------------------------------- the server


@dataclass
class FakeTranscriber:
    asked: list[str] = field(default_factory=list)

    async def transcribe(self, audio: bytes, filename: str, mime: str) -> str:
        self.asked.append(filename)
        return "from the memo"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    options = {"transcriber": FakeTranscriber()}
    model = ScriptedModel(brain, keep_requests=False)
    with live_server(tmp_path_factory.mktemp("audit10"), model=model, kernel_options=options) as srv:
        yield srv


alice = server_support.alice
bob = server_support.bob


def ws(server: LiveServer) -> Client:
    url = server.url.replace("http://", "ws://") + "/v1/ws"
    client = Client(connect(url, open_timeout=5, close_timeout=2).__enter__())
    client.ok("sys.connect", {"role": "user", "token": server.tokens.alice})
    return client


async def spawn(client: httpx.AsyncClient, **body: Any) -> str:
    resp = await client.post("/v1/processes", json=body)
    assert resp.status_code == 201, resp.text
    pid: str = resp.json()["pid"]
    return pid


async def test_http_reject_and_expected_run_id(alice: httpx.AsyncClient) -> None:
    """409 ``busy`` (no ``Retry-After``) and 409 ``run_not_current``, both with
    ``current_run_id``, nothing delivered; the two together are a 400; a retried ``run_id`` that
    got through answers its receipt first."""
    pid = await spawn(alice)
    first = await alice.post(f"/v1/processes/{pid}/messages", json={"text": "sleep 30", "run_id": "r-1"})
    run = first.json()["run_id"]
    busy = await alice.post(f"/v1/processes/{pid}/messages", json={"text": "x", "mode": "reject"})
    refused(busy, 409, "busy")
    assert busy.json()["current_run_id"] == run and "retry-after" not in busy.headers
    stale = await alice.post(f"/v1/processes/{pid}/messages", json={"text": "x", "expected_run_id": "old"})
    refused(stale, 409, "run_not_current")
    assert stale.json()["current_run_id"] == run
    both = {"text": "x", "mode": "reject", "expected_run_id": run}
    refused(await alice.post(f"/v1/processes/{pid}/messages", json=both), 400, "invalid_request")
    again = await alice.post(
        f"/v1/processes/{pid}/messages", json={"text": "sleep 30", "run_id": "r-1", "mode": "reject"}
    )
    assert again.status_code == 202 and again.json()["run_id"] == run
    assert (await alice.get(f"/v1/processes/{pid}/queue")).json()["items"] == []
    await alice.post(f"/v1/processes/{pid}/abort", json={})
    await wait_idle(alice, pid)
    gone = await alice.post(f"/v1/processes/{pid}/messages", json={"text": "x", "expected_run_id": run})
    refused(gone, 409, "run_not_current")
    assert gone.json()["current_run_id"] is None
    texts = [m["message"] for m in (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"]]
    assert not any(str(m.get("content")) == "x" for m in texts)


async def test_the_409s_are_not_counted_against_the_input_rate(server: LiveServer, bob: httpx.AsyncClient) -> None:
    assert server.ctx is not None
    limit = server.ctx.max_inputs_per_minute
    server.ctx.max_inputs_per_minute = 2
    try:
        pid = await spawn(bob)
        run = (await bob.post(f"/v1/processes/{pid}/messages", json={"text": "sleep 30"})).json()["run_id"]
        for _ in range(4):
            refused(await bob.post(f"/v1/processes/{pid}/messages", json={"text": "x", "mode": "reject"}), 409, "busy")
            stale = {"text": "x", "expected_run_id": "old"}
            refused(await bob.post(f"/v1/processes/{pid}/messages", json=stale), 409, "run_not_current")
        steer = await bob.post(f"/v1/processes/{pid}/messages", json={"text": "more", "expected_run_id": run})
        assert steer.status_code == 202 and steer.json()["run_id"] == run
        refused(await bob.post(f"/v1/processes/{pid}/messages", json={"text": "third"}), 429, "rate_limited")
    finally:
        server.ctx.max_inputs_per_minute = limit
    await bob.delete(f"/v1/processes/{pid}/queue")
    await bob.post(f"/v1/processes/{pid}/abort", json={})
    await wait_idle(bob, pid)


async def test_http_edit_and_account_remember_on_a_policy_given_in_code(
    server: LiveServer, alice: httpx.AsyncClient
) -> None:
    """The edited call's result begins with the docs' note and the answer says ``edited``;
    ``remember: "account"`` is a 400 when the policy is not kept in files (this server's is a
    function), the request still pending."""
    pid = await spawn(alice, text="echo risky")
    [request] = await pending_requests(alice, pid)
    url = f"/v1/processes/{pid}/hil/{request['request_id']}"
    refused(await alice.post(url, json={"decision": "approve", "remember": "account"}), 400, "invalid_request")
    assert len((await alice.get(f"/v1/processes/{pid}/hil")).json()["requests"]) == 1
    answer = await alice.post(url, json={"decision": "approve", "arguments": {"text": "calm"}})
    assert answer.status_code == 200 and answer.json().get("edited") is True, answer.text
    await wait_idle(alice, pid)
    messages = [m["message"] for m in (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"]]
    [result] = [m for m in messages if m["role"] == "toolResult"]
    text = "".join(b.get("text", "") for b in result["content"])
    assert text.startswith(NOTE) and '"calm"' in text


async def test_http_compact_options(alice: httpx.AsyncClient) -> None:
    pid = await spawn(alice, text="one")
    await wait_idle(alice, pid)
    for text in ("two", "three"):
        await alice.post(f"/v1/processes/{pid}/messages", json={"text": text})
        await wait_idle(alice, pid)
    messages = (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"]
    url = f"/v1/processes/{pid}/compact"
    for bad in (
        {"keep_last": 2, "through": messages[0]["id"]},
        {"summary": "S", "instructions": "keep it"},
        {"summary": ""},
        {"summary": "x" * 20_001},
        {"through": 987654321},
    ):
        refused(await alice.post(url, json=bad), 400, "invalid_request")
    done = await alice.post(url, json={"keep_last": 2, "summary": "My summary.\t" + "x" * 19_988})
    assert done.status_code == 200 and done.json()["compacted"] is True, done.text
    after = [m["message"] for m in (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"]]
    assert after[0]["role"] == "system" and len(after) == 3
    assert [m["message"] for m in messages[-2:]] == after[1:]


async def test_http_and_ws_tool_scope(server: LiveServer, alice: httpx.AsyncClient) -> None:
    pid = await spawn(alice, tools=["echo"])
    scope = (await alice.get(f"/v1/processes/{pid}/tools")).json()
    assert scope["tools"] == ["echo"] and {"echo", "slow"} <= set(scope["available"]) and scope["pid"] == pid
    bad = await alice.post(f"/v1/processes/{pid}/tools", json={"tools": ["nope"]})
    refused(bad, 400, "invalid_request")
    assert "slow" in bad.json()["message"]
    changed = await alice.post(f"/v1/processes/{pid}/tools", json={"tools": ["slow", "mcp:github"]})
    assert changed.json()["tools"] == ["slow", "mcp:github"]
    events = (await alice.get(f"/v1/processes/{pid}/events", params={"follow": "false"})).text
    assert '"changes": ["tools"]' in events or '"changes":["tools"]' in events
    client = ws(server)
    try:
        assert client.ok("proc.tools.get", {"pid": pid})["tools"] == ["slow", "mcp:github"]
        assert client.ok("proc.tools.set", {"pid": pid, "tools": None})["tools"] is None
        spawned = client.ok("proc.spawn", {"tools": ["echo"]})
        assert client.ok("proc.tools.get", {"pid": spawned["pid"]})["tools"] == ["echo"]
        pid2 = client.ok("proc.spawn", {"text": "hello"})["pid"]
        await wait_idle(alice, pid2)
        done = client.ok("proc.compact", {"pid": pid2, "keep_last": 1, "summary": "S."})
        assert done["compacted"] is True and done["removed"] == 1
        stale = client.call("proc.send", {"pid": pid2, "text": "x", "expected_run_id": "old"})
        assert stale["error"]["code"] == "run_not_current" and stale["error"]["current_run_id"] is None
    finally:
        client.close()


async def test_http_generic_types_by_file_name(alice: httpx.AsyncClient) -> None:
    """An ``application/octet-stream`` or empty type counts as video (``clip.mp4``, ``trip.mov``,
    ``a.webm``) or audio (``memo.ogg``) by the name."""
    for name, mime in (("clip.mp4", "application/octet-stream"), ("trip.mov", ""), ("a.webm", "")):
        pid = await spawn(alice)
        media = [{"data": b64(bytes(64)), "mime_type": mime, "name": name}]
        sent = await alice.post(f"/v1/processes/{pid}/messages", json={"text": "see", "media": media})
        assert sent.status_code == 202, (name, sent.text)
        await wait_idle(alice, pid)
        [first, *_] = (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"]
        text = "".join(b.get("text", "") for b in first["message"]["content"])
        assert f'[Attached video "{name}"' in text, text
    pid = await spawn(alice)
    media = [{"data": b64(OGG), "mime_type": "application/octet-stream", "name": "memo.ogg"}]
    sent = await alice.post(f"/v1/processes/{pid}/messages", json={"text": "hear", "media": media})
    assert sent.status_code == 202, sent.text
    await wait_idle(alice, pid)
    [first, *_] = (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"]
    text = "".join(b.get("text", "") for b in first["message"]["content"])
    assert '[Transcribed audio file "memo.ogg"]: from the memo' in text
