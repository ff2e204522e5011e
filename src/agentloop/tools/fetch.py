"""The Fetch tool (syscall ``net.fetch``): one HTTP(S) request, its answer as text for the model.

The request leaves from the server (or the device serving the call), inside networks whoever
chose the URL may not otherwise reach: a cloud's metadata service (169.254.169.254 hands out the
machine's credentials), a router's admin pages, the server's own API on localhost. So the URL
given and every redirect are checked the same way: http or https only, the host resolved once
and each of its addresses refused if it is not a public one (loopback, private, link-local,
unique-local, multicast, unspecified, reserved). The connection then goes to the address that was
checked, with the URL's host name in the ``Host`` header and as TLS's server name (certificates are
verified against the name): a DNS answer that changes between the check and the connection
(rebinding) cannot lead anywhere else. Hosts that should be reachable anyway (a dev server on
localhost) are named in ``allow``: host names, addresses or networks.

A hop the environment sends through a proxy (``HTTPS_PROXY`` or ``HTTP_PROXY`` by the URL's scheme,
else ``ALL_PROXY``; not for a host ``NO_PROXY`` names, nor for ``localhost`` and loopback addresses,
which go direct) is checked without DNS, since the proxy resolves the name and connects: an address
in the URL is judged as above (so are ``127.1``, ``2130706433`` and ``0x7f.0.0.1``, which resolvers
read as addresses), and a name without a dot (an intranet host) or under a domain only a local
network resolves (``.local``, ``.internal``, ``.home.arpa``, ``.localdomain``) is refused unless
allowed. A name this machine can resolve as well is refused when it points at a non-public
address here; what the proxy's own lookup answers is not checked: where the proxy lets requests
go is the proxy's policy (hosts to reach directly, checked in full, belong in ``NO_PROXY``). The
proxy itself is the operator's choice and may have a private address.

Nothing else of the runtime's is sent along: no ``.netrc`` credentials from the environment (a
proxy's own credentials, in its URL, go to the proxy only), no cookies kept from one call (or hop)
to the next; the ``Authorization`` and ``Cookie`` headers a call sets do not follow a redirect to
another origin.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import ipaddress
import re
import socket
import zlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Annotated, Any, Literal, NoReturn, TypeAlias
from urllib.parse import urljoin, urlsplit

import httpx
from pydantic import Field

from agentloop.images import image_size, sniff_image
from agentloop.messages import ImageContent, TextContent
from agentloop.proxies import env_proxy
from agentloop.tools.base import FunctionTool, ResultBlock, ToolError, ToolResult, tool, utf8
from agentloop.tools.fs import MAX_IMAGE_BYTES
from agentloop.urls import redact_url

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_CHARS",
    "DEFAULT_TIMEOUT",
    "MAX_REDIRECTS",
    "MAX_TIMEOUT",
    "AllowList",
    "Resolver",
    "decode",
    "fetch_tool",
    "fetch_url",
    "html_to_text",
]

DEFAULT_TIMEOUT = 30.0
MAX_TIMEOUT = 120.0
DEFAULT_MAX_BYTES = 5 * 1024 * 1024
MAX_BYTES = 50 * 1024 * 1024
#: Characters of a body's text handed to the model (the download may be larger).
DEFAULT_MAX_CHARS = 200_000
MAX_REDIRECTS = 5
METHODS = ("GET", "HEAD", "POST")
USER_AGENT = "Mozilla/5.0 (compatible; agentloop-fetch)"
ACCEPT = "text/html,application/xhtml+xml,application/json;q=0.9,text/plain;q=0.9,*/*;q=0.5"

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network
#: ``resolve(host, port)``: the addresses a host name stands for (``OSError`` if none).
Resolver: TypeAlias = Callable[[str, int], Awaitable[Sequence[str]]]

# headers that describe the connection or the body as sent: Fetch sets them itself
_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te"})
# headers that prove who the caller is: they go to the origin they were set for, not where it redirects
_CREDENTIALS = frozenset({"authorization", "cookie", "proxy-authorization"})
# headers that describe the body sent (the Fetch standard's request-body-header names): they go with it
_BODY_HEADERS = frozenset({"content-type", "content-encoding", "content-language", "content-location"})
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # the well-known prefix: the IPv4 address is the last 32 bits
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")  # local-use NAT64 (RFC 8215), not globally reachable
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
_SIIT = ipaddress.IPv6Network("::ffff:0:0:0/96")  # SIIT's IPv4-translated addresses: the last 32 bits
LOCAL_LOOKUP_TIMEOUT = 2.0  # seconds a hop through a proxy waits for this machine's own lookup of the name
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# the last label of a host resolvers read as an IPv4 address in a short or numeric form (127.1, 0x7f.1)
_NUMBER_LABEL = re.compile(r"0x[0-9a-f]*|[0-9]+")
# domains only a local network resolves (RFC 6762, RFC 8375, ICANN's private-use .internal, and a
# common one of /etc/hosts): names under them are refused on a hop through a proxy
_LOCAL_DOMAINS = (".local", ".internal", ".home.arpa", ".localdomain", ".localhost")
_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*")
_TEXT_TYPES = frozenset(
    {
        "application/json",
        "application/xml",
        "application/javascript",
        "application/ecmascript",
        "application/x-javascript",
        "application/yaml",
        "application/x-yaml",
        "application/toml",
        "application/x-ndjson",
        "application/sql",
        "application/graphql",
        "application/x-www-form-urlencoded",
    }
)
_HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.IGNORECASE)
_HEADER_CHARSET = re.compile(r"charset\s*=\s*[\"']?([A-Za-z0-9_.:-]+)", re.IGNORECASE)


# ------------------------------------------------------------------ which addresses may be reached


@dataclass(frozen=True)
class AllowList:
    """Hosts a fetch may reach although they are not public: names (exact, any case), addresses
    and networks (``127.0.0.1``, ``10.0.0.0/8``, ``::1``)."""

    names: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowList:
        """Raise ``ValueError`` for an entry that is neither: a typo would silently allow nothing."""
        names: set[str] = set()
        networks: list[IPNetwork] = []
        for entry in entries:
            text = entry.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")
            try:
                networks.append(ipaddress.ip_network(text, strict=False))
            except ValueError:
                if not _HOST_NAME.fullmatch(text):
                    raise ValueError(f"allow: {entry!r} is not a host name, an address or a network") from None
                names.add(text)
        return cls(frozenset(names), tuple(networks))

    def allows_name(self, host: str) -> bool:
        return host.lower().rstrip(".") in self.names

    def allows_address(self, ip: IPAddress) -> bool:
        return any(ip.version == net.version and ip in net for net in self.networks)


def _carried_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one reaches through a translator or a tunnel the host may have a
    route to (``::ffff:127.0.0.1``, NAT64's ``64:ff9b::7f00:1``, 6to4's ``2002:7f00:1::``): judged
    in its place, or a loopback address would pass as a public IPv6 one."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64 or ip in _SIIT:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def refusal(ip: IPAddress) -> str | None:
    """Why no fetch connects to ``ip`` unless it is allowed; None for a public address.
    Link-local comes before private: 169.254.169.254, the metadata service, is both."""
    if isinstance(ip, ipaddress.IPv6Address):
        carried = _carried_ipv4(ip)
        if carried is not None:
            ip = carried
        elif ip in _NAT64_LOCAL or (ip in _IPV4_COMPATIBLE and not (ip.is_loopback or ip.is_unspecified)):
            return "not a public address"  # (where the IPv4 address sits varies, or it is deprecated)
        elif ip.is_site_local:  # fec0::/10, deprecated but routed inside a site (not private to ipaddress)
            return "not a public address"
    if ip.is_unspecified:
        return "the unspecified address"
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address (where cloud metadata services answer)"
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_private:
        return "a private address"
    return None if ip.is_global else "not a public address"


async def system_resolve(host: str, port: int) -> list[str]:
    """The addresses ``getaddrinfo`` gives for ``host``, in its order, without repeats. A name
    that has no IDNA form (an empty label, one over 63 characters) is an ``OSError``, as a name
    that does not resolve is: the lookup raised ``UnicodeError`` before asking anyone."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except UnicodeError as exc:
        raise OSError(f"not a host name DNS can look up ({exc})") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def checked_url(url: str) -> httpx.URL:
    """``url`` parsed, if it is one Fetch may request (http or https, with a host)."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, UnicodeError) as exc:  # (a lone surrogate: no UTF-8 to quote)
        raise ToolError(f"not a URL: {redact_url(url)!r} ({exc})") from None
    if parsed.scheme not in ("http", "https"):
        given = f"not {parsed.scheme}:" if parsed.scheme else "and the URL has no scheme (write https://...)"
        raise ToolError(f"only http and https URLs can be fetched, {given}: {redact_url(url)!r}")
    if not parsed.host:
        raise ToolError(f"the URL names no host: {redact_url(url)!r}")
    return parsed


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def checked_addresses(url: httpx.URL, allow: AllowList, resolve: Resolver) -> list[str]:
    """The addresses to connect to for ``url``: resolved once, every one of them public or
    allowed (a name with one private address among public ones is refused: which one a
    connection would use is not ours to know)."""
    host = url.host
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        found = [str(ipaddress.ip_address(host))] if _is_address(host) else list(await resolve(host, port))
    except OSError as exc:
        raise ToolError(f"cannot resolve {host}: {exc}") from None
    if not found:
        raise ToolError(f"cannot resolve {host}: no addresses")
    if allow.allows_name(host):
        return found
    for text in found:
        ip = ipaddress.ip_address(text)
        why = None if allow.allows_address(ip) else refusal(ip)
        if why is not None:
            _refuse(url, f"{host} is {why}" if host == text else f"{host} resolves to {ip}, {why}")
    return found


def _refuse(url: httpx.URL, named: str, proxied: bool = False) -> NoReturn:
    via = " (checked as written: the proxy the environment names would resolve it)" if proxied else ""
    raise ToolError(
        f"refused to fetch {redact_url(str(url))}: {named}. Only public addresses are fetched "
        "unless the Fetch tool's allow list names the host (fetch_allow in the config file, or"
        f" Kernel.open(fetch_allow=[...])){via}"
    )


def _numeric_host(host: str) -> IPAddress | None:
    """The address ``host`` is written as, if it is one: in standard notation, or in a form a
    resolver reads as an IPv4 address (``127.1``, ``2130706433``, ``0x7f.0.0.1``).
    ``ToolError`` for a host whose last label is a number but that is no such address."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if not _NUMBER_LABEL.fullmatch(host.rsplit(".", 1)[-1]):
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        raise ToolError(f"{host!r} is neither a host name nor an address") from None


