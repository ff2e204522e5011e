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
