"""What a durable store keeps, and the interface every dialect implements.

A process's state is a registry row plus its own rows in the other tables (messages, pending tool
calls, input queue, pending approvals, key-value pairs, the signal log, history segments). The
durable runner changes that state only inside ``store.transaction()``, one transaction per step
of a run, so a crash leaves either the state before the step or the state after it.

Ids that need an order (message ids, signal sequence numbers, queue positions) come from
per-process counters kept in the registry row and bumped inside the same transaction, so they are
gap-free per process and identical across dialects.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias, get_args

from agentloop.messages import Message, Usage

ProcessState: TypeAlias = Literal["idle", "running", "killed"]
CallStatus: TypeAlias = Literal["registered", "dispatched", "completed", "failed", "cancelled", "denied"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"completed", "failed", "cancelled", "denied"})
QueueKind: TypeAlias = Literal["steer", "queue", "system"]
MAX_SEQ = 2**63 - 1  # the largest INTEGER (SQLite) and BIGINT (PostgreSQL): a larger id or seq is bad input


class StoreError(Exception):
    """The store cannot do what was asked (unknown process, newer schema, misuse)."""


class NoSuchProcess(StoreError):
    def __init__(self, pid: str) -> None:
        super().__init__(f"no such process: {pid}")
        self.pid = pid


class ProcessBusy(StoreError):
    """Another worker holds the process and will not let it go now (a reset asked through a
    worker without its lease): nothing was done; try again."""

    def __init__(self, pid: str, what: str) -> None:
        super().__init__(f"process {pid} is busy on another worker; retry the {what}")
        self.pid = pid


@dataclass(slots=True)
class UsageTotals:
    """What a process, or an account, has spent over its finished runs: tokens read and written,
    both together, the cost in dollars, and how many runs. A run counts however it ended (ok,
    failed, aborted): its model calls were billed all the same."""

    input: int = 0
    output: int = 0
    total_tokens: int = 0
    cost: float = 0.0
    runs: int = 0

    @classmethod
    def of_run(cls, usage: Mapping[str, Any]) -> UsageTotals:
        """One run's usage, as the run's record keeps it, as totals to add: one run."""
        return cls(usage["input"], usage["output"], usage["total_tokens"], usage["cost"], 1)

    def __add__(self, other: UsageTotals) -> UsageTotals:
        return UsageTotals(
            self.input + other.input,
            self.output + other.output,
            self.total_tokens + other.total_tokens,
            self.cost + other.cost,
            self.runs + other.runs,
        )

    @classmethod
    def of_call(cls, usage: Usage) -> UsageTotals:
        """One model call's usage (made outside any run: no run counted) as totals to add."""
        return cls(usage.input, usage.output, usage.total_tokens, usage.cost.total, 0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "input": self.input,
            "output": self.output,
            "total_tokens": self.total_tokens,
            "cost": self.cost,
            "runs": self.runs,
        }


@dataclass
class ProcessRecord:
    pid: str
    owner: str
    run_as: str
    cwd: str
    parent_pid: str | None = None
    interactive: bool = True
    context: str = ""
    state: ProcessState = "idle"
    current_run: dict[str, Any] | None = None  # the active run: id, tick generation, per-run caches
    history_generation: int = 1
    created_at: float = 0.0
    updated_at: float = 0.0
    usage: UsageTotals = field(default_factory=UsageTotals)  # over its finished runs; a reset keeps them
    # its title (process_kv ``title``, kernel/titles.py): filled in by ``Process.info`` and
    # ``Kernel.processes``, never by the store's own reads of the registry
    title: str | None = None


@dataclass
class StoredMessage:
    id: int
    generation: int
    run_id: str | None
    message: Message


@dataclass
class ToolCallRow:
    dispatch_id: str
    pid: str
    run_id: str
    position: int  # order within the assistant message: results go back in this order
    tool_call_id: str
    tool_name: str
    syscall: str
    args: dict[str, Any]
    status: CallStatus = "registered"
    deadline: float | None = None
    result: dict[str, Any] | None = None  # a ToolResultMessage as a dict, once terminal
    created_at: float = 0.0

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


@dataclass
class QueueItem:
    id: int
    kind: QueueKind
    run_id: str | None
    message: Message
    created_at: float = 0.0
    reason: str | None = None  # the run reason it starts with when promoted (None: ``queue.promote``)


