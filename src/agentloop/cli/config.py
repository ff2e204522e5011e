"""Which model and which defaults a CLI command uses, and where each choice came from.

Precedence is fixed so a user can always tell why a model was picked: the ``--model`` flag, then
``AGENTLOOP_MODEL``, then the config file (``$AGENTLOOP_CONFIG`` or
``~/.config/agentloop/config.toml``), then the embedded default. A broken config file must never
stop the CLI: it becomes a warning and the defaults apply.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentloop.models.base import Model
from agentloop.models.registry import DEFAULT_MODEL, ModelNotFound, parse_model_string, resolve_model

CONFIG_ENV = "AGENTLOOP_CONFIG"
MODEL_ENV = "AGENTLOOP_MODEL"
DEFAULT_TOOL_TIMEOUT = 60.0
SERVER_ENV = "AGENTLOOP_SERVER"
TOKEN_ENV = "AGENTLOOP_TOKEN"
DEFAULT_SERVER = "http://127.0.0.1:8765"
_KEYS = ("model", "system_prompt", "tool_timeout", "max_rounds", "workspace", "server", "token")


@dataclass(frozen=True)
class FileConfig:
    """What the config file says; a key that is absent or unusable is None."""

    model: str | None = None
    system_prompt: str | None = None
    tool_timeout: float | None = None
    max_rounds: int | None = None
    workspace: Path | None = None
    server: str | None = None
    token: str | None = None


@dataclass(frozen=True)
class Settings:
    """The effective settings of one command. ``model_source`` explains the model choice."""

    model: str
    model_source: str
    system_prompt: str = ""
    tool_timeout: float | None = DEFAULT_TOOL_TIMEOUT
    max_rounds: int | None = None
    workspace: Path | None = None
    config_path: Path | None = None
    warnings: list[str] = field(default_factory=list)


def config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    explicit = env.get(CONFIG_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "agentloop" / "config.toml"


def _positive_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def read_config_file(path: Path) -> tuple[FileConfig, list[str]]:
    """Parse the file leniently: every problem is a warning, never an exception."""
    if not path.exists():
        return FileConfig(), []
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        return FileConfig(), [f"ignoring config file {path}: {exc}"]

    warnings: list[str] = []

    def bad(key: str, expected: str) -> None:
        warnings.append(f"config file {path}: {key} must be {expected}, got {data[key]!r}; ignored")

    model = data.get("model")
    if model is not None and not (isinstance(model, str) and model.strip()):
        bad("model", "a 'provider:model' string")
        model = None
    system_prompt = data.get("system_prompt")
    if system_prompt is not None and not isinstance(system_prompt, str):
        bad("system_prompt", "a string")
        system_prompt = None
    tool_timeout = data.get("tool_timeout")
    if tool_timeout is not None and not _positive_number(tool_timeout):
        bad("tool_timeout", "a positive number of seconds")
        tool_timeout = None
    max_rounds = data.get("max_rounds")
    if max_rounds is not None and not (_positive_number(max_rounds) and isinstance(max_rounds, int)):
        bad("max_rounds", "a positive integer")
        max_rounds = None
    workspace = data.get("workspace")
    if workspace is not None and not (isinstance(workspace, str) and workspace):
        bad("workspace", "a directory path")
        workspace = None
    server = data.get("server")
    if server is not None and not (isinstance(server, str) and server.startswith(("http://", "https://"))):
        bad("server", "an http:// or https:// URL")
        server = None
    token = data.get("token")
    if token is not None and not (isinstance(token, str) and token.strip()):
        bad("token", "a token string")
        token = None
    unknown = sorted(set(data) - {*_KEYS})
    if unknown:
        warnings.append(f"config file {path}: unknown keys ignored: {', '.join(unknown)}")
    return (
        FileConfig(
            model=model.strip() if isinstance(model, str) else None,
            system_prompt=system_prompt,
            tool_timeout=float(tool_timeout) if tool_timeout is not None else None,
            max_rounds=max_rounds,
            workspace=Path(workspace).expanduser() if isinstance(workspace, str) else None,
            server=server.rstrip("/") if isinstance(server, str) else None,
            token=token.strip() if isinstance(token, str) else None,
        ),
        warnings,
    )


def load_settings(
    *,
    model: str | None = None,
    system_prompt: str | None = None,
    tool_timeout: float | None = None,
    max_rounds: int | None = None,
    workspace: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Flags win over the environment, which wins over the file, which wins over defaults."""
    env = os.environ if env is None else env
    path = config_path(env)
    file, warnings = read_config_file(path)

    if model:
        chosen, source = model, "--model"
    elif env.get(MODEL_ENV):
        chosen, source = env[MODEL_ENV], MODEL_ENV
    elif file.model:
        chosen, source = file.model, f"config file {path}"
    else:
        chosen, source = DEFAULT_MODEL, "built-in default"

    return Settings(
        model=chosen,
        model_source=source,
        system_prompt=system_prompt if system_prompt is not None else (file.system_prompt or ""),
        tool_timeout=tool_timeout if tool_timeout is not None else (file.tool_timeout or DEFAULT_TOOL_TIMEOUT),
        max_rounds=max_rounds if max_rounds is not None else file.max_rounds,
        workspace=workspace if workspace is not None else file.workspace,
        config_path=path,
        warnings=warnings,
    )


def open_model(spec: str, progress: Callable[[str], None] | None = None) -> Model:
    """Resolve ``spec``; the embedded model also reports its (slow) preparation to ``progress``."""
    provider, model_id = parse_model_string(spec)
    if provider == "local" and progress is not None:
        try:
            from agentloop.models.local import LocalModel
        except ImportError as exc:
            raise ModelNotFound(
                f"the embedded model needs an optional dependency: pip install 'agentloop[local]' ({exc})"
            ) from exc
        return LocalModel(model_id, progress=progress)
    return resolve_model(spec)


@dataclass(frozen=True)
class Connection:
    """Where a client command talks to and with which token; ``token_source`` says where the token
    came from (never the token itself), for error messages."""

    server: str
    token: str | None
    token_source: str
    warnings: list[str] = field(default_factory=list)


def load_connection(
    *, server: str | None = None, token: str | None = None, env: Mapping[str, str] | None = None
) -> Connection:
    """``--server``/``--token`` win over ``$AGENTLOOP_SERVER``/``$AGENTLOOP_TOKEN``, which win
    over the config file's ``server``/``token`` keys; the server defaults to the local one."""
    env = os.environ if env is None else env
    path = config_path(env)
    file, warnings = read_config_file(path)
    chosen_server = server or env.get(SERVER_ENV) or file.server or DEFAULT_SERVER
    if token:
        chosen_token, source = token, "--token"
    elif env.get(TOKEN_ENV):
        chosen_token, source = env[TOKEN_ENV], TOKEN_ENV
    elif file.token:
        chosen_token, source = file.token, f"config file {path}"
    else:
        chosen_token, source = None, "none"
    return Connection(chosen_server.rstrip("/"), chosen_token, source, warnings)
