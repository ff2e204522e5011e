"""The ``memory`` tool: an account's daily memory files, which the prompt shows for today and
yesterday only, searched, read, added to and pruned by the agent itself.

The files live in the owner's home (``process/memory.py``), where no file tool may go: this tool is
the one way in, and it reaches only the memory of the process's own owner. What the agent
remembers is written like what a compaction keeps, under a heading naming its source, so the
prompt of every process of the owner shows it from the next run on.

A run's recalled memories (``process/prompt.py``) do not go through this tool: the engine finds the
owner's home itself, so a run whose tool scope hides ``memory``, or whose application brings its
own tool of that name, still has its older memories recalled (read-only, in its prompt).
"""

from __future__ import annotations

import datetime
import errno
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from agentloop.process.api import ToolsetFn
from agentloop.process.memory import (
    MAX_DAY_BYTES,
    append_daily_memory,
    forget_daily_memory,
    memory_days,
    memory_entries,
    owner_home,
    read_daily_memory,
    read_days,
)
from agentloop.process.store import ProcessRecord
from agentloop.tools.base import FunctionTool, Tool, ToolError, ToolResult, tool

__all__ = ["memory_tool", "memory_toolset"]

SEARCH_LIMIT = 10
MAX_SHOWN_CHARS = 60_000  # what one answer shows of a day's file or of the matches
MAX_REMEMBER_CHARS = 4_000  # one entry: a fact or a few, not a document
SOURCE = "the agent"


def memory_toolset(data_dir: Path) -> ToolsetFn:
    """Gives every run the ``memory`` tool over its owner's memory (one tool object per owner)."""
    by_owner: dict[str, Tool] = {}

    def toolset(record: ProcessRecord, shared: Mapping[str, Tool]) -> Mapping[str, Tool]:
        if "memory" in shared:
            return shared
        found = by_owner.get(record.owner)
        if found is None:
            if len(by_owner) >= 1024:
                by_owner.clear()
            found = by_owner[record.owner] = memory_tool(owner_home(data_dir, record.owner))
        return {**shared, "memory": found}

    return toolset


def memory_tool(home: Path) -> FunctionTool:
    """The ``memory`` tool over the memory files under ``home`` (an owner's home)."""

    @tool(
        name="memory",
        description=(
            "Your long-term memory: notes kept by day (today's and yesterday's are in the system prompt). "
            "action='search' finds past entries matching query; 'list' names the days; 'read' shows a day "
            "(day as YYYY-MM-DD); 'remember' keeps text for later conversations; 'forget' removes a day's "
            "entries whose text (not heading) contains text."
        ),
        thread=True,
        keeps_cut_results=False,  # an account's memory, never copied into the workspace every account shares
    )
    def memory(
        action: Literal["search", "list", "read", "remember", "forget"],
        query: str | None = None,
        day: str | None = None,
        text: str | None = None,
        limit: int = SEARCH_LIMIT,
    ) -> ToolResult:
        """Args:
        action: search, list, read, remember or forget.
        query: words to look for, for search (case-insensitive; every word must match).
        day: YYYY-MM-DD, for read and forget.
        text: what to keep, for remember; what the entries to remove contain, for forget.
        limit: at most this many search results, newest first.
        """
        try:
            if action == "list":
                return _list(home)
            if action == "search":
                return _search(home, query or "", max(1, min(limit, 50)))
            if action == "remember":
                return _remember(home, text or "")
            when = _day(day, action)
            if action == "read":
                return _read(home, when)
            return _forget(home, when, text or "")
        except (OSError, UnicodeDecodeError) as exc:  # a damaged or unsafe file: the model may go on
            raise ToolError(f"the memory files cannot be used: {exc}") from None

    return memory


def _day(value: str | None, action: str) -> datetime.date:
    if not value:
        raise ToolError(f"action={action!r} needs a day (YYYY-MM-DD; action='list' names them)")
    try:
        return datetime.date.fromisoformat(value)
    except ValueError:
        raise ToolError(f"day must be YYYY-MM-DD, got {value!r}") from None


def _list(home: Path) -> ToolResult:
    days = memory_days(home) if home.is_dir() else []
    if not days:
        return ToolResult.text("No memories yet.")
    lines = [f"{day.isoformat()} ({size} bytes)" for day, size in days[-200:]]
    more = f" (the last 200 of {len(days)})" if len(days) > 200 else ""
    return ToolResult.text(f"Days with memories, oldest first{more}:\n" + "\n".join(lines))


def _search(home: Path, query: str, limit: int) -> ToolResult:
    words = query.lower().split()
    if not words:
        raise ToolError("action='search' needs a query")
    found: list[str] = []
    unreadable: list[str] = []
    for day, text in read_days(home) if home.is_dir() else ():  # newest first
        if isinstance(text, OSError | UnicodeDecodeError):  # one damaged day does not hide all the others
            unreadable.append(f"{day.isoformat()} ({text})")
            continue
        for entry in memory_entries(text):
            if all(w in entry.lower() for w in words):
                found.append(f"[{day.isoformat()}] {entry}")
                if len(found) >= limit:
                    break
        if len(found) >= limit:
            break
    skipped = f"\n\n(days that could not be searched: {', '.join(unreadable)})" if unreadable else ""
    if not found:
        return ToolResult.text(f"No memory matches {query!r}.{skipped}")
    return ToolResult.text(_clip("\n\n".join(found)) + skipped)


def _read(home: Path, day: datetime.date) -> ToolResult:
    text = read_daily_memory(home, day) if home.is_dir() else None
    if text is None:
        raise ToolError(f"no memories for {day.isoformat()} (action='list' names the days that have some)")
    return ToolResult.text(_clip(text.strip()))


def _remember(home: Path, text: str) -> ToolResult:
    text = text.strip()
    if not text:
        raise ToolError("action='remember' needs the text to keep")
    if len(text) > MAX_REMEMBER_CHARS:
        raise ToolError(f"keep it short: at most {MAX_REMEMBER_CHARS} characters per entry, got {len(text)}")
    home.mkdir(parents=True, exist_ok=True)
    try:
        name = append_daily_memory(home, text, source=SOURCE, max_bytes=MAX_DAY_BYTES)
    except OSError as exc:
        if exc.errno != errno.EFBIG:
            raise
        raise ToolError(
            f"today's memory file is full ({exc.strerror}): forget entries of today that are no longer"
            " needed, or keep fewer and shorter facts"
        ) from None
    return ToolResult.text(f"Remembered (in {name}); every conversation of yours sees it from its next run.")


def _forget(home: Path, day: datetime.date, text: str) -> ToolResult:
    if not text.strip():
        raise ToolError("action='forget' needs text that the entries to remove contain")
    removed = forget_daily_memory(home, day, text) if home.is_dir() else 0
    if not removed:
        raise ToolError(f"no entry of {day.isoformat()} contains {text!r}")
    return ToolResult.text(f"Forgot {removed} entr{'y' if removed == 1 else 'ies'} of {day.isoformat()}.")


def _clip(text: str) -> str:
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    return text[:MAX_SHOWN_CHARS] + f"\n[... {len(text) - MAX_SHOWN_CHARS} more characters]"
