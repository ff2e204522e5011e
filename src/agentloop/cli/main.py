"""``agentloop``: run the loop from a shell.

Every failure a user can cause (unknown provider, missing package, bad workspace, provider
error) ends in one ``error: …`` line on stderr and exit code 1, never a traceback; set
``AGENTLOOP_DEBUG=1`` to get the traceback back. Ctrl-C aborts the run properly (tools are
cancelled, shell children killed) and exits 130.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from agentloop.agent import Agent, RunResult
from agentloop.cli.approvals import (
    ApprovalSetting,
    PolicyHook,
    Question,
    UserAnswer,
    approvals_app,
    ask_user,
    parse_approval,
)
from agentloop.cli.config import (
    LoopFlags,
    Settings,
    expand_home,
    kernel_options,
    load_settings,
    loop_options,
    open_settings_model,
)
from agentloop.cli.device import device_app
from agentloop.cli.options import (
    CompactionOpt,
    FallbackOpt,
    MaxConcurrencyOpt,
    MaxCostOpt,
    MaxRoundsOpt,
    MaxTokensOpt,
    MaxToolCallsOpt,
    MaxWallClockOpt,
    ModelOpt,
    ReasoningOpt,
    SystemOpt,
    ToolExecutionOpt,
    WorkspaceOpt,
    data_path,
    loop_flags,
)
from agentloop.cli.render import (
    READER_GONE,
    EventSink,
    Interrupts,
    JsonRenderer,
    Progress,
    TextRenderer,
    exit_on_terminate,
    one_line,
    play,
    stderr_console,
    write_out,
)
from agentloop.cli.tooling import extra_tools
from agentloop.cli.usage import App
from agentloop.models.catalog import CATALOG
from agentloop.models.registry import HOSTED, hosted_status, parse_model_string
from agentloop.process.store.base import StoreError
from agentloop.tools.mcp import MCPError

if TYPE_CHECKING:
    from agentloop.cli.chat import ChatRepl
    from agentloop.kernel import Kernel

app = App(
    name="agentloop",
    help="A durable agent-loop runtime: a model, tools, and a loop that streams what it does.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(device_app, name="device")
app.add_typer(approvals_app, name="approvals")


class CliError(Exception):
    """A failure to report as one line, with exit code 1 (2: a bad flag or config value)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("agentloop")
    except Exception:
        return "unknown"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"agentloop {_version()}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_show_version, is_eager=True, help="Show the version and exit."),
    ] = False,
) -> None:
    """A durable agent-loop runtime: a model, tools, and a loop that streams what it does."""
    _replace_closed_streams()


def _replace_closed_streams() -> None:
    """A standard stream the caller closed (``<&-``, ``>&-``) is None in Python, and every
    command reads or writes them without a second thought: ``run -`` failed with ``error:
    AttributeError: 'NoneType' object has no attribute 'read'`` and ``chat`` with one about
    ``isatty``. A closed one is taken as /dev/null (as a daemon's streams are): no input, so
    ``run -`` says its prompt is empty and ``chat`` ends as at Ctrl-D; output goes nowhere."""
    if sys.stdin is None:
        sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115 (it stays open: it is stdin)
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115


# ---------------------------------------------------------------------------------- helpers


