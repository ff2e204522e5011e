"""A small client of Discord's HTTP API (v10, JSON): one request per call, retried when that helps.

The bot token travels in the ``Authorization: Bot <token>`` header, never in a URL, so what httpx
logs (``HTTP Request: POST …``) does not show it. Every message this module makes is passed
through ``redact`` all the same, in case an error's text quotes it. An interaction's token (what
answering a button press takes, valid for 15 minutes) is part of its callback's address; like the
Telegram client's token (``botapi``) it never enters httpx's URL: the client addresses
``/interactions/<id>/***/callback`` and ``_PathSecretTransport`` writes the token into the path of
the request handed to the connection, after httpx has built (and before it logs) its own.

Failures: a network error, an HTTP 5xx and a 429 are transient and retried, a 429 after the
``retry_after`` seconds Discord's JSON body asks for (else its ``Retry-After`` header, else the
backoff); anything else (401: the token was refused, 403: the bot lacks access or a permission,
404: the channel or the interaction is gone, 400: a message Discord will not take) is permanent and
raised at once, since asking again cannot change the answer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx

from agentloop.channels.clients import Masker, check_backoff
from agentloop.proxies import env_proxy
from agentloop.urls import MASK, redact_url

log = logging.getLogger("agentloop.channels.discord_api")

DEFAULT_API_URL = "https://discord.com/api/v10"
MAX_RETRY_AFTER = 3600.0  # seconds: a rate-limit wait past an hour is a garbled answer, not advice
USER_AGENT = "DiscordBot (https://github.com/agentloop/agentloop, 0.1)"  # the form Discord asks for
# what a bot token may be: three base64url parts joined by dots (checked loosely: Discord may
# change their lengths, and a wrong token is refused by Discord with a clear 401 anyway)
_TOKEN = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+){1,4}")
_PATH_TOKEN = re.compile(r"[A-Za-z0-9._-]{1,500}")  # an interaction token, as it may sit in a path
_PATH_SECRET = "agentloop.path_secret"  # the request extension carrying the path's secret
_MASKED = f"/{MASK}/".encode()
_PERMANENT = {
    401: "the bot token was refused (401 Unauthorized)",
    403: "the bot lacks access or a permission there (403 Forbidden)",
    404: "not found (404): the channel, message or interaction is gone or out of the bot's reach",
}


class DiscordError(Exception):
    """A Discord call (or the gateway) that failed: ``transient`` ones may succeed when asked
    again (after ``retry_after`` seconds when Discord said how long). ``status`` is the HTTP
    status, ``code`` Discord's JSON error code or a gateway close code. The message never holds
    the token."""

    def __init__(
        self,
        what: str,
        description: str,
        *,
        status: int | None = None,
        code: int | None = None,
        transient: bool = False,
        retry_after: float | None = None,
    ) -> None:
        shown = description
        if code is not None and status is not None:
            shown += f" (code {code})"
        super().__init__(f"Discord {what} failed: {shown}")
        self.what = what
        self.description = description
        self.status = status
        self.code = code
        self.transient = transient
        self.retry_after = retry_after


def check_token(token: str) -> str:
    """``token``, or ValueError (which does not quote it) if it cannot be a bot token."""
    if not isinstance(token, str) or len(token) > 300 or not _TOKEN.fullmatch(token):
        raise ValueError(
            "the bot token must be the one the Discord Developer Portal gave (Bot → Reset Token): "
            "letters, digits, '_' and '-' in parts joined by dots"
        )
    return token


def check_api_url(url: str) -> str:
    """``url`` without a trailing slash, or ValueError: an http(s) address of Discord's API."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"the Discord API URL must be an http(s) address, got {redact_url(str(url))!r}")
    return url.rstrip("/")


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return min(max(number, 0.0), MAX_RETRY_AFTER) if math.isfinite(number) else None


