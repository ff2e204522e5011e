"""Guarantees that had no test that would fail if they broke: a key provider's answer is sent
without the whitespace around it, ``KeySource`` keeps its copied SDK client while the key is the
same, the client's ``account_events(after_seq=...)`` resumes from that seq over a real server, and
a library follower of a process on the worker running it (``Process.signals`` on a shared
PostgreSQL) gets the signals the other worker logged for it, with no seq skipped."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from agentloop import ScriptedModel
from agentloop.client import AccountEvent, AgentloopClient
from agentloop.events import StreamDone, StreamEvent
from agentloop.messages import user
from agentloop.models.base import KeySource, ModelRequest
from agentloop.models.openai_chat import OpenAIChatModel
from agentloop.process import signals as sig
from agentloop.process.signals import Signal
from tests import server_support
from tests.fakes import openai_server as oai
from tests.server_support import LiveServer, live_server, wait_until

# ------------------------------------------------------------------ key providers


async def test_a_key_provider_answer_is_sent_without_the_whitespace_around_it() -> None:
    """A key read from a file ends in a newline; sent as is it is no valid header (the call fails
    before it leaves), and spaces around it would be a wrong key the provider refuses."""
    with oai.OpenAIFake() as fake:
        fake.push(oai.text_reply("fine"))
        sdk = AsyncOpenAI(api_key="placeholder", base_url=fake.base_url, max_retries=0)  # (closed here, not by GC)
        model = OpenAIChatModel("gpt-4o-mini", api_key=lambda: "  sk-from-a-file\n", client=sdk)
        request = ModelRequest(system_prompt="", messages=[user("hi")])
        try:
            events: list[StreamEvent] = [e async for e in model.stream(request)]
        finally:
            await sdk.close()
    assert isinstance(events[-1], StreamDone), events[-1]
    assert [h["authorization"] for h in fake.headers] == ["Bearer sk-from-a-file"]


async def test_the_copied_sdk_client_is_kept_while_the_key_is_the_same() -> None:
    """A copy per call would build a client (its headers, its options) for every model call of a
    provider that answers the same cached token for an hour; a copy kept past a new key would
    send the expired one."""
    keys = KeySource(None, lambda: "unused", "OpenAI")
    base = AsyncOpenAI(api_key="placeholder", base_url="http://127.0.0.1:9/v1")
    other_base = AsyncOpenAI(api_key="placeholder", base_url="http://127.0.0.1:9/v1")
    try:
        first = keys.client_for(base, "key-one")
        assert first is not base and first.api_key == "key-one"
        assert keys.client_for(base, "key-one") is first  # the same key: the same copy
        renewed = keys.client_for(base, "key-two")
        assert renewed is not first and renewed.api_key == "key-two"
        assert keys.client_for(base, "key-two") is renewed
        moved = keys.client_for(other_base, "key-two")  # another base client: a copy of that one
        assert moved is not renewed and moved.base_url == other_base.base_url and moved.api_key == "key-two"
        assert KeySource("fixed-key", None, "OpenAI").client_for(base, "fixed-key") is base
    finally:
        await base.close()
        await other_base.close()


# ------------------------------------------------------------------ the client's account stream


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("guarantees10")) as srv:
        yield srv


alice = server_support.alice


async def test_the_client_account_stream_resumes_after_the_given_seq(
    server: LiveServer, alice: httpx.AsyncClient
) -> None:
    """Runs that ended while nobody watched come first, from the seq after ``after_seq``, none of
    those before it; then live ones."""
    assert server.ctx is not None
    kernel = server.ctx.kernel
    start = await server.run(lambda: kernel.account_seq("alice"))
    pid: str = (await alice.post("/v1/processes", json={})).json()["pid"]

    async def finish(text: str) -> None:
        assert (await alice.post(f"/v1/processes/{pid}/messages", json={"text": text})).status_code == 202

        async def logged() -> bool:
            return await server.run(lambda: kernel.account_seq("alice")) > seen[0]

        await wait_until(logged)
        seen[0] = await server.run(lambda: kernel.account_seq("alice"))

    seen = [start]
    for text in ("one", "two", "three"):
        await finish(text)
    assert seen[0] == start + 3
    async with AgentloopClient(server.url, server.tokens.alice) as client:
        stream = client.account_events(after_seq=start + 1)

        async def logged_events(n: int) -> list[AccountEvent]:
            """The next ``n`` events with an account seq (a new title is live only, without one)."""
            events: list[AccountEvent] = []
            while len(events) < n:
                event = await anext(stream)
                if event.id is not None:
                    events.append(event)
            return events

        try:
            async with asyncio.timeout(10):
                got = await logged_events(2)
                live = asyncio.ensure_future(logged_events(1))
                await finish("four")
                got += await live
        finally:
            await stream.aclose()
    assert [e.id for e in got] == [start + 2, start + 3, start + 4], got
    assert {(e.pid, e.signal) for e in got} == {(pid, sig.RUN_FINISHED)}


# ------------------------------------------------------------------ two workers, one PostgreSQL


def answer(request: ModelRequest) -> str:
    return "ok"


async def test_a_library_follower_on_the_holder_gets_what_the_other_worker_logged(pg_url: str, tmp_path: Path) -> None:
    """A message sent through B for a process A runs is logged by B (its queue change) and reaches
    A's watchers through the log only: ``Process.signals`` on A skipped its seq, and every library
    follower (a channel bridge, a delegate waiting on a subagent, ``agentloop chat``) with it."""
    pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")
    from tests.test_scale_out import kept_by, two

    async with two(pg_url, tmp_path, ScriptedModel(answer), []) as (a, b):
        on_a = await a.spawn(owner="alice")
        await kept_by(a, on_a.pid)
        stream = on_a.signals(follow=True)
        got: list[Signal] = []

        async def until_finished() -> None:
            async for signal in stream:
                got.append(signal)
                if signal.signal == sig.RUN_FINISHED:
                    return

        reading = asyncio.ensure_future(until_finished())
        await wait_until(lambda: a.engine.hub.watching(on_a.pid))  # (sent before, it would be read from the log)
        await (await b.process(on_a.pid)).send("through B")
        try:
            await asyncio.wait_for(reading, 10)
        finally:
            await stream.aclose()
        seqs = [s.seq for s in got if s.seq is not None]
        logged = [row.seq for row in await a.store.events(on_a.pid)]
        assert seqs == list(range(1, seqs[-1] + 1)) and seqs == logged[: len(seqs)]
