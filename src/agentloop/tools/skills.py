"""Skills: how-to documents the agent opens only when a task calls for one.

The system prompt carries just an index (a name and one line per skill) so that a hundred skills
cost a hundred lines, not a hundred documents; the ``skills`` tool fetches a body, or a file that
ships with it, on demand, unless the run's input activates a skill (``$name``, or a path matching
its ``paths:`` globs: ``SkillCard``, ``process.prompt.activate_skills``), whose body the run's prompt
then carries. Skills live in layered ``skills.d`` directories (system, then account,
…): a later layer replaces an earlier skill of the same name, which is how an account adapts a
shared skill without editing it.

A skill is ``skills.d/<name>/SKILL.md`` (its directory may hold scripts, templates, references) or
a lone ``skills.d/<name>.md``. The name is the directory or file name, never the front matter:
layers override by what an operator sees on disk. Skill directories are writable by the agent, so
every file is opened through ``resolve_path`` rooted at the skill's own directory: a ``..``, an
absolute path or a symlink cannot turn ``read`` into a general file reader.

A skill may say what it needs, so that the model is told only of skills that can work here. Lists
are comma-separated (``[a, b]`` also reads)::

    requires-bins: git, docker        every program found on PATH (``shutil.which``)
    requires-any-bins: podman, docker at least one of them
    requires-env: GITHUB_TOKEN        each variable set and non-empty in the server's environment
    os: linux, macos                  the platform family: linux, darwin (macos), windows (win32)

Skills written for OpenClaw/ClawHub carry the same in a one-line JSON ``metadata`` field,
``{"openclaw": {"requires": {"bins": [...], "anyBins": [...], "env": [...]}, "os": [...]}}`` (or
under another single key, or with ``requires``/``os`` at the top); both forms add up. Other
requirement kinds (OpenClaw's ``config``) are ignored: nothing here can judge them, and hiding a
skill for them would hide it everywhere. Unreadable ``metadata`` is a warning, never a reason to
hide the skill. An ineligible skill is left out of the prompt index and of ``list``/``search``
(``list`` ends with one line naming them and why); ``show``/``read`` say why it is unavailable.
Layers override first, so an account's copy of a skill may drop a requirement.

Eligibility is judged on each assembly and each tool call, and only for skills that declare
requirements. The kernel reuses an assembled prompt while its files are unchanged, which PATH and
the environment are not part of; instead ``ELIGIBILITY`` remembers the verdicts prompts were built
on (the most recently judged ``MAX_REMEMBERED`` sets) and rechecks them at most once a minute,
when a cached prompt is about to be reused (``requirements_generation``): a program installed
later reaches the index within that minute, and no server without requirement-bearing skills ever
pays for it. Skill files are the agent's to write, so what they declare is bounded: a program is
looked up on PATH by its bare name only (a path would let a skill probe the server's disk, and
counts as missing), a list is checked up to ``MAX_REQUIRED_NAMES``, and ``metadata`` that cannot
be read (deep nesting too) is a warning.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentloop.stamps import read_regular
from agentloop.tools.base import FunctionTool, ToolError, ToolResult, tool
from agentloop.tools.paths import display, resolve_path

__all__ = [
    "ELIGIBILITY",
    "SKILL_FILE",
    "Eligibility",
    "Requirements",
    "Skill",
    "SkillCard",
    "SkillCatalog",
    "UnreadableFile",
    "discover_skills",
    "parse_front_matter",
    "platform_family",
    "read_text_file",
    "requirements_generation",
    "scan_skills",
    "skills_tool",
]

SKILL_FILE = "SKILL.md"
MAX_DESCRIPTION_CHARS = 200
MAX_READ_BYTES = 64 * 1024
# no text file is read past this: a million tokens, more than any model's window holds
MAX_TEXT_FILE_BYTES = 4 * 1024 * 1024
MAX_LISTED_FILES = 50
SEARCH_LIMIT = 10
SEARCH_LIMIT_MAX = 50
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_KEY = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*)\s*:\s*(.*)")
RECHECK_SECONDS = 60.0
MAX_REMEMBERED = 1024  # distinct requirement sets whose verdicts are rechecked (the most recently judged)
# Each name is a lookup (``which`` stats every PATH entry) at every assembly, tool call and recheck,
# on the event loop, and skill files are the agent's to write: a list is checked this far, and a
# name longer than this is shortened (and so never found), which also bounds the reasons shown.
MAX_REQUIRED_NAMES = 16
MAX_NAME_CHARS = 128
MAX_PATH_GLOBS = 16  # ``paths:`` globs of one skill that are matched (the agent writes skill files)
MAX_PATH_PARTS = 64
# glob segments tried against one mentioned path, a skill's globs together: past it the path does
# not match (a real glob takes tens; one the agent wrote to be slow cannot stall the engine)
MAX_MATCH_STEPS = 2048
_OS_ALIASES = {"macos": "darwin", "mac": "darwin", "osx": "darwin", "win32": "windows", "win": "windows"}
_OS_LABELS = {"linux": "Linux", "darwin": "macOS", "windows": "Windows"}


class UnreadableFile(Exception):
    """A file that cannot become prompt text; the message says why, for a warning."""


def read_text_file(path: Path) -> str:
    """UTF-8 text of ``path``; binary or undecodable content is refused rather than garbled, and
    so is a file over ``MAX_TEXT_FILE_BYTES``, before it is loaded."""
    try:
        data = read_regular(path, MAX_TEXT_FILE_BYTES)
    except OSError as exc:
        raise UnreadableFile(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if b"\x00" in data[:8192]:
        raise UnreadableFile(f"{path}: binary file, skipped")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UnreadableFile(f"{path}: not UTF-8 text, skipped") from None
    return text.replace("\r\n", "\n")


def parse_front_matter(text: str) -> tuple[dict[str, str], str]:
    """``(fields, body)``. Only flat ``key: value`` pairs (with indented continuation lines) are
    understood: skills need a name and a description, not a YAML parser."""
    lines = text.split("\n")
    if not lines or lines[0].strip() != "---":
        return {}, text
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].strip() in ("---", "..."))
    except StopIteration:
        return {}, text  # an unclosed fence is content, not metadata
    fields: dict[str, str] = {}
    current: str | None = None
    for line in lines[1:end]:
        match = _KEY.fullmatch(line)
        if match and not line[:1].isspace():
            current = match.group(1).lower()
            value = match.group(2).strip()
            fields[current] = "" if value in (">", "|", ">-", "|-") else value
        elif current is not None and line.strip():
            fields[current] = (fields[current] + " " + line.strip()).strip()
    for key, value in fields.items():
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            fields[key] = value[1:-1]
    return fields, "\n".join(lines[end + 1 :]).lstrip("\n")


def _one_line(fields: dict[str, str], body: str) -> str:
    text = fields.get("description", "")
    if not text:
        text = next((ln.strip().lstrip("#").strip() for ln in body.split("\n") if ln.strip().lstrip("#").strip()), "")
    text = " ".join(text.split())
    if len(text) > MAX_DESCRIPTION_CHARS:
        text = text[: MAX_DESCRIPTION_CHARS - 1].rstrip() + "…"
    return text


# ------------------------------------------------------------------ requirements


def platform_family() -> str:
    """``sys.platform`` as the families skills name: ``linux``, ``darwin``, ``windows``, or the
    platform itself (``freebsd14`` → ``freebsd``)."""
    platform = sys.platform
    if platform in ("win32", "cygwin"):
        return "windows"
    return platform.rstrip("0123456789")


@dataclass(frozen=True)
class Requirements:
    """What a skill needs to work here; empty (false) for almost every skill."""

    bins: tuple[str, ...] = ()
    any_bins: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    os: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.bins or self.any_bins or self.env or self.os)

    def unmet(self) -> str | None:
        """Why the skill cannot work here (every unmet requirement), or None; looked up afresh."""
        reasons: list[str] = []
        if self.os and platform_family() not in self.os:
            reasons.append(" or ".join(_OS_LABELS.get(o, o) for o in self.os) + " only")
        missing = [b for b in self.bins if not _on_path(b)]
        if missing:
            reasons.append(f"needs {', '.join(missing)} on PATH")
        if self.any_bins and not any(_on_path(b) for b in self.any_bins):
            reasons.append(f"needs one of {', '.join(self.any_bins)} on PATH")
        unset = [name for name in self.env if not os.environ.get(name)]
        if unset:
            reasons.append(f"needs {', '.join(unset)} set")
        return "; ".join(reasons) or None


def _program_name(name: str) -> bool:
    """Whether ``name`` is a bare program name, to look up on PATH. ``shutil.which`` checks a
    name with a directory part (``/home/bob/x``, ``../../x``) as that file, wherever it is: a
    skill the agent wrote could learn from its verdict what the server's disk holds."""
    return not (
        not name
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or name in (".", "..")
        or os.path.dirname(name)  # (a drive, on Windows)
        or (os.altsep is not None and os.altsep in name)
    )


