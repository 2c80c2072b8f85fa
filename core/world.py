"""The ranks one runtime runs on: every launched rank, or those ``init(comm=...)`` names.

Horovod's ``init(comm=...)`` takes either a list of ranks (of the launched job,
MPI's ``COMM_WORLD`` numbering) or an mpi4py communicator; the runtime then
runs on those processes only, numbered in the list's order (or the
communicator's), with its own local and cross ranks. Several disjoint lists
in one launch give independent runtimes.

:func:`parse` checks the argument. Under ``mpirun`` the members build their
communicator and bootstrap over it (:mod:`.mpi_bootstrap`); under any other
launcher :func:`narrow` renumbers the launched topology through the job's
store: each member publishes its host and the list it passed, waits for the
other members, and every member checks they all passed the same list.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
from typing import List, Optional

from . import store_wait
from .topology import Topology, topologies


@dataclasses.dataclass(frozen=True)
class World:
    """What ``init(comm=...)`` asked for: launched ranks (in order) or a communicator."""

    ranks: Optional[List[int]] = None
    comm: object = None

    def tag(self) -> str:
        """A store namespace for this list: disjoint lists never share keys."""
        digest = hashlib.sha256(json.dumps(sorted(self.ranks)).encode()).hexdigest()[:16]
        return f"world-{digest}/"


def is_mpi_comm(value) -> bool:
    """Whether ``value`` is an mpi4py communicator (without importing mpi4py)."""
    module = type(value).__module__ or ""
    return module.startswith("mpi4py") and hasattr(value, "Get_group")


def parse(comm) -> Optional[World]:
    """``init``'s ``comm`` argument as a :class:`World` (None: every launched rank).

    Raises:
        TypeError: not None, a list of ranks or an mpi4py communicator.
        ValueError: a list that is empty, repeats a rank or holds a negative one.
    """
    if comm is None:
        return None
    if is_mpi_comm(comm):
        return World(comm=comm)
    if isinstance(comm, (str, bytes, dict)) or not hasattr(comm, "__iter__"):
        raise TypeError(f"init: comm must be a list of ranks or an mpi4py communicator, "
                        f"got {type(comm).__name__}")
    ranks = rank_list(comm, "init: comm must list non-negative integer ranks")
    if not ranks:
        return None  # Horovod: an empty list means every rank
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"init: comm lists a rank more than once: {ranks}")
    return World(ranks=ranks)


def rank_list(given, what: str) -> List[int]:
    """``given``'s items as ranks: any integer type (numpy's too), never a bool.

    Raises:
        ValueError: ``what``, naming the first item that is not a rank >= 0.
    """
    given = list(given)
    ranks = []
    for r in given:
        try:
            index = None if isinstance(r, bool) else operator.index(r)
        except TypeError:
            index = None
        if index is None or index < 0:
            raise ValueError(f"{what}, got {r!r} ({type(r).__name__}) in {given!r}")
        ranks.append(index)
    return ranks


def check_member(world: World, launched: Topology) -> None:
    """Raise ``ValueError`` unless this process is one of ``world``'s ranks."""
    bad = [r for r in world.ranks if r >= launched.size]
    if bad:
        raise ValueError(f"init: comm={world.ranks} names rank(s) {bad}, but the job was "
                         f"launched with {launched.size} rank(s)")
    if launched.rank not in world.ranks:
        raise ValueError(f"init: comm={world.ranks} does not include this process (rank "
                         f"{launched.rank} of the launched job); only the listed ranks "
                         f"call init with it")


def _choice_key(rank: int) -> str:
    return f"world-choice/{rank}"


def host_record(rank: int) -> str:
    """The key, below the runtime's generation prefix, of launched rank ``rank``'s
    host record (written by :func:`narrow`; the runtime deletes it with the
    generation's other keys)."""
    return f"host/{rank}"


def narrow(store, world: World, launched: Topology, generation: int,
           timeout_seconds: float) -> Topology:
    """This process's topology among ``world.ranks`` (collective over those ranks).

    ``store`` is a connection to the launched job's store (no prefix). Each
    member publishes its host and list; a member that passed another list is
    named as soon as its choice is seen, one that never calls ``init`` at the
    timeout.

    Raises:
        ValueError: the members passed different lists (raised on each of them).
        HvdlikeInternalError: a member did not arrive within ``timeout_seconds``.
    """
    check_member(world, launched)
    ranks = world.ranks
    tag = f"{world.tag()}gen{generation}/"
    record = json.dumps({"host": launched.hostname, "ranks": ranks})
    store.set(tag + host_record(launched.rank), record)
    store.set(_choice_key(launched.rank), json.dumps({"generation": generation,
                                                      "ranks": ranks}))

    def elsewhere(late):
        for r in late:
            if not store.check([_choice_key(r)]):
                continue
            choice = json.loads(store.get(_choice_key(r)))
            if choice["generation"] == generation and sorted(choice["ranks"]) != sorted(ranks):
                raise ValueError(f"init: rank {r} called init(comm={choice['ranks']}), this "
                                 f"rank init(comm={ranks}); every listed rank must pass the "
                                 f"same list")
        return ""

    others = [r for r in ranks if r != launched.rank]
    store_wait.await_keys(store, [tag + host_record(r) for r in others], others,
                          timeout_seconds, lambda: None, elsewhere,
                          f"the runtime of ranks {ranks} (init(comm=...))")
    records = {r: json.loads(store.get(tag + host_record(r))) for r in others}
    for r in others:
        if records[r]["ranks"] != ranks:
            raise ValueError(f"init: rank {r} called init(comm={records[r]['ranks']}), this rank "
                             f"init(comm={ranks}); the order numbers the ranks, so it must "
                             f"be the same everywhere")
    records[launched.rank] = {"host": launched.hostname}
    hosts = [records[r]["host"] for r in ranks]
    return topologies(hosts)[ranks.index(launched.rank)]


