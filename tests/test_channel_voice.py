"""Voice messages sent to the chat bridges, transcribed (``agentloop.models.transcribe``,
``ChatBridge._deliver_files``), against the fakes of ``test_channel_media`` (Telegram with files,
Graph with media, Discord with its CDN) and a fake transcription server: a real local HTTP server
speaking OpenAI's ``POST /v1/audio/transcriptions`` (multipart, answered ``{"text": ...}``), which
records what it was sent and answers what the test queues (a text, an HTTP error, garbage).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from typer.testing import CliRunner

from agentloop.channels.media import UNSUPPORTED, Attachment, audio_filename, audio_type, transcript_text
from agentloop.cli.main import app
from agentloop.messages import TextContent, UserMessage
from agentloop.models.transcribe import OpenAITranscriber, TranscriptionError, open_transcriber
from tests import test_channel_discord as dc
from tests import test_channel_telegram as tg
from tests import test_channel_whatsapp as wa
from tests.fakes.http_server import ServerThread
from tests.test_channel_media import (
    PNG,
    FakeCdn,
    FilesGraph,
    FilesTelegram,
    attachment,
    b64,
    last_input,
    log_text,
    post,
    until,
)

KEY = "sk-transcribe-Secret-0123456789abcdef"
OGG = b"OggS\x00\x02" + bytes(range(256)) * 8  # what the user recorded (not real Opus: the fake does not listen)
MP3 = b"ID3\x04\x00" + bytes(range(255, -1, -1)) * 4
SORRY = "Sorry, I could not transcribe the voice message; please try again, or write it as text."


# ------------------------------------------------------------------------------- the fake server


@dataclass
class Upload:
    model: str
    response_format: str | None
    filename: str
    content_type: str
    data: bytes
    authorization: str | None
    raw: bytes  # the whole multipart body


class FakeWhisper:
    """``POST /v1/audio/transcriptions``: each request recorded, answered with the next queued
    answer (a text: ``{"text": ...}``; ``(status, body)``: that status, a JSON or raw body), or
    with ``default``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.uploads: list[Upload] = []
        self.answers: list[str | tuple[int, Any]] = []
        self.default = "hello from the voice note"
        self.server = ServerThread(Starlette(routes=[Route("/v1/audio/transcriptions", self.handle, methods=["POST"])]))
        self.url = self.server.url + "/v1"

    async def handle(self, request: Request) -> Response:
        raw = await request.body()
        form = await request.form()
        upload = form["file"]
        assert isinstance(upload, UploadFile)
        entry = Upload(
            model=str(form["model"]),
            response_format=str(form.get("response_format")),
            filename=upload.filename or "",
            content_type=upload.content_type or "",
            data=await upload.read(),
            authorization=request.headers.get("authorization"),
            raw=raw,
        )
        with self.lock:
            self.uploads.append(entry)
            answer = self.answers.pop(0) if self.answers else self.default
        if isinstance(answer, str):
            return JSONResponse({"text": answer})
        status, body = answer
        if isinstance(body, bytes):
            return Response(body, status, media_type="text/html")
        return JSONResponse(body, status)

    def queue(self, *answers: str | tuple[int, Any]) -> None:
        with self.lock:
            self.answers.extend(answers)

    def transcriber(self, **kw: Any) -> OpenAITranscriber:
        return OpenAITranscriber("whisper-1", api_key=KEY, base_url=self.url, max_retries=0, timeout=5.0, **kw)


@pytest.fixture
def whisper() -> Iterator[FakeWhisper]:
    fake = FakeWhisper()
    with fake.server:
        yield fake


@pytest.fixture
def telegram() -> Iterator[FilesTelegram]:
    fake = FilesTelegram()
    with fake.server:
        yield fake


