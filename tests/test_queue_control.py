"""Seeing and withdrawing the input that waits in a process's queue: ``Process.queued`` and
``Process.withdraw``, their HTTP routes, WebSocket calls, client methods and the chat's ``/queue``.

A withdrawn item must never run, and an item a run took must never be reported withdrawn: the
race tests put a withdraw between a reader's look at the queue and its claim of an item (the
promotion that starts the next run, the model turn that injects steer input), where a stale read
would otherwise run what was withdrawn or leave the rest of the queue stranded.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Kernel, NoSuchProcess, Process
from agentloop.messages import ImageContent, SystemMessage, UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process import admission
from agentloop.process import driver as driver_module
from agentloop.process import signals as sig
from agentloop.process.store import QueueItem
from agentloop.server import api
from tests import server_support
from tests.server_support import LiveServer, checked, refused, slow, wait_until
from tests.ws_support import KernelServer

PNG = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
    )
).decode()


# ---------------------------------------------------------------------------------- support


class Gated:
    """A model whose answer to a user message starting with "hold" waits for ``gate``; "tool"
    calls ``wait_gate`` (a tool that waits for ``gate``) first. Every request is kept, so a test
    can say exactly what the model saw."""

    def __init__(self, *, hold_all: bool = False) -> None:
        self.hold_all = hold_all  # every answer waits for the gate (a run resumed after a restart)
        self.gate = asyncio.Event()
        self.calling = asyncio.Event()  # set while a held answer (or the tool) waits for the gate
        self.model = ScriptedModel(self.brain)

    async def brain(self, req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if isinstance(last, ToolResultMessage):
            return f"after tool: {last.text}"
        if isinstance(last, UserMessage) and last.text.startswith("tool"):
            return Reply(tool_calls=[call("wait_gate")])
        if self.hold_all or (isinstance(last, UserMessage) and last.text.startswith("hold")):
            self.calling.set()
            await self.gate.wait()
        return f"re: {last.text}"

    def tool(self) -> Any:
        @tool
        async def wait_gate() -> str:
            """Wait until the test opens the gate."""
            self.calling.set()
            await self.gate.wait()
            return "opened"

        return wait_gate

    def seen(self) -> list[str]:
        """Every user and system text any request showed the model."""
        texts = []
        for req in self.model.requests:
            texts += [m.text for m in req.messages if isinstance(m, UserMessage | SystemMessage)]
        return texts

    def answered(self) -> list[str]:
        """The last message of every request (what each model call answered)."""
        return [r.messages[-1].text for r in self.model.requests]


def gated_kernel(tmp_path: Path, gated: Gated, url: str | None = None) -> Any:
    url = url or f"sqlite:///{tmp_path}/agentloop.db"
    return Kernel.open(url, model=gated.model, workspace=tmp_path, data_dir=tmp_path, tools=[gated.tool()])


async def drain(proc: Process) -> list[sig.Signal]:
    return [s async for s in proc.signals(follow=False)]


async def busy(k: Kernel, gated: Gated, text: str = "hold") -> Process:
    """A process with a run under way that waits on the gate."""
    proc = await k.spawn(owner="alice")
    await proc.send(text)
    await asyncio.wait_for(gated.calling.wait(), 5)
    return proc


def summary(items: list[QueueItem]) -> list[tuple[str, str]]:
    return [(i.kind, i.message.text) for i in items]


async def cached_count_is_right(k: Kernel, pid: str) -> None:
    """The engine's cached count of waiting items is the store's (positions and the driver's
    shortcut both trust it)."""
    live = k.engine.cached(pid)
    assert live is not None and live.queued == len(await k.store.queue(pid))


# ---------------------------------------------------------------------------------- kernel


async def test_queued_lists_waiting_input_in_the_order_it_will_be_taken(tmp_path: Path) -> None:
    gated = Gated()
    async with gated_kernel(tmp_path, gated) as k:
        proc = await busy(k, gated)
        assert await proc.queued() == []
        q1 = await proc.send("q1", mode="queue")
        s1 = await proc.send("s1", mode="steer")
        await k.signal(proc.pid, "an event")
        q2 = await proc.send("q2", mode="queue")
        await proc.send("s2", mode="steer")
        items = await proc.queued()
        # system events first, then steer input (both join the active run), then each queued message
        assert summary(items) == [
            ("system", "an event"),
            ("steer", "s1"),
            ("steer", "s2"),
            ("queue", "q1"),
            ("queue", "q2"),
        ]
        assert [i.id for i in items] == [3, 2, 5, 1, 4]
        assert all(i.created_at > 0 for i in items)
        assert items[3].run_id == q1.run_id and items[4].run_id == q2.run_id  # the runs their receipts named
        assert s1.queued and s1.position == 2
        gated.gate.set()
        await proc.wait_idle()
        assert await proc.queued() == []
        # ... and that is the order the model got them in
        order = [t for t in gated.seen() if t in ("an event", "s1", "s2", "q1", "q2")]
        assert list(dict.fromkeys(order)) == ["an event", "s1", "s2", "q1", "q2"]


async def test_withdraw_one_then_all_user_input_then_system_events(tmp_path: Path) -> None:
    gated = Gated()
    async with gated_kernel(tmp_path, gated) as k:
        proc = await busy(k, gated)
        await proc.send("q1", mode="queue")
        await proc.send("s1", mode="steer")
        await k.signal(proc.pid, "an event")
        await proc.send("q2", mode="queue")
        [q1] = [i for i in await proc.queued() if i.message.text == "q1"]

        assert summary(await proc.withdraw(q1.id)) == [("queue", "q1")]
        assert await proc.withdraw(q1.id) == []  # gone: nothing to withdraw, no error
        assert await proc.withdraw(999) == []
        await cached_count_is_right(k, proc.pid)

        # all user input, never the system events unless asked for by kind or id
        assert summary(await proc.withdraw()) == [("steer", "s1"), ("queue", "q2")]
        assert summary(await proc.queued()) == [("system", "an event")]
        assert await proc.withdraw(kind="steer") == []
        assert summary(await proc.withdraw(kind="system")) == [("system", "an event")]
        assert await proc.queued() == []
        await cached_count_is_right(k, proc.pid)

        later = await proc.send("later", mode="queue")
        assert later.position == 1  # counted from what waits now
        gated.gate.set()
        await proc.wait_idle()
        seen = gated.seen()
        assert "later" in seen and not {"q1", "s1", "q2", "an event"} & set(seen)
        assert not {"q1", "s1", "q2", "an event"} & {m.text for m in await proc.messages()}
        await cached_count_is_right(k, proc.pid)


async def test_withdraw_by_id_takes_any_kind_and_kind_and_id_narrow_together(tmp_path: Path) -> None:
    gated = Gated()
    async with gated_kernel(tmp_path, gated) as k:
        proc = await busy(k, gated)
        await k.signal(proc.pid, "an event")
        await proc.send("s1", mode="steer")
        event, steer = await proc.queued()
        assert await proc.withdraw(event.id, kind="steer") == []  # the id is not of that kind
        assert summary(await proc.withdraw(event.id)) == [("system", "an event")]
        assert summary(await proc.withdraw(steer.id, kind="steer")) == [("steer", "s1")]
        gated.gate.set()
        await proc.wait_idle()


async def test_withdraw_refuses_bad_arguments_and_unknown_processes(tmp_path: Path) -> None:
    gated = Gated()
    async with gated_kernel(tmp_path, gated) as k:
        proc = await k.spawn(owner="alice")
        for bad in (0, -1, True, "1", 2**63, 1.0):
            with pytest.raises(ValueError):
                await proc.withdraw(bad)  # type: ignore[arg-type]
        for kind in ("user", ["steer"]):
            with pytest.raises(ValueError):
                await proc.withdraw(kind=kind)  # type: ignore[arg-type]
        assert await proc.withdraw() == [] and await proc.queued() == []
        ghost = Process(k, "no-such-pid")
        with pytest.raises(NoSuchProcess):
            await ghost.queued()
        with pytest.raises(NoSuchProcess):
            await ghost.withdraw()


async def test_a_withdraw_signals_proc_changed_and_one_that_takes_nothing_does_not(tmp_path: Path) -> None:
    gated = Gated()
    async with gated_kernel(tmp_path, gated) as k:
        proc = await busy(k, gated)
        await proc.send("q1", mode="queue")
        await proc.send("q2", mode="queue")
        watching = proc.signals(after_seq=(await drain(proc))[-1].seq or 0, follow=True)
        before = len(await drain(proc))
        withdrawn = await proc.withdraw()
        live = await asyncio.wait_for(anext(watching), 5)  # watchers learn at once
        await watching.aclose()
        assert live.signal == sig.CHANGED and live.payload["changes"] == ["queue"]
        assert live.payload["withdrawn"] == [i.id for i in withdrawn]
        assert len(await drain(proc)) == before + 1  # logged, for those who come back later
        await proc.withdraw()
        assert len(await drain(proc)) == before + 1  # nothing withdrawn, nothing said
        gated.gate.set()
        await proc.wait_idle()


async def test_a_withdraw_waits_for_a_reset_under_way(tmp_path: Path) -> None:
    """A reset discards (and archives) what was queued before it: a withdraw during it waits and
    then finds nothing, instead of taking items the reset is about to archive."""
    gated = Gated()
    async with gated_kernel(tmp_path, gated) as k:
        proc = await busy(k, gated)
        await proc.send("q1", mode="queue")
        reset = asyncio.create_task(proc.reset())
        await asyncio.sleep(0)
        assert await proc.withdraw() == []
        await reset
        assert await proc.queued() == []


async def test_a_withdrawn_message_with_an_image_keeps_its_file_for_the_same_image_sent_again(
    tmp_path: Path,
) -> None:
    """Media files are stored once per process by content: the one a withdrawn message named may
    be named by another message too, so it stays (a reset or kill deletes the process's files)."""
    gated = Gated()
    async with gated_kernel(tmp_path, gated) as k:
        proc = await busy(k, gated)
        image = ImageContent(data=PNG, mime_type="image/png")
        await proc.send("look", mode="queue", media=[image])
        await proc.send("look again", mode="queue", media=[image])
        [first, _] = await proc.queued()
        assert summary(await proc.withdraw(first.id)) == [("queue", "look")]
        gated.gate.set()
        await proc.wait_idle()
        [req] = [r for r in gated.model.requests if r.messages[-1].text == "look again"]
        last = req.messages[-1]
        assert isinstance(last, UserMessage)
        [shown] = [b for b in last.content if isinstance(b, ImageContent)]
        assert shown.data == PNG  # the file is there, and the model got the image


# ---------------------------------------------------------------------------------- races


class StaleRead:
    """Once armed, the next read of the queue (outside a withdraw) returns what it read, but only
    after ``withdraw`` has run: a withdraw landing between a reader's look and its claim."""

    def __init__(self, k: Kernel, withdraw: Callable[[], Awaitable[list[QueueItem]]]) -> None:
        self.real = k.store.queue
        self.withdraw = withdraw
        self.armed = False
        self.busy = False
        self.withdrawn: list[QueueItem] | None = None

    async def __call__(self, pid: str) -> list[QueueItem]:
        items = await self.real(pid)
        if self.armed and not self.busy:
            self.armed, self.busy = False, True
            try:
                self.withdrawn = await self.withdraw()
            finally:
                self.busy = False
        return items


async def test_an_item_withdrawn_while_the_next_run_is_promoted_never_runs_and_the_rest_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gated = Gated()
    async with gated_kernel(tmp_path, gated) as k:
        proc = await busy(k, gated)
        await proc.send("q1", mode="queue")
        await proc.send("q2", mode="queue")
        first = (await proc.queued())[0]
        stale = StaleRead(k, lambda: proc.withdraw(first.id))
        monkeypatch.setattr(k.store, "queue", stale)
        real_promote = admission.promote

        async def racing(engine: Any, live: Any) -> None:
            stale.armed = stale.withdrawn is None
            await real_promote(engine, live)

        monkeypatch.setattr(driver_module, "promote", racing)
        gated.gate.set()
        await asyncio.wait_for(wait_runs(proc, 2), 5)
        await proc.wait_idle()
        assert stale.withdrawn is not None and summary(stale.withdrawn) == [("queue", "q1")]
        assert "q1" not in gated.seen() and "q2" in gated.answered()  # the next one ran instead
        await cached_count_is_right(k, proc.pid)


async def wait_runs(proc: Process, count: int) -> None:
    """Until ``count`` runs of ``proc`` have finished."""
    while sum(s.signal == sig.RUN_FINISHED for s in await drain(proc)) < count:
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("flow", ["tool", "answer"])
@pytest.mark.parametrize("when", ["before the turn", "after its read"])
async def test_steer_input_withdrawn_as_the_model_turn_takes_it_never_reaches_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flow: str, when: str
) -> None:
    """Steer input joins the run at its next model turn. Withdrawn just before that turn (its
    decision made on input now gone) or between the turn's read and its claim: the model never
    sees it, and a run whose answer was final ends with it instead of answering again."""
    gated = Gated()
    async with gated_kernel(tmp_path, gated) as k:
        proc = await busy(k, gated, "tool" if flow == "tool" else "hold")
        receipt = await proc.send("steer me", mode="steer")
        [steer] = await proc.queued()
        stale = StaleRead(k, lambda: proc.withdraw(steer.id))
        monkeypatch.setattr(k.store, "queue", stale)
        real_turn = driver_module._model_turn

        async def racing(engine: Any, live: Any, run: Any, tools_enabled: bool) -> bool:
            if stale.withdrawn is None and not stale.armed:
                if when == "before the turn":
                    stale.withdrawn = await proc.withdraw(steer.id)
                else:
                    stale.armed = True
            return await real_turn(engine, live, run, tools_enabled)

        monkeypatch.setattr(driver_module, "_model_turn", racing)
        gated.gate.set()
        await proc.wait_idle()
        assert stale.withdrawn is not None and summary(stale.withdrawn) == [("steer", "steer me")]
        assert "steer me" not in gated.seen()
        assert "steer me" not in [m.text for m in await proc.messages()]
        finished = [s.payload for s in await drain(proc) if s.signal == sig.RUN_FINISHED]
        assert [(f["runId"], f["status"]) for f in finished] == [(receipt.run_id, "ok")]
        if flow == "answer":  # the final answer stands: the model is not asked again
            assert gated.answered() == ["hold"] and finished[0]["text"] == "re: hold"
        else:
            assert gated.answered() == ["tool", "opened"]
        await cached_count_is_right(k, proc.pid)


