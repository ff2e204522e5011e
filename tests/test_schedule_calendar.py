"""Schedules on a calendar (cron in an IANA time zone) and the ``Schedule`` tool with which the
agent sets its own reminders."""

from __future__ import annotations

import datetime
import zoneinfo
from pathlib import Path
from typing import Any

import pytest

from agentloop import Reply, ScriptedModel, call
from agentloop.kernel.schedules import ScheduleError, next_cron_after, render
from agentloop.messages import SystemMessage, ToolResultMessage, UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process.store import ScheduleRow
from tests.process_support import kernel

BERLIN = zoneinfo.ZoneInfo("Europe/Berlin")


def epoch(*args: int, tz: datetime.tzinfo = BERLIN) -> float:
    return datetime.datetime(*args, tzinfo=tz).timestamp()  # type: ignore[misc]


def test_weekdays_at_nine_in_berlin_stay_at_nine_across_daylight_saving() -> None:
    friday_before_dst_ends = epoch(2026, 10, 23, 12, 0)
    first = next_cron_after("0 9 * * 1-5", "Europe/Berlin", friday_before_dst_ends)
    second = next_cron_after("0 9 * * 1-5", "Europe/Berlin", first)
    assert first == epoch(2026, 10, 26, 9, 0)  # Monday: the weekend skipped, DST over on the Sunday
    assert second == epoch(2026, 10, 27, 9, 0)
    shown = datetime.datetime.fromtimestamp(first, datetime.UTC)
    assert shown.hour == 8  # 09:00 CET, where it was 07:00 UTC the week before


async def test_a_calendar_schedule_fires_and_moves_to_its_next_time(tmp_path: Path) -> None:
    clock = [epoch(2026, 11, 26, 8, 59)]
    seen: list[str] = []

    def brain(request: ModelRequest) -> str:
        seen.append(request.messages[-1].text if isinstance(request.messages[-1], SystemMessage) else "")
        return "noted"

    async with kernel(tmp_path, ScriptedModel(brain)) as k:
        k.scheduler.clock = lambda: clock[0]
        proc = await k.spawn(owner="alice")
        sid = await k.schedule(proc.pid, "summarise the inbox", cron="0 9 * * 1-5", tz="Europe/Berlin")
        [row] = await k.schedules(proc.pid)
        assert (row.cron, row.tz, row.next_due) == ("0 9 * * 1-5", "Europe/Berlin", epoch(2026, 11, 26, 9, 0))
        clock[0] = epoch(2026, 11, 26, 9, 0, 30)
        await k.scheduler.fire_due()
        await proc.wait_idle()
        [row] = await k.schedules(proc.pid)
    assert row.id == sid and row.next_due == epoch(2026, 11, 27, 9, 0)  # Friday, 09:00 Berlin
    assert "summarise the inbox" in seen[-1] and "Monday through Friday" in seen[-1] and "Europe/Berlin" in seen[-1]


async def test_a_calendar_survives_a_restart_and_counts_what_it_missed(tmp_path: Path) -> None:
    async with kernel(tmp_path, ScriptedModel(lambda r: "noted")) as k:
        proc = await k.spawn(owner="alice")
        await k.schedule(proc.pid, "stand-up", cron="30 9 * * *", tz="Europe/Berlin")
    async with kernel(tmp_path, ScriptedModel(lambda r: "noted")) as k:
        [row] = await k.schedules(proc.pid)
    assert (row.cron, row.tz) == ("30 9 * * *", "Europe/Berlin")
    late = ScheduleRow("s", "p", "stand-up", epoch(2026, 11, 20, 9, 30), created_at=epoch(2026, 11, 1, 0, 0))
    late.cron, late.tz = "30 9 * * *", "Europe/Berlin"
    text = render(late, epoch(2026, 11, 23, 10, 0))
    assert "3 earlier fires missed" in text  # the 21st, 22nd and 23rd


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"cron": "not cron"}, "not a cron expression"),
        ({"cron": "0 9 * * *", "tz": "Mars/Olympus"}, "unknown time zone"),
        ({"cron": "0 9 * * *", "tz": "../../etc/passwd"}, "IANA time zone"),
        ({"cron": "0 9 * * *", "every": 60}, "not both"),
        ({"at": 2e9, "tz": "UTC"}, "tz goes with cron"),
        ({"cron": "0 0 30 2 *"}, "day-of-month"),  # 30 February
        ({"cron": "x" * 300}, "at most 200"),
    ],
)
async def test_bad_calendars_are_refused_clearly(tmp_path: Path, kwargs: dict[str, Any], error: str) -> None:
    async with kernel(tmp_path, ScriptedModel(lambda r: "noted")) as k:
        proc = await k.spawn(owner="alice")
        with pytest.raises(ScheduleError, match=error):
            await k.schedule(proc.pid, "x", **kwargs)
        assert await k.schedules(proc.pid) == []


async def test_a_calendar_firing_more_often_than_the_minimum_is_refused(tmp_path: Path) -> None:
    async with kernel(tmp_path, ScriptedModel(lambda r: "noted"), schedule_min_every=3600) as k:
        proc = await k.spawn(owner="alice")
        with pytest.raises(ScheduleError, match="more often than every 3600"):
            await k.schedule(proc.pid, "x", cron="*/5 * * * *")