def checked_name(url: httpx.URL, allow: AllowList) -> None:
    """For a hop through a proxy, which resolves the name and connects itself: ``url``'s host
    checked as it is written, without DNS. An address is refused as a resolved one would be;
    a name without a dot or under a local-only domain is refused; another name passes."""
    host = url.host.lower().rstrip(".")
    if allow.allows_name(host):
        return
    ip = _numeric_host(host)
    if ip is not None:
        why = None if allow.allows_address(ip) else refusal(ip)
        if why is not None:
            _refuse(url, f"{host} is {why}", proxied=True)
    elif "." not in host:
        _refuse(url, f"{host} is a name without a domain (a local or intranet host)", proxied=True)
    elif host.endswith(_LOCAL_DOMAINS):
        _refuse(url, f"{host} is in a domain only a local network resolves", proxied=True)


async def checked_locally(url: httpx.URL, allow: AllowList, resolve: Resolver) -> None:
    """For a hop through a proxy, after ``checked_name``: where this machine can resolve the name
    too (within ``LOCAL_LOOKUP_TIMEOUT``), a name that points at a non-public address is refused,
    as a direct hop's would be. Best effort: a name only the proxy can resolve passes, and the
    proxy's own answer may differ (a name that changes its answer is not caught)."""
    host = url.host.lower().rstrip(".")
    if allow.allows_name(host) or _numeric_host(host) is not None:
        return
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        found = await asyncio.wait_for(resolve(host, port), LOCAL_LOOKUP_TIMEOUT)
    except (OSError, TimeoutError):
        return  # the proxy's to resolve
    for text in found:
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            continue
        why = None if allow.allows_address(ip) else refusal(ip)
        if why is not None:
            _refuse(url, f"{host} resolves to {ip} here, {why}")


