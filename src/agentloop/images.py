"""What an image is, from its first bytes: its type (by magic number) and its size in pixels.

Providers refuse a damaged image, or one past their limits, only when the conversation holding it
is next sent, and then every later call of that conversation fails the same way. Reading the
header is enough to catch the usual cases (a truncated upload, a file that only starts like an
image, a photo too large for a provider) without an imaging library.
"""

from __future__ import annotations

import base64
import binascii
import struct

__all__ = ["encoded_image_size", "image_size", "sniff_image"]

# how much of an encoded image is decoded to find its size, in base64 characters: the first
# holds the header of a PNG, GIF or WebP; the second (192 KiB) gets past a JPEG's metadata
# segments, so a whole photo is decoded only in the rare case it does not
_HEAD_CHARS = (64, 256 * 1024)

_PNG = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers (the ones that carry the frame's size): C0-CF but DHT, JPG and DAC
_JPEG_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_BARE = frozenset((0x01, *range(0xD0, 0xD8)))  # markers without a length: TEM and the restarts
_JPEG_END = frozenset((0xD9, 0xDA))  # end of image, start of scan: no frame header past them


def sniff_image(head: bytes) -> str | None:
    """The MIME type of an image format models accept, judged by its magic bytes."""
    if head.startswith(_PNG):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if len(head) >= 12 and head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


def image_size(data: bytes) -> tuple[int, int] | None:
    """The image's (width, height) in pixels as its header states it; None when the header is
    missing, cut short or says zero (the image is damaged, or not the type its magic says)."""
    kind = sniff_image(data)
    try:
        if kind == "image/png":
            size = _png(data)
        elif kind == "image/jpeg":
            size = _jpeg(data)
        elif kind == "image/gif":
            size = _gif(data)
        elif kind == "image/webp":
            size = _webp(data)
        else:
            return None
    except (struct.error, IndexError, ValueError):  # the header ends early (or no marker follows)
        return None
    if size is None or size[0] <= 0 or size[1] <= 0:
        return None
    return size[0], size[1]


def encoded_image_size(data: str) -> tuple[int, int] | None:
    """``image_size`` of base64 ``data`` (an image block's), decoding only its start when that is
    enough: a provider adapter asks before every call, for every image of the history."""
    try:
        for chars in _HEAD_CHARS:
            size = image_size(base64.b64decode(data[:chars]))
            if size is not None or len(data) <= chars:
                return size
        return image_size(base64.b64decode(data))
    except (binascii.Error, ValueError):
        return None


def _png(data: bytes) -> tuple[int, int] | None:
    length, chunk = struct.unpack_from(">I4s", data, 8)
    if length != 13 or chunk != b"IHDR":  # the first chunk must be the header
        return None
    width, height = struct.unpack_from(">II", data, 16)
    return width, height


def _gif(data: bytes) -> tuple[int, int] | None:
    width, height, flags = struct.unpack_from("<HHB", data, 6)
    if width and height:
        return width, height
    # Some encoders leave the logical screen 0x0, and decoders (browsers, Pillow) then size the
    # image by its first frame: its descriptor follows the colour table and any extensions.
    at = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    while data[at] == 0x21:  # an extension (graphic control, comment, loop count): sub-blocks up to a 0
        at += 2
        while data[at]:
            at += data[at] + 1
        at += 1
    if data[at] != 0x2C:
        return None
    _, _, width, height = struct.unpack_from("<HHHH", data, at + 1)
    return width, height


def _jpeg(data: bytes) -> tuple[int, int] | None:
    at = 2
    while True:
        # The next marker: 0xFF, maybe fill bytes (more 0xFF), then its code. Stray bytes before
        # it, or a 0xFF followed by 0, are skipped as decoders do (libjpeg warns of "extraneous
        # bytes before marker" and shows the image): refusing them refused photos that display.
        at = data.index(0xFF, at) + 1  # (ValueError: no marker follows)
        while data[at] == 0xFF:
            at += 1
        marker = data[at]
        at += 1
        if marker in _JPEG_BARE or marker == 0:
            continue
        if marker in _JPEG_END:
            return None
        (length,) = struct.unpack_from(">H", data, at)
        if marker in _JPEG_FRAMES:
            height, width = struct.unpack_from(">HH", data, at + 3)
            return width, height
        if length < 2:
            return None
        at += length


def _webp(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8 ":  # lossy: a key frame's start code, then 14-bit sizes
        if data[23:26] != b"\x9d\x01\x2a":
            return None
        width, height = struct.unpack_from("<HH", data, 26)
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L":  # lossless: a signature byte, then two 14-bit sizes less one
        if data[20] != 0x2F:
            return None
        (bits,) = struct.unpack_from("<I", data, 21)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":  # extended: the canvas, in 24-bit sizes less one
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        return (width, height) if len(data) >= 30 else None
    return None
