"""``agentloop chat`` on a durable process: the conversation outlives the command, and tool
calls the policy asks about are put to the user at the prompt.

In-process tests (typer's ``CliRunner``) register a capturing scripted provider, so they can see
exactly what the model was sent; subprocess tests use ``scripted:<file>`` models and real pipes.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from agentloop.cli.main import app
from agentloop.cli.render import SignalRenderer, TextRenderer, stderr_console
from agentloop.messages import AssistantMessage, ToolResultMessage, UserMessage
from agentloop.models.base import ProviderError
from agentloop.models.registry import register_provider
from agentloop.models.scripted import Reply, ScriptedModel, call
from agentloop.process import signals as psig
from agentloop.process.signals import Signal

runner = CliRunner()


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No user config, no model or data directory from the environment."""
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG", "AGENTLOOP_DATA"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "build").mkdir()
    return workspace


def model(name: str, replies: list[Any]) -> ScriptedModel:
    scripted = ScriptedModel(replies)
    register_provider(name, lambda _id: scripted)
    return scripted


def chat(ws: Path, data: Path, model_name: str, stdin: str, *extra: str) -> Any:
    result = runner.invoke(
        app, ["chat", "-m", f"{model_name}:x", "-w", str(ws), "--data", str(data), *extra], input=stdin
    )
    assert result.exit_code == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result


def texts(messages: list[Any]) -> list[str]:
    return [m.text for m in messages if isinstance(m, UserMessage | AssistantMessage | ToolResultMessage)]


def pid_of(stderr: str) -> str:
    found = re.search(r"(?:new|continuing) conversation ([0-9a-f]+)", stderr)
    assert found, stderr
    return found.group(1)


# ---------------------------------------------------------------------------------- continuing


def test_a_second_chat_continues_the_conversation_and_new_starts_afresh(tmp_path: Path, ws: Path) -> None:
    data = tmp_path / "data"
    first_model = model("first", ["first answer"])
    first = chat(ws, data, "first", "first question\n")
    assert first.stdout == "first answer\n"
    assert [m.text for m in first_model.requests[0].messages] == ["first question"]
    pid = pid_of(first.stderr)
    assert f"new conversation {pid}" in first.stderr
    assert (data / "agentloop.db").exists()
    assert stat.S_IMODE(data.stat().st_mode) == 0o700  # every conversation is in there: the owner's only
    assert stat.S_IMODE((data / "agentloop.db").stat().st_mode) == 0o600
    assert json.loads((data / "chat.json").read_text())["chats"][str(ws.resolve())]["pid"] == pid

    second_model = model("second", ["second answer"])
    second = chat(ws, data, "second", "second question\n")
    assert f"continuing conversation {pid} (2 messages)" in second.stderr
    assert second.stdout == "second answer\n"
    sent = second_model.requests[0].messages
    assert [type(m) for m in sent] == [UserMessage, AssistantMessage, UserMessage]
    assert texts(sent) == ["first question", "first answer", "second question"]

    fresh_model = model("fresh", ["fresh answer", "after slash-new"])
    fresh = chat(ws, data, "fresh", "third question\n/new\nfourth question\n", "--new")
    assert "continuing" not in fresh.stderr
    assert pid_of(fresh.stderr) != pid
    assert texts(fresh_model.requests[0].messages) == ["third question"]
    assert texts(fresh_model.requests[1].messages) == ["fourth question"]  # /new inside the REPL
    assert "(new conversation)" in fresh.stderr

    # the newest conversation (the one /new started) is what the next chat continues
    last_model = model("last", ["last answer"])
    last = chat(ws, data, "last", "fifth question\n")
    assert "(2 messages)" in last.stderr
    assert texts(last_model.requests[0].messages) == ["fourth question", "after slash-new", "fifth question"]


@pytest.mark.parametrize("memory", [False, True])
def test_slash_chat_answers_without_tools_and_slash_agent_brings_them_back(
    tmp_path: Path, ws: Path, memory: bool
) -> None:
    scripted = model("modes", ["with tools", "without", "with tools again"])
    extra = ("--memory",) if memory else ()
    result = chat(ws, tmp_path / "data", "modes", "one\n/chat\ntwo\n/agent\nthree\n", *extra)
    assert [bool(r.tools) for r in scripted.requests] == [True, False, True]
    assert texts(scripted.requests[1].messages) == ["one", "with tools", "two"]  # the same conversation
    assert "(chat mode: answers without tools)" in result.stderr and "(agent mode: tools on)" in result.stderr


