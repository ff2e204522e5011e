"""The CLI as a server's client, under the conditions a user meets: a server that goes away in the
middle of a turn (Ctrl-C must still give the prompt back), and model or tool text that carries
terminal control sequences (shown as text, never obeyed by the terminal)."""

from __future__ import annotations

import asyncio
import gc
import io
import logging
import signal
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from rich.console import Console

from agentloop.cli.chat import ChatRepl, PlainReader
from agentloop.cli.client import RemoteSession
from agentloop.cli.render import SignalRenderer, TextRenderer
from agentloop.client import AgentloopClient
from agentloop.process import signals as sig
from agentloop.process.signals import Signal
from tests.server_support import LiveServer, live_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("cli-review")) as live:
        yield live


class Terminal(io.StringIO):
    """Output that says it is a terminal, as stdout is in an interactive chat."""

    def isatty(self) -> bool:
        return True


HOSTILE = "ok \x1b]0;pwned\x07\x1b[2J\x1b[31mred\x1b[0m \u202eevil\r"


# ---------------------------------------------------------------------------------- escape sequences


def test_answer_text_never_sends_control_sequences_to_a_terminal() -> None:
    """A model (or a prompt injection in what it read) must not be able to retitle, clear or
    recolour the user's terminal, nor hide text behind a carriage return or a bidi override."""
    out = Terminal()
    view = TextRenderer(out, Console(file=io.StringIO(), width=200))
    render = SignalRenderer(view)
    render.handle(Signal(sig.RUN_STREAM, {"event": "start"}, None))
    render.handle(Signal(sig.RUN_STREAM, {"event": "text_delta", "delta": HOSTILE}, None))
    render.handle(Signal(sig.RUN_OUTPUT, {"text": HOSTILE + "\nline two\ttab é 中文"}, 5))
    shown = out.getvalue()
    assert "\x1b" not in shown and "\x07" not in shown and "\r" not in shown and "\u202e" not in shown
    assert "\\u001b]0;pwned" in shown  # made visible, not silently dropped
    assert shown.endswith("\nline two\ttab é 中文")  # newlines, tabs and unicode stay as they are


def test_answer_text_to_a_pipe_stays_exact() -> None:
    """``agentloop run … > answer.txt`` captures the answer byte for byte: only a terminal is guarded."""
    out = io.StringIO()
    view = TextRenderer(out, Console(file=io.StringIO(), width=200))
    view.text(HOSTILE)
    assert out.getvalue() == HOSTILE


def test_tool_lines_never_send_control_sequences_to_the_terminal() -> None:
    """Tool arguments and error text are the model's (or a web page's): on stderr they are text."""
    err = io.StringIO()
    view = TextRenderer(Terminal(), Console(file=err, width=200, force_terminal=True))
    render = SignalRenderer(view)
    render.handle(Signal(sig.TOOL_STARTED, {"callId": "c1", "name": "shell", "args": {"command": HOSTILE}}, 1))
    render.handle(Signal(sig.TOOL_FINISHED, {"callId": "c1", "name": "shell", "ok": False, "error": HOSTILE}, 2))
    shown = err.getvalue()
    for hostile in ("\x1b]", "\x1b[2J", "\x1b[31mred", "\x07", "\u202e", "\r"):
        assert hostile not in shown, repr(hostile)
    assert "\\u001b]0;pwned" in shown


# ---------------------------------------------------------------------------------- server gone