async def test_withdraw_right_as_the_run_ends_runs_or_withdraws_each_item_never_both(tmp_path: Path) -> None:
    gated = Gated()
    async with gated_kernel(tmp_path, gated) as k:
        proc = await k.spawn(owner="alice")
        outcomes = set()
        for i in range(30):
            gated.gate, gated.calling = asyncio.Event(), asyncio.Event()
            await proc.send(f"hold {i}")
            await asyncio.wait_for(gated.calling.wait(), 5)
            await proc.send(f"late {i}", mode="queue")
            [item] = await proc.queued()
            gated.gate.set()
            for _ in range(i % 10):  # land the withdraw at a different step of the run's end each time
                await asyncio.sleep(0)
            if 20 <= i < 25:
                await asyncio.sleep(0.0005 * (i - 20))
            if i >= 25:  # (and surely after the promotion, however slow the machine)
                await wait_until(lambda: f"late {i}" in gated.answered())  # noqa: B023
            withdrawn = await proc.withdraw(item.id)
            await proc.wait_idle()
            ran = f"late {i}" in gated.answered()
            assert ran != bool(withdrawn), (i, ran, withdrawn)
            outcomes.add(ran)
            await cached_count_is_right(k, proc.pid)
        assert outcomes == {True, False}  # both sides of the race were hit


