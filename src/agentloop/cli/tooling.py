"""The tools a command adds to the built-ins: the configured MCP servers' and, when the config
says ``codemode = true``, CodeMode over all of them. One place, so ``run``, ``chat`` and ``serve``
offer the model the same tools."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from agentloop.cli.config import Settings
from agentloop.tools.base import Tool
from agentloop.tools.builtin import builtin_tools
from agentloop.tools.mcp import mcp_tools


@contextlib.asynccontextmanager
async def extra_tools(settings: Settings, workspace: Path) -> AsyncIterator[list[Tool]]:
    """Start the MCP servers (stopped on exit) and yield the tools to add to the built-ins."""
    async with mcp_tools(settings.mcp_servers) as mcp:
        extra: list[Tool] = list(mcp)
        if settings.codemode:
            from agentloop.tools.codemode import CodeMode

            builtins = builtin_tools(
                workspace,
                fetch_allow=settings.fetch_allow,
                shell_sandbox=settings.shell_sandbox,
                shell_sandbox_read=settings.shell_sandbox_read,
            )
            extra.append(
                CodeMode(
                    [*builtins, *mcp],
                    cwd=workspace,
                    sandbox=settings.shell_sandbox,
                    sandbox_read=settings.shell_sandbox_read,
                )
            )
        yield extra
