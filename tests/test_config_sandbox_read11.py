"""The config file's ``shell_sandbox_read`` (cli/config.py): the directories the private Shell
sandbox modes let commands read besides the workspace and the system, as ``Kernel.open``'s
``shell_sandbox_read`` does for a program. Each entry is resolved to its real path when the file is
read (the sandbox refuses a directory reached through a symlink); an entry that is not an existing
directory, a value that is not a list of paths, or the key given with a mode that reads everything
is exit 2 naming the file, the key and the entry. End to end, ``agentloop run`` and the durable
``agentloop chat`` give it to their Shell: a file there is read, one in a sibling directory not
listed answers "Permission denied".

The end-to-end tests need Landlock, as tests/test_sandbox_private11.py's do: on a machine known to
have none, ``AGENTLOOP_TEST_NO_LANDLOCK=1`` skips them; without it they fail."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentloop.cli.config import kernel_options, load_settings, read_config_file
from agentloop.cli.main import app
from agentloop.messages import TextContent, ToolResultMessage
from agentloop.models import registry
from agentloop.models.base import ModelRequest
from agentloop.models.scripted import Reply, ScriptedModel, call

SECRET = "not-for-the-agent"
runner = CliRunner()


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No user config, model or data directory from the environment; a home of the test's own."""
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG", "AGENTLOOP_DATA"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """The directory to be let be read, with a document in it."""
    path = (tmp_path / "shared").resolve()
    path.mkdir()
    (path / "doc.txt").write_text("shared reference\n")
    return path


@pytest.fixture
def sibling(tmp_path: Path) -> Path:
    """A directory beside ``shared``, not listed: the private modes hide it."""
    path = (tmp_path / "sibling").resolve()
    path.mkdir()
    (path / "secret.txt").write_text(SECRET)
    return path


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    path = (tmp_path / "ws").resolve()
    path.mkdir()
    return path


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def settings_for(path: Path) -> tuple[list[str], tuple[Path, ...]]:
    settings = load_settings(env={"AGENTLOOP_CONFIG": str(path)})
    return settings.errors, settings.shell_sandbox_read


# ---------------------------------------------------------------------------------- the key


def test_the_key_is_read_and_each_directory_resolved(tmp_path: Path, shared: Path, sibling: Path) -> None:
    """A symlinked directory becomes its target, ``~`` the home; both reach the kernel's options."""
    link = tmp_path / "docs-link"
    link.symlink_to(shared)
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    path = write_config(tmp_path, f'shell_sandbox = "private"\nshell_sandbox_read = ["{link}", "~/notes"]\n')
    file, warnings = read_config_file(path)
    assert not file.errors and not warnings
    assert file.shell_sandbox_read == (shared, (home / "notes").resolve())
    errors, readable = settings_for(path)
    assert not errors and readable == (shared, (home / "notes").resolve())
    options = kernel_options(load_settings(env={"AGENTLOOP_CONFIG": str(path)}))
    assert options["shell_sandbox"] == "private"
    assert options["shell_sandbox_read"] == (shared, (home / "notes").resolve())


def test_without_the_key_nothing_is_added(tmp_path: Path) -> None:
    path = write_config(tmp_path, 'shell_sandbox = "private-offline"\n')
    errors, readable = settings_for(path)
    assert not errors and readable == ()
    assert "shell_sandbox_read" not in kernel_options(load_settings(env={"AGENTLOOP_CONFIG": str(path)}))


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ('["{missing}"]', "shell_sandbox_read entry '{missing}': {missing} does not exist"),
        ('["{file}"]', "shell_sandbox_read entry '{file}': {file} is not a directory"),
        ('["{shared}", "{broken}"]', "shell_sandbox_read entry '{broken}': {broken} does not exist"),
        ('["relative/dir"]', "shell_sandbox_read entry 'relative/dir' must be an absolute path"),
        ('"{shared}"', "shell_sandbox_read must be a list of directory paths"),
        ("[1, 2]", "shell_sandbox_read must be a list of directory paths"),
        ("true", "shell_sandbox_read must be a list of directory paths"),
    ],
)
def test_an_unusable_entry_or_value_is_an_error_naming_the_key_and_entry(
    tmp_path: Path, shared: Path, value: str, fragment: str
) -> None:
    names = {
        "missing": tmp_path / "nowhere",
        "file": shared / "doc.txt",
        "broken": tmp_path / "dangling",
        "shared": shared,
    }
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    path = write_config(tmp_path, f'shell_sandbox = "private"\nshell_sandbox_read = {value.format(**names)}\n')
    file, _ = read_config_file(path)
    assert file.shell_sandbox_read == ()
    assert file.errors["shell_sandbox_read"].startswith(f"config file {path}: {fragment.format(**names)}")
    errors, _ = settings_for(path)
    assert any(fragment.format(**names) in e for e in errors)  # (the loop commands stop: exit 2)


