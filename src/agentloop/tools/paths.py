"""Resolving a model-supplied path to a real path inside a workspace root.

The model names files relative to the root; it must never reach outside it, neither with ``..``
nor with an absolute path nor through a symlink (one that exists now, or a dangling one that a
write would create through). Resolution walks the path one component at a time against the real
file system, resolving each symlink as it is met and checking that the result is still inside the
root, so ``link/..`` means what the kernel means by it. The returned path has every symlink
resolved, which is why callers operate on it rather than on the name the model gave.

These functions take the root explicitly and know nothing of models or tools: the same checks
guard the syscalls when they run on a device.
"""

from __future__ import annotations

import os
from pathlib import Path

from agentloop.tools.base import ToolError

__all__ = ["display", "real_root", "resolve_path"]


def real_root(root: str | Path) -> Path:
    """The root with its own symlinks resolved; it must exist and be a directory."""
    try:
        real = Path(root).expanduser().resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise ToolError(f"Workspace root {str(root)!r} is not available: {exc}") from None
    if not real.is_dir():
        raise ToolError(f"Workspace root {str(root)!r} is not a directory")
    return real


def _inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def _relative_parts(root: Path, given: Path, path: str) -> list[str]:
    """The components of ``path`` relative to the root, for an absolute or a relative path."""
    if "\x00" in path:
        raise ToolError(f"Invalid path {path!r}: contains a NUL byte")
    p = Path(path)
    if not p.is_absolute():
        return [part for part in p.parts if part not in ("", ".")]
    for base in (root, given):  # ".." is kept: the walk gives it the kernel's meaning
        if _inside(p, base):
            return list(p.relative_to(base).parts)
    raise ToolError(f"Path {path!r} is outside the workspace ({root}); use a path relative to it")


NAME_MAX = 255  # bytes in one file name (Linux, macOS)
PATH_MAX = 4096  # bytes in a whole path, its NUL included (Linux; macOS allows 1024)


def resolve_path(root: str | Path, path: str, *, follow_final: bool = True) -> Path:
    """The real path ``path`` names inside ``root``, or ``ToolError`` if it would leave the root.

    With ``follow_final=False`` a final symlink component is kept as the link itself (what Delete
    removes), though its target must still lie inside the root.
    """
    if not path.strip():
        raise ToolError("Path is empty; give a path relative to the workspace")
    try:
        os.fsencode(path)
    except UnicodeError:  # a lone surrogate: no file can have this name
        raise ToolError(f"Path {path!r} has characters no file name can hold") from None
    if any(len(os.fsencode(part)) > NAME_MAX for part in Path(path).parts):
        raise ToolError(f"Path {path!r} has a name longer than {NAME_MAX} bytes")
    base = real_root(root)
    given = Path(root).expanduser().absolute()
    parts = _relative_parts(base, given, path)
    current = base
    for i, part in enumerate(parts):
        if part == "..":
            current = current.parent
            if not _inside(current, base):
                raise ToolError(f"Path {path!r} escapes the workspace with '..'")
            continue
        candidate = current / part
        if len(os.fsencode(candidate)) >= PATH_MAX:  # (lstat would raise ENAMETOOLONG, naming the root)
            raise ToolError(f"Path {_shorten(path)!r} is longer than a path can be ({PATH_MAX} bytes with the root)")
        try:
            is_link = candidate.is_symlink()
        except OSError as exc:  # (a directory on the way the runtime may not search: EACCES)
            raise ToolError(f"Path {_shorten(path)!r} cannot be reached: {exc.strerror}") from None
        if is_link:
            target = Path(os.path.realpath(candidate))
            if not _inside(target, base):
                shown = "/".join(parts[: i + 1])
                raise ToolError(f"Path {path!r} goes through the symlink {shown!r}, which points outside the workspace")
            last = i == len(parts) - 1
            current = candidate if last and not follow_final else target
        else:
            current = candidate
    if len(os.fsencode(current)) >= PATH_MAX:  # (a symlink's target made it so)
        raise ToolError(f"Path {_shorten(path)!r} is longer than a path can be ({PATH_MAX} bytes with the root)")
    return current


def _shorten(path: str) -> str:
    """``path`` as an error message repeats it: a path of thousands of characters, cut."""
    return path if len(path) <= 200 else f"{path[:100]}…{path[-100:]}"


def check_opened(base: Path, fd: int, path: str) -> None:
    """``ToolError`` unless the file or directory open as ``fd`` lies inside ``base``. A directory
    on the way may have been swapped for a symlink to elsewhere (by another process) after
    ``resolve_path`` looked: what was actually opened is what counts (Linux tells it in /proc)."""
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc: the check resolve_path made stands
        return
    if not _inside(Path(opened), base):
        raise ToolError(f"Path {path!r} led outside the workspace as it was opened (a directory on it changed)")


def display(root: Path, path: Path) -> str:
    """``path`` as the model should write it next time: relative to the (real) root."""
    try:
        rel = path.relative_to(root)
    except ValueError:
        return str(path)
    return "." if not rel.parts else rel.as_posix()
