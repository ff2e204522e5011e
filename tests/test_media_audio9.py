"""Audio and video sent to a process through the library and the server (``process/audio_video.py``):
audio becomes its transcript, marked as one, in the input's one delivery; video a note of what was
attached. Before this, only the chat bridges transcribed: ``Process.send`` refused audio as a
TypeError and the server's ``media`` refused ``audio/*`` and ``video/*`` with a 400."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from typer.testing import CliRunner

from agentloop import ScriptedModel
from agentloop.kernel import Kernel
from agentloop.messages import UserMessage
from agentloop.models.transcribe import OpenAITranscriber
from agentloop.process.audio_video import (
    AudioContent,
    NoTranscriber,
    TranscriptionFailed,
    VideoContent,
)
from agentloop.server.ratelimit import InputRate
from tests.fakes.http_server import ServerThread
from tests.ws_support import KernelServer, eventually

OGG = b"OggS\x00\x02" + bytes(range(200))  # (never decoded: the transcriber gets the bytes as they are)
MP4 = b"\x00\x00\x00\x18ftypmp42" + bytes(3072 - 12)  # 3 KiB


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass
class FakeTranscriber:
    """Answers ``said`` (or raises ``error``), keeping what it was asked; ``closed`` once closed."""

    said: str = "hello from the memo"
    error: Exception | None = None
    asked: list[tuple[bytes, str, str]] = field(default_factory=list)
    closed: bool = False

    async def transcribe(self, audio: bytes, filename: str, mime: str) -> str:
        self.asked.append((audio, filename, mime))
        if self.error is not None:
            raise self.error
        return self.said

    async def close(self) -> None:
        self.closed = True


def user_texts(model: ScriptedModel) -> list[str]:
    """The user messages' text of every request the model was given."""
    return [m.text for r in model.requests for m in r.messages if isinstance(m, UserMessage)]


# ------------------------------------------------------------------------------------- the library


async def test_audio_sent_to_a_process_reaches_the_model_as_its_marked_transcript(tmp_path: Path) -> None:
    model = ScriptedModel(lambda req: "ok")
    fake = FakeTranscriber()
    async with Kernel.open(f"sqlite:///{tmp_path}/k.db", model=model, workspace=tmp_path, transcriber=fake) as kernel:
        proc = await kernel.spawn("alice")
        receipt = await proc.send("what do you make of this?", media=[AudioContent(b64(OGG), "audio/ogg", "memo.ogg")])
        await proc.wait_idle()
        assert receipt.run_id
        assert fake.asked == [(OGG, "memo.ogg", "audio/ogg")]  # (asked before the receipt: one delivery)
        said = 'what do you make of this?\n\n[Transcribed audio file "memo.ogg"]: hello from the memo'
        assert user_texts(model) == [said]
        history = [m.message for m in await proc.history()]
        assert isinstance(history[0], UserMessage) and history[0].text == said
        assert len(history[0].content) == 1  # the sound is not kept: its words are
        # audio alone (no text), unnamed and of a generic type: named by its type for the server
        await proc.send("", media=[AudioContent(b64(OGG), "audio/mpeg")])
        await proc.wait_idle()
        assert fake.asked[-1] == (OGG, "audio.mp3", "audio/mpeg")
        assert user_texts(model)[-1] == "[Transcribed audio attachment]: hello from the memo"


async def test_audio_without_a_transcriber_or_whose_transcription_fails_delivers_nothing(tmp_path: Path) -> None:
    model = ScriptedModel(lambda req: "ok")
    async with Kernel.open(f"sqlite:///{tmp_path}/k.db", model=model, workspace=tmp_path) as kernel:
        proc = await kernel.spawn("alice")
        with pytest.raises(NoTranscriber, match="audio needs a transcription model"):
            await proc.send("listen", media=[AudioContent(b64(OGG), "audio/ogg")])
        kernel.transcriber = FakeTranscriber(error=RuntimeError("the server is down"))
        with pytest.raises(TranscriptionFailed, match=r"could not transcribe .*the server is down"):
            await proc.send("listen", media=[AudioContent(b64(OGG), "audio/ogg", "memo.ogg")])
        assert await proc.history() == [] and model.calls == 0


async def test_a_video_is_delivered_as_a_note_of_what_was_attached(tmp_path: Path) -> None:
    model = ScriptedModel(lambda req: "ok")
    async with Kernel.open(f"sqlite:///{tmp_path}/k.db", model=model, workspace=tmp_path) as kernel:
        proc = await kernel.spawn("alice", text="watch this", media=[VideoContent(b64(MP4), "video/mp4", "clip.mp4")])
        await proc.wait_idle()
        note = '[Attached video "clip.mp4" (video/mp4, 3.0 KiB): it cannot be viewed here; this note stands in for it]'
        assert user_texts(model) == [f"watch this\n\n{note}"]