def voice(file_id: str = "v1", size: int | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {"file_id": file_id, "file_unique_id": file_id, "duration": 3, "mime_type": "audio/ogg"}
    if size is not None:
        found["file_size"] = size
    return found


# ------------------------------------------------------------------------------- the shared part


def test_audio_is_recognised_named_with_a_suffix_and_its_transcript_marked() -> None:
    assert audio_type("audio/ogg; codecs=opus") == "audio/ogg"
    assert audio_type("audio/x-wav") == "audio/wav" and audio_type("audio/mp3") == "audio/mpeg"
    assert audio_type("application/octet-stream", "talk.M4A") == "audio/mp4"
    assert audio_type("video/mp4") is None and audio_type(None, "a.pdf") is None and audio_type("audio/") is None
    note = Attachment("audio", "audio/ogg", "", "the voice message", None, "x")
    assert audio_filename(note) == "audio.ogg"  # (OpenAI tells the format by the suffix)
    assert audio_filename(Attachment("audio", "audio/mpeg", "talk.mp3", "talk.mp3", None, "x")) == "talk.mp3"
    assert audio_filename(Attachment("audio", "audio/mp4", "memo", "memo", None, "x")) == "audio.m4a"
    assert transcript_text(note, "hi") == "[Transcribed voice message]: hi"
    named = Attachment("audio", "audio/mpeg", "talk.mp3", "talk.mp3", None, "x")
    assert transcript_text(named, "hi") == '[Transcribed audio file "talk.mp3"]: hi'


async def test_the_client_sends_the_file_as_openai_multipart_and_never_shows_the_key(whisper: FakeWhisper) -> None:
    transcriber = whisper.transcriber(language="en")
    try:
        assert await transcriber.transcribe(OGG, "audio.ogg", "audio/ogg") == "hello from the voice note"
        [upload] = whisper.uploads
        assert (upload.model, upload.response_format, upload.filename) == ("whisper-1", "json", "audio.ogg")
        assert upload.content_type == "audio/ogg" and upload.data == OGG
        assert upload.authorization == f"Bearer {KEY}"
        assert b'name="language"' in upload.raw and b'filename="audio.ogg"' in upload.raw
        whisper.queue(
            (500, {"error": {"message": f"overloaded (key {KEY})", "type": "server_error"}}),
            (200, b"<html>not json</html>"),
            (200, {"no": "text"}),
            (401, {"error": {"message": "Incorrect API key provided: sk-tra***cdef"}}),
        )
        reasons = []
        for _ in range(4):
            with pytest.raises(TranscriptionError) as failed:
                await transcriber.transcribe(OGG, "audio.ogg", "audio/ogg")
            reasons.append(str(failed.value))
        assert reasons[0].startswith("the transcription server answered HTTP 500: overloaded")
        assert reasons[1] == reasons[2] == "the transcription server's answer holds no text"
        assert reasons[3].startswith("the transcription server answered HTTP 401")
        assert all(KEY not in r for r in reasons) and KEY not in repr(transcriber)
    finally:
        await transcriber.close()
    gone = OpenAITranscriber("whisper-1", api_key=KEY, base_url="http://127.0.0.1:9/v1", max_retries=0, timeout=2)
    try:
        with pytest.raises(TranscriptionError, match="could not be reached"):
            await gone.transcribe(OGG, "audio.ogg", "audio/ogg")
    finally:
        await gone.close()


def test_the_transcription_model_is_checked_with_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    for spec, message in (
        ("whisper-1", "must look like 'openai:whisper-1'"),
        ("openai:", "must look like"),
        ("acme:whisper", "unknown transcription provider 'acme'"),
        ("openai:whisper-1", "needs an API key: set OPENAI_API_KEY"),
    ):
        with pytest.raises(ValueError, match=message):
            open_transcriber(spec)
    with pytest.raises(ValueError, match="must be an http"):
        open_transcriber("openai:whisper-1", base_url="ftp://example.com/v1")
    with pytest.raises(ValueError, match="set MY_KEY"):
        open_transcriber("openai:whisper-1", key_env="MY_KEY")
    monkeypatch.setenv("MY_KEY", KEY)
    keyed = open_transcriber("openai:whisper-1", key_env="MY_KEY")
    assert keyed.model_id == "whisper-1" and keyed.base_url is None
    local = open_transcriber(" openai:Systran/faster-whisper-small ", base_url="http://127.0.0.1:8000/v1/")
    assert local.model_id == "Systran/faster-whisper-small" and local.base_url == "http://127.0.0.1:8000/v1"


def test_the_commands_refuse_a_bad_transcription_option_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = CliRunner()
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", tg.TOKEN)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    for name in ("AGENTLOOP_DATA", "AGENTLOOP_STORE", "AGENTLOOP_TRANSCRIBE_MODEL", "AGENTLOOP_TRANSCRIBE_URL"):
        monkeypatch.delenv(name, raising=False)
    bad = runner.invoke(app, ["telegram", "--allow", "100", "--transcribe-model", "whisper-1"])
    assert bad.exit_code == 2 and "--transcribe-model" in bad.stderr and "openai:whisper-1" in bad.stderr
    lone = runner.invoke(app, ["telegram", "--allow", "100", "--transcribe-url", "http://127.0.0.1:1/v1"])
    assert lone.exit_code == 2 and "--transcribe-url need --transcribe-model" in lone.stderr
    monkeypatch.delenv("OPENAI_API_KEY")
    keyless = runner.invoke(app, ["telegram", "--allow", "100", "--transcribe-model", "openai:whisper-1"])
    assert keyless.exit_code == 2 and "set OPENAI_API_KEY" in keyless.stderr
    for result in (bad, lone, keyless):
        assert "Traceback" not in result.stderr and KEY not in result.stderr + result.stdout
    assert not (tmp_path / "xdg" / "agentloop").exists()  # refused before anything was opened


# ------------------------------------------------------------------------------- Telegram


async def test_telegram_a_voice_note_reaches_the_agent_as_its_transcript(
    tmp_path: Path, telegram: FilesTelegram, whisper: FakeWhisper, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    telegram.file("v1", "voice/file_7.oga", OGG, len(OGG))
    whisper.queue("  turn off the\x00 lights  ")
    transcriber = whisper.transcriber()
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE], transcriber=transcriber) as (kernel, _, model):
        telegram.media(tg.ALICE, tg.ALICE, voice=voice(size=len(OGG)), caption="from the car")
        await until(lambda: telegram.texts(tg.ALICE))
        said = "from the car\n\n[Transcribed voice message]: turn off the lights"
        assert last_input(model).content == [TextContent(text=said)]
        assert telegram.texts(tg.ALICE) == [f"seen: {said}"]  # a run like a text's
        [upload] = whisper.uploads  # the file the user sent, as it was sent
        assert upload.data == OGG and upload.filename == "audio.ogg" and upload.content_type == "audio/ogg"
        assert upload.model == "whisper-1" and upload.authorization == f"Bearer {KEY}"
        assert telegram.downloads == ["voice/file_7.oga"]
        # an audio file sent as a document is transcribed too (no caption: the transcript alone)
        telegram.file("d1", "documents/talk.mp3", MP3)
        document = {"file_id": "d1", "file_unique_id": "d1", "file_name": "talk.mp3", "mime_type": "audio/mpeg"}
        telegram.media(tg.ALICE, tg.ALICE, document=document)
        await until(lambda: len(telegram.texts(tg.ALICE)) == 2)
        assert last_input(model).text == '[Transcribed audio file "talk.mp3"]: hello from the voice note'
        assert whisper.uploads[1].data == MP3 and whisper.uploads[1].filename == "talk.mp3"
        [record] = await kernel.processes()
        assert not (tmp_path / "var" / "media" / record.owner).exists()  # the sound is not kept: its words are
    await transcriber.close()
    text = log_text(caplog)
    assert "transcribed the voice message" in text and KEY not in text and tg.TOKEN not in text


