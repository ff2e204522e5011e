"""Repeated successful calls (``loop/retries.py``, the "doom loop"): the same call getting the same
result is told at the ``MAX_SAME_RESULTS``-th time that it will not change, and one more ends the
run's tool use with stop reason ``repeated_call``: in memory and durably alike, the durable counts
surviving a restart. A result that changes is no repeat; a tool that polls (``repeatable``) opts
out; what is not the model's doing is not counted; the counts a run keeps stay bounded."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any, cast

from agentloop import Agent, Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Approval, Kernel, Process
from agentloop.kernel.devices import DeviceDirectory, RoutedTool
from agentloop.loop.execute import CANCELLED
from agentloop.loop.retries import MAX_KEPT, MAX_SAME_FAILURES, MAX_SAME_RESULTS, count_failures, count_repeats
from agentloop.messages import TextContent, ToolCall, tool_error_result
from agentloop.models.base import ModelRequest
from agentloop.process.api import approve_everything
from agentloop.tools.jobs import jobs_tool

NOTE = "it will not change"
looked: list[str] = []  # what ``look`` was asked (cleared by the tests that check it)


@tool
def look(path: str) -> str:
    """List a directory (the same listing every time)."""
    looked.append(path)
    return f"{path}: a.py b.py"


def looping(r: ModelRequest) -> object:
    """Makes the same call for as long as it may, then answers from what it got (giving up on its
    own well past the guard: a run without it ends too, and fails the test instead of hanging)."""
    if r.tools and len(results_of(r.messages)) < 3 * MAX_SAME_RESULTS:
        return Reply(tool_calls=[call("look", path="src")])
    return "src holds a.py and b.py."


def ok(the_call: ToolCall, text: str) -> ToolResultMessage:
    """A successful result of ``the_call``."""
    return ToolResultMessage(tool_call_id=the_call.id, tool_name=the_call.name, content=[TextContent(text=text)])


def results_of(messages: list[Any]) -> list[ToolResultMessage]:
    return [m for m in messages if isinstance(m, ToolResultMessage)]


async def test_the_same_result_is_told_then_stops_the_tools_in_memory() -> None:
    model = ScriptedModel(looping)
    result = await Agent(model=model, tools=[look]).run("what is in src?")
    results = results_of(result.messages)
    assert result.stop_reason == "repeated_call" and result.text == "src holds a.py and b.py."
    assert len(results) == MAX_SAME_RESULTS + 1 and len(model.requests) == MAX_SAME_RESULTS + 2
    assert [NOTE in r.text for r in results] == [False] * (MAX_SAME_RESULTS - 1) + [True, False]
    assert f"this exact result {MAX_SAME_RESULTS} times" in results[MAX_SAME_RESULTS - 1].text
    assert not model.requests[-1].tools  # the last round has no tools
    assert "kept returning the same result" in model.requests[-1].messages[-1].text


async def test_a_result_that_changes_each_time_is_no_repeat() -> None:
    ticks = itertools.count(1)

    @tool
    def progress() -> str:
        """How far the build is."""
        return f"{next(ticks) * 10}% built"

    def waiting(r: ModelRequest) -> object:
        return "built" if r.messages[-1].text == "100% built" else Reply(tool_calls=[call("progress")])

    result = await Agent(model=ScriptedModel(waiting), tools=[progress]).run("wait for the build")
    assert result.stop_reason == "stop" and result.text == "built"
    assert not any(NOTE in r.text for r in results_of(result.messages))


async def test_a_repeatable_tool_may_poll_as_long_as_it_needs() -> None:
    polls = itertools.count(1)

    @tool(repeatable=True)
    def job_status() -> str:
        """Whether the job still runs."""
        next(polls)
        return "still running"

    def polling(r: ModelRequest) -> object:
        count = len(results_of(r.messages))
        return Reply(tool_calls=[call("job_status")]) if count < 2 * MAX_SAME_RESULTS + 2 else "gave up waiting"

    result = await Agent(model=ScriptedModel(polling), tools=[job_status]).run("wait for the job")
    assert result.stop_reason == "stop" and result.text == "gave up waiting"
    assert next(polls) == 2 * MAX_SAME_RESULTS + 3  # every poll ran, none was told off
    assert not any(NOTE in r.text for r in results_of(result.messages))


def test_the_builtin_jobs_tool_polls() -> None:
    assert jobs_tool().repeatable and not look.repeatable


def test_what_is_not_the_models_doing_is_not_counted_and_failures_and_results_apart() -> None:
    the_call = ToolCall(id="c1", name="look", arguments={"path": "src"})
    failures: dict[str, int] = {}
    repeats: dict[str, int] = {}
    for _ in range(MAX_SAME_RESULTS + 2):
        skipped = ok(the_call, CANCELLED)  # (a success in form, but no result of the model's)
        _, failing, repeating = count_repeats(
            failures, repeats, [the_call], [skipped], not_counted=frozenset({CANCELLED}), tools={}
        )
        assert not failing and not repeating
    assert failures == repeats == {}
    for i in range(MAX_SAME_RESULTS + 1):  # the same call failing and succeeding in turn: two counts
        _, failing, repeating = count_repeats(failures, repeats, [the_call], [ok(the_call, "fine")], tools={})
        assert not failing and repeating == (i == MAX_SAME_RESULTS)
        failed = tool_error_result(the_call, "boom")
        assert count_repeats(failures, repeats, [the_call], [failed], tools={})[1] == (i >= MAX_SAME_FAILURES)
    assert list(failures.values()) == [MAX_SAME_RESULTS + 1] and list(repeats.values()) == [MAX_SAME_RESULTS + 1]
    counts: dict[str, int] = {}
    for _ in range(MAX_SAME_RESULTS + 2):  # what counts failures alone leaves the results alone
        assert not count_failures(counts, [the_call], [ok(the_call, "fine")])[1]
    assert counts == {}


def succeed(repeats: dict[str, int], *calls: ToolCall) -> bool:
    """Whether the batch of ``calls``, each getting its own result, trips ``repeated_call``."""
    return count_repeats({}, repeats, list(calls), [ok(c, f"did {c.name}") for c in calls], tools={})[2]


def test_the_result_counts_a_run_keeps_are_bounded_to_the_current_streak() -> None:
    counts: dict[str, int] = {}
    for i in range(1000):
        assert not succeed(counts, ToolCall(id=f"c{i}", name=f"make-{i}", arguments={}))
        assert len(counts) == 1
    repeat = ToolCall(id="r", name="look", arguments={"path": "src"})
    for i in range(3 * MAX_SAME_RESULTS):  # between the repeats, other new results: no streak
        others = (ToolCall(id=f"n{i}{j}", name=f"new-{i}-{j}", arguments={}) for j in range(20))
        assert not succeed(counts, repeat, *others)
    assert [succeed(counts, repeat) for _ in range(MAX_SAME_RESULTS + 1)] == [False] * MAX_SAME_RESULTS + [True]
    assert list(counts.values()) == [MAX_SAME_RESULTS + 1]


def test_the_failures_a_run_keeps_are_bounded_and_keep_the_latest() -> None:
    failures: dict[str, int] = {}
    for i in range(1000):
        new = ToolCall(id=f"c{i}", name=f"make-{i}", arguments={})
        assert not count_failures(failures, [new], [tool_error_result(new, "boom")])[1]
    assert len(failures) <= MAX_KEPT
    repeat = ToolCall(id="r", name="look", arguments={"path": "src"})
    for i in range(MAX_SAME_FAILURES):  # between the repeats, other new failures
        others = [ToolCall(id=f"n{i}{j}", name=f"new-{i}-{j}", arguments={}) for j in range(20)]
        batch = [repeat, *others]
        assert not count_failures(failures, batch, [tool_error_result(c, "boom") for c in batch])[1]
    assert count_failures(failures, [repeat], [tool_error_result(repeat, "boom")])[1]
    assert len(failures) <= MAX_KEPT


files: dict[str, str] = {}


@tool
def edit(path: str, text: str) -> str:
    """Write a file."""
    files[path] = text
    return f"wrote {path}"


@tool
def lint() -> str:
    """Run the linter (it finds nothing wrong, every time)."""
    return "All checks passed!"


def edit_then_lint(steps: int) -> Any:
    """A model that makes ``steps`` different edits, each checked by the same linter run."""

    def script(r: ModelRequest) -> object:
        n = len(results_of(r.messages))
        if n >= 2 * steps:
            return "refactor done"
        if n % 2 == 0:
            return Reply(tool_calls=[call("edit", path=f"m{n // 2}.py", text=f"v{n}")])
        return Reply(tool_calls=[call("lint")])

    return script


async def test_a_check_after_every_change_is_no_repeat() -> None:
    """The reviewer's case: edit, lint "All checks passed!", edit, lint ... the same lint result
    after each different edit is work, not a loop (counted over the run, it ended at the 5th lint)."""
    files.clear()
    steps = 2 * MAX_SAME_RESULTS
    result = await Agent(model=ScriptedModel(edit_then_lint(steps)), tools=[edit, lint]).run("refactor")
    assert result.stop_reason == "stop" and len(files) == steps
    assert not any(NOTE in r.text for r in results_of(result.messages))


async def test_a_durable_check_after_every_change_is_no_repeat(tmp_path: Path) -> None:
    files.clear()
    steps = 2 * MAX_SAME_RESULTS
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=ScriptedModel(edit_then_lint(steps)),
        workspace=tmp_path,
        tools=[edit, lint],
        approval=approve_everything,
    ) as k:
        proc = await k.spawn(owner="a", text="refactor")
        await asyncio.wait_for(proc.wait_idle(), 10)
        reasons = await finished_reasons(proc)
        results = results_of(await proc.messages())
    assert reasons == [("ok", "turn.complete")] and len(files) == steps
    assert not any(NOTE in r.text for r in results)


def test_a_batch_counts_its_calls_in_order() -> None:
    """A batch counts its calls in the model's order: lint, edit, lint ... in one batch is no
    streak; the same call made many times in one batch is one decision of the model, counted
    once (a fan-out, not a loop); batch after batch of it is a streak."""
    counts: dict[str, int] = {}
    lints = [ToolCall(id=f"l{i}", name="lint", arguments={}) for i in range(2 * MAX_SAME_RESULTS)]
    edits = [ToolCall(id=f"e{i}", name="edit", arguments={"n": i}) for i in range(2 * MAX_SAME_RESULTS)]
    assert not succeed(counts, *itertools.chain.from_iterable(zip(lints, edits, strict=True)))
    assert list(counts.values()) == [1]  # the last edit: a streak of one
    assert not succeed(counts, *lints)  # eight at once: one step
    assert list(counts.values()) == [1]
    assert [succeed(counts, *lints[:2]) for _ in range(MAX_SAME_RESULTS)] == [False] * (MAX_SAME_RESULTS - 1) + [True]


def test_a_poll_ends_a_streak_and_a_failure_does_not() -> None:
    poll = ToolCall(id="p", name="job_status", arguments={})
    polls = {"job_status": jobs_tool()}  # (a repeatable tool, under the call's name)
    the_call = ToolCall(id="c", name="look", arguments={"path": "src"})
    counts: dict[str, int] = {}
    for _ in range(2 * MAX_SAME_RESULTS):  # look, poll, look, poll ...: no streak
        batch = [the_call, poll]
        _, _, repeating = count_repeats({}, counts, batch, [ok(the_call, "same"), ok(poll, "running")], tools=polls)
        assert not repeating and counts == {}
    other = ToolCall(id="o", name="edit", arguments={"path": "x"})
    tripped = []
    for _ in range(MAX_SAME_RESULTS + 1):  # look, a failing edit, look ...: the failure changed nothing
        failed = tool_error_result(other, f"no such file {len(tripped)}")
        tripped.append(count_repeats({}, counts, [the_call, other], [ok(the_call, "same"), failed], tools={})[2])
    assert tripped == [False] * MAX_SAME_RESULTS + [True]


def test_a_tool_routed_to_devices_keeps_being_repeatable() -> None:
    @tool(name="Shell", repeatable=True, idempotent=True)
    def shell(command: str) -> str:
        """Run a command."""
        return command

    routed = RoutedTool(shell, "shell.exec", "alice", [], cast(DeviceDirectory, object()))
    assert routed.repeatable and routed.idempotent


def test_the_arguments_are_compared_as_canonical_json() -> None:
    counts: dict[str, int] = {}
    orders = itertools.cycle([{"a": 1, "b": {"x": 1, "y": 2}}, {"b": {"y": 2, "x": 1}, "a": 1}])
    tripped = [
        succeed(counts, ToolCall(id="c", name="find", arguments=next(orders))) for _ in range(MAX_SAME_RESULTS + 1)
    ]
    assert tripped == [False] * MAX_SAME_RESULTS + [True] and list(counts.values()) == [MAX_SAME_RESULTS + 1]


async def finished_reasons(proc: Process) -> list[tuple[str, str]]:
    finished = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.run.finished"]
    return [(f["status"], f["reason"]) for f in finished]


async def test_a_durable_run_counts_results_the_same_way(tmp_path: Path) -> None:
    model = ScriptedModel(looping)
    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[look], approval=approve_everything
    ) as k:
        proc = await k.spawn(owner="a", text="what is in src?")
        await asyncio.wait_for(proc.wait_idle(), 10)
        reasons = await finished_reasons(proc)
        results = results_of(await proc.messages())
    assert reasons == [("ok", "repeated_call")]
    assert [NOTE in r.text for r in results] == [False] * (MAX_SAME_RESULTS - 1) + [True, False]
    assert len(model.requests) == MAX_SAME_RESULTS + 2 and not model.requests[-1].tools


async def asked(proc: Process) -> str:
    """The request id of the one approval the process waits for."""
    for _ in range(500):
        pending = await proc.pending_approvals()
        if pending:
            [one] = pending
            return one.request_id
        await asyncio.sleep(0.01)
    raise AssertionError("no approval was asked for")


async def test_the_durable_counts_survive_a_restart(tmp_path: Path) -> None:
    """The ``MAX_SAME_RESULTS``-th call waits for a person's approval across a restart of the
    runtime: the counts of the calls before it come back with the run, so it is still the one told
    and the next still ends the run (counted afresh, the run would go on for as many again)."""
    looked.clear()

    async def ask_at_the_last_allowed(process: Any, row: Any) -> Approval:
        if len(looked) == MAX_SAME_RESULTS - 1:
            return Approval("ask", ("read",), "look again", fingerprint=f"look-{len(looked)}")
        return Approval("auto")

    def open_kernel() -> Kernel:
        return Kernel.open(
            f"sqlite:///{tmp_path}/a.db",
            model=ScriptedModel(looping),
            workspace=tmp_path,
            tools=[look],
            approval=ask_at_the_last_allowed,
        )

    async with open_kernel() as k:
        proc = await k.spawn(owner="a", text="what is in src?")
        await asked(proc)
        pid = proc.pid
    assert len(looked) == MAX_SAME_RESULTS - 1
    async with open_kernel() as k2:
        proc = await k2.process(pid)
        await proc.hil(await asked(proc), "approve")
        await asyncio.wait_for(proc.wait_idle(), 10)
        reasons = await finished_reasons(proc)
        results = results_of(await proc.messages())
    assert reasons == [("ok", "repeated_call")]
    assert len(looked) == MAX_SAME_RESULTS + 1
    assert [NOTE in r.text for r in results] == [False] * (MAX_SAME_RESULTS - 1) + [True, False]


def test_results_that_are_only_an_image_differ_by_the_image() -> None:
    """A screenshot tool answers with an image and no text: two different screenshots are no repeat."""
    from agentloop.messages import ImageContent

    shot = ToolCall(id="s", name="screenshot", arguments={})
    repeats: dict[str, int] = {}
    for n in range(MAX_SAME_RESULTS + 2):
        image = ToolResultMessage(
            tool_call_id="s", tool_name="screenshot", content=[ImageContent(data=f"AAA{n}", mime_type="image/png")]
        )
        assert not count_repeats({}, repeats, [shot], [image], tools={})[2]


def test_shell_polls_are_no_repeats(tmp_path: Path) -> None:
    """`sleep 30; curl …/status` answering "pending" again and again is a poll: Shell's results
    watch a world that changes with time, as Jobs' do."""
    from agentloop.tools.shell import shell_tool

    assert shell_tool(tmp_path).repeatable
