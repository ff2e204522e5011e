"""A run's callbacks stamp the paths they watch in few ``stat`` calls (an absent path is answered
by the directory its first missing entry would be in: ``kernel/runs.path_stats``), and still see
every edit, addition and removal at the next run: context files, workspace files, skills, the
skills tool."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from agentloop.kernel import runs
from agentloop.kernel.runs import path_stamps, path_stats, prompt_builder, skills_toolset
from agentloop.process.store import ProcessRecord
from agentloop.stamps import file_stamp

OLD_NS = time.time_ns() - 3_600 * 10**9 + 123_457  # an hour ago: settled (not on a whole millisecond)


def _age(root: Path) -> None:
    """Every directory under ``root`` (itself too) last changed an hour ago."""
    for dirpath, _, _ in os.walk(root):
        os.utime(dirpath, ns=(OLD_NS, OLD_NS))
    os.utime(root, ns=(OLD_NS, OLD_NS))


def _record(work: Path) -> ProcessRecord:
    return ProcessRecord(pid="p1", owner="alice", run_as="alice", cwd=str(work))


@pytest.fixture(autouse=True)
def _fresh_witnesses() -> None:
    runs._absent.clear()


def test_path_stamps_agree_with_file_stamp(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f.md").write_text("x")
    _age(tmp_path)
    paths = [str(tmp_path / p) for p in ("a", "a/f.md", "b", "b/c/d", "a/g.md", "a/f.md/x")]
    for _ in range(3):  # (the second and third answered by witnesses)
        assert path_stamps(paths) == tuple(file_stamp(p) for p in paths)


def test_an_absent_path_shares_its_directory_stat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _age(tmp_path)
    paths = [str(tmp_path / "home" / "alice" / name) for name in ("context.d", "skills.d", "memory")]
    path_stats(paths)
    calls: list[str] = []
    real = os.stat
    monkeypatch.setattr(runs.os, "stat", lambda p, *a, **k: calls.append(p) or real(p, *a, **k))
    assert path_stats(paths) == [None, None, None]
    assert calls == [str(tmp_path)]


@pytest.mark.parametrize("depth", ["home/alice/context.d/x.md", "home/alice/context.d", "home"])
def test_an_absent_path_that_appears_is_seen(tmp_path: Path, depth: str) -> None:
    target = tmp_path / "home" / "alice" / "context.d" / "x.md"
    _age(tmp_path)
    assert path_stats([str(target)]) == [None]
    assert path_stats([str(target)]) == [None]
    made = tmp_path / depth
    if depth.endswith(".md"):
        made.parent.mkdir(parents=True)
        made.write_text("hi")
    else:
        made.mkdir(parents=True)
        if made != target.parent:
            target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("hi")
    [st] = path_stats([str(target)])
    assert st is not None and st.st_size == 2


def test_a_recently_changed_directory_is_not_trusted(tmp_path: Path) -> None:
    """An entry added within the directory's timestamp granule leaves its mtime as it was."""
    now = time.time_ns()
    os.utime(tmp_path, ns=(now, now))
    target = tmp_path / "context.d"
    assert path_stats([str(target)]) == [None]
    target.mkdir()
    os.utime(tmp_path, ns=(now, now))  # (the same timestamp as before the entry was made)
    assert path_stats([str(target)])[0] is not None


def test_a_dangling_link_is_not_a_witnessed_absence(tmp_path: Path) -> None:
    """A link pointing nowhere comes to life without its directory changing."""
    (tmp_path / "home").symlink_to(tmp_path / "elsewhere")
    _age(tmp_path)
    target = tmp_path / "home" / "alice"
    assert path_stats([str(target)]) == [None]
    (tmp_path / "elsewhere" / "alice").mkdir(parents=True)
    os.utime(tmp_path, ns=(OLD_NS, OLD_NS))
    assert path_stats([str(target)])[0] is not None


def test_a_removed_directory_is_seen(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    target.mkdir(parents=True)
    _age(tmp_path)
    assert path_stats([str(target)])[0] is not None
    target.rmdir()
    (tmp_path / "a").rmdir()
    assert path_stats([str(target)]) == [None]
    target.mkdir(parents=True)
    assert path_stats([str(target)])[0] is not None


async def test_each_kind_of_prompt_file_is_seen_at_the_next_run(tmp_path: Path) -> None:
    """Added, edited and removed, with every directory settled long ago (its witnesses trusted):
    a system context file, a home context file (its directories made on the way), a workspace
    file (AGENTS.md, SOUL.md) and a skill."""
    work = tmp_path / "work"
    work.mkdir()
    _age(tmp_path)
    build = prompt_builder(tmp_path, "Base.")
    record = _record(work)
    system = tmp_path / "config" / "ai" / "context.d" / "10-rules.md"
    home = tmp_path / "home" / "alice" / "context.d" / "style.md"
    agents, soul = work / "AGENTS.md", work / "SOUL.md"
    skill = tmp_path / "home" / "alice" / "skills.d" / "deploy" / "SKILL.md"
    files = {
        system: "System rule one.",
        home: "Use British spelling.",
        agents: "Always answer in French.",
        soul: "You are calm.",
        skill: "---\nname: deploy\ndescription: Ship a release.\n---\nmake ship",
    }
    shown = {system: "System rule", home: "spelling.", agents: "in French.", soul: "calm.", skill: "a release."}
    for path in files:
        for _ in range(2):
            assert shown[path] not in (await build(record, {})).text
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files[path])  # added
        assert shown[path] in (await build(record, {})).text
        _age(tmp_path)
        time.sleep(0.002)
        edited = files[path].replace("Ship a release.", "Edited.") if path == skill else files[path] + " Edited."
        path.write_text(edited)  # edited (no entry changes)
        assert "Edited." in (await build(record, {})).text
        _age(tmp_path)
        path.unlink()  # removed
        text = (await build(record, {})).text
        assert shown[path] not in text and "Edited." not in text
        _age(tmp_path)


async def test_the_skills_tool_comes_and_goes_with_a_skills_directory(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    _age(tmp_path)
    toolset = skills_toolset(tmp_path)
    record = _record(work)
    for _ in range(2):
        assert "skills" not in toolset(record, {})
    layer = tmp_path / "home" / "alice" / "skills.d"
    layer.mkdir(parents=True)
    assert "skills" in toolset(record, {})
    _age(tmp_path)
    layer.rmdir()
    assert "skills" not in toolset(record, {})
    _age(tmp_path)
    (tmp_path / "config" / "ai" / "skills.d").mkdir(parents=True)
    assert "skills" in toolset(record, {})
    assert toolset(record, {"skills": "given"})["skills"] == "given"  # (a run's own is kept)


async def test_chained_toolsets_stay_plain_until_one_is_async(tmp_path: Path) -> None:
    from agentloop.kernel.runs import chain

    def add(name: str):  # type: ignore[no-untyped-def]
        return lambda record, shared: {**shared, name: name}

    async def later(record, shared):  # type: ignore[no-untyped-def]
        return {**shared, "later": "later"}

    record = _record(tmp_path)
    assert chain(add("a"), add("b"))(record, {}) == {"a": "a", "b": "b"}
    pending = chain(chain(add("a"), later), add("b"))(record, {})
    assert await pending == {"a": "a", "later": "later", "b": "b"}  # type: ignore[misc]
