"""``agentloop telegram``: the durable agent, reachable from Telegram (``agentloop.channels.telegram``).

The command opens the kernel as ``agentloop serve`` does (``<data>/agentloop.db``, or the store
``--store`` names) and runs a ``TelegramBridge`` on it until SIGINT/SIGTERM, which stop polling and
close the kernel cleanly; the next start resumes unfinished runs and the poll where it stopped.
The bot token comes from an environment variable (``TELEGRAM_BOT_TOKEN``, or the one
``--token-env`` names), never from the command line, where ``ps`` would show it to everyone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from agentloop.cli.approvals import ApprovalSetting
from agentloop.cli.config import Settings, kernel_options, open_model
from agentloop.cli.options import (
    CompactionOpt,
    DataOpt,
    FallbackOpt,
    MaxCostOpt,
    MaxRoundsOpt,
    MaxTokensOpt,
    MaxToolCallsOpt,
    MaxWallClockOpt,
    ModelOpt,
    ReasoningOpt,
    StoreOpt,
    SystemOpt,
    WorkspaceOpt,
    loop_flags,
)
from agentloop.cli.render import Progress

DEFAULT_TOKEN_ENV = "TELEGRAM_BOT_TOKEN"


def register(app: typer.Typer) -> None:
    app.command()(telegram)


def telegram(
    allow: Annotated[
        list[int] | None,
        typer.Option(
            "--allow",
            metavar="ID",
            help="A Telegram user id that may talk to the agent and answer its approvals (repeat for more). "
            "Required: anyone else is refused, and told their id.",
        ),
    ] = None,
    token_env: Annotated[
        str, typer.Option("--token-env", help="The environment variable that holds the bot token.")
    ] = DEFAULT_TOKEN_ENV,
    api_url: Annotated[
        str | None, typer.Option("--api-url", help="The Bot API server (default: https://api.telegram.org).")
    ] = None,
    account: Annotated[
        str | None,
        typer.Option(
            "--account", help="The account every chat's process belongs to (default: telegram-<user id> per chat)."
        ),
    ] = None,
    data: DataOpt = None,
    model: ModelOpt = None,
    workspace: WorkspaceOpt = None,
    system: SystemOpt = None,
    approval: Annotated[
        str,
        typer.Option(
            "--approval",
            help="Tool calls: ask (default policy: risky calls wait for Approve/Deny in the chat), auto, deny, "
            "or a JSON policy.",
        ),
    ] = "ask",
    store: StoreOpt = None,
    max_rounds: MaxRoundsOpt = None,
    max_tool_calls: MaxToolCallsOpt = None,
    max_wall_clock: MaxWallClockOpt = None,
    max_tokens: MaxTokensOpt = None,
    max_cost: MaxCostOpt = None,
    fallback: FallbackOpt = None,
    compaction_threshold: CompactionOpt = None,
    reasoning: ReasoningOpt = None,
) -> None:
    """Talk with the durable agent from Telegram: one conversation per chat, answers and approval
    buttons in the chat; /new starts afresh, /stop stops the answer under way."""
    from agentloop.channels.botapi import DEFAULT_API_URL, check_api_url, check_token
    from agentloop.cli.chat import data_dir, make_data_dir
    from agentloop.cli.main import CliError, _approval, _fail, _guarded, _settings, _workspace
    from agentloop.process.archive import check_name

    with _guarded():
        token = os.environ.get(token_env, "").strip() if token_env else ""
        if not token:
            _fail(
                f"no bot token: set {token_env or DEFAULT_TOKEN_ENV} to the token @BotFather gave "
                "(--token-env names another variable)",
                2,
            )
        if not allow:
            _fail(
                "no Telegram user is allowed, so every message would be refused: pass --allow ID "
                "(your numeric user id; the bot tells it to anyone it refuses)",
                2,
            )
        try:
            check_token(token)
            url = check_api_url(api_url or DEFAULT_API_URL)
            if account is not None:
                check_name(account, "account")
        except ValueError as exc:
            _fail(str(exc), 2)
        flags = loop_flags(
            max_rounds, max_tool_calls, max_wall_clock, max_tokens, max_cost, fallback, compaction_threshold, reasoning
        )
        settings = _settings(model, workspace, system, flags=flags, store=store, uses_store=True)
        setting = _approval(approval)
        ws = _workspace(settings)
        directory = data_dir(data)
        try:
            make_data_dir(directory)
        except OSError as exc:
            raise CliError(f"cannot use the data directory {directory}: {exc.strerror or exc}") from exc
        handler = _log_to_stderr()
        try:
            asyncio.run(_run(settings, setting, ws, directory.resolve(), token, sorted(set(allow)), url, account))
        finally:
            logging.getLogger("agentloop.channels").removeHandler(handler)


def _log_to_stderr() -> logging.Handler:
    """The bridge's log (refusals, retries, failures: never the token) on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("agentloop.channels")
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    return handler


async def _run(
    settings: Settings,
    setting: ApprovalSetting,
    ws: Path,
    directory: Path,
    token: str,
    allow: list[int],
    api_url: str,
    account: str | None,
) -> None:
    from agentloop.channels.botapi import BotApiError
    from agentloop.channels.telegram import TelegramBridge
    from agentloop.cli.main import CliError
    from agentloop.cli.tooling import extra_tools
    from agentloop.kernel import Kernel

    progress = Progress()
    model = open_model(settings.model, progress)
    options = kernel_options(settings, progress)
    async with (
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
        bridge = TelegramBridge(kernel, token, allow=allow, api_url=api_url, account=account)
        try:
            await bridge.start()
        except BotApiError as exc:
            raise CliError(str(exc)) from None
        try:
            shown = f"@{bridge.username}" if bridge.username else f"bot {bridge.bot_id}"
            users = ", ".join(str(uid) for uid in allow)
            sys.stderr.write(f"agentloop telegram: {shown} is listening ({settings.model}); allowed users: {users}\n")
            sys.stderr.flush()
            stop = asyncio.Event()
            with _stop_on_signals(stop):
                waiting = asyncio.ensure_future(stop.wait())
                polling = asyncio.ensure_future(bridge.wait())
                try:
                    await asyncio.wait({waiting, polling}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiting.cancel()
                    polling.cancel()
            sys.stderr.write("agentloop telegram: stopping\n")
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
