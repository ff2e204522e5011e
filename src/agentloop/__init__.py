"""agentloop: a durable agent-loop runtime. The library API lives here."""

from __future__ import annotations

# Not ``from typing import TYPE_CHECKING``: typing (and the re module it imports) is most of what
# importing this package would cost; type checkers take this name for typing's just the same.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from agentloop.agent import Agent, AgentBusy, Run, RunResult
    from agentloop.conversation import Conversation, ConversationBusy
    from agentloop.kernel import Kernel, NoSuchProcess, Process, Receipt, Signal
    from agentloop.loop.compaction import Compaction
    from agentloop.loop.guards import Guards
    from agentloop.loop.hooks import (
        Block,
        Handled,
        Hooks,
        InputInfo,
        InputRejected,
        Rewrite,
        Stop,
        ToolCallInfo,
        TurnInfo,
    )
    from agentloop.loop.output import OutputSpec
    from agentloop.loop.reveal import ToolReveal
    from agentloop.loop.stop_after import StopAfterTools
    from agentloop.loop.tool_retry import ToolRetry
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
    from agentloop.process.audio_video import AudioContent, VideoContent
    from agentloop.tools.base import Tool, ToolContext, ToolError, ToolResult, tool

__version__ = "0.1.0"

# Nothing is imported with the package itself: ``import agentloop`` (which every ``agentloop.x``
# import runs first) costs a few milliseconds, and each name loads its module on first use. The
# command line relies on it: its entry point (``agentloop.cli.entry``) can only guard against an
# early Ctrl-C once its packages are imported, so a Ctrl-C while they were importing (the half
# second this once took) printed a traceback. The durable side (the kernel) loads no sooner.
_LAZY: dict[str, str] = {
    "Agent": "agentloop.agent",
    "AgentBusy": "agentloop.agent",
    "Run": "agentloop.agent",
    "RunResult": "agentloop.agent",
    "Conversation": "agentloop.conversation",
    "ConversationBusy": "agentloop.conversation",
    "Compaction": "agentloop.loop.compaction",
    "Guards": "agentloop.loop.guards",
    "Block": "agentloop.loop.hooks",
    "Handled": "agentloop.loop.hooks",
    "Hooks": "agentloop.loop.hooks",
    "InputInfo": "agentloop.loop.hooks",
    "InputRejected": "agentloop.loop.hooks",
    "Rewrite": "agentloop.loop.hooks",
    "Stop": "agentloop.loop.hooks",
    "ToolCallInfo": "agentloop.loop.hooks",
    "TurnInfo": "agentloop.loop.hooks",
    "OutputSpec": "agentloop.loop.output",
    "ToolReveal": "agentloop.loop.reveal",
    "StopAfterTools": "agentloop.loop.stop_after",
    "ToolRetry": "agentloop.loop.tool_retry",
    "AssistantMessage": "agentloop.messages",
    "FileContent": "agentloop.messages",
    "ImageContent": "agentloop.messages",
    "Message": "agentloop.messages",
    "SystemMessage": "agentloop.messages",
    "TextContent": "agentloop.messages",
    "ThinkingContent": "agentloop.messages",
    "ToolCall": "agentloop.messages",
    "ToolResultMessage": "agentloop.messages",
    "Usage": "agentloop.messages",
    "UserMessage": "agentloop.messages",
    "user": "agentloop.messages",
    "Model": "agentloop.models.base",
    "ModelInfo": "agentloop.models.base",
    "register_provider": "agentloop.models.registry",
    "resolve_model": "agentloop.models.registry",
    "RetryPolicy": "agentloop.models.retry",
    "Reply": "agentloop.models.scripted",
    "ScriptedModel": "agentloop.models.scripted",
    "call": "agentloop.models.scripted",
    "AudioContent": "agentloop.process.audio_video",
    "VideoContent": "agentloop.process.audio_video",
    "Tool": "agentloop.tools.base",
    "ToolContext": "agentloop.tools.base",
    "ToolError": "agentloop.tools.base",
    "ToolResult": "agentloop.tools.base",
    "tool": "agentloop.tools.base",
    "Kernel": "agentloop.kernel",
    "NoSuchProcess": "agentloop.kernel",
    "Process": "agentloop.kernel",
    "Receipt": "agentloop.kernel",
    "Signal": "agentloop.kernel",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agentloop' has no attribute {name!r}")
    import importlib  # (here, not above: it imports the warnings module, all that the package would cost)

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # (looked up once)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "Agent",
    "AgentBusy",
    "AssistantMessage",
    "AudioContent",
    "Block",
    "Compaction",
    "Conversation",
    "ConversationBusy",
    "FileContent",
    "Guards",
    "Handled",
    "Hooks",
    "ImageContent",
    "InputInfo",
    "InputRejected",
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
    "Rewrite",
    "Run",
    "RunResult",
    "ScriptedModel",
    "Signal",
    "Stop",
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
    "ToolRetry",
    "ToolReveal",
    "TurnInfo",
    "Usage",
    "UserMessage",
    "VideoContent",
    "call",
    "register_provider",
    "resolve_model",
    "tool",
    "user",
]
