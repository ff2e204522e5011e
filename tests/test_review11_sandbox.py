"""Review of the private Shell sandbox modes (tools/sandbox.py): ways a confined command could still
read what the private modes promise it cannot, or leave its confinement, and the config key that can
make the private modes moot.

- ``/dev`` was let be read whole: ``/dev/shm`` (files other programs keep in shared memory), the
  user's terminals (``/dev/pts/N``), cameras, microphones and, for root, the disks. Now only the
  devices ordinary tools use are.
- A command run by root kept root's capabilities: ``CAP_SYS_ADMIN`` or ``CAP_PERFMON`` let it read
  the runtime's ``/proc/PID/environ`` (its API keys, withheld from the command's own environment)
  and memory map despite Landlock; ``CAP_MKNOD`` let it make a device node in the workspace (a disk,
  readable and writable there); ``CAP_NET_RAW`` let an offline one craft TCP on a raw socket.
- ``shell_sandbox_read`` naming ``/`` or a directory holding the home (``~``) silently made the
  private modes read ``~/.ssh``: now a warning says so.

Real Landlock, real processes, as tests/test_sandbox_private11.py's (``AGENTLOOP_TEST_NO_LANDLOCK=1``
skips them on a machine known to have none); the capability tests need root (skipped otherwise)."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentloop.cli.config import read_config_file
from agentloop.tools import sandbox
from agentloop.tools.shell import run_shell
from tests.test_tools_shell import text

SECRET = "review11-secret-material"
# CAP_DAC_READ_SEARCH, CAP_SYS_MODULE, CAP_SYS_RAWIO, CAP_SYS_ADMIN, CAP_MKNOD, CAP_PERFMON, CAP_BPF
DROPPED = (2, 16, 17, 21, 27, 38, 39)
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="capabilities matter only to a command run by root")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws.resolve()


@pytest.fixture
def tmpdir_(tmp_path: Path) -> Path:
    path = (tmp_path / "cmdtmp").resolve()
    path.mkdir()
    return path


def wrapped(mode: str, root: Path, tmp: Path, command: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``command`` through the wrapper itself: its exit status and output."""
    argv = sandbox.wrapper_argv(mode, [root, tmp], ["/bin/bash", "-c", command])
    environment = {**os.environ, **(env or {}), "TMPDIR": str(tmp)}
    done = subprocess.run(argv, cwd=root, env=environment, capture_output=True, text=True, timeout=30, check=False)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture
def shm_secret() -> Iterator[Path]:
    """A file another program keeps in ``/dev/shm`` (shared memory: a tmpfs every process can use)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    path = Path("/dev/shm") / f"agentloop-review11-{uuid.uuid4().hex}"
    path.write_text(SECRET)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("mode", ["private", "private-offline"])
def test_private_does_not_read_shared_memory_files(
    abi: int, root: Path, tmpdir_: Path, shm_secret: Path, mode: str
) -> None:
    _, output = wrapped(mode, root, tmpdir_, f"cat '{shm_secret}'; ls /dev/shm /dev/pts")
    assert SECRET not in output
    assert f"cat: {shm_secret}: Permission denied" in output
    assert "cannot open directory '/dev/shm': Permission denied" in output


def test_private_still_has_the_ordinary_devices(abi: int, root: Path, tmpdir_: Path) -> None:
    """What shells and tools open in ``/dev`` keeps working: the null and random devices, ``/dev/fd``."""
    command = (
        "head -c 4 /dev/urandom | wc -c; head -c 4 /dev/random | wc -c; head -c 3 /dev/zero | wc -c; "
        "echo x > /dev/null && echo null-ok; echo y > /dev/stdout; echo z 2>/dev/stderr >&2; "
        "cat <(echo via-dev-fd)"
    )
    status, output = wrapped("private", root, tmpdir_, command)
    assert status == 0, output
    assert sorted(output.split()) == sorted(["4", "4", "3", "null-ok", "y", "z", "via-dev-fd"])


async def test_private_does_not_read_the_runtimes_environment(abi: int, root: Path) -> None:
    """The command's ``$PPID`` is this (the runtime's) process: its environment holds the API keys
    ``command_environment`` withholds, its memory map where its secrets lie."""
    parent = os.getpid()
    command = (
        f"for f in environ maps auxv; do cat /proc/{parent}/$f > /dev/null 2>&1 && echo $f-read || echo $f-denied; "
        "done; "
        "cat /proc/self/environ > /dev/null && echo own-environ-read"
    )
    for mode in ("private", "private-offline"):
        result = await run_shell(root, command, ".", 20, sandbox=mode)
        assert text(result).split()[:4] == ["environ-denied", "maps-denied", "auxv-denied", "own-environ-read"], mode


@root_only
@pytest.mark.parametrize("mode", sandbox.MODES[1:])
def test_root_keeps_no_capability_that_leaves_the_sandbox(abi: int, root: Path, tmpdir_: Path, mode: str) -> None:
    """CAP_SYS_ADMIN, CAP_PERFMON (ptrace reads past Landlock), CAP_SYS_MODULE (a kernel module),
    CAP_SYS_RAWIO, CAP_BPF, CAP_DAC_READ_SEARCH, CAP_MKNOD are gone; root's ordinary work stays."""
    status, output = wrapped(mode, root, tmpdir_, "grep -E '^Cap(Eff|Prm|Bnd):' /proc/self/status")
    assert status == 0, output
    sets = {line.split(":")[0]: int(line.split()[1], 16) for line in output.splitlines()}
    for name in ("CapEff", "CapPrm"):
        for cap in DROPPED:
            assert not sets[name] & (1 << cap), (name, cap, output)
        for cap in (0, 1, 3, 5, 6, 7):  # CHOWN, DAC_OVERRIDE, FOWNER, KILL, SETGID, SETUID
            assert sets[name] & (1 << cap), (name, cap, output)