@dataclass
class HilRow:
    request_id: str
    pid: str
    run_id: str
    dispatch_id: str
    tool_call_id: str
    tool_name: str
    syscall: str
    args: dict[str, Any]
    fingerprint: str
    tags: list[str] = field(default_factory=list)
    reason: str = ""
    created_at: float = 0.0


#: what an approvals audit row says was decided: a person's ``approve`` or ``deny``; a request
#: nobody answered in time (``timeout``), denied; a call the policy would have put to a person in
#: a process that cannot ask (``non-interactive``), denied; a call the policy refused without
#: asking (``policy-deny``). A policy's ``auto`` is no decision anyone audits: not recorded.
AuditDecision: TypeAlias = Literal["approve", "deny", "timeout", "non-interactive", "policy-deny"]
AUDIT_DECISIONS: tuple[str, ...] = get_args(AuditDecision)


@dataclass(slots=True)
class ApprovalAuditRow:
    """One decision of the approvals audit, kept by the process's ``owner`` after the process is
    gone. ``answered_by`` is the account that answered (None for the decisions nobody made, and
    for a person a library caller did not name); ``request_id`` is None where nobody was asked
    (``policy-deny``, ``non-interactive``). Never the arguments: ``args_digest`` (the approval
    fingerprint of the arguments decided on) and ``args_preview`` (short, secrets masked)."""

    id: str
    owner: str
    pid: str
    run_id: str
    request_id: str | None
    call_id: str
    tool_name: str
    syscall: str
    args_digest: str
    args_preview: str
    tags: list[str]
    decision: AuditDecision
    remembered: str | None = None
    edited: bool = False
    answered_by: str | None = None
    decided_at: float = 0.0


def audit_row(r: Any) -> ApprovalAuditRow:
    """An ``approval_audit`` row (``schema.AUDIT_COLUMNS``) as an ``ApprovalAuditRow``."""
    return ApprovalAuditRow(
        r[0],
        r[1],
        r[2],
        r[3],
        r[4],
        r[5],
        r[6],
        r[7],
        r[8],
        r[9],
        json.loads(r[10]),
        r[11],
        r[12],
        bool(r[13]),
        r[14],
        r[15],
    )


def audit_values(row: ApprovalAuditRow) -> tuple[Any, ...]:
    """``row``'s column values, in ``schema.AUDIT_COLUMNS``' order (``audit_row`` reads them back)."""
    return (
        row.id,
        row.owner,
        row.pid,
        row.run_id,
        row.request_id,
        row.call_id,
        row.tool_name,
        row.syscall,
        row.args_digest,
        row.args_preview,
        json.dumps(row.tags, separators=(",", ":")),
        row.decision,
        row.remembered,
        int(row.edited),
        row.answered_by,
        float(row.decided_at),
    )


@dataclass
class EventRow:
    seq: int
    signal: str
    payload: dict[str, Any]
    created_at: float = 0.0


@dataclass
class AccountEventRow:
    """An account-level signal as the account log keeps it: its ``seq`` in the owner's log, and
    the process it is of with its seq in that process's log (``pid_seq``)."""

    seq: int
    pid: str
    pid_seq: int
    signal: str
    payload: dict[str, Any]
    created_at: float = 0.0


@dataclass
class SegmentRow:
    id: str
    pid: str
    generation: int
    kind: str
    from_message_id: int
    to_message_id: int
    archive_path: str | None = None
    summary_message_id: int | None = None
    created_at: float = 0.0


@dataclass
class ScheduleRow:
    """A system event to deliver to ``pid`` at ``next_due`` (epoch seconds), then every ``every``
    seconds, or at the times the ``cron`` expression names in time zone ``tz`` (neither: once)."""

    id: str
    pid: str
    text: str
    next_due: float
    every: float | None = None
    name: str | None = None
    created_at: float = 0.0
    cron: str | None = None
    tz: str | None = None


@dataclass
class WatchRow:
    """Process ``pid`` is told when process ``source_pid`` logs ``signal``. ``seen_seq``: the
    source's log has been read up to there; ``once``: the watch ends after its first delivery."""

    id: str
    pid: str
    source_pid: str
    signal: str
    once: bool = True
    seen_seq: int = 0
    created_at: float = 0.0


