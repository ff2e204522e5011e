"""Tools: what the model may call, how its arguments are checked, and what a tool returns.

``@tool`` turns a typed Python function into a ``Tool``: the JSON schema comes from the signature
(pydantic) and the descriptions from the docstring. ``Tool.from_schema`` takes a hand-written
JSON schema and an async callable instead. Either way, arguments are validated (with coercion:
``"3"`` is accepted for an ``int``) before the tool runs, and a failure becomes a readable message
for the model rather than an exception.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, get_type_hints, overload

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from agentloop.messages import FileContent, ImageContent, TextContent, ToolResultMessage, storable, storable_value
from agentloop.models.base import ToolSpec
from agentloop.tools.process_group import KeptOutput, keep_text, kept_note, unshown_lines

if TYPE_CHECKING:
    from agentloop.tools.jobs import JobTable

ResultBlock: TypeAlias = TextContent | ImageContent | FileContent

#: Characters of text a tool result may hand the model (about 25k tokens). One runaway result
#: (a whole log, a binary dumped as text) would otherwise fill the context and be sent again with
#: every later model call; cut, the model still sees the start and the end and can ask for less.
MAX_RESULT_CHARS = 100_000
#: Seconds a plain ``def`` tool may hold the event loop before it is reported (once per tool): no
#: timeout can stop work done inline, and meanwhile every other run on the loop waits.
SLOW_INLINE = 0.5

log = logging.getLogger("agentloop.tools")


@dataclass
class ToolResult:
    """What a tool hands back: content blocks for the model, ``details`` for programs.
    ``terminate`` asks for the run to end after this turn (when every result of the turn asks
    it): a "submit" tool whose result is the outcome needs no model call to read it back."""

    content: list[ResultBlock]
    details: Any = None
    is_error: bool = False
    terminate: bool = False

    def __post_init__(self) -> None:
        # ``ToolResult("done")`` reads naturally, and was taken as a list of one-character blocks
        content: object = self.content
        if isinstance(content, str):
            self.content = [TextContent(text=content)]
        elif isinstance(content, tuple):
            self.content = list(content)
        elif not isinstance(content, list):
            raise TypeError(f"ToolResult content must be a list of blocks or a text, got {type(content).__name__}")

    @classmethod
    def text(cls, text: str, *, is_error: bool = False, details: Any = None, terminate: bool = False) -> ToolResult:
        return cls([TextContent(text=text)], details=details, is_error=is_error, terminate=terminate)

    @classmethod
    def error(cls, text: str) -> ToolResult:
        return cls([TextContent(text=text)], is_error=True)

    def _texts(self) -> tuple[list[str], int]:
        """The text blocks, and the length of their text joined by line breaks."""
        texts = [b.text for b in self.content if isinstance(b, TextContent)]
        return texts, sum(len(t) for t in texts) + max(0, len(texts) - 1)

    def too_long(self, limit: int) -> bool:
        """Whether ``capped(limit)`` would cut this result (asked of every result: one text block,
        nearly every result, is measured directly)."""
        content = self.content
        if len(content) == 1 and type(content[0]) is TextContent:
            return len(content[0].text) > limit
        return self._texts()[1] > limit

    def capped(self, limit: int | None) -> ToolResult:
        """This result with its text cut to ``limit`` characters (None: no limit): the text blocks
        become one block that keeps the first two thirds and the last third of the allowance
        around a note saying what was cut; images stay. ``details`` (for programs) is kept whole."""
        texts, total = self._texts()
        if limit is None or total <= limit:
            return self
        return self._cut("\n".join(texts), limit, None)

    async def capped_keeping(self, limit: int | None, workspace: str | Path | None) -> ToolResult:
        """``capped``, but with a ``workspace`` the whole text of a result it cuts is first kept in
        a file of it, as Shell keeps a long command output (``process_group.keep_text``), and the
        cut names the file: what was cut is there to read, where calling the tool again could cost
        as much, fail, or give something else. Written in a worker thread (a result may be
        megabytes); a result that fits costs what ``capped`` does. A file that cannot be written
        (a read-only workspace) leaves the cut as ``capped`` makes it."""
        texts, total = self._texts()
        if limit is None or total <= limit:
            return self
        text = "\n".join(texts)
        kept = None if workspace is None else await asyncio.to_thread(_keep, workspace, text)
        return self._cut(text, limit, kept)

    def _cut(self, text: str, limit: int, kept: KeptOutput | None) -> ToolResult:
        head = limit * 2 // 3
        tail = limit - head
        shown_tail = text[-tail:] if tail else ""
        why = f"the result had {len(text)}, more than the {limit} this tool may return"
        if kept is not None and kept.path is not None:
            lines = text.count("\n") + (0 if text.endswith("\n") else 1)
            first, last = unshown_lines(lines, text.endswith("\n"), text[:head], shown_tail)
            span = f": lines {first}–{last} of {lines} not shown" if first <= last else ""
            why += f"{span}{kept_note(kept, kept.size, first)}"
        else:
            why += ". Ask for a smaller part if the cut matters"
        note = f"\n[… {len(text) - limit} characters cut: {why} …]\n"
        images = [b for b in self.content if not isinstance(b, TextContent)]
        cut = TextContent(text=text[:head] + note + shown_tail)
        return ToolResult([cut, *images], details=self.details, is_error=self.is_error, terminate=self.terminate)

    def to_message(self, tool_call_id: str, tool_name: str) -> ToolResultMessage:
        """The result as the history keeps it. Text a tool made of bytes that were not UTF-8 (a
        file name decoded with ``surrogateescape``) has lone surrogates, which no provider takes
        and no store can write: they become U+FFFD here instead of failing the step."""
        content = [_storable_block(b) for b in self.content]
        return ToolResultMessage(
            tool_call_id=tool_call_id,
            tool_name=tool_name,
            content=content,
            details=storable_value(self.details),
            is_error=self.is_error,
            terminate=self.terminate,
        )


def _keep(workspace: str | Path, text: str) -> KeptOutput:
    """``text`` kept whole beneath ``workspace`` (in a worker thread: encoding and writing
    megabytes would hold the event loop), as UTF-8 with lone surrogates made U+FFFD, as the
    history stores the text. (A ``str`` from the durable runner: made a ``Path`` only here, when a
    result is cut, not on every call.)"""
    return keep_text(Path(workspace), storable(text).encode())


def _storable_block(block: ResultBlock) -> ResultBlock:
    if isinstance(block, TextContent):
        text = storable(block.text)
        if text is not block.text:
            return TextContent(text=text)
    return block


class ToolError(Exception):
    """Raise from a tool to report a failure to the model; the text is what the model reads."""


class ToolArgumentsError(ToolError):
    """The model's arguments do not fit the tool's schema."""


def utf8(text: str, what: str) -> bytes:
    """``text`` as UTF-8, or ``ToolError`` naming ``what``: a model's JSON may hold a lone
    surrogate (``"\\ud800"`` is valid JSON), which has no UTF-8 form; a raw ``UnicodeEncodeError``
    would tell the model nothing it could fix."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ToolError(
            f"{what} is not valid UTF-8 text: character {exc.start} is a lone surrogate"
            f" ({text[exc.start]!r}); write the character itself, or a whole surrogate pair"
        ) from None


