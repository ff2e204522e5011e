"""Ways out of the Shell sandbox (tools/sandbox.py) found in review, each closed: what runs before
the command is confined must not be writable by a command (the wrapper's own file, the interpreter);
``workspace-offline`` must stop the TCP that Landlock's connect rule does not see (Multipath TCP,
TCP Fast Open, io_uring); a workspace root reached through a symlink a command could have swapped in
is refused. The machine needs Landlock, as for tests/test_shell_sandbox.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentloop.tools import sandbox
from agentloop.tools.base import ToolError
from agentloop.tools.shell import run_shell
from tests.conftest import NO_LANDLOCK
from tests.test_tools_shell import text


@pytest.fixture
def abi() -> int:
    version, why = sandbox.landlock_status()
    if version < 1 and os.environ.get(NO_LANDLOCK) == "1":
        pytest.skip(f"{NO_LANDLOCK}=1: this machine has no Landlock ({why})")
    assert version >= 1, f"Landlock is not available ({why})"
    return version


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "ws" / "sub").mkdir(parents=True)
    return (tmp_path / "ws").resolve()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    (tmp_path / "outside").mkdir()
    return (tmp_path / "outside").resolve()


#: what a command writes over the wrapper (or the interpreter) to run the next command unconfined
_UNCONFINED_WRAPPER = "import os, sys\nargs = sys.argv[sys.argv.index('--') + 1 :]\nos.execv(args[0], args)\n"
_UNCONFINED_PYTHON = '#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done\nshift\nexec "$@"\n'


async def test_a_command_cannot_rewrite_the_wrapper_of_the_next(
    abi: int, root: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An editable install in the workspace (agentloop working on itself): ``sandbox.py`` lies where
    commands may write. The wrapper is run from the text the runtime imported, not from the file."""
    copy = root / "sandbox.py"
    copy.write_text(Path(sandbox.__file__).read_text())
    monkeypatch.setattr(sandbox, "__file__", str(copy))
    first = await run_shell(root, f"printf '%s' \"{_UNCONFINED_WRAPPER}\" > sandbox.py", sandbox="workspace")
    assert not first.is_error and copy.read_text() == _UNCONFINED_WRAPPER, text(first)
    result = await run_shell(root, f"echo x > '{outside}/escaped'", sandbox="workspace")
    assert result.is_error and not (outside / "escaped").exists(), text(result)


async def test_a_command_cannot_swap_the_interpreter_of_the_next(
    abi: int, root: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A virtual environment in the workspace: its ``bin/python`` (a symlink) may be replaced by a
    command. The wrapper runs on the real interpreter, resolved before any command ran."""
    venv_python = root / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(os.path.realpath(sys.executable))
    monkeypatch.setattr(sys, "executable", str(venv_python))
    monkeypatch.setattr(sys, "_base_executable", str(venv_python), raising=False)
    clear = getattr(sandbox, "_interpreter", None)  # (the resolved interpreter, cached)
    clear = clear.cache_clear if clear is not None else lambda: None
    clear()
    try:
        swap = (
            f"rm .venv/bin/python && printf '%s' '{_UNCONFINED_PYTHON}' > .venv/bin/python && chmod +x .venv/bin/python"
        )
        first = await run_shell(root, swap, sandbox="workspace")
        assert not first.is_error and not venv_python.is_symlink(), text(first)
        result = await run_shell(root, f"echo x > '{outside}/escaped'", sandbox="workspace")
        assert result.is_error and not (outside / "escaped").exists(), text(result)
    finally:
        clear()


async def test_no_sandbox_where_its_python_is_writable(abi: int) -> None:
    """A workspace that holds the interpreter's standard library (a Python installed in it, or a
    workspace of ``~`` or ``/``): a command could change what confines the next one, so none runs."""
    stdlib = Path(os.path.realpath(sysconfig.get_paths()["stdlib"]))
    with pytest.raises(sandbox.Unconfinable, match="lies beneath"):
        sandbox.wrapper_argv("workspace", [stdlib.parent], ["/bin/true"])
    with pytest.raises(ToolError, match="was not run: the sandbox cannot be set up"):
        await run_shell(stdlib, "echo x > escaped", sandbox="workspace")
    with pytest.raises(sandbox.Unconfinable):
        sandbox.wrapper_argv("workspace", ["/"], ["/bin/true"])


# -- workspace-offline: TCP by other ways than connect() -------------------------------------------


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.5)
    yield server
    server.close()


def _accepted(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
    except TimeoutError:
        return False
    return True


_PROBE = """
import ctypes, socket, sys
port = int(sys.argv[1])
def attempt(name, fn):
    try:
        fn(); print(name, "ok")
    except OSError as exc:
        print(name, exc.errno)
