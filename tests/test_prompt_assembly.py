"""Prompt assembly for durable processes (DESIGN §3): provider order, templating, the byte budget,
workspace files, commissioning, the skills index, determinism, and warnings instead of failures."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest

from agentloop.process.prompt import AssembledPrompt, PromptSources, assemble_prompt, render_template
from agentloop.tools import skills

TODAY = datetime.date(2024, 3, 1)  # yesterday crosses a month (and leap day) boundary


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def full_tree(root: Path) -> PromptSources:
    write(root / "config/ai/context.d/20-tools.md", "Devices:\n{{devices}}")
    write(root / "config/ai/context.d/10-base.md", "You are {{identity}} in {{ cwd }} on {{date}}.")
    write(root / "home/agent/context.d/a.md", "AGENT NOTE")
    write(root / "home/alice/context.d/a.md", "OWNER NOTE")
    write(root / "skills.d/deploy/SKILL.md", "---\ndescription: Ship a release\n---\nSECRET DEPLOY BODY\n")
    write(root / "skills.d/review.md", "Review a change\nREVIEW BODY LINE\n")
    ws = root / "ws"
    for name in ("HEARTBEAT.md", "TOOLS.md", "AGENTS.md", "USER.md", "IDENTITY.md", "SOUL.md", "MEMORY.md"):
        write(ws / name, f"content of {name}")
    owner = root / "home/alice"  # daily memory is the owner's, not the (maybe shared) workspace's
    write(owner / "memory/2024-03-01.md", "TODAY NOTES")
    write(owner / "memory/2024-02-29.md", "YESTERDAY NOTES")
    write(owner / "memory/2024-02-28.md", "OLDER NOTES")
    write(ws / "memory/2024-03-01.md", "A WORKSPACE FILE THAT IS NOT MEMORY")
    return PromptSources(
        system_dir=root / "config/ai/context.d",
        agent_home=root / "home/agent",
        owner_home=root / "home/alice",
        skills_dirs=[root / "skills.d"],
        workspace=ws,
        process_context="Watch the build.",
        main_process=True,
        variables={"identity": "agent7", "cwd": "/work", "devices": "- laptop"},
    )


def positions(prompt: AssembledPrompt, *needles: str) -> list[int]:
    found = [prompt.text.find(n) for n in needles]
    assert -1 not in found, [n for n, f in zip(needles, found, strict=True) if f == -1]
    return found


def test_full_order_of_sections_and_files(tmp_path: Path) -> None:
    prompt = assemble_prompt(full_tree(tmp_path), today=TODAY)
    assert [s.name for s in prompt.sections] == [
        "system context",
        "agent context",
        "owner context",
        "skills",
        "workspace",
        "process context",
    ]
    headers = [f"[{s.name}]" for s in prompt.sections]
    assert positions(prompt, *headers) == sorted(positions(prompt, *headers))
    assert prompt.text.startswith("[system context]\n--- 10-base.md ---\nYou are agent7 in /work on 2024-03-01.")
    order = positions(
        prompt,
        "You are agent7",
        "Devices:\n- laptop",
        "AGENT NOTE",
        "OWNER NOTE",
        "- deploy: Ship a release",
        "content of SOUL.md",
        "content of IDENTITY.md",
        "content of USER.md",
        "content of AGENTS.md",
        "content of MEMORY.md",
        "YESTERDAY NOTES",
        "TODAY NOTES",
        "content of TOOLS.md",
        "content of HEARTBEAT.md",
        "Watch the build.",
    )
    assert order == sorted(order)
    assert "OLDER NOTES" not in prompt.text
    assert prompt.text.endswith("[process context]\nWatch the build.\n")
    assert prompt.warnings == [] and prompt.bootstrap is False
    workspace = prompt.section("workspace")
    assert workspace is not None
    assert [p.name for p in workspace.sources][-4:] == ["2024-02-29.md", "2024-03-01.md", "TOOLS.md", "HEARTBEAT.md"]
    assert sum(s.bytes for s in prompt.sections) + 2 * (len(prompt.sections) - 1) + 1 == len(prompt.text.encode())


def test_missing_everything_gives_an_empty_prompt(tmp_path: Path) -> None:
    empty = assemble_prompt(PromptSources(), today=TODAY)
    assert (empty.text, empty.sections, empty.warnings, empty.bootstrap) == ("", [], [], False)
    absent = tmp_path / "nope"
    sources = PromptSources(absent, absent, absent, [absent], absent, "   ")
    assert assemble_prompt(sources, today=TODAY).text == ""


def test_templating_and_unknown_variables(tmp_path: Path) -> None:
    write(tmp_path / "ctx/a.md", "Hi {{identity}}; {{ mcp_servers }}; {{typo}} {{typo}}; {{date}}; {not} {{ }}")
    prompt = assemble_prompt(
        PromptSources(system_dir=tmp_path / "ctx", variables={"identity": "{{typo}}", "mcp_servers": "none"}),
        today=TODAY,
    )
    # values are inserted once, never expanded again; unknown names stay visible
    assert "Hi {{typo}}; none; {{typo}} {{typo}}; 2024-03-01; {not} {{ }}" in prompt.text
    assert prompt.warnings == [f"{tmp_path / 'ctx/a.md'}: unknown template variable {{{{typo}}}} left as is"]
    assert render_template("{{date}}", {"date": "given"}) == ("given", [])


def test_only_the_system_context_is_templated(tmp_path: Path) -> None:
    sources = full_tree(tmp_path)
    write(tmp_path / "home/agent/context.d/b.md", "literal {{identity}}")
    write(tmp_path / "ws/SOUL.md", "soul {{identity}}")
    prompt = assemble_prompt(sources, today=TODAY)
    assert "literal {{identity}}" in prompt.text and "soul {{identity}}" in prompt.text


def test_byte_budget_truncates_one_file_and_lists_the_rest(tmp_path: Path) -> None:
    home = tmp_path / "agent"
    write(home / "context.d/1.md", "a" * 40)
    write(home / "context.d/2.md", "line one\nline two\nline three\n" + "b" * 30)
    write(home / "context.d/3.md", "never shown")
    write(home / "context.d/4.md", "also never shown")
    write(home / "context.d/notes.txt", "not markdown")
    prompt = assemble_prompt(PromptSources(agent_home=home, max_context_bytes=70), today=TODAY)
    section = prompt.section("agent context")
    assert section is not None and section.truncated
    assert [p.name for p in section.sources] == ["1.md", "2.md"]
    assert [p.name for p in section.omitted] == ["3.md", "4.md"]
    assert "a" * 40 in prompt.text
    # 30 bytes were left: the cut ends at the last line break within them
    assert "line one\nline two\nline three\n[… 2.md truncated: 28 of 59 bytes shown]" in prompt.text
    assert "lineb" not in prompt.text and "\nb" not in prompt.text
    assert "[omitted, over the 70-byte context budget: 3.md, 4.md]" in prompt.text
    assert "never shown" not in prompt.text and "not markdown" not in prompt.text
    assert any("truncated" in w for w in prompt.warnings) and any("3.md, 4.md" in w for w in prompt.warnings)


def test_each_home_has_its_own_budget_and_an_exact_fit_is_not_truncated(tmp_path: Path) -> None:
    write(tmp_path / "agent/context.d/a.md", "x" * 50)
    write(tmp_path / "agent/context.d/b.md", "y")
    write(tmp_path / "owner/context.d/a.md", "é" * 30)  # 60 bytes, cut on a character boundary
    sources = PromptSources(agent_home=tmp_path / "agent", owner_home=tmp_path / "owner", max_context_bytes=50)
    prompt = assemble_prompt(sources, today=TODAY)
    agent, owner = prompt.section("agent context"), prompt.section("owner context")
    assert agent is not None and not agent.truncated and [p.name for p in agent.omitted] == ["b.md"]
    assert owner is not None and owner.truncated
    assert "é" * 25 + "\n[… a.md truncated: 50 of 60 bytes shown]" in prompt.text


def test_the_owner_running_their_own_process_gets_their_context_once(tmp_path: Path) -> None:
    write(tmp_path / "alice/context.d/a.md", "ALICE")
    prompt = assemble_prompt(PromptSources(agent_home=tmp_path / "alice", owner_home=tmp_path / "alice/."))
    assert prompt.text.count("ALICE") == 1 and [s.name for s in prompt.sections] == ["agent context"]


def test_memory_md_only_in_the_main_process(tmp_path: Path) -> None:
    sources = full_tree(tmp_path)
    assert "content of MEMORY.md" in assemble_prompt(sources, today=TODAY).text
    sources.main_process = False
    other = assemble_prompt(sources, today=TODAY)
    assert "MEMORY.md" not in other.text
    assert "TODAY NOTES" in other.text and "YESTERDAY NOTES" in other.text  # daily notes are for everyone


def test_daily_memory_is_read_from_the_owners_home_only(tmp_path: Path) -> None:
    """A review: memories written to the shared workspace went into every account's prompt."""
    sources = full_tree(tmp_path)
    text = assemble_prompt(sources, today=TODAY).text
    assert "TODAY NOTES" in text and "A WORKSPACE FILE THAT IS NOT MEMORY" not in text
    sources.owner_home = tmp_path / "home/bob"
    assert "TODAY NOTES" not in assemble_prompt(sources, today=TODAY).text