async def test_telegram_without_a_transcriber_a_voice_note_is_refused_as_before(
    tmp_path: Path, telegram: FilesTelegram, whisper: FakeWhisper
) -> None:
    telegram.file("v1", "voice/file_7.oga", OGG)
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE]) as (kernel, _, model):
        telegram.media(tg.ALICE, tg.ALICE, voice=voice(), caption="listen")
        document = {"file_id": "v1", "file_name": "talk.mp3", "mime_type": "audio/mpeg"}
        telegram.media(tg.ALICE, tg.ALICE, document=document)
        await until(lambda: len(telegram.texts(tg.ALICE)) == 2)
        assert telegram.texts(tg.ALICE) == [UNSUPPORTED, UNSUPPORTED]
        assert telegram.of("getFile") == [] and whisper.uploads == []
        assert model.requests == [] and await kernel.processes() == []


async def test_telegram_a_failed_transcription_is_told_and_the_bridge_goes_on(
    tmp_path: Path, telegram: FilesTelegram, whisper: FakeWhisper, caplog: pytest.LogCaptureFixture
) -> None:
    telegram.file("v1", "voice/a.oga", OGG)
    telegram.file("v2", "voice/b.oga", OGG[::-1])
    telegram.file("v3", "voice/c.oga", OGG)
    whisper.queue(
        (500, {"error": {"message": f"upstream died, key={KEY}", "type": "server_error"}}),
        (200, b"<html>garbage</html>"),
        "   ",
    )
    transcriber = whisper.transcriber()
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE], transcriber=transcriber) as (_, bridge, model):
        first = telegram.media(tg.ALICE, tg.ALICE, voice=voice("v1"), caption="about the meeting")
        telegram.media(tg.ALICE, tg.ALICE, voice=voice("v2"))
        telegram.media(tg.ALICE, tg.ALICE, voice=voice("v3"))
        nxt = telegram.message(chat=tg.ALICE, user=tg.ALICE, text="next")
        await until(lambda: len(telegram.texts(tg.ALICE)) == 4)
        assert telegram.texts(tg.ALICE) == [
            SORRY,  # a 500
            SORRY,  # an answer that is no JSON
            "I could not make out any words in the voice message; please try again, or write it as text.",
            "seen: next",  # the next update goes through: nothing of the failed ones (not their caption)
        ]
        assert bridge.state.offset == nxt + 1 and nxt == first + 3
        assert len(whisper.uploads) == 3  # each tried once (a failed transcription is not a failed update)
        assert [r.messages[-1].text for r in model.requests] == ["next"]
    await transcriber.close()
    text = log_text(caplog)
    assert "could not transcribe the voice message" in text and "HTTP 500" in text and KEY not in text


