"""Forks: ``Process.fork`` / ``Kernel.fork`` make a new process of the same owner from a prefix of
a live history (``at``: up to and including that message id; None: all of it) or from an archived
segment (``segment``), with the conversation's settings, its media copied, and ``forked_from``
recorded; the source is left as it was. Over HTTP: ``POST /v1/processes/{pid}/fork``; the client's
``fork``; ``/fork`` in ``agentloop chat``."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.cli.main import app
from agentloop.client import AgentloopClient, Conflict, NotFound
from agentloop.kernel import Kernel, NoSuchProcess, Process
from agentloop.kernel.fork import FORKED_KEY
from agentloop.kernel.segments import NoSuchSegment
from agentloop.messages import AssistantMessage, ImageContent, Message, UserMessage
from agentloop.models.base import ModelRequest
from agentloop.models.registry import register_provider
from agentloop.process.media import MediaRef
from agentloop.process.store import StoreError
from agentloop.server import api
from tests import server_support, test_prompt_manifest
from tests.image_support import PNG
from tests.process_support import assert_valid
from tests.server_support import LiveServer, checked, live_server, refused, wait_idle

PNG64 = base64.b64encode(PNG).decode()
gate = asyncio.Event()


@tool
def echo(text: str) -> str:
    """Echo."""
    return text


@tool
async def wait_gate() -> str:
    """Wait until the test opens the gate."""
    await gate.wait()
    return "opened"


def answer(req: ModelRequest) -> Reply | str:
    """``tool <x>`` calls echo, ``wait`` waits for the gate; otherwise the user texts it has seen."""
    last = req.messages[-1]
    if isinstance(last, ToolResultMessage):
        return f"tool said {last.text}"
    text = last.text if isinstance(last, UserMessage) else ""
    if text.startswith("tool "):
        return Reply(tool_calls=[call("echo", text=text[5:])])
    if text == "wait":
        return Reply(tool_calls=[call("wait_gate")])
    return "seen: " + ", ".join(m.text for m in req.messages if isinstance(m, UserMessage))


MODELS: dict[str, ScriptedModel] = {}


def named(model_id: str) -> ScriptedModel:
    if model_id not in MODELS:
        MODELS[model_id] = ScriptedModel(lambda req: f"{model_id} answers")
    return MODELS[model_id]


register_provider("forkm", named)


def open_kernel(tmp_path: Path, model: ScriptedModel, url: str | None = None) -> Any:
    url = url or f"sqlite:///{tmp_path}/a.db"
    return Kernel.open(url, model=model, workspace=tmp_path, data_dir=tmp_path, tools=[echo, wait_gate])


async def say(proc: Process, text: str, **kw: Any) -> None:
    await proc.send(text, **kw)
    await proc.wait_idle()


def texts(messages: list[Message]) -> list[str]:
    return [m.text for m in messages]


def user_texts(req: ModelRequest) -> list[str]:
    return [m.text for m in req.messages if isinstance(m, UserMessage)]


async def test_a_fork_at_a_user_message_answers_from_that_prefix_and_leaves_the_source(tmp_path: Path) -> None:
    model = ScriptedModel(answer)
    async with open_kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice")
        for text in ("one", "two", "three"):
            await say(proc, text)
        before = await proc.history()
        second = next(m for m in before if isinstance(m.message, UserMessage) and m.message.text == "two")
        fork = await proc.fork(at=second.id)
        assert fork.pid != proc.pid
        forked = await fork.messages()
        assert forked == [m.message for m in before if m.id <= second.id]
        assert texts(forked) == ["one", "seen: one", "two"]
        await say(fork, "again")
        assert user_texts(model.requests[-1]) == ["one", "two", "again"]
        assert (await fork.messages())[-1].text == "seen: one, two, again"
        assert await proc.history() == before  # the source is untouched
        info = await fork.info()
        assert (info.owner, info.run_as, info.cwd, info.parent_pid) == ("alice", "alice", str(tmp_path), None)
        origin = await k.store.kv_get(fork.pid, FORKED_KEY)
        assert origin == {"pid": proc.pid, "at": second.id}
        logged = await k.store.events(fork.pid)
        assert logged[0].signal == "proc.changed" and logged[0].payload["forkedFrom"] == origin


async def test_a_fork_of_the_whole_history(tmp_path: Path) -> None:
    async with open_kernel(tmp_path, ScriptedModel(answer)) as k:
        proc = await k.spawn(owner="alice", context="be brief")
        await say(proc, "one")
        await say(proc, "tool x")
        fork = await k.fork(proc.pid)
        assert await fork.messages() == await proc.messages()
        assert_valid(await fork.messages())
        last = (await proc.history())[-1].id
        assert await k.store.kv_get(fork.pid, FORKED_KEY) == {"pid": proc.pid, "at": last}
        assert (await fork.info()).context == "be brief"
        other = await proc.fork(context="be thorough")
        assert (await other.info()).context == "be thorough"
        empty = await (await k.spawn(owner="alice")).fork()
        assert await empty.messages() == []


async def test_a_cut_inside_a_tool_call_batch_is_refused_naming_the_nearest_valid_points(tmp_path: Path) -> None:
    async with open_kernel(tmp_path, ScriptedModel(answer)) as k:
        proc = await k.spawn(owner="alice")
        await say(proc, "tool x")
        stored = await proc.history()
        assert [m.message.role for m in stored] == ["user", "assistant", "toolResult", "assistant"]
        user, calling, result, _ = (m.id for m in stored)
        with pytest.raises(ValueError, match=rf"message {calling}.*fork at message {user}.*or {result}"):
            await proc.fork(at=calling)
        fork = await proc.fork(at=result)  # the batch is complete: the model answers from the results
        assert_valid(await fork.messages())
        assert [m.role for m in await fork.messages()] == ["user", "assistant", "toolResult"]


async def test_a_fork_of_a_running_process_copies_what_is_committed_and_starts_idle(tmp_path: Path) -> None:
    gate.clear()
    async with open_kernel(tmp_path, ScriptedModel(answer)) as k:
        proc = await k.spawn(owner="alice")
        await say(proc, "one")
        await proc.send("wait")
        for _ in range(500):  # the call is made and waits for the gate: its result is not there yet
            if any(isinstance(m, AssistantMessage) and m.tool_calls for m in await proc.messages()):
                break
            await asyncio.sleep(0.01)
        await proc.send("steered while running")  # waits in the queue: not copied
        assert (await proc.info()).state == "running"
        fork = await proc.fork()
        assert texts(await fork.messages()) == ["one", "seen: one", "wait"]  # cut before the open call
        info = await fork.info()
        assert info.state == "idle" and info.current_run is None
        assert await fork.queued() == []
        with pytest.raises(ValueError, match="fork at message"):
            await proc.fork(at=(await proc.history())[-1].id)
        gate.set()
        await proc.wait_idle()
        assert_valid(await proc.messages())


async def test_a_fork_from_the_segment_a_reset_archived(tmp_path: Path) -> None:
    model = ScriptedModel(answer)
    async with open_kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice")
        await say(proc, "old one")
        await say(proc, "old two")
        archived = await proc.messages()
        await proc.reset()
        await say(proc, "new")
        (segment,) = await proc.segments()
        fork = await proc.fork(segment=segment.id)
        assert await fork.messages() == archived
        assert await k.store.kv_get(fork.pid, FORKED_KEY) == {"pid": proc.pid, "segment": segment.id}
        await say(fork, "continued")
        assert user_texts(model.requests[-1]) == ["old one", "old two", "continued"]
        assert texts(await proc.messages()) == ["new", "seen: new"]
        with pytest.raises(NoSuchSegment):
            await proc.fork(segment="no-such-segment")


async def test_media_of_copied_messages_stay_readable_after_the_source_is_killed(tmp_path: Path) -> None:
    model = ScriptedModel(answer)
    async with open_kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice")
        await say(proc, "look", media=[ImageContent(data=PNG64, mime_type="image/png")])
        fork = await proc.fork()
        await proc.kill()
        assert not (tmp_path / "var" / "media" / "alice" / proc.pid).exists()
        image = (await fork.messages())[0].content[1]
        assert isinstance(image, ImageContent)
        ref = MediaRef.of(image)
        assert ref.path.startswith(f"var/media/alice/{fork.pid}/")
        assert (tmp_path / ref.path).read_bytes() == PNG
        await say(fork, "and now?")
        sent = model.requests[-1].messages[0]
        assert isinstance(sent, UserMessage) and sent.content[1] == ImageContent(data=PNG64, mime_type="image/png")


async def test_the_fork_survives_a_restart_with_its_settings_and_origin(tmp_path: Path) -> None:
    async with open_kernel(tmp_path, ScriptedModel(answer)) as k:
        proc = await k.spawn(owner="alice", mode="chat", model="forkm:own", interactive=False)
        await proc.set_compaction(0.5, "fail")
        await proc.set_title("the plan")
        await say(proc, "hello")
        async with k.store.transaction():  # a rule a person let the source remember: not copied
            await k.store.kv_set(proc.pid, "approval_overrides", [{"match": "shell.exec"}])
        fork = await proc.fork()
        pid, source = fork.pid, proc.pid
    async with open_kernel(tmp_path, ScriptedModel(answer)) as k:
        fork = await k.process(pid)
        assert texts(await fork.messages()) == ["hello", "own answers"]
        assert await fork.mode() == "chat"
        assert (await fork.model()).model == "forkm:own"
        policy = await fork.compaction()
        assert (policy.threshold, policy.overflow) == (0.5, "fail")
        assert not (await fork.info()).interactive
        assert await fork.title() == "the plan"
        assert await k.store.kv_get(pid, "approval_overrides") is None
        assert (await k.store.kv_get(pid, FORKED_KEY))["pid"] == source
        await say(fork, "again")
        assert (await fork.messages())[-1].text == "own answers"


async def test_bad_input_is_refused_and_makes_nothing(tmp_path: Path) -> None:
    async with open_kernel(tmp_path, ScriptedModel(answer)) as k:
        proc = await k.spawn(owner="alice")
        await say(proc, "one")
        count = len(await k.processes())
        with pytest.raises(NoSuchProcess):
            await k.fork("nope")
        with pytest.raises(ValueError, match="not a message of"):
            await proc.fork(at=10_000)
        with pytest.raises(ValueError, match="at or segment"):
            await proc.fork(at=1, segment="x")
        for bad in (True, -1, "1", 1.0):
            with pytest.raises(ValueError, match="at must be"):
                await proc.fork(at=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            await proc.fork(segment=3)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            await proc.fork(context="nul\x00")
        assert len(await k.processes()) == count
        await proc.kill()
        with pytest.raises(NoSuchProcess):
            await proc.fork()


async def test_a_fork_given_its_pid_is_made_once(tmp_path: Path) -> None:
    """A caller that names the fork's pid can retry: the retry gets the fork the first call made,
    not a second one; a pid taken by another process, or by a fork since killed, is refused."""
    async with open_kernel(tmp_path, ScriptedModel(answer)) as k:
        proc = await k.spawn(owner="alice")
        await say(proc, "one")
        other = await k.spawn(owner="alice")
        made = await k.fork(proc.pid, new_pid="fork-1")
        assert made.pid == "fork-1"
        again = await k.fork(proc.pid, new_pid="fork-1", at=1)  # (a retry: its arguments are the first call's)
        assert again.pid == "fork-1" and len(await k.processes()) == 3
        assert texts([m.message for m in await again.history()]) == ["one", "seen: one"]
        with pytest.raises(StoreError, match="already"):
            await k.fork(other.pid, new_pid="fork-1")  # the pid is a fork of another process
        with pytest.raises(StoreError, match="already"):
            await k.fork(proc.pid, new_pid=other.pid)  # the pid is not a fork at all
        await made.kill()
        with pytest.raises(StoreError, match="killed"):
            await k.fork(proc.pid, new_pid="fork-1")
        with pytest.raises(ValueError):
            await k.fork(proc.pid, new_pid="../x")
        assert len(await k.processes()) == 2


async def test_a_fork_the_store_fails_to_write_leaves_no_media_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: a StoreError while the fork was written (its pid named by the caller) was re-raised
    before the media copied for it were removed: they stayed on disk, in no process's folder."""
    async with open_kernel(tmp_path, ScriptedModel(answer)) as k:
        proc = await k.spawn(owner="alice")
        await say(proc, "look", media=[ImageContent(data=PNG64, mime_type="image/png")])

        async def failing(*args: Any, **kw: Any) -> None:
            raise StoreError("disk I/O error")

        monkeypatch.setattr(k.store, "append_event", failing)
        with pytest.raises(StoreError, match="disk I/O"):
            await k.fork(proc.pid, new_pid="fork-1")
        monkeypatch.undo()
        assert not (tmp_path / "var" / "media" / "alice" / "fork-1").exists()
        assert len(await k.processes()) == 1
        assert (await k.fork(proc.pid, new_pid="fork-1")).pid == "fork-1"  # and it can be asked again
        assert any((tmp_path / "var" / "media" / "alice" / "fork-1").iterdir())


