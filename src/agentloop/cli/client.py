"""The CLI as a client of a running server: ``ps``, ``send``, ``history``, ``watch``, ``approve``,
``deny``, ``abort``, ``reset``, ``kill``, and ``chat --server``.

Each command finds the server and the token the same way (``--server``/``--token``, then
``$AGENTLOOP_SERVER``/``$AGENTLOOP_TOKEN``, then the config file) and turns every failure the
server reports into one ``error:`` line with exit code 1. The remote chat is the local chat's
REPL with a different ``Session``: turns go over HTTP and are shown from the event stream, with
the same renderer and the same approval prompt.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Annotated, Any, TypeVar

import typer
from rich.text import Text

from agentloop.cli.approvals import Asker, Denial, Question
from agentloop.cli.chat import Compaction, Rewind, SessionError, TurnOutcome, Waiting, before_last_user
from agentloop.cli.config import Connection, load_connection
from agentloop.cli.options import ServerOpt, TokenOpt
from agentloop.cli.render import (
    SignalRenderer,
    TextRenderer,
    describe_call,
    is_terminal,
    one_line,
    stderr_console,
    terminal_text,
)
from agentloop.client import AgentloopClient, ClientError, StreamEvent
from agentloop.loop.state import Mode
from agentloop.messages import (
    AssistantMessage,
    FileContent,
    MediaBlock,
    ToolResultMessage,
    message_from_dict,
    storable,
)
from agentloop.process import signals as sig
from agentloop.process.signals import Signal
from agentloop.urls import check_server_address, redact_url

T = TypeVar("T")

PidArg = Annotated[str, typer.Argument(metavar="PID", help="The process id ('agentloop ps' lists them).")]


def register(app: typer.Typer) -> None:
    for command in (ps, send, history, watch, approve, deny, abort, reset, kill):
        app.command()(command)


# ---------------------------------------------------------------------------------- plumbing


def connection(server: str | None, token: str | None) -> Connection:
    from agentloop.cli.main import CliError

    conn = load_connection(server=server, token=token)
    for warning in conn.warnings:
        sys.stderr.write(f"warning: {one_line(warning, 1000)}\n")
    try:  # a typo in the address is a bad setting (exit 2), not a server out of reach
        check_server_address(conn.server)
    except ValueError as exc:
        raise CliError(str(exc), 2) from None
    if not conn.token:
        raise CliError(
            'no token: pass --token, set AGENTLOOP_TOKEN, or put token = "…" in the config file '
            "('agentloop token create' makes one)"
        )
    return conn


def call(server: str | None, token: str | None, work: Callable[[AgentloopClient], Awaitable[T]]) -> T:
    """Run ``work`` with a client; a ``ClientError`` becomes a one-line ``CliError``."""

    conn = connection(server, token)

    async def go() -> T:
        async with AgentloopClient(conn.server, conn.token) as client:
            return await work(client)

    try:
        return asyncio.run(go())
    except ClientError as exc:
        raise failure(exc, conn) from None


def failure(exc: ClientError, conn: Connection) -> Exception:
    """The one line a client error becomes; a refused token says where the token came from."""
    from agentloop.cli.main import CliError

    if exc.code == "unauthorized":
        return CliError(f"the server refused the token (from {conn.token_source}): {exc.message}")
    return CliError(exc.message)


def _when(stamp: Any) -> str:
    if not isinstance(stamp, int | float):
        return "-"
    return datetime.datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M:%S")


def _echo_json(data: Any) -> None:
    typer.echo(json.dumps(data, ensure_ascii=False))


# ---------------------------------------------------------------------------------- commands


def ps(
    server: ServerOpt = None,
    token: TokenOpt = None,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per process.")] = False,
) -> None:
    """List your processes."""
    from agentloop.cli.main import _guarded

    with _guarded():
        rows = call(server, token, lambda c: c.processes())
        if json_output:
            for row in rows:
                _echo_json(row)
            return
        typer.echo("pid\tstate\towner\trun\tupdated\tcwd\ttitle")
        for row in sorted(rows, key=lambda r: r.get("updated_at") or 0):
            typer.echo(
                f"{row.get('pid')}\t{row.get('state')}\t{row.get('owner')}\t{row.get('run_id') or '-'}\t"
                f"{_when(row.get('updated_at'))}\t{row.get('cwd')}\t{row.get('title') or '-'}"
            )


def send(
    pid: PidArg,
    text: Annotated[str, typer.Argument(metavar="TEXT", help="The message; '-' reads it from stdin.")],
    mode: Annotated[
        str,
        typer.Option(
            "--mode", help="steer (join the running turn), queue (after it), interrupt (abort it, then this)."
        ),
    ] = "steer",
    expected_run: Annotated[
        str | None,
        typer.Option(
            "--expected-run",
            metavar="RUN_ID",
            help="Only while this run is the process's current one (refused otherwise, nothing sent).",
        ),
    ] = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Send a message to a process; prints the run id it went to."""
    from agentloop.cli.main import CliError, _guarded

    with _guarded():
        if mode not in ("steer", "queue", "interrupt"):
            raise CliError("--mode must be steer, queue or interrupt", 2)  # (a bad flag value: usage)
        if text == "-":
            text = sys.stdin.read()
        # bytes that were not UTF-8 (on stdin or in the argument) are U+FFFD, as ``run -`` and the
        # chat make them: as Python's lone surrogates they failed the request's JSON, with
        # ``error: 'utf-8' codec can't encode characters …: surrogates not allowed``
        text = storable(text)
        if not text.strip():
            raise CliError("empty message")
        receipt = call(server, token, lambda c: c.send(pid, text, mode=mode, expected_run_id=expected_run))
        where = f" (queued, position {receipt.get('position')})" if receipt.get("queued") else ""
        typer.echo(f"{receipt.get('run_id')}{where}")


