"""The approval policy as the durable runner asks it: one verdict per registered tool call.

Policies come from three places, most specific first: rules a person remembered for this process
(stored with the process), the owning account's policy (given in code, or its policy file, read
again whenever it changes), and the server-wide default. A policy that cannot be read is replaced
by the default policy, with a warning in the log.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentloop.process.api import Approval, ApprovalFn
from agentloop.process.approval.engine import args_fingerprint, decide, rules_read_args
from agentloop.process.approval.policy import Policy, Rule, default_policy, merge, parse_policy
from agentloop.process.approval.tags import call_target, facts_read_args
from agentloop.process.store import ProcessRecord, Store, ToolCallRow
from agentloop.stamps import Stamp, file_stamp, read_regular

log = logging.getLogger("agentloop.approval")

OVERRIDES_KEY = "approval_overrides"


def load_policy(data: str | bytes | dict[str, Any] | Policy | None, source: str) -> Policy | None:
    """A policy from JSON text or data; ``None`` stays ``None``; problems are logged, never raised."""
    if data is None or isinstance(data, Policy):
        return data
    policy, warnings = parse_policy(data)
    for warning in warnings:
        log.warning("approval policy %s: %s; using the default policy", source, warning)
    return policy


def policy_approval(
    store: Store,
    *,
    server: str | bytes | dict[str, Any] | Policy | None = None,
    accounts: Mapping[str, str | bytes | dict[str, Any] | Policy] | None = None,
    home_of: Callable[[str], str] | None = None,
    account_file: Callable[[str], Path] | None = None,
    protected: Sequence[str | Path] = (),
) -> ApprovalFn:
    """An ``ApprovalFn`` that applies the policies of DESIGN §3 to each call. ``account_file``
    names an account's policy file, used when ``accounts`` has no policy for it."""
    server_policy = load_policy(server, "server")
    account_policies = {name: load_policy(p, f"of account {name!r}") for name, p in (accounts or {}).items()}
    own_home = os.path.expanduser("~")  # the kernel user's, for every account without a home of its own
    home = home_of or (lambda user: own_home)

    fallback = server_policy if server_policy is not None else default_policy()
    guarded = [os.path.realpath(p) for p in protected]
    # (owner, remembered rules as JSON) -> (the policy they were merged onto, the result)
    merged: dict[tuple[str, str], tuple[Policy, Policy]] = {}
    from_files: dict[str, tuple[Stamp, Policy | None]] = {}  # owner -> (file stamp, its policy)

    def from_file(owner: str, path: Path) -> Policy | None:
        stamp = file_stamp(path)
        if stamp is None:  # no file: the server-wide policy applies
            from_files.pop(owner, None)
            return None
        hit = from_files.get(owner)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        source = f"of account {owner!r} ({path})"
        try:
            policy = load_policy(read_regular(path).decode("utf-8"), source)
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("approval policy %s cannot be read (%s); using the default policy", source, exc)
            policy = default_policy()
        from_files[owner] = (stamp, policy)
        return policy

    def policy_of(owner: str, remembered: list[dict[str, Any]] | None) -> Policy:
        base = account_policies.get(owner)
        if base is None and account_file is not None:
            base = from_file(owner, account_file(owner))
        base = fallback if base is None else base
        if not remembered:
            return base
        key = (owner, json.dumps(remembered, sort_keys=True))
        hit = merged.get(key)
        if hit is not None and hit[0] is base:  # (not if the account's policy changed or went away)
            return hit[1]
        if len(merged) > 4096:
            merged.clear()
        policy = merge(base, None, [Rule.model_validate(r) for r in remembered])
        merged[key] = (base, policy)
        return policy

    # policy -> automatic approvals by (syscall, target), for calls whose verdict cannot depend on
    # their arguments: most calls of most runs, answered without working the policy out again
    plain_autos: dict[int, tuple[Policy, dict[tuple[str, str], Approval]]] = {}

    def known_auto(policy: Policy, syscall: str, target: str) -> Approval | None:
        entry = plain_autos.get(id(policy))
        return entry[1].get((syscall, target)) if entry is not None and entry[0] is policy else None

    def keep_auto(policy: Policy, syscall: str, target: str, approval: Approval) -> None:
        entry = plain_autos.get(id(policy))
        if entry is None or entry[0] is not policy:
            if rules_read_args(policy):
                return
            if len(plain_autos) >= 64:
                plain_autos.clear()
            entry = plain_autos[id(policy)] = (policy, {})
        if len(entry[1]) < 4096:
            entry[1][(syscall, target)] = approval

    async def approve(process: ProcessRecord, row: ToolCallRow) -> Approval:
        policy = policy_of(process.owner, await store.kv_get(process.pid, OVERRIDES_KEY))
        target = call_target(row.syscall, row.tool_name, row.args)  # a device call is tagged ``remote``
        plain = not facts_read_args(row.syscall, row.args)
        if plain and (known := known_auto(policy, row.syscall, target)) is not None:
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
        )
        if verdict.action == "auto":  # nothing to bind a person's answer to, nor to explain
            approval = Approval("auto", tuple(verdict.tags))
            if plain:
                keep_auto(policy, row.syscall, target, approval)
            return approval
        return Approval(verdict.action, tuple(verdict.tags), verdict.reason, args_fingerprint(row.syscall, row.args))

    return approve
