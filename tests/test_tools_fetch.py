"""Fetch (syscall ``net.fetch``): a real HTTP server on 127.0.0.1, reached through the allow-list;
everything private, loopback or link-local refused without it, at the first hop and at every
redirect; the address that was checked is the one connected to; limits on time and size hold."""

from __future__ import annotations

import asyncio
import functools
import gzip
import ipaddress
import json
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from agentloop import Reply, ScriptedModel, ToolResultMessage, call
from agentloop.device.client import DeviceClient, DeviceOptions, parse_allow
from agentloop.kernel import Kernel
from agentloop.kernel.devices import DEVICE_SYSCALLS, DeviceInfo, device_toolset
from agentloop.messages import ImageContent, TextContent
from agentloop.process.approval import call_target, decide, default_policy, parse_policy
from agentloop.process.store import ProcessRecord
from agentloop.tools.base import ToolArgumentsError, ToolContext, ToolError, ToolResult
from agentloop.tools.builtin import SYSCALLS, builtin_tools, syscall_of
from agentloop.tools.fetch import MAX_REDIRECTS, decode, fetch_tool, fetch_url, html_to_text, refusal
from tests.image_support import PNG

PAGE = """<!doctype html><html><head><title>The Title</title>
<style>.secret-style { color: red }</style><script>var secretScript = 1;</script></head>
<body><nav><a href="/about">About us</a></nav><h1>Main heading</h1>
<p>First   paragraph with
 <b>bold</b> &amp; an entity.</p><ul><li>one</li><li>two</li></ul>
<noscript>enable js</noscript><pre>  keep   this
  spacing</pre></body></html>"""


@dataclass
class Seen:
    """One request the site received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Site:
    """A small HTTP/1.1 server on 127.0.0.1 whose answers the tests choose by path."""

    port: int = 0
    seen: list[Seen] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            seen = await read_request(reader)
            self.seen.append(seen)
            await answer(seen, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.tasks.discard(task)


async def read_request(reader: asyncio.StreamReader) -> Seen:
    """One HTTP/1.1 request as it arrived: a header sent twice, or a body of unknown length,
    fails the test (every body Fetch sends has one)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            assert name.strip().lower() not in headers, f"{name} sent twice"
            headers[name.strip().lower()] = value.strip()
    assert "transfer-encoding" not in headers
    return Seen(method, target, headers, await reader.readexactly(int(headers.get("content-length", "0"))))


def respond(writer: asyncio.StreamWriter, status: str, body: bytes = b"", **headers: str) -> None:
    lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)


