"""``agentloop serve``: the durable kernel behind HTTP, SSE and WebSocket on one port.

The server owns one kernel on ``<data>/agentloop.db``, or on the store ``--store`` (or
``AGENTLOOP_STORE``, or the config file's ``store``) names: several servers may share one
PostgreSQL database, each advancing the processes whose lease it holds (``process/lease.py``); the
data directory still holds their archives and media, so they should share it too. Opening it
resumes whatever runs were unfinished when the last server stopped or crashed. On a fresh
database the first start creates the ``admin`` account and prints its token once (the store keeps only its hash).

Shutdown is graceful on SIGINT/SIGTERM: stop accepting, end event streams cleanly (``ctx.stopping``),
give open connections a bounded time to finish, then close the kernel, so every tick that got
going commits and the next start resumes the rest. uvicorn's own signal capture is switched off:
it re-raises the signal after shutdown, which would kill the process before the kernel closes.

``--chat`` runs the server in a background thread of the same process and opens the chat client
against it over HTTP with a token minted for the session (revoked at exit): the one command that
starts everything and talks to it.

``--telegram``, ``--whatsapp`` and ``--discord`` (or the config file's ``[bridges]`` table) host the
chat bridges on the server's kernel, each from its command's own options (``cli.channel``): one
process, so one runtime on the embedded database, which refuses a second one (a bridge of its own
next to the server needed PostgreSQL). They start once the kernel is open, before the port
accepts; one that cannot start (a refused token) closes what had started, the kernel last, and
ends serve with one ``error:`` line. At shutdown they close after the server and before the kernel;
one that stops by itself (a token revoked meanwhile) stops serve, as it stops its command.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import shlex
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TextIO, TypeVar

import typer

from agentloop.agent import Agent
from agentloop.cli.approvals import ApprovalSetting, PolicyHook
from agentloop.cli.channel import Bridge, HostedBridge
from agentloop.cli.config import (
    BRIDGES,
    Settings,
    config_path,
    kernel_extras,
    loop_options,
    open_settings_model,
    read_config_file,
)
from agentloop.cli.options import (
    CompactionOpt,
    DataOpt,
    FallbackOpt,
    MaxConcurrencyOpt,
    MaxCostOpt,
    MaxRoundsOpt,
    MaxTokensOpt,
    MaxToolCallsOpt,
    MaxWallClockOpt,
    ModelOpt,
    ReasoningOpt,
    StoreOpt,
    SystemOpt,
    ToolExecutionOpt,
    TranscribeKeyEnvOpt,
    TranscribeModelOpt,
    TranscribeUrlOpt,
    WorkspaceOpt,
    loop_flags,
)
from agentloop.cli.render import Progress
from agentloop.sockets import listening_socket

if TYPE_CHECKING:  # (the server extra may be missing: imported where it is used)
    from agentloop.kernel import Kernel
    from agentloop.models.transcribe import OpenAITranscriber
    from agentloop.server.auth import Accounts

T = TypeVar("T")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
SHUTDOWN_TIMEOUT = 5  # seconds open connections get to finish once shutdown begins
TOKEN_NOTE = "store it now: it is shown only this once (agentloop token create makes more)"


@dataclass
class ServeOptions:
    """Everything ``serve`` decided before the server starts."""

    host: str
    port: int
    data: Path
    workspace: Path
    settings: Settings
    approval: ApprovalSetting
    shutdown_timeout: int = SHUTDOWN_TIMEOUT
    max_processes: int | None = None  # per account (None: the server's default)
    max_inputs_per_minute: int | None = None  # per account (None: the server's default)
    account_budget: float | None = None  # dollars per account and calendar month (None: no budget)
    transcriber: OpenAITranscriber | None = None  # audio sent to a process is transcribed (None: refused)
    bridges: list[HostedBridge] = field(default_factory=list)  # chat bridges started on the kernel
    device_account_tokens: bool = False  # a driver may connect with an account token (deprecated)
    device_reconnect_wait: float | None = None  # seconds a call waits for its device to come back (None: 30)
    out: TextIO = field(default_factory=lambda: sys.stdout)  # the URL and the first token go here


@dataclass
class Running:
    """A started server: what a caller needs to talk to it and to stop it."""

    url: str
    ctx: Any  # ServerContext (imported lazily: the server extra may be missing)
    server: Any  # _Server
    loop: asyncio.AbstractEventLoop

    def stop(self) -> None:
        """Begin a graceful shutdown; safe to call from any thread, more than once."""
        self.loop.call_soon_threadsafe(self._stop)

    def _stop(self) -> None:
        self.ctx.stopping.set()
        self.server.should_exit = True


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def url_of(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{port}"


def _server_class() -> Any:
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn without its signal capture: ``serve_async`` handles the signals itself."""

        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            yield

    return _Server


