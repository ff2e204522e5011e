"""A database SQLite could open but not write is refused at open, with the reason, not at the first
commit (a run's answer lost long after start-up).

Root writes through file permissions, so as root each case runs in a forked child that has become
``nobody`` first (everything it needs is imported before the fork: after it, the interpreter's own
files under a private home may be out of reach). Otherwise the test's own user is refused.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentloop.process.store.base import StoreError
from agentloop.process.store.sqlite import SQLiteStore

NOBODY = 65534


def _open_as_someone_else(path: Path) -> str:
    """Open the store at ``path`` as a user without root's powers; what it said (or ``opened``)."""

    def attempt() -> str:
        async def go() -> str:
            store = SQLiteStore(path)
            try:
                await store.open()
            except StoreError as exc:
                return str(exc)
            await store.close()
            return "opened"

        return asyncio.run(go())

    if os.geteuid() != 0:
        return attempt()
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's coverage is not collected)
        code = 0
        try:
            os.close(reader)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(writer, attempt().encode())
        except BaseException as exc:
            os.write(writer, f"child failed: {exc!r}".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(writer)
    with os.fdopen(reader, "rb") as out:
        said = out.read().decode()
    os.waitpid(child, 0)
    return said


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder another user can enter (pytest's own are root's only)."""
    path = Path(tempfile.mkdtemp(prefix="agentloop-ro-"))
    path.chmod(0o777)
    yield path
    for item in path.iterdir():
        item.chmod(0o600)
        item.unlink()
    path.chmod(0o700)
    path.rmdir()


def _existing_database(folder: Path) -> Path:
    path = folder / "agentloop.db"

    async def make() -> None:
        store = SQLiteStore(path)
        await store.open()
        await store.close()

    asyncio.run(make())
    for item in folder.iterdir():  # the store made it its owner's only; the other user may read it
        item.chmod(0o644)
    return path


def _tables(path: Path) -> list[str]:
    with sqlite3.connect(path) as db:
        return sorted(row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))


def test_a_read_only_database_file_is_refused_at_open_and_left_as_it_was(folder: Path) -> None:
    path = _existing_database(folder)
    tables, content = _tables(path), path.read_bytes()
    path.chmod(0o444)
    said = _open_as_someone_else(path)
    assert said.startswith(f"cannot open the database {path}: it is read-only"), said
    assert path.read_bytes() == content and _tables(path) == tables


def test_a_writable_database_in_a_read_only_folder_says_where_the_journal_would_go(folder: Path) -> None:
    path = _existing_database(folder)
    for companion in folder.glob("agentloop.db-*"):  # a clean close leaves no -wal/-shm behind
        companion.unlink()
    path.chmod(0o666)
    folder.chmod(0o555)
    try:
        said = _open_as_someone_else(path)
    finally:
        folder.chmod(0o777)
    reason = f"its folder {folder} is read-only, and SQLite writes its journal there"
    assert said == f"cannot open the database {path}: {reason}"


def test_a_read_only_journal_file_is_named(folder: Path) -> None:
    path = _existing_database(folder)
    path.chmod(0o666)
    wal = Path(f"{path}-wal")
    wal.write_bytes(b"")
    wal.chmod(0o444)
    said = _open_as_someone_else(path)
    assert said == f"cannot open the database {path}: {wal} is read-only; make it writable"


def test_a_writable_database_still_opens_for_the_other_user(folder: Path) -> None:
    """The check refuses only what SQLite could not write: the same cases made writable open."""
    path = _existing_database(folder)
    path.chmod(0o666)
    assert _open_as_someone_else(path) == "opened"
