"""The pieces the commands share since the read-through: ``listening_socket`` (``agentloop serve``
and the WhatsApp webhook) and ``_data_directory`` (chat, serve and the chat-app commands). Each
failure is one clear line, never a traceback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentloop.cli.main import app
from agentloop.sockets import listening_socket
from tests.test_channel_whatsapp import ENV, cli_env  # noqa: F401 (cli_env: a fixture)
from tests.test_cli_chat_durable import model

runner = CliRunner()


def test_a_busy_port_is_a_clear_error_and_port_0_picks_a_free_one() -> None:
    first = listening_socket("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        assert port > 0 and not first.getblocking()
        with pytest.raises(OSError, match=rf"cannot listen on 127\.0\.0\.1:{port}"):
            listening_socket("127.0.0.1", port)
        with pytest.raises(OSError, match=r"cannot listen on no-such-host\.invalid"):
            listening_socket("no-such-host.invalid", 0)
    finally:
        first.close()


def test_the_webhook_on_a_busy_port_is_one_line_and_exit_1(
    tmp_path: Path,
    cli_env: None,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    model("busy-port", ["never"])
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        where = ["-w", str(tmp_path), "--data", str(tmp_path / "data")]
        result = runner.invoke(
            app, ["whatsapp", "--allow", "15550001111", "--port", str(port), "-m", "busy-port:x", *where]
        )
    finally:
        taken.close()
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


@pytest.mark.parametrize("command", [["serve"], ["whatsapp", "--allow", "15550001111"]])
def test_a_data_path_that_is_a_file_is_one_clear_error(
    tmp_path: Path,
    cli_env: None,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    command: list[str],
) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "data").write_text("not a directory")
    model("file-data", ["never"])
    result = runner.invoke(app, [*command, "-m", "file-data:x", "-w", str(tmp_path), "--data", str(tmp_path / "data")])
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "cannot use the data directory" in result.stderr and "not a directory" in result.stderr
