"""Memory recall: at a run's start the owner's older memory entries that share the most words with
the run's input (stopwords and words most entries hold do not count; ties to the newer) are put
into the run's prompt as a final ``[recalled memories]`` block, each with its day, within a count
and a byte budget. Decided once per run (every model call, and the run resumed after a restart,
sends the same bytes); nothing recalled leaves the prompt byte-equal."""

from __future__ import annotations

import asyncio
import datetime
import time
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, call, tool
from agentloop.kernel import Kernel
from agentloop.messages import UserMessage, user
from agentloop.models.base import ModelRequest
from agentloop.process import prompt as prompt_module
from agentloop.process.api import CompiledPrompt
from agentloop.process.memory import recall_entries, recall_terms
from agentloop.process.prompt import RECALLED_MEMORIES, PromptSources, assemble_prompt, recall_memories, run_prompt

TODAY = datetime.date(2024, 3, 10)
FACT = "Deploy to staging uses port 8443."
COMPILED = "proc.prompt.compiled"


@tool
def dump(n: int) -> str:
    """Return a short text."""
    return f"chunk {n}"


def entry(body: str, at: str = "10:00", source: str = "the agent") -> str:
    return f"### From {source} ({at})\n\n{body}\n\n"


def day_file(home: Path, day: datetime.date, *bodies: str) -> Path:
    path = home / "memory" / f"{day.isoformat()}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(entry(b, f"{9 + i:02}:00") for i, b in enumerate(bodies)))
    return path


def ago(days: int, today: datetime.date = TODAY) -> datetime.date:
    return today - datetime.timedelta(days=days)


def base(home: Path, today: datetime.date = TODAY) -> CompiledPrompt:
    """The assembled prompt of an owner's home, as the kernel hands it to the engine."""
    assembled = assemble_prompt(PromptSources(owner_home=home), today=today)
    return CompiledPrompt(assembled.text)


def recalled_part(prompt: CompiledPrompt, before: CompiledPrompt) -> str:
    assert prompt.text.startswith(before.text)  # appended at the end: the rest is a shared prefix
    return prompt.text.removeprefix(before.text)


# ------------------------------------------------------------------ the recall itself


def test_an_older_memory_sharing_the_inputs_words_is_recalled_with_its_day(tmp_path: Path) -> None:
    day_file(tmp_path, ago(9), "The user prefers dark mode.", FACT, "Lunch is at noon.")
    day_file(tmp_path, ago(1), "Yesterday we fixed the login page.")  # (in the prompt already)
    before = base(tmp_path)
    prompt = recall_memories(before, "How do I deploy to staging?", tmp_path, today=TODAY)
    text = recalled_part(prompt, before)
    assert text.startswith("\n[recalled memories]\nOlder memories that share words with this run's input")
    assert f"--- 2024-03-01, From the agent (10:00); shares deploy, staging ---\n{FACT}" in text
    assert "dark mode" not in text and "noon" not in text and text.count("---\n") == 1
    (section,) = [s for s in prompt.sections if s.name == RECALLED_MEMORIES]
    assert section.files == ("memory/2024-03-01.md",) and not section.truncated
    assert section.bytes == len(text.strip("\n").encode())


def test_unrelated_input_adds_nothing_and_returns_the_very_prompt(tmp_path: Path) -> None:
    day_file(tmp_path, ago(9), FACT, "The user prefers dark mode.")
    before = base(tmp_path)
    for text in ("hello", "How do I do it?", "what is the weather in Paris", "tell me about staging servers"):
        assert recall_memories(before, text, tmp_path, today=TODAY) is before  # (the last: 1 of 2 words)
    nobody = base(tmp_path / "none")
    assert recall_memories(nobody, FACT, tmp_path / "none", today=TODAY) is nobody


