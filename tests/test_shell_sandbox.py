"""The Shell sandbox (``shell_sandbox``, tools/sandbox.py): Landlock, applied by the command's own
process before it execs the shell. ``workspace``: reads anywhere, writes only beneath the workspace
and the command's private ``$TMPDIR``; ``workspace-offline``: also no TCP. Where it cannot be had, a
command that asks for it is not run.

These tests need Landlock (CI has it). On a machine known to have none, set
``AGENTLOOP_TEST_NO_LANDLOCK=1`` to skip the ones that need it; without that they fail."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.cli.config import kernel_options, load_settings, read_config_file
from agentloop.kernel import Kernel
from agentloop.models.base import ModelRequest
from agentloop.process.api import approve_everything
from agentloop.tools import sandbox, shell
from agentloop.tools.base import ToolContext, ToolError, ToolResult
from agentloop.tools.builtin import builtin_tools
from agentloop.tools.codemode import CodeMode
from agentloop.tools.shell import run_shell, shell_tool
from tests.test_background_control import Runtime
from tests.test_tools_shell import alive, pid_from, text, wait_dead


@pytest.fixture
def root(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    return ws.resolve()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the workspace (in the same temporary directory): not writable."""
    path = tmp_path / "outside"
    path.mkdir()
    return path.resolve()


@pytest.fixture
def home_file() -> Iterator[Path]:
    """A file name in ``$HOME``, removed after the test (should the sandbox have let it through)."""
    path = Path.home() / f".agentloop-sandbox-test-{secrets.token_hex(4)}"
    yield path
    path.unlink(missing_ok=True)


def failed_with_denial(result: ToolResult) -> bool:
    return result.is_error and "Permission denied" in text(result)


