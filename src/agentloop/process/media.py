"""Images and documents of a process, stored as files and referenced from message rows.

Base64 media inside message rows would make every history read carry megabytes, so a message
keeps a small ``MediaRef`` and the bytes live under ``var/media/<uid>/<pid>/``, named by their
SHA-256 (the same file sent twice is stored once). The declared MIME type is checked against
the bytes (an image's or a PDF's magic numbers, and an image's header; a text document must be
UTF-8 without NUL bytes), because providers reject a mislabelled or damaged file only at the next
model call, far from the client that sent it. The files belong to one process, so reset and kill drop the folder.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from agentloop.images import image_size, sniff_image
from agentloop.messages import FILE_TYPES, PDF_MAGIC, FileContent, ImageContent, MediaBlock
from agentloop.process.archive import check_name, fsync_dir, private_dir

DEFAULT_MAX_BYTES = 10 * 1024 * 1024
ORPHAN_AGE = 600.0  # seconds: a process's media directory younger than this is never swept
# A text document goes to the model whole, in the newest message, where compaction cannot fold
# it away: past about 50k tokens it would crowd out the conversation on most models.
MAX_TEXT_BYTES = 200 * 1024

_EXTENSIONS = {"image/png": "png", "image/jpeg": "jpg", "image/gif": "gif", "image/webp": "webp"}
_FILE_EXTENSIONS = {"application/pdf": "pdf", "text/plain": "txt", "text/markdown": "md", "text/csv": "csv"}
assert set(_FILE_EXTENSIONS) == set(FILE_TYPES)
_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg"}  # (a document's type is settled by FileContent)
_SHA256 = re.compile(r"[0-9a-f]{64}")


MEDIA_PREFIX = "media:"  # a media block whose data is this prefix + a MediaRef as JSON: stored as a file


class MediaError(ValueError):
    """An image or a document that cannot be stored or found."""


class MediaTooLarge(MediaError):
    pass


class MediaNotFound(MediaError):
    pass


def decoded_size(data: str) -> int:
    """The bytes that base64 ``data`` holds (3 per 4 characters, less the padding), undecoded."""
    return len(data) * 3 // 4 - data[-2:].count("=")


def decode_limited(data: str, kind: str, max_bytes: int) -> bytes:
    """``data`` (base64) decoded, at most ``max_bytes`` (``MediaTooLarge``), a huge payload refused
    by its length before it is decoded (4 characters per 3 bytes)."""
    if len(data) * 3 // 4 > max_bytes + 3:
        raise MediaTooLarge(f"{kind} is larger than the {max_bytes}-byte limit")
    try:
        decoded = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"{kind} data is not valid base64: {exc}") from None
    if len(decoded) > max_bytes:
        raise MediaTooLarge(f"{kind} is {len(decoded)} bytes, over the {max_bytes}-byte limit")
    return decoded


def text_fault(data: bytes) -> Literal["nul", "encoding"] | None:
    """Why ``data`` cannot be a text document: it holds NUL bytes (it is binary), or it is not
    UTF-8; None when it can."""
    if b"\x00" in data:
        return "nul"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "encoding"
    return None


def _check_document(data: bytes, mime: str, declared: str) -> None:
    if mime == "application/pdf":
        if not data.startswith(PDF_MAGIC):
            raise MediaError(f"file declared as {declared!r} is not a PDF")
        return
    fault = text_fault(data)
    if fault == "nul":
        raise MediaError(f"file declared as {declared!r} holds NUL bytes: it is not text")
    if fault == "encoding":
        raise MediaError(f"file declared as {declared!r} is not UTF-8 text")


@dataclass(frozen=True, slots=True)
class MediaRef:
    """Where a stored image or document is: ``path`` is relative to the data dir, ``size`` in bytes."""

    path: str
    mime_type: str
    size: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "mimeType": self.mime_type, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, data: Any) -> MediaRef:
        if not isinstance(data, dict):
            raise MediaError(f"media ref must be an object, got {type(data).__name__}")
        path, mime, size, sha = data.get("path"), data.get("mimeType"), data.get("size"), data.get("sha256")
        if not isinstance(path, str) or not isinstance(mime, str) or not isinstance(sha, str):
            raise MediaError(f"media ref needs string path, mimeType and sha256: {data!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise MediaError(f"media ref needs a non-negative integer size: {data!r}")
        if not _SHA256.fullmatch(sha):
            raise MediaError(f"media ref has an invalid sha256: {sha!r}")
        return cls(path=path, mime_type=mime, size=size, sha256=sha)

    def to_data(self) -> str:
        """What a message keeps in the ``data`` of the block this file stands for."""
        return MEDIA_PREFIX + json.dumps(self.to_dict())

    @classmethod
    def of(cls, block: ImageContent | FileContent) -> MediaRef:
        """The reference a stored block holds (see ``is_stored``); ``MediaError`` if it is broken."""
        try:
            data = json.loads(block.data[len(MEDIA_PREFIX) :])
        except ValueError as exc:
            raise MediaError(f"media ref is not JSON: {exc}") from None
        return cls.from_dict(data)


def is_stored(block: object) -> bool:
    """Whether ``block`` is an image or a document kept as a file (its data a ``MediaRef``)."""
    return isinstance(block, ImageContent | FileContent) and block.data.startswith(MEDIA_PREFIX)


def check_media(block: MediaBlock, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[bytes, str, str]:
    """The block's bytes, type and file extension; ``MediaError`` says why it is not what it says
    or too large (user input, and the images and documents in a device's tool results)."""
    kind = "image" if isinstance(block, ImageContent) else "file"
    known = _EXTENSIONS if kind == "image" else _FILE_EXTENSIONS
    declared = block.mime_type.strip().lower()
    mime = _ALIASES.get(declared, declared)
    ext = known.get(mime)
    if ext is None:
        raise MediaError(f"unsupported {kind} type {block.mime_type!r}; supported: {', '.join(known)}")
    data = decode_limited(block.data, kind, max_bytes)
    if kind == "file":
        if mime != "application/pdf" and len(data) > MAX_TEXT_BYTES:
            raise MediaTooLarge(f"a text document is {len(data)} bytes, over the {MAX_TEXT_BYTES}-byte limit")
        _check_document(data, mime, block.mime_type)
        return data, mime, ext
    actual = sniff_image(data)
    if actual is None:
        raise MediaError(f"image data is not a PNG, JPEG, GIF or WebP image (declared {block.mime_type!r})")
    if actual != mime:
        raise MediaError(f"image declared as {block.mime_type!r} but its bytes are {actual}")
    if image_size(data) is None:
        raise MediaError(f"image data is a damaged {mime} image: its header does not give its size")
    return data, mime, ext


class MediaStore:
    """Media files under ``<data_dir>/var/media``; every path it hands out is relative to ``data_dir``."""

    def __init__(self, data_dir: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.data_dir = Path(data_dir)
        self.root = self.data_dir / "var" / "media"
        self.max_bytes = max_bytes

    def process_dir(self, uid: str, pid: str) -> Path:
        return self.root / check_name(uid, "uid") / check_name(pid, "pid")

    def check(self, block: MediaBlock) -> tuple[bytes, str, str]:
        """The block's bytes, type and file extension; ``MediaError`` says why it cannot be stored."""
        return check_media(block, self.max_bytes)

    def save(self, uid: str, pid: str, block: MediaBlock) -> MediaRef:
        """Store ``block`` (once per content) and return its reference. A copy already there is
        kept only if it is intact: sending a file again is how a damaged copy gets mended."""
        directory = self.process_dir(uid, pid)
        data, mime, ext = self.check(block)
        sha = hashlib.sha256(data).hexdigest()
        path = directory / f"{sha}.{ext}"
        try:
            _read_verified(path, len(data), sha)
        except MediaError:
            directory = private_dir(self.data_dir, "var", "media", uid, pid)
            fd, tmp_name = tempfile.mkstemp(prefix=f".{sha[:16]}.", suffix=".tmp", dir=directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp_name, path)
            except BaseException:
                Path(tmp_name).unlink(missing_ok=True)
                raise
            # the message that references the file is committed next: the rename must be on disk
            fsync_dir(directory)
        rel = path.relative_to(self.data_dir).as_posix()
        return MediaRef(path=rel, mime_type=mime, size=len(data), sha256=sha)

    def _resolve(self, ref: MediaRef) -> Path:
        rel = PurePosixPath(ref.path)
        if rel.is_absolute() or ".." in rel.parts or rel.parts[:2] != ("var", "media"):
            raise MediaError(f"media ref {ref.path!r} is outside the media store")
        return self.data_dir.joinpath(*rel.parts)

    def load(self, ref: MediaRef, name: str = "") -> MediaBlock:
        """The image (or the document, called ``name``) back, verified against the ref's hash."""
        data = _read_verified(self._resolve(ref), ref.size, ref.sha256, ref)
        encoded = base64.b64encode(data).decode("ascii")
        if ref.mime_type in _FILE_EXTENSIONS:
            return FileContent(data=encoded, mime_type=ref.mime_type, name=name)
        return ImageContent(data=encoded, mime_type=ref.mime_type)

    def delete_process(self, uid: str, pid: str) -> int:
        """Remove every file of one process; returns how many were removed."""
        directory = self.process_dir(uid, pid)
        if not directory.is_dir():
            return 0
        count = sum(1 for p in directory.rglob("*") if p.is_file() and not p.name.endswith(".tmp"))
        shutil.rmtree(directory)
        return count

    def settled_dirs(self, older_than: float = ORPHAN_AGE) -> list[tuple[str, str]]:
        """(owner, pid) of every process directory untouched for ``older_than`` seconds: the ones
        ``Kernel.open`` checks for a process that no longer exists. A kill deletes the process,
        then its files, so a crash in between leaves them behind with nothing pointing at them
        (as does one between a spawn's files and its commit). A younger directory may belong to a
        process being created right now (on a shared store, by another worker in the same data
        directory)."""
        cutoff = time.time() - older_than
        found: list[tuple[str, str]] = []
        try:
            owners = [d for d in self.root.iterdir() if d.is_dir() and not d.is_symlink()]
            for owner in owners:
                for directory in owner.iterdir():
                    info = directory.lstat()
                    if stat.S_ISDIR(info.st_mode) and info.st_mtime < cutoff:
                        found.append((owner.name, directory.name))
        except OSError:  # (no media yet, or a directory going away meanwhile: the next open looks again)
            pass
        return found


def _read_verified(path: Path, size: int, sha: str, ref: MediaRef | None = None) -> bytes:
    """The bytes of the regular file ``path`` if they are the ``size`` bytes hashing to ``sha``.
    Every way a stored file can go bad is a ``MediaError`` (``MediaNotFound`` when it is gone),
    never an ``OSError``: the caller turns it into a note for the model instead of failing the
    run, and every later one. A file of another size (or a folder, a FIFO) is not read at all."""
    what = f"media {ref.path} ({ref.mime_type}, sha256 {sha})" if ref is not None else f"media {path}"
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            raise MediaError(f"{what} is not the {size}-byte file it was: the file is corrupt")
        data = path.read_bytes()
    except FileNotFoundError:
        raise MediaNotFound(f"{what} is missing") from None
    except OSError as exc:
        raise MediaError(f"{what} is unreadable: {exc.strerror or exc}") from None
    if hashlib.sha256(data).hexdigest() != sha:
        raise MediaError(f"{what} does not match its sha256: the file is corrupt")
    return data
