"""Certain deadlocks: ranks that all wait on collectives none of which can complete.

When the ranks' programs diverge -- one raised and moved on to its next
collective while another still waits on the previous one -- every rank ends up
blocked in a wait on a name some other (equally blocked) rank never submitted.
Nothing can change that but the ranks' own threads, and none of them runs.
Horovod only warns about such a stall; hvdlike fails every rank with an error
naming what each one waits for, after ``HVDLIKE_DEADLOCK_TIME_SECONDS``.

Two parts, both without communication:

* :class:`Waits` -- on every rank, whether a user thread has been blocked in a
  wait, and since when; the health watcher combines it with the pending names
  to tell how long the rank has been *stuck*: blocked, with nothing submitted
  or completed since.
* :func:`find_deadlock` -- on rank 0, given what every stuck rank has pending,
  the ranks that can never proceed (unit-tested with plain data).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

# (process set id, collective name, is it a join)
Pending = Tuple[int, str, bool]


class Waits:
    """How many user threads are blocked in a wait on this rank, and since when."""

    def __init__(self):
        self._lock = threading.Lock()
        self._count = 0
        self._since: Optional[float] = None

    def enter(self) -> None:
        with self._lock:
            self._count += 1
            if self._count == 1:
                self._since = time.monotonic()

    def leave(self) -> None:
        with self._lock:
            self._count -= 1
            if self._count == 0:
                self._since = None

    def blocked_since(self) -> Optional[float]:
        """Monotonic time since which some thread has been blocked without a break."""
        return self._since


class StuckClock:
    """On one rank: since when it has been blocked with its pending names unchanged.

    Fed once per health tick with the wait state and the pending names (and
    their submission times); any submission, completion or end of the wait
    restarts the clock.
    """

    def __init__(self):
        self._names: frozenset = frozenset()
        self._changed = 0.0

    def update(self, blocked_since: Optional[float], pending: Dict[tuple, float],
               now: float) -> Optional[float]:
        names = frozenset(pending)
        if names != self._names:
            self._names, self._changed = names, now
        if blocked_since is None or not pending:
            return None
        return max(blocked_since, self._changed, max(pending.values()))


def find_deadlock(stuck: Dict[int, Sequence[Pending]],
                  members: Callable[[int], List[int]]) -> Set[int]:
    """The ranks among ``stuck`` that can never proceed.

    Args:
        stuck: ``{rank: its pending collectives}`` for every rank that is
            blocked and has submitted or completed nothing for a while. Ranks
            not in it may still submit anything.
        members: global ranks of a process set, by id.

    A rank can proceed if one of its pending collectives can still complete:
    every member that has not submitted it (a joined member stands in for
    anything but a join) is a rank that is not stuck. Ranks that can proceed
    are dropped until none is left to drop; what remains waits only on ranks
    that wait on it. Returns that set (empty: no deadlock).
    """
    submitted: Dict[Tuple[int, str], Set[int]] = {}
    joined: Dict[int, Set[int]] = {}
    for rank, pending in stuck.items():
        for set_id, name, is_join in pending:
            submitted.setdefault((set_id, name), set()).add(rank)
            if is_join:
                joined.setdefault(set_id, set()).add(rank)

    def missing(set_id: int, name: str, is_join: bool) -> Set[int]:
        exempt = set() if is_join else joined.get(set_id, set())
        return set(members(set_id)) - submitted[(set_id, name)] - exempt

    blocked = set(stuck)
    changed = True
    while changed and blocked:
        changed = False
        for rank in sorted(blocked):
            if any(not (missing(*p) & blocked) for p in stuck[rank]):
                blocked.discard(rank)
                changed = True
    return blocked


def describe(ranks: Set[int], stuck: Dict[int, Sequence[Pending]],
             members: Callable[[int], List[int]], host: Callable[[int], str],
             seconds: float, deadline: float, limit: int = 4) -> str:
    """The error text: what each deadlocked rank waits for and who never sent it."""
    submitted: Dict[Tuple[int, str], Set[int]] = {}
    joined: Dict[int, Set[int]] = {}
    for rank in ranks:
        for set_id, name, is_join in stuck[rank]:
            submitted.setdefault((set_id, name), set()).add(rank)
            if is_join:
                joined.setdefault(set_id, set()).add(rank)
    lines = [f"deadlock: rank(s) {', '.join(map(str, sorted(ranks)))} have all waited "
             f"{seconds:.0f}s on collectives that none of them can complete: their programs "
             f"diverged (HVDLIKE_DEADLOCK_TIME_SECONDS={deadline:g}; 0 turns this check off)"]
    for rank in sorted(ranks):
        parts = []
        for set_id, name, is_join in stuck[rank][:limit]:
            others = [r for r in members(set_id) if r in ranks
                      and r not in submitted[(set_id, name)] and r not in joined.get(set_id, ())]
            label = f"{name!r}" + (f" (process set {set_id})" if set_id else "")
            if others and not is_join:
                label += f", not submitted by rank(s) {', '.join(map(str, others))}"
            parts.append(label)
        more = len(stuck[rank]) - limit
        if more > 0:
            parts.append(f"and {more} more")
        lines.append(f"  rank {rank} ({host(rank)}) waits for " + "; ".join(parts))
    if any(_OPTIMIZER_NAMES in name for rank in ranks for _, name, _ in stuck[rank]):
        lines.append(_OPTIMIZER_HINT)
    return "\n".join(lines)


# In the names of the torch front end's bucketed and unnamed gradient reductions:
# ranks stuck on different ones built different optimizers or models.
_OPTIMIZER_NAMES = "DistributedOptimizer."
_OPTIMIZER_HINT = (
    "  (the names are DistributedOptimizer's gradient reductions: the ranks' optimizers "
    "differ -- a different number or order of parameters, a parameter frozen "
    "(requires_grad=False) or added on some ranks only, an optimizer or a backward pass "
    "that only some ranks have)")
