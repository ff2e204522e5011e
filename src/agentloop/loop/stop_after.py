"""``StopAfterTools``: end the run once one of the named tools has succeeded.

Some tools are the run's outcome: a "submit" or "final_answer" tool whose arguments are the
result a program waits for. Without this piece the model is called once more only to read its own
result back and say "done", which costs a round trip and tokens. Added with
``agent.use(StopAfterTools("submit"))`` (or given to a kernel, ``pieces=[...]``), it marks a
successful result of those tools ``terminate`` (see ``ToolResult``); the run ends after a turn whose
every result is so marked. A failed call is not marked, so the model can mend its arguments and try
again; and input that waits when the turn ends is still answered.
"""

from __future__ import annotations

from dataclasses import replace

from agentloop.loop.hooks import Hooks, ToolCallInfo
from agentloop.loop.state import LoopConfig
from agentloop.tools.base import ToolResult


class StopAfterTools:
    """A piece (``Agent.use``) that ends the run after a successful call to any of ``names``."""

    def __init__(self, *names: str) -> None:
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError("StopAfterTools needs the names of the tools that end a run")
        self.names = frozenset(names)

    def install(self, config: LoopConfig) -> None:
        config.hooks.after_tool_call(self.after_tool_call)

    def hooks(self) -> Hooks:
        """The piece as ``Hooks``, for a kernel (``Kernel.open(..., hooks=piece.hooks())``)."""
        hooks = Hooks()
        hooks.after_tool_call(self.after_tool_call)
        return hooks

    def after_tool_call(self, info: ToolCallInfo, result: ToolResult) -> ToolResult | None:
        if info.call.name in self.names and not result.is_error and not result.terminate:
            return replace(result, terminate=True)
        return None
