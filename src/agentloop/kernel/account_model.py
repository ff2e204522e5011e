"""The model per account: ``<data>/home/<account>/model.json`` picks the model (and its fallbacks,
output budget and temperature) for the runs of that account's processes, in place of the
kernel's. GSV reads the same facts per account (its ``ai.config``); here they sit next to the
account's ``approval.json`` and ``mcp.json``.

    {"model": "anthropic:claude-sonnet-4-5", "fallbacks": ["openai:gpt-4.1-mini"], "max_tokens": 4096}

Models are named as everywhere else (``provider:model``, ``models/registry.py``); the providers'
keys stay server-wide, in the environment. The file is read again when it changes (a ``stat`` per
run), and a run keeps the model it started with. A file that does not validate (a value of another
type is not converted: ``true`` is no output budget), is over ``MAX_FILE_BYTES``, or names a model
that cannot be made, is logged and the account's runs use the kernel's model until it is fixed.
There is no base URL to set: the server's provider keys go only where its environment says.
Only someone who can write the data directory can write it (the API has no way to).

A process may pick its own model over its account's (``Kernel.spawn(model=...)``,
``Process.set_model``): the same ``provider:model`` name, and a ``reasoning`` level as in the file,
kept in its kv row ``model`` (``ProcessModelChoice``). It is checked when it is set (``check``: a
model that cannot be made, or a hosted provider whose key the server's environment lacks, is a
``ValueError`` and nothing is stored), and applied at the start of each run (``choose``), over what
the account's file gave; a stored choice that can no longer be made is logged and the run gets the
account's model (or the kernel's). The account's fallbacks, output budget and temperature stay.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentloop.loop.state import LoopConfig
from agentloop.messages import check_plain_text
from agentloop.models.base import Model, Reasoning
from agentloop.models.registry import HOSTED, hosted_status, parse_model_string, resolve_model
from agentloop.process.store import ProcessRecord
from agentloop.stamps import Stamp, file_stamp, read_regular

log = logging.getLogger("agentloop.kernel.model")

MAX_FILE_BYTES = 1 << 20  # a model choice is a few lines: a larger file is refused, not read into memory
KEPT_MODELS = 256  # models made for the specs named, kept for the next run that names one
MAX_SPEC = 1024  # characters of a process's ``provider:model`` (a scripted model's path included)
ModelSource: TypeAlias = Literal["process", "account", "default"]


class AccountModelFile(BaseModel):
    """What ``model.json`` may say; every field is optional (an absent one keeps the kernel's)."""

    # strict: JSON has the types these need, and a coerced mistake is worse than a refused one
    # (``"max_tokens": true`` would be 1, every answer cut after its first token)
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    fallbacks: list[str] | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    reasoning: Reasoning | None = None


class ProcessModelChoice(BaseModel):
    """A process's own choice (its kv row ``model``): the file's ``model`` and ``reasoning``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(default=None, max_length=MAX_SPEC)
    reasoning: Reasoning | None = None


@dataclass(frozen=True)
class ModelChoice:
    """A process's model as its next run takes it: its own choice (``model``, ``reasoning``; None
    where it has none), the model that answers (``effective``, named ``provider:model``) and
    where that comes from: the process, its account's ``model.json`` or the kernel."""

    model: str | None
    reasoning: Reasoning | None
    effective: str
    source: ModelSource

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "reasoning": self.reasoning, "effective": self.effective, "source": self.source}


class _Choice:
    """One account's file as last read: its stamp, what it changes (None: nothing), and the model
    it names (None: none, or the file is wrong)."""

    __slots__ = ("apply", "model", "stamp")

    def __init__(
        self, stamp: Stamp | None, apply: Callable[[LoopConfig], LoopConfig] | None, model: str | None = None
    ) -> None:
        self.stamp = stamp
        self.apply = apply
        self.model = model


