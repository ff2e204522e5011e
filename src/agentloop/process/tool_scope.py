"""A process's tool scope: the tools its runs are offered, narrower than the kernel's.

A scope is a list of entries; a tool is offered when one of them matches it:

- a tool's name, exactly: ``Read``, ``Shell``, an MCP tool's ``github__search_issues``;
- ``mcp:<server>``: every tool of that MCP server (its tools are named ``<server>__<tool>``, and
  their syscall is ``mcp.<server>.<tool>``, which is what is matched); a server not exposed
  directly is reached through an ``mcp`` gateway narrowed to the servers so named (``mcp``
  itself, by name: the gateway to all of them);
- a glob over names (``*``, ``?``, ``[...]``): ``github__*``, ``laptop__*``.

None (no scope) offers every tool. The scope is kept in the process's kv (``TOOLS_KEY``) and
applied when a run's tools are put together, after the kernel's toolsets (devices, MCP, skills,
memory, Task...), so a tool left out is neither shown to the model nor callable: a call to it
is answered as one to a tool that does not exist; a CodeMode program's functions are scoped
alike (a program may call only the tools the scope offers). ``Jobs`` goes with ``Shell`` (it only looks
after Shell's background commands); a run's own output tool (``output_schema``) is never scoped.

A child (a subagent) is spawned within its parent's scope: it may narrow it, never widen it
(``widening``); a process under a scope may delegate only to a process whose scope is within
its own.
"""

from __future__ import annotations

import copy
import fnmatch
import weakref
from collections.abc import Iterable, Mapping, Sequence

from agentloop.messages import check_plain_text
from agentloop.tools.base import Tool
from agentloop.tools.codemode import CodeMode
from agentloop.tools.mcp import MCPGateway

TOOLS_KEY = "tools"  # kv row of a process: its tool scope (a list of entries); absent: every tool
MCP_PREFIX = "mcp:"
MAX_ENTRIES = 256
MAX_ENTRY = 200  # characters of one entry (a tool name is at most 64)
_GLOB = frozenset("*?[")

__all__ = [
    "TOOLS_KEY",
    "ToolScopeError",
    "allows",
    "check_scope",
    "intersection",
    "scoped",
    "unknown_entries",
    "widening",
]


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
    """The tools ``scope`` offers, in their order (``Jobs`` with ``Shell``); a CodeMode among
    them lends its programs only the tools the scope offers too (``_lent``)."""
    if scope is None:
        return tools
    out: dict[str, Tool] = {}
    for name, tool in tools.items():
        offered = _offered(name, tool, scope)
        if offered is not None:
            out[name] = offered
    return out


def _offered(name: str, tool: Tool, scope: Sequence[str]) -> Tool | None:
    """``tool`` as ``scope`` offers it: whole, narrowed (a CodeMode's functions, the ``mcp``
    gateway's servers: ``mcp:<server>`` names one it reaches), or not at all (None)."""
    if allows(scope, name, tool):
        return _lent(tool, scope) if isinstance(tool, CodeMode) else tool
    if isinstance(tool, MCPGateway):
        servers = [c for server, c in tool.connections.items() if f"{MCP_PREFIX}{server}" in scope]
        return MCPGateway(servers) if servers else None
    return None


# a CodeMode narrowed to a scope, per CodeMode (by identity, dropped with it) and scope
_LENT: weakref.WeakKeyDictionary[CodeMode, dict[tuple[str, ...], CodeMode]] = weakref.WeakKeyDictionary()


def _lent(mode: CodeMode, scope: Sequence[str]) -> CodeMode:
    """``mode`` with only the tools ``scope`` offers as its program's functions. A program calls
    the run's tool of a name when the run has one, else CodeMode's own (a tool only programs
    have, or one the scope took from the run): without this a scope of ``CodeMode`` alone would
    leave every tool CodeMode was made with (the built-ins, MCP servers' tools) to its programs."""
    kept = [lent for tool in mode.own_tools.values() if (lent := _offered(tool.name, tool, scope)) is not None]
    if len(kept) == len(mode.own_tools) and all(a is b for a, b in zip(kept, mode.own_tools.values(), strict=True)):
        return mode
    made = _LENT.setdefault(mode, {})
    key = tuple(scope)
    narrowed = made.get(key)
    if narrowed is None:
        fresh = CodeMode(
            kept, max_output=mode.max_output, max_calls=mode.max_calls, name=mode.name, sandbox=mode.sandbox
        )
        narrowed = copy.copy(mode)  # (its check, cwd and whatever else it was given stay)
        narrowed.own_tools, narrowed.functions, narrowed.description = (
            fresh.own_tools,
            fresh.functions,
            fresh.description,
        )
        if len(made) >= 64:  # (scopes are few; bounded all the same)
            made.clear()
        made[key] = narrowed
    return narrowed


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


def intersection(
    child: Sequence[str] | None, parent: Sequence[str] | None, tools: Mapping[str, Tool]
) -> list[str] | None:
    """``child`` narrowed to ``parent`` (a parent narrowed: its subagents follow): the entries of
    each that the other covers (``widening``), then the names of ``tools`` both offer that none of
    those covers (one pattern against another, not worked out: only the tools there now). Never
    wider than either; None only when both are."""
    if parent is None:
        return None if child is None else list(child)
    if child is None:
        return list(parent)
    kept = [entry for entry in child if not widening([entry], parent, tools)]
    kept += [entry for entry in parent if entry not in kept and not widening([entry], child, tools)]
    kept += [
        name
        for name, tool in tools.items()
        if name not in kept
        and allows(child, name, tool)
        and allows(parent, name, tool)
        and not allows(kept, name, tool)
    ]
    return kept
