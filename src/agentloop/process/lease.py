"""Several workers on one database (DESIGN §6): which worker advances a process, and how the
others reach it.

A worker advances a process only while it holds the process's lease (``process_leases``: owner,
expiry, epoch). It claims the lease when it has work for an idle process (a ``send`` it received)
or finds one orphaned (the sweep: an active run or queued input, and no live lease, because the
process's worker died or never was); it keeps its leases alive with one renewal for all of them
every ``ttl / 3`` seconds; it frees a lease once the process is idle and nothing waits in its
queue. Every step's commit first runs ``store.fence``: an UPDATE of the lease row that matches
only this worker's claim (epoch), so a worker whose lease expired and was taken over cannot
commit, and drops the process instead (its cache and its tasks) the moment it learns.

A worker that does not hold a process's lease does not write its state; it leaves rows the
holder acts on, and tells it with ``store.notify`` (NOTIFY on PostgreSQL, delivered at commit):

- ``send`` / system events: an item in the input queue. ``steer`` joins the active run at its
  next tool-result boundary, as on one worker; input for an idle process goes in as ``queue``, to
  be promoted by the holder (or whoever claims the process) with the receipt's run id.
- ``hil``: the decision is a claim on the ``pending_hil`` row, safe from any worker; the holder
  then dispatches (or not) the call.
- ``abort``: a request in the process's key-value rows (``abort:request``); the holder stops the
  run, and the caller waits until the store shows it ended.

Notifications can be lost (a listener reconnecting, a pooler in between), so every ``poll``
seconds each worker re-reads the queues of the processes it holds and sweeps for orphans: a lost
notification delays work by at most ``poll``, it never strands it.

Live signals: a worker publishes the signals of the processes it holds as on one worker. Its
watchers of a process held elsewhere are fed from the process's signal log, read after each
notification about it, in sequence order (``follow``), with the holder's relayed stream deltas
in their place (``relay``). Forwarded signals (a queue change, an
approval decided elsewhere) are logged but not published by the holder: its watchers read them
from the log when the holder hears of them (``SignalHub.recheck``), or when the next live seq
shows one skipped (``Process.signals``), whichever comes first.

Account streams (``Kernel.account_signals``): a worker publishes the signals it commits itself to
its account watchers; the account-level ones (``signals.for_account``: runs ended, approvals asked
and answered) of every commit also go to the other workers in a notification the committing
transaction sends (``accounted``), so an account watcher on any worker sees them, whichever worker
ran the step, without reading any process's log. Each carries its account seq (per owner, gapless,
in commit order: the account log's), so a watcher that finds one missing (a notification lost
while the listener reconnected, or overtaken by a later one) reads it from the account log before
it goes on; and every ``poll`` each worker compares the newest account seq of the owners watched
on it with what reached them, so one lost after the last signal is found too.

Devices (server/devices.py): a device's connection lives on one worker, while its owner may follow
the account stream, or revoke its token, through any. The device events a worker commits (presence
changes, a token revoked or replaced, a device forgotten) go to the others in a notification of
their transaction (``Store.notify_device``), which this worker hands to whoever registered in
``devices`` (the server's device hub: this layer knows no devices) through ``deviced``.

On SQLite (one process owns the file) there are no leases: the engine runs without this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from agentloop.process.keylock import KeyedLocks
from agentloop.process.relay import Relay, publish_batch
from agentloop.process.signals import AccountSignal, Signal
from agentloop.process.store import NoSuchProcess, ProcessRecord, RelayBatch, StoreError
from agentloop.process.store.base import DeviceNews

if TYPE_CHECKING:
    from agentloop.process.engine import ProcessEngine
    from agentloop.process.tx import _Live

T = TypeVar("T")

log = logging.getLogger("agentloop.lease")

ABORT_KEY = "abort:request"  # a process's kv row: {"run_id", "reason"} for its holder to act on
STOP_REASON = "user.stop"  # the reason of a request to finish the run gently (``ProcessEngine.stop``)
DEFAULT_TTL = 30.0
DEFAULT_POLL = 2.0


class LeaseLost(StoreError):
    """This worker's claim on the process was taken over (it expired) or the process was deleted."""

    def __init__(self, pid: str) -> None:
        super().__init__(f"process {pid}: this worker no longer holds its lease")
        self.pid = pid


