"""Process titles: a short name per process, so lists (the web UI's sidebar, ``agentloop ps``, the
chat's ``/title``) need not show bare pids.

A title is the process_kv row ``title`` (``{"text", "source"}``): no migration, and it goes with
the process when it is killed. ``source`` is ``user`` for one a person set (``Process.set_title``),
which nothing automatic ever overwrites, or ``auto`` for one derived after the conversation's first
run. A reset clears an automatic title, since the fresh conversation is about something else and
earns its own, and keeps a person's, which names the process rather than one conversation.

Automatic titles stay off the hot path: the runs' own commits are untouched. The kernel's hub tap
notes a run that starts on an empty history (a conversation's first) and, once that run's end is
durable, the title is made. The default is cheap and deterministic, the first user message cut
short (``fallback_title``); ``titles="model"`` asks the process's model once, in a task of the
process's own (what it spends is added to the process's usage totals, as for the memories a reset
keeps: an increment in a transaction of its own, so a run of the process ending meanwhile loses
nothing of it, nor it of the run: ``ProcessEngine.add_usage``), and keeps that fallback when the
model fails or answers nothing usable; a ``TitleFn`` may replace the model (what it spends is its
own affair). A conversation begun by a system event waits for its first user message. The titles
made are written a moment later (``WRITE_DELAY``) by one background writer, all that came meanwhile
in one transaction, each row added only where no title is and only for the conversation it names
(``Store.kv_add``): a busy server pays a fraction of a commit per title, and what ends a run (the
abort's answer, the next queued run) goes first. Reset and kill cancel the work under way; close
writes what is made at once, and the fallback for a title a model is still being asked for.

Every change is announced with ``proc.changed`` (``changes: ["title"]``, ``title``), live only: the
log is the conversation's record and a title is state read with the process, so a watcher that
missed the announcement finds the title there. Account streams carry it too, for a sidebar that
lists every process. On a store several workers share, followers of another worker do not hear it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import unicodedata
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from agentloop.messages import Message, UserMessage, check_unicode, user
from agentloop.models.base import ModelRequest
from agentloop.process import signals as sig
from agentloop.process.signals import Signal
from agentloop.process.store import NoSuchProcess, ProcessRecord, Store

if TYPE_CHECKING:
    from agentloop.process.engine import ProcessEngine

log = logging.getLogger("agentloop.titles")

TITLE_KEY = "title"  # process_kv: {"text": str, "source": "user" | "auto"}
MAX_TITLE = 120  # characters of a title a person sets
FALLBACK_CHARS = 60  # of one cut from the first message
MODEL_CHARS = 80  # of one a model wrote
MODEL_INPUT = 4_000  # characters of the first message the model is shown
MODEL_TOKENS = 512  # the answer's budget (a reasoning model spends some before it answers)
MODEL_TIMEOUT = 30.0  # seconds: a slower model leaves the fallback in place
WRITE_DELAY = 0.05  # seconds the writer gathers titles for one transaction
RECOVER_SCAN = 200  # messages of a run resumed at start-up read to see whether it is a first run
TITLE_PROMPT = (
    "You name conversations. Answer with a title of at most eight words for the conversation that the"
    " user's message begins: the title alone, in plain text, without quotes or a full stop."
)
# What no title holds: control characters (Cc), line and paragraph separators, surrogates, and the
# bidirectional controls that would reorder what a list shows around the title
_CONTROL = frozenset(
    [
        *range(0x20),
        *range(0x7F, 0xA0),
        0x2028,
        0x2029,
        *range(0x202A, 0x202F),
        *range(0x2066, 0x206A),
        *range(0xD800, 0xE000),
    ]
)
_TO_SPACE = dict.fromkeys(_CONTROL, " ")
_FIRST_LINE = re.compile(r"\S[^\r\n]*")  # from the first character that is not blank to its line's end
_EDGES = " \"'`*_#~>“”‘’«»„"  # quotes and Markdown a model wraps a title in
_LABEL = re.compile(r"^title\s*:\s*", re.IGNORECASE)

TitleFn: TypeAlias = Callable[[ProcessRecord, str], Awaitable[str | None]]
Titling: TypeAlias = Literal["message", "model"] | TitleFn | None


def check_titling(titling: object) -> None:
    """What ``Kernel.open(titles=...)`` takes: refused at open, not at each first run."""
    if titling is not None and titling not in ("message", "model") and not callable(titling):
        raise ValueError(f"titles must be 'message', 'model', None or a function, got {titling!r}")


def check_title(text: str) -> str:
    """A title a person sets, trimmed: one line of plain text of at most ``MAX_TITLE`` characters.
    ``TypeError``/``ValueError`` otherwise, so nothing a list shows can break its line."""
    if not isinstance(text, str):
        raise TypeError(f"title must be a string, got {type(text).__name__}")
    check_unicode(text, "title")
    title = text.strip()
    if not title:
        raise ValueError("title must not be blank")
    if len(title) > MAX_TITLE:
        raise ValueError(f"title is longer than {MAX_TITLE} characters")
    bad = next((c for c in title if ord(c) in _CONTROL), None)
    if bad is not None:
        raise ValueError(f"title must be one line of plain text, without control characters (U+{ord(bad):04X})")
    if not any(_visible(c) for c in title):
        raise ValueError("title must have a visible character (it holds only invisible or blank ones)")
    return title


# Categories of what shows nothing by itself: controls, format characters (U+200B ZERO WIDTH SPACE,
# U+200D ZERO WIDTH JOINER, U+2060 WORD JOINER, U+FEFF), surrogates, spaces and separators, and
# combining marks (variation selectors among them), which only change the character before them.
_UNSEEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zs", "Zl", "Zp", "Mn", "Me"})
# Letters and symbols drawn as blank space: the Hangul fillers and the blank Braille pattern.
_BLANK_CHARS = frozenset("\u115f\u1160\u3164\uffa0\u2800")


def _visible(char: str) -> bool:
    """Whether ``char`` shows something by itself. A title of only zero-width or blank characters
    passes the blank check (``str.strip`` keeps them) but names nothing: a list would show a row
    that cannot be told from an untitled process. An unassigned code point (``Cn``) counts as
    visible: it may be an emoji newer than this Python's Unicode tables."""
    return char not in _BLANK_CHARS and unicodedata.category(char) not in _UNSEEN_CATEGORIES


