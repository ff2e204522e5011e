"""Tools from MCP servers (the official ``mcp`` SDK, extra ``agentloop[mcp]``).

An MCP server is a separate program (started over stdio) or a URL (Streamable HTTP). Each one is
held open by :class:`MCPConnection` for as long as the agent or kernel lives; its tools become
agentloop tools named ``<server>__<tool>``, so two servers may both have a ``search``. A server
configured with ``expose=False`` keeps its tools out of the model's tool list: they are reached
through the single ``mcp`` tool instead, which lists and calls them on request, and keeps a server
with dozens of tools from filling the context window.

Failures stay tool results: a server that cannot start is an error when the toolset opens (with
the tail of the server's stderr, which is otherwise kept out of the terminal), and a server that
dies later turns its calls into error results; the next call starts it again. So does a server
whose calls time out ``restart_after_timeouts`` times in a row: it is taken for wedged (stuck in a
loop, deadlocked), stopped (a program's process is killed) and started afresh by the next call.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import contextvars
import hashlib
import json
import logging
import re
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentloop.images import image_size, sniff_image
from agentloop.messages import ImageContent, TextContent
from agentloop.tools.base import (
    MAX_RESULT_CHARS,
    ResultBlock,
    Tool,
    ToolArgumentsError,
    ToolContext,
    ToolError,
    ToolResult,
    format_validation_error,
)
from agentloop.tools.fs import MAX_IMAGE_BYTES
from agentloop.tools.process_group import end_group
from agentloop.urls import redact_url

log = logging.getLogger("agentloop.mcp")

__all__ = ["MCPConnection", "MCPServerConfig", "mcp_tools"]

_NAME = r"[A-Za-z0-9_-]{1,40}"
_CONNECTION_CLOSED = -32000  # JSON-RPC code the SDK gives a request whose connection ended
_REQUEST_TIMEOUT = -32001  # JSON-RPC code the SDK gives a request that waited out its read timeout
STDERR_TAIL_BYTES = 8192  # of a server's stderr, what an error about it quotes from
STDERR_KEEP_BYTES = 1 << 20  # of a server's stderr, what its file may grow to before it is cut to its tail
STDERR_CHECK_EVERY = 2.0  # seconds between looks at that size while a server runs
MAX_DETAILS_CHARS = MAX_RESULT_CHARS  # structured output kept with a result, as JSON
HTTP_TIMEOUT = 30.0  # seconds to connect to (or send to) an HTTP server: the SDK's own default
HTTP_READ_TIMEOUT = 300.0  # seconds an HTTP answer may pause: the SDK's default, or a call's `timeout` if longer
GROUP_GRACE = 2.0  # seconds a stopped stdio server's leftover processes get after SIGTERM, before SIGKILL


class _OneLine(logging.Filter):
    """The SDK logs a full traceback for every line a server writes to stdout that is not
    JSON-RPC (a banner, a debug print): fifty lines on the user's terminal for one stray print.
    Keep one line per record, naming what went wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            first = (_describe(record.exc_info[1]).splitlines() or [""])[0]
            record.msg, record.args = f"{record.getMessage()}: {first}"[:300], None
            record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("mcp.client.stdio").addFilter(_OneLine())


