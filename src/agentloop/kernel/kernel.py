"""The kernel: opens a store, owns the durable processes in it, and hands out ``Process`` handles.

    async with Kernel.open("sqlite:///agentloop.db", model="local:qwen2.5-coder-0.5b", workspace=".") as kernel:
        proc = await kernel.spawn(owner="alice")
        receipt = await proc.send("hello")
        async for signal in proc.signals(follow=True): ...

Opening resumes every run that was unfinished when the store was last closed (or the machine
crashed). Images and documents sent with a message are stored as files under the data directory;
reset and kill archive the history there (``var/sessions/<user>/<pid>/``) before they clear it.
What each run is given (prompt, tools, media) is put together in ``runs.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from agentloop.agent import Agent
from agentloop.kernel import tree
from agentloop.kernel.account_mcp import AccountMCP
from agentloop.kernel.account_model import AccountModels, ModelChoice
from agentloop.kernel.delegate import Replies, delegate_toolset
from agentloop.kernel.devices import DeviceDirectory, device_toolset
from agentloop.kernel.duty import HEARTBEAT, RETENTION, SCHEDULES, WATCHES, Duty
from agentloop.kernel.fork import fork as fork_process
from agentloop.kernel.heartbeat import Heartbeat
from agentloop.kernel.memory_tool import memory_toolset
from agentloop.kernel.retention import Retention, RetentionTimer, StillActive
from agentloop.kernel.rewind import Rewound
from agentloop.kernel.rewind import rewind as rewind_process
from agentloop.kernel.runs import (
    chain,
    cwd_toolset,
    home_file,
    hydrate_media,
    jobs_toolset,
    owner_scoped,
    prompt_builder,
    skills_toolset,
)
from agentloop.kernel.schedule_tool import schedule_toolset
from agentloop.kernel.schedules import DEFAULT_MIN_EVERY, SCHEDULE_RUN_PREFIX, Scheduler
from agentloop.kernel.segments import Segment, SegmentPage, list_segments, read_segment, record_reset
from agentloop.kernel.subagent_asks import SubagentAsks, descendants_asks
from agentloop.kernel.tasks import Retirer, task_toolset
from agentloop.kernel.titles import Titles, Titling, check_titling
from agentloop.kernel.watches import WATCH_RUN_PREFIX, WatchRouter
from agentloop.loop.hooks import Handled, maybe_await
from agentloop.loop.output import DEFAULT_RETRIES, output_in, output_schema_of
from agentloop.loop.state import Mode, check_mode
from agentloop.messages import (
    FileContent,
    ImageContent,
    Message,
    Origin,
    TextContent,
    UserBlock,
    UserMessage,
    check_origin,
    check_plain_text,
    check_unicode,
    system,
)
from agentloop.models.base import Model, Reasoning
from agentloop.process import admission
from agentloop.process import signals as sig
from agentloop.process.api import ApprovalFn, Compacted, Receipt, SendMode, ToolsetFn, new_id
from agentloop.process.approval.checker import AmendFn, PolicyBook, policy_amender, policy_approval
from agentloop.process.archive import DISCARDED_KEY, check_name, discarded_messages, queued_meta, write_archive
from agentloop.process.audio_video import (
    AudioContent,
    InputMedia,
    Transcriber,
    VideoContent,
    check_transcriber,
    to_text,
)
from agentloop.process.background import JOBS_KEY
from agentloop.process.compaction import check_manual, extract_memories
from agentloop.process.driver import check_outage_retries
from agentloop.process.engine import MODE_KEY, MODEL_KEY, Admit, ProcessEngine
from agentloop.process.heartbeat import DEFAULT_HEARTBEAT, HeartbeatSettings
from agentloop.process.hil import AUDIT_ID, MAX_AUDIT_PAGE, check_approval_timeout
from agentloop.process.lease import DEFAULT_POLL, DEFAULT_TTL
from agentloop.process.media import MediaStore
from agentloop.process.memory import append_daily_memory, owner_home
from agentloop.process.pressure import (
    CompactionPolicy,
    Overflow,
    ProcessContext,
    check_policy,
    context_of,
    load_policy,
    set_policy,
)
from agentloop.process.prompt import DEFAULT_MAX_CONTEXT_BYTES
from agentloop.process.signals import AccountSignal, Signal
from agentloop.process.store import (
    MAX_SEQ,
    HilRow,
    NoSuchProcess,
    ProcessBusy,
    ProcessRecord,
    QueueItem,
    ScheduleRow,
    Store,
    StoredMessage,
    StoreError,
    UsageTotals,
    WatchRow,
    open_store,
)
from agentloop.process.store.base import AUDIT_DECISIONS, ApprovalAuditRow, QueueKind
from agentloop.process.store.common import dumps
from agentloop.process.tool_scope import (
    TOOLS_KEY,
    ToolScopeError,
    check_scope,
    intersection,
    unknown_entries,
    widening,
)
from agentloop.tools.base import Tool, ToolLike
from agentloop.tools.builtin import builtin_tools
from agentloop.tools.sandbox import check_mode as check_sandbox_mode

log = logging.getLogger("agentloop.kernel")
#: kv of a process whose spawn's first input an input hook handled: that spawn's run id
SPAWN_HANDLED_KEY = "spawn:handled"

REMEMBER_GRACE = 10.0  # seconds a closing kernel waits for the memories of a reset conversation
MAX_INSTRUCTIONS = 20_000  # characters of instructions a compaction asked for may give the summary model
MAX_FILE_NAME = 255  # characters of a document's name (as the server's API allows)
MAX_RUN_ID = 128  # characters of a caller's run id (as the server's API and its WebSocket frames allow)


def _kernel_files(store: Store, data: Path) -> list[Path]:
    """What tools must not touch: the database (and its WAL), the accounts' homes (policies, MCP
    servers, context), the archives and media, the system context and skills. Named one by one,
    not as the whole data directory, because that may be the workspace itself."""
    files = [data / "home", data / "var", data / "config"]
    path = getattr(store, "path", None)
    if isinstance(path, str | Path) and str(path) != ":memory:":
        files += [Path(f"{path}{suffix}") for suffix in ("", "-wal", "-shm", "-journal")]
    return files


def _check_outside(root: Path, kernel_files: Iterable[Path]) -> None:
    """A sandboxed Shell may write anywhere beneath ``root``: the kernel's own files (its database,
    the accounts' policies and MCP servers) must lie elsewhere, or a command could rewrite what
    the runtime trusts and so leave the sandbox (``ValueError`` saying so)."""
    for path in kernel_files:
        if path.resolve().is_relative_to(root):
            raise ValueError(
                f"shell_sandbox needs the kernel's data outside {root}, where sandboxed commands may write,"
                f" but {path} lies in it: a command could rewrite it (keep the store and data_dir elsewhere)"
            )


def _check_run_id(run_id: object) -> None:
    """A caller's run id names a run in a column of its own, and in the key of the record that
    makes its delivery idempotent: a non-empty string of plain text of at most ``MAX_RUN_ID``
    characters."""
    if run_id is not None and (not isinstance(run_id, str) or not run_id):
        raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
    if run_id is not None:
        _check_run_id_length(run_id)
        check_plain_text(run_id, "run_id")


def _check_run_id_length(run_id: str) -> None:
    if len(run_id) > MAX_RUN_ID:
        raise ValueError(f"run_id must be at most {MAX_RUN_ID} characters, got {len(run_id)}")


def _check_run_id_type(run_id: object) -> None:
    """The run id ``abort`` and ``stop`` name: None (the active run) or a string. Any other string
    is a stale id, which does nothing (DESIGN §2); a number is a mistake, not a stale id."""
    if run_id is not None and not isinstance(run_id, str):
        raise TypeError(f"run_id must be a string or None, got {type(run_id).__name__}")
    if run_id is not None:
        _check_run_id_length(run_id)  # (no run has a longer one: a mistake, as the server says too)


def _output_row(output_schema: Any) -> dict[str, Any] | None:
    """The row an input's ``output_schema`` is kept in (``admission.output_key``), checked
    (``ValueError``), or None for input that asks for no output."""
    if output_schema is None:
        return None
    return {"schema": output_schema_of(output_schema), "retries": DEFAULT_RETRIES}


def _check_input(text: object, media: object, run_id: object) -> None:
    """What ``send`` (and ``spawn`` with a first message) refuses before anything is stored."""
    if not isinstance(text, str) or (not text.strip() and not media):
        raise ValueError("text must be a non-empty string (or come with an image or a file)")
    check_unicode(text, "text")
    _check_run_id(run_id)
    if (
        isinstance(media, str | bytes)
        or not isinstance(media, Sequence)
        or not all(isinstance(b, ImageContent | FileContent | AudioContent | VideoContent) for b in media)
    ):
        raise TypeError("media must be a sequence of ImageContent, FileContent, AudioContent or VideoContent blocks")
    for block in media:
        if isinstance(block, FileContent):
            _check_file_name(block.name)


def _check_file_name(name: object) -> None:
    """A document's name is shown to the model and kept in the message's JSON: a string of at most
    ``MAX_FILE_NAME`` characters, of one line, that has a UTF-8 form (a lone surrogate would fail
    the commit deep in the store, after the file was written)."""
    if not isinstance(name, str):
        raise TypeError(f"a file's name must be a string, got {type(name).__name__}")
    if len(name) > MAX_FILE_NAME:
        raise ValueError(f"a file's name must be at most {MAX_FILE_NAME} characters, got {len(name)}")
    check_plain_text(name, "the file's name")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValueError(f"the file's name {name!r} holds control characters (a line break, a tab...)")


def _check_kv(kv: object) -> None:
    """``spawn``'s ``kv``: a mapping of plain-text keys to values a store row can hold as JSON,
    checked before the transaction so that a bad one names itself instead of failing the insert."""
    if kv is None:
        return
    if not isinstance(kv, Mapping):
        raise TypeError(f"kv must be a mapping of names to JSON values, got {type(kv).__name__}")
    for key, value in kv.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"kv keys must be non-empty strings, got {key!r}")
        check_plain_text(key, "a kv key")
        try:
            dumps(value)
        except ValueError as exc:  # (pydantic's serialisation error is one)
            raise ValueError(f"kv[{key!r}] cannot be stored as JSON: {exc}") from None


def _user_input(
    store: MediaStore, owner: str, pid: str, text: str, media: Sequence[ImageContent | FileContent]
) -> UserMessage:
    """The user message for ``text`` and ``media``, the media stored as files (the message keeps a
    reference, the model gets the content). Every block is checked before any is stored: a bad
    one stores nothing."""
    for block in media:
        store.check(block)
    blocks: list[UserBlock] = [TextContent(text=text)]
    for block in media:
        ref = store.save(owner, pid, block)
        data = ref.to_data()
        if isinstance(block, FileContent):
            blocks.append(FileContent(data=data, mime_type=ref.mime_type, name=block.name))
        else:
            blocks.append(ImageContent(data=data, mime_type=ref.mime_type))
    return UserMessage(content=blocks)


def _check_position(name: str, value: object, minimum: int) -> None:
    """A count or position (a seq, a message id, a page size): an int the store can hold."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_SEQ:
        raise ValueError(f"{name} must be an integer from {minimum} to {MAX_SEQ}, got {value!r}")


