"""Loop events as a terminal shows them.

The answer goes to stdout and nothing else does, so ``agentloop run … > answer.txt`` captures
only the answer; tool activity, retries and progress go to stderr, one compact line each. The
JSON form prints one event per line and leaves out the live partial message of
``message_update`` (the delta is enough, and repeating the growing message would make the output
quadratic).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Protocol, TextIO

from rich.console import Console
from rich.text import Text

from agentloop.agent import Run, RunResult
from agentloop.events import (
    AgentEnd,
    AgentStart,
    CompactionEnd,
    CompactionStart,
    LoopEvent,
    MessageStart,
    MessageUpdate,
    ModelRetry,
    TextDelta,
    ThinkingDelta,
    ToolExecutionEnd,
    ToolExecutionStart,
    ToolExecutionUpdate,
    ToolRetryExhausted,
    TurnEnd,
    WindowContinued,
    event_to_dict,
)
from agentloop.messages import AssistantMessage
from agentloop.process import signals as psig
from agentloop.process.heartbeat import REASON as HEARTBEAT_REASON
from agentloop.process.signals import Signal

# The argument most worth showing for a call, by name, in order of preference.
_MAIN_ARGS = ("path", "file", "file_path", "command", "cmd", "pattern", "query", "url", "name")


# What a terminal obeys instead of showing: the C0 and C1 controls (ESC begins every control
# sequence, BEL ends the one that retitles the window, CR and BS overwrite what was shown) and the
# bidirectional overrides and isolates (text shown in another order than it was written).
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _shown(match: re.Match[str]) -> str:
    char = match.group()
    return "" if char == "\r" else f"\\u{ord(char):04x}"


def terminal_text(text: str) -> str:
    """Model or tool text as a terminal may receive it: newlines, tabs and every printable
    character kept, a carriage return dropped, any other control character made visible as
    ``\\uXXXX``, so what a model wrote (or a web page it read told it to write) cannot clear,
    retitle or recolour the terminal, nor hide text. (An approval question is stricter still:
    see ``approvals._visible``.)"""
    return _CONTROLS.sub(_shown, text)


def one_line(text: str, limit: int = 160) -> str:
    """Collapse whitespace so a message never breaks the one-line-per-event layout, and make
    control characters visible: a line on stderr often quotes a model, a tool or a server."""
    flat = terminal_text(" ".join(text.split()))
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def describe_call(name: str, args: dict[str, Any]) -> str:
    for key in _MAIN_ARGS:
        value = args.get(key)
        if isinstance(value, str) and value:
            return f"{name} {one_line(value, 100)}"
    if not args:
        return name
    return f"{name} {one_line(json.dumps(args, ensure_ascii=False, default=str), 100)}"


# a running call's output as the chat shows it (``TextRenderer.tool_output``): a line is cut at
# this many characters, and an unfinished line waits with at most this many more
_MAX_OUTPUT_LINE = 300
_MAX_PARTIAL = 4096


class EventSink(Protocol):
    def handle(self, event: LoopEvent) -> None: ...


def stderr_console(err: TextIO | None = None) -> Console:
    """Rich on stderr, never wrapping: a wrapped tool line would read as two events."""
    return Console(file=err if err is not None else sys.stderr, soft_wrap=True, highlight=False)


class TextRenderer:
    """Streams the answer text to ``out`` and tool activity to ``err``.

    ``on_wait(True)`` is called whenever the user would otherwise stare at nothing (the run
    started, or tools finished and the model is thinking again) and ``on_wait(False)`` before the
    next visible output, so an interactive caller can show a spinner in between.
    """

    def __init__(
        self,
        out: TextIO | None = None,
        err: Console | None = None,
        *,
        on_wait: Callable[[bool], None] | None = None,
    ) -> None:
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else stderr_console()
        self.on_wait = on_wait
        self._calls: dict[str, str] = {}
        self._partial: dict[str, str] = {}  # call id -> the last line of its output so far, unfinished
        self._at_line_start = True
        self._wrote_text = False
        self._new_message = False
        self._waiting = False
        self._out_is_tty = is_terminal(self.out)

    # -- helpers ------------------------------------------------------------------------------

    def _wait(self, waiting: bool) -> None:
        if waiting != self._waiting:
            self._waiting = waiting
            if self.on_wait is not None:
                self.on_wait(waiting)

    def _write(self, text: str) -> None:
        self._wait(False)
        # a pipe or a file gets the answer exactly; a terminal would obey the control sequences in it
        write_out(self.out, terminal_text(text) if self._out_is_tty else text)
        self._at_line_start = text.endswith("\n")
        self._wrote_text = True

    def end_line(self) -> None:
        """Finish a half-written answer line, so what follows starts on its own line."""
        if not self._at_line_start:
            write_out(self.out, "\n")
            self._at_line_start = True

    def note(self, text: Text) -> None:
        """A line on stderr. On a terminal stdout and stderr share the screen: break the answer first."""
        self._wait(False)
        if self._out_is_tty:
            self.end_line()
        self.err.print(text)

    def pause(self) -> None:
        """Make way for a question: no spinner, and the answer so far ends its line."""
        self._wait(False)
        self.end_line()

    # -- what a run shows (fed by loop events here, by process signals in SignalRenderer) ----

    def waiting(self) -> None:
        """Nothing visible is happening: the model is thinking or about to answer."""
        self._wait(True)

    def message_start(self) -> None:
        """A new assistant message: its text is not glued to the previous message's."""
        self._new_message = True

    def text(self, delta: str) -> None:
        if not delta:
            return
        if self._new_message and self._wrote_text:
            self.end_line()
        self._new_message = False
        self._write(delta)

    def tool_start(self, call_id: str, name: str, args: dict[str, Any], *, show: bool = True) -> None:
        """``show=False`` only learns the call, for a result line that comes without a start (a
        durable call the user refused never starts)."""
        label = describe_call(name, args)
        self._calls[call_id] = label
        if show:
            self.note(Text.assemble(("▸ ", "cyan"), label))

    def knows(self, call_id: str) -> bool:
        return call_id in self._calls

    def tool_output(self, call_id: str, update: Any) -> None:
        """A running call's progress: of an update with a text ``delta`` (Shell's output as it
        comes), each finished line, dim and indented under the call's line; the unfinished last
        line waits for the rest of it (or for the call's end). ``skipped`` (characters the tool
        left out, a flood of output) is said in a line of its own. Other updates are not shown."""
        if not isinstance(update, Mapping) or not isinstance(update.get("delta"), str):
            return
        skipped = update.get("skipped")
        if isinstance(skipped, int) and not isinstance(skipped, bool) and skipped > 0:
            self._flush_output(call_id)
            self.note(Text(f"  … {skipped:,} characters skipped …", style="dim"))
        *lines, rest = (self._partial.pop(call_id, "") + update["delta"]).split("\n")
        for line in lines:
            self._output_line(line)
        if rest:
            self._partial[call_id] = rest[-_MAX_PARTIAL:]

    def _flush_output(self, call_id: str) -> None:
        rest = self._partial.pop(call_id, "")
        if rest:
            self._output_line(rest)

    def _output_line(self, line: str) -> None:
        shown = terminal_text(line.expandtabs())
        if len(shown) > _MAX_OUTPUT_LINE:
            shown = shown[: _MAX_OUTPUT_LINE - 1] + "…"
        self.note(Text("  " + shown, style="dim"))

    def tool_end(self, call_id: str, name: str, is_error: bool, text: str) -> None:
        self._flush_output(call_id)
        label = self._calls.pop(call_id, name)
        if is_error:
            self.note(Text.assemble(("✗ ", "red"), label, (": " + one_line(text), "red")))
        else:
            self.note(Text.assemble(("✓ ", "green"), (label, "dim")))

    def retry(self, model: str, error: str, attempt: int, delay: float) -> None:
        """A failed model call retried after ``delay``, or (``attempt`` 0) a switch to ``model``."""
        if attempt == 0:
            self.note(Text(f"↻ switching to {model}: {one_line(error)}", style="yellow"))
        else:
            self.note(Text(f"↻ {model}: {one_line(error)} — retry {attempt} in {delay:.1f}s", style="yellow"))
        self._wait(True)

    def finish(self) -> None:
        for call_id in list(self._partial):  # (calls that never ended: an abort)
            self._flush_output(call_id)
        self._wait(False)
        self.end_line()

    # -- events --------------------------------------------------------------------------------

    def handle(self, event: LoopEvent) -> None:
        if isinstance(event, AgentStart):
            self.waiting()
        elif isinstance(event, MessageStart):
            if isinstance(event.message, AssistantMessage):
                self.message_start()
        elif isinstance(event, MessageUpdate):
            if isinstance(event.event, TextDelta):
                self.text(event.event.delta)
            elif isinstance(event.event, ThinkingDelta):
                self.waiting()
        elif isinstance(event, ToolExecutionStart):
            self.tool_start(event.tool_call_id, event.tool_name, event.args)
        elif isinstance(event, ToolExecutionUpdate):
            self.tool_output(event.tool_call_id, event.partial_result)
        elif isinstance(event, ToolExecutionEnd):
            self.tool_end(event.tool_call_id, event.tool_name, event.is_error, event.result.text)
        elif isinstance(event, TurnEnd):
            if event.tool_results:
                self.waiting()  # the model reads the results next
        elif isinstance(event, ModelRetry):
            self.retry(event.model, event.error, event.attempt, event.delay)
        elif isinstance(event, WindowContinued):
            self.note(Text(window_line(event.window, event.rounds, event.tool_calls), style="dim"))
        elif isinstance(event, CompactionStart | CompactionEnd | ToolRetryExhausted):
            self._report(event)
        elif isinstance(event, AgentEnd):
            self.finish()

    def _report(self, event: CompactionStart | CompactionEnd | ToolRetryExhausted) -> None:
        """A piece's report, one line: a compaction (the model is called next) or a spent budget."""
        if isinstance(event, ToolRetryExhausted):
            self.note(Text(f"tool retry budget spent: {one_line(event.reason)}; the run stops", style="yellow"))
            return
        why = " (the context overflowed)" if event.reason == "overflow" else ""
        if isinstance(event, CompactionStart):
            self.note(Text(f"compacting context…{why}", style="dim"))
        elif event.compacted:
            plural = "message" if event.removed == 1 else "messages"
            self.note(Text(f"context compacted: {event.removed} {plural} summarised", style="dim"))
        elif event.error:
            self.note(Text(f"context not compacted: {one_line(event.error)}", style="yellow"))
        else:
            self.note(Text("context not compacted: nothing to summarise", style="dim"))
        self.waiting()


