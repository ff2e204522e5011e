"""The approvals audit: every decision about a call the policy put to a person (answered, timed
out, or in a process that cannot ask) or refused outright is kept per account, in the
transaction that carries it out, after the process is killed; never with the arguments (a digest
and a short redacted preview). Read through ``Kernel.approval_audit``, ``GET /v1/approvals/audit``
(owner's own account; an admin's ``?account=``), the client and ``agentloop approvals audit``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.client import AgentloopClient
from agentloop.kernel import Approval
from agentloop.messages import ToolResultMessage
from agentloop.models.base import ModelRequest
from agentloop.process.approval import Policy, Rule
from agentloop.process.approval.engine import args_fingerprint
from agentloop.process.hil import args_preview
from agentloop.process.store.base import ApprovalAuditRow
from tests.process_support import kernel
from tests.server_support import LiveServer, live_server

SECRET = "sk-live-0123456789abcdefXYZ"


async def policy(process: Any, row: Any) -> Approval:
    """Asks about ``risky`` echoes, refuses ``forbidden`` ones, lets the rest run."""
    text = str(row.args.get("text", ""))
    if text.startswith("risky"):
        return Approval("ask", ("network", "destructive"), "risky", fingerprint="fp")
    if text == "forbidden":
        return Approval("deny", ("privileged",), "never")
    return Approval("auto")


def calls(*texts: str) -> ScriptedModel:
    """Each run's model: one echo per text, in one batch, then "ok"."""

    def script(req: ModelRequest) -> Reply | str:
        if isinstance(req.messages[-1], ToolResultMessage):
            return "ok"
        return Reply(tool_calls=[call("echo", text=t) for t in texts])

    return ScriptedModel(script)


async def pending(proc: Any) -> list[Any]:
    for _ in range(500):
        rows = await proc.pending_approvals()
        if rows:
            return list(rows)
        await asyncio.sleep(0.01)
    raise AssertionError("no approval was asked")


async def test_answers_are_audited_with_who_and_how_and_outlive_the_process(tmp_path: Path) -> None:
    risky = f"risky api_key={SECRET}"
    async with kernel(tmp_path, calls(risky, "risky two"), approval=policy) as k:
        proc = await k.spawn(owner="alice", text="go")
        [first] = await pending(proc)
        await proc.hil(first.request_id, "approve", remember="run", by="alice")
        [second] = await pending(proc)
        await proc.hil(second.request_id, "deny", by="admin")
        await asyncio.wait_for(proc.wait_idle(), 5)
        await proc.kill()
        rows = await k.approval_audit("alice")
        assert await k.approval_audit("bob") == []
    denied, approved = rows  # newest first
    assert (approved.decision, approved.answered_by, approved.remembered, approved.edited) == (
        "approve",
        "alice",
        "run",
        False,
    )
    assert (denied.decision, denied.answered_by, denied.remembered) == ("deny", "admin", None)
    assert (approved.request_id, approved.pid, approved.owner) == (first.request_id, proc.pid, "alice")
    assert (approved.call_id, approved.tool_name, approved.run_id) == (first.tool_call_id, "echo", first.run_id)
    assert approved.tags == ["destructive", "network"]
    assert approved.args_digest == args_fingerprint(first.syscall, {"text": risky})
    assert SECRET not in approved.args_preview and "api_key=***" in approved.args_preview
    assert approved.decided_at <= denied.decided_at and approved.id < denied.id


async def test_timeouts_policy_refusals_and_a_process_that_cannot_ask(tmp_path: Path) -> None:
    async with kernel(tmp_path, calls("forbidden", "risky"), approval=policy, approval_timeout=0.2) as k:
        proc = await k.spawn(owner="alice", text="go")
        await asyncio.wait_for(proc.wait_idle(), 5)
        background = await k.spawn(owner="alice", interactive=False)
        await background.send("go")
        await asyncio.wait_for(background.wait_idle(), 5)
        mine = await k.approval_audit("alice", pid=proc.pid)
        theirs = await k.approval_audit("alice", pid=background.pid)
        assert [r.decision for r in await k.approval_audit("alice", decision="policy-deny")] == ["policy-deny"] * 2
    assert [(r.decision, r.answered_by, r.request_id is None) for r in mine] == [
        ("timeout", None, False),
        ("policy-deny", None, True),
    ]
    assert mine[1].tags == ["privileged"]
    assert [r.decision for r in theirs] == ["non-interactive", "policy-deny"]


async def test_a_policy_allowed_call_writes_no_audit_row(tmp_path: Path) -> None:
    async with kernel(tmp_path, calls("fine"), approval=policy) as k:
        proc = await k.spawn(owner="alice", text="go")
        await asyncio.wait_for(proc.wait_idle(), 5)
        assert await k.approval_audit("alice") == []


