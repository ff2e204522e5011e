"""OpenTelemetry tracing: GenAI spans of in-memory runs (``Tracing``) and durable processes (``trace_kernel``).

    agent.use(Tracing())                      # every run of the agent, streamed or not
    tracing = trace_kernel(kernel)            # every run of every process the kernel drives

The spans follow the OpenTelemetry GenAI semantic conventions: ``invoke_agent`` for a run (a child
of the span current where the run starts), under it ``chat <model>`` for each model call (a failed
attempt that is retried is a span of its own, in error) and ``execute_tool <tool>`` for each tool
call, with the ``gen_ai.*`` attributes (operation, provider, request and response model, token
usage, finish reasons, tool name and call id, ``gen_ai.conversation.id``: a durable process's pid)
and agentloop's own under ``agentloop.*`` (the run's id and stop reason, its cost when the usage
has one). ``gen_ai.usage.input_tokens`` counts the whole prompt, its cached part included (which
``gen_ai.usage.cache_read.input_tokens`` / ``cache_creation.input_tokens`` give apart). A span that
failed, or that an abort cut short, has status ERROR and an ``error.type``.

What was said is not recorded unless asked (``record_content=True``): then the run's input and
answer (``gen_ai.input.messages`` / ``gen_ai.output.messages``), each model call's answer, and
each tool call's arguments and result (``gen_ai.tool.call.arguments`` / ``.result``).

OpenTelemetry is an optional extra (``pip install 'agentloop[otel]'``): importing this module does
not import it; using it does. Spans go to ``tracer_provider``, else to the global one
(``opentelemetry.trace.set_tracer_provider``).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentloop.events import (
    AgentEnd,
    AgentStart,
    LoopEvent,
    MessageEnd,
    MessageStart,
    MessageUpdate,
    ModelRetry,
    ToolExecutionEnd,
    ToolExecutionStart,
    ToolExecutionUpdate,
    TurnStart,
)
from agentloop.loop.execute import CANCELLED
from agentloop.messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    TextContent,
    ThinkingContent,
    ToolCall,
    ToolResultMessage,
    Usage,
    UserMessage,
)
from agentloop.process import signals as sig

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, TracerProvider

    from agentloop.kernel import Kernel
    from agentloop.loop.state import LoopConfig, RunState
    from agentloop.models.base import ModelInfo

log = logging.getLogger("agentloop.tracing")

INSTALL_HINT = "agentloop's tracing needs OpenTelemetry: pip install 'agentloop[otel]'"

# the GenAI semantic conventions' names
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
SYSTEM = "gen_ai.system"  # the older name of the provider, still read by many backends
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
FINISH_REASONS = "gen_ai.response.finish_reasons"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHE_READ_TOKENS = "gen_ai.usage.cache_read.input_tokens"
CACHE_CREATION_TOKENS = "gen_ai.usage.cache_creation.input_tokens"
CONVERSATION = "gen_ai.conversation.id"
AGENT_NAME = "gen_ai.agent.name"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
TOOL_TYPE = "gen_ai.tool.type"
TOOL_ARGUMENTS = "gen_ai.tool.call.arguments"
TOOL_RESULT = "gen_ai.tool.call.result"
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"
ERROR_TYPE = "error.type"
# agentloop's own
RUN_ID = "agentloop.run.id"
STOP_REASON = "agentloop.run.stop_reason"
RUN_MODE = "agentloop.run.mode"
RUN_TURNS = "agentloop.run.turns"
RUN_TOOL_CALLS = "agentloop.run.tool_calls"
RUN_RESUMED = "agentloop.run.resumed"  # a durable run this tracer did not see start (a restart)
RUN_TRIGGER = "agentloop.run.trigger"  # what started a durable run (``proc.send``, a schedule …)
RUN_FINISH_CODE = "agentloop.run.finish_code"  # the durable run's own reason code
RUN_INCOMPLETE = "agentloop.run.incomplete"  # ended by the tracer: "evicted", "superseded", "closed"
COST = "agentloop.usage.cost"
SYSCALL = "agentloop.tool.syscall"

#: how many durable runs ``trace_kernel`` holds open spans for, by default
MAX_OPEN_RUNS = 1000
# the longest error text put in a span's status (a provider's error; a tool's is content)
_MAX_DESCRIPTION = 500


@dataclass(frozen=True, slots=True)
class _Api:
    """The parts of the OpenTelemetry API this module uses, imported when tracing is first used."""

    get_tracer: Callable[..., Tracer]
    set_span_in_context: Callable[..., Context]
    Status: type[Status]
    StatusCode: type[StatusCode]
    SpanKind: type[SpanKind]


def _api() -> _Api:
    try:
        from opentelemetry import trace
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return _Api(trace.get_tracer, trace.set_span_in_context, trace.Status, trace.StatusCode, trace.SpanKind)


def _tracer(api: _Api, provider: TracerProvider | None) -> Tracer:
    from agentloop import __version__

    return api.get_tracer("agentloop", __version__, tracer_provider=provider)


# ------------------------------------------------------------------ shared


def _usage(usage: Usage) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        INPUT_TOKENS: usage.input + usage.cache_read + usage.cache_write,
        OUTPUT_TOKENS: usage.output,
    }
    if usage.cache_read:
        attrs[CACHE_READ_TOKENS] = usage.cache_read
    if usage.cache_write:
        attrs[CACHE_CREATION_TOKENS] = usage.cache_write
    if usage.cost.total:
        attrs[COST] = usage.cost.total
    return attrs


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _parts(content: Sequence[Any]) -> list[dict[str, Any]]:
    """Message blocks as the conventions' parts (media as its type only: not its bytes)."""
    parts: list[dict[str, Any]] = []
    for block in content:
        if isinstance(block, TextContent):
            parts.append({"type": "text", "content": block.text})
        elif isinstance(block, ThinkingContent):
            parts.append({"type": "reasoning", "content": block.thinking})
        elif isinstance(block, ToolCall):
            parts.append({"type": "tool_call", "id": block.id, "name": block.name, "arguments": block.arguments})
        else:
            parts.append({"type": getattr(block, "type", "unknown"), "mime_type": getattr(block, "mime_type", None)})
    return parts


