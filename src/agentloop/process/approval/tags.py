"""The facts about one tool call that a policy's ``when`` clause can test.

Paths are judged lexically (``..`` folded, ``~`` expanded): the call may be bound for another
device, and a decision should not depend on the moment it is taken; the tools themselves confine
what they reach. A shell operand is read as the shell expands it; the path of any other call also
as the file tools read it (``resolve_path``), which expands nothing: ``$x/../.env`` is
``<root>/.env``, and ``~/..`` is the workspace. One exception looks at this machine: whether a
path leads into the kernel's own data (``protected``), through a link or as a shell glob would
match it, is also checked on disk, since that data is refused whatever the policy says; and so is
whether a write leads into a repository's ``.git`` through a link.
"""

from __future__ import annotations

import glob
import itertools
import os
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from agentloop.process.approval.shell import ShellAnalysis, classify_shell

__all__ = [
    "PATH_ARGS",
    "CallFacts",
    "call_facts",
    "call_tags",
    "call_target",
    "is_local",
    "path_inside",
    "path_tags",
    "workspace_path",
]

StrPath = str | os.PathLike[str]

#: Writing here needs root on any sane machine (or changes the machine itself).
SYSTEM_DIRS = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/boot", "/sys", "/proc", "/dev", "/root")
_WRITES = frozenset({"fs.write", "fs.edit", "fs.delete"})
# what the shell expands before a command sees it: a pattern's matches are not known here
_GLOB = re.compile(r"[*?\[]")
# a process's environment (the runtime's credentials) and memory, readable by the same user
_PROCESS_SECRETS = re.compile(r"/proc/[^/]+/(?:task/[^/]+/)?(?:environ|mem)")


def in_git_dir(path: str) -> bool:
    """Whether ``path`` names a repository's ``.git`` (a folder, or the file that points a
    worktree at one) or lies inside it, in any case (``.GIT`` on a case-insensitive disk) or as a
    shell pattern could match it (``.gi?``; bash matches a leading dot only when it is spelled):
    its ``config`` and ``hooks`` name programs that a later, harmless-looking ``git status``
    runs."""
    return any(part.startswith(".") and fnmatchcase(".git", part.lower()) for part in path.split("/"))


@dataclass(frozen=True)
class CallFacts:
    """Tags plus what they were read from, so a prompt can show the user why."""

    tags: frozenset[str]
    paths: tuple[str, ...] = ()
    shell: ShellAnalysis | None = None
    notes: tuple[str, ...] = field(default=())


def is_local(target: str | None) -> bool:
    return target in (None, "", "local")


_ROUTABLE = frozenset({"fs.read", "fs.write", "fs.edit", "fs.delete", "fs.search", "shell.exec", "net.fetch"})


def call_target(syscall: str, tool_name: str, args: Mapping[str, Any]) -> str:
    """Where a call runs: ``local`` or a device id.

    A routable syscall names its device in ``args["target"]``; a device's own tool is named
    ``<device>__<tool>`` (DESIGN §4). Reading the name is deliberately generous: a local tool
    whose name holds ``__`` is judged as remote, which only makes the policy stricter.
    """
    if syscall in _ROUTABLE:
        target = args.get("target")
        return target if isinstance(target, str) and not is_local(target) else "local"
    if syscall.startswith("mcp."):  # an MCP server's tool, <server>__<tool>: the server calls it itself
        return "local"
    device, sep, rest = tool_name.partition("__")
    return device if sep and device and rest else "local"


def _real(path: str) -> str:
    """Where ``path`` leads through links, as far as this user may look."""
    try:
        return os.path.realpath(path)
    except OSError:  # a link it may not read (/proc/1/fd/0)
        return path


def path_inside(path: str, base: str) -> bool:
    """Whether the normalised path ``path`` is ``base`` or lies below it (folder by folder:
    ``/etcetera`` is not under ``/etc``)."""
    return path == base or path.startswith(base.rstrip("/") + "/")


#: The argument naming the path each routable syscall's tool resolves in the workspace.
PATH_ARGS: dict[str, str] = {
    "fs.read": "path",
    "fs.write": "path",
    "fs.edit": "path",
    "fs.delete": "path",
    "fs.search": "path",
    "shell.exec": "cwd",
}