@pytest.mark.parametrize("mode", ["workspace", "workspace-offline", "off", None])
def test_with_a_mode_that_reads_everything_it_is_an_error(tmp_path: Path, shared: Path, mode: str | None) -> None:
    """It would do nothing there (every file may be read already, or nothing is confined): the user
    meant a private mode, so the command stops rather than run in another."""
    line = f'shell_sandbox = "{mode}"\n' if mode else ""
    path = write_config(tmp_path, f'{line}shell_sandbox_read = ["{shared}"]\n')
    file, _ = read_config_file(path)
    shown = mode or "off"
    assert file.errors["shell_sandbox_read"] == (
        f"config file {path}: shell_sandbox_read is read only in the private modes "
        f'(shell_sandbox = "private" or "private-offline"), not \'{shown}\''
    )
    path.write_text(f"{line}shell_sandbox_read = []\n")  # (an empty list asks for nothing)
    assert read_config_file(path)[0].errors == {}


def test_a_misspelt_mode_is_the_one_error(tmp_path: Path, shared: Path) -> None:
    """``"privat"`` is the mistake to name, not the read directories it leaves without a private mode."""
    path = write_config(tmp_path, f'shell_sandbox = "privat"\nshell_sandbox_read = ["{shared}"]\n')
    file, warnings = read_config_file(path)
    assert set(file.errors) == {"shell_sandbox"}
    assert not warnings  # (a key of the file's, not an unknown one ignored)


@pytest.mark.parametrize("command", ["run", "chat"])
def test_a_bad_entry_stops_the_command_with_exit_2(tmp_path: Path, ws: Path, command: str) -> None:
    path = write_config(tmp_path, f'shell_sandbox = "private"\nshell_sandbox_read = ["{tmp_path}/nowhere"]\n')
    data = tmp_path / "data"
    args = {
        "run": ["run", "-m", "scripted:x", "-w", str(ws), "go"],
        "chat": ["chat", "-m", "scripted:x", "-w", str(ws), "--data", str(data)],
    }[command]
    result = runner.invoke(app, args, input="hello\n", env={"AGENTLOOP_CONFIG": str(path)})
    assert result.exit_code == 2, result.output
    assert f"config file {path}: shell_sandbox_read entry '{tmp_path}/nowhere'" in result.stderr
    assert not data.exists()  # (refused before anything was made)


# ---------------------------------------------------------------------------------- end to end


def shell_model(monkeypatch: pytest.MonkeyPatch, name: str, command: str) -> list[str]:
    """A provider ``name`` whose model runs ``command`` in Shell once, then answers; the outputs
    the Shell calls returned, as the model was shown them."""
    outputs: list[str] = []

    def reply(request: ModelRequest) -> Reply:
        results = [m for m in request.messages if isinstance(m, ToolResultMessage)]
        if not results:
            return Reply(tool_calls=[call("Shell", command=command)])
        outputs.extend(b.text for b in results[-1].content if isinstance(b, TextContent))
        return Reply(text="done")

    monkeypatch.setitem(registry._PROVIDERS, name, lambda _id: ScriptedModel(reply))
    return outputs


@pytest.mark.parametrize("command", ["run", "chat"])
def test_the_configured_directory_is_readable_and_its_sibling_is_not(
    abi: int,
    tmp_path: Path,
    ws: Path,
    shared: Path,
    sibling: Path,
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    """Given through a symlink in the config, as a user's ``~/docs -> /mnt/docs`` would be."""
    link = tmp_path / "home" / "docs"
    link.parent.mkdir()
    link.symlink_to(shared)
    path = write_config(tmp_path, 'shell_sandbox = "private"\nshell_sandbox_read = ["~/docs"]\n')
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(path))
    name = f"sandboxread{command}"
    shell = f"cat '{shared}/doc.txt'; cat ~/docs/doc.txt; cat '{sibling}/secret.txt'; true"
    outputs = shell_model(monkeypatch, name, shell)
    args = ["-m", f"{name}:x", "-w", str(ws), "--approval", "auto"]
    if command == "run":
        result = runner.invoke(app, ["run", *args, "go"])
    else:
        result = runner.invoke(app, ["chat", *args, "--data", str(tmp_path / "data")], input="go\n")
    assert result.exit_code == 0, result.output
    assert len(outputs) == 1, outputs
    assert outputs[0].count("shared reference") == 2, outputs[0]
    assert "secret.txt: Permission denied" in outputs[0]
    assert SECRET not in outputs[0]
