"""A conversation kept in memory: an ``Agent`` plus the history it has built so far.

    conv = agent.conversation()
    await conv.send("My name is Alice.")
    result = await conv.send("What is my name?")   # the model sees both prompts

An ``Agent`` holds configuration only, so a caller who just wants to chat would otherwise carry
``result.messages`` from run to run and could not queue input between runs. A ``Conversation``
does that bookkeeping (pi's stateful ``Agent``) and nothing more: each send is one ``Agent`` run
on the history so far, so the loop's rules (queues, abort, guards, output types) are the agent's.

One run at a time: a second ``send`` while one runs is refused (``ConversationBusy``) unless it
says ``if_busy="queue"``, which waits its turn. Input given while idle (``follow_up``, ``steer``)
waits for the next run, which takes it before its own input.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from agentloop.agent import MESSAGE_TYPES, AgentBusy, Run, RunResult, as_message, handled_end, handled_result
from agentloop.events import LoopEvent
from agentloop.loop.execute import CANCELLED
from agentloop.loop.hooks import Handled
from agentloop.loop.state import Mode, RunState, unresolved_calls
from agentloop.messages import (
    FileContent,
    ImageContent,
    Message,
    ToolResultMessage,
    UserMessage,
    system,
    tool_error_result,
    user,
)

if TYPE_CHECKING:
    from agentloop.agent import Agent

log = logging.getLogger("agentloop")

#: What a second ``send`` does while a run is active: fail at once, or wait for its turn.
IfBusy: TypeAlias = Literal["refuse", "queue"]
#: What ``subscribe`` takes: called with every event of every run of the conversation.
Listener: TypeAlias = Callable[[LoopEvent], None]


class ConversationBusy(AgentBusy):
    """A send, a continue or a reset while the conversation is running a prompt."""


class Conversation:
    """An agent's conversation in memory: send prompts, steer and queue input, abort, reset.

    ``messages`` seeds the history (a saved ``conv.messages``, say). Not thread-safe: use it from
    one event loop, as the agent's runs are.
    """

    def __init__(self, agent: Agent, messages: Iterable[Message] = ()) -> None:
        self.agent = agent
        self._messages: list[Message] = _checked(messages)
        self._pending: deque[Message] = deque()  # input for the next run, oldest first
        self._run: Run[Any] | None = None
        self._busy = 0  # sends running or waiting for their turn
        self._turns = asyncio.Lock()  # FIFO: queued sends run in the order they were made
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the lock and event serve
        self._listeners: list[Listener] = []

    # -- state ----------------------------------------------------------------------------------

    @property
    def messages(self) -> tuple[Message, ...]:
        """The history, including what the running send has added so far. A copy: change the
        history with ``reset``, never by editing this (a run would overwrite the edit)."""
        if self._run is not None:
            return tuple(self._run.state.messages)
        return tuple(self._messages)

    @property
    def queued(self) -> tuple[Message, ...]:
        """Input waiting for the next run (given while idle, or left by a run that ended first)."""
        return tuple(self._pending)

    @property
    def running(self) -> bool:
        """Whether a send is running or waiting for its turn."""
        return self._busy > 0

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with every event of every later run; returns the unsubscribe function.

        Listeners run on the run's path, so keep them cheap; what one raises is logged and
        ignored, as the agent's observers are, so a UI bug cannot end the run it displays.
        """
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    # -- input ----------------------------------------------------------------------------------

    async def send(
        self,
        input: str | Message | None = None,
        *,
        media: Sequence[ImageContent | FileContent] = (),
        mode: Mode = "agent",
        metadata: Mapping[str, Any] | None = None,
        output_type: Any = None,
        if_busy: IfBusy = "refuse",
    ) -> RunResult[Any]:
        """Run the agent on the history plus ``input`` and keep what the run added.

        Queued input goes first: the oldest queued message opens the run and the rest, then
        ``input``, follow it as follow-ups, so the agent's ``follow_up_mode`` decides as it does
        for a running prompt (one answer each, or with ``"all"`` one answer to the rest together).
        No ``input`` continues the conversation (``continue_``).
        ``mode``, ``metadata`` and ``output_type`` are ``Agent.run``'s.

        A run that raises (a bug that escapes the loop, or the send's task cancelled) still
        leaves a history a model accepts: each tool call it left without a result gets an error
        result, then the exception goes on to the caller.

        ``input`` passes the agent's input hooks once it is this send's turn (``Hooks.admit``,
        mode ``queue`` if it waited for another send, else ``prompt``): input a hook handled
        starts no run and adds nothing (``handled_result``; queued input stays queued), and a
        hook's failure raises ``InputRejected``. ``steer`` and ``follow_up`` do not pass them.
        """
        prompt = _prompt(input, media)
        waited = self._busy > 0
        async with self._turn(if_busy):
            if prompt is not None and self.agent.config.hooks.inputs:
                admitted = await self._admit(prompt, "conversation.send", waited)
                if isinstance(admitted, Handled):
                    return handled_result(self._messages)
                prompt = admitted
            streamed = bool(self._listeners)  # subscribers' events come from the run's stream
            run = self._start(prompt, stream=streamed, mode=mode, metadata=metadata, output=output_type)
            async with self._running(run):
                if streamed:
                    async with aclosing(run.events()) as events:
                        async for event in events:
                            self._tell(event)
                return await run.result()

    async def stream(
        self,
        input: str | Message | None = None,
        *,
        media: Sequence[ImageContent | FileContent] = (),
        mode: Mode = "agent",
        metadata: Mapping[str, Any] | None = None,
        output_type: Any = None,
        if_busy: IfBusy = "refuse",
    ) -> AsyncIterator[LoopEvent]:
        """``send``, yielding the run's events as ``Agent.stream`` does; the last is ``agent_end``.

        Leaving the iteration early aborts the run; the history keeps what it did until then.
        Input an input hook handled yields only ``handled_end()``.
        """
        prompt = _prompt(input, media)
        waited = self._busy > 0
        async with self._turn(if_busy):
            if prompt is not None and self.agent.config.hooks.inputs:
                admitted = await self._admit(prompt, "conversation.stream", waited)
                if isinstance(admitted, Handled):
                    yield handled_end()
                    return
                prompt = admitted
            run = self._start(prompt, stream=True, mode=mode, metadata=metadata, output=output_type)
            async with self._running(run), aclosing(run.events()) as events:
                async for event in events:
                    self._tell(event)
                    yield event

    async def continue_(self, *, mode: Mode = "agent", if_busy: IfBusy = "refuse") -> RunResult[Any]:
        """Run on the queued input, or (none queued) go on from a history that ends with user
        input or tool results; ``ValueError`` when there is nothing to answer (pi's ``continue``)."""
        return await self.send(None, mode=mode, if_busy=if_busy)

    def steer(self, message: str | Message) -> None:
        """Give the running prompt new input at its next step (``Run.steer``: tool calls not yet
        started are skipped). While idle, queued for the next run like ``follow_up``."""
        message = as_message(message)
        run = self._run
        if run is not None and not run.done and not run.state.aborted:
            run.steer(message)
        else:
            self._pending.append(message)

    def follow_up(self, message: str | Message) -> None:
        """Input for when the running prompt would otherwise finish (``Run.follow_up``). While
        idle, queued: the next ``send`` or ``continue_`` takes it before its own input."""
        message = as_message(message)
        run = self._run
        if run is not None and not run.done and not run.state.aborted:
            run.follow_up(message)
        else:  # (also a run that has just ended: its input would be lost, not delivered)
            self._pending.append(message)

    def clear_queue(self) -> list[Message]:
        """Drop the input queued for the next run and return it."""
        dropped = list(self._pending)
        self._pending.clear()
        return dropped

    # -- control --------------------------------------------------------------------------------

    def abort(self) -> None:
        """Abort the running prompt (``Run.abort``); sends waiting for their turn still run, and
        queued input stays queued. Does nothing while idle."""
        if self._run is not None:
            self._run.abort()  # (before its first step too: ``Run.abort`` then ends it there)

    def stop(self) -> None:
        """Ask the running prompt to finish gently (``Run.stop``). Does nothing while idle."""
        if self._run is not None:
            self._run.stop()

    async def wait_idle(self) -> None:
        """Wait until no send is running or waiting. Never raises a run's error: the send that
        started the run raises it to its own caller."""
        await self._idle.wait()

    def reset(self, messages: Iterable[Message] = ()) -> None:
        """Start over from ``messages`` (none: empty) with nothing queued.

        Refused while running (``ConversationBusy``), not an abort: the running send would write
        its history back when it ends, and a reset that quietly stopped someone's run is a worse
        surprise than an error. ``abort()``, ``await wait_idle()``, then ``reset()``.
        """
        if self._busy:
            raise ConversationBusy("cannot reset while a prompt is running: abort() and wait_idle() first")
        self._messages = _checked(messages)
        self._pending.clear()

    # -- running --------------------------------------------------------------------------------

    async def _admit(self, prompt: Message, source: str, waited: bool) -> Message | Handled:
        """``prompt`` as the agent's input hooks admit it (a system message is no one's input)."""
        if not isinstance(prompt, UserMessage):
            return prompt
        return await self.agent.config.hooks.admit(prompt, mode="queue" if waited else "prompt", source=source)

    @asynccontextmanager
    async def _turn(self, if_busy: IfBusy) -> AsyncIterator[None]:
        """Hold the conversation for one send; the lock's order is the order sends were made."""
        if if_busy not in ("refuse", "queue"):
            raise ValueError(f"if_busy must be 'refuse' or 'queue', got {if_busy!r}")
        if self._busy and if_busy == "refuse":
            raise ConversationBusy(
                "the conversation is already running a prompt: use steer() or follow_up() to add to it, "
                "wait_idle() for it to finish, or send(..., if_busy='queue') to wait its turn"
            )
        loop = asyncio.get_running_loop()
        if loop is not self._loop and not self._busy:  # (asyncio.run again: the old ones are bound)
            self._loop, self._turns, self._idle = loop, asyncio.Lock(), asyncio.Event()
            self._idle.set()
        self._busy += 1
        self._idle.clear()
        try:
            async with self._turns:
                yield
        finally:
            self._busy -= 1
            if not self._busy:
                self._idle.set()

    def _start(
        self, prompt: Message | None, *, stream: bool, mode: Mode, metadata: Mapping[str, Any] | None, output: Any
    ) -> Run[Any]:
        """The agent's run of the history plus the queued input and ``prompt``; the queue is
        emptied only once the run exists, so a send the agent refuses loses nothing."""
        batch = [*self._pending, *([prompt] if prompt is not None else [])]
        agent = self.agent
        if batch:
            run: Run[Any] = agent.start(
                batch[0], history=self._messages, stream=stream, mode=mode, metadata=metadata, output_type=output
            )
            for message in batch[1:]:
                run.follow_up(message)
        else:  # a continuation: the agent says why a history cannot be continued
            if not self._messages:
                raise ValueError("No messages to continue from")
            run = agent.start(list(self._messages), stream=stream, mode=mode, metadata=metadata, output_type=output)
        self._pending.clear()
        return run

    @asynccontextmanager
    async def _running(self, run: Run[Any]) -> AsyncIterator[None]:
        """Make ``run`` the conversation's (and the agent's, for ``Agent.abort``) while it runs,
        and keep its history however it ends."""
        self._run = run
        active = self.agent._active
        active.add(run)
        failure: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            failure = exc
            raise
        finally:
            active.discard(run)
            state = run.state
            _close_dangling(state, failure)
            # input the run accepted but never took (it failed, was aborted or hit a guard)
            # goes to the front of the queue, steering first, as it was given before the rest
            left = [*state.steering, *state.follow_up]
            state.steering.clear()
            state.follow_up.clear()
            self._pending.extendleft(reversed(left))
            self._messages = list(state.messages)  # (not the result's list: a caller may edit that)
            self._run = None

    def _tell(self, event: LoopEvent) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("a conversation listener failed on %s", event.type)