def workspace_path(path: str, base: str, home: str | None = None) -> str:
    """``path`` as the tools resolve it, lexically: relative to ``base``, ``..`` folded, nothing
    expanded. With ``home``, a leading ``~`` is that home, as a person writing a policy means it."""
    if home is not None and (path == "~" or path.startswith("~/")):
        path = home + path[1:]
    return posixpath.normpath(posixpath.join(base, path))


_MAX_ALTERNATIVES = 64  # more, and a command line of a hundred characters could stall the server
_BRACE_RANGE = re.compile(r"\{[^{}]*\.\.[^{}]*\}")  # ``{a..z}``: not expanded here
# commands that read a whole tree below the directories they are given (or, with a flag, can)
_WALKERS = frozenset({"find", "rg", "ag", "ack", "tar", "zip", "rsync", "tree", "scp", "bsdtar"})
_FLAG_WALKERS = frozenset({"grep", "egrep", "fgrep", "cp", "ls", "chmod", "chown", "chgrp", "diff", "zgrep"})
_RECURSIVE_FLAG = re.compile(r"(?:^|\s)(?:--recursive|--dereference-recursive|-[A-Za-z]*[rRa][A-Za-z]*)(?=\s|$)")


def walks_tree(command: str, analysis: ShellAnalysis) -> bool:
    """Whether a command line may read everything below a directory it names (so naming one that
    holds the kernel's data reaches into it); ``ls /`` or ``du -sh ~`` do not read files."""
    names = set(analysis.commands)
    return bool(names & _WALKERS) or bool(names & _FLAG_WALKERS and _RECURSIVE_FLAG.search(command))


def _braces(pattern: str) -> list[str] | None:
    """``a{b,c}d`` → ``abd``, ``acd`` (nested and repeated too), as the shell expands it; None
    past ``_MAX_ALTERNATIVES``."""
    alternatives = _expand_braces(pattern)
    return alternatives if len(alternatives) <= _MAX_ALTERNATIVES else None


def _expand_braces(pattern: str) -> list[str]:
    depth, start = 0, -1
    for i, ch in enumerate(pattern):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                body, parts, level, last = pattern[start + 1 : i], [], 0, 0
                for j, c in enumerate(body):
                    level += (c == "{") - (c == "}")
                    if c == "," and level == 0:
                        parts.append(body[last:j])
                        last = j + 1
                parts.append(body[last:])
                if len(parts) < 2:
                    continue  # ``{x}`` is literal
                head, tail = pattern[:start], pattern[i + 1 :]
                out: list[str] = []
                for part in parts:
                    out += _expand_braces(head + part + tail)
                    if len(out) > _MAX_ALTERNATIVES:
                        return out  # (the caller gives up: no need to build the rest)
                return out
    return [pattern]


def _reach(pattern: str, protected: Sequence[str]) -> tuple[bool, bool]:
    """Whether a glob pattern (absolute, normalised) can name a path inside a protected directory,
    and whether it can name a directory that holds one: component by component, as the shell
    matches it (``*`` stays within a component)."""
    parts = pattern.strip("/").split("/")
    inside = holds = False
    for guarded in protected:
        names = guarded.strip("/").split("/")
        common = min(len(parts), len(names))
        if all(fnmatchcase(name, part) for name, part in zip(names[:common], parts[:common], strict=True)):
            if len(parts) >= len(names):
                inside = True
            else:
                holds = True
    return inside, holds


def _resolve(path: str, base: str, home: str) -> str | None:
    """The absolute, normalised form of ``path``, or None if it depends on the environment."""
    if not path or "$" in path or "`" in path or "\x00" in path:
        return None
    if path == "~" or path.startswith("~/"):
        path = home + path[1:]
    elif path.startswith("~"):
        return None  # another user's home: unknown here
    return posixpath.normpath(posixpath.join(base, path))