@dataclass(slots=True)
class AccountRecord:
    name: str
    admin: bool = False
    created_at: float = 0.0


@dataclass(slots=True)
class TokenRecord:
    """A bearer token as stored: only its hash, never the token itself."""

    id: str
    account: str
    hash: str
    label: str = ""
    created_at: float = 0.0
    revoked_at: float | None = None


@dataclass(slots=True)
class DeviceRecord:
    """A device in the registry: an owner's name for one machine, the id of the token bound to it
    (None: none, or revoked), and when it was first and last connected (None: never yet)."""

    owner: str
    name: str
    label: str = ""
    description: str = ""
    token_id: str | None = None
    created_at: float = 0.0
    first_seen_at: float | None = None
    last_seen_at: float | None = None


DeviceEvent: TypeAlias = Literal["status", "revoked", "forgotten"]


@dataclass(frozen=True, slots=True)
class DeviceNews:
    """A device event one worker committed, for the others sharing the store (``notify_device``):
    the device's connection lives on one worker only, and the owner's account stream may be
    followed through any. ``status``: it went online or offline (``detail`` is its
    ``device.status`` payload, for the account watchers elsewhere). ``revoked``: its token was
    revoked (``{"revoked": its id}``: a connection with that token must close) or replaced
    (``{"token_id": the new one's id}``: a connection with another device token must close).
    ``forgotten``: it left the registry, so its connection must close whatever token it used."""

    owner: str
    name: str
    event: DeviceEvent
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Lease:
    """Who may advance a process (DESIGN §6): ``owner`` (None: nobody) until ``expires`` (epoch
    seconds on the store's clock), and the ``epoch`` of that claim, which fences its commits."""

    pid: str
    owner: str | None
    epoch: int
    expires: float


@dataclass(slots=True)
class DutyLease:
    """Kernel-wide work one worker does at a time (firing the schedules), as a lease by ``name``:
    ``owner`` (None: nobody) until ``expires`` (epoch seconds on the store's clock); ``epoch``
    counts the times it changed hands."""

    name: str
    owner: str | None
    epoch: int
    expires: float


Settled: TypeAlias = Callable[[BaseException | None], None]
Notified: TypeAlias = Callable[[str, str], None]  # (pid, sender): a process changed on some worker
RelayBatch: TypeAlias = tuple[str, int, list[dict[str, Any]]]  # (pid, base seq, payloads): see process/relay.py


class LiveListener(Protocol):
    """Who hears the relayed progress signals of the other workers (see process/relay.py)."""

    def relayed(self, sender: str, batches: list[RelayBatch]) -> None: ...

    def followed(self, sender: str, pids: list[str]) -> None: ...


class Transaction(ABC):
    """What ``Store.transaction()`` returns. ``async with store.transaction():`` suits most
    callers. The durable runner uses the two halves itself (``begin``, then ``end``), because it
    keeps caches that must follow the store's state the moment a step's body ends, while what
    the world may see of the step (signals, started tools) must wait until the step is durable.
    """

    __slots__ = ()

    @abstractmethod
    async def begin(self) -> None: ...

    @abstractmethod
    def end(self, commit: bool, settled: Settled | None = None) -> Awaitable[None] | None:
        """Close the body: roll it back, or keep it. Kept changes are visible to this store at
        once. ``None`` means they are committed already. An awaitable means they ride in a group
        commit with the transactions of other tasks: it completes once the group is durable and
        raises if the group failed, and ``settled`` is called at that moment, with the error or
        ``None``, whether or not anyone is still awaiting (a cancelled task's step stays valid)."""

    async def __aenter__(self) -> None:
        await self.begin()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        pending = self.end(commit=kind is None)
        if pending is not None:
            await pending


