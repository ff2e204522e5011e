"""A watcher resuming after a seq the log no longer reaches back to (pruned as runs ended, or
dropped by a reset) is told so first, with an unlogged ``proc.log.pruned``: how many signals it
missed and where the log now starts, so it knows to read the history rather than trust its view."""

from __future__ import annotations

from pathlib import Path

import httpx

from agentloop import ScriptedModel
from agentloop.kernel.kernel import Process
from agentloop.process import signals as sig
from agentloop.process.signals import Signal
from tests.process_support import kernel
from tests.server_support import live_server, parse_sse, wait_idle


async def _drain(proc: Process, after: int = 0) -> list[Signal]:
    return [s async for s in proc.signals(after_seq=after, follow=False)]


async def _prune(proc: Process, through: int) -> None:
    store = proc.kernel.store
    async with store.transaction():
        await store.prune_events(proc.pid, through=through)


async def test_a_resume_before_the_oldest_kept_signal_is_told_how_many_it_missed(tmp_path: Path) -> None:
    async with kernel(tmp_path, ScriptedModel(lambda request: "seen")) as k:
        proc = await k.spawn(owner="alice")
        for n in range(3):
            await proc.send(f"message {n}")
            await proc.wait_idle()
        whole = await _drain(proc)
        assert all(s.signal != sig.LOG_PRUNED for s in await _drain(proc, after=2))  # nothing missing yet
        await _prune(proc, through=6)
        resumed = await _drain(proc, after=2)
        from_start = await _drain(proc)
        at_edge = await _drain(proc, after=6)
    marker, rest = resumed[0], resumed[1:]
    assert marker.signal == sig.LOG_PRUNED and marker.seq is None  # not logged: no seq to resume from
    assert marker.payload == {"pid": proc.pid, "afterSeq": 2, "oldestSeq": 7, "missed": 4}
    assert rest == whole[6:]
    assert from_start == whole[6:]  # reading from the start asks for what is kept: nothing to report
    assert at_edge == whole[6:]  # nothing missed


async def test_a_follower_resuming_across_a_reset_is_told_and_then_follows_live(tmp_path: Path) -> None:
    async with kernel(tmp_path, ScriptedModel(lambda request: "seen")) as k:
        proc = await k.spawn(owner="alice", text="first conversation")
        await proc.wait_idle()
        seen = (await _drain(proc))[1].seq  # a client that saw two signals, then went away
        assert seen is not None
        await proc.reset()  # the old conversation's log goes with it
        stream = proc.signals(after_seq=seen, follow=True)
        got = [await anext(stream), await anext(stream)]
        await proc.send("second conversation")
        live = [await anext(stream)]
        await stream.aclose()
    assert got[0].signal == sig.LOG_PRUNED and got[0].payload["afterSeq"] == seen
    assert got[0].payload["missed"] == got[0].payload["oldestSeq"] - seen - 1 > 0
    assert got[1].signal == sig.CHANGED and got[1].payload["changes"] == ["messages", "reset"]
    assert live[0].signal == sig.RUN_STARTED


async def test_the_event_stream_sends_the_marker_without_an_id(tmp_path: Path) -> None:
    with live_server(tmp_path) as server:
        async with server.client(server.tokens.alice) as alice:
            pid = (await alice.post("/v1/processes", json={"text": "hello"})).json()["pid"]
            await wait_idle(alice, pid)
            assert server.ctx is not None
            kernel = server.ctx.kernel

            async def prune() -> None:
                async with kernel.store.transaction():
                    await kernel.store.prune_events(pid, through=3)

            await server.run(prune)
            resp = await alice.get(f"/v1/processes/{pid}/events", params={"follow": "false", "after_seq": 1})
            frames = parse_sse(resp.text)
            resumed = parse_sse(
                (
                    await alice.get(
                        f"/v1/processes/{pid}/events", params={"follow": "false"}, headers={"Last-Event-ID": "2"}
                    )
                ).text
            )
    assert isinstance(resp, httpx.Response) and resp.status_code == 200
    assert frames[0]["event"] == sig.LOG_PRUNED and "id" not in frames[0]
    assert frames[0]["data"]["payload"]["missed"] == 2 and frames[0]["data"]["seq"] is None
    assert frames[1]["id"] == "4"
    assert resumed[0]["event"] == sig.LOG_PRUNED and resumed[1]["id"] == "4"
