"""Durable processes on SQLite: runs, ticks, tool batches, input modes, abort, approvals, reset/kill, media."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import json

import pytest

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Approval, Kernel, NoSuchProcess
from agentloop.loop.runner import CANCELLED
from agentloop.messages import AssistantMessage, ImageContent, SystemMessage, UserMessage, message_from_dict
from agentloop.models.base import ModelRequest
from agentloop.process import calls as process_calls
from agentloop.process import engine as engine_module
from agentloop.process import signals as psig
from agentloop.process.archive import read_archive
from agentloop.process.media import MediaError
from agentloop.process.store import StoreError
from tests.process_support import kernel, ran

PNG = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
    )
).decode()


def by_tool_results(req: ModelRequest) -> Reply | str:
    """Call echo once per user message, then answer with what the tools said."""
    last = req.messages[-1]
    if isinstance(last, UserMessage):
        return Reply(tool_calls=[call("echo", text=last.text)])
    results = [m.text for m in req.messages if isinstance(m, ToolResultMessage)]
    return "answer: " + results[-1]


async def drain(proc, after: int = 0):
    return [s async for s in proc.signals(after_seq=after, follow=False)]


async def test_a_run_with_a_tool_completes_and_is_logged(tmp_path):
    ran.clear()
    async with kernel(tmp_path, ScriptedModel(by_tool_results)) as k:
        proc = await k.spawn(owner="alice")
        receipt = await proc.send("hello")
        assert not receipt.queued and receipt.run_id
        await proc.wait_idle()
        msgs = await proc.messages()
        assert [m.role for m in msgs] == ["user", "assistant", "toolResult", "assistant"]
        assert msgs[-1].text == "answer: hello" and ran == ["hello"]
        names = [s.signal for s in await drain(proc)]
        assert names[0] == "proc.run.started" and names[-1] == "proc.run.finished"
        assert "proc.run.tool.started" in names and "proc.run.tool.finished" in names
        finished = (await drain(proc))[-1]
        assert finished.payload["status"] == "ok" and finished.payload["runId"] == receipt.run_id
        seqs = [s.seq for s in await drain(proc)]
        assert seqs == list(range(1, len(seqs) + 1))  # gap-free log
        assert await k.store.calls(proc.pid) == []  # the batch was ingested and cleared
        assert [p.pid for p in await k.processes("alice")] == [proc.pid] and await k.processes("bob") == []


async def test_parallel_batch_results_in_model_order(tmp_path):
    model = ScriptedModel([Reply(tool_calls=[call("slow", seconds=0.1), call("slow", seconds=0.01)]), "done"])
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        t0 = asyncio.get_running_loop().time()
        await proc.send("go")
        await proc.wait_idle()
        assert asyncio.get_running_loop().time() - t0 < 1.0
        results = [m.text for m in await proc.messages() if isinstance(m, ToolResultMessage)]
        assert results == ["slept 0.1", "slept 0.01"]


async def test_steer_is_injected_before_the_next_model_call(tmp_path):
    model = ScriptedModel([Reply(tool_calls=[call("slow", seconds=0.2)]), "after steer"])
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        first = await proc.send("start")
        await asyncio.sleep(0.05)
        steer = await proc.send("also consider this", mode="steer")
        assert steer.queued and steer.run_id == first.run_id and steer.position == 1
        await proc.wait_idle()
        second_request = model.requests[1].messages
        assert second_request[-1].text == "also consider this"
        assert [m.role for m in await proc.messages()] == ["user", "assistant", "toolResult", "user", "assistant"]


async def test_steer_during_the_final_answer_is_answered_by_the_run_its_receipt_names(tmp_path):
    model = ScriptedModel(lambda r: f"re: {r.messages[-1].text}", latency=0.2)
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        first = await proc.send("first")
        await asyncio.sleep(0.05)  # the model is writing what would be the run's last answer
        steer = await proc.send("and this", mode="steer")
        assert steer.queued and steer.run_id == first.run_id
        await proc.wait_idle()
        assert [m.text for m in await proc.messages()] == ["first", "re: first", "and this", "re: and this"]
        signals = await drain(proc)
        assert [s.payload["runId"] for s in signals if s.signal == "proc.run.started"] == [first.run_id]
        assert [s.payload["runId"] for s in signals if s.signal == "proc.run.finished"] == [first.run_id]


async def test_a_system_event_during_the_final_answer_joins_the_run(tmp_path):
    model = ScriptedModel(lambda r: f"re: {r.messages[-1].text}", latency=0.2)
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        first = await proc.send("first")
        await asyncio.sleep(0.05)
        event = await k.signal(proc.pid, "the build finished")
        assert event.queued and event.run_id == first.run_id
        await proc.wait_idle()
        assert [m.text for m in await proc.messages()][-1] == "re: the build finished"
        assert len([s for s in await drain(proc) if s.signal == "proc.run.finished"]) == 1


async def test_queue_becomes_its_own_run_fifo(tmp_path):
    model = ScriptedModel(
        lambda r: (
            Reply(tool_calls=[call("slow", seconds=0.1)])
            if isinstance(r.messages[-1], UserMessage) and r.messages[-1].text == "first"
            else f"re: {r.messages[-1].text}"
        )
    )
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        await proc.send("first")
        q1 = await proc.send("second", mode="queue")
        q2 = await proc.send("third", mode="queue")
        assert q1.queued and (q1.position, q2.position) == (1, 2) and q1.run_id != q2.run_id
        await proc.wait_idle()
        finished = [s.payload["runId"] for s in await drain(proc) if s.signal == "proc.run.finished"]
        started = [s for s in await drain(proc) if s.signal == "proc.run.started"]
        assert len(finished) == 3 and finished[1:] == [q1.run_id, q2.run_id]
        assert [s.payload["reason"] for s in started] == ["proc.send", "queue.promote", "queue.promote"]
        texts = [m.text for m in await proc.messages() if isinstance(m, AssistantMessage)]
        assert texts[-2:] == ["re: second", "re: third"]


async def test_interrupt_aborts_and_starts_over(tmp_path):
    model = ScriptedModel(
        lambda r: Reply(tool_calls=[call("slow", seconds=30)]) if r.messages[-1].text == "long job" else "short answer"
    )
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        first = await proc.send("long job")
        await asyncio.sleep(0.1)
        second = await proc.send("never mind", mode="interrupt")
        assert not second.queued and second.run_id != first.run_id
        await proc.wait_idle()
        msgs = await proc.messages()
        cancelled = [m for m in msgs if isinstance(m, ToolResultMessage)]
        assert len(cancelled) == 1 and cancelled[0].is_error and "cancelled" in cancelled[0].text
        assert msgs[-1].text == "short answer"
        statuses = [
            (s.payload["runId"], s.payload["status"]) for s in await drain(proc) if s.signal == "proc.run.finished"
        ]
        assert statuses == [(first.run_id, "aborted"), (second.run_id, "ok")]


async def test_abort_is_terminal_stale_abort_is_a_noop_and_queue_goes_on(tmp_path):
    model = ScriptedModel(
        lambda r: (
            Reply(tool_calls=[call("slow", seconds=30), call("echo", text="quick")])
            if r.messages[-1].text == "work"
            else "queued one done"
        )
    )
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        run = await proc.send("work")
        await proc.send("next", mode="queue")
        await asyncio.sleep(0.1)
        assert not await proc.abort(run_id="not-the-active-run")
        assert await proc.abort(run_id=run.run_id)
        assert not await proc.abort(run_id=run.run_id)  # already over: stale
        await proc.wait_idle()
        results = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)]
        assert [r.text for r in results] == ["Tool call cancelled: the run was aborted.", "quick"]
        assert (await proc.messages())[-1].text == "queued one done"


async def test_an_abort_ends_every_started_call_and_says_the_history_and_approvals_changed(tmp_path):
    """Watchers learn what an abort changed as they learn what a run changes: each started call
    gets its proc.run.tool.finished (a card shown as running ends), and proc.changed names the
    history (the cancelled results) and, when a question was withdrawn, the approvals."""

    async def policy(process, row):
        return Approval("ask", ("destructive",), "echo asks") if row.tool_name == "echo" else Approval("auto")

    model = ScriptedModel(
        lambda r: (
            Reply(tool_calls=[call("slow", seconds=30)])
            if r.messages[-1].text == "work"
            else Reply(tool_calls=[call("echo", text="x")])
        )
    )
    async with kernel(tmp_path, model, approval=policy) as k:
        proc = await k.spawn(owner="a")
        run = await proc.send("work")
        await asyncio.sleep(0.1)
        seen = len(await drain(proc))
        assert await proc.abort()
        after = await drain(proc, seen)
        finished = [s.payload for s in after if s.signal == "proc.run.tool.finished"]
        assert [(p["name"], p["ok"], p["error"]) for p in finished] == [("slow", False, CANCELLED)]
        assert {"changes": ["messages"]}.items() <= next(s.payload for s in after if s.signal == "proc.changed").items()
        assert after[-1].signal == "proc.run.finished" and after[-1].payload["runId"] == run.run_id

        await proc.send("ask")
        for _ in range(200):
            if await proc.pending_approvals():
                break
            await asyncio.sleep(0.01)
        seen = len(await drain(proc))
        assert await proc.abort()
        after = await drain(proc, seen)
        assert not [s for s in after if s.signal == "proc.run.tool.finished"]  # it never started
        assert [s.payload["changes"] for s in after if s.signal == "proc.changed"] == [["messages", "hil"]]


async def test_a_tool_that_ignores_cancellation_does_not_hold_the_abort(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_module, "ABORT_GRACE", 0.3)
    release = asyncio.Event()
    started = asyncio.Event()

    @tool
    async def stubborn() -> str:
        """Work that will not be stopped."""
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await release.wait()  # ignores the cancellation until the test lets it go
        return "finished anyway"

    model = ScriptedModel([Reply(tool_calls=[call("stubborn")]), "after the abort"])
    async with kernel(tmp_path, model, tools=[stubborn]) as k:
        proc = await k.spawn(owner="a")
        await proc.send("go")
        await asyncio.wait_for(started.wait(), 5)
        assert await asyncio.wait_for(proc.abort(), 5)  # the grace, not the tool, decides when
        release.set()
        await asyncio.sleep(0.1)  # the tool's late result arrives now, and is ignored
        await proc.send("next")
        await proc.wait_idle()
        results = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)]
        assert [r.text for r in results] == ["Tool call cancelled: the run was aborted."]
        assert (await proc.messages())[-1].text == "after the abort"


async def test_live_stream_signals_say_which_block_and_which_tool_call(tmp_path):
    model = ScriptedModel([Reply(text="Let me echo.", tool_calls=[call("echo", text="x")]), "done"])
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        seen = []

        async def watch() -> None:
            async for s in proc.signals(follow=True):
                seen.append(s)
                if s.signal == "proc.run.finished":
                    return

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.05)  # subscribed before the run starts
        await proc.send("go")
        await asyncio.wait_for(watcher, 5)
    live = [s.payload for s in seen if s.signal == "proc.run.stream"]
    assert all(s.seq is None for s in seen if s.signal == "proc.run.stream")  # live only, never logged
    text = [p for p in live if p["event"] == "text_delta"]
    assert "".join(p["delta"] for p in text) == "Let me echo." + "done"
    [start] = [p for p in live if p["event"] == "toolcall_start"]
    assert start["callId"] and start["name"] == "echo" and isinstance(start["index"], int)
    assert start["index"] > text[0]["index"]  # the call is the block after the text


async def test_chat_mode_answers_from_the_same_history_without_tools(tmp_path):
    model = ScriptedModel(
        lambda r: Reply(tool_calls=[call("echo", text="x")]) if r.tools and r.messages[-1].role == "user" else "said"
    )
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        assert await proc.mode() == "agent"
        await proc.send("use a tool")
        await proc.wait_idle()
        await proc.set_mode("chat")
        assert await proc.mode() == "chat"
        await proc.send("just talk")
        await proc.wait_idle()
        await proc.set_mode("agent")
        await proc.send("tools again")
        await proc.wait_idle()
        chatty = await k.spawn(owner="a", mode="chat")
        await chatty.send("hello")
        await chatty.wait_idle()
        changes = [s.payload["changes"] async for s in proc.signals(follow=False) if s.signal == "proc.changed"]
        with pytest.raises(ValueError, match="mode must be agent or chat"):
            await proc.set_mode("silent")  # type: ignore[arg-type]
    offered = [bool(r.tools) for r in model.requests]
    # agent run: call + after the result; chat run: no tools; agent again; the chat process: no tools
    assert offered == [True, True, False, True, True, False]
    assert model.requests[2].messages[0].text == "use a tool"  # the same history, tools or not
    assert ["mode"] in changes


async def test_model_answer_arriving_after_abort_is_dropped(tmp_path):
    model = ScriptedModel(["too late", "fresh"], latency=0.3)
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        await proc.send("slow question")
        await asyncio.sleep(0.05)
        await proc.abort()
        await proc.wait_idle()
        msgs = await proc.messages()
        assert all(getattr(m, "text", "") != "too late" for m in msgs)
        assert msgs[-1].role == "user" or (isinstance(msgs[-1], AssistantMessage) and msgs[-1].stop_reason == "aborted")


async def test_a_resume_point_past_the_end_of_the_log_counts_from_its_end(tmp_path):
    """A client that saw seq 500 of a database since restored from an older backup (the log ends
    at 8): the new signals are numbered 9, 10, … and must reach it, not wait to pass 500."""
    async with kernel(tmp_path, ScriptedModel(["one", "two"])) as k:
        proc = await k.spawn(owner="a")
        await proc.send("a")
        await proc.wait_idle()
        end = (await drain(proc))[-1].seq
        assert await drain(proc, after=end + 500) == []  # nothing new yet
        got: list[int] = []

        async def follow() -> None:
            async for s in proc.signals(after_seq=end + 500):
                if s.seq is not None:
                    got.append(s.seq)
                if s.signal == "proc.run.finished":
                    return

        watcher = asyncio.create_task(follow())
        await asyncio.sleep(0.01)
        await proc.send("b")
        await asyncio.wait_for(watcher, 5)
    assert got and got[0] == end + 1  # the next run's signals, from the first


async def test_signals_resume_and_follow(tmp_path):
    async with kernel(tmp_path, ScriptedModel(["one", "two"])) as k:
        proc = await k.spawn(owner="a")
        await proc.send("a")
        await proc.wait_idle()
        first = await drain(proc)
        got: list[str] = []

        async def follow() -> None:
            async for s in proc.signals(after_seq=first[-1].seq):
                got.append(s.signal)
                if s.signal == "proc.run.finished":
                    return

        watcher = asyncio.create_task(follow())
        await asyncio.sleep(0.01)
        await proc.send("b")
        await asyncio.wait_for(watcher, 5)
        assert got[0] == "proc.run.started" and got[-1] == "proc.run.finished"
        assert [s.seq for s in await drain(proc, after=first[-1].seq)] == list(
            range(first[-1].seq + 1, first[-1].seq + 1 + len([g for g in got if g != "proc.run.stream"]))
        )


async def test_system_events_start_runs_and_take_priority(tmp_path):
    model = ScriptedModel(
        lambda r: Reply(tool_calls=[call("slow", seconds=0.2)]) if r.messages[-1].text == "user asks" else "ok"
    )
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        await proc.send("user asks")
        await asyncio.sleep(0.05)
        await proc.send("later question", mode="queue")
        await k.signal(proc.pid, "file changed: notes.txt")
        await proc.wait_idle()
        second_call = model.requests[1].messages
        assert isinstance(second_call[-1], SystemMessage) and "notes.txt" in second_call[-1].text
        idle = await k.spawn(owner="a")
        receipt = await k.signal(idle.pid, "timer fired")
        assert not receipt.queued
        await idle.wait_idle()
        assert [m.role for m in await idle.messages()] == ["system", "assistant"]


async def test_send_with_a_run_id_is_idempotent(tmp_path):
    async with kernel(tmp_path, ScriptedModel(["once"])) as k:
        proc = await k.spawn(owner="a")
        a = await proc.send("hello", run_id="delivery-1")
        b = await proc.send("hello", run_id="delivery-1")
        assert a == b and a.run_id == "delivery-1"
        await proc.wait_idle()
        assert [m.role for m in await proc.messages()] == ["user", "assistant"]


async def asking_policy(process, row) -> Approval:
    if row.tool_name == "echo" and row.args.get("text") == "risky":
        return Approval("ask", ("destructive",), "echo of something risky", fingerprint=json.dumps(row.args))
    return Approval("auto")


async def test_approval_approve_deny_and_bad_requests(tmp_path):
    ran.clear()
    model = ScriptedModel(
        [
            Reply(tool_calls=[call("echo", text="safe"), call("echo", text="risky")]),
            "after approve",
            Reply(tool_calls=[call("echo", text="risky")]),
            "after deny",
        ]
    )
    async with kernel(tmp_path, model, approval=asking_policy) as k:
        proc = await k.spawn(owner="a")
        await proc.send("do it")
        for _ in range(100):
            if await proc.pending_approvals():
                break
            await asyncio.sleep(0.01)
        [pending] = await proc.pending_approvals()
        asked = [s for s in await drain(proc) if s.signal == "proc.run.hil.requested"]
        assert asked[0].payload["requestId"] == pending.request_id and asked[0].payload["tags"] == ["destructive"]
        assert ran == ["safe"]  # the sibling ran; the risky call waits
        with pytest.raises(ValueError):
            await proc.hil(pending.request_id, "maybe")
        with pytest.raises(KeyError):
            await proc.hil("no-such-request", "approve")
        await proc.hil(pending.request_id, "approve")
        with pytest.raises(KeyError):  # a second decision finds nothing to decide
            await proc.hil(pending.request_id, "approve")
        await proc.wait_idle()
        assert ran == ["safe", "risky"]  # approved call ran once, the approved sibling did not re-run
        await proc.send("again")
        for _ in range(100):
            if await proc.pending_approvals():
                break
            await asyncio.sleep(0.01)
        [second] = await proc.pending_approvals()
        await proc.hil(second.request_id, "deny")
        await proc.wait_idle()
        denied = [m for m in await proc.messages() if isinstance(m, ToolResultMessage)][-1]
        assert denied.is_error and denied.text == "Tool execution denied by user" and ran == ["safe", "risky"]


async def test_non_interactive_processes_turn_ask_into_an_error(tmp_path):
    ran.clear()
    model = ScriptedModel([Reply(tool_calls=[call("echo", text="risky")]), "ok"])
    async with kernel(tmp_path, model, approval=asking_policy) as k:
        proc = await k.spawn(owner="a", interactive=False)
        await proc.send("go")
        await proc.wait_idle()
        result = next(m for m in await proc.messages() if isinstance(m, ToolResultMessage))
        assert result.is_error and "requires interactive approval" in result.text and ran == []


async def test_reset_archives_and_kill_removes(tmp_path):
    async with kernel(tmp_path, ScriptedModel(lambda r: "seen")) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("look", media=[ImageContent(data=PNG, mime_type="image/png")])
        await proc.wait_idle()
        media_dir = tmp_path / "var" / "media" / "alice" / proc.pid
        assert len(list(media_dir.iterdir())) == 1
        archive = await proc.reset()
        assert archive is not None and archive.is_relative_to(tmp_path / "var" / "sessions" / "alice" / proc.pid)
        lines = gzip.decompress(archive.read_bytes()).decode().splitlines()
        assert len(lines) == 3  # header + user + assistant
        assert await proc.messages() == [] and not media_dir.exists()
        await proc.send("fresh start")
        await proc.wait_idle()
        await proc.kill()
        with pytest.raises(NoSuchProcess):
            await proc.send("anyone?")
        with pytest.raises(NoSuchProcess):
            await k.process(proc.pid)
        assert await k.processes() == []


async def test_a_reset_drops_the_old_conversations_signals_and_the_numbering_goes_on(tmp_path):
    """The log of a conversation that reset archived and cleared is dropped with it (it would
    otherwise grow with every tool output for the life of the process); signals a watch on the
    process has not read yet are kept for it (``Store.prune_events``, in the store conformance)."""
    async with kernel(tmp_path, ScriptedModel(lambda r: "seen")) as k:
        proc = await k.spawn(owner="alice", text="first conversation")
        await proc.wait_idle()
        before = await drain(proc)
        await proc.reset()
        after = await drain(proc)
        await proc.send("second conversation")
        await proc.wait_idle()
        resumed = await drain(proc, after=before[-1].seq)  # a client that saw the old log to its end
    assert [s.signal for s in after] == ["proc.changed"] and after[0].payload["changes"] == ["messages", "reset"]
    assert after[0].seq == before[-1].seq + 1
    assert resumed[0] == after[0] and resumed[-1].signal == "proc.run.finished"


async def test_a_long_conversation_keeps_only_the_newest_signals_and_every_message(tmp_path, monkeypatch):
    """The log keeps its newest ``KEPT_SIGNALS`` signals (pruned as runs end, ``PRUNE_EVERY`` at
    a time), so a conversation that lasts for months does not grow the database for ever; its
    messages all stay (a watch's unread signals stay too: the store conformance)."""
    monkeypatch.setattr(psig, "KEPT_SIGNALS", 12)
    monkeypatch.setattr(psig, "PRUNE_EVERY", 6)
    async with kernel(tmp_path, ScriptedModel(lambda r: "seen")) as k:
        proc = await k.spawn(owner="alice")
        for n in range(15):
            await proc.send(f"message {n}")
            await proc.wait_idle()
        logged = await drain(proc)
        last = logged[-1].seq
        assert last > 40 and last - 12 - 6 - 5 <= logged[0].seq <= last - 11  # the newest, give or take a batch
        assert [s.seq for s in logged] == list(range(logged[0].seq, last + 1))  # whole, in order
        assert len(await proc.messages()) == 30  # the conversation itself is all there


@pytest.mark.parametrize("clearing", ["reset", "kill"])
async def test_input_queued_when_a_reset_or_kill_clears_it_is_kept_in_the_archive(tmp_path, clearing):
    """Queued input the clearing drops never ran: it is kept, under the archive's meta.queued."""
    gate = asyncio.Event()

    @tool
    async def wait() -> str:
        """Wait."""
        await gate.wait()
        return "waited"

    brain = lambda r: "done" if isinstance(r.messages[-1], ToolResultMessage) else Reply(tool_calls=[call("wait")])  # noqa: E731
    async with kernel(tmp_path, ScriptedModel(brain), tools=[wait]) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("start")
        receipt = await proc.send("later, please", mode="queue")
        assert receipt.queued
        archive = await (proc.reset() if clearing == "reset" else proc.kill())
        assert archive is not None
        header, history = read_archive(archive)
        assert [m.text for m in history if isinstance(m, UserMessage)] == ["start"]
        assert header["meta"]["reason"] == clearing
        assert [message_from_dict(m).text for m in header["meta"]["queued"]] == ["later, please"]


async def test_images_reach_the_model_as_images(tmp_path):
    model = ScriptedModel(["a red pixel"])
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        await proc.send("what is this?", media=[ImageContent(data=PNG, mime_type="image/png")])
        await proc.wait_idle()
        sent = model.requests[0].messages[0]
        assert isinstance(sent, UserMessage) and sent.content[1] == ImageContent(data=PNG, mime_type="image/png")
        stored = (await proc.messages())[0]
        assert stored.content[1].data.startswith("media:")  # the store keeps a reference, not the bytes


async def test_bad_input_gets_clear_errors(tmp_path):
    async with kernel(tmp_path, ScriptedModel([])) as k:
        with pytest.raises(NoSuchProcess, match="no such process: nope"):
            await k.process("nope")
        proc = await k.spawn(owner="a")
        with pytest.raises(ValueError, match="mode must be"):
            await proc.send("x", mode="shout")  # type: ignore[arg-type]
        for empty in ("", "  \n"):
            with pytest.raises(ValueError, match="non-empty"):
                await proc.send(empty)
        for run_id in (7, ""):
            with pytest.raises(ValueError, match="run_id must be a non-empty string"):
                await proc.send("x", run_id=run_id)  # type: ignore[arg-type]
        for media in (["abc"], "abc", [{"data": PNG, "mime_type": "image/png"}]):
            with pytest.raises(TypeError, match="media must be a sequence of ImageContent"):
                await proc.send("x", media=media)  # type: ignore[arg-type]
        for limit, before in ((-1, None), (0, None), (True, None), (None, "x"), (None, 2**63)):
            with pytest.raises(ValueError, match="must be an integer from"):
                await proc.history(limit=limit, before=before)  # type: ignore[arg-type]
        for after in ("x", -1, 2**63):
            with pytest.raises(ValueError, match="after_seq must be an integer"):
                await anext(proc.signals(after, follow=False))  # type: ignore[arg-type]
        assert await proc.messages() == []
        with pytest.raises(TypeError, match="context must be a string, got int"):
            await k.spawn(owner="a", context=5)  # type: ignore[arg-type]
        with pytest.raises(NoSuchProcess, match="no such process: ghost"):
            await k.spawn(owner="a", parent_pid="ghost")
        with pytest.raises(ValueError, match="is not a directory"):
            await k.spawn(owner="a", cwd="a\x00b")
        (tmp_path / "loop").symlink_to(tmp_path / "loop")
        for cwd in ("loop", "x" * 300):  # (a symlink loop made Path.resolve raise RuntimeError)
            with pytest.raises(ValueError, match="is not a directory"):
                await k.spawn(owner="a", cwd=cwd)
        with pytest.raises(TypeError, match="interactive must be true or false, got 'no'"):
            await k.spawn(owner="a", interactive="no")  # type: ignore[arg-type]
        # text from bytes that were not UTF-8 (surrogateescape) cannot be stored: refused up front
        bad = b"caf\xe9".decode("utf-8", "surrogateescape")
        with pytest.raises(ValueError, match="text is not valid text"):
            await proc.send(bad)
        with pytest.raises(ValueError, match="text is not valid text"):
            await k.signal(proc.pid, bad)
        with pytest.raises(ValueError, match="context is not valid text"):
            await k.spawn(owner="a", context=bad)
        assert [p.pid for p in await k.processes()] == [proc.pid]  # nothing half-made
    with pytest.raises(TypeError, match="approval must be a function, got str"):  # not at the first step
        async with Kernel.open(f"sqlite:///{tmp_path}/other.db", approval="default"):  # type: ignore[arg-type]
            pass
    assert not (tmp_path / "other.db").exists()
    for threshold in (5, 0, float("nan")):
        with pytest.raises(ValueError, match="compaction_threshold must be above 0 and at most 1"):
            async with Kernel.open(f"sqlite:///{tmp_path}/other.db", compaction_threshold=threshold):
                pass
    assert not (tmp_path / "other.db").exists()


async def test_crash_resume_reruns_idempotent_and_fails_the_others(tmp_path):
    calls: list[str] = []

    @tool(idempotent=True)
    async def lookup(key: str) -> str:
        """Read-only lookup."""
        calls.append(f"lookup {key}")
        await asyncio.sleep(0.5 if len(calls) == 1 else 0)
        return f"value of {key}"

    @tool
    async def charge(amount: int) -> str:
        """Charge a card (not idempotent)."""
        calls.append(f"charge {amount}")
        await asyncio.sleep(5)
        return "charged"

    def brain(r: ModelRequest):
        if isinstance(r.messages[-1], UserMessage):
            return Reply(tool_calls=[call("lookup", key="k"), call("charge", amount=5)])
        return "done: " + " | ".join(m.text for m in r.messages if isinstance(m, ToolResultMessage))

    async with kernel(tmp_path, ScriptedModel(brain), tools=[lookup, charge]) as k:
        proc = await k.spawn(owner="a")
        await proc.send("pay")
        await asyncio.sleep(0.2)  # both calls are dispatched; the "crash" comes now
        pid = proc.pid
    async with kernel(tmp_path, ScriptedModel(brain), tools=[lookup, charge]) as k2:
        proc = await k2.process(pid)
        await proc.wait_idle()
        final = (await proc.messages())[-1].text
        assert final.startswith("done: value of k | Tool call interrupted by a restart")
        assert calls.count("charge 5") == 1 and calls.count("lookup k") == 2


async def test_crash_resume_judges_a_call_by_the_processs_own_tools(tmp_path):
    """A tool only the process's tool set has (a device's, say) is re-run after a restart when it is
    idempotent, like a shared one; it is not taken for unknown and failed."""
    calls: list[str] = []

    @tool(name="dev__lookup", idempotent=True)
    async def lookup(key: str) -> str:
        """Read-only lookup on a device."""
        calls.append(key)
        await asyncio.sleep(0.5 if len(calls) == 1 else 0)
        return f"value of {key}"

    def own_tools(record, shared):
        return {**shared, "dev__lookup": lookup}

    def brain(r: ModelRequest):
        if isinstance(r.messages[-1], UserMessage):
            return Reply(tool_calls=[call("dev__lookup", key="k")])
        return "done: " + " | ".join(m.text for m in r.messages if isinstance(m, ToolResultMessage))

    async with kernel(tmp_path, ScriptedModel(brain), tools=[], toolset=own_tools) as k:
        proc = await k.spawn(owner="a")
        await proc.send("look")
        await asyncio.sleep(0.2)  # the call is dispatched; the "crash" comes now
        pid = proc.pid
    async with kernel(tmp_path, ScriptedModel(brain), tools=[], toolset=own_tools) as k2:
        proc = await k2.process(pid)
        await proc.wait_idle()
        assert (await proc.messages())[-1].text == "done: value of k"
        assert calls == ["k", "k"]


async def test_a_toolset_gives_each_process_run_its_own_tools(tmp_path):
    """The engine asks the toolset for a run's tools once per run and keys them by the process:
    the model sees them, and calling one runs the per-process tool, not a shared one."""
    seen: list[list[str]] = []
    built: list[str] = []

    def model(req: ModelRequest) -> Reply | str:
        seen.append([t.name for t in req.tools])
        if isinstance(req.messages[-1], UserMessage):
            return Reply(tool_calls=[call("whoami")])
        return "done: " + [m.text for m in req.messages if isinstance(m, ToolResultMessage)][-1]

    def toolset(record, shared):
        built.append(record.owner)

        @tool
        def whoami() -> str:
            """Who owns this process."""
            return record.owner

        return {**shared, "whoami": whoami}

    async with kernel(tmp_path, ScriptedModel(model), toolset=toolset) as k:
        for owner in ("alice", "bob"):
            proc = await k.spawn(owner)
            await proc.send("hi")
            await proc.wait_idle()
            assert (await proc.messages())[-1].text == f"done: {owner}"
    assert built == ["alice", "bob"]  # once per run, not per model call
    assert all("whoami" in names and "echo" in names for names in seen)


async def test_a_dispatch_without_a_worker_fails_at_its_durable_deadline(tmp_path, monkeypatch):
    # The worker of a dispatched call can be lost (a remote side that never answers, a bug): the
    # deadline stored with the dispatch still ends the call, so the run does not hang.
    @tool(timeout=0.3)
    def lost(x: int) -> str:
        """Never gets to run here."""
        return "ran"

    def brain(r: ModelRequest):
        if isinstance(r.messages[-1], UserMessage):
            return Reply(tool_calls=[call("lost", x=1)])
        return "after: " + r.messages[-1].text

    async with kernel(tmp_path, ScriptedModel(brain), tools=[lost]) as k:
        monkeypatch.setattr(process_calls, "launcher", lambda *args: lambda: None)  # no worker starts
        proc = await k.spawn(owner="a")
        await proc.send("go")
        await asyncio.wait_for(proc.wait_idle(), 5)
        msgs = await proc.messages()
        assert [m.role for m in msgs] == ["user", "assistant", "toolResult", "assistant"]
        assert msgs[2].is_error and "no result before its deadline" in msgs[2].text
        assert msgs[-1].text.startswith("after: Tool lost timed out")


async def test_a_finished_batch_leaves_no_deadline_timer_behind(tmp_path, monkeypatch):
    # Each dispatch arms a timer for its deadline (60 s by default). Once the batch is over, or
    # the run aborted, the timer goes too: it would keep a wake-up for nothing in the loop.
    loop = asyncio.get_running_loop()
    armed: list[asyncio.TimerHandle] = []
    real_call_later = loop.call_later

    def spy(delay, callback, *args, **kwargs):
        handle = real_call_later(delay, callback, *args, **kwargs)
        if getattr(callback, "__name__", "") == "wake":
            armed.append(handle)
        return handle

    monkeypatch.setattr(loop, "call_later", spy)

    def brain(r: ModelRequest):
        last = r.messages[-1]
        if isinstance(last, UserMessage):
            return Reply(tool_calls=[call("slow", seconds=30 if last.text == "stuck" else 0)])
        return "done"

    async with kernel(tmp_path, ScriptedModel(brain)) as k:
        proc = await k.spawn(owner="a")
        await proc.send("quick")
        await proc.wait_idle()
        assert len(armed) == 1 and armed[0].cancelled()
        await proc.send("stuck")
        while len(armed) < 2:
            await asyncio.sleep(0.01)
        assert await proc.abort()
        assert armed[1].cancelled()


async def test_an_idle_process_keeps_no_finished_driver_task_or_run_configuration(tmp_path):
    # A server holds thousands of idle processes: each must not pin its last driver task (and the
    # coroutine and context with it) in memory.
    import gc

    async with kernel(tmp_path, ScriptedModel(by_tool_results)) as k:
        proc = await k.spawn(owner="a")
        await proc.send("hello")
        await proc.wait_idle()
        await asyncio.sleep(0)
        gc.collect()
        name = f"agentloop-process-{proc.pid}"
        assert [t for t in gc.get_objects() if isinstance(t, asyncio.Task) and t.get_name() == name] == []
        live = k.engine._live[proc.pid]
        assert live.config is None and live.prompt is None  # nor the ended run's configuration and prompt
        await proc.send("again")  # a new run gets a new driver
        await proc.wait_idle()
        assert (await proc.messages())[-1].text == "answer: again"


async def test_spawn_with_a_first_message_stores_the_process_and_its_run_in_one_commit(tmp_path):
    model = ScriptedModel(["first answer", "second answer"])
    async with kernel(tmp_path, model) as k:
        commits: list[int] = []
        store = k.store
        real_end = store._end

        def counting(commit, settled=None):  # type: ignore[no-untyped-def]
            if commit:
                commits.append(1)
            return real_end(commit, settled)

        store._end = counting  # type: ignore[method-assign]
        proc = await k.spawn(owner="a", text="hello", media=[ImageContent(data=PNG, mime_type="image/png")])
        assert len(commits) == 1  # the process, its first message and run: one transaction
        assert proc.started is not None and not proc.started.queued
        await proc.wait_idle()
        store._end = real_end  # type: ignore[method-assign]
        sent = model.requests[0].messages[0]
        assert isinstance(sent, UserMessage) and sent.text == "hello" and isinstance(sent.content[1], ImageContent)
        signals = [s async for s in proc.signals(follow=False)]
        started = next(s.payload for s in signals if s.signal == "proc.run.started")
        assert isinstance(started.pop("timestamp"), int)
        assert started == {"pid": proc.pid, "runId": proc.started.run_id, "reason": "proc.send", "queuedCount": 0}
        assert signals[-1].signal == "proc.run.finished" and signals[-1].payload["status"] == "ok"


async def test_spawn_with_a_first_message_is_idempotent_by_run_id_and_refuses_bad_input(tmp_path):
    async with kernel(tmp_path, ScriptedModel(["once"])) as k:
        proc = await k.spawn(owner="a", text="hello", run_id="job-7")
        await proc.wait_idle()
        again = await proc.send("hello", run_id="job-7")  # a retry of the same delivery
        assert proc.started is not None and again.run_id == proc.started.run_id
        assert [m.text for m in await proc.messages()] == ["hello", "once"]
        before = await k.processes()
        for text, media in (("  ", ()), ("x", ["not a block"])):
            with pytest.raises((ValueError, TypeError)):
                await k.spawn(owner="a", text=text, media=media)  # type: ignore[arg-type]
        assert await k.processes() == before  # nothing stored for a refused spawn
        with pytest.raises(MediaError):
            await k.spawn(owner="a", text="x", media=[ImageContent(data=PNG, mime_type="image/jpeg")])
        assert await k.processes() == before
        # a pid that is taken: refused, and the process that has it keeps its cache and its media
        with pytest.raises(StoreError, match="exists already"):
            await k.spawn(owner="a", pid=proc.pid, text="again", media=[ImageContent(data=PNG, mime_type="image/png")])
        assert [m.text for m in await proc.messages()] == ["hello", "once"] and await k.processes() == before


async def test_a_retried_spawn_with_the_same_pid_and_run_id_gets_the_first_one(tmp_path):
    async with kernel(tmp_path, ScriptedModel(["done"])) as k:
        first = await k.spawn(owner="a", pid="job-1", text="go", run_id="r-1")
        await first.wait_idle()
        again = await k.spawn(owner="a", pid="job-1", text="go", run_id="r-1")
        assert again.pid == first.pid and again.started == first.started
        assert [m.text for m in await first.messages()] == ["go", "done"]  # delivered once
        for owner, run_id in (("b", "r-1"), ("a", "r-2"), ("a", None)):  # not the same delivery: refused
            with pytest.raises(StoreError, match="exists already"):
                await k.spawn(owner=owner, pid="job-1", text="go", run_id=run_id)


async def test_spawn_with_a_taken_pid_leaves_a_stored_but_uncached_process_working(tmp_path):
    """After a restart a stored process is not cached yet: a spawn that collides with it must not
    leave an empty cache entry behind for the next send to use."""
    async with kernel(tmp_path, ScriptedModel(["first", "second"])) as k:
        proc = await k.spawn(owner="a", text="one")
        await proc.wait_idle()
        k.engine.uncache(proc.pid)  # as after a restart
        with pytest.raises(StoreError, match="exists already"):
            await k.spawn(owner="a", pid=proc.pid, text="clash")
        await proc.send("two")
        await asyncio.wait_for(proc.wait_idle(), 5)
        assert [m.text for m in await proc.messages()] == ["one", "first", "two", "second"]


async def test_a_follower_catching_up_gets_no_deltas_of_a_run_it_has_seen_end(tmp_path):
    """A follower reads a long log page by page while a run streams: the deltas that queued for it
    meanwhile belong to a run the log then shows finished; they are dropped, not shown after it."""
    model = ScriptedModel(lambda r: "many words " * 30)
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="a")
        for i in range(130):  # several pages of log
            await proc.send(f"m{i}")
            await proc.wait_idle()
        follower = proc.signals(follow=True)
        await anext(follower)  # reading the first page; live signals queue meanwhile
        await proc.send("streamed")
        await proc.wait_idle()
        seen = []
        with contextlib.suppress(TimeoutError):
            while True:
                seen.append((await asyncio.wait_for(anext(follower), 0.5)).signal)
        await follower.aclose()
        last_run_ends = len(seen) - seen[::-1].index("proc.run.finished")
        assert seen.count("proc.run.finished") == 131 and "proc.run.stream" not in seen[last_run_ends:]