def test_stopwords_and_words_most_entries_hold_do_not_count(tmp_path: Path) -> None:
    assert recall_terms("How do I deploy to the Staging servers? Use it, please!") == ["deploy", "staging", "server"]
    bodies = [f"Project note {i}: the project build {i} passed." for i in range(12)]
    day_file(tmp_path, ago(5), *bodies, "The project deploy goes through staging.")
    days = [(ago(5), (tmp_path / "memory" / f"{ago(5)}.md").read_text())]
    # "project" is in every entry: it counts for none, so only the entry sharing "deploy" is found
    (found,) = recall_entries(days, "project deploy", 5)
    assert found.shared == ("deploy",) and "staging" in found.entry
    # the heading ("From the agent") is not searched, and words match whole (not "important" for "port")
    assert recall_entries([(ago(5), entry("An important agent note."))], "agent port", 5) == []
    (plural,) = recall_entries([(ago(5), entry("It deploys to the server."))], "deploy servers", 5)
    assert plural.shared == ("deploy", "server")
    # a character whose lower case is longer (İ) shifts no entry: each is found whole
    text = entry("İİİİ staging deploy first") + entry("staging deploy second")
    found = recall_entries([(ago(5), text)], "staging deploy", 5)
    assert [r.entry.splitlines()[-1] for r in found] == ["staging deploy second", "İİİİ staging deploy first"]


def test_ranked_by_shared_words_then_newer_first_within_count_and_budget(tmp_path: Path) -> None:
    day_file(tmp_path, ago(30), "staging deploy port: 8443, via the VPN")  # three words
    day_file(tmp_path, ago(20), *[f"staging deploy note {i}" for i in range(4)])  # two words each
    day_file(tmp_path, ago(10), "staging deploy is on Fridays")
    before = base(tmp_path)
    prompt = recall_memories(before, "staging deploy port?", tmp_path, today=TODAY)
    text = recalled_part(prompt, before)
    labels = [line for line in text.splitlines() if line.startswith("--- ")]
    assert len(labels) == prompt_module.RECALL_ENTRIES == 5
    assert labels[0].startswith("--- 2024-02-09, ") and "shares staging, deploy, port" in labels[0]
    assert labels[1].startswith("--- 2024-02-29, ")  # then the newest of those sharing two
    assert [label.split("(")[1][:5] for label in labels[2:]] == ["12:00", "11:00", "10:00"]  # later in a day first
    assert "note 0" not in text  # the sixth: over the count


def test_the_byte_budget_bounds_the_block_and_cuts_only_the_best_entry(tmp_path: Path, monkeypatch: Any) -> None:
    big = "staging deploy steps:\n" + "".join(f"step {i}: do the thing number {i}\n" for i in range(200))
    day_file(tmp_path, ago(9), big)
    day_file(tmp_path, ago(8), "staging deploy needs the VPN.")
    day_file(tmp_path, ago(10), "x" * 10 + " staging deploy " + "y" * 3000)
    before = base(tmp_path)
    prompt = recall_memories(before, "staging deploy", tmp_path, today=TODAY)
    (section,) = [s for s in prompt.sections if s.name == RECALLED_MEMORIES]
    assert section.bytes <= prompt_module.RECALL_BYTES
    text = recalled_part(prompt, before)
    assert "needs the VPN" in text and "step 0" not in text and "yyyy" not in text  # larger ones: left out
    # the best entry alone over the budget: cut, with a note, and the block still within it
    monkeypatch.setattr(prompt_module, "RECALL_BYTES", 600)
    cut = recall_memories(before, "staging deploy steps", tmp_path, today=TODAY)
    (section,) = [s for s in cut.sections if s.name == RECALLED_MEMORIES]
    assert section.truncated and section.bytes <= 600 and section.files == ("memory/2024-03-01.md",)
    assert "step 0:" in cut.text and "step 199" not in cut.text
    assert "[… cut; the memory tool reads 2024-03-01]" in cut.text


