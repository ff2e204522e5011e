"""CodeMode (syscall ``codemode.exec``): a short Python program that calls tools in a loop.

A model that must read forty files, or grep and then filter, would otherwise spend a model round
trip per call. CodeMode runs one program in a subprocess in which the tools it was given are
``async`` functions (``await read("a.py")``, ``await shell("ls")``, ``await mcp_gh_search(q=…)``);
what the program prints is the tool result.

Every function call is a request to this process, which runs the *real* tool (the run's tool of
that name, so a durable process's per-cwd tools and device routing apply) only after the same
check a direct call gets: the runner's approval (``ToolContext.check``: the before-tool-call hooks
in memory, the process's policy and the hooks in a durable run), judged on the nested call's own
syscall and arguments. A refused call does not run and raises ``ToolDenied`` in the program.
A call the policy would *ask* a person about is asked while the program waits in that call: in
memory by the terminal prompt (a hook), in a durable run by a ``pending_hil`` request answered
like a direct call's (``process/hil.py``). The wait is bounded by the program's timeout, and a
program does not survive a restart: its call is then resolved as interrupted and its question
withdrawn. Only a check that cannot ask at all says ``ask``; such a call is refused with a
message telling the model to make it directly.

Every nested call also counts toward the run's tool-call budget (``ToolContext.budget``, the
``max_tool_calls`` guard): a program is not a way around it.

What this does **not** confine: the program itself is ordinary Python running as the server's
user. It can open files, start processes and use the network without asking anyone; only what it
does through the tool functions is confined (file tools keep their root) and approved. CodeMode is
therefore exactly as powerful as an unclassified shell command, and the default policy asks a
person before each ``codemode.exec`` call, showing the program. The subprocess gets a minimal
environment (no API keys from this process's environment), which keeps secrets out of casual
reach but is no sandbox. ``sandbox`` (the ``shell_sandbox`` setting: ``workspace``,
``workspace-offline``, ``private``, ``private-offline``) confines the program as it does Shell's
commands (``tools/sandbox.py``): it may then write only beneath its working directory and its
private ``$TMPDIR`` (and, offline, open no TCP connection; private, read only there, in the
system and in the directories ``sandbox_read`` names); it is not run where that cannot be had.

The subprocess runs in its own process group; a timeout, the runtime's per-tool timeout and an
abort kill the group, so whatever the program started dies with it (as for Shell) - unless it
left the group on purpose (``setsid``, a daemon): a process group is a leash, not a cage.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import keyword
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentloop.messages import FileContent, ImageContent, TextContent
from agentloop.tools import sandbox as sandboxing
from agentloop.tools.base import (
    ALLOW,
    NestedCheck,
    NestedVerdict,
    Tool,
    ToolArgumentsError,
    ToolContext,
    ToolError,
    ToolResult,
    format_validation_error,
    not_offered,
)
from agentloop.tools.builtin import SYSCALLS, syscall_of
from agentloop.tools.codemode_runner import LINE_LIMIT, PROGRAM
from agentloop.tools.process_group import (
    DRAIN_GRACE,
    KILL_GRACE,
    OutputCapture,
    close_transport,
    kill_group,
    marked,
    pump,
    spawn,
    supervise,
)
from agentloop.tools.shell import confined_argv, private_tmp, refuse_unconfined, sandbox_root

log = logging.getLogger("agentloop.codemode")

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_CALLS",
    "MAX_OUTPUT_CHARS",
    "MAX_TIMEOUT",
    "SYSCALL",
    "CodeMode",
    "describe",
    "function_name",
]

SYSCALL = "codemode.exec"
DEFAULT_TIMEOUT = 60.0
MAX_TIMEOUT = 600.0
MAX_OUTPUT_CHARS = 30_000
MAX_CALLS = 200
MAX_PARALLEL = 8  # nested calls in flight at once
MAX_EXIT_MESSAGE = 2_000  # characters of a sys.exit("message") shown with the exit
RUNNER = Path(__file__).with_name("codemode_runner.py")
_LINE_LIMIT = LINE_LIMIT  # told to the runner in the setup, so both sides keep the same one
#: what the program's environment keeps of ours: enough to run programs, no credentials
_ENV_KEEP = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "TERM")

#: a nested call a check said ``ask`` about without asking (it could not, from where it runs)
NEEDS_APPROVAL = "needs a person's approval, which cannot be asked from inside CodeMode; call the tool directly"


def _identifier(text: str) -> str:
    name = re.sub(r"\W", "_", text).strip("_").lower() or "tool"
    if name[0].isdigit():
        name = "t_" + name
    return name + "_" if keyword.iskeyword(name) else name


def function_name(tool: Tool) -> str:
    """The program's name for ``tool``: ``read`` for Read, ``mcp_<server>_<tool>`` for an MCP
    server's tool, otherwise the tool's name made a Python identifier."""
    syscall = tool.syscall or ""
    parts = syscall.split(".", 2)
    if len(parts) == 3 and parts[0] == "mcp":
        return _identifier(f"mcp_{parts[1]}_{parts[2]}")
    return _identifier(tool.name)


@dataclass(frozen=True)
class Function:
    """One tool as the program sees it."""

    name: str
    tool: str
    params: tuple[str, ...]  # positional order: required first, then optional, as in the schema
    required: tuple[str, ...]
    signature: str
    summary: str

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "tool": self.tool, "params": list(self.params), "required": list(self.required)}


def _default_text(schema: Any) -> str:
    if isinstance(schema, dict) and "default" in schema:
        try:
            text = json.dumps(schema["default"])
        except (TypeError, ValueError):
            return "None"
        return {"null": "None", "true": "True", "false": "False"}.get(text, text) if len(text) <= 30 else "None"
    return "None"


def describe(tool: Tool) -> Function:
    """The function for ``tool``, with a signature read from its JSON schema."""
    name = function_name(tool)
    props = tool.parameters.get("properties") or {}
    required = [p for p in tool.parameters.get("required") or () if p in props]
    usable = [p for p in props if p.isidentifier() and not keyword.iskeyword(p)]
    params = [p for p in required if p in usable] + [p for p in usable if p not in required]
    shown = [p if p in required else f"{p}={_default_text(props[p])}" for p in params]
    open_ended = not props and tool.parameters.get("additionalProperties", True) is not False
    if len(usable) < len(props) or open_ended:  # names Python cannot spell, or no schema at all
        shown.append("**args")
    summary = (tool.description or "").strip().split("\n")[0]
    if len(summary) > 160:
        summary = summary[:157] + "..."
    signature = f"await {name}({', '.join(shown)})"
    if tool.output_schema is not None:
        signature += f" -> {_cut(_shape(unwrapped_schema(tool.output_schema)), 240)}"
    return Function(name, tool.name, tuple(params), tuple(required), signature, summary)


_SCALARS = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "null": "None"}


def unwrapped_schema(schema: dict[str, Any]) -> Any:
    """The schema of what the function returns: MCP servers wrap a value that is not an object as
    ``{"result": value}``, which the program gets unwrapped."""
    props = schema.get("properties")
    if schema.get("type") == "object" and isinstance(props, dict) and list(props) == ["result"]:
        return props["result"]
    return schema


def _shape(schema: Any, depth: int = 0) -> str:
    """A JSON schema as a short Python-like type: ``{"city": str, "days": list[float]}``."""
    if not isinstance(schema, dict):
        return "Any"
    if "enum" in schema and isinstance(schema["enum"], list):
        return " | ".join(json.dumps(v) for v in schema["enum"][:6])
    options = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(options, list):
        return " | ".join(_shape(o, depth) for o in options[:4])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_shape({**schema, "type": k}, depth) for k in kind[:4])
    if kind == "array":
        return f"list[{_shape(schema.get('items'), depth + 1)}]"
    if kind == "object" or "properties" in schema:
        props = schema.get("properties")
        if not isinstance(props, dict) or not props or depth >= 2:
            return "dict"
        fields = [f"{json.dumps(k)}: {_shape(v, depth + 1)}" for k, v in list(props.items())[:12]]
        return "{" + ", ".join(fields) + "}"
    return _SCALARS.get(kind, "Any") if isinstance(kind, str) else "Any"


_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "description": "The Python program. Top-level `await` works."},
        "timeout": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": MAX_TIMEOUT,
            "description": f"Seconds before the program is killed (default {DEFAULT_TIMEOUT:g}, max {MAX_TIMEOUT:g}).",
        },
    },
    "required": ["code"],
    "additionalProperties": False,
}


def _description(functions: Iterable[Function], max_output: int, max_calls: int) -> str:
    lines = [
        "Run a short Python 3 program (top-level `await` works; asyncio and json are imported) to make many tool "
        "calls in one step: loop over files, filter, aggregate, and print only what matters. What the program "
        f"print()s is the result (cut in the middle past {max_output} characters); if it raises, the traceback "
        "is added.",
        "",
        "Tool functions (async: always `await` them; asyncio.gather runs several at once; an argument left at "
        "None takes the tool's default):",
    ]
    lines += [f"- {f.signature}: {f.summary}" if f.summary else f"- {f.signature}" for f in functions]
    lines += [
        "",
        "Each returns the text the tool would show you (Read's lines are numbered), or, where it says `-> type`, "
        "the tool's structured output as that Python value (a dict, a list, a number …). A failed call raises "
        "ToolFailed(message); one the approval policy refused raises ToolDenied (a ToolFailed) and did not run. "
        "Catch them to go on. Every call is approved exactly like a direct tool call; a call that needs a "
        "person's approval waits for their answer (within the program's timeout: give it time) or, where "
        "nobody can be asked, is refused.",
        "",
        "Use the tool functions for files and commands. The program runs as the server's user: what it does "
        "directly in Python (open(), subprocess, sockets) is neither confined to the workspace nor approved, so "
        f"do not go around the tools. Limits: the timeout, and {max_calls} tool calls per program; every call "
        "also counts toward the run's tool call budget, if it has one (past it a call raises ToolFailed).",
    ]
    return "\n".join(lines)


def _text_of(result: ToolResult) -> str:
    parts: list[str] = []
    for block in result.content:
        if isinstance(block, TextContent):
            parts.append(block.text)
        elif isinstance(block, ImageContent | FileContent):
            parts.append(f"[{block.type}: {block.mime_type}, not available inside CodeMode]")
    return "\n".join(parts)


def _own_files() -> list[str]:
    """What the program's interpreter reads to start, beyond what a private sandbox lets be read
    (the system, the base interpreter's files): the runner (in this package, which may lie in a
    project or a home) and a virtual environment's ``pyvenv.cfg`` (``site`` stops without it)."""
    files = [os.path.realpath(RUNNER)]
    venv = Path(sys.prefix, "pyvenv.cfg")
    if sys.prefix != sys.base_prefix and venv.is_file():
        files.append(os.path.realpath(venv))
    return files


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k in _ENV_KEEP or k.startswith("LC_")}


