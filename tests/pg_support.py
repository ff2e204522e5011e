"""A throwaway PostgreSQL server for the tests: started once per session, one database per test.

Nothing here assumes a server is running. ``PgServer.start()`` runs ``initdb`` into a temporary
directory (as the ``postgres`` user when the tests run as root, since PostgreSQL refuses to run as
root), starts it with ``pg_ctl -w`` on a free port of 127.0.0.1 with trust authentication, and
``stop()`` stops it and removes the directory. Durability settings are off (``fsync`` and
friends): the tests kill clients, never the server, so nothing is lost that a test could notice,
and ``CREATE DATABASE`` plus a migration take milliseconds instead of a second.

``find_binaries()`` says why the server cannot be started on this machine (no binaries, no
``postgres`` user to run them as root), so the PostgreSQL tests can be skipped with that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BIN_ENV = "AGENTLOOP_PG_BIN"  # a directory with initdb and pg_ctl, if not a standard one


def find_binaries() -> tuple[Path | None, str]:
    """The directory holding ``initdb`` and ``pg_ctl``, or None and the reason there is none."""
    if os.environ.get(BIN_ENV):  # an explicit choice: that directory or nothing
        candidates = [os.environ[BIN_ENV]]
    else:
        candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_major, reverse=True)
        on_path = shutil.which("pg_ctl")
        if on_path:
            candidates.append(str(Path(on_path).parent))
    for c in candidates:
        d = Path(c)
        if (d / "initdb").exists() and (d / "pg_ctl").exists():
            if os.geteuid() == 0:
                try:
                    pwd.getpwnam("postgres")
                except KeyError:
                    return None, f"running as root and there is no 'postgres' user to run {d}/initdb as"
            return d, ""
    return None, "PostgreSQL server binaries (initdb, pg_ctl) not found; set AGENTLOOP_PG_BIN or install postgresql"


def _major(path: str) -> int:
    try:
        return int(Path(path).parent.name)
    except ValueError:
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgServer:
    """One PostgreSQL cluster in a temporary directory. ``dsn(db)`` names a database in it."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        # in memory where there is a tmpfs: the cluster is thrown away anyway, and disk writes
        # (CREATE DATABASE copies a template; DDL writes catalogs) are most of a test's setup time
        shm = Path("/dev/shm")
        base = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
        self.root = Path(tempfile.mkdtemp(prefix="agentloop-pg-", dir=base))
        self.data = self.root / "data"
        self.port = 0
        self._as_postgres = os.geteuid() == 0

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = list(args)
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=self.root)
        if proc.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}{tail}")
        return proc

    def start(self) -> None:
        if self._as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self.root.chmod(0o700)
        self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
        )
        self.port = _free_port()
        options = " ".join(
            [
                "-c listen_addresses=127.0.0.1",
                f"-c port={self.port}",
                f"-c unix_socket_directories={self.root}",
                "-c fsync=off",
                "-c synchronous_commit=off",
                "-c full_page_writes=off",
                "-c max_connections=200",
                "-c shared_buffers=32MB",
            ]
        )
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.root / "server.log"),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
        )

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def dsn(self, database: str = "postgres", *, password: str | None = None) -> str:
        auth = "postgres" if password is None else f"postgres:{password}"
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}"

    def admin(self, sql: str, database: str = "postgres") -> None:
        """Run one statement as the superuser. On a thread of its own with its own event loop, so
        sync fixtures can call it whatever pytest-asyncio is doing with the test's loop."""

        async def run() -> None:
            import asyncpg

            conn = await asyncpg.connect(self.dsn(database))
            try:
                await conn.execute(sql)
            finally:
                await conn.close()

        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, run()).result(timeout=60)

    def create_database(self) -> str:
        """A new empty database; returns its DSN."""
        name = "t_" + uuid.uuid4().hex[:16]
        # FILE_COPY: with fsync off, copying template0's files beats WAL-logging every page
        self.admin(f"CREATE DATABASE {name} TEMPLATE template0 STRATEGY FILE_COPY")
        return self.dsn(name)

    def drop_database(self, dsn: str) -> None:
        name = dsn.rsplit("/", 1)[1]
        self.admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")  # FORCE: a test may leave a store open