def test_entries_the_prompt_shows_are_not_repeated_but_those_it_leaves_out_are(tmp_path: Path) -> None:
    day_file(tmp_path, TODAY, "Staging deploy moved to port 9443 today.")
    day_file(tmp_path, ago(4), FACT, "Staging deploy moved to port 9443 today.")  # (a copy of today's)
    before = base(tmp_path)
    text = recalled_part(recall_memories(before, "staging deploy port", tmp_path, today=TODAY), before)
    assert FACT in text and "9443" not in text
    # yesterday's file over what the prompt shows of a day: its older entries can be recalled
    old = "Staging deploy first used port 7000."
    day_file(tmp_path, ago(1), old, *[f"filler entry {i} " + "z" * 400 for i in range(60)])
    before = base(tmp_path)
    assert old not in before.text and "filler entry 59" in before.text
    text = recalled_part(recall_memories(before, "staging deploy port", tmp_path, today=TODAY), before)
    assert f"--- 2024-03-09, From the agent (09:00); shares staging, deploy, port ---\n{old}" in text


def test_recall_is_bounded_on_ten_thousand_entries(tmp_path: Path, monkeypatch: Any) -> None:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "report"]
    for d in range(100):  # 100 days of 100 entries
        bodies = [" ".join(words[(d * 7 + i * j) % len(words)] for j in range(12)) + f" item{i}" for i in range(100)]
        if d == 50:
            bodies[3] = FACT
        day_file(tmp_path, ago(2 + d), *bodies)
    before = base(tmp_path)
    started = time.perf_counter()
    prompt = recall_memories(before, "how do I deploy to staging? " + " ".join(words), tmp_path, today=TODAY)
    took = time.perf_counter() - started
    assert FACT in prompt.text and took < 2.0, took  # (about 0.15 s here: every entry shares words)
    # only the newest days up to RECALL_SCAN_BYTES are searched
    monkeypatch.setattr(prompt_module, "RECALL_SCAN_BYTES", 20 * 1024)
    assert FACT not in recall_memories(before, "deploy staging", tmp_path, today=TODAY).text


def test_a_damaged_day_is_skipped_with_a_warning(tmp_path: Path) -> None:
    day_file(tmp_path, ago(9), FACT)
    (tmp_path / "memory" / f"{ago(8)}.md").write_bytes(b"\xff\xfe staging deploy")
    before = base(tmp_path)
    prompt = recall_memories(before, "deploy to staging", tmp_path, today=TODAY)
    assert FACT in prompt.text
    assert any(w.startswith("memory/2024-03-02.md: not searched for memories to recall") for w in prompt.warnings)


async def test_run_prompt_recalls_from_the_home_it_is_given_only(tmp_path: Path, monkeypatch: Any) -> None:
    today = datetime.date.today()
    day_file(tmp_path, ago(9, today), FACT)
    before = CompiledPrompt("Base.\n")
    history = [user("How do I deploy to staging?")]
    recalled = await run_prompt(before, history, tmp_path)
    assert FACT in recalled.text and f"--- {ago(9, today).isoformat()}, " in recalled.text
    assert await run_prompt(before, history, None) is before  # no home (memory off): nothing to recall from
    monkeypatch.setattr(prompt_module, "RECALL_ENTRIES", 0)  # the off switch
    assert await run_prompt(before, history, tmp_path) is before
    monkeypatch.setattr(prompt_module, "RECALL_ENTRIES", 5)

    async def no_thread(*args: Any) -> Any:
        raise AssertionError("no memory folder: nothing to search")

    monkeypatch.setattr(prompt_module.asyncio, "to_thread", no_thread)
    assert await run_prompt(before, history, tmp_path / "nobody") is before


# ------------------------------------------------------------------ in durable runs


def recorder(prompts: list[str]) -> ScriptedModel:
    """Records each call's system prompt; a run's first call asks for a tool (two calls a run)."""

    def brain(r: ModelRequest) -> Reply | str:
        prompts.append(r.system_prompt)
        return Reply(tool_calls=[call("dump", n=1)]) if isinstance(r.messages[-1], UserMessage) else "done"

    return ScriptedModel(brain)


