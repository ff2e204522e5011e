"""Human-in-the-loop approval: a policy per account, decided per tool call from parsed facts.

Pure functions only; the durable runner stores pending questions and answers.
"""

from agentloop.process.approval.engine import (
    NON_INTERACTIVE,
    ApprovalDecision,
    account_rule,
    args_fingerprint,
    decide,
    describe_rule,
    find_rule,
    remember_rule,
)
from agentloop.process.approval.policy import (
    KNOWN_TAGS,
    Action,
    Policy,
    Rule,
    When,
    default_policy,
    parse_policy,
)
from agentloop.process.approval.shell import ShellAnalysis, classify_shell
from agentloop.process.approval.tags import CallFacts, call_facts, call_tags, call_target, path_tags

__all__ = [
    "KNOWN_TAGS",
    "NON_INTERACTIVE",
    "Action",
    "ApprovalDecision",
    "CallFacts",
    "Policy",
    "Rule",
    "ShellAnalysis",
    "When",
    "account_rule",
    "args_fingerprint",
    "call_facts",
    "call_tags",
    "call_target",
    "classify_shell",
    "decide",
    "default_policy",
    "describe_rule",
    "find_rule",
    "parse_policy",
    "path_tags",
    "remember_rule",
]