def test_daily_memory_follows_today(tmp_path: Path) -> None:
    sources = full_tree(tmp_path)
    later = assemble_prompt(sources, today=datetime.date(2024, 3, 2))
    assert "TODAY NOTES" in later.text and "YESTERDAY NOTES" not in later.text
    earlier = assemble_prompt(sources, today=datetime.date(2024, 2, 29))
    assert positions(earlier, "OLDER NOTES", "YESTERDAY NOTES") == sorted(
        positions(earlier, "OLDER NOTES", "YESTERDAY NOTES")
    )
    assert "TODAY NOTES" not in earlier.text
    assert "on 2024-02-29." in earlier.text  # {{date}} follows today unless the caller sets it


def test_bootstrap_starts_the_commissioning_conversation(tmp_path: Path) -> None:
    sources = full_tree(tmp_path)
    write(tmp_path / "ws/BOOTSTRAP.md", "Ask the human for a name.")
    prompt = assemble_prompt(sources, today=TODAY)
    assert prompt.bootstrap
    assert [s.name for s in prompt.sections][-3:] == ["workspace", "commissioning", "process context"]
    section = prompt.text.split("[commissioning]\n", 1)[1].split("\n\n[process context]")[0]
    assert "delete BOOTSTRAP.md" in section and "Ask the human for a name." in section
    (tmp_path / "ws/BOOTSTRAP.md").unlink()
    assert not assemble_prompt(sources, today=TODAY).bootstrap