def _message(message: Message) -> dict[str, Any]:
    if isinstance(message, AssistantMessage):
        return {"role": "assistant", "parts": _parts(message.content), "finish_reason": message.stop_reason}
    if isinstance(message, ToolResultMessage):
        part = {"type": "tool_call_response", "id": message.tool_call_id, "response": message.text}
        return {"role": "tool", "parts": [part]}
    role = "system" if isinstance(message, SystemMessage) else "user"
    return {"role": role, "parts": _parts(message.content)}


def _short(text: str | None) -> str | None:
    if text and len(text) > _MAX_DESCRIPTION:
        return text[:_MAX_DESCRIPTION] + "…"
    return text


def _fail(api: _Api, span: Span, error_type: str, description: str | None = None) -> None:
    span.set_attribute(ERROR_TYPE, error_type)
    span.set_status(api.Status(api.StatusCode.ERROR, _short(description)))


def _model_attrs(provider: str, model: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    if provider:
        attrs[PROVIDER] = attrs[SYSTEM] = provider
    if model:
        attrs[REQUEST_MODEL] = model
    return attrs


def _tool_attrs(name: str, call_id: str) -> dict[str, Any]:
    return {OPERATION: "execute_tool", TOOL_NAME: name, TOOL_CALL_ID: call_id, TOOL_TYPE: "function"}


def _answer(api: _Api, span: Span, message: AssistantMessage, content: bool) -> None:
    """What a model call's span says of its answer: usage, response model, finish, failure."""
    attrs = _usage(message.usage)
    attrs[FINISH_REASONS] = (message.stop_reason,)
    if message.model:
        attrs[RESPONSE_MODEL] = message.model
    if content:
        attrs[OUTPUT_MESSAGES] = _json([_message(message)])
    span.set_attributes(attrs)
    if message.stop_reason == "aborted":
        _fail(api, span, "aborted", "aborted")
    elif message.stop_reason == "error":
        _fail(api, span, "model_error", message.error_message)


# ------------------------------------------------------------------ in memory


class Tracing:
    """A piece (``agent.use(Tracing())``) that traces the agent's runs, streamed or not.

    ``tracer_provider``: where the spans go (None: the global provider). ``record_content``: record
    what was said (see the module's documentation; off by default). ``agent_name`` names the run
    spans (``invoke_agent <name>``, ``gen_ai.agent.name``). ``install_kernel(kernel)`` traces a
    kernel's durable processes with the same settings (``trace_kernel``).
    """

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        *,
        record_content: bool = False,
        agent_name: str | None = None,
    ) -> None:
        self._api = _api()
        self.tracer_provider = tracer_provider
        self._tracer = _tracer(self._api, tracer_provider)
        self.record_content = record_content
        self.agent_name = agent_name

    def install(self, config: LoopConfig) -> None:
        config.observers.append(self.observe)

    def observe(self, config: LoopConfig, state: RunState) -> Callable[[LoopEvent], None]:
        """The observer (``LoopConfig.observers``): one watcher per run."""
        return _RunWatch(self, config, state)

    def install_kernel(self, kernel: Kernel, *, max_open_runs: int = MAX_OPEN_RUNS) -> KernelTracing:
        return KernelTracing(
            kernel,
            self._tracer,
            record_content=self.record_content,
            agent_name=self.agent_name,
            max_open_runs=max_open_runs,
            api=self._api,
        )