# ------------------------------------------------------------------ the request


def request_headers(given: Mapping[str, str]) -> dict[str, str]:
    """The call's headers, checked: one that Fetch sets itself is an error rather than silently
    dropped, and so is one that could not be sent as written."""
    for name, value in given.items():
        if name.strip().lower() in _OWN_HEADERS:
            raise ToolError(f"the {name.strip().lower()} header is set by Fetch itself; leave it out")
        if not _TOKEN.fullmatch(name) or not value.isprintable() or not value.isascii():
            raise ToolError(f"header {name[:60]!r} cannot be sent: names are ASCII tokens, values printable ASCII")
    return dict(given)


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    return url.scheme, url.host, url.port


def _limit(timeout: float | None) -> float:
    limit = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    if not 0 < limit <= MAX_TIMEOUT:
        raise ToolError(f"timeout must be more than 0 and at most {MAX_TIMEOUT:g} s")
    return limit


class _Clients:
    """The httpx clients of one fetch: one that connects to the addresses checked, and one for
    each proxy a hop goes through. None reads the environment itself (``trust_env=False``): no
    ``.netrc``, and the proxy is the one ``env_proxy`` names for the hop."""

    def __init__(self, headers: Mapping[str, str]) -> None:
        self._headers = dict(headers)
        self._open: dict[str | None, httpx.AsyncClient] = {}

    def get(self, proxy: str | None) -> httpx.AsyncClient:
        client = self._open.get(proxy)
        if client is None:
            transport = None
            if proxy is not None:
                try:
                    transport = httpx.AsyncHTTPTransport(proxy=proxy, trust_env=False)
                except (ImportError, ValueError, httpx.InvalidURL) as exc:
                    raise ToolError(
                        f"the proxy the environment names, {redact_url(proxy)}, cannot be used: {exc}"
                    ) from None
            client = httpx.AsyncClient(
                trust_env=False, follow_redirects=False, headers=self._headers, transport=transport
            )
            self._open[proxy] = client
        return client

    def forget_cookies(self) -> None:
        for client in self._open.values():
            client.cookies.clear()

    async def aclose(self) -> None:
        for client in self._open.values():
            await client.aclose()


