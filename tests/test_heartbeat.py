"""Heartbeat check-ins: HEARTBEAT.md asks, the kernel delivers a beat per period to the
workspace's main conversation, and an acknowledgement is marked quiet for clients."""

from __future__ import annotations

import asyncio
import datetime
import io
import math
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from agentloop import ScriptedModel
from agentloop.cli.render import SignalRenderer, TextRenderer
from agentloop.kernel.heartbeat import Heartbeat, offset_of
from agentloop.process.heartbeat import DEFAULT_TEXT, HeartbeatSettings, has_instructions, is_ack, parse_hours, within
from agentloop.process.signals import Signal
from tests.process_support import kernel

EVERY = 60.0
ASKING = "# Heartbeat\n\n- Look at inbox.txt and tell me about anything urgent.\n"


def settings(**kw: Any) -> HeartbeatSettings:
    return HeartbeatSettings(every=kw.pop("every", EVERY), hours=kw.pop("hours", None), **kw)


def later(periods: float) -> float:
    return time.time() + periods * EVERY


async def beats(proc: Any) -> int:
    """Check-ins the process got (from its log: a quiet one leaves the conversation)."""
    return len([s async for s in proc.signals(follow=False) if s.payload.get("reason") == "heartbeat"])


async def signals_of(proc: Any, name: str) -> list[dict[str, Any]]:
    return [s.payload async for s in proc.signals(follow=False) if s.signal == name]


async def check_ins(workspace: Path, reply: str = "HEARTBEAT_OK") -> int:
    """A new main conversation in ``workspace``, its timer passed three periods on: the check-ins
    it got."""
    async with kernel(workspace, ScriptedModel(lambda r: reply), heartbeat=settings()) as k:
        await k.heartbeat.stop()
        proc = await k.spawn(owner="a")
        k.heartbeat.clock = lambda: later(3)
        await k.heartbeat.beat_due()
        await proc.wait_idle()
        return await beats(proc)


async def quiet_kernel(tmp_path: Path, model: Any, **kw: Any) -> Any:
    """A kernel whose heartbeat timer the test drives itself (``beat_due`` with a clock)."""
    return kernel(tmp_path, model, heartbeat=settings(**kw))


# ------------------------------------------------------------------ the rules


def test_a_template_of_headings_and_empty_items_asks_for_nothing():
    assert not has_instructions("")
    assert not has_instructions("# Heartbeat\n\n## Tasks\n- \n* [ ]\n<!-- add tasks here -->\n")
    assert not has_instructions("<!--\nmulti-line\ncomment\n-->\n\n")
    assert has_instructions("# Heartbeat\n- check the build\n")
    assert has_instructions("Tell me the weather at nine.")


def test_active_hours_parse_and_span_midnight():
    assert parse_hours(None) is None and parse_hours("all") is None and parse_hours("") is None
    day = parse_hours("08:00-23:00")
    assert within(day, datetime.time(8)) and within(day, datetime.time(22, 59))
    assert not within(day, datetime.time(23)) and not within(day, datetime.time(7, 59))
    night = parse_hours("22:00-06:00")
    assert within(night, datetime.time(23, 30)) and within(night, datetime.time(5))
    assert not within(night, datetime.time(12))
    assert within(parse_hours("00:00-24:00"), datetime.time(23, 59, 59))
    for bad in ("8-23", "25:00-26:00", "08:60-09:00", "24:30-01:00", "noon"):
        with pytest.raises(ValueError, match="active hours"):
            parse_hours(bad)


def test_settings_refuse_a_period_too_short_or_not_a_number():
    with pytest.raises(ValueError, match="at least 60"):
        HeartbeatSettings(every=5)
    with pytest.raises(ValueError, match="number of seconds"):
        HeartbeatSettings(every=math.nan)
    with pytest.raises(ValueError, match="non-empty"):
        HeartbeatSettings(text=" ")
    assert HeartbeatSettings().every == 1800 and HeartbeatSettings().hours == parse_hours("08:00-23:00")


def test_what_counts_as_an_acknowledgement():
    for ack in ("HEARTBEAT_OK", " **HEARTBEAT_OK** ", "HEARTBEAT_OK.", "Nothing urgent in the inbox. HEARTBEAT_OK"):
        assert is_ack(ack), ack
    for answer in (
        None,
        "",
        "All fine",
        "HEARTBEAT_OK " + "x" * 301,
        "The build broke; HEARTBEAT_OK is not right here",
    ):
        assert not is_ack(answer), answer


