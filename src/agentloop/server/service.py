"""The process operations every transport offers (HTTP ``/v1``, WebSocket ``/v1/ws``), checked
against the caller, with the JSON shapes they answer.

HTTP and WebSocket are two spellings of the same calls, so the rules live here once: who may see
a process (its owner and admins; to anyone else it does not exist, so a stranger cannot probe
pids), what a valid argument is, and which ``ApiError`` a failure becomes. Transports only parse
their framing and serialise what comes back.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, get_args

from agentloop.images import image_size, sniff_image
from agentloop.kernel import Kernel, NoSuchProcess, Process
from agentloop.kernel.budget import MonthlyBudget
from agentloop.kernel.fork import FORKED_KEY
from agentloop.kernel.schedules import MAX_TEXT as MAX_SCHEDULE_TEXT
from agentloop.kernel.schedules import LimitReached, ScheduleError
from agentloop.kernel.segments import NoSuchSegment, Segment, SegmentPage
from agentloop.kernel.watches import WatchError
from agentloop.loop.hooks import InputRejected
from agentloop.loop.output import output_schema_of
from agentloop.loop.state import Mode, check_mode
from agentloop.messages import FILE_TYPES, FileContent, ImageContent, check_plain_text, message_to_dict
from agentloop.models.registry import catalog, names_a_file
from agentloop.process import admission
from agentloop.process.api import Compacted, Receipt, RunActive, RunNotCurrent, SendMode
from agentloop.process.audio_video import (
    AudioContent,
    InputMedia,
    TranscriptionFailed,
    VideoContent,
    audio_type,
    video_type,
)
from agentloop.process.compaction import CompactionError
from agentloop.process.engine import Admit
from agentloop.process.media import MediaError, MediaTooLarge
from agentloop.process.pressure import check_policy, context_of
from agentloop.process.signals import AccountSignal, Signal
from agentloop.process.store import (
    MAX_SEQ,
    HilRow,
    ProcessBusy,
    ProcessRecord,
    QueueItem,
    ScheduleRow,
    StoredMessage,
    StoreError,
    WatchRow,
)
from agentloop.process.store.base import ApprovalAuditRow, QueueKind
from agentloop.process.tool_scope import ToolScopeError, check_scope
from agentloop.server.auth import Principal
from agentloop.server.errors import ApiError, safe_message
from agentloop.server.ratelimit import InputRate
from agentloop.server.strict_json import too_deep

MODES: tuple[str, ...] = get_args(SendMode)
QUEUE_KINDS: tuple[str, ...] = get_args(QueueKind)
RUN_MODES: tuple[str, ...] = get_args(Mode)
IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
MEDIA_TYPES = (*IMAGE_TYPES, *FILE_TYPES)  # besides audio/* (transcribed) and video/* (described)
NO_TRANSCRIBER = (
    "audio needs a transcription model: start the server with --transcribe-model (openai:whisper-1, for one; "
    "or the config file's transcribe_model)"
)
MAX_TEXT = 200_000
MAX_CONTEXT = 64_000
MAX_HISTORY_PAGE = 500
MAX_INSTRUCTIONS = 20_000  # characters of a compaction's instructions (``kernel.MAX_INSTRUCTIONS``)


def process_json(record: ProcessRecord) -> dict[str, Any]:
    run = record.current_run
    return {
        "pid": record.pid,
        "title": record.title,
        "owner": record.owner,
        "state": record.state,
        "cwd": record.cwd,
        "interactive": record.interactive,
        "context": record.context,
        "parent_pid": record.parent_pid,
        "run_id": run["run_id"] if run else None,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
        "usage": record.usage.as_dict(),
    }


def message_json(stored: StoredMessage) -> dict[str, Any]:
    return {"id": stored.id, "run_id": stored.run_id, "message": message_to_dict(stored.message)}


# JSON nesting an ``output_schema`` may have (as a device tool's schema: ``devices.MAX_SCHEMA_DEPTH``).
# Checking a schema, and later the answers against it, recurses a few Python frames per level: one
# nested ~150 deep, well within the 64 KiB limit, ran out of stack and answered 500.
MAX_SCHEMA_DEPTH = 64


def _output_schema(schema: Any) -> dict[str, Any] | None:
    """An input's ``output_schema``, checked as the kernel checks it: a 400 for one that is not a
    valid JSON Schema object (or is larger than ``MAX_SCHEMA_BYTES`` as JSON, or nested deeper
    than ``MAX_SCHEMA_DEPTH``)."""
    if schema is None:
        return None
    if not isinstance(schema, dict):
        raise ApiError(400, "invalid_request", "output_schema must be a JSON Schema object")
    if too_deep(schema, MAX_SCHEMA_DEPTH):
        raise ApiError(400, "invalid_request", f"output_schema nests more than {MAX_SCHEMA_DEPTH} levels deep")
    try:
        return output_schema_of(schema)
    except ValueError as exc:
        raise ApiError(400, "invalid_request", str(exc)) from None
    except RecursionError:  # (a backstop: the depth limit above keeps well clear of it)
        raise ApiError(400, "invalid_request", "output_schema nests too deeply to be checked") from None


def _input_rejected(exc: InputRejected) -> ApiError:
    return ApiError(422, "input_rejected", safe_message(str(exc), "an input hook refused the input"))


def receipt_json(receipt: Receipt) -> dict[str, Any]:
    """The receipt on the wire; ``handled`` only when an input hook took the input (no run to follow)."""
    out: dict[str, Any] = {"run_id": receipt.run_id, "queued": receipt.queued, "position": receipt.position}
    if receipt.handled:
        out["handled"] = True
    return out


def signal_json(signal: Signal) -> dict[str, Any]:
    return {"signal": signal.signal, "payload": signal.payload, "seq": signal.seq}


def hil_json(row: HilRow) -> dict[str, Any]:
    data = asdict(row)
    return {
        k: data[k] for k in ("request_id", "run_id", "tool_call_id", "tool_name", "syscall", "args", "tags", "reason")
    }


def audit_json(row: ApprovalAuditRow) -> dict[str, Any]:
    """An approvals audit row as the API shows it: ``by`` for the column the store names
    ``answered_by`` (``by`` is a word of SQL), ``at`` for ``decided_at``."""
    return {
        "id": row.id,
        "account": row.owner,
        "pid": row.pid,
        "run_id": row.run_id,
        "request_id": row.request_id,
        "call_id": row.call_id,
        "tool_name": row.tool_name,
        "syscall": row.syscall,
        "args_digest": row.args_digest,
        "args_preview": row.args_preview,
        "tags": row.tags,
        "decision": row.decision,
        "remembered": row.remembered,
        "edited": row.edited,
        "by": row.answered_by,
        "at": row.decided_at,
    }


def schedule_json(row: ScheduleRow) -> dict[str, Any]:
    return {
        "id": row.id,
        "pid": row.pid,
        "text": row.text,
        "name": row.name,
        "next_due": row.next_due,
        "every": row.every,
        "cron": row.cron,
        "tz": row.tz,
        "created_at": row.created_at,
    }


def watch_json(row: WatchRow) -> dict[str, Any]:
    return {
        "id": row.id,
        "pid": row.pid,
        "source_pid": row.source_pid,
        "signal": row.signal,
        "once": row.once,
        "created_at": row.created_at,
    }


def queue_item_json(item: QueueItem) -> dict[str, Any]:
    """A waiting item: ``text`` to show, ``message`` whole (its media as references)."""
    return {
        "id": item.id,
        "kind": item.kind,
        "run_id": item.run_id,
        "text": item.message.text,
        "message": message_to_dict(item.message),
        "created_at": item.created_at,
    }


def compacted_json(done: Compacted) -> dict[str, Any]:
    return {
        "compacted": done.compacted,
        "note": done.note or None,
        "removed": done.removed,
        "tokens_before": done.tokens_before,
        "tokens_after": done.tokens_after,
        "archive": done.archive,
        "segment_id": done.segment_id,
    }


def segment_json(segment: Segment) -> dict[str, Any]:
    return {
        "id": segment.id,
        "kind": segment.kind,
        "reason": segment.reason,
        "created_at": segment.created_at,
        "generation": segment.generation,
        "messages": segment.messages,
        "archive": segment.archive,
    }


def segment_page_json(page: SegmentPage) -> dict[str, Any]:
    messages = [{"index": i, "message": message_to_dict(m)} for i, m in page.messages]
    return {"segment": segment_json(page.segment), "messages": messages, "next_before": page.next_before}


def _spawn_pid(account: str, run_id: str) -> str:
    """The pid of the process a spawn with this caller's ``run_id`` makes (the same on a retry)."""
    digest = hashlib.sha256(f"{account}\0{run_id}".encode()).hexdigest()[:20]
    return f"spawn-{digest}"


