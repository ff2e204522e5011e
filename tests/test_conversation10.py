"""``Conversation``: an agent's history kept in memory between sends (pi's stateful ``Agent``,
§1.5 and B5-B11), on a scripted model: history carried over, input queued while idle, steering,
abort, reset, one run at a time, and a history a model accepts after a run that raised."""

from __future__ import annotations

import asyncio

import pytest

from agentloop import (
    Agent,
    AgentBusy,
    AssistantMessage,
    Conversation,
    ConversationBusy,
    ImageContent,
    Reply,
    ScriptedModel,
    ToolResultMessage,
    UserMessage,
    call,
    tool,
    user,
)
from agentloop.agent import RunResult
from agentloop.events import LoopEvent
from agentloop.models.base import ModelRequest


def texts(request: ModelRequest) -> list[str]:
    """What one model call saw, as ``role:text`` (tool results by their text)."""
    return [f"{m.role}:{m.text}" for m in request.messages]


class Gate:
    """A model that answers ``reply(n)`` to its n-th call, holding each call until released."""

    def __init__(self) -> None:
        self.called = asyncio.Event()
        self.release = asyncio.Event()
        self.model = ScriptedModel(self.answer)

    async def answer(self, request: ModelRequest) -> str:
        self.called.set()
        await self.release.wait()
        return f"answer {len(self.model.requests)}"


async def test_history_is_carried_from_send_to_send() -> None:
    model = ScriptedModel(["Hello Alice.", "Your name is Alice."])
    agent = Agent(model=model)
    conv = agent.conversation()
    assert isinstance(conv, Conversation) and conv.messages == () and not conv.running

    first = await conv.send("My name is Alice.")
    second = await conv.send("What is my name?")

    assert texts(model.requests[1]) == [
        "user:My name is Alice.",
        "assistant:Hello Alice.",
        "user:What is my name?",
    ]
    assert [m.role for m in first.new_messages] == ["user", "assistant"]
    assert [m.text for m in second.new_messages] == ["What is my name?", "Your name is Alice."]
    assert [m.text for m in conv.messages] == [m.text for m in second.messages]
    assert isinstance(conv.messages, tuple)  # a copy: editing a result does not edit the conversation
    second.messages.clear()
    assert len(conv.messages) == 4