# ---------------------------------------------------------------------------------- restart and PostgreSQL


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/agentloop.db"
    pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")
    url: str = request.getfixturevalue("pg_url")
    return url


async def test_a_restart_keeps_the_queue_listing_and_a_withdraw_after_it_holds(store_url: str, tmp_path: Path) -> None:
    gated = Gated()
    async with gated_kernel(tmp_path, gated, store_url) as k:
        proc = await busy(k, gated)
        await proc.send("q1", mode="queue")
        await k.signal(proc.pid, "an event")
        await proc.send("q2", mode="queue")
        before = await proc.queued()
        pid = proc.pid
    assert summary(before) == [("system", "an event"), ("queue", "q1"), ("queue", "q2")]
    again = Gated(hold_all=True)  # the run resumes with a model that holds it again
    async with gated_kernel(tmp_path, again, store_url) as k:
        proc = await k.process(pid)
        await asyncio.wait_for(again.calling.wait(), 5)  # resumed: its next turn took the event
        assert again.answered() == ["an event"]
        after = await proc.queued()
        assert [(i.id, i.kind, i.message.text, i.run_id, i.created_at) for i in after] == [
            (i.id, i.kind, i.message.text, i.run_id, i.created_at) for i in before[1:]
        ]
        assert summary(await proc.withdraw(after[0].id)) == [("queue", "q1")]
        await cached_count_is_right(k, pid)
        again.gate.set()
        await proc.wait_idle()
        assert "q1" not in again.seen() and "q2" in again.answered() and "an event" in again.seen()
        assert await proc.queued() == []


