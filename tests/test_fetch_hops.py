"""Fetch across the hops of a redirect chain, pinned by what the servers received: no cookie jar
(not between calls, not between hops), 307/308 repeat the request, 301/302 after a POST and 303
turn it into a GET without the body or the headers that described it, credentials stay with their
origin, and an https server whose certificate does not verify is refused with a plain error.

The servers listen on 127.0.0.1 and are reached through the allow list, as in
``test_tools_fetch.py``; two servers on different ports are two origins (a cookie jar would
not tell them apart: cookies ignore ports)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, quote, urlsplit

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agentloop import Agent, Reply, ScriptedModel, ToolResultMessage, call
from agentloop.messages import TextContent
from agentloop.tools.base import ToolContext, ToolError, ToolResult
from agentloop.tools.fetch import fetch_tool, fetch_url
from tests.test_tools_fetch import Seen, read_request

LOCAL = ("127.0.0.1",)
TIMEOUT = 5.0
REASONS = {
    200: "OK",
    301: "Moved Permanently",
    302: "Found",
    303: "See Other",
    307: "Temporary Redirect",
    308: "Permanent Redirect",
}


@dataclass
class Server:
    """An HTTP/1.1 server on 127.0.0.1. ``/go?status=307&to=URL`` redirects (``&cookie=a=b``
    sets a cookie with it), ``/set?cookie=a=b`` only sets one; any other path answers 200."""

    port: int = 0
    scheme: str = "http"
    seen: list[Seen] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

    def paths(self) -> list[str]:
        return [s.path.split("?")[0] for s in self.seen]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            seen = await read_request(reader)
            self.seen.append(seen)
            writer.write(self.answer(seen.path))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.tasks.discard(task)

    def answer(self, target: str) -> bytes:
        parts = urlsplit(target)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        status = int(query.get("status", "302")) if parts.path == "/go" else 200
        lines = [f"HTTP/1.1 {status} {REASONS[status]}", "Connection: close"]
        if parts.path == "/go":
            lines.append(f"Location: {query['to']}")
        if "cookie" in query:  # no Domain: a jar keeps it for 127.0.0.1, whatever the port
            lines.append(f"Set-Cookie: {query['cookie']}; Path=/")
        body = b"ok"
        lines += ["Content-Type: text/plain", f"Content-Length: {len(body)}"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


S = TypeVar("S", bound=Server)


async def serving(state: S, context: ssl.SSLContext | None = None) -> AsyncIterator[S]:
    server = await asyncio.start_server(state.serve, "127.0.0.1", 0, ssl=context)
    state.port = server.sockets[0].getsockname()[1]
    try:
        yield state
    finally:
        server.close()
        for task in list(state.tasks):
            task.cancel()
        await server.wait_closed()


@pytest.fixture
async def a() -> AsyncIterator[Server]:
    async for state in serving(Server()):
        yield state


@pytest.fixture
async def b() -> AsyncIterator[Server]:
    async for state in serving(Server()):
        yield state


def go(start: Server, to: str, status: int = 302, cookie: str | None = None) -> str:
    """A URL of ``start``'s that redirects to ``to`` with ``status``."""
    extra = f"&cookie={quote(cookie, safe='')}" if cookie else ""
    return start.url(f"/go?status={status}&to={quote(to, safe='')}{extra}")