async def test_telegram_an_audio_album_goes_through_without_the_file_whose_transcription_failed(
    tmp_path: Path, telegram: FilesTelegram, whisper: FakeWhisper
) -> None:
    telegram.file("a1", "music/one.mp3", MP3)
    telegram.file("a2", "music/two.mp3", MP3[::-1])
    telegram.file("a3", "music/three.mp3", MP3)
    whisper.queue("first part", (503, {"error": {"message": "busy"}}), "third part")
    transcriber = whisper.transcriber()

    def track(file_id: str, name: str) -> dict[str, Any]:
        return {
            "file_id": file_id,
            "file_unique_id": file_id,
            "duration": 9,
            "file_name": name,
            "mime_type": "audio/mpeg",
        }

    async with tg.running(tmp_path, telegram, allow=[tg.ALICE], transcriber=transcriber) as (_, _, model):
        group = {"media_group_id": "album-1"}
        telegram.media(tg.ALICE, tg.ALICE, audio=track("a1", "one.mp3"), caption="my notes", **group)
        telegram.media(tg.ALICE, tg.ALICE, audio=track("a2", "two.mp3"), **group)
        telegram.media(tg.ALICE, tg.ALICE, audio=track("a3", "three.mp3"), **group)
        await until(lambda: len(telegram.texts(tg.ALICE)) == 2)
        said = "my notes\n\n[Transcribed audio file]: first part\n\n[Transcribed audio file]: third part"
        assert telegram.texts(tg.ALICE) == [
            "Sorry, I could not transcribe the audio file; please try again, or write it as text.",
            f"seen: {said}",
        ]
        assert [u.data for u in whisper.uploads] == [MP3, MP3[::-1], MP3]
        assert [u.filename for u in whisper.uploads] == ["one.mp3", "two.mp3", "three.mp3"]
        assert len(model.requests) == 1
    await transcriber.close()


