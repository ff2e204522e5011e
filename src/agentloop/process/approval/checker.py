"""The approval policy as the durable runner asks it: one verdict per registered tool call.

Policies come from two places: the owning account's policy (given in code, or its policy file,
read again whenever it changes), else the server-wide default (``ServerPolicy``: a file of it too
is read again whenever it changes, and keeps its last good policy while it does not parse). An
account's policy of ``remembered`` rules alone (no ``default``, no ``rules``), in its file or in
code alike, adds them to the server-wide policy instead of replacing it. A ``PolicyBook`` says
which policy is in force for an account, to the checks here and to what applies it outside a
process (``/engine/chat``) alike.
A policy that cannot be read is replaced by the default policy, with a warning in the log. Rules
a person remembered for this process (stored with the process) then answer the questions the
policy would ask; they never lift what it denies.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentloop.process.api import Approval, ApprovalFn
from agentloop.process.approval.engine import args_fingerprint, decide, rules_read_args
from agentloop.process.approval.policy import Policy, Rule, default_policy, parse_account_policy, parse_policy
from agentloop.process.approval.tags import call_target, facts_read_args
from agentloop.process.store import ProcessRecord, Store, ToolCallRow
from agentloop.stamps import Stamp, file_stamp, read_regular

log = logging.getLogger("agentloop.approval")

OVERRIDES_KEY = "approval_overrides"
#: an account's rules a person added ("always, for this account") written to its policy file;
#: ``ValueError`` when they cannot be (the policy is not a file this server may amend)
AmendFn = Callable[[ProcessRecord, Rule], None]


def run_overrides_key(run_id: str) -> str:
    """The kv row of the rules remembered for the rest of run ``run_id`` only (its end drops it)."""
    return f"{OVERRIDES_KEY}:{run_id}"


#: A policy is a few rules; a file far larger is not one, and is not read into memory.
MAX_POLICY_BYTES = 1 << 20


def load_policy(data: str | bytes | dict[str, Any] | Policy | None, source: str) -> Policy | None:
    """A policy from JSON text or data; ``None`` stays ``None``; problems are logged, never raised."""
    if data is None or isinstance(data, Policy):
        return data
    policy, warnings = parse_policy(data)
    _warn(source, warnings)
    return policy


def _warn(source: str, warnings: list[str]) -> None:
    for warning in warnings:
        log.warning("approval policy %s: %s; using the default policy", source, warning)


def _read_server_file(path: Path) -> tuple[Policy | None, list[str]]:
    """The server-wide policy file's policy, or None and why it cannot be had (blank text is
    none: a file being written, or emptied)."""
    try:
        text = read_regular(path, MAX_POLICY_BYTES).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return None, [f"cannot be read ({exc})"]
    if not text.strip():
        return None, ["empty"]
    policy, problems = parse_policy(text)
    return (None, problems) if problems else (policy, [])


class ServerPolicy:
    """The server-wide policy in force, as ``policy_approval`` and anything else that applies it
    (the stateless ``/engine/chat``) ask for it: one source, so that all follow the same edits.
    Given in code (JSON text, data or a ``Policy``) it stays as given (``None``: DESIGN §3's
    default); given as a file (a ``Path``) it is read again whenever the file's stamp changes,
    which each call checks (one ``stat``). A file that cannot be read at all here is a
    ``ValueError``; one that is not a valid policy here is the default policy, with a warning."""

    def __init__(self, given: str | bytes | dict[str, Any] | Policy | os.PathLike[str] | None = None) -> None:
        self.file: Path | None = None
        stamp = None
        if isinstance(given, os.PathLike):  # read as text is (not valid: the default policy, with a warning)
            self.file = Path(given)
            stamp = file_stamp(self.file)  # (before the read: a change during it is read again)
            try:
                given = read_regular(self.file, MAX_POLICY_BYTES).decode("utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"approval policy {str(self.file)!r} cannot be read ({exc})") from None
        policy = load_policy(given, "server" if self.file is None else f"server ({self.file})")
        # the file's stamp when last read, and the policy in force
        self._seen: tuple[Stamp | None, Policy] = (stamp, policy if policy is not None else default_policy())

    def __call__(self) -> Policy:
        """The policy in force: a file's is parsed again only when its stamp changes. A file that
        no longer gives a policy (not valid, gone, empty: being written) keeps the last good one
        in force, with one warning per change, never the default policy, which may allow more
        than the operator's."""
        seen, policy = self._seen
        if self.file is None:
            return policy
        stamp = file_stamp(self.file)
        if stamp == seen:
            return policy
        read, problems = _read_server_file(self.file)
        if read is None:
            shown = "; ".join(re.sub(r"[,;] using the default policy", "", p) for p in problems)
            log.warning("approval policy server (%s): %s; the policy in force is kept", self.file, shown)
        self._seen = (stamp, policy if read is None else read)
        return self._seen[1]


