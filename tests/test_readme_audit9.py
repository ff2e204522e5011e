"""The README and docs/server-api.md lines changed on the day of the ToolRetry, audio/video and
account-log work, checked against what the code does: the new CLI flags and config keys
(``--max-concurrency``, ``--tool-execution``, the reasoning levels ``minimal`` and ``xhigh``), the
loop's new options (steering and follow-up modes, ``post_turn``'s ``Stop``, ``pieces=``,
``preflight_timeout``, ``ToolRetry``'s budgets), audio and video sent to a process (the marked
transcript, the video note, the errors), the reserved ``:reply`` run ids, the prompt variables,
OpenAI's effort and the thinking budgets per level, key providers, and over HTTP the transcription
errors, the account stream's ids and the gateway's actor headers."""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

import agentloop
from agentloop import Agent, Reply, ScriptedModel, ToolResult, ToolRetry, call, tool
from agentloop.cli.config import load_settings, loop_options
from agentloop.cli.main import app
from agentloop.kernel import Kernel
from agentloop.loop.hooks import Stop, TurnInfo
from agentloop.loop.reveal import ToolReveal
from agentloop.loop.stop_after import StopAfterTools
from agentloop.loop.tool_retry import DEFAULT_CLASS_BUDGETS, DEFAULT_PER_SIGNATURE, DEFAULT_PER_TOOL, DEFAULT_ROUNDS
from agentloop.messages import UserMessage, user
from agentloop.models.base import THINKING_BUDGETS, ModelRequest, ProviderError, thinking_budget
from agentloop.models.catalog import model_info
from agentloop.models.gemini import MIN_PRO_THINKING, _max_thinking
from agentloop.models.openai_chat import OpenAIChatModel, _effort
from agentloop.process.api import approve_everything
from agentloop.process.audio_video import (
    AudioContent,
    NoTranscriber,
    NoWords,
    TranscriptionFailed,
    VideoContent,
)
from agentloop.process.media import MediaTooLarge
from tests.ws_support import KernelServer, eventually

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
API = (ROOT / "docs" / "server-api.md").read_text(encoding="utf-8")
OGG = b"OggS\x00\x02" + bytes(100)
runner = CliRunner()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def flat(text: str) -> str:
    return " ".join(text.split())


def user_texts(model: ScriptedModel) -> list[str]:
    return list(dict.fromkeys(m.text for r in model.requests for m in r.messages if isinstance(m, UserMessage)))


@dataclass
class FakeTranscriber:
    """Answers ``said``; audio holding ``FAIL`` fails, as a server answering 500 does."""

    said: str = "hello from the memo"
    asked: list[str] = field(default_factory=list)

    async def transcribe(self, audio: bytes, filename: str, mime: str) -> str:
        self.asked.append(filename)
        if b"FAIL" in audio:
            raise RuntimeError("the transcription server answered HTTP 500")
        return self.said


# ------------------------------------------------------------------------------ flags and config keys


def help_of(*command: str) -> str:
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_run_chat_and_serve_take_the_tool_call_flags_and_the_bridges_do_not() -> None:
    """README: "`run`, `chat` and `serve` also `--max-concurrency` and `--tool-execution`"; every
    command with the run limits lists the levels ``minimal`` and ``xhigh``; serve takes the
    bridges' ``--transcribe-*`` flags."""
    assert "`run`, `chat` and `serve` also `--max-concurrency` and\n`--tool-execution`" in README
    for command in ("run", "chat", "serve"):
        text = help_of(command)
        assert "--max-concurrency" in text and "--tool-execution" in text and "default 16" in text
        assert "off, minimal, low, medium, high or xhigh" in flat(text)
    for command in ("telegram", "whatsapp", "discord"):
        assert "--max-concurrency" not in help_of(command)
    serve = help_of("serve")
    assert all(f"--transcribe-{flag}" in serve for flag in ("model", "url", "key-env"))


