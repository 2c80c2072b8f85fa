"""Process sets: subsets of ranks that negotiate and communicate on their own.

A :class:`ProcessSet` names some global ranks. Registered at ``init()`` (static
sets) or with :func:`add_process_set` while the job runs (dynamic sets, with
``HVDLIKE_DYNAMIC_PROCESS_SETS=1`` or ``init(process_sets="dynamic")``), it gets
an id, and its member ranks get their own negotiation and data-plane groups.
Collectives take it as ``process_set=``; ranks outside it must not call them.

Registration is collective over *all* ranks: every rank passes the same sets
in the same order. That is checked -- a rank that registers something else
makes every rank raise, never hang.

How a dynamic change takes effect: members build the new set's groups, then
every rank submits a barrier on the global set. The barrier's response comes
back in the same negotiation cycle everywhere, and the background thread
applies the change at the end of that cycle, so all members start (or stop)
cycling the set in the same cycle -- the lock-step their control collectives
need.
"""

from __future__ import annotations

import pickle
from typing import Any, Dict, List, Optional, Sequence

from .errors import HvdlikeError, NotInitializedError


class ProcessSet:
    """A subset of the job's ranks; collectives take it as ``process_set=``.

    Args:
        ranks_or_comm: the global ranks in the set (any order; kept sorted).
            An mpi4py communicator is not accepted: pass its ranks.

    Attributes:
        process_set_id: the id once registered, else None.
        ranks: sorted global ranks.
        mpi_comm: always None (kept for Horovod's ``repr``).

    Example:
        >>> even = hvd.ProcessSet([0, 2])
        >>> hvd.init(process_sets=[even])
        >>> if even.included():
        ...     hvd.allreduce(t, process_set=even)
    """

    def __init__(self, ranks_or_comm: Sequence[int]):
        if hasattr(ranks_or_comm, "Get_group"):
            raise NotImplementedError(
                "ProcessSet from an MPI communicator is not supported; pass the list of "
                "global ranks in it instead")
        if isinstance(ranks_or_comm, (str, bytes)) or not hasattr(ranks_or_comm, "__iter__"):
            raise TypeError("ProcessSet expects a list of global ranks, got "
                            f"{type(ranks_or_comm).__name__}")
        ranks = list(ranks_or_comm)
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
        if bad:
            raise ValueError(f"ProcessSet ranks must be non-negative ints, got {ranks}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be unique, got {ranks}")
        self.ranks: List[int] = sorted(ranks)
        self.process_set_id: Optional[int] = None
        self.mpi_comm = None

    def __repr__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __str__ = __repr__

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> Optional[int]:
        """Number of ranks in the set; None while it is not registered."""
        if self.process_set_id is None:
            return None
        return len(_registered_ranks(self.process_set_id))

    def rank(self) -> Optional[int]:
        """This process's rank within the set; None while it is not registered.

        Collectives still take *global* ranks (``broadcast(root_rank=...)``);
        this relative rank indexes results such as an allgather's rows.

        Raises:
            ValueError: this process is not a member of the set.
        """
        if self.process_set_id is None:
            return None
        ranks = _registered_ranks(self.process_set_id)
        from . import api

        me = api.rank()
        if me not in ranks:
            raise ValueError(f"rank {me} is not a member of {self!r}")
        return ranks.index(me)

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set (None before ``init()`` for the global set)."""
        from . import api

        if not api.is_initialized():
            return None if self.process_set_id == 0 else api.rank() in self.ranks
        return api.rank() in self.ranks


def _registered_ranks(set_id: int) -> List[int]:
    from . import api

    ranks = api.runtime().set_ranks.get(set_id)
    if ranks is None:
        raise ValueError(f"process set {set_id} is not registered (it was removed)")
    return ranks


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


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


# -- registration --------------------------------------------------------------------


def _check_ranks(pset: ProcessSet, size: int, what: str) -> None:
    if not pset.ranks:
        raise ValueError(f"{what}: a process set needs at least one rank")
    bad = [r for r in pset.ranks if r >= size]
    if bad:
        raise ValueError(f"{what}: ranks {bad} of {pset!r} do not exist in a job of "
                         f"{size} rank(s)")


def _disagreement(what: str, values: List[Any]) -> Optional[str]:
    if all(v == values[0] for v in values[1:]):
        return None
    lines = [f"{what} must be called with the same process sets, in the same order, on "
             f"every rank; the ranks passed:"]
    lines += [f"  rank {r}: {v}" for r, v in enumerate(values)]
    return "\n".join(lines)


def register_static(runtime, psets: Sequence[ProcessSet]) -> None:
    """Register ``init(process_sets=...)`` before the background thread starts.

    Sets with the ranks of an earlier one (or of the whole job) share its id.

    Raises:
        TypeError: an element is not a :class:`ProcessSet`.
        ValueError: ranks out of range, or the ranks passed differ across ranks
            (raised on every rank).
    """
    size = runtime.topology.size
    for index, pset in enumerate(psets):
        if not isinstance(pset, ProcessSet):
            raise TypeError(f"init: process_sets[{index}] must be a ProcessSet, "
                            f"got {type(pset).__name__}")
        _check_ranks(pset, size, "init")
    mine = [list(p.ranks) for p in psets]
    control = runtime.process_sets[0].controller.control
    gathered = control.gather(pickle.dumps(mine))
    verdict = None
    if gathered is not None:
        verdict = _disagreement("init()", [pickle.loads(g) for g in gathered])
    verdict = pickle.loads(control.broadcast(pickle.dumps(verdict)))
    if verdict:
        raise ValueError(verdict)
    by_ranks: Dict[tuple, int] = {tuple(range(size)): 0}
    for pset in psets:
        key = tuple(pset.ranks)
        if key not in by_ranks:
            by_ranks[key] = runtime.next_set_id()
            runtime.add_process_set(by_ranks[key], pset.ranks)
        pset.process_set_id = by_ranks[key]


def _gather_everywhere(runtime, value: Any, name: str) -> List[Any]:
    """Every rank's ``value`` through the global set (works while the runtime runs)."""
    import torch

    from .collectives import allgather_entry

    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    length = torch.tensor([data.numel()], dtype=torch.int64)
    handles = runtime.submit([allgather_entry(length, f"{name}.size"),
                              allgather_entry(data, f"{name}.data")], 0)
    lengths, blob = [runtime.wait(h) for h in handles]
    out, start = [], 0
    for n in lengths.tolist():
        out.append(pickle.loads(blob[start:start + n].numpy().tobytes()))
        start += n
    return out