class _RunWatch:
    """The spans of one in-memory run, made from its events."""

    __slots__ = ("api", "chat", "config", "content", "ctx", "inputs", "mark", "model", "owner", "run", "state", "tools")

    def __init__(self, owner: Tracing, config: LoopConfig, state: RunState) -> None:
        self.owner = owner
        self.api = owner._api
        self.config = config
        self.state = state
        self.content = owner.record_content
        self.model: ModelInfo = config.model.info
        self.run: Span | None = None
        self.ctx: Context | None = None
        self.chat: Span | None = None
        self.tools: dict[str, Span] = {}
        self.inputs: list[dict[str, Any]] = []
        self.mark = time.time_ns()  # when the loop began its next model call (the span's start)

    def __call__(self, event: LoopEvent) -> None:
        if isinstance(event, MessageUpdate | ToolExecutionUpdate):  # the hot ones: nothing to do
            return
        if isinstance(event, MessageStart):
            if isinstance(event.message, AssistantMessage) and self.chat is None:
                self._start_chat()
        elif isinstance(event, MessageEnd):
            self._message_end(event.message)
        elif isinstance(event, ToolExecutionStart):
            self._tool_start(event.tool_call_id, event.tool_name, event.args)
        elif isinstance(event, ToolExecutionEnd):
            self._tool_end(event.tool_call_id, event.result)
        elif isinstance(event, TurnStart):
            self.mark = time.time_ns()
        elif isinstance(event, ModelRetry):
            self._retry(event)
        elif isinstance(event, AgentStart):
            self._start()
        elif isinstance(event, AgentEnd):
            self._end(event)

    def _start(self) -> None:
        owner, state, info = self.owner, self.state, self.model
        attrs = _model_attrs(info.provider, info.id)
        attrs[OPERATION] = "invoke_agent"
        attrs[RUN_ID] = state.run_id
        attrs[RUN_MODE] = state.mode
        if state.conversation:
            attrs[CONVERSATION] = state.conversation
        name = "invoke_agent"
        if owner.agent_name:
            attrs[AGENT_NAME] = owner.agent_name
            name = f"invoke_agent {owner.agent_name}"
        self.run = owner._tracer.start_span(name, kind=self.api.SpanKind.INTERNAL, attributes=attrs)
        self.ctx = self.api.set_span_in_context(self.run)
        self.mark = time.time_ns()

    def _start_chat(self) -> None:
        info, cfg = self.model, self.config
        attrs = _model_attrs(info.provider, info.id)
        attrs[OPERATION] = "chat"
        if cfg.max_tokens is not None:
            attrs[MAX_TOKENS] = cfg.max_tokens
        if cfg.temperature is not None:
            attrs[TEMPERATURE] = cfg.temperature
        if self.state.conversation:
            attrs[CONVERSATION] = self.state.conversation
        self.chat = self.owner._tracer.start_span(
            f"chat {info.id}", context=self.ctx, kind=self.api.SpanKind.CLIENT, attributes=attrs, start_time=self.mark
        )

    def _message_end(self, message: Message) -> None:
        if isinstance(message, AssistantMessage):
            if self.chat is None:  # (shown without a start: an abort before the call began)
                self._start_chat()
            span, self.chat = self.chat, None
            assert span is not None
            _answer(self.api, span, message, self.content)
            span.end()
        elif isinstance(message, ToolResultMessage):
            if message.tool_call_id in self.tools:  # a call an abort cancelled
                self._tool_end(message.tool_call_id, message)
        elif self.content and isinstance(message, UserMessage):
            self.inputs.append(_message(message))
        self.mark = time.time_ns()

    def _retry(self, event: ModelRetry) -> None:
        if event.fallback:  # the next calls go to the fallback model
            found = next((m for m in self.config.fallbacks if m.name == event.model), None)
            if found is not None:
                self.model = found.info
        if self.run is not None:
            self.run.add_event(
                "agentloop.model_retry",
                {"attempt": event.attempt, "delay": event.delay, "model": event.model, "fallback": event.fallback},
            )
        self.mark = time.time_ns() + int(event.delay * 1e9)

    def _tool_start(self, call_id: str, name: str, args: Mapping[str, Any]) -> None:
        attrs = _tool_attrs(name, call_id)
        if self.content:
            attrs[TOOL_ARGUMENTS] = _json(args)
        self.tools[call_id] = self.owner._tracer.start_span(
            f"execute_tool {name}", context=self.ctx, kind=self.api.SpanKind.INTERNAL, attributes=attrs
        )

    def _tool_end(self, call_id: str, result: ToolResultMessage) -> None:
        span = self.tools.pop(call_id, None)
        if span is None:
            return
        text = result.text
        if self.content:
            span.set_attribute(TOOL_RESULT, text)
        if result.is_error:
            if text == CANCELLED:
                _fail(self.api, span, "cancelled", "cancelled")
            else:  # (what the tool said is content: in the status only when content is recorded)
                _fail(self.api, span, "tool_error", text if self.content else None)
        span.end()

    def _end(self, event: AgentEnd) -> None:
        run, state = self.run, self.state
        if run is None:
            return
        self.run = None
        reason = event.stop_reason
        for span in self.tools.values():  # (none unless the run ended abnormally)
            _fail(self.api, span, reason if reason in ("aborted", "error") else "cancelled")
            span.end()
        self.tools.clear()
        if self.chat is not None:
            _fail(self.api, self.chat, reason)
            self.chat.end()
            self.chat = None
        attrs = _usage(event.usage)
        attrs[STOP_REASON] = reason
        attrs[RUN_TURNS] = state.turn + 1
        attrs[RUN_TOOL_CALLS] = state.tool_calls
        if self.content:
            if self.inputs:
                attrs[INPUT_MESSAGES] = _json(self.inputs)
            last = next((m for m in reversed(event.messages) if isinstance(m, AssistantMessage)), None)
            if last is not None:
                attrs[OUTPUT_MESSAGES] = _json([_message(last)])
        run.set_attributes(attrs)
        if reason == "aborted":
            _fail(self.api, run, "aborted", "aborted")
        elif reason == "error":
            # the loop's own failure (the model's) has its state's error; else the run raised
            # (a hook's bug), and the observers were told "<exception type>: <message>"
            error_type = "error" if state.error is not None or not event.error else event.error.partition(":")[0]
            _fail(self.api, run, error_type, event.error)
        run.end()


