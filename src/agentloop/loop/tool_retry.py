"""``ToolRetry``: budgets for failing tool calls, told to the model, and a gentle end when spent.

A failed call goes back to the model as an error result and the model decides what to do next. On
its own it does not know how much more failing the run will put up with, and nothing tells a
"file not found" (look first, then try again) from a "denied by policy" (do not try again) or a
tool's own crash (trying again is pointless). This piece, added with ``agent.use(ToolRetry())``
(or ``Kernel.open(pieces=[ToolRetry()])``), gives each failure a class and counts it against
per-run budgets, the way Pioneer's retry controller does:

- one budget per class (``DEFAULT_CLASS_BUDGETS``: three invalid-argument failures, two not-found
  ones, none for ``needs_narrowing`` or ``internal`` …),
- one per tool name (``per_tool``, 16),
- one per *signature*, the tool with the same arguments failing the same way (``per_signature``, 3),
- and one for the rounds (batches of calls) that had a retryable failure (``rounds``, 32).

A failed result gets one compact line with its class, what is left of each budget and a hint, so
the model can plan its next try. The failure that would go past a budget is marked as the one
that spent it, and the run ends after that turn as ``Run.stop`` ends it: one more answer without
tools, in which the model tells the person what stood in the way (stop reason ``stopped``). A
round in which nothing retryable failed (a success, or only refusals) closes the *episode*: the
budgets start again from full, so a long run that keeps making progress is never stopped by
failures it has got past. Refusals (a policy denial, a blocked call) are classified but not
counted: repeating them cannot help, and the approval layer already says so.

Classification reads what agentloop's own tools report (Shell's ``exit_code``/``timed_out`` in
``details``, Fetch's HTTP ``status``, the file tools' and the loop's error texts); a tool of your
own may classify its failures itself (``details={"error_class": "not_found", "retry_hint": ...}``),
and ``classify=`` takes a function that sees every failure first.

Calls refused before they ran (arguments that fail validation, an unknown tool, a refusal) never
reach ``after_tool_call`` hooks, so their result cannot carry the line: they are counted when the
turn ends (``post_turn``) and their facts given to the model with its next call, as context. A
durable call cut off by a restart of the runtime (it may or may not have taken effect) is no
failure of the model's: it is classed ``cancelled`` and not counted.

The counts live in this object, per run (its process and ``run_id``: one piece serves every process
of a kernel, and run ids repeat across processes), and need no storage of their own: the first time
the piece sees a run it has no counts for after the run's first turn (a durable run resumed by a
new ``Kernel.open``, or one forgotten past ``MAX_RUNS``), it counts the run's batches again from the
history, back to the previous run's end. A failure that carries its line is taken as the line says
(its class was decided once, by whatever classifier was in place), the others are classified again.
Where that end cannot be told (input that joined the run after an answer of the model's) the older
part is not counted, nor more batches than the run's turn (a run before that left no end: an abort
during a model call), which errs on the side of going on; the repeat guard (``loop/retries.py``),
which keeps its counts with the run, still stands behind it. That guard compares failures by their
text; the budget line differs from one failure to the next, so with this piece it is the signature
budget (three identical failures, the same limit) that ends a loop of identical calls.

When a budget is spent, the final round (tools off) is told why, next to the generic instruction
of a stopped run, so the model says what failed rather than that it was asked to stop.

A watched in-memory run reports each step's episode at its end (``post_turn``, through
``TurnInfo.emit``): a ``tool_retry_scheduled`` event per failure counted, ``tool_retry_resolved``
when a step without one gives the budgets back, ``tool_retry_exhausted`` when one is spent (a
durable process logs them as ``proc.run.tool.retry.*`` signals: ``process/calls.py``).
Failures counted again from a history (a resumed run) are not reported anew.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeAlias, cast, get_args

from agentloop.events import LoopEvent, ToolRetryExhausted, ToolRetryResolved, ToolRetryScheduled
from agentloop.loop.execute import CANCELLED, NOT_COUNTED
from agentloop.loop.hooks import Hooks, Stop, ToolCallInfo, TurnInfo
from agentloop.loop.state import LoopConfig
from agentloop.messages import AssistantMessage, Message, SystemMessage, TextContent, ToolCall, ToolResultMessage
from agentloop.tools.base import ToolResult

log = logging.getLogger("agentloop.tool_retry")

# a run of a process (its id, None in memory) and its run id: what the counts are kept per
RunKey: TypeAlias = tuple[str | None, str]

ErrorClass: TypeAlias = Literal[
    "invalid_arguments",
    "not_found",
    "permission_denied",
    "command_not_found",
    "timeout",
    "cancelled",
    "execution_failed",
    "needs_narrowing",
    "internal",
    "output_truncated",
    "unknown",
]
ERROR_CLASSES: tuple[str, ...] = get_args(ErrorClass)

#: retries allowed per class and episode (Pioneer's defaults). Zero means the first such failure
#: spends the budget: a search that must be narrowed, or a tool that crashed, is not worth a retry
#: of the same kind, and the run ends with the model saying so.
DEFAULT_CLASS_BUDGETS: Mapping[str, int] = {
    "invalid_arguments": 3,
    "not_found": 2,
    "permission_denied": 1,
    "command_not_found": 2,
    "timeout": 2,
    "cancelled": 1,
    "execution_failed": 2,
    "needs_narrowing": 0,
    "internal": 0,
    "output_truncated": 3,
    "unknown": 1,
}
DEFAULT_PER_TOOL = 16
DEFAULT_PER_SIGNATURE = 3
DEFAULT_ROUNDS = 32
# how the budget line of a result that ran begins (``after_tool_call``), and what it says: the class,
# and ", not retryable" for a failure that was not counted
_LINE = "\n[tool retry: class="
_TOLD = re.compile(r"\n\[tool retry: class=(\w+)(, not retryable;)?.*\]\Z", re.DOTALL)
#: runs whose counts are kept at once; the oldest is forgotten past it (as ``ToolReveal`` does)
MAX_RUNS = 1024

_HINTS: Mapping[str, str] = {
    "invalid_arguments": "fix the arguments to match the tool's parameters, then call it again",
    "not_found": "check the name or path first (list or search), then try again",
    "permission_denied": "this is not allowed; choose another path or approach instead of repeating it",
    "command_not_found": "the program is not installed or not on PATH; check with `command -v` or do without it",
    "timeout": "make the work smaller or faster (or run it in the background), or wait before trying again",
    "cancelled": "the call was cancelled; make it again only if it is still needed",
    "execution_failed": "read the error above and fix its cause before trying again",
    "needs_narrowing": "narrow the request (a path, a pattern, a range); the same arguments will fail again",
    "internal": "the tool itself failed; trying again will not help, tell the user",
    "output_truncated": "the output was cut; ask for less (filter it, take its tail, a range) to see the error",
    "unknown": "retry with corrected arguments",
}


@dataclass(frozen=True)
class ToolFailure:
    """A failed tool result, as a classifier sees it. ``executed`` is False for a call refused
    before it ran (bad arguments, an unknown tool, a refusal); ``details`` is the tool's own."""

    tool_name: str
    arguments: Mapping[str, Any]
    text: str
    details: Any
    executed: bool


