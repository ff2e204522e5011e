"""A channel's own small state file: where its poll of the chat service stopped (an offset),
per process the seq of the last signal it acted on, and an inbox: input the chat service was told
was taken (a webhook's 200) before its admission finished, kept until it is admitted.

The store keeps processes, and has no table for state that belongs to none; the offset belongs to
the bot. The file is written whole and atomically (a temporary file, fsynced, renamed over it),
under the data directory's ``var/`` (kept from tools like the rest of the kernel's files). Losing
it costs little: the channel then takes what the service still holds (re-sent input is admitted
once, by its run id) and follows each process from the end of its log (and the inbox's input, which
the service will not send again, is lost). A file written before the inbox existed loads with an
empty one; an empty inbox is not written, so such a file keeps its form.
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


def _entry(value: object) -> bool:
    """Whether ``value`` can be an inbox entry: a JSON object with a non-empty string ``id``."""
    if not isinstance(value, dict):
        return False
    key = value.get("id")
    return isinstance(key, str) and bool(key)


class ChannelState:
    """``offset``, ``seqs`` (pid -> seq), ``inbox`` (the input not yet admitted, in the order it
    came: JSON objects, each with a distinct string ``id``) and ``taking``, kept in the JSON file ``path``:
    ``load`` once, change them, ``save``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.seqs: dict[str, int] = {}
        self.inbox: list[dict[str, Any]] = []
        # (first, last): the ids of the updates an album's take under way holds (Telegram), so that
        # a retake holds the same ones, not files of the album that came since
        self.taking: tuple[int, int] | None = None
        self._lock = asyncio.Lock()

    def load(self) -> None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("the state file %s cannot be read (%s): starting afresh", self.path, exc)
            return
        if isinstance(data, dict):
            self._read(data)

    def _read(self, data: dict[str, Any]) -> None:
        """Take what the file's ``data`` holds; a channel's state with more fields reads them here."""
        self.offset = _count(data.get("offset")) or 0
        seqs = data.get("seqs")
        if isinstance(seqs, dict):
            for pid, seq in seqs.items():
                if isinstance(pid, str) and (seq := _count(seq)) is not None:
                    self.seqs[pid] = seq
        taking = data.get("taking")
        if isinstance(taking, list) and len(taking) == 2:
            first, last = _count(taking[0]), _count(taking[1])
            self.taking = (first, last) if first is not None and last is not None and first <= last else None
        inbox = data.get("inbox")
        ids = {entry["id"] for entry in self.inbox}  # (loaded again: what is held already stays, once)
        for entry in inbox if isinstance(inbox, list) else []:
            if _entry(entry) and entry["id"] not in ids:
                ids.add(entry["id"])
                self.inbox.append(entry)

    async def save(self) -> bool:
        """Write the state as it is now; False (logged) when it cannot be written."""
        async with self._lock:
            data: dict[str, Any] = {"offset": self.offset, "seqs": dict(self.seqs)}
            if self.inbox:
                data["inbox"] = list(self.inbox)
            if self.taking is not None:
                data["taking"] = list(self.taking)
            try:
                await asyncio.to_thread(self._write, data)
            except (OSError, ValueError, TypeError, RecursionError) as exc:  # (a full disk; what JSON cannot hold)
                log.error("the state file %s cannot be written: %s", self.path, exc)
                return False
            return True

    def _write(self, data: dict[str, Any]) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with tmp.open("w", encoding="utf-8") as file:
            json.dump(data, file)
            file.flush()
            os.fsync(file.fileno())
        tmp.replace(self.path)