# ------------------------------------------------------------------ HTTP and the client


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("fork")) as srv:
        yield srv


async def test_the_fork_route(server: LiveServer) -> None:
    async with server.client(server.tokens.alice) as alice, server.client(server.tokens.bob) as bob:
        pid = checked(await alice.post("/v1/processes", json={"text": "hello"}), api.ProcessOut, 201)["pid"]
        await wait_idle(alice, pid)
        await alice.post(f"/v1/processes/{pid}/messages", json={"text": "echo more"})
        await wait_idle(alice, pid)
        history = (await alice.get(f"/v1/processes/{pid}/messages")).json()["messages"]
        first = history[0]["id"]
        made = checked(await alice.post(f"/v1/processes/{pid}/fork", json={"at": first}), api.ForkOut, 201)
        assert made["owner"] == "alice" and made["pid"] != pid
        assert made["forked_from"] == {"pid": pid, "at": first}
        copied = (await alice.get(f"/v1/processes/{made['pid']}/messages")).json()["messages"]
        assert [m["message"] for m in copied] == [history[0]["message"]]
        whole = checked(await alice.post(f"/v1/processes/{pid}/fork", json={}), api.ForkOut, 201)
        assert len((await alice.get(f"/v1/processes/{whole['pid']}/messages")).json()["messages"]) == len(history)
        refused(await bob.post(f"/v1/processes/{pid}/fork", json={}), 404, "not_found")
        refused(await alice.post(f"/v1/processes/{pid}/fork", json={"at": 999999}), 400, "invalid_request")
        refused(await alice.post(f"/v1/processes/{pid}/fork", json={"at": 1, "segment": "s"}), 400, "invalid_request")
        refused(await alice.post(f"/v1/processes/{pid}/fork", json={"segment": "nope"}), 404, "not_found")
        refused(await alice.post(f"/v1/processes/{pid}/fork", json={"at": "1"}), 400, "invalid_request")
        roles = [m["message"]["role"] for m in history]
        assert roles == ["user", "assistant", "user", "assistant", "toolResult", "assistant"]
        inside = await alice.post(f"/v1/processes/{pid}/fork", json={"at": history[3]["id"]})
        refused(inside, 400, "invalid_request")
        assert f"fork at message {history[2]['id']}" in inside.json()["message"]


