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
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentloop.loop.state import LoopConfig
from agentloop.models.base import Model, Reasoning
from agentloop.models.registry import resolve_model
from agentloop.process.store import ProcessRecord
from agentloop.stamps import Stamp, file_stamp, read_regular

log = logging.getLogger("agentloop.kernel.model")

MAX_FILE_BYTES = 1 << 20  # a model choice is a few lines: a larger file is refused, not read into memory


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


class _Choice:
    """One account's file as last read: its stamp, and what it changes (None: nothing)."""

    __slots__ = ("apply", "stamp")

    def __init__(self, stamp: Stamp | None, apply: Callable[[LoopConfig], LoopConfig] | None) -> None:
        self.stamp = stamp
        self.apply = apply


class AccountModels:
    """``configure(record, cfg)``: the run's configuration with the owner's model choice applied."""

    def __init__(self, file_of: Callable[[str], Path], resolve: Callable[[str], Model] = resolve_model) -> None:
        self.file_of = file_of
        self.resolve = resolve
        self._models: dict[str, Model] = {}  # spec -> model, shared by the accounts naming it
        self._choices: dict[str, _Choice] = {}

    def configure(self, record: ProcessRecord, cfg: LoopConfig) -> LoopConfig:
        owner = record.owner
        stamp = file_stamp(self.file_of(owner))
        choice = self._choices.get(owner)
        if choice is None or choice.stamp != stamp:
            if len(self._choices) >= 4096:
                self._choices.clear()
            choice = self._choices[owner] = _Choice(stamp, self._read(owner) if stamp is not None else None)
        return cfg if choice.apply is None else choice.apply(cfg)

    def _read(self, owner: str) -> Callable[[LoopConfig], LoopConfig] | None:
        path = self.file_of(owner)
        try:
            data = json.loads(read_regular(path, MAX_FILE_BYTES).decode("utf-8"))
            chosen = AccountModelFile.model_validate(data)
            model = self._model(chosen.model) if chosen.model is not None else None
            fallbacks = [self._model(spec) for spec in chosen.fallbacks] if chosen.fallbacks is not None else None
        except Exception as exc:  # unreadable, not JSON, invalid, a model that cannot be made
            log.warning("model choice of account %r (%s) ignored, using the kernel's: %s", owner, path, _why(exc))
            return None

        def apply(cfg: LoopConfig) -> LoopConfig:
            return replace(
                cfg,
                model=model or cfg.model,
                fallbacks=cfg.fallbacks if fallbacks is None else fallbacks,
                max_tokens=cfg.max_tokens if chosen.max_tokens is None else chosen.max_tokens,
                temperature=cfg.temperature if chosen.temperature is None else chosen.temperature,
                reasoning=cfg.reasoning if chosen.reasoning is None else chosen.reasoning,
            )

        return apply

    def _model(self, spec: str) -> Model:
        model = self._models.get(spec)
        if model is None:
            model = self._models[spec] = self.resolve(spec)
        return model


def _why(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'file'}: {e['msg']}" for e in exc.errors(include_url=False)[:5]
        )
    return str(exc)