def test_without_the_state_file_the_users_newest_process_in_the_workspace_is_continued(
    tmp_path: Path, ws: Path
) -> None:
    data = tmp_path / "data"
    model("one", ["remembered"])
    pid = pid_of(chat(ws, data, "one", "remember this\n").stderr)
    (data / "chat.json").unlink()
    again = model("two", ["still here"])
    assert f"continuing conversation {pid}" in chat(ws, data, "two", "what did I say?\n").stderr
    assert texts(again.requests[0].messages)[:2] == ["remember this", "remembered"]

    other = tmp_path / "other"
    other.mkdir()
    elsewhere = model("three", ["hello"])
    assert "new conversation" in chat(other, data, "three", "hi\n").stderr  # another workspace, another chat
    assert texts(elsewhere.requests[0].messages) == ["hi"]


def test_a_data_path_that_is_a_file_is_one_clear_error(tmp_path: Path, ws: Path) -> None:
    (tmp_path / "data").write_text("not a directory")
    model("file-data", ["never"])
    result = runner.invoke(
        app, ["chat", "-m", "file-data:x", "-w", str(ws), "--data", str(tmp_path / "data")], input="hi\n"
    )
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "cannot use the data directory" in result.stderr and "not a directory" in result.stderr


def test_data_directory_from_the_environment(tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTLOOP_DATA", str(tmp_path / "env-data"))
    model("envdata", ["ok"])
    result = runner.invoke(app, ["chat", "-m", "envdata:x", "-w", str(ws)], input="hi\n")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "env-data" / "agentloop.db").exists()
    monkeypatch.delenv("AGENTLOOP_DATA")
    model("xdgdata", ["ok"])
    result = runner.invoke(app, ["chat", "-m", "xdgdata:x", "-w", str(ws)], input="hi\n")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "xdg" / "agentloop" / "agentloop.db").exists()


def test_tools_and_errors_render_from_signals(tmp_path: Path, ws: Path) -> None:
    (ws / "a.txt").write_text("hello from a\n")
    scripted = model(
        "render",
        [
            Reply(text="Reading.", tool_calls=[call("Read", path="a.txt")]),
            Reply(tool_calls=[call("Read", path="missing.txt")]),
            "It says hello.",
            ProviderError("bad gateway", kind="bad_request"),
            "recovered",
        ],
    )
    scripted.chunk = 3
    result = chat(ws, tmp_path / "data", "render", "read a.txt\nfail now\nagain\n")
    assert result.stdout == "Reading.\nIt says hello.\nrecovered\n"
    err = result.stderr
    assert "▸ Read a.txt" in err and "✓ Read a.txt" in err
    assert re.search(r"✗ Read missing.txt: .*not found", err, re.IGNORECASE)
    assert "error: bad gateway" in err
    assert texts(scripted.requests[4].messages)[-1] == "again"


