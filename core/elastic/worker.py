"""The rank's side of re-rendezvous: notice new generations, re-form into them.

One :class:`WorkerContext` per process (created on first use) keeps its own
connection to the job's store, separate from the runtime's: the runtime is
shut down and rebuilt on every re-form, this connection is not.

Anybody who reaches the store can delete a key or write back a value read
earlier under the same key, without any secret. Neither may pass for the
launcher's word: a process whose seat was deleted is not "left out" (the
generation's roster still lists it), and ``elastic/latest`` never goes
backwards. Either raises :class:`ElasticStoreTampered`, and from then on the
process trusts nothing more from the store (every later wait raises it again):
it fails, and the launcher sees a member fail instead of one completing the
job, or a job waiting in silence for a generation it was made to miss.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, List, MutableMapping, Optional

from hvdlike.core.errors import HvdlikeInternalError
from hvdlike.core.log import logger
from hvdlike.core.store_auth import StoreTamperedError

from . import protocol

_POLL_SECONDS = 0.05
# How long a rank waits for the launcher's next generation when the
# launcher did not say (it passes its --elastic-timeout plus a margin).
DEFAULT_WAIT_SECONDS = 660.0
# The start timeout when the job's knob cannot be read (the knob's default).
DEFAULT_START_SECONDS = 60.0


def _start_timeout(environ) -> float:
    """The job's start timeout (``--start-timeout``, ``HVDLIKE_START_TIMEOUT``): how
    long a member waits for the others of its generation before it reports the
    missing ones to the launcher, as a static job's ranks wait for each other."""
    from hvdlike.core import config
    from hvdlike.core.errors import ConfigError

    try:
        return config.load(environ).start_timeout
    except ConfigError:  # init() itself reports the bad value right after
        return DEFAULT_START_SECONDS


class ElasticStoreTampered(StoreTamperedError):
    """A record of the elastic protocol was deleted, or an older value of it written
    back, by someone who reaches the job's store (neither needs the job secret)."""

    def __init__(self, key: str, why: str):
        HvdlikeInternalError.__init__(
            self, f"the rendezvous store was tampered with: key {key!r} {why}")
        self.key = key