async def test_a_retried_fork_with_a_fork_id_makes_one_fork(server: LiveServer) -> None:
    async with server.client(server.tokens.alice) as alice, server.client(server.tokens.bob) as bob:
        pid = checked(await alice.post("/v1/processes", json={"text": "hello"}), api.ProcessOut, 201)["pid"]
        await wait_idle(alice, pid)
        other = checked(await alice.post("/v1/processes", json={}), api.ProcessOut, 201)["pid"]
        count = len((await alice.get("/v1/processes")).json()["processes"])
        made = checked(await alice.post(f"/v1/processes/{pid}/fork", json={"fork_id": "f1"}), api.ForkOut, 201)
        again = checked(await alice.post(f"/v1/processes/{pid}/fork", json={"fork_id": "f1"}), api.ForkOut, 201)
        assert again == made and again["forked_from"] == {"pid": pid, "at": 2}
        # the same id for another source is another fork; the quota counts each fork once
        elsewhere = checked(await alice.post(f"/v1/processes/{other}/fork", json={"fork_id": "f1"}), api.ForkOut, 201)
        assert elsewhere["pid"] != made["pid"]
        assert len((await alice.get("/v1/processes")).json()["processes"]) == count + 2
        refused(await bob.post(f"/v1/processes/{pid}/fork", json={"fork_id": "f1"}), 404, "not_found")
        refused(await alice.post(f"/v1/processes/{pid}/fork", json={"fork_id": ""}), 400, "invalid_request")
        refused(await alice.post(f"/v1/processes/{pid}/fork", json={"fork_id": "x\u0000"}), 400, "invalid_request")
        assert (await alice.delete(f"/v1/processes/{made['pid']}")).status_code == 200
        refused(await alice.post(f"/v1/processes/{pid}/fork", json={"fork_id": "f1"}), 409, "conflict")