async def test_a_run_recalls_once_for_all_its_calls_and_a_plain_run_is_byte_equal(tmp_path: Path) -> None:
    today = datetime.date.today()
    old = ago(12, today)
    day_file(tmp_path / "home" / "alice", old, "The user likes short answers.", FACT)
    prompts: list[str] = []
    url = f"sqlite:///{tmp_path}/a.db"
    async with Kernel.open(url, model=recorder(prompts), workspace=tmp_path, tools=[dump]) as k:
        proc = await k.spawn(owner="alice")
        record = (await k.engine.live(proc.pid)).record
        assert k.engine.prompt is not None
        built = await k.engine.prompt(record, k.engine.config.tools)
        assert isinstance(built, CompiledPrompt)
        await proc.send("How do I deploy to staging?")
        await proc.wait_idle()
        await proc.send("Thanks, what's the weather like?")
        await proc.wait_idle()
        logged = [s.payload async for s in proc.signals(follow=False) if s.signal == COMPILED]
    assert len(prompts) == 4
    assert prompts[0] == prompts[1] and prompts[0].startswith(built.text)  # byte-stable across the run
    label = f"--- {old.isoformat()}, From the agent (10:00); shares deploy, staging ---"
    assert prompts[0].endswith(f"{label}\n{FACT}\n")
    assert prompts[2] == prompts[3] == built.text  # nothing recalled: the prompt as it was
    sections = {s["name"]: s for s in logged[0]["sections"]}
    assert list(sections)[-1] == RECALLED_MEMORIES and sections[RECALLED_MEMORIES]["files"] == [f"memory/{old}.md"]
    assert RECALLED_MEMORIES not in [s["name"] for s in logged[1]["sections"]]
    prompts.clear()  # Kernel.open(daily_memory=False): no memory tool, no recall
    async with Kernel.open(url, model=recorder(prompts), workspace=tmp_path, tools=[dump], daily_memory=False) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("How do I deploy to staging?")
        await proc.wait_idle()
    assert FACT not in prompts[0]


async def test_a_run_resumed_after_a_restart_keeps_its_recalled_memories(tmp_path: Path) -> None:
    home = tmp_path / "home" / "alice"
    old = ago(12, datetime.date.today())
    day_file(home, old, FACT)

    @tool
    async def slow(seconds: float) -> str:
        """Sleep."""
        await asyncio.sleep(seconds)
        return "slept"

    prompts: list[str] = []

    def brain(r: ModelRequest) -> Reply | str:
        prompts.append(r.system_prompt)
        return Reply(tool_calls=[call("slow", seconds=30)]) if len(prompts) == 1 else "done"

    url = f"sqlite:///{tmp_path}/a.db"
    async with Kernel.open(url, model=ScriptedModel(brain), workspace=tmp_path, tools=[slow]) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("How do I deploy to staging?")
        for _ in range(500):  # the slow call is registered (the step, and the prompt, committed)
            if await k.engine.store.calls(proc.pid):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
    # the memory changes meanwhile: a recall made anew would differ
    day_file(home, old, "Deploy to staging now uses port 9999.")
    async with Kernel.open(url, model=ScriptedModel(brain), workspace=tmp_path, tools=[slow]) as k:
        proc = await k.process(proc.pid)
        await asyncio.wait_for(proc.wait_idle(), 10)
    assert len(prompts) == 2 and prompts[1] == prompts[0]
    assert FACT in prompts[1] and "9999" not in prompts[1]


@pytest.mark.parametrize("text", ["", "   ", "the and of"])
def test_an_input_without_words_to_look_for_recalls_nothing(tmp_path: Path, text: str) -> None:
    day_file(tmp_path, ago(9), FACT)
    before = base(tmp_path)
    assert recall_memories(before, text, tmp_path, today=TODAY) is before
