"""Three limits of Retry and Rewind, lifted: a retry looks past the notes recorded after the failed
run (``Kernel.note``: an undelivered answer's, say), which stay in the history before the retried
run; a retried run that was asked for a structured output is asked for it again; and a rewind stops
the background jobs that the tool calls it takes out started (only those), whose ends then never
reach the rewound history."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from agentloop import Reply, ScriptedModel, call
from agentloop.kernel import Kernel
from agentloop.messages import SystemMessage, system, user
from agentloop.models.base import ModelRequest, ProviderError
from agentloop.models.retry import NO_RETRY
from agentloop.process.admission import output_key, retry_point
from agentloop.process.api import approve_everything
from agentloop.process.background import JOBS_KEY
from tests.process_support import kernel
from tests.test_background_shell import until
from tests.test_retry_run11 import _answer, ends, idle
from tests.test_tools_shell import alive, pid_from

DOWN = ProviderError("the provider is down", kind="auth")  # (not an outage the run waits out)
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
}


class Model:
    """The model's replies in order (a ``ProviderError`` fails the call; an ``asyncio.Event`` is
    waited for, then the next item answers); once spent, "answer". Every request is kept."""

    def __init__(self, *items: Any) -> None:
        self.items = list(items)
        self.requests: list[ModelRequest] = []
        self.model = ScriptedModel(self.brain)

    async def brain(self, request: ModelRequest) -> Any:
        self.requests.append(request)
        while self.items and isinstance(self.items[0], asyncio.Event):
            await self.items.pop(0).wait()
        item = self.items.pop(0) if self.items else "answer"
        if isinstance(item, ProviderError):
            raise item
        return item


# -- 1. a retry after a note --------------------------------------------------------------------


def test_retry_point_looks_past_closing_notes() -> None:
    failed, notice = _answer("half", "error"), system("The run failed: down", "error")
    note = system("The answer could not be delivered to the chat.", "event")
    assert retry_point([user("hi"), failed, notice, note]) == 1
    assert retry_point([user("hi"), failed, notice, note, note]) == 1
    assert retry_point([user("hi"), note]) == 1  # (an abort during the model call, then a note)
    assert retry_point([user("hi"), _answer("hello"), note]) is None  # an answer, then a note
    assert retry_point([note]) is None


async def test_a_note_after_a_failed_run_does_not_stop_its_retry(tmp_path: Path) -> None:
    script = Model(DOWN)
    async with kernel(tmp_path, script.model, retry=NO_RETRY) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("hello")
        await idle(proc)
        assert await k.note(proc.pid, "The answer never reached the chat.", note_id="undelivered:r1")
        receipt = await proc.retry()
        await idle(proc)
        msgs = await proc.messages()
        [segment] = await proc.segments()
        archived = await proc.segment(segment.id)
        finished = await ends(proc)
    asked = script.requests[1].messages  # the input, then the note: neither the failed turn nor its notice
    assert [(m.role, m.text) for m in asked] == [("user", "hello"), ("system", "The answer never reached the chat.")]
    assert [m.role for m in msgs] == ["user", "system", "assistant"]  # the note stays, before the retried run
    assert isinstance(msgs[1], SystemMessage) and msgs[1].kind == "event" and msgs[2].text == "answer"
    assert [m.role for _, m in archived.messages] == ["assistant", "system"]  # only the failed end went
    assert (finished[-1]["runId"], finished[-1]["status"]) == (receipt.run_id, "ok")


# -- 2. the retried run keeps its output ---------------------------------------------------------


async def test_a_retried_run_is_asked_for_the_same_output(tmp_path: Path) -> None:
    script = Model(DOWN, Reply(tool_calls=[call("final_result", name="Paris", population=2100000)]))
    async with kernel(tmp_path, script.model, retry=NO_RETRY) as k:
        proc = await k.spawn(owner="alice")
        first = await proc.send("the largest city of France", output_schema=CITY)
        await idle(proc)
        receipt = await proc.retry()
        await idle(proc)
        finished = await ends(proc)
        value = await proc.output(receipt.run_id)
        rows = [await k.store.kv_get(proc.pid, output_key(run)) for run in (first.run_id, receipt.run_id)]
    assert "final_result" in [t.name for t in script.requests[1].tools]  # the retried run's tool
    assert finished[-1]["runId"] == receipt.run_id and finished[-1]["status"] == "ok"
    assert finished[-1]["output"] == {"name": "Paris", "population": 2100000}
    assert value == {"name": "Paris", "population": 2100000}
    assert rows == [None, None]  # the output rows go with the runs


async def test_an_aborted_run_is_retried_with_its_output(tmp_path: Path) -> None:
    gate = asyncio.Event()
    script = Model(gate, Reply(tool_calls=[call("final_result", name="Lyon", population=520000)]))
    async with kernel(tmp_path, script.model, retry=NO_RETRY) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("the third city of France", output_schema=CITY)
        async with asyncio.timeout(5):
            while not script.requests:
                await asyncio.sleep(0.01)
        assert await proc.abort()
        await idle(proc)
        gate.set()  # (the aborted call never got past it)
        receipt = await proc.retry()
        await idle(proc)
        value = await proc.output(receipt.run_id)
    assert "final_result" in [t.name for t in script.requests[-1].tools]
    assert value == {"name": "Lyon", "population": 520000}


async def test_a_retry_of_a_run_without_output_asks_for_none(tmp_path: Path) -> None:
    """The output kept for a retry belongs to the run that failed: a later failed run asked for
    none retries without it."""
    script = Model(DOWN, DOWN)
    async with kernel(tmp_path, script.model, retry=NO_RETRY) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("a city", output_schema=CITY)
        await idle(proc)
        await proc.send("never mind, say hi")  # (a run of its own, which fails too)
        await idle(proc)
        await proc.retry()
        await idle(proc)
    assert "final_result" not in [t.name for t in script.requests[2].tools]


# -- 3. a rewind stops the jobs of the calls it takes out ----------------------------------------


async def test_a_rewind_stops_only_the_jobs_of_the_calls_it_removes(tmp_path: Path) -> None:
    kept_pid, removed_pid = tmp_path / "kept.pid", tmp_path / "removed.pid"

    def brain(r: ModelRequest) -> object:
        last = r.messages[-1]
        if last.role == "user":
            target = kept_pid if last.text == "first" else removed_pid
            return Reply(tool_calls=[call("Shell", command=f"echo $$ > {target}; exec sleep 30", background=True)])
        return "started"

    async with Kernel.open(
        f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(brain), workspace=tmp_path, approval=approve_everything
    ) as k:
        proc = await k.spawn(owner="a", text="first")
        await proc.wait_idle()
        await proc.send("second")
        await proc.wait_idle()
        kept_job, removed_job = await pid_from(kept_pid), await pid_from(removed_pid)
        stored = await k.store.history(proc.pid)
        assert [m.message.role for m in stored] == ["user", "assistant", "toolResult", "assistant"] * 2
        assert alive(kept_job) and alive(removed_job)
        rewound = await proc.rewind(stored[3].id)  # to the answer of the first exchange
        await until(lambda: not alive(removed_job))
        await asyncio.sleep(0.2)  # (time for an end that would be delivered to arrive)
        msgs = await proc.messages()
        records = await k.store.kv_get(proc.pid, JOBS_KEY)
        jobs = k.engine.jobs.of(proc.pid).all()
        assert alive(kept_job)  # the job of the kept call goes on
        await proc.reset()  # (stops it)
        await until(lambda: not alive(kept_job))
    assert rewound.kept == 4 and rewound.removed == 4
    assert [m.role for m in msgs] == ["user", "assistant", "toolResult", "assistant"]  # no end delivered
    assert isinstance(records, dict) and len(records) == 1  # only the kept job's record is left
    assert [job.command for job in jobs] == [f"echo $$ > {kept_pid}; exec sleep 30"]
