"""``Store.account_hils``: the pending approvals of every live process of one owner, in one query
(the inbox of ``GET /v1/approvals``), on every store."""

from __future__ import annotations

from agentloop.process.store import HilRow, Store
from tests.store_conformance.test_conformance import spawn


def request(request_id: str, pid: str) -> HilRow:
    return HilRow(request_id, pid, "r1", f"d-{request_id}", "c1", "Shell", "shell.exec", {"n": request_id}, "fp")


async def test_the_pending_approvals_of_an_owners_processes(store: Store) -> None:
    await spawn(store, "a1", owner="alice")
    await spawn(store, "a2", owner="alice")
    await spawn(store, "a3", owner="alice")
    await spawn(store, "b1", owner="bob")
    for request_id, pid in (("h1", "a2"), ("h2", "a1"), ("h3", "b1"), ("h4", "a2"), ("h5", "a3")):
        async with store.transaction():
            await store.put_hil(request(request_id, pid))
    async with store.transaction():
        await store.update_process("a3", state="killed")  # (on its way out: not the owner's to answer)

    mine = await store.account_hils("alice")
    assert [(h.request_id, h.pid) for h in mine] == [("h1", "a2"), ("h2", "a1"), ("h4", "a2")]  # oldest first
    assert mine[0] == (await store.hils("a2"))[0]  # the whole row, as ``hils`` reads it
    assert [h.request_id for h in await store.account_hils("bob")] == ["h3"]
    assert await store.account_hils("carol") == []

    async with store.transaction():
        assert await store.delete_hil("h1")
        await store.delete_process("a1")
    assert [h.request_id for h in await store.account_hils("alice")] == ["h4"]
