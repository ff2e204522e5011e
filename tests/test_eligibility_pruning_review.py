"""Review of skills eligibility (d38fe37) and the bounded event log (dfdaceb): the cases the
commits' own tests leave out. Skill files are writable by the agent, so what a skill's front matter
declares is untrusted input: it may not probe the server's files, crash the prompt, cost without
bound, or make every prompt cache in the server miss. A pruned log must stay readable from any
position, keep what a watch has still to read, and be pruned along an index range."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop import ScriptedModel
from agentloop.messages import SystemMessage
from agentloop.process import signals as psig
from agentloop.process.prompt import PromptSources, assemble_prompt
from agentloop.process.store import SQLiteStore, Store, WatchRow
from agentloop.tools import skills
from agentloop.tools.base import Tool, ToolContext, ToolResult
from agentloop.tools.skills import Eligibility, Requirements, scan_skills, skills_tool
from tests.process_support import kernel
from tests.store_conformance.test_conformance import make_store, spawn, store  # noqa: F401
from tests.test_skills_eligibility import Clock

# ====================================================================== skills eligibility


@pytest.fixture
def eligibility(monkeypatch: pytest.MonkeyPatch) -> Eligibility:
    fresh = Eligibility(interval=60.0, clock=Clock())
    monkeypatch.setattr(skills, "ELIGIBILITY", fresh)
    return fresh


@pytest.fixture
def bindir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, eligibility: Eligibility) -> Path:
    path = tmp_path / "bin"
    path.mkdir()
    monkeypatch.setenv("PATH", str(path))
    return path


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every name ``shutil.which`` is asked about."""
    asked: list[str] = []
    real = skills.shutil.which

    def which(name: str, *args: Any, **kw: Any) -> str | None:
        asked.append(name)
        return real(name, *args, **kw)

    monkeypatch.setattr(skills.shutil, "which", which)
    yield asked


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def skill(layer: Path, name: str, *front: str) -> Path:
    path = layer / name / "SKILL.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(["---", f"description: {name} skill", *front, "---", f"BODY OF {name}"]) + "\n")
    return path


def verdicts(layer: Path) -> dict[str, str | None]:
    found, _ = scan_skills([layer])
    return {name: s.unavailable() for name, s in found.items()}


def index(dirs: list[Path]) -> str:
    prompt = assemble_prompt(PromptSources(skills_dirs=dirs), today=datetime.date(2024, 3, 1))
    return prompt.text.split("[skills]\n", 1)[1] if "[skills]" in prompt.text else ""


async def run(tool: Tool, **args: object) -> ToolResult:
    return await tool.run(tool.validate(dict(args)), ToolContext("c1", tool.name))


def text(result: ToolResult) -> str:
    return "\n".join(getattr(b, "text", "") for b in result.content)