def _on_path(name: str) -> bool:
    """Whether the program ``name`` is found on PATH; a path is never looked up (it is missing)."""
    return _program_name(name) and shutil.which(name) is not None


def _names(value: object) -> list[str]:
    """A front-matter list (``a, b`` or ``[a, 'b']``) or a JSON list, as names; other values none."""
    if isinstance(value, list):
        return [v.strip() for v in value if isinstance(v, str) and v.strip()]
    if not isinstance(value, str):
        return []
    return [n.strip("\"'") for n in re.split(r"[,\s]+", value.strip().strip("[]")) if n.strip("\"'")]


def _metadata_spec(text: str) -> tuple[dict[str, Any], str | None]:
    """The object in ``metadata`` that holds ``requires``/``os`` (OpenClaw's own key, any single
    key, or the top level), and a problem to warn about."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # (deep nesting: RecursionError, in a file the agent writes)
        return {}, f"metadata is not valid JSON ({exc}); its requirements are ignored"
    if not isinstance(data, dict):
        return {}, "metadata is not a JSON object; its requirements are ignored"
    if "requires" in data or "os" in data:
        return data, None
    inner = data.get("openclaw", next(iter(data.values())) if len(data) == 1 else None)
    return (inner, None) if isinstance(inner, dict) else ({}, None)


def parse_requirements(fields: dict[str, str]) -> tuple[Requirements, list[str]]:
    """The requirements a skill's front matter declares, in either form, and warnings."""
    spec, problem = _metadata_spec(fields["metadata"]) if fields.get("metadata") else ({}, None)
    needs = spec.get("requires")
    needs = needs if isinstance(needs, dict) else {}
    systems = _names(fields.get("os", "")) + _names(spec.get("os"))
    problems = [problem] if problem else []
    found = Requirements(
        bins=_bounded("requires-bins", _names(fields.get("requires-bins", "")) + _names(needs.get("bins")), problems),
        any_bins=_bounded(
            "requires-any-bins", _names(fields.get("requires-any-bins", "")) + _names(needs.get("anyBins")), problems
        ),
        env=_bounded("requires-env", _names(fields.get("requires-env", "")) + _names(needs.get("env")), problems),
        os=_bounded("os", [_OS_ALIASES.get(o.lower(), o.lower()) for o in systems], problems),
    )
    paths = [b for b in found.bins + found.any_bins if not _program_name(b)]
    if paths:
        problems.append(
            f"{', '.join(paths)}: programs are looked up on PATH by name, never by path; counted as missing"
        )
    return found, problems


