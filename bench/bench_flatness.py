"""Is the loop's per-call cost flat in history length? (W3's question, answered per call.)

One run of 200 tool turns; the scripted model notes the time of each call, so the gap between
consecutive calls is the loop's own work for one turn (tool execution included, model excluded).
Compares the median gap of the first 20 calls with that of the last 20, over several runs.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time

from agentloop import Agent, Reply, ScriptedModel, ToolCall, ToolResultMessage, tool
from agentloop.models.base import ModelRequest

STEPS = 200
RUNS = 7


@tool
def echo(text: str) -> str:
    """Return the text."""
    return text


async def one_run() -> list[float]:
    stamps: list[float] = []

    def brain(request: ModelRequest) -> Reply | str:
        stamps.append(time.perf_counter())
        last = request.messages[-1]
        step = int(last.tool_call_id.split("_")[1]) + 1 if isinstance(last, ToolResultMessage) else 0
        if step >= STEPS:
            return "done"
        return Reply(tool_calls=[ToolCall(id=f"call_{step}", name="echo", arguments={"text": "hi"})])

    agent = Agent(model=ScriptedModel(brain, keep_requests=False), tools=[echo])
    result = await agent.run("hi")
    assert result.text == "done"
    return [b - a for a, b in itertools.pairwise(stamps)]


async def main() -> None:
    await one_run()  # warm-up
    first: list[float] = []
    last: list[float] = []
    for _ in range(RUNS):
        gaps = await one_run()
        first.extend(gaps[:20])
        last.extend(gaps[-20:])
    f, la = statistics.median(first) * 1e6, statistics.median(last) * 1e6
    print("## W3 flatness: loop work per turn, early vs late in a 200-turn run\n")
    print("| turns | median µs/turn |\n|---|---:|")
    print(f"| 1-20 (history 2-40 messages) | {f:.1f} |")
    print(f"| 181-200 (history 362-400 messages) | {la:.1f} |")
    print(f"\nratio late/early: {la / f:.2f} (target ≤ 1.5: {'met' if la / f <= 1.5 else 'NOT met'})")


if __name__ == "__main__":
    asyncio.run(main())