# ------------------------------------------------------------------ durable


def trace_kernel(
    kernel: Kernel,
    tracer_provider: TracerProvider | None = None,
    *,
    record_content: bool = False,
    agent_name: str | None = None,
    max_open_runs: int = MAX_OPEN_RUNS,
) -> KernelTracing:
    """Trace the runs of every process ``kernel`` drives, from its signals, until ``close()`` (or
    the kernel closes). Arguments as ``Tracing``'s; ``max_open_runs`` caps the runs it holds spans
    open for (a run past it ends the oldest's span, marked ``agentloop.run.incomplete``)."""
    api = _api()
    return KernelTracing(
        kernel,
        _tracer(api, tracer_provider),
        record_content=record_content,
        agent_name=agent_name,
        max_open_runs=max_open_runs,
        api=api,
    )


@dataclass(slots=True)
class _DurableRun:
    pid: str
    run_id: str
    span: Span
    ctx: Context
    mark: int  # when its next model step began (the step's span starts there)
    seen: AssistantMessage | None  # the newest answer in the history that has its span
    tools: dict[str, Span] = field(default_factory=dict)
    model: tuple[str, str] | None = None  # (provider, model) of its model calls, once known
    cached: int = 0  # the cached prompt tokens of the steps seen (the run's usage counts none)


