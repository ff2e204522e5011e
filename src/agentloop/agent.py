"""The library's front door: ``Agent`` runs the loop in memory, ``Run`` is one run of it.

    agent = Agent(model="openai:gpt-4o-mini", tools=[read_file], system_prompt="Be brief.")
    result = await agent.run("What is in notes.txt?")
    async for event in agent.stream("And in todo.txt?"): ...

An agent holds configuration, not conversation: each run starts from the history it is given, so
one agent serves any number of concurrent runs. ``result.messages`` continues a conversation, or
``agent.conversation()`` keeps one in memory (``agentloop.conversation``).

    result = await agent.run("Which city?", output_type=City)   # result.output: a City, or None
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, cast

from typing_extensions import TypeVar

from agentloop.events import AgentEnd, LoopEvent
from agentloop.loop.execute import own_tasks
from agentloop.loop.guards import Guards
from agentloop.loop.hooks import Handled, Hooks
from agentloop.loop.output import DEFAULT_RETRIES, OUTPUT_MISSING, OutputSpec, check_retries
from agentloop.loop.runner import finish_event, run_loop
from agentloop.loop.state import LoopConfig, Mode, QueueMode, RunState, ToolExecution, check_mode, check_queue_mode
from agentloop.messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolResultMessage,
    Usage,
    UserMessage,
    user,
)
from agentloop.models.base import Model, Reasoning, check_reasoning
from agentloop.models.registry import resolve_model
from agentloop.models.retry import RetryPolicy
from agentloop.tools.base import Tool, ToolLike, as_tool

if TYPE_CHECKING:
    from agentloop.conversation import Conversation

Input = str | Message | Sequence[Message]
#: The type of a run's structured output (``output_type``); Any when the run has none.
OutputT = TypeVar("OutputT", default=Any)


MESSAGE_TYPES = (UserMessage, AssistantMessage, ToolResultMessage, SystemMessage)

log = logging.getLogger("agentloop")

Watch = Callable[[LoopEvent], None]  # what an observer watches a run with (``loop.state.Observer``)

#: The stop reason of a send whose input an input hook handled (``Handled``): no run was made.
HANDLED = "handled"


class Piece(Protocol):
    """A composable piece of behaviour: it installs its tools, hooks and observers into an agent's config."""

    def install(self, config: LoopConfig) -> None: ...


class AgentBusy(RuntimeError):
    """``steer`` / ``follow_up`` / ``abort`` on the agent is ambiguous: use the ``Run`` object."""


@dataclass
class RunResult(Generic[OutputT]):
    """The outcome of a run: the whole history, what this run added, and why it stopped.

    ``stop_reason`` is ``stop``, ``length``, ``error``, ``aborted``, the name of the guard
    that ended the run (``max_rounds``, ``max_tool_calls``, ``max_wall_clock``, ``max_tokens``,
    ``max_cost``), or ``output_missing``: the run was given an ``output_type`` and the model kept
    answering in words after being told to call ``final_result``; ``handled`` when an input hook
    took the input (``Handled``): no run was made (``run_id`` empty, the history as it was).
    ``output`` is the validated
    ``output_type`` value (the last valid ``final_result`` call since the prompt), None when the run
    had no output type or got no valid output (a guard may end a run before it, too).
    """

    run_id: str
    messages: list[Message]
    new_messages: list[Message]
    stop_reason: str
    usage: Usage
    error: str | None = None
    output: OutputT | None = None

    @property
    def text(self) -> str:
        """The final answer: the text of the last assistant message."""
        for msg in reversed(self.messages):
            if isinstance(msg, AssistantMessage):
                return msg.text
        return ""

    @property
    def ok(self) -> bool:
        return self.stop_reason not in ("error", "aborted")


_RUN_PREFIX = os.urandom(5).hex()
_run_numbers = itertools.count(1)


def _next_run_id() -> str:
    """Unique within this process and, by its random prefix, across processes."""
    return f"{_RUN_PREFIX}{next(_run_numbers):06x}"


def handled_result(history: Sequence[Message]) -> RunResult[Any]:
    """What a send whose input an input hook handled answers: no run, the history unchanged."""
    return RunResult(run_id="", messages=list(history), new_messages=[], stop_reason=HANDLED, usage=Usage())