async def answer(seen: Seen, writer: asyncio.StreamWriter) -> None:
    """The site's routes."""
    parts = urlsplit(seen.path)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    path = parts.path
    if path == "/text":
        respond(writer, "200 OK", "héllo wörld".encode(), Content_Type="text/plain; charset=utf-8")
    elif path == "/latin1":
        respond(writer, "200 OK", "café".encode("latin-1"), Content_Type="text/plain; charset=iso-8859-1")
    elif path == "/json":
        respond(writer, "200 OK", b'{"answer": 42}', Content_Type="application/json")
    elif path == "/html":
        respond(writer, "200 OK", PAGE.encode(), Content_Type="text/html; charset=utf-8")
    elif path.startswith("/redirect/"):
        left = int(path.rsplit("/", 1)[1])
        if left == 0:
            respond(writer, "200 OK", b"arrived", Content_Type="text/plain")
        else:
            respond(writer, "302 Found", Location=f"/redirect/{left - 1}")
    elif path == "/go":
        respond(writer, query.get("status", "302 Found"), Location=query["to"])
    elif path == "/nowhere":
        respond(writer, "302 Found", b"no location given", Content_Type="text/plain")
    elif path == "/headers":
        respond(writer, "200 OK", json.dumps(seen.headers).encode(), Content_Type="application/json")
    elif path == "/echo":
        echoed = {"method": seen.method, "body": seen.body.decode(), "type": seen.headers.get("content-type")}
        respond(writer, "200 OK", json.dumps(echoed).encode(), Content_Type="application/json")
    elif path == "/sleep":
        await asyncio.sleep(30)
    elif path == "/drip":  # headers at once, then a byte every 0.2 s: no single read is slow
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n")
        for _ in range(100):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.2)
    elif path == "/big":
        respond(writer, "200 OK", b"a" * int(query["n"]), Content_Type="text/plain")
    elif path == "/bomb":  # 64 MiB of zeros in about 64 KiB of gzip (or raw deflate)
        encoding = query.get("encoding", "gzip")
        respond(writer, "200 OK", bomb(encoding), Content_Type="text/plain", Content_Encoding=encoding)
    elif path == "/gzipped":
        respond(
            writer, "200 OK", gzip.compress(b"small and squeezed"), Content_Type="text/plain", Content_Encoding="gzip"
        )
    elif path == "/badgzip":
        respond(
            writer, "200 OK", b"\x1f\x8b\x08\x00not gzip at all", Content_Type="text/plain", Content_Encoding="gzip"
        )
    elif path == "/brotli":
        respond(writer, "200 OK", b"\x0b\x02\x80hi\x03", Content_Type="text/plain", Content_Encoding="br")
    elif path == "/binary":
        respond(writer, "200 OK", bytes(range(256)) * 40, Content_Type="application/octet-stream")
    elif path == "/image":
        respond(writer, "200 OK", PNG, Content_Type="image/png")
    elif path == "/missing":
        respond(writer, "404 Not Found", b"no such page", Content_Type="text/plain")
    else:
        respond(writer, "500 Internal Server Error")
    await writer.drain()


@pytest.fixture
async def site() -> AsyncIterator[Site]:
    state = Site()
    server = await asyncio.start_server(state.serve, "127.0.0.1", 0)
    state.port = server.sockets[0].getsockname()[1]
    try:
        yield state
    finally:
        server.close()
        for task in list(state.tasks):
            task.cancel()
        await server.wait_closed()


Resolver = Callable[[str, int], Awaitable[list[str]]]


def resolver(names: dict[str, list[str]], asked: list[str] | None = None) -> Resolver:
    """A DNS of our own: ``names`` answer, anything else is an error (the tests never reach out)."""

    async def resolve(host: str, port: int) -> list[str]:
        if asked is not None:
            asked.append(host)
        if host not in names:
            raise OSError(f"unknown host {host}")
        return names[host]

    return resolve


