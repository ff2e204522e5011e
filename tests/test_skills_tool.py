"""The skills tool and skill discovery: layering, front matter, the four actions, rooted reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentloop import Agent, Reply, ScriptedModel, ToolResultMessage, call
from agentloop.tools.base import Tool, ToolContext, ToolError, ToolResult
from agentloop.tools.skills import discover_skills, parse_front_matter, scan_skills, skills_tool


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def layers(tmp_path: Path) -> list[Path]:
    system, account = tmp_path / "system" / "skills.d", tmp_path / "account" / "skills.d"
    write(
        system / "deploy" / "SKILL.md",
        "---\nname: deploy\ndescription: Ship a release to production\n---\nSYSTEM BODY\n",
    )
    write(system / "deploy" / "scripts" / "ship.sh", "echo shipping\n")
    write(system / "review.md", "# Review a pull request\n\nRead the diff. Check the tests.\n")
    write(account / "deploy" / "SKILL.md", "---\ndescription: Ship our way\n---\nACCOUNT BODY uses the staging host\n")
    write(account / "deploy" / "notes" / "hosts.txt", "staging.example\n")
    write(account / "pdf.md", "---\ndescription: >\n  Fill PDF forms\n  and extract text\n---\nUse pdftotext.\n")
    return [system, account]


async def run(tool: Tool, **args: object) -> ToolResult:
    return await tool.run(tool.validate(dict(args)), ToolContext("c1", tool.name))


async def _error(tool: Tool, **args: object) -> ToolError:
    with pytest.raises(ToolError) as info:
        await run(tool, **args)
    return info.value


def text(result: ToolResult | ToolResultMessage) -> str:
    return "\n".join(getattr(b, "text", "") for b in result.content)


# ------------------------------------------------------------------ discovery


def test_front_matter_flat_fields_folded_values_and_quotes() -> None:
    fields, body = parse_front_matter('---\nname: "x"\ndescription: >\n  one\n  two\n---\n\nbody\n')
    assert fields == {"name": "x", "description": "one two"}
    assert body == "body\n"
    assert parse_front_matter("---\nno closing fence\n") == ({}, "---\nno closing fence\n")


def test_layers_override_by_name_and_single_file_skills(layers: list[Path]) -> None:
    skills = discover_skills(layers)
    assert list(skills) == ["deploy", "pdf", "review"]  # sorted
    assert skills["deploy"].description == "Ship our way"
    assert "ACCOUNT BODY" in skills["deploy"].body and skills["deploy"].layer == layers[1]
    assert skills["review"].description == "Review a pull request"  # first line, heading marks removed
    assert skills["review"].root is None
    assert skills["pdf"].description == "Fill PDF forms and extract text"
    # the order of layers decides: reversed, the system skill wins
    assert "SYSTEM BODY" in discover_skills(layers[::-1])["deploy"].body


def test_missing_layers_hidden_entries_and_bad_files(tmp_path: Path) -> None:
    layer = tmp_path / "skills.d"
    write(layer / ".hidden.md", "secret")
    write(layer / "notaskill" / "README.md", "no SKILL.md here")
    (layer / "blob.md").write_bytes(b"\x00\x01binary")
    write(layer / "ok.md", "Fine")
    skills, warnings = scan_skills([tmp_path / "absent", layer])
    assert list(skills) == ["ok"]
    assert any("blob" in w and "binary" in w for w in warnings)


def test_a_skill_file_linking_out_of_its_layer_is_refused(tmp_path: Path) -> None:
    secret = write(tmp_path / "secret.txt", "top secret")
    layer = tmp_path / "skills.d"
    layer.mkdir()
    (layer / "leak.md").symlink_to(secret)
    write(layer / "inner" / "x.txt", "x")
    (layer / "inner" / "SKILL.md").symlink_to(secret)
    skills, warnings = scan_skills([layer])
    assert skills == {}
    assert len(warnings) == 2 and all("outside" in w for w in warnings)


# ------------------------------------------------------------------ the tool


async def test_list_and_search(layers: list[Path]) -> None:
    tool = skills_tool(layers)
    listed = await run(tool, action="list")
    assert text(listed).splitlines() == [
        "3 skills:",
        "- deploy: Ship our way",
        "- pdf: Fill PDF forms and extract text",
        "- review: Review a pull request",
    ]
    found = await run(tool, action="search", query="STAGING")
    assert found.details == {"matches": ["deploy"]}
    assert "ACCOUNT BODY uses the staging host" in text(found)  # a snippet of the matching line
    # every word must match; name hits rank above body hits
    assert (await run(tool, action="search", query="pdf text")).details == {"matches": ["pdf"]}
    write(layers[1] / "tests.md", "Mentions review once.\n")
    ranked = await run(tool, action="search", query="review")
    assert ranked.details == {"matches": ["review", "tests"]}
    capped = await run(tool, action="search", query="e", limit=1)
    assert len(capped.details["matches"]) == 1 and "top 1 shown" in text(capped)
    assert "No skill matches" in text(await run(tool, action="search", query="kubernetes"))
    with pytest.raises(ToolError, match="non-empty query"):
        await run(tool, action="search")


async def test_show_returns_the_body_and_the_files(layers: list[Path]) -> None:
    tool = skills_tool(layers)
    shown = await run(tool, action="show", name="deploy")
    body = text(shown)
    assert "ACCOUNT BODY" in body and "SYSTEM BODY" not in body
    assert "description:" not in body  # the front matter is metadata
    assert shown.details["files"] == ["notes/hosts.txt"]  # the overriding layer's directory only
    assert "Use pdftotext." in text(await run(tool, action="show", name="pdf"))


async def test_unknown_skill_lists_close_names(layers: list[Path]) -> None:
    tool = skills_tool(layers)
    with pytest.raises(ToolError, match=r"Unknown skill 'deplyo'\. Did you mean: deploy\?"):
        await run(tool, action="show", name="deplyo")
    with pytest.raises(ToolError, match="needs the skill's name"):
        await run(tool, action="show")
    assert "Unknown skill" in str(await _error(skills_tool([]), action="show", name="x"))


async def test_read_a_file_of_the_skill(layers: list[Path]) -> None:
    tool = skills_tool(layers)
    got = await run(tool, action="read", name="deploy", path="notes/hosts.txt")
    assert text(got) == "staging.example\n"
    assert got.details == {"name": "deploy", "path": "notes/hosts.txt"}
    missing = await _error(tool, action="read", name="deploy", path="scripts/ship.sh")  # the system layer's
    assert "has no file 'scripts/ship.sh'" in str(missing) and "notes/hosts.txt" in str(missing)
    assert "single file" in str(await _error(tool, action="read", name="review", path="x"))
    assert "needs a path" in str(await _error(tool, action="read", name="deploy"))


async def test_read_refuses_escapes(tmp_path: Path, layers: list[Path]) -> None:
    secret = write(tmp_path / "secret.txt", "top secret")
    skill_dir = layers[1] / "deploy"
    (skill_dir / "out").symlink_to(secret)
    (skill_dir / "outdir").symlink_to(tmp_path)
    tool = skills_tool(layers)
    for path in ("../pdf.md", "../../../secret.txt", str(secret), "out", "outdir/secret.txt", "notes/../../pdf.md"):
        error = await _error(tool, action="read", name="deploy", path=path)
        assert "Cannot read" in str(error), path
        assert "top secret" not in str(error)
    # an absolute path that stays inside the skill is fine
    assert text(await run(tool, action="read", name="deploy", path=str(skill_dir / "notes" / "hosts.txt")))


async def test_read_refuses_binary_and_caps_large_files(layers: list[Path]) -> None:
    skill_dir = layers[1] / "deploy"
    (skill_dir / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    write(skill_dir / "big.txt", "x" * 100_000)
    tool = skills_tool(layers)
    assert "binary" in str(await _error(tool, action="read", name="deploy", path="logo.png"))
    big = text(await run(tool, action="read", name="deploy", path="big.txt"))
    assert big.endswith("[… truncated: 65536 of 100000 bytes shown]")


async def test_a_skill_written_during_the_run_is_found(tmp_path: Path) -> None:
    layer = tmp_path / "skills.d"
    tool = skills_tool([layer])
    assert text(await run(tool, action="list")) == "No skills are installed."
    write(layer / "new.md", "Fresh skill")
    assert "- new: Fresh skill" in text(await run(tool, action="list"))


def test_the_tool_schema_and_flags(layers: list[Path]) -> None:
    tool = skills_tool(layers)
    assert tool.name == "skills" and tool.idempotent
    props = tool.parameters["properties"]
    assert props["action"]["enum"] == ["list", "search", "show", "read"]
    assert tool.parameters["required"] == ["action"]


async def test_through_an_agent(layers: list[Path]) -> None:
    model = ScriptedModel(
        [
            Reply(
                tool_calls=[
                    call("skills", action="show", name="deploy"),
                    call("skills", action="read", name="deploy", path="../../../../etc/passwd"),
                ]
            ),
            "Deployed via staging.",
        ]
    )
    agent = Agent(model=model, tools=[skills_tool(layers)])
    result = await agent.run("deploy please")
    results = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert [r.is_error for r in results] == [False, True]
    assert "ACCOUNT BODY" in text(results[0])
    assert "escapes" in text(results[1])
    assert result.text == "Deployed via staging."
    assert "ACCOUNT BODY" in str(model.requests[1].messages)


def test_a_directory_and_a_file_of_the_same_name_in_one_layer(tmp_path: Path) -> None:
    layer = tmp_path / "skills.d"
    write(layer / "x" / "SKILL.md", "From the directory")
    write(layer / "x.md", "From the file")
    skills, warnings = scan_skills([layer])
    assert skills["x"].description == "From the directory"
    assert warnings == [f"skill 'x': both x/ and x.md in {layer}; using the directory"]


async def test_a_name_is_looked_up_never_used_as_a_path(layers: list[Path]) -> None:
    tool = skills_tool(layers)
    for name in ("../account/skills.d/deploy", "deploy/../pdf", "/etc"):
        assert "Unknown skill" in str(await _error(tool, action="show", name=name))
