"""A process that runs a durable agent on a store and may be SIGKILLed at any moment.

Run by ``test_crash_resume.py``: ``python crash_worker.py DB SIDE_EFFECTS_FILE``, where DB is a
SQLite file's path or a store URL (``postgresql://…``). Each start
opens the kernel (which resumes any unfinished run), approves what waits for approval, starts the
conversation if it has not started, waits until the process is idle and prints DONE.
"""

from __future__ import annotations

import asyncio
import os
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from agentloop import Reply, ScriptedModel, ToolResultMessage, call, tool
from agentloop.kernel import Approval, Kernel
from agentloop.models.base import ModelRequest

ROUNDS = 3


def main(db: str, side_effects: str) -> None:
    effects = Path(side_effects)

    @tool
    async def append_line(n: int) -> str:
        """Not idempotent: appends to a file."""
        await asyncio.sleep(0.03)
        with effects.open("a") as f:
            f.write(f"{n}\n")
            f.flush()
        return f"appended {n}"

    @tool(idempotent=True)
    async def lookup(n: int) -> str:
        """Idempotent: reads only."""
        await asyncio.sleep(0.02)
        return f"looked up {n}"

    def brain(request: ModelRequest) -> Reply | str:
        done = sum(1 for m in request.messages if isinstance(m, ToolResultMessage)) // 2
        if done >= ROUNDS:
            return "finished after all rounds"
        return Reply(text=f"round {done}", tool_calls=[call("append_line", n=done), call("lookup", n=done)])

    async def policy(process: object, row: object) -> Approval:
        args = getattr(row, "args", {})
        if getattr(row, "tool_name", "") == "append_line" and args.get("n") == 1:
            return Approval("ask", ("mutating",), "second append", fingerprint=str(args))
        return Approval("auto")

    async def run() -> None:
        model = ScriptedModel(brain, latency=0.03, chunk=4)
        url = db if "://" in db else f"sqlite:///{db}"
        # one worker name across restarts: a restarted worker takes its leases back at once
        async with Kernel.open(url, model=model, tools=[append_line, lookup], approval=policy, worker="crash") as k:
            print("READY", flush=True)
            procs = await k.processes()
            proc = await k.process(procs[0].pid) if procs else await k.spawn(owner="crash", pid="p1")
            if not await proc.history():
                await proc.send("start", run_id="the-run")
            while True:
                pending = await proc.pending_approvals()
                if pending:  # a person takes a moment to decide: the run waits meanwhile
                    await asyncio.sleep(0.1)
                for row in pending:
                    await proc.hil(row.request_id, "approve")
                info = await proc.info()
                if info.current_run is None:
                    await proc.wait_idle()
                    if (await proc.info()).current_run is None:
                        break
                await asyncio.sleep(0.01)
        print("DONE", flush=True)

    asyncio.run(run())


def forked(db: str, side_effects: str, out: Connection, err: Connection) -> None:
    """``main`` in a process forked from the tests' fork server (``test_crash_resume._start``),
    this module and the package imported already: its stdout and stderr are the pipes given."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    main(db, side_effects)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
