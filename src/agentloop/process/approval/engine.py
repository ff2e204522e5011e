"""Deciding one call: which rule applies, and words a person can act on.

The engine is pure so that the durable runner can re-decide a call after a crash and get the
same answer, and so that a stored decision can be checked against the exact arguments shown.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from agentloop.process.approval.policy import KNOWN_TAGS, Action, Policy, Rule, When
from agentloop.process.approval.shell import ShellAnalysis, classify_shell
from agentloop.process.approval.tags import PATH_ARGS, CallFacts, call_facts, is_local, path_inside, workspace_path

__all__ = [
    "NON_INTERACTIVE",
    "ApprovalDecision",
    "account_rule",
    "args_fingerprint",
    "decide",
    "describe_rule",
    "find_rule",
    "remember_rule",
]

NON_INTERACTIVE = "requires interactive approval, which is unavailable for this process"
_RISK_ORDER = ("destructive", "privileged", "network", "unclassified", "mutating")
_MAX_SHOWN = 120
# risks an "always, for this account" answer may not cover: what such a call destroys or takes over
# depends on its arguments, which the rule (a program, not a target) does not hold
_NOT_FOR_ACCOUNTS = frozenset({"destructive", "privileged"})


class ApprovalDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    action: Action
    tags: list[str]
    rule: str
    reason: str


def _target_rank(rule: Rule, target: str) -> int | None:
    """How specifically ``rule`` names ``target``; None when it does not apply to it."""
    scope = rule.target
    if scope is None:
        return 0
    if scope == "*":
        return 1
    if scope == "devices/*":
        return 1 if target != "local" else None
    return 2 if scope == target else None


def _match_rank(rule: Rule, syscall: str) -> int | None:
    if rule.match == "*":
        return 0
    if rule.match.endswith(".*"):
        domain = rule.match[:-2]
        return 1 if syscall == domain or syscall.startswith(domain + ".") else None
    return 2 if rule.match == syscall else None


def _same_value(actual: Any, wanted: Any) -> bool:
    # JSON's true is not 1: compare kinds as well as values.
    if isinstance(actual, bool) or isinstance(wanted, bool):
        return isinstance(actual, bool) and isinstance(wanted, bool) and actual == wanted
    return bool(actual == wanted)


def _has_prefix(value: Any, prefix: str, where: tuple[str, str] | None) -> bool:
    """Whether ``value`` starts with ``prefix``; for a path argument (``where`` = its base and the
    home), whether the path the tool reaches is the one ``prefix`` names or lies below it. A
    string prefix there would let ``./.github/x`` past a rule on ``.github/`` and let a rule on
    ``build`` allow ``build/../src`` or ``build-keep``."""
    if not isinstance(value, str):
        return False
    if where is None:
        return value.startswith(prefix)
    base, home = where
    return path_inside(workspace_path(value, base), workspace_path(prefix, base, home))


def runs_only(shell: ShellAnalysis | None, program: str) -> bool:
    """Whether a shell command line (its analysis) runs ``program`` and nothing else: parsed, no
    other program anywhere in it (after ``;``, ``&&``, ``|``, in a substitution), and named and
    given words as written (:attr:`ShellAnalysis.literal`: not ``FOO=1 git push``, ``./git push``
    or ``git push $X``). ``program`` twice (``git push a; git push b``) is still only it."""
    return shell is not None and shell.literal and "unclassified" not in shell.tags and shell.commands == (program,)


def _shell_of(syscall: str, args: Mapping[str, Any]) -> ShellAnalysis | None:
    command = args.get("command")
    return classify_shell(command) if syscall == "shell.exec" and isinstance(command, str) else None


def _holds(
    when: When | None,
    tags: frozenset[str],
    args: Mapping[str, Any],
    path_key: str | None = None,
    where: tuple[str, str] | None = None,
    shell: ShellAnalysis | None = None,
) -> bool:
    if when is None:
        return True
    if when.program is not None and not runs_only(shell, when.program):
        return False
    if when.any_tags is not None and not tags.intersection(when.any_tags):
        return False
    if when.all_tags is not None and not tags.issuperset(when.all_tags):
        return False
    if when.none_tags is not None and tags.intersection(when.none_tags):
        return False
    for key, prefix in (when.arg_prefix or {}).items():
        if not _has_prefix(args.get(key), prefix, where if key == path_key else None):
            return False
    return all(key in args and _same_value(args[key], v) for key, v in (when.arg_equals or {}).items())


def rules_read_args(policy: Policy) -> bool:
    """Whether any rule of ``policy`` looks at a call's arguments (not only its syscall and tags)."""
    rules = (*policy.rules, *policy.remembered)
    return any(r.when is not None and (r.when.arg_prefix or r.when.arg_equals or r.when.program) for r in rules)


