"""PostgreSQL URLs as the store shows them: with the password replaced, so errors and logs never
carry it (a DSN may hold it in the authority, ``user:secret@host``, or in ``?password=``)."""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

MASK = "***"


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


def redact(dsn: str) -> str:
    """The DSN with every password masked; a DSN that cannot be parsed is not shown at all."""
    try:
        parts = urlsplit(dsn)
        netloc = parts.netloc
        if parts.password is not None:
            userinfo, _, hostport = netloc.rpartition("@")
            user = userinfo.split(":", 1)[0]
            netloc = f"{user}:{MASK}@{hostport}"
        query = parts.query
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k == "password" for k, _ in pairs):
            query = urlencode([(k, MASK if k == "password" else v) for k, v in pairs], safe="*/")
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return "<a PostgreSQL URL that cannot be parsed>"


def scrub(text: str, dsn: str) -> str:
    """``text`` (an error message, say) with the DSN's passwords masked."""
    for secret in secrets_of(dsn):
        text = text.replace(secret, MASK)
    return text
