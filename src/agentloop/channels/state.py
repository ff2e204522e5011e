"""A channel's own small state file: where its poll of the chat service stopped (an offset),
and per process the seq of the last signal it acted on.

The store keeps processes, and has no table for state that belongs to none; the offset belongs to
the bot. The file is written whole and atomically (a temporary file, fsynced, renamed over it),
under the data directory's ``var/`` (kept from tools like the rest of the kernel's files). Losing
it costs little: the channel then takes what the service still holds (re-sent input is admitted
once, by its run id) and follows each process from the end of its log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("agentloop.channels")


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class ChannelState:
    """``offset`` and ``seqs`` (pid -> seq), kept in the JSON file ``path``: ``load`` once, change
    them, ``save``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.seqs: dict[str, int] = {}
        self._lock = asyncio.Lock()

    def load(self) -> None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("the state file %s cannot be read (%s): starting afresh", self.path, exc)
            return
        if not isinstance(data, dict):
            return
        self.offset = _count(data.get("offset")) or 0
        seqs = data.get("seqs")
        if isinstance(seqs, dict):
            for pid, seq in seqs.items():
                if isinstance(pid, str) and (seq := _count(seq)) is not None:
                    self.seqs[pid] = seq

    async def save(self) -> None:
        async with self._lock:
            data = {"offset": self.offset, "seqs": dict(self.seqs)}
            try:
                await asyncio.to_thread(self._write, data)
            except OSError as exc:
                log.error("the state file %s cannot be written: %s", self.path, exc)

    def _write(self, data: dict[str, Any]) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with tmp.open("w", encoding="utf-8") as file:
            json.dump(data, file)
            file.flush()
            os.fsync(file.fileno())
        tmp.replace(self.path)
