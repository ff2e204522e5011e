"""``agentloop account …`` and ``agentloop token …`` on a data directory: tokens printed once and
stored hashed, listings without secrets, clear one-line errors with exit code 1."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentloop.cli.main import app
from agentloop.process.store import open_store
from agentloop.server.auth import Accounts, hash_token

runner = CliRunner()
TOKEN = re.compile(r"al_[A-Za-z0-9_\-]{20,}")


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.delenv("AGENTLOOP_DATA", raising=False)
    monkeypatch.delenv("AGENTLOOP_DEBUG", raising=False)
    directory = tmp_path / "data"
    directory.mkdir()
    return directory


def cli(data: Path, *args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, [*args, "--data", str(data)])
    return result.exit_code, result.stdout, result.stderr


def authenticate(data: Path, token: str) -> str | None:
    async def go() -> str | None:
        store = open_store(f"sqlite:///{data}/agentloop.db")
        await store.open()
        try:
            who = await Accounts(store).authenticate(token)
            return who.account if who else None
        finally:
            await store.close()

    return asyncio.run(go())


def test_account_and_token_lifecycle(data: Path) -> None:
    code, out, _ = cli(data, "account", "create", "alice")
    assert code == 0 and "created account alice" in out
    first = TOKEN.findall(out)
    assert len(first) == 1
    assert authenticate(data, first[0]) == "alice"

    code, out, err = cli(data, "token", "create", "--account", "alice", "--label", "ci")
    assert code == 0 and "shown only this once" in err
    (second,) = TOKEN.findall(out)
    assert out.strip() == second  # stdout is the token alone: scriptable

    code, listing, _ = cli(data, "token", "list")
    assert code == 0
    rows = [line.split("\t") for line in listing.strip().splitlines()]
    assert rows[0] == ["id", "account", "label", "created", "revoked"]
    assert [(r[1], r[2], r[4]) for r in rows[1:]] == [("alice", "first token", "-"), ("alice", "ci", "-")]
    for secret in (first[0], second):  # neither the tokens nor their hashes are ever listed
        assert secret not in listing and hash_token(secret) not in listing

    ci_id = rows[2][0]
    code, out, _ = cli(data, "token", "revoke", ci_id)
    assert code == 0 and ci_id in out
    assert authenticate(data, second) is None
    assert authenticate(data, first[0]) == "alice"
    code, listing, _ = cli(data, "token", "list", "--account", "alice")
    assert [line.split("\t")[4] != "-" for line in listing.strip().splitlines()[1:]] == [False, True]
    code, _, err = cli(data, "token", "revoke", ci_id)
    assert code == 1 and "no such token" in err


def test_admin_account_and_default_token_owner(data: Path) -> None:
    code, out, _ = cli(data, "account", "create", "admin", "--admin", "--no-token")
    assert code == 0 and "(admin)" in out and not TOKEN.search(out)
    code, out, _ = cli(data, "token", "create")  # for the admin by default
    assert code == 0 and authenticate(data, out.strip()) == "admin"
    code, out, _ = cli(data, "account", "list")
    assert out.split("\t")[:2] == ["admin", "admin"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("account", "create", "Bad Name"), "invalid account name"),
        (("account", "create", "1abc"), "invalid account name"),
        (("token", "create", "--account", "nobody"), "no such account 'nobody'"),
        (("token", "revoke", "deadbeef"), "no such token"),
    ],
)
def test_clear_errors(data: Path, args: tuple[str, ...], message: str) -> None:
    code, out, err = cli(data, *args)
    assert code == 1
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err + out


def test_taken_name_and_missing_directory(data: Path, tmp_path: Path) -> None:
    assert cli(data, "account", "create", "bob")[0] == 0
    code, _, err = cli(data, "account", "create", "bob")
    assert code == 1 and err.startswith("error: ") and "Traceback" not in err
    code, _, err = cli(tmp_path / "nowhere", "account", "create", "carol")
    assert code == 1 and "no data directory" in err and not (tmp_path / "nowhere").exists()


def tree(root: Path) -> list[Path]:
    return sorted(root.rglob("*"))


@pytest.mark.parametrize("where", ["empty", "missing"])
@pytest.mark.parametrize("command", [("account", "list"), ("token", "list"), ("token", "list", "--account", "bob")])
def test_listing_without_a_database_creates_nothing(
    data: Path, tmp_path: Path, where: str, command: tuple[str, ...]
) -> None:
    """A look is read-only: on a data directory without a database (empty, or not there at all)
    the listings say there is none and exit 0, leaving no database or directory behind."""
    target = data if where == "empty" else tmp_path / "nowhere"
    before = tree(tmp_path)
    code, out, err = cli(target, *command)
    assert code == 0, err
    assert out == "" and f"no database at {target / 'agentloop.db'}" in err and "Traceback" not in err
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (("token", "revoke", "deadbeef"), "no such token"),
        (("token", "create", "--account", "alice"), "no such account 'alice' (no database at"),
    ],
)
def test_token_commands_without_a_database_create_nothing(
    data: Path, tmp_path: Path, command: tuple[str, ...], message: str
) -> None:
    before = tree(tmp_path)
    code, _, err = cli(data, *command)
    assert code == 1 and message in err and "Traceback" not in err
    assert tree(tmp_path) == before


def test_account_create_makes_the_database_and_listing_then_reads_it(data: Path) -> None:
    assert not (data / "agentloop.db").exists()
    assert cli(data, "account", "create", "dana", "--no-token")[0] == 0
    code, out, _ = cli(data, "account", "list")
    assert code == 0 and out.split("\t")[0] == "dana"


def test_accounts_and_tokens_live_in_the_configured_store(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server on PostgreSQL (AGENTLOOP_STORE) is administered there, not in a SQLite file
    nobody reads."""
    pytest.importorskip("asyncpg")
    monkeypatch.setenv("AGENTLOOP_STORE", pg_url)
    empty = tmp_path / "data"
    empty.mkdir()
    made = runner.invoke(app, ["account", "create", "carol", "--data", str(empty)])
    assert made.exit_code == 0, made.stderr
    listed = runner.invoke(app, ["account", "list", "--data", str(empty)])
    assert listed.exit_code == 0 and "carol" in listed.stdout
    assert list(empty.iterdir()) == []  # no SQLite file beside it

    async def accounts() -> list[str]:
        store = open_store(pg_url)
        await store.open()
        try:
            return [a.name for a in await store.list_accounts()]
        finally:
            await store.close()

    assert "carol" in asyncio.run(accounts())