def _dynamic_runtime(what: str):
    from . import api

    runtime = api.runtime()
    if not runtime.config.dynamic_process_sets:
        raise HvdlikeError(
            f"{what} needs dynamic process sets: set HVDLIKE_DYNAMIC_PROCESS_SETS=1 (or "
            f"HOROVOD_DYNAMIC_PROCESS_SETS=1) or call init(process_sets='dynamic')")
    return runtime


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
    runtime = _dynamic_runtime("add_process_set")
    pset = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if pset.process_set_id is not None:
        raise ValueError(f"{pset!r} is already registered")
    _check_ranks(pset, runtime.topology.size, "add_process_set")
    with runtime.set_change_lock:
        serial = runtime.next_set_change()
        name = f"hvdlike.process_set.{serial}"
        verdict = _disagreement("add_process_set()",
                                _gather_everywhere(runtime, ("add", pset.ranks), name))
        if verdict:
            raise ValueError(verdict)
        if pset.ranks in runtime.set_ranks.values():
            raise ValueError(f"add_process_set: a process set with ranks {pset.ranks} is "
                             f"already registered")
        set_id = runtime.next_set_id()
        state = runtime.build_process_set(set_id, pset.ranks)
        runtime.change_process_sets(f"{name}.add",
                                    lambda: runtime.install_process_set(set_id, pset.ranks,
                                                                        state))
    pset.process_set_id = set_id
    return pset


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
    runtime = _dynamic_runtime("remove_process_set")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"remove_process_set expects a ProcessSet, got "
                        f"{type(process_set).__name__}")
    set_id = process_set.process_set_id
    with runtime.set_change_lock:
        serial = runtime.next_set_change()
        name = f"hvdlike.process_set.{serial}"
        verdict = _disagreement("remove_process_set()",
                                _gather_everywhere(runtime, ("remove", set_id), name))
        if verdict:
            raise ValueError(verdict)
        if set_id is None or set_id == 0 or set_id not in runtime.set_ranks:
            return False
        runtime.change_process_sets(f"{name}.remove",
                                    lambda: runtime.uninstall_process_set(set_id))
    process_set._invalidate()
    return True


__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set",
           "NotInitializedError"]