def path_tags(
    path: str,
    *,
    base: StrPath,
    cwd: StrPath,
    home: StrPath,
    writing: bool = False,
    protected: Sequence[str] = (),
    shell: bool = False,
    walks: bool = False,
) -> set[str]:
    """Tags for one path named relative to ``base``; ``writing`` also flags system directories.
    A path inside one of the ``protected`` directories (agentloop's own data: its database,
    archives, policies) is ``protected``, also when a symlink on the way leads there, and so is a
    process's environment. A ``shell`` operand is what the shell expands: one that depends on a
    variable (or another user's home, or too many braces) is ``unclassified``, a glob that can
    match a protected path is ``protected``, and, for a command that ``walks`` a tree, a directory
    holding a protected one is ``unclassified``."""
    if shell and "{" in path:  # expanded first: ``{/a,b}/c`` is /a/c and <base>/b/c
        alternatives = _braces(path)
        if alternatives is None or any(_BRACE_RANGE.search(p) for p in alternatives):
            return {"unclassified"}
        if alternatives != [path]:
            found: set[str] = set()
            for p in alternatives:
                found |= path_tags(
                    p, base=base, cwd=cwd, home=home, writing=writing, protected=protected, shell=True, walks=walks
                )
            return found
    cwd_s, home_s = posixpath.normpath(os.fspath(cwd)), posixpath.normpath(os.fspath(home))
    base_s = posixpath.normpath(os.fspath(base))
    resolved = _resolve(path, base_s, home_s)
    if shell:
        if resolved is None:
            return {"unclassified"}  # ``$VAR/x``, ``~other/x``: not known here
        readings = {resolved}
    elif not path or "\x00" in path:
        return set()  # (the tools refuse it)
    else:
        # the tools expand nothing (``$x/../data`` is ``<root>/data``); another reader of a path
        # argument may expand ``~``: judged both ways
        readings = {workspace_path(path, base_s)} | ({resolved} if resolved is not None else set())
    found = set()
    for reading in readings:
        found |= _resolved_tags(reading, cwd_s, home_s, writing=writing, protected=protected, shell=shell, walks=walks)
    return found


def _resolved_tags(
    resolved: str,
    cwd_s: str,
    home_s: str,
    *,
    writing: bool,
    protected: Sequence[str],
    shell: bool,
    walks: bool,
) -> set[str]:
    """The tags of one absolute, normalised path (see :func:`path_tags`)."""
    tags: set[str] = set()
    if _PROCESS_SECRETS.fullmatch(resolved):
        tags.add("protected")
    if shell and _GLOB.search(resolved):
        inside, holds = _reach(resolved, protected)
        # what it matches here, through links too (``lin?/x`` with ``link`` pointing at the data)
        inside = inside or (
            bool(protected)
            and any(
                path_inside(_real(found), d)
                for found in itertools.islice(glob.iglob(resolved), _MAX_ALTERNATIVES)
                for d in protected
            )
        )
        if inside:
            tags.add("protected")
        elif (holds and walks) or resolved.startswith("/proc/"):  # (/proc: an environment, by any spelling)
            tags.add("unclassified")
    elif protected and any(path_inside(p, d) for p in {resolved, _real(resolved)} for d in protected):
        tags.add("protected")
    elif walks and any(path_inside(d, resolved) for d in protected):
        tags.add("unclassified")
    inside_cwd = path_inside(resolved, cwd_s)
    if not inside_cwd:
        tags.add("outside-cwd")
    if not path_inside(resolved, home_s):
        tags.add("outside-home")
    # Judge hiddenness below cwd only: a workspace under ~/.cache must not make every path hidden.
    shown = posixpath.relpath(resolved, cwd_s) if inside_cwd else resolved
    if any(part.startswith(".") and part not in (".", "..") for part in shown.split("/")):
        tags.add("hidden-path")
    if writing and any(path_inside(resolved, d) for d in SYSTEM_DIRS) and resolved not in ("/dev/null",):
        tags.add("privileged")
    if writing and (in_git_dir(resolved) or in_git_dir(_real(resolved))):  # (through a link too)
        tags.add("unclassified")  # what git will run next is being changed
    return tags


def _paths_tags(
    paths: Iterable[str],
    writes: Iterable[str],
    *,
    base: StrPath,
    cwd: StrPath,
    home: StrPath,
    protected: Sequence[str] = (),
    shell: bool = False,
    walks: bool = False,
) -> set[str]:
    written = set(writes)
    tags: set[str] = set()
    for p in paths:
        writing = p in written
        tags |= path_tags(
            p, base=base, cwd=cwd, home=home, writing=writing, protected=protected, shell=shell, walks=walks
        )
    return tags


