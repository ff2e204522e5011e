"""What every store dialect encodes the same way."""

from __future__ import annotations

from typing import Any

from pydantic_core import to_json

# the registry columns ``Store.update_process`` may set
UPDATABLE_FIELDS = frozenset({"state", "current_run", "history_generation", "cwd", "context", "interactive", "run_as"})


def dumps(value: Any) -> str:
    """Compact JSON for a column. pydantic-core's encoder: about five times ``json``'s on the
    small payloads the store writes many of per step (signals, run state, arguments)."""
    return to_json(value).decode()
