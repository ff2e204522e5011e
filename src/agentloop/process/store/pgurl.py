"""PostgreSQL URLs as the store shows them: with the password replaced, so errors and logs never
carry it (a DSN may hold it in the authority, ``user:secret@host``, or in ``?password=``).
``redact`` is the URL masking every error uses (``agentloop.urls``); ``scrub`` also masks the
password wherever a driver's message repeats it."""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlsplit

from agentloop.urls import MASK
from agentloop.urls import redact_url as redact

__all__ = ["MASK", "redact", "scrub", "secrets_of"]


def secrets_of(dsn: str) -> list[str]:
    """The passwords a DSN holds, as written and decoded (to scrub them from any message)."""
    try:
        parts = urlsplit(dsn)
        found = [parts.password or ""]
        found += [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k == "password"]
    except ValueError:
        return []
    found += [unquote(s) for s in found]
    return sorted({s for s in found if s}, key=len, reverse=True)


def scrub(text: str, dsn: str) -> str:
    """``text`` (an error message, say) with the DSN's passwords masked."""
    for secret in secrets_of(dsn):
        text = text.replace(secret, MASK)
    return text
