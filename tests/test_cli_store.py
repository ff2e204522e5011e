"""Which store ``agentloop serve`` uses: ``--store``, then ``AGENTLOOP_STORE``, then the config
file's ``store``, else the data directory's SQLite file; a malformed URL is an error naming its
source (never quoting the URL, which may hold a password)."""

from __future__ import annotations

from pathlib import Path

from agentloop.cli.config import Settings, load_settings


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
    assert s.store is None and len(s.errors) == 1
    assert "store must start with" in s.errors[0] and "secret" not in s.errors[0]
    s = settings(tmp_path, flag="nope://u:secret@h")
    assert s.errors == ["--store: store must start with sqlite:///, postgresql:// or postgres://"]