def test_model_retries_show_in_the_durable_chat(tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import agentloop.models.retry as retry

    monkeypatch.setattr(
        retry.RetryPolicy, "delay", lambda self, attempt, retry_after=None: 0.0 if attempt < 2 else None
    )
    model("retrying", [ProviderError("overloaded", kind="rate_limit"), "ok"])
    result = chat(ws, tmp_path / "data", "retrying", "hi\n")
    assert result.stdout == "ok\n"
    assert "↻" in result.stderr and "overloaded" in result.stderr and "retry 1" in result.stderr


def test_signal_renderer_fills_in_unstreamed_text_and_shows_compaction() -> None:
    """A watcher that missed the deltas (joined late, or after a restart) still gets the whole
    answer from ``proc.run.output``, and never twice."""
    out = io.StringIO()
    err_text = io.StringIO()
    view = SignalRenderer(TextRenderer(out, stderr_console(err_text)))
    view.handle(Signal(psig.RUN_STARTED, {"runId": "r"}, 1))
    view.handle(Signal(psig.RUN_STREAM, {"event": "text_delta", "delta": "Hel"}))
    view.handle(Signal(psig.RUN_OUTPUT, {"text": "Hello."}, 2))  # the rest of it, once
    view.handle(Signal(psig.COMPACTED, {"runId": "r", "reason": "threshold", "removed": 12}, 3))
    view.handle(Signal(psig.RUN_OUTPUT, {"text": "Second message."}, 4))  # nothing streamed at all
    view.handle(Signal(psig.RUN_FINISHED, {"runId": "r", "status": "ok"}, 5))
    assert out.getvalue() == "Hello.\nSecond message.\n"
    assert err_text.getvalue() == "compacted 12 messages (threshold)\n"


def test_a_nested_approval_request_does_not_rename_the_program_asking() -> None:
    """A CodeMode program's nested request carries the program's callId: its result line still
    names the program, not the call it asked about."""
    err_text = io.StringIO()
    view = SignalRenderer(TextRenderer(io.StringIO(), stderr_console(err_text)))
    view.handle(Signal(psig.TOOL_STARTED, {"callId": "c1", "name": "CodeMode", "args": {"code": "x"}}, 1))
    asked = {"callId": "c1", "name": "Delete", "args": {"path": "f.txt"}, "nested": True}
    view.handle(Signal(psig.HIL_REQUESTED, asked, 2))
    view.handle(Signal(psig.TOOL_FINISHED, {"callId": "c1", "name": "CodeMode", "ok": True, "output": "done"}, 3))
    *_, last = err_text.getvalue().splitlines()
    assert "CodeMode" in last and "Delete" not in last


# ---------------------------------------------------------------------------------- approvals


def test_an_asked_call_runs_when_the_user_says_yes(tmp_path: Path, ws: Path) -> None:
    scripted = model("yes", [Reply(tool_calls=[call("Shell", command="rm -rf build")]), "cleaned"])
    result = chat(ws, tmp_path / "data", "yes", "clean up\ny\n")
    assert not (ws / "build").exists()
    assert result.stdout == "cleaned\n"
    err = result.stderr
    assert "approve Shell rm -rf build" in err
    assert "tags: " in err and "destructive" in err and "mutating" in err  # what made the policy ask
    assert "why: shell command is destructive" in err
    assert "Allow? [y]es / [n]o / [a]lways" in err
    assert "✓ Shell rm -rf build" in err
    [result_msg] = [m for m in scripted.requests[1].messages if isinstance(m, ToolResultMessage)]
    assert not result_msg.is_error


def test_an_asked_call_is_refused_when_the_user_says_no(tmp_path: Path, ws: Path) -> None:
    scripted = model("no", [Reply(tool_calls=[call("Shell", command="rm -rf build")]), "I left it"])
    result = chat(ws, tmp_path / "data", "no", "clean up\nn\n")
    assert (ws / "build").exists()
    assert result.stdout == "I left it\n"
    assert "✗ Shell rm -rf build: Tool execution denied by user" in result.stderr
    [result_msg] = [m for m in scripted.requests[1].messages if isinstance(m, ToolResultMessage)]
    assert result_msg.is_error and result_msg.text == "Tool execution denied by user"


def test_a_piped_line_that_is_no_answer_denies_and_becomes_the_next_message(tmp_path: Path, ws: Path) -> None:
    scripted = model("piped", [Reply(tool_calls=[call("Shell", command="rm -rf build")]), "I left it", "re: what else"])
    result = chat(ws, tmp_path / "data", "piped", "clean up\nyeah, and what else?\n")
    assert (ws / "build").exists()
    assert "not an answer: denied" in result.stderr
    assert result.stdout == "I left it\nre: what else\n"
    assert scripted.requests[2].messages[-1].text == "yeah, and what else?"


def test_always_remembers_for_the_conversation_and_survives_a_restart(tmp_path: Path, ws: Path) -> None:
    data = tmp_path / "data"
    (ws / "build2").mkdir()
    (ws / "build3").mkdir()
    model(
        "always",
        [
            Reply(tool_calls=[call("Shell", command="rm -rf build")]),
            "one",
            Reply(tool_calls=[call("Shell", command="rm -rf build2")]),
            "two",
        ],
    )
    result = chat(ws, data, "always", "clean\na\nand build2\n")
    assert result.stdout == "one\ntwo\n"
    assert result.stderr.count("Allow?") == 1  # the second rm -rf was not asked about
    assert not (ws / "build").exists() and not (ws / "build2").exists()

    model("always2", [Reply(tool_calls=[call("Shell", command="rm -rf build3")]), "three"])
    again = chat(ws, data, "always2", "and build3\n")  # remembered rules live with the process
    assert "Allow?" not in again.stderr and not (ws / "build3").exists()

    model("always3", [Reply(tool_calls=[call("Shell", command="rm -rf build4")]), "four"])
    fresh = chat(ws, data, "always3", "new one\nn\n", "--new")  # a new conversation asks again
    assert fresh.stderr.count("Allow?") == 1


def test_end_of_input_at_the_question_denies(tmp_path: Path, ws: Path) -> None:
    model("eof", [Reply(tool_calls=[call("Shell", command="rm -rf build")]), "ok then"])
    result = chat(ws, tmp_path / "data", "eof", "clean up\n")
    assert (ws / "build").exists()
    assert "(no answer: denied)" in result.stderr
    assert result.stdout == "ok then\n"


@pytest.mark.parametrize(
    ("flag", "asked", "runs"),
    [("auto", False, True), ("deny", False, False), ("ask", True, True)],
)
def test_approval_flag_in_chat(tmp_path: Path, ws: Path, flag: str, asked: bool, runs: bool) -> None:
    model(f"flag{flag}", [Reply(tool_calls=[call("Shell", command="rm -rf build")]), "done"])
    result = chat(ws, tmp_path / "data", f"flag{flag}", "clean up\n" + ("y\n" if asked else ""), "--approval", flag)
    assert ("Allow?" in result.stderr) is asked
    assert (not (ws / "build").exists()) is runs
    if flag == "deny":
        assert "✗ Shell rm -rf build: Tool execution denied by policy: denied by the default policy" in result.stderr
    assert result.stdout == "done\n"


def test_a_policy_file_and_a_malformed_one(tmp_path: Path, ws: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"default": "auto", "rules": [{"match": "shell.exec", "action": "deny"}]}))
    model("pfile", [Reply(tool_calls=[call("Shell", command="ls")]), "no shell"])
    result = chat(ws, tmp_path / "data", "pfile", "list\n", "--approval", str(policy))
    assert "✗ Shell ls: Tool execution denied by policy" in result.stderr

    policy.write_text('{"default": "sometimes", "rules": [')
    model("pbad", [Reply(tool_calls=[call("Shell", command="rm -rf build")]), "asked"])
    bad = chat(ws, tmp_path / "data", "pbad", "clean\ny\n", "--approval", str(policy), "--new")
    assert bad.stderr.startswith("warning: approval policy") and "default policy" in bad.stderr.splitlines()[0]
    assert "Allow?" in bad.stderr and not (ws / "build").exists()  # the default policy asked


