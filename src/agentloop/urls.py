"""URLs as errors and logs may show them: credentials masked. A URL from a config file or an
environment variable may carry a password (``https://user:secret@host``) or a key in its query
(``?api_key=...``); an error message that repeats it puts the secret in a terminal or a log."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"

# What names a credential, in a query parameter (api_key, access_token, X-Amz-Signature), an
# environment variable (OPENAI_API_KEY, NPM_CONFIG__AUTH, DB_PASS, MYSQL_PWD) or a ``key=value``
# pair: one of these words of the name (GIT_AUTHOR_NAME holds none: AUTHOR is not AUTH), or one of
# the parts.
_SECRET_WORD = re.compile(
    r"KEYS?|TOKENS?|SECRETS?|PASSWORDS?|PASSWDS?|PASS|PWD|PASSPHRASE|COOKIES?|CREDENTIALS?|AUTH|AUTHORIZATION"
    r"|SIG|SIGNATURE|SESSION|PAT|DSN",
    re.IGNORECASE,
)
# PWD alone is the shell's working directory, no password (MYSQL_PWD is one)
_NOT_SECRET = frozenset({"PWD"})
_SECRET_PARTS = re.compile(r"apikey|accesskey|secret|passw|token|credential", re.IGNORECASE)
_WORD_BREAK = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z])(?=[A-Z])")
# a URL's user that is a token rather than a name (https://ghp_...@github.com): long, or shaped
# like a vendor's token
_TOKEN_USER = re.compile(r".{20,}|(gh[pousr]|github_pat|glpat|xox[abp])[_-].+")


def secret_name(name: str) -> bool:
    """Whether ``name`` (a parameter's, a variable's, a field's) names a credential."""
    if name.upper() in _NOT_SECRET:
        return False
    return any(_SECRET_WORD.fullmatch(word) for word in _WORD_BREAK.split(name)) or bool(_SECRET_PARTS.search(name))


def redact_url(url: str) -> str:
    """``url`` with the password of its userinfo (or a user that is a token), and the values of
    credential-like query parameters masked; a URL that cannot be parsed is not shown at all."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            userinfo, _, hostport = netloc.rpartition("@")
            netloc = f"{userinfo.split(':', 1)[0]}:{MASK}@{hostport}"
        elif parts.username is not None and _TOKEN_USER.fullmatch(parts.username):
            netloc = f"{MASK}@{netloc.rpartition('@')[2]}"
        query = parts.query
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(secret_name(k) for k, _ in pairs):
            query = urlencode([(k, MASK if secret_name(k) else v) for k, v in pairs], safe="*/")
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
# name=value, "name": "value", NAME="quoted value": a quoted value is masked whole (to the line's
# end when its quote is not closed: a text cut short)
_PAIR = re.compile(r"""\b([A-Za-z][\w.-]*)(["']?\s*[=:]\s*)("[^"\n]*"?|'[^'\n]*'?|[^\s"',}]+)""")
# any scheme's URL: a DSN (postgresql://user:pass@db, redis://:pass@cache) carries a password as
# often as a web address does
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")
# a command's own password options, which name no credential: mysql's ``-p<password>`` (glued:
# ``-p`` alone asks for it) and ``-u``/``--user user:password`` (curl and the like; not a URL's
# ``scheme://``, which the URL rule reads)
_MYSQL_PASSWORD = re.compile(r"(?i)\b((?:mysql|mariadb)[\w-]*\b[^\n;&|]*?\s-p)([^\s\"']+)")
_USER_PASSWORD = re.compile(r"""(?<![\w-])((?:-u|--user)(?:\s+|=)["']?[^\s:"']*:["']?)(?!//)([^\s"']+)""")


def redact_secrets(text: str) -> str:
    """``text`` (an error message from a provider or a library) with what looks like a credential
    masked: in URLs as ``redact_url`` does, bearer tokens, vendor keys, ``key=value`` pairs and
    long opaque strings. Such a message is stored and shown to the process's owner, who on a
    server is not the operator whose key it may quote; the rest of it stays readable."""
    text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    text = _CREDENTIAL.sub(MASK, text)
    text = _MYSQL_PASSWORD.sub(lambda m: m.group(1) + MASK, text)
    text = _USER_PASSWORD.sub(lambda m: m.group(1) + MASK, text)
    return _PAIR.sub(_masked_pair, text)


def _masked_pair(match: re.Match[str]) -> str:
    name, between, value = match.groups()
    if not secret_name(name):
        return match.group(0)
    quote = value[0] if value[0] in "\"'" else ""
    return f"{name}{between}{quote}{MASK}{quote}"


def carries_secret(text: str) -> bool:
    """Whether ``text`` (a setting's value) holds a URL with a credential in it."""
    return any(redact_url(m.group(0)) != m.group(0) for m in _URL_IN_TEXT.finditer(text)) or bool(
        re.search(r"://[^/@\s]*:[^/@\s]*@", text)  # (schemes urlsplit reads no userinfo of)
    )


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
