"""Durable runs and their context: the assembled prompt, threshold compaction inside a run,
and one compact-and-retry after a provider overflow."""

from __future__ import annotations

import asyncio
import datetime
import gzip
import json
import os
from pathlib import Path

import pytest

from agentloop import Block, Hooks, Reply, ScriptedModel, SystemMessage, ToolResultMessage, TurnInfo, call, tool
from agentloop.kernel import Kernel
from agentloop.messages import AssistantMessage, UserMessage
from agentloop.models.base import ModelInfo, ModelRequest, ProviderError
from agentloop.process.compaction import MEMORY_SYSTEM_PROMPT, SUMMARY_SYSTEM_PROMPT, estimate_tokens


@tool
def dump(n: int) -> str:
    """Return a long text."""
    return f"chunk {n}: " + "lorem ipsum dolor sit amet " * 60


def kernel(tmp_path: Path, model, **kw):
    kw.setdefault(
        "clear_tool_outputs", False
    )  # (the summary's tests: tests/test_compaction_clearing.py has the first tier)
    return Kernel.open(f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[dump], **kw)


async def test_each_run_gets_an_assembled_prompt_built_once(tmp_path):
    context = tmp_path / "config" / "ai" / "context.d"
    context.mkdir(parents=True)
    (context / "00-identity.md").write_text("You are {{identity}}, working in {{cwd}}.")
    work = tmp_path / "work"
    work.mkdir()
    (work / "AGENTS.md").write_text("Always answer in French.")
    seen: list[str] = []

    def brain(r: ModelRequest):
        seen.append(r.system_prompt)
        if isinstance(r.messages[-1], UserMessage):
            (work / "AGENTS.md").write_text("Now answer in German.")  # changes only the next run
            return Reply(tool_calls=[call("dump", n=1)])
        return "fini"

    async with kernel(tmp_path, ScriptedModel(brain), system_prompt="Base rules.") as k:
        proc = await k.spawn(owner="alice", cwd=work, context="Project: inventory.")
        await proc.send("hi")
        await proc.wait_idle()
        assert seen[0] == seen[1]  # built once per run
        assert seen[0].startswith("Base rules.") and "You are alice, working in " + str(work) in seen[0]
        assert "Always answer in French." in seen[0] and "Project: inventory." in seen[0]
        await proc.send("again")
        await proc.wait_idle()
        assert "Now answer in German." in seen[2]


def compacting_brain(rounds: int, summary: str = "Summary: the user wanted chunks; chunks 0.. were produced."):
    def brain(r: ModelRequest):
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return summary
        done = sum(isinstance(m, ToolResultMessage) for m in r.messages)
        summaries = [m for m in r.messages if isinstance(m, SystemMessage) and m.kind == "summary"]
        used = estimate_tokens(r.messages)  # report usage like a real provider would
        if done + 10 * len(summaries) >= rounds:
            return Reply(text="all chunks done", input_tokens=used)
        return Reply(tool_calls=[call("dump", n=done)], input_tokens=used)

    return brain


async def test_threshold_compaction_happens_between_turns_of_one_run(tmp_path):
    model = ScriptedModel(
        compacting_brain(12), info=ModelInfo(provider="scripted", id="small", context_window=3000, max_output=200)
    )
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice")
        receipt = await proc.send("produce chunks")
        await proc.wait_idle()
        signals = [s async for s in proc.signals(follow=False)]
        compacted = [s for s in signals if s.signal == "proc.compacted"]
        finished = [s for s in signals if s.signal == "proc.run.finished"]
        assert compacted and len(finished) == 1  # compacted inside the single run, which still finished
        event = compacted[0].payload
        assert event["reason"] == "threshold" and event["runId"] == receipt.run_id and event["removed"] >= 2
        assert event["tokensAfter"] < event["tokensBefore"]
        msgs = await proc.messages()
        assert isinstance(msgs[0], SystemMessage) and msgs[0].kind == "summary"
        assert msgs[-1].text == "all chunks done"
        for i, m in enumerate(msgs):  # never a tool call without its result, nor a result without its call
            if isinstance(m, ToolResultMessage):
                assert isinstance(msgs[i - 1], AssistantMessage | ToolResultMessage)
        archive = tmp_path / event["archive"]
        lines = gzip.decompress(archive.read_bytes()).decode().splitlines()
        assert json.loads(lines[0])["count"] == event["removed"]  # archived before it was replaced
        assert json.loads(lines[1])["role"] == "user"
        segments = await k.store.segments(proc.pid)
        assert segments and segments[0].archive_path == event["archive"]


