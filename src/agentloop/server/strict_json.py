"""JSON as browsers and strict clients parse it.

A provider's ``{"n": 1e999}`` parses (``json.loads``) to ``inf`` in a tool call's arguments, and
from there reaches approvals, signals and event streams. JSON has no spelling for NaN or the
infinities: Starlette's encoder refuses them (a 500), and ``json.dumps`` writes JavaScript's
``Infinity``, which ``JSON.parse`` refuses. Everything the server sends goes through here.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with NaN and the infinities as None (see the module docstring)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def json_text(value: Any) -> str:
    """``value`` as JSON, NaN and the infinities as null (see ``finite``)."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:  # rare: only then is the value walked
        return json.dumps(finite(value), allow_nan=False)


def too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` nests dicts and lists more than ``limit`` deep. Walked without recursion:
    a request may hold JSON nested almost to Python's recursion limit, and the checks that follow
    (``check_schema``, a validator at every call, the providers' encoders) recurse several frames
    per level, so such a schema made ``RecursionError`` escape as a failure instead of a refusal."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False
