"""Skills activated for a run: a ``$name`` in the user's message, or a path it mentions that a
skill's ``paths:`` globs match, puts that skill's body into the run's system prompt as an
``[active skills]`` block after everything else, decided once at the run's start (every model
call of the run sends the same bytes, and a run resumed after a restart keeps them)."""

from __future__ import annotations

import asyncio
import datetime
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, call, tool
from agentloop.kernel import Kernel
from agentloop.messages import AssistantMessage, TextContent, UserMessage, user
from agentloop.models.base import ModelRequest
from agentloop.process.api import CompiledPrompt
from agentloop.process.prompt import ACTIVE_SKILLS, PromptSources, activate_skills, assemble_prompt, run_input
from agentloop.tools.skills import SkillCard

COMPILED = "proc.prompt.compiled"
DEPLOY_BODY = "Run make ship, then tag the release."
LINT_BODY = "Run ruff on every file you touch."


@tool
def dump(n: int) -> str:
    """Return a short text."""
    return f"chunk {n}"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def skills(data: Path) -> Path:
    """A data directory with three skills (one that cannot work here) and a workspace."""
    layer = data / "config" / "ai" / "skills.d"
    write(layer / "deploy" / "SKILL.md", f"---\nname: deploy\ndescription: How to ship.\n---\n{DEPLOY_BODY}\n")
    lint = f"---\ndescription: Lint Python.\npaths:\n  - src/**/*.py\n  - '*.pyi'\n---\n{LINT_BODY}\n"
    write(layer / "lint.md", lint)
    write(layer / "gone" / "SKILL.md", "---\ndescription: Needs a program.\nrequires-bins: no-such-program-x\n---\nG\n")
    work = data / "work"
    work.mkdir()
    return work


def recorder(prompts: list[str], calls_first: bool = True) -> ScriptedModel:
    """A model that records each call's system prompt; a run's first call asks for a tool, so
    each run makes two model calls."""

    def brain(r: ModelRequest) -> Reply | str:
        prompts.append(r.system_prompt)
        first = isinstance(r.messages[-1], UserMessage)
        return Reply(tool_calls=[call("dump", n=1)]) if first and calls_first else "done"

    return ScriptedModel(brain)


def kernel(data: Path, model: ScriptedModel, **kw: Any) -> Any:
    return Kernel.open(f"sqlite:///{data}/a.db", model=model, workspace=data, tools=[dump], **kw)


async def manifests(proc: Any) -> list[dict[str, Any]]:
    return [s.payload async for s in proc.signals(follow=False) if s.signal == COMPILED]


async def test_a_named_skill_is_in_every_model_call_of_its_run_only(tmp_path: Path) -> None:
    work = skills(tmp_path)
    prompts: list[str] = []
    async with kernel(tmp_path, recorder(prompts)) as k:
        proc = await k.spawn(owner="alice", cwd=work)
        await proc.send("Ship it: use $deploy.")
        await proc.wait_idle()
        await proc.send("thanks")
        await proc.wait_idle()
        logged = await manifests(proc)
    assert len(prompts) == 4
    named, plain = prompts[:2], prompts[2:]
    assert named[0] == named[1]  # byte-stable across the run's model calls
    assert named[0].count(DEPLOY_BODY) == 1 and "[active skills]" in named[0]
    assert named[0].index("[skills]") < named[0].index("--- deploy (named as $deploy) ---")
    assert named[0].startswith(plain[0])  # appended at the end: the rest is a shared prefix
    assert DEPLOY_BODY not in plain[0] and plain[0] == plain[1]  # the next run does not inherit it
    sections = {s["name"]: s for s in logged[0]["sections"]}
    assert list(sections)[-1] == ACTIVE_SKILLS
    assert sections[ACTIVE_SKILLS]["files"] == ["skills.d/deploy"]
    assert sections[ACTIVE_SKILLS]["truncated"] is False
    assert ACTIVE_SKILLS not in [s["name"] for s in logged[1]["sections"]]


async def test_no_reference_or_an_unknown_one_leaves_the_prompt_byte_equal(tmp_path: Path) -> None:
    work = skills(tmp_path)
    prompts: list[str] = []
    async with kernel(tmp_path, recorder(prompts, calls_first=False)) as k:
        proc = await k.spawn(owner="alice", cwd=work)
        record = (await k.engine.live(proc.pid)).record
        assert k.engine.prompt is not None
        built = await k.engine.prompt(record, k.engine.config.tools)
        assert isinstance(built, CompiledPrompt) and built.skills is not None
        for text in ("hi", "use $nope and $gone", "costs US$5 or $$deploy", "see docs/readme.md"):
            await proc.send(text)
            await proc.wait_idle()
        logged = await manifests(proc)
    assert prompts == [built.text] * 4
    assert all(ACTIVE_SKILLS not in [s["name"] for s in m["sections"]] for m in logged)


async def test_a_mentioned_path_activates_the_skill_whose_paths_match(tmp_path: Path) -> None:
    work = skills(tmp_path)
    prompts: list[str] = []
    async with kernel(tmp_path, recorder(prompts, calls_first=False)) as k:
        proc = await k.spawn(owner="alice", cwd=work)
        await proc.send("Fix the bug in `src/app/main.py`, then $deploy")
        await proc.wait_idle()
        logged = await manifests(proc)
    (prompt,) = prompts
    assert prompt.index(DEPLOY_BODY) < prompt.index(LINT_BODY)  # named first, then by path
    assert "--- lint (src/app/main.py matches its paths) ---" in prompt
    sections = {s["name"]: s for s in logged[0]["sections"]}
    assert sections[ACTIVE_SKILLS]["files"] == ["skills.d/deploy", "skills.d/lint.md"]


