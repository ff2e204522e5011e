"""What a heartbeat is: its settings, when a ``HEARTBEAT.md`` asks for one, and when an answer
is only an acknowledgement.

The kernel's heartbeat (kernel/heartbeat.py) delivers a check-in to a process as a system event
whose run is named ``heartbeat:<start>`` (the period's start, epoch seconds: unique whatever the
period). Most check-ins find nothing to do, and the agent is asked to say so with ``HEARTBEAT_OK``:
an answer of that kind is marked ``quiet`` in the run's signals, so clients do not show a person a
message every half hour that says nothing happened. The rules live here, below the kernel, because
the process driver marks the signals as it logs them (and the command line reads the settings
without loading the kernel).
"""

from __future__ import annotations

import datetime
import math
import re
from dataclasses import dataclass

__all__ = [
    "ACK",
    "DEFAULT_HEARTBEAT",
    "HEARTBEAT_FILE",
    "REASON",
    "RUN_PREFIX",
    "HeartbeatSettings",
    "has_instructions",
    "is_ack",
    "is_heartbeat_run",
    "parse_hours",
    "quiet_answer",
    "within",
]

ACK = "HEARTBEAT_OK"
RUN_PREFIX = "heartbeat:"
REASON = "heartbeat"  # the reason of a heartbeat run's ``proc.run.started``
# Words besides the token that an answer may have and still be an acknowledgement ("Nothing new
# in the inbox. HEARTBEAT_OK"): a longer answer has something to say, and is shown.
MAX_ACK_EXTRA = 300
_DECORATION = re.compile(r"^[\s*_`~>\"'.!]+|[\s*_`~\"'.!]+$")


def is_heartbeat_run(run_id: str) -> bool:
    return run_id.startswith(RUN_PREFIX)


def is_ack(text: str | None) -> bool:
    """Whether ``text`` acknowledges a check-in: the token at its start or end (markdown emphasis
    and punctuation around it ignored), and at most ``MAX_ACK_EXTRA`` characters besides."""
    if not text:
        return False
    stripped = _DECORATION.sub("", text)
    if stripped.startswith(ACK):
        rest = stripped[len(ACK) :]
    elif stripped.endswith(ACK):
        rest = stripped[: -len(ACK)]
    else:
        return False
    return len(_DECORATION.sub("", rest)) <= MAX_ACK_EXTRA


def quiet_answer(run_id: str, text: str | None) -> bool:
    """Whether an answer of run ``run_id`` is a heartbeat's acknowledgement, not to be shown."""
    return is_heartbeat_run(run_id) and is_ack(text)


# ------------------------------------------------------------------ when and how often

HEARTBEAT_FILE = "HEARTBEAT.md"
DEFAULT_EVERY = 30 * 60.0
DEFAULT_HOURS = "08:00-23:00"
SHORTEST_EVERY = 60.0  # each beat is a model call
DEFAULT_TEXT = (
    f"Heartbeat check-in. Follow the instructions of {HEARTBEAT_FILE} in your workspace (they are in "
    f"your context). If nothing needs attention, answer only {ACK}."
)
_HOURS = re.compile(r"(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})")
_EMPTY_LINE = re.compile(r"\s*(#.*|[-*+]\s*(\[[ xX]?\])?\s*|<!--.*-->)?\s*")

Hours = tuple[datetime.time, datetime.time]
DAYTIME: Hours = (datetime.time(8), datetime.time(23))  # (the default, as parse_hours(DEFAULT_HOURS))


def parse_hours(spec: str | None) -> Hours | None:
    """``"08:00-23:00"`` as a (start, end) pair of local times; ``None``, ``""`` or ``"all"`` for
    the whole day. An end before the start spans midnight (``"22:00-06:00"``); ``24:00`` is the
    end of the day. ``ValueError`` says what a bad spec should look like."""
    if spec is None or spec.strip().lower() in ("", "all", "always"):
        return None
    match = _HOURS.fullmatch(spec.strip())
    if match is None:
        raise ValueError(f"active hours must look like 08:00-23:00, got {spec!r}")
    h1, m1, h2, m2 = map(int, match.groups())
    if h1 > 23 or m1 > 59 or h2 > 24 or m2 > 59 or (h2 == 24 and m2):
        raise ValueError(f"active hours must be times of day between 00:00 and 24:00, got {spec!r}")
    end = datetime.time.max if h2 == 24 else datetime.time(h2, m2)
    return datetime.time(h1, m1), end


def within(hours: Hours | None, moment: datetime.time) -> bool:
    if hours is None:
        return True
    start, end = hours
    if start == end:
        return True
    if start < end:
        return start <= moment < end
    return moment >= start or moment < end  # across midnight


def has_instructions(text: str) -> bool:
    """Whether a ``HEARTBEAT.md`` asks for anything: a line other than headings, empty list
    items, comments and blank lines. A template left as it was shipped asks for nothing."""
    text = re.sub(r"<!--.*?-->", "", text.removeprefix("\ufeff"), flags=re.DOTALL)  # (an editor's BOM)
    return any(not _EMPTY_LINE.fullmatch(line) for line in text.splitlines())


@dataclass(frozen=True)
class HeartbeatSettings:
    """How often the check-ins come, within which local hours, and what they say."""

    every: float = DEFAULT_EVERY
    hours: Hours | None = DAYTIME
    text: str = DEFAULT_TEXT

    def __post_init__(self) -> None:
        if self.hours is not None and not (
            isinstance(self.hours, tuple)
            and len(self.hours) == 2
            and all(isinstance(t, datetime.time) for t in self.hours)
        ):
            raise ValueError(f"heartbeat hours must be a (start, end) pair of times, got {self.hours!r}")
        every = self.every
        if isinstance(every, bool) or not isinstance(every, int | float) or not _finite(every):
            raise ValueError(f"heartbeat every must be a number of seconds, got {every!r:.40}")
        if every < SHORTEST_EVERY:
            raise ValueError(f"heartbeat every must be at least {SHORTEST_EVERY:g} seconds, got {every:g}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise ValueError("heartbeat text must be a non-empty string")


def _finite(number: float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an int no float can hold
        return False


DEFAULT_HEARTBEAT = HeartbeatSettings()
