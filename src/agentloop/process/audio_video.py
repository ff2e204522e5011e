"""Audio and video attached to a user's input: what a model cannot take, turned into text it can.

Models take text, images and documents (``messages.MediaBlock``). The GSV process seed says the
rest of a process's media is "represented with transcript or descriptive fallback text", so:

- audio (``AudioContent``: a voice note, a recording) becomes the words said in it, by a
  ``Transcriber`` (``agentloop.models.transcribe`` is one: any OpenAI-compatible
  ``/v1/audio/transcriptions``), marked as a transcript (``transcript_text``, the chat bridges'
  wording) so that the model knows the user spoke it and that a word may be misheard;
- video (``VideoContent``) becomes a short note of what was attached (name, type, size) and that
  it cannot be viewed (``video_note``): the model can tell the user so, where refusing the input
  would lose the words that came with it.

Both happen before the input is delivered, as part of it (``to_text``): the message stored holds
the text, not the sound or the pictures (no model call could use them), and an input whose audio
cannot be transcribed is not delivered at all (``TranscriptionFailed``), as one whose image is
damaged is not. The kernel (``Process.send``) and the chat bridges (``channels.bridge``) share this
module; it sits below both.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Protocol, TypeAlias

from agentloop.messages import FileContent, ImageContent
from agentloop.process.media import DEFAULT_MAX_BYTES, MediaError, decode_limited
from agentloop.urls import redact_secrets

__all__ = [
    "GENERIC_TYPES",
    "TRANSCRIBER_THREADS",
    "TRANSCRIBE_SECONDS",
    "AudioContent",
    "InputMedia",
    "NoTranscriber",
    "NoWords",
    "Transcriber",
    "TranscriptionFailed",
    "VideoContent",
    "audio_filename",
    "audio_type",
    "check_transcriber",
    "clean_transcript",
    "shown_name",
    "size_text",
    "to_text",
    "transcribe_audio",
    "transcript_text",
    "video_note",
    "video_type",
]

TRANSCRIBE_SECONDS = 300.0  # seconds one transcription may take in all, whatever the transcriber's own limit

# audio a transcriber is given: its type, by suffix, and the suffix a file of that type is named with
# (a server such as OpenAI's tells the format by the file name's suffix)
_AUDIO_ALIASES = {
    "audio/mp3": "audio/mpeg",
    "audio/x-mp3": "audio/mpeg",
    "audio/x-wav": "audio/wav",
    "audio/wave": "audio/wav",
    "audio/vnd.wave": "audio/wav",
    "audio/x-m4a": "audio/mp4",
    "audio/m4a": "audio/mp4",
    "audio/x-flac": "audio/flac",
    "audio/opus": "audio/ogg",
    "application/ogg": "audio/ogg",
}
_AUDIO_BY_SUFFIX = {
    ".ogg": "audio/ogg",
    ".oga": "audio/ogg",
    ".opus": "audio/ogg",
    ".mp3": "audio/mpeg",
    ".mpga": "audio/mpeg",
    ".m4a": "audio/mp4",
    ".wav": "audio/wav",
    ".flac": "audio/flac",
    ".aac": "audio/aac",
    ".amr": "audio/amr",
    ".weba": "audio/webm",
}
_AUDIO_SUFFIX = {
    "audio/ogg": ".ogg",
    "audio/mpeg": ".mp3",
    "audio/mp4": ".m4a",
    "audio/wav": ".wav",
    "audio/flac": ".flac",
    "audio/aac": ".aac",
    "audio/amr": ".amr",
    "audio/webm": ".webm",
}
# video sent as a file of a generic type: its type, by suffix (a chat app's or an HTTP client's upload)
_VIDEO_BY_SUFFIX = {
    ".mp4": "video/mp4",
    ".m4v": "video/x-m4v",
    ".mov": "video/quicktime",
    ".webm": "video/webm",
    ".mkv": "video/x-matroska",
    ".avi": "video/x-msvideo",
    ".3gp": "video/3gpp",
}
# types that say nothing of a file's content: such a file is judged by its name's suffix instead
GENERIC_TYPES = frozenset({"", "application/octet-stream", "binary/octet-stream", "application/x-binary"})


class Transcriber(Protocol):
    """Speech to text: the words said in ``audio`` (a file named ``filename``, of type ``mime``).
    Any exception is a failed transcription. ``transcribe`` may be a coroutine function or a plain
    one (a local model's blocking call): a plain one runs in a worker thread (``transcribe_audio``)."""

    def transcribe(self, audio: bytes, filename: str, mime: str) -> Awaitable[str] | str: ...


def check_transcriber(transcriber: object) -> None:
    """TypeError unless ``transcriber`` has a ``transcribe`` method. Checked where one is given
    (``Kernel.open``, a chat bridge): found only at the first audio, the mistake would read as
    the transcription service failing (a server's 502), not as the caller's."""
    if not callable(getattr(transcriber, "transcribe", None)):
        raise TypeError(
            "transcriber must have a transcribe(audio, filename, mime) method (async, or a plain one, run in a "
            f"worker thread), got {type(transcriber).__name__}"
        )


async def transcribe_audio(transcriber: Transcriber, audio: bytes, filename: str, mime: str) -> object:
    """What ``transcriber`` answers for ``audio``: awaited when its ``transcribe`` is a coroutine
    function, else called in a thread of its own (at most ``TRANSCRIBER_THREADS`` at once), so
    that a blocking transcriber (a local model) does not stall every process and connection on
    the event loop meanwhile (and what that call returns is awaited if it is awaitable: a
    coroutine, not a task or future, which the thread has no event loop to make). Not checked:
    the caller judges the answer. A caller's timeout stops the wait, not a thread already running
    (Python cannot stop one): it holds its place until it ends, and keeps no one from exiting."""
    call: Callable[[bytes, str, str], object] = transcriber.transcribe
    is_async = inspect.iscoroutinefunction(call)  # (a bool: the check's type guard would narrow ``call``)
    if is_async:
        said = call(audio, filename, mime)
    else:
        said = await _in_thread(call, audio, filename, mime)
    if inspect.isawaitable(said):
        said = await said
    return said


# Plain-def transcriptions under way at once, per event loop: each in a daemon thread of its own,
# not the loop's default executor. One given up at its timeout goes on in its thread (a stuck local
# model, a blocking SDK call with no timeout): in the default executor a few of them would hold
# every thread it has, and every ``asyncio.to_thread`` of the kernel (file tools, archives, channel
# state) and its DNS lookups would wait behind them; and a thread of any ``concurrent.futures``
# executor is waited for as the program exits (``asyncio.run``, the interpreter), for ever. Past
# this many, a transcription waits for one to end, within its own timeout.
TRANSCRIBER_THREADS = 4
_running: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


async def _in_thread(call: Callable[[bytes, str, str], object], audio: bytes, filename: str, mime: str) -> object:
    """``call(audio, filename, mime)`` in a daemon thread (see ``TRANSCRIBER_THREADS``), in a copy
    of the caller's context, as ``asyncio.to_thread`` runs one. Cancelled, the wait ends at once;
    the thread's place is given back when the thread ends."""
    loop = asyncio.get_running_loop()
    places = _running.get(loop)
    if places is None:
        places = _running[loop] = asyncio.Semaphore(TRANSCRIBER_THREADS)
    await places.acquire()
    answer: asyncio.Future[object] = loop.create_future()

    def settle(outcome: tuple[bool, object]) -> None:  # (on the loop)
        places.release()
        ok, value = outcome
        if answer.done():  # (given up)
            return
        if ok:
            answer.set_result(value)
        else:
            assert isinstance(value, BaseException)
            answer.set_exception(value)

    def run() -> None:
        outcome: tuple[bool, object] = (False, RuntimeError("the transcriber's thread ended without an answer"))
        try:
            outcome = (True, call(audio, filename, mime))
        except Exception as exc:
            outcome = (False, exc)
        finally:
            with contextlib.suppress(RuntimeError):  # (the loop is closed: nobody waits any more)
                loop.call_soon_threadsafe(settle, outcome)

    context = contextvars.copy_context()
    try:
        threading.Thread(target=context.run, args=(run,), name="agentloop-transcriber", daemon=True).start()
    except BaseException:
        places.release()
        raise
    return await answer


class NoTranscriber(MediaError):
    """Audio sent where no transcriber was given: nothing could read it to the model."""


class NoWords(MediaError):
    """Audio whose transcript holds no words (silence, noise): there is nothing to deliver."""


class TranscriptionFailed(Exception):
    """The transcriber failed (an HTTP error, a timeout, an answer that is not text). Not a
    ``MediaError``: the audio may be fine, the service behind it is not (a server answers 502).
    The message says why, briefly, without a credential."""


def _declared(mime: object) -> str:
    return mime.split(";", 1)[0].strip().lower() if isinstance(mime, str) else ""


def _typed(mime: object, name: object, major: str, by_suffix: Mapping[str, str]) -> str | None:
    """The ``major`` type (``audio/…``, ``video/…``) of a file declared as ``mime`` and named
    ``name``, None for anything else. One rule for audio and video, wherever a file is judged (the
    kernel's blocks, the server, the chat bridges): a type that says nothing (missing, empty,
    ``application/octet-stream``: what many clients send for any upload) gives way to the name's
    suffix, so ``clip.mp4`` sent so is a video, as ``memo.ogg`` is audio; a type that does say
    something (``image/png``) is believed whatever the name."""
    declared = _declared(mime)
    if declared in GENERIC_TYPES and isinstance(name, str):
        declared = by_suffix.get(PurePosixPath(name.lower()).suffix, declared)
    return declared if declared.startswith(major) and len(declared) > len(major) else None


def audio_type(mime: object, name: object = "") -> str | None:
    """The audio type of a file declared as ``mime`` and named ``name`` (by the name's suffix when
    the type is missing or generic); None for anything that is not audio."""
    return _typed(_AUDIO_ALIASES.get(_declared(mime), _declared(mime)), name, "audio/", _AUDIO_BY_SUFFIX)


def video_type(mime: object, name: object = "") -> str | None:
    """The video type of a file declared as ``mime`` and named ``name`` (by the name's suffix when
    the type is missing or generic: ``clip.mp4`` sent as ``application/octet-stream``); None for
    anything that is not a video."""
    return _typed(mime, name, "video/", _VIDEO_BY_SUFFIX)


def audio_filename(name: str, mime: str) -> str:
    """The name audio of type ``mime`` is given to a transcriber as: its own ``name`` when that has
    a suffix the server can tell the format by, else ``audio`` with the suffix of its type."""
    suffix = PurePosixPath(name.lower()).suffix
    if name and (suffix in _AUDIO_BY_SUFFIX or suffix in _AUDIO_SUFFIX.values()):
        return name
    return "audio" + _AUDIO_SUFFIX.get(mime, ".ogg")


def transcript_text(what: str, transcript: str) -> str:
    """The transcript of ``what`` ("the voice message", or an audio file's name) as the model reads
    it: marked as a transcription, so that it knows the user spoke it (and that the words may be
    misheard)."""
    label = what[4:] if what.startswith("the ") else f'audio file "{what}"'
    return f"[Transcribed {label}]: {transcript}"


def clean_transcript(text: str) -> str:
    """A transcript with what no message should hold (control characters, lone surrogates) taken
    out and its whitespace tidied."""
    kept = "".join(c for c in text if c.isprintable() or c in "\n\t")
    return "\n".join(" ".join(line.split()) for line in kept.strip().splitlines()).strip()


def shown_name(name: object, fallback: str) -> str:
    """A file name as a person (or the model) is told about it: one short line of printable
    characters (``fallback`` when there is none)."""
    if not isinstance(name, str):
        return fallback
    clean = "".join(c for c in name if c.isprintable()).strip()[:80]
    return clean or fallback


def size_text(size: int) -> str:
    """``size`` bytes, as a person reads it (``1.5 MiB``: one decimal is enough to tell files apart)."""
    if size >= 1 << 20:
        return f"{size / (1 << 20):.1f} MiB"
    if size >= 1 << 10:
        return f"{size / (1 << 10):.1f} KiB"
    return f"{size} bytes"


@dataclass(frozen=True, slots=True)
class AudioContent:
    """Speech (a voice note, a recording) as base64 ``data`` of an audio ``mime_type``
    (``audio/ogg``, ``audio/mpeg`` …; a generic type is judged by ``name``'s suffix), named
    ``name``. Input only: ``Process.send`` delivers its transcript; no message holds one."""

    data: str
    mime_type: str
    name: str = ""

    def __post_init__(self) -> None:
        if audio_type(self.mime_type, self.name) is None:
            raise ValueError(f"unsupported audio type {self.mime_type!r}: audio is audio/* (audio/ogg, audio/mpeg …)")


@dataclass(frozen=True, slots=True)
class VideoContent:
    """A video as base64 ``data`` of a ``video/*`` ``mime_type`` (a generic type is judged by
    ``name``'s suffix, as audio's is), named ``name``. Input only: no model takes video, so
    ``Process.send`` delivers a note of it in its place (``video_note``)."""

    data: str
    mime_type: str
    name: str = ""

    def __post_init__(self) -> None:
        if video_type(self.mime_type, self.name) is None:
            raise ValueError(f"unsupported video type {self.mime_type!r}: video is video/* (video/mp4 …)")


# what an input may attach: the blocks a model takes, and those turned into text first
InputMedia: TypeAlias = ImageContent | FileContent | AudioContent | VideoContent


def video_note(name: str, mime: str, size: int | None) -> str:
    """What the model reads in place of a video: what was attached, and that it cannot be seen
    (``size`` None: unknown, as a chat app that does not say it)."""
    shown = shown_name(name, "")
    label = f'video "{shown}"' if shown else "video"
    known = size_text(size) if size is not None else "size unknown"
    return f"[Attached {label} ({mime}, {known}): it cannot be viewed here; this note stands in for it]"


def _decoded(block: AudioContent | VideoContent, max_bytes: int) -> bytes:
    """The bytes of ``block``, at most ``max_bytes``: the limit
    every attachment has (``MediaTooLarge``), checked before decoding a huge payload."""
    kind = "audio" if isinstance(block, AudioContent) else "video"
    if not isinstance(block.data, str) or not block.data:
        raise MediaError(f"{kind} data must be a non-empty base64 string")
    data = decode_limited(block.data, kind, max_bytes)
    if not data:
        raise MediaError(f"{kind} data is empty")
    return data


async def _transcribe(transcriber: Transcriber, block: AudioContent, data: bytes) -> str:
    """The cleaned words of ``block``: ``TranscriptionFailed`` when the transcriber fails or takes
    past ``TRANSCRIBE_SECONDS``, ``NoWords`` when it finds none."""
    mime = audio_type(block.mime_type, block.name) or "audio/ogg"
    named = shown_name(block.name, "")
    what = f'"{named}"' if named else "the audio attachment"  # (as an error names it)
    try:
        async with asyncio.timeout(TRANSCRIBE_SECONDS):
            said = await transcribe_audio(transcriber, data, audio_filename(block.name, mime), mime)
    except TimeoutError as exc:
        if str(exc):  # (the transcriber's own timeout, said in its words)
            raise TranscriptionFailed(f"could not transcribe {what}: {redact_secrets(str(exc))[:300]}") from None
        raise TranscriptionFailed(f"could not transcribe {what}: no answer in {TRANSCRIBE_SECONDS:.0f} s") from None
    except Exception as exc:  # (anything a transcriber raises is its failure, not the caller's)
        reason = redact_secrets(str(exc) or type(exc).__name__)[:300]
        raise TranscriptionFailed(f"could not transcribe {what}: {reason}") from None
    if not isinstance(said, str):
        raise TranscriptionFailed(f"could not transcribe {what}: the transcriber answered {type(said).__name__}")
    transcript = clean_transcript(said)
    if not transcript:
        raise NoWords(f"no words could be made out in {what}")
    return transcript_text(named or "the audio attachment", transcript)


async def to_text(
    text: str,
    media: Sequence[InputMedia],
    transcriber: Transcriber | None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> tuple[str, list[ImageContent | FileContent]]:
    """``text`` and ``media`` as a model takes them: each audio's marked transcript and each
    video's note after ``text`` (in the order attached, a blank line apart; they are the text when
    ``text`` is blank), and the images and documents left as they are.

    Every audio and video is checked (its size, its base64) and a transcriber required
    (``NoTranscriber``) before the first one is transcribed, so a bad input costs no
    transcription. Audio is transcribed one after another (``TranscriptionFailed``, ``NoWords``)."""
    blocks: list[ImageContent | FileContent] = []
    decoded: list[tuple[AudioContent | VideoContent, bytes]] = []
    for block in media:
        if isinstance(block, AudioContent | VideoContent):
            decoded.append((block, _decoded(block, max_bytes)))
        else:
            blocks.append(block)
    if not decoded:
        return text, blocks
    if transcriber is None and any(isinstance(block, AudioContent) for block, _ in decoded):
        raise NoTranscriber("audio needs a transcription model, and none was given (Kernel.open(transcriber=...))")
    notes: list[str] = []
    for block, data in decoded:
        if isinstance(block, VideoContent):
            notes.append(video_note(block.name, video_type(block.mime_type, block.name) or block.mime_type, len(data)))
        else:
            assert transcriber is not None  # (checked above)
            notes.append(await _transcribe(transcriber, block, data))
    return "\n\n".join([text, *notes] if text.strip() else notes), blocks
