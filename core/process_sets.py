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

# The number of the newest runtime's registrations in this process. Ids start
# at 1 again in every runtime, so an id alone cannot tell whether an object
# kept across shutdown()/init() still names the set it was given for; the
# number it was given under can, and checking it costs one comparison.
_generation = 0


def open_registrations() -> None:
    """Start a new runtime's registrations: ids given from now on belong to it,
    and objects holding an id of an earlier runtime are refused until registered again."""
    global _generation
    _generation += 1


class _Registration:
    """An id given to a set by one runtime, shared by every object registered
    with it (equal static sets), so that removing one invalidates them all."""

    __slots__ = ("set_id", "generation")

    def __init__(self, set_id: int):
        self.set_id: Optional[int] = set_id
        self.generation = _generation


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

    _registration: Optional[_Registration] = None  # see process_set_id

    def __init__(self, ranks_or_comm: Sequence[int]):
        self._registration = None
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

    @property
    def process_set_id(self) -> Optional[int]:
        """The id this set was registered with, else None."""
        registration = self._registration
        return None if registration is None else registration.set_id

    @process_set_id.setter
    def process_set_id(self, set_id: Optional[int]) -> None:
        """Record an id given by the newest runtime (None: not registered).

        Giving an object the id it already holds -- a set passed to ``init()``
        again keeps its id -- renews its registration for the new runtime,
        together with every object sharing it.
        """
        registration = self._registration
        if set_id is None:
            self._registration = None
        elif registration is not None and registration.set_id == set_id:
            registration.generation = _generation
        else:
            self._registration = _Registration(set_id)

    def _live_id(self) -> Optional[int]:
        """The id in the live runtime; None while not registered there (never,
        removed, or only by an earlier runtime). Runs on every collective."""
        registration = self._registration
        if registration is None or registration.generation != _generation:
            return None
        return registration.set_id

    def _checked_id(self) -> Optional[int]:
        """:meth:`_live_id`, refusing an id an earlier runtime gave.

        Raises:
            ValueError: the id was given by an earlier runtime.
        """
        set_id = self._live_id()
        if set_id is None and self.process_set_id is not None:
            raise ValueError(_stale_message(self))
        return set_id

    def __repr__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __str__ = __repr__

    def size(self) -> Optional[int]:
        """Number of ranks in the set; None while it is not registered."""
        set_id = self._checked_id()
        if set_id is None:
            return None
        return len(current.require().sets.ranks_of(set_id))

    def rank(self) -> Optional[int]:
        """This process's rank within the set; None while it is not registered.

        Collectives still take *global* ranks (``broadcast(root_rank=...)``);
        this relative rank indexes results such as an allgather's rows.

        Raises:
            ValueError: this process is not a member of the set, or the set was
                registered by an earlier runtime.
        """
        set_id = self._checked_id()
        if set_id is None:
            return None
        runtime = current.require()
        ranks = runtime.sets.ranks_of(set_id)
        me = runtime.topology.rank
        if me not in ranks:
            raise ValueError(f"rank {me} is not a member of {self!r}")
        return ranks.index(me)

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set (None before ``init()`` for the global
        set, and for a communicator's set until it is registered).

        As in Horovod it answers from the set's ranks, registered or not, and
        needs ``init()`` (``NotInitializedError``, a ``ValueError``, before it).
        """
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
        self._registration = None
        self.mpi_comm = None

    @property
    def process_set_id(self) -> int:
        """Always 0: every runtime has the global set."""
        return 0

    def _live_id(self) -> int:
        """0 in every runtime."""
        return 0

    @property
    def ranks(self) -> List[int]:
        runtime = current.get()
        return [] if runtime is None else list(range(runtime.topology.size))


global_process_set = _GlobalProcessSet()


def _stale_message(pset: ProcessSet) -> str:
    """Why a set registered by an earlier runtime is refused, and what its id is now."""
    set_id = pset.process_set_id
    runtime = current.get()
    now = None if runtime is None or runtime.sets is None else runtime.sets.ranks.get(set_id)
    meaning = (f"process set {set_id} is now ranks {now}" if now is not None
               else f"process set {set_id} is not registered now")
    return (f"{pset!r} was registered before the last init() (ids start again at every "
            f"init(); {meaning}): pass it to init(process_sets=[...]) or add_process_set() "
            f"again")


def live_id(pset: ProcessSet) -> Optional[int]:
    """The id ``pset`` has in the live runtime; None when not registered there
    (never, removed, or only by an earlier runtime)."""
    return pset._live_id()


def share_id(alias: ProcessSet, registered: ProcessSet) -> None:
    """Give ``alias`` (a set equal to ``registered``) its registration, so that
    they stay valid, or are invalidated, together."""
    alias._registration = registered._registration


def drop_id(pset: Optional[ProcessSet]) -> None:
    """Unregister ``pset`` and every object sharing its id (after a removal)."""
    if pset is None or pset._registration is None:
        return
    pset._registration.set_id = None
    pset._registration = None


def resolve(process_set) -> int:
    """The id a collective's ``process_set=`` argument refers to."""
    if process_set is None:
        return 0
    if isinstance(process_set, ProcessSet):
        set_id = process_set._live_id()
        if set_id is None:
            process_set._checked_id()  # an id of an earlier runtime: say so
            raise ValueError(f"{process_set!r} is not registered: pass it to "
                             f"init(process_sets=[...]) or add_process_set() first")
        return set_id
    raise TypeError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")


def _as_process_set(argument):
    """``(ProcessSet, None)`` for ``add_process_set``'s argument, or ``(None, the
    error)`` when it is not a valid list of ranks."""
    if isinstance(argument, ProcessSet):
        return argument, None
    try:
        return ProcessSet(argument), None
    except Exception as exc:  # noqa: BLE001 - an iterable that raises anything: told to all
        if not isinstance(exc, (TypeError, ValueError)):
            exc = ValueError(f"the ranks could not be read: {type(exc).__name__}: {exc}")
        return None, exc


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
        ValueError: on every rank, when the ranks differ across ranks, or any
            rank passed ranks out of range, no ranks, or an object already
            registered; or a set with the same ranks is already registered.
        TypeError: on a rank whose argument is not a list of ranks (the
            others raise ``ValueError`` naming it).

    Example:
        >>> hvd.init(process_sets="dynamic")
        >>> odd = hvd.add_process_set([1, 3])
    """
    sets = current.require().sets
    pset, invalid = _as_process_set(process_set)
    if invalid is not None:
        # The other ranks are entering the exchange: take part, so they raise too.
        sets.refuse_add(process_set, invalid)
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