def _bounded(kind: str, names: list[str], problems: list[str]) -> tuple[str, ...]:
    """``names`` without repeats, at most ``MAX_REQUIRED_NAMES`` of them, none longer than
    ``MAX_NAME_CHARS`` (a longer one is shortened with an ellipsis, so that it is never found)."""
    unique = list(dict.fromkeys(names))
    if len(unique) > MAX_REQUIRED_NAMES:
        problems.append(f"{kind} names {len(unique)}; only the first {MAX_REQUIRED_NAMES} are checked")
        unique = unique[:MAX_REQUIRED_NAMES]
    if any(len(n) > MAX_NAME_CHARS for n in unique):
        problems.append(f"{kind}: a name over {MAX_NAME_CHARS} characters is never found")
        unique = [n if len(n) <= MAX_NAME_CHARS else n[:MAX_NAME_CHARS] + "…" for n in unique]
    return tuple(dict.fromkeys(unique))


class Eligibility:
    """The requirement verdicts prompts were built on, so a cached prompt can learn that one
    changed: ``generation`` rechecks them at most once per ``interval`` and moves on when any
    differs (as does ``judge`` when a fresh look disagrees with the remembered one). With no
    requirement ever judged, ``generation`` costs nothing, not even a clock read."""

    def __init__(self, interval: float = RECHECK_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._verdicts: dict[Requirements, str | None] = {}
        self._checked = 0.0
        self._generation = 0

    def judge(self, needs: Requirements) -> str | None:
        """Why ``needs`` are unmet here, looked up now; remembered for the recheck (the
        ``MAX_REMEMBERED`` most recently judged sets)."""
        verdict = needs.unmet()
        if not self._verdicts:
            self._checked = self.clock()
        if self._verdicts.pop(needs, verdict) != verdict:  # (put back last: the most recent)
            self._generation += 1
        self._verdicts[needs] = verdict
        while len(self._verdicts) > MAX_REMEMBERED:
            # The least recently judged set is forgotten, and the generation stays: it is part of
            # every process's prompt cache key, so moving it here would make every assembly that
            # judges more sets than this miss every cached prompt, server-wide. A prompt built on
            # a forgotten verdict follows at its next assembly (a file of it changes, a new day).
            self._verdicts.pop(next(iter(self._verdicts)), None)
        return verdict

    def generation(self) -> int:
        """A number that changes when a remembered verdict no longer holds."""
        if self._verdicts and self.clock() - self._checked >= self.interval:
            self._checked = self.clock()
            fresh = {needs: needs.unmet() for needs in list(self._verdicts)}
            if any(self._verdicts.get(needs, verdict) != verdict for needs, verdict in fresh.items()):
                self._generation += 1
            for needs, verdict in fresh.items():
                if needs in self._verdicts:  # (not one forgotten meanwhile: the bound holds)
                    self._verdicts[needs] = verdict
        return self._generation


ELIGIBILITY = Eligibility()


def requirements_generation() -> int:
    """``ELIGIBILITY.generation()``: part of a cached prompt's key, so it is rebuilt once a
    program or variable a skill needs appears (or goes), within ``RECHECK_SECONDS``."""
    return ELIGIBILITY.generation()


@dataclass
class Skill:
    """One skill as found on disk; ``root`` is None for a single-file skill."""

    name: str
    description: str
    path: Path
    root: Path | None
    layer: Path
    body: str
    fields: dict[str, str] = field(default_factory=dict)
    requires: Requirements = field(default_factory=Requirements)

    def unavailable(self) -> str | None:
        """Why this skill cannot work here, or None; no lookup at all without requirements."""
        return ELIGIBILITY.judge(self.requires) if self.requires else None

    def globs(self) -> tuple[str, ...]:
        """The ``paths:`` globs that activate this skill for a run whose input names a matching
        path (``paths: src/**/*.py, *.sql``, or a ``- item`` list), at most ``MAX_PATH_GLOBS``."""
        value = self.fields.get("paths", "").strip()
        if value.startswith("[") and value.endswith("]"):  # (not a glob's own ``[ch]``)
            value = value[1:-1]
        found = [g.strip("\"'") for g in re.split(r"[,\s]+", value) if g not in ("", "-")]
        return tuple(dict.fromkeys(g for g in found if g and len(g) <= MAX_NAME_CHARS))[:MAX_PATH_GLOBS]

    def card(self, shown: str = "") -> SkillCard:
        """What activating this skill later needs (``shown``: how the prompt's manifest names it)."""
        return SkillCard(self.name, shown or self.name, self.globs(), self.layer, self.root is not None)


@dataclass(frozen=True)
class SkillCard:
    """A skill of a prompt's index, as a run's activation needs it: kept with the cached prompt,
    so it holds no body (``load`` reads the skill again, rooted in its layer as discovery does)."""

    name: str
    shown: str
    globs: tuple[str, ...]
    layer: Path
    folder: bool

    def load(self) -> Skill:
        """The skill as it is on disk now; ``UnreadableFile`` or ``ToolError`` if it cannot be read."""
        rel = f"{self.name}/{SKILL_FILE}" if self.folder else f"{self.name}.md"
        return _load(self.layer, self.name, rel, self.folder)[0]

    def matches(self, path: str) -> bool:
        """Whether ``path`` (as a person wrote it) matches one of the skill's ``paths:`` globs. A
        glob with no ``/`` matches a file's name in any directory; one with a ``/`` matches from
        the start of a relative path, or anywhere along an absolute one (``/srv/app/src/x.py``
        matches ``src/*.py``: where the workspace lies is not known here). ``**`` spans
        directories, ``*`` and ``?`` do not."""
        parts = tuple(p for p in path.split("/") if p not in ("", "."))
        if not parts or len(parts) > MAX_PATH_PARTS:
            return False
        anywhere = path.startswith(("/", "~"))
        left = MAX_MATCH_STEPS
        for glob in self.globs:
            pattern = _glob_parts(glob)
            # anywhere along an absolute path: one pass with a leading ``**`` (the same as trying
            # each start, which cost a pass per segment: seconds for a message of deep paths)
            if anywhere and pattern[:1] != ("**",):
                pattern = ("**", *pattern)
            matched, left = _match_parts(pattern, parts, left)
            if matched:
                return True
            if left <= 0:
                return False
        return False


@dataclass(frozen=True)
class SkillCatalog:
    """The skills a prompt's index offers, for activating some of them in a run (see
    ``process.prompt.activate_skills``); ``budget``: the bytes their bodies may add together."""

    cards: tuple[SkillCard, ...]
    budget: int

    def get(self, name: str) -> SkillCard | None:
        return next((c for c in self.cards if c.name == name), None)


@functools.lru_cache(maxsize=1024)
def _glob_parts(glob: str) -> tuple[str, ...]:
    """A ``paths:`` glob as segments: one without ``/`` gets a leading ``**``, a trailing ``/``
    (a directory) a final ``**``."""
    parts = tuple(p for p in glob.strip("/").split("/") if p not in ("", "."))
    if "/" not in glob.strip("/"):
        parts = ("**", *parts)
    return (*parts, "**") if glob.endswith("/") else parts


def _match_parts(pattern: tuple[str, ...], parts: tuple[str, ...], left: int = MAX_MATCH_STEPS) -> tuple[bool, int]:
    """Segment-wise glob matching, as a set of pattern positions (no backtracking: a glob is the
    agent's to write, and each segment goes to ``fnmatchcase``, itself linear); with the steps
    ``left`` after it (none left: no match)."""

    def closure(states: set[int]) -> set[int]:  # (a ``**`` may match no segment)
        out = set(states)
        for i in states:
            while i < len(pattern) and pattern[i] == "**":
                i += 1
                out.add(i)
        return out

    states = closure({0})
    for part in parts:
        left -= len(states)
        if left <= 0:
            return False, 0
        moved = set()
        for i in states:
            if i == len(pattern):
                continue
            if pattern[i] == "**":
                moved.add(i)  # (it matches this segment too)
            elif fnmatch.fnmatchcase(part, pattern[i]):
                moved.add(i + 1)
        states = closure(moved)
        if not states:
            return False, left
    return len(pattern) in states, left


def _load(layer: Path, name: str, rel: str, folder: bool) -> tuple[Skill, list[str]]:
    """The skill ``rel`` names in ``layer``. A skill folder is resolved inside its layer before it
    becomes the root of its files: a folder that is a symlink to elsewhere (another account's
    skill, say) would otherwise make everything there readable, as a linked single file is not."""
    root = resolve_path(layer, name) if folder else None
    path = resolve_path(root if root is not None else layer, SKILL_FILE if root is not None else rel)
    if not path.is_file():
        raise UnreadableFile(f"{layer / rel}: not a regular file")
    fields, body = parse_front_matter(read_text_file(path))
    requires, problems = parse_requirements(fields)
    return Skill(name, _one_line(fields, body), path, root, layer, body.rstrip() + "\n", fields, requires), problems


def scan_skills(dirs: list[Path]) -> tuple[dict[str, Skill], list[str]]:
    """All skills by name, later layers winning, and warnings for what could not be loaded."""
    skills: dict[str, Skill] = {}
    warnings: list[str] = []
    for layer in dirs:
        if not layer.is_dir():
            continue
        found: dict[str, Skill] = {}
        for entry in sorted(layer.iterdir(), key=lambda p: p.name):
            is_dir = entry.is_dir() and (entry / SKILL_FILE).exists()
            if is_dir:
                name, rel = entry.name, f"{entry.name}/{SKILL_FILE}"
            elif entry.suffix == ".md" and not entry.is_dir():
                name, rel = entry.stem, entry.name
            else:
                continue
            if not _NAME.fullmatch(name):
                continue  # hidden files, editor droppings
            if name in found and not is_dir:
                warnings.append(f"skill {name!r}: both {name}/ and {entry.name} in {layer}; using the directory")
                continue
            try:
                found[name], problems = _load(layer, name, rel, is_dir)
            except (UnreadableFile, ToolError) as exc:
                warnings.append(f"skill {name!r} skipped: {exc}")
                continue
            warnings += [f"skill {name!r}: {problem}" for problem in problems]
        skills.update(found)
    return dict(sorted(skills.items())), warnings


def discover_skills(dirs: list[Path]) -> dict[str, Skill]:
    """Skills by name, sorted; later directories override earlier ones."""
    return scan_skills(dirs)[0]


# ------------------------------------------------------------------ the tool


def _unknown(name: str, skills: dict[str, Skill]) -> ToolError:
    if not skills:
        return ToolError(f"Unknown skill {name!r}: no skills are installed.")
    close = difflib.get_close_matches(name, list(skills), n=5, cutoff=0.5)
    close += [s for s in skills if name.lower() in s.lower() and s not in close][: 5 - len(close)]
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return ToolError(f"Unknown skill {name!r}.{hint} Use action='list' to see all {len(skills)} skills.")


def _files(skill: Skill) -> list[str]:
    """Files a ``read`` may open: regular files inside the skill directory, symlinks not followed."""
    if skill.root is None:
        return []
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(skill.root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fname in sorted(filenames):
            full = Path(dirpath) / fname
            if fname.startswith(".") or full.is_symlink() or not full.is_file() or full == skill.path:
                continue  # (a FIFO or socket: ``read`` refuses it, so it is not offered)
            out.append(full.relative_to(skill.root).as_posix())
    return sorted(out)


def _cap(text: str) -> str:
    data = text.encode("utf-8")
    if len(data) <= MAX_READ_BYTES:
        return text
    kept = data[:MAX_READ_BYTES].decode("utf-8", errors="ignore")
    return kept + f"\n[… truncated: {MAX_READ_BYTES} of {len(data)} bytes shown]"


def _split(found: dict[str, Skill]) -> tuple[dict[str, Skill], dict[str, str]]:
    """The skills that can work here, and why each of the others cannot."""
    usable: dict[str, Skill] = {}
    unavailable: dict[str, str] = {}
    for name, skill in found.items():
        reason = skill.unavailable()
        if reason is None:
            usable[name] = skill
        else:
            unavailable[name] = reason
    return usable, unavailable


def _list(skills: dict[str, Skill], unavailable: dict[str, str]) -> ToolResult:
    """The usable skills, then one line for the others: the model learns they exist (a user may
    ask for one) without a line each for what it cannot use."""
    if not skills and not unavailable:
        return ToolResult.text("No skills are installed.", details={"skills": []})
    lines = [f"{len(skills)} skills:" if skills else "No skills are available here."]
    lines += [f"- {s.name}: {s.description}" for s in skills.values()]
    details: dict[str, Any] = {"skills": list(skills)}
    if unavailable:
        lines.append("not available here: " + ", ".join(f"{n} ({why})" for n, why in unavailable.items()))
        details["unavailable"] = unavailable
    return ToolResult.text("\n".join(lines), details=details)


def _search(skills: dict[str, Skill], query: str, limit: int) -> ToolResult:
    terms = query.lower().split()
    if not terms:
        raise ToolError("search needs a non-empty query")
    ranked: list[tuple[int, str, str]] = []
    for skill in skills.values():
        name, desc, body = skill.name.lower(), skill.description.lower(), skill.body.lower()
        score = 0
        for term in terms:
            hit = 10 if term == name else 5 if term in name else 0
            hit += 3 if term in desc else 0
            hit += min(body.count(term), 5)
            if hit == 0:
                break  # every term must match somewhere
            score += hit
        else:
            snippet = next((ln.strip() for ln in skill.body.split("\n") if terms[0] in ln.lower()), "")
            ranked.append((score, skill.name, snippet[:160]))
    ranked.sort(key=lambda r: (-r[0], r[1]))
    shown = ranked[:limit]
    if not shown:
        return ToolResult.text(f"No skill matches {query!r}.", details={"matches": []})
    lines = [f"{len(ranked)} skills match {query!r}" + (f" (top {limit} shown)" if len(ranked) > limit else "") + ":"]
    for _, name, snippet in shown:
        lines.append(f"- {name}: {skills[name].description}")
        if snippet:
            lines.append(f"    {snippet}")
    return ToolResult.text("\n".join(lines), details={"matches": [r[1] for r in shown]})


def _show(skill: Skill) -> ToolResult:
    files = _files(skill)
    head = f"Skill {skill.name} ({skill.path})"
    text = head + "\n\n" + _cap(skill.body)
    if files:
        more = f"\n… and {len(files) - MAX_LISTED_FILES} more" if len(files) > MAX_LISTED_FILES else ""
        listing = "\n".join(f"- {f}" for f in files[:MAX_LISTED_FILES])
        text += f"\nFiles in this skill (open with action='read'):\n{listing}{more}"
    return ToolResult.text(text, details={"name": skill.name, "path": str(skill.path), "files": files})


def _read(skill: Skill, path: str) -> ToolResult:
    if skill.root is None:
        raise ToolError(f"Skill {skill.name!r} is a single file; use action='show' to read it.")
    try:
        real = resolve_path(skill.root, path)
    except ToolError as exc:
        reason = str(exc).replace("the workspace", "the skill's directory")  # resolve_path speaks of workspaces
        raise ToolError(f"Cannot read {path!r} in skill {skill.name!r}: {reason}") from None
    if not real.is_file():
        files = _files(skill)
        listing = ", ".join(files[:MAX_LISTED_FILES]) if files else "none besides SKILL.md"
        raise ToolError(f"Skill {skill.name!r} has no file {path!r}. Its files: {listing}.")
    try:
        text = read_text_file(real)
    except UnreadableFile as exc:
        raise ToolError(str(exc)) from None
    rel = display(skill.root, real)
    return ToolResult.text(_cap(text), details={"name": skill.name, "path": rel})


def skills_tool(dirs: list[Path]) -> FunctionTool:
    """The ``skills`` tool over layered ``dirs``. Skills are rediscovered on every call so one
    written or edited during a run is usable at once."""
    layers = list(dirs)

    @tool(
        name="skills",
        description=(
            "Read the skills listed in the system prompt. action='list' names every skill; "
            "'search' finds skills matching query; 'show' returns a skill's instructions (name); "
            "'read' opens another file shipped with a skill (name, path relative to the skill)."
        ),
        thread=True,
        idempotent=True,
    )
    def skills(
        action: Literal["list", "search", "show", "read"],
        name: str | None = None,
        query: str | None = None,
        path: str | None = None,
        limit: int = SEARCH_LIMIT,
    ) -> ToolResult:
        """Args:
        action: list, search, show or read.
        name: the skill, for show and read.
        query: words to look for, for search (case-insensitive; every word must match).
        path: a file inside the skill's directory, for read.
        limit: at most this many search results.
        """
        found, unavailable = _split(discover_skills(layers))
        if action == "list":
            return _list(found, unavailable)
        if action == "search":
            return _search(found, query or "", max(1, min(limit, SEARCH_LIMIT_MAX)))
        if not name:
            raise ToolError(f"action={action!r} needs the skill's name")
        if name in unavailable:
            raise ToolError(f"Skill {name!r} is not available here: {unavailable[name]}.")
        skill = found.get(name)
        if skill is None:
            raise _unknown(name, found)
        if action == "show":
            return _show(skill)
        if not path:
            raise ToolError("action='read' needs a path inside the skill (see the file list from action='show')")
        return _read(skill, path)

    return skills
