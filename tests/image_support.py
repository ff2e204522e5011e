"""The smallest byte strings each image format's header reads as a real image (``agentloop.images``
checks the header, not the pixels), and a way to make one of any size."""

from __future__ import annotations

import struct


def png(width: int = 4, height: int = 3) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I4sII", 13, b"IHDR", width, height) + bytes(range(40))


def jpeg(width: int = 4, height: int = 3) -> bytes:
    app0 = b"\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    frame = b"\xff\xc0\x00\x11\x08" + struct.pack(">HH", height, width) + b"\x03" + bytes(9)
    return b"\xff\xd8" + app0 + frame + bytes(range(24))


def gif(width: int = 4, height: int = 3) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + bytes(14)


def webp(width: int = 4, height: int = 3) -> bytes:
    frame = b"\x00\x00\x00" + b"\x9d\x01\x2a" + struct.pack("<HH", width, height)
    return b"RIFF\x16\x00\x00\x00WEBPVP8 " + struct.pack("<I", len(frame)) + frame + bytes(8)


PNG, JPEG, GIF, WEBP = png(), jpeg(), gif(), webp()
