"""Repeated failures: a model that makes the same failing call again and again is told to change
course, and then stopped.

A failed tool call goes back to the model as an error result, and a capable model corrects its
arguments or tries another way. A weaker one may repeat the very same call, and with no round
limit on by default that loop has no end. So each failure is counted by what it was (the tool,
its arguments and the error it got: a command whose output changes between runs, as a test suite
being fixed does, is not a repeat). The ``MAX_SAME_FAILURES``-th identical failure is told so in
its result; one more trips the ``repeated_failure`` guard, which ends the run like a used-up
budget: one last round without tools, to tell the person what stood in the way.

Both runners count through ``count_failures``, the durable one keeping the counts with its run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

from agentloop.messages import TextContent, ToolCall, ToolResultMessage

REPEATED_FAILURE = "repeated_failure"
MAX_SAME_FAILURES = 3
#: the distinct failures a run keeps counting, the latest: the durable run rewrites its record
#: (the counts with it) at every step, so a long run failing in ever new ways must not make
#: every step cost more. A repeat is a recent failure coming back, which this keeps.
MAX_KEPT = 64
FINAL_INSTRUCTION = (
    "The same tool call kept failing the same way, so tools are disabled now: tell the user what you "
    "tried, what failed and what would unblock it."
)


def _note(count: int) -> str:
    return (
        f"\n\n[This exact call has now failed {count} times with the same error. Do not repeat it: change "
        "the arguments, try another way, or tell the user what is in the way. If it fails the same way "
        "again, tools are disabled for the rest of this run.]"
    )


def _key(call: ToolCall, result: ToolResultMessage) -> str:
    arguments = json.dumps(call.arguments, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(f"{call.name}\0{arguments}\0{result.text}".encode()).hexdigest()[:16]


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
    by_id = {c.id: c for c in calls}
    out: list[ToolResultMessage] = []
    tripped = False
    touched: set[str] = set()
    for result in results:
        call = by_id.get(result.tool_call_id)
        if not result.is_error or call is None or result.text in not_counted:
            out.append(result)
            continue
        key = _key(call, result)
        count = counts[key] = counts.pop(key, 0) + 1  # (moved to the end: the latest last)
        touched.add(key)
        if count == MAX_SAME_FAILURES:
            result = dataclasses.replace(result, content=[*result.content, TextContent(text=_note(count))])
        tripped = tripped or count > MAX_SAME_FAILURES
        out.append(result)
    for key in [k for k in counts if k not in touched][: max(0, len(counts) - MAX_KEPT)]:
        del counts[key]  # the failures not seen for the longest
    return out, tripped