# signals the tracer never reads: live-only progress, sent for every delta
_IGNORED = frozenset({sig.RUN_STREAM, sig.TOOL_UPDATE, sig.LOG_PRUNED})
# a ToolRetry signal -> the name of the event it is on its run's span
_TOOL_RETRIES = {
    sig.TOOL_RETRY_SCHEDULED: "agentloop.tool_retry.scheduled",
    sig.TOOL_RETRY_RESOLVED: "agentloop.tool_retry.resolved",
    sig.TOOL_RETRY_EXHAUSTED: "agentloop.tool_retry.exhausted",
}
_TOOL_RETRY_PREFIX = "agentloop.tool_retry."
# signals that name a run this tracer may not have seen start (resumed after a restart)
_OF_A_RUN = frozenset(
    {
        sig.RUN_OUTPUT,
        sig.TOOL_STARTED,
        sig.TOOL_FINISHED,
        sig.RUN_RETRYING,
        sig.RUN_FINISHED,
        sig.HIL_REQUESTED,
        *_TOOL_RETRIES,
    }
)
# how far back from the end of a history the newest answer is looked for
_LOOK_BACK = 64
_STOP_REASONS = {"turn.complete": "stop", "generation.error": "error"}


def _snake(key: str) -> str:
    """A signal's camelCase field as an attribute's name part: ``errorClass`` -> ``error_class``."""
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in key)


