"""SSE passthrough: how much delay the server adds between a provider token and the client.

The server runs as ``agentloop``'s app under uvicorn in a child process, on a paced model that
emits tokens carrying the ``perf_counter_ns`` at which it handed each one to the loop (the moment
a real adapter would have parsed it off the wire). The client (httpx, this process) stamps each
token again when its SSE event is parsed; the difference is the time spent in the loop, the
endpoint, the SSE encoder, the socket and the client's parser. On Linux ``perf_counter`` is the
system-wide monotonic clock, so stamps from the two processes compare directly; separate
processes keep the client from competing with the server for one GIL.

Two measurements:

* ``/engine/chat`` — one client, ``--tokens`` text deltas: p50 / p99 added latency.
* ``/v1/processes/{pid}/events`` — ``--clients`` SSE clients follow one process while a run
  streams ``--fanout-tokens`` deltas: delivery latency over all clients and tokens, and whether
  every client received every token.

Run: ``python bench/bench_sse.py`` (``--json`` for a machine-readable line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Mount, Route

from agentloop import Agent
from agentloop.kernel import Kernel
from agentloop.models.base import AssistantBuilder, Model, ModelInfo, ModelRequest, StreamEvent
from agentloop.server import ServerContext, create_server
from agentloop.server.auth import Accounts


class PacedModel(Model):
    """Streams numbered, time-stamped text deltas. The request's last message says how many and
    how far apart (``"<tokens> <interval seconds>"``), so one server serves every measurement."""

    def __init__(self) -> None:
        self.info = ModelInfo(provider="bench", id="paced", context_window=10_000_000)

    async def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
        count, interval = request.messages[-1].text.split()
        yield out.start()
        for _ in range(int(count)):
            await asyncio.sleep(float(interval))
            for event in out.text(f"<{time.perf_counter_ns()}>"):
                yield event
        for event in out.finish("stop"):
            yield event


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stamps(text: str) -> list[int]:
    """The send stamps in a text delta (one or several ``<ns>`` tokens, if the server merged any)."""
    return [int(part) for part in text.replace(">", "").split("<") if part]


def _percentiles(values_ns: list[int]) -> dict[str, float]:
    values = sorted(v / 1e6 for v in values_ns)
    if not values:
        return {"n": 0}
    p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
    return {"n": len(values), "p50_ms": statistics.median(values), "p99_ms": p99, "max_ms": values[-1]}


def _added(text: str, now: int) -> list[int]:
    return [now - sent for sent in _stamps(text)]


async def measure_engine_chat(
    url: str, token: str, tokens: int, interval: float, path: str = "/engine/chat"
) -> dict[str, float]:
    body = {"messages": [{"role": "user", "content": f"{tokens} {interval}"}], "metadata": {"correlation_id": "bench"}}
    added: list[int] = []
    headers = {"authorization": f"Bearer {token}"}
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", url + path, json=body, headers=headers) as resp,
    ):
        resp.raise_for_status()
        event = ""
        async for line in resp.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "text-delta":
                added += _added(json.loads(line[5:])["content"], time.perf_counter_ns())
    return {**_percentiles(added), "missing": tokens - len(added)}


async def _follow(client: httpx.AsyncClient, pid: str, out: list[int], ready: asyncio.Event) -> None:
    async with client.stream("GET", f"/v1/processes/{pid}/events") as resp:
        resp.raise_for_status()
        ready.set()
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            now = time.perf_counter_ns()
            data = json.loads(line[5:])
            if data.get("signal") == "proc.run.stream":
                payload = data.get("payload") or {}
                out += _added(str(payload.get("text") or payload.get("delta") or ""), now)
            elif data.get("signal") == "proc.run.finished":
                return


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure_fanout(
    url: str, token: str, clients: int, tokens: int, interval: float, server_pid: int
) -> dict[str, float]:
    headers = {"authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers, limits=limits) as client:
        resp = await client.post("/v1/processes", json={})
        resp.raise_for_status()
        pid = resp.json()["pid"]
        results: list[list[int]] = [[] for _ in range(clients)]
        readies = [asyncio.Event() for _ in range(clients)]
        tasks = [asyncio.create_task(_follow(client, pid, results[n], readies[n])) for n in range(clients)]
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 120)
        started, cpu_server, cpu_client = time.perf_counter(), cpu_seconds(server_pid), time.process_time()
        resp = await client.post(f"/v1/processes/{pid}/messages", json={"text": f"{tokens} {interval}"})
        resp.raise_for_status()
        await asyncio.wait_for(asyncio.gather(*tasks), 600)
        wall = time.perf_counter() - started
        cpu_server = cpu_seconds(server_pid) - cpu_server
        cpu_client = time.process_time() - cpu_client
    added = [v for got in results for v in got]
    complete = sum(1 for got in results if len(got) == tokens)
    return {
        **_percentiles(added),
        "clients": clients,
        "complete_clients": complete,
        "wall_s": wall,
        "server_cpu_s": cpu_server,
        "client_cpu_s": cpu_client,
    }


async def raw_stream(request: Request) -> EventSourceResponse:
    """The baseline: the same paced, stamped tokens sent straight from an SSE endpoint, with no
    agent loop, model adapter or event translation in between."""
    body = await request.json()
    count, interval = body["messages"][-1]["content"].split()

    async def events() -> AsyncIterator[ServerSentEvent]:
        for _ in range(int(count)):
            await asyncio.sleep(float(interval))
            yield ServerSentEvent(json.dumps({"content": f"<{time.perf_counter_ns()}>"}), event="text-delta")
        yield ServerSentEvent(json.dumps({"finish_reason": "stop"}), event="done")

    return EventSourceResponse(events())


def serve_forever(data: Path) -> None:
    """The child process: open a kernel on the paced model, make a token, serve until killed."""

    async def run() -> None:
        model = PacedModel()
        async with Kernel.open(f"sqlite:///{data}/agentloop.db", model=model, workspace=data) as kernel:
            accounts = Accounts(kernel.store)
            token = await accounts.bootstrap()
            ctx = ServerContext(kernel, accounts)
            app = Starlette(
                routes=[
                    Route("/bench/raw", raw_stream, methods=["POST"]),
                    Mount("/", create_server(ctx, lambda: Agent(model=model))),
                ]
            )
            port = _free_port()
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
            server_task = asyncio.create_task(server.serve())
            while not server.started:  # noqa: ASYNC110 - uvicorn offers no event to wait on
                await asyncio.sleep(0.01)
            print(f"READY http://127.0.0.1:{port} {token}", flush=True)
            await server_task

    asyncio.run(run())


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        child = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything is measured
            [sys.executable, __file__, "--serve", tmp], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            assert child.stdout is not None
            line = child.stdout.readline().split()
            if not line or line[0] != "READY":
                raise SystemExit("the benchmark server did not start")
            url, token = line[1], line[2]
            await measure_engine_chat(url, token, 5, 0)  # warm-up: imports, first connection
            for _ in range(args.repeat):  # interleaved, so both see the same machine load
                for name, path in (("raw_sse", "/bench/raw"), ("engine_chat", "/engine/chat")):
                    result = await measure_engine_chat(url, token, args.tokens, args.interval, path)
                    report.setdefault(name + "_runs", []).append(result)
            for name in ("raw_sse", "engine_chat"):
                runs = report.pop(name + "_runs")
                report[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            if not args.skip_fanout:
                try:
                    report["fanout"] = await measure_fanout(
                        url, token, args.clients, args.fanout_tokens, args.fanout_interval, child.pid
                    )
                except httpx.HTTPStatusError as exc:
                    report["fanout"] = {"error": f"{exc.response.status_code} {exc.request.url.path}"}
        finally:
            child.terminate()
            child.wait(30)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--interval", type=float, default=0.002, help="seconds between provider tokens")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--fanout-tokens", type=int, default=200)
    parser.add_argument("--fanout-interval", type=float, default=0.01)
    parser.add_argument("--skip-fanout", action="store_true")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs of each; medians reported")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", metavar="DATA_DIR", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.serve:
        serve_forever(Path(args.serve))
        return
    report = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(report))
        return
    chat, raw = report["engine_chat"], report["raw_sse"]
    spacing = f"{args.interval * 1000:g} ms apart"
    print(f"provider token -> SSE client, {args.tokens} tokens {spacing}, medians of {args.repeat}:")
    print(f"  /engine/chat    p50 {chat['p50_ms']:.3f} ms, p99 {chat['p99_ms']:.3f} ms, missing {chat['missing']:g}")
    print(f"  bare SSE route  p50 {raw['p50_ms']:.3f} ms, p99 {raw['p99_ms']:.3f} ms (same server, no agent loop)")
    print(
        f"  added by the loop and endpoint: p50 {chat['p50_ms'] - raw['p50_ms']:+.3f} ms"
        f" (target <= 1 ms), p99 {chat['p99_ms'] - raw['p99_ms']:+.3f} ms"
    )
    fan = report.get("fanout")
    if fan and "error" not in fan:
        print(f"/v1 events, {fan['clients']} SSE clients on one process, {args.fanout_tokens} tokens:")
        print(
            f"  delivery p50 {fan['p50_ms']:.3f} ms, p99 {fan['p99_ms']:.3f} ms, max {fan['max_ms']:.1f} ms;"
            f" {fan['complete_clients']}/{fan['clients']} clients got every token"
        )
        print(
            f"  run wall {fan['wall_s']:.2f} s (paced: {args.fanout_tokens * args.fanout_interval:.2f} s);"
            f" CPU: server {fan['server_cpu_s']:.2f} s, clients {fan['client_cpu_s']:.2f} s"
        )
    elif fan:
        print(f"/v1 events fan-out not measured: {fan['error']}", file=sys.stderr)


if __name__ == "__main__":
    main()
