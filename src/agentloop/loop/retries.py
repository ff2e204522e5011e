"""Repeated calls: a model that makes the same call again and again, and gets the same answer each
time, is told to change course, and then stopped.

A failed tool call goes back to the model as an error result, and a capable model corrects its
arguments or tries another way. A weaker one may repeat the very same call, and with no round
limit on by default that loop has no end. So each failure is counted by what it was (the tool,
its arguments and the error it got: a command whose output changes between runs, as a test suite
being fixed does, is not a repeat). The ``MAX_SAME_FAILURES``-th identical failure is told so in
its result; one more trips the ``repeated_failure`` guard, which ends the run like a used-up
budget: one last round without tools, to tell the person what stood in the way.

A call that succeeds can loop the same way (a "doom loop": the same search, the same listing,
the same page read again and again), so successful results are counted too, apart from the
failures and with a higher bar (``MAX_SAME_RESULTS``), tripping the ``repeated_call`` guard. Only
a streak counts: a successful result is a repeat when the previous successful call was the same
call with the same result. The same answer to a check after every change is normal work (edit,
lint "All checks passed!", edit, lint ...; a quiet ``go build``; ``git pull`` "Already up to
date."), and the successful call in between (the change) is what tells it apart from a loop. A
failure in between does not break a streak: it changed nothing the model could rely on (and is
counted as a failure). A tool whose same answer is expected news (a poll of a job that is "still
running") opts out with ``Tool.repeatable``; it breaks a streak like any other successful call.

Both runners count through ``count_repeats``, the durable one keeping the counts with its run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from agentloop.messages import TextContent, ToolCall, ToolResultMessage
from agentloop.tools.base import Tool

REPEATED_FAILURE = "repeated_failure"
REPEATED_CALL = "repeated_call"
MAX_SAME_FAILURES = 3
MAX_SAME_RESULTS = 4
#: the distinct failures a run keeps counting, the latest: the durable run rewrites its record (the
#: counts with it) at every step, so a long run failing in ever new ways must not make every step
#: cost more. A repeat is a recent failure coming back, which this keeps. (Successes keep one count
#: at most: the current streak's.)
MAX_KEPT = 64
FINAL_INSTRUCTION = (
    "The same tool call kept failing the same way, so tools are disabled now: tell the user what you "
    "tried, what failed and what would unblock it."
)
REPEATED_CALL_INSTRUCTION = (
    "The same tool call kept returning the same result, so tools are disabled now: answer the user "
    "from what you have, and say briefly what is left undone."
)


def repeated(failing: bool, repeating: bool) -> str | None:
    """The repeat guard a run tripped, if any (a failure's first: it says more of what went wrong)."""
    return REPEATED_FAILURE if failing else REPEATED_CALL if repeating else None


def _failure_note(count: int) -> str:
    return (
        f"\n\n[This exact call has now failed {count} times with the same error. Do not repeat it: change "
        "the arguments, try another way, or tell the user what is in the way. If it fails the same way "
        "again, tools are disabled for the rest of this run.]"
    )


def _result_note(count: int) -> str:
    return (
        f"\n\n[You have now had this exact result {count} times in a row for this exact call; it will not change. "
        "Use it, change the arguments, or answer the user. If you make the same call again, tools are "
        "disabled for the rest of this run.]"
    )


@dataclass(frozen=True, slots=True)
class _Repeats:
    """One kind of repeat: how many identical results it lets by, and what the last of those
    tells the model."""

    limit: int
    note: Callable[[int], str]


_FAILURES = _Repeats(MAX_SAME_FAILURES, _failure_note)
_RESULTS = _Repeats(MAX_SAME_RESULTS, _result_note)


#: the arguments as canonical JSON, the same for the same arguments in any order; built once: a
#: ``json.dumps`` with options makes an encoder at each call
_canonical = json.JSONEncoder(sort_keys=True, default=str, ensure_ascii=False).encode
#: argument values a ``repr`` writes the same way in every process, as JSON would tell them apart
_FLAT = frozenset({str, int, float, bool, type(None)})
#: a key this long or shorter is kept as it is; a longer one as its digest (the durable run keeps
#: its keys in its record, rewritten at every step)
_SHORT_KEY = 96


def _arguments(arguments: Mapping[str, object]) -> str:
    """``arguments`` in one canonical form: the ``repr`` of its sorted items when every value is
    flat (nearly every call: a quarter of canonical JSON's cost, and every successful call of a
    run is counted), else canonical JSON."""
    for value in arguments.values():
        if type(value) not in _FLAT:
            return _canonical(arguments)
    return repr(sorted(arguments.items())) if len(arguments) > 1 else repr(arguments)


def _text(result: ToolResultMessage) -> str:
    """``result.text``, read directly for a result of one text block (nearly every one: every
    successful call of a run comes here)."""
    content = result.content
    return content[0].text if len(content) == 1 and type(content[0]) is TextContent else result.text


def _key(call: ToolCall, text: str, result: ToolResultMessage) -> str:
    """What a result was, for ``call``: its tool, canonical arguments, ``text`` and media (a
    screenshot tool's text may never change). Short, it is the key itself (no digest to
    compute); long, its digest."""
    whole = f"{call.name}\0{_arguments(call.arguments)}\0{text}"
    content = result.content
    if len(content) != 1 or type(content[0]) is not TextContent:  # (media: a text-only result has none)
        for block in content:
            if not isinstance(block, TextContent):
                whole += f"\0{block.data}"
    return whole if len(whole) <= _SHORT_KEY else hashlib.sha256(whole.encode()).hexdigest()[:16]


def count_failures(
    counts: dict[str, int],
    calls: Sequence[ToolCall],
    results: Sequence[ToolResultMessage],
    *,
    not_counted: frozenset[str] = frozenset(),
) -> tuple[list[ToolResultMessage], bool]:
    """Count the failed results of a batch into ``counts`` (kept for the run); return the results,
    the ones that reach ``MAX_SAME_FAILURES`` with a note for the model, and whether a failure
    went past it (the ``repeated_failure`` guard trips). Results whose text is in ``not_counted``
    (a call skipped, cancelled or never run: not the model's doing) are not failures."""
    out, failing, _ = _count(counts, None, calls, results, not_counted, {})
    return out, failing


def count_repeats(
    failures: dict[str, int],
    repeats: dict[str, int],
    calls: Sequence[ToolCall],
    results: Sequence[ToolResultMessage],
    *,
    not_counted: frozenset[str] = frozenset(),
    tools: Mapping[str, Tool],
) -> tuple[list[ToolResultMessage], bool, bool]:
    """``count_failures``, and the current streak of identical successful results in ``repeats``
    (one entry at most; a batch's calls count in order, the same call twice in one batch once: a
    fan-out is one decision, not a loop): the result that makes it
    ``MAX_SAME_RESULTS`` long gets a note, one more trips ``repeated_call``. Returns the results and
    whether each guard tripped (``repeated_failure``, ``repeated_call``). A result of a tool in
    ``tools`` that is ``repeatable`` (a poll) is no repeat, but ends the streak (its failures still
    count). One pass for both kinds: every call of a run goes through here."""
    return _count(failures, repeats, calls, results, not_counted, tools)


def _count(
    failures: dict[str, int],
    repeats: dict[str, int] | None,
    calls: Sequence[ToolCall],
    results: Sequence[ToolResultMessage],
    not_counted: frozenset[str],
    tools: Mapping[str, Tool],
) -> tuple[list[ToolResultMessage], bool, bool]:
    """Count ``results`` into ``failures`` or (not None) ``repeats``, as they failed or not."""
    by_id = {c.id: c for c in calls}
    out: list[ToolResultMessage] = []
    failing = repeating = False
    batch: set[str] | None = None  # the successful results of this batch counted already
    for result in results:
        counts, kind = (failures, _FAILURES) if result.is_error else (repeats, _RESULTS)
        call = by_id.get(result.tool_call_id)
        if counts is None or call is None:
            out.append(result)
            continue
        text = _text(result)
        if text in not_counted:
            out.append(result)
            continue
        if result.is_error:
            key = _key(call, text, result)
            count = counts[key] = counts.pop(key, 0) + 1  # (moved to the end: the latest last)
        else:
            tool = tools.get(call.name)
            if tool is not None and tool.repeatable:
                counts.clear()  # a successful call between two others: they are no streak
                out.append(result)
                continue
            key = _key(call, text, result)
            if batch is None:
                batch = {key}
            elif key in batch:  # the same call twice in one batch: one decision of the model, one step
                out.append(result)
                continue
            else:
                batch.add(key)
            count = _streak(counts, key)
        if count == kind.limit:
            result = dataclasses.replace(result, content=[*result.content, TextContent(text=kind.note(count))])
        elif count > kind.limit and result.is_error:
            failing = True
        elif count > kind.limit:
            repeating = True
        out.append(result)
    if len(failures) > MAX_KEPT:  # (a run with few distinct failures never looks)
        for key in list(itertools.islice(failures, len(failures) - MAX_KEPT)):
            del failures[key]  # the failures not seen for the longest
    return out, failing, repeating


def _streak(streak: dict[str, int], key: str) -> int:
    """Count a successful result ``key`` into ``streak`` (its one entry: the last successful
    result and how many times in a row it came); return its length now. A different result
    starts a new streak: a successful call came between."""
    count = streak.get(key, 0) + 1
    if count == 1 and streak:
        streak.clear()
    streak[key] = count
    return count
