"""The stream-delta relay between workers (process/relay.py), on its own: what the holder sends,
when, and for which processes, and where a receiving worker puts relayed deltas among the
logged signals."""

from __future__ import annotations

import asyncio
from typing import Any

from agentloop.process.relay import Relay
from agentloop.process.signals import RUN_STREAM, Signal
from agentloop.process.store import RelayBatch, StoreError


class Wire:
    """Stands in for the store's cross-worker channel: records what was relayed."""

    def __init__(self, fail: bool = False, round_trips: tuple[float, ...] = ()) -> None:
        self.sent: list[tuple[str, list[RelayBatch]]] = []
        self.announced: list[list[str]] = []
        self.fail = fail
        self.round_trips = list(round_trips)

    async def relay(self, sender: str, batches: list[RelayBatch]) -> None:
        if self.fail:
            raise StoreError("the database is away")
        await asyncio.sleep(self.round_trips.pop(0) if self.round_trips else 0.01)
        self.sent.append((sender, [(pid, base, list(payloads)) for pid, base, payloads in batches]))

    async def follow_live(self, sender: str, pids: list[str]) -> None:
        if self.fail:
            raise StoreError("the database is away")
        self.announced.append(pids)


def relay_on(wire: Wire, *, interval: float = 0.05, interest_ttl: float = 10.0) -> Relay:
    return Relay(wire, "A", interval=interval, interest_ttl=interest_ttl)  # type: ignore[arg-type]


def delta(text: str) -> dict[str, Any]:
    return {"event": "text_delta", "delta": text}


def logged(seq: int) -> Signal:
    return Signal("proc.changed", {"n": seq}, seq)


def texts(wire: Wire) -> list[str]:
    return [p["delta"] for _, batches in wire.sent for *_, payloads in batches for p in payloads]


async def test_deltas_go_out_together_after_the_interval_by_process_and_base() -> None:
    wire = Wire()
    relay = relay_on(wire)
    relay.followed("B", ["p1", "p2"])
    for text in ("a", "b", "c"):
        relay.send("p1", 4, delta(text))
    relay.send("p1", 5, delta("d"))  # a commit in between: a new base
    relay.send("p2", 1, delta("x"))
    assert wire.sent == []  # nothing before the interval
    await asyncio.sleep(0.15)
    assert wire.sent == [  # one message for all of them
        ("A", [("p1", 4, [delta("a"), delta("b"), delta("c")]), ("p1", 5, [delta("d")]), ("p2", 1, [delta("x")])])
    ]
    await relay.stop()


async def test_only_processes_followed_elsewhere_are_relayed_while_the_interest_lasts() -> None:
    wire = Wire()
    relay = relay_on(wire, interval=0.01, interest_ttl=0.1)
    relay.followed("A", ["p1"])  # this worker's own announcement does not count
    relay.send("p1", 1, delta("nobody"))
    relay.followed("B", ["p1"])
    relay.send("p1", 1, delta("seen"))
    relay.send("p2", 1, delta("not followed"))
    await asyncio.sleep(0.05)
    assert texts(wire) == ["seen"]
    await asyncio.sleep(0.1)  # no announcement since: the watchers are gone
    assert not relay.wanted("p1")
    relay.send("p1", 1, delta("late"))
    await asyncio.sleep(0.05)
    assert texts(wire) == ["seen"]
    await relay.stop()


async def test_a_flush_sends_at_once_and_waits_for_a_send_under_way() -> None:
    wire = Wire(round_trips=(0.05, 0.01))
    relay = relay_on(wire, interval=0.01)
    relay.followed("B", ["p1"])
    relay.send("p1", 1, delta("early"))
    await asyncio.sleep(0.02)  # the timed send has begun (its round trip takes 50 ms)
    relay.send("p1", 1, delta("late"))
    await relay.flush("p1")  # before a commit: everything made so far has gone out
    assert texts(wire) == ["early", "late"]
    await relay.stop()


async def test_deltas_made_during_a_send_go_out_without_another_delta() -> None:
    wire = Wire(round_trips=(0.05,))
    relay = relay_on(wire, interval=0.01)
    relay.followed("B", ["p1"])
    relay.send("p1", 1, delta("first"))
    await asyncio.sleep(0.02)  # the first send is under way
    relay.send("p1", 1, delta("second"))  # and then the stream pauses
    await asyncio.sleep(0.1)
    assert texts(wire) == ["first", "second"]
    await relay.stop()


async def test_a_relay_that_fails_costs_only_the_deltas() -> None:
    wire = Wire(fail=True)
    relay = relay_on(wire, interval=0.01)
    relay.followed("B", ["p1"])
    relay.send("p1", 1, delta("lost"))
    await relay.flush("p1")  # no error: the run goes on
    await relay.announce(["p9"])  # nor here
    await asyncio.sleep(0.03)
    await relay.stop()


async def test_received_batches_take_their_place_among_the_logged_signals() -> None:
    relay = relay_on(Wire())
    relay.received("p1", 3, [delta("stale")])  # made before signal 4, which was published
    relay.received("p1", 4, [delta("a")])
    relay.received("p1", 5, [delta("b")])
    relay.received("p1", 9, [delta("later")])  # its commit (9) is not read yet
    out: list[Signal] = []
    relay.merge("p1", 4, [logged(5), logged(6), logged(7)], out.append)
    assert [s.payload.get("delta") or s.seq for s in out] == ["a", 5, "b", 6, 7]
    assert all(s.signal == RUN_STREAM for s in out if s.seq is None)
    out.clear()
    assert relay.waiting("p1")
    relay.merge("p1", 7, [logged(8), logged(9)], out.append)
    assert [s.payload.get("delta") or s.seq for s in out] == [8, 9, "later"]
    out.clear()
    relay.received("p1", 9, [delta("x")])
    relay.forget("p1")  # nobody watches any more
    relay.merge("p1", 9, [], out.append)
    assert out == [] and not relay.waiting("p1")
