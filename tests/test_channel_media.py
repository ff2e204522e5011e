"""Images and documents sent to the chat bridges (``agentloop.channels.media``), against the fakes of
``test_channel_telegram``, ``test_channel_whatsapp`` and ``test_channel_discord``, each extended to
serve files: Telegram's ``getFile`` and ``/file/bot<token>/<path>``, Graph's ``GET /<media id>``
and the address it names, and a Discord CDN of its own (a second local server).

A file is served whole (bytes), or streamed (a number of bytes, in 64 KiB chunks, counted as they
are sent): what a bridge that stops at its limit leaves unread is never sent.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentloop.channels.botapi import BotApi
from agentloop.channels.discord import ATTACHMENT_URLS, _allowed, _attachment_base
from agentloop.channels.graph import GraphApi
from agentloop.channels.media import UNSUPPORTED, Attachment, FetchFailed, block_of, classify, default_text
from agentloop.messages import FileContent, ImageContent, TextContent, UserMessage
from agentloop.models.base import ModelRequest
from agentloop.process.media import MediaError
from tests import test_channel_discord as dc
from tests import test_channel_telegram as tg
from tests import test_channel_whatsapp as wa
from tests.fakes.http_server import ServerThread
from tests.image_support import png

PNG = png(320, 240)
SMALL_PNG = png(90, 68)
PDF = b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\ntrailer << /Root 1 0 R >>\n%%EOF\n"
CHUNK = 64 * 1024
HUGE = 64 * 1024 * 1024  # bytes a streamed file has: far more than any test's limit
LIMIT = 256 * 1024  # the bridges' max_file_bytes in the tests of the limit
until = tg.until


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Served:
    """Counts what a streamed file sent."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes = 0

    def stream(self, size: int) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            sent = 0
            while sent < size:
                part = b"\x00" * min(CHUNK, size - sent)
                sent += len(part)
                with self.lock:
                    self.bytes += len(part)
                yield part
                await asyncio.sleep(0)

        return StreamingResponse(chunks(), media_type="application/octet-stream")


def last_input(model: Any) -> UserMessage:
    requests: list[ModelRequest] = model.requests
    message = requests[-1].messages[-1]
    assert isinstance(message, UserMessage)
    return message


def log_text(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records) + caplog.text


# ------------------------------------------------------------------------------- the shared part


def test_what_the_kernel_takes_is_told_by_type_or_by_name() -> None:
    assert classify("image/jpeg") == ("image", "image/jpeg")
    assert classify("image/jpg") == ("image", "image/jpeg")
    assert classify("text/plain; charset=utf-8") == ("file", "text/plain")
    assert classify("application/octet-stream", "notes.md") == ("file", "text/markdown")
    assert classify(None, "report.PDF") == ("file", "application/pdf")
    assert classify("audio/ogg", "voice.ogg")[0] is None
    assert classify("video/mp4")[0] is None and classify("application/zip", "a.zip")[0] is None
    assert classify("application/octet-stream", "a.exe")[0] is None
    image = Attachment("image", "image/jpeg", "", "the photo", None, "x")
    assert block_of(image, PNG, LIMIT) == ImageContent(data=b64(PNG), mime_type="image/png")  # the bytes win
    with pytest.raises(MediaError, match="not a PNG"):
        block_of(image, b"GIF? no", LIMIT)
    with pytest.raises(MediaError, match="not a PDF"):
        block_of(Attachment("file", "application/pdf", "a.pdf", "a.pdf", None, "x"), b"PK\x03\x04", LIMIT)
    assert default_text([image]) == "(see the attached image)"
    assert default_text([image, Attachment("file", "application/pdf", "", "a", None, "")]) == "(see the attached files)"


