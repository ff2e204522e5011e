"""``agentloop serve`` hosting the chat bridges on its own kernel (``--telegram OPTIONS``, or the
config file's ``[bridges]``): on the embedded SQLite store a bridge of its own next to the server
was refused (one runtime per database), so a user had to pick the web UI or the chat app.

The Telegram side is the fake Bot API of ``tests/test_channel_telegram.py``: a real HTTP server.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
import typer.main
from typer.testing import CliRunner

from agentloop import ScriptedModel
from agentloop.cli.approvals import parse_approval
from agentloop.cli.channel import Bridge, HostedBridge
from agentloop.cli.config import Settings
from agentloop.cli.main import CliError, app
from agentloop.cli.serve import ServeOptions, serve_async
from agentloop.kernel import Kernel
from tests.test_channel_telegram import ALICE, TOKEN, FakeTelegram

runner = CliRunner()
TOKEN_RE = re.compile(r"al_[A-Za-z0-9_-]+")


@pytest.fixture
def fake() -> Iterator[FakeTelegram]:
    telegram = FakeTelegram()
    with telegram.server:
        yield telegram


@pytest.fixture
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No config file of the user's, no data directory of theirs; the config file's path."""
    config = tmp_path / "config.toml"
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(config))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG", "AGENTLOOP_DATA", "AGENTLOOP_STORE", "TELEGRAM_BOT_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AGENTLOOP_TRANSCRIBE_MODEL", "AGENTLOOP_TRANSCRIBE_URL"):
        monkeypatch.delenv(name, raising=False)
    return config


def _lines(stream: IO[str] | None) -> queue.Queue[str]:
    """The lines of a child's stream as they come (a thread reads it: no read blocks the test)."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert stream is not None
        for line in stream:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _wait_for(lines: queue.Queue[str], prefix: str, seen: list[str], seconds: float = 20.0) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            continue
        seen.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no line starting {prefix!r} in {seen!r}")


def test_serve_answers_telegram_and_lists_the_chats_process_for_its_owner(
    tmp_path: Path, fake: FakeTelegram, cli_env: Path
) -> None:
    """One ``serve``, the bridge on its kernel: a message to the bot is answered in the chat, and
    the process that answered is the one its owner's token lists over the HTTP API (the bridge
    names it ``telegram-<user id>``: an account of that name sees it); SIGTERM closes the bridge,
    then the kernel, and exits 0."""
    script = tmp_path / "script.json"
    script.write_text(json.dumps(["hello from the agent"]))
    (tmp_path / "ws").mkdir()
    data = tmp_path / "data"
    env = {**os.environ, "TELEGRAM_BOT_TOKEN": TOKEN}
    command = [sys.executable, "-m", "agentloop.cli.main", "serve", "--port", "0", "--data", str(data)]
    command += ["-w", str(tmp_path / "ws"), "--model", f"scripted:{script}"]
    command += ["--telegram", f"--allow {ALICE} --api-url {fake.url}"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = _lines(proc.stdout)
        seen: list[str] = []
        admin_token = TOKEN_RE.findall(_wait_for(out, "created the admin account", seen))[0]
        listening = _wait_for(out, "agentloop telegram:", seen)
        assert "@agent_bot is listening" in listening and f"allowed users: {ALICE}" in listening
        url = _wait_for(out, "agentloop serving on ", seen).split()[-1]

        fake.message(chat=ALICE, user=ALICE, text="hi")
        deadline = time.monotonic() + 15
        while not fake.texts(ALICE) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert fake.texts(ALICE) == ["hello from the agent"]

        # the chat's owner as an API account (made on the database while serve runs, as README says)
        made = runner.invoke(app, ["account", "create", f"telegram-{ALICE}", "--data", str(data)])
        assert made.exit_code == 0, made.stderr
        owner_token = TOKEN_RE.findall(made.stdout)[0]
        with httpx.Client(base_url=url, timeout=10) as client:
            owners = client.get("/v1/processes", headers={"Authorization": f"Bearer {owner_token}"})
            assert owners.status_code == 200, owners.text
            listed = owners.json()["processes"]
            assert [p["owner"] for p in listed] == [f"telegram-{ALICE}"]
            history = client.get(
                f"/v1/processes/{listed[0]['pid']}/messages", headers={"Authorization": f"Bearer {owner_token}"}
            )
            assert history.status_code == 200 and "hello from the agent" in history.text and '"hi"' in history.text
            admins = client.get("/v1/processes", headers={"Authorization": f"Bearer {admin_token}"})
            assert admins.json()["processes"] == []  # (a list shows its caller's own processes, an admin's too)

        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        err = proc.stderr.read() if proc.stderr is not None else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and TOKEN not in err + "".join(seen)
    # the bridge closed before the kernel: the poll's offset was kept, the next start goes on from it
    assert json.loads((data / "var" / "telegram" / "4242.json").read_text())["offset"] == 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.parametrize("given", ["flag", "config file"])
def test_a_refused_bot_token_stops_serve_with_one_line_and_leaves_nothing_running(
    tmp_path: Path, fake: FakeTelegram, cli_env: Path, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    """Telegram answers 401 to the token: serve exits 1 with one ``error:`` line naming the bridge
    (no traceback, no token), before its port ever accepted, and with the database free again."""
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "4242:AAE-not_the_bots_token_0123456789")
    options = f"--allow {ALICE} --api-url {fake.url}"
    port = _free_port()
    data = tmp_path / "data"
    script = tmp_path / "script.json"
    script.write_text(json.dumps(["never asked"]))
    args = ["serve", "--port", str(port), "--data", str(data), "-w", str(tmp_path), "-m", f"scripted:{script}"]
    if given == "flag":
        args += ["--telegram", options]
    else:
        cli_env.write_text(f"[bridges]\ntelegram = {json.dumps(options)}\n")
    result = runner.invoke(app, args)
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert result.stderr.strip().splitlines()[-1] == (
        "error: the telegram bridge cannot start: Telegram getMe failed: Unauthorized (HTTP 401)"
    )
    assert "Traceback" not in result.stderr and "not_the_bots_token" not in result.stdout + result.stderr
    assert "agentloop serving on" not in result.stdout
    assert [c.method for c in fake.calls] == ["getMe"]  # (a refused token is not asked again)
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass  # nobody listens

    async def reopen() -> None:  # (the runtime lock of the embedded store was released)
        async with Kernel.open(f"sqlite:///{data.resolve()}/agentloop.db", model=ScriptedModel(["x"])):
            pass

    asyncio.run(reopen())


def test_the_bridges_options_are_its_commands_and_checked_before_serve_starts(
    tmp_path: Path, cli_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bridge's own checks refuse as its command refuses (exit 2); what opens the kernel is
    serve's to set, so giving it to the bridge is refused rather than ignored; a bad ``[bridges]``
    table stops serve too, rather than leave a bridge written down unstarted."""
    data = tmp_path / "data"
    base = ["serve", "--port", "0", "--data", str(data), "-w", str(tmp_path)]
    no_token = runner.invoke(app, [*base, "--telegram", f"--allow {ALICE}"])
    assert no_token.exit_code == 2 and "no bot token: set TELEGRAM_BOT_TOKEN" in no_token.stderr
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", TOKEN)
    no_allow = runner.invoke(app, [*base, "--telegram", ""])
    assert no_allow.exit_code == 2 and "no Telegram user is allowed" in no_allow.stderr
    kernels = runner.invoke(app, [*base, "--telegram", f"--allow {ALICE} --model openai:gpt-4o --approval auto"])
    assert kernels.exit_code == 2 and "error: --telegram: --model, --approval: set on serve itself" in kernels.stderr
    unknown = runner.invoke(app, [*base, "--telegram", f"--allow {ALICE} --bogus"])
    assert unknown.exit_code == 2 and "error: --telegram: No such option: --bogus" in unknown.stderr
    unclosed = runner.invoke(app, [*base, "--telegram", "--allow '1"])
    assert unclosed.exit_code == 2 and "error: --telegram: No closing quotation" in unclosed.stderr
    cli_env.write_text('[bridges]\ntelegram = "--allow 1"\nsignal = "--allow 2"\n')
    misspelt = runner.invoke(app, base)
    assert misspelt.exit_code == 2 and "bridges names no bridge: signal" in misspelt.stderr
    for result in (no_token, no_allow, kernels, unknown, unclosed, misspelt):
        assert "Traceback" not in result.stderr and TOKEN not in result.stdout + result.stderr
        assert "agentloop serving on" not in result.stdout
    assert not (data / "agentloop.db").exists()  # refused before the kernel was opened


