"""A worker on a shared PostgreSQL database that is SIGKILLed while a tool of its run is in flight.

Run by ``test_scale_failover.py``: ``python failover_worker.py URL EFFECTS``. It opens a kernel
named ``doomed`` with a one-second lease, spawns process ``p1``, sends it a message whose run
calls ``append_slow`` (not idempotent), and prints ``TOOL`` once the tool has started; the test
kills it then, and another worker must finish the run.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Kernel
from agentloop.models.base import ModelRequest

LEASE_TTL = 1.0


def brain(request: ModelRequest) -> Reply | str:
    if not any(isinstance(m, ToolResultMessage) for m in request.messages):
        return Reply(tool_calls=[call("append_slow", n=0)])
    return "finished"


def main(url: str, effects: str) -> None:
    out = Path(effects)

    @tool
    async def append_slow(n: int) -> str:
        """Not idempotent: appends a line, slowly."""
        print("TOOL", flush=True)
        await asyncio.sleep(30)  # killed long before this ends
        with out.open("a") as f:
            f.write(f"{n}\n")
        return "appended"

    async def run() -> None:
        model = ScriptedModel(brain)
        async with Kernel.open(url, model=model, tools=[append_slow], worker="doomed", lease_ttl=LEASE_TTL) as k:
            proc = await k.spawn(owner="fail", pid="p1")
            await proc.send("go")
            await asyncio.sleep(60)

    asyncio.run(run())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
