"""Process titles: a short name per process instead of a bare pid, for the web UI's sidebar,
``agentloop ps`` and the chat's ``/title``.

After the first run of a conversation a title is derived in the background (from the first user
message, or by asking the model once with ``titles="model"``); a title a person set wins over it
and survives restarts and resets; a reset clears an automatic one. Changes are announced with a
live-only ``proc.changed`` (``changes: ["title"]``).
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.cli.chat import ChatRepl, PlainReader
from agentloop.cli.client import RemoteSession
from agentloop.cli.main import app
from agentloop.client import AgentloopClient, ClientError
from agentloop.kernel import Kernel, NoSuchProcess, Process
from agentloop.kernel.titles import TITLE_PROMPT, check_title, clean_title, fallback_title
from agentloop.messages import UserMessage
from agentloop.models.base import ModelRequest
from agentloop.models.registry import register_provider
from agentloop.process import signals as sig
from agentloop.server import api
from tests import server_support, test_prompt_manifest
from tests.cdp import Browser
from tests.process_support import kernel
from tests.server_support import LiveServer
from tests.test_web_ui_browser import replies, served  # noqa: F401 - fixtures
from tests.ws_support import KernelServer

LONG = "  Plan the migration of our billing\tservice to Postgres with zero downtime and a rollback plan  \nmore"
LONG_TITLE = "Plan the migration of our billing service to Postgres with…"

gate = asyncio.Event()


def new_gate() -> None:
    """A closed gate for this test (an event is bound to the loop that first waits on it)."""
    global gate
    gate = asyncio.Event()


@tool
async def wait_gate() -> str:
    """Wait until the test opens the gate."""
    await gate.wait()
    return "opened"


def brain(req: ModelRequest) -> Reply | str:
    """A tool call on "gate …" messages, else an answer; the title request is answered "Lisbon"."""
    last = req.messages[-1]
    if req.system_prompt == TITLE_PROMPT:
        return '"Lisbon trip."'
    if isinstance(last, UserMessage) and last.text.startswith("gate"):
        return Reply(tool_calls=[call("wait_gate")])
    if isinstance(last, ToolResultMessage):
        return "done"
    return "answer"


def titles_kernel(tmp_path: Path, model: Any = None, **kw: Any) -> Any:
    return kernel(tmp_path, model or ScriptedModel(brain), tools=[wait_gate], **kw)


async def titled(proc: Process) -> str:
    """The process's title, once it has one."""
    async with asyncio.timeout(5):
        while (title := await proc.title()) is None:
            await asyncio.sleep(0.01)
    return title


async def settle(kernel: Kernel) -> None:
    """Let the background title work end (it has nothing left to do after this)."""
    for _ in range(50):
        if not kernel.titles.busy:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("title work still running")


# ------------------------------------------------------------------ the rules of a title


def test_the_fallback_is_the_first_line_cut_at_a_word_boundary() -> None:
    assert fallback_title(LONG) == LONG_TITLE and len(LONG_TITLE) <= 60
    assert fallback_title("hello world") == "hello world"
    assert fallback_title("\n\n   hi   there \n second") == "hi there"
    assert fallback_title("x" * 100) == "x" * 59 + "…"
    assert fallback_title("a\x07b\x1b[31m") == "a b [31m"
    assert fallback_title("   \n\t ") is None and fallback_title("") is None
    assert (
        fallback_title("a whole file on one line " * 50_000)
        == "a whole file on one line a whole file on one line a whole…"
    )
    assert fallback_title("\u202eevil\u2028twin") == "evil twin"


def test_a_model_answer_is_cleaned_or_refused() -> None:
    assert clean_title('"Billing migration plan."') == "Billing migration plan"
    assert clean_title("Title: **Lisbon trip**") == "Lisbon trip"
    assert clean_title("**Title:** Lisbon") == "Lisbon"
    assert clean_title("# Heading\nmore words") == "Heading"
    assert clean_title("  \n  «Quarterly report»  ") == "Quarterly report"
    for garbage in ("", "   ", "***", "...", "\n\n", "“”"):
        assert clean_title(garbage) is None
    long = clean_title("word " * 40)
    assert long is not None and len(long) <= 80 and long.endswith("…") and not long.startswith(" ")


