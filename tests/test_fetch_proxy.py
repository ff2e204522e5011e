"""Fetch behind the environment's proxy: a real HTTP proxy on 127.0.0.1 (it answers itself, there
is no internet) gets a hop whose host ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` covers, the host
checked by its name since the proxy resolves it; a host ``NO_PROXY`` names, ``localhost`` and
loopback addresses go direct with the full check; without proxy variables nothing changes."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest

from agentloop.proxies import env_proxy
from agentloop.tools import fetch as fetch_module
from agentloop.tools.base import ToolError
from agentloop.tools.fetch import fetch_url
from tests.test_fetch_hops import serving
from tests.test_tools_fetch import resolver, text

PROXY_VARIABLES = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "REQUEST_METHOD",  # (set, urllib ignores HTTP_PROXY: a CGI request could name it)
)
LOCAL = ("127.0.0.1",)


@dataclass
class Request:
    line: str
    headers: dict[str, str]

    @property
    def method(self) -> str:
        return self.line.split(" ", 1)[0]

    @property
    def target(self) -> str:
        return self.line.split(" ")[1]


@dataclass
class Server:
    """A small HTTP/1.1 server on 127.0.0.1 that plays a forward proxy or an origin by the request
    it gets: an absolute-form ``GET http://host/path`` (what a proxy is sent for http) is answered
    ``proxied ...``, an origin-form ``GET /path`` ``direct ...``, a ``CONNECT host:port`` (a tunnel
    for https) is refused with 403. ``redirects`` maps a request target to a ``Location``."""

    port: int = 0
    requests: list[Request] = field(default_factory=list)
    redirects: dict[str, str] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            line = (await reader.readline()).decode("latin-1").rstrip("\r\n")
            headers: dict[str, str] = {}
            while (raw := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = raw.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            request = Request(line, headers)
            self.requests.append(request)
            if request.method == "CONNECT":
                writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            elif request.target in self.redirects:
                location = self.redirects[request.target].encode()
                writer.write(b"HTTP/1.1 302 Found\r\nLocation: " + location + b"\r\nContent-Length: 0\r\n\r\n")
            else:
                role = "proxied" if request.target.startswith("http") else "direct"
                body = f"{role} {request.method} {request.target} for {headers.get('host')}".encode()
                head = f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                writer.write(head.encode() + b"Connection: close\r\n\r\n" + body)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.tasks.discard(task)


@pytest.fixture
async def proxy() -> AsyncIterator[Server]:
    async for server in serving(Server()):
        yield server


@pytest.fixture
async def origin() -> AsyncIterator[Server]:
    async for server in serving(Server()):
        yield server


@pytest.fixture(autouse=True)
def no_proxy_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with none of the environment's proxy settings (upper or lower case)."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    yield


# ------------------------------------------------------------------ through the proxy


async def test_an_http_fetch_goes_through_http_proxy(proxy: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy is on a loopback address (the operator's choice: not checked); the target's name
    is the proxy's to resolve: the local lookup (this resolver knows no name at all) only looks."""
    monkeypatch.setenv("HTTP_PROXY", f"http://{proxy.address}")
    asked: list[str] = []
    result = await fetch_url("http://public.example/page?q=1", resolve=resolver({}, asked))
    assert not result.is_error, text(result)
    assert "proxied GET http://public.example/page?q=1 for public.example" in text(result)
    assert [r.line for r in proxy.requests] == ["GET http://public.example/page?q=1 HTTP/1.1"]
    assert asked == ["public.example"]