class Store(ABC):
    """A durable store. Writes happen inside ``transaction()``; reads may happen anywhere."""

    # -- lifecycle ------------------------------------------------------------------------------

    @abstractmethod
    async def open(self) -> None:
        """Connect and bring the schema up to date."""

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def transaction(self) -> Transaction:
        """One atomic unit of change: everything inside commits together or not at all."""

    @abstractmethod
    async def schema_version(self) -> int: ...

    # -- registry -------------------------------------------------------------------------------

    @abstractmethod
    async def create_process(self, record: ProcessRecord) -> None: ...

    @abstractmethod
    async def get_process(self, pid: str) -> ProcessRecord | None: ...

    @abstractmethod
    async def list_processes(self, owner: str | None = None) -> list[ProcessRecord]: ...

    @abstractmethod
    async def count_processes(self, owner: str, *, top_level_only: bool = False) -> int:
        """How many live (not killed) processes ``owner`` has; with ``top_level_only``, only those
        without a parent (its conversations: the subagents a ``Task`` call makes are left out)."""

    @abstractmethod
    async def update_process(self, pid: str, **fields: Any) -> None:
        """Set ``state``, ``current_run``, ``history_generation``, ``cwd``, ``context``,
        ``interactive`` or the usage totals (``common.usage_columns``), or add to the totals:
        ``usage_added`` (``UsageTotals``) is added to the stored ones by the UPDATE itself
        (``usage_input = usage_input + ?``), so two writers that each add what they spent lose
        nothing of each other's, whichever commits first. The durable runner adds a run's usage
        so when the run ends, in the one UPDATE of its registry row."""

    async def add_usage(self, pid: str, added: UsageTotals) -> bool:
        """Add ``added`` to the process's usage totals in a transaction of its own (a model call
        made outside the runner's transactions: a title, the memories a reset keeps). An
        increment (see ``update_process``): a run ending meanwhile loses nothing, nor does this.
        False, and nothing written, when the process does not exist (killed: its totals were
        folded into its owner's already, and what came later is not counted)."""
        try:
            async with self.transaction():
                await self.update_process(pid, usage_added=added)
        except NoSuchProcess:
            return False
        return True

    @abstractmethod
    async def delete_process(self, pid: str) -> None:
        """Remove the process and every row it owns, its schedules and its signal watches (those
        it holds and those on it). Its pid is remembered (``was_killed``), never given again. Its
        usage totals are added to its owner's (``account_usage``): the account spent them."""

    @abstractmethod
    async def account_usage(self, owner: str) -> UsageTotals:
        """What ``owner``'s processes have spent: the live ones' totals and the deleted ones'."""

    @abstractmethod
    async def spent_before(self, account: str, period: str, spent: float) -> float:
        """What ``account`` had spent when budget ``period`` (a name such as ``2026-11``) began for
        it: the ``spent`` the first call for the period gives (kept), the kept value after."""

    @abstractmethod
    async def was_killed(self, pid: str) -> bool:
        """Whether a process with this pid existed and was deleted."""

    # -- history --------------------------------------------------------------------------------

    @abstractmethod
    async def append_messages(self, pid: str, run_id: str | None, messages: list[Message]) -> list[int]:
        """Append to the current history generation; returns the new ids, in order."""

    @abstractmethod
    async def history(
        self, pid: str, *, generation: int | None = None, limit: int | None = None, before: int | None = None
    ) -> list[StoredMessage]:
        """Messages of a generation (default: current) in id order; with ``limit``, the newest
        ``limit`` before id ``before``."""

    @abstractmethod
    async def replace_messages(self, pid: str, from_id: int, to_id: int, replacement: Message) -> int:
        """Replace the messages with ids in [from_id, to_id] by one message (compaction); returns its id."""

    @abstractmethod
    async def update_messages(self, pid: str, updates: list[tuple[int, Message]]) -> None:
        """Rewrite messages in place, by id (old tool outputs cleared to save context)."""

    @abstractmethod
    async def delete_run_messages(self, pid: str, run_id: str) -> int:
        """Delete the messages run ``run_id`` added (a heartbeat that only acknowledged); how many."""

    @abstractmethod
    async def truncate_messages(self, pid: str, after_id: int) -> int:
        """Delete the current history's messages with ids above ``after_id`` (a rewind: what
        follows a message goes, what precedes it stays as it was); how many. Ids are never given
        again: the next message appended gets a new one."""

    @abstractmethod
    async def new_generation(self, pid: str) -> int:
        """Start an empty history (reset); old generations' messages are deleted."""

    # -- tool calls -----------------------------------------------------------------------------

    @abstractmethod
    async def register_calls(self, rows: list[ToolCallRow]) -> None: ...

    @abstractmethod
    async def calls(self, pid: str, run_id: str | None = None) -> list[ToolCallRow]:
        """Pending tool calls of a process (or one run), by run then position."""

    @abstractmethod
    async def set_call_status(
        self,
        dispatch_id: str,
        status: CallStatus,
        *,
        expect: tuple[CallStatus, ...],
        result: dict[str, Any] | None = None,
        deadline: float | None = None,
    ) -> bool:
        """Move a call to ``status`` only if it is in one of ``expect`` (a claim): False otherwise,
        which is how late or duplicate results are ignored."""

    @abstractmethod
    async def delete_calls(self, pid: str, run_id: str | None = None) -> None: ...

    # -- input queue ----------------------------------------------------------------------------

    @abstractmethod
    async def enqueue(
        self, pid: str, kind: QueueKind, message: Message, run_id: str | None = None, reason: str | None = None
    ) -> int:
        """Add to the queue; returns the item id (FIFO order). ``reason``: the run reason the item
        starts its run with when it is promoted (None: ``queue.promote``)."""

    @abstractmethod
    async def queue(self, pid: str) -> list[QueueItem]: ...

    @abstractmethod
    async def dequeue(self, pid: str, item_id: int) -> bool: ...

    # -- approvals ------------------------------------------------------------------------------

    @abstractmethod
    async def put_hil(self, row: HilRow) -> None: ...

    @abstractmethod
    async def hils(self, pid: str) -> list[HilRow]: ...

    @abstractmethod
    async def account_hils(self, owner: str) -> list[HilRow]:
        """The pending approvals of every live process of ``owner``, oldest first: one query for an
        inbox, instead of one per process."""

    @abstractmethod
    async def delete_hil(self, request_id: str) -> bool: ...

    # -- the approvals audit --------------------------------------------------------------------

    @abstractmethod
    async def add_approval_audit(self, row: ApprovalAuditRow) -> None:
        """Inside the transaction that carries the decision out: append ``row`` (never updated)."""

    @abstractmethod
    async def approval_audit(
        self,
        owner: str,
        *,
        limit: int,
        pid: str | None = None,
        since: float | None = None,
        decision: str | None = None,
        answered_by: str | None = None,
        before: str | None = None,
    ) -> list[ApprovalAuditRow]:
        """``owner``'s audit rows, newest first (by id), at most ``limit``: of process ``pid``,
        decided at or after ``since``, with that ``decision``, answered by that account, and with
        an id below ``before`` (the last id of the page before), for those given."""

    # -- key-value ------------------------------------------------------------------------------

    @abstractmethod
    async def kv_get(self, pid: str, key: str) -> Any | None: ...

    @abstractmethod
    async def kv_set(self, pid: str, key: str, value: Any) -> None: ...

    @abstractmethod
    async def kv_delete(self, pid: str, key: str) -> None: ...

    @abstractmethod
    async def kv_add(self, pid: str, key: str, value: Any, *, generation: int) -> bool:
        """Add the row unless the process has one for ``key`` already, is gone, or has moved past
        history ``generation`` (a reset): a value for one conversation that never overwrites
        another, checked and written in one statement. Whether it was added."""

    @abstractmethod
    async def kv_values(self, key: str, owner: str | None = None) -> dict[str, Any]:
        """pid -> the value of ``key`` for each process of ``owner`` (of any owner with None) that
        has one: one query for a list, instead of one per process."""

    async def kv_many(self, pid: str, keys: Sequence[str]) -> dict[str, Any]:
        """The rows of ``keys`` that exist, by key. The stores read them in one query: a run's
        configuration reads several rows, and a query per row would be paid by every run."""
        found = {key: await self.kv_get(pid, key) for key in keys}
        return {key: value for key, value in found.items() if value is not None}

    # -- signal log -----------------------------------------------------------------------------

    @abstractmethod
    async def append_event(self, pid: str, signal: str, payload: dict[str, Any]) -> int:
        """Append a signal; returns its sequence number (1, 2, 3 … per process)."""

    @abstractmethod
    async def append_events(self, pid: str, events: list[tuple[str, dict[str, Any]]]) -> list[int]:
        """Append several signals at once; returns their sequence numbers."""

    async def notify_account(self, owner: str, pid: str, signals: list[tuple[int, int, str, dict[str, Any]]]) -> None:
        """Inside a transaction: tell the other workers sharing the store of ``owner``'s
        account-level signals (account seq, seq, name, payload) just logged for ``pid``, for their
        account streams, once the transaction commits. A store no other worker shares has none to
        tell. Best-effort: a worker that misses one finds the gap in the account seqs and reads
        the account log."""
        return None

    async def notify_device(self, news: DeviceNews) -> None:
        """Inside a transaction: tell the other workers sharing the store of a device event
        (``DeviceNews``), once the transaction commits (never for a rollback: a revoke that did
        not happen closes nothing). A store no other worker shares has none to tell. Best-effort:
        a worker that misses a revoke or a forget still closes the connection at its next token
        check (the heartbeat's), one that misses a presence change only shows it late."""
        return None

    # -- account log ----------------------------------------------------------------------------

    @abstractmethod
    async def append_account_events(
        self, owner: str, pid: str, events: list[tuple[int, str, dict[str, Any]]]
    ) -> list[int]:
        """Inside a transaction: copy account-level signals of ``owner``'s process ``pid`` (its
        seq, name, payload) to the owner's account log; returns their account seqs, in order.
        The numbering is per owner, gapless and in commit order: a second transaction of the
        same owner's waits here until the first has committed (or rolled back, leaving no gap),
        so whatever is numbered below a committed account seq is committed too."""

    @abstractmethod
    async def account_events(self, owner: str, after_seq: int = 0, limit: int = 1000) -> list[AccountEventRow]:
        """The owner's account log after ``after_seq``, oldest first."""

    @abstractmethod
    async def last_account_seq(self, owner: str) -> int:
        """The account seq of the owner's newest logged account signal (0 when none)."""

    async def last_account_seqs(self, owners: Sequence[str]) -> dict[str, int]:
        """``last_account_seq`` of each of ``owners`` (those with none left out); a dialect that
        several workers share answers in one query (each worker's poll asks of every owner whose
        account stream it serves)."""
        found = {owner: await self.last_account_seq(owner) for owner in owners}
        return {owner: seq for owner, seq in found.items() if seq}

    @abstractmethod
    async def prune_account_events(self, owner: str, *, through: int) -> int:
        """Inside a transaction: drop the owner's account log up to ``through``, but never its
        newest row (the numbering goes on from it); returns how many."""

    @abstractmethod
    async def events(self, pid: str, after_seq: int = 0, limit: int = 1000) -> list[EventRow]: ...

    @abstractmethod
    async def last_event_seq(self, pid: str) -> int:
        """The sequence number of the process's newest logged signal (0 when none)."""

    @abstractmethod
    async def prune_events(self, pid: str, *, through: int | None = None) -> int:
        """Drop the process's logged signals up to seq ``through`` (all when None) that no watch
        on it has still to read (those up to the lowest ``seen_seq`` of the watches whose source
        it is); returns how many. A reset's: the conversation they tell of is archived and gone;
        and a long conversation's oldest, past what the log keeps (``signals.KEPT_SIGNALS``): a
        log kept for ever would grow with every tool output. The sequence goes on unchanged."""

    # -- history segments -----------------------------------------------------------------------

    @abstractmethod
    async def add_segment(self, row: SegmentRow) -> None: ...

    @abstractmethod
    async def segments(self, pid: str) -> list[SegmentRow]: ...

    @abstractmethod
    async def delete_segment(self, segment_id: str) -> bool:
        """Inside a transaction: drop a segment row (retention removed its archive, so the row
        would only lead to a file that is gone); False if there was none."""

    # -- retention (kernel/retention.py) --------------------------------------------------------

    @abstractmethod
    async def idle_processes(self, before: float, pids: Sequence[str] | None = None) -> list[ProcessRecord]:
        """Live processes with nothing under way or waiting and nothing done since ``before``,
        least recently active first: state idle with no run, nothing queued, no pending approval
        or tool call, no schedule, no watch held or on it, and neither the registry row
        (``created_at``, ``updated_at``) nor the newest message or logged signal at or after
        ``before``. Children are listed like any other: whether one goes with its parent is the
        caller's to judge.

        With ``pids``, inside a transaction: only those, with their rows locked first (changing
        none), so that a writer to one of them (a send, a run starting) either committed before
        this look, and is seen, or waits for the transaction's end: what is found idle stays so
        until then (retention's kill decides and deletes in that one transaction). A row another
        transaction holds already may make the answer empty (that process is at work), leaving
        the transaction to be ended by the caller."""

    @abstractmethod
    async def exclusive(self, key: str) -> None:
        """Inside a transaction: hold ``key`` until it ends, against the transactions of every
        worker sharing the store. A check and the write it allows (a count under a limit, a cycle
        check) done under one key cannot interleave with another pair's, wherever that runs."""

    # -- schedules ------------------------------------------------------------------------------

    @abstractmethod
    async def add_schedule(self, row: ScheduleRow) -> None: ...

    @abstractmethod
    async def schedules(self, pid: str) -> list[ScheduleRow]:
        """A process's schedules, soonest first."""

    @abstractmethod
    async def due_schedules(self, before: float | None, limit: int = 100) -> list[ScheduleRow]:
        """Schedules of every process due at or before ``before`` (None: any time), soonest first."""

    @abstractmethod
    async def set_schedule_due(self, schedule_id: str, next_due: float, *, expect: float) -> bool:
        """Move a schedule to ``next_due`` only if it is still due at ``expect`` (a claim): False
        when it was moved or deleted meanwhile."""

    @abstractmethod
    async def delete_schedule(self, schedule_id: str) -> bool: ...

    # -- signal watches -------------------------------------------------------------------------

    @abstractmethod
    async def add_watch(self, row: WatchRow) -> None: ...

    @abstractmethod
    async def watches(self, *, pid: str | None = None, source_pid: str | None = None) -> list[WatchRow]:
        """Watches held by ``pid`` and/or on ``source_pid`` (every watch when both are None), oldest first."""

    @abstractmethod
    async def set_watch_seen(self, watch_id: str, seq: int, *, expect: int | None = None) -> bool:
        """Record that the watch has read its source's log up to ``seq``; False if it is gone or,
        with ``expect``, no longer at ``expect`` (a claim: another worker moved it meanwhile)."""

    @abstractmethod
    async def delete_watch(self, watch_id: str) -> bool: ...

    @abstractmethod
    async def lagging_watches(self, before: float) -> list[str]:
        """The sources (pids, sorted) of watches whose source logged a signal they want after
        their ``seen_seq`` and before the time ``before``: deliveries still owed. On a shared
        store the worker that published the signal delivers it; this finds what a worker that
        died in between left undelivered."""

    # -- leases (DESIGN §6; see process/lease.py) ------------------------------------------------
    # Claims, renewals and releases commit on their own: call them outside ``transaction()``.
    # ``fence`` and ``notify`` belong to the caller's open transaction.

    shared: bool = False  # several workers may use this store's database at once (leases needed)

    @abstractmethod
    def hold_runtime(self) -> None:
        """Claim the open database for one runtime (a kernel that drives its processes) until the
        store closes. Runtimes sharing a store coordinate with leases; a store that is not
        ``shared`` has none, so two runtimes would both drive the same processes (a tool run
        twice): such a store refuses the second claim with ``StoreError``."""

    @abstractmethod
    async def claim_lease(self, pid: str, owner: str, ttl: float) -> int | None:
        """Take ``pid``'s lease for ``ttl`` seconds if it is free, expired, or ``owner``'s already;
        returns the claim's epoch (one more than the last), None when another owner holds it."""

    @abstractmethod
    async def claim_orphans(
        self, owner: str, ttl: float, limit: int = 100, *, reclaim: bool = False
    ) -> list[tuple[str, int]]:
        """The sweep: claim processes that have work (an active run, queued input) and no live
        lease (none, released, or expired: their worker died); returns (pid, epoch) pairs. Rows
        another claimer is looking at are skipped, not waited for. ``reclaim``: ``owner``'s own
        leases count as orphans too (a worker restarted under the same name, whose previous
        life cannot commit any more once the epoch moved on)."""

    @abstractmethod
    async def renew_leases(self, owner: str, ttl: float) -> dict[str, int]:
        """Extend every lease ``owner`` holds to ``ttl`` seconds from now; returns pid -> epoch of
        the leases it still holds (one missing was taken over after it expired)."""

    @abstractmethod
    async def release_lease(self, pid: str, owner: str, epoch: int) -> bool:
        """Free the lease if it is still ``owner``'s claim ``epoch``; False otherwise."""

    @abstractmethod
    async def lease(self, pid: str) -> Lease | None:
        """The process's lease row, or None if it was never claimed."""

    @abstractmethod
    async def fence(self, pid: str, owner: str, epoch: int, ttl: float) -> bool:
        """Inside a transaction: whether ``owner`` still holds claim ``epoch`` of the lease, which
        it extends by ``ttl``. The row stays locked until the transaction ends, so a claim waits
        for the commit and then finds the lease alive: a step commits only under its lease. A
        fence that holds also does what ``notify(pid, owner)`` does."""

    @abstractmethod
    async def claim_duty(self, name: str, owner: str, ttl: float) -> int | None:
        """Take the duty ``name`` for ``ttl`` seconds if it is free, expired, or ``owner``'s
        already (which renews it); returns its epoch (one more than the last when it changes
        hands, the same while ``owner`` keeps it), None when another owner holds it."""

    @abstractmethod
    async def release_duty(self, name: str, owner: str) -> bool:
        """Free the duty if ``owner`` holds it; False otherwise."""

    @abstractmethod
    async def duty(self, name: str) -> DutyLease | None:
        """The duty's row, or None if it was never claimed."""

    async def notify(self, pid: str, sender: str) -> None:
        """Inside a transaction: tell the other workers, once it commits, that ``pid`` changed.
        A store one worker has to itself has nobody to tell."""
        return None

    async def listen(
        self, notified: Notified, live: LiveListener | None = None
    ) -> Callable[[], Awaitable[None]] | None:
        """Call ``notified`` for every ``notify`` of any worker (this one's too), and ``live``
        for every ``relay`` and ``follow_live`` (and, when it has them, its ``accounted`` and
        ``deviced`` for the other workers' ``notify_account`` and ``notify_device``); returns how
        to stop listening, or None when the store has no cross-worker channel."""
        return None

    async def relay(self, sender: str, batches: list[RelayBatch]) -> None:
        """Send live progress signals to the other workers now (outside any transaction;
        best-effort: nothing is stored). Nobody to send them to on a store one worker has to
        itself."""
        return None

    async def follow_live(self, sender: str, pids: list[str]) -> None:
        """Tell the other workers that ``sender``'s watchers follow ``pids`` (as ``relay``)."""
        return None

    # -- accounts and tokens --------------------------------------------------------------------

    @abstractmethod
    async def create_account(self, record: AccountRecord) -> None:
        """Add an account; ``StoreError`` if the name is taken."""

    @abstractmethod
    async def get_account(self, name: str) -> AccountRecord | None: ...

    @abstractmethod
    async def list_accounts(self) -> list[AccountRecord]: ...

    @abstractmethod
    async def add_token(self, record: TokenRecord) -> None: ...

    @abstractmethod
    async def token_by_hash(self, token_hash: str) -> TokenRecord | None: ...

    @abstractmethod
    async def list_tokens(self, account: str | None = None) -> list[TokenRecord]: ...

    @abstractmethod
    async def revoke_token(self, token_id: str, at: float) -> bool:
        """Mark a token revoked; False if there is no such token or it was already revoked."""

    # -- the device registry --------------------------------------------------------------------

    @abstractmethod
    async def set_device_token(
        self, owner: str, name: str, token_id: str | None, token_hash: str | None, at: float
    ) -> bool:
        """Bind a token to ``owner``'s device ``name`` (the device is registered if new; a token
        bound before is replaced), or with None unbind it (revoke): False if it had none."""

    @abstractmethod
    async def device_by_token(self, token_hash: str) -> DeviceRecord | None:
        """The device a live token is bound to."""

    @abstractmethod
    async def device_seen(
        self, owner: str, name: str, at: float, label: str | None = None, description: str | None = None
    ) -> None:
        """Record a device connecting or leaving at ``at`` (registered if new): its last seen,
        its first seen if it had none, and the label and description it gave (None: kept)."""

    @abstractmethod
    async def list_devices(self, owner: str | None = None) -> list[DeviceRecord]:
        """The registry (one owner's devices, or every one), by owner and name."""

    @abstractmethod
    async def forget_device(self, owner: str, name: str) -> bool:
        """Remove ``owner``'s device ``name`` from the registry, the token bound to it with it (it
        no longer resolves): False if there was no such device."""
