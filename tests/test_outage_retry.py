"""A model that is out (Pioneer's deferred recovery): with ``Kernel.open(outage_retries=...)`` a
durable run whose model call still fails after the call's own retries and fallbacks, in a way that
may pass (rate limit, 5xx, connection), waits and tries again instead of ending with an error. The
plan is kept in the run's record, so a restart keeps to it; input that joins the run tries at once;
an abort ends it; a failure that will not pass, or the plan spent, ends the run as before."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from agentloop import ScriptedModel, UserMessage
from agentloop.messages import AssistantMessage
from agentloop.models.base import ModelRequest, ProviderError
from agentloop.models.retry import NO_RETRY
from agentloop.process import signals as sig
from tests.process_support import kernel

OUT = ProviderError("overloaded", kind="rate_limit")


class Replies:
    """The model's replies in order (a ``ProviderError`` is a failed call); once they are spent,
    the user messages it saw. ``more`` adds replies later."""

    def __init__(self, *items: Any) -> None:
        self.items = list(items)
        self.model = ScriptedModel(self.brain)

    def brain(self, request: ModelRequest) -> Any:
        if self.items:
            item = self.items.pop(0)
            if isinstance(item, ProviderError):
                raise item
            return item
        return "seen: " + ", ".join(m.text for m in request.messages if isinstance(m, UserMessage))


def replies(*items: Any) -> ScriptedModel:
    return Replies(*items).model


async def logged(proc: Any, name: str) -> list[dict[str, Any]]:
    rows = await proc.kernel.store.events(proc.pid)
    return [r.payload for r in rows if r.signal == name]


async def finished(proc: Any) -> list[dict[str, Any]]:
    return await logged(proc, sig.RUN_FINISHED)


async def deferrals(proc: Any) -> list[dict[str, Any]]:
    return [p for p in await logged(proc, sig.RUN_RETRYING) if p.get("deferred")]


async def test_a_run_waits_out_an_outage_and_answers(tmp_path: Path) -> None:
    model = replies(OUT, OUT, "back")
    async with kernel(tmp_path, model, retry=NO_RETRY, outage_retries=[0.2, 0.3, 5]) as k:
        proc = await k.spawn(owner="alice")
        started = time.monotonic()
        await proc.send("hello")
        async with asyncio.timeout(5):
            await proc.wait_idle()
        took = time.monotonic() - started
        msgs = await proc.messages()
        waits = await deferrals(proc)
        [end] = await finished(proc)
        record = await k.store.get_process(proc.pid)
    assert took >= 0.5  # it waited as planned (0.2 s, then 0.3 s)
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[-1].text == "back"  # no error kept
    assert [(w["attempt"], w["delay"]) for w in waits] == [(1, 0.2), (2, 0.3)]
    assert all(w["reason"] and w["at"] > 0 for w in waits)
    assert end["status"] == "ok"
    assert record is not None and record.current_run is None


async def test_the_plan_spent_or_a_failure_that_will_not_pass_ends_the_run(tmp_path: Path) -> None:
    script = Replies(OUT, OUT)
    async with kernel(tmp_path, script.model, retry=NO_RETRY, outage_retries=[0.1]) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("hello")
        async with asyncio.timeout(5):
            await proc.wait_idle()
        assert len(await deferrals(proc)) == 1
        assert [e["status"] for e in await finished(proc)] == ["error"]
        msgs = await proc.messages()
        assert [m.role for m in msgs] == ["user", "assistant", "system"] and "overloaded" in msgs[-1].text
        assert isinstance(msgs[1], AssistantMessage) and msgs[1].stop_reason == "error"  # once: the last try's
        # a refusal is not an outage: no wait
        bad = await k.spawn(owner="alice")
        script.items.append(ProviderError("bad key", kind="auth"))
        await bad.send("hello")
        async with asyncio.timeout(5):
            await bad.wait_idle()
        assert await deferrals(bad) == []
        assert [e["status"] for e in await finished(bad)] == ["error"]


async def test_a_restart_keeps_to_the_plan(tmp_path: Path) -> None:
    async with kernel(tmp_path, replies(OUT), retry=NO_RETRY, outage_retries=[1.0]) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("hello")
        async with asyncio.timeout(5):
            while not await deferrals(proc):
                await asyncio.sleep(0.02)
        [wait] = await deferrals(proc)
    # the kernel stopped while the run waited; the next one calls the model when the plan says
    model = replies("back")
    async with kernel(tmp_path, model, retry=NO_RETRY, outage_retries=[1.0]) as k:
        proc = await k.process(proc.pid)
        assert (await proc.info()).current_run is not None
        async with asyncio.timeout(5):
            await proc.wait_idle()
        answered = time.time()
        msgs = await proc.messages()
        ends = await finished(proc)
    assert answered >= wait["at"]  # not before the time it had planned
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[-1].text == "back"
    assert [e["status"] for e in ends] == ["ok"]


async def test_input_tries_at_once_and_an_abort_ends_the_wait(tmp_path: Path) -> None:
    script = Replies(OUT)
    async with kernel(tmp_path, script.model, retry=NO_RETRY, outage_retries=[60]) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("hello")
        async with asyncio.timeout(5):
            while not await deferrals(proc):
                await asyncio.sleep(0.02)
        receipt = await proc.send("still there?", mode="steer")
        async with asyncio.timeout(5):
            await proc.wait_idle()
        msgs = await proc.messages()
        assert receipt.queued and msgs[-1].text == "seen: hello, still there?"
        assert [e["status"] for e in await finished(proc)] == ["ok"]
        assert k.engine.cached(proc.pid).retry_timer is None  # (the run ended: nothing left to wake it for)

        script.items.append(OUT)
        await proc.send("again")
        async with asyncio.timeout(5):
            while len(await deferrals(proc)) < 2:
                await asyncio.sleep(0.02)
        assert await proc.abort()
        async with asyncio.timeout(5):
            await proc.wait_idle()
        assert [e["status"] for e in await finished(proc)] == ["ok", "aborted"]
        assert k.engine.cached(proc.pid).retry_timer is None


@pytest.mark.parametrize("plan", ["30", [0], [-1], [float("nan")], [True], [1e9], [1] * 21, None])
async def test_a_bad_plan_is_refused(tmp_path: Path, plan: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="outage_retries"):
        async with kernel(tmp_path, ScriptedModel("x"), outage_retries=plan):
            pass
