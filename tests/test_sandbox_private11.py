"""The Shell sandbox's private modes (``shell_sandbox = "private"``, ``"private-offline"``;
tools/sandbox.py): as ``workspace`` (``-offline``), and reading confined too. A command reads only
beneath the workspace, its ``$TMPDIR``, the system's directories, the interpreter's own files and the
extra read-only directories given (``--read``, ``shell_sandbox_read``); the user's home and the rest
of ``/tmp`` answer "Permission denied", also when reached through a symlink in the workspace.

Real Landlock, real processes. These tests need Landlock, as tests/test_shell_sandbox.py's do: on a
machine known to have none, ``AGENTLOOP_TEST_NO_LANDLOCK=1`` skips them; without it they fail."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.kernel import Kernel
from agentloop.models.base import ModelRequest
from agentloop.process.api import approve_everything
from agentloop.tools import sandbox
from agentloop.tools.base import ToolContext, ToolError
from agentloop.tools.builtin import builtin_tools
from agentloop.tools.codemode import CodeMode
from agentloop.tools.shell import run_shell, shell_tool
from tests.test_tools_shell import text

SECRET = "s3cr3t-key-material"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("workspace notes\n")
    return ws.resolve()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake home beside the workspace (under /tmp, as the workspace is) with a secret in it; the
    commands' ``$HOME``."""
    path = (tmp_path / "home").resolve()
    (path / ".ssh").mkdir(parents=True)
    (path / ".ssh" / "id_rsa").write_text(SECRET)
    monkeypatch.setenv("HOME", str(path))
    return path


@pytest.fixture
def extra(tmp_path: Path) -> Path:
    """A directory beside the workspace to be let be read (``--read``)."""
    path = (tmp_path / "reference").resolve()
    path.mkdir()
    (path / "doc.txt").write_text("reference text\n")
    return path


@pytest.fixture
def tmpdir_(tmp_path: Path) -> Path:
    path = (tmp_path / "cmdtmp").resolve()
    path.mkdir()
    return path


def wrapped(mode: str, root: Path, tmp: Path, command: str, readable: tuple[Path, ...] = ()) -> tuple[int, str]:
    """Run ``command`` through the wrapper itself (no Shell tool): its exit status and output."""
    argv = sandbox.wrapper_argv(mode, [root, tmp], ["/bin/bash", "-c", command], readable)
    env = {**os.environ, "TMPDIR": str(tmp)}
    done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=30, check=False)
    return done.returncode, done.stdout + done.stderr


def test_the_private_modes_are_modes(root: Path) -> None:
    assert sandbox.MODES == ("off", "workspace", "workspace-offline", "private", "private-offline")
    assert [sandbox.is_private(m) for m in sandbox.MODES] == [False, False, False, True, True]
    assert [sandbox.is_offline(m) for m in sandbox.MODES] == [False, False, True, False, True]
    with pytest.raises(ValueError, match="'private', 'private-offline', got 'hidden'"):
        shell_tool(root, sandbox="hidden")


def test_the_workspace_modes_command_line_is_unchanged(root: Path, extra: Path) -> None:
    """``--private``/``--read`` only in the private modes: the workspace modes read everything, as before."""
    for mode, tail in (("workspace", []), ("workspace-offline", ["--offline"])):
        argv = sandbox.wrapper_argv(mode, [root], ["/bin/true"], [extra])
        assert argv[5:] == ["--write", str(root), *tail, "--", "/bin/true"]
    argv = sandbox.wrapper_argv("private-offline", [root], ["/bin/true"], [extra])
    options = argv[5 : argv.index("--")]
    assert options[:3] == ["--write", str(root), "--private"] and options[-3:] == ["--read", str(extra), "--offline"]