def test_a_user_title_is_one_trimmed_line_of_plain_text() -> None:
    assert check_title("  Mine  ") == "Mine"
    assert check_title("x" * 120) == "x" * 120
    assert check_title("Café ☕ 👩‍💻") == "Café ☕ 👩‍💻"  # (a zero-width joiner is not a control character)
    for bad in ("", "   ", "a\nb", "a\tb", "x" * 121, "a\x00b", "a\u202eb", "a\u2028b", "bad\udcff"):
        with pytest.raises(ValueError):
            check_title(bad)
    with pytest.raises(TypeError):
        check_title(5)  # type: ignore[arg-type]


# ------------------------------------------------------------------ the kernel


async def test_a_title_comes_from_the_first_message_once_the_first_run_has_finished(tmp_path: Path) -> None:
    new_gate()
    async with titles_kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice", text="gate " + LONG)
        await asyncio.sleep(0.05)
        assert await proc.title() is None  # not before the first run has finished
        assert (await proc.info()).title is None
        gate.set()
        await proc.wait_idle()
        assert await titled(proc) == "gate " + LONG_TITLE[: LONG_TITLE.rindex(" ")] + "…"
        assert (await proc.info()).title == await proc.title()
        assert [r.title for r in await k.processes("alice")] == [await proc.title()]
        logged = [s.signal for s in await drain(proc)]
        assert logged[-1] == sig.RUN_FINISHED  # (announced live only: the log stays the conversation's)


async def drain(proc: Process) -> list[sig.Signal]:
    return [s async for s in proc.signals(follow=False)]


async def test_a_title_is_made_once_and_later_runs_keep_it(tmp_path: Path) -> None:
    asked: list[str] = []

    async def namer(record: Any, text: str) -> str:
        asked.append(text)
        return f"Named: {text}"

    async with titles_kernel(tmp_path, titles=namer) as k:
        proc = await k.spawn(owner="alice", text="first question")
        await proc.wait_idle()
        assert await titled(proc) == "Named: first question"
        await proc.send("second question")
        await proc.wait_idle()
        await settle(k)
        assert asked == ["first question"] and await proc.title() == "Named: first question"
        quiet = await k.spawn(owner="alice")  # no message yet: nothing to name it after
        await asyncio.sleep(0.05)
        assert await quiet.title() is None and asked == ["first question"]


async def test_a_system_event_does_not_name_the_process_but_the_first_user_message_does(tmp_path: Path) -> None:
    async with titles_kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice")
        await k.signal(proc.pid, "the nightly build failed")
        await proc.wait_idle()
        await settle(k)
        assert await proc.title() is None
        await proc.send("why did the build fail?")
        await proc.wait_idle()
        assert await titled(proc) == "why did the build fail?"


async def test_model_titles_ask_the_model_once_and_fall_back_when_it_fails(tmp_path: Path) -> None:
    answers: list[Any] = []

    def model_brain(req: ModelRequest) -> Any:
        if req.system_prompt == TITLE_PROMPT:
            assert req.tools == [] and [m.text for m in req.messages] == ["plan a trip to Lisbon"]
            return answers.pop(0)
        return brain(req)

    model = ScriptedModel(model_brain)
    async with titles_kernel(tmp_path, model, titles="model") as k:
        answers.append('"Lisbon trip."')
        proc = await k.spawn(owner="alice", text="plan a trip to Lisbon")
        await proc.wait_idle()
        assert await titled(proc) == "Lisbon trip"
        for failure in (RuntimeError("provider down"), "", "***", Reply(text="  \n ")):
            answers.append(failure)
            other = await k.spawn(owner="alice", text="plan a trip to Lisbon")
            await other.wait_idle()
            assert await titled(other) == "plan a trip to Lisbon", failure  # the fallback
        assert answers == []  # each asked exactly once
        asked = [r for r in model.requests if r.system_prompt == TITLE_PROMPT]
        assert len(asked) == 5


async def test_a_title_function_that_raises_or_answers_garbage_keeps_the_fallback(tmp_path: Path) -> None:
    async def broken(record: Any, text: str) -> str:
        raise ValueError("no")

    async def garbage(record: Any, text: str) -> str:
        return "\n\n"

    for namer in (broken, garbage):
        async with titles_kernel(tmp_path / namer.__name__, titles=namer) as k:
            proc = await k.spawn(owner="alice", text="hello there")
            await proc.wait_idle()
            assert await titled(proc) == "hello there"


