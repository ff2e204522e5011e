"""``--approval ask|auto|deny|<policy.json>``: one flag, two runners.

A durable chat hands the policy to the kernel, which stores the question and waits for
``proc.hil``; the in-memory ``run`` (and ``chat --memory``) has no such machinery, so the same
policy is evaluated in a ``before_tool_call`` hook with the same ``decide``. Both ask through
:func:`ask_user`, so a question looks and is answered the same way everywhere: the tool, its
main argument, the tags that made the policy ask, the reason, and ``y`` / ``n`` / ``a``; ``n`` may
be followed by a reason for the model (``n use staging instead``), which it reads in the call's
result: one line, so a piped conversation answers as it always did. The kernel's questions (a
durable chat's) may also be answered ``e`` (approve with arguments edited as JSON at the prompt)
and ``account`` (always, for the account: its policy file); the in-memory runner has neither.

``agentloop approvals audit`` lists a server account's approvals audit (``GET /v1/approvals/audit``).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from agentloop.cli.config import expand_home
from agentloop.cli.options import ServerOpt, TokenOpt
from agentloop.cli.render import describe_call, one_line
from agentloop.cli.usage import App
from agentloop.loop.hooks import DEFAULT_HOOK_TIMEOUT, Block, ToolCallInfo
from agentloop.process.api import approve_everything
from agentloop.process.approval import Policy, Rule, decide, default_policy, parse_policy, remember_rule
from agentloop.process.approval.denial import denial_message, denial_text

Mode = Literal["ask", "auto", "deny", "file"]
Answer = Literal["approve", "deny", "always", "account", "abort"]

ASK_LINE = "Allow? [y]es / [n]o / [a]lways · n REASON tells the model why"
EDIT_LINE = "Allow? [y]es / [n]o / [a]lways / [e]dit / account · n REASON tells the model why"
MAX_SHOWN = 4000  # characters of one argument shown with a question
DENIED_BY_USER = "Tool execution denied by user"
NO_TERMINAL = "requires interactive approval, but there is no terminal to ask at"


@dataclass(frozen=True)
class ApprovalSetting:
    """What ``--approval`` resolved to. ``warnings`` are for stderr: a bad policy file must
    not stop the CLI, but the user has to learn that the default policy is in force instead."""

    mode: Mode
    policy: Policy
    source: str
    warnings: list[str] = field(default_factory=list)
    file: Path | None = None  # the policy file (absolute), for ``mode == "file"``

    def kernel_options(self, owner: str | None = None) -> dict[str, Any]:
        """``Kernel.open`` keywords: ``auto`` skips the check, everything else is a policy. It is
        the server-wide default, which an account's own policy file refines; given as a file, it
        is the file, which the kernel reads again whenever it changes. For ``owner`` (the one
        account of a local chat) a policy named on the command line (``deny``, a file) wins over
        that file instead, as ``auto`` does, as read now."""
        if self.mode == "auto":
            return {"approval": approve_everything}
        if owner is not None and self.mode in ("deny", "file"):
            return {"policy": self.policy, "account_policies": {owner: self.policy}}
        return {"policy": self.file if self.file is not None else self.policy}


def parse_approval(spec: str) -> ApprovalSetting:
    """``ask`` / ``auto`` / ``deny`` or a JSON policy file. A file that cannot be read raises
    ``ValueError`` (most likely a misspelt word: falling back to another policy would surprise);
    a file that is not a valid policy gives the default policy and a warning."""
    word = spec.strip().lower()
    if word == "ask":
        return ApprovalSetting("ask", default_policy(), "default policy")
    if word == "auto":
        return ApprovalSetting("auto", Policy(default="auto"), "--approval auto")
    if word == "deny":
        return ApprovalSetting("deny", Policy(default="deny"), "--approval deny")
    path = expand_home(spec, "--approval")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(
            f"--approval must be ask, auto, deny or a JSON policy file; cannot read {str(path)!r} ({reason})"
        ) from None
    policy, problems = parse_policy(text)
    file = Path(os.path.abspath(path))  # (the server's working directory may change; a link stays one)
    if problems:
        warnings = [f"approval policy {path}: {p}" for p in problems]
        return ApprovalSetting("file", policy, "default policy", warnings, file)
    return ApprovalSetting("file", policy, str(path), file=file)


# ---------------------------------------------------------------------------------- asking


@dataclass(frozen=True)
class Question:
    """One call waiting for a person, with what the policy saw in it."""

    tool: str
    args: Mapping[str, Any]
    tags: tuple[str, ...]
    reason: str
    request_id: str = ""
    editable: bool = False  # ``e`` (other arguments) and ``account`` may answer it (a durable chat's)

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> Question:
        """From a ``proc.run.hil.requested`` signal."""
        args = payload.get("args")
        return cls(
            tool=str(payload.get("name") or payload.get("syscall") or "tool"),
            args=args if isinstance(args, dict) else {},
            tags=tuple(str(t) for t in payload.get("tags") or ()),
            reason=str(payload.get("reason") or ""),
            request_id=str(payload.get("requestId") or ""),
        )

    @classmethod
    def from_row(cls, row: Any) -> Question:
        """From a ``pending_hil`` row (a question asked before this client was watching)."""
        return cls(
            tool=str(row.tool_name),
            args=dict(row.args or {}),
            tags=tuple(row.tags or ()),
            reason=str(row.reason or ""),
            request_id=str(row.request_id),
        )


def question_lines(question: Question) -> list[Text]:
    tags = ", ".join(question.tags) or "none"
    args = dict(question.args)
    headline = describe_call(question.tool, args)
    lines = [Text.assemble(("? ", "bold yellow"), ("approve ", "bold"), _visible(headline))]
    only = next(iter(args.values())) if len(args) == 1 else None
    if not (isinstance(only, str) and headline == f"{question.tool} {only}"):
        lines += argument_lines(args)  # the headline is shortened: "y" approves all of this
    lines.append(Text.assemble(("  tags: ", "dim"), (tags, "yellow")))
    if question.reason:
        lines.append(Text.assemble(("  why: ", "dim"), _visible(one_line(question.reason, 300))))
    return lines


def argument_lines(args: Mapping[str, Any]) -> list[Text]:
    """Every argument of the call in full (up to ``MAX_SHOWN`` characters each, the rest counted),
    lines kept, control characters made visible: what an approval is bound to, not a summary."""
    lines: list[Text] = []
    for key, value in args.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        hidden = len(text) - MAX_SHOWN
        label = f"  {key}: "
        for i, part in enumerate(text[:MAX_SHOWN].split("\n")):
            lines.append(Text.assemble((label if i == 0 else " " * len(label), "dim"), _visible(part)))
        if hidden > 0:
            lines.append(Text(f"{' ' * len(label)}… and {hidden} more characters", style="yellow"))
    return lines


def _visible(text: str) -> str:
    """Control and format characters (escape sequences, bidirectional overrides) as escapes, so a
    model cannot make the terminal show something other than what is approved."""
    return "".join(c if c.isprintable() or c == "\t" else f"\\u{ord(c):04x}" for c in text)


@dataclass(frozen=True)
class Denial:
    """``n REASON``: deny, and tell the model why (it reads ``reason`` in the call's result)."""

    reason: str


@dataclass(frozen=True)
class Edited:
    """``e``: approve, but run the call with these ``arguments`` (typed as JSON) instead."""

    arguments: dict[str, Any]


UserAnswer = Answer | Denial | Edited


def parse_answer(line: str) -> UserAnswer | None:
    """y / n / a, or ``n`` (``no``, ``no,``, ``no:``) followed by a reason. The reason is checked
    as the kernel checks it (``denial_message``): ``ValueError`` when it could not be sent."""
    parts = line.split(maxsplit=1)
    word = parts[0].lower().rstrip(",:") if parts else ""
    rest = parts[1] if len(parts) > 1 else ""
    if rest:
        reason = denial_message(rest) if word in ("n", "no") else None
        return Denial(reason) if reason is not None else None
    if word in ("y", "yes"):
        return "approve"
    if word in ("n", "no"):
        return "deny"
    if word in ("a", "always"):
        return "always"
    if word == "account":
        return "account"
    return None


def parse_arguments(line: str) -> dict[str, Any]:
    """Arguments typed at the prompt: one JSON object; ``ValueError`` saying what is wrong."""
    try:
        value = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"the arguments must be a JSON object, not {type(value).__name__}")
    return value