def test_private_runs_ordinary_tools_in_the_workspace(abi: int, root: Path, tmpdir_: Path) -> None:
    python = sandbox.wrapper_argv("private", [root], ["x"])[0]  # (the real interpreter the wrapper runs on)
    checks = [
        "cat notes.txt",
        "ls /usr/bin | grep -x bash > /dev/null && echo usr-bin-listed",  # (not -q: ls would get a SIGPIPE)
        f"{python} -c 'import json, sqlite3; print(json.dumps([1]))'",
        "printf '%s\\n' builtin-ok; type cd >/dev/null && echo type-ok",
        'echo in-tmp > "$TMPDIR/t" && cat "$TMPDIR/t" && f=$(mktemp) && echo mk > "$f" && cat "$f"',
        "echo new > made.txt && cat made.txt",
        "grep -q root /etc/passwd && echo etc-read",
    ]
    if shutil.which("git"):
        # (it warns that it cannot read ~/.gitconfig: hidden too, as it may hold credentials)
        checks.append("git --version 2>/dev/null | grep '^git version' > /dev/null && echo git-ok")
    status, output = wrapped("private", root, tmpdir_, " && ".join(checks))
    assert status == 0, output
    assert output.split() == [
        "workspace",
        "notes",
        "usr-bin-listed",
        "[1]",
        "builtin-ok",
        "type-ok",
        "in-tmp",
        "mk",
        "new",
        "etc-read",
        *(["git-ok"] if shutil.which("git") else []),
    ]


def test_private_hides_the_home_and_the_rest_of_tmp(abi: int, root: Path, tmpdir_: Path, home: Path) -> None:
    secret = home / ".ssh" / "id_rsa"
    probes = {
        "cat": f"cat '{secret}'",
        "tilde": "cat ~/.ssh/id_rsa",
        "ls": f"ls '{home}/.ssh'",
        "ls-tmp": "ls /tmp",  # (the workspace and $TMPDIR lie beneath /tmp: the rest of it stays hidden)
        "beside": f"ls '{root.parent}'",
        "python": f"{sandbox.wrapper_argv('private', [root], ['x'])[0]} -c \"open('{secret}').read()\"",
        "cd-then-cat": f"cd '{home}/.ssh' && cat id_rsa",
    }
    for name, command in probes.items():
        status, output = wrapped("private", root, tmpdir_, command)
        assert status != 0 and "Permission denied" in output, (name, output)
        assert SECRET not in output, name
    status, output = wrapped("workspace", root, tmpdir_, f"cat '{secret}' && ls /tmp > /dev/null && echo listed")
    assert (status, output) == (0, f"{SECRET}listed\n")  # (what the private mode takes away)


def test_a_symlink_in_the_workspace_does_not_reach_outside(abi: int, root: Path, tmpdir_: Path, home: Path) -> None:
    """Landlock checks the file a path resolves to, not the path: a link the command (or anyone)
    placed in the workspace opens nothing beyond it, whether it names a file or a directory."""
    (root / "key").symlink_to(home / ".ssh" / "id_rsa")
    (root / "dot-ssh").symlink_to(home / ".ssh")
    (root / "notes-link").symlink_to(root / "notes.txt")
    command = "cat notes-link; cat key; ls dot-ssh; cat dot-ssh/id_rsa; ln -s ~/.ssh/id_rsa made && cat made; true"
    status, output = wrapped("private", root, tmpdir_, command)
    assert status == 0 and output.startswith("workspace notes\n"), output
    assert SECRET not in output
    for path in ("key", "dot-ssh", "dot-ssh/id_rsa", "made"):
        assert f"{path}': Permission denied" in output or f"{path}: Permission denied" in output, (path, output)
    status, output = wrapped("workspace", root, tmpdir_, "cat key")
    assert (status, output) == (0, SECRET)  # (the links do resolve: only the sandbox stops them)


