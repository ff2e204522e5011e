"""URLs as errors and logs may show them: credentials masked. A URL from a config file or an
environment variable may carry a password (``https://user:secret@host``) or a key in its query
(``?api_key=...``); an error message that repeats it puts the secret in a terminal or a log."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"

# query parameters whose values are credentials (api_key, access_token, X-Amz-Signature, ...)
_SECRET_PARAM = re.compile(r"key|token|secret|passw|pwd|sig|auth|credential|session", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with the password of its userinfo and the values of credential-like query
    parameters masked; a URL that cannot be parsed is not shown at all."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            userinfo, _, hostport = netloc.rpartition("@")
            netloc = f"{userinfo.split(':', 1)[0]}:{MASK}@{hostport}"
        query = parts.query
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_SECRET_PARAM.search(k) for k, _ in pairs):
            query = urlencode([(k, MASK if _SECRET_PARAM.search(k) else v) for k, v in pairs], safe="*/")
        shown = urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return "<a URL that cannot be parsed>"
    if parts.scheme and not netloc and url.startswith(f"{parts.scheme}://"):
        shown = shown.replace(f"{parts.scheme}:", f"{parts.scheme}://", 1)  # keep an empty authority
    return shown


# credentials as error texts carry them: a bearer header, a vendor key (sk-..., sk-ant-..., AIza...),
# a ``key=value`` or ``"token": "..."`` pair, a long opaque string (a key, a signature)
_CREDENTIAL = re.compile(
    r"(?i)\bbearer\s+[^\s\"',]+"
    r"|\b(?:sk|pk|rk)-[A-Za-z0-9_\-]{6,}"
    r"|\bAIza[A-Za-z0-9_\-]{20,}"
    r"|(?<![A-Za-z0-9_\-])[A-Za-z0-9_\-]{32,}(?![A-Za-z0-9_\-])"
)
_CREDENTIAL_PAIR = re.compile(
    r"(?i)\b((?:api[_-]?key|access[_-]?token|token|secret|password|authorization)[\"']?\s*[=:]\s*[\"']?)[^\s\"',}]+"
)
_URL_IN_TEXT = re.compile(r"\bhttps?://[^\s\"'<>]+")


def redact_secrets(text: str) -> str:
    """``text`` (an error message from a provider or a library) with what looks like a credential
    masked: in URLs as ``redact_url`` does, bearer tokens, vendor keys, ``key=value`` pairs and
    long opaque strings. Such a message is stored and shown to the process's owner, who on a
    server is not the operator whose key it may quote; the rest of it stays readable."""
    text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    text = _CREDENTIAL.sub(MASK, text)
    return _CREDENTIAL_PAIR.sub(lambda m: m.group(1) + MASK, text)


def check_server_address(url: str, schemes: tuple[str, ...] = ("http", "https")) -> None:
    """Raise ``ValueError`` for an address no connection can be made to (a wrong scheme, no host,
    a port outside 1-65535): a typo, to report as such, not as a server that cannot be reached."""
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError for a port that is not a number or out of 0-65535
    except ValueError as exc:
        raise ValueError(f"not a server address: {redact_url(url)!r} ({exc})") from None
    if parts.scheme not in schemes or not parts.hostname:
        raise ValueError(f"not a server address: {redact_url(url)!r} (use {schemes[0]}://host:port)")
    if port == 0:
        raise ValueError(f"not a server address: {redact_url(url)!r} (port 0)")


def check_token(token: str) -> None:
    """Raise ``ValueError`` for a token that cannot travel in an HTTP header. Tokens are printable
    ASCII; anything else is a paste gone wrong, and the message must not repeat it."""
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise ValueError("the token holds characters a token never has (spaces, control or non-ASCII characters)")
