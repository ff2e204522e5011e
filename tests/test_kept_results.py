"""Any tool result cut at its ``max_result_chars`` is kept whole in the workspace, as a long Shell
output is (``.agentloop/outputs/``, ``process_group.KeptOutput``): the cut names the file and the
first line not shown, and Read pages through it. Without a workspace (or one the file cannot be
written to) the cut is as it always was; a result that fits writes nothing; Search leaves the
kept files out unless it is pointed into them."""

from __future__ import annotations

import re
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from agentloop import Agent, Reply, ScriptedModel, ToolResult, ToolResultMessage, call, tool
from agentloop.kernel import Kernel
from agentloop.messages import ImageContent, TextContent
from agentloop.tools import base, process_group, search_python
from agentloop.tools.base import Tool
from agentloop.tools.fs import read_file
from agentloop.tools.search import search_files
from tests.test_output_offload11 import kept_files, outputs
from tests.test_tool_results import results_seen
from tests.test_tools_shell import text

# 20,000 numbered lines (~150k chars) with one of its own in the middle: line 10,001
MIDDLE = "UNIQUE-MIDDLE-LINE-4c1e"
LINES = [f"line {i}" for i in range(1, 10001)] + [MIDDLE] + [f"line {i}" for i in range(10001, 20001)]
LONG = "\n".join(LINES)
LIMIT = 5_000
NOTE = re.compile(
    r"\[… (\d+) characters cut: the result had (\d+), more than the (\d+) this tool may return: "
    r"lines (\d+)–(\d+) of (\d+) not shown; the full output \(.*?\) is kept in (\S+): Read it with offset/limit "
    r"\(offset=(\d+) for the first line not shown\)(?:, though [^\]]*)? …\]"
)


@tool(max_result_chars=LIMIT)
def fetch_page() -> str:
    """Fetch a long page."""
    return LONG


@tool(max_result_chars=LIMIT)
def short_page() -> str:
    """Fetch a short page."""
    return "a short page"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws.resolve()


async def run_in_memory(tool_obj: Tool, workspace: Path | None) -> str:
    model = ScriptedModel([Reply(tool_calls=[call(tool_obj.name)]), "ok"])
    await Agent(model=model, tools=[tool_obj], workspace=workspace).run("go")
    [seen] = results_seen(model)
    return seen


def numbered(page: ToolResult) -> list[str]:
    """Read's lines, their numbers unpadded."""
    return [line.lstrip() for line in text(page).splitlines()]


