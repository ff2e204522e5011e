"""Structured output of a durable run: ``Process.send(..., output_schema=...)`` (and ``spawn``)
gives the run that answers that input a ``final_result`` tool with the schema; its valid call ends
the run, whose ``proc.run.finished`` carries the value as ``output``; a text answer is nudged, at
most a few times, then the run ends with reason ``output_missing``. The schema is kept with the run,
so a restart resumes it with the same tool."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from agentloop import Reply, ScriptedModel, call, tool
from agentloop.kernel import Approval
from agentloop.loop.output import MAX_SCHEMA_BYTES
from agentloop.messages import SystemMessage, ToolResultMessage
from agentloop.models.base import ModelRequest
from agentloop.process.admission import output_key
from tests import server_support
from tests.process_support import kernel
from tests.server_support import LiveServer
from tests.ws_support import KernelServer

CITY = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
}


class City(BaseModel):
    name: str
    population: int


def scripted(*replies: Reply | str) -> ScriptedModel:
    queue = list(replies)

    def brain(request: ModelRequest) -> Reply | str:
        return queue.pop(0) if queue else "the model was called once too often"

    return ScriptedModel(brain)


def tool_names(request: ModelRequest) -> list[str]:
    return [t.name for t in request.tools]


async def finished(proc: Any) -> list[dict[str, Any]]:
    return [s.payload async for s in proc.signals(after_seq=0, follow=False) if s.signal == "proc.run.finished"]


async def test_a_send_with_a_schema_ends_on_the_final_result_call(tmp_path: Path) -> None:
    model = scripted(Reply(text="found it", tool_calls=[call("final_result", name="Paris", population=2100000)]))
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice")
        receipt = await proc.send("the capital of France?", output_schema=CITY)
        await proc.wait_idle()
        ends = await finished(proc)
        output = await proc.output(receipt.run_id)
        typed = await proc.output(receipt.run_id, City)
        rows = await k.store.kv_many(proc.pid, (output_key(receipt.run_id),))
    assert len(model.requests) == 1
    assert "final_result" in tool_names(model.requests[0])
    assert ends[-1]["status"] == "ok" and ends[-1]["runId"] == receipt.run_id
    assert ends[-1]["output"] == {"name": "Paris", "population": 2100000}
    assert output == {"name": "Paris", "population": 2100000}
    assert typed == City(name="Paris", population=2100000)
    assert rows == {}  # the run's output row ended with it


async def test_invalid_arguments_go_back_to_the_model(tmp_path: Path) -> None:
    model = scripted(
        Reply(tool_calls=[call("final_result", name="Paris", population="many")]),
        Reply(tool_calls=[call("final_result", name="Paris", population=2)]),
    )
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice", text="capital?", output_schema=CITY)
        await proc.wait_idle()
        messages = await proc.messages()
        ends = await finished(proc)
    assert len(model.requests) == 2
    seen = model.requests[1].messages[-1]
    assert isinstance(seen, ToolResultMessage) and seen.is_error and "population" in seen.text
    assert ends[-1]["output"] == {"name": "Paris", "population": 2}
    assert isinstance(messages[-1], ToolResultMessage) and messages[-1].terminate


async def test_words_are_nudged_then_the_call_comes(tmp_path: Path) -> None:
    model = scripted("It is Paris.", Reply(tool_calls=[call("final_result", name="Paris", population=3)]))
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice", text="capital?", output_schema=CITY)
        await proc.wait_idle()
        ends = await finished(proc)
    assert len(model.requests) == 2
    nudge = model.requests[1].messages[-1]
    assert isinstance(nudge, SystemMessage) and "final_result" in nudge.text
    assert ends[-1]["output"] == {"name": "Paris", "population": 3} and ends[-1]["reason"] == "turn.complete"


async def test_words_every_time_end_the_run_without_an_output(tmp_path: Path) -> None:
    model = ScriptedModel(lambda request: "Paris, I say.")
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice", text="capital?", output_schema=CITY)
        await proc.wait_idle()
        ends = await finished(proc)
        output = await proc.output(proc.started.run_id if proc.started else "")
    assert len(model.requests) == 3  # the answer, then two nudges
    assert ends[-1]["status"] == "ok" and ends[-1]["reason"] == "output_missing"
    assert ends[-1]["output"] is None and output is None


async def test_a_send_without_a_schema_afterwards_has_no_output_tool(tmp_path: Path) -> None:
    model = scripted(Reply(tool_calls=[call("final_result", result=["a", "b"])]), "plain words")
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice")
        first = await proc.send("list", output_schema={"type": "array", "items": {"type": "string"}})
        await proc.wait_idle()
        second = await proc.send("chat")
        await proc.wait_idle()
        ends = await finished(proc)
        assert await proc.output(first.run_id) == ["a", "b"]  # a non-object schema, wrapped as {"result": ...}
        assert await proc.output(second.run_id) is None
    assert "final_result" in tool_names(model.requests[0])
    assert "final_result" not in tool_names(model.requests[1])
    assert ends[0]["output"] == ["a", "b"]
    assert "output" not in ends[1] and ends[1]["text"] == "plain words"


async def test_a_bad_schema_is_refused_with_nothing_admitted(tmp_path: Path) -> None:
    model = scripted()
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice")
        bad: list[Any] = [{"type": "no such type"}, {"properties": 3}, "a string", {"x": float("nan")}]
        bad.append({"type": "object", "description": "x" * (MAX_SCHEMA_BYTES + 1)})
        for schema in bad:
            with pytest.raises(ValueError, match="output_schema"):
                await proc.send("hello", output_schema=schema)
        with pytest.raises(ValueError, match="output_schema"):
            await k.spawn(owner="alice", text="hi", output_schema={"type": 5})
        with pytest.raises(ValueError, match="text"):
            await k.spawn(owner="alice", output_schema=CITY)
        assert await proc.messages() == []
        assert len(await k.processes("alice")) == 1
    assert model.requests == []


async def test_a_pydantic_type_in_the_python_api(tmp_path: Path) -> None:
    model = scripted(Reply(tool_calls=[call("final_result", name="Rome", population="5")]))
    async with kernel(tmp_path, model) as k:
        proc = await k.spawn(owner="alice", text="capital?", output_schema=City)
        await proc.wait_idle()
        ends = await finished(proc)
    params = next(t for t in model.requests[0].tools if t.name == "final_result").parameters
    assert params["required"] == ["name", "population"] and "title" not in params
    assert ends[-1]["output"] == {"name": "Rome", "population": 5}  # (coerced, as any schema tool's)


async def test_input_with_a_schema_does_not_join_a_run_under_way(tmp_path: Path) -> None:
    gate = asyncio.Event()

    @tool
    async def wait_gate() -> str:
        """Wait."""
        await gate.wait()
        return "opened"

    def brain(request: ModelRequest) -> Reply | str:
        last = request.messages[-1]
        if last.text == "gate":
            return Reply(tool_calls=[call("wait_gate")])
        if "final_result" in tool_names(request):
            return Reply(tool_calls=[call("final_result", name="Oslo", population=1)])
        return "gate passed"

    async with kernel(tmp_path, ScriptedModel(brain), tools=[wait_gate]) as k:
        proc = await k.spawn(owner="alice", text="gate")
        await asyncio.sleep(0.05)
        receipt = await proc.send("capital?", output_schema=CITY)  # a steer, by default
        assert proc.started is not None and receipt.queued and receipt.run_id != proc.started.run_id
        # input withdrawn takes its output row with it; sent again, it is queued with a new one
        assert [q.run_id for q in await proc.withdraw()] == [receipt.run_id]
        assert await k.store.kv_many(proc.pid, (output_key(receipt.run_id),)) == {}
        receipt = await proc.send("capital?", output_schema=CITY)
        assert receipt.queued and list(await k.store.kv_many(proc.pid, (output_key(receipt.run_id),)))
        gate.set()
        await proc.wait_idle()
        while len(ends := await finished(proc)) < 2:
            await asyncio.sleep(0.01)
            await proc.wait_idle()
    assert "output" not in ends[0] and ends[0]["text"] == "gate passed"
    assert ends[1]["runId"] == receipt.run_id and ends[1]["output"] == {"name": "Oslo", "population": 1}


async def test_a_restart_resumes_the_run_with_the_same_output_tool(tmp_path: Path) -> None:
    @tool
    def rm(path: str) -> str:
        """Pretend to delete."""
        return f"removed {path}"

    async def policy(process: Any, row: Any) -> Approval:
        return Approval("ask", ("destructive",), "rm", fingerprint="rm") if row.tool_name == "rm" else Approval("auto")

    first = scripted(Reply(tool_calls=[call("rm", path="x")]))
    async with kernel(tmp_path, first, tools=[rm], approval=policy) as k:
        proc = await k.spawn(owner="alice", text="clean up, then the capital?", output_schema=CITY)
        for _ in range(200):
            if await proc.kernel.store.hils(proc.pid):
                break
            await asyncio.sleep(0.01)
        requests = await proc.kernel.store.hils(proc.pid)
        assert requests  # the run waits for a person: the kernel closes meanwhile
    second = scripted(Reply(tool_calls=[call("final_result", name="Bern", population=4)]))
    async with kernel(tmp_path, second, tools=[rm], approval=policy) as k:
        again = await k.process(proc.pid)
        assert await again.hil(requests[0].request_id, "approve")
        await again.wait_idle()
        ends = await finished(again)
        assert proc.started is not None
        output = await again.output(proc.started.run_id)
    assert "final_result" in tool_names(second.requests[0])
    params = next(t for t in second.requests[0].tools if t.name == "final_result").parameters
    assert json.dumps(params, sort_keys=True) == json.dumps(CITY, sort_keys=True)
    assert ends[-1]["output"] == {"name": "Bern", "population": 4} == output


# ------------------------------------------------------------------ over HTTP


def city_script(req: ModelRequest) -> Reply | str:
    if any(t.name == "final_result" for t in req.tools):
        return Reply(tool_calls=[call("final_result", name="Lima", population=10)])
    return "no output asked"


@pytest.fixture(scope="module")
def city_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with server_support.live_server(tmp_path_factory.mktemp("city"), model=ScriptedModel(city_script)) as srv:
        yield srv


async def test_http_send_with_a_schema_and_the_finished_event_carries_output(city_server: LiveServer) -> None:
    async with city_server.client(city_server.tokens.alice) as client:
        pid = (await client.post("/v1/processes", json={})).json()["pid"]
        resp = await client.post(f"/v1/processes/{pid}/messages", json={"text": "capital?", "output_schema": CITY})
        assert resp.status_code in (200, 201, 202), resp.text
        run_id = resp.json()["run_id"]
        frames = await sse_until_finished(client, pid, run_id)
        assert frames[-1]["output"] == {"name": "Lima", "population": 10}
        spawned = await client.post("/v1/processes", json={"text": "capital?", "output_schema": CITY})
        assert spawned.status_code in (200, 201), spawned.text
        body = spawned.json()
        frames = await sse_until_finished(client, body["pid"], body["run_id"])
        assert frames[-1]["output"] == {"name": "Lima", "population": 10}
        bad = await client.post(f"/v1/processes/{pid}/messages", json={"text": "x", "output_schema": {"type": 1}})
        assert bad.status_code == 400 and bad.json()["code"] == "invalid_request", bad.text
        bad = await client.post("/v1/processes", json={"text": "x", "output_schema": []})
        assert bad.status_code == 400 and bad.json()["code"] == "invalid_request", bad.text


async def sse_until_finished(client: Any, pid: str, run_id: str) -> list[dict[str, Any]]:
    """The ``proc.run.finished`` payloads of the process's event stream, up to ``run_id``'s."""
    found: list[dict[str, Any]] = []
    async with client.stream("GET", f"/v1/processes/{pid}/events?after_seq=0") as resp:
        event = None
        async for line in resp.aiter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event == "proc.run.finished":
                data = json.loads(line.split(":", 1)[1])["payload"]
                found.append(data)
                if data.get("runId") == run_id:
                    return found
    return found


# ------------------------------------------------------------------ over the WebSocket


def test_ws_send_and_spawn_with_a_schema(tmp_path: Path) -> None:
    with KernelServer(tmp_path, ScriptedModel(city_script)) as server, server.client("alice") as c:
        made = c.ok("proc.spawn", {"text": "capital?", "output_schema": CITY})
        pid = made["pid"]
        assert c.ok("proc.subscribe", {"pid": pid, "after_seq": 0})
        sigs = c.signals_until(pid, "proc.run.finished")
        assert sigs[-1]["payload"]["output"] == {"name": "Lima", "population": 10}
        assert sigs[-1]["payload"]["runId"] == made["run_id"]
        run_id = c.ok("proc.send", {"pid": pid, "text": "again", "output_schema": CITY})["run_id"]
        sigs = c.signals_until(pid, "proc.run.finished")
        assert sigs[-1]["payload"]["runId"] == run_id and sigs[-1]["payload"]["output"]["name"] == "Lima"
        assert c.error("proc.send", {"pid": pid, "text": "x", "output_schema": "nope"}) == "invalid_request"
        assert c.error("proc.send", {"pid": pid, "text": "x", "output_schema": {"type": 3}}) == "invalid_request"
        assert c.error("proc.spawn", {"output_schema": CITY}) == "invalid_request"  # no first message to answer


async def test_a_run_ended_before_its_configuration_was_built_leaves_no_output_row(tmp_path: Path) -> None:
    """Found by review: the output row was deleted only when the run's configuration (and so its
    output tool) was cached; a run ended before it was ever built (an internal error right after a
    reload) left the row for ever. Now such an end deletes it anyway."""
    from agentloop.process.admission import output_key
    from agentloop.process.driver import forget_output

    async with kernel(tmp_path, ScriptedModel(["ok"])) as k:
        proc = await k.spawn(owner="alice")
        async with k.store.transaction():
            await k.store.kv_set(proc.pid, output_key("r-lost"), {"schema": {"type": "integer"}})
        live = await k.engine.live(proc.pid)
        live.config = None  # (as after a reload: nothing built for the run yet)
        async with k.store.transaction():
            await forget_output(k.engine, live, "r-lost")
        assert await k.store.kv_get(proc.pid, output_key("r-lost")) is None
