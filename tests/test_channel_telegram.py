"""The Telegram channel against a real local HTTP server that speaks the Bot API's wire format.

``FakeTelegram`` is a Starlette app under uvicorn on 127.0.0.1 (its own thread and event loop):
``getUpdates`` long-polls a list of updates the test adds (an ``offset`` confirms and drops the
ones before it, as Telegram does), the send methods are recorded and answered as Telegram answers
them, and failures (an HTTP status with a body, or bytes that are not JSON) can be queued per method.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from typer.testing import CliRunner

from agentloop import Reply, ScriptedModel, call, tool
from agentloop.channels.botapi import BotApi, BotApiError
from agentloop.channels.media import UNSUPPORTED
from agentloop.channels.telegram import CHAT_KEY, TelegramBridge
from agentloop.channels.telegram_text import MAX_MESSAGE, describe_request, split_message
from agentloop.cli.main import app
from agentloop.kernel import Approval, Kernel
from agentloop.messages import ToolResultMessage, UserMessage
from agentloop.models.base import ModelRequest
from tests.fakes.http_server import ServerThread

TOKEN = "4242:AAE-secret_Token-xyz0123456789"
SECRET = TOKEN.split(":", 1)[1]
ALICE, BOB, MALLORY = 100, 200, 999
FAST = (0.05, 0.2)  # the bridge's backoff in these tests


# ------------------------------------------------------------------------------- the fake Bot API


@dataclass
class Call:
    method: str
    params: dict[str, Any]
    at: float
    ok: bool  # answered ok: true (a failure the test queued, or a wrong token, is not)


class FakeTelegram:
    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.lock = threading.Lock()
        self.updates: list[dict[str, Any]] = []
        self.calls: list[Call] = []
        self.failures: dict[str, list[tuple[int, Any]]] = {}
        self._next_update = 1
        self._next_message = 1000
        self.app = Starlette(routes=[Route("/bot{token}/{method}", self.handle, methods=["POST"])])
        self.server = ServerThread(self.app)
        self.url = self.server.url

    async def handle(self, request: Request) -> Response:
        method = request.path_params["method"]
        token_ok = request.path_params["token"] == self.token
        try:
            params = await request.json()
        except ValueError:
            params = {}
        with self.lock:
            queued = self.failures.get(method)
            failure = queued.pop(0) if queued and token_ok else None
            entry = Call(method, params, time.monotonic(), token_ok and failure is None)
            self.calls.append(entry)
        if not token_ok:
            return JSONResponse({"ok": False, "error_code": 401, "description": "Unauthorized"}, 401)
        if failure is not None:
            status, body = failure
            if isinstance(body, bytes):
                return Response(body, status, media_type="text/html")
            return JSONResponse(body, status)
        return JSONResponse({"ok": True, "result": await self.result(method, params, entry)})

    async def result(self, method: str, params: dict[str, Any], entry: Call) -> Any:
        if method == "getMe":
            return {"id": 4242, "is_bot": True, "first_name": "Agent", "username": "agent_bot"}
        if method == "getUpdates":
            offset = int(params.get("offset") or 0)
            deadline = time.monotonic() + min(float(params.get("timeout") or 0), 0.2)
            with self.lock:  # the offset confirms the updates before it: Telegram forgets them
                self.updates = [u for u in self.updates if u["update_id"] >= offset]
            while True:
                with self.lock:
                    ready = [u for u in self.updates if u["update_id"] >= offset]
                if ready or time.monotonic() >= deadline:
                    return ready
                await asyncio.sleep(0.01)
        if method == "sendMessage":
            with self.lock:
                self._next_message += 1
                message_id = self._next_message
            entry.params["_message_id"] = message_id  # (what the test presses buttons on)
            chat = {"id": params["chat_id"], "type": "private"}
            return {"message_id": message_id, "chat": chat, "date": 0, "text": params.get("text")}
        return True

    # -- what the test does as a Telegram user

    def add(self, update: dict[str, Any], update_id: int | None = None) -> int:
        with self.lock:
            if update_id is None:
                update_id = self._next_update
                self._next_update += 1
            self.updates.append({"update_id": update_id, **update})
        return update_id

    def message(self, chat: int, user: int, text: str, update_id: int | None = None) -> int:
        sender = {"id": user, "is_bot": False, "first_name": f"User{user}"}
        body = {"message_id": 1, "from": sender, "chat": {"id": chat, "type": "private"}, "date": 0, "text": text}
        return self.add({"message": body}, update_id)

    def press(self, user: int, sent: dict[str, Any], data: str) -> int:
        message = {
            "message_id": sent["_message_id"],
            "chat": {"id": sent["chat_id"], "type": "private"},
            "date": 0,
            "text": sent["text"],
        }
        sender = {"id": user, "is_bot": False, "first_name": f"User{user}"}
        query = {"id": f"q{len(self.calls)}", "from": sender, "message": message, "chat_instance": "1", "data": data}
        return self.add({"callback_query": query})

    def fail(self, method: str, *failures: tuple[int, Any]) -> None:
        with self.lock:
            self.failures.setdefault(method, []).extend(failures)

    # -- what the test looks at

    def sent(self, method: str = "sendMessage", chat: int | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [
                c.params
                for c in self.calls
                if c.method == method and c.ok and (chat is None or c.params.get("chat_id") == chat)
            ]

    def texts(self, chat: int) -> list[str]:
        return [p["text"] for p in self.sent("sendMessage", chat)]

    def of(self, method: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.method == method]


@pytest.fixture
def fake() -> Iterator[FakeTelegram]:
    telegram = FakeTelegram()
    with telegram.server:
        yield telegram


async def until(check: Callable[[], Any], seconds: float = 5.0) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {getattr(check, '__name__', check)}")


# ------------------------------------------------------------------------------- the agent


def typed(message: UserMessage) -> str:
    """What the person typed: in a group chat the model sees the speaker's line before it
    (``[From: …]``, see tests/test_channel_speakers10.py), which these tests are not about."""
    line, _, rest = message.text.partition("\n")
    return (
        rest
        if message.origin is not None and message.origin.chat == "group" and line.startswith("[From: ")
        else message.text
    )


removed: list[str] = []
gate = threading.Event()


@tool
def rm(path: str) -> str:
    """Pretend to delete."""
    removed.append(path)
    return f"removed {path}"


@tool
async def wait_gate() -> str:
    """Wait for the test."""
    while not gate.is_set():
        await asyncio.sleep(0.01)
    return "opened"


def brain(req: ModelRequest) -> Reply | str:
    last = req.messages[-1]
    if isinstance(last, ToolResultMessage):
        return f"tool said: {last.text}"
    if isinstance(last, UserMessage) and typed(last) == "delete":
        return Reply(tool_calls=[call("rm", path="x")])
    if isinstance(last, UserMessage) and typed(last) == "gate":
        return Reply(tool_calls=[call("wait_gate")])
    if isinstance(last, UserMessage) and typed(last).startswith("long "):
        return "\n".join(f"line {n:04d} " + "x" * 40 for n in range(int(typed(last).split()[1])))
    return "seen: " + ", ".join(typed(m) for m in req.messages if isinstance(m, UserMessage))


async def policy(process: Any, row: Any) -> Approval:
    return (
        Approval("ask", ("destructive",), "rm deletes files", fingerprint="rm")
        if row.tool_name == "rm"
        else Approval("auto")
    )


def open_kernel(tmp_path: Path, model: ScriptedModel) -> Any:
    return Kernel.open(
        f"sqlite:///{tmp_path}/agentloop.db",
        model=model,
        workspace=tmp_path,
        tools=[rm, wait_gate],
        approval=policy,
        titles=None,
        heartbeat=None,
    )


@asynccontextmanager
async def running(
    tmp_path: Path, fake: FakeTelegram, **kw: Any
) -> AsyncIterator[tuple[Kernel, TelegramBridge, ScriptedModel]]:
    model = kw.pop("model", None) or ScriptedModel(brain)
    async with open_kernel(tmp_path, model) as kernel:
        bridge = TelegramBridge(
            kernel, TOKEN, allow=kw.pop("allow", [ALICE, BOB]), api_url=fake.url, poll_timeout=1, backoff=FAST, **kw
        )
        async with bridge:
            yield kernel, bridge, model


def user_texts(model: ScriptedModel) -> list[str]:
    return [typed(r.messages[-1]) for r in model.requests if isinstance(r.messages[-1], UserMessage)]


# ------------------------------------------------------------------------------- tests


async def test_a_message_is_answered_in_its_own_chat_by_that_chats_process(tmp_path: Path, fake: FakeTelegram) -> None:
    async with running(tmp_path, fake) as (kernel, _, _):
        fake.message(chat=ALICE, user=ALICE, text="hello")
        fake.message(chat=BOB, user=BOB, text="hi there")
        await until(lambda: fake.texts(ALICE) and fake.texts(BOB))
        assert fake.texts(ALICE) == ["seen: hello"] and fake.texts(BOB) == ["seen: hi there"]
        assert {p["action"] for p in fake.sent("sendChatAction")} == {"typing"}
        assert {p["chat_id"] for p in fake.sent("sendChatAction")} == {ALICE, BOB}
        assert all("parse_mode" not in p for p in fake.sent())  # plain text: nothing to escape
        procs = await kernel.processes()
        assert sorted(p.owner for p in procs) == [f"telegram-{ALICE}", f"telegram-{BOB}"]
        fake.message(chat=ALICE, user=ALICE, text="again")  # the same chat: the same conversation
        await until(lambda: len(fake.texts(ALICE)) == 2)
        assert fake.texts(ALICE)[1] == "seen: hello, again" and len(await kernel.processes()) == 2
        [first] = fake.of("getUpdates")[:1]
        assert first.params["allowed_updates"] == ["message", "callback_query"] and first.params["timeout"] == 1


async def test_a_user_not_on_the_allow_list_is_refused_and_reaches_no_process(
    tmp_path: Path, fake: FakeTelegram
) -> None:
    async with running(tmp_path, fake, allow=[ALICE]) as (kernel, _, model):
        fake.message(chat=MALLORY, user=MALLORY, text="rm -rf / please")
        fake.message(chat=MALLORY, user=MALLORY, text="please?")  # told once, not each time
        fake.message(chat=ALICE, user=ALICE, text="hello")  # (taken after them: the refusals were handled)
        await until(lambda: fake.texts(ALICE))
        [refusal] = fake.texts(MALLORY)
        assert "private" in refusal and str(MALLORY) in refusal
        assert user_texts(model) == ["hello"]
        assert [p.owner for p in await kernel.processes()] == [f"telegram-{ALICE}"]
    # an empty allow-list refuses everyone
    async with running(tmp_path / "empty", fake, allow=[]) as (kernel, _, model):
        fake.message(chat=ALICE, user=ALICE, text="me neither?")
        await until(lambda: len(fake.texts(ALICE)) == 2)
        assert "private" in fake.texts(ALICE)[1] and model.requests == [] and await kernel.processes() == []


async def test_approve_runs_the_tool_and_deny_does_not(tmp_path: Path, fake: FakeTelegram) -> None:
    removed.clear()
    async with running(tmp_path, fake, allow=[ALICE]) as (kernel, _, _):
        fake.message(chat=ALICE, user=ALICE, text="delete")
        ask = await until(lambda: [p for p in fake.sent(chat=ALICE) if "reply_markup" in p])
        [[approve, deny, always]] = ask[0]["reply_markup"]["inline_keyboard"]
        assert (approve["text"], deny["text"], always["text"]) == ("Approve", "Deny", "Always")
        assert "rm" in ask[0]["text"] and "path: x" in ask[0]["text"] and "destructive" in ask[0]["text"]
        assert removed == []  # nothing ran before the answer

        fake.press(MALLORY, ask[0], approve["callback_data"])  # not on the allow-list: refused
        fake.press(ALICE, ask[0], "hil:x:nonsense")  # garbage: no traceback, an answer
        await until(lambda: len(fake.sent("answerCallbackQuery")) == 2)
        assert [p["text"] for p in fake.sent("answerCallbackQuery")] == [
            "You are not allowed to answer this.",
            "Unknown button.",
        ]
        [proc] = await kernel.processes()
        assert len(await (await kernel.process(proc.pid)).pending_approvals()) == 1 and removed == []

        fake.press(ALICE, ask[0], approve["callback_data"])
        await until(lambda: "tool said: removed x" in fake.texts(ALICE))
        assert removed == ["x"]
        [edit] = await until(lambda: fake.sent("editMessageText"))
        assert fake.sent("answerCallbackQuery")[2]["text"] == "✅ Approved"
        assert edit["message_id"] == ask[0]["_message_id"] and edit["text"].endswith("✅ Approved by User100")
        assert "reply_markup" not in edit  # the buttons are gone

        fake.press(ALICE, ask[0], approve["callback_data"])  # pressed again: stale
        await until(lambda: len(fake.sent("answerCallbackQuery")) == 4)
        assert fake.sent("answerCallbackQuery")[3]["text"] == "This request is no longer pending."

        fake.message(chat=ALICE, user=ALICE, text="delete")
        ask = await until(lambda: [p for p in fake.sent(chat=ALICE) if "reply_markup" in p][1:])
        fake.press(ALICE, ask[0], ask[0]["reply_markup"]["inline_keyboard"][0][1]["callback_data"])  # Deny
        await until(lambda: len(fake.texts(ALICE)) == 4)
        assert removed == ["x"]  # denied: it did not run
        assert fake.texts(ALICE)[3].startswith("tool said:") and "denied" in fake.texts(ALICE)[3]
        assert fake.sent("answerCallbackQuery")[4]["text"] == "❌ Denied"


async def test_a_message_typed_instead_of_pressing_a_button_denies_and_is_answered(
    tmp_path: Path, fake: FakeTelegram
) -> None:
    """A chat has no prompt to type an answer into: a user who writes while a request waits (\"no,
    keep it\") declines it, and the model reads the refusal and the message together, in the
    run that asked; one answer comes, and the buttons go stale."""
    removed.clear()
    async with running(tmp_path, fake, allow=[ALICE]) as (kernel, _, model):
        fake.message(chat=ALICE, user=ALICE, text="delete")
        [ask] = await until(lambda: [p for p in fake.sent(chat=ALICE) if "reply_markup" in p])
        fake.message(chat=ALICE, user=ALICE, text="no, keep it")
        await until(lambda: len(fake.texts(ALICE)) == 2)
        [proc] = await kernel.processes()
        process = await kernel.process(proc.pid)
        await process.wait_idle()
        assert removed == [] and await process.pending_approvals() == []
        assert fake.texts(ALICE) == [ask["text"], "seen: delete, no, keep it"]  # one answer, in the run that asked
        last = model.requests[-1].messages
        assert isinstance(last[-2], ToolResultMessage) and last[-2].is_error and "denied" in last[-2].text.lower()
        fake.press(ALICE, ask, ask["reply_markup"]["inline_keyboard"][0][0]["callback_data"])  # Approve, too late
        await until(lambda: fake.sent("answerCallbackQuery"))
        assert fake.sent("answerCallbackQuery")[0]["text"] == "This request is no longer pending."
        assert removed == []


async def test_the_offset_survives_a_restart_and_a_redelivered_update_runs_once(
    tmp_path: Path, fake: FakeTelegram
) -> None:
    async with running(tmp_path, fake, allow=[ALICE]) as (kernel, bridge, model):
        first = fake.message(chat=ALICE, user=ALICE, text="hello")
        await until(lambda: fake.texts(ALICE))
        await until(lambda: bridge.state.offset == first + 1)
        [proc] = await kernel.processes()
    state = tmp_path / "var" / "telegram" / "4242.json"
    assert json.loads(state.read_text())["offset"] == first + 1
    polled = len(fake.of("getUpdates"))

    async with running(tmp_path, fake, allow=[ALICE], model=model) as (kernel, _, _):
        await until(lambda: len(fake.of("getUpdates")) > polled)
        assert fake.of("getUpdates")[polled].params["offset"] == first + 1  # picked up where it stopped
        fake.message(chat=ALICE, user=ALICE, text="more")
        await until(lambda: len(fake.texts(ALICE)) == 2)
        assert fake.texts(ALICE)[1] == "seen: hello, more"  # the same process, found again
        assert [p.pid for p in await kernel.processes()] == [proc.pid]

    # a crash after the input was accepted but before the offset was saved: Telegram sends it again
    saved = json.loads(state.read_text())
    state.write_text(json.dumps({**saved, "offset": first}))
    fake.message(chat=ALICE, user=ALICE, text="hello", update_id=first)
    async with running(tmp_path, fake, allow=[ALICE], model=model) as (kernel, bridge, _):
        await until(lambda: bridge.state.offset == first + 1)  # the redelivered update was taken
        fake.message(chat=ALICE, user=ALICE, text="last")
        await until(lambda: len(fake.texts(ALICE)) == 3)
        history = [m.text for m in await (await kernel.process(proc.pid)).messages() if isinstance(m, UserMessage)]
        assert history == ["hello", "more", "last"]  # "hello" ran once
        assert fake.texts(ALICE) == ["seen: hello", "seen: hello, more", "seen: hello, more, last"]
        assert user_texts(model) == ["hello", "more", "last"]
        kv = await kernel.store.kv_values(CHAT_KEY)
        assert kv == {proc.pid: f"4242:{ALICE}"}


async def test_a_long_answer_is_split_at_the_message_limit(tmp_path: Path, fake: FakeTelegram) -> None:
    async with running(tmp_path, fake, allow=[ALICE]) as (_, _, _):
        fake.message(chat=ALICE, user=ALICE, text="long 250")  # 250 lines of 50 characters: 12 749
        await until(lambda: len(fake.texts(ALICE)) >= 4)
        await asyncio.sleep(0.1)
        parts = fake.texts(ALICE)
        assert len(parts) == 4 and all(len(p) <= MAX_MESSAGE for p in parts)
        lines = "\n".join(parts).splitlines()
        assert lines == [f"line {n:04d} " + "x" * 40 for n in range(250)]  # cut at line breaks, nothing lost

    assert split_message("short") == ["short"]
    emoji = "😀" * 3000  # two UTF-16 code units each, as Telegram counts
    assert [len(p) for p in split_message(emoji)] == [2048, 952]
    words = ("word " * 2000).strip()
    assert all(p.startswith("word") and p.endswith("word") for p in split_message(words))
    assert " ".join(split_message(words)) == words
    # an approval request shows every argument, each one shortened where long
    payload = {"name": "Shell", "args": {"command": "y" * 1000, "cwd": "/w"}, "tags": ["destructive"], "reason": "rm"}
    shown = describe_request(payload)
    assert "command: " + "y" * 300 + "… (700 more characters)\ncwd: /w" in shown and "Flagged: destructive" in shown
    many = describe_request({"name": "Write", "args": {f"a{n}": "z" * 300 for n in range(40)}})
    assert len(many) < MAX_MESSAGE and many.endswith("… and 32 more arguments")


async def test_429_with_retry_after_and_500_are_retried_and_garbage_does_not_stop_the_loop(
    tmp_path: Path, fake: FakeTelegram
) -> None:
    fake.fail("getUpdates", (200, b"<html>bad gateway</html>"), (502, b"not json"))
    fake.fail(
        "sendMessage",
        (429, {"ok": False, "error_code": 429, "description": "Too Many Requests", "parameters": {"retry_after": 1}}),
        (500, {"ok": False, "error_code": 500, "description": "Internal Server Error"}),
    )
    async with running(tmp_path, fake, allow=[ALICE]) as (_, _, _):
        fake.message(chat=ALICE, user=ALICE, text="hello")
        await until(lambda: fake.texts(ALICE))
        sends = fake.of("sendMessage")
        assert len(sends) == 3 and fake.texts(ALICE) == ["seen: hello"]  # the answer once, on the third try
        assert sends[1].at - sends[0].at >= 0.95  # retry_after: 1 second
        assert sends[2].at - sends[1].at < 0.9  # the 500: the backoff
        assert len(fake.of("getUpdates")) >= 3  # went on past the garbage
        # an update that is not what it should be is skipped; the next is handled
        fake.add({"message": "junk"})
        fake.add({"callback_query": {"id": 5, "data": None}})
        fake.message(chat=ALICE, user=ALICE, text="still here")
        await until(lambda: len(fake.texts(ALICE)) == 2)


async def test_the_token_never_appears_in_the_logs(
    tmp_path: Path, fake: FakeTelegram, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    fake.fail("sendMessage", (500, {"ok": False, "error_code": 500, "description": f"boom at /bot{TOKEN}/x"}))
    async with running(tmp_path, fake, allow=[ALICE]) as (_, _, _):
        fake.message(chat=ALICE, user=ALICE, text="hello")
        fake.message(chat=MALLORY, user=MALLORY, text="hello")
        await until(lambda: fake.texts(ALICE) and fake.texts(MALLORY))
    wrong = BotApi("4242:wrong-token-9876543210", fake.url, backoff=FAST)
    with pytest.raises(BotApiError) as refused:
        await wrong.call("getMe")
    await wrong.close()
    assert refused.value.code == 401 and "wrong-token" not in str(refused.value)
    unreachable = BotApi(TOKEN, "http://127.0.0.1:9", backoff=(0.01, 0.01))
    with pytest.raises(BotApiError) as down:
        await unreachable.call("getMe", attempts=2)
    await unreachable.close()
    assert down.value.transient and TOKEN not in str(down.value)

    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "HTTP Request: POST" in text and f"{fake.url}/bot***/getUpdates" in text  # httpx did log, masked
    assert "boom at /bot***/x" in text and "network error" in text and str(MALLORY) in text
    assert TOKEN not in text and SECRET not in text and TOKEN not in caplog.text and SECRET not in caplog.text


async def test_stop_aborts_the_run_and_new_starts_a_fresh_conversation(tmp_path: Path, fake: FakeTelegram) -> None:
    gate.clear()
    async with running(tmp_path, fake, allow=[ALICE]) as (kernel, bridge, _):
        fake.message(chat=ALICE, user=ALICE, text="/stop")
        await until(lambda: fake.texts(ALICE) == ["Nothing is running."])
        fake.message(chat=ALICE, user=ALICE, text="gate")
        fake.message(chat=ALICE, user=ALICE, text="queued meanwhile")
        await until(lambda: bridge.state.offset == 4)
        [record] = await kernel.processes()
        process = await kernel.process(record.pid)
        assert [item.kind for item in await process.queued()] == ["queue"]  # waits for its own run
        fake.message(chat=ALICE, user=ALICE, text="/stop")
        await until(lambda: "Stopped." in fake.texts(ALICE))
        await until(lambda: fake.texts(ALICE)[-1].startswith("seen:"))  # then the queued message ran
        assert fake.texts(ALICE)[-1] == "seen: gate, queued meanwhile"
        fake.message(chat=ALICE, user=ALICE, text="/new@agent_bot")
        await until(lambda: "Started a new conversation." in fake.texts(ALICE))
        assert await process.messages() == []
        fake.message(chat=ALICE, user=ALICE, text="fresh")
        await until(lambda: fake.texts(ALICE)[-1] == "seen: fresh")  # the same chat's process, reset
        assert [r.pid for r in await kernel.processes()] == [record.pid]
        fake.message(chat=ALICE, user=ALICE, text="/help")
        fake.add({"message": {"message_id": 9, "from": {"id": ALICE}, "chat": {"id": ALICE}, "sticker": {}}})
        await until(lambda: fake.texts(ALICE)[-1] == UNSUPPORTED)
        assert "/new" in fake.texts(ALICE)[-2]


# ------------------------------------------------------------------------------- the command

runner = CliRunner()


@pytest.fixture
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG", "AGENTLOOP_DATA", "AGENTLOOP_STORE", "TELEGRAM_BOT_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return {}


def test_the_command_refuses_to_start_without_a_token_or_an_allow_list(
    tmp_path: Path, cli_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    no_token = runner.invoke(app, ["telegram", "--allow", "100"])
    assert no_token.exit_code == 2 and "no bot token: set TELEGRAM_BOT_TOKEN" in no_token.stderr
    other = runner.invoke(app, ["telegram", "--allow", "100", "--token-env", "MY_BOT"])
    assert other.exit_code == 2 and "set MY_BOT" in other.stderr
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", TOKEN)
    no_allow = runner.invoke(app, ["telegram"])
    assert no_allow.exit_code == 2 and "no Telegram user is allowed" in no_allow.stderr and "--allow" in no_allow.stderr
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "not a token/../")
    bad = runner.invoke(app, ["telegram", "--allow", "100"])
    assert bad.exit_code == 2 and "bot token" in bad.stderr and "not a token" not in bad.stderr
    for result in (no_token, other, no_allow, bad):
        assert "Traceback" not in result.stderr and TOKEN not in result.stderr + result.stdout
    assert not (tmp_path / "xdg" / "agentloop").exists()  # refused before anything was opened


def test_the_command_talks_through_a_bot_and_stops_cleanly_on_sigterm(
    tmp_path: Path, fake: FakeTelegram, cli_env: dict[str, str]
) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps(["hello from the agent"]))
    (tmp_path / "ws").mkdir()
    env = {**os.environ, "MY_BOT": TOKEN}
    command = [sys.executable, "-m", "agentloop.cli.main", "telegram", "--token-env", "MY_BOT", "--allow", str(ALICE)]
    command += ["--api-url", fake.url, "--data", str(tmp_path / "data"), "-w", str(tmp_path / "ws")]
    command += ["--model", f"scripted:{script}"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        fake.message(chat=ALICE, user=ALICE, text="hi")
        deadline = time.monotonic() + 15
        while not fake.texts(ALICE) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert fake.texts(ALICE) == ["hello from the agent"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "@agent_bot is listening" in err and "allowed users: 100" in err and TOKEN not in out + err
    assert json.loads((tmp_path / "data" / "var" / "telegram" / "4242.json").read_text())["offset"] == 2