def _account_policy(given: str | bytes | dict[str, Any] | Policy, owner: str) -> tuple[Policy, bool]:
    """An account's policy given in code, read as its file would be (``parse_account_policy``),
    and whether it only adds to the server-wide policy: so that moving a policy between code and
    the account's file does not change what it means (``{"remembered": [...]}`` alone sits on the
    server-wide policy, whose later denies reach it, in either place). A ``Policy`` built in code
    is taken the same way, by the fields it was given (``Policy(remembered=...)``)."""
    if isinstance(given, Policy):
        return given, given.only_adds()
    policy, inherits, warnings = parse_account_policy(given)
    _warn(f"of account {owner!r}", warnings)
    return policy, inherits


class PolicyBook:
    """The approval policy in force for each account, as everything that applies it asks for it
    (``policy_approval``'s checks of the processes, the stateless ``/engine/chat`` of a caller's
    account): one source, so that all follow the same files and edits. An account's policy is
    the one given in code (``accounts``), else its file (``account_file``, read again whenever it
    changes), else the server-wide one (``server``, a ``ServerPolicy``, or one made here from
    what is given otherwise); one of ``remembered`` rules alone, in code or in its file, goes on
    top of the server-wide policy instead of replacing it. A policy that did not change is the
    same object from one call to the next (a cache key for the checks)."""

    def __init__(
        self,
        server: str | bytes | dict[str, Any] | Policy | os.PathLike[str] | ServerPolicy | None = None,
        *,
        accounts: Mapping[str, str | bytes | dict[str, Any] | Policy] | None = None,
        account_file: Callable[[str], Path] | None = None,
    ) -> None:
        self.server = server if isinstance(server, ServerPolicy) else ServerPolicy(server)
        self.account_file = account_file
        # owner -> (the policy given in code, whether it is remembered rules alone, put on the server-wide one)
        self._in_code = {name: _account_policy(p, name) for name, p in (accounts or {}).items() if p is not None}
        # owner -> (file stamp, its policy, whether it is remembered rules alone, put on the server-wide one)
        self._from_files: dict[str, tuple[Stamp, Policy, bool]] = {}
        # owner -> (its remembered rules alone, the server-wide policy they sit on, the two merged)
        self._merged: dict[str, tuple[Policy, Policy, Policy]] = {}

    def of(self, owner: str) -> Policy:
        """The policy in force for ``owner``'s calls now."""
        given = self._in_code.get(owner)
        if given is not None:
            return self._on_server(owner, given[0]) if given[1] else given[0]
        own = None if self.account_file is None else self._from_file(owner, self.account_file(owner))
        return self.server() if own is None else own

    def _on_server(self, owner: str, own: Policy) -> Policy:
        """An account's remembered rules alone (its file's, or given in code) on the server-wide
        policy in force, merged again only when either changes."""
        base = self.server()
        hit = self._merged.get(owner)
        if hit is None or hit[0] is not own or hit[1] is not base:
            hit = self._merged[owner] = (own, base, own.on_top_of(base))
        return hit[2]

    def _from_file(self, owner: str, path: Path) -> Policy | None:
        """The account's policy as its file makes it, read again only when the file changes. A
        file of remembered rules alone is put on the server-wide policy (``_on_server``, again
        when either changes), and never copied into the file, so that policy's changes reach the
        account."""
        stamp = file_stamp(path)
        if stamp is None:  # no file: the server-wide policy applies
            self._from_files.pop(owner, None)
            self._merged.pop(owner, None)
            return None
        hit = self._from_files.get(owner)
        if hit is not None and hit[0] == stamp:
            return self._on_server(owner, hit[1]) if hit[2] else hit[1]
        source = f"of account {owner!r} ({path})"
        try:
            policy, inherits, warnings = parse_account_policy(read_regular(path, MAX_POLICY_BYTES).decode("utf-8"))
            _warn(source, warnings)
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("approval policy %s cannot be read (%s); using the default policy", source, exc)
            policy, inherits = default_policy(), False
        self._from_files[owner] = (stamp, policy, inherits)
        return self._on_server(owner, policy) if inherits else policy


