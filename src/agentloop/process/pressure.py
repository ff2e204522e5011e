"""Context pressure (how full a process's context window is) and its compaction policy.

The driver measures the context after every model step anyway (compaction has to), so the
pressure costs a division: the reply's own usage where the provider reported it, else the
estimate the step already made before its call plus the reply's. A process's *level* (ok, warn,
critical, full) is what a person acts on, and it changes rarely; so the cache keeps the newest
tokens and the band of ratios the known level spans, a step inside it does nothing more, and only
a change of level is written (``process_kv`` ``context``) and logged (``proc.changed`` with
``changes: ["context"]``), inside the commit of the step that changed it. Watchers see it at the
moment it happens, a restart finds it, and the common step neither writes nor builds anything.

The policy (``process_kv`` ``compaction``) lets one process compact earlier or later than the
kernel's threshold, keep more or less recent history, or refuse to compact on an overflow (a run
whose history must stay verbatim fails instead). It is read with the run's configuration, once
per run, like the mode: a change applies from the next run on.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeAlias

from agentloop.loop.compaction import usable_window
from agentloop.messages import AssistantMessage
from agentloop.models.base import ModelInfo
from agentloop.process import signals as sig
from agentloop.process.store import NoSuchProcess, ProcessRecord, Store

if TYPE_CHECKING:
    from agentloop.process.engine import ProcessEngine
    from agentloop.process.tx import _Live, _Tx

log = logging.getLogger("agentloop.process")

ContextLevel: TypeAlias = Literal["ok", "warn", "critical", "full"]
Overflow: TypeAlias = Literal["compact", "fail"]
Band: TypeAlias = tuple[float, float, int]  # ratios [low, high) of one level, of a window of so many tokens

WARN_AT = 0.7  # a share of the usable window (the model's window less its output budget)
CRITICAL_AT = 0.85  # (or the compaction threshold, if lower: compaction is what comes next)
FULL_AT = 1.0
LEVELS: tuple[ContextLevel, ...] = ("ok", "warn", "critical", "full")

CONTEXT_KEY = "context"  # the reading of the last change of level
COMPACTION_KEY = "compaction"  # the process's policy; absent: the kernel's defaults
MAX_KEEP_RECENT = 10_000_000  # tokens: larger than any window, so surely a mistake


def context_level(ratio: float, threshold: float) -> ContextLevel:
    """The level of a context ``ratio`` full, for a process that compacts at ``threshold``."""
    if ratio >= FULL_AT:
        return "full"
    if ratio >= min(CRITICAL_AT, threshold):
        return "critical"
    return "warn" if ratio >= WARN_AT else "ok"


class ContextReading(NamedTuple):
    """How full the context was after a model step: ``tokens`` of ``window`` (usable) tokens. (A
    tuple: one is made at every model step, and a frozen dataclass costs three times as much.)"""

    level: ContextLevel
    ratio: float
    tokens: int
    window: int

    @classmethod
    def of(cls, tokens: int, info: ModelInfo, threshold: float) -> ContextReading:
        window = usable_window(info)
        ratio = tokens / window
        return cls(context_level(ratio, threshold), ratio, tokens, window)

    @classmethod
    def stored(cls, value: Any) -> ContextReading | None:
        """The row as written by ``as_dict``, or None for anything else (a damaged row is no reading)."""
        if not isinstance(value, dict) or value.get("level") not in LEVELS:
            return None
        ratio, tokens, window = value.get("ratio"), value.get("tokens"), value.get("window")
        if not isinstance(ratio, int | float) or not isinstance(tokens, int) or not isinstance(window, int):
            return None
        return cls(value["level"], float(ratio), tokens, window)

    def as_dict(self) -> dict[str, Any]:
        return {"level": self.level, "ratio": round(self.ratio, 4), "tokens": self.tokens, "window": self.window}


@dataclass(frozen=True, slots=True)
class CompactionPolicy:
    """One process's compaction settings; None: the kernel's (``threshold``) or the computed
    default (``keep_recent_tokens``: a quarter of the room the history has)."""

    threshold: float | None = None
    overflow: Overflow = "compact"
    keep_recent_tokens: int | None = None

    @classmethod
    def stored(cls, value: Any) -> CompactionPolicy:
        """The policy a row holds; the defaults (logged) for a row that does not hold one."""
        if value is None:
            return DEFAULT_POLICY
        try:
            if not isinstance(value, dict):
                raise TypeError(f"a policy is an object, not {type(value).__name__}")
            return check_policy(value.get("threshold"), value.get("overflow"), value.get("keep_recent_tokens"))
        except (TypeError, ValueError) as exc:
            log.warning("a stored compaction policy was ignored (the defaults apply): %s", exc)
            return DEFAULT_POLICY

    def as_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "overflow": self.overflow, "keep_recent_tokens": self.keep_recent_tokens}


DEFAULT_POLICY = CompactionPolicy()


def check_policy(threshold: object, overflow: object, keep_recent_tokens: object) -> CompactionPolicy:
    """A policy from values a caller gave, or ``TypeError``/``ValueError`` naming the bad one."""
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, int | float):
            raise TypeError(f"threshold must be a number, got {type(threshold).__name__}")
        if not 0 < threshold <= 1:  # (NaN fails this too)
            raise ValueError(f"threshold must be above 0 and at most 1 (a share of the window), got {threshold}")
    if overflow not in ("compact", "fail"):
        raise ValueError(f"overflow must be compact or fail, got {overflow!r:.60}")
    if keep_recent_tokens is not None:
        if isinstance(keep_recent_tokens, bool) or not isinstance(keep_recent_tokens, int):
            raise TypeError(f"keep_recent_tokens must be an integer, got {type(keep_recent_tokens).__name__}")
        if not 0 < keep_recent_tokens <= MAX_KEEP_RECENT:
            raise ValueError(f"keep_recent_tokens must be between 1 and {MAX_KEEP_RECENT}, got {keep_recent_tokens}")
    return CompactionPolicy(
        None if threshold is None else float(threshold),
        "fail" if overflow == "fail" else "compact",
        keep_recent_tokens,
    )


@dataclass(frozen=True, slots=True)
class ProcessContext:
    """``Process.context()``: the latest reading, the policy set for the process's runs, and the
    threshold that applies (the policy's, else the kernel's)."""

    level: ContextLevel
    ratio: float
    tokens: int
    window: int
    policy: CompactionPolicy
    threshold: float

    def as_dict(self) -> dict[str, Any]:
        reading = ContextReading(self.level, self.ratio, self.tokens, self.window).as_dict()
        return {**reading, "threshold": self.threshold, "policy": self.policy.as_dict()}


# ------------------------------------------------------------------ in the driver


def threshold_of(engine: ProcessEngine, policy: CompactionPolicy) -> float:
    return engine.compaction_threshold if policy.threshold is None else policy.threshold


def run_keys(live: _Live) -> tuple[str, ...]:
    """The rows a run's configuration reads besides the mode: the policy, and the stored level
    until this cache has read it once (it is the cache's from then on: only it writes the row)."""
    return (COMPACTION_KEY,) if live.context_known else (COMPACTION_KEY, CONTEXT_KEY)


def take_run_rows(engine: ProcessEngine, live: _Live, rows: dict[str, Any], info: ModelInfo) -> None:
    """Keep what ``run_keys`` read (the run's policy; the stored reading at the first run), and the
    band of ratios the known level spans with this run's model and threshold."""
    live.policy = CompactionPolicy.stored(rows.get(COMPACTION_KEY))
    if not live.context_known:
        _know(live, rows.get(CONTEXT_KEY))
    live.context_band = level_band(_level(live.context), usable_window(info), threshold_of(engine, live.policy))


def level_band(level: ContextLevel, window: int, threshold: float) -> Band:
    """The ratios ``[low, high)`` at which ``context_level`` says ``level``, and the window they are
    of: a step whose ratio stays inside is at the level known, so it writes nothing, and a
    comparison decides so (no reading is made)."""
    critical = min(CRITICAL_AT, threshold)
    if level == "ok":
        return -math.inf, min(WARN_AT, critical), window
    if level == "warn":
        return WARN_AT, critical, window  # (empty where the threshold is under WARN_AT)
    if level == "critical":
        return critical, FULL_AT, window
    return FULL_AT, math.inf, window


def step_reading(engine: ProcessEngine, live: _Live, info: ModelInfo, tokens: int) -> ContextReading | None:
    """After a model step measured ``tokens``: the cache keeps them; the reading to write down
    (``note_context``) unless the level is still the one known (None, the usual case)."""
    live.context_tokens = tokens
    band = live.context_band
    if band is not None and band[0] <= tokens / band[2] < band[1]:
        return None
    return ContextReading.of(tokens, info, threshold_of(engine, live.policy))


async def note_context(tx: _Tx, live: _Live, reading: ContextReading) -> None:
    """Inside a step's transaction: where the level of ``reading`` differs from the last one known
    (none: ok), write it and log ``proc.changed``; the cache takes it once the step commits. The
    caller makes sure the stored level was read (``run_keys``)."""
    if reading.level != _level(live.context):
        await tx.engine.store.kv_set(live.record.pid, CONTEXT_KEY, reading.as_dict())
        await tx.signal(sig.CHANGED, changes=["context"], **reading.as_dict())
    band = level_band(reading.level, reading.window, threshold_of(tx.engine, live.policy))

    def keep() -> None:
        live.context, live.context_tokens, live.context_band = reading, reading.tokens, band

    tx.after.append(keep)


def _level(reading: ContextReading | None) -> ContextLevel:
    return "ok" if reading is None else reading.level


async def know_context(store: Store, live: _Live) -> None:
    """Read the stored level into the cache, where no run has yet (a compaction while idle)."""
    if not live.context_known:
        _know(live, await store.kv_get(live.record.pid, CONTEXT_KEY))


def _know(live: _Live, stored: Any) -> None:
    """The cache takes the stored level row (``stored``: its value, None where there is none)."""
    live.context = ContextReading.stored(stored)
    live.context_known = True


async def forget_context(tx: _Tx, live: _Live) -> None:
    """Inside a reset's transaction: an empty history starts at ok, with nothing stored."""
    await tx.engine.store.kv_delete(live.record.pid, CONTEXT_KEY)

    def forget() -> None:
        live.context, live.context_tokens, live.context_band, live.context_known = None, None, None, True

    tx.after.append(forget)


OVERFLOW_REFUSED = (
    "(This process's compaction policy is overflow=fail, so the conversation was not compacted: compact "
    "it now, reset it, or set overflow to compact.)"
)


def refused_overflow(reply: AssistantMessage, window: int) -> AssistantMessage:
    """An overflow the policy does not compact, as the error that ends the run. A provider that
    cut the prompt without saying so answered something: it is not kept, being an answer to part
    of the conversation."""
    if reply.stop_reason == "error":
        return reply
    seen = reply.usage.input + reply.usage.cache_read
    why = f"the prompt ({seen} input tokens) exceeds the context window of {window} tokens: the provider cut it"
    return replace(reply, content=[], stop_reason="error", error_message=why)


# ------------------------------------------------------------------ for the Process handle


async def load_policy(store: Store, pid: str) -> CompactionPolicy:
    return CompactionPolicy.stored(await store.kv_get(pid, COMPACTION_KEY))


async def set_policy(engine: ProcessEngine, pid: str, policy: CompactionPolicy) -> None:
    """Store the policy (the defaults: no row), for the process's next run on."""
    live = await engine.live(pid)  # NoSuchProcess for an unknown or killed pid
    async with engine._tx(live) as tx:
        if policy == DEFAULT_POLICY:
            await engine.store.kv_delete(pid, COMPACTION_KEY)
        else:
            await engine.store.kv_set(pid, COMPACTION_KEY, policy.as_dict())
        await tx.signal(sig.CHANGED, changes=["compaction"])


async def context_of(engine: ProcessEngine, record: ProcessRecord) -> ProcessContext:
    """The process's context as this worker knows it: the cache's latest reading (every step's),
    else the stored one (the last change of level), else an empty window of the process's model."""
    if record.state == "killed":
        raise NoSuchProcess(record.pid)
    live = engine.cached(record.pid)
    if live is not None and live.context_known:
        reading = _latest(live)
    else:
        reading = ContextReading.stored(await engine.store.kv_get(record.pid, CONTEXT_KEY))
    policy = await load_policy(engine.store, record.pid)
    threshold = threshold_of(engine, policy)
    if reading is None:
        # (no step measured it yet: the window of the model its next run uses, its own choice included)
        reading = ContextReading.of(0, (await engine.effective_config(record)).model.info, threshold)
    return ProcessContext(reading.level, reading.ratio, reading.tokens, reading.window, policy, threshold)


def _latest(live: _Live) -> ContextReading | None:
    """The cache's reading with the newest step's tokens (a step at the level known keeps only those)."""
    tokens, band = live.context_tokens, live.context_band
    if tokens is None or band is None:
        return live.context
    return ContextReading(_level(live.context), tokens / band[2], tokens, band[2])


def overflow_advice(policy: CompactionPolicy, default: str) -> str:
    """What a run that failed on an overflow tells the person: why it was not compacted, if so."""
    return OVERFLOW_REFUSED if policy.overflow == "fail" else default
