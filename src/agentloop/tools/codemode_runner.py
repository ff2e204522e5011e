"""The child side of CodeMode: runs one program, turning its tool functions into requests.

Started by :mod:`agentloop.tools.codemode` as ``python -I -u codemode_runner.py REQ_FD RESP_FD``
(isolated mode: no ``PYTHONPATH``, no user site, so this file imports nothing but the standard
library). The setup — the program's source, the functions to define and the longest line either
side may send (``max_line``) — arrives as one JSON document on stdin, which is then at end of
file. Each call of a function writes one JSON line ``{"id", "tool", "args"}`` to ``REQ_FD`` and
waits for ``{"id", "ok", "result" | "error"}`` on ``RESP_FD``. A call whose arguments would make
a longer line fails in the program without being sent: the parent could not read it, and the
call would wait for an answer that never comes. The program's own stdout and stderr are other
pipes, so nothing it prints can be read as a request; and even a request the program writes to
``REQ_FD`` itself is only a request: the parent approves every one exactly as it approves the
functions' own.

Exit status: 0 when the program finished, 1 when it raised (the traceback, cut to the program's
own frames, is on stderr), 2 when it could not be compiled; a program that calls ``sys.exit`` ends
with the status it asked for, wherever it called it (a task too), and no traceback: an exit is
not a failure of the program. ``sys.exit("message")`` ends with status 1 and the message sent to
the parent as the line ``{"exit": 1, "message": ...}``, so it is shown as the exit it was.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import inspect
import json
import linecache
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

PROGRAM = "<program>"
LINE_LIMIT = 1 << 27  # the longest line of the channel, either way: one line may carry a whole file


class ToolFailed(Exception):
    """A tool the program called failed; the message is what the tool said."""

    def __init__(self, message: str, tool: str = "") -> None:
        super().__init__(message)
        self.tool = tool


class ToolDenied(ToolFailed):
    """A call the approval policy refused (or that needs a person's approval); it did not run."""


class _Channel:
    """The two pipes to the parent, with one future per call in flight."""

    def __init__(self, req_fd: int, resp_fd: int, max_line: int) -> None:
        self.req_fd = req_fd
        self.resp_fd = resp_fd
        self.max_line = max_line
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.next_id = 0
        self.closed = False

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=self.max_line)
        pipe = os.fdopen(self.resp_fd, "rb", 0)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        self._pump_task = asyncio.create_task(self._pump(reader))

    async def _pump(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                msg = json.loads(line)
                future = self.pending.pop(msg.get("id"), None)
                if future is not None and not future.done():
                    future.set_result(msg)
        finally:
            self.closed = True
            for future in self.pending.values():
                if not future.done():
                    future.set_exception(ToolFailed("the CodeMode host closed the channel"))
            self.pending.clear()

    async def call(self, function: str, tool: str, args: dict[str, Any]) -> Any:
        if self.closed:
            raise ToolFailed("the CodeMode host closed the channel", function)
        try:
            line = json.dumps({"id": self.next_id + 1, "tool": tool, "args": args}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            kinds = "str, int, float, bool, None, list, dict"
            raise TypeError(f"{function}(): arguments must be JSON values ({kinds}): {exc}") from None
        data = line.encode()
        if len(data) > self.max_line:
            raise ToolFailed(
                f"{function}(): the arguments are too large to send ({len(data)} bytes, at most "
                f"{self.max_line}): pass less at once",
                function,
            )
        self.next_id += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = future
        _write_all(self.req_fd, data + b"\n")
        msg = await future
        if msg.get("ok"):
            return msg.get("result")
        error = str(msg.get("error") or "failed")
        raise (ToolDenied if msg.get("denied") else ToolFailed)(error, function)


def _function(channel: _Channel, spec: dict[str, Any]) -> Callable[..., Awaitable[Any]]:
    """One async function that calls ``spec["tool"]``; positional arguments fill ``params`` in
    order, and an argument left at ``None`` is left out so the tool's own default applies."""
    name: str = spec["name"]
    tool: str = spec["tool"]
    params: list[str] = list(spec["params"])
    required = set(spec.get("required") or ())

    async def call_tool(*args: Any, **kwargs: Any) -> Any:
        if len(args) > len(params):
            raise TypeError(f"{name}() takes at most {len(params)} positional arguments ({len(args)} given)")
        given = dict(zip(params, args, strict=False))
        for key, value in kwargs.items():
            if key in given:
                raise TypeError(f"{name}() got multiple values for argument {key!r}")
            given[key] = value
        return await channel.call(name, tool, {k: v for k, v in given.items() if v is not None or k in required})

    call_tool.__name__ = call_tool.__qualname__ = name
    return call_tool


def _trim(exc: traceback.TracebackException) -> None:
    """Keep only the program's own frames (this runner's and the event loop's are noise)."""
    exc.stack = traceback.StackSummary.from_list([f for f in exc.stack if f.filename == PROGRAM])
    for linked in (exc.__cause__, exc.__context__):
        if linked is not None:
            _trim(linked)


def _report(exc: BaseException) -> None:
    summary = traceback.TracebackException.from_exception(exc)
    _trim(summary)
    sys.stderr.write("".join(summary.format()))


def _exit_status(exc: SystemExit, req_fd: int) -> int:
    """The status the program asked for with ``sys.exit``. A message (``sys.exit("why")``) means
    status 1, as in any Python program; it goes to the parent, which shows it with the exit."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    line = json.dumps({"exit": 1, "message": str(exc.code)}) + "\n"
    with contextlib.suppress(OSError):  # the parent is gone: nobody is left to show it to
        _write_all(req_fd, line.encode())
    return 1


def _write_all(fd: int, data: bytes) -> None:
    while data:  # small and rare: a blocking write is simpler than a transport
        written = os.write(fd, data)
        data = data[written:]


def _quiet_exits(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler: a task that called ``sys.exit`` is the program's exit
    (reported as such), not a "Task exception was never retrieved" with the event loop's frames."""
    if isinstance(context.get("exception"), SystemExit):
        return
    loop.default_exception_handler(context)


async def _run(setup: dict[str, Any], req_fd: int, resp_fd: int) -> int:
    source: str = setup["code"]
    linecache.cache[PROGRAM] = (len(source), None, source.splitlines(keepends=True), PROGRAM)
    try:
        code = compile(source, PROGRAM, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        return 2
    asyncio.get_running_loop().set_exception_handler(_quiet_exits)
    channel = _Channel(req_fd, resp_fd, int(setup.get("max_line") or LINE_LIMIT))
    await channel.start()
    namespace: dict[str, Any] = {
        "__name__": "__main__",
        "__builtins__": builtins,
        "asyncio": asyncio,
        "json": json,
        "ToolFailed": ToolFailed,
        "ToolDenied": ToolDenied,
    }
    for spec in setup["functions"]:
        namespace[spec["name"]] = _function(channel, spec)
    try:
        result = eval(code, namespace)  # running the program is the point
        if inspect.isawaitable(result):
            await result
    except SystemExit as exc:
        return _exit_status(exc, req_fd)
    except asyncio.CancelledError:
        # Raised here by the shutdown that follows a task's sys.exit (asyncio lets SystemExit out
        # of the loop and then cancels the program): ``main`` tells that from a program that
        # cancelled itself.
        raise
    except BaseException as exc:  # KeyboardInterrupt and the like too: the program is what failed
        _report(exc)
        return 1
    return 0


def main() -> int:
    req_fd, resp_fd = int(sys.argv[1]), int(sys.argv[2])
    for fd in (req_fd, resp_fd):  # whatever the program starts must not hold the channel open
        os.set_inheritable(fd, False)
    setup = json.loads(sys.stdin.buffer.read())  # stdin stays at end of file: input() raises EOFError
    try:
        return asyncio.run(_run(setup, req_fd, resp_fd))
    except SystemExit as exc:  # a task of the program called sys.exit
        return _exit_status(exc, req_fd)
    except asyncio.CancelledError as exc:  # the program cancelled itself
        _report(exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