def facts_read_args(syscall: str, args: Mapping[str, Any]) -> bool:
    """Whether :func:`call_facts` looks at this call's arguments (a command, a method, a path):
    when it does not, every call of ``syscall`` on one target has the same facts."""
    return syscall in ("shell.exec", "net.fetch", "shell.jobs") or "path" in args


def call_facts(
    syscall: str,
    args: Mapping[str, Any],
    *,
    target: str | None = "local",
    cwd: StrPath,
    home: StrPath,
    root: StrPath | None = None,
    protected: Sequence[str] = (),
) -> CallFacts:
    """Everything :func:`call_tags` knows about a call.

    ``root`` is the directory the tools resolve their relative paths against (the workspace),
    ``cwd`` the one ``outside-cwd`` is measured from; they are the same unless told otherwise.
    ``protected`` directories make the paths inside them ``protected`` (see :func:`path_tags`).
    """
    base = root if root is not None else cwd
    tags: set[str] = set()
    if not is_local(target):
        tags.add("remote")
    if syscall == "shell.exec":
        command = args.get("command")
        command = command if isinstance(command, str) else None
        analysis = classify_shell(command) if command is not None else None
        workdir = args.get("cwd", ".")
        workdir = workdir if isinstance(workdir, str) and workdir else "."
        if analysis is None or command is None:
            tags.add("unclassified")
            return CallFacts(frozenset(tags), (), None, ("no command given",))
        tags |= analysis.tags
        tags |= path_tags(workdir, base=base, cwd=cwd, home=home, protected=protected)
        # the shell tool resolves its ``cwd`` as the file tools do, expanding nothing (``$x/..`` is
        # the workspace): operands are judged from there, and from the ``~`` reading too
        base_s = posixpath.normpath(os.fspath(base))
        workdirs = {workspace_path(workdir, base_s)}
        expanded = _resolve(workdir, base_s, posixpath.normpath(os.fspath(home)))
        if expanded is not None:
            workdirs.add(expanded)
        walks = walks_tree(command, analysis)
        if "mutating" in analysis.tags and any(in_git_dir(p) for p in analysis.paths):
            tags.add("unclassified")  # (``cd .git && echo x > config``: a write from there)
        cwd_s, home_s = posixpath.normpath(os.fspath(cwd)), posixpath.normpath(os.fspath(home))
        for resolved_workdir in workdirs:
            for repo in analysis.git_dirs:  # a repository outside the workspace: its own configuration
                where = _resolve(repo, resolved_workdir, home_s)
                if where is None or not path_inside(where, cwd_s):
                    tags.add("unclassified")
            tags |= _paths_tags(
                analysis.paths,
                analysis.writes,
                base=resolved_workdir,
                cwd=cwd,
                home=home,
                protected=protected,
                shell=True,
                walks=walks,
            )
        return CallFacts(frozenset(tags), analysis.paths, analysis, analysis.reasons)
    if syscall == "shell.jobs":
        # (a background command this process started, judged as it started: looking at it only
        # reads, and writing to it or stopping it changes no more than the command itself may)
        if args.get("action") in ("input", "stop"):
            tags.add("mutating")
        return CallFacts(frozenset(tags))
    path = args.get("path")
    paths = (path,) if isinstance(path, str) and path else ()
    if syscall in _WRITES:
        tags.add("mutating")
    if syscall == "fs.delete":
        tags.add("destructive")
    if syscall == "codemode.exec":
        tags.add("unclassified")  # its nested calls are judged one by one as they happen
    if syscall == "net.fetch":
        tags.add("network")
        if str(args.get("method", "GET")).upper() not in ("GET", "HEAD"):
            tags.add("mutating")
    tags |= _paths_tags(paths, paths if syscall in _WRITES else (), base=base, cwd=cwd, home=home, protected=protected)
    return CallFacts(frozenset(tags), paths)


def call_tags(
    syscall: str,
    args: Mapping[str, Any],
    *,
    target: str | None = "local",
    cwd: StrPath,
    home: StrPath,
    root: StrPath | None = None,
) -> set[str]:
    """The tags of one call: the facts that approval rules are written against."""
    return set(call_facts(syscall, args, target=target, cwd=cwd, home=home, root=root).tags)
