"""Daily memory files: what a summary model picked out as worth remembering (when a compaction
folds part of a conversation away, or a reset clears it), or what the agent chose to remember
(the ``memory`` tool), is appended to ``memory/<YYYY-MM-DD>.md`` in the owner's home
(``<data>/home/<owner>``), under a heading with its source and the time. The prompt reads today's
and yesterday's file back (``prompt.py``), so those facts stay in view for the next day, in every
process of that owner, and in no one else's: a working directory may be shared by accounts. Older
days are reached through the ``memory`` tool, which searches, reads and forgets entries, and a run's prompt
recalls the few older entries that share the most words with the run's input (``recall_entries``),
from the owner's home as the kernel knows it (``owner_home``), with or without the tool in the run.

The home is off limits to tools, but the writer still trusts no link where ``memory`` or the
day's file should be. Every step is opened relative to the one before and without following a link
(``O_NOFOLLOW`` on each component, no path resolved ahead of time that a concurrent process could
swap), a file with other hard links is refused (it may be a file outside the directory), and so
is anything but a regular file (a FIFO would block the writer). A file is rewritten (to forget an
entry) through a new file renamed over it, in the same folder.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import heapq
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

MEMORY_DIR = "memory"
ENTRY_HEADING = "### From "
MAX_DAY_BYTES = 1024 * 1024  # a day's file read back; one larger is refused, not loaded
_DAY_FILE = re.compile(r"(\d{4}-\d{2}-\d{2})\.md")
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def owner_home(data_dir: Path, owner: str) -> Path:
    """The home of ``owner`` under a kernel's ``data_dir``, whose ``memory`` folder holds the
    owner's memory files: one place for the ``memory`` tool, compaction and a run's recall to
    agree on, none of them asking another where it is."""
    return data_dir / "home" / owner


def daily_memory_name(day: datetime.date) -> str:
    return f"{MEMORY_DIR}/{day.isoformat()}.md"


@contextlib.contextmanager
def _folder(home: str | Path, *, create: bool, lock: bool = False) -> Iterator[int]:
    """The memory folder of ``home``, opened without following a link (``FileNotFoundError`` when
    it does not exist and ``create`` is false). With ``lock`` it is held exclusively while in use:
    writers take it, so an entry appended while another is forgotten (a file read, then replaced)
    is not lost with the replaced file."""
    root = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(MEMORY_DIR, 0o755, dir_fd=root)
        folder = os.open(MEMORY_DIR, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=root)
    finally:
        os.close(root)
    try:
        if lock:
            fcntl.flock(folder, fcntl.LOCK_EX)  # (released when the descriptor closes)
        yield folder
    finally:
        os.close(folder)


def _checked(fd: int, name: str) -> os.stat_result:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise OSError(errno.EINVAL, "not a regular file", name)
    if info.st_nlink > 1:
        raise OSError(errno.EPERM, "the file has other hard links, which may lead out of the directory", name)
    return info


def append_daily_memory(
    home: str | Path,
    memories: str,
    now: datetime.datetime | None = None,
    *,
    source: str = "context compaction",
    max_bytes: int | None = None,
) -> str:
    """Append ``memories`` (found by ``source``) to the day's memory file under ``home``; returns
    its name relative to ``home``. Raises ``OSError`` when it cannot be written there safely, and
    ``OSError(EFBIG)`` when the file would pass ``max_bytes`` (checked under the folder's lock:
    an agent remembering in a loop would make a day too large to read back, or to forget from)."""
    now = now or datetime.datetime.now()
    name = daily_memory_name(now.date())
    entry = f"{ENTRY_HEADING}{source} ({now:%H:%M})\n\n{memories.strip()}\n\n".encode()
    with _folder(home, create=True, lock=True) as folder:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | _NOFOLLOW
        fd = os.open(Path(name).name, flags, 0o644, dir_fd=folder)
        try:
            size = _checked(fd, name).st_size
            if max_bytes is not None and size + len(entry) > max_bytes:
                raise OSError(errno.EFBIG, f"{size} bytes already; the entry would pass {max_bytes}", name)
            os.write(fd, entry)
        finally:
            os.close(fd)
    return name


def memory_days(home: str | Path) -> list[tuple[datetime.date, int]]:
    """The days that have a memory file under ``home``, oldest first, with each file's size."""
    try:
        with _folder(home, create=False) as folder:
            days = []
            for entry in os.scandir(folder):
                match = _DAY_FILE.fullmatch(entry.name)
                if match is None or not entry.is_file(follow_symlinks=False):
                    continue
                with contextlib.suppress(ValueError):
                    days.append(
                        (datetime.date.fromisoformat(match.group(1)), entry.stat(follow_symlinks=False).st_size)
                    )
    except FileNotFoundError:
        return []
    return sorted(days)