async def test_a_withdraw_through_another_worker_reaches_the_holder(pg_url: str, tmp_path: Path) -> None:
    pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")
    from tests.test_scale_out import kept_by, worker

    gated = Gated()
    tools = [gated.tool()]
    async with (
        worker(pg_url, tmp_path, "A", gated.model, tools) as a,
        worker(pg_url, tmp_path, "B", gated.model, tools) as b,
    ):
        proc_a = await a.spawn(owner="alice")
        await kept_by(a, proc_a.pid)
        await proc_a.send("hold")
        await asyncio.wait_for(gated.calling.wait(), 5)
        proc_b = await b.process(proc_a.pid)
        await proc_b.send("q1", mode="queue")  # forwarded: waits in the queue for A
        await proc_b.send("q2", mode="queue")
        assert summary(await proc_b.queued()) == [("queue", "q1"), ("queue", "q2")]
        [q1, _] = await proc_b.queued()
        assert summary(await proc_b.withdraw(q1.id)) == [("queue", "q1")]
        await wait_until(lambda: a.engine.cached(proc_a.pid).queued == 1)  # type: ignore[union-attr]
        gated.gate.set()
        await asyncio.wait_for(wait_runs(proc_a, 2), 10)
        await proc_a.wait_idle()
        assert "q1" not in gated.seen() and "q2" in gated.answered()
        assert await proc_a.queued() == []


