"""Which model and which defaults a CLI command uses, and where each choice came from.

Precedence is fixed so a user can always tell why a model was picked: the ``--model`` flag, then
``AGENTLOOP_MODEL``, then the config file (``$AGENTLOOP_CONFIG`` or
``~/.config/agentloop/config.toml``), then the embedded default. A broken config file must never
stop the CLI: it becomes a warning and the defaults apply.

The one exception is what limits or steers a run: the guards (``max_rounds``, ``max_tool_calls``,
``max_wall_clock``, ``max_tokens``, ``max_cost``), the ``fallbacks``, the
``compaction_threshold``, how a turn's tool calls run (``max_concurrency``, ``tool_execution``),
the ``approval_timeout``, the ``outage_retries``, the ``mcp_servers``, the ``shell_sandbox`` and its
``shell_sandbox_read``, and the ``[retention]`` rules (what a misspelt rule removes, or keeps, must
not be a guess).
A budget written down and then silently ignored would let a run go on without the limit its owner relied on (and a
server left out, without tools it was meant to have), so a bad value there is an error (exit 2)
for the commands that run the loop, naming the key or flag and what it must be.

The store (``--store``, then ``AGENTLOOP_STORE``, then the file's ``store`` key; default the
data directory's SQLite file) is strict too: a server pointed at a shared PostgreSQL that
silently fell back to a private SQLite file would split the data of its workers.
"""

from __future__ import annotations

import os
import shlex
import stat
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, get_args

from agentloop.loop.guards import Guards
from agentloop.loop.state import ToolExecution
from agentloop.loop.windows import DEFAULT_MAX_IDLE_WINDOWS, DEFAULT_MAX_WINDOWS
from agentloop.models.base import REASONING_LEVELS, Model, Reasoning
from agentloop.models.registry import DEFAULT_MODEL, ModelNotFound, parse_model_string, providers, resolve_model
from agentloop.process.driver import MAX_OUTAGE_DELAY, MAX_OUTAGE_RETRIES
from agentloop.process.heartbeat import DEFAULT_EVERY, DEFAULT_HEARTBEAT, DEFAULT_HOURS, HeartbeatSettings, parse_hours
from agentloop.tools.mcp import MCPServerConfig, parse_servers
from agentloop.tools.sandbox import check_mode as check_sandbox_mode
from agentloop.tools.sandbox import is_private
from agentloop.urls import redact_secrets

if TYPE_CHECKING:  # (the rules' module brings in the kernel: imported when a file sets some)
    from agentloop.kernel.retention import Retention