class CodeMode(Tool):
    """The CodeMode tool over ``tools`` (see the module docstring).

    ``check`` is an extra approval for nested calls, applied after the runner's own (a program
    run outside any runner has only this one; with neither, every nested call is allowed, as a
    direct call would be). ``cwd`` is where the program starts (default: the run's workspace).
    """

    def __init__(
        self,
        tools: Iterable[Tool],
        *,
        check: NestedCheck | None = None,
        cwd: str | Path | None = None,
        max_output: int = MAX_OUTPUT_CHARS,
        max_calls: int = MAX_CALLS,
        name: str = "CodeMode",
        sandbox: str = "off",
        sandbox_read: Iterable[str | Path] = (),
    ) -> None:
        self.sandbox = sandboxing.check_mode(sandbox)
        self.sandbox_read = tuple(str(p) for p in sandbox_read)  # (a private mode's extra read-only directories)
        own: dict[str, Tool] = {}
        functions: dict[str, Function] = {}
        for tool in tools:
            if isinstance(tool, CodeMode) or syscall_of(tool) == SYSCALL:
                continue  # a program that starts programs would escape the call limit
            function = describe(tool)
            if function.name in functions:
                raise ValueError(
                    f"CodeMode: tools {functions[function.name].tool} and {tool.name} "
                    f"would both be the function {function.name}()"
                )
            functions[function.name] = function
            own[tool.name] = tool
        self.functions = functions
        self.own_tools = own
        self.check = check
        self.cwd = Path(cwd) if cwd is not None else None
        self.max_output = max_output
        self.max_calls = max_calls
        # The program's own ``timeout`` argument (at most MAX_TIMEOUT) bounds a call and keeps the
        # output printed so far; the runtime's per-tool limit (default 60 s) would cut a longer
        # one and lose it. So the runtime waits a little longer than the longest allowed program.
        runtime_limit = MAX_TIMEOUT + 2 * KILL_GRACE + 5
        description = _description(functions.values(), max_output, max_calls)
        if sandbox != "off":
            description += (
                "\nThe program itself runs in a sandbox: it can write files only inside the working directory and "
                "$TMPDIR" + (" and cannot open TCP connections." if sandboxing.is_offline(sandbox) else ".")
            )
        super().__init__(name, description, _SCHEMA, timeout=runtime_limit)
        self.syscall = SYSCALL

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        problems: list[tuple[str, str]] = []
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            problems.append(("code", "must be a non-empty string (the program)"))
        timeout = arguments.get("timeout")
        if isinstance(timeout, str):
            with contextlib.suppress(ValueError):
                timeout = float(timeout)
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= MAX_TIMEOUT
        ):
            problems.append(("timeout", f"must be a number of seconds, above 0 and at most {MAX_TIMEOUT:g}"))
        extra = sorted(set(arguments) - {"code", "timeout"})
        if extra:
            problems.append(("root", f"unknown argument(s): {', '.join(extra)}"))
        if problems:
            raise ToolArgumentsError(format_validation_error(self.name, problems, arguments))
        out: dict[str, Any] = {"code": code}
        if timeout is not None:
            out["timeout"] = float(timeout)
        return out

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        limit = float(arguments.get("timeout") or DEFAULT_TIMEOUT)
        return await _Execution(self, ctx).run(arguments["code"], limit)


