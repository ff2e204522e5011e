"""A denial with a message for the model ("no, use the staging database instead"): checking the
words a person gave, and the tool result that carries them.

The message reaches the model inside the denied call's result, so it is told apart from tool
output there: the result says the user denied the call and that what follows is the user's own
words, which the model should act on as it would on a user message."""

from __future__ import annotations

import unicodedata

DENIED_BY_USER = "Tool execution denied by user"
MAX_DENIAL_MESSAGE = 2000  # characters: a reason, not a document; longer belongs in a message
_KEPT_CONTROLS = frozenset("\n\t")


def denial_message(message: object) -> str | None:
    """``message`` as it will reach the model: stripped, line ends made ``\\n``; None when there
    is none (None or blank). Raises ``TypeError`` for a non-string and ``ValueError`` for one
    that is too long or holds control characters (escape sequences, NUL), which a person does
    not type and which would reach the model unseen."""
    if message is None:
        return None
    if not isinstance(message, str):
        raise TypeError(f"message must be a string, got {type(message).__name__}")
    text = message.replace("\r\n", "\n").replace("\r", "\n").strip()
    if not text:
        return None
    if len(text) > MAX_DENIAL_MESSAGE:
        raise ValueError(f"message is {len(text)} characters long; at most {MAX_DENIAL_MESSAGE} are allowed")
    bad = next((c for c in text if unicodedata.category(c) == "Cc" and c not in _KEPT_CONTROLS), None)
    if bad is not None:
        raise ValueError(f"message holds the control character U+{ord(bad):04X}; only newlines and tabs are allowed")
    return text


def denial_text(message: str | None) -> str:
    """The denied call's result text: the plain denial, or the denial and the user's words."""
    if message is None:
        return DENIED_BY_USER
    return f"{DENIED_BY_USER}, with this message from the user:\n\n{message}"