async def test_where_files_may_be_fetched_from_and_no_error_names_a_token() -> None:
    cdn = [_attachment_base(u) for u in ATTACHMENT_URLS]
    assert _allowed("https://cdn.discordapp.com/attachments/1/2/a.png?ex=1&hm=2", cdn)
    assert _allowed("https://media.discordapp.net/attachments/1/2/a.png", cdn)
    for off in (
        "http://cdn.discordapp.com/attachments/1/2/a.png",  # not https
        "https://cdn.discordapp.com.evil.example/attachments/a.png",
        "https://user@cdn.discordapp.com/attachments/a.png",
        "https://cdn.discordapp.com:8443/attachments/a.png",
        "https://169.254.169.254/latest/meta-data",
        "file:///etc/passwd",
        "https://cdn.discordapp.com:99999/x",
    ):
        assert not _allowed(off, cdn), off
    graph = GraphApi(wa.ACCESS_TOKEN, wa.PHONE_ID)
    try:
        assert graph.media_allowed("https://lookaside.fbsbx.com/whatsapp_business/attachments/?mid=1&hash=2")
        assert graph.media_allowed("https://graph.facebook.com/v21.0/123")
        for off in ("http://lookaside.fbsbx.com/x", "https://fbsbx.com.evil.example/x", "https://evil.example/x"):
            assert not graph.media_allowed(off), off
        with pytest.raises(FetchFailed) as foreign:
            await graph.download("https://evil.example/x?token=abc", 100)
        assert not foreign.value.transient and wa.ACCESS_TOKEN not in str(foreign.value)
    finally:
        await graph.close()
    api = BotApi(tg.TOKEN, "http://127.0.0.1:9")
    try:
        with pytest.raises(FetchFailed) as down:
            await api.download("photos/file_1.jpg", 100)
        assert down.value.transient and tg.TOKEN not in str(down.value) and tg.SECRET not in str(down.value)
        for path in ("../etc/passwd", "/abs/path", "photos/../../x", "a?b", None):
            with pytest.raises(FetchFailed) as bad:
                await api.download(path, 100)
            assert not bad.value.transient
    finally:
        await api.close()


# ------------------------------------------------------------------------------- Telegram


class FilesTelegram(tg.FakeTelegram):
    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, tuple[str, bytes | int, int | None]] = {}  # file_id -> (path, content, declared size)
        self.downloads: list[str] = []
        self.download_failures: list[int] = []
        self.served = Served()
        self.app.router.routes.append(Route("/file/bot{token}/{path:path}", self.download, methods=["GET"]))

    def file(self, file_id: str, path: str, content: bytes | int, declared: int | None = None) -> None:
        self.files[file_id] = (path, content, declared)

    async def result(self, method: str, params: dict[str, Any], entry: tg.Call) -> Any:
        if method == "getFile":
            path, _, declared = self.files[params["file_id"]]
            found: dict[str, Any] = {"file_id": params["file_id"], "file_unique_id": "u", "file_path": path}
            if declared is not None:
                found["file_size"] = declared
            return found
        return await super().result(method, params, entry)

    async def download(self, request: Request) -> Response:
        path = request.path_params["path"]
        with self.lock:
            self.downloads.append(path)
            failure = self.download_failures.pop(0) if self.download_failures else None
        if request.path_params["token"] != self.token:
            return Response(b"Not Found", 404)
        if failure is not None:
            return Response(b"oops", failure)
        [content] = [c for p, c, _ in self.files.values() if p == path]
        if isinstance(content, int):
            return self.served.stream(content)
        return Response(content, media_type="application/octet-stream")

    def media(self, chat: int, user: int, update_id: int | None = None, **fields: Any) -> int:
        sender = {"id": user, "is_bot": False, "first_name": f"User{user}"}
        body = {"message_id": 1, "from": sender, "chat": {"id": chat, "type": "private"}, "date": 0, **fields}
        return self.add({"message": body}, update_id)


@pytest.fixture
def telegram() -> Iterator[FilesTelegram]:
    fake = FilesTelegram()
    with fake.server:
        yield fake