def test_the_config_keys_reach_the_loop_and_a_bad_one_stops_the_command(tmp_path: Path) -> None:
    """``max_concurrency = 4`` and ``tool_execution = "sequential"`` (the README's config lines)
    become the Agent's options; a bad value is an error naming the key, and a bad flag exits 2
    naming the flag."""
    assert "max_concurrency = 4 " in README and 'tool_execution = "sequential"' in README
    cfg = tmp_path / "config.toml"
    env = {"AGENTLOOP_CONFIG": str(cfg)}
    cfg.write_text('max_concurrency = 4\ntool_execution = "sequential"\nreasoning = "xhigh"\n')
    settings = load_settings(env=env)
    options = loop_options(settings)
    assert not settings.errors
    assert (options["max_concurrency"], options["tool_execution"], options["reasoning"]) == (4, "sequential", "xhigh")
    cfg.write_text('max_concurrency = "4"\n')
    assert "max_concurrency must be a positive integer" in " ".join(load_settings(env=env).errors)
    cfg.write_text('tool_execution = "serial"\n')
    assert "tool_execution must be one of parallel, sequential" in " ".join(load_settings(env=env).errors)
    cfg.write_text("")
    assert "max_concurrency" not in loop_options(load_settings(env=env))  # (the loop's own default stays)
    result = runner.invoke(app, ["run", "--max-concurrency", "0", "hi"], env=env)
    assert result.exit_code == 2 and "--max-concurrency must be a positive integer" in result.output
    result = runner.invoke(app, ["run", "--tool-execution", "serial", "hi"], env=env)
    assert result.exit_code == 2 and "--tool-execution must be one of parallel, sequential" in result.output


# ------------------------------------------------------------------------------------ loop options


def test_agent_defaults_and_the_queue_modes() -> None:
    """README: "16 by default" and "parallel" are Agent's; ``steering_mode="all"`` takes everything
    queued into the next call, the default one per call."""
    agent = Agent(model=ScriptedModel([]))
    assert (agent.config.max_concurrency, agent.config.tool_execution) == (16, "parallel")

    async def steered(mode: str) -> list[list[str]]:
        model = ScriptedModel(["a", "b", "c"])
        run = Agent(model=model, steering_mode=mode).start("hi")  # type: ignore[arg-type]
        run.steer("first")
        run.steer("second")
        await run.result()
        return [[m.text for m in r.messages if isinstance(m, UserMessage)] for r in model.requests]

    assert asyncio.run(steered("all")) == [["hi", "first", "second"]]
    assert asyncio.run(steered("one-at-a-time")) == [["hi", "first"], ["hi", "first", "second"]]


@tool
def step() -> str:
    """Do one step of the work."""
    return "step done"


@tool
def submit(answer: str) -> str:
    """Hand in the answer."""
    return "handed in"


async def test_a_post_turn_stop_ends_the_run_gently() -> None:
    """``post_turn`` returning ``Stop()`` (from ``agentloop.loop.hooks``, also exported from
    ``agentloop``) ends the run as ``run.stop()`` does: stop reason ``stopped``, a last answer
    without tools."""
    assert agentloop.Stop is Stop
    model = ScriptedModel([Reply(tool_calls=[call("step")]), "Stopped after a step.", "never"])
    agent = Agent(model=model, tools=[step])

    @agent.hooks.on("post_turn")
    def once(info: TurnInfo) -> Stop | None:
        return Stop() if info.turn == 0 else None

    result = await asyncio.wait_for(agent.run("work"), 5)
    assert result.stop_reason == "stopped" and result.text == "Stopped after a step."
    assert not model.requests[-1].tools and len(model.requests) == 2


def test_preflight_timeout_defaults_to_15_and_is_at_most_60() -> None:
    assert "given up after `preflight_timeout`\nseconds, 15 by default, at most 60" in README
    assert ToolReveal(hidden=[step]).preflight_timeout == 15
    assert ToolReveal(hidden=[step], preflight_timeout=60).preflight_timeout == 60
    for bad in (0, 60.5):
        with pytest.raises(ValueError, match="at most 60"):
            ToolReveal(hidden=[step], preflight_timeout=bad)


async def test_pieces_go_to_an_agent_and_to_a_kernel(tmp_path: Path) -> None:
    """``Agent(..., pieces=[...])`` and ``Kernel.open(..., pieces=[StopAfterTools("submit")])``."""
    model = ScriptedModel([Reply(tool_calls=[call("submit", answer="42")]), "never"])
    result = await Agent(model=model, tools=[submit], pieces=[StopAfterTools("submit")]).run("go")
    assert len(model.requests) == 1 and result.stop_reason == "stop"
    model = ScriptedModel([Reply(tool_calls=[call("submit", answer="42")]), "never"])
    async with Kernel.open(
        f"sqlite:///{tmp_path}/k.db",
        model=model,
        workspace=tmp_path,
        tools=[submit],
        approval=approve_everything,
        pieces=[StopAfterTools("submit")],
    ) as kernel:
        proc = await kernel.spawn("alice", text="go")
        await asyncio.wait_for(proc.wait_idle(), 5)
    assert len(model.requests) == 1


