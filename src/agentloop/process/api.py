"""The durable runner's vocabulary, shared by its parts and by the layers above: the hooks a
``ProcessEngine`` takes (approval policy, system prompt, toolset, archive), what input delivery
returns, and the ids of processes, runs and calls. Separate from ``engine.py`` so that the parts of
the runner (and the approval policy, the kernel) can name them without importing the runner."""

from __future__ import annotations

import functools
import hashlib
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from agentloop.loop.state import LoopConfig
from agentloop.messages import Message, ToolCall
from agentloop.process.store import HilRow, ProcessRecord, ToolCallRow
from agentloop.tools.base import Tool
from agentloop.tools.skills import SkillCatalog

# how input meets a run under way (``admission.send``): ``reject`` delivers only to an idle process
SendMode: TypeAlias = Literal["steer", "queue", "interrupt", "reject"]


@dataclass(frozen=True)
class Approval:
    """What the approval policy says about one call."""

    action: Literal["auto", "ask", "deny"]
    tags: tuple[str, ...] = ()
    reason: str = ""
    fingerprint: str = ""


@dataclass(frozen=True)
class PromptSection:
    """One ``[name]`` block of a compiled prompt as its manifest shows it. Files are display
    names (``AGENTS.md``, ``context.d/10-me.md``, ``skills.d/deploy``): the manifest is logged
    for watchers, who must not learn how the server's disk is laid out."""

    name: str
    bytes: int
    files: tuple[str, ...] = ()
    truncated: bool = False  # a file of it was cut to fit the context budget
    omitted: tuple[str, ...] = ()  # files left out, over the budget


@dataclass(frozen=True)
class CompiledPrompt:
    """A run's system prompt with what went into it, which a ``PromptFn`` may return instead of
    the bare text, so the run's ``proc.prompt.compiled`` can say why the prompt is as large as it
    is. ``base``: bytes of the kernel's own prompt, which comes before the sections. A prompt
    function that caches its result returns the same object, so the digest is computed once."""

    text: str
    sections: tuple[PromptSection, ...] = ()
    warnings: tuple[str, ...] = ()  # what assembly noticed (unreadable files...), paths as in ``files``
    base: int = 0
    skills: SkillCatalog | None = None  # the index's skills, which a run's input may activate

    @functools.cached_property
    def digest(self) -> str:
        """sha256 of the text: which prompt the run was given."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    @functools.cached_property
    def size(self) -> int:
        """The text's length in UTF-8 bytes."""
        return len(self.text.encode("utf-8"))


ApprovalFn: TypeAlias = Callable[[ProcessRecord, ToolCallRow], Awaitable[Approval]]
# A run's configuration from the kernel's, for one process (e.g. its owner's model choice).
ConfigFn: TypeAlias = Callable[[ProcessRecord, LoopConfig], LoopConfig]
# A run's system prompt, given the process and the tools the run has (the prompt names their MCP
# servers): the text, or a ``CompiledPrompt`` that also says what it was built from.
PromptFn: TypeAlias = Callable[[ProcessRecord, Mapping[str, Tool]], Awaitable[str | CompiledPrompt]]
# The tools one process's run sees, given the process and the shared tools (e.g. the shared ones
# with a ``target`` argument routing to the owner's devices, plus the devices' own tools); may be
# async (e.g. to start the owner's MCP servers).
ToolsetFn: TypeAlias = Callable[[ProcessRecord, Mapping[str, Tool]], Mapping[str, Tool] | Awaitable[Mapping[str, Tool]]]
ArchiveFn: TypeAlias = Callable[[ProcessRecord, str, list[Message], dict[str, Any]], Awaitable[str | None]]
# Keeps memories a summary model picked out (the daily memory file), saying what found them (a
# compaction, a reset); returns where, or None.
MemoryFn: TypeAlias = Callable[[ProcessRecord, str, str], Awaitable[str | None]]
# Told (pid, run id, reason) once a run was aborted, so what the run started elsewhere can stop
# with it (the kernel: the subagents it started).
AbortedFn: TypeAlias = Callable[[str, str, str], Awaitable[None]]


async def approve_everything(process: ProcessRecord, row: ToolCallRow) -> Approval:
    return Approval("auto")


_last_us = 0
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)


def new_id() -> str:
    """A fresh id: 13 hex digits of the time in microseconds (strictly increasing in this runtime),
    then 6 random ones. Ids sort by creation, so the rows keyed by them (processes, runs, calls)
    are appended at the end of their index instead of anywhere in it: fewer pages per commit.
    The random part only keeps the workers sharing a store apart; no id is a secret (every access
    is checked against the owner), so a generator seeded from the OS (again in a forked child)
    serves, without the system call ``os.urandom`` costs per id. It is this module's own: a
    program seeding ``random`` for its own reasons does not make ids repeat across workers."""
    global _last_us
    _last_us = max(time.time_ns() // 1000, _last_us + 1)
    return f"{_last_us:013x}{_ids.getrandbits(24):06x}"


@dataclass(frozen=True)
class Receipt:
    """The answer to ``send``: which run the input belongs to, and whether it waits in the queue.
    ``handled``: an input hook took the input (``loop.hooks.Handled``): nothing was written and
    no run started; ``run_id`` is then the caller's own id, or empty."""

    run_id: str
    queued: bool
    position: int = 0
    handled: bool = False


@dataclass(frozen=True)
class Compacted:
    """The answer to a compaction asked for (``ProcessEngine.compact``): whether the history was
    summarised, and if not, why (``note``), so that a caller can tell "nothing worth compacting"
    from a failure, which raises instead. Token counts are estimates of the history alone."""

    compacted: bool
    note: str = ""
    removed: int = 0  # messages the summary replaced
    tokens_before: int = 0
    tokens_after: int = 0
    archive: str | None = None  # the name of the archive that holds what was removed
    segment_id: str | None = None  # its ``history_segments`` row


class RunActive(ValueError):
    """What was asked needs the process idle, and a run is under way: nothing was done; ask again
    once it has finished (or abort it). ``run_id``: that run, when the refusal knew it (a send
    with ``mode="reject"``), so a caller can follow or steer it instead."""

    def __init__(self, pid: str, what: str, run_id: str | None = None) -> None:
        super().__init__(f"process {pid} has a run under way; {what} needs it idle")
        self.pid = pid
        self.run_id = run_id


class RunNotCurrent(ValueError):
    """A send named the run it meant (``expected_run_id``) and that run is not the process's
    current one (it ended, or another took its place): nothing was delivered, queued or aborted,
    since input written for one run would otherwise land in another, or start a run of its own.
    ``current``: the process's run at the refusal (None: idle), to decide on anew."""

    def __init__(self, pid: str, expected: str, current: str | None) -> None:
        now = f"its current run is {current}" if current is not None else "it has no run under way"
        super().__init__(f"run {expected} is not the current run of process {pid}: {now}")
        self.pid = pid
        self.expected = expected
        self.current = current


def call_of(row: ToolCallRow | HilRow) -> ToolCall:
    """The model's tool call a pending-call or approval row stands for."""
    return ToolCall(id=row.tool_call_id, name=row.tool_name, arguments=row.args)
