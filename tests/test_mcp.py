"""MCP servers as tool sources (DESIGN §4): real servers on the official SDK, over stdio and
Streamable HTTP; their tools run in the loop, in a durable process, and under the approval policy."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from agentloop import Agent, Reply, ScriptedModel, ToolResultMessage, UserMessage, call
from agentloop.cli.main import app
from agentloop.models.base import ModelRequest
from agentloop.tools.base import ToolError
from agentloop.tools.mcp import MCPError, MCPServerConfig, mcp_tools
from tests.process_support import kernel

pytest.importorskip("mcp")

SERVER = str(Path(__file__).parent / "fakes" / "mcp_server.py")


def fake(name: str = "fake", **kw: object) -> dict[str, object]:
    return {"name": name, "command": sys.executable, "args": [SERVER], **kw}


@pytest.fixture
def short_sdk_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """For a test whose server never reads its stdin again (asleep, or wedged): on stopping it the
    SDK closes that stdin and waits out its grace period (2 s) for the server to exit before it
    kills the server's process tree. This server never exits by itself, so the wait was only
    time lost; with a shorter one the SDK takes the same path (the kill), sooner."""
    from mcp.client import stdio

    monkeypatch.setattr(stdio, "PROCESS_TERMINATION_TIMEOUT", 0.5, raising=False)


def _results(messages: list[object]) -> list[ToolResultMessage]:
    return [m for m in messages if isinstance(m, ToolResultMessage)]


async def test_a_servers_tools_run_in_the_loop_under_prefixed_names():
    async with mcp_tools([fake()]) as tools:
        by_name = {t.name: t for t in tools}
        assert {"fake__add", "fake__fail", "fake__nap"} <= set(by_name)
        assert by_name["fake__add"].syscall == "mcp.fake.add"
        assert by_name["fake__add"].parameters["required"] == ["a", "b"]
        model = ScriptedModel(
            [Reply(tool_calls=[call("fake__add", a=2, b=40), call("fake__fail", why="no disk")]), "done"]
        )
        result = await Agent(model=model, tools=tools).run("add")
    ok, failed = _results(result.messages)
    assert (ok.text, ok.is_error) == ("42", False)
    assert failed.is_error and "fail" in failed.text
    assert result.text == "done"


async def test_bad_arguments_and_timeouts_are_error_results_and_the_run_goes_on():
    async with mcp_tools([fake(timeout=0.5)]) as tools:
        model = ScriptedModel(
            [Reply(tool_calls=[call("fake__add", a="two", b=1), call("fake__nap", seconds=5)]), "carried on"]
        )
        started = time.monotonic()
        result = await Agent(model=model, tools=tools).run("go")
        elapsed = time.monotonic() - started
        after = await Agent(
            model=ScriptedModel([Reply(tool_calls=[call("fake__add", a=1, b=1)]), "ok"]), tools=tools
        ).run("again")
    bad, slow = _results(result.messages)
    assert bad.is_error and slow.is_error and "timed out" in slow.text.lower()
    assert elapsed < 4 and result.text == "carried on"
    assert _results(after.messages)[0].text == "2"  # the server still answers after a cancelled call


async def test_a_server_that_dies_gives_an_error_result_and_is_started_again_on_the_next_call():
    async with mcp_tools([fake()]) as tools:
        model = ScriptedModel(
            [
                Reply(tool_calls=[call("fake__whoami")]),
                Reply(tool_calls=[call("fake__crash")]),
                Reply(tool_calls=[call("fake__whoami")]),
                "done",
            ]
        )
        result = await Agent(model=model, tools=tools).run("go")
    before, crashed, after = _results(result.messages)
    assert crashed.is_error and "fake" in crashed.text
    assert not after.is_error and after.text.isdigit() and after.text != before.text


async def test_a_server_that_cannot_start_is_a_clear_error_with_its_stderr(short_sdk_grace: None):
    broken = {"name": "broken", "command": sys.executable, "args": ["-c", "import sys; sys.exit('no config file')"]}
    with pytest.raises(MCPError) as info:
        async with mcp_tools([broken]):
            pass
    assert "'broken'" in str(info.value) and "no config file" in str(info.value)
    with pytest.raises(MCPError, match="did not start within"):
        async with mcp_tools(
            [
                {
                    "name": "mute",
                    "command": sys.executable,
                    "args": ["-c", "import time; time.sleep(30)"],
                    "startup_timeout": 1,
                }
            ]
        ):
            pass


def test_a_server_config_names_exactly_one_transport():
    with pytest.raises(ValidationError, match="exactly one"):
        MCPServerConfig.model_validate({"name": "x", "command": "srv", "url": "http://127.0.0.1:1/mcp"})
    with pytest.raises(ValidationError, match="exactly one"):
        MCPServerConfig.model_validate({"name": "x"})
    with pytest.raises(ValidationError, match="name"):
        MCPServerConfig.model_validate({"name": "a b", "command": "srv"})
    with pytest.raises(ValidationError, match="timeout"):
        MCPServerConfig.model_validate({"name": "x", "command": "srv", "timeout": 0})


async def test_a_hidden_server_is_reached_through_the_mcp_tool():
    async with mcp_tools([fake(expose=False, tools=["add", "nap"])]) as tools:
        assert [t.name for t in tools] == ["mcp"]
        model = ScriptedModel(
            [
                Reply(tool_calls=[call("mcp", server="fake")]),
                Reply(tool_calls=[call("mcp", server="fake", tool="add", arguments={"a": 3, "b": 4})]),
                Reply(tool_calls=[call("mcp", server="fake", tool="crash")]),
                Reply(tool_calls=[call("mcp", server="nope")]),
                Reply(tool_calls=[call("mcp", server=["fake"])]),  # not a string: an argument error, no crash
                "done",
            ]
        )
        result = await Agent(model=model, tools=tools).run("go")
    listing, added, refused, unknown, odd = _results(result.messages)
    assert "add" in listing.text and "nap" in listing.text and "crash" not in listing.text
    assert added.text == "7"
    assert refused.is_error and "no tool 'crash'" in refused.text
    assert unknown.is_error and "server" in unknown.text
    assert odd.is_error and "must be one of" in odd.text


async def test_an_mcp_call_in_a_durable_process_is_judged_by_its_mcp_syscall(tmp_path):
    policy = {"default": "auto", "rules": [{"match": "mcp.fake.*", "action": "ask"}]}
    async with mcp_tools([fake()]) as tools:
        model = ScriptedModel([Reply(tool_calls=[call("fake__add", a=1, b=2)]), "three"])
        async with kernel(tmp_path, model, tools=tools, policy=policy) as k:
            proc = await k.spawn(owner="a", interactive=True)
            await proc.send("add")
            asked = None
            async for s in proc.signals(follow=True):
                if s.signal == "proc.run.hil.requested":
                    asked = s.payload
                    break
            assert asked is not None and asked["syscall"] == "mcp.fake.add"
            await proc.hil(asked["requestId"], "approve")
            await proc.wait_idle()
            messages = await proc.messages()
    assert _results(messages)[0].text == "3" and messages[-1].text == "three"


async def test_the_prompt_names_the_mcp_servers_a_process_has(tmp_path):
    (tmp_path / "config/ai/context.d").mkdir(parents=True)
    (tmp_path / "config/ai/context.d/10-mcp.md").write_text("MCP servers: {{mcp_servers}}.")
    (tmp_path / "home/alice").mkdir(parents=True)
    (tmp_path / "home/alice/mcp.json").write_text(json.dumps([fake("mine")]))
    async with mcp_tools([fake("shared")]) as tools:
        model = ScriptedModel(["hi alice", "hi bob"])
        async with kernel(tmp_path, model, tools=tools) as k:
            for owner in ("alice", "bob"):
                proc = await k.spawn(owner=owner)
                await proc.send("hello")
                await proc.wait_idle()
    alice, bob = (r.system_prompt for r in model.requests)
    assert "MCP servers: shared, mine." in alice  # the kernel's, then the account's own
    assert "MCP servers: shared." in bob


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def http_server() -> AsyncIterator[str]:
    """The test MCP server over Streamable HTTP, once it answers; its URL."""
    port = _free_port()
    server = await asyncio.create_subprocess_exec(sys.executable, SERVER, "http", str(port), stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        deadline = time.monotonic() + 20
        async with httpx.AsyncClient() as http:
            while True:
                try:
                    await http.get(url)
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "the HTTP MCP server did not come up"
                    await asyncio.sleep(0.1)
        yield url
    finally:
        server.terminate()
        await server.wait()


async def test_a_server_over_streamable_http():
    async with http_server() as url, mcp_tools([{"name": "web", "url": url, "headers": {"X-Test": "1"}}]) as tools:
        model = ScriptedModel([Reply(tool_calls=[call("web__add", a=20, b=22)]), "done"])
        result = await Agent(model=model, tools=tools).run("add")
    assert _results(result.messages)[0].text == "42"


# ------------------------------------------------------------------------------ the command line


def _cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config_text: str) -> Path:
    (tmp_path / "config.toml").write_text(config_text)
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    return workspace


def _server_table(name: str = "fake") -> str:
    return f'[[mcp_servers]]\nname = "{name}"\ncommand = {json.dumps(sys.executable)}\nargs = [{json.dumps(SERVER)}]\n'


@pytest.mark.parametrize("command", ["run", "chat", "chat --memory"])
def test_mcp_servers_from_the_config_file_give_their_tools_to_run_and_chat(tmp_path, monkeypatch, command):
    ws = _cli_env(tmp_path, monkeypatch, _server_table())
    script = tmp_path / "s.json"
    script.write_text(
        json.dumps({"replies": [{"tool_calls": [{"name": "fake__add", "arguments": {"a": 19, "b": 23}}]}, "It is 42."]})
    )
    args = [
        *command.split(),
        "-m",
        f"scripted:{script}",
        "-w",
        str(ws),
        "--approval",
        "auto",
    ]  # the default asks for mcp.*
    if command == "run":
        result = CliRunner().invoke(app, [*args, "add them"])
    else:
        result = CliRunner().invoke(app, [*args, "--data", str(tmp_path / "data")], input="add them\n")
    assert result.exit_code == 0, result.stderr
    assert "It is 42." in result.stdout
    assert '✓ fake__add {"a": 19, "b": 23}' in result.stderr  # it ran, and succeeded


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ('[[mcp_servers]]\nname = "x"\n', "exactly one of `command`"),
        ('[[mcp_servers]]\nname = "a b"\ncommand = "srv"\n', "mcp_servers[0]"),
        ('mcp_servers = "srv"\n', "list of tables"),
        ('[[mcp_servers]]\nname = "x"\ncommand = "a"\n[[mcp_servers]]\nname = "x"\ncommand = "b"\n', "two mcp_servers"),
    ],
)
def test_a_bad_mcp_server_table_is_exit_2_naming_it(tmp_path, monkeypatch, table, expected):
    ws = _cli_env(tmp_path, monkeypatch, table)
    result = CliRunner().invoke(app, ["run", "-m", "scripted:/nonexistent.json", "-w", str(ws), "go"])
    assert result.exit_code == 2, result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr


def test_an_mcp_server_that_cannot_start_stops_the_command_with_its_reason(tmp_path, monkeypatch):
    args = json.dumps(["-c", "raise SystemExit('missing token')"])
    table = f'[[mcp_servers]]\nname = "broken"\ncommand = {json.dumps(sys.executable)}\nargs = {args}\n'
    ws = _cli_env(tmp_path, monkeypatch, table)
    script = tmp_path / "s.json"
    script.write_text(json.dumps({"replies": ["never"]}))
    result = CliRunner().invoke(app, ["run", "-m", f"scripted:{script}", "-w", str(ws), "go"])
    assert result.exit_code == 1
    assert "error: MCP server 'broken'" in result.stderr and "missing token" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_mcp_tool_is_not_mistaken_for_a_device_tool_by_the_policy():
    from agentloop.process.approval.tags import call_target

    assert call_target("mcp.fake.add", "fake__add", {}) == "local"
    assert call_target("tool.laptop__add", "laptop__add", {}) == "laptop"  # a device's own tool stays remote


# ------------------------------------------------------------------------------ per account


async def test_an_accounts_mcp_file_gives_its_processes_the_servers_tools(tmp_path, caplog):
    """``<data>/home/<account>/mcp.json`` (DESIGN §4: MCP servers per account): alice's runs get
    the server's tools, bob's do not; a changed file restarts the servers; a bad file is logged
    and the runs go on without them."""
    seen: dict[str, list[str]] = {}

    def brain(request: ModelRequest) -> Reply | str:
        owner = request.messages[-1].text if isinstance(request.messages[-1], UserMessage) else ""
        names = sorted(t.name for t in request.tools)
        if isinstance(request.messages[-1], UserMessage):
            seen[owner] = names
            if "fake__whoami" in names:
                return Reply(tool_calls=[call("fake__whoami")])
        return "ok"

    home = tmp_path / "home"
    (home / "alice").mkdir(parents=True)
    mcp_file = home / "alice" / "mcp.json"
    mcp_file.write_text(json.dumps([fake()]))
    policy = {"default": "auto", "rules": []}
    async with kernel(tmp_path, ScriptedModel(brain), policy=policy, data_dir=tmp_path) as k:
        alice, bob = await k.spawn(owner="alice"), await k.spawn(owner="bob")
        for proc, who in ((alice, "alice"), (bob, "bob")):
            await proc.send(who)
            await proc.wait_idle()
        first = _results(await alice.messages())[0].text
        assert "fake__add" in seen["alice"] and not any(n.startswith("fake__") for n in seen["bob"])

        mcp_file.write_text(json.dumps({"mcp_servers": [fake(), fake("again")]}))  # changed: restarted
        await alice.send("alice")
        await alice.wait_idle()
        assert "again__add" in seen["alice"]
        second = _results(await alice.messages())[-1].text
        assert first.isdigit() and second.isdigit() and first != second  # a new server process

        mcp_file.write_text("{not json")
        await alice.send("alice")
        await alice.wait_idle()
        assert not any(n.startswith(("fake__", "again__")) for n in seen["alice"])
    assert "MCP servers of account 'alice'" in caplog.text


async def test_a_call_through_the_mcp_tool_is_judged_as_the_server_tool_it_reaches(tmp_path):
    """A rule on ``mcp.fake.*`` applies whether the server is exposed or hidden behind ``mcp``."""
    policy = {"default": "auto", "rules": [{"match": "mcp.fake.*", "action": "deny"}]}
    async with mcp_tools([fake(expose=False)]) as tools:
        model = ScriptedModel([Reply(tool_calls=[call("mcp", server="fake", tool="whoami")]), "done"])
        async with kernel(tmp_path, model, tools=tools, policy=policy) as k:
            proc = await k.spawn(owner="a")
            await proc.send("go")
            await proc.wait_idle()
            [result] = _results(await proc.messages())
    assert result.is_error and "denied" in result.text and "mcp.fake" in result.text
    gateway = tools[0]
    assert gateway.syscall_for({"server": "fake", "tool": "add"}) == "mcp.fake.add"
    assert gateway.syscall_for({"server": "fake"}) == "mcp.fake.list_tools"


async def test_a_server_printing_garbage_on_stdout_is_logged_in_one_line_per_line(tmp_path, caplog, short_sdk_grace):
    """QA: the SDK logged a fifty-line traceback for each stray line a server printed."""
    noisy = tmp_path / "noisy.py"
    noisy.write_text("import time\nprint('hello, not json', flush=True)\ntime.sleep(30)\n")
    with pytest.raises(MCPError, match="did not start within 1 s"):
        async with mcp_tools(
            [{"name": "noisy", "command": sys.executable, "args": [str(noisy)], "startup_timeout": 1}]
        ):
            pass
    records = [r for r in caplog.records if r.name.startswith("mcp")]
    assert records and all(r.exc_info is None and "\n" not in r.getMessage() for r in records)
    assert "Failed to parse" in records[0].getMessage()


RAW = str(Path(__file__).parent / "fakes" / "raw_mcp_server.py")


def raw(mode: str, **kw: object) -> dict[str, object]:
    return {"name": "raw", "command": sys.executable, "args": [RAW, mode], **kw}


async def test_a_byte_that_is_not_utf8_does_not_jam_the_servers_connection():
    """With the SDK's strict decoding one bad byte stopped the reader: every later call waited out
    its timeout, and nothing restarted the server."""
    async with mcp_tools([raw("latin1-once", timeout=5)]) as tools:
        [get] = tools
        answers = [await get.run({}, None) for _ in range(3)]  # type: ignore[arg-type]
    assert [a.content[0].text for a in answers] == ["caf\ufffd", "call 2", "call 3"]  # type: ignore[union-attr]


async def test_what_a_server_sends_is_kept_only_where_it_is_what_it_says():
    """An "image" that is HTML, not base64, becomes a note (a provider refuses it at every later
    call); structured output past the result cap is not stored with the result."""
    async with mcp_tools([raw("image")]) as tools:
        result = await tools[0].run({}, None)  # type: ignore[arg-type]
    [block] = result.content
    assert block.type == "text" and "not a png, jpeg, gif or webp" in block.text  # type: ignore[union-attr]
    async with mcp_tools([raw("big-struct")]) as tools:
        result = await tools[0].run({}, None)  # type: ignore[arg-type]
    assert result.content[0].text == "ok" and result.details is None  # type: ignore[union-attr]


async def test_a_server_that_cannot_be_restarted_tells_the_model_nothing_of_its_command_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its arguments and stderr may hold the operator's secrets (a database URL, a token): the
    model and the account see that it failed, the operator's log says why. A server stopped
    because its configuration changed stays stopped for a run that still holds its tools."""
    from agentloop.tools.mcp import MCPConnection

    marker = tmp_path / "started"
    script = (
        f"import os, sys\nif os.path.exists({str(marker)!r}):\n"
        "    sys.stderr.write('bad token ' + sys.argv[-1]); sys.exit(1)\n"
        f"open({str(marker)!r}, 'w').close()\nos.execv(sys.executable, [sys.executable, {RAW!r}, 'ok'])\n"
    )
    config = MCPServerConfig(name="gh", command=sys.executable, args=["-c", script, "--token", "ghp_SECRET1234"])
    connection = MCPConnection(config)
    await connection.start()
    await connection._stop_task()  # the server went away; the next call starts it again, and that fails
    with pytest.raises(Exception) as info:
        await connection.call("get", {})
    assert "ghp_SECRET1234" not in str(info.value) and "'gh' is not available" in str(info.value)
    assert any("ghp_SECRET1234" in r.getMessage() for r in caplog.records)  # (the operator's log)
    await connection.close()
    with pytest.raises(Exception, match="configuration changed"):
        await connection.call("get", {})