@tool
def look(path: str) -> ToolResult:
    """Look a path up."""
    return ToolResult.text(f"no such file: {path}", is_error=True, details={"error_class": "not_found"})


async def test_tool_retry_budgets_are_the_readmes_and_a_spent_one_stops_the_run() -> None:
    """README: "3 invalid-argument failures, 2 not-found, none for `needs_narrowing` or `internal` …; 16
    per tool; 3 for the same call failing the same way; 32 rounds": the third not-found failure
    is past its budget, and the run ends with one last answer without tools."""
    assert "3 invalid-argument failures, 2 not-found, none\nfor `needs_narrowing` or `internal`" in README
    assert DEFAULT_CLASS_BUDGETS["invalid_arguments"] == 3 and DEFAULT_CLASS_BUDGETS["not_found"] == 2
    assert DEFAULT_CLASS_BUDGETS["needs_narrowing"] == DEFAULT_CLASS_BUDGETS["internal"] == 0
    assert (DEFAULT_PER_TOOL, DEFAULT_PER_SIGNATURE, DEFAULT_ROUNDS) == (16, 3, 32)
    for name in re.findall(r"`(\w+)`", README.split("each\nfailed tool result gets a class (")[1].split(")")[0]):
        assert name in DEFAULT_CLASS_BUDGETS
    replies = [Reply(tool_calls=[call("look", path=p)]) for p in "abc"]
    model = ScriptedModel([*replies, "I could not find it.", "never"])
    agent = Agent(model=model, tools=[look])
    agent.use(ToolRetry())
    result = await asyncio.wait_for(agent.run("find it"), 5)
    assert result.stop_reason == "stopped" and result.text == "I could not find it."
    assert len(model.requests) == 4 and not model.requests[-1].tools
    first = next(r for r in result.messages if getattr(r, "tool_name", None) == "look")
    assert "class=not_found; retries left:" in first.text and "not_found 1/2, look 15/16, same call 2/3" in first.text


# ---------------------------------------------------------------------------------- audio and video


async def test_audio_and_video_sent_to_a_process(tmp_path: Path) -> None:
    """The README's paragraph on ``AudioContent`` and ``VideoContent``, in order: the marked
    transcript (named and unnamed), a retry with its ``run_id`` not transcribed again, the video
    note, the errors, and the 10 MiB limit."""
    model = ScriptedModel(lambda req: "ok")
    fake = FakeTranscriber()
    async with Kernel.open(f"sqlite:///{tmp_path}/k.db", model=model, workspace=tmp_path, transcriber=fake) as kernel:
        proc = await kernel.spawn("alice")
        memo = AudioContent(data=b64(OGG), mime_type="audio/ogg", name="memo.ogg")
        first = await proc.send("listen", media=[memo], run_id="r1")
        again = await proc.send("listen", media=[memo], run_id="r1")
        assert first.run_id == again.run_id and fake.asked == ["memo.ogg"]
        await proc.send("", media=[AudioContent(data=b64(OGG), mime_type="audio/ogg")], mode="queue")
        clip = VideoContent(data=b64(bytes(int(2.5 * 1024 * 1024))), mime_type="video/mp4", name="clip.mp4")
        await proc.send("watch", media=[clip], mode="queue")
        with pytest.raises(TranscriptionFailed):
            await proc.send("x", media=[AudioContent(data=b64(b"FAIL"), mime_type="audio/ogg")])
        fake.said = "   "
        with pytest.raises(NoWords):
            await proc.send("x", media=[memo])
        with pytest.raises(MediaTooLarge):
            await proc.send("x", media=[VideoContent(data=b64(bytes(10 * 1024 * 1024 + 1)), mime_type="video/mp4")])
        await asyncio.wait_for(proc.wait_idle(), 5)
        note = '[Attached video "clip.mp4" (video/mp4, 2.5 MiB): it cannot be viewed here; this note stands in for\nit]'
        assert note in README
        assert user_texts(model) == [
            'listen\n\n[Transcribed audio file "memo.ogg"]: hello from the memo',
            "[Transcribed audio attachment]: hello from the memo",
            "watch\n\n" + note.replace("\n", " "),
        ]
    async with Kernel.open(f"sqlite:///{tmp_path}/k2.db", model=model, workspace=tmp_path) as kernel:
        proc = await kernel.spawn("alice")
        with pytest.raises(NoTranscriber):
            await proc.send("x", media=[memo])


