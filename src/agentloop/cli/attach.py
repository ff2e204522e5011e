"""``/attach PATH`` in ``agentloop chat``: a local file made into the image or document block the
next message carries. The type is judged by the bytes (an image's or a PDF's magic numbers, else
UTF-8 text; the extension only tells Markdown and CSV from plain text), and the limits are the
media store's, so what is accepted here is accepted by the process too."""

from __future__ import annotations

import base64
from pathlib import Path

from agentloop.images import image_size, sniff_image
from agentloop.messages import PDF_MAGIC, FileContent, ImageContent, MediaBlock
from agentloop.process.media import DEFAULT_MAX_BYTES, MAX_TEXT_BYTES, decoded_size, text_fault

_TEXT_TYPES = {".md": "text/markdown", ".markdown": "text/markdown", ".csv": "text/csv"}


class AttachError(ValueError):
    """A file that cannot be attached; the message says why, in one line."""


def load_attachment(path: Path) -> MediaBlock:
    try:
        if not path.is_file():
            where = ""
            if not path.is_absolute() and not path.exists():
                # (not the workspace's: a user who chats about examples/demo may expect that)
                where = f" (no such file in the current directory, {Path.cwd()})"
            raise AttachError(f"{path} is not a file{where}")
        size = path.stat().st_size
        if size > DEFAULT_MAX_BYTES:
            raise AttachError(f"{path} is {size} bytes, over the {DEFAULT_MAX_BYTES}-byte limit")
        data = path.read_bytes()
    except OSError as exc:
        raise AttachError(f"cannot read {path}: {exc.strerror or exc}") from None
    encoded = base64.b64encode(data).decode("ascii")
    image = sniff_image(data)
    if image is not None:
        if image_size(data) is None:
            raise AttachError(f"{path} is a damaged image ({image}): its header does not give its size")
        return ImageContent(data=encoded, mime_type=image)
    if data.startswith(PDF_MAGIC):
        return FileContent(data=encoded, mime_type="application/pdf", name=path.name)
    fault = text_fault(data)
    if fault == "nul":
        raise AttachError(f"{path} is not an image, a PDF or a text file")
    if fault == "encoding":
        raise AttachError(f"{path} is not UTF-8 text (nor an image or a PDF)")
    if len(data) > MAX_TEXT_BYTES:
        raise AttachError(f"{path} is {len(data)} bytes of text, over the {MAX_TEXT_BYTES}-byte limit for text")
    return FileContent(data=encoded, mime_type=_TEXT_TYPES.get(path.suffix.lower(), "text/plain"), name=path.name)


def describe(block: MediaBlock) -> str:
    size = decoded_size(block.data)
    if isinstance(block, FileContent):
        return f"{block.name} ({block.mime_type}, {size} bytes)"
    return f"an image ({block.mime_type}, {size} bytes)"