def test_skills_index_layers_and_shows_no_bodies(tmp_path: Path) -> None:
    sources = full_tree(tmp_path)
    write(tmp_path / "account-skills.d/review.md", "---\ndescription: Review our way\n---\nOUR REVIEW BODY\n")
    sources.skills_dirs.append(tmp_path / "account-skills.d")
    prompt = assemble_prompt(sources, today=TODAY)
    block = prompt.text.split("[skills]\n", 1)[1].split("\n\n[workspace]")[0]
    assert block.endswith("- deploy: Ship a release\n- review: Review our way")
    assert "skills tool" in block
    for body in ("SECRET DEPLOY BODY", "REVIEW BODY LINE", "OUR REVIEW BODY"):
        assert body not in prompt.text
    section = prompt.section("skills")
    assert section is not None and [p.name for p in section.sources] == ["SKILL.md", "review.md"]


def test_deterministic_bytes(tmp_path: Path) -> None:
    sources = full_tree(tmp_path)
    first = assemble_prompt(sources, today=TODAY)
    second = assemble_prompt(sources, today=TODAY)
    assert first.text.encode() == second.text.encode() and first.digest == second.digest
    assert first.sections == second.sections
    write(tmp_path / "ws/TOOLS.md", "changed")
    assert assemble_prompt(sources, today=TODAY).digest != first.digest