def find_rule(
    policy: Policy,
    syscall: str,
    args: Mapping[str, Any],
    tags: frozenset[str],
    target: str = "local",
    *,
    base: str | os.PathLike[str] | None = None,
    home: str | os.PathLike[str] | None = None,
    shell: ShellAnalysis | None = None,
) -> tuple[int, Rule] | None:
    """The winning rule and its index: most specific target, then match, then first written.

    Given the ``base`` the tools resolve relative paths against (and the ``home`` a policy's
    ``~`` means), an ``argPrefix`` on the path argument of a file or shell call compares paths.
    ``shell`` is the call's command line analysed (``CallFacts.shell``), which a ``program``
    clause reads; not given, it is worked out here when a rule needs it.
    """
    if shell is None and any(r.when is not None and r.when.program is not None for r in policy.rules):
        shell = _shell_of(syscall, args)
    return _winner(policy.rules, syscall, args, tags, target, base=base, home=home, shell=shell)


def _winner(
    rules: Sequence[Rule],
    syscall: str,
    args: Mapping[str, Any],
    tags: frozenset[str],
    target: str,
    *,
    base: str | os.PathLike[str] | None,
    home: str | os.PathLike[str] | None,
    shell: ShellAnalysis | None,
) -> tuple[int, Rule] | None:
    target = "local" if is_local(target) else target
    where = (os.fspath(base), os.fspath(home)) if base is not None and home is not None else None
    path_key = PATH_ARGS.get(syscall) if where is not None else None
    candidates: list[tuple[int, int, int, Rule]] = []
    for index, rule in enumerate(rules):
        t_rank, m_rank = _target_rank(rule, target), _match_rank(rule, syscall)
        if t_rank is None or m_rank is None or not _holds(rule.when, tags, args, path_key, where, shell):
            continue
        candidates.append((-t_rank, -m_rank, index, rule))
    if not candidates:
        return None
    _, _, index, rule = min(candidates, key=lambda c: c[:3])
    return index, rule


def describe_rule(rule: Rule, index: int | None = None) -> str:
    parts = [f"rules[{index}]" if index is not None else "rule", rule.match]
    if rule.target is not None:
        parts.append(f"on {rule.target}")
    if rule.when is not None:
        when = rule.when.model_dump(by_alias=True, exclude_none=True)
        parts.append("when " + json.dumps(when, sort_keys=True, separators=(",", ":")))
    return " ".join(parts) + f" -> {rule.action}"


def _shorten(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 1] + "…"


def _describe_call(syscall: str, args: Mapping[str, Any], facts: CallFacts, target: str) -> str:
    risks = [t for t in _RISK_ORDER if t in facts.tags]
    others = sorted(facts.tags - set(risks))
    where = "" if is_local(target) else f" on {target}"
    if syscall == "shell.exec" and facts.shell is not None:
        what = f"shell command{where}"
        shown = str(args.get("command", ""))
    elif syscall == "net.fetch" and isinstance(args.get("url"), str):
        what = f"web fetch{where}"  # the URL first: a JSON of every argument would cut it off
        shown = f"{args.get('method') or 'GET'} {args['url']}"
    else:
        what = f"{syscall}{where}"
        shown = ", ".join(facts.paths) or _shorten(json.dumps(dict(args), sort_keys=True, default=str))
    label = ", ".join(risks + others)
    head = f"{what} is {label}" if label else what
    return f"{head}: {_shorten(shown)}" if shown else head


def decide(
    policy: Policy,
    syscall: str,
    args: Mapping[str, Any],
    *,
    target: str = "local",
    cwd: str | os.PathLike[str],
    home: str | os.PathLike[str],
    root: str | os.PathLike[str] | None = None,
    interactive: bool = True,
    protected: Sequence[str] = (),
    remembered: Sequence[Rule] = (),
) -> ApprovalDecision:
    """What to do with one call under ``policy``, and why, in words fit for the user.

    A call that touches a ``protected`` directory (the kernel's data: its database with every
    conversation and token hash, the archives, the policies themselves) is denied whatever the
    policy says: an agent that could rewrite its own approval policy or read other accounts'
    archives would make every other rule moot.

    ``remembered`` rules (a person's "yes, and remember", :func:`remember_rule`) answer the
    questions ``policy`` would ask: an ``auto`` one that applies turns ``ask`` into ``auto``. They
    never lift a ``deny``: a call the policy refuses was never put to that person. The policy's own
    ``remembered`` rules (an account's "always") answer after them, the same way."""
    remembered = (*remembered, *policy.remembered)
    facts = call_facts(syscall, args, target=target, cwd=cwd, home=home, root=root, protected=protected)
    if "protected" in facts.tags:
        described = _describe_call(syscall, args, facts, target)
        reason = f"agentloop's own data is off limits to tools: {described}"
        return ApprovalDecision(action="deny", tags=sorted(facts.tags), rule="protected", reason=reason)
    base = root if root is not None else cwd
    # (the command line parsed once, by ``call_facts``: the rules' ``program`` clauses read it)
    found = find_rule(policy, syscall, args, facts.tags, target, base=base, home=home, shell=facts.shell)
    if found is None:
        action, rule_text = policy.default, "default"
    else:
        action, rule_text = found[1].action, describe_rule(found[1], found[0])
    if action == "ask" and remembered:
        kept = _winner(remembered, syscall, args, facts.tags, target, base=base, home=home, shell=facts.shell)
        if kept is not None and kept[1].action == "auto":
            action, rule_text = "auto", "remembered " + describe_rule(kept[1])
    described = _describe_call(syscall, args, facts, target)
    if action == "ask" and not interactive:
        action, reason = "deny", f"{NON_INTERACTIVE} ({described})"
    elif action == "deny":
        reason = f"denied by {'the default policy' if found is None else rule_text}: {described}"
    else:
        reason = described
    return ApprovalDecision(action=action, tags=sorted(facts.tags), rule=rule_text, reason=reason)