@dataclass(frozen=True)
class Classification:
    """What kind of failure a result is. A failure that is not ``retryable`` (a policy denial) is
    not counted against any budget; ``hint`` (else the class's default) tells the model what to do."""

    error_class: ErrorClass
    retryable: bool = True
    hint: str | None = None


Classifier: TypeAlias = Callable[[ToolFailure], "Classification | None"]

_REFUSED = Classification(
    "permission_denied", retryable=False, hint="the call was refused before it ran; do not repeat it"
)
_DENIED = Classification(
    "permission_denied", retryable=False, hint="refused by the approval policy or the person asked; do not repeat it"
)
_REFUSALS = ("Tool execution denied", "Tool execution not approved", "Tool execution was blocked")
# a durable call a restart cut off (``process/calls.py``'s ``INTERRUPTED_BY_RESTART``, not imported:
# the loop does not load the durable side): the runtime's doing, not the model's, so not counted
_INTERRUPTED = Classification(
    "cancelled",
    retryable=False,
    hint="the runtime restarted while the call ran and it may have taken effect: check before making it again",
)
_INTERRUPTED_TEXT = re.compile(r"\A(Tool call )?interrupted by a restart\b", re.IGNORECASE)

# What the loop and the built-in tools say, checked in this order against the text of a failure
# that no ``details`` explained (Shell's and Fetch's are read first). The loop's own argument
# errors come first: they quote the model's arguments, which may hold any words at all.
_PATTERNS: tuple[tuple[str, ErrorClass], ...] = (
    (r"\AInvalid arguments for \S+: \w+(Error|Exception)\b", "internal"),  # a validator's own bug
    (r"\AValidation failed for tool\b|\AThe arguments of this \S+ call\b", "invalid_arguments"),
    # the tool's own crash, or a hook's: a programming error, not the model's arguments
    (r"\A(before|after)-tool-call hook failed", "internal"),
    (
        r"\A(TypeError|AttributeError|NameError|AssertionError|NotImplementedError|UnboundLocalError"
        r"|RecursionError|KeyError|IndexError)\b",
        "internal",
    ),
    (r"\ACancelledError\b|\bstopped on request\b", "cancelled"),
    (r"\btimed out\b|\ATimeoutError\b", "timeout"),
    (r"\bnarrow (the|it|your)\b|\btoo broad\b", "needs_narrowing"),
    (r"\bcommand not found\b|\bnot on PATH\b", "command_not_found"),
    # Edit's old_string (missing, or not unique), Read's offset, a file a text tool cannot take:
    # the model's arguments to fix (checked before "not found", "denied" and the like)
    (
        r"\bwas not found in\b|\bidentical; nothing to change\b|\Aold_string occurs \d+ times\b"
        r"|\Aoffset \d+ is past the end of\b|\bis a binary file\b",
        "invalid_arguments",
    ),
    # Fetch's refusal of an address that is not public: a rule, not a failure of the request
    (r"\Arefused to fetch\b", "permission_denied"),
    (
        r"Permission denied|Operation not permitted|\bread-only\b|\boutside the workspace\b"
        # ("may not", but not the "may or may not" of a call whose outcome is unknown)
        r"|\bescapes the workspace\b|(?<!\bor )\bmay not\b|\ARefusing to\b|\bdenied\b|\AAccessDenied"
        r"|\APermissionError\b",
        "permission_denied",
    ),
    (
        r"\bnot found\b|No such file|\bdoes not exist\b|\bcannot resolve\b|\AFileNotFoundError\b"
        r"|\bis not available in this turn\b",
        "not_found",
    ),
    (
        r"\bmust be\b|\bmust not\b|\bis empty\b|\AInvalid\b|\bnot valid\b|\bnot a URL\b|\bonly http and https\b"
        r"|\bhas a NUL byte\b|\bis a directory(;| that is not empty)|\bis not a (regular file|directory)\b"
        r"|\AValueError\b|\A\w+ is at most\b",
        "invalid_arguments",
    ),
    (r"characters cut: the result had\b", "output_truncated"),
)
_RULES: tuple[tuple[re.Pattern[str], ErrorClass], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), cls) for pattern, cls in _PATTERNS
)