def _comm_ranks(comm, base) -> Optional[List[int]]:
    """``comm``'s processes as ranks of ``base`` (sorted); None for ``COMM_NULL``.

    Raises:
        ValueError: ``comm`` holds a process outside ``base``.
    """
    from mpi4py import MPI

    if comm == MPI.COMM_NULL:
        return None
    group, whole = comm.Get_group(), base.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), whole)
    finally:
        group.Free()
        whole.Free()
    if any(r == MPI.UNDEFINED for r in ranks):
        raise ValueError("its communicator holds processes outside the job's")
    return sorted(ranks)


def resolve_comm_sets(psets: list, base, why_not: str, control) -> list:
    """The process sets ``init`` registers when some are made from communicators.

    Collective over the job (one gather and one broadcast on ``control``, the
    global set's negotiation plane). Each rank translates its communicators to
    job ranks; position by position, the sets of every rank's communicators
    are registered (sorted by ranks, before the sets given as lists, the order
    Horovod gives them ids). A communicator's :class:`ProcessSet` gets its
    ``ranks`` here and its id once the sets are registered.

    Args:
        psets: ``init``'s list (sets of ranks and of communicators).
        base: the job's communicator (None: the job was not started by mpirun).
        why_not: what to say when ``base`` is None.

    Returns:
        ``(ranks, id it had or None)`` of the communicators' sets, the same on
        every rank; they are registered before the sets given as lists.

    Raises:
        ValueError: on every rank, when a rank cannot translate a communicator
            or the ranks passed different numbers of them.
    """
    import pickle

    # By their communicator (ranks are set once registered, also before a re-init).
    from_comms = [p for p in psets if getattr(p, "mpi_comm", None) is not None]
    error, mine = "", []
    for index, pset in enumerate(psets):
        if getattr(pset, "mpi_comm", None) is None:
            continue
        if base is None:
            error = f"process_sets[{index}] is made from an MPI communicator, but {why_not}"
            break
        try:
            # With the id it had: a re-init after shutdown() keeps it, as listed sets do.
            mine.append((_comm_ranks(pset.mpi_comm, base), pset.process_set_id))
        except ValueError as exc:
            error = f"process_sets[{index}]: {exc}"
            break
    gathered = control.gather(pickle.dumps((error, mine)))
    decided = None
    if gathered is not None:
        reports = [pickle.loads(g) for g in gathered]
        errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(reports) if e]
        counts = [len(m) for _, m in reports]
        if errors:
            decided = ("init: " + "; ".join(errors), None)
        elif any(c != counts[0] for c in counts):
            decided = ("init: every rank must pass as many communicator process sets; "
                       "they passed " + ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts)),
                       None)
        else:
            union = []
            for position in range(counts[0]):
                seen: dict = {}
                for _, m in reports:
                    ranks, had = m[position]
                    if ranks is not None and seen.get(tuple(ranks)) is None:
                        seen[tuple(ranks)] = had
                union.extend(sorted(seen.items()))
            decided = ("", union)
    verdict, union = pickle.loads(control.broadcast(pickle.dumps(decided)))
    if verdict:
        raise ValueError(verdict)
    for pset, (ranks, _) in zip(from_comms, mine):
        pset.ranks = ranks
    return [(list(t), had) for t, had in union]


def regroup(store, prefix: str, topo: Topology, node: int, timeout_seconds: float,
            abandon, gone) -> Topology:
    """``topo`` with its cross rank and size taken from every rank's ``node``.

    torchrun says which node a rank runs on (``GROUP_RANK``) and how many ranks
    run there, but not how many run on the other nodes; with different
    ``--nproc-per-node`` values Horovod's cross rank (this node's index among
    the nodes that have a rank with this local rank) needs them all.
    """
    if topo.size < 2:
        return topo
    nodes = store_wait.gather(store, f"{prefix}nodes/", topo.rank, topo.size, node,
                              lambda every: every, timeout_seconds, abandon, gone,
                              "the exchange of each rank's node (torchrun's GROUP_RANK)")
    placed = topologies([str(n) for n in nodes])[topo.rank]
    return dataclasses.replace(topo, cross_rank=placed.cross_rank, cross_size=placed.cross_size)
