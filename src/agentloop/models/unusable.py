"""Answers that finished but cannot be used, and why: the one place that decides.

A provider can end a call successfully with nothing the loop can act on: no text and no tool call
(an empty answer, or one that only thought), or text holding the raw markup of a tool call that
the serving stack did not turn into a real one (open-weight models behind OpenAI-compatible
servers leak their chat template's call syntax). Taken as final, such an answer ends the run "ok"
with nothing to show; the loop asks again instead (``loop/model_call.py``). Adapters pass such
answers on as they came, the embedded model (``models/local.py``) included, so every provider is
judged by the same rule.
"""

from __future__ import annotations

import re

from agentloop.messages import AssistantMessage, ThinkingContent

EMPTY = "empty answer"
REASONING_ONLY = "reasoning only"
TOOL_MARKUP = "tool call markup in text"
NAMELESS_CALL = "tool call without a name"

#: the call syntax of chat templates, as it shows when a server fails to parse it
_MARKUP = re.compile(
    "|".join(
        [
            r"</?tool_call>",  # Hermes, Qwen
            r"<\|tool_calls?(?:_\w+)?\|>",  # <|tool_call|>, Kimi's <|tool_calls_section_begin|>
            r"<function=[\w.\-]+>",  # Qwen3-Coder, Llama's function format
            r"<｜tool▁calls?▁begin｜>",  # DeepSeek
            r"\[TOOL_CALLS\]",  # Mistral
            r"<\|python_tag\|>",  # Llama 3
            r"<function_calls>|<invoke name=",  # Claude-style XML
            r"<\|channel\|>commentary to=functions\.",  # gpt-oss (harmony)
        ]
    ),
    re.IGNORECASE,
)
#: fenced blocks and inline code: markup quoted there is being shown, not leaked
_CODE = re.compile(r"```.*?(?:```|\Z)|`[^`\n]+`", re.DOTALL)


def has_tool_markup(text: str) -> bool:
    """Whether ``text`` holds raw tool-call markup outside code (a model that explains a format
    quotes it in code: that is an answer)."""
    return bool(_MARKUP.search(_CODE.sub("", text)))


def unusable(message: AssistantMessage, tools_offered: bool) -> str | None:
    """Why a finished answer cannot be used (``EMPTY``, ``REASONING_ONLY``, ``TOOL_MARKUP``,
    ``NAMELESS_CALL``), or None when it can. Markup counts only when tools were offered: without
    them, text about tool calls is just an answer. An answer cut by the output limit with some
    text is usable. A call whose name never came (a server's garbage) names no tool to run, and
    kept in the history it is replayed with an empty name that providers refuse."""
    if any(not call.name for call in message.tool_calls):
        return NAMELESS_CALL
    if message.tool_calls:
        return None
    if not message.text.strip():
        thought = any(isinstance(b, ThinkingContent) for b in message.content)
        return REASONING_ONLY if thought else EMPTY
    if tools_offered and has_tool_markup(message.text):
        return TOOL_MARKUP
    return None