CONFIG_ENV = "AGENTLOOP_CONFIG"
MODEL_ENV = "AGENTLOOP_MODEL"
DEFAULT_TOOL_TIMEOUT = 60.0
SERVER_ENV = "AGENTLOOP_SERVER"
TOKEN_ENV = "AGENTLOOP_TOKEN"
STORE_ENV = "AGENTLOOP_STORE"
DEFAULT_SERVER = "http://127.0.0.1:8765"
_LENIENT_KEYS = ("model", "system_prompt", "tool_timeout", "workspace", "server", "token")
GUARD_KEYS = ("max_rounds", "max_tool_calls", "max_wall_clock", "max_tokens", "max_cost")
# execution windows (loop/windows.py): strict like the guards, set in the file only
WINDOW_KEYS = ("window_rounds", "window_tool_calls", "max_windows", "max_idle_windows")
# how the tool calls of one model turn run: at most ``max_concurrency`` at once, or one after the
# other (``tool_execution = "sequential"``); tools that share state may need either
TOOL_RUN_KEYS = ("max_concurrency", "tool_execution")
TOOL_EXECUTIONS: tuple[str, ...] = get_args(ToolExecution)
_STRICT_KEYS = (
    *GUARD_KEYS,
    *WINDOW_KEYS,
    "fallbacks",
    "compaction_threshold",
    "reasoning",
    "approval_timeout",
    "outage_retries",
    *TOOL_RUN_KEYS,
)
_SWITCHES = ("codemode", "subagents", "schedules", "native_compaction")
# the chat bridges' speech-to-text (``--transcribe-model``, ``--transcribe-url``, ``--transcribe-key-env``)
TRANSCRIBE_KEYS = (
    "transcribe_model",
    "transcribe_url",
    "transcribe_key_env",
)  # true or false; anything else is an error
# the chat bridges ``agentloop serve`` hosts: ``[bridges]`` names each with its command's options
# (``telegram = "--allow 123456789"``); a bad table stops ``serve`` (exit 2), never the other commands
BRIDGES = ("telegram", "whatsapp", "discord")
_KEYS = (
    *_LENIENT_KEYS,
    *_STRICT_KEYS,
    "mcp_servers",
    *_SWITCHES,
    "store",
    "heartbeat",
    "fetch_allow",
    "shell_sandbox",
    "shell_sandbox_read",
    *TRANSCRIBE_KEYS,
    "bridges",
    "retention",
)
# ``[retention]``: archives older than ``archives_days`` are removed, processes idle for longer
# than ``idle_process_days`` killed (with an archive); a key left out is a rule that is off
RETENTION_KEYS = ("archives_days", "idle_process_days")


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
    max_tool_calls: int | None = None
    max_wall_clock: float | None = None
    max_tokens: int | None = None
    max_cost: float | None = None
    window_rounds: int | None = None
    window_tool_calls: int | None = None
    max_windows: int | None = None
    max_idle_windows: int | None = None
    fallbacks: tuple[str, ...] | None = None
    compaction_threshold: float | None = None
    reasoning: Reasoning | None = None
    approval_timeout: float | None = None
    outage_retries: tuple[float, ...] | None = None
    max_concurrency: int | None = None
    tool_execution: ToolExecution | None = None
    mcp_servers: tuple[MCPServerConfig, ...] = ()
    codemode: bool = False
    subagents: bool = False
    schedules: bool = False
    native_compaction: bool = False
    fetch_allow: tuple[str, ...] = ()
    shell_sandbox: str = "off"
    shell_sandbox_read: tuple[Path, ...] = ()  # real paths, each an existing directory
    store: str | None = None
    heartbeat: HeartbeatSettings | None = DEFAULT_HEARTBEAT  # None: ``heartbeat = false``
    # the chat bridges' speech-to-text, for the keys of ``TRANSCRIBE_KEYS`` the file sets
    transcribe: dict[str, str] = field(default_factory=dict)
    # ``[bridges]``: a bridge's name -> its command's options; and what is wrong with the table
    bridges: dict[str, tuple[str, ...]] = field(default_factory=dict)
    bridges_error: str | None = None
    retention: Retention | None = None  # ``[retention]``; None: nothing is ever removed
    errors: dict[str, str] = field(default_factory=dict)  # bad run-limit keys: fatal for the loop commands


@dataclass(frozen=True)
class LoopFlags:
    """A command's flags for the run limits, fallbacks and compaction; None means not given, so
    the config file's value (or no limit) applies."""

    max_rounds: int | None = None
    max_tool_calls: int | None = None
    max_wall_clock: float | None = None
    max_tokens: int | None = None
    max_cost: float | None = None
    fallbacks: tuple[str, ...] | None = None
    compaction_threshold: float | None = None
    reasoning: Reasoning | None = None
    max_concurrency: int | None = None
    tool_execution: ToolExecution | None = None

    def given(self) -> list[str]:
        """The flags that were set, spelled as on the command line (to refuse them where they
        cannot apply, rather than ignore them)."""
        return [flag_name(name) for name, value in vars(self).items() if value is not None]


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
    max_tool_calls: int | None = None
    max_wall_clock: float | None = None
    max_tokens: int | None = None
    max_cost: float | None = None
    window_rounds: int | None = None  # execution windows (``Guards``); None: off / the defaults
    window_tool_calls: int | None = None
    max_windows: int | None = None
    max_idle_windows: int | None = None
    fallbacks: tuple[str, ...] = ()
    compaction_threshold: float | None = None  # None: the kernel's default
    reasoning: Reasoning | None = None  # None: the model's own setting
    approval_timeout: float | None = None  # seconds an approval request waits before it is denied
    outage_retries: tuple[float, ...] | None = None  # waits before each new try of a model that is out
    max_concurrency: int | None = None  # tool calls of one turn running at once (None: the loop's 16)
    tool_execution: ToolExecution | None = None  # "sequential": a turn's calls one after the other (None: parallel)
    mcp_servers: tuple[MCPServerConfig, ...] = ()  # ``[[mcp_servers]]`` tables: their tools join the built-ins
    codemode: bool = False  # offer CodeMode over the built-in and MCP tools
    subagents: bool = False  # offer durable processes the Task tool (child processes)
    schedules: bool = False  # offer durable processes the Schedule tool (their own reminders)
    native_compaction: bool = False  # compactions also ask the provider for its own (Kernel's option)
    fetch_allow: tuple[str, ...] = ()  # non-public hosts the Fetch tool may reach
    shell_sandbox: str = "off"  # confine Shell commands (tools/sandbox.py): off, workspace, private (-offline)
    shell_sandbox_read: tuple[Path, ...] = ()  # what the private modes let be read besides (real paths)
    store: str | None = None  # a store URL; None: the data directory's SQLite file
    store_source: str = "default"
    heartbeat: HeartbeatSettings | None = DEFAULT_HEARTBEAT  # the check-ins HEARTBEAT.md asks for
    retention: Retention | None = None  # old archives and idle processes removed (None: nothing is)
    errors: list[str] = field(default_factory=list)  # bad run limits: the command must stop (exit 2)
    store_error: str | None = None  # an unusable (or unknowable) store URL: only commands that open the store stop

    @property
    def guards(self) -> Guards:
        """The run budgets as the loop takes them (none set means no limit at all)."""
        return Guards(
            max_rounds=self.max_rounds,
            max_tool_calls=self.max_tool_calls,
            max_wall_clock=self.max_wall_clock,
            max_tokens=self.max_tokens,
            max_cost=self.max_cost,
            window_rounds=self.window_rounds,
            window_tool_calls=self.window_tool_calls,
            max_windows=DEFAULT_MAX_WINDOWS if self.max_windows is None else self.max_windows,
            max_idle_windows=DEFAULT_MAX_IDLE_WINDOWS if self.max_idle_windows is None else self.max_idle_windows,
        )


