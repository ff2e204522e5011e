"""The chat bridges' speech-to-text from the config file: ``transcribe_model``, ``transcribe_url``
and ``transcribe_key_env`` stand in for the flags of the same name (which win, key by key), and a
problem says where it was set."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentloop.cli.channel import open_transcriber
from agentloop.cli.config import read_config_file
from agentloop.cli.main import app

KEY = "sk-transcribe-test-key"


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "config.toml"
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(path))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in ("AGENTLOOP_TRANSCRIBE_MODEL", "AGENTLOOP_TRANSCRIBE_URL", "OPENAI_BASE_URL", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    return path


def test_the_config_file_names_the_transcription_model_server_and_key(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STT_KEY", KEY)
    config.write_text(
        'transcribe_model = "openai:whisper-large-v3"\n'
        'transcribe_url = "http://127.0.0.1:9000/v1"\n'
        'transcribe_key_env = "STT_KEY"\n'
    )
    transcriber = open_transcriber(None, None, None)
    assert transcriber is not None
    assert transcriber.model_id == "whisper-large-v3"
    assert (transcriber.base_url, transcriber.key_env) == ("http://127.0.0.1:9000/v1", "STT_KEY")


def test_a_flag_wins_over_its_key_and_the_other_keys_still_apply(config: Path) -> None:
    config.write_text('transcribe_model = "openai:whisper-1"\ntranscribe_url = "http://127.0.0.1:9000/v1"\n')
    transcriber = open_transcriber("openai:gpt-4o-transcribe", None, None)
    assert transcriber is not None
    assert (transcriber.model_id, transcriber.base_url) == ("gpt-4o-transcribe", "http://127.0.0.1:9000/v1")
    elsewhere = open_transcriber(None, "http://127.0.0.1:9001/v1", None)
    assert elsewhere is not None and (elsewhere.model_id, elsewhere.base_url) == (
        "whisper-1",
        "http://127.0.0.1:9001/v1",
    )


def test_a_bad_key_is_named_with_the_file_it_is_in(config: Path) -> None:
    config.write_text('transcribe_model = "whisper-1"\n')
    with pytest.raises(ValueError, match=rf"^config file {config}: transcribe_model: .*openai:whisper-1"):
        open_transcriber(None, None, None)
    config.write_text('transcribe_url = "http://127.0.0.1:9000/v1"\n')
    with pytest.raises(ValueError, match=rf"^config file {config}: transcribe_url need --transcribe-model"):
        open_transcriber(None, None, None)


def test_a_key_of_the_wrong_type_is_a_warning_and_ignored(config: Path) -> None:
    config.write_text("transcribe_model = 3\ntranscribe_key_env = ''\n")
    file, warnings = read_config_file(config)
    assert file.transcribe == {}
    assert [w.split(": ", 1)[1] for w in warnings] == [
        "transcribe_model must be a non-empty string, got 3; ignored",
        "transcribe_key_env must be a non-empty string, got ''; ignored",
    ]
    assert open_transcriber(None, None, None) is None  # (no model: voice messages are refused)


def test_the_command_refuses_a_bad_key_before_anything_starts(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "123456:" + "A" * 35)
    config.write_text('transcribe_model = "openai:whisper-1"\n')  # (and no key for OpenAI)
    result = CliRunner().invoke(app, ["telegram", "--allow", "100"])
    assert result.exit_code == 2, result.output
    assert f"config file {config}: transcribe_model" in result.stderr and "OPENAI_API_KEY" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (config.parent / "xdg" / "agentloop").exists()  # refused before anything was opened