class SignalRenderer:
    """Shows a durable process's signals the way ``TextRenderer`` shows loop events.

    Stream deltas are live-only (a watcher that joined late, or resumed after a restart, never
    sees them), while ``proc.run.output`` carries each finished message whole; so the output
    signal prints whatever part of the text the deltas did not.
    """

    def __init__(self, view: TextRenderer) -> None:
        self.view = view
        self._streamed = ""  # text deltas of the model message in flight
        self._running: set[str] = set()
        # heartbeat runs' text waits for its ``proc.run.output``, which says whether it is an
        # acknowledgement nobody needs to see (``quiet``)
        self._held: set[str] = set()
        self._level = "ok"  # the context's, as last logged: a rise is worth a line, a fall is not

    def handle(self, signal: Signal) -> None:
        name, p = signal.signal, signal.payload
        view = self.view
        if name == psig.RUN_STARTED:
            if p.get("reason") == HEARTBEAT_REASON:
                self._held.add(str(p.get("runId")))
            view.waiting()
        elif name in (psig.RUN_STREAM, psig.RUN_OUTPUT) and str(p.get("runId")) in self._held:
            if name == psig.RUN_OUTPUT and not p.get("quiet") and p.get("text"):
                view.message_start()
                view.text(str(p["text"]))
                view.message_start()
        elif name == psig.RUN_STREAM:
            event = p.get("event")
            delta = p.get("delta")
            if event == "start":
                view.message_start()
            elif event == "text_delta" and isinstance(delta, str):
                self._streamed += delta
                view.text(delta)
            elif event in ("thinking_start", "thinking_delta"):
                view.waiting()
        elif name == psig.RUN_RETRYING:
            self._retry(p)
        elif name == psig.RUN_WINDOW:
            view.note(Text(window_line(p.get("window"), p.get("rounds"), p.get("toolCalls")), style="dim"))
        elif name in (psig.TOOL_RETRY_SCHEDULED, psig.TOOL_RETRY_EXHAUSTED):
            view.note(Text(tool_retry_line(name, p), style="yellow"))
            view.waiting()  # the model reads the failure next (told to try again, or to stop)
        elif name == psig.RUN_OUTPUT:
            text = str(p.get("text") or "")
            if text.startswith(self._streamed):
                view.text(text[len(self._streamed) :])
            self._streamed = ""
            view.message_start()
        elif name == psig.TOOL_STARTED:
            call_id = str(p.get("callId", ""))
            self._running.add(call_id)
            args = p.get("args")
            view.tool_start(call_id, str(p.get("name", "")), args if isinstance(args, dict) else {})
        elif name == psig.TOOL_UPDATE:
            view.tool_output(str(p.get("callId", "")), p.get("update"))
        # a nested call's callId is its program's; a subagent's call is not one of this process's
        elif name == psig.HIL_REQUESTED and not p.get("nested") and not p.get("subagent"):
            args = p.get("args")
            view.tool_start(
                str(p.get("callId", "")), str(p.get("name", "")), args if isinstance(args, dict) else {}, show=False
            )
        elif name == psig.TOOL_FINISHED:
            call_id = str(p.get("callId", ""))
            self._running.discard(call_id)
            ok = bool(p.get("ok"))
            view.tool_end(call_id, str(p.get("name", "")), not ok, str(p.get("output" if ok else "error") or ""))
            if not self._running:
                view.waiting()  # the model reads the results next
        elif name == psig.COMPACTED:
            count = next((p[k] for k in ("messages", "removed", "count") if isinstance(p.get(k), int)), None)
            reason = p.get("reason")
            what = f"compacted {count} messages" if count is not None else "compacted the conversation"
            if p.get("kind") == "clearing":
                what = f"cleared {p.get('cleared')} old tool outputs (archived)"
            kept = f"; memories kept in {p['memory']}" if isinstance(p.get("memory"), str) else ""
            view.note(Text(one_line(what + (f" ({reason})" if reason else "") + kept, 400), style="dim"))
        elif name == psig.RUN_FINISHED:
            self._held.discard(str(p.get("runId")))
            view.finish()
        elif name == psig.CHANGED and "context" in (p.get("changes") or ()):
            self._context(p)

    def _context(self, p: dict[str, Any]) -> None:
        """A dim line when the context's level rises (warn, critical, full): the user can compact
        or start anew before the run has to."""
        level = str(p.get("level"))
        if level not in _LEVELS:
            return
        rose = _LEVELS.index(level) > _LEVELS.index(self._level)
        self._level = level
        if rose:
            self.view.note(Text(context_warning(p), style="dim"))

    def _retry(self, p: dict[str, Any]) -> None:
        self.view.retry(
            str(p.get("model") or "model"),
            str(p.get("reason") or ""),
            int(p.get("attempt") or 0),
            float(p.get("delay") or 0.0),
        )


