"""Rewinds: ``Process.rewind(at)`` cuts a process's history back in place to message id ``at``
(0: the start), what followed archived first as a ``rewind`` segment (``segments()``, ``segment()``,
``fork(segment=…)``), the process, its settings, queue and media kept. Refused while a run is active
and at a point inside a tool call batch (as a fork is); a no-op at the last message. Over HTTP:
``POST /v1/processes/{pid}/rewind``; the WebSocket's ``proc.rewind``; the client's ``rewind``;
``/rewind`` in ``agentloop chat``, local and remote."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from agentloop import ScriptedModel, tool
from agentloop.cli.main import app
from agentloop.client import AgentloopClient, ClientError, Conflict, NotFound
from agentloop.kernel import Kernel, NoSuchProcess, Process, RunActive
from agentloop.messages import ImageContent, UserMessage
from agentloop.models.registry import register_provider
from agentloop.process.media import MediaRef
from tests import server_support, test_prompt_manifest
from tests.image_support import PNG
from tests.server_support import LiveServer, live_server, refused, wait_idle
from tests.test_fork import PNG64, answer, echo, say, texts, user_texts

gate = asyncio.Event()  # (its own: an event is bound to the loop of the test that first waits on it)


@tool
async def wait_gate() -> str:
    """Wait until the test opens the gate."""
    await gate.wait()
    return "opened"


def open_kernel(tmp_path: Path, model: ScriptedModel, url: str | None = None) -> Any:
    url = url or f"sqlite:///{tmp_path}/a.db"
    return Kernel.open(url, model=model, workspace=tmp_path, data_dir=tmp_path, tools=[echo, wait_gate])


async def conversation(proc: Process, *said: str) -> list[int]:
    for text in said:
        await say(proc, text)
    return [m.id for m in await proc.history()]


# ------------------------------------------------------------------ the library


async def test_a_rewind_keeps_the_prefix_archives_the_rest_and_the_next_send_goes_on_from_it(tmp_path: Path) -> None:
    model = ScriptedModel(answer, keep_requests=True)
    async with open_kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice")
        ids = await conversation(proc, "one", "two", "three")
        before = await proc.messages()
        seq = (await k.store.events(proc.pid))[-1].seq
        done = await proc.rewind(ids[1])
        assert (done.kept, done.removed) == (2, 4) and done.segment is not None
        assert texts(await proc.messages()) == ["one", "seen: one"]
        assert [m.id for m in await proc.history()] == ids[:2]
        (segment,) = await proc.segments()
        assert (segment.id, segment.kind, segment.reason, segment.messages) == (done.segment, "rewind", "rewind", 4)
        assert segment.archive == done.archive
        page = await proc.segment(segment.id)
        assert [m for _, m in page.messages] == before[2:]
        changed = [e for e in await k.store.events(proc.pid, after_seq=seq) if e.signal == "proc.changed"]
        assert [e.payload["changes"] for e in changed] == [["messages"]]
        assert changed[0].payload["rewound"] == {"at": ids[1], "removed": 4, "segment": segment.id}
        await say(proc, "again")
        assert user_texts(model.requests[-1]) == ["one", "again"]
        assert [m.role for m in model.requests[-1].messages] == ["user", "assistant", "user"]
        history = await proc.history()
        assert texts([m.message for m in history]) == ["one", "seen: one", "again", "seen: one, again"]
        assert history[2].id > ids[-1]  # ids are never given again
        # what was dropped comes back as a process of its own
        restored = await proc.fork(segment=segment.id)
        assert await restored.messages() == before[2:]
        await say(restored, "more")
        assert user_texts(model.requests[-1]) == ["two", "three", "more"]


async def test_rewinding_to_the_start_and_to_the_last_message(tmp_path: Path) -> None:
    async with open_kernel(tmp_path, ScriptedModel(answer)) as k:
        proc = await k.spawn(owner="alice")
        ids = await conversation(proc, "one")
        seq = (await k.store.events(proc.pid))[-1].seq
        same = await proc.rewind(ids[-1])
        assert (same.kept, same.removed, same.segment, same.archive) == (2, 0, None, None)
        assert await proc.segments() == []
        assert await k.store.events(proc.pid, after_seq=seq) == []  # no signal either
        assert not (tmp_path / "var" / "sessions" / "alice" / proc.pid).exists()
        start = await proc.rewind(0)
        assert (start.kept, start.removed) == (0, 2)
        assert await proc.messages() == []
        assert (await proc.rewind(0)).removed == 0
        await say(proc, "fresh")
        assert texts(await proc.messages()) == ["fresh", "seen: fresh"]


async def test_a_point_inside_a_tool_call_batch_or_not_in_the_history_is_refused(tmp_path: Path) -> None:
    async with open_kernel(tmp_path, ScriptedModel(answer)) as k:
        proc = await k.spawn(owner="alice")
        ids = await conversation(proc, "tool x")
        roles = [m.message.role for m in await proc.history()]
        assert roles == ["user", "assistant", "toolResult", "assistant"]
        before = await proc.history()
        with pytest.raises(ValueError, match=rf"rewind to message {ids[0]} \(before the calls\) or {ids[2]}"):
            await proc.rewind(ids[1])
        with pytest.raises(ValueError, match="is not a message of process"):
            await proc.rewind(999)
        with pytest.raises(ValueError, match="at must be a message id"):
            await proc.rewind(-1)
        with pytest.raises(TypeError):
            await proc.rewind("1")  # type: ignore[arg-type]
        assert await proc.history() == before and await proc.segments() == []
        assert (await proc.rewind(ids[2])).removed == 1  # after the results: valid
        killed = await k.spawn(owner="alice")
        await killed.kill()
        with pytest.raises(NoSuchProcess):
            await killed.rewind(0)


async def test_a_rewind_is_refused_while_a_run_is_active_and_leaves_the_queue(tmp_path: Path) -> None:
    gate.clear()
    async with open_kernel(tmp_path, ScriptedModel(answer)) as k:
        proc = await k.spawn(owner="alice")
        ids = await conversation(proc, "one")
        await proc.send("wait")
        queued = await proc.send("later", mode="queue")
        for _ in range(200):
            if len(await proc.history()) == 4:  # the call is made
                break
            await asyncio.sleep(0.01)
        with pytest.raises(RunActive, match="a rewind needs it idle"):
            await proc.rewind(ids[1])
        assert [q.run_id for q in await proc.queued()] == [queued.run_id]
        assert await proc.segments() == []
        gate.set()
        await proc.wait_idle()
        assert "later" in texts(await proc.messages())


async def test_a_rewound_history_survives_a_restart(tmp_path: Path) -> None:
    async with open_kernel(tmp_path, ScriptedModel(answer)) as k:
        proc = await k.spawn(owner="alice")
        ids = await conversation(proc, "one", "two")
        await proc.rewind(ids[1])
        pid = proc.pid
    model = ScriptedModel(answer, keep_requests=True)
    async with open_kernel(tmp_path, model) as k:
        proc = await k.process(pid)
        assert texts(await proc.messages()) == ["one", "seen: one"]
        assert [s.kind for s in await proc.segments()] == ["rewind"]
        await say(proc, "three")
        assert user_texts(model.requests[-1]) == ["one", "three"]


async def test_media_of_dropped_messages_stay_until_a_reset_as_a_compactions_do(tmp_path: Path) -> None:
    model = ScriptedModel(answer, keep_requests=True)
    async with open_kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice")
        ids = await conversation(proc, "one")
        await say(proc, "look", media=[ImageContent(data=PNG64, mime_type="image/png")])
        done = await proc.rewind(ids[-1])
        assert done.removed == 2 and done.segment is not None
        archived = (await proc.segment(done.segment)).messages[0][1]
        image = archived.content[1]
        assert isinstance(image, ImageContent)
        ref = MediaRef.of(image)
        assert ref.path.startswith(f"var/media/alice/{proc.pid}/")
        assert (tmp_path / ref.path).read_bytes() == PNG  # kept: the archive refers to it
        restored = await proc.fork(segment=done.segment)
        await say(restored, "and now?")
        sent = model.requests[-1].messages[0]
        assert isinstance(sent, UserMessage) and sent.content[1] == ImageContent(data=PNG64, mime_type="image/png")
        await proc.reset()  # a reset deletes the process's media, the rewound ones with them
        assert not (tmp_path / "var" / "media" / "alice" / proc.pid).exists()


async def test_a_rewind_on_postgres(pg_url: str, tmp_path: Path) -> None:
    async with open_kernel(tmp_path, ScriptedModel(answer), pg_url) as k:
        proc = await k.spawn(owner="alice")
        ids = await conversation(proc, "one", "two")
        assert (await proc.rewind(ids[1])).removed == 2
        pid = proc.pid
    model = ScriptedModel(answer, keep_requests=True)
    async with open_kernel(tmp_path, model, pg_url) as k:
        proc = await k.process(pid)
        await say(proc, "three")
        assert user_texts(model.requests[-1]) == ["one", "three"]
        assert [s.kind for s in await proc.segments()] == ["rewind"]


# ------------------------------------------------------------------ HTTP, the client, the WebSocket


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("rewind")) as srv:
        yield srv


async def test_the_rewind_route(server: LiveServer) -> None:
    async with server.client(server.tokens.alice) as alice, server.client(server.tokens.bob) as bob:
        pid = (await alice.post("/v1/processes", json={"text": "hello"})).json()["pid"]
        await wait_idle(alice, pid)
        await alice.post(f"/v1/processes/{pid}/messages", json={"text": "echo more"})
        await wait_idle(alice, pid)
        history = (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"]
        assert [m["message"]["role"] for m in history] == [
            "user",
            "assistant",
            "user",
            "assistant",
            "toolResult",
            "assistant",
        ]
        inside = await alice.post(f"/v1/processes/{pid}/rewind", json={"at": history[3]["id"]})
        refused(inside, 400, "invalid_request")
        assert f"rewind to message {history[2]['id']} (before the calls)" in inside.json()["message"]
        refused(await alice.post(f"/v1/processes/{pid}/rewind", json={"at": 999999}), 400, "invalid_request")
        refused(await alice.post(f"/v1/processes/{pid}/rewind", json={"at": "1"}), 400, "invalid_request")
        refused(await alice.post(f"/v1/processes/{pid}/rewind", json={}), 400, "invalid_request")
        refused(await bob.post(f"/v1/processes/{pid}/rewind", json={"at": history[1]["id"]}), 404, "not_found")
        refused(await alice.post("/v1/processes/no-such/rewind", json={"at": 1}), 404, "not_found")
        resp = await alice.post(f"/v1/processes/{pid}/rewind", json={"at": history[1]["id"]})
        assert resp.status_code == 200, resp.text
        done = resp.json()
        assert (done["kept"], done["removed"]) == (2, 4)
        kept = (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"]
        assert kept == history[:2]
        segments = (await alice.get(f"/v1/processes/{pid}/segments")).json()["segments"]
        assert [(s["id"], s["kind"], s["messages"]) for s in segments] == [(done["segment"], "rewind", 4)]
        same = (await alice.post(f"/v1/processes/{pid}/rewind", json={"at": history[1]["id"]})).json()
        assert same == {"kept": 2, "removed": 0, "segment": None}
        await alice.post(f"/v1/processes/{pid}/messages", json={"text": "sleep 5"})
        busy = await alice.post(f"/v1/processes/{pid}/rewind", json={"at": history[0]["id"]})
        refused(busy, 409, "busy")
        await alice.post(f"/v1/processes/{pid}/abort", json={})
        await wait_idle(alice, pid)
        assert len((await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"]) > 2  # nothing rewound
        spec = (await alice.get("/v1/openapi.json")).json()
        assert "/v1/processes/{pid}/rewind" in spec["paths"]


async def test_the_client_rewinds(server: LiveServer) -> None:
    async with AgentloopClient(server.url, token=server.tokens.alice) as client:
        pid = (await client.spawn())["pid"]
        await client.send(pid, "hello")
        async with server.client(server.tokens.alice) as alice:
            await wait_idle(alice, pid)
        first = (await client.history(pid))["messages"][0]["id"]
        done = await client.rewind(pid, first)
        assert (done["kept"], done["removed"]) == (1, 1)
        assert [s["kind"] for s in await client.segments(pid)] == ["rewind"]
        with pytest.raises(NotFound):
            await client.rewind("no-such-process", 1)
        with pytest.raises(ClientError) as bad:
            await client.rewind(pid, 12345)
        assert bad.value.status == 400
        await client.send(pid, "sleep 5")
        with pytest.raises(Conflict):
            await client.rewind(pid, first)
        await client.abort(pid)


def test_websocket_rewinds_a_process(tmp_path: Path) -> None:
    from tests.ws_support import KernelServer

    model = ScriptedModel(lambda req: f"answer: {req.messages[-1].text}")
    with KernelServer(tmp_path, model) as server, server.client("alice") as c, server.client("bob") as bob:
        pid = c.ok("proc.spawn", {"text": "one"})["pid"]
        for _ in range(200):
            if len(c.ok("proc.history", {"pid": pid})["messages"]) == 2:
                break
            time.sleep(0.02)
        [first, _] = c.ok("proc.history", {"pid": pid})["messages"]
        assert c.ok("proc.rewind", {"pid": pid, "at": first["id"]}) == {
            "kept": 1,
            "removed": 1,
            "segment": c.ok("proc.segment.list", {"pid": pid})["segments"][0]["id"],
        }
        assert [m["id"] for m in c.ok("proc.history", {"pid": pid})["messages"]] == [first["id"]]
        assert c.error("proc.rewind", {"pid": pid, "at": 999}) == "invalid_request"
        assert c.error("proc.rewind", {"pid": pid, "at": "one"}) == "invalid_request"
        assert c.error("proc.rewind", {"pid": pid}) == "invalid_request"
        assert bob.error("proc.rewind", {"pid": pid, "at": first["id"]}) == "not_found"


# ------------------------------------------------------------------ agentloop chat

isolated = test_prompt_manifest.isolated  # a config-free environment for the CLI


def test_chat_slash_rewind(tmp_path: Path, isolated: None) -> None:
    register_provider("rewindchat", lambda model_id: ScriptedModel(answer))
    ws = tmp_path / "ws"
    ws.mkdir()
    # ids: one 1, its answer 2, two 3, 4, three 5, 6; again 7, 8; four 9, 10
    stdin = "one\ntwo\nthree\n/rewind\nagain\n/rewind 2\nfour\n/rewind 999\n/rewind x\n/rewind 10\n/help\n"
    result = CliRunner().invoke(
        app, ["chat", "-m", "rewindchat:x", "-w", str(ws), "--data", str(tmp_path / "data")], input=stdin
    )
    assert "Traceback" not in result.stderr
    err = " ".join(result.stderr.split())
    assert "(rewound: 2 messages dropped and archived, 4 kept)" in err
    assert "(rewound: 4 messages dropped and archived, 2 kept)" in err
    assert "not rewound: message 999 is not a message of process" in err
    assert "usage: /rewind [ID]" in err
    assert "(nothing to rewind: message 10 is the last one)" in err
    assert "/rewind [ID]" in err.split("usage: /rewind [ID]")[-1]  # in the help too
    out = result.stdout
    assert "seen: one, two, again" in out and "seen: one, four" in out
    assert "seen: one, two, three, again" not in out


remote_server = server_support.module_server("rewind-remote")


def test_remote_chat_rewinds_the_servers_conversation(remote_server: LiveServer) -> None:
    """``agentloop chat --server``: ``/rewind`` drops the last exchange of the server's process,
    which stays the same process."""
    from agentloop.cli.chat import ChatRepl, PlainReader
    from agentloop.cli.client import RemoteSession

    err = io.StringIO()
    ev = asyncio.new_event_loop()
    client = AgentloopClient(remote_server.url, remote_server.tokens.bob)
    try:
        session = RemoteSession(client)
        ev.run_until_complete(session.open(new=True))
        first = session.pid
        stdin = "/rewind\none\ntwo\n/rewind\nthree\n"
        repl = ChatRepl(session, reader=PlainReader(io.StringIO(stdin)), out=io.StringIO(), err=Console(file=err))
        repl.loop(ev)
        history = ev.run_until_complete(client.history(session.pid, limit=100))["messages"]
    finally:
        ev.run_until_complete(client.aclose())
        ev.close()
    shown = " ".join(err.getvalue().split())
    assert "not rewound: this conversation has no message of yours" in shown
    assert "(rewound: 2 messages dropped and archived, 2 kept)" in shown
    assert session.pid == first
    assert [m["message"]["content"][0]["text"] for m in history] == ["one", "answer: one", "three", "answer: three"]