async def test_a_run_resumed_after_a_restart_keeps_its_activated_skill(tmp_path: Path) -> None:
    work = skills(tmp_path)

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
        proc = await k.spawn(owner="alice", cwd=work)
        await proc.send("$deploy please")
        for _ in range(500):  # the slow call is registered (the step, and the prompt, committed)
            if await k.engine.store.calls(proc.pid):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
    # the skill changes meanwhile: a prompt built anew would differ
    write(tmp_path / "config" / "ai" / "skills.d" / "deploy" / "SKILL.md", "---\ndescription: x\n---\nNEW BODY\n")
    async with Kernel.open(url, model=ScriptedModel(brain), workspace=tmp_path, tools=[slow]) as k:
        proc = await k.process(proc.pid)
        await asyncio.wait_for(proc.wait_idle(), 10)
    assert len(prompts) == 2 and prompts[1] == prompts[0]
    assert DEPLOY_BODY in prompts[1] and "NEW BODY" not in prompts[1]


# ------------------------------------------------------------------ the activation itself


def catalogued(tmp_path: Path, budget: int) -> CompiledPrompt:
    """The assembled prompt of a layer with ``big`` (300 bytes) and ``small``, as the kernel hands
    it to the engine: with its skill catalogue and ``budget``."""
    layer = tmp_path / "skills.d"
    write(layer / "big" / "SKILL.md", "---\ndescription: Big.\n---\n" + "".join(f"line {i:03}\n" for i in range(34)))
    write(layer / "small.md", "---\ndescription: Small.\n---\nSMALL BODY\n")
    assembled = assemble_prompt(
        PromptSources(skills_dirs=[layer], max_context_bytes=budget), today=datetime.date(2024, 1, 2)
    )
    return CompiledPrompt(assembled.text, skills=assembled.catalog())


def test_bodies_past_the_budget_are_cut_with_a_note_and_later_ones_named(tmp_path: Path) -> None:
    prompt = catalogued(tmp_path, budget=100)
    active = activate_skills(prompt, [user("$big and $small")])
    text = active.text.removeprefix(prompt.text)
    assert "line 000" in text and "line 033" not in text
    assert "[… big truncated: " in text and "of 305 bytes shown; the skills tool reads it whole" in text
    assert "SMALL BODY" not in text and "over the 100-byte context budget: small" in text
    (section,) = [s for s in active.sections if s.name == ACTIVE_SKILLS]
    assert section.truncated and section.files == ("big",) and section.omitted == ("small",)
    assert section.bytes == len(text.strip("\n").encode())  # (the block, without the line breaks around it)
    assert any("truncated to fit max_context_bytes=100" in w for w in active.warnings)
    whole = activate_skills(catalogued(tmp_path / "more", budget=4096), [user("$big and $small")])
    assert "line 033" in whole.text and "SMALL BODY" in whole.text and "truncated" not in whole.text


def test_nothing_to_activate_returns_the_very_prompt(tmp_path: Path) -> None:
    prompt = catalogued(tmp_path, budget=4096)
    for history in ([], [user("hello")], [user("$unknown"), user("a$big")]):
        assert activate_skills(prompt, history) is prompt
    plain = CompiledPrompt("Custom prompt.")  # a prompt function's text: no catalogue
    assert activate_skills(plain, [user("$big")]) is plain


def test_the_runs_input_is_what_follows_the_models_last_turn() -> None:
    answered = AssistantMessage(content=[TextContent(text="ok")])
    assert run_input([user("$old"), answered, user("first"), user("second")]) == "first\nsecond"
    assert run_input([user("$old"), answered]) == ""


@pytest.mark.parametrize(
    ("globs", "path", "hit"),
    [
        (("src/**/*.py",), "src/a.py", True),  # ``**`` may match no directory
        (("src/**/*.py",), "src/x/y/a.py", True),
        (("src/**/*.py",), "lib/src/a.py", False),  # a relative path is anchored
        (("src/**/*.py",), "/srv/app/src/a.py", True),  # an absolute one is matched along its length
        (("src/**/*.py",), "./src/a.py", True),
        (("*.py",), "deep/in/a.py", True),  # no ``/``: the file's name, anywhere
        (("*.py",), "a.pyc", False),
        (("src/*.py",), "src/x/a.py", False),  # ``*`` does not cross a directory
        (("*.[ch]",), "lib/x.h", True),
        (("docs/",), "docs/guide/intro.md", True),
        (("docs/",), "src/docs.md", False),
    ],
)
def test_paths_globs(tmp_path: Path, globs: tuple[str, ...], path: str, hit: bool) -> None:
    assert SkillCard("s", "s", globs, tmp_path, False).matches(path) is hit


def test_paths_front_matter_forms(tmp_path: Path) -> None:
    layer = tmp_path / "skills.d"
    write(layer / "a.md", "---\npaths: src/**/*.py, '*.[ch]'\n---\nA\n")
    write(layer / "b.md", "---\npaths: [docs/*.md, tests/]\n---\nB\n")
    write(layer / "c.md", "---\npaths:\n  - \"web/**\"\n  - '*.sql'\n---\nC\n")
    assembled = assemble_prompt(PromptSources(skills_dirs=[layer]), today=datetime.date(2024, 1, 2))
    catalog = assembled.catalog()
    assert catalog is not None
    assert {c.name: c.globs for c in catalog.cards} == {
        "a": ("src/**/*.py", "*.[ch]"),
        "b": ("docs/*.md", "tests/"),
        "c": ("web/**", "*.sql"),
    }