def _ignore(partial: Any) -> None:
    """Progress reports go nowhere when nobody watches the run."""


@dataclass(frozen=True, slots=True)
class NestedVerdict:
    """What the runner says about a call one tool makes through another (CodeMode's nested
    calls): ``allow`` runs it, ``deny`` refuses it, ``ask`` means a person would have to approve
    it and the runner could not ask from where the call was made."""

    action: Literal["allow", "deny", "ask"]
    reason: str = ""


ALLOW = NestedVerdict("allow")

#: ``check(syscall, tool_name, validated_args)``: the approval of one nested call, made by the
#: runner that runs the outer call, so nested calls meet the same policy and hooks as direct ones.
NestedCheck: TypeAlias = Callable[[str, str, dict[str, Any]], Awaitable[NestedVerdict]]

#: ``spend()``: counts one nested call against the run's tool-call budget (the ``max_tool_calls``
#: guard) before it runs, so a program's hundred calls are a hundred calls to the guard and not
#: one. None: the call may run (and is counted); otherwise why it may not (the budget is used up).
CallBudget: TypeAlias = Callable[[], Awaitable[str | None]]


@dataclass(slots=True)
class ToolContext:
    """Handed to tools that ask for it (a parameter annotated ``ToolContext``).

    ``update`` reports progress (a ``tool_execution_update`` event); ``workspace`` is the
    directory the built-in tools are rooted in. ``tools`` (the run's tools, by name) and
    ``check`` (their approval) are for tools that call other tools, like CodeMode: the runner
    fills them so a nested call uses the very tool objects and the policy a direct call would.
    ``run_id`` names the run that made the call, for tools whose effects belong to that run (a
    subagent started by it stops when the run is aborted). ``off_limits`` are paths a tool that
    walks a tree (Search) leaves out, whatever path it was given: a kernel's own data (every
    account's conversations) may lie under the workspace. ``offered`` are the tools the model was
    shown this turn when hooks narrowed them (None: all of ``tools``); a tool that calls others
    calls only those. ``call_key`` is unique to this call in a durable process's store and the
    same when the call runs again after a restart (None in memory): what a tool that starts
    something keyed to its call (a subagent) names it by, where a provider may reuse call ids.
    ``metadata`` is what the caller attached to the run (``Agent.run(metadata=...)``; for
    ``/engine/chat`` the request's ``metadata``, its ``correlation_id`` among it): for tools that
    log or trace their work under the caller's ids. Read it; it is the caller's. ``background``
    hands the runtime work that outlives the call (a command left running, as Shell's
    ``background``): the runtime owns it - stops it when the process is reset or killed, or the
    runtime closes - and tells the model what it returns, as a system event (or, when the runtime
    stopped or died first, the next one tells it the work did not finish; the work reports the
    process groups it starts through ``background_group``, for that runtime to stop). None where
    nothing could tell it later (in memory); ``BackgroundRefused`` when the process runs too many.
    ``jobs`` are the calling process's background commands (``tools/jobs.py``), given with
    ``background``: what Shell files a command it starts under, and the ``Jobs`` tool looks in.
    ``deadline`` is when the runtime cuts the call for its timeout, in event-loop time
    (``loop.time()``; None: no limit): for a tool that waits before its work can begin (a device
    call waiting for its device to reconnect), so it leaves the work the time left and says what
    ran the clock out, instead of being cut with a bare "timed out".
    """

    tool_call_id: str
    tool_name: str
    workspace: Path | None = None
    update: Callable[[Any], None] = _ignore
    tools: Mapping[str, Tool] | None = None
    check: NestedCheck | None = None
    run_id: str | None = None
    budget: CallBudget | None = None
    off_limits: tuple[Path, ...] = ()
    offered: frozenset[str] | None = None
    call_key: str | None = None
    metadata: Mapping[str, Any] | None = None
    background: Callable[[Coroutine[Any, Any, str], str], None] | None = None
    jobs: JobTable | None = None
    deadline: float | None = None