async def test_an_events_run_id_may_not_end_with_reply(tmp_path: Path) -> None:
    """``signal``'s ``run_id`` makes it idempotent; one ending ``:reply`` is refused."""
    async with Kernel.open(f"sqlite:///{tmp_path}/k.db", model=ScriptedModel(lambda r: "ok"), workspace=tmp_path) as k:
        proc = await k.spawn("alice")
        with pytest.raises(ValueError, match="must not end with ':reply'"):
            await k.signal(proc.pid, "an event", run_id="job:reply")
        first = await k.signal(proc.pid, "an event", run_id="job:reply:1")
        again = await k.signal(proc.pid, "an event", run_id="job:reply:1")
        assert first.run_id == again.run_id == "job:reply:1"
        await asyncio.wait_for(proc.wait_idle(), 5)
        runs = [s async for s in proc.signals(follow=False) if s.signal == "proc.run.finished"]
        assert len(runs) == 1


# --------------------------------------------------------------------------------- prompt variables


async def test_the_new_prompt_variables(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "config/ai/context.d").mkdir(parents=True)
    line = "vars: {{identity}} {{owner}} {{home}} {{time}} {{timezone}} {{pid}} {{model}}\n"
    (data / "config/ai/context.d/00.md").write_text(line)
    model = ScriptedModel(lambda req: "ok")
    async with Kernel.open(f"sqlite:///{tmp_path}/k.db", model=model, workspace=tmp_path, data_dir=data) as k:
        proc = await k.spawn("alice", text="hi")
        await asyncio.wait_for(proc.wait_idle(), 5)
    said = next(x for x in model.requests[-1].system_prompt.splitlines() if x.startswith("vars: "))
    home = data / "home" / "alice"
    pattern = rf"vars: alice alice {re.escape(str(home))} \d\d:\d\d \S+ \(UTC[+-]\d\d:\d\d\) {proc.pid} scripted:\S+"
    assert re.fullmatch(pattern, said), said


# ---------------------------------------------------------------------------------- reasoning levels


def test_openais_effort_per_family_as_the_readme_says() -> None:
    expected = {
        ("gpt-5.1", "off"): "none",
        ("gpt-5.2", "off"): "none",
        ("gpt-5", "off"): "minimal",
        ("o4-mini", "off"): "low",
        ("gpt-5.1-codex", "off"): "low",
        ("gpt-5.1-codex-max", "off"): "low",
        ("gpt-5.1", "minimal"): "low",
        ("o3", "minimal"): "low",
        ("gpt-5.1-codex-max", "xhigh"): "xhigh",
        ("gpt-5.2", "xhigh"): "xhigh",
        ("gpt-5.1", "xhigh"): "high",
        ("gpt-5", "xhigh"): "high",
        ("gpt-5-pro", "low"): "high",
    }
    assert {key: _effort(key[1], key[0]) for key in expected} == expected
    assert "`low` on the o-series and the codex models" in flat(README)


def test_thinking_budgets_per_level() -> None:
    """README: "`minimal` 1k, `low` 2k, `medium` 8k, `high` 24k, `xhigh` 32k tokens, each at most half
    the model's output limit …, so Flash's `xhigh` is 24k; a Gemini Pro model keeps its least, 128"."""
    assert THINKING_BUDGETS == {"minimal": 1024, "low": 2048, "medium": 8192, "high": 24576, "xhigh": 32768}
    flash = model_info("gemini", "gemini-2.5-flash")
    assert flash.max_output >= 2 * 24576
    assert thinking_budget("xhigh", flash, maximum=_max_thinking("gemini-2.5-flash")) == 24576
    assert MIN_PRO_THINKING == 128 and thinking_budget("off", flash) == 0


