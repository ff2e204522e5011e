"""Review of prompt assembly and the skills tool: escapes through symlinked skill folders, files
too large to read whole, and the commissioning conversation kept to the main process."""

from __future__ import annotations

import datetime
import os
import tracemalloc
from pathlib import Path

import pytest

from agentloop.process.prompt import PromptSources, assemble_prompt
from agentloop.tools.base import Tool, ToolContext, ToolError, ToolResult
from agentloop.tools.skills import scan_skills, skills_tool

TODAY = datetime.date(2024, 3, 1)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


async def run(tool: Tool, **args: object) -> ToolResult:
    return await tool.run(tool.validate(dict(args)), ToolContext("c1", tool.name))


def text(result: ToolResult) -> str:
    return "\n".join(getattr(b, "text", "") for b in result.content)


@pytest.fixture
def bobs_skill(tmp_path: Path) -> Path:
    """Another account's private skill folder, with a file beside its SKILL.md."""
    skill = tmp_path / "home/bob/skills.d/private"
    write(skill / "SKILL.md", "---\ndescription: Bob's private skill\n---\nBOB BODY\n")
    write(skill / "creds.txt", "BOB SECRET")
    return skill


async def test_a_skill_folder_linking_out_of_its_layer_is_refused(tmp_path: Path, bobs_skill: Path) -> None:
    """A skill folder in an account's ``skills.d`` that is a symlink to a folder elsewhere (here
    another account's skill) must not make that folder's files readable, as a linked single-file
    skill is not. A link to a folder inside the same layer stays fine."""
    layer = tmp_path / "home/alice/skills.d"
    write(layer / "mine/SKILL.md", "---\ndescription: Alice's skill\n---\nALICE BODY\n")
    (layer / "steal").symlink_to(bobs_skill)
    (layer / "alias").symlink_to(layer / "mine")
    skills, warnings = scan_skills([layer])
    assert sorted(skills) == ["alias", "mine"]
    assert len(warnings) == 1 and "'steal'" in warnings[0] and "outside" in warnings[0]
    tool = skills_tool([layer])
    with pytest.raises(ToolError) as info:
        await run(tool, action="read", name="steal", path="creds.txt")
    assert "BOB SECRET" not in str(info.value)
    assert "ALICE BODY" in text(await run(tool, action="show", name="alias"))
    prompt = assemble_prompt(PromptSources(skills_dirs=[layer]), today=TODAY)
    assert "Bob's private skill" not in prompt.text and "- alias: Alice's skill" in prompt.text


def test_a_huge_context_file_is_not_read_whole(tmp_path: Path) -> None:
    """The budget keeps 32 KiB of a home's context; a file of many megabytes (a sparse file costs
    nothing to make) must not be loaded into the server's memory to find that out."""
    home = tmp_path / "home/agent"
    write(home / "context.d/a.md", "SMALL NOTE")
    with open(home / "context.d/b.md", "wb") as f:
        f.truncate(64 * 1024 * 1024)
    tracemalloc.start()
    try:
        prompt = assemble_prompt(PromptSources(agent_home=home), today=TODAY)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "SMALL NOTE" in prompt.text
    assert peak < 16 * 1024 * 1024, peak
    assert any("b.md" in w and "larger than" in w for w in prompt.warnings), prompt.warnings


async def test_a_huge_skill_file_is_not_read_whole(tmp_path: Path) -> None:
    layer = tmp_path / "skills.d"
    write(layer / "big/SKILL.md", "Big data")
    with open(layer / "big/data.txt", "wb") as f:
        f.truncate(64 * 1024 * 1024)
    tool = skills_tool([layer])
    tracemalloc.start()
    try:
        with pytest.raises(ToolError) as info:
            await run(tool, action="read", name="big", path="data.txt")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024, peak
    assert "larger than" in str(info.value)


def test_commissioning_is_for_the_main_process_only(tmp_path: Path) -> None:
    """BOOTSTRAP.md makes a run the commissioning conversation with the user, which ends with the
    agent deleting the file. A subagent the main process starts in the same workspace has no user
    to commission with; told it is the commissioning run, it may delete BOOTSTRAP.md and cut the
    real conversation short."""
    ws = tmp_path / "ws"
    write(ws / "BOOTSTRAP.md", "Ask the human for a name.")
    write(ws / "AGENTS.md", "Be brief.")
    main = assemble_prompt(PromptSources(workspace=ws, main_process=True), today=TODAY)
    assert main.bootstrap and "Ask the human for a name." in main.text
    sub = assemble_prompt(PromptSources(workspace=ws, main_process=False), today=TODAY)
    assert not sub.bootstrap
    assert "BOOTSTRAP.md" not in sub.text and "Be brief." in sub.text


def test_a_fifo_or_folder_named_like_a_skill_or_context_file_does_not_hang(tmp_path: Path) -> None:
    """(Checked fine.) Nothing on disk makes assembly block or fail."""
    home, layer, ws = tmp_path / "home/agent", tmp_path / "skills.d", tmp_path / "ws"
    for folder in (home / "context.d", layer, ws):
        folder.mkdir(parents=True)
        os.mkfifo(folder / "fifo.md")
        (folder / "dir.md").mkdir()
        (folder / "loop.md").symlink_to("loop.md")
    os.mkfifo(ws / "SOUL.md")
    (ws / "USER.md").mkdir()
    prompt = assemble_prompt(PromptSources(agent_home=home, skills_dirs=[layer], workspace=ws), today=TODAY)
    assert prompt.text == ""
