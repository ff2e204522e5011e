"""A process's tool scope: the tools its runs are offered, narrower than the kernel's.

A scope is a list of entries; a tool is offered when one of them matches it:

- a tool's name, exactly: ``Read``, ``Shell``, an MCP tool's ``github__search_issues``;
- ``mcp:<server>``: every tool of that MCP server (its tools are named ``<server>__<tool>``, and
  their syscall is ``mcp.<server>.<tool>``, which is what is matched);
- a glob over names (``*``, ``?``, ``[...]``): ``github__*``, ``laptop__*``.

None (no scope) offers every tool. The scope is kept in the process's kv (``TOOLS_KEY``) and
applied when a run's tools are put together, after the kernel's toolsets (devices, MCP, skills,
memory, Task...), so a tool left out is neither shown to the model nor callable: a call to it
is answered as one to a tool that does not exist. ``Jobs`` goes with ``Shell`` (it only looks
after Shell's background commands); a run's own output tool (``output_schema``) is never scoped.

A child (a subagent) is spawned within its parent's scope: it may narrow it, never widen it
(``widening``); a process under a scope may delegate only to a process whose scope is within
its own.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence

from agentloop.messages import check_plain_text
from agentloop.tools.base import Tool

TOOLS_KEY = "tools"  # kv row of a process: its tool scope (a list of entries); absent: every tool
MCP_PREFIX = "mcp:"
MAX_ENTRIES = 256
MAX_ENTRY = 200  # characters of one entry (a tool name is at most 64)
_GLOB = frozenset("*?[")

__all__ = ["TOOLS_KEY", "ToolScopeError", "allows", "check_scope", "scoped", "unknown_entries", "widening"]


class ToolScopeError(ValueError):
    """A scope that names tools the process does not have, or widens its parent's. ``available``:
    the names it could have used."""

    def __init__(self, message: str, available: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.available = sorted(available)


def check_scope(entries: object) -> list[str] | None:
    """``entries`` as a scope (order kept, repeats dropped), or ``TypeError``/``ValueError``. An
    empty list is a scope too: no tools at all."""
    if entries is None:
        return None
    if isinstance(entries, str | bytes) or not isinstance(entries, Sequence | set | frozenset):
        raise TypeError(f"tools must be a list of tool names, got {type(entries).__name__}")
    out: list[str] = []
    for entry in entries:
        if not isinstance(entry, str):
            raise TypeError(f"tools must be a list of tool names, got an entry of {type(entry).__name__}")
        name = entry.strip()
        if not name or len(name) > MAX_ENTRY:
            raise ValueError(f"a tools entry must have 1 to {MAX_ENTRY} characters, got {entry[:MAX_ENTRY]!r}")
        check_plain_text(name, "a tools entry")
        if name.startswith(MCP_PREFIX) and not name[len(MCP_PREFIX) :]:
            raise ValueError("an mcp: entry names a server: mcp:<server>")
        if name not in out:
            out.append(name)
    if len(out) > MAX_ENTRIES:
        raise ValueError(f"tools may have {MAX_ENTRIES} entries at most, got {len(out)}")
    return out


def _pattern(entry: str) -> bool:
    return entry.startswith(MCP_PREFIX) or not _GLOB.isdisjoint(entry)


def _matches(entry: str, name: str, tool: Tool | None) -> bool:
    if entry == name:
        return True
    if entry.startswith(MCP_PREFIX):
        server = entry[len(MCP_PREFIX) :]
        if tool is None:  # (a name alone: an MCP tool's is <server>__<tool>)
            return name.startswith(f"{server}__")
        syscall = getattr(tool, "syscall", None)
        return isinstance(syscall, str) and syscall.startswith(f"mcp.{server}.")
    return not _GLOB.isdisjoint(entry) and fnmatch.fnmatchcase(name, entry)


def allows(scope: Sequence[str] | None, name: str, tool: Tool | None = None) -> bool:
    """Whether ``scope`` offers the tool ``name`` (``tool``, when known, for ``mcp:`` entries)."""
    if scope is None or any(_matches(entry, name, tool) for entry in scope):
        return True
    return name == "Jobs" and allows(scope, "Shell")


def scoped(tools: Mapping[str, Tool], scope: Sequence[str] | None) -> Mapping[str, Tool]:
    """The tools ``scope`` offers, in their order (``Jobs`` with ``Shell``)."""
    if scope is None:
        return tools
    return {name: tool for name, tool in tools.items() if allows(scope, name, tool)}


def unknown_entries(scope: Sequence[str], tools: Mapping[str, Tool]) -> list[str]:
    """The entries of ``scope`` that name no tool of ``tools`` by its exact name. Patterns are
    not checked: they may name tools not there now (an MCP server down, a device offline)."""
    return [entry for entry in scope if not _pattern(entry) and entry not in tools]


def widening(child: Sequence[str] | None, parent: Sequence[str] | None, tools: Mapping[str, Tool]) -> list[str]:
    """The entries of ``child`` that ``parent`` does not cover (all of them: ``["*"]`` for no
    scope under a parent's). A name is covered when the parent's scope offers that tool; a
    pattern only when the parent has the same pattern (one pattern within another is not
    worked out: refused, never widened)."""
    if parent is None:
        return []
    if child is None:
        return ["*"]
    return [
        entry
        for entry in child
        if entry not in parent and (_pattern(entry) or not allows(parent, entry, tools.get(entry)))
    ]
