"""The stream-delta relay between workers (process/relay.py), on its own: what the holder sends
and when, and where a receiving worker puts relayed deltas among the logged signals."""

from __future__ import annotations

import asyncio
from typing import Any

from agentloop.process.relay import Relay
from agentloop.process.signals import RUN_STREAM, Signal
from agentloop.process.store import StoreError


class Wire:
    """Stands in for the store's cross-worker channel: records what was relayed."""

    def __init__(self, fail: bool = False, round_trips: tuple[float, ...] = ()) -> None:
        self.sent: list[tuple[str, str, int, list[dict[str, Any]]]] = []
        self.fail = fail
        self.round_trips = list(round_trips)

    async def relay(self, sender: str, pid: str, base: int, payloads: list[dict[str, Any]]) -> None:
        if self.fail:
            raise StoreError("the database is away")
        await asyncio.sleep(self.round_trips.pop(0) if self.round_trips else 0.01)
        self.sent.append((sender, pid, base, list(payloads)))


def delta(text: str) -> dict[str, Any]:
    return {"event": "text_delta", "delta": text}


def logged(seq: int) -> Signal:
    return Signal("proc.changed", {"n": seq}, seq)


async def test_deltas_go_out_in_batches_by_base_after_the_interval() -> None:
    wire = Wire()
    relay = Relay(wire, "A", interval=0.05)  # type: ignore[arg-type]
    for text in ("a", "b", "c"):
        relay.send("p1", 4, delta(text))
    relay.send("p1", 5, delta("d"))  # a commit in between: a new base
    relay.send("p2", 1, delta("x"))
    assert wire.sent == []  # nothing before the interval
    await asyncio.sleep(0.15)
    assert wire.sent == [
        ("A", "p1", 4, [delta("a"), delta("b"), delta("c")]),
        ("A", "p1", 5, [delta("d")]),
        ("A", "p2", 1, [delta("x")]),
    ]
    await relay.stop()


async def test_a_flush_sends_at_once_and_waits_for_a_send_under_way() -> None:
    wire = Wire(round_trips=(0.05, 0.01))
    relay = Relay(wire, "A", interval=0.01)  # type: ignore[arg-type]
    relay.send("p1", 1, delta("early"))
    await asyncio.sleep(0.02)  # the timed send has begun (its round trip takes 50 ms)
    relay.send("p1", 1, delta("late"))
    await relay.flush("p1")  # before a commit: everything made so far has gone out
    assert [p for *_, payloads in wire.sent for p in payloads] == [delta("early"), delta("late")]
    await relay.stop()


async def test_a_relay_that_fails_costs_only_the_deltas() -> None:
    relay = Relay(Wire(fail=True), "A", interval=0.01)  # type: ignore[arg-type]
    relay.send("p1", 1, delta("lost"))
    await relay.flush("p1")  # no error: the run goes on
    await asyncio.sleep(0.03)
    await relay.stop()


async def test_received_batches_take_their_place_among_the_logged_signals() -> None:
    relay = Relay(Wire(), "B")  # type: ignore[arg-type]
    assert not relay.received("p1", "B", 9, [delta("mine")])  # this worker's own: ignored
    assert relay.received("p1", "A", 3, [delta("stale")])  # made before signal 4, which was published
    assert relay.received("p1", "A", 4, [delta("a")])
    assert relay.received("p1", "A", 5, [delta("b")])
    assert relay.received("p1", "A", 9, [delta("later")])  # its commit (9) is not read yet
    out: list[Signal] = []
    relay.merge("p1", 4, [logged(5), logged(6), logged(7)], out.append)
    shown = [s.payload.get("delta") or s.seq for s in out]
    assert shown == ["a", 5, "b", 6, 7]
    assert all(s.signal == RUN_STREAM and s.seq is None for s in out if s.seq is None)
    out.clear()
    relay.merge("p1", 7, [logged(8), logged(9)], out.append)
    assert [s.payload.get("delta") or s.seq for s in out] == [8, 9, "later"]
    out.clear()
    relay.received("p1", "A", 9, [delta("x")])
    relay.forget("p1")  # nobody watches any more
    relay.merge("p1", 9, [], out.append)
    assert out == []
