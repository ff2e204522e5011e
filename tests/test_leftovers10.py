"""Leftovers of today's reviews: an abort racing the start of ``Agent.stream`` (and ``agent.run``),
``$name`` in code not activating a skill, the chat's ``/compact --keep N``."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from agentloop import Agent, AssistantMessage, ScriptedModel
from agentloop.events import AgentEnd, LoopEvent
from agentloop.process.prompt import _chosen
from agentloop.tools.skills import SkillCard, SkillCatalog

# -- an abort as a run starts ---------------------------------------------------------------------


async def _consume(stream: AsyncIterator[LoopEvent], seen: list[LoopEvent]) -> None:
    async for event in stream:
        seen.append(event)


async def test_an_abort_as_an_agent_stream_starts_ends_the_stream() -> None:
    """Aborted after the stream made the run's task but before its first step: the task was
    cancelled before it ran, never told the stream it ended, and the stream waited forever."""
    model = ScriptedModel(["never sent"])
    agent = Agent(model=model)
    seen: list[LoopEvent] = []
    task = asyncio.create_task(_consume(agent.stream("hi"), seen))
    await asyncio.sleep(0)  # the stream made the run's task, which has not run yet
    agent.abort()
    await asyncio.wait_for(task, 1)
    assert isinstance(seen[-1], AgentEnd) and seen[-1].stop_reason == "aborted"
    assert not model.requests


async def test_run_abort_as_its_stream_starts_ends_the_stream() -> None:
    agent = Agent(model=ScriptedModel(["never sent"]))
    run = agent.start("hi", stream=True)
    seen: list[LoopEvent] = []
    task = asyncio.create_task(_consume(run.events(), seen))
    await asyncio.sleep(0)
    run.abort()
    await asyncio.wait_for(task, 1)
    assert seen[-1].type == "agent_end"
    result = await asyncio.wait_for(run.result(), 1)
    assert result.stop_reason == "aborted" and [m.role for m in result.messages] == ["user"]


async def test_an_abort_racing_agent_run_returns_aborted() -> None:
    model = ScriptedModel(["never sent"], latency=5)
    agent = Agent(model=model)
    for ticks in range(4):  # before the run is active (nothing to abort), as it starts, while it waits
        running = asyncio.create_task(agent.run("hi"))
        for _ in range(ticks):
            await asyncio.sleep(0)
        agent.abort()
        if ticks == 0:  # not active yet: the abort was a no-op, the run is aborted once it is active
            await asyncio.sleep(0)
            agent.abort()
        result = await asyncio.wait_for(running, 1)
        assert result.stop_reason == "aborted"
        assert all(not isinstance(m, AssistantMessage) or m.stop_reason == "aborted" for m in result.messages)
    conversation = agent.conversation()  # and a conversation, on Run.abort alone
    seen: list[LoopEvent] = []
    task = asyncio.create_task(_consume(conversation.stream("hi"), seen))
    await asyncio.sleep(0)
    conversation.abort()
    await asyncio.wait_for(task, 1)
    assert seen[-1].type == "agent_end" and not conversation.running


# -- $name in code --------------------------------------------------------------------------------

CATALOG = SkillCatalog(tuple(SkillCard(n, n, (), Path("/nowhere"), True) for n in ("deploy", "db")), 4096)


def named(text: str) -> list[str]:
    return [card.name for card, _ in _chosen(CATALOG, text)]


def test_a_name_in_a_fenced_code_block_activates_no_skill() -> None:
    assert named("set it up:\n```sh\nexport X=$deploy\n```\n") == []
    assert named("  ~~~\necho $deploy\n~~~~\nthen") == []  # tildes, closed by a longer fence
    assert named("```\necho $db\n``` not a close\n$deploy\n") == []  # unclosed: code to the end
    assert named("```bash\nexport X=$db\n```\nnow use $deploy.") == ["deploy"]  # after the block: text
    assert named("````\n```\n$db\n```\n````\n$deploy") == ["deploy"]  # a shorter fence does not close


def test_a_name_in_inline_code_activates_no_skill() -> None:
    assert named("run `export X=$deploy` first") == []
    assert named("run ``a ` $deploy`` and ```$db```") == []  # spans of 2 and 3 backticks
    assert named("```echo $db``` then $deploy") == ["deploy"]  # (a fence's line with backticks: inline code)
    assert named("a lone `` then $deploy, and `$db` in code") == ["deploy"]  # a run nothing closes is text


def test_a_name_in_plain_text_still_activates() -> None:
    assert named("please $deploy the app, with $db") == ["deploy", "db"]
    assert named("use $deploy.") == ["deploy"]


def test_code_spans_are_found_in_bounded_time() -> None:
    text = " ".join("`" * n for n in range(2, 1500)) + " $deploy `$db`"  # 1.1 MB of runs nothing closes
    started = time.perf_counter()
    assert named(text) == ["deploy"]
    assert time.perf_counter() - started < 1.0


# -- the chat's /compact --keep N -----------------------------------------------------------------


def test_the_chat_compacts_all_but_the_newest_messages(tmp_path: Path) -> None:
    from contextlib import AsyncExitStack

    from rich.console import Console

    from agentloop.cli.chat import ChatRepl, ChatState, DurableSession, PlainReader
    from tests.test_manual_compaction import LONG, Brain, is_summary, kernel

    brain = Brain()
    ev = asyncio.new_event_loop()
    stack = AsyncExitStack()
    err = io.StringIO()
    try:
        k = ev.run_until_complete(stack.enter_async_context(kernel(tmp_path, brain)))
        session = DurableSession(k, owner="me", cwd=tmp_path, state=ChatState(tmp_path / "chat.json"))
        ev.run_until_complete(session.open(new=True))
        lines = "".join(f"part {i}: {LONG}\n" for i in range(3))
        commands = "/compact --keep x\n/compact --keep\n/compact --keep 4 the part numbers\n/help\n"
        reader = PlainReader(io.StringIO(f"{lines}{commands}/exit\n"))
        repl = ChatRepl(session, reader=reader, out=io.StringIO(), err=Console(file=err, width=400))
        assert repl.loop(ev) == 0
        messages = ev.run_until_complete(session.process.messages())
    finally:
        ev.run_until_complete(stack.aclose())
        ev.close()
    shown = err.getvalue()
    assert shown.count("usage: /compact [--keep N] [instructions]") == 2  # nothing done for those
    assert "compacted: 2 messages summarised" in shown  # of 6: the newest 4 kept as they were
    assert "/compact [--keep N] [instructions]" in shown.split("compacted:")[1]  # the /help
    assert len(brain.summaries) == 1 and "the part numbers" in brain.summaries[0].messages[-1].text
    assert is_summary(messages[0]) and [m.role for m in messages[1:]] == ["user", "assistant"] * 2
    assert messages[1].text.startswith("part 1:")


def test_keep_option_reads_the_count_and_the_instructions() -> None:
    from agentloop.cli.chat import _keep_option

    assert _keep_option("") == (None, None) and _keep_option(" keep names ") == (None, "keep names")
    assert _keep_option("--keep 3") == (3, None) and _keep_option("--keep=0 only\tthe gist") == (0, "only\tthe gist")
    assert _keep_option("--keep\t12  names") == (12, "names") and _keep_option("--keeping x") == (None, "--keeping x")
    for bad in ("--keep", "--keep=", "--keep -1", "--keep ３", "--keep 1e3", "--keep=" + "9" * 10):
        assert _keep_option(bad) is None, bad


def test_a_server_chat_asks_the_server_to_keep_the_newest_messages() -> None:
    """``chat --server``: ``/compact --keep N`` reaches the server as ``keep_last``."""
    from rich.console import Console

    from agentloop.cli.chat import ChatRepl, PlainReader
    from agentloop.cli.client import RemoteSession
    from agentloop.client import AgentloopClient

    asked: list[tuple[str | None, int | None]] = []

    class Recording(AgentloopClient):
        async def compact(self, pid: str, instructions: str | None = None, **cut: Any) -> dict[str, Any]:
            asked.append((instructions, cut.get("keep_last")))
            return {"compacted": True, "removed": 2, "tokens_before": 10, "tokens_after": 4, "note": ""}

    ev = asyncio.new_event_loop()
    client = Recording("http://127.0.0.1:9", "token")  # (nothing listens: any other call would fail loudly)
    err = io.StringIO()
    try:
        session = RemoteSession(client)
        session.pid = "p1"
        reader = PlainReader(io.StringIO("/compact --keep 2 names\n/exit\n"))
        repl = ChatRepl(session, reader=reader, out=io.StringIO(), err=Console(file=err, width=400))
        assert repl.loop(ev) == 0
    finally:
        ev.run_until_complete(client.aclose())
        ev.close()
    assert asked == [("names", 2)]
    assert "compacted: 2 messages summarised" in err.getvalue()


# -- the look for a group chat's speakers, in memory ------------------------------------------------


def test_an_in_memory_run_looks_for_speakers_only_in_what_its_history_gained(monkeypatch: Any) -> None:
    """Every model call of an in-memory run looked through the whole history for a group chat's
    messages: a long run's calls cost more as it grew (W3 lost its flatness, 1.43 late/early)."""
    from agentloop.loop import model_call
    from agentloop.loop.state import RunState
    from agentloop.messages import Origin, TextContent, UserMessage, user

    looked: list[int] = []
    real = model_call.names_speaker
    monkeypatch.setattr(model_call, "names_speaker", lambda m: looked.append(1) or real(m))
    state = RunState(run_id="r", messages=[user(f"m{i}") for i in range(100)], first_new=0)
    assert model_call.speakers_named(state) is False and len(looked) == 100
    state.messages += [user("a"), user("b")]
    looked.clear()
    assert model_call.speakers_named(state) is False and len(looked) == 2  # (the two new ones only)
    spoke = Origin(name="Alice", user="telegram:1", chat="group")
    state.messages.append(UserMessage(content=[TextContent(text="hi")], origin=spoke))
    assert model_call.speakers_named(state) is True
    del state.messages[50:]  # (replaced by a compaction: shorter than what was looked at)
    assert model_call.speakers_named(state) is True  # (once found, kept: naming finds nothing, changes no byte)
