"""A new user's walk through the README's quick start, command line, server and configuration
sections: a Ctrl-C in the CLI's first second, and the wrong inputs a first hour brings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from agentloop.cli.main import app
from tests.test_cli_review6 import KEYS, _isolated, runner, script  # noqa: F401 (_isolated: autouse)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    return workspace


def invoke(args: list[str], stdin: str = "") -> Any:
    result = runner.invoke(app, args, input=stdin)
    assert "Traceback" not in result.stderr
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


# ---------------------------------------------------------------------------------- Ctrl-C at start-up


def _console_script(marker: int) -> str:
    """The program an installer writes for ``[project.scripts]`` (pip's template): it imports
    its target outside any handler of ours. A byte on ``marker`` (a pipe) says the interpreter's
    own start-up (site, before any agentloop code) is over, so the signals land in agentloop's."""
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["agentloop"]
    module, _, function = target.partition(":")
    return (
        f"import os, sys\nos.write({marker}, b'.')\nfrom {module} import {function}\n"
        f"if __name__ == '__main__':\n    sys.exit({function}())\n"
    )


def test_ctrl_c_in_the_first_second_ends_quietly(tmp_path: Path, ws: Path) -> None:
    """A Ctrl-C while the CLI was still importing (the best part of a second, before typer or a
    command could handle it) printed a KeyboardInterrupt traceback from the console script."""
    model = script(tmp_path / "s.json", ["hi"])
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    env["PYTHONPATH"] = str(ROOT / "src")
    delays = [0.1, 0.2, 0.3, 0.45, 0.65, 0.9]
    runs: list[tuple[float, subprocess.Popen[bytes], int]] = []
    for n, delay in enumerate(delays):
        marker_read, marker_write = os.pipe()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _console_script(marker_write),
                "chat",
                "-m",
                model,
                "-w",
                str(ws),
                "--data",
                str(tmp_path / f"d{n}"),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(marker_write,),
            env=env,
        )
        os.close(marker_write)
        runs.append((delay, proc, marker_read))
    started: list[float] = []
    for _, _, marker_read in runs:  # (started together: the whole test takes one start-up)
        assert os.read(marker_read, 1) == b"."
        os.close(marker_read)
        started.append(time.monotonic())
    for (delay, proc, _), start in sorted(zip(runs, started, strict=True), key=lambda r: r[1] + r[0][0]):
        time.sleep(max(0.0, start + delay - time.monotonic()))
        proc.send_signal(signal.SIGINT)
    for delay, proc, _ in runs:
        _, err = proc.communicate(timeout=30)  # (stdin closed: one at its prompt by then ends there)
        stderr = err.decode(errors="replace")
        assert "Traceback" not in stderr, (delay, stderr)
        assert proc.returncode in (0, 1, 130), (delay, proc.returncode, stderr)
        if delay == delays[0]:  # certainly still importing (that takes most of a second): stopped, and said so
            assert proc.returncode == 130, stderr
            assert stderr.strip().endswith("aborted"), stderr


def test_the_console_script_target_imports_nothing_heavy() -> None:
    """What the console script imports before ``main`` can guard it must take milliseconds: a
    Ctrl-C in it is a traceback. ``agentloop``'s own ``__init__`` imported the whole library."""
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["agentloop"]
    module = target.partition(":")[0]
    heavy = [
        "typer",
        "click",
        "rich",
        "pydantic",
        "httpx",
        "asyncio",
        "typing",
        "agentloop.agent",
        "agentloop.cli.main",
    ]
    code = f"import sys, {module}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    assert found.stdout.strip() == "[]", found.stdout + found.stderr


# ---------------------------------------------------------------------------------- closed standard streams


