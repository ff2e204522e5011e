"""Skills that declare requirements (programs on PATH, environment variables, an operating system)
are shown only where they can work: left out of the prompt index and of list/search, explained
by show/read, and noticed again within the recheck interval once a program or variable appears."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytest

from agentloop.process.prompt import PromptSources, assemble_prompt
from agentloop.tools import skills
from agentloop.tools.base import Tool, ToolContext, ToolError, ToolResult
from agentloop.tools.skills import Eligibility, Requirements, scan_skills, skills_tool

TODAY = datetime.date(2024, 3, 1)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(skills, "ELIGIBILITY", Eligibility(interval=60.0, clock=fake))
    return fake


@pytest.fixture
def bindir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: Clock) -> Path:
    """An otherwise empty PATH holding only the programs a test puts there."""
    path = tmp_path / "bin"
    path.mkdir()
    monkeypatch.setenv("PATH", str(path))
    return path


def install(bindir: Path, name: str) -> None:
    program = bindir / name
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def skill(layer: Path, name: str, *front: str, body: str = "") -> Path:
    lines = ["---", f"description: {name} skill", *front, "---", body or f"BODY OF {name}"]
    return write(layer / name / "SKILL.md", "\n".join(lines) + "\n")


def verdicts(layer: Path) -> dict[str, str | None]:
    found, _ = scan_skills([layer])
    return {name: s.unavailable() for name, s in found.items()}


async def run(tool: Tool, **args: object) -> ToolResult:
    return await tool.run(tool.validate(dict(args)), ToolContext("c1", tool.name))


def text(result: ToolResult) -> str:
    return "\n".join(getattr(b, "text", "") for b in result.content)


def index(dirs: list[Path]) -> str:
    prompt = assemble_prompt(PromptSources(skills_dirs=dirs), today=TODAY)
    return prompt.text.split("[skills]\n", 1)[1] if "[skills]" in prompt.text else ""


# ------------------------------------------------------------------ front matter


def test_flat_keys_are_parsed(tmp_path: Path) -> None:
    skill(
        tmp_path,
        "x",
        "requires-bins: git, docker",
        "requires-any-bins: [podman, 'docker']",
        "requires-env: GITHUB_TOKEN,FOO",
        "os: linux, macos",
    )
    skill(tmp_path, "plain")
    found, warnings = scan_skills([tmp_path])
    assert warnings == []
    assert found["x"].requires == Requirements(
        bins=("git", "docker"), any_bins=("podman", "docker"), env=("GITHUB_TOKEN", "FOO"), os=("linux", "darwin")
    )
    assert not found["plain"].requires


def test_openclaw_metadata_json(tmp_path: Path) -> None:
    skill(
        tmp_path,
        "claw",
        'metadata: {"openclaw": {"emoji": "x", "requires": {"bins": ["gh"], "anyBins": ["a", "b"], '
        '"env": ["X"], "config": ["browser.enabled"]}, "os": ["darwin"]}}',
    )
    skill(tmp_path, "other-key", 'metadata: {"clawdbot": {"requires": {"bins": ["jq"]}}}')
    skill(tmp_path, "top-level", 'metadata: {"requires": {"env": ["TOKEN"]}, "os": ["win32"]}')
    skill(tmp_path, "flat-and-json", "requires-bins: git", 'metadata: {"openclaw": {"requires": {"bins": ["gh"]}}}')
    found, warnings = scan_skills([tmp_path])
    assert warnings == []
    assert found["claw"].requires == Requirements(bins=("gh",), any_bins=("a", "b"), env=("X",), os=("darwin",))
    assert found["other-key"].requires == Requirements(bins=("jq",))
    assert found["top-level"].requires == Requirements(env=("TOKEN",), os=("windows",))
    assert found["flat-and-json"].requires == Requirements(bins=("git", "gh"))


def test_malformed_metadata_warns_and_the_skill_stays_eligible(tmp_path: Path, clock: Clock) -> None:
    skill(tmp_path, "broken", 'metadata: {"openclaw": {"requires": ')
    skill(tmp_path, "not-an-object", 'metadata: ["gh"]')
    found, warnings = scan_skills([tmp_path])
    assert set(found) == {"broken", "not-an-object"}
    assert all(s.unavailable() is None for s in found.values())
    assert len(warnings) == 2
    assert any("'broken'" in w and "metadata" in w and "JSON" in w for w in warnings)
    assert any("'not-an-object'" in w and "metadata" in w for w in warnings)
    assert "broken skill" in index([tmp_path])


def test_unknown_requirement_kinds_are_ignored(tmp_path: Path, clock: Clock) -> None:
    skill(tmp_path, "cfg", 'metadata: {"openclaw": {"requires": {"config": ["a.b"]}, "primaryEnv": "K"}}')
    skill(tmp_path, "flat-cfg", "requires-config: a.b")
    assert verdicts(tmp_path) == {"cfg": None, "flat-cfg": None}


# ------------------------------------------------------------------ eligibility


def test_bins_must_all_be_on_path(tmp_path: Path, bindir: Path) -> None:
    layer = tmp_path / "skills.d"
    install(bindir, "mytool")
    skill(layer, "has", "requires-bins: mytool")
    skill(layer, "lacks", "requires-bins: mytool, othertool")
    skill(layer, "json-lacks", 'metadata: {"openclaw": {"requires": {"bins": ["nothere"]}}}')
    assert verdicts(layer) == {
        "has": None,
        "json-lacks": "needs nothere on PATH",
        "lacks": "needs othertool on PATH",
    }


def test_any_bins_needs_one_of_them(tmp_path: Path, bindir: Path) -> None:
    layer = tmp_path / "skills.d"
    install(bindir, "docker")
    skill(layer, "one", "requires-any-bins: podman, docker")
    skill(layer, "none", "requires-any-bins: podman, nerdctl")
    skill(layer, "json", 'metadata: {"openclaw": {"requires": {"anyBins": ["podman", "docker"]}}}')
    assert verdicts(layer) == {"json": None, "none": "needs one of podman, nerdctl on PATH", "one": None}


def test_env_must_be_set_and_not_empty(tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTLOOP_T_SET", "yes")
    monkeypatch.setenv("AGENTLOOP_T_EMPTY", "")
    monkeypatch.delenv("AGENTLOOP_T_UNSET", raising=False)
    skill(tmp_path, "set", "requires-env: AGENTLOOP_T_SET")
    skill(tmp_path, "empty", "requires-env: AGENTLOOP_T_SET, AGENTLOOP_T_EMPTY")
    skill(tmp_path, "unset", 'metadata: {"openclaw": {"requires": {"env": ["AGENTLOOP_T_UNSET"]}}}')
    assert verdicts(tmp_path) == {
        "empty": "needs AGENTLOOP_T_EMPTY set",
        "set": None,
        "unset": "needs AGENTLOOP_T_UNSET set",
    }


@pytest.mark.parametrize(
    ("platform", "family"), [("linux", "linux"), ("darwin", "darwin"), ("win32", "windows"), ("cygwin", "windows")]
)
def test_platform_family(monkeypatch: pytest.MonkeyPatch, platform: str, family: str) -> None:
    monkeypatch.setattr(sys, "platform", platform)
    assert skills.platform_family() == family


def test_os_must_match(tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    skill(tmp_path, "mac-notes", "os: macos")
    skill(tmp_path, "unixy", "os: linux, darwin")
    skill(tmp_path, "win", 'metadata: {"openclaw": {"os": ["win32"]}}')
    real = sys.platform
    monkeypatch.setattr(sys, "platform", "darwin")
    on_mac = verdicts(tmp_path)
    monkeypatch.setattr(sys, "platform", "linux")
    on_linux = verdicts(tmp_path)
    monkeypatch.setattr(sys, "platform", real)
    assert on_mac == {"mac-notes": None, "unixy": None, "win": "Windows only"}
    assert on_linux == {"mac-notes": "macOS only", "unixy": None, "win": "Windows only"}


def test_every_unmet_requirement_is_named(tmp_path: Path, bindir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(skills, "platform_family", lambda: "linux")
    monkeypatch.delenv("AGENTLOOP_T_UNSET", raising=False)
    skill(tmp_path, "all", "requires-bins: a, b", "requires-env: AGENTLOOP_T_UNSET", "os: darwin, windows")
    assert verdicts(tmp_path) == {"all": "macOS or Windows only; needs a, b on PATH; needs AGENTLOOP_T_UNSET set"}


def test_a_later_layer_may_drop_the_requirement(tmp_path: Path, bindir: Path) -> None:
    system, account = tmp_path / "system", tmp_path / "account"
    skill(system, "deploy", "requires-bins: docker")
    skill(account, "deploy", body="OUR WAY, no docker")
    skill(system, "review")
    skill(account, "review", "requires-bins: docker")  # and the other way round
    assert verdicts(system)["deploy"] == "needs docker on PATH"
    found, _ = scan_skills([system, account])
    assert found["deploy"].unavailable() is None and "OUR WAY" in found["deploy"].body
    assert found["review"].unavailable() == "needs docker on PATH"


# ------------------------------------------------------------------ the prompt index and the tool


def test_the_prompt_index_leaves_out_ineligible_skills(tmp_path: Path, bindir: Path) -> None:
    layer = tmp_path / "skills.d"
    install(bindir, "git")
    skill(layer, "docker-deploy", "requires-bins: docker")
    skill(layer, "git-flow", "requires-bins: git")
    skill(layer, "plain")
    shown = index([layer])
    assert "- git-flow: git-flow skill" in shown and "- plain: plain skill" in shown
    assert "docker-deploy" not in shown
    prompt = assemble_prompt(PromptSources(skills_dirs=[layer]), today=TODAY)
    section = prompt.section("skills")
    assert section is not None and layer / "docker-deploy" / "SKILL.md" not in section.sources
    install(bindir, "docker")
    assert "- docker-deploy" in index([layer])  # assembly itself always judges afresh


def test_no_skill_available_means_no_skills_block(tmp_path: Path, bindir: Path) -> None:
    skill(tmp_path, "docker-deploy", "requires-bins: docker")
    assert index([tmp_path]) == ""


async def test_the_tool_hides_and_explains_ineligible_skills(
    tmp_path: Path, bindir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(skills, "platform_family", lambda: "linux")
    layer = tmp_path / "skills.d"
    skill(layer, "docker-deploy", "requires-bins: docker", body="deploy with docker")
    write(layer / "docker-deploy" / "compose.yml", "services: {}\n")
    skill(layer, "mac-notes", "os: macos", body="notes via docker too")
    skill(layer, "plain", body="docker is mentioned here")
    tool = skills_tool([layer])

    listed = await run(tool, action="list")
    assert text(listed).splitlines() == [
        "1 skills:",
        "- plain: plain skill",
        "not available here: docker-deploy (needs docker on PATH), mac-notes (macOS only)",
    ]
    assert listed.details["skills"] == ["plain"]
    assert listed.details["unavailable"] == {"docker-deploy": "needs docker on PATH", "mac-notes": "macOS only"}

    found = await run(tool, action="search", query="docker")
    assert found.details == {"matches": ["plain"]}

    with pytest.raises(ToolError, match=r"Skill 'docker-deploy' is not available here: needs docker on PATH"):
        await run(tool, action="show", name="docker-deploy")
    with pytest.raises(ToolError, match=r"Skill 'mac-notes' is not available here: macOS only"):
        await run(tool, action="read", name="mac-notes", path="x")
    with pytest.raises(ToolError, match="not available here") as info:
        await run(tool, action="read", name="docker-deploy", path="compose.yml")
    assert "Unknown" not in str(info.value)

    install(bindir, "docker")  # the tool judges on every call
    assert "deploy with docker" in text(await run(tool, action="show", name="docker-deploy"))
    assert "services" in text(await run(tool, action="read", name="docker-deploy", path="compose.yml"))


async def test_list_when_nothing_is_available(tmp_path: Path, bindir: Path) -> None:
    skill(tmp_path, "docker-deploy", "requires-bins: docker")
    listed = await run(skills_tool([tmp_path]), action="list")
    assert text(listed).splitlines() == [
        "No skills are available here.",
        "not available here: docker-deploy (needs docker on PATH)",
    ]


# ------------------------------------------------------------------ cost and the recheck


def test_skills_without_requirements_cost_no_lookups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*_: object) -> object:
        raise AssertionError("looked up")

    monkeypatch.setattr(skills, "ELIGIBILITY", Eligibility(clock=forbidden))
    monkeypatch.setattr(skills.shutil, "which", forbidden)
    skill(tmp_path, "plain")
    assert "- plain" in index([tmp_path])
    assert skills.requirements_generation() == 0  # no clock read either


async def test_a_cached_prompt_notices_a_program_or_variable_after_the_interval(
    tmp_path: Path, bindir: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentloop.kernel.runs import prompt_builder
    from agentloop.process.store import ProcessRecord

    monkeypatch.delenv("AGENTLOOP_T_LATER", raising=False)
    layer = tmp_path / "config" / "ai" / "skills.d"
    skill(layer, "later-tool", "requires-bins: latertool")
    skill(layer, "later-env", "requires-env: AGENTLOOP_T_LATER")
    work = tmp_path / "work"
    work.mkdir()
    builder = prompt_builder(tmp_path, "Base.")
    record = ProcessRecord(pid="p1", owner="alice", run_as="alice", cwd=str(work))

    async def build() -> str:
        built = await builder(record, {})
        return built if isinstance(built, str) else built.text  # the text, or a compiled prompt

    assert "later-" not in await build()

    install(bindir, "latertool")
    monkeypatch.setenv("AGENTLOOP_T_LATER", "1")
    clock.now += 59
    assert "later-" not in await build()  # cached, and not rechecked before the interval
    clock.now += 1
    prompt = await build()
    assert "- later-tool" in prompt and "- later-env" in prompt

    (bindir / "latertool").unlink()  # and the other way round
    clock.now += 60
    prompt = await build()
    assert "later-tool" not in prompt and "- later-env" in prompt


def test_eligibility_rechecks_at_most_once_per_interval(monkeypatch: pytest.MonkeyPatch, bindir: Path) -> None:
    clock = Clock()
    calls: list[str] = []
    real_which = skills.shutil.which

    def which(name: str) -> str | None:
        calls.append(name)
        return real_which(name)

    monkeypatch.setattr(skills.shutil, "which", which)
    watch = Eligibility(interval=60.0, clock=clock)
    needs = Requirements(bins=("sometool",))
    assert watch.judge(needs) == "needs sometool on PATH"
    generation = watch.generation()
    for _ in range(5):
        clock.now += 10
        assert watch.generation() == generation
    assert calls == ["sometool"]
    install(bindir, "sometool")
    clock.now += 10
    assert watch.generation() == generation + 1
    assert calls == ["sometool", "sometool"]