async def test_a_conversation_starts_from_given_messages_and_takes_media() -> None:
    model = ScriptedModel(["a red dot"])
    seed = [user("earlier"), AssistantMessage(content=[])]
    conv = Conversation(Agent(model=model), seed)
    image = ImageContent(data="iVBORw0KGgo=", mime_type="image/png")
    await conv.send("What is this?", media=[image])
    sent = model.requests[0].messages[-1]
    assert isinstance(sent, UserMessage) and sent.content[1] == image
    assert [m.role for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    with pytest.raises(TypeError, match="media goes with a text prompt"):
        await conv.send(user("hi"), media=[image])
    with pytest.raises(TypeError, match="Message objects"):
        Conversation(Agent(model=model), ["not a message"])  # type: ignore[list-item]


async def test_a_follow_up_given_while_idle_is_taken_first_by_the_next_send() -> None:
    model = ScriptedModel(["one", "two", "three"])
    conv = Agent(model=model).conversation()
    conv.follow_up("queued first")
    conv.steer("queued second")  # (idle: steering has no run to reach, so it waits the same way)
    assert [m.text for m in conv.queued] == ["queued first", "queued second"]
    assert conv.messages == ()  # queued input is not history until a run takes it (B5, B6)

    result = await conv.send("typed now")

    # one at a time (the agent's follow_up_mode): each is answered, the queue's oldest first
    assert [texts(r)[-1] for r in model.requests] == ["user:queued first", "user:queued second", "user:typed now"]
    assert [m.text for m in result.new_messages] == [
        "queued first",
        "one",
        "queued second",
        "two",
        "typed now",
        "three",
    ]
    assert conv.queued == ()


async def test_follow_up_mode_all_answers_the_rest_of_the_queue_at_once() -> None:
    model = ScriptedModel(["one", "two"])
    conv = Agent(model=model, follow_up_mode="all").conversation()
    conv.follow_up("a")
    conv.follow_up("b")
    await conv.send("c")
    assert texts(model.requests[1])[-3:] == ["assistant:one", "user:b", "user:c"]
    assert len(model.requests) == 2


async def test_continue_takes_the_queue_or_goes_on_from_user_input() -> None:
    model = ScriptedModel(["first", "second", "third"])
    conv = Agent(model=model).conversation()
    with pytest.raises(ValueError, match="No messages to continue from"):
        await conv.continue_()
    await conv.send("hi")
    with pytest.raises(ValueError, match="Cannot continue from message role: assistant"):
        await conv.continue_()
    assert not conv.running  # a refused continue leaves the conversation idle

    conv.follow_up("more")  # B10: a follow-up after an assistant turn, then continue
    result = await conv.continue_()
    assert [m.text for m in result.new_messages] == ["more", "second"]

    conv.reset([user("from the top")])  # a history that ends with user input: continue answers it
    result = await conv.continue_()
    assert [m.text for m in result.new_messages] == ["third"]
    assert [m.role for m in conv.messages] == ["user", "assistant"]


async def test_steer_and_follow_up_during_a_send_reach_its_run() -> None:
    started, release = asyncio.Event(), asyncio.Event()

    @tool
    async def wait() -> str:
        """Wait for the test."""
        started.set()
        await release.wait()
        return "waited"

    model = ScriptedModel([Reply(tool_calls=[call("wait")]), "steered", "followed"])
    conv = Agent(model=model, tools=[wait]).conversation()
    task = asyncio.create_task(conv.send("go"))
    await started.wait()
    assert conv.running
    conv.steer("change course")
    conv.follow_up("and then this")
    assert [m.text for m in conv.messages] == ["go", ""]  # the running send's progress so far
    release.set()
    result = await task

    assert texts(model.requests[1])[-2:] == ["toolResult:waited", "user:change course"]
    assert texts(model.requests[2])[-2:] == ["assistant:steered", "user:and then this"]
    assert result.text == "followed" and conv.queued == ()


async def test_abort_stops_the_running_send_and_the_history_goes_on() -> None:
    gate = Gate()
    conv = Agent(model=gate.model).conversation()
    conv.abort()  # B7: idle, nothing to abort
    task = asyncio.create_task(conv.send("long question"))
    await gate.called.wait()
    conv.abort()
    result = await task

    assert result.stop_reason == "aborted"
    last = conv.messages[-1]
    assert isinstance(last, AssistantMessage) and last.stop_reason == "aborted"
    assert not conv.running

    gate.release.set()
    again = await conv.send("shorter then")
    assert again.ok
    assert [m.role for m in conv.messages] == ["user", "assistant", "user", "assistant"]


async def test_agent_abort_reaches_a_conversation_run() -> None:
    gate = Gate()
    agent = Agent(model=gate.model)
    conv = agent.conversation()
    task = asyncio.create_task(conv.send("q"))
    await gate.called.wait()
    agent.abort()
    assert (await task).stop_reason == "aborted"


async def test_a_second_send_is_refused_unless_it_queues() -> None:
    gate = Gate()
    conv = Agent(model=gate.model).conversation()
    first = asyncio.create_task(conv.send("first"))
    await gate.called.wait()

    with pytest.raises(ConversationBusy, match="already running a prompt") as refused:
        await conv.send("refused")
    assert isinstance(refused.value, AgentBusy)
    with pytest.raises(ConversationBusy):
        await conv.continue_()
    with pytest.raises(ValueError, match="if_busy"):
        await conv.send("x", if_busy="later")  # type: ignore[arg-type]

    second = asyncio.create_task(conv.send("second", if_busy="queue"))
    idle = asyncio.create_task(conv.wait_idle())
    await asyncio.sleep(0)
    assert not second.done() and not idle.done()
    gate.release.set()
    await idle  # both sends: the queued one ran too
    assert second.done() and not conv.running

    one: RunResult = await first
    two: RunResult = await second
    assert one.text == "answer 1" and two.text == "answer 2"
    assert texts(gate.model.requests[1]) == ["user:first", "assistant:answer 1", "user:second"]


async def test_reset_is_refused_while_running_and_clears_when_idle() -> None:
    gate = Gate()
    conv = Agent(model=gate.model).conversation()
    task = asyncio.create_task(conv.send("q"))
    await gate.called.wait()
    with pytest.raises(ConversationBusy, match="cannot reset"):
        conv.reset()
    gate.release.set()
    await conv.wait_idle()
    await task
    conv.follow_up("pending")
    assert len(conv.messages) == 2 and conv.queued

    conv.reset()
    assert conv.messages == () and conv.queued == ()
    conv.follow_up("dropped")
    assert [m.text for m in conv.clear_queue()] == ["dropped"] and conv.queued == ()


class Boom(BaseException):
    """Not an ``Exception``: a tool's error result cannot hold it, so it ends the run."""


async def test_a_run_that_raises_leaves_no_tool_call_without_a_result() -> None:
    @tool
    async def fine() -> str:
        """Fine."""
        return "fine"

    @tool
    async def explode() -> str:
        """Explode."""
        raise Boom("kaput")

    model = ScriptedModel([Reply(tool_calls=[call("fine"), call("explode")]), "recovered"])
    conv = Agent(model=model, tools=[fine, explode]).conversation()
    with pytest.raises(Boom):
        await conv.send("go")

    assert not conv.running
    results = {m.tool_call_id: m for m in conv.messages if isinstance(m, ToolResultMessage)}
    calls = [c.id for m in conv.messages if isinstance(m, AssistantMessage) for c in m.tool_calls]
    assert sorted(results) == sorted(calls)  # every call answered
    assert results[calls[0]].text == "fine" and not results[calls[0]].is_error  # what finished is kept
    assert results[calls[1]].is_error and "run failed" in results[calls[1]].text
    assert conv.messages[-1].role == "system" and "kaput" in conv.messages[-1].text

    result = await conv.send("try again")
    assert result.text == "recovered"
    assert [m.role for m in model.requests[1].messages][-2:] == ["system", "user"]


async def test_input_a_failed_run_never_took_waits_for_the_next_send() -> None:
    calls = 0
    called, release = asyncio.Event(), asyncio.Event()

    async def answer(request: ModelRequest) -> str | Reply:
        nonlocal calls
        calls += 1
        if calls == 1:
            called.set()
            await release.wait()
            raise Boom("model bug")
        return "answered"

    conv = Agent(model=ScriptedModel(answer)).conversation()
    task = asyncio.create_task(conv.send("first"))
    await called.wait()
    conv.follow_up("not lost")
    release.set()
    with pytest.raises(Boom):
        await task
    assert [m.text for m in conv.queued] == ["not lost"]
    result = await conv.continue_()
    assert [m.text for m in result.new_messages] == ["not lost", "answered"]


async def test_stream_yields_what_agent_stream_does_and_subscribers_see_every_run() -> None:
    script = [Reply(tool_calls=[call("echo", text="x")]), "done"]

    @tool
    def echo(text: str) -> str:
        """Echo."""
        return text

    plain = [e.type async for e in Agent(model=ScriptedModel(list(script)), tools=[echo]).stream("go")]
    conv = Agent(model=ScriptedModel([*script, "again", "unheard"]), tools=[echo]).conversation()
    seen: list[LoopEvent] = []
    unsubscribe = conv.subscribe(seen.append)
    conv.subscribe(lambda event: 1 / 0)  # type: ignore[func-returns-value]  # a broken listener is ignored

    streamed = [e.type async for e in conv.stream("go")]
    assert streamed == plain and streamed[-1] == "agent_end"
    assert [e.type for e in seen] == streamed
    assert [m.role for m in conv.messages] == ["user", "assistant", "toolResult", "assistant"]

    seen.clear()
    result = await conv.send("more")  # a plain send tells its subscribers too
    assert result.text == "again" and seen[-1].type == "agent_end"
    unsubscribe()
    seen.clear()
    await conv.send("last")
    assert seen == []


async def test_leaving_a_stream_early_aborts_its_run_and_frees_the_conversation() -> None:
    gate = Gate()
    conv = Agent(model=gate.model).conversation()
    async for event in conv.stream("q"):
        if event.type == "agent_start":
            break
    await asyncio.wait_for(conv.wait_idle(), 5)
    last = conv.messages[-1]
    assert isinstance(last, AssistantMessage) and last.stop_reason == "aborted"


async def test_a_send_cancelled_from_outside_closes_its_tool_calls() -> None:
    @tool
    async def forever() -> str:
        """Never returns."""
        await asyncio.Event().wait()
        return "unreachable"

    model = ScriptedModel([Reply(tool_calls=[call("forever")]), "next"])
    conv = Agent(model=model, tools=[forever]).conversation()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(conv.send("go"), 0.05)

    assert not conv.running
    result = conv.messages[-1]
    assert isinstance(result, ToolResultMessage) and result.is_error and "cancelled" in result.text
    assert (await conv.send("hello?")).text == "next"