async def _send_via(
    client: httpx.AsyncClient, proxy: str, url: httpx.URL, method: str, headers: Mapping[str, str], body: bytes | None
) -> httpx.Response:
    """One hop through ``proxy``, which resolves the host's name and connects (a ``CONNECT``
    tunnel for https, the absolute URL sent to it for http)."""
    request = client.build_request(method, url, headers=headers, content=body)
    try:
        return await client.send(request, stream=True)
    except httpx.ConnectError as exc:
        raise ToolError(f"could not connect to {url.host} through the proxy {redact_url(proxy)}: {exc}") from None
    except httpx.ProxyError as exc:
        raise ToolError(f"the proxy {redact_url(proxy)} did not connect to {url.host}: {exc}") from None


async def _send(
    client: httpx.AsyncClient,
    url: httpx.URL,
    method: str,
    headers: Mapping[str, str],
    body: bytes | None,
    addresses: Sequence[str],
) -> httpx.Response:
    """One hop, to the checked addresses in turn until one takes the connection."""
    sni = {"sni_hostname": url.raw_host.decode("ascii")} if url.scheme == "https" else {}
    named = {**headers, "Host": url.netloc.decode("ascii")}
    failure: Exception | None = None
    for address in addresses:
        request = client.build_request(method, url.copy_with(host=address), headers=named, content=body, extensions=sni)
        try:
            return await client.send(request, stream=True)
        except httpx.ConnectError as exc:
            failure = exc
    raise ToolError(f"could not connect to {url.host} ({', '.join(addresses)}): {failure}")


def _next_hop(response: httpx.Response, url: httpx.URL) -> httpx.URL | None:
    location = response.headers.get("location")
    if response.status_code not in _REDIRECTS or not location:
        return None
    try:
        return checked_url(str(url.join(location)))
    except ToolError as exc:
        raise ToolError(f"{redact_url(str(url))} redirected to a URL that is not fetched: {exc}") from None


def _redirected(status: int, method: str, body: bytes | None) -> tuple[str, bytes | None]:
    """The method and body of the next hop, as browsers do it: 303 (and 301/302 after a POST)
    turn into a GET without the body; 307 and 308 repeat the request as it was."""
    if (status == 303 and method != "HEAD") or (status in (301, 302) and method == "POST"):
        return "GET", None
    return method, body


async def _follow(
    clients: _Clients,
    url: httpx.URL,
    method: str,
    headers: dict[str, str],
    body: bytes | None,
    allow: AllowList,
    resolve: Resolver,
    hops: list[str],
) -> tuple[httpx.Response, httpx.URL, str]:
    """The first answer that is not a redirect (open: the caller reads and closes it), with the
    URL and method that got it. Each hop is checked as the first one was, and goes through the
    proxy the environment names for it, if any (checked by name then, without DNS)."""
    while True:
        proxy = env_proxy(str(url))
        addresses: list[str] = []
        try:
            if proxy is None:
                addresses = await checked_addresses(url, allow, resolve)
            else:
                checked_name(url, allow)
                await checked_locally(url, allow, resolve)
        except ToolError as exc:
            raise ToolError(f"{exc} (redirected there by {hops[-1]})" if hops else str(exc)) from None
        if proxy is None:
            response = await _send(clients.get(None), url, method, headers, body, addresses)
        else:
            response = await _send_via(clients.get(proxy), proxy, url, method, headers, body)
        clients.forget_cookies()  # nothing a site set goes to the next hop, maybe another origin
        try:
            target = _next_hop(response, url)
        except ToolError:
            await response.aclose()
            raise
        if target is None:
            return response, url, method
        await response.aclose()
        if len(hops) >= MAX_REDIRECTS:
            raise ToolError(f"too many redirects: more than {MAX_REDIRECTS}, the last to {redact_url(str(target))}")
        hops.append(redact_url(str(url)))
        method, body = _redirected(response.status_code, method, body)
        if body is None:
            headers = {k: v for k, v in headers.items() if k.lower() not in _BODY_HEADERS}
        if _origin(target) != _origin(url):
            headers = {k: v for k, v in headers.items() if k.lower() not in _CREDENTIALS}
        url = target


