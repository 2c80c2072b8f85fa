"""Process sets: subsets of ranks that negotiate and communicate on their own.

A :class:`ProcessSet` names some global ranks. Registered at ``init()`` (static
sets) or with :func:`add_process_set` while the job runs (dynamic sets, with
``HVDLIKE_DYNAMIC_PROCESS_SETS=1`` or ``init(process_sets="dynamic")``), it gets
an id, and its member ranks get their own negotiation and data-plane groups.
Collectives take it as ``process_set=``; ranks outside it must not call them.

This module holds the user-facing type and thin functions; the tables and the
registration protocol belong to the runtime's
:class:`~hvdlike.core.registry.ProcessSetRegistry`.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from . import current
from .errors import NotInitializedError
from .world import is_mpi_comm, rank_list


class ProcessSet:
    """A subset of the job's ranks; collectives take it as ``process_set=``.

    Args:
        ranks_or_comm: the global ranks in the set (any order; kept sorted),
            or an mpi4py communicator (a job started by mpirun, passed to
            ``init(process_sets=...)``): each rank passes its own, and the
            sets of every rank's communicators are registered.

    Attributes:
        process_set_id: the id once registered, else None.
        ranks: sorted global ranks (for a communicator: None until ``init()``).
        mpi_comm: the communicator it was made from, else None.

    Example:
        >>> even = hvd.ProcessSet([0, 2])
        >>> hvd.init(process_sets=[even])
        >>> if even.included():
        ...     hvd.allreduce(t, process_set=even)
    """

    def __init__(self, ranks_or_comm: Sequence[int]):
        self.process_set_id: Optional[int] = None
        if is_mpi_comm(ranks_or_comm):
            # Its ranks are known once init() registers it (see world.resolve_comm_sets).
            self.ranks: Optional[List[int]] = None
            self.mpi_comm = ranks_or_comm
            return
        if isinstance(ranks_or_comm, (str, bytes)) or not hasattr(ranks_or_comm, "__iter__"):
            raise TypeError("ProcessSet expects a list of global ranks, got "
                            f"{type(ranks_or_comm).__name__}")
        ranks = rank_list(ranks_or_comm, "ProcessSet ranks must be non-negative ints")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be unique, got {ranks}")
        self.ranks = sorted(ranks)
        self.mpi_comm = None

    def __repr__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __str__ = __repr__

    def size(self) -> Optional[int]:
        """Number of ranks in the set; None while it is not registered."""
        if self.process_set_id is None:
            return None
        return len(current.require().sets.ranks_of(self.process_set_id))

    def rank(self) -> Optional[int]:
        """This process's rank within the set; None while it is not registered.

        Collectives still take *global* ranks (``broadcast(root_rank=...)``);
        this relative rank indexes results such as an allgather's rows.

        Raises:
            ValueError: this process is not a member of the set.
        """
        if self.process_set_id is None:
            return None
        runtime = current.require()
        ranks = runtime.sets.ranks_of(self.process_set_id)
        me = runtime.topology.rank
        if me not in ranks:
            raise ValueError(f"rank {me} is not a member of {self!r}")
        return ranks.index(me)

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set (None before ``init()`` for the global
        set, and for a communicator's set until it is registered)."""
        if self.ranks is None:
            return None
        runtime = current.get()
        if runtime is None or runtime.alive_error() is not None:
            if self.process_set_id == 0:
                return None
            return current.require().topology.rank in self.ranks
        return runtime.topology.rank in self.ranks


class _GlobalProcessSet(ProcessSet):
    """The set of every rank (id 0); its ranks are those of the live runtime."""

    def __init__(self):
        self.process_set_id = 0
        self.mpi_comm = None

    @property
    def ranks(self) -> List[int]:
        runtime = current.get()
        return [] if runtime is None else list(range(runtime.topology.size))


global_process_set = _GlobalProcessSet()


def resolve(process_set) -> int:
    """The id a collective's ``process_set=`` argument refers to."""
    if process_set is None:
        return 0
    if isinstance(process_set, ProcessSet):
        if process_set.process_set_id is None:
            raise ValueError(f"{process_set!r} is not registered: pass it to "
                             f"init(process_sets=[...]) or add_process_set() first")
        return process_set.process_set_id
    raise TypeError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")


def add_process_set(process_set) -> ProcessSet:
    """Register a process set while the job runs; collective over all ranks.

    Every rank must call it with the same ranks, in the same order relative to
    other ``add_process_set``/``remove_process_set`` calls.

    Args:
        process_set: a :class:`ProcessSet` or a list of global ranks.

    Returns:
        The registered :class:`ProcessSet` (``process_set`` itself when one was given).

    Raises:
        HvdlikeError: dynamic process sets are not enabled.
        ValueError: the ranks differ across ranks, are out of range, or a set
            with the same ranks is already registered.

    Example:
        >>> hvd.init(process_sets="dynamic")
        >>> odd = hvd.add_process_set([1, 3])
    """
    sets = current.require().sets
    pset = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if pset.ranks is None:
        raise NotImplementedError(
            "add_process_set: a process set made from an MPI communicator can only be "
            "registered by init(process_sets=[...]); pass its list of ranks here")
    return sets.add(pset)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set; collective over all ranks.

    Collectives still pending on the set fail with ``HvdlikeInternalError``.

    Returns:
        True when the set was removed; False for the global set or a set that
        is not registered.

    Raises:
        HvdlikeError: dynamic process sets are not enabled.
        ValueError: ranks asked to remove different sets.
    """
    sets = current.require().sets
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"remove_process_set expects a ProcessSet, got "
                        f"{type(process_set).__name__}")
    return sets.remove(process_set)


__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set",
           "NotInitializedError"]
