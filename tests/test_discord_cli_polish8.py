"""Discord slash commands acknowledged on arrival, the CLI's help text, and ``/model`` in a local chat.

A slash command waits its turn behind the messages before it (an attachment being downloaded …),
but Discord drops an interaction not answered within 3 seconds: ``/new`` and ``/stop`` are deferred
(type 5) as they arrive and answered by editing that response once handled; ``/help`` and refusals
are answered at once. The CLI's ``--help`` shows the README's metavars (``URL``, ``PID TEXT`` …),
and no ``<bool>`` for flags.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
import typer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from typer.testing import CliRunner

from agentloop.channels.discord import EPHEMERAL, HELP
from agentloop.cli.main import app
from tests import test_channel_discord as dc
from tests.fakes.http_server import ServerThread
from tests.image_support import png
from tests.test_channel_discord import ALICE, ALICE_DM, MALLORY, FakeDiscord, running, until

PNG = png(32, 24)
NO_MENTIONS = {"parse": []}


class SlowCdn:
    """Discord's CDN, holding each download until the test releases it."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.asked = threading.Event()
        self.server = ServerThread(Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET"])]))
        self.base = f"{self.server.url}/attachments/"

    async def handle(self, request: Request) -> Response:
        self.asked.set()
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        return Response(PNG, media_type="image/png")


@pytest.fixture
def fake() -> Iterator[FakeDiscord]:
    with FakeDiscord() as discord:
        yield discord


@pytest.fixture
def cdn() -> Iterator[SlowCdn]:
    slow = SlowCdn()
    with slow.server:
        yield slow
        slow.release.set()


def post_image(fake: FakeDiscord, cdn: SlowCdn, channel: int, user: int, text: str) -> None:
    """``user`` sends ``text`` with an image in ``channel``, its download held by ``cdn``."""
    event = fake.message(channel, user, text, live=False)
    url = f"{cdn.base}1/2/cat.png?ex=1&is=2&hm=abc"
    file = {"id": "1", "filename": "cat.png", "size": len(PNG), "url": url, "proxy_url": url}
    event["attachments"] = [file | {"content_type": "image/png"}]
    with fake.lock:
        fake.history[channel][-1]["attachments"] = event["attachments"]
    fake.gateway.dispatch("MESSAGE_CREATE", event)


def response(fake: FakeDiscord, token: str) -> dc.Call | None:
    return next((c for c in fake.of("callback") if c.ok and c.params["token"] == token), None)


async def test_a_command_behind_a_slow_download_is_acknowledged_at_once_then_edited(
    tmp_path: Path, fake: FakeDiscord, cdn: SlowCdn
) -> None:
    async with running(tmp_path, fake, allow=[ALICE], attachment_urls=(cdn.base,)) as (kernel, _, model):
        post_image(fake, cdn, ALICE_DM, ALICE, "look")
        await until(cdn.asked.is_set)  # the intake is held by the download
        sent = time.monotonic()
        new = fake.command(ALICE, "new", ALICE_DM)
        stop = fake.command(ALICE, "stop", ALICE_DM)
        help_ = fake.command(ALICE, "help", ALICE_DM)
        refused = fake.command(MALLORY, "new", dc.MALLORY_DM)
        await until(lambda: all(response(fake, t) for t in (new, stop, help_, refused)))
        for token in (new, stop, help_, refused):
            answered = response(fake, token)
            assert answered is not None and answered.at - sent < 3.0  # (Discord's limit)
        assert response(fake, new).body == {"type": 5}  # type: ignore[union-attr]
        assert response(fake, stop).body == {"type": 5, "data": {"flags": EPHEMERAL}}  # type: ignore[union-attr]
        assert fake.answer_to(help_) == {
            "type": 4,
            "data": {"content": HELP, "flags": EPHEMERAL, "allowed_mentions": NO_MENTIONS},
        }
        assert fake.answer_to(refused)["data"]["content"].startswith("Sorry, this bot is private.")  # type: ignore[index]
        await asyncio.sleep(0.2)
        assert fake.of("edit_original") == [] and fake.texts(ALICE_DM) == []  # (still behind the download)

        cdn.release.set()  # the message, then /new, then /stop, in order
        await until(lambda: fake.edit_of(new) and fake.edit_of(stop))
        assert fake.edit_of(new) == {"content": "Started a new conversation.", "allowed_mentions": NO_MENTIONS}
        assert fake.edit_of(stop) == {"content": "Nothing is running.", "allowed_mentions": NO_MENTIONS}
        [edit, _] = fake.of("edit_original")
        assert edit.params["app"] == str(dc.BOT)
        assert dc.user_texts(model)[0] == "look"  # the message went first
        [record] = await kernel.processes()
        assert await (await kernel.process(record.pid)).messages() == []  # then /new reset it
        assert "Started a new conversation." not in fake.texts(ALICE_DM)


async def test_a_failed_deferral_or_edit_is_told_in_the_channel(tmp_path: Path, fake: FakeDiscord) -> None:
    async with running(tmp_path, fake, allow=[ALICE]):
        fake.fail("edit_original", (404, {"message": "Unknown Webhook", "code": 10015}))
        token = fake.command(ALICE, "new", ALICE_DM)
        await until(lambda: fake.texts(ALICE_DM) == ["Started a new conversation."])
        assert response(fake, token) is not None and fake.edit_of(token) is None
        fake.fail("callback", (404, {"message": "Unknown interaction", "code": 10062}))
        token = fake.command(ALICE, "stop", ALICE_DM)
        await until(lambda: fake.texts(ALICE_DM)[-1:] == ["Nothing is running."])
        assert response(fake, token) is None and fake.of("edit_original")[-1].params["token"] != token


# ------------------------------------------------------------------ the CLI


def command_paths(group: click.Command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [path]
    for name, sub in getattr(group, "commands", {}).items():
        found += command_paths(sub, (*path, name))
    return found


def test_every_commands_help_shows_the_readmes_metavars_and_no_bool_type() -> None:
    runner = CliRunner()
    paths = command_paths(typer.main.get_command(app))
    assert ("send",) in paths and ("device", "connect") in paths and ("token", "revoke") in paths
    usage: dict[tuple[str, ...], str] = {}
    for path in paths:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"}, terminal_width=200)
        assert result.exit_code == 0, (path, result.output)
        text = result.output
        assert not re.search(r"\{[^}]*\}", text), (path, text)  # (no "{url}", "{PID}")
        assert "<bool>" not in text, (path, text)
        assert "--help" in text
        usage[path] = next(line.strip() for line in text.splitlines() if "Usage:" in line)
    assert usage[("send",)].endswith("send [OPTIONS] PID TEXT")
    assert usage[("run",)].endswith("run [OPTIONS] PROMPT")
    assert usage[("device", "connect")].endswith("connect [OPTIONS] URL")
    assert usage[("account", "create")].endswith("create [OPTIONS] NAME")
    assert usage[("approve",)].endswith("approve [OPTIONS] PID [REQ]")
    assert usage[("token", "revoke")].endswith("revoke [OPTIONS] ID")
    assert usage[()].endswith("[OPTIONS] COMMAND [ARGS]...")


def test_model_in_a_local_chat_shows_the_spec_the_user_gave(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG", "AGENTLOOP_DATA"):
        monkeypatch.delenv(name, raising=False)
    script = tmp_path / "replies.json"
    script.write_text(json.dumps(["hi back", "again back"]))
    spec = f"scripted:{script}"
    ws = tmp_path / "ws"
    ws.mkdir()
    stdin = "/model\nhello\n/model scripted:" + str(script) + "\n/model default\n/model\n"
    argv = ["chat", "-m", spec, "-w", str(ws), "--data", str(tmp_path / "data")]
    result = CliRunner().invoke(app, argv, input=stdin, env={"COLUMNS": "400"}, terminal_width=400)
    assert result.exit_code == 0, result.stderr
    err = " ".join(result.stderr.split())
    assert f"(model: {spec}, the default)" in err
    assert f"(model: back to the default, {spec})" in err
    assert err.count(f"(model: {spec}, the default)") == 2
    assert "scripted:scripted" not in err
    assert "hi back" in result.stdout
