"""Tool progress (``ctx.update``) as a live signal: ``proc.run.tool.update`` for durable runs,
``tool_execution_update`` in memory. Shell streams its output through it, coalesced and capped;
updates are live-only (never in the events log, no seq), best-effort, and never break the tool."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from agentloop import Agent, Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.cli.render import JsonRenderer, SignalRenderer, TextRenderer
from agentloop.events import ToolExecutionEnd, ToolExecutionStart, ToolExecutionUpdate
from agentloop.kernel import Kernel
from agentloop.messages import TextContent, UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.api import approve_everything
from agentloop.process.relay import Relay, publish_batch
from agentloop.process.signals import Signal
from agentloop.tools.base import ToolContext
from agentloop.tools.shell import MAX_DELTA_BYTES, UPDATE_INTERVAL, run_shell, shell_tool
from tests import test_web_ui_browser as web
from tests.server_support import live_server, parse_sse, remote_chat, wait_until
from tests.ws_support import KernelServer

STEPS = "for i in 1 2 3; do echo line$i; sleep 0.3; done"
FLOOD = "yes | head -c 5000000"


def running(command: str) -> ScriptedModel:
    """A model that runs ``command`` in Shell when asked to ("run"), then answers with its result."""

    def brain(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if isinstance(last, ToolResultMessage):
            return "done"
        if isinstance(last, UserMessage) and last.text == "run":
            return Reply(tool_calls=[call("Shell", command=command)])
        return "nothing to run"

    return ScriptedModel(brain)


def kernel(tmp_path: Path, model: Any, **kw: Any) -> Kernel:
    kw.setdefault("approval", approve_everything)
    return Kernel.open(f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, **kw)


async def follow_run(k: Kernel, text: str = "run") -> tuple[str, list[Signal]]:
    """Spawn a process, follow it, send ``text``: its pid and every signal until the run finished."""
    proc = await k.spawn(owner="a")
    seen: list[Signal] = []
    following = asyncio.Event()

    async def follow() -> None:
        stream = proc.signals(follow=True)
        following.set()
        async for s in stream:
            seen.append(s)
            if s.signal == sig.RUN_FINISHED:
                return

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.05)  # (the watch is made on the generator's first step)
    await following.wait()
    await proc.send(text)
    await asyncio.wait_for(task, 30)
    await proc.wait_idle()
    return proc.pid, seen


def updates(signals: list[Signal]) -> list[Signal]:
    return [s for s in signals if s.signal == sig.TOOL_UPDATE]


def deltas(signals: list[Signal]) -> str:
    return "".join(s.payload["update"]["delta"] for s in updates(signals))


# -- durable runs ----------------------------------------------------------------------------------


async def test_a_follower_sees_shell_output_stream_before_the_call_finishes(tmp_path: Path) -> None:
    async with kernel(tmp_path, running(STEPS)) as k:
        pid, seen = await follow_run(k)
        names = [s.signal for s in seen]
        got = updates(seen)
        assert len(got) >= 2, names  # the lines come apart, as the command prints them
        finished = names.index(sig.TOOL_FINISHED)
        assert names.index(sig.TOOL_STARTED) < names.index(sig.TOOL_UPDATE)
        assert max(i for i, n in enumerate(names) if n == sig.TOOL_UPDATE) < finished
        assert deltas(seen) == "line1\nline2\nline3\n"
        started = next(s for s in seen if s.signal == sig.TOOL_STARTED).payload
        for update in got:
            assert update.seq is None
            p = update.payload
            assert p["pid"] == pid and p["runId"] == started["runId"] and p["callId"] == started["callId"]
            assert p["name"] == "Shell" and p["update"]["stream"] == "stdout"
        # the result is what it always was
        assert seen[finished].payload["output"] == "line1\nline2\nline3\n[exit code 0]"

        # never logged: a replay of the log has none, and the log's seqs have no holes
        proc = await k.process(pid)
        logged = [s async for s in proc.signals(after_seq=0, follow=False)]
        assert logged and not updates(logged)
        assert [s.seq for s in logged] == list(range(1, len(logged) + 1))
        assert sig.TOOL_FINISHED in [s.signal for s in logged]


async def test_a_flood_of_output_makes_few_capped_updates(tmp_path: Path) -> None:
    async with kernel(tmp_path, running(FLOOD)) as k:
        _, seen = await follow_run(k)
        got = updates(seen)
        assert 1 <= len(got) <= 40, len(got)
        for update in got:
            assert len(update.payload["update"]["delta"].encode()) <= MAX_DELTA_BYTES
        streamed = deltas(seen)
        assert streamed and set(streamed) <= {"y", "\n"}
        assert any(u.payload["update"].get("skipped") for u in got)  # most of it was never sent
        finished = next(s for s in seen if s.signal == sig.TOOL_FINISHED).payload
        assert "omitted" in finished["output"] and finished["output"].endswith("[exit code 0]")


async def test_nobody_watching_costs_nothing_and_a_stalled_watcher_does_not_hold_the_tool(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(sig, "BACKLOG", 3)
    async with kernel(tmp_path, running("for i in 1 2 3 4 5 6; do echo $i; sleep 0.12; done")) as k:
        proc = await k.spawn(owner="a")
        stalled = k.engine.hub.watch(proc.pid)  # never read
        await proc.send("run")
        await asyncio.wait_for(proc.wait_idle(), 20)
        assert stalled.qsize() <= 3
        k.engine.hub.unwatch(proc.pid, stalled)
        texts = [m.text for m in await proc.messages()]
        assert texts[-1] == "done" and "6\n[exit code 0]" in texts[-2]
        # and nobody at all: the call runs just the same
        await proc.send("run")
        await asyncio.wait_for(proc.wait_idle(), 20)
        assert (await proc.messages())[-1].text == "done"


class Opaque:
    def __repr__(self) -> str:
        return "<opaque thing>"


class Hostile:
    def __str__(self) -> str:
        raise RuntimeError("no string for you")

    __repr__ = __str__


async def test_a_tool_may_report_anything_and_never_fails_for_it(tmp_path: Path) -> None:
    @tool
    async def reporter(ctx: ToolContext) -> str:
        """Report progress in every shape."""
        ctx.update({"step": 1, "of": 3})
        ctx.update({"thing": Opaque()})  # not JSON: made a string
        ctx.update(Hostile())  # not even a string: dropped
        ctx.update({1, 2})  # a set
        ctx.update(float("nan"))  # not JSON proper either
        ctx.update("x" * 1_000_000)  # too large to send: dropped
        ctx.update("last")
        return "reported"

    @tool(thread=True)
    def threaded(ctx: ToolContext) -> str:
        """Report from a worker thread."""
        ctx.update({"from": "a thread"})
        return "threaded"

    def brain(req: ModelRequest) -> Reply | str:
        last = req.messages[-1]
        if isinstance(last, ToolResultMessage):
            return "ok"
        return Reply(tool_calls=[call("reporter"), call("threaded")])

    async with kernel(tmp_path, ScriptedModel(brain), tools=[reporter, threaded]) as k:
        _, seen = await follow_run(k, "go")
        finished = {s.payload["name"]: s.payload for s in seen if s.signal == sig.TOOL_FINISHED}
        assert finished["reporter"]["output"] == "reported" and finished["threaded"]["output"] == "threaded"
        reported = [s.payload["update"] for s in updates(seen) if s.payload["name"] == "reporter"]
        assert reported[0] == {"step": 1, "of": 3}
        assert reported[1] == {"thing": "<opaque thing>"}
        assert reported[-1] == "last"
        assert all(isinstance(u, str | dict) for u in reported) and len(reported) == 5
        assert all(json.dumps(s.payload, allow_nan=False) for s in updates(seen))
        assert [s.payload["update"] for s in updates(seen) if s.payload["name"] == "threaded"] == [{"from": "a thread"}]


def test_updates_cross_workers_through_the_relay_with_their_name() -> None:
    sent: list[Any] = []

    class Store:
        async def relay(self, sender: str, batches: list[Any]) -> None:
            sent.extend(batches)

    async def scenario() -> None:
        relay = Relay(Store(), "w1", interest_ttl=10, interval=0.01)  # type: ignore[arg-type]
        relay.followed("w2", ["p1"])
        relay.send("p1", 4, {"pid": "p1", "runId": "r", "event": "text_delta", "delta": "hi"})
        relay.send("p1", 4, {"pid": "p1", "callId": "c", "update": {"delta": "out"}}, signal=sig.TOOL_UPDATE)
        await relay.flush("p1")
        await relay.stop()

    asyncio.run(scenario())
    assert [pid for pid, _, _ in sent] == ["p1"]
    published: list[Signal] = []
    for _, base, payloads in sent:
        json.dumps(payloads)  # what goes over the wire is plain JSON
        publish_batch((base, payloads), 4, published.append)
    assert [s.signal for s in published] == [sig.RUN_STREAM, sig.TOOL_UPDATE]
    assert published[1].payload == {"pid": "p1", "callId": "c", "update": {"delta": "out"}}
    assert all(s.seq is None and s.base == 4 for s in published)


# -- Shell itself ---------------------------------------------------------------------------------


async def test_shell_coalesces_its_output_and_keeps_its_result(tmp_path: Path) -> None:
    got: list[dict[str, Any]] = []
    command = "for i in $(seq 1 60); do echo $i; sleep 0.01; done"
    began = time.monotonic()
    result = await run_shell(tmp_path, command, progress=got.append)
    took = time.monotonic() - began
    text = result.content[0]
    assert isinstance(text, TextContent)
    expected = "".join(f"{i}\n" for i in range(1, 61))
    assert text.text == expected.rstrip("\n") + "\n[exit code 0]"
    assert "".join(u["delta"] for u in got) == expected
    assert all(u["stream"] == "stdout" and "skipped" not in u for u in got)
    assert 2 <= len(got) <= took / UPDATE_INTERVAL + 2, (len(got), took)  # one per 100 ms at most, and the last
    assert len(got) < 45  # (60 writes)


async def test_shell_splits_no_character_and_survives_a_failing_update(tmp_path: Path) -> None:
    got: list[str] = []
    calls = 0

    def update(u: dict[str, Any]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a listener that fails")
        got.append(u["delta"])

    command = "printf 'h\\xc3'; sleep 0.2; printf '\\xa9llo\\n'; sleep 0.2; printf 'bye\\n'"
    result = await run_shell(tmp_path, command, progress=update)
    assert not result.is_error
    assert "".join(got) in ("éllo\nbye\n", "llo\nbye\n", "héllo\nbye\n")  # (the first update was lost)
    assert "\ufffd" not in "".join(got)


async def test_shell_timeout_still_kills_and_reports(tmp_path: Path) -> None:
    got: list[dict[str, Any]] = []
    result = await run_shell(tmp_path, "echo before; sleep 30", timeout=0.5, progress=got.append)
    assert result.is_error and "timed out" in result.content[0].text  # type: ignore[union-attr]
    assert "".join(u["delta"] for u in got) == "before\n"


# -- in memory --------------------------------------------------------------------------------------


async def test_in_memory_agent_gets_shell_output_as_tool_execution_updates(tmp_path: Path) -> None:
    agent = Agent(model=running(STEPS), tools=[shell_tool(tmp_path)])
    events = [e async for e in agent.stream("run")]
    kinds = [e.type for e in events]
    got = [e for e in events if isinstance(e, ToolExecutionUpdate)]
    assert len(got) >= 2
    assert "".join(e.partial_result["delta"] for e in got) == "line1\nline2\nline3\n"
    assert all(e.tool_name == "Shell" and e.partial_result["stream"] == "stdout" for e in got)
    start = next(i for i, e in enumerate(events) if isinstance(e, ToolExecutionStart))
    end = next(i for i, e in enumerate(events) if isinstance(e, ToolExecutionEnd))
    assert (
        start < kinds.index("tool_execution_update")
        and max(i for i, k in enumerate(kinds) if k == "tool_execution_update") < end
    )


# -- over the wire --------------------------------------------------------------------------------


async def test_updates_reach_an_sse_client_following_the_process(tmp_path: Path) -> None:
    options = {"tools": [shell_tool(tmp_path)], "approval": approve_everything}
    with live_server(tmp_path, model=running(STEPS), kernel_options=options) as server:
        async with server.client(server.tokens.alice) as client:
            pid = (await client.post("/v1/processes", json={})).json()["pid"]
            frames: list[dict[str, Any]] = []

            async def follow() -> None:
                async with client.stream("GET", f"/v1/processes/{pid}/events") as resp:
                    assert resp.status_code == 200
                    async for frame in sse_frames(resp):
                        frames.append(frame)
                        if frame.get("event") == sig.RUN_FINISHED:
                            return

            task = asyncio.create_task(follow())
            await wait_until(lambda: server.watchers(pid) == 1)
            await client.post(f"/v1/processes/{pid}/messages", json={"text": "run"})
            await asyncio.wait_for(task, 30)
    names = [f["event"] for f in frames]
    live = [f for f in frames if f["event"] == sig.TOOL_UPDATE]
    assert live and all("id" not in f and f["data"]["seq"] is None for f in live)
    assert max(i for i, n in enumerate(names) if n == sig.TOOL_UPDATE) < names.index(sig.TOOL_FINISHED)
    assert "".join(f["data"]["payload"]["update"]["delta"] for f in live) == "line1\nline2\nline3\n"
    assert all(f["data"]["pid"] == pid and f["data"]["payload"]["name"] == "Shell" for f in live)


async def sse_frames(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    buffer = ""
    async for chunk in resp.aiter_text():
        buffer += chunk.replace("\r\n", "\n")
        while "\n\n" in buffer:
            block, buffer = buffer.split("\n\n", 1)
            for frame in parse_sse(block):
                yield frame


def test_updates_reach_a_websocket_subscriber(tmp_path: Path) -> None:
    tools = [shell_tool(tmp_path)]
    with (
        KernelServer(tmp_path, running(STEPS), tools=tools, approval=approve_everything) as server,
        server.client("alice") as c,
    ):
        pid = c.ok("proc.spawn", {})["pid"]
        c.ok("proc.subscribe", {"pid": pid})
        c.ok("proc.send", {"pid": pid, "text": "run"})
        sigs = c.signals_until(pid, sig.RUN_FINISHED, timeout=20)
    names = [s["signal"] for s in sigs]
    live = [s for s in sigs if s["signal"] == sig.TOOL_UPDATE]
    assert live and all(s["seq"] is None for s in live)
    assert max(i for i, n in enumerate(names) if n == sig.TOOL_UPDATE) < names.index(sig.TOOL_FINISHED)
    assert "".join(s["payload"]["update"]["delta"] for s in live) == "line1\nline2\nline3\n"


# -- the chat's rendering --------------------------------------------------------------------------


def renderer() -> tuple[TextRenderer, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    console = Console(file=err, soft_wrap=True, highlight=False, color_system=None)
    return TextRenderer(out, console), out, err


def test_the_chat_shows_streamed_output_under_its_call() -> None:
    view, out, err = renderer()
    signals = SignalRenderer(view)

    def update(delta: str, **more: Any) -> Signal:
        payload = {
            "pid": "p",
            "runId": "r",
            "callId": "c1",
            "name": "Shell",
            "update": {"stream": "stdout", "delta": delta, **more},
        }
        return Signal(sig.TOOL_UPDATE, payload)

    signals.handle(Signal(sig.RUN_STARTED, {"runId": "r"}))
    signals.handle(
        Signal(sig.TOOL_STARTED, {"runId": "r", "callId": "c1", "name": "Shell", "args": {"command": "make"}}, 1)
    )
    signals.handle(update("compiling a\ncompil"))
    signals.handle(update("ing b\n\x1b[31mred\x1b[0m"))
    signals.handle(update("tail\n", skipped=1234))
    signals.handle(update("no newline at the end"))
    signals.handle(Signal(sig.TOOL_UPDATE, {"runId": "r", "callId": "c1", "name": "Shell", "update": {"pct": 5}}))
    finished = {"runId": "r", "callId": "c1", "name": "Shell", "ok": True, "output": "all of it"}
    signals.handle(Signal(sig.TOOL_FINISHED, finished, 2))
    signals.handle(Signal(sig.RUN_OUTPUT, {"runId": "r", "text": "built"}, 3))
    signals.handle(Signal(sig.RUN_FINISHED, {"runId": "r", "status": "ok"}, 4))
    lines = err.getvalue().splitlines()
    assert lines[0] == "▸ Shell make"
    assert lines[1:3] == ["  compiling a", "  compiling b"]
    assert "\x1b" not in err.getvalue() and "\\u001b[31mred" in lines[3]
    assert lines[4:] == [
        "  … 1,234 characters skipped …",
        "  tail",
        "  no newline at the end",  # the unfinished line is shown before the call's end
        "✓ Shell make",
    ]
    assert out.getvalue() == "built\n"


def test_agentloop_chat_over_a_server_shows_the_output_as_it_comes(tmp_path: Path) -> None:
    options = {"tools": [shell_tool(tmp_path)], "approval": approve_everything}
    with live_server(tmp_path, model=running(STEPS), kernel_options=options) as server:
        out, err = remote_chat(server, "run\n")
    lines = [line.rstrip() for line in err.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("▸ Shell for i in 1 2 3"))
    end = next(i for i, line in enumerate(lines) if line.startswith("✓ Shell"))
    assert lines[start + 1 : end] == ["  line1", "  line2", "  line3"]
    assert "done" in out


def test_the_in_memory_renderer_shows_updates_too() -> None:
    view, _, err = renderer()
    view.handle(ToolExecutionStart(tool_call_id="c", tool_name="Shell", args={"command": "ls"}))
    view.handle(
        ToolExecutionUpdate(tool_call_id="c", tool_name="Shell", partial_result={"stream": "stdout", "delta": "a\nb\n"})
    )
    view.handle(ToolExecutionUpdate(tool_call_id="c", tool_name="Shell", partial_result="not a delta"))
    result = ToolResultMessage(tool_call_id="c", tool_name="Shell", content=[TextContent(text="a\nb")])
    view.handle(ToolExecutionEnd(tool_call_id="c", tool_name="Shell", result=result, is_error=False))
    assert err.getvalue().splitlines() == ["▸ Shell ls", "  a", "  b", "✓ Shell ls"]


# -- the web UI ------------------------------------------------------------------------------------

STREAMED = {"tool_calls": [{"name": "Shell", "arguments": {"command": "echo first; sleep 1.5; echo second"}}]}
served = web.served  # (fixtures of the browser tests: a real ``agentloop serve`` with a scripted model)
replies = web.replies


@pytest.mark.parametrize("replies", [[STREAMED, "Ran it."]])
def test_the_web_ui_shows_a_running_commands_output_in_its_card(served: tuple[str, str, Path], browser: Any) -> None:
    url, token, _ = served
    web.sign_in_and_open_a_process(browser, url, token)
    web.send(browser, "run it")
    card = "document.querySelector('#transcript .tool')"
    # the first line is in the card while the command still runs
    output = f"{card}.querySelector('.output').textContent"
    browser.wait(f"{card} && {card}.classList.contains('running') && {output}.includes('first')")
    assert browser.eval(output) == "first\n"
    browser.wait("document.querySelector('#transcript .footer[data-status=ok]')")
    assert browser.eval(f"{card}.className") == "tool ok"
    assert browser.eval(output) == "first\nsecond\n[exit code 0]"
    assert not [line for line in browser.console if "exception" in line], browser.console


def test_the_json_renderer_prints_any_update() -> None:
    out = io.StringIO()
    json_view = JsonRenderer(out)
    for value in ({"stream": "stdout", "delta": "é\n"}, {"thing": Opaque()}, Hostile()):
        json_view.handle(ToolExecutionUpdate(tool_call_id="c", tool_name="t", partial_result=value))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["partial_result"] for line in lines] == [
        {"stream": "stdout", "delta": "é\n"},
        {"thing": "<opaque thing>"},
        None,
    ]
    assert all(line["type"] == "tool_execution_update" and line["tool_call_id"] == "c" for line in lines)