async def serve_async(
    opts: ServeOptions,
    *,
    signals: bool = True,
    on_ready: Callable[[Running], Awaitable[None] | None] | None = None,
) -> None:
    """Open the kernel, start the server, and run until stopped (a signal when ``signals``, or
    ``Running.stop``). ``on_ready`` is called once the port accepts connections. The transcriber
    is closed at the end whatever happened (a taken port, a missing extra), after the kernel."""
    try:
        await _serve(opts, signals=signals, on_ready=on_ready)
    finally:
        if opts.transcriber is not None:
            await opts.transcriber.close()


async def _serve(
    opts: ServeOptions,
    *,
    signals: bool,
    on_ready: Callable[[Running], Awaitable[None] | None] | None,
) -> None:
    try:
        import uvicorn

        from agentloop.server.app import create_server
        from agentloop.server.auth import Accounts, Principal
        from agentloop.server.context import ServerContext
        from agentloop.server.devices import DeviceHub
        from agentloop.server.engine_chat import STATELESS_ASK
    except ImportError as exc:
        raise ImportError(f"the server needs an optional dependency: pip install 'agentloop[server]' ({exc})") from exc
    from agentloop.cli.tooling import extra_tools
    from agentloop.kernel import Kernel
    from agentloop.tools.builtin import builtin_tools

    settings = opts.settings
    sock = listening_socket(opts.host, opts.port, backlog=2048)
    try:
        progress = Progress()
        model = open_settings_model(settings, progress)
        # devices connect over the WebSocket, each with its device token (an account token only with
        # --device-account-tokens); the kernel routes their owners' calls
        hub = DeviceHub(account_tokens=opts.device_account_tokens)
        if opts.device_reconnect_wait is not None:
            hub.reconnect_wait = opts.device_reconnect_wait
        # what Agent takes (its stateless asks run their tool calls as the processes' do), and the kernel
        loop = loop_options(settings, progress)
        options = {**loop, **kernel_extras(settings)}
        async with (
            extra_tools(settings, opts.workspace) as extra,
            Kernel.open(
                settings.store or f"sqlite:///{opts.data.resolve()}/agentloop.db",  # None: <data>/agentloop.db
                model=model,
                workspace=opts.workspace,
                system_prompt=settings.system_prompt,
                data_dir=opts.data,
                devices=hub,
                extra_tools=extra,
                transcriber=opts.transcriber,
                **opts.approval.kernel_options(),
                **options,
            ) as kernel,
        ):
            accounts = Accounts(kernel.store)
            first = await _first_start(accounts)
            if first is not None:
                _say(opts.out, f"created the admin account; its token: {first}")
                _say(opts.out, TOKEN_NOTE)
            ctx = ServerContext(kernel, accounts, devices=hub)
            if opts.max_processes is not None:
                ctx.max_processes = opts.max_processes
            if opts.max_inputs_per_minute is not None:
                ctx.max_inputs_per_minute = opts.max_inputs_per_minute
            ctx.limit_spending(opts.account_budget)
            tools = [
                *builtin_tools(
                    opts.workspace,
                    fetch_allow=settings.fetch_allow,
                    shell_sandbox=settings.shell_sandbox,
                    shell_sandbox_read=settings.shell_sandbox_read,
                ),
                *extra,
            ]

            def agent_factory() -> Agent:
                """``/engine/chat``'s agent: the server's model and built-in tools, fresh per request
                (``under_policy`` then puts its caller's approval policy on it)."""
                agent = Agent(
                    model=model, tools=tools, system_prompt=settings.system_prompt, workspace=opts.workspace, **loop
                )
                agent.config.off_limits = kernel.off_limits  # the Search tool walks around the kernel's data
                return agent

            def under_policy(who: Principal, agent: Agent) -> None:
                """A ``/engine/chat`` request's agent under its caller's account's approval policy, the
                one that account's processes are checked against, as in force now (its file's and the
                server-wide file's edits too); an admin's is its own account's, as its processes'
                are. Nobody can answer a question in a stateless request, so a call the policy would
                ask about is refused as a tool error."""
                if kernel.policies is None:  # (``--approval auto``: nothing is checked)
                    return
                agent.hooks.before_tool_call(
                    PolicyHook(
                        kernel.policies.of(who.account),
                        cwd=opts.workspace,
                        ask=None,
                        unanswerable=STATELESS_ASK,
                        protected=kernel.off_limits,
                    )
                )

            config = uvicorn.Config(
                create_server(ctx, agent_factory, for_caller=under_policy),
                host=opts.host,
                port=sock.getsockname()[1],
                log_level="warning",
                access_log=False,  # an access log is one misconfiguration away from logging credentials
                lifespan="off",
                timeout_graceful_shutdown=max(1, round(opts.shutdown_timeout)),
            )
            server = _server_class()(config)
            running = Running(url_of(opts.host, sock.getsockname()[1]), ctx, server, asyncio.get_running_loop())

            async def close_devices_when_stopping() -> None:
                # Driver sockets belong to the hub, not to a request: close them as soon as the
                # shutdown begins, so uvicorn's graceful wait is not spent waiting for them.
                await ctx.stopping.wait()
                await hub.close()

            devices_closer = asyncio.ensure_future(close_devices_when_stopping())
            bridges = _Bridges(opts, running)
            with _signals(running, signals):
                task: asyncio.Future[None] | None = None
                try:
                    # (one that cannot start ends serve before the port accepts; a signal meanwhile
                    # ends its start, which may wait long for a network that does not answer)
                    await _unless_stopping(bridges.start(kernel), ctx.stopping)
                    if not server.should_exit:  # (a signal while the bridges started: nothing to serve)
                        task = asyncio.ensure_future(server.serve(sockets=[sock]))
                        while not server.started and not task.done():
                            await asyncio.wait({task}, timeout=0.05)
                        if server.started:
                            _say(opts.out, f"agentloop serving on {running.url}")
                            _say(opts.out, f"web UI: {running.url}/ (sign in with a token)")
                            if opts.transcriber is not None:
                                _say(opts.out, f"audio sent to processes is transcribed ({opts.transcriber!r})")
                            if on_ready is not None:
                                result = on_ready(running)
                                if result is not None:
                                    await result
                        await task
                finally:
                    ctx.stopping.set()
                    if task is not None and not task.done():
                        server.should_exit = True
                        await asyncio.gather(task, return_exceptions=True)
                    devices_closer.cancel()
                    try:
                        await bridges.close()  # no new input from the chats once the runs are to stop
                    finally:
                        await hub.close()  # before the kernel: in-flight device calls fail, then runs stop
    finally:
        sock.close()


