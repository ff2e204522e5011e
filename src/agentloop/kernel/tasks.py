"""Subagents: the ``Task`` tool, with which a process hands a piece of work to a child process.

The child is an ordinary durable process (same owner and working directory, ``parent_pid`` set,
the task as its first message), so it survives a crash, shows up in ``ps`` and can be watched.
Two ways to use it:

- ``wait=true`` (the default): the call returns the child's final answer. The child's pid is
  derived from the parent, the run and the tool call id, so when a restart runs the call again
  (the tool is idempotent) it finds the same child and waits for it instead of starting a second
  one; a later run whose model numbers its calls the same way (``call_0`` again) starts its own.
- ``wait=false``: the call returns at once; a one-shot signal watch tells the parent, as a system
  event, how the child's run ended and what it answered. The parent can go on meanwhile.

Either way the child stops with the parent's run that started it (aborted, interrupted), and
with the parent (reset, kill): see ``tree.py``. Which run that was is stored with the child.

Children are not interactive: nobody watches a child to answer its approval requests, so a call
its policy would ask about is refused and the child's model is told why. Nesting is capped
(``MAX_DEPTH``) so a model cannot fork itself without end, and so is the number of children one
process may have running at once.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agentloop.kernel.tree import ORIGIN_KEY, origin
from agentloop.messages import AssistantMessage, UserMessage
from agentloop.process import signals as sig
from agentloop.process.keylock import KeyedLocks
from agentloop.process.store import ProcessRecord
from agentloop.tools.base import Tool, ToolContext, ToolError, ToolResult

if TYPE_CHECKING:
    from agentloop.kernel.kernel import Kernel

MAX_DEPTH = 3  # a process, its child, grandchild and great-grandchild: no deeper
MAX_RUNNING = 8  # children of one process running at once
TASK_TIMEOUT = 1800.0  # seconds a waiting Task call may take (the child's own runs are not cut)

_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "prompt": {
            "type": "string",
            "description": "The task, complete in itself: the subagent sees nothing of this conversation.",
        },
        "wait": {
            "type": "boolean",
            "description": "true (default): wait and get the answer. false: go on; the answer arrives later"
            " as a system message.",
        },
    },
    "required": ["prompt"],
    "additionalProperties": False,
}


_starting = KeyedLocks()  # per parent pid (one event loop per kernel: a module-level lock set is enough)


class TaskTool(Tool):
    """``Task`` for one process: starts a child process on the given prompt."""

    def __init__(self, kernel: Kernel, parent: ProcessRecord) -> None:
        super().__init__(
            "Task",
            "Hand a self-contained piece of work to a subagent (a new process with the same tools and"
            " working directory) and get its final answer. Use it for work that needs many steps of its"
            " own; give it everything it needs to know in `prompt`.",
            _SCHEMA,
            timeout=TASK_TIMEOUT,
            idempotent=True,  # a re-run after a restart finds the child it started (see child_pid)
        )
        self.syscall = "proc.spawn"
        self.kernel = kernel
        self.parent = parent

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        # as the schema says (``additionalProperties``): an option the model guessed at (say,
        # ``background``) would otherwise be dropped in silence, and the call do something else
        unknown = sorted(set(arguments) - set(_SCHEMA["properties"]))
        if unknown:
            raise ToolError(f"Task takes `prompt` and `wait` only, not {', '.join(f'`{k}`' for k in unknown)}")
        prompt = arguments.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ToolError("Task needs a non-empty `prompt` string")
        wait = arguments.get("wait", True)
        if not isinstance(wait, bool):
            raise ToolError("`wait` must be true or false")
        return {"prompt": prompt, "wait": wait}

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        kernel, parent = self.kernel, self.parent
        pid = child_pid(parent.pid, ctx.run_id, ctx.call_key or ctx.tool_call_id)
        existing = await kernel.store.get_process(pid)
        if existing is None and ctx.call_key is not None:  # a child made before calls had keys?
            legacy = await _legacy_child(kernel, parent.pid, child_pid(parent.pid, ctx.run_id, ctx.tool_call_id))
            if legacy is not None and legacy[1] == arguments["prompt"]:
                pid, existing = legacy[0].pid, legacy[0]
        if existing is None and await kernel.store.was_killed(pid):  # (a re-run after a restart)
            raise ToolError(f"the subagent {pid} this call started was killed")
        if existing is None:
            # one call of the parent's at a time from the count to the child's run: sibling calls
            # of one turn would all count before any child runs, and pass the cap together
            async with _starting.hold(parent.pid):
                await self._check_limits()
                child = await kernel.spawn(
                    parent.owner,
                    run_as=parent.run_as,  # the identity it works as (its context, skills, home) too
                    cwd=parent.cwd,
                    interactive=False,
                    parent_pid=parent.pid,
                    pid=pid,
                    kv={ORIGIN_KEY: origin(parent.pid, ctx.run_id, arguments["wait"])},
                    context=f"You are a subagent working on a task for process {parent.pid}. Answer with the result.",
                )
                if not arguments["wait"]:
                    await kernel.watch(parent.pid, pid, sig.RUN_FINISHED, once=True)
                await child.send(arguments["prompt"], run_id=f"task:{pid}")
        else:
            child = await kernel.process(pid)
            if existing.state != "killed":
                # A restart may have come between the child's creation and its prompt (and, for a
                # background task, its watch): finish the delivery. The send is idempotent by its
                # run id, so a child that got the prompt gets nothing new; the watch goes in first,
                # as above, so the child cannot finish before it exists.
                if (
                    not arguments["wait"]
                    and not any(w.source_pid == pid for w in await kernel.watches(parent.pid))
                    and not await child.history(limit=1)
                ):
                    await kernel.watch(parent.pid, pid, sig.RUN_FINISHED, once=True)
                await child.send(arguments["prompt"], run_id=f"task:{pid}")
        if not arguments["wait"]:
            return ToolResult.text(f"Started subagent {pid}; its answer will arrive as a system message.")
        try:
            await child.wait_idle()
        except asyncio.CancelledError:
            # The parent's run was aborted (or timed out): the work it waited for is not wanted any
            # more. A shutdown is different: the call runs again after the restart and finds the child.
            if not kernel.engine.closing:
                await asyncio.shield(child.abort())
            raise
        return await _answer(kernel, pid)

    async def _check_limits(self) -> None:
        depth, pid = 0, self.parent.parent_pid
        while pid is not None and depth <= MAX_DEPTH:
            depth += 1
            record = await self.kernel.store.get_process(pid)
            pid = record.parent_pid if record is not None else None
        if depth >= MAX_DEPTH:
            raise ToolError(f"subagents may nest {MAX_DEPTH} deep at most; do this task yourself")
        children = [r for r in await self.kernel.processes(self.parent.owner) if r.parent_pid == self.parent.pid]
        if sum(1 for r in children if r.current_run is not None) >= MAX_RUNNING:
            raise ToolError(f"{MAX_RUNNING} subagents are running already; wait for one to finish")


def child_pid(parent_pid: str, run_id: str | None, call_key: str) -> str:
    """The child's pid: the same for the same call, so a re-run after a restart finds it. The call
    is named by its durable key (``ToolContext.call_key``), not by the provider's call id, which
    some providers reuse in every reply (``call_0``): a second Task of the run would find the
    first one's child and be given its answer."""
    digest = hashlib.sha256(f"{parent_pid}\0{run_id or ''}\0{call_key}".encode()).hexdigest()[:20]
    return f"task-{digest}"


