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
from .errors import HvdlikeInternalError, NotInitializedError
from .executor import Executor
from .handles import Handle
from .log import configure as configure_logging, logger
from .tensor_queue import Entry, TensorQueue
from .transport import GlooControlPlane, Groups

_generation = 0  # init() count in this process; names store keys of each init apart
_generation_lock = threading.Lock()


class ProcessSetState:
    """Everything one process set needs on a member rank."""

    def __init__(self, set_id: int, ranks: Sequence[int], global_rank: int, store, cfg,
                 local_addr: str, complete, on_fatal):
        self.id = set_id
        self.ranks = list(ranks)
        self.rank = self.ranks.index(global_rank)
        self.size = len(self.ranks)
        self.queue = TensorQueue()
        import torch.distributed as dist

        self.groups = Groups(dist.PrefixStore(f"ps{set_id}/", store), self.rank, self.size,
                             cfg.gloo_timeout_seconds, local_addr)
        self.controller = Controller(GlooControlPlane(self.groups.control, self.rank, self.size),
                                     cfg.cache_capacity)
        self.executor = Executor(self.groups, self.rank, self.size, cfg.fusion_threshold,
                                 complete, on_fatal)

    def close(self) -> None:
        self.executor.close()
        self.groups.close()


class Runtime:
    """A live hvdlike job in this process."""

    def __init__(self, cfg: config_mod.Config, topology: bootstrap.Topology,
                 rendezvous: bootstrap.Rendezvous):
        self.config = cfg
        self.topology = topology
        self.rendezvous = rendezvous
        self.process_sets: Dict[int, ProcessSetState] = {}
        self.fatal: Optional[BaseException] = None
        self._stopping = False
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._name_counters: Dict[str, int] = {}
        self._name_lock = threading.Lock()
        self._next_set_id = 1
        self.store = None

    # -- life cycle --------------------------------------------------------------

    @classmethod
    def start(cls, environ: Optional[Mapping[str, str]] = None, **overrides) -> "Runtime":
        """Bootstrap from ``environ`` and start the background thread."""
        global _generation
        environ = os.environ if environ is None else environ
        cfg = config_mod.load(environ, **overrides)
        topology, rendezvous = bootstrap.detect(environ)
        configure_logging(cfg.log_level_number, topology.rank)
        runtime = cls(cfg, topology, rendezvous)
        with _generation_lock:
            _generation += 1
            generation = _generation
        import torch.distributed as dist

        base = bootstrap.connect_store(topology, rendezvous, cfg.start_timeout)
        runtime.store = dist.PrefixStore(f"gen{generation}/", base)
        local_addr = rendezvous.gloo_iface
        if not local_addr:
            local_addr = (bootstrap.local_address_towards(rendezvous.addr, rendezvous.port)
                          if rendezvous.addr else "127.0.0.1")
        runtime.local_addr = local_addr
        try:
            runtime.add_process_set(0, range(topology.size))
        except Exception as exc:
            raise HvdlikeInternalError(
                f"rank {topology.rank} could not connect to the other {topology.size - 1} "
                f"rank(s) (Gloo on {local_addr or 'default interface'}): {exc}") from None
        if topology.rank == 0:
            logger.info("hvdlike started: %d rank(s), launcher %s, settings:\n%s",
                        topology.size, rendezvous.launcher, cfg.describe())
        runtime._thread = threading.Thread(target=runtime._loop, name="hvdlike-background",
                                           daemon=True)
        runtime._thread.start()
        return runtime

    def add_process_set(self, set_id: int, ranks: Sequence[int]) -> Optional[ProcessSetState]:
        """Create the groups of a process set; a no-op (None) on non-member ranks."""
        ranks = list(ranks)
        if self.topology.rank not in ranks:
            return None
        state = ProcessSetState(set_id, ranks, self.topology.rank, self.store, self.config,
                                self.local_addr, self._complete, self._set_fatal)
        self.process_sets[set_id] = state
        return state

    def register_process_set(self, pset) -> int:
        """Give ``pset`` the next id and build its groups on member ranks."""
        with self._name_lock:
            set_id = self._next_set_id
            self._next_set_id += 1
        size = self.topology.size
        bad = [r for r in pset.ranks if not 0 <= r < size]
        if bad or not pset.ranks:
            raise ValueError(f"process set ranks {pset.ranks} must be a non-empty subset of "
                             f"0..{size - 1}")
        self.add_process_set(set_id, pset.ranks)
        pset.process_set_id = set_id
        return set_id

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop negotiating (every rank stops), fail what is pending, free everything."""
        self._stopping = True
        for state in list(self.process_sets.values()):
            state.queue.wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            limit = timeout if timeout is not None else self.config.gloo_timeout_seconds + 5
            self._thread.join(limit)
        self._stopped.wait(1.0)

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

    def auto_name(self, op: str) -> str:
        """Names for unnamed collectives: per-op counters agree across ranks."""
        with self._name_lock:
            n = self._name_counters.get(op, 0)
            self._name_counters[op] = n + 1
        return f"{op}.noname.{n}"

    def process_set(self, set_id: int) -> ProcessSetState:
        state = self.process_sets.get(set_id)
        if state is None:
            raise ValueError(
                f"rank {self.topology.rank} is not a member of process set {set_id} "
                f"(or the set does not exist)")
        return state

    def submit(self, entries: List[Entry], set_id: int = 0) -> List[Handle]:
        """Hand entries to the background thread; return their handles."""
        error = self.alive_error()
        if error is not None or self._stopping:
            raise HvdlikeInternalError(
                f"cannot submit {entries[0].request.name!r}: "
                f"{error or 'hvdlike is shutting down'}")
        state = self.process_set(set_id)
        now = time.monotonic()
        for entry in entries:
            entry.enqueued_at = now
            entry.set_id = set_id
            entry.request = dataclasses.replace(entry.request, rank=state.rank)
        state.queue.put(entries)
        return [entry.handle for entry in entries]

    def wait(self, handle: Handle, timeout: Optional[float] = None):
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

    def _set_fatal(self, error: BaseException) -> None:
        if self.fatal is None:
            self.fatal = error
            logger.error("%s", error)

    def _loop(self) -> None:
        cycle_seconds = self.config.cycle_time / 1000.0
        try:
            while self.fatal is None:
                started = time.monotonic()
                if self._cycle_all():
                    break
                remaining = cycle_seconds - (time.monotonic() - started)
                if remaining > 0:
                    self.process_sets[0].queue.wakeup.wait(remaining)
        except BaseException as exc:
            self._set_fatal(HvdlikeInternalError(
                f"rank {self.topology.rank}: negotiation with the other ranks failed "
                f"(a peer may have died or stopped): {exc}"))
        finally:
            self._teardown()

    def _cycle_all(self) -> bool:
        """One cycle over every process set; True once the job shuts down."""
        for set_id in sorted(self.process_sets):
            state = self.process_sets[set_id]
            result = state.controller.cycle(state.queue.drain(), shutdown=self._stopping)
            if result.shutdown:
                return True
            state.executor.execute(result.work)
        return False

    def _teardown(self) -> None:
        reason = self.fatal or HvdlikeInternalError(
            "hvdlike was shut down before this collective completed")
        for state in self.process_sets.values():
            state.executor.finisher.close(self.config.gloo_timeout_seconds)
            for entry in state.controller.pending_entries() + state.queue.drain():
                self._complete(entry, None, reason)
        for state in self.process_sets.values():
            state.groups.close()
            state.executor.pool.clear()
        self._stopped.set()
