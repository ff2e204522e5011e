"""The driver of a durable run: one task per process repeats a step - look at the committed state,
take ``decide``'s decision (the in-memory runner's), do it, commit its outcome - until there is
nothing to do until something arrives. Here are the steps that are not about single tool calls
(``calls.py``): the model turn (queued input injected, guards, the model call, its answer
committed with the next step's start), compaction before a model call, ending a run (done, or
failed inside the runtime)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from agentloop.events import LoopEvent, MessageUpdate, ModelRetry, StreamEvent, ToolCallStart
from agentloop.loop.compaction import ask_pre_compaction, compaction_due, keep_recent, usable_window
from agentloop.loop.execute import SKIPPED
from agentloop.loop.guards import STOPPED
from agentloop.loop.hooks import Block, ToolMap
from agentloop.loop.model_call import call_model, tools_added, with_bundles
from agentloop.loop.output import NUDGE_KIND, OUTPUT_MISSING, OUTPUT_TOOL, SchemaOutput, SchemaOutputTool
from agentloop.loop.retries import REPEATED_CALL, REPEATED_FAILURE, repeated
from agentloop.loop.state import CallModel, Finish, LoopConfig, RunState, RunTools, decide
from agentloop.loop.windows import MAX_WINDOWS, NO_PROGRESS, Boundary, Window, next_window
from agentloop.messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolResultMessage,
    Usage,
    system,
    tool_error_result,
)
from agentloop.models.overflow import is_context_overflow
from agentloop.process import signals as sig
from agentloop.process.admission import keep_for_retry, output_key, promote
from agentloop.process.api import Compacted, RunActive, call_of, new_id
from agentloop.process.calls import (
    NOT_RUN_STOPPED,
    arm_deadline,
    call_rows,
    dispatch,
    end_batch,
    expire,
    ingest,
    post_turn,
    results_of,
    settle,
)
from agentloop.process.compaction import (
    CLEARING_MARGIN,
    Clearing,
    CompactionError,
    CompactionReason,
    CompactionResult,
    clear_tool_outputs,
    compact,
    context_tokens,
    estimate_tokens,
    estimated_context,
    explicit_cut,
    reported_tokens,
    should_compact,
)
from agentloop.process.heartbeat import quiet_answer
from agentloop.process.hil import expire_asks, forget_decisions
from agentloop.process.lease import LeaseLost
from agentloop.process.pressure import (
    ContextReading,
    know_context,
    load_policy,
    note_context,
    overflow_advice,
    refused_overflow,
    step_reading,
    threshold_of,
)
from agentloop.process.signals import Signal
from agentloop.process.store import SegmentRow, ToolCallRow
from agentloop.process.tx import _Live, _Tx

if TYPE_CHECKING:
    from agentloop.models.base import ToolSpec
    from agentloop.process.engine import ProcessEngine

log = logging.getLogger("agentloop.process")

RUN_FAILED = "Tool call not completed: the run ended with an internal error."
GUARD_NAMES = frozenset(
    {
        "max_rounds",
        "max_tool_calls",
        "max_wall_clock",
        "max_tokens",
        "max_cost",
        REPEATED_FAILURE,
        REPEATED_CALL,
        STOPPED,
        MAX_WINDOWS,
        NO_PROGRESS,
    }
)


async def drive(engine: ProcessEngine, live: _Live) -> None:
    while live.dirty:
        live.dirty = False
        try:
            while live.record.current_run is not None and await _step(engine, live):
                pass
        except asyncio.CancelledError:
            raise
        except LeaseLost:  # another worker carries on from what was committed
            log.warning("process %s: lease taken over; this worker's step was not committed", live.record.pid)
            return
        except Exception:  # a bug must not leave the run hanging: end it visibly
            log.exception("process %s: step failed", live.record.pid)
            if live.lost:
                return  # the cache was dropped (a failed commit): the reloaded process carries on
            # inside the loop: the promotion's wake-up only marks this driver dirty
            await fail_run(engine, live)
    if live.driver is asyncio.current_task():  # an idle process keeps no finished task around
        live.driver = None
    if engine.leases is not None and live.record.current_run is None:
        engine.leases.idle(live.record.pid)


async def fail_run(engine: ProcessEngine, live: _Live) -> None:
    """End the active run after an internal error: stop its tools, give every open call an
    error result (so the history stays valid), then let queued input run."""
    run = live.record.current_run
    if run is None:
        return
    pid, run_id = live.record.pid, run["run_id"]
    me = asyncio.current_task()
    tools = [t for t in live.tools.values() if not t.done() and t is not me]
    for task in tools:
        task.cancel()
    if tools:
        await asyncio.wait(tools)
    run = live.record.current_run
    if run is None or run["run_id"] != run_id:
        return  # ended meanwhile (an abort)
    rows = await engine.store.calls(pid, run_id)
    async with engine._tx(live) as tx:
        await tx.append(run_id, results_of(rows, RUN_FAILED))
        for h in await engine.store.hils(pid):
            await engine.store.delete_hil(h.request_id)
        await end_batch(engine, tx, live, run_id)
        await _finish(engine, tx, live, run, "error", error="internal error in the runtime (see the server log)")
    await promote(engine, live)


async def _step(engine: ProcessEngine, live: _Live) -> bool:
    """One decision and its committed outcome. False: nothing to do until something arrives."""
    run = live.record.current_run
    assert run is not None
    pid, run_id = live.record.pid, run["run_id"]
    rows = await engine.store.calls(pid, run_id) if live.calls else []
    if rows:
        waiting = any(r.status == "registered" for r in rows)
        if waiting and run.get("stopping") and await _unask_on_stop(engine, live, rows):
            rows = await engine.store.calls(pid, run_id)
        if waiting and await _joining(engine, live) and await _skip_waiting(engine, live, rows):
            rows = await engine.store.calls(pid, run_id)
        if (waiting or live.asking) and engine.approval_timeout is not None and await expire_asks(engine, live):
            return True  # (a request nobody answered was denied: the batch goes on at the next step)
        if any(r.status == "registered" for r in rows) and not await engine.store.hils(pid):
            async with engine._tx(live) as tx:
                await dispatch(engine, tx, live, run, rows)
            rows = await engine.store.calls(pid, run_id)
        if rows and await expire(engine, live, rows):
            rows = await engine.store.calls(pid, run_id)
        if not rows or any(not r.terminal for r in rows):
            return False
        async with engine._tx(live) as tx:
            # the record, not the step's first look: a running program's calls add to tool_calls
            await ingest(engine, tx, live, live.record.current_run or run, rows)
        await post_turn(engine, live, run_id, run["turn"])
        return True

    decision = decide(live.history, has_input=await _joining(engine, live), guard=run.get("guard"))
    if isinstance(decision, Finish):
        reason = decision.reason
        output = await _run_output(engine, live, run_id) if reason == "stop" else None
        if output is not None and output.output_of(live.history) is None:  # (resumed, or input withdrawn)
            nudged = _nudged(run, output, live.history[-1] if live.history else None)
            if nudged is not None:
                async with engine._tx(live) as tx:
                    await _nudge(tx, output, {**nudged, "generation": run["generation"] + 1})
                    await tx.signal(sig.CHANGED, changes=["messages"])
                return True
            reason = OUTPUT_MISSING
        async with engine._tx(live) as tx:
            await _finish(engine, tx, live, run, reason)
        await promote(engine, live)
        return False
    if isinstance(decision, RunTools):  # calls without rows: history from elsewhere; register them
        tools = (await engine._run_config(live, run_id)).tools
        async with engine._tx(live):
            live.calls = True
            await engine.store.register_calls(call_rows(pid, run_id, decision.calls, tools))
        return True
    assert isinstance(decision, CallModel)
    retry_at = run.get("retry_at")
    if retry_at is not None and time.time() < retry_at and not await _joining(engine, live):
        _arm_retry(engine, live, retry_at)  # (the model was out: its turn comes then, or with new input)
        return False
    return await _model_turn(engine, live, run, decision.tools_enabled)


async def _run_output(engine: ProcessEngine, live: _Live, run_id: str) -> SchemaOutput | None:
    """The output the run must give, if it was asked for one (its configuration is the run's
    cached one: read again only after a reload, never a query of its own)."""
    tool = (await engine._run_config(live, run_id)).tools.get(OUTPUT_TOOL)
    return tool.output if isinstance(tool, SchemaOutputTool) else None


def run_output(live: _Live, run_id: str) -> SchemaOutput | None:
    """``_run_output`` from the cache alone (None where the run's configuration is not cached)."""
    if live.config is None or live.config[0] != run_id:
        return None
    tool = live.config[1].tools.get(OUTPUT_TOOL)
    return tool.output if isinstance(tool, SchemaOutputTool) else None


def _nudged(run: dict[str, Any], output: SchemaOutput, last: Message | None) -> dict[str, Any] | None:
    """The run would end with words (``last``) where it must give an output: its record with one
    more nudge counted (``nudged``), for the step's commit to write with ``_nudge``, when it may
    have one (at most ``output.retries`` a run); None once they are spent, and for an end that is
    not a text answer (a tool asked to end the run, a guard or a stop ended it)."""
    if not isinstance(last, AssistantMessage) or last.tool_calls or last.stop_reason != "stop":
        return None
    nudged = int(run.get("nudged", 0))
    if nudged >= output.retries or run.get("stopping") or run.get("guard"):
        return None
    return {**run, "nudged": nudged + 1}


async def _nudge(tx: _Tx, output: SchemaOutput, run: dict[str, Any]) -> None:
    """Inside the step's transaction: tell the model to call the output tool (a system message of
    kind ``output``, as ``OutputSpec`` does in memory), with ``run`` (``_nudged``'s) as the record."""
    await tx.append(run["run_id"], [system(output.instruction, NUDGE_KIND)])
    await tx.set_run(run)


async def forget_output(engine: ProcessEngine, live: _Live, run_id: str, *, answered: bool = False) -> None:
    """Inside the transaction that ends run ``run_id``: its output row goes with it. Where the run's
    configuration was never built (an internal error right after a reload) whether it has one is
    not known: the row is deleted anyway (a rare path; the common one costs no statement). A run
    that did not answer (failed, aborted - the default, as an abort ends a run unanswered - or cut
    at the output limit) leaves its output for a retry to ask for again (``keep_for_retry``)."""
    if run_output(live, run_id) is not None or live.config is None or live.config[0] != run_id:
        if not answered:
            await keep_for_retry(engine, live.record.pid, run_id)
        await engine.store.kv_delete(live.record.pid, output_key(run_id))


async def _joining(engine: ProcessEngine, live: _Live) -> bool:
    """Whether input waits that joins the active run (steer items, system events): a run that
    would end takes it in another model call instead, so the receipt's run is the one that
    answers. (A run that ends anyway - aborted, failed, stopped by a guard - leaves it to start
    the next run.)"""
    return bool(live.queued) and any(q.kind != "queue" for q in await engine.store.queue(live.record.pid))


async def _skip_waiting(engine: ProcessEngine, live: _Live, rows: list[ToolCallRow]) -> bool:
    """The user (or a system event) spoke while calls of the batch still wait their turn: like
    the in-memory runner, do not start what is now stale. A call whose approval is pending
    stays: the person answers the question they were shown, and so does one already approved
    (its question is gone once answered; skipped, the approval would come to nothing)."""
    pid = live.record.pid
    asked = {h.dispatch_id for h in await engine.store.hils(pid)}
    run = live.record.current_run
    if live.approvals and run is not None:
        asked.update(await engine.store.kv_get(pid, f"approved:{run['run_id']}") or {})
    waiting = [r for r in rows if r.status == "registered" and r.dispatch_id not in asked]
    if not waiting:
        return False
    async with engine._tx(live) as tx:
        for row in waiting:
            await settle(engine, tx, row, tool_error_result(call_of(row), SKIPPED), "cancelled", ("registered",))
    return True


async def _unask_on_stop(engine: ProcessEngine, live: _Live, rows: list[ToolCallRow]) -> bool:
    """The user asked the run to stop while calls of the batch wait for a person's approval: those
    are not under way, and the stop must not wait for an answer that may never come (the run
    would hang on it). Their questions are withdrawn and they are not run; the batch goes on
    without them, then the model answers once more without tools. A question answered meanwhile
    stands (its request is gone: its call runs, or is denied, as the person said)."""
    pid = live.record.pid
    asked = {h.dispatch_id: h.request_id for h in await engine.store.hils(pid)}
    waiting = [r for r in rows if r.status == "registered" and r.dispatch_id in asked]
    if not waiting:
        return False
    async with engine._tx(live) as tx:
        withdrawn = False
        for row in waiting:
            if await engine.store.delete_hil(asked[row.dispatch_id]):
                withdrawn = True
                result = tool_error_result(call_of(row), NOT_RUN_STOPPED)
                await settle(engine, tx, row, result, "cancelled", ("registered",))
        if withdrawn:
            await tx.signal(sig.CHANGED, changes=["hil"])
    return withdrawn


async def _model_turn(engine: ProcessEngine, live: _Live, run: dict[str, Any], tools_enabled: bool) -> bool:
    pid, run_id = live.record.pid, run["run_id"]
    cfg = await engine._run_config(live, run_id)  # the run's own prompt and tools
    queue = await engine.store.queue(pid) if live.queued else []
    inject = [q for q in queue if q.kind == "system"] + [q for q in queue if q.kind == "steer"]
    guard = run.get("guard")
    tools_enabled = tools_enabled and bool(cfg.tools)
    boundary: Boundary | None = None  # an execution window used up: the next one opens
    tripped = (
        (repeated(bool(run.get("failing")), bool(run.get("repeating"))) or (STOPPED if run.get("stopping") else None))
        if tools_enabled
        else None
    )
    if tools_enabled and tripped is None and cfg.guards.active:
        usage = Usage(total_tokens=run["usage"]["total_tokens"])
        usage.cost.total = run["usage"]["cost"]
        tripped = cfg.guards.tripped(run["rounds"], run["tool_calls"], time.time() - run["started"], usage)
        if tripped is None:
            run, tripped, boundary = _next_window(cfg, run, live.history)
    if inject or tripped or boundary is not None:
        async with engine._tx(live) as tx:
            # claimed one by one: an item withdrawn since the look above is not there to take
            inject = [q for q in inject if await engine.store.dequeue(pid, q.id)]
            if inject or tripped or boundary is not None:
                added = [q.message for q in inject]
                if tripped:
                    guard, tools_enabled = tripped, False
                    added.append(system(cfg.guards.final_instruction(tripped), "guard"))
                run = {**run, "guard": guard, "generation": run["generation"] + 1}
                taken = len(inject)
                tx.after.append(lambda: setattr(live, "queued", live.queued - taken))
                if added:
                    await tx.append(run_id, added)
                await tx.set_run(run)
                if added:
                    await tx.signal(sig.CHANGED, changes=["messages", "queue"] if inject else ["messages"])
                if boundary is not None:
                    await tx.signal(
                        sig.RUN_WINDOW,
                        runId=run_id,
                        window=boundary.window,
                        rounds=boundary.rounds,
                        toolCalls=boundary.tool_calls,
                    )
    # after an answer, a model turn is for input that joins the run: if it was withdrawn meanwhile
    # (before it was read above, or before it was claimed), the next step ends the run instead
    answered = not inject and not tripped and bool(live.history) and isinstance(live.history[-1], AssistantMessage)
    if answered and isinstance(decide(live.history, has_input=False, guard=guard), Finish):
        return True
    generation = run["generation"]

    run, measured = await _compact_if_needed(engine, live, run, cfg, tools_enabled)
    state = _call_state(engine, live, run)

    relay = engine.leases.relay if engine.leases is not None else None  # watchers on other workers

    def stream(event: LoopEvent) -> None:
        if not isinstance(event, MessageUpdate):
            return
        payload = _stream_payload(pid, run_id, event.event)
        if engine.hub.watching(pid):
            engine.hub.publish(pid, Signal(sig.RUN_STREAM, payload, base=live.seq))
        if relay is not None:
            relay.send(pid, live.seq, payload)

    async def retrying(event: ModelRetry) -> None:
        """Log the retry (or the switch to a fallback) before its wait: a run that takes long
        says why, to those watching and to whoever reads the log later. Only a report: a store
        that cannot take it now must not end a run that is riding out a failure."""
        try:
            await _log_retry(engine, live, run_id, generation, event)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("process %s: the retry of run %s was not logged: %s", pid, run_id, exc)

    try:
        # (on a shared store always: a watcher elsewhere may start following during the call)
        streaming = relay is not None or engine.hub.watching(pid)
        bundled: dict[str, Any] = {}  # tools a pre_tool_materialization hook added (a bundle)
        reply = await call_model(cfg, state, tools_enabled, stream if streaming else None, retrying, bundled)
        discarded = state.usage  # the unusable answers call_model asked again for: billed all the same
        overflow = is_context_overflow(reply, cfg.model.info.context_window)  # an error, or silent truncation
        refused = overflow and live.policy.overflow == "fail"  # the process's policy: the run fails instead
        compacted = await _compact(engine, live, run, cfg, "overflow") if overflow and not refused else None
        if refused:
            reply = refused_overflow(reply, cfg.model.info.context_window)
        if compacted is not None:  # one compact-and-retry
            run, measured = compacted, None
            state = _call_state(engine, live, run)
            reply = await call_model(cfg, state, tools_enabled, stream if streaming else None, retrying, bundled)
            discarded += state.usage
        if bundled:  # callable for the rest of the run: its configuration, which dispatch reads, has them
            cfg = with_bundles(cfg, bundled)
            live.config = (run_id, cfg)
    finally:
        live.partial = None
    if relay is not None:
        await relay.flush(pid)  # the answer's deltas go out ahead of the commit that logs it
    delay = _outage_delay(engine, run, reply, state)
    if delay is not None:
        return await _defer(engine, live, run, cfg, reply, discarded, delay)
    calls = reply.tool_calls  # (a list made anew at each look: taken once)
    if not tools_enabled and calls:
        reply.content = [b for b in reply.content if not isinstance(b, ToolCall)]
        reply.stop_reason = "stop"
        calls = []
    limit = cfg.guards.max_tool_calls
    budget = None if limit is None else max(0, limit - run["tool_calls"])  # calls past it are not run
    ran = len(calls) if budget is None else min(len(calls), budget)
    new_run = {
        **run,
        "generation": generation + 1,
        "rounds": run["rounds"] + (1 if tools_enabled else 0),
        "tool_calls": run["tool_calls"] + ran,
        "usage": _spent(run["usage"], reply.usage + discarded),
    }
    new_run.pop("offered", None)  # (a turn before's)
    new_run.pop("added", None)
    new_run.pop("retry_at", None)  # (the model answered: an outage's count starts again)
    new_run.pop("deferred", None)
    reading = _reading(engine, live, cfg, tools_enabled, reply, measured)  # None: the level is as known
    if calls and state.offered is not None:
        new_run["offered"] = sorted(state.offered)  # kept with the run: so is a call resumed after a restart
    hook_added = _hook_added(cfg, calls, state.offered)
    if hook_added:  # the configuration holds them in memory only: a restart asks the hooks again
        new_run["added"] = hook_added
    finished = False
    batch: list[ToolCallRow] = []
    async with engine._tx(live) as tx:
        # This engine is the process's only writer, so its record is the committed state; the
        # check runs inside the transaction, after any abort or interrupt that committed first.
        if not _still_current(live, run_id, generation):
            return False  # aborted or superseded while the model was answering: drop the answer
        await engine.log_prompt(tx, live, run_id)  # (the run's first answer: what its prompt was made of)
        await tx.append(run_id, [reply])
        if reading is not None:
            await note_context(tx, live, reading)
        text = reply.text
        if text or any(b.type == "thinking" for b in reply.content):
            thinking = "".join(getattr(b, "thinking", "") for b in reply.content)
            output: dict[str, Any] = {"runId": run_id, "text": text, "thinking": thinking}
            if not calls and quiet_answer(run_id, text):
                output["quiet"] = True  # a heartbeat's "nothing to do": clients need not show it
            await tx.signal(sig.RUN_OUTPUT, **output)
        await tx.signal(sig.CHANGED, changes=["messages"])
        # the same transaction takes the next decision's first step: start the tools, or finish
        # (the run's record is written once, as the step leaves it: the body reads the cache's)
        if calls:
            await tx.set_run(new_run)
            live.calls = True
            batch = call_rows(pid, run_id, calls, cfg.tools)
            live.offered = (run_id, state.offered)  # (before the commit: dispatch checks it)
            await dispatch(engine, tx, live, new_run, batch, reply, fresh=True, budget=budget, offered=state.offered)
        else:  # after an assistant message, the decision depends on that message (and input) alone
            after = decide([reply], has_input=await _joining(engine, live), guard=new_run.get("guard"))
            reason = after.reason if isinstance(after, Finish) else None
            wanted = run_output(live, run_id) if reason == "stop" else None
            nudged = None
            if wanted is not None and wanted.output_of(live.history) is None:  # words, not the output
                nudged = _nudged(new_run, wanted, reply)
                if nudged is None:
                    reason = OUTPUT_MISSING
                else:  # asked for the output tool's call: another turn
                    reason = None
                    await _nudge(tx, wanted, {**nudged, "turn": new_run["turn"] + 1})
            if reason is not None:
                await _finish(engine, tx, live, new_run, reason, last=reply)
                finished = True
            elif nudged is None:  # input joined the run: the next model call opens another turn
                await tx.set_run({**new_run, "turn": new_run["turn"] + 1})
        if not finished:
            await engine.keep_prompt(tx, live)
    if not batch:
        await post_turn(engine, live, run_id, run["turn"])
    if finished:
        await promote(engine, live)
        return False
    if batch and not all(r.terminal for r in batch):
        # calls are out (or waiting for approval): their results wake the driver; the rows
        # just written are known, so they need no reading back to arm the deadline timer
        arm_deadline(engine, live, batch, time.time())
        return False
    return True


def _next_window(
    cfg: LoopConfig, run: dict[str, Any], history: list[Message]
) -> tuple[dict[str, Any], str | None, Boundary | None]:
    """The run's execution window (``loop/windows.py``, the in-memory runner's decision) counted
    before a model call with tools: its record with the window as it is now (written with the
    step's commit, so a restart goes on in the same window), the guard that ends the run, and
    the window opened, if one was."""
    window = Window.from_record(run.get("window"))
    after, tripped, boundary = next_window(cfg.guards, window, run["rounds"], run["tool_calls"], history)
    if after != window:
        run = {**run, "window": after.record()}
    return run, tripped, boundary


MAX_OUTAGE_RETRIES = 20  # tries a run may wait for at most (``Kernel.open``'s ``outage_retries``)
MAX_OUTAGE_DELAY = 86_400.0  # seconds one wait may last at most


def check_outage_retries(delays: object) -> tuple[float, ...]:
    """``outage_retries`` as the engine keeps it; ``TypeError``/``ValueError`` for what is not a
    list of at most ``MAX_OUTAGE_RETRIES`` positive numbers of seconds up to ``MAX_OUTAGE_DELAY``."""
    if isinstance(delays, str | bytes) or not isinstance(delays, list | tuple):
        raise TypeError(f"outage_retries must be a list of seconds, got {type(delays).__name__}")
    if len(delays) > MAX_OUTAGE_RETRIES:
        raise ValueError(f"outage_retries may plan {MAX_OUTAGE_RETRIES} tries at most, got {len(delays)}")
    for delay in delays:
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 < delay <= MAX_OUTAGE_DELAY:
            raise ValueError(f"outage_retries must be seconds between 0 and {MAX_OUTAGE_DELAY:g}, got {delay!r}")
    return tuple(float(d) for d in delays)


def _outage_delay(engine: ProcessEngine, run: dict[str, Any], reply: AssistantMessage, state: RunState) -> float | None:
    """Seconds until the run calls its model again, when the call failed in a way that may pass
    (``state.transient``: a rate limit, a 5xx, no connection, after the call's own retries and
    fallbacks) and the run may wait for it yet (``engine.outage_retries``, counted in the run's
    record as ``deferred``); None: the failure ends the run, as it always did."""
    delays = engine.outage_retries
    deferred = int(run.get("deferred", 0))
    if reply.stop_reason != "error" or not state.transient or deferred >= len(delays) or run.get("stopping"):
        return None
    return float(delays[deferred])


async def _defer(
    engine: ProcessEngine,
    live: _Live,
    run: dict[str, Any],
    cfg: LoopConfig,
    reply: AssistantMessage,
    spent: Usage,
    delay: float,
) -> bool:
    """The model is out: instead of ending the run, commit when it is to be called again (the run's
    ``retry_at``, which a restart keeps) with ``proc.run.retrying`` (``deferred``), and sleep until
    then. The failed answer is not kept: the history stays as the model last saw it, so the next
    try asks the same. Input that joins the run calls the model at once; an abort ends the run as
    at any time."""
    run_id, generation = run["run_id"], run["generation"]
    retry_at = time.time() + delay
    deferred = int(run.get("deferred", 0)) + 1
    async with engine._tx(live) as tx:
        if not _still_current(live, run_id, generation):
            return False
        waiting = {**run, "generation": generation + 1, "retry_at": retry_at, "deferred": deferred}
        waiting["usage"] = _spent(run["usage"], reply.usage + spent)  # (failed calls may be billed)
        await tx.set_run(waiting)
        await tx.signal(
            sig.RUN_RETRYING,
            runId=run_id,
            attempt=deferred,
            delay=delay,
            reason=reply.error_message or "the model call failed",
            model=cfg.model.name,
            fallback=False,
            deferred=True,
            at=retry_at,
        )
    log.warning(
        "process %s: the model is unavailable (%s); run %s tries again in %g s (%d of %d)",
        live.record.pid,
        reply.error_message,
        run_id,
        delay,
        deferred,
        len(engine.outage_retries),
    )
    _arm_retry(engine, live, retry_at)
    return False


def _arm_retry(engine: ProcessEngine, live: _Live, at: float) -> None:
    """Wake the process's driver just after ``at`` (epoch seconds), for its deferred model call."""
    loop = asyncio.get_running_loop()
    if live.retry_timer is not None:
        live.retry_timer.cancel()
    live.retry_timer = loop.call_at(loop.time() + max(0.0, at - time.time()) + 0.01, engine.wake, live.record.pid)


def _still_current(live: _Live, run_id: str, generation: int) -> bool:
    """Whether the model call made at ``generation`` of run ``run_id`` is still the run's: no abort,
    interrupt or newer step committed since."""
    current = live.record.current_run
    return current is not None and current.get("run_id") == run_id and current.get("generation") == generation


async def _log_retry(engine: ProcessEngine, live: _Live, run_id: str, generation: int, event: ModelRetry) -> None:
    """``proc.run.retrying`` in its own transaction, if the model call is still the run's."""
    async with engine._tx(live) as tx:
        if not _still_current(live, run_id, generation):
            return
        await tx.signal(
            sig.RUN_RETRYING,
            runId=run_id,
            attempt=event.attempt,
            delay=event.delay,
            reason=event.error,
            model=event.model,
            fallback=event.fallback,
        )


def _stream_payload(pid: str, run_id: str, event: StreamEvent) -> dict[str, Any]:
    """A live stream event as ``proc.run.stream`` shows it: its type, the content block it belongs
    to, the text it adds, and for a tool call that starts, which call and tool (before its
    arguments have arrived, a UI can already show what is being prepared)."""
    payload: dict[str, Any] = {
        "pid": pid,
        "runId": run_id,
        "event": event.type,
        "index": getattr(event, "index", None),
        "delta": getattr(event, "delta", None),
    }
    if isinstance(event, ToolCallStart):
        payload["callId"], payload["name"] = event.id, event.name
    return payload


def _hook_added(cfg: LoopConfig, calls: list[ToolCall], offered: frozenset[str] | None) -> list[str]:
    """The tools ``calls`` name that the run's hooks added to the call that made them (``cfg``:
    the run's configuration with them; ``offered``: what the call showed, when not all of it)."""
    tools = cfg.tools
    if not calls or not isinstance(tools, ToolMap) or not tools.bundled:
        return []
    names = {c.name for c in calls} & tools.bundled
    return sorted(names if offered is None else names & offered)


async def restore_added(engine: ProcessEngine, live: _Live, run_id: str, cfg: LoopConfig) -> LoopConfig:
    """``cfg`` (run ``run_id``'s configuration, just built) with the tools its hooks added to the
    call whose tool calls are still to run, when they are not in it: the run's record names them
    (``added``), and the configuration that held them lived in memory only (a restart, a takeover).
    The hooks are asked again, for the history as that call saw it (up to its answer) and its
    turn, as ``call_model`` asks them: the tools they add now are the run's again. A tool they no
    longer add, or hooks that fail, leave its calls to end as a tool no longer available
    (``calls.NOT_ADDED_AGAIN``); nothing is taken from the record but names: the process's tool
    scope is as narrow as it was, widened only by what the hooks add, as in any call."""
    run = live.record.current_run
    if run is None or run["run_id"] != run_id:
        return cfg
    wanted = run.get("added") or []
    if all(name in cfg.tools for name in wanted):
        return cfg
    history = live.history
    answer = next((i for i in range(len(history) - 1, -1, -1) if isinstance(history[i], AssistantMessage)), 0)
    seen = history[:answer]
    messages = engine.hydrate(seen) if engine.hydrate is not None and live.media else seen
    state = RunState(
        run_id=run_id, messages=messages, first_new=len(messages), turn=run["turn"], conversation=live.record.pid
    )
    try:
        added = await tools_added(cfg, state)
    except Exception as exc:  # (the turn would fail; here only the calls to those tools do)
        log.warning("process %s: the hooks could not add the tools of run %s again: %s", live.record.pid, run_id, exc)
        return cfg
    lost = sorted(set(wanted) - added.keys() - cfg.tools.keys())
    if lost:
        log.info("process %s: after a restart the hooks no longer add %s", live.record.pid, ", ".join(lost))
    return with_bundles(cfg, added) if added else cfg


def _call_state(engine: ProcessEngine, live: _Live, run: dict[str, Any]) -> RunState:
    """What one model call of the run sees (stored images made inline again), kept as the call in
    flight; the process id is the conversation a provider's prompt cache knows it by."""
    history = live.history
    messages = engine.hydrate(history) if engine.hydrate is not None and live.media else history
    state = RunState(
        run_id=run["run_id"],
        messages=messages,
        first_new=len(messages),
        turn=run["turn"],
        conversation=live.record.pid,
        origins=live.origins,  # (known: the call need not look for a group chat's speakers)
    )
    live.partial = state
    return state


def _spent(usage: dict[str, Any], more: Usage) -> dict[str, Any]:
    """A run's usage (as its record keeps it) after one more model call."""
    return {
        "input": usage["input"] + more.input,
        "output": usage["output"] + more.output,
        "total_tokens": usage["total_tokens"] + more.total_tokens,
        "cost": usage["cost"] + more.cost.total,
    }


async def _compact_if_needed(
    engine: ProcessEngine, live: _Live, run: dict[str, Any], cfg: LoopConfig, tools: bool
) -> tuple[dict[str, Any], int | None]:
    """Threshold compaction, between the turns of a run as well as between runs; the run as it
    stands afterwards, and the context's tokens as measured for it (None: not measured, or the
    history changed since), which the step's pressure reading builds on."""
    if engine.archive is None or len(live.history) < 4:
        return run, None
    specs, policy = _shown_tools(cfg, run) if tools else [], live.policy
    tokens = context_tokens(cfg.system_prompt, specs, live.history)
    threshold, who = threshold_of(engine, policy), f"process {live.record.pid}"
    # (the in-memory piece's rule: where the prompt and tools alone are past the threshold, only a
    # call that would not fit the usable window is compacted, not every call past the threshold)
    if compaction_due(
        cfg.system_prompt,
        specs,
        live.history,
        cfg.model.info,
        threshold,
        policy.keep_recent_tokens,
        tokens=tokens,
        who=who,
    ):
        compacted = await _compact(engine, live, run, cfg, "threshold")
        return (run, tokens) if compacted is None else (compacted, None)
    return run, tokens


def _shown_tools(cfg: LoopConfig, run: dict[str, Any] | None) -> list[ToolSpec]:
    """The tools a compaction measures, as the in-memory runner does: those the run's last model
    call was shown where a hook (``ToolReveal``) narrowed the list (kept with the run as
    ``offered``), not a catalogue kept hidden to save that very room; else all of them."""
    offered = run.get("offered") if run is not None else None
    if offered is None:
        return cfg.tool_specs
    shown = set(offered)
    return [spec for spec in cfg.tool_specs if spec.name in shown]


def _reading(
    engine: ProcessEngine, live: _Live, cfg: LoopConfig, tools: bool, reply: AssistantMessage, before: int | None
) -> ContextReading | None:
    """How full the context is with ``reply`` in it (``step_reading``): the provider's count, else
    the tokens measured before the call plus the reply's estimate (measured now only where they
    were not: compaction off, or the history changed since)."""
    tokens = reported_tokens(reply)
    if not tokens:
        if before is None:
            before = context_tokens(cfg.system_prompt, cfg.tool_specs if tools else [], live.history)
        tokens = before + estimate_tokens(reply)
    return step_reading(engine, live, cfg.model.info, tokens)


async def _compact(
    engine: ProcessEngine, live: _Live, run: dict[str, Any], cfg: LoopConfig, reason: Any
) -> dict[str, Any] | None:
    """Compact during a run (``summarise``). Returns the run with the summary call's usage added
    (its guards count it like any model call), or None when nothing was compacted. A failure
    leaves the history as it was."""
    done, after = await summarise(engine, live, cfg, reason, run)
    return after if done.compacted else None


async def summarise(
    engine: ProcessEngine,
    live: _Live,
    cfg: LoopConfig,
    reason: CompactionReason,
    run: dict[str, Any] | None,
    instructions: str | None = None,
    *,
    keep_last: int | None = None,
    through: int | None = None,
    summary: str | None = None,
) -> tuple[Compacted, dict[str, Any] | None]:
    """Summarise the older part of the history, archive it, then replace it by the summary (in
    one commit with its segment row and ``proc.compacted``). ``run``: the run it is made for, or
    None for one asked for while the process is idle (``ProcessEngine.compact``), which must find
    it still idle, its history as summarised, at the commit. Returns what it did and the run as it
    stands afterwards. A failure leaves the history as it was: logged during a run, raised
    (``CompactionError``, ``RunActive``) to whoever asked for it.

    Asked for by hand, the cut may be the caller's (``explicit_cut``): the newest ``keep_last``
    messages kept, or every message up to and including message id ``through`` summarised (a
    ``ValueError``, before anything is done, for an id the history does not hold); and the
    summary may be the caller's text (``summary``, checked: ``check_summary``), with no model call."""
    if engine.archive is None:
        return _unchanged(live, "not compacted: compaction is off (no archive to keep the history in)"), run
    pid = live.record.pid
    cut = await _chosen_cut(engine, live, keep_last, through)
    run_id, turn = (run["run_id"], run["turn"]) if run is not None else ("", 0)
    carry = await ask_pre_compaction(
        cfg.hooks, run_id, turn, live.history, cfg.system_prompt, cfg.tool_specs, pid, f"process {pid}"
    )
    if isinstance(carry, Block):
        return _unchanged(live, f"not compacted: a pre_compaction hook declined: {carry.reason}"), run
    specs, model = _shown_tools(cfg, run), cfg.model.info
    policy = live.policy if run is not None else await load_policy(engine.store, pid)  # (idle: no run read it)
    threshold = threshold_of(engine, policy)
    keep = keep_recent(cfg.system_prompt, specs, live.history, model, threshold, policy.keep_recent_tokens, reason)
    fixed = estimated_context(cfg.system_prompt, specs, [])  # (the clearing and the new reading build on it)
    # (an overflow was measured by the provider: the summary is the surer cure)
    if reason == "threshold" and engine.clear_tool_outputs and run is not None:
        level = context_tokens(cfg.system_prompt, specs, live.history) / usable_window(model)
        if await _clear(engine, live, run, cfg, keep, fixed, level):
            return Compacted(True, "eased by clearing old tool outputs"), run
    history = list(live.history)
    try:
        result = await compact(
            history,
            cfg.model,
            keep_recent_tokens=keep,
            reason=reason,
            instructions=instructions,
            carry=carry,
            cut=cut,
            summary=summary,
            native=cfg.model if engine.native_compaction else None,
        )
    except CompactionError as exc:
        if run is None:
            raise
        log.warning("process %s: compaction failed, history unchanged: %s", pid, exc)
        return _unchanged(live, str(exc)), run
    if result is None:
        if cut is not None:
            return _unchanged(live, "nothing to compact: the cut asked for leaves nothing to summarise"), run
        return _unchanged(live, "nothing to compact: the conversation is too short"), run
    if not result.still_applies(live.history):
        return _unchanged(live, "not compacted: the history changed meanwhile"), run
    stored = await engine.store.history(pid)
    removed_ids = [m.id for m in stored[: len(result.removed)]]
    name = f"compaction-{new_id()}"
    try:
        where = await engine.archive(live.record, name, result.removed, result.meta())
    except Exception as exc:  # (a full disk): the removed messages would have no copy; keep them
        if run is None:
            raise CompactionError(f"the compacted messages could not be archived: {exc}") from exc
        log.warning("process %s: compaction not archived, history unchanged: %s", pid, exc)
        return _unchanged(live, "not compacted: the archive could not be written"), run
    memory = await _remember(engine, live, result.memories)
    segment_id, removed, made = new_id(), len(result.removed), result.summary
    await know_context(engine.store, live)
    reading = ContextReading.of(fixed + result.tokens_after, model, threshold)
    async with engine._tx(live) as tx:
        if run is None:
            _still_idle(live, result)
        summary_id = await engine.store.replace_messages(pid, removed_ids[0], removed_ids[-1], made)
        await engine.store.add_segment(
            SegmentRow(
                segment_id,
                pid,
                live.record.history_generation,
                "compaction",
                removed_ids[0],
                removed_ids[-1],
                where,
                summary_id,
            )
        )
        await tx.signal(
            sig.COMPACTED,
            runId=run["run_id"] if run is not None else None,
            reason=reason,
            kind="summary",
            removed=removed,
            tokensBefore=result.tokens_before,
            tokensAfter=result.tokens_after,
            archive=where,
            memory=memory,
        )
        await note_context(tx, live, reading)  # (an estimate: the next model step has the provider's count)
        if run is None:  # asked for while idle: no run to carry the summary call's usage
            await tx.count_usage(result.usage)
        elif _still_current(live, run["run_id"], run["generation"]):  # (not if an abort ended it meanwhile)
            run = {**run, "usage": _spent(run["usage"], result.usage)}
            await tx.set_run(run)
        # the tail as it is now: only the prefix the summary replaces was checked to be unchanged
        tx.after.append(lambda: live.history.__setitem__(slice(0, removed), [made]))
    done = Compacted(
        True,
        removed=removed,
        tokens_before=result.tokens_before,
        tokens_after=result.tokens_after,
        archive=name,
        segment_id=segment_id,
    )
    return done, run


async def _chosen_cut(engine: ProcessEngine, live: _Live, keep_last: int | None, through: int | None) -> int | None:
    """Where the caller's cut leaves the kept tail (``explicit_cut``), ``through`` a message id
    of the stored history, which the live one mirrors; None without a cut asked for."""
    if keep_last is None and through is None:
        return None
    if through is None:
        return explicit_cut(live.history, keep_last=keep_last)
    ids = [m.id for m in await engine.store.history(live.record.pid)]
    if len(ids) != len(live.history):  # (idle, they are the same; a caller raced a change)
        raise CompactionError("not compacted: the history changed meanwhile")
    try:
        index = ids.index(through)
    except ValueError:
        raise ValueError(f"through: message {through} is not a message of the current history") from None
    return explicit_cut(live.history, through=index)


def _unchanged(live: _Live, note: str) -> Compacted:
    """A compaction that did nothing, and why; the history's size as it stays."""
    tokens = estimate_tokens(live.history)
    return Compacted(False, note, tokens_before=tokens, tokens_after=tokens)


def _still_idle(live: _Live, result: CompactionResult) -> None:
    """Inside the commit of a compaction asked for while idle: input that slipped in before the
    process was held may have started a run (or a run's own compaction changed the history); the
    summary then is not installed (its archive stays, an extra copy)."""
    if live.record.current_run is not None:
        raise RunActive(live.record.pid, "a compaction")
    if not result.still_applies(live.history):
        raise CompactionError("not compacted: the history changed meanwhile")


async def _clear(
    engine: ProcessEngine, live: _Live, run: dict[str, Any], cfg: LoopConfig, keep: int, fixed: int, level: float
) -> bool:
    """Compaction's first tier: the large outputs of tool calls older than the newest ``keep``
    tokens are archived and replaced by a note, with no model call, when that alone brings the
    pressure well under the threshold (``CLEARING_MARGIN``); whether it did (or the pressure, once
    what an earlier clearing took out is no longer counted, needs nothing). ``fixed``: the
    prompt's and tools' estimate, and ``level`` the pressure, as ``summarise`` measured them. A
    failure leaves the history as it was, for the summary to try."""
    if engine.archive is None:
        return False
    # The usage the pressure was read from may predate a clearing (the model call after it failed
    # or was aborted, reporting none): it still counts the outputs cleared. Without them the
    # context may be well under the threshold, and another clearing (breaking the provider's prompt
    # cache again) or a summary would be for nothing.
    uncounted = Clearing.uncounted(live.history)
    if uncounted:
        estimated = fixed + estimate_tokens(live.history)
        level *= estimated / (estimated + uncounted)
        if not should_compact(level, threshold_of(engine, live.policy)):
            return True
    clearing = clear_tool_outputs(live.history, keep)
    if clearing is None:
        return False
    after = level * (fixed + clearing.tokens_after) / max(1, fixed + clearing.tokens_before)
    if after > threshold_of(engine, live.policy) * CLEARING_MARGIN:
        return False  # not enough: the summary does it all at once
    pid = live.record.pid
    stored = await engine.store.history(pid)
    ids = [stored[i].id for i in clearing.positions]
    originals: list[Message] = list(clearing.originals)
    try:
        where = await engine.archive(live.record, f"clearing-{new_id()}", originals, clearing.meta())
    except Exception as exc:  # (a full disk): the outputs would have no copy; keep them
        log.warning("process %s: tool outputs not archived, history unchanged: %s", pid, exc)
        return False
    if not clearing.still_applies(live.history):
        return False
    async with engine._tx(live) as tx:
        await engine.store.update_messages(pid, list(zip(ids, clearing.cleared, strict=True)))
        await engine.store.add_segment(
            SegmentRow(new_id(), pid, live.record.history_generation, "clearing", ids[0], ids[-1], where)
        )
        await tx.signal(
            sig.COMPACTED,
            runId=run["run_id"],
            reason="threshold",
            kind="clearing",
            removed=0,
            cleared=len(ids),
            tokensBefore=clearing.tokens_before,
            tokensAfter=clearing.tokens_after,
            archive=where,
        )
        history = clearing.history(live.history)
        tx.after.append(lambda: live.history.__setitem__(slice(None), history))
    return True


async def _remember(engine: ProcessEngine, live: _Live, memories: str | None) -> str | None:
    """Keep a compaction's memories (before the history is replaced, like its archive: a crash in
    between repeats them, never loses them); where they went, or None. A failure to write them is
    logged and costs the compaction nothing."""
    if not memories or engine.memory is None:
        return None
    try:
        return await engine.memory(live.record, memories, "context compaction")
    except Exception as exc:
        log.warning("process %s: the compaction's memories were not kept: %s", live.record.pid, exc)
        return None


async def _finish(
    engine: ProcessEngine,
    tx: _Tx,
    live: _Live,
    run: dict[str, Any],
    reason: str,
    *,
    error: str | None = None,
    last: Message | None = None,
) -> None:
    """End the run inside ``tx``; the caller promotes queued input once it has committed."""
    pid, run_id = live.record.pid, run["run_id"]
    status = "aborted" if reason == "aborted" else "error" if reason == "error" else "ok"
    last = last or (live.history[-1] if live.history else None)
    if status == "error" and error is None:
        error = (last.error_message if isinstance(last, AssistantMessage) else None) or "unknown error"
        if isinstance(last, AssistantMessage) and is_context_overflow(last):  # (compaction was tried, or refused)
            error += " " + overflow_advice(live.policy, OVERFLOW_ADVICE)
    if status == "error":
        await tx.append(run_id, [system(f"The run failed: {error}", "error")])
    if live.approvals:
        await forget_decisions(engine.store, pid, run_id)
    await forget_output(engine, live, run_id, answered=status == "ok" and reason != "length")
    await tx.end_run(run)
    if status == "ok" and isinstance(last, ToolResultMessage) and last.terminate:  # (ended by its tools)
        last = next((m for m in reversed(live.history) if isinstance(m, AssistantMessage)), last)
    answer = (last.text or None) if status == "ok" and isinstance(last, AssistantMessage) else None
    await signal_run_finished(tx, live, run, status, _reason_code(reason), error=error, text=answer)
    if status == "ok" and not run["tool_calls"] and not run["turn"] and quiet_answer(run_id, answer):
        await _forget_check_in(engine, tx, live, run_id, last)
    if live.seq >= live.prune_at:
        await _prune_log(engine, tx, live)


async def _prune_log(engine: ProcessEngine, tx: _Tx, live: _Live) -> None:
    """The log keeps its newest signals (``signals.KEPT_SIGNALS``). At most ten batches go per
    finishing run: a log grown long (before a watch let go of it, say) is worked down over the
    next runs, not deleted in one transaction that holds the store for seconds."""
    pid = live.record.pid
    if live.pruned is None:  # (once per load: where the log starts)
        oldest = await engine.store.events(pid, limit=1)
        live.pruned = oldest[0].seq - 1 if oldest else live.seq
    goal = live.seq - sig.KEPT_SIGNALS
    through = min(goal, live.pruned + 10 * sig.PRUNE_EVERY)
    if through > live.pruned:
        await engine.store.prune_events(pid, through=through)
    behind = through < goal

    def moved() -> None:
        live.pruned = max(live.pruned or 0, through)
        live.prune_at = live.seq if behind else live.seq + sig.PRUNE_EVERY

    tx.after.append(moved)


async def _forget_check_in(engine: ProcessEngine, tx: _Tx, live: _Live, run_id: str, answer: Message | None) -> None:
    """A heartbeat that found nothing to do, and did nothing (no tool call, no input joined): its
    check-in and its acknowledgement leave the conversation, which would otherwise carry two
    messages of nothing every half hour into every later model call. Its signals stay logged."""
    history = live.history  # (the answer joins it once this transaction's body is kept)
    if not history or not isinstance(history[-1], SystemMessage):
        return  # (not the shape of a check-in: kept)
    await engine.store.delete_run_messages(live.record.pid, run_id)

    def forget() -> None:
        if len(history) >= 2 and history[-1] is answer and isinstance(history[-2], SystemMessage):
            del history[-2:]

    tx.after.append(forget)


async def signal_run_finished(
    tx: _Tx,
    live: _Live,
    run: dict[str, Any],
    status: str,
    reason: str,
    *,
    error: str | None = None,
    text: str | None = None,
    queued: int | None = None,
) -> None:
    """Log ``proc.run.finished`` with what a watcher needs without reading the history: the run's
    answer (``text``, null unless it ended with one), its usage, and the input waiting to start
    the next run (``queuedCount``: ``queued``, the count once ``tx`` is kept, where ``tx`` changes
    the queue itself - the cache follows only after the commit - else the cache's)."""
    payload: dict[str, Any] = {"runId": run["run_id"], "status": status, "reason": reason, "text": text}
    output = run_output(live, run["run_id"])
    if output is not None:  # a run asked for an output: the value, null without one (only when asked)
        payload["output"] = output.output_of(live.history) if status == "ok" else None
    if error:
        payload["error"] = error
    if status == "aborted":
        payload["aborted"] = True
    if quiet_answer(run["run_id"], text):
        payload["quiet"] = True
    payload["usage"] = run["usage"]
    payload["queuedCount"] = live.queued if queued is None else queued
    payload["timestamp"] = int(time.time() * 1000)
    await tx.signal(sig.RUN_FINISHED, **payload)


# what a person can do about an overflow that a compaction did not cure (what is left in the window,
# the system prompt, the tools and the newest messages, is too large on its own)
OVERFLOW_ADVICE = (
    "(The conversation no longer fits the model's context window, even compacted: reset the process "
    "to start afresh - its history is archived - or use a model with a larger window.)"
)


def _reason_code(reason: str) -> str:
    if reason in ("stop", "length") or reason in GUARD_NAMES:
        return "turn.complete" if reason == "stop" else reason
    return {"error": "generation.error", "aborted": "user"}.get(reason, reason)
