"""Review of the session's changes: defects found in the usage increments and Fetch's own
inflating, each pinned by a test that failed before its fix."""

from __future__ import annotations

import asyncio
import ipaddress
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentloop.messages import Usage
from agentloop.process.store import ProcessRecord, Store, UsageTotals, open_store
from agentloop.process.store.common import usage_columns
from agentloop.tools.base import TextContent, ToolResult
from agentloop.tools.fetch import fetch_url, refusal
from tests.store_conformance.test_conformance import make_store, store  # noqa: F401
from tests.test_process_titles import titles_kernel

LOCAL = ("127.0.0.1",)

Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]


class RawSite:
    """An HTTP/1.1 server on 127.0.0.1 whose one handler writes the raw answer (chunks, pauses)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.port = 0
        self.heads: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.heads.append(head)
            await self.handler(head, writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def url(self, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.port}{path}"


async def started(handler: Handler) -> AsyncIterator[RawSite]:
    site = RawSite(handler)
    server = await asyncio.start_server(site.serve, "127.0.0.1", 0)
    site.port = server.sockets[0].getsockname()[1]
    try:
        yield site
    finally:
        server.close()
        await server.wait_closed()


def text(result: ToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


def header(head: bytes, name: str) -> str | None:
    for line in head.decode("latin-1").split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name:
            return value.strip()
    return None


# -- Fetch: the encodings it asks for are the ones it can read ------------------------------------


async def test_fetch_asks_only_for_the_encodings_it_inflates(monkeypatch: pytest.MonkeyPatch) -> None:
    """httpx advertises br and zstd whenever brotli or zstandard happens to be installed, but Fetch
    now inflates bodies itself (gzip and deflate only): a server that took up the offer would get
    every page refused as 'compressed as br'."""
    monkeypatch.setattr(httpx._client, "ACCEPT_ENCODING", "gzip, deflate, br, zstd")

    async def answer(head: bytes, writer: asyncio.StreamWriter) -> None:
        offered = {e.strip().split(";")[0] for e in (header(head, "accept-encoding") or "").split(",")}
        if "br" in offered:  # as a CDN does: the best it was offered
            body, encoding = b"\x0b\x02\x80hi\x03", "br"
        else:
            body, encoding = zlib.compress(b"hello there"), "deflate"
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            + f"Content-Encoding: {encoding}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

    async for site in started(answer):
        assert "hello there" in text(await fetch_url(site.url(), allow=LOCAL))


# -- Fetch: deflate told apart by its first two bytes, whatever the first read holds ---------------


async def test_zlib_wrapped_deflate_whose_first_read_is_one_byte() -> None:
    """``_Deflate`` chose raw deflate whenever the first network read held fewer than two bytes
    (a chunked body whose first chunk is one byte): the zlib-wrapped body then failed as
    'not valid deflate'."""
    body = zlib.compress(b"wrapped and chunked " * 20)

    async def answer(head: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Encoding: deflate\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        writer.write(b"1\r\n" + body[:1] + b"\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)  # (the client reads the one byte on its own)
        rest = body[1:]
        writer.write(f"{len(rest):x}\r\n".encode() + rest + b"\r\n0\r\n\r\n")

    async for site in started(answer):
        assert "wrapped and chunked" in text(await fetch_url(site.url(), allow=LOCAL))


# -- the stores: a total set and an increment in one update_process call --------------------------


async def test_a_total_set_and_added_to_in_one_call_is_their_sum(store: Store) -> None:  # noqa: F811
    """PostgreSQL sets the sum when one ``update_process`` call sets a total and adds to it
    (``usage_added``); SQLite dropped the increment when it came first among the arguments."""
    async with store.transaction():
        await store.create_process(ProcessRecord(pid="p1", owner="alice", run_as="alice", cwd="/"))
    added = UsageTotals(1, 2, 3, 0.5, 0)
    async with store.transaction():
        await store.update_process("p1", usage_added=added, **usage_columns(UsageTotals(10, 20, 30, 1.0, 4)))
    got = await store.get_process("p1")
    assert got is not None and got.usage == UsageTotals(11, 22, 33, 1.5, 4)


# -- Fetch's address guard: IPv4 carried in IPv6 ---------------------------------------------------


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("::ffff:0:127.0.0.1", "loopback"),  # SIIT's IPv4-translated form (RFC 2765): as NAT64's prefix
        ("::ffff:0:10.0.0.1", "private"),
        ("::ffff:0:169.254.169.254", "link-local"),
        ("fec0::1", "public"),  # site-local (deprecated, RFC 3879): routed only inside a site
    ],
)
def test_ipv6_forms_of_private_targets_are_refused(address: str, why: str) -> None:
    reason = refusal(ipaddress.ip_address(address))
    assert reason is not None and why in reason


def test_a_public_ipv4_in_siit_form_is_still_public() -> None:
    assert refusal(ipaddress.ip_address("::ffff:0:8.8.8.8")) is None


# -- titles: the close keeps a model's title made just before it -----------------------------------


async def test_a_model_title_made_as_the_kernel_closes_is_not_replaced_by_the_fallback(tmp_path: Path) -> None:
    """A title task that has just finished (its model title handed to the writer) is still in
    ``asking`` until its done callback runs, a loop turn later: a close in between wrote the
    fallback over the model's title."""
    answered = asyncio.Event()

    async def namer(record: Any, text: str) -> str:
        answered.set()  # wakes the test in the turn the title task ends, before its done callback
        return "Lisbon trip"

    async with titles_kernel(tmp_path, titles=namer) as k:
        proc = await k.spawn(owner="alice", text="we go to portugal in may")
        await answered.wait()
        await k.titles.close()  # (what the kernel's close does first)
        pid = proc.pid
    async with titles_kernel(tmp_path) as k:
        assert await (await k.process(pid)).title() == "Lisbon trip"


