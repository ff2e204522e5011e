"""Optional run budgets. None of them is on by default: a run goes until the model is done.

When one trips, the run is not cut off: the model gets one last round with tools disabled and an
instruction to answer from what it has, then the run finishes with the guard's name as its stop
reason. Nothing in the history is discarded.

Execution windows (``window_rounds``, ``window_tool_calls``; ``loop/windows.py``) are the other
kind of budget: used up, a window does not end the run but opens the next one, up to
``max_windows``, and the run ends early (``no_progress``) after ``max_idle_windows`` windows in a
row without progress.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from agentloop.loop.retries import FINAL_INSTRUCTION as REPEATED_FAILURE_INSTRUCTION
from agentloop.loop.retries import REPEATED_CALL, REPEATED_CALL_INSTRUCTION, REPEATED_FAILURE
from agentloop.loop.windows import DEFAULT_MAX_IDLE_WINDOWS, DEFAULT_MAX_WINDOWS, MAX_WINDOWS, NO_PROGRESS
from agentloop.messages import Usage

#: the result of a direct call the model made past the ``max_tool_calls`` budget
CALLS_USED_UP = "Not run: the run's tool call budget is used up."
#: the stop reason of a run asked to finish (``Run.stop``, a ``post_turn`` hook's ``Stop``): the guard that
#: ends it gently (its instruction names no one: a person, a hook or a retry budget may ask)
STOPPED = "stopped"
#: the final round's instruction of the guards that are not budgets
FINAL_INSTRUCTIONS = {
    REPEATED_FAILURE: REPEATED_FAILURE_INSTRUCTION,
    REPEATED_CALL: REPEATED_CALL_INSTRUCTION,
    STOPPED: (
        "You were asked to stop here. Tools are disabled now: say briefly what you did and what is "
        "left undone, and stop."
    ),
    MAX_WINDOWS: (
        "The run has used all of its execution windows. Tools are disabled now: answer the user from "
        "what you have, and say briefly what is left undone."
    ),
    NO_PROGRESS: (
        "The last execution windows made no progress: the same tool calls kept giving the same results "
        "and you wrote nothing new. Tools are disabled now: tell the user what you tried, where you are "
        "stuck and what would unblock you."
    ),
}


@dataclass(frozen=True)
class Guards:
    max_rounds: int | None = None  # model calls that may use tools
    max_tool_calls: int | None = None
    max_wall_clock: float | None = None  # seconds since the run started
    max_tokens: int | None = None  # total tokens over the run
    max_cost: float | None = None  # dollars over the run
    # execution windows (loop/windows.py): off unless one of the two window budgets is set
    window_rounds: int | None = None  # rounds per window
    window_tool_calls: int | None = None  # tool calls per window
    max_windows: int = DEFAULT_MAX_WINDOWS  # windows per run, the last one used up ends it (``max_windows``)
    max_idle_windows: int = DEFAULT_MAX_IDLE_WINDOWS  # windows in a row without progress that end it (``no_progress``)

    def __post_init__(self) -> None:
        # a window budget that cannot be what was meant would split or end a run for nothing
        for name in ("window_rounds", "window_tool_calls", "max_windows", "max_idle_windows"):
            value = getattr(self, name)
            if value is None and name.startswith("window_"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Guards.{name} must be a positive integer, got {value!r}")

    @cached_property
    def active(self) -> bool:
        """Whether any budget is set (asked once per run, so computed once)."""
        return any(
            v is not None
            for v in (
                self.max_rounds,
                self.max_tool_calls,
                self.max_wall_clock,
                self.max_tokens,
                self.max_cost,
                self.window_rounds,
                self.window_tool_calls,
            )
        )

    def tripped(self, rounds: int, tool_calls: int, elapsed: float, usage: Usage) -> str | None:
        """The name of the first budget used up, or None."""
        if self.max_rounds is not None and rounds >= self.max_rounds:
            return "max_rounds"
        if self.max_tool_calls is not None and tool_calls >= self.max_tool_calls:
            return "max_tool_calls"
        if self.max_wall_clock is not None and elapsed >= self.max_wall_clock:
            return "max_wall_clock"
        if self.max_tokens is not None and usage.total_tokens >= self.max_tokens:
            return "max_tokens"
        if self.max_cost is not None and usage.cost.total >= self.max_cost:
            return "max_cost"
        return None

    def calls_used_up(self) -> str:
        """Why a nested call (one a tool makes itself, like CodeMode's) may not run: the same
        budget as the model's direct calls, named with its limit so the program can say so."""
        return (
            f"the run's tool call budget is used up (max_tool_calls={self.max_tool_calls}); "
            "no more tool calls can run in this run"
        )

    def final_instruction(self, reason: str) -> str:
        if reason in FINAL_INSTRUCTIONS:
            return FINAL_INSTRUCTIONS[reason]
        limit = getattr(self, reason)
        return (
            f"The run's budget is used up ({reason}={limit}). Tools are disabled now: answer the "
            "user from what you know so far, and say briefly what is left undone."
        )
