"""Hooks: user code that can veto a tool call, rewrite a result, reshape the context, or take
part in each turn.

Each hook may be a plain or an ``async`` function. Several hooks of one kind run in the order they
were added; the first ``before_tool_call`` that blocks wins, and each ``after_tool_call`` sees the
result the previous one returned.

Turn phases (``hooks.on(phase)``) run before every model call, in this order:
``pre_policy`` (may ``Block`` the turn), ``pre_prompt_context`` (returns extra context text),
``pre_tool_materialization`` (returns the tool list to show, and may add tools: see below),
``post_preflight_prompt_context`` (after ``ToolReveal``'s preflight chose the visible tools:
``TurnInfo.preflight`` holds its plan, ``TurnInfo.tools`` the tools this call shows; returns extra
context text, as ``pre_prompt_context`` does), ``pre_prompt_compile`` (returns the system prompt
to send), ``post_prompt_compile`` (sees the final system prompt; text it returns is appended to it
as a section of its own: a hook that wants the prompt cache to keep working returns the same text
at each call of a run, since a prompt that changes between calls is sent anew); and ``post_turn``
after each turn (returning ``Stop`` ends the run gently,
as ``Run.stop`` does: pi's ``shouldStopAfterTurn``). ``pre_compaction`` runs before older
history is summarised, by a durable process or by the ``Compaction`` piece (a last chance to save
something from it; returning ``Block`` skips this compaction, returning a ``dict`` keeps that data
on the summary message's ``details``, for code that reads the history, as ``ToolReveal`` does, to
find it there). ``compact_context`` is the in-memory runner's own compaction point (a durable
process compacts by itself and never runs it): before each model call its hooks see the run's
history (``TurnInfo.messages``, not to be changed in place) and may return a shorter one that
replaces it, an older part folded into a summary, as the ``Compaction`` piece does; they run once
more, with ``TurnInfo.overflow`` set, after a call the provider refused as too long, and the call
is made again if they returned a history. A hook that fails in a policy phase (``pre_policy``,
``pre_tool_materialization``, ``pre_prompt_compile``) fails the run; one that fails in a context
phase (``pre_prompt_context``, ``post_preflight_prompt_context``, ``post_prompt_compile``,
``post_turn``, ``pre_compaction``, ``compact_context``) is logged and its contribution left out.

Deadlines: each call of an ``async`` hook is given ``Hooks.timeout`` seconds (``DEFAULT_HOOK_TIMEOUT``,
30 s, unless set: ``hooks.timeout = 10``; None for no deadline), since a hook that never ends (an
HTTP call to a policy service that never answers) would otherwise hold its run, in memory and in a
durable process alike, forever. A hook may declare its own with a ``hook_timeout`` attribute (an
approval hook that waits for a person: ``hook_timeout = None``). A hook past its deadline is
cancelled and ``HookTimedOut`` raised in its place (Pioneer's ``hook_timed_out``): each phase treats
it as it treats a hook that fails, so a timed-out ``before_tool_call`` hook refuses the call (an
approval gate fails closed), one in a policy phase fails the run, one in a context phase is logged
and left out. A plain (not ``async``) hook runs inline on the event loop, where no deadline can
interrupt it (as for an inline tool): a hook that may wait on the network should be ``async``.

Input hooks (``hooks.on_input``): input that arrives for an agent passes them before it is
admitted (``Hooks.admit``), in memory (``Agent.run``/``stream``, a ``Conversation``'s send) and in
a durable process (``Process.send``, before the admission's transaction, so that a hook failing or
timing out, ``InputRejected``, leaves nothing written). Each returns None, a ``Rewrite`` or
``Handled`` (the input consumed: no history, no run). Provider-request hooks
(``hooks.before_provider_request``) see each loop model call's payload as the adapter is about to
send it (``models.base.ProviderRequest``, through ``Model.payload``) and may return a replacement;
one that fails fails that call as a provider's refusal would. Neither costs a thing unregistered.

Tool bundles: a ``pre_tool_materialization`` hook may add tools to the call, not only filter
them. It returns a ``Tool``, a bundle name (``hooks.add_bundle("memory", [...])``: a piece maps the
name to its tools), or a list mixing them with ``ToolSpec``s: the specs are the list to show (as
before), the tools and bundle names are added to it (a list with no spec keeps the list as it was).
An added tool is shown for this call and can be called like any registered tool, for the rest of
the run (in memory and in a durable process alike); a later call shows it only if a hook adds it
again (else a call to it is refused as not offered). A tool whose name is already another tool's,
an unknown bundle name, or something that is not a tool is logged once and left out. A durable
process keeps the added tools in memory, and with the run the names of those its open calls use:
after a restart (a call waiting for a person's approval meanwhile) the hooks are asked again, for
the turn and history of the call that made them (``model_call.tools_added``), and the calls run
with the tools they add; a tool they no longer add leaves its calls a tool error that says so.
Hooks are the application's own code, trusted as its tools are: a tool they add is not held to a
process's tool scope (``process/tool_scope.py``), which only narrows the tools the kernel gives a
run.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeAlias, TypeVar, cast, get_args

from agentloop.events import LoopEvent
from agentloop.messages import (
    AssistantMessage,
    FileContent,
    ImageContent,
    MediaBlock,
    Message,
    Origin,
    TextContent,
    ToolCall,
    Usage,
    UserMessage,
)
from agentloop.models.base import ProviderError, ProviderRequest, ToolSpec
from agentloop.tools.base import Tool, ToolLike, ToolResult, as_tool

log = logging.getLogger("agentloop.hooks")

Phase: TypeAlias = Literal[
    "pre_policy",
    "pre_prompt_context",
    "pre_tool_materialization",
    "post_preflight_prompt_context",
    "pre_prompt_compile",
    "post_prompt_compile",
    "post_turn",
    "pre_compaction",
    "compact_context",
]
PHASES: tuple[str, ...] = get_args(Phase)
POLICY_PHASES = frozenset({"pre_policy", "pre_tool_materialization", "pre_prompt_compile"})

#: Seconds an ``async`` hook call may take when its ``Hooks`` sets no ``timeout`` of its own: long
#: enough for a policy service's answer, short enough that a hung one does not hold a run for good.
DEFAULT_HOOK_TIMEOUT = 30.0


@dataclass
class TurnInfo:
    """What a turn-phase hook sees, and (through its return value) may change for this turn."""

    run_id: str
    turn: int
    messages: list[Message]
    system_prompt: str
    tools: list[ToolSpec]
    context: list[str] = field(default_factory=list)
    carry: dict[str, Any] = field(default_factory=dict)  # pre_compaction: what the summary keeps
    # compact_context: the call before failed as a context overflow (compact harder, or it fails
    # again); and the run's usage, to which a hook adds what its own model calls cost
    overflow: bool = False
    usage: Usage | None = None
    # a durable process's id (None in memory): run ids are unique only within one process (a
    # heartbeat's, a caller's), so a hook that keeps state per run keys it by both
    conversation: str | None = None
    # the run's event stream, for a hook to report what it did (``Compaction``, ``ToolRetry``):
    # set by the in-memory runner in ``compact_context`` and ``post_turn`` while the run is watched
    emit: Callable[[LoopEvent], None] | None = None
    # pre_tool_materialization: the run's registered tools (an added tool may not take one's
    # name), and the tools its hooks added to this call (their specs are in ``tools``)
    registered: Mapping[str, Tool] = field(default_factory=dict)
    added: dict[str, Tool] = field(default_factory=dict)
    # post_preflight_prompt_context: the plan of ``ToolReveal``'s preflight for this run, if one
    # ran: ``{"visibleTools": [...], "source": "provider" | "fallback", "fallbackReason"?: ...}``
    preflight: dict[str, Any] | None = None


class ToolMap(dict[str, Tool]):
    """A run's tools with those its ``pre_tool_materialization`` hooks added (``bundled``): the
    added ones are callable for the rest of the run, shown only when a hook adds them again."""

    bundled: frozenset[str] = frozenset()


def with_added(tools: Mapping[str, Tool], added: Mapping[str, Tool]) -> ToolMap:
    """``tools`` with ``added`` (tools hooks added to a call) joined to them, as bundled tools."""
    joined = ToolMap({**tools, **added})
    joined.bundled = (tools.bundled if isinstance(tools, ToolMap) else frozenset()) | added.keys()
    return joined


class TurnFailed(Exception):
    """A policy-phase hook blocked or failed the turn."""


@dataclass
class ToolCallInfo:
    """What a tool hook knows about the call: the call, its validated arguments, the history.

    ``syscall`` is what approval policies match the call against (``fs.read``, ``mcp.gh.search``);
    ``parent`` is set for a call a tool made on the model's behalf (a CodeMode program's
    ``await shell(...)``): the model's call it was made from. A hook judges such a call like a
    direct one; ``parent`` only says where it came from.
    """

    call: ToolCall
    args: dict[str, Any]
    assistant_message: AssistantMessage
    messages: list[Message]
    run_id: str
    syscall: str | None = None
    parent: ToolCall | None = None
    conversation: str | None = None  # as ``TurnInfo.conversation``


@dataclass(frozen=True)
class Block:
    """Returned by a before-tool-call hook to stop the call; ``reason`` is what the model reads."""

    reason: str = "Tool execution was blocked"


@dataclass(frozen=True)
class Stop:
    """Returned by a ``post_turn`` hook to end the run gently after this turn: as ``Run.stop``
    (and a durable process's ``stop``) do, what the turn started is kept, the model answers once
    more without tools, and the run ends with stop reason ``stopped``; a turn that ended with the
    model's answer and no waiting input simply ends the run. ``reason`` is logged. It is a value
    of its own, not ``Block``: a block refuses something, this asks for an orderly end."""

    reason: str = "a post_turn hook asked to stop"


#: How input reached the agent: ``prompt`` starts a run in memory (``Agent.run``, a
#: ``Conversation``'s send); the others are a durable process's send modes (``Process.send``).
InputMode: TypeAlias = Literal["prompt", "steer", "queue", "interrupt", "reject"]


@dataclass(frozen=True)
class InputInfo:
    """What an input hook sees: user input that has arrived and is not admitted yet. ``source``
    names the door it came in by (``agent.run``, ``agent.stream``, ``conversation.send``,
    ``conversation.stream``, ``process.send``, ``process.spawn``: a process's first input, mode
    ``prompt``), ``origin`` who wrote it when a chat bridge said so.
    ``run_id`` is the run id a durable send's caller supplied (None: none): a hook with side
    effects keys them by it, since a retried send it ``Handled`` reaches it again."""

    text: str
    media: tuple[MediaBlock, ...] = ()
    mode: InputMode = "prompt"
    source: str | None = None
    origin: Origin | None = None
    run_id: str | None = None
    conversation: str | None = None  # a durable process's id (None in memory)


@dataclass(frozen=True)
class Rewrite:
    """Returned by an input hook to admit other input in place of what came: ``text`` (a slash
    command expanded, a pasted secret masked) and ``media`` (None: the media that came)."""

    text: str
    media: tuple[MediaBlock, ...] | None = None

    def __post_init__(self) -> None:
        # checked here: a bad rewrite would otherwise surface as a provider's refusal, turns later
        if not isinstance(self.text, str):
            raise TypeError(f"Rewrite.text must be a string, got {type(self.text).__name__}")
        if self.media is not None and not all(isinstance(m, ImageContent | FileContent) for m in self.media):
            raise TypeError("Rewrite.media must be a tuple of ImageContent and FileContent blocks")


@dataclass(frozen=True)
class Handled:
    """Returned by an input hook that dealt with the input itself (a command it answered, input
    routed elsewhere): nothing is added to the history and no run starts; the caller's answer
    says so (a ``RunResult`` with stop reason ``handled``, a ``Receipt`` with ``handled``)."""

    reason: str = "an input hook handled the input"


class InputRejected(RuntimeError):
    """An input hook failed, timed out or returned something it may not: the input was not
    admitted (nothing written, no run started), so the caller still holds it and learns why."""


BeforeToolCall: TypeAlias = Callable[[ToolCallInfo], "Block | Awaitable[Block | None] | None"]
AfterToolCall: TypeAlias = Callable[[ToolCallInfo, ToolResult], "ToolResult | Awaitable[ToolResult | None] | None"]
TransformContext: TypeAlias = Callable[[list[Message]], "list[Message] | Awaitable[list[Message]]"]
OnInput: TypeAlias = Callable[[InputInfo], "Rewrite | Handled | Awaitable[Rewrite | Handled | None] | None"]
BeforeProviderRequest: TypeAlias = Callable[
    [ProviderRequest], "dict[str, Any] | Awaitable[dict[str, Any] | None] | None"
]

T = TypeVar("T")


async def maybe_await(value: T | Awaitable[T]) -> T:
    """``value``, awaited if it is awaitable: for callbacks that may be plain or ``async``."""
    if hasattr(value, "__await__"):  # cheaper than inspect.isawaitable's ABC check
        return await cast(Awaitable[T], value)
    return value


class HookTimedOut(TimeoutError):
    """A hook ran past its deadline (Pioneer's ``hook_timed_out``). It is raised where the hook
    would have raised, so that every phase treats it exactly as a failing hook (see the module's
    docstring); the message names the hook and the deadline, for the log and the model."""

    def __init__(self, hook: str, timeout: float) -> None:
        super().__init__(f"hook {hook} timed out after {timeout:g} s")
        self.hook = hook
        self.timeout = timeout

    @property
    def timeout_ms(self) -> int:
        return round(self.timeout * 1000)


def hook_name(fn: Callable[..., Any]) -> str:
    """``fn``'s qualified name (its class's, for a callable object), for messages about it."""
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) else type(fn).__qualname__


async def _call(fn: Callable[..., Any], *args: Any, limit: float | None) -> Any:
    """``fn(*args)``, awaited within ``limit`` seconds (or ``fn``'s own ``hook_timeout``) if it
    is ``async``. A plain hook's value is returned as it is: it ran inline, where no deadline can
    stop it, and a deadline set up for it would only cost time on every turn."""
    result = fn(*args)  # maybe_await inlined: hooks run on every turn and call
    if not hasattr(result, "__await__"):
        return result
    seconds = getattr(fn, "hook_timeout", limit)
    if seconds is None:
        return await result
    deadline = asyncio.timeout(seconds)
    try:
        async with deadline:
            return await result
    except TimeoutError as exc:
        if not deadline.expired():  # the hook's own TimeoutError (a socket's): its failure as it is
            raise
        raise HookTimedOut(hook_name(fn), seconds) from exc


@dataclass
class Hooks:
    """The hooks of one agent. Add with ``hooks.before_tool_call(fn)`` (usable as a decorator).

    ``timeout`` is each ``async`` hook call's deadline in seconds (None: none), read from
    ``DEFAULT_HOOK_TIMEOUT`` when the ``Hooks`` is made."""

    before: list[BeforeToolCall] = field(default_factory=list)
    after: list[AfterToolCall] = field(default_factory=list)
    transform: list[TransformContext] = field(default_factory=list)
    inputs: list[OnInput] = field(default_factory=list)
    provider_request: list[BeforeProviderRequest] = field(default_factory=list)
    phases: dict[str, list[Callable[[TurnInfo], Any]]] = field(default_factory=dict)
    bundles: dict[str, list[Tool]] = field(default_factory=dict)  # bundle name -> its tools
    timeout: float | None = field(default_factory=lambda: DEFAULT_HOOK_TIMEOUT)
    _warned: set[str] = field(default_factory=set, repr=False)  # what was logged once

    def add_bundle(self, name: str, tools: Iterable[ToolLike]) -> None:
        """Name a group of tools that a ``pre_tool_materialization`` hook may add by that name."""
        made = [as_tool(t) for t in tools]
        names = [t.name for t in made]
        if len(set(names)) != len(names):
            raise ValueError(f"bundle {name!r} names a tool twice: {names}")
        self.bundles[name] = made

    def on(self, phase: Phase) -> Callable[[T], T]:
        """Register a turn-phase hook: ``@hooks.on("post_turn")``."""
        if phase not in PHASES:
            raise ValueError(f"unknown hook phase {phase!r} (phases: {', '.join(PHASES)})")

        def register(fn: T) -> T:
            self.phases.setdefault(phase, []).append(fn)  # type: ignore[arg-type]
            return fn

        return register

    async def run_phase(self, phase: Phase, info: TurnInfo) -> Block | Stop | None:
        """Run one phase's hooks, applying what they return to ``info``; raises ``TurnFailed``.
        Returns the ``Block`` a ``pre_compaction`` hook gave, or the ``Stop`` a ``post_turn`` hook
        gave (the other ``post_turn`` hooks still run: each sees every turn), if any."""
        stop: Stop | None = None
        for fn in self.phases.get(phase, ()):
            try:
                out = await _call(fn, info, limit=self.timeout)
            except Exception as exc:
                if phase in POLICY_PHASES:
                    raise TurnFailed(f"{phase} hook failed: {exc}") from exc
                log.warning("%s hook %s failed; going on without it: %s", phase, getattr(fn, "__name__", fn), exc)
                continue
            if isinstance(out, Block) and phase == "pre_policy":
                raise TurnFailed(f"turn blocked by policy: {out.reason}")
            if isinstance(out, Block) and phase == "pre_compaction":
                return out
            if isinstance(out, Stop) and phase == "post_turn":
                log.info("run %s: a post_turn hook asked to stop after turn %d: %s", info.run_id, info.turn, out.reason)
                stop = stop or out
                continue
            if out is None:
                continue
            if phase == "pre_prompt_context" and isinstance(out, str):
                info.context.append(out)
            elif phase == "pre_tool_materialization":
                self._offer(info, out)
            elif phase == "post_preflight_prompt_context" and isinstance(out, str):
                info.context.append(out)
            elif phase == "pre_prompt_compile" and isinstance(out, str):
                info.system_prompt = out
            elif phase == "post_prompt_compile" and isinstance(out, str) and out:
                info.system_prompt = f"{info.system_prompt}\n\n{out}" if info.system_prompt else out
            elif phase == "pre_compaction" and isinstance(out, dict):
                info.carry.update(out)
            elif phase == "compact_context" and isinstance(out, list):
                info.messages = out
        return stop

    def _offer(self, info: TurnInfo, out: Any) -> None:
        """Apply what a ``pre_tool_materialization`` hook returned: the specs to show, tools added."""
        items = out if isinstance(out, list) else [out]
        extra = [x for x in items if not isinstance(x, ToolSpec)]
        if not extra:
            if isinstance(out, list):
                info.tools = out
            return
        kept = [x for x in items if isinstance(x, ToolSpec)]
        tools = kept if kept else list(info.tools)
        shown = {spec.name for spec in tools}
        bundled = info.registered.bundled if isinstance(info.registered, ToolMap) else frozenset()
        for tool in self._tools_of(extra):
            name = tool.name
            if info.added.get(name) is tool or (name in shown and info.registered.get(name) is tool):
                continue  # added twice, or a registered tool a hook shows again: the same tool
            mine = info.registered.get(name)
            if name in info.added or (mine is not None and mine is not tool and name not in bundled):
                self._warn_once(f"clash:{name}", "a hook added a tool named %r, another tool's name: left out", name)
                continue
            if name not in shown:
                tools.append(tool.spec)
                shown.add(name)
            if mine is not tool:
                info.added[name] = tool
        info.tools = tools

    def _tools_of(self, items: list[Any]) -> list[Tool]:
        """The tools ``items`` name: tools as they are, bundle names as their tools."""
        found: list[Tool] = []
        for item in items:
            if isinstance(item, str):
                bundle = self.bundles.get(item)
                if bundle is None:
                    self._warn_once(f"bundle:{item}", "a hook added the unknown tool bundle %r: left out", item)
                else:
                    found.extend(bundle)
                continue
            try:
                tool = as_tool(item)
                tool.spec  # noqa: B018  (a subclass that skipped Tool.__init__ has none)
            except (TypeError, ValueError, AttributeError) as exc:  # (ValueError: a lambda's name)
                self._warn_once(f"tool:{type(item).__name__}", "a hook added %r, which is not a tool: %s", item, exc)
                continue
            found.append(tool)
        return found

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def before_tool_call(self, fn: T) -> T:
        self.before.append(fn)  # type: ignore[arg-type]
        return fn

    def after_tool_call(self, fn: T) -> T:
        self.after.append(fn)  # type: ignore[arg-type]
        return fn

    def transform_context(self, fn: T) -> T:
        self.transform.append(fn)  # type: ignore[arg-type]
        return fn

    def on_input(self, fn: T) -> T:
        """Register an input hook: it sees input before it is admitted (see ``admit``)."""
        self.inputs.append(fn)  # type: ignore[arg-type]
        return fn

    def before_provider_request(self, fn: T) -> T:
        """Register a provider-request hook: it sees each model call's payload (``shape_payload``)."""
        self.provider_request.append(fn)  # type: ignore[arg-type]
        return fn

    async def admit(
        self,
        message: UserMessage,
        *,
        mode: InputMode,
        source: str,
        run_id: str | None = None,
        conversation: str | None = None,
    ) -> UserMessage | Handled:
        """``message`` as the input hooks admit it: itself (no hook changed it), a copy carrying
        a ``Rewrite`` (its text, then its media), or ``Handled``. The hooks run in the order they
        were added, each seeing the input as the one before left it; the first ``Handled`` ends
        it. Raises ``InputRejected`` naming the hook that failed, timed out or returned something
        else: the caller admits nothing."""
        media = tuple(b for b in message.content if not isinstance(b, TextContent))
        info = InputInfo(message.text, media, mode, source, message.origin, run_id, conversation)
        rewritten = False
        for fn in self.inputs:
            try:
                out = await _call(fn, info, limit=self.timeout)
            except Exception as exc:
                raise InputRejected(f"input hook {hook_name(fn)} failed: {exc}") from exc
            if out is None:
                continue
            if isinstance(out, Handled):
                log.info("input hook %s handled the input: %s", hook_name(fn), out.reason)
                return out
            if not isinstance(out, Rewrite):
                raise InputRejected(
                    f"input hook {hook_name(fn)} returned {type(out).__name__}: return None, a Rewrite or Handled"
                )
            info = replace(info, text=out.text, media=info.media if out.media is None else out.media)
            rewritten = True
        if not rewritten:
            return message
        return replace(message, content=[TextContent(text=info.text), *info.media])

    async def shape_payload(self, request: ProviderRequest) -> dict[str, Any]:
        """The payload the provider-request hooks leave: each sees the one before's, and returns
        a replacement ``dict`` or None (keep it). A hook that fails, times out or returns
        something else fails the model call as a provider's refusal would (a ``ProviderError``
        naming the hook, not retried: it would fail again), never an exception in the loop."""
        payload = request.payload
        for fn in self.provider_request:
            try:
                out = await _call(fn, replace(request, payload=payload), limit=self.timeout)
            except Exception as exc:
                raise ProviderError(f"provider-request hook {hook_name(fn)} failed: {exc}", "bad_request") from exc
            if out is None:
                continue
            if not isinstance(out, dict):
                raise ProviderError(
                    f"provider-request hook {hook_name(fn)} returned {type(out).__name__}, not a dict payload",
                    "bad_request",
                )
            payload = out
        return payload

    async def run_before(self, info: ToolCallInfo) -> Block | None:
        for fn in self.before:
            verdict = await _call(fn, info, limit=self.timeout)
            if isinstance(verdict, Block):
                return verdict
        return None

    async def run_after(self, info: ToolCallInfo, result: ToolResult) -> ToolResult:
        for fn in self.after:
            replaced = await _call(fn, info, result, limit=self.timeout)
            if isinstance(replaced, ToolResult):
                result = replaced
        return result

    async def run_transform(self, messages: list[Message]) -> list[Message]:
        for fn in self.transform:
            messages = list(await _call(fn, messages, limit=self.timeout))
        return messages