def policy_approval(
    store: Store,
    *,
    server: str | bytes | dict[str, Any] | Policy | os.PathLike[str] | ServerPolicy | None = None,
    accounts: Mapping[str, str | bytes | dict[str, Any] | Policy] | None = None,
    home_of: Callable[[str], str] | None = None,
    account_file: Callable[[str], Path] | None = None,
    protected: Sequence[str | Path] = (),
    policies: PolicyBook | None = None,
) -> ApprovalFn:
    """An ``ApprovalFn`` that applies the policies of DESIGN §3 to each call: each process's
    owner's, as ``policies`` has it (a ``PolicyBook`` shared with what else applies them), or a
    book made here of ``server``, ``accounts`` and ``account_file`` (given with ``policies``
    they are a ``TypeError``: the book already says which policies are in force). The
    server-wide policy given as a file is read again whenever it changes, as an account's file
    is; one that cannot be read at all here is a ``ValueError``."""
    if policies is not None and (server is not None or accounts is not None or account_file is not None):
        raise TypeError("policy_approval: give policies, or server/accounts/account_file, not both")
    book = policies if policies is not None else PolicyBook(server, accounts=accounts, account_file=account_file)
    own_home = os.path.expanduser("~")  # the kernel user's, for every account without a home of its own
    home = home_of or (lambda user: own_home)

    guarded = [os.path.realpath(p) for p in protected]
    # remembered rules as JSON -> (those rules, whether one reads a call's arguments)
    parsed: dict[str, tuple[tuple[Rule, ...], bool]] = {}

    def remembered_rules(stored: list[dict[str, Any]] | None) -> tuple[str, tuple[Rule, ...], bool]:
        """The process's remembered rules, parsed once per distinct list (a key for the caches)."""
        if not stored:
            return "", (), False
        key = json.dumps(stored, sort_keys=True)
        hit = parsed.get(key)
        if hit is None:
            if len(parsed) > 4096:
                parsed.clear()
            rules = tuple(Rule.model_validate(r) for r in stored)
            hit = parsed[key] = (rules, rules_read_args(Policy(rules=rules)))
        return key, *hit

    # policy -> automatic approvals by (syscall, target, remembered rules), for calls whose verdict
    # cannot depend on their arguments: most calls of most runs, answered without working the
    # policy out again
    plain_autos: dict[int, tuple[Policy, dict[tuple[str, str, str], Approval]]] = {}

    def known_auto(policy: Policy, key: tuple[str, str, str]) -> Approval | None:
        entry = plain_autos.get(id(policy))
        return entry[1].get(key) if entry is not None and entry[0] is policy else None

    def keep_auto(policy: Policy, key: tuple[str, str, str], approval: Approval) -> None:
        entry = plain_autos.get(id(policy))
        if entry is None or entry[0] is not policy:
            if rules_read_args(policy):
                return
            if len(plain_autos) >= 64:
                plain_autos.clear()
            entry = plain_autos[id(policy)] = (policy, {})
        if len(entry[1]) < 4096:
            entry[1][key] = approval

    async def approve(process: ProcessRecord, row: ToolCallRow) -> Approval:
        policy = book.of(process.owner)
        # the run's remembered rules, then the process's: one query for both
        run_key = run_overrides_key(row.run_id)
        kept = await store.kv_many(process.pid, (OVERRIDES_KEY, run_key))
        stored = [*kept.get(run_key, ()), *kept.get(OVERRIDES_KEY, ())]
        rkey, remembered, remembered_read_args = remembered_rules(stored)
        target = call_target(row.syscall, row.tool_name, row.args)  # a device call is tagged ``remote``
        plain = not remembered_read_args and not facts_read_args(row.syscall, row.args)
        key = (row.syscall, target, rkey)
        if plain and (known := known_auto(policy, key)) is not None:
            return known
        verdict = decide(
            policy,
            row.syscall,
            row.args,
            target=target,
            cwd=process.cwd,
            home=home(process.run_as),
            interactive=True,
            protected=guarded,
            remembered=remembered,
        )
        if verdict.action == "auto":  # nothing to bind a person's answer to, nor to explain
            approval = Approval("auto", tuple(verdict.tags))
            if plain:
                keep_auto(policy, key, approval)
            return approval
        return Approval(verdict.action, tuple(verdict.tags), verdict.reason, args_fingerprint(row.syscall, row.args))

    return approve


