"""Any tool result cut at its ``max_result_chars`` is kept whole in the workspace, as a long Shell
output is (``.agentloop/outputs/``, ``process_group.KeptOutput``): the cut names the file and the
first line not shown, and Read pages through it. Without a workspace (or one the file cannot be
written to) the cut is as it always was; a result that fits writes nothing; Search leaves the
kept files out unless it is pointed into them. The workspace is every account's: a result of an
account's own tool (its MCP servers, devices, memory, what a toolset adds for it) is never kept
there, nor a Read of a file already there; a process directory swapped for a symlink is not
written through."""

from __future__ import annotations

import contextlib
import json
import re
import stat
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from agentloop import Agent, Reply, ScriptedModel, ToolResult, ToolResultMessage, call, tool
from agentloop.kernel import Kernel, account_mcp
from agentloop.kernel.devices import RoutedTool
from agentloop.loop.hooks import maybe_await
from agentloop.messages import ImageContent, TextContent
from agentloop.process.store import ProcessRecord
from agentloop.server.devices import DeviceHub
from agentloop.tools import base, process_group, search_python
from agentloop.tools.base import Tool
from agentloop.tools.builtin import builtin_tools
from agentloop.tools.fs import read_file
from agentloop.tools.mcp import MCPServerConfig
from agentloop.tools.search import search_files
from tests.test_devices import ALICE, online
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


# ------------------------------------------------------------------ the workspace is every account's

SECRET = "ALICE-PRIVATE-TOKEN-9f3a"


def alice_mail() -> Tool:
    """An account's own tool, its long answer holding what only that account may read."""

    @tool(max_result_chars=2_000)
    def alice_mail() -> str:
        """Alice's mail."""
        return "\n".join([f"filler {i}" for i in range(2000)] + [SECRET] + [f"filler {i}" for i in range(2000)])

    return alice_mail


def as_toolset(mail: Tool) -> Callable[[ProcessRecord, Mapping[str, Tool]], Mapping[str, Tool]]:
    """An application's toolset giving alice her own tool."""
    return lambda record, shared: {**shared, mail.name: mail} if record.owner == "alice" else shared


def as_account_mcp(mail: Tool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Alice's own MCP server (``home/alice/mcp.json``) answering with the tool."""

    @contextlib.asynccontextmanager
    async def servers(configs: list[MCPServerConfig]) -> AsyncIterator[list[Tool]]:
        yield [mail]

    monkeypatch.setattr(account_mcp, "mcp_tools", servers)
    (tmp_path / "home" / "alice").mkdir(parents=True)
    (tmp_path / "home" / "alice" / "mcp.json").write_text(json.dumps([{"name": "mail", "command": "srv"}]))


@pytest.mark.parametrize("given_by", ["toolset", "account_mcp"])
async def test_an_accounts_own_tool_keeps_no_cut_result_another_account_could_read(
    root: Path, monkeypatch: pytest.MonkeyPatch, given_by: str
) -> None:
    mail = alice_mail()
    options: dict[str, Any] = {}
    if given_by == "toolset":
        options["toolset"] = as_toolset(mail)
    else:
        as_account_mcp(mail, root.parent, monkeypatch)
    model = ScriptedModel(
        [
            Reply(tool_calls=[call("alice_mail")]),
            "ok",
            Reply(tool_calls=[call("Search", pattern="PRIVATE-TOKEN", path=".agentloop/outputs")]),
            "ok",
        ]
    )
    tools = [*builtin_tools(root)]
    url = f"sqlite:///{root.parent}/k.db"
    async with Kernel.open(url, model=model, tools=tools, workspace=root, **options) as k:
        alice = await k.spawn(owner="alice")
        await alice.send("go")
        await alice.wait_idle()
        [cut] = [m.text for m in await alice.messages() if isinstance(m, ToolResultMessage)]
        assert SECRET not in cut and "Ask for a smaller part if the cut matters" in cut and "kept in" not in cut
        # the kernel's own per-account tools alike; a shared tool keeps its cut results
        record, toolset = await k.store.get_process(alice.pid), k.engine.toolset
        assert record is not None and toolset is not None
        offered = await maybe_await(toolset(record, k.engine.config.tools))
        assert not offered["memory"].keeps_cut_results and offered["Shell"].keeps_cut_results
        bob = await k.spawn(owner="bob")
        await bob.send("look")
        await bob.wait_idle()
        [found] = [m.text for m in await bob.messages() if isinstance(m, ToolResultMessage)]
        assert SECRET not in found
    assert kept_files(root) == []


async def test_a_device_targeted_calls_cut_result_is_not_kept(root: Path) -> None:
    async def answer(call_name: str, args: dict[str, Any]) -> dict[str, Any]:
        return {"content": [{"type": "text", "text": LONG * 5}], "is_error": False}  # over Read's 100k

    hub = DeviceHub()
    await online(hub, ALICE, "laptop", handler=answer, tools=[{"name": "dump", "parameters": {"type": "object"}}])
    model = ScriptedModel(
        [Reply(tool_calls=[call("Read", path="big.log", target="laptop"), call("laptop__dump")]), "ok"]
    )
    async with Kernel.open(f"sqlite:///{root.parent}/k.db", model=model, workspace=root, devices=hub) as k:
        proc = await k.spawn("alice")
        await proc.send("go")
        await proc.wait_idle()
        cuts = [m.text for m in await proc.messages() if isinstance(m, ToolResultMessage)]
    assert len(cuts) == 2
    for cut in cuts:
        assert "Ask for a smaller part if the cut matters" in cut and "kept in" not in cut
    assert kept_files(root) == []
    # the same tool run on the server decides as its own tool does
    routed = RoutedTool(fetch_page, "fs.read", "alice", [], hub)
    assert routed.keeps_result_of({}) and not routed.keeps_result_of({"target": "laptop"})


async def test_reading_a_kept_file_does_not_keep_it_again(root: Path) -> None:
    name = await assert_kept(await run_in_memory(fetch_page, root), root)
    model = ScriptedModel([Reply(tool_calls=[call("Read", path=name, limit=len(LINES))]), "ok"])
    await Agent(model=model, tools=builtin_tools(root), workspace=root).run("go")
    [page] = results_seen(model)
    assert "characters cut" in page and "Ask for a smaller part if the cut matters" in page
    assert kept_files(root) == [Path(name).name]


async def test_a_process_directory_swapped_for_a_symlink_is_not_written_through(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    model = ScriptedModel([Reply(tool_calls=[call("fetch_page")]), "ok"])
    agent = Agent(model=model, tools=[fetch_page], workspace=tmp_path / "sub")
    (tmp_path / "sub").rmdir()
    (tmp_path / "sub").symlink_to(elsewhere)  # (as a command of the process could)
    await agent.run("go")
    [seen] = results_seen(model)
    assert "Ask for a smaller part if the cut matters" in seen and "kept in" not in seen
    assert list(elsewhere.iterdir()) == []


def test_owner_scoping_leaves_the_tool_objects_it_marks_as_they_were() -> None:
    """A tool an owner's toolset adds may serve elsewhere too (an in-memory agent, another
    kernel): the owner's run gets a copy that keeps nothing, the object itself is unchanged."""
    from agentloop.kernel.runs import owner_scoped

    @tool
    def report(text: str) -> str:
        """Say it back."""
        return text

    scoped = owner_scoped(lambda record, shared: {**shared, "report": report})
    tools = scoped(object(), {})
    assert isinstance(tools, dict)
    assert tools["report"] is not report and tools["report"].keeps_cut_results is False
    assert report.keeps_cut_results is True