def test_an_extra_read_directory_is_readable_not_writable(
    abi: int, root: Path, tmpdir_: Path, extra: Path, home: Path
) -> None:
    command = f"cat '{extra}/doc.txt' && ls '{extra}' && echo x > '{extra}/new'"
    status, output = wrapped("private", root, tmpdir_, command, readable=(extra,))
    assert status == 1 and output.startswith("reference text\ndoc.txt\n"), output
    assert "new: Permission denied" in output and not (extra / "new").exists()
    status, output = wrapped("private", root, tmpdir_, f"rm '{extra}/doc.txt'", readable=(extra,))
    assert status != 0 and (extra / "doc.txt").exists()
    status, output = wrapped("private", root, tmpdir_, f"cat '{home}/.ssh/id_rsa'", readable=(extra,))
    assert "Permission denied" in output and SECRET not in output  # (only that directory)
    status, output = wrapped("private", root, tmpdir_, f"cat '{extra}/doc.txt'")
    assert "Permission denied" in output  # (not given: hidden as the rest)


def test_an_extra_read_directory_given_through_a_symlink_is_refused(abi: int, root: Path, tmp_path: Path) -> None:
    """A command could swap a link it may write for one to ``~/.ssh``: the wrapper fails closed."""
    link = tmp_path / "ref-link"
    link.symlink_to(root)
    marker = root / "ran"
    argv = sandbox.wrapper_argv("private", [root], ["/bin/sh", "-c", f"touch '{marker}'"], [link])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == sandbox.REFUSED_STATUS and not marker.exists()
    assert "is reached through a symlink" in done.stderr and "it was not run" in done.stderr
    argv = sandbox.wrapper_argv("workspace", [root], ["/bin/true"])
    at = argv.index("--")  # (a --read without --private: reading would not be confined, so nothing runs)
    done = subprocess.run([*argv[:at], "--read", "/usr", *argv[at:]], capture_output=True, text=True, check=False)
    assert done.returncode == sandbox.REFUSED_STATUS and "--read confines reading only with --private" in done.stderr


async def test_the_shell_tool_in_private_mode(abi: int, root: Path, home: Path, extra: Path) -> None:
    tool = shell_tool(root, sandbox="private", sandbox_read=[extra])
    assert "can read only the workspace, $TMPDIR and the system's directories" in tool.description
    assert str(extra) in tool.description and "cannot open TCP" not in tool.description
    ctx = ToolContext("1", "Shell")
    result = await tool.run(tool.validate({"command": f"cat notes.txt '{extra}/doc.txt'"}), ctx)
    assert text(result) == "workspace notes\nreference text\n[exit code 0]"
    assert result.details["sandbox"] == "private"
    result = await tool.run(tool.validate({"command": "cat ~/.ssh/id_rsa"}), ctx)
    assert result.is_error and "Permission denied" in text(result) and SECRET not in text(result)
    assert "[sandbox private: commands may write only inside the workspace and $TMPDIR; they may read only" in text(
        result
    )
    result = await tool.run(tool.validate({"command": f"echo x > '{extra}/w'"}), ctx)
    assert result.is_error and not (extra / "w").exists()
    plain = shell_tool(root, sandbox="workspace")  # (the workspace mode still reads everything)
    result = await plain.run(plain.validate({"command": "cat ~/.ssh/id_rsa"}), ctx)
    assert text(result) == f"{SECRET}\n[exit code 0]"
    assert "they can read everything but write only inside" in plain.description