# ------------------------------------------------------------------------------ a wedged server

WEDGED = (  # the fake server, plus a tool that blocks its event loop: it reads nothing more, ever
    "import sys, time\n"
    f"sys.path.insert(0, {str(Path(SERVER).parent)!r})\n"
    "from mcp_server import app\n"
    "@app.tool()\n"
    "async def wedge() -> str:\n"
    '    """Stop answering anything (an infinite loop, a deadlock)."""\n'
    "    time.sleep(3600)\n"
    "    return 'never'\n"
    "app.run()\n"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _gone(pid: int, within: float = 8.0) -> bool:
    deadline = time.monotonic() + within
    while _alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return not _alive(pid)


async def test_a_server_whose_calls_time_out_again_and_again_is_killed_and_started_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, short_sdk_grace: None
) -> None:
    """A wedged server made every later call wait out its timeout, for ever: after
    ``restart_after_timeouts`` calls in a row time out (here in the loop, which cancels them at the
    deadline), its process is killed and the next call starts a new one, just one however many
    calls come at once. The log names the server, not its command line."""
    script = tmp_path / "wedged.py"
    script.write_text(WEDGED)
    server = {"name": "stuck", "command": sys.executable, "args": [str(script), "--token", "ghp_SECRET1234"]}
    async with mcp_tools([{**server, "timeout": 0.5}]) as tools:
        whoami = next(t for t in tools if t.name == "stuck__whoami")
        before = int((await whoami.run({}, None)).content[0].text)  # type: ignore[arg-type, union-attr]
        model = ScriptedModel([*(Reply(tool_calls=[call("stuck__wedge")]) for _ in range(3)), "gave up"])
        result = await Agent(model=model, tools=tools).run("go")
        timed_out = _results(result.messages)
        assert len(timed_out) == 3 and all(r.is_error and "timed out" in r.text for r in timed_out)
        assert await _gone(before), "the wedged server's process is still there"
        answers = await asyncio.gather(*(whoami.run({}, None) for _ in range(3)))  # type: ignore[arg-type]
    after = {int(a.content[0].text) for a in answers}  # type: ignore[union-attr]
    assert len(after) == 1 and before not in after  # one new process, for all three calls
    assert "'stuck' timed out 3 times in a row" in caplog.text and "ghp_SECRET1234" not in caplog.text


