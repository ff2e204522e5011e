"""Manual compaction options: where the summary ends (``keep_last``: the newest N messages stay;
``through``: every message up to and including a message id goes) and a summary the caller wrote
(``summary``: no model call), through the library, HTTP (and the client) and the WebSocket.

A tool call is never parted from its results: ``keep_last`` keeps more, ``through`` summarises the
call's results too. Bad options are refused before anything changes; the archive, the segment row
and ``proc.compacted`` (reason ``manual``) are those of any compaction.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop import Reply, ScriptedModel, ToolResultMessage, call
from agentloop.kernel import Kernel, Process
from agentloop.messages import AssistantMessage, Message, SystemMessage, TextContent, ToolCall, user
from agentloop.models.base import ModelRequest
from agentloop.process.api import RunActive
from agentloop.process.compaction import MAX_SUMMARY, SUMMARY_KIND, SUMMARY_SYSTEM_PROMPT, explicit_cut
from agentloop.server import api
from tests.server_support import LiveServer, checked, echo, live_server, refused, slow, wait_idle
from tests.ws_support import KernelServer

WRITTEN = "The user sent parts 0 and 1; nothing is open."


class Recorder:
    """Answers ``re: <text>``; ``tools`` makes two ``echo`` calls in one reply, ``sleep N`` calls
    ``slow``, ``hold`` waits for ``gate``. Every summary request is kept in ``summaries``."""

    def __init__(self) -> None:
        self.summaries: list[ModelRequest] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = asyncio.Event()
        self.model = ScriptedModel(self.answer)

    async def answer(self, req: ModelRequest) -> Reply | str:
        if req.system_prompt == SUMMARY_SYSTEM_PROMPT:
            self.summaries.append(req)
            return "Summary: the model's."
        last = req.messages[-1]
        if isinstance(last, ToolResultMessage):
            return f"after tool: {last.text}"
        if last.text == "hold":
            self.waiting.set()
            await self.gate.wait()
        if last.text == "tools":
            return Reply(tool_calls=[call("echo", text="a"), call("echo", text="b")])
        if last.text.startswith("sleep "):
            return Reply(tool_calls=[call("slow", seconds=float(last.text[6:]))])
        return f"re: {last.text}"


LONG = "lorem ipsum dolor sit amet " * 80  # about 540 tokens: enough for the rules' own cut
TALK = (f"part 0 {LONG}", f"part 1 {LONG}", "tools", f"part 3 {LONG}")
# the history TALK leaves: 0 user, 1 re, 2 user, 3 re, 4 user "tools", 5 two calls, 6 result,
# 7 result, 8 after tool, 9 user, 10 re
CALLS = 5


def kernel(tmp_path: Path, rec: Recorder) -> Any:
    return Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=rec.model, workspace=tmp_path, data_dir=tmp_path, tools=[echo, slow]
    )


async def talked(k: Kernel) -> Process:
    proc = await k.spawn(owner="alice")
    for text in TALK:
        await proc.send(text)
        await proc.wait_idle()
    assert len(await proc.messages()) == 11
    return proc


async def logged(proc: Process) -> list[dict[str, Any]]:
    return [s.payload async for s in proc.signals(follow=False) if s.signal == "proc.compacted"]


def is_summary(m: Message) -> bool:
    return isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND


def reply(text: str, *calls: str) -> AssistantMessage:
    blocks: list[Any] = [TextContent(text=text)] if text else []
    blocks.extend(ToolCall(id=c, name="echo", arguments={}) for c in calls)
    return AssistantMessage(content=blocks)


def result(call_id: str) -> ToolResultMessage:
    return ToolResultMessage(tool_call_id=call_id, tool_name="echo", content=[TextContent(text="ok")])


def whole_calls(messages: list[Message]) -> bool:
    """Every tool result follows the assistant message that made its call, in the same list."""
    made: set[str] = set()
    for m in messages:
        if isinstance(m, AssistantMessage):
            made.update(c.id for c in m.tool_calls)
        if isinstance(m, ToolResultMessage) and m.tool_call_id not in made:
            return False
    return True


async def archived(proc: Process, segment_id: str | None) -> list[Message]:
    assert segment_id is not None
    return [m for _, m in (await proc.segment(segment_id, limit=1000)).messages]


# ---------------------------------------------------------------------------------- the cut


def test_the_explicit_cut_never_parts_a_call_from_its_results() -> None:
    messages: list[Message] = [
        user("a"),
        reply("b"),
        user("tools"),
        reply("", "c1", "c2"),
        result("c1"),
        result("c2"),
        reply("after"),
    ]
    assert [explicit_cut(messages, keep_last=k) for k in range(8)] == [7, 6, 3, 3, 3, 2, 1, 0]
    assert [explicit_cut(messages, through=t) for t in range(7)] == [1, 2, 3, 6, 6, 6, 7]
    with pytest.raises(ValueError):
        explicit_cut(messages, keep_last=1, through=1)
    with pytest.raises(ValueError):
        explicit_cut(messages, through=7)


# ---------------------------------------------------------------------------------- library


async def test_keep_last_keeps_the_newest_and_archives_the_rest(tmp_path: Path) -> None:
    rec = Recorder()
    async with kernel(tmp_path, rec) as k:
        proc = await talked(k)
        before = await proc.messages()
        done = await proc.compact(keep_last=2)
        after = await proc.messages()
        assert done.compacted and done.removed == 9 and len(rec.summaries) == 1
        assert is_summary(after[0]) and after[1:] == before[9:]
        assert await archived(proc, done.segment_id) == before[:9]
        [signal] = await logged(proc)
        assert signal["reason"] == "manual" and signal["kind"] == "summary" and signal["removed"] == 9
        [row] = await k.store.segments(proc.pid)
        assert row.kind == "compaction" and row.id == done.segment_id


async def test_keep_last_keeps_more_rather_than_part_a_call_from_its_results(tmp_path: Path) -> None:
    rec = Recorder()
    async with kernel(tmp_path, rec) as k:
        proc = await talked(k)
        before = await proc.messages()
        assert isinstance(before[7], ToolResultMessage)  # the 4 newest would start on a result
        done = await proc.compact(keep_last=4)
        after = await proc.messages()
        assert done.removed == CALLS and after[1:] == before[CALLS:] and whole_calls(after)
        assert await archived(proc, done.segment_id) == before[:CALLS]


async def test_through_summarises_up_to_a_message_and_past_a_calls_results(tmp_path: Path) -> None:
    rec = Recorder()
    async with kernel(tmp_path, rec) as k:
        plain, batch = await talked(k), await talked(k)
        stored = await plain.history()
        done = await plain.compact(through=stored[3].id)  # (ids are not positions: a second process)
        after = await plain.messages()
        assert done.removed == 4 and after[1:] == [m.message for m in stored[4:]]
        assert await archived(plain, done.segment_id) == [m.message for m in stored[:4]]

        stored = await batch.history()
        done = await batch.compact(through=stored[CALLS].id)  # the calls: their results go too
        after = await batch.messages()
        assert done.removed == 8 and after[1:] == [m.message for m in stored[8:]] and whole_calls(after)
        assert await archived(batch, done.segment_id) == [m.message for m in stored[:8]]
        assert [s["reason"] for s in await logged(batch)] == ["manual"]


async def test_a_supplied_summary_makes_no_model_call(tmp_path: Path) -> None:
    rec = Recorder()
    async with kernel(tmp_path, rec) as k:
        proc = await talked(k)
        before = await proc.messages()
        usage = (await proc.info()).usage
        done = await proc.compact(keep_last=7, summary=f"  {WRITTEN}\n")
        after = await proc.messages()
        assert done.compacted and done.removed == 4 and not rec.summaries
        assert is_summary(after[0]) and after[0].text.endswith(WRITTEN) and after[1:] == before[4:]
        assert await archived(proc, done.segment_id) == before[:4]
        assert (await proc.info()).usage == usage  # no call, nothing spent
        [signal] = await logged(proc)
        assert signal["reason"] == "manual" and signal["removed"] == 4 and signal["memory"] is None

        again = await proc.compact(summary="Second summary.")  # the rules' cut, the caller's text
        assert again.compacted and not rec.summaries
        newest = await proc.messages()
        assert newest[0].text.endswith("Second summary.") and WRITTEN not in newest[0].text
        assert is_summary((await archived(proc, again.segment_id))[0])  # the first summary, archived

        await proc.send("and now?")  # the conversation goes on from it
        await proc.wait_idle()
        assert (await proc.messages())[-1].text == "re: and now?"


async def test_bad_options_are_refused_and_change_nothing(tmp_path: Path) -> None:
    rec = Recorder()
    async with kernel(tmp_path, rec) as k:
        proc = await talked(k)
        before = await proc.history()
        bad: list[tuple[type[Exception], dict[str, Any]]] = [
            (ValueError, {"keep_last": 2, "through": before[3].id}),
            (ValueError, {"summary": WRITTEN, "instructions": "keep ids"}),
            (ValueError, {"summary": ""}),
            (ValueError, {"summary": " \n\t"}),
            (ValueError, {"summary": "x" * (MAX_SUMMARY + 1)}),
            (ValueError, {"summary": "a\x00b"}),
            (ValueError, {"summary": "red \x1b[31mtext"}),
            (ValueError, {"summary": "\ud800"}),
            (TypeError, {"summary": 5}),
            (ValueError, {"keep_last": -1}),
            (TypeError, {"keep_last": True}),
            (TypeError, {"keep_last": "2"}),
            (ValueError, {"through": -1}),
            (ValueError, {"through": before[-1].id + 1000}),  # not a message of the history
        ]
        for error, options in bad:
            with pytest.raises(error):
                await proc.compact(**options)
        assert await proc.history() == before and not rec.summaries
        assert not await logged(proc) and not await k.store.segments(proc.pid)

        nothing = await proc.compact(keep_last=11, summary=WRITTEN)  # keeps it all: a note, no change
        assert not nothing.compacted and "nothing" in nothing.note
        assert await proc.history() == before and not await k.store.segments(proc.pid)


async def test_only_while_idle(tmp_path: Path) -> None:
    rec = Recorder()
    async with kernel(tmp_path, rec) as k:
        proc = await talked(k)
        rec.gate.clear()
        await proc.send("hold")
        await asyncio.wait_for(rec.waiting.wait(), 5)
        before = await proc.history()
        for options in ({"keep_last": 2}, {"through": before[3].id}, {"summary": WRITTEN}):
            with pytest.raises(RunActive):
                await proc.compact(**options)
        assert await proc.history() == before
        rec.gate.set()
        await proc.wait_idle()
        assert not await logged(proc) and not rec.summaries


# ---------------------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def recorded() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, recorded: Recorder) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("compact10"), model=recorded.model) as srv:
        yield srv


@pytest.fixture
async def alice(server: LiveServer) -> Any:
    async with server.client(server.tokens.alice) as client:
        yield client


async def talked_over_http(client: httpx.AsyncClient) -> tuple[str, list[dict[str, Any]]]:
    pid: str = (await client.post("/v1/processes", json={})).json()["pid"]
    for text in TALK:
        assert (await client.post(f"/v1/processes/{pid}/messages", json={"text": text})).status_code == 202
        await wait_idle(client, pid)
    messages = (await client.get(f"/v1/processes/{pid}/messages")).json()["messages"]
    assert len(messages) == 11
    return pid, messages


async def test_http_takes_each_option(alice: httpx.AsyncClient, recorded: Recorder) -> None:
    pid, before = await talked_over_http(alice)
    base = f"/v1/processes/{pid}"
    done = checked(await alice.post(f"{base}/compact", json={"keep_last": 4, "summary": WRITTEN}), api.CompactOut)
    assert done["compacted"] and done["removed"] == CALLS and not recorded.summaries
    after = (await alice.get(f"{base}/messages")).json()["messages"]
    assert after[0]["message"]["kind"] == "summary" and WRITTEN in after[0]["message"]["content"][0]["text"]
    assert [m["message"] for m in after[1:]] == [m["message"] for m in before[CALLS:]]
    page = checked(await alice.get(f"{base}/segments/{done['segment_id']}"), api.SegmentPageOut)
    assert [m["message"] for m in page["messages"]] == [m["message"] for m in before[:CALLS]]

    # through the calls (now after[1]): the summary, they and both their results go
    done = checked(await alice.post(f"{base}/compact", json={"through": after[1]["id"]}), api.CompactOut)
    assert done["removed"] == 4 and len(recorded.summaries) == 1
    newest = (await alice.get(f"{base}/messages")).json()["messages"]
    assert [m["message"] for m in newest[1:]] == [m["message"] for m in after[4:]]
    [first, second] = checked(await alice.get(f"{base}/segments"), api.SegmentList)["segments"]
    assert first["reason"] == second["reason"] == "manual" and second["messages"] == 4


async def test_http_refuses_bad_options_with_nothing_changed(alice: httpx.AsyncClient, recorded: Recorder) -> None:
    pid, before = await talked_over_http(alice)
    base = f"/v1/processes/{pid}"
    summaries = len(recorded.summaries)
    for body in (
        {"keep_last": 2, "through": before[3]["id"]},
        {"summary": WRITTEN, "instructions": "keep ids"},
        {"summary": ""},
        {"summary": "   "},
        {"summary": "x" * (MAX_SUMMARY + 1)},
        {"summary": "bell\x07"},
        {"summary": 3},
        {"keep_last": -1},
        {"keep_last": "2"},
        {"through": before[-1]["id"] + 1000},
        {"keep": 2},
    ):
        refused(await alice.post(f"{base}/compact", json=body), 400, "invalid_request")
    assert (await alice.post(f"{base}/messages", json={"text": "sleep 30"})).status_code == 202
    try:
        refused(await alice.post(f"{base}/compact", json={"summary": WRITTEN, "keep_last": 1}), 409, "busy")
    finally:
        await alice.post(f"{base}/abort", json={})
    await wait_idle(alice, pid)
    after = (await alice.get(f"{base}/messages")).json()["messages"]
    assert after[:11] == before and len(recorded.summaries) == summaries
    assert checked(await alice.get(f"{base}/segments"), api.SegmentList)["segments"] == []


async def test_the_client_passes_the_options(server: LiveServer, recorded: Recorder) -> None:
    from agentloop.client import AgentloopClient

    async with server.client(server.tokens.alice) as http:
        pid, before = await talked_over_http(http)
    summaries = len(recorded.summaries)
    async with AgentloopClient(server.url, server.tokens.alice) as client:
        done = await client.compact(pid, through=before[1]["id"], summary=WRITTEN)
        assert done["compacted"] and done["removed"] == 2 and len(recorded.summaries) == summaries
        done = await client.compact(pid, keep_last=9)  # would take only the summary: nothing new
        assert not done["compacted"] and done["note"] and len(recorded.summaries) == summaries
        history = (await client.history(pid))["messages"]
    assert [m["message"] for m in history[1:]] == [m["message"] for m in before[2:]]


def test_the_options_are_documented() -> None:
    document = api.openapi_document()
    body = document["paths"]["/v1/processes/{pid}/compact"]["post"]["requestBody"]
    name = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    fields = document["components"]["schemas"][name]["properties"]
    assert {"keep_last", "through", "summary"} <= set(fields)


# ---------------------------------------------------------------------------------- WebSocket


def test_websocket_takes_each_option_with_the_same_rules(tmp_path: Path) -> None:
    rec = Recorder()
    with KernelServer(tmp_path, rec.model, tools=[echo, slow]) as srv:
        alice = srv.client("alice")
        try:
            pids = []
            for _ in range(2):
                pid = alice.ok("proc.spawn", {})["pid"]
                for text in TALK:
                    alice.ok("proc.send", {"pid": pid, "text": text})
                    for _ in range(500):
                        if alice.ok("proc.get", {"pid": pid})["state"] == "idle":
                            break
                        time.sleep(0.01)
                pids.append(pid)
            first, second = pids
            before = alice.ok("proc.history", {"pid": first})["messages"]
            assert len(before) == 11
            for args in (
                {"keep_last": 2, "through": before[3]["id"]},
                {"summary": WRITTEN, "instructions": "x"},
                {"summary": ""},
                {"summary": 7},
                {"keep_last": -1},
                {"through": before[-1]["id"] + 1000},
                {"keep": 1},
            ):
                assert alice.error("proc.compact", {"pid": first, **args}) == "invalid_request"
            assert alice.ok("proc.history", {"pid": first})["messages"] == before

            done = alice.ok("proc.compact", {"pid": first, "keep_last": 4, "summary": WRITTEN})
            api.CompactOut.model_validate(done)
            assert done["compacted"] and done["removed"] == CALLS and not rec.summaries
            after = alice.ok("proc.history", {"pid": first})["messages"]
            assert WRITTEN in after[0]["message"]["content"][0]["text"]

            other = alice.ok("proc.history", {"pid": second})["messages"]
            done = alice.ok("proc.compact", {"pid": second, "through": other[CALLS]["id"]})
            assert done["removed"] == 8 and len(rec.summaries) == 1
            page = alice.ok("proc.segment.read", {"pid": second, "segment_id": done["segment_id"], "limit": 100})
            assert [m["message"] for m in page["messages"]] == [m["message"] for m in other[:8]]

            alice.ok("proc.send", {"pid": first, "text": "sleep 30"})
            assert alice.error("proc.compact", {"pid": first, "summary": WRITTEN}) == "busy"
            alice.ok("proc.abort", {"pid": first})
        finally:
            alice.close()


def test_whole_calls_sees_a_parted_call() -> None:
    """(The checks above lean on ``whole_calls``.)"""
    assert whole_calls([user("x"), reply("", "c1"), result("c1")])
    assert not whole_calls([result("c1"), reply("after")])