def expand_home(path: str | Path, what: str) -> Path:
    """``path`` with ``~`` expanded; a ValueError naming ``what`` (the flag or key it came from)
    when it names the home of a user this machine does not know (``~nosuchuser/x``)."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        user = str(path).split("/", 1)[0]
        raise ValueError(f"{what} {str(path)!r}: {user} names no user on this machine") from None


def config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    explicit = env.get(CONFIG_ENV)
    if explicit:
        return expand_home(explicit, f"${CONFIG_ENV}")
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "agentloop" / "config.toml"


def _positive_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _positive_int(value: Any) -> bool:
    return _positive_number(value) and isinstance(value, int)


def _share(value: Any) -> bool:
    """A share of the context window: above 0 (0 would compact on every turn) and at most 1
    (beyond the window the provider's overflow error comes first)."""
    return _positive_number(value) and value <= 1


def model_problem(spec: Any) -> str | None:
    """Why ``spec`` cannot name a model (its form or an unknown provider), or None. Checked before
    anything is loaded, so a typo in a fallback is reported at start, not when the model fails."""
    if not isinstance(spec, str) or not spec.strip():
        return f"{spec!r} is not a 'provider:model' string"
    try:
        provider, _ = parse_model_string(spec.strip())
    except ModelNotFound as exc:
        return str(exc)
    if provider not in providers():
        return f"unknown provider {provider!r} in {spec!r} (known: {', '.join(providers())})"
    return None


#: the run-limit keys: a check, and what the value must be (for the error message)
_LIMITS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_rounds": (_positive_int, "a positive integer (model rounds with tools per run)"),
    "max_tool_calls": (_positive_int, "a positive integer (tool calls per run)"),
    "max_wall_clock": (_positive_number, "a positive number of seconds per run"),
    "max_tokens": (_positive_int, "a positive integer (input and output tokens per run)"),
    "max_cost": (_positive_number, "a positive number of dollars per run"),
    "window_rounds": (_positive_int, "a positive integer (model rounds with tools per execution window)"),
    "window_tool_calls": (_positive_int, "a positive integer (tool calls per execution window)"),
    "max_windows": (_positive_int, "a positive integer (execution windows per run)"),
    "max_idle_windows": (_positive_int, "a positive integer (execution windows in a row without progress)"),
    "compaction_threshold": (_share, "a number above 0 and at most 1 (the share of the context window)"),
    "reasoning": (lambda v: v in REASONING_LEVELS, f"one of {', '.join(REASONING_LEVELS)}"),
    "approval_timeout": (
        lambda v: _positive_number(v) and v < float("inf"),
        "a positive number of seconds an approval request waits for its answer",
    ),
    "outage_retries": (
        lambda v: (
            isinstance(v, list)
            and len(v) <= MAX_OUTAGE_RETRIES
            and all(_positive_number(x) and x <= MAX_OUTAGE_DELAY for x in v)
        ),
        f"a list of at most {MAX_OUTAGE_RETRIES} waits in seconds (each up to {MAX_OUTAGE_DELAY:g})"
        " before a model that is out is tried again",
    ),
    "max_concurrency": (_positive_int, "a positive integer (tool calls of one model turn running at once)"),
    "tool_execution": (lambda v: v in TOOL_EXECUTIONS, f"one of {', '.join(TOOL_EXECUTIONS)}"),
}