async def test_telegram_a_photo_with_a_caption_reaches_the_model_as_an_image_and_the_token_is_never_logged(
    tmp_path: Path, telegram: FilesTelegram, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    telegram.file("small", "photos/file_1.jpg", SMALL_PNG, len(SMALL_PNG))
    telegram.file("medium", "photos/file_2.jpg", PNG, len(PNG))
    telegram.file("large", "photos/file_3.jpg", HUGE, HUGE)  # past the limit: the largest that fits is taken
    sizes = [
        {"file_id": "small", "file_unique_id": "s", "width": 90, "height": 68, "file_size": len(SMALL_PNG)},
        {"file_id": "large", "file_unique_id": "l", "width": 2560, "height": 1920, "file_size": HUGE},
        {"file_id": "medium", "file_unique_id": "m", "width": 320, "height": 240, "file_size": len(PNG)},
    ]
    telegram.fail("getFile", (500, {"ok": False, "error_code": 500, "description": f"boom /bot{tg.TOKEN}/"}))
    telegram.download_failures.append(502)  # (each tried again, with the backoff)
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE], max_file_bytes=LIMIT) as (_, _, model):
        telegram.media(tg.ALICE, tg.ALICE, photo=sizes, caption="what is this?")
        await until(lambda: telegram.texts(tg.ALICE))
        assert telegram.texts(tg.ALICE) == ["seen: what is this?"]
        assert last_input(model).content == [
            TextContent(text="what is this?"),
            ImageContent(data=b64(PNG), mime_type="image/png"),
        ]
        assert [c.params["file_id"] for c in telegram.of("getFile")] == ["medium", "medium", "medium"]
        assert telegram.downloads == ["photos/file_2.jpg", "photos/file_2.jpg"]
    text = log_text(caplog)
    assert f"{telegram.url}/file/bot***/photos/file_2.jpg" in text  # httpx logged the download, masked
    assert "trying again" in text
    assert tg.TOKEN not in text and tg.SECRET not in text


async def test_telegram_a_pdf_document_arrives_as_a_file_and_an_image_document_as_an_image(
    tmp_path: Path, telegram: FilesTelegram
) -> None:
    telegram.file("doc", "documents/file_5.pdf", PDF, len(PDF))
    telegram.file("pic", "documents/file_6.png", PNG)
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE]) as (kernel, _, model):
        document = {"file_id": "doc", "file_unique_id": "d", "file_name": "report.pdf", "mime_type": "application/pdf"}
        telegram.media(tg.ALICE, tg.ALICE, document=document)
        await until(lambda: telegram.texts(tg.ALICE))
        assert last_input(model).content == [
            TextContent(text="(see the attached file)"),
            FileContent(data=b64(PDF), mime_type="application/pdf", name="report.pdf"),
        ]
        image = {"file_id": "pic", "file_unique_id": "p", "file_name": "shot.png", "mime_type": "image/png"}
        telegram.media(tg.ALICE, tg.ALICE, document=image, caption="and this")
        await until(lambda: len(telegram.texts(tg.ALICE)) == 2)
        assert last_input(model).content[1] == ImageContent(data=b64(PNG), mime_type="image/png")
        [record] = await kernel.processes()
        stored = sorted(p.suffix for p in (tmp_path / "var" / "media" / record.owner / record.pid).iterdir())
        assert stored == [".pdf", ".png"]  # kept as the kernel keeps media


async def test_telegram_voice_stickers_and_other_files_are_refused_and_start_no_run(
    tmp_path: Path, telegram: FilesTelegram
) -> None:
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE]) as (kernel, _, model):
        telegram.media(tg.ALICE, tg.ALICE, voice={"file_id": "v", "duration": 2, "mime_type": "audio/ogg"})
        telegram.media(tg.ALICE, tg.ALICE, sticker={"file_id": "s", "type": "regular"}, caption="look")
        zip_file = {"file_id": "z", "file_name": "a.zip", "mime_type": "application/zip"}
        telegram.media(tg.ALICE, tg.ALICE, document=zip_file, caption="unpack this")
        await until(lambda: len(telegram.texts(tg.ALICE)) == 3)
        assert telegram.texts(tg.ALICE) == [UNSUPPORTED] * 3
        assert "voice messages" in UNSUPPORTED
        assert model.requests == [] and await kernel.processes() == [] and telegram.of("getFile") == []