def _one_line(text: str, keep: int) -> str:
    """The first line that is not blank, control characters as spaces, whitespace collapsed; only
    its first ``keep`` characters are looked at (the first message may be a whole file)."""
    found = _FIRST_LINE.search(text)
    return " ".join(found.group()[:keep].translate(_TO_SPACE).split()) if found else ""


def _shorten(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters at a word boundary, with an ellipsis (mid-word only
    when the first half holds no space)."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    if space >= limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:.-–—") + "…"


def fallback_title(text: str, limit: int = FALLBACK_CHARS) -> str | None:
    """The deterministic title of a conversation that begins with ``text``: its first line, cut
    short. None when there is nothing to show."""
    line = _one_line(text, 4 * limit)
    return _shorten(line, limit) if line else None


def clean_title(answer: str, limit: int = MODEL_CHARS) -> str | None:
    """A model's answer as a title: its first line without the quotes, Markdown and "Title:" it
    may come wrapped in, cut short; None when nothing readable is left (the fallback then stays)."""
    line = _one_line(answer, 4 * limit).strip(_EDGES)
    line = _LABEL.sub("", line).strip(_EDGES).rstrip(".").strip(_EDGES)
    if not any(c.isalnum() for c in line):
        return None
    return _shorten(line, limit)


def _user_text(message: Message) -> str | None:
    """The text a user message holds, if any (a system event's names nothing)."""
    if not isinstance(message, UserMessage):
        return None
    text = message.text
    return text if text.strip() else None