# ------------------------------------------------------------------- a real transcription request


class Whisper:
    """A local ``POST /v1/audio/transcriptions`` (OpenAI's multipart form, answered ``{"text"}``)."""

    def __init__(self) -> None:
        self.forms: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.server = ServerThread(Starlette(routes=[Route("/v1/audio/transcriptions", self.handle, methods=["POST"])]))

    async def handle(self, request: Request) -> Response:
        form = await request.form()
        upload = form["file"]
        assert isinstance(upload, UploadFile)
        seen = {
            "model": form["model"],
            "name": upload.filename,
            "type": upload.content_type,
            "data": await upload.read(),
        }
        with self.lock:
            self.forms.append(seen)
        return JSONResponse({"text": "  words   from\x07 whisper "})


async def test_audio_is_transcribed_over_openais_wire_format(tmp_path: Path) -> None:
    whisper = Whisper()
    model = ScriptedModel(lambda req: "ok")
    with whisper.server:
        transcriber = OpenAITranscriber("whisper-1", base_url=whisper.server.url + "/v1", max_retries=0, timeout=5)
        try:
            url = f"sqlite:///{tmp_path}/k.db"
            async with Kernel.open(url, model=model, workspace=tmp_path, transcriber=transcriber) as kernel:
                proc = await kernel.spawn("alice")
                await proc.send("", media=[AudioContent(b64(OGG), "audio/ogg", "memo.ogg")])
                await proc.wait_idle()
        finally:
            await transcriber.close()
    assert whisper.forms == [{"model": "whisper-1", "name": "memo.ogg", "type": "audio/ogg", "data": OGG}]
    assert user_texts(model) == ['[Transcribed audio file "memo.ogg"]: words from whisper']


# --------------------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelServer]:
    model = ScriptedModel(lambda req: "ok", keep_requests=False)
    with KernelServer(tmp_path_factory.mktemp("audio9"), model, transcriber=FakeTranscriber()) as s:
        yield s


def http(server: KernelServer, account: str = "alice") -> httpx.Client:
    base = server.url.replace("ws://", "http://").removesuffix("/v1/ws")
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {server.tokens[account]}"}, timeout=5)


def texts(client: httpx.Client, pid: str) -> list[str]:
    answer = client.get(f"/v1/processes/{pid}/messages").json()
    return [m["message"]["content"][0]["text"] for m in answer["messages"] if m["message"]["role"] == "user"]


def transcriber_of(server: KernelServer) -> FakeTranscriber:
    assert server.ctx is not None
    fake = server.ctx.kernel.transcriber
    assert isinstance(fake, FakeTranscriber)
    return fake


AUDIO = {"data": b64(OGG), "mime_type": "audio/ogg", "name": "memo.ogg"}
MARKED = '[Transcribed audio file "memo.ogg"]: hello from the memo'


def test_audio_posted_over_rest_and_sent_over_the_websocket_is_transcribed(server: KernelServer) -> None:
    with http(server) as client, server.client("alice") as ws:
        pid = client.post("/v1/processes", json={}).json()["pid"]
        answer = client.post(f"/v1/processes/{pid}/messages", json={"text": "hear this", "media": [AUDIO]})
        assert answer.status_code == 202, answer.text
        eventually(lambda: texts(client, pid) == [f"hear this\n\n{MARKED}"])
        receipt = ws.ok("proc.send", {"pid": pid, "text": "", "media": [AUDIO], "mode": "queue"})
        assert receipt["run_id"]
        eventually(lambda: texts(client, pid)[1:] == [MARKED])
        spawned = client.post("/v1/processes", json={"text": "first", "media": [AUDIO]})
        assert spawned.status_code == 201, spawned.text
        eventually(lambda: texts(client, spawned.json()["pid"]) == [f"first\n\n{MARKED}"])


def test_a_video_posted_is_delivered_as_a_note(server: KernelServer) -> None:
    with http(server) as client:
        pid = client.post("/v1/processes", json={}).json()["pid"]
        video = {"data": b64(MP4), "mime_type": "video/mp4", "name": "clip.mp4"}
        answer = client.post(f"/v1/processes/{pid}/messages", json={"text": "see", "media": [video]})
        assert answer.status_code == 202, answer.text
        note = '[Attached video "clip.mp4" (video/mp4, 3.0 KiB): it cannot be viewed here; this note stands in for it]'
        eventually(lambda: texts(client, pid) == [f"see\n\n{note}"])