def handled_end() -> AgentEnd:
    """The one event a streamed send whose input an input hook handled yields: the stream's
    consumers read ``agent_end`` as its last event, so it gets one, with no run behind it."""
    return AgentEnd(run_id="", messages=[], stop_reason=HANDLED, usage=Usage())


def as_message(m: str | Message) -> Message:
    if isinstance(m, str):
        return user(m)
    if not isinstance(m, MESSAGE_TYPES):
        raise TypeError(f"a message must be a string or a Message, got {type(m).__name__}")
    return m


class Run(Generic[OutputT]):
    """One run of an agent. Steer it, queue follow-ups, abort it, iterate its events."""

    def __init__(
        self,
        cfg: LoopConfig,
        history: list[Message],
        prompts: list[Message],
        stream: bool,
        mode: Mode = "agent",
        metadata: Mapping[str, Any] | None = None,
        output: OutputSpec[OutputT] | None = None,
    ) -> None:
        self.id = _next_run_id()
        self._prompts = prompts
        self.state = RunState(run_id=self.id, messages=history, first_new=len(history), mode=mode, metadata=metadata)
        self._output = output
        self._cfg = cfg if output is None else output.prepare(cfg, self.state)  # the output tool: this run's only
        self._queue: asyncio.Queue[LoopEvent | None] | None = asyncio.Queue() if stream else None
        self._task: asyncio.Task[Any] | None = None
        self._started = False  # ``_execute`` has taken its first step (its task may not have yet)
        self._result: RunResult[OutputT] | None = None
        self._done: asyncio.Event | None = None  # made on demand: only a second waiter needs it
        self._failure: BaseException | None = None  # what the run raised, for its other waiters

    # -- input while running ----------------------------------------------------------------

    def steer(self, message: str | Message) -> None:
        """Deliver at the next boundary (after the running tools), before the next model call;
        tool calls not yet started are skipped."""
        self._still_running("steer")
        self.state.steering.append(as_message(message))

    def follow_up(self, message: str | Message) -> None:
        """Deliver when the agent would otherwise finish; the run goes on with it."""
        self._still_running("follow up")
        self.state.follow_up.append(as_message(message))

    def _still_running(self, what: str) -> None:
        if self._result is not None or self.state.aborted:  # the message would never be read
            raise AgentBusy(f"cannot {what}: the run has ended; start a new run with the message")

    def stop(self) -> None:
        """Finish gently: the model's answer and the tool calls under way complete, then the model
        answers once more without tools (saying what is done and what is left) and the run ends
        with stop reason ``stopped``. ``abort`` is the immediate stop. A no-op once it has ended."""
        if self._result is None and not self.state.aborted:
            self.state.stopping = True

    def abort(self) -> None:
        """Stop now: cancel the model stream and the tools. A no-op once the run is finished."""
        if self._result is not None or self.state.aborted:
            return
        self.state.aborted = True
        task = self._task
        # A streaming run's task made but not started yet is not cancelled: cancelled before its
        # first step it would never tell the stream it ended (the stream would wait forever); it
        # sees the flag at its first step and ends there, ``aborted``.
        if task is not None and self._started and task not in own_tasks() and not task.done():
            task.cancel()  # (not a tool's own run)

    @property
    def done(self) -> bool:
        return self._result is not None

    # -- running ------------------------------------------------------------------------------

    async def _execute(self) -> RunResult[OutputT]:
        self._task = asyncio.current_task()
        self._started = True
        emit: Watch | None = self._queue.put_nowait if self._queue is not None else None
        state = self.state
        watchers = _watchers(self._cfg, state) if self._cfg.observers else None
        if watchers:  # (none: the loop runs as it would without observers, emit None unless streaming)
            emit = _fan_out(emit, watchers)
        try:
            reason = await run_loop(self._cfg, state, emit, self._prompts)
        except BaseException as exc:  # a hook or tool bug: the stream and the waiters must not hang
            self._failure = exc
            if watchers:  # their run ends too (the stream's consumer gets the exception instead)
                ended = "aborted" if isinstance(exc, asyncio.CancelledError) else "error"
                _tell(watchers, finish_event(state, ended, f"{type(exc).__name__}: {exc}"))
            if self._queue is not None:
                self._queue.put_nowait(None)  # ends ``events``, which then raises it from the task
            if self._done is not None:
                self._done.set()
            raise
        finally:
            self._task = None
        error = state.error if reason == "error" else ("aborted" if reason == "aborted" else None)
        output = self._output.output_of(state.messages) if self._output is not None else None
        if output is None and self._output is not None and reason == "stop":
            reason = OUTPUT_MISSING
        if emit is not None:
            emit(finish_event(state, reason, error))
        self._result = RunResult(
            run_id=self.id,
            messages=state.messages,
            new_messages=state.new_messages,
            stop_reason=reason,
            usage=state.usage,
            error=error,
            output=output,
        )
        if self._done is not None:
            self._done.set()
        return self._result

    async def result(self) -> RunResult[OutputT]:
        """Wait for the run to finish (start it here if nobody else did)."""
        if self._result is not None:
            return self._result
        if self._task is None and self._queue is None:
            return await self._execute()
        if self._done is None:
            self._done = asyncio.Event()
        await self._done.wait()
        if self._result is None:
            assert self._failure is not None
            raise self._failure
        return self._result

    async def events(self) -> AsyncGenerator[LoopEvent, None]:
        """Start the run in a task and yield its events until ``agent_end``.

        Leaving the iteration early aborts the run.
        """
        assert self._queue is not None, "this run was not started for streaming"
        queue = self._queue
        task = asyncio.create_task(self._execute())
        self._task = task
        try:
            while True:
                event = await queue.get()
                if event is None:
                    break
                yield event
                if isinstance(event, AgentEnd):
                    break
            await task
        finally:
            if not task.done():
                self.abort()
                await asyncio.gather(task, return_exceptions=True)


