"""Images, documents and videos that users send to a chat bridge: what the kernel takes, how they
are fetched, and what the user is told when a file cannot be used.

A chat app hands a bot a reference to a file (Telegram a ``file_id``, WhatsApp a media id,
Discord a CDN URL), not its bytes. Each channel turns a message's files into ``Attachment`` (its
kind, declared type, name, size and the reference) and says how to fetch one (``_fetch``); the
rest is shared (``ChatBridge._deliver_files``):

- the kernel takes images (PNG, JPEG, GIF, WebP) and documents (PDF, plain text, Markdown, CSV);
  a video is taken as a note in its place (below); anything else (voice messages and audio
  without a transcriber, stickers, archives …) is refused with ``UNSUPPORTED`` and nothing reaches
  the process, not even the caption;
- at most ``MAX_FILES`` files a message; each at most the bridge's ``max_file_bytes`` (10 MiB by
  default, the kernel's own limit; a text document ``MAX_TEXT_BYTES``, as the kernel). A size the
  app declares past the limit is refused before any download; a download is streamed
  (``read_capped``) and stopped as soon as it passes the limit, so a file that lies about its size
  is never read whole;
- a download that fails is tried again with the channel's backoff (``FETCH_TRIES`` tries in all,
  and never for longer than ``FETCH_SECONDS`` each); when it still fails the user is told the file
  could not be fetched, and the message is not delivered at all: a caption without its picture
  would have the agent answer about a file it cannot see, and the user can simply send it again;
- the bytes are checked as the kernel checks them (``agentloop.process.media.check_media``: an
  image's magic and header, a PDF's magic, a text document's UTF-8) before anything is admitted, so
  the user learns at once what is wrong with a file.

The message is then admitted with the same run id as a text message of the channel: a
re-delivered message (a crash between the download and the admission, or after it) is admitted
once; one admitted already is not even downloaded again.

Voice messages and audio files are taken only when the bridge was given a ``Transcriber``
(``agentloop.models.transcribe`` is one: any OpenAI-compatible ``/v1/audio/transcriptions``). The
channel then makes them attachments of kind ``"audio"`` (``audio_type``), downloaded as any file
(the same limits and retries), and their transcript joins the text, marked as such
(``transcript_text``): the agent reads the words, not the sound. A transcription that fails (an
HTTP error, a timeout, an answer with no words) is told to the user (``not_transcribed``) and only
that file is left out: the rest of the message (the other files of an album, the caption with them)
still goes on; a message with nothing left is not delivered at all. Without a transcriber, a voice
message is refused with ``UNSUPPORTED``, as any file the kernel does not take.

A video (kind ``"video"``: a ``video/*`` type, or a video's suffix on a file of a generic type) is
given to the agent as the note the kernel gives a ``VideoContent`` in its place
(``process.audio_video.video_note``: name, type, size, and that it cannot be viewed), after the
text, as a transcript is (``video_text``). No model takes video, so its bytes are never downloaded:
every app says its type (and Telegram and Discord its name and size) in the message itself, and
what nobody reads is not fetched; a size the app does not say (WhatsApp's) is said to be unknown
rather than found out. For the same reason a video is held to neither the size limit nor
``MAX_FILES``: neither costs anything for a file that is not fetched. The words sent with a video
reach the agent with it, and a video alone still makes a run (the agent can say it cannot watch it,
where a refusal would have said nothing of the message).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal

import httpx

from agentloop.images import sniff_image
from agentloop.messages import FILE_TYPES, FileContent, ImageContent
from agentloop.process.audio_video import (
    GENERIC_TYPES,
    TRANSCRIBE_SECONDS,
    Transcriber,
    audio_type,
    clean_transcript,
    shown_name,
    video_note,
    video_type,
)
from agentloop.process.audio_video import audio_filename as _audio_filename
from agentloop.process.audio_video import transcript_text as _transcript_text
from agentloop.process.media import DEFAULT_MAX_BYTES, MAX_TEXT_BYTES, check_media

__all__ = [
    "FETCH_SECONDS",
    "FETCH_TRIES",
    "MAX_FILES",
    "TRANSCRIBE_SECONDS",
    "UNSUPPORTED",
    "Attachment",
    "FetchFailed",
    "TooLarge",
    "Transcriber",
    "audio_filename",
    "audio_type",
    "block_of",
    "classify",
    "clean_transcript",
    "default_text",
    "read_capped",
    "shown_name",
    "transcript_text",
    "video_attachment",
    "video_kind",
    "video_text",
]

MAX_FILE_BYTES = DEFAULT_MAX_BYTES  # bytes of one file (the kernel's media limit)
MAX_FILES = 4  # files of one message
FETCH_TRIES = 3  # times a download that failed for a reason that may pass is tried
FETCH_SECONDS = 120.0  # seconds one download may take in all (a server that trickles is cut off)

UNSUPPORTED = (
    "I can read text, images and PDF or text documents, and am told that a video was sent (I cannot "
    "watch it); voice messages, audio, stickers and other files are not supported."
)


def not_transcribed(what: str) -> str:
    """What the user is told when ``what`` ("the voice message") could not be transcribed."""
    return f"Sorry, I could not transcribe {what}; please try again, or write it as text."


def no_words(what: str) -> str:
    """What the user is told when ``what`` was transcribed to nothing."""
    return f"I could not make out any words in {what}; please try again, or write it as text."


IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg", "text/x-markdown": "text/markdown"}
_BY_SUFFIX = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".gif": "image/gif",
    ".webp": "image/webp",
    ".pdf": "application/pdf",
    ".txt": "text/plain",
    ".md": "text/markdown",
    ".markdown": "text/markdown",
    ".csv": "text/csv",
}
_GENERIC = GENERIC_TYPES  # (the types judged by the name's suffix: the kernel's, for audio and video too)

# ("audio": transcribed, where the bridge has a transcriber; "video": a note in its place, never fetched)
Kind = Literal["image", "file", "audio", "video"]


class FetchFailed(Exception):
    """A file that could not be downloaded; ``transient`` when asking again may help. The
    message never holds a token."""

    def __init__(self, reason: str, *, transient: bool = True) -> None:
        super().__init__(reason)
        self.transient = transient


class TooLarge(Exception):
    """A file past the limit (declared so, or found so while it was read)."""


@dataclass(frozen=True, slots=True)
class Attachment:
    """One file of a message. ``kind`` is None for a type the kernel does not take; ``mime`` the
    type it will be given as (for an image, the one its bytes show wins); ``what`` how the user is
    told about it ("the photo", "report.pdf"); ``size`` the bytes the app declares (None: not
    said); ``ref`` what the channel fetches it by."""

    kind: Kind | None
    mime: str
    name: str
    what: str
    size: int | None
    ref: str

    @property
    def text(self) -> bool:
        return self.kind == "file" and self.mime != "application/pdf"


def classify(mime: object, name: object = "") -> tuple[Kind | None, str]:
    """The kind and type of a file declared as ``mime`` and named ``name``: an image or a document
    the kernel takes, else ``(None, type)``. A missing or generic type is judged by the name's
    suffix (``notes.md`` sent as ``application/octet-stream``)."""
    declared = mime.split(";", 1)[0].strip().lower() if isinstance(mime, str) else ""
    declared = _ALIASES.get(declared, declared)
    if declared in _GENERIC and isinstance(name, str):
        declared = _BY_SUFFIX.get(PurePosixPath(name.lower()).suffix, declared)
    if declared in IMAGE_TYPES:
        return "image", declared
    if declared in FILE_TYPES:
        return "file", declared
    return None, declared


# The video type of a file declared as ``mime`` and named ``name``: the kernel's own rule
# (``process.audio_video.video_type``, a generic type judged by the name's suffix), so that a video a
# chat app sends is taken exactly when the same file sent to ``Process.send`` or the server would be.
video_kind = video_type


def video_attachment(mime: object, name: object, what: str, size: int | None, ref: str) -> Attachment:
    """A video an app sent as one (Telegram's ``video`` …, WhatsApp's ``video`` message), from what
    the message says of it, which is all its note needs: it is never downloaded. A type the
    message does not say (a round video message, a sender that gave none) is MP4, as the apps'
    own videos are."""
    return Attachment("video", video_type(mime, name) or "video/mp4", shown_name(name, ""), what, size, ref)


def video_text(attachment: Attachment) -> str:
    """What the agent reads in place of the video ``attachment``: the kernel's note for a
    ``VideoContent`` (``video_note``), so that a video reads the same whichever way it came. A
    size the app did not say is said to be unknown: finding it out would mean fetching a file
    nobody reads."""
    return video_note(attachment.name, attachment.mime, attachment.size)


def audio_filename(attachment: Attachment) -> str:
    """The name ``attachment`` is given to a transcriber as (``process.audio_video.audio_filename``)."""
    return _audio_filename(attachment.name, attachment.mime)


def transcript_text(attachment: Attachment, transcript: str) -> str:
    """The transcript of ``attachment`` as the agent reads it, marked as a transcription (the
    wording the kernel gives audio sent to a process too: ``process.audio_video.transcript_text``)."""
    return _transcript_text(attachment.what, transcript)


def default_text(attachments: Sequence[Attachment]) -> str:
    """What the input says when the user sent files (images, documents) without a caption (and
    nothing else stands for the text: a transcript, a video's note)."""
    if all(a.kind == "image" for a in attachments):
        return "(see the attached image)" if len(attachments) == 1 else "(see the attached images)"
    return "(see the attached file)" if len(attachments) == 1 else "(see the attached files)"


def cap_of(attachment: Attachment, max_bytes: int) -> int:
    """The most bytes ``attachment`` may have: a text document goes to the model whole."""
    return min(max_bytes, MAX_TEXT_BYTES) if attachment.text else max_bytes


def human(size: int) -> str:
    if size >= 1 << 20:
        return f"{size / (1 << 20):g} MiB"
    if size >= 1 << 10:
        return f"{size / (1 << 10):g} KiB"
    return f"{size} bytes"


def refusal(attachments: Sequence[Attachment], max_bytes: int) -> str | None:
    """Why the message's files cannot be taken, before any is fetched; None when they may be. A
    video is counted against neither limit: it is never fetched, only noted."""
    if any(a.kind is None for a in attachments):
        return UNSUPPORTED
    fetched = [a for a in attachments if a.kind != "video"]
    if len(fetched) > MAX_FILES:
        return f"Send at most {MAX_FILES} files in one message."
    for attachment in fetched:
        if attachment.size is not None and attachment.size > cap_of(attachment, max_bytes):
            return too_large(attachment, max_bytes)
    return None


def too_large(attachment: Attachment, max_bytes: int) -> str:
    limit = human(cap_of(attachment, max_bytes))
    what = "a text document" if attachment.text else "a file"
    return f"{attachment.what[:1].upper()}{attachment.what[1:]} is too large: I can take {what} of up to {limit}."


async def read_capped(response: httpx.Response, cap: int) -> bytes:
    """The body of a streamed ``response``, read only up to ``cap`` bytes: ``TooLarge`` as soon as
    it has more (or says so in ``Content-Length``), before the rest is read."""
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > cap:
        raise TooLarge(f"{length} bytes")
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > cap:
            raise TooLarge(f"more than {cap} bytes")
    return bytes(body)


async def fetch(
    client: httpx.AsyncClient, request: httpx.Request, cap: int, redact: Callable[[str], str] = str
) -> bytes:
    """GET ``request`` with ``client``, at most ``cap`` bytes (``read_capped``) and
    ``FETCH_SECONDS``: ``FetchFailed`` (transient for a network error, a 5xx and a 429; its reason
    passed through ``redact``) or ``TooLarge``."""
    try:
        async with asyncio.timeout(FETCH_SECONDS):
            response = await client.send(request, stream=True)
            try:
                status = response.status_code
                if status != 200:
                    transient = status >= 500 or status in (408, 429)
                    raise FetchFailed(f"the download was answered HTTP {status}", transient=transient)
                return await read_capped(response, cap)
            finally:
                await response.aclose()
    except TimeoutError:
        raise FetchFailed(f"the download took longer than {FETCH_SECONDS:.0f} s") from None
    except httpx.HTTPError as exc:  # connection refused, reset, timed out …
        reason = redact(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        raise FetchFailed(f"network error ({reason})") from None


def block_of(attachment: Attachment, data: bytes, max_bytes: int) -> ImageContent | FileContent:
    """The block ``data`` of ``attachment`` is given to the process as, checked as the kernel
    checks it (``MediaError`` says what is wrong). An image is given as the type its bytes show
    (a photo labelled PNG that is a JPEG is still a photo)."""
    encoded = base64.b64encode(data).decode("ascii")
    block: ImageContent | FileContent
    if attachment.kind == "image":
        block = ImageContent(data=encoded, mime_type=sniff_image(data[:16]) or attachment.mime)
    else:
        block = FileContent(data=encoded, mime_type=attachment.mime, name=attachment.name)
    check_media(block, max_bytes)
    return block