# ---------------------------------------------------------------------------------- HTTP


server = server_support.module_server("queue")
alice, bob = server_support.alice, server_support.bob


async def busy_over_http(client: httpx.AsyncClient) -> str:
    """A process of the client's with a long run (the test server's "sleep" calls a slow tool)."""
    pid: str = (await client.post("/v1/processes", json={})).json()["pid"]
    assert (await client.post(f"/v1/processes/{pid}/messages", json={"text": "sleep 30"})).status_code == 202
    return pid


async def test_http_lists_and_withdraws_waiting_input(alice: httpx.AsyncClient) -> None:
    pid = await busy_over_http(alice)
    base = f"/v1/processes/{pid}/queue"
    try:
        assert checked(await alice.get(base), api.QueueOut) == {"items": []}
        await alice.post(f"/v1/processes/{pid}/messages", json={"text": "later", "mode": "queue", "run_id": "r-later"})
        await alice.post(f"/v1/processes/{pid}/messages", json={"text": "also", "mode": "steer"})
        await alice.post(f"/v1/processes/{pid}/events", json={"text": "an event"})
        items = checked(await alice.get(base), api.QueueOut)["items"]
        assert [(i["kind"], i["text"]) for i in items] == [
            ("system", "an event"),
            ("steer", "also"),
            ("queue", "later"),
        ]
        later = items[2]
        assert later["run_id"] == "r-later" and later["message"]["role"] == "user" and later["created_at"] > 0

        gone = checked(await alice.delete(f"{base}/{later['id']}"), api.WithdrawnOut)["withdrawn"]
        assert gone == [later]
        refused(await alice.delete(f"{base}/{later['id']}"), 404, "not_found")  # no longer waiting
        refused(await alice.delete(f"{base}/424242"), 404, "not_found")
        for bad in ("abc", "0", "-1", "1.5", "99999999999999999999", "%C2%B2"):
            refused(await alice.delete(f"{base}/{bad}"), 400, "invalid_request")
        refused(await alice.delete(f"{base}?kind=user"), 400, "invalid_request")

        left = checked(await alice.delete(base), api.WithdrawnOut)["withdrawn"]
        assert [(i["kind"], i["text"]) for i in left] == [("steer", "also")]  # user input only
        system = checked(await alice.delete(f"{base}?kind=system"), api.WithdrawnOut)["withdrawn"]
        assert [i["text"] for i in system] == ["an event"]
        assert checked(await alice.get(base), api.QueueOut) == {"items": []}
        assert checked(await alice.delete(base), api.WithdrawnOut) == {"withdrawn": []}
    finally:
        await alice.post(f"/v1/processes/{pid}/abort", json={})


