"""Run limits (guards), fallback models and the compaction threshold from the config file and
flags of ``run``, ``chat`` and ``serve``: each one set there changes what a run does, and a bad
value is exit 2 with one line naming the key or flag, before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from agentloop.cli.config import kernel_options, load_settings
from agentloop.cli.main import app
from agentloop.loop.guards import Guards
from agentloop.models.base import ModelInfo, ModelRequest
from agentloop.models.registry import register_provider
from agentloop.models.scripted import Reply, ScriptedModel, call
from agentloop.process.compaction import SUMMARY_SYSTEM_PROMPT, context_tokens

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
    (workspace / "a.txt").write_text("hello from a\n")
    return workspace


def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(path))
    return path


def script(path: Path, replies: list[Any]) -> str:
    path.write_text(json.dumps({"replies": replies}))
    return f"scripted:{path}"


READ = {"tool_calls": [{"name": "Read", "arguments": {"path": "a.txt"}}]}
READ_REPLY = Reply(tool_calls=[call("Read", path="a.txt")])
DOWN = {"error": "primary is down", "kind": "bad_request"}  # not retryable: straight to the fallback


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


# ---------------------------------------------------------------------------------- settings


def test_file_keys_become_guards_fallbacks_and_threshold_and_flags_win(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        "max_rounds = 4\nmax_tool_calls = 9\nmax_wall_clock = 30\nmax_tokens = 5000\nmax_cost = 0.5\n"
        'fallbacks = ["openai:gpt-4o-mini", "scripted:/x.json"]\ncompaction_threshold = 0.6\n'
    )
    s = load_settings(env={"AGENTLOOP_CONFIG": str(cfg)})
    assert s.errors == [] and s.warnings == []
    assert s.guards == Guards(max_rounds=4, max_tool_calls=9, max_wall_clock=30.0, max_tokens=5000, max_cost=0.5)
    assert s.fallbacks == ("openai:gpt-4o-mini", "scripted:/x.json")
    assert s.compaction_threshold == 0.6
    options = kernel_options(load_settings(env={"AGENTLOOP_CONFIG": str(tmp_path / "none.toml")}))
    assert options["guards"] == Guards() and options["fallbacks"] == [] and "compaction_threshold" not in options
    assert "approval_timeout" not in options
    cfg.write_text("approval_timeout = 600\n")
    assert kernel_options(load_settings(env={"AGENTLOOP_CONFIG": str(cfg)}))["approval_timeout"] == 600.0
    assert "outage_retries" not in options
    cfg.write_text("outage_retries = [30, 120.5]\n")
    assert kernel_options(load_settings(env={"AGENTLOOP_CONFIG": str(cfg)}))["outage_retries"] == (30.0, 120.5)


def test_a_flag_replaces_a_bad_key(tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config(tmp_path, monkeypatch, 'max_tool_calls = "two"\n')
    model = script(tmp_path / "s.json", [READ, READ, "done"])
    result = runner.invoke(app, ["run", "-m", model, "-w", str(ws), "--max-tool-calls", "1", "go"])
    assert result.exit_code == 0, result.stderr
    assert "(stopped: max_tool_calls)" in result.stderr and result.stderr.count("▸ Read") == 1


# ---------------------------------------------------------------------------------- guards


def test_a_guard_from_the_config_ends_a_run(tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config(tmp_path, monkeypatch, "max_tool_calls = 1\n")
    model = script(tmp_path / "s.json", [READ, {"text": "What I have so far.", **READ}])
    result = runner.invoke(app, ["run", "-m", model, "-w", str(ws), "go"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "What I have so far.\n"
    assert "(stopped: max_tool_calls)" in result.stderr
    assert result.stderr.count("▸ Read") == 1  # the last round had no tools


def test_a_guard_from_the_config_ends_a_durable_chat_turn(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config(tmp_path, monkeypatch, "max_tokens = 10\n")  # every scripted call uses 15 tokens
    model = script(tmp_path / "s.json", [READ, {"text": "Out of tokens.", **READ}])
    result = runner.invoke(app, ["chat", "-m", model, "-w", str(ws), "--data", str(tmp_path / "data")], input="go\n")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "Out of tokens.\n"
    assert "(stopped: max_tokens)" in result.stderr


def test_max_cost_from_a_flag_ends_a_run(tmp_path: Path, ws: Path) -> None:
    priced = ScriptedModel(
        [READ_REPLY, READ_REPLY, "Stopped for money."],
        info=ModelInfo(provider="priced", id="x", input_cost=1_000.0, output_cost=1_000.0),  # $0.015 a call
    )
    register_provider("priced", lambda _id: priced)
    result = runner.invoke(app, ["run", "-m", "priced:x", "-w", str(ws), "--max-cost", "0.02", "go"])
    assert result.exit_code == 0, result.stderr
    assert "(stopped: max_cost)" in result.stderr and priced.calls == 3
    assert not priced.requests[-1].tools  # the last call could only answer


# ---------------------------------------------------------------------------------- fallbacks


def test_a_configured_fallback_answers_when_the_model_fails(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fallback = script(tmp_path / "fallback.json", ["from the fallback", "again from the fallback"])
    config(tmp_path, monkeypatch, f'fallbacks = ["{fallback}"]\n')
    primary = script(tmp_path / "primary.json", [DOWN])
    ran = runner.invoke(app, ["run", "-m", primary, "-w", str(ws), "go"])
    assert ran.exit_code == 0, ran.stderr
    assert ran.stdout == "from the fallback\n"
    assert "primary is down" in ran.stderr  # the switch is shown
    assert "switching to" in ran.stderr and "retry 0" not in ran.stderr
    chatted = runner.invoke(
        app, ["chat", "-m", primary, "-w", str(ws), "--data", str(tmp_path / "data")], input="hello\n"
    )
    assert chatted.exit_code == 0, chatted.stderr
    assert chatted.stdout == "from the fallback\n"
    assert "switching to" in chatted.stderr and "retry 0" not in chatted.stderr  # from the durable log too


def test_without_a_fallback_the_failure_is_the_answer(tmp_path: Path, ws: Path) -> None:
    primary = script(tmp_path / "primary.json", [DOWN])
    result = runner.invoke(app, ["run", "-m", primary, "-w", str(ws), "go"])
    assert result.exit_code == 1 and "primary is down" in one_error_line(result.stderr)


def test_fallback_flags_are_tried_in_order(tmp_path: Path, ws: Path) -> None:
    primary = script(tmp_path / "primary.json", [DOWN])
    second = script(tmp_path / "second.json", [{"error": "second is down too", "kind": "bad_request"}])
    third = script(tmp_path / "third.json", ["third time lucky"])
    args = ["run", "-m", primary, "-w", str(ws), "--fallback", second, "--fallback", third, "go"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "third time lucky\n"


def test_a_fallback_that_cannot_load_is_named_at_start(tmp_path: Path, ws: Path) -> None:
    primary = script(tmp_path / "primary.json", ["never"])
    args = ["run", "-m", primary, "-w", str(ws), "--fallback", f"scripted:{tmp_path}/missing.json", "go"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert "fallback model scripted:" in one_error_line(result.stderr)


# ---------------------------------------------------------------------------------- compaction


def _small_window_model(name: str) -> list[ModelRequest]:
    """A model with a 12k window that answers briefly and summarises when asked; its requests.
    It reports the input tokens a provider would (the pressure is measured from them)."""
    requests: list[ModelRequest] = []

    def reply(request: ModelRequest) -> Reply:
        requests.append(request)
        text = "the summary" if request.system_prompt == SUMMARY_SYSTEM_PROMPT else "ok"
        return Reply(text=text, input_tokens=context_tokens(request.system_prompt, request.tools, request.messages))

    info = ModelInfo(provider=name, id="x", context_window=12_000, max_output=1_000)
    register_provider(name, lambda _id: ScriptedModel(reply, info=info))
    return requests


@pytest.mark.parametrize("source", ["default", "flag", "config"])
def test_the_compaction_threshold_reaches_the_durable_chat(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """About 4,200 tokens of history in a 11,000-token window: the default threshold (0.9) leaves
    it alone, 0.3 from a flag or the config file compacts it (a summary call, an archive)."""
    requests = _small_window_model(f"window-{source}")
    lines = "".join(f"{n} " + "words " * 700 + "\n" for n in range(4))  # about 1,050 tokens each
    args = ["chat", "-m", f"window-{source}:x", "-w", str(ws), "--data", str(tmp_path / "data")]
    if source == "flag":
        args += ["--compaction-threshold", "0.3"]
    elif source == "config":
        config(tmp_path, monkeypatch, "compaction_threshold = 0.3\n")
    result = runner.invoke(app, args, input=lines)
    assert result.exit_code == 0, result.stderr
    compacts = source != "default"
    summaries = [r for r in requests if r.system_prompt == SUMMARY_SYSTEM_PROMPT]
    assert bool(summaries) == compacts
    archived = list((tmp_path / "data").glob("var/sessions/*/*/compaction-*"))
    assert bool(archived) == compacts


# ---------------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("max_rounds = 0\n", "max_rounds must be a positive integer"),
        ('max_tool_calls = "3"\n', "max_tool_calls must be a positive integer"),
        ("max_wall_clock = -1\n", "max_wall_clock must be a positive number of seconds"),
        ("max_tokens = 1.5\n", "max_tokens must be a positive integer"),
        ("max_cost = true\n", "max_cost must be a positive number of dollars"),
        ("compaction_threshold = 1.5\n", "compaction_threshold must be a number above 0 and at most 1"),
        ('fallbacks = "openai:gpt-4o"\n', "fallbacks must be a non-empty list"),
        ('fallbacks = ["gpt-4o"]\n', "fallbacks has a bad model: model must look like 'provider:model'"),
        ('fallbacks = ["nope:x"]\n', "fallbacks has a bad model: unknown provider 'nope'"),
        ("approval_timeout = 0\n", "approval_timeout must be a positive number of seconds"),
        ("approval_timeout = inf\n", "approval_timeout must be a positive number of seconds"),
        ("outage_retries = 30\n", "outage_retries must be a list of at most 20 waits in seconds"),
        ("outage_retries = [30, -1]\n", "outage_retries must be a list of at most 20 waits in seconds"),
        ("outage_retries = [1e9]\n", "outage_retries must be a list of at most 20 waits in seconds"),
    ],
)
@pytest.mark.parametrize("command", ["run", "chat", "serve"])
def test_a_bad_config_value_is_exit_2_naming_the_key(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch, text: str, fragment: str, command: str
) -> None:
    path = config(tmp_path, monkeypatch, text)
    model = script(tmp_path / "s.json", ["never"])
    data = tmp_path / "data"
    args = {
        "run": ["run", "-m", model, "-w", str(ws), "go"],
        "chat": ["chat", "-m", model, "-w", str(ws), "--data", str(data)],
        "serve": ["serve", "-m", model, "-w", str(ws), "--data", str(data), "--port", "0"],
    }[command]
    result = runner.invoke(app, args, input="hello\n")
    assert result.exit_code == 2
    line = one_error_line(result.stderr)
    assert f"config file {path}: {fragment}" in line
    assert not data.exists()  # refused before anything was created or started
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("flag", "value", "fragment"),
    [
        ("--max-rounds", "0", "--max-rounds must be a positive integer"),
        ("--max-tool-calls", "-2", "--max-tool-calls must be a positive integer"),
        ("--max-wall-clock", "0", "--max-wall-clock must be a positive number of seconds"),
        ("--max-tokens", "0", "--max-tokens must be a positive integer"),
        ("--max-cost", "-0.5", "--max-cost must be a positive number of dollars"),
        ("--compaction-threshold", "0", "--compaction-threshold must be a number above 0 and at most 1"),
        ("--fallback", "no-colon", "--fallback has a bad model: model must look like 'provider:model'"),
    ],
)
def test_a_bad_flag_is_exit_2_naming_the_flag(tmp_path: Path, ws: Path, flag: str, value: str, fragment: str) -> None:
    model = script(tmp_path / "s.json", ["never"])
    data = tmp_path / "data"
    for args in (
        ["chat", "-m", model, "-w", str(ws), "--data", str(data)],
        ["serve", "-m", model, "-w", str(ws), "--data", str(data), "--port", "0"],
    ):
        result = runner.invoke(app, [*args, flag, value], input="hello\n")
        assert result.exit_code == 2, result.stderr
        assert fragment in one_error_line(result.stderr)
        assert not data.exists()


def test_a_flag_of_the_wrong_type_is_a_usage_error(tmp_path: Path, ws: Path) -> None:
    result = runner.invoke(app, ["run", "-w", str(ws), "--max-tool-calls", "many", "go"])
    assert result.exit_code == 2 and "--max-tool-calls" in result.stderr and "Traceback" not in result.stderr


def test_limits_that_cannot_apply_are_refused_not_ignored(tmp_path: Path, ws: Path) -> None:
    remote = runner.invoke(app, ["chat", "--server", "http://127.0.0.1:9", "--max-cost", "1"])
    assert remote.exit_code == 2
    assert "--max-cost: set run limits where the server runs" in one_error_line(remote.stderr)
    model = script(tmp_path / "s.json", ["never"])
    memory = runner.invoke(app, ["chat", "--memory", "-m", model, "-w", str(ws), "--compaction-threshold", "0.5"])
    assert memory.exit_code == 2 and "never compacted" in one_error_line(memory.stderr)


def test_models_lists_despite_a_bad_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config(tmp_path, monkeypatch, "max_cost = 0\n")
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0
    assert "warning:" in result.stderr and "max_cost" in result.stderr


# ---------------------------------------------------------------------------------- serve


def test_serve_applies_the_configured_guard_and_fallback(tmp_path: Path, ws: Path) -> None:
    """``serve --chat`` as a subprocess: the primary model fails, the configured fallback answers,
    and the configured tool-call limit ends the turn."""
    fallback = script(tmp_path / "fallback.json", [READ, {"text": "Answer from the fallback.", **READ}])
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'max_tool_calls = 1\nfallbacks = ["{fallback}"]\n')
    primary = script(tmp_path / "primary.json", [DOWN])
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTLOOP_MODEL", "AGENTLOOP_DATA", "AGENTLOOP_TOKEN")}
    env["AGENTLOOP_CONFIG"] = str(cfg)
    args = [sys.executable, "-m", "agentloop.cli.main", "serve", "--chat", "--port", "0"]
    args += ["--data", str(tmp_path / "data"), "-m", primary, "-w", str(ws), "--approval", "auto"]
    done = subprocess.run(args, input="go\n", capture_output=True, text=True, env=env, timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Answer from the fallback.\n"
    assert "(stopped: max_tool_calls)" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["chat", "--server", "http://127.0.0.1:9", "--approval", "auto"], "--approval: a chat with a server"),
        (["chat", "--server", "http://127.0.0.1:9", "-m", "openai:gpt-4o", "--memory"], "--model, --memory: a chat"),
        (["chat", "--server", "http://127.0.0.1:9", "-w", "/nonexistent", "--data", "/x"], "--workspace, --data"),
        (["chat", "--server", "http://127.0.0.1:9", "--new", "--pid", "p1"], "give one of them"),
        (["chat", "--token", "sekrit"], "--token goes with --server"),
        (["serve", "--new"], "give --chat too"),
        (["serve", "--pid", "p1", "--port", "0"], "give --chat too"),
    ],
)
def test_options_that_would_be_ignored_are_refused(tmp_path: Path, args: list[str], fragment: str) -> None:
    """A review found each of these silently doing nothing (--approval auto then asked anyway)."""
    result = runner.invoke(app, args, input="")
    assert result.exit_code == 2 and fragment in one_error_line(result.stderr), result.stderr
    assert "sekrit" not in result.stderr