def _fork_pid(account: str, source: str, fork_id: str) -> str:
    """The pid of the fork of ``source`` this caller's ``fork_id`` makes (the same on a retry)."""
    digest = hashlib.sha256(f"{account}\0{source}\0{fork_id}".encode()).hexdigest()[:20]
    return f"fork-{digest}"


def _transcription_failed(exc: TranscriptionFailed) -> ApiError:
    """502: the transcription model failed (the audio was fine as far as the server can tell);
    nothing was delivered, so the same request may simply be sent again."""
    said = safe_message(str(exc), "the transcription failed")
    return ApiError(502, "transcription_failed", f"media: {said}; nothing was delivered")


def _not_found(pid: str) -> ApiError:
    return ApiError(404, "not_found", f"no such process {pid!r}")


def _check_plain(value: str | None, name: str) -> None:
    """400 unless ``value`` fits a text column of its own (``check_plain_text``: PostgreSQL's text
    refuses NUL, and the query failed with a 500). Checked for every store alike, so the answer
    does not depend on which one the server runs on."""
    if value is not None:
        try:
            check_plain_text(value, name)
        except ValueError as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None


def decode_media(items: list[Any]) -> list[InputMedia]:
    """``[{data: base64, mime_type, name?}]`` → image, document, audio (``audio/*``, or a generic
    type such as ``application/octet-stream`` with an audio file's name, as the library judges it:
    ``audio_type``; transcribed as it is delivered) and video (``video/*``, or a generic type with a
    video file's name, by the same rule: ``video_type``; delivered as a note of it) blocks, refusing
    other types (a document's content is checked when it is stored: ``MediaStore.check``)."""
    blocks: list[InputMedia] = []
    for i, item in enumerate(items):
        where = f"media[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, "invalid_request", f"{where} must be an object with data and mime_type")
        unknown = sorted(set(item) - {"data", "mime_type", "name"})
        if unknown:  # (as HTTP's model refuses it: a misspelt ``name`` is not silently dropped)
            raise ApiError(400, "invalid_request", f"{where}.{unknown[0][:64]}: unknown field")
        mime, data, name = item.get("mime_type"), item.get("data"), item.get("name", "")
        audio, video = audio_type(mime, name), video_type(mime, name)  # (a generic type's: by the name's suffix)
        if not isinstance(mime, str) or (mime not in MEDIA_TYPES and audio is None and video is None):
            known = ", ".join(MEDIA_TYPES)
            raise ApiError(
                400,
                "invalid_request",
                f"{where}.mime_type must be one of {known}, audio/* or video/* (an empty or generic type such as "
                "application/octet-stream is taken with an audio or video file's name, such as memo.ogg or clip.mp4)",
            )
        if not isinstance(data, str) or not data:
            raise ApiError(400, "invalid_request", f"{where}.data must be a base64 string")
        if not isinstance(name, str) or len(name) > 255:
            raise ApiError(400, "invalid_request", f"{where}.name must be a string of at most 255 characters")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "invalid_request", f"{where}.data is not valid base64") from None
        if audio is not None:
            blocks.append(AudioContent(data=data, mime_type=audio, name=name))
            continue
        if video is not None:
            blocks.append(VideoContent(data=data, mime_type=video, name=name))
            continue
        if mime in FILE_TYPES:
            blocks.append(FileContent(data=data, mime_type=mime, name=name))
            continue
        actual = sniff_image(raw)
        if actual != mime:
            what = "not a PNG, JPEG, GIF or WebP image" if actual is None else f"a {actual} image, not {mime}"
            raise ApiError(400, "invalid_request", f"{where}.data is {what}")
        if image_size(raw) is None:
            raise ApiError(400, "invalid_request", f"{where}.data is a damaged {mime} image: its header gives no size")
        blocks.append(ImageContent(data=data, mime_type=mime))
    return blocks