@pytest.fixture
def listening() -> Iterator[int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


async def test_private_offline_also_refuses_tcp(abi: int, root: Path, home: Path, listening: int) -> None:
    connect = f"exec 3<>/dev/tcp/127.0.0.1/{listening} && echo connected"
    assert text(await run_shell(root, connect, sandbox="private")) == "connected\n[exit code 0]"
    if abi < 4:  # (TCP rules came with ABI 4: before, an offline mode refuses to run anything)
        with pytest.raises(ToolError, match="needs Landlock ABI 4"):
            await run_shell(root, connect, sandbox="private-offline")
        return
    result = await run_shell(root, connect, sandbox="private-offline")
    assert result.is_error and "Permission denied" in text(result) and "no TCP connections" in text(result)
    result = await run_shell(root, "cat notes.txt; cat ~/.ssh/id_rsa", sandbox="private-offline")
    assert text(result).startswith("workspace notes\n") and "id_rsa: Permission denied" in text(result)
    tool = shell_tool(root, sandbox="private-offline")
    assert "can read only the workspace" in tool.description and "cannot open TCP" in tool.description


async def test_private_offline_needs_abi_4(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    monkeypatch.setattr(sandbox, "landlock_status", lambda: (3, ""))
    with pytest.raises(ToolError, match=r"blocking the network needs Landlock ABI 4 .* this kernel has ABI 3"):
        await run_shell(root, "touch ran", sandbox="private-offline")
    assert not (root / "ran").exists()


async def test_codemode_programs_are_confined_to_reading_the_workspace(abi: int, root: Path, home: Path) -> None:
    """CodeMode's runner (the package's file, outside the workspace) still runs; the program reads
    as a Shell command does."""
    [code_mode] = [t for t in builtin_tools(root, codemode=True, shell_sandbox="private") if t.name == "CodeMode"]
    assert isinstance(code_mode, CodeMode)
    program = f"""
print(open("notes.txt").read().strip())
try:
    open("{home}/.ssh/id_rsa").read()
except PermissionError as exc:
    print("direct:", exc.strerror)
print(await shell(command="cat ~/.ssh/id_rsa"))
"""
    result = await code_mode.run(code_mode.validate({"code": program}), ToolContext("1", "CodeMode"))
    assert "workspace notes" in text(result) and "direct: Permission denied" in text(result), text(result)
    assert "id_rsa: Permission denied" in text(result) and SECRET not in text(result)


async def test_codemode_programs_read_the_extra_directories(abi: int, root: Path, home: Path, extra: Path) -> None:
    """The directories ``shell_sandbox_read`` adds are readable by the program itself too, not only by its
    ``shell()`` calls; the rest of the home stays hidden."""
    tools = builtin_tools(root, codemode=True, shell_sandbox="private", shell_sandbox_read=[extra])
    [code_mode] = [t for t in tools if t.name == "CodeMode"]
    program = f"""
print(open("{extra}/doc.txt").read().strip())
try:
    open("{home}/.ssh/id_rsa").read()
except PermissionError as exc:
    print("direct:", exc.strerror)
"""
    result = await code_mode.run(code_mode.validate({"code": program}), ToolContext("1", "CodeMode"))
    assert (extra / "doc.txt").read_text().strip() in text(result), text(result)
    assert "direct: Permission denied" in text(result) and SECRET not in text(result)


async def test_kernel_open_takes_the_mode_and_the_read_directories(
    abi: int, tmp_path: Path, home: Path, extra: Path
) -> None:
    """``Kernel.open(shell_sandbox="private", shell_sandbox_read=[...])``: the shared Shell and one
    rooted at a process's own cwd."""
    ws = tmp_path / "kws"
    project = tmp_path / "project"
    ws.mkdir()
    project.mkdir()
    command = f"cat '{extra}/doc.txt'; cat ~/.ssh/id_rsa; ls '{ws}' > /dev/null && echo listed-ws"

    def brain(r: ModelRequest) -> object:
        if r.messages[-1].role == "user":
            return Reply(tool_calls=[call("Shell", command=command)])
        return "done"

    async with Kernel.open(
        f"sqlite:///{tmp_path}/k.db",
        model=ScriptedModel(brain),
        workspace=ws,
        approval=approve_everything,
        shell_sandbox="private",
        shell_sandbox_read=[extra],
    ) as k:
        shared = await k.spawn(owner="a", text="go")
        await shared.wait_idle()
        [first] = [m.text for m in await shared.messages() if m.role == "toolResult"]
        own = await k.spawn(owner="a", text="go", cwd=project)
        await own.wait_idle()
        [second] = [m.text for m in await own.messages() if m.role == "toolResult"]
    for result in (first, second):
        assert result.startswith("reference text\n") and "id_rsa: Permission denied" in result, result
        assert SECRET not in result
    assert "listed-ws" in first and "listed-ws" not in second  # (a process's own cwd: not the workspace)
