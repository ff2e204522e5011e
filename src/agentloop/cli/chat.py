"""The interactive REPL behind ``agentloop chat``.

Two seams keep it testable: a ``LineReader`` (prompt_toolkit on a terminal, plain lines from a
pipe) and a ``Session`` (where turns run and the conversation lives: a durable process by
default, so quitting and coming back continues the conversation, or an in-memory ``Agent`` with a
``Transcript``). The REPL itself only decides what a line means and how a turn is shown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import errno
import getpass
import io
import json
import os
import shlex
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol, TextIO, TypeVar, runtime_checkable

from rich.console import Console
from rich.status import Status
from rich.text import Text

from agentloop.agent import Agent, Run, RunResult
from agentloop.cli.approvals import (
    Asker,
    Denial,
    Edited,
    PolicyHook,
    Question,
    ReadInterrupted,
    UserAnswer,
    ask_user,
)
from agentloop.cli.attach import AttachError, describe, load_attachment
from agentloop.cli.config import expand_home
from agentloop.cli.render import (
    READER_GONE,
    Interrupts,
    Progress,
    SignalRenderer,
    TextRenderer,
    context_line,
    one_line,
    play,
    prompt_manifest_lines,
    stderr_console,
    usage_line,
)
from agentloop.kernel import Kernel, Process, ProcessBusy
from agentloop.loop.hooks import InputRejected
from agentloop.loop.state import Mode
from agentloop.messages import AssistantMessage, MediaBlock, Message, user
from agentloop.process import signals as sig
from agentloop.process.api import RunActive
from agentloop.process.compaction import CompactionError
from agentloop.process.media import MediaError

HELP = (
    "/new starts a new conversation · /chat answers without tools, /agent with them · "
    "/attach FILE adds an image, a PDF or a text file to your next message (/detach drops them) · "
    "/prompt shows what the last system prompt was built from · "
    "/queue lists input waiting to run (/queue clear withdraws yours) · "
    "/compact [--keep N] [instructions] summarises the conversation now (all but the newest N messages) · "
    "/context shows how full the context window is · "
    "/usage shows what this conversation has cost · "
    "/title [text] shows or sets the conversation's title · "
    "/model [spec|default] shows or sets this conversation's model (provider:model) · "
    "/fork [N] continues a copy of this conversation (before your Nth message: type another) · "
    "/rewind [ID] drops what came after message ID (alone: your last message and what followed), archived · "
    "/retry asks the model again where the last answer failed or was cut short · "
    "/exit or Ctrl-D quits · Ctrl-C aborts a running answer"
)

T = TypeVar("T")


class _Failed(enum.Enum):
    FAILED = enum.auto()


#: What ``ChatRepl._ask`` gives for a session call that failed (its answer may itself be None).
_FAILED = _Failed.FAILED


class Transcript(Protocol):
    """The conversation between turns."""

    def history(self) -> list[Message]: ...

    def record(self, messages: list[Message]) -> None:
        """Replace the conversation with a finished run's whole history."""

    def clear(self) -> None: ...


class MemoryTranscript:
    def __init__(self) -> None:
        self._messages: list[Message] = []

    def history(self) -> list[Message]:
        return list(self._messages)

    def record(self, messages: list[Message]) -> None:
        self._messages = list(messages)

    def clear(self) -> None:
        self._messages = []


class LineReader(Protocol):
    shows_prompt: bool  # False for a pipe: whoever asks must print the question elsewhere

    def read(self, prompt: str) -> str:
        """One line of input; ``EOFError`` at the end, ``KeyboardInterrupt`` on Ctrl-C."""

    async def read_async(self, prompt: str) -> str:
        """The same, while a turn is running (an approval answer): the event loop keeps going.
        Ctrl-C is ``ReadInterrupted`` here, never ``KeyboardInterrupt``."""


class PlainReader:
    """For a pipe or a file: no prompt on stdout (it would mix with the answers), no history.

    An answer read during a turn comes from a daemon thread, so running tools keep running and
    a stuck read never holds up exit. If the turn is aborted before the line arrives, the read
    stays pending and the next ``read`` takes its line, so no input is lost or read twice.
    """

    shows_prompt = False

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdin
        if isinstance(self.stream, io.TextIOWrapper):  # a byte that is not UTF-8 must not end the chat
            self.stream.reconfigure(errors="replace")
        self._pending: concurrent.futures.Future[str] | None = None

    def _readline(self) -> str:
        line = self.stream.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")

    def read(self, prompt: str) -> str:
        pending, self._pending = self._pending, None
        if pending is not None:
            return pending.result()
        return self._readline()

    def unread(self, line: str) -> None:
        """Give a line back: the next read returns it."""
        future: concurrent.futures.Future[str] = concurrent.futures.Future()
        future.set_result(line)
        self._pending = future

    async def read_async(self, prompt: str) -> str:
        if self._pending is None:
            future: concurrent.futures.Future[str] = concurrent.futures.Future()

            def work() -> None:
                try:
                    future.set_result(self._readline())
                except BaseException as exc:
                    future.set_exception(exc)

            self._pending = future
            threading.Thread(target=work, name="agentloop-stdin", daemon=True).start()
        pending = self._pending
        line = await asyncio.shield(asyncio.wrap_future(pending))
        if self._pending is pending:
            self._pending = None
        return line


