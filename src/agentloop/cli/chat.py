"""The interactive REPL behind ``agentloop chat``.

Three seams keep it testable and ready for durable chat: a ``LineReader`` (prompt_toolkit on a
terminal, plain lines from a pipe), a ``Transcript`` (where the conversation lives between turns;
in memory here, a durable process later) and the ``Agent`` that runs each turn. The REPL itself
only decides what a line means and how a turn is shown.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Protocol, TextIO

from rich.console import Console
from rich.status import Status
from rich.text import Text

from agentloop.agent import Agent, RunResult
from agentloop.cli.render import Interrupts, Progress, TextRenderer, one_line, play, stderr_console
from agentloop.messages import Message

HELP = "/new starts a new conversation · /exit or Ctrl-D quits · Ctrl-C aborts a running answer"


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
    def read(self, prompt: str) -> str:
        """One line of input; ``EOFError`` at the end, ``KeyboardInterrupt`` on Ctrl-C."""


class PlainReader:
    """For a pipe or a file: no prompt on stdout (it would mix with the answers), no history."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdin

    def read(self, prompt: str) -> str:
        line = self.stream.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")


class TerminalReader:
    """prompt_toolkit with a persistent history, so earlier prompts are one arrow key away."""

    def __init__(self, history_file: Path | None) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, History, InMemoryHistory

        history: History = InMemoryHistory()
        if history_file is not None:
            try:
                history_file.parent.mkdir(parents=True, exist_ok=True)
                history = FileHistory(str(history_file))
            except OSError:
                pass
        self.session: PromptSession[str] = PromptSession(history=history)

    def read(self, prompt: str) -> str:
        return self.session.prompt(prompt)


def history_file(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "agentloop" / "chat_history"


def default_reader() -> LineReader:
    if sys.stdin.isatty() and sys.stdout.isatty():
        return TerminalReader(history_file())
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


class ChatRepl:
    """Reads lines, runs turns, keeps the conversation going until Ctrl-D or ``/exit``."""

    def __init__(
        self,
        agent: Agent,
        *,
        transcript: Transcript | None = None,
        reader: LineReader | None = None,
        out: TextIO | None = None,
        err: Console | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.agent = agent
        self.transcript = transcript if transcript is not None else MemoryTranscript()
        self.reader = reader if reader is not None else default_reader()
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else stderr_console()
        self.progress = progress
        self.prompt = "› "
        self.last_result: RunResult | None = None
        self.aborted = False  # a turn was aborted: work that ignores cancellation may still run

    def loop(self, event_loop: asyncio.AbstractEventLoop | None = None) -> int:
        """Run until the user quits; the exit code is 0. One event loop serves every turn, so
        clients a model keeps (HTTP pools) stay bound to a loop that is still alive."""
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
                if not self.command(line, ev):
                    break
        finally:
            if own:
                ev.run_until_complete(ev.shutdown_asyncgens())
                ev.close()
        return 0

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
                self.transcript.clear()
                self.err.print(Text("(new conversation)", style="dim"))
                return True
            if word in ("/help", "/?"):
                self.err.print(Text(HELP, style="dim"))
                return True
            if not text.startswith("//"):  # "//x" sends "/x" as text
                self.err.print(Text(f"unknown command {word}; {HELP}", style="yellow"))
                return True
            text = text[1:]
        self.last_result = ev.run_until_complete(self.turn(text))
        return True

    async def turn(self, text: str) -> RunResult:
        """Run one turn and show it. An aborted or failed turn still joins the conversation
        (its history is valid: open tool calls got cancelled results), so the user can go on."""
        spinner = Spinner(self.err)
        progress = self.progress
        if progress is not None and spinner.enabled:
            progress.route = spinner.update  # model loading shows in the spinner, not over it

        def waiting(on: bool) -> None:
            if not on and progress is not None:
                progress.done()
            spinner(on)

        renderer = TextRenderer(self.out, self.err, on_wait=waiting)
        run = self.agent.start(text, history=self.transcript.history(), stream=True)
        interrupts = Interrupts()
        try:
            with interrupts.abort_on_signal(run, on_abort=lambda: spinner(False)):
                result = await play(run, renderer)
        finally:
            spinner(False)
            if progress is not None:
                progress.route = None
                progress.done()
        self.transcript.record(result.messages)
        if result.stop_reason == "aborted":
            self.aborted = True
            self.err.print(Text("(aborted)", style="yellow"))
        elif result.stop_reason == "error":
            self.err.print(Text(f"error: {one_line(result.error or 'the model call failed', 400)}", style="red"))
        elif result.stop_reason not in ("stop", "length"):
            self.err.print(Text(f"(stopped: {result.stop_reason})", style="dim"))
        return result
