"""How a turn's tool calls run (``max_concurrency``, ``tool_execution``) as ``run``, ``chat`` and
``serve`` take it from the config file and their flags, and the run variables of the prompt's
templating (``{{time}}``, ``{{timezone}}``, ``{{model}}``, ``{{pid}}``, ``{{home}}``) as a real
run's system prompt shows them."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import time
import zoneinfo
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from agentloop import ScriptedModel
from agentloop.cli.config import kernel_options, load_settings
from agentloop.cli.main import app
from agentloop.kernel import Kernel
from agentloop.kernel.runs import local_zone
from agentloop.models.base import ModelInfo
from agentloop.models.registry import register_provider
from agentloop.process import signals as sig

runner = CliRunner()


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No user config, no model or data directory from the environment."""
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG", "AGENTLOOP_DATA", "AGENTLOOP_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    return workspace


def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(path))
    return path


def slow(name: str) -> dict[str, Any]:
    """A Shell call that notes its start and its end in ``log.txt``, 0.4 s apart."""
    command = f"echo {name}-start >> log.txt; sleep 0.4; echo {name}-end >> log.txt"
    return {"name": "Shell", "arguments": {"command": command}}


def two_slow_calls(tmp_path: Path) -> str:
    """A scripted model whose first answer calls two slow commands at once."""
    path = tmp_path / "two.json"
    path.write_text(json.dumps({"replies": [{"tool_calls": [slow("a"), slow("b")]}, "both done"]}))
    return f"scripted:{path}"


def one_after_the_other(ws: Path) -> bool:
    """Whether the two commands ran one after the other (else they overlapped)."""
    lines = (ws / "log.txt").read_text().split()
    assert sorted(lines) == ["a-end", "a-start", "b-end", "b-start"], lines
    return lines in (["a-start", "a-end", "b-start", "b-end"], ["b-start", "b-end", "a-start", "a-end"])


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


# ------------------------------------------------------------------------------- settings


def test_the_keys_become_loop_options_and_flags_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = config(tmp_path, monkeypatch, 'max_concurrency = 3\ntool_execution = "sequential"\n')
    settings = load_settings()
    assert settings.errors == [] and settings.warnings == [], (settings.errors, settings.warnings)
    options = kernel_options(settings)
    assert options["max_concurrency"] == 3 and options["tool_execution"] == "sequential"
    path.write_text("")
    options = kernel_options(load_settings())  # not set: the loop's own defaults stay its own
    assert "max_concurrency" not in options and "tool_execution" not in options


# ------------------------------------------------------------------------------- the runs