class TerminalReader:
    """prompt_toolkit with a persistent history, so earlier prompts are one arrow key away."""

    shows_prompt = True

    def __init__(self, history_file: Path | None) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, History, InMemoryHistory

        history: History = InMemoryHistory() if history_file is None else FileHistory(str(history_file))
        self.session: PromptSession[str] = PromptSession(history=history)
        self.answers: PromptSession[str] = PromptSession()  # y/n/a do not belong in the history

    def read(self, prompt: str) -> str:
        return self.session.prompt(prompt)

    async def read_async(self, prompt: str) -> str:
        # Ctrl-C is a key here (raw mode), so prompt_toolkit need not take SIGINT; if it did, it
        # would remove the turn's own handler on the way out and a later Ctrl-C would do nothing.
        try:
            return await self.answers.prompt_async(prompt, handle_sigint=False, set_exception_handler=False)
        except KeyboardInterrupt:  # out of a task, asyncio would re-raise it past the whole event loop
            raise ReadInterrupted from None

    async def read_prefilled(self, prompt: str, text: str) -> str:
        """``read_async`` with ``text`` already in the line, to edit (an approval's arguments)."""
        try:
            return await self.answers.prompt_async(
                prompt, default=text, handle_sigint=False, set_exception_handler=False
            )
        except KeyboardInterrupt:
            raise ReadInterrupted from None


def pasted_path(text: str) -> Path:
    """``/attach``'s argument as typed, or as a terminal pastes a file dropped on it: quoted, or
    with its spaces escaped (``'My file.png'``, ``My\\ file.png``). The text as it stands wins
    when it names something."""
    literal = expand_home(text, "/attach")
    if literal.exists():
        return literal
    try:
        words = shlex.split(text)
    except ValueError:  # an unbalanced quote: not shell words
        return literal
    if len(words) == 1 and words[0] != text:
        return expand_home(words[0], "/attach")
    return literal


def history_file(directory: Path) -> Path | None:
    """Where a terminal chat keeps what was typed (up-arrow recalls it): in the data directory,
    readable by its owner only, like the conversations it repeats. None if it cannot be made."""
    path = directory / "chat_history"
    try:
        make_data_dir(directory)
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600))
        os.chmod(path, 0o600)  # (one an older agentloop made readable by all)
    except OSError:
        return None
    return path


def default_reader(history: Path | None = None) -> LineReader:
    """A prompt with ``history`` (a file; None: kept in memory) on a terminal, else plain lines."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        return TerminalReader(history)
    return PlainReader()


class Spinner:
    """A spinner on a terminal while nothing else moves; nothing at all when stderr is a pipe."""

    def __init__(self, console: Console) -> None:
        self.enabled = console.is_terminal
        self._status: Status | None = Status("thinking…", console=console, spinner="dots") if self.enabled else None
        self._running = False

    def update(self, text: str) -> None:
        if self._status is not None:
            self._status.update(Text(text))

    def __call__(self, on: bool) -> None:
        if self._status is None or on == self._running:
            return
        self._running = on
        if on:
            self._status.update("thinking…")
            self._status.start()
        else:
            self._status.stop()


@dataclass(frozen=True)
class TurnOutcome:
    """How a turn ended, whichever runner ran it. ``reason`` is the stop reason, for the
    ``(stopped: …)`` line when a guard rather than the model ended the turn."""

    status: Literal["ok", "error", "aborted"]
    reason: str = "stop"
    error: str | None = None


class SessionError(Exception):
    """A command the session could not carry out (its server out of reach, say): the chat says
    why and goes on, as it does after a failed turn, instead of ending with the conversation."""


class Session(Protocol):
    """Where turns run and where the conversation lives between them: in memory
    (``AgentSession``) or in a durable process (``DurableSession`` in ``cli.durable``)."""

    async def turn(self, text: str, view: TextRenderer, ask: Asker, media: Sequence[MediaBlock] = ()) -> TurnOutcome:
        """Run one turn to its end, showing it on ``view``; ``ask`` puts approvals to the user;
        ``media`` go with the text."""

    async def resume(self, view: TextRenderer, ask: Asker) -> TurnOutcome:
        """Show a turn left unfinished by an earlier chat to its end (nothing in memory)."""

    async def new(self) -> None:
        """Start a fresh conversation (``SessionError`` when it cannot)."""

    async def set_mode(self, mode: Mode) -> None:
        """From the next turn on: ``chat`` answers from the same history without tools, ``agent``
        with them (``SessionError`` when it cannot)."""

    def abort(self) -> None:
        """Ctrl-C during a turn: stop it (the conversation stays valid); called from a signal handler."""


@runtime_checkable
class ShowsPrompt(Protocol):
    """A session whose runs log what their system prompt was built from (``/prompt``)."""

    async def prompt_manifest(self) -> dict[str, Any] | None:
        """The newest ``proc.prompt.compiled`` payload of the conversation, or None."""


@runtime_checkable
class HasUsage(Protocol):
    """A session whose process keeps usage totals (``/usage``)."""

    async def usage(self) -> dict[str, Any]:
        """The conversation's totals over its finished runs: ``{input, output, total_tokens, cost, runs}``."""


@runtime_checkable
class ShowsContext(Protocol):
    """A session whose process measures how full its context window is (``/context``)."""

    async def context(self) -> dict[str, Any]:
        """``Process.context()`` as a dict: level, ratio, tokens, window, threshold, policy."""


class Compaction(NamedTuple):
    """What ``/compact`` did, as it shows it: token counts are estimates of the history."""

    compacted: bool
    removed: int
    tokens_before: int
    tokens_after: int
    note: str  # why nothing was compacted


@runtime_checkable
class Compacts(Protocol):
    """A session whose process can summarise its history on demand (``/compact``)."""

    async def compact(self, instructions: str | None, keep_last: int | None = None) -> Compaction:
        """Summarise the conversation now; ``instructions`` say what the summary must keep,
        ``keep_last`` how many of the newest messages stay as they are (None: the rules choose)."""


def _keep_option(rest: str) -> tuple[int | None, str | None] | None:
    """``/compact``'s line: a leading ``--keep N`` (or ``--keep=N``), the instructions after it
    (None: none); None when N is not a count of messages."""
    words = rest.split(None, 1)
    if not words or not (words[0] == "--keep" or words[0].startswith("--keep=")):
        return None, rest.strip() or None
    if words[0] == "--keep":
        words = words[1].split(None, 1) if len(words) > 1 else [""]
        value = words[0]
    else:
        value = words[0][len("--keep=") :]
    if not (value.isascii() and value.isdigit() and len(value) <= 9):
        return None
    return int(value), (words[1].strip() or None) if len(words) > 1 else None


