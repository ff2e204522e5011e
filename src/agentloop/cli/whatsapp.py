"""``agentloop whatsapp``: the durable agent, reachable from WhatsApp (``agentloop.channels.whatsapp``).

The command opens the kernel as ``agentloop telegram`` does and serves a ``WhatsAppBridge``'s
webhook on ``--host``/``--port`` (127.0.0.1:8787 by default: a reverse proxy or a tunnel gives it
the public HTTPS address Meta calls) until SIGINT/SIGTERM, which stop serving and close the kernel
cleanly. The secrets come from the environment (``WHATSAPP_ACCESS_TOKEN``, ``WHATSAPP_APP_SECRET``,
``WHATSAPP_VERIFY_TOKEN``, and ``WHATSAPP_PHONE_NUMBER_ID``), never from the command line, where
``ps`` would show them to everyone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, NamedTuple

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
    approval: Annotated[
        str,
        typer.Option(
            "--approval",
            help="Tool calls: ask (default policy: risky calls wait for Approve/Deny buttons in the chat), auto, "
            "deny, or a JSON policy.",
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
    from agentloop.cli.chat import data_dir, make_data_dir
    from agentloop.cli.main import CliError, _approval, _fail, _guarded, _settings, _workspace
    from agentloop.cli.telegram import _log_to_stderr
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
            where = _Where(host, port, path, url, version)
            asyncio.run(_run(settings, setting, ws, directory.resolve(), secrets, numbers, where, account))
        finally:
            logging.getLogger("agentloop.channels").removeHandler(handler)


class _Where(NamedTuple):
    host: str
    port: int
    path: str
    graph_url: str
    api_version: str


async def _run(
    settings: Settings,
    setting: ApprovalSetting,
    ws: Path,
    directory: Path,
    secrets: dict[str, str],
    allow: list[str],
    where: _Where,
    account: str | None,
) -> None:
    from agentloop.channels.whatsapp import WhatsAppBridge
    from agentloop.cli.main import CliError
    from agentloop.cli.telegram import _stop_on_signals
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
        bridge = WhatsAppBridge(
            kernel,
            access_token=secrets["WHATSAPP_ACCESS_TOKEN"],
            app_secret=secrets["WHATSAPP_APP_SECRET"],
            verify_token=secrets["WHATSAPP_VERIFY_TOKEN"],
            phone_number_id=secrets["WHATSAPP_PHONE_NUMBER_ID"],
            allow=allow,
            path=where.path,
            graph_url=where.graph_url,
            api_version=where.api_version,
            account=account,
        )
        try:
            try:
                port = await bridge.listen(where.host, where.port)
            except OSError as exc:
                raise CliError(str(exc)) from None
            shown = f"[{where.host}]" if ":" in where.host else where.host
            sys.stderr.write(
                f"agentloop whatsapp: webhook on http://{shown}:{port}{where.path} ({settings.model}); "
                f"allowed numbers: {', '.join(allow)}\n"
            )
            sys.stderr.flush()
            stop = asyncio.Event()
            with _stop_on_signals(stop):
                waiting = asyncio.ensure_future(stop.wait())
                serving = asyncio.ensure_future(bridge.wait())
                try:
                    await asyncio.wait({waiting, serving}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiting.cancel()
                    serving.cancel()
            sys.stderr.write("agentloop whatsapp: stopping\n")
        finally:
            await bridge.close()  # before the kernel closes