class _Ending:
    """A bridge that stops by itself (a Discord token revoked while serving, say); it records
    whether the kernel was still open when it was closed."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.closed_on_open_kernel: bool | None = None

    async def wait(self) -> None:
        await asyncio.sleep(0.2)

    async def close(self) -> None:
        try:
            await self.kernel.store.list_accounts()
            self.closed_on_open_kernel = True
        except Exception:
            self.closed_on_open_kernel = False


def test_a_bridge_that_stops_by_itself_stops_serve_after_closing_it_on_the_open_kernel(tmp_path: Path) -> None:
    bridges: list[_Ending] = []

    async def start(kernel: Kernel, settings: Settings) -> tuple[Bridge, str]:
        bridge = _Ending(kernel)
        bridges.append(bridge)
        return bridge, "listening"

    out = io.StringIO()
    script = tmp_path / "script.json"
    script.write_text(json.dumps(["never asked"]))
    settings = Settings(model=f"scripted:{script}", model_source="test")
    opts = ServeOptions(
        "127.0.0.1", 0, tmp_path.resolve(), tmp_path.resolve(), settings, parse_approval("ask"), out=out
    )
    opts.bridges = [HostedBridge("telegram", start)]
    with pytest.raises(CliError, match="the telegram bridge stopped"):
        asyncio.run(asyncio.wait_for(serve_async(opts, signals=False), 20))
    assert "agentloop telegram: listening" in out.getvalue() and "agentloop serving on" in out.getvalue()
    assert [b.closed_on_open_kernel for b in bridges] == [True]


def test_what_a_bridge_shares_with_serve_is_refused_when_serve_hosts_it() -> None:
    """Every option a bridge's command shares with ``serve`` opens or runs the kernel (the WhatsApp
    webhook's --host and --port aside: they are its own), so a hosted bridge may not be given it;
    and every name the refusal knows is one of each bridge's options (a misspelt one refuses nothing)."""
    from agentloop.cli.channel import KERNEL_OPTIONS
    from agentloop.cli.config import BRIDGES

    commands: Any = typer.main.get_command(app)
    serve = {param.name for param in commands.commands["serve"].params}
    for name in BRIDGES:
        own = {param.name for param in commands.commands[name].params}
        assert (own & serve) - {"host", "port"} == KERNEL_OPTIONS, name
