"""agentloop: a durable agent-loop runtime. The library API lives here."""

from agentloop.agent import Agent, AgentBusy, Run, RunResult
from agentloop.loop.guards import Guards
from agentloop.loop.hooks import Block, Hooks, ToolCallInfo, TurnInfo
from agentloop.loop.reveal import ToolReveal
from agentloop.messages import (
    AssistantMessage,
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

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "AgentBusy",
    "AssistantMessage",
    "Block",
    "Guards",
    "Hooks",
    "ImageContent",
    "Message",
    "Model",
    "ModelInfo",
    "Reply",
    "RetryPolicy",
    "Run",
    "RunResult",
    "ScriptedModel",
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
