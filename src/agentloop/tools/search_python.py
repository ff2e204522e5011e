"""The Search tool's pure-Python engine, for where ripgrep is missing; the contract both engines
keep is in ``search.py``.

It runs in a child interpreter (``search.py`` starts this file as a script), never in the
server's: Python's regex engine holds the GIL while it matches, so a pattern that backtracks
without end (``(a+)+$`` on a long line) would freeze every run and stream of the process, and
no timeout could stop it. A child can be killed. So this module imports the standard library
only (the child starts in milliseconds, without the package) and speaks JSON over its pipes:
``{root, start, pattern, ignore_case, glob, cap, skipped, skip_kept}`` in, one ``[path, line, text]`` per
line out.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

SKIP_DIRS = frozenset({".git"})
#: Where the runtime keeps the whole output of a cut tool result (``process_group.OUTPUT_DIR``,
#: which this file, standard library only, cannot import), at any depth (a process working in a
#: subdirectory keeps its own there): a search of the workspace must not find yesterday's logs.
KEPT_DIR = ".agentloop/outputs"
_KEPT_PARTS = KEPT_DIR.split("/")
MAX_TEXT_CHARS = 500


def in_kept_dir(rel: str) -> bool:
    """Whether ``rel`` (a POSIX path relative to the root) is a ``KEPT_DIR`` or lies inside one."""
    parts, n = rel.split("/"), len(_KEPT_PARTS)
    return any(parts[i : i + n] == _KEPT_PARTS for i in range(len(parts) - n + 1))


def _relative(root: Path, path: Path) -> str:
    """``path`` relative to ``root``, as the model should write it (``tools.paths.display``)."""
    try:
        rel = path.relative_to(root)
    except ValueError:
        return str(path)
    return "." if not rel.parts else rel.as_posix()


@dataclass(frozen=True)
class Hit:
    path: str  # relative to the root, POSIX separators
    line: int
    text: str

    def render(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def clean_line(text: str) -> str:
    text = text.rstrip("\n").rstrip("\r")
    if len(text) > MAX_TEXT_CHARS:
        text = text[:MAX_TEXT_CHARS] + "…"
    return text


# ------------------------------------------------------------------ globs


def _glob_body(glob: str) -> str:
    """One glob (without its ``!``) as a regex body; ``*`` stays within a path component, as in gitignore."""
    out: list[str] = []
    i, n = 0, len(glob)
    depth = 0
    while i < n:
        c = glob[i]
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if glob.startswith("/**", i) and i + 3 == n:
            out.append("/.*")
            i += 3
            continue
        if glob.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = glob.find("]", i + 2 if glob[i + 1 : i + 2] in ("!", "^", "]") else i + 1)
            if end == -1:
                out.append(re.escape(c))
            else:
                body = glob[i + 1 : end]
                if body[:1] in ("!", "^"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = end
        elif c == "{":
            depth += 1
            out.append("(?:")
        elif c == "}" and depth:
            depth -= 1
            out.append(")")
        elif c == "," and depth:
            out.append("|")
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(glob[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def glob_to_regex(glob: str) -> tuple[re.Pattern[str], bool, bool]:
    """(regex, anchored, negated) for one gitignore-style glob.

    An anchored regex is matched against the path relative to the root, otherwise against the
    file name.
    """
    negated = glob.startswith("!")
    if negated:
        glob = glob[1:]
    anchored = "/" in glob.rstrip("/")
    glob = glob.lstrip("/").rstrip("/")
    return re.compile(_glob_body(glob) + r"\Z", re.DOTALL), anchored, negated


class _GlobFilter:
    def __init__(self, glob: str | None) -> None:
        self.rule = glob_to_regex(glob) if glob else None
        self.dirs_only = glob is not None and glob.endswith("/")  # as in gitignore: it names no file

    def _matches(self, rel: str) -> bool:
        assert self.rule is not None
        regex, anchored, _ = self.rule
        return bool(regex.match(rel if anchored else rel.rsplit("/", 1)[-1]))

    def keep_dir(self, rel: str) -> bool:
        return self.rule is None or not self.rule[2] or not self._matches(rel)

    def keep_file(self, rel: str) -> bool:
        if self.rule is None:
            return True
        if self.dirs_only:  # taken in: none; left out: only inside a directory it names
            return self.rule[2]
        return self._matches(rel) != self.rule[2]


# ------------------------------------------------------------------ the pure-Python engine


_CHUNK = 1 << 20  # bytes read at a time where a file is only checked for NUL bytes


def _open_regular(real: Path) -> BinaryIO | None:
    """``real`` open for reading if it is, as opened, a regular file and not a symlink; None
    otherwise. The walk saw a regular file there, but another process may have swapped in a
    symlink to outside the workspace (which must not be followed) or a FIFO (which would block)."""
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        return None
    return f


def _search_file(real: Path, rel: str, regex: re.Pattern[str], hits: list[Hit], cap: int) -> None:
    """``real``'s matching lines, read a line at a time: a log of gigabytes is never held whole,
    only its longest line (which the regex must see whole, as ripgrep's does).

    A file with a NUL byte anywhere is binary and gives no hits (see ``search.py``), so its hits
    wait in a list of their own until its end: a NUL found after them drops them all. Once that
    list is full (``cap`` reached) the rest is only checked for a NUL, in large chunks."""
    f = _open_regular(real)
    if f is None:
        return
    room = cap - len(hits)
    found: list[Hit] = []
    with f:
        for number, raw in enumerate(f, start=1):  # (lines split at b"\n", as bytes.split did)
            if b"\x00" in raw:
                return
            line = raw.removesuffix(b"\n").decode("utf-8", errors="replace")
            if regex.search(line):
                found.append(Hit(rel, number, clean_line(line)))
                if len(found) >= room:
                    break
        else:
            hits.extend(found)
            return
        while chunk := f.read(_CHUNK):  # (only after a break: at the end, a read still takes _CHUNK bytes)
            if b"\x00" in chunk:
                return
    hits.extend(found)


def python_search(
    root: Path,
    start: Path,
    regex: re.Pattern[str],
    glob: str | None,
    cap: int,
    skipped: frozenset[str] = frozenset(),
    skip_kept: bool = False,
) -> list[Hit]:
    """Depth-first in name order: the order ``rg --sort path`` visits a tree in. ``skipped``:
    paths (relative to ``root``) left out; ``skip_kept``: every ``KEPT_DIR`` too."""
    hits: list[Hit] = []
    filt = _GlobFilter(glob)

    def walk(directory: Path) -> None:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            if len(hits) >= cap:
                return
            if entry.name in SKIP_DIRS or entry.is_symlink():
                continue
            rel = _relative(root, Path(entry.path))
            if rel in skipped:
                continue
            if entry.is_dir(follow_symlinks=False):
                if skip_kept and entry.name == _KEPT_PARTS[-1] and in_kept_dir(rel):
                    continue
                if filt.keep_dir(rel):
                    walk(Path(entry.path))
            elif entry.is_file(follow_symlinks=False) and filt.keep_file(rel):
                _search_file(Path(entry.path), rel, regex, hits, cap)

    if start.is_dir():
        walk(start)
    else:
        _search_file(start, _relative(root, start), regex, hits, cap)
    return hits


def main() -> None:
    """The child's side: one search, its hits as JSON lines."""
    job = json.load(sys.stdin)
    regex = re.compile(job["pattern"], re.IGNORECASE if job["ignore_case"] else 0)
    hits = python_search(
        Path(job["root"]),
        Path(job["start"]),
        regex,
        job["glob"],
        job["cap"],
        frozenset(job["skipped"]),
        job["skip_kept"],
    )
    out = sys.stdout
    for hit in hits:
        out.write(json.dumps([hit.path, hit.line, hit.text]) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
