"""Fixes left from the tenth review:

- a transcriber whose ``transcribe`` is a plain function (a local model's blocking call) passed
  ``Kernel.open``'s check and then failed every audio as a 502 ``transcription_failed``, as if the
  service were down; it is now run in a worker thread, by the kernel and by the chat bridges alike
  (``process.audio_video.transcribe_audio``), and an object with no ``transcribe`` is refused where
  it is given;
- the server refused audio sent as ``application/octet-stream`` (or with no type) under an audio
  file's name, which the library takes by the name's suffix (``audio_type``);
- ``admission.signal_event(generation=...)`` without a ``claim`` ignored ``generation`` (and
  delivered to whatever conversation the process held): it is now a ValueError.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from agentloop import ScriptedModel
from agentloop.channels.telegram import TelegramBridge
from agentloop.kernel import Kernel
from agentloop.messages import UserMessage
from agentloop.process import admission
from agentloop.process.audio_video import AudioContent, TranscriptionFailed
from tests import test_channel_telegram as tg
from tests.test_channel_media import FilesTelegram, last_input, until
from tests.ws_support import KernelServer, eventually

OGG = b"OggS\x00\x02" + bytes(range(200))  # (never decoded: the transcriber gets the bytes as they are)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass
class SyncTranscriber:
    """A transcriber with a plain (blocking) ``transcribe``: answers ``said`` or raises ``error``;
    with a ``gate``, it first waits (in its thread) for the event loop's side to open it."""

    said: str = "words from a local model"
    error: Exception | None = None
    gate: threading.Event | None = None
    asked: list[tuple[bytes, str, str]] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)

    def transcribe(self, audio: bytes, filename: str, mime: str) -> str:
        self.asked.append((audio, filename, mime))
        self.threads.append(threading.get_ident())
        if self.gate is not None and not self.gate.wait(3):
            raise RuntimeError("the event loop stood still while the transcriber ran")
        if self.error is not None:
            raise self.error
        return self.said


def user_texts(model: ScriptedModel) -> list[str]:
    return [m.text for r in model.requests for m in r.messages if isinstance(m, UserMessage)]


# ------------------------------------------------------------------------------- the transcriber


@pytest.mark.parametrize("bad", [object(), SimpleNamespace(transcribe="not a function")], ids=["none", "not-callable"])
async def test_kernel_open_refuses_a_transcriber_without_a_transcribe_method(tmp_path: Path, bad: object) -> None:
    with pytest.raises(TypeError, match=r"transcriber must have a transcribe\(audio, filename, mime\) method"):
        async with Kernel.open(f"sqlite:///{tmp_path}/k.db", model=ScriptedModel(["x"]), transcriber=bad):
            pass


async def test_a_sync_transcriber_runs_in_a_worker_thread_and_its_transcript_is_delivered(tmp_path: Path) -> None:
    model = ScriptedModel(lambda req: "ok")
    gate = threading.Event()
    fake = SyncTranscriber(gate=gate)
    async with Kernel.open(f"sqlite:///{tmp_path}/k.db", model=model, workspace=tmp_path, transcriber=fake) as kernel:
        proc = await kernel.spawn("alice")

        async def open_gate() -> None:  # runs only if the loop is free while the transcriber blocks
            await asyncio.sleep(0.05)
            gate.set()

        opener = asyncio.create_task(open_gate())
        await proc.send("listen", media=[AudioContent(b64(OGG), "audio/ogg", "memo.ogg")])
        await opener
        await proc.wait_idle()
        assert fake.asked == [(OGG, "memo.ogg", "audio/ogg")]
        assert fake.threads[0] != threading.get_ident()  # not on the event loop's thread
        assert user_texts(model) == ['listen\n\n[Transcribed audio file "memo.ogg"]: words from a local model']
        # its failure is the transcriber's, in its own words (not "str can't be used in await")
        kernel.transcriber = SyncTranscriber(error=RuntimeError("the local model crashed"))
        with pytest.raises(TranscriptionFailed, match=r'could not transcribe "memo.ogg": the local model crashed'):
            await proc.send("again", media=[AudioContent(b64(OGG), "audio/ogg", "memo.ogg")])
        assert len(user_texts(model)) == 1


@pytest.fixture
def telegram() -> Iterator[FilesTelegram]:
    fake = FilesTelegram()
    with fake.server:
        yield fake