async def test_no_automatic_titles_when_turned_off(tmp_path: Path) -> None:
    async with titles_kernel(tmp_path, titles=None) as k:
        proc = await k.spawn(owner="alice", text="hello there")
        await proc.wait_idle()
        await asyncio.sleep(0.05)
        assert await proc.title() is None and not k.titles.busy
        assert await proc.set_title("By hand") == "By hand"
    with pytest.raises(ValueError):
        async with titles_kernel(tmp_path, titles="poetry"):
            pass


async def test_a_user_title_wins_and_survives_a_restart(tmp_path: Path) -> None:
    new_gate()
    async with titles_kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice", text="gate the first message")
        assert await proc.set_title("  My own title  ") == "My own title"  # during the first run
        gate.set()
        await proc.wait_idle()
        await settle(k)
        assert await proc.title() == "My own title"  # never overwritten by the automatic one
        pid = proc.pid
    async with titles_kernel(tmp_path) as k:
        proc = await k.process(pid)
        assert await proc.title() == "My own title" and (await proc.info()).title == "My own title"
        assert [r.title for r in await k.processes("alice")] == ["My own title"]


async def test_bad_titles_are_refused_and_change_nothing(tmp_path: Path) -> None:
    async with titles_kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice")
        await proc.set_title("Kept")
        for bad in ("", "two\nlines", "x" * 121, "nul\x00"):
            with pytest.raises(ValueError):
                await proc.set_title(bad)
        with pytest.raises(TypeError):
            await proc.set_title(42)  # type: ignore[arg-type]
        assert await proc.title() == "Kept"
        await proc.kill()
        with pytest.raises(NoSuchProcess):
            await proc.set_title("gone")
        with pytest.raises(NoSuchProcess):
            await proc.title()


async def test_clearing_a_user_title_hands_it_back_to_the_automatic_one(tmp_path: Path) -> None:
    async with titles_kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice", text="what is the plan")
        await proc.wait_idle()
        assert await titled(proc) == "what is the plan"
        await proc.set_title("Mine")
        assert await proc.set_title(None) is None
        assert await titled(proc) == "what is the plan"


async def test_a_reset_clears_an_automatic_title_and_keeps_a_users(tmp_path: Path) -> None:
    async with titles_kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice", text="first topic")
        await proc.wait_idle()
        assert await titled(proc) == "first topic"
        await proc.reset()
        assert await proc.title() is None  # the fresh conversation earns its own
        await proc.send("second topic")
        await proc.wait_idle()
        assert await titled(proc) == "second topic"

        mine = await k.spawn(owner="alice", text="anything")
        await mine.wait_idle()
        await mine.set_title("Pinned")
        await mine.reset()
        await mine.send("something else")
        await mine.wait_idle()
        await settle(k)
        assert await mine.title() == "Pinned"


async def test_reset_kill_and_close_cancel_the_title_being_made(tmp_path: Path) -> None:
    started: list[str] = []
    cancelled: list[str] = []

    async def stuck(record: Any, text: str) -> str:
        started.append(record.pid)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(record.pid)
            raise
        return "never"

    async def begun(pid: str) -> None:
        async with asyncio.timeout(5):
            while pid not in started:
                await asyncio.sleep(0.01)

    async with titles_kernel(tmp_path, titles=stuck) as k:
        reset = await k.spawn(owner="alice", text="one")
        killed = await k.spawn(owner="alice", text="two")
        closed = await k.spawn(owner="alice", text="three")
        for proc in (reset, killed, closed):
            await proc.wait_idle()
            await begun(proc.pid)
        await reset.reset()
        await killed.kill()
        assert cancelled == [reset.pid, killed.pid]
        assert await reset.title() is None
    assert cancelled == [reset.pid, killed.pid, closed.pid]
    async with titles_kernel(tmp_path) as k:  # the close did not wait for the model: the fallback names it
        assert await (await k.process(closed.pid)).title() == "three"
        assert await (await k.process(reset.pid)).title() is None


async def test_a_title_made_just_before_the_kernel_closes_is_written(tmp_path: Path) -> None:
    async with titles_kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice", text="quit right after the answer")
        await proc.wait_idle()  # the title waits for the writer's next batch: the close writes it
    async with titles_kernel(tmp_path) as k:
        assert await (await k.process(proc.pid)).title() == "quit right after the answer"


