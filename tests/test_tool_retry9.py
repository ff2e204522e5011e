"""``ToolRetry``: failed tool calls classified from what the real tools report, counted against
per-run budgets told to the model, a gentle stop when one is spent (in memory and in a durable
process), budgets given back after a clean step, and nothing at all without the piece."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import agentloop
from agentloop import Agent, Block, Reply, ScriptedModel, ToolResult, ToolResultMessage, call, tool
from agentloop.kernel import Kernel
from agentloop.loop.tool_retry import (
    DEFAULT_CLASS_BUDGETS,
    Classification,
    ToolFailure,
    ToolRetry,
    classify_failure,
    signature,
)
from agentloop.process.api import approve_everything
from agentloop.tools.builtin import builtin_tools


def results(messages: list[agentloop.Message]) -> list[ToolResultMessage]:
    return [m for m in messages if isinstance(m, ToolResultMessage)]


def failure(text: str, details: object = None, *, tool_name: str = "X", executed: bool = True) -> ToolFailure:
    return ToolFailure(tool_name, {}, text, details, executed)


def cls(text: str, details: object = None, *, executed: bool = True) -> str:
    return classify_failure(failure(text, details, executed=executed)).error_class


@tool
def flaky(n: int) -> str:
    """Fails for odd n."""
    if n % 2:
        raise agentloop.ToolError(f"item {n} not found")
    return f"item {n}"


# -- 1. classification of real tool failures -------------------------------------------------------


async def test_real_tool_failures_are_classified_and_told_with_their_budgets(tmp_path: Path) -> None:
    (tmp_path / "ok.txt").write_text("fine\n")
    model = ScriptedModel(
        [
            Reply(
                tool_calls=[
                    call("Shell", command="definitely-not-a-command-9x7 --help"),
                    call("Read", path="missing.txt"),
                    call("Shell", command="ls", cwd="no-such-dir"),  # the tool's own argument check
                    call("Shell", command="sleep 5", timeout=0.3),
                    call("Shell", command="exit 3"),
                ]
            ),
            "done",
        ]
    )
    agent = Agent(model=model, tools=builtin_tools(tmp_path), pieces=[ToolRetry()], tool_execution="sequential")
    start = time.monotonic()
    result = await asyncio.wait_for(agent.run("go"), 10)
    shell_missing, read_missing, bad_cwd, slow, exit3 = results(result.messages)
    assert shell_missing.details["exit_code"] == 127
    assert "class=command_not_found" in shell_missing.text
    assert shell_missing.text.startswith(shell_missing.text.split("\n[tool retry")[0])  # the tool's text kept
    assert read_missing.text.startswith("File not found: missing.txt\n[tool retry: class=not_found;")
    # what is left of each budget, after this failure: one round of 32, one not-found of 2 …
    assert "retries left: rounds 31/32, not_found 1/2, Read 15/16, same call 2/3" in read_missing.text
    assert "hint: check the name or path" in read_missing.text
    assert "class=invalid_arguments" in bad_cwd.text and "Shell 14/16" in bad_cwd.text
    assert slow.details["timed_out"] is True and "class=timeout" in slow.text
    assert "class=execution_failed" in exit3.text and "Shell 12/16" in exit3.text and "rounds 31/32" in exit3.text
    assert result.stop_reason == "stop" and result.text == "done"  # no budget spent: the run goes on
    assert time.monotonic() - start < 8


async def test_arguments_refused_before_the_call_ran_are_counted_and_told_as_context(tmp_path: Path) -> None:
    """Validation errors never reach an ``after_tool_call`` hook: their facts come with the next
    model call instead, and they count against the same budgets."""
    model = ScriptedModel(
        [Reply(tool_calls=[call("Read", pathh="x.txt")]), Reply(tool_calls=[call("Read", pathh="x.txt")]), "ok"]
    )
    agent = Agent(model=model, tools=builtin_tools(tmp_path, shell=False), pieces=[ToolRetry()])
    result = await agent.run("go")
    first, second = results(result.messages)
    assert first.text.startswith('Validation failed for tool "Read"') and "[tool retry" not in first.text
    assert second.text == first.text  # the result itself is left as the loop made it
    told, again = model.requests[1].system_prompt, model.requests[2].system_prompt
    line = f"Read ({first.tool_call_id}): [tool retry: class=invalid_arguments; retries left: rounds 31/32"
    assert line + ", invalid_arguments 2/3" in told
    assert "invalid_arguments 1/3" in again and "same call 1/3" in again
    assert "Tool failures" not in model.requests[0].system_prompt
    assert result.stop_reason == "stop"


def test_the_default_classification_reads_details_and_the_tools_words() -> None:
    # Shell, by its details
    assert classify_failure(failure("x", {"exit_code": 127, "timed_out": False})).error_class == "command_not_found"
    assert cls("bash: ./run.sh: Permission denied\n[exit code 126]", {"exit_code": 126}) == "permission_denied"
    assert cls("cat: a: No such file or directory\n[exit code 1]", {"exit_code": 1}) == "not_found"
    assert cls("boom\n[exit code 1]", {"exit_code": 1, "truncated": True}) == "output_truncated"
    assert cls("x", {"exit_code": -9, "timed_out": False, "stopped": True}) == "cancelled"
    # Fetch, by its HTTP status (a rate limit asks for time, as Pioneer counts it)
    assert cls("GET u -> 404 Not Found", {"status": 404}) == "not_found"
    assert cls("GET u -> 429", {"status": 429}) == "timeout"
    assert cls("GET u -> 403", {"status": 403}) == "permission_denied"
    assert cls("GET u -> 502", {"status": 502}) == "execution_failed"
    # the loop's and the file tools' words
    assert cls("Tool Shell timed out after 5 s") == "timeout"
    assert cls("timed out after 3 s fetching https://x") == "timeout"
    assert cls("Cannot read a.txt: Permission denied") == "permission_denied"
    assert cls("Path '../x' escapes the workspace with '..'") == "permission_denied"
    assert cls("Tool Nope not found", executed=False) == "not_found"
    assert cls("old_string was not found in a.py; Read the file and copy the text exactly") == "invalid_arguments"
    assert cls("Search failed: the regex is too slow; simplify it, or narrow the path or glob") == "needs_narrowing"
    assert cls("TypeError: unsupported operand") == "internal"
    assert cls("after-tool-call hook failed: oops") == "internal"
    assert cls("CancelledError") == "cancelled"
    assert cls("something odd happened") == "execution_failed"
    # the arguments quoted in a validation error do not decide the class (pi #7055's lesson)
    assert cls('Validation failed for tool "F":\n  - url: bad\n\nReceived arguments:\n"timed out 429"') == (
        "invalid_arguments"
    )
    # refusals are not retryable; a refusal in words of its own (a hook's Block) neither
    denied = classify_failure(failure("Tool execution denied by policy: no", executed=False))
    assert denied.error_class == "permission_denied" and not denied.retryable
    assert not classify_failure(failure("the reviewer said no", executed=False)).retryable
    # a tool of one's own may classify its failure
    own = classify_failure(failure("too much", {"error_class": "needs_narrowing", "retry_hint": "ask for less"}))
    assert own == Classification("needs_narrowing", True, "ask for less")


def test_the_signature_is_canonical_and_the_defaults_are_pioneers() -> None:
    assert signature("T", {"a": 1, "b": {"y": 2, "x": 1}}, "not_found") == signature(
        "T", {"b": {"x": 1, "y": 2}, "a": 1}, "not_found"
    )
    assert signature("T", {"a": 1}, "not_found") != signature("T", {"a": 1}, "timeout")
    assert DEFAULT_CLASS_BUDGETS["needs_narrowing"] == 0 and DEFAULT_CLASS_BUDGETS["internal"] == 0
    assert DEFAULT_CLASS_BUDGETS["invalid_arguments"] == 3 and DEFAULT_CLASS_BUDGETS["not_found"] == 2
    with pytest.raises(ValueError, match="unknown error class"):
        ToolRetry(class_budgets={"nope": 1})
    with pytest.raises(ValueError, match="non-negative"):
        ToolRetry(per_tool=-1)
    with pytest.raises(TypeError, match="classify"):
        ToolRetry(classify="no")  # type: ignore[arg-type]
    assert agentloop.ToolRetry is ToolRetry and "ToolRetry" in agentloop.__all__
    hooks = ToolRetry().hooks()  # (for code that composes ``Hooks`` itself)
    assert len(hooks.after) == 1 and set(hooks.phases) == {"post_turn", "pre_prompt_context"}


# -- 2. exhaustion ends the run gently --------------------------------------------------------------


def reads(*paths: str) -> list[Reply | str]:
    return [*(Reply(tool_calls=[call("Read", path=p)]) for p in paths), "I could not find the file.", "never"]


async def test_a_spent_budget_ends_the_run_gently_in_memory(tmp_path: Path) -> None:
    model = ScriptedModel(reads("a.txt", "b.txt", "c.txt"))
    agent = Agent(model=model, tools=builtin_tools(tmp_path, shell=False), pieces=[ToolRetry()])
    result = await asyncio.wait_for(agent.run("find it"), 10)
    texts = [r.text for r in results(result.messages)]
    assert len(texts) == 3  # the third not-found goes past the budget of two
    assert "not_found 0/2" in texts[1]
    assert "budget exhausted: not_found 2/2 used" in texts[2] and "Tools are off" in texts[2]
    assert result.stop_reason == "stopped" and result.text == "I could not find the file."
    assert not model.requests[-1].tools and len(model.requests) == 4


async def test_the_same_failing_call_spends_the_signature_budget() -> None:
    model = ScriptedModel([*(Reply(tool_calls=[call("flaky", n=1)]) for _ in range(5)), "gave up", "never"])
    agent = Agent(model=model, tools=[flaky], pieces=[ToolRetry(class_budgets={"not_found": 10})])
    result = await agent.run("go")
    texts = [r.text for r in results(result.messages)]
    assert len(texts) == 4 and "same call 0/3" in texts[2]
    assert "budget exhausted: same call 3/3 used" in texts[3]
    assert result.stop_reason == "stopped"  # (before the repeat guard's fourth identical failure)


async def test_needs_narrowing_and_internal_failures_have_no_retries() -> None:
    @tool
    def grep_all(pattern: str) -> ToolResult:
        """Search everything."""
        return ToolResult.text("too many matches", is_error=True, details={"error_class": "needs_narrowing"})

    @tool
    def buggy() -> str:
        """A tool with a bug."""
        raise TypeError("unsupported operand type(s)")

    for name, expected in (("grep_all", "needs_narrowing"), ("buggy", "internal")):
        args = {"pattern": "."} if name == "grep_all" else {}
        model = ScriptedModel([Reply(tool_calls=[call(name, **args)]), "sorry", "never"])
        agent = Agent(model=model, tools=[grep_all, buggy], pieces=[ToolRetry()])
        result = await agent.run("go")
        (only,) = results(result.messages)
        assert f"class={expected}; budget exhausted: {expected} 0/0 used" in only.text
        assert result.stop_reason == "stopped" and len(model.requests) == 2


async def test_a_durable_run_stops_when_a_budget_is_spent(tmp_path: Path) -> None:
    model = ScriptedModel([Reply(tool_calls=[call("Read", pathh="a.txt")]), *reads("a.txt", "b.txt", "c.txt")])
    async with Kernel.open(
        f"sqlite:///{tmp_path}/k.db",
        model=model,
        workspace=tmp_path,
        tools=builtin_tools(tmp_path, shell=False),
        approval=approve_everything,
        pieces=[ToolRetry()],
    ) as k:
        proc = await k.spawn(owner="me", text="find it")
        await asyncio.wait_for(proc.wait_idle(), 10)
        finished = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.run.finished"]
        texts = [m.text for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert [(f["status"], f["reason"]) for f in finished] == [("ok", "stopped")]
    # the refused arguments (never run) were told with the next call, and count as a round
    assert "class=invalid_arguments; retries left: rounds 31/32" in model.requests[1].system_prompt
    assert texts[0].startswith("Validation failed") and "[tool retry" not in texts[0]
    assert len(texts) == 4 and "rounds 30/32, not_found 1/2" in texts[1]
    assert "budget exhausted: not_found 2/2" in texts[3]
    assert not model.requests[-1].tools and len(model.requests) == 5


# -- 3. a clean step gives the budgets back ----------------------------------------------------------


async def test_a_success_resolves_the_episode() -> None:
    model = ScriptedModel(
        [
            Reply(tool_calls=[call("flaky", n=1)]),
            Reply(tool_calls=[call("flaky", n=3)]),
            Reply(tool_calls=[call("flaky", n=2)]),  # works: the episode is over
            Reply(tool_calls=[call("flaky", n=5)]),
            "done",
        ]
    )
    agent = Agent(model=model, tools=[flaky], pieces=[ToolRetry()])
    result = await agent.run("go")
    first, second, ok, after = (r.text for r in results(result.messages))
    assert "not_found 1/2" in first and "not_found 0/2" in second and "rounds 30/32" in second
    assert ok == "item 2"
    assert "retries left: rounds 31/32, not_found 1/2, flaky 15/16" in after  # counted afresh
    assert result.stop_reason == "stop" and result.text == "done"


async def test_refusals_are_not_counted_and_a_custom_classifier_decides_first() -> None:
    seen: list[ToolFailure] = []

    def mine(f: ToolFailure) -> Classification | None:
        seen.append(f)
        return Classification("timeout", hint="wait a little") if "not found" in f.text else None

    model = ScriptedModel([Reply(tool_calls=[call("flaky", n=2)]), Reply(tool_calls=[call("flaky", n=1)]), "done"])
    agent = Agent(model=model, tools=[flaky], pieces=[ToolRetry(classify=mine, class_budgets={"timeout": 1})])
    agent.hooks.before_tool_call(lambda info: Block("the reviewer said no") if info.args["n"] == 2 else None)
    result = await agent.run("go")
    refused, custom = results(result.messages)
    assert refused.text == "the reviewer said no"  # (a block never reaches after hooks)
    assert "class=permission_denied, not retryable" in model.requests[1].system_prompt
    assert "class=timeout; retries left: rounds 31/32, timeout 0/1" in custom.text and "wait a little" in custom.text
    assert [f.executed for f in seen] == [False, True]
    assert result.stop_reason == "stop"


# -- 4. without the piece nothing changes ------------------------------------------------------------


async def test_without_the_piece_results_are_unchanged(tmp_path: Path) -> None:
    model = ScriptedModel([*reads("a.txt", "b.txt", "c.txt", "d.txt")[:4], "done"])
    agent = Agent(model=model, tools=builtin_tools(tmp_path, shell=False))
    assert not agent.config.hooks.after and not agent.config.hooks.phases  # nothing installed, nothing run
    result = await agent.run("find it")
    texts = [r.text for r in results(result.messages)]
    assert texts == [f"File not found: {p}.txt" for p in "abcd"]
    assert result.stop_reason == "stop" and result.text == "done"
    assert all("Tool failures" not in r.system_prompt for r in model.requests)


async def test_the_budgets_of_two_processes_are_their_own_though_their_run_ids_match(tmp_path: Path) -> None:
    """One piece serves every process of a kernel, and run ids repeat across processes (a
    heartbeat's, or a caller's own): the counts were kept per run id alone, so one process's
    failures spent another's budget and stopped its run. Each process fails twice here (the
    not_found budget is 2) and must finish on its own."""

    def brain(request: object) -> Reply | str:
        failed = sum(1 for m in request.messages if isinstance(m, ToolResultMessage))  # type: ignore[attr-defined]
        return Reply(tool_calls=[call("Read", path=f"missing-{failed}.txt")]) if failed < 2 else "not there"

    async with Kernel.open(
        f"sqlite:///{tmp_path}/k.db",
        model=ScriptedModel(brain),
        workspace=tmp_path,
        tools=builtin_tools(tmp_path, shell=False),
        approval=approve_everything,
        pieces=[ToolRetry()],
    ) as k:
        reasons = []
        for owner in ("ann", "bob"):
            proc = await k.spawn(owner=owner)
            await proc.send("find it", run_id="nightly")
            await asyncio.wait_for(proc.wait_idle(), 10)
            finished = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.run.finished"]
            reasons += [(f["status"], f["reason"]) for f in finished]
    assert reasons == [("ok", "turn.complete"), ("ok", "turn.complete")]  # (not "stopped")
