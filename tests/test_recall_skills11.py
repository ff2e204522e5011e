"""Two limits of a run's prompt, lifted.

Recall: a run's ``[recalled memories]`` come from its owner's home as the kernel knows it, not
from the run's ``memory`` tool, so a tool scope hiding that tool, or an application's own tool
named ``memory``, no longer turns recall off; the kernel's ``daily_memory=False`` does.

Skills: a run's input may be several user messages; each is judged on its own, so a code fence
one of them leaves open hides no ``$name`` in a later one (and still hides those after it in its
own message)."""

from __future__ import annotations

import datetime
from pathlib import Path

from agentloop import ScriptedModel, tool
from agentloop.kernel.memory_tool import memory_tool
from agentloop.messages import user
from agentloop.models.base import ModelRequest
from agentloop.process.api import CompiledPrompt
from agentloop.process.prompt import ACTIVE_SKILLS, RECALLED_MEMORIES, PromptSources, activate_skills, assemble_prompt
from tests.process_support import echo, kernel

FACT = "Deploy to staging uses port 8443."
QUESTION = "How do I deploy to staging?"
DEPLOY_BODY = "Run make ship, then tag the release."
LINT_BODY = "Run ruff on every file you touch."


def old_memory(data: Path, owner: str = "alice") -> None:
    """An entry twelve days old in ``owner``'s memory (older than the prompt's daily sections)."""
    day = datetime.date.today() - datetime.timedelta(days=12)
    path = data / "home" / owner / "memory" / f"{day.isoformat()}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"### From the agent (10:00)\n\n{FACT}\n\n")


class Seen:
    """What each model call was given: its system prompt and the names of its tools."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.tools: list[list[str]] = []

    def model(self) -> ScriptedModel:
        def brain(r: ModelRequest) -> str:
            self.prompts.append(r.system_prompt)
            self.tools.append(sorted(spec.name for spec in r.tools))
            return "done"

        return ScriptedModel(brain)


async def one_run(data: Path, seen: Seen, scope: list[str] | None = None, **kw: object) -> None:
    """One run of alice's process, asked ``QUESTION``, in a kernel over ``data``."""
    async with kernel(data, seen.model(), **kw) as k:
        proc = await k.spawn(owner="alice", tools=scope)
        await proc.send(QUESTION)
        await proc.wait_idle()


# ------------------------------------------------------------------ recall without the tool


async def test_recall_still_works_when_the_process_scope_hides_the_memory_tool(tmp_path: Path) -> None:
    old_memory(tmp_path)
    seen = Seen()
    await one_run(tmp_path, seen, scope=["echo"])
    (tools,) = seen.tools
    assert tools == ["echo"]  # the model can neither write nor browse memory...
    (prompt,) = seen.prompts
    assert f"[{RECALLED_MEMORIES}]" in prompt and prompt.endswith(f"{FACT}\n")  # ...but what it holds is recalled


async def test_recall_works_beside_an_applications_own_tool_named_memory(tmp_path: Path) -> None:
    old_memory(tmp_path)

    @tool(name="memory")
    def own_memory(query: str) -> str:
        """The application's own notes."""
        return "nothing"

    seen = Seen()
    await one_run(tmp_path, seen, tools=[echo, own_memory])
    assert "memory" in seen.tools[0]  # (the application's tool, which knows no home)
    assert seen.prompts[0].endswith(f"{FACT}\n")


async def test_recall_is_off_when_the_kernel_keeps_no_daily_memory(tmp_path: Path) -> None:
    """``daily_memory=False`` alone decides: a ``memory`` tool the application brings, even the
    kernel's own over alice's home, does not turn recall back on."""
    old_memory(tmp_path)
    seen = Seen()
    alices = memory_tool(tmp_path / "home" / "alice")
    await one_run(tmp_path, seen, tools=[echo, alices], daily_memory=False)
    assert "memory" in seen.tools[0]
    assert FACT not in seen.prompts[0] and RECALLED_MEMORIES not in seen.prompts[0]
    on = Seen()  # the same files with daily memory on: recalled (so the switch is what turned it off)
    await one_run(tmp_path, on, tools=[echo, alices])
    assert on.prompts[0].endswith(f"{FACT}\n")


# ------------------------------------------------------------------ $name, message by message


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def catalogued(tmp_path: Path) -> CompiledPrompt:
    """The assembled prompt of a layer with the skills ``deploy`` and ``lint``, as the kernel
    hands it to the engine: with its skill catalogue."""
    layer = tmp_path / "skills.d"
    write(layer / "deploy" / "SKILL.md", f"---\ndescription: How to ship.\n---\n{DEPLOY_BODY}\n")
    write(layer / "lint.md", f"---\ndescription: Lint Python.\n---\n{LINT_BODY}\n")
    assembled = assemble_prompt(PromptSources(skills_dirs=[layer]), today=datetime.date(2024, 1, 2))
    return CompiledPrompt(assembled.text, skills=assembled.catalog())


def active(prompt: CompiledPrompt, *messages: str) -> list[str]:
    """The skills a run's input of ``messages`` (queued, joined into one run) activates."""
    activated = activate_skills(prompt, [user(m) for m in messages])
    sections = [s for s in activated.sections if s.name == ACTIVE_SKILLS]
    return list(sections[0].files) if sections else []


def test_a_name_in_a_later_message_is_not_hidden_by_a_fence_an_earlier_one_left_open(tmp_path: Path) -> None:
    prompt = catalogued(tmp_path)
    opened = "Here is my script:\n```bash\nexport X=$lint\nmake"
    assert active(prompt, opened, "Now please use $deploy.") == ["deploy"]
    activated = activate_skills(prompt, [user(opened), user("Now please use $deploy.")])
    assert DEPLOY_BODY in activated.text and LINT_BODY not in activated.text
    # an inline code span is not closed by a backtick of the next message either
    assert active(prompt, "the `make target", "use $deploy and `x`") == ["deploy"]


def test_an_unclosed_fence_still_hides_a_name_after_it_in_its_own_message(tmp_path: Path) -> None:
    prompt = catalogued(tmp_path)
    assert active(prompt, "Run this:\n```sh\nexport X=$deploy\n$lint") == []
    # in a run of several messages too: the fence ends with its message, not before
    assert active(prompt, "use $lint", "```\n$deploy") == ["lint"]
    assert active(prompt, "```\n$deploy", "and $lint\n```\n") == ["lint"]
