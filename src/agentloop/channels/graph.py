"""A small client of the WhatsApp Business Cloud API (Meta's Graph API): sends a phone number's
messages, retried when that helps.

The access token travels in the ``Authorization`` header, never in a URL, so what httpx logs
(``HTTP Request: POST …``) does not show it; every message this module makes is passed through
``redact`` all the same, in case an error's text quotes it.

Failures: a network error, an HTTP 5xx, an answer that is not JSON, a 429 and the Graph error
codes that mean "too many messages" (4, 80007, 130429, 131056) or that Graph marks
``is_transient`` are retried with exponential backoff; anything else (a bad token, a number that
is not on WhatsApp, a re-engagement window that closed) is permanent and raised at once.

A file a user sent is fetched in two steps (``media``, then ``download``): ``GET /<media id>`` names
its address, which is downloaded with the same bearer token (Meta requires it), so the address must
be on one of Meta's hosts (``media_hosts``; or the Graph URL's own host, for a test's fake): the
token is never sent anywhere a message names. The download is streamed and cut off at a limit.

``check`` asks Graph once, at start, whether it takes the token and knows the number (``GET
/<phone number id>/whatsapp_business_profile``, the cheapest read on the number a messaging token
may make): a wrong token would otherwise show only when the first answer to a user fails.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx

from agentloop.channels.clients import Masker, check_backoff
from agentloop.channels.media import FetchFailed, fetch
from agentloop.urls import redact_url

log = logging.getLogger("agentloop.channels.graph")

DEFAULT_GRAPH_URL = "https://graph.facebook.com"
DEFAULT_API_VERSION = "v21.0"
RATE_LIMITS = frozenset({4, 80007, 130429, 131056})  # Graph error codes that mean "slow down"
TOKEN_REFUSED = 190  # Graph's code for an access token it does not take (expired, revoked, mistyped)
NO_OBJECT = (100, 33)  # (code, subcode): the id names nothing this token can see
CHECK_TIMEOUT = 10.0  # seconds the start-up check waits: a start should not hang on a dead network
_ID = re.compile(r"[0-9]{1,32}")  # a phone number id (and a wa_id: digits)
_VERSION = re.compile(r"v[0-9]{1,3}\.[0-9]{1,3}")
_MEDIA_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
# where Graph's media addresses point (lookaside.fbsbx.com): the token is sent there, nowhere else
MEDIA_HOSTS = ("fbsbx.com", "facebook.com", "fbcdn.net", "whatsapp.net")


class GraphError(Exception):
    """A Graph API call that failed: ``transient`` ones may succeed when asked again. The message
    never holds the access token."""

    def __init__(
        self,
        description: str,
        *,
        status: int | None = None,
        code: int | None = None,
        transient: bool = False,
        what: str = "send",
        subcode: int | None = None,
    ) -> None:
        shown = description
        if code is not None:
            shown += f" (code {code})"
        if status is not None:
            shown += f" (HTTP {status})"
        super().__init__(f"WhatsApp {what} failed: {shown}")
        self.description = description
        self.status = status
        self.code = code
        self.subcode = subcode
        self.transient = transient


class CredentialsRefused(ValueError):
    """Graph refused the access token, or does not know the phone number id: the bridge could
    answer nobody with them. A ValueError, as a wrong setting is, so that the command line says it
    in one line; the message never holds the token."""


def check_graph_url(url: str) -> str:
    """``url`` without a trailing slash, or ValueError: an http(s) address of the Graph API."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"the Graph API URL must be an http(s) address, got {redact_url(str(url))!r}")
    return url.rstrip("/")


def check_phone_number_id(value: str) -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise ValueError("the phone number id must be the digits Meta shows for the WhatsApp number")
    return value


def check_api_version(value: str) -> str:
    if not isinstance(value, str) or not _VERSION.fullmatch(value):
        raise ValueError(f"the Graph API version must look like v21.0, got {value!r}")
    return value


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def refusal(exc: GraphError, phone_number_id: str) -> str | None:
    """What ``exc`` (the start-up check's failure) says is wrong with the bridge's settings, None
    when it does not say they are wrong (a network error, a rate limit, a missing permission …)."""
    if exc.code == TOKEN_REFUSED or exc.status == 401:
        return f"the access token was refused by the Graph API ({exc.description}); give a valid one"
    if (exc.code, exc.subcode) == NO_OBJECT:
        return (
            f"the Graph API does not know the phone number id {phone_number_id} (or this access token may not"
            " use it): give the id Meta shows for the WhatsApp number, not the number"
        )
    return None


