"""A user's first hour with ``agentloop chat`` and ``agentloop run``: what went wrong before the
first answer (a hosted model without its key, a model picked long ago in the environment, a
database that cannot be opened, an empty ``--data``) and a path pasted with its quotes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from agentloop.cli.main import app
from agentloop.events import StreamError
from agentloop.messages import FileContent, UserMessage, user
from agentloop.models.base import Model, ModelRequest
from agentloop.models.registry import register_provider
from agentloop.models.scripted import ScriptedModel

runner = CliRunner()
KEYS = ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL")
KEYS += ("GEMINI_API_KEY", "GOOGLE_API_KEY", "GEMINI_BASE_URL")


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No user config, no model, key or data directory from the environment."""
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG", "AGENTLOOP_DATA", *KEYS):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    return workspace


def script(path: Path, replies: list[Any]) -> str:
    path.write_text(json.dumps({"replies": replies}))
    return f"scripted:{path}"


def invoke(args: list[str], stdin: str = "") -> Any:
    result = runner.invoke(app, args, input=stdin)
    assert "Traceback" not in result.stderr
    return result


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


# ---------------------------------------------------------------------------------- a hosted model without its key


@pytest.mark.parametrize(
    ("spec", "variable"),
    [
        ("openai:gpt-4o-mini", "OPENAI_API_KEY"),
        ("anthropic:claude-haiku-4-5", "ANTHROPIC_API_KEY"),
        ("gemini:gemini-2.5-flash", "GEMINI_API_KEY"),
    ],
)
async def test_a_missing_api_key_is_named_in_the_error_not_masked(spec: str, variable: str) -> None:
    """The error once said ``no OpenAI API key: *** OPENAI_API_KEY``: the credential masking took
    ``key: set`` for a key and its value, and hid the one word that said what to do."""
    from agentloop.models.registry import resolve_model

    model: Model = resolve_model(spec)
    events = [e async for e in model.stream(ModelRequest(system_prompt="", messages=[user("hi")], tools=[]))]
    last = events[-1]
    assert isinstance(last, StreamError) and last.kind == "auth"
    message = last.message.error_message or ""
    assert "***" not in message and f"set {variable}" in message


@pytest.mark.parametrize("how", [["run", "hi"], ["chat", "--memory"], ["chat"]])
def test_a_hosted_model_without_a_key_is_refused_before_the_first_message(
    tmp_path: Path, ws: Path, how: list[str]
) -> None:
    """Before, the chat started, greeted, and failed every message with the same error."""
    data = ["--data", str(tmp_path / "data")] if how == ["chat"] else []
    result = invoke([*how, "-m", "openai:gpt-4o-mini", "-w", str(ws), *data], "hello\n")
    assert result.exit_code == 1, result.stderr
    assert error_lines(result.stderr) == [
        "error: openai:gpt-4o-mini (from --model) cannot be used here (needs OPENAI_API_KEY or OPENAI_BASE_URL); "
        "pick another with --model (agentloop models lists them)"
    ]
    assert "conversation" not in result.stderr  # no chat was started


