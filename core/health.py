"""Liveness and stalls, watched out of band through the rendezvous store.

The background thread can be stuck inside a collective exactly when something
needs to be reported, so the watching happens on a separate daemon thread
that talks only to the store (through its own connection):

* every rank bumps a heartbeat counter each interval and publishes the names
  of collectives it has been waiting on for a while;
* rank 0 reads them all: a rank whose heartbeat stops is reported as
  unresponsive; a tensor that some ranks wait on and others have not
  submitted for ``HVDLIKE_STALL_CHECK_TIME_SECONDS`` is logged with the
  missing ranks; after ``HVDLIKE_STALL_SHUTDOWN_TIME_SECONDS`` rank 0 posts an
  abort message that every rank turns into a :class:`StallError` (a shutdown
  time below the check time shuts nothing down, as in Horovod: rank 0 warns
  once that it will not, see :func:`shutdown_after`);
* a rank blocked in a wait with nothing submitted or completed since says so
  with everything it has pending; when every rank of a group is stuck on
  names that only other stuck ranks could complete (:mod:`.deadlock`) for
  ``HVDLIKE_DEADLOCK_TIME_SECONDS``, rank 0 posts the abort with a
  :class:`DeadlockError` naming what each rank waits for;
* when a collective fails, :meth:`Health.diagnose` tells which peers stopped
  beating, so the error names the dead rank and its host;
* a rank that has taken in the abort says so (``health/abort_seen/<rank>``),
  and rank 0 -- which hosts the store under mpirun, srun and torchrun --
  keeps it up at teardown until every live peer has (:meth:`Health.close`):
  a peer whose watcher was slow to look must still learn why, not find the
  store gone;
* a store that stays unreachable (its host died) is itself a failure
  (``store_lost``): a collective whose engine never reports a vanished peer
  (MPI) must not wait for it forever;
* every store request goes through one "store I/O" thread (:class:`_StoreIO`)
  and is waited for only a few seconds: on a link cut without a reset (a
  cable pulled, a host partitioned away) a request can block in the socket for
  as long as the cut lasts -- the store client's timeout does not bound it --
  and neither the watcher nor the failure path (:meth:`Health.diagnose`) may
  hang with it. A request that does not answer in time counts as the store
  being unreachable.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import config, deadlock
from .errors import DeadlockError, HvdlikeInternalError, StallError
from .store_auth import StoreTamperedError
from .log import logger

MAX_NAMES = 8  # per report line; the rest is summarised as a count
STORE_LOST_SECONDS = 5.0  # unreachable this long (and 5 intervals): its host is gone
PEER_QUIET_SECONDS = 5.0  # rank 0 at an abort: a peer silent this long is not waited for
STORE_ANSWER_SECONDS = 2.0  # a store request unanswered this long (and 3 intervals) is hung


def shutdown_after(cfg, environ: Mapping[str, str] = os.environ) -> Tuple[float, str, str]:
    """``(seconds, variable, warning)``: how long a stall lasts before it shuts the
    job down (0: never), the variable that set it as spelled in ``environ``, and
    what to warn about when the time set is not used ('' when it is).

    As in Horovod, a shutdown time below the stall check time shuts nothing
    down: stalls are still reported and the job carries on.
    """
    limit = cfg.stall_shutdown_time_seconds
    name = config.variable_of(cfg, "stall_shutdown_time_seconds", environ)
    check = cfg.stall_check_time_seconds
    if cfg.stall_check_disable or not 0 < limit < check:
        return limit, name, ""
    check_set = config.variable_of(cfg, "stall_check_time_seconds", environ)
    if config.lookup(environ, config.KNOBS_BY_FIELD["stall_check_time_seconds"]) is None:
        check_set = f"{check_set} ({check:g}, its default)"
    else:
        check_set = f"{check_set}={check:g}"
    return 0.0, name, (f"{name}={limit:g} is less than {check_set}, so a stall will be "
                       f"reported but will not shut the job down; set it to at least "
                       f"{check:g} for that")


def exited_key(rank: int) -> str:
    """Where ``hvdlike-run`` (static jobs) records how launched rank ``rank``'s
    process ended, outside any runtime's prefix: a rank that ends without ever
    calling ``init()`` (or before a later one) leaves no word of its own, and
    the ranks waiting for it learn from this key instead of their timeout."""
    return f"launcher/exited/{rank}"


def word_of(store, rank: int, exits=None) -> Optional[str]:
    """What ``rank`` left in ``store`` about its end -- its own reason, or the
    elastic launcher's for it (``protocol.lost_key``), or a goodbye -- if anything;
    else, given ``exits`` (the job's unprefixed store), how the launcher saw its
    process end (:func:`exited_key`)."""
    def read(key: str, where=store) -> Optional[bytes]:
        return where.get(key) if where.check([key]) else None

    try:
        said = read(f"health/shutdown/{rank}")
        if said is not None:
            return said.decode()
        if read(f"health/bye/{rank}") is not None:
            return "shut down"
        if exits is not None:
            ended = read(exited_key(rank), exits)
            if ended is not None:
                return ended.decode()
        return None
    except StoreTamperedError as exc:
        return str(exc)


def words_probe(store, exits=None) -> Callable[[Sequence[int]], str]:
    """A probe (see :mod:`.store_wait`) that knows only what ranks left in the store:
    for the sets built before the watcher starts, when no heartbeat moves yet.
    In an elastic job it names a rank the launcher saw end while the
    generation was forming; with ``exits`` (see :func:`word_of`), a rank whose
    process ``hvdlike-run`` saw end."""
    def probe(ranks: Sequence[int]) -> str:
        try:
            words = {r: word_of(store, r, exits) for r in ranks}
        except Exception:  # the store is unreachable: the wait's own timeout reports it
            return ""
        return "; ".join(f"rank {r} {word}" for r, word in words.items() if word is not None)

    return probe


class StoreHungError(TimeoutError):
    """A store request did not answer in time (or one before it is still hung)."""


class _Request:
    """One store request handed to :class:`_StoreIO`, and its outcome."""

    __slots__ = ("fn", "done", "result", "error", "abandoned")

    def __init__(self, fn):
        self.fn = fn
        self.done = threading.Event()
        self.result = self.error = None
        self.abandoned = False  # its caller stopped waiting: not worth sending any more


class _StoreIO:
    """Makes a Health's store requests one at a time on a daemon thread of its own.

    A request on a connection whose link was cut silently (no reset) blocks in
    the socket's recv until the link returns; the store client's timeout does
    not bound that. Running requests here lets every caller give up after
    ``deadline`` seconds (:class:`StoreHungError`) instead of hanging with it.
    While the thread is still stuck in a request, further ones fail at once
    rather than queue behind it, so no caller waits on a hung request twice.
    The connection stays used by one request at a time, as it must be.
    """

    def __init__(self, deadline: float):
        self.deadline = deadline
        self._requests: "queue.SimpleQueue[Optional[_Request]]" = queue.SimpleQueue()
        # Guards _stuck, _closed and the requests' done/abandoned; never held
        # during a request, so taking it cannot block on the store.
        self._lock = threading.Lock()
        self._stuck = False  # a caller gave up on a request the thread has not returned from
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="hvdlike-health-store",
                                         daemon=True)
        self._thread.start()

    def call(self, fn):
        """``fn()`` (which uses the store) run on the I/O thread; its result or its
        exception, or :class:`StoreHungError` once ``deadline`` has passed."""
        with self._lock:
            if self._stuck:
                raise StoreHungError(f"a store request has not answered for over "
                                     f"{self.deadline:g}s")
            request = _Request(fn)
            if self._closed:
                # Read after the watcher stopped (why a shutdown happened, for a
                # late call's error): rare, so a thread of its own for it.
                threading.Thread(target=self._answer, args=(request,),
                                 name="hvdlike-health-store", daemon=True).start()
            else:
                self._requests.put(request)
        if not request.done.wait(self.deadline):
            with self._lock:
                if not request.done.is_set():
                    request.abandoned = True
                    self._stuck = True
                    raise StoreHungError(f"the store did not answer within {self.deadline:g}s")
        if request.error is not None:
            raise request.error
        return request.result

    def close(self) -> None:
        """End the thread after the requests queued (at once if none is hung);
        later requests each get a thread of their own."""
        with self._lock:
            self._closed = True
            self._requests.put(None)

    def _serve(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            self._answer(request)
            request = None  # do not keep a result (or traceback) alive while idle

    def _answer(self, request: _Request) -> None:
        with self._lock:
            if request.abandoned:
                return
        try:
            request.result = request.fn()
        except BaseException as exc:  # handed to the caller, raised there
            request.error = exc
        with self._lock:
            self._stuck = False  # it answered, late or not: the link is back
            request.done.set()


class Health:
    """Heartbeat, stall inspection and peer diagnosis for one runtime."""

    def __init__(self, store, rank: int, size: int, hostname: str, cfg,
                 waiting_since: Callable[[], Dict[tuple, float]],
                 on_abort: Callable[[BaseException], None],
                 members: Callable[[int], List[int]] = None,
                 blocked_since: Callable[[], Optional[float]] = lambda: None,
                 joins: Callable[[], List[tuple]] = lambda: [],
                 store_lost: Optional[Callable[[BaseException], None]] = None,
                 exits=None,
                 coordinated: Callable[[], Dict[tuple, tuple]] = dict):
        self.store = store
        self._exits = exits  # see word_of
        self.rank = rank
        self.size = size
        self.cfg = cfg
        self.interval = min(1.0, cfg.stall_check_time_seconds / 4.0)
        self.stall_enabled = not cfg.stall_check_disable
        self.shutdown_seconds, self._shutdown_name, ignored = shutdown_after(cfg)
        if ignored and rank == 0:  # rank 0 alone inspects stalls
            logger.warning("%s", ignored)
        self.deadlock_after = cfg.deadlock_time_seconds
        self._blocked_since = blocked_since
        self._joins = joins
        self._stuck_clock = deadlock.StuckClock()
        self._stuck_seen: Dict[int, tuple] = {}  # rank 0: rank -> (record id, since, our clock)
        self._waiting_since = waiting_since
        self._on_abort = on_abort
        self._store_lost = store_lost or on_abort
        self._failing_since: Optional[float] = None  # first of the current run of failed ticks
        self._members = members or (lambda set_id: list(range(size)))
        self._coordinated = coordinated  # rank 0: see stall_report
        # One store request at a time on this connection, none waited for long.
        self._io = _StoreIO(max(STORE_ANSWER_SECONDS, 3 * self.interval))
        self._stop = threading.Event()
        self._published = None
        self._beats: Dict[int, tuple] = {}  # rank -> (counter, monotonic time it last moved)
        self._warned_silent = set()
        self._warned_reset = set()  # ranks whose heartbeat record was removed
        self._last_stall_report = 0.0
        self._since: Dict[str, float] = {}  # rank 0: name -> when its wait began, our clock
        self._aborted = False
        self._tampered = False
        self.hosts: Dict[int, str] = {}
        try:
            self._store_op(lambda: store.set(f"health/host/{rank}",
                                             f"{hostname} (pid {os.getpid()})"))
        except BaseException:
            self._io.close()
            raise
        self._thread = threading.Thread(target=self._run, name="hvdlike-health", daemon=True)
        self._thread.start()

    def _store_op(self, fn):
        """``fn()`` against the store, given up after a few seconds (see :class:`_StoreIO`)."""
        return self._io.call(fn)

    def close(self, clean: bool = True) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)
        if clean:
            try:
                self._store_op(lambda: self.store.set(f"health/bye/{self.rank}", "1"))
            except Exception:  # the store may already be gone at job end
                pass
        elif self.rank == 0 and self._aborted and not self._tampered:
            self._await_abort_seen()
        self._io.close()

    def _await_abort_seen(self, limit: float = 15.0) -> None:
        """Rank 0 after an abort: wait (at most ``limit`` s) until every other rank
        has taken the abort in or is gone (it left word or stopped beating: it
        will never look). Rank 0 often hosts the store, and closing it under a peer
        whose watcher has not looked yet would leave that peer with no reason to
        give -- or, under MPI, waiting for rank 0 forever."""
        deadline = time.monotonic() + limit
        departed = self._departures()
        peers = set(range(self.size)) - {self.rank}
        try:
            while peers and time.monotonic() < deadline:
                peers = {r for r in peers if self._read(f"health/abort_seen/{r}") is None}
                peers -= set(departed(sorted(peers)))
                if peers:
                    time.sleep(min(0.05, self.interval))
        except Exception as exc:  # the store is gone already: nothing left to wait for
            logger.debug("not waiting for peers to see the abort: %s", exc)
        if peers:
            logger.debug("closing with rank(s) %s not having seen the abort", sorted(peers))

    def _departures(self) -> Callable[[Sequence[int]], Dict[int, str]]:
        """For one wait on peers: ``departed(ranks)`` maps those of ``ranks`` that
        are gone to why -- what they (or the launcher) left in the store, or a
        heartbeat that has not moved for ``PEER_QUIET_SECONDS`` (and 5 intervals)
        since the first call. Store errors propagate."""
        quiet_after = max(PEER_QUIET_SECONDS, 5 * self.interval)
        beats: Dict[int, tuple] = {}  # rank -> (counter, when it was last seen to move)

        def departed(ranks: Sequence[int]) -> Dict[int, str]:
            now = time.monotonic()
            counts = self._counters_of(ranks)
            found = {}
            for r in ranks:
                if beats.get(r, (None,))[0] != counts[r]:
                    beats[r] = (counts[r], now)
                word = self._word(r)
                if word is not None:
                    found[r] = word
                elif now - beats[r][1] > quiet_after:
                    found[r] = (f"died or stopped responding (no heartbeat for "
                                f"{now - beats[r][1]:.0f}s)")
            return found

        return departed

    # -- the watcher thread ----------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._tick()
                self._failing_since = None
            except StoreTamperedError as exc:  # fail closed: the record is not used
                if not self._tampered:
                    self._tampered = self._aborted = True
                    self._on_abort(exc)
            except Exception as exc:
                if self._unreachable(exc):
                    return

    def _unreachable(self, exc: BaseException) -> bool:
        """Count a failed tick; True once the store has been unreachable for long
        enough that its host must be gone (then this watcher reports it and stops)."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        logger.debug("health check failed: %s", exc)
        if now - self._failing_since < max(STORE_LOST_SECONDS, 5 * self.interval) \
                or self._stop.is_set():
            return False
        self._store_lost(HvdlikeInternalError(
            f"rank {self.rank}: the rendezvous store has been unreachable for "
            f"{now - self._failing_since:.0f}s ({exc}); the launcher, or rank 0 if it "
            f"hosted the store, is gone"))
        return True

    def _tick(self) -> None:
        self._store_op(lambda: self.store.add(f"health/hb/{self.rank}", 1))
        if self.stall_enabled or self.deadlock_after > 0:
            self._publish_waiting()
        if self._store_op(lambda: self.store.check(["health/abort"])) and not self._aborted:
            message = self._store_op(lambda: self.store.get("health/abort")).decode()
            self._aborted = True
            kind = DeadlockError if message.startswith("deadlock:") else StallError
            self._on_abort(kind(message))
            if self.rank != 0:  # rank 0 posted it; the others tell it they have it
                self._store_op(lambda: self.store.set(f"health/abort_seen/{self.rank}", "1"))
        if self.rank == 0:
            self._inspect()

    def _publish_waiting(self) -> None:
        """One record per rank: names waited on for a while (the stall inspector)
        and, while the rank is stuck, everything it has pending (deadlock check)."""
        now = time.monotonic()
        pending = self._waiting_since()
        half = self.cfg.stall_check_time_seconds / 2.0
        waiting = [[set_id, name, round(now - t, 1)]
                   for (set_id, name), t in pending.items() if now - t >= half] \
            if self.stall_enabled else []
        names = sorted((set_id, name) for set_id, name, _ in waiting)
        stuck = None
        if self.deadlock_after > 0:
            since = self._stuck_clock.update(self._blocked_since(), pending, now)
            if since is not None and now - since >= self.interval:
                joins = set(self._joins())
                stuck = {"id": since, "age": round(now - since, 1),
                         "pending": [[set_id, name, (set_id, name) in joins]
                                     for set_id, name in sorted(pending)]}
        key = (names, stuck and stuck["id"])
        if key != self._published:
            payload = json.dumps({"waiting": waiting, "stuck": stuck})
            self._store_op(lambda: self.store.set(f"health/waiting/{self.rank}", payload))
            self._published = key

    def _read(self, key: str) -> Optional[bytes]:
        def op():
            return self.store.get(key) if self.store.check([key]) else None
        return self._store_op(op)

    def host(self, rank: int) -> str:
        if rank not in self.hosts:
            try:
                raw = self._read(f"health/host/{rank}")
            except StoreTamperedError:
                return "unknown host (its store record failed authentication)"
            except Exception:  # the store went away with the job (rank 0 hosted it)
                return "unknown host"
            if raw is None:
                return "unknown host"
            self.hosts[rank] = raw.decode()
        return self.hosts[rank]

    def _counters(self) -> Dict[int, int]:
        return self._counters_of(range(self.size))

    def _counters_of(self, ranks) -> Dict[int, int]:
        return {r: self._store_op(lambda r=r: self.store.add(f"health/hb/{r}", 0))
                for r in ranks}

    def _inspect(self) -> None:
        now = time.monotonic()
        for r, count in self._counters().items():
            last = self._beats.get(r)
            if last is not None and count < last[0] and r not in self._warned_reset:
                # Counters only grow: the record was removed (a client of the store
                # that is not the job's can delete keys, see docs/security.md).
                self._warned_reset.add(r)
                logger.warning("the heartbeat record of rank %d went back from %d to %d: "
                               "something other than the job removed it from the store; "
                               "silence of that rank is no longer reported", r, last[0], count)
            if r in self._warned_reset or r == self.rank:
                continue  # its own beats say nothing about this process
            if last is None or last[0] != count:
                self._beats[r] = (count, now)
                self._warned_silent.discard(r)
            elif now - last[1] > max(5.0, 5 * self.interval) and r not in self._warned_silent:
                self._warned_silent.add(r)
                logger.warning("rank %d on %s has not shown signs of life for %.0fs "
                               "(stopped, hung or dead?)", r, self.host(r), now - last[1])
        if not self.stall_enabled and self.deadlock_after <= 0:
            return
        records = self._records()
        if self.deadlock_after > 0:
            self._check_deadlock(records, now)
        if not self.stall_enabled:
            return
        report = self.stall_report(records)
        if not report:
            return
        longest, text = report
        if longest >= self.cfg.stall_check_time_seconds and \
                now - self._last_stall_report >= self.cfg.stall_check_time_seconds:
            self._last_stall_report = now
            logger.warning("%s", text)
        limit = self.shutdown_seconds
        if limit > 0 and longest >= limit and not self._aborted:
            message = (f"stalled for {longest:.0f}s ({self._shutdown_name}={limit:g}); "
                       f"shutting down every rank.\n{text}")
            self._store_op(lambda: self.store.set("health/abort", message))

    def _records(self) -> Dict[int, dict]:
        """Every rank's published record (ranks that published none are left out)."""
        found = {}
        for r in range(self.size):
            raw = self._read(f"health/waiting/{r}")
            if raw:
                found[r] = json.loads(raw)
        return found

    def _check_deadlock(self, records: Dict[int, dict], now: float) -> None:
        stuck, since = {}, {}
        for r, record in records.items():
            mark = record.get("stuck")
            if not mark:
                self._stuck_seen.pop(r, None)
                continue
            seen = self._stuck_seen.get(r)
            if seen is None or seen[0] != mark["id"]:
                # The age is published once per episode; convert it to our clock.
                seen = self._stuck_seen[r] = (mark["id"], now - mark["age"])
            stuck[r] = [(int(s), n, bool(j)) for s, n, j in mark["pending"]]
            since[r] = seen[1]
        if not stuck or self._aborted:
            return
        ranks = deadlock.find_deadlock(stuck, self._members)
        if not ranks:
            return
        waited = min(now - since[r] for r in ranks)
        if waited < self.deadlock_after:
            return
        message = deadlock.describe(ranks, stuck, self._members, self.host, waited,
                                   self.deadlock_after)
        self._store_op(lambda: self.store.set("health/abort", message))

    def stall_report(self, records: Optional[Dict[int, dict]] = None):
        """``(longest wait, text)`` naming stalled tensors and missing ranks, or None.

        Two sources: every rank's record of what it submitted and waits on,
        and what this rank's coordinators actually received. They differ only
        when a rank's requests do not match its own record (a rank that lies,
        or renames its collectives): a name the coordinator holds that no rank
        reports waiting on is listed too, with the ranks that requested it."""
        names: Dict[tuple, List[int]] = {}  # (process set id, name) -> ranks waiting
        now = time.monotonic()
        records = self._records() if records is None else records
        for r, record in records.items():
            for set_id, name, seconds in record.get("waiting", []):
                name = (set_id, name)
                names.setdefault(name, []).append(r)
                # Ages are published once per name; convert to our own clock.
                since = self._since.get(name, now)
                self._since[name] = min(since, now - seconds)
        unclaimed: Dict[tuple, List[int]] = {}  # held by a coordinator, waited on by no rank
        half = self.cfg.stall_check_time_seconds / 2.0
        for key, (seconds, missing) in self._coordinated().items():
            if key in names or seconds < half:
                continue
            unclaimed[key] = missing
            self._since[key] = min(self._since.get(key, now), now - seconds)
        for name in list(self._since):
            if name not in names and name not in unclaimed:
                del self._since[name]
        longest = {name: now - since for name, since in self._since.items()}
        stalled = sorted([n for n in names if len(names[n]) < len(self._members(n[0]))]
                         + list(unclaimed), key=lambda n: -longest[n])
        if not stalled:
            return None
        lines = ["stall: some ranks submitted collectives that others have not:"]
        for key in stalled[:MAX_NAMES]:
            set_id, name = key
            members = self._members(set_id)
            if key in unclaimed:
                missing = unclaimed[key]
                senders = [r for r in members if r not in missing]
                note = (f" (requested by rank(s) {', '.join(map(str, senders))}, "
                        f"which report no wait on that name)")
            else:
                missing = [r for r in members if r not in names[key]]
                note = ""
            where = ", ".join(f"{r} ({self.host(r)})" for r in missing)
            label = f"{name!r}" + (f" (process set {set_id})" if set_id else "")
            lines.append(f"  {label}: waited {longest[key]:.0f}s; missing rank(s) {where}{note}")
        if len(stalled) > MAX_NAMES:
            lines.append(f"  ... and {len(stalled) - MAX_NAMES} more")
        return longest[stalled[0]], "\n".join(lines)

    # -- going away -------------------------------------------------------------------

    def announce(self, reason: str) -> None:
        """Leave word in the store of why this rank is going away."""
        try:
            self._store_op(lambda: self.store.set(f"health/shutdown/{self.rank}", reason))
        except Exception:  # the store is gone too: peers will see a dead rank
            pass

    def announcements(self) -> Dict[int, str]:
        """``{rank: reason}`` of every rank that announced it is going away."""
        found = {}
        for r in range(self.size):
            raw = self._read(f"health/shutdown/{r}")
            if raw is not None:
                found[r] = raw.decode()
        return found

    # -- diagnosis after a failure ---------------------------------------------------

    def diagnose(self, wait: Optional[float] = None, poll: float = 0.05) -> str:
        """Name the peers that are gone; '' if every peer still looks alive.

        A peer is gone when it left word in the store (its own reason, a clean
        shut down, or -- in an elastic job -- how the launcher saw it end) or
        when its heartbeat does not move for ``wait`` seconds (2.5 heartbeat
        intervals). The store is polled: the answer comes as soon as a peer
        is named or every other peer has beaten again, so a lost rank the
        launcher already reported is named within a poll, not after ``wait``.
        """
        wait = 2.5 * self.interval if wait is None else wait
        try:
            before = self._counters()
            deadline = time.monotonic() + wait
            while True:
                time.sleep(poll)
                after = self._counters()
                peers = [r for r in range(self.size) if r != self.rank]
                quiet = [r for r in peers if after[r] == before[r]]
                words = {r: self._word(r) for r in quiet}
                named = [r for r in quiet if words[r] is not None]
                if named or not quiet or time.monotonic() >= deadline:
                    break
        except StoreTamperedError as exc:
            return str(exc)
        except Exception as exc:
            return (f"the rendezvous store is unreachable ({exc}); the launcher, or rank 0 "
                    f"if it hosted the store, is gone")
        if named and time.monotonic() < deadline:
            quiet = named  # the others have not missed a beat yet: no reason to name them
        parts = []
        for r in quiet:
            try:
                host = self.host(r)
            except Exception:
                host = "unknown host"
            parts.append(f"rank {r} on {host} {words[r] or 'died or stopped responding'}")
        return "; ".join(parts)

    def watch(self) -> Callable[[Sequence[int]], str]:
        """A probe for one wait on other ranks (see :mod:`.store_wait`):
        ``probe(ranks)`` names those that are gone (see :meth:`_departures`),
        '' while all look alive."""
        departed = self._departures()

        def probe(ranks: Sequence[int]) -> str:
            try:
                found = departed(ranks)
            except StoreTamperedError as exc:
                return str(exc)
            except Exception:  # the store is unreachable: the lost-store check reports it
                return ""
            return "; ".join(f"rank {r} on {self.host(r)} {why}" for r, why in found.items())

        return probe

    def _word(self, rank: int) -> Optional[str]:
        """What ``rank`` (or the launcher, for it) left in the store about its end, if anything."""
        return self._store_op(lambda: word_of(self.store, rank, self._exits))