class BackgroundRefused(Exception):
    """Raised by ``ToolContext.background`` when it takes no more work (the limit per process)."""


#: Called with the process group and the run mark (``process_group.marked``) of a command it starts.
GroupStarted: TypeAlias = Callable[[int, str], Awaitable[None]]

#: Set by the runtime while it runs work handed to ``ToolContext.background``: what that work
#: tells of each process group it starts. The runtime records the group durably, so that if it
#: dies meanwhile the next one can stop the command (a group of its own outlives its runtime).
#: A context variable rather than an argument: the work was built before the runtime took it.
background_group: ContextVar[GroupStarted | None] = ContextVar("agentloop_background_group", default=None)


def not_offered(name: str) -> str:
    """The error of a call to a tool that exists but was not shown to the model this turn (kept
    back by a hook, or not revealed yet): the model must not reach past what it was offered, by
    a direct call or from a program."""
    return f"Tool {name} is not available in this turn: only the tools offered to you may be called"


def to_result(value: Any) -> ToolResult:
    """Normalise whatever a tool returned into a ``ToolResult`` (JSON for structured values)."""
    if isinstance(value, ToolResult):
        return value
    if isinstance(value, str):
        return ToolResult([TextContent(text=value)])
    if value is None:
        return ToolResult([TextContent(text="")])
    if isinstance(value, ResultBlock):
        return ToolResult([value])
    if isinstance(value, list) and value and all(isinstance(v, ResultBlock) for v in value):
        return ToolResult(list(value))
    if isinstance(value, BaseModel):  # a pydantic model returned by a tool
        return ToolResult([TextContent(text=value.model_dump_json())], details=value)
    try:
        return ToolResult([TextContent(text=json.dumps(value, default=str))], details=value)
    except (TypeError, ValueError):
        return ToolResult([TextContent(text=str(value))])


