"""``agentloop account …`` and ``agentloop token …``: accounts and bearer tokens, administered on
the database itself.

They open the server's store directly (``<data>/agentloop.db``, or the PostgreSQL store that
``AGENTLOOP_STORE`` or the config file's ``store`` names, as ``serve`` does) rather than asking
the server, so an administrator can
make the first extra account or revoke a leaked token even while no server (or a stuck one) runs.
SQLite in WAL mode lets them do so while the server has the database open. A token is printed
once, when created; listings show ids and labels, never the stored hashes.

``agentloop prune`` applies the retention rules (``kernel/retention.py``: the config file's
``[retention]``, or its flags) to the same store and data directory, once, or with ``--dry-run``
lists what they would remove.

Only ``account create`` may create the database (the first account can be made before any server
ran). The other commands need one to exist: ``account list`` and ``token list`` on a directory
without a database say so and exit 0, and nothing is written: a look must not leave a database
(or a directory) behind where none was.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from agentloop.cli.options import data_path
from agentloop.cli.usage import App
from agentloop.process.store import Store, open_store

if TYPE_CHECKING:
    from agentloop.kernel.retention import Plan, Retention, Swept
    from agentloop.server.auth import Accounts

T = TypeVar("T")
ADMIN = "admin"  # the account the first server start creates (agentloop.server.auth.ADMIN)

account_app = App(help="Accounts that own processes and tokens.", no_args_is_help=True)
token_app = App(help="Bearer tokens for the server (shown once when created).", no_args_is_help=True)

DataOpt = Annotated[
    Path | None,
    typer.Option(
        "--data",
        parser=data_path,
        help="The server's data directory (default: $AGENTLOOP_DATA, $XDG_DATA_HOME/agentloop, "
        "~/.local/share/agentloop).",
    ),
]


def register(app: typer.Typer) -> None:
    app.add_typer(account_app, name="account")
    app.add_typer(token_app, name="token")
    app.command("prune")(prune)


def _database(data: Path | None) -> Path:
    """Where the database is (or would be); the directory must exist."""
    from agentloop.cli.chat import data_dir
    from agentloop.cli.main import CliError

    directory = data_dir(data)
    if not directory.is_dir():
        raise CliError(f"no data directory {directory}: start 'agentloop serve' once, or pass --data")
    return directory.resolve() / "agentloop.db"


def _existing_database(data: Path | None) -> Path | None:
    """The database when there is one, else None; never creates anything."""
    from agentloop.cli.chat import data_dir

    path = data_dir(data).expanduser() / "agentloop.db"
    return path.resolve() if path.is_file() else None


def _sqlite_file(url: str) -> Path | None:
    """The file a ``sqlite:///`` store URL names (relative to here, as the store reads it)."""
    return Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None


def _no_database(data: Path | None) -> str:
    from agentloop.cli.chat import data_dir
    from agentloop.cli.config import load_settings

    configured = load_settings().store
    path = (_sqlite_file(configured) if configured else None) or data_dir(data) / "agentloop.db"
    return f"no database at {path}: no accounts or tokens yet (agentloop serve creates it)"


def _store_url(data: Path | None, *, create: bool = False) -> str | None:
    """The store to open: the configured one, else the data directory's SQLite file when it
    exists (or, with ``create``, may be made); None when there is nothing to open."""
    from agentloop.cli.config import load_settings
    from agentloop.cli.main import CliError

    settings = load_settings()
    if settings.store_error is not None:  # a bad URL (or an unreadable config file) must not fall back
        raise CliError(settings.store_error, 2)  # to another database; a bad config value is exit 2, as for serve
    configured = settings.store
    if configured is not None:
        # a configured SQLite file is no different from the data directory's: only ``create`` makes
        # it (``account list`` once left an empty database wherever a mistyped URL pointed)
        file = _sqlite_file(configured)
        return None if file is not None and not create and not file.is_file() else configured
    path = _database(data) if create else _existing_database(data)
    return f"sqlite:///{path}" if path is not None else None


def _with_accounts(data: Path | None, work: Callable[[Accounts], Awaitable[T]], *, create: bool = False) -> T:
    """Open the store (migrating its schema like the server would), run ``work``, close. Only with
    ``create`` is a missing database created; otherwise the caller has checked that it exists."""
    from agentloop.cli.main import CliError

    try:  # the server package needs the server extra; a plain install still gets a clear error
        from agentloop.server.auth import AccountError, Accounts
    except ImportError as exc:
        raise CliError(f"accounts need the server extra: pip install 'agentloop[server]' ({exc})") from None
    url = _store_url(data, create=create)
    if url is None:
        raise CliError(_no_database(data))

    async def go() -> T:
        store: Store = open_store(url)
        await store.open()
        try:
            return await work(Accounts(store))
        finally:
            await store.close()

    try:
        return asyncio.run(go())
    except AccountError as exc:
        raise CliError(str(exc)) from None


