"""The approval policy language: what an account writes down, and how a bad file is survived.

A policy is read from a file a person edits by hand, so parsing never raises: anything wrong
(bad JSON, a misspelt field, an unknown action) yields the built-in default policy plus
warnings that say what was wrong. Falling back to the whole default, rather than dropping the
one bad rule, is deliberate: a dropped ``deny`` rule would silently widen what runs unasked.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "KNOWN_TAGS",
    "Action",
    "Policy",
    "Rule",
    "When",
    "default_policy",
    "parse_account_policy",
    "parse_policy",
]

Action = Literal["auto", "ask", "deny"]

#: The facts a ``when`` clause can test; computed per call by :mod:`.tags`.
KNOWN_TAGS: frozenset[str] = frozenset(
    {
        "mutating",
        "destructive",
        "privileged",
        "network",
        "hidden-path",
        "outside-cwd",
        "outside-home",
        "remote",
        "unclassified",
    }
)

# "*", an exact syscall ("fs.read", "mcp.github.create_issue") or a domain wildcard ("fs.*").
_MATCH = re.compile(r"^(\*|[^\s*]+(\.\*)?)$")
# "local", "devices/*", "*" or one device id.
_TARGET = re.compile(r"^(\*|devices/\*|[^\s*]+)$")

Scalar = str | int | float | bool | None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class When(_Strict):
    """Extra conditions on a rule; all given ones must hold (an empty clause always holds).

    ``program`` (``shell.exec`` rules only): the parsed command line runs that program (with its
    subcommand, as the parser names it: ``git push``, ``ls``) and nothing else, by its bare name,
    with only words the line spells out. A prefix of the text cannot say that: ``git push x; cat
    ~/.ssh/id_rsa``, ``git push $(…)`` and ``git push x | sh`` all start with ``git push ``."""

    any_tags: tuple[str, ...] | None = Field(default=None, alias="anyTag", min_length=1)
    all_tags: tuple[str, ...] | None = Field(default=None, alias="allTags", min_length=1)
    none_tags: tuple[str, ...] | None = Field(default=None, alias="noTag", min_length=1)
    arg_prefix: dict[str, str] | None = Field(default=None, alias="argPrefix")
    arg_equals: dict[str, Scalar] | None = Field(default=None, alias="argEquals")
    program: str | None = None

    @field_validator("any_tags", "all_tags", "none_tags")
    @classmethod
    def _known_tags(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        # A misspelt tag would make the rule silently never (or always) apply.
        unknown = sorted(set(value or ()) - KNOWN_TAGS)
        if unknown:
            raise ValueError(f"unknown tag(s) {unknown}; known: {sorted(KNOWN_TAGS)}")
        return value

    @field_validator("program")
    @classmethod
    def _valid_program(cls, value: str | None) -> str | None:
        # compared with the parser's names ("git push"): any other spelling would never hold
        if value is not None and (not value or " ".join(value.split()) != value):
            raise ValueError(
                f"program {value!r} must name a program, or a program and its subcommand ('git push'),"
                " in words separated by single spaces"
            )
        return value


class Rule(_Strict):
    match: str
    target: str | None = None
    when: When | None = None
    action: Action

    @field_validator("match")
    @classmethod
    def _valid_match(cls, value: str) -> str:
        if not _MATCH.match(value):
            raise ValueError(f"match {value!r} must be '*', a syscall name, or '<domain>.*'")
        return value

    @field_validator("target")
    @classmethod
    def _valid_target(cls, value: str | None) -> str | None:
        if value is not None and not _TARGET.match(value):
            raise ValueError(f"target {value!r} must be 'local', 'devices/*', '*' or a device id")
        return value

    @model_validator(mode="after")
    def _program_only_for_shell(self) -> Rule:
        # (on any other call there is no command line: the rule would silently never apply)
        if self.when is not None and self.when.program is not None and self.match != "shell.exec":
            raise ValueError(
                f"when.program names a shell command's program: it applies only to rules matching"
                f" 'shell.exec', not {self.match!r}"
            )
        return self

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class Policy(_Strict):
    """``remembered``: allow rules a person added ("always, for this account"). They answer the
    questions ``rules`` ask, as a process's remembered rules do, and never compete with ``rules``
    for precedence: an ``auto`` rule in ``rules`` naming a target would outrank a ``deny`` written
    without one, so an answer given once could lift a refusal the account's owner wrote down."""

    default: Action = "auto"
    rules: tuple[Rule, ...] = ()
    remembered: tuple[Rule, ...] = ()

    @field_validator("remembered")
    @classmethod
    def _only_allows(cls, value: tuple[Rule, ...]) -> tuple[Rule, ...]:
        # (an ``ask`` or ``deny`` there would be read as an answer, and silently never apply)
        if any(rule.action != "auto" for rule in value):
            raise ValueError("remembered rules answer questions: their action must be auto")
        return value

    def only_adds(self) -> bool:
        """Whether this policy was given neither ``default`` nor ``rules``: an account's policy
        that then only adds its remembered rules to the one it would have without it (the
        server-wide one, ``on_top_of``), rather than replacing it with the defaults of the fields
        left out (every call ``auto``)."""
        return not {"default", "rules"} & self.model_fields_set

    def on_top_of(self, inherited: Policy) -> Policy:
        """``inherited`` with this policy's remembered rules added to its own: what an account's
        file of remembered rules alone means (``parse_account_policy``)."""
        if not self.remembered:
            return inherited
        return inherited.model_copy(update={"remembered": (*inherited.remembered, *self.remembered)})

    def to_json(self) -> dict[str, Any]:
        data = self.model_dump(by_alias=True, exclude_none=True)
        if not self.remembered:  # (as the policies written before remembered rules existed)
            del data["remembered"]
        return data


