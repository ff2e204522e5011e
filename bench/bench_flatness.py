"""Is the loop's per-call cost flat in history length? (W3's question, answered per call.)

One run of 200 tool turns; the scripted model notes the time of each call, so the gap between
consecutive calls is the loop's own work for one turn (tool execution included, model excluded).
Compares the median gap of the first 20 calls with that of the last 20, over several runs: once for
the in-memory ``Agent`` and once for a durable process on SQLite (every step committed).
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable

from agentloop import Agent, Kernel, Reply, ScriptedModel, ToolCall, ToolResultMessage, tool
from agentloop.models.base import ModelRequest

STEPS = 200
RUNS = 7


@tool(repeatable=True)  # (the same call 200 times by design: else the repeated-call guard ends the run)
def echo(text: str) -> str:
    """Return the text."""
    return text


def _scripted(stamps: list[float]) -> ScriptedModel:
    def brain(request: ModelRequest) -> Reply | str:
        stamps.append(time.perf_counter())
        last = request.messages[-1]
        step = int(last.tool_call_id.split("_")[1]) + 1 if isinstance(last, ToolResultMessage) else 0
        if step >= STEPS:
            return "done"
        return Reply(tool_calls=[ToolCall(id=f"call_{step}", name="echo", arguments={"text": "hi"})])

    return ScriptedModel(brain, keep_requests=False)


async def in_memory_run() -> list[float]:
    stamps: list[float] = []
    result = await Agent(model=_scripted(stamps), tools=[echo]).run("hi")
    assert result.text == "done"
    return [b - a for a, b in itertools.pairwise(stamps)]


async def durable_run() -> list[float]:
    stamps: list[float] = []
    folder = tempfile.mkdtemp(prefix="bench-flatness-")
    try:
        async with Kernel.open(
            f"sqlite:///{folder}/agentloop.db", model=_scripted(stamps), tools=[echo], workspace=folder
        ) as kernel:
            proc = await kernel.spawn(owner="bench")
            await proc.send("hi")
            await proc.wait_idle()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return [b - a for a, b in itertools.pairwise(stamps)]


async def measure(name: str, one_run: Callable[[], Awaitable[list[float]]]) -> None:
    await one_run()  # warm-up
    first: list[float] = []
    last: list[float] = []
    for _ in range(RUNS):
        gaps = await one_run()
        first.extend(gaps[:20])
        last.extend(gaps[-20:])
    f, la = statistics.median(first) * 1e6, statistics.median(last) * 1e6
    print(f"| {name} | {f:.1f} | {la:.1f} | {la / f:.2f} ({'met' if la / f <= 1.5 else 'NOT met'}) |")


async def main() -> None:
    print(f"## W3 flatness: loop work per turn, early vs late in a {STEPS}-turn run\n")
    print("median µs per turn; turns 1-20 see a history of 2-40 messages, the last 20 one of about 400;")
    print("target: ratio late/early ≤ 1.5\n")
    print("| runner | turns 1-20 | last 20 turns | ratio |\n|---|---:|---:|---|")
    await measure("in memory (Agent)", in_memory_run)
    await measure("durable (SQLite process)", durable_run)


if __name__ == "__main__":
    asyncio.run(main())