def _prompt(input: str | Message | None, media: Sequence[ImageContent | FileContent]) -> Message | None:
    """The send's new message, checked before the send waits or starts anything."""
    if media:
        if not isinstance(input, str):
            raise TypeError("media goes with a text prompt: put it in the message's content instead")
        return user(input, *media)
    return None if input is None else as_message(input)


def _checked(messages: Iterable[Message]) -> list[Message]:
    history = list(messages)
    if not all(isinstance(m, MESSAGE_TYPES) for m in history):
        raise TypeError("a conversation's messages must be Message objects")
    return history


def _close_dangling(state: RunState, failure: BaseException | None) -> None:
    """Give every tool call a run left without a result one, so the next send's model call is
    valid: providers reject a tool call with no result. A clean or aborted run leaves none (the
    runner closes them); a run that raised can."""
    if failure is None:
        return
    assistant, pending = unresolved_calls(state.messages)
    # cancelled, or a stream's consumer left (its run was aborted): no failure to tell the model of
    cancelled = isinstance(failure, asyncio.CancelledError | GeneratorExit)
    why = CANCELLED if cancelled else f"Tool call not completed: the run failed ({type(failure).__name__})."
    for call in pending if assistant is not None else ():
        done: ToolResultMessage | None = state.results.get(call.id)  # (finished before the failure)
        state.messages.append(done or tool_error_result(call, why))
    state.results = {}
    if not cancelled:  # as a failed model call leaves it: the next model call learns of it
        state.messages.append(system(f"The run failed: {type(failure).__name__}: {failure}", "error"))