class ProcessService:
    """What a principal may do with processes on one kernel."""

    def __init__(
        self,
        kernel: Kernel,
        *,
        max_processes: int | None = None,
        inputs: InputRate | None = None,
        max_inputs_per_minute: int | None = None,
        budget: MonthlyBudget | None = None,
    ) -> None:
        self.kernel = kernel
        self.max_processes = max_processes  # per account, admins aside; None: no limit
        self._inputs = inputs if inputs is not None else InputRate()
        self.max_inputs_per_minute = max_inputs_per_minute  # per account, admins aside; None: no limit
        self.budget = budget  # per account and calendar month (UTC), admins aside; None: no budget

    @contextlib.asynccontextmanager
    async def _input(self, who: Principal, pid: str | None = None, run_id: str | None = None) -> AsyncIterator[None]:
        """Admit an input that may start a run around the block that delivers it: the budget, then
        the rate (``_check_input``). When the block refuses it after all (media whose bytes are
        not what they say, found only when stored; the process quota, checked in the spawn's
        commit), the rate slot is given back: a refused request must not cost the account the
        inputs it may still send, nor turn its next good one into a 429."""
        counted = await self._check_input(who, pid, run_id)
        try:
            yield
        except Exception:
            if counted:
                self._inputs.give_back(who.account)
            raise

    async def _check_input(self, who: Principal, pid: str | None = None, run_id: str | None = None) -> bool:
        """The budget, then the rate, for an input that may start a run; not for a retry of one
        admitted already (``run_id``), which gets its first receipt however the account stands now.
        Whether a rate slot was taken (``_input`` gives it back if the input is refused later)."""
        if pid is not None and await admission.admitted(self.kernel.engine, pid, run_id) is not None:
            return False
        why = await self.budget.refusal(who.account, admin=who.admin) if self.budget is not None else None
        if why is not None:  # (``kernel/budget.py``: new input would start more)
            raise ApiError(402, "budget_spent", why)
        return self._take_input(who)

    def _take_input(self, who: Principal) -> bool:
        """Count an input that may start a run (a first message, a send, an event): 429 past the
        account's rate (see ratelimit.py). Checked once the request is known to be good, so a
        malformed one or one for another's process costs nothing; whether it was counted."""
        if who.admin or self.max_inputs_per_minute is None:
            return False
        self._inputs.take(who.account, self.max_inputs_per_minute)
        return True

    async def _process(self, who: Principal, pid: str) -> tuple[Process, ProcessRecord]:
        if "\x00" in pid:  # no process has one, and PostgreSQL fails a query naming it (_check_plain)
            raise _not_found(pid)
        record = await self.kernel.store.get_process(pid)
        if record is None or record.state == "killed" or not who.may_see(record.owner):
            raise _not_found(pid)
        return Process(self.kernel, pid), record

    async def spawn(
        self,
        who: Principal,
        *,
        context: str = "",
        interactive: bool = True,
        cwd: str | None = None,
        mode: str = "agent",
        model: str | None = None,
        reasoning: str | None = None,
        tools: list[str] | None = None,
        text: str | None = None,
        media: list[Any] | None = None,
        run_id: str | None = None,
        output_schema: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A new process owned by the caller (``tools``: its tool scope, as ``tools`` sets it).
        ``cwd`` is relative to the server's workspace and must
        stay inside it. ``text`` (with ``media`` and ``run_id``, as ``send`` takes them) starts its
        first run in the same commit; ``run_id`` then names that run. ``model`` and ``reasoning``
        are its own model choice (see ``model``); ``output_schema`` (with ``text``) as ``send``'s."""
        run_mode = _run_mode(mode)
        if model is not None or reasoning is not None:
            self._model_choice(model, reasoning)
        scope = _tool_scope(tools)
        _check_plain(context, "context")
        _check_plain(run_id, "run_id")
        blocks = None
        if text is not None:
            _check_text(text, empty_ok=bool(media))
            blocks = decode_media(media or [])
            self._check_audio(blocks)
        elif media or run_id is not None or output_schema is not None:
            raise ApiError(400, "invalid_request", "media, run_id and output_schema come with a first message (text)")
        output = _output_schema(output_schema)
        if len(context) > MAX_CONTEXT:  # it is sent with every model call, and listed with every process
            raise ApiError(413, "too_large", f"context is longer than {MAX_CONTEXT} characters")
        root = Path(self.kernel.engine.config.workspace or ".").resolve()  # noqa: ASYNC240 - no I/O wait
        where = root
        if cwd:
            bad_cwd = ApiError(400, "invalid_request", "cwd must name a directory inside the server's workspace")
            try:
                where = (root / cwd).resolve()
                inside = where.is_relative_to(root) and where.is_dir()
            except (OSError, ValueError, RuntimeError):  # a NUL byte, a name too long, a symlink loop
                inside = False
            if not inside:
                raise bad_cwd
        # With a run id the pid follows from it, so a retried request (its answer lost) finds the
        # process the first one made and gets its receipt instead of making a second one.
        pid = _spawn_pid(who.account, run_id) if run_id is not None else None
        new_input = text is not None and (pid is None or await self.kernel.store.get_process(pid) is None)
        try:
            async with self._input(who) if new_input else contextlib.nullcontext():
                proc = await self.kernel.spawn(
                    who.account,
                    cwd=where,
                    interactive=interactive,
                    context=context,
                    mode=run_mode,
                    model=model,
                    reasoning=reasoning,  # type: ignore[arg-type]
                    tools=scope,
                    text=text,
                    media=blocks or (),
                    run_id=run_id,
                    pid=pid,
                    admit=self._process_quota(who),
                    output_schema=output,
                )
        except StoreError:
            if pid is not None and await self.kernel.store.was_killed(pid):
                raise ApiError(409, "conflict", f"run_id {run_id!r} started a process that was killed since") from None
            if pid is None or await self.kernel.store.get_process(pid) is None:
                raise
            # the pid is taken by a process that no spawn with this run id made (a retry gets the
            # first one's receipt from the kernel)
            raise ApiError(409, "conflict", f"run_id {run_id!r} already started a process") from None
        except ToolScopeError as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None
        except MediaTooLarge as exc:
            raise ApiError(413, "too_large", f"media: {exc}") from None
        except MediaError as exc:
            raise ApiError(400, "invalid_request", f"media: {exc}") from None
        except TranscriptionFailed as exc:
            raise _transcription_failed(exc) from None
        except InputRejected as exc:  # an input hook failed: no process was made
            raise _input_rejected(exc) from None
        answer = await self._one(await proc.info())
        if proc.started is not None:  # (the run may have ended already: its id all the same)
            answer["run_id"] = proc.started.run_id
            if proc.started.handled:  # an input hook took the first input: the process has none
                answer["handled"] = True
        return answer

    def _process_quota(self, who: Principal) -> Admit | None:
        """The check a new process of the caller's passes in the transaction that stores it: 409
        past the live processes the server allows an account (admins have no limit). Only the
        top-level ones count, the account's conversations: the subagents their ``Task`` calls
        make are capped per parent (kernel/tasks.py) and retired once finished. Counted there,
        under a key of the account's, spawns through several workers at once cannot pass it
        together; a retried spawn, whose process exists already, never gets this far (it gets its
        receipt)."""
        limit, store = self.max_processes, self.kernel.store
        if limit is None or who.admin:
            return None

        async def admit() -> None:
            await store.exclusive(f"processes of {who.account}")
            live = await store.count_processes(who.account, top_level_only=True)  # this new one included
            if live > limit:
                raise ApiError(
                    409,
                    "conflict",
                    f"account {who.account} has {live - 1} processes, as many as this server allows; kill one first",
                )

        return admit

    async def list_processes(self, who: Principal) -> list[dict[str, Any]]:
        return [process_json(r) for r in await self.kernel.processes(owner=who.account) if r.state != "killed"]

    async def get(self, who: Principal, pid: str) -> dict[str, Any]:
        """One process, with how full its context is (``context_pressure``: ``Process.context``)."""
        record = (await self._process(who, pid))[1]
        record.title = await self.kernel.titles.of(pid)
        return await self._one(record)

    async def _one(self, record: ProcessRecord) -> dict[str, Any]:
        """A process as one is answered (a list leaves out the context: a row read per process)."""
        context = await context_of(self.kernel.engine, record)
        model = await self._model_json(Process(self.kernel, record.pid))
        return {**process_json(record), "context_pressure": context.as_dict(), "model": model}

    async def usage(self, who: Principal) -> dict[str, Any]:
        """What the caller's account has spent: its processes' totals, the killed ones' too."""
        return {"account": who.account, "usage": (await self.kernel.usage(who.account)).as_dict()}

    async def send(
        self,
        who: Principal,
        pid: str,
        text: str,
        *,
        mode: str = "steer",
        media: list[Any] | None = None,
        run_id: str | None = None,
        output_schema: dict[str, Any] | None = None,
        expected_run_id: str | None = None,
    ) -> dict[str, Any]:
        """Deliver input. ``output_schema`` (a JSON Schema) asks the run answering it for a value
        (``Process.send``): such input never joins a run under way; a bad schema is a 400.
        ``expected_run_id`` not the current run: 409 ``run_not_current``; ``mode="reject"`` while a
        run is active: 409 ``busy``; both with the process's ``current_run_id``, nothing delivered
        (nor counted against the input rate)."""
        if mode not in MODES:
            raise ApiError(400, "invalid_request", f"mode must be one of {', '.join(MODES)}")
        if expected_run_id is not None and mode == "reject":
            raise ApiError(400, "invalid_request", "expected_run_id names a run under way: not with mode reject")
        _check_text(text, empty_ok=bool(media))
        _check_plain(run_id, "run_id")
        output = _output_schema(output_schema)
        blocks = decode_media(media or [])
        proc, _ = await self._process(who, pid)
        self._check_audio(blocks)
        try:
            async with self._input(who, pid, run_id):
                receipt = await proc.send(
                    text,
                    mode,  # type: ignore[arg-type]
                    blocks,
                    run_id=run_id,
                    output_schema=output,
                    expected_run_id=expected_run_id,
                )
        except NoSuchProcess:
            raise _not_found(pid) from None
        except RunNotCurrent as exc:
            raise ApiError(409, "run_not_current", str(exc), about_run=True, current_run_id=exc.current) from None
        except RunActive as exc:  # (a reject: the caller asked for nothing while a run is under way)
            raise ApiError(409, "busy", str(exc), about_run=True, current_run_id=exc.run_id) from None
        except MediaTooLarge as exc:
            raise ApiError(413, "too_large", f"media: {exc}") from None
        except MediaError as exc:
            raise ApiError(400, "invalid_request", f"media: {exc}") from None
        except TranscriptionFailed as exc:
            raise _transcription_failed(exc) from None
        except InputRejected as exc:  # an input hook failed: nothing was written, the caller keeps the input
            raise _input_rejected(exc) from None
        return receipt_json(receipt)

    def _check_audio(self, blocks: list[InputMedia]) -> None:
        """400 for audio on a server without a transcriber, before the input is counted: the
        kernel would refuse it too, in words that name the library, not the server's flag."""
        if self.kernel.transcriber is None and any(isinstance(b, AudioContent) for b in blocks):
            raise ApiError(400, "invalid_request", NO_TRANSCRIBER)

    async def history(self, who: Principal, pid: str, *, limit: int = 100, before: int | None = None) -> dict[str, Any]:
        """A page of messages, oldest first, ending before message id ``before`` (the newest page by
        default); ``next_before`` pages further back, None at the start."""
        if not 1 <= limit <= MAX_HISTORY_PAGE:
            raise ApiError(400, "invalid_request", f"limit must be between 1 and {MAX_HISTORY_PAGE}")
        proc, _ = await self._process(who, pid)
        page = await proc.history(limit=limit + 1, before=before)
        more = len(page) > limit
        page = page[-limit:]
        return {"messages": [message_json(m) for m in page], "next_before": page[0].id if more and page else None}

    async def signals(
        self, who: Principal, pid: str, *, after_seq: int = 0, follow: bool = True
    ) -> AsyncIterator[Signal]:
        """The process's signals after ``after_seq`` (checked now, before the first one is read;
        on a shared store, with those another worker logged for it: ``Process.signals``)."""
        proc, _ = await self._process(who, pid)
        return proc.signals(after_seq=after_seq, follow=follow)

    async def mode(self, who: Principal, pid: str, mode: str | None = None) -> dict[str, Any]:
        """The process's mode, after setting it when ``mode`` is given (from its next run on)."""
        proc, _ = await self._process(who, pid)
        if mode is not None:
            await proc.set_mode(_run_mode(mode))
        return {"pid": pid, "mode": await proc.mode()}

    async def tools(self, who: Principal, pid: str, change: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The process's tool scope (``Process.tools``: null, every tool) and the names of the tools
        it could name (``available``), after replacing the scope when ``change`` is given (its
        ``tools``), from the next run on. A name it has no tool of, or one past its parent's
        scope, is a 400 listing the available ones, and changes nothing."""
        proc, _ = await self._process(who, pid)
        try:
            if change is not None:
                await proc.set_tools(_tool_scope(change.get("tools")))
            return {"pid": pid, "tools": await proc.tools(), "available": await proc.available_tools()}
        except ToolScopeError as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None
        except NoSuchProcess:
            raise _not_found(pid) from None

    async def model(self, who: Principal, pid: str, change: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The process's model choice (``Process.model``), after replacing it when ``change`` is
        given (its ``model`` and ``reasoning``; null: none), from the next run on. A choice that
        cannot be used is a 400 and changes nothing."""
        proc, _ = await self._process(who, pid)
        if change is not None:
            model, reasoning = change.get("model"), change.get("reasoning")
            self._model_choice(model, reasoning)
            try:
                await proc.set_model(model, reasoning=reasoning)
            except ValueError as exc:  # (checked above: the provider's key went meanwhile, say)
                raise ApiError(400, "invalid_request", str(exc)) from None
            except NoSuchProcess:
                raise _not_found(pid) from None
        return await self._model_json(proc)

    def models(self) -> dict[str, Any]:
        """The model catalog (``registry.catalog``) and the server's own model, shown as ``model``
        shows it (by its provider only when it names a file on the server)."""
        default = self.kernel.engine.config.model.name
        if names_a_file(default):
            default = f"{default.partition(':')[0]}:(a file on the server)"
        return {"models": catalog(), "default": default}

    async def _model_json(self, proc: Process) -> dict[str, Any]:
        """The process's model choice; a model the operator named by a file on the server (the
        default, an account's ``model.json``) is shown by its provider only: the path is theirs."""
        try:
            shown = {"pid": proc.pid, **(await proc.model()).as_dict()}
        except NoSuchProcess:
            raise _not_found(proc.pid) from None
        effective = shown.get("effective")
        if shown.get("source") != "process" and isinstance(effective, str) and names_a_file(effective):
            shown["effective"] = f"{effective.partition(':')[0]}:(a file on the server)"
        return shown

    def _model_choice(self, model: Any, reasoning: Any) -> None:
        """A 400 for a model choice the kernel refuses, or one that names a file on the server (a
        scripted model's replies, a local model's weights): only its operator may name those."""
        if isinstance(model, str) and names_a_file(model):
            raise ApiError(400, "invalid_request", f"model {model!r} names a file on the server: not over the API")
        try:
            self.kernel.models.check(model, reasoning)
        except ValueError as exc:
            raise ApiError(400, "invalid_request", safe_message(str(exc), "the model choice was refused")) from None

    async def compaction(self, who: Principal, pid: str, change: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The process's compaction policy, after replacing it when ``change`` is given (its
        ``threshold``, ``overflow``, ``keep_recent_tokens``; those left out take the defaults), from
        the next run on. ``default_threshold``: the kernel's, which applies while ``threshold`` is null."""
        proc, _ = await self._process(who, pid)
        if change is not None:
            try:
                policy = check_policy(
                    change.get("threshold"), change.get("overflow", "compact"), change.get("keep_recent_tokens")
                )
            except (TypeError, ValueError) as exc:
                raise ApiError(400, "invalid_request", str(exc)) from None
            await proc.set_compaction(policy.threshold, policy.overflow, policy.keep_recent_tokens)
        policy = await proc.compaction()
        return {"pid": pid, **policy.as_dict(), "default_threshold": self.kernel.engine.compaction_threshold}

    async def title(self, who: Principal, pid: str) -> dict[str, Any]:
        proc, _ = await self._process(who, pid)
        return {"pid": pid, "title": await proc.title()}

    async def set_title(self, who: Principal, pid: str, title: str | None) -> dict[str, Any]:
        """Name the process (``Process.set_title``; None clears the name): 400 for a title that is
        not one trimmed line of plain text of at most 120 characters with a visible character, and
        nothing changes."""
        proc, _ = await self._process(who, pid)
        try:
            title = await proc.set_title(title)
        except (TypeError, ValueError) as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None
        except NoSuchProcess:
            raise _not_found(pid) from None
        return {"pid": pid, "title": title}

    async def stop(self, who: Principal, pid: str, *, run_id: str | None = None) -> dict[str, Any]:
        proc, _ = await self._process(who, pid)
        return {"stopping": await proc.stop(run_id)}

    async def abort(self, who: Principal, pid: str, *, run_id: str | None = None) -> dict[str, Any]:
        proc, _ = await self._process(who, pid)
        return {"aborted": await proc.abort(run_id)}

    async def retry(self, who: Principal, pid: str, *, run_id: str | None = None) -> dict[str, Any]:
        """Run the model again where the last run ended without an answer (``Process.retry``): the
        receipt of the run it starts. Counted as input (it starts a run), a retry of one admitted
        already (its ``run_id``) not. 409 ``busy`` while a run is active, 409 ``nothing_to_retry``
        when the conversation ended with an answer: nothing done (nor counted) either way."""
        _check_plain(run_id, "run_id")
        proc, _ = await self._process(who, pid)
        try:
            async with self._input(who, pid, run_id):
                receipt = await proc.retry(run_id)
        except (RunActive, ProcessBusy) as exc:  # (first: a RunActive is a ValueError too)
            raise ApiError(409, "busy", str(exc), retry_after=1) from None
        except admission.NothingToRetry as exc:
            raise ApiError(409, "nothing_to_retry", str(exc)) from None
        except NoSuchProcess:  # killed by a request that raced this one
            raise _not_found(pid) from None
        return receipt_json(receipt)

    async def approvals(self, who: Principal, pid: str) -> list[dict[str, Any]]:
        proc, _ = await self._process(who, pid)
        # (a subagent's request is put to its conversation: answered here, it says whose it is)
        return [
            {**hil_json(r), **({"subagent": r.pid} if r.pid != pid else {})} for r in await proc.pending_approvals()
        ]

    async def account_approvals(self, who: Principal, account: str | None = None) -> list[dict[str, Any]]:
        """The pending approvals of all the caller's processes, each with its pid: one inbox. An
        admin may name another ``account``; anyone else naming one but their own gets a 403."""
        owner = account or who.account
        if owner != who.account and not who.admin:
            raise ApiError(403, "forbidden", "only an admin may list another account's approvals")
        _check_plain(owner, "account")
        return [{"pid": r.pid, **hil_json(r)} for r in await self.kernel.approvals(owner)]

    async def approval_audit(
        self,
        who: Principal,
        *,
        account: str | None = None,
        limit: int = 100,
        pid: str | None = None,
        since: float | None = None,
        decision: str | None = None,
        by: str | None = None,
        before: str | None = None,
    ) -> dict[str, Any]:
        """A page of the approvals audit of the caller's account (``Kernel.approval_audit``),
        newest first, with ``next_before`` to ask the next page with (null: this is the last). An
        admin may name another ``account``; anyone else naming one but their own gets a 403."""
        owner = account or who.account
        if owner != who.account and not who.admin:
            raise ApiError(403, "forbidden", "only an admin may read another account's approvals audit")
        for value, name in ((owner, "account"), (pid, "pid"), (by, "by")):
            _check_plain(value, name)
        try:
            rows = await self.kernel.approval_audit(
                owner, limit=limit, pid=pid, since=since, decision=decision, by=by, before=before
            )
        except ValueError as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None
        next_before = rows[-1].id if len(rows) == limit else None
        return {"entries": [audit_json(r) for r in rows], "next_before": next_before}

    async def account_signals(
        self, who: Principal, *, after_seq: int | None = None, follow: bool = True
    ) -> tuple[int, AsyncIterator[AccountSignal]]:
        """The caller's account stream (``Kernel.account_signals``): their own processes', admins'
        included, so that an admin's inbox is not every account's; after ``after_seq`` (an account
        seq), or from now on. Returned with where it starts: ``after_seq``, or the newest account
        seq now, which a client resumes from if it is cut off before any signal comes."""
        start = await self.kernel.account_seq(who.account) if after_seq is None else after_seq
        return start, self.kernel.account_signals(who.account, start, follow=follow)

    async def hil(
        self,
        who: Principal,
        pid: str,
        request_id: str,
        *,
        decision: str,
        remember: bool | str = False,
        message: str | None = None,
        arguments: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Answer a pending approval; ``message`` goes with deny, to the model, ``arguments`` and a
        ``remember`` scope with approve (see ``Process.hil``). The kernel checks them before
        touching anything, so a 400 leaves the request pending."""
        if decision not in ("approve", "deny"):
            raise ApiError(400, "invalid_request", "decision must be approve or deny")
        proc, _ = await self._process(who, pid)
        try:
            await proc.hil(
                request_id, decision, remember=remember, message=message, arguments=arguments, by=who.account
            )
        except KeyError:
            raise ApiError(404, "not_found", f"no pending approval {request_id!r} for process {pid!r}") from None
        except (TypeError, ValueError) as exc:  # the message, the arguments, the scope, the policy's refusal
            raise ApiError(400, "invalid_request", str(exc)) from None
        return {
            "request_id": request_id,
            "decision": decision,
            "remember": remember,
            **({"edited": True} if arguments is not None else {}),
        }

    async def reset(self, who: Principal, pid: str) -> dict[str, Any]:
        proc, _ = await self._process(who, pid)
        try:
            archived = await proc.reset()
        except ProcessBusy as exc:  # another worker would not let it go: nothing was done
            raise ApiError(409, "conflict", str(exc), retry_after=1) from None
        return {"pid": pid, "archived": archived is not None}

    async def compact(
        self,
        who: Principal,
        pid: str,
        *,
        instructions: str | None = None,
        keep_last: int | None = None,
        through: int | None = None,
        summary: str | None = None,
    ) -> dict[str, Any]:
        """Summarise the history now (``Process.compact``): by the compaction rules, or keeping the
        newest ``keep_last`` messages, or through message id ``through``; with the caller's
        ``summary`` (no model call) or the model's. ``compacted: false`` with a ``note`` when there
        was nothing worth compacting; 400 for bad options (both cuts, a summary with instructions,
        an empty or oversized summary, an id the history does not hold), 409 ``busy`` while a run
        is active and 502 when the summary could not be made, all leaving the history as it was."""
        if instructions is not None and len(instructions) > MAX_INSTRUCTIONS:
            raise ApiError(400, "invalid_request", f"instructions are longer than {MAX_INSTRUCTIONS} characters")
        _check_plain(instructions, "instructions")
        proc, _ = await self._process(who, pid)
        try:
            done = await proc.compact(instructions, keep_last=keep_last, through=through, summary=summary)
        except (RunActive, ProcessBusy) as exc:  # (first: a RunActive is a ValueError too)
            raise ApiError(409, "busy", str(exc), retry_after=1) from None
        except (TypeError, ValueError) as exc:  # the options: checked before anything was done
            raise ApiError(400, "invalid_request", str(exc)) from None
        except CompactionError as exc:
            raise ApiError(502, "compaction_failed", safe_message(str(exc), "the summary could not be made")) from None
        return compacted_json(done)

    async def rewind(self, who: Principal, pid: str, at: int) -> dict[str, Any]:
        """Cut the history back to message ``at`` (``Process.rewind``): 409 ``busy`` while a run is
        active (abort it first: a rewind never stops one), 400 for a point that is not one of the
        history's messages or ends inside a tool call batch (the message names valid ones)."""
        proc, _ = await self._process(who, pid)
        try:
            done = await proc.rewind(at)
        except (RunActive, ProcessBusy) as exc:  # (first: a RunActive is a ValueError too)
            raise ApiError(409, "busy", str(exc), retry_after=1) from None
        except NoSuchProcess:  # killed by a request that raced this one
            raise ApiError(404, "not_found", f"no such process {pid!r}") from None
        except (TypeError, ValueError) as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None
        return {"kept": done.kept, "removed": done.removed, "segment": done.segment}

    async def segments(self, who: Principal, pid: str) -> list[dict[str, Any]]:
        """What compactions, clearings and resets put away, oldest first."""
        proc, _ = await self._process(who, pid)
        return [segment_json(s) for s in await proc.segments()]

    async def segment(
        self, who: Principal, pid: str, segment_id: str, *, limit: int = 100, before: int | None = None
    ) -> dict[str, Any]:
        """A page of one segment's archived messages, as ``history`` pages the live ones; 404 for
        an unknown segment, or one whose archive is gone."""
        if not 1 <= limit <= MAX_HISTORY_PAGE:
            raise ApiError(400, "invalid_request", f"limit must be between 1 and {MAX_HISTORY_PAGE}")
        if before is not None and not 0 <= before <= MAX_SEQ:
            raise ApiError(400, "invalid_request", f"before must be an integer from 0 to {MAX_SEQ}")
        proc, _ = await self._process(who, pid)
        try:
            return segment_page_json(await proc.segment(segment_id, limit=limit, before=before))
        except NoSuchSegment as exc:
            raise ApiError(404, "not_found", str(exc)) from None

    async def fork(
        self,
        who: Principal,
        pid: str,
        *,
        at: int | None = None,
        segment: str | None = None,
        context: str | None = None,
        fork_id: str | None = None,
    ) -> dict[str, Any]:
        """A new process from this one's conversation (``Kernel.fork``): owned by the process's
        owner, counted against the caller's quota as a spawn is (409 past it). 400 for an ``at``
        that is not a message of the history or ends inside a tool call batch, for both ``at`` and
        ``segment``, for a clearing's segment; 404 for a segment the process has none by. With a
        ``fork_id`` the fork's pid follows from it, so a retried request gets the fork the first
        one made (409 once that fork was killed)."""
        _check_plain(context, "context")
        _check_plain(segment, "segment")
        _check_plain(fork_id, "fork_id")
        if context is not None and len(context) > MAX_CONTEXT:
            raise ApiError(413, "too_large", f"context is longer than {MAX_CONTEXT} characters")
        await self._process(who, pid)
        new_pid = _fork_pid(who.account, pid, fork_id) if fork_id is not None else None
        try:
            made = await self.kernel.fork(
                pid, at=at, segment=segment, context=context, admit=self._process_quota(who), new_pid=new_pid
            )
        except StoreError:
            if new_pid is None or not await self.kernel.store.was_killed(new_pid):
                raise
            raise ApiError(409, "conflict", f"fork_id {fork_id!r} made a fork that was killed since") from None
        except NoSuchSegment as exc:
            raise ApiError(404, "not_found", str(exc)) from None
        except NoSuchProcess:
            raise _not_found(pid) from None
        except ValueError as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None
        answer = await self._one(await made.info())
        answer["forked_from"] = await self.kernel.store.kv_get(made.pid, FORKED_KEY)
        return answer

    async def kill(self, who: Principal, pid: str) -> dict[str, Any]:
        proc, _ = await self._process(who, pid)
        archived = await proc.kill()
        return {"pid": pid, "killed": True, "archived": archived is not None}

    # -- runtime events ---------------------------------------------------------------------------

    async def signal(self, who: Principal, pid: str, text: str, *, run_id: str | None = None) -> dict[str, Any]:
        """Inject a system event (ahead of queued user input); a retried ``run_id`` delivers once."""
        _check_text(text)
        _check_plain(run_id, "run_id")
        await self._process(who, pid)
        try:
            async with self._input(who, pid, run_id):
                return receipt_json(await self.kernel.signal(pid, text, run_id=run_id))
        except NoSuchProcess:
            raise _not_found(pid) from None
        except ValueError as exc:  # a run id kept for the runtime's own events
            raise ApiError(400, "invalid_request", str(exc)) from None

    async def schedule(
        self,
        who: Principal,
        pid: str,
        text: str,
        *,
        at: float | None = None,
        every: float | None = None,
        name: str | None = None,
        cron: str | None = None,
        tz: str | None = None,
    ) -> dict[str, Any]:
        if len(text) > MAX_SCHEDULE_TEXT:
            raise ApiError(413, "too_large", f"text is longer than {MAX_SCHEDULE_TEXT} characters")
        await self._process(who, pid)
        with _refusals():
            row = await self.kernel.scheduler.add(pid, text, at=at, every=every, name=name, cron=cron, tz=tz)
        return schedule_json(row)

    async def schedules(self, who: Principal, pid: str) -> list[dict[str, Any]]:
        await self._process(who, pid)
        with _refusals():
            return [schedule_json(r) for r in await self.kernel.schedules(pid)]

    async def unschedule(self, who: Principal, pid: str, schedule_id: str) -> dict[str, Any]:
        await self._process(who, pid)
        with _refusals():
            removed = await self.kernel.unschedule(pid, schedule_id)
        if not removed:
            raise ApiError(404, "not_found", f"no schedule {schedule_id!r} on process {pid!r}")
        return {"id": schedule_id, "removed": True}

    async def watch(
        self, who: Principal, pid: str, source_pid: str, *, signal: str = "proc.run.finished", once: bool = True
    ) -> dict[str, Any]:
        """``pid`` is told when ``source_pid`` logs ``signal``; the caller must see both."""
        await self._process(who, pid)
        await self._process(who, source_pid)
        with _refusals():
            row = await self.kernel.watchers.add(pid, source_pid, signal, once=once)
        return watch_json(row)

    async def watches(self, who: Principal, pid: str) -> list[dict[str, Any]]:
        await self._process(who, pid)
        with _refusals():
            return [watch_json(r) for r in await self.kernel.watches(pid)]

    async def unwatch(self, who: Principal, pid: str, watch_id: str) -> dict[str, Any]:
        await self._process(who, pid)
        with _refusals():
            removed = await self.kernel.unwatch(pid, watch_id)
        if not removed:
            raise ApiError(404, "not_found", f"no watch {watch_id!r} on process {pid!r}")
        return {"id": watch_id, "removed": True}

    # -- the input queue --------------------------------------------------------------------------

    async def queue(self, who: Principal, pid: str) -> list[dict[str, Any]]:
        """The input waiting for the process, in the order it will be taken."""
        proc, _ = await self._process(who, pid)
        return [queue_item_json(i) for i in await proc.queued()]

    async def withdraw(
        self, who: Principal, pid: str, item_id: int | None = None, *, kind: str | None = None
    ) -> list[dict[str, Any]]:
        """Withdraw waiting input (``Process.withdraw``): one item, a kind, or all the user's. A
        named item that is not waiting (never was, or a run took it first) is a 404, so a client
        knows it was not withdrawn."""
        if item_id is not None and (isinstance(item_id, bool) or not 1 <= item_id <= MAX_SEQ):
            raise ApiError(400, "invalid_request", f"item_id must be an integer from 1 to {MAX_SEQ}")
        if kind is not None and kind not in QUEUE_KINDS:
            raise ApiError(400, "invalid_request", f"kind must be one of {', '.join(QUEUE_KINDS)}")
        proc, _ = await self._process(who, pid)
        withdrawn = await proc.withdraw(item_id, kind=kind)  # type: ignore[arg-type]
        if item_id is not None and not withdrawn:
            what = f"no waiting {kind} item {item_id}" if kind else f"no waiting item {item_id}"
            raise ApiError(404, "not_found", f"{what} on process {pid!r} (a run may have taken it)")
        return [queue_item_json(i) for i in withdrawn]


def _tool_scope(tools: object) -> list[str] | None:
    """A tool scope as a request gives it, checked for its form (its names: by the kernel)."""
    try:
        return check_scope(tools)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, "invalid_request", f"tools: {exc}") from None


def _run_mode(mode: str) -> Mode:
    try:
        return check_mode(mode)
    except ValueError:
        raise ApiError(400, "invalid_request", f"mode must be one of {', '.join(RUN_MODES)}") from None


def _check_text(text: str, *, empty_ok: bool = False) -> None:
    """A message or event text: not blank (unless images carry the message), not over the limit."""
    if not text.strip() and not empty_ok:
        raise ApiError(400, "invalid_request", "text must not be empty")
    if len(text) > MAX_TEXT:
        raise ApiError(413, "too_large", f"text is longer than {MAX_TEXT} characters")


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """What the kernel's schedules and watches refuse, as API errors. ``LimitReached`` first: it
    is a ``ValueError`` like the others. A process killed meanwhile is a 404, not a 500."""
    try:
        yield
    except LimitReached as exc:
        raise ApiError(409, "conflict", str(exc)) from None
    except (ScheduleError, WatchError) as exc:
        raise ApiError(400, "invalid_request", str(exc)) from None
    except PermissionError as exc:  # an admin pairing two owners' processes
        raise ApiError(403, "forbidden", str(exc)) from None
    except NoSuchProcess as exc:
        raise _not_found(exc.pid) from None