async def _read(response: httpx.Response, max_bytes: int) -> tuple[bytes, bool]:
    """The body (decompressed) up to ``max_bytes``, and whether there was more. Inflated here, a
    bounded amount at a time: httpx inflates each network read whole, and 64 KiB of gzip can hold
    64 MiB (a page built to exhaust memory would be, before the limit could cut it)."""
    inflate = _inflater(response.headers.get("content-encoding", ""))
    chunks: list[bytes] = []
    size = 0
    async for raw in response.aiter_raw():
        while raw:
            room = max_bytes - size + 1  # one byte more than fits: whether there was more
            if inflate is None:
                chunk, raw = raw[:room], raw[room:]
            else:
                try:
                    chunk, raw = inflate.decompress(raw, room), inflate.unconsumed_tail
                except zlib.error as exc:
                    raise ToolError(
                        f"the response body is not valid {response.headers['content-encoding']}: {exc}"
                    ) from None
            if size + len(chunk) > max_bytes:
                chunks.append(chunk[: max_bytes - size])
                return b"".join(chunks), True
            chunks.append(chunk)
            size += len(chunk)
            if not chunk:
                break  # (all of ``raw`` went into the inflater's state: the next read goes on)
    return b"".join(chunks), False


def _inflater(encoding: str) -> Any:
    """A ``zlib`` decompressor for the body's ``Content-Encoding`` (None: not compressed)."""
    name = encoding.strip().lower()
    if name in ("", "identity"):
        return None
    if name in ("gzip", "x-gzip"):
        return zlib.decompressobj(wbits=31)
    if name == "deflate":  # meant as zlib-wrapped; raw deflate is what many servers send
        return _Deflate()
    raise ToolError(f"the response is compressed as {encoding!r}, which Fetch cannot read (gzip and deflate only)")


class _Deflate:
    """``Content-Encoding: deflate`` read as it is meant (zlib-wrapped) or as it is often sent
    (raw), told apart by the first bytes."""

    def __init__(self) -> None:
        self._inflate: Any = None
        self._head = b""  # the first bytes, until two tell which it is (a read may hold one)
        self.unconsumed_tail = b""

    def decompress(self, data: bytes, max_length: int) -> bytes:
        if self._inflate is None:
            data = self._head + data
            if len(data) < 2:
                self._head, self.unconsumed_tail = data, b""
                return b""
            wrapped = data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
            self._inflate = zlib.decompressobj(wbits=15 if wrapped else -15)
        out: bytes = self._inflate.decompress(data, max_length)
        self.unconsumed_tail = self._inflate.unconsumed_tail
        return out


# ------------------------------------------------------------------ the answer as the model sees it


