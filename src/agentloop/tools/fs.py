"""The file tools: Read, Write, Edit, Delete (syscalls ``fs.read``, ``fs.write``, ``fs.edit``,
``fs.delete``).

Each syscall is a plain coroutine taking the workspace root first (``read_file(root, path, …)``),
so a device can serve it without the model layer; ``*_tool(root)`` wraps one as a model-facing
``Tool``. Blocking file work runs in a worker thread so a large file does not stall the loop.
Every path goes through ``resolve_path``: nothing here touches a file outside the root.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import os
import secrets
import stat
import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, BinaryIO

from pydantic import Field

from agentloop.images import image_size, sniff_image
from agentloop.messages import PDF_MAGIC, FileContent, ImageContent, TextContent
from agentloop.stamps import open_regular
from agentloop.tools.base import FunctionTool, ToolError, ToolResult, tool, utf8
from agentloop.tools.paths import check_opened, display, real_root, resolve_path

__all__ = [
    "delete_file",
    "delete_tool",
    "edit_file",
    "edit_tool",
    "read_file",
    "read_tool",
    "write_file",
    "write_tool",
]

MAX_LINE_CHARS = 2000
_LINE_BYTES = 4 * MAX_LINE_CHARS  # of one line, read: enough for MAX_LINE_CHARS characters of any UTF-8
DEFAULT_LIMIT = 2000
_CHUNK = 1 << 20  # bytes read at a time where lines are only counted, not shown
# bytes after the page Read counts lines in for its "… N more lines" note: a log of many gigabytes
# would otherwise hold a worker thread (which no timeout can stop) for minutes, for a count
COUNT_BYTES = 256 * 1024 * 1024
MAX_IMAGE_BYTES = 10 * 1024 * 1024
# of a file Edit changes: it holds the file several times over (bytes, text, the edited text),
# in the server's memory; a larger one (a log, a data dump, a sparse file) is for Shell's tools
MAX_EDIT_BYTES = 32 * 1024 * 1024
_BINARY_PROBE = 8192
# Line checkpoints (``_LineMarks``): at least this many bytes apart in one file (half a counting
# chunk, so each chunk's end makes one), at most this many kept of one file, and of this many
# files (the least recently read forgotten first). A file of more than ``_MARKS_PER_FILE`` times
# ``_MARK_BYTES`` is marked more sparsely, never less than whole.
_MARK_BYTES = _CHUNK // 2
_MARKS_PER_FILE = 4096
_MARKED_FILES = 8

_IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".gif", ".webp"})


def _not_found(path: str) -> ToolError:
    return ToolError(f"File not found: {path}")


def _is_dir_error(path: str) -> ToolError:
    return ToolError(f"{path} is a directory; use Search to find files in it or Shell (ls) to list it")


def _open_regular(base: Path, real: Path, path: str) -> BinaryIO:
    """``real`` open for reading, if what was opened is a regular file inside the workspace.
    Callers checked it was one, but another process may have put a FIFO (or a link out) in its
    place since: a blocked open would hold a worker thread no cancellation can free."""
    try:
        f = open_regular(real)
    except FileNotFoundError:
        raise _not_found(path) from None
    except OSError as exc:
        raise ToolError(f"Cannot read {path}: {exc.strerror or exc}") from None
    try:
        check_opened(base, f.fileno(), path)
    except BaseException:
        f.close()
        raise
    return f


# ------------------------------------------------------------------ Read


def _read_sync(root: str | Path, path: str, offset: int, limit: int) -> ToolResult:
    base = real_root(root)
    real = resolve_path(root, path)
    if not real.exists():
        raise _not_found(path)
    if real.is_dir():
        raise _is_dir_error(path)
    if not real.is_file():  # a FIFO or device would block the reader forever
        raise ToolError(f"{path} is not a regular file")
    rel = display(base, real)
    with _open_regular(base, real, path) as f:
        head = f.read(_BINARY_PROBE)
        # an image or a PDF goes to the model whole, as a block of its own
        mime = sniff_image(head) or ("application/pdf" if head.startswith(PDF_MAGIC) else None)
        if mime is not None:
            what, noun = ("PDF", "a PDF") if mime == "application/pdf" else ("Image", "an image")
            size = os.fstat(f.fileno()).st_size
            if size > MAX_IMAGE_BYTES:
                raise ToolError(f"{path} is {noun} of {size} bytes, over the {MAX_IMAGE_BYTES}-byte limit")
            data = head + f.read()
            if what == "Image" and image_size(data) is None:  # a provider would refuse it, and every later call
                raise ToolError(f"{path} is a damaged image ({mime}): its header does not give its size")
            encoded = base64.b64encode(data).decode("ascii")
            block: ImageContent | FileContent = (
                FileContent(data=encoded, mime_type=mime, name=real.name)
                if what == "PDF"
                else ImageContent(data=encoded, mime_type=mime)
            )
            return ToolResult(
                [TextContent(text=f"{what} {rel} ({mime}, {len(data)} bytes)"), block],
                details={"path": rel, "mime_type": mime, "bytes": len(data)},
            )
        if b"\x00" in head:
            hint = (
                " (its extension says image, but its content is not one)"
                if real.suffix.lower() in _IMAGE_EXTENSIONS
                else ""
            )
            raise ToolError(f"{path} is a binary file{hint}; it cannot be read as text (try Shell with file or xxd)")
        return _read_text(f, str(real), rel, offset, limit)


# A version of one file: device and inode (another file put at the path), size, modification
# and change times (a rewrite in place; ctime moves with every write and cannot be set back)
FileStamp = tuple[int, int, int, int, int]
# bytes of a file's version kept to tell a later version that only grew from it (``_Version``):
# its first ones, and the last before its end
_SAMPLE_BYTES = 256


def _file_stamp(fd: int) -> FileStamp:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class _Version:
    """One version of a file: its stamp, and samples of its bytes by which a later version is
    known (as far as can be told without reading it all) to be this one with lines appended.

    A live log changes its stamp with every line written: checkpoints kept for one stamp only
    were dropped at each append, and paging through a growing log was quadratic again. Lines
    appended move no earlier line, so the checkpoints stay good while the file is the same one
    (device and inode), no smaller, and its first bytes and the last ones before this version's
    end are unchanged. A rewrite moves them (an edit inserting or deleting, a log truncated by
    copytruncate and grown past its old size: other lines at those places), and one that keeps
    the size is not an append at all."""

    __slots__ = ("samples", "stamp")

    def __init__(self, stamp: FileStamp, samples: tuple[tuple[int, bytes], ...] = ()) -> None:
        self.stamp = stamp
        self.samples = samples  # (byte position, the bytes there)

    @classmethod
    def of(cls, fd: int) -> _Version:
        """The version open as ``fd``. The samples are read before the stamp is taken: a file
        rewritten in between has samples of the older bytes, which the newer do not match (so
        its checkpoints are dropped), never the other way round."""
        size = os.fstat(fd).st_size
        spans = sorted({(0, min(size, _SAMPLE_BYTES)), (max(0, size - _SAMPLE_BYTES), size)})
        samples = tuple((start, os.pread(fd, end - start, start)) for start, end in spans if end > start)
        return cls(_file_stamp(fd), samples)

    def grown_into(self, fd: int | None) -> bool:
        """Whether the file open as ``fd`` is now this version, or this version with bytes
        appended. (Without ``fd``, or samples, only the same stamp is.)"""
        if fd is None:
            return False
        stamp = _file_stamp(fd)
        if stamp == self.stamp:
            return True
        if not self.samples or stamp[:2] != self.stamp[:2] or stamp[2] <= self.stamp[2]:
            return False  # another file, or one that shrank or changed without growing
        return all(os.pread(fd, len(sample), start) == sample for start, sample in self.samples)


class _Marks:
    """The checkpoints of one file: ``lines[i]`` starts at byte ``positions[i]``, in ``version``
    and in every version grown from it by appending."""

    __slots__ = ("gap", "lines", "positions", "version")

    def __init__(self, version: _Version, lines: list[int], positions: list[int], gap: int) -> None:
        self.version = version
        self.lines = lines
        self.positions = positions
        self.gap = gap  # the least bytes between two of them


class _LineMarks:
    """Where lines start, remembered from earlier Reads: a page at line ``offset`` is read from
    the last checkpoint at or before it instead of from the first byte, so paging through a log
    of gigabytes costs each page its own bytes, not all the bytes before it (quadratic).

    Bounded: ``files`` files (least recently used dropped), ``per_file`` checkpoints each (when a
    file has more, every other one goes and the spacing doubles, so the whole file stays marked).
    Checkpoints are kept with the version of the file they were found in (``_Version``), and
    dropped when the file read is another one, or was changed other than by appending to it
    (which, given the open file as ``fd``, is checked by reading the version's samples). Reads
    run in worker threads, several at once: every use holds the lock, and a Read gathers its new
    checkpoints apart and adds them once, at its end."""

    def __init__(self, files: int = _MARKED_FILES, per_file: int = _MARKS_PER_FILE) -> None:
        self._lock = threading.Lock()
        self._files: OrderedDict[str, _Marks] = OrderedDict()
        self._max_files = files
        self._per_file = per_file

    def _current(self, key: str, version: _Version, fd: int | None) -> _Marks | None:
        marks = self._files.get(key)
        if marks is None or marks.version.stamp == version.stamp:
            return marks
        if not marks.version.grown_into(fd):  # the file changed: its checkpoints are wrong
            del self._files[key]
            return None
        if version.samples and version.stamp[2] > marks.version.stamp[2]:
            marks.version = version  # (checked from now on by samples of this longer version)
        return marks

    def nearest(self, key: str, version: _Version, line: int, fd: int | None = None) -> tuple[int, int]:
        """(line number, byte position) of the last checkpoint at or before ``line`` of this
        version of the file; (1, 0), its start, when there is none."""
        with self._lock:
            marks = self._current(key, version, fd)
            if marks is None:
                return 1, 0
            self._files.move_to_end(key)
            i = bisect_right(marks.lines, line) - 1
            return (marks.lines[i], marks.positions[i]) if i >= 0 else (1, 0)

    def marks_of(self, key: str) -> list[tuple[int, int]]:
        with self._lock:
            marks = self._files.get(key)
            return [] if marks is None else list(zip(marks.lines, marks.positions, strict=True))

    def add(self, key: str, version: _Version, found: list[tuple[int, int]], fd: int | None = None) -> None:
        """Adds ``found`` (line number, byte position of its start) to this version's checkpoints."""
        if not found:
            return
        with self._lock:
            marks = self._current(key, version, fd)
            merged = sorted({*found, *(() if marks is None else zip(marks.lines, marks.positions, strict=True))})
            gap = _MARK_BYTES if marks is None else marks.gap
            while len(kept := self._thinned(merged, gap)) > self._per_file:
                gap *= 2
            self._files[key] = _Marks(version, [line for line, _ in kept], [pos for _, pos in kept], gap)
            self._files.move_to_end(key)
            while len(self._files) > self._max_files:
                self._files.popitem(last=False)

    @staticmethod
    def _thinned(marks: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
        kept: list[tuple[int, int]] = []
        for line, pos in marks:
            if not kept or pos - kept[-1][1] >= gap:
                kept.append((line, pos))
        return kept


_LINE_MARKS = _LineMarks()


class _Marker:
    """Gathers one Read's checkpoints: the start of the first line found at least
    ``_MARK_BYTES`` past the last one."""

    def __init__(self, position: int) -> None:
        self.found: list[tuple[int, int]] = []
        self._next = position + _MARK_BYTES

    def line_at(self, line: int, position: int) -> None:
        if position >= self._next:
            self.found.append((line, position))
            self._next = position + _MARK_BYTES


def _lines(f: BinaryIO) -> Iterator[tuple[bytes, int, int]]:
    """The file's lines, split at "\n" only (as Search, Edit and ``cat -n`` count them; a lone
    "\r" is not a line break), each cut to what a result can show, with its whole length (its
    line break left out) and the bytes it took (with it): a line of gigabytes (a minified
    bundle) is never held whole."""
    while raw := f.readline(_LINE_BYTES):
        last, size = raw, len(raw)
        while not last.endswith(b"\n") and (more := f.readline(_CHUNK)):  # (the rest only measured)
            last, size = more, size + len(more)
        ending = 2 if last.endswith(b"\r\n") else 1 if last.endswith(b"\n") else 0
        yield raw, size - ending, size


def _read_text(f: BinaryIO, key: str, rel: str, offset: int, limit: int) -> ToolResult:
    """Up to ``limit`` lines from line ``offset``, read from the nearest checkpoint before it
    (``_LineMarks``), and the lines after them counted.

    A page stops before the first line that holds a NUL byte. The file's first 8 KB held none
    (``_read_sync`` refuses it as binary otherwise), so this is text with something else later:
    a log a crash padded with zeros, a script with an archive appended. NULs are not text a
    model can use (and some providers refuse them), and hiding them, or swapping each for a
    mark, would show a page of binary as if it were text. So the text before is answered as
    usual, with a note that names the line and the offset to read on after it; a page that
    starts on such a line is refused like a binary file, with the same way on."""
    version = _Version.of(f.fileno())
    first, position = _LINE_MARKS.nearest(key, version, offset, f.fileno())
    f.seek(position)
    marker = _Marker(position)
    lines: list[str] = []
    binary_line: int | None = None
    total = first - 1
    for total, (raw, size, took) in enumerate(_lines(f), start=first):
        marker.line_at(total, position)
        position += took
        if offset <= total:
            text = raw.decode("utf-8", errors="replace").removesuffix("\n").removesuffix("\r")
            if len(text) > MAX_LINE_CHARS or size > len(raw.rstrip(b"\r\n")):
                text = text[:MAX_LINE_CHARS] + f"… [line truncated, {size} bytes]"
            if "\x00" in text:
                if not lines:
                    raise ToolError(
                        f"line {total} of {rel} holds NUL bytes: binary content that cannot be read as text;"
                        f" use offset={total + 1} to read on past it, or Shell (xxd) to see it"
                    )
                binary_line = total
                break
            lines.append(f"{total:>6}\t{text}")
            if len(lines) == limit:
                break
    rest, counted = _count_lines(f, total, position, marker)
    total += rest
    # kept if the file was not changed while it was read, or only grown (a live log): the
    # checkpoints found in the lines appended meanwhile are as good as the others
    end = _Version.of(f.fileno())
    if version.grown_into(f.fileno()):
        _LINE_MARKS.add(key, end, marker.found, f.fileno())
    details: dict[str, object] = {"path": rel, "offset": offset, "lines": len(lines), "total_lines": total}
    if total == 0:
        return ToolResult.text(f"({rel} is empty)", details=details)
    if offset > total:
        raise ToolError(f"offset {offset} is past the end of {rel}, which has {total} lines")
    out = "\n".join(lines)
    if binary_line is not None:
        details["binary_line"] = binary_line
        out += (
            f"\n… line {binary_line} holds NUL bytes: binary content, not shown;"
            f" use offset={binary_line + 1} to read on past it"
        )
        return ToolResult.text(out, details=details)
    remaining = total - (offset + len(lines) - 1)
    if not counted:
        size = os.fstat(f.fileno()).st_size
        details["total_lines"] = None
        out += (
            f"\n… at least {remaining} more lines (counted in the next {COUNT_BYTES} bytes of {size});"
            f" use offset={offset + len(lines)} to read on"
        )
    elif remaining > 0:
        out += f"\n… {remaining} more lines; use offset={offset + len(lines)} to read on"
    return ToolResult.text(out, details=details)


def _count_lines(f: BinaryIO, line: int, position: int, marker: _Marker) -> tuple[int, bool]:
    """The lines from ``f``'s position (``position``, the start of line ``line + 1``) to its end
    (a last one without a line break counts), read in chunks of ``_CHUNK``, and whether that is
    all of them: counting stops after ``COUNT_BYTES``, the count then a lower bound. The line
    after each chunk's last break is a checkpoint for ``marker``, which costs a search per chunk,
    not per line."""
    count, read, last = 0, 0, b"\n"
    while chunk := f.read(_CHUNK):
        breaks = chunk.count(b"\n")
        if breaks:
            marker.line_at(line + count + breaks + 1, position + read + chunk.rindex(b"\n") + 1)
        count += breaks
        read += len(chunk)
        last = chunk[-1:]
        if read >= COUNT_BYTES and f.read(1):
            return count, False
    return count + (last != b"\n"), True


async def read_file(root: str | Path, path: str, offset: int = 1, limit: int = DEFAULT_LIMIT) -> ToolResult:
    """``fs.read``: numbered text lines, an image or PDF block, or a ``ToolError``."""
    if offset < 1 or limit < 1:
        raise ToolError("offset and limit must be at least 1")
    return await asyncio.to_thread(_read_sync, root, path, offset, limit)


# ------------------------------------------------------------------ Write


_writers_guard = threading.Lock()
_writers: dict[Path, tuple[threading.Lock, int]] = {}  # a file's lock, and how many hold or await it


@contextlib.contextmanager
def _one_writer(real: Path) -> Iterator[None]:
    """Hold the file ``real`` for one Write or Edit at a time in this runtime. The calls of one
    model turn run concurrently (CodeMode's too): two Edits of one file each read it, made their
    change and wrote it back, and the second undid the first while both reported success. The
    lock is dropped when no call holds or awaits it. (Another runtime, a device or a command
    changing the file meanwhile is not held off: only the calls made here are.)"""
    with _writers_guard:
        lock, users = _writers.get(real, (threading.Lock(), 0))
        _writers[real] = (lock, users + 1)
    try:
        with lock:
            yield
    finally:
        with _writers_guard:
            lock, users = _writers[real]
            if users == 1:
                del _writers[real]
            else:
                _writers[real] = (lock, users - 1)


def _write_bytes(base: Path, real: Path, path: str, data: bytes) -> None:
    """Write all or nothing: the new content goes to a file beside the target, which then takes
    the target's place in one rename, with its mode and owner. A full disk or a crash halfway
    leaves the old file whole (truncating it first lost an edited file's original). Both happen
    in the directory as opened and checked to be inside the workspace, so a directory on the
    path swapped for a symlink meanwhile cannot send the write elsewhere; a symlink put in the
    target's place is replaced, never written through. A file with other hard links, or in a
    directory the runtime may not add files to, is written in place (a rename would cut the
    links, or is not possible); a file its owner made read-only is refused, as a write would be."""
    with _directory_of(base, real, path, make=True) as directory:
        name = real.name
        old = _lstat(name, directory)
        if old is not None and stat.S_ISLNK(old.st_mode):
            raise ToolError(f"Refusing to write {path}: it is a symlink")
        if old is not None and stat.S_ISDIR(old.st_mode):
            raise _is_dir_error(path)
        if old is not None and not stat.S_ISREG(old.st_mode):
            raise ToolError(f"{path} is not a regular file")
        if old is not None and not os.access(name, os.W_OK, dir_fd=directory):
            raise ToolError(f"Cannot write {path}: it is read-only")
        if old is not None and (old.st_nlink > 1 or not os.access(".", os.W_OK, dir_fd=directory)):
            _write_in_place(name, directory, path, data)
            return
        temporary = f".agentloop-{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=directory)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if old is None:
                    os.fchmod(f.fileno(), 0o666 & ~_umask())
                else:  # the file keeps its mode (an edited script stays executable) and its owner
                    with contextlib.suppress(PermissionError):
                        os.fchown(f.fileno(), old.st_uid, old.st_gid)
                    os.fchmod(f.fileno(), stat.S_IMODE(old.st_mode))
                os.fsync(f.fileno())
            os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=directory)
            raise ToolError(f"Cannot write {path}: {exc.strerror or exc} (the file is unchanged)") from None


def _write_in_place(name: str, directory: int, path: str, data: bytes) -> None:
    try:
        fd = os.open(name, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW, dir_fd=directory)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError as exc:
        raise ToolError(f"Cannot write {path}: {exc.strerror or exc}") from None


def _umask() -> int:
    """The process's umask (read by setting it, then setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _directory_of(base: Path, real: Path, path: str, *, make: bool = False) -> Iterator[int]:
    """The directory ``real`` is in, open and checked to be inside the workspace as opened; with
    ``make``, the directories missing on the way are made first.

    ``real`` has no symlink on the way (``resolve_path`` resolved them all), so each directory is
    made and entered relative to the one before it, never following a symlink: one put on the way
    by another process since the check would otherwise have the directories made (``mkdir -p``)
    outside the workspace before the open could be checked."""
    try:
        parts = real.parent.relative_to(base).parts
    except ValueError:  # (the root itself: callers refuse it first)
        raise ToolError(f"Path {path!r} is outside the workspace") from None
    try:
        directory = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise ToolError(f"Cannot reach {path}: {exc.strerror or exc}") from None
    try:
        for part in parts:
            if make:
                try:
                    os.mkdir(part, dir_fd=directory)
                except FileExistsError:
                    pass
                except OSError as exc:
                    raise ToolError(f"Cannot reach {path}: {exc.strerror or exc}") from None
            inner = _enter(directory, part, path)
            os.close(directory)
            directory = inner
        check_opened(base, directory, path)
        yield directory
    finally:
        os.close(directory)


def _enter(directory: int, name: str, path: str) -> int:
    """The directory ``name`` in ``directory``, open; a symlink there is refused, not followed."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=directory)
    except OSError as exc:
        try:
            link = stat.S_ISLNK(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        if link:
            raise ToolError(
                f"Path {path!r} could lead outside the workspace: {name!r} on it became a symlink after it was checked"
            ) from None
        raise ToolError(f"Cannot reach {path}: {exc.strerror or exc}") from None


def _lstat(name: str, directory: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _write_sync(root: str | Path, path: str, content: str) -> ToolResult:
    data = utf8(content, "content")
    base = real_root(root)
    real = resolve_path(root, path)
    if real.is_dir():  # (the root itself would otherwise be blamed on a directory that changed)
        raise _is_dir_error(path)
    if path.endswith(("/", os.sep)):  # a directory's name: the kernel's open says EISDIR, not "created"
        raise ToolError(f"{path} ends in '/', which names a directory; give the file's name to write it")
    with _one_writer(real):  # (an Edit of it under way would write back what it read, this lost)
        existed = real.exists()
        _write_bytes(base, real, path, data)
    rel = display(base, real)
    verb = "Overwrote" if existed else "Created"
    return ToolResult.text(f"{verb} {rel} ({len(data)} bytes)", details={"path": rel, "bytes": len(data)})


async def write_file(root: str | Path, path: str, content: str) -> ToolResult:
    """``fs.write``: create or overwrite a UTF-8 text file, making parent directories."""
    return await asyncio.to_thread(_write_sync, root, path, content)


# ------------------------------------------------------------------ Edit


def _edit_sync(root: str | Path, path: str, old_string: str, new_string: str, replace_all: bool) -> ToolResult:
    if old_string == "":
        raise ToolError("old_string is empty; to create or overwrite a file use Write")
    if old_string == new_string:
        raise ToolError("old_string and new_string are identical; nothing to change")
    base = real_root(root)
    real = resolve_path(root, path)
    with _one_writer(real):  # (read, change, write back: no other Write or Edit of it in between)
        if not real.exists():
            raise _not_found(path)
        if real.is_dir():
            raise _is_dir_error(path)
        if not real.is_file():
            raise ToolError(f"{path} is not a regular file")
        text = _text_for_edit(_read_for_edit(base, real, path), path)
        updated, count = _replace(text, path, old_string, new_string, replace_all)
        _write_bytes(base, real, path, utf8(updated, "new_string"))
    done = count if replace_all else 1
    rel = display(base, real)
    noun = "replacement" if done == 1 else "replacements"
    return ToolResult.text(f"Edited {rel}: {done} {noun}", details={"path": rel, "replacements": done})


def _text_for_edit(raw: bytes, path: str) -> str:
    if b"\x00" in raw[:_BINARY_PROBE]:
        raise ToolError(f"{path} is a binary file; Edit works on text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{path} is not UTF-8 text; Edit cannot change it safely") from None


def _replace(text: str, path: str, old_string: str, new_string: str, replace_all: bool) -> tuple[str, int]:
    """``text`` with the edit made, and how many times ``old_string`` occurs in it."""

    def crlf(text: str) -> str:
        return text.replace("\r\n", "\n").replace("\n", "\r\n")

    if "\r\n" in text and text.count("\r\n") == text.count("\n"):
        # The model writes "\n"; a Windows file has "\r\n" (every line): the edit takes the
        # file's convention, what it replaces and what it puts in alike
        old_string, new_string = crlf(old_string), crlf(new_string)
    elif "\r\n" in text and "\n" in old_string and old_string not in text:
        old_string, new_string = crlf(old_string), crlf(new_string)  # lines of a mixed file that end in CRLF
    count = text.count(old_string)
    if count == 1 and not replace_all and text.find(old_string, text.find(old_string) + 1) >= 0:
        count = 2  # overlapping occurrences ("end\nend\n" in "end\nend\nend\n"): not unique either
    if count == 0:
        raise ToolError(f"old_string was not found in {path}; Read the file and copy the text exactly")
    if count > 1 and not replace_all:
        raise ToolError(
            f"old_string occurs {count} times in {path}; add surrounding context to make it unique,"
            " or set replace_all=true to replace every occurrence"
        )
    updated = text.replace(old_string, new_string) if replace_all else text.replace(old_string, new_string, 1)
    return updated, count


def _read_for_edit(base: Path, real: Path, path: str) -> bytes:
    """The whole of the file Edit changes, if it is at most ``MAX_EDIT_BYTES``: judged before it
    is loaded, and again by what is read (it may grow meanwhile)."""
    with _open_regular(base, real, path) as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(MAX_EDIT_BYTES + 1) if size <= MAX_EDIT_BYTES else b""
    if size > MAX_EDIT_BYTES or len(raw) > MAX_EDIT_BYTES:
        raise ToolError(
            f"{path} is {max(size, len(raw))} bytes, over the {MAX_EDIT_BYTES}-byte limit of Edit;"
            " change it with Shell (sed, a script) instead"
        )
    return raw


async def edit_file(
    root: str | Path, path: str, old_string: str, new_string: str, replace_all: bool = False
) -> ToolResult:
    """``fs.edit``: exact string replacement, unique unless ``replace_all``."""
    return await asyncio.to_thread(_edit_sync, root, path, old_string, new_string, replace_all)


# ------------------------------------------------------------------ Delete


def _delete_sync(root: str | Path, path: str) -> ToolResult:
    base = real_root(root)
    real = resolve_path(root, path, follow_final=False)
    if real == base:
        raise ToolError("Refusing to delete the workspace root")
    rel = display(base, real)
    with _one_writer(real), _directory_of(base, real, path) as directory:  # (as opened: see ``_write_bytes``)
        found = _lstat(real.name, directory)
        if found is None:
            raise _not_found(path)
        try:
            if stat.S_ISDIR(found.st_mode):
                os.rmdir(real.name, dir_fd=directory)
            else:
                os.unlink(real.name, dir_fd=directory)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise ToolError(f"{path} is a directory that is not empty; delete its files first") from None
            raise ToolError(f"Cannot delete {path}: {exc.strerror}") from None
    if stat.S_ISDIR(found.st_mode):
        return ToolResult.text(f"Deleted empty directory {rel}", details={"path": rel, "kind": "directory"})
    kind = "file" if stat.S_ISREG(found.st_mode) or stat.S_ISLNK(found.st_mode) else "other"
    return ToolResult.text(f"Deleted {rel}", details={"path": rel, "kind": kind})


async def delete_file(root: str | Path, path: str) -> ToolResult:
    """``fs.delete``: a file, a symlink (not its target) or an empty directory; never the root."""
    return await asyncio.to_thread(_delete_sync, root, path)


# ------------------------------------------------------------------ model-facing tools


def read_tool(root: str | Path) -> FunctionTool:
    @tool(
        name="Read",
        description=(
            "Read a text file with line numbers (like cat -n), or view an image (png, jpeg, gif, webp) or a PDF. "
            f"Returns up to `limit` lines from line `offset`; lines over {MAX_LINE_CHARS} chars are truncated. "
            "Read a file before you Edit it."
        ),
        idempotent=True,
        # a page of a file already there to page through: a copy of it would only take a kept
        # output's room (and pruning might remove the very file being paged)
        keeps_cut_results=False,
    )
    async def read(
        path: str,
        offset: Annotated[int, Field(ge=1)] = 1,
        limit: Annotated[int, Field(ge=1)] = DEFAULT_LIMIT,
    ) -> ToolResult:
        """
        Args:
            path: File path relative to the workspace root.
            offset: First line to return (1-based).
            limit: Maximum number of lines to return.
        """
        return await read_file(root, path, offset, limit)

    return read


def write_tool(root: str | Path) -> FunctionTool:
    @tool(
        name="Write",
        description=(
            "Create or overwrite a text file with `content` (UTF-8), creating parent directories. "
            "Prefer Edit for changing part of an existing file."
        ),
    )
    async def write(path: str, content: str) -> ToolResult:
        """
        Args:
            path: File path relative to the workspace root.
            content: The complete new file content.
        """
        return await write_file(root, path, content)

    return write


def edit_tool(root: str | Path) -> FunctionTool:
    @tool(
        name="Edit",
        description=(
            "Replace an exact string in a file. `old_string` must match the file exactly (whitespace included) "
            "and occur once, unless replace_all is true. Read the file first."
        ),
    )
    async def edit(path: str, old_string: str, new_string: str, replace_all: bool = False) -> ToolResult:
        """
        Args:
            path: File path relative to the workspace root.
            old_string: The exact text to replace.
            new_string: The text to put in its place.
            replace_all: Replace every occurrence instead of requiring exactly one.
        """
        return await edit_file(root, path, old_string, new_string, replace_all)

    return edit


def delete_tool(root: str | Path) -> FunctionTool:
    @tool(
        name="Delete",
        description="Delete a file or an empty directory.",
    )
    async def delete(path: str) -> ToolResult:
        """
        Args:
            path: Path relative to the workspace root.
        """
        return await delete_file(root, path)

    return delete