def test_processes_beat_at_offsets_spread_over_the_period():
    offsets = {offset_of(f"p{i}", 1800) for i in range(50)}
    assert len(offsets) == 50 and all(0 <= o < 1800 for o in offsets)
    assert max(offsets) - min(offsets) > 900


# ------------------------------------------------------------------ delivery


async def test_the_main_conversation_gets_one_beat_per_period_and_an_ack_is_quiet(tmp_path):
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    async with await quiet_kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK")) as k:
        await k.heartbeat.stop()  # the test runs the passes
        proc = await k.spawn(owner="a")
        k.heartbeat.clock = lambda: later(0.5)
        await k.heartbeat.beat_due()
        assert await beats(proc) == 0  # not within its first period
        now = later(2)
        k.heartbeat.clock = lambda: now
        delay = await k.heartbeat.beat_due()
        assert 0 < delay <= 60
        await proc.wait_idle()
        await k.heartbeat.beat_due()  # the same period again: nothing more
        await proc.wait_idle()
        assert await beats(proc) == 1
        [started] = await signals_of(proc, "proc.run.started")
        assert started["reason"] == "heartbeat" and started["runId"].startswith("heartbeat:")
        [output] = await signals_of(proc, "proc.run.output")
        [finished] = await signals_of(proc, "proc.run.finished")
        assert output["quiet"] is True and finished["quiet"] is True and finished["text"] == "HEARTBEAT_OK"
        k.heartbeat.clock = lambda: now + EVERY  # the next period
        await k.heartbeat.beat_due()
        await proc.wait_idle()
        assert await beats(proc) == 2


async def test_an_answer_with_something_to_say_is_not_quiet(tmp_path):
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    async with await quiet_kernel(tmp_path, ScriptedModel(lambda r: "The inbox has an urgent mail from Bob.")) as k:
        await k.heartbeat.stop()
        proc = await k.spawn(owner="a")
        k.heartbeat.clock = lambda: later(2)
        await k.heartbeat.beat_due()
        await proc.wait_idle()
        [finished] = await signals_of(proc, "proc.run.finished")
        assert "quiet" not in finished and finished["text"].startswith("The inbox")


async def test_a_user_run_answering_the_token_is_not_quiet(tmp_path):
    async with await quiet_kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK")) as k:
        proc = await k.spawn(owner="a")
        await proc.send("say the token")
        await proc.wait_idle()
        [finished] = await signals_of(proc, "proc.run.finished")
        assert "quiet" not in finished


@pytest.mark.parametrize("content", [None, "# Heartbeat\n\n- \n", "\n"])
async def test_no_beat_without_instructions(tmp_path, content):
    if content is not None:
        (tmp_path / "HEARTBEAT.md").write_text(content)
    assert await check_ins(tmp_path) == 0


async def test_a_linked_heartbeat_file_outside_the_workspace_does_not_count(tmp_path):
    outside = tmp_path / "elsewhere.md"
    outside.write_text(ASKING)
    work = tmp_path / "work"
    work.mkdir()
    (work / "HEARTBEAT.md").symlink_to(outside)
    assert await check_ins(work) == 0


async def test_only_the_owners_latest_interactive_top_level_process_per_workspace_beats(tmp_path):
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    other = tmp_path / "other"
    other.mkdir()
    async with await quiet_kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK")) as k:
        await k.heartbeat.stop()
        old = await k.spawn(owner="a")
        main = await k.spawn(owner="a")
        child = await k.spawn(owner="a", parent_pid=main.pid)
        batch = await k.spawn(owner="a", interactive=False)
        elsewhere = await k.spawn(owner="a", cwd=other)  # no HEARTBEAT.md there
        bob = await k.spawn(owner="b")
        await main.send("hello")  # used last
        await main.wait_idle()
        k.heartbeat.clock = lambda: later(3)
        await k.heartbeat.beat_due()
        for proc in (main, bob):
            await proc.wait_idle()
            assert await beats(proc) == 1
        for proc in (old, child, batch, elsewhere):
            assert await beats(proc) == 0


