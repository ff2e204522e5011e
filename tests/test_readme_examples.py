"""The README's examples, run as written: every ```python fence is executed (hosted models
answered by a scripted one), every ```toml fence is read by the config loader, every
``agentloop ...`` command line (the synopsis fence and inline ones) names commands and flags the
CLI has, every ``agentloop.x.Name`` imports, and the HTTP routes README.md and docs/server-api.md
name are the ones served. A README edit that breaks an example, or a code change that the README
did not follow, fails here."""

from __future__ import annotations

import ast
import asyncio
import importlib
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from agentloop.cli.config import read_config_file
from agentloop.cli.main import app
from agentloop.messages import ToolResultMessage, UserMessage
from agentloop.models import registry
from agentloop.models.base import ModelRequest
from agentloop.models.scripted import Reply, ScriptedModel, call
from agentloop.process.heartbeat import parse_hours

README = Path(__file__).resolve().parent.parent / "README.md"
TEXT = README.read_text(encoding="utf-8")

# Fences that cannot run offline, by their first line, with the reason. Every other ```python
# fence runs.
OFFLINE_SKIP: dict[str, str] = {}

# hosted and embedded providers the examples name, answered by a scripted model instead
FAKED_PROVIDERS = ("openai", "anthropic", "gemini", "local")