def history(
    pid: PidArg,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, max=500, help="How many of the newest messages.")] = 20,
    json_output: Annotated[bool, typer.Option("--json", help="Each message as JSON, one per line.")] = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Show a process's latest messages, oldest first."""
    from agentloop.cli.main import _guarded

    with _guarded():
        page = call(server, token, lambda c: c.history(pid, limit=limit))
        terminal = is_terminal(sys.stdout)  # the model's text, shown as the chat shows it (see ``terminal_text``)
        for item in page.get("messages", []):
            if json_output:
                _echo_json(item)
            else:
                for line in message_lines(item.get("message")):
                    typer.echo(terminal_text(line) if terminal else line)


def message_lines(data: Any) -> list[str]:
    """A stored message as plain lines: ``role: text``, one line per tool call or result."""
    try:
        message = message_from_dict(data)
    except Exception:
        return [f"?: {one_line(json.dumps(data, default=str), 300)}"]
    texts = [getattr(b, "text", "") for b in message.content if getattr(b, "type", "") == "text"]
    text = "\n".join(t for t in texts if t)
    lines = [f"{message.role}: {text}"] if text else []
    if isinstance(message, AssistantMessage):
        lines.extend(f"  → {describe_call(c.name, dict(c.arguments))}" for c in message.tool_calls)
        if not lines:
            lines.append("assistant:")
    elif isinstance(message, ToolResultMessage):
        mark = "✗" if message.is_error else "←"
        lines = [f"  {mark} {message.tool_name}: {one_line(text, 300)}"]
    return lines or [f"{message.role}:"]