class MCPServerConfig(BaseModel):
    """One MCP server: a ``command`` to start (stdio) or a ``url`` (Streamable HTTP)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=f"^{_NAME}$", description="Prefix of its tools' names: <name>__<tool>.")
    command: str | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] | None = None
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = Field(default_factory=dict, description="HTTP headers (e.g. Authorization).")
    expose: bool = Field(True, description="List its tools to the model; otherwise reach them through `mcp`.")
    tools: list[str] | None = Field(None, description="Only these of its tools (all when absent).")
    timeout: float = Field(60.0, gt=0, description="Seconds one call may take.")
    startup_timeout: float = Field(30.0, gt=0, description="Seconds the server may take to start.")
    # Why 3: one slow call, or the model trying the same slow call again, is not yet a wedged server,
    # and a restart loses what the server holds (an open browser, a login) for every run using it;
    # a third call in a row waiting out its timeout (with no answer in between) is, and without a
    # restart every later call would wait out the timeout as well.
    restart_after_timeouts: int = Field(
        3, ge=1, description="Calls in a row that time out before the server is stopped and started again."
    )

    @model_validator(mode="after")
    def _one_transport(self) -> MCPServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of `command` (a program to start) or `url`")
        if self.url is not None and not re.match(r"^https?://", self.url):
            raise ValueError("`url` must start with http:// or https://")
        return self


def parse_servers(
    items: Sequence[Any],
    label: Callable[[int, Any], str] = lambda i, item: f"server {i}",
    plural: str = "MCP servers",
) -> list[MCPServerConfig]:
    """Server configs from plain data (a config file's tables, an account's JSON), or a
    ``ValueError`` naming the first bad one (``label`` says how) and what is wrong with it; two
    servers may not share a name, since it prefixes their tools (``plural`` names them)."""
    servers: list[MCPServerConfig] = []
    for i, item in enumerate(items):
        if isinstance(item, MCPServerConfig):
            servers.append(item)
            continue
        try:
            servers.append(MCPServerConfig.model_validate(item))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"{label(i, item)}{'.' + where if where else ''}: {first['msg']}") from None
    names = [s.name for s in servers]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ValueError(f"two {plural} are named {duplicate!r}")
    return servers


class MCPError(Exception):
    """An MCP server could not be reached; the message says which one and why."""


class MCPConnection:
    """One MCP server, held open by a task of its own: the SDK's client must be entered and left
    in the same task, while tool calls come from whichever task runs the tool."""

    def __init__(self, config: MCPServerConfig) -> None:
        self.config = config
        self._client: Any = None
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._listing: list[Any] = []
        self._start_lock = asyncio.Lock()
        self._stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")  # noqa: SIM115
        self._closed = False  # closed for good: a tool kept by a run that began before does not restart it
        self._timeouts = 0  # calls in a row that timed out on the current session
        self._abandoned: asyncio.Event | None = None  # the ``_closing`` of the session last given up for them

    @property
    def alive(self) -> bool:
        """Connected, and not being stopped (a session given up is still leaving: not to be used)."""
        return (
            self._client is not None and self._task is not None and not self._task.done() and not self._closing.is_set()
        )

    async def start(self) -> None:
        """Start the server (or reconnect) and read its tool list; ``MCPError`` if it fails."""
        async with self._start_lock:
            if self.alive:
                return
            if self._closed:
                raise MCPError(f"MCP server {self.config.name!r} was stopped (its configuration changed)")
            await self._stop_task()  # (a session given up is waited for: its server is gone before the next starts)
            with contextlib.suppress(OSError, ValueError):  # a new start, a new log: the old one goes
                self._stderr.seek(0)
                self._stderr.truncate()
            self._closing = asyncio.Event()
            self._timeouts = 0
            ready: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._hold(ready), name=f"mcp:{self.config.name}")
            try:
                self._listing = await asyncio.wait_for(asyncio.shield(ready), self.config.startup_timeout)
            except TimeoutError:
                await self._stop_task()
                raise MCPError(self._why(f"did not start within {self.config.startup_timeout:g} s")) from None
            except MCPError:
                await self._stop_task()
                raise

    async def _hold(self, ready: asyncio.Future[list[Any]]) -> None:
        spawned: list[int] = []  # this session's server processes (this task's context: see ``_record_spawns``)
        _SPAWNED.set(spawned)
        try:
            from mcp import Client  # the SDK is an extra: imported only when a server is configured

            async with Client(self._transport(), read_timeout_seconds=self.config.timeout) as client:
                listing = await _list_all(client)
                self._client = client
                if not ready.done():
                    ready.set_result(listing)
                closing = self._closing
                while not closing.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(closing.wait(), STDERR_CHECK_EVERY)
                    self._trim_stderr()
        except ImportError:
            if not ready.done():
                ready.set_exception(MCPError("MCP servers need the `mcp` package: pip install 'agentloop[mcp]'"))
        except Exception as exc:  # the SDK raises many kinds (OSError, MCPError, ExceptionGroup, ...)
            if not ready.done():
                ready.set_exception(MCPError(self._why(_describe(exc))))
            else:
                log.warning("MCP server %s stopped: %s", self.config.name, _describe(exc))
        finally:
            self._client = None
            for pid in spawned if sys.platform != "win32" else ():  # (there the SDK's job object ends the tree)
                await end_group(pid, GROUP_GRACE)  # what the server left running in its group

    def _transport(self) -> Any:
        if self.config.url is not None:
            return self._http_transport(self.config.url)
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        _record_spawns()

        assert self.config.command is not None
        params = StdioServerParameters(
            command=self.config.command,
            args=self.config.args,
            env=self.config.env,
            cwd=self.config.cwd,
            # a byte that is not UTF-8 (a Latin-1 file name) becomes U+FFFD: with the default,
            # the SDK's reader stopped there and every later call waited out its timeout
            encoding_error_handler="replace",
        )
        return stdio_client(params, errlog=self._stderr)

    @contextlib.asynccontextmanager
    async def _http_transport(self, url: str) -> AsyncIterator[Any]:
        """Streamable HTTP through a client of our own: the SDK makes one with its timeouts only
        when given none, and one made for the ``headers`` had httpx's 5 s read timeout (every
        call that took longer failed, and ended the session). It is ours to close, too."""
        import httpx2  # the HTTP client the mcp SDK is built on
        from mcp.client.streamable_http import streamable_http_client

        timeout = httpx2.Timeout(HTTP_TIMEOUT, read=max(HTTP_READ_TIMEOUT, self.config.timeout))
        async with (
            httpx2.AsyncClient(headers=self.config.headers, timeout=timeout) as http,
            streamable_http_client(url, http_client=http) as streams,
        ):
            yield streams

    def _why(self, reason: str) -> str:
        url = self.config.url
        what = redact_url(url) if url else " ".join([self.config.command or "", *self.config.args]).strip()
        text = f"MCP server {self.config.name!r} ({what}) {reason}"
        tail = self._stderr_tail()
        return f"{text}; its stderr ends with:\n{tail}" if tail else text

    def _stderr_tail(self, lines: int = 8) -> str:
        """The last lines the server wrote to stderr (read from the end: a chatty server's log
        grows large, and this runs on the event loop)."""
        try:
            self._stderr.flush()
            end = self._stderr.seek(0, 2)
            self._stderr.seek(max(0, end - STDERR_TAIL_BYTES))
            text = self._stderr.read()
            self._stderr.seek(0, 2)
        except (OSError, ValueError):
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def _trim_stderr(self) -> None:
        """Cut the server's stderr file to its tail once it passes ``STDERR_KEEP_BYTES``: only
        the tail is ever quoted, and a chatty server's log, kept whole for as long as it runs,
        filled the temporary directory (on a tmpfs: memory). The server writes through the same
        open file, offset included, so its next lines follow the kept tail."""
        try:
            self._stderr.flush()
            end = self._stderr.seek(0, 2)
            if end <= STDERR_KEEP_BYTES:
                return
            self._stderr.seek(end - STDERR_TAIL_BYTES)
            tail = self._stderr.read()
            self._stderr.seek(0)
            self._stderr.truncate()
            self._stderr.write(tail)
            self._stderr.flush()
        except (OSError, ValueError):  # closed meanwhile
            pass

    def tools(self) -> list[Any]:
        """The server's tools (the SDK's ``Tool`` objects), filtered by ``config.tools``."""
        wanted = self.config.tools
        return [t for t in self._listing if wanted is None or t.name in wanted]

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        """Call one of the server's tools; a failure of the server is a ``ToolError``. A call that
        times out counts against the server (see ``_timed_out``); an answer clears the count."""
        name = self.config.name
        started = asyncio.get_running_loop().time()
        if self._closed:  # a run that began before its account's configuration changed
            raise ToolError(f"MCP server {name!r} was stopped: its configuration changed")
        if not self.alive:
            try:
                await self.start()
            except MCPError as exc:
                # the details (its command line, its stderr) are the operator's, and may hold
                # secrets: they go to the log; the model (and the account) learn only that it failed
                log.warning("%s", exc)
                raise ToolError(f"MCP server {name!r} is not available (the server's log says why)") from None
        client, task, closing = self._client, self._task, self._closing  # this session's
        try:
            result = await client.call_tool(tool, arguments)
        except asyncio.CancelledError:
            # the loop cancels a tool at its deadline, which for a server's tool is its `timeout`
            # (a call cancelled sooner, by an abort, says nothing about the server)
            if asyncio.get_running_loop().time() - started >= self.config.timeout * 0.99:
                self._timed_out(closing)
            raise
        except Exception as exc:
            if closing.is_set():  # stopped under the call: say so, not the SDK's "connection closed"
                why = ""
                if closing is self._abandoned:
                    limit = self.config.restart_after_timeouts
                    why = f" (its calls timed out {limit} times in a row); the next call starts it again"
                raise ToolError(f"MCP server {name!r} was stopped before {tool} answered{why}") from None
            if _error_code(exc) == _REQUEST_TIMEOUT:  # the SDK's own deadline (the same `timeout`)
                self._timed_out(closing)
            elif _connection_lost(exc):  # the server is gone: the next call starts it again
                await self._stop_task(task)
            elif closing is self._closing:  # an error the server sent: it answers
                self._timeouts = 0
            raise ToolError(f"MCP server {name!r} failed on {tool}: {_describe(exc)}") from None
        if closing is self._closing:
            self._timeouts = 0
        return _to_result(result)

    def _timed_out(self, closing: asyncio.Event) -> None:
        """Count a call to the session ``closing`` belongs to that waited out its timeout. At
        ``restart_after_timeouts`` in a row the server is taken for wedged and the session is
        given up: no call goes to it any more, its task leaves the SDK's client, which stops the
        server (closes its stdin, then kills its process group if it is still there), and the next
        call starts it again, once the old one is gone (``start`` waits for the task). Calls still
        waiting on it fail at once. Synchronous, so the timed-out call is not held up."""
        if closing is not self._closing or closing.is_set():  # a session already given up or replaced
            return
        self._timeouts += 1
        if self._timeouts < self.config.restart_after_timeouts:
            return
        # only the name: the command line, its environment and its stderr may hold secrets
        log.warning(
            "MCP server %r timed out %d times in a row: stopping it; the next call starts it again",
            self.config.name,
            self._timeouts,
        )
        self._abandoned = closing
        closing.set()

    async def _stop_task(self, only: asyncio.Task[None] | None = None) -> None:
        """Stop the task holding the session (and with it the server), and wait for it to end;
        with ``only``, just if that task is still the current one (a call that saw its server go
        away must not stop the one a later call has started since)."""
        if only is not None and only is not self._task:
            return
        task, self._task = self._task, None
        if task is None:
            return
        self._closing.set()  # a connected client leaves its context and stops the server
        if self._client is None:  # still starting: nothing to leave politely
            task.cancel()
        try:
            await asyncio.wait_for(task, 5)
        except (TimeoutError, asyncio.CancelledError):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        except Exception:  # already reported by ``_hold``
            pass

    async def close(self) -> None:
        self._closed = True
        await self._stop_task()
        self._stderr.close()


async def _list_all(client: Any) -> list[Any]:
    tools: list[Any] = []
    cursor: str | None = None
    while True:
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools


def _error_code(exc: BaseException) -> int | None:
    """The JSON-RPC error code of a failed request (``None``: not an error the SDK reports)."""
    code = getattr(getattr(exc, "error", None), "code", None)
    return code if isinstance(code, int) else None


def _connection_lost(exc: BaseException) -> bool:
    """Whether a failed call means the connection is over (anything but an error the server sent)."""
    code = _error_code(exc)
    return code is None or code == _CONNECTION_CLOSED


def _describe(exc: BaseException) -> str:
    """One line for an error, looking inside the exception groups anyio raises."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_SPAWNED: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("agentloop_mcp_spawned", default=None)