async def test_a_first_run_resumed_after_a_restart_still_names_the_process(tmp_path: Path) -> None:
    new_gate()
    async with titles_kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice", text="gate and then a restart")
        await asyncio.sleep(0.05)
        pid = proc.pid
    gate.set()
    async with titles_kernel(tmp_path) as k:
        proc = await k.process(pid)
        await proc.wait_idle()
        assert await titled(proc) == "gate and then a restart"


async def test_changes_are_announced_to_followers_and_the_account_stream(tmp_path: Path) -> None:
    async with titles_kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice")
        account = k.account_signals("alice")
        heard = asyncio.ensure_future(anext(account))
        await asyncio.sleep(0)

        async def first_title_change() -> sig.Signal:
            async for s in proc.signals(follow=True):
                if s.signal == sig.CHANGED and "title" in s.payload.get("changes", ()):
                    return s
            raise AssertionError("the stream ended")

        following = asyncio.ensure_future(first_title_change())
        await asyncio.sleep(0.05)
        await proc.send("name me please")
        changed = await asyncio.wait_for(following, 5)
        assert changed.payload == {"pid": proc.pid, "changes": ["title"], "title": "name me please"}
        assert changed.seq is None
        finished = await asyncio.wait_for(heard, 5)
        assert finished.signal.signal == sig.RUN_FINISHED and finished.seq is not None
        told = await asyncio.wait_for(anext(account), 5)
        assert (told.pid, told.signal.signal, told.signal.payload["title"]) == (proc.pid, sig.CHANGED, "name me please")
        assert told.seq is None  # (a title is announced live only: no account seq)
        await proc.set_title("By hand")
        told = await asyncio.wait_for(anext(account), 5)
        assert told.signal.payload == {"pid": proc.pid, "changes": ["title"], "title": "By hand"}
        await account.aclose()


async def test_kv_add_adds_only_where_no_row_is_for_the_generation_named(tmp_path: Path) -> None:
    async with titles_kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice")
        store = k.store
        async with store.transaction():
            assert not await store.kv_add(proc.pid, "title", {"text": "a"}, generation=2)  # a later conversation's
            assert not await store.kv_add("no-such-pid", "title", {"text": "a"}, generation=1)
            assert await store.kv_add(proc.pid, "title", {"text": "a"}, generation=1)
            assert not await store.kv_add(proc.pid, "title", {"text": "b"}, generation=1)  # never overwrites
        assert await store.kv_get(proc.pid, "title") == {"text": "a"}
        assert await store.kv_values("title", "alice") == {proc.pid: {"text": "a"}}
        assert await store.kv_values("title", "bob") == {} and proc.pid in await store.kv_values("title")


async def test_titles_on_postgres(pg_url: str, tmp_path: Path) -> None:
    pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")
    opened = Kernel.open(pg_url, model=ScriptedModel(brain), workspace=tmp_path, data_dir=tmp_path, tools=[])
    async with opened as k:
        auto = await k.spawn(owner="alice", text="a postgres conversation")
        await auto.wait_idle()
        assert await titled(auto) == "a postgres conversation"
        mine = await k.spawn(owner="alice")
        assert await mine.set_title("By hand") == "By hand"
        await k.spawn(owner="bob", text="not alice's")
        titles = {r.pid: r.title for r in await k.processes("alice")}
        assert titles == {auto.pid: "a postgres conversation", mine.pid: "By hand"}
        await auto.reset()
        assert await auto.title() is None
        async with k.store.transaction():  # an old conversation's title is not added to the new one
            assert not await k.store.kv_add(auto.pid, "title", {"text": "stale", "source": "auto"}, generation=1)
            assert not await k.store.kv_add("no-such-pid", "title", {"text": "x"}, generation=1)
            assert not await k.store.kv_add(mine.pid, "title", {"text": "x"}, generation=1)  # (one is there)
            assert await k.store.kv_add(auto.pid, "title", {"text": "fresh", "source": "auto"}, generation=2)
        assert await auto.title() == "fresh"


# ------------------------------------------------------------------ HTTP, WebSocket, client, CLI


server = server_support.module_server("titles")
alice = server_support.alice


async def http_titled(client: httpx.AsyncClient, pid: str) -> str:
    async with asyncio.timeout(5):
        while (title := (await client.get(f"/v1/processes/{pid}")).json()["title"]) is None:
            await asyncio.sleep(0.01)
    return str(title)