class Outage(httpx.AsyncBaseTransport):
    """A server that can go away (``down``): new requests are refused and open event streams break,
    as when the server is stopped or the network drops; it comes back when ``down`` is cleared."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.down = False
        self._gone: asyncio.Event | None = None

    def go_down(self) -> None:
        self.down = True
        if self._gone is not None:
            self._gone.set()

    def come_back(self) -> None:
        self.down = False
        self._gone = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        response = await self.inner.handle_async_request(request)
        if not request.url.path.endswith("/events"):
            return response
        upstream = response.stream
        assert isinstance(upstream, httpx.AsyncByteStream)
        gone = self._gone = self._gone or asyncio.Event()

        class Breakable(httpx.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                pieces = upstream.__aiter__()
                stop = asyncio.ensure_future(gone.wait())
                piece: asyncio.Future[bytes] | None = None
                try:
                    while True:
                        piece = asyncio.ensure_future(pieces.__anext__())
                        await asyncio.wait({piece, stop}, return_when=asyncio.FIRST_COMPLETED)
                        if not piece.done():
                            raise httpx.ReadError("the server went away")
                        try:
                            yield piece.result()
                        except StopAsyncIteration:
                            return
                finally:
                    stop.cancel()
                    if piece is not None:  # (a read left pending when the stream is closed or cut)
                        piece.cancel()
                        piece.add_done_callback(lambda f: f.cancelled() or f.exception())

            async def aclose(self) -> None:
                await upstream.aclose()

        return httpx.Response(response.status_code, headers=response.headers, stream=Breakable(), request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class ScriptedReader(PlainReader):
    """Piped input, with something done as each line is read (the server comes back…)."""

    def __init__(self, lines: list[tuple[str, object]]) -> None:
        super().__init__(io.StringIO(""))
        self.lines = lines

    def read(self, prompt: str) -> str:
        if not self.lines:
            raise EOFError
        line, action = self.lines.pop(0)
        if callable(action):
            action()
        return line


def test_ctrl_c_while_the_server_is_gone_gives_the_prompt_back(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The server goes away during a turn and the user presses Ctrl-C: the abort cannot be
    delivered, so the turn ends at once saying so (no minute of silent reconnecting, no second
    Ctrl-C that kills the chat, no 'Task exception was never retrieved' traceback), and the next
    line is sent once the server is back."""
    outage = Outage()
    ev = asyncio.new_event_loop()
    client = AgentloopClient(server.url, server.tokens.bob, transport=outage)
    out, err = io.StringIO(), io.StringIO()
    ended: list[float] = []

    def start_outage() -> None:
        ev.call_later(1.0, outage.go_down)
        ev.call_later(1.5, signal.raise_signal, signal.SIGINT)  # Ctrl-C, while the turn is running

    def server_back() -> None:
        ended.append(time.monotonic())
        outage.come_back()

    try:
        session = RemoteSession(client)
        ev.run_until_complete(session.open(new=True))
        reader = ScriptedReader([("sleep 3", start_outage), ("hi", server_back), ("/exit", None)])
        repl = ChatRepl(session, reader=reader, out=out, err=Console(file=err, width=300))
        began = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            repl.loop(ev)
            ev.run_until_complete(asyncio.sleep(0.1))
            gc.collect()  # an exception nobody retrieved is reported when its task is collected
    finally:
        ev.run_until_complete(client.aclose())
        ev.close()
    assert ended and ended[0] - began < 10, "the aborted turn kept waiting for the gone server"
    assert "could not abort" in err.getvalue() and "cannot reach the server" in err.getvalue()
    assert out.getvalue().endswith("answer: hi\n")  # the next line went through once the server was back
    assert repl.last_outcome is not None and repl.last_outcome.status == "ok"
    assert "never retrieved" not in caplog.text


def test_history_on_a_terminal_shows_control_sequences_as_text(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``agentloop history`` prints what the model wrote: on a terminal, the same guard as the chat."""
    from typer.testing import CliRunner

    from agentloop.cli.main import app

    async def hostile_turn() -> str:
        async with AgentloopClient(server.url, server.tokens.bob) as client:
            pid = str((await client.spawn())["pid"])
            receipt = await client.send(pid, HOSTILE)
            async for event in client.events(pid):
                if event.signal == sig.RUN_FINISHED and event.payload.get("runId") == receipt["run_id"]:
                    return pid
        raise AssertionError("the stream ended before the run finished")

    pid = asyncio.run(hostile_turn())
    monkeypatch.setattr("agentloop.cli.client.is_terminal", lambda stream: True, raising=False)
    result = CliRunner().invoke(app, ["history", pid, "--server", server.url, "--token", server.tokens.bob])
    assert result.exit_code == 0, result.output
    assert "answer: ok \\u001b]0;pwned" in result.output
    assert "\x1b" not in result.output and "\x07" not in result.output and "\u202e" not in result.output


def test_a_command_the_gone_server_cannot_carry_out_leaves_the_chat_going(server: LiveServer) -> None:
    """/new and /chat while the server is out of reach say so and the chat goes on (they ended it,
    and the lines after them were lost); the next line is sent once the server is back."""
    outage = Outage()
    ev = asyncio.new_event_loop()
    client = AgentloopClient(server.url, server.tokens.bob, transport=outage)
    out, err = io.StringIO(), io.StringIO()
    try:
        session = RemoteSession(client)
        ev.run_until_complete(session.open(new=True))
        pid = session.pid
        reader = ScriptedReader([("/new", outage.go_down), ("/chat", None), ("hi", outage.come_back), ("/exit", None)])
        repl = ChatRepl(session, reader=reader, out=out, err=Console(file=err, width=300))
        code = repl.loop(ev)
    finally:
        ev.run_until_complete(client.aclose())
        ev.close()
    shown = err.getvalue()
    assert "error: no new conversation: cannot reach the server" in shown
    assert "error: the mode was not changed: cannot reach the server" in shown
    assert "(new conversation)" not in shown and "chat mode" not in shown
    assert session.pid == pid and out.getvalue().endswith("answer: hi\n") and code == 0