def test_binary_undecodable_and_unreadable_files_warn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources = full_tree(tmp_path)
    (tmp_path / "config/ai/context.d/30-blob.md").write_bytes(b"\x00\x01\x02")
    (tmp_path / "home/agent/context.d/b.md").write_bytes(b"caf\xe9")
    locked = tmp_path / "ws/USER.md"
    (tmp_path / "ws/SOUL.md").unlink()
    os.mkfifo(tmp_path / "ws/SOUL.md")  # reading a FIFO would block the event loop until a writer came
    real_read = skills.read_regular

    def read_regular(path: Path, limit: int | None = None) -> bytes:
        if Path(path).name == locked.name:
            raise PermissionError(13, "Permission denied")
        return real_read(path, limit)

    monkeypatch.setattr(skills, "read_regular", read_regular)
    prompt = assemble_prompt(sources, today=TODAY)
    assert "content of AGENTS.md" in prompt.text  # (and no hang on the FIFO: it is not a file to read)
    assert "content of USER.md" not in prompt.text and "content of SOUL.md" not in prompt.text
    assert len(prompt.warnings) == 3
    assert "30-blob.md: binary file" in prompt.warnings[0]
    assert "b.md: not UTF-8" in prompt.warnings[1]
    assert "USER.md: cannot be read (Permission denied)" in prompt.warnings[2]


def test_symlinks_out_of_agent_writable_places_are_refused(tmp_path: Path) -> None:
    sources = full_tree(tmp_path)
    secret = write(tmp_path / "etc/secret", "TOP SECRET")
    (tmp_path / "ws/SOUL.md").unlink()
    (tmp_path / "ws/SOUL.md").symlink_to(secret)
    (tmp_path / "home/agent/context.d/z.md").symlink_to(secret)
    (tmp_path / "config/ai/context.d/30-linked.md").symlink_to(secret)  # the operator's choice
    prompt = assemble_prompt(sources, today=TODAY)
    assert prompt.text.count("TOP SECRET") == 1
    assert "--- 30-linked.md ---\nTOP SECRET" in prompt.text
    assert len([w for w in prompt.warnings if "refused" in w]) == 2


async def test_a_cached_prompt_follows_in_place_edits_of_files_that_added_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The kernel reuses an assembled prompt while what it read is unchanged. Files that added
    nothing (empty, blank, not UTF-8 yet, a skill folder without its SKILL.md) count too: edited
    in place (their folder's entries unchanged), they reach the next run's prompt. What assembly
    warned about is logged, once per assembly."""
    import logging
    import time

    from agentloop.kernel.runs import prompt_builder
    from agentloop.process.store import ProcessRecord

    work = tmp_path / "work"
    work.mkdir()
    context = tmp_path / "home" / "alice" / "context.d"
    context.mkdir(parents=True)
    skill = tmp_path / "config" / "ai" / "skills.d" / "deploy"
    skill.mkdir(parents=True)
    (work / "AGENTS.md").write_text("")
    (work / "USER.md").write_bytes(b"Name: J\xfcrgen\n")  # not UTF-8: skipped, with a warning
    (context / "style.md").write_text("   \n")
    build = prompt_builder(tmp_path, "Base.")
    record = ProcessRecord(pid="p1", owner="alice", run_as="alice", cwd=str(work))
    with caplog.at_level(logging.WARNING, logger="agentloop.prompt"):
        await build(record, {})
        await build(record, {})  # cached: not assembled (nor warned about) again
    assert sum("USER.md" in r.getMessage() for r in caplog.records) == 1
    time.sleep(0.01)
    (work / "AGENTS.md").write_text("Always answer in French.")
    (work / "USER.md").write_text("Name: Jürgen")
    (context / "style.md").write_text("Use British spelling.")
    (skill / "SKILL.md").write_text("---\nname: deploy\ndescription: Ship a release.\n---\nmake ship")
    prompt = (await build(record, {})).text  # (a ``CompiledPrompt``: the text with its manifest)
    for text in ("Always answer in French.", "Name: Jürgen", "Use British spelling.", "Ship a release."):
        assert text in prompt


def test_a_context_file_whose_name_is_not_utf8_is_skipped_with_a_warning(tmp_path):
    """The agent can write its home: a name of stray bytes must not break every later prompt."""
    folder = tmp_path / "home" / "context.d"
    folder.mkdir(parents=True)
    (folder / "10-fine.md").write_text("Be brief.")
    with open(os.path.join(os.fsencode(folder), b"20-\xff.md"), "w") as f:
        f.write("unreachable")
    assembled = assemble_prompt(PromptSources(agent_home=tmp_path / "home"))
    assert "Be brief." in assembled.text and "unreachable" not in assembled.text
    assert any("not UTF-8, skipped" in w for w in assembled.warnings)
    assembled.text.encode("utf-8")
    [section] = assembled.sections
    assert section.bytes > 0