async def test_http_shows_and_sets_titles(server: LiveServer, alice: httpx.AsyncClient) -> None:
    spawned = (await alice.post("/v1/processes", json={"text": "plan the trip to Lisbon"})).json()
    api.ProcessOut.model_validate(spawned)
    pid = spawned["pid"]
    assert await http_titled(alice, pid) == "plan the trip to Lisbon"
    listed = (await alice.get("/v1/processes")).json()
    api.ProcessList.model_validate(listed)
    assert [p["title"] for p in listed["processes"] if p["pid"] == pid] == ["plan the trip to Lisbon"]

    resp = await alice.post(f"/v1/processes/{pid}/title", json={"title": "  Lisbon  "})
    assert resp.status_code == 200 and resp.json() == {"pid": pid, "title": "Lisbon"}
    api.TitleOut.model_validate(resp.json())
    got = await alice.get(f"/v1/processes/{pid}/title")
    assert got.status_code == 200 and got.json() == {"pid": pid, "title": "Lisbon"}
    assert (await alice.get(f"/v1/processes/{pid}")).json()["title"] == "Lisbon"

    for bad in ({"title": "two\nlines"}, {"title": "x" * 121}, {"title": ""}, {"title": 5}, {}, {"name": "x"}):
        resp = await alice.post(f"/v1/processes/{pid}/title", json=bad)
        assert resp.status_code == 400 and resp.json()["code"] == "invalid_request", (bad, resp.text)
    assert (await alice.get(f"/v1/processes/{pid}/title")).json()["title"] == "Lisbon"

    async with server.client(server.tokens.bob) as bob:
        assert (await bob.post(f"/v1/processes/{pid}/title", json={"title": "mine"})).status_code == 404
        assert (await bob.get(f"/v1/processes/{pid}/title")).status_code == 404
    resp = await alice.post(f"/v1/processes/{pid}/title", json={"title": None})
    assert resp.status_code == 200 and resp.json() == {"pid": pid, "title": None}
    assert await http_titled(alice, pid) == "plan the trip to Lisbon"  # the automatic one again


def test_the_openapi_document_has_the_title_routes() -> None:
    paths = api.openapi_document()["paths"]
    assert {"get", "post"} <= set(paths["/v1/processes/{pid}/title"])
    assert "title" in api.ProcessOut.model_fields


def test_websocket_title_calls_and_signal(tmp_path: Path) -> None:
    with KernelServer(tmp_path, ScriptedModel(brain)) as server, server.client("alice") as c:
        pid = c.ok("proc.spawn", {})["pid"]
        c.ok("proc.subscribe", {"pid": pid})
        assert c.ok("proc.title", {"pid": pid}) == {"pid": pid, "title": None}
        assert c.ok("proc.title", {"pid": pid, "title": " Named "}) == {"pid": pid, "title": "Named"}
        changed = c.signals_until(pid, sig.CHANGED)[-1]
        assert changed["payload"] == {"pid": pid, "changes": ["title"], "title": "Named"} and changed["seq"] is None
        assert c.ok("proc.get", {"pid": pid})["title"] == "Named"
        assert [p["title"] for p in c.ok("proc.list")["processes"]] == ["Named"]
        for bad in ({"pid": pid, "title": "a\nb"}, {"pid": pid, "title": 3}, {"pid": pid, "title": ["x"]}):
            assert c.error("proc.title", bad) == "invalid_request"
        assert c.ok("proc.title", {"pid": pid, "title": None}) == {"pid": pid, "title": None}
        with server.client("bob") as bob:
            assert bob.error("proc.title", {"pid": pid, "title": "x"}) == "not_found"


async def test_client_methods(server: LiveServer) -> None:
    async with AgentloopClient(server.url, server.tokens.alice) as client:
        pid = (await client.spawn())["pid"]
        assert await client.title(pid) is None
        assert await client.set_title(pid, " Client title ") == "Client title"
        assert await client.title(pid) == "Client title"
        assert [p["title"] for p in await client.processes() if p["pid"] == pid] == ["Client title"]
        with pytest.raises(ClientError) as bad:
            await client.set_title(pid, "a\nb")
        assert bad.value.status == 400 and bad.value.code == "invalid_request"
        assert await client.set_title(pid, None) is None and (await client.process(pid))["title"] is None