class Process:
    """A handle on one durable process; every call goes through the kernel's engine and store."""

    def __init__(self, kernel: Kernel, pid: str, started: Receipt | None = None) -> None:
        self.kernel = kernel
        self.pid = pid
        self.started = started  # the receipt of the message ``spawn`` was given, if any

    def __repr__(self) -> str:
        return f"<Process {self.pid}>"

    async def info(self) -> ProcessRecord:
        record = await self._record()
        record.title = await self.kernel.titles.of(self.pid)
        return record

    async def _record(self) -> ProcessRecord:
        """The registry row (``NoSuchProcess`` if there is none), without the title ``info`` adds."""
        record = await self.kernel.store.get_process(self.pid)
        if record is None:
            raise NoSuchProcess(self.pid)
        return record

    async def title(self) -> str | None:
        """The process's title (kernel/titles.py): a person's, or the one made after its
        conversation's first run; None before there is one."""
        record = await self.kernel.store.get_process(self.pid)
        if record is None or record.state == "killed":
            raise NoSuchProcess(self.pid)
        return await self.kernel.titles.of(self.pid)

    async def set_title(self, text: str | None) -> str | None:
        """Name the process: one line of plain text, trimmed, at most 120 characters
        (``ValueError``/``TypeError`` otherwise, changing nothing). Nothing automatic overwrites it,
        a reset keeps it; None clears it, handing the process back to the automatic title."""
        return await self.kernel.titles.set(self.pid, text)

    async def send(
        self,
        text: str,
        mode: SendMode = "steer",
        media: Sequence[InputMedia] = (),
        run_id: str | None = None,
        output_schema: dict[str, Any] | Any = None,
        expected_run_id: str | None = None,
        origin: Origin | None = None,
    ) -> Receipt:
        """Deliver user input (``steer`` / ``queue`` / ``interrupt`` while a run is active), with
        images and documents (PDF, plain text, Markdown, CSV) attached as ``media``.

        Arbitration, for callers that may race one another or act on a stale view: ``mode="reject"``
        delivers only to an idle process (a run under way: ``RunActive``, with its ``run_id``), and
        ``expected_run_id`` only while that run is the current one (``RunNotCurrent`` otherwise,
        with the ``current`` one): a steer then joins it, a queue waits for the run after it, an
        interrupt stops it. A refusal is decided inside the admission's transaction and delivers,
        queues and aborts nothing; a retry of a delivery that got through (its ``run_id``) gets
        its receipt whatever the process does now (``process/admission.py``).

        Audio (``AudioContent``) is transcribed by the kernel's transcriber (``Kernel.open``)
        before delivery, and its transcript, marked as one, follows ``text``; a video
        (``VideoContent``) is delivered as a note of what was attached (no model takes video).
        What cannot be done is raised and nothing delivered: ``NoTranscriber`` (audio without a
        transcriber), ``TranscriptionFailed``, ``NoWords``, ``MediaTooLarge`` (each attachment
        has the media limit). A retry of an input admitted already (its ``run_id``) is not
        transcribed again: it gets its receipt (``process/audio_video.py``).

        ``output_schema`` (a JSON Schema, or a type pydantic describes as one) asks the run that
        answers this input for a value: it gets a ``final_result`` tool with that schema, and ends
        when the model calls it validly (``Process.output`` reads the value back; the run's
        ``proc.run.finished`` carries it as ``output``). Such input never joins a run under way
        (a run has one output): a ``steer`` waits for a run of its own, as ``queue`` does. A schema
        that is not valid (or larger than 64 KiB as JSON) is a ``ValueError``, nothing delivered.

        ``origin`` (``messages.origin``) says who wrote the input, in what kind of chat: kept with
        the message, and in a group chat shown to the model as a line before the text (a chat
        bridge's, where several people write to one process)."""
        if expected_run_id is not None and not isinstance(expected_run_id, str):  # (any string: a run id)
            raise TypeError(f"expected_run_id must be a string or None, got {type(expected_run_id).__name__}")
        admission.check_send(mode, expected_run_id)  # before any media file is written
        _check_input(text, media, run_id)
        origin = check_origin(origin)
        output = _output_row(output_schema)
        engine = self.kernel.engine
        record = (await engine.live(self.pid)).record
        conditional = expected_run_id is not None or mode == "reject"
        if conditional or any(isinstance(block, AudioContent | VideoContent) for block in media):
            seen = await admission.admitted(engine, self.pid, run_id)
            if seen is not None:  # (a retry: delivered, transcription and all, whatever the run is now)
                return seen
        if conditional:  # a refusal seen now transcribes and stores nothing (admission decides again)
            admission.check_admission(self.pid, mode, expected_run_id, record.current_run)
        text, blocks = await to_text(text, media, self.kernel.transcriber, self.kernel.media.max_bytes)
        if blocks:  # a reset under way deletes the process's media: what this input brings is stored
            await admission.after_clearing(engine, self.pid)  # after it (the input waits for it anyway)
        message = _user_input(self.kernel.media, record.owner, self.pid, text, blocks)
        message.origin = origin
        return await engine.send(
            self.pid, message, mode=mode, run_id=run_id, output=output, expected_run_id=expected_run_id
        )

    async def output(self, run_id: str, output_type: Any = None) -> Any:
        """The output run ``run_id`` gave (one whose input asked for it with ``output_schema``):
        the value of its last valid ``final_result`` call, read back from the history, as JSON
        data (validated as ``output_type`` when given, a pydantic type); None if it gave none
        (yet, or it was asked for none, or the history holding it was reset)."""
        await self.kernel.engine.live(self.pid)  # NoSuchProcess for an unknown or killed pid
        messages = [m.message for m in await self.kernel.store.history(self.pid) if m.run_id == run_id]
        value = output_in(messages)
        if value is None or output_type is None:
            return value
        return TypeAdapter(output_type).validate_python(value)

    async def signals(self, after_seq: int = 0, *, follow: bool = True) -> AsyncGenerator[Signal, None]:
        """The process's signals after ``after_seq``; with ``follow``, then live ones as they come.
        An ``after_seq`` past the log's end (a client that saw more than a database restored from
        an older backup holds) counts from the end: new signals take the numbers it already saw,
        and waiting for the log to pass them would hide every one until then. One before the
        oldest kept signal (the log was pruned, or a reset dropped it) is first sent an unlogged
        ``proc.log.pruned`` saying how many it missed: what they told is in the history now.
        On a shared store, the worker running the process publishes the signals of its own steps
        only: one another worker logged for it (the queue change of a message sent there, an
        approval decided there) is read from the log when the worker hears of it (``GAP``:
        ``SignalHub.recheck``) or a later seq shows it was skipped, so a follower there gets every
        logged signal, in order, once."""
        _check_position("after_seq", after_seq, 0)
        engine = self.kernel.engine
        await engine.live(self.pid)
        if after_seq:
            after_seq = min(after_seq, await self.kernel.store.last_event_seq(self.pid))
        queue = engine.hub.watch(self.pid) if follow else None
        try:
            last = after_seq
            async for logged in self._logged(last, resumed=after_seq > 0):
                last = logged.seq or last
                yield logged
            if queue is None:
                return
            if engine.leases is not None:  # held by another worker: fed from the log from here
                engine.leases.follow(self.pid, last)
            while True:
                item = await queue.get()
                if item is None:
                    return
                # fell behind, and what it had not taken was dropped; or (on a shared store) a seq
                # skipped, logged by another worker: the log has them (seqs are given out under the
                # process row's lock, so whatever is numbered below a committed signal is committed)
                if item is sig.GAP or (engine.leases is not None and item.seq is not None and item.seq > last + 1):
                    async for logged in self._logged(last, resumed=True):
                        last = logged.seq or last
                        yield logged
                    if item is sig.GAP:
                        continue
                if item.seq is not None and item.seq <= last:
                    continue  # already delivered from the log
                if item.seq is None and item.base is not None and item.base < last:
                    continue  # a delta of a step the log has shown past (queued while the log was read)
                if item.seq is not None:
                    last = item.seq
                yield item
        finally:
            if queue is not None:
                engine.hub.unwatch(self.pid, queue)

    async def _logged(self, after_seq: int, *, resumed: bool) -> AsyncIterator[Signal]:
        """The logged signals after ``after_seq``, a page at a time; for a watcher that has seen
        the log through ``after_seq`` (``resumed``), led by ``proc.log.pruned`` if the log no
        longer goes back that far. (A watcher reading from the start asked for what is kept.)"""
        first = resumed
        while True:
            page = await self.kernel.store.events(self.pid, after_seq=after_seq, limit=500)
            if first and page and page[0].seq > after_seq + 1:
                payload = {"pid": self.pid, "afterSeq": after_seq, "oldestSeq": page[0].seq}
                yield Signal(sig.LOG_PRUNED, {**payload, "missed": page[0].seq - after_seq - 1})
            first = False
            for row in page:
                after_seq = row.seq
                yield Signal(row.signal, row.payload, row.seq)
            if len(page) < 500:
                return

    async def wait_idle(self) -> None:
        await self.kernel.engine.wait_idle(self.pid)

    async def history(self, limit: int | None = None, before: int | None = None) -> list[StoredMessage]:
        """The stored messages, oldest first: the last ``limit`` of them before message id ``before``."""
        if limit is not None:
            _check_position("limit", limit, 1)
        if before is not None:
            _check_position("before", before, 0)
        await self.kernel.engine.live(self.pid)  # NoSuchProcess for an unknown or killed pid
        return await self.kernel.store.history(self.pid, limit=limit, before=before)

    async def messages(self) -> list[Message]:
        return [m.message for m in await self.history()]

    async def stop(self, run_id: str | None = None) -> bool:
        """Finish the active run gently (``run_id``: only that one): what is under way completes,
        then the model answers once without tools and the run ends with reason ``stopped``. The
        subagents the run started that still work are stopped the same way (``tree.run_stopping``).
        The run is named before it is stopped: a quick last answer may end it before its subagents
        are looked up, and they must be found by it all the same."""
        _check_run_id_type(run_id)
        if run_id is None:
            record = await self.kernel.store.get_process(self.pid)
            run = record.current_run if record is not None else None
            run_id = None if run is None else run["run_id"]
        stopping = await self.kernel.engine.stop(self.pid, run_id)
        if stopping:
            await tree.run_stopping(self.kernel, self.pid, run_id)
        return stopping

    async def abort(self, run_id: str | None = None) -> bool:
        """Stop the active run (``run_id``: only that one), and the subagents it started."""
        _check_run_id_type(run_id)
        return await self.kernel.engine.abort(self.pid, run_id)

    async def retry(self, run_id: str | None = None) -> Receipt:
        """Run the model again on the conversation as it stands, with no new input ("Retry"): for
        a last run that ended without answering (a provider error, an abort, the output limit, a
        context overflow a compaction did not cure), whose input is kept. The failed end (the
        failure notice, the failed or cut-off partial answer) is removed first, so the model
        answers the input afresh. Only while idle (``RunActive``); ``NothingToRetry`` (a
        ``ValueError``) when the conversation ended with an answer. ``run_id`` makes it
        idempotent as with ``send``: a retry of it gets the first receipt. See ``admission.retry``."""
        _check_run_id(run_id)
        return await self.kernel.engine.retry(self.pid, run_id=run_id)

    async def hil(
        self,
        request_id: str,
        decision: str,
        remember: bool | str = False,
        message: str | None = None,
        *,
        arguments: Mapping[str, Any] | None = None,
        by: str | None = None,
    ) -> bool:
        """Answer a pending approval: ``approve`` or ``deny``, with ``message`` the model reads in
        the denied call's result ("use staging instead"), so it can change course instead of
        guessing why. A message with approve, one too long (``MAX_DENIAL_MESSAGE``) or with control
        characters raises and answers nothing.

        With approve, ``arguments`` run in place of the model's (checked against the tool's schema
        and the policy first: invalid, or denied by the policy, raises ``ValueError`` and the request
        stays pending), and ``remember`` allows this kind of call from now on where the policy
        would ask: ``"run"`` for the rest of the run, ``"process"`` (or ``True``) for the process,
        ``"account"`` in the owner's policy file, for its later processes too (a shell command: its
        program only). A request of one of its subagents (``pending_approvals`` lists them) is
        answered in the subagent's process (kernel/subagent_asks.py). ``by`` names who answered
        (the server gives the caller's account), kept with the answer's ``proc.changed`` signal
        (``answered``), so an owner can see that an admin answered for them."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        pid = self.pid
        if not any(h.request_id == request_id for h in await self.pending_approvals(own=True)):
            record = await self._record()
            theirs = next((h for h in await descendants_asks(self.kernel, record) if h.request_id == request_id), None)
            pid = pid if theirs is None else theirs.pid
        return await self.kernel.engine.hil(
            pid, request_id, decision, remember=remember, message=message, arguments=arguments, by=by
        )

    async def set_mode(self, mode: Mode) -> None:
        """``chat``: from the next run on, answer from the same history without tools; ``agent``
        (the default): with them again."""
        await self.kernel.engine.set_mode(self.pid, mode)

    async def mode(self) -> Mode:
        return await self.kernel.engine.mode(self.pid)

    async def set_model(self, model: str | None, *, reasoning: Reasoning | None = None) -> ModelChoice:
        """This conversation's own model from its next run on (a run under way keeps its own):
        ``provider:model`` as an account's ``model.json`` names one, and a ``reasoning`` level;
        it wins over the account's file and the kernel's model. None (and no level) returns to
        those. One that cannot be used (``AccountModels.check``) is a ``ValueError``, and the
        choice stays what it was."""
        row = self.kernel.models.check(model, reasoning)
        await self.kernel.engine.set_model(self.pid, row)
        return await self.model()

    async def model(self) -> ModelChoice:
        """The process's model choice, the model its next run uses and where that comes from."""
        record = await self._record()
        if record.state == "killed":
            raise NoSuchProcess(self.pid)
        row = await self.kernel.store.kv_get(self.pid, MODEL_KEY)
        return self.kernel.models.describe(record, row, self.kernel.engine.config.model)

    async def set_tools(self, tools: Sequence[str] | None) -> list[str] | None:
        """This process's tool scope from its next run on (a run under way keeps its tools): the
        names (``mcp:<server>`` and globs too, process/tool_scope.py) of the tools its runs are
        offered; None: every tool (a subagent's: its parent's). A name it has no tool of, or one
        its parent's scope does not offer, is a ``ToolScopeError`` (a ``ValueError`` listing the
        available names), and the scope stays what it was. Its subagents, and theirs, are narrowed
        with it (each one's scope: its own within the new one, ``Kernel._narrow_descendants``), each
        as a change of its own (its watchers told), deepest first, before the process's own changes
        (so none keeps a tool it lost); widening it widens none of them."""
        record = await self._record()
        if record.state == "killed":
            raise NoSuchProcess(self.pid)
        scope = await self.kernel._checked_scope(record, check_scope(tools))
        await self.kernel._narrow_descendants(record, scope)
        await self.kernel.engine.set_tools(self.pid, scope)
        return scope

    async def tools(self) -> list[str] | None:
        """The process's tool scope (``set_tools``); None: it may use every tool."""
        await self.kernel.engine.live(self.pid)  # NoSuchProcess for an unknown or killed pid
        scope = await self.kernel.store.kv_get(self.pid, TOOLS_KEY)
        return list(scope) if isinstance(scope, list) else None

    async def available_tools(self) -> list[str]:
        """The names of the tools a run of this process would be offered without its scope."""
        return sorted(await self.kernel._tools_of(await self._record()))

    async def set_compaction(
        self, threshold: float | None = None, overflow: Overflow = "compact", keep_recent_tokens: int | None = None
    ) -> CompactionPolicy:
        """This process's compaction, from its next run on: compact at ``threshold`` (a share of
        the usable window, above 0 and at most 1; None: the kernel's), on an ``overflow`` the
        provider reports either ``compact`` and retry or ``fail`` the run with an error (its
        history stays verbatim), and keep ``keep_recent_tokens`` of recent history out of the
        summary (None: a quarter of the room the history has). All defaults: the kernel's again.
        A bad value raises ``TypeError`` or ``ValueError`` and changes nothing."""
        policy = check_policy(threshold, overflow, keep_recent_tokens)
        await set_policy(self.kernel.engine, self.pid, policy)
        return policy

    async def compaction(self) -> CompactionPolicy:
        """The compaction policy set for the process's runs (``set_compaction``)."""
        await self.kernel.engine.live(self.pid)  # NoSuchProcess for an unknown or killed pid
        return await load_policy(self.kernel.store, self.pid)

    async def context(self) -> ProcessContext:
        """How full the context window is (``level`` ok/warn/critical/full, ``ratio``, ``tokens``
        of the usable ``window``) after the latest model step, with the policy and the threshold
        that apply. A level change is also logged as ``proc.changed`` with ``changes: ["context"]``."""
        return await context_of(self.kernel.engine, await self._record())

    async def pending_approvals(self, *, own: bool = False) -> list[HilRow]:
        """The approval requests waiting for a person: its own, then (unless ``own``) those of its
        subagents, which are answered through it too (each row's ``pid`` says whose it is)."""
        await self.kernel.engine.live(self.pid)  # NoSuchProcess for an unknown or killed pid
        rows = await self.kernel.store.hils(self.pid)
        if own:
            return rows
        return rows + await descendants_asks(self.kernel, await self._record())

    async def queued(self) -> list[QueueItem]:
        """The input waiting in the process's queue (steer input and system events for the active
        run, queued messages for the runs after it), in the order it will be taken."""
        live = await self.kernel.engine.live(self.pid)  # NoSuchProcess for an unknown or killed pid
        items = await self.kernel.store.queue(self.pid)
        return admission.take_order(items, running=live.record.current_run is not None)

    async def withdraw(self, item_id: int | None = None, *, kind: QueueKind | None = None) -> list[QueueItem]:
        """Take waiting input out of the queue before it runs; returns what was withdrawn. By
        ``item_id``, by ``kind`` (both: the item, if of that kind), or by default all the user's
        input (steer and queue), never the system events unless named. An item a run has taken
        already is not withdrawn, and not in the answer. See ``admission.withdraw``."""
        return await self.kernel.engine.withdraw(self.pid, item_id, kind)

    async def compact(
        self,
        instructions: str | None = None,
        *,
        keep_last: int | None = None,
        through: int | None = None,
        summary: str | None = None,
    ) -> Compacted:
        """Summarise the history now, as a run does when its context fills (``ProcessEngine.compact``):
        the older part is archived and replaced by a summary, ``instructions`` telling the summary
        model what to keep. Only while idle (``RunActive`` otherwise); ``Compacted.note`` says why
        nothing was compacted (too short, a hook declined), a failure raises ``CompactionError``.

        Where the summary ends is the compaction rules' choice unless given: ``keep_last`` keeps
        the newest N messages, ``through`` summarises every message up to and including that
        message id (``history()``'s ``StoredMessage.id``); not both. A tool call is never parted
        from its results: ``keep_last`` then keeps more, ``through`` summarises the call's results
        too. ``summary``: the summary's text, yours (plain text, at most ``MAX_SUMMARY``
        characters, not with ``instructions``), installed with no model call. Bad options are a
        ``TypeError`` or ``ValueError`` and change nothing."""
        if instructions is not None:
            if not isinstance(instructions, str):
                raise TypeError(f"instructions must be a string, got {type(instructions).__name__}")
            if len(instructions) > MAX_INSTRUCTIONS:
                raise ValueError(f"instructions are longer than {MAX_INSTRUCTIONS} characters")
            check_plain_text(instructions, "instructions")
        summary = check_manual(keep_last, through, summary, instructions, MAX_SEQ)
        await self.kernel.engine.live(self.pid)  # NoSuchProcess for an unknown or killed pid
        return await self.kernel.engine.compact(
            self.pid,
            instructions=(instructions or "").strip() or None,
            keep_last=keep_last,
            through=through,
            summary=summary,
        )

    async def segments(self) -> list[Segment]:
        """The parts of the history that compactions, clearings and resets put away, oldest first."""
        return await list_segments(self.kernel.store, self.kernel.data_dir, await self._record())

    async def segment(self, segment_id: str, limit: int = 100, before: int | None = None) -> SegmentPage:
        """The archived messages of one segment: the last ``limit`` before position ``before``
        (the newest page by default). ``NoSuchSegment`` for an id the process has no segment by."""
        _check_position("limit", limit, 1)
        if before is not None:
            _check_position("before", before, 0)
        if not isinstance(segment_id, str):
            raise TypeError(f"segment_id must be a string, got {type(segment_id).__name__}")
        return await read_segment(
            self.kernel.store, self.kernel.data_dir, await self._record(), segment_id, limit=limit, before=before
        )

    async def fork(self, *, at: int | None = None, segment: str | None = None, context: str | None = None) -> Process:
        """A new process of the same owner and settings whose history is a copy of this one's up to
        and including message id ``at`` (None: all of it), or of the archived ``segment``; this
        one is left as it is (``Kernel.fork``, kernel/fork.py)."""
        return await self.kernel.fork(self.pid, at=at, segment=segment, context=context)

    async def rewind(self, at: int) -> Rewound:
        """Cut this process's history back, in place, to message id ``at`` (``history()``'s
        ``StoredMessage.id``; 0: the start): what follows it is archived as a ``rewind`` segment,
        then removed; the process, its settings, queue and media stay (kernel/rewind.py). Only
        while idle (``RunActive``); an ``at`` that is not a message of the history, or ends inside
        a tool call batch, is a ``ValueError`` naming the nearest valid points. At the last message
        nothing is done (``Rewound.removed`` 0)."""
        return await rewind_process(self.kernel, self.pid, at)

    async def reset(self) -> Path | None:
        """Abort (with the runs of its descendants), archive the whole history, start an empty
        one, delete the process's media."""
        return await self.kernel._clear(self.pid, kill=False, archive=True)

    async def kill(self, archive: bool = True, *, if_idle_since: float | None = None) -> Path | None:
        """Abort, optionally archive, delete the process and its media, and its descendants
        likewise. Later calls fail. With ``if_idle_since`` (a time; retention's kill), only if the
        process and every one below it have been idle since then, decided with the kill itself
        (``Kernel._kill_if_idle``): else ``StillActive``, and nothing is done."""
        if if_idle_since is not None:
            return await self.kernel._kill_if_idle(self.pid, since=if_idle_since, archive=archive)
        return await self.kernel._clear(self.pid, kill=True, archive=archive)