def _mime(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def _kind(mime: str, data: bytes) -> str:
    """``html``, ``text``, ``image`` or ``binary``: what the body is shown as. An untyped body
    (or ``application/octet-stream``) is judged by its bytes."""
    if mime in _HTML_TYPES:
        return "html"
    if mime.startswith("text/") or mime in _TEXT_TYPES or mime.endswith(("+json", "+xml")):
        return "text"
    if mime.startswith("image/"):
        return "image" if sniff_image(data[:16]) else "binary"
    if mime and mime != "application/octet-stream":
        return "binary"
    if sniff_image(data[:16]):
        return "image"
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        # UTF-16 text (as ``decode`` reads it, by its mark): its NUL bytes are no sign of binary,
        # and its head must be decoded to be told for HTML (``_text`` still refuses NUL characters)
        head = data[:4096].decode("utf-16", errors="replace").lstrip()
        return "html" if head[:15].lower().startswith(("<!doctype html", "<html")) else "text"
    if b"\x00" in data[:4096]:
        return "binary"
    return "html" if data.lstrip()[:15].lower().startswith((b"<!doctype html", b"<html")) else "text"


def decode(data: bytes, content_type: str, html: bool) -> str:
    """The body as text, by its declared charset (an HTML page's ``<meta>`` one too), else UTF-8;
    bytes that do not decode become U+FFFD."""
    found = _HEADER_CHARSET.search(content_type)
    charset = found.group(1) if found else None
    if charset is None and html and (meta := _CHARSET.search(data[:4096])):
        charset = meta.group(1).decode("ascii")
    if data.startswith(codecs.BOM_UTF8):
        charset = "utf-8-sig"
    elif data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        # (as browsers decode: the mark wins over the header) UTF-16 holds NUL bytes for every
        # ASCII character; read as UTF-8 it would be NULs and nonsense, and taken for binary
        charset = "utf-16"
    try:
        return data.decode(charset or "utf-8", errors="replace")
    except (LookupError, UnicodeError):
        # a name Python does not know; one of its codecs that turn bytes into bytes (base64, zlib,
        # rot13), which a server or a page's <meta> is not trusted not to name; or a text codec
        # that takes no "replace" (idna) or decodes nothing (undefined)
        return data.decode("utf-8", errors="replace")


def _image(data: bytes, mime: str, truncated: bool) -> tuple[list[ResultBlock], str]:
    """An image block the model can see, or why there is none."""
    kind = sniff_image(data[:16]) or mime
    if truncated:
        return [], f"[an image ({kind}) larger than max_bytes: not shown; fetch it with a larger max_bytes]"
    if len(data) > MAX_IMAGE_BYTES:
        return [], f"[an image ({kind}, {len(data)} bytes) over the {MAX_IMAGE_BYTES}-byte limit: not shown]"
    if image_size(data) is None:
        return [], f"[a damaged image ({kind}, {len(data)} bytes): its header does not give its size]"
    block = ImageContent(data=base64.b64encode(data).decode("ascii"), mime_type=kind)
    return [block], f"[image: {kind}, {len(data)} bytes]"


def _cut(text: str, max_chars: int) -> tuple[str, str | None]:
    if len(text) <= max_chars:
        return text, None
    note = f"[… cut: the text is {len(text)} characters; only the first {max_chars} are shown]"
    return text[:max_chars], note


def _text(data: bytes, content_type: str, html: bool, url: str) -> str | None:
    """A body typed as text (or HTML), decoded and, for HTML, made readable; None when it is not
    text after all: it holds a NUL character. A server's type is a claim (a misconfigured one
    serves archives and images as ``text/plain``), and NULs are no text a model can use, nor
    one some providers accept. The check is on the decoded text, not the bytes: UTF-16 text has
    NUL bytes in every ASCII character but no NUL character. (In a worker thread: a page of
    megabytes takes a while to decode and parse.)"""
    decoded = decode(data, content_type, html)
    if "\x00" in decoded:
        return None
    return html_to_text(decoded, url) if html else decoded


async def _render(
    data: bytes, content_type: str, truncated: bool, url: str, max_chars: int, max_bytes: int
) -> tuple[str, list[ResultBlock]]:
    """The body as text for the model (HTML made readable, binary described) and any image."""
    mime = _mime(content_type)
    kind = _kind(mime, data)
    stopped = f"\n[download stopped after {max_bytes} bytes (max_bytes); the body is longer]" if truncated else ""
    if kind == "image":
        blocks, note = _image(data, mime, truncated)
        return note, blocks
    more = " or more (download stopped at max_bytes)" if truncated else ""
    if kind == "binary":
        return f"[binary body: {mime or 'no type given'}, {len(data)} bytes{more}; not shown]", []
    text = await asyncio.to_thread(_text, data, content_type, kind == "html", url)
    if text is None:
        typed = mime and mime != "application/octet-stream"  # (else judged text by its first 4 KB)
        why = "declared as text, but it holds NUL bytes" if typed else "it holds NUL bytes"
        return f"[binary body: {mime or 'no type given'}, {len(data)} bytes{more}; not shown: {why}]", []
    shown, cut = _cut(text, max_chars)
    return (shown or "(empty body)") + (f"\n{cut}" if cut else "") + stopped, []


async def _answer(
    response: httpx.Response, url: httpx.URL, method: str, hops: list[str], max_bytes: int, max_chars: int
) -> ToolResult:
    shown_url = redact_url(str(url))
    content_type = response.headers.get("content-type", "")
    lines = [f"{method} {shown_url} -> {response.status_code} {response.reason_phrase}".rstrip()]
    if hops:
        lines.append(f"(after {len(hops)} redirect(s), from {hops[0]})")
    lines.append(f"Content-Type: {content_type or 'not given'}")
    details: dict[str, Any] = {
        "status": response.status_code,
        "url": shown_url,
        "content_type": _mime(content_type) or None,
        "redirects": list(hops),
        "bytes": 0,
        "truncated": False,
    }
    is_error = response.status_code >= 400
    if method == "HEAD":
        if length := response.headers.get("content-length"):
            lines.append(f"Content-Length: {length}")
        return ToolResult.text("\n".join(lines), is_error=is_error, details=details)
    data, truncated = await _read(response, max_bytes)
    details.update(bytes=len(data), truncated=truncated)
    body, blocks = await _render(data, content_type, truncated, str(url), max_chars, max_bytes)
    text = "\n".join(lines) + "\n\n" + body
    return ToolResult([TextContent(text=text), *blocks], details=details, is_error=is_error)


async def fetch_url(
    url: str,
    method: str = "GET",
    headers: Mapping[str, str] | None = None,
    body: str | None = None,
    timeout: float | None = None,  # noqa: ASYNC109 - the request's own limit, part of the syscall
    max_bytes: int = DEFAULT_MAX_BYTES,
    *,
    allow: AllowList | Iterable[str] = (),
    resolve: Resolver | None = None,
    max_chars: int = DEFAULT_MAX_CHARS,
) -> ToolResult:
    """``net.fetch``: request ``url`` (following up to ``MAX_REDIRECTS`` redirects), checked as
    the module docstring says; the whole fetch, every hop and the body, ends at ``timeout``."""
    method = method.upper()
    if method not in METHODS:
        raise ToolError(f"method must be one of {', '.join(METHODS)}, not {method}")
    if body is not None and method != "POST":
        raise ToolError("a body is sent only with POST")
    if not 0 < max_bytes <= MAX_BYTES:
        raise ToolError(f"max_bytes must be more than 0 and at most {MAX_BYTES}")
    limit = _limit(timeout)
    start = checked_url(url)
    sent = request_headers(headers or {})
    if body is not None and not any(k.lower() == "content-type" for k in sent):
        sent["Content-Type"] = "text/plain; charset=utf-8"
    allowed = allow if isinstance(allow, AllowList) else AllowList.parse(allow)
    content = utf8(body, "body") if body is not None else None
    try:
        async with asyncio.timeout(limit):
            return await _fetch(start, method, sent, content, allowed, resolve or system_resolve, max_bytes, max_chars)
    except (TimeoutError, httpx.TimeoutException):
        raise ToolError(f"timed out after {limit:g} s fetching {redact_url(url)}") from None


async def _fetch(
    url: httpx.URL,
    method: str,
    headers: dict[str, str],
    body: bytes | None,
    allow: AllowList,
    resolve: Resolver,
    max_bytes: int,
    max_chars: int,
) -> ToolResult:
    hops: list[str] = []
    # Accept-Encoding named here: httpx offers br and zstd whenever their packages are installed,
    # and ``_read`` inflates gzip and deflate only
    defaults = {"User-Agent": USER_AGENT, "Accept": ACCEPT, "Accept-Encoding": "gzip, deflate"}
    clients = _Clients(defaults)
    try:
        response, final, method = await _follow(clients, url, method, headers, body, allow, resolve, hops)
        try:
            return await _answer(response, final, method, hops, max_bytes, max_chars)
        finally:
            await response.aclose()
    except httpx.TimeoutException:
        raise
    except httpx.HTTPError as exc:
        raise ToolError(f"fetching {redact_url(str(url))} failed: {type(exc).__name__}: {exc}") from None
    finally:
        await clients.aclose()


# ------------------------------------------------------------------ HTML as text


_SKIPPED = frozenset({"script", "style", "noscript", "template", "svg", "math", "iframe", "object", "canvas"})
_LINES = frozenset({"div", "section", "article", "header", "footer", "nav", "aside", "main", "form", "tr", "dt", "dd"})
_PARAGRAPHS = frozenset({"p", "ul", "ol", "dl", "table", "blockquote", "pre", "figure", "hr", "address"})
_HEADINGS = {f"h{n}": n for n in range(1, 7)}
_SPACE = re.compile(r"\s+")
_MARKER = re.compile(r"- |#{1,6} ")


class _Reader(HTMLParser):
    """Collects a page's readable text: scripts and styles dropped, blocks on lines of their own,
    headings marked with ``#``, list items with ``-``, links as ``[text](url)``, ``<pre>`` kept."""

    def __init__(self, base: str) -> None:
        super().__init__(convert_charrefs=True)
        self.base = base
        self.parts: list[str] = []
        self.title: str | None = None
        self._title: list[str] | None = None
        self._skip = 0
        self._pre = 0
        self._link: tuple[int, str] | None = None

    def _tail(self) -> str:
        return self.parts[-1] if self.parts else "\n"

    def _breaks(self) -> int:
        """How many line breaks the text ends with (the page's start counts as a paragraph's end)."""
        count = 0
        for part in reversed(self.parts):
            kept = part.rstrip("\n")
            count += len(part) - len(kept)
            if kept:
                return count
        return 2

    def _lines(self, count: int) -> None:
        """End the current line and leave ``count`` line breaks (not more) before what follows;
        none right after a list item's or heading's marker (``<li><p>``)."""
        if self.parts and _MARKER.fullmatch(self.parts[-1]):
            return
        missing = count - self._breaks()
        if missing > 0:
            self.parts.append("\n" * missing)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _SKIPPED:
            self._skip += 1
        elif tag == "title" and self.title is None:
            self._title = []
        elif tag == "br":
            self.parts.append("\n")
        elif tag == "li":
            self._lines(1)
            self.parts.append("- ")
        elif tag in _HEADINGS:
            self._lines(2)
            self.parts.append("#" * _HEADINGS[tag] + " ")
        elif tag in ("td", "th") and not self._tail().endswith(("\n", " ")):
            self.parts.append(" ")
        elif tag == "a":
            self._start_link(dict(attrs).get("href"))
        if tag == "pre":
            self._pre += 1
        if tag in _PARAGRAPHS:
            self._lines(2)
        elif tag in _LINES:
            self._lines(1)

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIPPED:
            self._skip = max(0, self._skip - 1)
        elif tag == "title" and self._title is not None:
            self.title = _SPACE.sub(" ", "".join(self._title)).strip()
            self._title = None
        elif tag == "a":
            self._end_link()
        if tag == "pre":
            self._pre = max(0, self._pre - 1)
        if tag in _PARAGRAPHS or tag in _HEADINGS:
            self._lines(2)
        elif tag in _LINES or tag == "li":
            self._lines(1)

    def handle_data(self, data: str) -> None:
        if self._skip:
            return
        if self._title is not None:
            self._title.append(data)
            return
        if self._pre:
            self.parts.append(data)
            return
        text = _SPACE.sub(" ", data)
        if self._tail().endswith(("\n", " ")):
            text = text.lstrip(" ")
        if text:
            self.parts.append(text)

    def _start_link(self, href: str | None) -> None:
        target = urljoin(self.base, href.strip()) if href and not href.strip().startswith("#") else ""
        self._link = (len(self.parts), target) if urlsplit(target).scheme in ("http", "https") else None

    def _end_link(self) -> None:
        if self._link is None:
            return
        start, target = self._link
        self._link = None
        label = "".join(self.parts[start:]).strip()
        if label and "\n" not in label:
            self.parts[start:] = [f"[{label}]({target})"]

    def text(self) -> str:
        body = "".join(self.parts)
        body = re.sub(r"[ \t]+\n", "\n", body)
        body = re.sub(r"\n{3,}", "\n\n", body).strip()
        return f"{self.title}\n\n{body}" if self.title else body


def html_to_text(html: str, base_url: str = "") -> str:
    """``html`` as text a model reads well; links resolved against ``base_url``."""
    reader = _Reader(base_url)
    reader.feed(html)
    reader.close()
    return reader.text()


# ------------------------------------------------------------------ the tool


def fetch_tool(
    *, allow: Iterable[str] = (), resolve: Resolver | None = None, max_chars: int = DEFAULT_MAX_CHARS
) -> FunctionTool:
    """The model-facing Fetch tool. ``allow`` names hosts it may reach although they are not
    public (``["localhost", "10.0.0.0/8"]``; ``ValueError`` for an entry that is neither a name,
    an address nor a network); ``resolve`` replaces the system's DNS lookup (tests)."""
    allowed = AllowList.parse(allow)

    @tool(
        name="Fetch",
        description=(
            "Fetch a web page or file over http(s) and return its status, final URL, content type and body: "
            "text and JSON as they are, HTML as readable text (links as [text](url)), images as images, other "
            f"binary bodies as a note of their size. Follows up to {MAX_REDIRECTS} redirects. Private, loopback "
            "and link-local addresses are refused. Long text is cut."
        ),
        # its own timeout (at most MAX_TIMEOUT) governs; the runtime's limit only catches a stuck one
        timeout=MAX_TIMEOUT + 10,
        max_result_chars=max_chars + 2_000,
    )
    async def fetch(
        url: str,
        method: Literal["GET", "HEAD", "POST"] = "GET",
        headers: dict[str, str] | None = None,
        body: str | None = None,
        timeout: Annotated[float, Field(gt=0, le=MAX_TIMEOUT)] = DEFAULT_TIMEOUT,  # noqa: ASYNC109
        max_bytes: Annotated[int, Field(ge=1, le=MAX_BYTES)] = DEFAULT_MAX_BYTES,
    ) -> ToolResult:
        """
        Args:
            url: The http:// or https:// URL to fetch.
            method: GET (the default), HEAD (status and headers only) or POST (with body).
            headers: Extra request headers, e.g. {"Accept": "application/json"}.
            body: The request body, for POST only (sent as text/plain unless headers give a Content-Type).
            timeout: Seconds for the whole fetch, redirects and download included (default 30, max 120).
            max_bytes: Bytes of the body to download at most (default 5 MB); the rest is not fetched.
        """
        return await fetch_url(
            url, method, headers, body, timeout, max_bytes, allow=allowed, resolve=resolve, max_chars=max_chars
        )

    return fetch
