"""A Ctrl-C while the command line is being imported ends quietly with 130, also when it lands in a
class body's ``__set_name__`` (pydantic building a model), where Python 3.11 wraps it in a
``RuntimeError``; any other ``RuntimeError`` still propagates. (The timing-driven end-to-end test is
``test_cli_walkthrough_review7.test_ctrl_c_in_the_first_second_ends_quietly``.)"""

from __future__ import annotations

import sys
import types

import pytest

from agentloop.cli import entry


def _main_raising(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    """``agentloop.cli.main`` replaced by a module whose ``app`` raises ``error``."""

    def app() -> None:
        raise error

    fake = types.ModuleType("agentloop.cli.main")
    fake.app = app  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "agentloop.cli.main", fake)


def test_a_ctrl_c_wrapped_by_set_name_ends_quietly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wrapped = RuntimeError("Error calling __set_name__ on 'cached_property' instance 'types_namespace'")
    wrapped.__cause__ = KeyboardInterrupt()
    _main_raising(monkeypatch, wrapped)
    assert entry.main() == 130
    assert capsys.readouterr().err == "\naborted\n"


def test_a_plain_ctrl_c_ends_quietly(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _main_raising(monkeypatch, KeyboardInterrupt())
    assert entry.main() == 130
    assert "Traceback" not in capsys.readouterr().err


def test_another_runtime_error_is_not_taken_for_a_ctrl_c(monkeypatch: pytest.MonkeyPatch) -> None:
    _main_raising(monkeypatch, RuntimeError("something else broke"))
    with pytest.raises(RuntimeError, match="something else broke"):
        entry.main()