def classify_failure(failure: ToolFailure) -> Classification:
    """The default classification of a failed result (see the module docstring for what is read)."""
    details = failure.details if isinstance(failure.details, dict) else {}
    own = details.get("error_class", details.get("errorClass"))
    if isinstance(own, str) and own in ERROR_CLASSES:  # a tool that classified its own failure
        hint = details.get("retry_hint")
        retryable = details.get("retryable", True)
        return Classification(
            cast(ErrorClass, own), retryable is not False, hint if isinstance(hint, str) and hint else None
        )
    text = failure.text
    # the approval layer's refusals: by policy, by the person asked ("denied by user", with their
    # words), for a process nobody can be asked in, and a request nobody answered in time. The
    # person's own "no" is no failure to retry either: counted, a second one ended the run
    if text.startswith(_REFUSALS):
        return _DENIED
    if _INTERRUPTED_TEXT.search(text):
        return _INTERRUPTED
    if "exit_code" in details or "timed_out" in details:
        return _shell(details, text)
    status = details.get("status")
    if isinstance(status, int) and not isinstance(status, bool) and 400 <= status <= 599:
        return _http(status)
    for pattern, cls in _RULES:
        if pattern.search(text):
            return Classification(cls)
    if not failure.executed:  # refused by a hook or a check with words of its own
        return _REFUSED
    return Classification("execution_failed" if text.strip() else "unknown")