async def test_a_fork_counts_against_the_account_quota(server: LiveServer) -> None:
    assert server.ctx is not None
    async with server.client(server.tokens.alice) as alice:
        pid = checked(await alice.post("/v1/processes", json={}), api.ProcessOut, 201)["pid"]
        live = len((await alice.get("/v1/processes")).json()["processes"])
        server.ctx.max_processes = live
        try:
            refused(await alice.post(f"/v1/processes/{pid}/fork", json={}), 409, "conflict")
            assert len((await alice.get("/v1/processes")).json()["processes"]) == live
            server.ctx.max_processes = live + 1
            assert (await alice.post(f"/v1/processes/{pid}/fork", json={})).status_code == 201
        finally:
            server.ctx.max_processes = 1000


async def test_the_client_forks(server: LiveServer) -> None:
    async with AgentloopClient(server.url, token=server.tokens.alice) as client:
        pid = (await client.spawn())["pid"]
        await client.send(pid, "hello")
        async with server.client(server.tokens.alice) as alice:
            await wait_idle(alice, pid)
        segment_less = await client.fork(pid)
        assert segment_less["forked_from"]["pid"] == pid
        first = (await client.history(pid))["messages"][0]["id"]
        assert (await client.fork(pid, at=first))["forked_from"] == {"pid": pid, "at": first}
        await client.reset(pid)
        segment = (await client.segments(pid))[0]["id"]
        made = await client.fork(pid, segment=segment)
        assert made["forked_from"] == {"pid": pid, "segment": segment}
        retried = await client.fork(pid, segment=segment, fork_id="c1")
        assert (await client.fork(pid, segment=segment, fork_id="c1"))["pid"] == retried["pid"] != made["pid"]
        with pytest.raises(NotFound):
            await client.fork("no-such-process")
        assert server.ctx is not None
        server.ctx.max_processes = len(await client.processes())
        try:
            with pytest.raises(Conflict):
                await client.fork(pid)
        finally:
            server.ctx.max_processes = 1000