SMALL = ModelInfo(provider="scripted", id="small", context_window=3000, max_output=200)
REMEMBERING = "Summary: chunks were produced.\n<memories>\n- The user measures in metric units.\n</memories>"


async def test_a_compactions_memories_go_to_the_days_memory_file_and_into_later_prompts(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    model = ScriptedModel(compacting_brain(12, REMEMBERING), info=SMALL)
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice", cwd=work)
        await proc.send("produce chunks")
        await proc.wait_idle()
        compacted = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.compacted"]
        name = f"memory/{datetime.date.today().isoformat()}.md"
        assert compacted and all(event["memory"] == name for event in compacted)
        text = (tmp_path / "home" / "alice" / name).read_text()  # the owner's, not the workspace's
        assert text.startswith("### From context compaction (") and text.count("metric units") == len(compacted)
        summary = (await proc.messages())[0]
        assert summary.text.startswith("Summary of the earlier") and "<memories>" not in summary.text
        await proc.send("what units?")
        await proc.wait_idle()
    last_prompt = model.requests[-1].system_prompt
    assert "The user measures in metric units." in last_prompt  # read back as today's memory


@pytest.mark.parametrize("how", ["folder-link", "file-link", "hard-link", "disabled"])
async def test_memories_are_not_written_through_a_link_out_of_the_home_nor_when_disabled(tmp_path, how, caplog):
    work, outside, home = tmp_path / "work", tmp_path / "outside", tmp_path / "home" / "alice"
    work.mkdir()
    outside.mkdir()
    home.mkdir(parents=True)
    today = f"{datetime.date.today().isoformat()}.md"
    if how == "folder-link":
        (home / "memory").symlink_to(outside)
    elif how in ("file-link", "hard-link"):
        (home / "memory").mkdir()
        (outside / "bashrc").write_text("# keep me\n")
        if how == "file-link":
            (home / "memory" / today).symlink_to(outside / "bashrc")
        else:
            os.link(outside / "bashrc", home / "memory" / today)
    model = ScriptedModel(compacting_brain(12, REMEMBERING), info=SMALL)
    async with kernel(tmp_path, model, daily_memory=how != "disabled") as k:
        proc = await k.spawn(owner="alice", cwd=work)
        await proc.send("produce chunks")
        await proc.wait_idle()
        compacted = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.compacted"]
        messages = await proc.messages()
    assert compacted and all(event["memory"] is None for event in compacted)  # compacted all the same
    assert isinstance(messages[0], SystemMessage) and messages[0].kind == "summary"
    assert [p.read_text() for p in outside.iterdir()] in ([], ["# keep me\n"])  # nothing written outside
    if how == "disabled":
        assert not (home / "memory").exists() and not (work / "memory").exists()
    else:
        assert "memories were not kept" in caplog.text


@pytest.mark.parametrize("block", [False, True])
async def test_pre_compaction_hooks_see_the_history_first_and_may_skip_it(tmp_path, block):
    hooks = Hooks()
    seen: list[int] = []

    @hooks.on("pre_compaction")
    def before(info: TurnInfo) -> Block | None:
        seen.append(len(info.messages))
        return Block("not now") if block else None

    model = ScriptedModel(
        compacting_brain(12), info=ModelInfo(provider="scripted", id="small", context_window=3000, max_output=200)
    )
    async with kernel(tmp_path, model, hooks=hooks) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("produce chunks")
        await proc.wait_idle()
        compacted = [s async for s in proc.signals(follow=False) if s.signal == "proc.compacted"]
    assert seen and seen[0] >= 4
    assert (compacted == []) is block


async def test_provider_overflow_triggers_one_compact_and_retry(tmp_path):
    calls = {"n": 0}

    def brain(r: ModelRequest):
        if r.system_prompt == SUMMARY_SYSTEM_PROMPT:
            return "Summary of the earlier talk."
        calls["n"] += 1
        if calls["n"] == 4:
            raise ProviderError("prompt is too long: 9000 tokens > 8192 maximum", kind="overflow")
        if isinstance(r.messages[-1], UserMessage) and calls["n"] < 4:
            return Reply(tool_calls=[call("dump", n=calls["n"])])
        return "answer " + str(calls["n"])

    async with kernel(tmp_path, ScriptedModel(brain)) as k:
        proc = await k.spawn(owner="alice")
        for text in ("one", "two"):
            await proc.send(text)
            await proc.wait_idle()
        await proc.send("three: this call overflows")
        await proc.wait_idle()
        signals = [s async for s in proc.signals(follow=False)]
        reasons = [s.payload["reason"] for s in signals if s.signal == "proc.compacted"]
        assert reasons == ["overflow"]
        assert signals[-1].payload["status"] == "ok"
        assert (await proc.messages())[-1].text.startswith("answer ")  # the retried call answered


async def test_skills_are_indexed_in_the_prompt_and_read_with_the_skills_tool(tmp_path):
    skill = tmp_path / "config" / "ai" / "skills.d" / "deploy"
    skill.mkdir(parents=True)
    (skill / "SKILL.md").write_text("---\nname: deploy\ndescription: How to ship a release.\n---\nRun make ship.")
    model = ScriptedModel([Reply(tool_calls=[call("skills", action="show", name="deploy")]), "ok"])
    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[]) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("how do we deploy?")
        await proc.wait_idle()
        first = model.requests[0]
        assert "deploy" in first.system_prompt and "How to ship a release." in first.system_prompt
        assert "Run make ship." not in first.system_prompt  # bodies are read on demand
        result = next(m for m in await proc.messages() if isinstance(m, ToolResultMessage))
        assert "Run make ship." in result.text


