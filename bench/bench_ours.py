"""agentloop on the peer harness's workloads (W1-W4), in memory.

Run through the harness so the figures land beside its ``baseline`` row, measured in the same run:

    OURS=$PWD/bench/bench_ours.py PY_OURS=$PWD/.venv/bin/python \\
        ../shared/bench/peers/run_all.sh baseline ours

or on its own (``bench/run.sh`` does both and prints the ratios). The fake model is agentloop's
own ``ScriptedModel`` driven by the harness's ``common.next_action``; the tool is the harness's
function wrapped with ``@tool``, so it goes through schema validation like any tool.
"""

from __future__ import annotations

import common  # type: ignore[import-not-found]  # the harness folder, put on PYTHONPATH by run_all.sh

from agentloop import Agent, Reply, ScriptedModel, ToolCall, ToolResultMessage, tool
from agentloop.models.base import ModelRequest


def make_runner(wl: common.Workload):  # type: ignore[no-untyped-def]
    def brain(request: ModelRequest) -> Reply | str:
        last = request.messages[-1]
        last_id = last.tool_call_id if isinstance(last, ToolResultMessage) else None
        action = common.next_action(last_id, wl)
        if action is None:
            return common.FINAL_TEXT
        return Reply(tool_calls=[ToolCall(id=cid, name=name, arguments=args) for cid, name, args in action])

    model = ScriptedModel(brain, latency=wl.latency, keep_requests=False)
    agent = Agent(model=model, tools=[tool(wl.tool_fn, name=wl.tool)], system_prompt=common.SYSTEM_PROMPT)

    async def run() -> str:
        result = await agent.run(common.USER_PROMPT)
        return result.text

    return run


if __name__ == "__main__":
    common.main("ours", make_runner, caps="no iteration cap (none by default)")