@runtime_checkable
class HasTitle(Protocol):
    """A session whose process has a title (``/title``), the name lists show instead of its pid."""

    async def title(self) -> str | None:
        """The title: the user's, or the one made after the first answer; None before."""

    async def set_title(self, text: str) -> str | None:
        """Name the conversation (``SessionError`` for a title that is not one line of plain text)."""


@runtime_checkable
class HasModel(Protocol):
    """A session whose process may have a model of its own (``/model``), over the account's and
    the default one."""

    async def model(self) -> dict[str, Any]:
        """``Process.model()`` as a dict: model, reasoning (its own), effective, source."""

    async def set_model(self, spec: str | None) -> dict[str, Any]:
        """Its own model from the next answer on (None: the default again); ``SessionError`` for
        one that cannot be used."""


@runtime_checkable
class Forks(Protocol):
    """A session whose process can be forked (``/fork``): the chat goes on in a copy."""

    async def fork(self, before: int | None) -> int:
        """Switch to a fork of the conversation: all of it (None), or what came before the user's
        message number ``before`` (from 1); how many messages the fork holds."""


class Rewind(NamedTuple):
    """What ``/rewind`` did: how many messages the conversation keeps, and how many it dropped."""

    kept: int
    removed: int


@runtime_checkable
class Rewinds(Protocol):
    """A session whose process can cut its history back in place (``/rewind``): the same
    conversation goes on from an earlier message, what came after it archived."""

    async def rewind(self, at: int | None) -> Rewind:
        """Drop everything after message id ``at`` (None: the user's last message and everything
        after it); ``SessionError`` for a point that cannot be one, or while a run is active."""


@runtime_checkable
class Retries(Protocol):
    """A session whose process can run the model again on its history with no new input
    (``/retry``): after a turn that failed (a provider error, an abort, the output limit), whose
    message the conversation kept."""

    async def retry(self, view: TextRenderer, ask: Asker) -> TurnOutcome:
        """Run the retried turn to its end, showing it on ``view``; ``SessionError`` when there is
        nothing to retry (the last turn was answered) or a run is under way."""


def before_last_user(messages: Sequence[tuple[int, str]]) -> int:
    """``/rewind``'s point when none is given: the id of the message before the user's last one
    ((id, role) pairs, oldest first; 0, the start, when that was the first), so that the rewind
    drops the last exchange and what followed it; ``SessionError`` when the user said nothing."""
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i][1] == "user"), None)
    if last is None:
        raise SessionError("not rewound: this conversation has no message of yours")
    return messages[last - 1][0] if last else 0


_MODEL_SOURCES = {"process": "this conversation's", "account": "your account's model.json", "default": "the default"}


class Waiting(NamedTuple):
    """One item waiting in a conversation's input queue, as ``/queue`` shows it."""

    id: int
    kind: str  # steer, queue or system
    text: str


@runtime_checkable
class HasQueue(Protocol):
    """A session whose process keeps an input queue (``/queue``): what was sent from elsewhere
    (another window, the web UI) while a run was under way, and system events, wait there."""

    async def queued(self) -> list[Waiting]:
        """What waits, in the order it will be taken."""

    async def clear_queue(self) -> list[Waiting]:
        """Withdraw the user's waiting input (the system events stay); returns what was withdrawn."""


class AgentSession:
    """Turns on an in-memory ``Agent``; the history lives in a ``Transcript``. Approvals, when the
    agent has a ``PolicyHook``, are asked through the turn's ``ask``."""

    def __init__(self, agent: Agent, transcript: Transcript | None = None, hook: PolicyHook | None = None) -> None:
        self.agent = agent
        self.transcript = transcript if transcript is not None else MemoryTranscript()
        self.hook = hook
        self.last_result: RunResult | None = None
        self.mode: Mode = "agent"
        self._run: Run | None = None

    async def set_mode(self, mode: Mode) -> None:
        self.mode = mode

    async def turn(self, text: str, view: TextRenderer, ask: Asker, media: Sequence[MediaBlock] = ()) -> TurnOutcome:
        prompt = user(text, *media) if media else text
        run = self._run = self.agent.start(prompt, history=self.transcript.history(), stream=True, mode=self.mode)
        if self.hook is not None:
            self.hook.ask = ask
            self.hook.on_abort = run.abort
        try:
            result = await play(run, view)
        finally:
            self._run = None
        self.last_result = result
        # An aborted or failed turn still joins the conversation (its history is valid: open
        # tool calls got cancelled results), so the user can go on.
        self.transcript.record(result.messages)
        if result.stop_reason == "aborted":
            return TurnOutcome("aborted", "aborted")
        if result.stop_reason == "error":
            return TurnOutcome("error", "error", result.error or "the model call failed")
        return TurnOutcome("ok", result.stop_reason)

    async def resume(self, view: TextRenderer, ask: Asker) -> TurnOutcome:
        return TurnOutcome("ok")

    async def new(self) -> None:
        self.transcript.clear()
        if self.hook is not None:
            self.hook.remembered.clear()  # "always" was said for that conversation

    def abort(self) -> None:
        if self._run is not None:
            self._run.abort()