def _nothing_to_list(data: Path | None) -> bool:
    """For a listing: True (having said so on stderr) when there is no database to list from."""
    if _store_url(data) is not None:
        return False
    typer.echo(_no_database(data), err=True)
    return True


def _when(stamp: float | None) -> str:
    if stamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M")


@account_app.command("create")
def account_create(
    name: Annotated[
        str, typer.Argument(metavar="NAME", help="Lowercase letters, digits, '-' or '_', starting with a letter.")
    ],
    admin: Annotated[bool, typer.Option("--admin", help="May see and manage every account's processes.")] = False,
    token: Annotated[bool, typer.Option("--token/--no-token", help="Also create a first token and print it.")] = True,
    data: DataOpt = None,
) -> None:
    """Create an account (and, by default, its first token)."""
    from agentloop.cli.main import _guarded

    with _guarded():

        async def work(accounts: Accounts) -> str | None:
            await accounts.create_account(name, admin=admin)
            if not token:
                return None
            secret, _ = await accounts.create_token(name, label="first token")
            return secret

        secret = _with_accounts(data, work, create=True)
        typer.echo(f"created account {name}" + (" (admin)" if admin else ""))
        if secret is not None:
            typer.echo(f"token: {secret}")
            typer.echo("store it now: it is shown only this once", err=True)


@account_app.command("list")
def account_list(data: DataOpt = None) -> None:
    """List the accounts."""
    from agentloop.cli.main import _guarded

    with _guarded():
        if _nothing_to_list(data):
            return

        async def work(accounts: Accounts) -> list[tuple[str, bool, float]]:
            return [(a.name, a.admin, a.created_at) for a in await accounts.store.list_accounts()]

        for name, is_admin, created in _with_accounts(data, work):
            typer.echo(f"{name}\t{'admin' if is_admin else 'user'}\t{_when(created)}")


@token_app.command("create")
def token_create(
    account: Annotated[str, typer.Option("--account", "-a", help="Whose token it is.")] = ADMIN,
    label: Annotated[str, typer.Option("--label", "-l", help="A note to recognise it by in 'token list'.")] = "",
    data: DataOpt = None,
) -> None:
    """Create a token and print it (once: only its hash is kept)."""
    from agentloop.cli.main import CliError, _guarded

    with _guarded():
        if _store_url(data) is None:  # no accounts at all; and no database made for nothing
            raise CliError(f"no such account {account!r} ({_no_database(data)})")

        async def work(accounts: Accounts) -> tuple[str, str]:
            secret, record = await accounts.create_token(account, label=label)
            return secret, record.id

        secret, token_id = _with_accounts(data, work)
        typer.echo(secret)
        typer.echo(f"token {token_id} for {account}: store it now, it is shown only this once", err=True)


@token_app.command("list")
def token_list(
    account: Annotated[str | None, typer.Option("--account", "-a", help="Only this account's tokens.")] = None,
    data: DataOpt = None,
) -> None:
    """List tokens: id, account, label, created, revoked (never the tokens or their hashes)."""
    from agentloop.cli.main import _guarded

    with _guarded():
        if _nothing_to_list(data):
            return

        async def work(accounts: Accounts) -> list[tuple[str, str, str, float, float | None]]:
            return [(t.id, t.account, t.label, t.created_at, t.revoked_at) for t in await accounts.tokens(account)]

        rows = _with_accounts(data, work)
        typer.echo("id\taccount\tlabel\tcreated\trevoked")
        for token_id, owner, note, created, revoked in rows:
            typer.echo(f"{token_id}\t{owner}\t{note or '-'}\t{_when(created)}\t{_when(revoked)}")


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[str, typer.Argument(metavar="ID", help="The id 'token list' shows.")],
    data: DataOpt = None,
) -> None:
    """Revoke a token: the next request that carries it is refused."""
    from agentloop.cli.main import CliError, _guarded

    with _guarded():

        async def work(accounts: Accounts) -> bool:
            return await accounts.revoke(token_id)

        if _store_url(data) is None or not _with_accounts(data, work):
            raise CliError(f"no such token {token_id!r} (or it was already revoked)")
        typer.echo(f"revoked {token_id}")


