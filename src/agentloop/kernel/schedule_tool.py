"""The ``Schedule`` tool: the agent sets its own reminders ("check the deploy in an hour", "every
weekday at 9, summarise the inbox"), as schedules of its own process (``kernel/schedules.py``).

A schedule outlives the run that made it: when it fires, the process gets its text as a system
event, which starts a run if none is active. The tool reaches only its own process's schedules,
with the limits any schedule has (how many per process, how often at most).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agentloop.kernel.schedules import MAX_AHEAD, LimitReached, ScheduleError, repeats, zone
from agentloop.process.api import ToolsetFn
from agentloop.process.store import NoSuchProcess, ProcessRecord, ScheduleRow
from agentloop.tools.base import Tool, ToolContext, ToolError, ToolResult

if TYPE_CHECKING:
    from agentloop.kernel.kernel import Kernel

NAME = "Schedule"
ACTIONS = ("add", "list", "remove")
PAST_GRACE = 60.0  # seconds an ``at`` may lie in the past (it fires at once) before it is refused as a mistake
FOR_ADD = ("text", "at", "in_seconds", "every_seconds", "cron", "tz", "name")  # the arguments of add alone

_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "action": {"type": "string", "enum": list(ACTIONS)},
        "text": {
            "type": "string",
            "description": "add: what you will be told when it fires; write it as an instruction to yourself.",
        },
        "at": {
            "type": "string",
            "description": "add: when, as an ISO 8601 date-time (2026-12-01T09:00; in tz unless it has an offset).",
        },
        "in_seconds": {"type": "number", "description": "add: when, as seconds from now (instead of at)."},
        "every_seconds": {"type": "number", "description": "add: repeat at this interval."},
        "cron": {
            "type": "string",
            "description": "add: repeat on a calendar, 'minute hour day month weekday' (0 9 * * 1-5: weekdays at 9).",
        },
        "tz": {"type": "string", "description": "The IANA time zone of at and cron, e.g. Europe/Berlin (default UTC)."},
        "name": {"type": "string", "description": "add: a short name to recognise it by."},
        "id": {"type": "string", "description": "remove: the schedule's id (from add or list)."},
    },
    "required": ["action"],
    "additionalProperties": False,
}


class ScheduleTool(Tool):
    """``Schedule`` for one process: add, list and remove its schedules."""

    def __init__(self, kernel: Kernel, record: ProcessRecord) -> None:
        super().__init__(
            NAME,
            "Set a reminder for yourself: at a time, after a delay, at an interval or on a calendar (cron). When"
            " it fires you get its text as a system message, in this conversation, even if nobody is talking to"
            " you then. Also lists and removes your reminders.",
            _SCHEMA,
        )
        self.syscall = "proc.schedule"
        self.kernel = kernel
        self.pid = record.pid

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(arguments) - set(_SCHEMA["properties"]))
        if unknown:
            raise ToolError(f"Schedule does not take {', '.join(f'`{k}`' for k in unknown)}")
        if arguments.get("action") not in ACTIONS:
            raise ToolError(f"action must be one of {', '.join(ACTIONS)}")
        for key in ("text", "at", "cron", "tz", "name", "id"):
            if arguments.get(key) is not None and not isinstance(arguments[key], str):
                raise ToolError(f"`{key}` must be a string")
        for key in ("in_seconds", "every_seconds"):
            value = arguments.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise ToolError(f"`{key}` must be a number of seconds")
            if value is not None and not _finite(value):  # (named here: the kernel would name `at`)
                raise ToolError(f"`{key}` must be a finite number of seconds")
        # an argument the action does not use is an error, not dropped: the call would do something else
        action = arguments["action"]
        unused = [f"`{k}`" for k in FOR_ADD if action != "add" and arguments.get(k) is not None]
        if unused:
            raise ToolError(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} for action=add, not {action}")
        if action != "remove" and arguments.get("id") is not None:
            raise ToolError(f"`id` is for action=remove, not {action}")
        return arguments

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        action = arguments["action"]
        try:
            if action == "add":
                return await self._add(arguments)
            if action == "list":
                return self._listed(await self.kernel.schedules(self.pid), self.kernel.scheduler.clock())
            return await self._remove(arguments.get("id"))
        except (ScheduleError, LimitReached) as exc:
            raise ToolError(str(exc)) from None
        except NoSuchProcess:
            raise ToolError("this process no longer exists") from None

    async def _add(self, arguments: dict[str, Any]) -> ToolResult:
        text = arguments.get("text")
        if not text:
            raise ToolError("add needs `text`: what you want to be told when it fires")
        at, delay = arguments.get("at"), arguments.get("in_seconds")
        if at is not None and delay is not None:
            raise ToolError("give `at` or `in_seconds`, not both")
        cron, tz = arguments.get("cron"), arguments.get("tz")
        if tz is not None and at is None and cron is None:
            raise ToolError("`tz` is the time zone of `at` or `cron` only: `in_seconds` and `every_seconds` need none")
        now = self.kernel.scheduler.clock()
        when = _when(at, tz) if at is not None else None
        if when is not None and when < now - PAST_GRACE:  # (a guessed year or date, not a plan)
            raise ToolError(f"`at` {at} is in the past. {_now(now)}: give a later time, or `in_seconds`.")
        if delay is not None:
            if delay < 0:
                raise ToolError("`in_seconds` must not be negative")
            if delay > MAX_AHEAD:
                raise ToolError("`in_seconds` is more than a hundred years")
            when = now + float(delay)
        row = await self.kernel.scheduler.add(
            self.pid,
            text,
            at=when,
            every=arguments.get("every_seconds"),
            name=arguments.get("name"),
            cron=cron,
            tz=tz if cron is not None else None,
        )
        return ToolResult.text(f"Scheduled: {_line(row, now)}. {_now(now)}.", details={"id": row.id})

    async def _remove(self, schedule_id: str | None) -> ToolResult:
        if not schedule_id:
            raise ToolError("remove needs `id` (see action=list)")
        if not await self.kernel.unschedule(self.pid, schedule_id):
            raise ToolError(f"no schedule {schedule_id!r} here (see action=list)")
        return ToolResult.text(f"Removed schedule {schedule_id}.")

    @staticmethod
    def _listed(rows: list[ScheduleRow], now: float) -> ToolResult:
        lines = [f"{_now(now)}."] + [_line(r, now) for r in rows] if rows else [f"No schedules. {_now(now)}."]
        return ToolResult.text("\n".join(lines), details={"ids": [r.id for r in rows]})


def _when(at: str, tz: str | None) -> float:
    """``at`` (ISO 8601) as epoch seconds; a time without an offset is read in ``tz`` (UTC)."""
    try:
        moment = datetime.datetime.fromisoformat(at.strip())
    except ValueError:
        raise ToolError(f"`at` {at!r} is not an ISO 8601 date-time such as 2026-12-01T09:00") from None
    try:
        where = zone(tz or "UTC")  # (checked with an offset too: a bad tz is refused, not ignored)
    except ScheduleError as exc:
        raise ToolError(str(exc)) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=where)
    return moment.timestamp()


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past any float
        return False


def _now(now: float) -> str:
    """The time ``now``, as a model that knows no date needs it to plan: "Now: Thursday 2026-11-26 15:20 UTC"."""
    return "Now: " + datetime.datetime.fromtimestamp(now, datetime.UTC).strftime("%A %Y-%m-%d %H:%M UTC")


def _until(seconds: float) -> str:
    """How far off a time is: "in 2 d 3 h", "in 16 h 40 min", "in 1 min", "now"."""
    minutes = int(seconds // 60)
    if minutes <= 0:
        return "now"
    days, rest = divmod(minutes, 1440)
    hours, minutes = divmod(rest, 60)
    parts = [f"{days} d"] if days else []
    parts += [f"{hours} h"] if hours else []
    parts += [f"{minutes} min"] if minutes and days < 2 else []  # (minutes matter less days ahead)
    return "in " + " ".join(parts or ["1 d"])


def _line(row: ScheduleRow, now: float) -> str:
    """One schedule as the model reads it back: id, name, next time (and how far off), how it
    repeats, its text."""
    due = datetime.datetime.fromtimestamp(row.next_due, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    due = f"{due} ({_until(row.next_due - now)})"
    repeat = repeats(row)
    repeat = "" if repeat is None else f", {repeat}"
    name = f" ({row.name})" if row.name else ""
    text = row.text if len(row.text) <= 200 else row.text[:200] + "…"
    return f"{row.id}{name}: next {due}{repeat}: {text}"


def schedule_toolset(kernel_ref: list[Kernel]) -> ToolsetFn:
    """A ``ToolsetFn`` adding ``Schedule`` to each run, bound to the run's process."""

    def toolset(record: ProcessRecord, shared: Mapping[str, Tool]) -> Mapping[str, Tool]:
        if not kernel_ref or NAME in shared:
            return shared
        return {**shared, NAME: ScheduleTool(kernel_ref[0], record)}

    return toolset