Read = Callable[[str], Awaitable[str]]
# a prompt with text already typed into it, to be edited (a terminal's): (prompt, text) -> the line
Prefilled = Callable[[str, str], Awaitable[str]]


class ReadInterrupted(Exception):
    """Ctrl-C while an answer was being typed. Not ``KeyboardInterrupt``: raised inside an
    asyncio task, that one escapes the event loop instead of reaching the code that asked."""


async def ask_user(
    question: Question,
    read: Read,
    err: Console,
    *,
    shows_prompt: bool,
    cancelled: asyncio.Event | None = None,
    unread: Callable[[str], None] | None = None,
    prefilled: Prefilled | None = None,
) -> UserAnswer:
    """Ask until the answer is y, n (with a reason, maybe: a ``Denial``) or a (or, for an
    ``editable`` question, e or account). End of input denies
    (nobody is there to say yes); Ctrl-C in the answer, or ``cancelled`` (the turn was aborted
    meanwhile), gives ``abort``. With ``unread`` (input from a pipe, written before the question
    was asked), a line that is no answer denies the call and is given back, to be read as the
    next message: nothing is lost. A reason that cannot be sent is asked again on a terminal."""
    for text in question_lines(question):
        err.print(text)
    ask_line = EDIT_LINE if question.editable else ASK_LINE
    prompt = f"{ask_line} › "
    while True:
        if not shows_prompt:  # a pipe shows no prompt: say what is asked where the user looks
            err.print(Text(ask_line, style="bold"))
        line, ended = await _answer_line(read(prompt), cancelled, err)
        if line is None:
            return ended
        try:
            answer = parse_answer(line)
        except ValueError as exc:  # a reason that cannot be sent
            if unread is not None:  # a pipe cannot be asked again: the answer was still no
                err.print(Text(f"(cannot send that reason: {exc}; denied without it)", style="yellow"))
                return "deny"
            err.print(Text(f"cannot send that reason: {exc}", style="yellow"))
            continue
        if answer == "account" and not question.editable:
            answer = None
        if answer is not None:
            return answer
        if question.editable and line.strip().lower() in ("e", "edit"):
            edited = await _edit(question, read, err, prefilled, cancelled, pipe=unread is not None)
            if edited is not None:
                return edited
            continue
        if unread is not None:
            unread(line)
            err.print(Text("(not an answer: denied; the line is kept as the next message)", style="yellow"))
            return "deny"
        always = f"allow every {question.tool} call for the rest of this conversation"
        if question.editable:
            err.print(
                Text(
                    f"answer y (yes, this once), n (no), n REASON (no, and tell the model why), a ({always}),"
                    " e (yes, with arguments you edit) or account (always, for every conversation of this account)"
                )
            )
            continue
        err.print(Text(f"answer y (yes, this once), n (no), n REASON (no, and tell the model why) or a ({always})"))