def _text_of(value: Any) -> str | None:
    return value["text"] if isinstance(value, dict) and isinstance(value.get("text"), str) else None


def model_namer(engine: ProcessEngine) -> TitleFn:
    """The ``TitleFn`` of ``titles="model"``: the process's model (its own choice, else its
    owner's: ``ProcessEngine.effective_config``), asked once without tools. What the call spent is
    added to the process's usage totals (``ProcessEngine.add_usage``). A failed call raises, so the
    caller keeps the fallback."""

    async def ask(record: ProcessRecord, text: str) -> str | None:
        model = (await engine.effective_config(record)).model
        request = ModelRequest(
            system_prompt=TITLE_PROMPT,
            messages=[user(text[:MODEL_INPUT])],
            tools=[],
            max_tokens=min(model.info.max_output, MODEL_TOKENS),
        )
        reply = await model.complete(request)
        try:  # billed whatever it answered: counted in the process's totals (no run)
            await engine.add_usage(record.pid, reply.usage)
        except Exception as exc:  # (the store failed: the title still stands)
            log.warning("process %s: the title's model call was not counted: %s", record.pid, exc)
        if reply.stop_reason in ("error", "aborted"):
            raise RuntimeError(f"model {model.name} failed: {reply.error_message or reply.stop_reason}")
        return reply.text

    return ask


