"""Context pressure and the per-process compaction policy.

After each model step the durable runner knows how full the context window is (the provider's
usage, else the estimate compaction already makes) and names a level: ok, warn, critical, full.
The level is kept in the process's cache; only a change of level is written (``process_kv``
"context") and logged (``proc.changed`` with ``changes: ["context"]``), in the step's own commit.
``Process.set_compaction`` overrides the kernel's threshold, what an overflow does and how much
recent history a summary keeps, from the process's next run on.
"""

from __future__ import annotations

import asyncio
import io
import math
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.cli.render import SignalRenderer, TextRenderer, stderr_console
from agentloop.client import AgentloopClient
from agentloop.kernel import Kernel, NoSuchProcess, Process
from agentloop.messages import SystemMessage, UserMessage
from agentloop.models.base import ModelInfo, ModelRequest, ProviderError
from agentloop.process import signals as psig
from agentloop.process.compaction import SUMMARY_KIND, SUMMARY_SYSTEM_PROMPT, estimate_tokens
from agentloop.process.pressure import (
    CRITICAL_AT,
    FULL_AT,
    LEVELS,
    WARN_AT,
    CompactionPolicy,
    check_policy,
    context_level,
    level_band,
)
from agentloop.process.signals import Signal
from agentloop.process.store import open_store
from agentloop.server import api
from tests import server_support
from tests.server_support import LiveServer, remote_chat, wait_idle
from tests.ws_support import KernelServer

# a window of 2,000 usable tokens (the output budget is not usable): ratios are easy to read
SMALL = ModelInfo(provider="scripted", id="small", context_window=2_200, max_output=200)
PAD = "lorem ipsum dolor sit amet " * 30  # about 200 tokens


def reporting(req: ModelRequest) -> Reply | str:
    """A user message ``"<n>"`` is answered with usage of ``n`` input tokens (0 output): the
    provider says how full the window is. The summary call answers a summary."""
    if req.system_prompt == SUMMARY_SYSTEM_PROMPT:
        return "Summary: numbers were sent."
    last = req.messages[-1]
    if isinstance(last, ToolResultMessage):
        return Reply(text="done", input_tokens=int(last.text), output_tokens=0)
    if isinstance(last, UserMessage) and last.text.startswith("tool "):
        return Reply(tool_calls=[call("count", n=int(last.text[5:]))], input_tokens=int(last.text[5:]), output_tokens=0)
    return Reply(text="ok", input_tokens=int(last.text.split()[0]), output_tokens=0)


def estimating(req: ModelRequest) -> Reply | str:
    """Usage as large as the request's estimate: the window fills as the history grows."""
    if req.system_prompt == SUMMARY_SYSTEM_PROMPT:
        return "Summary: padded messages were sent."
    used = estimate_tokens(req.system_prompt) + estimate_tokens(req.tools) + estimate_tokens(req.messages)
    return Reply(text="ok", input_tokens=used, output_tokens=0)


@tool
def count(n: int) -> str:
    """Return the number."""
    return str(n)


def kernel(tmp_path: Path, brain: Callable[[ModelRequest], Any], **kw: Any) -> AbstractAsyncContextManager[Kernel]:
    return Kernel.open(
        f"sqlite:///{tmp_path}/a.db",
        model=ScriptedModel(brain, info=SMALL),
        workspace=tmp_path,
        tools=[count],
        heartbeat=None,
        **kw,
    )


async def context_signals(proc: Process, after: int = 0) -> list[dict[str, Any]]:
    return [
        s.payload
        async for s in proc.signals(after, follow=False)
        if s.signal == psig.CHANGED and "context" in s.payload.get("changes", ())
    ]


async def compactions(proc: Process) -> list[dict[str, Any]]:
    return [s.payload async for s in proc.signals(follow=False) if s.signal == psig.COMPACTED]


async def say(proc: Process, text: str) -> None:
    await proc.send(text)
    await proc.wait_idle()


async def finished(proc: Process) -> list[dict[str, Any]]:
    return [s.payload async for s in proc.signals(follow=False) if s.signal == psig.RUN_FINISHED]


# ------------------------------------------------------------------ levels


def test_levels_follow_fixed_thresholds_and_the_compaction_threshold() -> None:
    assert (WARN_AT, CRITICAL_AT, FULL_AT) == (0.7, 0.85, 1.0)
    assert [context_level(r, 0.9) for r in (0.0, 0.69, 0.7, 0.849, 0.85, 0.99, 1.0, 3.0)] == [
        "ok",
        "ok",
        "warn",
        "warn",
        "critical",
        "critical",
        "full",
        "full",
    ]
    assert context_level(0.55, 0.5) == "critical"  # at the process's own threshold: compaction is next
    assert context_level(0.45, 0.5) == "ok"