async def _edit(
    question: Question,
    read: Read,
    err: Console,
    prefilled: Prefilled | None,
    cancelled: asyncio.Event | None,
    *,
    pipe: bool,
) -> UserAnswer | None:
    """``e``: the call's arguments as one line of JSON, to change (in the prompt itself, on a
    terminal) and send; an empty line goes back to the question, as does JSON that is no object
    (on a terminal: a pipe cannot be asked again, so there the call is denied)."""
    # (control and format characters, a bidirectional override, as JSON escapes: the line is put
    # in the terminal's prompt as it is, and must show what it sends, as the question does)
    shown = "".join(
        c if c.isprintable() else json.dumps(c)[1:-1] for c in json.dumps(dict(question.args), ensure_ascii=False)
    )
    prompt = "arguments (JSON; empty: back) › "
    if prefilled is None:
        err.print(Text.assemble(("  arguments now: ", "dim"), _visible(shown)))
        reading = read(prompt)
    else:
        reading = prefilled(prompt, shown)
    line, ended = await _answer_line(reading, cancelled, err)
    if line is None:
        return ended
    if not line.strip():
        return None
    try:
        return Edited(parse_arguments(line))
    except ValueError as exc:
        if pipe:
            err.print(Text(f"(cannot use those arguments: {exc}; denied)", style="yellow"))
            return "deny"
        err.print(Text(f"cannot use those arguments: {exc}", style="yellow"))
        return None