def _record_spawns() -> None:
    """Have the SDK's stdio transport tell the session holding it (``_SPAWNED`` of its task) the
    id of each server process it starts. The SDK starts a server in a process group of its own,
    but kills that group only if the server outlives its grace period after stdin closes; a
    server that exits at once leaves the helpers it started (a browser, a language server, a
    child holding its stdout) running, one more set at every restart. With the id, the group
    (whose id it is) is ended after the SDK is done (``end_group``). Installed once; an SDK
    without the hook keeps its own behaviour."""
    from mcp.client import stdio

    spawn = getattr(stdio, "_create_platform_compatible_process", None)
    if spawn is None or getattr(spawn, "_agentloop_records", False):
        return

    async def recording(*args: Any, **kwargs: Any) -> Any:
        process = await spawn(*args, **kwargs)
        pids = _SPAWNED.get()
        if pids is not None and isinstance(getattr(process, "pid", None), int):
            pids.append(process.pid)
        return process

    recording._agentloop_records = True  # type: ignore[attr-defined]
    stdio._create_platform_compatible_process = recording


def _to_result(result: Any) -> ToolResult:
    """An MCP ``CallToolResult`` as a tool result: text and images kept, other blocks described."""
    blocks: list[ResultBlock] = []
    for block in result.content:
        kind = getattr(block, "type", None)
        if kind == "text":
            blocks.append(TextContent(text=block.text))
        elif kind == "image":
            blocks.append(_image(block.data, block.mime_type))
        elif kind == "resource_link":
            blocks.append(TextContent(text=f"[resource {block.uri}]"))
        elif kind == "resource":
            inner = block.resource
            text = getattr(inner, "text", None)
            blocks.append(TextContent(text=text if text is not None else f"[binary resource {inner.uri}]"))
        else:
            blocks.append(TextContent(text=f"[{kind or 'unknown'} content]"))
    details = result.structured_content
    if details is not None:
        shown = json.dumps(details, ensure_ascii=False)
        if not blocks:
            blocks.append(TextContent(text=shown))
        if len(shown) > MAX_DETAILS_CHARS:  # stored with the result: not past the cap text has
            details = None
    return ToolResult(blocks, details=details, is_error=bool(result.is_error))