@given(
    ratio=st.floats(min_value=0, max_value=3, allow_nan=False),
    threshold=st.floats(min_value=0.01, max_value=1.0),
)
def test_a_levels_band_holds_exactly_the_ratios_of_that_level(ratio: float, threshold: float) -> None:
    """The step's fast path (a comparison against the known level's band) agrees with the levels."""
    for level in LEVELS:
        low, high, window = level_band(level, 1_000, threshold)
        assert (low <= ratio < high) == (context_level(ratio, threshold) == level), (level, ratio, threshold)
        assert window == 1_000


async def test_levels_are_signalled_and_written_only_when_they_change(tmp_path: Path) -> None:
    async with kernel(tmp_path, reporting, compaction_threshold=1.0) as k:
        proc = await k.spawn(owner="alice")
        assert (await proc.context()).level == "ok"
        for n in (200, 400, 1_440, 1_500, 1_740, 2_100):
            await say(proc, str(n))
        changes = await context_signals(proc)
        assert [(c["level"], c["tokens"]) for c in changes] == [("warn", 1_440), ("critical", 1_740), ("full", 2_100)]
        assert set(changes[0]) == {"pid", "changes", "level", "ratio", "tokens", "window"}
        assert changes[0]["changes"] == ["context"] and changes[0]["window"] == 2_000
        assert changes[0]["ratio"] == pytest.approx(0.72)
        ctx = await proc.context()
        assert (ctx.level, ctx.tokens, ctx.window) == ("full", 2_100, 2_000)
        assert ctx.ratio == pytest.approx(1.05) and ctx.policy == CompactionPolicy()
        assert ctx.threshold == 1.0  # the kernel's, no policy overrides it
        stored = await k.store.kv_get(proc.pid, "context")
        assert stored["level"] == "full" and stored["tokens"] == 2_100
        pid = proc.pid
    async with kernel(tmp_path, reporting, compaction_threshold=1.0) as k:  # a restart
        proc = await k.process(pid)
        assert (await proc.context()).level == "full"  # from the store: nothing cached yet
        last = [s.seq async for s in proc.signals(follow=False)][-1] or 0
        await say(proc, "600")
        await say(proc, "700")
        assert [(c["level"], c["tokens"]) for c in await context_signals(proc, last)] == [("ok", 600)]
        assert (await proc.context()).tokens == 700  # the cache has every step's figures
        assert (await k.store.kv_get(pid, "context"))["tokens"] == 600  # the store, the last change's


