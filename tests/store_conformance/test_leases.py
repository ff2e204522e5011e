"""The lease contract (DESIGN §6), on every store: a claim excludes other owners until it expires
or is released; each claim's epoch is larger than the last; a fence fails for a superseded claim;
the sweep finds processes with work and no live lease, and only those."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from agentloop.messages import user
from agentloop.process.store import Store
from tests.store_conformance.test_conformance import spawn


async def test_a_claim_excludes_other_owners_until_released(store: Store) -> None:
    await spawn(store)
    assert await store.lease("p1") is None
    first = await store.claim_lease("p1", "w1", 30)
    assert first == 1
    assert await store.claim_lease("p1", "w2", 30) is None  # held by w1
    lease = await store.lease("p1")
    assert lease is not None and (lease.owner, lease.epoch) == ("w1", 1)
    assert not await store.release_lease("p1", "w2", 1)  # not w2's
    assert not await store.release_lease("p1", "w1", 7)  # not this claim
    assert await store.release_lease("p1", "w1", 1)
    assert await store.claim_lease("p1", "w2", 30) == 2  # free: w2 takes it, epoch goes on
    assert await store.claim_lease("p1", "w2", 30) == 3  # its owner may claim again (a restarted worker)


async def test_an_expired_lease_is_taken_over_and_fences_its_old_owner(store: Store) -> None:
    await spawn(store)
    old = await store.claim_lease("p1", "w1", 0.05)
    assert old == 1
    async with store.transaction():
        assert await store.fence("p1", "w1", 1, 0.05)  # held, and extended by 0.05 s
    await asyncio.sleep(0.12)
    new = await store.claim_lease("p1", "w2", 30)
    assert new == 2
    async with store.transaction():  # the old owner's step: its commit is refused
        assert not await store.fence("p1", "w1", 1, 30)
        assert await store.fence("p1", "w2", 2, 30)
    assert await store.renew_leases("w1", 30) == {}  # w1 learns it holds nothing
    assert await store.renew_leases("w2", 30) == {"p1": 2}


async def test_renewal_keeps_a_lease_alive(store: Store) -> None:
    await spawn(store)
    await spawn(store, "p2")
    await store.claim_lease("p1", "w1", 0.3)
    await store.claim_lease("p2", "w1", 0.3)
    for _ in range(3):
        await asyncio.sleep(0.15)
        assert await store.renew_leases("w1", 0.3) == {"p1": 1, "p2": 1}
    assert await store.claim_lease("p1", "w2", 30) is None


async def test_the_sweep_claims_processes_with_work_and_no_live_lease(store: Store) -> None:
    for pid in ("idle", "running", "queued", "held", "dead", "killed"):
        await spawn(store, pid)
    async with store.transaction():
        for pid in ("running", "held", "dead"):
            await store.update_process(pid, state="running", current_run={"run_id": "r-" + pid, "generation": 0})
        await store.enqueue("queued", "queue", user("later"))
        await store.update_process("killed", state="killed", current_run={"run_id": "r-k", "generation": 0})
    await store.claim_lease("held", "w1", 30)
    await store.claim_lease("dead", "w0", 0.01)  # its worker died: the lease runs out
    await asyncio.sleep(0.05)
    claimed = dict(await store.claim_orphans("w2", 30))
    assert claimed == {"running": 1, "queued": 1, "dead": 2}
    assert await store.claim_orphans("w3", 30) == []  # all live now
    assert dict(await store.claim_orphans("w1", 30)) == {}  # w1 holds "held": not an orphan …
    assert dict(await store.claim_orphans("w1", 30, reclaim=True)) == {"held": 2}  # … unless w1 restarted
    lease = await store.lease("dead")
    assert lease is not None and lease.owner == "w2"


async def test_two_sweepers_never_claim_the_same_process(make_store: Callable[[], Store]) -> None:
    a, b = make_store(), make_store()
    await a.open()
    await b.open()
    try:
        for i in range(20):
            await spawn(a, f"p{i:02}")
            async with a.transaction():
                await a.enqueue(f"p{i:02}", "queue", user("work"))
        got_a, got_b = await asyncio.gather(a.claim_orphans("wa", 30, 15), b.claim_orphans("wb", 30, 15))
        pids_a, pids_b = {p for p, _ in got_a}, {p for p, _ in got_b}
        assert not pids_a & pids_b
        rest = {p for p, _ in await a.claim_orphans("wa", 30)}
        assert pids_a | pids_b | rest == {f"p{i:02}" for i in range(20)}
    finally:
        await a.close()
        await b.close()


async def test_deleting_a_process_drops_its_lease(store: Store) -> None:
    await spawn(store)
    await store.claim_lease("p1", "w1", 30)
    async with store.transaction():
        await store.delete_process("p1")
    assert await store.lease("p1") is None
    async with store.transaction():  # its holder's next step is refused
        assert not await store.fence("p1", "w1", 1, 30)