# ------------------------------------------------------------------ PostgreSQL


async def test_a_fork_on_postgres(pg_url: str, tmp_path: Path) -> None:
    pytest.importorskip("asyncpg")
    model = ScriptedModel(answer)
    async with open_kernel(tmp_path, model, pg_url) as k:
        proc = await k.spawn(owner="alice")
        await say(proc, "one")
        await say(proc, "two")
        first = (await proc.history())[1].id
        fork = await proc.fork(at=first)
        await say(fork, "again")
        assert user_texts(model.requests[-1]) == ["one", "again"]
        pid = fork.pid
    async with open_kernel(tmp_path, ScriptedModel(answer), pg_url) as k:
        fork = await k.process(pid)
        assert texts(await fork.messages()) == ["one", "seen: one", "again", "seen: one, again"]
        assert (await k.store.kv_get(pid, FORKED_KEY))["at"] == first


# ------------------------------------------------------------------ agentloop chat

isolated = test_prompt_manifest.isolated  # a config-free environment for the CLI


def test_chat_slash_fork_goes_on_in_a_copy(tmp_path: Path, isolated: None) -> None:
    register_provider("forkchat", lambda model_id: ScriptedModel(answer))
    ws = tmp_path / "ws"
    ws.mkdir()
    stdin = "one\ntwo\n/fork 2\nthree\n/fork\nfour\n/fork 9\n/fork x\n/fork 1\n/help\n"
    result = CliRunner().invoke(
        app, ["chat", "-m", "forkchat:x", "-w", str(ws), "--data", str(tmp_path / "data")], input=stdin
    )
    assert "Traceback" not in result.stderr
    err = " ".join(result.stderr.split())
    assert "(forked: a new conversation with 2 messages, before your message 2; the old one is kept)" in err
    assert "(forked: a new conversation with 4 messages, all of it; the old one is kept)" in err
    assert "this conversation has 3 messages of yours" in err
    assert "usage: /fork [N]" in err
    assert "nothing comes before your first message" in err
    assert "/fork [N]" in err
    out = result.stdout
    assert "seen: one, two" in out and "seen: one, three" in out and "seen: one, three, four" in out


