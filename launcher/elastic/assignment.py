"""Who is which rank in the next generation (pure functions).

Members of a generation are processes, each pinned to a *slot* (a host and a
slot index on it) for its whole life. The next generation keeps every surviving
process whose slot is still usable, in its old rank order -- so rank 0 stays on
the oldest surviving host and a survivor never moves -- and then adds new
processes on free slots, host by host in discovery order, up to ``max_np``.
"""

from __future__ import annotations

import dataclasses
from typing import AbstractSet, Dict, List, Sequence, Set, Tuple

from hvdlike.core.mpi_bootstrap import topologies

from ..hosts import HostSlots, RankPlacement


@dataclasses.dataclass(frozen=True)
class Slot:
    host: str
    index: int


@dataclasses.dataclass(frozen=True)
class Member:
    """One process in a generation."""

    worker: str  # stable id of the process
    slot: Slot
    new: bool  # started for this generation


def usable_slots(hosts: Sequence[HostSlots]) -> List[Slot]:
    return [Slot(h.host, i) for h in hosts for i in range(h.slots)]


def assign(survivors: Sequence[Tuple[str, Slot]], hosts: Sequence[HostSlots], max_np: int,
           new_worker_ids, excluded: AbstractSet[Slot] = frozenset()) -> List[Member]:
    """The members of the next generation, in rank order.

    Args:
        survivors: ``(worker, slot)`` of live processes, in their current rank order.
        hosts: usable hosts (discovered, not blacklisted), in discovery order.
        max_np: most ranks allowed.
        new_worker_ids: iterator of ids for processes to start.
        excluded: slots not to use, on hosts that are (a process there never
            started up, while others on its host did).

    Example:
        >>> ids = iter(["w3", "w4"])
        >>> [m.worker for m in assign([("w1", Slot("b", 0))], [HostSlots("a", 1),
        ...     HostSlots("b", 1)], 4, ids)]
        ['w1', 'w3']
    """
    usable = [slot for slot in usable_slots(hosts) if slot not in excluded]
    allowed: Set[Slot] = set(usable)
    kept = [Member(worker, slot, False) for worker, slot in survivors if slot in allowed][:max_np]
    taken = {m.slot for m in kept}
    members = list(kept)
    for slot in usable:
        if len(members) >= max_np:
            break
        if slot not in taken:
            members.append(Member(next(new_worker_ids), slot, True))
            taken.add(slot)
    return members


def placements(members: Sequence[Member]) -> Dict[str, RankPlacement]:
    """Every member's host and Horovod topology, by worker id."""
    hosts = [m.slot.host for m in members]
    return {m.worker: RankPlacement(m.slot.host, topo)
            for m, topo in zip(members, topologies(hosts))}