# a retry budget's ``...Left`` field in ``proc.run.tool.retry.scheduled``, and what it counts: the
# one with the fewest retries left is shown (the first of them on a tie)
_RETRY_BUDGETS = (
    ("classLeft", "for this class"),
    ("signatureLeft", "for this call"),
    ("toolLeft", "for this tool"),
    ("roundsLeft", "in this run"),
)


def window_line(window: object, rounds: object, tool_calls: object) -> str:
    """An execution window used up (``window_continued``, ``proc.run.window``): the run goes on."""
    return f"execution window {window} opens (the last used {rounds} rounds, {tool_calls} tool calls)"


def tool_retry_line(name: str, p: Mapping[str, Any]) -> str:
    """The line a ``ToolRetry`` signal is shown with: a failure counted
    (``proc.run.tool.retry.scheduled``: the tightest budget's retries left) or a budget spent
    (``proc.run.tool.retry.exhausted``: the run stops); "" for any other."""
    if name == psig.TOOL_RETRY_EXHAUSTED:
        reason = p.get("reason")
        if not isinstance(reason, str) or not reason:
            reason = f"{p.get('budget', '?')} budget ({p.get('limit', '?')})"
        return f"tool retry budget spent: {one_line(reason)}; the run stops"
    if name != psig.TOOL_RETRY_SCHEDULED:
        return ""
    tool, error = one_line(str(p.get("name") or "a tool"), 80), one_line(str(p.get("errorClass") or "error"), 40)
    counts = [(p[key], what) for key, what in _RETRY_BUDGETS if _is_count(p.get(key))]
    if not counts:
        return f"{tool} failed ({error}): retrying"
    left, what = min(counts, key=lambda c: c[0])
    many = "no retries" if left == 0 else "1 retry" if left == 1 else f"{left} retries"
    return f"{tool} failed ({error}): {many} left {what}"


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_LEVELS = ("ok", "warn", "critical", "full")
_LEVEL_ADVICE = {
    "critical": " · it will be compacted soon (/compact does it now)",
    "full": " · the next message may not fit (/compact or /new)",
}


