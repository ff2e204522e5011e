"""An image's type and size from its header (``agentloop.images``), and the refusal of damaged
images wherever one enters a conversation: a provider refuses such an image at every later call of
the conversation holding it, so it is stopped at the door instead."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from agentloop.cli.attach import AttachError, load_attachment
from agentloop.images import encoded_image_size, image_size, sniff_image
from agentloop.messages import ImageContent
from agentloop.process.media import MediaError, check_media
from agentloop.server.errors import ApiError
from agentloop.server.service import decode_media
from agentloop.tools.base import ToolError
from agentloop.tools.fs import read_file
from tests.image_support import gif, jpeg, png, webp

# 7×5 images as an imaging library writes them (a progressive JPEG with EXIF before its frame
# header, a lossless WebP, a WebP with alpha in the extended layout, a GIF and a PNG)
MADE = {
    "image/jpeg": "/9j/4AAQSkZJRgABAQAAAQABAAD/4QAsRXhpZgAATU0AKgAAAAgAAQEOAAIAAAAKAAAAGgAAAABhZ2VudGxvb3AA/9sAQwAIBgYH"
    "BgUIBwcHCQkICgwUDQwLCwwZEhMPFB0aHx4dGhwcICQuJyAiLCMcHCg3KSwwMTQ0NB8nOT04MjwuMzQy/9sAQwEJCQkMCwwYDQ0YMiEcITIy"
    "MjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIy/8IAEQgABQAHAwEiAAIRAQMRAf/EABUAAQEAAAAAAAAAAAAA"
    "AAAAAAAF/8QAFQEBAQAAAAAAAAAAAAAAAAAABAb/2gAMAwEAAhADEAAAAYADVf/EABQQAQAAAAAAAAAAAAAAAAAAAAD/2gAIAQEAAQUCf//EABQR"
    "AQAAAAAAAAAAAAAAAAAAAAD/2gAIAQMBAT8Bf//EABQRAQAAAAAAAAAAAAAAAAAAAAD/2gAIAQIBAT8Bf//EABQQAQAAAAAAAAAAAAAAAAAAAAD/"
    "2gAIAQEABj8Cf//EABQQAQAAAAAAAAAAAAAAAAAAAAD/2gAIAQEAAT8hf//aAAwDAQACAAMAAAAQ8//EABQRAQAAAAAAAAAAAAAAAAAAAAD/2gAI"
    "AQMBAT8Qf//EABQRAQAAAAAAAAAAAAAAAAAAAAD/2gAIAQIBAT8Qf//EABQQAQAAAAAAAAAAAAAAAAAAAAD/2gAIAQEAAT8Qf//Z",
    "image/webp": "UklGRh4AAABXRUJQVlA4TBEAAAAvBgABAAdQhSJXof+BiOh/AAA=",
    "image/webp+alpha": "UklGRkgAAABXRUJQVlA4WAoAAAAQAAAABgAABAAAQUxQSAoAAAABB1CyiAhERP8DVlA4IBgAAAAwAQCdASoHAAUAAUAm"
    "JaQAA3AA/v0gUAA=",
    "image/gif": "R0lGODdhBwAFAIEAAMgKCgAAAAAAAAAAACwAAAAABwAFAAAIDAABCBxIsKDBgwcDAgA7",
    "image/png": "iVBORw0KGgoAAAANSUhEUgAAAAcAAAAFCAIAAAAG+GGPAAAAFElEQVR4nGM8wcXFgAGYMIWoIgoAYCIA5sHZx4oAAAAASUVO"
    "RK5CYII=",
}
DAMAGED = b"\x89PNG\r\n\x1a\n" + bytes(40)  # the magic number, and nothing of the header that must follow


@pytest.mark.parametrize("kind", sorted(MADE))
def test_the_size_of_images_as_encoders_write_them(kind: str) -> None:
    data = base64.b64decode(MADE[kind])
    assert sniff_image(data) == kind.split("+")[0]
    assert image_size(data) == (7, 5)


@pytest.mark.parametrize("make", [png, jpeg, gif, webp])
def test_the_size_stated_in_each_header(make) -> None:  # type: ignore[no-untyped-def]
    assert image_size(make(1, 1)) == (1, 1)
    assert image_size(make(8001, 300)) == (8001, 300)
    assert image_size(make(0, 300)) is None and image_size(make(300, 0)) is None  # an image of no pixels


@pytest.mark.parametrize("kind", sorted(MADE))
def test_a_cut_short_image_never_raises_and_has_no_size_until_its_header_is_whole(kind: str) -> None:
    data = base64.b64decode(MADE[kind])
    sizes = [image_size(data[:n]) for n in range(len(data) + 1)]
    assert sizes[:10] == [None] * 10  # no format states its size in fewer bytes
    whole = next(n for n, s in enumerate(sizes) if s is not None)
    assert all(s == (7, 5) for s in sizes[whole:])  # once readable, the same answer for any longer cut


def test_the_size_of_an_encoded_image_decodes_only_what_it_needs() -> None:
    assert encoded_image_size(MADE["image/png"]) == (7, 5)
    assert encoded_image_size(MADE["image/jpeg"]) == (7, 5)  # its frame header is past the first bytes
    metadata = b"\xff\xe1" + (65535).to_bytes(2, "big") + bytes(65533)  # an EXIF segment at its largest
    photo = jpeg(640, 480)
    for segments in (1, 4):  # within the first look, and past it (the whole image is decoded)
        data = photo[:2] + metadata * segments + photo[2:]
        assert encoded_image_size(base64.b64encode(data).decode()) == (640, 480)
    assert encoded_image_size("not base64!") is None
    assert encoded_image_size(base64.b64encode(DAMAGED).decode()) is None


def test_a_file_that_only_starts_like_an_image_has_no_size() -> None:
    assert image_size(DAMAGED) is None
    assert image_size(b"\xff\xd8\xff\xe0" + bytes(10)) is None  # a JPEG with no frame header
    assert image_size(b"\xff\xd8\xff\xd9") is None  # a JPEG that ends at once
    assert image_size(b"RIFF\x10\x00\x00\x00WEBPVP8 " + bytes(16)) is None  # a WebP frame without its start code
    assert image_size(b"not an image at all") is None


def test_a_damaged_image_is_refused_where_it_would_be_stored() -> None:
    with pytest.raises(MediaError, match="damaged image/png"):
        check_media(ImageContent(data=base64.b64encode(DAMAGED).decode(), mime_type="image/png"))
    data, mime, _ = check_media(ImageContent(data=MADE["image/jpeg"], mime_type="image/jpeg"))
    assert mime == "image/jpeg" and image_size(data) == (7, 5)


def test_a_damaged_image_is_a_400_on_the_api() -> None:
    with pytest.raises(ApiError) as caught:
        decode_media([{"data": base64.b64encode(DAMAGED).decode(), "mime_type": "image/png"}])
    assert caught.value.status == 400 and "damaged" in str(caught.value)
    [block] = decode_media([{"data": MADE["image/png"], "mime_type": "image/png"}])
    assert isinstance(block, ImageContent)


async def test_reading_a_damaged_image_is_a_tool_error_the_model_sees(tmp_path: Path) -> None:
    (tmp_path / "broken.png").write_bytes(DAMAGED)
    with pytest.raises(ToolError, match=r"broken\.png is a damaged image"):
        await read_file(tmp_path, "broken.png")
    (tmp_path / "fine.png").write_bytes(base64.b64decode(MADE["image/png"]))
    assert isinstance((await read_file(tmp_path, "fine.png")).content[1], ImageContent)


def test_attaching_a_damaged_image_in_the_cli_says_so(tmp_path: Path) -> None:
    (tmp_path / "broken.png").write_bytes(DAMAGED)
    with pytest.raises(AttachError, match="damaged image"):
        load_attachment(tmp_path / "broken.png")