class WorkerContext:
    """This process's membership in an elastic job."""

    def __init__(self, environ: Optional[MutableMapping[str, str]] = None,
                 connect: Optional[Callable[[], object]] = None):
        self.environ = os.environ if environ is None else environ
        self.worker = self.environ.get(protocol.ENV_WORKER, "")
        self.generation = int(self.environ.get(protocol.ENV_GENERATION, "0") or 0)
        self.wait_seconds = float(self.environ.get(protocol.ENV_TIMEOUT, DEFAULT_WAIT_SECONDS))
        self.start_seconds = _start_timeout(self.environ)
        self.worker_secret = self.environ.get(protocol.ENV_WORKER_SECRET, "")
        self._connect = connect or self._connect_job_store
        self._store = None
        self._job_store = None
        self._keys = {}  # generation number -> its key (generations this process was in)
        self._tamper_reported = False
        # The newest generation this process knows was published: the one it was
        # started for, then every one it read in elastic/latest or joined. The
        # launcher writes elastic/latest before it starts a generation's processes
        # and only ever raises it: a lower value is an old record written back.
        self.newest = self.generation
        # Once set, raised by every later look at the store (see the module's doc).
        self.tampered: Optional[StoreTamperedError] = None

    @property
    def enabled(self) -> bool:
        """True when the launcher runs this job elastically."""
        return bool(self.worker)

    def _connect_job_store(self):
        from hvdlike.core import bootstrap
        from hvdlike.core.job_store import JobStore

        topology, rendezvous = bootstrap.detect(self.environ)
        self._job_store = JobStore(topology, rendezvous, 60.0)  # keeps its views alive
        return self._job_store.connect()

    @property
    def store(self):
        if self._store is None:
            self._store = self._connect()
        return self._store

    def latest(self) -> int:
        """The newest generation the launcher has published (this one if none newer).

        Raises:
            StoreTamperedError: ``elastic/latest`` holds a value the launcher did not
                sign, or went backwards (:class:`ElasticStoreTampered`); so does every
                call after such a one.
        """
        if self.tampered is not None:
            raise self.tampered
        if not self.enabled:
            return self.generation
        if not self.store.check([protocol.LATEST_KEY]):
            # Deleted (the launcher puts it back), or, where the launcher's part is
            # played by hand, not written yet: nothing newer than what is known.
            return self.newest
        try:
            value = int(self.store.get(protocol.LATEST_KEY).decode())
        except StoreTamperedError as exc:
            self.tampered = exc
            raise
        if value < self.newest:
            self.tampered = ElasticStoreTampered(
                protocol.LATEST_KEY,
                f"went back from generation {self.newest} to {value}: an old record was "
                "written back by a process without the job's secret (the launcher only "
                f"ever announces newer generations); elastic worker {self.worker} stops "
                "instead of waiting for generations it would not see")
            raise self.tampered
        self.newest = value
        return value

    def finished(self) -> Optional[str]:
        """The worker id of a rank of this generation that completed the job, once
        one has (else None).

        The launcher's record is MACed with this generation's key, so a process
        left out of it cannot make the members leave: a record that fails the
        check is reported once and otherwise ignored.
        """
        if not self.enabled:
            return None
        key = protocol.finished_key(self.generation)
        view = self.view(self.generation)
        if view is None or not view.check([key]):
            return None
        try:
            return view.get(key).decode(errors="replace")
        except StoreTamperedError as exc:
            if not self._tamper_reported:
                self._tamper_reported = True
                logger.warning("elastic worker %s: ignoring %s", self.worker, exc)
            return None

    def key(self, number: int) -> Optional[bytes]:
        """Generation ``number``'s key, unsealed with this process's secret; None when
        the launcher gave no secret (no per-generation keys) or this process has no
        seat in that generation.

        Raises:
            StoreTamperedError: the seat was not sealed for this process.
        """
        if not self.worker_secret:
            return None
        if number not in self._keys:
            seat = protocol.seat_key(number, self.worker)
            deadline = time.monotonic() + self.wait_seconds
            while not self.store.check([seat]):
                # Seats are written before the generation is announced as latest:
                # once it is, no seat means none for this process.
                if self.latest() >= number or time.monotonic() > deadline:
                    return None
                time.sleep(_POLL_SECONDS)
            self._keys[number] = protocol.open_key(self.worker_secret, number, self.worker,
                                                   self.store.get(seat))
        return self._keys[number]

    def view(self, number: int):
        """The store as generation ``number`` sees it (MACed with its key), or None
        when this process has no seat in it."""
        if not self.worker_secret:
            return self.store
        key = self.key(number)
        return None if key is None else self.store.for_generation(key)

    def read(self, number: int) -> protocol.Generation:
        """Generation ``number``'s member table (empty when this process has no seat:
        it is not a member, and cannot read the table -- or its seat was deleted:
        ask :meth:`left_out` before leaving)."""
        view = self.view(number)
        if view is None:
            return protocol.Generation(number, {})
        return protocol.Generation.decode(view.get(protocol.generation_key(number)))

    def left_out(self, number: int) -> bool:
        """Whether the launcher left this process out of generation ``number``, in
        which it found no place: True, it leaves (status 0); False, a newer
        generation was published meanwhile (``number``, forgotten since, may have
        taken its roster along): look at the newest one instead.

        A missing seat alone cannot tell: anybody who reaches the store can delete
        a key. The generation's roster (``elastic/g<N>/roster``, signed with the
        job secret, deleted before the seats when the generation is forgotten) can.

        Raises:
            ElasticStoreTampered: the roster lists this process, whose seat is gone;
                or the roster is gone while ``number`` is still the newest
                generation. Either was deleted by someone else; leaving with status
                0 would end the job as if this process had completed it.
            StoreTamperedError: the roster was not signed with the job secret.
        """
        if not self.worker_secret:
            return True  # no seats: the member table itself said so
        seat = protocol.seat_key(number, self.worker)
        roster_key = protocol.roster_key(number)
        try:
            roster = protocol.read_roster(self.store, number)
        except StoreTamperedError as exc:
            self.tampered = exc
            raise
        if roster is not None and self.worker not in roster:
            return True
        if roster is None and self.latest() > number:
            return False
        if roster is not None:
            key, why = seat, (f"(this process's seat in generation {number}) was deleted, "
                              f"though the generation's roster ({roster_key!r}) lists this "
                              "process as a member")
        else:
            key, why = roster_key, (f"(generation {number}'s roster) was deleted while "
                                    f"generation {number} is the newest one published, and "
                                    f"this process's seat in it ({seat!r}) with it")
        self.tampered = ElasticStoreTampered(
            key, f"{why}: someone who reaches the job's store removed it (that needs no "
            f"secret); elastic worker {self.worker} fails rather than leave as a process "
            "left out of the job, which would let the job end as if it had completed")
        raise self.tampered

    def wait_for_newer(self, clock: Callable[[], float] = time.monotonic,
                       sleep: Callable[[float], None] = time.sleep
                       ) -> Optional[protocol.Generation]:
        """Block until a generation newer than ours is published; return it.

        Returns None once the job is finishing instead (a rank completed it:
        the launcher publishes no further generation).

        Raises:
            HvdlikeInternalError: none came within the wait (the launcher is gone
                or could not find enough hosts).
        """
        deadline = clock() + self.wait_seconds
        while True:
            try:
                if self.finished() is not None:
                    return None
                latest = self.latest()
            except StoreTamperedError:
                raise  # the store answers, but with something nobody may act on
            except Exception as exc:  # the launcher (and its store) went away
                raise HvdlikeInternalError(
                    f"elastic worker {self.worker}: lost the launcher's store while waiting "
                    f"for a new generation: {exc}") from None
            if latest > self.generation:
                return self.read(latest)
            if clock() > deadline:
                raise HvdlikeInternalError(
                    f"elastic worker {self.worker}: no new generation after generation "
                    f"{self.generation} within {self.wait_seconds:g}s (latest published: "
                    f"{latest})")
            sleep(_POLL_SECONDS)

    def enter(self, clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep,
              start_seconds: Optional[float] = None) -> None:
        """Announce this process in its generation; wait until every member has.

        Members start at different speeds (a new process imports torch, a
        survivor only re-initializes), so the generation's groups are built only
        once all are present; the Gloo timeout then bounds the build itself.
        When the launcher supersedes the generation meanwhile (a member died on
        its way in), move on to the newest one.

        Members still missing after the start timeout are reported to the
        launcher (:meth:`_report_late`), which stops those that never arrived
        anywhere and publishes a generation without them: this process is the
        healthy one and goes on waiting, to move on to that generation. It fails
        only when nothing has changed within the longer elastic wait.

        Raises:
            HvdlikeInternalError: the members did not all arrive, and the launcher
                published no other generation, within the elastic wait.
            ElasticStoreTampered: this process's seat was deleted (see :meth:`left_out`).
            SystemExit: the newest generation leaves this process out (status 0).
        """
        if start_seconds is not None:  # init(start_timeout=...), kept for later re-forms
            self.start_seconds = start_seconds
        deadline = clock() + self.wait_seconds
        while True:
            latest = self.latest()
            if latest > self.generation:  # superseded before this process got here
                if not self._move_to(latest):
                    continue  # and again meanwhile: look at the newest
            number = self.generation
            members = self.read(number).members
            if self.worker not in members:
                self.leave_if_left_out(number)
                continue  # superseded meanwhile: the newest one may have a place
            view = self.view(number)
            view.set(protocol.ready_key(number, self.worker), b"1")
            keys = [protocol.ready_key(number, w) for w in members]
            report_at, reported = clock() + self.start_seconds, False
            while not self.store.check(keys):
                latest = self.latest()
                if latest > number:
                    break
                if self.finished() is not None:
                    # A rank completed the job before this generation formed (the
                    # others finished in the one before): nobody else will come.
                    logger.warning("elastic worker %s: the job was completed before "
                                   "generation %d formed; leaving", self.worker, number)
                    raise SystemExit(0)
                if not reported and clock() > report_at:
                    reported = self._report_late(number, members, view)
                if clock() > deadline:
                    missing = self._missing(number, members)
                    raise HvdlikeInternalError(
                        f"elastic worker {self.worker}: generation {number} members "
                        f"{', '.join(missing)} did not arrive within {self.wait_seconds:g}s")
                sleep(_POLL_SECONDS)
            else:
                for key in keys:  # present is not enough: each must be a member's own
                    view.get(key)
                self._forget_older(number)
                return
            self._move_to(latest)

    def _missing(self, number: int, members) -> List[str]:
        """The members of generation ``number`` that have not announced themselves."""
        return [w for w in members if not self.store.check([protocol.ready_key(number, w)])]

    def _report_late(self, number: int, members, view) -> bool:
        """Tell the launcher which members of generation ``number`` did not arrive
        within the start timeout; True once reported.

        Written through the generation's view (MACed with its key), so nobody
        outside the generation can name its members late. The launcher checks
        the claim against the members' own ready marks before it acts.
        """
        missing = self._missing(number, members)
        if not missing:
            return False
        protocol.report_late(view, number, protocol.LateReport(self.worker, missing,
                                                               self.start_seconds))
        logger.warning("elastic worker %s: generation %d member(s) %s did not arrive within "
                       "%gs (the start timeout); reported them to the launcher, which stops "
                       "those that never arrived and re-forms without them", self.worker, number,
                       ", ".join(missing), self.start_seconds)
        return True

    def _move_to(self, number: int) -> bool:
        """Take this process's place in generation ``number``, newer than its own;
        False when it has none there because a newer one superseded it meanwhile.

        Raises:
            SystemExit: the launcher left this process out (status 0).
            ElasticStoreTampered: its seat there was deleted.
        """
        if self.join(self.read(number)):
            return True
        self.leave_if_left_out(number)
        return False

    def leave_if_left_out(self, number: int) -> None:
        """Having found no place in generation ``number``: leave (status 0) when
        the launcher left this process out; return when a newer generation
        superseded it meanwhile (the caller looks at the newest).

        Raises:
            SystemExit: left out.
            ElasticStoreTampered: its seat there was deleted (see :meth:`left_out`).
        """
        if self.left_out(number):
            logger.info("elastic worker %s is not part of generation %d; leaving",
                        self.worker, number)
            raise SystemExit(0)

    def _forget_older(self, number: int) -> None:
        """Rank 0 of a generation every member has entered deletes the earlier
        generations' keys (nobody uses them any more), newest first, down to the
        first one already gone."""
        from hvdlike.core import bootstrap

        if self.environ.get(bootstrap.ENV_RANK) != "0":
            return
        older = number - 1
        try:
            while older >= 1 and protocol.forget_generation(self.store, older,
                                                            self.view(older)):
                self._keys.pop(older, None)
                older -= 1
        except Exception as exc:  # tidiness only: never fail a re-form over it
            logger.debug("keys of generation %d left in the store: %s", older, exc)

    def join(self, generation: protocol.Generation) -> bool:
        """Take this process's place in ``generation``; False if it is not a member."""
        topology = generation.topology_of(self.worker)
        self.generation = generation.number
        self.newest = max(self.newest, generation.number)
        if topology is None:
            return False
        self.environ.update(protocol.rank_variables(topology, generation.number))
        return True


