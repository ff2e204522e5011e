"""What each run of a durable process is given besides the history: its system prompt (assembled
from the data directory, the account's homes and the working directory, reused while none of
those files changed), its tools (built-ins rooted at the process's directory, the skills tool,
the account's MCP servers, chained), and its stored media made inline again for the model call.

Every run asks for these, so the lookups behind them (paths joined per account, files stamped
rather than read) are kept cheap; ``Kernel.open`` wires them into the engine.
"""

from __future__ import annotations

import copy
import datetime
import functools
import logging
import os
import re
import secrets
import stat
import time
import zoneinfo
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from agentloop.kernel.devices import DeviceDirectory, describe_devices
from agentloop.loop.hooks import maybe_await
from agentloop.messages import FileContent, Message, TextContent, ToolResultMessage, UserMessage
from agentloop.process.api import CompiledPrompt, PromptFn, PromptSection, ToolsetFn
from agentloop.process.media import MediaError, MediaRef, MediaStore, is_stored
from agentloop.process.prompt import DEFAULT_MAX_CONTEXT_BYTES, AssembledPrompt, PromptSources, assemble_prompt
from agentloop.process.store import ProcessRecord
from agentloop.stamps import Stamp
from agentloop.tools.base import Tool
from agentloop.tools.builtin import SYSCALLS, builtin_tools
from agentloop.tools.jobs import jobs_tool
from agentloop.tools.mcp import mcp_server_names
from agentloop.tools.skills import SKILL_FILE, requirements_generation, skills_tool

log = logging.getLogger("agentloop.prompt")


def hydrate_media(media: MediaStore) -> Callable[[list[Message]], list[Message]]:
    """Turn stored media references back into image and document blocks for a model call
    (history unchanged)."""

    def load(block: Any) -> Any:
        if is_stored(block):
            name = block.name if isinstance(block, FileContent) else ""
            try:
                return media.load(MediaRef.of(block), name)
            except (MediaError, ValueError) as exc:
                return TextContent(text=f"[{block.type} unavailable: {exc}]")
        return block

    def hydrate(messages: list[Message]) -> list[Message]:
        out: list[Message] = []
        for msg in messages:
            if isinstance(msg, UserMessage | ToolResultMessage) and any(is_stored(b) for b in msg.content):
                msg = replace(msg, content=[load(b) for b in msg.content])
            out.append(msg)
        return out

    return hydrate


def cwd_toolset(root: Path, shell_sandbox: str = "off", shell_sandbox_read: Sequence[str | Path] = ()) -> ToolsetFn:
    """Each process works in its own directory: a process spawned with a ``cwd`` other than the
    workspace gets built-in tools rooted there (its prompt already reads that directory's files,
    and its approvals judge paths against it), its Shell under the same ``shell_sandbox`` and
    ``shell_sandbox_read`` (so writable beneath that directory). Other tools are shared unchanged."""
    rooted: dict[str, dict[str, Tool]] = {}

    def toolset(record: ProcessRecord, shared: Mapping[str, Tool]) -> Mapping[str, Tool]:
        if record.cwd == str(root):
            return shared
        own = rooted.get(record.cwd)
        if own is None:
            if len(rooted) >= 1024:
                rooted.clear()
            # (Fetch has no root: the shared one stays, with whatever allow-list it was given)
            own = rooted[record.cwd] = {
                t.name: t
                for t in builtin_tools(
                    record.cwd, fetch=False, shell_sandbox=shell_sandbox, shell_sandbox_read=shell_sandbox_read
                )
            }
        return {name: own.get(name, tool) if name in SYSCALLS else tool for name, tool in shared.items()}

    return toolset


@functools.lru_cache(maxsize=1024)
def skill_layers(data_dir: Path, account: str) -> tuple[Path, Path]:
    """Where a process's skills come from: the system's, then its account's own (which win).
    Kept per account: every run asks, and joining paths costs more than the checks they serve."""
    return data_dir / "config" / "ai" / "skills.d", data_dir / "home" / account / "skills.d"


