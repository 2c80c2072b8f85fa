"""What one process set runs on a member rank: queue, groups, controller, executor.

Built once, with every collaborator passed in (nothing is attached later):
the runtime's completion hooks, its live settings and its timeline slot. The
groups rendezvous while it is built, so every member builds the set at the
same point of the protocol (see :mod:`hvdlike.core.registry`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from . import store_wait
from .controller import Controller
from .executor import CompletionHooks, Executor
from .tensor_queue import TensorQueue
from .store_wait import Watch
from .transport import GlooControlPlane, Groups


class SetParts:
    """What every process set of one runtime is built with.

    Attributes:
        rank: this process's global rank.
        store: the runtime's store (each set works under its own prefix).
        cfg: the runtime's :class:`~hvdlike.core.config.Config`.
        local_addr: the address Gloo binds to.
        engines: ``(negotiation, CPU tensors)``, see ``mpi_plane.choose``.
        mpi_world: the runtime's duplicate of COMM_WORLD when MPI is used.
        shm: ``shm_plane.Settings`` when ranks of this host may share memory.
        hooks: where executors hand results (:class:`CompletionHooks`).
        settings: the runtime's live settings (``autotune.LiveSettings``).
        recording: the runtime's timeline slot (``timeline.Recording``).
        abandon: returns the runtime's fatal error, if any (the MPI control
            plane stops polling once the job has failed).
        watch: makes a probe naming ranks that are gone, for the waits while a
            set is built (see :mod:`.store_wait`).
        host: this rank's host key (hierarchical Adasum groups members by it).
    """

    def __init__(self, rank: int, store, cfg, local_addr: str, engines, mpi_world, shm,
                 hooks: CompletionHooks, settings, recording,
                 abandon: Callable[[], Optional[BaseException]],
                 watch: Watch = store_wait.no_watch, host: str = ""):
        self.rank = rank
        self.store = store
        self.cfg = cfg
        self.local_addr = local_addr
        self.engines = engines
        self.mpi_world = mpi_world
        self.shm = shm
        self.host = host
        self.hooks = hooks
        self.settings = settings
        self.recording = recording
        self.abandon = abandon
        self.watch = watch


class ProcessSetState:
    """Everything one process set needs on a member rank.

    Args:
        set_id: the set's id (0: the global set).
        ranks: its global ranks, sorted.
        parts: the runtime's :class:`SetParts`.
    """

    def __init__(self, set_id: int, ranks: Sequence[int], parts: SetParts):
        import torch.distributed as dist

        self.id = set_id
        self.ranks = list(ranks)
        self.rank = self.ranks.index(parts.rank)
        self.size = len(self.ranks)
        self.queue = TensorQueue()
        controller_engine, cpu_engine = parts.engines
        self.groups = Groups(dist.PrefixStore(f"ps{set_id}/", parts.store), self.rank,
                             self.size, parts.cfg.gloo_timeout_seconds, parts.local_addr,
                             gloo_control=controller_engine == "gloo", abandon=parts.abandon,
                             members=self.ranks, watch=parts.watch)
        try:
            control = (GlooControlPlane(self.groups.control, self.rank, self.size)
                       if controller_engine == "gloo" else None)
            if "mpi" in parts.engines:
                from . import mpi_plane

                comm = mpi_plane.set_comm(parts.mpi_world, self.ranks, set_id)
                if cpu_engine == "mpi":
                    self.groups.cpu_plane = mpi_plane.MpiDataGroup(
                        comm.Dup(), lambda: self.groups.torch_group("cpu"))
                if control is None:
                    control = mpi_plane.MpiControlPlane(comm, self.rank, self.size,
                                                        parts.abandon)
                    self.groups.closers.append(control.close)
                else:
                    mpi_plane.free(comm)  # only its duplicate (the data plane) is used
            if parts.shm is not None and self.size > 1 and "gloo" in parts.engines:
                from . import shm_hierarchy, shm_plane

                def gloo():
                    return self.groups.torch_group("cpu")

                def across_hosts(store, layout):
                    return shm_hierarchy.build(parts.shm, store, self.rank, self.ranks, layout,
                                               gloo, parts.abandon, self.groups.subgroup,
                                               parts.watch)

                data, shm_control = shm_plane.for_set(
                    parts.shm, self.groups.store, self.rank, self.ranks, gloo, parts.abandon,
                    data=cpu_engine == "gloo", control=controller_engine == "gloo",
                    across_hosts=across_hosts, watch=parts.watch)
                if data is not None:
                    self.groups.cpu_plane = data
                if shm_control is not None:
                    control = shm_control
                    self.groups.closers.append(control.close)
        except BaseException:
            self.groups.close()
            raise
        self.controller = Controller(control, parts.cfg.cache_capacity,
                                     parts.recording.recording, self.ranks)
        self.executor = Executor(self.groups, self.rank, self.size, parts.settings,
                                 parts.hooks, parts.recording, parts.host,
                                 parts.cfg.adasum_hierarchical, self.ranks)
        self.controller.speculate = self.executor.offer
        self._closed = False

    def start(self) -> None:
        """Start the set's completion thread."""
        self.executor.start()

    def close(self, timeout: float = 5.0) -> None:
        """Finish launched work, then free the groups (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.executor.close(timeout)
        self.groups.close()