def generation_key(environ) -> Optional[bytes]:
    """The key of the generation an elastic runtime starting from ``environ`` joins
    (None outside elastic jobs, or without per-generation keys)."""
    if not environ.get(protocol.ENV_WORKER):
        return None
    ctx = context()
    if ctx.environ is not environ:
        ctx = WorkerContext(environ)
    return ctx.key(int(environ.get(protocol.ENV_GENERATION, "0") or 0))


def enter_generation(environ, start_seconds: Optional[float] = None) -> None:
    """Called by every ``init()``: in an elastic job, wait for the generation's
    members (see :meth:`WorkerContext.enter`); otherwise do nothing.

    ``start_seconds``: the runtime's start timeout (``init(start_timeout=...)``
    or the environment's); members missing after it are reported.
    """
    if not environ.get(protocol.ENV_WORKER):
        return
    ctx = context()
    if ctx.environ is not environ:  # a runtime started from an explicit environment
        ctx = WorkerContext(environ)
    ctx.enter(start_seconds=start_seconds)


_context: Optional[WorkerContext] = None
_context_lock = threading.Lock()


def context() -> WorkerContext:
    """This process's :class:`WorkerContext` (built on first use)."""
    global _context
    with _context_lock:
        if _context is None:
            _context = WorkerContext()
        return _context