async def test_the_kernel_sets_the_accounts_context_budget(tmp_path):
    home = tmp_path / "home" / "alice" / "context.d"
    home.mkdir(parents=True)
    (home / "1.md").write_text("A" * 100)
    (home / "2.md").write_text("B" * 100)
    prompts = []
    for budget in (150, 1000):
        model = ScriptedModel(["ok"])
        db = f"sqlite:///{tmp_path}/{budget}.db"
        async with Kernel.open(
            db, model=model, workspace=tmp_path, tools=[], data_dir=tmp_path, context_bytes=budget
        ) as k:
            proc = await k.spawn(owner="alice")
            await proc.send("hi")
            await proc.wait_idle()
        prompts.append(model.requests[0].system_prompt)
    small, large = prompts
    assert "A" * 100 in small and "B" * 100 not in small and "2.md truncated" in small
    assert "A" * 100 in large and "B" * 100 in large
    with pytest.raises(ValueError, match="context_bytes must be a non-negative integer"):
        async with Kernel.open(f"sqlite:///{tmp_path}/bad.db", context_bytes=-1):
            pass


async def test_an_accounts_own_skills_join_the_systems_and_win_by_name(tmp_path):
    def skill(layer: str, name: str, description: str, body: str) -> None:
        folder = tmp_path / layer / name
        folder.mkdir(parents=True)
        (folder / "SKILL.md").write_text(f"---\nname: {name}\ndescription: {description}\n---\n{body}")

    skill("config/ai/skills.d", "deploy", "Ship a release.", "Run make ship.")
    skill("config/ai/skills.d", "review", "Review a change.", "Read the diff.")
    skill("home/alice/skills.d", "deploy", "Ship the way alice does.", "Run alice-ship.")
    show = Reply(tool_calls=[call("skills", action="show", name="deploy")])
    model = ScriptedModel([show, "alice ok", show, "bob ok"])
    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[]) as k:
        shown = {}
        for owner in ("alice", "bob"):
            proc = await k.spawn(owner=owner)
            await proc.send("how do we deploy?")
            await proc.wait_idle()
            shown[owner] = next(m for m in await proc.messages() if isinstance(m, ToolResultMessage)).text
    alice_prompt, bob_prompt = model.requests[0].system_prompt, model.requests[2].system_prompt
    assert "Ship the way alice does." in alice_prompt and "Review a change." in alice_prompt
    assert "Ship a release." not in alice_prompt  # the account's skill of the same name wins
    assert "Ship a release." in bob_prompt and "alice" not in bob_prompt
    assert "Run alice-ship." in shown["alice"] and "Run make ship." in shown["bob"]


