"""KeyedLocks (process/keylock.py): one lock per key while it is in use, and none after."""

from __future__ import annotations

import asyncio

from agentloop.process.keylock import KeyedLocks


async def test_holders_of_one_key_take_turns_and_the_last_one_out_removes_it() -> None:
    locks = KeyedLocks()
    inside: list[str] = []
    log: list[str] = []
    first_in = asyncio.Event()
    release_first = asyncio.Event()

    async def hold(name: str, key: str, gate: asyncio.Event | None = None) -> None:
        async with locks.hold(key):
            inside.append(name)
            assert len([n for n in inside if n.startswith(key)]) == 1, inside  # alone with its key
            log.append(name)
            if gate is not None:
                first_in.set()
                await gate.wait()
            await asyncio.sleep(0)
            inside.remove(name)

    first = asyncio.create_task(hold("k1-first", "k1", release_first))
    await first_in.wait()
    waiter = asyncio.create_task(hold("k1-waiter", "k1"))
    other = asyncio.create_task(hold("k2-other", "k2"))  # another key does not wait
    await other
    assert "k1" in locks and "k2" not in locks
    release_first.set()
    await asyncio.sleep(0)  # the first is out; the waiter is woken but not yet running …
    late = asyncio.create_task(hold("k1-late", "k1"))  # … and a newcomer must queue on the same lock
    await asyncio.gather(first, waiter, late)
    assert log == ["k1-first", "k2-other", "k1-waiter", "k1-late"] or log == [
        "k1-first",
        "k2-other",
        "k1-late",
        "k1-waiter",
    ]
    assert len(locks) == 0


async def test_a_holder_that_fails_still_lets_go() -> None:
    locks = KeyedLocks()
    try:
        async with locks.hold("k"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert len(locks) == 0
    async with locks.hold("k"):
        assert "k" in locks