def _image(data: Any, mime_type: Any) -> ResultBlock:
    """An image block if it is one a model accepts (the type it says, in base64, within the size
    limit), else a note in its place: it is stored, and sent with every later model call."""
    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else b""
    except (binascii.Error, ValueError):
        raw = b""
    if raw and len(raw) <= MAX_IMAGE_BYTES and sniff_image(raw[:16]) == mime_type and image_size(raw) is not None:
        return ImageContent(data=data, mime_type=mime_type)
    return TextContent(
        text=f"[an image ({str(mime_type)[:40]}) that is not a png, jpeg, gif or webp under 10 MiB, or is damaged]"
    )


def _tool_name(server: str, tool: str) -> str:
    """``<server>__<tool>`` within the 64 characters and alphabet every provider accepts. A name
    that has to be changed for that ends in a hash of the tool's own name: ``get.user`` and
    ``get_user``, or two long names alike in their first 64 characters, stay two tools (they
    made the whole toolset fail to start), and a tool keeps its name whatever the server lists
    with it or in which order (the history names the tools it called)."""
    name = f"{server}__{tool}"
    if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        return name
    suffix = "_" + hashlib.sha256(tool.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)[: 64 - len(suffix)] + suffix


class MCPTool(Tool):
    """One tool of an MCP server, shown to the model under ``<server>__<tool>``. The server
    validates the arguments (it owns the schema); its refusal comes back as an error result."""

    def __init__(self, connection: MCPConnection, remote: Any) -> None:
        config = connection.config
        schema = remote.input_schema if isinstance(remote.input_schema, dict) else {"type": "object"}
        description = (remote.description or remote.title or remote.name).strip()
        super().__init__(
            _tool_name(config.name, remote.name), description, schema, timeout=config.timeout, idempotent=False
        )
        self.syscall = f"mcp.{config.name}.{remote.name}"
        self.connection = connection
        self.remote_name = remote.name
        output = getattr(remote, "output_schema", None)
        self.output_schema = output if isinstance(output, dict) else None

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return await self.connection.call(self.remote_name, arguments)