def context_warning(p: Mapping[str, Any]) -> str:
    """The line a rise of the context's level is shown with (a ``proc.changed`` context payload)."""
    tokens, window = _count(p.get("tokens")), _count(p.get("window"))
    advice = _LEVEL_ADVICE.get(str(p.get("level")), "")
    return f"context {_share(p.get('ratio'))} full ({tokens:,} of {window:,} tokens){advice}"


def context_line(ctx: Mapping[str, Any]) -> str:
    """``/context``: the level, the share of the usable window, the threshold and what the
    process's policy changes (``Process.context().as_dict()``, or a process's ``context_pressure``)."""
    threshold = ctx.get("threshold")
    parts = [
        f"context: {ctx.get('level', '?')}",
        f"{_share(ctx.get('ratio'))} of {_count(ctx.get('window')):,} tokens ({_count(ctx.get('tokens')):,})",
    ]
    if isinstance(threshold, int | float):
        parts.append(f"compacts at {threshold:.0%}")
    policy = ctx.get("policy")
    if isinstance(policy, Mapping):
        if policy.get("overflow") == "fail":
            parts.append("overflow fails the run")
        if isinstance(policy.get("keep_recent_tokens"), int):
            parts.append(f"keeps {policy['keep_recent_tokens']:,} recent tokens")
    return " · ".join(parts)