def test_memory_chat_asks_too(tmp_path: Path, ws: Path) -> None:
    scripted = model("mem", [Reply(tool_calls=[call("Shell", command="rm -rf build")]), "gone", "second"])
    result = chat(ws, tmp_path / "data", "mem", "clean\ny\nnext\n", "--memory")
    assert result.stdout == "gone\nsecond\n"
    assert "tags: " in result.stderr and "destructive" in result.stderr and not (ws / "build").exists()
    assert texts(scripted.requests[2].messages)[0] == "clean"
    assert not (tmp_path / "data").exists()  # nothing stored


# ---------------------------------------------------------------------------------- real pipes


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG", "AGENTLOOP_DATA")}
    env["AGENTLOOP_CONFIG"] = str(tmp_path / "no-config.toml")
    env["XDG_DATA_HOME"] = str(tmp_path / "xdg")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def script(path: Path, replies: list[Any], **options: Any) -> str:
    path.write_text(json.dumps({"replies": replies, **options}))
    return f"scripted:{path}"


def cli(tmp_path: Path, args: list[str], stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentloop.cli.main", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
        env=_env(tmp_path),
    )


def cli_process(tmp_path: Path, args: list[str]) -> subprocess.Popen[str]:
    """``agentloop`` running in the background, its stdin, stdout and stderr piped to the test."""
    return subprocess.Popen(
        [sys.executable, "-m", "agentloop.cli.main", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(tmp_path),
    )


def cli_unread(tmp_path: Path, args: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    """``agentloop`` whose stdout nobody reads (``| head -c 3`` once head is done)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "agentloop.cli.main", *args],
            input=stdin,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(tmp_path),
            timeout=60,
        )
    finally:
        os.close(write_end)


def test_subprocess_chat_asks_then_a_second_chat_continues(tmp_path: Path, ws: Path) -> None:
    data = str(tmp_path / "data")
    rm = {"tool_calls": [{"name": "Shell", "arguments": {"command": "rm -rf build"}}]}
    first = cli(
        tmp_path,
        ["chat", "-m", script(tmp_path / "s1.json", [rm, "cleaned"], chunk=2), "-w", str(ws), "--data", data],
        "clean up\ny\n",
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout == "cleaned\n" and not (ws / "build").exists()
    assert "destructive" in first.stderr and "Allow? [y]es / [n]o / [a]lways" in first.stderr

    second = cli(
        tmp_path,
        ["chat", "-m", script(tmp_path / "s2.json", ["welcome back"]), "-w", str(ws), "--data", data],
        "hello again\n",
    )
    assert second.returncode == 0, second.stderr
    assert f"continuing conversation {pid_of(first.stderr)} (4 messages)" in second.stderr
    assert second.stdout == "welcome back\n"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture
def sleeper_pid(ws: Path) -> Iterator[Path]:
    pid_file = ws / "sleeper.pid"  # inside the workspace: writing it needs no approval
    yield pid_file
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_ctrl_c_aborts_the_turn_and_the_chat_goes_on(tmp_path: Path, ws: Path, sleeper_pid: Path) -> None:
    command = f"echo $$ > {sleeper_pid}.tmp && mv {sleeper_pid}.tmp {sleeper_pid} && exec sleep 1000"
    shell = {"tool_calls": [{"name": "Shell", "arguments": {"command": command}}]}
    model_spec = script(tmp_path / "s.json", [shell, "after the abort"])
    data = str(tmp_path / "data")
    proc = cli_process(tmp_path, ["chat", "-m", model_spec, "-w", str(ws), "--data", data])
    try:
        assert proc.stdin is not None
        proc.stdin.write("sleep please\nnext\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 20
        while not sleeper_pid.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the Shell tool never started the sleeper"
            time.sleep(0.05)
        pid = int(sleeper_pid.read_text())
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "(aborted)" in err and "Traceback" not in err
    assert out == "after the abort\n"  # the REPL went on with the next line
    deadline = time.monotonic() + 5
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), "the sleeper outlived the aborted turn"

    later = cli(
        tmp_path,
        ["chat", "-m", script(tmp_path / "s2.json", ["fine"]), "-w", str(ws), "--data", data],
        "still there?\n",
    )
    assert later.returncode == 0, later.stderr
    # sleep please, the aborted call and its cancelled result, next, its answer
    assert "(5 messages)" in later.stderr


def test_a_question_left_open_by_a_killed_chat_is_asked_by_the_next(tmp_path: Path, ws: Path) -> None:
    rm = {"tool_calls": [{"name": "Shell", "arguments": {"command": "rm -rf build"}}]}
    data = str(tmp_path / "data")
    args = ["chat", "-m", script(tmp_path / "s1.json", [rm, "unreachable"]), "-w", str(ws), "--data", data]
    proc = cli_process(tmp_path, args)
    try:
        assert proc.stdin is not None and proc.stderr is not None
        proc.stdin.write("clean up\n")
        proc.stdin.flush()
        seen = ""
        while "Allow?" not in seen:  # the question is waiting for an answer that never comes
            line = proc.stderr.readline()
            assert line, "the chat ended without asking"
            seen += line
        proc.kill()
        proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert (ws / "build").exists()

    later = cli(
        tmp_path,
        ["chat", "-m", script(tmp_path / "s2.json", ["cleaned after all"]), "-w", str(ws), "--data", data],
        "y\n",
    )
    assert later.returncode == 0, later.stderr
    assert "the last answer was unfinished" in later.stderr
    assert "approve Shell rm -rf build" in later.stderr and "destructive" in later.stderr
    assert not (ws / "build").exists()
    assert later.stdout == "cleaned after all\n"


async def test_on_a_terminal_a_line_that_is_no_answer_is_asked_again() -> None:
    from rich.console import Console

    from agentloop.cli.approvals import Question, ask_user

    lines = iter(["maybe", "a"])

    async def read(prompt: str) -> str:
        return next(lines)

    err = Console(file=io.StringIO(), width=200)
    answer = await ask_user(Question("Shell", {"command": "ls"}, ("network",), "why"), read, err, shows_prompt=True)
    assert answer == "always"
    assert "a (allow every Shell call for the rest of this conversation)" in err.file.getvalue()


@pytest.mark.parametrize("where", ["durable", "memory"])
def test_attach_sends_files_with_the_next_message(tmp_path: Path, ws: Path, where: str) -> None:
    from agentloop.messages import FileContent, ImageContent

    pdf = tmp_path / "report.pdf"
    pdf.write_bytes(b"%PDF-1.4\n%%EOF\n")
    notes = tmp_path / "notes.md"
    notes.write_text("# Plan\nship it\n")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x00\x01\x02")
    scripted = model(f"attaching{where}", ["read both", "and nothing attached now"])
    lines = [
        f"/attach {pdf}",
        f"/attach {notes}",
        f"/attach {binary}",  # refused, with a reason
        f"/attach {tmp_path / 'missing.txt'}",
        "/attach",  # lists what is attached
        "summarise these",
        "and again",
    ]
    extra = ("--memory",) if where == "memory" else ()
    result = chat(ws, tmp_path / "data", f"attaching{where}", "\n".join(lines) + "\n", *extra)
    assert result.stdout == "read both\nand nothing attached now\n"
    assert "attached report.pdf (application/pdf" in result.stderr
    assert "cannot attach" in result.stderr and "blob.bin is not an image, a PDF or a text file" in result.stderr
    assert "missing.txt is not a file" in result.stderr
    assert "(attached: report.pdf (application/pdf, 15 bytes); notes.md (text/markdown" in result.stderr
    first, second = (r.messages[-1] for r in scripted.requests)
    assert isinstance(first, UserMessage) and first.text == "summarise these"
    files = [b for b in first.content if isinstance(b, FileContent)]
    assert [(f.name, f.mime_type) for f in files] == [("report.pdf", "application/pdf"), ("notes.md", "text/markdown")]
    assert not any(isinstance(b, FileContent | ImageContent) for b in second.content)  # sent once


def test_one_bad_line_is_refused_and_the_chat_goes_on(tmp_path: Path, ws: Path) -> None:
    """An attachment under an unknown user's home, or a line of bytes that are not UTF-8, ended
    the chat and lost the lines after it."""
    scripted = model("badlines", ["first", "second"])
    stdin = b"/attach ~nosuchuser-agentloop/x.png\ncaf\xe9\nsecond message\n"
    result = runner.invoke(app, ["chat", "-m", "badlines:x", "-w", str(ws), "--data", str(tmp_path / "d")], input=stdin)
    assert result.exit_code == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "cannot attach" in result.stderr
    assert result.stdout == "first\nsecond\n"
    assert [r.messages[-1].text for r in scripted.requests] == ["caf\ufffd", "second message"]


def test_a_question_shows_every_argument_it_would_approve_in_full() -> None:
    """The headline shortens the main argument; what "y" approves is shown below it in full:
    the end of a long command, the other arguments (a file's content), and control characters
    as escapes rather than as instructions to the terminal."""
    from agentloop.cli.approvals import Question, question_lines

    def shown(question: Question) -> str:
        return "\n".join(line.plain for line in question_lines(question))

    command = "echo " + "x" * 150 + " && rm -rf ~/.ssh"
    text = shown(Question("Shell", {"command": command}, ("destructive",), "shell command"))
    assert "rm -rf ~/.ssh" in text and text.count("rm -rf ~/.ssh") == 1
    text = shown(Question("Write", {"path": "/home/u/.bashrc", "content": "alias ls='rm -rf ~'\nexport X=1"}, (), ""))
    assert "  content: alias ls='rm -rf ~'\n" in text and "           export X=1" in text
    text = shown(Question("Shell", {"command": "ls \x1b[2K\x1b[1Arm -rf /\u202e"}, (), ""))
    assert "\x1b" not in text and "\u202e" not in text and "\\u001b[2K" in text
    assert shown(Question("Shell", {"command": "rm -rf build"}, ("destructive",), "")).count("rm -rf build") == 1
    big = shown(Question("Write", {"path": "a", "content": "y" * 5000}, (), ""))
    assert "… and 1000 more characters" in big


async def test_a_policy_named_on_the_command_line_beats_the_local_accounts_policy_file(tmp_path: Path) -> None:
    """``chat --approval deny`` (or a policy file) is what the local user asked for: it wins over
    their account's approval.json, as ``--approval auto`` does. Without the flag the file refines
    the default policy."""
    from agentloop import Reply, ScriptedModel, ToolResultMessage, call
    from agentloop.cli.approvals import parse_approval
    from tests.process_support import kernel

    (tmp_path / "home" / "me").mkdir(parents=True)
    (tmp_path / "home" / "me" / "approval.json").write_text('{"default": "auto", "rules": []}')
    model = ScriptedModel(
        lambda r: "ok" if isinstance(r.messages[-1], ToolResultMessage) else Reply(tool_calls=[call("echo", text="x")])
    )
    outcomes = {}
    for spec in ("deny", "ask"):
        async with kernel(tmp_path / spec, model, data_dir=tmp_path, **parse_approval(spec).kernel_options("me")) as k:
            proc = await k.spawn(owner="me")
            await proc.send("go")
            await proc.wait_idle()
            [result] = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)]
            outcomes[spec] = result.is_error
    assert outcomes == {"deny": True, "ask": False}


def test_sigterm_ends_the_chat_and_the_turn_goes_on_at_the_next_start(tmp_path: Path, ws: Path) -> None:
    """kill / timeout / a supervisor: the chat ends (143) instead of aborting the turn and reading
    on; the turn in flight is kept, as after a crash, and the next start finishes it."""
    data = str(tmp_path / "data")
    slow = script(tmp_path / "slow.json", ["late answer", "second", "third"], latency=2)
    proc = cli_process(tmp_path, ["chat", "-m", slow, "-w", str(ws), "--data", data])
    try:
        assert proc.stdin is not None and proc.stderr is not None
        proc.stdin.write("one\ntwo\nthree\n")
        proc.stdin.flush()
        while "new conversation" not in proc.stderr.readline():
            assert proc.poll() is None
        time.sleep(0.5)  # the first turn's model call is under way
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143 and out == "" and "(aborted)" not in err and "Traceback" not in err, err
    fast = script(tmp_path / "fast.json", ["resumed"])
    later = cli(tmp_path, ["chat", "-m", fast, "-w", str(ws), "--data", data], "")
    assert later.returncode == 0, later.stderr
    history = cli(tmp_path, ["chat", "-m", fast, "-w", str(ws), "--data", data], "")
    assert "(2 messages)" in history.stderr  # "one" and the answer the resumed turn gave


def test_typed_prompts_are_kept_privately_in_the_data_directory_and_not_at_all_in_memory_chats(
    tmp_path: Path,
) -> None:
    """What was typed repeats the conversations: it lives in the chat's data directory (--data), a
    file only its owner can read; a --memory chat keeps nothing (its history stays in memory)."""
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    from agentloop.cli.chat import TerminalReader, history_file

    data = tmp_path / "data"
    path = history_file(data)
    assert path == data / "chat_history"
    assert path.stat().st_mode & 0o777 == 0o600 and data.stat().st_mode & 0o777 == 0o700
    path.chmod(0o644)  # made by an older agentloop
    assert history_file(data) == path and path.stat().st_mode & 0o777 == 0o600
    assert isinstance(TerminalReader(path).session.history, FileHistory)
    assert isinstance(TerminalReader(None).session.history, InMemoryHistory)
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert history_file(blocked) is None  # not a directory: the history stays in memory


@pytest.mark.parametrize("where", ["durable", "memory"])
def test_a_piped_chat_whose_turn_failed_exits_1(tmp_path: Path, ws: Path, where: str) -> None:
    """A script piping lines in learns that the (last) turn failed, as from ``agentloop run``."""
    failing = script(tmp_path / "err.json", [{"error": "upstream exploded", "kind": "bad_request"}])
    extra = ["--memory"] if where == "memory" else ["--data", str(tmp_path / "data")]
    result = runner.invoke(app, ["chat", "-m", failing, "-w", str(ws), *extra], input="hi\n")
    assert result.exit_code == 1 and "upstream exploded" in result.stderr
    fine = script(tmp_path / "ok.json", ["hello"])
    extra = ["--memory"] if where == "memory" else ["--data", str(tmp_path / "data2")]
    assert runner.invoke(app, ["chat", "-m", fine, "-w", str(ws), *extra], input="hi\n").exit_code == 0


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path, ws: Path) -> None:
    """``agentloop run ... | head -c 3``: the answer's reader is gone; the command stops with the
    shell's usual 141 and no error line or asyncio noise."""
    answer = script(tmp_path / "long.json", ["x" * 200_000])
    done = cli_unread(tmp_path, ["run", "-m", answer, "-w", str(ws), "hi"])
    assert done.returncode == 141 and done.stderr == "", done.stderr


def test_a_chat_cut_short_leaves_a_waiting_subagent_to_finish(tmp_path: Path) -> None:
    """A turn whose Task waits on a subagent when the chat ends (SIGTERM): the subagent is left to
    finish, as after a crash, and the resumed call gets its answer (a review: cancelling the turn
    read as an abort, and the child was aborted)."""
    from contextlib import AsyncExitStack

    from agentloop.cli.main import _cancel_pending
    from agentloop.kernel import Kernel

    def brain(request: Any) -> Any:
        task = next(m.text for m in request.messages if isinstance(m, UserMessage))
        last = request.messages[-1]
        if task.startswith("delegate") and isinstance(last, UserMessage):
            return Reply(tool_calls=[call("Task", prompt="job count", wait=True)])
        if task.startswith("job "):
            return "done: counted"
        return "parent got: " + last.text

    url = f"sqlite:///{tmp_path}/agentloop.db"
    ev = asyncio.new_event_loop()
    stack = AsyncExitStack()
    model = ScriptedModel(brain, latency=1.0)
    kernel = ev.run_until_complete(
        stack.enter_async_context(Kernel.open(url, model=model, workspace=tmp_path, subagents=True))
    )
    parent = ev.run_until_complete(kernel.spawn(owner="me", pid="parent"))
    ev.run_until_complete(parent.send("delegate"))
    ev.run_until_complete(asyncio.sleep(1.5))  # the Task waits on the child's slow model call
    _cancel_pending(ev, kernel)
    ev.run_until_complete(stack.aclose())
    ev.close()

    async def resumed() -> list[str]:
        async with Kernel.open(url, model=ScriptedModel(brain), workspace=tmp_path, subagents=True) as again:
            proc = await again.process("parent")
            await asyncio.wait_for(proc.wait_idle(), 20)
            return [m.text for m in await proc.messages() if isinstance(m, ToolResultMessage)]

    assert asyncio.run(resumed()) == ["done: counted"]


def test_a_piped_chat_whose_reader_went_away_runs_no_more_turns(tmp_path: Path, ws: Path) -> None:
    """``... | agentloop chat | head -c 3``: once nobody reads the answers, the lines still to come
    are not sent to the model (and the command ends with 141)."""
    answer = script(tmp_path / "long.json", ["x" * 200_000, "second", "third"])
    data = tmp_path / "data"
    done = cli_unread(tmp_path, ["chat", "-m", answer, "-w", str(ws), "--data", str(data)], "one\ntwo\nthree\n")
    assert done.returncode == 141, done.stderr
    later = cli(tmp_path, ["chat", "-m", script(tmp_path / "s.json", ["x"]), "-w", str(ws), "--data", str(data)], "")
    assert "(2 messages)" in later.stderr  # "one" and its answer; "two" and "three" were never sent