def limit_problem(key: str, value: Any) -> str | None:
    """What is wrong with ``value`` for the run-limit ``key`` (a phrase to follow the key's or the
    flag's name), or None when it is usable."""
    if key == "fallbacks":
        if not isinstance(value, list | tuple) or not value:
            return f"must be a non-empty list of 'provider:model' strings, got {value!r}"
        problems = [p for p in (model_problem(v) for v in value) if p]
        return f"has a bad model: {problems[0]}" if problems else None
    check, expected = _LIMITS[key]
    return None if check(value) else f"must be {expected}, got {value!r}"


def flag_name(key: str) -> str:
    """The flag that sets the run-limit ``key`` (``fallbacks`` is given one ``--fallback`` at a time)."""
    return "--fallback" if key == "fallbacks" else f"--{key.replace('_', '-')}"


def _read_limits(data: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The run-limit keys of the file, and an error per unusable one (naming file, key, value)."""
    values: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for key in _STRICT_KEYS:
        if key not in data:
            continue
        problem = limit_problem(key, data[key])
        if problem:
            errors[key] = f"config file {path}: {key} {problem}"
        elif key == "fallbacks":
            values[key] = tuple(v.strip() for v in data[key])
        elif key == "outage_retries":
            values[key] = tuple(float(v) for v in data[key])
        else:
            values[key] = (
                float(data[key])
                if key in ("max_wall_clock", "max_cost", "compaction_threshold", "approval_timeout")
                else data[key]
            )
    return values, errors


def _read_mcp_servers(value: Any) -> tuple[tuple[MCPServerConfig, ...], str | None]:
    """``[[mcp_servers]]`` tables as server configs, or the first problem, naming the table."""
    if value is None:
        return (), None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        return (), "mcp_servers must be a list of tables ([[mcp_servers]] with name and command or url)"

    def label(i: int, table: Any) -> str:
        return f"mcp_servers[{i}]" + (f" ({table['name']!r})" if isinstance(table.get("name"), str) else "")

    try:
        return tuple(parse_servers(value, label, plural="mcp_servers")), None
    except ValueError as exc:
        return (), str(exc)


def read_config_file(path: Path) -> tuple[FileConfig, list[str]]:
    """Parse the file leniently: a problem with one key is a warning, never an exception. A file
    that cannot be read at all is an error for the commands that run the loop, like a bad limit:
    going on without it would silently drop every budget, fallback and MCP server it sets."""
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except (FileNotFoundError, NotADirectoryError):  # no file: nothing to read, nothing lost
        return FileConfig(), []
    # (a path that cannot even be checked, a directory the user may not enter, may hold a file;
    # the parser recurses, so a file nested deep enough exhausts the stack)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        return FileConfig(errors={"config": f"config file {path} cannot be read: {exc}"}), []

    warnings: list[str] = []

    def bad(key: str, expected: str, *, secret: bool = False) -> None:
        # a warning reaches the terminal and a server's log: a value that holds a credential (a
        # token written as a list, a URL with one in it) is described, never repeated
        got = f"a {type(data[key]).__name__}" if secret else redact_secrets(repr(data[key]))
        warnings.append(f"config file {path}: {key} must be {expected}, got {got}; ignored")

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
    workspace = data.get("workspace")
    workspace_path = None
    if workspace is not None and not (isinstance(workspace, str) and workspace):
        bad("workspace", "a directory path")
    elif isinstance(workspace, str):
        try:
            workspace_path = expand_home(workspace, "workspace")
        except ValueError as exc:  # ~nosuchuser/...: a key the CLI can do without, like the others
            warnings.append(f"config file {path}: {exc}; ignored")
    server = data.get("server")
    if server is not None and not (isinstance(server, str) and server.startswith(("http://", "https://"))):
        bad("server", "an http:// or https:// URL")
        server = None
    token = data.get("token")
    if token is not None and not (isinstance(token, str) and token.strip()):
        bad("token", "a token string", secret=True)
        token = None
    limits, errors = _read_limits(data, path)
    servers, problem = _read_mcp_servers(data.get("mcp_servers"))
    if problem:
        errors["mcp_servers"] = f"config file {path}: {problem}"
    switches: dict[str, bool] = {}
    for key in _SWITCHES:
        value = data.get(key, False)
        if isinstance(value, bool):
            switches[key] = value
        else:
            errors[key] = f"config file {path}: {key} must be true or false, got {value!r}"
    fetch_allow, problem = _read_fetch_allow(data.get("fetch_allow", []))
    if problem:
        errors["fetch_allow"] = f"config file {path}: fetch_allow {problem}"
    shell_sandbox = data.get("shell_sandbox", "off")
    try:  # (strict: a sandbox asked for and misspelt must not run commands unconfined)
        check_sandbox_mode(shell_sandbox)
    except ValueError as exc:
        errors["shell_sandbox"] = f"config file {path}: {exc}"
        shell_sandbox = "off"
    # (a misspelt mode is its own error: the directories are then judged as if the mode were private)
    mode = shell_sandbox if "shell_sandbox" not in errors else "private"
    shell_sandbox_read, problem = _read_sandbox_read(data.get("shell_sandbox_read", []), mode)
    if problem:
        errors["shell_sandbox_read"] = f"config file {path}: shell_sandbox_read {problem}"
        shell_sandbox_read = ()
    warnings += [f"config file {path}: shell_sandbox_read {w}" for w in _sandbox_read_warnings(shell_sandbox_read)]
    store = data.get("store")
    if store is not None and store_problem(store):
        errors["store"] = f"config file {path}: store {store_problem(store)}"
        store = None
    heartbeat, problem = _read_heartbeat(data.get("heartbeat", True))
    if problem:
        warnings.append(f"config file {path}: heartbeat {problem}; the default (every 30 minutes, 08:00-23:00) applies")
    transcribe = {}
    for key in TRANSCRIBE_KEYS:  # (checked as the flags are, when a bridge opens the transcriber)
        value = data.get(key)
        if value is not None and not (isinstance(value, str) and value.strip()):
            bad(key, "a non-empty string")
        elif value is not None:
            transcribe[key] = value.strip()
    bridges, problem = _read_bridges(data.get("bridges"))
    bridges_error = f"config file {path}: bridges {problem}" if problem else None
    retention, problem = read_retention(data.get("retention"))
    if problem:
        errors["retention"] = f"config file {path}: retention {problem}"
    unknown = sorted(set(data) - {*_KEYS})
    if unknown:
        warnings.append(f"config file {path}: unknown keys ignored: {', '.join(unknown)}")
    return (
        FileConfig(
            model=model.strip() if isinstance(model, str) else None,
            system_prompt=system_prompt,
            tool_timeout=float(tool_timeout) if tool_timeout is not None else None,
            workspace=workspace_path,
            server=server.rstrip("/") if isinstance(server, str) else None,
            token=token.strip() if isinstance(token, str) else None,
            errors=errors,
            mcp_servers=servers,
            codemode=switches.get("codemode", False),
            subagents=switches.get("subagents", False),
            schedules=switches.get("schedules", False),
            native_compaction=switches.get("native_compaction", False),
            fetch_allow=fetch_allow,
            shell_sandbox=shell_sandbox,
            shell_sandbox_read=shell_sandbox_read,
            store=store,
            heartbeat=heartbeat,
            transcribe=transcribe,
            bridges=bridges,
            bridges_error=bridges_error,
            retention=retention,
            **limits,
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
    flags: LoopFlags | None = None,
    env: Mapping[str, str] | None = None,
    store: str | None = None,
) -> Settings:
    """Flags win over the environment, which wins over the file, which wins over defaults.
    Unusable run limits, from a flag or the file, are listed in ``errors``."""
    env = os.environ if env is None else env
    path = config_path(env)
    file, warnings = read_config_file(path)
    flags = flags or LoopFlags()
    if max_rounds is not None and flags.max_rounds is None:
        flags = replace(flags, max_rounds=max_rounds)
    in_file = f"config file {path}"
    chosen, source = _pick(
        ("--model", model), (MODEL_ENV, env.get(MODEL_ENV)), (in_file, file.model), default=DEFAULT_MODEL
    )
    store_url, store_source = _pick(("--store", store), (STORE_ENV, env.get(STORE_ENV)), (in_file, file.store))
    errors = [
        *_flag_errors(flags),
        *(e for key, e in file.errors.items() if getattr(flags, key, None) is None and key != "store"),
    ]
    # a flag (or the environment) replaces the file's key, so a bad key it overrides does not matter;
    # a file that cannot be read may be the one naming the store: without it, the store is unknown
    store_error = (file.errors.get("store") or file.errors.get("config")) if store_url is None else None
    if store_url is not None and store_source != in_file and (problem := store_problem(store_url)):
        store_error = f"{store_source}: store {problem}"  # (a bad key in the file never becomes store_url)

    return Settings(
        model=chosen,
        model_source=source,
        system_prompt=system_prompt if system_prompt is not None else (file.system_prompt or ""),
        tool_timeout=tool_timeout if tool_timeout is not None else (file.tool_timeout or DEFAULT_TOOL_TIMEOUT),
        max_rounds=_first(flags.max_rounds, file.max_rounds),
        workspace=workspace if workspace is not None else file.workspace,
        config_path=path,
        warnings=warnings,
        max_tool_calls=_first(flags.max_tool_calls, file.max_tool_calls),
        max_wall_clock=_first(flags.max_wall_clock, file.max_wall_clock),
        max_tokens=_first(flags.max_tokens, file.max_tokens),
        max_cost=_first(flags.max_cost, file.max_cost),
        window_rounds=file.window_rounds,
        window_tool_calls=file.window_tool_calls,
        max_windows=file.max_windows,
        max_idle_windows=file.max_idle_windows,
        fallbacks=tuple(v.strip() for v in _first(flags.fallbacks, file.fallbacks) or ()),
        compaction_threshold=_first(flags.compaction_threshold, file.compaction_threshold),
        reasoning=_first(flags.reasoning, file.reasoning),
        max_concurrency=_first(flags.max_concurrency, file.max_concurrency),
        tool_execution=_first(flags.tool_execution, file.tool_execution),
        approval_timeout=file.approval_timeout,
        outage_retries=file.outage_retries,
        mcp_servers=file.mcp_servers,
        codemode=file.codemode,
        subagents=file.subagents,
        schedules=file.schedules,
        native_compaction=file.native_compaction,
        fetch_allow=file.fetch_allow,
        shell_sandbox=file.shell_sandbox,
        shell_sandbox_read=file.shell_sandbox_read,
        store=store_url,
        store_source=store_source,
        heartbeat=file.heartbeat,
        retention=file.retention,
        errors=errors,
        store_error=store_error,
    )


def _read_bridges(value: Any) -> tuple[dict[str, tuple[str, ...]], str | None]:
    """``[bridges]``: each of ``BRIDGES`` with its command's options, as one string split as a
    shell splits it or as a list of strings; the problem with the table, else None. Values are
    never quoted back: options are no place for a secret, but one may have been put there."""
    if value is None:
        return {}, None
    if not isinstance(value, dict):
        return {}, 'must be a table: [bridges] with telegram = "--allow 123456789" (the command\'s options)'
    unknown = sorted(set(value) - set(BRIDGES))
    if unknown:
        return {}, f"names no bridge: {', '.join(map(str, unknown))} (known: {', '.join(BRIDGES)})"
    bridges: dict[str, tuple[str, ...]] = {}
    for name, options in value.items():
        if isinstance(options, list) and all(isinstance(o, str) for o in options):
            bridges[name] = tuple(options)
            continue
        if not isinstance(options, str):
            return {}, f"{name} must be the options of agentloop {name}, as a string or a list of strings"
        try:
            bridges[name] = tuple(shlex.split(options))
        except ValueError as exc:  # (an unclosed quotation)
            return {}, f"{name}: {exc}"
    return bridges, None


def _read_fetch_allow(value: Any) -> tuple[tuple[str, ...], str | None]:
    """``fetch_allow = ["localhost", "10.0.0.0/8"]``: hosts, addresses or networks; the problem
    with the first entry that is none of them (a typo must not pass for an allow-list)."""
    from agentloop.tools.fetch import AllowList  # (with httpx: only when the key is used)

    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return (), 'must be a list of host names, addresses or networks, e.g. ["localhost", "10.0.0.0/8"]'
    if not value:
        return (), None
    try:
        AllowList.parse(value)
    except ValueError as exc:
        return (), str(exc).removeprefix("allow: ")
    return tuple(value), None


def _read_sandbox_read(value: Any, mode: str) -> tuple[tuple[Path, ...], str | None]:
    """``shell_sandbox_read = ["~/docs", "/srv/data"]``: the directories the private modes let
    commands read besides, each by its real path; the problem with the first unusable entry. Resolved
    here because the sandbox refuses a directory reached through a symlink (its target could be
    swapped later): a user's ``~/docs -> /mnt/docs`` is meant as ``/mnt/docs``. A relative path is
    refused: relative to wherever the command happened to start, it would name a different place
    each time. With a ``mode`` that is not private the key is an error, not a warning: the user
    meant the agent to read there, and it would do nothing (every file is readable already)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return (), f'must be a list of directory paths, e.g. ["~/docs", "/srv/data"], got {value!r}'
    if value and not is_private(mode):
        return (), f'is read only in the private modes (shell_sandbox = "private" or "private-offline"), not {mode!r}'
    directories: list[Path] = []
    for entry in value:
        try:
            directory = expand_home(entry, "entry")
        except ValueError as exc:
            return (), str(exc)
        if not directory.is_absolute():
            return (), f"entry {entry!r} must be an absolute path (or start with ~)"
        try:  # (following a symlink: its target is what must be a directory)
            is_directory = stat.S_ISDIR(directory.stat().st_mode)
        except FileNotFoundError:
            return (), f"entry {entry!r}: {directory} does not exist"
        except OSError as exc:  # (a parent the user may not enter, a symlink loop: never an exception here)
            return (), f"entry {entry!r}: {directory} cannot be used: {exc.strerror or exc}"
        if not is_directory:
            return (), f"entry {entry!r}: {directory} is not a directory"
        directories.append(directory.resolve())
    return tuple(dict.fromkeys(directories)), None


def _sandbox_read_warnings(directories: tuple[Path, ...]) -> list[str]:
    """What the user should know of ``shell_sandbox_read``'s ``directories`` (real paths): ``/``
    makes every file readable, and a directory holding the home (``~``, ``/home``) ``~/.ssh`` and
    the rest of the private files the private modes exist to hide. Warnings, not errors: a user may
    mean it, yet would otherwise believe the commands confined to the workspace."""
    try:
        home = Path.home().resolve()
    except (RuntimeError, OSError):  # (no home known: nothing in it to expose)
        home = None
    warnings: list[str] = []
    for directory in directories:
        if directory == Path(directory.anchor):
            warnings.append(
                f"entry {str(directory)!r} lets commands read every file (the home's ~/.ssh, ~/.aws too): "
                'the private modes then confine only writing, as shell_sandbox = "workspace" does'
            )
        elif home is not None and home.is_relative_to(directory):
            warnings.append(
                f"entry {str(directory)!r} holds the home ({home}): commands may read its private files "
                "(~/.ssh, ~/.aws, browser profiles, other projects); name the directories they need instead"
            )
    return warnings


_WORDS_FOR = {"off": False, "false": False, "no": False, "on": True, "true": True, "yes": True}


def _read_heartbeat(value: Any) -> tuple[HeartbeatSettings | None, str | None]:
    """``heartbeat = false`` (none), ``true`` (the default) or a table ``{every = seconds, hours =
    "08:00-23:00"}`` (``hours = "all"`` for the whole day); the default and why, when unusable."""
    if isinstance(value, str) and value.strip().lower() in _WORDS_FOR:  # "off", "on": meant as the booleans
        value = _WORDS_FOR[value.strip().lower()]
    if isinstance(value, bool):
        return (DEFAULT_HEARTBEAT if value else None), None
    if not isinstance(value, dict):
        return DEFAULT_HEARTBEAT, "must be true, false or a table with every and hours"
    unknown = sorted(set(value) - {"every", "hours"})
    if unknown:
        return DEFAULT_HEARTBEAT, f"has unknown keys: {', '.join(map(str, unknown))}"
    hours = value.get("hours", DEFAULT_HOURS)
    if not isinstance(hours, str):
        return DEFAULT_HEARTBEAT, 'hours must be a string such as "08:00-23:00" or "all"'
    try:
        return HeartbeatSettings(every=value.get("every", DEFAULT_EVERY), hours=parse_hours(hours)), None
    except ValueError as exc:
        return DEFAULT_HEARTBEAT, str(exc).removeprefix("heartbeat ")


def read_retention(value: Any) -> tuple[Retention | None, str | None]:
    """``[retention]`` (``archives_days``, ``idle_process_days``: positive numbers of days) as the
    rules, or what is wrong with it. Absent, or a table without either key: no rules, nothing is
    removed."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        return None, f"must be a table with {' and/or '.join(RETENTION_KEYS)}, got {redact_secrets(repr(value))}"
    unknown = sorted(set(value) - {*RETENTION_KEYS})
    if unknown:
        return None, f"has unknown keys: {', '.join(map(str, unknown))} (known: {', '.join(RETENTION_KEYS)})"
    from agentloop.kernel.retention import Retention

    try:
        rules = Retention.from_days(value.get("archives_days"), value.get("idle_process_days"))
    except ValueError as exc:
        return None, str(exc).removeprefix("retention ")
    return (rules if rules.enabled else None), None


def store_problem(url: Any) -> str | None:
    """Why ``url`` cannot name a store, or None (the form only: whether the database answers is
    learnt when it is opened). The URL is never quoted back: it may hold a password."""
    if not isinstance(url, str) or not url.strip():
        return "must be a store URL (sqlite:///path or postgresql://user@host/db)"
    if not url.startswith(("sqlite:///", "postgresql://", "postgres://")):
        return "must start with sqlite:///, postgresql:// or postgres://"
    return None


T = TypeVar("T")


def _pick(*choices: tuple[str, str | None], default: str | None = None, unset: str = "default") -> tuple[Any, str]:
    """The first value given, most specific first (a flag, the environment, the file), and where
    it came from, so a command can say why it uses what it uses; else ``default``."""
    for source, value in choices:
        if value:
            return value, source
    return default, ("built-in default" if default is not None else unset)


def _first(flag: T | None, file: T | None) -> T | None:
    """The flag's value when given, else the file's (a flag always wins, even over a bad key)."""
    return flag if flag is not None else file


def _flag_errors(flags: LoopFlags) -> list[str]:
    """One message per unusable flag value, naming the flag (typer already checked the types)."""
    errors: list[str] = []
    for key, value in vars(flags).items():
        if value is not None:
            problem = limit_problem(key, value)
            if problem:
                errors.append(f"{flag_name(key)} {problem}")
    return errors


def open_fallbacks(settings: Settings, progress: Callable[[str], None] | None = None) -> list[Model]:
    """The fallback models, opened now so that a fallback that cannot load is reported at start
    (naming it as a fallback) rather than at the moment the primary model fails."""
    models: list[Model] = []
    for spec in settings.fallbacks:
        try:
            models.append(open_model(spec, progress))
        except ValueError as exc:
            raise ModelNotFound(f"fallback model {spec}: {exc}") from exc
    return models


def loop_options(settings: Settings, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The ``Agent`` (and so ``Kernel.open``) keyword arguments the settings decide: the tool
    timeout, the guards, the fallback models and how a turn's tool calls run (each of the last two
    only when set: the loop's own defaults stay its own). One place, so every command builds the
    same loop."""
    options: dict[str, Any] = {
        "tool_timeout": settings.tool_timeout,
        "guards": settings.guards,
        "fallbacks": open_fallbacks(settings, progress),
        "reasoning": settings.reasoning,
    }
    if settings.max_concurrency is not None:
        options["max_concurrency"] = settings.max_concurrency
    if settings.tool_execution is not None:
        options["tool_execution"] = settings.tool_execution
    return options


def kernel_options(settings: Settings, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``loop_options`` plus ``kernel_extras``: the ``Kernel.open`` keyword arguments."""
    return {**loop_options(settings, progress), **kernel_extras(settings)}


def kernel_extras(settings: Settings) -> dict[str, Any]:
    """What only a durable kernel has: the compaction threshold (left to the kernel's default
    unless set), the ``Task`` tool (``subagents``) and the ``Schedule`` tool (``schedules``) …"""
    options: dict[str, Any] = {}
    if settings.compaction_threshold is not None:
        options["compaction_threshold"] = settings.compaction_threshold
    if settings.native_compaction:
        options["native_compaction"] = True
    if settings.subagents:
        options["subagents"] = True
    if settings.schedules:
        options["schedule_tool"] = True
    if settings.fetch_allow:
        options["fetch_allow"] = settings.fetch_allow
    if settings.shell_sandbox != "off":
        options["shell_sandbox"] = settings.shell_sandbox
    if settings.shell_sandbox_read:
        options["shell_sandbox_read"] = settings.shell_sandbox_read
    options["heartbeat"] = settings.heartbeat
    if settings.retention is not None:
        options["retention"] = settings.retention
    if settings.approval_timeout is not None:
        options["approval_timeout"] = settings.approval_timeout
    if settings.outage_retries is not None:
        options["outage_retries"] = settings.outage_retries
    return options


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


def open_settings_model(settings: Settings, progress: Callable[[str], None] | None = None) -> Model:
    """``open_model`` for a command's model. One the user did not type with this command (from
    ``$AGENTLOOP_MODEL`` or the config file) that cannot be made says where it came from: set long
    ago, that is the last place a user would look."""
    try:
        return open_model(settings.model, progress)
    except ValueError as exc:
        if settings.model_source in ("--model", "built-in default"):
            raise
        raise ModelNotFound(f"{exc} (the model comes from {settings.model_source})") from exc


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
    chosen_token, source = _pick(
        ("--token", token), (TOKEN_ENV, env.get(TOKEN_ENV)), (f"config file {path}", file.token), unset="none"
    )
    if "config" in file.errors:  # its server and token are lenient keys, but the user must learn they are lost
        warnings.append(file.errors["config"])
    return Connection(chosen_server.rstrip("/"), chosen_token, source, warnings)
