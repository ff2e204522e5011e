"""A small client of the Telegram Bot API: one JSON ``POST`` per method, retried when that helps.

The bot's token is part of every method's address (``/bot<token>/<method>``), so any log line or
error message that quotes a request's URL would give the bot away. The token therefore never
enters httpx's URL: the client addresses ``/bot***/<method>`` and ``_TokenTransport`` writes the
token into the path of the request handed to the connection, after httpx has built (and before it
logs) its own. What httpx logs (``HTTP Request: POST …`` at INFO on the ``httpx`` logger) and what
its exceptions carry show the mask; every message this module makes is passed through ``redact``.
A file a user sent is downloaded the same way (``download``: ``GET /file/bot***/<file path>``, the
token written in by the same transport), streamed and cut off at a limit.

Failures: a network error, an HTTP 5xx and an answer that is not the Bot API's JSON are transient
and retried with exponential backoff; a 429 waits the ``parameters.retry_after`` Telegram asks for;
any other ``ok: false`` (400 bad request, 401 bad token, 403 blocked by the user, 409 another
poller) is permanent and raised at once, since asking again cannot change the answer. A 400 that
names ``parameters.migrate_to_chat_id`` (the group became a supergroup, which has another chat id)
carries that id, so that the caller can send there instead.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from agentloop.channels.clients import Masker, check_backoff
from agentloop.channels.media import FetchFailed, fetch
from agentloop.proxies import env_proxy
from agentloop.urls import MASK, redact_url

log = logging.getLogger("agentloop.channels.botapi")

DEFAULT_API_URL = "https://api.telegram.org"
MAX_RETRY_AFTER = 3600.0  # seconds: a flood wait past an hour is a garbled answer, not advice
_TOKEN = re.compile(r"[A-Za-z0-9:_-]{1,200}")  # what a token may be: it is spliced into a URL path
_MASKED_PATH = f"/bot{MASK}/".encode()
_FILE_PATH = re.compile(r"[A-Za-z0-9_.-][A-Za-z0-9_./-]{0,499}")  # what getFile names ("photos/file_7.jpg")


class BotApiError(Exception):
    """A Bot API call that failed: ``transient`` ones may succeed when asked again (after
    ``retry_after`` seconds when Telegram said how long). ``migrate_to`` is the chat id a group
    that became a supergroup has now (Telegram's ``migrate_to_chat_id``). The message never holds
    the token."""

    def __init__(
        self,
        method: str,
        description: str,
        *,
        code: int | None = None,
        transient: bool = False,
        retry_after: float | None = None,
        migrate_to: int | None = None,
    ) -> None:
        shown = f"{description} (HTTP {code})" if code is not None else description
        super().__init__(f"Telegram {method} failed: {shown}")
        self.method = method
        self.description = description
        self.code = code
        self.transient = transient
        self.retry_after = retry_after
        self.migrate_to = migrate_to


class _TokenTransport(httpx.AsyncBaseTransport):
    """Hands ``inner`` a copy of each request with the mask in its path replaced by the token."""

    def __init__(self, token: str, inner: httpx.AsyncBaseTransport) -> None:
        self._path = f"/bot{token}/".encode()
        self._inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.raw_path.replace(_MASKED_PATH, self._path, 1)
        real = httpx.Request(
            request.method,
            request.url.copy_with(raw_path=path),
            headers=request.headers,
            stream=request.stream,
            extensions=request.extensions,
        )
        return await self._inner.handle_async_request(real)

    async def aclose(self) -> None:
        await self._inner.aclose()


def check_token(token: str) -> str:
    """``token``, or ValueError (which does not quote it) if it cannot be a bot token."""
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise ValueError("the bot token must be the one @BotFather gave (digits, ':', letters, '_' and '-')")
    return token


def check_api_url(url: str) -> str:
    """``url`` without a trailing slash, or ValueError: an http(s) address of a Bot API server."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"the Bot API URL must be an http(s) address, got {redact_url(str(url))!r}")
    return url.rstrip("/")


class BotApi:
    """Calls Bot API methods on ``api_url`` (``DEFAULT_API_URL``, or a local Bot API server, or a
    test's fake) with ``token``. ``backoff`` is (first, longest) wait between retries in seconds;
    ``timeout`` the seconds a call may take unless it says otherwise; ``transport`` replaces the
    network (tests). Close it with ``close``."""

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
        # ``text`` with the token, and its secret half alone (what follows the bot id), masked
        self.redact = Masker(token, token.partition(":")[2])
        inner = transport or httpx.AsyncHTTPTransport(proxy=env_proxy(self.api_url))
        self._client = httpx.AsyncClient(
            base_url=f"{self.api_url}/bot{MASK}/",
            transport=_TokenTransport(token, inner),
            timeout=timeout,
            trust_env=False,  # (the environment's proxy is the transport's, above)
            follow_redirects=False,
        )

    async def close(self) -> None:
        await self._client.aclose()

    async def call(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        attempts: int | None = None,
        http_timeout: float | None = None,
    ) -> Any:
        """The ``result`` of ``method``. Transient failures are logged and retried, up to
        ``attempts`` tries in all (None: until it works, or the caller is cancelled); the last
        one, or a permanent one, raises ``BotApiError``. ``http_timeout``: seconds the request may
        take (``getUpdates`` waits as long as it asked Telegram to)."""
        delay = self.backoff[0]
        tried = 0
        while True:
            tried += 1
            try:
                return await self._once(method, params or {}, http_timeout)
            except BotApiError as exc:
                if not exc.transient or (attempts is not None and tried >= attempts):
                    raise
                wait = exc.retry_after if exc.retry_after is not None else delay
                log.warning("%s; trying again in %.1f s", exc, wait)
                await asyncio.sleep(wait)
                if exc.retry_after is None:
                    delay = min(max(delay * 2, 0.05), self.backoff[1])

    async def download(self, file_path: object, cap: int) -> bytes:
        """The file ``getFile`` named ``file_path``, at most ``cap`` bytes (``media.fetch``:
        ``FetchFailed`` or ``TooLarge``). The token is written into the address by the transport."""
        if (
            not isinstance(file_path, str)
            or not _FILE_PATH.fullmatch(file_path)
            or any(part in ("", ".", "..") for part in file_path.split("/"))
        ):
            raise FetchFailed("Telegram named no file path that can be downloaded", transient=False)
        url = f"{self.api_url}/file/bot{MASK}/{quote(file_path)}"
        request = self._client.build_request("GET", url, headers={"Accept-Encoding": "identity"})
        return await fetch(self._client, request, cap, self.redact)

    async def _once(self, method: str, params: dict[str, Any], http_timeout: float | None) -> Any:
        try:
            if http_timeout is None:
                response = await self._client.post(method, json=params)
            else:
                response = await self._client.post(method, json=params, timeout=http_timeout)
        except httpx.HTTPError as exc:  # connection refused, reset, timed out …
            reason = self.redact(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            raise BotApiError(method, f"network error ({reason})", transient=True) from None
        status = response.status_code
        try:
            body = response.json()
        except ValueError:  # not JSON, or not UTF-8: a proxy's error page, a truncated answer
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("ok"), bool) or (body["ok"] and "result" not in body):
            raise BotApiError(method, "the answer is not the Bot API's JSON", code=status, transient=True)
        if body["ok"]:
            return body["result"]
        code = body.get("error_code")
        code = code if isinstance(code, int) and not isinstance(code, bool) else status
        description = self.redact(str(body.get("description") or "no description"))[:300]
        retry_after: float | None = None
        migrate_to: int | None = None
        parameters = body.get("parameters")
        if isinstance(parameters, dict):
            wait = parameters.get("retry_after")
            if isinstance(wait, int | float) and not isinstance(wait, bool) and math.isfinite(wait):
                retry_after = min(max(float(wait), 0.0), MAX_RETRY_AFTER)
            moved = parameters.get("migrate_to_chat_id")
            if isinstance(moved, int) and not isinstance(moved, bool):
                migrate_to = moved
        limited = 429 in (status, code)
        transient = limited or status >= 500 or code >= 500
        raise BotApiError(
            method,
            description,
            code=code,
            transient=transient,
            retry_after=retry_after if limited else None,
            migrate_to=migrate_to,
        )
