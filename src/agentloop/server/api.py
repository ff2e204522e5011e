"""The ``/v1`` HTTP routes: parse and check the request, call ``ProcessService``, answer JSON.

Authorization and the process rules live in ``ProcessService`` (shared with the WebSocket); this
module only does HTTP: bearer token → principal, size / content type / JSON shape of the body
(pydantic, so a 400 names the field), query strings, status codes. ``ENDPOINTS`` is the route
table; ``routes`` serves it and ``/v1/openapi.json`` documents it, from the same models.

Request bodies refuse unknown fields: a misspelt ``run_id`` would otherwise silently turn an
idempotent retry into a second message.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from agentloop.kernel.account_model import MAX_SPEC
from agentloop.loop.hooks import maybe_await
from agentloop.models.base import REASONING_LEVELS
from agentloop.process.approval.denial import MAX_DENIAL_MESSAGE
from agentloop.process.compaction import MAX_SUMMARY
from agentloop.process.hil import MAX_AUDIT_PAGE
from agentloop.process.pressure import MAX_KEEP_RECENT
from agentloop.process.store import MAX_SEQ, NoSuchProcess
from agentloop.process.store.base import AUDIT_DECISIONS
from agentloop.process.tool_scope import MAX_ENTRIES
from agentloop.server.auth import Principal
from agentloop.server.context import ServerContext
from agentloop.server.devices import (
    MAX_REGISTERED_DEVICES,
    DeviceHub,
    HubError,
    TooManyDevices,
    check_device_name,
    forget_device,
    issue_device_token,
    registry,
    revoke_device_token,
)
from agentloop.server.engine_chat import ChatRequest
from agentloop.server.errors import ApiError
from agentloop.server.events import open_account_stream, open_stream
from agentloop.server.http_errors import internal_error, invalid, validation_error
from agentloop.server.openapi import Endpoint, document
from agentloop.server.service import MAX_HISTORY_PAGE, MAX_INSTRUCTIONS, MEDIA_TYPES, MODES, QUEUE_KINDS, RUN_MODES
from agentloop.server.strict_json import finite

ModelT = TypeVar("ModelT", bound=BaseModel)

# ------------------------------------------------------------------ request models


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Query(BaseModel):
    # Query strings are text: "20" must become 20, "false" False. Unknown parameters are ignored
    # (proxies and browsers add cache busters).
    model_config = ConfigDict(extra="ignore")


class ModeBody(Body):
    mode: Literal[RUN_MODES] = Field(description="agent (with tools) or chat (without), from the next run on.")  # type: ignore[valid-type]


class ModelBody(Body):
    model: str | None = Field(
        max_length=MAX_SPEC,
        description="This process's own model (provider:model, as in an account's model.json), from its next run"
        " on; null returns to the account's model.json, else the server's model.",
    )
    reasoning: Literal[REASONING_LEVELS] | None = Field(  # type: ignore[valid-type]
        None,
        description="A reasoning level for its runs (off, minimal, low, medium, high, xhigh); null: the account's "
        "or the model's.",
    )


class ToolsBody(Body):
    tools: list[str] | None = Field(
        max_length=MAX_ENTRIES,
        description="The names of the tools its runs are offered, from its next run on (a tool left out is neither"
        " shown nor callable): a tool's name, mcp:<server> for all of an MCP server's, or a glob (github__*); null:"
        " every tool (a subagent's: its parent's). A name it has no tool of is a 400 listing the available ones.",
    )


class TitleBody(Body):
    title: str | None = Field(
        description="One line of plain text, trimmed, at most 120 characters, with a visible character; null"
        " clears it (an automatic title follows)."
    )


class MediaItem(Body):
    data: str = Field(description="The image, document, audio or video, base64.")
    mime_type: str = Field(
        max_length=128,
        description=f"One of {', '.join(MEDIA_TYPES)}; or audio/* (transcribed before delivery: the server needs"
        " --transcribe-model; application/octet-stream or empty with an audio file's name, such as note.ogg, is"
        " audio too), or video/* (delivered as a note of what was attached: no model takes video;"
        " application/octet-stream or empty with a video file's name, such as clip.mp4, is video too).",
    )
    name: str = Field("", max_length=255, description="The file's name, shown to the model.")


class SpawnBody(Body):
    context: str = Field("", description="Process context, the last section of every run's system prompt.")
    interactive: bool = Field(True, description="Whether the process may ask for approval.")
    cwd: str | None = Field(None, description="Working directory, relative to the server's workspace.")
    mode: Literal[RUN_MODES] = Field("agent", description="chat: runs answer without tools.")  # type: ignore[valid-type]
    model: str | None = Field(
        None, max_length=MAX_SPEC, description="Its own model (provider:model), over the account's and the server's."
    )
    reasoning: Literal[REASONING_LEVELS] | None = Field(None, description="Its own reasoning level.")  # type: ignore[valid-type]
    tools: list[str] | None = Field(
        None,
        max_length=MAX_ENTRIES,
        description="Its tool scope, as POST /v1/processes/{pid}/tools sets it; null: every tool.",
    )
    text: str | None = Field(None, description="A first message: its run starts with the process, in one commit.")
    media: list[MediaItem] | None = None
    run_id: str | None = Field(None, min_length=1, max_length=128, description="The first message's run id.")
    output_schema: dict[str, Any] | None = Field(
        None, description="A JSON Schema: the first run answers with a value of it (a final_result call); with text."
    )


class SendBody(Body):
    text: str
    mode: Literal[MODES] = "steer"  # type: ignore[valid-type]
    media: list[MediaItem] | None = None
    run_id: str | None = Field(
        None, min_length=1, max_length=128, description="Retrying with the same run_id delivers once."
    )
    output_schema: dict[str, Any] | None = Field(
        None, description="A JSON Schema: the run answering this input ends with a value of it (never joins a run)."
    )
    expected_run_id: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="Deliver only while this run is the process's current one (a steer joins it, a queue waits"
        " for the run after it, an interrupt stops it); otherwise 409 run_not_current, nothing delivered.",
    )


class AbortBody(Body):
    run_id: str | None = Field(None, min_length=1, max_length=128, description="Only abort this run.")


class StopBody(Body):
    run_id: str | None = Field(None, min_length=1, max_length=128, description="Only stop this run.")


class RetryBody(Body):
    run_id: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="The retried run's id; a retry with one that got through gets its first receipt (idempotent).",
    )


class HilBody(Body):
    decision: Literal["approve", "deny"]
    remember: bool | Literal["run", "process", "account"] = Field(
        False,
        description="With approve: allow this kind of call from now on where the policy would ask, for the"
        " rest of the run, the process (true is process) or the account (an allow rule in the owner's"
        " policy file, for its later processes too; a shell command's program only). 400 when it cannot"
        " be kept at that scope.",
    )
    arguments: dict[str, Any] | None = Field(
        None,
        description="With approve: the arguments the call runs with instead of the model's. Checked against"
        " the tool's schema and the approval policy (400, the request still pending, when invalid or"
        " denied); the approval is bound to them, and the call's result tells the model they were edited.",
    )
    message: str | None = Field(
        None,
        max_length=MAX_DENIAL_MESSAGE,
        description="With deny only: why, for the model, which reads it as the user's words in the denied"
        " call's result (e.g. use the staging database instead). Stripped; newlines and tabs are the only"
        " control characters allowed; blank is no message. With approve: 400.",
    )


class EventBody(Body):
    text: str = Field(description="The event, shown to the model as a system message.")
    run_id: str | None = Field(
        None, min_length=1, max_length=128, description="Retrying with the same run_id delivers once."
    )


class ScheduleBody(Body):
    text: str = Field(description="Delivered as a system event each time the schedule fires.")
    at: float | None = Field(None, description="First (or only) time, epoch seconds; in the past fires at once.")
    every: float | None = Field(None, description="Repeat every this many seconds (the server sets a minimum).")
    name: str | None = Field(None, min_length=1, max_length=128)
    cron: str | None = Field(
        None, max_length=200, description="A calendar instead of at/every: minute hour day month weekday."
    )
    tz: str | None = Field(None, max_length=64, description="The IANA time zone cron is read in (UTC by default).")


class WatchBody(Body):
    source_pid: str = Field(min_length=1, max_length=128, description="The process to watch (same owner).")
    signal: str = Field("proc.run.finished", description="A logged signal, e.g. proc.run.finished.")
    once: bool = Field(True, description="End the watch after its first delivery.")


class EmptyBody(Body):
    pass


class CompactBody(Body):
    instructions: str | None = Field(
        None, max_length=MAX_INSTRUCTIONS, description="What the summary must keep or focus on, for the summary model."
    )
    keep_last: int | None = Field(
        None,
        ge=0,
        le=MAX_SEQ,
        description="Keep the newest N messages (more where a tool call's results would be parted from it).",
    )
    through: int | None = Field(
        None,
        ge=0,
        le=MAX_SEQ,
        description="A message id: summarise up to and including it (and the results of a call it makes).",
    )
    summary: str | None = Field(
        None,
        max_length=MAX_SUMMARY,
        description="The summary's text, plain: installed with no model call (not with instructions).",
    )


class ForkBody(Body):
    at: int | None = Field(
        None, ge=0, le=MAX_SEQ, description="A message id: the copy ends with it (left out: the whole history)."
    )
    segment: str | None = Field(
        None, min_length=1, max_length=128, description="A segment's id: copy what it archived instead."
    )
    context: str | None = Field(None, description="The fork's process context (left out: the source's).")
    fork_id: str | None = Field(
        None, min_length=1, max_length=128, description="Retrying with the same fork_id makes one fork."
    )


class RewindBody(Body):
    at: int = Field(
        ge=0, le=MAX_SEQ, description="A message id: the history keeps it and what precedes it (0: the start)."
    )


class CompactionBody(Body):
    threshold: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Compact when the context is this full (a share of the usable window); null: the server's.",
    )
    overflow: Literal["compact", "fail"] = Field(
        "compact", description="On a context overflow: compact and retry, or end the run with an error."
    )
    keep_recent_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_KEEP_RECENT,
        description="Recent history a summary leaves as it is; null: a quarter of the room.",
    )


class HistoryQuery(Query):
    limit: int = Field(100, ge=1, le=MAX_HISTORY_PAGE)
    before: int | None = Field(None, ge=0, le=MAX_SEQ, description="A message id: the page ends before it.")


class SegmentQuery(Query):
    limit: int = Field(100, ge=1, le=MAX_HISTORY_PAGE)
    before: int | None = Field(None, ge=0, le=MAX_SEQ, description="An archive position: the page ends before it.")


class EventsQuery(Query):
    after_seq: int = Field(0, ge=0, le=MAX_SEQ, description="Send logged signals after this seq.")
    follow: bool = Field(True, description="Keep the stream open for live signals after the backlog.")


class ApprovalsQuery(Query):
    account: str | None = Field(None, min_length=1, max_length=128, description="Admins only: that account's.")


class AuditQuery(Query):
    account: str | None = Field(None, min_length=1, max_length=128, description="Admins only: that account's.")
    pid: str | None = Field(None, min_length=1, max_length=128, description="Only this process's decisions.")
    since: float | None = Field(
        None, ge=0, le=1e11, allow_inf_nan=False, description="Only decisions at or after this time (epoch seconds)."
    )
    decision: Literal[AUDIT_DECISIONS] | None = Field(  # type: ignore[valid-type]
        None,
        description="Only this decision: approve or deny (a person's), timeout (nobody answered in time),"
        " non-interactive (the process could not ask), policy-deny (refused without asking).",
    )
    by: str | None = Field(None, min_length=1, max_length=128, description="Only what this account answered.")
    before: str | None = Field(
        None, max_length=64, description="The next_before of the page before: this page is older."
    )
    limit: int = Field(100, ge=1, le=MAX_AUDIT_PAGE)


class AccountEventsQuery(Query):
    after_seq: int | None = Field(
        None, ge=0, le=MAX_SEQ, description="Send the account's logged signals after this account seq first."
    )
    follow: bool = Field(
        True, description="Keep the stream open for live signals after the backlog (none without after_seq)."
    )


class WithdrawQuery(Query):
    kind: Literal[QUEUE_KINDS] | None = Field(  # type: ignore[valid-type]
        None,
        description="Only items of this kind. Without it, DELETE …/queue takes the user's input (steer and"
        " queue), never system events; DELETE …/queue/{item_id} takes the item whatever its kind.",
    )


# ------------------------------------------------------------------ answer models (documentation and tests)


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HealthOut(Answer):
    ok: bool


class MeOut(Answer):
    account: str
    admin: bool


class UsageOut(Answer):
    """Usage over finished runs, whatever their status (an aborted run's model calls count)."""

    input: int = Field(description="Input tokens.")
    output: int = Field(description="Output tokens.")
    total_tokens: int
    cost: float = Field(description="Dollars, at the model's catalog prices.")
    runs: int = Field(description="Runs finished (ok, error or aborted).")


class UsageAnswer(Answer):
    account: str
    usage: UsageOut = Field(description="The account's processes, live and killed.")


class PolicyOut(Answer):
    threshold: float | None
    overflow: Literal["compact", "fail"]
    keep_recent_tokens: int | None


class CompactionOut(PolicyOut):
    pid: str
    default_threshold: float = Field(description="The server's, which applies while threshold is null.")


class ContextOut(Answer):
    level: Literal["ok", "warn", "critical", "full"] = Field(
        description="ok below 0.7, warn from 0.7, critical from 0.85 (or the compaction threshold), full from 1."
    )
    ratio: float = Field(description="tokens / window, after the latest model step.")
    tokens: int = Field(description="The provider's count where it reported one, else the estimate.")
    window: int = Field(description="The usable window: the model's context window less its output budget.")
    threshold: float = Field(description="The compaction threshold that applies (the policy's, else the server's).")
    policy: PolicyOut


class ProcessOut(Answer):
    pid: str
    title: str | None = Field(
        description="Set by a person, else made after the conversation's first run; null before there is one."
    )
    owner: str
    state: Literal["idle", "running", "killed"]
    cwd: str
    interactive: bool
    context: str
    parent_pid: str | None
    run_id: str | None
    created_at: float
    updated_at: float
    handled: bool = Field(
        False, description="Spawn only: an input hook took the first input; the process was made without it."
    )
    usage: UsageOut = Field(description="The process's finished runs; a reset keeps it.")
    context_pressure: ContextOut | None = Field(
        None, description="How full the context window is: with one process (GET, spawn), not in a list."
    )
    model: ModelOut | None = Field(
        None, description="Its model, as GET /v1/processes/{pid}/model answers: with one process, not in a list."
    )


class ForkOut(ProcessOut):
    forked_from: dict[str, Any] = Field(description='Where it came from: {"pid", "at"} or {"pid", "segment"}.')


class ProcessList(Answer):
    processes: list[ProcessOut]


class KillOut(Answer):
    pid: str
    killed: Literal[True]
    archived: bool


class ReceiptOut(Answer):
    run_id: str
    queued: bool
    position: int
    handled: bool = Field(False, description="An input hook took the input: nothing was written, no run started.")


class MessageOut(Answer):
    id: int
    run_id: str | None
    message: dict[str, Any] = Field(description="agentloop's message format (message_to_dict).")


class HistoryOut(Answer):
    messages: list[MessageOut]
    next_before: int | None


class AbortOut(Answer):
    aborted: bool


class StopOut(Answer):
    stopping: bool


class ModeOut(Answer):
    pid: str
    mode: str


class ToolsOut(Answer):
    pid: str
    tools: list[str] | None = Field(description="Its tool scope; null: it may use every tool.")
    available: list[str] = Field(description="The tools its runs would be offered without a scope, by name.")


class ModelOut(Answer):
    pid: str
    model: str | None = Field(description="The process's own model; null: it has none.")
    reasoning: str | None = Field(description="The process's own reasoning level; null: it has none.")
    effective: str = Field(description="The model its next run uses (provider:model).")
    source: Literal["process", "account", "default"] = Field(
        description="Where that model comes from: the process, its account's model.json, the server."
    )


class CatalogModel(Answer):
    model: str = Field(description="provider:model")
    context_window: int
    max_output: int
    input_cost: float = Field(description="Dollars per million input tokens.")
    output_cost: float = Field(description="Dollars per million output tokens.")
    vision: bool
    reasoning: bool
    usable: bool = Field(description="Whether this server can call it (its provider's key or package is there).")
    why: str = Field(description="Why it can be used, or what it needs.")


class ModelCatalog(Answer):
    models: list[CatalogModel] = Field(description="The models whose facts agentloop knows; others may be named.")
    default: str = Field(description="The server's model (by its provider only when it names a file on the server).")


class TitleOut(Answer):
    pid: str
    title: str | None


class ApprovalRequest(Answer):
    request_id: str
    run_id: str
    tool_call_id: str
    tool_name: str
    syscall: str
    args: dict[str, Any]
    tags: list[str]
    reason: str
    subagent: str | None = Field(None, description="The subagent that asks (its pid), when it is not this process.")


class ApprovalList(Answer):
    requests: list[ApprovalRequest]


class AccountApproval(ApprovalRequest):
    pid: str = Field(description="The process that asks.")


class AccountApprovalList(Answer):
    requests: list[AccountApproval] = Field(description="Oldest first.")


class AuditEntry(Answer):
    id: str = Field(description="Time-ordered; a page's last one is its next_before.")
    account: str = Field(description="The account of the process decided about.")
    pid: str
    run_id: str
    request_id: str | None = Field(description="The approval request; null where nobody was asked.")
    call_id: str
    tool_name: str
    syscall: str
    args_digest: str = Field(description="SHA-256 of the call (syscall and arguments decided on), never the arguments.")
    args_preview: str = Field(description="The arguments, short, with what looks like a credential masked.")
    tags: list[str] = Field(description="What made the policy ask or refuse.")
    decision: Literal[AUDIT_DECISIONS]  # type: ignore[valid-type]
    remembered: Literal["run", "process", "account"] | None = Field(description="An approval's remember scope.")
    edited: bool = Field(description="Approved with the answerer's own arguments (the digest is of those).")
    by: str | None = Field(description="The account that answered; null for decisions nobody made.")
    at: float


class AuditPage(Answer):
    entries: list[AuditEntry] = Field(description="Newest first.")
    next_before: str | None = Field(description="Pass as before for the next (older) page; null: no more.")


class DecisionOut(Answer):
    request_id: str
    decision: Literal["approve", "deny"]
    remember: bool | Literal["run", "process", "account"]
    edited: bool = Field(False, description="Approved with the caller's arguments.")


class ResetOut(Answer):
    pid: str
    archived: bool


class CompactOut(Answer):
    compacted: bool
    note: str | None = Field(description="Why nothing was compacted (too short, a hook declined); null when it was.")
    removed: int = Field(description="Messages the summary replaced.")
    tokens_before: int = Field(description="The history's estimated tokens before.")
    tokens_after: int
    archive: str | None = Field(description="The archive's name (see segments).")
    segment_id: str | None


class RewindOut(Answer):
    kept: int = Field(description="Messages the history holds now.")
    removed: int = Field(description="Messages taken out (0: the point was the last message, nothing was done).")
    segment: str | None = Field(description="The segment they were archived as (see segments); null when none.")


class SegmentOut(Answer):
    id: str
    kind: Literal["compaction", "clearing", "reset", "rewind"]
    reason: str | None = Field(description="A compaction's: threshold, overflow or manual; reset, rewind for those.")
    created_at: float
    generation: int = Field(description="The history generation it was taken from (each reset starts one).")
    messages: int | None = Field(description="How many its archive holds; null when the archive cannot be read.")
    archive: str | None


class SegmentList(Answer):
    segments: list[SegmentOut] = Field(description="Oldest first.")


class ArchivedMessageOut(Answer):
    index: int = Field(description="Its position in the archive, from 0.")
    message: dict[str, Any] = Field(description="agentloop's message format (message_to_dict).")


class SegmentPageOut(Answer):
    segment: SegmentOut
    messages: list[ArchivedMessageOut]
    next_before: int | None


class ScheduleOut(Answer):
    id: str
    pid: str
    text: str
    name: str | None
    next_due: float = Field(description="Epoch seconds.")
    every: float | None
    cron: str | None
    tz: str | None
    created_at: float


class ScheduleList(Answer):
    schedules: list[ScheduleOut]


class WatchOut(Answer):
    id: str
    pid: str
    source_pid: str
    signal: str
    once: bool
    created_at: float


class WatchList(Answer):
    watches: list[WatchOut]


class QueueItemOut(Answer):
    id: int
    kind: Literal[QUEUE_KINDS]  # type: ignore[valid-type]
    run_id: str | None = Field(description="A queued message's run (the one its receipt named); else its own id.")
    text: str
    message: dict[str, Any] = Field(description="agentloop's message format (message_to_dict).")
    created_at: float


class QueueOut(Answer):
    items: list[QueueItemOut] = Field(description="In the order they will be taken.")


class WithdrawnOut(Answer):
    withdrawn: list[QueueItemOut]


class RemovedOut(Answer):
    id: str
    removed: Literal[True]


class DeviceOut(Answer):
    id: str
    owner: str
    description: str
    implements: list[str] = Field(description="What it offers while online (empty while offline).")
    tools: list[dict[str, Any]]
    connected_at: float | None = Field(description="When its connection began; null while offline.")
    label: str = ""
    online: bool = True
    has_token: bool = Field(False, description="Whether a device token is bound to it.")
    first_seen_at: float | None = None
    last_seen_at: float | None = Field(None, description="When it last connected or left.")


class DeviceTokenOut(Answer):
    device: str
    token: str = Field(description="Shown only this once; a token issued before for the device stops working.")
    token_id: str


class DeviceRevokedOut(Answer):
    device: str
    revoked: Literal[True]


class DeviceForgottenOut(Answer):
    device: str
    forgotten: Literal[True]


class DeviceList(Answer):
    devices: list[DeviceOut]


class EventOut(Answer):
    signal: str
    payload: dict[str, Any]
    seq: int | None = Field(
        description="The process log's sequence number (also the SSE id of a process stream; an account stream's"
        " id is the account seq); null for live-only progress."
    )
    pid: str | None = Field(description="The process; null only on the account stream's account.log.pruned.")


class ChatEvent(BaseModel):
    """One ``/engine/chat`` event's data: ``text-delta``, ``tool-call``, ``tool-result``, ``done`` or ``error``."""

    model_config = ConfigDict(extra="allow")


class OpenApiOut(BaseModel):
    model_config = ConfigDict(extra="allow")
    openapi: str


# ------------------------------------------------------------------ request plumbing


@dataclass
class Call:
    """One parsed request, as a handler sees it."""

    ctx: ServerContext
    request: Request
    who: Principal | None
    query: BaseModel | None
    body: BaseModel | None

    @property
    def principal(self) -> Principal:
        assert self.who is not None, "the route is declared auth=False"
        return self.who

    def param(self, name: str) -> str:
        value: str = self.request.path_params[name]
        return value

    def parsed(self, model: type[ModelT], part: BaseModel | None) -> ModelT:
        assert isinstance(part, model)
        return part


class FiniteJSONResponse(JSONResponse):
    """An answer whose NaN and infinities (a model's ``1e999`` in a tool call's arguments, shown by
    ``GET …/hil``) are null: Starlette's encoder refuses them, which made the route a 500."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except ValueError:  # rare: only then is the content walked
            return super().render(finite(content))


def _json_type(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past ``limit`` bytes whether or not Content-Length said so."""
    too_large = ApiError(413, "too_large", f"the request body exceeds {limit} bytes")
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    """The body as ``model``; an empty body counts as ``{}`` (every field of abort is optional).

    pydantic parses the JSON itself: unlike ``json.loads`` it refuses lone surrogates
    (``"\\ud800"``), which no store could encode later.
    """
    raw = await read_body(request, limit)
    try:
        if not raw.strip():
            return model.model_validate({})
        if not _json_type(request.headers.get("content-type", "")):
            raise ApiError(415, "unsupported_media_type", "the body must be application/json")
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None


def parse_query(params: Mapping[str, str], model: type[BaseModel]) -> BaseModel:
    try:
        return model.model_validate(dict(params))
    except ValidationError as exc:
        raise validation_error(exc, root="query") from None


def _endpoint(ctx: ServerContext, spec: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    handler = spec.handler
    assert handler is not None

    async def endpoint(request: Request) -> Response:
        try:
            who = await ctx.principal(request) if spec.auth else None
            query = parse_query(request.query_params, spec.query) if spec.query else None
            limit = ctx.max_media_body if spec.body is not None and "media" in spec.body.model_fields else ctx.max_body
            body = await parse_body(request, spec.body, limit) if spec.body else None
            result = await handler(Call(ctx, request, who, query, body))
        except ApiError as exc:
            return exc.response()
        except NoSuchProcess as exc:  # killed by a request that raced this one (a retried DELETE)
            return ApiError(404, "not_found", f"no such process {exc.pid!r}").response()
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:
            return internal_error(request, exc)
        if isinstance(result, Response):
            return result
        return FiniteJSONResponse(result, status_code=spec.status)

    endpoint.__name__ = spec.operation_id
    return endpoint


# ------------------------------------------------------------------ handlers


async def health(call: Call) -> dict[str, Any]:
    return {"ok": True}


async def me(call: Call) -> dict[str, Any]:
    return {"account": call.principal.account, "admin": call.principal.admin}


async def usage(call: Call) -> dict[str, Any]:
    return await call.ctx.processes.usage(call.principal)


async def spawn(call: Call) -> dict[str, Any]:
    body = call.parsed(SpawnBody, call.body)
    media = [m.model_dump() for m in body.media] if body.media else None
    return await call.ctx.processes.spawn(
        call.principal,
        context=body.context,
        interactive=body.interactive,
        cwd=body.cwd,
        mode=body.mode,
        model=body.model,
        reasoning=body.reasoning,
        tools=body.tools,
        text=body.text,
        media=media,
        run_id=body.run_id,
        output_schema=body.output_schema,
    )


async def list_processes(call: Call) -> dict[str, Any]:
    return {"processes": await call.ctx.processes.list_processes(call.principal)}


async def get_process(call: Call) -> dict[str, Any]:
    return await call.ctx.processes.get(call.principal, call.param("pid"))


async def kill(call: Call) -> dict[str, Any]:
    return await call.ctx.processes.kill(call.principal, call.param("pid"))


async def send(call: Call) -> dict[str, Any]:
    body = call.parsed(SendBody, call.body)
    media = [m.model_dump() for m in body.media] if body.media is not None else None
    return await call.ctx.processes.send(
        call.principal,
        call.param("pid"),
        body.text,
        mode=body.mode,
        media=media,
        run_id=body.run_id,
        output_schema=body.output_schema,
        expected_run_id=body.expected_run_id,
    )


async def get_compaction(call: Call) -> dict[str, Any]:
    return await call.ctx.processes.compaction(call.principal, call.param("pid"))


async def set_compaction(call: Call) -> dict[str, Any]:
    body = call.parsed(CompactionBody, call.body)
    return await call.ctx.processes.compaction(call.principal, call.param("pid"), body.model_dump())


async def history(call: Call) -> dict[str, Any]:
    query = call.parsed(HistoryQuery, call.query)
    return await call.ctx.processes.history(call.principal, call.param("pid"), limit=query.limit, before=query.before)


def _last_event_id(request: Request) -> int | None:
    raw = request.headers.get("last-event-id")
    if raw is None or not raw.strip():
        return None
    value = raw.strip()
    if not value.isdigit() or not value.isascii() or int(value) > MAX_SEQ:
        raise invalid("Last-Event-ID", "must be a seq (a non-negative integer) from an earlier event")
    return int(value)


async def events(call: Call) -> Response:
    query = call.parsed(EventsQuery, call.query)
    resume = _last_event_id(call.request)
    after = resume if resume is not None else query.after_seq  # the header wins: it is the reconnect
    return await open_stream(call.ctx, call.principal, call.param("pid"), after_seq=after, follow=query.follow)


async def get_mode(call: Call) -> dict[str, Any]:
    return await call.ctx.processes.mode(call.principal, call.param("pid"))


async def set_mode(call: Call) -> dict[str, Any]:
    body = call.parsed(ModeBody, call.body)
    return await call.ctx.processes.mode(call.principal, call.param("pid"), body.mode)


async def get_tools(call: Call) -> dict[str, Any]:
    return await call.ctx.processes.tools(call.principal, call.param("pid"))


async def set_tools(call: Call) -> dict[str, Any]:
    body = call.parsed(ToolsBody, call.body)
    return await call.ctx.processes.tools(call.principal, call.param("pid"), body.model_dump())


async def models(call: Call) -> dict[str, Any]:
    return call.ctx.processes.models()


async def get_model(call: Call) -> dict[str, Any]:
    return await call.ctx.processes.model(call.principal, call.param("pid"))


async def set_model(call: Call) -> dict[str, Any]:
    body = call.parsed(ModelBody, call.body)
    return await call.ctx.processes.model(call.principal, call.param("pid"), body.model_dump())


async def get_title(call: Call) -> dict[str, Any]:
    return await call.ctx.processes.title(call.principal, call.param("pid"))


async def set_title(call: Call) -> dict[str, Any]:
    body = call.parsed(TitleBody, call.body)
    return await call.ctx.processes.set_title(call.principal, call.param("pid"), body.title)


async def stop(call: Call) -> dict[str, Any]:
    body = call.parsed(StopBody, call.body)
    return await call.ctx.processes.stop(call.principal, call.param("pid"), run_id=body.run_id)


async def abort(call: Call) -> dict[str, Any]:
    body = call.parsed(AbortBody, call.body)
    return await call.ctx.processes.abort(call.principal, call.param("pid"), run_id=body.run_id)


async def retry(call: Call) -> dict[str, Any]:
    body = call.parsed(RetryBody, call.body)
    return await call.ctx.processes.retry(call.principal, call.param("pid"), run_id=body.run_id)


async def approvals(call: Call) -> dict[str, Any]:
    return {"requests": await call.ctx.processes.approvals(call.principal, call.param("pid"))}


async def account_approvals(call: Call) -> dict[str, Any]:
    query = call.parsed(ApprovalsQuery, call.query)
    return {"requests": await call.ctx.processes.account_approvals(call.principal, query.account)}


async def approval_audit(call: Call) -> dict[str, Any]:
    query = call.parsed(AuditQuery, call.query)
    return await call.ctx.processes.approval_audit(
        call.principal,
        account=query.account,
        limit=query.limit,
        pid=query.pid,
        since=query.since,
        decision=query.decision,
        by=query.by,
        before=query.before,
    )


async def account_events(call: Call) -> Response:
    query = call.parsed(AccountEventsQuery, call.query)
    resume = _last_event_id(call.request)
    after = resume if resume is not None else query.after_seq  # the header wins: it is the reconnect
    return await open_account_stream(call.ctx, call.principal, after_seq=after, follow=query.follow)


async def decide(call: Call) -> dict[str, Any]:
    body = call.parsed(HilBody, call.body)
    return await call.ctx.processes.hil(
        call.principal,
        call.param("pid"),
        call.param("request_id"),
        decision=body.decision,
        remember=body.remember,
        message=body.message,
        arguments=body.arguments,
    )


async def reset(call: Call) -> dict[str, Any]:
    return await call.ctx.processes.reset(call.principal, call.param("pid"))


async def compact(call: Call) -> dict[str, Any]:
    body = call.parsed(CompactBody, call.body)
    return await call.ctx.processes.compact(
        call.principal,
        call.param("pid"),
        instructions=body.instructions,
        keep_last=body.keep_last,
        through=body.through,
        summary=body.summary,
    )


async def rewind(call: Call) -> dict[str, Any]:
    body = call.parsed(RewindBody, call.body)
    return await call.ctx.processes.rewind(call.principal, call.param("pid"), body.at)


async def segments(call: Call) -> dict[str, Any]:
    return {"segments": await call.ctx.processes.segments(call.principal, call.param("pid"))}


async def segment(call: Call) -> dict[str, Any]:
    query = call.parsed(SegmentQuery, call.query)
    pid, segment_id = call.param("pid"), call.param("segment_id")
    return await call.ctx.processes.segment(call.principal, pid, segment_id, limit=query.limit, before=query.before)


async def fork(call: Call) -> dict[str, Any]:
    body = call.parsed(ForkBody, call.body)
    return await call.ctx.processes.fork(
        call.principal, call.param("pid"), at=body.at, segment=body.segment, context=body.context, fork_id=body.fork_id
    )


async def signal_event(call: Call) -> dict[str, Any]:
    body = call.parsed(EventBody, call.body)
    return await call.ctx.processes.signal(call.principal, call.param("pid"), body.text, run_id=body.run_id)


async def add_schedule(call: Call) -> dict[str, Any]:
    body = call.parsed(ScheduleBody, call.body)
    return await call.ctx.processes.schedule(
        call.principal,
        call.param("pid"),
        body.text,
        at=body.at,
        every=body.every,
        name=body.name,
        cron=body.cron,
        tz=body.tz,
    )


async def schedules(call: Call) -> dict[str, Any]:
    return {"schedules": await call.ctx.processes.schedules(call.principal, call.param("pid"))}


async def remove_schedule(call: Call) -> dict[str, Any]:
    return await call.ctx.processes.unschedule(call.principal, call.param("pid"), call.param("schedule_id"))


async def add_watch(call: Call) -> dict[str, Any]:
    body = call.parsed(WatchBody, call.body)
    return await call.ctx.processes.watch(
        call.principal, call.param("pid"), body.source_pid, signal=body.signal, once=body.once
    )


async def watches(call: Call) -> dict[str, Any]:
    return {"watches": await call.ctx.processes.watches(call.principal, call.param("pid"))}


async def remove_watch(call: Call) -> dict[str, Any]:
    return await call.ctx.processes.unwatch(call.principal, call.param("pid"), call.param("watch_id"))


async def queue(call: Call) -> dict[str, Any]:
    return {"items": await call.ctx.processes.queue(call.principal, call.param("pid"))}


async def withdraw_all(call: Call) -> dict[str, Any]:
    query = call.parsed(WithdrawQuery, call.query)
    return {"withdrawn": await call.ctx.processes.withdraw(call.principal, call.param("pid"), kind=query.kind)}


async def withdraw_item(call: Call) -> dict[str, Any]:
    query, item_id = call.parsed(WithdrawQuery, call.query), _item_id(call.param("item_id"))
    withdrawn = await call.ctx.processes.withdraw(call.principal, call.param("pid"), item_id, kind=query.kind)
    return {"withdrawn": withdrawn}


def _item_id(raw: str) -> int:
    """A queue item id from the path: 1 or more, in ASCII digits (``int`` would take "²" or "1_0")."""
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= MAX_SEQ:
        raise invalid("item_id", f"must be an integer from 1 to {MAX_SEQ}")
    return int(raw)


async def devices(call: Call) -> dict[str, Any]:
    hub = call.ctx.devices
    if hub is None:  # devices not enabled: nobody has any
        return {"devices": []}
    if not hasattr(hub, "connected"):  # (a hub of another kind: only what it lists)
        return {"devices": list(await maybe_await(hub.list(call.principal)))}
    return {"devices": await registry(call.ctx.accounts.store, hub, call.principal)}


def _device_name(call: Call) -> str:
    try:
        return check_device_name(call.param("name"))
    except HubError as exc:
        raise ApiError(400, "invalid_request", exc.message) from None


async def device_token(call: Call) -> dict[str, Any]:
    name = _device_name(call)
    hub = call.ctx.devices
    limit = hub.max_registered if isinstance(hub, DeviceHub) else MAX_REGISTERED_DEVICES
    try:
        token, token_id = await issue_device_token(call.ctx.accounts.store, call.principal.account, name, limit=limit)
    except TooManyDevices as exc:
        raise ApiError(409, exc.code, exc.message) from None
    if isinstance(call.ctx.devices, DeviceHub):  # a connection with the token this one replaces ends now
        await call.ctx.devices.unbind(call.principal.account, name, token_id)
    return {"device": name, "token": token, "token_id": token_id}


async def revoke_device(call: Call) -> dict[str, Any]:
    name = _device_name(call)
    if not await revoke_device_token(call.ctx.accounts.store, call.principal.account, name):
        raise ApiError(404, "not_found", f"device {name!r} has no token")
    if isinstance(call.ctx.devices, DeviceHub):  # its connection ends now, not at the next heartbeat
        await call.ctx.devices.unbind(call.principal.account, name)
    return {"device": name, "revoked": True}


async def forget_device_route(call: Call) -> dict[str, Any]:
    name = _device_name(call)
    if not await forget_device(call.ctx.accounts.store, call.principal.account, name):
        raise ApiError(404, "not_found", f"device {name!r} is not registered")
    if isinstance(call.ctx.devices, DeviceHub):  # its connection ends now, whatever token it used
        await call.ctx.devices.disconnect(call.principal.account, name)
    return {"device": name, "forgotten": True}


async def openapi(call: Call) -> Response:
    return JSONResponse(openapi_document())


# ------------------------------------------------------------------ the table

_P = "/v1/processes/{pid}"

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("GET", "/v1/health", "Liveness; needs no token.", health, answer=HealthOut, auth=False),
    Endpoint("GET", "/v1/me", "The caller's account.", me, answer=MeOut),
    Endpoint("GET", "/v1/usage", "What the caller's account has spent.", usage, answer=UsageAnswer),
    Endpoint(
        "POST",
        "/v1/processes",
        "Spawn a process owned by the caller.",
        spawn,
        body=SpawnBody,
        answer=ProcessOut,
        status=201,
        errors=(402, 409, 429, 502),
    ),
    Endpoint("GET", "/v1/processes", "The caller's processes.", list_processes, answer=ProcessList),
    Endpoint("GET", _P, "One process.", get_process, answer=ProcessOut),
    Endpoint("DELETE", _P, "Kill the process (its history is archived).", kill, answer=KillOut),
    Endpoint(
        "POST",
        f"{_P}/messages",
        "Send user input (steer, queue, interrupt, or reject: only to an idle process).",
        send,
        body=SendBody,
        answer=ReceiptOut,
        status=202,
        errors=(402, 409, 429, 502),
    ),
    Endpoint(
        "GET",
        f"{_P}/messages",
        "A page of history, oldest first; next_before pages back.",
        history,
        query=HistoryQuery,
        answer=HistoryOut,
    ),
    Endpoint(
        "GET",
        f"{_P}/events",
        "The process's signals: the logged backlog, then live ones.",
        events,
        query=EventsQuery,
        stream=EventOut,
        errors=(503,),
        headers=(("Last-Event-ID", "Resume after this seq; wins over after_seq."),),
    ),
    Endpoint("POST", f"{_P}/abort", "Abort the active run.", abort, body=AbortBody, answer=AbortOut),
    Endpoint(
        "POST",
        f"{_P}/stop",
        "Finish the active run gently: what is under way completes, then one answer without tools.",
        stop,
        body=StopBody,
        answer=StopOut,
    ),
    Endpoint(
        "POST",
        f"{_P}/retry",
        "Run the model again on the history, with no new input, where the last run ended without an answer"
        " (failed, aborted, cut at the output limit); 409 busy while a run is active,"
        " nothing_to_retry after an answer.",
        retry,
        body=RetryBody,
        answer=ReceiptOut,
        status=202,
        errors=(402, 409, 429),
    ),
    Endpoint(
        "GET", f"{_P}/mode", "Whether the process's runs use tools (agent) or not (chat).", get_mode, answer=ModeOut
    ),
    Endpoint(
        "POST", f"{_P}/mode", "Set agent or chat mode, from the next run on.", set_mode, body=ModeBody, answer=ModeOut
    ),
    Endpoint("GET", f"{_P}/tools", "The process's tool scope and the tools it may name.", get_tools, answer=ToolsOut),
    Endpoint(
        "POST",
        f"{_P}/tools",
        "Set the process's tool scope (null: every tool), from its next run on.",
        set_tools,
        body=ToolsBody,
        answer=ToolsOut,
    ),
    Endpoint(
        "GET",
        "/v1/models",
        "The models a picker may offer, and which this server can call.",
        models,
        answer=ModelCatalog,
    ),
    Endpoint("GET", f"{_P}/model", "The process's model and where it comes from.", get_model, answer=ModelOut),
    Endpoint(
        "POST",
        f"{_P}/model",
        "Set the process's own model (null: the account's or the server's again), from its next run on.",
        set_model,
        body=ModelBody,
        answer=ModelOut,
    ),
    Endpoint("GET", f"{_P}/compaction", "The process's compaction policy.", get_compaction, answer=CompactionOut),
    Endpoint(
        "POST",
        f"{_P}/compaction",
        "Set the process's compaction policy (fields left out: the defaults), from its next run on.",
        set_compaction,
        body=CompactionBody,
        answer=CompactionOut,
    ),
    Endpoint("GET", f"{_P}/title", "The process's title (null before it has one).", get_title, answer=TitleOut),
    Endpoint(
        "POST",
        f"{_P}/title",
        "Name the process (null clears it): nothing automatic overwrites it, a reset keeps it.",
        set_title,
        body=TitleBody,
        answer=TitleOut,
    ),
    Endpoint("GET", f"{_P}/hil", "Pending approval requests.", approvals, answer=ApprovalList),
    Endpoint(
        "POST",
        f"{_P}/hil/{{request_id}}",
        "Approve (optionally with edited arguments, optionally remembered) or deny a pending tool call.",
        decide,
        body=HilBody,
        answer=DecisionOut,
    ),
    Endpoint(
        "POST",
        f"{_P}/reset",
        "Archive the history and start an empty one.",
        reset,
        body=EmptyBody,
        answer=ResetOut,
        errors=(409,),
    ),
    Endpoint(
        "POST",
        f"{_P}/compact",
        "Summarise the history now (idle only): the older part is archived, a summary takes its place.",
        compact,
        body=CompactBody,
        answer=CompactOut,
        errors=(409, 502),
    ),
    Endpoint(
        "POST",
        f"{_P}/rewind",
        "Cut the history back to a message (idle only): what follows it is archived as a segment, then removed.",
        rewind,
        body=RewindBody,
        answer=RewindOut,
        errors=(409,),
    ),
    Endpoint(
        "GET",
        f"{_P}/segments",
        "What compactions, clearings and resets put away (archived), oldest first.",
        segments,
        answer=SegmentList,
    ),
    Endpoint(
        "GET",
        f"{_P}/segments/{{segment_id}}",
        "A page of one segment's archived messages, oldest first; next_before pages back.",
        segment,
        query=SegmentQuery,
        answer=SegmentPageOut,
    ),
    Endpoint(
        "POST",
        f"{_P}/fork",
        "A new process from this one's conversation: its history up to a message (at), or an archived segment.",
        fork,
        body=ForkBody,
        answer=ForkOut,
        status=201,
        errors=(409,),
    ),
    Endpoint(
        "POST",
        f"{_P}/events",
        "Inject a system event (ahead of queued user input; starts a run when idle).",
        signal_event,
        body=EventBody,
        answer=ReceiptOut,
        status=202,
        errors=(402, 429),
    ),
    Endpoint("GET", f"{_P}/schedules", "The process's schedules, soonest first.", schedules, answer=ScheduleList),
    Endpoint(
        "POST",
        f"{_P}/schedules",
        "Deliver a system event at a time and/or every so many seconds.",
        add_schedule,
        body=ScheduleBody,
        answer=ScheduleOut,
        status=201,
        errors=(409,),
    ),
    Endpoint("DELETE", f"{_P}/schedules/{{schedule_id}}", "Delete a schedule.", remove_schedule, answer=RemovedOut),
    Endpoint("GET", f"{_P}/watches", "The signal watches the process holds.", watches, answer=WatchList),
    Endpoint(
        "POST",
        f"{_P}/watches",
        "Tell the process (a system event) when another process of its owner logs a signal.",
        add_watch,
        body=WatchBody,
        answer=WatchOut,
        status=201,
        errors=(403, 409),
    ),
    Endpoint("DELETE", f"{_P}/watches/{{watch_id}}", "Delete a signal watch.", remove_watch, answer=RemovedOut),
    Endpoint(
        "GET",
        f"{_P}/queue",
        "The input waiting for the process, in the order it will be taken.",
        queue,
        answer=QueueOut,
    ),
    Endpoint(
        "DELETE",
        f"{_P}/queue",
        "Withdraw waiting input before it runs: the user's, or one kind.",
        withdraw_all,
        query=WithdrawQuery,
        answer=WithdrawnOut,
    ),
    Endpoint(
        "DELETE",
        f"{_P}/queue/{{item_id}}",
        "Withdraw one waiting item (404 once a run has taken it).",
        withdraw_item,
        query=WithdrawQuery,
        answer=WithdrawnOut,
    ),
    Endpoint(
        "GET",
        "/v1/approvals",
        "Pending approval requests of all the caller's processes, each with its pid.",
        account_approvals,
        query=ApprovalsQuery,
        answer=AccountApprovalList,
        errors=(403,),
    ),
    Endpoint(
        "GET",
        "/v1/approvals/audit",
        "Decisions about tool calls of the caller's processes, newest first, kept after a process is killed or"
        " reset: answers, timeouts, calls a process could not ask about and calls the policy refused.",
        approval_audit,
        query=AuditQuery,
        answer=AuditPage,
        errors=(403,),
    ),
    Endpoint(
        "GET",
        "/v1/events",
        "Approvals asked and answered (proc.changed with hil) and runs finished, of all the caller's processes;"
        " each event's id is its account seq (a stream opened from now on starts with an id-only frame).",
        account_events,
        query=AccountEventsQuery,
        stream=EventOut,
        errors=(503,),
        headers=(("Last-Event-ID", "Resume after this account seq; wins over after_seq."),),
    ),
    Endpoint(
        "GET", "/v1/devices", "Devices, online and offline: the caller's (all for admins).", devices, answer=DeviceList
    ),
    Endpoint(
        "POST",
        "/v1/devices/{name}/token",
        "Issue the token a device connects with (replacing the one before).",
        device_token,
        answer=DeviceTokenOut,
        errors=(409,),
    ),
    Endpoint(
        "DELETE",
        "/v1/devices/{name}/token",
        "Revoke a device's token; its connection closes.",
        revoke_device,
        answer=DeviceRevokedOut,
        errors=(404,),
    ),
    Endpoint(
        "DELETE",
        "/v1/devices/{name}",
        "Forget a device: its registry entry and token go, freeing its place; its connection closes.",
        forget_device_route,
        answer=DeviceForgottenOut,
        errors=(404,),
    ),
    Endpoint("GET", "/v1/openapi.json", "This document.", openapi, answer=OpenApiOut),
)

# Served by ``EngineChat`` in app.py, documented here so the document covers every HTTP route.
ENGINE_CHAT = Endpoint(
    "POST",
    "/engine/chat",
    "One stateless run over a history the caller sends.",
    body=ChatRequest,
    stream=ChatEvent,
    errors=(503,),
    headers=(
        ("X-Actor-ID", "The gateway's actor (with X-Actor-Permissions), read-only for the run's tools; not auth."),
        ("X-Actor-Permissions", "The actor's permissions, a comma list (with X-Actor-ID); not checked here."),
    ),
)

_document: dict[str, Any] | None = None


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of every HTTP route (built once: the table does not change)."""
    global _document
    if _document is None:
        _document = document([*ENDPOINTS, ENGINE_CHAT])
    return _document


def routes(ctx: ServerContext) -> list[BaseRoute]:
    """``ENDPOINTS`` as Starlette routes bound to ``ctx``: one route per path, so a wrong method
    answers 405 with every allowed method in ``Allow`` (HEAD is answered by the GET handler)."""
    by_path: dict[str, dict[str, Callable[[Request], Awaitable[Response]]]] = {}
    for spec in ENDPOINTS:
        by_path.setdefault(spec.path, {})[spec.method] = _endpoint(ctx, spec)
    return [_route(path, handlers) for path, handlers in by_path.items()]


def _route(path: str, handlers: dict[str, Callable[[Request], Awaitable[Response]]]) -> Route:
    async def dispatch(request: Request) -> Response:
        method = "GET" if request.method == "HEAD" else request.method
        return await handlers[method](request)

    return Route(path, dispatch, methods=list(handlers))