def test_run_overlaps_two_slow_calls_by_default(tmp_path: Path, ws: Path) -> None:
    """The baseline the other tests are told apart from: without a setting the calls overlap."""
    result = runner.invoke(app, ["run", "-m", two_slow_calls(tmp_path), "-w", str(ws), "--approval", "auto", "go"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "both done\n"
    assert not one_after_the_other(ws)


def test_run_takes_sequential_tool_execution_from_the_config(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config(tmp_path, monkeypatch, 'tool_execution = "sequential"\n')
    result = runner.invoke(app, ["run", "-m", two_slow_calls(tmp_path), "-w", str(ws), "--approval", "auto", "go"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "both done\n"
    assert one_after_the_other(ws)


def test_a_flag_wins_over_the_key_in_run(tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config(tmp_path, monkeypatch, "max_concurrency = 0\n")  # bad, but replaced by the flag
    args = ["run", "-m", two_slow_calls(tmp_path), "-w", str(ws), "--approval", "auto", "--max-concurrency", "1"]
    result = runner.invoke(app, [*args, "go"])
    assert result.exit_code == 0, result.stderr
    assert one_after_the_other(ws)


def test_the_durable_chat_takes_the_concurrency_cap_from_the_config(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config(tmp_path, monkeypatch, "max_concurrency = 1\n")
    args = ["chat", "-m", two_slow_calls(tmp_path), "-w", str(ws), "--data", str(tmp_path / "data")]
    result = runner.invoke(app, [*args, "--approval", "auto"], input="go\n")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "both done\n"
    assert one_after_the_other(ws)


def test_the_memory_chat_takes_the_tool_execution_flag(tmp_path: Path, ws: Path) -> None:
    args = ["chat", "--memory", "-m", two_slow_calls(tmp_path), "-w", str(ws), "--approval", "auto"]
    result = runner.invoke(app, [*args, "--tool-execution", "sequential"], input="go\n")
    assert result.exit_code == 0, result.stderr
    assert one_after_the_other(ws)


def test_serve_takes_sequential_tool_execution_from_the_config(tmp_path: Path, ws: Path) -> None:
    """``serve --chat`` as a subprocess: every process the server runs keeps to the key."""
    cfg = tmp_path / "config.toml"
    cfg.write_text('tool_execution = "sequential"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTLOOP_MODEL", "AGENTLOOP_DATA", "AGENTLOOP_TOKEN")}
    env["AGENTLOOP_CONFIG"] = str(cfg)
    args = [sys.executable, "-m", "agentloop.cli.main", "serve", "--chat", "--port", "0"]
    args += ["--data", str(tmp_path / "data"), "-m", two_slow_calls(tmp_path), "-w", str(ws), "--approval", "auto"]
    done = subprocess.run(args, input="go\n", capture_output=True, text=True, env=env, timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "both done\n"
    assert one_after_the_other(ws)


# ------------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("max_concurrency = 0\n", "max_concurrency must be a positive integer"),
        ("max_concurrency = 2.5\n", "max_concurrency must be a positive integer"),
        ('tool_execution = "serial"\n', "tool_execution must be one of parallel, sequential, got 'serial'"),
    ],
)
@pytest.mark.parametrize("command", ["run", "chat", "serve"])
def test_a_bad_key_is_exit_2_naming_it(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch, text: str, fragment: str, command: str
) -> None:
    path = config(tmp_path, monkeypatch, text)
    model = two_slow_calls(tmp_path)
    data = tmp_path / "data"
    args = {
        "run": ["run", "-m", model, "-w", str(ws), "go"],
        "chat": ["chat", "-m", model, "-w", str(ws), "--data", str(data)],
        "serve": ["serve", "-m", model, "-w", str(ws), "--data", str(data), "--port", "0"],
    }[command]
    result = runner.invoke(app, args, input="hello\n")
    assert result.exit_code == 2, result.stderr
    assert f"config file {path}: {fragment}" in one_error_line(result.stderr)
    assert not data.exists() and not (ws / "log.txt").exists()  # refused before anything started
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("flag", "value", "fragment"),
    [
        ("--max-concurrency", "0", "--max-concurrency must be a positive integer"),
        ("--tool-execution", "serial", "--tool-execution must be one of parallel, sequential"),
    ],
)
def test_a_bad_flag_is_exit_2_naming_it(tmp_path: Path, ws: Path, flag: str, value: str, fragment: str) -> None:
    model = two_slow_calls(tmp_path)
    data = tmp_path / "data"
    for args in (
        ["run", "-m", model, "-w", str(ws), flag, value, "go"],
        ["chat", "-m", model, "-w", str(ws), "--data", str(data), flag, value],
        ["serve", "-m", model, "-w", str(ws), "--data", str(data), "--port", "0", flag, value],
    ):
        result = runner.invoke(app, args, input="hello\n")
        assert result.exit_code == 2, result.stderr
        assert fragment in one_error_line(result.stderr)
        assert not data.exists() and not (ws / "log.txt").exists()


def test_a_remote_chat_refuses_the_flags(tmp_path: Path) -> None:
    """The server's own settings decide: a flag silently ignored would mislead."""
    result = runner.invoke(app, ["chat", "--server", "http://127.0.0.1:9", "--tool-execution", "sequential"])
    assert result.exit_code == 2
    assert "--tool-execution: set run limits where the server runs" in one_error_line(result.stderr)


# ------------------------------------------------------------------------------- prompt variables


@pytest.fixture
def kolkata() -> Iterator[str]:
    """This process in a zone of its own (+05:30, no summer time), so the zone a prompt names is
    known; the zone it had is restored after."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Kolkata"
    time.tzset()
    try:
        yield "Asia/Kolkata"
    finally:
        if before is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = before
        time.tzset()


VARS = (
    "tz=[{{timezone}}] time=[{{time}}] model=[{{model}}] pid=[{{pid}}] home=[{{home}}]\n"
    "date=[{{date}}] me=[{{identity}}]"
)


def field(prompt: str, name: str) -> str:
    match = re.search(rf"(?<!\w){name}=\[([^\]]*)\]", prompt)
    assert match is not None, prompt
    return match.group(1)


async def test_the_run_variables_in_a_real_run_prompt(tmp_path: Path, kolkata: str) -> None:
    data = tmp_path / "data"
    (data / "config" / "ai" / "context.d").mkdir(parents=True)
    (data / "config" / "ai" / "context.d" / "10-vars.md").write_text(VARS)
    (tmp_path / "ws").mkdir()
    model = ScriptedModel(["one", "two", "three"], info=ModelInfo(provider="scripted", id="vars-main"))
    other = ScriptedModel(["from the other"], info=ModelInfo(provider="varsnine", id="other"))
    register_provider("varsnine", lambda _id: other)
    zone = zoneinfo.ZoneInfo(kolkata)
    url = f"sqlite:///{data}/a.db"
    async with Kernel.open(url, model=model, workspace=tmp_path / "ws", tools=[], data_dir=data) as k:
        first = await k.spawn(owner="alice")
        second = await k.spawn(owner="bob")
        before = datetime.datetime.now(zone).strftime("%H:%M")
        for proc in (first, second):
            await proc.send("hi")
            await proc.wait_idle()
        after = datetime.datetime.now(zone).strftime("%H:%M")
        await first.set_model("varsnine:other")  # the process's own model, from its next run on
        await first.send("again")
        await first.wait_idle()
        manifests = [
            s.payload for s in [s async for s in first.signals(follow=False)] if s.signal == sig.PROMPT_COMPILED
        ]
    alice, bob = (r.system_prompt for r in model.requests)
    assert field(alice, "tz") == "Asia/Kolkata (UTC+05:30)"
    assert field(alice, "time") in {before, after}
    assert field(alice, "model") == "scripted:vars-main"
    assert field(alice, "pid") == first.pid and field(bob, "pid") == second.pid  # each its own, one assembly
    assert field(alice, "home") == str(data / "home" / "alice") and field(bob, "home") == str(data / "home" / "bob")
    assert field(alice, "date") == datetime.datetime.now(zone).date().isoformat() or after == "00:00"
    assert field(alice, "me") == "alice"
    assert "{{" not in alice and "\ue000" not in alice
    (switched,) = (r.system_prompt for r in other.requests)
    assert field(switched, "model") == "varsnine:other"
    # the manifest's size of the system context is that of the block as the run was given it
    sizes = [next(s["bytes"] for s in m["sections"] if s["name"] == "system context") for m in manifests]
    block = switched[switched.index("[system context]") :].rstrip("\n")
    assert sizes[-1] == len(block.encode("utf-8"))


def test_the_zone_is_named_by_its_offset_when_it_has_no_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``$TZ`` rule rather than a zone's name (``<+0330>-3:30``) is not repeated as if it were one."""
    monkeypatch.setenv("TZ", "<+0330>-3:30")
    now = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.timezone(datetime.timedelta(hours=3, minutes=30)))
    assert local_zone(now) == "UTC+03:30"
    monkeypatch.setenv("TZ", "Europe/Berlin")
    berlin = datetime.datetime(2026, 7, 1, 12, 0, tzinfo=zoneinfo.ZoneInfo("Europe/Berlin"))
    assert local_zone(berlin) == "Europe/Berlin (UTC+02:00)"
