"""The CLI's ``--help`` as the README writes it.

Typer (0.29) shows a required argument as ``{text}`` in the usage line and every flag with a
``<bool>`` type (``--help`` too). ``App`` is a ``typer.Typer`` whose commands and groups show an
argument by its metavar (``PID TEXT``; one without a metavar as its name in capitals, in brackets
when it may be left out) and a flag or a count without a type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption


def _untyped_flags(params: list[Any]) -> list[Any]:
    for param in params:  # (a metavar, even empty, is what the help shows as the option's type)
        if isinstance(param, TyperOption) and (param.is_flag or param.count) and param.metavar is None:
            param.metavar = ""
    return params


class Command(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _untyped_flags(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if not isinstance(param, TyperArgument):
                pieces.extend(param.get_usage_pieces(ctx))
                continue
            name = param.metavar
            if name is None:
                name = (param.name or "").upper()
                name = name if param.required else f"[{name}]"
            pieces.append(name if param.nargs == 1 or param.metavar is not None else f"{name}...")
        return pieces


class Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _untyped_flags(super().get_params(ctx))


class App(typer.Typer):
    """A ``typer.Typer`` of ``Group`` and ``Command`` (unless told another class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("cls", Group)
        super().__init__(*args, **kwargs)

    def command(self, *args: Any, **kwargs: Any) -> Callable[[Any], Any]:
        kwargs.setdefault("cls", Command)
        return super().command(*args, **kwargs)