def _shell(details: Mapping[str, Any], text: str) -> Classification:
    """A command's failure, from how it ended and what it printed (a shell's words for the usual
    causes are stable: ``command not found``, ``No such file or directory``, ``Permission denied``)."""
    if details.get("timed_out"):
        return Classification("timeout")
    if details.get("stopped"):
        return Classification("cancelled")
    code = details.get("exit_code")
    if code == 127 or re.search(r"\bcommand not found\b|^\S*sh: \d+: \S+: not found$", text, re.MULTILINE):
        return Classification("command_not_found")
    if code == 126 or re.search(r"Permission denied|Operation not permitted", text):
        return Classification("permission_denied")
    if re.search(r"No such file or directory|\bnot found\b|does not exist", text, re.IGNORECASE):
        return Classification("not_found")
    if details.get("truncated"):
        return Classification("output_truncated")
    return Classification("execution_failed")


def _http(status: int) -> Classification:
    """An HTTP error status: 404/410 are a wrong address, 401/403 a door that stays shut, 408/429
    a server asking for time (Pioneer counts a rate limit as a timeout), the rest a failure."""
    if status in (404, 410):
        return Classification("not_found")
    if status in (401, 403):
        return Classification("permission_denied")
    if status in (408, 429):
        return Classification("timeout", hint="the server asks for time: wait, or use another source")
    return Classification("execution_failed")


def signature(tool_name: str, arguments: Mapping[str, Any], error_class: str) -> str:
    """The failure signature: the tool, its arguments in a canonical form (keys sorted at every
    depth, so the model's key order does not matter) and the class."""
    canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), default=str, ensure_ascii=False)
    digest = hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{tool_name}:{digest}:{error_class}"


@dataclass
class _Episode:
    """The counts since the last round without a retryable failure."""

    rounds: int = 0
    by_class: Counter[str] = field(default_factory=Counter)
    by_tool: Counter[str] = field(default_factory=Counter)
    by_signature: Counter[str] = field(default_factory=Counter)
    counted_batch: str | None = None  # the batch whose round is counted already


@dataclass
class _Run:
    """One run's retry state: its episode and the batch (one model turn's calls) being seen."""

    episode: _Episode = field(default_factory=_Episode)
    batch: str | None = None
    seen: set[str] = field(default_factory=set)  # call ids of ``batch`` counted (or let be) already
    retried: bool = False  # a retryable failure in ``batch``
    closed: bool = False  # ``batch``'s end handled (the episode resolved or kept)
    exhausted: str | None = None
    stopped: bool = False
    told_end: bool = False  # the final round was told which budget was spent
    notes: list[str] = field(default_factory=list)  # facts for the next model call
    events: list[LoopEvent] = field(default_factory=list)  # what ``post_turn`` reports (``TurnInfo.emit``)


def _batch_key(message: AssistantMessage, call: ToolCall) -> str:
    """A batch is named by its first call's id: stable across a durable restart, unlike the object."""
    return message.tool_calls[0].id if message.tool_calls else call.id