async def test_no_beat_outside_the_active_hours(tmp_path):
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    async with await quiet_kernel(
        tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK"), hours=parse_hours("08:00-23:00")
    ) as k:
        await k.heartbeat.stop()
        proc = await k.spawn(owner="a")
        k.heartbeat.clock = lambda: later(3)
        k.heartbeat.local_time = lambda ts: datetime.time(3, 0)
        await k.heartbeat.beat_due()
        assert await beats(proc) == 0
        k.heartbeat.local_time = lambda ts: datetime.time(9, 0)
        await k.heartbeat.beat_due()  # the same period: it was passed over, not postponed
        assert await beats(proc) == 0
        k.heartbeat.clock = lambda: later(4)
        await k.heartbeat.beat_due()
        await proc.wait_idle()
        assert await beats(proc) == 1


async def test_a_busy_process_gets_its_beat_once_idle_and_never_inside_a_run(tmp_path):
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    gate = asyncio.Event()

    async def brain(request: Any) -> str:
        if request.messages[-1].text == "work":
            await gate.wait()
        return "HEARTBEAT_OK" if request.messages[-1].text == DEFAULT_TEXT else "done"

    async with await quiet_kernel(tmp_path, ScriptedModel(brain)) as k:
        await k.heartbeat.stop()
        proc = await k.spawn(owner="a")
        await proc.send("work")
        await asyncio.sleep(0.05)
        k.heartbeat.clock = lambda: later(3)
        await k.heartbeat.beat_due()
        assert await beats(proc) == 0 and await k.store.queue(proc.pid) == []  # not queued behind the run
        gate.set()
        await proc.wait_idle()
        await k.heartbeat.beat_due()  # a later pass of the same period
        await proc.wait_idle()
        assert await beats(proc) == 1


async def test_two_timers_deliver_a_periods_beat_once(tmp_path):
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    async with await quiet_kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK")) as k:
        await k.heartbeat.stop()
        proc = await k.spawn(owner="a")
        now = later(3)
        twins = [Heartbeat(k.store, k.engine, settings(), clock=lambda: now) for _ in range(2)]
        await asyncio.gather(*(t.beat_due() for t in twins))
        await proc.wait_idle()
        assert await beats(proc) == 1


async def test_the_timer_delivers_and_a_beat_survives_a_restart_as_delivered(tmp_path):
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    now = later(3)
    async with await quiet_kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK")) as k:
        proc = await k.spawn(owner="a")
        await k.heartbeat.stop()
        k.heartbeat.clock = lambda: now
        k.heartbeat.start()  # the timer's first pass is at once
        async with asyncio.timeout(5):
            while not await beats(proc):
                await asyncio.sleep(0.02)
        await proc.wait_idle()
    async with await quiet_kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK")) as k:
        await k.heartbeat.stop()
        k.heartbeat.clock = lambda: now
        await k.heartbeat.beat_due()  # a fresh timer, the same period: the store says it was given
        proc = await k.process(proc.pid)
        await proc.wait_idle()
        assert await beats(proc) == 1


async def test_heartbeat_none_runs_no_timer(tmp_path):
    async with kernel(tmp_path, ScriptedModel(lambda r: "ok"), heartbeat=None) as k:
        assert k.heartbeat is None


# ------------------------------------------------------------------ clients


def test_chat_leaves_a_quiet_beat_unshown_and_shows_one_with_news():
    out = io.StringIO()
    view = TextRenderer(out, Console(file=io.StringIO()))
    render = SignalRenderer(view)
    for run, text, quiet in (("heartbeat:1", "HEARTBEAT_OK", True), ("heartbeat:2", "Bob mailed: urgent.", False)):
        render.handle(Signal("proc.run.started", {"runId": run, "reason": "heartbeat"}, 1))
        render.handle(Signal("proc.run.stream", {"runId": run, "event": "start"}))
        render.handle(Signal("proc.run.stream", {"runId": run, "event": "text_delta", "delta": text}))
        output = {"runId": run, "text": text} | ({"quiet": True} if quiet else {})
        render.handle(Signal("proc.run.output", output, 2))
        render.handle(Signal("proc.run.finished", {"runId": run, "status": "ok"}, 3))
    shown = out.getvalue()
    assert "HEARTBEAT_OK" not in shown
    assert shown.count("Bob mailed: urgent.") == 1