async def test_a_step_at_an_unchanged_level_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The common case adds no statement: the level is compared in memory, and the per-run read
    of the mode, the policy and (once per load) the stored level is one query."""
    async with kernel(tmp_path, reporting) as k:
        proc = await k.spawn(owner="alice")
        await say(proc, "100")
        calls: list[tuple[str, Any]] = []
        store = k.store

        def counting(name: str) -> Callable[..., Any]:
            real = getattr(store, name)

            def counted(*args: Any) -> Any:
                calls.append((name, args[1:]))
                return real(*args)

            return counted

        for name in ("kv_get", "kv_set", "kv_delete", "kv_many"):
            monkeypatch.setattr(store, name, counting(name))
        await say(proc, "tool 300")  # three model steps: the call, its result, the answer
        await say(proc, "200")
        ours = {"mode", "compaction", "context"}
        assert [c for c in calls if c[0] != "kv_many" and c[1][0] in ours] == []
        many = [c[1] for c in calls if c[0] == "kv_many" and ours & set(c[1][0])]  # (not the approval rules')
        assert len(many) == 2 and all("context" not in keys for (keys,) in many)  # one per run, level known
        assert (await proc.context()).tokens == 200


async def test_a_reset_forgets_the_level(tmp_path: Path) -> None:
    async with kernel(tmp_path, reporting) as k:
        proc = await k.spawn(owner="alice")
        await say(proc, "1800")
        assert (await proc.context()).level == "critical"
        await proc.reset()
        ctx = await proc.context()
        assert (ctx.level, ctx.tokens) == ("ok", 0) and await k.store.kv_get(proc.pid, "context") is None
        await say(proc, "1500")
        assert [c["level"] for c in await context_signals(proc)] == ["warn"]  # the reset's log is gone


async def test_a_compaction_reports_the_lower_level_in_its_own_commit(tmp_path: Path) -> None:
    async with kernel(tmp_path, estimating, clear_tool_outputs=False) as k:
        proc = await k.spawn(owner="alice")
        await proc.set_compaction(threshold=0.8)
        for i in range(7):
            await say(proc, f"{i} {PAD}")
        logged = [s async for s in proc.signals(follow=False)]
    at = next(i for i, s in enumerate(logged) if s.signal == psig.COMPACTED)
    before = [s.payload["level"] for s in logged[:at] if s.signal == psig.CHANGED and "level" in s.payload]
    assert before and before[-1] != "ok"
    after = logged[at + 1]
    assert after.signal == psig.CHANGED and after.payload["changes"] == ["context"] and after.payload["level"] == "ok"


# ------------------------------------------------------------------ the policy


async def test_the_policy_threshold_compacts_earlier_or_later_than_the_kernels(tmp_path: Path) -> None:
    async def first_compaction(k: Kernel, **policy: Any) -> int | None:
        proc = await k.spawn(owner="alice")
        if policy:
            await proc.set_compaction(**policy)
        for i in range(7):
            await say(proc, f"{i} {PAD}")
            if await compactions(proc):
                return i
        return None

    async with kernel(tmp_path, estimating, compaction_threshold=0.5, clear_tool_outputs=False) as k:
        default = await first_compaction(k)
        early = await first_compaction(k, threshold=0.4)
        late = await first_compaction(k, threshold=0.95)
    assert default is not None and early is not None
    assert early < default and late is None


async def test_the_policy_keeps_as_many_recent_tokens_as_it_says(tmp_path: Path) -> None:
    async with kernel(tmp_path, estimating, clear_tool_outputs=False) as k:
        proc = await k.spawn(owner="alice")
        await proc.set_compaction(threshold=0.5, keep_recent_tokens=10)
        for i in range(5):
            await say(proc, f"{i} {PAD}")
        done = await compactions(proc)
        history = await proc.messages()
    assert done and done[0]["reason"] == "threshold"
    assert isinstance(history[0], SystemMessage) and history[0].kind == SUMMARY_KIND
    # the default keeps a quarter of the window (~430 tokens, two padded messages or more)
    kept_after_summary = [m for m in history[1:] if isinstance(m, UserMessage)]
    assert len(kept_after_summary) <= 2


def overflowing(req: ModelRequest) -> Reply | str:
    """A message "overflow" is refused as too long until the history was summarised; "silent" is answered
    with usage past the whole window (a server that cut the prompt without saying so)."""
    if req.system_prompt == SUMMARY_SYSTEM_PROMPT:
        return "Summary: padded messages were sent."
    summarised = any(isinstance(m, SystemMessage) and m.kind == SUMMARY_KIND for m in req.messages)
    text = req.messages[-1].text
    if text == "overflow" and not summarised:
        raise ProviderError("prompt is too long: 9000 tokens > 2200 maximum", kind="overflow")
    if text == "silent" and not summarised:
        return Reply(text="I only saw half of it", input_tokens=5_000, output_tokens=1)
    return Reply(text="ok", input_tokens=100, output_tokens=1)


@pytest.mark.parametrize("trigger", ["overflow", "silent"])
async def test_overflow_fail_ends_the_run_with_an_error_and_no_compaction(tmp_path: Path, trigger: str) -> None:
    async with kernel(tmp_path, overflowing, clear_tool_outputs=False) as k:
        default, strict = await k.spawn(owner="alice"), await k.spawn(owner="alice")
        await strict.set_compaction(overflow="fail")
        for proc in (default, strict):
            for i in range(3):
                await say(proc, f"{i} {PAD}")
            await say(proc, trigger)
        assert [c["reason"] for c in await compactions(default)] == ["overflow"]
        assert (await finished(default))[-1]["status"] == "ok"
        assert await compactions(strict) == []
        end = (await finished(strict))[-1]
        assert end["status"] == "error" and "overflow" in end["error"] and "compaction policy" in end["error"]
        assert "even compacted" not in end["error"]
        # the next message runs (and may fit): the policy ended one run, not the process
        await say(strict, "fine now")
        assert (await finished(strict))[-1]["status"] == "ok"


async def test_the_policy_is_read_once_per_run(tmp_path: Path) -> None:
    """Set while a run is under way, it applies from the next run on (as the mode does)."""
    asked, gate = asyncio.Event(), asyncio.Event()

    async def brain(req: ModelRequest) -> Reply | str:
        if req.messages[-1].text == "wait":
            asked.set()
            await gate.wait()
            raise ProviderError("prompt is too long", kind="overflow")
        return Reply(text="ok", input_tokens=10, output_tokens=1)

    async with kernel(tmp_path, brain, clear_tool_outputs=False) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("wait")
        await asyncio.wait_for(asked.wait(), 5)
        await proc.set_compaction(overflow="fail")
        assert (await proc.compaction()).overflow == "fail"
        gate.set()
        await proc.wait_idle()
        assert "compaction policy" not in (await finished(proc))[-1]["error"]  # the run's own: compact


def test_policy_values_are_checked() -> None:
    assert check_policy(0.5, "fail", 1_000) == CompactionPolicy(0.5, "fail", 1_000)
    assert check_policy(1, "compact", None) == CompactionPolicy(1.0, "compact", None)
    bad: list[tuple[Any, Any, Any, type[Exception], str]] = [
        (0, "compact", None, ValueError, "threshold"),
        (-0.1, "compact", None, ValueError, "threshold"),
        (1.5, "compact", None, ValueError, "threshold"),
        (math.nan, "compact", None, ValueError, "threshold"),
        (True, "compact", None, TypeError, "threshold"),
        ("0.5", "compact", None, TypeError, "threshold"),
        (None, "explode", None, ValueError, "overflow"),
        (None, None, None, ValueError, "overflow"),
        (None, "compact", 0, ValueError, "keep_recent_tokens"),
        (None, "compact", -5, ValueError, "keep_recent_tokens"),
        (None, "compact", 10**12, ValueError, "keep_recent_tokens"),
        (None, "compact", 1.5, TypeError, "keep_recent_tokens"),
        (None, "compact", True, TypeError, "keep_recent_tokens"),
    ]
    for threshold, overflow, keep, kind, field in bad:
        with pytest.raises(kind, match=field):
            check_policy(threshold, overflow, keep)


async def test_set_compaction_stores_checks_and_clears(tmp_path: Path) -> None:
    async with kernel(tmp_path, reporting) as k:
        proc = await k.spawn(owner="alice")
        assert await proc.compaction() == CompactionPolicy()
        seq = [s.seq async for s in proc.signals(follow=False)]
        await proc.set_compaction(threshold=0.6, overflow="fail", keep_recent_tokens=3_000)
        assert await proc.compaction() == CompactionPolicy(0.6, "fail", 3_000)
        assert (await proc.context()).threshold == 0.6
        logged = [s async for s in proc.signals(seq[-1] if seq else 0, follow=False)]
        assert [s.payload["changes"] for s in logged if s.signal == psig.CHANGED] == [["compaction"]]
        with pytest.raises(ValueError, match="threshold"):
            await proc.set_compaction(threshold=2.0)
        assert (await proc.compaction()).threshold == 0.6  # a refused policy changes nothing
        await proc.set_compaction()  # the defaults: the row goes
        assert await k.store.kv_get(proc.pid, "compaction") is None
        async with k.store.transaction():  # a damaged row: the defaults
            await k.store.kv_set(proc.pid, "compaction", {"threshold": "lots"})
        assert await proc.compaction() == CompactionPolicy()
        await proc.kill(archive=False)
        with pytest.raises(NoSuchProcess):
            await proc.context()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_kv_many_reads_several_keys_in_one_query(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from agentloop.process.store import ProcessRecord

    if backend == "postgres":
        pytest.importorskip("asyncpg")
        url = request.getfixturevalue("pg_url")
    else:
        url = f"sqlite:///{tmp_path}/kv.db"
    store = open_store(url)
    await store.open()
    try:
        async with store.transaction():
            await store.create_process(ProcessRecord(pid="p", owner="alice", run_as="alice", cwd="/"))
            await store.kv_set("p", "mode", "chat")
            await store.kv_set("p", "compaction", {"threshold": 0.5})
        assert await store.kv_many("p", ("mode", "compaction", "context")) == {
            "mode": "chat",
            "compaction": {"threshold": 0.5},
        }
        assert await store.kv_many("p", ()) == {} and await store.kv_many("other", ("mode",)) == {}
    finally:
        await store.close()


# ------------------------------------------------------------------ HTTP, WebSocket, client


server = server_support.module_server("pressure")
alice = server_support.alice


async def test_http_process_carries_its_context(alice: httpx.AsyncClient) -> None:
    made = (await alice.post("/v1/processes", json={})).json()
    api.ProcessOut.model_validate(made)
    assert made["context_pressure"]["level"] == "ok" and made["context_pressure"]["tokens"] == 0
    pid = made["pid"]
    await alice.post(f"/v1/processes/{pid}/messages", json={"text": "hello"})
    await wait_idle(alice, pid)
    got = (await alice.get(f"/v1/processes/{pid}")).json()
    api.ProcessOut.model_validate(got)
    ctx = got["context_pressure"]
    assert ctx["level"] == "ok" and ctx["tokens"] == 15 and ctx["window"] == 1_000_000 - 4_096
    assert ctx["policy"] == {"threshold": None, "overflow": "compact", "keep_recent_tokens": None}
    assert ctx["threshold"] == 0.9
    listed = (await alice.get("/v1/processes")).json()["processes"]
    assert all("context_pressure" not in p for p in listed)  # (a list reads no process's row)


async def test_http_compaction_policy_is_read_set_and_checked(server: LiveServer, alice: httpx.AsyncClient) -> None:
    pid = (await alice.post("/v1/processes", json={})).json()["pid"]
    url = f"/v1/processes/{pid}/compaction"
    got = await alice.get(url)
    assert got.status_code == 200, got.text
    api.CompactionOut.model_validate(got.json())
    defaults = {"pid": pid, "threshold": None, "overflow": "compact", "keep_recent_tokens": None}
    assert got.json() == {**defaults, "default_threshold": 0.9}
    body = {"threshold": 0.6, "overflow": "fail", "keep_recent_tokens": 4_000}
    put = await alice.post(url, json=body)
    assert put.status_code == 200 and put.json() == {"pid": pid, **body, "default_threshold": 0.9}
    assert (await alice.get(url)).json()["threshold"] == 0.6
    assert (await alice.get(f"/v1/processes/{pid}")).json()["context_pressure"]["threshold"] == 0.6
    assert (await alice.post(url, json={"threshold": 1})).json()["threshold"] == 1.0  # a whole number is fine
    for bad in (
        {"threshold": 0},
        {"threshold": 1.5},
        {"threshold": "0.5"},
        {"threshold": True},
        {"overflow": "explode"},
        {"keep_recent_tokens": 0},
        {"keep_recent_tokens": 2.5},
        {"keep_recent": 10},
    ):
        resp = await alice.post(url, json=bad)
        assert resp.status_code == 400 and resp.json()["code"] == "invalid_request", (bad, resp.text)
    assert (await alice.get(url)).json()["threshold"] == 1.0  # unchanged by the refused ones
    assert (await alice.post(url, json={})).json() == {**defaults, "default_threshold": 0.9}
    async with server.client(server.tokens.bob) as bob:
        assert (await bob.get(url)).status_code == 404
        assert (await bob.post(url, json={"overflow": "fail"})).status_code == 404
    assert (await alice.get("/v1/processes/nope/compaction")).status_code == 404


async def test_the_client_reads_and_sets_the_policy_and_the_context(server: LiveServer) -> None:
    async with AgentloopClient(server.url, server.tokens.alice) as client:
        pid = (await client.spawn())["pid"]
        assert (await client.compaction(pid))["overflow"] == "compact"
        done = await client.set_compaction(pid, threshold=0.7, overflow="fail")
        assert done["threshold"] == 0.7 and done["overflow"] == "fail" and done["keep_recent_tokens"] is None
        assert (await client.process(pid))["context_pressure"]["policy"]["overflow"] == "fail"
        assert (await client.set_compaction(pid))["threshold"] is None


def test_the_websocket_shows_the_context_and_sets_the_policy(tmp_path: Path) -> None:
    model = ScriptedModel(reporting, info=SMALL)
    with KernelServer(tmp_path, model, tools=[count]) as s, s.client("alice") as c:
        pid = c.ok("proc.spawn", {})["pid"]
        assert c.ok("proc.get", {"pid": pid})["context_pressure"]["level"] == "ok"
        c.ok("proc.subscribe", {"pid": pid})
        c.ok("proc.send", {"pid": pid, "text": "1500"})
        seen = c.signals_until(pid, "proc.run.finished")
        context = [f["payload"] for f in seen if f["signal"] == "proc.changed" and "context" in f["payload"]["changes"]]
        assert [p["level"] for p in context] == ["warn"]
        got = c.ok("proc.get", {"pid": pid})["context_pressure"]
        assert (got["level"], got["tokens"], got["window"]) == ("warn", 1_500, 2_000)
        assert c.ok("proc.compaction", {"pid": pid})["overflow"] == "compact"
        answer = c.ok("proc.compaction", {"pid": pid, "threshold": 0.5, "keep_recent_tokens": 900})
        assert answer == {
            "pid": pid,
            "threshold": 0.5,
            "overflow": "compact",
            "keep_recent_tokens": 900,
            "default_threshold": 0.9,
        }
        assert c.ok("proc.compaction", {"pid": pid})["threshold"] == 0.5
        assert c.ok("proc.compaction", {"pid": pid, "threshold": None})["threshold"] is None
        for args, field in (
            ({"threshold": 3}, "threshold"),
            ({"threshold": "x"}, "threshold"),
            ({"overflow": "explode"}, "overflow"),
            ({"keep_recent_tokens": -1}, "keep_recent_tokens"),
        ):
            res = c.call("proc.compaction", {"pid": pid, **args})
            assert not res["ok"] and res["error"]["code"] == "invalid_request", res
            assert field in res["error"]["message"]
        with s.client("bob") as bob:
            assert bob.error("proc.compaction", {"pid": pid, "overflow": "fail"}) == "not_found"
            assert bob.error("proc.get", {"pid": pid}) == "not_found"


# ------------------------------------------------------------------ chat


def test_the_chat_shows_a_dim_line_when_the_level_rises() -> None:
    err = io.StringIO()
    view = SignalRenderer(TextRenderer(io.StringIO(), stderr_console(err)))

    def changed(level: str, ratio: float, seq: int) -> Signal:
        payload = {"changes": ["context"], "level": level, "ratio": ratio, "tokens": int(ratio * 1000), "window": 1000}
        return Signal(psig.CHANGED, payload, seq)

    view.handle(changed("warn", 0.72, 1))
    view.handle(changed("critical", 0.88, 2))
    view.handle(changed("ok", 0.2, 3))  # compacted: falling says nothing
    view.handle(Signal(psig.CHANGED, {"changes": ["messages"]}, 4))
    view.handle(changed("warn", 0.75, 5))
    lines = err.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert "72%" in lines[0] and "720 of 1,000 tokens" in lines[0]
    assert "88%" in lines[1] and "compact" in lines[1]
    assert "75%" in lines[2]


def test_chat_slash_context_and_the_warning(tmp_path: Path) -> None:
    from agentloop.cli.chat import ChatRepl, ChatState, DurableSession, PlainReader

    ev = asyncio.new_event_loop()
    stack = AsyncExitStack()
    err = io.StringIO()
    try:
        k = ev.run_until_complete(stack.enter_async_context(kernel(tmp_path, reporting)))
        session = DurableSession(k, owner="me", cwd=tmp_path, state=ChatState(tmp_path / "chat.json"))
        ev.run_until_complete(session.open(new=True))
        ev.run_until_complete(session.process.set_compaction(threshold=0.8, overflow="fail"))
        reader = PlainReader(io.StringIO("/context\n300\n1500\n/context\n/help\n/exit\n"))
        repl = ChatRepl(session, reader=reader, out=io.StringIO(), err=Console(file=err, width=200))
        assert repl.loop(ev) == 0
    finally:
        ev.run_until_complete(stack.aclose())
        ev.close()
    shown = err.getvalue()
    assert "context: ok · 0% of 2,000 tokens" in shown
    assert shown.count("context 75% full") == 1  # the rise to warn, said once
    assert "context: warn · 75% of 2,000 tokens (1,500)" in shown
    assert "compacts at 80%" in shown and "overflow fails the run" in shown
    assert "/context" in shown[shown.rindex("/new") :]  # /help lists it


def test_chat_slash_context_in_memory_and_remote(server: LiveServer) -> None:
    from agentloop import Agent
    from agentloop.cli.chat import ChatRepl, PlainReader

    err = io.StringIO()
    reader = PlainReader(io.StringIO("/context\n/exit\n"))
    repl = ChatRepl(Agent(model=ScriptedModel(["hi"])), reader=reader, out=io.StringIO(), err=Console(file=err))
    assert repl.loop() == 0
    assert "no context figures" in err.getvalue()

    _, shown = remote_chat(server, "hi\n/context\n/exit\n")
    assert "context: ok · 0% of 995,904 tokens (15)" in shown
