"""``agentloop.client.AgentloopClient`` and the remote chat session against a real server in a
thread (``tests/server_support.py``): calls, errors as ``ClientError``, the event stream and its
resumption after a dropped connection (a transport that cuts the first stream mid-way)."""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from agentloop.cli.chat import ChatRepl, PlainReader
from agentloop.cli.client import RemoteSession, message_lines
from agentloop.cli.config import load_connection
from agentloop.client import AgentloopClient, ClientError, SSEParser, StreamEvent
from agentloop.process import signals as sig
from tests.server_support import LiveServer, live_server, remote_chat


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("client")) as live:
        yield live


def client_for(server: LiveServer, token: str | None = None, **kw: Any) -> AgentloopClient:
    return AgentloopClient(server.url, token if token is not None else server.tokens.alice, **kw)


async def until_finished(client: AgentloopClient, pid: str, run_id: str, after: int = 0) -> list[StreamEvent]:
    seen: list[StreamEvent] = []
    async with asyncio.timeout(30):
        async for event in client.events(pid, after_seq=after):
            seen.append(event)
            if event.signal == sig.RUN_FINISHED and event.payload.get("runId") == run_id:
                return seen
    raise AssertionError("the stream ended before the run finished")


def test_sse_parser_frames() -> None:
    parser = SSEParser()
    lines = [": ping", "event: a", "id: 7", 'data: {"x":', "data: 1}", "", "", "data: plain", ""]
    frames = [f for f in (parser.feed(line) for line in lines) if f is not None]
    assert frames == [("a", '{"x":\n1}', "7"), ("message", "plain", None)]


async def test_spawn_send_events_history(server: LiveServer) -> None:
    async with client_for(server) as client:
        assert await client.health()
        assert await client.me() == {"account": "alice", "admin": False}
        proc = await client.spawn(context="tests")
        pid = proc["pid"]
        assert proc["owner"] == "alice"
        assert pid in [p["pid"] for p in await client.processes()]
        receipt = await client.send(pid, "hello there")
        events = await until_finished(client, pid, receipt["run_id"])
        finished = events[-1]
        assert finished.payload.get("status") == "ok"
        outputs = [e.payload["text"] for e in events if e.signal == sig.RUN_OUTPUT]
        assert outputs == ["answer: hello there"]
        seqs = [e.seq for e in events if e.seq is not None]
        assert seqs == sorted(set(seqs))  # logged signals in order, none twice
        page = await client.history(pid)
        lines = [line for item in page["messages"] for line in message_lines(item["message"])]
        assert lines == ["user: hello there", "assistant: answer: hello there"]
        assert (await client.process(pid))["run_id"] is None


async def test_approval_over_http(server: LiveServer) -> None:
    async with client_for(server) as client:
        pid = (await client.spawn())["pid"]
        receipt = await client.send(pid, "risky")
        async with asyncio.timeout(30):
            async for event in client.events(pid):
                if event.signal == sig.HIL_REQUESTED:
                    break
        (pending,) = await client.approvals(pid)
        assert pending["tool_name"] == "echo" and pending["run_id"] == receipt["run_id"]
        answer = await client.hil(pid, pending["request_id"], "approve")
        assert answer["decision"] == "approve"
        events = await until_finished(client, pid, receipt["run_id"], after=event.seq or 0)
        assert [e.payload["text"] for e in events if e.signal == sig.RUN_OUTPUT][-1] == "done: risky"
        with pytest.raises(ClientError) as caught:
            await client.hil(pid, pending["request_id"], "approve")
        assert caught.value.status == 404 and caught.value.code == "not_found"


async def test_errors_are_client_errors(server: LiveServer) -> None:
    async with client_for(server, server.tokens.revoked) as revoked:
        with pytest.raises(ClientError) as caught:
            await revoked.processes()
        assert (caught.value.status, caught.value.code) == (401, "unauthorized")
    async with client_for(server) as alice, client_for(server, server.tokens.bob) as bob:
        pid = (await alice.spawn())["pid"]
        with pytest.raises(ClientError) as caught:
            await bob.process(pid)  # someone else's process does not exist
        assert caught.value.code == "not_found"
        with pytest.raises(ClientError) as caught:
            await alice.send(pid, "x", mode="sideways")
        assert (caught.value.status, caught.value.code) == (400, "invalid_request")
        with pytest.raises(ClientError) as caught:
            async for _ in bob.events(pid):
                pass
        assert caught.value.code == "not_found"  # not retried: retrying cannot fix it
        assert (await alice.kill(pid))["killed"] is True
        with pytest.raises(ClientError):
            await alice.process(pid)