def _fail(message: str, code: int = 1) -> NoReturn:
    sys.stderr.write(f"error: {one_line(message, 1000)}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


@contextmanager
def _guarded() -> Iterator[None]:
    """The one place where exceptions become ``error:`` lines and exit codes."""
    READER_GONE.clear()  # (a command run before in this process, a test's, may have lost its reader)
    try:
        yield
    except typer.Exit:
        if READER_GONE.is_set():
            raise typer.Exit(141) from None
        raise
    except KeyboardInterrupt:  # outside a run: nothing to abort
        sys.stderr.write("\naborted\n")
        _exit(130)
    except BrokenPipeError:  # the reader went away (``| head``) where ``write_out`` was not used
        write_out(sys.stdout, "")
        raise typer.Exit(141) from None
    except Exception as exc:
        if os.environ.get("AGENTLOOP_DEBUG"):
            raise
        if READER_GONE.is_set():  # (what failed once stdout was gone is no news to anyone)
            raise typer.Exit(141) from None
        message = str(exc) or type(exc).__name__
        _fail(
            message
            if isinstance(exc, CliError | ValueError | ImportError | MCPError | StoreError)
            else f"{type(exc).__name__}: {message}",
            exc.code if isinstance(exc, CliError) else 1,
        )
    else:
        if READER_GONE.is_set():
            raise typer.Exit(141)


def _settings(
    model: str | None,
    workspace: Path | None,
    system: str | None,
    tool_timeout: float | None = None,
    flags: LoopFlags | None = None,
    store: str | None = None,
    *,
    uses_store: bool = False,
) -> Settings:
    """The command's settings, its config warnings shown. A bad run limit (flag or config key)
    is a usage error, exit 2: running without a budget the user set is worse than not running.
    So is a bad store URL, for the commands that open the configured store (``uses_store``)."""
    settings = load_settings(
        model=model, system_prompt=system, tool_timeout=tool_timeout, workspace=workspace, flags=flags, store=store
    )
    for warning in settings.warnings:
        sys.stderr.write(f"warning: {one_line(warning, 1000)}\n")
    store_error = [settings.store_error] if uses_store and settings.store_error else []
    errors = list(dict.fromkeys([*settings.errors, *store_error]))  # (an unreadable file is in both)
    if errors:
        _fail("; ".join(errors), 2)
    return settings


def _workspace(settings: Settings) -> Path:
    path = expand_home(settings.workspace or Path.cwd(), "workspace")
    if not path.exists():
        raise CliError(f"workspace {path} does not exist")
    if not path.is_dir():
        raise CliError(f"workspace {path} is not a directory")
    return path.resolve()


def _data_directory(data: Path | None) -> Path:
    """The data directory (``--data``, else the environment's, see ``chat.data_dir``), made for
    its owner only if it is missing; CliError when it cannot be used."""
    from agentloop.cli.chat import data_dir, make_data_dir

    directory = data_dir(data)
    try:
        return make_data_dir(directory)
    except OSError as exc:
        raise CliError(f"cannot use the data directory {directory}: {exc.strerror or exc}") from exc


def _is_embedded(settings: Settings) -> bool:
    return parse_model_string(settings.model)[0] == "local"


def _build_agent(settings: Settings, workspace: Path, progress: Progress, hook: PolicyHook | None = None) -> Agent:
    from agentloop.tools.builtin import builtin_tools

    model = open_settings_model(settings, progress)
    agent = Agent(
        model=model,
        tools=builtin_tools(
            workspace,
            fetch_allow=settings.fetch_allow,
            shell_sandbox=settings.shell_sandbox,
            shell_sandbox_read=settings.shell_sandbox_read,
        ),
        system_prompt=settings.system_prompt,
        workspace=workspace,
        **loop_options(settings, progress),
    )
    if hook is not None:
        agent.hooks.before_tool_call(hook)
    return agent


def _model_problem(spec: str) -> str | None:
    """Why the hosted model ``spec`` cannot answer on this machine (no key, no SDK), or None."""
    try:
        provider = parse_model_string(spec)[0]
    except ValueError:
        return None  # (opening it says why)
    if provider not in HOSTED:
        return None
    usable, why = hosted_status(provider)
    return None if usable else why


def _check_model(settings: Settings) -> None:
    """A hosted model this machine has no key for would fail every message with the same error:
    refuse it before the first one, unless a fallback may answer instead."""
    if not settings.fallbacks and (why := _model_problem(settings.model)) is not None:
        raise CliError(
            f"{settings.model} (from {settings.model_source}) cannot be used here ({why}); "
            "pick another with --model (agentloop models lists them)"
        )


def _approval(spec: str) -> ApprovalSetting:
    try:
        setting = parse_approval(spec)
    except ValueError as exc:
        _fail(str(exc), 2)
    for warning in setting.warnings:
        sys.stderr.write(f"warning: {one_line(warning, 1000)}\n")
    return setting


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


def _run_hook(setting: ApprovalSetting, workspace: Path) -> PolicyHook | None:
    """``run``'s approval check: on a terminal an ask is a question on stderr answered on stdin;
    without one it is a tool error, because a script must not hang on a question nobody sees."""
    if setting.mode == "auto":
        return None
    ask = None
    if _stdin_is_terminal():
        from agentloop.cli.chat import PlainReader

        reader = PlainReader()
        err = stderr_console()

        async def ask_terminal(question: Question) -> UserAnswer:
            return await ask_user(question, reader.read_async, err, shows_prompt=False)

        ask = ask_terminal
    return PolicyHook(setting.policy, cwd=workspace, ask=ask)


def _exit(code: int) -> NoReturn:
    """Exit after an abort. A worker thread that cannot be cancelled (the embedded model copying
    a gigabyte, say) would keep the interpreter alive at exit; the user asked to stop, so stop."""
    if any(t is not threading.main_thread() and t.is_alive() and not t.daemon for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise typer.Exit(code)


def _run_once(agent: Agent, prompt: str, sink: EventSink, settings: Settings) -> tuple[RunResult, int]:
    interrupts = Interrupts()

    async def go() -> RunResult:
        assert agent.config.workspace is not None
        async with extra_tools(settings, agent.config.workspace) as extra:  # on the loop that uses them
            for tool in extra:
                agent.tools.setdefault(tool.name, tool)
            run = agent.start(prompt, stream=True)
            with interrupts.abort_on_signal(run):
                return await play(run, sink)

    loop = asyncio.new_event_loop()
    try:
        result = loop.run_until_complete(go())
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
    return result, interrupts.exit_code


# ---------------------------------------------------------------------------------- commands

ApprovalOpt = Annotated[
    str | None,
    typer.Option(
        "--approval",
        help="Tool calls: ask (default policy, asks before risky calls), auto (allow all), deny, or a JSON policy.",
    ),
]


@app.command()
def run(
    prompt: Annotated[
        str, typer.Argument(metavar="PROMPT", help="What to ask; '-' reads it from stdin.", show_default=False)
    ] = "",
    model: ModelOpt = None,
    workspace: WorkspaceOpt = None,
    system: SystemOpt = None,
    tool_timeout: Annotated[
        float | None, typer.Option("--tool-timeout", min=0.001, help="Seconds a tool may run (default 60).")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print every loop event as a JSON line.")] = False,
    approval: ApprovalOpt = None,
    max_rounds: MaxRoundsOpt = None,
    max_tool_calls: MaxToolCallsOpt = None,
    max_wall_clock: MaxWallClockOpt = None,
    max_tokens: MaxTokensOpt = None,
    max_cost: MaxCostOpt = None,
    fallback: FallbackOpt = None,
    reasoning: ReasoningOpt = None,
    max_concurrency: MaxConcurrencyOpt = None,
    tool_execution: ToolExecutionOpt = None,
) -> None:
    """Run one prompt to the end: the answer on stdout, tool activity on stderr."""
    with _guarded():
        flags = loop_flags(
            max_rounds,
            max_tool_calls,
            max_wall_clock,
            max_tokens,
            max_cost,
            fallback,
            reasoning=reasoning,
            max_concurrency=max_concurrency,
            tool_execution=tool_execution,
        )
        settings = _settings(model, workspace, system, tool_timeout, flags)
        setting = _approval(approval or "ask")
        if prompt == "-":
            prompt = sys.stdin.read()
        if not prompt.strip():
            raise CliError("empty prompt")
        ws = _workspace(settings)
        progress = Progress()
        hook = _run_hook(setting, ws)
        agent = _build_agent(settings, ws, progress, hook)
        _check_model(settings)
        if _is_embedded(settings):  # the first start takes minutes: never leave the user in silence
            progress(f"starting the embedded model {settings.model}…")
        sink: EventSink
        if json_output:
            sink = JsonRenderer(before_output=progress.done)
        else:
            sink = TextRenderer(on_wait=lambda waiting: None if waiting else progress.done())
        result, interrupted_code = _run_once(agent, prompt, sink, settings)
        progress.done()
        if hook is not None and hook.refused_without_terminal and not json_output:
            sys.stderr.write("note: some tool calls need approval; without a terminal, pass --approval auto\n")
        if result.stop_reason == "aborted":
            sys.stderr.write("aborted\n")
            _exit(interrupted_code)
        if result.stop_reason == "error":
            raise CliError(result.error or "the model call failed")
        if result.stop_reason not in ("stop", "length") and not json_output:
            sys.stderr.write(f"(stopped: {result.stop_reason})\n")


@app.command()
def chat(
    model: ModelOpt = None,
    workspace: WorkspaceOpt = None,
    system: SystemOpt = None,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            parser=data_path,
            help="Where conversations are kept (default: $AGENTLOOP_DATA, $XDG_DATA_HOME/agentloop, "
            "~/.local/share/agentloop).",
        ),
    ] = None,
    new: Annotated[bool, typer.Option("--new", help="Start a new conversation instead of continuing.")] = False,
    memory: Annotated[
        bool, typer.Option("--memory", help="Keep the conversation in memory only (gone when the chat ends).")
    ] = False,
    approval: ApprovalOpt = None,
    server: Annotated[
        str | None, typer.Option("--server", help="Chat with a running server (agentloop serve) at this URL.")
    ] = None,
    token: Annotated[
        str | None, typer.Option("--token", help="With --server: bearer token (default: $AGENTLOOP_TOKEN, config).")
    ] = None,
    pid: Annotated[str | None, typer.Option("--pid", help="With --server: talk to this process.")] = None,
    max_rounds: MaxRoundsOpt = None,
    max_tool_calls: MaxToolCallsOpt = None,
    max_wall_clock: MaxWallClockOpt = None,
    max_tokens: MaxTokensOpt = None,
    max_cost: MaxCostOpt = None,
    fallback: FallbackOpt = None,
    compaction_threshold: CompactionOpt = None,
    reasoning: ReasoningOpt = None,
    max_concurrency: MaxConcurrencyOpt = None,
    tool_execution: ToolExecutionOpt = None,
) -> None:
    """Talk with the agent. The conversation is kept: quit and come back to continue it."""

    with _guarded(), exit_on_terminate():
        flags = loop_flags(
            max_rounds,
            max_tool_calls,
            max_wall_clock,
            max_tokens,
            max_cost,
            fallback,
            compaction_threshold,
            reasoning,
            max_concurrency=max_concurrency,
            tool_execution=tool_execution,
        )
        if server is not None or pid is not None:
            if flags.given():  # the server's own settings decide; silently ignoring them would mislead
                _fail(f"{', '.join(flags.given())}: set run limits where the server runs (agentloop serve)", 2)
            local: dict[str, object] = {"--model": model, "--workspace": workspace, "--system": system}
            local |= {"--data": data, "--approval": approval, "--memory": memory or None}
            if given := [name for name, value in local.items() if value is not None]:
                _fail(f"{', '.join(given)}: a chat with a server runs on the server's settings (agentloop serve)", 2)
            if new and pid is not None:
                _fail("--new starts a new conversation and --pid continues one: give one of them", 2)
            from agentloop.cli.client import chat_command

            remote_aborted, remote_code = chat_command(server, token, new=new, pid=pid)
            if remote_aborted:
                _exit(remote_code)
            raise typer.Exit(remote_code)
        if token is not None:
            _fail("--token goes with --server (or --pid): a local chat needs none", 2)
        settings = _settings(model, workspace, system, flags=flags)
        setting = _approval(approval or "ask")
        ws = _workspace(settings)
        progress = Progress()
        err = stderr_console()
        if memory:
            if compaction_threshold is not None:
                _fail("--compaction-threshold: a --memory chat is never compacted (it needs the durable chat)", 2)
            repl, code = _memory_chat(settings, setting, ws, progress, err)
        else:
            repl, code = _durable_chat(settings, setting, ws, data, new, progress, err)
        if repl.aborted:
            _exit(code)
        raise typer.Exit(code)


def _memory_chat(
    settings: Settings, setting: ApprovalSetting, ws: Path, progress: Progress, err: Console
) -> tuple[ChatRepl, int]:
    """The chat on an in-memory agent, with the same extra tools (MCP servers, CodeMode) as the
    other commands, started on the REPL's one event loop and stopped when it ends."""
    from agentloop.cli.chat import AgentSession, ChatRepl

    hook = None if setting.mode == "auto" else PolicyHook(setting.policy, cwd=ws, ask=None)
    agent = _build_agent(settings, ws, progress, hook)
    _check_model(settings)
    ev = asyncio.new_event_loop()
    stack = AsyncExitStack()
    try:
        for tool in ev.run_until_complete(stack.enter_async_context(extra_tools(settings, ws))):
            agent.tools.setdefault(tool.name, tool)
        _chat_banner(err, settings, ws)
        repl = ChatRepl(AgentSession(agent, hook=hook), err=err, progress=progress)
        code = repl.loop(ev)
    finally:
        try:
            ev.run_until_complete(stack.aclose())
            ev.run_until_complete(ev.shutdown_asyncgens())
        finally:
            ev.close()
    return repl, code


def _chat_banner(err: Console, settings: Settings, ws: Path) -> None:
    from agentloop.cli.chat import HELP

    err.print(Text(f"agentloop chat · {settings.model} ({settings.model_source}) · {ws}", style="bold"))
    if _is_embedded(settings):
        err.print(Text("the embedded model loads with your first message (a first start takes minutes)", style="dim"))
    err.print(Text(HELP, style="dim"))


def _durable_chat(
    settings: Settings,
    setting: ApprovalSetting,
    ws: Path,
    data: Path | None,
    new: bool,
    progress: Progress,
    err: Console,
) -> tuple[ChatRepl, int]:
    """The chat on a durable process. The kernel stays open for the whole REPL, entered and left
    on the REPL's one event loop, so runs it resumes keep going between turns' reads."""
    from agentloop.cli.chat import (
        ChatRepl,
        ChatState,
        DurableSession,
        history_file,
        local_user,
    )
    from agentloop.kernel import Kernel

    directory = _data_directory(data)
    model = open_settings_model(settings, progress)
    options = kernel_options(settings, progress)
    ev = asyncio.new_event_loop()
    stack = AsyncExitStack()
    kernel: Kernel | None = None
    try:
        extra = ev.run_until_complete(stack.enter_async_context(extra_tools(settings, ws)))
        kernel = ev.run_until_complete(
            stack.enter_async_context(
                Kernel.open(
                    f"sqlite:///{directory.resolve()}/agentloop.db",
                    model=model,
                    workspace=ws,
                    system_prompt=settings.system_prompt,
                    data_dir=directory,
                    extra_tools=extra,
                    **setting.kernel_options(owner=local_user()),
                    **options,
                )
            )
        )
        # /model names the default as the user gave it ("scripted:/path/file.json"), not by the model's
        # info (which says "scripted:scripted")
        kernel.models.default = settings.model
        session = DurableSession(kernel, owner=local_user(), cwd=ws, state=ChatState(directory / "chat.json"))
        count = ev.run_until_complete(session.open(new=new))
        choice = ev.run_until_complete(session.process.model())
        if choice.source == "default":
            _check_model(settings)
        _chat_banner(err, settings, ws)
        if count is None:
            err.print(Text(f"new conversation {session.pid}", style="dim"))
        else:
            err.print(
                Text(f"continuing conversation {session.pid} ({count} messages) · --new starts afresh", style="dim")
            )
        if choice.source != "default" and not settings.fallbacks and (why := _model_problem(choice.effective)):
            # its own model (or its account's): refusing would leave no way to /model it back
            err.print(
                Text(
                    f"warning: this conversation's model {choice.effective} cannot be used here ({why}); "
                    f"/model picks another (/model default: {settings.model})",
                    style="yellow",
                )
            )
        repl = ChatRepl(session, err=err, progress=progress, history=history_file(directory))
        if ev.run_until_complete(session.unfinished()):
            err.print(Text("(the last answer was unfinished; it goes on)", style="dim"))
            ev.run_until_complete(repl.resume())
        code = repl.loop(ev)
    finally:
        try:
            _cancel_pending(ev, kernel)  # a turn cut short (SIGTERM) stops before the kernel closes under it
            ev.run_until_complete(stack.aclose())
            ev.run_until_complete(ev.shutdown_asyncgens())
        finally:
            ev.close()
    return repl, code


def _cancel_pending(ev: asyncio.AbstractEventLoop, kernel: Kernel | None = None) -> None:
    """Cancel, and wait out, what a ``run_until_complete`` that was interrupted left running. It
    is the kernel's shutdown (``closing``), not an abort: a Task waiting on a subagent leaves it
    to finish, and the call finds it again when the turn resumes at the next start."""
    if kernel is not None:
        kernel.engine.closing = True
    pending = [task for task in asyncio.all_tasks(ev) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        ev.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


def _local_status() -> list[tuple[str, bool, str]]:
    """Embedded models as ``(bare id, usable, why)``; a missing module becomes an install hint."""
    try:
        from agentloop.models.local import local_model_status

        rows = list(local_model_status())
    except Exception as exc:
        ids = [info.id for info in CATALOG.values() if info.provider == "local"]
        return [(i, False, f"pip install 'agentloop[local]' ({one_line(str(exc), 80)})") for i in ids]
    return [(i.removeprefix("local:"), usable, why) for i, usable, why in rows]


def _facts(provider: str, model_id: str) -> tuple[str, str]:
    """Context window and price in/out per million tokens, when the catalog knows the model."""
    info = CATALOG.get(f"{provider}:{model_id}")
    if info is None:
        return "", ""
    price = "free" if provider == "local" else f"${info.input_cost:g} / ${info.output_cost:g}"
    return f"{info.context_window // 1000}k", price


@app.command()
def models() -> None:
    """List providers and models, whether each is usable here, and which one is the default."""
    with _guarded():
        settings = load_settings()  # run limits do not matter to a listing: no exit over a bad one
        for warning in dict.fromkeys([*settings.warnings, *settings.errors, *filter(None, [settings.store_error])]):
            sys.stderr.write(f"warning: {one_line(warning, 1000)}\n")
        # (provider, model id, usable, why) — a provider's reason is given once, on its first row
        rows: list[tuple[str, str, bool, str]] = []
        for provider in HOSTED:
            usable, why = hosted_status(provider)
            ids = [info.id for info in CATALOG.values() if info.provider == provider]
            rows.extend((provider, model_id, usable, why if n == 0 else "") for n, model_id in enumerate(ids))
        rows.extend(("local", model_id, usable, why) for model_id, usable, why in _local_status())
        rows.append(("scripted", "<file.json>", True, "replies from a JSON file (tests, demos)"))

        table = Table(title="models (* = default)", title_justify="left")
        table.add_column("model", no_wrap=True)
        table.add_column("context", justify="right", no_wrap=True)
        table.add_column("$/Mtok in/out", no_wrap=True)
        table.add_column("usable", no_wrap=True)
        table.add_column("why", overflow="fold")
        previous = ""
        for provider, model_id, usable, why in rows:
            if previous and provider != previous:
                table.add_section()
            previous = provider
            name = f"{provider}:{model_id}"
            default = name == settings.model
            table.add_row(
                Text(name + (" *" if default else ""), style="bold" if default else ""),
                *_facts(provider, model_id),
                Text("yes", style="green") if usable else Text("no", style="red"),
                Text(why),  # plain text: "agentloop[local]" is not rich markup
            )
        console = Console(soft_wrap=False)
        console.print(table)
        listed = any(f"{p}:{m}" == settings.model for p, m, _, _ in rows)
        console.print(
            Text(f"default: {settings.model} (from {settings.model_source})" + ("" if listed else " — not listed"))
        )


def _register_commands() -> None:
    """Commands kept in their own modules (imported here, after every helper they use exists)."""
    from agentloop.cli import admin, client, discord, serve, telegram, whatsapp

    serve.register(app)
    admin.register(app)
    client.register(app)
    telegram.register(app)
    whatsapp.register(app)
    discord.register(app)


_register_commands()


if __name__ == "__main__":
    app()