async def test_an_answer_whose_audit_row_cannot_be_written_is_not_applied(tmp_path: Path) -> None:
    async with kernel(tmp_path, calls("risky"), approval=policy) as k:
        proc = await k.spawn(owner="alice", text="go")
        [request] = await pending(proc)
        real = k.store.add_approval_audit

        async def broken(row: ApprovalAuditRow) -> None:
            raise RuntimeError("disk full")

        k.store.add_approval_audit = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="disk full"):
            await proc.hil(request.request_id, "approve", by="alice")
        k.store.add_approval_audit = real  # type: ignore[method-assign]
        assert [r.request_id for r in await proc.pending_approvals()] == [request.request_id]  # still asked
        await proc.hil(request.request_id, "approve", by="alice")
        await asyncio.wait_for(proc.wait_idle(), 5)
        assert [r.decision for r in await k.approval_audit("alice")] == ["approve"]


async def test_a_programs_nested_call_the_policy_refuses_is_audited(tmp_path: Path) -> None:
    from tests.test_codemode import open_kernel, program

    code = program(
        """
        try:
            await delete("f.txt")
        except ToolDenied as exc:
            print(exc)
        """
    )
    only_programs = Policy(default="deny", rules=(Rule(match="codemode.exec", action="auto"),))
    model = ScriptedModel([Reply(tool_calls=[call("CodeMode", code=code)]), "done"])
    async with open_kernel(tmp_path, model, policy=only_programs.to_json()) as k:
        proc = await k.spawn(owner="alice", text="go")
        await asyncio.wait_for(proc.wait_idle(), 5)
        [row] = await k.approval_audit("alice")
    assert (row.decision, row.tool_name, row.request_id) == ("policy-deny", "Delete", None)


async def test_bad_filters_are_refused(tmp_path: Path) -> None:
    async with kernel(tmp_path, calls()) as k:
        for bad, match in (
            ({"limit": 0}, "limit"),
            ({"limit": 501}, "limit"),
            ({"decision": "maybe"}, "decision must be one of"),
            ({"before": "not-an-id"}, "before must be the id"),
            ({"since": -1.0}, "since"),
        ):
            with pytest.raises(ValueError, match=match):
                await k.approval_audit("alice", **bad)


def test_the_preview_is_short_and_masks_credentials() -> None:
    shown = args_preview({"password": "hunter2", "headers": {"Authorization": "Bearer abc.def"}, "n": "word " * 100})
    assert "hunter2" not in shown and "abc.def" not in shown
    assert len(shown) <= 160 and shown.endswith("…")


PASSWORD = "S3cretPass"


@pytest.mark.parametrize(
    ("args", "kept"),
    [
        ({"command": f'export PASSWORD="{PASSWORD}"'}, "export PASSWORD="),  # (JSON's \" hid its shape)
        ({"command": f"psql postgresql://admin:{PASSWORD}@db/prod"}, "postgresql://admin:***@db/prod"),
        ({"command": f"redis-cli -u redis://:{PASSWORD}@cache:6379"}, "redis://:***@cache:6379"),
        ({"command": f"curl -u admin:{PASSWORD} https://api.example.com"}, "curl -u admin:*** https://api"),
        ({"command": f"mysql -u root -p{PASSWORD} prod"}, "mysql -u root -p*** prod"),
        ({"command": f"MYSQL_PWD={PASSWORD} mysqldump prod"}, "MYSQL_PWD=*** mysqldump prod"),
        ({"path": ".env", "content": f"DB_PASS={PASSWORD}"}, '"path": ".env"'),
        ({"env": [["API_KEY", PASSWORD]]}, '[["API_KEY", "***"]]'),
        ({"argv": ["deploy", "--password", PASSWORD, "--verbose"]}, '"--verbose"'),
        ({"command": f"curl --user=admin:'{PASSWORD}' https://api.example.com"}, "--user=admin:"),
    ],
)
def test_the_preview_masks_credentials_in_commands_files_and_pairs(args: dict[str, Any], kept: str) -> None:
    """The reviewer's cases: a credential in a command, a file's content or a [name, value] pair
    is masked in each string, before the JSON encoding (its escapes hid the quoted ones), and what
    is around it stays readable."""
    shown = args_preview(args)
    assert PASSWORD not in shown and kept in shown, shown


def test_the_preview_keeps_what_only_looks_like_a_credential() -> None:
    """``-p`` alone asks mysql for the password; PWD is the working directory; a URL without a
    password and a ``-u`` without one are shown as they are."""
    command = "cd $PWD && mysql -u root -p prod; ssh://git@example.com; PWD=/srv/app ls; curl -u admin x"
    shown = args_preview({"command": command})
    assert json.loads(shown)["command"] == command


# -------------------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("audit")) as srv:
        yield srv