def reset(init: Callable[[], None], shutdown: Callable[[], None],
          ctx: Optional[WorkerContext] = None) -> None:
    """Leave the current generation and join the next one the launcher publishes.

    Shuts the runtime down, waits for a newer generation, re-initializes with the
    topology given there. A generation that fails to form (a member died while
    it was forming) is left for the next one. A process the launcher left out
    of the new generation exits with status 0: its host was removed. So does a
    process waiting when another rank has completed the job (as Horovod's
    driver stops the rest once one worker succeeded): no generation follows.

    Raises:
        HvdlikeInternalError: no newer generation came in time.
        StoreTamperedError: the store was tampered with (a seat deleted, an old
            ``elastic/latest`` written back, a forged record of the generation):
            waiting for another generation would not undo it.
    """
    ctx = ctx or context()
    shutdown()
    while True:
        generation = ctx.wait_for_newer()
        if generation is None:
            logger.warning("elastic worker %s: the job is finishing (worker %s completed it); "
                           "leaving instead of re-forming", ctx.worker, ctx.finished())
            raise SystemExit(0)
        if not ctx.join(generation):
            ctx.leave_if_left_out(generation.number)
            continue  # superseded meanwhile: the newest one may have a place
        try:
            init()
            return
        except HvdlikeInternalError as exc:
            if isinstance(exc, StoreTamperedError) or ctx.tampered is not None:
                # Not a member lost while forming: the launcher has no reason to
                # publish another generation, and the members would wait for it.
                shutdown()
                raise
            logger.warning("generation %d did not form (%s); waiting for the next one",
                           generation.number, exc)
            shutdown()