# -- the cached totals follow an increment that commits in a group, even if its caller is gone -----


async def test_a_title_cancelled_while_its_usage_rides_a_group_commit_still_counts_in_the_cache(
    tmp_path: Path,
) -> None:
    """``ProcessEngine.add_usage`` added to the cached totals only after awaiting its commit: on
    SQLite a group member's increment is kept when the group commits, whether or not its task was
    cancelled meanwhile (a reset or kill cancels the title task), and the cache then said less
    than the store until the process was loaded again."""
    async with titles_kernel(tmp_path) as k:
        proc = await k.spawn(owner="alice", text="hello")
        await proc.wait_idle()
        store, engine = k.store, k.engine

        async def other() -> None:  # commits alone: the next transaction of this turn joins a group
            async with store.transaction():
                await store.kv_set(proc.pid, "review:x", 1)

        first = asyncio.ensure_future(other())
        adding = asyncio.ensure_future(engine.add_usage(proc.pid, Usage(input=7, output=3, total_tokens=10)))
        await asyncio.sleep(0)  # both ran their bodies; the increment waits for its group
        assert not adding.done()
        adding.cancel()
        await asyncio.gather(first, adding, return_exceptions=True)
        await asyncio.sleep(0.05)  # (the group commits)
        stored = await store.get_process(proc.pid)
        live = engine.cached(proc.pid)
        assert stored is not None and live is not None
        assert stored.usage.input == live.record.usage.input


# -- PostgreSQL: a kill on one worker while another adds to the totals ------------------------------


async def test_an_increment_committed_while_a_delete_waits_is_folded_into_the_account(pg_url: str) -> None:
    """The delete's fold read the process row from the statement's snapshot, taken before the
    row lock it then waited for: an increment another worker committed meanwhile (a title's
    usage) went with the deleted row instead of into the account's totals."""
    adder, killer = open_store(pg_url), open_store(pg_url)
    await adder.open()
    await killer.open()
    try:
        async with adder.transaction():
            await adder.create_process(ProcessRecord(pid="p1", owner="alice", run_as="alice", cwd="/"))
        added = UsageTotals(5, 1, 6, 0.25, 0)
        deleting: asyncio.Task[None] | None = None

        async def delete() -> None:
            async with killer.transaction():
                await killer.delete_process("p1")

        async with adder.transaction():
            await adder.update_process("p1", usage_added=added)  # the row is locked until this commits
            deleting = asyncio.ensure_future(delete())
            await asyncio.sleep(0.3)  # the delete's statement is under way, waiting for the lock
            assert not deleting.done()
        await deleting
        assert await adder.get_process("p1") is None
        assert await adder.account_usage("alice") == added
    finally:
        await adder.close()
        await killer.close()