async def _answer_line(
    reading: Awaitable[str], cancelled: asyncio.Event | None, err: Console
) -> tuple[str | None, Literal["deny", "abort"]]:
    """The line read, or None and how the question then ends: ``deny`` at the end of the input
    (nobody is there to say yes), ``abort`` on Ctrl-C or a cancelled question."""
    try:
        line = await _read_or_cancel(reading, cancelled)
    except EOFError:
        err.print(Text("(no answer: denied)", style="yellow"))
        return None, "deny"
    except (ReadInterrupted, KeyboardInterrupt):
        return None, "abort"
    return line, "abort"


async def _read_or_cancel(reading: Awaitable[str], cancelled: asyncio.Event | None) -> str | None:
    if cancelled is None:
        return await reading
    read_task = asyncio.ensure_future(reading)
    stop_task = asyncio.ensure_future(cancelled.wait())
    try:
        await asyncio.wait({read_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_task.cancel()
    if read_task.done():
        return read_task.result()
    read_task.cancel()
    return None


# ---------------------------------------------------------------------------------- in-memory runs

Asker = Callable[[Question], Awaitable[UserAnswer]]


class PolicyHook:
    """A ``before_tool_call`` hook that applies a policy the way the kernel does: ``auto`` runs,
    ``deny`` becomes a tool error, ``ask`` asks through ``ask`` (or, without one, is refused
    with a reason the model and the user can act on). "Always" adds the same process-local rule
    the kernel would add, so both runners remember alike."""

    def __init__(
        self,
        policy: Policy,
        *,
        cwd: str | os.PathLike[str],
        ask: Asker | None,
        unanswerable: str = NO_TERMINAL,
        protected: Sequence[str | os.PathLike[str]] = (),
    ) -> None:
        self.policy = policy
        # off limits whatever the policy says, as for processes (see ``decide``)
        self.protected = [os.path.realpath(p) for p in protected]
        self.unanswerable = unanswerable  # why an ask is refused when there is nobody to ask
        self.cwd = os.fspath(cwd)
        self.home = os.path.expanduser("~")
        self.ask = ask
        self.remembered: list[Rule] = []
        self.refused_without_terminal = 0
        self._lock = asyncio.Lock()  # one question at a time, and a remembered answer counts for the next
        self.on_abort: Callable[[], None] | None = None
        # a person answers in their own time: no hook deadline (``loop/hooks.py``) while one may be asked
        self.hook_timeout: float | None = None if ask is not None else DEFAULT_HOOK_TIMEOUT

    async def __call__(self, info: ToolCallInfo) -> Block | None:
        name = info.call.name
        syscall = info.syscall or f"tool.{name}"  # the runner always names it; a bare hook call may not
        async with self._lock:
            verdict = decide(
                self.policy,
                syscall,
                info.args,
                cwd=self.cwd,
                home=self.home,
                protected=self.protected,
                remembered=self.remembered,  # (they answer questions; they never lift a deny)
            )
            if verdict.action == "auto":
                return None
            if verdict.action == "deny":
                return Block(f"Tool execution {verdict.reason}")
            if self.ask is None:
                self.refused_without_terminal += 1
                return Block(f"Tool execution denied: {self.unanswerable} ({verdict.reason})")
            answer = await self.ask(Question(name, info.args, tuple(verdict.tags), verdict.reason))
            if answer == "always":
                self.remembered.insert(0, remember_rule(syscall, tags=verdict.tags))
                return None
            if answer == "approve":
                return None
            if answer == "abort" and self.on_abort is not None:
                self.on_abort()
            return Block(denial_text(answer.reason) if isinstance(answer, Denial) else DENIED_BY_USER)


# ---------------------------------------------------------------------------------- agentloop approvals

approvals_app = App(
    name="approvals",
    help="What was decided about the tool calls your processes asked to make.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

#: ``--since`` as a span back from now: 7d, 12h, 30m, 90s
_SPAN = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_SPAN_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


@approvals_app.callback()
def _approvals() -> None:
    """What was decided about the tool calls your processes asked to make."""


def parse_since(text: str, now: float | None = None) -> float:
    """``--since`` as epoch seconds: a span back from ``now`` (``7d``, ``12h``, ``30m``, ``90s``,
    ``2w``), or a local date or date and time (``2026-01-31``, ``2026-01-31T09:00``).
    ``ValueError`` otherwise: a misread filter would list the wrong decisions as if complete."""
    spec = text.strip()
    span = _SPAN.fullmatch(spec.lower())
    if span is not None:
        return (time.time() if now is None else now) - float(span.group(1)) * _SPAN_SECONDS[span.group(2)]
    try:
        return datetime.datetime.fromisoformat(spec).timestamp()
    except ValueError:
        raise ValueError(
            "--since must be a span back from now (7d, 12h, 30m) or a date (2026-01-31, 2026-01-31T09:00);"
            f" got {text!r}"
        ) from None


def audit_table(entries: Sequence[Mapping[str, Any]]) -> Table:
    """The audit as ``agentloop approvals audit`` shows it, newest first; the preview is plain text
    (a command's ``[red]`` is no markup)."""
    table = Table(title="approvals audit (newest first)", title_justify="left")
    for column in ("when", "decision", "by", "pid", "tool", "tags"):
        table.add_column(column, no_wrap=True)
    table.add_column("arguments (preview)", overflow="fold")
    for entry in entries:
        decision = str(entry.get("decision"))
        if entry.get("remembered"):
            decision += f" (remember: {entry['remembered']})"
        if entry.get("edited"):
            decision += " (edited)"
        at = entry.get("at")
        when = datetime.datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M:%S") if isinstance(at, int | float) else "-"
        table.add_row(
            Text(when),
            Text(decision, style="green" if decision.startswith("approve") else "red"),
            Text(str(entry.get("by") or "-")),
            Text(str(entry.get("pid"))),
            Text(str(entry.get("tool_name"))),
            Text(", ".join(entry.get("tags") or []) or "-"),
            Text(str(entry.get("args_preview", ""))),
        )
    return table


#: the entries ``agentloop approvals audit`` lists by default
AUDIT_PAGE = 50


def next_page_command(filters: Mapping[str, str | None], before: str, *, json_output: bool = False) -> str:
    """The command that lists the audit's next page: this one's filters (without them the next
    page would be of every decision, shown as if it went on), older than ``before``; the server
    and token are left out (the token is a secret, and both usually come from the config)."""
    words = ["agentloop", "approvals", "audit"]
    for flag, value in filters.items():
        if value is not None:
            words += [flag, value]
    if json_output:
        words.append("--json")
    return shlex.join([*words, "--before", before])


@approvals_app.command("audit")
def audit_command(
    pid: Annotated[str | None, typer.Option("--pid", help="Only this process's decisions.")] = None,
    since: Annotated[
        str | None, typer.Option("--since", help="Only decisions since: a span (7d, 12h, 30m) or a date (2026-01-31).")
    ] = None,
    decision: Annotated[
        str | None,
        typer.Option("--decision", help="Only this decision: approve, deny, timeout, non-interactive or policy-deny."),
    ] = None,
    by: Annotated[str | None, typer.Option("--by", help="Only what this account answered.")] = None,
    account: Annotated[str | None, typer.Option("--account", help="Admins: another account's audit.")] = None,
    limit: Annotated[int, typer.Option("--limit", help="At most this many entries (up to 500).")] = AUDIT_PAGE,
    before: Annotated[str | None, typer.Option("--before", help="Older than this entry id (the next page).")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per entry.")] = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """List the approvals audit of your account, newest first: who approved or denied which call,
    what timed out, and what the policy refused without asking. Kept after a process is gone."""
    from agentloop.cli.client import call
    from agentloop.cli.main import CliError, _guarded

    with _guarded():
        try:
            start = parse_since(since) if since is not None else None
        except ValueError as exc:
            raise CliError(str(exc), 2) from None
        page = call(
            server,
            token,
            lambda client: client.approval_audit(
                account=account, pid=pid, since=start, decision=decision, by=by, before=before, limit=limit
            ),
        )
        entries = page["entries"]
        if json_output:
            for entry in entries:
                typer.echo(json.dumps(entry, ensure_ascii=False))
        else:
            Console(soft_wrap=False).print(audit_table(entries))
        if page["next_before"]:
            filters = {"--pid": pid, "--decision": decision, "--by": by, "--account": account}
            if start is not None:  # (the point a span meant now: the next page lists the same window)
                filters["--since"] = datetime.datetime.fromtimestamp(start).isoformat()
            if limit != AUDIT_PAGE:
                filters["--limit"] = str(limit)
            more = next_page_command(filters, page["next_before"], json_output=json_output)
            sys.stderr.write(f"more: {more}\n")