async def test_a_chat_bridge_takes_a_sync_transcriber_and_refuses_one_without_transcribe(
    tmp_path: Path, telegram: FilesTelegram
) -> None:
    telegram.file("v1", "voice/file_1.oga", OGG, len(OGG))
    fake = SyncTranscriber(said="turn off the lights")
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE], transcriber=fake) as (kernel, _, model):
        voice = {"file_id": "v1", "file_unique_id": "v1", "duration": 3, "mime_type": "audio/ogg"}
        telegram.media(tg.ALICE, tg.ALICE, voice=voice)
        await until(lambda: telegram.texts(tg.ALICE))
        assert last_input(model).text == "[Transcribed voice message]: turn off the lights"
        assert fake.asked == [(OGG, "audio.ogg", "audio/ogg")]
        assert fake.threads[0] != threading.get_ident()
        with pytest.raises(TypeError, match=r"transcriber must have a transcribe\(audio, filename, mime\) method"):
            TelegramBridge(kernel, tg.TOKEN, allow=[tg.ALICE], api_url=telegram.url, transcriber=object())  # type: ignore[arg-type]


# ---------------------------------------------------------------- audio of a generic type, over HTTP


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelServer]:
    model = ScriptedModel(lambda req: "ok", keep_requests=False)
    with KernelServer(tmp_path_factory.mktemp("fixes10"), model, transcriber=SyncTranscriber(said="hello")) as s:
        yield s


def http(server: KernelServer) -> httpx.Client:
    base = server.url.replace("ws://", "http://").removesuffix("/v1/ws")
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {server.tokens['alice']}"}, timeout=5)


def texts(client: httpx.Client, pid: str) -> list[str]:
    answer = client.get(f"/v1/processes/{pid}/messages").json()
    return [m["message"]["content"][0]["text"] for m in answer["messages"] if m["message"]["role"] == "user"]


def test_audio_of_a_generic_type_is_taken_by_its_file_names_suffix_over_http_and_the_websocket(
    server: KernelServer,
) -> None:
    assert server.ctx is not None
    fake = server.ctx.kernel.transcriber
    assert isinstance(fake, SyncTranscriber)
    with http(server) as client, server.client("alice") as ws:
        pid = client.post("/v1/processes", json={}).json()["pid"]
        note = {"data": b64(OGG), "mime_type": "application/octet-stream", "name": "note.ogg"}
        answer = client.post(f"/v1/processes/{pid}/messages", json={"text": "hear", "media": [note]})
        assert answer.status_code == 202, answer.text
        eventually(lambda: texts(client, pid) == ['hear\n\n[Transcribed audio file "note.ogg"]: hello'])
        assert fake.asked[-1] == (OGG, "note.ogg", "audio/ogg")
        untyped = {"data": b64(OGG), "mime_type": "", "name": "memo.MP3"}
        receipt = ws.ok("proc.send", {"pid": pid, "text": "", "media": [untyped], "mode": "queue"})
        assert receipt["run_id"]
        eventually(lambda: texts(client, pid)[1:] == ['[Transcribed audio file "memo.MP3"]: hello'])
        assert fake.asked[-1] == (OGG, "memo.MP3", "audio/mpeg")
        spawned = client.post("/v1/processes", json={"text": "first", "media": [note]})
        assert spawned.status_code == 201, spawned.text
        # a generic type under a name that is not audio's is still refused
        binary = {"data": b64(OGG), "mime_type": "application/octet-stream", "name": "note.bin"}
        refused = client.post(f"/v1/processes/{pid}/messages", json={"text": "hear", "media": [binary]})
        assert refused.status_code == 400 and "media[0].mime_type must be one of" in refused.text


# ------------------------------------------------------------------------- signal_event's generation


async def test_signal_event_with_a_generation_but_no_claim_is_refused_not_ignored(tmp_path: Path) -> None:
    model = ScriptedModel(lambda req: "ok")
    async with Kernel.open(f"sqlite:///{tmp_path}/k.db", model=model, workspace=tmp_path) as kernel:
        proc = await kernel.spawn("alice")
        engine = kernel.engine
        generation = (await engine.live(proc.pid)).record.history_generation
        with pytest.raises(ValueError, match="generation is checked only with a claim"):
            await admission.signal_event(engine, proc.pid, "late", run_id=None, reason="x", generation=generation + 1)
        with pytest.raises(ValueError, match="generation is checked only with a claim"):
            await engine.claimed_event(proc.pid, "late", claim=None, run_id="r1", reason="x", generation=generation)  # type: ignore[arg-type]
        assert await proc.history() == [] and model.calls == 0

        async def claim() -> bool:
            return True

        # with a claim: an ended conversation gets nothing, the current one its event
        stale = await engine.claimed_event(proc.pid, "old", claim=claim, run_id="r2", reason="x", generation=-1)
        assert stale is None
        fresh = await engine.claimed_event(proc.pid, "now", claim=claim, run_id="r3", reason="x", generation=generation)
        assert fresh is not None
        await proc.wait_idle()
        assert model.calls == 1