def test_a_program_named_by_a_path_is_never_looked_up(
    tmp_path: Path, bindir: Path, lookups: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``shutil.which`` checks a name with a directory part as a file, anywhere: an agent writing
    ``requires-bins: /home/bob/.local/bin/x`` (or ``../../x``) into its skills.d would learn from
    the skill's verdict whether the server has that file. Requirements name programs on PATH."""
    secret = executable(tmp_path / "elsewhere" / "probe")
    monkeypatch.chdir(tmp_path)
    layer = tmp_path / "skills.d"
    depth = "../" * len(tmp_path.parts)
    named = {
        "absolute": str(secret),
        "relative": "elsewhere/probe",
        "dotted": "./elsewhere/probe",
        "climbing": depth + str(secret).lstrip("/"),
    }
    for label, name in named.items():
        skill(layer, label, f"requires-bins: {name}")
    skill(layer, "any", f"requires-any-bins: {secret}, nothere")
    skill(layer, "json", f'metadata: {{"openclaw": {{"requires": {{"bins": ["{secret}"]}}}}}}')
    found, warnings = scan_skills([layer])
    judged = {name: s.unavailable() for name, s in found.items()}
    assert all(why is not None for why in judged.values()), judged  # as if it were missing
    assert not [name for name in lookups if "/" in name or "\\" in name], lookups
    assert {"absolute", "relative", "dotted", "climbing", "any", "json"} <= {
        w.split("'")[1] for w in warnings if "PATH" in w
    }
    secret.unlink()  # and the verdict is the same without the file: nothing to learn from it
    assert {name: s.unavailable() for name, s in scan_skills([layer])[0].items()} == judged


def test_deeply_nested_metadata_is_a_warning_not_a_crash(tmp_path: Path, eligibility: Eligibility) -> None:
    """json.loads raises RecursionError (not ValueError) for deep nesting: one skill file the agent
    writes would fail every prompt assembly and every skills call of the account."""
    skill(tmp_path, "deep-list", "metadata: " + "[" * 100_000)
    skill(tmp_path, "deep-object", "metadata: " + '{"openclaw": ' * 50_000 + "{}" + "}" * 50_000)
    skill(tmp_path, "plain")
    found, warnings = scan_skills([tmp_path])
    assert set(found) == {"deep-list", "deep-object", "plain"}
    assert all(s.unavailable() is None for s in found.values())
    assert any("'deep-list'" in w and "metadata" in w for w in warnings)
    assert "- plain" in index([tmp_path]) and "- deep-list" in index([tmp_path])


async def test_very_long_requirement_lists_cost_a_bounded_number_of_lookups(
    tmp_path: Path, bindir: Path, lookups: list[str]
) -> None:
    """Each name is a ``which`` (a stat per PATH entry) on every assembly, every skills call and
    every recheck, on the event loop: a list is checked up to a bound, with a warning."""
    many = [f"tool{n}" for n in range(20_000)]
    skill(tmp_path, "flat", "requires-bins: " + ", ".join(many), "requires-env: " + ", ".join(many))
    skill(tmp_path, "json", 'metadata: {"requires": {"anyBins": [' + ", ".join(f'"{n}"' for n in many) + "]}}")
    found, warnings = scan_skills([tmp_path])
    reasons = [s.unavailable() for s in found.values()]
    assert all(reasons) and all(len(why or "") < 2_000 for why in reasons)
    assert len(lookups) <= 2 * skills.MAX_REQUIRED_NAMES
    assert {w.split("'")[1] for w in warnings} == {"flat", "json"}
    listed = await run(skills_tool([tmp_path]), action="list")
    assert len(text(listed)) < 5_000


def test_metadata_of_odd_types_reads_what_it_can(tmp_path: Path, eligibility: Eligibility) -> None:
    """Guard: valid JSON of unexpected shapes is neither an error nor a requirement."""
    cases = {
        "bins-string": '{"openclaw": {"requires": {"bins": "gh"}}}',
        "mixed": '{"requires": {"bins": 5, "env": null, "anyBins": [1, null, "x", ["y"], {"z": 1}, " x "]}, "os": 7}',
        "nulls": '{"requires": null, "os": null}',
        "requires-list": '{"requires": ["gh"]}',
        "inner-string": '{"openclaw": "x"}',
        "two-keys": '{"a": 1, "b": {"requires": {"bins": ["q"]}}}',
        "os-upper": '{"os": "LINUX"}',
        "bins-object": '{"requires": {"bins": {"gh": true}}}',
        "huge-number": '{"requires": {"bins": [1e999, 123456789012345678901234567890]}}',
    }
    for name, meta in cases.items():
        skill(tmp_path, name, f"metadata: {meta}")
    for name, scalar in {"scalar-true": "true", "scalar-null": "null", "scalar-inf": "1e999"}.items():
        skill(tmp_path, name, f"metadata: {scalar}")
    found, warnings = scan_skills([tmp_path])
    requires = {name: s.requires for name, s in found.items()}
    assert requires["bins-string"] == Requirements(bins=("gh",))
    assert requires["mixed"] == Requirements(any_bins=("x",))
    assert requires["os-upper"] == Requirements(os=("linux",))
    empty = set(cases) - {"bins-string", "mixed", "os-upper"}
    assert all(not requires[name] for name in empty | {"scalar-true", "scalar-null", "scalar-inf"})
    assert sorted(w.split("'")[1] for w in warnings) == ["scalar-inf", "scalar-null", "scalar-true"]


def test_odd_variable_names_and_os_spellings(
    tmp_path: Path, eligibility: Eligibility, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guard: an empty name is no requirement; a name with ``=`` or NUL is never set (no error);
    keys and OS names are read in any case."""
    monkeypatch.setenv("AGENTLOOP_T_A", "1")
    monkeypatch.setattr(skills, "platform_family", lambda: "linux")
    skill(tmp_path, "empty", "requires-env: , ,", 'metadata: {"requires": {"env": ["", "  "]}}')
    skill(tmp_path, "equals", "requires-env: AGENTLOOP_T_A=1")
    skill(tmp_path, "nul", 'metadata: {"requires": {"env": ["AGENTLOOP_T_A\\u0000B"], "bins": ["sh\\u0000x"]}}')
    skill(tmp_path, "cased", "OS: Linux", "Requires-Env: AGENTLOOP_T_A")
    skill(tmp_path, "mac", "os: [MacOS, 'WIN32']")
    assert verdicts(tmp_path) == {
        "cased": None,
        "empty": None,
        "equals": "needs AGENTLOOP_T_A=1 set",
        "mac": "macOS or Windows only",
        "nul": "needs sh\x00x on PATH; needs AGENTLOOP_T_A\x00B set",
    }


def test_more_requirement_sets_than_remembered_do_not_move_the_generation_at_every_assembly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The generation is part of every process's prompt cache key, server-wide. Clearing the
    remembered verdicts and moving it on whenever one more set is judged made every assembly
    that judges more sets than ``MAX_REMEMBERED`` (an account's agent can write them) miss every
    prompt cache of every account, at every build. What is remembered stays bounded."""
    monkeypatch.setattr(skills, "MAX_REMEMBERED", 8)
    clock = Clock()
    watch = Eligibility(interval=60.0, clock=clock)
    sets = [Requirements(env=(f"AGENTLOOP_T_NONE_{n}",)) for n in range(12)]
    for needs in sets:
        watch.judge(needs)
    generation = watch.generation()
    for _ in range(3):  # each assembly judges every live set again
        for needs in sets:
            watch.judge(needs)
        assert watch.generation() == generation
    assert len(watch._verdicts) <= 8
    monkeypatch.setenv("AGENTLOOP_T_NONE_11", "1")  # a recently judged set is still rechecked
    clock.now += 60
    assert watch.generation() == generation + 1


# ====================================================================== the bounded event log


async def test_a_client_resuming_from_before_the_kept_signals_gets_the_oldest_kept(tmp_path, monkeypatch):
    """Guard: no error and no loop; the log reads on from the oldest kept (after the gap marker,
    ``proc.log.pruned``, for one that resumes from before it), then live."""
    monkeypatch.setattr(psig, "KEPT_SIGNALS", 12)
    monkeypatch.setattr(psig, "PRUNE_EVERY", 6)
    async with kernel(tmp_path, ScriptedModel(lambda r: "seen")) as k:
        proc = await k.spawn(owner="alice")
        for n in range(10):
            await proc.send(f"message {n}")
            await proc.wait_idle()
        oldest = (await k.store.events(proc.pid, limit=1))[0].seq
        assert oldest > 5
        for after in (1, oldest - 1):
            replayed = [s.seq async for s in proc.signals(after_seq=after, follow=False)]
            if after < oldest - 1:
                assert replayed.pop(0) is None  # the marker: not logged
            assert replayed[0] == oldest and replayed == list(range(oldest, replayed[-1] + 1))
        live: list[str] = []

        async def follow() -> None:
            async for s in proc.signals(after_seq=1):
                live.append(s.signal)
                if s.signal == "proc.run.finished" and s.seq is not None and s.seq > replayed[-1]:
                    return

        following = asyncio.create_task(follow())
        await asyncio.sleep(0.05)
        await proc.send("one more")
        await asyncio.wait_for(following, 5)
        assert live.count("proc.run.finished") >= 2


async def test_signals_a_watch_has_not_read_outlive_pruning_and_a_restart(tmp_path, monkeypatch):
    """Guard: a repeating watch whose deliveries were owed when the kernel stopped gets them all
    after the restart, however many runs tried to prune the source's log meanwhile."""
    monkeypatch.setattr(psig, "KEPT_SIGNALS", 4)
    monkeypatch.setattr(psig, "PRUNE_EVERY", 2)

    def echo() -> ScriptedModel:
        return ScriptedModel(lambda r: f"re: {r.messages[-1].text}")

    async with kernel(tmp_path, echo()) as k:
        source, watcher = await k.spawn(owner="a"), await k.spawn(owner="a")
        await k.watch(watcher.pid, source.pid, once=False)
        k.watchers._index.clear()  # as if the kernel died before it saw the runs end
        for n in range(6):
            await source.send(f"job {n}")
            await source.wait_idle()
        pids = (source.pid, watcher.pid)
    async with kernel(tmp_path, echo()) as k:
        watcher = await k.process(pids[1])

        async def texts() -> list[str]:
            return [m.text for m in await watcher.messages() if isinstance(m, SystemMessage)]

        async with asyncio.timeout(5):
            while len(await texts()) < 6:
                await asyncio.sleep(0.02)
        await watcher.wait_idle()
        assert [f"re: job {n}" in t for n, t in enumerate(await texts())] == [True] * 6


async def test_pruning_bounds_of_any_sign(store: Store) -> None:  # noqa: F811
    """Guard (both dialects, PostgreSQL's ``$2::bigint`` too): a negative or zero bound drops
    nothing, None everything no watch holds, a bound past the end everything."""
    for pid in ("p1", "w"):
        await spawn(store, pid)
    async with store.transaction():
        await store.append_events("p1", [("proc.changed", {"n": n}) for n in range(6)])
    async with store.transaction():
        assert await store.prune_events("p1", through=-5) == 0
        assert await store.prune_events("p1", through=0) == 0
        assert await store.prune_events("p1", through=2) == 2
        await store.add_watch(WatchRow("w1", "w", "p1", "proc.run.finished", once=False, seen_seq=4))
        assert await store.prune_events("p1", through=10**12) == 2  # 3 and 4: the watch read to 4
        assert await store.prune_events("p1") == 0
    assert [e.seq for e in await store.events("p1")] == [5, 6]
    async with store.transaction():
        await store.delete_watch("w1")
        assert await store.prune_events("p1") == 2
        assert await store.append_events("p1", [("proc.changed", {})]) == [7]  # the numbering goes on


async def _prune_plan(store: Store, through: int | None) -> str:  # noqa: F811
    """The query plan of ``prune_events(p1, through=...)`` as the store runs it."""
    if isinstance(store, SQLiteStore):
        ran: list[str] = []
        store.db.set_trace_callback(ran.append)
        try:
            async with store.transaction():
                await store.prune_events("p1", through=through)
        finally:
            store.db.set_trace_callback(None)
        [delete] = [sql for sql in ran if sql.lstrip().upper().startswith("DELETE")]
        return "\n".join(str(row[-1]) for row in store.db.execute("EXPLAIN QUERY PLAN " + delete))
    logged: list[Any] = []
    async with store.transaction():
        conn = store._write()  # type: ignore[attr-defined]
        conn.add_query_logger(logged.append)
        try:
            await store.prune_events("p1", through=through)
            await asyncio.sleep(0)
        finally:
            conn.remove_query_logger(logged.append)
        [delete] = [q for q in logged if q.query.lstrip().upper().startswith("DELETE")]
        await conn.execute("SET LOCAL enable_seqscan = off")
        rows = await conn.fetch("EXPLAIN " + delete.query, *delete.args)
        return "\n".join(r[0] for r in rows)


async def test_pruning_reads_only_the_range_it_drops(store: Store) -> None:  # noqa: F811
    """``seq <= COALESCE(?, seq)`` names the column on both sides: no index bound, so every
    prune read the process's whole log (4 ms a prune at 11,000 rows on SQLite, and all of a log a
    watch holds back, at every run's end) inside the finishing transaction."""
    await spawn(store, "p1")
    async with store.transaction():
        await store.append_events("p1", [("proc.changed", {"n": n}) for n in range(50)])
    for through in (10, None):
        plan = await _prune_plan(store, through)
        if isinstance(store, SQLiteStore):
            assert "seq<" in plan.replace(" ", ""), plan
        else:
            assert any("Index Cond" in line and "seq <=" in line for line in plan.splitlines()), plan


async def test_a_long_log_is_pruned_in_bounded_steps(tmp_path, monkeypatch):
    """A log from before this change (months of signals) was pruned whole by the first run to
    finish: 490,000 rows of 2 KiB took 17 s in one SQLite transaction, the event loop blocked."""
    monkeypatch.setattr(psig, "KEPT_SIGNALS", 12)
    monkeypatch.setattr(psig, "PRUNE_EVERY", 6)
    async with kernel(tmp_path, ScriptedModel(lambda r: "seen")) as k:
        pid = (await k.spawn(owner="alice")).pid
    old = SQLiteStore(tmp_path / "agentloop.db")
    await old.open()
    async with old.transaction():
        await old.append_events(pid, [("proc.changed", {"n": n}) for n in range(300)])
    await old.close()
    async with kernel(tmp_path, ScriptedModel(lambda r: "seen")) as k:
        dropped: list[int] = []
        real = k.store.prune_events

        async def prune(pid: str, *, through: int | None = None) -> int:
            dropped.append(await real(pid, through=through))
            return dropped[-1]

        monkeypatch.setattr(k.store, "prune_events", prune)
        proc = await k.process(pid)
        for n in range(3):
            await proc.send(f"message {n}")
            await proc.wait_idle()
        assert dropped and max(dropped) <= 10 * psig.PRUNE_EVERY, dropped