def read_daily_memory(home: str | Path, day: datetime.date) -> str | None:
    """The day's memory file under ``home`` (None: there is none). ``OSError`` when it cannot be
    read safely, or is over ``MAX_DAY_BYTES``; ``UnicodeDecodeError`` when it is not UTF-8."""
    try:
        with _folder(home, create=False) as folder:
            return _read_day(folder, day)
    except FileNotFoundError:
        return None


def read_days(
    home: str | Path,
    wanted: Callable[[datetime.date, int], bool] | None = None,
    max_bytes: int | None = None,
) -> Iterator[tuple[datetime.date, str | OSError | UnicodeDecodeError]]:
    """The memory files under ``home``, newest first, each as its text or as what kept it from
    being read (one damaged day hides no other); the folder is opened once. ``wanted(day, size)``:
    whether to read a day at all; ``max_bytes``: the days read stop before their sizes pass it."""
    days = memory_days(home)
    if not days:
        return
    used = 0
    try:
        with _folder(home, create=False) as folder:
            for day, size in reversed(days):
                if wanted is not None and not wanted(day, size):
                    continue
                if max_bytes is not None and size <= MAX_DAY_BYTES:  # (a larger one is refused unread)
                    if used + size > max_bytes:
                        return
                    used += size
                try:
                    text = _read_day(folder, day)
                except (OSError, UnicodeDecodeError) as exc:
                    yield day, exc
                    continue
                if text is not None:
                    yield day, text
    except FileNotFoundError:  # (the folder went away meanwhile)
        return


def _read_day(folder: int, day: datetime.date) -> str | None:
    name = daily_memory_name(day)
    try:
        fd = os.open(Path(name).name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=folder)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        if _checked(fd, name).st_size > MAX_DAY_BYTES:
            raise OSError(errno.EFBIG, f"larger than {MAX_DAY_BYTES} bytes", name)
        return f.read(MAX_DAY_BYTES + 1).decode("utf-8")


def memory_entries(text: str) -> list[str]:
    """A day's file as its entries (each from its ``### From`` heading to the next), stripped."""
    parts = re.split(rf"(?m)^(?={re.escape(ENTRY_HEADING)})", text)
    return [p.strip() for p in parts if p.strip()]


def entry_body(entry: str) -> str:
    """An entry without its heading line, which names only its source and time: ``forget``'s
    text is looked for here, or "agent" (in every heading ``From the agent``) would remove them
    all."""
    return entry.partition("\n")[2] if entry.startswith(ENTRY_HEADING) else entry


def forget_daily_memory(home: str | Path, day: datetime.date, text: str) -> int:
    """Remove the entries of the day's memory file whose text (not heading) contains ``text``; how
    many were removed.
    The file is rewritten through a new one renamed over it (removed when nothing is left), under
    the folder's lock: an entry appended meanwhile is neither lost nor forgotten."""
    if not text:
        return 0
    try:
        with _folder(home, create=False, lock=True) as folder:
            current = _read_day(folder, day)
            if current is None:
                return 0
            entries = memory_entries(current)
            kept = [e for e in entries if text not in entry_body(e)]
            if len(kept) < len(entries):
                _replace(folder, Path(daily_memory_name(day)).name, kept)
            return len(entries) - len(kept)
    except FileNotFoundError:
        return 0


def _replace(folder: int, name: str, entries: list[str]) -> None:
    """The day's file ``name`` made of ``entries`` (removed when there are none)."""
    if not entries:
        os.unlink(name, dir_fd=folder)
        return
    temporary = f".{name}.{os.getpid()}.tmp"
    # Under the folder's lock no one else writes it: one that is there was left by a process that
    # died mid-rewrite (a restarted server often has its pid), and would fail every later forget.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary, dir_fd=folder)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(("\n\n".join(entries) + "\n\n").encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=folder)
        raise


# ------------------------------------------------------------------ recall

# A run's input recalls the older entries that share the most words with it: a score anyone can
# check by reading both. Words that say nothing of a subject do not count: the stopwords below,
# and a word more than half of the searched entries hold (once there are ``COMMON_MIN_ENTRIES``).
_STOPWORDS = """a about above after again against all also am an and any are as at be because been before being
    below between both but by can could did do does doing done down during each either else ever every
    few for from further get gets getting got had has have having he her here hers herself him himself
    his how i if in into is it its itself just let lets like may me might more most much must my myself
    need no nor not now of off ok okay on once only or other our ours out over own please same shall she
    should so some such than thank thanks that the their theirs them then there these they this those
    through to too under until up upon us use used using very want was we were what when where which
    while who whom whose why will with within without would yes yet you your yours"""