def test_audio_refused_or_not_transcribed_is_a_clear_error_and_costs_no_input(server: KernelServer) -> None:
    """No transcriber: 400 naming the flag; a failing one: 502. Either way nothing is delivered
    and the account's input rate is given back (a rate of 1: the good message after them passes)."""
    assert server.ctx is not None
    ctx, fake = server.ctx, transcriber_of(server)
    saved = ctx.inputs, ctx.max_inputs_per_minute
    ctx.inputs, ctx.max_inputs_per_minute = InputRate(), 1
    try:
        with http(server, "bob") as client, server.client("bob") as ws:
            pid = client.post("/v1/processes", json={}).json()["pid"]
            ctx.kernel.transcriber = None
            answer = client.post(f"/v1/processes/{pid}/messages", json={"text": "hi", "media": [AUDIO]})
            assert answer.status_code == 400
            assert "audio needs a transcription model: start the server with --transcribe-model" in answer.text
            assert ws.error("proc.send", {"pid": pid, "text": "hi", "media": [AUDIO]}) == "invalid_request"
            ctx.kernel.transcriber = FakeTranscriber(error=TimeoutError("the transcription took longer than 5 s"))
            for _ in range(2):
                answer = client.post(f"/v1/processes/{pid}/messages", json={"text": "hi", "media": [AUDIO]})
                assert answer.status_code == 502
                assert answer.json() == {
                    "code": "transcription_failed",
                    "message": 'media: could not transcribe "memo.ogg": the transcription took longer than 5 s; '
                    "nothing was delivered",
                }
            assert ws.error("proc.send", {"pid": pid, "text": "hi", "media": [AUDIO]}) == "transcription_failed"
            assert texts(client, pid) == []
            ctx.kernel.transcriber = fake
            assert (
                client.post(f"/v1/processes/{pid}/messages", json={"text": "ok", "media": [AUDIO]}).status_code == 202
            )
            eventually(lambda: texts(client, pid) == [f"ok\n\n{MARKED}"])
    finally:
        ctx.inputs, ctx.max_inputs_per_minute = saved
        ctx.kernel.transcriber = fake


def test_audio_past_the_media_limit_is_refused_with_413(server: KernelServer) -> None:
    assert server.ctx is not None
    with http(server) as client:
        pid = client.post("/v1/processes", json={}).json()["pid"]
        big = {"data": b64(bytes(server.ctx.kernel.media.max_bytes + 1)), "mime_type": "audio/wav"}
        answer = client.post(f"/v1/processes/{pid}/messages", json={"text": "hi", "media": [big]})
        assert answer.status_code == 413, answer.text
        assert texts(client, pid) == []


# ----------------------------------------------------------------------------------- agentloop serve


async def test_serve_gives_its_transcriber_to_the_kernel_and_closes_it(tmp_path: Path) -> None:
    from agentloop.cli.approvals import parse_approval
    from agentloop.cli.config import Settings
    from agentloop.cli.serve import Running, ServeOptions, serve_async

    (tmp_path / "data").mkdir()
    fake = FakeTranscriber()
    settings = Settings(model="scripted:" + str(tmp_path / "none.json"), model_source="test")
    (tmp_path / "none.json").write_text('["unused"]')
    opts = ServeOptions(
        "127.0.0.1", 0, tmp_path / "data", tmp_path, settings, parse_approval("auto"), out=io.StringIO()
    )
    opts.transcriber = fake  # type: ignore[assignment]
    seen: list[Any] = []

    def ready(running: Running) -> None:
        seen.append(running.ctx.kernel.transcriber)
        running.stop()

    await asyncio.wait_for(serve_async(opts, signals=False, on_ready=ready), 30)
    assert seen == [fake] and fake.closed


def test_serve_takes_the_channels_transcription_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import agentloop.cli.serve as serve_module

    got: list[Any] = []

    async def capture(opts: Any, **kw: Any) -> None:
        got.append(opts.transcriber)

    monkeypatch.setattr(serve_module, "serve_async", capture)
    from agentloop.cli.main import app

    flags = ["--transcribe-model", "openai:whisper-1", "--transcribe-url", "http://127.0.0.1:9/v1"]
    result = CliRunner().invoke(app, ["serve", "--data", str(tmp_path / "d"), *flags])
    assert result.exit_code == 0, result.output
    assert isinstance(got[0], OpenAITranscriber) and got[0].model_id == "whisper-1"
