"""``agentloop telegram``: the durable agent, reachable from Telegram (``agentloop.channels.telegram``).

The command checks its token and options, then runs a ``TelegramBridge`` on a kernel opened as
``agentloop serve`` opens it, until SIGINT/SIGTERM (``cli.channel``); the next start resumes
unfinished runs and the poll where it stopped.
The bot token comes from an environment variable (``TELEGRAM_BOT_TOKEN``, or the one
``--token-env`` names), never from the command line, where ``ps`` would show it to everyone.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated

import typer

from agentloop.cli.channel import Bridge, open_transcriber, run_bridge
from agentloop.cli.config import Settings
from agentloop.cli.options import (
    ChannelApprovalOpt,
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
    TranscribeKeyEnvOpt,
    TranscribeModelOpt,
    TranscribeUrlOpt,
    WorkspaceOpt,
    loop_flags,
)

if TYPE_CHECKING:
    from agentloop.kernel import Kernel

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
    approval: ChannelApprovalOpt = "ask",
    store: StoreOpt = None,
    max_rounds: MaxRoundsOpt = None,
    max_tool_calls: MaxToolCallsOpt = None,
    max_wall_clock: MaxWallClockOpt = None,
    max_tokens: MaxTokensOpt = None,
    max_cost: MaxCostOpt = None,
    fallback: FallbackOpt = None,
    compaction_threshold: CompactionOpt = None,
    reasoning: ReasoningOpt = None,
    transcribe_model: TranscribeModelOpt = None,
    transcribe_url: TranscribeUrlOpt = None,
    transcribe_key_env: TranscribeKeyEnvOpt = None,
) -> None:
    """Talk with the durable agent from Telegram: one conversation per chat, answers and approval
    buttons in the chat; /new starts afresh, /stop stops the answer under way."""
    from agentloop.channels.botapi import DEFAULT_API_URL, BotApiError, check_api_url, check_token
    from agentloop.channels.telegram import TelegramBridge
    from agentloop.cli.main import CliError, _fail, _guarded
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
            transcriber = open_transcriber(transcribe_model, transcribe_url, transcribe_key_env)
        except ValueError as exc:
            _fail(str(exc), 2)
        flags = loop_flags(
            max_rounds, max_tool_calls, max_wall_clock, max_tokens, max_cost, fallback, compaction_threshold, reasoning
        )
        allowed = sorted(set(allow))

        async def start(kernel: Kernel, settings: Settings) -> tuple[Bridge, str]:
            bridge = TelegramBridge(kernel, token, allow=allowed, api_url=url, account=account, transcriber=transcriber)
            try:
                await bridge.start()
            except BotApiError as exc:
                raise CliError(str(exc)) from None
            shown = f"@{bridge.username}" if bridge.username else f"bot {bridge.bot_id}"
            users = ", ".join(str(uid) for uid in allowed)
            return bridge, f"{shown} is listening ({settings.model}); allowed users: {users}"

        run_bridge(
            "telegram",
            start,
            model=model,
            workspace=workspace,
            system=system,
            data=data,
            approval=approval,
            store=store,
            flags=flags,
            account=account,
            transcriber=transcriber,
        )