class _Execution:
    """One program: the subprocess, its channel, and the nested calls it made."""

    def __init__(self, mode: CodeMode, ctx: ToolContext) -> None:
        self.mode = mode
        self.ctx = ctx
        self.calls = 0
        self.handlers: set[asyncio.Task[None]] = set()
        self.parallel = asyncio.Semaphore(MAX_PARALLEL)
        self.responses: asyncio.WriteTransport | None = None
        self.exit_message: str | None = None  # what the program passed to sys.exit, if a text

    async def run(self, code: str, limit: float) -> ToolResult:
        refusal = _compile_error(code)
        if refusal is not None:  # here, not in the runner: its exit code is the program's own to choose
            return ToolResult.text(f"{refusal}\n[the program could not be compiled; nothing ran]", is_error=True)
        refuse_unconfined(self.mode.sandbox, "program")  # (a sandbox asked for and not to be had)
        with private_tmp(self.mode.sandbox) as tmp:
            return await self._run(code, limit, tmp)

    async def _run(self, code: str, limit: float, tmp: str | None) -> ToolResult:
        functions = [f.spec() for f in self.mode.functions.values()]
        setup = json.dumps({"code": code, "functions": functions, "max_line": _LINE_LIMIT})
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        cwd = self.mode.cwd or self.ctx.workspace or Path.cwd()
        argv = [
            sys.executable,
            "-I",  # (which ignores every PYTHON* variable: UTF-8 is asked for with -X)
            "-X",
            "utf8",  # the program's text is UTF-8 whatever the server's locale, as its results are read
            "-u",
            str(RUNNER),
            str(req_w),
            str(resp_r),
        ]
        environment = _environment()
        if tmp is not None:  # (the wrapper confines itself, then execs the runner: the channel's fds stay open)
            environment.update(TMPDIR=tmp, TMP=tmp, TEMP=tmp)
            readable = [*_own_files(), *self.mode.sandbox_read]
            argv = confined_argv(self.mode.sandbox, [sandbox_root(cwd), tmp], argv, "program", readable=readable)
        env, mark = marked(environment)
        try:
            proc = await spawn(  # (a cancel while it starts stops its group too)
                mark,
                *argv,
                cwd=cwd,
                env=env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                pass_fds=(req_w, resp_r),
                start_new_session=True,
            )
        except BaseException:
            for fd in (req_r, resp_w):
                os.close(fd)
            raise
        finally:
            os.close(req_w)
            os.close(resp_r)
        loop = asyncio.get_running_loop()
        capture = OutputCapture(self.mode.max_output)
        assert proc.stdout is not None and proc.stdin is not None
        output = asyncio.create_task(pump(proc.stdout, capture))
        requests: asyncio.Task[None] | None = None
        transports: list[asyncio.BaseTransport] = []
        outcome = "exited"
        try:
            reader = asyncio.StreamReader(limit=_LINE_LIMIT)
            t_in, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(req_r, "rb", 0)
            )
            transports.append(t_in)
            t_out, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(resp_w, "wb", 0))
            transports.append(t_out)
            self.responses = t_out
            requests = asyncio.create_task(self._serve(reader))
            proc.stdin.write(setup.encode())
            with contextlib.suppress(ConnectionError):
                await proc.stdin.drain()
            proc.stdin.close()
            outcome = await supervise(proc, output, limit)
            if outcome != "exited":
                await kill_group(proc, KILL_GRACE, mark)
                await asyncio.wait({output}, timeout=DRAIN_GRACE)
            else:  # the runner's last line (a sys.exit message) may still be in the pipe
                await asyncio.wait({requests}, timeout=DRAIN_GRACE)
        except BaseException:
            await kill_group(proc, KILL_GRACE, mark)
            raise
        finally:
            output.cancel()
            pending = [t for t in (requests, *self.handlers) if t is not None]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for transport in transports:
                transport.close()
            close_transport(proc)
        return self._result(capture, proc.returncode, outcome, limit)

    def _result(self, capture: OutputCapture, code: int | None, outcome: str, limit: float) -> ToolResult:
        text, truncated = capture.render()
        body = text.rstrip("\n") if text.strip() else "(no output)"
        details: dict[str, Any] = {
            "exit_code": code,
            "timed_out": outcome == "timeout",
            "truncated": truncated,
            "tool_calls": self.calls,
        }
        notes: list[str] = []
        if truncated:
            notes.append(f"[output cut to {self.mode.max_output} characters: print less, or summarise]")
        if outcome == "timeout":
            notes.append(f"[timed out after {limit:g} s; the program and its child processes were killed]")
        elif code == 1 and self.exit_message is not None:  # sys.exit("message"): an exit, not a crash
            details["exit_message"] = self.exit_message
            notes.append(f"[the program exited with code 1: {_cut(self.exit_message, MAX_EXIT_MESSAGE)}]")
        elif code == 1:
            notes.append("[the program raised an exception]")
        elif code != 0:
            notes.append(f"[the program exited with code {code}]")
        failed = outcome == "timeout" or code != 0
        return ToolResult.text("\n".join([body, *notes]), is_error=failed, details=details)

    # -- nested calls ---------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await reader.readline()
            except ValueError:  # past the line limit: not the runner's (it sends no such line)
                log.debug("codemode: ignoring an overlong line on the channel")
                continue  # the reader dropped it; what follows is read afresh
            if not line:
                break
            try:
                msg = json.loads(line)
            except ValueError:
                log.debug("codemode: ignoring a malformed request line")
                continue
            if isinstance(msg, dict) and isinstance(msg.get("exit"), int) and "id" not in msg:
                # the runner's word on how the program ended; the program could write it too,
                # but only to dress its own exit, which the exit code still tells truthfully
                self.exit_message = str(msg.get("message", ""))
                continue
            if not isinstance(msg, dict) or not isinstance(msg.get("id"), int):
                continue
            task = asyncio.create_task(self._answer(msg))
            self.handlers.add(task)
            task.add_done_callback(self.handlers.discard)

    def _send(self, reply: dict[str, Any]) -> None:
        """Answer one call. A reply that cannot cross as it is (a value JSON cannot carry, a line
        longer than the runner reads) becomes a failure of that call: sent as it is, it would
        leave the program waiting for an answer, or close its channel for every later call."""
        if self.responses is None or self.responses.is_closing():
            return
        try:
            data = json.dumps(reply, default=str).encode()
        except (TypeError, ValueError):  # a key that is not a string, a circular value
            data = self._failure(reply["id"], "the result could not be encoded")
        if len(data) > _LINE_LIMIT:
            data = self._failure(
                reply["id"], f"the result is too large for the program ({len(data)} bytes): ask for less at once"
            )
        self.responses.write(data + b"\n")  # buffered, never blocks: the program may be busy and not reading

    @staticmethod
    def _failure(call_id: int, error: str) -> bytes:
        """A failed answer to ``call_id``: it always encodes, and is short."""
        return json.dumps({"id": call_id, "ok": False, "error": error}).encode()

    async def _answer(self, msg: dict[str, Any]) -> None:
        call_id = msg["id"]
        async with self.parallel:
            try:
                value = await self._call(msg.get("tool"), msg.get("args"))
            except _Refused as exc:
                self._send({"id": call_id, "ok": False, "denied": True, "error": str(exc)})
            except ToolError as exc:
                self._send({"id": call_id, "ok": False, "error": str(exc)})
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the program is over (it ended, timed out, was aborted): nobody waits
                # the tool awaited something another party cancelled: its failure, and the
                # program, waiting for this answer, must get one
                self._send({"id": call_id, "ok": False, "error": f"{msg.get('tool')} was cancelled"})
            except Exception as exc:
                log.debug("codemode: nested call raised", exc_info=True)
                self._send({"id": call_id, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
            else:
                self._send({"id": call_id, "ok": True, "result": value})

    def _tool(self, name: str) -> Tool:
        """The run's tool of that name when the runner gave its tools (if it was offered this
        turn, when hooks narrowed them), else the one given to us: a tool only programs have (an
        MCP server's, or every tool when CodeMode is an agent's only one). A run that has built-in
        tools of its own lends only those: they work in the process's directory, and one it lacks
        was taken from it (a toolset), so the program may not have it either."""
        own = self.mode.own_tools[name]
        if self.ctx.tools is None:
            return own
        found = self.ctx.tools.get(name)
        if found is not None and not isinstance(found, CodeMode) and syscall_of(found) != SYSCALL:
            if self.ctx.offered is not None and name not in self.ctx.offered:
                raise ToolError(not_offered(name))
            return found
        if name in SYSCALLS and any(other in SYSCALLS for other in self.ctx.tools):
            raise ToolError(f"no tool {name!r} is available in this run")
        return own

    async def _call(self, name: Any, args: Any) -> Any:
        if not isinstance(name, str) or name not in self.mode.own_tools:
            raise ToolError(f"no tool {name!r} is available in this program")
        if not isinstance(args, dict):
            raise ToolError("arguments must be an object")
        self.calls += 1
        number = self.calls  # now: calls made meanwhile (while this one is approved) count on
        if number > self.mode.max_calls:
            raise ToolError(f"call limit reached: a program may make at most {self.mode.max_calls} tool calls")
        await self._spend(name)
        tool = self._tool(name)
        args = tool.validate(args)  # ToolArgumentsError is a ToolError: a readable message
        syscall = syscall_of(tool, args)
        verdict = await self._approve(syscall, tool.name, args)
        if verdict.action == "deny":
            raise _Refused(f"{tool.name} denied: {verdict.reason or 'refused by the approval policy'}")
        if verdict.action == "ask":
            why = f" ({verdict.reason})" if verdict.reason else ""
            raise _Refused(f"{tool.name} {NEEDS_APPROVAL}{why}")
        self.ctx.update({"codemode_call": number, "tool": tool.name, "args": args})
        nested = ToolContext(
            f"{self.ctx.tool_call_id}.{number}",
            tool.name,
            self.ctx.workspace,
            tools=self.ctx.tools,
            check=self.ctx.check,
            run_id=self.ctx.run_id,  # (a subagent the program starts stops with the run)
            budget=self.ctx.budget,
            off_limits=self.ctx.off_limits,
            offered=self.ctx.offered,
            call_key=None if self.ctx.call_key is None else f"{self.ctx.call_key}.{number}",
            metadata=self.ctx.metadata,  # (the run's: a nested call is the run's as a direct one is)
            background=self.ctx.background,
            jobs=self.ctx.jobs,
        )
        if tool.timeout is not None and tool.interruptible:
            try:
                async with asyncio.timeout(tool.timeout):
                    result = await tool.run(args, nested)
            except TimeoutError:
                raise ToolError(f"{tool.name} timed out after {tool.timeout:g} s") from None
        else:
            result = await tool.run(args, nested)
        if result.is_error:
            raise ToolError(_text_of(result) or f"{tool.name} failed")
        if tool.output_schema is not None and isinstance(result.details, dict):
            if unwrapped_schema(tool.output_schema) is not tool.output_schema:
                return result.details.get("result")
            return result.details
        return _text_of(result)

    async def _spend(self, name: str) -> None:
        """Count the call against the run's tool-call budget, before anyone is asked about it: a
        program's calls are the run's calls, so the ``max_tool_calls`` guard sees each of them,
        and once the budget is used up the rest fail here (the run then ends through the guard)."""
        if self.ctx.budget is None:
            return
        refusal = await self.ctx.budget()
        if refusal is not None:
            raise ToolError(f"{name} not run: {refusal}")

    async def _approve(self, syscall: str, tool_name: str, args: dict[str, Any]) -> NestedVerdict:
        for check in (self.ctx.check, self.mode.check):
            if check is None:
                continue
            try:
                verdict = await check(syscall, tool_name, dict(args))
            except Exception as exc:  # an approval that fails refuses: fail closed
                log.debug("codemode: approval check raised", exc_info=True)
                return NestedVerdict("deny", f"the approval check failed: {type(exc).__name__}: {exc}")
            if verdict.action != "allow":
                return verdict
        return ALLOW


class _Refused(Exception):
    """A nested call the approval refused; it becomes ``ToolDenied`` in the program."""


def _cut(text: str, limit: int) -> str:
    """``text`` on one line, at most ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _compile_error(code: str) -> str | None:
    """Why the program does not compile (as the runner would compile it), or None."""
    try:
        compile(code, PROGRAM, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        return "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n")
    return None