async def test_a_skills_directory_made_after_start_brings_the_skills_tool_with_its_index(tmp_path):
    model = ScriptedModel(["no skills yet", Reply(tool_calls=[call("skills", action="list")]), "ok"])
    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[]) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("anything to know?")
        await proc.wait_idle()
        assert [t.name for t in model.requests[0].tools] == ["memory"]  # (the owner's memory: always there)
        skill = tmp_path / "config" / "ai" / "skills.d" / "deploy"
        skill.mkdir(parents=True)
        (skill / "SKILL.md").write_text("---\nname: deploy\ndescription: How to ship a release.\n---\nRun make ship.")
        await proc.send("and now?")
        await proc.wait_idle()
        second = model.requests[1]
        assert [t.name for t in second.tools] == ["memory", "skills"]
        assert "How to ship a release." in second.system_prompt
        result = next(m for m in await proc.messages() if isinstance(m, ToolResultMessage))
        assert "deploy" in result.text and not result.is_error


async def test_model_retries_and_a_fallback_switch_are_logged_before_the_answer(tmp_path):
    """``proc.run.retrying`` is in the signal log (not only shown live): a run that took long
    says why to whoever reads it later."""
    from agentloop import RetryPolicy

    primary = ScriptedModel([ProviderError("overloaded", kind="rate_limit")] * 2)
    backup = ScriptedModel(["fine"], info=ModelInfo(provider="scripted", id="backup"))
    retry = RetryPolicy(max_retries=1, base_delay=0.001)
    async with kernel(tmp_path, primary, fallbacks=[backup], retry=retry) as k:
        proc = await k.spawn(owner="alice")
        receipt = await proc.send("hi")
        await proc.wait_idle()
        signals = [s async for s in proc.signals(follow=False)]
        answer = (await proc.messages())[-1].text
    names = [s.signal for s in signals]
    retrying = [s.payload for s in signals if s.signal == "proc.run.retrying"]
    assert [(r["attempt"], r["model"], r["fallback"]) for r in retrying] == [
        (1, "scripted:scripted", False),
        (0, "scripted:backup", True),
    ]
    assert all(r["runId"] == receipt.run_id and "overloaded" in r["reason"] for r in retrying)
    assert retrying[0]["delay"] > 0
    assert names.index("proc.run.retrying") < names.index("proc.run.output") < names.index("proc.run.finished")
    assert signals[-1].payload["status"] == "ok" and answer == "fine"


def remembering_brain(r: ModelRequest):
    if r.system_prompt == MEMORY_SYSTEM_PROMPT:
        assert "my cat is called Miso" in r.messages[0].text  # shown the conversation being cleared
        return "<memories>\n- The user's cat is called Miso.\n</memories>"
    return "noted"