_RISKY_SHELL = ("destructive", "privileged", "network", "unclassified")


def default_policy() -> Policy:
    """Run freely, but stop for what is hard to undo or leaves the machine."""
    return Policy(
        default="auto",
        rules=(
            Rule(match="shell.exec", when=When(any_tags=_RISKY_SHELL), action="ask"),
            # the workspace is the agent's to change; the rest of the machine, and dotfiles
            # (keys, shell start-up files) outside it, are not
            Rule(match="shell.exec", when=When(all_tags=("mutating", "outside-cwd")), action="ask"),
            Rule(match="shell.exec", when=When(all_tags=("hidden-path", "outside-cwd")), action="ask"),
            Rule(match="fs.delete", action="ask"),
            # a file tool writing into a repository's ``.git`` (``unclassified``): its config and
            # hooks name programs a later ``git status``, which runs unasked, would run
            Rule(match="fs.*", when=When(any_tags=("unclassified",)), action="ask"),
            Rule(match="mcp.*", action="ask"),
            # a CodeMode program is Python running as this user: like an unclassified shell
            # command it can do anything outside its tool functions, so a person reads it first
            # (its tool calls are then judged one by one, like direct calls)
            Rule(match="codemode.exec", action="ask"),
            # a web fetch, even a GET, sends what its URL holds to a host the model chose (all it
            # has read could leave that way) and brings back text nobody vetted: a person sees the
            # URL first. A POST is also ``mutating``, so a policy can trust reads and keep asking
            # for writes (a rule on ``mutating`` written before an ``auto`` one)
            Rule(match="net.fetch", action="ask"),
        ),
    )


def _describe_errors(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "policy"
        out.append(f"{where}: {err['msg']}")
    return out


def _json_object(data: str | bytes | dict[str, Any] | None) -> tuple[dict[str, Any] | None, list[str]]:
    """The JSON object ``data`` holds; None without a warning for nothing written (``None``, blank
    text), None with the reason for anything else that is not one."""
    if data is None:
        return None, []
    if isinstance(data, bytes | str):
        text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
        if not text.strip():
            return None, []
        try:
            loaded: Any = json.loads(text)
        except (ValueError, RecursionError) as exc:
            return None, [f"approval policy is not valid JSON ({exc}); using the default policy"]
    else:
        loaded = data
    if not isinstance(loaded, dict):
        kind = type(loaded).__name__
        return None, [f"approval policy must be a JSON object, not {kind}; using the default policy"]
    return loaded, []


def _validated(loaded: dict[str, Any]) -> tuple[Policy, list[str]]:
    try:
        return Policy.model_validate(loaded), []
    except ValidationError as exc:
        problems = _describe_errors(exc)
        return default_policy(), [f"approval policy rejected, using the default policy: {p}" for p in problems]


def parse_policy(data: str | bytes | dict[str, Any] | None) -> tuple[Policy, list[str]]:
    """The policy ``data`` describes, or the default policy and the reasons it was rejected.

    Nothing (``None`` or blank text) means "no policy written", which is the default without a
    warning.
    """
    loaded, problems = _json_object(data)
    return (default_policy(), problems) if loaded is None else _validated(loaded)


def parse_account_policy(data: str | bytes | dict[str, Any] | None) -> tuple[Policy, bool, list[str]]:
    """``parse_policy`` for an account's own file, and whether that file only adds to the policy
    the account would have without it (the server-wide one): an object with neither ``default``
    nor ``rules`` (``{"remembered": [...]}``, what an "always, for this account" answer writes
    where there was no file). Its ``remembered`` rules then go on top of that policy
    (``Policy.on_top_of``), whose later changes reach the account; a file with either field
    replaces it. A file that does not parse is the default policy, as anywhere else."""
    loaded, problems = _json_object(data)
    if loaded is None:
        return default_policy(), False, problems
    policy, problems = _validated(loaded)
    return policy, not problems and policy.only_adds(), problems
