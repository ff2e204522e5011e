"""Recognising "the context does not fit": provider error texts, or usage above the window."""

from __future__ import annotations

import re

from agentloop.messages import AssistantMessage

_PATTERNS = re.compile(
    "|".join(
        [
            r"prompt is too long",
            r"input is too long for requested model",
            r"exceeds the context window",
            r"input token count.*exceeds the maximum",
            r"maximum prompt length is \d+",
            r"reduce the length of the messages",
            r"maximum context length is \d+ tokens",
            r"exceeds the limit of \d+",
            r"exceeds the available context size",
            r"greater than the context length",
            r"context window exceeds limit",
            r"exceeded model token limit",
            r"too large for model with \d+ maximum context length",
            r"model_context_window_exceeded",
            r"context[_ ]length[_ ]exceeded",
            r"too many tokens",
            r"token limit exceeded",
            r"requested tokens \(\d+\) exceed context window",
            r"model only supports up to \d+",  # Vertex AI's Gemini
            r"input length and `?max_tokens`? exceed context limit",  # Anthropic: input + max_tokens > window
        ]
    ),
    re.IGNORECASE,
)
_NO_BODY = re.compile(r"^4(00|13)\s*(status code)?\s*\(no body\)", re.IGNORECASE)


def is_overflow_text(text: str) -> bool:
    """True when a provider's error text says the prompt is larger than the model's window."""
    return bool(_PATTERNS.search(text) or _NO_BODY.search(text))


def is_context_overflow(message: AssistantMessage, context_window: int | None = None) -> bool:
    """An error that reads like an overflow, or a success whose input exceeded the window
    (some servers truncate silently and only the usage gives it away)."""
    if message.stop_reason == "error":
        return bool(message.error_message and is_overflow_text(message.error_message))
    if context_window and message.stop_reason == "stop":
        return message.usage.input + message.usage.cache_read > context_window
    return False
