"""MCP review: tool names providers refuse, an HTTP server behind headers, and
the processes a stdio server leaves behind. Real servers, as in test_mcp.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from agentloop.tools.mcp import MCPError, mcp_tools
from tests.test_mcp import SERVER, _gone, http_server, raw

pytest.importorskip("mcp")


async def test_tool_names_a_provider_refuses_become_distinct_ones_it_takes() -> None:
    """Names are cut to 64 characters and their other characters made ``_`` (what Anthropic and
    OpenAI take): two tools of one server whose names only differed there (``get.user`` and
    ``get_user``, two long names with the same first 64 characters) made the whole toolset fail
    to start, every server with it (for an account: all its servers, again every minute)."""
    async with mcp_tools([raw("odd-tools")]) as tools:
        by_remote = {getattr(t, "remote_name", None): t for t in tools}
        assert len(by_remote) == 5 and len({t.name for t in tools}) == 5
        for tool in tools:
            assert re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", tool.name), tool.name
        assert by_remote["get_user"].name == "raw__get_user"  # a name that needs nothing keeps it
        for remote, tool in by_remote.items():  # each name reaches its own tool
            answer = await tool.run({"n": 1}, None)  # type: ignore[arg-type]
            assert json.loads(answer.content[0].text) == [remote, {"n": 1}]  # type: ignore[union-attr]


async def test_a_server_over_http_with_headers_keeps_the_sdks_timeouts() -> None:
    """With ``headers`` (an Authorization header: most hosted servers) the HTTP client was a
    bare one with a 5 s read timeout: every call that took longer failed, and took the session
    down with it, whatever the server's ``timeout`` said."""
    config = {"name": "web", "headers": {"Authorization": "Bearer t"}, "timeout": 30}
    async with http_server() as url, mcp_tools([{**config, "url": url}]) as tools:
        nap = next(t for t in tools if t.name == "web__nap")
        result = await nap.run({"seconds": 6}, None)  # type: ignore[arg-type]
    assert not result.is_error and result.content[0].text.startswith("slept 6")  # type: ignore[union-attr]


def _kill_left(pid_file: Path) -> None:
    """Kill the child a test server recorded, if the test failed with it still running."""
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


_WITH_A_CHILD = (  # a server that starts a helper (a browser, a language server) and serves on
    "import subprocess, sys\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
    " stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)\n"
    "open(sys.argv[1], 'w').write(str(child.pid))\n"
    f"sys.path.insert(0, {str(Path(SERVER).parent)!r})\n"
    "from mcp_server import app\n"
    "app.run()\n"
)


async def test_stopping_a_stdio_server_stops_the_processes_it_started(tmp_path: Path) -> None:
    """The SDK kills a server's process group only when the server itself outlives its grace
    period: a server that exits when its stdin closes left its children running, one more at each
    restart or configuration change."""
    pid_file = tmp_path / "child.pid"
    config = {"name": "kid", "command": sys.executable, "args": ["-c", _WITH_A_CHILD, str(pid_file)]}
    try:
        async with mcp_tools([config]):
            child = int(pid_file.read_text())
            os.kill(child, 0)  # there while the server is
        assert await _gone(child, within=5), "the server's child outlived it"
    finally:
        _kill_left(pid_file)


async def test_a_server_that_exits_at_start_leaving_a_child_on_its_stdout_does_not_leak_it(tmp_path: Path) -> None:
    """The server exits at once, but a child it left holds its stdout open: the start waits out
    ``startup_timeout`` (nothing closes the pipe), and the child must not outlive that failure."""
    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], stdin=subprocess.DEVNULL)\n"
        "open(sys.argv[1], 'w').write(str(child.pid))\n"
        "sys.exit('no token')\n"
    )
    config = {"name": "quits", "command": sys.executable, "args": ["-c", script, str(pid_file)], "startup_timeout": 2}
    try:
        with pytest.raises(MCPError, match="'quits'"):
            async with mcp_tools([config]):
                pass
        assert await _gone(int(pid_file.read_text()), within=5), "the server's child outlived it"
    finally:
        _kill_left(pid_file)


_CHATTY = (  # a server that logs a lot to stderr, then serves
    "import sys\n"
    "line = 'debug: ' + 'x' * 1000 + '\\n'\n"
    "for _ in range(20_000):\n"
    "    sys.stderr.write(line)\n"
    "sys.stderr.write('the last line\\n')\n"
    "sys.stderr.flush()\n"
    f"sys.path.insert(0, {str(Path(SERVER).parent)!r})\n"
    "from mcp_server import app\n"
    "app.run()\n"
)


async def test_a_server_flooding_stderr_does_not_fill_the_disk() -> None:
    """A server's stderr went to a temporary file kept whole for its whole life (on a tmpfs:
    memory): a chatty server filled it, when only its last lines are ever quoted."""
    from agentloop.tools.mcp import STDERR_TAIL_BYTES, MCPConnection, MCPServerConfig

    connection = MCPConnection(MCPServerConfig(name="chatty", command=sys.executable, args=["-c", _CHATTY]))
    try:
        await connection.start()
        assert (await connection.call("add", {"a": 1, "b": 2})).content[0].text == "3"  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while os.fstat(connection._stderr.fileno()).st_size > 1 << 20 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert os.fstat(connection._stderr.fileno()).st_size <= 1 << 20  # not the 20 MB written
        assert "the last line" in connection._stderr_tail() and len(connection._stderr_tail()) <= STDERR_TAIL_BYTES
    finally:
        await connection.close()