def remember_rule(syscall: str, target: str = "local", tags: Sequence[str] | None = None) -> Rule:
    """The process-local allow rule a "yes, and remember" answer adds (``remembered`` in
    :func:`decide`).

    It is bound to the syscall and target, not to the arguments, and, given the ``tags`` of the
    call the person answered, to calls with no risk beyond those (``noTag``: every other known
    tag): remembering one network command auto-approves the later network commands on that
    target the policy would ask about, not a destructive or privileged one, which the person was
    never shown. It answers questions only: what the policy denies stays denied.
    """
    others = sorted(KNOWN_TAGS - set(tags)) if tags is not None else []
    when = When.model_validate({"noTag": others}) if others else None
    return Rule(match=syscall, target="local" if is_local(target) else target, when=when, action="auto")


def account_rule(syscall: str, args: Mapping[str, Any], target: str = "local", tags: Sequence[str] = ()) -> Rule:
    """The allow rule an "always, for this account" answer adds to the account's policy
    (``Policy.remembered``): :func:`remember_rule`'s, narrowed for a shell command to its program
    (and subcommand: ``git push``), since a whole account trusting every command of a kind is
    far wider than one conversation doing so. ``ValueError`` where no rule would be narrow enough:
    a shell command that runs several programs, none that can be named, or code of its own
    (``unclassified``), a ``destructive`` or ``privileged`` call (what it harms depends on
    arguments the rule does not keep), and a CodeMode program (Python: it can do anything).

    The program is a ``program`` clause, which holds only for a command line that runs that
    program and nothing else (:func:`runs_only`), not a prefix of the text: ``git push x; cat
    ~/.ssh/id_rsa``, ``git push x && curl …``, ``git push $(…)`` start with ``git push `` too. A
    prefix would add nothing to it (nor would ``argEquals``: ``ls`` allows ``ls -l``, as ``git
    push origin main`` allows ``git push origin dev``), so none is written."""
    rule = remember_rule(syscall, target, tags)
    if syscall == "codemode.exec":
        raise ValueError("a CodeMode program can do anything: it cannot be allowed for the whole account")
    harmful = sorted(set(tags) & _NOT_FOR_ACCOUNTS)
    if harmful:  # (one ``rm -rf build`` trusted would be every ``rm -rf`` of every later process)
        raise ValueError(
            f"a {' and '.join(harmful)} call cannot be allowed for the whole account: its next target is"
            " not this one; remember it for the process or the run instead"
        )
    if syscall != "shell.exec":
        return rule
    analysis = _shell_of(syscall, args)
    if analysis is None or "unclassified" in analysis.tags or len(analysis.commands) != 1:
        shown = ", ".join(analysis.commands) if analysis is not None and analysis.commands else "none that can be named"
        raise ValueError(
            "only a shell command that runs one known program can be allowed for the whole account"
            f" (this one runs: {shown}); remember it for the process or the run instead"
        )
    program = analysis.commands[0]
    if not runs_only(analysis, program):
        # (``FOO=1 git push``, ``./git push``, ``git push $X``: the rule would not even cover it)
        raise ValueError(
            f"the command runs {program} with what its line does not spell out (a variable, an expansion or"
            " pattern, a path to the program): it cannot be allowed for the whole account;"
            " remember it for the process or the run instead"
        )
    when: dict[str, Any] = {"program": program}
    if rule.when is not None:
        when["noTag"] = list(rule.when.none_tags or ())
    return Rule(match=syscall, target=rule.target, when=When.model_validate(when), action="auto")


def args_fingerprint(syscall: str, args: Mapping[str, Any]) -> str:
    """A stable digest of the call, so an approval given for these arguments fits no others."""
    canonical = json.dumps(
        {"syscall": syscall, "args": args}, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