class Kernel:
    """Owns a store and the durable processes in it."""

    def __init__(
        self,
        store: Store,
        engine: ProcessEngine,
        data_dir: Path,
        *,
        schedule_min_every: float = DEFAULT_MIN_EVERY,
        heartbeat: HeartbeatSettings | None = None,
        titles: Titling = "message",
        models: AccountModels | None = None,
        retention: Retention | None = None,
    ) -> None:
        self.store = store
        self.engine = engine
        # the model per account (model.json) and per process (``Process.set_model``)
        self.models = models if models is not None else AccountModels(home_file(data_dir, "model.json"))
        engine.choose_model = self.models.choose
        self.titles = Titles(store, engine, titles)  # (before recovery: its tap hears the runs it starts)
        self.data_dir = data_dir
        self.media = MediaStore(data_dir)
        self.transcriber: Transcriber | None = None  # (``open``'s: audio sent to a process is refused without one)
        leases = engine.leases

        # on a shared store one worker at a time fires the schedules, and one delivers the watched
        # signals that a worker which died left undelivered (kernel/duty.py)
        def duty(name: str) -> Duty | None:
            return None if leases is None else Duty(store, name, leases.owner, ttl=leases.ttl, every=leases.poll)

        self.scheduler = Scheduler(store, engine, min_every=schedule_min_every, duty=duty(SCHEDULES))
        self.watchers = WatchRouter(store, engine, duty=duty(WATCHES))
        self.heartbeat = None if heartbeat is None else Heartbeat(store, engine, heartbeat, duty=duty(HEARTBEAT))
        # old archives and idle processes swept away (kernel/retention.py); none unless a rule is set
        sweeps = retention is not None and retention.enabled
        self.retention = RetentionTimer(self, retention, duty=duty(RETENTION)) if sweeps and retention else None
        engine.aborted = self._run_aborted
        self._remembering: set[asyncio.Task[None]] = set()  # memories of reset conversations being kept
        self._closing = False  # (no new background work once closing has begun)
        self.shell_sandbox = "off"  # (``open``'s: a sandboxed process may not work where the kernel's data is)
        # (``open``'s) each account's approval policy in force (``policies.of(account)``), the one
        # the processes' checks ask, for what applies it outside a process (``/engine/chat``, to
        # its caller's account); None when a caller's own ``approval`` replaces the policy check
        self.policies: PolicyBook | None = None

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        url: str,
        *,
        model: str | Model | None = None,
        workspace: str | Path | None = None,
        tools: Iterable[ToolLike] | None = None,
        extra_tools: Iterable[ToolLike] = (),
        subagents: bool = False,
        schedule_tool: bool = False,
        fetch_allow: Iterable[str] = (),
        shell_sandbox: str = "off",
        shell_sandbox_read: Sequence[str | Path] = (),
        system_prompt: str = "",
        data_dir: str | Path | None = None,
        approval: ApprovalFn | None = None,
        approval_timeout: float | None = None,
        outage_retries: Sequence[float] = (),
        policy: str | bytes | dict[str, Any] | os.PathLike[str] | None = None,
        account_policies: dict[str, Any] | None = None,
        compaction_threshold: float = 0.9,
        clear_tool_outputs: bool = True,
        native_compaction: bool = False,
        daily_memory: bool = True,
        context_bytes: int = DEFAULT_MAX_CONTEXT_BYTES,
        toolset: ToolsetFn | None = None,
        devices: DeviceDirectory | None = None,
        schedule_min_every: float = DEFAULT_MIN_EVERY,
        heartbeat: HeartbeatSettings | None = DEFAULT_HEARTBEAT,
        worker: str | None = None,
        lease_ttl: float = DEFAULT_TTL,
        poll_interval: float = DEFAULT_POLL,
        titles: Titling = "message",
        transcriber: Transcriber | None = None,
        retention: Retention | None = None,
        maintenance: bool = False,
        **agent_options: Any,
    ) -> AsyncIterator[Kernel]:
        """Open (and migrate) the store, resume unfinished runs, and close everything on exit.

        ``tools`` default to the built-in tools rooted at ``workspace`` (default: the current
        directory); ``extra_tools`` join them (an MCP server's, say) without giving up the
        built-ins' per-process ``cwd``; ``subagents`` adds the ``Task`` tool (kernel/tasks.py), with
        which a process hands work to a child process, and ``Delegate`` (kernel/delegate.py), with which
        it hands a task to another existing process of its owner; ``schedule_tool`` adds ``Schedule``
        (kernel/schedule_tool.py), with which a process sets its own reminders; ``fetch_allow``
        names the non-public hosts the built-in Fetch may reach (``["localhost", "10.0.0.0/8"]``);
        ``shell_sandbox`` (``"off"``, ``"workspace"``, ``"workspace-offline"``, ``"private"``,
        ``"private-offline"``) confines the built-in Shell's commands with Landlock
        (``tools/sandbox.py``; a sandbox this machine cannot give is logged once, and every command
        refused); in the private modes they read only the workspace, the system and the directories
        ``shell_sandbox_read`` names;
        ``toolset`` adapts them per process run;
        ``devices`` (the server's device hub)
        makes the owner's online devices routable targets (``device_toolset``, unless ``toolset``
        is given) and fills the prompt's ``{{devices}}``; ``schedule_min_every`` is the shortest
        interval a repeating schedule may have; ``heartbeat`` paces the check-ins a workspace's
        ``HEARTBEAT.md`` asks for (kernel/heartbeat.py; None: none); on a store several workers share (PostgreSQL),
        ``worker`` names this one in its leases (default: host, pid and a random suffix), a lease
        lasts ``lease_ttl`` seconds unless renewed, and ``poll_interval`` is how often it looks
        for work whose notification it missed (see ``process/lease.py``) and how often the
        workers renew or try to take their duties (``kernel/duty.py``: firing the schedules, and
        delivering watched signals a dead worker left undelivered);
        ``agent_options`` are ``Agent``'s (``tool_timeout``, ``guards``, ``fallbacks`` …), among
        them ``pieces``: behaviour to compose in, like ``[ToolReveal(hidden=[...])]`` (hidden tools
        behind ``request_tools``) or ``[StopAfterTools("submit")]``, installed into the processes'
        shared configuration (``steering_mode``/``follow_up_mode`` are the in-memory runner's only).
        ``context_bytes`` is the budget of the accounts' own context (``home/<user>/context.d``) in
        each run's system prompt. A context past ``compaction_threshold`` is first eased by
        archiving old tool outputs and leaving a note in their place (``clear_tool_outputs``), when
        that is enough, else summarised (``process/compaction.py``), with ``native_compaction``
        also by the model's provider where it has its own (``Compaction``'s ``native``). With
        ``daily_memory`` the memories a compaction (or a reset) finds are appended to
        ``memory/<date>.md`` in the owner's home, ``<data_dir>/home/<owner>`` (``process/memory.py``),
        the ``memory`` tool reaches them,
        and each run's prompt recalls older ones (whatever tools its scope allows). An account's
        ``home/<account>/model.json`` picks the model of its runs (``kernel/account_model.py``).
        Tool calls are checked against the approval policy (``policy`` server-wide, per account in
        ``account_policies`` or the file ``<data_dir>/home/<account>/approval.json``; DESIGN §3's
        default otherwise) unless ``approval`` replaces the check. An account's policy, in code or
        in its file alike, replaces the server-wide one, unless it is ``remembered`` rules alone
        (neither ``default`` nor ``rules``): those go on top of it. A ``policy`` given as a file
        (a ``Path``; a ``str`` is JSON text) is read again whenever it changes, as the accounts'
        files are (``Kernel.policies`` gives each account's as in force, for ``/engine/chat``); an edit
        that does not parse keeps the last good policy (with a warning); one that cannot be read
        when the kernel opens is a ``ValueError``. A request nobody answers within
        ``approval_timeout`` seconds is denied (None: it waits for ever). A model call that still
        fails after its own retries and fallbacks in a way that may pass (a rate limit, a 5xx, no
        connection) ends the run, unless ``outage_retries`` gives the seconds to wait before each
        new try (``(30, 120, 600)``: three more, over some 12 minutes): the run then waits, durably
        (a restart keeps to the plan), and goes on where it was. After a conversation's first run
        a title is made in the background (kernel/titles.py): ``titles="message"`` cuts one from the
        first user message, ``"model"`` asks the process's model (that fallback when it fails), a
        ``TitleFn`` replaces the model, None makes none (a person may still set one).
        ``transcriber`` (``models.transcribe.open_transcriber``'s, or any object with a
        ``transcribe(audio, filename, mime) -> str``: async, or a plain function, run in a worker
        thread) turns audio sent to a process into its transcript (``Process.send``); without one,
        audio is refused. The caller closes it.
        ``retention`` (kernel/retention.py; None: nothing is ever removed) removes archives older
        than its ``archives`` and kills, with an archive, processes idle for longer than its
        ``idle_processes``, in a sweep an hour apart (the ``retention`` duty on a shared store).
        ``maintenance`` opens the store for a tool that works on it with none of a server's
        settings (``agentloop prune``): nothing starts, so nothing runs on the wrong model, tools or
        policy: no recovery (unfinished runs stay as they are, for the server to resume), no
        schedules, watches, heartbeat, retention sweeps, subagent bookkeeping or media sweep. The
        processes can be read and killed (retention's kill, ``Process.kill(if_idle_since=...)``,
        starts nothing); input sent to one would start a run, so such a tool sends none.
        """
        check_titling(titles)
        check_sandbox_mode(shell_sandbox)
        if retention is not None and not isinstance(retention, Retention):  # (else a sweep fails every hour)
            raise TypeError(f"retention must be a Retention, got {type(retention).__name__}")
        check_approval_timeout(approval_timeout)
        retry_plan = check_outage_retries(outage_retries)
        for name, fn in (("approval", approval), ("toolset", toolset)):
            if fn is not None and not callable(fn):  # else the first step of every run fails
                raise TypeError(f"{name} must be a function, got {type(fn).__name__}")
        if transcriber is not None:  # (else every audio sent fails as a 502, as if the service were down)
            check_transcriber(transcriber)
        if isinstance(compaction_threshold, bool) or not isinstance(compaction_threshold, int | float):
            raise TypeError(f"compaction_threshold must be a number, got {type(compaction_threshold).__name__}")
        if not 0 < compaction_threshold <= 1:  # a share of the context window (NaN fails this too)
            raise ValueError(f"compaction_threshold must be above 0 and at most 1, got {compaction_threshold}")
        if isinstance(context_bytes, bool) or not isinstance(context_bytes, int) or context_bytes < 0:
            raise ValueError(f"context_bytes must be a non-negative integer, got {context_bytes!r}")
        root = Path(workspace or ".").resolve()  # noqa: ASYNC240 - once, at start-up
        store = open_store(url)
        if data_dir is None:
            path = getattr(store, "path", ":memory:")
            data_dir = Path(path).resolve().parent if path != ":memory:" else root  # noqa: ASYNC240
        data = Path(data_dir)
        builtin = tools is None
        if tools is None:
            tools = builtin_tools(
                root, fetch_allow=fetch_allow, shell_sandbox=shell_sandbox, shell_sandbox_read=shell_sandbox_read
            )
        elif shell_sandbox != "off":  # (tools of the caller's own: theirs to confine)
            raise ValueError("shell_sandbox is for the built-in tools: with tools=..., pass it to builtin_tools()")
        tools = [*tools, *extra_tools]
        agent = Agent(model=model, tools=tools, system_prompt=system_prompt, workspace=root, **agent_options)
        off_limits = tuple(_kernel_files(store, data))
        if shell_sandbox != "off":
            _check_outside(root, off_limits)
        agent.config.off_limits = off_limits  # (the Search tool walks around them)
        media = MediaStore(data)
        if toolset is None and devices is not None:
            toolset = device_toolset(devices)
        account_mcp = AccountMCP(home_file(data, "mcp.json"))
        account_models = AccountModels(home_file(data, "model.json"), default=model if isinstance(model, str) else None)
        kernel_ref: list[Kernel] = []  # the Task tool needs the kernel, which is made below
        if subagents:
            toolset = chain(task_toolset(kernel_ref), toolset)
            toolset = chain(delegate_toolset(kernel_ref), toolset)  # (kernel/delegate.py)
        if schedule_tool:
            toolset = chain(schedule_toolset(kernel_ref), toolset)
        toolset = chain(account_mcp.toolset, toolset)
        toolset = chain(skills_toolset(data), toolset)
        toolset = chain(toolset, jobs_toolset())  # (last: with Shell as the other toolsets left it)
        if daily_memory:
            toolset = chain(memory_toolset(data), toolset)
        if builtin:
            toolset = chain(cwd_toolset(root, shell_sandbox, tuple(shell_sandbox_read)), toolset)
        toolset = owner_scoped(toolset)  # (an owner's own tools keep no cut results in the shared workspace)
        amend: AmendFn | None = None  # (a caller's own ``approval`` keeps no account files to amend)
        policies: PolicyBook | None = None  # (one book: the processes' checks and /engine/chat ask it alike)
        if approval is None:
            policy_file = home_file(data, "approval.json")
            policies = PolicyBook(policy, accounts=account_policies, account_file=policy_file)
            approval = policy_approval(store, policies=policies, protected=off_limits)
            amend = policy_amender(accounts=account_policies, account_file=policy_file)

        async def archive(record: ProcessRecord, name: str, messages: list[Message], meta: dict[str, Any]) -> str:
            path = await asyncio.to_thread(write_archive, data, record.owner, record.pid, name, messages, meta)
            return str(path.relative_to(data))

        async def remember(record: ProcessRecord, memories: str, source: str) -> str:
            # in the owner's home: the working directory may be shared with other accounts, whose
            # prompts read the memory files there
            home = data / "home" / record.owner
            await asyncio.to_thread(home.mkdir, parents=True, exist_ok=True)
            return await asyncio.to_thread(append_daily_memory, home, memories, source=source)

        async def run_model(record: ProcessRecord) -> str:
            # the prompt's {{model}}: what the run starts on (the process's, its account's or this
            # kernel's model), read only when the system context asks; the engine is made just below
            return (await engine.effective_config(record)).model.name

        engine = ProcessEngine(
            store,
            agent.config,
            approval=approval,
            hydrate=hydrate_media(media),
            prompt=prompt_builder(data, agent.config.system_prompt, devices, context_bytes, run_model),
            configure=account_models.configure,
            archive=archive,
            memory=remember if daily_memory else None,
            # recall reads the owner's memory whatever tools a run has (``run_prompt``)
            memory_home=(lambda record: owner_home(data, record.owner)) if daily_memory else None,
            compaction_threshold=compaction_threshold,
            clear_tool_outputs=clear_tool_outputs,
            native_compaction=native_compaction,
            toolset=toolset,
            worker=worker,
            lease_ttl=lease_ttl,
            poll_interval=poll_interval,
        )
        engine.approval_timeout = approval_timeout
        engine.amend_policy = amend
        engine.outage_retries = retry_plan
        await store.open()  # (last: what fails from here on closes it, and lets go of the runtime's lock)
        try:
            store.hold_runtime()  # one runtime drives the processes of a SQLite file
            kernel = cls(
                store,
                engine,
                Path(data_dir),
                schedule_min_every=schedule_min_every,
                heartbeat=None if maintenance else heartbeat,
                titles=titles,
                models=account_models,
                retention=None if maintenance else retention,
            )
        except BaseException:
            await store.close()
            raise
        kernel.shell_sandbox = shell_sandbox
        kernel.transcriber = transcriber
        kernel.policies = policies
        kernel_ref.append(kernel)
        working = subagents and not maintenance
        retirer = Retirer(kernel) if working else None  # (finished subagents: kernel/tasks.py)
        asks = SubagentAsks(kernel) if working else None  # (their approvals: kernel/subagent_asks.py)
        replies = Replies(kernel) if working else None  # (Delegate's answers: kernel/delegate.py)
        try:
            if not maintenance:  # (else nothing starts: see ``maintenance`` above)
                if retirer is not None:  # (before recovery: its tap hears the runs it resumes end)
                    await retirer.start()
                await kernel.titles.recover()
                await tree.stop_orphan_jobs(kernel)  # (before recovery reports them: what an abort left)
                await tree.stop_orphans(kernel, await engine.recover())  # (what an abort left before a crash)
                if asks is not None:  # (after recovery: the requests it withdrew are no longer shown)
                    await asks.recover()  # the copies a crash lost
                await kernel._sweep_media()
                await kernel.watchers.start()  # delivers what watched sources logged while it was down
                if replies is not None:  # delivers the answers to Delegate calls owed from before
                    await replies.start()
                kernel.scheduler.start()  # fires what came due meanwhile (missed repeats as one)
                if kernel.heartbeat is not None:
                    kernel.heartbeat.start()
                if kernel.retention is not None:
                    kernel.retention.start()
            yield kernel
        finally:
            if retirer is not None:
                await retirer.close()
            if asks is not None:
                await asks.close()
            if replies is not None:
                await replies.close()
            if kernel.retention is not None:  # (first: a sweep kills through the engine closed below)
                await kernel.retention.stop()
            if kernel.heartbeat is not None:
                await kernel.heartbeat.stop()
            await kernel.scheduler.stop()
            await kernel.watchers.stop()
            await kernel.titles.close()
            await kernel._finish_remembering()
            await engine.close()
            await account_mcp.close()
            await store.close()

    async def spawn(
        self,
        owner: str,
        *,
        cwd: str | Path | None = None,
        interactive: bool = True,
        context: str = "",
        run_as: str | None = None,
        parent_pid: str | None = None,
        pid: str | None = None,
        kv: Mapping[str, Any] | None = None,
        mode: Mode = "agent",
        model: str | None = None,
        reasoning: Reasoning | None = None,
        tools: Sequence[str] | None = None,
        text: str | None = None,
        media: Sequence[InputMedia] = (),
        run_id: str | None = None,
        admit: Admit | None = None,
        output_schema: dict[str, Any] | Any = None,
    ) -> Process:
        """A new durable process. ``cwd`` (default: the kernel's workspace; a relative one is taken
        from there) is the directory its built-in tools work in; it must exist. ``owner`` and
        ``run_as`` name accounts, so they must be plain names (they become directory names).
        ``kv`` rows are stored with the process, in the same transaction. ``mode="chat"``: its runs
        answer without tools (``Process.set_mode`` changes it). ``model`` (``provider:model``) and
        ``reasoning`` are its own model choice, over its account's (``Process.set_model`` changes
        it; one that cannot be used is a ``ValueError`` and no process is made). ``tools`` is its tool
        scope (process/tool_scope.py): the names of the tools its runs are offered (None: all; a
        child's: its parent's, which it may narrow but not widen), a ``ToolScopeError`` (listing
        the available names) for a name it has no tool of (``Process.set_tools`` changes it).
        ``text`` (with ``media``, and
        ``run_id`` as in ``send``) is its first input, stored in one transaction with the process (with
        its first run where this worker drives it; on a shared store as input the claiming worker
        runs), and ``Process.started`` is the receipt; ``output_schema`` as in ``Process.send``
        (the first run's output; only with ``text``). ``admit`` runs in the transaction that
        stores the process, once its row is written (a quota counts it there): what it raises
        leaves nothing behind."""
        output = _output_row(output_schema)
        if output is not None and text is None:
            raise ValueError("output_schema asks the run answering text for a value: give text with it")
        check_name(owner, "owner")
        run_as = owner if run_as is None else run_as  # ("" is a bad name, not "the owner")
        check_name(run_as, "run_as")
        _check_kv(kv)
        if kv is not None and TOOLS_KEY in kv:  # (else a scope nobody checked, past the parent's)
            raise ValueError(f"a tool scope is spawn's tools=..., not kv[{TOOLS_KEY!r}]")
        scope = check_scope(tools)
        if pid is not None:
            check_name(pid, "pid")
            if await self.store.was_killed(pid):
                raise StoreError(f"process {pid} was killed: a pid is not given to another process")
        if not isinstance(context, str):  # it ends every run's system prompt: caught here, not at each run
            raise TypeError(f"context must be a string, got {type(context).__name__}")
        check_plain_text(context, "context")  # (a column of its own)
        if not isinstance(interactive, bool):
            raise TypeError(f"interactive must be true or false, got {interactive!r}")
        if parent_pid is not None:
            await self._check_parent(parent_pid, owner)
        if check_mode(mode) == "chat":
            kv = {**(kv or {}), MODE_KEY: "chat"}
        if model is not None or reasoning is not None:
            chosen = self.models.check(model, reasoning)
            if chosen is not None:
                kv = {**(kv or {}), MODEL_KEY: chosen}
        workspace = self.engine.config.workspace or Path(".").resolve()  # noqa: ASYNC240 - (set at open)
        where = workspace
        if cwd is not None:
            if not isinstance(cwd, str | os.PathLike):
                raise TypeError(f"cwd must be a path, got {type(cwd).__name__}")
            try:
                where = (workspace / cwd).resolve()
                found = where.is_dir()
            except (OSError, ValueError, RuntimeError):  # a NUL byte, a path too long, a symlink loop
                found = False
            if not found:
                raise ValueError(f"cwd {str(cwd)!r} is not a directory")
            if self.shell_sandbox != "off":  # (its Shell may write anywhere beneath it)
                _check_outside(where, self.off_limits)
        record = ProcessRecord(
            pid=pid or new_id(),
            owner=owner,
            run_as=run_as,
            cwd=str(where),
            parent_pid=parent_pid,
            interactive=interactive,
            context=context,
            created_at=time.time(),
        )
        scope = await self._checked_scope(record, scope)
        if scope is not None:
            kv = {**(kv or {}), TOOLS_KEY: scope}
        if text is None:
            await self.engine.create(record, kv, admit=admit)
            return Process(self, record.pid)
        _check_input(text, media, run_id)
        if pid is not None and run_id is not None and any(isinstance(b, AudioContent | VideoContent) for b in media):
            # a retried spawn gets the first one's receipt before anything is transcribed (as
            # ``send``): again would cost a transcription, and one that fails now would refuse
            # an input delivered the first time
            seen = await self._retried_spawn(pid, owner, run_id)
            if seen is not None:
                return Process(self, pid, seen)
        text, blocks = await to_text(text, media, self.transcriber, self.media.max_bytes)  # (as ``send``)
        if self.engine.config.hooks.inputs:
            hooked = await self._hooked_spawn(record, kv, admit, text, blocks, pid, run_id)
            if isinstance(hooked, Process):
                return hooked
            text, blocks = hooked
        # whether this call makes the media folder (one already there holds files of someone else too)
        fresh = bool(blocks) and not self.media.process_dir(owner, record.pid).exists()
        try:
            first = _user_input(self.media, owner, record.pid, text, blocks)
            started = await self.engine.create(record, kv, first, run_id, admit, output)
        except StoreError:
            # a retried spawn (same pid, same run id) gets the first one's process and receipt
            seen = await self._retried_spawn(record.pid, owner, run_id)
            if seen is None:
                if fresh and await self.store.get_process(record.pid) is None:
                    self.media.delete_process(owner, record.pid)  # the process was not stored: nor are its files
                raise
            return Process(self, record.pid, seen)
        except BaseException:
            if fresh and await self.store.get_process(record.pid) is None:
                self.media.delete_process(owner, record.pid)
            raise
        return Process(self, record.pid, started)

    async def _hooked_spawn(
        self,
        record: ProcessRecord,
        kv: Mapping[str, Any] | None,
        admit: Admit | None,
        text: str,
        blocks: list[ImageContent | FileContent],
        pid: str | None,
        run_id: str | None,
    ) -> Process | tuple[str, list[ImageContent | FileContent]]:
        """A spawn's first input as the input hooks admit it (as ``send``'s: a process started with
        a message must not be a way around them), before anything is stored: its text and media,
        or the process to answer at once: the one a retried spawn made already (its hooks ran
        then), or, when a hook handled the input, the new process without it (a ``handled``
        receipt). A hook's failure (``InputRejected``) creates nothing."""
        if pid is not None and run_id is not None:
            seen = await self._retried_spawn(pid, record.owner, run_id)
            if seen is not None:
                return Process(self, pid, seen)
            existing = await self.store.get_process(pid)
            if (
                existing is not None
                and existing.owner == record.owner
                and await self.store.kv_get(pid, SPAWN_HANDLED_KEY) == run_id
            ):  # that spawn's first input was handled: the retry gets its answer, the hooks not run twice
                return Process(self, pid, Receipt(run_id, False, 0, handled=True))
        message = UserMessage(content=[TextContent(text=text), *blocks])
        hooks = self.engine.config.hooks
        out = await hooks.admit(message, mode="prompt", source="process.spawn", run_id=run_id, conversation=record.pid)
        if isinstance(out, Handled):
            if run_id is not None:  # (a retry of this spawn finds it: see above)
                kv = {**(kv or {}), SPAWN_HANDLED_KEY: run_id}
            await self.engine.create(record, kv, admit=admit)
            return Process(self, record.pid, Receipt(run_id or "", False, 0, handled=True))
        media = [b for b in out.content if isinstance(b, ImageContent | FileContent)]
        return out.text, media

    async def _retried_spawn(self, pid: str, owner: str, run_id: str | None) -> Receipt | None:
        """The receipt of the spawn ``run_id`` made of ``owner``'s process ``pid`` already, if one
        did: a retry gets it, and the process, again."""
        if run_id is None:
            return None
        existing = await self.store.get_process(pid)
        if existing is None or existing.owner != owner:
            return None
        return await admission.admitted(self.engine, pid, run_id)

    async def _tools_of(self, record: ProcessRecord) -> dict[str, Tool]:
        """The tools a run of ``record`` is offered before its scope: the kernel's, through its
        toolsets (the owner's MCP servers, devices, skills...)."""
        engine = self.engine
        tools: Mapping[str, Tool] = engine.config.tools
        if engine.toolset is not None:
            tools = await maybe_await(engine.toolset(record, tools))
        return dict(tools)

    async def _narrow_descendants(self, record: ProcessRecord, scope: list[str] | None) -> None:
        """Narrow every descendant of ``record`` (``tree.children``, from the top down) to ``scope``,
        ``record``'s new one: each one's stored scope becomes its own within its parent's new one
        (``intersection``; none stored, the parent's), each written as a change of its own
        (``set_tools``: its watchers are told), deepest first, so a failure part-way leaves every
        one within its parent's scope; read from its next run on (a run under way keeps its
        tools). A scope already within is left as it is: widening a parent widens none of them."""
        if scope is None:
            return
        changed: dict[str, list[str]] = {}
        seen, level = {record.pid}, [(record, scope)]
        while level:
            below: list[tuple[ProcessRecord, list[str]]] = []
            for parent, within in level:
                for child in await tree.children(self, parent):
                    if child.pid in seen:  # (a pid reused further up: never loop)
                        continue
                    seen.add(child.pid)
                    row = await self.store.kv_get(child.pid, TOOLS_KEY)
                    own = list(row) if isinstance(row, list) else None
                    narrowed = intersection(own, within, await self._tools_of(child)) or []
                    if narrowed != own:
                        changed[child.pid] = narrowed
                    below.append((child, narrowed))
            level = below
        for pid in reversed(changed):  # (deepest first: each one's new scope is within its parent's old one)
            try:
                await self.engine.set_tools(pid, changed[pid])
            except NoSuchProcess:  # (killed since the tree was read: nothing to narrow)
                continue

    async def _checked_scope(self, record: ProcessRecord, scope: list[str] | None) -> list[str] | None:
        """``scope`` for process ``record``, checked: its names name tools it has, and a child's
        stays within its parent's (None there: the parent's, checked when that was set)."""
        parent: list[str] | None = None
        if record.parent_pid is not None:
            row = await self.store.kv_get(record.parent_pid, TOOLS_KEY)
            parent = list(row) if isinstance(row, list) else None
        if scope is None:
            return parent
        available = await self._tools_of(record)
        unknown = unknown_entries(scope, available)
        if unknown:
            raise ToolScopeError(
                f"no tool named {', '.join(map(repr, unknown))} (tools: {', '.join(sorted(available)) or 'none'};"
                f" an MCP server's: mcp:<server>; a pattern: github__*)",
                available,
            )
        wider = widening(scope, parent, available)
        if wider:
            raise ToolScopeError(
                f"{', '.join(map(repr, wider))} would widen the parent's tool scope ({', '.join(parent or ())}):"
                " a subagent may narrow it, never widen it",
                parent or (),
            )
        return scope

    async def _check_parent(self, parent_pid: str, owner: str) -> None:
        """A child is spawned under a live process of its own owner: the tree (kill, the approvals a
        parent answers for its subagents) looks for children among the owner's processes only,
        so a child of another owner would neither die with its parent nor be answered through it."""
        parent = await self.store.get_process(parent_pid)
        if parent is None or parent.state == "killed":
            raise NoSuchProcess(parent_pid)
        if parent.owner != owner:
            raise ValueError(f"parent {parent_pid} is not {owner!r}'s: a child has its parent's owner")

    async def fork(
        self,
        pid: str,
        *,
        at: int | None = None,
        segment: str | None = None,
        context: str | None = None,
        admit: Admit | None = None,
        new_pid: str | None = None,
    ) -> Process:
        """A new top-level process from process ``pid``'s conversation (kernel/fork.py): its owner,
        ``run_as``, ``cwd``, ``interactive``, title, settings (mode, own model, tool scope, compaction policy)
        and ``context`` (unless another is given), and a copy of its current history up to and
        including message id ``at`` (None: all of it) or of its archived ``segment``, the media
        those messages reference copied with them; ``forked_from`` in its kv says where it came
        from. It starts idle: a run under way in ``pid`` is not copied. An ``at`` that is not a
        message of the history, or ends inside a tool call batch, is a ``ValueError`` (naming the
        nearest valid points); so are ``at`` and ``segment`` together. ``NoSuchProcess``,
        ``NoSuchSegment`` for what is not there. ``admit`` as in ``spawn`` (a quota). ``new_pid``
        names the fork: asked again, the call answers with the fork it made (a retry is safe)."""
        made = await fork_process(self, pid, at=at, segment=segment, context=context, admit=admit, new_pid=new_pid)
        return Process(self, made)

    async def process(self, pid: str) -> Process:
        if await self.store.get_process(pid) is None:
            raise NoSuchProcess(pid)
        return Process(self, pid)

    @property
    def off_limits(self) -> tuple[Path, ...]:
        """What tools may not touch whatever the policy says (the database, the accounts' homes,
        archives and media): for an agent outside any process to keep off them too."""
        return self.engine.config.off_limits

    async def processes(self, owner: str | None = None) -> list[ProcessRecord]:
        """The processes of ``owner`` (every one with None), each with its ``title``."""
        records = await self.store.list_processes(owner)
        titles = await self.titles.of_owner(owner)
        for record in records:
            record.title = titles.get(record.pid)
        return records

    async def usage(self, owner: str) -> UsageTotals:
        """What ``owner``'s processes have spent over their finished runs, killed ones included
        (a kill adds a process's totals to its owner's before it deletes the process)."""
        return await self.store.account_usage(owner)

    async def approvals(self, owner: str) -> list[HilRow]:
        """The pending approval requests of every live process of ``owner``, oldest first: one
        inbox, since a run nobody follows (a schedule's, a watch's, a subagent's) may ask too."""
        return await self.store.account_hils(owner)

    async def approval_audit(
        self,
        owner: str,
        *,
        limit: int = 100,
        pid: str | None = None,
        since: float | None = None,
        decision: str | None = None,
        by: str | None = None,
        before: str | None = None,
    ) -> list[ApprovalAuditRow]:
        """``owner``'s approvals audit, newest first: every decision about a call the policy put
        to a person (answered, timed out, or in a process that could not ask) or refused, kept
        after the process is killed or reset. Filtered by process ``pid``, decided at or after
        ``since`` (epoch seconds), ``decision`` (``AUDIT_DECISIONS``), the account that answered
        (``by``); paged with ``before``, the last id of the page before. ``ValueError`` for a bad
        filter, or a ``limit`` outside 1..``MAX_AUDIT_PAGE``."""
        _check_audit_filters(limit, since, decision, before)
        return await self.store.approval_audit(
            owner, limit=limit, pid=pid, since=since, decision=decision, answered_by=by, before=before
        )

    async def account_seq(self, owner: str) -> int:
        """The account seq of ``owner``'s newest logged account signal (0: none yet): where an
        account stream opened now starts, to resume from before anything reached it."""
        return await self.store.last_account_seq(owner)

    async def account_signals(
        self, owner: str, after_seq: int | None = None, *, follow: bool = True
    ) -> AsyncGenerator[AccountSignal, None]:
        """The approvals asked and answered and the runs ended of every process of ``owner``
        (``signals.for_account``), each with its account seq (``AccountSignal.seq``: per owner,
        gapless, in commit order). With ``after_seq``, first those the account log holds after
        it, then (with ``follow``) live ones, with none missed or repeated at the seam; without,
        live ones from the first ``__anext__`` on. An ``after_seq`` past the log's end counts from
        the end; one before the oldest kept is first sent an unlogged ``account.log.pruned``
        (``signals.ACCOUNT_LOG_PRUNED``: read the approvals inbox again). New titles come live
        only (no account seq). On a shared store (PostgreSQL), the signals committed through the
        other workers too (``Leases.accounted``): one whose notification was lost or overtaken is
        read from the account log before the one after it. Ends when the kernel closes, or when
        the reader falls too far behind (it resumes from its last account seq)."""
        if after_seq is not None:
            _check_position("after_seq", after_seq, 0)
        hub = self.engine.hub
        queue = hub.watch_account(owner) if follow else None  # first, then the log: nothing falls between
        try:
            newest = await self.store.last_account_seq(owner)
            last = newest if after_seq is None else min(after_seq, newest)
            async for logged in self._account_logged(owner, last):
                last = logged.seq or last
                yield logged
            if queue is None or self.engine.closing:  # (closed meanwhile: the hub ended its watchers)
                return
            hub.account_seen(owner, last)
            while (item := await queue.get()) is not None:
                if item.seq is None:  # (a new title: live only)
                    yield item
                    continue
                if item.seq <= last:
                    continue  # read from the log already
                if item.seq > last + 1:  # some did not reach this worker (yet): the log has them
                    async for logged in self._account_logged(owner, last, before=item.seq):
                        last = logged.seq or last
                        yield logged
                last = item.seq
                yield item
        except StoreError:
            # the kernel closed under a read of the account log (a long backlog, a gap being
            # filled): the stream ends, as a live one does when the kernel closes, rather than
            # failing with a store that is gone
            if not self.engine.closing:
                raise
        finally:
            if queue is not None:
                hub.unwatch_account(owner, queue)

    async def _account_logged(
        self, owner: str, after_seq: int, *, before: int | None = None
    ) -> AsyncIterator[AccountSignal]:
        """The owner's account log after ``after_seq`` (and before ``before``), a page at a time,
        each page led by ``account.log.pruned`` if it does not start right after ``after_seq``.
        The account log is gapless and never reset, so a hole can only be pruning: before the
        first page (a resume point older than what is kept, 0 included: a stream opened on an
        empty log said ``id: 0``), or between two pages (pruned while this read them)."""
        while True:
            page = await self.store.account_events(owner, after_seq=after_seq, limit=500)
            if page and page[0].seq > after_seq + 1:
                payload = {"afterSeq": after_seq, "oldestSeq": page[0].seq, "missed": page[0].seq - after_seq - 1}
                yield AccountSignal(None, Signal(sig.ACCOUNT_LOG_PRUNED, payload))
            for row in page:
                if before is not None and row.seq >= before:
                    return
                after_seq = row.seq
                yield AccountSignal.logged(row)
            if len(page) < 500:
                return

    async def signal(self, pid: str, text: str, *, run_id: str | None = None) -> Receipt:
        """Inject a system event into a process (ahead of queued user input). Retrying with the
        same ``run_id`` returns the first receipt and delivers once."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("text must be a non-empty string")
        check_unicode(text, "text")
        _check_run_id(run_id)
        if run_id is not None and run_id.endswith(admission.BOUND_SUFFIX):
            # (a reset would take it for a delegate's reply to the conversation it ends, and drop it)
            raise ValueError(f"run_id must not end with {admission.BOUND_SUFFIX!r}: delegate replies use such ids")
        return await self.engine.signal_event(pid, text, run_id=run_id)

    async def note(self, pid: str, text: str, *, note_id: str | None = None) -> bool:
        """Record ``text`` in the process's history as a system message (kind ``event``) that
        starts no run, unlike ``signal``: something that happened outside the conversation which
        the model reads with its next turn and a reader of the history sees (a chat bridge's
        answer that never reached the chat), but which asks for no answer of its own. Only while
        idle (``RunActive`` otherwise: amid a run's turns it would be input the run takes another
        model call for), ``ProcessBusy`` while another worker holds the process. ``note_id``
        makes it idempotent: a note already recorded under that id is not recorded again
        (False), checked in the transaction that records it."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("text must be a non-empty string")
        check_unicode(text, "text")
        if note_id is not None:
            if not isinstance(note_id, str) or not note_id or len(note_id) > 2 * MAX_RUN_ID:
                # (room for a run id and what the caller says of it: "undelivered:<run id>")
                raise ValueError(f"note_id must be a non-empty string of at most {2 * MAX_RUN_ID} characters")
            check_plain_text(note_id, "note_id")
        key = f"noted:{note_id}" if note_id is not None else None
        async with self.engine.held_idle(pid, "note") as live, self.engine._tx(live) as tx:
            if key is not None:
                if await self.store.kv_get(pid, key) is not None:
                    return False
                await self.store.kv_set(pid, key, True)
            await tx.append(None, [system(text, "event")])
            await tx.signal(sig.CHANGED, changes=["messages"])
        return True

    # -- schedules (see kernel/schedules.py) ------------------------------------------------------

    async def schedule(
        self,
        pid: str,
        text: str,
        *,
        at: float | None = None,
        every: float | None = None,
        name: str | None = None,
        cron: str | None = None,
        tz: str | None = None,
    ) -> str:
        """Deliver ``text`` to the process as a system event at ``at`` (epoch seconds) and/or every
        ``every`` seconds, or at the times ``cron`` names in time zone ``tz`` (UTC by default);
        returns the schedule's id. ``ScheduleError`` for a bad time, interval, expression or zone,
        ``NoSuchProcess`` for an unknown pid."""
        return (await self.scheduler.add(pid, text, at=at, every=every, name=name, cron=cron, tz=tz)).id

    async def schedules(self, pid: str) -> list[ScheduleRow]:
        """The process's schedules, soonest first."""
        return await self.scheduler.of(pid)

    async def unschedule(self, pid: str, schedule_id: str) -> bool:
        """Delete a schedule; False if the process has none by that id."""
        return await self.scheduler.remove(pid, schedule_id)

    # -- signal watches (see kernel/watches.py) ---------------------------------------------------

    async def watch(self, pid: str, source_pid: str, signal: str = sig.RUN_FINISHED, *, once: bool = True) -> str:
        """Tell ``pid`` (as a system event) when ``source_pid`` logs ``signal``; returns the watch's
        id. Both must have the same owner (``PermissionError``); a process cannot watch itself, and
        a repeating watch cannot close a loop (``WatchError``)."""
        return (await self.watchers.add(pid, source_pid, signal, once=once)).id

    async def watches(self, pid: str) -> list[WatchRow]:
        """The watches the process holds."""
        return await self.watchers.of(pid)

    async def unwatch(self, pid: str, watch_id: str) -> bool:
        """Delete a watch; False if the process holds none by that id."""
        return await self.watchers.remove(pid, watch_id)

    async def _run_aborted(self, pid: str, run_id: str, reason: str) -> None:
        """The engine's ``aborted`` hook: the subagents the run started stop with it (tree.py)."""
        await tree.run_aborted(self, pid, run_id, reason)

    async def _drop_subscriptions(self, pid: str) -> Callable[[], None]:
        """Delete the schedules and watches the process set up (inside the caller's transaction);
        returns what to do once that commits."""
        await self.scheduler.drop(pid)
        dropped = await self.watchers.drop(pid)
        # and the events they delivered that wait in the queue: another worker (its schedules duty,
        # its copy of a watched source) cannot see a reset under way here, and what it queued
        # meanwhile would otherwise start the fresh conversation (see ``ProcessEngine.clear``)
        for item in await self.store.queue(pid):
            if item.kind == "system" and (item.run_id or "").startswith((SCHEDULE_RUN_PREFIX, WATCH_RUN_PREFIX)):
                await self.store.dequeue(pid, item.id)
        return lambda: self.watchers.forget(dropped)

    async def _clear(self, pid: str, *, kill: bool, archive: bool, above: frozenset[str] = frozenset()) -> Path | None:
        """Reset or kill (``above``: the pids a kill came down from, see tree.py). From its abort
        to its last commit the process is idle, yet not to be started: input for it waits."""
        async with self.engine.clear(pid):
            return await self._clear_held(pid, kill=kill, archive=archive, above=above)

    async def _clear_held(self, pid: str, *, kill: bool, archive: bool, above: frozenset[str]) -> Path | None:
        record = await self.store.get_process(pid)
        if record is None:
            raise NoSuchProcess(pid)
        self.titles.cancel(pid)  # (the title being made is the cleared conversation's)
        # the input the clearing discards (see ProcessEngine.clear), kept in its archive: it never ran
        upto = self.engine.discarding.get(pid, 0)
        dropped = {item.id: item.message for item in await self.store.queue(pid) if item.id <= upto}
        if kill:  # first, so that nothing a child logs while it is stopped reaches the process
            async with self.store.transaction():
                done = await self._drop_subscriptions(pid)
            done()
        await self.engine.abort(pid, reason="process.kill" if kill else "process.reset")
        if kill:

            async def kill_one(child: str, lineage: frozenset[str]) -> Path | None:
                return await self._clear(child, kill=True, archive=archive, above=lineage)

            await tree.kill_children(self, record, kill_one, above)
            async with self.store.transaction():
                # Under the process's row lock, taken first: input another worker queues for it
                # from now on finds no process, and what it queued before is read here and kept
                # in the archive, instead of being deleted with the process after a receipt.
                await self.store.update_process(pid)  # NoSuchProcess: another kill came first
                history = [m.message for m in await self.store.history(pid)]
                dropped.update((item.id, item.message) for item in await self.store.queue(pid))
                queued = await self._discarded(pid, dropped)
                path = await self._archive(record, "kill", history, queued) if archive else None
                await self.store.delete_process(pid)  # with its schedules and every watch naming it
            self.media.delete_process(record.owner, pid)
            self.watchers.forget(killed=pid)
            await self.engine.forget(pid)
            return path

        await tree.stop_descendants(self, record)
        # before anything is archived or deleted: a reset given up after that would leave the
        # history it keeps without its images
        if self.engine.leases is not None and not await self.engine.leases.hold(pid):
            raise ProcessBusy(pid, "reset")
        stored = await self.store.history(pid)
        history = [m.message for m in stored]
        queued = await self._discarded(pid, dropped)
        path = await self._archive(record, "reset", history, queued) if archive else None
        self.media.delete_process(record.owner, pid)

        # Reset drops the schedules and watches the process set up: they belong to the
        # conversation being archived, and an event about it would reach a process that no
        # longer knows why it asked. Watches on it stay: its watchers still follow it.
        async def also() -> Callable[[], None]:
            await record_reset(self.store, self.data_dir, record, stored, path)  # (its segment row)
            retitled = await self.titles.forget_automatic(record)  # (the fresh conversation earns its own)
            dropped = await self._drop_subscriptions(pid)

            def done() -> None:
                dropped()
                retitled()

            return done

        await self.engine.reset(pid, also=also)
        if self.engine.memory is not None and history and not self._closing:
            task = asyncio.create_task(self._remember(record, history), name=f"memories of {pid}")
            self._remembering.add(task)
            task.add_done_callback(self._remembering.discard)
        return path

    async def _kill_if_idle(self, pid: str, *, since: float, archive: bool) -> Path | None:
        """Kill the process with everything below it only if all of it has been idle since
        ``since``, decided in the transaction that deletes them (``StillActive`` otherwise, with
        nothing done): input that reached one of them during a sweep must never get a receipt and
        then see its run aborted. Each is held first as a kill holds it (``engine.clear``): this
        worker's input for any of them waits for the decision, then finds the process, or none;
        another worker's committed before the look, or waits for the transaction's end
        (``Store.idle_processes`` with ``pids`` locks their rows). An idle process has no run to
        abort, no queued input, schedule or watch: what is left of a kill is the archive and the
        deletes, deepest first, as a kill goes."""
        record = await self.store.get_process(pid)
        if record is None:
            raise NoSuchProcess(pid)
        tree = await self._subtree(record)
        busy = next((member.pid for member in tree if member.pid in self.engine.clearing), None)
        if busy is not None:  # (a compaction or clearing holds it: at work; holding the others meanwhile
            raise StillActive(pid, busy)  # would keep their input waiting for a kill that cannot be)
        async with AsyncExitStack() as held:
            for member in tree:  # (top-down, in the order a kill takes them)
                await held.enter_async_context(self.engine.clear(member.pid, if_idle=True))
            path = await self._delete_idle(tree, since, archive)
            for member in tree:
                self.titles.cancel(member.pid)
                self.media.delete_process(member.owner, member.pid)
                self.watchers.forget(killed=member.pid)
                await self.engine.forget(member.pid)
        return path

    async def _subtree(self, record: ProcessRecord) -> list[ProcessRecord]:
        """``record`` and the live processes below it, each before its children (a child has its
        parent's owner)."""
        below: dict[str, list[ProcessRecord]] = {}
        for other in await self.store.list_processes(record.owner):
            if other.parent_pid is not None and other.state != "killed":
                below.setdefault(other.parent_pid, []).append(other)
        tree: list[ProcessRecord] = []
        seen: set[str] = set()
        todo = [record]
        while todo:
            member = todo.pop()
            if member.pid in seen:  # (a cycle cannot be made, but a walk must end whatever the rows say)
                continue
            seen.add(member.pid)
            tree.append(member)
            todo.extend(below.get(member.pid, ()))
        return tree

    async def _delete_idle(self, tree: list[ProcessRecord], since: float, archive: bool) -> Path | None:
        """``_kill_if_idle``'s one transaction: the look, then the archives and deletes; the root's
        archive. A child made since the tree was read is activity too."""
        root = tree[0]
        pids = [member.pid for member in tree]
        async with self.store.transaction():
            idle = {r.pid: r for r in await self.store.idle_processes(since, pids)}
            for pid in pids:
                jobs = self.engine.has_background(pid) or await self.store.kv_get(pid, JOBS_KEY)
                if pid not in idle or jobs:
                    raise StillActive(root.pid, pid)
            grown = {member.pid for member in await self._subtree(idle[root.pid])} - set(pids)
            if grown:
                raise StillActive(root.pid, min(grown))
            path = None
            for member in reversed(tree):  # (children before their parent)
                record = idle[member.pid]
                history = [m.message for m in await self.store.history(record.pid)]
                queued = await self._discarded(record.pid, {})  # (what a failed clearing set aside)
                path = await self._archive(record, "kill", history, queued) if archive else None
                await self.store.delete_process(record.pid)
        return path

    async def _discarded(self, pid: str, queued: dict[int, Message]) -> list[Message]:
        """The input a reset or kill of ``pid`` discards, oldest first: ``queued`` (by queue item
        id, read before its abort) and what the run's abort already took out of the queue, set
        aside in the abort's commit (``ProcessEngine._discard_queue``), by this clearing or by one
        that failed before its archive was written. Its archive is that input's only copy: the
        row is let go only in the commit after the archive (a kill's deletes it with the process)."""
        everything = {**discarded_messages(await self.store.kv_get(pid, DISCARDED_KEY)), **queued}
        return [everything[item_id] for item_id in sorted(everything)]

    async def _archive(
        self, record: ProcessRecord, reason: str, history: list[Message], queued: list[Message]
    ) -> Path | None:
        """Keep what a reset or kill clears: the history, and the queued input that never ran
        (under the header's ``meta.queued``, with a note: ``archive.queued_meta``). None when there
        was nothing to keep."""
        if not history and not queued:
            return None
        meta: dict[str, Any] = {"reason": reason, **queued_meta(reason, queued)}
        name = f"{reason}-{record.history_generation}-{new_id()}"
        return await asyncio.to_thread(write_archive, self.data_dir, record.owner, record.pid, name, history, meta)

    async def _remember(self, record: ProcessRecord, history: list[Message]) -> None:
        """Keep what is worth remembering of a conversation a reset cleared, in the daily memory
        file (as a compaction does for the part it folds away). In the background: the reset
        does not wait for a model call; a failure is logged and loses only the memories. What the
        model call spent is added to the process's usage totals (``ProcessEngine.add_usage``: no
        run counted); nothing once the process is killed."""
        engine = self.engine
        try:
            memories, spent = await extract_memories((await engine.effective_config(record)).model, history)
        except Exception as exc:
            log.warning("process %s: the memories of the reset conversation were not kept: %s", record.pid, exc)
            return
        try:
            await engine.add_usage(record.pid, spent)
        except Exception as exc:
            log.warning("process %s: the memory model's call was not counted: %s", record.pid, exc)
        try:
            if memories and engine.memory is not None:
                await engine.memory(record, memories, "a conversation cleared by a reset")
        except Exception as exc:
            log.warning("process %s: the memories of the reset conversation were not kept: %s", record.pid, exc)

    async def _sweep_media(self) -> None:
        """Remove media left behind by processes that are gone (``MediaStore.settled_dirs``)."""
        settled = await asyncio.to_thread(self.media.settled_dirs)
        gone = [(owner, pid) for owner, pid in settled if await self.store.get_process(pid) is None]
        for owner, pid in gone:
            try:
                await asyncio.to_thread(self.media.delete_process, owner, pid)
            except (OSError, ValueError) as exc:  # (a name no process could have, or an unreadable file)
                log.warning("could not remove the media left by process %s: %s", pid, exc)
        if gone:
            log.info("removed the media of %d processes that no longer exist", len(gone))

    async def _finish_remembering(self) -> None:
        """On close: give the memories being kept a moment to be written, then stop."""
        self._closing = True
        if self._remembering:
            _, late = await asyncio.wait(set(self._remembering), timeout=REMEMBER_GRACE)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)


def _check_audit_filters(limit: int, since: float | None, decision: str | None, before: str | None) -> None:
    """``ValueError`` naming the first bad filter of ``Kernel.approval_audit``."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_AUDIT_PAGE:
        raise ValueError(f"limit must be a whole number from 1 to {MAX_AUDIT_PAGE}, got {limit!r}")
    if since is not None and (isinstance(since, bool) or not isinstance(since, int | float) or not 0 <= since < 1e11):
        raise ValueError(f"since must be a time in epoch seconds, got {since!r}")
    if decision is not None and decision not in AUDIT_DECISIONS:
        raise ValueError(f"decision must be one of {', '.join(AUDIT_DECISIONS)}; got {decision!r}")
    if before is not None and not AUDIT_ID.fullmatch(before):
        raise ValueError(f"before must be the id of an audit entry (the next_before of a page), got {before!r}")
