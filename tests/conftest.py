"""Shared test configuration. Provider fakes live in ``tests/fakes``; the PostgreSQL server the
PostgreSQL tests use is started here (``tests/pg_support.py``), once per session, when first asked for."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.cdp import Browser, Chromium, find_chromium, required
from tests.pg_support import PgServer, find_binaries


def pytest_configure(config: pytest.Config) -> None:
    """Subprocesses the tests start (``agentloop`` commands, workers, servers: a few hundred) each
    import the package. Where ``PYTHONDONTWRITEBYTECODE`` is set, each of them compiled all of it
    from source again (~0.3 s apiece). They get a bytecode cache of this session's instead, in a
    temporary directory (``PYTHONPYCACHEPREFIX``), so the source tree stays free of
    ``__pycache__`` as that setting wants; removed at the session's end. The code they run is the
    same."""
    dont_write = os.environ.get("PYTHONDONTWRITEBYTECODE")
    if not dont_write or os.environ.get("PYTHONPYCACHEPREFIX"):
        return
    prefix = tempfile.mkdtemp(prefix="agentloop-test-pycache-")
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    os.environ["PYTHONPYCACHEPREFIX"] = prefix

    def restore() -> None:
        os.environ.pop("PYTHONPYCACHEPREFIX", None)
        os.environ["PYTHONDONTWRITEBYTECODE"] = dont_write
        shutil.rmtree(prefix, ignore_errors=True)

    config.add_cleanup(restore)


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


@pytest.fixture(scope="session")
def _chromium_process() -> Iterator[list[Chromium]]:
    """The session's Chromium (started by the first browser test, see ``tests/cdp.py``), in a
    list so that ``browser`` can start another if it ever died."""
    running: list[Chromium] = []
    yield running
    for c in running:
        c.close()


@pytest.fixture
def browser(chromium: str, _chromium_process: list[Chromium]) -> Iterator[Browser]:
    """A page of its own in a browser context of its own (cookies, storage, cache) of the
    session's Chromium."""
    if not _chromium_process or not _chromium_process[0].alive():
        if _chromium_process:
            _chromium_process.pop().close()
        _chromium_process.append(Chromium(chromium))
    b = Browser(_chromium_process[0])
    try:
        yield b
    finally:
        b.close()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start mypy (``test_static.test_mypy_strict``) in the background as soon as the session knows
    it will run it, so its ~25 s of CPU overlap the rest of the suite (see ``tests/test_static.py``).
    Not in an xdist worker: each collects every test, and only one runs it (then, in the foreground)."""
    from tests import test_static

    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    if not session.config.option.collectonly and any(
        item.nodeid.endswith(test_static.MYPY_TEST) for item in session.items
    ):
        test_static.start_mypy()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests import test_static

    test_static.stop_mypy()


# Set on a machine known to have no Landlock, to skip the sandbox tests that need it (see ``abi``).
NO_LANDLOCK = "AGENTLOOP_TEST_NO_LANDLOCK"


@pytest.fixture
def abi() -> int:
    """The machine's Landlock ABI, for the Shell sandbox's tests; a failure when there is none,
    unless the machine is declared to have none (then a skip that says so)."""
    from agentloop.tools import sandbox

    version, why = sandbox.landlock_status()
    if version >= 1:
        return version
    if os.environ.get(NO_LANDLOCK) == "1":
        pytest.skip(f"{NO_LANDLOCK}=1: this machine has no Landlock ({why})")
    pytest.fail(f"Landlock is not available ({why}); set {NO_LANDLOCK}=1 only on a machine known to have none")
