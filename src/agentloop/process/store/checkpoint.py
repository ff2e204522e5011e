"""Background WAL checkpoints for the SQLite store.

In WAL mode every commit appends the pages it changed to the write-ahead log; once the log holds
``wal_autocheckpoint`` pages, the *committing* connection copies them back into the database file
and fsyncs it. That checkpoint lands on whichever step happened to cross the threshold: measured
on the W1 workload, 1 % of commits took 0.3–17 ms and made up two thirds of all commit time.

A :class:`Checkpointer` moves that work to a thread with its own connection. Commits tell it how
many happened; every ``every`` commits (and at least every ``interval`` seconds while there were
any) it runs a PASSIVE checkpoint, which never blocks the writer. ``sqlite3`` releases the GIL
while SQLite works, so the copy and the fsync overlap with the event loop instead of stalling it.
The log file starts over from its beginning at the first commit after a checkpoint has copied
all of it, which the thread achieves whenever the writer pauses. Under sustained writing it may
not; the store therefore keeps ``wal_autocheckpoint`` as a safety net, four times SQLite's default:
past it the writer checkpoints itself, which is cheap by then (the thread has already copied
nearly every page) and bounds the file at about 16 MiB.
"""

from __future__ import annotations

import logging
import sqlite3
import threading

log = logging.getLogger("agentloop.store")

SAFETY_NET_PAGES = 4096  # the writer checkpoints itself only past this many log pages (16 MiB)


class Checkpointer:
    """``Checkpointer(path)``; ``start()``, ``committed()`` after each commit, ``stop()``."""

    def __init__(self, path: str, *, every: int = 200, interval: float = 1.0) -> None:
        self.path = path
        self.every = every
        self.interval = interval
        self._pending = 0  # commits since the last request (only the writer's thread touches it)
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.runs = 0  # checkpoints done (for tests and diagnostics)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="agentloop-wal-checkpoint", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        """Called by the writer after each commit: cheap, no lock, no syscall most of the time."""
        self._pending += 1
        if self._pending >= self.every:
            self._pending = 0
            self._wake.set()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join()
        self._thread = None

    def _catch_up(self, db: sqlite3.Connection) -> None:
        """Checkpoint until the log is copied back entirely (the writer keeps appending meanwhile,
        each round copies what the previous one left): only a fully copied log is started over
        from its beginning by the next commit, so this is what keeps the file short."""
        for _ in range(8):
            _, frames, copied = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            self.runs += 1
            if frames == copied or self._stopping:
                return

    def _work(self) -> None:
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:  # the writer's own autocheckpoint still bounds the log
            log.warning("background checkpoints disabled: %s", exc)
            return
        try:
            db.execute("PRAGMA busy_timeout=1000")
            while not self._stopping:
                self._wake.wait(self.interval)
                self._wake.clear()
                try:
                    self._catch_up(db)
                except sqlite3.Error as exc:  # busy or locked: try again at the next wake-up
                    log.debug("checkpoint skipped: %s", exc)
        finally:
            db.close()
