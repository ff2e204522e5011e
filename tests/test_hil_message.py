"""Denying an approval with a message for the model ("no — use the staging database instead"):
the kernel, its durability across a restart, HTTP, the WebSocket, the Python client, the chat
prompt (``n REASON``) and the in-memory hook. Bad input is refused without touching the pending
approval, which stays answerable."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from agentloop import Reply, ScriptedModel, ToolResultMessage, call
from agentloop.cli.approvals import Denial, PolicyHook, Question, ask_user, parse_answer
from agentloop.client import AgentloopClient, ClientError
from agentloop.kernel import Approval
from agentloop.loop.hooks import Block, ToolCallInfo
from agentloop.messages import AssistantMessage, ToolCall
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.approval import Policy
from agentloop.process.approval.denial import MAX_DENIAL_MESSAGE, denial_text
from tests import server_support
from tests import test_web_ui_browser as web_ui
from tests.cdp import Browser
from tests.process_support import echo, kernel
from tests.server_support import LiveServer, pending_requests, remote_chat, wait_idle
from tests.test_web_ui_browser import send, sign_in_and_open_a_process
from tests.ws_support import KernelServer

STAGING = "no — use the staging database instead"


async def asking(process: Any, row: Any) -> Approval:
    """Every echo of "risky" waits for a person."""
    if row.tool_name == "echo" and row.args.get("text") == "risky":
        return Approval("ask", ("destructive",), "echo of something risky", fingerprint=json.dumps(row.args))
    return Approval("auto")


def risky_model() -> ScriptedModel:
    """Calls echo("risky"), then answers with the tool result it was given."""

    def script(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if isinstance(last, ToolResultMessage):
            return f"done: {last.text}"
        return Reply(tool_calls=[call("echo", text="risky")])

    return ScriptedModel(script)


def tool_results(req: ModelRequest) -> list[ToolResultMessage]:
    return [m for m in req.messages if isinstance(m, ToolResultMessage)]


async def pending_of(proc: Any) -> Any:
    for _ in range(500):
        if pending := await proc.pending_approvals():
            [request] = pending
            return request
        await asyncio.sleep(0.01)
    raise AssertionError("no approval was requested")


# ---------------------------------------------------------------------------------- the words


def test_the_denial_text_marks_the_message_as_the_users_words() -> None:
    assert denial_text(None) == "Tool execution denied by user"
    text = denial_text(STAGING)
    assert text.startswith("Tool execution denied by user")
    assert "from the user" in text and text.endswith(STAGING)


# ---------------------------------------------------------------------------------- kernel


async def test_a_denial_with_a_message_reaches_the_model_in_the_calls_result(tmp_path: Path) -> None:
    model = risky_model()
    async with kernel(tmp_path, model, approval=asking) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        ask = await pending_of(proc)
        await proc.hil(ask.request_id, "deny", message=f"  {STAGING}\r\n")
        await proc.wait_idle()
        signals = [s async for s in proc.signals(follow=False)]
    [result] = tool_results(model.requests[-1])
    assert result.is_error and result.text == denial_text(STAGING)
    finished = [s.payload for s in signals if s.signal == sig.TOOL_FINISHED]
    assert finished[-1]["ok"] is False and finished[-1]["withMessage"] is True
    assert STAGING not in json.dumps(finished)  # the signal says a message was given, not what it said


async def test_a_denial_without_a_message_is_as_before_and_remember_still_works(tmp_path: Path) -> None:
    model = risky_model()
    async with kernel(tmp_path, model, approval=asking) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        ask = await pending_of(proc)
        await proc.hil(ask.request_id, "deny", remember=True, message="   ")  # blank: no message
        await proc.wait_idle()
        await proc.send("again")  # a denial is never remembered: asked again
        ask = await pending_of(proc)
        await proc.hil(ask.request_id, "deny", remember=True, message="not now")
        await proc.wait_idle()
        signals = [s async for s in proc.signals(follow=False)]
    assert [r.text for r in tool_results(model.requests[-1])] == [denial_text(None), denial_text("not now")]
    finished = [s.payload for s in signals if s.signal == sig.TOOL_FINISHED]
    assert [p.get("withMessage", False) for p in finished] == [False, True]


async def test_a_pending_approval_survives_a_restart_and_is_denied_with_a_message_after_it(tmp_path: Path) -> None:
    async with kernel(tmp_path, risky_model(), approval=asking) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        ask = await pending_of(proc)
        pid = proc.pid
    model = risky_model()
    async with kernel(tmp_path, model, approval=asking) as k:
        proc = await k.process(pid)
        assert [p.request_id for p in await proc.pending_approvals()] == [ask.request_id]
        await proc.hil(ask.request_id, "deny", message=STAGING)
        await proc.wait_idle()
    [result] = tool_results(model.requests[-1])
    assert result.is_error and result.text == denial_text(STAGING)
    async with kernel(tmp_path, risky_model(), approval=asking) as k:  # and it stays as it was stored
        messages = await (await k.process(pid)).messages()
    assert [m.text for m in messages if isinstance(m, ToolResultMessage)] == [denial_text(STAGING)]


@pytest.mark.parametrize(
    ("decision", "message", "error", "words"),
    [
        ("approve", "looks fine", ValueError, "only with deny"),
        ("deny", "x" * (MAX_DENIAL_MESSAGE + 1), ValueError, f"at most {MAX_DENIAL_MESSAGE}"),
        ("deny", "use \x1b[31mred\x1b[0m", ValueError, "control character"),
        ("deny", "nul \x00", ValueError, "control character"),
        ("deny", 42, TypeError, "must be a string"),
    ],
)
async def test_bad_input_is_refused_and_the_approval_stays_answerable(
    tmp_path: Path, decision: str, message: Any, error: type[Exception], words: str
) -> None:
    model = risky_model()
    async with kernel(tmp_path, model, approval=asking) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        ask = await pending_of(proc)
        with pytest.raises(error, match=words):
            await proc.hil(ask.request_id, decision, message=message)
        assert [p.request_id for p in await proc.pending_approvals()] == [ask.request_id]
        await proc.hil(ask.request_id, "deny", message="tabs\tand\nnew lines are fine")
        await proc.wait_idle()
    [result] = tool_results(model.requests[-1])
    assert result.text == denial_text("tabs\tand\nnew lines are fine")


async def test_a_nested_calls_denial_gives_its_program_the_message(tmp_path: Path) -> None:
    import textwrap

    from agentloop.process.approval import Rule, default_policy
    from agentloop.tools.builtin import builtin_tools

    ws = tmp_path
    (ws / "g.txt").write_text("x")
    code = textwrap.dedent(
        """
        try:
            await delete("g.txt")
        except ToolDenied as exc:
            print(exc)
        """
    ).strip()
    trust = Policy(default="auto", rules=(Rule(match="codemode.exec", action="auto"), *default_policy().rules))
    model = ScriptedModel([Reply(tool_calls=[call("CodeMode", code=code)]), "done"])
    tools = builtin_tools(ws, codemode=True)
    async with kernel(tmp_path, model, tools=tools, policy=trust.to_json()) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        ask = await pending_of(proc)
        await proc.hil(ask.request_id, "deny", message="keep g.txt")
        await proc.wait_idle()
        [result] = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)]
        assert await k.store.kv_get(proc.pid, f"denied:{ask.run_id}") is None  # cleared with the run
    assert result.text == f"Delete denied: {denial_text('keep g.txt')}"
    assert (ws / "g.txt").exists()


# ---------------------------------------------------------------------------------- HTTP and client


server = server_support.module_server("hil")


async def http_pending(client: httpx.AsyncClient, pid: str) -> dict[str, Any]:
    [request] = await pending_requests(client, pid)
    return request


async def test_http_accepts_a_message_with_deny_and_refuses_bad_ones(server: LiveServer) -> None:
    async with server.client(server.tokens.alice) as alice:
        pid = (await alice.post("/v1/processes", json={})).json()["pid"]
        await alice.post(f"/v1/processes/{pid}/messages", json={"text": "risky"})
        ask = await http_pending(alice, pid)
        url = f"/v1/processes/{pid}/hil/{ask['request_id']}"
        for bad in (
            {"decision": "approve", "message": "fine"},
            {"decision": "deny", "message": "x" * (MAX_DENIAL_MESSAGE + 1)},
            {"decision": "deny", "message": "bell \x07"},
            {"decision": "deny", "message": 5},
        ):
            resp = await alice.post(url, json=bad)
            assert resp.status_code == 400 and resp.json()["code"] == "invalid_request", (bad, resp.text)
            assert "message" in resp.json()["message"], resp.text
        assert [r["request_id"] for r in (await alice.get(f"/v1/processes/{pid}/hil")).json()["requests"]] == [
            ask["request_id"]
        ]
        resp = await alice.post(url, json={"decision": "deny", "message": STAGING})
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"request_id": ask["request_id"], "decision": "deny", "remember": False}
        await wait_idle(alice, pid)
        last = (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"][-1]["message"]
        assert last["content"][0]["text"] == f"done: {denial_text(STAGING)}"
        doc = (await alice.get("/v1/openapi.json")).json()
    body = doc["components"]["schemas"]["HilBody"]["properties"]["message"]
    assert "deny" in json.dumps(body) and str(MAX_DENIAL_MESSAGE) in json.dumps(body)


async def test_the_client_passes_the_message(server: LiveServer) -> None:
    async with AgentloopClient(server.url, server.tokens.alice) as client:
        pid = (await client.spawn())["pid"]
        await client.send(pid, "risky")
        for _ in range(500):
            if approvals := await client.approvals(pid):
                break
            await asyncio.sleep(0.01)
        [pending] = approvals
        with pytest.raises(ClientError) as caught:
            await client.hil(pid, pending["request_id"], "approve", message="fine")
        assert caught.value.status == 400
        await client.hil(pid, pending["request_id"], "deny", message=STAGING)
        for _ in range(500):
            page = await client.history(pid)
            if page["messages"][-1]["message"]["role"] == "assistant":
                break
            await asyncio.sleep(0.01)
    assert page["messages"][-1]["message"]["content"][0]["text"] == f"done: {denial_text(STAGING)}"


def test_remote_chat_denies_with_a_reason(server: LiveServer) -> None:
    out, _ = remote_chat(server, f"risky\nn {STAGING}\n/exit\n")
    assert out == f"done: {denial_text(STAGING)}\n"


# ---------------------------------------------------------------------------------- WebSocket


def test_the_socket_accepts_a_message_with_deny_and_refuses_bad_ones(tmp_path: Path) -> None:
    with KernelServer(tmp_path, risky_model(), tools=[echo], approval=asking) as server, server.client("alice") as c:
        pid = c.ok("proc.spawn")["pid"]
        c.ok("proc.subscribe", {"pid": pid})
        c.ok("proc.send", {"pid": pid, "text": "go"})
        request_id = c.signals_until(pid, sig.HIL_REQUESTED)[-1]["payload"]["requestId"]
        args = {"pid": pid, "request_id": request_id}
        for bad in (
            {"decision": "approve", "message": "fine"},
            {"decision": "deny", "message": "x" * (MAX_DENIAL_MESSAGE + 1)},
            {"decision": "deny", "message": ["no"]},
        ):
            res = c.call("proc.hil", {**args, **bad})
            assert not res["ok"] and res["error"]["code"] == "invalid_request", (bad, res)
            assert "message" in res["error"]["message"]
        assert [r["request_id"] for r in c.ok("proc.approvals", {"pid": pid})["requests"]] == [request_id]
        answer = c.ok("proc.hil", {**args, "decision": "deny", "message": STAGING})
        assert answer == {"request_id": request_id, "decision": "deny", "remember": False}
        finished = c.signals_until(pid, sig.RUN_FINISHED)[-1]["payload"]
    assert finished["status"] == "ok" and finished["text"] == f"done: {denial_text(STAGING)}"


# ---------------------------------------------------------------------------------- the chat prompt


@pytest.mark.parametrize(
    ("line", "answer"),
    [
        ("y", "approve"),
        ("n", "deny"),
        ("  No  ", "deny"),
        ("a", "always"),
        (f"n {STAGING}", Denial(STAGING)),
        ("no, use staging", Denial("use staging")),
        ("no:\tuse staging ", Denial("use staging")),
        ("nope", None),
        ("y please", None),
    ],
)
def test_the_prompt_reads_a_reason_after_n(line: str, answer: Any) -> None:
    assert parse_answer(line) == answer


async def test_a_reason_that_cannot_be_sent_is_asked_again_on_a_terminal() -> None:
    lines = iter(["n " + "x" * (MAX_DENIAL_MESSAGE + 1), "n shorter please"])

    async def read(prompt: str) -> str:
        return next(lines)

    err = Console(file=io.StringIO(), width=200)
    answer = await ask_user(Question("Shell", {"command": "ls"}, (), "why"), read, err, shows_prompt=True)
    assert answer == Denial("shorter please")
    assert f"at most {MAX_DENIAL_MESSAGE}" in err.file.getvalue()  # type: ignore[attr-defined]


def test_durable_chat_denies_with_a_reason(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from agentloop.cli.main import app
    from agentloop.models.registry import register_provider

    ws = tmp_path / "ws"
    (ws / "build").mkdir(parents=True)
    scripted = ScriptedModel([Reply(tool_calls=[call("Shell", command="rm -rf build")]), "I used staging"])
    register_provider("hilreason", lambda _id: scripted)
    env = {"AGENTLOOP_CONFIG": str(tmp_path / "none.toml"), "XDG_DATA_HOME": str(tmp_path / "xdg")}
    result = CliRunner().invoke(
        app,
        ["chat", "-m", "hilreason:x", "-w", str(ws), "--data", str(tmp_path / "data")],
        input=f"clean up\nn {STAGING}\n",
        env=env,
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "I used staging\n" and (ws / "build").exists()
    [denied] = tool_results(scripted.requests[1])
    assert denied.is_error and denied.text == denial_text(STAGING)


async def test_the_in_memory_hook_gives_the_model_the_reason(tmp_path: Path) -> None:
    async def ask(question: Question) -> Any:
        return Denial(STAGING)

    hook = PolicyHook(Policy(default="ask"), cwd=tmp_path, ask=ask)
    shell = ToolCall(id="c1", name="Shell", arguments={"command": "ls"})
    info = ToolCallInfo(shell, {"command": "ls"}, AssistantMessage(content=[shell]), [], "run-1", "shell.exec")
    assert await hook(info) == Block(denial_text(STAGING))


# ---------------------------------------------------------------------------------- web UI

# the browser test's fixture: an ``agentloop serve`` with a scripted model (Chromium: conftest)
served = web_ui.served
DELETE = {"tool_calls": [{"name": "Delete", "arguments": {"path": "junk.txt"}}]}


@pytest.mark.parametrize("replies", [[DELETE, "Kept junk.txt."]])
def test_the_web_ui_denies_with_the_reason_typed_next_to_the_buttons(
    served: tuple[str, str, Path], browser: Browser
) -> None:
    url, token, workspace = served
    pid = sign_in_and_open_a_process(browser, url, token)
    send(browser, "clean up")
    browser.wait("document.querySelector('#approvals .hil-reason')")
    too_long = json.dumps("x" * (MAX_DENIAL_MESSAGE + 1))
    # maxlength keeps typing short; a value set past it is refused by the server, and the card stays
    browser.eval(f"document.querySelector('#approvals .hil-reason').value = {too_long}")
    browser.click("#approvals .hil-deny")
    browser.wait("document.getElementById('status').textContent.startsWith('could not answer')")
    assert browser.eval("document.querySelector('#approvals .hil-deny').disabled") is False
    browser.eval(f"document.querySelector('#approvals .hil-reason').value = {json.dumps(STAGING)}")
    browser.click("#approvals .hil-deny")
    browser.wait("document.querySelector('#transcript .footer[data-status=ok]')")
    assert browser.eval("document.querySelectorAll('#approvals .approval').length") == 0
    auth = {"Authorization": f"Bearer {token}"}
    page = httpx.get(f"{url}/v1/processes/{pid}/messages", headers=auth, timeout=5).json()
    [result] = [m["message"] for m in page["messages"] if m["message"]["role"] == "toolResult"]
    assert result["isError"] is True and result["content"][0]["text"] == denial_text(STAGING)
    assert (workspace / "junk.txt").exists()
    assert not [line for line in browser.console if "Content Security Policy" in line], browser.console