async def test_a_pid_is_sent_as_one_path_segment(server: LiveServer) -> None:
    """``agentloop kill 'x/../<pid>'`` killed <pid>: the server normalised the unencoded path."""
    async with client_for(server) as alice:
        pid = (await alice.spawn())["pid"]
        for odd in (f"no-such/../{pid}", f"..%2F{pid}", "%00", "a?b#c"):
            with pytest.raises(ClientError) as caught:
                await alice.kill(odd)
            assert caught.value.code == "not_found", odd
            with pytest.raises(ClientError):
                await alice.hil(odd, "req/../x", "approve")
        for dots in ("..", "."):  # the URL would resolve them before sending: refused here
            with pytest.raises(ClientError, match="not a valid id"):
                await alice.reset(dots)
        assert (await alice.process(pid))["pid"] == pid  # still there
        assert (await alice.kill(pid))["killed"] is True


async def test_unreachable_server() -> None:
    async with AgentloopClient("http://127.0.0.1:9", "t", timeout=2) as client:
        assert not await client.health()
        with pytest.raises(ClientError) as caught:
            await client.processes()
        assert (caught.value.status, caught.value.code) == (0, "unreachable")


@pytest.mark.parametrize(
    ("url", "token", "said"),
    [
        ("http://127.0.0.1:99999", "tok3n", "Port out of range"),
        ("http://127.0.0.1:-1", "tok3n", "not a server address"),
        ("ftp://127.0.0.1", "tok3n", "use http://host:port"),
        ("http://127.0.0.1:0", "tok3n", "port 0"),
        ("http://127.0.0.1:8765", "caf\u00e9", "non-ASCII"),
        ("http://127.0.0.1:8765", "bad\ntoken", "control"),
    ],
)
def test_a_mistyped_address_or_token_is_said_to_be_one(url: str, token: str, said: str) -> None:
    """Not 'cannot reach the server' (nor an exception from the socket layer): the typo is named,
    and the token itself is not repeated."""
    with pytest.raises(ClientError) as caught:
        AgentloopClient(url, token)
    assert caught.value.code == "invalid_argument" and said in caught.value.message
    assert token not in caught.value.message