def _prune_rules(archives_days: float | None, idle_days: float | None) -> Retention:
    """The flags' rules when either is given (they replace the file's, so what a run removes is
    what its command line says), else the config file's; a usage error (exit 2) when neither
    sets any or the file's are unusable."""
    from agentloop.cli.config import config_path, read_config_file
    from agentloop.cli.main import CliError
    from agentloop.kernel.retention import Retention

    if archives_days is not None or idle_days is not None:
        try:
            return Retention.from_days(archives_days, idle_days)
        except ValueError as exc:
            flags = str(exc).replace("archives_days", "--archives-days").replace("idle_process_days", "--idle-days")
            raise CliError(flags.removeprefix("retention "), 2) from None
    path = config_path()
    file, _ = read_config_file(path)
    problem = file.errors.get("retention") or file.errors.get("config")  # (an unreadable file may hold rules)
    if problem is not None:
        raise CliError(problem, 2)
    if file.retention is None:
        raise CliError(
            f"no retention rules: set [retention] archives_days and/or idle_process_days in {path},"
            " or pass --archives-days / --idle-days",
            2,
        )
    return file.retention


def _days(seconds: float) -> str:
    return f"{seconds / 86400:.1f}d"


def _show_plan(todo: Plan, now: float) -> None:
    from agentloop.kernel.retention import last_active

    for archive in todo.archives:
        where = f"{archive.user}/{archive.pid}/{archive.path.name}"
        typer.echo(f"archive\t{where}\t{_days(now - archive.created)} old")
    for record in todo.processes:
        typer.echo(f"process\t{record.pid}\t{record.owner}\tidle {_days(now - last_active(record))}")


async def _prune(url: str, directory: Path, rules: Retention, *, dry_run: bool) -> tuple[Plan, Swept | None]:
    """Plan on the store alone; then, unless a dry run, remove. Only idle processes need the
    runtime (their kill goes through the kernel's, which archives them and deletes their media),
    so the kernel is opened only when there are some, and for maintenance: this command has none
    of the server's model, tools or policy, so it must resume no run and fire no schedule."""
    from agentloop.kernel import Kernel
    from agentloop.kernel.retention import Swept, plan, remove_old_archive, sweep

    now = time.time()
    store: Store = open_store(url)
    await store.open()
    try:
        todo = await plan(store, directory, rules, now=now)
        if dry_run:
            return todo, None
        if not todo.processes:
            done = Swept()
            for archive in todo.archives:  # (each on its own, as the kernel's sweep does)
                try:
                    await remove_old_archive(store, directory, archive)
                    done.archives += 1
                except Exception as exc:
                    done.failed += 1
                    typer.echo(f"warning: could not remove archive {archive.path}: {exc}", err=True)
            return todo, done
    finally:
        await store.close()
    async with Kernel.open(url, data_dir=directory, workspace=directory, titles=None, maintenance=True) as kernel:
        return todo, await sweep(kernel, rules, now=now)


def prune(
    archives_days: Annotated[
        float | None,
        typer.Option("--archives-days", help="Remove archives older than this many days (replaces the file's rules)."),
    ] = None,
    idle_days: Annotated[
        float | None,
        typer.Option(
            "--idle-days",
            help="Kill, with an archive, processes idle for longer than this many days (replaces the file's rules).",
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be removed; remove nothing.")] = False,
    data: DataOpt = None,
) -> None:
    """Apply the retention rules now: old archives go, idle processes are killed (with an archive).

    The rules are the config file's [retention] (archives_days, idle_process_days) unless a flag
    is given. Interactive conversations (the one 'agentloop chat' continues) are processes like
    any other. A server with [retention] configured sweeps by itself, hourly; on a SQLite store a
    running server or chat holds the store, so let it sweep (this command then says so)."""
    from agentloop.cli.chat import data_dir
    from agentloop.cli.main import _guarded

    with _guarded():
        rules = _prune_rules(archives_days, idle_days)
        url = _store_url(data)
        if url is None:
            typer.echo(_no_database(data).replace("no accounts or tokens yet", "nothing to prune"), err=True)
            return
        directory = data_dir(data).expanduser().resolve()
        todo, done = asyncio.run(_prune(url, directory, rules, dry_run=dry_run))
        _show_plan(todo, time.time())
        if done is None:
            typer.echo(
                f"dry run: would remove {len(todo.archives)} archives and kill {len(todo.processes)} idle processes"
                " (each with the idle processes below it)",
                err=True,
            )
            return
        typer.echo(
            f"removed {done.archives} archives, killed {done.processes} idle processes"
            + (f", {done.failed} failed (see the log)" if done.failed else ""),
            err=True,
        )
        if done.failed:
            raise typer.Exit(1)