class Titles:
    """The kernel's titles: read, set (``Process.title``/``set_title``), cleared by a reset, and
    made automatically after a conversation's first run (see the module doc)."""

    def __init__(self, store: Store, engine: ProcessEngine, titling: Titling = "message") -> None:
        check_titling(titling)
        self.store = store
        self.engine = engine
        self.automatic = titling is not None
        self.namer: TitleFn | None = model_namer(engine) if titling == "model" else None
        if callable(titling):
            self.namer = titling
        # pid -> the text its first run's end names it after (None: no user's text yet, waiting)
        self.pending: dict[str, str | None] = {}
        # pid -> the model asked for its title, and the fallback to write if the kernel closes first
        self.tasks: dict[str, tuple[asyncio.Task[None], tuple[str, int, int, str]]] = {}
        # pid -> (text, limit, generation, owner) to write: the title ``fallback_title(text, limit)``
        self.ready: dict[str, tuple[str, int, int, str]] = {}
        self._writer: asyncio.Task[None] | None = None
        self._ending: set[asyncio.Task[None]] = set()  # cancelled by a reset or kill, until they end
        self.closing = False
        if self.automatic:
            engine.hub.tap(self._heard)

    @property
    def busy(self) -> bool:
        """Whether titles are being made or wait to be written."""
        return bool(self.tasks or self.ready) or (self._writer is not None and not self._writer.done())

    # -- reading and setting ----------------------------------------------------------------------

    async def of(self, pid: str) -> str | None:
        """The process's title (no check that the process exists: the caller made it)."""
        return _text_of(await self.store.kv_get(pid, TITLE_KEY))

    async def of_owner(self, owner: str | None) -> dict[str, str]:
        """pid -> title of ``owner``'s processes (every process's with None), in one query."""
        values = await self.store.kv_values(TITLE_KEY, owner)
        return {pid: text for pid, value in values.items() if (text := _text_of(value)) is not None}

    async def set(self, pid: str, text: str | None) -> str | None:
        """Set a person's title (checked: ``check_title``), or clear it with None, which hands the
        process back to the automatic title: made at once when its first run is over."""
        title = None if text is None else check_title(text)
        await self._write(pid, None if title is None else {"text": title, "source": "user"})
        if title is None and self.automatic and pid not in self.pending:
            await self._remake(pid)
        return title

    async def _remake(self, pid: str) -> None:
        record = await self.store.get_process(pid)
        first = next((t for m in await self.store.history(pid) if (t := _user_text(m.message))), None)
        if record is not None and first is not None:
            self._start(record, first)

    async def _write(self, pid: str, value: dict[str, str] | None) -> None:
        """Write a person's title row (None: delete it) in a transaction of its own, then announce
        it. An upsert: it replaces an automatic title, which never replaces it (``kv_add``)."""
        async with self.store.transaction():
            record = await self.store.get_process(pid)
            if record is None or record.state == "killed":
                raise NoSuchProcess(pid)
            if value is None:
                await self.store.kv_delete(pid, TITLE_KEY)
            else:
                await self.store.kv_set(pid, TITLE_KEY, value)
        self._announce(pid, record.owner, None if value is None else value["text"])

    def _announce(self, pid: str, owner: str, title: str | None) -> None:
        payload = {"pid": pid, "changes": ["title"], "title": title}
        self.engine.hub.publish(pid, Signal(sig.CHANGED, payload), owner)

    async def forget_automatic(self, record: ProcessRecord) -> Callable[[], None]:
        """Inside a reset's transaction: delete an automatic title (a person's stays); returns
        what announces it once the reset has committed."""
        value = await self.store.kv_get(record.pid, TITLE_KEY)
        if value is None or (isinstance(value, dict) and value.get("source") == "user"):
            return lambda: None
        await self.store.kv_delete(record.pid, TITLE_KEY)
        return functools.partial(self._announce, record.pid, record.owner, None)

    # -- automatic titles -------------------------------------------------------------------------

    def _heard(self, pid: str, signal: Signal) -> None:
        """The hub's tap: cheap, synchronous, never raising (it runs for every signal, deltas too)."""
        name = signal.signal
        if name == sig.RUN_STARTED:
            self._started(pid)
        elif name == sig.RUN_FINISHED and pid in self.pending:
            self._finished(pid)

    def _started(self, pid: str) -> None:
        """A run that starts on an empty history (its first message is all there is) begins a
        conversation; one begun by a system event waits for the first run a user's message starts."""
        live = self.engine.cached(pid)
        if live is None or live.remote or not live.history:
            return
        if len(live.history) == 1:
            self.pending[pid] = _user_text(live.history[0])
        elif pid in self.pending and self.pending[pid] is None:
            self.pending[pid] = _user_text(live.history[-1])

    def _finished(self, pid: str) -> None:
        text = self.pending.get(pid)
        if text is None:
            return
        del self.pending[pid]
        live = self.engine.cached(pid)
        if live is None or pid in self.engine.clearing:  # (its conversation is being cleared)
            return
        self._start(live.record, text)

    def _start(self, record: ProcessRecord, text: str) -> None:
        """Make the title of the conversation ``text`` began: at once by default, else by asking
        the namer in a task of the process's own."""
        if self.closing:
            return
        self.cancel(record.pid)
        if self.namer is None:  # cut by the writer: here it would delay the run's watchers
            self._made(record, text, FALLBACK_CHARS, record.history_generation)
            return
        work = self._ask(record, text, record.history_generation)
        task = asyncio.get_running_loop().create_task(work, name=f"title of {record.pid}")
        self.tasks[record.pid] = (task, (text, FALLBACK_CHARS, record.history_generation, record.owner))
        task.add_done_callback(functools.partial(self._done, record.pid))

    def _done(self, pid: str, task: asyncio.Task[None]) -> None:
        if pid in self.tasks and self.tasks[pid][0] is task:
            del self.tasks[pid]

    async def _ask(self, record: ProcessRecord, text: str, generation: int) -> None:
        """The namer's title, else the fallback; a failure costs only the title (logged)."""
        try:
            if await self.store.kv_get(record.pid, TITLE_KEY) is not None:
                return  # a person named it meanwhile: no model call for nothing
            asked = await self._asked(record, text)
        except Exception as exc:
            log.warning("process %s: no title was made: %s", record.pid, exc)
            return
        if asked is None:
            self._made(record, text, FALLBACK_CHARS, generation)
        else:  # (a clean title passes the writer's cut unchanged)
            self._made(record, asked, MODEL_CHARS, generation)

    def _made(self, record: ProcessRecord, text: str, limit: int, generation: int) -> None:
        """Hand a title to the writer, which writes it a moment later with the others."""
        if self.closing:
            return
        self.ready[record.pid] = (text, limit, generation, record.owner)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_ready(), name="process titles")

    async def _write_ready(self) -> None:
        """Write what is ready, a batch per transaction, until nothing is; announce what was
        written. A failed transaction costs its batch's titles (logged)."""
        while self.ready:
            if not self.closing:  # (the close writes at once what is left)
                await asyncio.sleep(WRITE_DELAY)
            batch, self.ready = self.ready, {}
            written: list[tuple[str, str, str]] = []
            try:
                async with self.store.transaction():
                    for pid, (text, limit, generation, owner) in batch.items():
                        title = fallback_title(text, limit)
                        row = {"text": title, "source": "auto"}
                        if title and await self.store.kv_add(pid, TITLE_KEY, row, generation=generation):
                            written.append((pid, owner, title))
            except Exception as exc:
                log.warning("%d process titles were not written: %s", len(batch), exc)
                continue
            for pid, owner, title in written:
                self._announce(pid, owner, title)

    async def _asked(self, record: ProcessRecord, text: str) -> str | None:
        """The namer's title, cleaned; None when it failed, took too long or said nothing usable."""
        assert self.namer is not None
        try:
            async with asyncio.timeout(MODEL_TIMEOUT):
                answer = await self.namer(record, text)
        except Exception as exc:
            log.info("process %s: the title model failed, the first message names it: %s", record.pid, exc)
            return None
        return clean_title(answer) if isinstance(answer, str) else None

    def cancel(self, pid: str) -> None:
        """Stop what would title the process (a reset or kill of it): its pending first run and
        the title being made."""
        self.pending.pop(pid, None)
        self.ready.pop(pid, None)
        asked = self.tasks.pop(pid, None)
        if asked is not None:
            task = asked[0]
            task.cancel()
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)

    async def recover(self) -> None:
        """At start-up, before the unfinished runs resume: a first run a restart cut short still
        names its process when it ends (no ``proc.run.started`` is heard for it again). And an
        idle conversation without a title whose user message has run was named when the runtime
        died (the model still being asked, or the title waiting for the writer's batch): it gets
        the title the close would have written, the first message cut short (no model calls at
        start-up). Both look at a conversation of at most ``RECOVER_SCAN`` messages only."""
        if not self.automatic:
            return
        titled = await self.store.kv_values(TITLE_KEY)
        for record in await self.store.list_processes():
            run = record.current_run
            if record.state == "killed" or (run is None and record.pid in titled):
                continue
            stored = await self.store.history(record.pid, limit=RECOVER_SCAN + 1)
            if not stored or len(stored) > RECOVER_SCAN:
                continue
            if run is None:
                first = next((t for m in stored if (t := _user_text(m.message))), None)
                if first is not None:
                    self._made(record, first, FALLBACK_CHARS, record.history_generation)
            elif all(m.run_id == run["run_id"] for m in stored):
                self.pending[record.pid] = _user_text(stored[0].message)

    async def close(self) -> None:
        """On close: write the titles made, without waiting for the next batch (a restart does not
        make them again); a model still being asked is not waited for: the fallback names its
        process instead."""
        self.closing = True
        self.engine.hub.untap(self._heard)
        for pid, (_, fallback) in self.tasks.items():  # (setdefault: a task that ended this turn made one)
            self.ready.setdefault(pid, fallback)
        tasks = [*(task for task, _ in self.tasks.values()), *self._ending]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)
        await self._write_ready()  # (what came while no writer ran)
        self.tasks.clear()
        self.pending.clear()
