"""The runtime object: one per ``init()``, owning everything that runs.

Module-level API functions (``hvdlike.rank()``, ``hvdlike.torch.allreduce``...)
delegate to the current :class:`Runtime` (held by :mod:`.current`, the only
process-wide state). A runtime owns the store connection, the process-set
registry (one :class:`~.set_state.ProcessSetState` per set: groups,
controller, executor, queue), the timeline slot, the live settings and the
autotuner, the health watcher, and the background thread that cycles
through the sets.

Life cycle: :meth:`Runtime.build` bootstraps and wires every part (the
global set's groups rendezvous here, static process sets are registered, a
configured timeline file is opened) without starting a thread;
:meth:`Runtime.start` starts the threads; :meth:`Runtime.shutdown` negotiates
the stop with every rank and :meth:`Runtime.close` frees everything. A
re-form is ``close()`` of the old runtime and ``build()``/``start()`` of a
new one with the next generation number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence

from . import agreement, autotune, bootstrap, config as config_mod, generation_keys, store_wait
from . import current as _current, world as world_mod
from .deadlock import Waits
from .errors import SHUT_DOWN, SHUT_DOWN_UNDER, ConfigError, HvdlikeError, HvdlikeInternalError
from .executor import CompletionHooks
from .handles import Handle, finish_many
from .health import Health, words_probe
from .job_store import JobStore
from .log import configure as configure_logging, logger
from .messages import OpType
from .process_sets import ProcessSet
from .registry import ProcessSetRegistry
from .set_state import ProcessSetState, SetParts
from .tensor_queue import Entry
from .timeline import Recording
from .topology import horovod_variables

# How long the teardown waits for a user thread's cycle to end (see Runtime._teardown).
_TEARDOWN_WAIT_SECONDS = 5.0
# How long a rank hosting the store (mpirun, srun) waits at a clean close for the
# other ranks to be done with it (see generation_keys.wait_closed).
_HOST_WAITS_SECONDS = 10.0
# Idle back-off of the background loop (see Runtime._loop).
_IDLE_CYCLES_BEFORE_BACKOFF = 8
_IDLE_PAUSE_MAX_SECONDS = 0.05
_SUBSET_POLL_SECONDS = 0.002


def _with_id(pset, set_id):
    pset.process_set_id = set_id
    return pset


def affinity_core(cores: str, topology) -> Optional[int]:
    """The core ``HVDLIKE_THREAD_AFFINITY`` gives this rank's background thread, or None.

    Fewer cores than local ranks is logged as an error and nothing is pinned (as
    Horovod does): the job runs, unpinned.

    Raises:
        ConfigError: the core of this local rank is one this process may not use.
    """
    if not cores:
        return None
    listed = [int(c) for c in cores.split(",")]
    if len(listed) < topology.local_size:
        logger.error("HVDLIKE_THREAD_AFFINITY=%r names %d core(s) for %d local ranks (one per "
                     "local rank is needed): the background thread is not pinned",
                     cores, len(listed), topology.local_size)
        return None
    core = listed[topology.local_rank]
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if allowed and core not in allowed:
        raise ConfigError(f"HVDLIKE_THREAD_AFFINITY={cores!r}: core {core} (local rank "
                          f"{topology.local_rank}) is not available to this process; it may "
                          f"use cores {allowed}")
    return core


class Runtime:
    """A live hvdlike job in this process (see the module docstring for its life cycle).

    Attributes:
        config: the frozen :class:`~.config.Config`.
        topology, rendezvous: who this rank is and where the store is.
        generation: this runtime's number in the process (names its store keys).
        sets: the :class:`~.registry.ProcessSetRegistry`.
        recording: the timeline slot (:class:`~.timeline.Recording`).
        settings: the live settings (:class:`~.autotune.LiveSettings`).
        autotuner: the :class:`~.autotune.Autotuner` while tuning, else None.
        engines: ``(negotiation, CPU tensors)`` engines, see ``mpi_plane.choose``.
    """

    def __init__(self, cfg: config_mod.Config, topology: bootstrap.Topology,
                 rendezvous: bootstrap.Rendezvous, generation: int = 1):
        self.config = cfg
        self.topology = topology
        self.rendezvous = rendezvous
        self.generation = generation
        self.fatal: Optional[BaseException] = None
        self._stopping = False
        self._flush = threading.Event()  # a user thread waits on a pending handle
        # Held by whichever thread runs a negotiation cycle: the background
        # thread, or a user thread blocked on a handle (see wait()).
        self._cycle_lock = threading.Lock()
        self._last_cycle = 0.0  # when the last cycle (any thread's) ended
        self._agreed_stop = False  # a user thread's cycle agreed on the shutdown
        self._callers = 0  # user threads in _cycle_until (the background thread keeps still)
        # .held: this thread is inside cycles_here(); .cycling: it runs a cycle now
        self._here = threading.local()
        self.forked = False  # this is a forked child's copy (see forked_child)
        self.pid = os.getpid()
        self.waits = Waits()  # user threads blocked in wait(), for the deadlock check
        self._stopped = threading.Event()
        self._stop_error: Optional[HvdlikeInternalError] = None
        self._closed = False
        self._close_lock = threading.Lock()  # close() from a closing thread and at exit
        self._thread: Optional[threading.Thread] = None
        self._counters: Dict[str, int] = {}
        self._counter_lock = threading.Lock()
        self.handle_lock = threading.Lock()  # shared by every handle of this runtime
        self.ran_here = 0  # collectives whose cycle run() started on the caller's thread
        self.engines = ("gloo", "gloo")
        self.mpi_world = None
        self.shm = None  # shm_plane.Settings when ranks of this host may share memory
        self.job_store: Optional[JobStore] = None
        self.world_tag = ""  # init(comm=[ranks]) outside mpirun: that list's key namespace
        # Keys narrowing to that list wrote under this generation's prefix (its
        # own connection): deleted with the keys the runtime writes itself.
        self.world_keys: List[str] = []
        self.affinity_core: Optional[int] = None  # HVDLIKE_THREAD_AFFINITY's core for this rank
        self.store_prefix = f"gen{generation}/"
        self.store = None  # the generation's keys, written through a KeyLog
        self._key_logs: List[generation_keys.KeyLog] = []
        self.local_addr = ""
        self.health: Optional[Health] = None
        self.settings = autotune.LiveSettings(cfg.fusion_threshold, cfg.cycle_time,
                                              cfg.disable_group_fusion)
        self.autotuner: Optional[autotune.Autotuner] = None
        self.recording = Recording(topology.rank, cfg.timeline_max_bytes)
        self.hooks = CompletionHooks(self._complete, self._complete_many, self._explain)
        self.sets: Optional[ProcessSetRegistry] = None
        self.overrides: Dict[str, object] = {}  # init()'s knob arguments
        self.tuned = None  # the autotuner's settled Candidate, once it settled

    # -- life cycle --------------------------------------------------------------

    @classmethod
    def build(cls, environ: Optional[Mapping[str, str]] = None, process_sets=(),
              generation: int = 1, carried=None, world=None, **overrides) -> "Runtime":
        """Bootstrap from ``environ`` and wire every part; no thread runs yet.

        Collective: every rank builds its runtime at the same point (the global
        set's groups rendezvous, ``process_sets`` are checked across ranks).

        Args:
            environ: the environment (default ``os.environ``).
            process_sets: :class:`~.process_sets.ProcessSet` objects to register
                (the same on every rank); their ids are set.
            generation: this runtime's number in the process; successive
                runtimes of a job must use increasing numbers (their store keys
                live apart under ``gen<N>/``).
            carried: what an elastic re-form carries over from the previous
                runtime (:class:`~.elastic.carry.Carry`): timeline, tuning.
            world: ``init(comm=...)``'s :class:`~.world.World`: run on those
                launched ranks only, renumbered (None: every launched rank).
            **overrides: knob values by config field name.

        Raises:
            ConfigError: a bad knob value.
            ValueError: ``world`` does not fit the launched job, or its members
                passed different lists.
            HvdlikeInternalError: the other ranks could not be reached.
        """
        environ = os.environ if environ is None else environ
        from .elastic.protocol import ENV_WORKER
        from .elastic.worker import enter_generation

        if world is not None and environ.get(ENV_WORKER):
            raise HvdlikeError("init(comm=...) cannot be used in an elastic job: its ranks "
                               "come and go; use process sets")
        cfg = config_mod.load(environ, **overrides)
        enter_generation(environ, cfg.start_timeout)  # elastic: all members present
        topology, rendezvous = bootstrap.detect(environ, cfg.start_timeout, world)
        job_store, world_tag, world_keys = None, "", []
        if world is not None and rendezvous.mpi_comm is None:
            # Not narrowed by an MPI bootstrap: renumber through the job's store.
            if world.comm is not None:
                raise ValueError("init: comm is an MPI communicator, but this process was not "
                                 f"started by mpirun ({rendezvous.launcher}); pass a list "
                                 "of ranks instead")
            if world.ranks != list(range(topology.size)):
                job_store = JobStore(topology, rendezvous, cfg.start_timeout)
                job_store.keep_server = True
                launched = topology.rank
                try:
                    topology = world_mod.narrow(job_store.connect(), world, topology,
                                                generation, cfg.start_timeout)
                except BaseException:
                    job_store.close()
                    raise
                world_tag = world.tag()
                world_keys = [world_mod.host_record(launched)]
        configure_logging(cfg.log_level_number, topology.rank, cfg.log_hide_time)
        core = affinity_core(cfg.thread_affinity, topology)
        runtime = cls(cfg, topology, rendezvous, generation)
        runtime.affinity_core = core
        runtime.overrides = dict(overrides)
        runtime.job_store, runtime.world_tag = job_store, world_tag
        runtime.world_keys = world_keys
        try:
            runtime._wire(environ, list(process_sets or ()), carried)
        except BaseException:
            runtime.close()
            raise
        if environ is os.environ:
            # Whatever launched the process (mpirun, srun, torchrun, an elastic
            # re-form), scripts reading HOROVOD_RANK & co. see this runtime's place.
            os.environ.update(horovod_variables(topology))
        return runtime

    def _wire(self, environ: Mapping[str, str], process_sets: list, carried=None) -> None:
        from . import mpi_plane, shm_plane
        from .elastic.protocol import ENV_GENERATION, ENV_WORKER, store_prefix

        cfg, topology, rendezvous = self.config, self.topology, self.rendezvous
        # elastic: the launcher's generation names the keys, else this runtime's.
        self.store_prefix = self.world_tag + store_prefix(environ, self.generation)
        narrowed = self.job_store is not None  # init(comm=[ranks]): made by build()
        if not narrowed:
            self.job_store = JobStore(topology, rendezvous, cfg.start_timeout)
        from .elastic.worker import generation_key

        self.job_store.generation_key = generation_key(environ)  # elastic: this generation's
        self.store = self._logged_store()
        for key in self.world_keys:
            self.store.note(key)
        agreement.check(self.store, self.store_prefix, topology.rank, topology.size, cfg,
                        cfg.start_timeout, self._watch_peers(), lambda: self.fatal)
        if (rendezvous.launcher == "torchrun" and not narrowed
                and topology.local_size < topology.size):
            # Several nodes, whose rank counts torchrun does not tell: ask them.
            topology = self.topology = world_mod.regroup(
                self.store, self.store_prefix, topology, topology.cross_rank,
                cfg.start_timeout, lambda: self.fatal, self._watch_peers())
        local_addr = rendezvous.gloo_iface
        if not local_addr:
            local_addr = (bootstrap.local_address_towards(rendezvous.addr, rendezvous.port)
                          if rendezvous.addr else "127.0.0.1")
        self.local_addr = local_addr
        self.engines = mpi_plane.choose(cfg.controller, cfg.cpu_operations,
                                        rendezvous.launcher, topology.rank, topology.size,
                                        environ, rendezvous.mpi_comm,
                                        cfg.mpi_threads_disable)
        if "mpi" in self.engines:
            self.mpi_world = mpi_plane.duplicate_world(rendezvous.mpi_comm)
        self.shm = shm_plane.settings(cfg, topology, rendezvous)
        # The host key: the shared-memory plane's, else the host as the launcher names it.
        host = (self.shm.host if self.shm is not None
                else f"{topology.hostname}|{shm_plane.boot_id()}")
        parts = SetParts(topology.rank, self.store, cfg, local_addr, self.engines,
                         self.mpi_world, self.shm, self.hooks, self.settings, self.recording,
                         lambda: self.fatal, self._watch_peers, host)
        self.sets = ProcessSetRegistry(topology.size, parts, self.submit, self.wait,
                                       self.alive_error, self._forget_set)
        try:
            self.sets.register_global()
            if not narrowed:  # other lists' ranks may not have read a shared secret yet
                self.job_store.joined()
        except Exception as exc:
            raise HvdlikeInternalError(
                f"rank {topology.rank} could not connect to the other {topology.size - 1} "
                f"rank(s) (Gloo on {local_addr or 'default interface'}): {exc}") from None
        # Static sets are live from the first cycle on every rank: registered
        # before the background thread starts cycling.
        if any(getattr(p, "mpi_comm", None) is not None for p in process_sets):
            self._register_comm_sets(process_sets)
        else:
            self.sets.register_static(process_sets, elastic=bool(environ.get(ENV_WORKER)))
        if cfg.autotune:
            broadcast = self.sets.states[0].controller.control.broadcast
            self.autotuner = autotune.build(cfg, topology.rank, broadcast, self.settings)
            if environ.get(ENV_WORKER):
                self._agree_tuning(broadcast, carried)
        if carried is not None and carried.timeline_request is not None:
            self.recording.adopt(carried.timeline_request, carried.timeline,
                                  int(environ.get(ENV_GENERATION, "0") or 0))
        elif cfg.timeline:
            try:
                self.recording.open(cfg.timeline, cfg.timeline_mark_cycles)
            except ValueError as exc:  # say which setting, not start_timeline()
                reason = str(exc).replace("start_timeline: ", "", 1)
                raise ConfigError(f"HVDLIKE_TIMELINE={cfg.timeline!r} (or HOROVOD_TIMELINE, "
                                  f"--timeline-filename): {reason}") from None

    def _register_comm_sets(self, process_sets: list) -> None:
        """``init(process_sets=...)`` with sets made from MPI communicators."""
        base, launcher = self.rendezvous.mpi_comm, self.rendezvous.launcher
        if base is None and launcher.startswith("mpirun"):
            from . import mpi_plane

            base = mpi_plane.world_comm()
        control = self.sets.states[0].controller.control
        from_comms = world_mod.resolve_comm_sets(
            process_sets, base, f"this job was started by {launcher}, not mpirun", control)
        self.sets.register_static([_with_id(ProcessSet(ranks), had)
                                   for ranks, had in from_comms]
                                  + [p for p in process_sets
                                     if getattr(p, "mpi_comm", None) is None])
        by_ranks = {tuple(ranks): set_id for set_id, ranks in self.sets.ranks.items()}
        for pset in process_sets:
            if pset.mpi_comm is not None and pset.ranks is not None:
                pset.process_set_id = by_ranks[tuple(pset.ranks)]

    def _agree_tuning(self, broadcast, carried) -> None:
        """Elastic jobs: every rank takes rank 0's tuning from the previous generation.

        Rank 0 is a survivor whenever there is one. A settled result is kept
        (no rank tunes again); a search in progress goes on from rank 0's
        current candidate (rank 0 keeps its samples). Newcomers follow.
        """
        payload = b"-"  # nothing carried (an empty payload cannot be broadcast)
        if self.topology.rank == 0 and carried is not None and carried.tuning is not None:
            candidate, settled, _ = carried.tuning
            payload = candidate.encode(settled)
        payload = broadcast(payload)
        if payload == b"-":
            return
        candidate, settled = autotune.Candidate.decode(payload)
        self.settings.apply(candidate)
        if settled:
            self.autotuner, self.tuned = None, candidate
            return
        self.autotuner.current = candidate
        search = carried.tuning[2] if carried is not None and carried.tuning else None
        if self.topology.rank == 0 and search is not None:
            self.autotuner.search = search

    def start(self) -> "Runtime":
        """Start the threads: health watcher, completion threads, timeline writer,
        background loop. Returns the runtime."""
        if self._thread is not None:
            raise HvdlikeInternalError("this runtime was started already")
        cfg, topology = self.config, self.topology
        if topology.size > 1:
            health_store = self._logged_store()
            self.health = Health(health_store, topology.rank, topology.size,
                                 topology.hostname, cfg, self.sets.waiting_since,
                                 self._set_fatal, self.sets.members,
                                 self.waits.blocked_since, self.sets.joins,
                                 store_lost=self._store_lost,
                                 exits=self._launcher_exits(health_store),
                                 coordinated=self.sets.coordinated)
        self.sets.start()
        self.recording.start()
        if topology.rank == 0:
            logger.info("hvdlike started: %d rank(s), launcher %s, settings:\n%s",
                        topology.size, self.rendezvous.launcher, cfg.describe())
        self._thread = threading.Thread(target=self._loop, name="hvdlike-background",
                                        daemon=True)
        self._thread.start()
        return self

    def _logged_store(self) -> generation_keys.KeyLog:
        """A new connection to this generation's keys, remembering those written."""
        publish = None
        if self.store_prefix.startswith("elastic"):  # see elastic/protocol.key_list
            from .elastic.protocol import key_list

            publish = key_list(self.topology.rank, len(self._key_logs))
        log = generation_keys.KeyLog(self.job_store.connect(), self.store_prefix, publish)
        self._key_logs.append(log)
        return log

    def _forget_keys(self) -> None:
        """A clean end: the last rank to get here deletes the generation's keys."""
        try:
            # The registry's connection is idle by now: a new one would cost a
            # connect (and the store server's reverse lookup of this peer).
            store = self._key_logs[0].inner if self._key_logs else self.job_store.connect()
            last = generation_keys.forget(store, self.store_prefix, self._key_logs,
                                          self.topology.rank, self.topology.size)
            if not last and self.job_store.hosts_server and not generation_keys.wait_closed(
                    store, self.store_prefix, _HOST_WAITS_SECONDS):
                logger.debug("closing the store this rank hosts before every rank closed")
        except Exception as exc:  # the store went away with the job: nothing to keep tidy
            logger.debug("generation keys left in the store: %s", exc)

    @property
    def process_sets(self) -> Dict[int, ProcessSetState]:
        """``{set id: state}`` of the sets this rank belongs to."""
        return self.sets.states if self.sets is not None else {}

    def counter(self, kind: str) -> int:
        """The next number of ``kind`` in this runtime (0, 1, ...): optimizer and
        layer instances, which every rank creates in the same order."""
        with self._counter_lock:
            n = self._counters.get(kind, 0)
            self._counters[kind] = n + 1
        return n

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop negotiating (every rank stops), fail what is pending, free everything."""
        if self.forked:
            return  # the parent's runtime: nothing here is this process's to stop
        if self._thread is None:
            self.close()
            return
        if getattr(self._here, "cycling", False):
            self._shutdown_from_inside_a_cycle()
            return
        if not self._stopping and self.fatal is None and self.health is not None:
            self.health.announce("shut down (called shutdown() or its script ended)")
        self._stopping = True
        for state in list(self.process_sets.values()):
            state.queue.wakeup.set()
        if self._thread is not threading.current_thread():
            limit = timeout if timeout is not None else self.config.gloo_timeout_seconds + 5
            self._thread.join(limit)
        if self._stopped.wait(1.0):
            self.close()

    def _shutdown_from_inside_a_cycle(self) -> None:
        """``shutdown()`` from a signal handler or finalizer that interrupted this
        thread in the middle of a negotiation cycle (a SIGTERM handler on a
        preempted rank).

        Waiting for the background thread here would wait for the interrupted
        cycle, which cannot go on before the handler returns, and tearing the
        parts down would pull them from under it. The shutdown is announced and
        requested instead, and this returns at once: when the handler returns
        the cycle goes on and the job stops at the next one (a pending
        collective then fails, saying so); when it raises (``sys.exit()``) the
        cycle ends there and the peers read this rank's announcement. A thread
        of its own frees the parts once the background thread is done.
        """
        if not self._stopping and self.fatal is None and self.health is not None:
            self.health.announce("shut down (called shutdown() or its script ended)")
        self._stopping = True
        for state in list(self.process_sets.values()):
            state.queue.wakeup.set()
        limit = self.config.gloo_timeout_seconds + 5

        def close_when_stopped() -> None:
            if self._stopped.wait(limit):
                self.close()

        threading.Thread(target=close_when_stopped, name="hvdlike-close", daemon=True).start()
        # The next shutdown() -- the one at exit, at the latest -- finishes (or waits
        # for) the freeing: the interpreter must not end under that thread's close().
        _current.SLOT.closing.append(self)

    def _interrupted(self, exc: BaseException) -> None:
        """A cycle on this thread ended by an interrupt, ``sys.exit()`` or the like:
        the ranks' control collectives are out of step, the job cannot go on.

        After a ``shutdown()`` from a signal handler (then ``sys.exit()``) the
        peers already read this rank's announcement: the exit is that shutdown.
        """
        if self._stopping and isinstance(exc, SystemExit) and self.fatal is None:
            self.fatal = HvdlikeInternalError(f"rank {self.topology.rank}: {SHUT_DOWN}")
            return
        self.abort(f"{type(exc).__name__} in the middle of a negotiation cycle")

    def forked_child(self) -> None:
        """Make this copy, in a process forked from the rank that owns it, refuse work."""
        self.forked = True
        self.fatal = HvdlikeError(
            f"this process was forked from rank {self.topology.rank} (pid {self.pid}) after "
            f"init(): the runtime belongs to that process and cannot run collectives here "
            f"(it would disturb the job). Communicate from the rank itself; rank(), size() "
            f"and the other queries still answer here")

    def close(self) -> None:
        """Free everything this runtime holds (idempotent).

        After a started runtime's background thread has ended (:meth:`shutdown`),
        or on a runtime that never started (a failed :meth:`build`). Breaks the
        runtime <-> executor/health reference cycles so sockets and threads are
        released now, not whenever the cyclic GC runs.
        """
        with self._close_lock:
            self._close()

    def _close(self) -> None:
        if self._closed or self.forked:
            return
        if self._thread is not None and not self._stopped.is_set():
            return  # the background thread still owns the parts: shutdown() first
        self._closed = True
        if self._thread is None:  # never started: nothing ran, nothing is pending
            self._stopping = True
            self._stopped.set()
        sets, self.sets = self.sets, None  # the registry's parts hold this runtime's hooks
        if sets is not None:
            sets.close()
        if self.health is not None and self._thread is None:  # start() failed midway
            self.health.close(clean=True)
        self.health = None  # otherwise closed by the background thread's teardown
        self.recording.close()
        self.autotuner = None
        if self.mpi_world is not None:
            from . import mpi_plane

            mpi_plane.free(self.mpi_world)
            self.mpi_world = None
        if self._thread is not None and self.fatal is None and self.job_store is not None:
            self._forget_keys()
        self._key_logs = []
        self.store = None
        if self.job_store is not None:
            self.job_store.close()  # a store this rank hosted (mpirun, srun)

    def abort(self, reason: str, exiting: bool = False) -> None:
        """Stop at once without negotiating.

        Peers learn it from their next collective failing; the reason is left
        in the store so their error names this rank and why it went away.
        ``exiting``: the process is about to exit (an uncaught exception), and
        peers learn it from that; otherwise (a Ray actor whose function raised,
        an error a script may catch) its shared-memory segments are marked
        departed so that peers waiting there give up at once.
        """
        if self.fatal is not None:
            return
        if self.health is not None:
            self.health.announce(reason)
        self._set_fatal(HvdlikeInternalError(f"rank {self.topology.rank}: {reason}"))
        if not exiting:
            # Peers waiting for this rank in shared memory give up at once, named,
            # though this process lives on. (An exiting one is seen gone instead,
            # just after the launcher has taken its exit: the failure stays its.)
            from . import shm_segment

            shm_segment.depart_all()

    def alive_error(self) -> Optional[BaseException]:
        """None while handles can still complete; otherwise why they cannot."""
        if self.fatal is not None:
            return self.fatal
        if self._stopped.is_set():
            if self._stop_error is None:  # once: naming the peers reads the store
                self._stop_error = HvdlikeInternalError(self._shutdown_reason(SHUT_DOWN))
            return self._stop_error
        return None

    # -- submission --------------------------------------------------------------

    def auto_name(self, op: str, set_id: int = 0) -> str:
        """Names for unnamed collectives: per-(set, op) counters agree across members."""
        key = op if set_id == 0 else f"{op}.ps{set_id}"
        return f"{key}.noname.{self.counter(key)}"

    def _forget_set(self, set_id: int) -> None:
        """A process set was removed: the counters of its automatic names go with it
        (a runtime never gives its id again), or sets added and removed again
        and again would each leave theirs behind."""
        suffix = f".ps{set_id}"
        with self._counter_lock:
            self._counters = {kind: n for kind, n in self._counters.items()
                              if not kind.endswith(suffix)}

    def process_set(self, set_id: int) -> ProcessSetState:
        """The state of a set this rank belongs to (ValueError if none, see the registry)."""
        sets = self.sets
        if sets is None:
            raise HvdlikeInternalError("hvdlike has shut down")
        return sets.state(set_id)

    def submit(self, entries: List[Entry], set_id: int = 0, origin: str = "") -> List[Handle]:
        """Hand entries to the background thread; return their handles.

        ``origin`` names the submitting front end (for name-clash errors). The
        rank within the set is stamped on a request only when it is sent to the
        coordinator (``Controller._miss``), not here for every tensor.
        """
        if self.fatal is not None or self._stopping or self._stopped.is_set():
            error = self.alive_error()
            kind = type(error) if isinstance(error, HvdlikeInternalError) else HvdlikeInternalError
            raise kind(f"cannot submit {entries[0].request.name!r}: "
                       f"{error or 'hvdlike is shutting down'}")
        sets = self.sets
        state = sets.states.get(set_id) if sets is not None else None
        if state is None:
            state = self.process_set(set_id)  # raises, saying why
        if set_id != 0:
            self._to_set_roots(entries, state)
        now = time.monotonic()
        lock = self.handle_lock
        handles = []
        for entry in entries:
            handle = entry.handle = Handle(entry.request.name, lock)
            entry.enqueued_at = now
            entry.set_id = set_id
            entry.origin = origin
            handles.append(handle)
        state.queue.put(entries)
        if set_id:
            self._check_set(state, set_id, entries)
        return handles

    def submit_one(self, entry: Entry, origin: str = "") -> Handle:
        """:meth:`submit` of one entry to the global set: the same checks and
        effects with less Python per call (an ``allreduce_async_`` per gradient)."""
        sets = self.sets
        state = sets.states.get(0) if sets is not None else None
        if (state is None or self.fatal is not None or self._stopping
                or self._stopped.is_set()):
            return self.submit([entry], 0, origin)[0]  # raises, saying why
        handle = entry.handle = Handle(entry.request.name, self.handle_lock)
        entry.enqueued_at = time.monotonic()
        entry.set_id = 0
        entry.origin = origin
        state.queue.put_one(entry)
        return handle

    def _check_set(self, state: ProcessSetState, set_id: int, entries: List[Entry]) -> None:
        """Fail ``entries`` if their process set was removed while they were queued."""
        if self.process_sets.get(set_id) is not state:
            # The set was removed meanwhile and its queue drained: nothing runs these.
            error = HvdlikeInternalError(f"process set {set_id} was removed before "
                                         f"{entries[0].request.name!r} could run")
            for entry in entries:
                entry.handle.set_error(error)

    @staticmethod
    def _to_set_roots(entries: List[Entry], state: ProcessSetState) -> None:
        """Broadcast roots are global ranks (as in Horovod); a set negotiates in its own."""
        for entry in entries:
            request = entry.request
            if request.op == OpType.BROADCAST:
                if request.root not in state.ranks:
                    raise ValueError(
                        f"broadcast: root_rank {request.root} is not a member of process set "
                        f"{state.id} (ranks {state.ranks}); root_rank is a global rank")
                entry.request = dataclasses.replace(request, root=state.ranks.index(request.root))

    # A thread blocked on a pending handle runs the negotiation cycles itself
    # (see wait() and run()); False keeps every cycle on the background thread.
    caller_cycles = True

    def run(self, entry: Entry, set_id: int = 0, origin: str = ""):
        """Submit ``entry`` and wait for its result: a synchronous collective.

        When this rank has nothing else pending and ``entry`` is the cached
        collective its learned order expects next -- a synchronous allreduce in
        a loop -- the cycle that runs it is started right here (see
        :meth:`_run_here`) instead of going through the queue; the same
        negotiation and the same result, with far less Python per call.
        """
        handle = None
        if set_id == 0 and self.caller_cycles:
            handle = self._run_here(entry, origin)
        if handle is None:
            handle = self.submit([entry], set_id, origin)[0]
        return self.wait(handle)

    @property
    def _lone_global_set(self) -> Optional[ProcessSetState]:
        """The global set when it is the only one, negotiates on shared memory
        and nothing stops the job (else None)."""
        states = self.process_sets
        if (len(states) != 1 or self.fatal is not None or self._stopping or self._agreed_stop
                or "mpi" in self.engines or self.recording.timeline is not None):
            return None
        state = states.get(0)
        return state if state is not None and state.queue.inflight() == 0 else None

    def _run_here(self, entry: Entry, origin: str) -> Optional[Handle]:
        """One cycle of the global set with ``entry`` as its only new work, on
        this thread; its handle (None: not the case, nothing was done).

        Only while nothing is in flight on this rank, so the cycle is exactly
        the one the queue would have led to (``Controller.cycle_one``). The
        handle may still be pending (a peer was not ready, or the work went
        to the finisher): :meth:`wait` then cycles on as for any collective.
        """
        lock = self._cycle_lock
        if not lock.acquire(blocking=False):
            return None
        here = self._here
        here.cycling = True
        try:
            state = self._lone_global_set
            if state is None or not state.controller.idle or self.sets.has_changes():
                return None
            entry.handle = Handle(entry.request.name, self.handle_lock)
            entry.enqueued_at = time.monotonic()
            entry.set_id = 0
            entry.origin = origin
            queue = state.queue
            queue.claim(entry)
            try:
                result = state.controller.cycle_one(entry)
                if result is None:
                    queue.release(entry.request.name)
                    return None
                self.ran_here += 1
                if result.shutdown:
                    self._agreed_stop = True  # the pending entry fails in the teardown
                else:
                    self._run_agreed(state, 0, result)
            except BaseException as exc:
                # As in _cycle_until: a cycle broken halfway breaks the job.
                if isinstance(exc, Exception):
                    self._explain(exc)
                else:
                    self._interrupted(exc)
                    raise
            finally:
                self._last_cycle = time.monotonic()
        finally:
            here.cycling = False
            lock.release()
        if self.fatal is not None or self._agreed_stop:
            queue.wakeup.set()  # the background thread tears down
        return entry.handle

    def wait(self, handle: Handle, timeout: Optional[float] = None):
        if handle._done:
            return handle.wait()
        if getattr(self._here, "cycling", False):
            raise HvdlikeError(
                f"collective {handle.name!r} was waited for by a signal handler or a finalizer "
                f"(__del__, weakref.finalize) that interrupted this thread in the middle of "
                f"hvdlike's negotiation cycle: the cycle cannot go on before the handler "
                f"returns, so the collective could never complete. Set a flag in the handler "
                f"and communicate after it returns (shutdown() may be called from a handler)")
        self.waits.enter()
        try:
            if timeout is None and self.caller_cycles and "mpi" not in self.engines:
                self._cycle_until(handle)
            if handle._done:
                return handle.wait()
            with self._hold_released():  # the background thread may cycle for it
                self._flush.set()  # someone is blocked on it: cycle now, not at the next tick
                return handle.wait(self.alive_error, timeout)
        finally:
            self.waits.leave()

    @contextlib.contextmanager
    def _hold_released(self):
        """Suspend this thread's :meth:`cycles_here` for the block (if it is in one)."""
        if not getattr(self._here, "held", False):
            yield
            return
        with self._counter_lock:
            self._callers -= 1
        try:
            yield
        finally:
            with self._counter_lock:
                self._callers += 1

    @contextlib.contextmanager
    def cycles_here(self):
        """Within the block, the negotiation cycles run on this thread, not the background one.

        For a burst of collectives the caller submits and then waits for at
        once (``DistributedOptimizer`` holding CPU reductions back to
        ``step()``): the background thread starts no cycle while the block
        lasts, and this thread's waits run the cycles -- and the shared-memory
        work they launch -- themselves, waiting for a cycle already in
        progress instead of leaving the rest to the background thread. With
        every core busy that saves a wake-up per batch, and the work stays on
        the core this thread already holds: woken, the two ranks' background
        threads were seen placed on one core for a whole step while the other
        idled. Without caller cycles (``mpi`` engines) the block changes nothing.
        """
        if (not self.caller_cycles or "mpi" in self.engines
                or getattr(self._here, "held", False)):
            yield
            return
        with self._counter_lock:
            self._callers += 1
        self._here.held = True
        try:
            yield
        finally:
            self._here.held = False
            with self._counter_lock:
                self._callers -= 1
            self._flush.set()  # the background thread resumes (see _loop)

    def _take_cycle_lock(self, handle: Handle) -> bool:
        """The cycle lock for :meth:`_cycle_until`; False: leave the cycling to
        whoever holds it. Inside :meth:`cycles_here`, wait for the holder."""
        lock = self._cycle_lock
        if lock.acquire(blocking=False):
            return True
        if not getattr(self._here, "held", False):
            return False
        while not lock.acquire(timeout=0.05):
            if handle._done or self.fatal is not None or self._agreed_stop or self._stopping:
                return False
        return True

    def _cycle_until(self, handle: Handle) -> None:
        """Run negotiation cycles on this (user) thread until ``handle`` completes.

        A synchronous collective then costs no hand-off to the background
        thread and back: on a host whose cores are all busy each hand-off is
        a wake-up of another thread that may wait for a core. Cycles stay
        one at a time per rank (``_cycle_lock``), so the control collectives
        keep their order; when another thread is cycling already, or the
        handle's work runs on the finisher thread, this thread waits on the
        handle as before (and the background thread cycles).
        """
        lock = self._cycle_lock
        with self._counter_lock:
            self._callers += 1
        try:
            while not handle._done:
                if self.fatal is not None or self._agreed_stop or self._stopping:
                    return
                if not self._take_cycle_lock(handle):
                    return
                self._here.cycling = True
                try:
                    if handle._done or self.fatal is not None or self._agreed_stop:
                        return
                    launched = self._launched()
                    try:
                        if self._cycle_all():
                            self._agreed_stop = True
                    except BaseException as exc:
                        # A cycle broken halfway (a peer failed, or Ctrl-C here)
                        # leaves the ranks' control collectives out of step: the
                        # job cannot go on. An interrupt still reaches the caller.
                        if isinstance(exc, Exception):
                            self._explain(exc)
                        else:
                            self._interrupted(exc)
                            raise
                    finally:
                        self._last_cycle = time.monotonic()
                finally:
                    self._here.cycling = False
                    lock.release()
                if self._agreed_stop or self.fatal is not None:
                    return
                if not handle._done and self._launched() != launched:
                    return  # launched on the finisher: wait for it there
        finally:
            with self._counter_lock:
                self._callers -= 1
            if not handle._done:
                self._flush.set()  # the background thread takes over (see _loop)
            if self._agreed_stop or self.fatal is not None:
                for state in list(self.process_sets.values()):
                    state.queue.wakeup.set()  # the background thread tears down

    def _launched(self) -> int:
        return sum(state.executor.launched for state in self.process_sets.values())

    # -- background thread ---------------------------------------------------------

    def _complete(self, entry: Entry, result, error: Optional[BaseException]) -> None:
        state = self.process_sets.get(entry.set_id)
        if error is None and entry.finish is not None:
            try:
                result = entry.finish(result)
            except BaseException as exc:  # a frontend conversion failed: report it
                error = exc
        if state is not None:
            state.queue.release(entry.request.name)
        if error is not None:
            entry.handle.set_error(error)
        else:
            entry.handle.set_result(result)

    def _complete_many(self, entries: Sequence[Entry], results: Sequence) -> None:
        """:meth:`_complete` with success for a batch: one queue and one handle lock."""
        if not entries:
            return
        errors = None
        hooked = [i for i, entry in enumerate(entries) if entry.finish is not None]
        if hooked:
            results = list(results)
            for i in hooked:
                try:
                    results[i] = entries[i].finish(results[i])
                except BaseException as exc:  # a frontend conversion failed: report it
                    results[i] = None
                    errors = errors or {}
                    errors[i] = exc
        state = self.process_sets.get(entries[0].set_id)
        if state is not None:
            state.queue.release_many([entry.request.name for entry in entries])
        finish_many([entry.handle for entry in entries], results, errors)

    def _set_fatal(self, error: BaseException) -> None:
        if self.fatal is None:
            self.fatal = error
            logger.error("%s", error)

    def _watch_peers(self) -> store_wait.Gone:
        """A probe naming ranks that are gone, for one wait while a set is built.
        Before the health watcher starts (:meth:`build` registers the sets given
        to ``init`` before it) only what ranks or the launcher left in the store."""
        health = self.health
        if health is not None:
            return health.watch()
        return words_probe(self.store, self._launcher_exits(self.store))

    def _launcher_exits(self, log: generation_keys.KeyLog):
        """The unprefixed store ``hvdlike-run`` records rank exits in (see
        ``health.exited_key``), or None where they do not name this runtime's
        ranks: other launchers, elastic jobs (a rank's number changes with the
        generation; the driver reports under the generation's keys instead)
        and ``init(comm=[ranks])`` (ranks renumbered)."""
        if (self.rendezvous.launcher != "hvdlike-run" or self.world_tag
                or self.store_prefix.startswith("elastic")):
            return None
        return log.inner

    def _store_lost(self, error: BaseException) -> None:
        """The health watcher lost the store for good. Once every rank has agreed
        to stop, the store's host may rightly be gone already; before that it is
        the job failing (and under MPI the only news a waiting rank will get)."""
        if not (self._stopping or self._agreed_stop):
            self._set_fatal(error)

    def _explain(self, error: BaseException) -> BaseException:
        """Turn a transport failure into the job's fatal error, naming dead peers."""
        if self.fatal is not None:
            return self.fatal
        cause = self.health.diagnose() if self.health is not None and not self._stopping else ""
        text = f"rank {self.topology.rank} ({self.topology.hostname}): "
        text += f"{cause}. " if cause else ""
        text += f"A collective with the other ranks failed: {error}"
        self._set_fatal(HvdlikeInternalError(text))
        return self.fatal

    def _loop(self) -> None:
        if self.affinity_core is not None:
            try:
                os.sched_setaffinity(threading.get_native_id(), {self.affinity_core})
            except OSError as exc:
                logger.warning("could not pin the background thread to core %d: %s",
                               self.affinity_core, exc)
        idle_cycles = 0
        lock = self._cycle_lock
        try:
            while self.fatal is None and not self._agreed_stop:
                cycle_seconds = self.settings.cycle_seconds  # the autotuner may change it
                pause = cycle_seconds
                if idle_cycles > _IDLE_CYCLES_BEFORE_BACKOFF:
                    # Idle back-off: with nothing pending here, each further idle
                    # cycle doubles the pause (up to _IDLE_PAUSE_MAX_SECONDS), so
                    # a rank that only computes stops burning a control collective
                    # per millisecond. A peer that needs this rank meanwhile just
                    # waits in its control collective.
                    pause = min(_IDLE_PAUSE_MAX_SECONDS, max(cycle_seconds, 1e-3) * 2 ** min(
                        idle_cycles - _IDLE_CYCLES_BEFORE_BACKOFF, 16))
                # A user thread blocked on its handle runs the cycles for it
                # (wait()); one here would cost the peers a round trip. An idle
                # cycle runs once ``pause`` passed since anyone's last cycle.
                cycled = False
                if self._wants_cycle(pause):
                    with lock:
                        if self.fatal is not None or self._agreed_stop:
                            break
                        if self._wants_cycle(pause):  # a user thread may have run it
                            cycled = True
                            self._here.cycling = True
                            try:
                                if self._cycle_all():
                                    break
                            finally:
                                self._here.cycling = False
                                self._last_cycle = time.monotonic()
                idle = self._idle()
                if cycled:
                    idle_cycles = idle_cycles + 1 if idle else 0
                if self._callers:
                    # Until that thread is done (it sets _flush when it leaves).
                    self._flush.wait(pause)
                    self._flush.clear()
                elif not idle:
                    # Work in flight: let submissions gather for the cycle time
                    # so they fuse into fewer collectives; a thread blocking on
                    # a handle (synchronize) cuts the wait short.
                    remaining = cycle_seconds - (time.monotonic() - self._last_cycle)
                    if remaining > 0 and not self._flush.is_set():
                        self._flush.wait(remaining)
                    self._flush.clear()
                else:
                    remaining = pause - (time.monotonic() - self._last_cycle)
                    if remaining > 0:
                        self._pause(remaining)
        except BaseException as exc:
            self._explain(exc)
        finally:
            self._teardown()

    def _wants_cycle(self, pause: float) -> bool:
        """Whether the background thread should run a cycle now."""
        if self._stopping:
            return True
        if self._callers:
            return False
        return (not self._idle(queued=True)
                or time.monotonic() - self._last_cycle >= pause)

    def _idle(self, queued: bool = False) -> bool:
        """Nothing pending in any set (with ``queued``: nothing submitted since either)."""
        for state in self.process_sets.values():
            if not state.controller.idle or (queued and state.queue.has_pending()):
                return False
        return True

    def _pause(self, seconds: float) -> None:
        """Sleep up to ``seconds``; a submission to any process set ends it."""
        states = self.process_sets
        main = states[0].queue.wakeup
        if len(states) == 1:
            main.wait(seconds)
            return
        others = [s.queue.wakeup for k, s in states.items() if k != 0]
        deadline = time.monotonic() + seconds
        while not main.is_set() and not any(e.is_set() for e in others):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            main.wait(min(left, _SUBSET_POLL_SECONDS))

    def _cycle_all(self) -> bool:
        """One cycle over every process set; True once the job shuts down.

        Sets are cycled in id order on every rank, so their blocking control
        collectives cannot wait on each other in a circle. Only the global set
        carries the shutdown flag: every rank cycles it first, so all ranks stop
        in the same cycle (a subset's flag would strand the ranks outside it).
        """
        states = self.process_sets  # replaced, never mutated, while this thread runs
        changes = None
        timeline = self.recording.timeline
        if timeline is not None:
            timeline.cycle()
        for set_id in sorted(states):
            state = states[set_id]
            result = state.controller.cycle(state.queue.drain(),
                                            shutdown=self._stopping and set_id == 0)
            if timeline is not None:
                timeline.negotiated(state, result)
            if result.shutdown:
                return True
            if set_id == 0 and self.sets.has_changes():
                changes = self.sets.take_changes(result.work)
            self._run_agreed(state, set_id, result)
        if changes:
            for apply in changes:
                apply()
        return False

    def _run_agreed(self, state: ProcessSetState, set_id: int, result) -> None:
        """Start what one set's cycle agreed on (a cycle that did not shut down)."""
        work = result.work
        if result.voted is not None:
            # Its inputs stay in the vote's buffer only until this set's next
            # control exchange (the autotuner's may come first): reduce now.
            state.executor.allreduce_voted(work[0], result.voted)
            work = work[1:]
        if set_id == 0 and self.autotuner is not None and self.autotuner.cycle(result.work):
            # settled: every rank keeps the chosen settings
            self.tuned, self.autotuner = self.autotuner.settled, None
        state.executor.execute(work)

    def _shutdown_reason(self, text: str = SHUT_DOWN_UNDER) -> str:
        """Why pending collectives cannot complete after a negotiated shutdown
        (``text``, then the ranks that announced they went away and why)."""
        if self.health is None:
            return text
        try:
            others = {r: why for r, why in self.health.announcements().items()
                      if r != self.topology.rank}
        except Exception:  # the store went down with the job
            others = {}
        if not others:
            return text
        who = "; ".join(f"rank {r} on {self.health.host(r)} {why}" for r, why in sorted(others.items()))
        return f"{text}: {who}"

    def _teardown(self) -> None:
        """The background thread's last act: fail what is pending, stop the parts.

        A user thread may be in the middle of a cycle (:meth:`wait` runs them):
        its groups are not closed under it while it lasts. Its waits give up on
        the job's failure, so that is short; a cycle stuck longer (in a Gloo
        collective that cannot be given up) is left to fail on its own after
        ``_TEARDOWN_WAIT_SECONDS``, against groups that refuse to be made again.
        """
        held = self._cycle_lock.acquire(timeout=_TEARDOWN_WAIT_SECONDS)
        if not held:
            logger.debug("tearing down while a user thread's cycle still runs")
        try:
            reason = self.fatal or HvdlikeInternalError(self._shutdown_reason())
            for state in self.process_sets.values():
                self.sets.fail_pending(state, reason)
            for state in self.process_sets.values():
                state.close(0)  # its completion thread was stopped just above
        finally:
            if held:
                self._cycle_lock.release()
        if self.health is not None:
            self.health.close(clean=self.fatal is None)
        self.recording.close()
        self._stopped.set()