STOPWORDS = frozenset(_STOPWORDS.split())
MAX_QUERY_TERMS = 32  # the words of a run's input a recall looks for (its first ones)
MAX_QUERY_CHARS = 8192  # of a run's input read for them
MIN_SHARED = 2  # words an entry must share with the input (or all of them, when it has fewer)
COMMON_SHARE = 0.5
COMMON_MIN_ENTRIES = 10
_WORD = re.compile(r"[^\W_]+")  # letters and digits: ``deploy_to-staging`` is three words
_HEADING_LINE = re.compile(rf"(?m)^{re.escape(ENTRY_HEADING)}[^\n]*")
_CASED = re.compile(r"[A-Z]|[^\x00-\x7f]")


@dataclass(frozen=True)
class Recalled:
    """An entry a recall found: its day, its text (heading included) and the words it shares
    with the run's input, which are why it was picked."""

    day: datetime.date
    entry: str
    shared: tuple[str, ...]


def _stem(word: str) -> str:
    """A lower-case word without its plural ``s`` (``deploys``: ``deploy``; ``class`` stays)."""
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def recall_terms(text: str) -> list[str]:
    """The words of ``text`` a recall looks for: lower-cased, without a plural ``s``, none shorter
    than two characters nor a stopword; each once, in order, at most ``MAX_QUERY_TERMS``."""
    terms: dict[str, None] = {}
    for match in _WORD.finditer(text[:MAX_QUERY_CHARS].lower()):
        word = match.group()
        if len(word) < 2 or word in STOPWORDS:
            continue
        stem = _stem(word)
        if stem not in STOPWORDS:
            terms[stem] = None
            if len(terms) >= MAX_QUERY_TERMS:
                break
    return list(terms)


def _lowered(text: str) -> str:
    """``text`` lower-cased, each character in its place (a character whose lower case is longer,
    ``İ``, is kept as it is), so positions in it are positions in ``text``."""
    lowered = text.lower()
    if len(lowered) == len(text):
        return lowered
    return _CASED.sub(lambda m: low if len(low := m.group().lower()) == 1 else m.group(), text)


def _entry_hits(text: str, terms: Sequence[str]) -> tuple[list[tuple[int, int, int]], dict[int, set[str]]]:
    """A day's entries as (start, body start, end) offsets, and the ``terms`` each one's body (not
    its heading, where every entry names its source) holds as a whole word, alone or with a plural
    ``s``. A day that holds none of them anywhere (``str.find``, a fast scan) costs no more; in
    another each entry's words are collected once (in C) and met with the terms'."""
    spans: list[tuple[int, int, int]] = []
    heads = [(m.start(), m.end()) for m in _HEADING_LINE.finditer(text)]
    first = heads[0][0] if heads else len(text)
    if text[:first].strip():  # (text before the first heading is an entry too: ``memory_entries``)
        spans.append((0, 0, first))
    for i, (start, body) in enumerate(heads):
        spans.append((start, body, heads[i + 1][0] if i + 1 < len(heads) else len(text)))
    lowered = _lowered(text)
    if not any(term in lowered for term in terms):
        return spans, {}
    forms = {form: term for term in terms for form in (term, term + "s")}
    hits: dict[int, set[str]] = {}
    for k, (_, body, end) in enumerate(spans):
        shared = forms.keys() & _WORD.findall(lowered, body, end)
        if shared:
            hits[k] = {forms[form] for form in shared}
    return spans, hits


def recall_entries(days: Iterable[tuple[datetime.date, str]], text: str, limit: int) -> list[Recalled]:
    """The at most ``limit`` entries of ``days`` (each a day's memory file) most relevant to
    ``text``, best first. The score is the number of words an entry shares with ``text``
    (``recall_terms``), not counting a word more than half the entries hold; an entry must share
    ``MIN_SHARED`` of them (all, when the text has fewer). Ties go to the newer entry: the later
    day, then the later entry of the day."""
    terms = recall_terms(text)
    if not terms or limit < 1:
        return []
    found: list[tuple[datetime.date, int, str, tuple[int, int, int], set[str]]] = []
    held: dict[str, int] = dict.fromkeys(terms, 0)  # entries holding each term
    total = 0
    for day, content in days:
        spans, hits = _entry_hits(content, terms)
        total += len(spans)
        for k, shared in hits.items():
            found.append((day, k, content, spans[k], shared))
            for term in shared:
                held[term] += 1
    common = {t for t, n in held.items() if total >= COMMON_MIN_ENTRIES and n > total * COMMON_SHARE}
    counted = [t for t in terms if t not in common]
    need = min(MIN_SHARED, len(counted))
    if need == 0:
        return []
    scored = []
    for day, k, content, (start, _, end), shared in found:
        words = tuple(t for t in counted if t in shared)
        if len(words) >= need:
            scored.append((-len(words), -day.toordinal(), -k, day, content, start, end, words))
    best = heapq.nsmallest(limit, scored, key=lambda s: s[:3])
    return [Recalled(day, content[start:end].strip(), words) for *_, day, content, start, end, words in best]