def home_file(data_dir: Path, name: str) -> Callable[[str], Path]:
    """An account's own config file ``home/<account>/<name>`` (looked up at every run, so kept)."""

    @functools.lru_cache(maxsize=1024)
    def file_of(account: str) -> Path:
        return data_dir / "home" / account / name

    return file_of


@functools.lru_cache(maxsize=1024)
def _skill_layer_names(data_dir: Path, account: str) -> tuple[str, ...]:
    return tuple(map(str, skill_layers(data_dir, account)))


def skills_toolset(data_dir: Path) -> ToolsetFn:
    """The ``skills`` tool, for runs that start while a skills directory exists: the prompt's
    skills index is read at the same moment, so the model never sees one without the other."""
    by_account: dict[str, Tool] = {}

    def toolset(record: ProcessRecord, shared: Mapping[str, Tool]) -> Mapping[str, Tool]:
        if "skills" in shared:
            return shared
        found = path_stats(_skill_layer_names(data_dir, record.run_as))
        if not any(st is not None and stat.S_ISDIR(st.st_mode) for st in found):
            return shared
        layers = skill_layers(data_dir, record.run_as)
        skills = by_account.get(record.run_as)
        if skills is None:
            if len(by_account) >= 1024:
                by_account.clear()
            skills = by_account[record.run_as] = skills_tool(list(layers))
        return {**shared, "skills": skills}

    return toolset


def jobs_toolset() -> ToolsetFn:
    """The ``Jobs`` tool, for runs that have Shell: only a durable process runs background
    commands, so only its runs are offered the tool that looks after them."""
    jobs = jobs_tool()

    def toolset(record: ProcessRecord, shared: Mapping[str, Tool]) -> Mapping[str, Tool]:
        if "Shell" not in shared or "Jobs" in shared:
            return shared
        return {**shared, "Jobs": jobs}

    return toolset


def chain(first: ToolsetFn, then: ToolsetFn | None) -> ToolsetFn:
    """``then`` applied to what ``first`` gives. Plain as long as both answer plainly (most
    toolsets do, and every run asks): a coroutine only from the first that is ``async``."""
    if then is None:
        return first

    def chained(
        record: ProcessRecord, shared: Mapping[str, Tool]
    ) -> Mapping[str, Tool] | Awaitable[Mapping[str, Tool]]:
        tools = first(record, shared)
        if hasattr(tools, "__await__"):
            return _then(cast(Awaitable[Mapping[str, Tool]], tools), record, then)
        return then(record, tools)

    return chained


async def _then(pending: Awaitable[Mapping[str, Tool]], record: ProcessRecord, then: ToolsetFn) -> Mapping[str, Tool]:
    return await maybe_await(then(record, await pending))


def owner_scoped(toolset: ToolsetFn) -> ToolsetFn:
    """``toolset``, which fits the shared tools to one owner's run, with every tool it adds (a name
    the shared ones lack: the owner's MCP servers, devices, memory, skills, subagents...) made not
    to keep its cut results (``Tool.keeps_cut_results``): such a result is that owner's, and the
    workspace where results are kept is every account's. Tools it only re-roots or wraps under a
    shared name (a process's own directory, a device target) decide for themselves."""

    def scoped(record: ProcessRecord, shared: Mapping[str, Tool]) -> Mapping[str, Tool] | Awaitable[Mapping[str, Tool]]:
        return chain(toolset, lambda _, tools: _mark_added(tools, shared))(record, shared)

    return scoped


def _mark_added(tools: Mapping[str, Tool], shared: Mapping[str, Tool]) -> Mapping[str, Tool]:
    """``tools`` with each one added (not in ``shared``) that would keep its cut results replaced
    by a copy that does not: the object itself may serve elsewhere (an in-memory agent, another
    kernel), where keeping is not this toolset's to turn off."""
    marked: dict[str, Tool] | None = None
    for name, added in tools.items():
        if added.keeps_cut_results and name not in shared:
            if marked is None:
                marked = dict(tools)
            marked[name] = copy.copy(added)
            marked[name].keeps_cut_results = False
    return tools if marked is None else marked