async def test_an_answer_between_timeouts_clears_the_count_and_a_call_in_flight_fails_cleanly() -> None:
    """Only timeouts in a row count (here the SDK's own deadline, the call made directly, and
    ``restart_after_timeouts`` set to 2): one answer in between and the server is kept. A call
    still waiting when the server is given up fails at once, saying why."""
    from agentloop.tools.mcp import MCPConnection

    connection = MCPConnection(MCPServerConfig.model_validate(fake(timeout=0.5, restart_after_timeouts=2)))

    async def whoami() -> str:
        return (await connection.call("whoami", {})).content[0].text  # type: ignore[union-attr]

    async def nap() -> str:
        with pytest.raises(ToolError) as info:
            await connection.call("nap", {"seconds": 30})
        return str(info.value)

    try:
        first = await whoami()
        assert "timed out" in await nap()
        assert await whoami() == first
        assert "timed out" in await nap()
        assert await whoami() == first  # two timeouts, not in a row: the same process
        assert "timed out" in await nap()
        second = asyncio.create_task(nap())
        await asyncio.sleep(0.25)
        started = time.monotonic()
        in_flight = await nap()  # its own deadline is 0.5 s away, the second's 0.25 s
        assert "timed out" in await second
        assert "'fake' was stopped before nap answered" in in_flight and "2 times in a row" in in_flight
        assert time.monotonic() - started < 0.45
        assert await whoami() != first and await _gone(int(first))
    finally:
        await connection.close()