def test_a_crashed_runtimes_tmpdirs_are_swept(tmp_path: Path) -> None:
    """A runtime killed while a sandboxed command ran leaves its ``$TMPDIR``: the next runtime's first
    sandboxed command removes those whose runtime is gone, and nothing else."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as living:
        try:
            target = tmp_path / "target"
            target.mkdir()
            names = {
                "dead": f"agentloop-sandbox-pid{dead_pid}-x1",
                "living": f"agentloop-sandbox-pid{living.pid}-x2",
                "mine": f"agentloop-sandbox-pid{os.getpid()}-x3",
                "older name": "agentloop-sandbox-12345678",
                "other": "unrelated",
            }
            for name in names.values():
                (tmp_path / name).mkdir()
            (tmp_path / names["dead"] / "left.txt").write_text("x")
            (tmp_path / f"agentloop-sandbox-pid{dead_pid}-link").symlink_to(target)
            shell.sweep_stale_tmp(str(tmp_path))
        finally:
            living.kill()
    assert not (tmp_path / names["dead"]).exists()
    assert all((tmp_path / names[key]).is_dir() for key in ("living", "mine", "older name", "other"))
    assert target.is_dir() and (tmp_path / f"agentloop-sandbox-pid{dead_pid}-link").is_symlink()  # (not followed)


# -- workspace: what may be written and what may not ---------------------------------------------


async def test_writes_inside_the_workspace_and_its_tmpdir(abi: int, root: Path) -> None:
    command = "echo hi > made && mkdir -p sub/deeper && echo x > sub/deeper/f && mv made sub/moved && cat sub/moved"
    result = await run_shell(root, command, sandbox="workspace")
    assert text(result) == "hi\n[exit code 0]" and result.details["sandbox"] == "workspace"
    assert (root / "sub" / "moved").read_text() == "hi\n" and (root / "sub/deeper/f").exists()
    result = await run_shell(root, 'f=$(mktemp) && echo t > "$f" && cat "$f" && echo "$TMPDIR"', sandbox="workspace")
    assert not result.is_error, text(result)
    lines = text(result).splitlines()
    assert lines[0] == "t"
    tmpdir = Path(lines[1])
    assert tmpdir.name.startswith(f"agentloop-sandbox-pid{os.getpid()}-") and not tmpdir.exists()  # (removed)
    devices = "echo x > /dev/null && echo y >/dev/stdout && echo z >/dev/stderr && head -c1 /dev/zero | wc -c"
    ok = await run_shell(root, devices, sandbox="workspace")  # (what shells write to still works)
    assert text(ok) == "y\nz\n1\n[exit code 0]"


async def test_writes_outside_are_denied(abi: int, root: Path, outside: Path, home_file: Path) -> None:
    for target in (outside / "f", home_file, root.parent / "beside"):
        result = await run_shell(root, f"echo x > '{target}'", sandbox="workspace")
        assert failed_with_denial(result), text(result)
        assert "[sandbox workspace: commands may write only inside the workspace" in text(result)
        assert not target.exists()
    (outside / "kept").write_text("keep")
    for command in (f"rm -f '{outside}/kept'", f"truncate -s0 '{outside}/kept'", f"mkdir '{outside}/d'"):
        assert (await run_shell(root, command, sandbox="workspace")).is_error, command
    assert (outside / "kept").read_text() == "keep" and not (outside / "d").exists()


async def test_reads_outside_are_not_confined(abi: int, root: Path, outside: Path) -> None:
    (outside / "notes").write_text("readable\n")
    result = await run_shell(root, f"cat '{outside}/notes' && ls / > /dev/null && echo listed", sandbox="workspace")
    assert text(result) == "readable\nlisted\n[exit code 0]"


async def test_no_way_around_it_from_inside(abi: int, root: Path, outside: Path) -> None:
    """Children, other shells and interpreters, a new session, a symlink or a move out: all confined."""
    target = outside / "escaped"
    (root / "link").symlink_to(outside)
    (root / "mine").write_text("mine")
    tricks = [
        "cd / && touch escaped",
        f"cd '{outside}' && touch escaped",
        f"bash -c 'echo x > {target}'",
        f"sh -c 'echo x > {target}'",
        f"setsid -w sh -c 'echo x > {target}'",
        f"{sys.executable} -c \"open('{target}', 'w')\"",
        "echo x > link/escaped",
        f"mv mine '{target}'",
        f"ln mine '{target}'",
        f"cp mine '{target}'",
    ]
    for command in tricks:
        result = await run_shell(root, command, sandbox="workspace")
        assert result.is_error, (command, text(result))
        assert not target.exists(), command
    assert not Path("/escaped").exists()
    assert (root / "mine").read_text() == "mine"


async def test_the_command_keeps_its_pid_and_group(abi: int, root: Path) -> None:
    """The wrapper execs the shell: the pid the runtime records is the shell's, and stopping the
    group still takes every child with it."""
    seen: list[int] = []

    async def started(pid: int, mark: str) -> None:
        seen.append(pid)

    result = await run_shell(root, "echo $$", sandbox="workspace", started=started)
    assert text(result) == f"{seen[0]}\n[exit code 0]"
    result = await run_shell(root, "sleep 1000 & echo $! > pid; wait", timeout=0.5, sandbox="workspace")
    assert result.details["timed_out"]
    assert wait_dead(await pid_from(root / "pid"))


async def test_signals_cannot_leave_the_sandbox(abi: int, root: Path) -> None:
    """With ABI 6 a command cannot signal the runtime (or other programs of the user)."""
    if abi < 6:  # (as documented: before ABI 6 signals are not confined)
        assert not (await run_shell(root, f"kill -0 {os.getpid()}", sandbox="workspace")).is_error
        return
    result = await run_shell(root, f"kill -0 {os.getpid()}", sandbox="workspace")
    assert result.is_error and "Operation not permitted" in text(result)
    assert not (await run_shell(root, f"kill -0 {os.getpid()}")).is_error  # (without a sandbox it may)
    result = await run_shell(root, "sleep 5 & kill $! && wait $!; echo $?", sandbox="workspace")
    assert text(result) == "143\n[exit code 0]"  # (its own children it may)


async def test_a_background_job_is_sandboxed(abi: int, root: Path, outside: Path) -> None:
    rt = Runtime()
    shell_ = shell_tool(root, sandbox="workspace")
    result = await shell_.run(
        shell_.validate({"command": f"echo in > inside; echo x > '{outside}/f'; echo rc=$?", "background": True}),
        rt.ctx(),
    )
    assert "Started in the background" in text(result)
    await rt.settle()
    [end] = rt.ends
    assert "Permission denied" in end and "rc=1" in end
    assert (root / "inside").exists() and not (outside / "f").exists()


async def test_kernel_open_confines_shell_in_every_process(abi: int, tmp_path: Path, outside: Path) -> None:
    """``Kernel.open(shell_sandbox=...)``: the shared Shell and one rooted at a process's own cwd."""
    ws = tmp_path / "kws"
    project = tmp_path / "project"
    ws.mkdir()
    project.mkdir()
    command = f"echo a > here; echo b > '{outside}/there'; echo c > '{ws}/ws_file'; ls"

    def brain(r: ModelRequest) -> object:
        if r.messages[-1].role == "user":
            return Reply(tool_calls=[call("Shell", command=command)])
        return "done"

    async with Kernel.open(
        f"sqlite:///{tmp_path}/k.db",
        model=ScriptedModel(brain),
        workspace=ws,
        approval=approve_everything,
        shell_sandbox="workspace",
    ) as k:
        shared = await k.spawn(owner="a", text="go")
        await shared.wait_idle()
        [first] = [m.text for m in await shared.messages() if m.role == "toolResult"]
        own = await k.spawn(owner="a", text="go", cwd=project)
        await own.wait_idle()
        [second] = [m.text for m in await own.messages() if m.role == "toolResult"]
    assert "there: Permission denied" in first and (ws / "here").exists() and (ws / "ws_file").exists()
    assert "ws_file: Permission denied" in second and (project / "here").exists()
    assert not (outside / "there").exists() and not (project / "ws_file").exists()