# -- which watched paths changed, in as few ``stat`` calls as will tell --------------------------------
#
# Most of the paths a run's callbacks watch do not exist (an account without ``context.d``,
# ``skills.d`` or ``model.json``; a data directory without ``config/ai``), and they sit side by
# side. A path that is absent stays absent while the directory in which its first missing entry
# would be has the same modification time (adding, removing or renaming an entry changes it):
# so that directory is stamped in its place, once for all the paths it answers for. An entry
# added within the directory's current timestamp granule would not change its modification
# time: a directory changed too recently to tell has its missing entry looked up again
# (``lstat``) at each check until it has settled. Paths that exist are stamped themselves.

_SETTLE_NS = 50_000_000  # past a kernel clock tick (a filesystem timestamp is that coarse at most)
_SETTLE_COARSE_NS = 2_000_000_000  # timestamps of whole milliseconds or seconds (FAT: two seconds)
_absent: dict[str, list[Any]] = {}  # path -> [directory, its missing entry, the directory's key or None]


def path_stats(paths: Sequence[str]) -> list[os.stat_result | None]:
    """``os.stat`` of each of ``paths`` (None: absent or not to be seen), each directory stat'ed
    at most once however many absent paths it answers for."""
    seen: dict[str, os.stat_result | OSError] = {}
    gone: dict[str, bool] = {}
    # (read before anything is looked up: a directory is settled only if its timestamp's granule
    # had ended before its missing entry was looked up, which a clock read afterwards cannot tell)
    now = time.time_ns()
    return [_look(path, seen, gone, now) for path in paths]


def path_stamps(paths: Sequence[str]) -> tuple[Stamp | None, ...]:
    """``stamps(paths)``: each path's ``file_stamp``, from ``path_stats``."""
    return tuple(None if st is None else (st.st_mtime_ns, st.st_size) for st in path_stats(paths))


def _stat(path: str, seen: dict[str, os.stat_result | OSError]) -> os.stat_result | OSError:
    found = seen.get(path)
    if found is None:
        try:
            found = os.stat(path)
        except OSError as exc:
            found = exc
        seen[path] = found
    return found


def _gone(entry: str, gone: dict[str, bool]) -> bool:
    """Whether ``entry`` is absent, itself (not a link pointing nowhere, which a target made
    elsewhere would bring to life without its directory changing)."""
    found = gone.get(entry)
    if found is None:
        try:
            os.lstat(entry)
            found = False
        except FileNotFoundError:
            found = True
        except OSError:
            found = False
        gone[entry] = found
    return found


def _key(st: os.stat_result, now: int) -> tuple[int, int, int] | None:
    """What identifies a directory's entry list as stamped, if its timestamp had settled by ``now``."""
    mtime = st.st_mtime_ns
    margin = _SETTLE_COARSE_NS if mtime % 1_000_000 == 0 else _SETTLE_NS
    if now - mtime <= margin:
        return None
    return (st.st_dev, st.st_ino, mtime)


def _look(
    path: str, seen: dict[str, os.stat_result | OSError], gone: dict[str, bool], now: int
) -> os.stat_result | None:
    witness = _absent.get(path)
    if witness is not None:
        where, entry, key = witness
        st = _stat(where, seen)
        if isinstance(st, os.stat_result):
            if key is not None and key == (st.st_dev, st.st_ino, st.st_mtime_ns):
                return None
            if stat.S_ISDIR(st.st_mode) and _gone(entry, gone):
                witness[2] = _key(st, now)
                return None
        _absent.pop(path, None)  # (not ``del``: a toolset in a worker thread may have dropped it meanwhile)
    found = _stat(path, seen)
    if isinstance(found, os.stat_result):
        return found
    if isinstance(found, FileNotFoundError | NotADirectoryError) and not path.endswith("/"):
        _witness(path, seen, gone, now)
    return None


