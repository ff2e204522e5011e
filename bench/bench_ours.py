"""agentloop on the peer harness's workloads (W1-W4), in memory (``bench_ours_sqlite.py``: durable).

Run through the harness so the figures land beside its ``baseline`` / ``baseline-sqlite`` rows,
measured in the same run (``bench/run.sh`` does that and prints the ratios). The fake model is
agentloop's own ``ScriptedModel`` driven by the harness's ``common.next_action``; the tool is the
harness's function wrapped with ``@tool``, so it goes through schema validation like any tool.
Durable: one kernel on a fresh SQLite file; each run is a new process (spawn, send, wait until
idle), every step committed.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import common  # type: ignore[import-not-found]  # the harness folder, put on PYTHONPATH by run_all.sh

from agentloop import Agent, AssistantMessage, Reply, ScriptedModel, Tool, ToolCall, ToolResultMessage, tool
from agentloop.kernel import Kernel
from agentloop.models.base import ModelRequest


def _model(wl: common.Workload) -> ScriptedModel:
    def brain(request: ModelRequest) -> Reply | str:
        last = request.messages[-1]
        last_id = last.tool_call_id if isinstance(last, ToolResultMessage) else None
        action = common.next_action(last_id, wl)
        if action is None:
            return common.FINAL_TEXT
        return Reply(tool_calls=[ToolCall(id=cid, name=name, arguments=args) for cid, name, args in action])

    return ScriptedModel(brain, latency=wl.latency, keep_requests=False)


def _tool(wl: common.Workload) -> Tool:
    """The workload's tool. W3 calls it with the same arguments, for the same result, 200 times
    in a row by design: ``repeatable``, or the repeated-call guard (on by default) would end the
    run at the 5th, as it should for a model doing that. Every other workload counts its calls."""
    return tool(wl.tool_fn, name=wl.tool, repeatable=wl.steps > 1)


def make_runner(wl: common.Workload) -> Callable[[], Awaitable[str]]:
    agent = Agent(model=_model(wl), tools=[_tool(wl)], system_prompt=common.SYSTEM_PROMPT)

    async def run() -> str:
        result = await agent.run(common.USER_PROMPT)
        return result.text

    return run


def make_durable_runner(wl: common.Workload) -> Callable[[], Awaitable[str]]:
    folder = tempfile.mkdtemp(prefix="bench-agentloop-")
    stack = AsyncExitStack()
    kernels: list[Kernel] = []

    async def run() -> str:
        if not kernels:
            kernels.append(
                await stack.enter_async_context(
                    Kernel.open(
                        f"sqlite:///{folder}/agentloop.db",
                        model=_model(wl),
                        tools=[_tool(wl)],
                        system_prompt=common.SYSTEM_PROMPT,
                        workspace=folder,
                    )
                )
            )
        kernel = kernels[0]
        # a new conversation with its first message: the process and its run commit together
        proc = await kernel.spawn(owner="bench", text=common.USER_PROMPT)
        await proc.wait_idle()
        last = (await proc.history(limit=1))[-1].message
        return last.text if isinstance(last, AssistantMessage) else ""

    atexit.register(shutil.rmtree, folder, True)
    return run


if __name__ == "__main__":
    common.main("ours", make_runner, caps="no iteration cap (none by default)")