def mptcp():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 262); s.settimeout(2); s.connect(("127.0.0.1", port))
def mptcp_listen():
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM, 262); s.bind(("::1", 0)); s.listen()
def fastopen():
    s = socket.socket(); s.sendto(b"x", socket.MSG_FASTOPEN, ("127.0.0.1", port))
def io_uring():
    libc = ctypes.CDLL(None, use_errno=True); params = ctypes.create_string_buffer(120)
    if libc.syscall(425, 4, params) < 0:
        raise OSError(ctypes.get_errno(), "io_uring_setup")
def udp():
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", port))
for fn in (mptcp, mptcp_listen, fastopen, io_uring, udp):
    attempt(fn.__name__, fn)
"""


def _probe(result_text: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in result_text.splitlines() if " " in line and not line.startswith("["))


async def test_offline_stops_tcp_that_landlock_does_not_see(abi: int, root: Path, listener: socket.socket) -> None:
    """Landlock's TCP rules apply to ``IPPROTO_TCP`` sockets and to ``connect``/``bind``: a Multipath
    TCP socket (which falls back to TCP with any server), a ``sendto(MSG_FASTOPEN)`` (a connect
    without ``connect``) and io_uring got past them. Offline refuses them too (seccomp); UDP stays."""
    if abi < 4:
        pytest.skip("no TCP rules before Landlock ABI 4")
    port = listener.getsockname()[1]
    (root / "probe.py").write_text(_PROBE)
    command = f"{sys.executable} -I probe.py {port}"
    unconfined = _probe(text(await run_shell(root, command, sandbox="workspace")))
    assert unconfined["fastopen"] == "ok" and _accepted(listener), unconfined  # (what offline must stop)
    while _accepted(listener):
        pass
    confined = _probe(text(await run_shell(root, command, sandbox="workspace-offline")))
    assert not _accepted(listener), confined
    denied = str(13)  # EACCES
    assert confined["fastopen"] == denied and confined["io_uring"] == denied, confined
    if unconfined["mptcp"] == "ok":  # (a kernel with MPTCP: the way out that was)
        assert confined["mptcp"] == denied and confined["mptcp_listen"] == denied, confined
    assert confined["udp"] == "ok", confined  # (not TCP: not confined, as documented)


# -- the workspace root: a symlink a command swapped in --------------------------------------------


async def test_a_root_swapped_for_a_symlink_is_refused(abi: int, root: Path, outside: Path) -> None:
    """A process working in ``root/sub`` (a ``cwd`` inside the server's workspace) gets its Shell
    rooted there; a command of a process rooted above it can replace ``sub`` with a symlink to any
    directory, which the next command in ``sub`` would then have been let write."""
    sub = root / "sub"
    swap = f"mv sub sub.old && ln -s '{outside}' sub"
    assert not (await run_shell(root, swap, sandbox="workspace")).is_error
    with pytest.raises(ToolError, match="reached through a symlink"):
        await run_shell(sub, "echo x > escaped", sandbox="workspace")
    assert not (outside / "escaped").exists()


def test_the_wrapper_refuses_a_writable_directory_reached_through_a_symlink(
    abi: int, root: Path, outside: Path
) -> None:
    """The same swap between the runtime's check and the wrapper's start: the wrapper checks the
    directory it opened is the one it was given."""
    (root / "link").symlink_to(outside)
    marker = outside / "ran"
    argv = sandbox.wrapper_argv("workspace", [str(root / "link")], ["/bin/sh", "-c", f"touch '{marker}'"])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == sandbox.REFUSED_STATUS and "symlink" in done.stderr and not marker.exists()
