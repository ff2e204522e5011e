"""Review of the per-account configuration and of server start-up: an account's ``model.json`` and
``mcp.json`` that are wrong in type or size fall back with a warning (never a crash, never a silent
surprise), a model file cannot send the server's provider keys anywhere, and ``serve``'s start-up
choices hold."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from agentloop import ScriptedModel
from agentloop.cli.approvals import parse_approval
from agentloop.cli.config import CONFIG_ENV, Settings, load_connection, load_settings
from agentloop.cli.serve import Running, ServeOptions, serve_async
from agentloop.kernel import Kernel
from agentloop.kernel import account_mcp as account_mcp_module
from agentloop.kernel.account_mcp import AccountMCP
from agentloop.process.store import ProcessRecord
from tests.test_account_mcp import FakeServers

MODEL_LOG = "agentloop.kernel.model"


def _choose(tmp_path: Path, account: str, content: str) -> Path:
    home = tmp_path / "home" / account
    home.mkdir(parents=True, exist_ok=True)
    path = home / "model.json"
    path.write_text(content)
    return path


def _script(tmp_path: Path, name: str, replies: list[str]) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(replies))
    return f"scripted:{path}"


async def _answer(kernel: Kernel, owner: str) -> str:
    proc = await kernel.spawn(owner=owner)
    await proc.send("hi")
    await proc.wait_idle()
    return (await proc.messages())[-1].text


def _model_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == MODEL_LOG]


# ------------------------------------------------------------------------------- model.json


@pytest.mark.parametrize(
    ("choice", "why"),
    [
        ({"max_tokens": True}, "max_tokens"),  # was taken as 1: every answer cut after one token
        ({"temperature": True}, "temperature"),  # was taken as 1.0
        ({"max_tokens": "4096"}, "max_tokens"),  # a string where a number belongs
    ],
    ids=["bool-budget", "bool-temperature", "string-budget"],
)
async def test_a_model_file_of_the_wrong_types_is_refused_not_coerced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, choice: dict[str, object], why: str
) -> None:
    _choose(tmp_path, "alice", json.dumps(choice))
    default = ScriptedModel(lambda r: "from the kernel's model")
    with caplog.at_level(logging.WARNING, logger=MODEL_LOG):
        async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=default, workspace=tmp_path, tools=[]) as k:
            assert await _answer(k, "alice") == "from the kernel's model"
    assert default.requests[0].max_tokens != 1 and default.requests[0].temperature != 1.0
    warnings = _model_warnings(caplog)
    assert len(warnings) == 1 and why in warnings[0] and "'alice'" in warnings[0], warnings


async def test_a_huge_model_file_is_refused_without_being_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model file is a few lines; one of many megabytes (a sparse file, a log written to the
    wrong place) would be read whole into the server's memory at every change."""
    spec = _script(tmp_path, "big", ["from the big file"])
    _choose(tmp_path, "alice", json.dumps({"model": spec}) + " " * (1 << 20))
    default = ScriptedModel(lambda r: "from the kernel's model")
    with caplog.at_level(logging.WARNING, logger=MODEL_LOG):
        async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=default, workspace=tmp_path, tools=[]) as k:
            assert await _answer(k, "alice") == "from the kernel's model"
    warnings = _model_warnings(caplog)
    assert len(warnings) == 1 and "larger than" in warnings[0], warnings


async def test_a_model_file_cannot_choose_where_the_servers_keys_are_sent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The providers' keys are the server's (its environment): a file that could name a base URL
    would hand them to whatever host it names (or reach the server's internal network)."""
    spec = _script(tmp_path, "alice", ["alice's model"])
    _choose(tmp_path, "alice", json.dumps({"model": spec, "base_url": "http://169.254.169.254/"}))
    default = ScriptedModel(lambda r: "from the kernel's model")
    with caplog.at_level(logging.WARNING, logger=MODEL_LOG):
        async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=default, workspace=tmp_path, tools=[]) as k:
            assert await _answer(k, "alice") == "from the kernel's model"
    assert any("base_url" in w for w in _model_warnings(caplog))


# --------------------------------------------------------------------------------- mcp.json


def _record(owner: str) -> ProcessRecord:
    return ProcessRecord(pid="p", owner=owner, run_as=owner, cwd="/")


async def test_a_huge_mcp_file_is_refused_without_being_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeServers()
    monkeypatch.setattr(account_mcp_module, "mcp_tools", fake)
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps([{"name": "a", "command": "srv"}]) + " " * (1 << 20))
    mcp = AccountMCP(lambda owner: path)
    with caplog.at_level(logging.WARNING):
        assert await mcp.toolset(_record("alice"), {}) == {}
    assert "larger than" in caplog.text and fake.starts == []
    await mcp.close()


# ------------------------------------------------------------------------------------ serve


def _serve_options(tmp_path: Path, name: str, store: str, out: io.StringIO) -> ServeOptions:
    data = tmp_path / name
    data.mkdir()
    settings = Settings(model=_script(tmp_path, name, ["unused"]), model_source="test", store=store)
    return ServeOptions("127.0.0.1", 0, data, tmp_path, settings, parse_approval("auto"), out=out)


async def test_servers_sharing_a_fresh_store_start_together(tmp_path: Path, pg_url: str) -> None:
    """Several servers on one PostgreSQL (README: they may share it), started at once on a fresh
    database: each sees no account, each creates ``admin``, and the one that came second stopped
    with "account 'admin' already exists" instead of serving."""
    outs = [io.StringIO(), io.StringIO()]

    async def serve(i: int) -> None:
        async def ready(running: Running) -> None:
            running.stop()

        await serve_async(_serve_options(tmp_path, f"d{i}", pg_url, outs[i]), signals=False, on_ready=ready)

    await asyncio.wait_for(asyncio.gather(serve(0), serve(1)), 60)
    printed = [out.getvalue() for out in outs]
    assert all("agentloop serving on" in text for text in printed), printed
    assert sum("created the admin account" in text for text in printed) == 1, printed


# ------------------------------------------------------------------------------- config file


def _nested_too_deep(path: Path) -> Path:
    path.write_text("model = " + "[" * 100_000 + "]" * 100_000 + "\n")
    return path


def _unknowable(path: Path) -> Path:
    """A config path whose existence cannot be learnt: a name too long for the file system (as
    root this stands in for the usual case, a directory the user may not enter, such as a
    container's ``HOME=/root`` for a non-root user)."""
    return path.parent / ("x" * 300) / path.name


@pytest.mark.parametrize("make", [_nested_too_deep, _unknowable], ids=["too-deep", "unknowable"])
def test_a_config_file_that_cannot_be_read_is_reported_not_raised(tmp_path: Path, make: Callable[[Path], Path]) -> None:
    """README: "a broken config file must never stop the CLI" (the loop commands stop with exit 2
    naming it, the client ones warn). A file nested too deep for the parser, or a path that could
    not be checked, raised out of the settings: "RecursionError" (or "OSError") and exit 1 for
    every command, the client ones too."""
    path = make(tmp_path / "config.toml")
    env = {CONFIG_ENV: str(path)}
    settings = load_settings(env=env)
    assert any(f"config file {path} cannot be read" in e for e in settings.errors), settings.errors
    connection = load_connection(env=env)
    assert any("cannot be read" in w for w in connection.warnings), connection.warnings