class _PathSecretTransport(httpx.AsyncBaseTransport):
    """Hands ``inner`` each request that carries a path secret (in its extensions) with the mask
    in its path replaced by that secret; other requests as they are."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        secret = request.extensions.get(_PATH_SECRET)
        if not isinstance(secret, str):
            return await self._inner.handle_async_request(request)
        path, mark, query = request.url.raw_path.partition(b"?")
        if path.endswith(_MASKED[:-1]):  # (the secret ends the path: a followup's address)
            path = path[: -len(MASK)] + secret.encode()
        else:
            path = path.replace(_MASKED, f"/{secret}/".encode(), 1)
        path += mark + query
        real = httpx.Request(
            request.method,
            request.url.copy_with(raw_path=path),
            headers=request.headers,
            stream=request.stream,
            extensions={k: v for k, v in request.extensions.items() if k != _PATH_SECRET},
        )
        return await self._inner.handle_async_request(real)

    async def aclose(self) -> None:
        await self._inner.aclose()


class DiscordApi:
    """Calls Discord's HTTP API at ``api_url`` (``DEFAULT_API_URL``, or a test's fake) as the bot
    ``token``. ``backoff`` is (first, longest) wait between retries in seconds; ``timeout`` the
    seconds a request may take; ``transport`` replaces the network (tests). Close it with ``close``."""

    def __init__(
        self,
        token: str,
        api_url: str = DEFAULT_API_URL,
        *,
        backoff: tuple[float, float] = (1.0, 30.0),
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        check_token(token)
        self.backoff = check_backoff(backoff)
        self.api_url = check_api_url(api_url)
        self.token = token
        # ``text`` with the token, and its last part alone (the signature: what makes it a
        # secret), masked: messages may quote either
        secret = token.rpartition(".")[2]
        self.redact = Masker(token, secret if len(secret) >= 8 else token)
        inner = transport or httpx.AsyncHTTPTransport(proxy=env_proxy(self.api_url))
        self._client = httpx.AsyncClient(
            base_url=f"{self.api_url}/",
            headers={"Authorization": f"Bot {token}", "User-Agent": USER_AGENT},
            transport=_PathSecretTransport(inner),
            timeout=timeout,
            trust_env=False,  # (the environment's proxy is the transport's, above)
            follow_redirects=False,  # (a redirect elsewhere would carry the token there)
        )

    async def close(self) -> None:
        await self._client.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str | int] | None = None,
        attempts: int | None = None,
        path_secret: str | None = None,
    ) -> Any:
        """The JSON answer to ``method`` ``path`` (relative to the API URL; None for an empty
        answer). Transient failures are logged and retried, up to ``attempts`` tries in all
        (None: until it works, or the caller is cancelled); the last one, or a permanent one,
        raises ``DiscordError``. ``path_secret`` is put where ``path`` has ``***`` (an interaction
        token), out of sight of httpx's logs and of every message."""
        if path_secret is not None and (not _PATH_TOKEN.fullmatch(path_secret) or ".." in path_secret):
            raise DiscordError(f"{method} {path}", "the token in the address is malformed")
        delay = self.backoff[0]
        tried = 0
        while True:
            tried += 1
            try:
                return await self._once(method, path, json, params, path_secret)
            except DiscordError as exc:
                if not exc.transient or (attempts is not None and tried >= attempts):
                    raise
                wait = exc.retry_after if exc.retry_after is not None else delay
                log.warning("%s; trying again in %.1f s", exc, wait)
                await asyncio.sleep(wait)
                if exc.retry_after is None:
                    delay = min(max(delay * 2, 0.05), self.backoff[1])

    async def _once(
        self,
        method: str,
        path: str,
        body: Any,
        params: Mapping[str, str | int] | None,
        path_secret: str | None,
    ) -> Any:
        what = f"{method} {path}"
        extensions = {_PATH_SECRET: path_secret} if path_secret is not None else None
        try:
            response = await self._client.request(
                method, path.lstrip("/"), json=body, params=dict(params) if params else None, extensions=extensions
            )
        except httpx.HTTPError as exc:  # connection refused, reset, timed out …
            reason = self.redact(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            if path_secret:  # (an error that quotes the address the transport made)
                reason = reason.replace(path_secret, MASK)
            raise DiscordError(what, f"network error ({reason})", transient=True) from None
        status = response.status_code
        try:
            answer = response.json() if response.content else None
        except ValueError:  # a proxy's error page, a truncated answer
            answer = None
        if 200 <= status < 300:
            return answer
        message = _field(answer, "message")
        code = _field(answer, "code")
        code = code if isinstance(code, int) and not isinstance(code, bool) else None
        said = self.redact(str(message))[:300] if message else ""
        if status == 429:
            wait = _number(_field(answer, "retry_after"))
            if wait is None:
                wait = _number(response.headers.get("retry-after"))
            scope = " (global)" if _field(answer, "global") is True else ""
            description = f"rate limited{scope} (429)"
            raise DiscordError(what, description, status=status, code=code, transient=True, retry_after=wait)
        if status >= 500:
            description = f"server error ({status}{': ' + said if said else ''})"
            raise DiscordError(what, description, status=status, code=code, transient=True)
        description = _PERMANENT.get(status, f"refused ({status})")
        if said:
            description += f": {said}"
        raise DiscordError(what, description, status=status, code=code)


def _field(value: object, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else None