def usage_line(usage: Mapping[str, Any], whose: str = "this conversation") -> str:
    """Usage totals (``{input, output, total_tokens, cost, runs}``) as ``/usage`` shows them; the
    cost only when the model has prices (a local model's is zero, not free of tokens)."""
    runs = _count(usage.get("runs"))
    if not runs:
        return f"{whose}: no run has finished yet"
    tokens, read, written = (_count(usage.get(k)) for k in ("total_tokens", "input", "output"))
    parts = [f"{runs:,} run{'s' * (runs != 1)}", f"{tokens:,} tokens ({read:,} in, {written:,} out)"]
    cost = usage.get("cost")
    if isinstance(cost, int | float) and cost > 0:
        parts.append(f"${cost:.4f}" if cost < 1 else f"${cost:,.2f}")
    return f"{whose}: " + " · ".join(parts)


def prompt_manifest_lines(manifest: Mapping[str, Any]) -> list[str]:
    """A ``proc.prompt.compiled`` payload as ``/prompt`` shows it: the prompt's size, digest and
    tool count, then one line per section (its size, whether a file was cut, its files and those
    left out over the budget), then the assembly's warnings. File names come from the agent's
    own directories, so control characters in them are made visible."""
    sections = [s for s in _items(manifest.get("sections")) if isinstance(s, Mapping)]
    base = _count(manifest.get("base"))
    rows: list[tuple[str, int, bool, list[str], list[str]]] = [("base", base, False, [], [])] if base else []
    rows += [
        (
            str(s.get("name", "")),
            _count(s.get("bytes")),
            bool(s.get("truncated")),
            _names(s.get("files")),
            _names(s.get("omitted")),
        )
        for s in sections
    ]
    digest = one_line(str(manifest.get("digest") or ""), 64)[:12]  # (a server's payload: made visible too)
    tools = len(_items(manifest.get("tools")))
    lines = [f"system prompt: {_count(manifest.get('bytes'))} bytes, sha256 {digest}, {tools} tools"]
    width = max((len(one_line(name, 40)) for name, *_ in rows), default=0)
    size = max((len(str(n)) for _, n, *_ in rows), default=0)
    for name, n, truncated, files, omitted in rows:
        parts = [f"  {one_line(name, 40):<{width}}  {n:>{size}} bytes"]
        parts += ["truncated"] if truncated else []
        parts += [", ".join(files)] if files else []
        parts += [f"omitted: {', '.join(omitted)}"] if omitted else []
        lines.append("  ".join(parts))
    lines += [f"warning: {one_line(str(w), 400)}" for w in _items(manifest.get("warnings"))]
    return lines


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _names(value: Any) -> list[str]:
    return [one_line(str(v), 200) for v in _items(value)]