async def retried(attempt: Callable[[], Awaitable[T]], tries: int = 3) -> T:
    """Input delivered on a shared store: when this worker lost the lease between deciding to
    write as the holder and committing (it let the idle process go, or the lease expired),
    nothing was written, so the delivery starts over (as a forward, or under a new claim)."""
    for _ in range(tries - 1):
        try:
            return await attempt()
        except LeaseLost:
            continue
    return await attempt()


def idle_now(live: _Live) -> bool:
    """No run, no tool, no abort, no driver at work for the process."""
    driver = live.driver
    return (
        live.record.current_run is None
        and not live.tools
        and not live.stopping
        and (driver is None or driver.done() or driver is asyncio.current_task())
    )


def worker_id() -> str:
    """A name for this worker that no other (live or dead) shares: host, OS pid, random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"


class Leases:
    """The leases one engine holds on a shared store, and the loop that keeps them: renewals,
    the sweep, notifications from the other workers."""

    def __init__(
        self, engine: ProcessEngine, *, owner: str | None = None, ttl: float = DEFAULT_TTL, poll: float = DEFAULT_POLL
    ) -> None:
        if ttl <= 0 or poll <= 0:
            raise ValueError("lease ttl and poll interval must be positive")
        self.engine = engine
        self.store = engine.store
        self.owner = owner or worker_id()
        self.ttl = ttl
        self.poll = poll
        self.held: dict[str, int] = {}  # pid -> epoch of this worker's claim
        self._claiming = KeyedLocks()  # one claim of a process at a time (a send's, the sweep's)
        self._changed: set[str] = set()  # pids other workers said changed, not yet looked at
        self._news: dict[str, set[asyncio.Event]] = {}  # pid -> its waiters (``_news_of``), set when it changes
        self._wake = asyncio.Event()
        self._tail: dict[str, int] = {}  # pid -> last seq published to this worker's watchers
        self._loop: asyncio.Task[None] | None = None
        self._unlisten: Any = None
        self._background: set[asyncio.Task[Any]] = set()
        # told of each process claimed with a run under way (a takeover: its previous holder died,
        # closed or stalled); called under the claim, so each only starts work of its own
        self.taken: list[Callable[[ProcessRecord], None]] = []
        # told of each device event another worker committed (``deviced``): the server registers
        # its device hub here, which tells this worker's account watchers and closes connections
        self.devices: list[Callable[[DeviceNews], None]] = []
        # stream deltas between workers; an interest outlives a few polls of a follower set up like this one
        self.relay = Relay(self.store, self.owner, interest_ttl=max(3 * poll, 10.0))

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> list[str]:
        """Listen, claim the orphans (a dead worker's runs, this one's from before a restart),
        and start the loop; returns the pids resumed."""
        self._unlisten = await self.store.listen(self._notified, self)
        resumed = await self.sweep(reclaim=True)  # (this name's leases from before a restart too)
        self._loop = asyncio.get_running_loop().create_task(self._run(), name="agentloop-leases")
        return resumed

    async def stop(self) -> None:
        """Stop the loop and free every lease (the engine's tasks are stopped already), so another
        worker resumes this one's runs at once instead of after their expiry."""
        tasks = [t for t in [self._loop, *self._background] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.relay.stop()
        if self._unlisten is not None:
            await self._unlisten()
            self._unlisten = None
        held, self.held = self.held, {}
        for pid, epoch in held.items():
            try:
                await self.store.release_lease(pid, self.owner, epoch)
            except Exception:  # the database is gone: the leases expire by themselves
                log.warning("could not release the lease of %s; it expires in %.0fs", pid, self.ttl)

    # -- claiming ---------------------------------------------------------------------------------

    async def hold(self, pid: str) -> bool:
        """Make sure this worker holds ``pid``'s lease: True if it did or could claim it (the
        process is then resumed from the store), False if another live worker holds it."""
        if pid in self.held:
            return True
        async with self._claiming.hold(pid):
            if pid in self.held:
                return True
            epoch = await self.store.claim_lease(pid, self.owner, self.ttl)
            if epoch is None:
                return False
            await self._took(pid, epoch)
            return True

    async def sweep(self, *, reclaim: bool = False) -> list[str]:
        """Claim processes with work and no live lease, and resume them."""
        resumed = []
        for pid, epoch in await self.store.claim_orphans(self.owner, self.ttl, reclaim=reclaim):
            async with self._claiming.hold(pid):
                if self.held.get(pid, 0) >= epoch:
                    continue  # this worker's own claim (a send's) came first
                try:
                    await self._took(pid, epoch)
                except Exception:  # (its lease is let go: the next sweep tries again) the others go on
                    log.exception("process %s: claimed, but could not resume it", pid)
                    continue
                resumed.append(pid)
        return resumed

    async def _took(self, pid: str, epoch: int) -> None:
        """A claim succeeded: whatever this worker cached of the process may be stale (another
        worker may have advanced it), so it is reloaded; a run in flight under the previous
        holder resumes as after a crash (its open calls re-dispatched or failed)."""
        engine = self.engine
        try:
            record = await self.store.get_process(pid)
            if record is None:
                raise NoSuchProcess(pid)
            if record.current_run is not None and await self._stop_asked(pid, epoch, record.current_run):
                record.current_run = {**record.current_run, "stopping": True}
        except Exception:
            with contextlib.suppress(Exception):  # (the database is away: the lease expires)
                await self.store.release_lease(pid, self.owner, epoch)
            raise
        self.held[pid] = epoch
        self._tell_waiters(pid)  # (they wait for it here from now on)
        engine.uncache(pid)
        try:
            if pid in self._tail:
                await self._publish_log(pid)  # what the previous holder logged, before this one's steps
                self._tail.pop(pid, None)
                self.relay.forget(pid)
            await engine.resume(record)
            if record.current_run is not None:
                for hook in list(self.taken):
                    try:
                        hook(record)
                    except Exception:  # (the process is resumed: what a hook missed is not its concern)
                        log.exception("process %s: a takeover hook failed", pid)
        except Exception:
            # Not resumed: the lease goes back. Kept, it would be renewed with everything else this
            # worker holds while nothing here drives the process, and no sweep (this worker's
            # skips its own leases) would ever take the process up again.
            if self.held.get(pid) == epoch:
                del self.held[pid]
                engine.uncache(pid)
                with contextlib.suppress(Exception):  # (the database is away: the lease expires)
                    await self.store.release_lease(pid, self.owner, epoch)
            raise

    async def _stop_asked(self, pid: str, epoch: int, run: dict[str, Any]) -> bool:
        """On a takeover, before the run resumes (and before this worker shows the process as its
        own: nothing loads the run as it was before the mark): a gentle stop forwarded to the
        previous holder that it never acted on (it died first) marks the run ``stopping`` now, as
        ``_ask_to_stop`` would have, so its next model turn is its last, without tools, and it
        ends as stopped (left to ``_look``, the resumed run could end first as a plain end of
        turn). An abort asked for is left to ``_look``: its caller waits for it, and stops it
        here if need be. Whether the run was marked."""
        request = await self.store.kv_get(pid, ABORT_KEY)
        if (
            not isinstance(request, dict)
            or request.get("reason") != STOP_REASON
            or request.get("run_id") != run["run_id"]
        ):
            return False
        async with self.store.transaction():
            if not await self.store.fence(pid, self.owner, epoch, self.ttl):  # (this claim's)
                raise LeaseLost(pid)
            await self.store.kv_delete(pid, ABORT_KEY)
            if not run.get("stopping"):
                await self.store.update_process(pid, current_run={**run, "stopping": True}, state="running")
        return True

    def idle(self, pid: str) -> None:
        """The process has no active run: free its lease (in the background) unless input waits."""
        if pid in self.held:
            self._spawn(self._release_if_idle(pid))

    async def _release_if_idle(self, pid: str) -> None:
        engine = self.engine
        queued = await self.store.queue(pid)
        seen = await self.store.last_event_seq(pid) if engine.hub.watching(pid) else None
        live = engine.cached(pid)
        if queued:
            if live is not None and not live.lost and live.record.current_run is None:
                live.queued = len(queued)
                await engine.promote(live)
            return
        epoch = self.held.get(pid)
        if epoch is None or pid in engine.compacting or (live is not None and not idle_now(live)):
            return  # work arrived meanwhile (a compaction asked for lets it go when it is over)
        # no await from the check to here: a send of this worker either came before (and is
        # seen above) or comes after and claims the lease anew (a new epoch this release leaves)
        del self.held[pid]
        engine.uncache(pid)
        if seen is not None:  # its watchers here follow it from now on as held elsewhere
            self._tail[pid] = seen
            self._spawn(self.relay.announce([pid]))
        await self.store.release_lease(pid, self.owner, epoch)
        if await self.store.queue(pid):  # input that another worker queued while this one let go
            await self.hold(pid)

    # -- fencing ----------------------------------------------------------------------------------

    async def fence(self, pid: str) -> None:
        """Inside a step's transaction: ``LeaseLost`` unless this worker's claim still holds (and
        extend it); the other workers hear of the step once it commits."""
        epoch = self.held.get(pid)
        if epoch is None or not await self.store.fence(pid, self.owner, epoch, self.ttl):
            raise LeaseLost(pid)

    async def told(self, pid: str) -> None:
        """Inside a transaction of a process held elsewhere: its holder hears of it at commit."""
        await self.store.notify(pid, self.owner)

    def lost(self, pid: str) -> None:
        """This worker no longer holds ``pid`` (taken over, or its commit found the lease gone)."""
        if self.held.pop(pid, None) is not None:
            self._followed_from_log(pid)

    def _followed_from_log(self, pid: str) -> None:
        """Just before this worker drops its cache of a process it held: its watchers here follow
        the process from the log from now on, from the last signal it published to them, as
        watchers of any process held elsewhere (else they would hear nothing more of it)."""
        live = self.engine.cached(pid)
        if live is None or live.remote or not self.engine.hub.watching(pid) or pid in self._tail:
            return
        self._tail[pid] = live.seq
        self._spawn(self.relay.announce([pid]))
        self._changed.add(pid)  # (read the log at once: the new holder may be well ahead)
        self._wake.set()

    def _gone(self, pid: str) -> None:
        """The process was killed (through another worker): end its watchers' streams here, as a
        kill on this worker does, instead of leaving them waiting for ever."""
        self.held.pop(pid, None)
        self._tail.pop(pid, None)
        self.relay.forget(pid)
        self.engine.uncache(pid)
        self.engine.hub.close(pid)

    async def _exists(self, pid: str) -> bool:
        record = await self.store.get_process(pid)
        return record is not None and record.state != "killed"

    # -- forwarding -------------------------------------------------------------------------------

    async def _active_run(self, pid: str, run_id: str | None) -> dict[str, Any] | None:
        """The process's active run as the store has it (``run_id``: only that one), else None."""
        record = await self.store.get_process(pid)
        if record is None:
            raise NoSuchProcess(pid)
        run = record.current_run
        return None if run is None or (run_id is not None and run["run_id"] != run_id) else run

    async def forward_stop(self, pid: str, run_id: str | None) -> bool:
        """Ask the holder to finish the active run gently (``run_id``: only that one); False if no
        such run is active. Not waited for: the run ends when its last answer is in."""
        run = await self._active_run(pid, run_id)
        if run is None:
            return False
        async with self.store.transaction():
            if await self.store.kv_get(pid, ABORT_KEY) is None:  # (an abort asked for already wins)
                await self.store.kv_set(pid, ABORT_KEY, {"run_id": run["run_id"], "reason": STOP_REASON})
            await self.told(pid)
        return True

    async def forward_abort(self, pid: str, run_id: str | None, reason: str, *, wait: float = 30.0) -> bool:
        """Ask the holder to stop the active run (``run_id``: only that one) and wait until the
        store shows it ended; False if no such run was active, or it did not end in ``wait``."""
        run = await self._active_run(pid, run_id)
        if run is None:
            return False
        async with self.store.transaction():
            await self.store.kv_set(pid, ABORT_KEY, {"run_id": run["run_id"], "reason": reason})
            await self.told(pid)
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            with self._news_of(pid) as news:
                if pid in self.held:  # claimed meanwhile (its holder died or let go): stop it here
                    return await self.engine.abort(pid, run["run_id"], reason=reason)
                record = await self.store.get_process(pid)
                if record is None or (record.current_run or {}).get("run_id") != run["run_id"]:
                    return True
                await _heard(news, min(self.poll, left))
        return False

    async def wait_idle(self, pid: str) -> None:
        """Return when the process, held by another worker, has no active run and no input waiting."""
        while pid not in self.held:
            with self._news_of(pid) as news:
                record = await self.store.get_process(pid)
                if record is None or record.state == "killed":
                    raise NoSuchProcess(pid)
                if record.current_run is None and not await self.store.queue(pid):
                    return
                await _heard(news, self.poll)
        await self.engine.wait_idle(pid)

    @contextlib.contextmanager
    def _news_of(self, pid: str) -> Iterator[asyncio.Event]:
        """An event set when the holder says ``pid`` changed (each of its commits does). Taken
        before reading the process, so a change right after the read is not missed; waited on
        at most ``poll`` at a time (a notification can be lost), so that waiting on a process
        held elsewhere does not read the store in a tight loop for as long as its run lasts, as
        many times over as there are waiters."""
        news = asyncio.Event()
        waiters = self._news.setdefault(pid, set())
        waiters.add(news)
        try:
            yield news
        finally:
            waiters.discard(news)
            if not waiters and self._news.get(pid) is waiters:
                del self._news[pid]

    def follow(self, pid: str, after_seq: int) -> None:
        """A watcher of ``pid`` has read its log up to ``after_seq``: signals after that reach it
        from this worker's log reads while another worker holds the process (and its deltas
        from the holder, told that someone here follows it)."""
        if pid not in self.held:
            if pid not in self._tail:
                self._spawn(self.relay.announce([pid]))
            self._tail[pid] = min(self._tail.get(pid, after_seq), after_seq)

    # -- the loop ---------------------------------------------------------------------------------

    def _notified(self, pid: str, sender: str) -> None:
        if sender == self.owner:
            return
        self._tell_waiters(pid)
        self._changed.add(pid)
        self._wake.set()

    def _tell_waiters(self, pid: str) -> None:
        for news in self._news.get(pid, ()):
            news.set()

    # -- relayed deltas (see relay.py) -----------------------------------------------------------

    def relayed(self, sender: str, batches: list[RelayBatch]) -> None:
        """Another worker's deltas: straight to the watchers when they follow right after what
        these have seen, else placed once the log is read up to them."""
        if sender == self.owner:
            return
        for pid, base, payloads in batches:
            tail = self._tail.get(pid)
            if tail is None:
                continue  # nobody here follows it (any more)
            if base == tail and not self.relay.waiting(pid):
                publish_batch((base, payloads), tail, functools.partial(self.engine.hub.publish, pid))
            else:
                self.relay.received(pid, base, payloads)
                self._changed.add(pid)
                self._wake.set()

    def followed(self, sender: str, pids: list[str]) -> None:
        self.relay.followed(sender, pids)

    # -- account streams ---------------------------------------------------------------------------

    def accounted(self, owner: str, pid: str, items: list[tuple[int, int, str, dict[str, Any] | None]]) -> None:
        """Account-level signals (``signals.for_account``) another worker committed for ``owner``'s
        process ``pid``, told in its transaction as (account seq, seq, name, payload): to this
        worker's account watchers of ``owner``, who see the signals this worker commits as it
        publishes them, and no others (what the log reads publish goes to process watchers only).
        One without its payload (too large for a notification) is read from the account log
        first; one that never comes is found missing by its successor's account seq (or by the
        poll: ``_account_caught_up``), and read from the account log the same way."""
        hub = self.engine.hub
        if not hub.watches_account(owner):
            return  # nobody here watches the account (the usual case: nothing to do)
        if all(payload is not None for _, _, _, payload in items):
            for number, seq, name, payload in items:
                assert payload is not None
                hub.to_account(owner, AccountSignal(pid, Signal(name, payload, seq), number))
            return
        self._spawn(self._account_from_log(owner, items))

    # -- devices -----------------------------------------------------------------------------------

    def deviced(self, news: DeviceNews) -> None:
        """A device event another worker committed (its own are acted on where they are made)."""
        for hook in list(self.devices):
            try:
                hook(news)
            except Exception:  # (one hook's failure is not the others')
                log.exception("device %s of %s: a device hook failed", news.name, news.owner)

    async def _account_from_log(self, owner: str, items: list[tuple[int, int, str, dict[str, Any] | None]]) -> None:
        first = min(number for number, _, _, _ in items)
        last = max(number for number, _, _, _ in items)
        rows = await self.store.account_events(owner, after_seq=first - 1, limit=last - first + 1)
        for row in rows:  # (one pruned meanwhile is missing: the watchers are told when they read)
            self.engine.hub.to_account(owner, AccountSignal.logged(row))

    async def _account_caught_up(self) -> None:
        """The poll's check of the account streams watched here: an owner whose account log holds
        a newer account seq than any that reached its watchers gets the rest from the log (a
        notification lost after the owner's last signal has no successor to reveal it). The
        watchers drop what they had already."""
        hub = self.engine.hub
        heads = hub.account_heads()
        if not heads:
            return
        for owner, newest in (await self.store.last_account_seqs(list(heads))).items():
            seen = heads[owner]
            if newest > seen and hub.watches_account(owner):
                rows = await self.store.account_events(owner, after_seq=seen, limit=500)
                for row in rows:
                    hub.to_account(owner, AccountSignal.logged(row))

    async def _run(self) -> None:
        renew_every = self.ttl / 3
        next_renew = time.monotonic() + renew_every
        next_poll = time.monotonic() + self.poll
        while True:
            timeout = max(0.0, min(next_renew, next_poll) - time.monotonic())
            with contextlib.suppress(TimeoutError):  # (``asyncio.timeout``: 3.11's ``wait_for`` can swallow a cancel)
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            self._wake.clear()
            try:
                changed, self._changed = self._changed, set()
                for pid in changed:
                    await self._look(pid)
                now = time.monotonic()
                if now >= next_renew:
                    # a failed renewal is tried again at the next poll, not a renewal period later:
                    # two periods of a database blip would otherwise let every lease lapse
                    next_renew = now + min(renew_every, self.poll)
                    await self._renew()
                    next_renew = now + renew_every
                if now >= next_poll:
                    next_poll = now + self.poll
                    await self.sweep()
                    for pid in [*self.held, *self._tail]:
                        await self._look(pid)
                    if self._tail:  # (kept alive while the watchers last)
                        await self.relay.announce(list(self._tail))
                    await self._account_caught_up()
            except asyncio.CancelledError:
                raise
            except Exception:  # (the database is away) the next round tries again
                log.exception("lease upkeep failed")

    async def _renew(self) -> None:
        before = dict(self.held)
        alive = await self.store.renew_leases(self.owner, self.ttl)
        for pid, epoch in before.items():
            if self.held.get(pid) == epoch and alive.get(pid) != epoch:
                log.warning("process %s: lease lost (taken over after it expired, or killed)", pid)
                self.lost(pid)
                self.engine.uncache(pid)
        # Leases of this name that nothing here acts on (one whose release failed, one from before
        # a restart under the same name, the sweep's skipping its idle processes): renewed with the
        # rest, they would keep every other worker from the process for good, and this one would
        # ignore the input they forward. Let them go (a claim under way is left to finish).
        for pid, epoch in alive.items():
            if pid not in self.held and pid not in self._claiming:
                await self.store.release_lease(pid, self.owner, epoch)

    async def _look(self, pid: str) -> None:
        """Another worker changed the process (or it is time to poll): act on what it left."""
        engine = self.engine
        live = engine.cached(pid) if pid in self.held else None
        if live is None and pid in self.held and pid not in self._claiming:
            # held but not loaded (a claim that found nothing to resume, the reload after a failed
            # commit): loaded now, so that input another worker leaves for it is run, or the
            # idle process let go; unlooked at, its lease would be renewed with nothing acting on it
            try:
                live = await engine.live(pid)
            except NoSuchProcess:
                self._gone(pid)
                return
            if live.remote:
                return  # let go of meanwhile
        if live is None:
            if pid in self._tail:
                await self._publish_log(pid)
            return
        request = await self.store.kv_get(pid, ABORT_KEY)
        if request is not None:
            try:
                # under this worker's claim: one that lost the lease without knowing yet (a
                # stall) leaves the request to the new holder instead of dropping it unheeded
                if request.get("reason") == STOP_REASON:
                    await self._take_stop(live, request)
                else:
                    async with self.store.transaction():
                        await self.fence(pid)
                        await self.store.kv_delete(pid, ABORT_KEY)
            except LeaseLost:
                if engine.cached(pid) is live:
                    self.lost(pid)
                    engine.uncache(pid)
                return
            run = live.record.current_run
            # (an abort of this worker's own stopping the run already: a second one racing it
            # would end the run twice, each with its cancelled results; the caller waits all the same)
            # (a gentle stop is marked already: ``_take_stop``)
            reason = str(request.get("reason", "user"))
            if (
                run is not None
                and run["run_id"] == request.get("run_id")
                and not live.stopping
                and reason != STOP_REASON
            ):
                self._spawn(engine.abort(pid, run["run_id"], reason=reason))
        queued = len(await self.store.queue(pid))
        logged = await self.store.last_event_seq(pid)  # forwarded signals too: relayed deltas follow them
        if engine.cached(pid) is not live:
            return  # let go of (or reloaded) meanwhile
        if logged < live.seq and not await self._exists(pid):  # (a log only shrinks when its process is killed)
            if engine.cached(pid) is live:
                self._gone(pid)
            return
        live.queued = queued
        if logged > live.seq:  # signals another worker logged for it (a queue change, a decision)
            live.seq = logged
            # its watchers here read them now (from the log: this worker publishes its own
            # steps' only), not when a later step's seq shows them skipped: that may be the end of
            # a tool call minutes long, or never while the process is idle; and before the stream
            # deltas made from now on (their base is ``logged``), as on one worker
            engine.hub.recheck(pid)
        live.approvals = True  # a decision may have been stored elsewhere
        if live.record.current_run is None:
            if live.queued:
                await engine.promote(live)
            elif idle_now(live):
                self.idle(pid)
        else:
            engine.wake(pid)

    async def _take_stop(self, live: _Live, request: dict[str, Any]) -> None:
        """A gentle stop forwarded to this worker: the request is taken and the run marked
        ``stopping`` (as ``ProcessEngine.stop`` marks it) in one transaction, under this worker's
        claim. Taken in a transaction of its own, a crash before the mark's would lose the stop:
        the worker taking the run over (``_stop_asked``) would find no request and no mark. A
        request for another run (ended meanwhile), or one for a run an abort of this worker is
        stopping already, is only taken."""
        engine = self.engine
        pid = live.record.pid
        marked = False
        async with engine._tx(live) as tx:  # (fenced at its end: ``LeaseLost`` if the claim is gone)
            await self.store.kv_delete(pid, ABORT_KEY)
            # read inside the transaction: a step that committed while it began is not overwritten
            run = live.record.current_run
            if run is not None and run["run_id"] == request.get("run_id") and not live.stopping:
                if not run.get("stopping"):
                    await tx.set_run({**run, "stopping": True})
                marked = True
        if marked:
            engine.wake(pid)  # (a driver waiting on nothing takes its last round now)

    async def _publish_log(self, pid: str) -> None:
        """Feed this worker's watchers of ``pid`` from its log, in order, from where they are."""
        hub = self.engine.hub
        if not hub.watching(pid):
            self._tail.pop(pid, None)
            self.relay.forget(pid)
            return
        after = self._tail.get(pid, 0)
        rows = await self.store.events(pid, after_seq=after)
        if not rows and pid not in self.held and not await self._exists(pid):
            if pid not in self.held:  # (not claimed meanwhile)
                self._gone(pid)
            return
        logged = [Signal(row.signal, row.payload, row.seq) for row in rows]
        self.relay.merge(pid, after, logged, functools.partial(hub.publish, pid))
        if rows and pid in self._tail:
            self._tail[pid] = rows[-1].seq

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("lease work failed", exc_info=task.exception())


async def _heard(news: asyncio.Event, seconds: float) -> None:
    """Wait until ``news`` is set, or ``seconds``."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await news.wait()
