"""The runtime object: one per ``init()``, owning everything that runs.

Module-level API functions (``hvdlike.rank()``, ``hvdlike.torch.allreduce``...)
delegate to the single current :class:`Runtime`; nothing else holds global
state. A runtime owns the store connection, one :class:`ProcessSetState` per
process set (groups, controller, executor, queue) and the background thread
that cycles through them.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from . import bootstrap, config as config_mod
from .controller import Controller
from .errors import HvdlikeInternalError
from .messages import OpType
from .executor import Executor
from .handles import Handle, finish_many
from .health import Health
from .job_store import JobStore
from .log import configure as configure_logging, logger
from .tensor_queue import Entry, TensorQueue
from .transport import GlooControlPlane, Groups

# Idle back-off of the background loop (see Runtime._loop).
_IDLE_CYCLES_BEFORE_BACKOFF = 8
_IDLE_PAUSE_MAX_SECONDS = 0.05
_SUBSET_POLL_SECONDS = 0.002

_generation = 0  # init() count in this process; names store keys of each init apart
_generation_lock = threading.Lock()


class ProcessSetState:
    """Everything one process set needs on a member rank."""

    def __init__(self, set_id: int, ranks: Sequence[int], global_rank: int, store, cfg,
                 local_addr: str, complete, explain, engines=("gloo", "gloo"),
                 abandon=lambda: None, shm=None):
        self.id = set_id
        self.ranks = list(ranks)
        self.rank = self.ranks.index(global_rank)
        self.size = len(self.ranks)
        self.queue = TensorQueue()
        import torch.distributed as dist

        controller_engine, cpu_engine = engines
        self.groups = Groups(dist.PrefixStore(f"ps{set_id}/", store), self.rank, self.size,
                             cfg.gloo_timeout_seconds, local_addr,
                             gloo_control=controller_engine == "gloo")
        control = (GlooControlPlane(self.groups.control, self.rank, self.size)
                   if controller_engine == "gloo" else None)
        if "mpi" in engines:
            from . import mpi_plane

            comm = mpi_plane.set_comm(self.ranks, set_id)
            if cpu_engine == "mpi":
                self.groups.cpu_plane = mpi_plane.MpiDataGroup(
                    comm.Dup(), lambda: self.groups.torch_group("cpu"))
            if control is None:
                control = mpi_plane.MpiControlPlane(comm, self.rank, self.size, abandon)
                self.groups.closers.append(control.close)
            else:
                mpi_plane.free(comm)  # only its duplicate (the data plane) is used
        if shm is not None and self.size > 1 and "gloo" in engines:
            from . import shm_plane

            data, shm_control = shm_plane.for_set(
                shm, self.groups.store, self.rank, self.ranks,
                lambda: self.groups.torch_group("cpu"), abandon,
                data=cpu_engine == "gloo", control=controller_engine == "gloo")
            if data is not None:
                self.groups.cpu_plane = data
            if shm_control is not None:
                control = shm_control
                self.groups.closers.append(control.close)
        self.controller = Controller(control, cfg.cache_capacity)
        self.executor = Executor(self.groups, self.rank, self.size, cfg.fusion_threshold,
                                 complete, explain)

    def close(self) -> None:
        self.executor.close()
        self.groups.close()


class Runtime:
    """A live hvdlike job in this process."""

    timeline = None  # a core.timeline.Timeline while recording (see core/timeline.py)
    engines = ("gloo", "gloo")  # (negotiation, CPU tensors): see mpi_plane.choose
    shm = None  # shm_plane.Settings when ranks of this host may share memory

    def __init__(self, cfg: config_mod.Config, topology: bootstrap.Topology,
                 rendezvous: bootstrap.Rendezvous):
        self.config = cfg
        self.topology = topology
        self.rendezvous = rendezvous
        self.process_sets: Dict[int, ProcessSetState] = {}
        self.fatal: Optional[BaseException] = None
        self._stopping = False
        self._flush = threading.Event()  # a user thread waits on a pending handle
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._name_counters: Dict[str, int] = {}
        self._name_lock = threading.Lock()
        self._next_set_id = 1
        # Every registered set, member or not (copy-on-write, like process_sets).
        self.set_ranks: Dict[int, List[int]] = {}
        self.set_change_lock = threading.RLock()  # one add/remove at a time per process
        self._set_changes: Dict[str, Callable[[], None]] = {}
        self._set_changes_lock = threading.Lock()
        self._set_change_count = 0
        self.store = None
        self.health: Optional[Health] = None
        # Settings the background thread applies; the autotuner changes them
        # (between cycles, alike on every rank) while it searches.
        self.fusion_threshold = cfg.fusion_threshold
        self.cycle_seconds = cfg.cycle_time / 1000.0
        self.autotuner = None  # a core.autotune.Autotuner while tuning

    # -- life cycle --------------------------------------------------------------

    @classmethod
    def start(cls, environ: Optional[Mapping[str, str]] = None, process_sets=(),
              **overrides) -> "Runtime":
        """Bootstrap from ``environ``, register ``process_sets``, start the background thread."""
        global _generation
        environ = os.environ if environ is None else environ
        from .elastic.worker import enter_generation

        enter_generation(environ)  # elastic jobs: all members present (may move it on)
        cfg = config_mod.load(environ, **overrides)
        topology, rendezvous = bootstrap.detect(environ, cfg.start_timeout)
        configure_logging(cfg.log_level_number, topology.rank)
        runtime = cls(cfg, topology, rendezvous)
        with _generation_lock:
            _generation += 1
            generation = _generation
        import torch.distributed as dist

        from .elastic.protocol import store_prefix

        prefix = store_prefix(environ, generation)  # elastic: the launcher's generation
        runtime.job_store = JobStore(topology, rendezvous, cfg.start_timeout)
        base = runtime.job_store.connect()
        runtime.store = dist.PrefixStore(prefix, base)
        local_addr = rendezvous.gloo_iface
        if not local_addr:
            local_addr = (bootstrap.local_address_towards(rendezvous.addr, rendezvous.port)
                          if rendezvous.addr else "127.0.0.1")
        runtime.local_addr = local_addr
        from . import mpi_plane

        runtime.engines = mpi_plane.choose(cfg.controller, cfg.cpu_operations,
                                           rendezvous.launcher, topology.rank, topology.size,
                                           environ)
        from . import shm_plane

        runtime.shm = shm_plane.settings(cfg, topology, rendezvous)
        try:
            runtime.add_process_set(0, range(topology.size))
            runtime.job_store.joined()
        except Exception as exc:
            runtime.job_store.close()
            raise HvdlikeInternalError(
                f"rank {topology.rank} could not connect to the other {topology.size - 1} "
                f"rank(s) (Gloo on {local_addr or 'default interface'}): {exc}") from None
        if topology.size > 1:
            health_store = dist.PrefixStore(
                prefix, runtime.job_store.connect())
            runtime.health = Health(health_store, topology.rank, topology.size,
                                    topology.hostname, cfg, runtime._waiting_since,
                                    runtime._set_fatal, runtime._members)
        try:
            # Static sets are live from the first cycle on every rank: registered
            # before the background thread starts cycling.
            from .process_sets import register_static

            register_static(runtime, list(process_sets or ()))
            if cfg.autotune:
                from . import autotune

                runtime.autotuner = autotune.for_runtime(runtime)
            if cfg.timeline:
                from . import timeline

                timeline.start(runtime, cfg.timeline, cfg.timeline_mark_cycles)
        except BaseException:
            for state in runtime.process_sets.values():
                state.close()
            if getattr(runtime, "health", None) is not None:
                runtime.health.close(clean=True)
            runtime.job_store.close()
            raise
        if topology.rank == 0:
            logger.info("hvdlike started: %d rank(s), launcher %s, settings:\n%s",
                        topology.size, rendezvous.launcher, cfg.describe())
        runtime._thread = threading.Thread(target=runtime._loop, name="hvdlike-background",
                                           daemon=True)
        runtime._thread.start()
        return runtime

    def add_process_set(self, set_id: int, ranks: Sequence[int]) -> Optional[ProcessSetState]:
        """Build and install a process set (only before the background thread runs)."""
        state = self.build_process_set(set_id, ranks)
        self.install_process_set(set_id, ranks, state)
        return state

    def build_process_set(self, set_id: int, ranks: Sequence[int]) -> Optional[ProcessSetState]:
        """Create the groups of a process set; a no-op (None) on non-member ranks.

        Blocks until every member has called it (the groups rendezvous).
        """
        ranks = list(ranks)
        if self.topology.rank not in ranks:
            return None
        state = ProcessSetState(set_id, ranks, self.topology.rank, self.store, self.config,
                                self.local_addr, self._complete, self._explain, self.engines,
                                lambda: self.fatal, self.shm)
        return state

    def install_process_set(self, set_id: int, ranks: Sequence[int],
                            state: Optional[ProcessSetState]) -> None:
        """Make a built set live: before the thread starts, or on it between cycles.

        The tables are replaced, never mutated, so the background thread and
        submitting threads always read a consistent table without a lock.
        """
        self.set_ranks = {**self.set_ranks, set_id: list(ranks)}
        if state is not None:
            state.executor.complete_many = self._complete_many
            if self.timeline is not None:
                self.timeline.bind(state)
            state.executor.fusion_threshold = self.fusion_threshold
            self.process_sets = {**self.process_sets, set_id: state}

    def uninstall_process_set(self, set_id: int) -> None:
        """Retire a set on the background thread: fail what is pending, free its groups."""
        self.set_ranks = {k: v for k, v in self.set_ranks.items() if k != set_id}
        state = self.process_sets.get(set_id)
        if state is None:
            return
        self.process_sets = {k: v for k, v in self.process_sets.items() if k != set_id}
        reason = HvdlikeInternalError(
            f"process set {set_id} was removed before this collective completed")
        state.executor.finisher.close(self.config.gloo_timeout_seconds)
        for entry in state.controller.pending_entries() + state.queue.drain():
            self._complete(entry, None, reason)
        state.groups.close()
        state.executor.pool.clear()

    def next_set_id(self) -> int:
        with self._name_lock:
            set_id = self._next_set_id
            self._next_set_id += 1
        return set_id

    def next_set_change(self) -> int:
        """Serial number of an add/remove call (the same on every rank)."""
        with self._name_lock:
            self._set_change_count += 1
            return self._set_change_count

    def change_process_sets(self, name: str, change: Callable[[], None]) -> None:
        """Run ``change`` on the background thread in the same cycle on every rank.

        Submits a barrier named ``name`` on the global set; the cycle whose
        responses include it ends by running ``change``, so every member starts
        (or stops) cycling a set in the same cycle.
        """
        from .collectives import barrier_entry

        applied = threading.Event()
        errors: List[BaseException] = []

        def apply() -> None:
            try:
                change()
            except BaseException as exc:
                errors.append(exc)
            finally:
                applied.set()

        with self._set_changes_lock:
            self._set_changes = {**self._set_changes, name: apply}
        self.wait(self.submit([barrier_entry(name)], 0)[0])
        while not applied.wait(0.05):
            error = self.alive_error()
            if error is not None:
                raise HvdlikeInternalError(f"process set change {name!r} failed: {error}")
        if errors:
            raise errors[0]

    def _take_set_changes(self, work) -> List[Callable[[], None]]:
        with self._set_changes_lock:
            changes = dict(self._set_changes)
            taken = [changes.pop(response.name) for response, _ in work
                     if response.name in changes]
            self._set_changes = changes
        return taken

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop negotiating (every rank stops), fail what is pending, free everything."""
        if not self._stopping and self.fatal is None and self.health is not None:
            self.health.announce("shut down (called shutdown() or its script ended)")
        self._stopping = True
        for state in list(self.process_sets.values()):
            state.queue.wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            limit = timeout if timeout is not None else self.config.gloo_timeout_seconds + 5
            self._thread.join(limit)
        if self._stopped.wait(1.0):
            # Break the runtime <-> executor/health reference cycles so sockets
            # and threads are released now, not whenever the cyclic GC runs.
            self.process_sets = {}
            self.health = None
            self.store = None
            self.job_store.close()  # a store this rank hosted (mpirun, srun)

    def abort(self, reason: str) -> None:
        """Stop at once without negotiating (this process is going down).

        Peers learn it from their next collective failing; the reason is left
        in the store so their error names this rank and why it went away.
        """
        if self.fatal is not None:
            return
        if self.health is not None:
            self.health.announce(reason)
        self._set_fatal(HvdlikeInternalError(f"rank {self.topology.rank}: {reason}"))

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def alive_error(self) -> Optional[BaseException]:
        """None while handles can still complete; otherwise why they cannot."""
        if self.fatal is not None:
            return self.fatal
        if self._stopped.is_set():
            return HvdlikeInternalError("hvdlike has shut down")
        return None

    # -- submission --------------------------------------------------------------

    def auto_name(self, op: str, set_id: int = 0) -> str:
        """Names for unnamed collectives: per-(set, op) counters agree across members."""
        key = op if set_id == 0 else f"{op}.ps{set_id}"
        with self._name_lock:
            n = self._name_counters.get(key, 0)
            self._name_counters[key] = n + 1
        return f"{key}.noname.{n}"

    def process_set(self, set_id: int) -> ProcessSetState:
        """The state of a set this rank belongs to.

        Raises:
            ValueError: the set is not registered, or this rank is not a member.
        """
        state = self.process_sets.get(set_id)
        if state is None:
            ranks = self.set_ranks.get(set_id)
            if ranks is None:
                raise ValueError(f"process set {set_id} is not registered (never added, or "
                                 f"removed)")
            raise ValueError(
                f"rank {self.topology.rank} is not a member of process set {set_id} "
                f"(ranks {ranks}); only its members may call collectives on it")
        return state

    def submit(self, entries: List[Entry], set_id: int = 0, origin: str = "") -> List[Handle]:
        """Hand entries to the background thread; return their handles.

        ``origin`` names the submitting front end (for name-clash errors). The
        rank within the set is stamped on a request only when it is sent to the
        coordinator (``Controller._miss``), not here for every tensor.
        """
        error = self.alive_error()
        if error is not None or self._stopping:
            kind = type(error) if isinstance(error, HvdlikeInternalError) else HvdlikeInternalError
            raise kind(f"cannot submit {entries[0].request.name!r}: "
                       f"{error or 'hvdlike is shutting down'}")
        state = self.process_set(set_id)
        if set_id != 0:
            self._to_set_roots(entries, state)
        now = time.monotonic()
        for entry in entries:
            entry.enqueued_at = now
            entry.set_id = set_id
            entry.origin = origin
        state.queue.put(entries)
        if set_id and self.process_sets.get(set_id) is not state:
            # The set was removed meanwhile and its queue drained: nothing runs these.
            error = HvdlikeInternalError(f"process set {set_id} was removed before "
                                         f"{entries[0].request.name!r} could run")
            for entry in entries:
                entry.handle.set_error(error)
        return [entry.handle for entry in entries]

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

    def wait(self, handle: Handle, timeout: Optional[float] = None):
        if not handle._done:
            self._flush.set()  # someone is blocked on it: cycle now, not at the next tick
        return handle.wait(self.alive_error, timeout)

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

    def _waiting_since(self) -> Dict[tuple, float]:
        """``{(process set id, name): submission time}`` of everything pending here."""
        waiting: Dict[tuple, float] = {}
        for set_id, state in list(self.process_sets.items()):
            for name, since in state.queue.waiting_since().items():
                waiting[(set_id, name)] = since
        return waiting

    def _members(self, set_id: int) -> List[int]:
        return self.set_ranks.get(set_id) or list(range(self.topology.size))

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
        idle_cycles = 0
        try:
            while self.fatal is None:
                cycle_seconds = self.cycle_seconds  # the autotuner may change it
                started = time.monotonic()
                if self._cycle_all():
                    break
                # Idle back-off: with nothing pending here, each further idle
                # cycle doubles the pause (up to _IDLE_PAUSE_MAX_SECONDS), so a
                # rank that only computes stops burning a control collective per
                # millisecond. A submission wakes the loop at once; a peer that
                # needs this rank meanwhile just waits in its control collective.
                idle = all(s.controller.idle for s in self.process_sets.values())
                idle_cycles = idle_cycles + 1 if idle else 0
                if not idle:
                    # Work in flight: let submissions gather for the cycle time
                    # so they fuse into fewer collectives; a thread blocking on
                    # a handle (synchronize) cuts the wait short.
                    remaining = cycle_seconds - (time.monotonic() - started)
                    if remaining > 0 and not self._flush.is_set():
                        self._flush.wait(remaining)
                    self._flush.clear()
                    continue
                pause = cycle_seconds
                if idle_cycles > _IDLE_CYCLES_BEFORE_BACKOFF:
                    pause = min(_IDLE_PAUSE_MAX_SECONDS, max(cycle_seconds, 1e-3) * 2 ** min(
                        idle_cycles - _IDLE_CYCLES_BEFORE_BACKOFF, 16))
                remaining = pause - (time.monotonic() - started)
                if remaining > 0:
                    self._pause(remaining)
        except BaseException as exc:
            self._explain(exc)
        finally:
            self._teardown()

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
        timeline = self.timeline
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
            if set_id == 0 and self._set_changes:
                changes = self._take_set_changes(result.work)
            if set_id == 0 and self.autotuner is not None and self.autotuner.cycle(result.work):
                self.autotuner = None  # settled: every rank keeps the chosen settings
            state.executor.execute(result.work)
        if changes:
            for apply in changes:
                apply()
        return False

    def _shutdown_reason(self) -> str:
        """Why pending collectives cannot complete after a negotiated shutdown."""
        text = "hvdlike was shut down before this collective completed"
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
        reason = self.fatal or HvdlikeInternalError(self._shutdown_reason())
        for state in self.process_sets.values():
            state.executor.finisher.close(self.config.gloo_timeout_seconds)
            for entry in state.controller.pending_entries() + state.queue.drain():
                self._complete(entry, None, reason)
        for state in self.process_sets.values():
            state.groups.close()
            state.executor.pool.clear()
        if self.health is not None:
            self.health.close(clean=self.fatal is None)
        if self.timeline is not None:
            from . import timeline

            timeline.stop(self)
        self._stopped.set()