async def assert_kept(result: str, root: Path) -> str:
    """The note names a kept file holding ``LONG`` whole, and Read at its offset gives the first
    line the cut did not show; the file's path (relative to ``root``)."""
    note = NOTE.search(result)
    assert note is not None, result[3_000:3_600]
    assert int(note[2]) == len(LONG) and int(note[3]) == LIMIT and int(note[6]) == len(LINES)
    first, name = int(note[8]), note[7]
    assert int(note[4]) == first < 10_001 < int(note[5])
    assert re.fullmatch(r"\.agentloop/outputs/\d{8}-\d{6}-[0-9a-f]{8}\.txt", name)
    assert (root / name).read_text() == LONG  # the middle too
    assert result.startswith(LONG[: LIMIT * 2 // 3]) and MIDDLE not in result
    page = await read_file(root, name, first, 2)
    assert numbered(page)[:2] == [f"{first}\t{LINES[first - 1]}", f"{first + 1}\t{LINES[first]}"]
    middle = await read_file(root, name, 10_001, 1)
    assert numbered(middle)[0] == f"10001\t{MIDDLE}"
    return name


async def test_a_cut_result_is_kept_whole_and_the_cut_names_the_file_read_pages_through(root: Path) -> None:
    seen = await run_in_memory(fetch_page, root)
    await assert_kept(seen, root)
    assert len(kept_files(root)) == 1


async def test_a_durable_process_keeps_its_cut_result_where_its_read_is_rooted(root: Path) -> None:
    (root / "sub").mkdir()
    model = ScriptedModel([Reply(tool_calls=[call("fetch_page")]), "ok", Reply(tool_calls=[call("fetch_page")]), "ok"])
    async with Kernel.open(f"sqlite:///{root.parent}/k.db", model=model, tools=[fetch_page], workspace=root) as k:
        for cwd, where in ((None, root), ("sub", root / "sub")):
            proc = await k.spawn(owner="me", cwd=cwd)
            await proc.send("go")
            await proc.wait_idle()
            [stored] = [m.text for m in await proc.messages() if isinstance(m, ToolResultMessage)]
            await assert_kept(stored, where)
            assert results_seen(model)[-1] == stored
    assert len(kept_files(root)) == len(kept_files(root / "sub")) == 1


async def test_without_a_workspace_the_cut_is_as_before_and_no_file(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(root)
    seen = await run_in_memory(fetch_page, None)
    assert f"the result had {len(LONG)}, more than the {LIMIT} this tool may return. Ask for a smaller part" in seen
    assert "kept in" not in seen and not (root / ".agentloop").exists()


async def test_a_workspace_the_file_cannot_be_written_to_cuts_as_before(root: Path) -> None:
    (root / ".agentloop").write_text("not a directory")  # (the folder cannot be made: as a read-only one)
    seen = await run_in_memory(fetch_page, root)
    assert "Ask for a smaller part if the cut matters" in seen and "kept in" not in seen
    assert (root / ".agentloop").read_text() == "not a directory"


async def test_a_result_under_the_cap_writes_nothing(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: Any) -> None:
        raise AssertionError("a result that fits is not kept")

    monkeypatch.setattr(base, "keep_text", never)
    assert await run_in_memory(short_page, root) == "a short page"
    assert not (root / ".agentloop").exists()


async def test_the_file_is_written_off_the_event_loop(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[threading.Thread] = []
    real = process_group.keep_text

    def spy(where: Path, data: bytes) -> process_group.KeptOutput:
        threads.append(threading.current_thread())
        return real(where, data)

    monkeypatch.setattr(base, "keep_text", spy)
    await assert_kept(await run_in_memory(fetch_page, root), root)
    assert len(threads) == 1 and threads[0] is not threading.main_thread()


async def test_an_mcp_sized_result_keeps_its_text_blocks_whole_and_its_images_in_the_result(root: Path) -> None:
    image = ImageContent(data="aGk=", mime_type="image/png")
    blocks = [TextContent(text="\n".join(LINES[:10_000])), image, TextContent(text="\n".join(LINES[10_000:]))]

    async def big_call(**_: Any) -> ToolResult:
        return ToolResult(list(blocks), details={"structured": True})

    mcp_tool = Tool.from_schema("mcp_big", "A big MCP tool.", {"type": "object"}, big_call, max_result_chars=LIMIT)
    model = ScriptedModel([Reply(tool_calls=[call("mcp_big")]), "ok"])
    await Agent(model=model, tools=[mcp_tool], workspace=root).run("go")
    [message] = [m for m in model.requests[-1].messages if isinstance(m, ToolResultMessage)]
    assert [type(b) for b in message.content] == [TextContent, ImageContent] and message.content[1] == image
    assert message.details == {"structured": True}
    await assert_kept(message.text, root)  # (the text blocks joined by a line break, as the cut joins them)


async def test_kept_results_are_private_and_the_oldest_go_past_the_caps(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(process_group, "MAX_KEPT_FILES", 2)
    names = [Path(await assert_kept(await run_in_memory(fetch_page, root), root)).name for _ in range(3)]
    assert kept_files(root) == sorted(names[1:])
    assert stat.S_IMODE((outputs(root) / names[-1]).stat().st_mode) == 0o600
    assert stat.S_IMODE(outputs(root).stat().st_mode) == 0o700
    assert (root / ".agentloop" / ".gitignore").read_text().splitlines()[-1] == "*"

    monkeypatch.setattr(process_group, "MAX_KEPT_BYTES", 64 * 1024)
    monkeypatch.setattr(process_group, "KEPT_TAIL_BYTES", 16 * 1024)
    seen = await run_in_memory(fetch_page, root)
    assert "though only its first 48.0 KiB and last 16.0 KiB: it was over 64.0 KiB" in seen
    note = NOTE.search(seen)
    assert note is not None
    data = (root / note[7]).read_bytes()
    assert data.startswith(LONG.encode()[: 48 * 1024]) and data.endswith(LONG.encode()[-16 * 1024 :])
    assert len(kept_files(root)) == 2


@pytest.mark.parametrize("use_rg", [True, False], ids=["rg", "python"])
async def test_search_skips_kept_outputs_unless_pointed_inside(root: Path, use_rg: bool) -> None:
    assert search_python.KEPT_DIR == process_group.OUTPUT_DIR  # (the child's copy of the name)
    kept = outputs(root) / "20240101-000000-0123abcd.txt"  # as a kept result is named
    kept.parent.mkdir(parents=True)
    kept.write_text(LONG)
    (root / "sub" / ".agentloop" / "outputs").mkdir(parents=True)  # a process working in sub keeps its own
    (root / "sub" / ".agentloop" / "outputs" / "old.txt").write_text(MIDDLE + "\n")
    (root / ".agentloop" / "notes.txt").write_text(MIDDLE + "\n")  # (beside the folder: searched)
    (root / "src.txt").write_text(MIDDLE + "\n")

    found = await search_files(root, MIDDLE, use_rg=use_rg)
    assert text(found).splitlines() == [f".agentloop/notes.txt:1: {MIDDLE}", f"src.txt:1: {MIDDLE}"]
    in_sub = await search_files(root, MIDDLE, "sub", use_rg=use_rg)
    assert text(in_sub).startswith("No matches")

    inside = await search_files(root, MIDDLE, ".agentloop/outputs", use_rg=use_rg)
    assert text(inside).splitlines() == [f".agentloop/outputs/{kept.name}:10001: {MIDDLE}"]
    nested = await search_files(root, MIDDLE, "sub/.agentloop/outputs", use_rg=use_rg)
    assert text(nested).splitlines() == [f"sub/.agentloop/outputs/old.txt:1: {MIDDLE}"]