def _witness(path: str, seen: dict[str, os.stat_result | OSError], gone: dict[str, bool], now: int) -> None:
    """Find the directory that answers for absent ``path``: the nearest one that exists."""
    entry, where = path, os.path.dirname(path)
    while where and where != entry:
        st = _stat(where, seen)
        if isinstance(st, os.stat_result):
            # (stat'ed before its entry is looked up: an entry made since changes its time)
            if stat.S_ISDIR(st.st_mode) and _gone(entry, gone):
                if len(_absent) >= 4096:
                    _absent.clear()
                _absent[path] = [where, entry, _key(st, now)]
            return
        if not isinstance(st, FileNotFoundError):
            return
        entry, where = where, os.path.dirname(where)


#: The variables only the moment a run's prompt is built knows (``{{time}}``, ``{{timezone}}``),
#: or the process (``{{pid}}``) and the model its run takes (``{{model}}``): an assembly is shared
#: by the runs of many processes over many minutes, so these go into it as markers and each build
#: fills in its own values (reading the model's only when the system context asks for it).
RUN_VARIABLES = ("time", "timezone", "pid", "model")

ModelOf = Callable[[ProcessRecord], Awaitable[str]]


def local_zone(now: datetime.datetime) -> str:
    """``{{timezone}}``: this process's local time zone as a person would name it, by its IANA name
    where the process can tell it (``$TZ``, else the zone ``/etc/localtime`` links to), else its
    abbreviation; with the UTC offset in force at ``now`` (an aware local time), which a model needs
    to turn a time it is told into this zone's."""
    offset = now.strftime("%z")
    utc = f"UTC{offset[:3]}:{offset[3:]}" if offset else "UTC"
    rule = os.environ.get("TZ")
    if rule is not None:  # (``$TZ`` wins over /etc/localtime, also when it is a rule, not a zone's key)
        name = rule.removeprefix(":")
        try:
            zoneinfo.ZoneInfo(name)  # a zone's key, not a POSIX rule such as "EST5EDT,M3.2.0,M11.1.0"
        except (ValueError, zoneinfo.ZoneInfoNotFoundError):
            name = ""
    else:
        linked = os.path.realpath("/etc/localtime")
        name = linked.partition("/zoneinfo/")[2] if "/zoneinfo/" in linked else ""
    name = name or now.tzname() or ""
    if not name or name.startswith(("+", "-", "UTC")):  # an abbreviation that only repeats the offset
        return utc
    return f"{name} ({utc})"


@dataclass
class _Assembly:
    """One cached assembly: the stamps and files it was checked against, the prompt with the
    ``RUN_VARIABLES`` it uses still as markers, and the last prompt filled in from it (a build
    with the same values returns that very object, whose digest is then computed once)."""

    stamps: tuple[Any, ...]
    files: list[str]
    template: CompiledPrompt
    uses: tuple[str, ...]
    filled: tuple[dict[str, str], CompiledPrompt] | None = None