class ToolRetry:
    """A piece (``Agent.use``, ``Kernel.open(pieces=...)``) that classifies failed tool calls,
    counts them against per-run budgets and ends the run gently when one is spent; see the module
    docstring. ``class_budgets`` overrides entries of ``DEFAULT_CLASS_BUDGETS``; ``classify`` sees
    each failure first (returning None leaves it to the default classification)."""

    def __init__(
        self,
        *,
        class_budgets: Mapping[str, int] | None = None,
        per_tool: int = DEFAULT_PER_TOOL,
        per_signature: int = DEFAULT_PER_SIGNATURE,
        rounds: int = DEFAULT_ROUNDS,
        classify: Classifier | None = None,
    ) -> None:
        budgets = dict(DEFAULT_CLASS_BUDGETS)
        for name, value in (class_budgets or {}).items():
            if name not in ERROR_CLASSES:
                raise ValueError(f"unknown error class {name!r} (classes: {', '.join(ERROR_CLASSES)})")
            budgets[name] = _budget(f"class_budgets[{name!r}]", value)
        self.class_budgets: Mapping[str, int] = budgets
        self.per_tool = _budget("per_tool", per_tool)
        self.per_signature = _budget("per_signature", per_signature)
        self.rounds = _budget("rounds", rounds)
        if classify is not None and not callable(classify):
            raise TypeError(f"classify must be a function, got {type(classify).__name__}")
        self.classify = classify
        self._runs: OrderedDict[RunKey, _Run] = OrderedDict()

    def install(self, config: LoopConfig) -> None:
        self._register(config.hooks)

    def hooks(self) -> Hooks:
        """The piece as ``Hooks``, for code that composes hooks itself (``Kernel.open(hooks=...)``)."""
        hooks = Hooks()
        self._register(hooks)
        return hooks

    def _register(self, hooks: Hooks) -> None:
        hooks.after_tool_call(self.after_tool_call)
        hooks.on("post_turn")(self.post_turn)
        hooks.on("pre_prompt_context")(self.pre_prompt_context)

    def classification(self, failure: ToolFailure) -> Classification:
        """The custom classifier's verdict, else the default one."""
        if self.classify is not None:
            try:
                custom = self.classify(failure)
            except Exception:  # a broken classifier must not fail the call it looks at
                log.exception("tool retry classifier failed on a %s result", failure.tool_name)
                custom = None
            if isinstance(custom, Classification):
                return custom
        return classify_failure(failure)

    # -- hooks -------------------------------------------------------------------------------------

    def after_tool_call(self, info: ToolCallInfo, result: ToolResult) -> ToolResult | None:
        """Count a failed call that ran, and add the budget line to its result."""
        run = self._run((info.conversation, info.run_id), info.messages)  # (no turn known here: not bounded by one)
        self._enter(run, _batch_key(info.assistant_message, info.call))
        run.seen.add(info.call.id)
        if not result.is_error or info.parent is not None:
            return None
        text = "".join(b.text for b in result.content if isinstance(b, TextContent))
        if text in NOT_COUNTED:
            return None
        failure = ToolFailure(info.call.name, info.call.arguments, text, result.details, executed=True)
        line = self._count(run, failure, info.call.id)
        return replace(result, content=[*result.content, TextContent(text=f"\n{line}")])

    def post_turn(self, info: TurnInfo) -> Stop | None:
        """Count the turn's failures that never ran (no after hook saw them), close the batch, and
        ask for the stop once a budget is spent."""
        key = (info.conversation, info.run_id)
        run = self._runs.get(key)
        batch = _last_batch(info.messages)
        if batch is not None:
            assistant, results = batch
            batch_key = _batch_key(assistant, assistant.tool_calls[0])
            if run is None:  # (this batch is left to the sweep below, as if no restart had been)
                run = self._run(key, info.messages, before=assistant, turns=info.turn)
            if batch_key != run.batch or not run.closed:
                self._enter(run, batch_key)
                self._sweep(run, assistant, results)
                self._close(run)
        if run is not None and run.events:  # the step's retry episode, told to those watching
            events, run.events = run.events, []
            if info.emit is not None:
                for event in events:
                    info.emit(event)
        if run is None or run.exhausted is None or run.stopped:
            return None
        run.stopped = True
        return Stop(f"tool retry budget exhausted: {run.exhausted}")

    def pre_prompt_context(self, info: TurnInfo) -> str | None:
        """The facts of failures whose result could not carry them (see ``post_turn``), once; and,
        once a budget is spent, why the run is ending."""
        key = (info.conversation, info.run_id)
        run = self._runs.get(key)
        if run is None:
            # a run's first model call starts its counts; a later one found none to go on with:
            # the run was resumed (or forgotten), its counts are in its history
            run = self._run(key, None if info.turn == 0 else info.messages, turns=info.turn)
        parts: list[str] = []
        if run.notes:
            notes, run.notes = run.notes, []
            parts.append("Tool failures of your last step:\n" + "\n".join(notes))
        if run.exhausted is not None and not run.told_end:
            run.told_end = True
            parts.append(
                f"The run is ending because a tool retry budget is spent ({run.exhausted}); that is why"
                " it was asked to stop. Tell the user what failed and what would unblock it."
            )
        return "\n\n".join(parts) or None

    # -- counting ----------------------------------------------------------------------------------

    def _run(
        self,
        key: RunKey,
        history: list[Message] | None = None,
        *,
        before: Message | None = None,
        turns: int | None = None,
    ) -> _Run:
        """The counts of run ``key``; a run not seen yet is counted from ``history`` (up to
        ``before``, at most its last ``turns`` batches), none meaning it starts now."""
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = _Run() if history is None else self._recount(history, before, turns)
            while len(self._runs) > MAX_RUNS:
                self._runs.popitem(last=False)
        else:
            self._runs.move_to_end(key)
        return run

    def _recount(self, history: list[Message], before: Message | None, turns: int | None = None) -> _Run:
        """A run's counts as its own batches in ``history`` (those before ``before``) left them:
        they are counted again as they were counted live, each batch closed at the next one. The
        notes of failures that never ran are kept only for a batch no model call has followed.
        ``turns``: the run's turn (``TurnInfo.turn``), which each of its batches moved on by one in
        either runner, so the run has at most that many batches before the one it is at: older
        ones are another run's (one aborted with nothing to mark its end, one a tool ended)."""
        run = _Run()
        batch: tuple[str, dict[str, ToolCall]] | None = None
        for msg in _own_part(history, before, turns):
            if isinstance(msg, AssistantMessage):
                run.notes = []  # told with this model call
                if msg is before:
                    break
                calls = msg.tool_calls
                batch = (_batch_key(msg, calls[0]), {c.id: c for c in calls}) if calls else None
            elif isinstance(msg, ToolResultMessage) and batch is not None and msg.tool_call_id in batch[1]:
                # entered at its first result: a batch with none (its calls still running) is not over
                self._enter(run, batch[0])
                self._take(run, batch[1][msg.tool_call_id], msg)
        self._close(run)
        run.events = []  # (counted again, not new: nothing to report)
        return run

    def _enter(self, run: _Run, key: str) -> None:
        """Make ``key`` the batch being seen; the one before it is closed first if no
        ``post_turn`` did (a turn whose hooks were not run)."""
        if run.batch == key:
            return
        if run.batch is not None and not run.closed:
            self._close(run)
        run.batch, run.seen, run.retried, run.closed = key, set(), False, False

    def _close(self, run: _Run) -> None:
        """The batch is over: a batch without a retryable failure resolves the episode."""
        if not run.closed and not run.retried and run.exhausted is None:
            ep = run.episode
            if ep.rounds:  # an episode with failures is resolved: its budgets are given back
                run.events.append(ToolRetryResolved(failures=sum(ep.by_class.values()), rounds=ep.rounds))
            run.episode = _Episode()
        run.closed = True

    def _sweep(self, run: _Run, assistant: AssistantMessage, results: list[ToolResultMessage]) -> None:
        calls = {c.id: c for c in assistant.tool_calls}
        for result in results:
            call = calls.get(result.tool_call_id)
            if call is not None:
                self._take(run, call, result)

    def _take(self, run: _Run, call: ToolCall, result: ToolResultMessage) -> None:
        """Count a failed result the after hook did not count: one refused before it ran (its
        facts kept for the next model call), or one that ran before a restart (its line tells how
        it was counted, and the model has read it already)."""
        if result.tool_call_id in run.seen or not result.is_error:
            return
        run.seen.add(result.tool_call_id)
        text = result.text
        told = _told(text)
        if told is not None:
            at, verdict = told
            self._count(run, ToolFailure(call.name, call.arguments, text[:at], result.details, True), call.id, verdict)
            return
        if text in NOT_COUNTED:
            return
        failure = ToolFailure(call.name, call.arguments, text, result.details, executed=False)
        run.notes.append(f"{call.name} ({call.id}): {self._count(run, failure, call.id)}")

    def _count(self, run: _Run, failure: ToolFailure, call_id: str, verdict: Classification | None = None) -> str:
        """Classify ``failure`` (of call ``call_id``) unless its ``verdict`` is known, count it, and
        return the line the model reads about it."""
        verdict = verdict or self.classification(failure)
        cls = verdict.error_class
        hint = verdict.hint or _HINTS.get(cls, _HINTS["unknown"])
        if not verdict.retryable:
            return f"[tool retry: class={cls}, not retryable; {hint}]"
        run.retried = True
        if run.exhausted is not None:
            return f"[tool retry: class={cls}; the run is stopping: {run.exhausted}]"
        ep = run.episode
        new_round = ep.counted_batch != run.batch
        sig = signature(failure.tool_name, failure.arguments, cls)
        tool = failure.tool_name
        limits = (  # (the budget, as an event and as the model reads it; used with this failure; limit)
            ("rounds", "rounds", ep.rounds + (1 if new_round else 0), self.rounds),
            ("class", cls, ep.by_class[cls] + 1, self.class_budgets.get(cls, 1)),
            ("tool", tool, ep.by_tool[tool] + 1, self.per_tool),
            ("signature", "same call", ep.by_signature[sig] + 1, self.per_signature),
        )
        for budget, name, used, limit in limits:
            if used > limit:
                run.exhausted = f"a {cls} failure of {tool} went past the {name} budget ({limit})"
                run.events.append(
                    ToolRetryExhausted(
                        tool_call_id=call_id,
                        tool_name=tool,
                        error_class=cls,
                        budget=budget,
                        limit=limit,
                        reason=run.exhausted,
                    )
                )
                log.info("tool retry: %s budget %d spent by a %s failure of %s", name, limit, cls, failure.tool_name)
                return (
                    f"[tool retry: class={cls}; budget exhausted: {name} {limit}/{limit} used."
                    " Tools are off after this step: tell the user what failed and what would unblock it]"
                )
        if new_round:
            ep.rounds += 1
            ep.counted_batch = run.batch
        ep.by_class[cls] += 1
        ep.by_tool[failure.tool_name] += 1
        ep.by_signature[sig] += 1
        rounds_left, class_left, tool_left, signature_left = (limit - used for _, _, used, limit in limits)
        run.events.append(
            ToolRetryScheduled(
                tool_call_id=call_id,
                tool_name=tool,
                error_class=cls,
                rounds_left=rounds_left,
                class_left=class_left,
                tool_left=tool_left,
                signature_left=signature_left,
            )
        )
        left = ", ".join(f"{name} {limit - used}/{limit}" for _, name, used, limit in limits)
        return f"[tool retry: class={cls}; retries left: {left}; hint: {hint}]"