def test_the_cli_reports_a_mistyped_server_in_one_line() -> None:
    from typer.testing import CliRunner

    from agentloop.cli.main import app

    result = CliRunner().invoke(app, ["ps", "--server", "http://127.0.0.1:99999", "--token", "t"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "not a server address: 'http://127.0.0.1:99999' (Port out of range" in result.output


class CuttingTransport(httpx.AsyncBaseTransport):
    """The first event stream is cut after ``lines`` lines (a dropped connection); later ones pass.
    Records each stream request's ``Last-Event-ID``."""

    def __init__(self, lines: int) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.lines = lines
        self.streams: list[str | None] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if not request.url.path.endswith("/events"):
            return response
        self.streams.append(request.headers.get("last-event-id"))
        if len(self.streams) > 1:
            return response
        limit = self.lines
        upstream = response.stream
        assert isinstance(upstream, httpx.AsyncByteStream)

        class Cut(httpx.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                seen = 0
                async for piece in upstream:
                    for line in piece.split(b"\n"):
                        yield line + b"\n"
                        seen += 1
                        if seen >= limit:
                            raise httpx.ReadError("cut by the test")

            async def aclose(self) -> None:
                await upstream.aclose()

        return httpx.Response(response.status_code, headers=response.headers, stream=Cut(), request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_events_resume_after_a_drop_without_loss_or_repeat(server: LiveServer) -> None:
    async with client_for(server) as client:
        pid = (await client.spawn())["pid"]
        for n in range(3):
            receipt = await client.send(pid, f"message {n}")
            await until_finished(client, pid, receipt["run_id"])
        everything = [e async for e in client.events(pid, follow=False)]
    assert len(everything) >= 9
    transport = CuttingTransport(lines=14)  # a few frames in, mid-log
    retries: list[int] = []
    async with client_for(server, transport=transport) as cut:
        stream = cut.events(pid, follow=False, on_retry=lambda problem, n: retries.append(n))
        resumed = [e async for e in stream]
    assert retries == [1]
    assert transport.streams[0] is None and transport.streams[1] is not None
    assert [e.seq for e in resumed] == [e.seq for e in everything]
    assert resumed == everything


def test_remote_chat_session(server: LiveServer) -> None:
    """The chat REPL over HTTP: streamed answers, an approval answered at the prompt."""
    out, err = io.StringIO(), io.StringIO()
    reader = PlainReader(io.StringIO("hi\nrisky\ny\n/chat\n/exit\n"))
    ev = asyncio.new_event_loop()
    client = AgentloopClient(server.url, server.tokens.bob)
    try:
        session = RemoteSession(client)
        assert ev.run_until_complete(session.open(new=True)) is None
        repl = ChatRepl(session, reader=reader, out=out, err=Console(file=err, width=200))
        assert repl.loop(ev) == 0
        assert repl.last_outcome is not None and repl.last_outcome.status == "ok"
        # a second session continues the same conversation
        again = RemoteSession(client)
        count = ev.run_until_complete(again.open())
        assert again.pid == session.pid and count == 6
        assert again.seq == session.seq + 1  # /chat logged a proc.changed after the last turn
        assert ev.run_until_complete(client.mode(session.pid)) == "chat"  # on the server's process
    finally:
        ev.run_until_complete(client.aclose())
        ev.close()
    assert out.getvalue() == "answer: hi\ndone: risky\n"
    assert 'approve echo {"text": "risky"}' in err.getvalue()


def test_remote_chat_shows_the_prompt_manifest(server: LiveServer) -> None:
    """``/prompt`` over HTTP: read from the process's event log on the server."""
    _, shown = remote_chat(server, "/prompt\nhi\n/prompt\n/exit\n")
    assert "no prompt manifest yet" in shown
    after = shown[shown.index("no prompt manifest yet") :]
    assert re.search(r"system prompt: \d+ bytes, sha256 [0-9a-f]{12}, \d+ tools", after), shown


def test_remote_chat_attaches_a_document(server: LiveServer, tmp_path: Path) -> None:
    """``/attach`` over HTTP: the document reaches the server's process with the next message."""
    notes = tmp_path / "notes.csv"
    notes.write_text("a,b\n1,2\n")
    out, err = io.StringIO(), io.StringIO()
    reader = PlainReader(io.StringIO(f"/attach {notes}\nhi\n/exit\n"))
    ev = asyncio.new_event_loop()
    client = AgentloopClient(server.url, server.tokens.bob)
    try:
        session = RemoteSession(client)
        ev.run_until_complete(session.open(new=True))
        repl = ChatRepl(session, reader=reader, out=out, err=Console(file=err, width=200))
        assert repl.loop(ev) == 0
        page = ev.run_until_complete(client.history(session.pid))
    finally:
        ev.run_until_complete(client.aclose())
        ev.close()
    sent = next(m["message"] for m in page["messages"] if m["message"]["role"] == "user")
    assert [(b["type"], b.get("name"), b.get("mimeType")) for b in sent["content"]] == [
        ("text", None, None),
        ("file", "notes.csv", "text/csv"),
    ]
    assert out.getvalue() == "answer: hi\n"


def test_connection_precedence(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('server = "http://files:1/"\ntoken = "from-file"\n')
    env = {"AGENTLOOP_CONFIG": str(config)}
    conn = load_connection(env=env)
    assert (conn.server, conn.token, conn.token_source) == ("http://files:1", "from-file", f"config file {config}")
    env |= {"AGENTLOOP_SERVER": "http://env:2", "AGENTLOOP_TOKEN": "from-env"}
    conn = load_connection(env=env)
    assert (conn.server, conn.token, conn.token_source) == ("http://env:2", "from-env", "AGENTLOOP_TOKEN")
    conn = load_connection(server="http://flag:3", token="from-flag", env=env)
    assert (conn.server, conn.token, conn.token_source) == ("http://flag:3", "from-flag", "--token")
    empty = load_connection(env={"AGENTLOOP_CONFIG": str(tmp_path / "none.toml")})
    assert (empty.server, empty.token) == ("http://127.0.0.1:8765", None)
    config.write_text('server = "ftp://nope"\ntoken = 5\n')
    bad = load_connection(env={"AGENTLOOP_CONFIG": str(config)})
    assert bad.server == "http://127.0.0.1:8765" and bad.token is None and len(bad.warnings) == 2