def prompt_builder(
    data_dir: Path,
    base: str,
    devices: DeviceDirectory | None = None,
    context_bytes: int = DEFAULT_MAX_CONTEXT_BYTES,
    model_of: ModelOf | None = None,
) -> PromptFn:
    """Assemble each run's system prompt from the data directory's context, skills and homes
    (``config/ai/context.d``, ``config/ai/skills.d``, ``home/<user>``), the process's working
    directory and its spawn context; ``base`` (the kernel's own system prompt) comes first.
    The system context is templated: ``{{identity}}`` (the account the process runs as),
    ``{{owner}}``, ``{{cwd}}``, ``{{home}}`` (the run-as account's home, ``<data>/home/<account>``),
    ``{{date}}``, ``{{time}}`` (``HH:MM``, local) and ``{{timezone}}`` (``Europe/Berlin (UTC+01:00)``:
    this process's zone, the one ``date`` and ``time`` are in), ``{{pid}}`` (the process's id),
    ``{{model}}`` (the ``provider:model`` its run takes, as ``model_of`` names it; without
    ``model_of`` it is not known here and stays as written, with a warning), ``{{devices}}`` (the
    owner's online devices when ``devices`` is given) and ``{{mcp_servers}}`` (the MCP servers whose
    tools the run has). Their values are taken when the run's prompt is built, and the run keeps
    that prompt. The result says what went into the prompt, with display names instead of the
    server's paths (see ``CompiledPrompt``).

    Assembly reads a dozen paths; the result is reused while none of them (nor the day) changed."""
    cache: dict[tuple[Any, ...], _Assembly] = {}
    system_dir = data_dir / "config" / "ai" / "context.d"
    homes = data_dir / "home"
    # a marker no file holds (random per builder) stands for each run variable in an assembly
    opening = f"\ue000{secrets.token_hex(8)}:"
    markers = re.compile(re.escape(opening) + "([a-z]+)\ue001")
    run_names = RUN_VARIABLES if model_of is not None else tuple(n for n in RUN_VARIABLES if n != "model")

    @functools.lru_cache(maxsize=1024)
    def watched_of(run_as: str, owner: str, cwd: str) -> tuple[str, ...]:
        """The directories whose entries the prompt depends on besides the files it read (joined
        once per account and directory: every run asks)."""
        watched = [
            f"{system_dir}",
            f"{homes}/{run_as}/context.d",
            *map(str, skill_layers(data_dir, run_as)),
            cwd,
            f"{homes}/{owner}/memory",
        ]
        if owner != run_as:
            watched.append(f"{homes}/{owner}/context.d")
        return tuple(watched)

    def online(record: ProcessRecord) -> str:
        return describe_devices(devices.online(record.owner)) if devices is not None else "local"

    def assemble(record: ProcessRecord, devices_text: str, mcp_text: str) -> tuple[CompiledPrompt, list[str]]:
        sources = PromptSources(
            system_dir=system_dir,
            agent_home=homes / record.run_as,
            owner_home=homes / record.owner,
            skills_dirs=list(skill_layers(data_dir, record.run_as)),
            workspace=Path(record.cwd),
            process_context=record.context or None,
            main_process=record.parent_pid is None,
            max_context_bytes=context_bytes,
            variables={
                "identity": record.run_as,
                "owner": record.owner,
                "cwd": record.cwd,
                "home": str(homes / record.run_as),
                "devices": devices_text,
                "mcp_servers": mcp_text,
                **{name: f"{opening}{name}\ue001" for name in run_names},
            },
        )
        assembled = assemble_prompt(sources)
        for warning in assembled.warnings:  # once per assembly: the result is cached until a file changes
            log.warning("system prompt of process %s: %s", record.pid, warning)
        consulted = {str(p) for p in assembled.consulted}
        consulted.update(str(p) for section in assembled.sections for p in section.sources)
        return _compiled(base, assembled, _relative_to(_roots(data_dir, record))), sorted(consulted)

    async def run_values(record: ProcessRecord, names: Sequence[str]) -> dict[str, str]:
        """The values of the run variables ``names`` for a prompt built now for ``record``."""
        now = datetime.datetime.now().astimezone()
        values = {"time": now.strftime("%H:%M"), "pid": record.pid}
        if "timezone" in names:
            values["timezone"] = local_zone(now)
        if "model" in names and model_of is not None:
            values["model"] = await model_of(record)
        return {name: values[name] for name in names}

    async def fill(record: ProcessRecord, entry: _Assembly) -> CompiledPrompt:
        """The cached assembly with this build's run variables in place of its markers."""
        if not entry.uses:
            return entry.template
        values = await run_values(record, entry.uses)
        if entry.filled is not None and entry.filled[0] == values:
            return entry.filled[1]
        prompt = _filled(entry.template, markers, values)
        entry.filled = (values, prompt)
        return prompt

    async def build(record: ProcessRecord, tools: Mapping[str, Tool]) -> CompiledPrompt:
        devices_text = online(record)
        mcp_text = ", ".join(mcp_server_names(tools.values())) or "none"
        key = (
            devices_text,
            mcp_text,
            record.run_as,
            record.owner,
            record.cwd,
            record.context,
            record.parent_pid is None,
            datetime.date.today(),
            requirements_generation(),
        )
        watched = watched_of(record.run_as, record.owner, record.cwd)
        hit = cache.get(key)
        if hit is not None and hit.stamps == path_stamps([*watched, *hit.files]):
            return await fill(record, hit)
        prompt, files = assemble(record, devices_text, mcp_text)
        if len(cache) > 1024:
            cache.clear()
        uses = tuple(sorted(set(markers.findall(prompt.text))))
        entry = cache[key] = _Assembly(path_stamps([*watched, *files]), files, prompt, uses)
        return await fill(record, entry)

    return build


