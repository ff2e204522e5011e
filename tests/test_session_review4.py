"""Review of 145e52d..cbb8529: one regression test per problem found (each failed before its fix)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentloop.kernel import delegate
from tests import test_delegate as td

# ---------------------------------------------------------------- Delegate: a task that ran is "not run"


async def test_a_delegated_task_that_ran_is_not_reported_as_dropped_when_its_reply_is_slow(tmp_path, monkeypatch):
    """The target answered the delegated task; while the reply to the (non-waiting) caller is on
    its way, something that "may drop" queued input happens on the target (here the most ordinary:
    the target is busy with other work and a message is queued for it: ``proc.changed`` queue).
    ``Replies._deliver_dropped`` reads the log
    only *after* that signal, so it does not find the run's end (logged before), and since the
    task is neither queued nor current it claims the owed row first with NOT_RUN: the caller is
    told the task was never run, and never gets the real answer."""
    real = delegate.run_answer
    release = asyncio.Event()
    calls = 0

    async def slow_first(store: Any, pid: str, rid: str) -> str:
        nonlocal calls
        calls += 1
        if calls == 1:  # the delivery of the real end: slow (a loaded store)
            await release.wait()
        return await real(store, pid, rid)

    async def _reply_under_way() -> bool:
        return calls >= 1

    monkeypatch.setattr(delegate, "run_answer", slow_first)
    async with td._kernel(tmp_path) as k:
        source = await k.spawn(owner="alice")
        target = await k.spawn(owner="alice")
        await source.send(f"delegate {target.pid} nowait -: plain")
        await source.wait_idle()
        await target.wait_idle()  # the target ran the task and answered "did: plain"
        await td._until(_reply_under_way)
        assert [m.text for m in await target.messages()][-1] == "did: plain"
        await target.send("busy bz")  # other work after it answered
        await td._until(lambda: td._at_gate(target))
        await target.send("later", mode="queue")  # queued behind it: proc.changed ["queue"]
        await asyncio.sleep(0.2)
        release.set()
        await td._until(lambda: td._has_told(source))
        await source.wait_idle()
        told = await td._told(source)
        td.gate("bz").set()
        await target.wait_idle()
    assert len(told) == 1
    assert "did not run the task" not in told[0], told[0]
    assert "did: plain" in told[0]


# ------------------------------------------------ chat bridge: a failure between the steer and the denial


def fail_hil_once(monkeypatch: pytest.MonkeyPatch) -> list[Exception]:
    """``Process.hil`` fails once (the store locked for a moment), then works; the failure still
    to come, in a list that is empty once it came."""
    from agentloop.kernel.kernel import Process

    real_hil = Process.hil
    failures: list[Exception] = [RuntimeError("database is locked")]

    async def flaky_hil(self: Any, *a: Any, **kw: Any) -> Any:
        if failures:
            raise failures.pop()
        return await real_hil(self, *a, **kw)

    monkeypatch.setattr(Process, "hil", flaky_hil)
    return failures


async def test_a_message_typed_during_an_approval_still_declines_it_when_its_update_is_taken_again(
    tmp_path, monkeypatch
):
    """``ChatBridge._deliver`` admits the typed message as ``steer`` and only then denies the
    pending request. When the denial fails once (the store unreachable for a moment; or a crash
    there), Telegram's update is taken again (``TelegramBridge._take``: "its input is admitted
    once, by its run id"). But the message is admitted by then, so ``_deliver`` looks at no
    approval at all (``waiting = []``): the request stays pending for ever (no approval timeout
    by default) with the user's "no, keep it" stuck in the queue behind the question."""
    from tests import test_channel_telegram as tg

    tg.removed.clear()
    failures = fail_hil_once(monkeypatch)
    telegram = tg.FakeTelegram()
    with telegram.server:
        async with tg.running(tmp_path, telegram, allow=[tg.ALICE]) as (kernel, bridge, _):
            telegram.message(chat=tg.ALICE, user=tg.ALICE, text="delete")
            await tg.until(lambda: [p for p in telegram.sent(chat=tg.ALICE) if "reply_markup" in p])
            typed = telegram.message(chat=tg.ALICE, user=tg.ALICE, text="no, keep it")
            await tg.until(lambda: bridge.state.offset == typed + 1)  # taken (again) and confirmed
            [proc] = await kernel.processes()
            process = await kernel.process(proc.pid)
            await asyncio.sleep(0.5)
            pending = await process.pending_approvals()
            queued = await process.queued()
    assert not failures  # the denial did fail once
    assert tg.removed == []
    assert pending == [] and queued == [], "the refusal was admitted, but the request it declines still waits"


# ---------------------------------------------------------------- outage retries: an event that joins the run waits


async def test_an_event_that_joins_a_run_waiting_out_an_outage_tries_at_once(tmp_path):
    """``_defer``: "Input that joins the run calls the model at once". A message does
    (``admission.send`` wakes the driver for a run with ``retry_at``), but a system event
    (POST …/events, a webhook, a Delegate reply, a watch) is queued as ``system`` input that
    joins the active run, and ``admission.signal_event`` only wakes an idle process: the run
    sleeps through the whole planned delay (here 60 s; up to a day per step) with it."""
    from tests import test_outage_retry as to
    from tests.process_support import kernel

    script = to.Replies(to.OUT)
    async with kernel(tmp_path, script.model, retry=to.NO_RETRY, outage_retries=[60]) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("hello")
        async with asyncio.timeout(5):
            while not await to.deferrals(proc):
                await asyncio.sleep(0.02)
        receipt = await k.signal(proc.pid, "the build finished")
        assert receipt.queued  # it joins the waiting run
        try:
            async with asyncio.timeout(3):
                await proc.wait_idle()
        except TimeoutError:
            pytest.fail("the event joined the waiting run, but the model was not called until the plan's 60 s")