def _share(ratio: Any) -> str:
    """A share of the context window as a percentage ("?%" when the figure is missing)."""
    return f"{ratio:.0%}" if isinstance(ratio, int | float) else "?%"


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class JsonRenderer:
    """One JSON object per line on ``out``, flushed per event so a pipe sees it at once."""

    def __init__(self, out: TextIO | None = None, *, before_output: Callable[[], None] | None = None) -> None:
        self.out = out if out is not None else sys.stdout
        self.before_output = before_output

    @staticmethod
    def to_dict(event: LoopEvent) -> dict[str, Any]:
        if isinstance(event, MessageUpdate):
            return {"type": event.type, "event": event_to_dict(event.event)}
        if isinstance(event, ToolExecutionUpdate):  # a tool's progress may be anything: not JSON is its string
            try:
                progress = json.loads(json.dumps(event.partial_result, ensure_ascii=False, default=str))
            except Exception:  # (a value whose string fails, a cycle)
                progress = None
            return {**event_to_dict(replace(event, partial_result=None)), "partial_result": progress}
        data = event_to_dict(event)
        if isinstance(event, MessageStart) and isinstance(event.message, AssistantMessage):
            # The streamed message is live: by now it may hold text its deltas are about to repeat.
            data["message"]["content"] = []
        return data

    def handle(self, event: LoopEvent) -> None:
        if self.before_output is not None:
            self.before_output()
        write_out(self.out, json.dumps(self.to_dict(event), ensure_ascii=False) + "\n")


class Progress:
    """Status lines while a model is prepared (the embedded model's first start takes minutes).

    On a terminal each line replaces the previous one; elsewhere lines are printed, but a stream
    of percentage updates is thinned to one line every few seconds so logs stay readable.
    """

    def __init__(self, err: TextIO | None = None, *, min_interval: float = 2.0) -> None:
        self.err = err if err is not None else sys.stderr
        self.tty = is_terminal(self.err)
        self.min_interval = min_interval
        self._lock = threading.Lock()
        self._open = False  # a line on the terminal waits to be replaced or cleared
        self._last_shape = ""
        self._last_time = 0.0
        self.route: Callable[[str], None] | None = None  # e.g. a spinner that shows the line instead

    def __call__(self, line: str) -> None:
        text = one_line(str(line), 200)
        if not text:
            return
        with self._lock:
            if self.route is not None:
                self.route(text)
                return
            if self.tty:
                self.err.write(f"\r\x1b[K⋯ {text}")
                self._open = True
            else:
                shape = re.sub(r"[\d.,]+", "#", text)
                now = time.monotonic()
                if shape == self._last_shape and now - self._last_time < self.min_interval:
                    return
                self._last_shape, self._last_time = shape, now
                self.err.write(f"⋯ {text}\n")
            self.err.flush()

    def done(self) -> None:
        with self._lock:
            if self._open:
                self.err.write("\r\x1b[K")
                self.err.flush()
                self._open = False


async def play(run: Run, sink: EventSink) -> RunResult:
    """Drive a streaming run, handing each event to ``sink``; return its result."""
    async for event in run.events():
        sink.handle(event)
    return await run.result()


class Abortable(Protocol):
    def abort(self) -> Any: ...


class Interrupts:
    """Turns SIGINT (and SIGTERM) into ``abort()`` of a run (or a durable chat's turn) while it is active.

    Aborting, not raising, is what lets the loop cancel the tools (the Shell tool kills its
    process group) and close the history properly. A second signal while the abort is still
    under way means the user has given up waiting: exit at once.
    """

    def __init__(self) -> None:
        self.received: int | None = None

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or signal.SIGINT)

    @contextmanager
    def abort_on_signal(
        self,
        run: Abortable,
        on_abort: Callable[[], None] | None = None,
        signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM),
    ) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []

        def handler(signum: int) -> None:
            if self.received is not None:
                os._exit(128 + signum)
            self.received = signum
            if on_abort is not None:
                on_abort()
            run.abort()

        for sig in signals:
            try:
                loop.add_signal_handler(sig, handler, int(sig))
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
                pass
        try:
            yield
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)


READER_GONE = threading.Event()  # stdout's reader went away (``| head``): see ``write_out``


def write_out(out: TextIO, text: str) -> None:
    """Write answer text. When its reader has gone away (``| head -c 3``) the rest is discarded:
    stdout is pointed at /dev/null (so no later flush fails) and ``READER_GONE`` tells the command
    to end with the shell's usual 141 once the turn is over, instead of failing inside the loop."""
    try:
        out.write(text)
        out.flush()
    except BrokenPipeError:
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, out.fileno())
            finally:
                os.close(devnull)
        READER_GONE.set()


@contextmanager
def exit_on_terminate() -> Iterator[None]:
    """SIGTERM (``kill``, ``timeout``, a supervisor) ends the command by raising ``SystemExit``
    (143), so what it holds is closed on the way out: a durable chat's kernel, with the turn in
    flight left to resume at the next start (as after a crash); ``serve --chat``'s server and its
    session token. Ctrl-C stays what aborts a turn."""

    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread: the default stands
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
