"""The ``agentloop`` command line, driven by scripted models.

In-process tests use typer's ``CliRunner``; where signals, real pipes and child processes
matter, the CLI runs as a subprocess (``python -m agentloop.cli.main``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from agentloop.cli.config import load_settings, read_config_file
from agentloop.cli.main import app
from agentloop.messages import AssistantMessage, ToolResultMessage, UserMessage
from agentloop.models.registry import DEFAULT_MODEL, register_provider
from agentloop.models.scripted import Reply, ScriptedModel, call

runner = CliRunner()


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No user config, no model from the environment, no chat history in the real home."""
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv("AGENTLOOP_MODEL", raising=False)
    monkeypatch.delenv("AGENTLOOP_DEBUG", raising=False)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "a.txt").write_text("hello from a\n")
    return workspace


def script(path: Path, replies: list[Any], **options: Any) -> str:
    path.write_text(json.dumps({"replies": replies, **options}))
    return f"scripted:{path}"


def tool_call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def assert_one_line_error(stderr: str, *fragments: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert "Traceback" not in stderr


# ---------------------------------------------------------------------------------------- run


def test_run_streams_answer_to_stdout_and_tools_to_stderr(tmp_path: Path, ws: Path) -> None:
    model = script(
        tmp_path / "s.json",
        [
            {"text": "Reading.", "tool_calls": [tool_call("Read", path="a.txt")]},
            {"tool_calls": [tool_call("Read", path="missing.txt")]},
            "It says hello.",
        ],
        chunk=4,
    )
    result = runner.invoke(app, ["run", "--model", model, "--workspace", str(ws), "what is in a.txt?"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "Reading.\nIt says hello.\n"
    err = result.stderr.splitlines()
    assert err[:2] == ["▸ Read a.txt", "✓ Read a.txt"]
    assert err[2] == "▸ Read missing.txt"
    assert err[3].startswith("✗ Read missing.txt: ") and "not found" in err[3].lower()
    assert len(err) == 4


def test_run_json_prints_loop_events_in_order(tmp_path: Path, ws: Path) -> None:
    model = script(tmp_path / "s.json", [{"tool_calls": [tool_call("Read", path="a.txt")]}, "done"], chunk=2)
    result = runner.invoke(app, ["run", "--json", "--model", model, "-w", str(ws), "go"])
    assert result.exit_code == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    types = [e["type"] for e in events]
    assert types[0] == "agent_start" and types[-1] == "agent_end"
    expected = ["agent_start", "turn_start", "message_start", "message_end", "message_start", "message_update"]
    expected += ["message_end", "tool_execution_start", "tool_execution_end", "turn_end", "turn_start"]
    expected += ["message_start", "message_update", "message_end", "turn_end", "agent_end"]
    it = iter(types)
    assert all(t in it for t in expected), types  # a subsequence, in loop order
    updates = [e for e in events if e["type"] == "message_update"]
    assert updates and all(set(e) == {"type", "event"} for e in updates)
    deltas = "".join(e["event"]["delta"] for e in updates if e["event"]["type"] == "text_delta")
    assert deltas == "done"
    assert events[-1]["stop_reason"] == "stop"
    streamed_starts = [e for e in events if e["type"] == "message_start" and e["message"]["role"] == "assistant"]
    assert streamed_starts and all(e["message"]["content"] == [] for e in streamed_starts)  # deltas follow
    assert not result.stderr.strip()


def test_max_rounds_ends_with_the_guard_and_still_answers(tmp_path: Path, ws: Path) -> None:
    model = script(
        tmp_path / "s.json",
        [
            {"tool_calls": [tool_call("Read", path="a.txt")]},
            {"text": "Final answer from what I read.", "tool_calls": [tool_call("Read", path="a.txt")]},
        ],
    )
    result = runner.invoke(app, ["run", "--max-rounds", "1", "-m", model, "-w", str(ws), "go"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "Final answer from what I read.\n"
    assert "(stopped: max_rounds)" in result.stderr
    assert result.stderr.count("▸ Read") == 1  # the final round had no tools


def test_provider_error_exits_1_with_one_line(tmp_path: Path, ws: Path) -> None:
    model = script(tmp_path / "s.json", [{"error": "upstream exploded\nwith details", "kind": "bad_request"}])
    result = runner.invoke(app, ["run", "-m", model, "-w", str(ws), "go"])
    assert result.exit_code == 1
    assert_one_line_error(result.stderr, "upstream exploded with details")


def test_model_retries_are_shown(tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import agentloop.models.retry as retry

    monkeypatch.setattr(
        retry.RetryPolicy, "delay", lambda self, attempt, retry_after=None: 0.0 if attempt < 2 else None
    )
    model = script(tmp_path / "s.json", [{"error": "overloaded", "kind": "rate_limit"}, "ok"])
    result = runner.invoke(app, ["run", "-m", model, "-w", str(ws), "go"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "ok\n"
    assert "↻" in result.stderr and "overloaded" in result.stderr and "retry 1" in result.stderr


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["-m", "nope:model"], ["unknown provider 'nope'"]),
        (["-m", "no-colon"], ["provider:model"]),
        (["-m", "scripted:/does/not/exist.json"], ["cannot read scripted model file"]),
        (["-m", "broken:x"], ["optional dependency"]),
    ],
)
def test_model_errors_exit_1(ws: Path, args: list[str], fragments: list[str]) -> None:
    register_provider("broken", "agentloop.no_such_module_for_tests:Model")
    result = runner.invoke(app, ["run", *args, "-w", str(ws), "go"])
    assert result.exit_code == 1
    assert_one_line_error(result.stderr, *fragments)
    assert result.stdout == ""


def test_bad_workspace_and_empty_prompt_exit_1(tmp_path: Path, ws: Path) -> None:
    model = script(tmp_path / "s.json", ["unused"])
    missing = runner.invoke(app, ["run", "-m", model, "-w", str(tmp_path / "nowhere"), "go"])
    assert missing.exit_code == 1
    assert_one_line_error(missing.stderr, "does not exist")
    a_file = runner.invoke(app, ["run", "-m", model, "-w", str(ws / "a.txt"), "go"])
    assert a_file.exit_code == 1
    assert_one_line_error(a_file.stderr, "not a directory")
    empty = runner.invoke(app, ["run", "-m", model, "-w", str(ws), "   "])
    assert empty.exit_code == 1
    assert_one_line_error(empty.stderr, "empty prompt")


def test_prompt_from_stdin(tmp_path: Path, ws: Path) -> None:
    capture = ScriptedModel(["got it"])
    register_provider("capture", lambda _id: capture)
    result = runner.invoke(app, ["run", "-m", "capture:x", "-w", str(ws), "-"], input="from a pipe\n")
    assert result.exit_code == 0, result.stderr
    assert capture.requests[0].messages[-1].text == "from a pipe\n"


# ---------------------------------------------------------------------------------------- config


def test_model_selection_order(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('model = "openai:from-file"\nsystem_prompt = "be brief"\nmax_rounds = 3\n')
    env = {"AGENTLOOP_CONFIG": str(cfg)}
    s = load_settings(env=env)
    assert (s.model, s.system_prompt, s.max_rounds) == ("openai:from-file", "be brief", 3)
    assert "config file" in s.model_source
    env["AGENTLOOP_MODEL"] = "openai:from-env"
    s = load_settings(env=env)
    assert (s.model, s.model_source) == ("openai:from-env", "AGENTLOOP_MODEL")
    s = load_settings(model="openai:from-flag", max_rounds=7, env=env)
    assert (s.model, s.model_source, s.max_rounds) == ("openai:from-flag", "--model", 7)
    s = load_settings(env={"AGENTLOOP_CONFIG": str(tmp_path / "absent.toml")})
    assert (s.model, s.model_source, s.warnings) == (DEFAULT_MODEL, "built-in default", [])


def test_a_malformed_config_file_stops_the_loop_commands_and_bad_keys_only_warn(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("model = [unclosed\n")
    file, warnings = read_config_file(cfg)
    assert file.model is None and warnings == [] and "cannot be read" in file.errors["config"]
    cfg2 = tmp_path / "typed.toml"
    cfg2.write_text('model = 5\ntool_timeout = "soon"\ncolour = "blue"\n')
    file, warnings = read_config_file(cfg2)
    assert file.model is None and file.tool_timeout is None and len(warnings) == 3

    monkeypatch.setenv("AGENTLOOP_CONFIG", str(cfg))
    model = script(tmp_path / "s.json", ["fine"])
    result = runner.invoke(app, ["run", "-m", model, "-w", str(ws), "go"])
    # a file that cannot be read would silently drop its budgets, fallbacks and MCP servers: stop
    assert result.exit_code == 2 and result.stdout == ""
    assert f"error: config file {cfg} cannot be read" in result.stderr and "Traceback" not in result.stderr


def test_config_file_model_is_used(tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = script(tmp_path / "s.json", ["from the config file"])
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'model = "{model}"\nworkspace = "{ws}"\n')
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(cfg))
    result = runner.invoke(app, ["run", "go"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "from the config file\n"
    monkeypatch.setenv("AGENTLOOP_MODEL", "nope:x")  # env beats the file
    assert runner.invoke(app, ["run", "go"]).exit_code == 1


# ---------------------------------------------------------------------------------------- chat


def test_chat_carries_history_across_turns(ws: Path) -> None:
    capture = ScriptedModel(["first answer", "second answer", "fresh answer"])
    register_provider("capture", lambda _id: capture)
    result = runner.invoke(
        app,
        ["chat", "-m", "capture:x", "-w", str(ws)],
        input="first question\n\nsecond question\n/new\nthird question\n/exit\nnever sent\n",
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "first answer\nsecond answer\nfresh answer\n"
    assert capture.calls == 3
    second = capture.requests[1].messages
    assert [type(m) for m in second] == [UserMessage, AssistantMessage, UserMessage]
    assert [m.text for m in second] == ["first question", "first answer", "second question"]
    assert [m.text for m in capture.requests[2].messages] == ["third question"]
    assert "(new conversation)" in result.stderr


def test_chat_survives_a_failed_turn(ws: Path) -> None:
    from agentloop.models.base import ProviderError

    capture = ScriptedModel([ProviderError("bad gateway", kind="bad_request"), "recovered"])
    register_provider("capture", lambda _id: capture)
    result = runner.invoke(app, ["chat", "-m", "capture:x", "-w", str(ws)], input="one\ntwo\n")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "recovered\n"
    assert "error: bad gateway" in result.stderr and "Traceback" not in result.stderr
    assert capture.requests[1].messages[0].text == "one"  # the failed turn's prompt stays in history


def test_progress_lines_are_thinned_off_a_terminal() -> None:
    import io

    from agentloop.cli.render import Progress

    err = io.StringIO()
    progress = Progress(err, min_interval=60)
    for mb in range(0, 1000, 10):
        progress(f"assembling model: {mb}/1000 MB")
    progress("loading model.gguf")
    progress.done()
    assert err.getvalue().splitlines() == ["⋯ assembling model: 0/1000 MB", "⋯ loading model.gguf"]


def test_chat_subprocess_with_piped_stdin(tmp_path: Path, ws: Path) -> None:
    model = script(tmp_path / "s.json", [{"tool_calls": [tool_call("Read", path="a.txt")]}, "one", "two"])
    proc = subprocess.run(
        [sys.executable, "-m", "agentloop.cli.main", "chat", "-m", model, "-w", str(ws)],
        input="hi\nagain\n",
        capture_output=True,
        text=True,
        timeout=30,
        env=_env(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "one\ntwo\n"
    assert "▸ Read a.txt" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------- models


def test_models_lists_providers_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)
    for name in ("GEMINI_API_KEY", "GOOGLE_API_KEY", "GEMINI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    for name in ("openai:gpt-4o-mini", "anthropic:claude-sonnet-4-5", "local:qwen2.5-coder-1.5b", "scripted:"):
        assert name in out
    openai_row = next(line for line in out.splitlines() if "openai:gpt-4o " in line)
    assert "yes" in openai_row and "OPENAI_API_KEY is set" in openai_row
    anthropic_row = next(line for line in out.splitlines() if "claude-sonnet-4-5" in line)
    assert " no " in anthropic_row
    gemini_row = next(line for line in out.splitlines() if "gemini:gemini-2.5-pro " in line)
    assert " no " in gemini_row and "needs GEMINI_API_KEY" in gemini_row
    assert f"default: {DEFAULT_MODEL} (from built-in default)" in out

    monkeypatch.setenv("AGENTLOOP_MODEL", "openai:gpt-4o")
    assert "default: openai:gpt-4o (from AGENTLOOP_MODEL)" in runner.invoke(app, ["models"]).stdout


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.startswith("agentloop ")


# ---------------------------------------------------------------------------------------- signals


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG")}
    env["AGENTLOOP_CONFIG"] = str(tmp_path / "no-config.toml")
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie is dead, only unreaped
    except FileNotFoundError:
        return True


@pytest.fixture
def sleeper_pid(tmp_path: Path) -> Iterator[Path]:
    pid_file = tmp_path / "sleeper.pid"
    yield pid_file
    if pid_file.exists():  # never leave a sleeper behind, even when the test failed
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_sigint_aborts_run_kills_shell_children_and_exits_130(tmp_path: Path, ws: Path, sleeper_pid: Path) -> None:
    command = f"echo $$ > {sleeper_pid}.tmp && mv {sleeper_pid}.tmp {sleeper_pid} && exec sleep 1000"
    model = script(tmp_path / "s.json", [{"tool_calls": [tool_call("Shell", command=command)]}, "unreachable"])
    proc = subprocess.Popen(
        # the pid file lies outside the workspace, which the default policy would ask about
        [
            sys.executable,
            "-m",
            "agentloop.cli.main",
            "run",
            "-m",
            model,
            "-w",
            str(ws),
            "--approval",
            "auto",
            "sleep please",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(tmp_path),
    )
    try:
        deadline = time.monotonic() + 20
        while not sleeper_pid.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the Shell tool never started the sleeper"
            time.sleep(0.05)
        pid = int(sleeper_pid.read_text())
        assert not _gone(pid)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "unreachable" not in out
    deadline = time.monotonic() + 5
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), "the sleeper outlived the aborted run"


# ---------------------------------------------------------------------------------------- approval


@pytest.mark.parametrize(
    ("flag", "runs", "error"),
    [
        ("ask", False, "requires interactive approval, but there is no terminal"),
        ("auto", True, None),
        ("deny", False, "Tool execution denied by the default policy"),
    ],
)
def test_run_approval_without_a_terminal(tmp_path: Path, ws: Path, flag: str, runs: bool, error: str | None) -> None:
    (ws / "build").mkdir()
    capture = ScriptedModel([Reply(tool_calls=[call("Shell", command="rm -rf build")]), "done"])
    register_provider("capture", lambda _id: capture)
    result = runner.invoke(app, ["run", "-m", "capture:x", "-w", str(ws), "--approval", flag, "clean"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "done\n"
    assert (not (ws / "build").exists()) is runs
    [tool_result] = [m for m in capture.requests[1].messages if isinstance(m, ToolResultMessage)]
    assert tool_result.is_error is (error is not None)
    if error is not None:
        assert error in tool_result.text and "rm -rf build" in tool_result.text
        line = next(x for x in result.stderr.splitlines() if x.startswith("✗ Shell rm -rf build: "))
        assert error[:40] in line
    assert ("--approval auto" in result.stderr) is (flag == "ask")  # the way out is named


def test_run_default_policy_lets_harmless_calls_through(tmp_path: Path, ws: Path) -> None:
    model = script(tmp_path / "s.json", [{"tool_calls": [tool_call("Shell", command="cat a.txt")]}, "read it"])
    result = runner.invoke(app, ["run", "-m", model, "-w", str(ws), "show a.txt"])
    assert result.exit_code == 0, result.stderr
    assert "✓ Shell cat a.txt" in result.stderr and "approval" not in result.stderr


def test_run_on_a_terminal_asks(tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import agentloop.cli.main as cli_main

    monkeypatch.setattr(cli_main, "_stdin_is_terminal", lambda: True)
    for name in ("b1", "b2", "b3"):
        (ws / name).mkdir()
    calls = [call("Shell", command=f"rm -rf {n}") for n in ("b1", "b2", "b3")]
    capture = ScriptedModel([Reply(tool_calls=calls[:1]), Reply(tool_calls=calls[1:]), "done"])
    register_provider("capture", lambda _id: capture)
    result = runner.invoke(app, ["run", "-m", "capture:x", "-w", str(ws), "clean"], input="n\na\n")
    assert result.exit_code == 0, result.stderr
    assert (ws / "b1").exists() and not (ws / "b2").exists() and not (ws / "b3").exists()
    assert result.stderr.count("Allow? [y]es / [n]o / [a]lways") == 2  # "a" covered b3
    assert "tags: " in result.stderr and "destructive" in result.stderr
    assert "✗ Shell rm -rf b1: Tool execution denied by user" in result.stderr


def test_run_policy_file_and_a_malformed_one(tmp_path: Path, ws: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"default": "auto", "rules": [{"match": "fs.read", "action": "deny"}]}))
    model = script(tmp_path / "s.json", [{"tool_calls": [tool_call("Read", path="a.txt")]}, "no"])
    result = runner.invoke(app, ["run", "-m", model, "-w", str(ws), "--approval", str(policy), "read"])
    assert result.exit_code == 0, result.stderr
    assert "✗ Read a.txt: Tool execution denied by rules[0] fs.read -> deny" in result.stderr

    policy.write_text('{"default": "sometimes", "rules": [')
    (ws / "build").mkdir()
    model = script(
        tmp_path / "s2.json",
        [{"tool_calls": [tool_call("Read", path="a.txt"), tool_call("Shell", command="rm -rf build")]}, "ok"],
    )
    bad = runner.invoke(app, ["run", "-m", model, "-w", str(ws), "--approval", str(policy), "go"])
    assert bad.exit_code == 0, bad.stderr
    first = bad.stderr.splitlines()[0]
    assert first.startswith("warning: approval policy") and "not valid JSON" in first and "default policy" in first
    assert "✓ Read a.txt" in bad.stderr  # the default policy: reads run,
    assert "requires interactive approval" in bad.stderr and (ws / "build").exists()  # rm -rf asks
    missing = runner.invoke(app, ["run", "-m", model, "-w", str(ws), "--approval", str(tmp_path / "nope.json"), "go"])
    assert missing.exit_code == 2 and missing.stderr.startswith("error: --approval must be ask, auto, deny or")
    typo = runner.invoke(app, ["run", "-m", model, "-w", str(ws), "--approval", "dney", "go"])
    assert typo.exit_code == 2 and "cannot read 'dney'" in typo.stderr and "Traceback" not in typo.stderr


def test_a_home_of_an_unknown_user_is_named_with_its_flag(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``~nosuchuser/x`` made every path flag fail with "RuntimeError: Could not determine home
    directory", naming no flag; in the config file (a key the CLI can do without) it stopped the run."""
    model = script(tmp_path / "s.json", ["fine", "fine"])
    odd = "~nosuchuser-agentloop/x"
    for args, flag in (
        (["run", "-m", model, "-w", odd, "go"], "workspace"),
        (["run", "-m", model, "-w", str(ws), "--approval", odd, "go"], "--approval"),
        (["chat", "-m", model, "-w", str(ws), "--data", odd], "--data"),
    ):
        result = runner.invoke(app, args, input="")
        assert result.exit_code != 0 and "Traceback" not in result.stderr
        assert f"{flag} '{odd}': ~nosuchuser-agentloop names no user on this machine" in result.stderr, result.stderr
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'workspace = "{odd}"\n')
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(cfg))
    monkeypatch.chdir(ws)
    result = runner.invoke(app, ["run", "-m", model, "go"])
    assert result.exit_code == 0 and result.stdout == "fine\n", result.stderr
    assert "names no user on this machine; ignored" in result.stderr


@pytest.mark.parametrize("flag", ["--max-processes", "--max-inputs-per-minute"])
def test_serve_takes_limits_per_account(flag: str) -> None:
    assert flag in runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).stdout
    refused = runner.invoke(app, ["serve", flag, "0"])
    assert refused.exit_code == 2 and "Traceback" not in refused.stderr