async def test_http_queue_of_an_unknown_or_anothers_process_is_404(
    alice: httpx.AsyncClient, bob: httpx.AsyncClient
) -> None:
    pid = await busy_over_http(alice)
    try:
        await alice.post(f"/v1/processes/{pid}/messages", json={"text": "later", "mode": "queue"})
        [item] = (await alice.get(f"/v1/processes/{pid}/queue")).json()["items"]
        for path in (f"/v1/processes/{pid}/queue", f"/v1/processes/{pid}/queue/{item['id']}"):
            refused(await bob.get(path) if path.endswith("queue") else await bob.delete(path), 404, "not_found")
        refused(await bob.delete(f"/v1/processes/{pid}/queue"), 404, "not_found")
        refused(await alice.get("/v1/processes/nope/queue"), 404, "not_found")
        refused(await alice.delete("/v1/processes/nope/queue"), 404, "not_found")
        refused(await alice.delete("/v1/processes/nope/queue/1"), 404, "not_found")
        assert len((await alice.get(f"/v1/processes/{pid}/queue")).json()["items"]) == 1  # bob took nothing
    finally:
        await alice.post(f"/v1/processes/{pid}/abort", json={})


def test_the_queue_routes_are_documented() -> None:
    paths = api.openapi_document()["paths"]
    assert set(paths["/v1/processes/{pid}/queue"]) >= {"get", "delete"}
    assert "delete" in paths["/v1/processes/{pid}/queue/{item_id}"]


# ---------------------------------------------------------------------------------- client


async def test_the_client_lists_and_withdraws(server: LiveServer) -> None:
    from agentloop.client import AgentloopClient, ClientError, NotFound

    async with AgentloopClient(server.url, server.tokens.alice) as client:
        pid = (await client.spawn())["pid"]
        await client.send(pid, "sleep 30")
        try:
            await client.send(pid, "one", mode="queue")
            await client.send(pid, "two", mode="queue")
            items = await client.queue(pid)
            one = next(i for i in items if i["text"] == "one")
            assert [i["text"] for i in await client.withdraw(pid, one["id"])] == ["one"]
            with pytest.raises(NotFound):
                await client.withdraw(pid, one["id"])
            with pytest.raises(ClientError) as bad:
                await client.withdraw(pid, kind="nope")
            assert bad.value.status == 400
            assert [i["text"] for i in await client.withdraw(pid)] == ["two"]
            assert await client.queue(pid) == []
        finally:
            await client.abort(pid)


# ---------------------------------------------------------------------------------- WebSocket


def ws_script(req: ModelRequest) -> Reply | str:
    last = req.messages[-1]
    if isinstance(last, UserMessage) and last.text == "sleep":
        return Reply(tool_calls=[call("slow", seconds=30)])
    return "reply: " + last.text


def test_websocket_lists_and_withdraws_with_the_same_rules(tmp_path: Path) -> None:
    with KernelServer(tmp_path, ScriptedModel(ws_script), tools=[slow]) as srv:
        alice, bob = srv.client("alice"), srv.client("bob")
        try:
            pid = alice.ok("proc.spawn", {})["pid"]
            alice.ok("proc.send", {"pid": pid, "text": "sleep"})
            assert alice.ok("proc.queue.list", {"pid": pid}) == {"items": []}
            alice.ok("proc.send", {"pid": pid, "text": "later", "mode": "queue"})
            alice.ok("proc.send", {"pid": pid, "text": "also", "mode": "steer"})
            items = alice.ok("proc.queue.list", {"pid": pid})["items"]
            assert [(i["kind"], i["text"]) for i in items] == [("steer", "also"), ("queue", "later")]
            api.QueueOut.model_validate({"items": items})

            assert bob.error("proc.queue.list", {"pid": pid}) == "not_found"
            assert bob.error("proc.queue.withdraw", {"pid": pid}) == "not_found"
            assert alice.error("proc.queue.list", {"pid": "nope"}) == "not_found"
            assert alice.error("proc.queue.withdraw", {"pid": "nope", "item_id": 1}) == "not_found"
            for bad in ("1", 0, -3, True, 1.5, 2**63):
                assert alice.error("proc.queue.withdraw", {"pid": pid, "item_id": bad}) == "invalid_request"
            assert alice.error("proc.queue.withdraw", {"pid": pid, "kind": "user"}) == "invalid_request"
            assert alice.error("proc.queue.withdraw", {"pid": pid, "item_id": 4242}) == "not_found"

            later = items[1]
            assert alice.ok("proc.queue.withdraw", {"pid": pid, "item_id": later["id"]}) == {"withdrawn": [later]}
            assert alice.error("proc.queue.withdraw", {"pid": pid, "item_id": later["id"]}) == "not_found"
            rest = alice.ok("proc.queue.withdraw", {"pid": pid})["withdrawn"]
            assert [i["text"] for i in rest] == ["also"]
            assert alice.ok("proc.queue.list", {"pid": pid}) == {"items": []}
            alice.ok("proc.abort", {"pid": pid})
        finally:
            alice.close()
            bob.close()