def _budget(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _told(text: str) -> tuple[int, Classification] | None:
    """Where the budget line of a result that ran begins, and the class it gave; None for a
    result without one (a tool's text quoting such a line has more after it)."""
    at = text.rfind(_LINE)
    told = _TOLD.match(text, at) if at >= 0 else None
    if told is None:
        return None
    error_class = told[1] if told[1] in ERROR_CLASSES else "unknown"
    return at, Classification(cast(ErrorClass, error_class), retryable=not told[2])


def _own_part(history: list[Message], before: Message | None = None, turns: int | None = None) -> list[Message]:
    """The end of ``history`` that is the run's own: back to where the run before it ended (its
    answer, a model call that failed or was cut short, its failure notice, the calls its abort
    cancelled). Input that joined the run in between is passed over; after an answer it cannot
    be told from a new run's, so the part before it is left out. Nor can it where the run before
    left no such end (an abort during a model call, a batch whose tools all ended the run): with
    ``turns``, no more than that many batches before ``before`` (or the end) are the run's."""
    start, batches = len(history), 0
    while start > 0:
        msg = history[start - 1]
        if isinstance(msg, AssistantMessage) and not msg.tool_calls:
            break
        if isinstance(msg, SystemMessage) and msg.kind == "error":
            break
        if isinstance(msg, ToolResultMessage) and msg.text == CANCELLED:
            break
        if turns is not None and isinstance(msg, AssistantMessage):
            if msg is before:
                batches = 0  # (the batches before it are what ``turns`` bounds)
            elif batches == turns:
                break
            else:
                batches += 1
        start -= 1
    return history[start:]


def _last_batch(messages: list[Message]) -> tuple[AssistantMessage, list[ToolResultMessage]] | None:
    """The batch the history ends with: an assistant message with tool calls and the results
    after it. None when the history ends otherwise (an answer): an older batch, maybe an earlier
    run's, is not this turn's."""
    results: list[ToolResultMessage] = []
    for msg in reversed(messages):
        if isinstance(msg, ToolResultMessage):
            results.append(msg)
            continue
        if isinstance(msg, AssistantMessage) and msg.tool_calls and results:
            ids = {c.id for c in msg.tool_calls}
            return msg, [r for r in reversed(results) if r.tool_call_id in ids]
        return None
    return None
