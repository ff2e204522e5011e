"""The built-in tools as one set, bound to a workspace root.

The names are what the model sees; each maps to a syscall (DESIGN §4) whose implementation is the
plain coroutine named beside it, so the same behaviour can be served by a device later.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from agentloop.tools.base import Tool
from agentloop.tools.fetch import fetch_tool
from agentloop.tools.fs import delete_tool, edit_tool, read_tool, write_tool
from agentloop.tools.sandbox import check_mode
from agentloop.tools.search import search_tool
from agentloop.tools.shell import shell_tool

__all__ = ["SYSCALLS", "builtin_tools", "syscall_of"]

#: model-visible tool name → syscall
SYSCALLS: dict[str, str] = {
    "Read": "fs.read",  # fs.read_file
    "Write": "fs.write",  # fs.write_file
    "Edit": "fs.edit",  # fs.edit_file
    "Delete": "fs.delete",  # fs.delete_file
    "Search": "fs.search",  # search.search_files
    "Shell": "shell.exec",  # shell.run_shell
    "Fetch": "net.fetch",  # fetch.fetch_url
}


def syscall_of(tool: Tool, arguments: Mapping[str, Any] | None = None) -> str:
    """What approval policies match a call of ``tool`` (with ``arguments``) against: its own
    syscall (an MCP tool's ``mcp.<server>.<tool>``, CodeMode's ``codemode.exec``), a built-in's,
    else ``tool.<name>``."""
    own = tool.syscall_for(arguments) if arguments is not None else tool.syscall
    return own or SYSCALLS.get(tool.name) or f"tool.{tool.name}"


def builtin_tools(
    workspace: str | Path,
    *,
    shell: bool = True,
    codemode: bool = False,
    fetch: bool = True,
    fetch_allow: Iterable[str] = (),
    shell_sandbox: str = "off",
    shell_sandbox_read: Iterable[str | Path] = (),
) -> list[Tool]:
    """Read, Write, Edit, Delete, Search and (unless ``shell=False``) Shell, rooted at ``workspace``,
    and (unless ``fetch=False``) Fetch, which reaches public addresses and those ``fetch_allow``
    names (``["localhost", "10.0.0.0/8"]``; ``ValueError`` for an entry that is neither); with
    ``codemode=True`` also CodeMode (syscall ``codemode.exec``) over them. CodeMode is opt-in: its
    program is arbitrary Python running as this user (see ``tools/codemode.py``). ``shell_sandbox``
    (``"off"``, ``"workspace"``, ``"workspace-offline"``, ``"private"``, ``"private-offline"``;
    ``ValueError`` for another) runs Shell's commands and CodeMode's programs under Landlock,
    writable only inside the workspace (``tools/sandbox.py``); the private modes also confine what
    Shell's commands read, to the workspace, the system and the directories ``shell_sandbox_read``
    names (by their real paths).

    The root is resolved again on every call, so it may be created or moved after this returns;
    a call made while it is missing is an error result, not an exception.
    """
    check_mode(shell_sandbox)  # (also when Shell is left out: a typo is an error wherever it is)
    root = Path(workspace).expanduser().absolute()
    tools: list[Tool] = [read_tool(root), write_tool(root), edit_tool(root), delete_tool(root), search_tool(root)]
    if shell:
        tools.append(shell_tool(root, sandbox=shell_sandbox, sandbox_read=tuple(shell_sandbox_read)))
    if fetch:
        tools.append(fetch_tool(allow=fetch_allow))
    if codemode:
        from agentloop.tools.codemode import CodeMode  # it imports this module: import late

        tools.append(CodeMode(tools, cwd=root, sandbox=shell_sandbox, sandbox_read=shell_sandbox_read))
    return tools