class AccountModels:
    """``configure(record, cfg)``: the run's configuration with the owner's model choice applied."""

    def __init__(
        self,
        file_of: Callable[[str], Path],
        resolve: Callable[[str], Model] = resolve_model,
        *,
        default: str | None = None,
    ) -> None:
        self.file_of = file_of
        self.resolve = resolve
        self.default = default  # the kernel's model as it was named, if it was (else its info names it)
        self._models: dict[str, Model] = {}  # spec -> model, shared by the accounts naming it (LRU, oldest first)
        self._choices: dict[str, _Choice] = {}

    def configure(self, record: ProcessRecord, cfg: LoopConfig) -> LoopConfig:
        choice = self._choice(record.owner)
        return cfg if choice.apply is None else choice.apply(cfg)

    def _choice(self, owner: str) -> _Choice:
        stamp = file_stamp(self.file_of(owner))
        choice = self._choices.get(owner)
        if choice is None or choice.stamp != stamp:
            if len(self._choices) >= 4096:
                self._choices.clear()
            choice = self._choices[owner] = self._read(owner, stamp) if stamp is not None else _Choice(None, None)
        return choice

    def _read(self, owner: str, stamp: Stamp) -> _Choice:
        path = self.file_of(owner)
        try:
            data = json.loads(read_regular(path, MAX_FILE_BYTES).decode("utf-8"))
            chosen = AccountModelFile.model_validate(data)
            model = self._model(chosen.model) if chosen.model is not None else None
            fallbacks = [self._model(spec) for spec in chosen.fallbacks] if chosen.fallbacks is not None else None
        except Exception as exc:  # unreadable, not JSON, invalid, a model that cannot be made
            log.warning("model choice of account %r (%s) ignored, using the kernel's: %s", owner, path, _why(exc))
            return _Choice(stamp, None)

        def apply(cfg: LoopConfig) -> LoopConfig:
            return replace(
                cfg,
                model=model or cfg.model,
                fallbacks=cfg.fallbacks if fallbacks is None else fallbacks,
                max_tokens=cfg.max_tokens if chosen.max_tokens is None else chosen.max_tokens,
                temperature=cfg.temperature if chosen.temperature is None else chosen.temperature,
                reasoning=cfg.reasoning if chosen.reasoning is None else chosen.reasoning,
            )

        return _Choice(stamp, apply, chosen.model)

    # -- a process's own choice -------------------------------------------------------------------

    def check(self, model: str | None, reasoning: Reasoning | None = None) -> dict[str, Any] | None:
        """A process's choice as its kv row stores it (None: no choice, the account's model), or a
        ``ValueError`` saying why it cannot be used: not a ``provider:model`` name, a provider
        that is unknown or whose model cannot be made, a hosted provider this server has no key
        for, an unknown reasoning level."""
        try:
            chosen = ProcessModelChoice.model_validate({"model": model, "reasoning": reasoning})
        except ValidationError as exc:
            raise ValueError(f"model choice refused: {_why(exc)}") from None
        if chosen.model is not None:
            spec = check_plain_text(chosen.model, "model")
            try:
                provider = parse_model_string(spec)[0]
                if provider in HOSTED and not (status := hosted_status(provider))[0]:
                    raise ValueError(f"this server's {provider} provider {status[1]}")
                self.resolve(spec)  # (made to see that it can be, not kept: refused names cost no memory)
            except Exception as exc:  # an unknown provider, a missing SDK, a model that fails to load
                raise ValueError(f"model {spec!r} cannot be used: {exc}") from None
        row = chosen.model_dump(exclude_none=True)
        return row or None

    def choose(self, row: object, cfg: LoopConfig) -> LoopConfig:
        """``cfg`` (the account's, or the kernel's) with a process's stored choice applied; one
        that does not validate or whose model cannot be made now is logged and changes nothing."""
        try:
            chosen = ProcessModelChoice.model_validate(row)
            model = self._model(chosen.model) if chosen.model is not None else None
        except Exception as exc:
            log.warning("a process's model choice %r ignored: %s", row, _why(exc))
            return cfg
        return replace(
            cfg,
            model=model or cfg.model,
            reasoning=cfg.reasoning if chosen.reasoning is None else chosen.reasoning,
        )

    def describe(self, record: ProcessRecord, row: object, default: Model) -> ModelChoice:
        """The process's model as its next run takes it (``row``: its stored choice, if any)."""
        try:
            chosen = ProcessModelChoice.model_validate(row) if row is not None else ProcessModelChoice()
        except ValidationError:
            chosen = ProcessModelChoice()
        usable = chosen.model is not None and self._can_make(chosen.model)
        account = self._choice(record.owner).model
        if usable and chosen.model is not None:
            effective, source = chosen.model, "process"
        elif account is not None:
            effective, source = account, "account"
        else:
            effective, source = self.default or f"{default.info.provider}:{default.info.id}", "default"
        return ModelChoice(chosen.model, chosen.reasoning, effective, source)  # type: ignore[arg-type]

    def _can_make(self, spec: str) -> bool:
        try:
            self._model(spec)
        except Exception:
            return False
        return True

    def _model(self, spec: str) -> Model:
        """The model ``spec`` names, kept for the next run that names it (a scripted model's replies
        go on from run to run); the least recently used past ``KEPT_MODELS`` are let go."""
        model = self._models.pop(spec, None)
        if model is None:
            model = self.resolve(spec)
        self._models[spec] = model
        while len(self._models) > KEPT_MODELS:
            del self._models[next(iter(self._models))]
        return model


def _why(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'file'}: {e['msg']}" for e in exc.errors(include_url=False)[:5]
        )
    return str(exc)
