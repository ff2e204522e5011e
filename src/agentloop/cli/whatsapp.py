"""``agentloop whatsapp``: the durable agent, reachable from WhatsApp (``agentloop.channels.whatsapp``).

The command checks its secrets and options, then serves a ``WhatsAppBridge``'s webhook on
``--host``/``--port`` (127.0.0.1:8787 by default: a reverse proxy or a tunnel gives it the public
HTTPS address Meta calls) on a kernel opened as ``agentloop serve`` opens it, until SIGINT/SIGTERM
(``cli.channel``). The secrets come from the environment (``WHATSAPP_ACCESS_TOKEN``, ``WHATSAPP_APP_SECRET``,
``WHATSAPP_VERIFY_TOKEN``, and ``WHATSAPP_PHONE_NUMBER_ID``), never from the command line, where
``ps`` would show them to everyone.
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

ENV = ("WHATSAPP_ACCESS_TOKEN", "WHATSAPP_APP_SECRET", "WHATSAPP_VERIFY_TOKEN", "WHATSAPP_PHONE_NUMBER_ID")


def register(app: typer.Typer) -> None:
    app.command()(whatsapp)


def whatsapp(
    allow: Annotated[
        list[str] | None,
        typer.Option(
            "--allow",
            metavar="NUMBER",
            help="A phone number (international form, digits only: 15551234567) that may talk to the agent "
            "and answer its approvals (repeat for more). Required: anyone else is refused.",
        ),
    ] = None,
    host: Annotated[
        str, typer.Option("--host", help="Where the webhook listens (put a reverse proxy or a tunnel before it).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="The webhook's port.")] = 8787,
    path: Annotated[str, typer.Option("--path", help="The webhook's path (the callback URL's).")] = "/whatsapp",
    graph_url: Annotated[
        str | None, typer.Option("--graph-url", help="The Graph API (default: https://graph.facebook.com).")
    ] = None,
    api_version: Annotated[str | None, typer.Option("--api-version", help="The Graph API version.")] = None,
    account: Annotated[
        str | None,
        typer.Option(
            "--account", help="The account every user's process belongs to (default: whatsapp-<number> per user)."
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
    """Talk with the durable agent from WhatsApp (Business Cloud API): serves the webhook Meta
    calls; one conversation per number, approval buttons in the chat; /new starts afresh, /stop
    stops the answer under way."""
    from agentloop.channels.graph import (
        DEFAULT_API_VERSION,
        DEFAULT_GRAPH_URL,
        check_api_version,
        check_graph_url,
        check_phone_number_id,
    )
    from agentloop.channels.whatsapp import WhatsAppBridge
    from agentloop.cli.main import CliError, _fail, _guarded
    from agentloop.process.archive import check_name

    with _guarded():
        secrets = {name: os.environ.get(name, "").strip() for name in ENV}
        missing = [name for name, value in secrets.items() if not value]
        if missing:
            _fail(f"set {', '.join(missing)} (from the app's WhatsApp settings in Meta's developer console)", 2)
        numbers = sorted({n.strip().lstrip("+") for n in allow or []} - {""})
        if not numbers:
            _fail(
                "no WhatsApp number is allowed, so every message would be refused: pass --allow NUMBER "
                "(yours, in international form, digits only)",
                2,
            )
        if any(not (n.isascii() and n.isdigit()) for n in numbers):
            _fail("--allow takes phone numbers in international form, digits only (15551234567)", 2)
        if not path.startswith("/"):
            _fail(f"--path must begin with '/', got {path!r}", 2)
        try:
            url = check_graph_url(graph_url or DEFAULT_GRAPH_URL)
            version = check_api_version(api_version or DEFAULT_API_VERSION)
            check_phone_number_id(secrets["WHATSAPP_PHONE_NUMBER_ID"])
            if account is not None:
                check_name(account, "account")
            transcriber = open_transcriber(transcribe_model, transcribe_url, transcribe_key_env)
        except ValueError as exc:
            _fail(str(exc), 2)
        try:
            import starlette  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError:
            _fail("the webhook needs the server extra: pip install 'agentloop[server]'", 2)
        flags = loop_flags(
            max_rounds, max_tool_calls, max_wall_clock, max_tokens, max_cost, fallback, compaction_threshold, reasoning
        )

        async def start(kernel: Kernel, settings: Settings) -> tuple[Bridge, str]:
            bridge = WhatsAppBridge(
                kernel,
                access_token=secrets["WHATSAPP_ACCESS_TOKEN"],
                app_secret=secrets["WHATSAPP_APP_SECRET"],
                verify_token=secrets["WHATSAPP_VERIFY_TOKEN"],
                phone_number_id=secrets["WHATSAPP_PHONE_NUMBER_ID"],
                allow=numbers,
                path=path,
                graph_url=url,
                api_version=version,
                account=account,
                transcriber=transcriber,
            )
            try:
                listening = await bridge.listen(host, port)
            except OSError as exc:
                await bridge.close()
                raise CliError(str(exc)) from None
            shown = f"[{host}]" if ":" in host else host
            where = f"http://{shown}:{listening}{path}"
            return bridge, f"webhook on {where} ({settings.model}); allowed numbers: {', '.join(numbers)}"

        run_bridge(
            "whatsapp",
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