async def test_telegram_an_oversized_file_is_refused_without_being_read_whole(
    tmp_path: Path, telegram: FilesTelegram
) -> None:
    telegram.file("big", "documents/big.pdf", HUGE, HUGE)  # declared past the limit: not even looked up
    telegram.file("liar", "documents/liar.pdf", HUGE)  # not declared: streamed, and cut off
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE], max_file_bytes=LIMIT) as (kernel, _, model):
        big = {"file_id": "big", "file_name": "big.pdf", "mime_type": "application/pdf", "file_size": HUGE}
        telegram.media(tg.ALICE, tg.ALICE, document=big)
        await until(lambda: telegram.texts(tg.ALICE))
        assert telegram.texts(tg.ALICE) == ["Big.pdf is too large: I can take a file of up to 256 KiB."]
        assert telegram.of("getFile") == [] and telegram.downloads == []
        liar = {"file_id": "liar", "file_name": "liar.pdf", "mime_type": "application/pdf", "file_size": 10}
        telegram.media(tg.ALICE, tg.ALICE, document=liar, caption="read it")
        await until(lambda: len(telegram.texts(tg.ALICE)) == 2)
        assert telegram.texts(tg.ALICE)[1] == "Liar.pdf is too large: I can take a file of up to 256 KiB."
        assert telegram.downloads == ["documents/liar.pdf"]
        await asyncio.sleep(0.3)
        assert telegram.served.bytes < HUGE // 4  # the bridge stopped reading
        assert model.requests == [] and await kernel.processes() == []


async def test_telegram_a_file_that_cannot_be_fetched_is_reported_and_nothing_is_delivered(
    tmp_path: Path, telegram: FilesTelegram
) -> None:
    telegram.file("gone", "documents/gone.pdf", PDF)
    telegram.file("fake", "documents/fake.pdf", b"PK\x03\x04 not a pdf")
    telegram.download_failures.extend([500, 500, 500])  # every try fails
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE]) as (kernel, _, model):
        gone = {"file_id": "gone", "file_name": "gone.pdf", "mime_type": "application/pdf"}
        telegram.media(tg.ALICE, tg.ALICE, document=gone, caption="summarise")
        await until(lambda: telegram.texts(tg.ALICE))
        assert telegram.texts(tg.ALICE) == ["I could not fetch gone.pdf; please send it again."]
        assert len(telegram.downloads) == 3  # tried three times
        fake = {"file_id": "fake", "file_name": "fake.pdf", "mime_type": "application/pdf"}
        telegram.media(tg.ALICE, tg.ALICE, document=fake)
        await until(lambda: len(telegram.texts(tg.ALICE)) == 2)
        refused = telegram.texts(tg.ALICE)[1]
        assert refused.startswith("Fake.pdf was refused:") and "not a PDF" in refused
        assert model.requests == [] and await kernel.processes() == []


async def test_telegram_a_redelivered_photo_is_admitted_once_and_not_downloaded_again(
    tmp_path: Path, telegram: FilesTelegram
) -> None:
    telegram.file("p", "photos/p.jpg", PNG)
    photo = [{"file_id": "p", "file_unique_id": "p", "width": 320, "height": 240}]
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE]) as (kernel, bridge, model):
        first = telegram.media(tg.ALICE, tg.ALICE, photo=photo, caption="once")
        await until(lambda: telegram.texts(tg.ALICE))
        await until(lambda: bridge.state.offset == first + 1)
        [record] = await kernel.processes()
    # a crash after the admission, before the offset was saved: Telegram sends the update again
    state = tmp_path / "var" / "telegram" / "4242.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "offset": first}))
    telegram.media(tg.ALICE, tg.ALICE, update_id=first, photo=photo, caption="once")
    async with tg.running(tmp_path, telegram, allow=[tg.ALICE], model=model) as (kernel, bridge, _):
        await until(lambda: bridge.state.offset == first + 1)
        telegram.message(chat=tg.ALICE, user=tg.ALICE, text="next")
        await until(lambda: len(telegram.texts(tg.ALICE)) == 2)
        history = [m.text for m in await (await kernel.process(record.pid)).messages() if isinstance(m, UserMessage)]
        assert history == ["once", "next"]
        assert telegram.downloads == ["photos/p.jpg"]


# ------------------------------------------------------------------------------- WhatsApp