async def test_telegram_a_redelivered_voice_note_is_admitted_once_and_not_transcribed_again(
    tmp_path: Path, telegram: FilesTelegram, whisper: FakeWhisper
) -> None:
    telegram.file("v1", "voice/a.oga", OGG)
    transcriber = whisper.transcriber()
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE], transcriber=transcriber) as (kernel, bridge, model):
        first = telegram.media(tg.ALICE, tg.ALICE, voice=voice())
        await until(lambda: telegram.texts(tg.ALICE))
        await until(lambda: bridge.state.offset == first + 1)
        [record] = await kernel.processes()
    # a crash after the admission, before the offset was saved: Telegram sends the update again
    state = tmp_path / "var" / "telegram" / "4242.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "offset": first}))
    telegram.media(tg.ALICE, tg.ALICE, update_id=first, voice=voice())
    kw: dict[str, Any] = {"allow": [tg.ALICE], "model": model, "transcriber": transcriber}
    async with tg.running(tmp_path, telegram, **kw) as (kernel, bridge, _):
        await until(lambda: bridge.state.offset == first + 1)
        telegram.message(chat=tg.ALICE, user=tg.ALICE, text="next")
        await until(lambda: len(telegram.texts(tg.ALICE)) == 2)
        proc = await kernel.process(record.pid)
        history = [m.text for m in await proc.messages() if isinstance(m, UserMessage)]
        assert history == ["[Transcribed voice message]: hello from the voice note", "next"]
        assert telegram.downloads == ["voice/a.oga"] and len(whisper.uploads) == 1
    await transcriber.close()


async def test_telegram_a_voice_note_past_the_limit_is_refused_before_it_is_fetched_or_sent(
    tmp_path: Path, telegram: FilesTelegram, whisper: FakeWhisper
) -> None:
    telegram.file("big", "voice/big.oga", 1 << 20, 1 << 20)
    transcriber = whisper.transcriber()
    kw: dict[str, Any] = {"allow": [tg.ALICE], "transcriber": transcriber, "max_file_bytes": 64 * 1024}
    async with tg.running(tmp_path, telegram, **kw) as (_, _, model):
        telegram.media(tg.ALICE, tg.ALICE, voice=voice("big", size=1 << 20))
        await until(lambda: telegram.texts(tg.ALICE))
        assert telegram.texts(tg.ALICE) == ["The voice message is too large: I can take a file of up to 64 KiB."]
        assert telegram.of("getFile") == [] and whisper.uploads == [] and model.requests == []
    await transcriber.close()


# ------------------------------------------------------------------------------- WhatsApp


@pytest.fixture
def graph() -> Iterator[FilesGraph]:
    fake = FilesGraph()
    with fake.server:
        yield fake