def _watchers(cfg: LoopConfig, state: RunState) -> list[Watch]:
    """What the config's observers (``LoopConfig.observers``) watch this run with."""
    watchers: list[Watch] = []
    for observer in cfg.observers:
        try:
            watch = observer(cfg, state)
        except Exception:
            log.exception("a run observer failed to start watching run %s", state.run_id)
            continue
        if watch is not None:
            watchers.append(watch)
    return watchers


def _fan_out(emit: Watch | None, watchers: list[Watch]) -> Watch:
    def fan_out(event: LoopEvent) -> None:
        if emit is not None:
            emit(event)
        _tell(watchers, event)

    return fan_out


def _tell(watchers: list[Watch], event: LoopEvent) -> None:
    for watch in watchers:
        try:
            watch(event)
        except Exception:  # an observer's bug must not end the run it watches
            log.exception("a run observer failed on %s", event.type)


class Agent:
    """A model, tools, a system prompt and the rules of the loop.

    ``tool_timeout`` applies to every tool without its own; ``max_rounds`` is a shortcut for
    ``guards=Guards(max_rounds=...)``; ``fallbacks`` are tried in order when the model keeps
    failing; ``workspace`` is where the built-in file and shell tools are rooted; ``reasoning``
    (``"off"``, ``"low"``, ``"medium"``, ``"high"``) sets how hard a reasoning model thinks, on
    whichever provider it is (None: the model's own setting). ``output_type`` is the default of
    each run's ``output_type`` (see ``run``); ``output_retries`` is how many times a run that
    needs an output tells a model that answered in words to call ``final_result`` instead.

    ``pieces`` are composable behaviours (``ToolReveal``, ``StopAfterTools`` …) installed as
    ``use`` would: given here they reach a config nobody else builds, as ``Kernel.open``'s
    (which passes its ``agent_options`` to this constructor). ``steering_mode`` and
    ``follow_up_mode`` (``"one-at-a-time"``, the default, or ``"all"``; see ``loop.state.QueueMode``)
    say whether a model call takes one queued message or all of them. They are the in-memory
    runner's: a durable process always takes every waiting steer item into its next model call
    (as ``"all"``), and each queued follow-up starts a run of its own, so they do not apply there.
    """

    def __init__(
        self,
        model: str | Model | None = None,
        tools: Iterable[ToolLike] = (),
        system_prompt: str = "",
        *,
        tool_timeout: float | None = 60.0,
        max_rounds: int | None = None,
        tool_execution: ToolExecution = "parallel",
        max_concurrency: int = 16,
        guards: Guards | None = None,
        hooks: Hooks | None = None,
        fallbacks: Iterable[str | Model] = (),
        retry: RetryPolicy | None = None,
        workspace: str | Path | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        reasoning: Reasoning | None = None,
        output_type: Any = None,
        output_retries: int = DEFAULT_RETRIES,
        pieces: Iterable[Piece] = (),
        steering_mode: QueueMode = "one-at-a-time",
        follow_up_mode: QueueMode = "one-at-a-time",
    ) -> None:
        if tool_execution not in ("parallel", "sequential"):
            raise ValueError(f"tool_execution must be 'parallel' or 'sequential', got {tool_execution!r}")
        guards = guards or Guards()
        if max_rounds is not None:
            guards = replace(guards, max_rounds=max_rounds)
        tool_map: dict[str, Tool] = {}
        for t in tools:
            tool_obj = as_tool(t)
            if tool_obj.name in tool_map:
                raise ValueError(f"two tools are named {tool_obj.name!r}")
            tool_map[tool_obj.name] = tool_obj
        self.hooks = hooks or Hooks()
        self.config = LoopConfig(
            model=resolve_model(model),
            tools=tool_map,
            system_prompt=system_prompt,
            fallbacks=[resolve_model(f) for f in fallbacks],
            tool_timeout=tool_timeout,
            tool_execution=tool_execution,
            max_concurrency=max_concurrency,
            guards=guards,
            hooks=self.hooks,
            retry=retry or RetryPolicy(),
            workspace=Path(workspace).resolve() if workspace is not None else None,
            max_tokens=max_tokens,
            temperature=temperature,
            reasoning=check_reasoning(reasoning),
            steering_mode=check_queue_mode("steering_mode", steering_mode),
            follow_up_mode=check_queue_mode("follow_up_mode", follow_up_mode),
        )
        self.use(*pieces)
        self.output_retries = check_retries(output_retries)
        # made now: a type pydantic cannot handle is the constructor's TypeError, not each run's
        self._output = None if output_type is None else OutputSpec[Any](output_type, retries=output_retries)
        self._active: set[Run[Any]] = set()

    def use(self, *pieces: Piece) -> Agent:
        """Add behaviour made of tools, hooks and observers, e.g. ``agent.use(ToolReveal(hidden=[...]))``."""
        for piece in pieces:
            piece.install(self.config)
        return self

    @property
    def model(self) -> Model:
        return self.config.model

    @property
    def tools(self) -> dict[str, Tool]:
        return self.config.tools

    # -- starting runs --------------------------------------------------------------------------

    def start(
        self,
        input: Input,
        *,
        history: Sequence[Message] = (),
        stream: bool = False,
        mode: Mode = "agent",
        metadata: Mapping[str, Any] | None = None,
        output_type: type[OutputT] | None = None,
    ) -> Run[OutputT]:
        """Prepare a run. A string or message is a new prompt after ``history``; a list of
        messages is a history to continue (its last message must be user input or tool results).
        ``mode="chat"`` runs without tools on the same history. ``metadata`` (a request's ids,
        say) reaches the run's tools as ``ToolContext.metadata``. ``output_type`` (else the
        agent's) is what the run must produce; see ``run``.
        """
        check_mode(mode)
        output = self._output_for(output_type, mode)
        messages = list(history)
        if messages and not all(isinstance(m, MESSAGE_TYPES) for m in messages):
            raise TypeError("history must be a list of Message objects")
        if isinstance(input, str):  # the common case first: a plain prompt
            prompts: list[Message] = [user(input)]
        elif isinstance(input, list | tuple) or (not isinstance(input, MESSAGE_TYPES) and isinstance(input, Sequence)):
            if not all(isinstance(m, MESSAGE_TYPES) for m in input):
                raise TypeError("input must be a string, a Message or a list of Message objects")
            messages.extend(cast("Sequence[Message]", input))
            prompts = []
            if not messages:
                raise ValueError("Cannot continue: no messages in context")
            last = messages[-1]
            if isinstance(last, AssistantMessage):
                raise ValueError("Cannot continue from message role: assistant")
            if not isinstance(last, UserMessage | ToolResultMessage) and last.role != "system":
                raise ValueError(f"Cannot continue from message role: {last.role}")
        else:
            prompts = [as_message(input)]
        return Run(self.config, messages, prompts, stream, mode, metadata, output)

    def _output_for(self, output_type: Any, mode: Mode) -> OutputSpec[Any] | None:
        """The run's output: its own type, else the agent's (not in chat mode: no tools there)."""
        if output_type is None:
            return self._output if mode == "agent" else None
        if mode != "agent":
            raise ValueError("output_type needs tools, and mode='chat' runs without them")
        return OutputSpec[Any](output_type, retries=self.output_retries)

    async def run(
        self,
        input: Input,
        *,
        history: Sequence[Message] = (),
        mode: Mode = "agent",
        metadata: Mapping[str, Any] | None = None,
        output_type: type[OutputT] | None = None,
    ) -> RunResult[OutputT]:
        """Run to the end and return the result.

        ``output_type`` (else the agent's): a pydantic model, a dataclass, a TypedDict or any type
        pydantic validates (``list[str]``, ``int``, ``Literal[...]``; ``TypeError`` if it cannot).
        The run gets a ``final_result`` tool whose arguments are that type's JSON schema (others
        wrapped as ``{"result": ...}``); a valid call ends the run and is ``result.output``, the
        validated value. Invalid arguments go back to the model as a validation error; a model
        that answers in words is told to call the tool, at most ``output_retries`` times, and
        then the run ends with stop reason ``output_missing`` and ``output`` None.

        New input (a prompt, a user message) passes the input hooks first (``Hooks.admit``): one
        that handled it makes the result ``handled_result`` (no run); one that failed raises
        ``InputRejected``. ``start`` (which cannot wait for a hook) and a history to continue
        do not pass them.
        """
        if self.config.hooks.inputs:
            admitted = await self._admit(input, "agent.run")
            if isinstance(admitted, Handled):
                return handled_result(history)
            input = admitted
        run = self.start(input, history=history, mode=mode, metadata=metadata, output_type=output_type)
        self._active.add(run)
        try:
            return await run._execute()
        finally:
            self._active.discard(run)

    async def stream(
        self,
        input: Input,
        *,
        history: Sequence[Message] = (),
        mode: Mode = "agent",
        metadata: Mapping[str, Any] | None = None,
        output_type: type[Any] | None = None,
    ) -> AsyncIterator[LoopEvent]:
        """Run and yield every loop event; the last one is ``agent_end``. With an ``output_type``
        (see ``run``) the output is the ``details`` of the ``final_result`` tool result. Input an
        input hook handled yields only ``handled_end()``."""
        if self.config.hooks.inputs:
            admitted = await self._admit(input, "agent.stream")
            if isinstance(admitted, Handled):
                yield handled_end()
                return
            input = admitted
        run = self.start(input, history=history, stream=True, mode=mode, metadata=metadata, output_type=output_type)
        self._active.add(run)
        try:
            async with aclosing(run.events()) as events:
                async for event in events:
                    yield event
        finally:
            self._active.discard(run)

    async def _admit(self, input: Input, source: str) -> Input | Handled:
        """``input`` as the input hooks admit it, if it is new user input; a history to continue
        (or a system message) is not input arriving from anyone, and goes on as it is."""
        if isinstance(input, str):
            message = user(input)
        elif isinstance(input, UserMessage):
            message = input
        else:
            return input
        return await self.config.hooks.admit(message, mode="prompt", source=source)

    def run_sync(
        self,
        input: Input,
        *,
        history: Sequence[Message] = (),
        mode: Mode = "agent",
        output_type: type[OutputT] | None = None,
    ) -> RunResult[OutputT]:
        """``run`` for scripts without an event loop."""
        return asyncio.run(self.run(input, history=history, mode=mode, output_type=output_type))

    def conversation(self, messages: Iterable[Message] = ()) -> Conversation:
        """A conversation kept in memory on this agent (``agentloop.conversation``), from
        ``messages`` if given: for callers who would rather not carry ``history`` themselves."""
        from agentloop.conversation import Conversation  # (it builds on this module)

        return Conversation(self, messages)

    # -- talking to the active run ----------------------------------------------------------------

    def _only_run(self) -> Run | None:
        if len(self._active) > 1:
            raise AgentBusy("several runs are active: call steer/follow_up/abort on the Run")
        return next(iter(self._active), None)

    def steer(self, message: str | Message) -> None:
        run = self._only_run()
        if run is None:
            raise AgentBusy("no run is active to steer")
        run.steer(message)

    def follow_up(self, message: str | Message) -> None:
        run = self._only_run()
        if run is None:
            raise AgentBusy("no run is active to follow up")
        run.follow_up(message)

    def stop(self) -> None:
        """Ask the active run to finish gently (``Run.stop``); does nothing when no run is active."""
        for run in list(self._active):
            run.stop()

    def abort(self) -> None:
        """Abort the active run; does nothing when no run is active."""
        for run in list(self._active):
            run.abort()