async def _legacy_child(kernel: Kernel, parent_pid: str, pid: str) -> tuple[ProcessRecord, str] | None:
    """The child an earlier version named by the provider's call id, with its prompt, if there is
    one: a call re-run after an upgrade finds it by that (and by its prompt, since the call id may
    have been reused) instead of starting the work again."""
    record = await kernel.store.get_process(pid)
    if record is None or record.parent_pid != parent_pid:
        return None
    first = next((m.message for m in await kernel.store.history(pid) if isinstance(m.message, UserMessage)), None)
    return (record, first.text) if first is not None else None


async def _answer(kernel: Kernel, pid: str) -> ToolResult:
    """The child's last answer, or an error saying how its run ended without one."""
    finished = None
    async for signal in (await kernel.process(pid)).signals(follow=False):
        if signal.signal == sig.RUN_FINISHED:
            finished = signal.payload
    last = next(
        (m.message for m in reversed(await kernel.store.history(pid)) if isinstance(m.message, AssistantMessage)),
        None,
    )
    text = last.text if last is not None else ""
    if finished is not None and finished.get("status") != "ok":
        reason = finished.get("reason") or finished.get("status")
        # what failed (the provider's message), as the background report gives it: the reason
        # code alone (``generation.error``) does not tell the parent whether trying again helps
        said = "\n".join(part for part in (str(finished.get("error") or ""), text) if part)
        raise ToolError(
            f"subagent {pid} ended with {finished.get('status')} ({reason})" + (f": {said}" if said else "")
        )
    return ToolResult.text(text or f"subagent {pid} finished without an answer", details={"pid": pid})


def task_toolset(kernel_ref: list[Kernel]) -> Any:
    """A ``ToolsetFn`` adding ``Task`` to each run, bound to the run's process. ``kernel_ref`` is
    filled once the kernel exists (the toolset is made before it)."""

    def toolset(record: ProcessRecord, shared: Mapping[str, Tool]) -> Mapping[str, Tool]:
        if not kernel_ref or "Task" in shared:
            return shared
        return {**shared, "Task": TaskTool(kernel_ref[0], record)}

    return toolset