def format_validation_error(tool: str, errors: list[tuple[str, str]], args: Any) -> str:
    lines = [f'Validation failed for tool "{tool}":']
    lines += [f"  - {path or 'root'}: {msg}" for path, msg in errors]
    try:
        received = json.dumps(args, indent=2, default=str)
    except (TypeError, ValueError):
        received = repr(args)
    return "\n".join(lines) + f"\n\nReceived arguments:\n{received}"


class Tool:
    """A callable the model can use. Subclasses implement ``validate`` and ``run``.

    ``timeout`` (seconds) overrides the agent's default; ``sequential`` makes the call a barrier
    (it runs alone, after the calls before it); ``idempotent`` allows a durable runner to re-run
    it after a crash; ``max_result_chars`` is how much text of a result the model gets (the rest
    is cut, see ``ToolResult.capped``; None for no limit). ``repeatable`` says the same call may
    rightly get the same result again and again (a poll: "still running"), so the run does not
    count it as the model going round in circles (the ``repeated_call`` guard, ``loop/retries.py``;
    its failures still count). ``keeps_cut_results`` says a result cut for its length may be kept
    whole in the run's workspace (``ToolResult.capped_keeping``): False for a tool whose results
    belong to one account (its MCP servers, devices, memory), since the workspace is shared by
    every account's processes, and for one whose result is a view of a file already there (Read).
    """

    def __init__(
        self,
        name: str,
        description: str,
        parameters: dict[str, Any],
        *,
        timeout: float | None = None,
        sequential: bool = False,
        idempotent: bool = False,
        repeatable: bool = False,
        max_result_chars: int | None = MAX_RESULT_CHARS,
        keeps_cut_results: bool = True,
    ) -> None:
        if max_result_chars is not None and max_result_chars < 1:
            raise ValueError(f"max_result_chars must be a positive number or None, got {max_result_chars!r}")
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise ValueError(f"tool name must match [A-Za-z0-9_-]{{1,64}}, got {name!r}")
        self.name = name
        self.description = description
        self.parameters = parameters
        self.timeout = timeout
        self.sequential = sequential
        self.idempotent = idempotent
        self.repeatable = repeatable
        self.max_result_chars = max_result_chars  # None: results reach the model whole
        self.keeps_cut_results = keeps_cut_results
        self.spec = ToolSpec(name=name, description=description, parameters=parameters)
        self.syscall: str | None = None  # what approval policies match; None: derived from the name
        self.interruptible = True  # False for work that runs inline on the event loop
        # the JSON schema of the structured value in a result's ``details`` (an MCP tool's output
        # schema), if the tool declares one: CodeMode programs get that value instead of the text
        self.output_schema: dict[str, Any] | None = None

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Checked (and coerced) arguments, or ``ToolArgumentsError`` with a readable message."""
        return arguments

    def syscall_for(self, arguments: Mapping[str, Any]) -> str | None:
        """The syscall of one call. A tool that reaches different things by its arguments (the
        ``mcp`` tool: any server's tools) names the one this call reaches, so a policy rule on
        that thing applies however it is called."""
        return self.syscall

    def keeps_result_of(self, arguments: Mapping[str, Any]) -> bool:
        """Whether the result of one call (its checked ``arguments``), if cut, may be kept in the
        workspace: ``keeps_cut_results``, unless where the call runs decides it (a device-routed
        call: ``kernel/devices.py``'s ``RoutedTool``)."""
        return self.keeps_cut_results

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<Tool {self.name}>"

    @staticmethod
    def from_schema(
        name: str,
        description: str,
        parameters: dict[str, Any],
        fn: Callable[..., Awaitable[Any]],
        **options: Any,
    ) -> Tool:
        """A tool from a JSON schema and an async callable taking the arguments as keywords."""
        return SchemaTool(name, description, parameters, fn, **options)


# ------------------------------------------------------------------ function tools


_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters|Params)\s*:\s*$")
_SECTION = re.compile(r"^\s*(Returns?|Raises|Yields|Examples?|Notes?)\s*:\s*$")
_GOOGLE_PARAM = re.compile(r"^\s*(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")
_SPHINX_PARAM = re.compile(r"^\s*:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a docstring into (description, {param: description}); Google or Sphinx style."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    desc: list[str] = []
    params: dict[str, str] = {}
    section = "desc"
    current: str | None = None
    for line in lines:
        if _ARGS_HEADER.match(line):
            section, current = "args", None
            continue
        if _SECTION.match(line):
            section, current = "other", None
            continue
        sphinx = _SPHINX_PARAM.match(line)
        if sphinx:
            current = sphinx.group(1)
            params[current] = sphinx.group(2).strip()
            section = "args"
            continue
        if line.strip().startswith(":"):
            section, current = "other", None
            continue
        if section == "desc":
            desc.append(line)
        elif section == "args":
            m = _GOOGLE_PARAM.match(line)
            if m and (len(line) - len(line.lstrip())) <= 4:
                current = m.group(1).lstrip("*")
                params[current] = m.group(3).strip()
            elif current and line.strip():
                params[current] = (params[current] + " " + line.strip()).strip()
    return "\n".join(desc).strip(), params


def _strip_titles(schema: Any) -> Any:
    """Remove pydantic's generated ``title`` keys (noise for the model), keeping property names."""
    if isinstance(schema, dict):
        out: dict[str, Any] = {}
        for key, value in schema.items():
            if key == "title" and isinstance(value, str):
                continue
            if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
                out[key] = {k: _strip_titles(v) for k, v in value.items()}
            else:
                out[key] = _strip_titles(value)
        return out
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


class FunctionTool(Tool):
    """A tool backed by a Python function; built by ``@tool``."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        thread: bool | None = None,
        scope: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        sig = inspect.signature(fn)
        try:  # ``scope``: the names where the function was defined, for annotations kept as strings
            hints = get_type_hints(fn, localns=dict(scope) if scope else None, include_extras=True)
        except NameError as exc:
            raise TypeError(
                f"tool {fn.__name__}: annotation {exc.name!r} cannot be resolved; define it at module level"
            ) from None
        doc_desc, doc_params = parse_docstring(fn.__doc__)
        fields: dict[str, Any] = {}
        self._ctx_param: str | None = None
        for pname, param in sig.parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {fn.__name__}: *args / **kwargs cannot be described to a model")
            annotation = hints.get(pname, Any)
            if annotation is ToolContext:
                self._ctx_param = pname
                continue
            default = ... if param.default is param.empty else param.default
            fields[pname] = (annotation, Field(default, description=doc_params.get(pname)))
        self._args_model: type[BaseModel] = create_model(
            f"{fn.__name__}_arguments",
            __config__=ConfigDict(extra="ignore", arbitrary_types_allowed=True),
            **fields,
        )
        schema = _strip_titles(self._args_model.model_json_schema())
        schema.setdefault("properties", {})
        super().__init__(
            name or fn.__name__,
            description if description is not None else doc_desc,
            schema,
            **options,
        )
        self.fn = fn
        self._is_async = inspect.iscoroutinefunction(fn)
        if thread is None:  # a timeout set on the tool itself is a promise: only a thread can keep it
            thread = options.get("timeout") is not None
        self._thread = thread and not self._is_async
        self.interruptible = self._is_async or self._thread
        self._reported_slow = False

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        try:
            model = self._args_model.model_validate(arguments)
        except ValidationError as exc:
            errors = [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in exc.errors()]
            raise ToolArgumentsError(format_validation_error(self.name, errors, arguments)) from None
        return dict(model.__dict__)

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        if self._ctx_param is not None:
            arguments = {**arguments, self._ctx_param: ctx}
        if self._is_async:
            value = await self.fn(**arguments)
        elif self._thread:
            value = await asyncio.to_thread(self.fn, **arguments)
        else:
            started = time.perf_counter()
            try:
                value = self.fn(**arguments)
            finally:
                self._check_inline(time.perf_counter() - started)
        return to_result(value)

    def _check_inline(self, seconds: float) -> None:
        """Say so, once, when inline work held the loop long: the tool's author can move it to a
        thread, where the timeout holds and other runs go on meanwhile."""
        if seconds > SLOW_INLINE and not self._reported_slow:
            self._reported_slow = True
            log.warning(
                "tool %s ran %.1f s inline, holding the event loop (no timeout can stop it there): "
                "declare it @tool(thread=True), give it a timeout, or make it async",
                self.name,
                seconds,
            )


class SchemaTool(Tool):
    """A tool described by a JSON schema, validated with ``jsonschema`` after light coercion."""

    def __init__(
        self,
        name: str,
        description: str,
        parameters: dict[str, Any],
        fn: Callable[..., Awaitable[Any]],
        **options: Any,
    ) -> None:
        from jsonschema import Draft202012Validator

        Draft202012Validator.check_schema(parameters)
        super().__init__(name, description, parameters, **options)
        self.fn = fn
        self._validator = Draft202012Validator(parameters)

    def _coerce(self, arguments: dict[str, Any]) -> dict[str, Any]:
        props = self.parameters.get("properties") or {}
        out = dict(arguments)
        for key, value in arguments.items():
            kind = (props.get(key) or {}).get("type")
            if not isinstance(value, str) or kind not in ("integer", "number", "boolean"):
                continue
            text = value.strip()
            try:
                if kind == "integer" and re.fullmatch(r"[-+]?\d+", text):
                    out[key] = int(text)
                elif kind == "number":
                    out[key] = float(text)
                elif kind == "boolean" and text.lower() in ("true", "false"):
                    out[key] = text.lower() == "true"
            except ValueError:
                pass
        return out

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        coerced = self._coerce(arguments)
        errors = sorted(self._validator.iter_errors(coerced), key=lambda e: list(e.path))
        if errors:
            pairs = [(".".join(str(p) for p in e.path), e.message) for e in errors]
            raise ToolArgumentsError(format_validation_error(self.name, pairs, arguments))
        return coerced

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return to_result(await self.fn(**arguments))


# ------------------------------------------------------------------ @tool


@overload
def tool(fn: Callable[..., Any], /) -> FunctionTool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
    sequential: bool = False,
    idempotent: bool = False,
    repeatable: bool = False,
    thread: bool | None = None,
    max_result_chars: int | None = MAX_RESULT_CHARS,
    keeps_cut_results: bool = True,
) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
    sequential: bool = False,
    idempotent: bool = False,
    repeatable: bool = False,
    thread: bool | None = None,
    max_result_chars: int | None = MAX_RESULT_CHARS,
    keeps_cut_results: bool = True,
) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
    """Make a tool of a function: ``@tool`` or ``@tool(timeout=5, sequential=True)``.

    A plain ``def`` runs inline on the event loop (fast, fine for quick work); pass
    ``thread=True`` for blocking work so it runs in a worker thread instead (the default when the
    tool has its own ``timeout``, which inline work could not keep). ``async def`` tools are
    cancelled on timeout and abort; a thread's tool is answered with the timeout error when it is
    due, and its thread finishes on its own.
    """

    def wrap(f: Callable[..., Any], scope: Mapping[str, Any] | None = None) -> FunctionTool:
        return FunctionTool(
            f,
            name=name,
            description=description,
            thread=thread,
            # where the decorator was applied: a model defined in a function, named in annotations
            # that ``from __future__ import annotations`` keeps as strings, resolves from there
            scope=scope if scope is not None else sys._getframe(1).f_locals,
            timeout=timeout,
            sequential=sequential,
            idempotent=idempotent,
            repeatable=repeatable,
            max_result_chars=max_result_chars,
            keeps_cut_results=keeps_cut_results,
        )

    return wrap(fn, sys._getframe(1).f_locals) if fn is not None else wrap


ToolLike: TypeAlias = Tool | Callable[..., Any]


def as_tool(obj: ToolLike) -> Tool:
    """A ``Tool`` from a tool or a plain function."""
    if isinstance(obj, Tool):
        return obj
    if callable(obj):
        return FunctionTool(obj)
    raise TypeError(f"not a tool: {obj!r}")
