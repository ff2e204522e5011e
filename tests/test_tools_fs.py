"""Read, Write, Edit, Delete and the path rules, on real files under a tmp_path root."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agentloop import Agent, Reply, ScriptedModel, ToolResultMessage, call
from agentloop.messages import FileContent, ImageContent, TextContent
from agentloop.tools.base import ToolContext, ToolError, ToolResult
from agentloop.tools.builtin import SYSCALLS, builtin_tools
from agentloop.tools.fs import delete_file, edit_file, read_file, write_file
from agentloop.tools.paths import resolve_path
from tests.image_support import GIF, JPEG, WEBP

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


def text(result: ToolResult) -> str:
    assert isinstance(result.content[0], TextContent)
    return result.content[0].text


@pytest.fixture
def root(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("alpha\nbeta\ngamma\n")
    (ws / "sub").mkdir()
    (ws / "sub" / "b.txt").write_text("inside\n")
    (tmp_path / "secret.txt").write_text("top secret\n")
    (tmp_path / "outdir").mkdir()
    (tmp_path / "outdir" / "o.txt").write_text("outside\n")
    return ws


# ------------------------------------------------------------------ paths


def test_relative_and_absolute_inside_resolve(root: Path) -> None:
    assert resolve_path(root, "a.txt") == root.resolve() / "a.txt"
    assert resolve_path(root, str(root / "sub" / "b.txt")) == root.resolve() / "sub" / "b.txt"
    assert resolve_path(root, "sub/../a.txt") == root.resolve() / "a.txt"
    assert resolve_path(root, "./new/dir/file.txt") == root.resolve() / "new" / "dir" / "file.txt"


@pytest.mark.parametrize("path", ["../secret.txt", "sub/../../secret.txt", "..", "../ws/../secret.txt"])
async def test_dotdot_escapes_are_refused(root: Path, path: str) -> None:
    with pytest.raises(ToolError, match="escapes the workspace"):
        await read_file(root, path)
    with pytest.raises(ToolError, match="escapes the workspace"):
        await write_file(root, path, "x")
    assert (root.parent / "secret.txt").read_text() == "top secret\n"


async def test_absolute_path_outside_is_refused(root: Path) -> None:
    for path in ["/etc/passwd", str(root.parent / "secret.txt"), str(root) + "-other/x"]:
        with pytest.raises(ToolError, match="outside the workspace"):
            await read_file(root, path)
    with pytest.raises(ToolError, match="outside the workspace"):
        await write_file(root, str(root.parent / "new.txt"), "x")
    with pytest.raises(ToolError, match="escapes"):
        await write_file(root, f"{root}/../new.txt", "x")
    assert not (root.parent / "new.txt").exists()


async def test_file_symlink_out_is_refused(root: Path) -> None:
    (root / "leak.txt").symlink_to(root.parent / "secret.txt")
    with pytest.raises(ToolError, match=r"symlink 'leak.txt'.*outside"):
        await read_file(root, "leak.txt")
    with pytest.raises(ToolError, match="symlink"):
        await write_file(root, "leak.txt", "pwned")
    with pytest.raises(ToolError, match="symlink"):
        await edit_file(root, "leak.txt", "top", "bottom")
    with pytest.raises(ToolError, match="symlink"):
        await delete_file(root, "leak.txt")
    assert (root.parent / "secret.txt").read_text() == "top secret\n"


async def test_directory_symlink_out_is_refused(root: Path) -> None:
    (root / "out").symlink_to(root.parent / "outdir", target_is_directory=True)
    with pytest.raises(ToolError, match="symlink 'out'"):
        await read_file(root, "out/o.txt")
    with pytest.raises(ToolError, match="symlink 'out'"):
        await write_file(root, "out/new.txt", "x")  # a path that does not exist yet, under the link
    with pytest.raises(ToolError, match="symlink 'out'"):
        await write_file(root, "out/deeper/new.txt", "x")
    assert sorted(p.name for p in (root.parent / "outdir").iterdir()) == ["o.txt"]


async def test_dangling_symlink_out_is_refused_for_write(root: Path) -> None:
    target = root.parent / "created-by-model.txt"
    (root / "dangling").symlink_to(target)
    with pytest.raises(ToolError, match="symlink 'dangling'"):
        await write_file(root, "dangling", "pwned")
    assert not target.exists()


def test_symlink_escape_via_dotdot_after_link(root: Path) -> None:
    # "link/.." is the parent of the link's *target*, as the kernel sees it
    (root / "sub" / "deep").mkdir()
    (root / "up").symlink_to(root / "sub" / "deep", target_is_directory=True)
    assert resolve_path(root, "up/../b.txt") == root.resolve() / "sub" / "b.txt"
    (root / "top").symlink_to(root, target_is_directory=True)
    with pytest.raises(ToolError, match="escapes"):
        resolve_path(root, "top/../secret.txt")


async def test_symlinks_inside_the_root_work(root: Path) -> None:
    (root / "alias.txt").symlink_to(root / "a.txt")
    (root / "dir-alias").symlink_to(root / "sub", target_is_directory=True)
    assert "alpha" in text(await read_file(root, "alias.txt"))
    assert "inside" in text(await read_file(root, "dir-alias/b.txt"))
    await write_file(root, "alias.txt", "rewritten\n")  # writes the target, which is inside
    assert (root / "a.txt").read_text() == "rewritten\n"
    await delete_file(root, "alias.txt")  # removes the link, not its target
    assert not (root / "alias.txt").is_symlink() and (root / "a.txt").exists()


async def test_root_given_through_a_symlink(root: Path) -> None:
    link = root.parent / "ws-link"
    link.symlink_to(root, target_is_directory=True)
    assert "alpha" in text(await read_file(link, str(link / "a.txt")))
    assert "alpha" in text(await read_file(link, str(root / "a.txt")))


# ------------------------------------------------------------------ Read


async def test_read_numbers_lines_like_cat_n(root: Path) -> None:
    result = await read_file(root, "a.txt")
    assert text(result) == "     1\talpha\n     2\tbeta\n     3\tgamma"
    assert not result.is_error
    assert result.details["total_lines"] == 3


async def test_read_offset_limit_and_more_lines_note(root: Path) -> None:
    (root / "long.txt").write_text("".join(f"line {i}\n" for i in range(1, 101)))
    out = text(await read_file(root, "long.txt", offset=10, limit=5))
    assert out.splitlines()[0] == "    10\tline 10"
    assert out.splitlines()[4] == "    14\tline 14"
    assert out.splitlines()[-1] == "… 86 more lines; use offset=15 to read on"
    assert "more lines" not in text(await read_file(root, "long.txt", offset=96, limit=5))
    with pytest.raises(ToolError, match=r"past the end.*100 lines"):
        await read_file(root, "long.txt", offset=101)


async def test_read_truncates_long_lines(root: Path) -> None:
    (root / "wide.txt").write_text("x" * 5000 + "\nshort\n")
    first, second = text(await read_file(root, "wide.txt")).splitlines()
    assert first.startswith("     1\t" + "x" * 2000) and "x" * 2001 not in first
    assert "truncated" in first and "5000" in first
    assert second == "     2\tshort"


async def test_read_empty_file(root: Path) -> None:
    (root / "empty.txt").write_text("")
    assert "empty" in text(await read_file(root, "empty.txt"))


@pytest.mark.parametrize(("name", "head", "noun"), [("big.pdf", b"%PDF-1.4\n", "a PDF"), ("big.png", PNG, "an image")])
async def test_read_refuses_an_image_or_pdf_over_the_limit(
    root: Path, monkeypatch: pytest.MonkeyPatch, name: str, head: bytes, noun: str
) -> None:
    monkeypatch.setattr("agentloop.tools.fs.MAX_IMAGE_BYTES", 1000)
    (root / name).write_bytes(head + b"0" * 1000)
    with pytest.raises(ToolError, match=f"{name} is {noun} of {len(head) + 1000} bytes, over the 1000-byte limit"):
        await read_file(root, name)


async def test_read_pdf_gives_a_document_block(root: Path) -> None:
    pdf = b"%PDF-1.4\n" + bytes(range(256)) + b"\n%%EOF\n"  # binary inside, as real PDFs are
    (root / "docs").mkdir()
    (root / "docs" / "report.pdf").write_bytes(pdf)
    result = await read_file(root, "docs/report.pdf")
    assert not result.is_error and "PDF docs/report.pdf" in result.content[0].text
    block = result.content[1]
    assert isinstance(block, FileContent) and block.mime_type == "application/pdf" and block.name == "report.pdf"
    assert base64.b64decode(block.data) == pdf


async def test_read_image_gives_image_block(root: Path) -> None:
    (root / "pic.png").write_bytes(PNG)
    (root / "noext").write_bytes(PNG)  # judged by content, not by name
    for name in ("pic.png", "noext"):
        result = await read_file(root, name)
        assert not result.is_error
        assert isinstance(result.content[0], TextContent) and "image/png" in result.content[0].text
        image = result.content[1]
        assert isinstance(image, ImageContent)
        assert image.mime_type == "image/png"
        assert base64.b64decode(image.data) == PNG
    (root / "pic.gif").write_bytes(GIF)
    (root / "pic.webp").write_bytes(WEBP)
    (root / "pic.jpg").write_bytes(JPEG)
    mimes = []
    for name in ("pic.gif", "pic.webp", "pic.jpg"):
        block = (await read_file(root, name)).content[1]
        assert isinstance(block, ImageContent)
        mimes.append(block.mime_type)
    assert mimes == ["image/gif", "image/webp", "image/jpeg"]


async def test_read_binary_missing_and_directory_errors(root: Path) -> None:
    (root / "blob.bin").write_bytes(b"\x7fELF\x00\x01\x02")
    with pytest.raises(ToolError, match="binary"):
        await read_file(root, "blob.bin")
    with pytest.raises(ToolError, match=r"File not found: nope/missing\.txt"):
        await read_file(root, "nope/missing.txt")
    with pytest.raises(ToolError, match=r"directory.*Search.*Shell"):
        await read_file(root, "sub")


async def test_special_files_are_refused_not_blocked_on(root: Path) -> None:
    os.mkfifo(root / "fifo")
    with pytest.raises(ToolError, match="not a regular file"):
        await read_file(root, "fifo")
    with pytest.raises(ToolError, match="not a regular file"):
        await write_file(root, "fifo", "x")
    with pytest.raises(ToolError, match="not a regular file"):
        await edit_file(root, "fifo", "a", "b")


async def test_read_invalid_utf8_is_replaced_not_fatal(root: Path) -> None:
    (root / "latin.txt").write_bytes(b"caf\xe9\n")
    assert text(await read_file(root, "latin.txt")) == "     1\tcaf\ufffd"


# ------------------------------------------------------------------ Write


async def test_write_creates_parents_overwrites_and_reports_bytes(root: Path) -> None:
    result = await write_file(root, "new/deep/f.txt", "héllo\n")
    assert (root / "new" / "deep" / "f.txt").read_text() == "héllo\n"
    assert "7 bytes" in text(result) and "new/deep/f.txt" in text(result)
    result = await write_file(root, "new/deep/f.txt", "x")
    assert (root / "new" / "deep" / "f.txt").read_text() == "x"
    assert "1 bytes" in text(result) and "Overwrote" in text(result)
    with pytest.raises(ToolError, match="directory"):
        await write_file(root, "sub", "x")


# ------------------------------------------------------------------ Edit


async def test_edit_unique_replacement(root: Path) -> None:
    result = await edit_file(root, "a.txt", "beta", "BETA")
    assert (root / "a.txt").read_text() == "alpha\nBETA\ngamma\n"
    assert "1 replacement" in text(result) and result.details["replacements"] == 1


async def test_edit_requires_uniqueness_unless_replace_all(root: Path) -> None:
    (root / "dup.txt").write_text("x = 1\nx = 1\nx = 1\n")
    with pytest.raises(ToolError, match=r"occurs 3 times.*replace_all"):
        await edit_file(root, "dup.txt", "x = 1", "x = 2")
    assert (root / "dup.txt").read_text() == "x = 1\nx = 1\nx = 1\n"
    result = await edit_file(root, "dup.txt", "x = 1", "x = 2", replace_all=True)
    assert (root / "dup.txt").read_text() == "x = 2\nx = 2\nx = 2\n"
    assert "3 replacements" in text(result)


async def test_edit_errors(root: Path) -> None:
    with pytest.raises(ToolError, match=r"not found in a.txt"):
        await edit_file(root, "a.txt", "delta", "DELTA")
    with pytest.raises(ToolError, match="identical"):
        await edit_file(root, "a.txt", "beta", "beta")
    with pytest.raises(ToolError, match="File not found"):
        await edit_file(root, "missing.txt", "a", "b")
    with pytest.raises(ToolError, match="empty"):
        await edit_file(root, "a.txt", "", "b")


async def test_edit_matches_crlf_files_with_lf_strings(root: Path) -> None:
    (root / "win.txt").write_bytes(b"one\r\ntwo\r\n")
    await edit_file(root, "win.txt", "one\ntwo", "1\n2")
    assert (root / "win.txt").read_bytes() == b"1\r\n2\r\n"


# ------------------------------------------------------------------ Delete


async def test_delete_file_empty_dir_and_refusals(root: Path) -> None:
    result = await delete_file(root, "a.txt")
    assert not (root / "a.txt").exists() and "Deleted a.txt" in text(result)
    with pytest.raises(ToolError, match="File not found"):
        await delete_file(root, "a.txt")
    with pytest.raises(ToolError, match="not empty"):
        await delete_file(root, "sub")
    (root / "empty").mkdir()
    await delete_file(root, "empty")
    assert not (root / "empty").exists()
    for path in (".", "", str(root), "sub/.."):
        with pytest.raises(ToolError):
            await delete_file(root, path)
    assert (root / "sub" / "b.txt").read_text() == "inside\n"


# ------------------------------------------------------------------ as tools


def test_builtin_tool_set_names_and_flags(root: Path) -> None:
    tools = {t.name: t for t in builtin_tools(root)}
    assert list(tools) == ["Read", "Write", "Edit", "Delete", "Search", "Shell", "Fetch"]
    assert set(tools) == set(SYSCALLS)
    assert tools["Read"].idempotent and tools["Search"].idempotent
    assert not tools["Write"].idempotent and not tools["Shell"].idempotent
    assert tools["Shell"].timeout is None
    assert [t.name for t in builtin_tools(root, shell=False, fetch=False)] == list(tools)[:5]
    for t in tools.values():
        assert t.description
        props = t.parameters["properties"]
        assert all(p.get("description") for p in props.values()), t.name
    assert tools["Read"].parameters["required"] == ["path"]


async def test_tools_validate_and_run(root: Path) -> None:
    tools = {t.name: t for t in builtin_tools(root)}
    ctx = ToolContext(tool_call_id="1", tool_name="Read")
    args = tools["Read"].validate({"path": "a.txt", "offset": "2", "limit": 1})
    assert text(await tools["Read"].run(args, ctx)) == "     2\tbeta\n… 1 more lines; use offset=3 to read on"
    with pytest.raises(ToolError, match="offset"):
        tools["Read"].validate({"path": "a.txt", "offset": 0})


async def test_agent_gets_tool_errors_as_results(root: Path) -> None:
    model = ScriptedModel(
        [
            Reply(
                tool_calls=[
                    call("Read", path="a.txt"),
                    call("Read", path="../secret.txt"),
                    call("Write", path="sub/c.txt", content="new"),
                ]
            ),
            "done",
        ]
    )
    result = await Agent(model=model, tools=builtin_tools(root)).run("go")
    results = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert [r.is_error for r in results] == [False, True, False]
    assert "alpha" in results[0].text and "escapes the workspace" in results[1].text
    assert (root / "sub" / "c.txt").read_text() == "new"
    assert result.text == "done"


async def test_missing_root_is_an_error_not_a_crash(tmp_path: Path) -> None:
    gone = tmp_path / "not-yet"
    tools = {t.name: t for t in builtin_tools(gone)}
    with pytest.raises(ToolError, match="not available"):
        await read_file(gone, "a.txt")
    gone.mkdir()  # created after the tools were made: they pick it up
    ctx = ToolContext(tool_call_id="1", tool_name="Write")
    await tools["Write"].run({"path": "a.txt", "content": "hi"}, ctx)
    assert (gone / "a.txt").read_text() == "hi"


async def test_edit_keeps_a_windows_file_in_its_line_endings_and_counts_overlapping_matches(tmp_path: Path) -> None:
    """A review: a one-line match in a CRLF file put a bare \\n in with the new text; and an
    old_string found twice, overlapping, was taken as unique and the first one replaced."""
    (tmp_path / "w.txt").write_bytes(b"alpha\r\nbeta\r\ngamma\r\n")
    await edit_file(tmp_path, "w.txt", "beta", "beta\nbeta2")
    assert (tmp_path / "w.txt").read_bytes() == b"alpha\r\nbeta\r\nbeta2\r\ngamma\r\n"
    (tmp_path / "x.lua").write_text("if a then\nend\nend\nend\n")
    with pytest.raises(ToolError, match="occurs 2 times"):
        await edit_file(tmp_path, "x.lua", "end\nend\n", "end\n")
    assert (tmp_path / "x.lua").read_text() == "if a then\nend\nend\nend\n"


def test_a_write_that_fails_halfway_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    """Write and Edit write a new file and rename it into place: a full disk (here, a file size
    limit) fails the call, and the original is whole, not truncated to what fitted."""
    original = "".join(f"line {i} {'x' * 60}\n" for i in range(3000))
    (tmp_path / "big.txt").write_text(original)
    program = (
        "import asyncio, resource, signal, sys\n"
        "from agentloop.tools.fs import edit_file\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))\n"
        "try:\n"
        f"    asyncio.run(edit_file({str(tmp_path)!r}, 'big.txt', 'line 0 ', 'LINE 0 '))\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert "ToolError" in done.stdout and "unchanged" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "big.txt").read_text() == original
    assert [p.name for p in tmp_path.iterdir()] == ["big.txt"]  # no temporary file left behind


@pytest.mark.parametrize("path", ["x" * 300, "a/" + "y" * 256 + "/b", "\ud800", "f/sub"])
async def test_paths_no_file_can_have_are_a_clear_error_without_the_servers_directory(
    tmp_path: Path, path: str
) -> None:
    """A review: a name too long, a lone surrogate, or a file where a directory must be gave a raw
    OSError or UnicodeEncodeError naming the server's absolute path."""
    (tmp_path / "f").write_text("")
    for call_tool in (lambda: write_file(tmp_path, path, "hi"), lambda: read_file(tmp_path, path)):
        with pytest.raises(ToolError) as info:
            await call_tool()
        assert str(tmp_path) not in str(info.value)


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="what was opened is told by /proc")
async def test_a_directory_swapped_for_a_link_after_the_check_does_not_lead_outside(tmp_path: Path) -> None:
    """A review: a process racing the tool turned a directory on the path into a symlink to
    elsewhere between the check and the open, and Write wrote outside the workspace. What was
    opened is checked, for Read, Write, Edit and Delete alike."""
    from agentloop.tools import fs
    from agentloop.tools.paths import real_root, resolve_path

    root, outside = tmp_path / "ws", tmp_path / "outside"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    (outside / "x.txt").write_text("theirs\n")
    (root / "d" / "x.txt").write_text("ours\n")
    real = resolve_path(root, "d/x.txt")  # checked while d is a directory inside ...
    (root / "d").rename(root / "d-old")
    (root / "d").symlink_to(outside)  # ... then swapped
    base = real_root(root)
    with pytest.raises(ToolError, match="outside the workspace"):
        fs._write_bytes(base, real, "d/x.txt", b"pwned\n")
    with pytest.raises(ToolError, match="outside the workspace"), fs._directory_of(base, real, "d/x.txt"):
        pass
    monkey = pytest.MonkeyPatch()
    monkey.setattr(fs, "resolve_path", lambda root, path, **kw: real)
    try:
        for attempt in (
            lambda: read_file(root, "d/x.txt"),
            lambda: edit_file(root, "d/x.txt", "theirs", "pwned"),
            lambda: delete_file(root, "d/x.txt"),
        ):
            with pytest.raises(ToolError, match="outside the workspace"):
                await attempt()
    finally:
        monkey.undo()
    assert (outside / "x.txt").read_text() == "theirs\n" and sorted(p.name for p in outside.iterdir()) == ["x.txt"]


