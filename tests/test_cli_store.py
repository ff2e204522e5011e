"""Which store ``agentloop serve`` uses: ``--store``, then ``AGENTLOOP_STORE``, then the config
file's ``store``, else the data directory's SQLite file; a malformed URL is an error naming its
source (never quoting the URL, which may hold a password)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentloop.cli.config import Settings, load_settings
from agentloop.cli.main import app

runner = CliRunner()


def settings(
    tmp_path: Path, file: str | None = None, env_store: str | None = None, flag: str | None = None
) -> Settings:
    config = tmp_path / "config.toml"
    if file is not None:
        config.write_text(f'store = "{file}"\n')
    env = {"AGENTLOOP_CONFIG": str(config)}
    if env_store is not None:
        env["AGENTLOOP_STORE"] = env_store
    return load_settings(env=env, store=flag)


def test_precedence(tmp_path: Path) -> None:
    s = settings(tmp_path)
    assert (s.store, s.store_source, s.errors) == (None, "default", [])
    s = settings(tmp_path, file="postgresql://file@db/a")
    assert s.store == "postgresql://file@db/a" and s.store_source.startswith("config file")
    s = settings(tmp_path, file="postgresql://file@db/a", env_store="postgresql://env@db/a")
    assert (s.store, s.store_source) == ("postgresql://env@db/a", "AGENTLOOP_STORE")
    s = settings(tmp_path, file="bad", env_store="postgresql://env@db/a", flag="sqlite:///x.db")
    assert (s.store, s.store_source, s.errors) == ("sqlite:///x.db", "--store", [])


def test_a_malformed_url_is_an_error_that_does_not_quote_it(tmp_path: Path) -> None:
    s = settings(tmp_path, file="mysql://u:secret@h/db")
    assert s.store is None and s.errors == [] and s.store_error is not None
    assert "store must start with" in s.store_error and "secret" not in s.store_error
    s = settings(tmp_path, flag="nope://u:secret@h")
    assert s.store_error == "--store: store must start with sqlite:///, postgresql:// or postgres://"
    s = settings(tmp_path, file="mysql://u:secret@h/db", env_store="postgresql://env@db/a")
    assert s.store_error is None  # the environment overrides the bad key


def test_a_bad_store_stops_only_the_commands_that_open_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run`` never opens the configured store, so a bad AGENTLOOP_STORE must not stop it; the
    account commands do, and must refuse rather than fall back to the data directory's file."""
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.setenv("AGENTLOOP_STORE", "mysql://u:secret@h/db")
    script = tmp_path / "s.json"
    script.write_text(json.dumps(["hello there"]))
    ran = runner.invoke(app, ["run", "--model", f"scripted:{script}", "-w", str(tmp_path), "hi"])
    assert ran.exit_code == 0, ran.stderr
    assert ran.stdout == "hello there\n"
    data = tmp_path / "data"
    listed = runner.invoke(app, ["account", "create", "carol", "--data", str(data)])
    assert listed.exit_code != 0
    assert "AGENTLOOP_STORE: store must start with" in listed.stderr and "secret" not in listed.stderr
    assert not (data / "agentloop.db").exists()