def _filled(template: CompiledPrompt, markers: re.Pattern[str], values: Mapping[str, str]) -> CompiledPrompt:
    """``template`` with each marker replaced by its variable's value, in one pass (a value is
    never expanded again). Only the system context is templated, so its section's size in the
    manifest changes by what the values add."""
    text = markers.sub(lambda match: values[match.group(1)], template.text)
    grown = len(text.encode("utf-8")) - len(template.text.encode("utf-8"))
    sections = tuple(
        replace(section, bytes=section.bytes + grown) if section.name == "system context" else section
        for section in template.sections
    )
    return replace(template, text=text, sections=sections)


def _compiled(base: str, assembled: AssembledPrompt, shown: Callable[[str], str]) -> CompiledPrompt:
    """The run's prompt (``base`` first) with its manifest: paths shown as ``shown`` makes them."""

    def name(path: Path) -> str:
        return shown(str(path)).removesuffix(f"/{SKILL_FILE}")  # a skill is its folder

    sections = tuple(
        PromptSection(
            s.name,
            s.bytes,
            tuple(map(name, s.sources)),
            s.truncated,
            tuple(map(name, s.omitted)),
        )
        for s in assembled.sections
    )
    text = "\n\n".join(part for part in (base, assembled.text) if part)
    warnings = tuple(map(shown, assembled.warnings))
    return CompiledPrompt(text, sections, warnings, len(base.encode("utf-8")), assembled.catalog(name))


def _roots(data_dir: Path, record: ProcessRecord) -> list[tuple[str, str]]:
    """The directories a process's prompt files live in, each with what it is shown as, for
    ``_relative_to``: as named and as resolved (a skill's path, and the path in a warning about an
    unreadable file, are real ones), so a home or a skills directory linked in from elsewhere is
    named as its link is. A skill layer is ``skills.d`` wherever it really is."""
    named = [Path(record.cwd)]
    named += [data_dir / "home" / record.run_as, data_dir / "home" / record.owner, data_dir / "config" / "ai", data_dir]
    roots = [(str(root), "") for root in named]
    roots += [(str(root.resolve()), "") for root in named]
    roots += [(str(layer.resolve()), layer.name) for layer in skill_layers(data_dir, record.run_as)]
    return roots


def _relative_to(roots: Sequence[str | tuple[str, str]]) -> Callable[[str], str]:
    """Paths under ``roots`` in a text made relative to the innermost (the working directory's
    ``AGENTS.md``, a home's ``context.d/x.md``, the system's ``skills.d/deploy``); a root itself
    becomes ``.``. A root may come with a name to show instead (``(path, "skills.d")``). What the
    prompt's manifest says goes to watchers, who must not learn where the server keeps its data
    (nor, from a warning, how that directory is laid out). Only a whole path is a root: one
    inside a longer path or word (``/backup/srv/data``, ``metadata``) is left as it is."""
    shown: dict[str, str] = {}
    for root in roots:
        path, name = (root, "") if isinstance(root, str) else root
        if path.strip("/"):
            shown.setdefault(path.rstrip("/"), name)
    ordered = sorted(shown, key=len, reverse=True)  # (the innermost root wins)
    # a root starts a path: not after a character of a name (nor, a relative one, after a "/")
    starts = "|".join(re.escape(r) if r.startswith("/") else "(?<!/)" + re.escape(r) for r in ordered)
    pattern = re.compile(r"(?<![\w.~-])(" + starts + r")(?:(/)|(?![\w.-]))")

    def sub(match: re.Match[str]) -> str:
        name = shown[match.group(1)]
        if match.group(2):
            return f"{name}/" if name else ""
        return name or "."

    return lambda text: pattern.sub(sub, text) if ordered else text
