"""End to end: ``agentloop serve`` as a subprocess, its model an OpenAI-compatible fake in a thread.

Everything goes through the real pieces: the console script, the first-start admin token on
stdout, the OpenAI adapter over HTTP, the kernel on SQLite in the data directory, uvicorn, the
``/engine/chat`` contract and the ``/v1`` API, and the CLI's client commands. The tests are
synchronous (``httpx.Client``) so the CLI commands can run in process with typer's ``CliRunner``.

Timeouts are generous (a loaded two-core machine), but nothing sleeps for a fixed time where it
can poll for the state it waits for instead.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from agentloop.cli.main import app
from agentloop.process import signals as sig
from tests.fakes.openai_server import OpenAIFake, text_reply, tool_reply
from tests.fakes.openai_server import error as provider_error

AGENTLOOP = Path(sys.executable).parent / "agentloop"
TOKEN = re.compile(r"al_[A-Za-z0-9_\-]{20,}")
START_TIMEOUT = 60.0
WAIT = 30.0
runner = CliRunner()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """One ``agentloop serve`` subprocess: stdout read by a thread (the token and URL lines),
    stderr kept in a file (to check what the logs say, and for debugging)."""

    def __init__(self, data: Path, workspace: Path, fake: OpenAIFake, port: int) -> None:
        self.data, self.workspace, self.fake, self.port = data, workspace, fake, port
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[str] = []
        self.proc: subprocess.Popen[str] | None = None
        self.err_path = data.parent / f"serve-{port}-{time.monotonic_ns()}.err"

    def start(self) -> Served:
        self.lines = []
        env = {k: v for k, v in os.environ.items() if k not in ("AGENTLOOP_MODEL", "AGENTLOOP_DATA", "AGENTLOOP_TOKEN")}
        env.update(
            OPENAI_BASE_URL=self.fake.base_url,
            OPENAI_API_KEY="sk-e2e-test-key-0000",
            AGENTLOOP_CONFIG=str(self.data.parent / "no-config.toml"),
            XDG_DATA_HOME=str(self.data.parent / "xdg"),
            PYTHONUNBUFFERED="1",
        )
        args = [str(AGENTLOOP), "serve", "--port", str(self.port), "--data", str(self.data)]
        args += ["--model", "openai:gpt-4o-mini", "--workspace", str(self.workspace)]
        self.err = self.err_path.open("a")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.err, text=True, env=env)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}: {self.stderr()}")
            try:
                ready = any(line.startswith("agentloop serving on") for line in self.lines)
                if ready and httpx.get(f"{self.url}/v1/health", timeout=2).json() == {"ok": True}:
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"serve did not answer /v1/health in {START_TIMEOUT}s: {self.stderr()}")

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def stderr(self) -> str:
        if not self.err.closed:
            self.err.flush()
        return self.err_path.read_text()

    @property
    def token(self) -> str:
        found = [m for line in self.lines for m in TOKEN.findall(line)]
        assert len(found) == 1, self.lines
        return found[0]

    def kill(self, signum: int = signal.SIGKILL) -> int:
        assert self.proc is not None
        self.proc.send_signal(signum)
        code = self.proc.wait(WAIT)
        self.err.close()
        return code

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill(signal.SIGKILL)


@pytest.fixture(scope="module")
def fake() -> Iterator[OpenAIFake]:
    with OpenAIFake() as server:
        yield server


@pytest.fixture
def replies(fake: OpenAIFake) -> OpenAIFake:
    fake.reset()
    return fake


def start_server(tmp: Path, fake: OpenAIFake) -> Served:
    workspace = tmp / "ws"
    workspace.mkdir(exist_ok=True)
    return Served(tmp / "data", workspace, fake, free_port()).start()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, fake: OpenAIFake) -> Iterator[Served]:
    """One server for the tests that need nothing but a server."""
    server = start_server(tmp_path_factory.mktemp("e2e"), fake)
    try:
        yield server
    finally:
        server.stop()


def http(server: Served, token: str | None = None) -> httpx.Client:
    key = server.token if token is None else token
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=WAIT)


def sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """Frames of an SSE stream as they arrive: ``{"event", "id", "data"}`` (``data`` decoded)."""
    frame: dict[str, Any] = {}
    for line in lines:
        if not line:
            if "data" in frame:
                frame["data"] = json.loads(frame["data"])
                yield frame
            frame = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            frame[name] = value.removeprefix(" ")


def until(check: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def follow_run(client: httpx.Client, pid: str, run_id: str, last_id: int = 0) -> list[dict[str, Any]]:
    """Signals from after ``last_id`` until ``run_id`` finishes."""
    headers = {"Last-Event-ID": str(last_id)} if last_id else {}
    seen = []
    with client.stream("GET", f"/v1/processes/{pid}/events", headers=headers) as response:
        assert response.status_code == 200
        for frame in sse(response.iter_lines()):
            seen.append(frame)
            data = frame["data"]
            if data["signal"] == sig.RUN_FINISHED and data["payload"].get("runId") == run_id:
                return seen
    raise AssertionError(f"the stream ended before {run_id} finished: {seen}")


def logged(client: httpx.Client, pid: str) -> list[dict[str, Any]]:
    with client.stream("GET", f"/v1/processes/{pid}/events", params={"follow": "false"}) as response:
        return list(sse(response.iter_lines()))


def cli(server: Served, *args: str) -> str:
    result = runner.invoke(app, [*args, "--server", server.url, "--token", server.token])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result.stdout


# ---------------------------------------------------------------------------------- tests


def test_first_start_prints_url_and_token_once(served: Served) -> None:
    assert f"agentloop serving on {served.url}" in served.lines
    assert served.token.startswith("al_")
    assert served.token not in served.stderr()
    with http(served) as client:
        assert client.get("/v1/me").json() == {"account": "admin", "admin": True}


def test_engine_chat_contract(served: Served, replies: OpenAIFake) -> None:
    (served.workspace / "hello.txt").write_text("hi there\n")
    replies.push(tool_reply("Read", json.dumps({"path": "hello.txt"}), id="call_7"))
    replies.push(text_reply("The file says hi there.", pieces=3))
    body = {"messages": [{"role": "user", "content": "what does hello.txt say?"}], "metadata": {"correlation_id": "c1"}}
    with http(served) as client, client.stream("POST", "/engine/chat", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [(f["event"], f["data"]) for f in sse(response.iter_lines())]
    names = [name for name, _ in events]
    collapsed = [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]
    assert collapsed == ["tool-call", "tool-result", "text-delta", "done"]
    assert events[0][1] == {"id": "call_7", "name": "Read", "arguments": {"path": "hello.txt"}}
    assert events[1][1]["id"] == "call_7" and "hi there" in events[1][1]["output"]
    assert "".join(d["content"] for n, d in events if n == "text-delta") == "The file says hi there."
    done = events[-1][1]
    assert done["finish_reason"] == "stop"
    assert done["usage"] == {"prompt_tokens": 20 + 12, "completion_tokens": 10 + 5}
    assert replies.requests[0]["model"] == "gpt-4o-mini"


def test_engine_chat_refuses_what_the_policy_would_ask_about(served: Served, replies: OpenAIFake) -> None:
    """A stateless request has nobody to ask: a risky call is a tool error, and nothing runs."""
    victim = served.workspace / "keep"
    victim.mkdir()
    replies.push(tool_reply("Shell", json.dumps({"command": "rm -rf keep"}), id="call_rm"))
    replies.push(text_reply("I was not allowed to."))
    body = {"messages": [{"role": "user", "content": "delete keep"}], "metadata": {"correlation_id": "c3"}}
    with http(served) as client, client.stream("POST", "/engine/chat", json=body) as response:
        events = [(f["event"], f["data"]) for f in sse(response.iter_lines())]
    result = next(data for name, data in events if name == "tool-result")
    assert result["id"] == "call_rm" and "error" in result and "output" not in result
    assert "stateless /engine/chat request" in result["error"] and "terminal" not in result["error"]
    assert events[-1][0] == "done"
    assert victim.is_dir()


def test_engine_chat_errors(served: Served, replies: OpenAIFake) -> None:
    ok = {"messages": [{"role": "user", "content": "hi"}], "metadata": {"correlation_id": "c2"}}
    response = httpx.post(f"{served.url}/engine/chat", json=ok, timeout=WAIT)
    assert (response.status_code, response.json()["code"]) == (401, "unauthorized")
    with http(served) as client:
        response = client.post("/engine/chat", json={"messages": ok["messages"]})
        assert response.status_code == 400
        assert response.json()["code"] == "invalid_request" and "metadata" in response.json()["message"]
        replies.push(provider_error(400, "the fake refuses this request"))
        with client.stream("POST", "/engine/chat", json=ok) as stream:
            events = [(f["event"], f["data"]) for f in sse(stream.iter_lines())]
    assert events[-1][0] == "error" and events[-1][1]["code"] == "provider_error"
    assert [n for n, _ in events].count("error") == 1 and "done" not in [n for n, _ in events]


def test_process_with_approval_over_http_and_cli(served: Served, replies: OpenAIFake) -> None:
    (served.workspace / "build").mkdir()
    (served.workspace / "build" / "out.o").write_text("x")
    replies.push(tool_reply("Shell", json.dumps({"command": "rm -rf build"}), id="call_rm"))
    replies.push(text_reply("Removed the build directory."))
    with http(served) as client:
        created = client.post("/v1/processes", json={"context": "e2e"})
        assert created.status_code == 201
        pid = created.json()["pid"]
        sent = client.post(f"/v1/processes/{pid}/messages", json={"text": "remove the build directory"})
        assert sent.status_code == 202
        run_id = sent.json()["run_id"]
        pending = until(lambda: client.get(f"/v1/processes/{pid}/hil").json()["requests"], "the approval request")
        assert len(pending) == 1 and pending[0]["tool_name"] == "Shell"
        assert "destructive" in pending[0]["tags"] and (served.workspace / "build").exists()
        out = cli(served, "approve", pid)  # no REQ: the only pending one
        assert out.startswith(f"approved {pending[0]['request_id']}")
        frames = follow_run(client, pid, run_id)
    finished = frames[-1]["data"]["payload"]
    assert finished["status"] == "ok"
    tools = [f["data"]["payload"] for f in frames if f["data"]["signal"] == sig.TOOL_FINISHED]
    assert tools and tools[-1]["ok"] is True
    outputs = [f["data"]["payload"]["text"] for f in frames if f["data"]["signal"] == sig.RUN_OUTPUT]
    assert outputs[-1] == "Removed the build directory."
    assert not (served.workspace / "build").exists()


def test_sse_cut_and_resumed_with_last_event_id(served: Served, replies: OpenAIFake) -> None:
    slow = text_reply("one two three four five six seven eight", pieces=8)
    slow.delay = 0.25
    replies.push(slow)
    with http(served) as client:
        pid = client.post("/v1/processes", json={}).json()["pid"]
        first: list[dict[str, Any]] = []
        with client.stream("GET", f"/v1/processes/{pid}/events") as response:
            frames = sse(response.iter_lines())
            run_id = client.post(f"/v1/processes/{pid}/messages", json={"text": "count"}).json()["run_id"]
            for frame in frames:
                first.append(frame)
                if frame["data"]["signal"] == sig.RUN_STREAM:
                    break  # the model is mid-answer: cut the connection here
        last_id = max(int(f["id"]) for f in first if "id" in f)
        rest = follow_run(client, pid, run_id, last_id=last_id)
        everything = logged(client, pid)
    ids = [int(f["id"]) for f in [*first, *rest] if "id" in f]
    assert ids == [int(f["id"]) for f in everything]  # nothing lost, nothing repeated
    assert all(f["data"]["seq"] == int(f["id"]) for f in everything)
    assert [f for f in rest if "id" not in f] and all(  # live deltas carry no id
        f["data"]["signal"] == sig.RUN_STREAM for f in [*first, *rest] if "id" not in f
    )
    output = [f["data"]["payload"]["text"] for f in rest if f["data"]["signal"] == sig.RUN_OUTPUT]
    assert output == ["one two three four five six seven eight"]


def test_cli_client_commands(served: Served, replies: OpenAIFake) -> None:
    replies.push(text_reply("Hello from the fake."))
    with http(served) as client:
        pid = client.post("/v1/processes", json={}).json()["pid"]
    assert pid in cli(served, "ps")
    run_id = cli(served, "send", pid, "say hello").strip()
    assert run_id
    watched = cli(served, "watch", pid, "--until-done").splitlines()
    signals = [line.split("\t")[1] for line in watched]
    assert signals[0] == sig.RUN_STARTED and signals[-1] == sig.RUN_FINISHED
    assert json.loads(watched[-1].split("\t")[2])["runId"] == run_id
    seqs = [int(line.split("\t")[0]) for line in watched]
    assert seqs == sorted(set(seqs))
    assert cli(served, "history", pid).splitlines() == ["user: say hello", "assistant: Hello from the fake."]
    assert cli(served, "abort", pid).strip() == "nothing was running"
    result = runner.invoke(app, ["approve", pid, "--server", served.url, "--token", served.token])
    assert result.exit_code == 1 and "no approval is pending" in result.stderr
    result = runner.invoke(app, ["ps", "--server", served.url, "--token", "al_not-a-real-token-at-all-0000"])
    assert result.exit_code == 1 and "refused the token" in result.stderr and "Traceback" not in result.stderr
    assert "killed" in cli(served, "kill", pid)
    assert pid not in cli(served, "ps")


def test_sigkill_mid_run_restart_completes_it_then_sigterm_exits_cleanly(
    tmp_path: Path, fake: OpenAIFake, replies: OpenAIFake
) -> None:
    """The server's life: SIGKILLed while the model is mid-answer, restarted on the same data
    directory, the run completes; then SIGTERM with an event stream open ends that stream cleanly
    and the server exits 0 without logging the token. (One test, so one server start serves both.)"""
    server = start_server(tmp_path, fake)
    try:
        token = server.token
        stalled = text_reply("this answer is cut off by the crash " * 4, pieces=20)
        stalled.delay = 1.0  # twenty seconds of streaming: the kill lands in the middle
        replies.push(stalled)
        with http(server) as client:
            pid = client.post("/v1/processes", json={}).json()["pid"]
            run_id = client.post(f"/v1/processes/{pid}/messages", json={"text": "long answer"}).json()["run_id"]
            until(lambda: replies.requests, "the model call")
            assert server.kill(signal.SIGKILL) == -signal.SIGKILL
        replies.push(text_reply("The answer after the restart."))
        server.start()
        assert not [m for line in server.lines for m in TOKEN.findall(line)]  # no second admin token
        with http(server, token) as client:
            frames = follow_run(client, pid, run_id)
            assert client.get(f"/v1/processes/{pid}").json()["run_id"] is None
        finished = frames[-1]["data"]["payload"]
        assert finished["status"] == "ok"
        outputs = [f["data"]["payload"]["text"] for f in frames if f["data"]["signal"] == sig.RUN_OUTPUT]
        assert outputs == ["The answer after the restart."]
        assert len(replies.requests) == 2
        assert_sigterm_is_clean(server, token, pid)
    finally:
        server.stop()


def assert_sigterm_is_clean(server: Served, token: str, pid: str) -> None:
    outcome: dict[str, Any] = {}
    opened = threading.Event()

    def watch() -> None:
        try:
            with http(server, token) as client, client.stream("GET", f"/v1/processes/{pid}/events") as response:
                opened.set()
                outcome["frames"] = list(sse(response.iter_lines()))
                outcome["clean"] = True
        except httpx.HTTPError as exc:
            outcome["error"] = repr(exc)

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    assert opened.wait(WAIT)
    time.sleep(0.2)  # the server has the stream registered
    began = time.monotonic()
    assert server.kill(signal.SIGTERM) == 0, server.stderr()
    reader.join(WAIT)
    assert outcome.get("clean") is True, outcome
    assert outcome["frames"]  # the backlog came before the end
    assert time.monotonic() - began < 20
    log = server.stderr()
    assert token not in log and "Traceback" not in log


def test_serve_chat_from_stdin(tmp_path: Path, fake: OpenAIFake, replies: OpenAIFake) -> None:
    """The README's command, scripted: ``serve --chat`` reads lines from stdin, prints each answer on
    stdout, asks approvals on stderr (answered by the next line) and exits 0 at EOF, revoking the
    token it minted for the session."""
    workspace = tmp_path / "ws"
    (workspace / "junk").mkdir(parents=True)
    replies.push(text_reply("Hi from serve --chat.", pieces=3))
    replies.push(tool_reply("Shell", json.dumps({"command": "rm -rf junk"})), text_reply("Deleted junk."))
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTLOOP_MODEL", "AGENTLOOP_DATA", "AGENTLOOP_TOKEN")}
    env.update(OPENAI_BASE_URL=fake.base_url, OPENAI_API_KEY="sk-e2e", AGENTLOOP_CONFIG=str(tmp_path / "none.toml"))
    args = [str(AGENTLOOP), "serve", "--chat", "--port", "0", "--data", str(tmp_path / "data")]
    args += ["--model", "openai:gpt-4o-mini", "--workspace", str(workspace)]
    done = subprocess.run(args, input="hello\ndelete junk\ny\n", capture_output=True, text=True, env=env, timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Hi from serve --chat.\nDeleted junk.\n"
    assert "agentloop serving on http://127.0.0.1:" in done.stderr and "approve Shell rm -rf junk" in done.stderr
    assert not (workspace / "junk").exists()
    result = runner.invoke(app, ["token", "list", "--data", str(tmp_path / "data")])
    rows = [line.split("\t") for line in result.stdout.strip().splitlines()[1:]]
    assert [(r[2], r[4] != "-") for r in rows] == [("first start", False), ("serve --chat session", True)]


def test_loopback_detection() -> None:
    from agentloop.cli.serve import is_loopback, url_of

    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "192.168.1.4", "example.com", "::"))
    assert url_of("::1", 80) == "http://[::1]:80" and url_of("127.0.0.1", 8765) == "http://127.0.0.1:8765"


def test_chat_with_server_flag(served: Served, replies: OpenAIFake) -> None:
    replies.push(text_reply("Remote hello."))
    result = runner.invoke(
        app, ["chat", "--server", served.url, "--token", served.token, "--new"], input="hi over http\n"
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "Remote hello.\n"
    assert f"agentloop chat · {served.url} · admin" in result.stderr
    result = runner.invoke(app, ["chat", "--server", served.url, "--token", "al_wrong-token-wrong-token-wrong"])
    assert result.exit_code == 1 and "refused the token (from --token)" in result.stderr


def test_serve_chat_ends_cleanly_on_sigterm(tmp_path: Path, fake: OpenAIFake) -> None:
    """SIGTERM at the prompt: the server shuts down gracefully and the session's token is revoked
    (it was killed outright, leaving a live admin token behind)."""
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTLOOP_MODEL", "AGENTLOOP_DATA", "AGENTLOOP_TOKEN")}
    env.update(OPENAI_BASE_URL=fake.base_url, OPENAI_API_KEY="sk-e2e", AGENTLOOP_CONFIG=str(tmp_path / "none.toml"))
    args = [str(AGENTLOOP), "serve", "--chat", "--port", "0", "--data", str(tmp_path / "data")]
    args += ["--model", "openai:gpt-4o-mini", "--workspace", str(tmp_path)]
    proc = subprocess.Popen(
        args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stderr is not None
        while "new conversation" not in (line := proc.stderr.readline()):
            assert line, "serve --chat ended before its chat began"
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143
    result = runner.invoke(app, ["token", "list", "--data", str(tmp_path / "data")])
    rows = [line.split("\t") for line in result.stdout.strip().splitlines()[1:]]
    assert [(r[2], r[4] != "-") for r in rows] == [("first start", False), ("serve --chat session", True)]