def policy_amender(
    *,
    accounts: Mapping[str, Any] | None = None,
    account_file: Callable[[str], Path],
) -> AmendFn:
    """What adds a person's "always, for this account" to the account's policy file (the one
    ``policy_approval`` reads with the same ``account_file``): a ``remembered`` rule, so that later
    processes of the account are not asked. An account without a file gets one of the rule alone
    (``{"remembered": [rule]}``), which ``policy_approval`` puts on top of the server-wide policy:
    not a copy of that policy, which would keep its later changes (a new ``deny``) from the
    account. Refused (``ValueError``) when the account's policy is given in code, or its file does
    not parse (written back, the part that was wrong would be lost)."""
    in_code = frozenset(accounts or ())

    def amend(process: ProcessRecord, rule: Rule) -> None:
        owner = process.owner
        if owner in in_code:
            raise ValueError(
                f"account {owner!r}'s approval policy is given in code, not in a file: it cannot be amended;"
                " remember for the process or the run instead"
            )
        path = account_file(owner)
        if path.is_symlink():  # (replaced, the link would be cut: that policy's later changes lost here)
            raise ValueError(
                f"account {owner!r}'s approval policy file is a link to a policy kept elsewhere (maybe shared):"
                " it is not amended from here; remember for the process or the run instead"
            )
        if file_stamp(path) is None:
            data: dict[str, Any] = {}  # (remembered rules alone: the server-wide policy stays in force)
        else:
            try:
                text = read_regular(path, MAX_POLICY_BYTES).decode("utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"account {owner!r}'s approval policy cannot be read ({exc})") from None
            _, problems = parse_policy(text)
            if problems:
                raise ValueError(f"account {owner!r}'s approval policy file is not valid, fix it first: {problems[0]}")
            data = json.loads(text) if text.strip() else default_policy().to_json()  # (blank: the default)
        kept = data.setdefault("remembered", [])
        wanted = rule.to_json()
        if wanted in kept:
            return  # (answered again after a retry, or the same answer through another client)
        kept.append(wanted)
        text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
        if parse_policy(text)[1] or len(text.encode("utf-8")) > MAX_POLICY_BYTES:
            raise ValueError(f"account {owner!r}'s approval policy would not be valid with this rule")
        _replace(path, text)
        log.info("approval policy of account %r: remembered %s", owner, json.dumps(wanted, sort_keys=True))

    return amend


def _replace(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a reader (``policy_approval``, another worker) never
    sees half a policy, which would read as invalid and fall back to the default. The file keeps
    the permissions it had (a policy an operator made private stays private), and the rename is
    made durable with its directory, as the answer's commit that follows it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = None
    try:
        with open(temporary, "x", encoding="utf-8") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
