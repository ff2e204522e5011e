"""Skills: how-to documents the agent opens only when a task calls for one.

The system prompt carries just an index (a name and one line per skill) so that a hundred skills
cost a hundred lines, not a hundred documents; the ``skills`` tool fetches a body, or a file that
ships with it, on demand. Skills live in layered ``skills.d`` directories (system, then account,
…): a later layer replaces an earlier skill of the same name, which is how an account adapts a
shared skill without editing it.

A skill is ``skills.d/<name>/SKILL.md`` (its directory may hold scripts, templates, references) or
a lone ``skills.d/<name>.md``. The name is the directory or file name, never the front matter:
layers override by what an operator sees on disk. Skill directories are writable by the agent, so
every file is opened through ``resolve_path`` rooted at the skill's own directory: a ``..``, an
absolute path or a symlink cannot turn ``read`` into a general file reader.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agentloop.stamps import read_regular
from agentloop.tools.base import FunctionTool, ToolError, ToolResult, tool
from agentloop.tools.paths import display, resolve_path

__all__ = [
    "SKILL_FILE",
    "Skill",
    "UnreadableFile",
    "discover_skills",
    "parse_front_matter",
    "read_text_file",
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


def _load(layer: Path, name: str, rel: str, folder: bool) -> Skill:
    """The skill ``rel`` names in ``layer``. A skill folder is resolved inside its layer before it
    becomes the root of its files: a folder that is a symlink to elsewhere (another account's
    skill, say) would otherwise make everything there readable, as a linked single file is not."""
    root = resolve_path(layer, name) if folder else None
    path = resolve_path(root if root is not None else layer, SKILL_FILE if root is not None else rel)
    if not path.is_file():
        raise UnreadableFile(f"{layer / rel}: not a regular file")
    fields, body = parse_front_matter(read_text_file(path))
    return Skill(name, _one_line(fields, body), path, root, layer, body.rstrip() + "\n", fields)


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
                found[name] = _load(layer, name, rel, is_dir)
            except (UnreadableFile, ToolError) as exc:
                warnings.append(f"skill {name!r} skipped: {exc}")
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
            if fname.startswith(".") or full.is_symlink() or full == skill.path:
                continue
            out.append(full.relative_to(skill.root).as_posix())
    return sorted(out)


def _cap(text: str) -> str:
    data = text.encode("utf-8")
    if len(data) <= MAX_READ_BYTES:
        return text
    kept = data[:MAX_READ_BYTES].decode("utf-8", errors="ignore")
    return kept + f"\n[… truncated: {MAX_READ_BYTES} of {len(data)} bytes shown]"


def _list(skills: dict[str, Skill]) -> ToolResult:
    if not skills:
        return ToolResult.text("No skills are installed.", details={"skills": []})
    lines = [f"{len(skills)} skills:"] + [f"- {s.name}: {s.description}" for s in skills.values()]
    return ToolResult.text("\n".join(lines), details={"skills": [s.name for s in skills.values()]})


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
        found = discover_skills(layers)
        if action == "list":
            return _list(found)
        if action == "search":
            return _search(found, query or "", max(1, min(limit, SEARCH_LIMIT_MAX)))
        if not name:
            raise ToolError(f"action={action!r} needs the skill's name")
        skill = found.get(name)
        if skill is None:
            raise _unknown(name, found)
        if action == "show":
            return _show(skill)
        if not path:
            raise ToolError("action='read' needs a path inside the skill (see the file list from action='show')")
        return _read(skill, path)

    return skills