def test_ps_shows_the_title(server: LiveServer) -> None:
    async def make() -> str:
        async with AgentloopClient(server.url, server.tokens.bob) as client:
            pid = str((await client.spawn())["pid"])
            await client.set_title(pid, "Shown in ps")
            return pid

    pid = asyncio.run(make())
    result = CliRunner().invoke(app, ["ps", "--server", server.url, "--token", server.tokens.bob])
    assert result.exit_code == 0, result.output
    header, *rows = result.output.splitlines()
    assert header.split("\t")[-1] == "title"
    row = next(r for r in rows if r.startswith(pid))
    assert row.split("\t")[-1] == "Shown in ps"


# ------------------------------------------------------------------ chat


isolated = test_prompt_manifest.isolated  # a config-free environment for the CLI


def test_chat_slash_title_shows_and_sets_it(tmp_path: Path, isolated: None) -> None:
    scripted = ScriptedModel(["an answer"])
    register_provider("titles", lambda _id: scripted)
    ws = tmp_path / "ws"
    ws.mkdir()
    stdin = "/title\n/title  Pinned title \n/title\n/title bad\x07title\n"
    result = CliRunner().invoke(
        app, ["chat", "-m", "titles:x", "-w", str(ws), "--data", str(tmp_path / "data")], input=stdin
    )
    assert result.exit_code == 1, result.stderr  # (a command that failed fails a piped chat)
    assert "Traceback" not in result.stderr
    err = " ".join(result.stderr.split())
    assert "(no title yet" in err
    assert "(title set: Pinned title)" in err and "(title: Pinned title)" in err
    assert "error: " in err and "control characters" in err


def test_remote_chat_slash_title(server: LiveServer) -> None:
    err = io.StringIO()
    ev = asyncio.new_event_loop()
    client = AgentloopClient(server.url, server.tokens.bob)
    try:
        session = RemoteSession(client)
        ev.run_until_complete(session.open(new=True))
        reader = PlainReader(io.StringIO("/title Remote one\n/title\n"))
        repl = ChatRepl(session, reader=reader, out=io.StringIO(), err=Console(file=err, width=200))
        assert repl.loop(ev) == 0
        assert ev.run_until_complete(client.title(session.pid)) == "Remote one"
    finally:
        ev.run_until_complete(client.aclose())
        ev.close()
    assert "(title set: Remote one)" in err.getvalue() and "(title: Remote one)" in err.getvalue()


# ------------------------------------------------------------------ the web UI


@pytest.mark.parametrize("replies", [["The answer."]])
def test_the_sidebar_shows_the_title_with_the_pid_as_its_tooltip(
    served: tuple[str, str, Path],  # noqa: F811
    browser: Browser,
) -> None:
    url, token, _ = served
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers, timeout=10) as http:
        pid = http.post("/v1/processes", json={"text": "Summarise <b>the</b> quarterly numbers"}).json()["pid"]
        deadline = time.monotonic() + 10
        while http.get(f"/v1/processes/{pid}").json()["title"] is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        untitled = http.post("/v1/processes", json={}).json()["pid"]
    browser.navigate(url + "/")
    browser.wait("!document.getElementById('signin').hidden")
    browser.type_into("token", token)
    browser.eval("document.getElementById('signin-form').requestSubmit()")
    item = f"document.querySelector('#processes li[data-pid={json.dumps(pid)}]')"
    shown = browser.wait(f"{item} && {item}.querySelector('.name').textContent")
    assert shown == "Summarise <b>the</b> quarterly numbers"  # text, never markup
    assert browser.eval(f"{item}.title") == pid
    assert browser.eval(f"{item}.querySelector('b')") is None
    other = f"document.querySelector('#processes li[data-pid={json.dumps(untitled)}]')"
    assert browser.eval(f"{other}.querySelector('.name').textContent") == untitled  # no title: the pid

    # a title set elsewhere reaches the sidebar through the account stream
    with httpx.Client(base_url=url, headers=headers, timeout=10) as http:
        assert http.post(f"/v1/processes/{untitled}/title", json={"title": "Set elsewhere"}).status_code == 200
    browser.wait(f"{other}.querySelector('.name').textContent === 'Set elsewhere'")
    browser.click(f"#processes li[data-pid={json.dumps(pid)}]")
    browser.wait("document.getElementById('transcript').dataset.stream === 'live'")
    assert browser.eval("document.getElementById('proc-name').textContent") == shown
    assert browser.eval("document.getElementById('proc-title').textContent") == pid