class FilesGraph(wa.FakeGraph):
    def __init__(self) -> None:
        super().__init__()
        self.media: dict[str, tuple[bytes | int, str, int | None, str | None]] = {}
        self.lookups: list[str] = []
        self.downloads: list[tuple[str, str | None]] = []  # (media id, the Authorization it came with)
        self.served = Served()
        routes = self.app.router.routes
        routes.insert(0, Route("/lookaside/{id}", self.download, methods=["GET"]))
        routes.append(Route("/{version}/{media_id}", self.lookup, methods=["GET"]))

    def add_media(
        self, media_id: str, content: bytes | int, mime: str, declared: int | None = None, url: str | None = None
    ) -> None:
        self.media[media_id] = (content, mime, declared, url)

    async def lookup(self, request: Request) -> Response:
        media_id = request.path_params["media_id"]
        with self.lock:
            self.lookups.append(media_id)
        if request.headers.get("authorization") != f"Bearer {wa.ACCESS_TOKEN}":
            return JSONResponse({"error": {"message": "Invalid OAuth access token.", "code": 190}}, 401)
        if media_id not in self.media:
            return JSONResponse({"error": {"message": "Unsupported get request.", "code": 100}}, 400)
        _, mime, declared, url = self.media[media_id]
        answer: dict[str, Any] = {"messaging_product": "whatsapp", "id": media_id, "mime_type": mime, "sha256": "x"}
        answer["url"] = url or f"{self.url}/lookaside/{media_id}"
        if declared is not None:
            answer["file_size"] = str(declared)
        return JSONResponse(answer)

    async def download(self, request: Request) -> Response:
        media_id = request.path_params["id"]
        with self.lock:
            self.downloads.append((media_id, request.headers.get("authorization")))
        if request.headers.get("authorization") != f"Bearer {wa.ACCESS_TOKEN}":
            return Response(b"", 401)
        content = self.media[media_id][0]
        if isinstance(content, int):
            return self.served.stream(content)
        return Response(content, media_type="application/octet-stream")


@pytest.fixture
def graph() -> Iterator[FilesGraph]:
    fake = FilesGraph()
    with fake.server:
        yield fake