class ChatRepl:
    """Reads lines, runs turns, keeps the conversation going until Ctrl-D or ``/exit``. It only
    decides what a line means and how a turn is shown; the ``Session`` decides where it runs."""

    def __init__(
        self,
        session: Session | Agent,
        *,
        reader: LineReader | None = None,
        history: Path | None = None,
        out: TextIO | None = None,
        err: Console | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.session: Session = AgentSession(session) if isinstance(session, Agent) else session
        self.reader = reader if reader is not None else default_reader(history)
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else stderr_console()
        self.progress = progress
        self.prompt = "› "
        self.last_outcome: TurnOutcome | None = None
        self.attached: list[MediaBlock] = []  # /attach: they go with the next message
        self.aborted = False  # a turn was aborted: work that ignores cancellation may still run
        self.failed = False  # the last turn ended in an error
        self._cancelled: asyncio.Event | None = None

    def loop(self, event_loop: asyncio.AbstractEventLoop | None = None) -> int:
        """Run until the user quits; the exit code is 0, or 1 when input is piped and the last
        turn failed. One event loop serves every turn, so clients a model keeps (HTTP pools) stay bound
        to a loop that is still alive."""
        own = event_loop is None
        ev = event_loop if event_loop is not None else asyncio.new_event_loop()
        try:
            while True:
                try:
                    line = self.reader.read(self.prompt)
                except KeyboardInterrupt:
                    continue  # Ctrl-C at the prompt clears the line
                except EOFError:
                    break
                if not self.command(line, ev) or READER_GONE.is_set():
                    break  # (nobody reads the answers any more: no more turns for nobody)
        finally:
            if own:
                ev.run_until_complete(ev.shutdown_asyncgens())
                ev.close()
        # piped (a script reads the answers): a last turn that failed fails the command, as ``run``
        return 1 if self.failed and not self.reader.shows_prompt else 0

    def command(self, line: str, ev: asyncio.AbstractEventLoop) -> bool:
        """Act on one input line; False means quit."""
        text = line.strip()
        if not text:
            return True
        if text.startswith("/"):
            word = text.split()[0].lower()
            if word in ("/exit", "/quit"):
                return False
            if word in ("/new", "/reset", "/clear"):
                if self._carry_out(self.session.new(), ev):
                    self.err.print(Text("(new conversation)", style="dim"))
                return True
            if word in ("/chat", "/agent"):
                mode: Mode = "chat" if word == "/chat" else "agent"
                if self._carry_out(self.session.set_mode(mode), ev):
                    shown = "chat mode: answers without tools" if mode == "chat" else "agent mode: tools on"
                    self.err.print(Text(f"({shown})", style="dim"))
                return True
            if word == "/retry":
                self.retry(ev)
                return True
            if (act := self._commands(ev).get(word)) is not None:
                act(text[len(word) :].strip())
                return True
            if not text.startswith("//"):  # "//x" sends "/x" as text
                self.err.print(Text(f"unknown command {word}; {HELP}", style="yellow"))
                return True
            text = text[1:]
        self.last_outcome = ev.run_until_complete(self.turn(text))
        return True

    def _commands(self, ev: asyncio.AbstractEventLoop) -> dict[str, Callable[[str], None]]:
        """The slash commands that only show or change something, each given the rest of its line."""
        show_help: Callable[[str], None] = lambda _: self.err.print(Text(HELP, style="dim"))  # noqa: E731
        return {
            "/attach": lambda rest: self.attach(rest),
            "/detach": lambda _: self.attach(None),
            "/prompt": lambda _: self.show_prompt(ev),
            "/compact": lambda rest: self.compact(rest, ev),
            "/queue": lambda rest: self.show_queue(rest.lower(), ev),
            "/usage": lambda _: self.show_usage(ev),
            "/title": lambda rest: self.title(rest or None, ev),
            "/model": lambda rest: self.model(rest or None, ev),
            "/context": lambda _: self.show_context(ev),
            "/fork": lambda rest: self.fork(rest, ev),
            "/rewind": lambda rest: self.rewind(rest, ev),
            "/help": show_help,
            "/?": show_help,
        }

    def _carry_out(self, command: Awaitable[None], ev: asyncio.AbstractEventLoop) -> bool:
        """Run a session command; whether it was done (if not, the user is told why)."""
        return self._ask(command, ev) is not _FAILED

    def _ask(self, call: Awaitable[T], ev: asyncio.AbstractEventLoop) -> T | Literal[_Failed.FAILED]:
        """What a session call answers, or ``_FAILED`` once the user is told why it failed (a
        remote chat's server out of reach): said, and the chat goes on."""
        try:
            return ev.run_until_complete(call)
        except SessionError as exc:
            self.failed = True
            self.err.print(Text(f"error: {one_line(str(exc), 400)}", style="red"))
            return _FAILED

    def show_prompt(self, ev: asyncio.AbstractEventLoop) -> None:
        """``/prompt``: what the conversation's newest system prompt was built from, so a user can
        see why it is as large as it is and which files were cut or left out."""
        if not isinstance(self.session, ShowsPrompt):
            self.err.print(Text("(no prompt manifest: this chat does not log one)", style="dim"))
            return
        if (manifest := self._ask(self.session.prompt_manifest(), ev)) is _FAILED:
            return
        if manifest is None:
            self.err.print(Text("(no prompt manifest yet: it is logged when a run's prompt is built)", style="dim"))
            return
        for line in prompt_manifest_lines(manifest):
            self.err.print(Text(line, style="yellow" if line.startswith("warning: ") else "dim"))

    def show_usage(self, ev: asyncio.AbstractEventLoop) -> None:
        """``/usage``: what this conversation has cost so far (its process's totals, kept across
        restarts and resets), so a user can see it without a server's admin."""
        if not isinstance(self.session, HasUsage):
            self.err.print(Text("(no usage totals: this chat keeps no process)", style="dim"))
            return
        if (usage := self._ask(self.session.usage(), ev)) is _FAILED:
            return
        self.err.print(Text(f"({usage_line(usage)})", style="dim"))

    def show_context(self, ev: asyncio.AbstractEventLoop) -> None:
        """``/context``: how full the context window is and when it will be compacted, so a user
        can compact or start anew before a run has to."""
        if not isinstance(self.session, ShowsContext):
            self.err.print(Text("(no context figures: this chat keeps its conversation in memory)", style="dim"))
            return
        if (ctx := self._ask(self.session.context(), ev)) is _FAILED:
            return
        self.err.print(Text(f"({context_line(ctx)})", style="dim"))

    def title(self, text: str | None, ev: asyncio.AbstractEventLoop) -> None:
        """``/title``: the name lists (the web UI, ``agentloop ps``) show for this conversation;
        ``/title TEXT`` renames it, and no automatic title replaces that one."""
        if not isinstance(self.session, HasTitle):
            self.err.print(Text("(no title: this chat keeps no process)", style="dim"))
            return
        if (named := self._ask(self.session.title() if text is None else self.session.set_title(text), ev)) is _FAILED:
            return
        if text is not None:
            self.err.print(Text(f"(title set: {named})", style="dim"))
        elif named is None:
            self.err.print(Text("(no title yet: one is made from your first message once it is answered)", style="dim"))
        else:
            self.err.print(Text(f"(title: {named})", style="dim"))

    def model(self, spec: str | None, ev: asyncio.AbstractEventLoop) -> None:
        """``/model``: the model that answers this conversation and where it comes from (its own
        choice, the account's ``model.json``, the default); ``/model SPEC`` picks its own from the
        next answer on, ``/model default`` drops it."""
        if not isinstance(self.session, HasModel):
            self.err.print(Text("(no model of its own: this chat keeps no process)", style="dim"))
            return
        clear = spec is not None and spec.lower() == "default"
        call = self.session.model() if spec is None else self.session.set_model(None if clear else spec)
        if (choice := self._ask(call, ev)) is _FAILED:
            return
        effective, source = choice.get("effective"), _MODEL_SOURCES.get(str(choice.get("source")), "?")
        level = f", reasoning {choice['reasoning']}" if choice.get("reasoning") else ""
        if clear:
            shown = f"model: back to {source}, {effective}"
        elif spec is not None:
            shown = f"model set: {choice.get('model')}{level}, from the next answer on"
        else:
            shown = f"model: {effective}, {source}{level}"
        self.err.print(Text(f"({shown})", style="dim"))

    def fork(self, rest: str, ev: asyncio.AbstractEventLoop) -> None:
        """``/fork``: go on in a copy of the conversation, which stays as it was; ``/fork N``: in a
        copy of what came before your Nth message, so that what you type next takes its place."""
        if not isinstance(self.session, Forks):
            self.err.print(Text("(no fork: this chat cannot copy its conversation)", style="dim"))
            return
        if rest and (not rest.isascii() or not rest.isdigit() or int(rest) < 1):
            self.err.print(Text("usage: /fork [N], N the number of one of your messages, from 1", style="yellow"))
            return
        if (count := self._ask(self.session.fork(int(rest) if rest else None), ev)) is _FAILED:
            return
        where = f"before your message {rest}" if rest else "all of it"
        self.err.print(
            Text(f"(forked: a new conversation with {count} messages, {where}; the old one is kept)", style="dim")
        )

    def rewind(self, rest: str, ev: asyncio.AbstractEventLoop) -> None:
        """``/rewind ID``: drop what came after message ID from this conversation (it stays this
        one: an edit-and-retry); ``/rewind``: drop your last message and what followed it. What is
        dropped is archived, not lost."""
        if not isinstance(self.session, Rewinds):
            self.err.print(Text("(no rewind: this chat cannot cut its conversation back)", style="dim"))
            return
        if rest and not (rest.isascii() and rest.isdigit() and len(rest) <= 18):
            self.err.print(Text("usage: /rewind [ID], ID the id of the message to go on from", style="yellow"))
            return
        if (done := self._ask(self.session.rewind(int(rest) if rest else None), ev)) is _FAILED:
            return
        if not done.removed:
            self.err.print(Text(f"(nothing to rewind: message {rest} is the last one)", style="dim"))
            return
        dropped = f"{done.removed} message{'s' * (done.removed != 1)} dropped and archived"
        self.err.print(Text(f"(rewound: {dropped}, {done.kept} kept)", style="dim"))

    def retry(self, ev: asyncio.AbstractEventLoop) -> None:
        """``/retry``: the last turn failed (or was aborted, or cut at the output limit) and the
        conversation kept the message: ask the model again, shown as a turn, without typing the
        message again (which would leave it twice in the conversation)."""
        session = self.session
        if not isinstance(session, Retries):
            self.err.print(Text("(no retry: this chat keeps its conversation in memory; send it again)", style="dim"))
            return
        if (outcome := self._ask(self._play(lambda view: session.retry(view, self.ask)), ev)) is not _FAILED:
            self.last_outcome = outcome

    def compact(self, rest: str, ev: asyncio.AbstractEventLoop) -> None:
        """``/compact [--keep N] [instructions]``: summarise the conversation now, to free the
        context before it fills (or to refocus it), all but the newest N messages with ``--keep``
        (else where the compaction rules cut); says how many tokens it took from how many."""
        if not isinstance(self.session, Compacts):
            self.err.print(Text("(no compaction: this chat keeps its conversation in memory)", style="dim"))
            return
        if (asked := _keep_option(rest)) is None:
            self.err.print(Text("usage: /compact [--keep N] [instructions] (N: how many messages)", style="yellow"))
            return
        keep, instructions = asked
        keeping = {} if keep is None else {"keep_last": keep}
        if (done := self._ask(self.session.compact(instructions, **keeping), ev)) is _FAILED:
            return
        if not done.compacted:
            self.err.print(Text(f"({one_line(done.note, 300)}; {done.tokens_before:,} tokens)", style="dim"))
            return
        summarised = f"{done.removed} message{'s' * (done.removed != 1)} summarised"
        tokens = f"{done.tokens_before:,} → {done.tokens_after:,} tokens"
        self.err.print(Text(f"(compacted: {summarised}, {tokens})", style="dim"))

    def show_queue(self, arg: str, ev: asyncio.AbstractEventLoop) -> None:
        """``/queue``: the input waiting to run, so a user sees what another window sent meanwhile;
        ``/queue clear`` withdraws the user's part of it before it runs."""
        if arg not in ("", "clear"):
            self.err.print(Text("usage: /queue lists what waits, /queue clear withdraws your messages", style="yellow"))
            return
        if not isinstance(self.session, HasQueue):
            self.err.print(Text("(no queue: this chat runs one turn at a time in memory)", style="dim"))
            return
        if (items := self._ask(self.session.clear_queue() if arg else self.session.queued(), ev)) is _FAILED:
            return
        if arg:
            count = len(items)
            said = f"withdrew {count} waiting message{'s' * (count != 1)}" if count else "nothing of yours was waiting"
            self.err.print(Text(f"({said})", style="dim"))
            return
        if not items:
            self.err.print(Text("(nothing waiting)", style="dim"))
            return
        self.err.print(Text(f"({len(items)} waiting, in the order they will be taken)", style="dim"))
        for item in items:
            self.err.print(Text(f"  #{item.id} {item.kind:<6} {one_line(item.text, 100)}", style="dim"))

    async def ask(self, question: Question) -> UserAnswer:
        """An approval, asked in the middle of a turn (the spinner steps aside meanwhile)."""
        return await ask_user(
            question,
            self.reader.read_async,
            self.err,
            shows_prompt=self.reader.shows_prompt,
            cancelled=self._cancelled,
            unread=getattr(self.reader, "unread", None),
            prefilled=getattr(self.reader, "read_prefilled", None),
        )

    def attach(self, path: str | None) -> None:
        """``/attach FILE`` (relative to the current directory), ``/attach`` to list, ``/detach``."""
        if path is None:
            self.attached.clear()
            self.err.print(Text("(no attachments)", style="dim"))
        elif not path:
            shown = "; ".join(describe(b) for b in self.attached) or "nothing"
            self.err.print(Text(f"(attached: {shown})", style="dim"))
        else:
            try:
                block = load_attachment(pasted_path(path))
            except (AttachError, ValueError) as exc:
                self.err.print(Text(f"cannot attach: {exc}", style="yellow"))
                return
            self.attached.append(block)
            self.err.print(Text(f"(attached {describe(block)}: it goes with your next message)", style="dim"))

    async def turn(self, text: str) -> TurnOutcome:
        """Run one turn and show how it ended (with what was attached since the last one)."""
        media, self.attached = self.attached, []
        return await self._play(lambda view: self.session.turn(text, view, self.ask, media))

    async def resume(self) -> TurnOutcome:
        return await self._play(lambda view: self.session.resume(view, self.ask))

    async def _play(self, start: Callable[[TextRenderer], Awaitable[TurnOutcome]]) -> TurnOutcome:
        spinner = Spinner(self.err)
        progress = self.progress
        if progress is not None and spinner.enabled:
            progress.route = spinner.update  # model loading shows in the spinner, not over it

        def waiting(on: bool) -> None:
            if not on and progress is not None:
                progress.done()
            spinner(on)

        renderer = TextRenderer(self.out, self.err, on_wait=waiting)
        cancelled = self._cancelled = asyncio.Event()

        def on_abort() -> None:
            spinner(False)
            cancelled.set()

        interrupts = Interrupts()
        self.failed = False
        try:
            # (SIGTERM ends the chat instead: see ``exit_on_terminate``)
            with interrupts.abort_on_signal(self.session, on_abort=on_abort, signals=(signal.SIGINT,)):
                outcome = await start(renderer)
        finally:
            self._cancelled = None
            spinner(False)
            if progress is not None:
                progress.route = None
                progress.done()
        if outcome.status == "aborted":
            self.aborted = True
            self.err.print(Text("(aborted)", style="yellow"))
        elif outcome.status == "error":
            self.failed = True
            self.err.print(Text(f"error: {one_line(outcome.error or 'the model call failed', 400)}", style="red"))
        elif outcome.reason not in ("stop", "length", "turn.complete"):
            self.err.print(Text(f"(stopped: {outcome.reason})", style="dim"))
        return outcome


# ---------------------------------------------------------------------------------- durable chat

STATE_FILE = "chat.json"


def data_dir(explicit: Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """``--data``, else ``$AGENTLOOP_DATA``, else ``$XDG_DATA_HOME/agentloop``, else ``~/.local/share/agentloop``."""
    env = os.environ if env is None else env
    if explicit is not None:
        return expand_home(explicit, "--data")
    if env.get("AGENTLOOP_DATA"):
        return expand_home(env["AGENTLOOP_DATA"], "$AGENTLOOP_DATA")
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "agentloop"


def make_data_dir(directory: Path) -> Path:
    """Create the data directory for its owner only: it holds every conversation, the archives
    and the token hashes. (An existing directory keeps the permissions it has.)"""
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "it exists and is not a directory", str(directory))
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory


def local_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name (a container without a passwd entry)
        return str(os.getuid()) if hasattr(os, "getuid") else "user"


class ChatState:
    """Which process each workspace's chat is talking to, and the last signal it showed.

    A small JSON file beside the store: losing it only means the next chat falls back to the
    user's newest process in that workspace, so it is written plainly (atomically, never locked).
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> tuple[str, int] | None:
        entry = self._load().get("chats", {}).get(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("pid"), str):
            return None
        seq = entry.get("seq")
        return entry["pid"], seq if isinstance(seq, int) and seq >= 0 else 0

    def put(self, key: str, pid: str, seq: int) -> None:
        data = self._load()
        chats = data.get("chats")
        if not isinstance(chats, dict):
            chats = data["chats"] = {}
        chats[key] = {"pid": pid, "seq": seq}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
            tmp.replace(self.path)
        except OSError:
            pass  # the chat still works; the next one starts (or finds) a conversation on its own


class DurableSession:
    """Turns on a durable process: ``send`` the line, then show the process's signals until that
    run finishes, answering approvals as they come. The history lives in the store, so the REPL
    can quit at any time and a later ``agentloop chat`` continues where this one stopped."""

    def __init__(self, kernel: Kernel, *, owner: str, cwd: Path, state: ChatState) -> None:
        self.kernel = kernel
        self.owner = owner
        self.cwd = cwd
        self.state = state
        self.key = str(cwd)
        self.proc: Process | None = None
        self.seq = 0  # the last signal shown: the next turn follows from here
        self._abort: asyncio.Task[bool] | None = None
        self._manifest: tuple[str, int, dict[str, Any] | None] = ("", 0, None)  # (pid, seq read to, newest)

    @property
    def pid(self) -> str:
        return self.process.pid

    @property
    def process(self) -> Process:
        if self.proc is None:
            raise RuntimeError("the chat has no process yet: call open() first")
        return self.proc

    async def open(self, new: bool = False) -> int | None:
        """Attach to this workspace's conversation (or start one); returns how many messages it
        has when it continues one, None when it is new."""
        if not new:
            proc = await self._find()
            if proc is not None:
                self.proc = proc
                self.seq = await self._last_seq(proc, self.seq)
                self._save()
                return len(await proc.messages())
        await self.new()
        return None

    async def _find(self) -> Process | None:
        saved = self.state.get(self.key)
        if saved is not None:
            pid, self.seq = saved
            record = await self.kernel.store.get_process(pid)
            if record is not None and record.state != "killed":
                return Process(self.kernel, pid)
        self.seq = 0
        mine = [r for r in await self.kernel.processes(self.owner) if r.cwd == self.key and r.parent_pid is None]
        mine = [r for r in mine if r.state != "killed"]
        if not mine:
            return None
        newest = max(mine, key=lambda r: (r.updated_at, r.created_at))
        return Process(self.kernel, newest.pid)

    @staticmethod
    async def _last_seq(proc: Process, after: int) -> int:
        """Skip what earlier sessions already showed: follow from the end of the log."""
        last = after
        while True:
            page = await proc.kernel.store.events(proc.pid, after_seq=last, limit=1000)
            if not page:
                return last
            last = page[-1].seq

    async def prompt_manifest(self) -> dict[str, Any] | None:
        """The newest ``proc.prompt.compiled`` in the process's log, read on from where the last
        look ended: asking again costs only what was logged since."""
        pid = self.process.pid
        known, seen, found = self._manifest if self._manifest[0] == pid else (pid, 0, None)
        while page := await self.kernel.store.events(pid, after_seq=seen, limit=1000):
            seen = page[-1].seq
            found = next((row.payload for row in reversed(page) if row.signal == sig.PROMPT_COMPILED), found)
        self._manifest = (known, seen, found)
        return found

    def _save(self) -> None:
        if self.proc is not None:
            self.state.put(self.key, self.proc.pid, self.seq)

    async def set_mode(self, mode: Mode) -> None:
        await self.process.set_mode(mode)

    async def title(self) -> str | None:
        return await self.process.title()

    async def set_title(self, text: str) -> str | None:
        try:
            return await self.process.set_title(text)
        except (TypeError, ValueError) as exc:
            raise SessionError(f"the title was not set: {exc}") from exc

    async def model(self) -> dict[str, Any]:
        return (await self.process.model()).as_dict()

    async def set_model(self, spec: str | None) -> dict[str, Any]:
        """Its own model (keeping its own reasoning level), or none at all (``None``)."""
        try:
            level = (await self.process.model()).reasoning if spec is not None else None
            return (await self.process.set_model(spec, reasoning=level)).as_dict()
        except ValueError as exc:
            raise SessionError(f"the model was not changed: {exc}") from exc

    async def queued(self) -> list[Waiting]:
        return [Waiting(i.id, i.kind, i.message.text) for i in await self.process.queued()]

    async def clear_queue(self) -> list[Waiting]:
        return [Waiting(i.id, i.kind, i.message.text) for i in await self.process.withdraw()]

    async def usage(self) -> dict[str, Any]:
        return (await self.process.info()).usage.as_dict()

    async def context(self) -> dict[str, Any]:
        return (await self.process.context()).as_dict()

    async def compact(self, instructions: str | None, keep_last: int | None = None) -> Compaction:
        try:
            if keep_last is None:  # the compaction rules' cut, as before
                done = await self.process.compact(instructions)
            else:
                done = await self.process.compact(instructions, keep_last=keep_last)
        # busy (a run, another worker's lease), or instructions it cannot take (too long, a NUL: ValueError)
        except (RunActive, ProcessBusy, CompactionError, ValueError) as exc:
            raise SessionError(f"not compacted: {exc}") from exc
        return Compaction(done.compacted, done.removed, done.tokens_before, done.tokens_after, done.note)

    async def fork(self, before: int | None) -> int:
        """Go on in a fork (``Process.fork``): of the whole conversation, or of what came before the
        user's message number ``before``."""
        at = None
        if before is not None:
            history = await self.process.history()
            mine = [i for i, m in enumerate(history) if m.message.role == "user"]
            if before > len(mine):
                raise SessionError(f"not forked: this conversation has {len(mine)} messages of yours")
            if mine[before - 1] == 0:
                raise SessionError("not forked: nothing comes before your first message (/new starts afresh)")
            at = history[mine[before - 1] - 1].id
        try:
            self.proc = await self.process.fork(at=at)
        except ValueError as exc:
            raise SessionError(f"not forked: {exc}") from exc
        self.seq = await self._last_seq(self.proc, 0)
        self._save()
        return len(await self.proc.messages())

    async def rewind(self, at: int | None) -> Rewind:
        """Cut the conversation back in place (``Process.rewind``) to message id ``at``, or to
        before the user's last message."""
        if at is None:
            at = before_last_user([(m.id, m.message.role) for m in await self.process.history()])
        try:
            done = await self.process.rewind(at)
        # a run under way, another worker's lease, a point that is not one (ValueError)
        except (RunActive, ProcessBusy, ValueError) as exc:
            raise SessionError(f"not rewound: {exc}") from exc
        return Rewind(done.kept, done.removed)

    async def new(self) -> None:
        self.proc = await self.kernel.spawn(owner=self.owner, cwd=self.cwd, interactive=True)
        self.seq = 0
        self._save()

    def abort(self) -> None:
        if self.proc is not None and (self._abort is None or self._abort.done()):
            self._abort = asyncio.get_running_loop().create_task(self.proc.abort())

    async def unfinished(self) -> bool:
        """A run left over from before (the chat quit or crashed mid-turn; the kernel resumed it)."""
        record = await self.process.info()
        return record.current_run is not None

    async def resume(self, view: TextRenderer, ask: Asker) -> TurnOutcome:
        """Follow the unfinished run to its end, as if its turn had just been sent."""
        record = await self.process.info()
        run = record.current_run
        if run is None:
            return TurnOutcome("ok")
        return await self._follow(str(run["run_id"]), view, ask)

    async def retry(self, view: TextRenderer, ask: Asker) -> TurnOutcome:
        """``/retry``: run the model again where the last turn ended without an answer
        (``Process.retry``), then follow that run as a turn."""
        proc = self.process
        if await self.unfinished():  # a turn under way is followed, not retried
            return await self.resume(view, ask)
        hub = self.kernel.engine.hub
        early = hub.watch(proc.pid)  # (deltas stream only while someone watches: from before the run)
        try:
            try:
                receipt = await proc.retry()
            # after an answer (NothingToRetry), a run started meanwhile, another worker's lease
            except (RunActive, ProcessBusy, ValueError) as exc:
                raise SessionError(f"not retried: {exc}") from exc
            return await self._follow(receipt.run_id, view, ask, early=lambda: hub.unwatch(proc.pid, early))
        finally:
            hub.unwatch(proc.pid, early)

    async def turn(self, text: str, view: TextRenderer, ask: Asker, media: Sequence[MediaBlock] = ()) -> TurnOutcome:
        proc = self.process
        if await self.unfinished():  # never start a turn behind one the user cannot see
            await self.resume(view, ask)
        hub = self.kernel.engine.hub
        # The engine streams deltas only while someone watches: watch from before the run starts.
        early = hub.watch(proc.pid)
        try:
            try:
                receipt = await proc.send(text, media=media)
            except MediaError as exc:
                return TurnOutcome("error", "error", f"the attachment was refused: {exc}")
            except InputRejected as exc:  # (first: a RuntimeError, not the ValueError below)
                return TurnOutcome("error", "error", f"the message was refused: {exc}")
            except ValueError as exc:  # text that cannot be stored (bytes that were not UTF-8)
                return TurnOutcome("error", "error", f"the message was refused: {exc}")
            if receipt.handled:  # an input hook took it: no run to follow
                return TurnOutcome("ok")
            return await self._follow(receipt.run_id, view, ask, early=lambda: hub.unwatch(proc.pid, early))
        finally:
            hub.unwatch(proc.pid, early)

    async def _follow(
        self, run_id: str, view: TextRenderer, ask: Asker, early: Callable[[], None] | None = None
    ) -> TurnOutcome:
        proc = self.process
        render = SignalRenderer(view)
        answered: set[str] = set()
        outcome = TurnOutcome("ok")
        try:
            for row in await proc.pending_approvals():  # asked before this client was watching
                if row.run_id == run_id or row.pid != proc.pid:  # (or a subagent's, put to this person)
                    await self._answer(Question.from_row(row), view, ask, answered)
            stream = proc.signals(after_seq=self.seq, follow=True)
            async with aclosing(stream) as signals:
                async for signal in signals:
                    if early is not None:
                        early()
                        early = None
                    if signal.seq is not None:
                        self.seq = signal.seq
                    payload = signal.payload
                    if signal.signal == sig.TOOL_FINISHED and not view.knows(str(payload.get("callId"))):
                        await self._learn_call(str(payload.get("callId")), view)
                    render.handle(signal)
                    if signal.signal == sig.HIL_REQUESTED and (payload.get("runId") == run_id or "subagent" in payload):
                        await self._answer(Question.from_payload(payload), view, ask, answered)
                    if signal.signal == sig.RUN_FINISHED and payload.get("runId") == run_id:
                        outcome = _outcome(payload)
                        break
        finally:
            self._save()
        await proc.wait_idle()
        return outcome

    async def _learn_call(self, call_id: str, view: TextRenderer) -> None:
        """A call the policy refused never started, so no signal showed its arguments; the
        assistant message that made it has them (it was committed with the refusal)."""
        for stored in reversed(await self.process.history(limit=20)):
            message = stored.message
            if isinstance(message, AssistantMessage):
                for block in message.tool_calls:
                    if block.id == call_id:
                        view.tool_start(call_id, block.name, dict(block.arguments), show=False)
                        return

    async def _answer(self, question: Question, view: TextRenderer, ask: Asker, answered: set[str]) -> None:
        if question.request_id in answered:
            return
        answered.add(question.request_id)
        view.pause()
        question = dataclasses.replace(question, editable=True)  # (the kernel's: it takes edits and scopes)
        while True:
            answer = await ask(question)
            if answer == "abort":
                self.abort()
                return
            decision = "approve" if answer in ("approve", "always", "account") or isinstance(answer, Edited) else "deny"
            reason = answer.reason if isinstance(answer, Denial) else None
            remember: bool | str = "account" if answer == "account" else answer == "always"
            arguments = answer.arguments if isinstance(answer, Edited) else None
            try:
                await self.process.hil(question.request_id, decision, remember, reason, arguments=arguments)
            except KeyError:  # answered elsewhere, or the run ended meanwhile
                return
            except (TypeError, ValueError) as exc:  # edited arguments, or an account rule, refused: still pending
                view.note(Text(f"not done: {exc}", style="yellow"))
                continue
            break
        view.waiting()


def _outcome(payload: Mapping[str, Any]) -> TurnOutcome:
    status = payload.get("status")
    reason = str(payload.get("reason") or "stop")
    if status == "aborted":
        return TurnOutcome("aborted", reason)
    if status == "error":
        return TurnOutcome("error", reason, str(payload.get("error") or "the model call failed"))
    return TurnOutcome("ok", reason)