# ---------------------------------------------------------------------------------- chat


def test_durable_chat_lists_and_clears_the_queue(tmp_path: Path) -> None:
    from contextlib import AsyncExitStack

    from agentloop.cli.chat import ChatRepl, ChatState, DurableSession, PlainReader

    gated = Gated()
    ev = asyncio.new_event_loop()
    stack = AsyncExitStack()
    try:
        k = ev.run_until_complete(stack.enter_async_context(gated_kernel(tmp_path, gated)))
        session = DurableSession(k, owner="me", cwd=tmp_path, state=ChatState(tmp_path / "chat.json"))
        ev.run_until_complete(session.open(new=True))
        proc = session.process
        ev.run_until_complete(proc.send("hold"))
        ev.run_until_complete(asyncio.wait_for(gated.calling.wait(), 5))
        ev.run_until_complete(proc.send("from another window", mode="queue"))
        ev.run_until_complete(k.signal(proc.pid, "an event"))
        err = io.StringIO()
        reader = PlainReader(io.StringIO("/queue\n/queue clear\n/queue\n/queue nonsense\n/help\n/exit\n"))
        repl = ChatRepl(session, reader=reader, out=io.StringIO(), err=Console(file=err, width=200))
        assert repl.loop(ev) == 0
        shown = err.getvalue()
        listed, cleared = shown.split("withdrew 1 waiting message")
        assert "2 waiting" in listed and "from another window" in listed and "an event" in listed
        relisted, rest = cleared.split("usage: /queue")
        assert "1 waiting" in relisted and "an event" in relisted and "from another window" not in relisted
        assert "/queue" in rest  # /help names it
        assert summary(ev.run_until_complete(proc.queued())) == [("system", "an event")]
        gated.gate.set()
        ev.run_until_complete(proc.wait_idle())
    finally:
        ev.run_until_complete(stack.aclose())
        ev.close()
    assert "from another window" not in gated.seen()


def test_remote_chat_lists_and_clears_the_queue(server: LiveServer) -> None:
    from agentloop.cli.chat import ChatRepl, PlainReader
    from agentloop.cli.client import RemoteSession
    from agentloop.client import AgentloopClient

    ev = asyncio.new_event_loop()
    client = AgentloopClient(server.url, server.tokens.bob)
    err = io.StringIO()
    try:
        session = RemoteSession(client)
        ev.run_until_complete(session.open(new=True))
        ev.run_until_complete(client.send(session.pid, "sleep 30"))
        ev.run_until_complete(client.send(session.pid, "queued elsewhere", mode="queue"))
        reader = PlainReader(io.StringIO("/queue\n/queue clear\n/queue\n/exit\n"))
        repl = ChatRepl(session, reader=reader, out=io.StringIO(), err=Console(file=err, width=200))
        assert repl.loop(ev) == 0
        assert ev.run_until_complete(client.queue(session.pid)) == []
        ev.run_until_complete(client.abort(session.pid))
    finally:
        ev.run_until_complete(client.aclose())
        ev.close()
    shown = err.getvalue()
    assert "1 waiting" in shown and "queued elsewhere" in shown
    assert "withdrew 1 waiting message" in shown and "nothing waiting" in shown


def test_chat_without_a_queue_says_so() -> None:
    from agentloop import Agent
    from agentloop.cli.chat import ChatRepl, PlainReader

    err = io.StringIO()
    reader = PlainReader(io.StringIO("/queue\n/exit\n"))
    repl = ChatRepl(Agent(model=ScriptedModel(["hi"])), reader=reader, out=io.StringIO(), err=Console(file=err))
    assert repl.loop() == 0
    assert "no queue" in err.getvalue()
