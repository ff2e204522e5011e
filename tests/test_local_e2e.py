"""The real embedded model (Qwen2.5-Coder-0.5B from ``agentloop[local-small]``) running the agent loop.

This test does not skip when the model is missing: CI installs the extra, so a missing model is a
broken setup and the failure says what to install.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agentloop.agent import Agent
from agentloop.messages import AssistantMessage
from agentloop.models.base import ProviderError
from agentloop.models.gguf_assets import ensure_model_file
from agentloop.models.local import LocalModel
from agentloop.tools.base import Tool, tool

pytestmark = pytest.mark.embedded

MODEL = "local:qwen2.5-coder-0.5b"


@pytest.fixture(scope="module")
def small_model() -> LocalModel:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pytest.fail("llama-cpp-python is not installed: pip install 'agentloop[local-small]'")
    try:
        ensure_model_file(MODEL)
    except ProviderError as exc:
        pytest.fail(str(exc))
    return LocalModel(MODEL, n_threads=2)


def make_tools(root: Path, calls: list[tuple[str, dict[str, str]]]) -> list[Tool]:
    @tool
    def read_file(path: str) -> str:
        """Read a text file from the workspace.

        Args:
            path: the file's name, e.g. notes.txt
        """
        calls.append(("read_file", {"path": path}))
        target = root / Path(path).name
        return target.read_text() if target.is_file() else f"error: no such file: {path}"

    @tool
    def get_time(timezone: str) -> str:
        """The current local time in a timezone.

        Args:
            timezone: an IANA timezone name, e.g. Europe/Berlin
        """
        calls.append(("get_time", {"timezone": timezone}))
        return "07:31"

    return [read_file, get_time]


async def test_agent_reads_a_file_with_the_real_model(small_model: LocalModel, tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("server:\n  host: 0.0.0.0\n  port: 8081\n  workers: 4\n")
    calls: list[tuple[str, dict[str, str]]] = []
    agent = Agent(model=small_model, tools=make_tools(tmp_path, calls), system_prompt="You are a helpful assistant.")

    started = time.monotonic()
    result = await agent.run("Which port does the server in config.yaml listen on?")
    elapsed = time.monotonic() - started

    assert calls and calls[0] == ("read_file", {"path": "config.yaml"}), calls
    assert result.stop_reason == "stop", result.error
    assert result.text.strip()
    assert "8081" in result.text
    answers = [m for m in result.new_messages if isinstance(m, AssistantMessage)]
    assert answers[-1].provider == "local" and answers[-1].model == "qwen2.5-coder-0.5b"
    assert answers[-1].usage.output > 0
    assert elapsed < 90, f"took {elapsed:.1f}s"


async def test_agent_asks_for_the_time_with_the_real_model(small_model: LocalModel, tmp_path: Path) -> None:
    calls: list[tuple[str, dict[str, str]]] = []
    agent = Agent(model=small_model, tools=make_tools(tmp_path, calls), system_prompt="You are a helpful assistant.")

    result = await agent.run("What time is it in Tokyo right now?")

    assert calls and calls[0][0] == "get_time", calls
    assert "tokyo" in calls[0][1]["timezone"].lower()
    assert result.stop_reason == "stop", result.error
    assert "7:31" in result.text