@root_only
@pytest.mark.parametrize("mode", sandbox.MODES[1:])
def test_no_device_node_in_the_workspace(abi: int, root: Path, tmpdir_: Path, mode: str) -> None:
    """A device node made in the workspace would be read and written there: ``mknod disk b 8 0`` is
    the whole disk (every file on it, the home's too), ``c 1 1`` the memory."""
    _, output = wrapped(
        mode, root, tmpdir_, f"mknod '{root}/node' c 1 3 && echo made; mknod '{tmpdir_}/n2' c 1 3 && echo made"
    )
    assert "made" not in output
    assert not (root / "node").exists() and not (tmpdir_ / "n2").exists()


@root_only
@pytest.mark.parametrize("mode", ["workspace-offline", "private-offline"])
def test_offline_root_gets_no_raw_socket(abi: int, root: Path, tmpdir_: Path, mode: str) -> None:
    """A raw IP socket (or a packet socket) makes TCP by hand, past Landlock's ``connect`` rule."""
    python = sandbox.wrapper_argv(mode, [root], ["x"])[0]
    program = (
        "import socket\n"
        "for args in ((socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP), (socket.AF_PACKET, socket.SOCK_RAW, 0)):\n"
        "    try:\n        socket.socket(*args).close(); print('raw-socket')\n"
        "    except OSError as exc:\n        print('refused', exc.errno)\n"
    )
    status, output = wrapped(mode, root, tmpdir_, f'{python} -I -S -c "{program}"')
    assert status == 0, output
    assert "raw-socket" not in output and output.count("refused") == 2, output


def _config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entries: str) -> list[str]:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    path = tmp_path / "config.toml"
    path.write_text(f'shell_sandbox = "private"\nshell_sandbox_read = {entries}\n')
    file, warnings = read_config_file(path)
    assert file.errors == {}, file.errors  # (the user's explicit choice is kept: a warning, not exit 2)
    return warnings


def test_config_warns_when_shell_sandbox_read_exposes_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warnings = _config(tmp_path, monkeypatch, '["/"]')
    assert any("shell_sandbox_read" in w and "'/'" in w and "every file" in w for w in warnings), warnings


def test_config_warns_when_shell_sandbox_read_exposes_the_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for entries in ('["~"]', f'["{tmp_path}"]'):
        warnings = _config(tmp_path, monkeypatch, entries)
        assert any("shell_sandbox_read" in w and "home" in w and ".ssh" in w for w in warnings), (entries, warnings)


def test_config_does_not_warn_for_a_directory_in_the_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "home" / "docs").mkdir(parents=True)
    assert _config(tmp_path, monkeypatch, '["~/docs"]') == []