def text(result: ToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


async def fetch(url: str, method: str = "GET", **kwargs: Any) -> ToolResult:
    result = await fetch_url(url, method, timeout=TIMEOUT, allow=LOCAL, **kwargs)
    assert not result.is_error, text(result)
    return result


# ------------------------------------------------------------------ cookies


async def test_a_cookie_one_fetch_was_given_is_not_sent_by_the_next(a: Server) -> None:
    """The same tool, called twice: the second call starts with no cookies."""
    tool = fetch_tool(allow=LOCAL)
    for n, path in enumerate(["/set?cookie=sid=first", "/page"]):
        args = tool.validate({"url": a.url(path), "timeout": TIMEOUT})
        assert not (await tool.run(args, ToolContext(f"c{n}", "Fetch"))).is_error
    assert a.paths() == ["/set", "/page"]
    assert "cookie" not in a.seen[1].headers
    # a plain second fetch_url neither
    await fetch(a.url("/page"))
    assert "cookie" not in a.seen[2].headers


async def test_a_cookie_set_by_a_hop_goes_to_no_other_hop(a: Server, b: Server) -> None:
    """``a`` sets a cookie as it redirects to ``b`` (another origin: another port), ``b`` to
    ``a`` again: neither later hop carries it. Fetch keeps no cookies from one hop to the next,
    not even back to the origin that set them (the module says so)."""
    back = go(b, a.url("/end"), cookie="b_sid=2")
    await fetch(go(a, back, cookie="a_sid=1"))
    assert a.paths() == ["/go", "/end"] and b.paths() == ["/go"]
    assert "cookie" not in b.seen[0].headers
    assert "cookie" not in a.seen[1].headers


async def test_a_cookie_set_by_a_hop_is_not_sent_to_the_same_origin_either(a: Server) -> None:
    await fetch(go(a, a.url("/end"), status=307, cookie="sid=1"), "POST", body="x")
    assert a.paths() == ["/go", "/end"]
    assert "cookie" not in a.seen[1].headers


async def test_the_callers_cookie_header_stays_with_its_origin(a: Server, b: Server) -> None:
    """Kept for a hop to the same origin; dropped at the first hop to another, and not sent
    again when the chain comes back."""
    await fetch(go(a, go(a, go(b, a.url("/end")))), headers={"Cookie": "mine=1"})
    assert a.paths() == ["/go", "/go", "/end"] and b.paths() == ["/go"]
    assert [s.headers.get("cookie") for s in a.seen] == ["mine=1", "mine=1", None]
    assert "cookie" not in b.seen[0].headers


# ------------------------------------------------------------------ 307 and 308: the request again


@pytest.mark.parametrize("status", [307, 308])
async def test_307_and_308_repeat_the_post_with_its_body_and_type(a: Server, status: int) -> None:
    headers = {"Content-Type": "application/json", "Content-Language": "fr"}
    await fetch(go(a, a.url("/target?x=1"), status), "POST", body='{"q": "é"}', headers=headers)
    first, second = a.seen
    assert (second.method, second.path) == ("POST", "/target?x=1")
    assert second.body == first.body == '{"q": "é"}'.encode()
    assert second.headers["content-type"] == "application/json" and second.headers["content-language"] == "fr"
    assert second.headers["content-length"] == str(len(first.body))


@pytest.mark.parametrize("status", [307, 308])
async def test_307_and_308_keep_the_default_content_type(a: Server, status: int) -> None:
    await fetch(go(a, a.url("/target"), status), "POST", body="plain")
    second = a.seen[1]
    assert (second.method, second.body) == ("POST", b"plain")
    assert second.headers["content-type"] == "text/plain; charset=utf-8"


@pytest.mark.parametrize("status", [307, 308])
async def test_307_and_308_to_another_origin_repeat_the_post_without_credentials(
    a: Server, b: Server, status: int
) -> None:
    """Fetch repeats a 307/308 as it was wherever it points (as browsers do); only the
    credentials stay behind."""
    headers = {"Content-Type": "application/json", "Authorization": "Bearer s3cret", "X-Keep": "1"}
    await fetch(go(a, b.url("/target"), status), "POST", body='{"q": 1}', headers=headers)
    [arrived] = b.seen
    assert (arrived.method, arrived.body) == ("POST", b'{"q": 1}')
    assert arrived.headers["content-type"] == "application/json" and arrived.headers["x-keep"] == "1"
    assert "authorization" not in arrived.headers
    assert a.seen[0].headers["authorization"] == "Bearer s3cret"


# ------------------------------------------------------------------ 301/302 after POST, 303: a GET


@pytest.mark.parametrize("status", [301, 302, 303])
@pytest.mark.parametrize("content_type", [None, "application/json", "lower"])
async def test_a_post_redirected_by_301_302_or_303_becomes_a_get_without_its_body(
    a: Server, b: Server, status: int, content_type: str | None
) -> None:
    """The body goes, and so do the headers that described it (whatever case the caller wrote
    them in); the caller's other headers stay."""
    headers = {"X-Keep": "1"}
    if content_type == "lower":
        headers["content-type"] = "application/json"
    elif content_type:
        headers["Content-Type"] = content_type
    headers |= {"Content-Encoding": "identity", "Content-Language": "en", "Content-Location": "/draft"}
    for target in (a, b):
        target.seen.clear()
        result = await fetch(go(a, target.url("/landing"), status), "POST", body='{"q": 1}', headers=headers)
        posted, landed = a.seen[0], target.seen[-1]
        assert posted.method == "POST" and posted.body == b'{"q": 1}' and "content-type" in posted.headers
        assert (landed.method, landed.path, landed.body) == ("GET", "/landing", b"")
        for gone in ("content-type", "content-length", "content-encoding", "content-language", "content-location"):
            assert gone not in landed.headers, (gone, target is a)
        assert landed.headers["x-keep"] == "1"
        assert result.details["url"] == target.url("/landing") and text(result).startswith("GET ")


@pytest.mark.parametrize(
    ("method", "status", "then"),
    [("GET", 303, "GET"), ("GET", 301, "GET"), ("HEAD", 301, "HEAD"), ("HEAD", 302, "HEAD"), ("HEAD", 303, "HEAD")],
)
async def test_a_get_or_head_stays_what_it_was(a: Server, method: str, status: int, then: str) -> None:
    await fetch(go(a, a.url("/landing"), status), method)
    assert [(s.method, s.body) for s in a.seen] == [(method, b""), (then, b"")]
    assert "content-length" not in a.seen[1].headers and "content-type" not in a.seen[1].headers


# ------------------------------------------------------------------ credentials


async def test_credentials_stay_with_their_origin_another_port_is_another(a: Server, b: Server) -> None:
    """``Authorization``, ``Proxy-Authorization`` and ``Cookie`` go to every hop on the origin
    they were set for, not to ``b`` (same address, another port), and not back to ``a`` after
    the chain has left it."""
    secret = {"Authorization": "Bearer s3cret", "proxy-authorization": "Basic eDp5", "Cookie": "k=v", "X-Keep": "1"}
    await fetch(go(a, go(a, go(b, a.url("/end"), 308), 307), 307), "POST", body="x", headers=secret)
    assert a.paths() == ["/go", "/go", "/end"] and b.paths() == ["/go"]
    for seen in a.seen[:2]:
        assert seen.headers["authorization"] == "Bearer s3cret" and seen.headers["proxy-authorization"] == "Basic eDp5"
        assert seen.headers["cookie"] == "k=v"
    for seen in (b.seen[0], a.seen[2]):
        assert seen.method == "POST" and seen.body == b"x" and seen.headers["x-keep"] == "1"
        for gone in ("authorization", "proxy-authorization", "cookie"):
            assert gone not in seen.headers, gone


async def test_credentials_in_the_url_do_not_follow_to_another_origin(a: Server, b: Server) -> None:
    start = go(a, b.url("/end")).replace("http://", "http://user:pw@", 1)
    result = await fetch(start)
    assert a.seen[0].headers["authorization"].startswith("Basic ")
    assert "authorization" not in b.seen[0].headers
    assert "pw" not in text(result) and "pw" not in str(result.details)


# ------------------------------------------------------------------ https: certificates are verified


@dataclass
class Certificate:
    cert: Path
    key: Path
    pem: bytes


@pytest.fixture
def certificate(tmp_path: Path) -> Certificate:
    """A self-signed certificate for ``localhost`` and ``127.0.0.1``, made here."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    paths = Certificate(tmp_path / "cert.pem", tmp_path / "key.pem", pem)
    paths.cert.write_bytes(pem)
    paths.key.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


@dataclass
class TLSServer(Server):
    """The server above behind TLS; ``names`` are the server names clients asked for."""

    names: list[str | None] = field(default_factory=list)


@pytest.fixture
async def tls(certificate: Certificate) -> AsyncIterator[TLSServer]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certificate.cert, certificate.key)
    state = TLSServer(scheme="https")

    def record(_sock: Any, name: str | None, _ctx: ssl.SSLContext) -> None:
        state.names.append(name)

    context.sni_callback = record
    async for running in serving(state, context):
        yield running


Resolver = Callable[[str, int], Awaitable[list[str]]]


def resolver(names: dict[str, list[str]]) -> Resolver:
    async def resolve(host: str, port: int) -> list[str]:
        if host not in names:
            raise OSError(f"unknown host {host}")
        return names[host]

    return resolve


DNS = resolver({"localhost": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
NAMES = ["localhost", "other.test"]


async def test_a_self_signed_certificate_is_refused_before_anything_is_sent(tls: TLSServer) -> None:
    """The handshake starts (the server sees the host name asked for) and the client ends it:
    no request, no header, no body reaches the server."""
    secret = {"Authorization": "Bearer s3cret"}
    with pytest.raises(ToolError) as refused:
        await fetch_url(
            tls.url("/secret", "localhost"), "POST", headers=secret, body="x", timeout=TIMEOUT, allow=NAMES, resolve=DNS
        )
    message = str(refused.value)
    assert "localhost" in message and "certificate verify failed" in message and "self-signed" in message
    assert "Traceback" not in message and "s3cret" not in message
    with pytest.raises(ToolError, match="certificate verify failed"):
        await fetch_url(tls.url("/by-address"), timeout=TIMEOUT, allow=LOCAL)
    assert tls.seen == []
    assert tls.names == ["localhost", None]  # no SNI for an address


async def test_the_tool_result_says_so_in_plain_words(tls: TLSServer) -> None:
    """Through an agent's loop: an error result the model reads, not a traceback."""
    model = ScriptedModel([Reply(tool_calls=[call("Fetch", url=tls.url("/", "localhost"), timeout=TIMEOUT)]), "ok"])
    agent = Agent(model=model, tools=[fetch_tool(allow=NAMES, resolve=DNS)])
    result = await agent.run("fetch it")
    [answer] = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert answer.is_error, answer.text
    assert "could not connect to localhost" in answer.text and "certificate verify failed" in answer.text
    assert "Traceback" not in answer.text and "File " not in answer.text
    assert tls.seen == []


@pytest.fixture
def trusting(certificate: Certificate, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fetch's client trusts the test certificate (and nothing else changes): the control that
    shows the server works and the refusals above are verification's."""
    trusted = ssl.create_default_context(cadata=certificate.pem.decode("ascii"))
    real = httpx.AsyncClient

    class Trusting(real):  # type: ignore[misc, valid-type]
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(verify=trusted, **kwargs)

    monkeypatch.setattr(httpx, "AsyncClient", Trusting)
    yield


@pytest.mark.usefixtures("trusting")
async def test_a_trusted_certificate_is_checked_against_the_urls_host_name(tls: TLSServer) -> None:
    """Trusted, it is fetched; the server sees the name in SNI and ``Host``. Named for another
    host (other.test resolves to the same 127.0.0.1 the certificate names), it is refused: the
    name is checked, not the address connected to."""
    result = await fetch_url(tls.url("/page", "localhost"), timeout=TIMEOUT, allow=NAMES, resolve=DNS)
    assert not result.is_error and text(result).endswith("ok")
    [seen] = tls.seen
    assert (seen.method, seen.path, seen.headers["host"]) == ("GET", "/page", f"localhost:{tls.port}")
    with pytest.raises(ToolError, match=r"certificate verify failed.*(?i:hostname mismatch)"):
        await fetch_url(tls.url("/page", "other.test"), timeout=TIMEOUT, allow=NAMES, resolve=DNS)
    assert len(tls.seen) == 1 and tls.names == ["localhost", "other.test"]
