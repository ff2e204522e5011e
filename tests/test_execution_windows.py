"""Execution windows: a window's round or tool-call budget used up opens the next window (an event
in memory, ``proc.run.window`` in a durable process) instead of ending the run; the run ends like
a tripped guard past ``max_windows`` windows, or after ``max_idle_windows`` windows in a row
without progress. The in-memory and the durable runner decide the same."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentloop import Agent, Guards, Reply, ScriptedModel, call
from agentloop.cli.config import load_settings
from agentloop.events import AgentEnd, WindowContinued, event_from_dict, event_to_dict
from agentloop.kernel import Approval
from agentloop.messages import AssistantMessage, SystemMessage
from agentloop.models.base import ModelRequest
from tests.process_support import echo, kernel


@dataclass
class Outcome:
    reason: str
    windows: list[tuple[int, int, int]]  # (window, rounds, tool calls) of each window opened
    text: str  # the run's last message
    notices: list[str]  # the guard's final-round instructions
    last_tools: bool  # whether the last model call was offered tools


async def in_memory(tmp_path: Path, model: ScriptedModel, guards: Guards) -> Outcome:
    windows: list[tuple[int, int, int]] = []
    end: AgentEnd | None = None
    async for event in Agent(model=model, tools=[echo], guards=guards).stream("go"):
        if isinstance(event, WindowContinued):
            windows.append((event.window, event.rounds, event.tool_calls))
        elif isinstance(event, AgentEnd):
            end = event
    assert end is not None
    notices = [m.text for m in end.messages if isinstance(m, SystemMessage) and m.kind == "guard"]
    return Outcome(end.stop_reason, windows, end.messages[-1].text, notices, bool(model.requests[-1].tools))


async def durable(tmp_path: Path, model: ScriptedModel, guards: Guards) -> Outcome:
    async with kernel(tmp_path, model, tools=[echo], guards=guards) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        await asyncio.wait_for(proc.wait_idle(), 10)
        signals = [s async for s in proc.signals(follow=False)]
        messages = await proc.messages()
    windows = [
        (s.payload["window"], s.payload["rounds"], s.payload["toolCalls"])
        for s in signals
        if s.signal == "proc.run.window"
    ]
    [finished] = [s for s in signals if s.signal == "proc.run.finished"]
    notices = [m.text for m in messages if isinstance(m, SystemMessage) and m.kind == "guard"]
    return Outcome(
        _reason(finished.payload["reason"]), windows, messages[-1].text, notices, bool(model.requests[-1].tools)
    )


def _reason(durable: str) -> str:
    """A durable run's end reason as the in-memory runner's stop reason (an answer is a completed turn)."""
    return "stop" if durable == "turn.complete" else durable


Runner = Callable[[Path, ScriptedModel, Guards], Awaitable[Outcome]]
RUNNERS = pytest.mark.parametrize("run", [in_memory, durable], ids=["memory", "durable"])


def _rounds(request: ModelRequest) -> int:
    """How many answers the model gave before this call (the script's position, restart or not)."""
    return sum(isinstance(m, AssistantMessage) for m in request.messages)


@RUNNERS
async def test_used_up_windows_continue_the_run_to_its_answer(run: Runner, tmp_path: Path) -> None:
    model = ScriptedModel([*(Reply(tool_calls=[call("echo", text=f"step {i}")]) for i in range(5)), "all done"])
    out = await run(tmp_path, model, Guards(window_rounds=2))
    assert out.reason == "stop"
    assert out.windows == [(2, 2, 2), (3, 2, 2)]  # before rounds 3 and 5; round 6 answers in window 3
    assert out.text == "all done"
    assert out.notices == []
    assert len(model.requests) == 6


@RUNNERS
async def test_a_window_of_tool_calls_counts_every_call_of_its_rounds(run: Runner, tmp_path: Path) -> None:
    pairs = [Reply(tool_calls=[call("echo", text=f"{i}a"), call("echo", text=f"{i}b")]) for i in range(3)]
    model = ScriptedModel([*pairs, "all done"])
    out = await run(tmp_path, model, Guards(window_tool_calls=3))
    assert (out.reason, out.text) == ("stop", "all done")
    assert out.windows == [(2, 2, 4)]  # checked between rounds: the second round's pair went past 3


@RUNNERS
async def test_past_max_windows_the_run_ends_with_a_tools_free_round(run: Runner, tmp_path: Path) -> None:
    model = ScriptedModel(
        lambda r: Reply(tool_calls=[call("echo", text=f"step {_rounds(r)}")]) if r.tools else "wrapping up"
    )
    out = await run(tmp_path, model, Guards(window_rounds=2, max_windows=2))
    assert out.reason == "max_windows"
    assert out.windows == [(2, 2, 2)]
    assert (out.text, out.last_tools) == ("wrapping up", False)
    assert len(model.requests) == 5  # two windows of two rounds, then the final round
    assert len(out.notices) == 1 and "execution windows" in out.notices[0]


@RUNNERS
async def test_windows_without_progress_end_the_run(run: Runner, tmp_path: Path) -> None:
    """Two calls alternate with constant results: no streak for the repeated-call guard, but
    after the first window nothing new comes back and the model writes nothing."""
    model = ScriptedModel(
        lambda r: Reply(tool_calls=[call("echo", text="ab"[_rounds(r) % 2])]) if r.tools else "I am stuck"
    )
    out = await run(tmp_path, model, Guards(window_rounds=2, max_idle_windows=2))
    assert out.reason == "no_progress"
    assert out.windows == [(2, 2, 2), (3, 2, 2)]  # window 1 had new results; windows 2 and 3 none
    assert (out.text, out.last_tools) == ("I am stuck", False)
    assert len(model.requests) == 7
    assert len(out.notices) == 1 and "no progress" in out.notices[0]


@RUNNERS
async def test_new_assistant_text_is_progress(run: Runner, tmp_path: Path) -> None:
    """The same calls with the same results, but the model says something new each round."""

    def brain(r: ModelRequest) -> Reply | str:
        n = _rounds(r)
        if n >= 8:
            return "finished"
        return Reply(text=f"thinking {n}", tool_calls=[call("echo", text="ab"[n % 2])])

    out = await run(tmp_path, ScriptedModel(brain), Guards(window_rounds=2, max_idle_windows=1))
    assert (out.reason, out.text) == ("stop", "finished")
    assert [w for w, _, _ in out.windows] == [2, 3, 4, 5]


@RUNNERS
async def test_off_by_default_no_window_events(run: Runner, tmp_path: Path) -> None:
    model = ScriptedModel([*(Reply(tool_calls=[call("echo", text=f"step {i}")]) for i in range(5)), "all done"])
    out = await run(tmp_path, model, Guards(max_rounds=50))
    assert (out.reason, out.windows, out.text) == ("stop", [], "all done")
    assert not Guards().active


async def test_a_durable_restart_in_window_two_continues_window_two(tmp_path: Path) -> None:
    """The third round's call waits for approval (window 2) when the kernel closes; reopened, the
    run goes on in window 2: the next window opens after round 4, not at once."""

    def brain(r: ModelRequest) -> Reply | str:
        n = _rounds(r)
        if n == 2:
            return Reply(tool_calls=[call("rm", path="x")])
        return Reply(tool_calls=[call("echo", text=f"step {n}")]) if n < 5 else "all done"

    from agentloop import tool

    @tool
    def rm(path: str) -> str:
        """Pretend to delete."""
        return f"removed {path}"

    async def policy(process: Any, row: Any) -> Approval:
        return Approval("ask", ("destructive",), "rm", fingerprint="rm") if row.tool_name == "rm" else Approval("auto")

    guards = Guards(window_rounds=2)

    def open_kernel() -> Any:
        return kernel(tmp_path, ScriptedModel(brain), tools=[echo, rm], guards=guards, approval=policy)

    async def asked(proc: Any) -> str:
        for _ in range(500):
            pending = await proc.pending_approvals()
            if pending:
                return str(pending[0].request_id)
            await asyncio.sleep(0.01)
        raise AssertionError("no approval was asked for")

    async with open_kernel() as k:
        proc = await k.spawn(owner="a", text="go")
        await asked(proc)
        pid = proc.pid
        before = [s.payload["window"] async for s in proc.signals(follow=False) if s.signal == "proc.run.window"]
    assert before == [2]
    async with open_kernel() as k2:
        proc = await k2.process(pid)
        await proc.hil(await asked(proc), "approve")
        await asyncio.wait_for(proc.wait_idle(), 10)
        signals = [s async for s in proc.signals(follow=False)]
        messages = await proc.messages()
    windows = [
        (s.payload["window"], s.payload["rounds"], s.payload["toolCalls"])
        for s in signals
        if s.signal == "proc.run.window"
    ]
    assert windows == [(2, 2, 2), (3, 2, 2)]
    assert messages[-1].text == "all done"
    [finished] = [s for s in signals if s.signal == "proc.run.finished"]
    assert finished.payload["reason"] == "turn.complete"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window_rounds", 0),
        ("window_tool_calls", -1),
        ("window_rounds", 1.5),
        ("max_windows", 0),
        ("max_idle_windows", True),
        ("max_windows", None),
    ],
)
def test_bad_window_values_are_clear_errors(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"Guards.{field} must be a positive integer, got {value!r}"):
        Guards(**{field: value})