async def _unless_stopping(work: Coroutine[Any, Any, None], stopping: asyncio.Event) -> None:
    """``work``, cancelled if ``stopping`` is set first (its failure raised here)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        task.cancel()  # (nothing if it is done)
        await asyncio.gather(task, stopped, return_exceptions=True)
    if not task.cancelled():
        task.result()


class _Bridges:
    """The chat bridges serve hosts (``ServeOptions.bridges``), on its kernel: started in order,
    watched (one that stops by itself stops serve, as it would stop its own command), and closed
    the last started first, every one of them even when one fails."""

    def __init__(self, opts: ServeOptions, running: Running) -> None:
        self.opts = opts
        self.running = running
        self.started: list[tuple[str, Bridge]] = []
        self.watchers: list[asyncio.Future[None]] = []
        self.ended: list[str] = []  # the bridges that stopped while serve did not

    async def start(self, kernel: Kernel) -> None:
        from agentloop.cli.main import CliError

        for hosted in self.opts.bridges:
            try:
                bridge, listening = await hosted.start(kernel, self.opts.settings)
            except CliError as exc:  # (what the command would say, naming the bridge: serve hosts several)
                raise CliError(f"the {hosted.name} bridge cannot start: {exc}", exc.code) from None
            self.started.append((hosted.name, bridge))
            self.watchers.append(asyncio.ensure_future(self._watch(hosted.name, bridge)))
            _say(self.opts.out, f"agentloop {hosted.name}: {listening}")

    async def _watch(self, name: str, bridge: Bridge) -> None:
        why = ""
        try:
            await bridge.wait()
        except Exception as exc:  # (ended all the same: serve must not go on without it, unsaid)
            why = f" ({type(exc).__name__})"  # (its name only: a message may quote a URL with a token)
        if not self.running.ctx.stopping.is_set():
            self.ended.append(name)
            sys.stderr.write(f"agentloop: the {name} bridge stopped{why}, so serve stops\n")
            sys.stderr.flush()
            self.running.stop()

    async def close(self) -> None:
        """Close the started bridges; then raise the first failure (a Discord token revoked while
        serving, say), or say which bridge ended serve: an exit 0 would tell a supervisor all is well."""
        from agentloop.cli.main import CliError

        for watcher in self.watchers:
            watcher.cancel()
        await asyncio.gather(*self.watchers, return_exceptions=True)
        failure: Exception | None = None
        while self.started:
            name, bridge = self.started.pop()
            try:
                await bridge.close()
            except CliError as exc:
                failure = failure or CliError(f"the {name} bridge stopped: {exc}", exc.code)
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        if self.ended:
            raise CliError(f"the {', '.join(self.ended)} bridge stopped (its log above says why)")


async def _first_start(accounts: Accounts) -> str | None:
    """The admin's first token on a fresh store (``Accounts.bootstrap``), else None. Servers that
    share a PostgreSQL store may start together on a fresh one: each sees no account, and all but
    the first fail to create ``admin``. That one prints the token; the others just serve."""
    from agentloop.server.auth import ADMIN, AccountError

    try:
        return await accounts.bootstrap()
    except AccountError:
        if await accounts.store.get_account(ADMIN) is None:
            raise  # not the race: something else is wrong
        return None


@contextlib.contextmanager
def _signals(running: Running, install: bool) -> Generator[None, None, None]:
    """SIGINT/SIGTERM begin a graceful shutdown; a second one while it is under way forces it."""
    loop = running.loop
    installed: list[signal.Signals] = []
    handled: list[int] = []

    def handler(signum: int) -> None:
        handled.append(signum)
        if running.server.should_exit:
            running.server.force_exit = True
        else:
            sys.stderr.write("agentloop: stopping (again to force)\n")
            sys.stderr.flush()
        running.server.handle_exit(signum, None)  # also tells sse-starlette, which patches it
        running.ctx.stopping.set()

    if install and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, handler, int(sig))
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        if handled:  # (this server has stopped: others this process starts later stream as usual)
            from agentloop.server.events import streams_may_run_again

            streams_may_run_again()


def _say(out: TextIO, line: str) -> None:
    out.write(line + "\n")
    out.flush()


# ---------------------------------------------------------------------------------- --chat


class BackgroundServer:
    """``serve_async`` on its own thread and event loop, so the chat can run on the main thread
    (terminal input and Ctrl-C belong there)."""

    def __init__(self, opts: ServeOptions, *, start_timeout: float = 600.0) -> None:
        self.opts = opts
        self.start_timeout = start_timeout
        self.running: Running | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="agentloop-server", daemon=True)

    def _main(self) -> None:
        async def ready(running: Running) -> None:
            self.running = running
            self._ready.set()

        try:
            asyncio.run(serve_async(self.opts, signals=False, on_ready=ready))
        except BaseException as exc:
            self.error = exc
        finally:
            self._ready.set()

    def start(self) -> Running:
        self._thread.start()
        self._ready.wait(self.start_timeout)
        if self.running is None:
            if self.error is not None:
                raise self.error
            raise RuntimeError("the server did not start")
        return self.running

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run ``coro`` on the server's loop (where its kernel and store live) and wait for it."""
        if self.running is None:
            coro.close()
            raise RuntimeError("the server is not running")
        return asyncio.run_coroutine_threadsafe(coro, self.running.loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        if self.running is not None and self._thread.is_alive():
            self.running.stop()
        self._thread.join(timeout)


def serve_and_chat(opts: ServeOptions, *, new: bool, pid: str | None) -> tuple[bool, int]:
    """Start the server in the background and chat with it over HTTP; returns (aborted, exit code)."""
    from agentloop.cli.render import exit_on_terminate

    with exit_on_terminate():  # the server stops and the session token is revoked on the way out
        return _serve_and_chat(opts, new=new, pid=pid)


def _serve_and_chat(opts: ServeOptions, *, new: bool, pid: str | None) -> tuple[bool, int]:
    from agentloop.cli.client import remote_chat
    from agentloop.cli.main import CliError
    from agentloop.client import ClientError
    from agentloop.server.auth import ADMIN

    background = BackgroundServer(opts)
    running = background.start()
    try:
        accounts = running.ctx.accounts
        token, record = background.call(accounts.create_token(ADMIN, label="serve --chat session"))
        try:
            return remote_chat(running.url, token, new=new, pid=pid, cwd=None)
        except ClientError as exc:  # (``--pid nope``: the server's own words, as ``chat --server`` says them)
            raise CliError(exc.message) from None
        finally:
            with contextlib.suppress(Exception):
                background.call(accounts.revoke(record.id))
    finally:
        background.stop(opts.shutdown_timeout + 30.0)


# ---------------------------------------------------------------------------------- the command


def register(app: typer.Typer) -> None:
    app.command()(serve)


def serve(
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on (loopback unless you mean otherwise).")
    ] = DEFAULT_HOST,
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port (0 picks a free one).")] = DEFAULT_PORT,
    data: DataOpt = None,
    model: ModelOpt = None,
    workspace: WorkspaceOpt = None,
    system: SystemOpt = None,
    approval: Annotated[
        str,
        typer.Option(
            "--approval",
            help="Tool calls: ask (default policy: risky calls wait for approval), auto, deny, or a JSON policy.",
        ),
    ] = "ask",
    chat: Annotated[
        bool, typer.Option("--chat", help="Also chat with the server from this terminal (or from stdin).")
    ] = False,
    new: Annotated[bool, typer.Option("--new", help="With --chat: start a new conversation.")] = False,
    pid: Annotated[str | None, typer.Option("--pid", help="With --chat: talk to this process.")] = None,
    store: StoreOpt = None,
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
    max_processes: Annotated[
        int | None,
        typer.Option(
            "--max-processes",
            min=1,
            help="Live top-level processes an account may have, subagents aside (admins: no limit; default 1000).",
        ),
    ] = None,
    max_inputs_per_minute: Annotated[
        int | None,
        typer.Option(
            "--max-inputs-per-minute",
            min=1,
            help="Messages and events an account may send per minute (admins are not limited; default 60).",
        ),
    ] = None,
    account_budget: Annotated[
        float | None,
        typer.Option(
            "--account-budget",
            min=0.01,
            help="Dollars an account may spend per calendar month (UTC), at catalog prices; past it new input"
            " is refused with 402 (admins are not limited; default: no budget).",
        ),
    ] = None,
    device_account_tokens: Annotated[
        bool,
        typer.Option(
            "--device-account-tokens",
            help="Deprecated: let a device connect with an account token, as before device tokens (default: "
            "only with its own device token, from 'agentloop device token NAME').",
        ),
    ] = False,
    device_reconnect_wait: Annotated[
        float | None,
        typer.Option(
            "--device-reconnect-wait",
            min=0,
            help="Seconds a tool call to a device that is offline (or dropped an idempotent call) waits for it to "
            "connect again before it fails (default 30; 0: no wait).",
        ),
    ] = None,
    transcribe_model: TranscribeModelOpt = None,
    transcribe_url: TranscribeUrlOpt = None,
    transcribe_key_env: TranscribeKeyEnvOpt = None,
    telegram: Annotated[
        str | None,
        typer.Option(
            "--telegram",
            metavar="OPTIONS",
            help="Also run the Telegram bridge on this server's kernel, with agentloop telegram's options in one "
            "quoted string ('--allow 123456789'); its token from TELEGRAM_BOT_TOKEN, as there.",
        ),
    ] = None,
    whatsapp: Annotated[
        str | None,
        typer.Option(
            "--whatsapp",
            metavar="OPTIONS",
            help="Also run the WhatsApp bridge (its webhook on a port of its own), with agentloop whatsapp's "
            "options in one quoted string; its secrets from the WHATSAPP_* variables, as there.",
        ),
    ] = None,
    discord: Annotated[
        str | None,
        typer.Option(
            "--discord",
            metavar="OPTIONS",
            help="Also run the Discord bridge, with agentloop discord's options in one quoted string; "
            "its token from DISCORD_BOT_TOKEN, as there.",
        ),
    ] = None,
) -> None:
    """Serve the durable kernel over HTTP, SSE and WebSocket (prints the URL; the first start
    prints the admin token once). The run limits apply to every process it runs, the chat
    bridges' (--telegram, --whatsapp, --discord) too."""
    from agentloop.cli.channel import bridge_log, open_transcriber
    from agentloop.cli.main import (
        CliError,
        _approval,
        _data_directory,
        _exit,
        _fail,
        _guarded,
        _model_problem,
        _settings,
        _workspace,
    )

    with _guarded():
        if not chat and (new or pid is not None):
            _fail("--new and --pid choose the conversation of --chat: give --chat too", 2)
        if not host.strip():  # (``--host "$HOST"`` with HOST unset: a warning about "listening on ," came first)
            _fail(f"--host is empty: name the address to listen on (default {DEFAULT_HOST})", 2)
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
        settings = _settings(model, workspace, system, flags=flags, store=store, uses_store=True)
        setting = _approval(approval)
        ws = _workspace(settings)
        directory = _data_directory(data)
        try:  # (the channels' flags and config keys: audio sent over the API is transcribed as theirs is)
            transcriber = open_transcriber(transcribe_model, transcribe_url, transcribe_key_env)
        except ValueError as exc:
            _fail(str(exc), 2)
        bridges = _hosted_bridges({"telegram": telegram, "whatsapp": whatsapp, "discord": discord}, transcriber)
        if not settings.fallbacks and (why := _model_problem(settings.model)) is not None:
            # not refused, as ``run`` and ``chat`` refuse it: an account's own model may answer instead;
            # but without a word, every message to the others failed with no hint why before the first
            sys.stderr.write(
                f"warning: {settings.model} (from {settings.model_source}) cannot be used here ({why}): "
                "processes on it will fail until it can; --model picks another (agentloop models lists them)\n"
            )
        if not is_loopback(host):
            sys.stderr.write(
                f"warning: listening on {host}, not loopback: anyone who can reach this port can try tokens; "
                "put TLS in front of it\n"
            )
        if device_account_tokens:
            sys.stderr.write(
                "warning: --device-account-tokens is deprecated: devices may connect with account tokens, "
                "which are good for every call of the account; give each device its own token "
                "('agentloop device token NAME') and drop the flag\n"
            )
        opts = ServeOptions(
            host,
            port,
            directory.resolve(),
            ws,
            settings,
            setting,
            max_processes=max_processes,
            max_inputs_per_minute=max_inputs_per_minute,
            account_budget=account_budget,
            transcriber=transcriber,
            bridges=bridges,
            device_account_tokens=device_account_tokens,
            device_reconnect_wait=device_reconnect_wait,
        )
        try:
            if chat:
                opts.out = sys.stderr  # stdout carries the answers
                aborted, code = serve_and_chat(opts, new=new, pid=pid)
                if aborted:
                    _exit(code)
                raise typer.Exit(code)
            with bridge_log() if bridges else contextlib.nullcontext():
                asyncio.run(serve_async(opts))
        except OSError as exc:  # the port is taken, the address does not exist …
            raise CliError(str(exc)) from exc


def _hosted_bridges(flags: dict[str, str | None], transcriber: OpenAITranscriber | None) -> list[HostedBridge]:
    """The bridges serve hosts: each one's flag, else its entry in the config file's ``[bridges]``
    (a flag replaces the entry of its bridge), made by its own command from those options
    (``channel.hosted_bridge``), so every check it makes is made before anything is opened."""
    from agentloop.cli.channel import hosted_bridge
    from agentloop.cli.main import _fail

    file = read_config_file(config_path())[0]
    if file.bridges_error is not None and not all(flags.get(name) is not None for name in BRIDGES):
        _fail(file.bridges_error, 2)  # (a bridge written down and not started would go unnoticed)
    hosted: list[HostedBridge] = []
    for name in BRIDGES:
        given = flags.get(name)
        if given is None:
            if name not in file.bridges:
                continue
            options = list(file.bridges[name])
        else:
            try:
                options = shlex.split(given)
            except ValueError as exc:  # (an unclosed quotation)
                _fail(f"--{name}: {exc}", 2)
        hosted.append(hosted_bridge(name, options, transcriber))
    return hosted