def agent_that_schedules(calls: list[dict[str, Any]]) -> Any:
    """Asks the Schedule tool for each of ``calls`` in turn, one per user message, then answers
    with the tool's result text."""

    def brain(request: ModelRequest) -> Reply | str:
        last = request.messages[-1]
        if isinstance(last, UserMessage):
            return Reply(tool_calls=[call("Schedule", **calls.pop(0))])
        if isinstance(last, ToolResultMessage):
            return ("error: " if last.is_error else "") + last.text
        return "noted"

    return brain


async def _steps(proc: Any, n: int) -> list[str]:
    """Send ``n`` messages one after another; the answer to each."""
    answers = []
    for i in range(n):
        await proc.send(f"step {i}")
        await proc.wait_idle()
        answers.append((await proc.messages())[-1].text)
    return answers


async def test_the_agent_sets_lists_and_removes_its_own_reminders(tmp_path: Path) -> None:
    calls = [
        {"action": "add", "text": "check the deploy", "in_seconds": 3600, "name": "deploy"},
        {"action": "add", "text": "inbox", "cron": "0 9 * * 1-5", "tz": "Europe/Berlin"},
        {"action": "add", "text": "dentist", "at": "2030-01-02T08:00", "tz": "Europe/Berlin"},
        {"action": "list"},
    ]
    async with kernel(tmp_path, ScriptedModel(agent_that_schedules(calls)), schedule_tool=True) as k:
        proc = await k.spawn(owner="alice")
        answers = await _steps(proc, 4)
        rows = await k.schedules(proc.pid)
        calls.append({"action": "remove", "id": rows[0].id})
        await proc.send("remove")
        await proc.wait_idle()
        after = await k.schedules(proc.pid)
    assert all(a.startswith("Scheduled: ") for a in answers[:3]), answers
    assert "Monday through Friday (Europe/Berlin)" in answers[1]
    dentist = next(r for r in rows if r.text == "dentist")
    assert dentist.next_due == epoch(2030, 1, 2, 8, 0)
    assert all(r.id in answers[3] for r in rows) and len(rows) == 3
    assert len(after) == 2 and rows[0].id not in {r.id for r in after}


async def test_bad_tool_input_is_an_error_the_model_sees_and_nothing_is_scheduled(tmp_path: Path) -> None:
    calls = [
        {"action": "add", "text": "x", "at": "next tuesday"},
        {"action": "add", "text": "x", "cron": "*/1 * * * *", "every_seconds": 60},
        {"action": "add", "in_seconds": 10},
        {"action": "remove", "id": "nope"},
    ]
    async with kernel(tmp_path, ScriptedModel(agent_that_schedules(calls)), schedule_tool=True) as k:
        proc = await k.spawn(owner="alice")
        answers = await _steps(proc, 4)
        assert await k.schedules(proc.pid) == []
    assert all(a.startswith("error: ") for a in answers), answers
    assert "ISO 8601" in answers[0] and "not both" in answers[1] and "needs `text`" in answers[2]


async def test_the_tool_is_offered_only_when_asked_for(tmp_path: Path) -> None:
    offered: list[list[str]] = []

    def brain(request: ModelRequest) -> str:
        offered.append(sorted(t.name for t in request.tools))
        return "hi"

    async with kernel(tmp_path, ScriptedModel(brain)) as k:
        await (await k.spawn(owner="alice", text="hi")).wait_idle()
    async with kernel(tmp_path, ScriptedModel(brain), schedule_tool=True) as k:
        await (await k.spawn(owner="alice", text="hi")).wait_idle()
    assert "Schedule" not in offered[0] and "Schedule" in offered[1]


async def test_the_tool_says_what_time_it_is_and_refuses_a_date_already_past(tmp_path: Path) -> None:
    """A model does not know today's date: the tool's answers name the time now and how far off
    the reminder is, and an ``at`` already past (a guessed year, yesterday's date) is refused with
    the time now instead of firing at once."""
    now = epoch(2026, 11, 26, 15, 20, tz=datetime.UTC)  # a Thursday
    calls = [
        {"action": "add", "text": "dentist", "at": "2025-11-27T09:00", "tz": "Europe/Berlin"},
        {"action": "add", "text": "dentist", "at": "2026-11-27T09:00", "tz": "Europe/Berlin"},
        {"action": "add", "text": "tea", "in_seconds": 90},
        {"action": "list"},
    ]
    async with kernel(tmp_path, ScriptedModel(agent_that_schedules(calls)), schedule_tool=True) as k:
        k.scheduler.clock = lambda: now
        proc = await k.spawn(owner="alice")
        answers = await _steps(proc, 4)
        rows = await k.schedules(proc.pid)
    assert answers[0].startswith("error: ") and "in the past" in answers[0]
    assert "Now: Thursday 2026-11-26 15:20 UTC" in answers[0]
    assert sorted(r.text for r in rows) == ["dentist", "tea"]  # the refused one was not scheduled
    assert "in 16 h 40 min" in answers[1] and "Now: Thursday 2026-11-26 15:20 UTC" in answers[1]
    assert "in 1 min" in answers[2]
    assert answers[3].startswith("Now: Thursday 2026-11-26 15:20 UTC")
    assert "in 16 h 40 min" in answers[3] and "in 1 min" in answers[3]