def test_a_closed_stdin_is_no_input_not_an_attribute_error(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``run - <&-`` said ``error: AttributeError: 'NoneType' object has no attribute 'read'``
    and ``chat <&-`` the same about ``isatty``: Python's stdin is None when fd 0 is closed (as
    here; typer's CliRunner would put its own stdin in its place, so the app is called as is)."""
    model = script(tmp_path / "s.json", ["hi"])
    outcomes: dict[str, tuple[Any, str, str]] = {}
    stand_ins: list[str] = []
    commands = {
        "run": ["run", "-m", model, "-w", str(ws), "-"],
        "chat": ["chat", "--memory", "-m", model, "-w", str(ws)],
    }
    for name, args in commands.items():
        monkeypatch.setattr(sys, "stdin", None)
        code = app(args, standalone_mode=False)
        outcomes[name] = (code, *capsys.readouterr())
        stand_in = sys.stdin
        if stand_in is not None:
            stand_ins.append(stand_in.read())  # (/dev/null: nothing)
            stand_in.close()
    run_code, _, run_err = outcomes["run"]
    assert run_code == 1 and error_lines(run_err) == ["error: empty prompt"], run_err
    chat_code, chat_out, chat_err = outcomes["chat"]
    assert chat_code == 0 and chat_out == "" and not error_lines(chat_err), chat_err  # (as at Ctrl-D)
    assert "Error" not in run_err + chat_err and "Traceback" not in run_err + chat_err
    assert stand_ins == ["", ""]


# ---------------------------------------------------------------------------------- client commands


def test_a_bad_send_mode_is_a_usage_error() -> None:
    """``send PID TEXT --mode bogus`` exited 1, as if the server had failed; a bad flag value is 2
    (the README: "2 for a bad flag or config value"), and it is refused before any connection."""
    result = invoke(["send", "p1", "hi", "--mode", "bogus", "--server", "http://127.0.0.1:9", "--token", "t"])
    assert result.exit_code == 2
    assert error_lines(result.stderr) == ["error: --mode must be steer, queue or interrupt"]


def test_send_takes_text_that_was_not_utf8_as_run_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes that are not UTF-8 (``printf '\\xff' | agentloop send PID -``, or in the argument) are
    lone surrogates in Python; ``send`` put them in its JSON and failed with ``error: 'utf-8' codec
    can't encode characters …: surrogates not allowed``. ``run -`` and the chat make them U+FFFD."""
    from agentloop.client import AgentloopClient

    sent: list[str] = []

    async def fake_send(self: AgentloopClient, pid: str, text: str, **kwargs: Any) -> dict[str, Any]:
        sent.append(text)
        return {"run_id": "r1", "queued": False}

    monkeypatch.setattr(AgentloopClient, "send", fake_send)
    result = invoke(["send", "p1", "hi \udcff there", "--server", "http://127.0.0.1:9", "--token", "t"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "r1\n" and sent == ["hi \ufffd there"]


def test_serve_chat_with_an_unknown_pid_says_so_in_plain_words(tmp_path: Path, ws: Path) -> None:
    """``serve --chat --pid nope`` said ``error: NotFound: no such process 'nope' (not_found)``:
    the client's exception, unconverted; ``chat --server URL --pid nope`` says it plainly."""
    model = script(tmp_path / "s.json", ["hi"])
    data = tmp_path / "data"
    args = ["serve", "--chat", "--pid", "nope", "--port", "0", "--data", str(data), "-m", model, "-w", str(ws)]
    result = invoke(args)
    assert result.exit_code == 1, result.stderr
    assert error_lines(result.stderr) == ["error: no such process 'nope'"], result.stderr


def test_serve_warns_of_a_model_it_has_no_key_for(tmp_path: Path, ws: Path) -> None:
    """``run`` and ``chat`` refuse a hosted model without its key before the first message;
    ``serve`` started without a word, and every message then failed. It still starts (an
    account's own model may answer), with one warning saying why and what to do."""
    args = ["serve", "--chat", "--port", "0", "--data", str(tmp_path / "data"), "-m", "openai:gpt-4o-mini"]
    result = invoke([*args, "-w", str(ws)])
    assert result.exit_code == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "openai:gpt-4o-mini (from --model) cannot be used here" in warnings[0]
    assert "OPENAI_API_KEY" in warnings[0] and "--model" in warnings[0]


# ---------------------------------------------------------------------------------- account and token


def test_a_listing_leaves_no_database_where_the_configured_store_points(tmp_path: Path) -> None:
    """With ``store = "sqlite:///…"`` in the config file and no database there yet, ``account list``
    printed nothing and left an empty database behind (where a mistyped URL pointed); without the
    key it says there is none and writes nothing, and now it does so for the configured file too."""
    database = tmp_path / "elsewhere" / "agentloop.db"
    database.parent.mkdir()
    (tmp_path / "no-config.toml").write_text(f'store = "sqlite:///{database}"\n')
    for args in (["account", "list"], ["token", "list"]):
        listing = invoke(args)
        assert listing.exit_code == 0 and listing.stdout == ""
        assert listing.stderr.startswith(f"no database at {database}: no accounts or tokens yet"), listing.stderr
    made = invoke(["token", "create", "-a", "admin"])
    assert made.exit_code == 1 and "no database at" in made.stderr
    assert list(database.parent.iterdir()) == []
    created = invoke(["account", "create", "carol"])  # (the one command that makes the database)
    assert created.exit_code == 0 and database.is_file()
    assert "carol" in invoke(["account", "list"]).stdout


def test_serve_refuses_an_empty_host_as_a_usage_error(tmp_path: Path) -> None:
    """``serve --host ""`` (``--host "$HOST"``, HOST unset) warned "listening on , not loopback",
    then failed with exit 1 and ``cannot listen on :0: [Errno -2] Name or service not known``."""
    result = invoke(["serve", "--host", " ", "--port", "0", "--data", str(tmp_path / "data")])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["error: --host is empty: name the address to listen on (default 127.0.0.1)"]
    assert not (tmp_path / "data").exists()