def mcp_server_names(tools: Iterable[Tool]) -> list[str]:
    """The MCP servers whose tools are among ``tools`` (directly or through the ``mcp`` gateway),
    in order: what a prompt's ``{{mcp_servers}}`` lists."""
    names: dict[str, None] = {}
    for tool in tools:
        if isinstance(tool, MCPTool):
            names[tool.connection.config.name] = None
        elif isinstance(tool, MCPGateway):
            names.update(dict.fromkeys(tool.connections))
    return list(names)


_MCP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "server": {"type": "string", "description": "The MCP server's name."},
        "tool": {"type": "string", "description": "The tool to call; leave out to list the server's tools."},
        "arguments": {"type": "object", "description": "The tool's arguments, as its schema says."},
    },
    "required": ["server"],
    "additionalProperties": False,
}


class MCPGateway(Tool):
    """The ``mcp`` tool: lists and calls the tools of servers not exposed to the model directly."""

    def __init__(self, connections: Sequence[MCPConnection]) -> None:
        self.connections = {c.config.name: c for c in connections}
        names = ", ".join(sorted(self.connections))
        super().__init__(
            "mcp",
            f"Use the tools of these MCP servers: {names}. Call with only `server` to list its tools "
            "and their arguments, then with `tool` and `arguments` to call one.",
            _MCP_SCHEMA,
        )
        self.syscall = "mcp.call"

    def syscall_for(self, arguments: Mapping[str, Any]) -> str | None:
        """A call reaches one server's tool, and is judged as that tool called directly would be
        (``mcp.<server>.<tool>``); listing a server's tools is ``mcp.<server>.list_tools``."""
        server, tool = arguments.get("server"), arguments.get("tool")
        if not isinstance(server, str):
            return self.syscall
        return f"mcp.{server}.{tool if isinstance(tool, str) else 'list_tools'}"

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        problems: list[tuple[str, str]] = []
        server = arguments.get("server")
        if not isinstance(server, str) or server not in self.connections:
            problems.append(("server", f"must be one of {sorted(self.connections)}"))
        if "tool" in arguments and not isinstance(arguments["tool"], str):
            problems.append(("tool", "must be a string"))
        if not isinstance(arguments.get("arguments", {}), dict):
            problems.append(("arguments", "must be an object"))
        if problems:
            raise ToolArgumentsError(format_validation_error(self.name, problems, arguments))
        return arguments

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        connection = self.connections[arguments["server"]]
        tool = arguments.get("tool")
        allowed = {t.name: t for t in connection.tools()}
        if tool is None:
            lines = [
                f"- {t.name}: {(t.description or '').strip()}\n  arguments: {t.input_schema}" for t in allowed.values()
            ]
            return ToolResult.text("\n".join(lines) or f"{connection.config.name} has no tools")
        if tool not in allowed:
            raise ToolError(f"{connection.config.name} has no tool {tool!r}; tools: {', '.join(sorted(allowed))}")
        return await connection.call(tool, dict(arguments.get("arguments") or {}))


@contextlib.asynccontextmanager
async def mcp_tools(servers: Sequence[MCPServerConfig | dict[str, Any]]) -> AsyncIterator[list[Tool]]:
    """Start every server, yield their tools (plus ``mcp`` for servers with ``expose=False``),
    and stop the servers on exit. A server that fails to start raises ``MCPError``."""
    configs = parse_servers(servers)
    connections = [MCPConnection(c) for c in configs]
    try:
        await asyncio.gather(*(c.start() for c in connections))
        tools: list[Tool] = []
        names: dict[str, str] = {}
        for connection in connections:
            if not connection.config.expose:
                continue
            for remote in connection.tools():
                made = MCPTool(connection, remote)
                if made.name in names:
                    raise MCPError(
                        f"MCP tools {names[made.name]} and {connection.config.name}.{remote.name} "
                        f"share the name {made.name}"
                    )
                names[made.name] = f"{connection.config.name}.{remote.name}"
                tools.append(made)
        hidden = [c for c in connections if not c.config.expose]
        if hidden:
            tools.append(MCPGateway(hidden))
        yield tools
    finally:
        await asyncio.gather(*(c.close() for c in connections), return_exceptions=True)