def text(result: ToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


LOCAL = ("127.0.0.1",)


# ------------------------------------------------------------------ content


async def test_fetches_text_decoded_by_its_charset(site: Site) -> None:
    result = await fetch_url(site.url("/text"), allow=LOCAL)
    assert not result.is_error
    shown = text(result)
    assert "200 OK" in shown and "text/plain" in shown and site.url("/text") in shown
    assert shown.endswith("héllo wörld")
    assert result.details["status"] == 200 and result.details["url"] == site.url("/text")
    assert text(await fetch_url(site.url("/latin1"), allow=LOCAL)).endswith("café")


async def test_fetches_json_as_text(site: Site) -> None:
    result = await fetch_url(site.url("/json"), allow=LOCAL)
    assert text(result).endswith('{"answer": 42}') and result.details["content_type"] == "application/json"


async def test_html_becomes_readable_text(site: Site) -> None:
    shown = text(await fetch_url(site.url("/html"), allow=LOCAL))
    assert "The Title" in shown and "# Main heading" in shown
    assert "First paragraph with bold & an entity." in shown
    assert "- one\n- two" in shown and "  keep   this\n  spacing" in shown
    assert f"[About us]({site.url('/about')})" in shown
    for hidden in ("secretScript", "secret-style", "enable js", "<p>", "<b>"):
        assert hidden not in shown


def test_a_page_is_decoded_by_its_meta_charset_or_bom() -> None:
    assert decode(b'<meta charset="iso-8859-1"><p>caf\xe9', "text/html", True).endswith("café")
    assert decode("\ufeffhé".encode(), "text/plain", False) == "hé"
    assert decode(b"caf\xe9", "text/plain; charset=no-such-codec", False) == "caf\ufffd"


def test_html_to_text_keeps_words_apart_and_drops_unsafe_links() -> None:
    html = '<div>a</div><div>b</div><p>x<br>y</p><a href="javascript:alert(1)">js</a><td>c</td><td>d</td>'
    shown = html_to_text(html, "https://example.com/")
    assert "a\nb" in shown and "x\ny" in shown and "javascript" not in shown and "js" in shown
    assert "c d" in shown or "c\td" in shown or "c | d" in shown


async def test_an_image_is_an_image_block(site: Site) -> None:
    result = await fetch_url(site.url("/image"), allow=LOCAL)
    images = [b for b in result.content if isinstance(b, ImageContent)]
    assert len(images) == 1 and images[0].mime_type == "image/png"
    assert "image/png" in text(result) and f"{len(PNG)} bytes" in text(result)


async def test_a_binary_body_is_described_not_shown(site: Site) -> None:
    result = await fetch_url(site.url("/binary"), allow=LOCAL)
    shown = text(result)
    assert not result.is_error and "binary" in shown and "application/octet-stream" in shown
    assert "10240 bytes" in shown and "\x00" not in shown
    assert not any(isinstance(b, ImageContent) for b in result.content)


async def test_an_error_status_is_an_error_result_with_the_body(site: Site) -> None:
    result = await fetch_url(site.url("/missing"), allow=LOCAL)
    assert result.is_error and "404 Not Found" in text(result) and "no such page" in text(result)


async def test_head_and_post(site: Site) -> None:
    head = await fetch_url(site.url("/text"), "HEAD", allow=LOCAL)
    assert "200 OK" in text(head) and "héllo" not in text(head) and site.seen[-1].method == "HEAD"
    post = await fetch_url(site.url("/echo"), "POST", body='{"q": 1}', allow=LOCAL)
    echoed = json.loads(text(post).rsplit("\n", 1)[1])
    assert echoed == {"method": "POST", "body": '{"q": 1}', "type": "text/plain; charset=utf-8"}
    typed = await fetch_url(
        site.url("/echo"), "POST", body="{}", headers={"Content-Type": "application/json"}, allow=LOCAL
    )
    assert json.loads(text(typed).rsplit("\n", 1)[1])["type"] == "application/json"
    with pytest.raises(ToolError, match="body"):
        await fetch_url(site.url("/echo"), "GET", body="x", allow=LOCAL)


async def test_headers_are_sent_but_the_host_is_not_the_models_to_set(site: Site) -> None:
    result = await fetch_url(site.url("/headers"), headers={"X-Test": "yes"}, allow=LOCAL)
    assert json.loads(text(result).rsplit("\n", 1)[1])["x-test"] == "yes"
    for name in ("Host", "host", "Content-Length", "Transfer-Encoding"):
        with pytest.raises(ToolError, match=name.lower()):
            await fetch_url(site.url("/headers"), headers={name: "x"}, allow=LOCAL)
    for bad in ({"X-Split": "a\r\nInjected: 1"}, {"Bad Name": "x"}):
        with pytest.raises(ToolError, match="cannot be sent"):
            await fetch_url(site.url("/headers"), headers=bad, allow=LOCAL)


# ------------------------------------------------------------------ redirects


async def test_follows_redirects_up_to_the_limit_and_no_further(site: Site) -> None:
    result = await fetch_url(site.url(f"/redirect/{MAX_REDIRECTS}"), allow=LOCAL)
    assert MAX_REDIRECTS == 5
    assert text(result).endswith("arrived") and result.details["url"] == site.url("/redirect/0")
    assert len(result.details["redirects"]) == MAX_REDIRECTS
    site.seen.clear()
    with pytest.raises(ToolError, match="redirect"):
        await fetch_url(site.url(f"/redirect/{MAX_REDIRECTS + 1}"), allow=LOCAL)
    assert len(site.seen) == MAX_REDIRECTS + 1  # the sixth Location is never requested


@pytest.mark.parametrize(
    ("to", "word"),
    [
        ("http://127.0.0.1:{port}/text", "loopback"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://10.0.0.1/", "private"),
        ("file:///etc/passwd", "http"),
    ],
)
async def test_a_redirect_to_a_refused_address_is_refused(site: Site, to: str, word: str) -> None:
    """The first hop is allowed by name; where it redirects is checked again, on its own."""
    dns = resolver({"site.test": ["127.0.0.1"]})
    start = site.url(f"/go?to={to.format(port=site.port)}", host="site.test")
    with pytest.raises(ToolError, match=word) as refused:
        await fetch_url(start, allow=["site.test"], resolve=dns)
    assert "redirected" in str(refused.value)
    assert [s.path.split("?")[0] for s in site.seen] == ["/go"]


async def test_a_redirect_status_without_a_location_is_the_answer(site: Site) -> None:
    result = await fetch_url(site.url("/nowhere"), allow=LOCAL)
    assert "302 Found" in text(result) and text(result).endswith("no location given")


async def test_post_becomes_get_after_303_and_credentials_stay_with_their_origin(site: Site) -> None:
    dns = resolver({"site.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
    allow = ["site.test", "other.test"]
    to = site.url("/echo", host="other.test")
    result = await fetch_url(
        site.url(f"/go?status=303+See+Other&to={to}", host="site.test"), "POST", body="x", allow=allow, resolve=dns
    )
    assert json.loads(text(result).rsplit("\n", 1)[1])["method"] == "GET"
    secret = {"Authorization": "Bearer s3cret", "Cookie": "a=b", "X-Keep": "1"}
    to = site.url("/headers", host="other.test")
    result = await fetch_url(site.url(f"/go?to={to}", host="site.test"), headers=secret, allow=allow, resolve=dns)
    arrived = json.loads(text(result).rsplit("\n", 1)[1])
    assert "authorization" not in arrived and "cookie" not in arrived and arrived["x-keep"] == "1"
    assert site.seen[-2].headers["authorization"] == "Bearer s3cret"  # the first hop had it


# ------------------------------------------------------------------ the SSRF guard


@pytest.mark.parametrize(
    ("url", "word"),
    [
        ("http://127.0.0.1/", "loopback"),
        ("http://localhost/", "loopback"),
        ("http://[::1]:8080/", "loopback"),
        ("http://[::ffff:127.0.0.1]/", "loopback"),
        ("http://2130706433/", "loopback"),
        ("http://10.1.2.3/", "private"),
        ("http://172.16.3.4/", "private"),
        ("https://192.168.1.1/admin", "private"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://[fe80::1]/", "link-local"),
        ("http://[fd12:3456::1]/", "private"),
        ("http://0.0.0.0/", "unspecified"),
        ("http://[::]/", "unspecified"),
        ("http://224.0.0.1/", "multicast"),
        ("http://100.64.0.1/", "not a public"),
        # IPv4 carried inside IPv6: judged as the IPv4 address it reaches
        ("http://[64:ff9b::7f00:1]/", "loopback"),  # NAT64, well-known prefix
        ("http://[64:ff9b::a9fe:a9fe]/", "link-local"),
        ("http://[2002:a00:1::]/", "private"),  # 6to4 of 10.0.0.1
        ("http://[2002:7f00:1::1]/", "loopback"),
        ("http://[64:ff9b:1::a00:1]/", "not a public"),  # NAT64 local use (RFC 8215)
        ("http://[::127.0.0.1]/", "not a public"),  # IPv4-compatible (deprecated)
    ],
)
async def test_private_loopback_and_metadata_addresses_are_refused(url: str, word: str) -> None:
    with pytest.raises(ToolError, match=word):
        await fetch_url(url)


async def test_public_ipv4_inside_ipv6_is_still_public() -> None:
    for address in ("64:ff9b::808:808", "2002:808:808::1"):  # 8.8.8.8 by NAT64 and by 6to4
        assert refusal(ipaddress.ip_address(address)) is None


async def test_a_name_resolving_to_a_private_address_is_refused() -> None:
    dns = resolver({"intranet.test": ["10.9.8.7"], "mixed.test": ["93.184.216.34", "127.0.0.1"]})
    with pytest.raises(ToolError, match=r"intranet\.test.*10\.9\.8\.7.*private"):
        await fetch_url("http://intranet.test/", resolve=dns)
    with pytest.raises(ToolError, match=r"127\.0\.0\.1"):
        await fetch_url("http://mixed.test/", resolve=dns)
    with pytest.raises(ToolError, match="resolve"):
        await fetch_url("http://nowhere.test/", resolve=dns)


async def test_it_connects_to_the_address_it_checked_and_names_the_host(site: Site) -> None:
    """Resolved once per hop, connected to by address: a second answer (DNS rebinding) is never
    asked for; the server still sees the host name the URL gave."""
    asked: list[str] = []
    dns = resolver({"site.test": ["127.0.0.1"]}, asked)
    result = await fetch_url(site.url("/headers", host="site.test"), allow=["site.test"], resolve=dns)
    assert json.loads(text(result).rsplit("\n", 1)[1])["host"] == f"site.test:{site.port}"
    assert asked == ["site.test"] and result.details["url"] == site.url("/headers", host="site.test")


async def test_the_allow_list_takes_names_addresses_and_networks(site: Site) -> None:
    dns = resolver({"site.test": ["127.0.0.1"]})
    for allow in (["127.0.0.1"], ["127.0.0.0/8"], ["SITE.test"]):
        result = await fetch_url(site.url("/text", host="site.test"), allow=allow, resolve=dns)
        assert not result.is_error, allow
    with pytest.raises(ToolError, match="allow"):  # the refusal says how to allow it
        await fetch_url(site.url("/text"), allow=["10.0.0.0/8"])
    with pytest.raises(ValueError):
        fetch_tool(allow=["not a host/99"])


@pytest.mark.parametrize(
    "url", ["file:///etc/passwd", "ftp://example.com/x", "gopher://example.com/", "data:text/plain,hi", "example.com/x"]
)
async def test_other_schemes_are_refused_before_any_lookup(url: str) -> None:
    asked: list[str] = []
    with pytest.raises(ToolError, match="http"):
        await fetch_url(url, resolve=resolver({}, asked))
    assert asked == []


# ------------------------------------------------------------------ limits


async def test_the_timeout_is_honoured(site: Site) -> None:
    started = time.monotonic()
    with pytest.raises(ToolError, match=r"timed out after 0\.5 s"):
        await fetch_url(site.url("/sleep"), timeout=0.5, allow=LOCAL)
    assert time.monotonic() - started < 3


async def test_the_timeout_bounds_the_whole_fetch_not_each_read(site: Site) -> None:
    started = time.monotonic()
    with pytest.raises(ToolError, match="timed out"):
        await fetch_url(site.url("/drip"), timeout=1, allow=LOCAL)
    assert time.monotonic() - started < 4


@functools.cache
def bomb(encoding: str) -> bytes:
    """64 MiB of zeros, gzipped or as raw deflate."""
    packer = zlib.compressobj(9, wbits=31 if encoding == "gzip" else -15)
    return packer.compress(bytes(64 * 1024 * 1024)) + packer.flush()


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_compressed_body_is_inflated_only_as_far_as_max_bytes(site: Site, encoding: str) -> None:
    bomb(encoding)  # (made before memory is traced)
    tracemalloc.start()
    try:
        result = await fetch_url(site.url(f"/bomb?encoding={encoding}"), max_bytes=1000, allow=LOCAL)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.details["truncated"] is True
    assert peak < 8 * 1024 * 1024  # never the whole 64 MiB, nor one network read's worth of it


async def test_compressed_bodies_still_read_and_unknown_encodings_are_refused(site: Site) -> None:
    assert "small and squeezed" in text(await fetch_url(site.url("/gzipped"), allow=LOCAL))
    with pytest.raises(ToolError, match="br"):
        await fetch_url(site.url("/brotli"), allow=LOCAL)
    with pytest.raises(ToolError, match="not valid gzip"):
        await fetch_url(site.url("/badgzip"), allow=LOCAL)


async def test_max_bytes_stops_the_download(site: Site) -> None:
    result = await fetch_url(site.url("/big?n=1000000"), max_bytes=1000, allow=LOCAL)
    shown = text(result)
    assert "a" * 1000 in shown and "a" * 1001 not in shown and "1000 bytes" in shown
    assert result.details["truncated"] is True
    whole = await fetch_url(site.url("/big?n=1000"), max_bytes=1000, allow=LOCAL)
    assert whole.details["truncated"] is False


async def test_long_text_is_cut_with_a_note(site: Site) -> None:
    result = await fetch_url(site.url("/big?n=5000"), max_chars=1000, allow=LOCAL)
    shown = text(result)
    assert "a" * 1000 in shown and "a" * 1001 not in shown and "5000" in shown


def test_the_tool_checks_its_arguments() -> None:
    fetch = fetch_tool()
    assert fetch.validate({"url": "https://example.com"})["method"] == "GET"
    for bad in ({"url": "https://x", "timeout": 500}, {"url": "https://x", "method": "DELETE"}, {}):
        with pytest.raises(ToolArgumentsError):
            fetch.validate(bad)
    props = fetch.parameters["properties"]
    assert set(props) >= {"url", "method", "headers", "body", "timeout", "max_bytes"}
    assert all(p.get("description") for p in props.values())


async def test_the_tool_runs_a_fetch(site: Site) -> None:
    fetch = fetch_tool(allow=LOCAL)
    result = await fetch.run(fetch.validate({"url": site.url("/text")}), ToolContext("c1", "Fetch"))
    assert text(result).endswith("héllo wörld")
    refused = fetch_tool()
    with pytest.raises(ToolError, match="loopback"):
        await refused.run(refused.validate({"url": site.url("/text")}), ToolContext("c2", "Fetch"))


# ------------------------------------------------------------------ where it fits


def test_fetch_is_a_builtin_with_syscall_net_fetch(tmp_path: Path) -> None:
    tools = {t.name: t for t in builtin_tools(tmp_path)}
    assert SYSCALLS["Fetch"] == "net.fetch" and syscall_of(tools["Fetch"]) == "net.fetch"
    assert "Fetch" not in {t.name for t in builtin_tools(tmp_path, fetch=False)}
    assert "net.fetch" in DEVICE_SYSCALLS


class Directory:
    """One device of alice's that lends ``net.fetch``; its calls are recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any], float | None]] = []

    def online(self, owner: str) -> list[DeviceInfo]:
        return [DeviceInfo("laptop", "alice", ("net.fetch",))] if owner == "alice" else []

    async def call(
        self,
        owner: str,
        device_id: str,
        call: str,
        args: dict[str, Any],
        timeout: float | None,  # noqa: ASYNC109
        **options: Any,  # (the hub's waiting: idempotent, progress)
    ) -> Any:
        self.calls.append((call, args, timeout))
        return ToolResult.text("from the laptop")


async def test_a_device_can_serve_fetches(tmp_path: Path) -> None:
    directory = Directory()
    record = ProcessRecord(pid="p1", owner="alice", run_as="alice", cwd=str(tmp_path))
    tools = device_toolset(directory)(record, {t.name: t for t in builtin_tools(tmp_path)})
    fetch = tools["Fetch"]
    assert fetch.parameters["properties"]["target"]["enum"] == ["local", "laptop"]
    args = fetch.validate({"url": "http://printer.lan/", "target": "laptop", "timeout": 100})
    result = await fetch.run(args, ToolContext("c", "Fetch", tmp_path))
    assert text(result) == "from the laptop"
    [(syscall, sent, timeout)] = directory.calls
    assert syscall == "net.fetch" and sent["url"] == "http://printer.lan/" and "target" not in sent
    assert timeout is not None and timeout > 100  # its own timeout, and time to report it
    assert call_target("net.fetch", "Fetch", {"url": "x", "target": "laptop"}) == "laptop"
    remote = decide(default_policy(), "net.fetch", {"url": "x"}, target="laptop", cwd="/w", home="/h")
    assert "remote" in remote.tags


def test_a_device_lends_fetches_only_when_told(tmp_path: Path) -> None:
    def options(allow: str) -> DeviceOptions:
        return DeviceOptions(url="ws://h/v1/ws", token="t", name="d", root=tmp_path, implements=parse_allow(allow))

    assert DeviceClient(options("read,net.fetch")).handlers["net.fetch"].name == "Fetch"
    assert "net.fetch" not in DeviceClient(options("fs,shell")).handlers


# ------------------------------------------------------------------ approval


def test_the_default_policy_asks_before_every_fetch() -> None:
    """Even a GET sends what its URL holds to a host the model chose, and brings back text
    nobody vetted: a person sees the URL first. A POST is also ``mutating``."""
    get = decide(default_policy(), "net.fetch", {"url": "https://example.com/", "method": "GET"}, cwd="/w", home="/h")
    assert get.action == "ask" and get.tags == ["network"] and "https://example.com/" in get.reason
    post = decide(default_policy(), "net.fetch", {"url": "https://x/", "method": "POST"}, cwd="/w", home="/h")
    assert post.action == "ask" and set(post.tags) == {"network", "mutating"}


def test_a_policy_can_trust_reads_and_still_ask_for_posts() -> None:
    policy, warnings = parse_policy(
        {
            "rules": [
                {"match": "net.fetch", "when": {"anyTag": ["mutating"]}, "action": "ask"},
                {"match": "net.fetch", "action": "auto"},
            ]
        }
    )
    assert warnings == []
    get = decide(policy, "net.fetch", {"url": "https://x/", "method": "GET"}, cwd="/w", home="/h")
    post = decide(policy, "net.fetch", {"url": "https://x/", "method": "POST"}, cwd="/w", home="/h")
    assert (get.action, post.action) == ("auto", "ask")


async def wait_for_ask(proc: Any, seconds: float = 5.0) -> list[Any]:
    for _ in range(int(seconds / 0.01)):
        pending = await proc.pending_approvals()
        if pending or (await proc.info()).current_run is None:
            return list(pending)
        await asyncio.sleep(0.01)
    raise AssertionError("no approval was requested")


async def test_a_durable_process_asks_before_fetching(tmp_path: Path, site: Site) -> None:
    model = ScriptedModel([Reply(tool_calls=[call("Fetch", url=site.url("/text"))]), "read it"])
    tools = [*builtin_tools(tmp_path, fetch=False), fetch_tool(allow=LOCAL)]
    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=tools) as k:
        proc = await k.spawn(owner="alice", cwd=tmp_path)
        await proc.send("read the page")
        [ask] = await wait_for_ask(proc)
        assert ask.syscall == "net.fetch" and ask.tags == ["network"] and site.url("/text") in ask.reason
        assert site.seen == []  # nothing was fetched before the answer
        await proc.hil(ask.request_id, "approve")
        await proc.wait_idle()
        result = next(m for m in await proc.messages() if isinstance(m, ToolResultMessage))
        assert not result.is_error and "héllo wörld" in result.text