def watch(
    pid: PidArg,
    after: Annotated[
        int, typer.Option("--after", min=0, help="Start after this signal number (0: the whole log).")
    ] = 0,
    follow: Annotated[bool, typer.Option("--follow/--no-follow", help="Keep following live signals.")] = True,
    until_done: Annotated[
        bool, typer.Option("--until-done", help="Stop after the next finished run (proc.run.finished).")
    ] = False,
    deltas: Annotated[bool, typer.Option("--deltas", help="Also show live progress (deltas, tool output).")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Each signal as JSON, one per line.")] = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Print a process's signals as they come (the log first); reconnects after a dropped connection
    without missing or repeating one."""
    from agentloop.cli.main import _guarded

    def retrying(problem: ClientError, attempt: int) -> None:
        sys.stderr.write(f"(connection lost: {one_line(problem.message, 200)}; reconnecting, attempt {attempt})\n")
        sys.stderr.flush()

    async def work(client: AgentloopClient) -> None:
        stream = client.events(pid, after_seq=after, follow=follow, on_retry=retrying)
        async with aclosing(stream) as events:
            async for event in events:
                if event.signal in (sig.RUN_STREAM, sig.TOOL_UPDATE) and not deltas:
                    continue
                if json_output:
                    _echo_json({"seq": event.seq, "signal": event.signal, "payload": event.payload})
                else:
                    seq = "-" if event.seq is None else str(event.seq)
                    typer.echo(f"{seq}\t{event.signal}\t{json.dumps(event.payload, ensure_ascii=False)}")
                sys.stdout.flush()
                if until_done and event.signal == sig.RUN_FINISHED and event.seq is not None and event.seq > after:
                    return

    with _guarded():
        call(server, token, work)


def _decide(
    pid: str, request: str | None, decision: str, remember: bool, server: str | None, token: str | None
) -> None:
    from agentloop.cli.main import CliError

    if request is None:
        pending = call(server, token, lambda c: c.approvals(pid))
        if not pending:
            raise CliError(f"no approval is pending for {pid}")
        request = str(pending[0]["request_id"]) if len(pending) == 1 else _choose(pending)
    chosen = request
    result = call(server, token, lambda c: c.hil(pid, chosen, decision, remember=remember))
    past = "approved" if decision == "approve" else "denied"
    typer.echo(f"{past} {result.get('request_id', chosen)}" + (" (remembered)" if result.get("remember") else ""))


def _choose(pending: list[dict[str, Any]]) -> str:
    """Several approvals wait: list them; on a terminal ask which one, elsewhere refuse to guess."""
    from agentloop.cli.main import CliError

    err = stderr_console()
    for n, row in enumerate(pending, 1):
        args = row.get("args")
        args = args if isinstance(args, dict) else {}
        err.print(Text(f"{n}. {row.get('request_id')}  {describe_call(str(row.get('tool_name')), args)}"))
    if not sys.stdin.isatty():
        raise CliError("several approvals are pending: name one (approve PID REQ)")
    while True:
        try:
            answer = input(f"which one? [1-{len(pending)}] ").strip()
        except EOFError:
            raise CliError("no approval chosen") from None
        if answer.isdigit() and 1 <= int(answer) <= len(pending):
            return str(pending[int(answer) - 1]["request_id"])
        ids = [str(r.get("request_id")) for r in pending]
        if answer in ids:
            return answer


ReqArg = Annotated[str | None, typer.Argument(metavar="[REQ]", help="The request id (default: the only pending one).")]


def approve(
    pid: PidArg,
    request: ReqArg = None,
    remember: Annotated[
        bool, typer.Option("--remember", help="Also allow such calls for the rest of this process.")
    ] = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Approve a tool call that waits for a person."""
    from agentloop.cli.main import _guarded

    with _guarded():
        _decide(pid, request, "approve", remember, server, token)


def deny(pid: PidArg, request: ReqArg = None, server: ServerOpt = None, token: TokenOpt = None) -> None:
    """Deny a tool call that waits for a person (the model is told the user refused)."""
    from agentloop.cli.main import _guarded

    with _guarded():
        _decide(pid, request, "deny", False, server, token)


def abort(pid: PidArg, server: ServerOpt = None, token: TokenOpt = None) -> None:
    """Stop a process's running turn (the conversation stays valid)."""
    from agentloop.cli.main import _guarded

    with _guarded():
        aborted = call(server, token, lambda c: c.abort(pid))
        typer.echo("aborted" if aborted else "nothing was running")


def reset(pid: PidArg, server: ServerOpt = None, token: TokenOpt = None) -> None:
    """Archive a process's conversation and start it afresh."""
    from agentloop.cli.main import _guarded

    with _guarded():
        result = call(server, token, lambda c: c.reset(pid))
        typer.echo(f"reset {pid}" + (" (history archived)" if result.get("archived") else ""))


def kill(pid: PidArg, server: ServerOpt = None, token: TokenOpt = None) -> None:
    """End a process for good (its history is archived)."""
    from agentloop.cli.main import _guarded

    with _guarded():
        result = call(server, token, lambda c: c.kill(pid))
        typer.echo(f"killed {pid}" + (" (history archived)" if result.get("archived") else ""))


# ---------------------------------------------------------------------------------- remote chat


def _signal(event: StreamEvent) -> Signal:
    return Signal(event.signal, event.payload, event.seq)


def _outcome(payload: dict[str, Any]) -> TurnOutcome:
    status = payload.get("status")
    reason = str(payload.get("reason") or "stop")
    if status == "aborted":
        return TurnOutcome("aborted", reason)
    if status == "error":
        return TurnOutcome("error", reason, str(payload.get("error") or "the model call failed"))
    return TurnOutcome("ok", reason)


def _waiting(item: dict[str, Any]) -> Waiting:
    """A queue item as the server sends it, as ``/queue`` shows it (whatever the server sent)."""
    item_id = item.get("id")
    return Waiting(item_id if isinstance(item_id, int) else 0, str(item.get("kind", "")), str(item.get("text", "")))


def _question(row: dict[str, Any]) -> Question:
    args = row.get("args")
    return Question(
        tool=str(row.get("tool_name") or row.get("syscall") or "tool"),
        args=args if isinstance(args, dict) else {},
        tags=tuple(str(t) for t in row.get("tags") or ()),
        reason=str(row.get("reason") or ""),
        request_id=str(row.get("request_id") or ""),
    )


class RemoteSession:
    """Chat turns on a server's process: open the event stream, send the line, show the signals
    until that run finishes, answering approvals as they come. Like ``DurableSession``, but every
    step is an HTTP call, so the process lives (and keeps running) in the server."""

    def __init__(self, client: AgentloopClient, *, cwd: str | None = None) -> None:
        self.client = client
        self.cwd = cwd
        self.pid = ""
        self.seq = 0  # the last logged signal shown: the next turn follows from here
        self._abort: asyncio.Task[None] | None = None
        # The turn being followed: its run (once known), what its display reads, and Ctrl-C.
        self._run_id: str | None = None
        self._queue: asyncio.Queue[StreamEvent | BaseException | None] | None = None
        self._interrupted = asyncio.Event()
        self._manifest: tuple[str, int, dict[str, Any] | None] = ("", 0, None)  # pid, seq read, newest

    async def open(self, *, new: bool = False, pid: str | None = None) -> int | None:
        """Attach to ``pid``, else to the newest conversation (unless ``new``), else start one;
        returns how many messages a continued conversation has, None for a new one."""
        if pid is None and not new:
            mine = [p for p in await self.client.processes() if p.get("parent_pid") is None]
            if mine:
                pid = str(max(mine, key=lambda p: (p.get("updated_at") or 0, p.get("created_at") or 0))["pid"])
        if pid is None:
            await self.new()
            return None
        await self.client.process(pid)  # 404 for an unknown pid, before anything else
        self.pid = pid
        self.seq = await self._last_seq()
        return len((await self.client.history(pid, limit=500)).get("messages", []))

    async def prompt_manifest(self) -> dict[str, Any] | None:
        """The newest ``proc.prompt.compiled`` in the process's log (``/prompt``), read on from
        where the last look ended: asking again costs only what was logged since."""
        pid = self.pid
        _, seen, found = self._manifest if self._manifest[0] == pid else (pid, 0, None)
        stream = self.client.events(pid, after_seq=seen, follow=False, max_retries=3)
        try:
            async with aclosing(stream) as events:
                async for event in events:
                    if event.seq is not None:
                        seen = event.seq
                    if event.signal == sig.PROMPT_COMPILED:
                        found = event.payload
        except ClientError as exc:
            raise SessionError(f"no prompt manifest: {exc.message}") from exc
        finally:
            self._manifest = (pid, seen, found)  # (what was read stays read)
        return found

    async def _last_seq(self) -> int:
        last = self.seq
        stream = self.client.events(self.pid, after_seq=last, follow=False, max_retries=3)
        async with aclosing(stream) as events:
            async for event in events:
                if event.seq is not None:
                    last = event.seq
        return last

    async def set_mode(self, mode: Mode) -> None:
        try:
            await self.client.mode(self.pid, mode)
        except ClientError as exc:
            raise SessionError(f"the mode was not changed: {exc.message}") from exc

    async def title(self) -> str | None:
        try:
            return await self.client.title(self.pid)
        except ClientError as exc:
            raise SessionError(f"the title was not read: {exc.message}") from exc

    async def set_title(self, text: str) -> str | None:
        try:
            return await self.client.set_title(self.pid, text)
        except ClientError as exc:
            raise SessionError(f"the title was not set: {exc.message}") from exc

    async def model(self) -> dict[str, Any]:
        """``/model``: the process's own choice, the model its next run uses and where that comes from."""
        try:
            return await self.client.model(self.pid)
        except ClientError as exc:
            raise SessionError(f"the model was not read: {exc.message}") from exc

    async def set_model(self, spec: str | None) -> dict[str, Any]:
        """Its own model (keeping its own reasoning level), or none at all (``None``), from the next
        answer on."""
        try:
            level = (await self.client.model(self.pid)).get("reasoning") if spec is not None else None
            return await self.client.set_model(self.pid, spec, reasoning=level)
        except ClientError as exc:
            raise SessionError(f"the model was not changed: {exc.message}") from exc

    async def queued(self) -> list[Waiting]:
        try:
            return [_waiting(item) for item in await self.client.queue(self.pid)]
        except ClientError as exc:
            raise SessionError(f"the queue was not read: {exc.message}") from exc

    async def clear_queue(self) -> list[Waiting]:
        try:
            return [_waiting(item) for item in await self.client.withdraw(self.pid)]
        except ClientError as exc:
            raise SessionError(f"nothing was withdrawn: {exc.message}") from exc

    async def compact(self, instructions: str | None, keep_last: int | None = None) -> Compaction:
        try:
            done = await self.client.compact(self.pid, instructions, keep_last=keep_last)
        except ClientError as exc:
            raise SessionError(f"not compacted: {exc.message}") from exc

        def count(key: str) -> int:  # (whatever the server sent)
            value = done.get(key)
            return value if isinstance(value, int) else 0

        compacted, note = done.get("compacted") is True, str(done.get("note") or "not compacted")
        return Compaction(compacted, count("removed"), count("tokens_before"), count("tokens_after"), note)

    async def usage(self) -> dict[str, Any]:
        return await self._process_field("usage", "the usage", "keeps no usage totals")

    async def context(self) -> dict[str, Any]:
        return await self._process_field("context_pressure", "the context", "does not measure the context")

    async def _process_field(self, key: str, what: str, lacking: str) -> dict[str, Any]:
        """One object of the process's description; a server older than this client lacks it."""
        try:
            found = (await self.client.process(self.pid)).get(key)
        except ClientError as exc:
            raise SessionError(f"{what} was not read: {exc.message}") from exc
        if not isinstance(found, dict):
            raise SessionError(f"this server {lacking} (it is older than this client)")
        return found

    async def fork(self, before: int | None) -> int:
        """``/fork``: go on in a fork of the server's process (``POST …/fork``), of the whole
        conversation or of what came before the user's message number ``before``; how many
        messages the fork holds."""
        try:
            at = None
            if before is not None:
                history = await self._history()
                mine = [i for i, m in enumerate(history) if (m.get("message") or {}).get("role") == "user"]
                if before > len(mine):
                    raise SessionError(f"not forked: this conversation has {len(mine)} messages of yours")
                if mine[before - 1] == 0:
                    raise SessionError("not forked: nothing comes before your first message (/new starts afresh)")
                at = history[mine[before - 1] - 1]["id"]
            fork = await self.client.fork(self.pid, at=at)
        except ClientError as exc:
            raise SessionError(f"not forked: {exc.message}") from exc
        self.pid = str(fork["pid"])
        self.seq = await self._last_seq()
        return len(await self._history())

    async def rewind(self, at: int | None) -> Rewind:
        """``/rewind``: cut the server's process back in place (``POST …/rewind``) to message id
        ``at``, or to before the user's last message."""
        try:
            if at is None:
                history = await self._history()
                at = before_last_user([(m["id"], str((m.get("message") or {}).get("role"))) for m in history])
            done = await self.client.rewind(self.pid, at)
        except ClientError as exc:
            raise SessionError(f"not rewound: {exc.message}") from exc
        kept, removed = done.get("kept"), done.get("removed")  # (whatever the server sent)
        return Rewind(kept if isinstance(kept, int) else 0, removed if isinstance(removed, int) else 0)

    async def _history(self) -> list[dict[str, Any]]:
        """The whole history of the process, oldest first (read page by page)."""
        messages: list[dict[str, Any]] = []
        before = None
        while True:
            page = await self.client.history(self.pid, limit=500, before=before)
            messages[:0] = page.get("messages", [])
            before = page.get("next_before")
            if before is None:
                return messages

    async def new(self) -> None:
        try:
            proc = await self.client.spawn(interactive=True, cwd=self.cwd)
        except ClientError as exc:
            raise SessionError(f"no new conversation: {exc.message}") from exc
        self.pid = str(proc["pid"])
        self.seq = 0

    def abort(self) -> None:
        """Ctrl-C, or "abort" at an approval: stop the run being followed, and only that one.
        Before its line has been sent there is nothing to stop on the server: the line is not sent."""
        self._interrupted.set()
        if self._run_id is not None and (self._abort is None or self._abort.done()):
            self._abort = asyncio.get_running_loop().create_task(self._request_abort(self._run_id, self._queue))

    async def _request_abort(
        self, run_id: str, queue: asyncio.Queue[StreamEvent | BaseException | None] | None
    ) -> None:
        """The abort call. When it fails (most often: the server is gone) the turn cannot end the
        usual way, with the run's last signal, so it ends here, saying why; without this the chat
        kept waiting for a stream that would not come back, and only a second Ctrl-C (which
        exits the chat) gave the user back control."""
        try:
            await self.client.abort(self.pid, run_id)
        except ClientError as exc:
            if queue is not None:
                queue.put_nowait(ClientError(exc.status, exc.code, f"could not abort the run: {exc.message}"))

    async def unfinished(self) -> bool:
        return (await self.client.process(self.pid)).get("run_id") is not None

    async def resume(self, view: TextRenderer, ask: Asker) -> TurnOutcome:
        try:
            run = (await self.client.process(self.pid)).get("run_id")
            if run is None:
                return TurnOutcome("ok")
            return await self._follow(view, ask, run_id=str(run))
        except ClientError as exc:
            return TurnOutcome("error", "error", exc.message)

    async def turn(self, text: str, view: TextRenderer, ask: Asker, media: Sequence[MediaBlock] = ()) -> TurnOutcome:
        try:
            if await self.unfinished():  # never start a turn behind one the user cannot see
                await self.resume(view, ask)
            return await self._follow(view, ask, text=text, media=media)
        except ClientError as exc:
            return TurnOutcome("error", "error", exc.message)

    async def retry(self, view: TextRenderer, ask: Asker) -> TurnOutcome:
        """``/retry``: run the model again where the last turn ended without an answer
        (``POST …/retry``), then follow that run as a turn. A refusal (nothing to retry, a run
        under way) is a ``SessionError``: no turn was run."""
        try:
            if await self.unfinished():  # a turn under way is followed, not retried
                return await self.resume(view, ask)
            return await self._follow(view, ask, retry=True)
        except ClientError as exc:
            if exc.code in ("nothing_to_retry", "busy"):
                raise SessionError(f"not retried: {exc.message}") from exc
            return TurnOutcome("error", "error", exc.message)

    async def _follow(
        self,
        view: TextRenderer,
        ask: Asker,
        *,
        text: str | None = None,
        media: Sequence[MediaBlock] = (),
        run_id: str | None = None,
        retry: bool = False,
    ) -> TurnOutcome:
        """Watch first, then send (or ask for a ``retry``): text deltas are live-only, so a stream
        opened after the run started could miss the start of the answer."""
        queue: asyncio.Queue[StreamEvent | BaseException | None] = asyncio.Queue()
        connected = asyncio.Event()

        def retrying(problem: ClientError, attempt: int) -> None:
            if attempt == 1:  # the spinner alone would not say why nothing moves
                view.note(Text(f"(connection lost: {one_line(problem.message, 200)}; reconnecting)", style="yellow"))

        async def pump() -> None:
            stream = self.client.events(
                self.pid, after_seq=self.seq, connected=connected, max_retries=20, on_retry=retrying
            )
            try:
                async with aclosing(stream) as events:
                    async for event in events:
                        queue.put_nowait(event)
                queue.put_nowait(None)
            except ClientError as exc:
                queue.put_nowait(exc)

        self._queue, self._run_id = queue, run_id
        self._interrupted.clear()
        task = asyncio.get_running_loop().create_task(pump())
        try:
            waiters = {asyncio.ensure_future(connected.wait()), asyncio.ensure_future(self._interrupted.wait())}
            await asyncio.wait({*waiters, task}, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()
            if text is not None or retry:
                if self._interrupted.is_set():  # Ctrl-C while the stream was still being opened
                    return TurnOutcome("aborted", "aborted")
                if text is None:  # (a retry: no new input)
                    receipt = await self.client.retry(self.pid)
                else:
                    items = [_media_item(b) for b in media]
                    receipt = await self.client.send(self.pid, text, media=items or None)
                run_id = self._run_id = str(receipt["run_id"])
                if self._interrupted.is_set():  # Ctrl-C while the line was on its way
                    self.abort()
            return await self._show(queue, view, ask, str(run_id))
        finally:
            self._queue = self._run_id = None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _show(
        self,
        queue: asyncio.Queue[StreamEvent | BaseException | None],
        view: TextRenderer,
        ask: Asker,
        run_id: str,
    ) -> TurnOutcome:
        render = SignalRenderer(view)
        answered: set[str] = set()
        for row in await self.client.approvals(self.pid):  # asked before this client was watching
            if row.get("run_id") == run_id:
                await self._answer(_question(row), view, ask, answered)
        while True:
            item = await queue.get()
            if item is None:
                return TurnOutcome("error", "error", "the server ended the event stream")
            if isinstance(item, BaseException):
                raise item
            if item.seq is not None:
                self.seq = item.seq
            payload = item.payload
            if item.signal == sig.TOOL_FINISHED and not view.knows(str(payload.get("callId"))):
                await self._learn_call(str(payload.get("callId")), view)
            render.handle(_signal(item))
            if item.signal == sig.HIL_REQUESTED and (payload.get("runId") == run_id or "subagent" in payload):
                await self._answer(Question.from_payload(payload), view, ask, answered)
            if item.signal == sig.RUN_FINISHED and payload.get("runId") == run_id:
                return _outcome(payload)

    async def _learn_call(self, call_id: str, view: TextRenderer) -> None:
        """A refused call never started, so no signal showed its arguments: the message that made
        the call has them."""
        page = await self.client.history(self.pid, limit=20)
        for item in reversed(page.get("messages", [])):
            try:
                message = message_from_dict(item.get("message"))
            except Exception:
                continue
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
        answer = await ask(question)
        if answer == "abort":
            self.abort()
            return
        decision = "approve" if answer in ("approve", "always") else "deny"
        reason = answer.reason if isinstance(answer, Denial) else None
        try:
            await self.client.hil(self.pid, question.request_id, decision, remember=answer == "always", message=reason)
        except ClientError as exc:
            if exc.code != "not_found":  # not_found: answered elsewhere, or the run ended meanwhile
                raise
            return
        view.waiting()


def remote_chat(
    url: str, token: str, *, new: bool = False, pid: str | None = None, cwd: str | None = None
) -> tuple[bool, int]:
    """The chat REPL against a server; returns (a turn was aborted, exit code)."""
    from agentloop.cli.chat import HELP, ChatRepl

    err = stderr_console()
    ev = asyncio.new_event_loop()
    client = AgentloopClient(url, token)
    try:
        session = RemoteSession(client, cwd=cwd)
        count = ev.run_until_complete(session.open(new=new, pid=pid))
        me = ev.run_until_complete(client.me())
        err.print(Text(f"agentloop chat · {redact_url(url)} · {me.get('account')}", style="bold"))
        err.print(Text(HELP, style="dim"))
        if count is None:
            err.print(Text(f"new conversation {session.pid}", style="dim"))
        else:
            err.print(
                Text(f"continuing conversation {session.pid} ({count} messages) · --new starts afresh", style="dim")
            )
        repl = ChatRepl(session, err=err)
        if ev.run_until_complete(session.unfinished()):
            err.print(Text("(the last answer was unfinished; it goes on)", style="dim"))
            ev.run_until_complete(repl.resume())
        code = repl.loop(ev)
        return repl.aborted, code
    finally:
        try:
            ev.run_until_complete(client.aclose())
            ev.run_until_complete(ev.shutdown_asyncgens())
        finally:
            ev.close()


def chat_command(server: str | None, token: str | None, *, new: bool, pid: str | None) -> tuple[bool, int]:
    """``agentloop chat --server URL``: resolve the connection, then ``remote_chat``."""
    conn = connection(server, token)
    try:
        return remote_chat(conn.server, str(conn.token), new=new, pid=pid)
    except ClientError as exc:
        raise failure(exc, conn) from None


__all__ = ["RemoteSession", "chat_command", "register", "remote_chat"]


def _media_item(block: MediaBlock) -> dict[str, str]:
    """An attachment as ``POST …/messages`` takes it."""
    item = {"data": block.data, "mime_type": block.mime_type}
    if isinstance(block, FileContent):
        item["name"] = block.name
    return item
