"""``agentloop discord``: the durable agent, reachable from Discord (``agentloop.channels.discord``).

The command checks its token and options, then runs a ``DiscordBridge`` on a kernel opened as
``agentloop serve`` opens it, until SIGINT/SIGTERM (``cli.channel``); the next start resumes
unfinished runs and catches up on what was said meanwhile. The bot token comes from an environment
variable (``DISCORD_BOT_TOKEN``, or the one ``--token-env`` names), never from the command line,
where ``ps`` would show it to everyone. A token Discord refuses (HTTP 401 at start, or the
gateway's close code 4004, at start or later) ends the command with one ``error:`` line, exit 1.
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
    from agentloop.channels.discord import DiscordBridge
    from agentloop.kernel import Kernel

DEFAULT_TOKEN_ENV = "DISCORD_BOT_TOKEN"


def register(app: typer.Typer) -> None:
    app.command()(discord)


class _Running:
    """The bridge as ``cli.channel`` runs it, with its end told: a gateway failure no retry can
    mend (a token revoked while running) is raised as a ``CliError`` once the bridge is closed,
    so that the command ends with its one line and exit 1 rather than 0."""

    def __init__(self, bridge: DiscordBridge) -> None:
        self.bridge = bridge
        self.failure: str | None = None

    async def wait(self) -> None:
        from agentloop.channels.discord_api import DiscordError

        try:
            await self.bridge.wait()
        except DiscordError as exc:
            self.failure = str(exc)

    async def close(self) -> None:
        from agentloop.cli.main import CliError

        await self.bridge.close()
        if self.failure is not None:
            raise CliError(self.failure)


def discord(
    allow: Annotated[
        list[int] | None,
        typer.Option(
            "--allow",
            metavar="ID",
            help="A Discord user id that may talk to the agent and answer its approvals (repeat for more). "
            "Required: anyone else is refused, and told their id.",
        ),
    ] = None,
    token_env: Annotated[
        str, typer.Option("--token-env", help="The environment variable that holds the bot token.")
    ] = DEFAULT_TOKEN_ENV,
    api_url: Annotated[
        str | None, typer.Option("--api-url", help="Discord's HTTP API (default: https://discord.com/api/v10).")
    ] = None,
    account: Annotated[
        str | None,
        typer.Option(
            "--account", help="The account every channel's process belongs to (default: discord-<user id> per channel)."
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
    """Talk with the durable agent from Discord: one conversation per channel (DMs, or server
    channels where the bot is mentioned), answers and approval buttons in the channel; /new (or
    !new) starts afresh, /stop (or !stop) stops the answer under way."""
    from agentloop.channels.discord import DiscordBridge
    from agentloop.channels.discord_api import DEFAULT_API_URL, DiscordError, check_api_url, check_token
    from agentloop.cli.main import CliError, _fail, _guarded
    from agentloop.process.archive import check_name

    with _guarded():
        token = os.environ.get(token_env, "").strip() if token_env else ""
        if not token:
            _fail(
                f"no bot token: set {token_env or DEFAULT_TOKEN_ENV} to the token of the bot's page in the "
                "Discord Developer Portal (--token-env names another variable)",
                2,
            )
        if not allow:
            _fail(
                "no Discord user is allowed, so every message would be refused: pass --allow ID "
                "(your numeric user id; the bot tells it to anyone it refuses)",
                2,
            )
        try:
            check_token(token)
            url = check_api_url(api_url or DEFAULT_API_URL)
            if account is not None:
                check_name(account, "account")
            if any(uid < 0 for uid in allow):
                raise ValueError("--allow takes Discord user ids: positive numbers")
            transcriber = open_transcriber(transcribe_model, transcribe_url, transcribe_key_env)
        except ValueError as exc:
            _fail(str(exc), 2)
        flags = loop_flags(
            max_rounds, max_tool_calls, max_wall_clock, max_tokens, max_cost, fallback, compaction_threshold, reasoning
        )
        allowed = sorted(set(allow))

        async def start(kernel: Kernel, settings: Settings) -> tuple[Bridge, str]:
            bridge = DiscordBridge(kernel, token, allow=allowed, api_url=url, account=account, transcriber=transcriber)
            try:
                await bridge.start()
            except DiscordError as exc:
                raise CliError(str(exc)) from None
            shown = f"@{bridge.username}" if bridge.username else f"bot {bridge.bot_id}"
            users = ", ".join(str(uid) for uid in allowed)
            return _Running(bridge), f"{shown} is listening ({settings.model}); allowed users: {users}"

        run_bridge(
            "discord",
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