def test_with_a_fallback_the_keyless_model_is_left_to_fail_over(tmp_path: Path, ws: Path) -> None:
    result = invoke(
        [
            "run",
            "-m",
            "openai:gpt-4o-mini",
            "-w",
            str(ws),
            "--fallback",
            script(tmp_path / "s.json", ["fell back"]),
            "hi",
        ]
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "fell back\n"


def test_a_conversation_whose_own_model_lost_its_key_still_opens(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refusing to open it would leave no way to ``/model`` it back: a warning says what to do."""
    data = str(tmp_path / "data")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    first = invoke(["chat", "-m", script(tmp_path / "s.json", []), "-w", str(ws), "--data", data], "/model openai:x\n")
    assert first.exit_code == 0 and "(model set: openai:x" in first.stderr, first.stderr
    monkeypatch.delenv("OPENAI_API_KEY")
    model = script(tmp_path / "s2.json", ["back on the default"])
    again = invoke(["chat", "-m", model, "-w", str(ws), "--data", data], "/model default\nhello\n")
    assert again.exit_code == 0, again.stderr
    assert "warning: this conversation's model openai:x cannot be used here (needs OPENAI_API_KEY" in again.stderr
    assert "/model" in again.stderr and again.stdout == "back on the default\n"


# ---------------------------------------------------------------------------------- where the model came from


def test_an_unusable_model_from_the_environment_or_the_config_file_says_so(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``unknown provider 'nosuch'`` alone sent the user looking at the command they typed."""
    monkeypatch.setenv("AGENTLOOP_MODEL", "gpt-4o")
    from_env = invoke(["chat", "--memory", "-w", str(ws)], "hi\n")
    assert from_env.exit_code == 1
    assert error_lines(from_env.stderr) == [
        "error: model must look like 'provider:model', got 'gpt-4o' (the model comes from AGENTLOOP_MODEL)"
    ]
    monkeypatch.delenv("AGENTLOOP_MODEL")
    config = tmp_path / "config.toml"
    config.write_text('model = "nosuch:x"\n')
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(config))
    from_file = invoke(["run", "-w", str(ws), "hi"])
    assert from_file.exit_code == 1
    [line] = error_lines(from_file.stderr)
    assert line.startswith("error: unknown provider 'nosuch'") and line.endswith(f"from config file {config})")
    typed = invoke(["run", "-m", "nosuch:x", "-w", str(ws), "hi"])  # typed just now: nothing to add
    assert error_lines(typed.stderr) and "comes from" not in typed.stderr


# ---------------------------------------------------------------------------------- the data directory


def test_a_database_that_cannot_be_opened_is_one_plain_line(tmp_path: Path, ws: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "agentloop.db").write_text("not a database, just some text " * 10)
    result = invoke(["chat", "-m", script(tmp_path / "s.json", ["x"]), "-w", str(ws), "--data", str(data)], "hi\n")
    assert result.exit_code == 1
    assert error_lines(result.stderr) == [
        f"error: cannot open the database {data / 'agentloop.db'}: file is not a database"
    ]


def test_an_empty_data_path_is_refused_instead_of_filling_the_current_directory(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--data "$DIR"`` with DIR unset put the database, the chat state and the typed history in
    whatever directory the user stood in."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    result = invoke(["chat", "-m", script(tmp_path / "s.json", ["x"]), "-w", str(ws), "--data", ""], "hi\n")
    assert result.exit_code == 2
    assert "Invalid value for '--data': is empty: name a directory" in result.stderr
    assert list(here.iterdir()) == []
    for command in (["serve"], ["account", "list"]):  # (the other commands that keep data)
        refused = invoke([*command, "--data", " "])
        assert refused.exit_code == 2 and "'--data': is empty" in refused.stderr, refused.stderr
    assert list(here.iterdir()) == []


# ---------------------------------------------------------------------------------- /attach


@pytest.mark.parametrize("quoting", ["'{}'", '"{}"', "escaped", "{}"])
def test_attach_takes_a_path_as_a_terminal_pastes_it(tmp_path: Path, ws: Path, quoting: str) -> None:
    """A file dropped on a terminal arrives quoted (or its spaces escaped); ``/attach`` refused it
    as ``'my notes.txt' is not a file``."""
    seen: list[ModelRequest] = []

    def answer(request: ModelRequest) -> str:
        seen.append(request)
        return "read it"

    register_provider("review6attach", lambda _id: ScriptedModel(answer))
    path = ws / "my notes.txt"
    path.write_text("remember the milk\n")
    pasted = str(path).replace(" ", "\\ ") if quoting == "escaped" else quoting.format(path)
    result = invoke(
        ["chat", "--memory", "-m", "review6attach:x", "-w", str(ws)], f"/attach {pasted} \nwhat is in it?\n"
    )
    assert result.exit_code == 0, result.stderr
    assert "(attached my notes.txt (text/plain, 18 bytes)" in result.stderr
    [message] = [m for m in seen[0].messages if isinstance(m, UserMessage)]
    [block] = [b for b in message.content if isinstance(b, FileContent)]
    assert block.name == "my notes.txt"


def test_attach_still_takes_a_file_whose_name_has_quotes(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ws)
    (ws / "'odd'").write_text("x\n")
    register_provider("review6odd", lambda _id: ScriptedModel(["ok"]))
    result = invoke(
        ["chat", "--memory", "-m", "review6odd:x", "-w", str(ws)], "/attach 'odd'\n/attach ~nosuchuser6/'a b'\n"
    )
    assert "(attached 'odd' (text/plain, 2 bytes)" in result.stderr
    assert "~nosuchuser6 names no user on this machine" in result.stderr