async def test_read_breaks_lines_where_search_and_edit_do(tmp_path: Path) -> None:
    """A lone carriage return (progress output) is not a line break: Read numbered lines that
    Search and ``cat -n`` did not, and Edit could not match what Read had shown."""
    (tmp_path / "log.txt").write_bytes(b"progress 10%\rprogress 100%\nERROR disk\r\n")
    shown = text(await read_file(tmp_path, "log.txt")).split("\n")
    assert shown == ["     1\tprogress 10%\rprogress 100%", "     2\tERROR disk"]


async def test_edit_matches_crlf_lines_of_a_file_with_mixed_endings(tmp_path: Path) -> None:
    (tmp_path / "m.txt").write_bytes(b"one\r\ntwo\r\nthree\nfour\r\n")
    await edit_file(tmp_path, "m.txt", "one\ntwo", "ONE\nTWO")
    assert (tmp_path / "m.txt").read_bytes() == b"ONE\r\nTWO\r\nthree\nfour\r\n"


def test_a_write_keeps_hard_links_owner_and_mode_and_respects_read_only_files(tmp_path: Path) -> None:
    """The all-or-nothing write (a renamed temporary file) must not change what a file is: its
    other hard links see the new content, its owner and mode stay, a read-only file stays unwritten
    (the review of the atomic write: each had changed), and a directory the runtime may not add
    files to still lets it rewrite a file it may write."""
    import asyncio

    (tmp_path / "a.txt").write_text("old\n")
    os.link(tmp_path / "a.txt", tmp_path / "b.txt")
    asyncio.run(edit_file(tmp_path, "a.txt", "old", "new"))
    assert (tmp_path / "b.txt").read_text() == "new\n"
    (tmp_path / "script.sh").write_text("echo 1\n")
    (tmp_path / "script.sh").chmod(0o750)
    if os.geteuid() == 0:
        os.chown(tmp_path / "script.sh", 1000, 1000)
    asyncio.run(edit_file(tmp_path, "script.sh", "1", "2"))
    st = os.stat(tmp_path / "script.sh")
    assert st.st_mode & 0o777 == 0o750 and (os.geteuid() != 0 or (st.st_uid, st.st_gid) == (1000, 1000))
    shared = Path(tempfile.mkdtemp())  # (one another user can reach: pytest's directories are private)
    shared.chmod(0o755)
    program = (
        "import asyncio, concurrent.futures.thread, os, sys\n"  # (imported while root can read them)
        "from agentloop.tools.fs import write_file\n"
        "from agentloop.tools.base import ToolError\n"
        f"root = {str(shared)!r}\n"
        "if os.geteuid() == 0:\n"
        "    os.chown(root + '/ro.txt', 65534, 65534); os.chown(root + '/locked', 65534, 65534)\n"
        "    os.chown(root + '/locked/conf.txt', 65534, 65534); os.setgid(65534); os.setuid(65534)\n"
        "try:\n"
        "    asyncio.run(write_file(root, 'ro.txt', 'changed'))\n"
        "except ToolError as exc:\n"
        "    print('refused:', exc)\n"
        "print(asyncio.run(write_file(root, 'locked/conf.txt', 'v2')).content[0].text)\n"
    )
    try:
        (shared / "ro.txt").write_text("keep\n")
        (shared / "ro.txt").chmod(0o444)
        (shared / "locked").mkdir()
        (shared / "locked" / "conf.txt").write_text("v1")
        (shared / "locked").chmod(0o555)
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
        assert "refused: Cannot write ro.txt: it is read-only" in done.stdout, done.stdout + done.stderr
        assert "Overwrote locked/conf.txt" in done.stdout
        assert (shared / "ro.txt").read_text() == "keep\n" and (shared / "locked" / "conf.txt").read_text() == "v2"
    finally:
        (shared / "locked").chmod(0o755)
        shutil.rmtree(shared)