# ------------------------------------------------------------------------------------- key providers


async def test_a_key_provider_that_raises_is_an_auth_error_unless_it_says_otherwise() -> None:
    """A function that raises ends the call with an ``auth`` error; a ``ProviderError`` of another
    kind keeps it (the provider is asked before any connection: the port is closed)."""

    def vault_down() -> str:
        raise RuntimeError("vault down")

    def vault_blip() -> str:
        raise ProviderError("vault blip", kind="connection")

    async def kinds(api_key: object) -> list[str]:
        model = OpenAIChatModel("gpt-4o", api_key=api_key, base_url="http://127.0.0.1:9/v1")
        request = ModelRequest(system_prompt="", messages=[user("hi")], tools=[])
        return [ev.kind async for ev in model.stream(request) if ev.type == "error"]

    assert await kinds(vault_down) == ["auth"]
    assert await kinds(vault_blip) == ["connection"]


# ---------------------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelServer]:
    model = ScriptedModel(lambda req: "ok", keep_requests=False)
    with KernelServer(tmp_path_factory.mktemp("audit9"), model, transcriber=FakeTranscriber()) as s:
        yield s


def http(server: KernelServer) -> httpx.Client:
    base = server.url.replace("ws://", "http://").removesuffix("/v1/ws")
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {server.tokens['alice']}"}, timeout=5)


def test_the_servers_transcription_errors_and_reserved_ids(server: KernelServer) -> None:
    """502 ``transcription_failed`` and nothing delivered; an event id ending ``:reply`` is 400."""
    assert "| 502 | `transcription_failed` |" in API
    with http(server) as client:
        pid = client.post("/v1/processes", json={}).json()["pid"]
        failing = {"data": b64(b"FAIL"), "mime_type": "audio/ogg", "name": "memo.ogg"}
        answer = client.post(f"/v1/processes/{pid}/messages", json={"text": "hi", "media": [failing]})
        assert answer.status_code == 502 and answer.json()["code"] == "transcription_failed"
        assert client.get(f"/v1/processes/{pid}/messages").json()["messages"] == []
        answer = client.post(f"/v1/processes/{pid}/events", json={"text": "evt", "run_id": "x:reply"})
        assert answer.status_code == 400 and answer.json()["code"] == "invalid_request"


def test_the_account_stream_opens_with_its_newest_id_and_resumes(server: KernelServer) -> None:
    """docs: "A stream opened without either starts with a frame that is only `id: <the newest account
    seq>`"; ``after_seq`` sends the logged signals after it, each with its account seq as id;
    ``follow=false`` ends after the backlog."""
    with http(server) as client:
        pid = client.post("/v1/processes", json={"text": "hi"}).json()["pid"]

        def finished() -> str:
            return client.get("/v1/events", params={"follow": "false", "after_seq": 0}).text.replace("\r\n", "\n")

        eventually(lambda: pid in finished())
        backlog = finished()
        ids = [int(n) for n in re.findall(r"^id: (\d+)$", backlog, flags=re.M)]
        assert ids and ids == sorted(ids) and "event: proc.run.finished" in backlog
        opened = client.get("/v1/events", params={"follow": "false"}).text
        assert opened.split() == ["id:", str(ids[-1])]
        resumed = client.get("/v1/events", params={"follow": "false"}, headers={"Last-Event-ID": str(ids[-1])})
        assert "event:" not in resumed.text


def test_the_actor_headers_are_checked_after_the_token(server: KernelServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "metadata": {"correlation_id": "c1"}}
    with http(server) as client:
        half = client.post("/engine/chat", json=body, headers={"X-Actor-ID": "u_1"})
        assert half.status_code == 400 and half.json()["message"].startswith("X-Actor-Permissions:")
        spaced = client.post("/engine/chat", json=body, headers={"X-Actor-ID": "u 1", "X-Actor-Permissions": "a"})
        assert spaced.status_code == 400 and "u 1" not in spaced.text
        headers = {"Authorization": "Bearer nope", "X-Actor-ID": "u 1"}
        assert client.post("/engine/chat", json=body, headers=headers).status_code == 401
        good = client.post("/engine/chat", json=body, headers={"X-Actor-ID": "u_1", "X-Actor-Permissions": "a,b:*"})
        assert good.status_code == 200 and "event: done" in good.text
