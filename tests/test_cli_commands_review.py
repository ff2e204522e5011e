"""Review of the CLI commands around the server: ``device connect``, ``account``/``token`` and the
client commands' connection lookup. Each test reproduces a problem a user would hit: a secret
printed to the terminal, a command that silently used another store than the configured one, a
broken config file nobody was told about."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentloop.cli import device
from agentloop.cli.main import app
from agentloop.device.client import DeviceClient
from agentloop.process.store import open_store
from agentloop.server.auth import Accounts

runner = CliRunner()
TOKEN = re.compile(r"al_[A-Za-z0-9_\-]{20,}")


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No user config, store, server or token from the environment of whoever runs the tests."""
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in ("AGENTLOOP_DATA", "AGENTLOOP_STORE", "AGENTLOOP_SERVER", "AGENTLOOP_TOKEN", "AGENTLOOP_DEBUG"):
        monkeypatch.delenv(name, raising=False)


def token_count(data: Path, account: str) -> int:
    async def go() -> int:
        store = open_store(f"sqlite:///{data}/agentloop.db")
        await store.open()
        try:
            return len(await Accounts(store).tokens(account))
        finally:
            await store.close()

    return asyncio.run(go())


def test_device_connect_never_prints_the_password_of_its_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The start line repeated the server URL as given, so a reverse proxy's basic-auth password
    (``https://user:pw@host``) landed on the terminal and in whatever log keeps the device's output."""

    async def no_connection(client: DeviceClient) -> None:
        return None

    monkeypatch.setattr(device, "_serve", no_connection)
    url = "https://bob:hunter2-proxy@example.test:8443"
    result = runner.invoke(app, ["device", "connect", url, "--token", "al_x", "--root", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    assert "hunter2-proxy" not in result.stderr + result.stdout
    assert "wss://bob:***@example.test:8443/v1/ws" in result.stderr


def test_an_unreadable_config_file_stops_the_admin_commands_instead_of_using_another_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config file that cannot be parsed may be the one naming the shared store; ``token create``
    went on with the data directory's SQLite file, minted a token there and exited 0, so the token
    the operator handed out was unknown to the servers. ``serve`` stops (exit 2) on the same file."""
    data = tmp_path / "data"
    data.mkdir()
    created = runner.invoke(app, ["account", "create", "bob", "--no-token", "--data", str(data)])
    assert created.exit_code == 0, created.stderr
    config = tmp_path / "config.toml"
    config.write_text('store = "postgresql://agentloop@db.internal/agentloop"\nmodel = \n')  # a typo below the store
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(config))

    for command in (["token", "create", "-a", "bob"], ["account", "create", "carol"], ["token", "list"]):
        result = runner.invoke(app, [*command, "--data", str(data)])
        assert result.exit_code == 2, (command, result.stdout, result.stderr)
        assert f"error: config file {config} cannot be read" in result.stderr
        assert not TOKEN.search(result.stdout) and "Traceback" not in result.stderr
    assert token_count(data, "bob") == 0
    served = runner.invoke(app, ["serve", "--data", str(data), "--port", "0"])
    assert served.exit_code == 2 and served.stderr.count("cannot be read") == 1, served.stderr  # said once


def test_a_bad_store_setting_is_exit_2_for_the_admin_commands_as_for_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: exit 2 for a bad flag or config value; ``serve`` gives 2 for a malformed store URL,
    the account and token commands gave 1 for the same value."""
    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setenv("AGENTLOOP_STORE", "mysql://u:secret@h/db")
    for command in (["account", "create", "carol"], ["account", "list"], ["token", "revoke", "abc"]):
        result = runner.invoke(app, [*command, "--data", str(data)])
        assert result.exit_code == 2, (command, result.stderr)
        assert "AGENTLOOP_STORE: store must start with" in result.stderr and "secret" not in result.stderr
    served = runner.invoke(app, ["serve", "--data", str(data), "--port", "0"])
    assert served.exit_code == 2 and "AGENTLOOP_STORE: store must start with" in served.stderr


def test_the_client_commands_say_when_the_config_file_cannot_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client commands dropped an unparsable config file without a word: with the token kept
    there, the user was told to "put token = … in the config file", where it already was."""
    config = tmp_path / "config.toml"
    config.write_text('server = "http://127.0.0.1:9"\ntoken = "al_abcdefghijklmnopqrstuvwxyz"\ntimeout = \n')
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(config))
    result = runner.invoke(app, ["ps"])
    assert result.exit_code == 1
    assert f"warning: config file {config} cannot be read" in result.stderr, result.stderr
    assert "al_abcdefghijklmnopqrstuvwxyz" not in result.stderr


@pytest.mark.parametrize(
    ("line", "secret"),
    [
        ('token = ["al_SECRETSECRETSECRETSECRET"]', "al_SECRETSECRETSECRETSECRET"),  # a list by mistake
        ('server = "127.0.0.1:8765/?token=al_SECRETSECRET"', "al_SECRETSECRET"),  # no scheme
    ],
)
def test_a_config_warning_never_repeats_a_credential(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str, secret: str
) -> None:
    """An unusable ``token`` or ``server`` key was quoted back in the warning, so every command,
    ``serve`` under a supervisor included, wrote the token to stderr and so to its log."""
    config = tmp_path / "config.toml"
    config.write_text(line + "\n")
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(config))
    result = runner.invoke(app, ["ps", "--server", "http://127.0.0.1:9", "--token", "al_x"])
    assert result.exit_code == 1
    assert f"warning: config file {config}: " in result.stderr and "; ignored" in result.stderr
    assert secret not in result.stderr, result.stderr


@pytest.mark.parametrize("address", ["ftp://host", "http://", "http://host:99999"])
def test_a_server_address_that_is_a_typo_is_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, address: str
) -> None:
    """A bad --server is a bad flag value (exit 2, as the README says), not a server that could not
    be reached (1): a script can tell a mistake it must fix from an outage it may wait out."""
    result = runner.invoke(app, ["ps", "--server", address, "--token", "al_x"])
    assert result.exit_code == 2, result.output
    assert "not a server address" in result.output
