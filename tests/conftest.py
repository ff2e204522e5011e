"""Shared test configuration. Provider fakes live in ``tests/fakes``; the PostgreSQL server the
PostgreSQL tests use is started here (``tests/pg_support.py``), once per session, when first asked for."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.cdp import Browser, find_chromium, required
from tests.pg_support import PgServer, find_binaries

# Set (CI does) to make a missing PostgreSQL a failure instead of a skip.
REQUIRE_PG = "AGENTLOOP_REQUIRE_POSTGRES"


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_PG):
        pytest.fail(f"{REQUIRE_PG} is set but PostgreSQL cannot be used: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """A PostgreSQL server of this test session, or a skip saying why there cannot be one."""
    try:
        import asyncpg  # noqa: F401
    except ImportError:
        _unavailable("asyncpg is not installed (pip install 'agentloop[postgres]')")
    bindir, reason = find_binaries()
    if bindir is None:
        _unavailable(reason)
    assert bindir is not None
    server = PgServer(bindir)
    try:
        server.start()
    except BaseException:
        server.stop()
        raise
    yield server
    server.stop()


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """The URL of a fresh, empty database, dropped after the test."""
    url = pg_server.create_database()
    yield url
    pg_server.drop_database(url)


@pytest.fixture(scope="module")
def chromium() -> str:
    """The Chromium binary for the browser tests; they skip without one, unless
    ``AGENTLOOP_REQUIRE_BROWSER=1`` (CI) makes that a failure."""
    binary = find_chromium()
    if binary is None:
        message = "chromium is not installed (apt-get install -y chromium)"
        if required():
            pytest.fail(f"{message}, and AGENTLOOP_REQUIRE_BROWSER=1 says the browser test must run")
        pytest.skip(f"{message}; set AGENTLOOP_REQUIRE_BROWSER=1 to make this a failure")
    return binary


@pytest.fixture
def browser(chromium: str) -> Iterator[Browser]:
    b = Browser(chromium)
    try:
        yield b
    finally:
        b.close()