async def test_whatsapp_a_voice_note_reaches_the_agent_as_its_transcript_and_a_failure_is_told(
    tmp_path: Path, graph: FilesGraph, whisper: FakeWhisper
) -> None:
    graph.add_media("3001", OGG, "audio/ogg; codecs=opus", len(OGG))
    graph.add_media("3002", OGG, "audio/ogg; codecs=opus")
    whisper.queue("what is the weather", (500, {"error": {"message": "boom"}}))
    transcriber = whisper.transcriber()
    async with wa.running(tmp_path, graph, allow=[wa.ALICE], transcriber=transcriber) as (_, _, model, meta):
        note = {"id": "3001", "mime_type": "audio/ogg; codecs=opus", "voice": True}
        await meta.send(wa.ALICE, {"type": "audio", "audio": note})
        await until(lambda: graph.texts(wa.ALICE))
        assert graph.texts(wa.ALICE) == ["seen: [Transcribed voice message]: what is the weather"]
        [upload] = whisper.uploads
        assert upload.data == OGG and upload.filename == "audio.ogg" and upload.content_type == "audio/ogg"
        assert graph.downloads == [("3001", f"Bearer {wa.ACCESS_TOKEN}")]
        await meta.send(wa.ALICE, {"type": "audio", "audio": {"id": "3002", "mime_type": "audio/ogg", "voice": True}})
        await wa_text(meta, "still there?")
        await until(lambda: len(graph.texts(wa.ALICE)) == 3)
        assert graph.texts(wa.ALICE)[1:] == [
            SORRY,
            "seen: [Transcribed voice message]: what is the weather, still there?",
        ]
        assert len(model.requests) == 2
    await transcriber.close()


async def wa_text(meta: Any, text: str) -> None:
    await asyncio.sleep(0.1)  # (after the voice note)
    await meta.text(wa.ALICE, text)


async def test_whatsapp_without_a_transcriber_a_voice_note_is_refused_as_before(
    tmp_path: Path, graph: FilesGraph, whisper: FakeWhisper
) -> None:
    graph.add_media("3001", OGG, "audio/ogg")
    async with wa.running(tmp_path, graph, allow=[wa.ALICE]) as (kernel, _, model, meta):
        await meta.send(wa.ALICE, {"type": "audio", "audio": {"id": "3001", "mime_type": "audio/ogg", "voice": True}})
        await until(lambda: graph.texts(wa.ALICE))
        assert graph.texts(wa.ALICE) == [UNSUPPORTED] and graph.lookups == [] and whisper.uploads == []
        assert model.requests == [] and await kernel.processes() == []


# ------------------------------------------------------------------------------- Discord


@pytest.fixture
def discord() -> Iterator[dc.FakeDiscord]:
    with dc.FakeDiscord() as fake:
        yield fake


@pytest.fixture
def cdn() -> Iterator[FakeCdn]:
    fake = FakeCdn()
    with fake.server:
        yield fake


async def test_discord_a_voice_message_beside_an_image_reaches_the_agent_as_text_and_the_image(
    tmp_path: Path, discord: dc.FakeDiscord, cdn: FakeCdn, whisper: FakeWhisper
) -> None:
    note = attachment(cdn.add("voice-message.ogg", OGG), "voice-message.ogg", "audio/ogg", len(OGG))
    note["waveform"] = "AAAA"
    image = attachment(cdn.add("cat.png", PNG), "cat.png", "image/png", len(PNG))
    whisper.queue("what breed is it")
    transcriber = whisper.transcriber()
    kw: dict[str, Any] = {"attachment_urls": (f"{cdn.url}/attachments/",), "transcriber": transcriber}
    async with dc.running(tmp_path, discord, allow=[dc.ALICE], **kw) as (_, _, model):
        post(discord, dc.ALICE_DM, dc.ALICE, "", [note, image])
        await until(lambda: discord.texts(dc.ALICE_DM))
        content = last_input(model).content
        assert content[0] == TextContent(text="[Transcribed voice message]: what breed is it")
        assert len(content) == 2 and getattr(content[1], "data", None) == b64(PNG)
        [upload] = whisper.uploads
        assert upload.data == OGG and upload.filename == "voice-message.ogg"
    await transcriber.close()