async def test_codemode_programs_are_sandboxed_too(abi: int, root: Path, outside: Path) -> None:
    """CodeMode's program is Python running as the server's user: under ``shell_sandbox`` it gets
    the same sandbox (and its nested ``shell`` calls the sandboxed Shell)."""
    [code_mode] = [t for t in builtin_tools(root, codemode=True, shell_sandbox="workspace") if t.name == "CodeMode"]
    assert isinstance(code_mode, CodeMode) and "runs in a sandbox" in code_mode.description
    program = f"""
open("inside", "w").write("ok")
try:
    open("{outside}/direct", "w")
except PermissionError as exc:
    print("direct:", exc.strerror)
print(await shell(command="echo x > {outside}/nested"))
"""
    result = await code_mode.run(code_mode.validate({"code": program}), ToolContext("1", "CodeMode"))
    assert "direct: Permission denied" in text(result) and "nested: Permission denied" in text(result)
    assert (root / "inside").read_text() == "ok"
    assert not (outside / "direct").exists() and not (outside / "nested").exists()
    plain = CodeMode(builtin_tools(root), cwd=root)  # (off: as ever)
    result = await plain.run(plain.validate({"code": f'open("{outside}/direct", "w")'}), ToolContext("1", "CodeMode"))
    assert not result.is_error and (outside / "direct").exists()


# -- workspace-offline ---------------------------------------------------------------------------