def test_the_window_event_has_a_wire_form_that_reads_back() -> None:
    event = WindowContinued(window=3, rounds=2, tool_calls=5)
    data = event_to_dict(event)
    assert data == {"type": "window_continued", "window": 3, "rounds": 2, "tool_calls": 5}
    assert event_from_dict(data) == event


def test_window_keys_in_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("window_rounds = 5\nmax_idle_windows = 2\n")
    guards = load_settings(env={"AGENTLOOP_CONFIG": str(path)}).guards
    assert (guards.window_rounds, guards.window_tool_calls, guards.max_windows, guards.max_idle_windows) == (
        5,
        None,
        16,
        2,
    )
    path.write_text("window_rounds = 5\nmax_windows = 0\n")
    settings = load_settings(env={"AGENTLOOP_CONFIG": str(path)})
    assert settings.errors == [
        f"config file {path}: max_windows must be a positive integer (execution windows per run), got 0"
    ]


def test_the_terminal_shows_a_window_opening_in_memory_and_durably() -> None:
    """Both chats say when a run goes on in a new window (else a long run looks stuck or cut)."""
    import io

    from agentloop.cli.render import SignalRenderer, TextRenderer, stderr_console
    from agentloop.events import WindowContinued
    from agentloop.process import signals as psig
    from agentloop.process.signals import Signal

    memory_err, durable_err = io.StringIO(), io.StringIO()
    TextRenderer(io.StringIO(), stderr_console(memory_err)).handle(WindowContinued(window=2, rounds=5, tool_calls=7))
    view = SignalRenderer(TextRenderer(io.StringIO(), stderr_console(durable_err)))
    view.handle(Signal(psig.RUN_WINDOW, {"runId": "r", "window": 3, "rounds": 4, "toolCalls": 9}, 1))
    assert memory_err.getvalue() == "execution window 2 opens (the last used 5 rounds, 7 tool calls)\n"
    assert durable_err.getvalue() == "execution window 3 opens (the last used 4 rounds, 9 tool calls)\n"


def test_a_window_record_from_another_version_is_read_for_what_this_one_knows() -> None:
    """A run record written by a newer version (a rolling deploy) must not stop the run's driver."""
    from agentloop.loop.windows import Window

    window = Window.from_record({"number": 2, "seen": ["a"], "added_later": 1})
    assert window.number == 2 and window.seen == ("a",)
