"""CodeMode (DESIGN §4): a Python program in a subprocess whose tool functions are real tool calls,
each approved like a direct call. Every test runs real subprocesses."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from agentloop import Agent, Guards, Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.cli.approvals import PolicyHook, Question
from agentloop.kernel import Kernel
from agentloop.loop.hooks import Hooks
from agentloop.process.approval import Policy, Rule, default_policy, parse_policy
from agentloop.tools.base import NestedVerdict, ToolContext, ToolResult
from agentloop.tools.builtin import builtin_tools
from agentloop.tools.codemode import CodeMode, describe

ALLOW_CODEMODE = {"default": "auto", "rules": [{"match": "codemode.exec", "action": "auto"}]}
#: the default policy, but programs run unasked (their tool calls are still judged one by one)
TRUST_CODEMODE = Policy(default="auto", rules=(Rule(match="codemode.exec", action="auto"), *default_policy().rules))


def program(text: str) -> str:
    return textwrap.dedent(text).strip() + "\n"


def codemode(ws: Path, **kw: Any) -> CodeMode:
    return CodeMode(builtin_tools(ws), cwd=ws, **kw)


async def run_direct(cm: CodeMode, code: str, **args: Any) -> ToolResult:
    """The tool on its own: no runner, so only its own ``check`` applies."""
    return await cm.run(cm.validate({"code": code, **args}), ToolContext("call-1", cm.name))


def results(messages: list[Any]) -> list[ToolResultMessage]:
    return [m for m in messages if isinstance(m, ToolResultMessage)]


def policy_agent(ws: Path, policy: Policy, code: str, ask: Any = None, **kw: Any) -> Agent:
    """An in-memory agent whose approval is ``PolicyHook`` (what ``agentloop run --memory`` uses)."""
    hooks = Hooks()
    hooks.before_tool_call(PolicyHook(policy, cwd=ws, ask=ask))
    model = ScriptedModel([Reply(tool_calls=[call("CodeMode", code=code)]), "done"])
    return Agent(model=model, tools=builtin_tools(ws, codemode=True), workspace=ws, hooks=hooks, **kw)


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] not in (b"Z", b"X")


# ---------------------------------------------------------------------------------- the program


async def test_a_program_reads_files_in_a_loop_and_prints_a_summary(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"f{i}.txt").write_text("x\n" * (i + 1))
    code = program(
        """
        found = await search("x", glob="*.txt")
        names = sorted({line.split(":")[0] for line in found.splitlines() if ":" in line})
        total = 0
        for name in names:
            text = await read(name)
            total += len(text.splitlines())
        print(f"{len(names)} files, {total} lines")
        """
    )
    result = await run_direct(codemode(tmp_path), code)
    assert not result.is_error, result.content
    assert result.content[0].text == "5 files, 15 lines"  # type: ignore[union-attr]
    assert result.details["tool_calls"] == 6 and result.details["exit_code"] == 0


async def test_the_description_lists_the_functions_with_their_signatures(tmp_path: Path) -> None:
    cm = codemode(tmp_path)
    assert cm.syscall == "codemode.exec" and "CodeMode" not in {t.name for t in builtin_tools(tmp_path)}
    assert "await read(path, offset=1, limit=2000)" in cm.description
    assert 'await shell(command, cwd=".", timeout=None, background=False)' in cm.description
    assert "print()s is the result" in cm.description
    assert "neither confined to the workspace nor approved" in cm.description
    assert describe(builtin_tools(tmp_path)[1]).signature == "await write(path, content)"
    assert [t.name for t in builtin_tools(tmp_path, codemode=True)][-1] == "CodeMode"


async def test_results_and_failures_of_nested_calls_reach_the_program(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha\n")
    code = program(
        """
        print(repr(await read("a.txt")))
        try:
            await read("missing.txt")
        except ToolFailed as exc:
            print("caught:", exc)
        out = await shell("echo hi; exit 3")
        """
    )
    result = await run_direct(codemode(tmp_path), code)
    text = result.content[0].text  # type: ignore[union-attr]
    assert "'     1\\talpha'" in text and "caught: File not found: missing.txt" in text
    # the uncaught failure: a traceback of the program's own frames only, then a note
    assert result.is_error and result.details["exit_code"] == 1
    assert 'File "<program>", line 6' in text and "ToolFailed: hi\n[exit code 3]" in text
    assert "codemode_runner" not in text and "asyncio" not in text
    assert text.endswith("[the program raised an exception]")


async def test_a_programs_calls_get_the_runs_metadata_and_background_work(tmp_path: Path) -> None:
    """A call a program makes is the run's as a direct one is: it sees the caller's metadata, and
    may hand work to the runtime (``Shell(background=True)`` from a program)."""
    seen: dict[str, Any] = {}

    @tool
    async def probe(ctx: ToolContext) -> str:
        """Record what the call was handed."""
        seen.update(metadata=ctx.metadata, background=ctx.background)
        return "ok"

    def background(work: Any, label: str) -> None:
        work.close()

    cm = CodeMode([probe], cwd=tmp_path)
    ctx = ToolContext("call-1", cm.name, metadata={"correlation_id": "c-1"}, background=background)
    result = await cm.run(cm.validate({"code": "print(await probe())"}), ctx)
    assert not result.is_error, result
    assert seen == {"metadata": {"correlation_id": "c-1"}, "background": background}


async def test_nested_calls_can_run_concurrently(tmp_path: Path) -> None:
    code = 'outs = await asyncio.gather(*(shell(f"sleep 1; echo {i}") for i in range(4)))\nprint(len(outs))\n'
    started = time.monotonic()
    result = await run_direct(codemode(tmp_path), code)
    assert result.content[0].text == "4" and time.monotonic() - started < 3.5  # type: ignore[union-attr]


async def test_a_syntax_error_is_a_readable_error_and_nothing_runs(tmp_path: Path) -> None:
    code = 'await write("ran.txt", "x")\nfor x in range(3) print(x)\n'
    result = await run_direct(codemode(tmp_path), code)
    text = result.content[0].text  # type: ignore[union-attr]
    assert result.is_error and "SyntaxError" in text and "line 2" in text
    assert "nothing ran" in text and "Traceback" not in text
    assert not (tmp_path / "ran.txt").exists()


async def test_output_over_the_cap_is_cut_with_a_note(tmp_path: Path) -> None:
    code = 'print("BEGIN")\nfor i in range(2000):\n    print("line", i, "x" * 40)\nprint("END")\n'
    result = await run_direct(codemode(tmp_path, max_output=2000), code)
    text = result.content[0].text  # type: ignore[union-attr]
    assert not result.is_error and result.details["truncated"] is True
    assert text.startswith("BEGIN") and "END" in text and "omitted" in text
    assert "[output cut to 2000 characters" in text and len(text) < 2400


async def test_the_call_limit_stops_a_runaway_loop(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a")
    code = program(
        """
        n = 0
        try:
            while True:
                await read("a.txt")
                n += 1
        except ToolFailed as exc:
            print(n, exc)
        """
    )
    result = await run_direct(codemode(tmp_path, max_calls=3), code)
    assert result.content[0].text.startswith("3 call limit reached")  # type: ignore[union-attr]


async def test_a_timeout_kills_the_program_and_everything_it_started(tmp_path: Path) -> None:
    code = program(
        """
        import subprocess
        child = subprocess.Popen(["sleep", "300"])
        open("child.pid", "w").write(str(child.pid))
        print("started", flush=True)
        await shell("echo $$ > shell.pid; sleep 300")
        """
    )
    started = time.monotonic()
    result = await run_direct(codemode(tmp_path), code, timeout=2)
    assert time.monotonic() - started < 10
    text = result.content[0].text  # type: ignore[union-attr]
    assert result.is_error and result.details["timed_out"] is True
    assert text.startswith("started") and "timed out after 2 s" in text
    pids = [int((tmp_path / name).read_text()) for name in ("child.pid", "shell.pid")]
    for _ in range(100):  # SIGKILL is sent; the kernel takes a moment to tear them down
        if not any(alive(pid) for pid in pids):
            break
        await asyncio.sleep(0.05)
    assert not any(alive(pid) for pid in pids), pids


async def test_an_abort_kills_the_program_too(tmp_path: Path) -> None:
    code = 'import os\nopen("pid", "w").write(str(os.getpid()))\nawait asyncio.sleep(300)\n'
    task = asyncio.create_task(run_direct(codemode(tmp_path), code))
    for _ in range(200):
        if (tmp_path / "pid").exists() and (tmp_path / "pid").read_text():
            break
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not alive(int((tmp_path / "pid").read_text()))


async def test_the_program_runs_isolated_without_our_secrets(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-secret")
    monkeypatch.setenv("PYTHONPATH", "/nowhere")
    code = 'import os, sys\nprint(os.environ.get("ANTHROPIC_API_KEY"), sys.flags.isolated, os.getcwd())\n'
    result = await run_direct(codemode(tmp_path), code)
    assert result.content[0].text == f"None 1 {tmp_path.resolve()}"  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------- the run's budget

#: reads until a call fails, then says how many ran and why the next did not
READ_UNTIL_REFUSED = program(
    """
    n = 0
    try:
        while True:
            await read("a.txt")
            n += 1
    except ToolFailed as exc:
        print(n, exc)
    """
)
#: ten reads at once: how many ran, and why the first refused one did not
READ_TEN_AT_ONCE = program(
    """
    outs = await asyncio.gather(*(read("a.txt") for _ in range(10)), return_exceptions=True)
    print(sum(isinstance(o, str) for o in outs), next(o for o in outs if isinstance(o, Exception)))
    """
)
USED_UP = "Read not run: the run's tool call budget is used up (max_tool_calls=4)"


def budget_model(code: str) -> ScriptedModel:
    """Runs ``code`` for as long as tools are offered; answers once the guard takes them away."""
    return ScriptedModel(lambda r: Reply(tool_calls=[call("CodeMode", code=code)]) if r.tools else "out of budget")


async def test_nested_calls_count_toward_the_runs_tool_call_budget(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a")
    model = budget_model(READ_UNTIL_REFUSED)
    tools = builtin_tools(tmp_path, codemode=True)
    result = await Agent(model=model, tools=tools, workspace=tmp_path, guards=Guards(max_tool_calls=4)).run("go")
    [res] = results(result.messages)
    # the CodeMode call is one of the four: three reads ran, the fourth was refused in the program
    assert res.text.startswith(f"3 {USED_UP}"), res.text
    assert result.stop_reason == "max_tool_calls" and result.text == "out of budget"
    assert [bool(r.tools) for r in model.requests] == [True, False]  # ended through the guard


async def test_a_durable_run_counts_nested_calls_toward_its_budget(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "a.txt").write_text("a")
    model = budget_model(READ_TEN_AT_ONCE)  # in parallel: the count must not lose a call
    async with open_kernel(tmp_path, model, policy=ALLOW_CODEMODE, guards=Guards(max_tool_calls=4)) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        await proc.wait_idle()
        messages = await proc.messages()
        finished = [s async for s in proc.signals(follow=False) if s.signal == "proc.run.finished"]
    [res] = results(messages)
    assert res.text.startswith(f"3 {USED_UP}"), res.text
    assert messages[-1].text == "out of budget" and [bool(r.tools) for r in model.requests] == [True, False]
    assert finished[0].payload["reason"] == "max_tool_calls"


# ---------------------------------------------------------------------------------- approval


async def test_printing_a_request_forges_nothing_and_a_request_written_to_the_channel_is_approved(
    tmp_path: Path,
) -> None:
    (tmp_path / "keep.txt").write_text("x")

    judged: list[tuple[str, Any]] = []

    async def no_deletes(syscall: str, tool: str, args: dict[str, Any]) -> NestedVerdict:
        judged.append((syscall, args.get("path")))
        return NestedVerdict("deny", "no deletes") if syscall == "fs.delete" else NestedVerdict("allow")

    printed = '{"id": 1, "tool": "Write", "args": {"path": "forged.txt", "content": "x"}}'
    written = '{"id": 7, "tool": "Delete", "args": {"path": "keep.txt"}}'
    code = program(
        f"""
        import os, sys
        print({printed!r})
        print({printed!r}, file=sys.stderr)
        os.write(1, {printed!r}.encode() + b"\\n")
        os.write(int(sys.argv[1]), {written!r}.encode() + b"\\n")  # the channel itself
        await asyncio.sleep(0.5)
        await write("made.txt", "y")
        print("done")
        """
    )
    result = await run_direct(codemode(tmp_path, check=no_deletes), code)
    assert not result.is_error, result.content
    # output is output: the printed "request" (for an allowed tool) did not run
    assert not (tmp_path / "forged.txt").exists() and (tmp_path / "made.txt").read_text() == "y"
    # a request written into the channel is only a request: judged like any other, and refused
    assert (tmp_path / "keep.txt").exists()
    assert judged == [("fs.delete", "keep.txt"), ("fs.write", "made.txt")]


async def test_a_nested_shell_command_the_policy_denies_does_not_run(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data").write_text("precious")
    policy, problems = parse_policy(
        {
            "default": "auto",
            "rules": [{"match": "shell.exec", "when": {"anyTag": ["destructive"]}, "action": "deny"}],
        }
    )
    assert not problems
    code = program(
        """
        print(await shell("echo safe"))
        try:
            await shell("rm -rf victim")
        except ToolDenied as exc:
            print("refused:", exc)
        await shell("rm -rf victim")
        """
    )
    result = await policy_agent(tmp_path, policy, code).run("go")
    [res] = results(result.messages)
    assert res.is_error and "safe\n[exit code 0]" in res.text
    assert "refused: Shell denied: Tool execution denied by rules[0] shell.exec" in res.text
    assert "ToolDenied:" in res.text and 'File "<program>", line 6' in res.text
    assert (victim / "data").read_text() == "precious"


async def test_without_a_terminal_a_nested_call_the_policy_asks_about_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_text("x")
    code = 'try:\n    await delete("f.txt")\nexcept ToolDenied as exc:\n    print(exc)\n'
    result = await policy_agent(tmp_path, TRUST_CODEMODE, code).run("go")
    [res] = results(result.messages)
    assert "Delete denied: Tool execution denied: requires interactive approval" in res.text
    assert (tmp_path / "f.txt").exists()


async def test_on_a_terminal_a_nested_call_is_asked_like_a_direct_one(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_text("x")
    (tmp_path / "g.txt").write_text("x")
    asked: list[Question] = []

    async def ask(question: Question) -> Any:
        asked.append(question)
        if question.tool == "CodeMode":
            return "approve"  # the program itself: the default policy asks before it runs
        return "approve" if question.args.get("path") == "f.txt" else "deny"

    code = program(
        """
        await delete("f.txt")
        try:
            await delete("g.txt")
        except ToolDenied as exc:
            print(exc)
        print(await shell("rm -rf /tmp/definitely-not-here-codemode"))
        """
    )
    result = await policy_agent(tmp_path, default_policy(), code, ask=ask).run("go")
    [res] = results(result.messages)
    assert [q.tool for q in asked] == ["CodeMode", "Delete", "Delete", "Shell"]
    assert "destructive" in asked[3].tags  # judged exactly as a direct Shell call
    assert "Delete denied: Tool execution denied by user" in res.text
    assert not (tmp_path / "f.txt").exists() and (tmp_path / "g.txt").exists()


async def test_the_default_policy_asks_before_the_program_itself(tmp_path: Path) -> None:
    code = 'await write("ran.txt", "x")\n'
    result = await policy_agent(tmp_path, default_policy(), code).run("go")
    [res] = results(result.messages)
    assert res.is_error and "codemode.exec" in res.text and "requires interactive approval" in res.text
    assert not (tmp_path / "ran.txt").exists()


# ---------------------------------------------------------------------------------- MCP


async def test_mcp_tools_are_functions_of_the_program(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    from agentloop.tools.mcp import mcp_tools

    server = str(Path(__file__).parent / "fakes" / "mcp_server.py")
    async with mcp_tools([{"name": "fake", "command": sys.executable, "args": [server]}]) as tools:
        cm = CodeMode([*builtin_tools(tmp_path), *tools], cwd=tmp_path)
        assert "await mcp_fake_add(a, b)" in cm.description
        code = program(
            """
            print(await mcp_fake_add(2, b=40))
            try:
                await mcp_fake_fail(why="no disk")
            except ToolFailed as exc:
                print("failed:", exc)
            """
        )
        result = await run_direct(cm, code)
        assert result.content[0].text == "42\nfailed: Error executing tool fail"  # type: ignore[union-attr]
        # structured output: the signature shows its shape, the program gets the value itself
        assert "await mcp_fake_add(a, b) -> int" in cm.description
        assert 'await mcp_fake_forecast(city) -> {"city": str, "celsius": float, "days": list[str]}' in cm.description
        code = program(
            """
            f = await mcp_fake_forecast("Oslo")
            print(f["city"], f["celsius"] + 1, f["days"][-1], await mcp_fake_add(2, 40) + 1)
            """
        )
        result = await run_direct(cm, code)
        assert result.content[0].text == "Oslo 22.5 tue 43"  # type: ignore[union-attr]
        # the default policy asks before every MCP call: without a terminal, refused
        hooks = Hooks()
        hooks.before_tool_call(PolicyHook(TRUST_CODEMODE, cwd=tmp_path, ask=None))
        model = ScriptedModel([Reply(tool_calls=[call("CodeMode", code="print(await mcp_fake_add(1, 1))")]), "ok"])
        agent = Agent(model=model, tools=[cm], workspace=tmp_path, hooks=hooks)
        [res] = results((await agent.run("go")).messages)
        assert res.is_error and "ToolDenied: fake__add denied" in res.text and "mcp.fake.add" in res.text
        # and a direct call meets the same rule: the hook sees the tool's syscall, not its name
        model = ScriptedModel([Reply(tool_calls=[call("fake__add", a=1, b=1)]), "ok"])
        agent = Agent(model=model, tools=[cm, *tools], workspace=tmp_path, hooks=hooks)
        [res] = results((await agent.run("go")).messages)
        assert res.is_error and "mcp.fake.add" in res.text and "requires interactive approval" in res.text


# ---------------------------------------------------------------------------------- durable processes


def open_kernel(tmp_path: Path, model: Any, workspace: Path | None = None, **kw: Any) -> Any:
    root = workspace or tmp_path / "ws"
    root.mkdir(exist_ok=True)
    return Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=model,
        workspace=root,
        extra_tools=[CodeMode(builtin_tools(root))],
        **kw,
    )


async def test_codemode_in_a_durable_process(tmp_path: Path) -> None:
    sub = tmp_path / "ws" / "sub"
    sub.mkdir(parents=True)
    (sub / "note.txt").write_text("in sub\n")
    code = program(
        """
        print(await read("note.txt"))
        await write("out.txt", "written")
        """
    )
    model = ScriptedModel([Reply(tool_calls=[call("CodeMode", code=code)]), "done"])
    async with open_kernel(tmp_path, model, policy=TRUST_CODEMODE.to_json()) as k:
        proc = await k.spawn(owner="alice", cwd="sub")
        await proc.send("go")
        await proc.wait_idle()
        [res] = results(await proc.messages())
    # the process's own cwd: the run's per-process tools served the nested calls
    assert "in sub" in res.text and (sub / "out.txt").read_text() == "written" and not res.is_error


async def asked(proc: Any, *, besides: tuple[str, ...] = ()) -> Any:
    """The one pending approval request of ``proc`` (other than ``besides``), once it is there."""
    for _ in range(500):
        pending = [p for p in await proc.pending_approvals() if p.request_id not in besides]
        if pending:
            [request] = pending
            return request
        await asyncio.sleep(0.01)
    raise AssertionError("no approval request came")


async def test_a_durable_nested_call_is_asked_and_the_program_waits_for_the_answer(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    for name in ("f.txt", "g.txt"):
        (ws / name).write_text("x")
    code = program(
        """
        await delete("f.txt")
        print("deleted f")
        try:
            await delete("g.txt")
        except ToolDenied as exc:
            print(exc)
        print("went on")
        """
    )
    model = ScriptedModel([Reply(tool_calls=[call("CodeMode", code=code)]), "done"])
    async with open_kernel(tmp_path, model, policy=TRUST_CODEMODE.to_json()) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        first = await asked(proc)
        assert (first.tool_name, first.syscall, first.args) == ("Delete", "fs.delete", {"path": "f.txt"})
        await proc.hil(first.request_id, "approve")
        second = await asked(proc, besides=(first.request_id,))
        assert second.args == {"path": "g.txt"} and not (ws / "f.txt").exists()  # approved: it ran, then on
        await proc.hil(second.request_id, "deny")
        await proc.wait_idle()
        [res] = results(await proc.messages())
        signals = [s async for s in proc.signals(follow=False)]
        assert await proc.pending_approvals() == []
    assert res.text == "deleted f\nDelete denied: Tool execution denied by user\nwent on" and not res.is_error
    assert (ws / "g.txt").exists()
    requested = [s.payload for s in signals if s.signal == "proc.run.hil.requested"]
    assert [(p["args"], p.get("nested")) for p in requested] == [({"path": "f.txt"}, True), ({"path": "g.txt"}, True)]
    # the denial ended the nested call, not the program's: one tool result, the program's
    finished = [s.payload for s in signals if s.signal == "proc.run.tool.finished"]
    assert [(p["name"], p["ok"]) for p in finished] == [("CodeMode", True)]


async def test_a_program_that_ends_while_asking_withdraws_its_question(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "f.txt").write_text("x")
    model = ScriptedModel([Reply(tool_calls=[call("CodeMode", code='await delete("f.txt")\n', timeout=1)]), "ok"])
    async with open_kernel(tmp_path, model, policy=TRUST_CODEMODE.to_json()) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        await asked(proc)  # nobody answers
        await proc.wait_idle()
        [res] = results(await proc.messages())
        assert await proc.pending_approvals() == []
    assert res.is_error and res.details["timed_out"] and (tmp_path / "ws" / "f.txt").exists()


async def test_a_restart_resolves_a_program_waiting_for_approval_and_withdraws_its_question(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "f.txt").write_text("x")
    policy = TRUST_CODEMODE.to_json()
    model = ScriptedModel([Reply(tool_calls=[call("CodeMode", code='await delete("f.txt")\n')])])
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    async with open_kernel(tmp_path, model, policy=policy) as k:
        proc = await k.spawn(owner="alice", pid="p1")
        await proc.send("go")
        await asked(proc)
        # what a crash at this moment leaves behind: the store as committed (the program dies with us)
        with sqlite3.connect(tmp_path / "a.db") as src, sqlite3.connect(crashed / "a.db") as dst:
            src.backup(dst)
    model = ScriptedModel(["it was interrupted"])
    async with open_kernel(crashed, model, policy=policy, workspace=ws) as k:
        proc = await k.process("p1")
        await proc.wait_idle()
        assert await proc.pending_approvals() == []  # no question left that nothing waits on
        messages = await proc.messages()
    [res] = results(messages)
    assert res.is_error and "interrupted by a restart" in res.text
    assert messages[-1].text == "it was interrupted" and (ws / "f.txt").exists()


async def test_a_durable_policy_denial_reaches_the_program_and_the_program_itself_is_asked(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "keep.txt").write_text("x")
    deny = {"default": "auto", "rules": [{"match": "fs.delete", "action": "deny"}]}
    model = ScriptedModel([Reply(tool_calls=[call("CodeMode", code='await delete("keep.txt")\n')]), "done"])
    async with open_kernel(tmp_path, model, policy=deny) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        await proc.wait_idle()
        [res] = results(await proc.messages())
    assert res.is_error and "ToolDenied: Delete denied: denied by policy" in res.text
    assert (tmp_path / "ws" / "keep.txt").exists()

    model = ScriptedModel([Reply(tool_calls=[call("CodeMode", code="print(1)")]), "done"])
    async with open_kernel(tmp_path, model) as k:  # the default policy
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        for _ in range(500):
            pending = await proc.pending_approvals()
            if pending:
                break
            await asyncio.sleep(0.01)
        assert [(p.tool_name, p.syscall) for p in pending] == [("CodeMode", "codemode.exec")]
        await proc.hil(pending[0].request_id, "approve")
        await proc.wait_idle()
        [res] = results(await proc.messages())
    assert res.text == "1" and not res.is_error


def test_codemode_true_in_the_config_file_offers_it_to_run(tmp_path, monkeypatch):
    import json as _json

    from typer.testing import CliRunner

    from agentloop.cli.main import app

    (tmp_path / "config.toml").write_text("codemode = true\n")
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "config.toml"))
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("alpha\nbeta\n")
    code = 'text = await read("a.txt")\nprint("has beta:", "beta" in text)'
    script = tmp_path / "s.json"
    script.write_text(
        _json.dumps({"replies": [{"tool_calls": [{"name": "CodeMode", "arguments": {"code": code}}]}, "done"]})
    )
    ran = CliRunner().invoke(
        app, ["run", "--json", "--approval", "auto", "-m", f"scripted:{script}", "-w", str(ws), "go"]
    )
    assert ran.exit_code == 0, ran.stderr
    ends = [e for e in map(_json.loads, ran.stdout.splitlines()) if e.get("type") == "tool_execution_end"]
    assert len(ends) == 1 and not ends[0]["is_error"], ends
    assert "has beta: True" in ends[0]["result"]["content"][0]["text"]

    (tmp_path / "config.toml").write_text('codemode = "yes"\n')
    bad = CliRunner().invoke(app, ["run", "-m", f"scripted:{script}", "-w", str(ws), "go"])
    assert bad.exit_code == 2 and "codemode must be true or false" in bad.stderr


async def test_a_program_exiting_with_code_2_is_not_reported_as_a_compile_error(tmp_path: Path) -> None:
    result = await run_direct(codemode(tmp_path), 'import sys\nprint("hi")\nsys.exit(2)\n')
    text = result.content[0].text  # type: ignore[union-attr]
    assert result.is_error and text.startswith("hi") and "[the program exited with code 2]" in text
    assert "compiled" not in text


async def test_sys_exit_with_a_message_is_the_programs_exit_not_an_exception(tmp_path: Path) -> None:
    in_a_task = 'import sys\nprint("hi")\nasync def f():\n    sys.exit("gave up")\nawait asyncio.gather(f())\n'
    for code in ('import sys\nprint("hi")\nsys.exit("gave up")\n', in_a_task):
        result = await run_direct(codemode(tmp_path), code)
        assert result.content[0].text == "hi\n[the program exited with code 1: gave up]"  # type: ignore[union-attr]
        assert result.is_error and result.details["exit_code"] == 1 and result.details["exit_message"] == "gave up"


async def test_sys_exit_0_or_without_a_code_is_a_normal_end_even_in_a_task(tmp_path: Path) -> None:
    for how in ("sys.exit(0)", "sys.exit()"):
        in_a_task = f'import sys\nprint("hi")\nasync def f():\n    {how}\nawait asyncio.gather(f())\nprint("no")\n'
        for code in (f'import sys\nprint("hi")\n{how}\nprint("no")\n', in_a_task):
            result = await run_direct(codemode(tmp_path), code)
            text = result.content[0].text  # type: ignore[union-attr]
            assert text == "hi" and not result.is_error and result.details["exit_code"] == 0, (code, text)


async def test_a_nested_call_knows_the_run_that_started_the_program(tmp_path: Path) -> None:
    """(A subagent started from a program stops with that run, like one started directly.)"""
    from agentloop import tool

    seen: list[str | None] = []

    @tool(name="probe")
    async def probe(ctx: ToolContext) -> str:
        """Report the run."""
        seen.append(ctx.run_id)
        return "ok"

    cm = CodeMode([probe], cwd=tmp_path)
    result = await cm.run(cm.validate({"code": "await probe()\n"}), ToolContext("call-1", cm.name, run_id="run-7"))
    assert not result.is_error, result.text
    assert seen == ["run-7"]


async def test_a_program_calls_only_the_built_in_tools_its_run_has_and_was_offered(tmp_path: Path) -> None:
    """A review: a program ran shell() where a toolset had taken Shell from the process (and in the
    kernel's root, not the process's directory), and where a hook had held Shell back this turn."""

    def no_shell(record: Any, shared: Any) -> Any:  # e.g. a restricted account
        return {name: tool for name, tool in shared.items() if name != "Shell"}

    program_call = Reply(tool_calls=[call("CodeMode", code='print(await shell("touch made-by-shell"))')])
    policy = {"default": "auto", "rules": [{"match": "codemode.exec", "action": "auto"}]}
    (tmp_path / "ws" / "sub").mkdir(parents=True)
    async with open_kernel(tmp_path, ScriptedModel([program_call, "done"]), policy=policy, toolset=no_shell) as k:
        proc = await k.spawn(owner="alice", cwd="sub")
        await proc.send("go")
        await proc.wait_idle()
        [res] = results(await proc.messages())
    assert res.is_error and "no tool 'Shell' is available in this run" in res.text
    assert not list(tmp_path.rglob("made-by-shell"))

    hooks = Hooks()

    @hooks.on("pre_tool_materialization")
    async def hide_shell(info: Any) -> Any:
        return [t for t in info.tools if t.name != "Shell"]

    ws = tmp_path / "mem"
    ws.mkdir()
    agent = Agent(
        model=ScriptedModel([program_call, "done"]), tools=builtin_tools(ws, codemode=True), workspace=ws, hooks=hooks
    )
    [res] = results((await agent.run("go")).messages)
    assert res.is_error and "not available in this turn" in res.text and not (ws / "made-by-shell").exists()


async def test_a_program_approved_after_a_restart_calls_only_what_its_turn_was_offered(tmp_path: Path) -> None:
    """The tools a hook offered a turn are kept with the run: a program whose approval comes
    after a restart still may not call one the turn held back (they were kept in memory only)."""
    program_call = Reply(tool_calls=[call("CodeMode", code='print(await shell("touch made-by-shell"))')])
    policy = {"default": "auto", "rules": [{"match": "codemode.exec", "action": "ask"}]}

    async def hide_shell(info: Any) -> Any:
        return [t for t in info.tools if t.name != "Shell"]

    async with open_kernel(tmp_path, ScriptedModel([program_call]), policy=policy) as k:
        k.engine.config.hooks.on("pre_tool_materialization")(hide_shell)
        proc = await k.spawn(owner="alice")
        await proc.send("go")
        for _ in range(200):
            if await proc.pending_approvals():
                break
            await asyncio.sleep(0.02)
        pid = proc.pid
    async with open_kernel(tmp_path, ScriptedModel(["done"]), policy=policy) as k:
        proc = await k.process(pid)
        [question] = await proc.pending_approvals()
        await proc.hil(question.request_id, "approve")
        await asyncio.wait_for(proc.wait_idle(), 10)
        [res] = results(await proc.messages())
    assert res.is_error and "not available in this turn" in res.text, res.text
    assert not list(tmp_path.rglob("made-by-shell"))


async def test_codemode_as_an_agents_only_tool_calls_the_built_ins_it_was_given(tmp_path: Path) -> None:
    """The run has no built-ins of its own to lend: the program uses CodeMode's (a review: the
    rule for runs whose toolset took a built-in away had refused them all)."""
    (tmp_path / "a.txt").write_text("hello\n")
    cm = CodeMode(builtin_tools(tmp_path), cwd=tmp_path)
    model = ScriptedModel([Reply(tool_calls=[call("CodeMode", code='print(await read("a.txt"))')]), "done"])
    [res] = results((await Agent(model=model, tools=[cm], workspace=tmp_path).run("go")).messages)
    assert not res.is_error and "hello" in res.text