async def test_whatsapp_an_image_and_a_pdf_reach_the_model_and_the_token_is_never_logged(
    tmp_path: Path, graph: FilesGraph, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    graph.add_media("1001", PNG, "image/png", len(PNG))
    graph.add_media("1002", PDF, "application/pdf")
    async with wa.running(tmp_path, graph, allow=[wa.ALICE]) as (_, _, model, meta):
        image = {"id": "1001", "mime_type": "image/png", "sha256": "x", "caption": "what is this?"}
        await meta.send(wa.ALICE, {"type": "image", "image": image})
        await until(lambda: graph.texts(wa.ALICE))
        assert graph.texts(wa.ALICE) == ["seen: what is this?"]
        assert last_input(model).content == [
            TextContent(text="what is this?"),
            ImageContent(data=b64(PNG), mime_type="image/png"),
        ]
        document = {"id": "1002", "mime_type": "application/pdf", "filename": "report.pdf"}
        await meta.send(wa.ALICE, {"type": "document", "document": document})
        await until(lambda: len(graph.texts(wa.ALICE)) == 2)
        assert last_input(model).content == [
            TextContent(text="(see the attached file)"),
            FileContent(data=b64(PDF), mime_type="application/pdf", name="report.pdf"),
        ]
        assert graph.lookups == ["1001", "1002"]
        assert graph.downloads == [("1001", f"Bearer {wa.ACCESS_TOKEN}"), ("1002", f"Bearer {wa.ACCESS_TOKEN}")]
    text = log_text(caplog)
    assert "HTTP Request: GET" in text and "/lookaside/1001" in text
    for secret in (wa.ACCESS_TOKEN, wa.APP_SECRET, wa.VERIFY_TOKEN):
        assert secret not in text


async def test_whatsapp_voice_is_refused_a_large_file_is_not_read_whole_and_a_foreign_address_is_not_fetched(
    tmp_path: Path, graph: FilesGraph
) -> None:
    graph.add_media("2001", HUGE, "application/pdf", HUGE)  # declared past the limit
    graph.add_media("2002", HUGE, "application/pdf")  # not declared: cut off while read
    foreign = f"http://localhost:{graph.server.port}/lookaside/2003"  # (another host: no token goes there)
    graph.add_media("2003", PNG, "image/png", url=foreign)
    async with wa.running(tmp_path, graph, allow=[wa.ALICE], max_file_bytes=LIMIT) as (kernel, _, model, meta):
        await meta.send(wa.ALICE, {"type": "audio", "audio": {"id": "2000", "mime_type": "audio/ogg", "voice": True}})
        await until(lambda: graph.texts(wa.ALICE))
        assert graph.texts(wa.ALICE) == [UNSUPPORTED] and graph.lookups == []
        await meta.send(wa.ALICE, {"type": "document", "document": {"id": "2001", "mime_type": "application/pdf"}})
        await until(lambda: len(graph.texts(wa.ALICE)) == 2)
        assert graph.texts(wa.ALICE)[1] == "The document is too large: I can take a file of up to 256 KiB."
        assert graph.downloads == []  # refused on the size Graph declared
        await meta.send(wa.ALICE, {"type": "document", "document": {"id": "2002", "mime_type": "application/pdf"}})
        await until(lambda: len(graph.texts(wa.ALICE)) == 3)
        assert graph.texts(wa.ALICE)[2] == "The document is too large: I can take a file of up to 256 KiB."
        await asyncio.sleep(0.3)
        assert [d for d, _ in graph.downloads] == ["2002"] and graph.served.bytes < HUGE // 4
        await meta.send(wa.ALICE, {"type": "image", "image": {"id": "2003", "mime_type": "image/png"}})
        await until(lambda: len(graph.texts(wa.ALICE)) == 4)
        assert graph.texts(wa.ALICE)[3] == "I could not fetch the image; please send it again."
        assert [d for d, _ in graph.downloads] == ["2002"]  # never asked for, with or without the token
        assert model.requests == [] and await kernel.processes() == []


# ------------------------------------------------------------------------------- Discord


class FakeCdn:
    """Discord's CDN: serves attachments under /attachments/, and records every request (with its
    headers) to any path."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.files: dict[str, bytes | int] = {}
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.served = Served()
        self.server = ServerThread(Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET"])]))
        self.url = self.server.url

    def add(self, name: str, content: bytes | int) -> str:
        self.files[name] = content
        return f"{self.url}/attachments/1/2/{name}?ex=1&is=2&hm=abc"

    async def handle(self, request: Request) -> Response:
        path = request.path_params["path"]
        with self.lock:
            self.requests.append((path, dict(request.headers)))
        name = path.rsplit("/", 1)[-1]
        if not path.startswith("attachments/") or name not in self.files:
            return Response(b"Not Found", 404)
        content = self.files[name]
        if isinstance(content, int):
            return self.served.stream(content)
        return Response(content, media_type="application/octet-stream")

    def paths(self) -> list[str]:
        with self.lock:
            return [p for p, _ in self.requests]


@pytest.fixture
def discord() -> Iterator[dc.FakeDiscord]:
    with dc.FakeDiscord() as fake:
        yield fake


@pytest.fixture
def cdn() -> Iterator[FakeCdn]:
    fake = FakeCdn()
    with fake.server:
        yield fake


def attachment(url: str, name: str, content_type: str | None, size: int) -> dict[str, Any]:
    found = {"id": "1", "filename": name, "size": size, "url": url, "proxy_url": url}
    if content_type is not None:
        found["content_type"] = content_type
    return found


def post(fake: dc.FakeDiscord, channel: int, user: int, text: str, files: list[dict[str, Any]], **extra: Any) -> None:
    message: dict[str, Any] = {
        "id": str(fake.next_id()),
        "channel_id": str(channel),
        "author": {"id": str(user), "username": f"user{user}", "global_name": f"User{user}", "bot": False},
        "content": text,
        "mentions": [],
        "type": 0,
        "attachments": files,
        **extra,
    }
    with fake.lock:
        fake.history.setdefault(channel, []).append(message)
    fake.gateway.dispatch("MESSAGE_CREATE", message)


async def test_discord_attachments_reach_the_model_from_the_cdn_without_the_token(
    tmp_path: Path, discord: dc.FakeDiscord, cdn: FakeCdn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    bases = (f"{cdn.url}/attachments/",)
    image = attachment(cdn.add("cat.png", PNG), "cat.png", "image/png", len(PNG))
    pdf = attachment(cdn.add("report.pdf", PDF), "report.pdf", None, len(PDF))  # (type judged by the name)
    async with dc.running(tmp_path, discord, allow=[dc.ALICE], attachment_urls=bases) as (_, _, model):
        post(discord, dc.ALICE_DM, dc.ALICE, "what are these?", [image, pdf])
        await until(lambda: discord.texts(dc.ALICE_DM))
        assert discord.texts(dc.ALICE_DM) == ["seen: what are these?"]
        assert last_input(model).content == [
            TextContent(text="what are these?"),
            ImageContent(data=b64(PNG), mime_type="image/png"),
            FileContent(data=b64(PDF), mime_type="application/pdf", name="report.pdf"),
        ]
        assert cdn.paths() == ["attachments/1/2/cat.png", "attachments/1/2/report.pdf"]
        assert all("authorization" not in headers for _, headers in cdn.requests)  # the CDN gets no token
        post(discord, dc.ALICE_DM, dc.ALICE, "", [image])  # no text: a default one
        await until(lambda: len(discord.texts(dc.ALICE_DM)) == 2)
        assert last_input(model).content[0] == TextContent(text="(see the attached image)")
    text = log_text(caplog)
    assert "cat.png" in text and dc.TOKEN not in text and dc.SECRET not in text


async def test_discord_refuses_voice_oversized_files_and_addresses_off_the_cdn(
    tmp_path: Path, discord: dc.FakeDiscord, cdn: FakeCdn
) -> None:
    bases = (f"{cdn.url}/attachments/",)
    voice = attachment(cdn.add("voice-message.ogg", b"OggS"), "voice-message.ogg", "audio/ogg", 4)
    big = attachment(cdn.add("big.png", HUGE), "big.png", "image/png", HUGE)
    liar = attachment(cdn.add("liar.png", HUGE), "liar.png", "image/png", 100)
    foreign = attachment(f"{cdn.url}/elsewhere/x.png", "x.png", "image/png", len(PNG))
    other_host = attachment(f"http://localhost:{cdn.server.port}/attachments/1/2/cat.png", "y.png", "image/png", 9)
    kw: dict[str, Any] = {"attachment_urls": bases, "max_file_bytes": LIMIT}
    async with dc.running(tmp_path, discord, allow=[dc.ALICE], **kw) as (kernel, _, model):
        post(discord, dc.ALICE_DM, dc.ALICE, "", [voice], flags=1 << 13)
        await until(lambda: discord.texts(dc.ALICE_DM))
        assert discord.texts(dc.ALICE_DM) == [UNSUPPORTED]
        post(discord, dc.ALICE_DM, dc.ALICE, "", [], sticker_items=[{"id": "1", "name": "wave", "format_type": 1}])
        await until(lambda: len(discord.texts(dc.ALICE_DM)) == 2)
        assert discord.texts(dc.ALICE_DM)[1] == UNSUPPORTED
        post(discord, dc.ALICE_DM, dc.ALICE, "look", [big])
        await until(lambda: len(discord.texts(dc.ALICE_DM)) == 3)
        assert discord.texts(dc.ALICE_DM)[2] == "Big.png is too large: I can take a file of up to 256 KiB."
        assert cdn.paths() == []  # refused on the size Discord declared
        post(discord, dc.ALICE_DM, dc.ALICE, "look", [liar])
        await until(lambda: len(discord.texts(dc.ALICE_DM)) == 4)
        assert discord.texts(dc.ALICE_DM)[3] == "Liar.png is too large: I can take a file of up to 256 KiB."
        await asyncio.sleep(0.3)
        assert cdn.paths() == ["attachments/1/2/liar.png"] and cdn.served.bytes < HUGE // 4
        post(discord, dc.ALICE_DM, dc.ALICE, "look", [foreign])
        post(discord, dc.ALICE_DM, dc.ALICE, "look", [other_host])
        await until(lambda: len(discord.texts(dc.ALICE_DM)) == 6)
        assert discord.texts(dc.ALICE_DM)[4:] == [
            "I could not fetch x.png; please send it again.",
            "I could not fetch y.png; please send it again.",
        ]
        five = [attachment(cdn.add(f"{n}.png", PNG), f"{n}.png", "image/png", len(PNG)) for n in range(5)]
        post(discord, dc.ALICE_DM, dc.ALICE, "many", five)
        await until(lambda: len(discord.texts(dc.ALICE_DM)) == 7)
        assert discord.texts(dc.ALICE_DM)[6] == "Send at most 4 files in one message."
        assert cdn.paths() == ["attachments/1/2/liar.png"]  # nothing off the CDN was ever asked for
        assert model.requests == [] and await kernel.processes() == []