# ------------------------------------------------------------------ the config file


@pytest.mark.parametrize(
    ("text", "every", "hours", "warned"),
    [
        ("", 1800, parse_hours("08:00-23:00"), None),
        ("heartbeat = true", 1800, parse_hours("08:00-23:00"), None),
        ('heartbeat = { every = 3600, hours = "all" }', 3600, None, None),
        ('[heartbeat]\nhours = "22:00-06:00"', 1800, parse_hours("22:00-06:00"), None),
        ("heartbeat = { every = 5 }", 1800, parse_hours("08:00-23:00"), "at least 60"),
        ('heartbeat = { hours = "noon" }', 1800, parse_hours("08:00-23:00"), "must look like 08:00-23:00"),
        ("heartbeat = { often = 1 }", 1800, parse_hours("08:00-23:00"), "unknown keys: often"),
        ('heartbeat = "sometimes"', 1800, parse_hours("08:00-23:00"), "must be true, false or a table"),
    ],
)
def test_the_config_file_sets_the_heartbeat(tmp_path, text, every, hours, warned):
    from agentloop.cli.config import kernel_options, load_settings, read_config_file

    path = tmp_path / "config.toml"
    path.write_text(text)
    file, warnings = read_config_file(path)
    assert file.heartbeat is not None
    assert (file.heartbeat.every, file.heartbeat.hours) == (every, hours)
    if warned is None:
        assert warnings == []
    else:
        [warning] = warnings
        assert warned in warning and "default" in warning
    settings = load_settings(env={"AGENTLOOP_CONFIG": str(path)})
    assert kernel_options(settings)["heartbeat"] == file.heartbeat


@pytest.mark.parametrize("text", ["heartbeat = false", 'heartbeat = "off"', 'heartbeat = " No "'])
def test_the_config_file_turns_the_heartbeat_off(tmp_path, text):
    """``false``, or the words people write for it: a heartbeat costs model calls, so a config that
    says off in words must not leave it on."""
    from agentloop.cli.config import kernel_options, load_settings, read_config_file

    path = tmp_path / "config.toml"
    path.write_text(text + "\n")
    assert read_config_file(path)[1] == []
    assert kernel_options(load_settings(env={"AGENTLOOP_CONFIG": str(path)}))["heartbeat"] is None


# ------------------------------------------------------------------ the conversation stays lean


async def test_a_quiet_check_in_leaves_the_conversation_and_stays_in_the_log(tmp_path):
    (tmp_path / "HEARTBEAT.md").write_text(ASKING)
    async with await quiet_kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK")) as k:
        await k.heartbeat.stop()
        proc = await k.spawn(owner="a", text="hello")
        await proc.wait_idle()
        before = await proc.messages()
        k.heartbeat.clock = lambda: later(3)
        await k.heartbeat.beat_due()
        await proc.wait_idle()
        assert await proc.messages() == before  # the store's history, and the cache's:
        assert k.engine.cached(proc.pid).history == before
        [_, finished] = await signals_of(proc, "proc.run.finished")
        assert finished["quiet"] is True and finished["runId"].startswith("heartbeat:")
    async with await quiet_kernel(tmp_path, ScriptedModel(lambda r: "HEARTBEAT_OK")) as k:
        assert await (await k.process(proc.pid)).messages() == before  # after a restart too


async def test_a_check_in_with_news_or_with_tool_calls_stays_in_the_conversation(tmp_path):
    from agentloop import Reply, ToolResultMessage, call

    (tmp_path / "HEARTBEAT.md").write_text(ASKING)

    def brain(request: Any) -> Any:
        if isinstance(request.messages[-1], ToolResultMessage):
            return "HEARTBEAT_OK"
        return Reply(tool_calls=[call("echo", text="inbox")])

    async with await quiet_kernel(tmp_path, ScriptedModel(brain)) as k:
        await k.heartbeat.stop()
        proc = await k.spawn(owner="a")
        k.heartbeat.clock = lambda: later(3)
        await k.heartbeat.beat_due()
        await proc.wait_idle()
        kept = await proc.messages()
        assert len(kept) == 4 and kept[0].text == DEFAULT_TEXT  # it did something: the record stays