async def test_a_reset_keeps_the_conversations_memories_in_the_daily_file(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    model = ScriptedModel(remembering_brain)
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice", cwd=work)
        await proc.send("my cat is called Miso")
        await proc.wait_idle()
        await proc.reset()  # returns at once: the memories are written in the background
    # closing the kernel let the background work finish
    text = (tmp_path / "home" / "alice" / f"memory/{datetime.date.today().isoformat()}.md").read_text()
    assert "- The user's cat is called Miso." in text
    assert sum(r.system_prompt == MEMORY_SYSTEM_PROMPT for r in model.requests) == 1


async def test_one_accounts_memories_never_reach_another_accounts_prompt(tmp_path):
    """A review: a reset wrote alice's memories into the shared workspace, and bob's processes
    there read them into their system prompt."""
    model = ScriptedModel(remembering_brain)
    async with kernel(tmp_path, model) as k:
        alice = await k.spawn(owner="alice")
        await alice.send("my cat is called Miso")
        await alice.wait_idle()
        await alice.reset()
    async with kernel(tmp_path, model) as k:
        for owner in ("alice", "bob"):
            proc = await k.spawn(owner=owner)
            await proc.send("hello")
            await proc.wait_idle()
    alice_prompt, bob_prompt = (r.system_prompt for r in model.requests[-2:])
    assert "Miso" in alice_prompt and "Miso" not in bob_prompt
    assert not (tmp_path / "memory").exists()  # nothing of it in the shared workspace


@pytest.mark.parametrize("how", ["disabled", "model-fails"])
async def test_a_reset_without_memories_still_resets(tmp_path, how, caplog):
    work = tmp_path / "work"
    work.mkdir()

    def brain(r: ModelRequest):
        if r.system_prompt == MEMORY_SYSTEM_PROMPT:
            raise ProviderError("the memory call broke", kind="server")
        return "noted"

    model = ScriptedModel(brain)
    async with kernel(tmp_path, model, daily_memory=how != "disabled") as k:
        proc = await k.spawn(owner="alice", cwd=work)
        await proc.send("my cat is called Miso")
        await proc.wait_idle()
        await proc.reset()
        assert await proc.messages() == []
    assert not (work / "memory").exists()
    asked = sum(r.system_prompt == MEMORY_SYSTEM_PROMPT for r in model.requests)
    if how == "disabled":
        assert asked == 0
    else:
        assert asked >= 1 and "memories of the reset conversation were not kept" in caplog.text


async def test_a_retry_that_cannot_be_logged_does_not_end_the_run(tmp_path, monkeypatch, caplog):
    from agentloop import RetryPolicy
    from agentloop.process import driver
    from agentloop.process.store import StoreError

    async def broken(*args: object) -> None:
        raise StoreError("database is locked")

    monkeypatch.setattr(driver, "_log_retry", broken)
    model = ScriptedModel([ProviderError("overloaded", kind="rate_limit"), "fine after all"])
    async with kernel(tmp_path, model, retry=RetryPolicy(max_retries=1, base_delay=0.001)) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("hi")
        await proc.wait_idle()
        finished = [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.run.finished"]
        assert finished[-1]["status"] == "ok" and (await proc.messages())[-1].text == "fine after all"
    assert "the retry of run" in caplog.text and "database is locked" in caplog.text


async def test_a_run_resumed_after_a_restart_keeps_the_prompt_it_began_with(tmp_path: Path) -> None:
    """The prompt is built once per run and kept with it: a run cut off by a restart carries on
    with the instructions it began with, though AGENTS.md changed meanwhile; the next run reads
    the new file."""

    @tool
    async def slow(seconds: float) -> str:
        """Sleep."""
        await asyncio.sleep(seconds)
        return "slept"

    prompts: list[str] = []

    def brain(r: ModelRequest) -> Reply | str:
        prompts.append(r.system_prompt)
        return Reply(tool_calls=[call("slow", seconds=30)]) if len(prompts) == 1 else "done"

    work = tmp_path / "work"
    work.mkdir()
    (work / "AGENTS.md").write_text("Rule A.")
    url = f"sqlite:///{tmp_path}/a.db"
    async with Kernel.open(url, model=ScriptedModel(brain), workspace=tmp_path, tools=[slow]) as k:
        proc = await k.spawn(owner="alice", cwd=work)
        await proc.send("go")
        while len(prompts) < 1:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # the slow call is in flight when the kernel goes down
    (work / "AGENTS.md").write_text("Rule B.")
    async with Kernel.open(url, model=ScriptedModel(brain), workspace=tmp_path, tools=[slow]) as k:
        proc = await k.process(proc.pid)
        await asyncio.wait_for(proc.wait_idle(), 10)
        assert len(prompts) == 2 and prompts[1] == prompts[0] and "Rule A." in prompts[1]
        await proc.send("again")
        await proc.wait_idle()
        assert "Rule B." in prompts[2]