class KernelTracing:
    """The spans of a kernel's durable runs, made from the signals its engine publishes (a tap on
    the signal hub). Never raises into the hub: what fails here is logged and the signal dropped.
    A run's model steps are read from the process's history as the engine caches it, when the
    step's commit is announced. ``close()`` untaps and ends the spans still open."""

    def __init__(
        self,
        kernel: Kernel,
        tracer: Tracer,
        *,
        record_content: bool = False,
        agent_name: str | None = None,
        max_open_runs: int = MAX_OPEN_RUNS,
        api: _Api | None = None,
    ) -> None:
        if isinstance(max_open_runs, bool) or not isinstance(max_open_runs, int) or max_open_runs < 1:
            raise ValueError(f"max_open_runs must be a positive integer, got {max_open_runs!r}")
        self._api = api or _api()
        self._tracer = tracer
        self.record_content = record_content
        self.agent_name = agent_name
        self.max_open_runs = max_open_runs
        self._engine = kernel.engine
        # (pid, run id) -> its spans, oldest first: run ids are unique per process only (a heartbeat
        # gives all the processes it beats in one period the same)
        self._runs: OrderedDict[tuple[str, str], _DurableRun] = OrderedDict()
        self._active: dict[str, str] = {}  # pid -> its run being traced
        self._closed = False
        self._failures = 0
        self._engine.hub.tap(self.tap)
        # closing the kernel closes its engine: then the spans of the runs it cut short are ended
        self._engine.closed_hooks.append(self.close)

    @property
    def open_runs(self) -> int:
        """How many runs have a span open."""
        return len(self._runs)

    def __enter__(self) -> KernelTracing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop tracing: untap, and end the spans still open (``agentloop.run.incomplete``: closed)."""
        if self._closed:
            return
        self._closed = True
        engine = self._engine
        engine.hub.untap(self.tap)
        if self.close in engine.closed_hooks:
            engine.closed_hooks.remove(self.close)
        for run in list(self._runs.values()):
            self._incomplete(run, "closed")

    def tap(self, pid: str, signal: sig.Signal) -> None:
        """The hub's listener: cheap, and never raises."""
        name = signal.signal
        if name in _IGNORED:
            return
        try:
            self._on(pid, name, signal.payload)
        except Exception:
            self._failures += 1  # (told once in a while: a broken exporter would fail every signal)
            if self._failures % 1000 == 1:
                log.warning(
                    "tracing could not record %s of process %s (%d failures)", name, pid, self._failures, exc_info=True
                )

    # -- the signals

    def _on(self, pid: str, name: str, payload: Mapping[str, Any]) -> None:
        run_id = payload.get("runId")
        if name == sig.RUN_STARTED:
            if isinstance(run_id, str) and self._drives(pid):
                self._start(pid, run_id, payload, resumed=False)
            return
        if isinstance(run_id, str):
            run = self._runs.get((pid, run_id))
            if run is None:
                if name not in _OF_A_RUN or not self._drives(pid):
                    return
                run = self._start(pid, run_id, payload, resumed=True)
        else:
            active = self._active.get(pid)
            run = self._runs.get((pid, active)) if active is not None else None
            if run is None:
                return
        self._look(run)
        if name == sig.TOOL_STARTED:
            self._tool_started(run, payload)
        elif name == sig.TOOL_FINISHED:
            self._tool_finished(run, payload)
        elif name == sig.RUN_RETRYING:
            self._retrying(run, payload)
        elif name in _TOOL_RETRIES:
            self._tool_retry(run, name, payload)
        elif name == sig.RUN_FINISHED:
            self._finished(run, payload)

    def _start(self, pid: str, run_id: str, payload: Mapping[str, Any], *, resumed: bool) -> _DurableRun:
        earlier = self._active.get(pid)
        if earlier is not None and (pid, earlier) in self._runs:  # its end was never heard
            self._incomplete(self._runs[(pid, earlier)], "superseded")
        while len(self._runs) >= self.max_open_runs:
            self._incomplete(next(iter(self._runs.values())), "evicted")
        attrs: dict[str, Any] = {OPERATION: "invoke_agent", CONVERSATION: pid, RUN_ID: run_id, RUN_RESUMED: resumed}
        if isinstance(payload.get("reason"), str) and not resumed:
            attrs[RUN_TRIGGER] = payload["reason"]
        name = "invoke_agent"
        if self.agent_name:
            attrs[AGENT_NAME] = self.agent_name
            name = f"invoke_agent {self.agent_name}"
        history = self._history(pid)
        if self.record_content and not resumed and history and isinstance(history[-1], UserMessage):
            attrs[INPUT_MESSAGES] = _json([_message(history[-1])])
        stamp = payload.get("timestamp")
        start = int(stamp) * 1_000_000 if isinstance(stamp, int) and not resumed else time.time_ns()
        span = self._tracer.start_span(name, kind=self._api.SpanKind.INTERNAL, attributes=attrs, start_time=start)
        run = _DurableRun(pid, run_id, span, self._api.set_span_in_context(span), start, _newest_answer(history))
        self._runs[(pid, run_id)] = run
        self._active[pid] = run_id
        return run

    def _drives(self, pid: str) -> bool:
        """Whether this worker drives the process (on a shared store, the signals of a process
        another worker holds are relayed here too: that worker traces its runs)."""
        live = self._engine.cached(pid)
        return live is None or not getattr(live, "remote", False)

    def _history(self, pid: str) -> list[Message]:
        live = self._engine.cached(pid)
        return live.history if live is not None else []

    def _look(self, run: _DurableRun) -> None:
        """A model step's commit is being announced when the history has a new answer: its span."""
        live = self._engine.cached(run.pid)
        if live is None:
            return
        answer = _newest_answer(live.history)
        if answer is None or answer is run.seen:
            return
        run.seen = answer
        now = time.time_ns()
        config = getattr(live, "config", None)  # (run id, the run's loop configuration), once made
        if config is not None and config[0] == run.run_id:
            info = config[1].model.info
            model = (info.provider, info.id)
        else:
            model = run.model or (answer.provider, answer.model)
        if run.model is None:
            run.model = model
            run.span.set_attributes(_model_attrs(*model))
        span = self._chat(run, model)
        _answer(self._api, span, answer, self.record_content)
        span.end(end_time=now)
        run.cached += answer.usage.cache_read + answer.usage.cache_write
        run.mark = now

    def _chat(self, run: _DurableRun, model: tuple[str, str]) -> Span:
        attrs = _model_attrs(*model)
        attrs[OPERATION] = "chat"
        attrs[CONVERSATION] = run.pid
        return self._tracer.start_span(
            f"chat {model[1]}" if model[1] else "chat",
            context=run.ctx,
            kind=self._api.SpanKind.CLIENT,
            attributes=attrs,
            start_time=run.mark,
        )

    def _retrying(self, run: _DurableRun, payload: Mapping[str, Any]) -> None:
        """A failed model call: a span of its own (the next one starts after the delay)."""
        named = payload.get("model")  # the model of the next attempt ("provider:id")
        provider, _, model_id = named.partition(":") if isinstance(named, str) else ("", "", "")
        span = self._chat(run, run.model or (provider, model_id))
        reason = payload.get("reason")
        _fail(self._api, span, "model_error", reason if isinstance(reason, str) else None)
        span.end()
        if payload.get("fallback") and model_id:
            run.model = (provider, model_id)
        delay = payload.get("delay")
        run.mark = time.time_ns() + (int(delay * 1e9) if isinstance(delay, int | float) else 0)

    def _tool_retry(self, run: _DurableRun, name: str, payload: Mapping[str, Any]) -> None:
        """A ``ToolRetry`` episode's news (logged after the step that had it, its calls' spans
        ended): an event on the run's span, ``agentloop.tool_retry.scheduled|resolved|exhausted``
        with the signal's fields (``agentloop.tool_retry.<field>``; the call as ``gen_ai.tool.*``)."""
        attrs: dict[str, Any] = {}
        for key, value in payload.items():
            if key in ("pid", "runId"):
                continue
            if key == "callId":
                key = TOOL_CALL_ID
            elif key == "name":
                key = TOOL_NAME
            else:
                key = _TOOL_RETRY_PREFIX + _snake(key)
            if isinstance(value, str | bool | int | float):
                attrs[key] = value
        run.span.add_event(_TOOL_RETRIES[name], attrs)

    def _tool_started(self, run: _DurableRun, payload: Mapping[str, Any]) -> None:
        call_id, name = str(payload.get("callId")), str(payload.get("name"))
        earlier = run.tools.pop(call_id, None)
        if earlier is not None:  # (started again after a restart: the first start's span ends)
            earlier.end()
        run.tools[call_id] = self._tool_span(run, call_id, name, payload)

    def _tool_span(self, run: _DurableRun, call_id: str, name: str, payload: Mapping[str, Any]) -> Span:
        attrs = _tool_attrs(name, call_id)
        if isinstance(payload.get("syscall"), str):
            attrs[SYSCALL] = payload["syscall"]
        if self.record_content and "args" in payload:
            attrs[TOOL_ARGUMENTS] = _json(payload["args"])
        return self._tracer.start_span(
            f"execute_tool {name}", context=run.ctx, kind=self._api.SpanKind.INTERNAL, attributes=attrs
        )

    def _tool_finished(self, run: _DurableRun, payload: Mapping[str, Any]) -> None:
        call_id = str(payload.get("callId"))
        span = run.tools.pop(call_id, None)
        if span is None:  # finished without a start: denied, or its arguments refused
            span = self._tool_span(run, call_id, str(payload.get("name")), payload)
        ok = payload.get("ok") is True
        said = payload.get("output") if ok else payload.get("error")
        if self.record_content and isinstance(said, str):
            span.set_attribute(TOOL_RESULT, said)
        if not ok:
            _fail(self._api, span, "tool_error", said if self.record_content and isinstance(said, str) else None)
        span.end()
        run.mark = time.time_ns()

    def _finished(self, run: _DurableRun, payload: Mapping[str, Any]) -> None:
        self._drop(run)
        status, code = payload.get("status"), payload.get("reason")
        reason = "aborted" if status == "aborted" else _STOP_REASONS.get(str(code), str(code))
        if status == "error":
            reason = "error"
        for span in run.tools.values():
            _fail(self._api, span, "aborted" if status == "aborted" else "cancelled")
            span.end()
        run.tools.clear()
        attrs: dict[str, Any] = {STOP_REASON: reason, RUN_FINISH_CODE: str(code)}
        usage = payload.get("usage")
        if isinstance(usage, Mapping):
            attrs[INPUT_TOKENS] = int(usage.get("input") or 0) + run.cached
            attrs[OUTPUT_TOKENS] = int(usage.get("output") or 0)
            if usage.get("cost"):
                attrs[COST] = float(usage["cost"])
        text = payload.get("text")
        if self.record_content and isinstance(text, str) and text:
            answer = {"role": "assistant", "parts": [{"type": "text", "content": text}], "finish_reason": reason}
            attrs[OUTPUT_MESSAGES] = _json([answer])
        run.span.set_attributes(attrs)
        if status == "aborted":
            _fail(self._api, run.span, "aborted", "aborted")
        elif status == "error":
            error = payload.get("error")
            _fail(self._api, run.span, "error", error if isinstance(error, str) else None)
        run.span.end()

    def _incomplete(self, run: _DurableRun, why: str) -> None:
        """End a run's spans without its end: the tracer lets go of it."""
        self._drop(run)
        for span in run.tools.values():
            span.set_attribute(RUN_INCOMPLETE, why)
            span.end()
        run.tools.clear()
        run.span.set_attribute(RUN_INCOMPLETE, why)
        run.span.end()

    def _drop(self, run: _DurableRun) -> None:
        self._runs.pop((run.pid, run.run_id), None)
        if self._active.get(run.pid) == run.run_id:
            del self._active[run.pid]


def _newest_answer(history: list[Message]) -> AssistantMessage | None:
    for message in history[: -_LOOK_BACK - 1 : -1]:
        if isinstance(message, AssistantMessage):
            return message
    return None


__all__ = ["INSTALL_HINT", "MAX_OPEN_RUNS", "KernelTracing", "Tracing", "trace_kernel"]
