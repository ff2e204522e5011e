"""What the chat-app commands (``agentloop telegram``, ``agentloop whatsapp``) do alike: open the
kernel as ``agentloop serve`` does (``<data>/agentloop.db``, or the store ``--store`` names), start
the channel's bridge on it, log the bridge (refusals, retries, failures: never a secret) on stderr,
and run until SIGINT/SIGTERM, which close the bridge and then the kernel cleanly; the next start
resumes unfinished runs where they stopped. Each command checks its own secrets and options first
and hands over a function that starts its bridge.

``agentloop serve --telegram OPTIONS`` (``hosted_bridge``) runs the same command, on the same
options, to get that function without running it: the bridge then starts on serve's kernel, so
the web UI and the chat app reach the same processes on one embedded database, which refuses a
second runtime. What opens the kernel (``--model``, ``--store``, the run limits, ``--approval``,
the transcriber …) is serve's to give there: the bridge's command is not asked for it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agentloop.cli.config import (
    LoopFlags,
    Settings,
    config_path,
    kernel_options,
    open_settings_model,
    read_config_file,
)
from agentloop.cli.render import Progress

if TYPE_CHECKING:
    from agentloop.cli.approvals import ApprovalSetting
    from agentloop.kernel import Kernel
    from agentloop.models.transcribe import OpenAITranscriber


class Bridge(Protocol):
    async def wait(self) -> None: ...

    async def close(self) -> None: ...


# starts the channel's bridge on the kernel: the bridge, and the line that says where it listens
# (a failure to start raises ``CliError``)
StartBridge = Callable[["Kernel", Settings], Awaitable[tuple[Bridge, str]]]

# the options a bridge's command shares with ``serve``: what opens the kernel and what runs on it.
# Hosted, the bridge runs on serve's kernel, so these are serve's to give; one given to the bridge
# is refused rather than ignored (a --model that silently changed nothing would mislead).
KERNEL_OPTIONS = frozenset(
    {
        *("data", "model", "workspace", "system", "approval", "store"),
        *("max_rounds", "max_tool_calls", "max_wall_clock", "max_tokens", "max_cost"),
        *("fallback", "compaction_threshold", "reasoning"),
        *("transcribe_model", "transcribe_url", "transcribe_key_env"),
    }
)


@dataclass(frozen=True)
class HostedBridge:
    """A bridge for ``serve`` to start on its kernel: its command's checks passed, and ``start``
    is what the command would have run on a kernel of its own."""

    name: str
    start: StartBridge


@dataclass
class _Host:
    """While ``hosted_bridge`` runs a bridge's command: the transcriber serve opened (the bridge
    shares it), and the bridge the command handed over instead of running it."""

    transcriber: OpenAITranscriber | None
    taken: list[HostedBridge] = field(default_factory=list)


_HOST: ContextVar[_Host | None] = ContextVar("agentloop_bridge_host", default=None)


def hosted_bridge(name: str, options: Sequence[str], transcriber: OpenAITranscriber | None) -> HostedBridge:
    """The ``name`` bridge as its command (``agentloop telegram`` …) makes it from ``options``,
    for serve to start on its own kernel: the command's own parser and checks run (a missing token,
    a missing --allow, a bad option end serve as they end the command, before anything is opened),
    and its ``run_bridge`` hands the bridge over instead of opening a kernel. ``transcriber`` is
    serve's: the bridge turns voice messages into text with it, as the kernel does audio."""
    import typer
    import typer.main

    from agentloop.cli.main import _fail, app

    flag = f"--{name}"
    command: Any = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    host = _Host(transcriber)
    token = _HOST.set(host)
    try:
        with command.make_context(f"agentloop serve {flag}", list(options)) as ctx:
            shared = [
                param.opts[0]
                for param in command.params
                if param.name in KERNEL_OPTIONS and ctx.get_parameter_source(param.name).name == "COMMANDLINE"
            ]
            if shared:
                _fail(f"{flag}: {', '.join(shared)}: set on serve itself (the bridge runs on serve's kernel)", 2)
            command.invoke(ctx)
    except typer.Exit as exc:  # (its checks said why on stderr; or --help)
        raise typer.Exit(exc.exit_code) from None
    except _usage_errors() as exc:  # (an unknown option, a bad value)
        _fail(f"{flag}: {_unquoted(exc.format_message(), options)}", 2)  # type: ignore[attr-defined]
    finally:
        _HOST.reset(token)
    if len(host.taken) != 1:  # (every bridge command ends in ``run_bridge``)
        raise RuntimeError(f"agentloop {name} made no bridge")
    return host.taken[0]


def _unquoted(message: str, options: Sequence[str]) -> str:
    """A parser's ``message`` without the values of ``options`` it quotes ("Got unexpected extra
    argument (…)"): a bot token put among them by mistake (the config file's ``[bridges]``) is not
    written to a log. Option names stay, and values too short to be a secret."""
    for word in sorted({w for w in options if not w.startswith("-") and len(w) >= 16}, key=len, reverse=True):
        message = message.replace(word, "…")
    return message


