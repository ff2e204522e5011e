"""Judging a shell command line by its syntax tree, never by substrings.

Substring matching both over-fires (``echo "rm -rf /"``) and under-fires (``r\\m``, ``sudo -u
bob rm``); so the line is parsed with bashlex and every simple command in it — inside lists,
pipelines, loops, substitutions and ``bash -c`` strings — is classified by its real name and
arguments. Anything we cannot judge (an unknown program, a computed command name, an
interpreter, a parse failure) is ``unclassified``: the classifier errs towards asking.

Everything here is pure: no file system, no environment; the same line always gets the same tags.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["ShellAnalysis", "classify_shell"]

MAX_LENGTH = 20_000  # longer lines are not parsed (bashlex is pure Python and may be slow)
MAX_DEPTH = 4  # nesting of bash -c / su -c / find -exec / xargs / substitutions


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


READ_ONLY = _words(
    "ls cat grep egrep fgrep rg head tail wc echo printf pwd date which whoami id uname hostname stat file "
    "tree du df jq yq sort uniq cut tr diff cmp comm basename dirname realpath readlink true false test [ [[ "
    "type printenv less more nl column md5sum sha1sum sha256sum sha512sum cksum ps free uptime seq sleep cd "
    "pushd popd set unset shopt : exit return wait read bat locale tput clear history "
    "column fold fmt expand od hexdump xxd strings lsblk lscpu nproc getconf dmesg tac rev paste join "
    "look cal bc expr man help info whereis groups tty last w who"
)
NETWORK = _words(
    "curl wget ssh scp sftp rsync nc ncat netcat telnet ftp ping dig nslookup host http https aria2c "
    "socat whois traceroute mosh"
)
PRIVILEGED = _words(
    "mount umount systemctl service useradd userdel usermod groupadd groupdel passwd chroot insmod modprobe "
    "rmmod sysctl iptables nft ip6tables visudo launchctl"
)
DESTRUCTIVE = _words("rm rmdir unlink shred dd mkfs wipefs fdisk sfdisk parted truncate kill pkill killall")
POWER = _words("reboot shutdown halt poweroff")
MUTATING = _words(
    "touch mkdir cp mv ln install patch tee chmod chown chgrp unzip gunzip gzip bunzip2 bzip2 xz unxz zip setfacl"
)
SHELLS = _words("bash sh zsh dash ksh fish csh tcsh busybox")
INTERPRETERS = _words(
    "python python2 python3 node nodejs ruby perl php deno bun lua Rscript osascript pwsh powershell irb"
)
DYNAMIC = _words("eval source . trap alias")
# Wrappers that run their last part as a command: name → options that take a value.
WRAPPERS: dict[str, frozenset[str]] = {
    "sudo": _words("-u -g -C -D -h -p -r -t -U -T"),
    "doas": _words("-u -C"),
    "pkexec": _words("--user"),
    "env": _words("-u -C -S --unset --chdir"),
    "nice": _words("-n --adjustment"),
    "ionice": _words("-c -n -p -t"),
    "nohup": frozenset(),
    "time": _words("-f -o --format --output"),
    "stdbuf": _words("-i -o -e"),
    "command": frozenset(),
    "builtin": frozenset(),
    "exec": _words("-a"),
    "chronic": frozenset(),
    "unbuffer": frozenset(),
    "timeout": _words("-s -k --signal --kill-after"),
    "xargs": _words(
        "-I -i -n -P -L -l -d -E -e -s -a --max-args --max-procs --delimiter --arg-file --process-slot-var "
        "--max-lines --max-chars --eof --replace"
    ),
}
# Their long options that take no value. Any other long option (without ``=value``) may take the
# next word as its value, so the command after it cannot be told apart: unclassified.
WRAPPER_FLAGS = _words(
    "--preserve-status --foreground --verbose --preserve-env --login --non-interactive --shell --background "
    "--stdin --reset-timestamp --set-home --ignore-environment --null --debug --no-run-if-empty --open-tty "
    "--interactive --exit --portability --append --quiet"
)
ELEVATING = frozenset({"sudo", "doas", "pkexec"})
# Assignments that change what a later command runs: its name's meaning, the loader, or a helper
# program it starts (a pager, an editor, git's ssh or diff command, an interpreter's startup code).
HIJACKING_VARS = _words(
    "PATH LD_PRELOAD LD_LIBRARY_PATH LD_AUDIT BASH_ENV ENV IFS PROMPT_COMMAND PS4 SHELLOPTS BASHOPTS "
    "DYLD_INSERT_LIBRARIES PAGER MANPAGER LESSOPEN LESSCLOSE EDITOR VISUAL GIT_EDITOR GIT_PAGER GIT_SSH "
    "GIT_SSH_COMMAND GIT_EXTERNAL_DIFF GIT_ASKPASS SSH_ASKPASS GIT_EXEC_PATH GIT_PROXY_COMMAND "
    "PERL5OPT PERL5LIB PYTHONSTARTUP PYTHONPATH NODE_OPTIONS RUBYOPT RUBYLIB TAR_OPTIONS RIPGREP_CONFIG_PATH "
    # where git (and others) find their configuration: one that names a program to run
    "GIT_DIR GIT_WORK_TREE GIT_COMMON_DIR GIT_TEMPLATE_DIR HOME XDG_CONFIG_HOME LESSKEY LESSKEYIN "
    "LESSKEY_CONTENT LESSKEY_SRC"
)
HIJACKING_PREFIXES = ("GIT_CONFIG",)  # GIT_CONFIG_PARAMETERS, GIT_CONFIG_KEY_<n>, GIT_CONFIG_GLOBAL, ...
SETTING_BUILTINS = _words("export declare typeset readonly local")
HARMLESS_SINKS = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty"})
BLOCK_DEVICE = re.compile(r"^/dev/(sd|hd|vd|xvd|nvme|mmcblk|disk|md|dm-|loop|mapper/)")
PATTERN_FIRST = _words("grep egrep fgrep rg sed awk gawk mawk jq yq")
WRITE_REDIRECTS = frozenset({">", ">>", ">|", "&>", "&>>", "<>", ">&"})
# what the shell may expand into other words (quoted or not: this errs towards "not literal")
_PATTERN = re.compile(r"[*?\[{]")


@dataclass(frozen=True)
class ShellAnalysis:
    """What a command line would do, as far as its syntax shows.

    ``paths`` are the literal path-like operands (for path tags); ``writes`` the subset it would
    create, change or remove; ``reasons`` say, per finding, why a tag was given. ``git_dirs``: where
    git is pointed by ``-C``, ``--git-dir`` or ``--work-tree`` (a repository brings its own
    configuration, which can name programs git runs). ``literal``: every
    command is named as it is found on the PATH (not by a path: ``./git``) and runs with words the
    line spells out: no variable assignment (``HOME=/tmp/x git``), expansion (``git push $X``) or
    glob or brace pattern, whose value could be an option that changes what the program runs.
    """

    tags: frozenset[str]
    commands: tuple[str, ...]
    paths: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()
    literal: bool = True
    git_dirs: tuple[str, ...] = ()


class _Arg(NamedTuple):
    text: str
    dynamic: bool  # contains an expansion whose value we cannot know


class _Verdict(NamedTuple):
    tags: frozenset[str]
    interpreter: bool = False  # runs code it is given at run time
    reads_stdin: bool = False  # ... and that code may come from standard input


_NONE = _Verdict(frozenset())


def _hijacks(assignment: str) -> bool:
    name = assignment.split("=", 1)[0]
    return name in HIJACKING_VARS or name.startswith(HIJACKING_PREFIXES)


def _is_option(text: str) -> bool:
    return text.startswith("-") and text != "-"


def _operands(args: Sequence[_Arg]) -> list[_Arg]:
    out: list[_Arg] = []
    ended = False
    for arg in args:
        if not ended and arg.text == "--":
            ended = True
        elif ended or not _is_option(arg.text):
            out.append(arg)
    return out


def _looks_like_path(text: str) -> bool:
    if "://" in text or re.match(r"^[^/]*@[^/]*:", text):
        return False
    return "/" in text or text.startswith((".", "~"))


class _Walker:
    def __init__(self) -> None:
        self.tags: set[str] = set()
        self.commands: list[str] = []
        self.paths: list[str] = []
        self.writes: list[str] = []
        self.reasons: list[str] = []
        self.git_dirs: list[str] = []
        self.literal = True

    # -- recording ---------------------------------------------------------------------------
    def tag(self, why: str, *tags: str) -> frozenset[str]:
        self.tags.update(tags)
        why = why if len(why) <= 160 else why[:159] + "…"
        if why not in self.reasons:
            self.reasons.append(why)
        return frozenset(tags)

    def written(self, args: Iterable[_Arg]) -> None:
        # (one made of a variable or substitution too: the path tags find it ``unclassified``)
        for arg in args:
            if arg.text not in HARMLESS_SINKS and arg.text != "{}":
                self.writes.append(arg.text)

    def analysis(self) -> ShellAnalysis:
        return ShellAnalysis(
            tags=frozenset(self.tags),
            commands=tuple(dict.fromkeys(self.commands)),
            paths=tuple(dict.fromkeys(self.paths + self.writes)),
            writes=tuple(dict.fromkeys(self.writes)),
            reasons=tuple(self.reasons),
            literal=self.literal,
            git_dirs=tuple(dict.fromkeys(self.git_dirs)),
        )

    # -- parsing ------------------------------------------------------------------------------
    def line(self, text: str, depth: int) -> frozenset[str]:
        if depth > MAX_DEPTH:
            return self.tag("nested too deeply to judge", "unclassified")
        if len(text) > MAX_LENGTH:
            return self.tag("command line too long to judge", "unclassified")
        import bashlex  # here, not at the top: it builds its parser tables on import (~0.2 s)

        try:
            trees = bashlex.parse(text)
        except Exception as exc:  # bashlex raises many kinds (ParsingError, NotImplementedError, ...)
            return self.tag(f"cannot parse: {type(exc).__name__}", "unclassified")
        found: set[str] = set()
        for tree in trees:
            found |= self.node(tree, depth)
        return frozenset(found)

    def node(self, node: Any, depth: int) -> frozenset[str]:
        kind = getattr(node, "kind", None)
        if kind in ("operator", "pipe", "reservedword", "tilde"):
            return frozenset()
        if kind == "heredoc":  # (bashlex parses only unquoted delimiters, whose body is expanded)
            if "$(" in node.value or "`" in node.value:
                return self.tag("command substitution in a here-document", "unclassified")
            return frozenset()
        if kind == "pipeline":
            return self.pipeline(node, depth)
        if kind == "command":
            return self.command(node, depth).tags
        if kind in ("list", "if", "for", "while", "until"):
            return self.children(node.parts, depth)
        if kind == "compound":
            return self.children([*node.list, *getattr(node, "redirects", [])], depth)
        if kind == "function":
            body = self.children(node.parts, depth)
            return body | self.tag("defines a shell function", "unclassified")
        if kind == "word" or kind == "assignment":
            return self.children(getattr(node, "parts", []), depth)
        if kind in ("commandsubstitution", "processsubstitution"):
            return self.node(node.command, depth + 1)
        if kind == "parameter":
            if "$(" in node.value or "`" in node.value:
                return self.tag("command substitution inside ${...}", "unclassified")
            if node.value.endswith("@P"):  # expanded like a prompt: a $(...) in the value runs
                return self.tag("${...@P} runs the substitutions its value holds", "unclassified")
            return frozenset()
        if kind == "redirect":
            return self.redirect(node, depth)
        return self.tag(f"shell construct {kind!r}", "unclassified")

    def children(self, nodes: Iterable[Any], depth: int) -> frozenset[str]:
        found: set[str] = set()
        for child in nodes:
            found |= self.node(child, depth)
        return frozenset(found)

    def pipeline(self, node: Any, depth: int) -> frozenset[str]:
        found: set[str] = set()
        for part in node.parts:
            if getattr(part, "kind", None) == "command":
                verdict = self.command(part, depth)
                if verdict.reads_stdin and "network" in found:
                    verdict = verdict._replace(
                        tags=verdict.tags
                        | self.tag("pipes a download into an interpreter", "destructive", "unclassified")
                    )
                found |= verdict.tags
            else:
                found |= self.node(part, depth)
        return frozenset(found)

    def redirect(self, node: Any, depth: int) -> frozenset[str]:
        target = node.output
        heredoc = getattr(node, "heredoc", None)
        found = self.node(heredoc, depth) if heredoc is not None else frozenset()
        if getattr(target, "kind", None) != "word":
            return found  # 2>&1 and the like
        found |= self.node(target, depth)
        arg = self.arg(target)
        self.literal = self.literal and not arg.dynamic and not _PATTERN.search(arg.text)  # (``> $F``)
        if arg.text.startswith(("/dev/tcp/", "/dev/udp/")):  # bash opens a socket for these
            return found | self.tag(f"connects to {arg.text}", "network")
        if node.type not in WRITE_REDIRECTS:
            if node.type in ("<", "<>"):
                self.paths.append(arg.text)  # read: judged like any operand (``cat < secret``)
            return found
        if arg.text in HARMLESS_SINKS or arg.text.startswith("/dev/fd/"):
            return found
        if not arg.dynamic and BLOCK_DEVICE.match(arg.text):
            return found | self.tag(f"writes to the device {arg.text}", "destructive", "privileged", "mutating")
        self.written([arg])
        return found | self.tag(f"redirects output to {arg.text}", "mutating")

    @staticmethod
    def arg(word: Any) -> _Arg:
        parts = getattr(word, "parts", []) or []
        dynamic = any(getattr(p, "kind", None) != "tilde" for p in parts)
        return _Arg(word.word, dynamic)

    def command(self, node: Any, depth: int) -> _Verdict:
        found: set[str] = set()
        args: list[_Arg] = []
        hijack = False
        for part in node.parts:
            kind = getattr(part, "kind", None)
            found |= self.node(part, depth)
            if kind == "word":
                args.append(self.arg(part))
                self.literal = self.literal and not args[-1].dynamic and not _PATTERN.search(args[-1].text)
            elif kind == "assignment":
                self.literal = False
                hijack = hijack or (not args and _hijacks(part.word))
        verdict = self.argv(args, depth)
        if hijack:  # before a command, for it; alone, for every later command of the line
            found |= self.tag("changes PATH or the loader before running a command", "unclassified")
        if verdict.interpreter and "network" in found:
            found |= self.tag("feeds downloaded code to an interpreter", "destructive", "unclassified")
        return verdict._replace(tags=verdict.tags | found)

    # -- classifying one argv ---------------------------------------------------------------------
    def argv(self, args: Sequence[_Arg], depth: int) -> _Verdict:
        if not args:
            return _NONE
        head, rest = args[0], list(args[1:])
        if head.dynamic:
            return _Verdict(self.tag(f"computed command name {head.text}", "unclassified"))
        name = posixpath.basename(head.text) or head.text
        self.literal = self.literal and name == head.text
        self.commands.append(name)
        self.note_paths(name, rest)
        if name in WRAPPERS:
            return self.wrapper(name, rest, depth)
        if name in SHELLS or name in INTERPRETERS or name in DYNAMIC:
            return self.interpreter(name, rest, depth)
        if re.match(r"^python\d+(\.\d+)?$", name):
            return self.interpreter("python", rest, depth)
        special = _SPECIAL.get(name)
        if special is not None:
            return _Verdict(special(self, name, rest, depth))
        if name.startswith("mkfs"):
            name = "mkfs"
        return _Verdict(self.simple(name, rest))

    def note_paths(self, name: str, rest: Sequence[_Arg]) -> None:
        if name in ("echo", "printf") or name in WRAPPERS or name in SHELLS or name in INTERPRETERS:
            return  # their operands are text, a command, or code, not paths
        operands = _operands(rest)
        if name in PATTERN_FIRST and not any(a.text in ("-e", "-f", "--regexp") for a in rest):
            operands = operands[1:]
        # an operand with an expansion could be any path: kept, for the path tags to judge
        self.paths.extend(a.text for a in operands if a.dynamic or _looks_like_path(a.text))

    def simple(self, name: str, rest: Sequence[_Arg]) -> frozenset[str]:
        if name in READ_ONLY:
            return frozenset()
        if name in NETWORK:
            return self.tag(f"{name} uses the network", "network")
        if name in PRIVILEGED:
            return self.tag(f"{name} needs elevated rights", "privileged", "mutating")
        if name in POWER:
            return self.tag(f"{name} stops the machine", "privileged", "destructive", "mutating")
        if name in DESTRUCTIVE:
            if name == "dd":
                targets = [_Arg(a.text[3:], a.dynamic) for a in rest if a.text.startswith("of=")]
                self.written(targets)
                if any(BLOCK_DEVICE.match(t.text) for t in targets):
                    self.tag("dd writes to a device", "privileged")
            elif name not in ("kill", "pkill", "killall"):
                self.written(_operands(rest))
            return self.tag(f"{name} destroys data", "destructive", "mutating")
        if name in MUTATING:
            operands = _operands(rest)
            if name in ("chmod", "chown", "chgrp", "setfacl"):
                operands = operands[1:]
                if any(a.text in ("-R", "--recursive") or re.match(r"^-[a-zA-Z]*R", a.text) for a in rest):
                    self.written(operands)
                    return self.tag(f"{name} -R changes a whole tree", "destructive", "mutating")
            elif name == "ln":
                pass  # (the link, and what it leads to: ``ln -s .git g`` opens a way into .git)
            elif name == "cp" or name == "mv" or name == "install":
                operands = operands[-1:]
            self.written(operands)
            return self.tag(f"{name} changes files", "mutating")
        return self.tag(f"{name} is not a command we can judge", "unclassified")

    def wrapper(self, name: str, rest: list[_Arg], depth: int) -> _Verdict:
        takes_value = WRAPPERS[name]
        found: set[str] = set()
        if name in ELEVATING:
            found |= self.tag(f"{name} runs a command as another user", "privileged")
        i = 0
        while i < len(rest):
            text = rest[i].text
            if text == "--":
                i += 1
                break
            if name == "env" and "=" in text and not text.startswith("-"):
                if _hijacks(text):
                    found |= self.tag("env changes PATH or the loader", "unclassified")
                i += 1
                continue
            if not _is_option(text):
                break
            if name == "env" and (re.match(r"^-[a-zA-Z0-9]*S", text) or _abbreviates(text, ("--split-string",))):
                return _Verdict(frozenset(found | self.tag("env -S splits a string into a command", "unclassified")))
            if text.startswith("--") and "=" not in text and text not in takes_value and text not in WRAPPER_FLAGS:
                return _Verdict(frozenset(found | self.tag(f"{name} {text}: cannot tell its command", "unclassified")))
            if name == "time":
                found |= self.output_file(rest, i, ("-o", "--output"), "time -o")
            i += 2 if text in takes_value else 1
        wrapped = rest[i:]
        if name == "timeout" and wrapped:
            wrapped = wrapped[1:]  # the duration
        if name == "xargs" and not wrapped:
            wrapped = [_Arg("echo", False)]
        if name in ("exec", "command", "builtin", "env", "time", "nice", "nohup") and not wrapped:
            return _Verdict(frozenset(found))
        if not wrapped:
            return _Verdict(frozenset(found | self.tag(f"{name} without a command", "unclassified")))
        verdict = self.argv(wrapped, depth + 1)
        return verdict._replace(tags=verdict.tags | found)

    def output_file(self, args: Sequence[_Arg], i: int, options: tuple[str, ...], what: str) -> frozenset[str]:
        """``args[i]`` as an option naming a file to write (``-o FILE``, ``--output=FILE``)."""
        text = args[i].text
        if text in options and i + 1 < len(args):
            self.written([args[i + 1]])
        elif text.startswith(tuple(f"{o}=" for o in options if o.startswith("--"))):
            self.written([_Arg(text.split("=", 1)[1], args[i].dynamic)])
        else:
            return frozenset()
        return self.tag(f"{what} writes a file", "mutating")

    def interpreter(self, name: str, rest: list[_Arg], depth: int) -> _Verdict:
        if name in DYNAMIC:
            return _Verdict(self.tag(f"{name} runs code built at run time", "unclassified"), interpreter=True)
        if name == "python" or name in INTERPRETERS:
            module = next((rest[i + 1] for i, a in enumerate(rest[:-1]) if a.text == "-m"), None)
            if module is not None and module.text == "pip":
                return _Verdict(_package(self, "pip", rest[rest.index(module) + 1 :], depth))
        if name in SHELLS:
            for i, arg in enumerate(rest):
                if arg.text == "-c" or (re.match(r"^-[a-z]*c$", arg.text) and i + 1 < len(rest)):
                    inner = rest[i + 1] if i + 1 < len(rest) else None
                    if inner is None or inner.dynamic:
                        return _Verdict(self.tag(f"{name} -c with a computed script", "unclassified"), True)
                    return _Verdict(self.line(inner.text, depth + 1))
        operands = _operands(rest)
        reads_stdin = not operands or operands[0].text == "-" or any(a.text in ("-s", "-") for a in rest)
        kind = "runs a script" if operands else "reads a program"
        return _Verdict(self.tag(f"{name} {kind}", "unclassified"), interpreter=True, reads_stdin=reads_stdin)


# -- commands whose meaning depends on their arguments --------------------------------------------


_GIT_READS = _words(
    "status log diff show rev-parse ls-files blame grep describe shortlog ls-tree cat-file rev-list reflog "
    "whatchanged name-rev merge-base show-ref for-each-ref count-objects fsck check-ignore check-attr version "
    "help var verify-commit verify-tag cherry range-diff"
)
_GIT_NETWORK = _words("push pull clone fetch ls-remote submodule remote")
_GIT_CHANGES = _words(
    "add commit checkout switch restore reset clean branch tag stash merge rebase cherry-pick revert mv rm init "
    "config worktree am apply notes gc prune repack sparse-checkout format-patch archive bundle replace "
    "update-index update-ref symbolic-ref commit-tree write-tree read-tree hash-object mktree mktag lfs maintenance"
)
# Subcommands and options that run a program named on the command line.
_GIT_RUNNERS = _words("bisect filter-branch difftool mergetool send-email instaweb")
_GIT_EXEC_OPTIONS = ("--upload-pack", "--receive-pack", "--exec", "--extcmd", "--open-files-in-pager", "--tool")
# Configuration that names a program git (or ssh, a pager, a diff driver) will run later.
_GIT_EXEC_CONFIG = re.compile(
    r"^(alias\.|core\.(fsmonitor|sshcommand|pager|editor|hookspath|askpass|gitproxy)|diff\.|merge\..*\.driver|"
    r"filter\.|credential|gpg\.|sequence\.editor|pager\.|web\.|browser\.|uploadpack\.|receive\.|"
    r"remote\..*\.(uploadpack|receivepack|proxy)|include|protocol\.|difftool\.|mergetool\.|man\.|"
    r"instaweb\.|sendemail\.|ssh\.|.*\.textconv$)"
)


def _git(w: _Walker, name: str, rest: list[_Arg], depth: int) -> frozenset[str]:
    found: set[str] = set()
    i = 0
    moved = ""  # where ``-C`` took git (each one relative to the one before)
    while i < len(rest) and _is_option(rest[i].text):
        option = rest[i].text
        if option.startswith(("-c", "--config-env")) or option.startswith("--exec-path="):
            found |= w.tag(f"git {option.split('=')[0]} changes what git runs", "unclassified")
        elif option == "--bare":  # the working directory's ``config`` read as a repository's
            found |= w.tag("git --bare reads a repository's configuration from this directory", "unclassified")
        # a repository elsewhere, with its own configuration: judged by the path tags
        name, eq, value = option.partition("=")
        if name in ("-C", "--git-dir", "--work-tree"):
            where = value if eq else rest[i + 1].text if i + 1 < len(rest) else None
            if where is not None:
                if name == "-C":
                    moved = where if not moved else posixpath.join(moved, where)
                    w.git_dirs.append(moved)
                else:
                    w.git_dirs.append(posixpath.join(moved, where) if moved else where)
                    if eq:
                        w.paths.append(where)  # (``--git-dir=$X``: not an operand)
        i += 2 if option in ("-C", "-c", "--git-dir", "--work-tree", "--namespace", "--config-env") else 1
    if i >= len(rest):
        return frozenset(found)
    sub, args = rest[i].text, [a.text for a in rest[i + 1 :]]
    w.commands[-1] = f"git {sub}"
    if rest[i].dynamic or not (sub in _GIT_READS or sub in _GIT_NETWORK or sub in _GIT_CHANGES):
        return frozenset(found | w.tag(f"git {sub} is not a git command we know (an alias?)", "unclassified"))
    runs_program = (
        sub in _GIT_RUNNERS
        or any(a.startswith(_GIT_EXEC_OPTIONS) or _abbreviates(a, _GIT_EXEC_OPTIONS) for a in args)
        or (sub == "rebase" and "-x" in args)
        or (sub == "init" and any(_abbreviates(a, ("--template",)) for a in args))  # its hooks
        or (sub in ("clone", "ls-remote") and "-u" in args)
        or (sub == "grep" and any(re.match(r"^-[a-zA-Z]*O", a) for a in args))
    )
    if runs_program:
        found |= w.tag(f"git {sub} runs a program named on its command line", "unclassified")
    if sub == "config":
        return frozenset(found | _git_config(w, rest[i + 1 :]))
    for j in range(i + 1, len(rest)):  # diff, log, show ... --output FILE
        found |= w.output_file(rest, j, ("--output",), f"git {sub} --output")
    if sub in ("status", "log", "diff", "show", "rev-parse", "ls-files", "blame", "grep", "describe", "shortlog"):
        return frozenset(found)
    if sub in _GIT_NETWORK and (sub != "remote" or {"update", "prune"} & set(args)):
        found |= w.tag(f"git {sub} uses the network", "network")
        if sub == "push" and {"-f", "--force", "--force-with-lease", "--delete", "-d"} & set(args):
            found |= w.tag("git push --force rewrites a remote", "destructive", "mutating")
        elif sub not in ("ls-remote", "fetch"):
            found |= w.tag(f"git {sub} changes the repository", "mutating")
        return frozenset(found)
    if _git_reads(sub, args):
        return frozenset(found)
    if (
        (sub == "reset" and "--hard" in args)
        or (sub == "clean" and any(re.match(r"^-[a-zA-Z]*f", a) or a == "--force" for a in args))
        or (sub == "checkout" and ("--" in args or "-f" in args or "." in args))
        or (sub == "branch" and {"-D", "--delete", "-d"} & set(args))
        or sub == "restore"
        or (sub == "stash" and args[:1] in (["drop"], ["clear"]))
    ):
        return frozenset(found | w.tag(f"git {sub} discards work", "destructive", "mutating"))
    return frozenset(found | w.tag(f"git {sub} changes the repository", "mutating"))


def _abbreviates(arg: str, options: tuple[str, ...]) -> bool:
    """Whether ``arg`` is a long option read as one of ``options`` by a program that, like git or
    any user of getopt_long, takes any unambiguous prefix of a long option's name (``git push
    --receive=CMD`` runs CMD; ``sort --compress-p=CMD`` too)."""
    name = arg.split("=", 1)[0]
    return name.startswith("--") and len(name) > 2 and any(option.startswith(name) for option in options)


def _git_config(w: _Walker, rest: list[_Arg]) -> frozenset[str]:
    args = [a.text for a in rest]
    if {"--get", "--list", "-l", "--get-all", "--get-regexp"} & set(args):
        return frozenset()
    found: set[str] = set()
    if "--global" in args:
        w.written([_Arg("~/.gitconfig", False)])
    elif "--system" in args:
        w.written([_Arg("/etc/gitconfig", False)])
    key = next((a for a in _operands(rest) if not a.text.startswith("-")), None)
    if key is None or key.dynamic or _GIT_EXEC_CONFIG.match(key.text.lower()):
        found |= w.tag(f"git config {key.text if key else ''} can make git run a program", "unclassified")
    return frozenset(found | w.tag("git config changes the configuration", "mutating"))


_GIT_LISTING = _words("-a -v -vv -r -l --list --all --show-current --verbose --merged --contains")


def _git_reads(sub: str, args: list[str]) -> bool:
    if sub == "remote":
        return not args or args[0] in ("-v", "show", "get-url")
    if sub in ("branch", "tag"):
        return all(a in _GIT_LISTING for a in args)
    return args[:1] == ["list"] or args[:1] == ["show"]


def _su(w: _Walker, name: str, rest: list[_Arg], depth: int) -> frozenset[str]:
    found = w.tag("su runs a shell as another user", "privileged")
    for i, arg in enumerate(rest):
        if arg.text in ("-c", "--command") and i + 1 < len(rest):
            inner = rest[i + 1]
            if inner.dynamic:
                return found | w.tag("su -c with a computed command", "unclassified")
            return found | w.line(inner.text, depth + 1)
    return found


def _find(w: _Walker, name: str, rest: list[_Arg], depth: int) -> frozenset[str]:
    found: set[str] = set()
    i = 0
    while i < len(rest):
        text = rest[i].text
        if text == "-delete":
            found |= w.tag("find -delete removes files", "destructive", "mutating")
        elif text in ("-fprint", "-fprint0", "-fprintf", "-fls"):
            found |= w.tag(f"find {text} writes a file", "mutating")
        elif text in ("-exec", "-execdir", "-ok", "-okdir"):
            end = next((j for j in range(i + 1, len(rest)) if rest[j].text in (";", "+")), len(rest))
            found |= w.argv(rest[i + 1 : end], depth + 1).tags
            i = end
        i += 1
    return frozenset(found)


def _sed(w: _Walker, name: str, rest: list[_Arg], depth: int) -> frozenset[str]:
    found: set[str] = set()
    scripts: list[_Arg] = []
    operands = _operands(rest)
    i = 0
    while i < len(rest):
        text = rest[i].text
        if text in ("-f", "--file") or _abbreviates(text, ("--file",)) or re.match(r"^-[nrEsuz]*f", text):
            return w.tag("sed runs a script file we cannot see", "unclassified")
        if text.startswith("--") and "=" not in text and _abbreviates(text, ("--expression",)):
            text = "--expression"  # (``--exp SCRIPT``)
        elif text.startswith("--") and _abbreviates(text, ("--expression",)):
            text = "--expression=" + text.split("=", 1)[1]
        if text in ("-e", "--expression") or re.match(r"^-[nrEsuz]+e$", text):
            if i + 1 < len(rest):
                scripts.append(rest[i + 1])
                operands = [a for a in operands if a is not rest[i + 1]]
            i += 2
            continue
        if text.startswith("--expression="):
            scripts.append(_Arg(text.split("=", 1)[1], rest[i].dynamic))
        i += 1
    if not scripts and operands:
        scripts, operands = operands[:1], operands[1:]
    for script in scripts:
        if script.dynamic:
            found |= w.tag("sed script built at run time", "unclassified")
            continue
        runs, writes = _sed_script(script.text)
        if runs is None:
            found |= w.tag("sed script we cannot read", "unclassified")
        elif runs:
            found |= w.tag("sed script runs a command", "unclassified")
        if writes:
            w.written([_Arg(f, False) for f in writes])
            found |= w.tag("sed script writes a file", "mutating")
    if any(_abbreviates(a.text, ("--in-place",)) or re.match(r"^-[a-zA-Z]*i", a.text) for a in rest):
        w.written(operands)
        found |= w.tag("sed -i edits files in place", "mutating")
    return frozenset(found)


_SED_ADDRESS = re.compile(r"\s*(\d+(~\d+)?|\$|/(\\.|[^/\\])*/[IM]*|\\(.)(.*?)\5[IM]*)?")
_SED_PLAIN = frozenset("=dDgGhHnNpPxzFlLqQ")


def _sed_script(script: str) -> tuple[bool | None, list[str]]:
    """Whether a sed script runs commands (its ``e`` command or ``s///e``), and the files it writes
    (``w``, ``W``, ``s///w``); ``None`` when it is beyond this reader."""
    writes: list[str] = []
    runs = False
    i, n = 0, len(script)

    def to_line_end(j: int) -> tuple[str, int]:
        end = script.find("\n", j)
        end = n if end < 0 else end
        return script[j:end].strip(), end

    def delimited(j: int, parts: int) -> int | None:
        """Skip ``parts`` delimited fields starting at the delimiter ``script[j]``."""
        if j >= n or script[j] in "\\\n":
            return None
        delim = script[j]
        j += 1
        for _ in range(parts):
            while j < n and script[j] != delim:
                j += 2 if script[j] == "\\" else 1
            if j >= n:
                return None
            j += 1
        return j

    while i < n:
        c = script[i]
        if c in " \t\n;{}!":
            i += 1
            continue
        if c == "#":
            i = to_line_end(i)[1]
            continue
        for _ in range(2):  # an address, or two separated by a comma
            m = _SED_ADDRESS.match(script, i)
            i = m.end() if m else i
            if i < n and script[i] == ",":
                i += 1
                if i < n and script[i] in "+~":
                    m = re.compile(r"[+~]\d+").match(script, i)
                    i = m.end() if m else i
                    break
                continue
            break
        while i < n and script[i] in " \t!":
            i += 1
        if i >= n:
            break
        c = script[i]
        if c in "{};\n":
            continue
        if c in _SED_PLAIN:
            i += 1
            while i < n and script[i].isdigit():
                i += 1
        elif c in "aic":
            i = to_line_end(i + 1)[1]
        elif c in "btTv:":
            i += 1
            while i < n and script[i] not in ";\n}":
                i += 1
        elif c in "rR":
            i = to_line_end(i + 1)[1]
        elif c in "wW":
            target, i = to_line_end(i + 1)
            writes.append(target)
        elif c == "e":
            runs, i = True, to_line_end(i + 1)[1]
        elif c in "sy":
            end = delimited(i + 1, 2)
            if end is None:
                return None, writes
            i = end
            if c == "s":
                while i < n and (script[i] in "gpiImMe" or script[i].isdigit()):
                    runs = runs or script[i] == "e"
                    i += 1
                if i < n and script[i] == "w":
                    target, i = to_line_end(i + 1)
                    writes.append(target)
        else:
            return None, writes
    return runs, writes


_AWK_VALUED = ("--field-separator", "--assign")
_AWK_FLAGS = _words("--posix --traditional --sandbox --re-interval --characters-as-bytes -b -c -P -r -S")


def _awk(w: _Walker, name: str, rest: list[_Arg], depth: int) -> frozenset[str]:
    # Its program is the first operand after the options: ``-F SEP`` and ``-v X=1`` take a word,
    # any other option may name a program file (``-f``, ``-E``, ``-i``), a library (``-l``),
    # mawk's ``-W exec``...: not something we can see
    program = None
    i = 0
    while i < len(rest):
        text = rest[i].text
        if not _is_option(text):
            program = rest[i]
            break
        if text == "--":
            program = rest[i + 1] if i + 1 < len(rest) else None
            break
        if text in ("-F", "-v") or (_abbreviates(text, _AWK_VALUED) and "=" not in text):
            i += 2
        elif re.match(r"^-[Fv].", text) or _abbreviates(text, _AWK_VALUED) or text in _AWK_FLAGS:
            i += 1
        else:
            return w.tag(f"{name} {text.split('=', 1)[0]} may run a program we cannot see", "unclassified")
    if program is None or program.dynamic:
        return w.tag(f"{name} runs a program we cannot see", "unclassified")
    if re.search(r"system|getline|[|>@]", program.text):  # (gawk's ``@load`` a library, ``@include``)
        return w.tag(f"{name} program runs commands or writes files", "unclassified")
    return frozenset()


_TAR_EXEC = (
    "--to-command",
    "--checkpoint-action",
    "--use-compress-program",
    "--rsh-command",
    "--info-script",
    "--new-volume-script",
    "--rmt-command",
)


def _tar(w: _Walker, name: str, rest: list[_Arg], depth: int) -> frozenset[str]:
    first = rest[0].text if rest else ""
    letters = first.lstrip("-") if not first.startswith("--") else ""
    found: set[str] = set()
    if (
        # (abbreviated too, as getopt_long reads them: ``--to-c=CMD``; ``--checkpoint`` is its own)
        any(
            a.text.startswith(_TAR_EXEC) or (_abbreviates(a.text, _TAR_EXEC) and a.text.split("=")[0] != "--checkpoint")
            for a in rest
        )
        or any(re.match(r"^-[a-zA-Z]*[IF]", a.text) for a in rest)
        or (not first.startswith("-") and re.search(r"[IF]", first))
    ):
        found |= w.tag("tar runs a program named on its command line", "unclassified")
    listing = ("t" in letters and not re.search(r"[xcru]", letters)) or "--list" in first
    if listing:
        return frozenset(found)
    for i, arg in enumerate(rest):  # where extracted files go
        if arg.text in ("-C", "--directory") and i + 1 < len(rest):
            w.written([rest[i + 1]])
        elif arg.text.startswith("--") and _abbreviates(arg.text, ("--directory",)):
            if "=" in arg.text:
                w.written([_Arg(arg.text.split("=", 1)[1], arg.dynamic)])
            elif i + 1 < len(rest):
                w.written([rest[i + 1]])
    return frozenset(found | w.tag("tar writes files", "mutating"))


# Programs we otherwise count as read-only, and the options that make them run another program.
_RUNS_WITH: dict[str, tuple[str, ...]] = {
    "rg": ("--pre",),
    "sort": ("--compress-program",),
    "man": ("-P", "--pager", "-H", "--html", "-C", "--config-file"),  # (its config DEFINEs the pager)
    "bat": ("--pager",),
    # a lesskey file can set LESSOPEN (``#env``); ``+!CMD`` runs a command at start
    "less": ("--lesskey-src", "--lesskey-file", "--lesskey-content", "-k", "+"),
    "zip": ("-TT", "--unzip-command"),
}
# ... and the options (or operand positions) that make them write a file.
_WRITES_WITH: dict[str, tuple[str, ...]] = {
    "sort": ("-o", "--output"),
    "tree": ("-o",),
    "less": ("-o", "-O", "--log-file", "--LOG-FILE"),
}


def _reader(w: _Walker, name: str, rest: list[_Arg], depth: int) -> frozenset[str]:
    """A program that only reads, unless an option makes it run something or write a file."""
    found: set[str] = set()
    runners = _RUNS_WITH.get(name, ())
    # also abbreviated (``--compress-p=CMD``) or after other letters (``man -aPCMD``)
    shorts = "".join(o[1] for o in runners if len(o) == 2 and o[0] == "-")
    if any(
        a.text.startswith(runners)
        or _abbreviates(a.text, tuple(o for o in runners if o.startswith("--")))
        or (shorts and re.match(rf"^-[a-zA-Z]*[{shorts}]", a.text))
        for a in rest
    ):
        found |= w.tag(f"{name} runs a program named on its command line", "unclassified")
    writers = _WRITES_WITH.get(name, ())
    longs = tuple(o for o in writers if o.startswith("--"))
    for i, arg in enumerate(rest):
        short = re.match(r"^-[a-zA-Z]*o(.*)$", arg.text) if name == "sort" else None  # ``sort -ro FILE``
        if (arg.text in writers or (_abbreviates(arg.text, longs) and "=" not in arg.text)) and i + 1 < len(rest):
            w.written([rest[i + 1]])
            found |= w.tag(f"{name} {arg.text} writes a file", "mutating")
        elif _abbreviates(arg.text, longs) and "=" in arg.text:
            w.written([_Arg(arg.text.split("=", 1)[1], arg.dynamic)])
            found |= w.tag(f"{name} writes a file", "mutating")
        elif short is not None:
            w.written([_Arg(short.group(1), arg.dynamic)] if short.group(1) else rest[i + 1 : i + 2])
            found |= w.tag(f"{name} -o writes a file", "mutating")
    operands = _operands(rest)
    if name in ("uniq", "xxd") and len(operands) >= 2:  # uniq IN OUT, xxd [-r] IN OUT
        w.written(operands[1:2])
        found |= w.tag(f"{name} writes its second file", "mutating")
    if name == "zip":
        w.written(operands[:1])
        found |= w.tag("zip changes files", "mutating")
    return frozenset(found)


def _fd(w: _Walker, name: str, rest: list[_Arg], depth: int) -> frozenset[str]:
    for i, arg in enumerate(rest):
        if arg.text in ("-x", "--exec", "-X", "--exec-batch") or re.match(r"^-[a-zA-Z]*[xX]$", arg.text):
            end = next((j for j in range(i + 1, len(rest)) if rest[j].text == ";"), len(rest))
            return w.argv(rest[i + 1 : end], depth + 1).tags
        if arg.text.startswith(("--exec=", "--exec-batch=")) or re.match(r"^-[a-zA-Z]*[xX]", arg.text):
            return w.tag(f"{name} {arg.text}: runs a command we cannot tell apart", "unclassified")
    return frozenset()


def _setting(w: _Walker, name: str, rest: list[_Arg], depth: int) -> frozenset[str]:
    """``export``, ``declare`` and the like: harmless unless they repoint what later commands run."""
    if any("=" in a.text and _hijacks(a.text) for a in rest if not _is_option(a.text)):
        return w.tag(f"{name} changes PATH, the loader or a helper program", "unclassified")
    return frozenset()


def _assigning(w: _Walker, name: str, rest: list[_Arg], depth: int) -> frozenset[str]:
    """``printf -v NAME``, ``read NAME``, ``mapfile NAME``: builtins that set a variable, harmless
    unless it is one that repoints what later commands run."""
    if name in ("mapfile", "readarray") and any(a.text.startswith("-C") for a in rest):
        return w.tag(f"{name} -C runs a callback", "unclassified")
    if name == "printf":
        names = [rest[i + 1].text for i, a in enumerate(rest[:-1]) if a.text == "-v"]
    else:
        names = [a.text for a in rest if not _is_option(a.text)]
    if any(_hijacks(n) for n in names):
        return w.tag(f"{name} sets PATH, the loader or a helper program", "unclassified")
    return frozenset()


def _hash(w: _Walker, name: str, rest: list[_Arg], depth: int) -> frozenset[str]:
    if any(a.text.startswith("-p") for a in rest):
        return w.tag("hash -p points a command name at another program", "unclassified")
    return frozenset()


def _crontab(w: _Walker, name: str, rest: list[_Arg], depth: int) -> frozenset[str]:
    args = {a.text for a in rest}
    if "-l" in args:
        return frozenset()
    if "-r" in args:
        return w.tag("crontab -r removes every scheduled job", "destructive", "mutating")
    return w.tag("crontab installs jobs that run later, outside this session", "unclassified", "mutating")


_INSTALL_VERBS = _words("install i add ci update upgrade uninstall remove rm sync download get publish fetch pull")


def _package(w: _Walker, name: str, rest: list[_Arg], depth: int) -> frozenset[str]:
    verbs = [a.text for a in rest if not _is_option(a.text)]
    if name == "uv" and verbs[:1] == ["pip"]:
        verbs = verbs[1:]
    if name in ("go", "cargo") and verbs[:1] in (["build"], ["run"], ["test"]):
        return w.tag(f"{name} {verbs[0]} builds and runs code", "unclassified", "network")
    if verbs and verbs[0] in _INSTALL_VERBS:
        return w.tag(f"{name} {verbs[0]} downloads packages", "network", "mutating")
    if name in ("npx", "pipx", "uvx", "bunx") or (verbs and verbs[0] in ("run", "exec", "x", "dlx", "start", "test")):
        return w.tag(f"{name} runs package code", "unclassified", "network")
    if not verbs or verbs[0] in ("list", "ls", "show", "freeze", "view", "info", "search", "outdated", "why", "check"):
        return frozenset()
    return w.tag(f"{name} {verbs[0]} is not something we can judge", "unclassified")


_Handler = Callable[[_Walker, str, list[_Arg], int], frozenset[str]]


def _ps(w: _Walker, name: str, rest: list[_Arg], depth: int) -> frozenset[str]:
    """``ps`` lists processes; its BSD ``e`` option (``ps eww``, ``ps aux e``) shows each one's
    environment too: the runtime's, with its credentials."""
    if any((not a.text.startswith("-") and "e" in a.text) or a.text == "--env" for a in rest):
        return w.tag("ps shows processes' environments", "unclassified")
    return frozenset()


_SPECIAL: dict[str, _Handler] = {
    "git": _git,
    "ps": _ps,
    "su": _su,
    "find": _find,
    "sed": _sed,
    "awk": _awk,
    "gawk": _awk,
    "mawk": _awk,
    "tar": _tar,
    "fd": _fd,
    "fdfind": _fd,
    "hash": _hash,
    **{builtin: _assigning for builtin in ("printf", "read", "mapfile", "readarray")},
    "crontab": _crontab,
    **{reader: _reader for reader in (*_RUNS_WITH, *_WRITES_WITH, "uniq", "xxd")},
    **{builtin: _setting for builtin in SETTING_BUILTINS},
    **{
        pm: _package
        for pm in _words("pip pip3 npm yarn pnpm uv npx pipx uvx bun bunx gem cargo go apt apt-get brew conda poetry")
    },
}


def classify_shell(command: str) -> ShellAnalysis:
    """The tags, command names and paths of ``command``; never raises."""
    if not command.strip():
        return ShellAnalysis(frozenset(), ())
    walker = _Walker()
    try:
        walker.line(command, 0)
    except Exception as exc:  # a bug here must not let a command through unjudged
        walker.tag(f"analysis failed: {type(exc).__name__}", "unclassified")
    return walker.analysis()
