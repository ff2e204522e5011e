"""Bad input gets a clear error and loses nothing; never a traceback. Gaps found in the
``Schedule`` tool, the ``Jobs`` tool and the chat's ``/compact``, each pinned here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentloop import ScriptedModel
from agentloop.kernel import Process, ProcessBusy
from agentloop.kernel.schedule_tool import ScheduleTool
from agentloop.tools.base import ToolContext, ToolError
from agentloop.tools.jobs import jobs_tool
from tests import test_background_control
from tests.process_support import kernel
from tests.test_background_control import Runtime, jobs, start
from tests.test_background_shell import until
from tests.test_cli_chat_durable import chat, model
from tests.test_tools_shell import text

# -- Schedule ------------------------------------------------------------------------------------


async def _schedule(tmp_path: Path, calls: list[dict[str, Any]]) -> tuple[list[str], int]:
    """Each call's ToolError message ("" for one that did not fail), and how many schedules there
    are after them all."""
    said = []
    async with kernel(tmp_path, ScriptedModel(lambda r: "noted")) as k:
        proc = await k.spawn(owner="alice")
        record = await k.store.get_process(proc.pid)
        assert record is not None
        tool = ScheduleTool(k, record)
        for arguments in calls:
            try:
                await tool.run(tool.validate(arguments), ToolContext("call-1", "Schedule"))
            except ToolError as exc:
                said.append(str(exc))
            else:
                said.append("")
        return said, len(await k.schedules(proc.pid))


@pytest.mark.parametrize(
    "when",
    [
        {"in_seconds": 60},
        {"every_seconds": 60},
        {"in_seconds": 60, "every_seconds": 60},
        {},
    ],
)
async def test_tz_without_at_or_cron_is_refused_not_ignored(tmp_path: Path, when: dict[str, Any]) -> None:
    [said], count = await _schedule(tmp_path, [{"action": "add", "text": "x", "tz": "Europe/Berlin", **when}])
    assert "`tz`" in said and "`at`" in said and "`cron`" in said, said
    assert count == 0


async def test_tz_on_list_or_remove_is_refused_too(tmp_path: Path) -> None:
    said, _ = await _schedule(
        tmp_path,
        [{"action": "list", "tz": "Europe/Berlin"}, {"action": "remove", "id": "x", "in_seconds": 5}],
    )
    assert "`tz`" in said[0] and "action=add" in said[0], said
    assert "`in_seconds`" in said[1] and "action=add" in said[1], said


async def test_tz_with_at_reads_at_and_a_bad_one_is_refused_even_with_an_offset(tmp_path: Path) -> None:
    said, count = await _schedule(
        tmp_path,
        [
            {"action": "add", "text": "x", "at": "2030-01-02T08:00", "tz": "Europe/Berlin"},
            {"action": "add", "text": "x", "cron": "0 9 * * 1-5", "tz": "Europe/Berlin"},
            {"action": "add", "text": "x", "at": "2030-01-02T08:00+01:00", "tz": "Mars/Olympus"},
        ],
    )
    assert said[:2] == ["", ""] and "unknown time zone" in said[2], said
    assert count == 2


@pytest.mark.parametrize(
    "key_bad",
    [
        *(("in_seconds", bad) for bad in (float("nan"), float("inf"), -float("inf"), 10**400, 1e12)),
        *(("every_seconds", bad) for bad in (float("nan"), float("inf"), -float("inf"), 10**400)),
    ],
    ids=lambda kb: f"{kb[0]}={kb[1] if isinstance(kb[1], float) else 'huge'}",
)
async def test_a_number_that_is_no_time_names_the_argument_given(tmp_path: Path, key_bad: tuple[str, float]) -> None:
    key, bad = key_bad
    [said], count = await _schedule(tmp_path, [{"action": "add", "text": "x", key: bad}])
    assert f"`{key}`" in said, said
    assert "`at`" not in said and not said.startswith(("at ", "every ")), said
    assert count == 0


# -- Jobs ----------------------------------------------------------------------------------------

runtime = test_background_control.runtime  # (the fixture, under its name here)


async def _running(rt: Runtime, root: Path) -> str:
    job = await start(rt, root, "cat")
    await until(lambda: rt.registry.of("p").find(job).state == "running")
    return job


@pytest.mark.parametrize("wrong", ["job {hex}", "bg_{hex}", "bg-zzzz", "BG-ZZZZ", "x" * 500])
async def test_a_malformed_job_id_says_there_is_no_such_job_and_what_an_id_looks_like(
    tmp_path: Path, runtime: Runtime, wrong: str
) -> None:
    job = await _running(runtime, tmp_path)
    given = wrong.format(hex=job.removeprefix("bg-"))
    with pytest.raises(ToolError) as refused:
        await jobs(runtime, action="status", job=given)
    said = str(refused.value)
    assert "no such job" in said and "this conversation" in said and "bg-3f2a" in said, said
    assert "bg-bg-" not in said and "bg-job" not in said and len(said) < 400, said
    await jobs(runtime, action="stop", job=job)


async def test_a_job_id_is_found_in_either_case(tmp_path: Path, runtime: Runtime) -> None:
    job = await _running(runtime, tmp_path)
    hex_part = job.removeprefix("bg-")
    for given in (job.upper(), hex_part.upper(), f" {job} "):
        assert job in text(await jobs(runtime, action="status", job=given))
    await jobs(runtime, action="stop", job=job)


@pytest.mark.parametrize(
    ("action", "more"),
    [
        ("status", {"newline": False}),
        ("output", {"newline": True}),
        ("stop", {"newline": False}),
        ("list", {"newline": False}),
        ("list", {"job": "{job}"}),
        ("status", {"input": "yes"}),
        ("input", {"input": "yes"}),
        ("input", {"stdin": "yes", "newline": True}),
    ],
)
async def test_an_argument_that_does_not_apply_is_refused_and_nothing_is_written(
    tmp_path: Path, runtime: Runtime, action: str, more: dict[str, Any]
) -> None:
    job = await _running(runtime, tmp_path)
    arguments = {"action": action, **({} if action == "list" else {"job": job}), **more}
    arguments = {k: v.format(job=job) if isinstance(v, str) else v for k, v in arguments.items()}
    with pytest.raises(ToolError) as refused:
        await jobs(runtime, **arguments)
    said = str(refused.value)
    assert all(k in said for k in more), said  # (each argument that does not apply is named)
    assert runtime.registry.of("p").find(job).bytes_so_far() == 0  # (cat echoes whatever was written)
    await jobs(runtime, action="stop", job=job)


async def test_valid_job_calls_work_as_before(tmp_path: Path, runtime: Runtime) -> None:
    job = await _running(runtime, tmp_path)
    await jobs(runtime, action="input", job=job, text="ab", newline=False)
    await jobs(runtime, action="input", job=job, text="c", newline=True)
    await jobs(runtime, action="input", job=job, text="d")
    await until(lambda: runtime.registry.of("p").find(job).output_so_far() == "abc\nd\n")
    assert "running" in text(await jobs(runtime, action="status", job=f" {job.removeprefix('bg-')} "))
    assert job in text(await jobs(runtime, action="list"))
    assert "abc" in text(await jobs(runtime, action="output", job=job, offset=0))
    await jobs(runtime, action="input", job=job, eof=True)
    await runtime.settle()
    assert "abc\nd\n[exit code 0]" in runtime.ends[0]


def test_the_jobs_schema_still_offers_the_same_arguments() -> None:
    schema = jobs_tool().parameters
    assert sorted(schema["properties"]) == ["action", "eof", "job", "newline", "offset", "text"]
    assert schema["required"] == ["action"]


# -- chat /compact -------------------------------------------------------------------------------


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No user config, no model or data directory from the environment; the workspace."""
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG", "AGENTLOOP_DATA"):
        monkeypatch.delenv(name, raising=False)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    return workspace


def test_compact_while_another_worker_holds_the_process_says_so_and_the_chat_goes_on(
    tmp_path: Path, isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def busy(self: Process, instructions: str | None = None) -> Any:
        raise ProcessBusy(self.pid, "compaction")

    monkeypatch.setattr(Process, "compact", busy)
    model("busycompact", ["still here"])
    result = chat(isolated, tmp_path / "data", "busycompact", "/compact\nhello\n")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not compacted" in errors[0] and "busy" in errors[0], result.stderr
    assert "still here" in result.stdout


@pytest.mark.parametrize("instructions", ["x" * 20_001, "keep \x00 this"])
def test_compact_with_instructions_it_cannot_take_says_so_and_the_chat_goes_on(
    tmp_path: Path, isolated: Path, instructions: str
) -> None:
    model("badcompact", ["still here"])
    result = chat(isolated, tmp_path / "data", "badcompact", f"/compact {instructions}\nhello\n")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not compacted" in errors[0] and "instructions" in errors[0], result.stderr
    assert "still here" in result.stdout