def answered(server: LiveServer, decision: str, token: str) -> str:
    """A process of alice's whose risky call is answered ``decision`` by the account of ``token``."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.tokens.alice}"}) as alice:
        pid: str = alice.post("/v1/processes", json={"text": "risky"}).json()["pid"]
        for _ in range(500):
            requests = alice.get(f"/v1/processes/{pid}/hil").json()["requests"]
            if requests:
                break
            asyncio.run(asyncio.sleep(0.01))
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"}) as who:
            resp = who.post(f"/v1/processes/{pid}/hil/{requests[0]['request_id']}", json={"decision": decision})
            assert resp.status_code == 200, resp.text
    return pid


def test_the_route_shows_an_account_its_own_audit_and_admins_any(server: LiveServer) -> None:
    first = answered(server, "approve", server.tokens.alice)
    second = answered(server, "deny", server.tokens.admin)
    alice = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.tokens.alice}"})
    bob = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.tokens.bob}"})
    admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.tokens.admin}"})
    with alice, bob, admin:
        alice.delete(f"/v1/processes/{first}")  # killed: its decision stays in the audit
        page = alice.get("/v1/approvals/audit").json()
        mine = [(e["pid"], e["decision"], e["by"]) for e in page["entries"]]
        assert mine[:2] == [(second, "deny", "admin"), (first, "approve", "alice")]
        assert page["entries"][0]["account"] == "alice" and "args" not in page["entries"][0]
        assert bob.get("/v1/approvals/audit").json() == {"entries": [], "next_before": None}
        refused = bob.get("/v1/approvals/audit", params={"account": "alice"})
        assert refused.status_code == 403 and refused.json()["code"] == "forbidden"
        by_admin = admin.get("/v1/approvals/audit", params={"account": "alice", "by": "admin"}).json()
        assert [e["pid"] for e in by_admin["entries"]] == [second]
        one = alice.get("/v1/approvals/audit", params={"limit": 1}).json()
        assert one["next_before"] == one["entries"][0]["id"]
        older = alice.get("/v1/approvals/audit", params={"limit": 1, "before": one["next_before"]}).json()
        assert [e["pid"] for e in older["entries"]] == [first]
        for params, word in (
            ({"decision": "maybe"}, "decision"),
            ({"limit": 501}, "limit"),
            ({"before": "zzz"}, "before"),
            ({"since": "yesterday"}, "since"),
        ):
            resp = alice.get("/v1/approvals/audit", params=params)
            assert resp.status_code == 400 and word in resp.text, (params, resp.text)


def test_the_client_and_the_cli_list_the_audit(server: LiveServer) -> None:
    from typer.testing import CliRunner

    from agentloop.cli.main import app

    pid = answered(server, "deny", server.tokens.alice)

    async def read() -> dict[str, Any]:
        async with AgentloopClient(server.url, server.tokens.alice) as client:
            return await client.approval_audit(pid=pid, decision="deny")

    page = asyncio.run(read())
    assert [(e["pid"], e["decision"], e["by"]) for e in page["entries"]] == [(pid, "deny", "alice")]
    options = ["--server", server.url, "--token", server.tokens.alice]
    wide = {"COLUMNS": "300"}  # (a table cut to 80 columns hides what it lists)
    listed = CliRunner().invoke(app, ["approvals", "audit", "--pid", pid, "--since", "1h", *options], env=wide)
    assert listed.exit_code == 0, listed.output
    assert "deny" in listed.output and pid in listed.output and "echo" in listed.output
    as_json = CliRunner().invoke(app, ["approvals", "audit", "--pid", pid, "--json", *options])
    assert [json.loads(line)["pid"] for line in as_json.output.splitlines()] == [pid]
    bad = CliRunner().invoke(app, ["approvals", "audit", "--since", "last tuesday", *options])
    assert bad.exit_code == 2 and "--since" in bad.output


def test_the_cli_next_page_keeps_the_filters(server: LiveServer) -> None:
    """The ``more:`` line is the command for the next page with the same filters: run as it is
    written, it lists the older denial, not the approval in between (what a bare ``--before``
    would list next, as if it were more of the same)."""
    import shlex

    from typer.testing import CliRunner

    from agentloop.cli.main import app

    older = answered(server, "deny", server.tokens.alice)
    answered(server, "approve", server.tokens.alice)
    newest = answered(server, "deny", server.tokens.alice)
    options = ["--server", server.url, "--token", server.tokens.admin]
    filters = ["--account", "alice", "--decision", "deny", "--by", "alice", "--since", "1h", "--limit", "1"]
    first = CliRunner().invoke(app, ["approvals", "audit", *filters, "--json", *options])
    assert first.exit_code == 0, first.output
    assert [json.loads(line)["pid"] for line in first.stdout.splitlines()] == [newest]
    [more] = [line.removeprefix("more: ") for line in first.stderr.splitlines() if line.startswith("more: ")]
    words = shlex.split(more)
    assert words[:3] == ["agentloop", "approvals", "audit"] and server.tokens.admin not in more
    for flag, value in zip(filters[::2], filters[1::2], strict=True):
        assert flag in words and (flag == "--since" or words[words.index(flag) + 1] == value), more
    assert "--json" in words and "--before" in words
    second = CliRunner().invoke(app, [*words[1:], *options])
    assert second.exit_code == 0, second.output
    assert [json.loads(line)["pid"] for line in second.stdout.splitlines()] == [older]


def test_the_next_page_command_quotes_what_it_repeats() -> None:
    from agentloop.cli.approvals import next_page_command

    shown = next_page_command({"--pid": "p 1", "--by": None, "--decision": "deny"}, "00170000")
    assert shown == "agentloop approvals audit --pid 'p 1' --decision deny --before 00170000"