@pytest.fixture
def listening() -> Iterator[int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


async def test_offline_blocks_tcp_connect_and_bind(abi: int, root: Path, listening: int) -> None:
    connect = f"exec 3<>/dev/tcp/127.0.0.1/{listening} && echo connected"
    bind = f"{sys.executable} -c \"import socket; socket.socket().bind(('127.0.0.1', 0)); print('bound')\""
    for mode in ("off", "workspace"):
        assert text(await run_shell(root, connect, sandbox=mode)) == "connected\n[exit code 0]", mode
        assert text(await run_shell(root, bind, sandbox=mode)) == "bound\n[exit code 0]", mode
    if abi < 4:  # (TCP rules came with ABI 4: before, the offline mode refuses to run anything)
        with pytest.raises(ToolError, match="needs Landlock ABI 4"):
            await run_shell(root, connect, sandbox="workspace-offline")
        return
    result = await run_shell(root, connect, sandbox="workspace-offline")
    assert failed_with_denial(result) and "no TCP connections" in text(result)
    result = await run_shell(root, bind, sandbox="workspace-offline")
    assert result.is_error and "PermissionError" in text(result)
    result = await run_shell(root, f"echo ok > f && echo x > '{root.parent}/f'", sandbox="workspace-offline")
    assert failed_with_denial(result) and (root / "f").exists() and not (root.parent / "f").exists()


# -- off, bad modes, no Landlock ------------------------------------------------------------------


async def test_off_changes_nothing(root: Path, outside: Path) -> None:
    for result in (
        await run_shell(root, f"echo x > '{outside}/f' && echo $TMPDIR-", sandbox="off"),
        await run_shell(root, f"echo x > '{outside}/g' && echo $TMPDIR-"),
    ):
        assert not result.is_error and "sandbox" not in result.details
        assert text(result) == f"{os.environ.get('TMPDIR', '')}-\n[exit code 0]"
    assert (outside / "f").exists() and (outside / "g").exists()
    assert "sandbox" not in shell_tool(root).description
    assert "write only inside the workspace" in shell_tool(root, sandbox="workspace").description


async def test_a_bad_mode_is_a_clear_error(root: Path, tmp_path: Path) -> None:
    message = (
        "shell_sandbox must be one of 'off', 'workspace', 'workspace-offline', 'private', 'private-offline', "
        "got 'strict'"
    )
    with pytest.raises(ValueError, match=message):
        shell_tool(root, sandbox="strict")
    with pytest.raises(ValueError, match=message):
        builtin_tools(root, shell_sandbox="strict")
    with pytest.raises(ValueError, match=message):
        builtin_tools(root, shell=False, shell_sandbox="strict")
    with pytest.raises(ValueError, match=message):
        await run_shell(root, "true", sandbox="strict")
    with pytest.raises(ValueError, match="got True"):
        sandbox.check_mode(True)
    with pytest.raises(ValueError, match=message):
        async with Kernel.open(f"sqlite:///{tmp_path}/k.db", workspace=root, shell_sandbox="strict"):
            pass
    with pytest.raises(ValueError, match="shell_sandbox is for the built-in tools"):
        async with Kernel.open(f"sqlite:///{tmp_path}/k.db", tools=[shell_tool(root)], shell_sandbox="workspace"):
            pass


def test_the_config_file_key(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('shell_sandbox = "workspace-offline"\n')
    file, warnings = read_config_file(path)
    assert file.shell_sandbox == "workspace-offline" and not file.errors and not warnings
    settings = load_settings(env={"AGENTLOOP_CONFIG": str(path)})
    assert settings.shell_sandbox == "workspace-offline" and not settings.errors
    assert kernel_options(settings)["shell_sandbox"] == "workspace-offline"
    for bad in ('"on"', "true", '["workspace"]'):
        path.write_text(f"shell_sandbox = {bad}\n")
        file, _ = read_config_file(path)
        assert file.shell_sandbox == "off"
        assert "shell_sandbox must be one of 'off', 'workspace', 'workspace-offline'" in file.errors["shell_sandbox"]
        settings = load_settings(env={"AGENTLOOP_CONFIG": str(path)})
        assert any("shell_sandbox must be one of" in e for e in settings.errors)  # (the loop commands stop: exit 2)
    path.write_text("")
    settings = load_settings(env={"AGENTLOOP_CONFIG": str(path)})
    assert settings.shell_sandbox == "off" and "shell_sandbox" not in kernel_options(settings)


@pytest.fixture
def no_landlock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "landlock_status", lambda: (0, "Landlock is disabled for this test"))
    monkeypatch.setattr(shell, "_warned", set())


async def test_without_landlock_a_sandboxed_command_is_refused(
    no_landlock: None, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="agentloop.tools.shell"):
        tool = shell_tool(root, sandbox="workspace")
        builtin_tools(root, shell_sandbox="workspace")
    [warning] = [r.getMessage() for r in caplog.records]
    assert "shell_sandbox = 'workspace' is not available (Landlock is disabled for this test)" in warning
    reason = (
        "the command was not run: the Shell sandbox (shell_sandbox = 'workspace') is not available on this "
        "machine: Landlock is disabled for this test"
    )
    with pytest.raises(ToolError, match=re.escape(reason)):
        await tool.run(tool.validate({"command": "touch ran"}), ToolContext("1", "Shell"))
    rt = Runtime()
    with pytest.raises(ToolError, match="the command was not run"):  # (background: refused before a job is made)
        await tool.run(tool.validate({"command": "touch ran", "background": True}), rt.ctx())
    assert rt.tasks == set() and rt.registry.of("p").all() == []
    code_mode = CodeMode([], cwd=root, sandbox="workspace")
    with pytest.raises(ToolError, match="the program was not run: the Shell sandbox"):
        await code_mode.run(code_mode.validate({"code": 'open("ran", "w")'}), ToolContext("1", "CodeMode"))
    assert not (root / "ran").exists()
    assert not (await run_shell(root, "touch ran")).is_error  # (off: runs as ever)


async def test_without_landlock_a_kernel_warns_once_and_refuses(
    no_landlock: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def brain(r: ModelRequest) -> object:
        if r.messages[-1].role == "user":
            return Reply(tool_calls=[call("Shell", command="touch ran")])
        return "done"

    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="agentloop.tools.shell"):
        async with Kernel.open(
            f"sqlite:///{tmp_path}/k.db",
            model=ScriptedModel(brain),
            workspace=ws,
            approval=approve_everything,
            shell_sandbox="workspace-offline",
        ) as k:
            proc = await k.spawn(owner="a", text="go")
            await proc.wait_idle()
            [result] = [m for m in await proc.messages() if m.role == "toolResult"]
            other = await k.spawn(owner="a", text="go", cwd="sub")  # (its own Shell: no new warning)
            await other.wait_idle()
    assert len(caplog.records) == 1 and "workspace-offline" in caplog.records[0].getMessage()
    assert "the command was not run" in result.text and "Landlock is disabled for this test" in result.text
    assert not (ws / "ran").exists() and not (ws / "sub" / "ran").exists()


async def test_the_kernels_data_may_not_lie_where_sandboxed_commands_write(tmp_path: Path) -> None:
    """A command could rewrite the database, an account's policy or its MCP servers (which the
    runtime starts unconfined): with a sandbox the kernel's data lies outside the workspace, and
    outside a process's own cwd."""
    ws = tmp_path / "ws"
    ws.mkdir()
    with pytest.raises(ValueError, match="shell_sandbox needs the kernel's data outside"):
        async with Kernel.open(f"sqlite:///{ws}/k.db", workspace=ws, shell_sandbox="workspace"):
            pass
    with pytest.raises(ValueError, match="shell_sandbox needs the kernel's data outside"):
        async with Kernel.open("sqlite:///:memory:", workspace=ws, shell_sandbox="workspace"):
            pass
    async with Kernel.open(
        f"sqlite:///{tmp_path}/k.db", model=ScriptedModel(["ok"]), workspace=ws, shell_sandbox="workspace"
    ) as k:
        with pytest.raises(ValueError, match="lies in it"):
            await k.spawn(owner="a", cwd=tmp_path)
        assert [p.cwd for p in await k.processes()] == []
    async with Kernel.open(f"sqlite:///{ws}/k.db", workspace=ws):  # (no sandbox: as before)
        pass


async def test_offline_needs_abi_4(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    monkeypatch.setattr(sandbox, "landlock_status", lambda: (3, ""))
    with pytest.raises(ToolError, match=r"blocking the network needs Landlock ABI 4 .* this kernel has ABI 3"):
        await run_shell(root, "touch ran", sandbox="workspace-offline")
    assert not (root / "ran").exists()


def test_the_wrapper_fails_closed(abi: int, tmp_path: Path) -> None:
    """A sandbox the wrapper cannot set up (here: a writable directory that is not there) runs nothing."""
    marker = tmp_path / "ran"
    argv = sandbox.wrapper_argv("workspace", [tmp_path / "missing"], ["/bin/sh", "-c", f"touch '{marker}'"])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == sandbox.REFUSED_STATUS and not marker.exists()
    assert "agentloop sandbox: cannot confine the command" in done.stderr and "it was not run" in done.stderr
    assert argv[1:3] == ["-I", "-S"]  # (no site, no agentloop import: a fast start)


async def test_a_sandboxed_command_is_stopped_like_any(abi: int, root: Path) -> None:
    """Cancelling the call (an abort) kills the sandboxed group as it kills any."""
    task = asyncio.create_task(run_shell(root, "sleep 1000 & echo $! > pid; wait", timeout=100, sandbox="workspace"))
    pid = await pid_from(root / "pid")
    assert alive(pid)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert wait_dead(pid)
