"""Richer approvals: approve with edited arguments (checked against the tool's schema and the
policy, bound to the edit, durable across a restart, told to the model in the call's result),
and "remember" scopes (the run, the process, the account's policy file), through the kernel,
HTTP, the WebSocket, the Python client and the chat prompt."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from agentloop import Reply, ScriptedModel, ToolResultMessage, call
from agentloop.cli.approvals import Edited, Question, ask_user, parse_answer
from agentloop.client import AgentloopClient, ClientError
from agentloop.kernel import Approval
from agentloop.messages import AssistantMessage, UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.approval import Policy, Rule, account_rule, decide, default_policy, find_rule, parse_policy
from agentloop.process.approval.checker import load_policy
from tests import process_support, server_support
from tests.process_support import assert_valid, echo, kernel
from tests.server_support import LiveServer, pending_requests, wait_idle
from tests.ws_support import KernelServer

NOTE = "[The user edited this call's arguments before approving it. It ran with: "
# every echo asks, and an echo of "forbidden" is refused (the deny rule is written first: it wins)
ASK_ECHO = {
    "default": "auto",
    "rules": [
        {"match": "tool.echo", "when": {"argEquals": {"text": "forbidden"}}, "action": "deny"},
        {"match": "tool.echo", "action": "ask"},
    ],
}


def echo_model(calls_per_run: int = 1) -> ScriptedModel:
    """Each run calls echo("risky") ``calls_per_run`` times, one after another, then answers with
    the last result."""

    def script(req: ModelRequest) -> Reply | str:
        last_user = max(i for i, m in enumerate(req.messages) if isinstance(m, UserMessage))
        done = [m for m in req.messages[last_user:] if isinstance(m, ToolResultMessage)]
        if len(done) < calls_per_run:
            return Reply(tool_calls=[call("echo", text="risky")])
        return f"done: {done[-1].text}"

    return ScriptedModel(script)


async def pending_of(proc: Any) -> Any:
    for _ in range(500):
        if pending := await proc.pending_approvals():
            [request] = pending
            return request
        await asyncio.sleep(0.01)
    raise AssertionError("no approval was requested")


async def asked_or_finished(proc: Any) -> Any:
    """The next approval request, or None once the process is idle without one."""
    for _ in range(500):
        if pending := await proc.pending_approvals():
            return pending[0]
        info = await proc.info()
        if info.current_run is None:
            return None
        await asyncio.sleep(0.01)
    raise AssertionError("neither asked nor finished")


@pytest.fixture(autouse=True)
def _fresh_ran() -> None:
    process_support.ran.clear()


# ---------------------------------------------------------------------------------- edited arguments


async def test_approve_with_edited_arguments_runs_them_and_the_result_says_so(tmp_path: Path) -> None:
    model = echo_model()
    async with kernel(tmp_path, model, tools=[echo], policy=ASK_ECHO) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        ask = await pending_of(proc)
        assert ask.args == {"text": "risky"}
        await proc.hil(ask.request_id, "approve", arguments={"text": "safe"})
        await proc.wait_idle()
        messages = await proc.messages()
        signals = [s async for s in proc.signals(follow=False)]
        assert await k.store.kv_get(proc.pid, f"edited:{ask.run_id}") is None  # (forgotten with its run)
    assert process_support.ran == ["safe"]  # the edit ran, the model's arguments never did
    assert_valid(messages)
    [assistant] = [m for m in messages if isinstance(m, AssistantMessage) and m.tool_calls]
    assert assistant.tool_calls[0].arguments == {"text": "risky"}  # the model's call, as it made it
    [result] = [m for m in messages if isinstance(m, ToolResultMessage)]
    assert not result.is_error and result.text == NOTE + '{"text": "safe"}]\nsafe'
    started = [s.payload for s in signals if s.signal == sig.TOOL_STARTED]
    assert [p["args"] for p in started] == [{"text": "safe"}]
    assert any(s.signal == sig.CHANGED and s.payload.get("edited") for s in signals)


async def test_the_same_arguments_are_a_plain_approval(tmp_path: Path) -> None:
    async with kernel(tmp_path, echo_model(), tools=[echo], policy=ASK_ECHO) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        ask = await pending_of(proc)
        await proc.hil(ask.request_id, "approve", arguments={"text": "risky"})
        await proc.wait_idle()
        [result] = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert result.text == "risky"


@pytest.mark.parametrize(
    ("decision", "arguments", "error", "words"),
    [
        ("approve", {"text": 5}, ValueError, "not valid for echo"),
        ("approve", {"txt": "hello"}, ValueError, "not valid for echo"),
        ("approve", {"text": "forbidden"}, ValueError, "policy denies the call with the edited arguments"),
        ("approve", ["text"], TypeError, "object of named arguments"),
        ("approve", {"text": float("nan")}, ValueError, "plain JSON"),
        ("deny", {"text": "safe"}, ValueError, "only with approve"),
    ],
)
async def test_a_bad_edit_is_refused_and_the_request_stays_pending(
    tmp_path: Path, decision: str, arguments: Any, error: type[Exception], words: str
) -> None:
    async with kernel(tmp_path, echo_model(), tools=[echo], policy=ASK_ECHO) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        ask = await pending_of(proc)
        with pytest.raises(error, match=words):
            await proc.hil(ask.request_id, decision, arguments=arguments)
        assert [p.request_id for p in await proc.pending_approvals()] == [ask.request_id]
        assert process_support.ran == []
        # an edit the policy still asks about: this approval covers exactly it, nothing is asked again
        await proc.hil(ask.request_id, "approve", arguments={"text": "risky, but less"})
        await proc.wait_idle()
        assert await proc.pending_approvals() == []
    assert process_support.ran == ["risky, but less"]


async def test_a_restart_between_the_decision_and_the_dispatch_runs_the_edit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with kernel(tmp_path, echo_model(), tools=[echo], policy=ASK_ECHO) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        ask = await pending_of(proc)
        pid = proc.pid
        monkeypatch.setattr(k.engine, "wake", lambda pid: None)  # decided, never dispatched here
        await proc.hil(ask.request_id, "approve", arguments={"text": "risky, edited"})
        [row] = await k.store.calls(pid, ask.run_id)
        assert row.status == "registered" and row.args == {"text": "risky"}
        monkeypatch.undo()
    assert process_support.ran == []  # the crash: nothing ran
    model = echo_model()
    async with kernel(tmp_path, model, tools=[echo], policy=ASK_ECHO) as k:
        proc = await k.process(pid)
        await proc.wait_idle()
        assert await proc.pending_approvals() == []  # the edit stays approved, and is not asked again
        messages = await proc.messages()
    assert process_support.ran == ["risky, edited"]
    assert_valid(messages)
    [result] = [m for m in messages if isinstance(m, ToolResultMessage)]
    assert result.text.startswith(NOTE) and result.text.endswith("\nrisky, edited")


# ---------------------------------------------------------------------------------- remember scopes


async def test_remember_for_the_run_ends_with_the_run(tmp_path: Path) -> None:
    async with kernel(tmp_path, echo_model(calls_per_run=2), tools=[echo], policy=ASK_ECHO) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        ask = await pending_of(proc)
        await proc.hil(ask.request_id, "approve", remember="run")
        assert await asked_or_finished(proc) is None  # the run's second echo ran unasked
        assert process_support.ran == ["risky", "risky"]
        assert await k.store.kv_get(proc.pid, "approval_overrides") is None
        await proc.send("again")  # a new run: asked again
        ask = await pending_of(proc)
        await proc.hil(ask.request_id, "approve")
        assert await asked_or_finished(proc) is not None  # (and its second call too)


@pytest.mark.parametrize("remember", [True, "process"])
async def test_remember_for_the_process_outlives_the_run(tmp_path: Path, remember: bool | str) -> None:
    async with kernel(tmp_path, echo_model(), tools=[echo], policy=ASK_ECHO) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        ask = await pending_of(proc)
        await proc.hil(ask.request_id, "approve", remember=remember)
        await proc.wait_idle()
        await proc.send("again")
        assert await asked_or_finished(proc) is None
        other = await k.spawn(owner="alice")  # another process of the account is still asked
        await other.send("go")
        assert await pending_of(other) is not None
    assert process_support.ran == ["risky", "risky"]


@pytest.mark.parametrize(
    ("decision", "remember", "error", "words"),
    [
        ("approve", "forever", TypeError, "'run', 'process' or 'account'"),
        ("approve", "false", TypeError, "remember must be true or false"),
        ("approve", 1, TypeError, "remember must be"),
        ("deny", "run", ValueError, "remember goes only with approve"),
    ],
)
async def test_a_bad_scope_answers_nothing(
    tmp_path: Path, decision: str, remember: Any, error: type[Exception], words: str
) -> None:
    async with kernel(tmp_path, echo_model(), tools=[echo], policy=ASK_ECHO) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        ask = await pending_of(proc)
        with pytest.raises(error, match=words):
            await proc.hil(ask.request_id, decision, remember=remember)
        assert [p.request_id for p in await proc.pending_approvals()] == [ask.request_id]


async def test_remember_for_the_account_amends_its_policy_file(tmp_path: Path) -> None:
    for account in ("alice", "bob"):
        (tmp_path / "home" / account).mkdir(parents=True)
        (tmp_path / "home" / account / "approval.json").write_text(json.dumps(ASK_ECHO))
    async with kernel(tmp_path, echo_model(), tools=[echo]) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        ask = await pending_of(proc)
        await proc.hil(ask.request_id, "approve", remember="account")
        await proc.wait_idle()
        written = json.loads((tmp_path / "home" / "alice" / "approval.json").read_text())
        later = await k.spawn(owner="alice")  # a later process of the account: not asked
        await later.send("go")
        assert await asked_or_finished(later) is None
        bob = await k.spawn(owner="bob")  # another account: asked as before
        await bob.send("go")
        assert await pending_of(bob) is not None
    assert written["rules"] == ASK_ECHO["rules"]  # what the person wrote is kept as written
    [rule] = written["remembered"]
    assert rule["match"] == "tool.echo" and rule["action"] == "auto" and rule["target"] == "local"
    assert process_support.ran == ["risky", "risky"]


async def test_an_account_without_a_file_gets_the_rule_alone_on_the_server_policy(tmp_path: Path) -> None:
    async with kernel(tmp_path, echo_model(), tools=[echo], policy=ASK_ECHO) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        ask = await pending_of(proc)
        await proc.hil(ask.request_id, "approve", remember="account")
        await proc.wait_idle()
        later = await k.spawn(owner="alice")
        await later.send("go")
        assert await asked_or_finished(later) is None
        bob = await k.spawn(owner="bob")  # no file of his own: the server-wide policy, which asks
        await bob.send("go")
        assert await pending_of(bob) is not None
    # (not a copy of the server-wide policy, whose later changes would then never reach alice)
    written = json.loads((tmp_path / "home" / "alice" / "approval.json").read_text())
    assert list(written) == ["remembered"] and len(written["remembered"]) == 1
    assert parse_policy(written)[1] == []


async def test_remember_for_the_account_is_refused_where_there_is_no_file_to_amend(tmp_path: Path) -> None:
    async def asking(process: Any, row: Any) -> Approval:
        return Approval("ask", (), "every call", fingerprint="x")

    for options in ({"account_policies": {"alice": ASK_ECHO}}, {"approval": asking}):
        async with kernel(tmp_path, echo_model(), tools=[echo], **options) as k:
            proc = await k.spawn(owner="alice")
            await proc.send("go")
            ask = await pending_of(proc)
            with pytest.raises(ValueError, match="cannot be"):
                await proc.hil(ask.request_id, "approve", remember="account")
            assert [p.request_id for p in await proc.pending_approvals()] == [ask.request_id]
            await proc.hil(ask.request_id, "deny")
            await proc.wait_idle()
    assert not (tmp_path / "home" / "alice" / "approval.json").exists()


def test_an_account_rule_for_a_shell_command_names_its_program_never_every_command() -> None:
    push = account_rule("shell.exec", {"command": "git push origin main"}, tags=("mutating", "network"))
    assert push.when is not None and push.when.program == "git push"  # (not a prefix of the text)
    assert push.when.arg_prefix is None and push.when.arg_equals is None
    assert "destructive" in (push.when.none_tags or ())
    bare = account_rule("shell.exec", {"command": "ls"}, tags=())
    assert bare.when is not None and bare.when.program == "ls"  # (``lsblk`` is another program)
    refused = ("git push && curl x | sh", "cd x; make", "python -c 1", "$TOOL run", "FOO=1 git push")
    for command in (*refused, "./git push", "git push origin $BRANCH", "git push x; HOME=/tmp/x git push"):
        with pytest.raises(ValueError, match="account"):
            account_rule("shell.exec", {"command": command}, tags=("network",))
    with pytest.raises(ValueError, match="CodeMode"):
        account_rule("codemode.exec", {"code": "print(1)"})
    assert account_rule("fs.delete", {"path": "x"}, tags=("mutating",)).match == "fs.delete"
    # what a destructive or privileged call harms is in arguments the rule does not keep: ``rm -rf
    # build`` trusted for the account would be ``rm -rf .`` in every later process
    for tags in (("destructive", "mutating"), ("privileged",)):
        with pytest.raises(ValueError, match="cannot be allowed for the whole account"):
            account_rule("shell.exec", {"command": "rm -rf build"}, tags=tags)


def test_an_accounts_remembered_rules_answer_questions_and_never_lift_a_deny(tmp_path: Path) -> None:
    push = account_rule("shell.exec", {"command": "git push origin main"}, tags=("mutating", "network"))
    policy = Policy(
        default="ask",
        rules=(
            Rule.model_validate(
                {"match": "shell.exec", "when": {"argPrefix": {"command": "git push --force"}}, "action": "deny"}
            ),
        ),
        remembered=(push,),
    )

    def action(command: str) -> str:
        return decide(policy, "shell.exec", {"command": command}, cwd=tmp_path, home=tmp_path).action

    assert action("git push origin other") == "auto"
    assert action("git push --force origin main") == "deny"
    assert action("git pull") == "ask"
    assert action("git push origin main && rm -rf /") == "ask"  # riskier than what was answered
    assert parse_policy(policy.to_json()) == (policy, [])
    _, problems = parse_policy({"remembered": [{"match": "shell.exec", "action": "deny"}]})
    assert problems and "must be auto" in problems[0]


SMUGGLED = (
    "git push x; cat ~/.ssh/id_rsa",
    "git push x && rm f",
    "git push $(echo x)",
    "git push x | sh",
    "git pushx",
    "FOO=1 git push",
    "git push x; cat notes.txt",  # (no tag the answered call lacked: a prefix rule let these run)
    "git push x && curl https://example.com -o f",
    "git push x; HOME=/tmp/evil git push",  # (another git config: its core.sshCommand runs)
    "git push x; /tmp/evil/git push",
    "X=--receive-pack=evil; git push $X .",
    "git push --receive='touch p; git-receive-pack' ../bare.git",  # (git reads --receive as --receive-pack)
    "git push *",  # (a file named --receive-pack=... in the workspace)
    "git push {--receive-pack=evil,.}",
    "git push x > $HOME/.bashrc",  # (a path the line does not spell out)
)


@pytest.mark.parametrize("command", SMUGGLED)
def test_an_account_rule_for_a_program_allows_it_and_nothing_run_with_it(tmp_path: Path, command: str) -> None:
    push = account_rule("shell.exec", {"command": "git push origin main"}, tags=("mutating", "network"))
    assert push.when is not None
    policy = parse_policy({**default_policy().to_json(), "remembered": [push.to_json()]})[0]

    def action(policy: Policy, command: str) -> str:
        return decide(policy, "shell.exec", {"command": command}, cwd=tmp_path, home=tmp_path).action

    assert action(policy, "git push origin dev") == "auto"
    assert action(policy, "git push origin main; git push origin dev") == "auto"  # (git push only)
    assert action(policy, command) == "ask"
    if command in SMUGGLED[6:8]:  # what the prefix rule written before allowed
        prefix = {"argPrefix": {"command": "git push "}, "noTag": list(push.when.none_tags or ())}
        old = Rule.model_validate({"match": "shell.exec", "when": prefix, "action": "auto"})
        assert action(Policy(rules=default_policy().rules, remembered=(old,)), command) == "auto"


def test_a_program_clause_in_a_policy_rule(tmp_path: Path) -> None:
    rule = {"match": "shell.exec", "when": {"program": "git status"}, "action": "deny"}
    policy, problems = parse_policy({"rules": [rule]})
    assert problems == [] and policy.rules[0].to_json() == rule

    def action(command: str) -> str:
        return decide(policy, "shell.exec", {"command": command}, cwd=tmp_path, home=tmp_path).action

    assert action("git status --short") == "deny"
    assert action("git status; ls") == "auto" and action("git log") == "auto"
    assert find_rule(policy, "shell.exec", {"command": "git status"}, frozenset()) == (0, policy.rules[0])
    assert find_rule(policy, "shell.exec", {"command": "cd x && git status"}, frozenset()) is None


@pytest.mark.parametrize(
    ("rule", "words"),
    [
        ({"match": "fs.write", "when": {"program": "git push"}}, "only to rules matching 'shell.exec', not 'fs.write'"),
        ({"match": "shell.*", "when": {"program": "git push"}}, "only to rules matching 'shell.exec'"),
        ({"match": "*", "when": {"program": "git push"}}, "only to rules matching 'shell.exec'"),
        ({"match": "shell.exec", "when": {"program": ""}}, "must name a program"),
        ({"match": "shell.exec", "when": {"program": "git  push"}}, "must name a program"),
        ({"match": "shell.exec", "when": {"program": ["git push"]}}, "program"),
    ],
)
def test_a_bad_program_clause_is_refused_at_load(
    rule: dict[str, Any], words: str, caplog: pytest.LogCaptureFixture
) -> None:
    for section in ("rules", "remembered"):
        data = {"default": "deny", section: [{**rule, "action": "auto"}]}
        policy, problems = parse_policy(json.dumps(data))
        assert policy == default_policy() and len(problems) == 1 and words in problems[0], problems
        with caplog.at_level("WARNING", logger="agentloop.approval"):
            assert load_policy(data, "of account 'alice'") == default_policy()
        assert words in caplog.text and "using the default policy" in caplog.text
        caplog.clear()


# ---------------------------------------------------------------------------------- HTTP and client


server = server_support.module_server("hil_edit")


async def test_http_takes_edited_arguments_and_scopes(server: LiveServer) -> None:
    async with server.client(server.tokens.alice) as alice:
        pid = (await alice.post("/v1/processes", json={})).json()["pid"]
        await alice.post(f"/v1/processes/{pid}/messages", json={"text": "risky"})
        [ask] = await pending_requests(alice, pid)
        url = f"/v1/processes/{pid}/hil/{ask['request_id']}"
        for bad, words in (
            ({"decision": "approve", "remember": "forever"}, "remember"),
            ({"decision": "approve", "arguments": ["safe"]}, "arguments"),
            ({"decision": "approve", "arguments": {"text": 5}}, "not valid for echo"),
            ({"decision": "approve", "remember": "account"}, "account"),  # (a policy function: no files)
        ):
            resp = await alice.post(url, json=bad)
            assert resp.status_code == 400 and resp.json()["code"] == "invalid_request", (bad, resp.text)
            assert words in resp.text, resp.text
        resp = await alice.post(url, json={"decision": "approve", "arguments": {"text": "safe"}, "remember": "run"})
        assert resp.status_code == 200, resp.text
        assert resp.json() == {
            "request_id": ask["request_id"],
            "decision": "approve",
            "remember": "run",
            "edited": True,
        }
        await wait_idle(alice, pid)
        last = (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"][-1]["message"]
        assert last["content"][0]["text"] == "done: " + NOTE + '{"text": "safe"}]\nsafe'
        doc = (await alice.get("/v1/openapi.json")).json()
    props = doc["components"]["schemas"]["HilBody"]["properties"]
    assert "arguments" in props and "account" in json.dumps(props["remember"])


async def test_the_client_passes_arguments_and_a_scope(server: LiveServer) -> None:
    async with AgentloopClient(server.url, server.tokens.alice) as client:
        pid = (await client.spawn())["pid"]
        await client.send(pid, "risky")
        for _ in range(500):
            if approvals := await client.approvals(pid):
                break
            await asyncio.sleep(0.01)
        [pending] = approvals
        with pytest.raises(ClientError) as caught:
            await client.hil(pid, pending["request_id"], "deny", arguments={"text": "safe"})
        assert caught.value.status == 400
        answer = await client.hil(pid, pending["request_id"], "approve", arguments={"text": "calm"}, remember="process")
        assert answer["edited"] is True and answer["remember"] == "process"
        for _ in range(500):
            page = await client.history(pid)
            if page["messages"][-1]["message"]["role"] == "assistant":
                break
            await asyncio.sleep(0.01)
    assert page["messages"][-1]["message"]["content"][0]["text"].endswith('{"text": "calm"}]\ncalm')


def test_the_socket_takes_edited_arguments_and_scopes(tmp_path: Path) -> None:
    async def asking(process: Any, row: Any) -> Approval:
        if row.args.get("text") == "risky":
            return Approval("ask", ("destructive",), "risky", fingerprint=json.dumps(row.args))
        return Approval("auto")

    with KernelServer(tmp_path, echo_model(), tools=[echo], approval=asking) as srv, srv.client("alice") as c:
        pid = c.ok("proc.spawn")["pid"]
        c.ok("proc.subscribe", {"pid": pid})
        c.ok("proc.send", {"pid": pid, "text": "go"})
        request_id = c.signals_until(pid, sig.HIL_REQUESTED)[-1]["payload"]["requestId"]
        args = {"pid": pid, "request_id": request_id, "decision": "approve"}
        for bad in ({"arguments": "safe"}, {"remember": 3}, {"remember": "always"}):
            res = c.call("proc.hil", {**args, **bad})
            assert not res["ok"] and res["error"]["code"] == "invalid_request", (bad, res)
        answer = c.ok("proc.hil", {**args, "arguments": {"text": "safe"}, "remember": "run"})
        assert answer == {"request_id": request_id, "decision": "approve", "remember": "run", "edited": True}
        finished = c.signals_until(pid, sig.RUN_FINISHED)[-1]["payload"]
    assert finished["status"] == "ok" and finished["text"] == "done: " + NOTE + '{"text": "safe"}]\nsafe'


# ---------------------------------------------------------------------------------- the chat prompt


def lines_of(*answers: str) -> Any:
    given = iter(answers)

    async def read(prompt: str) -> str:
        return next(given)

    return read


async def test_the_prompt_edits_the_arguments_in_place_on_a_terminal() -> None:
    seen: list[str] = []

    async def prefilled(prompt: str, text: str) -> str:
        seen.append(text)
        return text.replace("ls", "ls -l")

    err = Console(file=io.StringIO(), width=200)
    question = Question("Shell", {"command": "ls"}, ("network",), "why", "r1", editable=True)
    answer = await ask_user(question, lines_of("e"), err, shows_prompt=True, prefilled=prefilled)
    assert answer == Edited({"command": "ls -l"}) and seen == ['{"command": "ls"}']


async def test_the_prompt_reads_edited_arguments_from_a_pipe_and_asks_again_after_bad_json() -> None:
    err = Console(file=io.StringIO(), width=200)
    question = Question("Shell", {"command": "ls"}, (), "why", "r1", editable=True)
    read = lines_of("e", "[1]", "e", "", "e", '{"command": "pwd"}')
    assert await ask_user(question, read, err, shows_prompt=False) == Edited({"command": "pwd"})
    shown = err.file.getvalue()  # type: ignore[attr-defined]
    assert "must be a JSON object" in shown and '{"command": "ls"}' in shown and "[e]dit" in shown


async def test_edit_and_account_are_only_offered_for_the_kernels_questions() -> None:
    assert parse_answer("account") == "account"
    err = Console(file=io.StringIO(), width=200)
    plain = Question("Shell", {"command": "ls"}, (), "why")  # the in-memory runner's: neither
    assert await ask_user(plain, lines_of("account", "e", "y"), err, shows_prompt=True) == "approve"
    assert "[e]dit" not in err.file.getvalue()  # type: ignore[attr-defined]
    editable = Question("Shell", {"command": "ls"}, (), "why", "r1", editable=True)
    assert await ask_user(editable, lines_of("account"), err, shows_prompt=True) == "account"


@pytest.fixture
def chat_env(tmp_path: Path) -> dict[str, str]:
    return {"AGENTLOOP_CONFIG": str(tmp_path / "none.toml"), "XDG_DATA_HOME": str(tmp_path / "xdg")}


@pytest.mark.parametrize("answer", ["edit", "account"])
def test_the_durable_chat_approves_with_an_edit_or_for_the_account(
    tmp_path: Path, chat_env: dict[str, str], answer: str
) -> None:
    from typer.testing import CliRunner

    from agentloop.cli.main import app
    from agentloop.models.registry import register_provider

    ws = tmp_path / "ws"
    (ws / "build").mkdir(parents=True)
    (ws / "junk").mkdir()
    scripted = ScriptedModel([Reply(tool_calls=[call("Shell", command="rm -rf build")]), "cleaned"])
    register_provider(f"hiledit{answer}", lambda _id: scripted)
    # (a destructive call is not trusted for the whole account: refused, then asked again)
    typed = 'e\n{"command": "rm -rf junk"}\n' if answer == "edit" else "account\ny\n"
    result = CliRunner().invoke(
        app,
        ["chat", "-m", f"hiledit{answer}:x", "-w", str(ws), "--data", str(tmp_path / "data")],
        input=f"clean up\n{typed}",
        env=chat_env,
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "cleaned\n"
    [ran] = [m for m in scripted.requests[1].messages if isinstance(m, ToolResultMessage)]
    if answer == "edit":
        assert (ws / "build").exists() and not (ws / "junk").exists()
        assert ran.text.startswith(NOTE + '{"command": "rm -rf junk"}]')
    else:
        assert not (ws / "build").exists()
        assert "cannot be allowed for the whole account" in result.stderr
        assert not list((tmp_path / "data" / "home").glob("*/approval.json"))