def _usage_errors() -> tuple[type[Exception], ...]:
    """The errors a command's parser raises: click's ``ClickException``, of the click typer runs
    on (newer typer brings a copy of its own, whose classes are not the click package's)."""
    import typer

    return tuple(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def open_transcriber(model: str | None, url: str | None, key_env: str | None) -> OpenAITranscriber | None:
    """The transcriber ``--transcribe-model`` (with ``--transcribe-url`` and ``--transcribe-key-env``)
    names, each flag (or its environment variable) else the config file's key of the same name
    (``transcribe_model`` …), checked before the bridge starts (ValueError saying what is wrong,
    and where it was set); None without a model: voice messages are then refused. A bridge that
    ``serve`` hosts gets serve's transcriber (opened from serve's flags and the same keys)."""
    host = _HOST.get()
    if host is not None:
        return host.transcriber
    given = {"model": (model or "").strip() or None, "url": url, "key_env": key_env}
    path = config_path()
    from_file = read_config_file(path)[0].transcribe
    where = {"model": "--transcribe-model", "url": "--transcribe-url", "key_env": "--transcribe-key-env"}
    for name, value in list(given.items()):
        if value is None and f"transcribe_{name}" in from_file:
            given[name] = from_file[f"transcribe_{name}"]
            where[name] = f"config file {path}: transcribe_{name}"
    if given["model"] is None:
        named = [where[name] for name in ("url", "key_env") if given[name]]
        if named:
            raise ValueError(f"{' and '.join(named)} need --transcribe-model (openai:whisper-1, for one)")
        return None
    from agentloop.models.transcribe import open_transcriber as _open

    try:
        return _open(given["model"], base_url=given["url"], key_env=given["key_env"])
    except ValueError as exc:
        raise ValueError(f"{where['model']}: {exc}") from None


def run_bridge(
    name: str,
    start: StartBridge,
    *,
    model: str | None,
    workspace: Path | None,
    system: str | None,
    data: Path | None,
    approval: str,
    store: str | None,
    flags: LoopFlags,
    account: str | None,
    transcriber: OpenAITranscriber | None = None,
) -> None:
    """Run the ``name`` channel's bridge (``start``) on a kernel made from the command's options,
    until a signal stops it (and then close ``transcriber``, the bridge's).
    Called inside ``cli.main._guarded``. Under ``hosted_bridge`` the bridge is handed over to
    serve instead, which opened the kernel (and the transcriber) from its own options."""
    host = _HOST.get()
    if host is not None:
        host.taken.append(HostedBridge(name, start))
        return
    from agentloop.cli.main import _approval, _data_directory, _settings, _workspace

    settings = _settings(model, workspace, system, flags=flags, store=store, uses_store=True)
    setting = _approval(approval)
    ws = _workspace(settings)
    directory = _data_directory(data)
    with bridge_log():
        asyncio.run(_serve(name, start, settings, setting, ws, directory.resolve(), account, transcriber))


@contextlib.contextmanager
def bridge_log() -> Iterator[None]:
    """The bridges' log on stderr, while they run (``serve`` hosting them too)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("agentloop.channels")
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)


async def _serve(
    name: str,
    start: StartBridge,
    settings: Settings,
    setting: ApprovalSetting,
    ws: Path,
    directory: Path,
    account: str | None,
    transcriber: OpenAITranscriber | None = None,
) -> None:
    from agentloop.cli.tooling import extra_tools
    from agentloop.kernel import Kernel

    progress = Progress()
    model = open_settings_model(settings, progress)
    options = kernel_options(settings, progress)
    async with (
        contextlib.AsyncExitStack() as stack,
        extra_tools(settings, ws) as extra,
        Kernel.open(
            settings.store or f"sqlite:///{directory}/agentloop.db",
            model=model,
            workspace=ws,
            system_prompt=settings.system_prompt,
            data_dir=directory,
            extra_tools=extra,
            **setting.kernel_options(owner=account),
            **options,
        ) as kernel,
    ):
        if transcriber is not None:  # (after the bridge, which closes first)
            stack.push_async_callback(transcriber.close)
        bridge, listening = await start(kernel, settings)
        try:
            if transcriber is not None:
                listening += f"; voice messages are transcribed ({transcriber!r})"
            sys.stderr.write(f"agentloop {name}: {listening}\n")
            sys.stderr.flush()
            stop = asyncio.Event()
            with _stop_on_signals(stop):
                waiting = asyncio.ensure_future(stop.wait())
                running = asyncio.ensure_future(bridge.wait())
                try:
                    await asyncio.wait({waiting, running}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiting.cancel()
                    running.cancel()
            sys.stderr.write(f"agentloop {name}: stopping\n")
        finally:
            await bridge.close()  # before the kernel closes


@contextlib.contextmanager
def _stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set ``stop``: the bridge and the kernel close as on any way out."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(signum, stop.set)
                installed.append(signum)
            except (NotImplementedError, RuntimeError, ValueError):
                pass
    try:
        yield
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