def fences(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", TEXT, flags=re.S | re.M)


def first_line(code: str) -> str:
    return next(line for line in code.splitlines() if line.strip())


class FakeProvider:
    """Stands in for every hosted model: calls ``word_count`` on the quoted text of the prompt when
    it is offered, and otherwise (a tool result to read back, no tools) answers in a word."""

    def __init__(self) -> None:
        self.calls = 0
        self.tool_calls: list[str] = []

    def answer(self, request: ModelRequest) -> str | Reply:
        self.calls += 1
        last = request.messages[-1] if request.messages else None
        offered = {spec.name for spec in request.tools}
        if isinstance(last, ToolResultMessage) or not offered:
            return "done"
        if "word_count" in offered and isinstance(last, UserMessage):
            prompt = " ".join(getattr(block, "text", "") for block in last.content)
            quoted = re.search(r"'([^']*)'", prompt)
            self.tool_calls.append("word_count")
            return Reply(tool_calls=[call("word_count", text=quoted.group(1) if quoted else prompt)])
        return "ok"

    def model(self, model_id: str) -> ScriptedModel:
        return ScriptedModel(self.answer)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeProvider]:
    provider = FakeProvider()
    for name in FAKED_PROVIDERS:
        monkeypatch.setitem(registry._PROVIDERS, name, provider.model)
    for key in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY"):  # (a kernel checks one is set)
        monkeypatch.setenv(key, "test-key")
    for name in ("AGENTLOOP_MODEL", "AGENTLOOP_DATA", "AGENTLOOP_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    yield provider


PYTHON = fences("python")


def test_the_readme_has_its_examples() -> None:
    assert len(PYTHON) >= 2 and fences("toml") and fences("bash")
    assert set(OFFLINE_SKIP) <= {first_line(code) for code in PYTHON}, "a skipped fence is no longer there"


@pytest.mark.parametrize("code", PYTHON, ids=[f"{i}:{first_line(c)[:40]}" for i, c in enumerate(PYTHON)])
def test_python_fence_runs(code: str, fake: FakeProvider, capsys: pytest.CaptureFixture[str]) -> None:
    reason = OFFLINE_SKIP.get(first_line(code))
    if reason:
        pytest.skip(reason)
    # a fence may use ``await`` at the top level, as if inside an async function
    compiled = compile(code, f"{README.name} fence", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    result = eval(compiled, namespace)  # (the README's own code)
    if asyncio.iscoroutine(result):
        asyncio.run(asyncio.wait_for(result, 30))
    assert fake.calls, "the example never called its model"
    if "word_count" in code:
        assert "word_count" in fake.tool_calls
        assert "done" in capsys.readouterr().out


@pytest.mark.parametrize("code", fences("toml"), ids=lambda c: first_line(c).split()[0])
def test_toml_fence_is_read_as_written(code: str, tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(code, encoding="utf-8")
    config, warnings = read_config_file(path)
    assert warnings == [] and config.errors == {}
    for key, value in tomllib.loads(code).items():
        got = getattr(config, key)
        if key == "heartbeat":
            got, value = (got.every, got.hours), (value["every"], parse_hours(value["hours"]))
        elif key == "mcp_servers":
            got, value = [server.name for server in got], [table["name"] for table in value]
        elif isinstance(value, list):
            value = tuple(value)
        assert got == value, f"{key} was not taken as written"


def test_commented_mcp_options_are_valid(tmp_path: Path) -> None:
    """The ``# key = value`` lines of the ``[[mcp_servers]]`` example, each uncommented (``url``
    in place of ``command``), are accepted."""
    (code,) = [c for c in fences("toml") if "[[mcp_servers]]" in c]
    options = re.findall(r"^# (\w+ = .*?)\s+#", code, flags=re.M)
    assert len(options) >= 5
    for option in options:
        table = code if not option.startswith("url ") else '[[mcp_servers]]\nname = "docs"\n'
        path = tmp_path / "config.toml"
        path.write_text(f"{table}\n{option}\n", encoding="utf-8")
        config, warnings = read_config_file(path)
        assert (warnings, config.errors) == ([], {}), option
        assert len(config.mcp_servers) == 1


def _split_top(line: str) -> list[str]:
    """``a [b | c] | d`` -> ``["a [b | c]", "d"]``: alternatives outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(line):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "|" and depth == 0 and line[i - 1 : i + 2] == " | ":
            parts.append(line[start:i])
            start = i + 1
    return [*parts, line[start:]]


def _invocations() -> list[str]:
    """Every ``agentloop ...`` command the README shows, without the ``agentloop``."""
    found: list[str] = []
    synopsis = next(c for c in fences("bash") if "agentloop run" in c)
    lines: list[str] = []
    for raw in synopsis.splitlines():
        line = raw.split("  #")[0].rstrip()
        if raw.startswith(" ") and lines:
            lines[-1] += " " + line.strip()
        elif line:
            lines.append(line)
    for line in lines:
        alternatives = _split_top(line.removeprefix("agentloop ").strip())
        found.extend(a.strip() for a in alternatives)
    prose = re.sub(r"^```.*?^```", "", TEXT, flags=re.S | re.M)
    for span in re.findall(r"`([^`]+)`", prose):
        match = re.search(r"(?:^|[\s/])agentloop ([a-z].*)", span, flags=re.S)
        if match:
            found.append(" ".join(match.group(1).split()))
    return found


def _command(words: list[str]) -> tuple[Any, list[str]]:
    """The (typer's own click) command ``words`` name, and the words that named it."""
    command: Any = typer.main.get_command(app)
    path: list[str] = []
    for word in words:
        if not hasattr(command, "commands"):
            break
        names = word.split("|")  # ``token create|list|revoke``
        if not all(name in command.commands for name in names):
            break
        path.append(word)
        command = command.commands[names[0]]
    return command, path


INVOCATIONS = _invocations()


@pytest.mark.parametrize("invocation", INVOCATIONS)
def test_cli_invocation_exists(invocation: str) -> None:
    words = invocation.split()
    command, path = _command(words)
    assert path, f"no command {words[0]!r}"
    if hasattr(command, "commands"):  # (``agentloop account`` in a sentence: the group)
        assert len(words) == len(path), f"agentloop {' '.join(path)} has no {words[len(path)]!r}"
        return
    options = {opt for param in command.params for opt in [*param.opts, *param.secondary_opts]}
    flags = re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", invocation)
    unknown = [flag for flag in flags if flag not in options]
    assert not unknown, f"agentloop {' '.join(path)} has no {', '.join(unknown)}"


def _all_commands(command: Any) -> Iterator[Any]:
    yield command
    for sub in getattr(command, "commands", {}).values():
        yield from _all_commands(sub)


# flags of other programs the README mentions (tar, rg, bench/run.sh), and of chat's slash commands
# (``/compact --keep N``, checked by tests/test_leftovers10.py)
OTHER_PROGRAMS_FLAGS = {"--to-command", "--to-c", "--git-dir", "--pre", "--peers", "--keep"}


def test_every_flag_in_the_prose_exists() -> None:
    """A flag named anywhere in the README's text is one some ``agentloop`` command takes."""
    options = {
        opt
        for command in _all_commands(typer.main.get_command(app))
        for param in command.params
        for opt in [*param.opts, *param.secondary_opts]
    }
    prose = re.sub(r"^```.*?^```", "", TEXT, flags=re.S | re.M)
    spans = re.findall(r"`([^`]+)`", prose)
    flags = {flag for span in spans for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", span)}
    assert flags - options - OTHER_PROGRAMS_FLAGS == set()


def test_every_dotted_name_resolves() -> None:
    """``agentloop.x.y.Name`` in the README imports; the ``agentloop.*`` span attributes it lists
    are the tracer's."""
    tracing = (Path(__file__).resolve().parent.parent / "src/agentloop/tracing.py").read_text(encoding="utf-8")
    for name in sorted(set(re.findall(r"\bagentloop(?:\.[A-Za-z_]+)+", TEXT))):
        if name == "agentloop.db" or f'"{name}"' in tracing:
            continue
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj: Any = importlib.import_module(".".join(parts[:cut]))
                break
            except ModuleNotFoundError:
                continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), f"{name}: no {attr!r}"
            obj = getattr(obj, attr)


def test_documented_routes_are_the_served_ones() -> None:
    """Every ``METHOD /v1/...`` route README.md and docs/server-api.md name is served, and every
    one served is documented (``…/x`` is short for ``/v1/processes/{pid}/x``)."""
    pytest.importorskip("starlette")
    from agentloop.server.api import ENDPOINTS

    docs = TEXT + (README.parent / "docs" / "server-api.md").read_text(encoding="utf-8")

    def norm(path: str) -> str:
        return re.sub(r"\{[^}]+\}", "{}", re.sub(r"^(…|\.\.\.)", "/v1/processes/{pid}", path))

    documented = {
        (method, norm(path))
        for methods, path in re.findall(
            r"`((?:GET|POST|DELETE)(?:\|(?:GET|POST|DELETE))*) ((?:/v1|…|\.\.\.)/[^` ]*)", docs
        )
        for method in methods.split("|")
    }
    served = {(endpoint.method, norm(endpoint.path)) for endpoint in ENDPOINTS}
    # (the WebSocket, routed on its own; OpenAI's transcription route, which a transcriber calls)
    assert documented - served == {("GET", "/v1/ws"), ("POST", "/v1/audio/transcriptions")}
    assert served - documented == set()