async def test_a_name_that_resolves_to_a_private_address_here_is_refused_with_a_proxy(
    proxy: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where this machine resolves the name too, a private answer is refused before the proxy is
    asked; a lookup that hangs is given up on and the proxy resolves the name."""
    monkeypatch.setenv("HTTP_PROXY", f"http://{proxy.address}")
    with pytest.raises(ToolError, match=r"evil\.example resolves to 10\.0\.0\.5 here, a private address"):
        await fetch_url("http://evil.example/", resolve=resolver({"evil.example": ["10.0.0.5"]}))
    assert proxy.requests == []
    allowed = await fetch_url(
        "http://evil.example/", allow=["10.0.0.0/8"], resolve=resolver({"evil.example": ["10.0.0.5"]})
    )
    assert not allowed.is_error, text(allowed)

    async def hanging(host: str, port: int) -> list[str]:
        await asyncio.sleep(30)
        return ["10.0.0.5"]

    monkeypatch.setattr(fetch_module, "LOCAL_LOOKUP_TIMEOUT", 0.05)
    slow = await fetch_url("http://slow.example/", resolve=hanging)
    assert not slow.is_error, text(slow)
    assert [r.line for r in proxy.requests][-1] == "GET http://slow.example/ HTTP/1.1"


async def test_the_proxys_credentials_go_to_it_and_are_not_shown(
    proxy: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", f"http://alice:pr0xy-pw@{proxy.address}")
    result = await fetch_url("http://public.example/", resolve=resolver({}))
    assert "proxied GET http://public.example/" in text(result)
    expected = "Basic " + base64.b64encode(b"alice:pr0xy-pw").decode()
    assert proxy.requests[0].headers.get("proxy-authorization") == expected

    monkeypatch.setenv("HTTPS_PROXY", f"http://alice:pr0xy-pw@{proxy.address}")
    with pytest.raises(ToolError) as caught:
        await fetch_url("https://public.example/", resolve=resolver({}))
    assert "pr0xy-pw" not in str(caught.value) and "alice:***@" in str(caught.value)


async def test_an_https_fetch_asks_https_proxy_for_a_tunnel(proxy: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", f"http://{proxy.address}")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # the https one is the one used
    with pytest.raises(ToolError, match=r"the proxy .* did not connect to public.example"):
        await fetch_url("https://public.example/secure", resolve=resolver({}))
    assert [(r.method, r.target) for r in proxy.requests] == [("CONNECT", "public.example:443")]


@pytest.mark.parametrize("variable", ["ALL_PROXY", "all_proxy", "HTTP_PROXY_WITHOUT_SCHEME"])
async def test_all_proxy_and_a_proxy_without_scheme(
    proxy: Server, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    if variable == "HTTP_PROXY_WITHOUT_SCHEME":
        monkeypatch.setenv("HTTP_PROXY", proxy.address)  # "127.0.0.1:port", as curl takes it
    else:
        monkeypatch.setenv(variable, f"http://{proxy.address}")
    result = await fetch_url("http://public.example/a", resolve=resolver({}))
    assert "proxied GET http://public.example/a" in text(result)


async def test_a_proxy_that_cannot_be_used_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("socksio") is not None:
        pytest.skip("socksio is installed: a SOCKS proxy can be used")
    monkeypatch.setenv("ALL_PROXY", "socks5://bob:s0cks-pw@127.0.0.1:9")
    with pytest.raises(ToolError, match="cannot be used") as caught:
        await fetch_url("http://public.example/", resolve=resolver({}))
    assert "s0cks-pw" not in str(caught.value)


async def test_an_unreachable_proxy_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ToolError, match=r"could not connect to public.example through the proxy http://127.0.0.1:9"):
        await fetch_url("http://public.example/", resolve=resolver({}))


async def test_an_allowed_private_address_goes_through_the_proxy(
    proxy: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", f"http://{proxy.address}")
    result = await fetch_url("http://10.1.2.3/x", allow=["10.0.0.0/8"], resolve=resolver({}))
    assert "proxied GET http://10.1.2.3/x" in text(result)
    result = await fetch_url("http://wiki.corp.internal/y", allow=["wiki.corp.internal"], resolve=resolver({}))
    assert "proxied GET http://wiki.corp.internal/y" in text(result)


# ------------------------------------------------------------------ what is still refused


@pytest.mark.parametrize(
    ("url", "word"),
    [
        ("http://10.0.0.1/", "private"),
        ("http://192.168.1.1/admin", "private"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("https://169.254.169.254/", "link-local"),
        ("http://[fd00::1]/", "private"),
        ("http://[::ffff:127.0.0.1]/", "loopback"),
        ("http://[::ffff:169.254.169.254]/", "link-local"),
        ("http://0.0.0.0/", "unspecified"),
        # forms a resolver (the proxy's) reads as an address
        ("http://127.1/", "loopback"),
        ("http://2130706433/", "loopback"),
        ("http://0x7f.0.0.1/", "loopback"),
        ("http://0xa9fea9fe/", "link-local"),
        ("http://10.1/", "private"),
        ("http://example.123/", "neither a host name nor an address"),
        ("http://example.0x10/", "neither a host name nor an address"),
        # names only a local network resolves
        ("http://intranet/", "without a domain"),
        ("http://jenkins:8080/job", "without a domain"),
        ("http://metadata.google.internal/computeMetadata/v1/", "only a local network"),
        ("http://printer.local/", "only a local network"),
        ("https://router.home.arpa/", "only a local network"),
        ("http://box.localdomain/", "only a local network"),
    ],
)
async def test_non_public_hosts_are_refused_by_name_with_a_proxy(
    proxy: Server, monkeypatch: pytest.MonkeyPatch, url: str, word: str
) -> None:
    monkeypatch.setenv("HTTP_PROXY", f"http://{proxy.address}")
    monkeypatch.setenv("HTTPS_PROXY", f"http://{proxy.address}")
    with pytest.raises(ToolError, match=word):
        await fetch_url(url, resolve=resolver({}))
    assert proxy.requests == []


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "app.localhost"])
async def test_this_machine_goes_direct_with_a_proxy_and_is_refused(
    proxy: Server, origin: Server, monkeypatch: pytest.MonkeyPatch, host: str
) -> None:
    """A proxy would reach its own loopback: localhost and loopback addresses go direct, checked
    in full (refused unless allowed)."""
    monkeypatch.setenv("HTTP_PROXY", f"http://{proxy.address}")
    names = {"localhost": ["127.0.0.1"], "app.localhost": ["127.0.0.1"]}
    with pytest.raises(ToolError, match="loopback"):
        await fetch_url(f"http://{host}:{origin.port}/", resolve=resolver(names))
    assert proxy.requests == [] and origin.requests == []
    if host != "[::1]":  # (the origin listens on IPv4 only)
        result = await fetch_url(f"http://{host}:{origin.port}/dev", allow=LOCAL, resolve=resolver(names))
        assert "direct GET /dev" in text(result)
        assert proxy.requests == []


async def test_a_redirect_through_the_proxy_is_checked_too(proxy: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", f"http://{proxy.address}")
    proxy.redirects["http://public.example/meta"] = "http://169.254.169.254/latest/meta-data/"
    proxy.redirects["http://public.example/intranet"] = "http://intranet/secrets"
    with pytest.raises(ToolError, match=r"link-local.*\(redirected there by http://public.example/meta\)"):
        await fetch_url("http://public.example/meta", resolve=resolver({}))
    with pytest.raises(ToolError, match=r"without a domain.*\(redirected there by"):
        await fetch_url("http://public.example/intranet", resolve=resolver({}))
    assert [r.target for r in proxy.requests] == ["http://public.example/meta", "http://public.example/intranet"]


# ------------------------------------------------------------------ NO_PROXY: direct, checked in full


async def test_a_no_proxy_host_goes_direct_with_the_full_check(
    proxy: Server, origin: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", f"http://{proxy.address}")
    monkeypatch.setenv("NO_PROXY", "other.example,public.example")
    asked: list[str] = []
    names = {"public.example": ["127.0.0.1"]}
    url = f"http://public.example:{origin.port}/page"
    with pytest.raises(ToolError, match=r"resolves to 127.0.0.1, a loopback address"):
        await fetch_url(url, resolve=resolver(names, asked))
    assert asked == ["public.example"] and origin.requests == []
    result = await fetch_url(url, allow=LOCAL, resolve=resolver(names))
    assert f"direct GET /page for public.example:{origin.port}" in text(result)
    assert proxy.requests == []


async def test_a_redirect_from_the_proxy_to_a_no_proxy_host_goes_direct(
    proxy: Server, origin: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", f"http://{proxy.address}")
    monkeypatch.setenv("NO_PROXY", ".corp.example")
    names = {"wiki.corp.example": ["10.0.0.7"], "dev.corp.example": ["127.0.0.1"]}
    proxy.redirects["http://public.example/go"] = "http://wiki.corp.example/"
    with pytest.raises(ToolError, match=r"resolves to 10.0.0.7, a private address"):
        await fetch_url("http://public.example/go", resolve=resolver(names))
    proxy.redirects["http://public.example/dev"] = f"http://dev.corp.example:{origin.port}/here"
    result = await fetch_url("http://public.example/dev", allow=LOCAL, resolve=resolver(names))
    assert f"direct GET /here for dev.corp.example:{origin.port}" in text(result)
    assert [r.target for r in proxy.requests] == ["http://public.example/go", "http://public.example/dev"]


# ------------------------------------------------------------------ without proxy variables


async def test_without_proxy_variables_nothing_changes(proxy: Server, origin: Server) -> None:
    """The name is resolved here and its addresses checked, and the connection goes to them."""
    names = {"public.example": ["127.0.0.1"]}
    url = f"http://public.example:{origin.port}/page"
    with pytest.raises(ToolError, match=r"resolves to 127.0.0.1, a loopback address"):
        await fetch_url(url, resolve=resolver(names))
    result = await fetch_url(url, allow=LOCAL, resolve=resolver(names))
    assert f"direct GET /page for public.example:{origin.port}" in text(result)
    with pytest.raises(ToolError, match=r"cannot resolve elsewhere.example"):
        await fetch_url("http://elsewhere.example/", resolve=resolver(names))
    with pytest.raises(ToolError, match=r"refused .*127.1 resolves to 127.0.0.1"):
        await fetch_url("http://127.1/", resolve=resolver({"127.1": ["127.0.0.1"]}))
    assert proxy.requests == [] and [r.line for r in origin.requests] == ["GET /page HTTP/1.1"]


# ------------------------------------------------------------------ the shared helper


def test_env_proxy_reads_the_environment_as_httpx_would(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_proxy("https://public.example/") is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.corp:3128")
    monkeypatch.setenv("HTTP_PROXY", "proxy.corp:8080")
    monkeypatch.setenv("NO_PROXY", "skip.example,.internal.example")
    assert env_proxy("https://public.example/") == "http://proxy.corp:3128"
    assert env_proxy("http://public.example/") == "http://proxy.corp:8080"
    assert env_proxy("https://skip.example/") is None
    assert env_proxy("https://a.internal.example/") is None
    for here in ("http://localhost:8081/", "http://127.0.0.1/", "http://[::1]:80/", "http://x.localhost/"):
        assert env_proxy(here) is None, here
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setenv("ALL_PROXY", "socks5://proxy.corp:1080")
    assert env_proxy("https://public.example/") == "socks5://proxy.corp:1080"