class GraphApi:
    """Sends messages from ``phone_number_id`` with ``token``, through ``graph_url`` (Meta, or a
    test's fake) at ``api_version``. ``backoff`` is (first, longest) wait between retries in
    seconds; ``media_hosts`` the hosts (and their subdomains) a media address may be on. Close it
    with ``close``."""

    def __init__(
        self,
        token: str,
        phone_number_id: str,
        *,
        graph_url: str = DEFAULT_GRAPH_URL,
        api_version: str = DEFAULT_API_VERSION,
        backoff: tuple[float, float] = (1.0, 30.0),
        timeout: float = 30.0,
        secrets: tuple[str, ...] = (),
        media_hosts: Sequence[str] = MEDIA_HOSTS,
    ) -> None:
        if not isinstance(token, str) or not token.strip() or any(c.isspace() or not c.isprintable() for c in token):
            raise ValueError("the access token must be the one Meta gave (no spaces)")
        self.backoff = check_backoff(backoff)
        self.phone_number_id = check_phone_number_id(phone_number_id)
        self.graph_url = check_graph_url(graph_url)
        self.api_version = check_api_version(api_version)
        self.media_hosts = tuple(h.lower().strip(".") for h in media_hosts)
        self.redact = Masker(token, *secrets)  # ``text`` with the token (and the other secrets given) masked
        self._client = httpx.AsyncClient(
            base_url=f"{self.graph_url}/{self.api_version}/{self.phone_number_id}/",
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            follow_redirects=False,  # (a redirect elsewhere would carry the token there)
        )

    async def close(self) -> None:
        await self._client.aclose()

    async def send(self, message: dict[str, Any], *, attempts: int | None = None) -> Any:
        """POST ``message`` (``to``, ``type`` and its part; ``messaging_product`` is added) to
        ``/messages``; Graph's answer. Transient failures are logged and retried, up to
        ``attempts`` tries (None: until it works, or the caller is cancelled); the last one, or a
        permanent one, raises ``GraphError``."""
        body = {"messaging_product": "whatsapp", **message}
        delay = self.backoff[0]
        tried = 0
        while True:
            tried += 1
            try:
                return await self._once(body)
            except GraphError as exc:
                if not exc.transient or (attempts is not None and tried >= attempts):
                    raise
                log.warning("%s; trying again in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(max(delay * 2, 0.05), self.backoff[1])

    async def media(self, media_id: object) -> tuple[str, int | None]:
        """Where the file ``media_id`` (of a user's message) is, and its size when Graph says it
        (``GET /<media id>``, one try): ``GraphError`` when Graph does not say."""
        if not isinstance(media_id, str) or not _MEDIA_ID.fullmatch(media_id):
            raise GraphError("the message names no media id", what="media lookup")
        url = f"{self.graph_url}/{self.api_version}/{media_id}"
        try:
            response = await self._client.get(url, params={"phone_number_id": self.phone_number_id})
        except httpx.HTTPError as exc:
            raise self._network_error(exc, "media lookup") from None
        answer = self._answer(response, "media lookup")
        address = answer.get("url") if isinstance(answer, dict) else None
        if not isinstance(address, str):
            raise GraphError("the answer names no media address", status=response.status_code, what="media lookup")
        size = answer.get("file_size")
        if isinstance(size, str) and size.isascii() and size.isdigit():
            size = int(size)
        return address, _int(size)

    def media_allowed(self, url: str) -> bool:
        """Whether ``url`` may be downloaded with the token: https on one of ``media_hosts`` (or
        on the Graph URL's own scheme and host)."""
        try:
            parts = urlsplit(url)
            graph = urlsplit(self.graph_url)
            host = (parts.hostname or "").lower()
            if parts.username is not None or parts.password is not None or not host:
                return False
            if parts.scheme == graph.scheme and host == graph.hostname and parts.port == graph.port:
                return True
            return parts.scheme == "https" and any(host == h or host.endswith(f".{h}") for h in self.media_hosts)
        except ValueError:  # (a port that is not a number)
            return False

    async def download(self, url: object, cap: int) -> bytes:
        """The file at ``url`` (what ``media`` named), with the token, at most ``cap`` bytes
        (``media.fetch``: ``FetchFailed`` or ``TooLarge``)."""
        if not isinstance(url, str) or not self.media_allowed(url):
            shown = redact_url(url) if isinstance(url, str) else repr(url)
            raise FetchFailed(f"Graph named a media address off Meta's hosts: {shown[:200]}", transient=False)
        request = self._client.build_request("GET", url, headers={"Accept-Encoding": "identity"})
        return await fetch(self._client, request, cap, self.redact)

    async def check(self) -> None:
        """Ask Graph, once, whether it takes the token and knows the phone number id.
        ``CredentialsRefused`` when it says it does not; ``GraphError`` when it could not be asked,
        or answered some other failure, which says nothing certain about them (the caller decides
        what that is worth)."""
        what = "start-up check"
        try:
            response = await self._client.get(
                "whatsapp_business_profile", params={"fields": "about"}, timeout=CHECK_TIMEOUT
            )
        except httpx.HTTPError as exc:
            raise self._network_error(exc, what) from None
        try:
            self._answer(response, what)
        except GraphError as exc:
            reason = refusal(exc, self.phone_number_id)
            if reason is not None:
                raise CredentialsRefused(f"WhatsApp cannot start: {reason}") from None
            raise

    def _network_error(self, exc: httpx.HTTPError, what: str) -> GraphError:
        """The transient ``GraphError`` for a call that got no answer (refused, reset, timed out …)."""
        reason = self.redact(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        return GraphError(f"network error ({reason})", transient=True, what=what)

    async def _once(self, body: dict[str, Any]) -> Any:
        try:
            response = await self._client.post("messages", json=body)
        except httpx.HTTPError as exc:  # connection refused, reset, timed out …
            raise self._network_error(exc, "send") from None
        return self._answer(response, "send")

    def _answer(self, response: httpx.Response, what: str) -> Any:
        """The JSON of a 2xx answer; ``GraphError`` for any other."""
        status = response.status_code
        try:
            answer = response.json()
        except ValueError:  # a proxy's error page, a truncated answer
            answer = None
        if 200 <= status < 300:  # (sent: an answer that is not JSON is not worth sending it again)
            return answer
        error = answer.get("error") if isinstance(answer, dict) else None
        if not isinstance(error, dict):
            description = "the answer is not the Graph API's JSON"
            raise GraphError(description, status=status, transient=status >= 500, what=what)
        code = _int(error.get("code"))
        subcode = _int(error.get("error_subcode"))
        description = self.redact(str(error.get("message") or "no description"))[:300]
        transient = status >= 500 or status == 429 or code in RATE_LIMITS or error.get("is_transient") is True
        raise GraphError(description, status=status, code=code, transient=transient, what=what, subcode=subcode)