# ------------------------------------------------------------------ the remote chat

remote_server = server_support.module_server("fork-remote")


def test_remote_chat_forks_the_servers_conversation(remote_server: LiveServer) -> None:
    """``agentloop chat --server``: ``/fork 2`` goes on in a copy of what came before the second
    message, on the server; the original conversation is kept."""
    import io

    from rich.console import Console

    from agentloop.cli.chat import ChatRepl, PlainReader
    from agentloop.cli.client import RemoteSession
    from agentloop.client import AgentloopClient

    err = io.StringIO()
    ev = asyncio.new_event_loop()
    client = AgentloopClient(remote_server.url, remote_server.tokens.bob)
    try:
        session = RemoteSession(client)
        ev.run_until_complete(session.open(new=True))
        first = session.pid
        stdin = "one\ntwo\n/fork 9\n/fork 2\nthree\n"
        repl = ChatRepl(session, reader=PlainReader(io.StringIO(stdin)), out=io.StringIO(), err=Console(file=err))
        repl.loop(ev)
        forked = ev.run_until_complete(client.history(session.pid, limit=100))["messages"]
        original = ev.run_until_complete(client.history(first, limit=100))["messages"]
    finally:
        ev.run_until_complete(client.aclose())
        ev.close()
    shown = " ".join(err.getvalue().split())
    assert "no fork" not in shown and "not forked: this conversation has 2 messages of yours" in shown
    assert "(forked: a new conversation with 2 messages, before your message 2" in shown
    assert session.pid != first
    assert [m["message"]["content"][0]["text"] for m in forked] == ["one", "answer: one", "three", "answer: three"]
    assert len(original) == 4  # one, its answer, two, its answer: kept


# ------------------------------------------------------------------ the WebSocket


def test_websocket_forks_a_process(tmp_path: Path) -> None:
    from tests.ws_support import KernelServer

    model = ScriptedModel(lambda req: f"answer: {req.messages[-1].text}")
    with KernelServer(tmp_path, model) as server, server.client("alice") as c, server.client("bob") as bob:
        pid = c.ok("proc.spawn", {"text": "one"})["pid"]
        for _ in range(200):
            if len(c.ok("proc.history", {"pid": pid})["messages"]) == 2:
                break
            time.sleep(0.02)
        [first, _] = c.ok("proc.history", {"pid": pid})["messages"]
        made = c.ok("proc.fork", {"pid": pid, "at": first["id"], "context": "a fork"})
        assert made["pid"] != pid and made["forked_from"] == {"pid": pid, "at": first["id"]}
        assert [m["message"]["role"] for m in c.ok("proc.history", {"pid": made["pid"]})["messages"]] == ["user"]
        assert c.error("proc.fork", {"pid": pid, "at": 999}) == "invalid_request"
        assert c.error("proc.fork", {"pid": pid, "at": "one"}) == "invalid_request"
        assert bob.error("proc.fork", {"pid": pid}) == "not_found"
        once = c.ok("proc.fork", {"pid": pid, "fork_id": "w1"})
        assert c.ok("proc.fork", {"pid": pid, "fork_id": "w1"})["pid"] == once["pid"]
        assert c.error("proc.fork", {"pid": pid, "fork_id": ""}) == "invalid_request"
