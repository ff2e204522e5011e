"""agentloop: a durable agent-loop runtime. The library API lives here."""

from typing import TYPE_CHECKING, Any

from agentloop.agent import Agent, AgentBusy, Run, RunResult
from agentloop.loop.guards import Guards
from agentloop.loop.hooks import Block, Hooks, ToolCallInfo, TurnInfo
from agentloop.loop.output import OutputSpec
from agentloop.loop.reveal import ToolReveal
from agentloop.loop.stop_after import StopAfterTools
from agentloop.messages import (
    AssistantMessage,
    FileContent,
    ImageContent,
    Message,
    SystemMessage,
    TextContent,
    ThinkingContent,
    ToolCall,
    ToolResultMessage,
    Usage,
    UserMessage,
    user,
)
from agentloop.models.base import Model, ModelInfo
from agentloop.models.registry import register_provider, resolve_model
from agentloop.models.retry import RetryPolicy
from agentloop.models.scripted import Reply, ScriptedModel, call
from agentloop.tools.base import Tool, ToolContext, ToolError, ToolResult, tool

if TYPE_CHECKING:
    from agentloop.kernel import Kernel, NoSuchProcess, Process, Receipt, Signal

__version__ = "0.1.0"

# The durable side (store, approvals, shell parser) costs a few hundred milliseconds to import, so
# ``from agentloop import Kernel`` loads it on first use instead of with every ``import agentloop``.
_KERNEL_NAMES = frozenset({"Kernel", "NoSuchProcess", "Process", "Receipt", "Signal"})


def __getattr__(name: str) -> Any:
    if name in _KERNEL_NAMES:
        from agentloop import kernel

        return getattr(kernel, name)
    raise AttributeError(f"module 'agentloop' has no attribute {name!r}")


__all__ = [
    "Agent",
    "AgentBusy",
    "AssistantMessage",
    "Block",
    "FileContent",
    "Guards",
    "Hooks",
    "ImageContent",
    "Kernel",
    "Message",
    "Model",
    "ModelInfo",
    "NoSuchProcess",
    "OutputSpec",
    "Process",
    "Receipt",
    "Reply",
    "RetryPolicy",
    "Run",
    "RunResult",
    "ScriptedModel",
    "Signal",
    "StopAfterTools",
    "SystemMessage",
    "TextContent",
    "ThinkingContent",
    "Tool",
    "ToolCall",
    "ToolCallInfo",
    "ToolContext",
    "ToolError",
    "ToolResult",
    "ToolResultMessage",
    "ToolReveal",
    "TurnInfo",
    "Usage",
    "UserMessage",
    "call",
    "register_provider",
    "resolve_model",
    "tool",
    "user",
]
